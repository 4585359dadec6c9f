// pdo/place/cuda_place.hpp: GPU places. The type always exists, so generic code and
// meshes can name it; creating one needs a build with PDO_WITH_CUDA.
//
// A GPU place is a set of host lanes (threads) that drive one device, with three streams:
// compute (every kernel, cuBLAS call and copy of the place, in order), communication (NCCL)
// and copy (the copies its copy lane makes: batches prefetched onto it), ordered against each
// other by events, never by a device-wide synchronisation. Its
// caching allocator takes device memory from the stream-ordered allocator
// (cudaMallocAsync on the compute stream; cudaMalloc where the device has no memory
// pools), with the same statistics and cap as CPU places. A block freed on the host is
// reused by later work of the compute stream, which runs after the work that used it.
#pragma once

#include <pdo/core/error.hpp>
#include <pdo/place/place_concept.hpp>

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#if defined(PDO_WITH_CUDA)
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#endif

namespace pdo {

namespace detail {
/// @brief True when this translation unit was built with the CUDA backend.
#if defined(PDO_WITH_CUDA)
inline constexpr bool cuda_enabled = true;
#else
inline constexpr bool cuda_enabled = false;
#endif

/// @brief The error for work on a GPU place in a build without the CUDA backend.
[[noreturn]] inline void no_cuda(const std::string& what, const std::string& place) {
  throw error(what + " on " + place + ": this program was built without the CUDA backend (PDO_WITH_CUDA)");
}

#if defined(PDO_WITH_CUDA)
/// @brief "out of memory (cudaErrorMemoryAllocation)".
inline std::string cuda_status(cudaError_t status) {
  return std::string(cudaGetErrorString(status)) + " (" + cudaGetErrorName(status) + ")";
}

/// @brief Throws, for a failed CUDA runtime call, a pdo::error naming the call and the
/// place (pdo::out_of_memory when the device is out of memory).
inline void cuda_check(cudaError_t status, const char* call, const std::string& where) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();  // clears the error unless it is sticky
  const std::string message = std::string(call) + " on " + where + ": " + cuda_status(status);
  if (status == cudaErrorMemoryAllocation) throw out_of_memory(message);
  throw error(message);
}

/// @brief Throws, for a failed cuBLAS call, a pdo::error naming the call and the place.
inline void cublas_check(cublasStatus_t status, const char* call, const std::string& where) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw error(std::string(call) + " on " + where + ": " + cublasGetStatusString(status));
}

/// @brief Makes `device` the calling thread's current device for its lifetime, and
/// restores the one before (host threads that are not a place's lanes keep theirs).
class device_guard {
 public:
  explicit device_guard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) cudaSetDevice(device);
  }
  ~device_guard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int previous_ = -1;
};

/// @brief A GPU place's device resources: its streams, its cuBLAS handle (bound to the
/// compute stream), two pinned host buffers for copies staged through the host, and the
/// checks of the NCCL communicators that use its streams (see failures()).
struct cuda_device {
  int ordinal = 0;
  std::string name;
  bool pools = false;  ///< the device supports the stream-ordered allocator
  cudaStream_t compute = nullptr;
  cudaStream_t comm = nullptr;
  cudaStream_t copy = nullptr;  ///< the copy lane's copies
  cublasHandle_t blas = nullptr;

  std::mutex order_mutex;            ///< guards order_event between its record and the wait on it
  cudaEvent_t order_event = nullptr;  ///< marks work of this device's streams that another stream waits for

  static constexpr std::size_t staging_bytes = std::size_t{4} << 20;
  std::mutex staging_mutex;      ///< one staged copy from this device at a time
  void* staging[2] = {nullptr, nullptr};
  cudaEvent_t staged[2] = {nullptr, nullptr};      ///< buffer b holds its chunk (an event of this device)
  cudaEvent_t last_upload[2] = {nullptr, nullptr};  ///< buffer b's last upload has read it (an event of that upload's device)
  std::map<int, cudaEvent_t> upload_events[2];      ///< per destination device: the events made there for buffer b

  std::mutex checks_mutex;
  std::vector<std::pair<const void*, std::function<std::string()>>> checks;  ///< owner, check

