// pdo/io/safetensors.hpp: the safetensors format (an 8-byte little-endian header length, a
// JSON header naming each tensor's type, shape and byte range, then the raw little-endian
// data), so that weights move between PyTorch and pdo; and a module's parameters saved to
// or loaded from such a file by name.
#pragma once

#include <pdo/core/shape.hpp>
#include <pdo/io/file.hpp>
#include <pdo/nn/layers.hpp>
#include <pdo/nn/module.hpp>
#include <pdo/tensor/tensor.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <limits>
#include <map>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo::io {

namespace detail {

/// @brief The safetensors name of T ("F32", "I64", "U8").
template <class T>
std::string safetensors_dtype() {
  const char kind = std::is_floating_point_v<T> ? 'F' : (std::is_signed_v<T> ? 'I' : 'U');
  return std::string(1, kind) + std::to_string(8 * sizeof(T));
}

/// @brief A type of the safetensors format: its name, the bytes of one element, and whether
/// pdo reads it into its element types (converting: F64, F32, I64 to I8, U64 to U8; not F16,
/// BF16, F8 or BOOL, which have no pdo element type).
struct safetensors_type {
  std::string_view name;
  std::size_t bytes;
  bool readable;
};
inline constexpr std::array<safetensors_type, 15> safetensors_types{{{"F64", 8, true},
                                                                    {"F32", 4, true},
                                                                    {"F16", 2, false},
                                                                    {"BF16", 2, false},
                                                                    {"F8_E4M3", 1, false},
                                                                    {"F8_E5M2", 1, false},
                                                                    {"I64", 8, true},
                                                                    {"I32", 4, true},
                                                                    {"I16", 2, true},
                                                                    {"I8", 1, true},
                                                                    {"U64", 8, true},
                                                                    {"U32", 4, true},
                                                                    {"U16", 2, true},
                                                                    {"U8", 1, true},
                                                                    {"BOOL", 1, false}}};

/// @brief The format's type named `dtype`; null for a name that is not one of them.
inline const safetensors_type* find_safetensors_type(std::string_view dtype) {
  for (const auto& t : safetensors_types)
    if (t.name == dtype) return &t;
  return nullptr;
}

/// @brief The size of one element of the safetensors type `dtype`, 0 for a name that is not
/// one of the format's types.
inline std::size_t safetensors_element_bytes(const std::string& dtype) {
  const auto* t = find_safetensors_type(dtype);
  return t == nullptr ? 0 : t->bytes;
}

/// @brief Whether pdo reads elements of the safetensors type `dtype` into its element types.
inline bool safetensors_readable(const std::string& dtype) {
  const auto* t = find_safetensors_type(dtype);
  return t != nullptr && t->readable;
}

/// @brief The io_error for reading tensor `name` of the file `path`, of the type `dtype`,
/// which pdo does not read.
inline io_error unreadable_dtype(const std::filesystem::path& path, const std::string& name, const std::string& dtype) {
  std::string readable;
  for (const auto& t : safetensors_types)
    if (t.readable) readable += (readable.empty() ? "" : ", ") + std::string(t.name);
  return io_error("io: " + path.string() + ": \"" + name + "\" has type " + dtype + ", which pdo does not read (it reads " + readable +
                  "; convert it in PyTorch first, tensor.float()); the file's other tensors can be read");
}

/// @brief Whether T holds the value `v` (for a floating-point T, any value of a floating-point
/// or integer type: it rounds; for an integer T, an integer in its range, or a finite
/// floating-point value whose integer part is in its range, which the conversion truncates to).
template <class T, class S>
bool holds_value(S v) {
  if constexpr (std::is_floating_point_v<T>) {
    return true;
  } else if constexpr (std::is_floating_point_v<S>) {
    const auto x = static_cast<long double>(v);  // exact for every value of S; T's bounds, too
    return std::isfinite(x) && x > static_cast<long double>(std::numeric_limits<T>::min()) - 1 &&
           x < static_cast<long double>(std::numeric_limits<T>::max()) + 1;
  } else {
    return std::in_range<T>(v);
  }
}

/// @brief Elements of the safetensors type `dtype` at `src` converted to T; an element T cannot
/// hold (an integer out of T's range, a NaN, infinite or too large float for an integer T) is
/// an io_error beginning with `where`, its index and value named, rather than a value of T.
template <class T>
void convert_from(const std::string& dtype, const unsigned char* src, T* out, std::size_t n, const std::string& where) {
  auto each = [&]<class S>(S) {
    for (std::size_t i = 0; i < n; ++i) {
      S v;
      std::memcpy(&v, src + i * sizeof(S), sizeof(S));
      if (!holds_value<T>(v)) {
        std::ostringstream value;
        value << +v;
        throw io_error(where + "element " + std::to_string(i) + " is " + value.str() + ", which " + safetensors_dtype<T>() +
                       " cannot hold (converting " + dtype + " to " + safetensors_dtype<T>() + ")");
      }
      out[i] = static_cast<T>(v);
    }
  };
  if (dtype == "F64") each(double{});
  else if (dtype == "F32") each(float{});
  else if (dtype == "I64") each(std::int64_t{});
  else if (dtype == "I32") each(std::int32_t{});
  else if (dtype == "I16") each(std::int16_t{});
  else if (dtype == "I8") each(std::int8_t{});
  else if (dtype == "U64") each(std::uint64_t{});
  else if (dtype == "U32") each(std::uint32_t{});
  else if (dtype == "U16") each(std::uint16_t{});
  else each(std::uint8_t{});
}

}  // namespace detail

