// tests/test_expr.cpp: expressions on one place: every op against a naive loop; plans, fusion, async, explain.
#include "support.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

using pdo::replicate;
using pdo_test::close;
using pdo_test::eval_checked;
using pdo_test::random_tensor;
using pdo::split;

namespace {

template <class T, std::size_t Rank, class F>
pdo::tensor<T, Rank> map(const pdo::tensor<T, Rank>& a, F f) {
  pdo::tensor<T, Rank> out(a.shape());
  for (std::size_t i = 0; i < a.size(); ++i) out.data()[i] = f(a.data()[i]);
  return out;
}

template <class T, std::size_t Rank, class F>
pdo::tensor<T, Rank> zip(const pdo::tensor<T, Rank>& a, const pdo::tensor<T, Rank>& b, F f) {
  pdo::tensor<T, Rank> out(a.shape());
  for (std::size_t i = 0; i < a.size(); ++i) out.data()[i] = f(a.data()[i], b.data()[i]);
  return out;
}

}  // namespace

// The views pdo's loops use: range-v3's, or pdo's own under nvcc (this program is also built by nvcc).
TEST_CASE("zip and enumerate pair shards with places", "[expr][views]") {
  namespace views = pdo::detail::views;
  std::vector<std::size_t> places{4, 7, 9};
  std::vector<int> shards{10, 20, 30, 40};  // longer: zip stops with the shortest
  std::vector<std::string> names{"a", "b", "c"};
  std::vector<std::string> seen;
  for (auto&& [p, s, n] : views::zip(places, shards, names)) {
    s += static_cast<int>(p);  // references into the ranges: writes land
    seen.push_back(n + std::to_string(p));
  }
  CHECK(shards == std::vector<int>{14, 27, 39, 40});
  CHECK(seen == std::vector<std::string>{"a4", "b7", "c9"});
  std::vector<std::size_t> positions;
  std::size_t total = 0;
  for (const auto [k, p] : views::enumerate(places)) {
    positions.push_back(static_cast<std::size_t>(k));
    total += p;
  }
  CHECK(positions == std::vector<std::size_t>{0, 1, 2});
  CHECK(total == 20);
  const std::vector<int> none;
  CHECK(std::ranges::distance(views::zip(places, none)) == 0);
}

TEST_CASE("elementwise ops against naive loops", "[expr]") {
  const auto a = random_tensor<double, 2>({5, 7}, 1);
  const auto b = random_tensor<double, 2>({5, 7}, 2);
  const auto pos = random_tensor<double, 2>({5, 7}, 3, 2.0);
  CHECK(close(eval_checked(a + b), zip(a, b, std::plus<>()), 0));
  CHECK(close(eval_checked(a - b), zip(a, b, std::minus<>()), 0));
  CHECK(close(eval_checked(a * b), zip(a, b, std::multiplies<>()), 0));
  CHECK(close(eval_checked(a / pos), zip(a, pos, std::divides<>()), 1e-15));
  CHECK(close(eval_checked(-a), map(a, [](double x) { return -x; }), 0));
  CHECK(close(eval_checked(a * 2.0 + 1.0), map(a, [](double x) { return x * 2 + 1; }), 0));
  CHECK(close(eval_checked(3.0 - a), map(a, [](double x) { return 3 - x; }), 0));
  CHECK(close(eval_checked(pdo::exp(a)), map(a, [](double x) { return std::exp(x); }), 1e-15));
  CHECK(close(eval_checked(pdo::log(pos)), map(pos, [](double x) { return std::log(x); }), 1e-15));
  CHECK(close(eval_checked(pdo::sqrt(pos)), map(pos, [](double x) { return std::sqrt(x); }), 1e-15));
  CHECK(close(eval_checked(pdo::tanh(a)), map(a, [](double x) { return std::tanh(x); }), 1e-15));
  CHECK(close(eval_checked(pdo::sigmoid(a)), map(a, [](double x) { return 1 / (1 + std::exp(-x)); }), 1e-15));
  CHECK(close(eval_checked(pdo::relu(a)), map(a, [](double x) { return x > 0 ? x : 0; }), 0));
  CHECK(close(eval_checked(pdo::gelu(a)), map(a, [](double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }), 1e-15));
  CHECK(close(eval_checked(pdo::gelu_tanh(a)), map(a, [](double x) {
                return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
              }),
              1e-15));
  CHECK(close(eval_checked(pdo::maximum(a, b)), zip(a, b, [](double x, double y) { return std::max(x, y); }), 0));
  CHECK(close(eval_checked(pdo::minimum(a, b)), zip(a, b, [](double x, double y) { return std::min(x, y); }), 0));
  CHECK(close(eval_checked(pdo::less(a, b)), zip(a, b, [](double x, double y) { return x < y ? 1.0 : 0.0; }), 0));
  CHECK(close(eval_checked(pdo::greater_equal(a, 0.0)), map(a, [](double x) { return x >= 0 ? 1.0 : 0.0; }), 0));
  CHECK(close(eval_checked(pdo::equal(a, a)), map(a, [](double) { return 1.0; }), 0));
  CHECK(close(eval_checked(pdo::where(pdo::greater(a, b), a, b * 2.0)),
              zip(a, b, [](double x, double y) { return x > y ? x : 2 * y; }), 0));
  // a fused chain equals the op-by-op evaluation
  const auto step = pdo::eval(a * b);
  CHECK(close(eval_checked(pdo::relu(a * b + pos)), eval_checked(pdo::relu(step + pos)), 0));
  // integer division truncates; by 0 it gives 0 and lowest / -1 wraps, as NumPy's (not a crash)
  pdo::tensor<int, 1> n({5}), d({5});
  const int lowest = std::numeric_limits<int>::min();
  const int ns[] = {7, -7, lowest, 5, 0}, ds[] = {0, 2, -1, -1, 0}, want[] = {0, -3, lowest, -5, 0};
  for (std::size_t i = 0; i < 5; ++i) n(i) = ns[i], d(i) = ds[i];
  const auto q = pdo::eval(n / d);
  for (std::size_t i = 0; i < 5; ++i) CHECK(q(i) == want[i]);
}

