// pdo/io/checkpoint.hpp: sharded checkpoints. A save writes named tensors, dtensors, numbers
// and strings into a directory: metadata.json (global shapes, element types, layouts, which
// block of each tensor each shard file holds) and one shard file per block, written by the
// place that holds it, all places at once. A load fills tensors of any mesh and layout: each
// place reads only the blocks, and the parts of them, that its new shard needs.
#pragma once

#include <pdo/core/error.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/exec/mesh_ops.hpp>
#include <pdo/exec/run_on_places.hpp>
#include <pdo/io/file.hpp>
#include <pdo/tensor/copy.hpp>
#include <pdo/tensor/dtensor.hpp>
#include <pdo/tensor/tensor.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo::io {

/// @brief How a checkpoint is written.
struct save_options {
  /// @brief Bytes covered by one checksum of a shard file: a load that reads part of a block
  /// reads (and checks) the whole chunks its elements are in.
  std::size_t chunk_bytes = std::size_t{1} << 20;
  /// @brief Wait until every file is on the disk before the checkpoint replaces the old one
  /// (off: faster, but a power failure may leave the new checkpoint incomplete).
  bool flush = true;
};

/// @brief How a checkpoint is read.
struct load_options {
  /// @brief Check every chunk read against its checksum (off: read exactly the bytes needed,
  /// unchecked).
  bool verify = true;
};

/// @brief The part of a tensor one place holds, for checkpoint::add_blocks: where it sits in
/// the whole tensor (`offset`, `shape`) and its elements, row-major in the place's (host)
/// memory; `data` null when the place holds none of it. `write` is false for a copy of a
/// block another place writes (a replica along a data-parallel axis).
template <class T>
struct held_block {
  /// @brief Where the block starts in the whole tensor, one index per dim.
  std::vector<std::size_t> offset, shape;
  /// @var shape
  /// @brief The block's extents, one per dim.

  T* data = nullptr;  ///< the block's elements, row-major, in host memory; null when the place holds none
  bool write = true;  ///< false for a replica of a block another place writes
};

/// @brief What a checkpoint holds under one name (see inspect()).
struct entry_info {
  std::string name;                  ///< the name it was added under
  std::string kind;                  ///< "tensor", "value" (a number) or "text"
  std::string dtype;                 ///< "float32", "int64", ... ("" for text)
  std::vector<std::size_t> shape;    ///< global extents (empty for numbers and text)
  std::string layout;                ///< the layout it was saved from ("" for host tensors)
  std::string mesh;                  ///< the mesh it was saved from ("" for host tensors)
};

namespace detail {

inline constexpr char shard_magic[8] = {'P', 'D', 'O', 'S', 'H', 'A', 'R', 'D'};
inline constexpr std::uint64_t shard_version = 1;
inline constexpr std::size_t shard_header_bytes = 64;
inline constexpr std::size_t shard_data_alignment = 4096;

/// @brief The first 64 bytes of a shard file; then one checksum per chunk of data; then,
/// from the next multiple of 4096 bytes, the block's elements, row-major.
struct shard_header {
  char magic[8];
  std::uint64_t version;
  std::uint64_t data_bytes;
  std::uint64_t chunk_bytes;
  std::uint64_t identity;   ///< checksum of the tensor's name and the block's offset: which block this is
  std::uint64_t checksum;   ///< of the header's other fields and the chunk checksums
  std::uint64_t save;       ///< the save that wrote it, as the metadata's "save" names it (0: written before pdo recorded it)
  std::uint64_t dtype;      ///< checksum of the name of its element type (0: written before pdo recorded it)
};
static_assert(sizeof(shard_header) == shard_header_bytes);

inline std::size_t chunks_of(std::size_t data_bytes, std::size_t chunk_bytes) {
  return data_bytes / chunk_bytes + (data_bytes % chunk_bytes != 0 ? 1 : 0);  // no overflow for any chunk size
}
inline std::size_t data_offset_of(std::size_t nchunks) {
  const std::size_t used = shard_header_bytes + 8 * nchunks;
  return (used + shard_data_alignment - 1) / shard_data_alignment * shard_data_alignment;
}
inline std::uint64_t header_checksum(shard_header h, const std::vector<std::uint64_t>& chunk_sums) {
  h.checksum = 0;
  return checksum(chunk_sums.data(), chunk_sums.size() * 8, checksum(&h, sizeof h));
}
inline std::uint64_t block_identity(const std::string& name, const std::vector<std::size_t>& offset) {
  std::string key = name;
  for (auto o : offset) key += "/" + std::to_string(o);
  return checksum(key.data(), key.size());
}
inline std::uint64_t dtype_identity(std::string_view dtype) { return checksum(dtype.data(), dtype.size()); }

/// @brief A new save's identity, different from every other save's (for a checkpoint of
/// several processes, each proposes one and they take the largest); never 0.
inline std::uint64_t new_save_identity() {
  std::random_device device;
  const auto now = static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  const std::uint64_t x = (static_cast<std::uint64_t>(device()) << 32 ^ device()) ^ now * 0x9e3779b97f4a7c15ull;
  return (x >> 2) | 1;  // positive as a long long, and not 0
}
/// @brief The save identity as the metadata keeps it (16 hex digits) and back; an io_error
/// for text that is not one.
inline std::string save_identity_text(std::uint64_t id) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(id));
  return text;
}
inline std::uint64_t save_identity_of(const nlohmann::ordered_json& j, const std::filesystem::path& metadata) {
  const std::string text = j.is_string() ? j.get<std::string>() : std::string();
  std::uint64_t id = 0;
  bool hex = text.size() == 16;
  for (char ch : text) {
    const int digit = ch >= '0' && ch <= '9' ? ch - '0' : (ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1);
    hex = hex && digit >= 0;
    id = id << 4 | static_cast<std::uint64_t>(digit & 15);
  }
  if (!hex || id == 0) throw io_error("io: " + metadata.string() + ": its \"save\" is " + j.dump() + ", not a save's identity (16 hex digits)");
  return id;
}

/// @brief The checksum metadata.json keeps of its own content ("checksum", 16 hex digits): of
/// the compact JSON text of `meta` without that key, so that whitespace does not count but
/// every name, number and string does.
inline std::string metadata_checksum(const nlohmann::ordered_json& meta) {
  const std::string text = meta.dump();
  return save_identity_text(checksum(text.data(), text.size()));
}

/// @brief The keys of metadata.json, in the order a save writes them.
inline constexpr std::array<std::string_view, 5> metadata_keys = {"format", "version", "save", "entries", "checksum"};

/// @brief What a shard file holds, as its errors name it: " (tensor "w", block at [0, 0])".
inline std::string block_label(const std::string& name, const std::vector<std::size_t>& offset) {
  return " (tensor \"" + name + "\", block at " + pdo::detail::format_extents(offset) + ")";
}

/// @brief Writes one block (`bytes` of host memory) as a shard file.
inline void write_shard(const std::filesystem::path& path, const std::string& name, const std::vector<std::size_t>& offset,
                        std::string_view dtype, const void* data, std::size_t bytes, std::uint64_t save, const save_options& o) {
  const std::size_t chunk = std::max<std::size_t>(o.chunk_bytes, 64);
  const std::size_t n = chunks_of(bytes, chunk);
  std::vector<std::uint64_t> sums(n);
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t c = 0; c < n; ++c) sums[c] = checksum(p + c * chunk, std::min(chunk, bytes - c * chunk));
  shard_header h{};
  std::memcpy(h.magic, shard_magic, 8);
  h.version = shard_version;
  h.data_bytes = bytes;
  h.chunk_bytes = chunk;
  h.identity = block_identity(name, offset);
  h.save = save;
  h.dtype = dtype_identity(dtype);
  h.checksum = header_checksum(h, sums);
  file f(path, file::mode::write, block_label(name, offset));
  f.write_at(&h, sizeof h, 0);
  if (n > 0) f.write_at(sums.data(), n * 8, sizeof h);
  const std::size_t at = data_offset_of(n);
  constexpr std::size_t piece = std::size_t{1} << 28;  // one write call moves at most 2 GiB on Linux
  for (std::size_t done = 0; done < bytes; done += piece) f.write_at(p + done, std::min(piece, bytes - done), at + done);
  if (bytes == 0) f.write_at("", 0, at);
  if (o.flush) f.flush();
}

