// pdo/comm/nccl/group.hpp: the NCCL backend: a group of GPU places whose collectives run
// on each place's communication stream, ordered after the work already queued on its
// compute stream and before the work queued after them (events, no host wait).
//
// Every NCCL call is preceded by a small host collective over the same members (the
// threads or MPI group of the mesh) that checks the arguments agree, so a mismatch is a
// pdo::mismatch_error on every member and a failed member releases the others (an
// aborted mesh) before any of them has queued a kernel that would wait for it forever.
#pragma once

#include <pdo/comm/host_group.hpp>
#include <pdo/core/dtype.hpp>
#include <pdo/core/error.hpp>
#include <pdo/kernels/cuda_system.hpp>
#include <pdo/place/cuda_place.hpp>

#include <nccl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace pdo::nccl::detail {

using pdo::detail::cuda_device;

/// @brief Throws, for a failed NCCL call, a pdo::error naming the call and the place.
inline void check(ncclResult_t status, const char* call, const std::string& where, ncclComm_t comm = nullptr) {
  if (status == ncclSuccess || status == ncclInProgress) return;
  std::string message = std::string(call) + " on " + where + ": " + ncclGetErrorString(status);
  if (const char* last = ncclGetLastError(comm); last != nullptr && *last != '\0') message += std::string(": ") + last;
  throw communication_error(message);
}

/// @brief The NCCL type of element type T, or ncclNumTypes where NCCL has none (such
/// elements move as bytes and cannot be reduced).
template <class T>
constexpr ncclDataType_t type_of() {
  if constexpr (std::is_same_v<T, float>) return ncclFloat32;
  else if constexpr (std::is_same_v<T, double>) return ncclFloat64;
  else if constexpr (std::is_integral_v<T> && std::is_signed_v<T> && sizeof(T) == 1) return ncclInt8;
  else if constexpr (std::is_integral_v<T> && std::is_unsigned_v<T> && sizeof(T) == 1) return ncclUint8;
  else if constexpr (std::is_integral_v<T> && std::is_signed_v<T> && sizeof(T) == 4) return ncclInt32;
  else if constexpr (std::is_integral_v<T> && std::is_unsigned_v<T> && sizeof(T) == 4) return ncclUint32;
  else if constexpr (std::is_integral_v<T> && std::is_signed_v<T> && sizeof(T) == 8) return ncclInt64;
  else if constexpr (std::is_integral_v<T> && std::is_unsigned_v<T> && sizeof(T) == 8) return ncclUint64;
  else return ncclNumTypes;
}

inline ncclRedOp_t op_of(reduce_op op) {
  switch (op) {
    case reduce_op::max: return ncclMax;
    case reduce_op::min: return ncclMin;
    default: return ncclSum;
  }
}

/// @brief flags[i] = 1 where data[i] is NaN, else 0: what a max or min of floating elements
/// reduces beside its data, since NCCL's max and min skip NaN (as fmax and fmin do) and pdo's
/// propagate it wherever it sits (detail::nan_max).
template <class T>
struct nan_flag {
  const T* data;
  T* flags;
  PDO_HD void operator()(std::size_t i) const { flags[i] = data[i] != data[i] ? T(1) : T(0); }
};

/// @brief data[i] = NaN where flags[i] (reduced over the members with max) is set.
template <class T>
struct restore_nan {
  const T* flags;
  T* data;
  PDO_HD void operator()(std::size_t i) const {
    if constexpr (std::is_floating_point_v<T>)  // needs_nan_flags: integers never come here
      if (flags[i] != T(0)) data[i] = T(0) / T(0);
  }
};

/// @brief Whether a reduction `op` of T needs the NaN flags (nan_flag): a max or min of
/// floating elements, where this translation unit can run kernels on the GPU (compiled as
/// CUDA, or on simulated devices); elsewhere NCCL's max and min skip NaN (docs/cuda.md).
template <class T>
bool needs_nan_flags(reduce_op op) {
  return std::is_floating_point_v<T> && pdo::detail::cuda_kernels_enabled && op != reduce_op::sum;
}