TEST_CASE("broadcasting aligns trailing dims and stretches dims of extent 1", "[expr]") {
  const auto a = random_tensor<float, 2>({4, 6}, 4);
  const auto row = random_tensor<float, 1>({6}, 5);
  const auto col = random_tensor<float, 2>({4, 1}, 6);
  const auto r = eval_checked(a + row);
  const auto c = eval_checked(a * col);
  const auto outer = eval_checked(col - row);
  REQUIRE(outer.shape() == pdo::shape_t<2>{4, 6});
  for (std::size_t i = 0; i < 4; ++i)
    for (std::size_t j = 0; j < 6; ++j) {
      CHECK(r(i, j) == a(i, j) + row(j));
      CHECK(c(i, j) == a(i, j) * col(i, 0));
      CHECK(outer(i, j) == col(i, 0) - row(j));
    }
  const pdo::tensor<float, 2> b({5, 6});
  try {
    (void)(a + b);
    FAIL("no error");
  } catch (const pdo::shape_error& e) {
    CHECK_THAT(e.what(), Catch::Contains("add") && Catch::Contains("[4, 6]") && Catch::Contains("[5, 6]"));
  }
}

TEMPLATE_TEST_CASE("matmul, 2-D and batched, against a naive loop", "[expr]", float, double, int) {
  using T = TestType;
  const auto a = pdo_test::iota_tensor<T, 2>({7, 5});
  const auto b = pdo_test::iota_tensor<T, 2>({5, 3});
  CHECK(close(eval_checked(pdo::matmul(a, b)), pdo_test::naive_matmul(a, b), 1e-6));
  // a transposed stored matrix is read in place: the transpose runs inside gemm (fused)
  const auto at = pdo::eval(pdo::transpose(a)), bt = pdo::eval(pdo::transpose(b));
  CHECK(close(eval_checked(pdo::matmul(pdo::transpose(at), pdo::transpose(bt))), pdo_test::naive_matmul(a, b), 1e-6));
  STATIC_REQUIRE(pdo::plan_of<decltype(pdo::matmul(pdo::transpose(at), b))>().kernels() == 1);
  const auto batch = pdo_test::iota_tensor<T, 3>({3, 4, 5});
  const auto bb = pdo_test::iota_tensor<T, 3>({3, 5, 2});
  const auto shared = eval_checked(pdo::matmul(batch, b));
  const auto each = eval_checked(pdo::matmul(batch, bb));
  for (std::size_t n = 0; n < 3; ++n)
    for (std::size_t i = 0; i < 4; ++i) {
      for (std::size_t j = 0; j < 3; ++j) {
        T acc{};
        for (std::size_t k = 0; k < 5; ++k) acc += batch(n, i, k) * b(k, j);
        CHECK(shared(n, i, j) == acc);
      }
      for (std::size_t j = 0; j < 2; ++j) {
        T acc{};
        for (std::size_t k = 0; k < 5; ++k) acc += batch(n, i, k) * bb(n, k, j);
        CHECK(each(n, i, j) == acc);
      }
    }
  CHECK_THROWS_AS(pdo::matmul(a, a), pdo::shape_error);
}

