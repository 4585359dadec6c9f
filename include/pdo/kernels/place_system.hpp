// pdo/kernels/place_system.hpp: a Thrust system per backend (a CPU place's cores, a GPU place's
// compute stream), each with its own algorithms, and the system of the place a kernel runs on.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/error.hpp>
#include <pdo/kernels/cuda_system.hpp>
#include <pdo/place/place_state.hpp>

#include <thrust/functional.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/for_each.h>
#include <thrust/reduce.h>
#include <thrust/execution_policy.h>
#include <thrust/system/cpp/execution_policy.h>
#include <thrust/transform.h>
#include <thrust/transform_reduce.h>

#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__clang__)
// The kernels' loops ask for vectorization (`omp simd`); those that gather (conv, pooling,
// indexing) cannot have it, and clang's optimizer reports each such loop as a warning at the
// place the loop was inlined into: in a user's code, or with no location at all. A
// push/pop around the loops cannot cover those places, so the warning is off from here to the
// end of the translation unit (it only ever reports a vectorization request that failed).
#pragma clang diagnostic ignored "-Wpass-failed"
#endif

namespace pdo::detail {

/// @brief The CPU backend: Thrust's C++ system, except for the algorithms pdo's kernels use,
/// which it runs as vectorised loops over `threads` cores of a place (an OpenMP team,
/// inheriting the place's pinning), found by Thrust through argument-dependent lookup.
struct cpu_system : thrust::system::cpp::execution_policy<cpu_system> {
  int threads = 1;
};

/// @brief The GPU backend: the algorithms pdo's kernels use, run with the same functors on the
/// compute stream of GPU place `place` (pdo/kernels/cuda_system.hpp). It derives from Thrust's
/// generic policy, not from a host system's: an algorithm it lacks does not compile (Thrust's
/// generic layer asserts), rather than running host loops over device memory.
struct gpu_system : thrust::execution_policy<gpu_system> {
  place_state* place = nullptr;
};

/// @brief Whether backend `B` (cpu_system or gpu_system) is the GPU's: for the kernels that
/// take another algorithm there (`if constexpr`).
template <class B>
inline constexpr bool gpu_backend = std::is_same_v<std::remove_cvref_t<B>, gpu_system>;

/// @brief The system of the place a kernel runs on, which is known only at run time: the one
/// run-time choice of backend. Every algorithm called with it picks the backend once, by
/// visit(), and calls that backend's own overload (chosen at compile time). It derives from
/// Thrust's generic policy too: a Thrust algorithm pdo has no overload for does not compile.
struct place_system : thrust::execution_policy<place_system> {
  int threads = 1;
  place_state* gpu = nullptr;  ///< the GPU place whose compute stream runs the kernels, if any

