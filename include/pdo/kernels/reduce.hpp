// pdo/kernels/reduce.hpp: sums and maxima along one dim or over everything, as Thrust kernels.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/dtype.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/kernels/place_system.hpp>

#include <thrust/iterator/transform_output_iterator.h>

#include <algorithm>
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

/// @brief Element e of the row of output element o, along the middle dim of [outer, extent,
/// inner], as an A (what a reduction of it accumulates in).
template <class T, class A = T>
struct element_along_dim {
  const T* in;
  std::size_t extent, inner;
  PDO_HD A operator()(std::size_t o, std::size_t e) const { return static_cast<A>(in[(o / inner) * extent * inner + o % inner + e * inner]); }
};

/// @brief Element i of `in`, as an A (what a reduction of it accumulates in).
template <class T, class A = T>
struct read_at {
  const T* in;
  PDO_HD A operator()(std::size_t i) const { return static_cast<A>(in[i]); }
};

/// @brief The square of element i of `in`, in double (what a norm adds).
template <class T>
struct squared_at {
  const T* in;
  PDO_HD double operator()(std::size_t i) const {
    const double x = static_cast<double>(in[i]);
    return x * x;
  }
};

template <class T>
struct max_of {
  PDO_HD T operator()(T a, T b) const { return nan_max(a, b); }
};

/// @brief x * factor rounded to T: what a mean's output iterator writes for a sum x (in its
/// accumulator A).
template <class T, class A = T>
struct scale_by {
  A factor;
  PDO_HD T operator()(A x) const { return static_cast<T>(x * factor); }
};

/// @brief x rounded to T: what a sum's output iterator writes for a sum x in its accumulator A.
template <class T, class A>
struct rounded_to {
  PDO_HD T operator()(A x) const { return static_cast<T>(x); }
};

/// @brief The work items of a CPU kernel along a dim that is not the innermost: item b runs
/// `block(o, j, n)` for the positions [j, j + n) of the innermost dim under outer index o,
/// blocks of at most `Block::width` positions, `per_outer` of them per o.
template <class Block>
struct inner_blocks {
  Block block;
  std::size_t inner, per_outer;
  void operator()(std::size_t b) const {
    const std::size_t j = b % per_outer * Block::width;
    block(b / per_outer, j, std::min(Block::width, inner - j));
  }
};

/// @brief Runs `block` over every block of the innermost dim of `v` (see inner_blocks), spread
/// over the cores of the place: the kernels that read along a dim that is not the innermost a
/// line of a block at a time, keeping what they compute for the block's positions in buffers.
template <class Backend, class Block>
void for_each_inner_block(Backend& backend, const dim_view& v, const Block& block) {
  const std::size_t per_outer = (v.inner + Block::width - 1) / Block::width;
  for_each_n(backend, thrust::counting_iterator<std::size_t>(0), v.outer * per_outer, inner_blocks<Block>{block, v.inner, per_outer});
}

/// @brief The outputs [j, j + n) of outer index o of a reduction along a dim that is not the
/// innermost, on the CPU (a block of for_each_inner_block): kept in a buffer while the rows
/// along the dim stream past, vectorized across the outputs. Each output still reduces its
/// elements in order from `init`, in the accumulator A (the bits segmented_reduce gives), but
/// reads rows, not columns strided by the inner extent (a bias's gradient, the sum over the
/// rows of a [128, 4096] block, read that way took 4-5 ms, the element's index divided twice
/// per element).
template <class T, class A, class Op, class Out>
struct reduce_rows_block {
  static constexpr std::size_t width = 512;  ///< outputs per block: 4 KiB of doubles, in L1
  const T* in;
  dim_view v;
  A init;
  Op op;
  Out out;
  void operator()(std::size_t o, std::size_t j, std::size_t n) const {
    alignas(64) A acc[width];
    for (std::size_t i = 0; i < n; ++i) acc[i] = init;
    const T* row = in + o * v.extent * v.inner + j;
    for (std::size_t e = 0; e < v.extent; ++e, row += v.inner) {
#pragma omp simd
      for (std::size_t i = 0; i < n; ++i) acc[i] = op(acc[i], static_cast<A>(row[i]));
    }
    Out to = out + static_cast<std::ptrdiff_t>(o * v.inner + j);
    for (std::size_t i = 0; i < n; ++i) to[static_cast<std::ptrdiff_t>(i)] = acc[i];
  }
};

