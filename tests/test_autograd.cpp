// Autograd: every op's gradient against central finite differences (double), and the
// gradients of a dtensor program against the same program on one place, over lines of
// 1-4 places with uneven shards.
#include "support.hpp"

#include <pdo/autograd.hpp>

#include <cmath>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using pdo::shape_t;
template <std::size_t R>
using dt = pdo::tensor<double, R>;
template <std::size_t R>
using dvar = pdo::var<dt<R>>;

/// @brief sum(out * w) for fixed random weights w: a scalar whose gradient exercises
/// every element of out's Jacobian.
template <class V>
pdo::var<dt<0>> weigh(const pdo::var<V>& out) {
  if constexpr (pdo::var<V>::rank == 0) {
    return out;
  } else {
    const pdo::var<V> w(pdo_test::random_tensor<double>(out.shape(), 4242));
    return pdo::sum(out * w);
  }
}

/// @brief Checks d(weigh(f(xs...)))/d(xs) against central differences.
template <class F, std::size_t... R>
void check_gradient(F f, dt<R>... xs) {
  auto params = std::make_tuple(pdo::parameter(xs)...);
  const auto loss = weigh(std::apply(f, params));
  pdo::backward(loss);
  auto value_at = [&](const auto&... inputs) { return weigh(f(pdo::var(inputs)...)).value().data()[0]; };
  auto inputs = std::make_tuple(xs...);
  constexpr double eps = 1e-6;
  auto check_input = [&]<std::size_t I>(std::integral_constant<std::size_t, I>) {
    auto& x = std::get<I>(inputs);
    const auto& grad = std::get<I>(params).grad();
    REQUIRE(grad.shape() == x.shape());
    for (std::size_t j = 0; j < x.size(); ++j) {
      const double keep = x.data()[j];
      x.data()[j] = keep + eps;
      const double up = std::apply(value_at, inputs);
      x.data()[j] = keep - eps;
      const double down = std::apply(value_at, inputs);
      x.data()[j] = keep;
      const double numeric = (up - down) / (2 * eps);
      INFO("input " << I << " element " << j);
      CHECK(grad.data()[j] == Approx(numeric).epsilon(1e-5).margin(1e-6));
    }
  };
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (check_input(std::integral_constant<std::size_t, I>{}), ...);
  }(std::index_sequence_for<dt<R>...>{});
}

template <std::size_t R>
dt<R> rnd(const shape_t<R>& s, unsigned seed, double shift = 0) {
  return pdo_test::random_tensor<double>(s, seed, shift);
}

}  // namespace

TEST_CASE("autograd: an empty var says so instead of reading nothing", "[autograd]") {
  pdo::var<pdo::tensor<float, 1>> empty;
  CHECK_THROWS_WITH(empty.value(), Catch::Contains("this var is empty (default-constructed, or moved from)"));
  CHECK_THROWS_WITH(empty.shape(), Catch::Contains("this var is empty"));
  CHECK_THROWS_WITH(empty.grad(), Catch::Contains("this var is empty"));
  CHECK_THROWS_AS(empty.zero_grad(), pdo::error);
  empty = pdo::parameter(pdo::tensor<float, 1>({3}));
  CHECK(empty.shape()[0] == 3);
  auto moved = pdo::parameter(pdo::tensor<float, 1>({2}));
  const auto kept = std::move(moved);
  CHECK_THROWS_WITH(moved.value(), Catch::Contains("this var is empty (default-constructed, or moved from)"));
  CHECK(kept.shape()[0] == 2);
  CHECK_FALSE(empty.has_grad());
}

TEST_CASE("autograd: copies of a var share its node; an op's result holds the nodes of its operands that need gradients", "[autograd]") {
  const auto w = pdo::parameter(rnd<1>({4}, 1));
  const dvar<1> c(rnd<1>({4}, 2));  // a constant: no gradient
  const auto copy = w;
  REQUIRE(w.node() != nullptr);
  CHECK(copy.node() == w.node());
  CHECK(copy.graph_node() == w.graph_node());
  CHECK(w.graph_node().get() == w.node());
  const auto y = w * c;
  REQUIRE(y.node() != nullptr);
  CHECK_FALSE(y.is_leaf());
  REQUIRE(y.node()->inputs.size() == 1);
  CHECK(y.node()->inputs[0] == w.graph_node());
  CHECK(y.node()->value.data() == y.value().data());
  const dvar<1> empty;
  CHECK(empty.node() == nullptr);
  CHECK(empty.graph_node() == nullptr);
}

