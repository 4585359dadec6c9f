// pdo/memory/memory_stats.hpp: what a place's allocator reports.
#pragma once

#include <cstddef>

namespace pdo {

/// @brief A snapshot of one place's allocator.
struct memory_stats {
  std::size_t bytes_in_use = 0;     ///< bytes handed out and not yet returned
  std::size_t peak_bytes_in_use = 0;///< highest bytes_in_use since creation or reset_peak()
  std::size_t bytes_cached = 0;     ///< bytes returned and kept for reuse
  std::size_t allocations = 0;      ///< number of allocate() calls served
  std::size_t system_allocations = 0; ///< of those, how many went to the system allocator
  std::size_t cap = 0;              ///< bytes_in_use + bytes_cached may not exceed it (0: no cap)
};

}  // namespace pdo
