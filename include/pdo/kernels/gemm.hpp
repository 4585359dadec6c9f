// pdo/kernels/gemm.hpp: C = A * B on a place: BLAS ?gemm (CPU places) or cuBLAS (GPU places)
// for float and double, a Thrust kernel otherwise.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/kernels/place_system.hpp>
#include <pdo/place/copy.hpp>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#if defined(PDO_WITH_BLAS)
#include <cblas.h>
// OpenBLAS's thread count, where the BLAS is OpenBLAS (weak: absent elsewhere).
extern "C" void openblas_set_num_threads(int) __attribute__((weak));
extern "C" int openblas_get_num_threads() __attribute__((weak));
#endif

namespace pdo::detail {

/// @brief A row-major matrix operand at `data`, rows `ld` elements apart; with `trans`
/// the operand is the transpose of the matrix stored there.
template <class T>
struct matrix_ref {
  const T* data;
  std::size_t ld;
  bool trans = false;
  /// @brief Element (i, l) of the operand.
  PDO_HD const T& at(std::size_t i, std::size_t l) const { return trans ? data[l * ld + i] : data[i * ld + l]; }
};

/// @brief C[i, j] = sum over k of A[i, k] B[k, j], one output element per index.
template <class T>
struct gemm_element {
  matrix_ref<T> a, b;
  std::size_t n, k;
  PDO_HD T operator()(std::size_t index) const {
    const std::size_t i = index / n, j = index % n;
    T acc{};
    for (std::size_t l = 0; l < k; ++l) acc += a.at(i, l) * b.at(l, j);
    return acc;
  }
};

/// @brief Whether gemm runs on BLAS for element type T.
template <class T>
inline constexpr bool blas_gemm_v =
#if defined(PDO_WITH_BLAS)
    std::is_same_v<T, float> || std::is_same_v<T, double>;
#else
    false;
#endif

#if defined(PDO_WITH_CUDA)
/// @brief `n` as the int cuBLAS takes, or a pdo::error naming the call, what `n` is and the place.
inline int cublas_int(std::size_t n, const char* what, const char* call, const place_state& p) {
  if (n > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    throw error(std::string(call) + " on " + p.name + ": " + what + " " + std::to_string(n) +
                " exceeds cuBLAS's int extents; split the product");
  return static_cast<int>(n);
}

/// @brief C = A * B with cuBLAS on GPU place `p`'s compute stream. cuBLAS is column-major:
/// a row-major matrix is its transpose there, so it computes Cᵀ = op(B)ᵀ op(A)ᵀ. Empty
/// products never reach cuBLAS (gemm answers them), so every leading dimension is >= 1.
template <class T>
void cublas_gemm(place_state& p, std::size_t m, std::size_t n, std::size_t k, matrix_ref<T> a, matrix_ref<T> b, T* c) {
  cuda_device& d = cuda_device_of(p);
  device_guard guard(d.ordinal);
  const T one = 1, zero = 0;
  const auto ta = a.trans ? CUBLAS_OP_T : CUBLAS_OP_N, tb = b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const char* call = std::is_same_v<T, float> ? "cublasSgemm" : "cublasDgemm";
  const int M = cublas_int(m, "m", call, p), N = cublas_int(n, "n", call, p), K = cublas_int(k, "k", call, p);
  const int lda = cublas_int(a.ld, "lda", call, p), ldb = cublas_int(b.ld, "ldb", call, p);
  if constexpr (std::is_same_v<T, float>)
    cublas_check(cublasSgemm(d.blas, tb, ta, N, M, K, &one, b.data, ldb, a.data, lda, &zero, c, N), call, p.name);
  else
    cublas_check(cublasDgemm(d.blas, tb, ta, N, M, K, &one, b.data, ldb, a.data, lda, &zero, c, N), call, p.name);
}

/// @brief `batches` products C_i = A_i * B_i, A_i at a.data + i * stride_a (likewise B, C;
/// a stride of 0 repeats one matrix) as one cublas?gemmStridedBatched call. Empty blocks
/// (m, n or k of 0, as uneven splits give) are answered here: cuBLAS refuses leading
/// dimensions of 0.
template <class T>
void cublas_gemm_batched(place_state& p, std::size_t batches, std::size_t m, std::size_t n, std::size_t k, matrix_ref<T> a,
                         std::size_t stride_a, matrix_ref<T> b, std::size_t stride_b, T* c) {
  if (batches == 0 || m == 0 || n == 0) return;
  if (k == 0) {
    const T zero{};
    fill_bytes(&p, c, &zero, sizeof(T), batches * m * n);
    return;
  }
  cuda_device& d = cuda_device_of(p);
  device_guard guard(d.ordinal);
  const T one = 1, zero = 0;
  const auto ta = a.trans ? CUBLAS_OP_T : CUBLAS_OP_N, tb = b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const char* call = std::is_same_v<T, float> ? "cublasSgemmStridedBatched" : "cublasDgemmStridedBatched";
  const int M = cublas_int(m, "m", call, p), N = cublas_int(n, "n", call, p), K = cublas_int(k, "k", call, p);
  const int count = cublas_int(batches, "batch count", call, p);
  const int lda = cublas_int(a.ld, "lda", call, p), ldb = cublas_int(b.ld, "ldb", call, p);
  const auto sa = static_cast<long long>(stride_a), sb = static_cast<long long>(stride_b), sc = static_cast<long long>(m * n);
  if constexpr (std::is_same_v<T, float>)
    cublas_check(cublasSgemmStridedBatched(d.blas, tb, ta, N, M, K, &one, b.data, ldb, sb, a.data, lda, sa, &zero, c, N, sc, count), call,
                 p.name);
  else
    cublas_check(cublasDgemmStridedBatched(d.blas, tb, ta, N, M, K, &one, b.data, ldb, sb, a.data, lda, sa, &zero, c, N, sc, count), call,
                 p.name);
}
#endif

/// @brief The element types cuBLAS multiplies for pdo (others take the Thrust kernel on a GPU).
template <class T>
inline constexpr bool cublas_element = std::is_same_v<T, float> || std::is_same_v<T, double>;

#if defined(PDO_WITH_BLAS)
/// @brief C = alpha A B + beta C by one BLAS call on the calling thread, C's rows `ldc` apart
/// (alpha 1, beta 0: C = A B, C not read). BLAS's own threads are off (see blas_threads_off):
/// a place's gemm uses its cores by cutting the product into one block per core (gemm).
template <class T>
void blas_gemm(std::size_t m, std::size_t n, std::size_t k, matrix_ref<T> a, matrix_ref<T> b, T* c, std::size_t ldc, T alpha = T(1),
               T beta = T(0)) {
  const auto M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  const auto ta = a.trans ? CblasTrans : CblasNoTrans, tb = b.trans ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, a.data, static_cast<int>(a.ld), b.data, static_cast<int>(b.ld), beta, c,
                static_cast<int>(ldc));
  else
    cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, alpha, a.data, static_cast<int>(a.ld), b.data, static_cast<int>(b.ld), beta, c,
                static_cast<int>(ldc));
}

