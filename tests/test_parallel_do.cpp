// tests/parallel_do.cpp: parallel_do against the single-place program, merges, and failures.
#include "support.hpp"

#include <atomic>
#include <cmath>

using pdo::replicate;
using pdo::split;

namespace {

/// @brief The single-place program: y = relu(x * w) with x [m, k] and w [k, n].
template <class T>
pdo::tensor<T, 2> dense_relu(const pdo::tensor<T, 2>& x, const pdo::tensor<T, 2>& w) {
  pdo::tensor<T, 2> y({x.extent(0), w.extent(1)});
  for (std::size_t i = 0; i < x.extent(0); ++i)
    for (std::size_t j = 0; j < w.extent(1); ++j) {
      T acc{};
      for (std::size_t l = 0; l < x.extent(1); ++l) acc += x(i, l) * w(l, j);
      y(i, j) = acc > T{} ? acc : T{};
    }
  return y;
}

}  // namespace

TEMPLATE_TEST_CASE("split inputs and replicated weights give the single-place result", "[parallel_do]", float, double, int) {
  using T = TestType;
  auto x = pdo_test::iota_tensor<T, 2>({10, 5});
  auto w = pdo_test::iota_tensor<T, 2>({5, 3});
  const auto expected = dense_relu(x, w);
  for (std::size_t n : pdo_test::line_sizes()) {
    CAPTURE(n);
    const auto mesh = pdo_test::line_mesh(n);
    const auto xs = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, x);
    const auto ws = pdo::distribute<pdo::layout<replicate, replicate>>(mesh, w);
    const auto y = pdo::parallel_do<pdo::layout<split<"x">, replicate>>(
        [](const pdo::tensor<T, 2>& xl, const pdo::tensor<T, 2>& wl) { return dense_relu(xl, wl); }, xs, ws);
    static_assert(std::is_same_v<typename decltype(y)::layout_type, pdo::layout<split<"x">, replicate>>);
    CHECK(y.shape() == pdo::shape_t<2>{10, 3});
    CHECK(pdo_test::equal(pdo::gather(y), expected));
  }
}

TEST_CASE("row-parallel blocks merge as a partial sum; column-parallel as a split", "[parallel_do]") {
  const auto x = pdo_test::iota_tensor<int, 2>({7, 9});
  const auto w = pdo_test::iota_tensor<int, 2>({9, 6});
  const auto expected = pdo_test::naive_matmul(x, w);
  for (std::size_t n : pdo_test::line_sizes()) {
    const auto mesh = pdo_test::line_mesh(n);
    auto mm = [](const pdo::tensor<int, 2>& a, const pdo::tensor<int, 2>& b) { return pdo_test::naive_matmul(a, b); };
    // K split in both: each place holds an addend
    const auto partial = pdo::parallel_do<pdo::layout<replicate, replicate>::partial<"x">>(
        mm, pdo::distribute<pdo::layout<replicate, split<"x">>>(mesh, x), pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, w));
    CHECK(pdo_test::equal(pdo::gather(partial), expected));
    // N split in w: each place holds a block of columns
    const auto cols = pdo::parallel_do<pdo::layout<replicate, split<"x">>>(
        mm, pdo::distribute<pdo::layout<replicate, replicate>>(mesh, x), pdo::distribute<pdo::layout<replicate, split<"x">>>(mesh, w));
    CHECK(pdo_test::equal(pdo::gather(cols), expected));
  }
}

TEST_CASE("parallel_do on a 2x2 mesh: data x tensor parallel", "[parallel_do]") {
  const auto mesh = pdo_test::grid_mesh(2, 2);
  const auto x = pdo_test::iota_tensor<double, 2>({9, 4});
  const auto w = pdo_test::iota_tensor<double, 2>({4, 5});
  const auto y = pdo::parallel_do<pdo::layout<split<"a">, split<"b">>>(
      [](const auto& xl, const auto& wl) { return pdo_test::naive_matmul(xl, wl); },
      pdo::distribute<pdo::layout<split<"a">, replicate>>(mesh, x),
      pdo::distribute<pdo::layout<replicate, split<"b">>>(mesh, w));
  CHECK(y.shard(3).shape() == pdo::shape_t<2>{4, 2});
  CHECK(pdo_test::equal(pdo::gather(y), pdo_test::naive_matmul(x, w)));
}

