// Numerics of every op and its gradient against a reference computed in long double on one
// place, over random inputs that include NaN, infinities, ties, signed zeros and large
// magnitudes, on local tensors and on dtensors split by rows or columns over 1-4 places and
// a 2 x 2 mesh. Also: log-sum-exp precision next to a large maximum, NaN through every
// comparison-based op and collective, the gradient of max with ties, exact and tanh GELU,
// and extents whose product overflows.
#include "support.hpp"

#include <pdo/autograd.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using ld = long double;
using pdo::shape_t;
constexpr std::size_t rows = 6, cols = 5;  // uneven over 4 places: 2, 2, 1, 1 rows

/// @brief A host tensor of mostly ordinary values with, where `specials`, a few of each kind
/// that stresses numerics: a repeated value (ties), ±0, a large magnitude, ±inf and NaN.
template <class T, std::size_t R>
pdo::tensor<T, R> stress_tensor(const shape_t<R>& shape, unsigned seed, bool specials) {
  pdo::tensor<T, R> t(shape);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> ordinary(-2, 2);
  const T large = std::is_same_v<T, float> ? T(1e30) : T(1e300);
  const T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
  const T kinds[] = {T(1.5), T(1.5), T(0), T(-0.0), large, -large, inf, -inf, nan};
  for (auto& x : t) x = static_cast<T>(ordinary(gen));
  if (specials)
    for (std::size_t i = 0; i < t.size(); ++i)
      if (std::uniform_int_distribution<int>(0, 2)(gen) == 0) t.data()[i] = kinds[std::uniform_int_distribution<int>(0, 8)(gen)];
  return t;
}

/// @brief A reference value computed in long double, as the op's element type holds it.
template <class T>
struct reference {
  std::vector<ld> value;  ///< rounded to T when compared (so T's overflow is T's)
  std::vector<ld> scale;  ///< what the rounding errors of T are relative to, per element
};

/// @brief got == want, or both NaN, or equal infinities, or within `tol` of want's scale.
template <class T>
bool agrees(T got, ld want_ld, ld scale, double tol) {
  const T want = static_cast<T>(want_ld);
  if (std::isnan(want) || std::isnan(got)) return std::isnan(want) && std::isnan(got);
  if (std::isinf(want) || std::isinf(got)) return got == want;
  return std::abs(static_cast<ld>(got) - static_cast<ld>(want)) <= tol * (scale + std::abs(static_cast<ld>(want)) + ld(1e-300L));
}

template <class T, std::size_t R>
void check_against(const pdo::tensor<T, R>& got, const reference<T>& want, double tol, const std::string& what) {
  REQUIRE(got.size() == want.value.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (agrees(got.data()[i], want.value[i], want.scale[i], tol)) continue;
    FAIL_CHECK(what << ": element " << i << " is " << got.data()[i] << ", the reference " << static_cast<T>(want.value[i]));
    return;
  }
}

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-13;
}

// ---- the ops: pdo's program on vars, the reference value and gradient in long double ----
// Each reference takes the inputs (x, y: [rows, cols]) and the loss weights w (of the output's
// shape); the loss is sum(op(x, y) * w), so the reference gradient is the op's Jacobian
// applied to w, written with the same formulas as pdo's backward rules.

struct ref_out {
  std::vector<ld> value, scale, dx, dy, dx_scale, dy_scale;
};

template <class F>
ref_out elementwise(const std::vector<ld>& x, const std::vector<ld>& y, const std::vector<ld>& w, F f) {
  ref_out r;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const auto [v, dx, dy] = f(x[i], y[i], w[i]);
    r.value.push_back(v);
    r.scale.push_back(std::abs(v));
    r.dx.push_back(dx);
    r.dy.push_back(dy);
    r.dx_scale.push_back(std::abs(dx));
    r.dy_scale.push_back(std::abs(dy));
  }
  return r;
}

struct triple {
  ld v, dx, dy;
};

