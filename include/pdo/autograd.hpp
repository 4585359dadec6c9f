// pdo/autograd.hpp: reverse-mode autograd over pdo::tensor and pdo::dtensor (pdo::var, pdo::backward),
// parallel_do over vars.
#pragma once

#include <pdo/autograd/ops.hpp>
#include <pdo/autograd/variable.hpp>
#include <pdo/autograd/conv.hpp>
#include <pdo/autograd/collectives.hpp>
#include <pdo/autograd/parallel_do.hpp>