TEST_CASE("a block may return an expression of its shards, evaluated on its place", "[parallel_do]") {
  // the contract's example: relu(matmul) of each place's rows by the weights, uneven rows
  const auto x = pdo_test::iota_tensor<float, 2>({11, 6});
  auto w = pdo_test::iota_tensor<float, 2>({6, 5});
  for (auto& v : w) v = 0.01f * v - 0.1f;
  const auto expected = pdo::eval(pdo::relu(pdo::matmul(x, w)));
  const auto block = [](const auto& xl, const auto& wl) { return pdo::relu(pdo::matmul(xl, wl)); };
  for (std::size_t n : pdo_test::line_sizes()) {
    CAPTURE(n);
    const auto mesh = pdo_test::line_mesh(n);
    const auto y = pdo::parallel_do<pdo::layout<split<"x">, replicate>>(
        block, pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, x), pdo::distribute<pdo::layout<replicate, replicate>>(mesh, w));
    static_assert(std::is_same_v<typename decltype(y)::value_type, float>);
    CHECK(pdo_test::close(pdo::gather(y), expected, 1e-5));
  }
  // on a 2 x 2 mesh, the weight's columns cut along "b": the result is split both ways
  const auto mesh = pdo_test::grid_mesh(2, 2);
  const auto y = pdo::parallel_do<pdo::layout<split<"a">, split<"b">>>(block, pdo::distribute<pdo::layout<split<"a">, replicate>>(mesh, x),
                                                                       pdo::distribute<pdo::layout<replicate, split<"b">>>(mesh, w));
  CHECK(y.shard(3).shape() == pdo::shape_t<2>{5, 2});
  CHECK(pdo_test::close(pdo::gather(y), expected, 1e-5));
}

TEST_CASE("a block's expression of a tensor it made, or took by value, is an error: that tensor is freed when the block returns",
          "[parallel_do][errors]") {
  const auto x = pdo_test::iota_tensor<double, 2>({7, 4});
  const auto mesh = pdo_test::line_mesh(3);
  using rows = pdo::layout<split<"x">, replicate>;
  const auto dx = pdo::distribute<rows>(mesh, x);
  const auto made = [](const pdo::tensor<double, 2>& s) {
    const pdo::tensor<double, 2> t = pdo::eval(s * 3.0);
    return pdo::relu(t + 1.0);
  };
  CHECK_THROWS_WITH(pdo::parallel_do<rows>(made, dx),
                    Catch::Contains("parallel_do: the block failed on place cpu:0: its result is an expression (relu) that refers to a tensor") &&
                        Catch::Contains("the block made (or took by value), freed when it returned") &&
                        Catch::Contains("return pdo::eval(...)"));
  const auto by_value = [](pdo::tensor<double, 2> s) { return s * 2.0; };
  CHECK_THROWS_WITH(pdo::parallel_do<rows>(by_value, dx), Catch::Contains("freed when it returned"));
  // the fixes the message names work; tensors that outlive the block may be referred to
  const auto evaluated = [](const pdo::tensor<double, 2>& s) {
    const pdo::tensor<double, 2> t = pdo::eval(s * 3.0);
    return pdo::eval(pdo::relu(t + 1.0));
  };
  const auto outer = pdo_test::iota_tensor<double, 1>({4});
  const auto with_outer = [&](const auto& s) { return s * 3.0 + 1.0 + outer * 0.0; };
  CHECK(pdo_test::equal(pdo::gather(pdo::parallel_do<rows>(evaluated, dx)), pdo::eval(pdo::relu(x * 3.0 + 1.0))));
  CHECK(pdo_test::equal(pdo::gather(pdo::parallel_do<rows>(with_outer, dx)), pdo::eval(x * 3.0 + 1.0)));
}

