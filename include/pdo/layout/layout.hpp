// pdo/layout/layout.hpp: layouts as types: split<"axis">, replicate, partial axes.
#pragma once

#include <pdo/core/fixed_string.hpp>
#include <pdo/core/type_list.hpp>

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace pdo {

/// @brief Layout entry of one tensor dim: cut into contiguous chunks along mesh axis `Axis`
/// (sizes differ by at most one, larger chunks first: 10 rows over 4 places are 3,3,2,2).
template <fixed_string Axis>
struct split {
  /// @brief Marks this type as a split entry (see pdo::dim_spec).
  using split_tag = void;
  /// @brief The name of the mesh axis the dim is cut along.
  static constexpr std::string_view axis = Axis.view();
};

/// @brief Layout entry of one tensor dim: every place holds all of it.
struct replicate {};

// Found by split's member, not by a partial specialization on split<Axis>: nvcc's
// front end does not match partial specializations on string template arguments.
template <class T>
inline constexpr bool is_dim_spec_v = std::is_same_v<T, replicate> || requires { typename T::split_tag; };

/// @brief A layout entry: pdo::split<"axis"> or pdo::replicate.
template <class T>
concept dim_spec = is_dim_spec_v<T>;

/// @brief How a tensor is laid out on a mesh: one entry per tensor dim.
/// `layout<...>::partial<"tp">` marks a pending sum over mesh axis "tp": each place
/// holds an addend, and the value is the sum over the places along that axis.
/// Its entries are checked where it is used (detail::check_layout), with the mesh and the
/// tensor's rank: a check here would make clang reject every overload whose constraint
/// looks into a layout with a bad entry, a second error after the first.
template <class... Dims>
struct layout {
  /// @brief Marks this type as a layout (see pdo::layout_spec).
  using layout_tag = void;
  /// @brief The layout without pending sums: this layout itself.
  using base = layout;
  /// @brief The entries, one per tensor dim.
  using dims = detail::type_list<Dims...>;
  /// @brief The number of tensor dims the layout describes.
  static constexpr std::size_t rank = sizeof...(Dims);
  /// @brief For each dim, the mesh axis it is split along, or "" where it is replicated.
  static constexpr std::array<std::string_view, rank> dim_axes{[] {
    if constexpr (dim_spec<Dims> && !std::is_same_v<Dims, replicate>) return Dims::axis;
    else return std::string_view{};  // (a bad entry: check_layout says so, once)
  }()...};
  /// @brief The axes of pending sums: none.
  static constexpr std::array<std::string_view, 0> partial_axes{};

  /// @brief This layout with pending sums over mesh axes `Axes` (a class, not an alias:
  /// nvcc's front end cannot take string literals as arguments of alias templates).
  template <fixed_string... Axes>
  struct partial {
    static_assert(sizeof...(Axes) >= 1, "pdo: layout::partial: name at least one mesh axis");
    /// @brief Marks this type as a layout (see pdo::layout_spec).
    using layout_tag = void;
    /// @brief The enclosing layout, without the pending sums.
    using base = layout;
    /// @brief The entries, one per tensor dim (those of the enclosing layout).
    using dims = detail::type_list<Dims...>;
    /// @brief The number of tensor dims.
    static constexpr std::size_t rank = sizeof...(Dims);
    /// @brief For each dim, the mesh axis it is split along, or "" where it is replicated.
    static constexpr auto dim_axes = layout::dim_axes;
    /// @brief The mesh axes the value is a pending sum over, in the order given.
    static constexpr std::array<std::string_view, sizeof...(Axes)> partial_axes{Axes.view()...};
  };
};

namespace detail {
template <class Seq>
struct replicated_layout;
template <std::size_t... I>
struct replicated_layout<std::index_sequence<I...>> {
  using type = layout<std::conditional_t<I == I, replicate, void>...>;
};
/// @brief layout<replicate, ..., replicate> of rank `Rank`.
template <std::size_t Rank>
using replicated_layout_t = typename replicated_layout<std::make_index_sequence<Rank>>::type;
}  // namespace detail

/// @brief A layout type: pdo::layout<...> or pdo::layout<...>::partial<...>.
template <class L>
concept layout_spec = requires {
  typename L::layout_tag;
  L::rank;
  L::dim_axes;
  L::partial_axes;
};

}  // namespace pdo
