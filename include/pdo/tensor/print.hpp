// pdo/tensor/print.hpp: writing a tensor to a std::ostream: its elements, nested by dim as
// NumPy prints an array. A dtensor is not written (its elements are on the places of its
// mesh): its operator<< is deleted.
#pragma once

#include <pdo/tensor/dtensor.hpp>
#include <pdo/tensor/tensor.hpp>

#include <cmath>
#include <cstddef>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>

namespace pdo {

namespace detail {

/// @brief A tensor of more elements than this is written with the middle of each long dim
/// left out ("..."), as NumPy does.
inline constexpr std::size_t elements_written_whole = 1000;
/// @brief How many indices of a dim are written at each end when its middle is left out.
inline constexpr std::size_t indices_at_each_end = 3;

/// @brief Writes to `os` element `i` of the host array at `data`.
using element_writer = void (*)(std::ostream& os, const void* data, std::size_t i);

/// @brief Writes the elements of the row-major host array at `data` of extents `shape`, from
/// dim `d` on (the block starting at element `first`), nested in brackets: the rows of the
/// last dim on one line each, a blank line between blocks of higher dims. With `elide`, a dim
/// of more than twice indices_at_each_end extents shows its first and last ones only.
PDO_NOINLINE inline void write_nested(std::ostream& os, std::span<const std::size_t> shape, std::size_t d, std::size_t first, bool elide,
                                      element_writer write, const void* data) {
  std::size_t inner = 1;
  for (std::size_t e = d + 1; e < shape.size(); ++e) inner *= shape[e];
  const std::size_t n = shape[d];
  const bool last = d + 1 == shape.size();
  const std::string between = last ? ", " : "," + std::string(shape.size() - d - 1, '\n') + std::string(d + 1, ' ');
  os << '[';
  for (std::size_t i = 0; i < n; ++i) {
    if (i > 0) os << between;
    if (elide && n > 2 * indices_at_each_end && i == indices_at_each_end) {
      os << "..." << between;
      i = n - indices_at_each_end;
    }
    if (last) write(os, data, first + i);
    else write_nested(os, shape, d + 1, first + i * inner, elide, write, data);
  }
  os << ']';
}

/// @brief Writes element `i` of a host array of T (a one-byte integer as a number, not a character).
template <class T>
void stream_element(std::ostream& os, const void* data, std::size_t i) {
  const T v = static_cast<const T*>(data)[i];
  if constexpr (sizeof(T) == 1) os << static_cast<int>(v);
  else if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(v)) os << "nan";  // whatever its sign bit, as NumPy and PyTorch write it (the stream may write -nan)
    else os << v;
  } else os << v;
}

}  // namespace detail

/// @brief Writes the elements of `t` to `os`, nested by dim as NumPy prints an array:
/// `[[1, 2, 3],\n [4, 5, 6]]`; a rank-0 tensor as its one value. The stream's format (its
/// precision, fixed or scientific) applies to each element. A tensor of more than 1000
/// elements shows the first and last 3 indices of each longer dim, "..." between them. A
/// tensor in a GPU's memory is copied to the host first; one with no elements (a 0 extent, or
/// no storage: default constructed) is written as `[]`, and NaN as `nan`.
template <class T, std::size_t Rank>
std::ostream& operator<<(std::ostream& os, const tensor<T, Rank>& t) {
  if (t.on_gpu()) return os << to_host(t);
  // no elements (a 0 extent, or no storage) is written as NumPy writes an empty array
  if (t.data() == nullptr || t.size() == 0) os << "[]";
  else if constexpr (Rank == 0) detail::stream_element<T>(os, t.data(), 0);
  else detail::write_nested(os, t.shape(), 0, 0, t.size() > detail::elements_written_whole, &detail::stream_element<T>, t.data());
  return os;
}

/// @brief Deleted: a dtensor's elements are on the places of its mesh. Deleted rather than an
/// error in its body, so that code asking whether a type can be written (a test framework's
/// printer) finds it cannot.
template <class T, std::size_t Rank, class Mesh, class Layout>
std::ostream& operator<<(std::ostream& os, const dtensor<T, Rank, Mesh, Layout>& x) = delete;  // pdo: a dtensor is not written to a stream: write pdo::gather(x), or x.describe()

}  // namespace pdo