ld gelu_exact(ld x) { return 0.5L * x * (1 + std::erf(x / std::sqrt(ld(2)))); }
ld gelu_exact_d(ld x) { return 0.5L * (1 + std::erf(x / std::sqrt(ld(2)))) + x * std::exp(-x * x / 2) / std::sqrt(2 * 3.14159265358979323846L); }
ld gelu_tanh(ld x) {
  const ld c = std::sqrt(2 / 3.14159265358979323846L);
  return 0.5L * x * (1 + std::tanh(c * (x + 0.044715L * x * x * x)));
}
ld gelu_tanh_d(ld x) {
  const ld c = std::sqrt(2 / 3.14159265358979323846L), t = std::tanh(c * (x + 0.044715L * x * x * x)), sech2 = 1 - t * t;
  return 0.5L * (1 + t) + (sech2 == 0 ? 0 : 0.5L * x * sech2 * c * (1 + 3 * 0.044715L * x * x));
}
ld share_max(ld a, ld b) {
  if (a == b || (std::isnan(a) && std::isnan(b))) return 0.5L;
  return (a > b || std::isnan(a)) ? 1 : 0;
}
ld share_min(ld a, ld b) {
  if (a == b || (std::isnan(a) && std::isnan(b))) return 0.5L;
  return (a < b || std::isnan(a)) ? 1 : 0;
}
ld nan_max(ld a, ld b) { return (std::isnan(a) || a > b) ? a : b; }
ld nan_min(ld a, ld b) { return (std::isnan(a) || a < b) ? a : b; }

/// @brief sum, mean or max over dim `dim` (0, 1) or every dim (2) of x [rows, cols].
ref_out reduction(const std::vector<ld>& x, const std::vector<ld>& w, int what, int dim) {
  const std::size_t n_out = dim == 0 ? cols : dim == 1 ? rows : 1;
  auto members = [&](std::size_t o) {
    std::vector<std::size_t> m;
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < cols; ++j)
        if ((dim == 0 && j == o) || (dim == 1 && i == o) || dim == 2) m.push_back(i * cols + j);
    return m;
  };
  ref_out r;
  r.dx.assign(x.size(), 0);
  r.dx_scale.assign(x.size(), 0);
  for (std::size_t o = 0; o < n_out; ++o) {
    const auto m = members(o);
    ld acc = what == 2 ? -std::numeric_limits<ld>::infinity() : 0, magnitude = 0;
    for (auto i : m) {
      acc = what == 2 ? nan_max(acc, x[i]) : acc + x[i];
      magnitude += std::abs(x[i]);
    }
    if (what == 1) {
      acc /= static_cast<ld>(m.size());
      magnitude /= static_cast<ld>(m.size());
    }
    r.value.push_back(acc);
    r.scale.push_back(what == 2 ? std::abs(acc) : magnitude);
    if (what == 2) {
      ld reached = 0;
      for (auto i : m) reached += (x[i] == acc || (std::isnan(x[i]) && std::isnan(acc))) ? 1 : 0;
      const ld share = w[o] / reached;
      for (auto i : m) r.dx[i] = (x[i] == acc || (std::isnan(x[i]) && std::isnan(acc))) ? share : 0;
    } else {
      for (auto i : m) r.dx[i] = w[o] * (what == 1 ? 1 / static_cast<ld>(m.size()) : 1);
    }
    for (auto i : m) r.dx_scale[i] = std::abs(r.dx[i]);
  }
  return r;
}

