// pdo/io/file.hpp: what every file format of pdo::io shares: element type names, the
// checksum of stored bytes, and files read and written whole or at an offset, whose
// failures are pdo::io_errors naming the file.
#pragma once

#include <pdo/core/dtype.hpp>
#include <pdo/core/error.hpp>
#include <pdo/core/shape.hpp>

#include <atomic>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

namespace pdo::io {

static_assert(std::endian::native == std::endian::little,
              "pdo: io: checkpoints, safetensors and .npy files hold little-endian data; this host is not little-endian");

namespace detail {

/// @brief The name of an element type in checkpoint metadata ("float32", "int64", ...).
template <class T>
constexpr std::string_view stored_dtype() {
  if constexpr (std::is_floating_point_v<T>) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "pdo: io: floating-point elements are float or double");
    return sizeof(T) == 4 ? "float32" : "float64";
  } else {
    constexpr bool s = std::is_signed_v<T>;
    if constexpr (sizeof(T) == 1) return s ? "int8" : "uint8";
    else if constexpr (sizeof(T) == 2) return s ? "int16" : "uint16";
    else if constexpr (sizeof(T) == 4) return s ? "int32" : "uint32";
    else return s ? "int64" : "uint64";
  }
}

/// @brief The names of `items` (`name_of` of each) for an io error's message: "a, b, c", the
/// first 16 and then how many there are in all, or "nothing".
template <class Items, class NameOf>
std::string listed_names(const Items& items, NameOf name_of) {
  std::string text = pdo::detail::listed(items, name_of, 16);
  return text.empty() ? "nothing" : text;
}

/// @brief A 64-bit checksum of `n` bytes: four lanes of 8-byte words, each word multiplied
/// into its lane and rotated, then the lanes and the length mixed. It reads memory at the
/// speed of the memory bus, so checking what is read costs little beside the read itself.
inline std::uint64_t checksum(const void* data, std::size_t n, std::uint64_t seed = 0) {
  constexpr std::uint64_t k1 = 0x9E3779B97F4A7C15ull, k2 = 0xC2B2AE3D27D4EB4Full, k3 = 0x165667B19E3779F9ull;
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t lane[4] = {seed + k1, seed + k2, seed ^ k3, seed - k1};
  auto word = [](const unsigned char* q) {
    std::uint64_t w;
    std::memcpy(&w, q, 8);
    return w;
  };
  auto round = [](std::uint64_t acc, std::uint64_t w) { return std::rotl(acc + w * k2, 31) * k1; };
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int l = 0; l < 4; ++l) lane[l] = round(lane[l], word(p + i + 8 * static_cast<std::size_t>(l)));
  std::uint64_t h = std::rotl(lane[0], 1) + std::rotl(lane[1], 7) + std::rotl(lane[2], 12) + std::rotl(lane[3], 18);
  for (int l = 0; l < 4; ++l) h = (h ^ round(0, lane[l])) * k1 + k3;
  h += n;
  for (; i + 8 <= n; i += 8) h = std::rotl(h ^ round(0, word(p + i)), 27) * k1 + k3;
  for (; i < n; ++i) h = std::rotl(h ^ (p[i] * k1), 11) * k2;
  h ^= h >> 33;
  h *= k2;
  h ^= h >> 29;
  h *= k3;
  return h ^ (h >> 32);
}

/// @brief An open file: every failure is a pdo::io_error naming it (and, after its path,
/// `label`: what it holds, " (tensor "w", block at [0, 0])") and what was asked.
class file {
 public:
  enum class mode { read, write };
  file(std::filesystem::path path, mode m, std::string label = {}) : path_(std::move(path)), label_(std::move(label)) {
    fd_ = m == mode::read ? ::open(path_.c_str(), O_RDONLY | O_CLOEXEC) : ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail(m == mode::read ? "cannot open it to read" : "cannot create it");
  }
  file(const file&) = delete;
  file& operator=(const file&) = delete;
  ~file() {
    if (fd_ >= 0) ::close(fd_);
  }

  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  [[nodiscard]] std::size_t size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) fail("cannot read its size");
    return static_cast<std::size_t>(st.st_size);
  }
  /// @brief `n` bytes at `offset`; fewer in the file is an io_error saying it is truncated.
  void read_at(void* out, std::size_t n, std::size_t offset) const {
    auto* p = static_cast<char*>(out);
    while (n > 0) {
      const ::ssize_t got = ::pread(fd_, p, n, static_cast<::off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) fail("cannot read " + std::to_string(n) + " bytes at offset " + std::to_string(offset));
      if (got == 0)
        throw io_error("io: " + path_.string() + label_ + ": truncated: it ends at byte " + std::to_string(offset) + ", " + std::to_string(n) +
                       " bytes before the end its contents need");
      p += got, n -= static_cast<std::size_t>(got), offset += static_cast<std::size_t>(got);
    }
  }
  void write_at(const void* data, std::size_t n, std::size_t offset) {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const ::ssize_t put = ::pwrite(fd_, p, n, static_cast<::off_t>(offset));
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) fail("cannot write " + std::to_string(n) + " bytes at offset " + std::to_string(offset));
      p += put, n -= static_cast<std::size_t>(put), offset += static_cast<std::size_t>(put);
    }
  }
  /// @brief Waits until what was written is on the disk.
  void flush() {
    if (::fsync(fd_) != 0) fail("cannot flush it to the disk");
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw io_error("io: " + path_.string() + label_ + ": " + what + ": " + std::strerror(errno));
  }
  std::filesystem::path path_;
  std::string label_;
  int fd_ = -1;
};

