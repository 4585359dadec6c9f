// pdo/io/npy.hpp: single tensors in NumPy's .npy format (numpy.save / numpy.load), C order,
// little-endian.
#pragma once

#include <pdo/core/shape.hpp>
#include <pdo/io/file.hpp>
#include <pdo/tensor/tensor.hpp>

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

namespace pdo::io {

namespace detail {

/// @brief NumPy's type string of T ("<f4", "<i8", "|u1").
template <class T>
std::string npy_descr() {
  const char kind = std::is_floating_point_v<T> ? 'f' : (std::is_signed_v<T> ? 'i' : 'u');
  return std::string(1, sizeof(T) == 1 ? '|' : '<') + kind + std::to_string(sizeof(T));
}

/// @brief The three keys of an .npy header, read from its Python dict literal.
struct npy_header {
  std::string descr;
  bool fortran_order = false;
  std::vector<std::size_t> shape;
  std::size_t data_offset = 0;
};

inline npy_header parse_npy_header(const std::filesystem::path& path, const std::string& text, std::size_t data_offset) {
  auto bad = [&](const std::string& what) { return io_error("io: " + path.string() + ": not a valid .npy header (" + what + "): " + text); };
  auto value_of = [&](const std::string& key) {
    const auto k = text.find("'" + key + "'");
    if (k == std::string::npos) throw bad("no '" + key + "'");
    auto at = text.find(':', k);
    if (at == std::string::npos) throw bad("no value for '" + key + "'");
    ++at;
    while (at < text.size() && text[at] == ' ') ++at;
    return at;
  };
  npy_header h;
  h.data_offset = data_offset;
  std::size_t at = value_of("descr");
  if (at >= text.size() || (text[at] != '\'' && text[at] != '"')) throw bad("descr is not a string");
  const auto close = text.find(text[at], at + 1);
  if (close == std::string::npos) throw bad("descr is not closed");
  h.descr = text.substr(at + 1, close - at - 1);
  at = value_of("fortran_order");
  if (text.compare(at, 4, "True") == 0) h.fortran_order = true;
  else if (text.compare(at, 5, "False") != 0) throw bad("fortran_order is neither True nor False");
  at = value_of("shape");
  if (at >= text.size() || text[at] != '(') throw bad("shape is not a tuple");
  const auto end = text.find(')', at);
  if (end == std::string::npos) throw bad("shape is not closed");
  std::size_t i = at + 1;
  while (i < end) {
    while (i < end && (text[i] == ' ' || text[i] == ',')) ++i;
    if (i >= end) break;
    if (!std::isdigit(static_cast<unsigned char>(text[i]))) throw bad("an extent is not a number");
    std::size_t v = 0;
    while (i < end && std::isdigit(static_cast<unsigned char>(text[i]))) {
      const auto digit = static_cast<std::size_t>(text[i++] - '0');
      if (v > (std::numeric_limits<std::size_t>::max() - digit) / 10) throw bad("an extent is too large to count");
      v = v * 10 + digit;
    }
    h.shape.push_back(v);
  }
  return h;
}

inline npy_header read_npy_header(const file& f) {
  char head[12] = {};
  if (f.size() < 10) throw io_error("io: " + f.path().string() + ": not an .npy file (shorter than its magic string)");
  f.read_at(head, 10, 0);
  if (std::string(head, 6) != "\x93NUMPY") throw io_error("io: " + f.path().string() + ": not an .npy file (no \\x93NUMPY magic string)");
  const unsigned major = static_cast<unsigned char>(head[6]);
  std::size_t length = 0, at = 0;
  if (major == 1) {
    length = static_cast<unsigned char>(head[8]) | (static_cast<std::size_t>(static_cast<unsigned char>(head[9])) << 8);
    at = 10;
  } else if (major == 2 || major == 3) {
    f.read_at(head, 12, 0);
    std::uint32_t n = 0;
    std::memcpy(&n, head + 8, 4);
    length = n, at = 12;
  } else {
    throw io_error("io: " + f.path().string() + ": .npy format version " + std::to_string(major) + " (pdo reads versions 1 to 3)");
  }
  // the header's length is checked against the file's size before it is read (a damaged
  // length may claim any size)
  if (at > f.size() || length > f.size() - at)
    throw io_error("io: " + f.path().string() + ": truncated, or a damaged .npy header: its header claims " + std::to_string(length) +
                   " bytes after byte " + std::to_string(at) + ", the file has " + std::to_string(f.size()) + " bytes");
  std::string text(length, '\0');
  f.read_at(text.data(), length, at);
  return parse_npy_header(f.path(), text, at + length);
}

}  // namespace detail

/// @brief Writes `t` (any place's memory) to `path` as an .npy file, safely (a temporary
/// name, flushed, then renamed).
template <element T, std::size_t R>
void save_npy(const std::filesystem::path& path, const tensor<T, R>& t) {
  std::string dict = "{'descr': '" + detail::npy_descr<T>() + "', 'fortran_order': False, 'shape': (";
  for (std::size_t d = 0; d < R; ++d) dict += std::to_string(t.shape()[d]) + (R == 1 || d + 1 < R ? "," : "") + (d + 1 < R ? " " : "");
  dict += "), }";
  std::size_t total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict += '\n';
  std::string head = std::string("\x93NUMPY\x01\x00", 8);
  head += static_cast<char>(dict.size() & 0xff);
  head += static_cast<char>((dict.size() >> 8) & 0xff);
  head += dict;
  const tensor<T, R> host = t.on_gpu() ? to_host(t) : tensor<T, R>();
  const T* data = t.on_gpu() ? host.data() : t.data();
  detail::write_atomically(path, [&](detail::file& f) {
    f.write_at(head.data(), head.size(), 0);
    f.write_at(data, t.bytes(), head.size());
  });
}

/// @brief The .npy file `path` as a host tensor: its element type must be T and its rank R
/// (else a pdo::io_error naming the file, what it holds and what was asked).
template <element T, std::size_t R>
tensor<T, R> load_npy(const std::filesystem::path& path) {
  const detail::file f(path, detail::file::mode::read);
  const auto h = detail::read_npy_header(f);
  const std::string want = detail::npy_descr<T>();
  const bool same_type = h.descr == want || (sizeof(T) == 1 && h.descr.substr(1) == want.substr(1)) ||
                         (h.descr.size() == want.size() && h.descr[0] == '=' && h.descr.substr(1) == want.substr(1));
  if (!same_type)
    throw io_error("io: " + path.string() + ": holds elements of NumPy type '" + h.descr + "', the tensor asked for '" + want + "' (" +
                   std::string(detail::stored_dtype<T>()) + ")");
  if (h.fortran_order)
    throw io_error("io: " + path.string() + ": is in Fortran (column-major) order; save it from numpy.ascontiguousarray(...)");
  if (h.shape.size() != R)
    throw io_error("io: " + path.string() + ": holds a tensor of rank " + std::to_string(h.shape.size()) + " " +
                   pdo::detail::format_extents(h.shape) + ", the tensor asked for has rank " + std::to_string(R));
  shape_t<R> shape{};
  std::copy(h.shape.begin(), h.shape.end(), shape.begin());
  // the file's size is checked against the header before anything is allocated (a damaged
  // header may claim any shape)
  const bool empty = std::find(h.shape.begin(), h.shape.end(), std::size_t{0}) != h.shape.end();
  std::size_t bytes = empty ? 0 : sizeof(T);
  bool overflow = false;
  for (std::size_t e : h.shape) {
    if (empty) break;
    overflow = overflow || bytes > std::numeric_limits<std::size_t>::max() / e;
    if (!overflow) bytes *= e;
  }
  overflow = overflow || bytes > std::numeric_limits<std::size_t>::max() - h.data_offset;
  if (overflow || f.size() != h.data_offset + bytes)
    throw io_error("io: " + path.string() + ": " + std::to_string(f.size()) + " bytes, its header " + pdo::detail::format_extents(h.shape) +
                   " needs " + (overflow ? std::string("more than memory can address") : std::to_string(h.data_offset + bytes)) +
                   (overflow || f.size() < h.data_offset + bytes ? " (truncated, or a damaged header)" : ""));
  auto out = tensor<T, R>::on_host(shape);
  f.read_at(out.data(), out.bytes(), h.data_offset);
  return out;
}

}  // namespace pdo::io