/// @brief softmax or log_softmax along dim 1 (rows), as pdo computes them: the row's first
/// maximum m, rest = (m - m) + the sum of exp(x - m) over the other elements (m - m: NaN for
/// an infinite max, whose row is NaN throughout, as PyTorch gives), log-sum = log1p(rest).
ref_out softmaxes(const std::vector<ld>& x, const std::vector<ld>& w, bool log) {
  ref_out r;
  r.value.resize(x.size());
  r.dx.resize(x.size());
  for (std::size_t i = 0; i < rows; ++i) {
    const ld* row = &x[i * cols];
    std::size_t at = 0;
    for (std::size_t j = 1; j < cols; ++j)
      if (row[j] > row[at] || (std::isnan(row[j]) && !std::isnan(row[at]))) at = j;
    const ld top = row[at];
    ld rest = top - top;
    for (std::size_t j = 0; j < cols; ++j)
      if (j != at) rest += std::exp(row[j] - top);
    ld gy = 0, g = 0;
    for (std::size_t j = 0; j < cols; ++j) {
      const ld v = log ? (row[j] - top) - std::log1p(rest) : std::exp(row[j] - top) / (1 + rest);
      r.value[i * cols + j] = v;
      gy += w[i * cols + j] * v;
      g += w[i * cols + j];
    }
    for (std::size_t j = 0; j < cols; ++j) {
      const ld v = r.value[i * cols + j];
      r.dx[i * cols + j] = log ? w[i * cols + j] - std::exp(v) * g : v * (w[i * cols + j] - gy);
    }
  }
  for (std::size_t k = 0; k < x.size(); ++k) {
    r.scale.push_back(std::abs(r.value[k]) + 1);
    r.dx_scale.push_back(std::abs(r.dx[k]) + 1);
  }
  return r;
}

template <class T>
std::vector<ld> widen(const pdo::tensor<T, 2>& t) {
  return {t.begin(), t.end()};
}

/// @brief Runs `program(xv, yv)` (vars over local tensors or dtensors), weighs its output by
/// w, differentiates, and compares the value and both gradients with `want`.
template <class T, class Program, class Make>
void run_case(const std::string& what, Program program, Make make, const pdo::tensor<T, 2>& x, const pdo::tensor<T, 2>& y,
              const ref_out& want, const std::vector<T>& w_values, auto gather) {
  auto xv = pdo::parameter(make(x));
  auto yv = pdo::parameter(make(y));
  const auto out = program(xv, yv);
  using out_value = std::remove_cvref_t<decltype(out.value())>;
  constexpr std::size_t r = pdo::var<out_value>::rank;
  shape_t<r> out_shape = out.shape();
  pdo::tensor<T, r> w_host(out_shape);
  std::copy(w_values.begin(), w_values.begin() + static_cast<std::ptrdiff_t>(w_host.size()), w_host.data());
  const auto weights = pdo::var([&] {
    if constexpr (pdo::distributed_tensor<out_value>)
      return pdo::distribute<typename out_value::layout_type::base>(out.value().mesh(), w_host);
    else
      return w_host;
  }());
  pdo::backward(pdo::sum(out * weights));
  const double tol = tolerance<T>();
  check_against(gather(out.value()), reference<T>{want.value, want.scale}, tol, what + " value");
  if (!want.dx.empty()) check_against(gather(xv.grad()), reference<T>{want.dx, want.dx_scale}, tol, what + " d/dx");
  if (!want.dy.empty() && yv.has_grad()) check_against(gather(yv.grad()), reference<T>{want.dy, want.dy_scale}, tol, what + " d/dy");
}

/// @brief What a run of check_all_ops covers (each family and place costs compile time: the
/// runs below cover each path once).
struct coverage {
  bool local;        ///< on local tensors
  bool meshes;       ///< on dtensors over meshes of 1-4 places and 2 x 2
  bool elementwise;  ///< the elementwise ops
};

