// pdo/place/copy.hpp: copies between the memories of any two places (host, CPU places,
// GPU places), and fills.
//
// Between GPUs a copy goes directly (cudaMemcpyPeerAsync) where cudaDeviceCanAccessPeer
// allows it, else through pinned host memory in chunks, two buffers in flight; between a
// GPU and the host it is a cudaMemcpyAsync on the GPU place's compute stream. Either way
// it is ordered after the work already queued on both places' compute streams, and the
// receiving place's later work is ordered after it, with events (no device-wide wait). A copy
// to or from the host, or within one device, made on a GPU place's copy lane goes on its copy
// stream instead (see copy_stream), so the compute work queued after it does not wait for it;
// a copy between two devices stays on their compute streams.
#pragma once

#include <pdo/core/copy_elements.hpp>
#include <pdo/core/error.hpp>
#include <pdo/core/timeline.hpp>
#include <pdo/place/cuda_place.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <vector>

namespace pdo {

/// @brief How a copy between two GPUs goes.
enum class peer_copy {
  automatic,  ///< directly where the devices can access each other, else staged
  direct,     ///< cudaMemcpyPeerAsync (the driver stages it itself where there is no peer path)
  staged,     ///< through pinned host memory, chunk by chunk
};

/// @brief When a copy returns.
enum class copy_completion {
  host_safe,  ///< host memory on either side may be read or reused at once (GPU-to-GPU stays queued on the streams)
  queued,     ///< queued on the streams: host memory on either side must stay untouched until the places synchronize
};

namespace detail {

#if defined(PDO_WITH_CUDA)
/// @brief GPU to GPU on different devices through the two pinned buffers of the source:
/// chunk i goes down on the source's compute stream into buffer i % 2, then up on the
/// destination's; a buffer is refilled once its previous upload has read it. Every step is
/// ordered by events on the streams (each recorded on its own device's stream): nothing
/// waits on the host.
inline void staged_device_copy(cuda_device& dst, void* to, cuda_device& src, const void* from, std::size_t bytes) {
  std::lock_guard lock(src.staging_mutex);
  src.ensure_staging();
  auto* out = static_cast<char*>(to);
  const auto* in = static_cast<const char*>(from);
  for (std::size_t done = 0, chunk = 0; done < bytes; ++chunk) {
    const int b = static_cast<int>(chunk % 2);
    const std::size_t n = std::min(cuda_device::staging_bytes, bytes - done);
    {
      device_guard guard(src.ordinal);
      if (src.last_upload[b] != nullptr) cuda_check(cudaStreamWaitEvent(src.compute, src.last_upload[b], 0), "cudaStreamWaitEvent", src.name);
      cuda_check(cudaMemcpyAsync(src.staging[b], in + done, n, cudaMemcpyDeviceToHost, src.compute), "cudaMemcpyAsync", src.name);
      cuda_check(cudaEventRecord(src.staged[b], src.compute), "cudaEventRecord", src.name);
    }
    device_guard guard(dst.ordinal);
    cuda_check(cudaStreamWaitEvent(dst.compute, src.staged[b], 0), "cudaStreamWaitEvent", dst.name);
    cuda_check(cudaMemcpyAsync(out + done, src.staging[b], n, cudaMemcpyHostToDevice, dst.compute), "cudaMemcpyAsync", dst.name);
    cudaEvent_t uploaded = src.upload_event(b, dst.ordinal);
    cuda_check(cudaEventRecord(uploaded, dst.compute), "cudaEventRecord", dst.name);
    src.last_upload[b] = uploaded;
    done += n;
  }
}

/// @brief A copy between two GPUs on different devices. Each step runs on the compute lane of
/// its place, in that place's order of work: the destination marks the work queued on it so
/// far (which may still read the destination block); the source waits for that mark, copies
/// (peer, or staged), and marks the copy; the destination waits for that. So each device's
/// stream waits only for work its place queued before the copy, never for work queued after
/// it, and a collective queued on both places in one order cannot wait for itself through
/// the copy.
inline void copy_between_devices(place_state& dst_place, void* dst, place_state& src_place, const void* src, std::size_t bytes, peer_copy how) {
  cuda_device &d = cuda_device_of(dst_place), &s = cuda_device_of(src_place);
  cudaEvent_t destination_ready = nullptr, copied = nullptr;
  {
    device_guard guard(d.ordinal);
    cuda_check(cudaEventCreateWithFlags(&destination_ready, cudaEventDisableTiming), "cudaEventCreateWithFlags", d.name);
  }
  {
    device_guard guard(s.ordinal);
    cuda_check(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming), "cudaEventCreateWithFlags", s.name);
  }
  struct release {
    cudaEvent_t a, b;
    ~release() {
      cudaEventDestroy(a);  // queued waits on them still see them complete
      cudaEventDestroy(b);
    }
  } events{destination_ready, copied};
  run_on_place(dst_place, [&] {
    device_guard guard(d.ordinal);
    cuda_check(cudaEventRecord(destination_ready, d.compute), "cudaEventRecord", d.name);
  });
  const bool direct = how == peer_copy::direct || (how == peer_copy::automatic && enable_peer_access(s.ordinal, d.ordinal));
  run_on_place(src_place, [&] {
    device_guard guard(s.ordinal);
    cuda_check(cudaStreamWaitEvent(s.compute, destination_ready, 0), "cudaStreamWaitEvent", s.name);
    if (direct) {
      if (how == peer_copy::direct) enable_peer_access(s.ordinal, d.ordinal);
      cuda_check(cudaMemcpyPeerAsync(dst, d.ordinal, src, s.ordinal, bytes, s.compute), "cudaMemcpyPeerAsync", s.name);
      cuda_check(cudaEventRecord(copied, s.compute), "cudaEventRecord", s.name);
    } else {
      staged_device_copy(d, dst, s, src, bytes);  // the uploads run on the destination's stream
    }
  });
  run_on_place(dst_place, [&] {
    device_guard guard(d.ordinal);
    if (direct) cuda_check(cudaStreamWaitEvent(d.compute, copied, 0), "cudaStreamWaitEvent", d.name);
  });
}
#endif

#if defined(PDO_WITH_CUDA)
/// @brief The stream a GPU place's copies and fills go on from the calling thread. On the
/// place's copy lane: its copy stream, after the work queued so far on its compute stream
/// (which made, or last used, the blocks the copy touches), and the copies are complete before
/// the task goes on (done()), so that the work that uses them later needs no event of that
/// stream. Elsewhere: its compute stream, in that stream's order.
struct copy_stream {
  explicit copy_stream(place_state& place) : device(cuda_device_of(place)) {
    const lane* l = current_lane();
    on_copy_lane = l != nullptr && l->kind() == lane_kind::copy && current_place() == &place;
    if (on_copy_lane) device.make_wait(device.copy, device.compute);
    stream = on_copy_lane ? device.copy : device.compute;
  }
  /// @brief After the copies: on the copy lane, waits until they are done.
  void done() const {
    if (on_copy_lane) wait_for_stream(device, device.copy);
  }
  cuda_device& device;
  bool on_copy_lane = false;
  cudaStream_t stream = nullptr;
};
#endif

#if defined(PDO_WITH_CUDA)
/// @brief Waits on the host until `done()`, watching `d`'s checks: gives up (false) when a
/// collective on `d` failed (not the echo of an abort, whose kernels end), as its work may
/// never end. Never throws.
template <class Done>
bool wait_quietly(cuda_device& d, Done done) noexcept {
  try {
    return poll_device(done, [&] {
      const std::string f = d.failures();
      return f.empty() || f[0] == '~';
    });
  } catch (...) {
    return false;
  }
}

/// @brief What a sender and a receiver of one process share about a block of the sender's GPU
/// memory that the receiver copies to its own (a pipeline's handoff): where the block is, the
/// sender's mark (event) of the work that wrote it, and how far the receiver got. The receiver
/// claims it (or finds it withdrawn), then says whether it queued a copy (and its mark), queued
/// none, or could not tell when its copy ends. Freed by the last of the two.
struct handoff {
  enum stage_t : int { pending, claimed, copying, no_copy, lost, withdrawn };
  std::atomic<int> stage{pending};
  std::atomic<int> refs{1};
  place_state* from = nullptr;
  const void* data = nullptr;
  cudaEvent_t ready = nullptr;   ///< the sender's mark (an event of its device)
  cudaEvent_t copied = nullptr;  ///< the receiver's mark of its copy (an event of its device), when copying
  place_state* to = nullptr;     ///< the receiver, once claimed
  void release() {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }
};

/// @brief The sender's side of a handoff. Made on the sender's compute lane right after the
/// work that writes the block is queued, it marks that work (and nothing queued later, so the
/// receiver never waits for the sender's later collectives). It keeps the block until the
/// receiver is done with it: at once when the receiver never claimed it (it is withdrawn), else
/// once the receiver's copy has run. When the receiver could not tell (its device failed) the
/// block is kept for good rather than freed under a copy that may still run.
class offered_block {
 public:
  offered_block(place_state& from, std::shared_ptr<const void> keep, const void* data) : keep_(std::move(keep)) {
    cuda_device& s = cuda_device_of(from);
    device_guard guard(s.ordinal);
    auto* h = new handoff;
    h->from = &from;
    h->data = data;
    if (const cudaError_t status = cudaEventCreateWithFlags(&h->ready, cudaEventDisableTiming); status != cudaSuccess) {
      delete h;
      cuda_check(status, "cudaEventCreateWithFlags", s.name);
    }
    if (const cudaError_t status = cudaEventRecord(h->ready, s.compute); status != cudaSuccess) {
      cudaEventDestroy(h->ready);
      delete h;
      cuda_check(status, "cudaEventRecord", s.name);
    }
    state_ = h;
  }
  offered_block(const offered_block&) = delete;
  offered_block& operator=(const offered_block&) = delete;
  ~offered_block() {
    int stage = handoff::pending;
    if (!state_->stage.compare_exchange_strong(stage, handoff::withdrawn, std::memory_order_acq_rel)) {
      // claimed: the receiver always answers, soon (a few calls that do not wait)
      while ((stage = state_->stage.load(std::memory_order_acquire)) == handoff::claimed) std::this_thread::yield();
      if (stage == handoff::copying) {
        cuda_device& d = cuda_device_of(*state_->to);
        device_guard guard(d.ordinal);
        if (!wait_quietly(d, [&] { return cudaEventQuery(state_->copied) != cudaErrorNotReady; })) stage = handoff::lost;
        cudaEventDestroy(state_->copied);
      }
      if (stage == handoff::lost) new std::shared_ptr<const void>(std::move(keep_));  // the copy may still read it: kept for good
    }
    {
      device_guard guard(cuda_device_of(*state_->from).ordinal);
      cudaEventDestroy(state_->ready);
    }
    state_->release();
  }
  /// @brief The handoff's address, for the receiver (in this process); the receiver's
  /// reference is taken here, and given back by handed() if the receiver never got it.
  [[nodiscard]] std::uintptr_t address() {
    state_->refs.fetch_add(1, std::memory_order_relaxed);
    return reinterpret_cast<std::uintptr_t>(state_);
  }
  /// @brief The receiver did not get the address (the header was not delivered).
  void not_delivered() { state_->release(); }
  /// @brief Whether the block may be freed now (the receiver's copy has run, or it took none);
  /// from another thread than the receiver's.
  [[nodiscard]] bool released() const {
    const int stage = state_->stage.load(std::memory_order_acquire);
    if (stage == handoff::no_copy) return true;
    if (stage != handoff::copying) return false;
    device_guard guard(cuda_device_of(*state_->to).ordinal);
    return cudaEventQuery(state_->copied) != cudaErrorNotReady;
  }

