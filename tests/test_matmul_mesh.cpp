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

TEST_CASE("matmul over meshes reads a transposed stored shard in place where it is the block the product needs",
          "[expr][mesh]") {
  const auto x = random_tensor<double, 2>({9, 6}, 24);
  const auto w = random_tensor<double, 2>({6, 5}, 25);
  const auto xt = pdo::eval(pdo::transpose(x)), wt = pdo::eval(pdo::transpose(w));  // stored [6, 9] and [5, 6]
  auto right = [](const auto& p, const auto& q) { return pdo::matmul(p, pdo::transpose(q)); };
  auto left = [](const auto& p, const auto& q) { return pdo::relu(pdo::matmul(pdo::transpose(p), q)) * 2.0; };
  auto both = [](const auto& p, const auto& q) { return pdo::relu(pdo::matmul(pdo::transpose(p), pdo::transpose(q))); };
  using R = replicate;
  // rows x replicated weight; K split on both (a partial product, then its sum); N split
  check_on_meshes<pdo::layout<split<"x">, R>, pdo::layout<R, R>>(right, 1e-12, x, wt);
  check_on_meshes<pdo::layout<R, split<"x">>, pdo::layout<R, split<"x">>>(right, 1e-12, x, wt);
  check_on_meshes<pdo::layout<R, R>, pdo::layout<split<"x">, R>>(right, 1e-12, x, wt);
  check_on_meshes<pdo::layout<R, split<"x">>, pdo::layout<R, R>>(left, 1e-12, xt, w);
  check_on_meshes<pdo::layout<split<"x">, R>, pdo::layout<split<"x">, R>>(left, 1e-12, xt, w);
  check_on_meshes<pdo::layout<R, split<"x">>, pdo::layout<split<"x">, R>>(both, 1e-12, xt, wt);
  check_on_meshes<pdo::layout<split<"x">, R>, pdo::layout<R, split<"x">>>(both, 1e-12, xt, wt);
  // extents under the places' count: empty blocks of M, K and N
  const auto thin = random_tensor<double, 2>({2, 3}, 26), thin_wt = random_tensor<double, 2>({2, 3}, 27);
  check_on_meshes<pdo::layout<split<"x">, R>, pdo::layout<R, R>>(right, 1e-12, thin, thin_wt);
  check_on_meshes<pdo::layout<R, split<"x">>, pdo::layout<R, split<"x">>>(right, 1e-12, thin, thin_wt);
  check_on_meshes<pdo::layout<R, R>, pdo::layout<split<"x">, R>>(right, 1e-12, thin, thin_wt);
  check_on_meshes<pdo::layout<R, split<"x">>, pdo::layout<split<"x">, R>>(both, 1e-12, pdo::eval(pdo::transpose(thin)), thin_wt);
  // a transposed shard that is not the block the product needs (K split on the axis that
  // splits M) is transposed and gathered first
  check_on_meshes<pdo::layout<split<"x">, R>, pdo::layout<R, split<"x">>>(right, 1e-12, x, wt);

  using mesh_t = decltype(pdo_test::grid_mesh(2, 2));
  using rows = pdo::dtensor<double, 2, mesh_t, pdo::layout<split<"a">, R>>;
  using whole = pdo::dtensor<double, 2, mesh_t, pdo::layout<R, R>>;
  using k_split = pdo::dtensor<double, 2, mesh_t, pdo::layout<R, split<"a">>>;
  using in_place = decltype(pdo::matmul(std::declval<const rows&>(), pdo::transpose(std::declval<const whole&>())));
  STATIC_REQUIRE(pdo::plan_of<in_place>().size == 2);  // the transpose, fused, and the product
  STATIC_REQUIRE(pdo::plan_of<in_place>().kernels() == 1);
  // K split over the axis that splits the rows: the transposed block is not the one needed
  using moved = decltype(pdo::matmul(std::declval<const rows&>(), pdo::transpose(std::declval<const k_split&>())));
  STATIC_REQUIRE(pdo::plan_of<moved>().kernels() == 2);

  // on a 2x2 mesh: rows on one axis, the stored weight's rows (the product's columns) on the other
  const auto mesh = pdo_test::grid_mesh(2, 2);
  const auto y = pdo::eval(pdo::matmul(pdo::distribute<pdo::layout<split<"a">, R>>(mesh, x),
                                       pdo::transpose(pdo::distribute<pdo::layout<split<"b">, R>>(mesh, wt))));
  static_assert(std::is_same_v<decltype(y)::layout_type, pdo::layout<split<"a">, split<"b">>>);
  CHECK(close(pdo::gather(y), pdo_test::naive_matmul(x, w), 1e-12));
}
