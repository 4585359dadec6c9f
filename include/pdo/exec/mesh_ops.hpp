// pdo/exec/mesh_ops.hpp: distribute, redistribute and gather of dtensors: tasks on every
// place of the mesh, each running its part (pdo/tensor/redistribute.hpp).
#pragma once

#include <pdo/exec/run_on_places.hpp>
#include <pdo/expr/expression.hpp>
#include <pdo/kernels/reduce.hpp>
#include <pdo/layout/layout_check.hpp>
#include <pdo/tensor/redistribute.hpp>

#include <algorithm>
#include <cstddef>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {
/// @brief What a task that reads `shard` declares.
template <class T, std::size_t Rank>
access reading(const tensor<T, Rank>& shard) {
  access a;
  a.reads.push_back(storage_key(shard));
  return a;
}
}  // namespace detail

namespace detail {
/// @brief The shards of `host` cut over `m` as `v`, one for each place of this process, in
/// its memory (see pdo::distribute; one function for every layout of a mesh, element type
/// and rank).
template <class T, std::size_t Rank, class Mesh>
PDO_NOINLINE std::vector<tensor<T, Rank>> distribute_shards(const Mesh& m, const layout_value& v, const tensor<T, Rank>& host) {
  std::vector<tensor<T, Rank>> shards(m.local_places().size());
  const auto failure = try_run_on_places(
      m,
      [&](std::size_t p, std::size_t k) {
        if (m.is_multiprocess()) check_same_host_shapes(m, p, host.shape());
        shards[k] = shard_of(m, v, host, p);
      },
      true, "distribute", "copy");
  if (failure) rethrow_on_place(*m.state(), *failure, "distribute to " + describe_dtensor<T>(m, v, host.shape()));
  return shards;
}
}  // namespace detail

/// @brief Rejects one layout entry given where a layout is asked for: pdo::split<"dp"> for
/// pdo::layout<pdo::split<"dp">>.
template <class Entry, class Mesh, class T, std::size_t Rank>
  requires dim_spec<Entry>
auto distribute(const Mesh&, const tensor<T, Rank>&) {
  static_assert(detail::always_false<Entry>,
                "pdo: distribute: give a layout, pdo::layout<...> with one entry per tensor dim (pdo::layout<pdo::split<\"dp\">>, not pdo::split<\"dp\">)");
  return detail::unformed_result<detail::replicated_dtensor_t<T, Rank, Mesh>>();
}

/// @brief Rejects distribute without its layout: the layout is a template argument.
template <mesh_type Mesh, element T, std::size_t Rank>
auto distribute(const Mesh&, const tensor<T, Rank>&) {
  static_assert(detail::always_false<Mesh>, "pdo: distribute: give the layout as a template argument, one entry per tensor dim: "
                                            "pdo::distribute<pdo::layout<pdo::split<\"x\">, pdo::replicate>>(mesh, t)");
  return detail::unformed_result<detail::replicated_dtensor_t<T, Rank, Mesh>>();
}

/// @brief Rejects places given where a mesh is asked for.
template <layout_spec Layout, std::ranges::input_range Places, element T, std::size_t Rank>
  requires place<std::ranges::range_value_t<Places>>
auto distribute(const Places&, const tensor<T, Rank>&) {
  static_assert(detail::always_false<Layout>, "pdo: distribute: its first argument is a mesh, not places: lay the places out "
                                              "first, auto mesh = pdo::make_mesh<\"x\">(places), and distribute over it");
  return detail::unformed_result<detail::replicated_dtensor_t<T, Rank, mesh<"x">>>();
}

/// @brief Rejects an expression of local tensors given to distribute, which takes a tensor.
template <layout_spec Layout, mesh_type Mesh, class E>
  requires tensor_expression<E> && (!detail::expression_t<E>::distributed)
auto distribute(const Mesh&, const E&) {
  using node_t = detail::expression_t<E>;
  static_assert(detail::always_false<Layout>, "pdo: distribute: takes a pdo::tensor, not an expression: evaluate it first, "
                                              "pdo::distribute<Layout>(mesh, pdo::eval(e))");
  return detail::unformed_result<detail::replicated_dtensor_t<typename node_t::value_type, node_t::rank, Mesh>>();
}

