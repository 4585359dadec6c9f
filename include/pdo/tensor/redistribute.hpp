// pdo/tensor/redistribute.hpp: what one place does in a distribute, a redistribution and a
// gather of dtensors (the operations themselves, which run these on every place of a mesh,
// are in pdo/exec/mesh_ops.hpp).
#pragma once

#include <pdo/comm/mesh_comms.hpp>
#include <pdo/core/views.hpp>
#include <pdo/layout/layout_check.hpp>
#include <pdo/layout/redistribute_plan.hpp>
#include <pdo/tensor/copy.hpp>
#include <pdo/tensor/dtensor.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief How many collectives of each kind the plans have run (see planned_collectives).
inline std::array<std::atomic<std::size_t>, 7>& planned_collective_counts() {
  static std::array<std::atomic<std::size_t>, 7> counts{};
  return counts;
}

/// @brief Counts one planned collective of kind `k` run by a group of places: called by
/// every member, counted by the first (`first_of_group`), so a group counts once.
inline void count_planned(step_kind k, bool first_of_group) {
  if (first_of_group) planned_collective_counts()[static_cast<std::size_t>(k)].fetch_add(1, std::memory_order_relaxed);
}

/// @brief The collective of a redistribution step of kind `Kind` over a flat buffer (a
/// gradient bucket: one parameter's gradient, or several packed), run by one member of
/// `group`, the line of places along the step's axis: partial -> replicate (all_reduce) in
/// place in `data`; partial -> split of dim 0 (reduce_scatter) into `out`, this member's
/// chunk; split of dim 0 -> replicate (all_gather) of the chunk `data` into `out`.
/// apply_step runs these same collectives for tensors.
template <step_kind Kind, class T>
void apply_flat_step(const mesh_communicator& group, std::span<T> data, std::span<T> out = {}) {
  static_assert(Kind == step_kind::all_reduce || Kind == step_kind::reduce_scatter || Kind == step_kind::all_gather,
                "pdo: a flat buffer is synced by an all_reduce, a reduce_scatter or an all_gather of dim 0");
  count_planned(Kind, group.rank() == 0);
  if constexpr (Kind == step_kind::all_reduce) group.all_reduce(data);
  else if constexpr (Kind == step_kind::reduce_scatter) group.reduce_scatter(std::span<const T>(data), out);
  else group.all_gather(std::span<const T>(data), out);
}

/// @brief apply_flat_step of redistribution step `step` on place `p` of `m`, over p's line
/// along the step's axis.
template <step_kind Kind, class T, class Mesh>
void apply_flat_step(const redistribute_step& step, const Mesh& m, std::size_t p, std::span<T> data, std::span<T> out = {}) {
  apply_flat_step<Kind>(communicator_along(m, Mesh::axis_index(step.axis), p), data, out);
}

/// @brief The all_reduce of a flat buffer (partial over the group's axis -> replicate) fused
/// with what reads its result: the step apply_flat_step<all_reduce> runs, the sum handed to
/// `consume` range by range instead of written back (group_communicator::all_reduce_apply).
template <class T>
void apply_flat_sum(const mesh_communicator& group, std::span<T> data, reduced_consumer<T> consume) {
  count_planned(step_kind::all_reduce, group.rank() == 0);
  group.all_reduce_apply(data, consume);
}