TEST_CASE("autograd: elementwise ops with broadcasting", "[autograd]") {
  const auto a = rnd<2>({3, 4}, 1), b = rnd<2>({3, 4}, 2), col = rnd<2>({3, 1}, 4);
  const auto bias = rnd<1>({4}, 3);
  const auto pos = rnd<2>({3, 4}, 5, 2.0);  // in [1, 3): log, sqrt, division
  check_gradient([](auto x, auto y) { return x + y; }, a, b);
  check_gradient([](auto x, auto y) { return x - y; }, a, b);
  check_gradient([](auto x, auto y) { return x * y; }, a, b);
  check_gradient([](auto x, auto y) { return x / y; }, a, pos);
  check_gradient([](auto x, auto y) { return x + y; }, a, bias);
  check_gradient([](auto x, auto y) { return x * y; }, a, col);
  check_gradient([](auto x, auto y) { return y - x; }, a, bias);
  check_gradient([](auto x, auto y) { return y / x; }, pos, col);
  check_gradient([](auto x, auto y) { return pdo::maximum(x, y); }, a, b);
  check_gradient([](auto x, auto y) { return pdo::minimum(x, y); }, a, bias);
  const auto cond = pdo::eval(pdo::greater(a, 0.0));
  check_gradient([&](auto x, auto y) { return pdo::where(cond, x, y); }, a, b);
}

TEST_CASE("autograd: numbers on either side, and one-operand ops", "[autograd]") {
  const auto a = rnd<2>({3, 4}, 6), pos = rnd<2>({3, 4}, 7, 2.0);
  check_gradient([](auto x) { return x + 1.5; }, a);
  check_gradient([](auto x) { return 1.5 + x; }, a);
  check_gradient([](auto x) { return x - 1.5; }, a);
  check_gradient([](auto x) { return 1.5 - x; }, a);
  check_gradient([](auto x) { return x * 3.0; }, a);
  check_gradient([](auto x) { return 3.0 * x; }, a);
  check_gradient([](auto x) { return x / 3.0; }, a);
  check_gradient([](auto x) { return 3.0 / x; }, pos);
  check_gradient([](auto x) { return -x; }, a);
  check_gradient([](auto x) { return pdo::exp(x); }, a);
  check_gradient([](auto x) { return pdo::log(x); }, pos);
  check_gradient([](auto x) { return pdo::sqrt(x); }, pos);
  check_gradient([](auto x) { return pdo::tanh(x); }, a);
  check_gradient([](auto x) { return pdo::sigmoid(x); }, a);
  check_gradient([](auto x) { return pdo::relu(x); }, a);  // random values: none within eps of 0
  {  // at a NaN, relu passes the gradient through, as PyTorch's (x <= 0 ? 0 : g)
    auto x = pdo::parameter(dt<1>({3}, {std::numeric_limits<double>::quiet_NaN(), -1.0, 2.0}));
    pdo::backward(pdo::sum(pdo::relu(x)));
    CHECK(x.grad()(0) == 1.0);
    CHECK(x.grad()(1) == 0.0);
    CHECK(x.grad()(2) == 1.0);
  }
  check_gradient([](auto x) { return pdo::gelu(x); }, a);
  check_gradient([](auto x) { return pdo::gelu_tanh(x); }, a);
  // maximum, minimum and where with a number (random values: none within eps of 0.25)
  const auto keep = pdo::eval(pdo::greater(a, 0.0));
  check_gradient([](auto x) { return pdo::maximum(x, 0.25); }, a);
  check_gradient([](auto x) { return pdo::maximum(0.25, x); }, a);
  check_gradient([](auto x) { return pdo::minimum(x, 0.25); }, a);
  check_gradient([](auto x) { return pdo::minimum(0.25, x); }, a);
  check_gradient([&](auto x) { return pdo::where(keep, x, 0.5); }, a);
  check_gradient([&](auto x) { return pdo::where(keep, 0.5, x); }, a);
  {  // a tie gives the var half the gradient, as torch.maximum; a NaN is chosen
    auto x = pdo::parameter(dt<1>({4}, {std::numeric_limits<double>::quiet_NaN(), -1.0, 0.0, 2.0}));
    const auto y = pdo::maximum(x, 0.0);
    pdo::backward(pdo::sum(y * 3.0));
    CHECK(std::isnan(y.value()(0)));
    CHECK((y.value()(1) == 0.0 && y.value()(2) == 0.0 && y.value()(3) == 2.0));
    CHECK((x.grad()(0) == 3.0 && x.grad()(1) == 0.0 && x.grad()(2) == 1.5 && x.grad()(3) == 3.0));
  }
  {  // on a dtensor var, split unevenly: the one-place program's gradients
    const auto b = rnd<2>({7, 3}, 8);
    auto program = [](const auto& x, const auto& mask) {
      return pdo::sum(pdo::maximum(x, 0.1) * 2.0 + pdo::minimum(-0.2, x) + pdo::where(mask, x * x, 1.0));
    };
    const auto mask = pdo::eval(pdo::less(b, 0.3));
    auto x = pdo::parameter(b);
    pdo::backward(program(x, mask));
    for (std::size_t n : pdo_test::line_sizes()) {
      INFO(n << " places");
      const auto m = pdo_test::line_mesh(n);
      using rows = pdo::layout<pdo::split<"x">, pdo::replicate>;
      auto dx = pdo::parameter(pdo::distribute<rows>(m, b));
      pdo::backward(program(dx, pdo::distribute<rows>(m, mask)));
      const auto g = pdo::gather(dx.grad());
      for (std::size_t i = 0; i < g.size(); ++i) CHECK(g.data()[i] == Approx(x.grad().data()[i]).epsilon(1e-12));
    }
  }
}

