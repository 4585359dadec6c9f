// pdo/nn.hpp: layers, losses, optimizers and data-parallel training.
#pragma once

#include <pdo/nn/data_parallel.hpp>
#include <pdo/nn/layers.hpp>
#include <pdo/nn/module.hpp>
#include <pdo/nn/optim.hpp>
#include <pdo/nn/tensor_parallel.hpp>
#include <pdo/nn/pipeline.hpp>
