// tests/test_matmul_mesh.cpp: matmul over meshes (1 to 4 places, 2 x 2; uneven shards) against the single-place result.
#include "support.hpp"

using pdo::replicate;
using pdo_test::check_on_meshes;
using pdo_test::close;
using pdo_test::random_tensor;
using pdo::split;

TEST_CASE("matmul over meshes: data, column and row parallel", "[expr][mesh]") {
  const auto x = random_tensor<double, 2>({9, 6}, 21);
  const auto w = random_tensor<double, 2>({6, 5}, 22);
  auto mm = [](const auto& p, const auto& q) { return pdo::matmul(p, q); };
  auto mlp = [](const auto& p, const auto& q) { return pdo::relu(pdo::matmul(p, q)) * 2.0; };
  using R = replicate;
  check_on_meshes<pdo::layout<split<"x">, R>, pdo::layout<R, R>>(mm, 1e-12, x, w);
  check_on_meshes<pdo::layout<R, R>, pdo::layout<R, split<"x">>>(mm, 1e-12, x, w);
  check_on_meshes<pdo::layout<R, split<"x">>, pdo::layout<split<"x">, R>>(mlp, 1e-12, x, w);
  check_on_meshes<pdo::layout<R, split<"x">>, pdo::layout<R, R>>(mlp, 1e-12, x, w);
  check_on_meshes<pdo::layout<R, R>, pdo::layout<split<"x">, R>>(mlp, 1e-12, x, w);
  check_on_meshes<pdo::layout<split<"x">, R>, pdo::layout<R, split<"x">>>(mm, 1e-12, x, w);
  const auto xb = random_tensor<double, 3>({5, 4, 6}, 23);
  check_on_meshes<pdo::layout<split<"x">, R, R>, pdo::layout<R, R>>(mlp, 1e-12, xb, w);
  // on a 2x2 mesh: rows on one axis, columns on the other
  const auto mesh = pdo_test::grid_mesh(2, 2);
  const auto y = pdo::eval(pdo::matmul(pdo::distribute<pdo::layout<split<"a">, R>>(mesh, x),
                                       pdo::distribute<pdo::layout<R, split<"b">>>(mesh, w)));
  static_assert(std::is_same_v<decltype(y)::layout_type, pdo::layout<split<"a">, split<"b">>>);
  CHECK(close(pdo::gather(y), pdo_test::naive_matmul(x, w), 1e-12));
  const auto z = pdo::eval(pdo::relu(pdo::matmul(pdo::distribute<pdo::layout<split<"a">, split<"b">>>(mesh, x),
                                                 pdo::distribute<pdo::layout<split<"b">, R>>(mesh, w))));
  static_assert(std::is_same_v<decltype(z)::layout_type, pdo::layout<split<"a">, R>>);
  CHECK(close(pdo::gather(z), pdo::eval(pdo::relu(pdo::matmul(x, w))), 1e-12));
}