TEST_CASE("autograd: matmul, 2-D and batched", "[autograd]") {
  check_gradient([](auto x, auto w) { return pdo::matmul(x, w); }, rnd<2>({5, 3}, 8), rnd<2>({3, 4}, 9));
  check_gradient([](auto x, auto w) { return pdo::matmul(x, w); }, rnd<3>({2, 5, 3}, 10), rnd<3>({2, 3, 4}, 11));
  check_gradient([](auto x, auto w) { return pdo::matmul(x, w); }, rnd<3>({2, 5, 3}, 12), rnd<2>({3, 4}, 13));
  check_gradient([](auto x, auto w) { return pdo::matmul(pdo::transpose(x), w); }, rnd<2>({3, 5}, 14), rnd<2>({3, 4}, 15));
}

TEST_CASE("autograd: reductions", "[autograd]") {
  const auto a = rnd<3>({2, 3, 4}, 16);
  check_gradient([](auto x) { return pdo::sum(x); }, a);
  check_gradient([](auto x) { return pdo::sum<1>(x); }, a);
  check_gradient([](auto x) { return pdo::mean(x); }, a);
  check_gradient([](auto x) { return pdo::mean<2>(x); }, a);
  check_gradient([](auto x) { return pdo::max(x); }, a);
  check_gradient([](auto x) { return pdo::max<0>(x); }, a);
  // negative dims count back from the last
  check_gradient([](auto x) { return pdo::sum<-1>(x); }, a);
  check_gradient([](auto x) { return pdo::mean<-2>(x); }, a);
  check_gradient([](auto x) { return pdo::max<-3>(x); }, a);
  check_gradient([](auto x) { return pdo::unsqueeze<-1>(x) * pdo::unsqueeze<-2>(pdo::unsqueeze<-1>(pdo::sum<-1>(x))); }, a);
  // the same gradients as the dims counted from 0
  auto p = pdo::parameter(a), q = pdo::parameter(a);
  pdo::backward(pdo::sum(pdo::max<-2>(p)) * pdo::mean(pdo::mean<-1>(pdo::unsqueeze<-3>(p))));
  pdo::backward(pdo::sum(pdo::max<1>(q)) * pdo::mean(pdo::mean<3>(pdo::unsqueeze<1>(q))));
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(p.grad().data()[i] == q.grad().data()[i]);
}