TEST_CASE("results made inside a block live in the place's memory", "[parallel_do][memory]") {
  const auto places = pdo::cpu_places(2);
  const auto mesh = pdo::make_mesh<"x">(places);
  const auto x = pdo::distribute<pdo::layout<split<"x">>>(mesh, pdo_test::iota_tensor<float, 1>({1000}));
  const auto before = places[1].memory().stats().bytes_in_use;
  const auto y = pdo::parallel_do<pdo::layout<split<"x">>>([](const pdo::tensor<float, 1>& s) { return pdo::tensor<float, 1>(s.shape()); }, x);
  CHECK(places[1].memory().stats().bytes_in_use >= before + 500 * sizeof(float));
  CHECK(y.shard(1).place_name() == "cpu:1");
}

TEST_CASE("an exception on one place reaches the caller naming the place; the mesh stays usable", "[parallel_do][errors]") {
  const auto mesh = pdo_test::line_mesh(4);
  const auto x = pdo::distribute<pdo::layout<split<"x">>>(mesh, pdo_test::iota_tensor<int, 1>({10}));
  auto block = [](const pdo::tensor<int, 1>& s) { return s; };
  try {
    (void)pdo::parallel_do<pdo::layout<split<"x">>>(
        [](const pdo::tensor<int, 1>& s) {
          if (s(0) == -1) throw std::runtime_error("bad shard");  // place 2's shard starts at element 6, whose value is -1
          return s;
        },
        x);
    FAIL("no error reached the caller");
  } catch (const pdo::error& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("parallel_do") && Catch::Contains("cpu:2") && Catch::Contains("bad shard"));
  }
  const auto y = pdo::parallel_do<pdo::layout<split<"x">>>(block, x);
  CHECK(pdo_test::equal(pdo::gather(y), pdo_test::iota_tensor<int, 1>({10})));
}

TEST_CASE("a block reading, or a copy of, an eval_async result waits for it, and is its error when it failed", "[parallel_do][errors]") {
  const auto mesh = pdo_test::line_mesh(2);
  pdo::tensor<float, 2> h({2, 3});
  h.fill(1);
  pdo::tensor<int, 1> labels({2});
  labels(0) = 0;
  labels(1) = 99;  // not a class index: cross_entropy fails on place 1
  const auto logits = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, h);
  const auto y = pdo::distribute<pdo::layout<split<"x">>>(mesh, labels);
  auto copy = [](const pdo::tensor<float, 2>& s) { return pdo::tensor<float, 2>(s); };
  const auto r = pdo::eval_async(pdo::softmax<1>(logits) + pdo::cross_entropy(logits, y));
  for (int pass = 0; pass < 2; ++pass) {  // before its wait, and after
    CHECK_THROWS_WITH((pdo::parallel_do<pdo::layout<split<"x">, replicate>>(copy, r.value())),
                      Catch::Contains("parallel_do: the block did not run on place cpu:") &&
                          Catch::Contains(": an operation whose result it reads failed: ") &&
                          Catch::Contains("is not a class index"));
    // a copy of the result is that failure too, not shards of whatever the memory held
    CHECK_THROWS_WITH(std::remove_cvref_t<decltype(r.value())>(r.value()),
                      Catch::Contains("copy of dtensor f32[2, 3]{split<x>, replicate}") &&
                          Catch::Contains("its values were not computed: ") && Catch::Contains("is not a class index"));
    if (pass == 0) CHECK_THROWS_WITH(r.wait(), Catch::Contains("is not a class index") && Catch::Contains("the first is 99, at row 1"));
  }
  // an independent block still runs, and one on a good result reads it whole
  labels(1) = 2;
  const auto y2 = pdo::distribute<pdo::layout<split<"x">>>(mesh, labels);
  const auto good = pdo::eval_async(pdo::softmax<1>(logits) + pdo::cross_entropy(logits, y2));
  const auto out = pdo::gather(pdo::parallel_do<pdo::layout<split<"x">, replicate>>(copy, good.value()));
  CHECK(out(1, 2) == Approx(1.0 / 3 + std::log(3.0)));
}

