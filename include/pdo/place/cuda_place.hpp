// pdo/place/cuda_place.hpp: GPU places. The type always exists, so generic code and
// meshes can name it; creating one needs a build with PDO_WITH_CUDA.
#pragma once

#include <pdo/core/error.hpp>
#include <pdo/place/place_concept.hpp>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#if defined(PDO_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pdo {

namespace detail {
/// @brief True when this translation unit was built with the CUDA backend.
#if defined(PDO_WITH_CUDA)
inline constexpr bool cuda_enabled = true;
#else
inline constexpr bool cuda_enabled = false;
#endif

#if defined(PDO_WITH_CUDA)
inline memory_system cuda_memory_system(int device) {
  return {[](std::size_t bytes, int dev) -> void* {
            void* p = nullptr;
            if (cudaSetDevice(dev) != cudaSuccess || cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
            return p;
          },
          [](void* p, std::size_t, int dev) noexcept {
            cudaSetDevice(dev);
            cudaFree(p);
          },
          device, "cuda"};
}
#endif
}  // namespace detail

/// @brief A CUDA GPU place: a host worker thread that drives device `ordinal`, and a
/// caching allocator of device memory with the same statistics and cap as CPU places.
class cuda_place : public detail::place_handle<cuda_place> {
 public:
  /// @brief A handle to the GPU place behind `state`.
  explicit cuda_place(std::shared_ptr<detail::place_state> state) : place_handle(std::move(state)) {}

#if defined(PDO_WITH_CUDA)
  /// @brief A new place for GPU `device`, with an optional memory cap in bytes.
  explicit cuda_place(int device, std::size_t memory_cap = 0)
      : place_handle(std::make_shared<detail::place_state>(place_kind::cuda, device, 0, true, std::vector<int>{},
                                                           "cuda:" + std::to_string(device))) {
    state_->memory = std::make_unique<caching_allocator>(state_->name, memory_cap, detail::cuda_memory_system(device));
    detail::start_worker(*state_, {});
    state_->runner->submit([device] { cudaSetDevice(device); });
  }
#endif

  /// @brief The CUDA device ordinal.
  [[nodiscard]] int device() const { return ordinal(); }
};

#if defined(PDO_WITH_CUDA)
/// @brief One place per visible GPU.
inline std::vector<cuda_place> cuda_places() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  std::vector<cuda_place> places;
  for (int d = 0; d < count; ++d) places.emplace_back(d);
  return places;
}
#endif

}  // namespace pdo
