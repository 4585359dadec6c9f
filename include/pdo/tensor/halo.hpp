// pdo/tensor/halo.hpp: what one place does in a halo exchange. A window op (conv2d, pooling)
// over an image split along its height or width computes, on each place, the output rows
// the output's layout gives it (the chunk rule on the output extent); their windows read,
// beyond the place's own input rows, a few rows of its neighbours (its halo), as many
// neighbours as the halo is wide. halo_gather brings them: one all_to_all along the mesh
// axis in which each place sends each other the rows of its shard that the other's windows
// read (nothing to places whose windows do not reach it). halo_return is its transpose for
// the backward: the gradient of the rows read from a neighbour goes back to it and is added
// to its own. A split of both dims is one exchange along each axis in turn, so corners
// travel with the second (the first has already widened the block by its rows).
#pragma once

#include <pdo/comm/mesh_comms.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/kernels/place_system.hpp>
#include <pdo/tensor/copy.hpp>
#include <pdo/tensor/tensor.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace pdo::detail {

/// @brief Rows [begin, end) of one dim.
struct row_range {
  std::size_t begin = 0, end = 0;
  [[nodiscard]] constexpr std::size_t size() const { return end - begin; }
  friend constexpr row_range intersect(row_range a, row_range b) {
    const std::size_t lo = std::max(a.begin, b.begin), hi = std::min(a.end, b.end);
    return lo < hi ? row_range{lo, hi} : row_range{lo, lo};
  }
};

/// @brief A window op's geometry along one spatial dim cut over `parts` places of a mesh
/// axis: input rows by the chunk rule on `extent`, output rows by the chunk rule on
/// `out_extent` (the layouts of input and output cut the dim alike).
struct halo_dim {
  std::size_t extent = 0, out_extent = 0, kernel = 1, stride = 1, padding = 0, parts = 1;

  /// @brief The input rows place `c` of the axis holds.
  [[nodiscard]] constexpr row_range own(std::size_t c) const {
    const std::size_t b = chunk_offset(extent, parts, c);
    return {b, b + chunk_size(extent, parts, c)};
  }
  /// @brief The output rows it computes.
  [[nodiscard]] constexpr row_range out(std::size_t c) const {
    const std::size_t b = chunk_offset(out_extent, parts, c);
    return {b, b + chunk_size(out_extent, parts, c)};
  }
  /// @brief Its windows' first row, in padded coordinates (row r of the image is r + padding).
  [[nodiscard]] constexpr std::size_t window_begin(std::size_t c) const { return out(c).begin * stride; }
  /// @brief The input rows its windows read (padding aside): its own rows and its halo.
  [[nodiscard]] constexpr row_range need(std::size_t c) const {
    const row_range o = out(c);
    if (o.size() == 0) return {};
    const std::size_t lo = std::max(o.begin * stride, padding), hi = std::min((o.end - 1) * stride + kernel, extent + padding);
    return lo < hi ? row_range{lo - padding, hi - padding} : row_range{};
  }
  /// @brief Padding rows in front of the first row it reads, within its windows.
  [[nodiscard]] constexpr std::size_t pad_before(std::size_t c) const {
    const row_range n = need(c);
    return n.size() == 0 ? 0 : n.begin + padding - window_begin(c);
  }
  /// @brief Its output rows, counted from its first, whose windows read none of its halo
  /// (only its own rows, or padding): computable before the halo has come. Empty when
  /// there are none, or when they are not one run.
  [[nodiscard]] constexpr row_range interior(std::size_t c) const {
    const std::size_t outs = out(c).size(), pad = pad_before(c);
    const row_range n = need(c), o = intersect(n, own(c));
    // in the padded coordinates of its block: window r reads rows [r * stride, r * stride + kernel)
    const std::size_t own_lo = o.begin - n.begin + pad, own_hi = o.end - n.begin + pad, real_hi = pad + n.size();
    std::size_t first = outs, last = 0;
    for (std::size_t r = 0; r < outs; ++r) {
      const std::size_t lo = std::max(r * stride, pad), hi = std::min(r * stride + kernel, real_hi);
      if (lo < hi && (lo < own_lo || hi > own_hi)) continue;  // reads a halo row
      if (first != outs && last != r) return {};               // a second run
      if (first == outs) first = r;
      last = r + 1;
    }
    return first < last ? row_range{first, last} : row_range{};
  }
  /// @brief The rows it receives from other places (its halo).
  [[nodiscard]] constexpr std::size_t halo_rows(std::size_t c) const { return need(c).size() - intersect(need(c), own(c)).size(); }
};

/// @brief Element i of the dense rows `src` added to rows [off, off + count) of `dst` laid out as v.
template <class T>
struct add_rows_element {
  const T* src;
  T* dst;
  dim_view v;
  std::size_t off, count;
  PDO_HD void operator()(std::size_t i) const {
    const std::size_t run = count * v.inner, o = i / run, r = i % run;
    dst[(o * v.extent + off) * v.inner + r] += src[i];
  }
};