TEST_CASE("reductions, softmax, cross_entropy, transpose and reshape against naive loops", "[expr]") {
  const auto a = random_tensor<double, 2>({4, 6}, 7);
  const auto rows = eval_checked(pdo::sum<1>(a));
  const auto cols = eval_checked(pdo::mean<0>(a));
  const auto top = eval_checked(pdo::max<1>(a));
  double total = 0, best = a(0, 0);
  for (std::size_t i = 0; i < 4; ++i) {
    double r = 0, m = a(i, 0);
    for (std::size_t j = 0; j < 6; ++j) {
      r += a(i, j);
      m = std::max(m, a(i, j));
      total += a(i, j);
      best = std::max(best, a(i, j));
    }
    CHECK(rows(i) == Approx(r));
    CHECK(top(i) == m);
  }
  for (std::size_t j = 0; j < 6; ++j) {
    double c = 0;
    for (std::size_t i = 0; i < 4; ++i) c += a(i, j);
    CHECK(cols(j) == Approx(c / 4));
  }
  // a negative dim counts back from the last (-1), as in PyTorch
  const auto rows_back = eval_checked(pdo::sum<-1>(a));
  const auto cols_back = eval_checked(pdo::mean<-2>(a));
  const auto top_back = eval_checked(pdo::max<-1>(a));
  const auto unit = eval_checked(pdo::unsqueeze<-1>(a));
  const auto unit_front = eval_checked(pdo::unsqueeze<-3>(a));
  REQUIRE(rows_back.shape() == rows.shape());
  REQUIRE(cols_back.shape() == cols.shape());
  REQUIRE(unit.shape() == pdo::shape_t<3>{4, 6, 1});
  REQUIRE(unit_front.shape() == pdo::shape_t<3>{1, 4, 6});
  for (std::size_t i = 0; i < 4; ++i) CHECK((rows_back(i) == rows(i) && top_back(i) == top(i)));
  for (std::size_t j = 0; j < 6; ++j) CHECK(cols_back(j) == cols(j));
  for (std::size_t i = 0; i < 24; ++i) CHECK((unit.data()[i] == a.data()[i] && unit_front.data()[i] == a.data()[i]));
  CHECK(eval_checked(pdo::sum(a)).data()[0] == Approx(total));
  CHECK(eval_checked(pdo::mean(a)).data()[0] == Approx(total / 24));
  CHECK(eval_checked(pdo::max(a)).data()[0] == best);

  const auto sm = eval_checked(pdo::softmax(a));
  const auto lsm = eval_checked(pdo::log_softmax(a));
  const auto sm0 = eval_checked(pdo::softmax<0>(a));
  const auto sm0_back = eval_checked(pdo::softmax<-2>(a));
  const auto lsm_back = eval_checked(pdo::log_softmax<-1>(a));
  for (std::size_t i = 0; i < 24; ++i) CHECK((sm0_back.data()[i] == sm0.data()[i] && lsm_back.data()[i] == lsm.data()[i]));
  pdo::tensor<int, 1> labels({4}, {0, 5, 2, 3});
  double loss = 0;
  for (std::size_t i = 0; i < 4; ++i) {
    double z = 0;
    for (std::size_t j = 0; j < 6; ++j) z += std::exp(a(i, j));
    for (std::size_t j = 0; j < 6; ++j) {
      CHECK(sm(i, j) == Approx(std::exp(a(i, j)) / z));
      CHECK(lsm(i, j) == Approx(a(i, j) - std::log(z)));
    }
    loss += std::log(z) - a(i, static_cast<std::size_t>(labels(i)));
  }
  for (std::size_t j = 0; j < 6; ++j) {
    double z = 0;
    for (std::size_t i = 0; i < 4; ++i) z += std::exp(a(i, j));
    CHECK(sm0(1, j) == Approx(std::exp(a(1, j)) / z));
  }
  CHECK(eval_checked(pdo::cross_entropy(a, labels)).data()[0] == Approx(loss / 4));
  pdo::tensor<int, 1> bad({4}, {0, 6, 2, 3});
  CHECK_THROWS_WITH(pdo::eval(pdo::cross_entropy(a, bad)),
                    Catch::StartsWith("cross_entropy: 1 label of i32[4] is not a class index in [0, 6)") &&
                        Catch::EndsWith("the first is 6, at row 1"));
  pdo::tensor<int, 1> two_bad({4}, {0, 2, -3, 9});
  CHECK_THROWS_WITH(pdo::eval(pdo::cross_entropy(a, two_bad)),
                    Catch::Contains("2 labels of") && Catch::Contains("are not class indices") && Catch::EndsWith("the first is -3, at row 2"));

  // cast: each element as static_cast converts it (toward zero for integers)
  const auto truncated = eval_checked(pdo::cast<int>(a * 10.0));
  const auto narrowed = eval_checked(pdo::cast<float>(a) + 1.0f);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(truncated)>, pdo::tensor<int, 2>>);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(narrowed)>, pdo::tensor<float, 2>>);
  for (std::size_t i = 0; i < 24; ++i) {
    CHECK(truncated.data()[i] == static_cast<int>(a.data()[i] * 10.0));
    CHECK(narrowed.data()[i] == static_cast<float>(a.data()[i]) + 1.0f);
  }
  const auto t = eval_checked(pdo::transpose(a));
  REQUIRE(t.shape() == pdo::shape_t<2>{6, 4});
  for (std::size_t i = 0; i < 4; ++i)
    for (std::size_t j = 0; j < 6; ++j) CHECK(t(j, i) == a(i, j));
  const auto r = eval_checked(pdo::reshape(a, {2, 2, 6}));
  CHECK(r(1, 0, 3) == a(2, 3));
  CHECK_THROWS_AS(pdo::reshape(a, {5, 5}), pdo::shape_error);
  CHECK_THROWS_WITH(pdo::reshape(a, {5, 5}), Catch::Contains("to [5, 5]: the number of elements must stay the same (24 here, 25 there)"));
  const pdo::tensor<double, 2> empty({0, 3});
  CHECK_THROWS_AS(pdo::max<0>(empty), pdo::shape_error);
  CHECK(eval_checked(pdo::sum<0>(empty))(1) == 0.0);
  pdo::tensor<double, 1> fraction({4}, {0, 1.5, 2, 3});
  CHECK_THROWS_AS(pdo::eval(pdo::cross_entropy(a, fraction)), pdo::shape_error);
  CHECK_THROWS_WITH(pdo::eval(pdo::cross_entropy(a, fraction)), Catch::EndsWith("the first is 1.5, at row 1"));

  // along a dim that is not the innermost (read row by row on the CPU, outputs in blocks of
  // 512): each output its elements in order, added in double and rounded once, bitwise; a NaN,
  // -0.0, rows wider than a block
  for (const pdo::shape_t<3> shape : {pdo::shape_t<3>{3, 7, 5}, pdo::shape_t<3>{2, 33, 1300}, pdo::shape_t<3>{1, 1, 1}}) {
    CAPTURE(shape[0], shape[1], shape[2]);
    pdo::tensor<float, 3> x(shape);
    for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = std::sin(0.37f * static_cast<float>(i)) * (i % 7 == 3 ? -0.0f : 1.0f);
    if (x.size() > 10) x.data()[10] = std::numeric_limits<float>::quiet_NaN();
    const auto s1 = eval_checked(pdo::sum<1>(x)), m1 = eval_checked(pdo::mean<1>(x)), x1 = eval_checked(pdo::max<1>(x));
    const auto s0 = eval_checked(pdo::sum<0>(x));
    std::size_t differ = 0;
    auto same = [](float u, float v) { return std::memcmp(&u, &v, sizeof u) == 0; };
    for (std::size_t o = 0; o < shape[0]; ++o)
      for (std::size_t j = 0; j < shape[2]; ++j) {
        double sum = 0;
        float top = -std::numeric_limits<float>::infinity();
        for (std::size_t e = 0; e < shape[1]; ++e) {
          sum = sum + x(o, e, j);
          top = pdo::detail::nan_max(top, x(o, e, j));
        }
        const auto mean = static_cast<float>(sum * (1.0 / static_cast<double>(shape[1])));
        differ += !same(static_cast<float>(sum), s1(o, j)) + !same(mean, m1(o, j)) + !same(top, x1(o, j));
      }
    for (std::size_t e = 0; e < shape[1]; ++e)
      for (std::size_t j = 0; j < shape[2]; ++j) {
        double sum = 0;
        for (std::size_t o = 0; o < shape[0]; ++o) sum = sum + x(o, e, j);
        differ += !same(static_cast<float>(sum), s0(e, j));
      }
    CHECK(differ == 0);

    // softmax along the middle dim (rows read a line of a block at a time on the CPU) gives
    // the bits of softmax along the innermost dim of the same rows laid out contiguously;
    // with an infinite element (its row NaN) and a tie for the max
    if (x.size() > 40) {
      x.data()[20] = std::numeric_limits<float>::infinity();
      x.data()[40 + shape[2]] = x.data()[40];
    }
    pdo::tensor<float, 3> y({shape[0], shape[2], shape[1]});
    for (std::size_t o = 0; o < shape[0]; ++o)
      for (std::size_t e = 0; e < shape[1]; ++e)
        for (std::size_t j = 0; j < shape[2]; ++j) y(o, j, e) = x(o, e, j);
    const auto sm1 = eval_checked(pdo::softmax<1>(x)), lsm1 = eval_checked(pdo::log_softmax<1>(x));
    const auto sm2 = eval_checked(pdo::softmax<2>(y)), lsm2 = eval_checked(pdo::log_softmax<2>(y));
    std::size_t nans = 0;
    for (std::size_t o = 0; o < shape[0]; ++o)
      for (std::size_t e = 0; e < shape[1]; ++e)
        for (std::size_t j = 0; j < shape[2]; ++j) {
          differ += !same(sm1(o, e, j), sm2(o, j, e)) + !same(lsm1(o, e, j), lsm2(o, j, e));
          nans += std::isnan(sm1(o, e, j));
        }
    CHECK(differ == 0);
    if (x.size() > 40) CHECK(nans >= shape[1]);  // the rows of the NaN and of the infinity
  }

  // long rows in float: a running float sum of 2^20 elements of 0.1f is 1% off; pdo's sums
  // (and means, and softmax's normaliser) add in double and round once. Here the double sum is
  // exact (each partial sum fits in 44 bits), so the results are the exact values rounded.
  const std::size_t n = std::size_t{1} << 20;
  pdo::tensor<float, 2> row({1, n}), column({n, 2}), alternating({1, n});
  std::fill(row.begin(), row.end(), 0.1f);
  std::fill(column.begin(), column.end(), 0.1f);
  for (std::size_t i = 0; i < n; ++i) alternating.data()[i] = i % 2 == 0 ? 0.0f : -2.3f;
  const double exact = static_cast<double>(0.1f) * static_cast<double>(n);
  CHECK(eval_checked(pdo::sum<1>(row))(0) == static_cast<float>(exact));
  CHECK(eval_checked(pdo::mean<1>(row))(0) == 0.1f);
  // over every dim, too (a CPU place's sum over all elements adds in double)
  CHECK(eval_checked(pdo::sum(row)).data()[0] == static_cast<float>(exact));
  CHECK(eval_checked(pdo::mean(column)).data()[0] == 0.1f);
  CHECK(eval_checked(pdo::sum(column)).data()[0] == static_cast<float>(2 * exact));
  const auto column_sums = eval_checked(pdo::sum<0>(column));
  CHECK((column_sums(0) == static_cast<float>(exact) && column_sums(1) == static_cast<float>(exact)));
  const double z = static_cast<double>(n / 2) * (1 + std::exp(static_cast<double>(-2.3f)));
  CHECK(eval_checked(pdo::softmax<1>(alternating))(0, 0) == Approx(1 / z).epsilon(1e-6));
  CHECK(eval_checked(pdo::log_softmax<1>(alternating))(0, 0) == Approx(-std::log(z)).epsilon(1e-7));
  pdo::tensor<float, 2> alternating_rows({n, 2});  // along a dim that is not the innermost
  for (std::size_t i = 0; i < 2 * n; ++i) alternating_rows.data()[i] = alternating.data()[i / 2];
  const auto by_columns = eval_checked(pdo::softmax<0>(alternating_rows));
  CHECK(by_columns(0, 0) == Approx(1 / z).epsilon(1e-6));
  CHECK(by_columns(0, 1) == by_columns(0, 0));
}

