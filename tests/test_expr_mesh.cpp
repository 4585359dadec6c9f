// tests/test_expr_mesh.cpp: expressions over meshes (1 to 4 places, 2 x 2; uneven shards) against the single-place result.
#include "support.hpp"

using pdo::replicate;
using pdo_test::check_on_meshes;
using pdo_test::close;
using pdo_test::random_tensor;
using pdo::split;

TEST_CASE("elementwise expressions over meshes equal the single-place result", "[expr][mesh]") {
  const auto a = random_tensor<double, 2>({10, 7}, 11);
  const auto b = random_tensor<double, 2>({10, 7}, 12);
  const auto bias = random_tensor<double, 1>({7}, 13);
  using rows = pdo::layout<split<"x">, replicate>;
  using cols = pdo::layout<replicate, split<"x">>;
  using full = pdo::layout<replicate, replicate>;
  auto f = [](const auto& x, const auto& y, const auto& z) { return pdo::relu(x * y + z) - pdo::tanh(x) * 0.5; };
  check_on_meshes<rows, rows, pdo::layout<replicate>>(f, 1e-14, a, b, bias);
  // operands in different layouts: the output takes the first's split; replicated ones are read in place
  check_on_meshes<rows, full, pdo::layout<replicate>>(f, 1e-14, a, b, bias);
  check_on_meshes<full, rows, pdo::layout<split<"x">>>(f, 1e-14, a, b, bias);
  check_on_meshes<rows, cols, pdo::layout<replicate>>(f, 1e-14, a, b, bias);
  // every other elementwise op, through one fused expression (a left-deep chain of 20 ops:
  // under nvcc, a check that eval's node stays fast to compile)
  auto all_ops = [](const auto& x, const auto& y, const auto& z) {
    return pdo::where(pdo::greater(x, y), pdo::exp(x) / pdo::sqrt(y * y + 1.0), pdo::log(y * y + 1.0)) + pdo::sigmoid(x) -
           pdo::gelu(y) + pdo::maximum(x, z) * pdo::minimum(y, z) + pdo::less_equal(x, 0.0) - pdo::not_equal(y, z) +
           pdo::equal(x, x) * pdo::less(y, x) - pdo::greater_equal(z, y);
  };
  check_on_meshes<rows, cols, pdo::layout<replicate>>(all_ops, 1e-13, a, b, bias);
  // a partial operand: linear ops keep it partial, relu reduces it
  check_on_meshes<full::partial<"x">, full::partial<"x">, pdo::layout<replicate>>(f, 1e-14, a, b, bias);
  check_on_meshes<full::partial<"x">, full, pdo::layout<replicate>>(
      [](const auto& x, const auto& y, const auto& z) { return (x + x) * y - z; }, 1e-14, a, b, bias);
  // cast: every dim keeps its split; a partial operand is summed before it is converted
  auto converted = [](const auto& x, const auto& y, const auto& z) {
    return pdo::cast<double>(pdo::cast<int>(x * 10.0)) + pdo::cast<double>(pdo::cast<float>(y)) * z;
  };
  check_on_meshes<rows, cols, pdo::layout<replicate>>(converted, 1e-14, a, b, bias);
  check_on_meshes<full::partial<"x">, rows, pdo::layout<split<"x">>>(converted, 1e-14, a, b, bias);
}

TEST_CASE("a unit dim that broadcasts where the result is split is a layout_error naming the fix", "[expr][mesh]") {
  const auto m = pdo::make_mesh<"a", "b">(pdo::cpu_places(4), {2, 2});
  const auto h = random_tensor<double, 2>({1, 5}, 41);
  const auto x = pdo::distribute<pdo::layout<split<"a">, split<"b">>>(m, h);
  auto expect_refusal = [](auto build, std::string_view op, std::string_view extent) {
    try {
      (void)pdo::gather(pdo::eval(build()));
      FAIL("no error");
    } catch (const pdo::layout_error& e) {
      CHECK_THAT(e.what(), Catch::Contains(std::string(op) + ": dim ") && Catch::Contains("extent 1 and broadcasts to extent " + std::string(extent)) &&
                               Catch::Contains("splits on \"b\"") && Catch::Contains("pdo::redistribute"));
    }
  };
  // [1, 5] - [1] (NumPy's broadcasting, as on one place): max<1>'s result, split on "a", would take
  // the result's split on "b" in the dim that stretches
  expect_refusal([&] { return x - pdo::max<1>(x); }, "subtract", "5");
  // the fix the message names: keep the unit dim (unsqueeze) in a layout that replicates it
  const auto want = pdo::eval(h - pdo::max<1>(h));
  CHECK(close(pdo::gather(pdo::eval(x - pdo::unsqueeze<1>(pdo::max<1>(x)))), want, 0));
  // a [7, 1] operand split on "b" in its unit dim: replicating that dim first makes it broadcast
  const auto g = random_tensor<double, 2>({7, 5}, 42), c = random_tensor<double, 2>({7, 1}, 43);
  using col_split = pdo::layout<replicate, split<"b">>;
  const auto gd = pdo::distribute<col_split>(m, g), cd = pdo::distribute<col_split>(m, c);
  expect_refusal([&] { return gd + cd; }, "add", "5");
  CHECK(close(pdo::gather(pdo::eval(gd + pdo::redistribute<pdo::layout<replicate, replicate>>(cd))), pdo::eval(g + c), 0));
}