/// @brief One tensor of a safetensors file, as its header describes it.
struct safetensors_entry {
  std::string dtype;                ///< "F32", "I64", ...
  std::vector<std::size_t> shape;  ///< extents, one per dim (empty for a scalar)
  /// @brief Where its bytes begin, counted from the start of the data (after the header).
  std::size_t begin = 0, end = 0;
  /// @var end
  /// @brief Where its bytes end (exclusive), counted as `begin`.
};

/// @brief A safetensors file opened to read. The header is checked when it is opened
/// (lengths, types, byte ranges inside the file and not overlapping); each tensor is read
/// when asked for.
class safetensors_reader {
 public:
  /// @brief Opens `path` and checks its header; a pdo::io_error saying what is wrong otherwise.
  explicit safetensors_reader(const std::filesystem::path& path) : f_(path, detail::file::mode::read) {
    const std::string invalid = "io: " + path.string() + ": not a valid safetensors file: ";
    auto bad = [&](const std::string& what) { return io_error(invalid + what); };
    const std::size_t size = f_.size();
    if (size < 8) throw bad("shorter than its 8-byte header length");
    std::uint64_t n = 0;
    f_.read_at(&n, 8, 0);
    if (n > size - 8) throw bad("its header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(size) + " bytes)");
    std::string text(n, '\0');
    f_.read_at(text.data(), n, 8);
    data_at_ = 8 + n;
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw bad(std::string("its header is not JSON: ") + e.what());
    }
    if (!header.is_object()) throw bad("its header is not a JSON object");
    std::vector<std::pair<std::size_t, std::size_t>> ranges;
    std::string entry_op = invalid;  // invalid + "\"name\"", the op of an entry's extents check: one buffer for every entry
    for (const auto& [name, e] : header.items()) {
      if (name == "__metadata__") {
        if (!e.is_object()) throw bad("__metadata__ is not an object");
        for (const auto& [k, v] : e.items()) {
          if (!v.is_string()) throw bad("__metadata__[\"" + k + "\"] is not a string");
          metadata_[k] = v.get<std::string>();
        }
        continue;
      }
      safetensors_entry t;
      try {
        t.dtype = e.at("dtype").get<std::string>();
        const auto& shape = e.at("shape");
        if (!shape.is_array()) throw bad("\"" + name + "\": its shape is not a list of extents");
        for (const auto& x : shape) {
          if (!x.is_number_unsigned()) throw bad("\"" + name + "\": its shape " + shape.dump() + " has an extent that is not a whole number >= 0");
          t.shape.push_back(x.get<std::size_t>());
        }
        const auto& offsets = e.at("data_offsets");
        if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
          throw bad("\"" + name + "\": data_offsets " + offsets.dump() + " is not a pair of whole numbers >= 0");
        t.begin = offsets[0].get<std::size_t>();
        t.end = offsets[1].get<std::size_t>();
      } catch (const nlohmann::json::exception& x) {
        throw bad("\"" + name + "\": " + x.what());
      }
      const std::size_t element = detail::safetensors_element_bytes(t.dtype);
      if (element == 0) throw bad("\"" + name + "\" has type " + t.dtype + ", which is not a safetensors type");
      entry_op.resize(invalid.size());
      entry_op.append("\"").append(name).append("\"");
      const std::size_t bytes = pdo::detail::checked_volume(t.shape, entry_op, element, pdo::error_kind::io) * element;
      if (t.end < t.begin)
        throw bad("\"" + name + "\": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "] end before they begin");
      if (t.end - t.begin != bytes)
        throw bad("\"" + name + "\": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "] hold " +
                  std::to_string(t.end - t.begin) + " bytes, its shape " + pdo::detail::format_extents(t.shape) + " needs " + std::to_string(bytes));
      if (t.end > size - data_at_)
        throw bad("\"" + name + "\": its data runs past the end of the file (truncated: " + std::to_string(size - data_at_) + " bytes of data)");
      ranges.emplace_back(t.begin, t.end);
      entries_[name] = std::move(t);
    }
    std::sort(ranges.begin(), ranges.end());
    for (std::size_t i = 1; i < ranges.size(); ++i)
      if (ranges[i].first < ranges[i - 1].second) throw bad("two tensors' data overlap");
  }

  /// @brief The file's path, as given.
  [[nodiscard]] const std::filesystem::path& path() const { return f_.path(); }
  /// @brief The names of its tensors, sorted.
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [k, v] : entries_) out.push_back(k);
    return out;
  }
  /// @brief Whether the file holds a tensor named `name`.
  [[nodiscard]] bool contains(const std::string& name) const { return entries_.contains(name); }
  /// @brief The header's entry of `name` (an io_error listing the names when there is none).
  [[nodiscard]] const safetensors_entry& entry(const std::string& name) const {
    const auto it = entries_.find(name);
    if (it == entries_.end())
      throw io_error("io: " + path().string() + ": no tensor named \"" + name +
                     "\" (it holds: " + detail::listed_names(entries_, [](const auto& e) -> const std::string& { return e.first; }) + ")");
    return it->second;
  }
  /// @brief The header's __metadata__ strings, by key (empty when it has none).
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const { return metadata_; }

  /// @brief Tensor `name` as a host tensor of element type T: stored as T, or converted from
  /// another stored type when `convert`; its rank must be R.
  template <element T, std::size_t R>
  [[nodiscard]] tensor<T, R> get(const std::string& name, bool convert = false) const {
    const auto& e = entry(name);
    if (!detail::safetensors_readable(e.dtype)) throw detail::unreadable_dtype(path(), name, e.dtype);
    if (e.shape.size() != R)
      throw io_error("io: " + path().string() + ": \"" + name + "\" is " + e.dtype + pdo::detail::format_extents(e.shape) + ", of rank " +
                     std::to_string(e.shape.size()) + ", not " + std::to_string(R));
    if (!convert && e.dtype != detail::safetensors_dtype<T>())
      throw io_error("io: " + path().string() + ": \"" + name + "\" holds " + e.dtype + " elements, the tensor asked for " +
                     detail::safetensors_dtype<T>());
    shape_t<R> shape{};
    std::copy(e.shape.begin(), e.shape.end(), shape.begin());
    auto out = tensor<T, R>::on_host(shape);
    read_into(name, out.data(), out.size());
    return out;
  }

  /// @brief The `n` elements of tensor `name` into `out`, converted to T from its stored type.
  template <element T>
  void read_into(const std::string& name, T* out, std::size_t n) const {
    const auto& e = entry(name);
    if (!detail::safetensors_readable(e.dtype)) throw detail::unreadable_dtype(path(), name, e.dtype);
    const std::size_t bytes = e.end - e.begin;
    if (bytes != n * detail::safetensors_element_bytes(e.dtype))
      throw io_error("io: " + path().string() + ": \"" + name + "\" holds " + std::to_string(bytes / detail::safetensors_element_bytes(e.dtype)) +
                     " elements, " + std::to_string(n) + " asked for");
    if (e.dtype == detail::safetensors_dtype<T>()) {
      f_.read_at(out, bytes, data_at_ + e.begin);
    } else {
      std::vector<unsigned char> raw(bytes);
      f_.read_at(raw.data(), bytes, data_at_ + e.begin);
      detail::convert_from(e.dtype, raw.data(), out, n, "io: " + path().string() + ": \"" + name + "\": ");
    }
  }

 private:
  detail::file f_;
  std::size_t data_at_ = 0;
  std::map<std::string, safetensors_entry> entries_;
  std::map<std::string, std::string> metadata_;
};