TEST_CASE("a block's pdo::error keeps its type", "[parallel_do][errors]") {
  const auto mesh = pdo_test::line_mesh(3);
  const auto x = pdo::distribute<pdo::layout<split<"x">>>(mesh, pdo_test::iota_tensor<int, 1>({9}));
  CHECK_THROWS_AS((pdo::parallel_do<pdo::layout<split<"x">>>(
                      [](const pdo::tensor<int, 1>& s) -> pdo::tensor<int, 1> {
                        if (s(0) == -4) throw pdo::out_of_memory("no room");  // place 1's shard starts at element 3
                        return s;
                      },
                      x)),
                  pdo::out_of_memory);
}

TEST_CASE("results that cannot be merged as the layout says are a shape error", "[parallel_do][errors]") {
  const auto mesh = pdo_test::line_mesh(3);
  const auto x = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, pdo_test::iota_tensor<float, 2>({6, 2}));
  // replicate merge needs equal shapes: here the second place to run returns one row more
  std::atomic<int> ran{0};
  REQUIRE_THROWS_AS((pdo::parallel_do<pdo::layout<replicate, replicate>>(
                        [&ran](const pdo::tensor<float, 2>& s) { return pdo::tensor<float, 2>({s.extent(0) + (ran++ == 1 ? 1 : 0), 2}); },
                        pdo::distribute<pdo::layout<replicate, replicate>>(mesh, pdo_test::iota_tensor<float, 2>({7, 2})))),
                    pdo::shape_error);
  // a split merge needs the even cut: place 0 returns 1 row, so 5 rows would be cut 2,2,1
  REQUIRE_THROWS_WITH((pdo::parallel_do<pdo::layout<split<"x">, replicate>>(
                          [](const pdo::tensor<float, 2>& s) {
                            return pdo::tensor<float, 2>({s(0, 0) == -3.5f ? 1 : s.extent(0), 2});
                          },
                          x)),
                      Catch::Contains("parallel_do") && Catch::Contains("cpu:0 [1, 2], cpu:1 [2, 2], cpu:2 [2, 2]"));
  // place 0's part is the odd one in a dim that is not split: the global shape, taken from
  // it, does not blame the others; every place's part is named
  REQUIRE_THROWS_WITH((pdo::parallel_do<pdo::layout<split<"x">, replicate>>(
                          [](const pdo::tensor<float, 2>& s) {
                            return pdo::tensor<float, 2>({s.extent(0), s(0, 0) == -3.5f ? std::size_t{1} : std::size_t{2}});
                          },
                          x)),
                      Catch::Contains("do not make one tensor") && Catch::Contains("cpu:0 [2, 1], cpu:1 [2, 2], cpu:2 [2, 2]"));
}

TEST_CASE("dtensors of different meshes cannot be mixed", "[parallel_do][errors]") {
  const auto a = pdo_test::line_mesh(2), b = pdo_test::line_mesh(2);
  const auto xa = pdo::distribute<pdo::layout<split<"x">>>(a, pdo_test::iota_tensor<int, 1>({4}));
  const auto xb = pdo::distribute<pdo::layout<split<"x">>>(b, pdo_test::iota_tensor<int, 1>({4}));
  REQUIRE_THROWS_AS((pdo::parallel_do<pdo::layout<split<"x">>>([](const auto& u, const auto&) { return u; }, xa, xb)),
                    pdo::layout_error);
}

// Differentiable parallel_do: blocks over pdo::var operands, checked against the program on one place.
namespace {

using grid = pdo::mesh<"x", "y">;
using rows2 = pdo::layout<split<"x">, replicate>;
using whole2 = pdo::layout<replicate, replicate>;

/// @brief Lines of 1 to 4 places (n x 1) and a 2 x 2 mesh, of one mesh type.
std::vector<grid> meshes() {
  std::vector<grid> out;
  for (std::size_t n : pdo_test::line_sizes()) out.push_back(pdo::make_mesh<"x", "y">(pdo::cpu_places(n), {n, 1}));
  out.push_back(pdo::make_mesh<"x", "y">(pdo::cpu_places(4), {2, 2}));
  return out;
}

template <class T, std::size_t R>
pdo::tensor<T, R> random(const pdo::shape_t<R>& shape, unsigned seed) {
  return pdo_test::random_tensor<T, R>(shape, seed);
}

}  // namespace

