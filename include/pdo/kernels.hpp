// pdo/kernels.hpp: the kernels CPU places run (Thrust elementwise, reductions, softmax, gemm).
#pragma once

#include <pdo/kernels/place_system.hpp>
#include <pdo/kernels/gemm.hpp>
#include <pdo/kernels/reduce.hpp>
#include <pdo/kernels/softmax.hpp>