/// @brief Named tensors gathered to be written as one safetensors file (it copies them).
class safetensors_writer {
 public:
  /// @brief A copy of `t` (copied down first if it is in a GPU's memory) under `name`; a pdo::io_error for an
  /// empty name, "__metadata__" or a name already added.
  template <element T, std::size_t R>
  safetensors_writer& add(const std::string& name, const tensor<T, R>& t) {
    return add_raw(name, detail::safetensors_dtype<T>(), std::vector<std::size_t>(t.shape().begin(), t.shape().end()),
                   t.on_gpu() ? to_host(t).data() : t.data(), t.bytes());
  }
  /// @brief `bytes` of host memory holding a tensor of `shape` of the safetensors type `dtype`
  /// (any of the format's types: "F16" too); a pdo::io_error for a type the format does not
  /// have, or a number of bytes that is not the shape's.
  safetensors_writer& add_raw(const std::string& name, const std::string& dtype, std::vector<std::size_t> shape, const void* data,
                              std::size_t bytes) {
    if (name.empty() || name == "__metadata__") throw io_error("io: safetensors: \"" + name + "\" cannot name a tensor");
    if (tensors_.contains(name)) throw io_error("io: safetensors: two tensors are named \"" + name + "\"");
    const std::size_t element = detail::safetensors_element_bytes(dtype);
    if (element == 0) throw io_error("io: safetensors: \"" + name + "\": " + dtype + " is not a safetensors type");
    // extents too large to address: an error of the file being made
    const std::size_t want = pdo::detail::checked_volume(shape, "io: safetensors: \"" + name + "\"", element, pdo::error_kind::io) * element;
    if (bytes != want)
      throw io_error("io: safetensors: \"" + name + "\": " + std::to_string(bytes) + " bytes given, its shape " + dtype +
                     pdo::detail::format_extents(shape) + " needs " + std::to_string(want));
    const auto* p = static_cast<const unsigned char*>(data);
    tensors_[name] = {dtype, std::move(shape), std::vector<unsigned char>(p, p + bytes)};
    return *this;
  }
  /// @brief Free-form strings kept in the header's __metadata__.
  safetensors_writer& metadata(const std::string& key, const std::string& value) {
    metadata_[key] = value;
    return *this;
  }
  /// @brief Writes the file safely (a temporary name, flushed, then renamed): tensors in the
  /// order of their names, the header padded with spaces to a multiple of 8 bytes.
  void write(const std::filesystem::path& path) const {
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!metadata_.empty()) header["__metadata__"] = metadata_;
    std::size_t at = 0;
    for (const auto& [name, t] : tensors_) {
      header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes.size()}}};
      at += t.bytes.size();
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    const std::uint64_t n = text.size();
    detail::write_atomically(path, [&](detail::file& f) {
      f.write_at(&n, 8, 0);
      f.write_at(text.data(), text.size(), 8);
      std::size_t offset = 8 + text.size();
      for (const auto& [name, t] : tensors_) {
        f.write_at(t.bytes.data(), t.bytes.size(), offset);
        offset += t.bytes.size();
      }
    });
  }

 private:
  struct stored {
    std::string dtype;
    std::vector<std::size_t> shape;
    std::vector<unsigned char> bytes;
  };
  std::map<std::string, stored> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// @brief Sets every parameter of `model` (named as nn::parameters_of names them: "0.weight")
