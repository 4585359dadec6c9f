// pdo/kernels/cuda_system.hpp: the algorithms of pdo's kernels on a GPU place: the same
// functors as on CPU places (each a PDO_HD functor of an output index), run by Thrust's
// CUDA system on the place's compute stream without waiting for them (par_nosync). A
// reduction's result comes back to the host, so it waits for its own stream only.
//
// Kernels are compiled by nvcc: in a translation unit compiled by a host compiler, work
// on a GPU place that needs a kernel throws a pdo::error that says so (cuBLAS and the
// copies need no kernel of ours and work from any translation unit).
#pragma once

#include <pdo/core/error.hpp>
#include <pdo/place/cuda_place.hpp>
#include <pdo/place/place_state.hpp>

#include <cstddef>
#include <string>

#if defined(__CUDACC__) && defined(PDO_WITH_CUDA)
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cuda/execution_policy.h>
#include <thrust/system_error.h>
#include <thrust/transform_reduce.h>
#endif

namespace pdo::detail {

#if defined(__CUDACC__) && defined(PDO_WITH_CUDA)
inline constexpr bool cuda_kernels_enabled = true;

/// @brief Runs `launch(policy)` with the CUDA policy of GPU place `p` (its compute stream),
/// turning Thrust's and CUDA's failures into a pdo::error naming the place.
template <class Launch>
auto on_gpu_stream(place_state& p, const char* what, Launch&& launch) {
  cuda_device& d = cuda_device_of(p);
  device_guard guard(d.ordinal);
  try {
    auto result = launch(thrust::cuda::par_nosync.on(d.compute));
    cuda_check(cudaGetLastError(), what, p.name);
    return result;
  } catch (const thrust::system_error& e) {
    throw error(std::string(what) + " on " + p.name + ": " + e.what());
  }
}

/// @brief out[i - base] = f(i): a transform over an index range as one for_each work item.
template <class Out, class F>
struct write_element {
  Out out;
  F f;
  std::size_t base;
  __device__ void operator()(std::size_t i) const { out[i - base] = f(i); }
};

/// @brief out[k] = f(first + k) on the place's compute stream. It runs as Thrust's for_each
/// (CUB's DeviceFor: one kernel per functor) rather than Thrust's transform, whose CUDA
/// system builds several kernels per functor to stream the inputs a counting iterator does
/// not have (pdo's functors read their operands themselves).
template <class Out, class F>
Out gpu_transform(place_state& p, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last, Out out, F f) {
  const std::size_t n = *last - *first;
  on_gpu_stream(p, "thrust::for_each_n", [&](auto policy) { return thrust::for_each_n(policy, first, n, write_element<Out, F>{out, f, *first}); });
  return out + static_cast<std::ptrdiff_t>(n);
}
template <class F>
thrust::counting_iterator<std::size_t> gpu_for_each_n(place_state& p, thrust::counting_iterator<std::size_t> first, std::size_t n, F f) {
  return on_gpu_stream(p, "thrust::for_each_n", [&](auto policy) { return thrust::for_each_n(policy, first, n, f); });
}
template <class F, class T, class Op>
T gpu_transform_reduce(place_state& p, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last, F f,
                       T init, Op op) {
  return on_gpu_stream(p, "thrust::transform_reduce",
                       [&](auto policy) { return thrust::transform_reduce(policy, first, last, f, init, op); });
}
#else
inline constexpr bool cuda_kernels_enabled = false;

[[noreturn]] inline void no_gpu_kernels(const place_state& p) {
  if constexpr (!cuda_enabled) no_cuda("a kernel", p.name);
  throw error("a kernel on " + p.name + ": GPU kernels are compiled by nvcc; compile this translation unit as CUDA");
}
template <class Out, class First, class F>
Out gpu_transform(place_state& p, First, First, Out, F) {
  no_gpu_kernels(p);
}
template <class First, class F>
First gpu_for_each_n(place_state& p, First, std::size_t, F) {
  no_gpu_kernels(p);
}
template <class F, class T, class Op, class First>
T gpu_transform_reduce(place_state& p, First, First, F, T, Op) {
  no_gpu_kernels(p);
}
#endif

}  // namespace pdo::detail
