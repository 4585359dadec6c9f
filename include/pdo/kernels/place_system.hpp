// pdo/kernels/place_system.hpp: the Thrust execution policy of a CPU place: its kernels use exactly its cores.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/error.hpp>
#include <pdo/kernels/cuda_system.hpp>
#include <pdo/place/place_state.hpp>

#include <thrust/functional.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/for_each.h>
#include <thrust/reduce.h>
#include <thrust/system/cpp/execution_policy.h>
#include <thrust/transform.h>
#include <thrust/transform_reduce.h>

#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace pdo::detail {

/// @brief A Thrust system for the work of one place. On a CPU place it is Thrust's C++
/// system except for the algorithms pdo's kernels use, which it runs as vectorised loops
/// over the place's own cores (an OpenMP team of `threads`, inheriting the place's
/// pinning), found by Thrust through argument-dependent lookup on the policy. On a GPU
/// place (`gpu` set) those algorithms run the same functors on the device.
struct place_system : thrust::system::cpp::execution_policy<place_system> {
  int threads = 1;
  place_state* gpu = nullptr;  ///< the GPU place whose compute stream runs the kernels, if any
};

/// @brief The policy for the calling thread: a CPU place's compute lane uses its place's cores,
/// a GPU place's lanes their device; any other thread, one core.
inline place_system current_place_system() {
  place_system s;
  place_state* p = current_place();
  if (p != nullptr && p->kind == place_kind::cuda) s.gpu = p;
  else if (p != nullptr && !p->cores.empty()) s.threads = static_cast<int>(p->cores.size());
  return s;
}

/// @brief The policy for kernel `op` on the calling thread, over operands in the memory of
/// `operands` (each a tensor's place; null: host memory). A GPU's memory is read only by
/// kernels on that GPU's place, and host memory only by host loops, so an operand the
/// calling thread's place cannot read is a pdo::error naming the op and both places.
inline place_system kernel_system(std::string_view op, std::initializer_list<place_state*> operands) {
  place_system s = current_place_system();
  for (place_state* operand : operands) {
    place_state* const gpu = memory_of(operand);
    if (gpu == s.gpu) continue;
    const place_state* here = current_place();
    throw error(std::string(op) + ": an operand in the memory of " + (gpu != nullptr ? gpu->name : std::string("the host")) +
                " is used on " + (here != nullptr ? here->name : std::string("a host thread")) +
                ", which cannot read it; run GPU work on its place (pdo::spmd, dtensor ops), or copy the tensor "
                "there first (pdo::to_place, pdo::to_host)");
  }
  return s;
}

/// @brief Loops this short are not worth waking a team for.
inline constexpr std::size_t parallel_grain = std::size_t{1} << 15;

#if defined(__clang__)
// the simd loops ask for vectorization; kernels that gather (conv, pooling) cannot have it,
// which clang reports as a warning for every such kernel
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wpass-failed"
#endif

/// @brief out[k] = f(first + k) for k in [0, last - first): the form every pdo kernel
/// has (a functor of the output index).
template <class F, class Out>
Out transform([[maybe_unused]] place_system& system, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last,
              Out out, F f) {
  if (system.gpu != nullptr) return gpu_transform(*system.gpu, first, last, out, f);
  const std::size_t base = *first, n = *last - *first;
#if defined(_OPENMP)
  if (system.threads > 1 && n >= parallel_grain) {
    // each thread its own copy of the functor, so its pointers are plain vector loads (a
    // shared one turns them into gathers)
#pragma omp parallel for simd num_threads(system.threads) schedule(static) firstprivate(f)
    for (std::size_t k = 0; k < n; ++k) out[k] = f(base + k);
    return out + static_cast<std::ptrdiff_t>(n);
  }
#endif
  // one core: no team is started (that alone costs more than a small kernel)
#pragma omp simd
  for (std::size_t k = 0; k < n; ++k) out[k] = f(base + k);
  return out + static_cast<std::ptrdiff_t>(n);
}

#if defined(__clang__)
#pragma clang diagnostic pop
#endif

/// @brief f(first + k) for k in [0, n), for work items that write several outputs each
/// (a row of a softmax); items run in parallel over the place's cores.
template <class F>
thrust::counting_iterator<std::size_t> for_each_n([[maybe_unused]] place_system& system, thrust::counting_iterator<std::size_t> first,
                                                  std::size_t n, F f) {
  if (system.gpu != nullptr) return gpu_for_each_n(*system.gpu, first, n, f);
  const std::size_t base = *first;
#if defined(_OPENMP)
  if (system.threads > 1 && n > 1) {
#pragma omp parallel for num_threads(system.threads) schedule(static)
    for (std::size_t k = 0; k < n; ++k) f(base + k);
    return first + static_cast<std::ptrdiff_t>(n);
  }
#endif
  for (std::size_t k = 0; k < n; ++k) f(base + k);
  return first + static_cast<std::ptrdiff_t>(n);
}

