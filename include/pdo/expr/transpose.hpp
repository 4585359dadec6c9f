// pdo/expr/transpose.hpp: the last two dims swapped.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/expr/expression.hpp>

#include <cstddef>
#include <tuple>

namespace pdo {

namespace detail {
/// @brief Output element i of [batch, cols, rows] read from the input [batch, rows, cols].
template <class T>
struct transpose_element {
  const T* in;
  std::size_t rows, cols;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t b = i / (rows * cols), rest = i % (rows * cols);
    const std::size_t c = rest / rows, r = rest % rows;
    return in[b * rows * cols + r * cols + c];
  }
};
}  // namespace detail

/// @brief transpose(x): x with its last two dims swapped (their splits swap too).
template <class C>
class transpose_node : public detail::op_node<C> {
 public:
  /// @brief The operand's element type, which the result keeps.
  using value_type = typename C::value_type;
  static_assert(C::rank >= 2, "pdo: transpose: needs at least 2 dims");
  /// @brief Whether this transpose and every op below it is well formed (see detail::op_node):
  /// for fewer than 2 dims nothing more is instantiated after the error, and eval stops there.
  static constexpr bool well_formed = detail::op_node<C>::well_formed && C::rank >= 2;
  /// @brief The operand's rank (at least 2).
  static constexpr std::size_t rank = C::rank;
  /// @brief false: a transpose is never fused into an elementwise group (a local matmul may read it in place).
  static constexpr bool elementwise = false;
  /// @brief "transpose": how plans and error messages name this op.
  static constexpr std::string_view name = "transpose";
  /// @brief The planner's rule (detail::transpose_rule): the last two dims' splits swap; partial stays partial.
  static constexpr detail::op_rule rule = C::rank >= 2 ? detail::transpose_rule(C::rule.out) : detail::op_rule{};

  /// @brief Takes the operand's shape with its last two extents swapped.
  explicit transpose_node(C c) : detail::op_node<C>(std::move(c)) {
    shape_ = detail::operand<0>(this->children_).shape();
    if constexpr (rank >= 2) std::swap(shape_[rank - 2], shape_[rank - 1]);
  }
  /// @brief The operand's shape with its last two extents swapped.
  [[nodiscard]] const shape_t<rank>& shape() const { return shape_; }

  /// @brief Writes the transpose of this place's block of the operand into `out`.
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto in = ctx.template operand<0>();
    thrust::transform(ctx.system, thrust::counting_iterator<std::size_t>(0), thrust::counting_iterator<std::size_t>(out.size()),
                      out.data(), detail::transpose_element<value_type>{in.data, in.shape[rank - 2], in.shape[rank - 1]});
  }

 private:
  shape_t<rank> shape_{};
};

}  // namespace pdo