/// @brief OpenBLAS's thread count is process-wide: with its own threads, the gemms of two
/// places would each spread over every core. pdo keeps it at one thread: set before its BLAS
/// calls whenever something else changed it (a program that calls BLAS itself meets the
/// same setting, and one that raises it has it lowered again at pdo's next gemm).
inline void blas_threads_off() {
  if (openblas_get_num_threads != nullptr && openblas_set_num_threads != nullptr && openblas_get_num_threads() != 1)
    openblas_set_num_threads(1);
}
#endif

/// @brief Products smaller than this many multiply-adds run as one BLAS call on one core.
inline constexpr std::size_t gemm_split_grain = std::size_t{1} << 21;

/// @brief The part of a dim of `extent` that block t of `parts` takes: cut at multiples of
/// 16 (whole register tiles of BLAS's kernels) where the extent allows.
inline std::pair<std::size_t, std::size_t> gemm_block(std::size_t extent, std::size_t parts, std::size_t t) {
  const std::size_t unit = extent >= 16 * parts ? 16 : 1, units = (extent + unit - 1) / unit;
  const std::size_t lo = std::min(extent, chunk_offset(units, parts, t) * unit);
  const std::size_t hi = std::min(extent, (chunk_offset(units, parts, t) + chunk_size(units, parts, t)) * unit);
  return {lo, hi};
}