/// @brief One step of a redistribution on place `p`: from `shard` (laid out as step.before)
/// to this place's shard under step.after. Every place of the mesh runs it at once. `shard`
/// is only read; when `owned` is given (it is then `shard` itself, whose memory the caller
/// hands over), the steps that work in place (keep_on_one, all_reduce) take it over, and the
/// others free it as soon as they have read it. Beside its input, a step holds at most two
/// buffers at once (its output, and the pieces of the collective packed one after another
/// where they are not already); a redistribution reads a dtensor's shards without copying them first.
template <step_kind Kind, class T, std::size_t Rank, class Mesh>
tensor<T, Rank> apply_step(const redistribute_step& step, const Mesh& m, const shape_t<Rank>& global, std::size_t p,
                           const tensor<T, Rank>& shard, tensor<T, Rank>* owned = nullptr) {
  const std::size_t a = Mesh::axis_index(step.axis), n = m.extent(a), me = m.coord(p, a);
  const any_place& place = m.place(p);
  const shape_t<Rank> out_shape = shard_shape(m, step.after, global, p);
  const auto release = [owned] {
    if (owned != nullptr) *owned = tensor<T, Rank>();
  };
  if constexpr (Kind == step_kind::keep_on_one) {
    if (me != 0) {
      release();
      return tensor<T, Rank>(out_shape, place);  // zeros
    }
    return owned != nullptr ? std::move(*owned) : tensor<T, Rank>(shard);
  } else if constexpr (Kind == step_kind::zero_pad) {
    tensor<T, Rank> out(out_shape, place);  // zeros
    place_chunk(shard.data(), view_along(out_shape, step.dim), n, me, out.data(), out.where());
    release();
    return out;
  } else if constexpr (Kind == step_kind::local_slice) {
    tensor<T, Rank> out(out_shape, place, uninitialized);
    copy_chunk(shard.data(), view_along(shard.shape(), step.dim), n, me, out.data(), out.where());
    release();
    return out;
  } else if constexpr (Kind == step_kind::all_reduce) {
    tensor<T, Rank> out = owned != nullptr ? std::move(*owned) : tensor<T, Rank>(shard);
    apply_flat_step<Kind>(step, m, p, out.span());
    return out;
  } else {
    const mesh_communicator comm = communicator_along(m, a, p);
    count_planned(Kind, me == 0);
    if constexpr (Kind == step_kind::reduce_scatter) {
      // members keep chunks of `dim`: send them chunk-major, unless dim is outermost
      const dim_view v = view_along(shard.shape(), step.dim);
      const bool pack = v.outer != 1;
      tensor<T, Rank> packed;
      if (pack) {
        packed = tensor<T, Rank>(shard.shape(), place, uninitialized);
        pack_chunks(shard.data(), v, n, packed.data(), packed.where());
        release();
      }
      tensor<T, Rank> out(out_shape, place, uninitialized);
      comm.reduce_scatter(std::as_const(pack ? packed : shard).span(), out.span());
      if (!pack) release();
      return out;
    } else if constexpr (Kind == step_kind::all_gather) {
      const dim_view v = view_along(out_shape, step.dim);
      if (v.outer == 1) {
        tensor<T, Rank> out(out_shape, place, uninitialized);
        comm.all_gather(shard.span(), out.span());
        release();
        return out;
      }
      tensor<T, Rank> packed(out_shape, place, uninitialized);
      comm.all_gather(shard.span(), packed.span());
      release();
      tensor<T, Rank> out(out_shape, place, uninitialized);
      unpack_chunks(packed.data(), v, n, out.data(), out.where());
      return out;
    } else {
      static_assert(Kind == step_kind::all_to_all);
      // piece j: my shard's chunk j of the new split dim; piece i received: member i's
      // chunk of the old split dim, to be put back in order along it. Where a dim is the
      // outermost one that is not 1, its chunks are already one after another: the shard is
      // sent as it is, or received straight into the output.
      const dim_view send_view = view_along(shard.shape(), step.dim);
      const dim_view recv_view = view_along(out_shape, step.from_dim);
      std::vector<std::size_t> send_counts(n), recv_counts(n);
      for (std::size_t k = 0; k < n; ++k) {
        send_counts[k] = send_view.outer * chunk_size(send_view.extent, n, k) * send_view.inner;
        recv_counts[k] = recv_view.outer * chunk_size(recv_view.extent, n, k) * recv_view.inner;
      }
      const bool pack = send_view.outer != 1, unpack = recv_view.outer != 1;
      tensor<T, Rank> packed;
      if (pack) {
        packed = tensor<T, Rank>(shard.shape(), place, uninitialized);
        pack_chunks(shard.data(), send_view, n, packed.data(), packed.where());
        release();
      }
      tensor<T, Rank> out, received;
      (unpack ? received : out) = tensor<T, Rank>(out_shape, place, uninitialized);
      comm.all_to_all(std::as_const(pack ? packed : shard).span(), std::span<const std::size_t>(send_counts),
                      (unpack ? received : out).span(), std::span<const std::size_t>(recv_counts));
      if (pack) packed = tensor<T, Rank>();
      else release();
      if (unpack) {
        out = tensor<T, Rank>(out_shape, place, uninitialized);
        unpack_chunks(received.data(), recv_view, n, out.data(), out.where());
      }
      return out;
    }
  }
}

