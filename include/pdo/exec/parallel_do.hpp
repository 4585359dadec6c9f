// pdo/exec/parallel_do.hpp: run a block on every place over its local shards, and merge the results.
#pragma once

#include <pdo/comm/mesh_comms.hpp>
#include <pdo/core/views.hpp>
#include <pdo/exec/eval.hpp>
#include <pdo/exec/run_on_places.hpp>
#include <pdo/layout/layout_check.hpp>
#include <pdo/layout/propagation.hpp>
#include <pdo/tensor/dtensor.hpp>

#if defined(__linux__)
#include <pthread.h>
#endif

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo {

template <class V>
class var;  // pdo/autograd/variable.hpp

namespace detail {

/// @brief Whether an argument is a pdo::var over a dtensor: parallel_do with one such
/// argument is the differentiable overload's (pdo/autograd/parallel_do.hpp), not this one.
template <class A>
inline constexpr bool is_distributed_var_v = false;
template <class V>
inline constexpr bool is_distributed_var_v<var<V>> = distributed_tensor<V>;

/// @brief What a parallel_do block receives for one argument on place `p`: a dtensor's
/// local shard; anything else as it is.
template <class Arg>
decltype(auto) local_view(const Arg& arg, std::size_t p) {
  if constexpr (distributed_tensor<Arg>) return arg.shard(p);
  else return (arg);
}

template <class Arg>
using local_view_t = decltype(local_view(std::declval<const Arg&>(), std::size_t{}));

/// @brief What the block of this process's `k`-th place reads: the local shards of the
/// dtensors among `args`. So it waits for the work queued to write them (an eval_async's,
/// its collectives included), and is cancelled with that work's error if it failed.
template <class... Args>
access shards_read(std::size_t k, const Args&... args) {
  access a;
  (
      [&] {
        if constexpr (distributed_tensor<Args>) a.reads.push_back(storage_key(args.local_shards()[k]));
      }(),
      ...);
  return a;
}

/// @brief Whether a parallel_do block may return an `R` as its place's part: a tensor, or an
/// expression of local tensors (evaluated on the place).
template <class R>
consteval bool is_block_part() {
  if constexpr (is_tensor_v<R>) return true;
  else if constexpr (tensor_expression<R>) return !expression_t<R>::distributed;
  else return false;
}

/// @brief The lowest address of the calling thread's stack (0 where the system does not say).
inline std::uintptr_t stack_bottom() {
#if defined(__linux__)
  thread_local const std::uintptr_t bottom = [] {
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) != 0) return std::uintptr_t{0};
    void* low = nullptr;
    std::size_t size = 0;
    const bool known = pthread_attr_getstack(&attr, &low, &size) == 0;
    pthread_attr_destroy(&attr);
    return known ? reinterpret_cast<std::uintptr_t>(low) : std::uintptr_t{0};
  }();
  return bottom;
#else
  return 0;
#endif
}

/// @brief std::apply(block, arguments), from a frame of its own: what the block kept on the
/// stack (its local tensors, the arguments it took by value) lies below its caller's frame.
template <class Block, class Tuple>
PDO_NOINLINE decltype(auto) apply_block(Block& block, Tuple& arguments) {
  return std::apply(block, arguments);
}

/// @brief An error unless every tensor the expression `part` (a block's result) refers to is
/// alive: one that lies on this thread's stack below `frame` (a local of the frame that called
/// the block) was the block's own, freed when the block returned.
template <class R>
void check_block_leaves(const R& part, const void* frame) {
  const std::uintptr_t bottom = stack_bottom(), top = reinterpret_cast<std::uintptr_t>(frame);
  if (bottom == 0) return;
  for_each_tensor_leaf(part, [&](const auto& leaf) {
    const auto at = reinterpret_cast<std::uintptr_t>(&leaf.value());
    if (at >= bottom && at < top)
      // the tensor is not read: its storage is another frame's now
      throw error("its result is an expression (" + std::string(R::name) + ") that refers to a tensor the block made (or took by value), freed when it returned: return pdo::eval(...) of "
                  "such an expression (a tensor), and take the shards as const references (const auto&)");
  });
}

