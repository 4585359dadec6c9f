// pdo/core/cache_line_allocator.hpp: a standard allocator that gives every allocation cache
// lines of its own, for bookkeeping that several host threads write at once.
#pragma once

#include <cstddef>
#include <new>

namespace pdo::detail {

/// @brief A standard allocator whose every allocation has cache lines of its own (64-byte
/// aligned, its size rounded up to whole lines): for the nodes and arrays of containers that
/// different host threads write at once, which the heap would otherwise put side by side
/// (two threads then write one line: each write makes the other's copy stale).
template <class T>
struct cache_line_allocator {
  using value_type = T;  ///< what it allocates
  cache_line_allocator() = default;
  /// @brief From the allocator of another type (containers rebind it).
  template <class U>
  cache_line_allocator(const cache_line_allocator<U>&) noexcept {}  // NOLINT: implicit, as standard allocators are
  /// @brief Room for `n` objects.
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(rounded(n), std::align_val_t{64})); }
  /// @brief Gives back what allocate(n) gave.
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{64}); }  // unsized: clang declares no sized aligned delete by default
  /// @brief Every such allocator frees what another gave.
  template <class U>
  bool operator==(const cache_line_allocator<U>&) const noexcept {
    return true;
  }

 private:
  static std::size_t rounded(std::size_t n) { return (n * sizeof(T) + 63) / 64 * 64; }
};

}  // namespace pdo::detail
