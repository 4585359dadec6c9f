// pdo/expr/reshape.hpp: the same elements in row-major order under another shape: reshape,
// and unsqueeze (a unit dim inserted, whatever the operand's split).
#pragma once

#include <pdo/expr/expression.hpp>

#include <cstddef>
#include <string>
#include <tuple>

namespace pdo {

/// @brief reshape<Rank>(x, shape): x's elements under `shape`. The leading dims through
/// x's last split dim are kept as they are (same extents); the rest, all replicated,
/// may be reshaped freely (see detail::reshape_rule).
template <std::size_t Rank, class C>
class reshape_node : public detail::op_node<C> {
 public:
  /// @brief The operand's element type, which the result keeps.
  using value_type = typename C::value_type;
  /// @brief Number of dims of the new shape.
  static constexpr std::size_t rank = Rank;
  /// @brief false: a reshape is never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "reshape": how plans and error messages name this op.
  static constexpr std::string_view name = "reshape";
  static_assert(detail::kept_dims(C::rule.out) <= Rank,
                "pdo: reshape: the result must keep every dim up to the operand's last split dim; gather the split "
                "dims first (pdo::redistribute) or reshape only trailing replicated dims");
  /// @brief The planner's rule (detail::reshape_rule): kept dims keep their split, the rest are replicated.
  static constexpr detail::op_rule rule = detail::reshape_rule(C::rule.out, Rank);

  /// @brief pdo::shape_error unless `shape` has the operand's element count and keeps the dims up to its
  /// last split one.
  reshape_node(C c, const shape_t<Rank>& shape) : detail::op_node<C>(std::move(c)), shape_(shape) {
    const auto s = detail::operand<0>(this->children_).shape();
    const std::size_t from = detail::volume(s), to = detail::checked_volume(shape_, "reshape", sizeof(value_type));
    const auto context = [&] {
      return "reshape: " + detail::describe_node(detail::operand<0>(this->children_)) + " to " + detail::format_extents(shape_) + ": ";
    };
    if (from != to)
      throw shape_error(context() + "the number of elements must stay the same (" + std::to_string(from) + " here, " + std::to_string(to) + " there)");
    for (std::size_t d = 0; d < detail::kept_dims(C::rule.out); ++d)
      if (s[d] != shape_[d])
        throw shape_error(context() + "dim " + std::to_string(d) + " must be kept: the dims up to the operand's last split one (dim " +
                          std::to_string(detail::kept_dims(C::rule.out) - 1) + ") keep their extents; gather it first (pdo::redistribute)");
  }
  /// @brief The new shape.
  [[nodiscard]] const shape_t<Rank>& shape() const { return shape_; }

  /// @brief Copies this place's block of the operand into `out` unchanged (row-major order is kept).
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto in = ctx.template operand<0>();
    detail::copy_bytes(out.where(), out.data(), out.where(), in.data, out.bytes());  // operands live on out's place
  }

 private:
  shape_t<Rank> shape_;
};

/// @brief unsqueeze<Dim>(x): x with a dim of extent 1 inserted at `Dim` (0 to x's rank). The
/// elements keep their order, so every dim keeps its split, whichever dims are split (see
/// detail::unsqueeze_rule): what a reduction's gradient is broadcast back through.
template <std::size_t Dim, class C>
class unsqueeze_node : public detail::op_node<C> {
 public:
  /// @brief The operand's element type, which the result keeps.
  using value_type = typename C::value_type;
  /// @brief One more than the operand's rank.
  static constexpr std::size_t rank = C::rank + 1;
  /// @brief Whether `Dim` is a place to insert a dim: 0 to the operand's rank.
  static constexpr bool dim_fits = Dim <= C::rank;
  /// @brief Whether pdo's layouts hold the result's rank.
  static constexpr bool rank_fits = rank <= detail::max_rank;
  static_assert(dim_fits, "pdo: unsqueeze: the dim to insert is out of range: 0 to the operand's rank, or -1 (after the last dim) back to -(rank + 1)");
  static_assert(rank_fits, "pdo: unsqueeze: the result would have more dims than pdo's layouts hold");
  /// @brief Whether this unsqueeze and every op below it is well formed (see detail::op_node):
  /// for a dim past the operand's rank nothing more is instantiated after the error.
  static constexpr bool well_formed = detail::op_node<C>::well_formed && dim_fits && rank_fits;
  /// @brief false: an unsqueeze is never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "unsqueeze": how plans and error messages name this op.
  static constexpr std::string_view name = "unsqueeze";
  /// @brief The planner's rule (detail::unsqueeze_rule): the new dim is replicated, the others keep their split.
  static constexpr detail::op_rule rule = well_formed ? detail::unsqueeze_rule(C::rule.out, Dim) : detail::op_rule{};

  /// @brief Takes the operand's shape with a 1 inserted at `Dim`.
  explicit unsqueeze_node(C c) : detail::op_node<C>(std::move(c)) {
    const auto s = detail::operand<0>(this->children_).shape();
    for (std::size_t d = 0, i = 0; d < rank; ++d) shape_[d] = d == Dim ? 1 : s[i++];
  }
  /// @brief The operand's shape with a dim of extent 1 at `Dim`.
  [[nodiscard]] const shape_t<rank>& shape() const { return shape_; }

  /// @brief Copies this place's block of the operand into `out` unchanged.
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto in = ctx.template operand<0>();
    detail::copy_bytes(out.where(), out.data(), out.where(), in.data, out.bytes());  // operands live on out's place
  }

 private:
  shape_t<rank> shape_{};
};

}  // namespace pdo
