// pdo/place/place_concept.hpp: the `place` concept and the type-erased place handle.
#pragma once

#include <pdo/core/error.hpp>
#include <pdo/place/place_state.hpp>

#include <concepts>
#include <memory>
#include <string>
#include <utility>

namespace pdo {

/// @brief A place: one device that owns memory and runs work (CPU cores, a GPU).
/// Types opt in with a nested `using place_tag = void;` and expose their shared state.
template <class P>
concept place = requires(const P& p) {
  typename P::place_tag;
  { p.kind() } -> std::same_as<place_kind>;
  { p.name() } -> std::convertible_to<std::string>;
  { p.is_local() } -> std::same_as<bool>;
  { p.state() } -> std::same_as<const std::shared_ptr<detail::place_state>&>;
};

/// @brief Work queued on one place by its `submit`: whether it has ended, and what it threw.
class place_task {
 public:
  /// @brief No work (ready, and wait() returns at once).
  place_task() = default;
  /// @brief The queued task `t` (what `submit` returns).
  explicit place_task(detail::task_handle t) : task_(std::move(t)) {}
  /// @brief Whether the work has ended, by returning or by throwing.
  [[nodiscard]] bool ready() const { return !task_ || task_->ended.load(std::memory_order_acquire); }
  /// @brief Waits until the work has ended; throws what it threw, as a pdo::error of the
  /// same kind whose message begins "submit on <place>: ". Called on the place's own lane
  /// (inside work it runs) before the work has ended, a pdo::error: it would wait forever.
  void wait() const {
    if (task_) detail::wait(task_);
  }

 private:
  detail::task_handle task_;
};

namespace detail {

/// @brief The members every place handle has; a handle is a shared reference to
/// its state, cheap to copy, equal when it names the same place.
template <class Derived>
class place_handle {
 public:
  using place_tag = void;

  [[nodiscard]] place_kind kind() const { return state_->kind; }
  [[nodiscard]] const std::string& name() const { return state_->name; }
  [[nodiscard]] bool is_local() const { return state_->local; }
  [[nodiscard]] int process() const { return state_->process; }
  [[nodiscard]] int ordinal() const { return state_->ordinal; }
  [[nodiscard]] const std::vector<int>& cores() const { return state_->cores; }
  [[nodiscard]] const std::shared_ptr<place_state>& state() const { return state_; }

  /// @brief The place's allocator; only places of this process have one.
  [[nodiscard]] caching_allocator& memory() const {
    if (!state_->memory) throw layout_error("memory: place " + state_->name + " belongs to another process");
    return *state_->memory;
  }
  /// @brief Runs `task` on the place's compute lane, after the work queued there before it
  /// (not ordered by pdo's engine with the evaluations that read or write the same tensors:
  /// wait for those first); returns at once. What it throws reaches the returned handle's
  /// wait(), so the handle is not to be dropped.
  template <class Task>
  [[nodiscard]] place_task submit(Task&& task) const {
    if (!state_->local) throw layout_error("submit: place " + state_->name + " belongs to another process");
    return place_task(detail::queue_on_lane(*state_, detail::task(std::forward<Task>(task)), "submit"));
  }

  friend bool operator==(const Derived& a, const Derived& b) { return a.state_ == b.state_; }

 protected:
  place_handle() = default;
  explicit place_handle(std::shared_ptr<place_state> s) : state_(std::move(s)) {}
  std::shared_ptr<place_state> state_;
};

}  // namespace detail

/// @brief Any place, whatever its kind: what a mesh holds.
class any_place : public detail::place_handle<any_place> {
 public:
  /// @brief The place `p`, of any kind (implicit: a place is an any_place); copies share its state.
  template <place P>
    requires(!std::same_as<P, any_place>)
  any_place(const P& p) : place_handle(p.state()) {}  // NOLINT: implicit, a place is an any_place
  /// @brief A handle on the place whose state is `s`.
  explicit any_place(std::shared_ptr<detail::place_state> s) : place_handle(std::move(s)) {}
};

}  // namespace pdo
