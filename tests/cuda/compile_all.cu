// tests/cuda/compile_all.cu: nvcc compiles every public header (but the MPI ones) and runs CPU and GPU code.
// every public header but the MPI ones, listed by CMake from include/ (so none is missed)
#include "all_headers.hpp"
#include <pdo/pdo.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdio>
#include <exception>

#if !defined(PDO_WITH_CUDA)
#error "compile_all.cu must be built with PDO_WITH_CUDA (link pdo::cuda)"
#endif

namespace {

static_assert(pdo::detail::cuda_enabled);

/// @brief The chunk rule of pdo::detail::chunk_size, callable on host and device.
struct chunk_rule {
  std::size_t extent;
  std::size_t parts;
  PDO_HD std::size_t operator()(std::size_t index) const { return extent / parts + (index < extent % parts ? 1 : 0); }
};

__global__ void chunk_sizes(chunk_rule rule, std::size_t* out) {
  const std::size_t i = threadIdx.x;
  if (i < rule.parts) out[i] = rule(i);
}

/// @brief distribute, redistribute, parallel_do and gather a float tensor on two CPU places.
bool run_cpu() {
  using pdo::replicate;
  using pdo::split;
  const auto places = pdo::cpu_places(2);
  const auto mesh = pdo::make_mesh<"dp">(places, {2});
  pdo::tensor<float, 2> host({5, 3});
  for (std::size_t i = 0; i < host.size(); ++i) host.data()[i] = 0.5f * static_cast<float>(i);
  const auto x = pdo::distribute<pdo::layout<split<"dp">, replicate>>(mesh, host);
  const auto y = pdo::redistribute<pdo::layout<replicate, split<"dp">>>(x);
  const auto z = pdo::parallel_do<pdo::layout<replicate, split<"dp">>>(
      [](const pdo::tensor<float, 2>& shard) {
        auto out = shard;
        for (auto& v : out) v *= 2.0f;
        return out;
      },
      y);
  const auto back = pdo::gather(y);
  const auto doubled = pdo::gather(z);
  if (back.shape() != host.shape() || doubled.shape() != host.shape()) return false;
  for (std::size_t i = 0; i < host.size(); ++i)
    if (back.data()[i] != host.data()[i] || doubled.data()[i] != 2.0f * host.data()[i]) return false;
  return x.local_shards().front().extent(0) == 3 && y.local_shards().back().extent(1) == 1;
}

/// @brief GPU places and a kernel that calls a PDO_HD function.
bool run_gpu() {
  const auto places = pdo::cuda_places();
  if (places.empty()) return false;
  const chunk_rule rule{10, 4};
  std::size_t* device_out = nullptr;
  if (cudaMalloc(&device_out, rule.parts * sizeof(std::size_t)) != cudaSuccess) return false;
  chunk_sizes<<<1, 32>>>(rule, device_out);
  std::size_t out[4] = {};
  const bool copied = cudaMemcpy(out, device_out, sizeof out, cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(device_out);
  if (!copied) return false;
  for (std::size_t k = 0; k < rule.parts; ++k)
    if (out[k] != pdo::detail::chunk_size(rule.extent, rule.parts, k)) return false;
  return true;
}

}  // namespace

int main() {
  try {
    if (!run_cpu()) {
      std::puts("FAILED: distribute/redistribute/gather on CPU places");
      return 1;
    }
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess || count == 0) {
      std::printf("SKIPPED: no CUDA device (%s)\n",
                  status != cudaSuccess ? cudaGetErrorString(status) : "cudaGetDeviceCount found 0 devices");
      return 77;
    }
    if (!run_gpu()) {
      std::puts("FAILED: CUDA places or the chunk_sizes kernel");
      return 1;
    }
    std::printf("OK: %d CUDA device(s)\n", count);
    return 0;
  } catch (const std::exception& e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
}