/// @brief The block's result on one place, called with `arguments` (a tuple in the caller's
/// frame); an expression that refers to a tensor the block kept on its stack is an error
/// (check_block_leaves), before anything reads it.
template <class Block, class Tuple>
PDO_NOINLINE decltype(auto) checked_block_call(Block& block, Tuple& arguments) {
  [[maybe_unused]] const char frame = 0;  // the block's frames lay below this one
  decltype(auto) part = apply_block(block, arguments);
  using part_t = std::remove_cvref_t<decltype(part)>;
  if constexpr (tensor_expression<part_t> && !is_tensor_v<part_t>) check_block_leaves(part, &frame);
  return part;
}

/// @brief A block's result on its place as a local tensor: a tensor as it is; an expression
/// of local tensors, evaluated there.
template <class R>
auto as_block_part(R&& r) {
  if constexpr (is_tensor_v<std::remove_cvref_t<R>>) return std::remove_cvref_t<R>(std::forward<R>(r));
  else return pdo::eval(std::forward<R>(r));
}

/// @brief Whether the blocks' parts may be merged as `Out`, given operands laid out as
/// `Layouts` (void for an argument that is not a dtensor): every mesh axis along which an
/// operand's blocks differ (a dim split over it, or a pending sum over it) must be one that
/// `Out` splits a dim over or sums over. Else the places along it would return different
/// parts that `Out` calls copies of one value (replicate), and the merged dtensor would hold
/// different "replicas": the mistake is refused at compile time, as the layouts' are.
template <class Out, class... Layouts>
consteval bool parts_mergeable() {
  constexpr layout_value out = value_of<Out>();
  bool ok = true;
  (
      [&] {
        if constexpr (!std::is_void_v<Layouts>) {
          constexpr layout_value v = value_of<Layouts>();
          for (std::size_t d = 0; d < v.rank; ++d) ok = ok && (v.dim_axis[d].empty() || uses_axis(out, v.dim_axis[d]));
          for (std::size_t i = 0; i < v.npartial; ++i) ok = ok && uses_axis(out, v.partial[i]);
        }
      }(),
      ...);
  return ok;
}

/// @brief The check of parts_mergeable, its error given once (a static_assert naming what to
/// change): `ok` says whether to go on.
template <class Out, class... Layouts>
struct check_parts_mergeable {
  static constexpr bool ok = parts_mergeable<Out, Layouts...>();
  static_assert(ok,
                "pdo: parallel_do: an operand is split (or a pending sum) over a mesh axis that the out layout replicates: the places "
                "along that axis return different parts, not copies of one value; split a dim of the result over that axis, make the "
                "result ::partial over it, or pass the operand replicated there");
};

/// @brief An argument's layout type, or void for one that is not a dtensor.
template <class Arg>
struct argument_layout {
  using type = void;
};
template <class Arg>
  requires distributed_tensor<Arg>
struct argument_layout<Arg> {
  using type = typename Arg::layout_type;
};

/// @brief Whether argument `Arg` is no dtensor, or one on a mesh of type `Mesh`.
template <class Arg, class Mesh>
constexpr bool on_mesh_type() {
  if constexpr (distributed_tensor<Arg>) return std::is_same_v<typename Arg::mesh_type, Mesh>;
  else return true;
}

/// @brief The check that every dtensor argument lives on a mesh of type `Mesh`, its error
/// given once, before the checks that compare their layouts: `ok` says whether to go on.
template <class Mesh, class... Args>
struct check_one_mesh_type {
  static constexpr bool ok = (on_mesh_type<Args, Mesh>() && ...);
  static_assert(ok, "pdo: parallel_do: all dtensor arguments must live on the same mesh type");
};

/// @brief Throws unless `arg` (when it is a dtensor) lives on `m` itself (its type is
/// checked by check_one_mesh_type).
template <class Arg, class Mesh>
void check_same_mesh(const Arg& arg, const Mesh& m) {
  if constexpr (distributed_tensor<Arg>) {
    if (!(arg.mesh() == m))
      throw layout_error("parallel_do: " + arg.describe() + " lives on another mesh than the first dtensor argument");
  }
}

template <class First, class... Rest>
const auto& first_dtensor(const First& first, const Rest&... rest) {
  if constexpr (distributed_tensor<First>) return first;
  else {
    static_assert(sizeof...(Rest) > 0, "pdo: parallel_do: pass at least one dtensor, so the mesh is known");
    return first_dtensor(rest...);
  }
}

