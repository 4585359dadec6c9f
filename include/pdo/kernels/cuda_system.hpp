// pdo/kernels/cuda_system.hpp: the algorithms of pdo's kernels on a GPU place: the same
// functors as on CPU places (each a PDO_HD functor of an output index), run on the place's
// compute stream without waiting for them. Under nvcc they are Thrust's for_each (CUB's
// DeviceFor), CUB's DeviceReduce and, for reductions along a dim or a row, CUB's
// DeviceSegmentedReduce (a block of threads per long row), whose temporary storage comes from
// the place's caching allocator (in its cap and statistics, and stream-ordered). Built against the simulated
// devices of tests/cuda_sim (PDO_CUDA_SIMULATOR), the same functors run as the stream's
// device work. A reduction either writes its result into device memory (no wait), or brings
// it back to the host, waiting for its own stream only.
//
// In a translation unit compiled by a host compiler against the real CUDA runtime, work on
// a GPU place that needs a kernel throws a pdo::error that says so (cuBLAS and the copies
// need no kernel of ours and work from any translation unit).
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/error.hpp>
#include <pdo/place/cuda_place.hpp>
#include <pdo/place/place_state.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

// Host-only builds take Thrust's C++ system as the device system, so no CUDA header is needed.
#if !defined(__CUDACC__) && !defined(THRUST_DEVICE_SYSTEM)
#define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_CPP
#endif
#include <thrust/iterator/counting_iterator.h>

#if defined(PDO_WITH_CUDA) && defined(__CUDACC__)
#include <cub/device/device_reduce.cuh>
#include <cub/device/device_segmented_reduce.cuh>
#include <thrust/iterator/transform_iterator.h>
#include <thrust/for_each.h>
#include <thrust/system/cuda/execution_policy.h>
#include <thrust/system_error.h>
#endif

namespace pdo::detail {

/// @brief `n` elements of T in the memory of place `p`, for the kernels of one op, given back
/// when it goes. A GPU place's allocator is stream-ordered on its compute stream, so the kernels
/// queued there before then still have them.
template <class T>
class kernel_scratch {
 public:
  kernel_scratch(place_state& p, std::size_t n)
      : place_(p), bytes_((n == 0 ? 1 : n) * sizeof(T)), data_(static_cast<T*>(p.memory->allocate(bytes_))) {}
  ~kernel_scratch() { place_.memory->deallocate(data_, bytes_); }
  kernel_scratch(const kernel_scratch&) = delete;
  kernel_scratch& operator=(const kernel_scratch&) = delete;
  [[nodiscard]] T* data() const { return data_; }