TEST_CASE("parallel_do over vars: gradients of split and replicated operands equal the one-place program's",
          "[parallel_do][autograd]") {
  const auto x = random<double, 2>({10, 6}, 1), w1 = random<double, 2>({6, 5}, 2), w2 = random<double, 2>({5, 3}, 3);
  const auto seed = random<double, 2>({10, 3}, 4);
  auto block = [](const auto& xl, const auto& a, const auto& b) { return pdo::matmul(pdo::tanh(pdo::matmul(xl, a)), b); };
  auto X = pdo::parameter(x), W1 = pdo::parameter(w1), W2 = pdo::parameter(w2);
  const auto want = block(X, W1, W2);
  pdo::backward(want, seed);
  for (const auto& m : meshes()) {
    CAPTURE(m.describe());
    auto dX = pdo::parameter(pdo::distribute<rows2>(m, x));
    auto dW1 = pdo::parameter(pdo::distribute<whole2>(m, w1)), dW2 = pdo::parameter(pdo::distribute<whole2>(m, w2));
    const auto out = pdo::parallel_do<rows2>(block, dX, dW1, dW2);
    STATIC_REQUIRE(std::is_same_v<std::remove_cvref_t<decltype(out)>, pdo::var<pdo::dtensor<double, 2, grid, rows2>>>);
    CHECK(pdo_test::close(pdo::gather(out.value()), want.value(), 1e-13));
    pdo::backward(out, pdo::distribute<rows2>(m, seed));
    CHECK(pdo_test::close(pdo::gather(dX.grad()), X.grad(), 1e-12));   // split: each place its rows
    CHECK(pdo_test::close(pdo::gather(dW1.grad()), W1.grad(), 1e-12));  // replicated: summed over the places
    CHECK(pdo_test::close(pdo::gather(dW2.grad()), W2.grad(), 1e-12));
  }
}

TEST_CASE("parallel_do over vars: a plain dtensor beside a var arrives as its shard, and gets no gradient",
          "[parallel_do][autograd]") {
  const auto x = random<double, 2>({7, 4}, 5), w = random<double, 2>({4, 3}, 6);
  const auto seed = random<double, 2>({7, 3}, 7);
  auto X = pdo::parameter(x);
  const auto want = pdo::relu(pdo::matmul(X, pdo::var(w)));
  pdo::backward(want, seed);
  for (const auto& m : meshes()) {
    CAPTURE(m.describe());
    auto dX = pdo::parameter(pdo::distribute<rows2>(m, x));
    const auto dW = pdo::distribute<whole2>(m, w);  // a plain dtensor: the block wraps its shard itself
    const auto out = pdo::parallel_do<rows2>(
        [](const auto& xl, const pdo::tensor<double, 2>& wl) { return pdo::relu(pdo::matmul(xl, pdo::var(wl))); }, dX, dW);
    STATIC_REQUIRE(std::is_same_v<std::remove_cvref_t<decltype(out)>, pdo::var<pdo::dtensor<double, 2, grid, rows2>>>);
    CHECK(pdo_test::close(pdo::gather(out.value()), want.value(), 1e-13));
    pdo::backward(out, pdo::distribute<rows2>(m, seed));
    CHECK(pdo_test::close(pdo::gather(dX.grad()), X.grad(), 1e-12));
  }
}

