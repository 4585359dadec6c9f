// pdo/expr/operators.hpp: the functions and operators that build expressions.
#pragma once

#include <pdo/expr/cast.hpp>
#include <pdo/expr/elementwise.hpp>
#include <pdo/expr/matmul.hpp>
#include <pdo/expr/reduce.hpp>
#include <pdo/expr/reshape.hpp>
#include <pdo/expr/softmax.hpp>
#include <pdo/expr/transpose.hpp>

#include <concepts>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

namespace pdo {

namespace detail {
/// @brief An operand of an arithmetic operator: a tensor operand, or a number beside one.
template <class A, class B>
concept arithmetic_operands = (tensor_operand<A> || tensor_operand<B>) && (tensor_operand<A> || element<std::remove_cvref_t<A>>) &&
                              (tensor_operand<B> || element<std::remove_cvref_t<B>>);

template <class Op, class... Args>
auto make_elementwise(Args&&... args) {
  return elementwise_node<Op, expression_t<Args>...>(as_expression(std::forward<Args>(args))...);
}
}  // namespace detail

/// @brief The value of a reduction's dim that means "every dim" (sum, mean, max: their default).
inline constexpr std::ptrdiff_t all_dims = std::numeric_limits<std::ptrdiff_t>::min();
/// @brief The last dim (softmax's and log_softmax's default). A dim counts from 0, the first,
/// or, as in PyTorch, back from -1, the last: `sum<-1>(a)` sums a's last dim.
inline constexpr std::ptrdiff_t last_dim = -1;

namespace detail {
/// @brief Whether `Dim` is one of the `N` positions of an op's dim: 0 to N - 1, or -1 (the
/// last) back to -N.
template <std::ptrdiff_t Dim, std::size_t N>
inline constexpr bool dim_in_range = Dim >= -static_cast<std::ptrdiff_t>(N) && Dim < static_cast<std::ptrdiff_t>(N);
/// @brief `Dim`, one of `N` positions, counted from 0; `N` (out of range, for the op's own
/// check to reject) when it is not one of them.
template <std::ptrdiff_t Dim, std::size_t N>
inline constexpr std::size_t dim_index = !dim_in_range<Dim, N> ? N
                                         : Dim < 0              ? static_cast<std::size_t>(Dim + static_cast<std::ptrdiff_t>(N))
                                                                : static_cast<std::size_t>(Dim);
}  // namespace detail

// Arithmetic: tensor operands, with plain numbers on either side.
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto operator+(A&& a, B&& b) {
  return detail::make_elementwise<op::add>(std::forward<A>(a), std::forward<B>(b));
}
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto operator-(A&& a, B&& b) {
  return detail::make_elementwise<op::subtract>(std::forward<A>(a), std::forward<B>(b));
}
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto operator*(A&& a, B&& b) {
  return detail::make_elementwise<op::multiply>(std::forward<A>(a), std::forward<B>(b));
}
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto operator/(A&& a, B&& b) {
  return detail::make_elementwise<op::divide>(std::forward<A>(a), std::forward<B>(b));
}
template <detail::tensor_operand A>
auto operator-(A&& a) {
  return detail::make_elementwise<op::negate>(std::forward<A>(a));
}

// Elementwise functions.
template <detail::tensor_operand A>
auto exp(A&& a) { return detail::make_elementwise<op::exp>(std::forward<A>(a)); }
template <detail::tensor_operand A>
auto log(A&& a) { return detail::make_elementwise<op::log>(std::forward<A>(a)); }
template <detail::tensor_operand A>
auto sqrt(A&& a) { return detail::make_elementwise<op::sqrt>(std::forward<A>(a)); }
template <detail::tensor_operand A>
auto tanh(A&& a) { return detail::make_elementwise<op::tanh>(std::forward<A>(a)); }
template <detail::tensor_operand A>
auto sigmoid(A&& a) { return detail::make_elementwise<op::sigmoid>(std::forward<A>(a)); }
template <detail::tensor_operand A>
auto relu(A&& a) { return detail::make_elementwise<op::relu>(std::forward<A>(a)); }
/// @brief GELU, exact (erf form): what PyTorch's F.gelu computes by default.
template <detail::tensor_operand A>
auto gelu(A&& a) { return detail::make_elementwise<op::gelu>(std::forward<A>(a)); }
/// @brief GELU, tanh approximation: PyTorch's F.gelu(x, approximate="tanh") (GPT-2's).
template <detail::tensor_operand A>
auto gelu_tanh(A&& a) { return detail::make_elementwise<op::gelu_tanh>(std::forward<A>(a)); }

/// @brief Elementwise maximum and minimum of two operands.
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto maximum(A&& a, B&& b) { return detail::make_elementwise<op::maximum>(std::forward<A>(a), std::forward<B>(b)); }
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto minimum(A&& a, B&& b) { return detail::make_elementwise<op::minimum>(std::forward<A>(a), std::forward<B>(b)); }

// Comparisons: 1 where they hold, 0 elsewhere, in the operands' element type.
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto less(A&& a, B&& b) { return detail::make_elementwise<op::less>(std::forward<A>(a), std::forward<B>(b)); }
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto less_equal(A&& a, B&& b) { return detail::make_elementwise<op::less_equal>(std::forward<A>(a), std::forward<B>(b)); }
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto greater(A&& a, B&& b) { return detail::make_elementwise<op::greater>(std::forward<A>(a), std::forward<B>(b)); }
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto greater_equal(A&& a, B&& b) {
  return detail::make_elementwise<op::greater_equal>(std::forward<A>(a), std::forward<B>(b));
}
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto equal(A&& a, B&& b) { return detail::make_elementwise<op::equal>(std::forward<A>(a), std::forward<B>(b)); }
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto not_equal(A&& a, B&& b) { return detail::make_elementwise<op::not_equal>(std::forward<A>(a), std::forward<B>(b)); }

/// @brief a where `cond` is nonzero, else b (each may be a number).
template <detail::tensor_operand C, class A, class B>
  requires(detail::tensor_operand<A> || element<std::remove_cvref_t<A>>) && (detail::tensor_operand<B> || element<std::remove_cvref_t<B>>)
auto where(C&& cond, A&& a, B&& b) {
  return detail::make_elementwise<op::where>(std::forward<C>(cond), std::forward<A>(a), std::forward<B>(b));
}

/// @brief Matrix product: a [..., M, K] by b [K, N] or [..., K, N].
template <detail::tensor_operand A, detail::tensor_operand B>
auto matmul(A&& a, B&& b) {
  return matmul_node<detail::expression_t<A>, detail::expression_t<B>>(detail::as_expression(std::forward<A>(a)),
                                                                       detail::as_expression(std::forward<B>(b)));
}

namespace detail {
template <reduction What, std::ptrdiff_t Dim, class A>
auto make_reduction(A&& a) {
  using e = expression_t<A>;
  if constexpr (Dim == all_dims) return reduce_node<What, 0, true, e>(as_expression(std::forward<A>(a)));
  else return reduce_node<What, dim_index<Dim, e::rank>, false, e>(as_expression(std::forward<A>(a)));
}
}  // namespace detail

/// @brief Sum over dim `Dim` (which leaves the shape; -1 is the last dim), or over every dim by default.
template <std::ptrdiff_t Dim = all_dims, detail::tensor_operand A>
auto sum(A&& a) { return detail::make_reduction<detail::reduction::sum, Dim>(std::forward<A>(a)); }
/// @brief Mean over dim `Dim`, or over every dim by default.
template <std::ptrdiff_t Dim = all_dims, detail::tensor_operand A>
auto mean(A&& a) { return detail::make_reduction<detail::reduction::mean, Dim>(std::forward<A>(a)); }
/// @brief Maximum over dim `Dim`, or over every dim by default.
template <std::ptrdiff_t Dim = all_dims, detail::tensor_operand A>
auto max(A&& a) { return detail::make_reduction<detail::reduction::max, Dim>(std::forward<A>(a)); }

/// @brief softmax along dim `Dim` (the last by default).
template <std::ptrdiff_t Dim = last_dim, detail::tensor_operand A>
auto softmax(A&& a) {
  using e = detail::expression_t<A>;
  return softmax_node<false, detail::dim_index<Dim, e::rank>, e>(detail::as_expression(std::forward<A>(a)));
}
/// @brief log_softmax along dim `Dim` (the last by default).
template <std::ptrdiff_t Dim = last_dim, detail::tensor_operand A>
auto log_softmax(A&& a) {
  using e = detail::expression_t<A>;
  return softmax_node<true, detail::dim_index<Dim, e::rank>, e>(detail::as_expression(std::forward<A>(a)));
}
namespace detail {
/// @brief The error of a reduction or softmax given its dim as an argument, as PyTorch takes it.
template <class I>
void dim_as_argument() {
  static_assert(always_false<I>,
                "pdo: sum, mean, max, softmax and log_softmax take the dim as a template argument: pdo::sum<1>(a), pdo::softmax<1>(a) "
                "(dims count from 0, or back from -1, the last; without it, sum, mean and max reduce every dim and softmax takes the last)");
}
}  // namespace detail

/// @brief Rejected: the dim is a template argument, sum<Dim>(a) (and so for mean, max, softmax, log_softmax).
template <detail::tensor_operand A, std::integral I>
auto sum(A&& a, I) {
  detail::dim_as_argument<I>();
  return pdo::sum(std::forward<A>(a));
}
template <detail::tensor_operand A, std::integral I>
auto mean(A&& a, I) {
  detail::dim_as_argument<I>();
  return pdo::mean(std::forward<A>(a));
}
template <detail::tensor_operand A, std::integral I>
auto max(A&& a, I) {
  detail::dim_as_argument<I>();
  return pdo::max(std::forward<A>(a));
}
template <detail::tensor_operand A, std::integral I>
auto softmax(A&& a, I) {
  detail::dim_as_argument<I>();
  return pdo::softmax(std::forward<A>(a));
}
template <detail::tensor_operand A, std::integral I>
auto log_softmax(A&& a, I) {
  detail::dim_as_argument<I>();
  return pdo::log_softmax(std::forward<A>(a));
}

/// @brief Mean cross-entropy of logits [N, C] against class indices [N].
template <detail::tensor_operand L, detail::tensor_operand Y>
auto cross_entropy(L&& logits, Y&& labels) {
  return cross_entropy_node<detail::expression_t<L>, detail::expression_t<Y>>(detail::as_expression(std::forward<L>(logits)),
                                                                              detail::as_expression(std::forward<Y>(labels)));
}

namespace detail {
/// @brief mse once the difference of its operands is `difference()` (an expression, or a var:
/// `mean` is found by the argument's type, so autograd's mse shares this): mean(d²), a shape
/// error of the difference named as mse's.
template <class Difference>
auto mse_of(Difference difference) {
  const auto d = [&] {
    try {
      return difference();
    } catch (const shape_error& e) {
      throw shape_error(std::string("mse: ") + e.what());
    }
  }();
  return mean(d * d);
}
}  // namespace detail

/// @brief Mean squared error: mean((a - b)²) over every element, a scalar expression (a and b
/// broadcast as in a - b, either may be a number; shapes that do not are a pdo::shape_error
/// that names mse).
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto mse(A&& a, B&& b) {
  return detail::mse_of([&] { return detail::make_elementwise<op::subtract>(std::forward<A>(a), std::forward<B>(b)); });
}

/// @brief The last two dims swapped.
template <detail::tensor_operand A>
auto transpose(A&& a) {
  return transpose_node<detail::expression_t<A>>(detail::as_expression(std::forward<A>(a)));
}

/// @brief The same elements under `shape` (see reshape_node for what may change).
template <detail::tensor_operand A, std::size_t Rank>
auto reshape(A&& a, const std::size_t (&shape)[Rank]) {
  shape_t<Rank> s{};
  for (std::size_t d = 0; d < Rank; ++d) s[d] = shape[d];
  return reshape_node<Rank, detail::expression_t<A>>(detail::as_expression(std::forward<A>(a)), s);
}
template <detail::tensor_operand A, std::size_t Rank>
auto reshape(A&& a, const shape_t<Rank>& shape) {
  return reshape_node<Rank, detail::expression_t<A>>(detail::as_expression(std::forward<A>(a)), shape);
}

/// @brief `a`'s elements converted to `U` (as static_cast converts them), its layout kept:
/// `cast<float>(labels)`, `cast<double>(x)`.
template <class U, detail::tensor_operand A>
auto cast(A&& a) {
  return cast_node<U, detail::expression_t<A>>(detail::as_expression(std::forward<A>(a)));
}

/// @brief `a` with a dim of extent 1 inserted at `Dim` (0 to a's rank, or -1, after the last
/// dim, back to -(rank + 1), as PyTorch); every dim keeps its split.
template <std::ptrdiff_t Dim, detail::tensor_operand A>
auto unsqueeze(A&& a) {
  using e = detail::expression_t<A>;
  return unsqueeze_node<detail::dim_index<Dim, e::rank + 1>, e>(detail::as_expression(std::forward<A>(a)));
}

namespace detail {
/// @brief The formula of pdo::layer_norm, of `x`: an expression, or a pdo::var (whose ops,
/// declared in autograd/ops.hpp, the unqualified calls find by argument-dependent lookup),
/// whose elements are `T` and whose rank is `Rank`. After a failed check, `x` itself, so that
/// nothing more is instantiated.
template <class T, std::size_t Rank, class X>
auto layer_norm_formula(const X& x, double eps) {
  static_assert(std::is_floating_point_v<T>, "pdo: layer_norm: the operand's elements must be floating-point (float, double)");
  static_assert(Rank >= 1, "pdo: layer_norm: the operand needs a dim to normalise over (its last)");
  if constexpr (!std::is_floating_point_v<T> || Rank == 0) {
    return x;
  } else {
    constexpr std::size_t last = Rank - 1;
    auto centred = x - unsqueeze<last>(mean<last>(x));
    return centred / sqrt(unsqueeze<last>(mean<last>(centred * centred)) + static_cast<T>(eps));
  }
}
}  // namespace detail

/// @brief Layer normalisation over the last dim, as PyTorch's layer_norm without weight and
/// bias: (a - mean) / sqrt(variance + eps), with the mean and the biased variance of each
/// row of the last dim (centred first, as PyTorch computes it). Lazy, as every expression:
/// its reductions run when it is evaluated, the rows' mean once for each of its three uses
/// (an expression shares no value; layer_norm of a pdo::var computes each once). Of a
/// dtensor whose last dim is split, the rows' means are sums over the places (planned as
/// for pdo::mean), all_reduced.
template <detail::tensor_operand A>
auto layer_norm(A&& a, double eps = 1e-5) {
  using node_t = detail::expression_t<A>;
  // the node's copies share the leaves it owns (an rvalue operand stays alive)
  return detail::layer_norm_formula<typename node_t::value_type, node_t::rank>(detail::as_expression(std::forward<A>(a)), eps);
}

}  // namespace pdo