TEST_CASE("autograd: softmax, log_softmax and the losses", "[autograd]") {
  const auto a = rnd<2>({4, 5}, 17);
  check_gradient([](auto x) { return pdo::softmax(x); }, a);
  check_gradient([](auto x) { return pdo::softmax<0>(x); }, a);
  check_gradient([](auto x) { return pdo::log_softmax(x); }, a);
  check_gradient([](auto x) { return pdo::log_softmax<0>(x); }, a);
  check_gradient([](auto x) { return pdo::softmax<-2>(x); }, a);
  check_gradient([](auto x) { return pdo::log_softmax<-1>(x); }, a);
  const pdo::tensor<int, 1> labels({4}, {2, 0, 4, 1});
  check_gradient([&](auto x) { return pdo::cross_entropy(x, labels); }, a);
  check_gradient([&](auto x) { return pdo::cross_entropy(x, labels) * 3.0; }, a);
  check_gradient([](auto x, auto y) { return pdo::mse(x, y); }, a, rnd<2>({4, 5}, 18));
  check_gradient([](auto x) { return pdo::mse(x, 0.5) + pdo::mse(-0.25, x); }, a);
}

namespace {

/// @brief Layer norm over the last dim of x [rows, n] (x's data as rows of n), computed here
/// in double: y = (x - mean) / sqrt(var + eps) per row, and the gradient of sum(y * g) with
/// respect to x, (g - mean(g) - y mean(g y)) / sqrt(var + eps) per row.
std::pair<std::vector<double>, std::vector<double>> layer_norm_by_hand(const double* x, const double* g, std::size_t rows, std::size_t n,
                                                                       double eps) {
  std::vector<double> y(rows * n), dx(rows * n);
  for (std::size_t r = 0; r < rows; ++r) {
    const double* xr = x + r * n;
    double mean = 0, var = 0;
    for (std::size_t i = 0; i < n; ++i) mean += xr[i] / static_cast<double>(n);
    for (std::size_t i = 0; i < n; ++i) var += (xr[i] - mean) * (xr[i] - mean) / static_cast<double>(n);
    const double inv = 1 / std::sqrt(var + eps);
    double mean_g = 0, mean_gy = 0;
    for (std::size_t i = 0; i < n; ++i) {
      y[r * n + i] = (xr[i] - mean) * inv;
      mean_g += g[r * n + i] / static_cast<double>(n);
      mean_gy += g[r * n + i] * y[r * n + i] / static_cast<double>(n);
    }
    for (std::size_t i = 0; i < n; ++i) dx[r * n + i] = (g[r * n + i] - mean_g - y[r * n + i] * mean_gy) * inv;
  }
  return {y, dx};
}

template <std::size_t R>
bool matches(const dt<R>& got, const std::vector<double>& expected) {
  if (got.size() != expected.size()) return false;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::abs(got.data()[i] - expected[i]) > 1e-10 * (1 + std::abs(expected[i]))) return false;
  return true;
}

}  // namespace

TEST_CASE("layer_norm: the expression and the var, against a hand computation; of dtensors with rows or features split",
          "[autograd][mesh]") {
  // rows of 7 features (shift 3: a mean far from 0, which the centring removes first)
  const auto x = rnd<2>({5, 7}, 60, 3.0), g = rnd<2>({5, 7}, 61);
  const auto hand = layer_norm_by_hand(x.data(), g.data(), 5, 7, 1e-5);
  const auto& y = hand.first;
  const auto& dx = hand.second;
  CHECK(matches(pdo::eval(pdo::layer_norm(x)), y));
  auto X = pdo::parameter(x);
  const auto Y = pdo::layer_norm(X);
  CHECK(matches(Y.value(), y));
  pdo::backward(pdo::sum(Y * pdo::var(g)));
  CHECK(matches(X.grad(), dx));
  check_gradient([](auto v) { return pdo::layer_norm(v, 0.1); }, rnd<2>({3, 4}, 62));
  // the last dim of a rank-3 operand, and an eps of the caller's
  const auto x3 = rnd<3>({2, 3, 4}, 63), g3 = rnd<3>({2, 3, 4}, 64);
  const auto hand3 = layer_norm_by_hand(x3.data(), g3.data(), 6, 4, 0.5);
  const auto& y3 = hand3.first;
  const auto& dx3 = hand3.second;
  CHECK(matches(pdo::eval(pdo::layer_norm(x3 * 1.0, 0.5)), y3));
  auto X3 = pdo::parameter(x3);
  const auto Y3 = pdo::layer_norm(X3, 0.5);
  CHECK(matches(Y3.value(), y3));
  pdo::backward(pdo::sum(Y3 * pdo::var(g3)));
  CHECK(matches(X3.grad(), dx3));

  auto check = [&]<class L>(std::size_t n) {
    const auto m = pdo_test::line_mesh(n);
    const auto dxv = pdo::distribute<L>(m, x);
    const auto ye = pdo::eval(pdo::layer_norm(dxv));
    static_assert(std::is_same_v<typename std::remove_cvref_t<decltype(ye)>::layout_type, L>);
    CHECK(matches(pdo::gather(ye), y));
    auto dX = pdo::parameter(dxv);
    const auto dY = pdo::layer_norm(dX);
    CHECK(matches(pdo::gather(dY.value()), y));
    pdo::backward(pdo::sum(dY * pdo::var(pdo::distribute<L>(m, g))));
    CHECK(matches(pdo::gather(dX.grad()), dx));
  };
  using R = pdo::replicate;
  using split_x = pdo::split<"x">;
  for (std::size_t n : pdo_test::line_sizes()) {
    INFO(n << " places");
    check.operator()<pdo::layout<split_x, R>>(n);  // rows split, 5 over n
    check.operator()<pdo::layout<R, split_x>>(n);  // the normalised features split, 7 over n: each row's mean a sum over places
  }
}