/// @brief Every op (elementwise ones as `Cover` says) on local tensors and on dtensors laid out
/// as `Layout` over meshes of 1-4 places and 2 x 2, as `Cover` says, against the reference.
template <class T, class Layout, coverage Cover>
void check_all_ops(bool specials, unsigned seed) {
  const auto x = stress_tensor<T, 2>({rows, cols}, seed, specials);
  const auto y = stress_tensor<T, 2>({rows, cols}, seed + 1, specials);
  const auto lx = widen(x), ly = widen(y);
  std::vector<T> w_values;
  for (std::size_t i = 0; i < rows * cols; ++i) w_values.push_back(static_cast<T>(0.25 + 0.5 * static_cast<double>((i * 7) % 11) / 11));
  const std::vector<ld> w(w_values.begin(), w_values.end());

  auto on_all_meshes = [&](const std::string& name, auto program, const ref_out& want) {
    INFO(name << (specials ? " (with NaN, inf, ties, large values)" : ""));
    if constexpr (Cover.local)
      run_case<T>(name + " on local tensors", program, [](const auto& t) { return t; }, x, y, want, w_values,
                  [](const auto& t) { return t; });
    if constexpr (Cover.meshes) {
      auto on = [&](const auto& mesh) {
        run_case<T>(name + " on " + mesh.describe(), program, [&](const auto& t) { return pdo::distribute<Layout>(mesh, t); }, x, y,
                    want, w_values, [](const auto& t) { return pdo::gather(t); });
      };
      for (std::size_t n : pdo_test::line_sizes()) on(pdo::make_mesh<"x", "y">(pdo::cpu_places(n), {n, 1}));
      on(pdo::make_mesh<"x", "y">(pdo::cpu_places(4), {2, 2}));
    }
  };
  auto unary = [&](const std::string& name, auto program, auto f, auto df) {
    if constexpr (Cover.elementwise)
      on_all_meshes(name, program, elementwise(lx, ly, w, [&](ld a, ld, ld g) { return triple{f(a), g * df(a), 0}; }));
  };
  auto binary = [&](const std::string& name, auto program, auto f) {
    if constexpr (Cover.elementwise)
      on_all_meshes(name, program, elementwise(lx, ly, w, [&](ld a, ld b, ld g) { return f(a, b, g); }));
  };

  unary("negate", [](auto a, auto) { return -a; }, [](ld a) { return -a; }, [](ld) { return ld(-1); });
  unary("exp", [](auto a, auto) { return pdo::exp(a); }, [](ld a) { return std::exp(a); }, [](ld a) { return std::exp(a); });
  unary("log", [](auto a, auto) { return pdo::log(a); }, [](ld a) { return std::log(a); }, [](ld a) { return 1 / a; });
  unary("sqrt", [](auto a, auto) { return pdo::sqrt(a); }, [](ld a) { return std::sqrt(a); }, [](ld a) { return 1 / (std::sqrt(a) * 2); });
  unary("tanh", [](auto a, auto) { return pdo::tanh(a); }, [](ld a) { return std::tanh(a); },
        [](ld a) { return 1 - std::tanh(a) * std::tanh(a); });
  unary("sigmoid", [](auto a, auto) { return pdo::sigmoid(a); }, [](ld a) { return 1 / (1 + std::exp(-a)); },
        [](ld a) { return (1 / (1 + std::exp(-a))) * (1 - 1 / (1 + std::exp(-a))); });
  unary("relu", [](auto a, auto) { return pdo::relu(a); }, [](ld a) { return (a > 0 || std::isnan(a)) ? a : ld(0); },
        [](ld a) { return a <= 0 ? ld(0) : ld(1); });  // PyTorch's rule: the gradient passes at NaN
  unary("gelu", [](auto a, auto) { return pdo::gelu(a); }, gelu_exact, gelu_exact_d);
  unary("gelu_tanh", [](auto a, auto) { return pdo::gelu_tanh(a); }, gelu_tanh, gelu_tanh_d);
  binary("add", [](auto a, auto b) { return a + b; }, [](ld a, ld b, ld g) { return triple{a + b, g, g}; });
  binary("subtract", [](auto a, auto b) { return a - b; }, [](ld a, ld b, ld g) { return triple{a - b, g, -g}; });
  binary("multiply", [](auto a, auto b) { return a * b; }, [](ld a, ld b, ld g) { return triple{a * b, g * b, g * a}; });
  binary("divide", [](auto a, auto b) { return a / b; }, [](ld a, ld b, ld g) { return triple{a / b, g / b, -(g * (a / b)) / b}; });
  binary("maximum", [](auto a, auto b) { return pdo::maximum(a, b); },
         [](ld a, ld b, ld g) { return triple{nan_max(a, b), g * share_max(a, b), g * (1 - share_max(a, b))}; });
  binary("minimum", [](auto a, auto b) { return pdo::minimum(a, b); },
         [](ld a, ld b, ld g) { return triple{nan_min(a, b), g * share_min(a, b), g * (1 - share_min(a, b))}; });
  on_all_meshes("sum", [](auto a, auto) { return pdo::sum(a); }, reduction(lx, w, 0, 2));
  on_all_meshes("sum<0>", [](auto a, auto) { return pdo::sum<0>(a); }, reduction(lx, w, 0, 0));
  on_all_meshes("mean<1>", [](auto a, auto) { return pdo::mean<1>(a); }, reduction(lx, w, 1, 1));
  on_all_meshes("mean", [](auto a, auto) { return pdo::mean(a); }, reduction(lx, w, 1, 2));
  on_all_meshes("max", [](auto a, auto) { return pdo::max(a); }, reduction(lx, w, 2, 2));
  on_all_meshes("max<0>", [](auto a, auto) { return pdo::max<0>(a); }, reduction(lx, w, 2, 0));
  on_all_meshes("max<1>", [](auto a, auto) { return pdo::max<1>(a); }, reduction(lx, w, 2, 1));
  on_all_meshes("softmax", [](auto a, auto) { return pdo::softmax(a); }, softmaxes(lx, w, false));
  on_all_meshes("log_softmax", [](auto a, auto) { return pdo::log_softmax(a); }, softmaxes(lx, w, true));
}

}  // namespace