#if defined(PDO_WITH_BLAS)
/// @brief C = alpha A B + beta C (C m x n, its rows `ldc` apart) by BLAS on a CPU place's
/// cores: on a place of several cores the product is cut into one block of C's rows (or, for
/// few rows, columns) per core, each a one-thread BLAS call on the place's own OpenMP team,
/// so that a place's gemm uses exactly its cores, whatever the other places do. For float
/// and double (blas_gemm_v); m, n and k not 0.
template <class T>
void blas_gemm_on_cores(cpu_system& system, std::size_t m, std::size_t n, std::size_t k, matrix_ref<T> a, matrix_ref<T> b, T* c,
                        std::size_t ldc, T alpha = T(1), T beta = T(0)) {
  blas_threads_off();
  const std::size_t parts = static_cast<std::size_t>(system.threads);
  if (parts <= 1 || m * n * k < gemm_split_grain) return blas_gemm(m, n, k, a, b, c, ldc, alpha, beta);
  const bool by_rows = m >= n || m >= 16 * parts;
  // block t: rows [lo, hi) of C (A's rows), or columns [lo, hi) (B's columns)
  auto block = [&](std::size_t t) {
    const auto [lo, hi] = gemm_block(by_rows ? m : n, parts, t);
    if (lo == hi) return;
    if (by_rows) {
      const matrix_ref<T> rows{a.trans ? a.data + lo : a.data + lo * a.ld, a.ld, a.trans};
      blas_gemm(hi - lo, n, k, rows, b, c + lo * ldc, ldc, alpha, beta);
    } else {
      const matrix_ref<T> cols{b.trans ? b.data + lo * b.ld : b.data + lo, b.ld, b.trans};
      blas_gemm(m, hi - lo, k, a, cols, c + lo, ldc, alpha, beta);
    }
  };
  // block t on thread t (and block t + nt, when the team is smaller than asked)
  const std::pair<const decltype(block)*, std::size_t> job{&block, parts};
  run_team(system.threads, [](void* c, std::size_t t, std::size_t nt) {
    const auto& [blocks, count] = *static_cast<const decltype(job)*>(c);
    for (std::size_t b = t; b < count; b += nt) (*blocks)(b);
  }, const_cast<void*>(static_cast<const void*>(&job)));
}
#endif

/// @brief C (m x n, dense, row-major) = A (m x k) * B (k x n) on a CPU place's cores: BLAS
/// (blas_gemm_on_cores) for float and double; without BLAS, or for other element types, a
/// Thrust kernel.
template <class T>
void gemm(cpu_system& system, std::size_t m, std::size_t n, std::size_t k, matrix_ref<T> a, matrix_ref<T> b, T* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    std::fill_n(c, m * n, T{});
    return;
  }
  if constexpr (blas_gemm_v<T>) {
#if defined(PDO_WITH_BLAS)
    blas_gemm_on_cores(system, m, n, k, a, b, c, n);
#endif
  } else {
    thrust::transform(system, thrust::counting_iterator<std::size_t>(0), thrust::counting_iterator<std::size_t>(m * n), c,
                      gemm_element<T>{a, b, n, k});
  }
}

/// @brief C = A * B on a GPU place's compute stream: cuBLAS for float and double, a Thrust
/// kernel for other element types.
template <class T>
void gemm(gpu_system& system, std::size_t m, std::size_t n, std::size_t k, matrix_ref<T> a, matrix_ref<T> b, T* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    const T zero{};
    fill_bytes(system.place, c, &zero, sizeof(T), m * n);
    return;
  }
#if defined(PDO_WITH_CUDA)
  if constexpr (cublas_element<T>)
    cublas_gemm(*system.place, m, n, k, a, b, c);
  else
#endif
    transform(system, thrust::counting_iterator<std::size_t>(0), thrust::counting_iterator<std::size_t>(m * n), c,
              gemm_element<T>{a, b, n, k});
}

/// @brief C = A * B on the place of `system` (its backend's gemm).
template <class T>
void gemm(place_system& system, std::size_t m, std::size_t n, std::size_t k, matrix_ref<T> a, matrix_ref<T> b, T* c) {
  system.visit([&](auto& backend) { gemm<T>(backend, m, n, k, a, b, c); });
}

/// @brief `batches` products C_i = A_i * B_i, A_i at a.data + i * stride_a (likewise B; a
/// stride of 0 repeats one matrix), C_i m x n apart, as one call where the backend has one
/// (cuBLAS's strided batched gemm on a GPU place); returns whether it had: otherwise the
/// caller multiplies the batches one by one.
template <class T>
bool gemm_strided_batched([[maybe_unused]] place_system& system, [[maybe_unused]] std::size_t batches, [[maybe_unused]] std::size_t m,
                          [[maybe_unused]] std::size_t n, [[maybe_unused]] std::size_t k, [[maybe_unused]] matrix_ref<T> a,
                          [[maybe_unused]] std::size_t stride_a, [[maybe_unused]] matrix_ref<T> b, [[maybe_unused]] std::size_t stride_b,
                          [[maybe_unused]] T* c) {
#if defined(PDO_WITH_CUDA)
  if constexpr (cublas_element<T>) {
    return system.visit([&](auto& backend) {
      if constexpr (gpu_backend<decltype(backend)>) {
        cublas_gemm_batched<T>(*backend.place, batches, m, n, k, a, stride_a, b, stride_b, c);
        return true;
      } else {
        return false;
      }
    });
  } else {
    return false;
  }
#else
  return false;
#endif
}

}  // namespace pdo::detail
