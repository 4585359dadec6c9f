// pdo/core/shape.hpp: shapes, row-major strides and the even-split rule for shards.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace pdo {

/// @brief The extents of a tensor of rank `Rank`.
template <std::size_t Rank>
using shape_t = std::array<std::size_t, Rank>;

namespace detail {

template <std::size_t Rank>
constexpr std::size_t volume(const shape_t<Rank>& shape) {
  std::size_t n = 1;
  for (auto e : shape) n *= e;
  return n;
}

/// @brief The largest number of bytes one tensor may span: pointer differences and strides
/// (std::ptrdiff_t) must be able to reach its end.
inline constexpr std::size_t max_tensor_bytes = static_cast<std::size_t>(PTRDIFF_MAX);

template <class Range>
std::string format_extents(const Range& extents);

/// @brief The error of checked_volume, of kind `kind`.
[[noreturn]] PDO_NOINLINE inline void throw_too_large(std::string_view op, const std::string& extents, long double elements,
                                                      std::size_t element_bytes, error_kind kind) {
  std::ostringstream os;
  os << op << ": extents " << extents << " hold " << elements << " elements of " << element_bytes
     << " bytes, more than one tensor can address (" << max_tensor_bytes << " bytes); use smaller extents";
  throw_error_of_kind(kind, os.str());
}

/// @brief The product of `extents`, checked: when it, or its size in bytes at
/// `element_bytes` each, exceeds what memory can hold (max_tensor_bytes), a pdo::error naming
/// `op` and the extents, of kind `kind`: a pdo::shape_error for a tensor's extents, a
/// pdo::io_error for extents a file gives or is asked to hold.
template <class Range>
std::size_t checked_volume(const Range& extents, std::string_view op, std::size_t element_bytes = 1, error_kind kind = error_kind::shape) {
  std::size_t n = 1;
  bool over = false, empty = false;
  long double exact = 1;  // for the message: the product that did not fit
  for (auto e : extents) {
    exact *= static_cast<long double>(e);
    empty = empty || e == 0;
    over = over || __builtin_mul_overflow(n, static_cast<std::size_t>(e), &n);
  }
  if (empty) return 0;  // an empty tensor: any other extent is fine
  std::size_t bytes = 0;
  if (over || __builtin_mul_overflow(n, element_bytes, &bytes) || bytes > max_tensor_bytes)
    throw_too_large(op, format_extents(extents), exact, element_bytes, kind);
  return n;
}

template <std::size_t Rank>
constexpr std::array<std::ptrdiff_t, Rank> row_major_strides(const shape_t<Rank>& shape) {
  std::array<std::ptrdiff_t, Rank> strides{};
  std::ptrdiff_t s = 1;
  for (std::size_t d = Rank; d-- > 0;) {
    strides[d] = s;
    s *= static_cast<std::ptrdiff_t>(shape[d]);
  }
  return strides;
}

/// @brief Size of chunk `index` when `extent` elements are cut into `parts` chunks:
/// sizes differ by at most one, larger chunks first (10 over 4 -> 3,3,2,2).
constexpr std::size_t chunk_size(std::size_t extent, std::size_t parts, std::size_t index) {
  return extent / parts + (index < extent % parts ? 1 : 0);
}

/// @brief Offset of chunk `index` under the rule of chunk_size.
constexpr std::size_t chunk_offset(std::size_t extent, std::size_t parts, std::size_t index) {
  const std::size_t rem = extent % parts;
  return index * (extent / parts) + (index < rem ? index : rem);
}

/// @brief A number as messages print it: printf's %g ("0.1", "-1", "nan", "1e+30").
PDO_NOINLINE inline std::string format_number(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", value);
  return text;
}

/// @brief "[10, 6]": extents as messages print them.
PDO_NOINLINE inline std::string format_extent_list(std::span<const std::size_t> extents) {
  std::string text = "[";
  for (std::size_t i = 0; i < extents.size(); ++i) text += (i ? ", " : "") + std::to_string(extents[i]);
  return text + "]";
}

/// @brief "a, b, c" for a message: `name_of` of each of `items`, the first `most` of them and
/// then ", ... (N in all)" when there are more (a list of thousands does not make a message of
/// thousands); empty for no items.
template <class Items, class NameOf>
std::string listed(const Items& items, NameOf name_of, std::size_t most) {
  std::string text;
  std::size_t n = 0;
  for (const auto& item : items) {
    if (n < most) text += (n == 0 ? "" : ", ") + std::string(name_of(item));
    ++n;
  }
  if (n > most) text += ", ... (" + std::to_string(n) + " in all)";
  return text;
}

template <class Range>
std::string format_extents(const Range& extents) {
  if constexpr (std::is_convertible_v<const Range&, std::span<const std::size_t>>) {
    return format_extent_list(extents);
  } else {
    std::string text = "[";
    for (bool first = true; auto e : extents) {
      text += (first ? "" : ", ") + std::to_string(e);
      first = false;
    }
    return text + "]";
  }
}

/// @brief A tensor viewed as [outer, extent(dim), inner], the form every pack,
/// unpack and slice along one dim works on.
struct dim_view {
  std::size_t outer = 1;
  std::size_t extent = 1;
  std::size_t inner = 1;
};

template <std::size_t Rank>
constexpr dim_view view_along(const shape_t<Rank>& shape, std::size_t dim) {
  dim_view v;
  for (std::size_t d = 0; d < Rank; ++d) {
    if (d < dim) v.outer *= shape[d];
    else if (d == dim) v.extent = shape[d];
    else v.inner *= shape[d];
  }
  return v;
}

}  // namespace detail
}  // namespace pdo