TEST_CASE("autograd: cast between floating-point types converts the gradient back", "[autograd]") {
  const auto a = rnd<2>({3, 4}, 41);
  check_gradient([](auto x) { return pdo::cast<double>(pdo::cast<double>(x) * x); }, a);
  // through float: the value rounds to float, the gradient is d/dw of sum(double(w)²) = 2w, in float
  auto w = pdo::parameter(pdo::eval(pdo::cast<float>(a)));
  pdo::backward(pdo::sum(pdo::cast<double>(w) * pdo::cast<double>(w)));
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(w.grad())>, pdo::tensor<float, 2>>);
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(w.grad().data()[i] == static_cast<float>(2.0 * static_cast<double>(w.value().data()[i])));
}

TEST_CASE("autograd: transpose, reshape, and a value used twice", "[autograd]") {
  const auto a = rnd<3>({2, 3, 4}, 19);
  check_gradient([](auto x) { return pdo::transpose(x); }, a);
  check_gradient([](auto x) { return pdo::reshape(x, {6, 4}); }, a);
  check_gradient([](auto x) { return pdo::reshape(x, {24}); }, a);
  check_gradient([](auto x) { return pdo::unsqueeze<0>(x) * 2.0; }, a);
  check_gradient([](auto x) { return pdo::unsqueeze<3>(x); }, a);
  check_gradient([](auto x) { return x - pdo::unsqueeze<1>(pdo::max<1>(x)); }, a);
  check_gradient([](auto x) { return pdo::tanh(x) * x + pdo::exp(x * x); }, a);
  check_gradient([](auto x, auto w) { return pdo::matmul(pdo::relu(pdo::matmul(x, w)), w); }, rnd<2>({3, 4}, 20), rnd<2>({4, 4}, 21));
}

TEST_CASE("autograd: leaf hooks fire when the leaf's gradient is complete, before backward ends", "[autograd]") {
  auto x = pdo::var(rnd<2>({4, 3}, 22));
  auto w1 = pdo::parameter(rnd<2>({3, 3}, 23));
  auto w2 = pdo::parameter(rnd<2>({3, 2}, 24));
  std::vector<std::string> events;
  w1.on_gradient([&] { events.push_back("w1"); });
  w2.on_gradient([&] { events.push_back("w2"); });
  const auto loss = pdo::sum(pdo::matmul(pdo::tanh(pdo::matmul(x, w1)), w2));
  pdo::backward(loss);
  // w2 is used last, so its gradient is complete first
  REQUIRE(events == std::vector<std::string>{"w2", "w1"});
  CHECK_THROWS_AS(x.grad(), pdo::error);
  CHECK_THROWS_WITH(pdo::backward(pdo::sum(x)), Catch::Contains("does not depend on anything"));
}

TEST_CASE("autograd: a graph takes one backward; a second through any part of it is an error that adds nothing", "[autograd]") {
  auto w = pdo::parameter(rnd<2>({3, 2}, 25));
  const auto x = pdo::var(rnd<2>({4, 3}, 26));
  const auto trunk = pdo::tanh(pdo::matmul(x, w));
  const auto l1 = pdo::sum(trunk);
  const auto l2 = pdo::sum(trunk * trunk);
  pdo::backward(l1);
  const auto once = w.grad();
  CHECK_THROWS_WITH(pdo::backward(l2), Catch::Contains("backward: part of the graph of this value was used by an earlier backward"));
  CHECK_THROWS_WITH(pdo::backward(l1), Catch::Contains("used by an earlier backward"));
  CHECK(pdo_test::equal(w.grad(), once));
  // the forward again takes another gradient; so does the sum of two losses of one forward
  const auto again = pdo::tanh(pdo::matmul(x, w));
  pdo::backward(pdo::sum(again) + pdo::sum(again * again));
  CHECK_FALSE(pdo_test::equal(w.grad(), once));
}

