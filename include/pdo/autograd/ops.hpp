// pdo/autograd/ops.hpp: the ops of pdo/expr on pdo::var, each with its backward rule.
//
// Each op evaluates its forward expression (fused and planned as pdo::eval does) and
// records a backward rule that is itself a pdo expression. So the gradient of a dtensor op
// is planned by the same rules as the forward: its layout is a type, derived at compile
// time, and it is brought to the layout of the value it is the gradient of by the
// redistribution the planner picks (detail::to_value). A replicated weight used on row-split
// data gets a partial gradient, which that step all_reduces.
#pragma once

#include <pdo/autograd/variable.hpp>
#include <pdo/expr/cross_entropy_grad.hpp>

#include <concepts>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

namespace pdo {

namespace detail {

template <class V>
using var_element_t = typename value_kind<V>::element_type;

template <std::size_t D, class Target, class G>
Target sum_kept_dims(const G& g, const shape_t<value_kind<Target>::rank>& target) {
  constexpr std::size_t r = value_kind<Target>::rank;
  if constexpr (D == r) {
    return to_value<Target>(G(g));
  } else {
    if (target[D] != 1 || g.shape()[D] == 1) return sum_kept_dims<D + 1, Target>(g, target);
    // summed, the dim put back with extent 1 (unsqueeze keeps every other dim's split, where a
    // reshape could not put it back after a split dim); a dtensor's layout may change here
    // (summing a split dim leaves a pending sum): the result is brought to the value's layout
    // at the end (to_value)
    return sum_kept_dims<D + 1, Target>(pdo::eval(pdo::unsqueeze<D>(pdo::sum<D>(g))), target);
  }
}

/// @brief `g` summed over the dims that `target` broadcast along, so it has `target`'s
/// shape: leading dims `target` lacks, and dims where `target` has extent 1.
template <class Target, class G>
Target sum_to(const G& g, const shape_t<value_kind<Target>::rank>& target) {
  constexpr std::size_t r = value_kind<Target>::rank, rg = value_kind<G>::rank;
  if constexpr (rg > r) {
    return sum_to<Target>(pdo::eval(pdo::sum<0>(g)), target);
  } else {
    return sum_kept_dims<0, Target>(g, target);
  }
}

/// @brief `g` with the extent-1 dim at `Dim` that a reduction over `Dim` removed, put back
/// (whatever dims of `g` are split).
template <std::size_t Dim, class G, std::size_t R>
auto keep_dim(const G& g, const shape_t<R>&) {
  return pdo::unsqueeze<Dim>(g);
}

}  // namespace detail

// ---- elementwise, two operands (with NumPy broadcasting) ----

template <class A, class B>
auto operator+(const var<A>& a, const var<B>& b) {
  auto y = detail::eval_forward(a.value() + b.value());
  return detail::record(
      std::move(y),
      [a, b](auto& self) {
        if (a.requires_grad()) detail::add_grad(a, detail::sum_to<detail::grad_t<A>>(*self.grad, a.shape()));
        if (b.requires_grad()) detail::add_grad(b, detail::sum_to<detail::grad_t<B>>(*self.grad, b.shape()));
      },
      a, b);
}

template <class A, class B>
auto operator-(const var<A>& a, const var<B>& b) {
  auto y = detail::eval_forward(a.value() - b.value());
  return detail::record(
      std::move(y),
      [a, b](auto& self) {
        if (a.requires_grad()) detail::add_grad(a, detail::sum_to<detail::grad_t<A>>(*self.grad, a.shape()));
        if (b.requires_grad()) detail::add_grad(b, detail::sum_to<detail::grad_t<B>>(pdo::eval(-*self.grad), b.shape()));
      },
      a, b);
}

template <class A, class B>
auto operator*(const var<A>& a, const var<B>& b) {
  auto y = detail::eval_forward(a.value() * b.value());
  return detail::record(
      std::move(y),
      [a, b](auto& self) {
        if (a.requires_grad()) detail::add_grad(a, detail::sum_to<detail::grad_t<A>>(pdo::eval(*self.grad * b.value()), a.shape()));
        if (b.requires_grad()) detail::add_grad(b, detail::sum_to<detail::grad_t<B>>(pdo::eval(*self.grad * a.value()), b.shape()));
      },
      a, b);
}

template <class A, class B>
auto operator/(const var<A>& a, const var<B>& b) {
  auto y = detail::eval_forward(a.value() / b.value());
  return detail::record(
      std::move(y),
      [a, b](auto& self) {
        if (a.requires_grad()) detail::add_grad(a, detail::sum_to<detail::grad_t<A>>(pdo::eval(*self.grad / b.value()), a.shape()));
        if (b.requires_grad())
          detail::add_grad(b, detail::sum_to<detail::grad_t<B>>(pdo::eval(-(*self.grad * self.value) / b.value()), b.shape()));
      },
      a, b);
}

namespace detail {
/// @brief maximum (Max) or minimum of two vars. The gradient goes to the operand chosen;
/// where the two tie (or are both NaN) each gets half (PyTorch's rule).
template <bool Max, class A, class B>
auto extremum(const var<A>& a, const var<B>& b) {
  auto y = [&] {
    if constexpr (Max) return eval_forward(pdo::maximum(a.value(), b.value()));
    else return eval_forward(pdo::minimum(a.value(), b.value()));
  }();
  using V = decltype(y);
  using T = var_element_t<V>;
  using share_op = std::conditional_t<Max, op::maximum_share, op::minimum_share>;
  return record(
      std::move(y),
      [a, b](auto& self) {
        const auto& g = *self.grad;
        const auto to_a = pdo::eval(make_elementwise<share_op>(a.value(), b.value()));
        if (a.requires_grad()) add_grad(a, sum_to<grad_t<A>>(pdo::eval(g * to_a), a.shape()));
        if (b.requires_grad()) add_grad(b, sum_to<grad_t<B>>(pdo::eval(g * (T(1) - to_a)), b.shape()));
      },
      a, b);
}
}  // namespace detail

/// @brief Elementwise maximum (NaN where either is NaN); where both are equal each gets
/// half the gradient.
template <class A, class B>
auto maximum(const var<A>& a, const var<B>& b) {
  return detail::extremum<true>(a, b);
}
/// @brief Elementwise minimum (NaN where either is NaN); where both are equal each gets
/// half the gradient.
template <class A, class B>
auto minimum(const var<A>& a, const var<B>& b) {
  return detail::extremum<false>(a, b);
}

namespace detail {
/// @brief maximum (Max) or minimum of a var and a number: the gradient goes to the var where
/// it is chosen, half of it where the two tie (or are both NaN), as for two vars.
template <bool Max, class A>
auto extremum_with_number(const var<A>& a, var_element_t<A> s) {
  auto y = [&] {
    if constexpr (Max) return eval_forward(pdo::maximum(a.value(), s));
    else return eval_forward(pdo::minimum(a.value(), s));
  }();
  using share_op = std::conditional_t<Max, op::maximum_share, op::minimum_share>;
  return record(
      std::move(y), [a, s](auto& self) { add_grad(a, *self.grad * make_elementwise<share_op>(a.value(), s)); }, a);
}
}  // namespace detail

/// @brief Elementwise maximum of a var and a number (ReLU is maximum(x, 0) with half the
/// gradient at 0, as torch.maximum); NaN where the var is NaN.
template <class A>
auto maximum(const var<A>& a, detail::var_element_t<A> s) {
  return detail::extremum_with_number<true>(a, s);
}
template <class A>
auto maximum(detail::var_element_t<A> s, const var<A>& a) {
  return detail::extremum_with_number<true>(a, s);
}
/// @brief Elementwise minimum of a var and a number; NaN where the var is NaN.
template <class A>
auto minimum(const var<A>& a, detail::var_element_t<A> s) {
  return detail::extremum_with_number<false>(a, s);
}
template <class A>
auto minimum(detail::var_element_t<A> s, const var<A>& a) {
  return detail::extremum_with_number<false>(a, s);
}

/// @brief a where `cond` (a value, not differentiated) is nonzero, else b.
template <class C, class A, class B>
  requires(!is_var_v<std::remove_cvref_t<C>>)
auto where(const C& condition, const var<A>& a, const var<B>& b) {
  auto cond = pdo::eval(condition);
  auto y = detail::eval_forward(pdo::where(cond, a.value(), b.value()));
  using V = decltype(y);
  using T = detail::var_element_t<V>;
  return detail::record(
      std::move(y),
      [cond, a, b](auto& self) {
        const auto& g = *self.grad;
        if (a.requires_grad()) detail::add_grad(a, detail::sum_to<detail::grad_t<A>>(pdo::eval(pdo::where(cond, g, T(0))), a.shape()));
        if (b.requires_grad()) detail::add_grad(b, detail::sum_to<detail::grad_t<B>>(pdo::eval(pdo::where(cond, T(0), g)), b.shape()));
      },
      a, b);
}
/// @brief a where `cond` is nonzero, else the number s (a mask: `where(keep, x, 0.0)`).
template <class C, class A>
  requires(!is_var_v<std::remove_cvref_t<C>>)
auto where(const C& condition, const var<A>& a, detail::var_element_t<A> s) {
  auto cond = pdo::eval(condition);
  using T = detail::var_element_t<A>;
  return detail::record(
      detail::eval_forward(pdo::where(cond, a.value(), s)),
      [cond, a](auto& self) {
        detail::add_grad(a, detail::sum_to<detail::grad_t<A>>(pdo::eval(pdo::where(cond, *self.grad, T(0))), a.shape()));
      },
      a);
}
/// @brief The number s where `cond` is nonzero, else a.
template <class C, class A>
  requires(!is_var_v<std::remove_cvref_t<C>>)
auto where(const C& condition, detail::var_element_t<A> s, const var<A>& a) {
  auto cond = pdo::eval(condition);
  using T = detail::var_element_t<A>;
  return detail::record(
      detail::eval_forward(pdo::where(cond, s, a.value())),
      [cond, a](auto& self) {
        detail::add_grad(a, detail::sum_to<detail::grad_t<A>>(pdo::eval(pdo::where(cond, T(0), *self.grad)), a.shape()));
      },
      a);
}

// ---- with a number on one side ----

template <class A>
auto operator+(const var<A>& a, detail::var_element_t<A> s) {
  return detail::record(
      detail::eval_forward(a.value() + s), [a](auto& self) { detail::add_grad(a, *self.grad); }, a);
}
template <class A>
auto operator+(detail::var_element_t<A> s, const var<A>& a) {
  return a + s;
}
template <class A>
auto operator-(const var<A>& a, detail::var_element_t<A> s) {
  return a + (-s);
}
template <class A>
auto operator-(detail::var_element_t<A> s, const var<A>& a) {
  return detail::record(
      detail::eval_forward(s - a.value()), [a](auto& self) { detail::add_grad(a, -*self.grad); }, a);
}
template <class A>
auto operator*(const var<A>& a, detail::var_element_t<A> s) {
  return detail::record(
      detail::eval_forward(a.value() * s), [a, s](auto& self) { detail::add_grad(a, *self.grad * s); }, a);
}
template <class A>
auto operator*(detail::var_element_t<A> s, const var<A>& a) {
  return a * s;
}
template <class A>
auto operator/(const var<A>& a, detail::var_element_t<A> s) {
  return detail::record(
      detail::eval_forward(a.value() / s), [a, s](auto& self) { detail::add_grad(a, *self.grad / s); }, a);
}
template <class A>
auto operator/(detail::var_element_t<A> s, const var<A>& a) {
  return detail::record(
      detail::eval_forward(s / a.value()),
      [a](auto& self) { detail::add_grad(a, -(*self.grad * self.value) / a.value()); }, a);
}

// ---- elementwise, one operand ----

template <class A>
auto operator-(const var<A>& a) {
  return detail::record(
      detail::eval_forward(-a.value()), [a](auto& self) { detail::add_grad(a, -*self.grad); }, a);
}
template <class A>
auto exp(const var<A>& a) {
  return detail::record(
      detail::eval_forward(pdo::exp(a.value())), [a](auto& self) { detail::add_grad(a, *self.grad * self.value); }, a);
}
template <class A>
auto log(const var<A>& a) {
  return detail::record(
      detail::eval_forward(pdo::log(a.value())), [a](auto& self) { detail::add_grad(a, *self.grad / a.value()); }, a);
}
template <class A>
auto sqrt(const var<A>& a) {
  using T = detail::var_element_t<A>;
  return detail::record(
      detail::eval_forward(pdo::sqrt(a.value())),
      [a](auto& self) { detail::add_grad(a, *self.grad / (self.value * T(2))); }, a);
}
template <class A>
auto tanh(const var<A>& a) {
  using T = detail::var_element_t<A>;
  return detail::record(
      detail::eval_forward(pdo::tanh(a.value())),
      [a](auto& self) { detail::add_grad(a, *self.grad * (T(1) - self.value * self.value)); }, a);
}
template <class A>
auto sigmoid(const var<A>& a) {
  using T = detail::var_element_t<A>;
  return detail::record(
      detail::eval_forward(pdo::sigmoid(a.value())),
      [a](auto& self) { detail::add_grad(a, *self.grad * self.value * (T(1) - self.value)); }, a);
}
template <class A>
auto relu(const var<A>& a) {
  using T = detail::var_element_t<A>;
  return detail::record(
      detail::eval_forward(pdo::relu(a.value())),
      // PyTorch's rule, x <= 0 ? 0 : g, which passes g at a NaN
      [a](auto& self) { detail::add_grad(a, pdo::where(pdo::less_equal(a.value(), T(0)), T(0), *self.grad)); }, a);
}
/// @brief GELU, exact (erf form), PyTorch's default.
template <class A>
auto gelu(const var<A>& a) {
  return detail::record(
      detail::eval_forward(pdo::gelu(a.value())),
      [a](auto& self) {
        detail::add_grad(a, *self.grad * detail::make_elementwise<op::gelu_derivative>(a.value()));
      },
      a);
}
/// @brief GELU, tanh approximation (PyTorch's approximate="tanh").
template <class A>
auto gelu_tanh(const var<A>& a) {
  return detail::record(
      detail::eval_forward(pdo::gelu_tanh(a.value())),
      [a](auto& self) {
        detail::add_grad(a, *self.grad * detail::make_elementwise<op::gelu_tanh_derivative>(a.value()));
      },
      a);
}

// ---- matmul ----

namespace detail {
template <class A, class B>
auto matmul_var(const var<A>& a, const var<B>& b);
}  // namespace detail

/// @brief matmul(a [..., M, K], b [K, N] or [..., K, N]); gradients matmul(g, bᵀ) and
/// matmul(aᵀ, g) (summed over the batch when b is one matrix for the whole batch).
template <class A, class B>
auto matmul(const var<A>& a, const var<B>& b) {
  using node_t = decltype(pdo::matmul(a.value(), b.value()));
  if constexpr (!node_t::well_formed) {
    return var<detail::unformed_value_t<node_t>>{};  // the product's error was given: nothing more after it
  } else {
    return detail::matmul_var(a, b);
  }
}

namespace detail {
/// @brief Whether `b`'s product_gradient hook (a local matrix leaf's) took the contribution
/// matmul(aᵀ, g) to its gradient; never for other values.
template <class B, class A2, class G2>
bool took_product_gradient(const var<B>& b, const A2& a, const G2& g) {
  if constexpr (std::is_same_v<B, A2> && std::is_same_v<B, G2> && !value_kind<B>::distributed && value_kind<B>::rank == 2) {
    const auto& hook = b.node()->product_gradient;
    return hook && hook(&a, &g);
  } else {
    return false;
  }
}

/// @brief matmul of two vars whose ranks make a product.
template <class A, class B>
auto matmul_var(const var<A>& a, const var<B>& b) {
  auto y = detail::eval_forward(pdo::matmul(a.value(), b.value()));
  using V = decltype(y);  // well formed: matmul checked it
  constexpr std::size_t ra = detail::value_kind<A>::rank, rb = detail::value_kind<B>::rank;
  return detail::record(
      std::move(y),
      // the node's type, not auto: in a generic lambda clang would instantiate the branches
      // below that depend on g's type before they are discarded
      [a, b](detail::value_node<V>& self) {
        const auto& g = *self.grad;
        if (a.requires_grad()) detail::add_grad(a, pdo::matmul(g, pdo::transpose(b.value())));
        if (b.requires_grad()) {
          if constexpr (rb == ra) {
            if (detail::took_product_gradient(b, a.value(), g)) return;
            detail::add_grad(b, pdo::matmul(pdo::transpose(a.value()), g));
          } else if constexpr (detail::kept_dims(detail::expression_t<const A&>::rule.out) == 0 &&
                               detail::kept_dims(detail::expression_t<decltype(g)>::rule.out) == 0) {
            // one matrix for the whole batch, no dim split: the batch dims fold into the rows
            // (one product)
            const auto& sa = a.shape();
            std::size_t rows = 1;
            for (std::size_t d = 0; d + 1 < ra; ++d) rows *= sa[d];
            const auto a2 = pdo::eval(pdo::reshape(a.value(), shape_t<2>{rows, sa[ra - 1]}));
            const auto g2 = pdo::eval(pdo::reshape(g, shape_t<2>{rows, g.shape()[ra - 1]}));
            if (detail::took_product_gradient(b, a2, g2)) return;
            detail::add_grad(b, pdo::matmul(pdo::transpose(a2), g2));
          } else {
            // one matrix for the whole batch, some dim of a or g split: a fold of the batch
            // dims into the rows would cut them at other places than the split does, so each
            // batch's product is summed over the batch dims (a pending sum where they are split)
            detail::add_grad(b, detail::sum_to<detail::grad_t<B>>(pdo::eval(pdo::matmul(pdo::transpose(a.value()), g)), b.shape()));
          }
        }
      },
      a, b);
}
}  // namespace detail

// ---- reductions ----

namespace detail {
template <reduction What, std::ptrdiff_t Reduced, class A>
auto reduce_var(const var<A>& a) {
  using node_t = decltype(make_reduction<What, Reduced>(a.value()));
  if constexpr (!node_t::well_formed) {
    return var<unformed_value_t<node_t>>{};  // the reduction's error was given: nothing more after it
  } else {
    using T = var_element_t<A>;
    // the dim counted from 0 (all_dims: every dim)
    constexpr std::size_t Dim = Reduced == all_dims ? 0 : dim_index<Reduced, var<A>::rank>;
    constexpr bool all = Reduced == all_dims;
    auto y = detail::eval_forward(detail::make_reduction<What, Reduced>(a.value()));
    return record(
        std::move(y),
        [a](auto& self) {
          const auto& g = *self.grad;
          const auto& x = a.value();
          if constexpr (What == reduction::max) {
            // shared evenly among the elements that reach the maximum (NaN matching NaN), as
            // PyTorch's amax: the components add up to the output's gradient
            if constexpr (all) {
              const auto reached = pdo::eval(make_elementwise<op::matches>(x, self.value));
              const auto share = pdo::eval(g / pdo::sum(reached));
              add_grad(a, reached * share);
            } else {
              const auto reached = pdo::eval(make_elementwise<op::matches>(x, keep_dim<Dim>(self.value, x.shape())));
              const auto share = pdo::eval(g / pdo::sum<Dim>(reached));
              add_grad(a, reached * keep_dim<Dim>(share, x.shape()));
            }
          } else {
            const T scale = [&] {
              if constexpr (What == reduction::sum) return T(1);
              else if constexpr (all) return T(1) / static_cast<T>(volume(x.shape()));
              else return T(1) / static_cast<T>(x.shape()[Dim]);
            }();
            if constexpr (all) add_grad(a, make_elementwise<op::expand>(g, x) * scale);
            else add_grad(a, make_elementwise<op::expand>(keep_dim<Dim>(g, x.shape()), x) * scale);
          }
        },
        a);
  }
}
}  // namespace detail

/// @brief Sum over dim `Dim`, or over every dim.
template <std::ptrdiff_t Dim = all_dims, class A>
auto sum(const var<A>& a) {
  return detail::reduce_var<detail::reduction::sum, Dim>(a);
}
/// @brief Mean over dim `Dim`, or over every dim.
template <std::ptrdiff_t Dim = all_dims, class A>
auto mean(const var<A>& a) {
  return detail::reduce_var<detail::reduction::mean, Dim>(a);
}
/// @brief Maximum over dim `Dim`, or over every dim (NaN when any element is NaN); the
/// gradient is shared evenly among the elements equal to the maximum, as PyTorch's amax;
/// for a NaN maximum, among the NaNs (PyTorch's amax gives NaN to every element there).
template <std::ptrdiff_t Dim = all_dims, class A>
auto max(const var<A>& a) {
  return detail::reduce_var<detail::reduction::max, Dim>(a);
}

/// @brief Rejected: the dim is a template argument, sum<Dim>(v) (and so for mean, max, softmax, log_softmax).
template <class A, std::integral I>
auto sum(const var<A>& a, I) {
  detail::dim_as_argument<I>();
  return pdo::sum(a);
}
template <class A, std::integral I>
auto mean(const var<A>& a, I) {
  detail::dim_as_argument<I>();
  return pdo::mean(a);
}
template <class A, std::integral I>
auto max(const var<A>& a, I) {
  detail::dim_as_argument<I>();
  return pdo::max(a);
}

// ---- softmax and losses ----

namespace detail {
/// @brief softmax (`Log` false) or log_softmax (true) of `a` along `Dim`, recorded for
/// backward; after the op's own error, an empty var (nothing more is reported).
template <bool Log, std::ptrdiff_t Dim, class A>
auto softmax_var(const var<A>& a) {
  const auto op = [](const auto& x) {
    if constexpr (Log) return pdo::log_softmax<Dim>(x);
    else return pdo::softmax<Dim>(x);
  };
  using node_t = decltype(op(a.value()));
  if constexpr (!node_t::well_formed) {
    return var<unformed_value_t<node_t>>{};
  } else {
    constexpr std::size_t d = dim_index<Dim, var<A>::rank>;
    return record(
        eval_forward(op(a.value())),
        [a](auto& self) {
          const auto& g = *self.grad;
          const auto& y = self.value;
          if constexpr (Log) add_grad(a, g - pdo::exp(y) * keep_dim<d>(pdo::eval(pdo::sum<d>(g)), y.shape()));
          else add_grad(a, y * (g - keep_dim<d>(pdo::eval(pdo::sum<d>(g * y)), y.shape())));
        },
        a);
  }
}
}  // namespace detail

/// @brief softmax along `Dim` (the last by default); gradient y * (g - sum(g * y)).
template <std::ptrdiff_t Dim = last_dim, class A>
auto softmax(const var<A>& a) {
  return detail::softmax_var<false, Dim>(a);
}

/// @brief log_softmax along `Dim` (the last by default); gradient g - exp(y) * sum(g).
template <std::ptrdiff_t Dim = last_dim, class A>
auto log_softmax(const var<A>& a) {
  return detail::softmax_var<true, Dim>(a);
}
template <class A, std::integral I>
auto softmax(const var<A>& a, I) {
  detail::dim_as_argument<I>();
  return pdo::softmax(a);
}
template <class A, std::integral I>
auto log_softmax(const var<A>& a, I) {
  detail::dim_as_argument<I>();
  return pdo::log_softmax(a);
}

/// @brief Mean cross-entropy of logits [N, C] against class indices [N] (a value, not
/// differentiated); gradient (softmax(logits) - one_hot(labels)) * g / N.
template <class L, class Y>
  requires(!is_var_v<std::remove_cvref_t<Y>>)
auto cross_entropy(const var<L>& logits, const Y& labels) {
  auto y = detail::eval_forward(pdo::cross_entropy(logits.value(), labels));
  using T = detail::var_element_t<L>;
  return detail::record(
      std::move(y),
      [logits, labels](auto& self) {
        const T scale = static_cast<T>(detail::scalar_of(*self.grad));
        detail::add_grad(logits, cross_entropy_grad_node<detail::expression_t<const L&>, detail::expression_t<const Y&>>(
                                     detail::as_expression(logits.value()), detail::as_expression(labels), scale));
      },
      logits);
}

/// @brief Mean squared error: mean((a - b)²) over every element (a and b broadcast as in
/// a - b; shapes that do not are a pdo::shape_error that names mse).
template <class A, class B>
auto mse(const var<A>& a, const var<B>& b) {
  return detail::mse_of([&] { return a - b; });
}
/// @brief mse against a number: mean((a - s)²).
template <class A>
auto mse(const var<A>& a, detail::var_element_t<A> s) {
  return detail::mse_of([&] { return a - s; });
}
/// @brief mse of a number: mean((s - a)²).
template <class A>
auto mse(detail::var_element_t<A> s, const var<A>& a) {
  return detail::mse_of([&] { return s - a; });
}

// ---- layout of the data ----

/// @brief The last two dims swapped.
template <class A>
auto transpose(const var<A>& a) {
  using node_t = decltype(pdo::transpose(a.value()));
  if constexpr (!node_t::well_formed) {
    return var<detail::unformed_value_t<node_t>>{};  // the transpose's error was given: nothing more after it
  } else {
    auto y = detail::eval_forward(pdo::transpose(a.value()));
    return detail::record(
        std::move(y), [a](auto& self) { detail::add_grad(a, pdo::transpose(*self.grad)); }, a);
  }
}

/// @brief `a`'s elements converted to `U` (see pdo::cast), between floating-point types: the
/// gradient is converted back (a conversion to integers has no gradient: cast the value,
/// a.value(), instead).
template <class U, class A>
auto cast(const var<A>& a) {
  using node_t = decltype(pdo::cast<U>(a.value()));
  constexpr bool floating = std::is_floating_point_v<U> && std::is_floating_point_v<detail::var_element_t<A>>;
  static_assert(floating || !node_t::well_formed,
                "pdo: cast of a var: converts between floating-point types (float, double), whose gradient converts back; to "
                "convert to integers, which have no gradient, cast its value: pdo::cast<int>(v.value())");
  if constexpr (!node_t::well_formed || !floating) {
    return var<detail::unformed_value_t<node_t>>{};  // the error was given: nothing more after it
  } else {
    auto y = detail::eval_forward(pdo::cast<U>(a.value()));
    return detail::record(
        std::move(y), [a](auto& self) { detail::add_grad(a, pdo::cast<detail::var_element_t<A>>(*self.grad)); }, a);
  }
}

/// @brief The same elements under `shape`.
template <class A, std::size_t Rank>
auto reshape(const var<A>& a, const shape_t<Rank>& shape) {
  auto y = detail::eval_forward(pdo::reshape(a.value(), shape));
  return detail::record(
      std::move(y), [a](auto& self) { detail::add_grad(a, pdo::reshape(*self.grad, a.shape())); }, a);
}
template <class A, std::size_t Rank>
auto reshape(const var<A>& a, const std::size_t (&shape)[Rank]) {
  shape_t<Rank> s{};
  for (std::size_t d = 0; d < Rank; ++d) s[d] = shape[d];
  return pdo::reshape(a, s);
}

/// @brief `a` with a dim of extent 1 inserted at `Dim`, every dim keeping its split (as
/// pdo::unsqueeze); the gradient sums the inserted dim away, so it comes back in a's layout
/// whatever the gradient's layout of that dim is.
template <std::ptrdiff_t Dim, class A>
auto unsqueeze(const var<A>& a) {
  using node_t = decltype(pdo::unsqueeze<Dim>(a.value()));
  if constexpr (!node_t::well_formed) {
    return var<detail::unformed_value_t<node_t>>{};  // the unsqueeze's error was given: nothing more after it
  } else {
    constexpr std::size_t d = detail::dim_index<Dim, var<A>::rank + 1>;
    auto y = detail::eval_forward(pdo::unsqueeze<d>(a.value()));
    return detail::record(
        std::move(y), [a](auto& self) { detail::add_grad(a, pdo::sum<d>(*self.grad)); }, a);
  }
}

/// @brief Layer normalisation over the last dim, as PyTorch's layer_norm without weight and
/// bias (see pdo::layer_norm of expressions): each row's mean and variance computed once,
/// the gradient through them. Of a dtensor whose last dim is split, the rows' means are
/// sums over the places (and so are their gradients).
template <class A>
auto layer_norm(const var<A>& a, double eps = 1e-5) {
  return detail::layer_norm_formula<detail::var_element_t<A>, var<A>::rank>(a, eps);
}

// ---- a var with a plain tensor on the other side: one compile error ----

namespace detail {
/// @brief A var and a tensor operand (a pdo::tensor, a pdo::dtensor or an expression of
/// them), in either order: what the ops on vars do not take.
template <class A, class B>
concept var_with_tensor = (is_var_v<A> && tensor_operand<B>) || (tensor_operand<A> && is_var_v<B>);

/// @brief The error of an op given a var and a plain tensor; an empty var of the type the
/// op on the two values would have (`Node`) stands for its result, so nothing more is
/// reported.
template <class Node>
auto var_with_tensor_result() {
  static_assert(always_false<Node>,
                "pdo: an op on a pdo::var was given a plain tensor or expression as its other operand: make that a var too, "
                "pdo::var(x) (a constant: no gradient)");
  return var<unformed_value_t<expression_t<Node>>>{};
}
}  // namespace detail

template <class A, class B>
  requires detail::var_with_tensor<A, B>
auto operator+(const A& a, const B& b) {
  return detail::var_with_tensor_result<decltype(detail::unwrap_var<is_var_v<A>>(a) + detail::unwrap_var<is_var_v<B>>(b))>();
}
template <class A, class B>
  requires detail::var_with_tensor<A, B>
auto operator-(const A& a, const B& b) {
  return detail::var_with_tensor_result<decltype(detail::unwrap_var<is_var_v<A>>(a) - detail::unwrap_var<is_var_v<B>>(b))>();
}
template <class A, class B>
  requires detail::var_with_tensor<A, B>
auto operator*(const A& a, const B& b) {
  return detail::var_with_tensor_result<decltype(detail::unwrap_var<is_var_v<A>>(a) * detail::unwrap_var<is_var_v<B>>(b))>();
}
template <class A, class B>
  requires detail::var_with_tensor<A, B>
auto operator/(const A& a, const B& b) {
  return detail::var_with_tensor_result<decltype(detail::unwrap_var<is_var_v<A>>(a) / detail::unwrap_var<is_var_v<B>>(b))>();
}
template <class A, class B>
  requires detail::var_with_tensor<A, B>
auto maximum(const A& a, const B& b) {
  return detail::var_with_tensor_result<decltype(pdo::maximum(detail::unwrap_var<is_var_v<A>>(a), detail::unwrap_var<is_var_v<B>>(b)))>();
}
template <class A, class B>
  requires detail::var_with_tensor<A, B>
auto minimum(const A& a, const B& b) {
  return detail::var_with_tensor_result<decltype(pdo::minimum(detail::unwrap_var<is_var_v<A>>(a), detail::unwrap_var<is_var_v<B>>(b)))>();
}
template <class A, class B>
  requires detail::var_with_tensor<A, B>
auto mse(const A& a, const B& b) {
  return detail::var_with_tensor_result<decltype(pdo::mse(detail::unwrap_var<is_var_v<A>>(a), detail::unwrap_var<is_var_v<B>>(b)))>();
}
template <class A, class B>
  requires detail::var_with_tensor<A, B>
auto matmul(const A& a, const B& b) {
  return detail::var_with_tensor_result<decltype(pdo::matmul(detail::unwrap_var<is_var_v<A>>(a), detail::unwrap_var<is_var_v<B>>(b)))>();
}

}  // namespace pdo
