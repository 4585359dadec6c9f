// pdo/expr/softmax.hpp: softmax and log_softmax along one dim, and the cross-entropy loss.
#pragma once

#include <pdo/expr/expression.hpp>
#include <pdo/kernels/softmax.hpp>

#include <cstddef>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace pdo {

/// @brief softmax (or log_softmax when `Log`) of its operand along dim `Dim`. The dim is
/// gathered first where it is split (see detail::along_dim_rule).
template <bool Log, std::size_t Dim, class C>
class softmax_node : public detail::op_node<C> {
 public:
  /// @brief The operand's floating-point element type, which the result keeps.
  using value_type = typename C::value_type;
  static_assert(Dim < C::rank, "pdo: softmax: the dim is out of range for the operand's rank: 0 to rank - 1, or -1 (the last) back to -rank");
  static_assert(std::is_floating_point_v<value_type>, "pdo: softmax: needs a floating-point operand");
  /// @brief Whether the checks above hold here and every op below is well formed (see
  /// detail::op_node): when not, eval stops after the error.
  static constexpr bool well_formed = detail::op_node<C>::well_formed && Dim < C::rank && std::is_floating_point_v<value_type>;
  /// @brief The operand's rank.
  static constexpr std::size_t rank = C::rank;
  /// @brief false: a softmax is never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "softmax" or "log_softmax", as plans and error messages print it.
  static constexpr std::string_view name = Log ? "log_softmax" : "softmax";
  /// @brief The planner's rule (detail::along_dim_rule): dim `Dim` whole on each place, partials reduced.
  static constexpr detail::op_rule rule = detail::along_dim_rule(C::rule.out, Dim);

  /// @brief Wraps the operand; no check runs here (the dim and type are checked at compile time).
  explicit softmax_node(C c) : detail::op_node<C>(std::move(c)) {}
  /// @brief The operand's shape.
  [[nodiscard]] shape_t<rank> shape() const { return detail::operand<0>(this->children_).shape(); }

  /// @brief Writes the softmax (or log_softmax) along `Dim` of this place's block of the operand into `out`.
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto in = ctx.template operand<0>();
    detail::softmax_dim<Log>(ctx.system, in.data, detail::view_along(in.shape, Dim), out.data());
  }

 private:
};

namespace detail {

/// @brief The error of a place's cross_entropy whose labels (its `rows` rows, from global row
/// `row0`) hold `bad` values that are not class indices in [0, classes): how many, and the
/// first of them with its row (read back from the place's memory, `where`), named as `op`'s.
template <class Label>
[[noreturn]] void throw_bad_labels(const char* op, place_state* where, const Label* labels, std::size_t rows, std::size_t row0, std::size_t classes,
                                   std::size_t bad, const std::string& operand) {
  std::vector<Label> host(rows);
  copy_bytes(nullptr, host.data(), where, labels, rows * sizeof(Label));
  const label_out_of_range<Label> out_of_range{host.data(), classes};
  std::size_t i = 0;
  while (i + 1 < rows && out_of_range(i) == 0) ++i;
  std::string value;
  if constexpr (std::is_integral_v<Label>) {
    value = std::to_string(host[i]);
  } else {
    value = format_number(static_cast<double>(host[i]));
  }
  throw shape_error(std::string(op) + ": " + std::to_string(bad) + (bad == 1 ? " label of " : " labels of ") + operand +
                    (bad == 1 ? " is not a class index" : " are not class indices") + " in [0, " + std::to_string(classes) +
                    "): the first is " + value + ", at row " +
                    std::to_string(row0 + i));
}

}  // namespace detail

/// @brief cross_entropy(logits [N, C], labels [N]): the mean over the N samples of
/// -log softmax(logits)[label]. Labels are class indices of any element type.
template <class Logits, class Labels>
class cross_entropy_node : public detail::op_node<Logits, Labels> {

 public:
  /// @brief The logits' floating-point element type, which the loss has.
  using value_type = typename Logits::value_type;
  static_assert(Logits::rank == 2 && Labels::rank == 1, "pdo: cross_entropy: takes logits [N, C] and labels [N]");
  static_assert(std::is_floating_point_v<value_type>, "pdo: cross_entropy: needs floating-point logits");
  /// @brief Whether the checks above hold here and every op below is well formed (see
  /// detail::op_node): when not, eval stops after the error.
  static constexpr bool well_formed = detail::op_node<Logits, Labels>::well_formed && Logits::rank == 2 && Labels::rank == 1 &&
                                      std::is_floating_point_v<value_type>;
  /// @brief 0: the loss is one number.
  static constexpr std::size_t rank = 0;
  /// @brief false: a cross_entropy is never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "cross_entropy": how plans and error messages name this op.
  static constexpr std::string_view name = "cross_entropy";
  /// @brief The planner's rule (detail::cross_entropy_rule): classes gathered, labels beside their rows; a split
  /// N makes the result partial.
  static constexpr detail::op_rule rule = detail::cross_entropy_rule(Logits::rule.out, Labels::rule.out);

  /// @brief pdo::shape_error unless there is one label per row of logits and, for N > 0, at least one class.
  cross_entropy_node(Logits logits, Labels labels) : detail::op_node<Logits, Labels>(std::move(logits), std::move(labels)) {
    const auto sl = detail::operand<0>(this->children_).shape();
    const auto sb = detail::operand<1>(this->children_).shape();
    if (sl[0] != sb[0] || (sl[1] == 0 && sl[0] != 0))
      throw shape_error("cross_entropy: logits " + detail::describe_node(detail::operand<0>(this->children_)) + " and labels " +
                        detail::describe_node(detail::operand<1>(this->children_)) +
                        ": need one label per row of logits and at least one class");
  }
  /// @brief The empty shape of rank 0.
  [[nodiscard]] shape_t<0> shape() const { return {}; }

  /// @brief Writes into `out` this place's rows' summed losses divided by the global N; pdo::shape_error when
  /// a label is not a class index in [0, C).
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
      detail::throw_bad_labels("cross_entropy", ctx.system.gpu, first, rows, logits.offset[0], classes, bad, detail::describe_node(detail::operand<1>(this->children_)));
    // the sum of the rows' losses, then divided by the global row count, where the result lives
    detail::cross_entropy_sum_into(ctx.system, logits.data, first, rows, classes, out.data());
    thrust::for_each_n(ctx.system, begin, std::size_t{1}, detail::mean_of_sum<value_type>{out.data(), logits.global[0]});
  }

 private:
};

}  // namespace pdo
