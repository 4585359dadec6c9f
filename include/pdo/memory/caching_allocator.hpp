// pdo/memory/caching_allocator.hpp: per-place caching allocator with statistics and a cap.
#pragma once

#include <pdo/core/cache_line_allocator.hpp>
#include <pdo/core/error.hpp>
#include <pdo/memory/memory_stats.hpp>

#include <cstddef>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

/// @brief Where a caching allocator takes blocks from and gives them back to: host
/// memory for CPU places, device memory for GPU places. `allocate` returns nullptr
/// when the system refuses.
struct memory_system {
  /// @brief A new block of `bytes` bytes, or nullptr when the system refuses (it must not throw).
  void* (*allocate)(std::size_t bytes, void* context);
  /// @brief Gives back block `p`, of the `bytes` it was allocated with.
  void (*deallocate)(void* p, std::size_t bytes, void* context) noexcept;
  void* context = nullptr;  ///< what the two need besides the size (a GPU place's device and stream)
  const char* name = "host";  ///< the memory's name, for messages ("host" for host memory)
};

/// @brief Host memory, 64-byte aligned (one cache line, one AVX-512 vector).
inline memory_system host_memory_system() {
  constexpr std::align_val_t alignment{64};
  return {[](std::size_t bytes, void*) -> void* { return ::operator new(bytes, alignment, std::nothrow); },
          [](void* p, std::size_t, void*) noexcept { ::operator delete(p, alignment); }, nullptr, "host"};
}

/// @brief A thread-safe caching allocator owned by one place.
///
/// Freed blocks are kept in size classes and reused; when a request would take the
/// place over its cap, the cache is released first and, if that is not enough, the
/// request fails with pdo::out_of_memory naming the place, the request and the cap.
// Aligned, and its free lists on cache lines of their own: the places of cpu_places(n) are
// made one after the other (and a free list is made by the thread that first frees a block
// of its size), while two host threads that each drive one place allocate and free on every
// operation.
class alignas(64) caching_allocator {
 public:
  /// @brief An allocator of place `owner` (the name errors give) taking blocks from `system`; `cap`: the most
  /// bytes in use at once, counted in rounded block sizes (0: no cap).
  explicit caching_allocator(std::string owner, std::size_t cap = 0, memory_system system = host_memory_system())
      : owner_(std::move(owner)), system_(system) {
    stats_.cap = cap;
  }
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;
  ~caching_allocator() { release_cache(); }

  /// @brief A block of at least `bytes` bytes, 64-byte aligned. Zero bytes gives nullptr.
  void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    if (bytes > max_request) throw refused(bytes, "no block that large can exist");
    const std::size_t block = size_class(bytes);
    std::lock_guard lock(mutex_);
    if (stats_.cap != 0 && stats_.bytes_in_use + block > stats_.cap)
      throw refused(bytes, "with " + std::to_string(stats_.bytes_in_use) + " bytes in use, its block of " +
                               std::to_string(block) + " bytes exceeds the cap of " + std::to_string(stats_.cap) + " bytes");
    if (auto it = cache_.find(block); it != cache_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      stats_.bytes_cached -= block;
      note_in_use(block);
      return p;
    }
    if (stats_.cap != 0 && stats_.bytes_in_use + stats_.bytes_cached + block > stats_.cap) release_cache_locked();
    void* p = system_.allocate(block, system_.context);
    if (p == nullptr) {
      release_cache_locked();
      p = system_.allocate(block, system_.context);
    }
    if (p == nullptr)
      throw refused(bytes, "the system refused it (" + std::to_string(stats_.bytes_in_use) + " bytes in use)");
    ++stats_.system_allocations;
    note_in_use(block);
    return p;
  }

  /// @brief Returns a block obtained from allocate(bytes) with the same `bytes`.
  void deallocate(void* p, std::size_t bytes) noexcept {
    if (p == nullptr) return;
    const std::size_t block = size_class(bytes);
    std::lock_guard lock(mutex_);
    stats_.bytes_in_use -= block;
    stats_.bytes_cached += block;
    try {
      cache_[block].push_back(p);
    } catch (...) {
      stats_.bytes_cached -= block;
      system_.deallocate(p, block, system_.context);
    }
  }

  /// @brief Gives every cached block back to the system.
  void release_cache() {
    std::lock_guard lock(mutex_);
    release_cache_locked();
  }

  /// @brief A snapshot of the counters: bytes in use, cached and at peak, system allocations, the cap.
  [[nodiscard]] memory_stats stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }
  /// @brief Sets the cap on bytes in use (0: none); it applies to later requests, nothing is freed.
  void set_cap(std::size_t cap) {
    std::lock_guard lock(mutex_);
    stats_.cap = cap;
  }
  /// @brief Restarts the peak from the bytes in use now.
  void reset_peak() {
    std::lock_guard lock(mutex_);
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
  }
  /// @brief The name of the place that owns this allocator, as its errors name it.
  [[nodiscard]] const std::string& owner() const { return owner_; }

  /// @brief The block size a request is served with: multiples of 256 bytes up to
  /// 64 KiB, then quarter steps between powers of two (at most 25% slack).
  static constexpr std::size_t size_class(std::size_t bytes) {
    constexpr std::size_t small = 256;
    if (bytes <= (std::size_t{64} << 10)) return (bytes + small - 1) / small * small;
    std::size_t pow2 = std::size_t{1} << 16;
    while (pow2 * 2 < bytes) pow2 *= 2;
    const std::size_t step = pow2 / 4;
    return (bytes + step - 1) / step * step;
  }

 private:
  /// @brief Requests above this size are refused before rounding (it would overflow).
  static constexpr std::size_t max_request = std::size_t{1} << (sizeof(std::size_t) * 8 - 2);

  out_of_memory refused(std::size_t bytes, const std::string& why) const {
    return out_of_memory("out of memory on " + owner_ + ": request of " + std::to_string(bytes) + " bytes: " + why);
  }
  void note_in_use(std::size_t block) {
    ++stats_.allocations;
    stats_.bytes_in_use += block;
    if (stats_.bytes_in_use > stats_.peak_bytes_in_use) stats_.peak_bytes_in_use = stats_.bytes_in_use;
  }
  void release_cache_locked() noexcept {
    for (auto& [block, blocks] : cache_)
      for (void* p : blocks) system_.deallocate(p, block, system_.context);
    cache_.clear();
    stats_.bytes_cached = 0;
  }

  std::string owner_;
  memory_system system_;
  mutable std::mutex mutex_;
  using free_list = std::vector<void*, detail::cache_line_allocator<void*>>;
  std::map<std::size_t, free_list, std::less<>, detail::cache_line_allocator<std::pair<const std::size_t, free_list>>> cache_;
  memory_stats stats_;
};

/// @brief The allocator of host tensors made without a place.
inline caching_allocator& host_allocator() {
  // never destroyed: tensors with static storage may be freed after main returns
  static caching_allocator* allocator = new caching_allocator("host");
  return *allocator;
}

}  // namespace pdo