/// @brief Closes a group opened with ncclGroupStart when it goes out of scope, so a failure
/// inside the group cannot leave it open.
class group_call {
 public:
  group_call(const char* what, const std::string& where) : what_(what), where_(where) { check(ncclGroupStart(), "ncclGroupStart", where_); }
  group_call(const group_call&) = delete;
  group_call& operator=(const group_call&) = delete;
  /// @brief Ends the group, throwing what it failed with.
  void end() {
    open_ = false;
    check(ncclGroupEnd(), what_, where_);
  }
  ~group_call() {
    if (open_) (void)ncclGroupEnd();
  }

 private:
  const char* what_;
  std::string where_;
  bool open_ = true;
};

/// @brief The communicators of places of this process, one per member (null for members of
/// other processes); destroyed with the group. Once aborted (a member failed after others
/// had queued work that waits for it), they are made again in one process (remake()).
struct comm_set {
  std::vector<ncclComm_t> comms;
  std::vector<int> devices;  ///< member m's device (-1 for members of other processes)
  std::atomic<bool> aborted{false};
  comm_set() = default;
  comm_set(const comm_set&) = delete;
  comm_set& operator=(const comm_set&) = delete;
  ~comm_set() {
    if (aborted.load()) return;  // an abort destroyed them
    for (auto c : comms)
      if (c != nullptr) ncclCommDestroy(c);
  }
  /// @brief Ends every communicator's queued and blocked work (ncclCommAbort may be called
  /// while another thread is inside an NCCL call on the same communicator).
  void abort() {
    if (aborted.exchange(true)) return;
    for (auto c : comms)
      if (c != nullptr) (void)ncclCommAbort(c);
  }
  /// @brief New communicators over the same devices, after an abort (one process only:
  /// across processes a failure ends the job). Call when no thread uses them.
  void remake(const std::string& where) {
    if (!aborted.load()) return;
    std::vector<int> local;
    for (int d : devices)
      if (d >= 0) local.push_back(d);
    if (local.size() != devices.size()) return;
    check(ncclCommInitAll(comms.data(), static_cast<int>(comms.size()), devices.data()), "ncclCommInitAll", where);
    aborted.store(false);
  }
  /// @brief "NCCL: <what>" for the first communicator that failed (after aborting all of
  /// them), "~..." when they were aborted for another failure, or "".
  std::string failure() {
    if (aborted.load()) return "~the NCCL communicators were aborted (another place of the group failed)";
    for (auto c : comms) {
      if (c == nullptr) continue;
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(c, &state) != ncclSuccess || state == ncclSuccess || state == ncclInProgress) continue;
      std::string text = std::string("NCCL: ") + ncclGetErrorString(state);
      if (const char* last = ncclGetLastError(c); last != nullptr && *last != '\0') text += std::string(": ") + last;
      abort();
      return text;
    }
    return "";
  }
};

/// @brief A group of GPU places on NCCL. `places[m]` is member m's place state (for
/// members of this process); `host` is the threads or MPI group of the same members,
/// which carries the argument checks, barriers and point-to-point handshakes.
class group {
 public:
  /// @brief Its buffers are GPU memory, filled by work queued on the members' streams.
  static constexpr bool device_buffers = true;
  group(std::vector<std::shared_ptr<pdo::detail::place_state>> places, std::shared_ptr<comm_set> comms,
        std::shared_ptr<pdo::detail::host_group> host)
      : places_(std::move(places)), comms_(std::move(comms)), host_(std::move(host)), locks_(places_.size()) {
    for (auto& l : locks_) l = std::make_unique<std::mutex>();
    // a wait on a member's streams watches these communicators: a failed one ends the wait
    for (const auto& p : places_)
      if (p) pdo::detail::cuda_device_of(*p).add_check(comms_.get(), [set = comms_.get()] { return set->failure(); });
  }
  ~group() {
    for (const auto& p : places_)
      if (p) pdo::detail::cuda_device_of(*p).remove_checks(comms_.get());
  }
  group(const group&) = delete;
  group& operator=(const group&) = delete;

  [[nodiscard]] std::size_t size() const { return places_.size(); }
  [[nodiscard]] ncclComm_t comm(std::size_t member) const { return comms_->comms[member]; }
  [[nodiscard]] pdo::detail::host_group& host() const { return *host_; }

