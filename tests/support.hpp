// tests/support.hpp: meshes, reference data and comparisons shared by the tests.
#pragma once

#include <pdo/pdo.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace pdo_test {

/// @brief A host tensor whose elements are distinct and exactly representable:
/// element i is (i % 1000) * 0.5 - 7 for floating types, i % 1000 - 7 for integers.
template <class T, std::size_t Rank>
pdo::tensor<T, Rank> iota_tensor(const pdo::shape_t<Rank>& shape) {
  pdo::tensor<T, Rank> t(shape);
  for (std::size_t i = 0; i < t.size(); ++i) {
    const auto v = static_cast<std::int64_t>(i % 1000) - 7;
    if constexpr (std::is_floating_point_v<T>) t.data()[i] = static_cast<T>(v) * T(0.5);
    else t.data()[i] = static_cast<T>(v);
  }
  return t;
}

/// @brief Random values in [-1, 1) (floating) or [-50, 50) (integral), from `seed`.
template <class T>
std::vector<T> random_values(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<T> v(n);
  for (auto& x : v) {
    if constexpr (std::is_floating_point_v<T>) x = static_cast<T>(std::uniform_real_distribution<double>(-1, 1)(gen));
    else x = static_cast<T>(std::uniform_int_distribution<int>(-50, 49)(gen));
  }
  return v;
}

template <class T, std::size_t Rank>
bool equal(const pdo::tensor<T, Rank>& a, const pdo::tensor<T, Rank>& b) {
  if (a.shape() != b.shape()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a.data()[i] != b.data()[i]) return false;
  return true;
}

/// @brief The mesh shapes every parallel result is checked on: 1, 2, 3, 4 places in a line.
inline const std::vector<std::size_t>& line_sizes() {
  static const std::vector<std::size_t> sizes{1, 2, 3, 4};
  return sizes;
}

/// @brief The piece member i of group g sends member j in all_to_all tests: uneven
/// (i + 2j + 1 elements), with values that name g, i and j.
inline std::vector<int> piece(std::size_t g, std::size_t i, std::size_t j) {
  return std::vector<int>(i + 2 * j + 1, static_cast<int>(1000 * g + 100 * i + j));
}

/// @brief What member j of group g receives from all_to_all among n members.
inline std::vector<int> pieces_to(std::size_t g, std::size_t j, std::size_t n) {
  std::vector<int> all;
  for (std::size_t i = 0; i < n; ++i) {
    const auto v = piece(g, i, j);
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

inline pdo::mesh<"x"> line_mesh(std::size_t n) { return pdo::make_mesh<"x">(pdo::cpu_places(n)); }

inline pdo::mesh<"a", "b"> grid_mesh(std::size_t a, std::size_t b) {
  return pdo::make_mesh<"a", "b">(pdo::cpu_places(a * b), {a, b});
}

/// @brief A host tensor of random values (see random_values), plus `shift`.
template <class T, std::size_t Rank>
pdo::tensor<T, Rank> random_tensor(const pdo::shape_t<Rank>& shape, unsigned seed, double shift = 0) {
  pdo::tensor<T, Rank> t(shape);
  const auto v = pdo_test::random_values<T>(t.size(), seed);
  for (std::size_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(v[i] + shift);
  return t;
}

/// @brief Same shape, and every element within `tol` relative to b (0: equal).
template <class T, std::size_t Rank>
bool close(const pdo::tensor<T, Rank>& a, const pdo::tensor<T, Rank>& b, double tol) {
  if (a.shape() != b.shape()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = a.data()[i], y = b.data()[i];
    if (std::abs(x - y) > tol * (1 + std::abs(y))) {
      UNSCOPED_INFO("element " << i << ": " << x << " vs " << y);
      return false;
    }
  }
  return true;
}

/// @brief The matrix product by three loops.
template <class T>
pdo::tensor<T, 2> naive_matmul(const pdo::tensor<T, 2>& a, const pdo::tensor<T, 2>& b) {
  pdo::tensor<T, 2> c({a.extent(0), b.extent(1)});
  for (std::size_t i = 0; i < a.extent(0); ++i)
    for (std::size_t j = 0; j < b.extent(1); ++j) {
      T acc{};
      for (std::size_t k = 0; k < a.extent(1); ++k) acc += a(i, k) * b(k, j);
      c(i, j) = acc;
    }
  return c;
}

/// @brief The steps evaluation of `e` ran on each of `places` places (recorded by `ran`) are
/// the steps of plan_of, in order, and the lines of explain are those steps, fused kernels
/// shown with the kernel they run in.
template <class Expr>
void check_plan_ran(const Expr& e, const pdo::detail::step_recorder& ran, std::size_t places) {
  constexpr auto plan = pdo::plan_of<Expr>();
  for (std::size_t p = 0; p < places; ++p) {
    const auto steps = ran.of(p);
    CAPTURE(p, pdo::explain(e));
    REQUIRE(steps.size() == plan.size);
    for (std::size_t i = 0; i < plan.size; ++i) {
      CAPTURE(i, std::string(plan.steps[i].op), std::string(steps[i].op), static_cast<int>(plan.steps[i].kind),
              static_cast<int>(steps[i].kind), plan.steps[i].fused);
      CHECK(pdo::same_work(steps[i], plan.steps[i]));
    }
  }
  const std::string text = pdo::explain(e);
  std::size_t line = 0, at = text.find('\n');
  for (const auto& s : plan) {
    if (s.kind == pdo::plan_step_kind::kernel && s.fused) continue;
    const std::string prefix = "  " + std::to_string(++line) + ". ";
    const std::size_t end = text.find('\n', at + 1);
    REQUIRE(end != std::string::npos);
    const std::string row = text.substr(at + 1, end - at - 1);
    CAPTURE(text, row);
    CHECK(row.rfind(prefix, 0) == 0);
    CHECK(row.find(std::string(s.op)) != std::string::npos);
    at = end;
  }
  CHECK(text.find('\n', at + 1) == std::string::npos);  // no line beyond the steps
}

/// @brief pdo::eval of `e`, checking that the steps that ran on each of `places` places are
/// those of plan_of and explain.
template <class Expr>
auto eval_checked(const Expr& e, std::size_t places = 1) {
  const pdo::detail::step_recorder ran;
  auto value = pdo::eval(e);
  check_plan_ran(e, ran, places);
  return value;
}

/// @brief Checks `expr` (a callable of tensors or dtensors) evaluated over dtensors in Layouts
/// against the same expression on the local tensors, on lines of 1 to 4 places and a 2 x 2
/// mesh; on one place and on every mesh, the steps that ran are those of plan_of and explain.
template <class... Layouts, class Expr, class... Hosts>
void check_on_meshes(Expr expr, double tol, const Hosts&... hosts) {
  const auto expected = eval_checked(expr(hosts...));
  auto on = [&](const auto& mesh) {
    CAPTURE(mesh.describe());
    // the expression reads the distributed operands by reference: evaluated and checked
    // within the full-expression that holds them
    const auto result = eval_checked(expr(pdo::distribute<Layouts>(mesh, hosts)...), mesh.size());
    CHECK(close(pdo::gather(result), expected, tol));
  };
  // one mesh type for all shapes (a line of n places is n x 1), so each expression is compiled once
  for (std::size_t n : pdo_test::line_sizes()) on(pdo::make_mesh<"x", "y">(pdo::cpu_places(n), {n, 1}));
  on(pdo::make_mesh<"x", "y">(pdo::cpu_places(4), {2, 2}));  // 2 x 2: each block twice, along "y"
}

}  // namespace pdo_test