/// @brief What every process learns about every place after the block ran: whether it
/// failed, and the shape of its result. Gathered over the whole mesh when the mesh
/// spans processes (so all of them throw alike, or none), read in place otherwise.
struct block_outcomes {
  std::vector<std::size_t> values;  ///< per place: 0, or 1 + the error_kind of its failure; then Rank extents
  std::size_t width = 0;
  [[nodiscard]] bool failed(std::size_t p) const { return values[p * width] != 0; }
  [[nodiscard]] error_kind kind(std::size_t p) const { return static_cast<error_kind>(values[p * width] - 1); }
  [[nodiscard]] std::size_t extent(std::size_t p, std::size_t d) const { return values[p * width + 1 + d]; }
};

template <class Mesh, class Result>
block_outcomes share_outcomes(const Mesh& m, const std::vector<std::optional<Result>>& results,
                              const std::vector<std::optional<captured_error>>& failures) {
  constexpr std::size_t rank = Result::rank;
  block_outcomes o{std::vector<std::size_t>(m.size() * (rank + 1), 0), rank + 1};
  auto mine = [&](std::size_t k) {
    std::vector<std::size_t> v(rank + 1, 1);
    if (failures[k]) v[0] = 1 + static_cast<std::size_t>(failures[k]->kind);
    if (results[k]) {
      v[0] = 0;
      for (std::size_t d = 0; d < rank; ++d) v[1 + d] = results[k]->extent(d);
    }
    return v;
  };
  const auto& local = m.local_places();
  if (!m.is_multiprocess()) {
    for (const auto [k, p] : views::enumerate(local)) {
      const auto v = mine(static_cast<std::size_t>(k));
      std::copy(v.begin(), v.end(), o.values.begin() + static_cast<std::ptrdiff_t>(p * o.width));
    }
    return o;
  }
  std::vector<std::vector<std::size_t>> gathered(local.size(), std::vector<std::size_t>(o.values.size()));
  run_on_places("parallel_do", m, [&](std::size_t p, std::size_t k) {
    const auto v = mine(k);
    host_communicator_of(m, p).all_gather(std::span<const std::size_t>(v), std::span<std::size_t>(gathered[k]));
  });
  o.values = gathered.front();
  return o;
}

/// @brief The message of place `failed`'s error, on every process.
template <class Mesh>
std::string share_message(const Mesh& m, std::size_t failed, const std::string& local_message) {
  if (!m.is_multiprocess()) return local_message;
  std::vector<std::string> texts(m.local_places().size());
  run_on_places("parallel_do", m, [&](std::size_t p, std::size_t k) {
    const auto comm = host_communicator_of(m, p);
    std::size_t length = p == failed ? local_message.size() : 0;
    comm.broadcast(std::span<std::size_t>(&length, 1), failed);
    std::vector<char> text(length);
    if (p == failed) text.assign(local_message.begin(), local_message.end());
    comm.broadcast(std::span<char>(text), failed);
    texts[k].assign(text.begin(), text.end());
  });
  return texts.front();
}

template <layout_spec Out, class Mesh, std::size_t Rank>
void check_merge(const Mesh& m, const block_outcomes& o, shape_t<Rank>& global) {
  constexpr layout_value v = value_of<Out>();
  auto shape_of = [&](std::size_t p) {
    shape_t<Rank> s;
    for (std::size_t d = 0; d < Rank; ++d) s[d] = o.extent(p, d);
    return s;
  };
  for (std::size_t d = 0; d < Rank; ++d) {
    global[d] = o.extent(0, d);
    if (!v.dim_axis[d].empty()) {
      const std::size_t a = Mesh::axis_index(v.dim_axis[d]);
      global[d] = 0;
      for (std::size_t q : m.group(a, 0)) global[d] += o.extent(q, d);
    }
  }
  for (std::size_t p = 0; p < m.size(); ++p)
    if (shard_shape(m, v, global, p) != shape_of(p)) {
      // which place is the odd one is not known (the global shape was taken from the first
      // places' parts): every place's part is named
      constexpr std::size_t named = 16;
      std::string parts;
      for (std::size_t q = 0; q < m.size() && q < named; ++q)
        parts += (q == 0 ? "" : ", ") + m.place(q).name() + " " + format_extents(shape_of(q));
      if (m.size() > named) parts += ", ... (" + std::to_string(m.size() - named) + " more)";
      throw shape_error("parallel_do: merging as " + to_string(v) + " on " + m.describe() +
                        ": the places' parts do not make one tensor; they returned " + parts +
                        " (split dims are cut evenly, larger chunks first; other dims must agree)");
    }
}

}  // namespace detail