  /// @brief Wakes the members waiting in an argument check or a handshake, and ends the
  /// NCCL work already queued (a member that failed after the others queued their part of a
  /// collective would leave it waiting for good); reset() makes new communicators.
  void abort() {
    host_->abort();
    comms_->abort();
  }
  void reset() {
    host_->reset();
    comms_->remake(name(0));
  }
  void barrier(std::size_t me) {
    on_host([&](auto& h) { h.barrier(me); });
  }

  template <class T>
  void all_reduce(std::size_t me, std::span<T> data, reduce_op op) {
    agree(me, "all_reduce", data.size(), 0, pdo::detail::collective_call_text<T>("all_reduce", static_cast<int>(op)));
    reducible<T>("all_reduce", me);
    if (!needs_nan_flags<T>(op)) {
      enqueue(me, "ncclAllReduce", [&](ncclComm_t c, cudaStream_t s) {
        return ncclAllReduce(data.data(), data.data(), data.size(), type_of<T>(), op_of(op), c, s);
      });
      return;
    }
    with_nan_flags<T>(me, data.data(), data.size(), data.size(), data.data(), [&](const T* flags_in, T* flags_out) {
      enqueue(me, "ncclAllReduce", [&](ncclComm_t c, cudaStream_t s) {
        ncclResult_t status = ncclGroupStart();
        if (status == ncclSuccess) status = ncclAllReduce(data.data(), data.data(), data.size(), type_of<T>(), op_of(op), c, s);
        if (status == ncclSuccess) status = ncclAllReduce(flags_in, flags_out, data.size(), type_of<T>(), ncclMax, c, s);
        const ncclResult_t end = ncclGroupEnd();
        return status != ncclSuccess ? status : end;
      });
    });
  }

  template <class T>
  void broadcast(std::size_t me, std::span<T> data, std::size_t root) {
    agree(me, "broadcast", data.size(), root, pdo::detail::collective_call_text<T>("broadcast"));
    enqueue(me, "ncclBroadcast", [&](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(data.data(), data.data(), bytes_or_count<T>(data.size()), wire_type<T>(), static_cast<int>(root), c, s);
    });
  }

  /// @brief Every member's `in` concatenated into `out`; pieces of different sizes go as
  /// one broadcast per member in a group call.
  template <class T>
  void all_gather(std::size_t me, std::span<const T> in, std::span<T> out) {
    same_call(me, "all_gather", pdo::detail::collective_call_text<T>("all_gather"));
    const auto counts = counts_of(me, in.size());
    std::size_t total = 0;
    for (auto c : counts) total += c;
    // every member's verdict, so all of them throw, or none queues a kernel
    std::size_t bad = total != out.size() ? 1 : 0;
    on_host([&](auto& h) { h.all_reduce(me, std::span<std::size_t>(&bad, 1), reduce_op::max); });
    if (bad != 0)
      throw mismatch_error("all_gather: the members' pieces add up to " + std::to_string(total) + " elements but an output " +
                           (total != out.size() ? "here (" + name(me) + ") holds " + std::to_string(out.size()) : std::string("of another member differs")));
    const bool even = std::all_of(counts.begin(), counts.end(), [&](std::size_t c) { return c == counts[0]; });
    enqueue(me, even ? "ncclAllGather" : "ncclBroadcast", [&](ncclComm_t c, cudaStream_t s) {
      if (even) return ncclAllGather(in.data(), out.data(), bytes_or_count<T>(in.size()), wire_type<T>(), c, s);
      ncclResult_t status = ncclGroupStart();
      std::size_t at = 0;
      for (std::size_t k = 0; k < counts.size() && status == ncclSuccess; at += counts[k], ++k)
        status = ncclBroadcast(k == me ? static_cast<const void*>(in.data()) : nullptr, out.data() + at, bytes_or_count<T>(counts[k]),
                               wire_type<T>(), static_cast<int>(k), c, s);
      const ncclResult_t end = ncclGroupEnd();
      return status != ncclSuccess ? status : end;
    });
  }

