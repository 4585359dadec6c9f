// pdo/core/dtype.hpp: element types pdo moves and reduces, and their short names.
#pragma once

#include <pdo/core/config.hpp>

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

namespace pdo {

/// @brief An element type pdo tensors hold: an arithmetic type other than bool.
template <class T>
concept element = std::is_arithmetic_v<T> && !std::same_as<T, bool>;

/// @brief Reduction applied by all_reduce and reduce_scatter.
enum class reduce_op { sum, max, min };

namespace detail {

/// @brief The short name of the element type T, its kind and bits, as NumPy's and PyTorch's
/// (f32, f64, i8 to i64, u8 to u64; a char is i8 or u8 as it is signed), as a
/// NUL-terminated constant array.
template <class T>
inline constexpr auto dtype_chars = [] {
  constexpr std::size_t bits = 8 * sizeof(T);
  std::array<char, 5> name{std::floating_point<T> ? 'f' : std::signed_integral<T> ? 'i' : 'u'};
  std::size_t n = 1;
  if constexpr (bits >= 100) name[n++] = static_cast<char>('0' + bits / 100);
  if constexpr (bits >= 10) name[n++] = static_cast<char>('0' + bits / 10 % 10);
  name[n] = static_cast<char>('0' + bits % 10);
  return name;
}();

/// @brief The short name of the element type T in messages: "f32", "i64", "u8" (see
/// dtype_chars); long double, whose bits vary by platform, by its name.
template <class T>
constexpr std::string_view dtype_name() {
  if constexpr (std::same_as<T, long double>) return "long double";
  else return std::string_view(dtype_chars<T>.data());
}

constexpr std::string_view op_name(reduce_op op) {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::max: return "max";
    case reduce_op::min: return "min";
  }
  return "?";
}

/// @brief What a sum of elements of type T adds in: double for float (a running float sum of
/// a long row loses about a bit per doubling of its length: 1% over 2^20 elements), T otherwise.
/// Every sum a kernel makes along a dim or a row (sum, mean, softmax's normaliser, a bias's
/// gradient) adds in it and rounds once, at the end.
template <class T>
using sum_accumulator = std::conditional_t<std::same_as<T, float>, double, T>;

/// @brief The larger of `a` and `b`; NaN when either is NaN, whichever it is (as PyTorch's
/// maximum and NumPy's max): every max of pdo, reductions and collectives included, is this one.
template <class T>
PDO_HD constexpr T nan_max(T a, T b) {
  return (a != a || a > b) ? a : b;  // a != a: a is NaN (never for integers)
}
/// @brief The smaller of `a` and `b`; NaN when either is NaN.
template <class T>
PDO_HD constexpr T nan_min(T a, T b) {
  return (a != a || a < b) ? a : b;
}

template <class T>
constexpr T apply(reduce_op op, T a, T b) {
  switch (op) {
    case reduce_op::sum: return a + b;
    case reduce_op::max: return nan_max(a, b);
    case reduce_op::min: return nan_min(a, b);
  }
  return a;
}

}  // namespace detail
}  // namespace pdo
