// pdo/comm/group_communicator.hpp: a member's endpoint on a group, for any backend's group type.
#pragma once

#include <pdo/comm/communicator_concept.hpp>
#include <pdo/core/dtype.hpp>
#include <pdo/core/error.hpp>
#include <pdo/core/timeline.hpp>

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

namespace pdo {

namespace detail {
/// @brief Calls `f` with the backend group behind `g`; groups that choose their backend
/// at run time (any_group) overload it.
template <class Group, class F>
decltype(auto) visit_group(Group& g, F&& f) {
  return std::forward<F>(f)(g);
}
/// @brief How the timeline names a group; groups that know their mesh axis overload it.
template <class Group>
std::string group_label(const Group&) {
  return "a group";
}
}  // namespace detail

/// @brief Member `rank()` of a group of places; see pdo::communicator for the contract.
/// @tparam Group a backend group: detail::local_group (threads), mpi::detail::group,
///         or detail::any_group (whichever the mesh was built on).
template <class Group>
class group_communicator {
 public:
  /// @brief Marks this class as a communicator (see pdo::communicator).
  using communicator_tag = void;

  /// @brief Member `member` (0 to the group's size - 1) of `group`, which copies of the endpoint share.
  group_communicator(std::shared_ptr<Group> group, std::size_t member) : group_(std::move(group)), member_(member) {}

  /// @brief The number of members of the group.
  [[nodiscard]] std::size_t size() const {
    using detail::visit_group;
    return visit_group(*group_, [](auto& g) { return g.size(); });
  }
  /// @brief This endpoint's member index in the group, from 0.
  [[nodiscard]] std::size_t rank() const { return member_; }

  /// @brief Returns once every member of the group has called barrier().
  void barrier() const {
    const detail::timeline_span span("collective", "barrier", [&] { return describe(0); });
    with([&](auto& g) { g.barrier(member_); });
  }
  /// @brief `data` = op over members of their `data` (same size on all).
  template <element T>
  void all_reduce(std::span<T> data, reduce_op op = reduce_op::sum) const {
    const detail::timeline_span span("collective", "all_reduce", [&] { return describe(data.size_bytes()); });
    with([&](auto& g) { g.all_reduce(member_, data, op); });
  }
  /// @brief The sum over members of their `data` (same size on all), consumed where it is
  /// made instead of stored: each member's `consume` receives every range of the sum (see
  /// pdo::reduced_consumer), an all_reduce fused with what reads its result. Over shared memory
  /// (the threads backend) each member sums its part of the elements block by block and hands
  /// each block to every member's consumer while it is in cache: one pass over memory, the sum
  /// never written. Over MPI `data` is all_reduced in place and handed whole to this member's
  /// consumer. Either way the sum is the all_reduce's, bitwise; `data` may be left as it was or
  /// summed. The consumer runs on the host: over a group of GPU places (NCCL, or staged through
  /// host memory), whose buffers are device memory, it is a pdo::communication_error.
  template <element T>
  void all_reduce_apply(std::span<T> data, reduced_consumer<T> consume) const {
    const detail::timeline_span span("collective", "all_reduce", [&] { return describe(data.size_bytes()) + ", fused with its consumer"; });
    with([&](auto& g) {
      using group_t = std::remove_cvref_t<decltype(g)>;
      if constexpr (requires { group_t::device_buffers; }) {
        throw communication_error("all_reduce_apply: over " + describe(data.size_bytes()) +
                                  ": a group of GPU places, whose buffers the host consumer cannot read; all_reduce, then "
                                  "consume the result on the places");
      } else if constexpr (requires { g.all_reduce_apply(member_, std::span<const T>(data), consume); }) {
        g.all_reduce_apply(member_, std::span<const T>(data), consume);
      } else {
        g.all_reduce(member_, data, reduce_op::sum);
        consume(0, data.size(), data.data());
      }
    });
  }
  /// @brief `out` = every member's `in`, concatenated in member order (sizes may differ).
  template <element T>
  void all_gather(std::span<const T> in, std::span<T> out) const {
    const detail::timeline_span span("collective", "all_gather", [&] { return describe(out.size_bytes()); });
    with([&](auto& g) { g.all_gather(member_, in, out); });
  }
  /// @brief `out` = this member's segment of op over members of `in`; segment k has the
  /// size member k passes as `out`.
  template <element T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op = reduce_op::sum) const {
    const detail::timeline_span span("collective", "reduce_scatter", [&] { return describe(in.size_bytes()); });
    with([&](auto& g) { g.reduce_scatter(member_, in, out, op); });
  }
  /// @brief `data` = member `root`'s `data`.
  template <element T>
  void broadcast(std::span<T> data, std::size_t root) const {
    const detail::timeline_span span("collective", "broadcast", [&] { return describe(data.size_bytes()); });
    with([&](auto& g) { g.broadcast(member_, data, root); });
  }
  /// @brief Piece j of `in` (send_counts[j] elements) goes to member j; `out` holds the
  /// pieces received from members 0..n-1 in order (recv_counts[i] elements from i).
  template <element T>
  void all_to_all(std::span<const T> in, std::span<const std::size_t> send_counts, std::span<T> out,
                  std::span<const std::size_t> recv_counts) const {
    const detail::timeline_span span("collective", "all_to_all", [&] { return describe(in.size_bytes()); });
    with([&](auto& g) { g.all_to_all(member_, in, send_counts, out, recv_counts); });
  }
  /// @brief Sends `data` to member `to`; returns once it has been received.
  template <element T>
  void send(std::span<const T> data, std::size_t to, int tag = 0) const {
    const detail::timeline_span span("collective", "send", [&] { return describe(data.size_bytes()); });
    with([&](auto& g) { g.send(member_, data, to, tag); });
  }
  /// @brief Receives exactly `data.size()` elements from member `from`.
  template <element T>
  void recv(std::span<T> data, std::size_t from, int tag = 0) const {
    const detail::timeline_span span("collective", "recv", [&] { return describe(data.size_bytes()); });
    with([&](auto& g) { g.recv(member_, data, from, tag); });
  }

 private:
  /// @brief The timeline's detail of a collective: its group, this member, the bytes it passes.
  [[nodiscard]] std::string describe(std::size_t bytes) const {
    using detail::group_label;
    return "over " + group_label(*group_) + ", member " + std::to_string(member_) + " of " + std::to_string(size()) + ", " +
           std::to_string(bytes) + " bytes";
  }

  template <class F>
  void with(F&& f) const {
    using detail::visit_group;  // and, found by ADL, the overloads of run-time chosen groups
    visit_group(*group_, std::forward<F>(f));
  }

  std::shared_ptr<Group> group_;
  std::size_t member_;
};

}  // namespace pdo