/// @brief One saved block of a tensor, as the metadata describes it.
struct block_meta {
  std::string file;
  std::vector<std::size_t> offset, shape;
};

/// @brief The last chunk read and checked whole, for the runs that want parts of it.
struct chunk_cache {
  std::size_t chunk = static_cast<std::size_t>(-1);
  std::vector<unsigned char> bytes;
};

/// @brief A shard file opened to read, its header checked against what the metadata says.
class shard_reader {
 public:
  /// @brief Opens the shard of block `b` of tensor `name`, of element type `dtype` (of
  /// `element_bytes` each), written by the save `save` (0: the metadata does not say).
  shard_reader(const std::filesystem::path& path, const std::string& name, std::string_view dtype, std::uint64_t save, const block_meta& b,
               std::size_t element_bytes)
      : f_(path, file::mode::read, block_label(name, b.offset)) {
    const std::string where = "io: " + path.string() + block_label(name, b.offset) + ": ";
    if (f_.size() < shard_header_bytes) throw io_error(where + "truncated: " + std::to_string(f_.size()) + " bytes, shorter than a shard header");
    f_.read_at(&h_, sizeof h_, 0);
    if (std::memcmp(h_.magic, shard_magic, 8) != 0) throw io_error(where + "not a pdo shard file (its first bytes are not PDOSHARD)");
    if (h_.version != shard_version)
      throw io_error(where + "shard format version " + std::to_string(h_.version) + ", this pdo reads version " + std::to_string(shard_version));
    const std::size_t expected =
        pdo::detail::checked_volume(b.shape, where + "the metadata is corrupt: a block", element_bytes, pdo::error_kind::io) * element_bytes;
    // The header's fields are believed only once its checksum matches. The checksums it
    // covers are read from where its sizes say: sizes past the file are a damaged header or
    // a truncated file; sizes within it are checked by the checksum before anything else.
    if (h_.chunk_bytes == 0) throw io_error(where + "corrupt: the header's chunk size is 0");
    const std::size_t size = f_.size();
    auto needs_for = [&](std::size_t data_bytes) { return data_offset_of(chunks_of(data_bytes, h_.chunk_bytes)) + data_bytes; };
    auto past_the_file = [&] {
      if (h_.data_bytes != expected)
        return io_error(where + "corrupt or truncated: its header says " + std::to_string(h_.data_bytes) + " bytes of data in a file of " +
                        std::to_string(size) + " bytes, and the block " + pdo::detail::format_extents(b.shape) + " needs " +
                        std::to_string(expected));
      return io_error(where + "truncated: " + std::to_string(size) + " bytes, its block needs " + std::to_string(needs_for(expected)));
    };
    if (h_.data_bytes > size) throw past_the_file();
    sums_.resize(chunks_of(h_.data_bytes, h_.chunk_bytes));  // at most data_bytes <= size of them
    if (shard_header_bytes + 8 * sums_.size() > size) throw past_the_file();
    if (!sums_.empty()) f_.read_at(sums_.data(), sums_.size() * 8, sizeof h_);
    if (header_checksum(h_, sums_) != h_.checksum) throw io_error(where + "corrupt: the checksum of its header and its table of chunk checksums does not match");
    if (h_.data_bytes != expected)
      throw io_error(where + "the metadata does not match the shard: the block " + pdo::detail::format_extents(b.shape) + " needs " +
                     std::to_string(expected) + " bytes, the file holds " + std::to_string(h_.data_bytes));
    if (h_.identity != block_identity(name, b.offset))
      throw io_error(where + "the metadata does not match the shard: the file holds another tensor's block, or another block");
    if (h_.save != save)
      throw io_error(where + "the metadata does not match the shard: the file was written by another save (" +
                     (h_.save == 0 ? std::string("one that recorded none") : save_identity_text(h_.save)) + ", the checkpoint's is " +
                     (save == 0 ? std::string("not recorded") : save_identity_text(save)) + ")");
    if (h_.dtype != 0 && h_.dtype != dtype_identity(dtype))
      throw io_error(where + "the metadata does not match the shard: the file holds elements of another type than " + std::string(dtype));
    data_at_ = data_offset_of(sums_.size());
    const std::size_t need = data_at_ + h_.data_bytes;
    if (size < need) throw io_error(where + "truncated: " + std::to_string(size) + " bytes, its block needs " + std::to_string(need));
    if (size > need)
      throw io_error(where + "the metadata does not match the shard: " + std::to_string(size - need) + " bytes more than its block");
    where_ = where;
  }

  /// @brief Bytes [from, to) of the block's data into `out`. With `verify`, every chunk they
  /// touch is checked: whole chunks are read straight into `out` and checked there; a chunk
  /// only partly wanted is read into `cache` (which keeps the last one, for the next run).
  void read(std::size_t from, std::size_t to, unsigned char* out, bool verify, chunk_cache& cache) const {
    if (!verify) {
      if (to > from) f_.read_at(out, to - from, data_at_ + from);
      return;
    }
    const std::size_t cb = h_.chunk_bytes, total = h_.data_bytes;
    std::size_t at = from;
    while (at < to) {
      const std::size_t c = at / cb, start = c * cb, end = std::min(start + cb, total);
      if (at == start && end <= to) {  // whole chunks from here on: straight into out
        const std::size_t last = to == total ? total : to / cb * cb;
        f_.read_at(out + (at - from), last - at, data_at_ + at);
        for (std::size_t k = c; k * cb < last; ++k) check_chunk(k, out + (k * cb - from));
        at = last;
        continue;
      }
      if (cache.chunk != c) {
        cache.bytes.resize(end - start);
        f_.read_at(cache.bytes.data(), end - start, data_at_ + start);
        check_chunk(c, cache.bytes.data());
        cache.chunk = c;
      }
      const std::size_t n = std::min(to, end) - at;
      std::memcpy(out + (at - from), cache.bytes.data() + (at - start), n);
      at += n;
    }
  }
  [[nodiscard]] std::size_t chunk_bytes() const { return h_.chunk_bytes; }

 private:
  void check_chunk(std::size_t c, const unsigned char* data) const {
    const std::size_t cb = h_.chunk_bytes, n = std::min<std::size_t>(cb, h_.data_bytes - c * cb);
    if (checksum(data, n) != sums_[c])
      throw io_error(where_ + "corrupt: bytes " + std::to_string(c * cb) + " to " + std::to_string(c * cb + n) +
                     " of its data do not match their checksum");
  }
  file f_;
  shard_header h_{};
  std::vector<std::uint64_t> sums_;
  std::size_t data_at_ = 0;
  std::string where_;
};

/// @brief Whether two boxes of elements, each given by its offset and extents (one of each
/// per dim), share an element: saved blocks must not (a load counts the elements they cover).
template <class I>
bool boxes_overlap(std::span<const I> a_offset, std::span<const I> a_extents, std::span<const I> b_offset, std::span<const I> b_extents) {
  for (std::size_t d = 0; d < a_offset.size(); ++d)
    if (std::max(a_offset[d], b_offset[d]) >= std::min(a_offset[d] + a_extents[d], b_offset[d] + b_extents[d])) return false;
  return true;
}

/// @brief A tensor's entry in the metadata, read back.
struct tensor_meta {
  std::string name, dtype;
  std::vector<std::size_t> shape;
  std::vector<block_meta> blocks;
  std::uint64_t save = 0;  ///< the save that wrote its shards (0: the metadata does not say, a checkpoint of an older pdo)
};