 private:
  handoff* state_ = nullptr;
  std::shared_ptr<const void> keep_;
};

/// @brief The receiver gives up the handoff at `address` without claiming it (it could not
/// take the block): the sender withdraws it.
inline void leave_block(std::uintptr_t address) { reinterpret_cast<handoff*>(address)->release(); }

/// @brief The receiver's side: claims the handoff at `address` (a pdo::error when the sender
/// withdrew it) and copies its block (`bytes`) into `dst` in `to`'s memory on `to`'s compute
/// stream, after the sender's mark; marks the copy for the sender. When it fails after the copy
/// was queued, it waits for the copy before it says so.
inline void take_block(place_state& to, void* dst, std::uintptr_t address, std::size_t bytes) {
  auto* h = reinterpret_cast<handoff*>(address);
  struct reference {
    handoff* h;
    ~reference() { h->release(); }
  } ref{h};
  int stage = handoff::pending;
  if (!h->stage.compare_exchange_strong(stage, handoff::claimed, std::memory_order_acq_rel))
    throw error("pipeline: receiving on " + to.name + ": " + h->from->name + " withdrew the tensor it sent (its step failed)");
  h->to = &to;
  if (bytes == 0) {
    h->stage.store(handoff::no_copy, std::memory_order_release);
    return;
  }
  cuda_device &d = cuda_device_of(to), &s = cuda_device_of(*h->from);
  bool queued = false;
  try {
    if (d.ordinal != s.ordinal) enable_peer_access(d.ordinal, s.ordinal);  // the driver stages the copy where it cannot
    device_guard guard(d.ordinal);
    cuda_check(cudaEventCreateWithFlags(&h->copied, cudaEventDisableTiming), "cudaEventCreateWithFlags", d.name);
    cuda_check(cudaStreamWaitEvent(d.compute, h->ready, 0), "cudaStreamWaitEvent", d.name);
    queued = true;
    cuda_check(cudaMemcpyPeerAsync(dst, d.ordinal, h->data, s.ordinal, bytes, d.compute), "cudaMemcpyPeerAsync", d.name);
    cuda_check(cudaEventRecord(h->copied, d.compute), "cudaEventRecord", d.name);
  } catch (...) {
    device_guard guard(d.ordinal);
    const bool ended = !queued || wait_quietly(d, [&] { return cudaStreamQuery(d.compute) != cudaErrorNotReady; });
    if (h->copied != nullptr) cudaEventDestroy(h->copied);
    h->copied = nullptr;
    h->stage.store(ended ? handoff::no_copy : handoff::lost, std::memory_order_release);
    throw;
  }
  h->stage.store(handoff::copying, std::memory_order_release);
}
#endif

/// @brief Copies `bytes` from `src` in the memory of `src_place` to `dst` in the memory of
/// `dst_place` (nullptr or a CPU place: host memory).
inline void copy_bytes(place_state* dst_place, void* dst, place_state* src_place, const void* src, std::size_t bytes,
                       copy_completion completion = copy_completion::host_safe, peer_copy how = peer_copy::automatic) {
  if (bytes == 0) return;
  const timeline_span span("copy", "copy", [&] {
    return std::to_string(bytes) + " bytes from " + (src_place != nullptr ? src_place->name : std::string("the host")) + " to " +
           (dst_place != nullptr ? dst_place->name : std::string("the host"));
  });
  const bool to_gpu = on_gpu(dst_place), from_gpu = on_gpu(src_place);
  if (!to_gpu && !from_gpu) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if defined(PDO_WITH_CUDA)
  if (to_gpu && from_gpu) {
    auto &d = cuda_device_of(*dst_place), &s = cuda_device_of(*src_place);
    if (d.ordinal != s.ordinal) return copy_between_devices(*dst_place, dst, *src_place, src, bytes, how);
    // one device (two places on it, or one place): the copy on the destination's stream,
    // after the source's work; the source's later work waits for the copy before it
    // overwrites what the copy reads
    device_guard guard(d.ordinal);
    const copy_stream on(*dst_place);
    s.make_wait(on.stream, s.compute);
    cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, on.stream), "cudaMemcpyAsync", d.name);
    d.make_wait(s.compute, on.stream);
    on.done();
    return;
  }
  cuda_device& g = cuda_device_of(to_gpu ? *dst_place : *src_place);
  device_guard guard(g.ordinal);
  const copy_stream on(to_gpu ? *dst_place : *src_place);
  cuda_check(cudaMemcpyAsync(dst, src, bytes, to_gpu ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, on.stream), "cudaMemcpyAsync",
             g.name);
  if (completion == copy_completion::host_safe) wait_for_stream(g, on.stream);
  on.done();