TEST_CASE("the planner's layouts and plans, at compile time", "[expr][plan]") {
  using M = pdo::mesh<"dp", "tp">;
  using R = replicate;
  using X = pdo::dtensor<float, 2, M, pdo::layout<split<"dp">, R>>;
  using Xk = pdo::dtensor<float, 2, M, pdo::layout<R, split<"tp">>>;
  using Wr = pdo::dtensor<float, 2, M, pdo::layout<R, R>>;
  using Wc = pdo::dtensor<float, 2, M, pdo::layout<R, split<"tp">>>;
  using Wk = pdo::dtensor<float, 2, M, pdo::layout<split<"tp">, R>>;
  using mm_data = decltype(pdo::matmul(std::declval<const X&>(), std::declval<const Wr&>()));
  using mm_cols = decltype(pdo::matmul(std::declval<const X&>(), std::declval<const Wc&>()));
  using mm_rows = decltype(pdo::matmul(std::declval<const Xk&>(), std::declval<const Wk&>()));
  STATIC_REQUIRE(std::is_same_v<pdo::result_layout_t<mm_data>, pdo::layout<split<"dp">, R>>);
  STATIC_REQUIRE(std::is_same_v<pdo::result_layout_t<mm_cols>, pdo::layout<split<"dp">, split<"tp">>>);
  STATIC_REQUIRE(std::is_same_v<pdo::result_layout_t<mm_rows>, pdo::layout<R, R>::partial<"tp">>);
  STATIC_REQUIRE(pdo::plan_of<mm_rows>().collectives() == 0);
  using mlp = decltype(pdo::relu(std::declval<mm_rows>()));
  constexpr auto plan = pdo::plan_of<mlp>();
  STATIC_REQUIRE(plan.count(pdo::step_kind::all_reduce) == 1);
  STATIC_REQUIRE(plan.collectives() == 1);
  STATIC_REQUIRE(std::is_same_v<pdo::result_layout_t<mlp>, pdo::layout<R, R>>);
  // linear ops keep the partial sum pending; the fused chain is one kernel
  using lin = decltype(std::declval<mm_rows>() * 2.0f - std::declval<mm_rows>());
  STATIC_REQUIRE(std::is_same_v<pdo::result_layout_t<lin>, pdo::layout<R, R>::partial<"tp">>);
  using fused = decltype(pdo::relu(std::declval<const X&>() * std::declval<const X&>() + std::declval<const X&>()));
  STATIC_REQUIRE(pdo::plan_of<fused>().kernels() == 1);
  STATIC_REQUIRE(pdo::plan_of<fused>().collectives() == 0);
  // a reduction over a split dim is partial; max over it is combined at once
  using s = decltype(pdo::sum<0>(std::declval<const X&>()));
  STATIC_REQUIRE(std::is_same_v<pdo::result_layout_t<s>, pdo::layout<R>::partial<"dp">>);
  using m = decltype(pdo::max<0>(std::declval<const X&>()));
  STATIC_REQUIRE(std::is_same_v<pdo::result_layout_t<m>, pdo::layout<R>>);
  STATIC_REQUIRE(pdo::plan_of<m>().count(pdo::step_kind::all_reduce) == 1);
  // elementwise over different splits: the second operand moves
  using mixed = decltype(std::declval<const X&>() + std::declval<const Xk&>());
  STATIC_REQUIRE(std::is_same_v<pdo::result_layout_t<mixed>, pdo::layout<split<"dp">, split<"tp">>>);
  STATIC_REQUIRE(pdo::plan_of<mixed>().collectives() == 0);
}

