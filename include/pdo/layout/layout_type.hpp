// pdo/layout/layout_type.hpp: a layout computed as a value turned back into a layout type of a mesh.
#pragma once

#include <pdo/layout/layout.hpp>
#include <pdo/layout/layout_value.hpp>

#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>

namespace pdo::detail {

template <class Mesh, std::size_t Axis>
constexpr auto dim_spec_of() {
  if constexpr (Axis == Mesh::ndim) return std::type_identity<replicate>{};
  else return std::type_identity<split<Mesh::template axis_string<Axis>>>{};
}

/// @brief Builds the layout type of `Value::value` from the mesh axis numbers of its
/// entries (the mesh's rank where a dim is replicated).
template <class Mesh, class Value>
struct layout_type_builder {
  static constexpr layout_value v = Value::value;
  static constexpr std::array<std::size_t, max_rank> dims = [] {
    std::array<std::size_t, max_rank> a{};
    for (std::size_t d = 0; d < v.rank; ++d) a[d] = v.dim_axis[d].empty() ? Mesh::ndim : Mesh::axis_index(v.dim_axis[d]);
    return a;
  }();
  static constexpr std::array<std::size_t, max_axes> partial = [] {
    std::array<std::size_t, max_axes> a{};
    for (std::size_t i = 0; i < v.npartial; ++i) a[i] = Mesh::axis_index(v.partial[i]);
    return a;
  }();

  template <std::size_t... D, std::size_t... P>
  static constexpr auto make(std::index_sequence<D...>, std::index_sequence<P...>) {
    using base = layout<typename decltype(dim_spec_of<Mesh, dims[D]>())::type...>;
    if constexpr (sizeof...(P) == 0) return std::type_identity<base>{};
    else return std::type_identity<typename base::template partial<Mesh::template axis_string<partial[P]>...>>{};
  }
  using type = typename decltype(make(std::make_index_sequence<v.rank>{}, std::make_index_sequence<v.npartial>{}))::type;
};

/// @brief The layout type, on mesh type `Mesh`, of the constexpr layout_value `Value::value`
/// (the planner computes layouts as values; dtensor types need them as types).
template <class Mesh, class Value>
using layout_type_t = typename layout_type_builder<Mesh, Value>::type;

}  // namespace pdo::detail
