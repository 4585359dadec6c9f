// pdo/tensor/redistribute.hpp: distribute, redistribute and gather of dtensors.
#pragma once

#include <pdo/comm/mesh_comms.hpp>
#include <pdo/comm/run_on_places.hpp>
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

/// @brief One step of a redistribution on place `p`: turns `shard` (laid out as
/// step.before) into its shard under step.after. Every place of the mesh runs it at once.
template <step_kind Kind, class T, std::size_t Rank, class Mesh>
tensor<T, Rank> apply_step(const redistribute_step& step, const Mesh& m, const shape_t<Rank>& global, std::size_t p,
                           tensor<T, Rank> shard) {
  const std::size_t a = Mesh::axis_index(step.axis), n = m.extent(a), me = m.coord(p, a);
  const any_place& place = m.place(p);
  const shape_t<Rank> out_shape = shard_shape(m, step.after, global, p);
  if constexpr (Kind == step_kind::keep_on_one) {
    if (me != 0) shard.fill(T{});
    return shard;
  } else if constexpr (Kind == step_kind::zero_pad) {
    tensor<T, Rank> out(out_shape, place);  // zeros
    place_chunk(shard.data(), view_along(out_shape, step.dim), n, me, out.data(), out.where());
    return out;
  } else if constexpr (Kind == step_kind::local_slice) {
    tensor<T, Rank> out(out_shape, place, uninitialized);
    copy_chunk(shard.data(), view_along(shard.shape(), step.dim), n, me, out.data(), out.where());
    return out;
  } else {
    const mesh_communicator comm = communicator_along(m, a, p);
    if (me == 0) planned_collective_counts()[static_cast<std::size_t>(Kind)].fetch_add(1, std::memory_order_relaxed);
    if constexpr (Kind == step_kind::all_reduce) {
      comm.all_reduce(shard.span());
      return shard;
    } else if constexpr (Kind == step_kind::reduce_scatter) {
      // members keep chunks of `dim`: send them chunk-major, unless dim is outermost
      const dim_view v = view_along(shard.shape(), step.dim);
      tensor<T, Rank> out(out_shape, place, uninitialized);
      if (v.outer == 1) {
        comm.reduce_scatter(std::as_const(shard).span(), out.span());
      } else {
        tensor<T, Rank> packed(shard.shape(), place, uninitialized);
        pack_chunks(shard.data(), v, n, packed.data(), packed.where());
        comm.reduce_scatter(std::as_const(packed).span(), out.span());
      }
      return out;
    } else if constexpr (Kind == step_kind::all_gather) {
      tensor<T, Rank> out(out_shape, place, uninitialized);
      const dim_view v = view_along(out_shape, step.dim);
      if (v.outer == 1) {
        comm.all_gather(std::as_const(shard).span(), out.span());
      } else {
        tensor<T, Rank> packed(out_shape, place, uninitialized);
        comm.all_gather(std::as_const(shard).span(), packed.span());
        unpack_chunks(packed.data(), v, n, out.data(), out.where());
      }
      return out;
    } else {
      static_assert(Kind == step_kind::all_to_all);
      // piece j: my shard's chunk j of the new split dim; piece i received: member i's
      // chunk of the old split dim, to be put back in order along it
      const dim_view send_view = view_along(shard.shape(), step.dim);
      const dim_view recv_view = view_along(out_shape, step.from_dim);
      std::vector<std::size_t> send_counts(n), recv_counts(n);
      for (std::size_t k = 0; k < n; ++k) {
        send_counts[k] = send_view.outer * chunk_size(send_view.extent, n, k) * send_view.inner;
        recv_counts[k] = recv_view.outer * chunk_size(recv_view.extent, n, k) * recv_view.inner;
      }
      tensor<T, Rank> packed(shard.shape(), place, uninitialized);
      pack_chunks(shard.data(), send_view, n, packed.data(), packed.where());
      tensor<T, Rank> received(out_shape, place, uninitialized), out(out_shape, place, uninitialized);
      comm.all_to_all(std::as_const(packed).span(), std::span<const std::size_t>(send_counts), received.span(),
                      std::span<const std::size_t>(recv_counts));
      unpack_chunks(received.data(), recv_view, n, out.data(), out.where());
      return out;
    }
  }
}

/// @brief Runs `Plan` on place `p`; each step's collective is chosen at compile time.
template <const redistribute_plan& Plan, class T, std::size_t Rank, class Mesh>
tensor<T, Rank> apply_plan(const Mesh& m, const shape_t<Rank>& global, std::size_t p, tensor<T, Rank> shard) {
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((shard = apply_step<Plan.steps[I].kind>(Plan.steps[I], m, global, p, std::move(shard))), ...);
  }(std::make_index_sequence<Plan.size>{});
  return shard;
}

/// @brief Runs the plan from `From` to `To` on place `p`.
template <layout_spec From, layout_spec To, class T, std::size_t Rank, class Mesh>
tensor<T, Rank> apply_plan(const Mesh& m, const shape_t<Rank>& global, std::size_t p, tensor<T, Rank> shard) {
  return apply_plan<redistribute_plan_v<From, To>>(m, global, p, std::move(shard));
}