TEST_CASE("reductions, softmax and losses over meshes", "[expr][mesh]") {
  const auto a = random_tensor<double, 2>({10, 7}, 31);
  using rows = pdo::layout<split<"x">, replicate>;
  using cols = pdo::layout<replicate, split<"x">>;
  check_on_meshes<rows>([](const auto& x) { return pdo::sum<0>(x); }, 1e-12, a);
  check_on_meshes<rows>([](const auto& x) { return pdo::mean<1>(x); }, 1e-12, a);
  check_on_meshes<cols>([](const auto& x) { return pdo::max<1>(x); }, 0, a);
  check_on_meshes<rows>([](const auto& x) { return pdo::max<0>(x) + pdo::sum<0>(x); }, 1e-12, a);
  check_on_meshes<cols>([](const auto& x) { return pdo::mean(x) * 2.0; }, 1e-12, a);
  check_on_meshes<rows>([](const auto& x) { return pdo::max(x); }, 0, a);
  check_on_meshes<rows>([](const auto& x) { return pdo::softmax(x); }, 1e-12, a);
  check_on_meshes<cols>([](const auto& x) { return pdo::log_softmax(x); }, 1e-12, a);
  check_on_meshes<rows>([](const auto& x) { return pdo::transpose(x) * 3.0; }, 0, a);
  check_on_meshes<rows>([](const auto& x) { return pdo::reshape(x, {10, 7, 1}); }, 0, a);
  // a split dim (or one before it) is kept by a reshape, and the error says which dim is not
  const auto by_cols = pdo::distribute<cols>(pdo::make_mesh<"x">(pdo::cpu_places(2)), a);
  CHECK_THROWS_WITH(pdo::reshape(by_cols, {5, 2, 7}), Catch::Contains("to [5, 2, 7]: dim 0 must be kept") && Catch::Contains("(dim 1)"));
  pdo::tensor<double, 1> labels({10}, {0, 1, 2, 3, 4, 5, 6, 0, 1, 2});
  check_on_meshes<rows, pdo::layout<split<"x">>>([](const auto& x, const auto& y) { return pdo::cross_entropy(x, y); }, 1e-12, a, labels);
  check_on_meshes<cols, pdo::layout<replicate>>([](const auto& x, const auto& y) { return pdo::cross_entropy(x, y); }, 1e-12, a,
                                                labels);
  // mse of tensors and dtensors (no var): mean((a - b)²), b broadcast as in a - b
  const auto b = random_tensor<double, 2>({10, 7}, 32);
  const auto column = random_tensor<double, 2>({10, 1}, 33);
  double by_hand = 0, by_hand_column = 0, by_hand_number = 0;
  for (std::size_t i = 0; i < 10; ++i)
    for (std::size_t j = 0; j < 7; ++j) {
      by_hand += (a(i, j) - b(i, j)) * (a(i, j) - b(i, j)) / 70;
      by_hand_column += (a(i, j) - column(i, 0)) * (a(i, j) - column(i, 0)) / 70;
      by_hand_number += (a(i, j) - 2) * (a(i, j) - 2) / 70;
    }
  CHECK(pdo::eval(pdo::mse(a, b)).data()[0] == Approx(by_hand).epsilon(1e-13));
  CHECK(pdo::eval(pdo::mse(a, 2.0)).data()[0] == Approx(by_hand_number).epsilon(1e-13));
  CHECK(pdo::eval(pdo::mse(2.0, a)).data()[0] == Approx(by_hand_number).epsilon(1e-13));
  CHECK(pdo::eval(pdo::mse(a, column)).data()[0] == Approx(by_hand_column).epsilon(1e-13));
  CHECK(pdo::eval(pdo::mse(a, b)).data()[0] == pdo::mse(pdo::var(a), pdo::var(b)).value().data()[0]);
  check_on_meshes<rows, rows>([](const auto& x, const auto& y) { return pdo::mse(x, y); }, 1e-12, a, b);
  check_on_meshes<cols, cols>([](const auto& x, const auto& y) { return pdo::mse(x, y) * 2.0; }, 1e-12, a, b);
  const auto wrong = random_tensor<double, 2>({9, 7}, 34);
  CHECK_THROWS_WITH(pdo::mse(a, wrong), Catch::Contains("mse: subtract") && Catch::Contains("[10, 7]") && Catch::Contains("[9, 7]"));
}