TEST_CASE("numerics: every op and its gradient against long double, NaN, inf, ties and large values included", "[numerics]") {
  using split = pdo::split<"x">;
  using by_rows = pdo::layout<split, pdo::replicate>;
  using by_cols = pdo::layout<pdo::replicate, split>;
  // float on local tensors; double on dtensors split by rows (every op) and by columns (the
  // ops whose dim the split crosses: reductions, softmax)
  constexpr coverage local_all{true, false, true}, meshes_all{false, true, true}, meshes_reductions{false, true, false};
  for (unsigned seed : {1u, 2u, 3u}) {
    check_all_ops<float, by_rows, local_all>(false, seed);
    check_all_ops<float, by_rows, local_all>(true, seed * 100);
    check_all_ops<double, by_rows, meshes_all>(false, seed);
    check_all_ops<double, by_rows, meshes_all>(true, seed * 100);
    check_all_ops<double, by_cols, meshes_reductions>(true, seed * 10);
  }
}

// ---- the defects these checks were written for, one by one ----

TEST_CASE("numerics: log_softmax and cross_entropy keep their precision next to a large maximum", "[numerics]") {
  // exact: log_softmax([50, 35, 30])[0] = -log1p(e^-15 + e^-20); cross_entropy([[1000, 990, 980]], [0]) = log1p(e^-10 + e^-20)
  const ld lsm = -std::log1p(std::exp(ld(-15)) + std::exp(ld(-20))), ce = std::log1p(std::exp(ld(-10)) + std::exp(ld(-20)));
  const pdo::tensor<float, 1> xf({3}, {50, 35, 30});
  const pdo::tensor<double, 1> xd({3}, {50, 35, 30});
  CHECK(std::abs(pdo::eval(pdo::log_softmax(xf))(0) - lsm) <= 1e-6 * std::abs(lsm));
  CHECK(std::abs(pdo::eval(pdo::log_softmax(xd))(0) - lsm) <= 1e-15 * std::abs(lsm));
  const pdo::tensor<int, 1> label({1}, {0});
  CHECK(std::abs(pdo::eval(pdo::cross_entropy(pdo::tensor<float, 2>({1, 3}, {1000, 990, 980}), label))() - ce) <= 1e-6 * ce);
  CHECK(std::abs(pdo::eval(pdo::cross_entropy(pdo::tensor<double, 2>({1, 3}, {1000, 990, 980}), label))() - ce) <= 1e-15 * ce);
  // the same over a mesh: rows split, classes split (gathered for the log-sum-exp)
  const pdo::tensor<double, 2> logits({4, 3}, {1000, 990, 980, 1000, 990, 980, 1000, 990, 980, 1000, 990, 980});
  const pdo::tensor<int, 1> labels({4}, {0, 0, 0, 0});
  for (std::size_t n : pdo_test::line_sizes()) {
    const auto mesh = pdo::make_mesh<"x">(pdo::cpu_places(n));
    const auto l = pdo::distribute<pdo::layout<pdo::replicate, pdo::split<"x">>>(mesh, logits);
    const auto y = pdo::distribute<pdo::layout<pdo::replicate>>(mesh, labels);
    CHECK(std::abs(pdo::gather(pdo::eval(pdo::cross_entropy(l, y)))() - ce) <= 1e-15 * ce);
  }
  // and the gradient: softmax - one_hot, divided by the rows
  auto v = pdo::parameter(pdo::tensor<double, 2>({1, 3}, {1000, 990, 980}));
  pdo::backward(pdo::cross_entropy(v, label));
  const ld p1 = std::exp(ld(-10)) / (1 + std::exp(ld(-10)) + std::exp(ld(-20)));
  CHECK(std::abs(v.grad()(0, 1) - p1) <= 1e-15 * p1);
}