/// @brief out[o] = `op` from `init` along dim `v` of `in`, accumulated in A (init's type): a
/// segmented reduction (a row per output element) on the GPU and along the innermost dim; row
/// by row on the CPU along another (reduce_rows_block).
template <class T, class A, class Op, class Out>
void reduce_along(place_system& system, const T* in, const dim_view& v, A init, Op op, Out out) {
  system.visit([&](auto& backend) {
    if constexpr (!gpu_backend<decltype(backend)>) {
      if (v.inner > 1) {
        for_each_inner_block(backend, v, reduce_rows_block<T, A, Op, Out>{in, v, init, op, out});
        return;
      }
    }
    segmented_reduce(backend, v.outer * v.inner, v.extent, v.inner == 1, element_along_dim<T, A>{in, v.extent, v.inner}, init, op, out);
  });
}

/// @brief out[o] = the reduction along dim `v` of `in`; `global_extent` divides a mean. Sums
/// add in sum_accumulator<T>, rounded to T once each (a mean after its division).
template <class T>
void reduce_dim(place_system& system, const T* in, const dim_view& v, reduction what, std::size_t global_extent, T* out) {
  if (what == reduction::max) {
    reduce_along(system, in, v, reduction_identity<T>(what), max_of<T>{}, out);
    return;
  }
  using A = sum_accumulator<T>;
  if (what == reduction::mean)  // each sum scaled as it is written
    reduce_along(system, in, v, A{}, thrust::plus<A>{},
                 thrust::make_transform_output_iterator(out, scale_by<T, A>{A(1) / static_cast<A>(global_extent)}));
  else if constexpr (std::is_same_v<A, T>)
    reduce_along(system, in, v, A{}, thrust::plus<A>{}, out);
  else
    reduce_along(system, in, v, A{}, thrust::plus<A>{}, thrust::make_transform_output_iterator(out, rounded_to<T, A>{}));
}

/// @brief *out = *out * factor, for the one element of a rank-0 result.
template <class T>
struct scale_element {
  T* out;
  T factor;
  PDO_HD void operator()(std::size_t) const { *out = *out * factor; }
};

/// @brief *out (in the memory of the system's place) = the reduction of all `n` elements of
/// `in`; `global_count` divides a mean. On a CPU place a sum adds in sum_accumulator<T>,
/// rounded to T once, as along a dim (a float running sum of 2^20 elements would be off in
/// its 4th digit); on a GPU place CUB's reduction adds in a tree, whose rounding error grows
/// with log n, and writes the result by kernels.
template <class T>
void reduce_all_into(place_system& system, const T* in, std::size_t n, reduction what, std::size_t global_count, T* out) {
  const thrust::counting_iterator<std::size_t> first(0), last(n);
  if (what == reduction::max) {
    transform_reduce_into(system, first, last, read_at<T>{in}, reduction_identity<T>(what), max_of<T>{}, out);
    return;
  }
  system.visit([&](auto& backend) {
    if constexpr (gpu_backend<decltype(backend)>) {
      transform_reduce_into(backend, first, last, read_at<T>{in}, T{}, thrust::plus<T>{}, out);
      if (what == reduction::mean)
        thrust::for_each_n(system, first, std::size_t{1}, scale_element<T>{out, T(1) / static_cast<T>(global_count)});
    } else {
      using A = sum_accumulator<T>;
      const A sum = transform_reduce(backend, first, last, read_at<T, A>{in}, A{}, thrust::plus<A>{});
      *out = what == reduction::mean ? scale_by<T, A>{A(1) / static_cast<A>(global_count)}(sum) : static_cast<T>(sum);
    }
  });
}

/// @brief The sum of the squares of the `n` elements at `in`, added in double, over data in the
/// memory of `where` (a tensor's place; null: host memory), computed where that memory can be
/// read (see for_each_index): one function for every shape and layout of element type T.
template <class T>
PDO_NOINLINE double sum_of_squares(place_state* where, const T* in, std::size_t n) {
  if (n == 0) return 0;
  if (on_gpu(where) && current_place() != where) return run_on_place(*where, [&] { return sum_of_squares(where, in, n); });
  place_system system = current_place_system();
  if (system.gpu != memory_of(where)) system = place_system{};
  const thrust::counting_iterator<std::size_t> first(0), last(n);
  return transform_reduce(system, first, last, squared_at<T>{in}, 0.0, thrust::plus<double>{});
}

}  // namespace pdo::detail