template <class T, std::size_t Rank, class Mesh, class Layout>
std::string redistribute_context(const dtensor<T, Rank, Mesh, Layout>& x, const std::string& to) {
  return "redistribute: " + x.describe() + " -> " + to;
}

/// @brief Every process must distribute a host tensor of the same shape: checked with
/// one small all_gather, so a process that passed another shape fails on all of them
/// (pdo::mismatch_error, the error every member of a collective throws alike).
template <class Mesh, std::size_t Rank>
void check_same_host_shape(const Mesh& m, std::size_t p, const shape_t<Rank>& shape) {
  std::vector<std::size_t> all(m.size() * Rank);
  host_communicator_of(m, p).all_gather(std::span<const std::size_t>(shape.data(), Rank), std::span<std::size_t>(all));
  for (std::size_t q = 0; q < m.size(); ++q)
    if (!std::equal(shape.begin(), shape.end(), all.begin() + static_cast<std::ptrdiff_t>(q * Rank)))
      throw mismatch_error("distribute: the processes passed host tensors of different shapes: " + format_extents(shape) +
                        " here, " + format_extents(std::span<const std::size_t>(all.data() + q * Rank, Rank)) + " on " +
                        m.place(q).name() + "; every process must pass the same tensor");
}

}  // namespace detail

/// @brief How many collectives of kind `k` the planned redistributions have run in this
/// process since reset_planned_collectives() (eval, redistribute, autograd's gradients),
/// each counted once per group of places that ran it together. For tests and tuning:
/// `pdo::plan_of` says what a plan will run; this says what ran.
inline std::size_t planned_collectives(step_kind k) {
  return detail::planned_collective_counts()[static_cast<std::size_t>(k)].load(std::memory_order_relaxed);
}
inline void reset_planned_collectives() {
  for (auto& c : detail::planned_collective_counts()) c.store(0, std::memory_order_relaxed);
}