TEST_CASE("parallel_do over vars: a block with its own parameter, two blocks in a row, a result used twice",
          "[parallel_do][autograd]") {
  const auto x = random<double, 2>({9, 4}, 5), w1 = random<double, 2>({4, 6}, 6), w2 = random<double, 2>({6, 3}, 7);
  const auto b = random<double, 1>({3}, 8);
  auto first = [](const auto& xl, const auto& a) { return pdo::relu(pdo::matmul(xl, a)); };
  auto loss_of = [](const auto& y) { return pdo::sum(y) + pdo::sum(y * y); };  // y used twice
  auto X = pdo::parameter(x), W1 = pdo::parameter(w1), W2 = pdo::parameter(w2);
  auto B = pdo::parameter(b);
  auto second = [&B](const auto& h, const auto& a) { return pdo::tanh(pdo::matmul(h, a) + B); };
  pdo::backward(loss_of(second(first(X, W1), W2)));
  for (const auto& m : meshes()) {
    CAPTURE(m.describe());
    auto dX = pdo::parameter(pdo::distribute<rows2>(m, x));
    auto dW1 = pdo::parameter(pdo::distribute<whole2>(m, w1)), dW2 = pdo::parameter(pdo::distribute<whole2>(m, w2));
    auto own = pdo::parameter(b);  // the block's own parameter: every place's block uses it
    auto block2 = [&own](const auto& h, const auto& a) { return pdo::tanh(pdo::matmul(h, a) + own); };
    const auto h = pdo::parallel_do<rows2>(first, dX, dW1);
    const auto y = pdo::parallel_do<rows2>(block2, h, dW2);
    pdo::backward(loss_of(y));
    CHECK(pdo_test::close(pdo::gather(dX.grad()), X.grad(), 1e-12));
    CHECK(pdo_test::close(pdo::gather(dW1.grad()), W1.grad(), 1e-12));
    CHECK(pdo_test::close(pdo::gather(dW2.grad()), W2.grad(), 1e-12));
    CHECK(pdo_test::close(own.grad(), B.grad(), 1e-12));
  }
}

TEST_CASE("parallel_do over vars: a value the block captured, computed from a parameter outside it, passes its gradient on once",
          "[parallel_do][autograd]") {
  const auto x = random<double, 2>({9, 4}, 11), w = random<double, 2>({4, 3}, 12);
  auto Q = pdo::parameter(w);
  const auto H = pdo::tanh(Q) * 2.0;
  const auto want = pdo::tanh(pdo::matmul(pdo::var(x), H));
  pdo::backward(pdo::sum(want * want));
  for (const auto& m : meshes()) {
    CAPTURE(m.describe());
    auto dQ = pdo::parameter(w);
    std::vector<double> seen;  // dQ's first gradient element, each time its hook fires
    dQ.on_gradient([&] { seen.push_back(dQ.grad().data()[0]); });
    const auto dH = pdo::tanh(dQ) * 2.0;  // every place's block uses it: its gradient is the sum of theirs
    const auto dX = pdo::var(pdo::distribute<rows2>(m, x));
    const auto out = pdo::parallel_do<rows2>([&dH](const auto& xl) { return pdo::tanh(pdo::matmul(xl, dH)); }, dX);
    CHECK(pdo_test::close(pdo::gather(out.value()), want.value(), 1e-13));
    pdo::backward(pdo::sum(out * out));
    CHECK(pdo_test::close(dQ.grad(), Q.grad(), 1e-12));
    REQUIRE(seen.size() == 1);  // once, complete
    CHECK(seen[0] == dQ.grad().data()[0]);
    // a captured parameter's hook too
    auto P = pdo::parameter(w);
    std::size_t calls = 0;
    double at_hook = 0;
    P.on_gradient([&] {
      ++calls;
      at_hook = P.grad().data()[0];
    });
    const auto direct = pdo::parallel_do<rows2>([&P](const auto& xl) { return pdo::tanh(pdo::matmul(xl, P)); }, dX);
    pdo::backward(pdo::sum(direct * direct));
    CHECK(calls == 1);
    CHECK(at_hook == P.grad().data()[0]);
  }
}