namespace detail {

/// @brief Runs `part(p, k)` (place p, the k-th of this process) on every place of `m` in
/// this process, all at once, and merges the tensors they return into a dtensor laid out as
/// `OutLayout`: a part that failed, or parts whose shapes do not fit the layout, are a
/// pdo::error on every process, naming the place and the shapes; the mesh stays usable.
template <layout_spec OutLayout, class Mesh, class Part, class Access = no_access>
auto merge_parts(const Mesh& m, Part&& part, Access reads = {}) {
  using result_t = std::remove_cvref_t<std::invoke_result_t<Part&, std::size_t, std::size_t>>;
  using T = typename result_t::value_type;
  constexpr std::size_t rank = result_t::rank;
  check_not_nested("parallel_do");
  const auto& local = m.local_places();
  check_holds_places(m, "parallel_do");
  std::vector<std::optional<result_t>> results(local.size());
  std::vector<char> started(local.size(), 0);  // a task cancelled by a failure of what it reads never starts its block
  const auto batch = run_batch_on_places(
      m,
      [&](std::size_t p, std::size_t k) {
        started[k] = 1;
        result_t r = part(p, k);
        // a part made in another memory than its place's (a host tensor on a GPU place) moves there
        if (memory_of(r.where()) != memory_of(m.place(p).state().get())) r = to_place(r, m.place(p));
        results[k].emplace(std::move(r));
      },
      /*communicate=*/false, "parallel_do", "task", reads);
  const block_outcomes outcomes = share_outcomes(m, results, batch->failures);
  // the place whose error is reported, the same on every process: the first that failed by
  // itself, else the first whose collective was aborted by another's failure
  std::optional<std::size_t> reported;
  for (std::size_t p = 0; p < m.size(); ++p)
    if (outcomes.failed(p) && (!reported || tells_more_than(outcomes.kind(p), outcomes.kind(*reported))))
      reported = p;
  if (reported) {
    const std::size_t p = *reported;
    std::string here;
    for (std::size_t k = 0; k < local.size(); ++k)
      if (local[k] == p && batch->failures[k])
        here = (started[k] != 0 ? "the block failed on place " + m.place(p).name() + ": "
                                : "the block did not run on place " + m.place(p).name() + ": an operation whose result it reads failed: ") +
               batch->failures[k]->message;
    throw_error_of_kind(outcomes.kind(p), "parallel_do: " + share_message(m, p, here));
  }
  shape_t<rank> global{};
  check_merge<OutLayout>(m, outcomes, global);
  std::vector<tensor<T, rank>> shards;
  shards.reserve(local.size());
  for (auto& r : results) shards.push_back(std::move(*r));
  return dtensor<T, rank, Mesh, OutLayout>(m, global, std::move(shards));
}

/// @brief parallel_do once its block is known to return a part: the layout and mesh checks
/// (each error given once, a value of type `Unformed` standing for the result after it),
/// then the run.
template <layout_spec OutLayout, class Unformed, class Block, class... Args>
auto parallel_do_checked(Block& block, const Args&... args) {
  using returned_t = std::invoke_result_t<Block&, detail::local_view_t<Args>...>;
  using result_t = decltype(detail::as_block_part(std::declval<returned_t>()));
  using mesh_t = typename std::remove_cvref_t<decltype(detail::first_dtensor(args...))>::mesh_type;
  if constexpr (!detail::check_layout<"parallel_do", OutLayout, mesh_t, result_t::rank>::ok) {
    return detail::unformed_result<Unformed>();
  } else if constexpr (!detail::check_one_mesh_type<mesh_t, Args...>::ok) {
    return detail::unformed_result<Unformed>();
  } else if constexpr (!detail::check_parts_mergeable<OutLayout, typename detail::argument_layout<Args>::type...>::ok) {
    return detail::unformed_result<Unformed>();
  } else {
    const mesh_t& m = detail::first_dtensor(args...).mesh();
    (detail::check_same_mesh(args, m), ...);
    return detail::merge_parts<OutLayout>(
        m,
        [&](std::size_t p, std::size_t) -> result_t {
          auto views = std::forward_as_tuple(detail::local_view(args, p)...);
          return detail::as_block_part(detail::checked_block_call(block, views));
        },
        [&](std::size_t, std::size_t k) { return detail::shards_read(k, args...); });
  }
}

}  // namespace detail

