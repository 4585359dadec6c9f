// tests/cuda_sim/src/cublas.cpp: the simulated cuBLAS: handles bound to a device and a
// stream, cuBLAS's parameter checks, and gemm (column-major, as cuBLAS) computed as device
// work on the handle's stream by the host BLAS where there is one.
#include "sim.hpp"

#include <cublas_v2.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#if defined(CUDA_SIM_WITH_CBLAS)
#include <cblas.h>
#endif

struct cublasContext {
  int device = 0;
  cudaStream_t stream = nullptr;
};

namespace {

using cuda_sim::allocation;
using cuda_sim::find_allocation;

cublasStatus_t refuse(const std::string& why) {
  if (std::getenv("PDO_SIM_VERBOSE") != nullptr) std::fprintf(stderr, "pdo cuda simulator: cuBLAS: %s\n", why.c_str());
  return CUBLAS_STATUS_INVALID_VALUE;
}

bool valid_op(cublasOperation_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C; }

/// @brief Whether `p` holds `elements` of `bytes` each in device memory of `device`.
bool on_device(const void* p, long long elements, std::size_t bytes, int device) {
  if (elements <= 0) return true;
  bool overruns = false;
  const allocation* a = find_allocation(p, static_cast<std::size_t>(elements) * bytes, &overruns);
  return a != nullptr && !overruns && a->device == device;
}

/// @brief The checks cuBLAS documents for ?gemm, and that the matrices are device memory
/// of the handle's device, reaching as far as the product reads and writes.
template <class T>
cublasStatus_t check_gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const T* alpha, const T* A,
                          int lda, const T* B, int ldb, const T* beta, const T* C, int ldc, long long sa, long long sb, long long sc,
                          int batches, const char* name) {
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  const std::string call = name;
  if (!valid_op(ta) || !valid_op(tb)) return refuse(call + ": transa or transb is not an operation");
  if (m < 0 || n < 0 || k < 0 || batches < 0) return refuse(call + ": m, n, k and batchCount must not be negative");
  const int rows_a = ta == CUBLAS_OP_N ? m : k, rows_b = tb == CUBLAS_OP_N ? k : n;
  if (lda < std::max(1, rows_a)) return refuse(call + ": lda " + std::to_string(lda) + " < max(1, " + std::to_string(rows_a) + ")");
  if (ldb < std::max(1, rows_b)) return refuse(call + ": ldb " + std::to_string(ldb) + " < max(1, " + std::to_string(rows_b) + ")");
  if (ldc < std::max(1, m)) return refuse(call + ": ldc " + std::to_string(ldc) + " < max(1, " + std::to_string(m) + ")");
  if (alpha == nullptr || beta == nullptr) return refuse(call + ": alpha and beta are needed");
  if (m == 0 || n == 0 || batches == 0) return CUBLAS_STATUS_SUCCESS;
  const long long cols_a = ta == CUBLAS_OP_N ? k : m, cols_b = tb == CUBLAS_OP_N ? n : k;
  auto span = [&](int ld, long long cols, long long rows, long long stride) {
    return (batches - 1) * stride + (cols - 1) * ld + rows;
  };
  if (k > 0 && (!on_device(A, span(lda, cols_a, rows_a, sa), sizeof(T), h->device) || !on_device(B, span(ldb, cols_b, rows_b, sb), sizeof(T), h->device)))
    return refuse(call + ": A or B is not device memory of the handle's device " + std::to_string(h->device) + " (or runs past it)");
  if (!on_device(C, span(ldc, n, m, sc), sizeof(T), h->device))
    return refuse(call + ": C is not device memory of the handle's device " + std::to_string(h->device) + " (or runs past it)");
  return CUBLAS_STATUS_SUCCESS;
}

/// @brief C = alpha op(A) op(B) + beta C, column-major, on the calling thread.
template <class T>
void gemm_now(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, T alpha, const T* A, int lda, const T* B, int ldb, T beta,
              T* C, int ldc) {
#if defined(CUDA_SIM_WITH_CBLAS)
  if (k > 0) {
    const auto a = ta == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, b = tb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans;
    if constexpr (std::is_same_v<T, float>) cblas_sgemm(CblasColMajor, a, b, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
    else cblas_dgemm(CblasColMajor, a, b, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
#endif
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      T acc{};
      for (int l = 0; l < k; ++l) {
        const T a = ta == CUBLAS_OP_N ? A[i + static_cast<long long>(l) * lda] : A[l + static_cast<long long>(i) * lda];
        const T b = tb == CUBLAS_OP_N ? B[l + static_cast<long long>(j) * ldb] : B[j + static_cast<long long>(l) * ldb];
        acc += a * b;
      }
      T& c = C[i + static_cast<long long>(j) * ldc];
      c = alpha * acc + (beta == T(0) ? T(0) : beta * c);
    }
}

template <class T>
cublasStatus_t gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const T* alpha, const T* A, int lda,
                    long long sa, const T* B, int ldb, long long sb, const T* beta, T* C, int ldc, long long sc, int batches,
                    const char* name) {
  if (const cublasStatus_t s = check_gemm(h, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc, sa, sb, sc, batches, name);
      s != CUBLAS_STATUS_SUCCESS || m == 0 || n == 0 || batches == 0)
    return s;
  cuda_sim::stream* st = cuda_sim::stream_of(h->stream);
  if (st == nullptr) return CUBLAS_STATUS_EXECUTION_FAILED;
  const T a = *alpha, b = *beta;  // host pointer mode: read at the call
  st->enqueue(cuda_sim::operation{[=] {
                                    for (int i = 0; i < batches; ++i)
                                      gemm_now<T>(ta, tb, m, n, k, a, A + i * sa, lda, B + i * sb, ldb, b, C + i * sc, ldc);
                                  },
                                  true, name});
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return CUBLAS_STATUS_NOT_INITIALIZED;
  *handle = new cublasContext{device, nullptr};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  int device = -1;
  if (stream != nullptr && (cudaStreamGetDevice(stream, &device) != cudaSuccess || device != handle->device))
    return refuse("cublasSetStream: a stream of device " + std::to_string(device) + " for a handle of device " +
                  std::to_string(handle->device));
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (stream == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *stream = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    default: return "CUBLAS_STATUS_INTERNAL_ERROR";
  }
}
const char* cublasGetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    default: return "an internal operation failed";
  }
}

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float* alpha,
                           const float* A, int lda, const float* B, int ldb, const float* beta, float* C, int ldc) {
  return gemm<float>(h, ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1, "cublasSgemm");
}
cublasStatus_t cublasDgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const double* alpha,
                           const double* A, int lda, const double* B, int ldb, const double* beta, double* C, int ldc) {
  return gemm<double>(h, ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1, "cublasDgemm");
}
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                         const float* alpha, const float* A, int lda, long long sa, const float* B, int ldb, long long sb,
                                         const float* beta, float* C, int ldc, long long sc, int batches) {
  return gemm<float>(h, ta, tb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batches, "cublasSgemmStridedBatched");
}
cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                         const double* alpha, const double* A, int lda, long long sa, const double* B, int ldb,
                                         long long sb, const double* beta, double* C, int ldc, long long sc, int batches) {
  return gemm<double>(h, ta, tb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batches, "cublasDgemmStridedBatched");
}

}  // extern "C"