/// @brief Cuts the host tensor `host` over `m` as `Layout`: each place of this process
/// gets its chunk of the split dims, in its own memory; for partial axes, the places at
/// coordinate 0 get the value and the others zeros. Every process passes the same tensor.
/// Returns a dtensor<T, Rank, Mesh, Layout>; a layout that does not fit it (other rank, an
/// axis the mesh lacks) is one compile error, with nothing instantiated after it.
template <layout_spec Layout, mesh_type Mesh, element T, std::size_t Rank>
auto distribute(const Mesh& m, const tensor<T, Rank>& host) {
  if constexpr (!detail::check_layout<"distribute", Layout, Mesh, Rank>::ok) {
    // the layout's error was given: nothing more after it
    return detail::unformed_result<detail::replicated_dtensor_t<T, Rank, Mesh>>();
  } else {
    return dtensor<T, Rank, Mesh, Layout>(m, host.shape(), detail::distribute_shards(m, detail::value_of<Layout>(), host));
  }
}

namespace detail {

/// @brief redistribute<To>(x) once its layout is checked.
template <layout_spec To, element T, std::size_t Rank, mesh_type Mesh, layout_spec From>
dtensor<T, Rank, Mesh, To> redistribute_to(const dtensor<T, Rank, Mesh, From>& x) {
  const Mesh& m = x.mesh();
  std::vector<tensor<T, Rank>> shards(x.local_shards().size());
  // each place's task reads its shard: it waits for the work queued to write it (an
  // eval_async's), and is cancelled with that work's error if it failed. A plan with a
  // collective runs on the communication lanes, as an evaluation's does; a local slice on
  // the compute lanes.
  constexpr bool collective = redistribute_plan_of<From, To>().collectives() > 0;
  const auto failure = try_run_on_places(
      m, [&](std::size_t p, std::size_t k) { shards[k] = apply_plan<From, To>(m, x.shape(), p, x.local_shards()[k]); }, true,
      "redistribute", collective ? "collective" : "kernel",
      [&](std::size_t, std::size_t k) { return reading(x.local_shards()[k]); },
      collective ? lane_kind::communication : lane_kind::compute);
  if (failure) rethrow_on_place(*m.state(), *failure, redistribute_context(x, layout_name<To>()));
  return {m, x.shape(), std::move(shards)};
}

}  // namespace detail

/// @brief Rejects one layout entry given where a layout is asked for (see distribute's).
template <class Entry, class T, std::size_t Rank, class Mesh, class From>
  requires dim_spec<Entry>
auto redistribute(const dtensor<T, Rank, Mesh, From>&) {
  static_assert(detail::always_false<Entry>,
                "pdo: redistribute: give a layout, pdo::layout<...> with one entry per tensor dim (pdo::layout<pdo::replicate>, not pdo::replicate)");
  return detail::unformed_result<detail::replicated_dtensor_t<T, Rank, Mesh>>();
}

/// @brief Deleted for what is not a dtensor (a tensor, a var, an expression), so that the error
/// names this line and code asking whether a value can be redistributed finds it cannot.
template <layout_spec To, class X>
  requires(!distributed_tensor<X>)
void redistribute(const X& x) = delete;  // pdo: redistribute takes a dtensor: a tensor is laid out by pdo::distribute<Layout>(mesh, t)

/// @brief `x` laid out as `To`. The steps are planned at compile time
/// (redistribute_plan_of<From, To>()): partial -> replicate is an all_reduce,
/// partial -> split a reduce_scatter, split -> replicate an all_gather, split(d) ->
/// split(d') an all_to_all, and replicate -> split a local slice that moves no data.
/// Returns a dtensor<T, Rank, Mesh, To>; a target layout that does not fit the dtensor (other
/// rank, an axis the mesh lacks) is one compile error, with nothing instantiated after it.
template <layout_spec To, element T, std::size_t Rank, mesh_type Mesh, layout_spec From>
auto redistribute(const dtensor<T, Rank, Mesh, From>& x) {
  if constexpr (!detail::check_layout<"redistribute", To, Mesh, Rank>::ok) {
    // the layout's error was given: nothing more after it
    return detail::unformed_result<detail::replicated_dtensor_t<T, Rank, Mesh>>();
  } else {
    return detail::redistribute_to<To>(x);
  }
}

