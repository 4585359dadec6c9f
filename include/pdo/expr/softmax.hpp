// pdo/expr/softmax.hpp: softmax and log_softmax along one dim, and the cross-entropy loss.
#pragma once

#include <pdo/expr/expression.hpp>
#include <pdo/kernels/softmax.hpp>

#include <cstddef>
#include <limits>
#include <string>
#include <tuple>

namespace pdo {

/// @brief softmax (or log_softmax when `Log`) of its operand along dim `Dim`. The dim is
/// gathered first where it is split (see detail::along_dim_rule).
template <bool Log, std::size_t Dim, class C>
class softmax_node : public detail::op_node<C> {
 public:
  using value_type = typename C::value_type;
  static_assert(Dim < C::rank, "pdo: softmax: the dim is out of range for the operand's rank");
  static_assert(std::is_floating_point_v<value_type>, "pdo: softmax: needs a floating-point operand");
  static constexpr std::size_t rank = C::rank;
  static constexpr bool elementwise = false;
  static constexpr std::string_view name = Log ? "log_softmax" : "softmax";
  static constexpr detail::op_rule rule = detail::along_dim_rule(C::rule.out, Dim);

  explicit softmax_node(C c) : detail::op_node<C>(std::move(c)) {}
  [[nodiscard]] shape_t<rank> shape() const { return std::get<0>(this->children_).shape(); }

  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto in = ctx.template operand<0>();
    detail::softmax_dim<Log>(ctx.system, in.data, detail::view_along(in.shape, Dim), out.data());
  }

 private:
};

/// @brief cross_entropy(logits [N, C], labels [N]): the mean over the N samples of
/// -log softmax(logits)[label]. Labels are class indices of any element type.
template <class Logits, class Labels>
class cross_entropy_node : public detail::op_node<Logits, Labels> {

 public:
  using value_type = typename Logits::value_type;
  static_assert(Logits::rank == 2 && Labels::rank == 1, "pdo: cross_entropy: takes logits [N, C] and labels [N]");
  static_assert(std::is_floating_point_v<value_type>, "pdo: cross_entropy: needs floating-point logits");
  static constexpr std::size_t rank = 0;
  static constexpr bool elementwise = false;
  static constexpr std::string_view name = "cross_entropy";
  static constexpr detail::op_rule rule = detail::cross_entropy_rule(Logits::rule.out, Labels::rule.out);

  cross_entropy_node(Logits logits, Labels labels) : detail::op_node<Logits, Labels>(std::move(logits), std::move(labels)) {
    const auto sl = std::get<0>(this->children_).shape();
    const auto sb = std::get<1>(this->children_).shape();
    if (sl[0] != sb[0] || (sl[1] == 0 && sl[0] != 0))
      throw shape_error("cross_entropy: logits " + detail::describe_node(std::get<0>(this->children_)) + " and labels " +
                        detail::describe_node(std::get<1>(this->children_)) +
                        ": need one label per row of logits and at least one class");
  }
  [[nodiscard]] shape_t<0> shape() const { return {}; }

  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, 0>& out) const {
    const auto logits = ctx.template operand<0>();
    const auto labels = ctx.template operand<1>();
    using label_t = typename Labels::value_type;
    const std::size_t rows = logits.shape[0], classes = logits.shape[1];
    const label_t* first = labels.data + (logits.offset[0] - labels.offset[0]);  // replicated labels: read at the rows' offset
    const thrust::counting_iterator<std::size_t> begin(0), end(rows);
    const std::size_t bad = thrust::transform_reduce(ctx.system, begin, end, detail::label_out_of_range<label_t>{first, classes},
                                                     std::size_t{0}, thrust::plus<std::size_t>{});
    if (bad != 0)
      throw shape_error("cross_entropy: " + std::to_string(bad) + " labels of " + detail::describe_node(std::get<1>(this->children_)) +
                        " are not class indices in [0, " + std::to_string(classes) + ")");
    // the sum of the rows' losses, then divided by the global row count, where the result lives
    detail::transform_reduce_into(ctx.system, begin, end, detail::cross_entropy_row<value_type, label_t>{logits.data, first, classes},
                                  value_type{}, thrust::plus<value_type>{}, out.data());
    thrust::for_each_n(ctx.system, begin, std::size_t{1}, detail::mean_of_sum<value_type>{out.data(), logits.global[0]});
  }

 private:
};

}  // namespace pdo
