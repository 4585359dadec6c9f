// pdo/core/type_list.hpp: minimal type-level lists used by the layout algebra.
#pragma once

#include <cstddef>
#include <type_traits>

namespace pdo::detail {

template <class... Ts>
struct type_list {
  static constexpr std::size_t size = sizeof...(Ts);
};

/// @brief A `false` that depends on a type, for static_asserts in templates that must
/// only fire when instantiated.
template <class...>
inline constexpr bool always_false = false;

template <class T, template <class...> class Template>
inline constexpr bool is_specialization_of = false;
template <template <class...> class Template, class... Args>
inline constexpr bool is_specialization_of<Template<Args...>, Template> = true;

}  // namespace pdo::detail
