// pdo/tensor.hpp: the tensor layer (tensor, dtensor, copies, writing a tensor to a stream, what each place does in a redistribution).
#pragma once

#include <pdo/tensor/copy.hpp>
#include <pdo/tensor/dtensor.hpp>
#include <pdo/tensor/print.hpp>
#include <pdo/tensor/redistribute.hpp>
#include <pdo/tensor/tensor.hpp>
