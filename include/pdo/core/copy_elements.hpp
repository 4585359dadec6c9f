// pdo/core/copy_elements.hpp: element copies that accept the null pointers of empty buffers.
#pragma once

#include <cstddef>
#include <cstring>

namespace pdo::detail {

/// @brief Copies `count` elements from `src` to `dst` (not overlapping). An empty shard
/// or piece may have null data: nothing is copied then.
template <class T>
void copy_elements(T* dst, const T* src, std::size_t count) {
  if (count != 0) std::memcpy(static_cast<void*>(dst), static_cast<const void*>(src), count * sizeof(T));
}

}  // namespace pdo::detail