/// from the tensor of that name in the safetensors file `path`, converting its element type
/// (a float32 file loads into a double model). A missing name or another shape is a
/// pdo::io_error naming the parameter, the file and both shapes, before any parameter is set.
template <class T, class M>
void load_parameters(M& model, const std::filesystem::path& path, const std::string& prefix = "") {
  const safetensors_reader file(path);
  const auto params = nn::parameters_of<T>(model, prefix);
  for (const auto& p : params) {
    const auto& e = file.entry(p.name());
    if (!detail::safetensors_readable(e.dtype)) throw detail::unreadable_dtype(file.path(), p.name(), e.dtype);
    if (e.shape != p.extents()) {
      const auto& want = p.extents();
      const bool transposed = want.size() == 2 && e.shape.size() == 2 && e.shape[0] == want[1] && e.shape[1] == want[0];
      throw io_error("io: " + path.string() + ": \"" + p.name() + "\" is " + e.dtype + pdo::detail::format_extents(e.shape) +
                     ", the parameter is " + p.shape_text() +
                     (transposed ? " (its transpose: a PyTorch nn.Linear weight is [out, in], a pdo::nn::linear weight [in, out])" : ""));
    }
  }
  for (const auto& p : params) {
    auto host = tensor<T, 1>::on_host({p.size_global()});
    file.read_into(p.name(), host.data(), host.size());
    p.assign_flat(host.data());
  }
}