TEST_CASE("planned_collectives counts what ran as the plan counts it: max's all_reduce(max) as an all_reduce", "[expr][plan]") {
  for (const auto& [dp, tp] : {std::pair<std::size_t, std::size_t>{2, 1}, {2, 2}, {3, 1}, {1, 3}}) {
    INFO(dp << " x " << tp);
    const auto mesh = pdo::make_mesh<"dp", "tp">(pdo::cpu_places(dp * tp), {dp, tp});
    const auto h = random_tensor<float, 2>({7, 5}, 43);
    const auto x = pdo::distribute<pdo::layout<split<"dp">, split<"tp">>>(mesh, h);
    using E = decltype(pdo::max<0>(x) + 1.0f);
    STATIC_REQUIRE(pdo::plan_of<E>().count(pdo::step_kind::all_reduce) == 1);
    pdo::reset_planned_collectives();
    const auto r = pdo::gather(pdo::eval(pdo::max<0>(x) + 1.0f));
    // once per group of places along dp: one per place of tp
    CHECK(pdo::planned_collectives(pdo::step_kind::all_reduce) == tp);
    const auto want = pdo::eval(pdo::max<0>(h) + 1.0f);
    for (std::size_t j = 0; j < 5; ++j) CHECK(r(j) == want(j));
  }
}

