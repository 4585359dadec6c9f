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
  using value_type = typename C::value_type;
  static constexpr std::size_t rank = Rank;
  static constexpr bool elementwise = false;
  static constexpr std::string_view name = "reshape";
  static_assert(detail::kept_dims(C::rule.out) <= Rank,
                "pdo: reshape: the result must keep every dim up to the operand's last split dim; gather the split "
                "dims first (pdo::redistribute) or reshape only trailing replicated dims");
  static constexpr detail::op_rule rule = detail::reshape_rule(C::rule.out, Rank);

  reshape_node(C c, const shape_t<Rank>& shape) : detail::op_node<C>(std::move(c)), shape_(shape) {
    const auto s = std::get<0>(this->children_).shape();
    bool ok = detail::volume(s) == detail::checked_volume(shape_, "reshape", sizeof(value_type));
    for (std::size_t d = 0; d < detail::kept_dims(C::rule.out); ++d) ok = ok && s[d] == shape_[d];
    if (!ok)
      throw shape_error("reshape: " + detail::describe_node(std::get<0>(this->children_)) + " to " + detail::format_extents(shape_) +
                        ": the number of elements must stay the same, and the dims up to the last split one must be kept");
  }
  [[nodiscard]] const shape_t<Rank>& shape() const { return shape_; }

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
  using value_type = typename C::value_type;
  static constexpr std::size_t rank = C::rank + 1;
  static_assert(Dim <= C::rank, "pdo: unsqueeze: the dim to insert is beyond the operand's rank");
  static_assert(rank <= detail::max_rank, "pdo: unsqueeze: the result would have more dims than pdo's layouts hold");
  static constexpr bool elementwise = false;
  static constexpr std::string_view name = "unsqueeze";
  static constexpr detail::op_rule rule = detail::unsqueeze_rule(C::rule.out, Dim);

  explicit unsqueeze_node(C c) : detail::op_node<C>(std::move(c)) {
    const auto s = std::get<0>(this->children_).shape();
    for (std::size_t d = 0, i = 0; d < rank; ++d) shape_[d] = d == Dim ? 1 : s[i++];
  }
  [[nodiscard]] const shape_t<rank>& shape() const { return shape_; }

  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto in = ctx.template operand<0>();
    detail::copy_bytes(out.where(), out.data(), out.where(), in.data, out.bytes());  // operands live on out's place
  }

 private:
  shape_t<rank> shape_{};
};

}  // namespace pdo
