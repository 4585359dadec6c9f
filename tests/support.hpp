// tests/support.hpp: meshes, reference data and comparisons shared by the tests.
#pragma once

#include <pdo/pdo.hpp>

#include <catch2/catch.hpp>

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

}  // namespace pdo_test
