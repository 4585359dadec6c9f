// pdo/kernels/conv.hpp: conv2d by im2col + gemm, and 2-D pooling, forward and backward.
// Every kernel is a functor of one output index (PDO_HD), run by thrust::transform or
// for_each_n on the place's system: gathers, never scatters, so no two indices write
// the same element.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/dtype.hpp>
#include <pdo/kernels/place_system.hpp>

#include <cstddef>
#include <cstdint>

namespace pdo::detail {

/// @brief The geometry of a 2-D window op over x [batch, channels, height, width]:
/// square kernel, stride, the output extents, and the zero padding in front of the first
/// row (pad_h) and column (pad_w): window (oh, ow) reads padded rows [oh * stride, oh *
/// stride + kernel), row r being x's row r - pad_h; rows outside x are padding (behind it
/// too). A whole image is padded alike on both sides; a block of a split image (its own rows
/// and its halo) has the padding of the image's edges it touches, on that side only.
struct window_geometry {
  std::size_t batch = 0, channels = 0, height = 0, width = 0;
  std::size_t kernel = 1, stride = 1, pad_h = 0, pad_w = 0;
  std::size_t out_height = 0, out_width = 0;

  PDO_HD std::size_t out_pixels() const { return out_height * out_width; }
  /// @brief Output rows of the im2col matrix: one per (image, output pixel).
  PDO_HD std::size_t rows() const { return batch * out_pixels(); }
  /// @brief Its columns: one per (channel, kernel row, kernel column).
  PDO_HD std::size_t cols() const { return channels * kernel * kernel; }
};

/// @brief The geometry of a whole image padded alike on all sides, with output extents;
/// false when the window does not fit.
inline bool make_window_geometry(window_geometry& g) {
  constexpr std::size_t most = static_cast<std::size_t>(-1) / 4;  // padded extents are computed without overflow below this
  if (g.pad_h > most || g.pad_w > most || g.height > most || g.width > most) return false;
  if (g.kernel == 0 || g.stride == 0 || g.height + 2 * g.pad_h < g.kernel || g.width + 2 * g.pad_w < g.kernel) return false;
  g.out_height = (g.height + 2 * g.pad_h - g.kernel) / g.stride + 1;
  g.out_width = (g.width + 2 * g.pad_w - g.kernel) / g.stride + 1;
  return true;
}

/// @brief Element i of the im2col matrix [rows, cols] of x.
template <class T>
struct im2col_element {
  const T* x;
  window_geometry g;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t row = i / g.cols(), col = i % g.cols();
    const std::size_t n = row / g.out_pixels(), pixel = row % g.out_pixels();
    const std::size_t oh = pixel / g.out_width, ow = pixel % g.out_width;
    const std::size_t c = col / (g.kernel * g.kernel), k = col % (g.kernel * g.kernel);
    const std::size_t h = oh * g.stride + k / g.kernel, w = ow * g.stride + k % g.kernel;  // in padded coordinates
    if (h < g.pad_h || w < g.pad_w || h - g.pad_h >= g.height || w - g.pad_w >= g.width) return T(0);
    return x[((n * g.channels + c) * g.height + (h - g.pad_h)) * g.width + (w - g.pad_w)];
  }
};

/// @brief A rectangle of output pixels: rows [row_begin, row_end), columns [col_begin, col_end).
struct pixel_region {
  std::size_t row_begin = 0, row_end = 0, col_begin = 0, col_end = 0;
  [[nodiscard]] PDO_HD std::size_t pixels() const { return (row_end - row_begin) * (col_end - col_begin); }
};

/// @brief Element i of the im2col rows of the output pixels of `region` (of geometry g, whose
/// input is a block of `g.height` x `g.width` pixels), for each image: cols's entries for
/// those pixels, read from `src`, which holds rows [row0, row0 + src_height) and columns
/// [col0, col0 + src_width) of the block (the block itself, or a part of it held apart,
/// such as a place's own rows before its halo has come). The region's windows must read no
/// block pixel outside `src`; padding reads as zero.
template <class T>
struct im2col_region_element {
  const T* src;
  T* cols;
  window_geometry g;
  pixel_region region;
  std::ptrdiff_t row0 = 0, col0 = 0;
  std::size_t src_height = 0, src_width = 0;
  PDO_HD void operator()(std::size_t i) const {
    const std::size_t per_image = region.pixels() * g.cols(), n = i / per_image, rest = i % per_image;
    const std::size_t pixel = rest / g.cols(), col = rest % g.cols(), region_width = region.col_end - region.col_begin;
    const std::size_t oh = region.row_begin + pixel / region_width, ow = region.col_begin + pixel % region_width;
    const std::size_t c = col / (g.kernel * g.kernel), k = col % (g.kernel * g.kernel);
    const std::size_t h = oh * g.stride + k / g.kernel, w = ow * g.stride + k % g.kernel;  // in padded coordinates
    T value(0);
    if (h >= g.pad_h && w >= g.pad_w && h - g.pad_h < g.height && w - g.pad_w < g.width) {
      const std::size_t sh = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(h - g.pad_h) - row0);
      const std::size_t sw = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(w - g.pad_w) - col0);
      value = src[((n * g.channels + c) * src_height + sh) * src_width + sw];
    }
    cols[(n * g.out_pixels() + oh * g.out_width + ow) * g.cols() + col] = value;
  }
};

