// pdo/nn.hpp: layers, losses, optimizers and data-parallel training.
#pragma once

#include <pdo/nn/batching.hpp>
#include <pdo/nn/buckets.hpp>
#include <pdo/nn/data_parallel.hpp>
#include <pdo/nn/layers.hpp>
#include <pdo/nn/losses.hpp>
#include <pdo/nn/module.hpp>
#include <pdo/nn/optim.hpp>
#include <pdo/nn/tensor_parallel.hpp>
#include <pdo/nn/pipeline.hpp>