#else
  (void)completion;
  (void)how;
  no_cuda("copy", (to_gpu ? dst_place : src_place)->name);
#endif
}

/// @brief `rows` runs of `width` bytes from `src` (runs `src_pitch` bytes apart) to `dst`
/// (`dst_pitch` apart), both in the memory of `place` (nullptr: the host); on a GPU one
/// cudaMemcpy2DAsync on its compute stream.
inline void copy_strided(place_state* place, void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch, std::size_t width,
                         std::size_t rows) {
  if (width == 0 || rows == 0) return;
  if (!on_gpu(place)) {
    for (std::size_t r = 0; r < rows; ++r)
      std::memcpy(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, width);
    return;
  }
#if defined(PDO_WITH_CUDA)
  cuda_device& g = cuda_device_of(*place);
  device_guard guard(g.ordinal);
  const copy_stream on(*place);
  cuda_check(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDeviceToDevice, on.stream), "cudaMemcpy2DAsync",
             g.name);
  on.done();
#else
  no_cuda("copy", place->name);
#endif
}

/// @brief Sets the `count` elements of `elem_bytes` bytes at `dst` (in `place`'s memory)
/// to the element at `value`.
inline void fill_bytes(place_state* place, void* dst, const void* value, std::size_t elem_bytes, std::size_t count) {
  if (count == 0) return;
  const auto* v = static_cast<const unsigned char*>(value);
  const bool one_byte = std::all_of(v, v + elem_bytes, [&](unsigned char c) { return c == v[0]; });
  if (!on_gpu(place)) {
    auto* out = static_cast<unsigned char*>(dst);
    if (one_byte) std::memset(out, v[0], elem_bytes * count);
    else
      for (std::size_t i = 0; i < count; ++i) std::memcpy(out + i * elem_bytes, v, elem_bytes);
    return;
  }
#if defined(PDO_WITH_CUDA)
  cuda_device& g = cuda_device_of(*place);
  device_guard guard(g.ordinal);
  const copy_stream on(*place);
  if (one_byte) {
    cuda_check(cudaMemsetAsync(dst, v[0], elem_bytes * count, on.stream), "cudaMemsetAsync", g.name);
    on.done();
    return;
  }
  // a pattern of several bytes: one element copied up, then doubled on the device (log2(count)
  // device-to-device copies, no host buffer of the whole size)
  auto* out = static_cast<unsigned char*>(dst);
  cuda_check(cudaMemcpyAsync(out, v, elem_bytes, cudaMemcpyHostToDevice, on.stream), "cudaMemcpyAsync", g.name);
  for (std::size_t have = 1; have < count; have *= 2) {
    const std::size_t more = std::min(have, count - have);
    cuda_check(cudaMemcpyAsync(out + have * elem_bytes, out, more * elem_bytes, cudaMemcpyDeviceToDevice, on.stream), "cudaMemcpyAsync",
               g.name);
  }
  on.done();
#else
  no_cuda("fill", place->name);
#endif
}

}  // namespace detail
}  // namespace pdo
