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

/// @brief The value of `expr(a, b, ...)` evaluated on dtensors laid out as given, gathered,
/// against the same expression on the local tensors, on lines of 1 to 4 places and a 2 x 2 mesh.
template <class... Layouts, class Expr, class... Hosts>
void check_on_meshes(Expr expr, double tol, const Hosts&... hosts) {
  const auto expected = pdo::eval(expr(hosts...));
  auto on = [&](const auto& mesh) {
    CAPTURE(mesh.describe());
    const auto result = pdo::eval(expr(pdo::distribute<Layouts>(mesh, hosts)...));
    CHECK(close(pdo::gather(result), expected, tol));
  };
  // one mesh type for all shapes (a line of n places is n x 1), so each expression is compiled once
  for (std::size_t n : pdo_test::line_sizes()) on(pdo::make_mesh<"x", "y">(pdo::cpu_places(n), {n, 1}));
  on(pdo::make_mesh<"x", "y">(pdo::cpu_places(4), {2, 2}));  // 2 x 2: each block twice, along "y"
}

}  // namespace pdo_test
