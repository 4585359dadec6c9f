// pdo/comm/communicator_concept.hpp: what every communicator backend provides.
#pragma once

#include <pdo/core/dtype.hpp>

#include <concepts>
#include <cstddef>
#include <span>

namespace pdo {

/// @brief What consumes the sum of an all_reduce_apply (group_communicator::all_reduce_apply):
/// `call(context, lo, hi, sum)` takes elements [lo, hi) of the sum, `sum[0]` being element lo.
/// It may be called from the thread of another member of the group, once for each range, the
/// ranges together covering the elements once; it writes only its own member's outputs.
template <class T>
struct reduced_consumer {
  /// @brief What consumes a range: `call(context, lo, hi, sum)`.
  void (*call)(const void* context, std::size_t lo, std::size_t hi, const T* sum) = nullptr;
  /// @brief What `call` is given first: the consumer's own state.
  const void* context = nullptr;
  /// @brief Hands elements [lo, hi) of the sum (`sum[0]` is element lo) to `call`.
  void operator()(std::size_t lo, std::size_t hi, const T* sum) const { call(context, lo, hi, sum); }
};

/// @brief One member's endpoint on a group of places (a mesh axis, or the whole mesh).
///
/// Every collective is called by all members of the group at once, each with its own
/// buffers (SPMD). Reductions sum in a fixed order, so results are bitwise identical
/// from run to run on a fixed group. Arguments that disagree across members (sizes,
/// roots) raise pdo::communication_error on every member; they never hang.
/// Backends opt in with `using communicator_tag = void;`.
template <class C>
concept communicator = requires(const C& c, std::span<float> f, std::span<const float> cf,
                                std::span<const std::size_t> counts) {
  typename C::communicator_tag;
  { c.size() } -> std::same_as<std::size_t>;
  { c.rank() } -> std::same_as<std::size_t>;
  c.barrier();
  c.all_reduce(f, reduce_op::sum);
  c.all_gather(cf, f);
  c.reduce_scatter(cf, f, reduce_op::sum);
  c.broadcast(f, std::size_t{0});
  c.all_to_all(cf, counts, f, counts);
  c.send(cf, std::size_t{0}, 0);
  c.recv(f, std::size_t{0}, 0);
};

}  // namespace pdo