namespace detail {

/// @brief `x` with its partial axes summed (an all_reduce over each, shard by shard: no
/// place holds more than its shard), or `x` itself when it has none; then `f` of it. A
/// failure of the sum is an error of `op` (the operation that asked for it).
template <class T, std::size_t Rank, class Mesh, class Layout, class F>
decltype(auto) with_sums_done(const char* op, const dtensor<T, Rank, Mesh, Layout>& x, F&& f) {
  if constexpr (value_of<Layout>().npartial > 0) {
    std::optional<dtensor<T, Rank, Mesh, typename Layout::base>> whole;
    try {
      whole.emplace(redistribute<typename Layout::base>(x));
    } catch (const error&) {
      captured_error::current().rethrow_with_context(std::string(op) + ": ");
    }
    return f(*whole);
  } else {
    return f(x);
  }
}

/// @brief The blocks of the dtensor of `global` shape laid out over `m` as `v` (no partial
/// axes) whose local shards are `shards`, that places of this process hold, written into `out`
/// (host memory, of the global shape), each by a task of its place that reads the shard:
/// after the work queued to write it (an eval_async's) has ended, and never from work that
/// failed (its error is thrown, naming `op` and the place).
template <class T, std::size_t Rank, class Mesh>
void write_local_blocks(const Mesh& m, const layout_value& v, const shape_t<Rank>& global, const std::vector<tensor<T, Rank>>& shards,
                        tensor<T, Rank>& out, const char* op) {
  const auto failure = try_run_on_places(
      m,
      [&](std::size_t p, std::size_t k) {
        if (writes_block(m, v, p)) write_block(shards[k], out, shard_offset(m, v, global, p));
      },
      false, op, "copy", [&](std::size_t, std::size_t k) { return reading(shards[k]); });
  if (failure) rethrow_on_place(*m.state(), *failure, std::string(op) + ": " + describe_dtensor<T>(m, v, global));
}

/// @brief The blocks of that dtensor that places of other processes hold, into `out` (host
/// memory): with `to_all`, each block is broadcast over the whole mesh and every process
/// writes it; else each is sent to place `to`, whose process writes it. One block is in
/// flight at a time, so no place holds more than one block beside its shard.
template <class T, std::size_t Rank, class Mesh>
void move_remote_blocks(const Mesh& m, const layout_value& v, const shape_t<Rank>& global, const std::vector<tensor<T, Rank>>& shards,
                        tensor<T, Rank>* out, std::size_t to, bool to_all, const char* op) {
  const std::size_t first_local = m.local_places().front();
  run_on_places(op, m, [&](std::size_t p, std::size_t k) {
    const mesh_communicator comm = communicator_of(m, p);
    const int here = m.place(p).process();
    for (std::size_t q = 0; q < m.size(); ++q) {
      if (!writes_block(m, v, q)) continue;
      const bool remote = m.place(q).process() != here;
      if (to_all) {  // a collective: every place takes part
        tensor<T, Rank> received;
        // the root's buffer is only read by a broadcast
        std::span<T> buffer = p == q ? std::span<T>(const_cast<T*>(shards[k].data()), shards[k].size())
                                     : (received = tensor<T, Rank>(shard_shape(m, v, global, q), m.place(p), uninitialized)).span();
        comm.broadcast(buffer, q);
        if (p == first_local && remote) write_block(received, *out, shard_offset(m, v, global, q));
      } else if (m.place(q).process() != m.place(to).process()) {
        if (p == q) {
          comm.send(std::span<const T>(shards[k].span()), to, 0);
        } else if (p == to) {
          tensor<T, Rank> received(shard_shape(m, v, global, q), m.place(p), uninitialized);
          comm.recv(received.span(), q, 0);
          write_block(received, *out, shard_offset(m, v, global, q));
        }
      }
    }
  });
}

/// @brief The value of the dtensor of `global` shape laid out over `m` as `v` (no partial
/// axes) whose local shards are `shards`, as one host tensor, on every process (see
/// pdo::gather; `op` names it in errors). One function for every layout of a mesh, element
/// type and rank.
template <class T, std::size_t Rank, class Mesh>
PDO_NOINLINE tensor<T, Rank> gather_blocks(const Mesh& m, const layout_value& v, const shape_t<Rank>& global,
                                           const std::vector<tensor<T, Rank>>& shards, const char* op) {
  auto out = tensor<T, Rank>::on_host(global);
  write_local_blocks(m, v, global, shards, out, op);
  if (m.is_multiprocess()) move_remote_blocks(m, v, global, shards, &out, 0, true, op);
  return out;
}

/// @brief The same value on the process of place `to` only (see pdo::gather_to; `op` names it
/// in errors).
template <class T, std::size_t Rank, class Mesh>
PDO_NOINLINE std::optional<tensor<T, Rank>> gather_blocks_to(const Mesh& m, const layout_value& v, const shape_t<Rank>& global,
                                                             const std::vector<tensor<T, Rank>>& shards, std::size_t to,
                                                             const char* op) {
  const auto& local = m.local_places();
  if (local.empty()) return std::nullopt;
  std::optional<tensor<T, Rank>> out;
  if (m.place(local.front()).process() == m.place(to).process()) {
    out.emplace(tensor<T, Rank>::on_host(global));
    write_local_blocks(m, v, global, shards, *out, op);
  }
  if (m.is_multiprocess()) move_remote_blocks(m, v, global, shards, out ? &*out : nullptr, to, false, op);
  return out;
}

/// @brief The sum of the squares of the elements of a tensor of `global` shape laid out over
/// `m` as `v` (no partial axes), whose shards in this process are `shards`: each element counted
/// once (a block replicated along an axis, on the places at coordinate 0 of it), added in
/// double, on every process. A collective of the mesh's places; a failure is an error of `op`.
/// One function for every layout of a mesh, element type and rank.
template <class T, std::size_t Rank, class Mesh>
PDO_NOINLINE double sum_of_squares(const Mesh& m, const layout_value& v, const shape_t<Rank>& global,
                                   const std::vector<tensor<T, Rank>>& shards, const char* op) {
  check_not_nested(op);
  check_holds_places(m, op);
  std::vector<double> sums(shards.size());
  const auto failure = try_run_on_places(
      m,
      [&](std::size_t p, std::size_t k) {
        double sum = writes_block(m, v, p) ? sum_of_squares(shards[k].where(), shards[k].data(), shards[k].size()) : 0.0;
        host_communicator_of(m, p).all_reduce(std::span<double>(&sum, 1));
        sums[k] = sum;
      },
      true, op, "collective", [&](std::size_t, std::size_t k) { return reading(shards[k]); });
  if (failure) rethrow_on_place(*m.state(), *failure, std::string(op) + ": " + describe_dtensor<T>(m, v, global));
  return sums.front();
}

/// @brief Each element of `v` becomes its largest value over the processes of `m` (each
/// process passes its own, and every process calls it): how processes learn that one of them
/// failed, or what the others wrote, and wait for one another (a checkpoint's save, a save of
/// parameters). In a mesh of one process, `v` is left as it is. A failure is an error of `op`.
template <class Mesh>
void max_over_processes(const Mesh& m, std::span<long long> v, const char* op) {
  if (!m.is_multiprocess()) return;
  std::vector<long long> result(v.begin(), v.end());
  run_on_places(op, m, [&](std::size_t p, std::size_t k) {
    std::vector<long long> x(v.begin(), v.end());
    host_communicator_of(m, p).all_reduce(std::span<long long>(x), reduce_op::max);
    if (k == 0) result = std::move(x);
  });
  std::copy(result.begin(), result.end(), v.begin());
}

}  // namespace detail