/// @brief Element i of dx [batch, channels, height, width]: the sum of the im2col
/// gradient entries that read it.
template <class T>
struct col2im_element {
  const T* dcols;
  window_geometry g;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t w = i % g.width, h = (i / g.width) % g.height;
    const std::size_t c = (i / (g.width * g.height)) % g.channels, n = i / (g.width * g.height * g.channels);
    T acc{};
    for (std::size_t kh = 0; kh < g.kernel; ++kh) {
      const std::size_t ph = h + g.pad_h;  // padded row
      if (ph < kh || (ph - kh) % g.stride != 0) continue;
      const std::size_t oh = (ph - kh) / g.stride;
      if (oh >= g.out_height) continue;
      for (std::size_t kw = 0; kw < g.kernel; ++kw) {
        const std::size_t pw = w + g.pad_w;
        if (pw < kw || (pw - kw) % g.stride != 0) continue;
        const std::size_t ow = (pw - kw) / g.stride;
        if (ow >= g.out_width) continue;
        const std::size_t row = n * g.out_pixels() + oh * g.out_width + ow;
        acc += dcols[row * g.cols() + (c * g.kernel + kh) * g.kernel + kw];
      }
    }
    return acc;
  }
};

/// @brief y [batch, out_channels, oh, ow] from the gemm result [rows, out_channels], plus the bias (if any).
template <class T>
struct rows_to_images {
  const T* rows;
  const T* bias;
  std::size_t out_channels, pixels;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t p = i % pixels, oc = (i / pixels) % out_channels, n = i / (pixels * out_channels);
    return rows[(n * pixels + p) * out_channels + oc] + (bias != nullptr ? bias[oc] : T(0));
  }
};

/// @brief The inverse reordering: g [batch, out_channels, oh, ow] as [rows, out_channels].
template <class T>
struct images_to_rows {
  const T* images;
  std::size_t out_channels, pixels;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t oc = i % out_channels, row = i / out_channels;
    const std::size_t n = row / pixels, p = row % pixels;
    return images[(n * out_channels + oc) * pixels + p];
  }
};

/// @brief Column oc of a [rows, columns] matrix, summed in sum_accumulator<T> (the bias gradient).
template <class T>
struct column_sum {
  const T* m;
  std::size_t rows, columns;
  PDO_HD T operator()(std::size_t oc) const {
    sum_accumulator<T> acc{};
    for (std::size_t r = 0; r < rows; ++r) acc += m[r * columns + oc];
    return static_cast<T>(acc);
  }
};

/// @brief Output element i of a max (Max) or average pool over windows of x (no padding
/// for max pooling: padded cells never win; average pooling counts them as zeros).
template <class T, bool Max>
struct pool_element {
  const T* x;
  window_geometry g;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t ow = i % g.out_width, oh = (i / g.out_width) % g.out_height, nc = i / g.out_pixels();
    const T* plane = x + nc * g.height * g.width;
    T acc{};
    bool first = true;
    for (std::size_t kh = 0; kh < g.kernel; ++kh)
      for (std::size_t kw = 0; kw < g.kernel; ++kw) {
        const std::size_t h = oh * g.stride + kh, w = ow * g.stride + kw;
        if (h < g.pad_h || w < g.pad_w || h - g.pad_h >= g.height || w - g.pad_w >= g.width) continue;
        const T v = plane[(h - g.pad_h) * g.width + (w - g.pad_w)];
        if constexpr (Max) {
          acc = first ? v : nan_max(acc, v);
          first = false;
        } else {
          acc += v;
        }
      }
    if constexpr (Max) return acc;
    else return acc / static_cast<T>(g.kernel * g.kernel);
  }
};

/// @brief Element i of dx for a pool: the output gradients of the windows that read it;
/// for max pooling only those whose maximum it is (the maximum PyTorch picks: the first of
/// equal maxima in reading order, the last NaN of a window that holds NaNs).
template <class T, bool Max>
struct pool_backward_element {
  const T* x;
  const T* dy;
  window_geometry g;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t w = i % g.width, h = (i / g.width) % g.height, nc = i / (g.width * g.height);
    const T* plane = x + nc * g.height * g.width;
    T acc{};
    const std::size_t ph = h + g.pad_h, pw = w + g.pad_w;
    for (std::size_t kh = 0; kh < g.kernel; ++kh) {
      if (ph < kh || (ph - kh) % g.stride != 0 || (ph - kh) / g.stride >= g.out_height) continue;
      const std::size_t oh = (ph - kh) / g.stride;
      for (std::size_t kw = 0; kw < g.kernel; ++kw) {
        if (pw < kw || (pw - kw) % g.stride != 0 || (pw - kw) / g.stride >= g.out_width) continue;
        const std::size_t ow = (pw - kw) / g.stride;
        const T grad = dy[nc * g.out_pixels() + oh * g.out_width + ow];
        if constexpr (Max) {
          if (picked_max_at(plane, oh, ow) == h * g.width + w) acc += grad;
        } else {
          acc += grad / static_cast<T>(g.kernel * g.kernel);
        }
      }
    }
    return acc;
  }
  /// @brief Where, in its plane, window (oh, ow)'s picked maximum lies.
  PDO_HD std::size_t picked_max_at(const T* plane, std::size_t oh, std::size_t ow) const {
    std::size_t at = 0;
    bool first = true;
    T best{};
    for (std::size_t kh = 0; kh < g.kernel; ++kh)
      for (std::size_t kw = 0; kw < g.kernel; ++kw) {
        const std::size_t h = oh * g.stride + kh, w = ow * g.stride + kw;
        if (h < g.pad_h || w < g.pad_w || h - g.pad_h >= g.height || w - g.pad_w >= g.width) continue;
        const std::size_t idx = (h - g.pad_h) * g.width + (w - g.pad_w);
        const T v = plane[idx];
        if (first || v > best || v != v) {  // each NaN replaces the one before, as in PyTorch's kernel
          best = v;
          at = idx;
          first = false;
        }
      }
    return at;
  }
};

}  // namespace pdo::detail