/// @brief The elements [offset, offset + extents) of the saved tensor `t` into `out`, a dense
/// row-major host buffer of `extents`: from every saved block that overlaps them, only the
/// runs they need (and, when verifying, the whole chunks they touch), consecutive runs read at once.
template <class T, std::size_t R>
void read_region(const std::filesystem::path& dir, const tensor_meta& t, const shape_t<R>& offset, const shape_t<R>& extents, T* out,
                 const load_options& o) {
  const std::size_t want = pdo::detail::volume(extents);
  if (want == 0) return;
  std::size_t covered = 0;
  for (const block_meta& b : t.blocks) {
    shape_t<R> lo{}, hi{}, bshape{}, boff{};
    bool empty = false;
    for (std::size_t d = 0; d < R; ++d) {
      bshape[d] = b.shape[d], boff[d] = b.offset[d];
      lo[d] = std::max(offset[d], boff[d]);
      hi[d] = std::min(offset[d] + extents[d], boff[d] + bshape[d]);
      empty = empty || lo[d] >= hi[d];
    }
    if (empty) continue;
    shape_t<R> inter{}, in_block{}, in_out{};
    for (std::size_t d = 0; d < R; ++d) inter[d] = hi[d] - lo[d], in_block[d] = lo[d] - boff[d], in_out[d] = lo[d] - offset[d];
    covered += pdo::detail::volume(inter);
    // the runs, as (offset in the block, offset in out, length), consecutive ones merged
    struct run {
      std::size_t src, dst, n;
    };
    std::vector<std::size_t> dst;
    pdo::detail::for_each_block_run(extents, in_out, inter, [&](std::size_t big, std::size_t, std::size_t) { dst.push_back(big); });
    std::vector<run> runs;
    std::size_t i = 0;
    pdo::detail::for_each_block_run(bshape, in_block, inter, [&](std::size_t big, std::size_t, std::size_t n) {
      const std::size_t d = dst[i++];
      if (!runs.empty() && runs.back().src + runs.back().n == big && runs.back().dst + runs.back().n == d) runs.back().n += n;
      else runs.push_back({big, d, n});
    });
    const shard_reader reader(dir / b.file, t.name, t.dtype, t.save, b, sizeof(T));
    chunk_cache cache;
    for (const run& r : runs)
      reader.read(r.src * sizeof(T), (r.src + r.n) * sizeof(T), reinterpret_cast<unsigned char*>(out + r.dst), o.verify, cache);
  }
  if (covered != want)
    throw io_error("io: " + (dir / "metadata.json").string() + ": tensor \"" + t.name + "\": its blocks cover " + std::to_string(covered) +
                   " of the " + std::to_string(want) + " elements asked for: the metadata does not match the shards");
}

/// @brief The checkpoint being written: its directory, its metadata, the first failure.
struct save_context {
  std::filesystem::path dir;
  save_options options;
  nlohmann::ordered_json entries = nlohmann::ordered_json::object();
  bool writer = true;        ///< this process writes the host tensors and the metadata
  std::uint64_t save_id = 0;  ///< the save's identity, in each shard it writes and in the metadata
  std::size_t index = 0;     ///< the entry's position: its shard files' names
  /// @brief Each element becomes its largest value over the checkpoint's processes (they all
  /// call it, in the same order); absent in a checkpoint of one process.
  std::function<void(std::span<long long>)> max_over_processes;
  std::optional<pdo::detail::captured_error> failure;
  void fail() {
    if (!failure) failure = pdo::detail::captured_error::current();
  }
};

/// @brief The checkpoint being read.
struct load_context {
  std::filesystem::path dir;
  load_options options;
  nlohmann::ordered_json entries;
  std::uint64_t save_id = 0;  ///< the save that wrote the checkpoint (0: its metadata does not say)
  /// @brief The first pass of a load: each entry only checks that the checkpoint holds it as
  /// what it is loaded into (kind, element type, shape), changing nothing.
  bool checking = false;
  std::optional<pdo::detail::captured_error> failure;
  void fail() {
    if (!failure) failure = pdo::detail::captured_error::current();
  }
  /// @brief The metadata of entry `name`, or an io_error listing what the checkpoint holds.
  const nlohmann::ordered_json& entry(const std::string& name) const {
    const auto it = entries.find(name);
    if (it == entries.end())
      throw io_error("io: " + (dir / "metadata.json").string() + ": no entry named \"" + name +
                     "\" (it holds: " + detail::listed_names(entries.items(), [](const auto& e) { return e.key(); }) + ")");
    return *it;
  }
  [[nodiscard]] std::string where(const std::string& name) const { return "io: load of \"" + name + "\" from " + dir.string() + ": "; }
};

inline std::vector<std::size_t> sizes_of(const nlohmann::ordered_json& j, const std::string& what) {
  if (!j.is_array()) throw io_error("io: metadata: " + what + " is not a list of extents");
  std::vector<std::size_t> out;
  for (const auto& e : j) {
    if (!e.is_number_unsigned()) throw io_error("io: metadata: " + what + " holds " + e.dump() + ", not an extent");
    out.push_back(e.get<std::size_t>());
  }
  return out;
}

/// @brief Entry `name` of the metadata as a tensor of element type `dtype` and shape
/// `shape`; anything else is an io_error naming the tensor and both.
inline tensor_meta tensor_entry(const load_context& c, const std::string& name, std::string_view dtype, const std::vector<std::size_t>& shape) {
  const auto& e = c.entry(name);
  tensor_meta t;
  t.name = name;
  t.save = c.save_id;
  try {
    if (e.at("kind") != "tensor") throw io_error(c.where(name) + "it is a " + e.at("kind").get<std::string>() + " in the checkpoint, not a tensor");
    t.dtype = e.at("dtype").get<std::string>();
    t.shape = sizes_of(e.at("shape"), "the shape of \"" + name + "\"");
    for (const auto& b : e.at("blocks")) {
      block_meta m{b.at("file").get<std::string>(), sizes_of(b.at("offset"), "a block offset of \"" + name + "\""),
                   sizes_of(b.at("shape"), "a block shape of \"" + name + "\"")};
      if (m.file.empty() || m.file.find('/') != std::string::npos || m.file == "." || m.file == "..")
        throw io_error(c.where(name) + "the metadata's block " + b.dump() + " names the file \"" + m.file +
                       "\", which is not a file of the checkpoint's folder");
      bool inside = m.offset.size() == t.shape.size() && m.shape.size() == t.shape.size();
      for (std::size_t d = 0; inside && d < t.shape.size(); ++d) inside = m.shape[d] <= t.shape[d] && m.offset[d] <= t.shape[d] - m.shape[d];
      if (!inside)
        throw io_error(c.where(name) + "the metadata's block " + b.dump() + " does not fit its shape " + pdo::detail::format_extents(t.shape));
      t.blocks.push_back(std::move(m));
    }
  } catch (const nlohmann::json::exception& x) {
    throw io_error(c.where(name) + "its metadata is malformed: " + x.what());
  }
  if (t.dtype != dtype)
    throw io_error(c.where(name) + "it holds " + t.dtype + " elements, the tensor it is loaded into " + std::string(dtype) + " ones");
  if (t.shape != shape)
    throw io_error(c.where(name) + "its global shape is " + pdo::detail::format_extents(t.shape) + ", the tensor it is loaded into has " +
                   pdo::detail::format_extents(shape));
  // a load counts the elements the blocks cover: blocks that overlap could hide a gap
  for (std::size_t i = 0; i < t.blocks.size(); ++i)
    for (std::size_t j = i + 1; j < t.blocks.size(); ++j) {
      const block_meta &a = t.blocks[i], &b = t.blocks[j];
      if (boxes_overlap<std::size_t>(a.offset, a.shape, b.offset, b.shape))
        throw io_error(c.where(name) + "the metadata's blocks " + a.file + " (offset " + pdo::detail::format_extents(a.offset) + ", shape " +
                       pdo::detail::format_extents(a.shape) + ") and " + b.file + " (offset " + pdo::detail::format_extents(b.offset) +
                       ", shape " + pdo::detail::format_extents(b.shape) + ") overlap: the metadata does not match the shards");
    }
  return t;
}