TEST_CASE("autograd: gradient layouts are derived by the forward rules", "[autograd][mesh]") {
  using rows = pdo::layout<pdo::split<"x">, pdo::replicate>;
  using whole = pdo::layout<pdo::replicate, pdo::replicate>;
  using X = pdo::dtensor<double, 2, pdo::mesh<"x">, rows>;
  using W = pdo::dtensor<double, 2, pdo::mesh<"x">, whole>;
  // a replicated weight used on row-split data: its gradient matmul(xᵀ, g) is a pending sum over "x"
  using grad_w = pdo::result_layout_t<decltype(pdo::matmul(pdo::transpose(std::declval<const X&>()), std::declval<const X&>()))>;
  static_assert(std::is_same_v<grad_w, whole::partial<"x">>);
  // ... which becomes the weight's layout by exactly one all_reduce
  static_assert(pdo::redistribute_plan_of<grad_w, whole>().size == 1);
  static_assert(pdo::redistribute_plan_of<grad_w, whole>().steps[0].kind == pdo::step_kind::all_reduce);
  // the input's gradient matmul(g, wᵀ) keeps the rows split: no communication
  using grad_x = pdo::result_layout_t<decltype(pdo::matmul(std::declval<const X&>(), pdo::transpose(std::declval<const W&>())))>;
  static_assert(std::is_same_v<grad_x, rows>);
}

TEST_CASE("autograd: a dtensor program's gradients equal the one-place program's", "[autograd][mesh]") {
  using rows = pdo::layout<pdo::split<"x">, pdo::replicate>;
  using labels_rows = pdo::layout<pdo::split<"x">>;
  using whole = pdo::layout<pdo::replicate, pdo::replicate>;
  using vec = pdo::layout<pdo::replicate>;
  const auto x = rnd<2>({10, 6}, 30), w1 = rnd<2>({6, 5}, 31), w2 = rnd<2>({5, 4}, 32);
  const auto b1 = rnd<1>({5}, 33);
  pdo::tensor<int, 1> y({10});
  for (std::size_t i = 0; i < 10; ++i) y(i) = static_cast<int>((i * 7) % 4);

  auto program = [](const auto& X, const auto& W1, const auto& B1, const auto& W2, const auto& Y) {
    const auto h = pdo::tanh(pdo::matmul(X, W1) + B1);
    const auto logits = pdo::matmul(pdo::gelu(h) * 0.5 + pdo::sigmoid(h), W2);
    const auto extra = pdo::mean(pdo::softmax(logits) * pdo::exp(logits * 0.1)) + pdo::sum(pdo::log_softmax<-1>(logits)) * 0.01 +
                       pdo::mean(pdo::sum<-2>(logits) * pdo::max<-1>(pdo::unsqueeze<-1>(pdo::max<-2>(logits)))) * 0.05;
    return pdo::cross_entropy(logits, Y) + extra + pdo::max(pdo::relu(logits)) * 0.1 - pdo::mean(pdo::transpose(logits)) * 0.2;
  };
  auto W1 = pdo::parameter(w1), W2 = pdo::parameter(w2);
  auto B1 = pdo::parameter(b1);
  const auto loss = program(pdo::var(x), W1, B1, W2, y);
  pdo::backward(loss);

  for (std::size_t n : pdo_test::line_sizes()) {
    INFO(n << " places");
    const auto m = pdo_test::line_mesh(n);
    auto dW1 = pdo::parameter(pdo::distribute<whole>(m, w1)), dW2 = pdo::parameter(pdo::distribute<whole>(m, w2));
    auto dB1 = pdo::parameter(pdo::distribute<vec>(m, b1));
    auto dX = pdo::parameter(pdo::distribute<rows>(m, x));
    const auto dloss = program(dX, dW1, dB1, dW2, pdo::distribute<labels_rows>(m, y));
    pdo::backward(dloss);
    CHECK(pdo::gather(dloss.value()).data()[0] == Approx(loss.value().data()[0]).epsilon(1e-12));
    auto same = [](const auto& distributed, const auto& local) {
      const auto g = pdo::gather(distributed);
      REQUIRE(g.shape() == local.shape());
      for (std::size_t i = 0; i < g.size(); ++i) CHECK(g.data()[i] == Approx(local.data()[i]).epsilon(1e-10).margin(1e-13));
    };
    same(dW1.grad(), W1.grad());
    same(dW2.grad(), W2.grad());
    same(dB1.grad(), B1.grad());
    // the input's gradient stays split by rows, as the input
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(dX.grad())>::layout_type, rows>);
  }
}

