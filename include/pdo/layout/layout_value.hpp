// pdo/layout/layout_value.hpp: a layout as a constexpr value, for planning and messages.
#pragma once

#include <pdo/layout/layout.hpp>

#include <array>
#include <cstddef>
#include <string>
#include <string_view>

namespace pdo::detail {

inline constexpr std::size_t max_rank = 8;  ///< the highest tensor rank a layout may have
inline constexpr std::size_t max_axes = 8;  ///< the most partial axes a layout may have

/// @brief A layout as data: for each dim the axis it is split on ("" when replicated),
/// and the partial axes. Equality treats the partial axes as a set.
struct layout_value {
  std::size_t rank = 0;
  std::array<std::string_view, max_rank> dim_axis{};
  std::size_t npartial = 0;
  std::array<std::string_view, max_axes> partial{};

  /// @brief The dim split on `axis`, or rank when none is.
  [[nodiscard]] constexpr std::size_t split_dim(std::string_view axis) const {
    for (std::size_t d = 0; d < rank; ++d)
      if (dim_axis[d] == axis) return d;
    return rank;
  }
  [[nodiscard]] constexpr bool is_partial(std::string_view axis) const {
    for (std::size_t i = 0; i < npartial; ++i)
      if (partial[i] == axis) return true;
    return false;
  }
  constexpr void add_partial(std::string_view axis) {
    if (!is_partial(axis)) partial[npartial++] = axis;
  }
  constexpr void remove_partial(std::string_view axis) {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < npartial; ++i)
      if (partial[i] != axis) partial[kept++] = partial[i];
    for (std::size_t i = kept; i < npartial; ++i) partial[i] = {};
    npartial = kept;
  }
  friend constexpr bool operator==(const layout_value& a, const layout_value& b) {
    if (a.rank != b.rank || a.npartial != b.npartial) return false;
    for (std::size_t d = 0; d < a.rank; ++d)
      if (a.dim_axis[d] != b.dim_axis[d]) return false;
    for (std::size_t i = 0; i < a.npartial; ++i)
      if (!b.is_partial(a.partial[i])) return false;
    return true;
  }
};

template <layout_spec L>
constexpr layout_value value_of() {
  static_assert(L::rank <= max_rank, "pdo: layout: at most 8 tensor dims are supported");
  static_assert(L::partial_axes.size() <= max_axes, "pdo: layout: at most 8 partial axes are supported");
  layout_value v;
  v.rank = L::rank;
  for (std::size_t d = 0; d < L::rank; ++d) v.dim_axis[d] = L::dim_axes[d];
  for (auto a : L::partial_axes) v.add_partial(a);
  return v;
}

/// @brief "{split<dp>, replicate}" or "{replicate, replicate} partial<tp>".
inline std::string to_string(const layout_value& v) {
  std::string text = "{";
  for (std::size_t d = 0; d < v.rank; ++d) {
    if (d) text += ", ";
    text += v.dim_axis[d].empty() ? std::string("replicate") : "split<" + std::string(v.dim_axis[d]) + ">";
  }
  text += "}";
  for (std::size_t i = 0; i < v.npartial; ++i) text += (i ? ", " : " ") + ("partial<" + std::string(v.partial[i]) + ">");
  return text;
}

}  // namespace pdo::detail

namespace pdo {
/// @brief A layout type spelled out: "{split<dp>, replicate} partial<tp>".
template <layout_spec L>
std::string layout_name() {
  return detail::to_string(detail::value_of<L>());
}
}  // namespace pdo