  /// @brief This member's segment of op over the members' `in`; segments of different
  /// sizes go as one reduce per member in a group call.
  template <class T>
  void reduce_scatter(std::size_t me, std::span<const T> in, std::span<T> out, reduce_op op) {
    const auto counts = counts_of(me, out.size());
    std::size_t total = 0;
    for (auto c : counts) total += c;
    agree(me, "reduce_scatter", in.size(), 0, pdo::detail::collective_call_text<T>("reduce_scatter", static_cast<int>(op)));
    reducible<T>("reduce_scatter", me);  // after agree: every member has this T, so all throw alike
    if (total != in.size())
      throw mismatch_error("reduce_scatter on " + name(me) + ": the segments add up to " + std::to_string(total) +
                           " elements but the input holds " + std::to_string(in.size()));
    const bool even = std::all_of(counts.begin(), counts.end(), [&](std::size_t c) { return c == counts[0]; });
    // the reduction of `from` into `to` with `o`, queued in the group call open on (c, s)
    auto queue = [&](const T* from, T* to, ncclRedOp_t o, ncclComm_t c, cudaStream_t s) {
      if (even) return ncclReduceScatter(from, to, out.size(), type_of<T>(), o, c, s);
      ncclResult_t status = ncclSuccess;
      std::size_t at = 0;
      for (std::size_t k = 0; k < counts.size() && status == ncclSuccess; at += counts[k], ++k)
        status = ncclReduce(from + at, k == me ? to : nullptr, counts[k], type_of<T>(), o, static_cast<int>(k), c, s);
      return status;
    };
    auto run = [&](const T* flags_in, T* flags_out) {
      enqueue(me, even ? "ncclReduceScatter" : "ncclReduce", [&](ncclComm_t c, cudaStream_t s) {
        ncclResult_t status = ncclGroupStart();
        if (status == ncclSuccess) status = queue(in.data(), out.data(), op_of(op), c, s);
        if (status == ncclSuccess && flags_in != nullptr) status = queue(flags_in, flags_out, ncclMax, c, s);
        const ncclResult_t end = ncclGroupEnd();
        return status != ncclSuccess ? status : end;
      });
    };
    if (needs_nan_flags<T>(op)) with_nan_flags<T>(me, in.data(), in.size(), out.size(), out.data(), run);
    else run(nullptr, nullptr);
  }

  /// @brief Piece j of `in` to member j, as sends and receives in one group call.
  template <class T>
  void all_to_all(std::size_t me, std::span<const T> in, std::span<const std::size_t> send_counts, std::span<T> out,
                  std::span<const std::size_t> recv_counts) {
    const std::size_t n = size();
    same_call(me, "all_to_all", pdo::detail::collective_call_text<T>("all_to_all"));
    if (send_counts.size() != n || recv_counts.size() != n)
      throw mismatch_error("all_to_all on " + name(me) + ": " + std::to_string(send_counts.size()) + " send and " +
                           std::to_string(recv_counts.size()) + " receive counts for " + std::to_string(n) + " members");
    // every member's send counts, so each can check what it is told to expect
    std::vector<std::size_t> mine(send_counts.begin(), send_counts.end()), all(n * n);
    on_host([&](auto& h) { h.all_gather(me, std::span<const std::size_t>(mine), std::span<std::size_t>(all)); });
    bool ok = true;
    for (std::size_t j = 0; j < n; ++j) ok = ok && all[j * n + me] == recv_counts[j];
    std::size_t sent = 0, got = 0;
    for (std::size_t j = 0; j < n; ++j) {
      sent += send_counts[j];
      got += recv_counts[j];
    }
    std::size_t bad = (ok && sent == in.size() && got == out.size()) ? 0 : 1;
    on_host([&](auto& h) { h.all_reduce(me, std::span<std::size_t>(&bad, 1), reduce_op::max); });
    if (bad != 0)
      throw mismatch_error("all_to_all: the members' send counts, receive counts and buffer sizes disagree (seen on " + name(me) + ")");
    enqueue(me, "ncclSend/ncclRecv", [&](ncclComm_t c, cudaStream_t s) {
      ncclResult_t status = ncclGroupStart();
      std::size_t at_in = 0, at_out = 0;
      for (std::size_t j = 0; j < n && status == ncclSuccess; ++j) {
        if (send_counts[j] != 0)
          status = ncclSend(in.data() + at_in, bytes_or_count<T>(send_counts[j]), wire_type<T>(), static_cast<int>(j), c, s);
        if (status == ncclSuccess && recv_counts[j] != 0)
          status = ncclRecv(out.data() + at_out, bytes_or_count<T>(recv_counts[j]), wire_type<T>(), static_cast<int>(j), c, s);
        at_in += send_counts[j];
        at_out += recv_counts[j];
      }
      const ncclResult_t end = ncclGroupEnd();
      return status != ncclSuccess ? status : end;
    });
  }