TEST_CASE("parallel_do over vars: a conv block, batch split", "[parallel_do][autograd]") {
  const auto x = random<double, 4>({5, 2, 6, 6}, 9), w = random<double, 4>({3, 2, 3, 3}, 10);
  const auto bias = random<double, 1>({3}, 11);
  using batch = pdo::layout<split<"x">, replicate, replicate, replicate>;
  using whole4 = pdo::layout<replicate, replicate, replicate, replicate>;
  auto block = [](const auto& xl, const auto& wl, const auto& bl) {
    return pdo::max_pool2d(pdo::relu(pdo::conv2d(xl, wl, bl, {1, 1})), 2);
  };
  auto X = pdo::parameter(x), W = pdo::parameter(w);
  auto Bs = pdo::parameter(bias);
  const auto want = block(X, W, Bs);
  pdo::backward(pdo::sum(want * want));
  for (const auto& m : meshes()) {
    CAPTURE(m.describe());
    auto dX = pdo::parameter(pdo::distribute<batch>(m, x));
    auto dW = pdo::parameter(pdo::distribute<whole4>(m, w));
    auto dB = pdo::parameter(pdo::distribute<pdo::layout<replicate>>(m, bias));
    const auto y = pdo::parallel_do<batch>(block, dX, dW, dB);
    CHECK(pdo_test::close(pdo::gather(y.value()), want.value(), 1e-13));
    pdo::backward(pdo::sum(y * y));
    CHECK(pdo_test::close(pdo::gather(dX.grad()), X.grad(), 1e-12));
    CHECK(pdo_test::close(pdo::gather(dW.grad()), W.grad(), 1e-12));
    CHECK(pdo_test::close(pdo::gather(dB.grad()), Bs.grad(), 1e-12));
  }
}

TEST_CASE("the seed program: a batch split, an MLP replicated, parallel_do, loss, backward, SGD on every place",
          "[parallel_do][autograd][training]") {
  const auto x = random<double, 2>({12, 5}, 12);
  pdo::tensor<int, 1> labels({12});
  for (std::size_t i = 0; i < 12; ++i) labels(i) = static_cast<int>(i % 3);
  const auto w1 = random<double, 2>({5, 8}, 13), w2 = random<double, 2>({8, 3}, 14);
  auto mlp = [](const auto& xl, const auto& a, const auto& b) { return pdo::matmul(pdo::relu(pdo::matmul(xl, a)), b); };
  // one place
  auto W1 = pdo::parameter(w1), W2 = pdo::parameter(w2);
  pdo::nn::sgd<double> opt({{"w1", W1}, {"w2", W2}}, {.lr = 0.2, .momentum = 0.9});
  std::vector<double> losses;
  for (int step = 0; step < 4; ++step) {
    const auto loss = pdo::cross_entropy(mlp(pdo::var(x), W1, W2), labels);
    losses.push_back(pdo::detail::scalar_of(loss.value()));
    opt.zero_grad();
    pdo::backward(loss);
    opt.step();
  }
  for (const auto& m : meshes()) {
    CAPTURE(m.describe());
    const auto X = pdo::distribute<rows2>(m, x);
    const auto Y = pdo::distribute<pdo::layout<split<"x">>>(m, labels);
    auto dW1 = pdo::parameter(pdo::distribute<whole2>(m, w1)), dW2 = pdo::parameter(pdo::distribute<whole2>(m, w2));
    pdo::nn::sgd<double> dopt({{"w1", dW1}, {"w2", dW2}}, {.lr = 0.2, .momentum = 0.9});
    for (int step = 0; step < 4; ++step) {
      const auto logits = pdo::parallel_do<rows2>(mlp, pdo::var(X), dW1, dW2);
      const auto loss = pdo::cross_entropy(logits, Y);
      CHECK(pdo::detail::scalar_of(loss.value()) == Approx(losses[static_cast<std::size_t>(step)]).epsilon(1e-12));
      dopt.zero_grad();
      pdo::backward(loss);
      dopt.step();  // on every place, on its replica
    }
    CHECK(pdo_test::close(pdo::gather(dW1.value()), W1.value(), 1e-11));
    CHECK(pdo_test::close(pdo::gather(dW2.value()), W2.value(), 1e-11));
  }
}