TEST_CASE("numerics: a row whose max is infinite is NaN throughout, as PyTorch gives", "[numerics]") {
  // torch.softmax([inf, 1]) = [nan, nan]; torch.softmax([1, inf, 2]) = [nan, nan, nan];
  // torch.softmax([-inf, 0]) = [0, 1] and torch.log_softmax([-inf, 0]) = [-inf, 0]
  const double inf = std::numeric_limits<double>::infinity();
  const pdo::tensor<double, 2> x({3, 3}, {inf, 1, -inf, 1, inf, 2, -inf, 0, -inf});
  auto check_rows = [&](const pdo::tensor<double, 2>& sm, const pdo::tensor<double, 2>& lsm) {
    for (std::size_t i = 0; i < 2; ++i)
      for (std::size_t j = 0; j < 3; ++j) {
        CHECK(std::isnan(sm(i, j)));
        CHECK(std::isnan(lsm(i, j)));
      }
    CHECK(sm(2, 0) == 0.0);
    CHECK(sm(2, 1) == 1.0);
    CHECK(lsm(2, 0) == -inf);
    CHECK(lsm(2, 1) == 0.0);
  };
  check_rows(pdo::eval(pdo::softmax<1>(x)), pdo::eval(pdo::log_softmax<1>(x)));
  const pdo::tensor<int, 1> labels({3}, {1, 0, 1});
  for (std::size_t n : pdo_test::line_sizes()) {
    const auto mesh = pdo::make_mesh<"x">(pdo::cpu_places(n));
    const auto d = pdo::distribute<pdo::layout<pdo::split<"x">, pdo::replicate>>(mesh, x);
    check_rows(pdo::gather(pdo::eval(pdo::softmax<1>(d))), pdo::gather(pdo::eval(pdo::log_softmax<1>(d))));
    // the loss of a batch with such a row is NaN (torch.nn.functional.cross_entropy too)
    CHECK(std::isnan(pdo::gather(pdo::eval(pdo::cross_entropy(d, pdo::distribute<pdo::layout<pdo::split<"x">>>(mesh, labels))))()));
  }
}