/// @brief apply_step of a shard whose memory the caller hands over (the result of an
/// earlier step): reused or freed by the step.
template <step_kind Kind, class T, std::size_t Rank, class Mesh>
tensor<T, Rank> apply_step(const redistribute_step& step, const Mesh& m, const shape_t<Rank>& global, std::size_t p,
                           tensor<T, Rank>&& shard) {
  return apply_step<Kind>(step, m, global, p, std::as_const(shard), &shard);
}

/// @brief Runs `Plan` on place `p` from `shard`, which it only reads (its first step reads it
/// in place; a plan with no steps gives a copy); each step's collective is chosen at compile time.
template <const redistribute_plan& Plan, class T, std::size_t Rank, class Mesh>
tensor<T, Rank> apply_plan(const Mesh& m, const shape_t<Rank>& global, std::size_t p, const tensor<T, Rank>& shard) {
  if constexpr (Plan.size == 0) {
    return shard;
  } else {
    // a copy of each step: passing Plan.steps[I] itself would make the whole plan (all its
    // capacity of steps) an object of the program
    constexpr redistribute_step first = Plan.steps[0];
    tensor<T, Rank> out = apply_step<first.kind>(first, m, global, p, shard);
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (
          [&] {
            constexpr redistribute_step step = Plan.steps[I + 1];
            out = apply_step<step.kind>(step, m, global, p, std::move(out));
          }(),
          ...);
    }(std::make_index_sequence<Plan.size - 1>{});
    return out;
  }
}

/// @brief Runs the plan from `From` to `To` on place `p`.
template <layout_spec From, layout_spec To, class T, std::size_t Rank, class Mesh>
tensor<T, Rank> apply_plan(const Mesh& m, const shape_t<Rank>& global, std::size_t p, const tensor<T, Rank>& shard) {
  return apply_plan<redistribute_plan_v<From, To>>(m, global, p, shard);
}

template <class T, std::size_t Rank, class Mesh, class Layout>
std::string redistribute_context(const dtensor<T, Rank, Mesh, Layout>& x, const std::string& to) {
  return "redistribute: " + x.describe() + " -> " + to;
}

/// @brief The error of check_same_extents: `here` and `there` hold the shapes of the
/// tensors one after another, `ranks[i]` extents each.
[[noreturn]] PDO_NOINLINE inline void throw_different_host_shapes(std::span<const std::size_t> ranks,
                                                                 std::span<const std::size_t> here, std::span<const std::size_t> there,
                                                                 const std::string& place) {
  const auto shapes = [&](std::span<const std::size_t> extents) {
    std::string text;
    for (std::size_t i = 0, at = 0; i < ranks.size(); at += ranks[i++])
      text += (i == 0 ? "" : " and ") + format_extents(extents.subspan(at, ranks[i]));
    return text;
  };
  throw mismatch_error("the processes passed host tensors of different shapes: " + shapes(here) + " here, " +
                       shapes(there) + " on " + place + "; every process must pass the same " +
                       (ranks.size() == 1 ? "tensor" : "tensors"));
}

/// @brief Every process must pass the operation host tensors of the same shapes (`extents`:
/// their shapes one after another, `ranks[i]` extents each): checked by place `p` with one
/// small all_gather over every place of `m`, so a process that passed other shapes fails on
/// all of them (pdo::mismatch_error, the error every member of a collective throws alike; the
/// operation's task names the operation and the place).
template <class Mesh>
void check_same_extents(const Mesh& m, std::size_t p, std::span<const std::size_t> extents, std::span<const std::size_t> ranks) {
  const std::size_t n = extents.size();
  std::vector<std::size_t> all(m.size() * n);
  host_communicator_of(m, p).all_gather(extents, std::span<std::size_t>(all));
  for (std::size_t q = 0; q < m.size(); ++q) {
    const std::span<const std::size_t> there(all.data() + q * n, n);
    if (!std::equal(extents.begin(), extents.end(), there.begin())) throw_different_host_shapes(ranks, extents, there, m.place(q).name());
  }
}

