// tests/parallel_do.cpp: parallel_do against the single-place program, merges, and failures.
#include "support.hpp"

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
  // replicate merge needs equal shapes
  REQUIRE_THROWS_AS((pdo::parallel_do<pdo::layout<replicate, replicate>>([](const auto& s) { return s; },
                                                                          pdo::distribute<pdo::layout<split<"x">, replicate>>(
                                                                              mesh, pdo_test::iota_tensor<float, 2>({7, 2})))),
                    pdo::shape_error);
  // a split merge needs the even cut: place 0 returns 1 row, so 5 rows would be cut 2,2,1
  REQUIRE_THROWS_WITH((pdo::parallel_do<pdo::layout<split<"x">, replicate>>(
                          [](const pdo::tensor<float, 2>& s) {
                            return pdo::tensor<float, 2>({s(0, 0) == -3.5f ? 1 : s.extent(0), 2});
                          },
                          x)),
                      Catch::Contains("parallel_do") && Catch::Contains("cpu:0") && Catch::Contains("[1, 2]"));
}

TEST_CASE("dtensors of different meshes cannot be mixed", "[parallel_do][errors]") {
  const auto a = pdo_test::line_mesh(2), b = pdo_test::line_mesh(2);
  const auto xa = pdo::distribute<pdo::layout<split<"x">>>(a, pdo_test::iota_tensor<int, 1>({4}));
  const auto xb = pdo::distribute<pdo::layout<split<"x">>>(b, pdo_test::iota_tensor<int, 1>({4}));
  REQUIRE_THROWS_AS((pdo::parallel_do<pdo::layout<split<"x">>>([](const auto& u, const auto&) { return u; }, xa, xb)),
                    pdo::layout_error);
}