/// @brief Writes every parameter of `model` (its global value: dtensor parameters are
/// gathered) to the safetensors file `path`, under the names nn::parameters_of gives. Every
/// process calls it. When dtensor parameters span several processes, the process of their
/// mesh's first place writes the file (as a checkpoint's save) and every process returns once
/// it is written; its failure is an error on every process. A model of local parameters is
/// written by each process that saves it (each through a temporary file of its own, so
/// processes writing one path leave one complete file).
template <class T, class M>
void save_parameters(const std::filesystem::path& path, const M& model, const std::string& prefix = "") {
  const auto params = nn::parameters_of<T>(model, prefix);
  safetensors_writer w;
  for (const auto& p : params) {
    const auto values = p.global_values();
    w.add_raw(p.name(), detail::safetensors_dtype<T>(), p.extents(), values.data(), values.bytes());
  }
  const auto spanning = std::find_if(params.begin(), params.end(), [](const auto& p) { return p.distributed(); });
  if (spanning == params.end()) return w.write(path);
  const auto writer = spanning->mesh_places().front();
  std::exception_ptr failure;
  if (writer.is_local()) {
    try {
      w.write(path);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  long long failed = failure ? 1 : 0;
  spanning->max_over_processes(std::span<long long>(&failed, 1), "save_parameters");
  if (failure) std::rethrow_exception(failure);
  if (failed != 0)
    throw io_error("io: save_parameters to " + path.string() + ": process " + std::to_string(writer.process()) +
                   ", which writes the file, failed (its error says why)");
}

}  // namespace pdo::io
