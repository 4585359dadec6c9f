// pdo/expr/cast.hpp: the elements converted to another element type.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/dtype.hpp>
#include <pdo/expr/expression.hpp>

#include <cstddef>
#include <string_view>

namespace pdo {

namespace detail {
/// @brief Element i of a block of `From`s, converted to `To` as static_cast converts it.
template <class From, class To>
struct cast_element {
  const From* in;
  PDO_HD To operator()(std::size_t i) const { return static_cast<To>(in[i]); }
};
}  // namespace detail

/// @brief cast<U>(x): x's elements converted to `U`, as static_cast converts them (a
/// floating-point value becomes an integer by truncation toward zero; one out of the
/// integer's range is undefined, as in C++). Every dim keeps its split; a partial operand is
/// summed first (a conversion is not linear: truncations of the addends do not add up to the
/// truncation of their sum).
template <class U, class C>
class cast_node : public detail::op_node<C> {
 public:
  /// @brief The element type the operand's elements are converted to.
  using value_type = U;
  static_assert(element<U>, "pdo: cast: the target is an element type (float, double, an integer type other than bool)");
  /// @brief Whether this cast and every op below it is well formed (see detail::op_node).
  static constexpr bool well_formed = detail::op_node<C>::well_formed && element<U>;
  /// @brief The operand's rank.
  static constexpr std::size_t rank = C::rank;
  /// @brief false: a cast runs its own kernel (an elementwise group has one element type).
  static constexpr bool elementwise = false;
  /// @brief "cast": how plans and error messages name this op.
  static constexpr std::string_view name = "cast";
  /// @brief The planner's rule: the operand's layout, its partial axes summed first.
  static constexpr detail::op_rule rule =
      detail::elementwise_rule<1>(detail::partial_rule::none, {C::rule.out}, {false}, C::rank);

  /// @brief Takes the operand's shape.
  explicit cast_node(C c) : detail::op_node<C>(std::move(c)), shape_(detail::operand<0>(this->children_).shape()) {}
  /// @brief The operand's shape.
  [[nodiscard]] const shape_t<rank>& shape() const { return shape_; }

  /// @brief Writes this place's block of the operand, converted, into `out`.
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    using from_t = typename C::value_type;
    const auto in = ctx.template operand<0>();
    thrust::transform(ctx.system, thrust::counting_iterator<std::size_t>(0), thrust::counting_iterator<std::size_t>(out.size()),
                      out.data(), detail::cast_element<from_t, U>{in.data});
  }

 private:
  shape_t<rank> shape_{};
};

}  // namespace pdo