/// @brief A number as the metadata keeps it: exactly, as JSON's number; a floating-point
/// infinity or NaN, which JSON has no number for, as the string "inf", "-inf" or "nan".
template <class V>
nlohmann::ordered_json number_json(V v) {
  if constexpr (std::is_floating_point_v<V>) {
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  }
  return v;
}

/// @brief The number entry `name` holds (see number_json), or an io_error naming it.
template <class V>
V number_of(const load_context& c, const std::string& name, const nlohmann::ordered_json& j) {
  if constexpr (std::is_floating_point_v<V>) {
    if (j.is_string()) {
      const auto& s = j.get_ref<const std::string&>();
      if (s == "nan") return std::numeric_limits<V>::quiet_NaN();
      if (s == "inf") return std::numeric_limits<V>::infinity();
      if (s == "-inf") return -std::numeric_limits<V>::infinity();
    }
    if (j.is_number()) {  // a finite number V cannot hold is not rounded to an infinity
      const double x = j.get<double>();
      if (!std::isfinite(x) || std::abs(x) <= static_cast<double>(std::numeric_limits<V>::max())) return static_cast<V>(x);
    }
  } else if constexpr (std::is_signed_v<V>) {
    if (j.is_number_integer()) {
      const auto x = j.get<std::int64_t>();
      if (x >= std::numeric_limits<V>::min() && x <= std::numeric_limits<V>::max()) return static_cast<V>(x);
    }
  } else {
    if (j.is_number_unsigned()) {
      const auto x = j.get<std::uint64_t>();
      if (x <= std::numeric_limits<V>::max()) return static_cast<V>(x);
    }
  }
  throw io_error(c.where(name) + "its value in the metadata is " + j.dump() + ", not a " + std::string(stored_dtype<V>()));
}

/// @brief A string entry must be valid UTF-8 (JSON text): an io_error naming it when not,
/// before anything is written.
inline void check_text(const std::string& name, const std::string& text) {
  try {
    (void)nlohmann::ordered_json(text).dump();
  } catch (const nlohmann::json::exception&) {
    throw io_error("io: save of \"" + name + "\": the string is not valid UTF-8 text (a checkpoint keeps strings in its JSON "
                   "metadata); keep bytes in a tensor of std::uint8_t");
  }
}

}  // namespace detail

/// @brief The named things one save writes and one load fills: tensors (host), dtensors (of
/// any mesh and layout), numbers and strings (a step counter, an RNG's state). It refers to
/// them; they must outlive it. Every process of a mesh builds the same checkpoint and calls
/// save (or load) with it together.
class checkpoint {
 public:
  /// @brief A host tensor: saved by one process, loaded whole by every process.
  template <element T, std::size_t R>
  checkpoint& add(std::string name, tensor<T, R>& t) {
    check_name(name);
    entries_.push_back({std::move(name), [&t](detail::save_context& c, const std::string& n) { save_host(c, n, t); },
                        [&t](detail::load_context& c, const std::string& n) { load_host(c, n, t); }});
    return *this;
  }

  /// @brief A dtensor: each place writes the blocks it holds (partial sums are reduced
  /// first); a load fills each local shard from the blocks it overlaps, whatever the mesh and
  /// layout the checkpoint was saved from.
  template <element T, std::size_t R, mesh_type Mesh, layout_spec L>
  checkpoint& add(std::string name, dtensor<T, R, Mesh, L>& x) {
    check_name(name);
    spanning(x.mesh());
    entries_.push_back({std::move(name), [&x](detail::save_context& c, const std::string& n) { save_distributed(c, n, x); },
                        [&x](detail::load_context& c, const std::string& n) { load_distributed(c, n, x); }});
    return *this;
  }

  /// @brief A tensor of global `shape` held in blocks by the places of `m` (CPU places), as
  /// `block(p)` says for each place p of this process: the stages of a pipeline, their shards
  /// along "tp", an optimizer's moments laid out as the parameters. On save each place writes
  /// its block at once, then the places tell each other what they wrote, so the metadata lists
  /// every block; a load fills each place's block from the saved blocks it overlaps, whatever
  /// the blocks were when it was saved.
  template <element T, std::size_t R, mesh_type Mesh>
  checkpoint& add_blocks(std::string name, const Mesh& m, const shape_t<R>& shape, std::function<held_block<T>(std::size_t)> block) {
    check_name(name);
    spanning(m);
    entries_.push_back({std::move(name), [m, shape, block](detail::save_context& c, const std::string& n) { save_blocks<T, R>(c, n, m, shape, block); },
                        [m, shape, block](detail::load_context& c, const std::string& n) { load_blocks<T, R>(c, n, m, shape, block); }});
    return *this;
  }

  /// @brief A number (a step counter, a learning rate), kept in the metadata exactly.
  template <class V>
    requires(std::is_arithmetic_v<V> && !std::is_same_v<V, bool>)
  checkpoint& add(std::string name, V& value) {
    return add_computed<V>(std::move(name), [&value] { return value; }, [&value](V v) { value = v; });
  }

  /// @brief A host tensor of `shape` made when the checkpoint is saved (`get`, called on
  /// every process: it may gather) and handed to `set` when it is loaded: for state that
  /// lives elsewhere (a model's parameters, an optimizer's moments).
  template <element T, std::size_t R>
  checkpoint& add_computed(std::string name, const shape_t<R>& shape, std::function<tensor<T, R>()> get,
                           std::function<void(const tensor<T, R>&)> set) {
    check_name(name);
    entries_.push_back({std::move(name), [get](detail::save_context& c, const std::string& n) { save_host(c, n, get()); },
                        [set, shape](detail::load_context& c, const std::string& n) {
                          if (c.checking) {
                            detail::tensor_entry(c, n, detail::stored_dtype<T>(), {shape.begin(), shape.end()});
                            return;
                          }
                          auto t = tensor<T, R>::on_host(shape);
                          load_host(c, n, t);
                          set(t);
                        }});
    return *this;
  }

  /// @brief A number made when the checkpoint is saved and handed to `set` when it is loaded.
  /// An `optional` entry may be absent from the checkpoint loaded (one saved before the entry
  /// was added to a state): `set` is then not called.
  template <class V>
    requires(std::is_arithmetic_v<V> && !std::is_same_v<V, bool>)
  checkpoint& add_computed(std::string name, std::function<V()> get, std::function<void(V)> set, bool optional = false) {
    check_name(name);
    entries_.push_back({std::move(name),
                        [get](detail::save_context& c, const std::string& n) {
                          c.entries[n] = {{"kind", "value"}, {"dtype", std::string(detail::stored_dtype<V>())}, {"value", detail::number_json(get())}};
                        },
                        [set, optional](detail::load_context& c, const std::string& n) {
                          if (optional && !c.entries.contains(n)) return;
                          const auto& e = c.entry(n);
                          if (e.value("kind", "") != "value" || e.value("dtype", "") != detail::stored_dtype<V>()) {
                            const std::string dtype = e.value("dtype", "");
                            throw io_error(c.where(n) + "it is a " + e.value("kind", "?") + (dtype.empty() ? "" : " of " + dtype) +
                                           " in the checkpoint, not a value of " + std::string(detail::stored_dtype<V>()));
                          }
                          const V v = detail::number_of<V>(c, n, e.at("value"));
                          if (!c.checking) set(v);
                        }});
    return *this;
  }

  /// @brief The processes of `m` save and load this checkpoint together: they learn of each
  /// other's failures, and the process of m's first place writes the host tensors and the
  /// metadata. Adding a dtensor does this for its mesh (the first mesh added counts).
  template <mesh_type Mesh>
  checkpoint& spanning(const Mesh& m) {
    if (!agree_) {
      agree_ = [m](std::span<long long> v) { pdo::detail::max_over_processes(m, v, "checkpoint"); };
      writer_ = m.place(0).is_local();
      holds_places_ = !m.local_places().empty();
      rank_ = holds_places_ ? m.place(m.local_places().front()).process() : 0;
    }
    return *this;
  }