/// @brief Deleted for what is not a dtensor, as redistribute is.
template <class X>
  requires(!distributed_tensor<X>)
tensor<float, 0> gather(const X& x) = delete;  // pdo: gather takes a dtensor: a tensor is whole already; a var's value is v.value()
template <class X>
  requires(!distributed_tensor<X>)
std::optional<tensor<float, 0>> gather_to(const X& x, int root = 0) = delete;  // pdo: gather_to takes a dtensor

/// @brief The value of `x` as one host tensor, on every process: partial sums are reduced
/// (over each partial axis, shard by shard) and each block of the split dims is written into
/// the host tensor from its place, so no place ever holds the whole tensor (a tensor that
/// fits only when split can be gathered). Over several processes each block travels by a
/// broadcast; gather_to(x, root) brings it to one process only.
template <element T, std::size_t Rank, mesh_type Mesh, layout_spec Layout>
tensor<T, Rank> gather(const dtensor<T, Rank, Mesh, Layout>& x) {
  detail::check_not_nested("gather");
  const Mesh& m = x.mesh();
  detail::check_holds_places(m, "gather");  // (every process builds the mesh's communicators, those without places too)
  return detail::with_sums_done("gather", x, [](const auto& whole) {
    return detail::gather_blocks(whole.mesh(), whole.layout_value, whole.shape(), whole.local_shards(), "gather");
  });
}

/// @brief The value of `x` as one host tensor on process `root` only (an MPI rank that owns
/// places of the mesh; 0 in a program of one process), and nothing on the others: each
/// block is sent from its place to the root, one at a time, so only the root holds the
/// whole tensor. Every process of the mesh calls it.
template <element T, std::size_t Rank, mesh_type Mesh, layout_spec Layout>
std::optional<tensor<T, Rank>> gather_to(const dtensor<T, Rank, Mesh, Layout>& x, int root = 0) {
  detail::check_not_nested("gather_to");
  const Mesh& m = x.mesh();
  detail::comms_of(m);
  std::size_t to = m.size();
  for (std::size_t q = 0; q < m.size() && to == m.size(); ++q)
    if (m.place(q).process() == root) to = q;
  if (to == m.size())
    throw layout_error("gather_to: " + x.describe() + ": process " + std::to_string(root) + " holds no place of the mesh");
  return detail::with_sums_done("gather_to", x, [to](const auto& whole) {
    return detail::gather_blocks_to(whole.mesh(), whole.layout_value, whole.shape(), whole.local_shards(), to, "gather_to");
  });
}

}  // namespace pdo