  /// @brief f(backend): f called with the gpu_system of `gpu`, or the cpu_system of `threads`.
  template <class F>
  decltype(auto) visit(F&& f) const {
    if (gpu != nullptr) {
      gpu_system g;
      g.place = gpu;
      return f(g);
    }
    cpu_system c;
    c.threads = threads;
    return f(c);
  }
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


/// @brief Runs `body(context, t, nt)` on each thread `t` of a team of `nt` (at most
/// `threads`; the team may be smaller: OMP_DYNAMIC, thread limits, nesting): the one OpenMP
/// parallel region of pdo's CPU kernels. Each kernel is a plain function over a range of its
/// indices, called here by every thread with its part: one region, compiled once, not one
/// outlined region per kernel type (which the compilers' OpenMP passes would analyse each).
PDO_NOINLINE inline void run_team([[maybe_unused]] int threads, void (*body)(void* context, std::size_t t, std::size_t nt),
                                  void* context) {
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
  body(context, static_cast<std::size_t>(omp_get_thread_num()), static_cast<std::size_t>(omp_get_num_threads()));
#else
  body(context, 0, 1);
#endif
}

/// @brief Part `t` of `nt` equal parts of [0, n): its first index and the next part's.
constexpr std::pair<std::size_t, std::size_t> team_part(std::size_t n, std::size_t t, std::size_t nt) {
  return {n * t / nt, n * (t + 1) / nt};
}

/// @brief out[k] = f(base + k) for k in [begin, end), vectorized. The functor is copied to a
/// local, so that the stores to `out` cannot be taken to change it and its loads stay plain
/// vector loads (a shared one turns them into gathers).
template <class F, class Out>
void transform_range(const F& f, std::size_t base, Out out, std::size_t begin, std::size_t end) {
  const F local = f;
#pragma omp simd
  for (std::size_t k = begin; k < end; ++k) out[k] = local(base + k);
}

/// @brief f(base + k) for k in [begin, end), in order.
template <class F>
void for_each_range(const F& f, std::size_t base, std::size_t begin, std::size_t end) {
  for (std::size_t k = begin; k < end; ++k) f(base + k);
}

/// @brief out[k] = f(first + k) for k in [0, last - first): the form every pdo kernel
/// has (a functor of the output index).
template <class F, class Out>
Out transform([[maybe_unused]] cpu_system& system, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last,
              Out out, F f) {
  const std::size_t base = *first, n = *last - *first;
  if (system.threads > 1 && n >= parallel_grain) {
    struct job {
      const F& f;
      std::size_t base, n;
      Out out;
    } j{f, base, n, out};
    run_team(system.threads, [](void* c, std::size_t t, std::size_t nt) {
      const job& j = *static_cast<const job*>(c);
      const auto [begin, end] = team_part(j.n, t, nt);
      transform_range(j.f, j.base, j.out, begin, end);
    }, &j);
  } else {
    // one core: no team is started (that alone costs more than a small kernel)
    transform_range(f, base, out, 0, n);
  }
  return out + static_cast<std::ptrdiff_t>(n);
}

/// @brief f(base + k) for k in [begin, end), vectorized: for elementwise items, each reading
/// and writing its own elements. The functor is copied to a local, as in transform_range (its
/// pointers then stay in registers, and the loads and stores through them are vector ones).
template <class F>
void for_each_element_range(const F& f, std::size_t base, std::size_t begin, std::size_t end) {
  const F local = f;
#pragma omp simd
  for (std::size_t k = begin; k < end; ++k) local(base + k);
}

/// @brief `Range(f, base, begin, end)` over the parts of [0, n): on the place's cores, a part
/// each, when it has several and more than `grain` items; else on the calling thread, whole.
template <auto Range, class F>
void over_team(const cpu_system& system, std::size_t base, std::size_t n, std::size_t grain, const F& f) {
  if (system.threads > 1 && n > grain) {
    struct job {
      const F& f;
      std::size_t base, n;
    } j{f, base, n};
    run_team(system.threads, [](void* c, std::size_t t, std::size_t nt) {
      const job& j = *static_cast<const job*>(c);
      const auto [begin, end] = team_part(j.n, t, nt);
      Range(j.f, j.base, begin, end);
    }, &j);
  } else {
    Range(f, base, 0, n);
  }
}

/// @brief f(first + k) for k in [0, n), for elementwise work items (each writes the elements
/// of its own index: an optimizer's update, a gradient's accumulation), vectorized, in
/// parallel over the place's cores.
template <class F>
void for_each_element(cpu_system& system, thrust::counting_iterator<std::size_t> first, std::size_t n, F f) {
  over_team<&for_each_element_range<F>>(system, *first, n, parallel_grain - 1, f);
}

/// @brief f(first + k) for k in [0, n), for work items that write several outputs each
/// (a row of a softmax); items run in parallel over the place's cores.
template <class F>
thrust::counting_iterator<std::size_t> for_each_n(cpu_system& system, thrust::counting_iterator<std::size_t> first, std::size_t n, F f) {
  over_team<&for_each_range<F>>(system, *first, n, 1, f);
  return first + static_cast<std::ptrdiff_t>(n);
}

/// @brief reduce(f(first + k)) with `op`, from `init`; one partial result per thread,
/// combined in thread order (so the result does not depend on timing). Each thread's range
/// is reduced pairwise (halves, down to runs of 256 in order), so a float sum of n
/// elements errs by O(log n) roundings, not O(n), as a GPU's tree reduction.
template <class F, class T, class Op>
T transform_reduce([[maybe_unused]] cpu_system& system, thrust::counting_iterator<std::size_t> first,
                   thrust::counting_iterator<std::size_t> last, F f, T init, Op op) {
  const std::size_t base = *first, n = *last - *first;
  struct job {
    const F& f;
    const Op& op;
    std::size_t base;
    T range(std::size_t begin, std::size_t end) const {
      if (end - begin <= 256) {
        T acc = f(base + begin);
        for (std::size_t k = begin + 1; k < end; ++k) acc = op(acc, f(base + k));
        return acc;
      }
      const std::size_t mid = begin + (end - begin) / 2;
      return op(range(begin, mid), range(mid, end));
    }
  };
  const job whole{f, op, base};
  if (system.threads > 1 && n >= parallel_grain) {
    constexpr std::size_t most = 64;
    struct team_job {
      const job& j;
      std::size_t n;
      T parts[most];
      std::size_t used;
    } tj{whole, n, {}, 1};
    run_team(system.threads < static_cast<int>(most) ? system.threads : static_cast<int>(most), [](void* c, std::size_t t, std::size_t nt) {
      auto& tj = *static_cast<team_job*>(c);
      const auto [begin, end] = team_part(tj.n, t, nt);
      tj.parts[t] = tj.j.range(begin, end);
      if (t == 0) tj.used = nt;
    }, &tj);
    T acc = init;
    for (std::size_t t = 0; t < tj.used; ++t) acc = op(acc, tj.parts[t]);
    return acc;
  }
  return n == 0 ? init : op(init, whole.range(0, n));
}

/// @brief *out = reduce(f(first + k)) with `op`, from `init`, at once.
template <class F, class T, class Op>
void transform_reduce_into(cpu_system& system, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last,
                           F f, T init, Op op, T* out) {
  *out = transform_reduce(system, first, last, f, init, op);
}

/// @brief out[s] = reduce over k in [0, length) of f(s, k) with `op`, from `init`, for s in
/// [0, segments): a reduction along a dim or a row, a loop per segment, in order, segments in
/// parallel over the place's cores.
template <class F, class T, class Op, class Out>
void segmented_reduce(cpu_system& system, std::size_t segments, std::size_t length, bool, F f, T init, Op op, Out out) {
  transform(system, thrust::counting_iterator<std::size_t>(0), thrust::counting_iterator<std::size_t>(segments), out,
            reduce_segment<F, T, Op>{f, init, op, length});
}

/// @name The GPU backend's algorithms: the same functors on the place's compute stream.
/// @{
template <class F, class Out>
Out transform(gpu_system& system, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last, Out out, F f) {
  return gpu_transform(*system.place, first, last, out, f);
}
template <class F>
thrust::counting_iterator<std::size_t> for_each_n(gpu_system& system, thrust::counting_iterator<std::size_t> first, std::size_t n, F f) {
  return gpu_for_each_n(*system.place, first, n, f);
}
template <class F>
void for_each_element(gpu_system& system, thrust::counting_iterator<std::size_t> first, std::size_t n, F f) {
  gpu_for_each_n(*system.place, first, n, f);
}
/// @brief The reduction, brought back to the host (waits for the place's compute stream).
template <class F, class T, class Op>
T transform_reduce(gpu_system& system, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last, F f,
                   T init, Op op) {
  return gpu_transform_reduce(*system.place, first, last, f, init, op);
}
/// @brief *out (device memory) = the reduction, by a kernel queued on the compute stream (no wait).
template <class F, class T, class Op>
void transform_reduce_into(gpu_system& system, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last,
                           F f, T init, Op op, T* out) {
  gpu_transform_reduce_into(*system.place, first, last, f, init, op, out);
}
/// @brief A block of threads per long segment whose elements are `contiguous` in memory (CUB's
/// segmented reduction), a thread per short or strided one.
template <class F, class T, class Op, class Out>
void segmented_reduce(gpu_system& system, std::size_t segments, std::size_t length, bool contiguous, F f, T init, Op op, Out out) {
  gpu_segmented_reduce(*system.place, segments, length, contiguous, f, init, op, out);
}
/// @}

/// @name Algorithms on the system of a place known at run time: its backend's own.
/// @{
template <class F, class Out>
Out transform(place_system& system, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last, Out out, F f) {
  return system.visit([&](auto& backend) { return transform(backend, first, last, out, f); });
}
template <class F>
thrust::counting_iterator<std::size_t> for_each_n(place_system& system, thrust::counting_iterator<std::size_t> first, std::size_t n, F f) {
  return system.visit([&](auto& backend) { return for_each_n(backend, first, n, f); });
}
template <class F>
void for_each_element(place_system& system, thrust::counting_iterator<std::size_t> first, std::size_t n, F f) {
  system.visit([&](auto& backend) { for_each_element(backend, first, n, f); });
}
template <class F, class T, class Op>
T transform_reduce(place_system& system, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last, F f,
                   T init, Op op) {
  return system.visit([&](auto& backend) { return transform_reduce(backend, first, last, f, init, op); });
}
/// @brief *out (in the memory of the system's place) = reduce(f(first + k)) with `op`, from
/// `init`: on a GPU place written by a kernel (queued, no wait); elsewhere at once.
template <class F, class T, class Op>
void transform_reduce_into(place_system& system, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last,
                           F f, T init, Op op, T* out) {
  system.visit([&](auto& backend) { transform_reduce_into(backend, first, last, f, init, op, out); });
}
/// @brief out[s] = reduce over k in [0, length) of f(s, k) with `op`, from `init`, for s in
/// [0, segments): a reduction along a dim or a row (see the backends' overloads). `out` is a
/// pointer or an output iterator (one that scales what it is given finishes a mean in the
/// same pass).
template <class F, class T, class Op, class Out>
void segmented_reduce(place_system& system, std::size_t segments, std::size_t length, bool contiguous, F f, T init, Op op, Out out) {
  system.visit([&](auto& backend) { segmented_reduce(backend, segments, length, contiguous, f, init, op, out); });
}
/// @}

/// @brief f(i) for i in [0, n), each i reading and writing only the elements of index i (an
/// elementwise update), over data in the memory of `where` (a tensor's place; null: host
/// memory), run where that memory can be read: on a GPU's place (from its compute lane, the
/// calling thread waiting, when called from elsewhere), else as vectorized host loops over the
/// calling thread's cores (one core on a GPU place's lane).
template <class F>
void for_each_index(place_state* where, std::size_t n, F f) {
  if (on_gpu(where) && current_place() != where) return run_on_place(*where, [&] { for_each_index(where, n, f); });
  place_system system = current_place_system();
  if (system.gpu != memory_of(where)) system = place_system{};
  for_each_element(system, thrust::counting_iterator<std::size_t>(0), n, f);
}

}  // namespace pdo::detail
