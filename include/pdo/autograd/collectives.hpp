// pdo/autograd/collectives.hpp: collectives on pdo::var inside SPMD code (an spmd task, a
// pipeline stage), each with its backward rule: Megatron's two conjugate operators.
//
// On dtensors the planner inserts these collectives itself (see pdo/nn/tensor_parallel.hpp);
// code that runs on one place of a group, holding local tensors, says where they go.
#pragma once

#include <pdo/autograd/variable.hpp>
#include <pdo/comm/mesh_comms.hpp>

#include <cstddef>
#include <utility>

namespace pdo {

/// @brief The sum over the members of `group` of their `x` (every member of the group calls
/// it, in the same order as its other collectives; each passes its addend). The gradient
/// of each addend is the gradient of the sum, so backward moves no data (Megatron's g).
template <class T, std::size_t R>
var<tensor<T, R>> sum_across(const var<tensor<T, R>>& x, const mesh_communicator& group) {
  tensor<T, R> y = x.value();
  group.all_reduce(y.span());
  return detail::record(
      std::move(y), [x](detail::value_node<tensor<T, R>>& self) { detail::add_grad(x, std::move(*self.grad)); }, x);
}

/// @brief `x`, the same value on every member of `group`, used by each member for its own
/// part of the work (its shard of a column-parallel layer): forward moves no data; the
/// gradient of `x` is the sum of the members' gradients, all_reduced in backward (Megatron's f).
template <class T, std::size_t R>
var<tensor<T, R>> replicated_across(const var<tensor<T, R>>& x, const mesh_communicator& group) {
  return detail::record(
      tensor<T, R>(x.value()),
      [x, group](detail::value_node<tensor<T, R>>& self) {
        tensor<T, R> g = std::move(*self.grad);
        group.all_reduce(g.span());
        detail::add_grad(x, std::move(g));
      },
      x);
}

}  // namespace pdo