  /// @brief Sends `data` to member `to`. The receiver first confirms, through the host
  /// group, that it expects this many elements with this tag; then both queue the
  /// transfer. Between two members transfers run in the order they were made.
  template <class T>
  void send(std::size_t me, std::span<const T> data, std::size_t to, int tag) {
    const std::array<std::uint64_t, 2> header{data.size(), static_cast<std::uint64_t>(static_cast<std::int64_t>(tag))};
    handshake("send", "a recv from", me, to, tag, [&](auto& h) { h.send(me, std::span<const std::uint64_t>(header), to, header_tag); });
    std::uint64_t verdict = 0;
    on_host([&](auto& h) { h.recv(me, std::span<std::uint64_t>(&verdict, 1), to, verdict_tag); });
    if (verdict != 0)
      throw mismatch_error("send/recv: " + name(me) + " sent " + std::to_string(data.size()) + " elements with tag " + std::to_string(tag) +
                           " but " + name(to) + " expected another message");
    enqueue(me, "ncclSend", [&](ncclComm_t c, cudaStream_t s) {
      return ncclSend(data.data(), bytes_or_count<T>(data.size()), wire_type<T>(), static_cast<int>(to), c, s);
    });
  }

  template <class T>
  void recv(std::size_t me, std::span<T> data, std::size_t from, int tag) {
    std::array<std::uint64_t, 2> header{};
    handshake("recv", "a send to", me, from, tag, [&](auto& h) { h.recv(me, std::span<std::uint64_t>(header), from, header_tag); });
    const bool ok = header[0] == data.size() && static_cast<int>(static_cast<std::int64_t>(header[1])) == tag;
    const std::uint64_t verdict = ok ? 0 : 1;
    on_host([&](auto& h) { h.send(me, std::span<const std::uint64_t>(&verdict, 1), from, verdict_tag); });
    if (!ok)
      throw mismatch_error("send/recv: " + name(from) + " sent " + std::to_string(header[0]) + " elements with tag " +
                           std::to_string(static_cast<std::int64_t>(header[1])) + " but " + name(me) + " expects " +
                           std::to_string(data.size()) + " with tag " + std::to_string(tag));
    enqueue(me, "ncclRecv", [&](ncclComm_t c, cudaStream_t s) {
      return ncclRecv(data.data(), bytes_or_count<T>(data.size()), wire_type<T>(), static_cast<int>(from), c, s);
    });
  }

 private:
  /// @brief The host tags of point-to-point handshakes: headers (the user's tag travels in
  /// the header) and the receiver's verdicts.
  static constexpr int header_tag = 0, verdict_tag = 1;

  template <class F>
  void on_host(F&& f) {
    pdo::detail::visit_group(*host_, std::forward<F>(f));
  }

  /// @brief The host handshake `f` of member `me`'s `op` ("send", "recv") with `peer`, for
  /// the user's `tag`: when the peer is a member of this process whose task ended without the
  /// matching call, the error says so with that tag (the handshake's host tags are its own).
  template <class F>
  void handshake(const char* op, const char* missing, std::size_t me, std::size_t peer, int tag, F&& f) {
    try {
      on_host(f);
    } catch (const error&) {
      const auto [local, first] = pdo::detail::local_members(*host_);
      if (peer >= first && peer - first < local->size() && local->has_left(peer - first))
        local->peer_left(op, missing, me - first, peer - first, tag);
      throw;
    }
  }

  [[nodiscard]] std::string name(std::size_t member) const {
    return places_[member] ? places_[member]->name : "member " + std::to_string(member);
  }

  /// @brief Elements without an NCCL type move as bytes.
  template <class T>
  static constexpr ncclDataType_t wire_type() {
    return type_of<T>() == ncclNumTypes ? ncclUint8 : type_of<T>();
  }
  template <class T>
  static constexpr std::size_t bytes_or_count(std::size_t count) {
    return type_of<T>() == ncclNumTypes ? count * sizeof(T) : count;
  }
  template <class T>
  void reducible(const char* op, std::size_t me) const {
    if constexpr (type_of<T>() == ncclNumTypes)
      throw layout_error(std::string(op) + " on " + name(me) + ": NCCL cannot reduce elements of type " +
                         std::string(pdo::detail::dtype_name<T>()));
  }