/// @brief reduce(f(first + k)) with `op`, from `init`; one partial result per thread,
/// combined in thread order (so the result does not depend on timing). Each thread's range
/// is reduced pairwise (halves, down to runs of 256 in order), so a float sum of n
/// elements errs by O(log n) roundings, not O(n), as a GPU's tree reduction.
template <class F, class T, class Op>
T transform_reduce([[maybe_unused]] place_system& system, thrust::counting_iterator<std::size_t> first,
                   thrust::counting_iterator<std::size_t> last, F f, T init, Op op) {
  if (system.gpu != nullptr) return gpu_transform_reduce(*system.gpu, first, last, f, init, op);
  const std::size_t base = *first, n = *last - *first;
  auto pairwise = [&](auto& self, std::size_t begin, std::size_t end) -> T {
    if (end - begin <= 256) {
      T acc = f(base + begin);
      for (std::size_t k = begin + 1; k < end; ++k) acc = op(acc, f(base + k));
      return acc;
    }
    const std::size_t mid = begin + (end - begin) / 2;
    return op(self(self, begin, mid), self(self, mid, end));
  };
  auto range = [&](std::size_t begin, std::size_t end) { return pairwise(pairwise, begin, end); };
#if defined(_OPENMP)
  if (system.threads > 1 && n >= parallel_grain) {
    constexpr int most = 64;
    T parts[most];
    int used = 1;
#pragma omp parallel num_threads(system.threads < most ? system.threads : most)
    {
      // the team may be smaller than asked (OMP_DYNAMIC, thread limits, nesting): split by its size
      const auto t = static_cast<std::size_t>(omp_get_thread_num()), nt = static_cast<std::size_t>(omp_get_num_threads());
      parts[t] = range(n * t / nt, n * (t + 1) / nt);
#pragma omp single
      used = static_cast<int>(nt);
    }
    T acc = init;
    for (int t = 0; t < used; ++t) acc = op(acc, parts[t]);
    return acc;
  }
#endif
  return n == 0 ? init : op(init, range(0, n));
}

/// @brief *out = reduce(f(first + k)) with `op`, from `init`: on a GPU place a kernel that
/// writes the result into device memory (queued, no wait); elsewhere at once.
template <class F, class T, class Op>
void transform_reduce_into(place_system& system, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last,
                           F f, T init, Op op, T* out) {
  if (system.gpu != nullptr) return gpu_transform_reduce_into(*system.gpu, first, last, f, init, op, out);
  *out = transform_reduce(system, first, last, f, init, op);
}

/// @brief out[s] = reduce over k in [0, length) of f(s, k) with `op`, from `init`, for s in
/// [0, segments): a reduction along a dim or a row. On a CPU place a loop per segment, in
/// order, segments in parallel over the place's cores; on a GPU place a block of threads per
/// long segment whose elements are `contiguous` in memory (CUB's segmented reduction, queued on
/// the compute stream), a thread per short or strided one.
template <class F, class T, class Op>
void segmented_reduce(place_system& system, std::size_t segments, std::size_t length, bool contiguous, F f, T init, Op op, T* out) {
  if (system.gpu != nullptr) return gpu_segmented_reduce(*system.gpu, segments, length, contiguous, f, init, op, out);
  transform(system, thrust::counting_iterator<std::size_t>(0), thrust::counting_iterator<std::size_t>(segments), out,
            reduce_segment<F, T, Op>{f, init, op, length});
}

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

/// @brief f(i) for i in [0, n), over data in the memory of `where` (a tensor's place; null:
/// host memory), run where that memory can be read: on a GPU's place (from its compute lane, the
/// calling thread waiting, when called from elsewhere), else as host loops over the calling
/// thread's cores (one core on a GPU place's lane).
template <class F>
void for_each_index(place_state* where, std::size_t n, F f) {
  if (on_gpu(where) && current_place() != where) return run_on_place(*where, [&] { for_each_index(where, n, f); });
  place_system system = current_place_system();
  if (system.gpu != memory_of(where)) system = place_system{};
  thrust::for_each_n(system, thrust::counting_iterator<std::size_t>(0), n, f);
}

}  // namespace pdo::detail
