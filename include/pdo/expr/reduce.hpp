// pdo/expr/reduce.hpp: sum, mean and max over one dim or over all dims.
#pragma once

#include <pdo/expr/expression.hpp>
#include <pdo/kernels/reduce.hpp>

#include <cstddef>
#include <string>
#include <tuple>

namespace pdo {

/// @brief A reduction of its operand over dim `Dim`, or over every dim when `All`
/// (a rank-0 result). See detail::reduce_rule for the layouts.
template <detail::reduction What, std::size_t Dim, bool All, class C>
class reduce_node : public detail::op_node<C> {
 public:
  /// @brief The operand's element type, which the result keeps.
  using value_type = typename C::value_type;
  static_assert(All || Dim < C::rank, "pdo: sum/mean/max: the dim to reduce is out of range for the operand's rank: 0 to rank - 1, or -1 (the last) back to -rank");
  static_assert(What != detail::reduction::mean || std::is_floating_point_v<value_type>,
                "pdo: mean: needs a floating-point operand");
  /// @brief Whether the checks above hold here and every op below is well formed (see
  /// detail::op_node): when not, eval stops after the error.
  static constexpr bool well_formed = detail::op_node<C>::well_formed && (All || Dim < C::rank) &&
                                      (What != detail::reduction::mean || std::is_floating_point_v<value_type>);
  /// @brief 0 when `All`, else the operand's rank less the reduced dim.
  static constexpr std::size_t rank = All || C::rank == 0 ? 0 : C::rank - 1;
  /// @brief false: a reduction is never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "sum", "mean" or "max", as plans and error messages print it.
  static constexpr std::string_view name =
      What == detail::reduction::sum ? "sum" : What == detail::reduction::mean ? "mean" : "max";
  /// @brief The planner's rule: a split reduced dim leaves a partial sum (sum, mean), or an all_reduce(max)
  /// after the kernel (max); see detail::reduce_rule and detail::reduce_all_rule.
  static constexpr detail::op_rule rule = All ? detail::reduce_all_rule(C::rule.out, What == detail::reduction::max)
                                              : detail::reduce_rule(C::rule.out, Dim, What == detail::reduction::max);

  /// @brief pdo::shape_error for a max over no elements.
  explicit reduce_node(C c) : detail::op_node<C>(std::move(c)) {
    const auto s = detail::operand<0>(this->children_).shape();
    if (What == detail::reduction::max && (All ? detail::volume(s) : s[All ? 0 : Dim]) == 0)
      throw shape_error("max: " + detail::describe_node(detail::operand<0>(this->children_)) + ": the maximum of no elements");
    if constexpr (!All)
      for (std::size_t d = 0, o = 0; d < C::rank; ++d)
        if (d != Dim) shape_[o++] = s[d];
  }

  /// @brief The operand's shape without dim `Dim` (empty when `All`).
  [[nodiscard]] const shape_t<rank>& shape() const { return shape_; }

  /// @brief Reduces this place's block of the operand into `out`; a mean divides by the global count.
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto in = ctx.template operand<0>();
    if constexpr (All) {
      detail::reduce_all_into(ctx.system, in.data, detail::volume(in.shape), What, detail::volume(in.global), out.data());
    } else {
      detail::reduce_dim(ctx.system, in.data, detail::view_along(in.shape, Dim), What, in.global[Dim], out.data());
    }
  }

 private:
  shape_t<rank> shape_{};
};

}  // namespace pdo