  /// @brief A max or min of floating elements that keeps NaN (needs_nan_flags): flags of the
  /// `n` elements of `in` (1 where NaN) made on the place's compute stream, then
  /// `reduce(flags_in, flags_out)`, which queues the collective and the flags' own reduction
  /// with max (`m` results), then NaN put back into `out` where a reduced flag is set. The
  /// flags' memory is the place's, freed in stream order after the last kernel.
  template <class T, class Reduce>
  void with_nan_flags(std::size_t me, const T* in, std::size_t n, std::size_t m, T* out, Reduce&& reduce) {
    auto& place = *places_[me];
    const pdo::detail::kernel_scratch<T> flags_in(place, n), flags_out(place, m);
    const thrust::counting_iterator<std::size_t> first(0);
    pdo::detail::gpu_for_each_n(place, first, n, nan_flag<T>{in, flags_in.data()});
    reduce(static_cast<const T*>(flags_in.data()), flags_out.data());
    pdo::detail::gpu_for_each_n(place, first, m, restore_nan<T>{flags_out.data(), out});
  }

  /// @brief Throws on every member unless all made the same call (`call`: the collective and
  /// its element type), for the collectives whose sizes may differ between members.
  void same_call(std::size_t me, const char* op, const std::string& call) { agree(me, op, call, {}); }

  /// @brief Throws on every member unless all made the same call (`call`: the collective,
  /// its element type and reduction) with the same `count` and `root`.
  void agree(std::size_t me, const char* op, std::size_t count, std::size_t root, const std::string& call) {
    const std::array<std::int64_t, 2> sizes{static_cast<std::int64_t>(count), static_cast<std::int64_t>(root)};
    agree(me, op, call, sizes);
  }

  /// @brief The check of the two above: one host all_reduce(max) of the call's code and of
  /// each of `values` with their negations, so every member learns the largest and smallest.
  void agree(std::size_t me, const char* op, const std::string& call, std::span<const std::int64_t> values) {
    const auto code = static_cast<std::int64_t>(pdo::detail::collective_code(call) >> 1);
    std::array<std::int64_t, 6> v{code, -code, 0, 0, 0, 0};
    for (std::size_t i = 0; i < values.size(); ++i) {
      v[2 + 2 * i] = values[i];
      v[3 + 2 * i] = -values[i];
    }
    on_host([&](auto& h) { h.all_reduce(me, std::span<std::int64_t>(v.data(), 2 + 2 * values.size()), reduce_op::max); });
    if (v[0] != -v[1])
      throw mismatch_error(std::string(op) + ": the members called different collectives, or this one over different element types or "
                           "with different reductions (this member: " + call + ", seen on " + name(me) + ")");
    if (values.size() > 0 && v[2] != -v[3])
      throw mismatch_error(std::string(op) + ": the members passed different sizes, from " + std::to_string(-v[3]) + " to " +
                           std::to_string(v[2]) + " elements (seen on " + name(me) + ")");
    if (values.size() > 1 && v[4] != -v[5])
      throw mismatch_error(std::string(op) + ": the members named different roots, from " + std::to_string(-v[5]) + " to " +
                           std::to_string(v[4]) + " (seen on " + name(me) + ")");
  }

  /// @brief Every member's `count`, in member order.
  std::vector<std::size_t> counts_of(std::size_t me, std::size_t count) {
    std::vector<std::size_t> all(size());
    const std::size_t mine = count;
    on_host([&](auto& h) { h.all_gather(me, std::span<const std::size_t>(&mine, 1), std::span<std::size_t>(all)); });
    return all;
  }

  /// @brief Queues `call(comm, stream)` on member `me`'s communication stream, after the
  /// work queued on its compute stream; its compute stream's later work waits for it.
  template <class Call>
  void enqueue(std::size_t me, const char* what, Call&& call) {
    auto& place = *places_[me];
    cuda_device& d = pdo::detail::cuda_device_of(place);
    std::lock_guard lock(*locks_[me]);  // one thread at a time on a communicator
    pdo::detail::device_guard guard(d.ordinal);
    if (comms_->aborted.load()) throw collective_aborted(std::string(what) + " on " + place.name + ": the NCCL communicators were aborted");
    d.make_wait(d.comm, d.compute);
    check(call(comm(me), d.comm), what, place.name, comm(me));
    d.make_wait(d.compute, d.comm);
  }