namespace detail {
/// @brief Place `p`'s shard of `host` laid out over `m` as `Layout`, in p's memory: its
/// chunk of the split dims; for partial axes, the value at coordinate 0 and zeros elsewhere.
template <layout_spec Layout, mesh_type Mesh, element T, std::size_t Rank>
tensor<T, Rank> shard_of(const Mesh& m, const tensor<T, Rank>& host, std::size_t p) {
  constexpr layout_value v = value_of<Layout>();
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
}  // namespace detail

/// @brief Cuts the host tensor `host` over `m` as `Layout`: each place of this process
/// gets its chunk of the split dims, in its own memory; for partial axes, the places at
/// coordinate 0 get the value and the others zeros. Every process passes the same tensor.
template <layout_spec Layout, mesh_type Mesh, element T, std::size_t Rank>
dtensor<T, Rank, Mesh, Layout> distribute(const Mesh& m, const tensor<T, Rank>& host) {
  static_assert(detail::check_layout<"distribute", Layout, Mesh, Rank>::ok);
  const auto& local = m.local_places();
  std::vector<tensor<T, Rank>> shards(local.size());
  detail::run_on_places("distribute", m, [&](std::size_t p, std::size_t k) {
    if (m.is_multiprocess()) detail::check_same_host_shape(m, p, host.shape());
    shards[k] = detail::shard_of<Layout>(m, host, p);
  });
  return {m, host.shape(), std::move(shards)};
}

/// @brief `x` laid out as `To`. The steps are planned at compile time
/// (redistribute_plan_of<From, To>()): partial -> replicate is an all_reduce,
/// partial -> split a reduce_scatter, split -> replicate an all_gather, split(d) ->
/// split(d') an all_to_all, and replicate -> split a local slice that moves no data.
template <layout_spec To, element T, std::size_t Rank, mesh_type Mesh, layout_spec From>
dtensor<T, Rank, Mesh, To> redistribute(const dtensor<T, Rank, Mesh, From>& x) {
  static_assert(detail::check_layout<"redistribute", To, Mesh, Rank>::ok);
  const Mesh& m = x.mesh();
  std::vector<tensor<T, Rank>> shards(x.local_shards().size());
  detail::run_on_places(detail::redistribute_context(x, layout_name<To>()).c_str(), m, [&](std::size_t p, std::size_t k) {
    shards[k] = detail::apply_plan<From, To>(m, x.shape(), p, x.local_shards()[k]);
  });
  return {m, x.shape(), std::move(shards)};
}

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

/// @brief `x` with its partial axes summed (an all_reduce over each, shard by shard: no
/// place holds more than its shard), or `x` itself when it has none; then `f` of it.
template <class T, std::size_t Rank, class Mesh, class Layout, class F>
decltype(auto) with_sums_done(const dtensor<T, Rank, Mesh, Layout>& x, F&& f) {
  if constexpr (value_of<Layout>().npartial > 0) return f(redistribute<typename Layout::base>(x));
  else return f(x);
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

/// @brief The blocks of `x` (no partial axes) that places of this process hold, written
/// into `out` (host memory, of x's global shape) from the host thread.
template <class T, std::size_t Rank, class Mesh, class Layout>
void write_local_blocks(const dtensor<T, Rank, Mesh, Layout>& x, tensor<T, Rank>& out) {
  const auto& m = x.mesh();
  const auto& local = m.local_places();
  for (std::size_t k = 0; k < local.size(); ++k) {
    if (writes_block(m, value_of<Layout>(), local[k])) write_block(x.local_shards()[k], out, x.local_offset(local[k]));
  }
}

/// @brief The blocks of `x` (no partial axes) that places of other processes hold, into
/// `out` (host memory): with `to_all`, each block is broadcast over the whole mesh and
/// every process writes it; else each is sent to place `to`, whose process writes it. One
/// block is in flight at a time, so no place holds more than one block beside its shard.
template <class T, std::size_t Rank, class Mesh, class Layout>
void move_remote_blocks(const dtensor<T, Rank, Mesh, Layout>& x, tensor<T, Rank>* out, std::size_t to, bool to_all, const char* op) {
  const auto& m = x.mesh();
  const std::size_t first_local = m.local_places().front();
  run_on_places(op, m, [&](std::size_t p, std::size_t k) {
    const mesh_communicator comm = communicator_of(m, p);
    const int here = m.place(p).process();
    for (std::size_t q = 0; q < m.size(); ++q) {
      if (!writes_block(m, value_of<Layout>(), q)) continue;
      const bool remote = m.place(q).process() != here;
      if (to_all) {  // a collective: every place takes part
        tensor<T, Rank> received;
        // the root's buffer is only read by a broadcast
        std::span<T> buffer = p == q ? std::span<T>(const_cast<T*>(x.local_shards()[k].data()), x.local_shards()[k].size())
                                     : (received = tensor<T, Rank>(x.local_shape(q), m.place(p), uninitialized)).span();
        comm.broadcast(buffer, q);
        if (p == first_local && remote) write_block(received, *out, x.local_offset(q));
      } else if (m.place(q).process() != m.place(to).process()) {
        if (p == q) {
          comm.send(std::span<const T>(x.local_shards()[k].span()), to, 0);
        } else if (p == to) {
          tensor<T, Rank> received(x.local_shape(q), m.place(p), uninitialized);
          comm.recv(received.span(), q, 0);
          write_block(received, *out, x.local_offset(q));
        }
      }
    }
  });
}

}  // namespace detail
/// @brief The value of `x` as one host tensor, on every process: partial sums are reduced
/// (over each partial axis, shard by shard) and each block of the split dims is written into
/// the host tensor from its place, so no place ever holds the whole tensor (a tensor that
/// fits only when split can be gathered). Over several processes each block travels by a
/// broadcast; gather_to(x, root) brings it to one process only.
template <element T, std::size_t Rank, mesh_type Mesh, layout_spec Layout>
tensor<T, Rank> gather(const dtensor<T, Rank, Mesh, Layout>& x) {
  const Mesh& m = x.mesh();
  detail::comms_of(m);  // built by every process, those without places too
  if (m.local_places().empty()) throw layout_error("gather: " + x.describe() + ": this process holds no place of the mesh");
  return detail::with_sums_done(x, [&](const auto& whole) {
    auto out = tensor<T, Rank>::on_host(x.shape());
    detail::write_local_blocks(whole, out);
    if (m.is_multiprocess()) detail::move_remote_blocks(whole, &out, 0, true, "gather");
    return out;
  });
}

/// @brief The value of `x` as one host tensor on process `root` only (an MPI rank that owns
/// places of the mesh; 0 in a program of one process), and nothing on the others: each
/// block is sent from its place to the root, one at a time, so only the root holds the
/// whole tensor. Every process of the mesh calls it.
template <element T, std::size_t Rank, mesh_type Mesh, layout_spec Layout>
std::optional<tensor<T, Rank>> gather_to(const dtensor<T, Rank, Mesh, Layout>& x, int root = 0) {
  const Mesh& m = x.mesh();
  detail::comms_of(m);
  std::size_t to = m.size();
  for (std::size_t q = 0; q < m.size() && to == m.size(); ++q)
    if (m.place(q).process() == root) to = q;
  if (to == m.size())
    throw layout_error("gather_to: " + x.describe() + ": process " + std::to_string(root) + " holds no place of the mesh");
  const auto& local = m.local_places();
  return detail::with_sums_done(x, [&](const auto& whole) -> std::optional<tensor<T, Rank>> {
    if (local.empty()) return std::nullopt;
    const bool is_root = m.place(local.front()).process() == root;
    std::optional<tensor<T, Rank>> out;
    if (is_root) {
      out.emplace(tensor<T, Rank>::on_host(x.shape()));
      detail::write_local_blocks(whole, *out);
    }
    if (m.is_multiprocess()) detail::move_remote_blocks(whole, out ? &*out : nullptr, to, false, "gather_to");
    return out;
  });
}

}  // namespace pdo