TEST_CASE("parallel_do over vars: a block's result that does not fit the output layout is an error naming the place",
          "[parallel_do][autograd][errors]") {
  const auto m = pdo::make_mesh<"x", "y">(pdo::cpu_places(2), {2, 1});
  auto dX = pdo::parameter(pdo::distribute<rows2>(m, random<double, 2>({5, 4}, 15)));
  // (a block over rows split along "x" whose result replicates over "x" is a compile error:
  // tests/compile_fail/parallel_do_replicas_differ.cpp) the second place to run returns a
  // block of 4 rows, the first one of 5: they cannot be replicas of one value. Which place
  // runs second is up to the scheduler, so the message names one shape as returned and the
  // other as expected, in either order
  const auto whole = pdo::parameter(pdo::distribute<whole2>(m, random<double, 2>({5, 4}, 15)));
  std::atomic<int> ran{0};
  CHECK_THROWS_WITH(pdo::parallel_do<whole2>(
                        [&ran](const auto& xl) {
                          if (ran++ == 1) return pdo::var(pdo::tensor<double, 2>({4, 4}));
                          return pdo::var(pdo::eval(xl.value() * 2.0));
                        },
                        whole),
                    Catch::Contains("parallel_do") && Catch::Contains("cpu:0 [") && Catch::Contains("cpu:1 [") &&
                        Catch::Contains("[4, 4]") && Catch::Contains("[5, 4]"));
  // the mesh stays usable
  const auto y = pdo::parallel_do<rows2>([](const auto& xl) { return xl * 2.0; }, dX);
  pdo::backward(pdo::sum(y));
  CHECK(pdo::gather(dX.grad())(4, 3) == 2.0);
}

TEST_CASE("prefetch moves the next inputs to their places while the current step runs", "[parallel_do][prefetch]") {
  const auto w = random<double, 2>({4, 3}, 16);
  auto block = [](const auto& xl, const auto& wl) { return pdo::tanh(pdo::matmul(xl, wl)); };
  for (const auto& m : meshes()) {
    CAPTURE(m.describe());
    auto W = pdo::parameter(pdo::distribute<whole2>(m, w));
    // a loop over batches: the next one is cut onto the places' copy lanes while this one runs
    auto batch = [](std::size_t i) { return random<double, 2>({7, 4}, 100 + static_cast<unsigned>(i)); };
    auto next = pdo::prefetch<rows2>(m, batch(0));
    for (std::size_t i = 0; i < 4; ++i) {
      const auto X = next.get();
      STATIC_REQUIRE(std::is_same_v<std::remove_cvref_t<decltype(X)>, pdo::dtensor<double, 2, grid, rows2>>);
      if (i + 1 < 4) next = pdo::prefetch<rows2>(m, batch(i + 1));
      const auto y = pdo::parallel_do<rows2>(block, pdo::var(X), W);
      CHECK(pdo_test::close(pdo::gather(y.value()), pdo::eval(pdo::tanh(pdo::matmul(batch(i), w))), 1e-13));
      CHECK(pdo_test::close(pdo::gather(X), batch(i), 0));
    }
    CHECK(!next.valid());
    CHECK_THROWS_WITH(next.get(), Catch::Contains("nothing to take"));
  }
  // any work, on one place's copy lane
  const auto m = pdo::make_mesh<"x", "y">(pdo::cpu_places(2), {2, 1});
  auto made = pdo::prefetch(m.place(1), [] { return random<double, 2>({3, 2}, 17); });
  CHECK(pdo_test::close(made.get(), random<double, 2>({3, 2}, 17), 0));
  auto failing = pdo::prefetch(m.place(0), []() -> int { throw pdo::shape_error("no such file"); });
  CHECK_THROWS_AS(failing.get(), pdo::shape_error);
}

TEST_CASE("parallel_do over vars: a gradient of another shape than the result's is an error, not a crash",
          "[parallel_do][autograd][errors]") {
  const auto m = pdo::make_mesh<"x", "y">(pdo::cpu_places(2), {2, 1});
  auto dX = pdo::parameter(pdo::distribute<rows2>(m, random<double, 2>({6, 4}, 18)));
  const auto y = pdo::parallel_do<rows2>([](const auto& xl) { return xl * 3.0; }, dX);
  CHECK_THROWS_WITH(pdo::backward(y, pdo::distribute<rows2>(m, random<double, 2>({6, 5}, 19))),
                    Catch::Contains("backward") && Catch::Contains("[6, 5]") && Catch::Contains("[6, 4]"));
  CHECK_NOTHROW(pdo::backward(y, pdo::distribute<rows2>(m, random<double, 2>({6, 4}, 19))));
}