/// @brief Runs `block` on every place of the mesh at once, on its local shards: each
/// dtensor argument arrives as that place's shard (a `const pdo::tensor&`), any other
/// argument as it is. The block returns that place's part of the result (a pdo::tensor, or
/// an expression of local tensors, evaluated on the place), and the parts are merged as
/// `OutLayout` says: concatenated along a split dim, summed over a partial axis, kept as
/// they are for replicate (each place's copy is its replica). A mesh axis that an operand
/// is split or partial over must be one that `OutLayout` splits or sums over: else the
/// places along it would return different parts that the result calls replicas, a
/// compile error.
///
/// An exception thrown by the block on some place reaches the caller, on every process,
/// as a pdo::error naming the place; the other places finish their blocks, and the
/// mesh stays usable. (With `pdo::var` operands, pdo/autograd/parallel_do.hpp's overload
/// records the block for pdo::backward.)
template <layout_spec OutLayout, class Block, class... Args>
  requires((distributed_tensor<Args> || ...) && !(detail::is_distributed_var_v<Args> || ...))
auto parallel_do(Block&& block, const Args&... args) {
  // each check's error is given once, with nothing instantiated after it (a value of the
  // type the result would most likely have had stands for the result)
  using first_t = std::remove_cvref_t<decltype(detail::first_dtensor(args...))>;
  using unformed_t = detail::replicated_dtensor_t<typename first_t::value_type, OutLayout::rank, typename first_t::mesh_type>;
  if constexpr (!std::is_invocable_v<Block&, detail::local_view_t<Args>...>) {
    static_assert(detail::always_false<Block>,
                  "pdo: parallel_do: the block cannot be called with the arguments as it receives them: a dtensor's local shard "
                  "as a const pdo::tensor<T, Rank>& (same element type and rank; take it as const auto&), any other argument as "
                  "it is, one parameter per argument in order");
    return detail::unformed_result<unformed_t>();
  } else {
    using returned_t = std::invoke_result_t<Block&, detail::local_view_t<Args>...>;
    constexpr bool part_ok = detail::is_block_part<std::remove_cvref_t<returned_t>>();
    static_assert(part_ok,
                  "pdo: parallel_do: the block must return a pdo::tensor or an expression of local tensors (its place's part of the result)");
    if constexpr (!part_ok) {
      return detail::unformed_result<unformed_t>();
    } else {
      return detail::parallel_do_checked<OutLayout, unformed_t>(block, args...);
    }
  }
}

namespace detail {
/// @brief What parallel_do gives after rejecting a call without a dtensor argument, so that
/// the program's uses of the result report nothing more: no argument names a mesh or an
/// element type, so a float dtensor of the layout's rank, replicated on a one-axis mesh.
template <layout_spec OutLayout>
using meshless_parallel_do_t = replicated_dtensor_t<float, OutLayout::rank, mesh<"x">>;
}  // namespace detail

/// @brief Rejects parallel_do without a dtensor argument: the mesh it runs on is that of its
/// dtensor arguments.
template <layout_spec OutLayout, class Block, class... Args>
  requires(!(distributed_tensor<Args> || ...) && !(detail::is_distributed_var_v<Args> || ...))
auto parallel_do(Block&&, const Args&...) {
  static_assert(detail::always_false<Block>, "pdo: parallel_do: needs a dtensor argument, whose mesh it runs on (each place's block "
                                             "gets that place's shard): distribute the tensor first, pdo::distribute<Layout>(mesh, t)");
  return detail::unformed_result<detail::meshless_parallel_do_t<OutLayout>>();
}

}  // namespace pdo
