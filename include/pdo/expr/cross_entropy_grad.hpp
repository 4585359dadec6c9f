// pdo/expr/cross_entropy_grad.hpp: the gradient of cross_entropy with respect to its logits.
#pragma once

#include <pdo/expr/expression.hpp>
#include <pdo/kernels/softmax.hpp>

#include <cstddef>
#include <string>
#include <tuple>

namespace pdo {


/// @brief (softmax(logits) - one_hot(labels)) * scale / N, with N the global row count:
/// the gradient of `scale * cross_entropy(logits, labels)` with respect to the logits. Its
/// operands take the layouts cross_entropy takes (classes whole, labels beside their rows),
/// and so does its result.
template <class Logits, class Labels>
class cross_entropy_grad_node : public detail::op_node<Logits, Labels> {
 public:
  /// @brief The logits' element type, which the gradient has.
  using value_type = typename Logits::value_type;
  static_assert(Logits::rank == 2 && Labels::rank == 1, "pdo: cross_entropy: takes logits [N, C] and labels [N]");
  /// @brief Whether the check above holds here and every op below is well formed.
  static constexpr bool well_formed = detail::op_node<Logits, Labels>::well_formed && Logits::rank == 2 && Labels::rank == 1;
  /// @brief 2: the gradient is [N, C], like the logits.
  static constexpr std::size_t rank = 2;
  /// @brief false: never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "cross_entropy_grad": how plans and error messages name this op.
  static constexpr std::string_view name = "cross_entropy_grad";
  /// @brief The planner's rule: cross_entropy's operand layouts, with the output laid out as the logits operand.
  static constexpr detail::op_rule rule = [] {
    detail::op_rule r = detail::cross_entropy_rule(Logits::rule.out, Labels::rule.out);
    r.out = r.operands[0];
    return r;
  }();

  /// @brief The gradient of `scale * cross_entropy(logits, labels)`; pdo::shape_error unless there is one label
  /// per row of logits.
  cross_entropy_grad_node(Logits logits, Labels labels, value_type scale)
      : detail::op_node<Logits, Labels>(std::move(logits), std::move(labels)), scale_(scale) {
    shape_ = detail::operand<0>(this->children_).shape();
    if (detail::operand<1>(this->children_).shape()[0] != shape_[0])
      throw shape_error("cross_entropy backward: logits " + detail::describe_node(detail::operand<0>(this->children_)) + " and labels " +
                        detail::describe_node(detail::operand<1>(this->children_)) + ": need one label per row of logits");
  }
  /// @brief The logits' shape, [N, C].
  [[nodiscard]] const shape_t<2>& shape() const { return shape_; }

  /// @brief Writes this place's rows of the gradient into `out`, scaled by `scale` / global N. Labels are not
  /// range-checked: a row whose label is outside [0, C) gets softmax * scale / N, with no one-hot term.
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, 2>& out) const {
    const auto logits = ctx.template operand<0>();
    const auto labels = ctx.template operand<1>();
    using label_t = typename Labels::value_type;
    const label_t* first = labels.data + (logits.offset[0] - labels.offset[0]);
    const value_type scale = logits.global[0] == 0 ? value_type{} : scale_ / static_cast<value_type>(logits.global[0]);
    detail::cross_entropy_grad(ctx.system, logits.data, first, logits.shape[0], logits.shape[1], scale, out.data());
  }

 private:
  shape_t<2> shape_{};
  value_type scale_;
};

}  // namespace pdo
