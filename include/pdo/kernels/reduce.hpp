// pdo/kernels/reduce.hpp: sums and maxima along one dim or over everything, as Thrust kernels.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/dtype.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/kernels/place_system.hpp>

#include <thrust/iterator/transform_output_iterator.h>

#include <cstddef>
#include <limits>

namespace pdo::detail {

/// @brief What a reduction computes.
enum class reduction { sum, mean, max };

/// @brief What a reduction starts from: 0, or for max the least value (-inf where T has it,
/// so that the max of -inf is -inf).
template <class T>
PDO_HD T reduction_identity(reduction r) {
  if (r != reduction::max) return T{};
  return std::numeric_limits<T>::has_infinity ? -std::numeric_limits<T>::infinity() : std::numeric_limits<T>::lowest();
}

/// @brief Element e of the row of output element o, along the middle dim of [outer, extent, inner].
template <class T>
struct element_along_dim {
  const T* in;
  std::size_t extent, inner;
  PDO_HD T operator()(std::size_t o, std::size_t e) const { return in[(o / inner) * extent * inner + o % inner + e * inner]; }
};

template <class T>
struct read_at {
  const T* in;
  PDO_HD T operator()(std::size_t i) const { return in[i]; }
};

template <class T>
struct max_of {
  PDO_HD T operator()(T a, T b) const { return nan_max(a, b); }
};

/// @brief x * factor: what a mean's output iterator writes for a sum x.
template <class T>
struct scale_by {
  T factor;
  PDO_HD T operator()(T x) const { return x * factor; }
};

/// @brief out[o] = the reduction along dim `v` of `in` (a segmented reduction: a row per output
/// element); `global_extent` divides a mean.
template <class T>
void reduce_dim(place_system& system, const T* in, const dim_view& v, reduction what, std::size_t global_extent, T* out) {
  const std::size_t outputs = v.outer * v.inner;
  const element_along_dim<T> element{in, v.extent, v.inner};
  if (what == reduction::max) {
    segmented_reduce(system, outputs, v.extent, v.inner == 1, element, reduction_identity<T>(what), max_of<T>{}, out);
    return;
  }
  if (what == reduction::mean)  // each sum scaled as it is written
    segmented_reduce(system, outputs, v.extent, v.inner == 1, element, T{}, thrust::plus<T>{},
                     thrust::make_transform_output_iterator(out, scale_by<T>{T(1) / static_cast<T>(global_extent)}));
  else
    segmented_reduce(system, outputs, v.extent, v.inner == 1, element, T{}, thrust::plus<T>{}, out);
}

/// @brief *out = *out * factor, for the one element of a rank-0 result.
template <class T>
struct scale_element {
  T* out;
  T factor;
  PDO_HD void operator()(std::size_t) const { *out = *out * factor; }
};

/// @brief *out (in the memory of the system's place) = the reduction of all `n` elements of
/// `in`; `global_count` divides a mean. On a GPU place the result is written by kernels.
template <class T>
void reduce_all_into(place_system& system, const T* in, std::size_t n, reduction what, std::size_t global_count, T* out) {
  const thrust::counting_iterator<std::size_t> first(0), last(n);
  if (what == reduction::max) {
    transform_reduce_into(system, first, last, read_at<T>{in}, reduction_identity<T>(what), max_of<T>{}, out);
    return;
  }
  transform_reduce_into(system, first, last, read_at<T>{in}, T{}, thrust::plus<T>{}, out);
  if (what == reduction::mean) thrust::for_each_n(system, first, std::size_t{1}, scale_element<T>{out, T(1) / static_cast<T>(global_count)});
}

}  // namespace pdo::detail