TEST_CASE("a fused chain allocates exactly its output", "[expr][memory]") {
  for (std::size_t n : {std::size_t{1}, std::size_t{3}}) {
    const auto mesh = pdo_test::line_mesh(n);
    const auto h = random_tensor<float, 1>({1000}, 41);
    using L = pdo::layout<split<"x">>;
    const auto a = pdo::distribute<L>(mesh, h), b = pdo::distribute<L>(mesh, h), c = pdo::distribute<L>(mesh, h);
    std::vector<std::size_t> before;
    for (const auto& p : mesh.places()) before.push_back(p.memory().stats().allocations);
    const auto y = pdo::eval(pdo::relu(a * b + c));
    for (std::size_t p = 0; p < n; ++p) CHECK(mesh.place(p).memory().stats().allocations == before[p] + 1);
    CHECK(close(pdo::gather(y), pdo::eval(pdo::relu(h * h + h)), 0));
  }
  // on local tensors inside a parallel_do block, on the block's place
  const auto mesh = pdo_test::line_mesh(2);
  const auto x = pdo::distribute<pdo::layout<split<"x">>>(mesh, random_tensor<float, 1>({64}, 42));
  const auto y = pdo::parallel_do<pdo::layout<split<"x">>>(
      [](const pdo::tensor<float, 1>& s) {
        const std::size_t before = pdo::detail::current_place()->memory->stats().allocations;
        auto out = pdo::eval(pdo::sigmoid(s * s - s));
        if (pdo::detail::current_place()->memory->stats().allocations != before + 1) throw pdo::error("allocated more");
        return out;
      },
      x);
  CHECK(close(pdo::gather(y), pdo::eval(pdo::sigmoid(pdo::gather(x) * pdo::gather(x) - pdo::gather(x))), 1e-6));
}