  /// @brief A string (an RNG's state written with operator<<, a data loader's position).
  checkpoint& add(std::string name, std::string& text) {
    check_name(name);
    entries_.push_back({std::move(name),
                        [&text](detail::save_context& c, const std::string& n) {
                          detail::check_text(n, text);
                          c.entries[n] = {{"kind", "text"}, {"value", text}};
                        },
                        [&text](detail::load_context& c, const std::string& n) {
                          const auto& e = c.entry(n);
                          if (e.value("kind", "") != "text" || !e.contains("value") || !e["value"].is_string())
                            throw io_error(c.where(n) + "it is not text in the checkpoint");
                          if (!c.checking) text = e["value"].get<std::string>();
                        }});
    return *this;
  }

  /// @brief The number of entries added so far (one per add, add_blocks or add_computed call).
  [[nodiscard]] std::size_t size() const { return entries_.size(); }

  /// @brief Writes every entry into `dir` safely: into `dir` + ".partial" first, flushed,
  /// then swapped in for `dir` in one rename, so `dir` holds the old checkpoint or the new
  /// one, never a part. `dir` must not exist, be empty, or hold a checkpoint (pdo replaces
  /// nothing else). Any failure is a pdo::io_error, on every process, and leaves `dir` as
  /// it was and no `dir` + ".partial".
  void save(const std::filesystem::path& dir, const save_options& o = {}) const {
    pdo::detail::check_not_nested("io::save");
    if (dir.empty()) throw io_error("io: save: the checkpoint's path is empty");
    detail::save_context c;
    c.options = o;
    c.writer = writer_;
    c.max_over_processes = agree_;
    std::filesystem::path target = std::filesystem::absolute(dir).lexically_normal();
    if (!target.has_filename()) target = target.parent_path();  // "ckpt/" is "ckpt"
    c.dir = target;
    c.dir += ".partial";
    // a failure after the staging directory was made removes it (every process has stopped writing by then)
    const auto settle = [&] {
      try {
        agree(c.failure, "save", target);
      } catch (...) {
        std::error_code ec;
        if (c.writer) std::filesystem::remove_all(c.dir, ec);
        throw;
      }
    };
    same_entries_everywhere("save", target, dir);
    // the writer's turn on the folder: saves into it from several threads, or from processes
    // that each save a checkpoint spanning no mesh, run one after the other, not into one
    // staging directory at once
    detail::directory_lock turn;
    try {  // a fresh staging directory (the writer clears what a failed save left)
      if (c.writer) {
        std::filesystem::create_directories(target.parent_path());
        turn.take(target.parent_path());
        check_target(target);
        std::filesystem::remove_all(c.dir);
      }
    } catch (const std::filesystem::filesystem_error& e) {
      c.failure = pdo::detail::captured_error{error_kind::io, "io: save: cannot clear " + c.dir.string() + ": " + e.code().message()};
    } catch (...) {
      c.fail();
    }
    agree(c.failure, "save", target);
    // the save's identity, written into every shard and the metadata, so that a load can tell
    // a shard of another save (a copy from another checkpoint) from one of this save
    long long identity = static_cast<long long>(detail::new_save_identity());
    if (c.max_over_processes) c.max_over_processes(std::span<long long>(&identity, 1));
    c.save_id = static_cast<std::uint64_t>(identity);
    try {
      std::filesystem::create_directories(c.dir);
    } catch (const std::filesystem::filesystem_error& e) {
      if (!c.failure) c.failure = pdo::detail::captured_error{error_kind::io, "io: save: cannot create " + c.dir.string() + ": " + e.code().message()};
    }
    // every entry runs, failed or not: a dtensor's partial sums are collectives every process joins
    for (const auto& e : entries_) {
      try {
        e.save(c, e.name);
      } catch (...) {
        c.fail();
      }
      ++c.index;
    }
    settle();
    if (c.writer) {
      try {
        nlohmann::ordered_json meta = {{"format", "pdo-checkpoint"}, {"version", 1}, {"save", detail::save_identity_text(c.save_id)}, {"entries", c.entries}};
        std::string text;
        try {
          meta["checksum"] = detail::metadata_checksum(meta);
          text = meta.dump(1);
        } catch (const nlohmann::json::exception& e) {
          throw io_error("io: save of " + target.string() + ": the metadata cannot be written as JSON (an entry's name that is not UTF-8?): " +
                         e.what());
        }
        detail::write_text_atomically(c.dir / "metadata.json", text);
        detail::flush_directory(c.dir);
        commit(c.dir, target);
      } catch (...) {
        c.fail();
      }
    }
    settle();
  }

  /// @brief Fills every entry from the checkpoint in `dir`; a missing, corrupt or truncated
  /// file, metadata that does not match the shards, or an entry of another global shape or
  /// element type is a pdo::io_error naming the file, the entry and what is wrong, on every
  /// process. Every entry's metadata is checked first: a checkpoint that lacks an entry, or
  /// holds one of another kind, element type or shape, loads nothing. A shard file found
  /// corrupt while the data is read fails the load there: the entries before it are filled,
  /// those after it are left as they were, and the entry it belongs to may hold some of the
  /// checkpoint's bytes (those read before the failure, the damaged ones among them).
  void load(const std::filesystem::path& dir, const load_options& o = {}) {
    pdo::detail::check_not_nested("io::load");
    same_entries_everywhere("load", dir, dir);
    detail::load_context c;
    c.dir = dir;
    c.options = o;
    try {
      const auto meta = read_metadata(dir);
      c.entries = meta.at("entries");
      if (meta.contains("save")) c.save_id = detail::save_identity_of(meta["save"], dir / "metadata.json");
    } catch (...) {
      c.fail();
    }
    for (const bool checking : {true, false}) {
      c.checking = checking;
      if (!c.failure)
        for (const auto& e : entries_) {
          if (!checking) {
            // the first failure on any process ends the load on every process at the same
            // entry: an entry's load may be collective (a parameter loaded whole is
            // distributed over the mesh), and a process that stopped alone would leave the
            // others waiting in it
            long long failed = c.failure ? 1 : 0;
            if (agree_) agree_(std::span<long long>(&failed, 1));
            if (failed != 0) break;
          }
          try {
            e.load(c, e.name);
          } catch (const nlohmann::json::exception& x) {
            if (!c.failure) c.failure = pdo::detail::captured_error{error_kind::io, c.where(e.name) + "its metadata is malformed: " + x.what()};
          } catch (...) {
            c.fail();
          }
        }
      agree(c.failure, "load", dir);
    }
  }

  /// @brief The metadata of the checkpoint in `dir` (an io_error when it is missing or not one).
  static nlohmann::ordered_json read_metadata(const std::filesystem::path& dir) {
    const auto path = dir / "metadata.json";
    if (!std::filesystem::exists(path)) {
      std::filesystem::path partial = dir;
      partial += ".partial";
      throw io_error("io: " + path.string() + ": missing: " + dir.string() + " holds no checkpoint" +
                     (std::filesystem::exists(partial) ? " (" + partial.string() + " is an unfinished save)" : ""));
    }
    nlohmann::ordered_json meta;
    try {
      meta = nlohmann::ordered_json::parse(detail::read_text(path));
    } catch (const nlohmann::json::exception& e) {
      throw io_error("io: " + path.string() + ": not valid JSON: " + e.what());
    }
    if (!meta.is_object() || !meta.contains("format") || meta["format"] != "pdo-checkpoint" || !meta.contains("entries") ||
        !meta["entries"].is_object())
      throw io_error("io: " + path.string() + ": not the metadata of a pdo checkpoint");
    // a checkpoint of an older pdo has no checksum; one written since has, and no other keys
    for (const auto& [key, value] : meta.items())
      if (std::find(detail::metadata_keys.begin(), detail::metadata_keys.end(), key) == detail::metadata_keys.end())
        throw io_error("io: " + path.string() + ": corrupt: it holds the key \"" + key + "\", which pdo's metadata does not have");
    if (meta.contains("checksum")) {
      const auto kept = meta["checksum"];
      meta.erase("checksum");
      if (const std::string content = detail::metadata_checksum(meta); !kept.is_string() || kept.get<std::string>() != content)
        throw io_error("io: " + path.string() + ": corrupt: its content does not match its checksum (" + kept.dump() + ", its content's is \"" +
                       content + "\"): the file was damaged or edited after the save");
    }
    if (!meta.contains("version") || meta["version"] != 1)
      throw io_error("io: " + path.string() + ": checkpoint format version " + meta["version"].dump() + ", this pdo reads version 1");
    return meta;
  }