/// @brief The rows each member sends each other in a halo exchange along `d` on member
/// `me`: sends[j] = my rows j's windows read; recvs[j] = j's rows mine read.
struct halo_pieces {
  std::vector<row_range> sends, recvs;
  halo_pieces(const halo_dim& d, std::size_t me) : sends(d.parts), recvs(d.parts) {
    for (std::size_t j = 0; j < d.parts; ++j) {
      sends[j] = intersect(d.need(j), d.own(me));
      recvs[j] = intersect(d.need(me), d.own(j));
    }
  }
};

/// @brief Bytes place `me` of the axis sends in a halo exchange along `d` of a block whose
/// rows along the dim hold `row_bytes` bytes each (the dims before and after it included):
/// the rows of its shard the other places' windows read. halo_return sends as many back.
inline std::size_t halo_bytes_sent(const halo_dim& d, std::size_t me, std::size_t row_bytes) {
  const halo_pieces pieces(d, me);
  std::size_t rows = 0;
  for (std::size_t j = 0; j < d.parts; ++j) rows += j == me ? 0 : pieces.sends[j].size();
  return rows * row_bytes;
}

/// @brief The exchange halo_gather and halo_return share: rows `sends[j]` of `src` (laid
/// out as `sv` along its dim, its first row being row `src_first` of the image) packed for
/// member j, one all_to_all along the axis, and the rows `recvs[j]` received from j handed
/// to `take(j, data, rows)` (rows relative to `dst_first`, laid out as `dv`).
template <class T, class Take>
void halo_exchange(const mesh_communicator& comm, const T* src, const dim_view& sv, std::size_t src_first, const std::vector<row_range>& sends,
                   const dim_view& dv, std::size_t dst_first, const std::vector<row_range>& recvs, const any_place& place, Take take) {
  const std::size_t parts = sends.size();
  std::vector<std::size_t> send_counts(parts), recv_counts(parts);
  std::size_t sent = 0, received = 0;
  for (std::size_t j = 0; j < parts; ++j) {
    sent += send_counts[j] = sv.outer * sends[j].size() * sv.inner;
    received += recv_counts[j] = dv.outer * recvs[j].size() * dv.inner;
  }
  tensor<T, 1> packed(shape_t<1>{sent}, place, uninitialized), in(shape_t<1>{received}, place, uninitialized);
  for (std::size_t j = 0, at = 0; j < parts; at += send_counts[j++])
    copy_rows(src, sv, sends[j].begin - src_first, sends[j].size(), packed.data() + at, packed.where());
  comm.all_to_all(std::as_const(packed).span(), std::span<const std::size_t>(send_counts), in.span(),
                  std::span<const std::size_t>(recv_counts));
  for (std::size_t j = 0, at = 0; j < parts; at += recv_counts[j++])
    if (recv_counts[j] != 0) take(in.data() + at, recvs[j].begin - dst_first, recvs[j].size());
}

/// @brief Place `me` of the axis `comm` spans (laid out as `d` along tensor dim `dim`): its
/// shard `x` (its own rows along `dim`) widened to the rows its windows read (need(me)),
/// the others' rows received from them. Every member of the axis calls it at once.
template <class T, std::size_t Rank>
tensor<T, Rank> halo_gather(const mesh_communicator& comm, const halo_dim& d, std::size_t me, std::size_t dim,
                            const tensor<T, Rank>& x, const any_place& place) {
  const halo_pieces pieces(d, me);
  shape_t<Rank> out_shape = x.shape();
  out_shape[dim] = d.need(me).size();
  const dim_view ov = view_along(out_shape, dim);
  tensor<T, Rank> out(out_shape, place, uninitialized);  // the pieces cover it: own(j) cut the image
  halo_exchange(comm, x.data(), view_along(x.shape(), dim), d.own(me).begin, pieces.sends, ov, d.need(me).begin, pieces.recvs, place,
                [&](const T* rows, std::size_t off, std::size_t count) { place_rows(rows, ov, off, count, out.data(), out.where()); });
  return out;
}

/// @brief The transpose of halo_gather: `dwide` (the gradient of need(me)'s rows) sent back
/// by rows to their owners, and the pieces received added up on place `me`'s own rows.
template <class T, std::size_t Rank>
tensor<T, Rank> halo_return(const mesh_communicator& comm, const halo_dim& d, std::size_t me, std::size_t dim,
                            const tensor<T, Rank>& dwide, const any_place& place) {
  const halo_pieces pieces(d, me);
  shape_t<Rank> out_shape = dwide.shape();
  out_shape[dim] = d.own(me).size();
  const dim_view ov = view_along(out_shape, dim);
  tensor<T, Rank> out(out_shape, place);  // zeros: rows no window read have no gradient
  auto system = kernel_system("halo exchange", {out.where()});
  halo_exchange(comm, dwide.data(), view_along(dwide.shape(), dim), d.need(me).begin, pieces.recvs, ov, d.own(me).begin, pieces.sends, place,
                [&](const T* rows, std::size_t off, std::size_t count) {
                  thrust::for_each_n(system, thrust::counting_iterator<std::size_t>(0), ov.outer * count * ov.inner,
                                     add_rows_element<T>{rows, out.data(), ov, off, count});
                });
  return out;
}

}  // namespace pdo::detail