TEST_CASE("numerics: the gradient of max with ties is shared evenly, and adds up to the output's", "[numerics]") {
  const pdo::tensor<double, 2> x({1, 4}, {1, 3, 3, 0});
  const std::vector<double> want{0, 0.5, 0.5, 0};
  auto all = pdo::parameter(x);
  pdo::backward(pdo::max(all));
  auto along = pdo::parameter(x);
  pdo::backward(pdo::sum(pdo::max<1>(along)));
  for (std::size_t j = 0; j < 4; ++j) {
    CHECK(all.grad()(0, j) == want[j]);
    CHECK(along.grad()(0, j) == want[j]);
  }
  // the dim with the ties split over 1-4 places
  for (std::size_t n : pdo_test::line_sizes()) {
    const auto mesh = pdo::make_mesh<"x">(pdo::cpu_places(n));
    auto d = pdo::parameter(pdo::distribute<pdo::layout<pdo::replicate, pdo::split<"x">>>(mesh, x));
    pdo::backward(pdo::sum(pdo::max<1>(d)));
    const auto g = pdo::gather(d.grad());
    for (std::size_t j = 0; j < 4; ++j) CHECK(g(0, j) == want[j]);
  }
  // maximum and minimum of equal values: half each (PyTorch's rule)
  auto a = pdo::parameter(pdo::tensor<double, 1>({2}, {2, 5}));
  auto b = pdo::parameter(pdo::tensor<double, 1>({2}, {2, 1}));
  pdo::backward(pdo::sum(pdo::maximum(a, b)));
  CHECK(a.grad()(0) == 0.5);
  CHECK(b.grad()(0) == 0.5);
  CHECK(a.grad()(1) == 1);
  CHECK(b.grad()(1) == 0);
}

TEST_CASE("numerics: NaN propagates through every reduction, comparison-based op and collective, wherever it sits",
          "[numerics]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (std::size_t at = 0; at < 3; ++at) {
    CAPTURE(at);
    pdo::tensor<double, 1> x({3}, {1, 2, -1});
    x(at) = nan;
    CHECK(std::isnan(pdo::eval(pdo::max(x))()));
    CHECK(std::isnan(pdo::eval(pdo::max<0>(x))()));
    CHECK(std::isnan(pdo::eval(pdo::relu(x))(at)));
    CHECK(std::isnan(pdo::eval(pdo::softmax(x))(at)));
    const pdo::tensor<double, 1> zero({3}, {0, 0, 0});
    CHECK(std::isnan(pdo::eval(pdo::maximum(x, zero))(at)));
    CHECK(std::isnan(pdo::eval(pdo::maximum(zero, x))(at)));
    CHECK(std::isnan(pdo::eval(pdo::minimum(x, zero))(at)));
    CHECK(std::isnan(pdo::eval(pdo::minimum(zero, x))(at)));
    // a 2 x 2 max-pool window with the NaN at each of its cells
    pdo::tensor<double, 4> image({1, 1, 2, 2}, {1, 2, 3, 4});
    image.data()[at] = nan;
    const auto pooled = pdo::max_pool2d(pdo::var(image), 2);
    CHECK(std::isnan(pooled.value().data()[0]));
  }
  // max-pool's gradient goes to a window's last NaN, as PyTorch's kernel gives it
  // (F.max_pool2d over [[nan, 1], [nan, 3]] and [[1, nan], [3, nan]])
  for (const auto& [cells, to] : {std::pair<std::array<double, 4>, std::size_t>{{nan, 1, nan, 3}, 2}, {{1, nan, 3, nan}, 3}}) {
    auto image = pdo::parameter(pdo::tensor<double, 4>({1, 1, 2, 2}, {cells[0], cells[1], cells[2], cells[3]}));
    pdo::backward(pdo::sum(pdo::max_pool2d(image, 2)));
    for (std::size_t i = 0; i < 4; ++i) CHECK(image.grad().data()[i] == (i == to ? 1.0 : 0.0));
  }
  // over meshes: the place holding the NaN does not matter
  for (std::size_t n : pdo_test::line_sizes())
    for (std::size_t holder = 0; holder < n; ++holder) {
      CAPTURE(n, holder);
      const auto mesh = pdo::make_mesh<"x">(pdo::cpu_places(n));
      pdo::tensor<double, 1> x({4}, {1, 2, 3, 4});
      x(pdo::detail::chunk_offset(4, n, holder)) = nan;
      const auto d = pdo::distribute<pdo::layout<pdo::split<"x">>>(mesh, x);
      CHECK(std::isnan(pdo::gather(pdo::eval(pdo::max(d)))()));
      for (auto op : {pdo::reduce_op::max, pdo::reduce_op::min}) {
        std::vector<std::vector<double>> values(n, std::vector<double>{1.0, -1.0});
        values[holder][1] = nan;
        pdo::spmd(mesh, [&](std::size_t p) { pdo::communicator_of(mesh, p).all_reduce(std::span<double>(values[p]), op); });
        for (std::size_t p = 0; p < n; ++p) {
          CHECK(values[p][0] == 1.0);
          CHECK(std::isnan(values[p][1]));
        }
      }
    }
}