 private:
  struct entry {
    std::string name;
    std::function<void(detail::save_context&, const std::string&)> save;
    std::function<void(detail::load_context&, const std::string&)> load;
  };

  void check_name(const std::string& name) const {
    if (name.empty()) throw io_error("io: checkpoint: an entry needs a name");
    for (const auto& e : entries_)
      if (e.name == name) throw io_error("io: checkpoint: two entries are named \"" + name + "\"");
  }

  /// @brief Over the processes of the mesh the checkpoint spans (those that hold places of
  /// it), an io_error on every one unless each added the same entries in the same order and
  /// names the same folder (`given`, the path as the caller passed it; `shown` in the message),
  /// before anything is read or written: a process's entry that the others lack would be
  /// written by none, or loaded by it alone; a process saving elsewhere would leave the others'
  /// checkpoint without its shards.
  void same_entries_everywhere(const char* op, const std::filesystem::path& shown, const std::filesystem::path& given) const {
    if (!agree_) return;
    const auto fingerprint = [](const std::string& text) { return static_cast<long long>(detail::checksum(text.data(), text.size()) >> 2); };
    std::string names;
    for (const auto& e : entries_) names += e.name + '\0';
    std::string folder = given.lexically_normal().generic_string();
    while (folder.size() > 1 && folder.back() == '/') folder.pop_back();  // "ckpt/" is "ckpt"
    const long long mine = fingerprint(names), here = fingerprint(folder);
    // the largest fingerprints and the negated smallest, the same on every process: they
    // differ when the processes' entries (or folders) do (each process then throws, those
    // without places too)
    constexpr long long none = -(1LL << 62);  // a process without places of the mesh counts for nothing
    std::array<long long, 4> v = {none, none, none, none};
    if (holds_places_) v = {mine, -mine, here, -here};
    agree_(v);
    if (v[0] == none) return;
    if (v[0] != -v[1])
      throw io_error(std::string("io: ") + op + " of " + shown.string() + ": the processes' checkpoints hold other entries (this process's " +
                     std::to_string(entries_.size()) + ": " + detail::listed_names(entries_, [](const entry& e) -> const std::string& { return e.name; }) +
                     "): every process adds the same entries, in the same order");
    if (v[2] != -v[3])
      throw io_error(std::string("io: ") + op + " of " + shown.string() + ": the processes name other folders (this process's: " + given.string() +
                     "): every process passes the same path, of a folder they all see; nothing was " +
                     (op[0] == 's' ? "written" : "loaded"));
  }

  /// @brief Every process learns whether one of them failed: the one that did throws its own
  /// error, the others an io_error naming it.
  void agree(const std::optional<pdo::detail::captured_error>& failure, const char* op, const std::filesystem::path& dir) const {
    long long failed = failure ? rank_ + 1 : 0;
    if (agree_) agree_(std::span<long long>(&failed, 1));
    if (failure) failure->rethrow_with_context("");
    if (failed > 0)
      throw io_error(std::string("io: ") + op + " of " + dir.string() + ": process " + std::to_string(failed - 1) +
                     " failed (its error says why); nothing was " + (op[0] == 's' ? "replaced" : "loaded reliably"));
  }

  /// @brief An io_error unless `target` is absent, an empty directory or a checkpoint's: a
  /// save replaces only a checkpoint (what it replaces is removed).
  static void check_target(const std::filesystem::path& target) {
    const auto st = std::filesystem::status(target);
    if (!std::filesystem::exists(st)) return;
    if (!std::filesystem::is_directory(st))
      throw io_error("io: save: " + target.string() + " exists and is not a directory (a checkpoint is a directory); it was left as it is: " +
                     "save to another path");
    if (!std::filesystem::exists(target / "metadata.json") && !std::filesystem::is_empty(target))
      throw io_error("io: save: " + target.string() + " is a directory that holds no pdo checkpoint (no metadata.json); a save replaces " +
                     "only a checkpoint, so it was left as it is: save to another path, or empty it");
  }