  std::vector<std::shared_ptr<pdo::detail::place_state>> places_;
  std::shared_ptr<comm_set> comms_;
  std::shared_ptr<pdo::detail::host_group> host_;
  std::vector<std::unique_ptr<std::mutex>> locks_;
};

}  // namespace pdo::nccl::detail

namespace pdo::nccl::detail {

/// @brief NCCL communicators over every place of mesh `m` (all GPU places), member i being
/// mesh place i: ncclCommInitAll in one process; in several, one ncclCommInitRank per
/// local place, with the unique id broadcast over MPI from the process of place 0.
inline std::shared_ptr<comm_set> init_mesh(const pdo::detail::mesh_state& m) {
  auto set = std::make_shared<comm_set>();
  const std::size_t n = m.places.size();
  set->comms.assign(n, nullptr);
  set->devices.assign(n, -1);
  std::vector<int> devices;
  for (auto i : m.local) {
    const int d = m.places[i].ordinal();
    if (std::find(devices.begin(), devices.end(), d) != devices.end())
      throw layout_error("mesh: NCCL needs every GPU place of a mesh on its own device; device " + std::to_string(d) +
                         " holds two places of this process (" + m.places[i].name() + ")");
    devices.push_back(d);
    set->devices[i] = d;
  }
  int current = 0;
  (void)cudaGetDevice(&current);
  pdo::detail::device_guard keep(current);  // the calling thread (a place's lane) keeps its device
  if (!m.multiprocess) {
    check(ncclCommInitAll(set->comms.data(), static_cast<int>(n), devices.data()), "ncclCommInitAll", m.places[0].name());
    return set;
  }
#if defined(PDO_WITH_MPI)
  ncclUniqueId id{};
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  const int root = m.places[0].process();
  if (me == root) check(ncclGetUniqueId(&id), "ncclGetUniqueId", m.places[0].name());
  pdo::mpi::detail::check(MPI_Bcast(&id, static_cast<int>(sizeof id), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
  if (m.local.empty()) return set;  // a process without places of the mesh takes part in the broadcast only
  group_call inits("ncclGroupEnd", m.places[m.local.front()].name());
  for (auto i : m.local) {
    pdo::detail::device_guard guard(m.places[i].ordinal());
    check(ncclCommInitRank(&set->comms[i], static_cast<int>(n), id, static_cast<int>(i)), "ncclCommInitRank", m.places[i].name());
  }
  inits.end();
  return set;
#else
  throw communication_error("mesh: GPU places of other processes need the MPI backend to start NCCL; build with PDO_WITH_MPI");
#endif
}

/// @brief The communicators of the lines along one axis, split from the whole mesh's
/// (ncclCommSplit: color the line, key the place's coordinate on it): `line_of[p]` is
/// place p's line; result[g] holds line g's communicators in member order.
inline std::vector<std::shared_ptr<comm_set>> split_lines(const pdo::detail::mesh_state& m, const comm_set& whole,
                                                          const std::vector<std::size_t>& line_of, std::size_t lines,
                                                          const std::vector<std::size_t>& coord_of, std::size_t extent) {
  std::vector<std::shared_ptr<comm_set>> out(lines);
  for (auto& s : out) {
    s = std::make_shared<comm_set>();
    s->comms.assign(extent, nullptr);
    s->devices.assign(extent, -1);
  }
  if (m.local.empty()) return out;  // no place here: no communicator to split
  std::vector<ncclComm_t> made(m.places.size(), nullptr);
  group_call splits("ncclGroupEnd", m.places[m.local.front()].name());
  for (auto p : m.local) {
    pdo::detail::device_guard guard(m.places[p].ordinal());
    check(ncclCommSplit(whole.comms[p], static_cast<int>(line_of[p]), static_cast<int>(coord_of[p]), &made[p], nullptr), "ncclCommSplit",
          m.places[p].name(), whole.comms[p]);
  }
  splits.end();
  for (auto p : m.local) {
    out[line_of[p]]->comms[coord_of[p]] = made[p];
    out[line_of[p]]->devices[coord_of[p]] = m.places[p].ordinal();
  }
  return out;
}

}  // namespace pdo::nccl::detail