/// @brief The whole of a small file (metadata, headers) as a string.
inline std::string read_text(const std::filesystem::path& path) {
  const file f(path, file::mode::read);
  std::string text(f.size(), '\0');
  f.read_at(text.data(), text.size(), 0);
  return text;
}

/// @brief A name beside `path` ("model.safetensors.partial.<hex>.<n>") that no other write
/// uses, in this process or another: a random number drawn once per process and its process
/// id, then a count of its writes. Threads or processes writing one path at once each fill a
/// temporary file of their own, and each rename leaves a complete file.
inline std::filesystem::path temporary_beside(const std::filesystem::path& path) {
  static const std::uint64_t drawn = [] {
    std::random_device r;
    return (std::uint64_t{r()} << 32) ^ std::uint64_t{r()};
  }();
  static std::atomic<std::uint64_t> writes{0};
  char suffix[64];
  std::snprintf(suffix, sizeof suffix, ".partial.%016llx.%llu", static_cast<unsigned long long>(drawn ^ static_cast<std::uint64_t>(::getpid())),
                static_cast<unsigned long long>(writes.fetch_add(1, std::memory_order_relaxed)));
  std::filesystem::path temporary = path;
  temporary += suffix;
  return temporary;
}

/// @brief Writes `path` safely: `write(file&)` fills a temporary name beside it (of this write
/// alone), which is flushed, then renamed over `path`, so a reader finds the old file or the new
/// one, never a part. When the write, the flush or the rename fails, the temporary file is removed.
template <class Write>
void write_atomically(const std::filesystem::path& path, Write&& write) {
  const std::filesystem::path temporary = temporary_beside(path);
  std::optional<file> f(std::in_place, temporary, file::mode::write);  // from here on, the temporary is this write's
  try {
    write(*f);
    f->flush();
    f.reset();
    std::error_code ec;
    std::filesystem::rename(temporary, path, ec);
    if (ec) throw io_error("io: " + path.string() + ": cannot rename " + temporary.string() + " to it: " + ec.message());
  } catch (...) {
    f.reset();
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    throw;
  }
}

inline void write_text_atomically(const std::filesystem::path& path, std::string_view text) {
  write_atomically(path, [&](file& f) { f.write_at(text.data(), text.size(), 0); });
}

/// @brief A descriptor of the directory `dir` (to lock or flush it), or -1 where it cannot be
/// opened (not every file system lets a directory be opened).
inline int open_directory(const std::filesystem::path& dir) { return ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); }

/// @brief An exclusive lock (flock) on a directory, held while it lives: the saves of
/// checkpoints into one folder, from several threads or from processes of one machine, take
/// turns with it. Where the file system does not lock directories, none is held.
class directory_lock {
 public:
  /// @brief Holds no lock yet.
  directory_lock() = default;
  directory_lock(const directory_lock&) = delete;
  directory_lock& operator=(const directory_lock&) = delete;
  /// @brief Lets the lock go (closing the directory does).
  ~directory_lock() {
    if (fd_ >= 0) ::close(fd_);
  }
  /// @brief Waits for the lock on `dir` and takes it (once).
  void take(const std::filesystem::path& dir) {
    if (fd_ >= 0) return;
    fd_ = open_directory(dir);
    if (fd_ >= 0)
      while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
      }
  }

 private:
  int fd_ = -1;
};

/// @brief Flushes a directory's entries (new files, renames) to the disk.
inline void flush_directory(const std::filesystem::path& dir) {
  const int fd = open_directory(dir);
  if (fd < 0) return;  // not every file system lets a directory be opened; its entries then go with the files
  ::fsync(fd);
  ::close(fd);
}

}  // namespace detail
}  // namespace pdo::io