  /// @brief `staged` becomes `target`; the checkpoint `target` held, if any, is removed.
  static void commit(const std::filesystem::path& staged, const std::filesystem::path& target) {
    std::error_code ec;
    if (std::filesystem::exists(target)) {
      // one atomic swap where the system has it; else two renames, the old one kept until the new is in
      if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0) {
        std::filesystem::path old = target;
        old += ".old";
        std::filesystem::remove_all(old, ec);
        std::filesystem::rename(target, old, ec);
        if (ec) throw io_error("io: save: cannot move the old checkpoint " + target.string() + " aside: " + ec.message());
        std::filesystem::rename(staged, target, ec);
        if (ec) {
          std::error_code back;
          std::filesystem::rename(old, target, back);  // the old checkpoint where it was
          throw io_error("io: save: cannot rename " + staged.string() + " to " + target.string() + ": " + ec.message());
        }
        std::filesystem::remove_all(old, ec);
      } else {
        std::filesystem::remove_all(staged, ec);  // the old checkpoint, now under the staging name
      }
    } else {
      std::filesystem::rename(staged, target, ec);
      if (ec) throw io_error("io: save: cannot rename " + staged.string() + " to " + target.string() + ": " + ec.message());
    }
    detail::flush_directory(target.parent_path());
  }

  /// @brief The first failure of this process's places (one per local place) becomes the
  /// save's or load's, unless it has one already; `name_place` puts the place in its message.
  template <class Context, class Mesh>
  static void keep_first_failure(Context& c, const Mesh& m, const std::vector<std::optional<pdo::detail::captured_error>>& failures,
                                 bool name_place) {
    for (std::size_t k = 0; k < failures.size() && !c.failure; ++k)
      if (failures[k]) {
        c.failure = failures[k];
        if (name_place) c.failure->message = "on place " + m.place(m.local_places()[k]).name() + ": " + c.failure->message;
      }
  }

  template <class T, std::size_t R>
  static nlohmann::ordered_json tensor_json(const shape_t<R>& shape) {
    return {{"kind", "tensor"}, {"dtype", std::string(detail::stored_dtype<T>())},
            {"shape", std::vector<std::size_t>(shape.begin(), shape.end())}, {"blocks", nlohmann::ordered_json::array()}};
  }

  template <class T, std::size_t R>
  static void save_host(detail::save_context& c, const std::string& name, const tensor<T, R>& t) {
    auto j = tensor_json<T, R>(t.shape());
    const std::string file = "t" + std::to_string(c.index) + ".bin";
    j["blocks"].push_back({{"file", file}, {"offset", std::vector<std::size_t>(R, 0)}, {"shape", std::vector<std::size_t>(t.shape().begin(), t.shape().end())}});
    j["layout"] = "";
    c.entries[name] = std::move(j);
    if (!c.writer) return;
    const tensor<T, R> staged = t.on_gpu() ? to_host(t) : tensor<T, R>();
    const T* data = t.on_gpu() ? staged.data() : t.data();
    detail::write_shard(c.dir / file, name, std::vector<std::size_t>(R, 0), detail::stored_dtype<T>(), data, t.bytes(), c.save_id, c.options);
  }

  template <class T, std::size_t R>
  static void load_host(detail::load_context& c, const std::string& name, tensor<T, R>& t) {
    const auto meta = detail::tensor_entry(c, name, detail::stored_dtype<T>(), {t.shape().begin(), t.shape().end()});
    if (c.checking) return;
    if (t.on_gpu()) {
      auto host = tensor<T, R>::on_host(t.shape());
      detail::read_region<T, R>(c.dir, meta, shape_t<R>{}, t.shape(), host.data(), c.options);
      copy(host, t);
    } else {
      detail::read_region<T, R>(c.dir, meta, shape_t<R>{}, t.shape(), t.data(), c.options);
    }
  }

  template <class T, std::size_t R, class Mesh, class L>
  static void save_distributed(detail::save_context& c, const std::string& name, const dtensor<T, R, Mesh, L>& x) {
    pdo::detail::with_sums_done("io::save", x, [&](const auto& whole) {
      const Mesh& m = whole.mesh();
      constexpr pdo::detail::layout_value v = std::remove_cvref_t<decltype(whole)>::layout_value;
      auto j = tensor_json<T, R>(x.shape());
      j["layout"] = pdo::detail::to_string(pdo::detail::value_of<L>());
      j["mesh"] = m.describe();
      auto file_of = [&](std::size_t q) { return "t" + std::to_string(c.index) + ".p" + std::to_string(q) + ".bin"; };
      for (std::size_t q = 0; q < m.size(); ++q) {
        if (!pdo::detail::writes_block(m, v, q)) continue;
        const auto off = whole.local_offset(q), shape = whole.local_shape(q);
        j["blocks"].push_back({{"file", file_of(q)}, {"offset", std::vector<std::size_t>(off.begin(), off.end())},
                               {"shape", std::vector<std::size_t>(shape.begin(), shape.end())}});
      }
      c.entries[name] = std::move(j);
      // every place writes its block at once, each on its own lane
      std::vector<std::optional<pdo::detail::captured_error>> failures(m.local_places().size());
      pdo::detail::run_on_places(
          "io::save", m,
          [&](std::size_t p, std::size_t k) {
            if (!pdo::detail::writes_block(m, v, p)) return;
            try {
              const auto& shard = whole.local_shards()[k];
              const auto off = whole.local_offset(p);
              const tensor<T, R> staged = shard.on_gpu() ? to_host(shard) : tensor<T, R>();
              detail::write_shard(c.dir / file_of(p), name, std::vector<std::size_t>(off.begin(), off.end()), detail::stored_dtype<T>(),
                                  shard.on_gpu() ? staged.data() : shard.data(), shard.bytes(), c.save_id, c.options);
            } catch (...) {
              failures[k] = pdo::detail::captured_error::current();
            }
          },
          "copy");
      keep_first_failure(c, m, failures, false);
    });
  }

  template <class T, std::size_t R, class Mesh, class L>
  static void load_distributed(detail::load_context& c, const std::string& name, dtensor<T, R, Mesh, L>& x) {
    const auto meta = detail::tensor_entry(c, name, detail::stored_dtype<T>(), {x.shape().begin(), x.shape().end()});
    if (c.checking) return;
    const Mesh& m = x.mesh();
    std::vector<std::optional<pdo::detail::captured_error>> failures(m.local_places().size());
    pdo::detail::run_on_places(
        "io::load", m,
        [&](std::size_t p, std::size_t k) {
          try {
            auto& shard = x.local_shards()[k];
            if (!pdo::detail::holds_partial_value(m, x.layout_value, p)) {
              shard.fill(T{});  // the partial sum's other terms
              return;
            }
            if (shard.on_gpu()) {
              auto host = tensor<T, R>::on_host(shard.shape());
              detail::read_region<T, R>(c.dir, meta, x.local_offset(p), shard.shape(), host.data(), c.options);
              copy(host, shard);
            } else {
              detail::read_region<T, R>(c.dir, meta, x.local_offset(p), shard.shape(), shard.data(), c.options);
            }
          } catch (...) {
            failures[k] = pdo::detail::captured_error::current();
          }
        },
        "copy");
    keep_first_failure(c, m, failures, true);
  }

  /// @brief Place p's block as add_blocks takes it, checked to lie inside `shape`.
  template <class T, std::size_t R, class Mesh>
  static held_block<T> checked_block(const std::string& name, const Mesh& m, const shape_t<R>& shape,
                                     const std::function<held_block<T>(std::size_t)>& block, std::size_t p) {
    held_block<T> b;
    try {
      b = block(p);
    } catch (...) {
      throw io_error("io: \"" + name + "\": add_blocks' block function failed on place " + m.place(p).name() + ": " +
                     pdo::detail::captured_error::current().message);
    }
    if (!b.data) return b;
    if (m.place(p).kind() != place_kind::cpu)
      throw io_error("io: \"" + name + "\": add_blocks takes blocks in host memory; place " + m.place(p).name() +
                     " is a GPU place (add its tensors as dtensors)");
    bool inside = b.offset.size() == R && b.shape.size() == R;
    for (std::size_t d = 0; inside && d < R; ++d) inside = b.offset[d] + b.shape[d] <= shape[d];
    if (!inside)
      throw io_error("io: \"" + name + "\": the block of place " + m.place(p).name() + " (offset " + pdo::detail::format_extents(b.offset) +
                     ", shape " + pdo::detail::format_extents(b.shape) + ") does not lie inside the tensor's shape " + pdo::detail::format_extents(shape));
    return b;
  }

  /// @brief Checks that the blocks the places write, as `table` records them (per place:
  /// whether it writes one, its offset, its shape), are each element of `shape` once: an
  /// io_error naming two blocks that overlap, or how many elements they leave out. A load could
  /// not take the checkpoint otherwise; the save says so, not a load of it later.
  template <std::size_t R, class Mesh>
  static void check_tiling(const std::string& name, const Mesh& m, const shape_t<R>& shape, const std::vector<long long>& table) {
    constexpr std::size_t record = 1 + 2 * R;
    const auto block_text = [&](std::size_t q) {
      const long long* r = table.data() + q * record;
      return m.place(q).name() + " (offset " + pdo::detail::format_extents(std::vector<std::size_t>(r + 1, r + 1 + R)) + ", shape " +
             pdo::detail::format_extents(std::vector<std::size_t>(r + 1 + R, r + 1 + 2 * R)) + ")";
    };
    long double covered = 0;
    for (std::size_t q = 0; q < m.size(); ++q) {
      const long long* a = table.data() + q * record;
      if (a[0] == 0) continue;
      long double v = 1;
      for (std::size_t d = 0; d < R; ++d) v *= static_cast<long double>(a[1 + R + d]);
      covered += v;
      if (v == 0) continue;
      for (std::size_t o = q + 1; o < m.size(); ++o) {
        const long long* b = table.data() + o * record;
        if (b[0] == 0) continue;
        if (detail::boxes_overlap<long long>({a + 1, R}, {a + 1 + R, R}, {b + 1, R}, {b + 1 + R, R}))
          throw io_error("io: \"" + name + "\": add_blocks: the blocks of places " + block_text(q) + " and " + block_text(o) +
                         " overlap: each element is written by one place (held_block::write is false for a replica)");
      }
    }
    long double want = 1;
    for (std::size_t e : shape) want *= static_cast<long double>(e);
    if (covered != want) {
      std::ostringstream os;
      os << "io: \"" << name << "\": add_blocks: the places write blocks of " << covered << " elements, its shape "
         << pdo::detail::format_extents(shape) << " holds " << want << ": every element is written by one place";
      throw io_error(os.str());
    }
  }

  template <class T, std::size_t R, class Mesh>
  static void save_blocks(detail::save_context& c, const std::string& name, const Mesh& m, const shape_t<R>& shape,
                          const std::function<held_block<T>(std::size_t)>& block) {
    auto file_of = [&](std::size_t q) { return "t" + std::to_string(c.index) + ".p" + std::to_string(q) + ".bin"; };
    // per place: whether it wrote a block, then its offset and shape
    constexpr std::size_t record = 1 + 2 * R;
    std::vector<long long> table(m.size() * record, 0);
    std::vector<std::optional<pdo::detail::captured_error>> failures(m.local_places().size());
    pdo::detail::run_on_places(
        "io::save", m,
        [&](std::size_t p, std::size_t k) {
          std::array<long long, record> mine{};
          try {
            const held_block<T> b = checked_block<T, R>(name, m, shape, block, p);
            if (b.data && b.write) {
              std::size_t elements = 1;
              for (std::size_t e : b.shape) elements *= e;
              detail::write_shard(c.dir / file_of(p), name, b.offset, detail::stored_dtype<T>(), b.data, elements * sizeof(T), c.save_id, c.options);
              mine[0] = 1;
              for (std::size_t d = 0; d < R; ++d) {
                mine[1 + d] = static_cast<long long>(b.offset[d]);
                mine[1 + R + d] = static_cast<long long>(b.shape[d]);
              }
            }
          } catch (...) {
            failures[k] = pdo::detail::captured_error::current();
            mine[0] = 0;
          }
          // every place takes part, failed or not: the others wait for its record
          std::vector<long long> all(table.size());
          host_communicator_of(m, p).all_gather(std::span<const long long>(mine), std::span<long long>(all));
          if (k == 0) table = std::move(all);
        },
        "copy");
    keep_first_failure(c, m, failures, false);
    // the processes that hold no place of `m` (the writer of the metadata among them, maybe)
    // learn the table from those that do
    if (c.max_over_processes) c.max_over_processes(std::span<long long>(table));
    if (c.failure) return;  // a place's block failed: the table lacks it
    check_tiling<R>(name, m, shape, table);
    auto j = tensor_json<T, R>(shape);
    j["layout"] = "blocks";
    j["mesh"] = m.describe();
    for (std::size_t q = 0; q < m.size(); ++q) {
      const long long* r = table.data() + q * record;
      if (r[0] == 0) continue;
      j["blocks"].push_back({{"file", file_of(q)}, {"offset", std::vector<std::size_t>(r + 1, r + 1 + R)},
                             {"shape", std::vector<std::size_t>(r + 1 + R, r + 1 + 2 * R)}});
    }
    c.entries[name] = std::move(j);
  }

  template <class T, std::size_t R, class Mesh>
  static void load_blocks(detail::load_context& c, const std::string& name, const Mesh& m, const shape_t<R>& shape,
                          const std::function<held_block<T>(std::size_t)>& block) {
    const auto meta = detail::tensor_entry(c, name, detail::stored_dtype<T>(), {shape.begin(), shape.end()});
    if (c.checking) return;
    std::vector<std::optional<pdo::detail::captured_error>> failures(m.local_places().size());
    pdo::detail::run_on_places(
        "io::load", m,
        [&](std::size_t p, std::size_t k) {
          try {
            const held_block<T> b = checked_block<T, R>(name, m, shape, block, p);
            if (!b.data) return;
            shape_t<R> offset{}, extents{};
            std::copy(b.offset.begin(), b.offset.end(), offset.begin());
            std::copy(b.shape.begin(), b.shape.end(), extents.begin());
            detail::read_region<T, R>(c.dir, meta, offset, extents, b.data, c.options);
          } catch (...) {
            failures[k] = pdo::detail::captured_error::current();
          }
        },
        "copy");
    keep_first_failure(c, m, failures, true);
  }

  std::vector<entry> entries_;
  std::function<void(std::span<long long>)> agree_;  ///< elementwise max over the processes of the first mesh added
  bool writer_ = true;
  bool holds_places_ = true;  ///< whether this process holds places of the mesh it spans
  long long rank_ = 0;
};

