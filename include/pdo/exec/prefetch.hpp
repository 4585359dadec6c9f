// pdo/exec/prefetch.hpp: prefetch, work that moves the next inputs to their places while the
// current step runs: engine tasks on the places' copy lanes, waited for when the inputs are
// needed.
#pragma once

#include <pdo/exec/engine.hpp>
#include <pdo/exec/mesh_ops.hpp>
#include <pdo/exec/run_on_places.hpp>
#include <pdo/layout/layout_check.hpp>
#include <pdo/tensor/dtensor.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo {

/// @brief Work queued on copy lanes that gives a `Result` (the inputs of a later step, in
/// their places' memory): `get()` waits for it and gives the result, or throws the error it
/// failed with (a pdo::error naming the op and place). Destroying a prefetched that was not
/// taken waits for its work, so the work never outlives what it reads.
template <class Result>
class prefetched {
 public:
  prefetched() = default;
  /// @brief `tasks`' work fills the result; `take()` makes it, once they have all ended.
  prefetched(std::vector<detail::task_handle> tasks, std::function<Result()> take)
      : tasks_(std::move(tasks)), take_(std::move(take)) {}
  /// @brief Takes over `other`'s work and result.
  prefetched(prefetched&&) noexcept = default;
  /// @brief Waits for this one's own work (its result is dropped), then takes over `other`'s.
  prefetched& operator=(prefetched&& other) noexcept {
    if (this != &other) {
      finish();
      tasks_ = std::move(other.tasks_);
      take_ = std::move(other.take_);
    }
    return *this;
  }
  prefetched(const prefetched&) = delete;
  prefetched& operator=(const prefetched&) = delete;
  ~prefetched() { finish(); }

  /// @brief Whether the work has ended (get() will not wait).
  [[nodiscard]] bool ready() const {
    for (const auto& t : tasks_)
      if (!t->ended.load(std::memory_order_acquire)) return false;
    return true;
  }
  /// @brief Whether it holds work whose result was not taken yet.
  [[nodiscard]] bool valid() const { return static_cast<bool>(take_); }

  /// @brief Waits for the work and gives its result (once).
  Result get() {
    if (!take_) throw error("prefetched::get: nothing to take (the result was taken, or nothing was prefetched)");
    finish_checked();
    auto take = std::move(take_);
    take_ = nullptr;
    tasks_.clear();
    return take();
  }

 private:
  void finish() noexcept {
    for (const auto& t : tasks_) t->wait_ended();
  }
  void finish_checked() {
    std::optional<detail::captured_error> first;
    for (const auto& t : tasks_) {
      detail::check_not_own_lane(*t, t->op);
      t->wait_ended();
      if (!first) first = detail::outcome(*t);
    }
    if (first) first->rethrow_with_context(std::string("prefetch: "));
  }

  std::vector<detail::task_handle> tasks_;
  std::function<Result()> take_;
};

/// @brief Runs `f()` on `where`'s copy lane while the caller goes on; get() gives what it
/// returned. For inputs made by a function of the caller's (cut, decoded, copied to a GPU).
/// `f` runs with `where` as its place: tensors it makes without naming a place live there.
template <class F>
auto prefetch(const any_place& where, F f) {
  using result_t = std::invoke_result_t<F&>;
  auto slot = std::make_shared<std::optional<result_t>>();
  detail::task_request request;
  request.home = &detail::lane_of(*where.state(), lane_kind::copy);
  request.op = "prefetch";
  request.category = "copy";
  request.uses.writes.push_back(slot.get());
  request.fn = [slot, f = std::move(f)]() mutable { slot->emplace(f()); };
  std::vector<detail::task_handle> tasks{detail::engine::instance().submit(std::move(request))};
  return prefetched<result_t>(std::move(tasks), [slot] { return std::move(**slot); });
}

/// @brief `pdo::distribute<Layout>(m, host)` done on the places' copy lanes while the caller
/// goes on: each place of this process cuts its shard into its own memory (copied up to a
/// GPU), all at once. The host tensor is moved in (pass a copy to keep yours). get() gives
/// the dtensor; every process passes the same host tensor.
template <layout_spec Layout, mesh_type Mesh, element T, std::size_t Rank>
auto prefetch(const Mesh& m, tensor<T, Rank> host) {
  if constexpr (!detail::check_layout<"prefetch", Layout, Mesh, Rank>::ok) {
    return 0;  // the layout's error was given: nothing more after it
  } else {
    detail::check_not_nested("prefetch");
    struct state {
      tensor<T, Rank> host;
      std::vector<tensor<T, Rank>> shards;
    };
    auto s = std::make_shared<state>(state{std::move(host), std::vector<tensor<T, Rank>>(m.local_places().size())});
    const bool multiprocess = m.is_multiprocess();
    auto batch = detail::submit_on_places(
        m,
        [s, m, multiprocess](std::size_t p, std::size_t k) {
          if (multiprocess) detail::check_same_host_shapes(m, p, s->host.shape());
          s->shards[k] = detail::shard_of<Layout>(m, s->host, p);
        },
        detail::batch_options{"prefetch", "copy", multiprocess, false, lane_kind::copy},
        [raw = s.get()](std::size_t, std::size_t k) {
          detail::access a;
          a.writes.push_back(&raw->shards[k]);
          return a;
        });
    return prefetched<dtensor<T, Rank, Mesh, Layout>>(batch->tasks, [s, batch, m]() {
      if (const auto failure = batch->first_failure()) detail::rethrow_on_place(*m.state(), *failure, "prefetch");
      return dtensor<T, Rank, Mesh, Layout>(m, s->host.shape(), std::move(s->shards));
    });
  }
}

}  // namespace pdo