TEST_CASE("autograd: broadcasting over an extent-1 dim of a dtensor, whichever dim is split", "[autograd][mesh]") {
  // centring as layer norm does (X - mean over the features, kept as [N, 1]), and a per-row
  // scale broadcast from [N, 1]: with the rows split and with the features split (the
  // gradient of the [N, 1] operand is then a sum over places, brought to its layout)
  const auto x = rnd<2>({5, 7}, 40), s = rnd<2>({5, 1}, 41);
  auto program = [](const auto& X, const auto& S) {
    const auto centred = X - pdo::reshape(pdo::mean<1>(X), {5, 1});
    // the same centring by unsqueeze, which keeps the rows' split where reshape cannot
    const auto shifted = X - pdo::unsqueeze<1>(pdo::max<1>(X));
    return pdo::sum(centred * centred * S) + pdo::sum(pdo::exp(S * 0.5 + X * 0.1)) + pdo::sum(pdo::tanh(shifted));
  };
  auto X = pdo::parameter(x), S = pdo::parameter(s);
  const auto loss = program(X, S);
  pdo::backward(loss);
  auto check = [&]<class LX, class LS>(std::size_t n) {
    const auto m = pdo_test::line_mesh(n);
    auto dX = pdo::parameter(pdo::distribute<LX>(m, x));
    auto dS = pdo::parameter(pdo::distribute<LS>(m, s));
    const auto dloss = program(dX, dS);
    pdo::backward(dloss);
    CHECK(pdo::gather(dloss.value()).data()[0] == Approx(loss.value().data()[0]).epsilon(1e-12));
    CHECK(pdo_test::close(pdo::gather(dX.grad()), X.grad(), 1e-11));
    CHECK(pdo_test::close(pdo::gather(dS.grad()), S.grad(), 1e-11));
  };
  using R = pdo::replicate;
  using split_x = pdo::split<"x">;
  for (std::size_t n : pdo_test::line_sizes()) {
    INFO(n << " places");
    check.operator()<pdo::layout<R, split_x>, pdo::layout<R, R>>(n);        // features split (7 over n: uneven)
    check.operator()<pdo::layout<split_x, R>, pdo::layout<split_x, R>>(n);  // rows split, 5 over n
    check.operator()<pdo::layout<split_x, R>, pdo::layout<R, R>>(n);
  }
}

TEST_CASE("autograd: a batched matmul by one matrix, with the batch, rows, contraction or columns split", "[autograd][mesh]") {
  // [batch, rows, features] by one [features, out] matrix, as a layer over a sequence: the
  // weight's gradient sums the products of every batch, whichever dim is split (5 batches,
  // 4 rows, 6 features and 3 columns over n places: uneven)
  const auto x = rnd<3>({5, 4, 6}, 50);
  const auto w = rnd<2>({6, 3}, 51);
  auto program = [](const auto& X, const auto& W) { return pdo::sum(pdo::tanh(pdo::matmul(X, W)) * 0.5) + pdo::mean(pdo::matmul(X, W)); };
  auto X = pdo::parameter(x);
  auto W = pdo::parameter(w);
  const auto loss = program(X, W);
  pdo::backward(loss);
  auto check = [&]<class LX, class LW>(std::size_t n) {
    const auto m = pdo_test::line_mesh(n);
    auto dX = pdo::parameter(pdo::distribute<LX>(m, x));
    auto dW = pdo::parameter(pdo::distribute<LW>(m, w));
    const auto dloss = program(dX, dW);
    pdo::backward(dloss);
    CHECK(pdo::gather(dloss.value()).data()[0] == Approx(loss.value().data()[0]).epsilon(1e-12));
    CHECK(pdo_test::close(pdo::gather(dX.grad()), X.grad(), 1e-11));
    CHECK(pdo_test::close(pdo::gather(dW.grad()), W.grad(), 1e-11));
  };
  using R = pdo::replicate;
  using S = pdo::split<"x">;
  for (std::size_t n : pdo_test::line_sizes()) {
    INFO(n << " places");
    check.operator()<pdo::layout<S, R, R>, pdo::layout<R, R>>(n);  // the batch (data parallel)
    check.operator()<pdo::layout<R, S, R>, pdo::layout<R, R>>(n);  // the rows
    check.operator()<pdo::layout<R, R, S>, pdo::layout<S, R>>(n);  // the contraction (row parallel)
    check.operator()<pdo::layout<R, R, R>, pdo::layout<R, S>>(n);  // the columns (column parallel)
    check.operator()<pdo::layout<R, R, R>, pdo::layout<R, R>>(n);  // nothing: one product of the folded rows
  }
}