/// @brief Saves `c` into `dir` (see checkpoint::save).
inline void save(const std::filesystem::path& dir, const checkpoint& c, const save_options& o = {}) { c.save(dir, o); }
/// @brief Loads `c` from `dir` (see checkpoint::load).
inline void load(const std::filesystem::path& dir, checkpoint& c, const load_options& o = {}) { c.load(dir, o); }

/// @brief What the checkpoint in `dir` holds, entry by entry.
inline std::vector<entry_info> inspect(const std::filesystem::path& dir) {
  std::vector<entry_info> out;
  const auto meta = checkpoint::read_metadata(dir);
  try {
    for (const auto& [name, e] : meta["entries"].items()) {
      entry_info i{name, e.value("kind", ""), e.value("dtype", ""), {}, e.value("layout", ""), e.value("mesh", "")};
      if (e.contains("shape")) i.shape = detail::sizes_of(e["shape"], "the shape of \"" + name + "\"");
      out.push_back(std::move(i));
    }
  } catch (const nlohmann::json::exception& e) {
    throw io_error("io: " + (dir / "metadata.json").string() + ": malformed: " + e.what());
  }
  return out;
}

namespace detail {
/// @brief The global shape of entry `name` in `dir`, as io::read allocates it; zeros when the
/// checkpoint has no such tensor (the load then names what it holds). An io_error when its
/// rank is not R, or when its blocks hold fewer elements than it needs: checked before the
/// whole tensor is allocated, so that a damaged shape in the metadata is named as such rather
/// than asked of the allocator.
template <std::size_t R>
shape_t<R> shape_to_read(const std::filesystem::path& dir, const std::string& name) {
  const auto meta = checkpoint::read_metadata(dir);
  const std::string where = "io: " + (dir / "metadata.json").string() + ": tensor \"" + name + "\": ";
  shape_t<R> shape{};
  try {
    const auto& entries = meta.at("entries");
    if (!entries.contains(name) || entries.at(name).value("kind", "") != "tensor") return shape;  // named by the load
    const auto& e = entries.at(name);
    const auto extents = sizes_of(e.at("shape"), "the shape of \"" + name + "\"");
    if (extents.size() != R)
      throw io_error("io: read of \"" + name + "\" from " + dir.string() + ": it has rank " + std::to_string(extents.size()) + ", not " +
                     std::to_string(R));
    long double held = 0, want = 1;  // counted exactly enough to compare, whatever the extents
    for (const auto& b : e.at("blocks")) {
      long double v = 1;
      for (std::size_t x : sizes_of(b.at("shape"), "a block shape of \"" + name + "\"")) v *= static_cast<long double>(x);
      held += v;
    }
    for (std::size_t x : extents) want *= static_cast<long double>(x);
    if (held < want) {
      std::ostringstream os;
      os << where << "its shape " << pdo::detail::format_extents(extents) << " holds " << want << " elements, its blocks only " << held
         << ": the metadata does not match the shards";
      throw io_error(os.str());
    }
    std::copy(extents.begin(), extents.end(), shape.begin());
  } catch (const nlohmann::json::exception& x) {
    throw io_error(where + "its metadata is malformed: " + x.what());
  }
  return shape;
}
}  // namespace detail

/// @brief The tensor `name` of the checkpoint in `dir`, whole, in host memory.
template <element T, std::size_t R>
tensor<T, R> read(const std::filesystem::path& dir, const std::string& name, const load_options& o = {}) {
  auto out = tensor<T, R>::on_host(detail::shape_to_read<R>(dir, name));
  checkpoint c;
  c.add(name, out);
  c.load(dir, o);
  return out;
}

/// @brief The tensor `name` of the checkpoint in `dir` laid out over `m` as `Layout` (any
/// layout: each place reads only what its shard needs), a dtensor<T, R, Mesh, Layout>; a
/// layout that does not fit it is one compile error, with nothing instantiated after it.
template <element T, std::size_t R, layout_spec Layout, mesh_type Mesh>
auto read(const std::filesystem::path& dir, const std::string& name, const Mesh& m, const load_options& o = {}) {
  if constexpr (!pdo::detail::check_layout<"io::read", Layout, Mesh, R>::ok) {
    // the layout's error was given: nothing more after it
    return pdo::detail::unformed_result<pdo::detail::replicated_dtensor_t<T, R, Mesh>>();
  } else {
    const shape_t<R> shape = detail::shape_to_read<R>(dir, name);
    std::vector<tensor<T, R>> shards;
    for (std::size_t p : m.local_places())
      shards.emplace_back(pdo::detail::shard_shape(m, pdo::detail::value_of<Layout>(), shape, p), m.place(p), pdo::detail::uninitialized);
    dtensor<T, R, Mesh, Layout> out(m, shape, std::move(shards));
    checkpoint c;
    c.add(name, out);
    c.load(dir, o);
    return out;
  }
}

}  // namespace pdo::io
