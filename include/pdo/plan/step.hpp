// pdo/plan/step.hpp: one step of an expression's plan, and the record of the steps evaluation runs.
#pragma once

#include <pdo/layout/layout_value.hpp>
#include <pdo/layout/redistribute_plan.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <mutex>
#include <string_view>
#include <vector>

namespace pdo {

/// @brief What one step of an expression's plan does.
enum class plan_step_kind {
  kernel,        ///< an op's local kernel (on every place at once)
  redistribute,  ///< one step bringing an operand to the layout its op needs
  combine_max,   ///< an all_reduce(max) over an axis after the kernel (max over a split dim)
  halo_exchange, ///< a window op's (conv2d, pooling) input widened by the rows of its neighbours along a split
                 ///< height or width: move.axis, move.dim (2 or 3), move.before = move.after = its layout
};

/// @brief One step of a plan. Nodes are numbered in evaluation order (post-order, leaves
/// included), so a step names the op it belongs to and, for a redistribution, the operand.
struct plan_step {
  plan_step_kind kind{};          ///< what the step does
  std::string_view op;            ///< the op the step belongs to ("matmul", "relu")
  std::size_t node = 0;           ///< that op's node number
  std::size_t operand = 0;        ///< redistribute: which operand of the op
  std::size_t operand_node = 0;   ///< redistribute: that operand's node number
  bool fused = false;             ///< kernel: runs inside the kernel of the op that consumes it
  std::size_t into = 0;           ///< fused kernel: the node whose kernel runs it
  redistribute_step move{};       ///< redistribute: the step; combine_max: its axis and layouts
  detail::layout_value layout{};  ///< kernel: the op's output layout
};

/// @brief Whether two steps do the same thing (the same kind of step of the same op, the same
/// operand, fusion, collective, axis and layouts), whatever their node numbers.
constexpr bool same_work(const plan_step& a, const plan_step& b) {
  if (a.kind != b.kind || a.op != b.op) return false;
  switch (a.kind) {
    case plan_step_kind::kernel: return a.fused == b.fused && a.layout == b.layout;
    case plan_step_kind::redistribute:
      return a.operand == b.operand && a.move.kind == b.move.kind && a.move.axis == b.move.axis && a.move.dim == b.move.dim &&
             a.move.from_dim == b.move.from_dim && a.move.before == b.move.before &&
             a.move.after == b.move.after;
    case plan_step_kind::combine_max: return a.move.axis == b.move.axis;
    case plan_step_kind::halo_exchange:
      return a.operand == b.operand && a.move.axis == b.move.axis && a.move.dim == b.move.dim && a.move.before == b.move.before;
  }
  return false;
}

namespace detail {

/// @brief The steps evaluation ran, per place (a local evaluation is place 0), while a
/// recorder is installed: what a test compares with plan_of, step for step. Each is recorded
/// by the code that ran it, with the index of the plan step it ran: steps that do not depend
/// on each other may run at once on a place's lanes, and are listed in the plan's order.
class step_recorder {
 public:
  step_recorder() { active().store(this, std::memory_order_release); }
  ~step_recorder() { active().store(nullptr, std::memory_order_release); }
  step_recorder(const step_recorder&) = delete;
  step_recorder& operator=(const step_recorder&) = delete;

  /// @brief The steps place `place` ran, in the order of their index in the plan (a
  /// recorder watches one evaluation).
  [[nodiscard]] std::vector<plan_step> of(std::size_t place) const {
    std::lock_guard lock(mutex_);
    std::vector<plan_step> out;
    if (place >= steps_.size()) return out;
    auto ran = steps_[place];
    std::stable_sort(ran.begin(), ran.end(), [](const entry& a, const entry& b) { return a.index < b.index; });
    for (const auto& e : ran) out.push_back(e.step);
    return out;
  }
  /// @brief Whether a recorder is installed: evaluation builds the steps it records only then.
  [[nodiscard]] static bool on() { return active().load(std::memory_order_acquire) != nullptr; }

  /// @brief Records `s`, step `index` of its plan, as run on `place`, if a recorder is installed.
  static void record(std::size_t place, std::size_t index, const plan_step& s) {
    step_recorder* r = active().load(std::memory_order_acquire);
    if (r == nullptr) return;
    std::lock_guard lock(r->mutex_);
    if (r->steps_.size() <= place) r->steps_.resize(place + 1);
    r->steps_[place].push_back({index, s});
  }

 private:
  struct entry {
    std::size_t index = 0;
    plan_step step;
  };
  static std::atomic<step_recorder*>& active() {
    static std::atomic<step_recorder*> current{nullptr};
    return current;
  }
  mutable std::mutex mutex_;
  std::vector<std::vector<entry>> steps_;
};

}  // namespace detail
}  // namespace pdo
