// pdo/expr.hpp: the expression layer (elementwise ops, matmul, reductions, softmax, losses, reshapes).
#pragma once

#include <pdo/expr/cross_entropy_grad.hpp>
#include <pdo/expr/operators.hpp>