TEST_CASE("autograd: an operand broadcast along its extent-1 dim 0 while its dim 1 is split", "[autograd][mesh]") {
  // a [1, 7] scale on [5, 7] rows, the 7 features split (uneven): its gradient sums over the
  // rows and puts the extent-1 dim back in front of the split one
  const auto x = rnd<2>({5, 7}, 52), s = rnd<2>({1, 7}, 53);
  auto program = [](const auto& X, const auto& S) { return pdo::sum(pdo::tanh(X * S) + S); };
  auto X = pdo::parameter(x), S = pdo::parameter(s);
  const auto loss = program(X, S);
  pdo::backward(loss);
  for (std::size_t n : pdo_test::line_sizes()) {
    INFO(n << " places");
    const auto m = pdo_test::line_mesh(n);
    using features = pdo::layout<pdo::replicate, pdo::split<"x">>;
    auto dX = pdo::parameter(pdo::distribute<features>(m, x));
    auto dS = pdo::parameter(pdo::distribute<features>(m, s));
    const auto dloss = program(dX, dS);
    pdo::backward(dloss);
    CHECK(pdo::gather(dloss.value()).data()[0] == Approx(loss.value().data()[0]).epsilon(1e-12));
    CHECK(pdo_test::close(pdo::gather(dX.grad()), X.grad(), 1e-11));
    CHECK(pdo_test::close(pdo::gather(dS.grad()), S.grad(), 1e-11));
  }
}

TEST_CASE("autograd inside parallel_do blocks: per-place backward, gradients merged as a partial sum", "[autograd][mesh]") {
  using rows = pdo::layout<pdo::split<"x">, pdo::replicate>;
  using labels_rows = pdo::layout<pdo::split<"x">>;
  using whole = pdo::layout<pdo::replicate, pdo::replicate>;
  const auto x = rnd<2>({10, 6}, 70), w = rnd<2>({6, 4}, 71);
  pdo::tensor<int, 1> y({10});
  for (std::size_t i = 0; i < 10; ++i) y(i) = static_cast<int>((i * 3) % 4);
  auto W = pdo::parameter(w);
  pdo::backward(pdo::cross_entropy(pdo::tanh(pdo::matmul(pdo::var(x), W)), y));
  for (std::size_t n : pdo_test::line_sizes()) {
    INFO(n << " places");
    const auto m = pdo_test::line_mesh(n);
    const auto dx = pdo::distribute<rows>(m, x);
    const auto dy = pdo::distribute<labels_rows>(m, y);
    const auto dw = pdo::distribute<whole>(m, w);
    // each place: backward over its rows, its loss weighted by its share of the batch
    const auto grads = pdo::parallel_do<whole::partial<"x">>(
        [](const auto& xs, const auto& ys, const auto& ws) {
          auto Wp = pdo::parameter(ws);
          if (xs.extent(0) == 0) return pdo::tensor<double, 2>(ws.shape());
          const auto loss = pdo::cross_entropy(pdo::tanh(pdo::matmul(pdo::var(xs), Wp)), ys) * (static_cast<double>(xs.extent(0)) / 10.0);
          pdo::backward(loss);
          return Wp.grad();
        },
        dx, dy, dw);
    const auto g = pdo::gather(pdo::redistribute<whole>(grads));
    for (std::size_t i = 0; i < g.size(); ++i) CHECK(g.data()[i] == Approx(W.grad().data()[i]).epsilon(1e-12));
  }
}
