// pdo/layout/redistribute_plan.hpp: the constexpr plan that turns one layout into another.
#pragma once

#include <pdo/layout/layout_value.hpp>

#include <array>
#include <cstddef>
#include <string>
#include <string_view>

namespace pdo {

/// @brief One step of a redistribution, along one mesh axis.
enum class step_kind {
  all_reduce,      ///< partial -> replicate
  reduce_scatter,  ///< partial -> split(dim)
  all_gather,      ///< split(dim) -> replicate
  all_to_all,      ///< split(from_dim) -> split(dim)
  local_slice,     ///< replicate -> split(dim): each place keeps its chunk, nothing moves
  keep_on_one,     ///< replicate -> partial: coordinate 0 keeps the value, the others hold zeros
  zero_pad,        ///< split(dim) -> partial: each place puts its chunk in zeros of the full dim
};

constexpr std::string_view step_name(step_kind k) {
  switch (k) {
    case step_kind::all_reduce: return "all_reduce";
    case step_kind::reduce_scatter: return "reduce_scatter";
    case step_kind::all_gather: return "all_gather";
    case step_kind::all_to_all: return "all_to_all";
    case step_kind::local_slice: return "local_slice";
    case step_kind::keep_on_one: return "keep_on_one";
    case step_kind::zero_pad: return "zero_pad";
  }
  return "?";
}

/// @brief True for the steps that communicate.
constexpr bool communicates(step_kind k) {
  return k != step_kind::local_slice && k != step_kind::keep_on_one && k != step_kind::zero_pad;
}

/// @brief One step of a redistribute_plan: a collective (or a local step) along one mesh axis,
/// with the layouts before and after it.
struct redistribute_step {
  step_kind kind{};       ///< what the step does
  std::string_view axis;  ///< the mesh axis it runs along
  std::size_t dim = 0;       ///< the dim gathered, scattered or sliced (the target dim of all_to_all)
  std::size_t from_dim = 0;  ///< all_to_all: the dim split before
  /// @brief The layout before the step.
  detail::layout_value before, after;
  /// @var after
  /// @brief The layout after the step.
};

/// @brief The steps from one layout to another, in order. A value: usable in
/// static_assert, printable with describe().
struct redistribute_plan {
  std::size_t size = 0;  ///< the number of steps in use, at the front of `steps`
  std::array<redistribute_step, 2 * (detail::max_rank + detail::max_axes)> steps{};  ///< the steps, in order