 private:
  place_state& place_;
  std::size_t bytes_;
  T* data_;
};

/// @brief Segment s of a segmented reduction: reduce over k in [0, length) of f(s, k) with
/// `op`, from `init`, in order; one work item per segment (a CPU place's loop, and a GPU's
/// kernel for short segments).
template <class F, class T, class Op>
struct reduce_segment {
  F f;
  T init;
  Op op;
  std::size_t length;
  PDO_HD T operator()(std::size_t s) const {
    T acc = init;
    for (std::size_t k = 0; k < length; ++k) acc = op(acc, f(s, k));
    return acc;
  }
};

/// @brief Segments at least this long are reduced by a block of GPU threads each (CUB's
/// segmented reduction); shorter ones by one thread each.
inline constexpr std::size_t long_segment = 256;

#if defined(PDO_WITH_CUDA) && (defined(__CUDACC__) || defined(PDO_CUDA_SIMULATOR))
inline constexpr bool cuda_kernels_enabled = true;

/// @brief out[i - base] = f(i): a transform over an index range as one for_each work item.
template <class Out, class F>
struct write_element {
  Out out;
  F f;
  std::size_t base;
  PDO_HD void operator()(std::size_t i) const { out[i - base] = f(i); }
};

/// @brief out[0] = reduce over k in [first, last) of f(k), from `init`, sequentially: the
/// simulator's reduction kernel.
template <class F, class T, class Op>
struct reduce_range {
  F f;
  T init;
  Op op;
  std::size_t first, last;
  T* out;
  PDO_HD void operator()(std::size_t) const {
    T acc = init;
    for (std::size_t k = first; k < last; ++k) acc = op(acc, f(k));
    *out = acc;
  }
};

#if defined(__CUDACC__)
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

/// @brief f(first + k) for k in [0, n) on the place's compute stream, as Thrust's for_each
/// (CUB's DeviceFor: one kernel per functor).
template <class F>
void launch_indices(place_state& p, std::size_t first, std::size_t n, F f, const char* what) {
  on_gpu_stream(p, what, [&](auto policy) { return thrust::for_each_n(policy, thrust::counting_iterator<std::size_t>(first), n, f); });
}

/// @brief out[0] = reduce of f over [first, last) on the place's compute stream: CUB's
/// DeviceReduce, its temporary storage from the place's allocator (freed, stream-ordered,
/// once the reduction is queued: later work of the stream reuses it only after).
template <class F, class T, class Op>
void launch_reduce_into(place_state& p, std::size_t first, std::size_t last, F f, T init, Op op, T* out) {
  cuda_device& d = cuda_device_of(p);
  device_guard guard(d.ordinal);
  const thrust::counting_iterator<std::size_t> in(first);
  std::size_t bytes = 0;
  cuda_check(cub::DeviceReduce::TransformReduce(nullptr, bytes, in, out, last - first, op, f, init, d.compute),
             "cub::DeviceReduce::TransformReduce", p.name);
  const kernel_scratch<unsigned char> storage(p, bytes);
  cuda_check(cub::DeviceReduce::TransformReduce(storage.data(), bytes, in, out, last - first, op, f, init, d.compute),
             "cub::DeviceReduce::TransformReduce", p.name);
}

/// @brief f(s, k) as element s * length + k of one flat sequence, whose segments CUB reduces.
template <class F, class T>
struct segment_element {
  F f;
  std::size_t length;
  PDO_HD T operator()(std::size_t i) const { return f(i / length, i % length); }
};

/// @brief Where segment s starts in the flat sequence.
struct segment_start {
  std::size_t length;
  PDO_HD std::int64_t operator()(std::size_t s) const { return static_cast<std::int64_t>(s * length); }
};

/// @brief out[s] = reduce over k of f(s, k), for s in [0, segments), on the place's compute
/// stream: CUB's DeviceSegmentedReduce (a block of threads per segment) for long segments whose
/// elements are `contiguous` in memory, its temporary storage from the place's allocator; one
/// thread per segment for short ones and for strided ones (whose threads then read neighbouring
/// elements at each step).
template <class F, class T, class Op, class Out>
void launch_segmented_reduce(place_state& p, std::size_t segments, std::size_t length, bool contiguous, F f, T init, Op op, Out out) {
  if (segments == 0) return;
  if (length < long_segment || !contiguous) {  // strided rows: neighbouring threads read neighbouring elements
    launch_indices(p, 0, segments, write_element<Out, reduce_segment<F, T, Op>>{out, {f, init, op, length}, 0}, "segmented reduction kernel");
    return;
  }
  cuda_device& d = cuda_device_of(p);
  device_guard guard(d.ordinal);
  const auto in = thrust::make_transform_iterator(thrust::counting_iterator<std::size_t>(0), segment_element<F, T>{f, length});
  const auto begins = thrust::make_transform_iterator(thrust::counting_iterator<std::size_t>(0), segment_start{length});
  const auto ends = begins + 1;
  const auto count = static_cast<std::int64_t>(segments);
  std::size_t bytes = 0;
  cuda_check(cub::DeviceSegmentedReduce::Reduce(nullptr, bytes, in, out, count, begins, ends, op, init, d.compute),
             "cub::DeviceSegmentedReduce::Reduce", p.name);
  const kernel_scratch<unsigned char> storage(p, bytes);
  cuda_check(cub::DeviceSegmentedReduce::Reduce(storage.data(), bytes, in, out, count, begins, ends, op, init, d.compute),
             "cub::DeviceSegmentedReduce::Reduce", p.name);
}
#else
/// @brief f(first + k) for k in [0, n) as device work of the place's compute stream (the
/// simulated device runs it on the stream's thread, after the work queued before it).
template <class F>
void launch_indices(place_state& p, std::size_t first, std::size_t n, F f, const char* what) {
  if (n == 0) return;
  struct job {
    F f;
    std::size_t first;
  };
  cuda_device& d = cuda_device_of(p);
  device_guard guard(d.ordinal);
  auto* work = new job{f, first};
  cuda_check(cudaSimLaunchKernel(
                 d.compute, n,
                 [](void* args, unsigned long long begin, unsigned long long end) {
                   const job& j = *static_cast<const job*>(args);
                   for (unsigned long long k = begin; k < end; ++k) j.f(j.first + static_cast<std::size_t>(k));
                 },
                 work, [](void* args) { delete static_cast<job*>(args); }),
             what, p.name);
}

template <class F, class T, class Op>
void launch_reduce_into(place_state& p, std::size_t first, std::size_t last, F f, T init, Op op, T* out) {
  launch_indices(p, 0, 1, reduce_range<F, T, Op>{f, init, op, first, last, out}, "reduction kernel");
}

/// @brief out[s] = reduce over k of f(s, k), for s in [0, segments): a work item per segment.
template <class F, class T, class Op, class Out>
void launch_segmented_reduce(place_state& p, std::size_t segments, std::size_t length, bool, F f, T init, Op op, Out out) {
  launch_indices(p, 0, segments, write_element<Out, reduce_segment<F, T, Op>>{out, {f, init, op, length}, 0}, "segmented reduction kernel");
}
#endif

/// @brief out[k] = f(first + k) on the place's compute stream.
template <class Out, class F>
Out gpu_transform(place_state& p, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last, Out out, F f) {
  const std::size_t n = *last - *first;
  launch_indices(p, *first, n, write_element<Out, F>{out, f, *first}, "thrust::for_each_n");
  return out + static_cast<std::ptrdiff_t>(n);
}
template <class F>
thrust::counting_iterator<std::size_t> gpu_for_each_n(place_state& p, thrust::counting_iterator<std::size_t> first, std::size_t n, F f) {
  launch_indices(p, *first, n, f, "thrust::for_each_n");
  return first + static_cast<std::ptrdiff_t>(n);
}

/// @brief *out (device memory of `p`) = the reduction, queued on the place's compute stream.
template <class F, class T, class Op>
void gpu_transform_reduce_into(place_state& p, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last,
                               F f, T init, Op op, T* out) {
  launch_reduce_into(p, *first, *last, f, init, op, out);
}

/// @brief out[s] (device memory of `p`) = reduce over k in [0, length) of f(s, k), for s in
/// [0, segments), queued on the place's compute stream; `contiguous`: each segment's elements
/// are next to each other in memory.
template <class F, class T, class Op, class Out>
void gpu_segmented_reduce(place_state& p, std::size_t segments, std::size_t length, bool contiguous, F f, T init, Op op, Out out) {
  launch_segmented_reduce(p, segments, length, contiguous, f, init, op, out);
}

/// @brief The reduction, brought back to the host (waits for the place's compute stream).
template <class F, class T, class Op>
T gpu_transform_reduce(place_state& p, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last, F f,
                       T init, Op op) {
  cuda_device& d = cuda_device_of(p);
  const kernel_scratch<T> scalar(p, 1);
  launch_reduce_into(p, *first, *last, f, init, op, scalar.data());
  T result{};
  device_guard guard(d.ordinal);
  cuda_check(cudaMemcpyAsync(&result, scalar.data(), sizeof(T), cudaMemcpyDeviceToHost, d.compute), "cudaMemcpyAsync", p.name);
  wait_for_stream(d, d.compute);
  return result;
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
template <class F, class T, class Op, class First>
void gpu_transform_reduce_into(place_state& p, First, First, F, T, Op, T*) {
  no_gpu_kernels(p);
}
template <class F, class T, class Op, class Out>
void gpu_segmented_reduce(place_state& p, std::size_t, std::size_t, bool, F, T, Op, Out) {
  no_gpu_kernels(p);
}
#endif

}  // namespace pdo::detail
