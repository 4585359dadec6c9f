// pdo/layout/layout_check.hpp: compile-time checks of a layout against a tensor rank and a mesh.
#pragma once

#include <pdo/core/fixed_string.hpp>
#include <pdo/core/type_list.hpp>
#include <pdo/layout/layout_value.hpp>

#include <cstddef>

namespace pdo {

/// @brief What is wrong with a layout on a mesh, if anything.
enum class layout_problem { none, bad_entry, rank_mismatch, axis_not_in_mesh, axis_used_twice };

namespace detail {

/// @brief Whether every entry of a layout's entry list is a split or a replicate.
template <class Dims>
inline constexpr bool all_dim_specs = false;
template <class... Dims>
inline constexpr bool all_dim_specs<type_list<Dims...>> = (dim_spec<Dims> && ...);

/// @brief What is wrong with layout `L` for a tensor of rank `tensor_rank` on `Mesh` (a bad
/// entry first: nothing else of such a layout is computed).
template <layout_spec L, class Mesh>
constexpr layout_problem find_layout_problem(std::size_t tensor_rank) {
  if constexpr (!all_dim_specs<typename L::dims>) {
    return layout_problem::bad_entry;
  } else {
    constexpr layout_value v = value_of<L>();
    if (v.rank != tensor_rank) return layout_problem::rank_mismatch;
    std::array<std::string_view, max_rank + max_axes> used{};
    std::size_t n = 0;
    for (std::size_t d = 0; d < v.rank; ++d)
      if (!v.dim_axis[d].empty()) used[n++] = v.dim_axis[d];
    for (std::string_view axis : L::partial_axes) used[n++] = axis;
    for (std::size_t i = 0; i < n; ++i) {
      if (!Mesh::has_axis(used[i])) return layout_problem::axis_not_in_mesh;
      for (std::size_t j = i + 1; j < n; ++j)
        if (used[i] == used[j]) return layout_problem::axis_used_twice;
    }
    return layout_problem::none;
  }
}

/// @brief Instantiated where a layout is used; its static_asserts fail with a message
/// that says what is wrong, and the compiler's note names the op, the layout and the
/// mesh (the template arguments of this type).
template <fixed_string Op, layout_spec L, class Mesh, std::size_t Rank>
struct check_layout {
  static constexpr layout_problem problem = find_layout_problem<L, Mesh>(Rank);
  static_assert(problem != layout_problem::bad_entry,
                "pdo: layout: each entry must be pdo::split<\"axis\"> or pdo::replicate (one per tensor dim)");
  static_assert(problem != layout_problem::rank_mismatch,
                "pdo: layout has a different number of entries than the tensor has dims; give one entry "
                "(pdo::split<\"axis\"> or pdo::replicate) per tensor dim");
  static_assert(problem != layout_problem::axis_not_in_mesh,
                "pdo: layout splits or sums over a mesh axis that the mesh does not have; use one of the "
                "mesh's axis names");
  static_assert(problem != layout_problem::axis_used_twice,
                "pdo: layout uses one mesh axis twice; a mesh axis may split one tensor dim or mark one "
                "partial sum, not both and not two dims");
  static constexpr bool ok = problem == layout_problem::none;
};

}  // namespace detail

/// @brief True when layout `L` fits a tensor of rank `Rank` on mesh type `Mesh`.
template <layout_spec L, class Mesh, std::size_t Rank>
inline constexpr bool valid_layout_v = detail::find_layout_problem<L, Mesh>(Rank) == layout_problem::none;

}  // namespace pdo