TEST_CASE("numerics: gelu is the exact (erf) GELU, PyTorch's default; gelu_tanh the approximation", "[numerics]") {
  const pdo::tensor<double, 1> x({3}, {1.0, -0.5, 3.0});
  // F.gelu(x) and F.gelu(x, approximate="tanh") from PyTorch 1.13, in double
  const double exact[] = {0.841344746068543, -0.15426876936299344, 2.99595030590511};
  const double tanh_form[] = {0.8411919906082768, -0.15428599017485606, 2.996362607918227};
  const auto g = pdo::eval(pdo::gelu(x));
  const auto gt = pdo::eval(pdo::gelu_tanh(x));
  const auto layer = pdo::nn::gelu{}(pdo::var(x)).value();
  const auto layer_tanh = pdo::nn::gelu_tanh{}(pdo::var(x)).value();
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(g(i) == Approx(exact[i]).epsilon(1e-15));
    CHECK(layer(i) == Approx(exact[i]).epsilon(1e-15));
    CHECK(gt(i) == Approx(tanh_form[i]).epsilon(1e-15));
    CHECK(layer_tanh(i) == Approx(tanh_form[i]).epsilon(1e-15));
  }
}

#if defined(PDO_WITH_BLAS)
extern "C" int openblas_get_num_threads() __attribute__((weak));
#endif

TEST_CASE("numerics: matmul on a place of several cores cuts the product, one BLAS call per core", "[numerics]") {
  // one place owning every core of the process; its gemm runs one block per core
  const auto mesh = pdo::make_mesh<"x">(pdo::cpu_places(1));
  struct product {
    std::size_t m, k, n;
  };
  for (const product s : {product{200, 300, 150}, product{20, 2000, 400}, product{3, 5000, 700}, product{1000, 64, 9}}) {
    CAPTURE(s.m, s.k, s.n);
    const auto a = pdo_test::random_tensor<double, 2>({s.m, s.k}, 1), b = pdo_test::random_tensor<double, 2>({s.k, s.n}, 2);
    const auto at = pdo_test::random_tensor<double, 2>({s.k, s.m}, 3), bt = pdo_test::random_tensor<double, 2>({s.n, s.k}, 4);
    pdo::spmd(mesh, [&](std::size_t) {
      CHECK(pdo_test::close(pdo::eval(pdo::matmul(a, b)), pdo_test::naive_matmul(a, b), 1e-12));
      CHECK(pdo_test::close(pdo::eval(pdo::matmul(pdo::transpose(at), pdo::transpose(bt))),
                            pdo_test::naive_matmul(pdo::eval(pdo::transpose(at)), pdo::eval(pdo::transpose(bt))), 1e-12));
    });
  }
#if defined(PDO_WITH_BLAS)
  // BLAS's own threads are off: each place's cores come from its own team
  if (openblas_get_num_threads != nullptr) CHECK(openblas_get_num_threads() == 1);
#endif
}