TEST_CASE("eval_async queues work per place; errors surface at the wait", "[expr][async]") {
  const auto one = pdo_test::line_mesh(2);
  const auto two = pdo_test::line_mesh(2);
  const auto h = random_tensor<double, 2>({6, 4}, 51);
  using L = pdo::layout<split<"x">, replicate>;
  const auto a = pdo::distribute<L>(one, h);
  const auto b = pdo::distribute<L>(two, h);
  auto first = pdo::eval_async(pdo::exp(a));
  auto second = pdo::eval_async(pdo::tanh(b));
  // a chain: the second expression reads the first's result on each place, after it was written
  auto chained = pdo::eval_async(pdo::sum<1>(first) * 2.0);
  pdo::wait_all();
  CHECK(close(pdo::gather(first.get()), pdo::eval(pdo::exp(h)), 1e-15));
  CHECK(close(pdo::gather(second.get()), pdo::eval(pdo::tanh(h)), 1e-15));
  CHECK(close(pdo::gather(chained.get()), pdo::eval(pdo::sum<1>(pdo::exp(h)) * 2.0), 1e-14));

  pdo::tensor<double, 1> bad({6}, {0, 1, 2, 3, 9, 0});
  const auto labels = pdo::distribute<pdo::layout<split<"x">>>(one, bad);
  auto failing = pdo::eval_async(pdo::cross_entropy(a, labels) * 1.0);
  auto after = pdo::eval_async(pdo::relu(a));  // queued behind the failure, unaffected
  try {
    pdo::wait_all();
    FAIL("no error");
  } catch (const pdo::shape_error& e) {
    CHECK_THAT(e.what(), Catch::Contains("cross_entropy") && Catch::Contains("cpu:1"));
  }
  CHECK(close(pdo::gather(after.get()), pdo::eval(pdo::relu(h)), 0));
  // an async result used as an operand stays alive until the work that reads it is done
  auto later = [&] {
    auto source = pdo::eval_async(pdo::exp(a));
    return pdo::eval_async(source * 0.5);
  }();
  CHECK(close(pdo::gather(std::move(later).get()), pdo::eval(pdo::exp(h) * 0.5), 1e-15));
  // operands on two meshes of one type
  CHECK_THROWS_WITH(pdo::eval(a + b), Catch::StartsWith("eval of add: an operand f64[") && Catch::Contains("another mesh") &&
                                          Catch::Contains("each make_mesh call makes a mesh of its own"));
  // of an op on vars: named by the op
  CHECK_THROWS_WITH(pdo::cross_entropy(pdo::var(a), pdo::distribute<pdo::layout<split<"x">>>(two, pdo::tensor<int, 1>(pdo::shape_t<1>{6}))),
                    Catch::StartsWith("eval of cross_entropy: an operand i32["));
  CHECK(after.ready());
  CHECK_THROWS_AS(failing.get(), pdo::shape_error);
  // a partial result that failed: gather names itself, then the sum it needed
  auto failed_sum = pdo::eval_async(pdo::sum(pdo::cross_entropy(a, labels) * a));
  static_assert(pdo::detail::value_of<typename decltype(failed_sum)::value_type::layout_type>().npartial == 1);
  CHECK_THROWS_WITH(pdo::gather(failed_sum.value()), Catch::StartsWith("gather: redistribute: ") && Catch::Contains("cross_entropy"));
  CHECK_THROWS_AS(failed_sum.wait(), pdo::shape_error);
  // the same plan with labels in range: its kernel (cross_entropy, compute lanes) and the
  // all_gather of `a` (communication lanes) run at once on each place, sharing its run
  pdo::tensor<double, 1> good({6}, {0, 1, 2, 3, 3, 0});
  const auto good_labels = pdo::distribute<pdo::layout<split<"x">>>(one, good);
  for (int round = 0; round < 20; ++round)
    CHECK(close(pdo::gather(pdo::eval(pdo::sum(pdo::cross_entropy(a, good_labels) * a))),
                pdo::eval(pdo::sum(pdo::cross_entropy(h, good) * h)), 1e-13));
  // a result taken by get() on an rvalue, and a dtensor moved from, are empty: every use says so
  auto once = pdo::eval_async(a * 2.0);
  const auto taken = std::move(once).get();
  CHECK(close(pdo::gather(taken), pdo::eval(h * 2.0), 0));
  CHECK_THROWS_WITH(pdo::gather(once.get()), Catch::Contains("dtensor f64[6, 4]{split<x>, replicate}: used after it was moved from"));
  auto moved = pdo::distribute<L>(one, h);
  const auto kept = std::move(moved);
  for (const auto& use : std::vector<std::function<void()>>{[&] { (void)pdo::gather(moved); },
                                                            [&] { (void)pdo::redistribute<pdo::layout<replicate, replicate>>(moved); },
                                                            [&] { (void)pdo::eval(moved + 1.0); }, [&] { (void)pdo::eval(kept + moved); }})
    CHECK_THROWS_WITH(use(), Catch::Contains("used after it was moved from"));
  CHECK_THAT(moved.describe(), Catch::Contains("(moved from)"));
  CHECK(close(pdo::gather(kept), h, 0));
  // an async_result moved from is still a handle on its evaluation; a mesh moved from has
  // no places, and every use of it says so
  auto handle = pdo::eval_async(a * 3.0);
  const auto other = std::move(handle);
  CHECK(close(pdo::gather(handle.get()), pdo::eval(h * 3.0), 0));
  CHECK(other.ready());
  auto mesh_moved = pdo_test::line_mesh(2);
  const auto mesh_kept = std::move(mesh_moved);
  for (const auto& use : std::vector<std::function<void()>>{[&] { (void)mesh_moved.size(); },
                                                            [&] { (void)mesh_moved.describe(); },
                                                            [&] { (void)pdo::distribute<L>(mesh_moved, h); }})
    CHECK_THROWS_WITH(use(), Catch::Contains("mesh of 1 axis: used after it was moved from"));
  CHECK(close(pdo::gather(pdo::distribute<L>(mesh_kept, h)), h, 0));
}

TEST_CASE("explain prints the plan with shapes and bytes", "[expr][plan]") {
  const auto mesh = pdo_test::line_mesh(2);
  const auto x = pdo::distribute<pdo::layout<replicate, split<"x">>>(mesh, random_tensor<float, 2>({8, 6}, 61));
  const auto w = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, random_tensor<float, 2>({6, 4}, 62));
  const std::string text = pdo::explain(pdo::relu(pdo::matmul(x, w) + 1.0f));
  CAPTURE(text);
  CHECK_THAT(text, Catch::Contains("kernel matmul") && Catch::Contains("all_reduce over x") &&
                       Catch::Contains("fused(add + relu)") && Catch::Contains("f32[8, 4]") &&
                       Catch::Contains("128 bytes sent per place"));
  // a shape mismatch names the op, the shapes and the layouts
  const auto y = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, random_tensor<float, 2>({7, 6}, 63));
  CHECK_THROWS_WITH(pdo::eval(x + y), Catch::Contains("add") && Catch::Contains("f32[8, 6]{replicate, split<x>}") &&
                                          Catch::Contains("f32[7, 6]{split<x>, replicate}"));
}
