// pdo/tensor/copy.hpp: block copies between row-major buffers: slices, packs along a dim, unpacks.
// The chunk copies take the place whose memory holds both buffers (nullptr: the host), so
// they run as strided device copies on a GPU place.
#pragma once

#include <pdo/core/copy_elements.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/place/copy.hpp>

#include <array>
#include <cstddef>
#include <cstring>

namespace pdo::detail {

/// @brief f(big, dense, run) for each contiguous run of the last dim of the block
/// [offsets, offsets + extents) of a row-major tensor of shape `shape`: `big` is the run's
/// element offset in that tensor, `dense` in the block laid out densely.
template <std::size_t Rank, class F>
void for_each_block_run(const shape_t<Rank>& shape, const shape_t<Rank>& offsets, const shape_t<Rank>& extents, F&& f) {
  if (volume(extents) == 0) return;
  if constexpr (Rank == 0) {
    f(std::size_t{0}, std::size_t{0}, std::size_t{1});
  } else {
    const auto strides = row_major_strides(shape);
    const std::size_t run = extents[Rank - 1];
    shape_t<Rank> index{};  // over the leading Rank-1 dims of the block
    for (std::size_t dense = 0;; dense += run) {
      std::size_t big = offsets[Rank - 1];
      for (std::size_t d = 0; d + 1 < Rank; ++d) big += (offsets[d] + index[d]) * static_cast<std::size_t>(strides[d]);
      f(big, dense, run);
      std::size_t d = Rank - 1;
      while (d-- > 0) {
        if (++index[d] < extents[d]) break;
        index[d] = 0;
      }
      if (d == static_cast<std::size_t>(-1)) return;
    }
  }
}

/// @brief Copies the block [offsets, offsets + extents) of a row-major `src` of shape
/// `src_shape` into the dense row-major `dst` of shape `extents`.
template <class T, std::size_t Rank>
void copy_block(const T* src, const shape_t<Rank>& src_shape, const shape_t<Rank>& offsets, const shape_t<Rank>& extents,
                T* dst) {
  for_each_block_run(src_shape, offsets, extents,
                     [&](std::size_t big, std::size_t dense, std::size_t run) { copy_elements(dst + dense, src + big, run); });
}

/// @brief The inverse of copy_block: the dense `src` of shape `extents` into the block at
/// `offsets` of the row-major `dst` of shape `dst_shape`.
template <class T, std::size_t Rank>
void place_block(const T* src, const shape_t<Rank>& extents, T* dst, const shape_t<Rank>& dst_shape, const shape_t<Rank>& offsets) {
  for_each_block_run(dst_shape, offsets, extents,
                     [&](std::size_t big, std::size_t dense, std::size_t run) { copy_elements(dst + big, src + dense, run); });
}

/// @brief Rows [off, off + count) of the middle dim of `src` laid out as v, into the dense `dst`.
template <class T>
void copy_rows(const T* src, const dim_view& v, std::size_t off, std::size_t count, T* dst, place_state* where = nullptr) {
  if (v.outer == 0 || count * v.inner == 0) return;  // nothing to copy (its buffers may be null)
  copy_strided(where, dst, count * v.inner * sizeof(T), src + off * v.inner, v.extent * v.inner * sizeof(T),
               count * v.inner * sizeof(T), v.outer);
}

/// @brief The inverse of copy_rows: the dense `src` into rows [off, off + count) of `dst` laid out as v.
template <class T>
void place_rows(const T* src, const dim_view& v, std::size_t off, std::size_t count, T* dst, place_state* where = nullptr) {
  if (v.outer == 0 || count * v.inner == 0) return;
  copy_strided(where, dst + off * v.inner, v.extent * v.inner * sizeof(T), src, count * v.inner * sizeof(T),
               count * v.inner * sizeof(T), v.outer);
}

/// @brief Chunk `k` of `parts` along the middle dim of `v` (see chunk_size), from `src`
/// laid out as v, into the dense `dst`.
template <class T>
void copy_chunk(const T* src, const dim_view& v, std::size_t parts, std::size_t k, T* dst, place_state* where = nullptr) {
  copy_rows(src, v, chunk_offset(v.extent, parts, k), chunk_size(v.extent, parts, k), dst, where);
}

/// @brief `src` (laid out as v) cut into `parts` chunks along v's middle dim, written
/// chunk after chunk into `dst`: the order collectives send and receive pieces in.
template <class T>
void pack_chunks(const T* src, const dim_view& v, std::size_t parts, T* dst, place_state* where = nullptr) {
  for (std::size_t k = 0; k < parts; ++k) {
    copy_chunk(src, v, parts, k, dst, where);
    dst += v.outer * chunk_size(v.extent, parts, k) * v.inner;
  }
}

/// @brief The inverse of copy_chunk: the dense chunk `k` in `src` into its place in `dst`
/// laid out as v.
template <class T>
void place_chunk(const T* src, const dim_view& v, std::size_t parts, std::size_t k, T* dst, place_state* where = nullptr) {
  place_rows(src, v, chunk_offset(v.extent, parts, k), chunk_size(v.extent, parts, k), dst, where);
}

/// @brief The inverse of pack_chunks: chunks one after another in `src` into `dst` laid out as v.
template <class T>
void unpack_chunks(const T* src, const dim_view& v, std::size_t parts, T* dst, place_state* where = nullptr) {
  for (std::size_t k = 0; k < parts; ++k) {
    place_chunk(src, v, parts, k, dst, where);
    src += v.outer * chunk_size(v.extent, parts, k) * v.inner;
  }
}

}  // namespace pdo::detail
