// pdo/core/fixed_string.hpp: a string usable as a template argument (mesh axis names).
#pragma once

#include <algorithm>
#include <cstddef>
#include <string_view>

namespace pdo {

/// @brief A compile-time string literal, usable as a non-type template parameter
/// (`pdo::split<"dp">`, `pdo::mesh<"dp", "tp">`).
template <std::size_t N>
struct fixed_string {
  char chars[N]{};  ///< the characters, then the literal's terminating NUL

  /// @brief The literal `text` (implicit, so `split<"dp">` works).
  constexpr fixed_string(const char (&text)[N]) { std::copy_n(text, N, chars); }
  /// @brief The first N - 1 characters of `text`, at compile time (a name kept as a string_view);
  /// a shorter `text` is padded with NULs.
  constexpr explicit fixed_string(std::string_view text) { std::copy_n(text.data(), std::min(text.size(), N - 1), chars); }

  /// @brief The N - 1 characters, without the terminator.
  [[nodiscard]] constexpr std::string_view view() const { return {chars, N - 1}; }
  /// @brief view(), implicitly.
  [[nodiscard]] constexpr operator std::string_view() const { return view(); }

  /// @brief Whether both hold the same characters (strings of different lengths compare unequal).
  template <std::size_t M>
  [[nodiscard]] constexpr bool operator==(const fixed_string<M>& other) const {
    return view() == other.view();
  }
};

namespace detail {
/// @brief Value `I` of a pack of values (the name of mesh axis I, say).
template <std::size_t I, auto First, auto... Rest>
constexpr auto nth_value() {
  if constexpr (I == 0) return First;
  else return nth_value<I - 1, Rest...>();
}
}  // namespace detail

}  // namespace pdo