  /// @brief The first step.
  [[nodiscard]] constexpr const redistribute_step* begin() const { return steps.data(); }
  /// @brief Past the last step in use (steps + size).
  [[nodiscard]] constexpr const redistribute_step* end() const { return steps.data() + size; }
  /// @brief How many steps of kind `k` the plan has.
  [[nodiscard]] constexpr std::size_t count(step_kind k) const {
    std::size_t n = 0;
    for (std::size_t i = 0; i < size; ++i) n += steps[i].kind == k;
    return n;
  }
  /// @brief How many steps communicate (all but local_slice, keep_on_one and zero_pad).
  [[nodiscard]] constexpr std::size_t collectives() const {
    std::size_t n = 0;
    for (std::size_t i = 0; i < size; ++i) n += communicates(steps[i].kind);
    return n;
  }
};

namespace detail {

struct axis_state {
  enum { replicated, split, partial } kind = replicated;
  std::size_t dim = 0;
  friend constexpr bool operator==(const axis_state&, const axis_state&) = default;
};

constexpr axis_state state_on(const layout_value& v, std::string_view axis) {
  if (v.is_partial(axis)) return {axis_state::partial, 0};
  const std::size_t d = v.split_dim(axis);
  if (d < v.rank) return {axis_state::split, d};
  return {};
}

/// @brief The plan from `from` to `to` (same rank). Two passes over the axes the
/// layouts name, partial axes first (reducing before gathering moves the least data):
/// first every axis leaves its old state (reductions and gathers, fused into
/// reduce_scatter or all_to_all where the target dim is free; split -> partial pads
/// with zeros in place), then every axis still replicated takes its new state (local
/// slices, keep-on-one), which moves nothing.
constexpr redistribute_plan plan_redistribute(layout_value from, layout_value to) {
  redistribute_plan plan;
  std::array<std::string_view, 2 * (max_rank + max_axes)> axes{};
  std::size_t naxes = 0;
  auto note = [&](std::string_view a) {
    if (a.empty()) return;
    for (std::size_t i = 0; i < naxes; ++i)
      if (axes[i] == a) return;
    axes[naxes++] = a;
  };
  for (std::size_t i = 0; i < from.npartial; ++i) note(from.partial[i]);
  for (std::size_t d = 0; d < from.rank; ++d) note(from.dim_axis[d]);
  for (std::size_t d = 0; d < to.rank; ++d) note(to.dim_axis[d]);
  for (std::size_t i = 0; i < to.npartial; ++i) note(to.partial[i]);

  layout_value cur = from;
  auto push = [&](step_kind k, std::string_view a, std::size_t dim, std::size_t from_dim, const layout_value& next) {
    plan.steps[plan.size++] = {k, a, dim, from_dim, cur, next};
    cur = next;
  };
  for (std::size_t i = 0; i < naxes; ++i) {
    const std::string_view a = axes[i];
    const axis_state f = state_on(cur, a), t = state_on(to, a);
    if (f == t) continue;
    layout_value next = cur;
    const bool target_free = t.kind == axis_state::split && cur.dim_axis[t.dim].empty();
    if (f.kind == axis_state::partial) {
      next.remove_partial(a);
      if (target_free) {
        next.dim_axis[t.dim] = a;
        push(step_kind::reduce_scatter, a, t.dim, t.dim, next);
      } else {
        push(step_kind::all_reduce, a, 0, 0, next);
      }
    } else if (f.kind == axis_state::split) {
      next.dim_axis[f.dim] = {};
      if (t.kind == axis_state::partial) {
        next.add_partial(a);
        push(step_kind::zero_pad, a, f.dim, f.dim, next);
      } else if (target_free) {
        next.dim_axis[t.dim] = a;
        push(step_kind::all_to_all, a, t.dim, f.dim, next);
      } else {
        push(step_kind::all_gather, a, f.dim, f.dim, next);
      }
    }
  }
  for (std::size_t i = 0; i < naxes; ++i) {
    const std::string_view a = axes[i];
    const axis_state f = state_on(cur, a), t = state_on(to, a);
    if (f == t) continue;
    layout_value next = cur;
    if (t.kind == axis_state::split) {
      next.dim_axis[t.dim] = a;
      push(step_kind::local_slice, a, t.dim, t.dim, next);
    } else if (t.kind == axis_state::partial) {
      next.add_partial(a);
      push(step_kind::keep_on_one, a, 0, 0, next);
    }
  }
  return plan;
}

}  // namespace detail

/// @brief The plan of `redistribute<To>` from layout `From`, at compile time.
template <layout_spec From, layout_spec To>
constexpr redistribute_plan redistribute_plan_of() {
  static_assert(From::rank == To::rank, "pdo: redistribute: the two layouts have different ranks");
  constexpr redistribute_plan plan = detail::plan_redistribute(detail::value_of<From>(), detail::value_of<To>());
  static_assert(plan.size == 0 ? detail::value_of<From>() == detail::value_of<To>()
                               : plan.steps[plan.size - 1].after == detail::value_of<To>(),
                "pdo: redistribute: the plan does not end in the target layout (a bug in pdo's planner)");
  return plan;
}

/// @brief The plan of `redistribute<To>` from layout `From`, as a variable.
template <layout_spec From, layout_spec To>
inline constexpr redistribute_plan redistribute_plan_v = redistribute_plan_of<From, To>();

/// @brief One line per step: "all_gather over tp on dim 1: {split<dp>, split<tp>} -> {split<dp>, replicate}".
inline std::string describe(const redistribute_plan& plan) {
  if (plan.size == 0) return "no steps (layouts are equal)\n";
  std::string text;
  for (const auto& s : plan) {
    text += std::string(step_name(s.kind)) + " over " + std::string(s.axis);
    if (s.kind == step_kind::all_to_all)
      text += " from dim " + std::to_string(s.from_dim) + " to dim " + std::to_string(s.dim);
    else if (s.kind != step_kind::all_reduce && s.kind != step_kind::keep_on_one)
      text += " on dim " + std::to_string(s.dim);
    text += ": " + detail::to_string(s.before) + " -> " + detail::to_string(s.after) + "\n";
  }
  return text;
}

}  // namespace pdo