/// @brief check_same_extents of the shapes of host tensors given to an operation (the data
/// of distribute, or a trainer's batch: inputs and targets), from its task on place `p`.
template <class Mesh, std::size_t... Rank>
void check_same_host_shapes(const Mesh& m, std::size_t p, const shape_t<Rank>&... shapes) {
  std::array<std::size_t, (Rank + ... + 0)> extents{};
  const std::array<std::size_t, sizeof...(Rank)> ranks{Rank...};
  std::size_t at = 0;
  ((std::copy(shapes.begin(), shapes.end(), extents.begin() + static_cast<std::ptrdiff_t>(at)), at += Rank), ...);
  check_same_extents(m, p, extents, ranks);
}

}  // namespace detail

/// @brief How many collectives of kind `k` the plans have run in this process since
/// reset_planned_collectives() (eval's redistributions, redistribute, autograd's gradients;
/// an all_reduce(max) counts as an all_reduce, and a window op's halo exchange, forward or
/// backward, as the all_to_all it runs as), each counted once per group of places that ran
/// it together. For tests and tuning: `pdo::plan_of` says what a plan will run, and its
/// `count(k)` counts each step once, so that a step along one axis of a mesh whose other axes
/// hold g groups of places counts g times here (on a 2 x 2 mesh, an all_gather along "a": 1
/// in the plan, 2 here); this says what ran.
inline std::size_t planned_collectives(step_kind k) {
  return detail::planned_collective_counts()[static_cast<std::size_t>(k)].load(std::memory_order_relaxed);
}
inline void reset_planned_collectives() {
  for (auto& c : detail::planned_collective_counts()) c.store(0, std::memory_order_relaxed);
}

namespace detail {
/// @brief Place `p`'s shard of `host` laid out over `m` as `v`, in p's memory: its chunk of
/// the split dims; for partial axes, the value at coordinate 0 and zeros elsewhere (one
/// function for every layout of a mesh, element type and rank).
template <class T, std::size_t Rank, class Mesh>
PDO_NOINLINE tensor<T, Rank> shard_of(const Mesh& m, const layout_value& v, const tensor<T, Rank>& host, std::size_t p) {
  const auto shape = shard_shape(m, v, host.shape(), p);
  tensor<T, Rank> shard(shape, m.place(p), uninitialized);
  if (!holds_partial_value(m, v, p)) {
    shard.fill(T{});
  } else if (shard.on_gpu()) {  // cut on the host, then copied up
    std::vector<T> cut(volume(shape));
    copy_block(host.data(), host.shape(), shard_offset(m, v, host.shape(), p), shape, cut.data());
    copy_bytes(shard.where(), shard.data(), nullptr, cut.data(), cut.size() * sizeof(T));
  } else {
    copy_block(host.data(), host.shape(), shard_offset(m, v, host.shape(), p), shape, shard.data());
  }
  return shard;
}
/// @brief Place `p`'s shard of `host` laid out over `m` as `Layout`.
template <layout_spec Layout, mesh_type Mesh, element T, std::size_t Rank>
tensor<T, Rank> shard_of(const Mesh& m, const tensor<T, Rank>& host, std::size_t p) {
  return shard_of(m, value_of<Layout>(), host, p);
}
}  // namespace detail

namespace detail {

/// @brief Whether place `p` holds a block that a gather writes: the one at coordinate 0
/// along every axis that `v` (no partial axes) does not split; the others hold copies.
template <class Mesh>
bool writes_block(const Mesh& m, const layout_value& v, std::size_t p) {
  for (std::size_t a = 0; a < Mesh::ndim; ++a) {
    bool splits = false;
    for (std::size_t d = 0; d < v.rank; ++d) splits = splits || v.dim_axis[d] == Mesh::axis_names[a];
    if (!splits && m.coord(p, a) != 0) return false;
  }
  return true;
}

/// @brief `block` (in any memory) into the block at `offset` of `out` (host memory).
template <class T, std::size_t Rank>
void write_block(const tensor<T, Rank>& block, tensor<T, Rank>& out, const shape_t<Rank>& offset) {
  if (block.on_gpu()) {
    const auto staged = to_host(block);
    place_block(staged.data(), block.shape(), out.data(), out.shape(), offset);
  } else {
    place_block(block.data(), block.shape(), out.data(), out.shape(), offset);
  }
}


}  // namespace detail

}  // namespace pdo