  cuda_device(int device, std::string label) : ordinal(device), name(std::move(label)) {
    device_guard guard(device);
    int supported = 0;
    cuda_check(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device), "cudaDeviceGetAttribute", name);
    pools = supported != 0;
    cuda_check(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", name);
    cuda_check(cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", name);
    cuda_check(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", name);
    cublas_check(cublasCreate(&blas), "cublasCreate", name);
    cublas_check(cublasSetStream(blas, compute), "cublasSetStream", name);
    cuda_check(cudaEventCreateWithFlags(&order_event, cudaEventDisableTiming), "cudaEventCreateWithFlags", name);
  }
  ~cuda_device() {
    {
      device_guard guard(ordinal);
      if (compute) cudaStreamSynchronize(compute);
      if (comm) cudaStreamSynchronize(comm);
      if (copy) cudaStreamSynchronize(copy);
    }
    for (int b = 0; b < 2; ++b) {
      if (last_upload[b]) cudaEventSynchronize(last_upload[b]);  // the upload from the buffer has read it
      for (auto& [device, event] : upload_events[b]) {
        device_guard guard(device);
        cudaEventDestroy(event);
      }
      device_guard guard(ordinal);
      if (staged[b]) cudaEventDestroy(staged[b]);
      if (staging[b]) cudaFreeHost(staging[b]);
    }
    device_guard guard(ordinal);
    if (order_event) cudaEventDestroy(order_event);
    if (blas) cublasDestroy(blas);
    if (copy) cudaStreamDestroy(copy);
    if (comm) cudaStreamDestroy(comm);
    if (compute) cudaStreamDestroy(compute);
  }
  cuda_device(const cuda_device&) = delete;
  cuda_device& operator=(const cuda_device&) = delete;

  /// @brief Makes `later` (a stream of any device) wait, without a host wait, for the work
  /// queued so far on `mine`, a stream of this device (the event must be made here).
  void make_wait(cudaStream_t later, cudaStream_t mine) {
    if (later == mine) return;
    std::lock_guard lock(order_mutex);  // the wait takes the record made just before it
    device_guard guard(ordinal);
    cuda_check(cudaEventRecord(order_event, mine), "cudaEventRecord", name);
    cuda_check(cudaStreamWaitEvent(later, order_event, 0), "cudaStreamWaitEvent", name);
  }

  /// @brief The pinned buffers and their events, made on first use (the caller holds staging_mutex).
  void ensure_staging() {
    if (staging[0]) return;
    device_guard guard(ordinal);
    for (int b = 0; b < 2; ++b) {
      cuda_check(cudaHostAlloc(&staging[b], staging_bytes, cudaHostAllocPortable), "cudaHostAlloc", name);
      cuda_check(cudaEventCreateWithFlags(&staged[b], cudaEventDisableTiming), "cudaEventCreateWithFlags", name);
    }
  }
  /// @brief The event that marks an upload from buffer b on device `destination` (made there:
  /// an event is recorded only on streams of its own device).
  cudaEvent_t upload_event(int b, int destination) {
    auto& event = upload_events[b][destination];
    if (event == nullptr) {
      device_guard guard(destination);
      cuda_check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags", name);
    }
    return event;
  }

  /// @brief Adds a check of the work queued on this device's streams (an NCCL communicator's
  /// asynchronous error): it returns what failed, after releasing the streams, or "".
  void add_check(const void* owner, std::function<std::string()> check) {
    std::lock_guard lock(checks_mutex);
    checks.emplace_back(owner, std::move(check));
  }
  void remove_checks(const void* owner) {
    std::lock_guard lock(checks_mutex);
    std::erase_if(checks, [&](const auto& c) { return c.first == owner; });
  }
  /// @brief What the checks found failed ("" when nothing did); a check whose text starts
  /// with '~' reports only the echo of another failure (an abort).
  std::string failures() {
    std::lock_guard lock(checks_mutex);
    std::string found;
    for (auto& [owner, check] : checks)
      if (std::string f = check(); !f.empty() && (found.empty() || found[0] == '~')) found = f;
    return found;
  }
};

/// @brief Throws what the checks of `d` found failed, if anything: pdo::communication_error
/// for a failure, pdo::collective_aborted for the echo of one (an aborted communicator).
inline void throw_failures(cuda_device& d) {
  const std::string failed = d.failures();
  if (failed.empty()) return;
  if (failed[0] == '~') throw collective_aborted("waiting for the work of " + d.name + ": " + failed.substr(1));
  throw communication_error("waiting for the work of " + d.name + ": " + failed);
}

/// @brief Polls `done()` on the host until it holds (true), yielding the core between polls,
/// then sleeping a little; every 64 polls asks `go_on()` whether to keep waiting (false: gives
/// up, false). How every wait for a device's work watches that device.
template <class Done, class GoOn>
bool poll_device(Done done, GoOn go_on) {
  for (unsigned spins = 0;; ++spins) {
    if (done()) return true;
    if ((spins & 63) == 63 && !go_on()) return false;
    if (spins < 256) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

/// @brief Waits until the work queued on `stream` (a stream of `d`) has finished, watching
/// the checks of `d` meanwhile: a collective that can no longer complete (a failed or aborted
/// NCCL communicator) is a pdo::error naming the place, never a hang.
inline void wait_for_stream(cuda_device& d, cudaStream_t stream) {
  device_guard guard(d.ordinal);
  poll_device(
      [&] {
        const cudaError_t state = cudaStreamQuery(stream);
        if (state != cudaSuccess && state != cudaErrorNotReady) cuda_check(state, "cudaStreamQuery", d.name);
        return state == cudaSuccess;
      },
      [&] {
        throw_failures(d);
        return true;
      });
  throw_failures(d);  // work that completed after an asynchronous failure may hold garbage
}

/// @brief Lets `device` read and write the memory of `peer` directly (peer access, and the
/// allocations of peer's memory pool), once per pair; false where the devices cannot.
inline bool enable_peer_access(int device, int peer) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, bool> known;
  std::lock_guard lock(mutex);
  if (auto it = known.find({device, peer}); it != known.end()) return it->second;
  int can = 0;
  cuda_check(cudaDeviceCanAccessPeer(&can, device, peer), "cudaDeviceCanAccessPeer", "cuda:" + std::to_string(device));
  if (can != 0) {
    device_guard guard(device);
    const cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
    if (status == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
    else cuda_check(status, "cudaDeviceEnablePeerAccess", "cuda:" + std::to_string(device));
    int pools = 0;
    cuda_check(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, peer), "cudaDeviceGetAttribute", "cuda:" + std::to_string(peer));
    if (pools != 0) {  // pool allocations are reachable from other devices only where the pool says so
      cudaMemPool_t pool = nullptr;
      cuda_check(cudaDeviceGetDefaultMemPool(&pool, peer), "cudaDeviceGetDefaultMemPool", "cuda:" + std::to_string(peer));
      cudaMemAccessDesc access{};
      access.location.type = cudaMemLocationTypeDevice;
      access.location.id = device;
      access.flags = cudaMemAccessFlagsProtReadWrite;
      cuda_check(cudaMemPoolSetAccess(pool, &access, 1), "cudaMemPoolSetAccess", "cuda:" + std::to_string(peer));
    }
  }
  known[{device, peer}] = can != 0;
  return can != 0;
}

/// @brief The device resources of GPU place `p`.
inline cuda_device& cuda_device_of(const place_state& p) { return *static_cast<cuda_device*>(p.device.get()); }

/// @brief Device memory for a GPU place's caching allocator: stream-ordered on its
/// compute stream where the device supports it.
inline memory_system cuda_memory_system(cuda_device& device) {
  return {[](std::size_t bytes, void* context) -> void* {
            auto& d = *static_cast<cuda_device*>(context);
            device_guard guard(d.ordinal);
            void* p = nullptr;
            const cudaError_t status = d.pools ? cudaMallocAsync(&p, bytes, d.compute) : cudaMalloc(&p, bytes);
            if (status != cudaSuccess) {
              (void)cudaGetLastError();
              return nullptr;
            }
            return p;
          },
          [](void* p, std::size_t, void* context) noexcept {
            auto& d = *static_cast<cuda_device*>(context);
            device_guard guard(d.ordinal);
            if (d.pools) cudaFreeAsync(p, d.compute);
            else cudaFree(p);
          },
          &device, "cuda"};
}
#endif
}  // namespace detail

/// @brief How a GPU place is made.
struct cuda_place_options {
  std::size_t memory_cap = 0;  ///< bytes the place may hold (0: no cap)
  std::string name;            ///< empty: "cuda:<device>"
  int process = 0;             ///< the MPI rank that owns it
};

/// @brief A CUDA GPU place: host lanes that drive device `ordinal`, its
/// compute, communication and copy streams, and a caching allocator of device memory with the
/// same statistics and cap as CPU places.
class cuda_place : public detail::place_handle<cuda_place> {
 public:
  /// @brief A handle to the GPU place behind `state`.
  explicit cuda_place(std::shared_ptr<detail::place_state> state) : place_handle(std::move(state)) {}

#if defined(PDO_WITH_CUDA)
  /// @brief A new place for GPU `device`, with an optional memory cap in bytes.
  explicit cuda_place(int device, std::size_t memory_cap = 0) : cuda_place(device, cuda_place_options{memory_cap, "", 0}) {}
  /// @brief A new place for GPU `device`, made as `options` say.
  cuda_place(int device, const cuda_place_options& options)
      : place_handle(std::make_shared<detail::place_state>(place_kind::cuda, device, options.process, true, std::vector<int>{},
                                                           options.name.empty() ? "cuda:" + std::to_string(device) : options.name)) {
    const std::size_t memory_cap = options.memory_cap;
    auto resources = std::make_shared<detail::cuda_device>(device, state_->name);
    state_->device = resources;
    state_->memory = std::make_unique<caching_allocator>(state_->name, memory_cap, detail::cuda_memory_system(*resources));
    detail::start_lanes(*state_, {}, [device] { cudaSetDevice(device); });
  }

  /// @brief The stream every kernel, cuBLAS call and copy of this place runs on, in order
  /// (but the copies of its copy lane).
  [[nodiscard]] cudaStream_t compute_stream() const { return resources().compute; }
  /// @brief The stream the place's NCCL collectives run on.
  [[nodiscard]] cudaStream_t comm_stream() const { return resources().comm; }
  /// @brief The stream of the copies made on the place's copy lane (pdo::prefetch): each
  /// after the work queued so far on the compute stream, and complete before its task ends.
  [[nodiscard]] cudaStream_t copy_stream() const { return resources().copy; }
  /// @brief Waits until the work queued on its streams has finished (not a device-wide
  /// synchronisation); a collective that can no longer complete is a pdo::communication_error.
  void synchronize() const {
    detail::wait_for_stream(resources(), resources().compute);
    detail::wait_for_stream(resources(), resources().comm);
    detail::wait_for_stream(resources(), resources().copy);
  }
  /// @brief Whether this device can read and write `other`'s memory directly (peer copies).
  [[nodiscard]] bool can_access_peer(const cuda_place& other) const {
    int can = 0;
    detail::cuda_check(cudaDeviceCanAccessPeer(&can, device(), other.device()), "cudaDeviceCanAccessPeer", name());
    return can != 0;
  }
#endif

  /// @brief The CUDA device ordinal.
  [[nodiscard]] int device() const { return ordinal(); }

 private:
#if defined(PDO_WITH_CUDA)
  [[nodiscard]] detail::cuda_device& resources() const { return detail::cuda_device_of(*state_); }
#endif
};

#if defined(PDO_WITH_CUDA)
/// @brief A CUDA event, to order work across the streams of one place or of several:
/// record() marks the work queued so far on a stream; wait() makes another stream's
/// later work wait for it, without blocking the host; synchronize() blocks the host. The
/// event is made on the device of the stream it is first recorded on (an event is recorded
/// only on streams of its own device), and again when recorded on another device's stream.
class cuda_event {
 public:
  cuda_event() = default;
  ~cuda_event() {
    if (event_) cudaEventDestroy(event_);
  }
  cuda_event(cuda_event&& other) noexcept : event_(std::exchange(other.event_, nullptr)), device_(other.device_) {}
  cuda_event& operator=(cuda_event&& other) noexcept {
    std::swap(event_, other.event_);
    std::swap(device_, other.device_);
    return *this;
  }
  cuda_event(const cuda_event&) = delete;
  cuda_event& operator=(const cuda_event&) = delete;

  void record(cudaStream_t stream) {
    int device = 0;
    detail::cuda_check(cudaStreamGetDevice(stream, &device), "cudaStreamGetDevice", "host");
    detail::device_guard guard(device);
    if (event_ != nullptr && device != device_) {
      cudaEventDestroy(event_);  // waits queued on it still see it complete
      event_ = nullptr;
    }
    if (event_ == nullptr) {
      detail::cuda_check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags", "cuda:" + std::to_string(device));
      device_ = device;
    }
    detail::cuda_check(cudaEventRecord(event_, stream), "cudaEventRecord", "cuda:" + std::to_string(device));
  }
  /// @brief Makes `stream`'s later work wait for the last record (nothing before a record).
  void wait(cudaStream_t stream) const {
    if (event_ != nullptr) detail::cuda_check(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent", "host");
  }
  void synchronize() const {
    if (event_ != nullptr) detail::cuda_check(cudaEventSynchronize(event_), "cudaEventSynchronize", "host");
  }
  /// @brief Whether the recorded work has finished.
  [[nodiscard]] bool done() const { return event_ == nullptr || cudaEventQuery(event_) == cudaSuccess; }
  /// @brief The CUDA event (null before the first record).
  [[nodiscard]] cudaEvent_t native() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
  int device_ = -1;
};

/// @brief Why there is no GPU place to make, or an empty string when there is one.
inline std::string cuda_unavailable_reason() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return "cudaGetDeviceCount: " + detail::cuda_status(status);
  }
  return count == 0 ? "cudaGetDeviceCount found no device" : "";
}

/// @brief One place per visible GPU (none when the machine has no usable GPU; see cuda_unavailable_reason).
inline std::vector<cuda_place> cuda_places(std::size_t memory_cap = 0) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
  }
  std::vector<cuda_place> places;
  for (int d = 0; d < count; ++d) places.emplace_back(d, memory_cap);
  return places;
}
#endif

}  // namespace pdo
