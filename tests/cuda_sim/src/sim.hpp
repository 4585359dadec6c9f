// tests/cuda_sim/src/sim.hpp: what the parts of the simulator (runtime, cuBLAS, NCCL) share:
// devices, device memory, streams that run their work on threads of their own, and the
// last-error state of each host thread.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace cuda_sim {

/// @brief Settings read once from the environment: PDO_SIM_DEVICES (default 2),
/// PDO_SIM_PEER (1: devices can access each other; 0: not), PDO_SIM_POOLS (1: the
/// stream-ordered allocator; 0: none), PDO_SIM_DEADLOCK_SECONDS (how long a wait that can
/// only end by another thread's action may last before the simulator calls it a deadlock).
struct settings {
  int devices = 2;
  bool peer = true;
  bool pools = true;
  double deadlock_seconds = 20;
};
const settings& config();

/// @brief Prints "pdo cuda simulator: <what>" and aborts: a rule broken in a way CUDA would
/// answer with a crash or a hang, not an error code.
[[noreturn]] void fatal(const std::string& what);

/// @brief Records `e` as the calling thread's last error (unless success) and returns it.
cudaError_t fail(cudaError_t e, const std::string& why = "");

/// @brief The calling thread's current device.
int current_device();

// ---- device memory ----

/// @brief An allocation of device memory: its device, size, and whether it came from the
/// device's memory pool (cudaMallocAsync).
struct allocation {
  char* base = nullptr;
  std::size_t size = 0;
  int device = -1;
  bool pooled = false;
};

/// @brief The device allocation that holds [p, p + bytes), if any (null: host memory).
/// Throws nothing; a range that starts in an allocation but runs past it is reported by
/// `overruns`.
const allocation* find_allocation(const void* p, std::size_t bytes = 1, bool* overruns = nullptr);
/// @brief Whether `p` lies in any device's memory (allocated or not).
int device_of_address(const void* p);
void* allocate_device(int device, std::size_t bytes, bool pooled);
void free_device(void* p);  ///< poisons the block, then gives it back
/// @brief Whether pool memory of `owner` may be used by `accessor` (cudaMemPoolSetAccess).
bool pool_access(int owner, int accessor);
void grant_pool_access(int owner, int accessor);
bool peer_enabled(int device, int peer);

/// @brief While an object of this type lives, device work runs: device memory is readable
/// and writable. Outside of device work it is not, and a host access faults (reported as
/// such by the simulator's SIGSEGV handler).
class device_work {
 public:
  device_work();
  ~device_work();
  device_work(const device_work&) = delete;
  device_work& operator=(const device_work&) = delete;
};

// ---- pinned host memory ----
bool is_pinned(const void* p);

// ---- streams ----

/// @brief One operation of a stream: what it runs, whether that is device work, and the
/// host memory it reads or writes (so freeing it while queued is caught).
struct operation {
  std::function<void()> run;
  bool device = true;
  std::string what;
  const void* host_begin = nullptr;
  std::size_t host_bytes = 0;
};

/// @brief A stream: its device and a thread that runs its operations in order.
class stream {
 public:
  stream(int device, unsigned flags);
  ~stream();
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;

  [[nodiscard]] int device() const { return device_; }
  void enqueue(operation op);
  /// @brief Blocks the calling thread until everything queued so far has run.
  void synchronize();
  [[nodiscard]] bool idle();
  /// @brief Whether a queued operation still uses host memory in [p, p + bytes).
  bool uses_host_range(const void* p, std::size_t bytes);
  /// @brief How many copies and memsets were made on it so far (queued, or synchronous).
  [[nodiscard]] unsigned long long copies() const { return copies_.load(); }
  void count_copy() { ++copies_; }

 private:
  std::atomic<unsigned long long> copies_{0};
  void loop();
  int device_;
  std::mutex mutex_;
  std::condition_variable work_, drained_;
  std::deque<operation> queue_;
  bool running_ = false;
  bool stop_ = false;
  std::thread thread_;
};

/// @brief The stream behind a handle (the default stream of the current device for 0), or
/// null when the handle is not a live stream.
stream* stream_of(cudaStream_t s);
/// @brief Every live stream (for the checks that look at all queued work).
std::vector<stream*> all_streams();

/// @brief Whether the calling thread is a stream's thread (running device work or waits).
bool on_stream_thread();

}  // namespace cuda_sim
