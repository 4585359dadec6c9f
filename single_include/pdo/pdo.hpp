// pdo: parallel tensor programs over meshes of places. Single-header edition.
// Generated from include/ by tools/amalgamate.py: do not edit by hand.
#pragma once
// ---- pdo/pdo.hpp
#ifndef PDO_SINGLE_PDO_PDO_HPP
#define PDO_SINGLE_PDO_PDO_HPP
// pdo/pdo.hpp: the whole public API of pdo.

// ---- pdo/comm.hpp
#ifndef PDO_SINGLE_PDO_COMM_HPP
#define PDO_SINGLE_PDO_COMM_HPP
// pdo/comm.hpp: the comm layer (communicator concept, threads and MPI backends, mesh groups).

// ---- pdo/comm/communicator_concept.hpp
#ifndef PDO_SINGLE_PDO_COMM_COMMUNICATOR_CONCEPT_HPP
#define PDO_SINGLE_PDO_COMM_COMMUNICATOR_CONCEPT_HPP
// pdo/comm/communicator_concept.hpp: what every communicator backend provides.

// ---- pdo/core/dtype.hpp
#ifndef PDO_SINGLE_PDO_CORE_DTYPE_HPP
#define PDO_SINGLE_PDO_CORE_DTYPE_HPP
// pdo/core/dtype.hpp: element types pdo moves and reduces, and their short names.

#include <concepts>
#include <cstdint>
#include <string_view>
#include <type_traits>

namespace pdo {

/// @brief An element type pdo tensors hold: an arithmetic type other than bool.
template <class T>
concept element = std::is_arithmetic_v<T> && !std::same_as<T, bool>;

/// @brief Reduction applied by all_reduce and reduce_scatter.
enum class reduce_op { sum, max, min };

namespace detail {

template <class T>
constexpr std::string_view dtype_name() {
  if constexpr (std::same_as<T, float>) return "f32";
  else if constexpr (std::same_as<T, double>) return "f64";
  else if constexpr (std::same_as<T, std::int32_t>) return "i32";
  else if constexpr (std::same_as<T, std::int64_t>) return "i64";
  else if constexpr (std::floating_point<T>) return "float";
  else if constexpr (std::signed_integral<T>) return "int";
  else return "uint";
}

constexpr std::string_view op_name(reduce_op op) {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::max: return "max";
    case reduce_op::min: return "min";
  }
  return "?";
}

template <class T>
constexpr T apply(reduce_op op, T a, T b) {
  switch (op) {
    case reduce_op::sum: return a + b;
    case reduce_op::max: return a < b ? b : a;
    case reduce_op::min: return b < a ? b : a;
  }
  return a;
}

}  // namespace detail
}  // namespace pdo
#endif  // PDO_SINGLE_PDO_CORE_DTYPE_HPP

#include <concepts>
#include <cstddef>
#include <span>

namespace pdo {

/// @brief One member's endpoint on a group of places (a mesh axis, or the whole mesh).
///
/// Every collective is called by all members of the group at once, each with its own
/// buffers (SPMD). Reductions sum in a fixed order, so results are bitwise identical
/// from run to run on a fixed group. Arguments that disagree across members (sizes,
/// roots) raise pdo::communication_error on every member; they never hang.
/// Backends opt in with `using communicator_tag = void;`.
template <class C>
concept communicator = requires(const C& c, std::span<float> f, std::span<const float> cf,
                                std::span<const std::size_t> counts) {
  typename C::communicator_tag;
  { c.size() } -> std::same_as<std::size_t>;
  { c.rank() } -> std::same_as<std::size_t>;
  c.barrier();
  c.all_reduce(f, reduce_op::sum);
  c.all_gather(cf, f);
  c.reduce_scatter(cf, f, reduce_op::sum);
  c.broadcast(f, std::size_t{0});
  c.all_to_all(cf, counts, f, counts);
  c.send(cf, std::size_t{0}, 0);
  c.recv(f, std::size_t{0}, 0);
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_COMM_COMMUNICATOR_CONCEPT_HPP
// ---- pdo/comm/group_communicator.hpp
#ifndef PDO_SINGLE_PDO_COMM_GROUP_COMMUNICATOR_HPP
#define PDO_SINGLE_PDO_COMM_GROUP_COMMUNICATOR_HPP
// pdo/comm/group_communicator.hpp: a member's endpoint on a group, for any backend's group type.


#include <cstddef>
#include <memory>
#include <span>
#include <utility>

namespace pdo {

namespace detail {
/// @brief Calls `f` with the backend group behind `g`; groups that choose their backend
/// at run time (any_group) overload it.
template <class Group, class F>
decltype(auto) visit_group(Group& g, F&& f) {
  return std::forward<F>(f)(g);
}
}  // namespace detail

/// @brief Member `rank()` of a group of places; see pdo::communicator for the contract.
/// @tparam Group a backend group: detail::local_group (threads), mpi::detail::group,
///         or detail::any_group (whichever the mesh was built on).
template <class Group>
class group_communicator {
 public:
  using communicator_tag = void;

  group_communicator(std::shared_ptr<Group> group, std::size_t member) : group_(std::move(group)), member_(member) {}

  [[nodiscard]] std::size_t size() const {
    using detail::visit_group;
    return visit_group(*group_, [](auto& g) { return g.size(); });
  }
  [[nodiscard]] std::size_t rank() const { return member_; }

  void barrier() const {
    with([&](auto& g) { g.barrier(member_); });
  }
  /// @brief `data` = op over members of their `data` (same size on all).
  template <element T>
  void all_reduce(std::span<T> data, reduce_op op = reduce_op::sum) const {
    with([&](auto& g) { g.all_reduce(member_, data, op); });
  }
  /// @brief `out` = every member's `in`, concatenated in member order (sizes may differ).
  template <element T>
  void all_gather(std::span<const T> in, std::span<T> out) const {
    with([&](auto& g) { g.all_gather(member_, in, out); });
  }
  /// @brief `out` = this member's segment of op over members of `in`; segment k has the
  /// size member k passes as `out`.
  template <element T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op = reduce_op::sum) const {
    with([&](auto& g) { g.reduce_scatter(member_, in, out, op); });
  }
  /// @brief `data` = member `root`'s `data`.
  template <element T>
  void broadcast(std::span<T> data, std::size_t root) const {
    with([&](auto& g) { g.broadcast(member_, data, root); });
  }
  /// @brief Piece j of `in` (send_counts[j] elements) goes to member j; `out` holds the
  /// pieces received from members 0..n-1 in order (recv_counts[i] elements from i).
  template <element T>
  void all_to_all(std::span<const T> in, std::span<const std::size_t> send_counts, std::span<T> out,
                  std::span<const std::size_t> recv_counts) const {
    with([&](auto& g) { g.all_to_all(member_, in, send_counts, out, recv_counts); });
  }
  /// @brief Sends `data` to member `to`; returns once it has been received.
  template <element T>
  void send(std::span<const T> data, std::size_t to, int tag = 0) const {
    with([&](auto& g) { g.send(member_, data, to, tag); });
  }
  /// @brief Receives exactly `data.size()` elements from member `from`.
  template <element T>
  void recv(std::span<T> data, std::size_t from, int tag = 0) const {
    with([&](auto& g) { g.recv(member_, data, from, tag); });
  }

 private:
  template <class F>
  void with(F&& f) const {
    using detail::visit_group;  // and, found by ADL, the overloads of run-time chosen groups
    visit_group(*group_, std::forward<F>(f));
  }

  std::shared_ptr<Group> group_;
  std::size_t member_;
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_COMM_GROUP_COMMUNICATOR_HPP
// ---- pdo/comm/mesh_comms.hpp
#ifndef PDO_SINGLE_PDO_COMM_MESH_COMMS_HPP
#define PDO_SINGLE_PDO_COMM_MESH_COMMS_HPP
// pdo/comm/mesh_comms.hpp: the communicators of a mesh: one group per axis line, and the whole mesh.

// ---- pdo/comm/threads/local_group.hpp
#ifndef PDO_SINGLE_PDO_COMM_THREADS_LOCAL_GROUP_HPP
#define PDO_SINGLE_PDO_COMM_THREADS_LOCAL_GROUP_HPP
// pdo/comm/threads/local_group.hpp: collectives among threads of one process over shared memory.

// ---- pdo/comm/barrier.hpp
#ifndef PDO_SINGLE_PDO_COMM_BARRIER_HPP
#define PDO_SINGLE_PDO_COMM_BARRIER_HPP
// pdo/comm/barrier.hpp: a reusable barrier that spins briefly, then sleeps, and can be aborted.

// ---- pdo/core/error.hpp
#ifndef PDO_SINGLE_PDO_CORE_ERROR_HPP
#define PDO_SINGLE_PDO_CORE_ERROR_HPP
// pdo/core/error.hpp: the exception hierarchy every run-time failure is reported with.

#include <stdexcept>
#include <string>

namespace pdo {

/// @brief Base of every exception pdo throws. Messages name the op, the shapes,
/// the layouts and the place involved, in one line.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// @brief A shape that does not fit the op (mismatched extents, wrong rank of data).
class shape_error : public error {
 public:
  using error::error;
};

/// @brief A layout or mesh that cannot be used as asked (wrong mesh, bad extents).
class layout_error : public error {
 public:
  using error::error;
};

/// @brief A collective or point-to-point transfer that failed or was aborted.
class communication_error : public error {
 public:
  using error::error;
};

/// @brief Members of a collective passed arguments that disagree (sizes, roots, counts).
/// Every member of the group throws it alike, so none is left waiting.
class mismatch_error : public communication_error {
 public:
  using communication_error::communication_error;
};

/// @brief A collective given up because another place of its group failed: the echo of
/// that failure, not a cause of its own.
class collective_aborted : public communication_error {
 public:
  using communication_error::communication_error;
};

/// @brief An allocation over a place's memory cap, or refused by the system.
class out_of_memory : public error {
 public:
  using error::error;
};

/// @brief A file that could not be read or written.
class io_error : public error {
 public:
  using error::error;
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_CORE_ERROR_HPP

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <thread>

namespace pdo::detail {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

/// @brief A barrier for a fixed number of threads. Waiters spin for a few microseconds
/// (collectives on small messages stay well under a microsecond) and then sleep on
/// the phase counter, so oversubscribed places do not burn each other's cores.
///
/// abort() makes abortable waits throw pdo::collective_aborted until reset(). A
/// collective waits abortably only at its entry barrier: once every member is past it,
/// the members read and write each other's buffers, so the closing barrier always waits
/// for all of them (none unwinds and frees a buffer another is still using).
class group_barrier {
 public:
  explicit group_barrier(std::uint32_t count)
      : count_(count), spin_limit_(count <= std::max(1u, std::thread::hardware_concurrency()) ? 4000 : 16) {}

  // phase_ counts completed phases in steps of 2; its low bit says "aborted". The last
  // arrival completes a phase only if no abort came first (compare-exchange), so either
  // every member goes on or every abortable waiter throws.
  void arrive_and_wait(bool abortable = true) {
    const std::uint32_t phase = phase_.load(std::memory_order_acquire);
    if (abortable && (phase & aborted_bit)) throw_aborted();
    const std::uint32_t clean = phase & ~aborted_bit;
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
      arrived_.store(0, std::memory_order_relaxed);
      std::uint32_t expected = clean;
      if (!phase_.compare_exchange_strong(expected, clean + 2, std::memory_order_acq_rel)) {
        if (abortable) throw_aborted();
        phase_.fetch_add(2, std::memory_order_release);  // a closing barrier completes regardless
      }
      phase_.notify_all();
      return;
    }
    std::uint32_t now = phase_.load(std::memory_order_acquire);
    for (int spin = 0; spin < spin_limit_ && !done(now, clean, abortable); ++spin) {
      cpu_relax();
      now = phase_.load(std::memory_order_acquire);
    }
    while (!done(now, clean, abortable)) {
      phase_.wait(now, std::memory_order_acquire);
      now = phase_.load(std::memory_order_acquire);
    }
    if ((now & ~aborted_bit) == clean) throw_aborted();  // woken by abort(), not by the last arrival
  }

  /// @brief Wakes abortable waiters, now and until reset(), with pdo::collective_aborted.
  void abort() {
    phase_.fetch_or(aborted_bit, std::memory_order_release);
    phase_.notify_all();
  }
  /// @brief Makes the barrier usable again; call only when no thread is inside it.
  void reset() {
    arrived_.store(0, std::memory_order_relaxed);
    phase_.fetch_and(~aborted_bit, std::memory_order_release);
  }
  [[nodiscard]] bool aborted() const { return (phase_.load(std::memory_order_acquire) & aborted_bit) != 0; }
  [[nodiscard]] std::uint32_t count() const { return count_; }

 private:
  static constexpr std::uint32_t aborted_bit = 1;

  /// @brief The phase this waiter waits on has completed, or it may give up on an abort.
  static bool done(std::uint32_t now, std::uint32_t clean, bool abortable) {
    return (now & ~aborted_bit) != clean || (abortable && (now & aborted_bit));
  }
  [[noreturn]] static void throw_aborted() {
    throw collective_aborted("collective aborted: another place of the group failed");
  }

  const std::uint32_t count_;
  const int spin_limit_;  ///< spin only while every member can have a core of its own
  std::atomic<std::uint32_t> arrived_{0};
  std::atomic<std::uint32_t> phase_{0};
};

/// @brief The closing barrier of a collective, as a scope: it is passed when the scope
/// ends, normally or by an exception, so no member leaves (and frees its buffers) while
/// another still uses them.
class closing_barrier {
 public:
  explicit closing_barrier(group_barrier& b) : barrier_(b) {}
  closing_barrier(const closing_barrier&) = delete;
  closing_barrier& operator=(const closing_barrier&) = delete;
  ~closing_barrier() { barrier_.arrive_and_wait(false); }

 private:
  group_barrier& barrier_;
};

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_COMM_BARRIER_HPP
// ---- pdo/core/config.hpp
#ifndef PDO_SINGLE_PDO_CORE_CONFIG_HPP
#define PDO_SINGLE_PDO_CORE_CONFIG_HPP
// pdo/core/config.hpp: configuration macros shared by every layer.

/// @brief Marks a function callable on the host and, under nvcc, on the device.
#if defined(__CUDACC__)
#define PDO_HD __host__ __device__
#else
#define PDO_HD
#endif

/// @brief Placed before a loop whose iterations do not depend on each other through
/// memory (its pointers may alias as far as the compiler knows, but never overlap in
/// the ranges it touches): lets the compiler vectorise it without run-time checks.
#if defined(__CUDACC__)
#define PDO_IVDEP
#elif defined(__clang__)
#define PDO_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define PDO_IVDEP _Pragma("GCC ivdep")
#else
#define PDO_IVDEP
#endif

#define PDO_VERSION_MAJOR 0
#define PDO_VERSION_MINOR 1
#define PDO_VERSION_PATCH 0
#endif  // PDO_SINGLE_PDO_CORE_CONFIG_HPP
// ---- pdo/core/copy_elements.hpp
#ifndef PDO_SINGLE_PDO_CORE_COPY_ELEMENTS_HPP
#define PDO_SINGLE_PDO_CORE_COPY_ELEMENTS_HPP
// pdo/core/copy_elements.hpp: element copies that accept the null pointers of empty buffers.

#include <cstddef>
#include <cstring>

namespace pdo::detail {

/// @brief Copies `count` elements from `src` to `dst` (not overlapping). An empty shard
/// or piece may have null data: nothing is copied then.
template <class T>
void copy_elements(T* dst, const T* src, std::size_t count) {
  if (count != 0) std::memcpy(static_cast<void*>(dst), static_cast<const void*>(src), count * sizeof(T));
}

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_CORE_COPY_ELEMENTS_HPP
// ---- pdo/core/shape.hpp
#ifndef PDO_SINGLE_PDO_CORE_SHAPE_HPP
#define PDO_SINGLE_PDO_CORE_SHAPE_HPP
// pdo/core/shape.hpp: shapes, row-major strides and the even-split rule for shards.

#include <array>
#include <cstddef>
#include <sstream>
#include <string>
#include <vector>

namespace pdo {

/// @brief The extents of a tensor of rank `Rank`.
template <std::size_t Rank>
using shape_t = std::array<std::size_t, Rank>;

namespace detail {

template <std::size_t Rank>
constexpr std::size_t volume(const shape_t<Rank>& shape) {
  std::size_t n = 1;
  for (auto e : shape) n *= e;
  return n;
}

template <std::size_t Rank>
constexpr std::array<std::ptrdiff_t, Rank> row_major_strides(const shape_t<Rank>& shape) {
  std::array<std::ptrdiff_t, Rank> strides{};
  std::ptrdiff_t s = 1;
  for (std::size_t d = Rank; d-- > 0;) {
    strides[d] = s;
    s *= static_cast<std::ptrdiff_t>(shape[d]);
  }
  return strides;
}

/// @brief Size of chunk `index` when `extent` elements are cut into `parts` chunks:
/// sizes differ by at most one, larger chunks first (10 over 4 -> 3,3,2,2).
constexpr std::size_t chunk_size(std::size_t extent, std::size_t parts, std::size_t index) {
  return extent / parts + (index < extent % parts ? 1 : 0);
}

/// @brief Offset of chunk `index` under the rule of chunk_size.
constexpr std::size_t chunk_offset(std::size_t extent, std::size_t parts, std::size_t index) {
  const std::size_t rem = extent % parts;
  return index * (extent / parts) + (index < rem ? index : rem);
}

template <class Range>
std::string format_extents(const Range& extents) {
  std::ostringstream os;
  os << '[';
  bool first = true;
  for (auto e : extents) {
    if (!first) os << ", ";
    os << e;
    first = false;
  }
  os << ']';
  return os.str();
}

/// @brief A tensor viewed as [outer, extent(dim), inner], the form every pack,
/// unpack and slice along one dim works on.
struct dim_view {
  std::size_t outer = 1;
  std::size_t extent = 1;
  std::size_t inner = 1;
};

template <std::size_t Rank>
constexpr dim_view view_along(const shape_t<Rank>& shape, std::size_t dim) {
  dim_view v;
  for (std::size_t d = 0; d < Rank; ++d) {
    if (d < dim) v.outer *= shape[d];
    else if (d == dim) v.extent = shape[d];
    else v.inner *= shape[d];
  }
  return v;
}

}  // namespace detail
}  // namespace pdo
#endif  // PDO_SINGLE_PDO_CORE_SHAPE_HPP

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <utility>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace pdo::detail {

/// @brief Elementwise `acc[i] = op(acc[i], src[i])`, written so the compiler vectorises it.
template <class T>
void reduce_into(T* __restrict acc, const T* __restrict src, std::size_t n, reduce_op op) {
  switch (op) {
    case reduce_op::sum:
      for (std::size_t i = 0; i < n; ++i) acc[i] += src[i];
      break;
    case reduce_op::max:
      for (std::size_t i = 0; i < n; ++i) acc[i] = acc[i] < src[i] ? src[i] : acc[i];
      break;
    case reduce_op::min:
      for (std::size_t i = 0; i < n; ++i) acc[i] = src[i] < acc[i] ? src[i] : acc[i];
      break;
  }
}

/// @brief `dst[lo, hi) = op over k of srcs[k][lo, hi)`, summed in the order of `srcs`
/// (fixed, so results are bitwise reproducible), then copied to every `dsts[k]`.
/// Works block by block through a buffer that stays in L1.
template <class T>
void reduce_blocks(std::span<const T* const> srcs, std::span<T* const> dsts, std::size_t lo, std::size_t hi,
                   reduce_op op) {
  constexpr std::size_t block = 2048;
  alignas(64) T acc[block];
  for (std::size_t b = lo; b < hi; b += block) {
    const std::size_t n = std::min(block, hi - b);
    copy_elements(acc, srcs[0] + b, n);
    for (std::size_t k = 1; k < srcs.size(); ++k) reduce_into(acc, srcs[k] + b, n, op);
    for (T* d : dsts) copy_elements(d + b, acc, n);
  }
}

/// @brief In place over `bufs` (N buffers): `bufs[k][i] = op over k of bufs[k][i]` for i in
/// [lo, hi), in one pass: N reads and N writes per element, summed in buffer order.
template <std::size_t N, class T, class Op>
void reduce_in_place(T* const* bufs, std::size_t lo, std::size_t hi, Op op) {
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    T* const b[N] = {bufs[K]...};
    PDO_IVDEP
    for (std::size_t i = lo; i < hi; ++i) {
      T v = b[0][i];
      ((v = K == 0 ? v : op(v, b[K][i])), ...);
      ((b[K][i] = v), ...);
    }
  }(std::make_index_sequence<N>{});
}

/// @brief reduce_in_place for any number of buffers and any reduce_op: one fused pass
/// for up to four buffers (the memory-traffic limit), blocks through an L1-resident
/// accumulator beyond.
template <class T>
void reduce_in_place(std::span<T* const> bufs, std::size_t lo, std::size_t hi, reduce_op op) {
  auto with_op = [&](auto run) {
    switch (op) {
      case reduce_op::sum: return run([](T a, T b) { return a + b; });
      case reduce_op::max: return run([](T a, T b) { return a < b ? b : a; });
      case reduce_op::min: return run([](T a, T b) { return b < a ? b : a; });
    }
  };
  switch (bufs.size()) {
    case 1: return;
    case 2: return with_op([&](auto f) { reduce_in_place<2>(bufs.data(), lo, hi, f); });
    case 3: return with_op([&](auto f) { reduce_in_place<3>(bufs.data(), lo, hi, f); });
    case 4: return with_op([&](auto f) { reduce_in_place<4>(bufs.data(), lo, hi, f); });
    default:
      reduce_blocks<T>(std::span<const T* const>(bufs.data(), bufs.size()), bufs, lo, hi, op);
  }
}

/// @brief The part of [0, n) that member `me` of `members` works on, cut at 64-byte
/// boundaries so no two members write the same cache line.
template <class T>
std::pair<std::size_t, std::size_t> work_range(std::size_t n, std::size_t members, std::size_t me) {
  constexpr std::size_t align = std::max<std::size_t>(1, 64 / sizeof(T));
  const std::size_t units = (n + align - 1) / align;
  const std::size_t lo = std::min(n, chunk_offset(units, members, me) * align);
  const std::size_t hi = std::min(n, (chunk_offset(units, members, me) + chunk_size(units, members, me)) * align);
  return {lo, hi};
}

/// @brief The members of one group that live in this process, and the shared slots
/// through which they see each other's buffers. Every collective is called by all
/// `size()` members at once, each from its own thread, with its own member index.
///
/// Protocol: publish the buffers, barrier, check the arguments agree (all members
/// reach the same verdict from the same slots, so a mismatch is an error on every
/// member, never a hang), do this member's share of the work, barrier.
class local_group {
 public:
  explicit local_group(std::vector<std::string> member_names)
      : names_(std::move(member_names)), slots_(names_.size()), barrier_(static_cast<std::uint32_t>(names_.size())) {}

  [[nodiscard]] std::size_t size() const { return names_.size(); }
  [[nodiscard]] const std::string& name(std::size_t member) const { return names_[member]; }

  void barrier() { barrier_.arrive_and_wait(); }
  void barrier(std::size_t /*me*/) { barrier_.arrive_and_wait(); }

  /// @brief Wakes every member blocked in this group with an error; see reset().
  void abort() {
    barrier_.abort();
    std::lock_guard lock(mail_mutex_);
    mail_aborted_ = true;
    mail_ready_.notify_all();
  }
  /// @brief Makes the group usable again once no member is inside a collective.
  void reset() {
    barrier_.reset();
    std::lock_guard lock(mail_mutex_);
    mail_aborted_ = false;
    mailbox_.clear();
  }

  template <class T>
  void all_reduce(std::size_t me, std::span<T> data, reduce_op op) {
    std::array<T*, 4> few{};  // allocated before the entry barrier: nothing throws between the barriers
    std::vector<T*> many(size() > few.size() ? size() : 0);
    T** bufs = many.empty() ? few.data() : many.data();
    publish(me, {data.data(), data.data(), data.size(), data.size()});
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_equal_counts("all_reduce", &slot::in_count, me);
    const auto [lo, hi] = work_range<T>(data.size(), size(), me);
    for (std::size_t k = 0; k < size(); ++k) bufs[k] = static_cast<T*>(slots_[k].out);
    reduce_in_place<T>(std::span<T* const>(bufs, size()), lo, hi, op);
  }

  /// @brief `out` (same size on every member) = the members' `in` concatenated in
  /// member order; inputs may differ in size.
  template <class T>
  void all_gather(std::size_t me, std::span<const T> in, std::span<T> out) {
    publish(me, {in.data(), out.data(), in.size(), out.size()});
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_total("all_gather", me);
    std::size_t offset = 0;
    for (const slot& s : slots_) {
      copy_elements(out.data() + offset, static_cast<const T*>(s.in), s.in_count);
      offset += s.in_count;
    }
  }

  /// @brief `in` (same size on every member) reduced over members; member k keeps the
  /// k-th segment, whose size is its `out.size()`.
  template <class T>
  void reduce_scatter(std::size_t me, std::span<const T> in, std::span<T> out, reduce_op op) {
    std::vector<const T*> srcs(size());  // allocated before the entry barrier
    publish(me, {in.data(), out.data(), in.size(), out.size()});
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_equal_counts("reduce_scatter", &slot::in_count, me);
    check_total("reduce_scatter", me, /*outputs_sum_to_input=*/true);
    std::size_t offset = 0;
    for (std::size_t k = 0; k < me; ++k) offset += slots_[k].out_count;
    for (std::size_t k = 0; k < size(); ++k) srcs[k] = static_cast<const T*>(slots_[k].in) + offset;
    T* dst = out.data();
    reduce_blocks<T>(srcs, std::span<T* const>(&dst, 1), 0, out.size(), op);
  }

  template <class T>
  void broadcast(std::size_t me, std::span<T> data, std::size_t root) {
    publish(me, {data.data(), data.data(), data.size(), root});
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_equal_counts("broadcast", &slot::in_count, me);
    for (const slot& s : slots_)
      if (s.out_count != root)
        fail_after_barrier("broadcast: members named different roots (" + counts_text(&slot::out_count) + ")");
    if (root >= size()) fail_after_barrier("broadcast: root " + std::to_string(root) + " is not a member of a group of " + std::to_string(size()));
    if (me != root) copy_elements(data.data(), static_cast<const T*>(slots_[root].in), data.size());
  }

  /// @brief Member i sends `in`'s i->j piece (send_counts[j] elements, pieces in member
  /// order) to member j, which receives recv_counts[i] elements from i, in member order.
  template <class T>
  void all_to_all(std::size_t me, std::span<const T> in, std::span<const std::size_t> send_counts, std::span<T> out,
                  std::span<const std::size_t> recv_counts) {
    slot s{in.data(), out.data(), in.size(), out.size()};
    s.send_counts = send_counts.data();
    s.recv_counts = recv_counts.data();
    s.counts_size = send_counts.size() == recv_counts.size() ? send_counts.size() : 0;
    publish(me, s);
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_all_to_all(me);
    std::size_t out_offset = 0;
    for (std::size_t i = 0; i < size(); ++i) {
      const slot& src = slots_[i];
      std::size_t in_offset = 0;
      for (std::size_t j = 0; j < me; ++j) in_offset += src.send_counts[j];
      copy_elements(out.data() + out_offset, static_cast<const T*>(src.in) + in_offset, recv_counts[i]);
      out_offset += recv_counts[i];
    }
  }

  /// @brief Blocks until member `to` has received `data` with a matching recv.
  template <class T>
  void send(std::size_t me, std::span<const T> data, std::size_t to, int tag) {
    check_peer("send", me, to, tag);
    std::unique_lock lock(mail_mutex_);
    const auto mine = post_for({me, to, tag});
    mine->data = data.data();
    mine->count = data.size();
    mine->posted = true;
    mail_ready_.notify_all();
    mail_ready_.wait(lock, [&] { return mine->done || mail_aborted_; });
    if (!mine->done) {  // withdraw the post: its buffer is about to go away
      if (auto it = mailbox_.find({me, to, tag}); it != mailbox_.end() && it->second == mine) mailbox_.erase(it);
      throw collective_aborted("send aborted: another place of the group failed");
    }
    if (!mine->problem.empty()) throw mismatch_error(mine->problem);
  }

  /// @brief Receives exactly `data.size()` elements from member `from` (an error on both
  /// sides when the sizes differ).
  template <class T>
  void recv(std::size_t me, std::span<T> data, std::size_t from, int tag) {
    check_peer("recv", me, from, tag);
    std::unique_lock lock(mail_mutex_);
    const auto theirs = post_for({from, me, tag});
    mail_ready_.wait(lock, [&] { return mail_aborted_ || theirs->posted; });
    if (mail_aborted_) throw collective_aborted("recv aborted: another place of the group failed");
    mailbox_.erase({from, me, tag});  // consumed: the next send with this key makes a new post
    if (theirs->count != data.size())
      theirs->problem = "send/recv: " + names_[from] + " sent " + std::to_string(theirs->count) + " elements with tag " +
                        std::to_string(tag) + " but " + names_[me] + " expects " + std::to_string(data.size());
    else
      copy_elements(data.data(), static_cast<const T*>(theirs->data), data.size());
    theirs->done = true;
    mail_ready_.notify_all();
    if (!theirs->problem.empty()) throw mismatch_error(theirs->problem);
  }

 private:
  struct slot {
    const void* in = nullptr;
    void* out = nullptr;
    std::size_t in_count = 0;
    std::size_t out_count = 0;
    const std::size_t* send_counts = nullptr;
    const std::size_t* recv_counts = nullptr;
    std::size_t counts_size = 0;
  };
  struct post {
    const void* data = nullptr;
    std::size_t count = 0;
    bool posted = false;
    bool done = false;
    std::string problem;
  };

  void publish(std::size_t me, const slot& s) { slots_[me] = s; }

  using mail_key = std::tuple<std::size_t, std::size_t, int>;  ///< from, to, tag

  /// @brief The post for `key`, made by whichever of sender and receiver comes first.
  std::shared_ptr<post> post_for(const mail_key& key) {
    auto& slot = mailbox_[key];
    if (!slot) slot = std::make_shared<post>();
    return slot;
  }

  void check_peer(const char* op, std::size_t me, std::size_t peer, int tag) const {
    if (peer >= size() || peer == me || tag < 0)
      throw communication_error(std::string(op) + ": " + names_[me] + " named member " + std::to_string(peer) +
                                " with tag " + std::to_string(tag) + "; the peer must be another member of the group of " +
                                std::to_string(size()) + " and the tag non-negative");
  }

  /// @brief The error every member of a collective finds alike; the closing barrier of
  /// the collective is passed as the exception leaves its scope.
  [[noreturn]] static void fail_after_barrier(const std::string& what) { throw mismatch_error(what); }

  std::string counts_text(std::size_t slot::*field) const {
    std::string text;
    for (std::size_t k = 0; k < size(); ++k)
      text += (k ? ", " : "") + names_[k] + ": " + std::to_string(slots_[k].*field);
    return text;
  }

  void check_equal_counts(const char* op, std::size_t slot::*field, std::size_t) {
    for (const slot& s : slots_)
      if (s.*field != slots_[0].*field)
        fail_after_barrier(std::string(op) + ": members called it with different sizes (" + counts_text(field) + ")");
  }

  void check_total(const char* op, std::size_t, bool outputs_sum_to_input = false) {
    std::size_t total = 0;
    if (outputs_sum_to_input) {
      for (const slot& s : slots_) total += s.out_count;
      if (total != slots_[0].in_count)
        fail_after_barrier(std::string(op) + ": outputs add up to " + std::to_string(total) +
                           " elements but the input has " + std::to_string(slots_[0].in_count) + " (" +
                           counts_text(&slot::out_count) + ")");
      return;
    }
    for (const slot& s : slots_) total += s.in_count;
    for (const slot& s : slots_)
      if (s.out_count != total)
        fail_after_barrier(std::string(op) + ": inputs add up to " + std::to_string(total) +
                           " elements but outputs hold (" + counts_text(&slot::out_count) + ")");
  }

  void check_all_to_all(std::size_t) {
    for (std::size_t i = 0; i < size(); ++i) {
      const slot& si = slots_[i];
      std::size_t sent = 0, received = 0;
      if (si.counts_size != size())
        fail_after_barrier("all_to_all: " + names_[i] + " gave send and receive counts that are not one per member of a group of " +
                           std::to_string(size()));
      for (std::size_t j = 0; j < size(); ++j) {
        sent += si.send_counts[j];
        received += si.recv_counts[j];
      }
      if (sent != si.in_count || received != si.out_count)
        fail_after_barrier("all_to_all: " + names_[i] + "'s counts do not add up to its buffers");
    }
    for (std::size_t i = 0; i < size(); ++i)
      for (std::size_t j = 0; j < size(); ++j)
        if (slots_[i].send_counts[j] != slots_[j].recv_counts[i])
          fail_after_barrier("all_to_all: " + names_[i] + " sends " + std::to_string(slots_[i].send_counts[j]) +
                             " elements to " + names_[j] + ", which expects " +
                             std::to_string(slots_[j].recv_counts[i]));
  }

  std::vector<std::string> names_;
  std::vector<slot> slots_;
  group_barrier barrier_;

  std::mutex mail_mutex_;
  std::condition_variable mail_ready_;
  std::map<mail_key, std::shared_ptr<post>> mailbox_;
  bool mail_aborted_ = false;
};

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_COMM_THREADS_LOCAL_GROUP_HPP
// ---- pdo/place/mesh.hpp
#ifndef PDO_SINGLE_PDO_PLACE_MESH_HPP
#define PDO_SINGLE_PDO_PLACE_MESH_HPP
// pdo/place/mesh.hpp: an N-D grid of places with named axes, in one process or many.

// ---- pdo/core/fixed_string.hpp
#ifndef PDO_SINGLE_PDO_CORE_FIXED_STRING_HPP
#define PDO_SINGLE_PDO_CORE_FIXED_STRING_HPP
// pdo/core/fixed_string.hpp: a string usable as a template argument (mesh axis names).

#include <algorithm>
#include <cstddef>
#include <string_view>

namespace pdo {

/// @brief A compile-time string literal, usable as a non-type template parameter
/// (`pdo::split<"dp">`, `pdo::mesh<"dp", "tp">`).
template <std::size_t N>
struct fixed_string {
  char chars[N]{};

  constexpr fixed_string(const char (&text)[N]) { std::copy_n(text, N, chars); }

  [[nodiscard]] constexpr std::string_view view() const { return {chars, N - 1}; }
  [[nodiscard]] constexpr operator std::string_view() const { return view(); }

  template <std::size_t M>
  [[nodiscard]] constexpr bool operator==(const fixed_string<M>& other) const {
    return view() == other.view();
  }
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_CORE_FIXED_STRING_HPP
// ---- pdo/place/place_concept.hpp
#ifndef PDO_SINGLE_PDO_PLACE_PLACE_CONCEPT_HPP
#define PDO_SINGLE_PDO_PLACE_PLACE_CONCEPT_HPP
// pdo/place/place_concept.hpp: the `place` concept and the type-erased place handle.

// ---- pdo/place/place_state.hpp
#ifndef PDO_SINGLE_PDO_PLACE_PLACE_STATE_HPP
#define PDO_SINGLE_PDO_PLACE_PLACE_STATE_HPP
// pdo/place/place_state.hpp: what every place handle shares: identity, cores, memory, worker.

// ---- pdo/place/worker.hpp
#ifndef PDO_SINGLE_PDO_PLACE_WORKER_HPP
#define PDO_SINGLE_PDO_PLACE_WORKER_HPP
// pdo/place/worker.hpp: the thread a place runs its work on, in submission order.

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace pdo::detail {

/// @brief Pins the calling thread to `cores` (Linux); does nothing for an empty set.
inline void pin_current_thread(const std::vector<int>& cores) {
#if defined(__linux__)
  if (cores.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cores) CPU_SET(c, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
#else
  (void)cores;
#endif
}

/// @brief The cores this process may run on (its affinity mask), in increasing order.
inline std::vector<int> process_cores() {
  std::vector<int> cores;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cores.push_back(c);
#endif
  if (cores.empty())
    for (unsigned c = 0; c < std::max(1u, std::thread::hardware_concurrency()); ++c) cores.push_back(static_cast<int>(c));
  return cores;
}

/// @brief One thread that runs submitted tasks in order. Tasks must not throw: the
/// callers wrap them and carry exceptions back themselves (see run_on_places).
///
/// After its last task the thread keeps looking for new work for a few microseconds
/// (yielding its core meanwhile) before it sleeps, so that a program issuing one short
/// operation after another does not pay a wake-up per operation.
class worker {
 public:
  explicit worker(std::vector<int> pin_to) : thread_([this, cores = std::move(pin_to)] { loop(cores); }) {}
  worker(const worker&) = delete;
  worker& operator=(const worker&) = delete;
  ~worker() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

  void submit(std::function<void()> task) {
    bool asleep = false;
    {
      std::lock_guard lock(mutex_);
      tasks_.push_back(std::move(task));
      queued_.fetch_add(1, std::memory_order_release);
      asleep = sleeping_;
    }
    if (asleep) wake_.notify_one();
  }

  /// @brief True when called from this worker's own thread.
  [[nodiscard]] bool is_current() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  static constexpr int idle_polls = 200;

  void loop(const std::vector<int>& cores) {
    pin_current_thread(cores);
    for (;;) {
      for (int poll = 0; poll < idle_polls && queued_.load(std::memory_order_acquire) == 0; ++poll)
        std::this_thread::yield();
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        sleeping_ = true;
        wake_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        sleeping_ = false;
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
        queued_.fetch_sub(1, std::memory_order_relaxed);
      }
      task();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> tasks_;
  std::atomic<std::size_t> queued_{0};  ///< tasks_.size(), readable without the lock
  bool sleeping_ = false;
  bool stop_ = false;
  std::thread thread_;
};

/// @brief A count of tasks still running, that the waiting thread polls briefly (yielding)
/// before it sleeps on it: short operations return without a wake-up.
class completion {
 public:
  explicit completion(std::size_t count) : left_(count) {}
  void count_down() {
    if (left_.fetch_sub(1, std::memory_order_acq_rel) == 1) left_.notify_all();
  }
  void wait() const {
    for (int poll = 0; poll < 200; ++poll) {
      if (left_.load(std::memory_order_acquire) == 0) return;
      std::this_thread::yield();
    }
    for (std::size_t now = left_.load(std::memory_order_acquire); now != 0; now = left_.load(std::memory_order_acquire))
      left_.wait(now, std::memory_order_acquire);
  }

 private:
  std::atomic<std::size_t> left_;
};

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_PLACE_WORKER_HPP
// ---- pdo/memory/caching_allocator.hpp
#ifndef PDO_SINGLE_PDO_MEMORY_CACHING_ALLOCATOR_HPP
#define PDO_SINGLE_PDO_MEMORY_CACHING_ALLOCATOR_HPP
// pdo/memory/caching_allocator.hpp: per-place caching allocator with statistics and a cap.

// ---- pdo/memory/memory_stats.hpp
#ifndef PDO_SINGLE_PDO_MEMORY_MEMORY_STATS_HPP
#define PDO_SINGLE_PDO_MEMORY_MEMORY_STATS_HPP
// pdo/memory/memory_stats.hpp: what a place's allocator reports.

#include <cstddef>

namespace pdo {

/// @brief A snapshot of one place's allocator.
struct memory_stats {
  std::size_t bytes_in_use = 0;     ///< bytes handed out and not yet returned
  std::size_t peak_bytes_in_use = 0;///< highest bytes_in_use since creation or reset_peak()
  std::size_t bytes_cached = 0;     ///< bytes returned and kept for reuse
  std::size_t allocations = 0;      ///< number of allocate() calls served
  std::size_t system_allocations = 0; ///< of those, how many went to the system allocator
  std::size_t cap = 0;              ///< bytes_in_use + bytes_cached may not exceed it (0: no cap)
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_MEMORY_MEMORY_STATS_HPP

#include <cstddef>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

/// @brief Where a caching allocator takes blocks from and gives them back to: host
/// memory for CPU places, device memory for GPU places. `allocate` returns nullptr
/// when the system refuses.
struct memory_system {
  void* (*allocate)(std::size_t bytes, int device);
  void (*deallocate)(void* p, std::size_t bytes, int device) noexcept;
  int device = 0;
  const char* name = "host";
};

/// @brief Host memory, 64-byte aligned (one cache line, one AVX-512 vector).
inline memory_system host_memory_system() {
  constexpr std::align_val_t alignment{64};
  return {[](std::size_t bytes, int) -> void* { return ::operator new(bytes, alignment, std::nothrow); },
          [](void* p, std::size_t, int) noexcept { ::operator delete(p, alignment); }, 0, "host"};
}

/// @brief A thread-safe caching allocator owned by one place.
///
/// Freed blocks are kept in size classes and reused; when a request would take the
/// place over its cap, the cache is released first and, if that is not enough, the
/// request fails with pdo::out_of_memory naming the place, the request and the cap.
class caching_allocator {
 public:
  explicit caching_allocator(std::string owner, std::size_t cap = 0, memory_system system = host_memory_system())
      : owner_(std::move(owner)), system_(system) {
    stats_.cap = cap;
  }
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;
  ~caching_allocator() { release_cache(); }

  /// @brief A block of at least `bytes` bytes, 64-byte aligned. Zero bytes gives nullptr.
  void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    if (bytes > max_request) throw refused(bytes, "no block that large can exist");
    const std::size_t block = size_class(bytes);
    std::lock_guard lock(mutex_);
    if (stats_.cap != 0 && stats_.bytes_in_use + block > stats_.cap)
      throw refused(bytes, "with " + std::to_string(stats_.bytes_in_use) + " bytes in use, its block of " +
                               std::to_string(block) + " bytes exceeds the cap of " + std::to_string(stats_.cap) + " bytes");
    if (auto it = cache_.find(block); it != cache_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      stats_.bytes_cached -= block;
      note_in_use(block);
      return p;
    }
    if (stats_.cap != 0 && stats_.bytes_in_use + stats_.bytes_cached + block > stats_.cap) release_cache_locked();
    void* p = system_.allocate(block, system_.device);
    if (p == nullptr) {
      release_cache_locked();
      p = system_.allocate(block, system_.device);
    }
    if (p == nullptr)
      throw refused(bytes, "the system refused it (" + std::to_string(stats_.bytes_in_use) + " bytes in use)");
    ++stats_.system_allocations;
    note_in_use(block);
    return p;
  }

  /// @brief Returns a block obtained from allocate(bytes) with the same `bytes`.
  void deallocate(void* p, std::size_t bytes) noexcept {
    if (p == nullptr) return;
    const std::size_t block = size_class(bytes);
    std::lock_guard lock(mutex_);
    stats_.bytes_in_use -= block;
    stats_.bytes_cached += block;
    try {
      cache_[block].push_back(p);
    } catch (...) {
      stats_.bytes_cached -= block;
      system_.deallocate(p, block, system_.device);
    }
  }

  /// @brief Gives every cached block back to the system.
  void release_cache() {
    std::lock_guard lock(mutex_);
    release_cache_locked();
  }

  [[nodiscard]] memory_stats stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }
  void set_cap(std::size_t cap) {
    std::lock_guard lock(mutex_);
    stats_.cap = cap;
  }
  void reset_peak() {
    std::lock_guard lock(mutex_);
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
  }
  [[nodiscard]] const std::string& owner() const { return owner_; }

  /// @brief The block size a request is served with: multiples of 256 bytes up to
  /// 64 KiB, then quarter steps between powers of two (at most 25% slack).
  static constexpr std::size_t size_class(std::size_t bytes) {
    constexpr std::size_t small = 256;
    if (bytes <= (std::size_t{64} << 10)) return (bytes + small - 1) / small * small;
    std::size_t pow2 = std::size_t{1} << 16;
    while (pow2 * 2 < bytes) pow2 *= 2;
    const std::size_t step = pow2 / 4;
    return (bytes + step - 1) / step * step;
  }

 private:
  /// @brief Requests above this size are refused before rounding (it would overflow).
  static constexpr std::size_t max_request = std::size_t{1} << (sizeof(std::size_t) * 8 - 2);

  out_of_memory refused(std::size_t bytes, const std::string& why) const {
    return out_of_memory("out of memory on " + owner_ + ": request of " + std::to_string(bytes) + " bytes: " + why);
  }
  void note_in_use(std::size_t block) {
    ++stats_.allocations;
    stats_.bytes_in_use += block;
    if (stats_.bytes_in_use > stats_.peak_bytes_in_use) stats_.peak_bytes_in_use = stats_.bytes_in_use;
  }
  void release_cache_locked() noexcept {
    for (auto& [block, blocks] : cache_)
      for (void* p : blocks) system_.deallocate(p, block, system_.device);
    cache_.clear();
    stats_.bytes_cached = 0;
  }

  std::string owner_;
  memory_system system_;
  mutable std::mutex mutex_;
  std::map<std::size_t, std::vector<void*>> cache_;
  memory_stats stats_;
};

/// @brief The allocator of host tensors made without a place.
inline caching_allocator& host_allocator() {
  // never destroyed: tensors with static storage may be freed after main returns
  static caching_allocator* allocator = new caching_allocator("host");
  return *allocator;
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_MEMORY_CACHING_ALLOCATOR_HPP

#include <memory>
#include <string>
#include <vector>

namespace pdo {

/// @brief The kind of device a place is.
enum class place_kind { cpu, cuda };

namespace detail {

/// @brief The state behind a place handle. A place of another process (an MPI rank)
/// has no worker and no allocator here: only its identity.
struct place_state : std::enable_shared_from_this<place_state> {
  place_kind kind = place_kind::cpu;
  int ordinal = 0;          ///< index among the places of its kind in its process (or device ordinal)
  int process = 0;          ///< the MPI rank that owns it (0 in a single process)
  bool local = true;        ///< owned by this process
  std::vector<int> cores;   ///< the cores its work may use
  std::string name;         ///< "cpu:0", "cuda:1", "rank1/cpu:0"
  std::unique_ptr<caching_allocator> memory;
  std::unique_ptr<worker> runner;  ///< declared last: destroyed first, before the memory it uses

  place_state(place_kind k, int ord, int proc, bool is_local, std::vector<int> cpu_cores, std::string label)
      : kind(k), ordinal(ord), process(proc), local(is_local), cores(std::move(cpu_cores)), name(std::move(label)) {}
};

/// @brief The place whose worker runs the calling thread, or nullptr on other threads.
inline place_state*& current_place() {
  thread_local place_state* current = nullptr;
  return current;
}

/// @brief Starts `state`'s worker: a thread pinned to `pin_to` that knows its place.
inline void start_worker(place_state& state, std::vector<int> pin_to) {
  state.runner = std::make_unique<worker>(std::move(pin_to));
  state.runner->submit([s = &state] { current_place() = s; });
}

}  // namespace detail
}  // namespace pdo
#endif  // PDO_SINGLE_PDO_PLACE_PLACE_STATE_HPP

#include <concepts>
#include <memory>
#include <string>
#include <utility>

namespace pdo {

/// @brief A place: one device that owns memory and runs work (a CPU worker, a GPU).
/// Types opt in with a nested `using place_tag = void;` and expose their shared state.
template <class P>
concept place = requires(const P& p) {
  typename P::place_tag;
  { p.kind() } -> std::same_as<place_kind>;
  { p.name() } -> std::convertible_to<std::string>;
  { p.is_local() } -> std::same_as<bool>;
  { p.state() } -> std::same_as<const std::shared_ptr<detail::place_state>&>;
};

namespace detail {

/// @brief The members every place handle has; a handle is a shared reference to
/// its state, cheap to copy, equal when it names the same place.
template <class Derived>
class place_handle {
 public:
  using place_tag = void;

  [[nodiscard]] place_kind kind() const { return state_->kind; }
  [[nodiscard]] const std::string& name() const { return state_->name; }
  [[nodiscard]] bool is_local() const { return state_->local; }
  [[nodiscard]] int process() const { return state_->process; }
  [[nodiscard]] int ordinal() const { return state_->ordinal; }
  [[nodiscard]] const std::vector<int>& cores() const { return state_->cores; }
  [[nodiscard]] const std::shared_ptr<place_state>& state() const { return state_; }

  /// @brief The place's allocator; only places of this process have one.
  [[nodiscard]] caching_allocator& memory() const {
    if (!state_->memory) throw layout_error("memory: place " + state_->name + " belongs to another process");
    return *state_->memory;
  }
  /// @brief Runs `task` on the place's worker, after the work submitted before it.
  template <class Task>
  void submit(Task&& task) const {
    if (!state_->runner) throw layout_error("submit: place " + state_->name + " belongs to another process");
    state_->runner->submit(std::forward<Task>(task));
  }

  friend bool operator==(const Derived& a, const Derived& b) { return a.state_ == b.state_; }

 protected:
  place_handle() = default;
  explicit place_handle(std::shared_ptr<place_state> s) : state_(std::move(s)) {}
  std::shared_ptr<place_state> state_;
};

}  // namespace detail

/// @brief Any place, whatever its kind: what a mesh holds.
class any_place : public detail::place_handle<any_place> {
 public:
  template <place P>
    requires(!std::same_as<P, any_place>)
  any_place(const P& p) : place_handle(p.state()) {}  // NOLINT: implicit, a place is an any_place
  explicit any_place(std::shared_ptr<detail::place_state> s) : place_handle(std::move(s)) {}
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_PLACE_PLACE_CONCEPT_HPP

#include <array>
#include <cstddef>
#include <memory>
#include <mutex>
#include <ranges>
#include <string>
#include <string_view>
#include <vector>

namespace pdo {

namespace detail {

struct mesh_comms;  // the mesh's communicators, built by the comm layer on first use

/// @brief What all copies of one mesh share.
struct mesh_state {
  std::vector<std::string> axes;
  std::vector<std::size_t> extents;
  std::vector<any_place> places;      ///< row-major over the axes: the last axis varies fastest
  std::vector<std::size_t> local;     ///< indices of the places of this process
  bool multiprocess = false;          ///< some places belong to other processes
  std::once_flag comms_once;
  std::shared_ptr<mesh_comms> comms;
};

}  // namespace detail

/// @brief An N-D grid of places whose axes are named by `Axes` ("dp", "tp", "pp").
/// Extents are run-time values; the axis names are part of the type, so layouts can
/// be checked against the mesh at compile time. Copies share one state.
template <fixed_string... Axes>
class mesh {
  static_assert(sizeof...(Axes) >= 1, "pdo: mesh: a mesh needs at least one named axis, e.g. pdo::mesh<\"dp\">");

  static constexpr bool distinct_names() {
    constexpr std::array<std::string_view, sizeof...(Axes)> names{Axes.view()...};
    for (std::size_t i = 0; i < names.size(); ++i)
      for (std::size_t j = i + 1; j < names.size(); ++j)
        if (names[i] == names[j]) return false;
    return true;
  }
  static_assert(distinct_names(), "pdo: mesh: two axes have the same name; give every mesh axis its own name");

 public:
  using mesh_tag = void;
  static constexpr std::size_t ndim = sizeof...(Axes);
  static constexpr std::array<std::string_view, ndim> axis_names{Axes.view()...};

  /// @brief The position of axis `name`, or ndim when the mesh has no such axis.
  static constexpr std::size_t axis_index(std::string_view name) {
    for (std::size_t i = 0; i < ndim; ++i)
      if (axis_names[i] == name) return i;
    return ndim;
  }
  static constexpr bool has_axis(std::string_view name) { return axis_index(name) < ndim; }

  explicit mesh(std::shared_ptr<detail::mesh_state> state) : state_(std::move(state)) {}

  [[nodiscard]] std::size_t size() const { return state_->places.size(); }
  [[nodiscard]] std::size_t extent(std::size_t axis) const { return state_->extents[axis]; }
  [[nodiscard]] std::size_t extent(std::string_view axis) const { return extent(checked_axis(axis)); }
  [[nodiscard]] const std::vector<std::size_t>& extents() const { return state_->extents; }
  [[nodiscard]] const any_place& place(std::size_t index) const {
    if (index >= size())
      throw layout_error(describe() + " has " + std::to_string(size()) + " places; there is no place " + std::to_string(index));
    return state_->places[index];
  }
  [[nodiscard]] const std::vector<any_place>& places() const { return state_->places; }
  /// @brief Indices of the places that belong to this process.
  [[nodiscard]] const std::vector<std::size_t>& local_places() const { return state_->local; }
  [[nodiscard]] bool is_multiprocess() const { return state_->multiprocess; }

  /// @brief The coordinates of place `index` (row-major: the last axis varies fastest).
  [[nodiscard]] std::array<std::size_t, ndim> coords(std::size_t index) const {
    std::array<std::size_t, ndim> c{};
    for (std::size_t a = ndim; a-- > 0;) {
      c[a] = index % state_->extents[a];
      index /= state_->extents[a];
    }
    return c;
  }
  [[nodiscard]] std::size_t coord(std::size_t index, std::size_t axis) const { return coords(index)[axis]; }
  [[nodiscard]] std::size_t index(const std::array<std::size_t, ndim>& c) const {
    std::size_t i = 0;
    for (std::size_t a = 0; a < ndim; ++a) i = i * state_->extents[a] + c[a];
    return i;
  }

  /// @brief The places that differ from place `index` only along `axis`, in
  /// coordinate order: the group a collective along that axis runs over.
  [[nodiscard]] std::vector<std::size_t> group(std::size_t axis, std::size_t index) const {
    auto c = coords(index);
    std::vector<std::size_t> members;
    for (std::size_t k = 0; k < extent(axis); ++k) {
      c[axis] = k;
      members.push_back(this->index(c));
    }
    return members;
  }

  /// @brief "mesh(dp=2, tp=2)".
  [[nodiscard]] std::string describe() const {
    std::string text = "mesh(";
    for (std::size_t a = 0; a < ndim; ++a)
      text += (a ? ", " : "") + std::string(axis_names[a]) + "=" + std::to_string(extent(a));
    return text + ")";
  }

  [[nodiscard]] const std::shared_ptr<detail::mesh_state>& state() const { return state_; }
  friend bool operator==(const mesh& a, const mesh& b) { return a.state_ == b.state_; }

 private:
  std::size_t checked_axis(std::string_view name) const {
    const std::size_t a = axis_index(name);
    if (a == ndim) throw layout_error(describe() + " has no axis \"" + std::string(name) + "\"");
    return a;
  }
  std::shared_ptr<detail::mesh_state> state_;
};

// Found by mesh's member, not by a partial specialization on mesh<Axes...>: nvcc's
// front end does not match partial specializations on string template arguments.
template <class M>
inline constexpr bool is_mesh_v = requires { typename M::mesh_tag; };

/// @brief A mesh type: pdo::mesh<"a", ...>.
template <class M>
concept mesh_type = is_mesh_v<M>;

/// @brief Lays `places` out as a grid with the given extents, one per axis:
/// `make_mesh<"dp", "tp">(places, {2, 2})`. The product of the extents must be the
/// number of places. A mesh over places of several processes (pdo::mpi::world_places)
/// must be made by every process, with the same arguments, in the same order.
template <fixed_string... Axes, std::ranges::input_range Places, std::size_t N>
  requires place<std::ranges::range_value_t<Places>>
mesh<Axes...> make_mesh(const Places& places, const std::size_t (&extents)[N]) {
  static_assert(N == sizeof...(Axes), "pdo: make_mesh: give exactly one extent per mesh axis");
  auto state = std::make_shared<detail::mesh_state>();
  state->axes = {std::string(Axes.view())...};
  state->extents.assign(extents, extents + N);
  for (const auto& p : places) state->places.emplace_back(p);
  std::size_t product = 1;
  for (auto e : state->extents) product *= e;
  const mesh<Axes...> probe(state);
  if (product != state->places.size() || product == 0)
    throw layout_error("make_mesh: extents " + detail::format_extents(state->extents) + " of " + probe.describe() +
                       " hold " + std::to_string(product) + " places but " + std::to_string(state->places.size()) +
                       " were given; make the product of the extents equal the number of places");
  for (std::size_t i = 0; i < state->places.size(); ++i) {
    const auto& p = state->places[i];
    for (std::size_t j = 0; j < i; ++j)
      if (state->places[j] == p)
        throw layout_error("make_mesh: place " + p.name() + " appears twice in " + probe.describe());
    if (i > 0 && p.process() < state->places[i - 1].process())
      throw layout_error("make_mesh: places must be ordered by process (" + p.name() + " comes after " +
                         state->places[i - 1].name() + ")");
    if (p.is_local()) state->local.push_back(i);
    else state->multiprocess = true;
  }
  return probe;
}

/// @brief A one-axis mesh over all of `places`.
template <fixed_string Axis, std::ranges::input_range Places>
  requires place<std::ranges::range_value_t<Places>>
mesh<Axis> make_mesh(const Places& places) {
  const std::size_t n = static_cast<std::size_t>(std::ranges::distance(places));
  return make_mesh<Axis>(places, {n});
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_PLACE_MESH_HPP

#if defined(PDO_WITH_MPI)
// ---- pdo/comm/mpi/group.hpp
#ifndef PDO_SINGLE_PDO_COMM_MPI_GROUP_HPP
#define PDO_SINGLE_PDO_COMM_MPI_GROUP_HPP
// pdo/comm/mpi/group.hpp: a group of places spread over MPI processes, one or more per process.

// ---- pdo/comm/mpi/environment.hpp
#ifndef PDO_SINGLE_PDO_COMM_MPI_ENVIRONMENT_HPP
#define PDO_SINGLE_PDO_COMM_MPI_ENVIRONMENT_HPP
// pdo/comm/mpi/environment.hpp: MPI start-up, datatypes and error checking for the MPI backend.


#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // the C API is all pdo uses
#endif
#include <mpi.h>

#include <climits>
#include <concepts>
#include <cstddef>
#include <cstdlib>
#include <string>

namespace pdo::mpi {

namespace detail {

inline void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

inline void check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw communication_error(std::string("mpi: ") + call + " failed: " + std::string(text, static_cast<std::size_t>(length)));
}

template <class T>
MPI_Datatype datatype() {
  if constexpr (std::same_as<T, float>) return MPI_FLOAT;
  else if constexpr (std::same_as<T, double>) return MPI_DOUBLE;
  else if constexpr (std::same_as<T, long double>) return MPI_LONG_DOUBLE;
  else if constexpr (std::signed_integral<T>) {
    if constexpr (sizeof(T) == 1) return MPI_INT8_T;
    else if constexpr (sizeof(T) == 2) return MPI_INT16_T;
    else if constexpr (sizeof(T) == 4) return MPI_INT32_T;
    else return MPI_INT64_T;
  } else {
    if constexpr (sizeof(T) == 1) return MPI_UINT8_T;
    else if constexpr (sizeof(T) == 2) return MPI_UINT16_T;
    else if constexpr (sizeof(T) == 4) return MPI_UINT32_T;
    else return MPI_UINT64_T;
  }
}

inline MPI_Op op(reduce_op o) {
  switch (o) {
    case reduce_op::sum: return MPI_SUM;
    case reduce_op::max: return MPI_MAX;
    case reduce_op::min: return MPI_MIN;
  }
  return MPI_SUM;
}

/// @brief `n` as an MPI count, or an error naming the op when it does not fit an int.
inline int count(std::size_t n, const char* op) {
  if (n > static_cast<std::size_t>(INT_MAX))
    throw communication_error(std::string("mpi: ") + op + ": " + std::to_string(n) +
                              " elements exceed MPI's int count; split the tensor");
  return static_cast<int>(n);
}

}  // namespace detail

/// @brief Starts MPI (with MPI_THREAD_MULTIPLE, as places call it from their own
/// threads) unless it is running already; MPI is finalized when the program exits.
inline void initialize() {
  int started = 0;
  MPI_Initialized(&started);
  if (started) {
    int level = 0;
    MPI_Query_thread(&level);
    if (level < MPI_THREAD_MULTIPLE)
      throw communication_error("mpi: MPI was started without MPI_THREAD_MULTIPLE, which places need; start it with "
                                "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or let pdo start it");
    return;
  }
  int provided = 0;
  detail::check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  std::atexit(detail::finalize_at_exit);
  if (provided < MPI_THREAD_MULTIPLE)
    throw communication_error("mpi: the MPI library does not provide MPI_THREAD_MULTIPLE, which places need");
}

/// @brief This process's rank in MPI_COMM_WORLD.
inline int rank() {
  initialize();
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

/// @brief The number of processes in MPI_COMM_WORLD.
inline int size() {
  initialize();
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

}  // namespace pdo::mpi
#endif  // PDO_SINGLE_PDO_COMM_MPI_ENVIRONMENT_HPP


#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <numeric>
#include <span>
#include <string>
#include <vector>

namespace pdo::mpi::detail {

using pdo::detail::copy_elements;
using pdo::detail::local_group;

/// @brief The group's members are numbered in mesh order and live on increasing MPI
/// ranks; this process holds members [first, first + local size). Each collective
/// runs in three steps: the members of this process publish their buffers; the first
/// of them (the leader) exchanges what all members passed, so every process reaches
/// the same verdict on bad arguments (an error everywhere, never a hang); then the
/// members reduce among themselves through shared memory while the leader moves the
/// combined data between processes, and each member copies out its result.
class group {
 public:
  /// @param members_per_rank for each process of `comm` in rank order, its member count
  /// @param spans_mesh the group holds every place of its mesh (see fail())
  group(MPI_Comm comm, std::vector<std::size_t> members_per_rank, std::vector<std::string> member_names, bool spans_mesh)
      : spans_mesh_(spans_mesh),
        comm_(set_errors_return(comm)),
        rank_(rank_in(comm_)),
        per_rank_(std::move(members_per_rank)),
        first_(first_of(rank_)),
        names_(std::move(member_names)),
        local_(local_names()),
        args_(local_.size()) {}
  group(const group&) = delete;
  group& operator=(const group&) = delete;
  ~group() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  [[nodiscard]] std::size_t size() const { return names_.size(); }

  /// @brief MPI errors on `comm` come back as codes (thrown as communication_error)
  /// instead of ending the job.
  static MPI_Comm set_errors_return(MPI_Comm comm) {
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    return comm;
  }
  [[nodiscard]] std::size_t first() const { return first_; }
  [[nodiscard]] local_group& local() { return local_; }
  /// MPI groups are never aborted: the other processes could not be told, and would wait
  /// in MPI calls for members that left (a failure there ends the job; see run_on_places).
  void abort() {}
  void reset() {}

  void barrier(std::size_t me) {
    exchange(me, {});
    local_.barrier();
  }

  template <class T>
  void all_reduce(std::size_t me, std::span<T> data, reduce_op op) {
    const std::size_t l = me - first();
    args_[l] = {data.data(), data.data()};
    const auto& counts = exchange(me, {data.size()});
    for (std::size_t k = 0; k < size(); ++k)
      if (counts[k] != counts[0]) fail("all_reduce: members called it with different sizes (" + listing(counts, 1, 0) + ")");
    if (local_.size() > 1) local_.all_reduce(l, data, op);
    leader_step(l, [&] {
      pdo::mpi::detail::check(MPI_Allreduce(MPI_IN_PLACE, data.data(), pdo::mpi::detail::count(data.size(), "all_reduce"),
                                            datatype<T>(), op_of(op), comm_),
                              "MPI_Allreduce");
    });
    if (l != 0) copy_elements(data.data(), static_cast<const T*>(args_[0].out), data.size());
    local_.barrier();
  }

  template <class T>
  void all_gather(std::size_t me, std::span<const T> in, std::span<T> out) {
    const std::size_t l = me - first();
    args_[l] = {in.data(), out.data()};
    const auto& counts = exchange(me, {in.size(), out.size()});
    std::size_t total = 0;
    for (std::size_t k = 0; k < size(); ++k) total += counts[2 * k];
    for (std::size_t k = 0; k < size(); ++k)
      if (counts[2 * k + 1] != total)
        fail("all_gather: inputs add up to " + std::to_string(total) + " elements but outputs hold (" + listing(counts, 2, 1) + ")");
    T* leader_out = static_cast<T*>(args_[0].out);
    copy_elements(leader_out + prefix(counts, 2, 0, me), in.data(), in.size());
    local_.barrier();
    leader_step(l, [&] {
      auto [rank_counts, displs] = rank_blocks(counts, 2, 0);
      pdo::mpi::detail::check(MPI_Allgatherv(MPI_IN_PLACE, 0, datatype<T>(), leader_out, rank_counts.data(), displs.data(),
                                             datatype<T>(), comm_),
                              "MPI_Allgatherv");
    });
    if (l != 0) copy_elements(out.data(), static_cast<const T*>(leader_out), out.size());
    local_.barrier();
  }

  template <class T>
  void reduce_scatter(std::size_t me, std::span<const T> in, std::span<T> out, reduce_op op) {
    const std::size_t l = me - first();
    args_[l] = {in.data(), out.data()};
    const auto& counts = exchange(me, {in.size(), out.size()});
    std::size_t total = 0;
    for (std::size_t k = 0; k < size(); ++k) {
      if (counts[2 * k] != counts[0]) fail("reduce_scatter: members called it with different sizes (" + listing(counts, 2, 0) + ")");
      total += counts[2 * k + 1];
    }
    if (total != counts[0])
      fail("reduce_scatter: outputs add up to " + std::to_string(total) + " elements but the input has " + std::to_string(counts[0]));
    // Sum this process's inputs first (each member a slice), then across processes.
    const T* send = in.data();
    std::vector<const T*> srcs(local_.size());
    if (local_.size() > 1) {
      if (l == 0) staging_.resize(in.size() * sizeof(T));
      local_.barrier();
      T* stage = reinterpret_cast<T*>(staging_.data());
      const auto [lo, hi] = pdo::detail::work_range<T>(in.size(), local_.size(), l);
      for (std::size_t k = 0; k < local_.size(); ++k) srcs[k] = static_cast<const T*>(args_[k].in);
      pdo::detail::reduce_blocks<T>(srcs, std::span<T* const>(&stage, 1), lo, hi, op);
      send = stage;
      local_.barrier();
    }
    const std::size_t block_offset = prefix(counts, 2, 1, first());
    leader_step(l, [&] {
      auto [rank_counts, displs] = rank_blocks(counts, 2, 1);
      const std::size_t mine = static_cast<std::size_t>(rank_counts[static_cast<std::size_t>(my_rank())]);
      result_.resize(mine * sizeof(T));
      pdo::mpi::detail::check(MPI_Reduce_scatter(send, result_.data(), rank_counts.data(), datatype<T>(), op_of(op), comm_),
                              "MPI_Reduce_scatter");
    });
    copy_elements(out.data(), reinterpret_cast<const T*>(result_.data()) + (prefix(counts, 2, 1, me) - block_offset), out.size());
    local_.barrier();
  }

  template <class T>
  void broadcast(std::size_t me, std::span<T> data, std::size_t root) {
    const std::size_t l = me - first();
    args_[l] = {data.data(), data.data()};
    const auto& counts = exchange(me, {data.size(), root});
    for (std::size_t k = 0; k < size(); ++k)
      if (counts[2 * k] != counts[0] || counts[2 * k + 1] != counts[1])
        fail("broadcast: members called it with different sizes or roots (" + listing(counts, 2, 0) + "; roots " + listing(counts, 2, 1) + ")");
    if (root >= size()) fail("broadcast: root " + std::to_string(root) + " is not a member of a group of " + std::to_string(size()));
    local_.barrier();
    const int root_rank = rank_of(root);
    const bool root_here = root_rank == my_rank();
    T* source = static_cast<T*>(args_[root_here ? root - first() : 0].out);
    leader_step(l, [&] {
      pdo::mpi::detail::check(MPI_Bcast(source, pdo::mpi::detail::count(data.size(), "broadcast"), datatype<T>(), root_rank, comm_),
                              "MPI_Bcast");
    });
    if (data.data() != source) copy_elements(data.data(), static_cast<const T*>(source), data.size());
    local_.barrier();
  }

  template <class T>
  void all_to_all(std::size_t me, std::span<const T> in, std::span<const std::size_t> send_counts, std::span<T> out,
                  std::span<const std::size_t> recv_counts) {
    const std::size_t l = me - first();
    const std::size_t n = size();
    args_[l] = {in.data(), out.data()};
    // member k contributes: n send counts, n receive counts, and whether its own
    // arguments are consistent, so that every process fails alike on bad ones
    const bool shaped = send_counts.size() == n && recv_counts.size() == n;
    std::vector<std::size_t> mine(2 * n + 1, 0);
    if (shaped) {
      std::copy(send_counts.begin(), send_counts.end(), mine.begin());
      std::copy(recv_counts.begin(), recv_counts.end(), mine.begin() + static_cast<std::ptrdiff_t>(n));
      mine[2 * n] = std::accumulate(send_counts.begin(), send_counts.end(), std::size_t{0}) == in.size() &&
                    std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t{0}) == out.size();
    }
    const auto& m = exchange(me, mine);
    const std::size_t w = 2 * n + 1;
    auto sends = [&](std::size_t i, std::size_t j) { return m[i * w + j]; };
    auto recvs = [&](std::size_t j, std::size_t i) { return m[j * w + n + i]; };
    for (std::size_t k = 0; k < n; ++k)
      if (m[k * w + 2 * n] == 0)
        fail("all_to_all: " + names_[k] + "'s counts are not one per member or do not add up to its buffers");
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < n; ++j)
        if (sends(i, j) != recvs(j, i))
          fail("all_to_all: " + names_[i] + " sends " + std::to_string(sends(i, j)) + " elements to " + names_[j] +
               ", which expects " + std::to_string(recvs(j, i)));
    local_.barrier();
    const std::size_t ranks = per_rank_.size(), f = first(), nl = local_.size();
    auto offset_in = [&](std::size_t i, std::size_t j) {  // where piece i->j starts in member i's input
      std::size_t o = 0;
      for (std::size_t k = 0; k < j; ++k) o += sends(i, k);
      return o;
    };
    leader_step(l, [&] {
      // send block to rank q: for each member j of q, for each local member i: piece i->j
      std::vector<int> scount(ranks), sdispl(ranks), rcount(ranks), rdispl(ranks);
      std::size_t stotal = 0, rtotal = 0;
      for (std::size_t q = 0; q < ranks; ++q) {
        std::size_t s = 0, r = 0;
        for (std::size_t j = first_of(static_cast<int>(q)); j < first_of(static_cast<int>(q)) + per_rank_[q]; ++j)
          for (std::size_t i = f; i < f + nl; ++i) s += sends(i, j);
        for (std::size_t j = f; j < f + nl; ++j)
          for (std::size_t i = first_of(static_cast<int>(q)); i < first_of(static_cast<int>(q)) + per_rank_[q]; ++i) r += sends(i, j);
        scount[q] = pdo::mpi::detail::count(s, "all_to_all");
        rcount[q] = pdo::mpi::detail::count(r, "all_to_all");
        sdispl[q] = pdo::mpi::detail::count(stotal, "all_to_all");
        rdispl[q] = pdo::mpi::detail::count(rtotal, "all_to_all");
        stotal += s;
        rtotal += r;
      }
      staging_.resize(stotal * sizeof(T));
      result_.resize(rtotal * sizeof(T));
      T* pack = reinterpret_cast<T*>(staging_.data());
      for (std::size_t q = 0; q < ranks; ++q)
        for (std::size_t j = first_of(static_cast<int>(q)); j < first_of(static_cast<int>(q)) + per_rank_[q]; ++j)
          for (std::size_t i = f; i < f + nl; ++i) {
            copy_elements(pack, static_cast<const T*>(args_[i - f].in) + offset_in(i, j), sends(i, j));
            pack += sends(i, j);
          }
      pdo::mpi::detail::check(MPI_Alltoallv(staging_.data(), scount.data(), sdispl.data(), datatype<T>(), result_.data(),
                                            rcount.data(), rdispl.data(), datatype<T>(), comm_),
                              "MPI_Alltoallv");
    });
    // received from rank r: for each local member j, for each member i of r: piece i->j
    const T* src = reinterpret_cast<const T*>(result_.data());
    T* dst = out.data();
    for (std::size_t r = 0; r < ranks; ++r) {
      const std::size_t fr = first_of(static_cast<int>(r));
      for (std::size_t j = f; j < f + nl; ++j)
        for (std::size_t i = fr; i < fr + per_rank_[r]; ++i) {
          if (j == me) {
            copy_elements(dst, src, sends(i, j));
            dst += sends(i, j);
          }
          src += sends(i, j);
        }
    }
    local_.barrier();
  }

  template <class T>
  void send(std::size_t me, std::span<const T> data, std::size_t to, int tag) {
    check_peer("send", me, to, tag);
    if (rank_of(to) == my_rank()) return local_only([&] { local_.send(me - first(), data, to - first(), tag); });
    // synchronous: returns once the receiver has started to receive, as the contract says
    pdo::mpi::detail::check(MPI_Ssend(data.data(), pdo::mpi::detail::count(data.size(), "send"), datatype<T>(), rank_of(to),
                                     wire_tag(me, to, tag), comm_),
                            "MPI_Ssend");
  }

  template <class T>
  void recv(std::size_t me, std::span<T> data, std::size_t from, int tag) {
    check_peer("recv", me, from, tag);
    if (rank_of(from) == my_rank()) return local_only([&] { local_.recv(me - first(), data, from - first(), tag); });
    MPI_Status status;
    MPI_Message message;
    const int wire = wire_tag(from, me, tag);
    pdo::mpi::detail::check(MPI_Mprobe(rank_of(from), wire, comm_, &message, &status), "MPI_Mprobe");
    int got = 0;
    MPI_Get_count(&status, datatype<T>(), &got);
    if (got == MPI_UNDEFINED || static_cast<std::size_t>(got) != data.size()) {
      int bytes = 0;
      MPI_Get_count(&status, MPI_BYTE, &bytes);
      std::vector<unsigned char> drain(static_cast<std::size_t>(bytes));
      MPI_Mrecv(drain.data(), bytes, MPI_BYTE, &message, MPI_STATUS_IGNORE);
      if (got == MPI_UNDEFINED)
        throw communication_error("send/recv: " + names_[from] + " sent " + std::to_string(bytes) + " bytes with tag " +
                             std::to_string(tag) + ", not a whole number of the elements " + names_[me] + " expects");
      throw communication_error("send/recv: " + names_[from] + " sent " + std::to_string(got) + " elements with tag " +
                                std::to_string(tag) + " but " + names_[me] + " expects " + std::to_string(data.size()));
    }
    pdo::mpi::detail::check(MPI_Mrecv(data.data(), got, datatype<T>(), &message, MPI_STATUS_IGNORE), "MPI_Mrecv");
  }

 private:
  struct args {
    const void* in = nullptr;
    void* out = nullptr;
  };

  template <class T>
  static MPI_Datatype datatype() { return pdo::mpi::detail::datatype<T>(); }
  static MPI_Op op_of(reduce_op op) { return pdo::mpi::detail::op(op); }

  int my_rank() const { return rank_; }
  static int rank_in(MPI_Comm comm) {
    int r = 0;
    MPI_Comm_rank(comm, &r);
    return r;
  }
  std::size_t first_of(int rank) const {
    return std::accumulate(per_rank_.begin(), per_rank_.begin() + rank, std::size_t{0});
  }
  int rank_of(std::size_t member) const {
    std::size_t end = 0;
    for (std::size_t r = 0; r < per_rank_.size(); ++r)
      if (member < (end += per_rank_[r])) return static_cast<int>(r);
    return static_cast<int>(per_rank_.size()) - 1;
  }
  int wire_tag(std::size_t from, std::size_t to, int tag) const {
    return static_cast<int>((static_cast<std::size_t>(tag) * size() + from) * size() + to);
  }
  /// @brief The largest user tag whose wire tag fits MPI_TAG_UB.
  std::size_t max_tag() const {
    int* upper = nullptr;
    int found = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &upper, &found);
    const std::size_t bound = found ? static_cast<std::size_t>(*upper) : 32767;
    return (bound + 1) / (size() * size()) - 1;
  }
  void check_peer(const char* op, std::size_t me, std::size_t peer, int tag) const {
    if (peer >= size() || peer == me || tag < 0 || static_cast<std::size_t>(tag) > max_tag())
      throw communication_error(std::string(op) + ": " + names_[me] + " named member " + std::to_string(peer) + " with tag " +
                                std::to_string(tag) + "; the peer must be another member of the group of " +
                                std::to_string(size()) + " and the tag in [0, " + std::to_string(max_tag()) + "]");
  }
  std::vector<std::string> local_names() const {
    const std::size_t f = first_;
    return {names_.begin() + static_cast<std::ptrdiff_t>(f),
            names_.begin() + static_cast<std::ptrdiff_t>(f + per_rank_[static_cast<std::size_t>(my_rank())])};
  }

  /// @brief Every member's `values` (all of one width), in member order, on every member.
  const std::vector<std::size_t>& exchange(std::size_t me, const std::vector<std::size_t>& values) {
    const std::size_t l = me - first(), width = values.size();
    if (l == 0) {
      local_values_.assign(local_.size() * width, 0);
      width_ = width;
    }
    local_.barrier();
    std::copy(values.begin(), values.end(), local_values_.begin() + static_cast<std::ptrdiff_t>(l * width));
    local_.barrier();
    leader_step(l, [&] {
      if (width_ == 0) {  // a barrier: an all-gather of nothing need not synchronise
        pdo::mpi::detail::check(MPI_Barrier(comm_), "MPI_Barrier");
        return;
      }
      std::vector<int> counts(per_rank_.size()), displs(per_rank_.size());
      for (std::size_t r = 0; r < per_rank_.size(); ++r) {
        counts[r] = static_cast<int>(per_rank_[r] * width_);
        displs[r] = static_cast<int>(first_of(static_cast<int>(r)) * width_);
      }
      all_values_.assign(size() * width_, 0);
      pdo::mpi::detail::check(MPI_Allgatherv(local_values_.data(), static_cast<int>(local_values_.size()), MPI_UINT64_T,
                                             all_values_.data(), counts.data(), displs.data(), MPI_UINT64_T, comm_),
                              "MPI_Allgatherv");
    });
    return all_values_;
  }

  /// @brief The leader runs `work` (its MPI calls); a failure there reaches every member.
  /// Problems alternate between two slots, step after step, so the leader never
  /// overwrites one that a member is still reading.
  template <class Work>
  void leader_step(std::size_t l, Work&& work) {
    std::string& problem = problems_[steps_[l]++ & 1];
    if (l == 0) {
      problem.clear();
      try {
        work();
      } catch (const std::exception& e) {
        problem = e.what();
      }
    }
    local_.barrier();
    if (!problem.empty()) {
      const std::string what = problem;
      local_.barrier();
      throw communication_error(what);
    }
  }

  /// @brief An argument error every member of every process has found alike.
  /// Every member of the group finds it alike. When the group spans the mesh every place
  /// throws it and the program can go on (mismatch_error); in a smaller group the places
  /// outside it may already wait in their next collective for these, so it is an error
  /// that ends the job (communication_error; see run_on_places).
  [[noreturn]] void fail(const std::string& what) {
    local_.barrier();
    if (spans_mesh_) throw mismatch_error(what);
    throw communication_error(what + " (in a group that does not span the mesh)");
  }
  static std::size_t prefix(const std::vector<std::size_t>& v, std::size_t width, std::size_t field, std::size_t upto) {
    std::size_t s = 0;
    for (std::size_t k = 0; k < upto; ++k) s += v[k * width + field];
    return s;
  }
  std::pair<std::vector<int>, std::vector<int>> rank_blocks(const std::vector<std::size_t>& v, std::size_t width,
                                                            std::size_t field) const {
    std::vector<int> counts(per_rank_.size()), displs(per_rank_.size());
    for (std::size_t r = 0; r < per_rank_.size(); ++r) {
      const std::size_t f = first_of(static_cast<int>(r));
      displs[r] = pdo::mpi::detail::count(prefix(v, width, field, f), "collective");
      counts[r] = pdo::mpi::detail::count(prefix(v, width, field, f + per_rank_[r]) - prefix(v, width, field, f), "collective");
    }
    return {counts, displs};
  }
  std::string listing(const std::vector<std::size_t>& v, std::size_t width, std::size_t field) const {
    std::string text;
    for (std::size_t k = 0; k < size(); ++k) text += (k ? ", " : "") + names_[k] + ": " + std::to_string(v[k * width + field]);
    return text;
  }

  /// @brief Point to point between two places of this process: a size mismatch is known
  /// to those two only, so it is not one the other places can go on from.
  template <class F>
  static void local_only(F&& f) {
    try {
      f();
    } catch (const mismatch_error& e) {
      throw communication_error(e.what());
    }
  }

  bool spans_mesh_;
  MPI_Comm comm_;
  int rank_;                         ///< this process's rank in comm_
  std::vector<std::size_t> per_rank_;
  std::size_t first_;                ///< the member index of this process's first member
  std::vector<std::string> names_;
  local_group local_;
  std::vector<args> args_;
  std::vector<std::size_t> local_values_, all_values_;
  std::size_t width_ = 0;
  std::vector<unsigned char> staging_, result_;
  std::string problems_[2];
  std::vector<std::size_t> steps_ = std::vector<std::size_t>(local_.size(), 0);  ///< leader steps per local member
};

}  // namespace pdo::mpi::detail
#endif  // PDO_SINGLE_PDO_COMM_MPI_GROUP_HPP
#endif

#include <cstddef>
#include <memory>
#include <string>
#include <variant>
#include <vector>

namespace pdo {

namespace detail {

/// @brief A group whose backend was chosen when its mesh was built: threads when all
/// places live in this process, MPI otherwise.
struct any_group {
#if defined(PDO_WITH_MPI)
  std::variant<std::shared_ptr<local_group>, std::shared_ptr<mpi::detail::group>> impl;
#else
  std::variant<std::shared_ptr<local_group>> impl;
#endif
  void abort() {
    std::visit([](auto& g) { g->abort(); }, impl);
  }
  void reset() {
    std::visit([](auto& g) { g->reset(); }, impl);
  }
};

template <class F>
decltype(auto) visit_group(any_group& g, F&& f) {
  return std::visit([&](auto& p) -> decltype(auto) { return f(*p); }, g.impl);
}

/// @brief The groups of one mesh. `lines[a][g]` is the g-th group along axis a; place
/// p is member `coord(p, a)` of group `line_of[a][p]`.
struct mesh_comms {
  std::shared_ptr<any_group> whole;
  std::vector<std::vector<std::shared_ptr<any_group>>> lines;
  std::vector<std::vector<std::size_t>> line_of;

  /// @brief Wakes every place blocked in a collective of this mesh with an error.
  void abort() {
    for_each_group([](any_group& g) { g.abort(); });
  }
  void reset() {
    for_each_group([](any_group& g) { g.reset(); });
  }
  /// @brief Calls `f` on every group with members in this process.
  template <class F>
  void for_each_group(F&& f) {
    if (whole) f(*whole);
    for (auto& axis : lines)
      for (auto& g : axis)
        if (g) f(*g);
  }
};

inline std::shared_ptr<any_group> make_group(const mesh_state& m, const std::vector<std::size_t>& members) {
  std::vector<std::string> names;
  for (auto i : members) names.push_back(m.places[i].name());
#if defined(PDO_WITH_MPI)
  if (m.multiprocess) {
    // every process takes part in the split, in the same order; those without members get no comm
    int me = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    std::vector<std::size_t> per_rank;
    int last = -1;
    bool mine = false;
    for (auto i : members) {
      const int r = m.places[i].process();
      if (r != last) per_rank.push_back(0);
      ++per_rank.back();
      last = r;
      mine = mine || r == me;
    }
    MPI_Comm comm = MPI_COMM_NULL;
    mpi::detail::check(MPI_Comm_split(MPI_COMM_WORLD, mine ? 0 : MPI_UNDEFINED, me, &comm), "MPI_Comm_split");
    if (!mine) return nullptr;
    return std::make_shared<any_group>(
        any_group{std::make_shared<mpi::detail::group>(comm, per_rank, names, members.size() == m.places.size())});
  }
#endif
  if (m.multiprocess)
    throw communication_error("mesh: places of other processes need the MPI backend; build with PDO_WITH_MPI");
  return std::make_shared<any_group>(any_group{std::make_shared<local_group>(names)});
}

/// @brief The communicators of the mesh behind `state`, built on first use (by every
/// process of a multi-process mesh, at the same point of the program).
template <class Mesh>
mesh_comms& comms_of(const Mesh& m) {
  auto& state = *m.state();
  std::call_once(state.comms_once, [&] {
    auto comms = std::make_shared<mesh_comms>();
    std::vector<std::size_t> all(m.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    comms->whole = make_group(state, all);
    comms->lines.resize(Mesh::ndim);
    comms->line_of.assign(Mesh::ndim, std::vector<std::size_t>(m.size()));
    for (std::size_t a = 0; a < Mesh::ndim; ++a)
      for (std::size_t p = 0; p < m.size(); ++p) {
        if (m.coord(p, a) != 0) continue;
        const auto members = m.group(a, p);
        for (auto q : members) comms->line_of[a][q] = comms->lines[a].size();
        comms->lines[a].push_back(make_group(state, members));
      }
    state.comms = std::move(comms);
  });
  return *state.comms;
}

}  // namespace detail

/// @brief The communicator of a mesh's groups, whichever backend they run on.
using mesh_communicator = group_communicator<detail::any_group>;

static_assert(communicator<mesh_communicator>);

/// @brief Place `index`'s endpoint on the group of places along mesh axis `axis`.
template <class Mesh>
mesh_communicator communicator_along(const Mesh& m, std::size_t axis, std::size_t index) {
  auto& comms = detail::comms_of(m);
  return {comms.lines[axis][comms.line_of[axis][index]], m.coord(index, axis)};
}

/// @brief Place `index`'s endpoint on the group of all places of the mesh.
template <class Mesh>
mesh_communicator communicator_of(const Mesh& m, std::size_t index) {
  return {detail::comms_of(m).whole, index};
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_COMM_MESH_COMMS_HPP
// ---- pdo/comm/run_on_places.hpp
#ifndef PDO_SINGLE_PDO_COMM_RUN_ON_PLACES_HPP
#define PDO_SINGLE_PDO_COMM_RUN_ON_PLACES_HPP
// pdo/comm/run_on_places.hpp: run one task per local place of a mesh, at once, and collect failures.


#include <cstddef>
#include <cstdio>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#if defined(PDO_WITH_MPI)
#endif

namespace pdo::detail {

/// @brief Which pdo::error subclass an exception is, as a small code that can travel
/// between processes; 0 for anything that is not a pdo::error.
inline int error_kind(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const collective_aborted&) {
    return 8;
  } catch (const mismatch_error&) {
    return 7;
  } catch (const communication_error&) {
    return 6;
  } catch (const shape_error&) {
    return 2;
  } catch (const layout_error&) {
    return 3;
  } catch (const out_of_memory&) {
    return 4;
  } catch (const io_error&) {
    return 5;
  } catch (const error&) {
    return 1;
  } catch (...) {
    return 0;
  }
}

/// @brief Throws the pdo::error subclass of code `kind` (see error_kind) with `message`.
[[noreturn]] inline void throw_error_of_kind(int kind, const std::string& message) {
  switch (kind) {
    case 2: throw shape_error(message);
    case 3: throw layout_error(message);
    case 4: throw out_of_memory(message);
    case 5: throw io_error(message);
    case 6: throw communication_error(message);
    case 7: throw mismatch_error(message);
    case 8: throw collective_aborted(message);
    default: throw error(message);
  }
}

inline std::string message_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

/// @brief Throws the exception in `failure` again with `context` in front of its
/// message, keeping its pdo::error subclass.
[[noreturn]] inline void rethrow_with_context(const std::exception_ptr& failure, const std::string& context) {
  throw_error_of_kind(error_kind(failure), context + message_of(failure));
}

inline bool is_abort_echo(const std::exception_ptr& failure) { return error_kind(failure) == 8; }

/// @brief Mesh-wide operations of one process run one at a time: two host threads whose
/// operations share places would otherwise queue their tasks in different orders on
/// different places and wait for each other forever.
inline std::mutex& mesh_operations_mutex() {
  static std::mutex m;
  return m;
}

/// @brief A failure in the middle of collectives on one process of a multi-process mesh:
/// the other processes are inside MPI calls that wait for this one, and cannot be told.
/// Rather than leave them hanging, the job ends with the error.
[[noreturn]] inline void end_job(const std::string& what) {
  std::fprintf(stderr, "pdo: fatal: %s; the other processes of the mesh cannot go on without this one, ending the job\n",
               what.c_str());
  std::fflush(stderr);
#if defined(PDO_WITH_MPI)
  MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  std::terminate();
}

/// @brief The failure of one place, if any: the first place (in mesh order) whose
/// failure is a cause, not the echo of another place's abort.
struct place_failure {
  std::size_t place = 0;
  std::exception_ptr error;
};

/// @brief Runs `task(place_index, local_ordinal)` on the worker of every place of `m`
/// that lives in this process, all at once, and waits for all of them.
///
/// When a task fails in a mesh of this process only, the mesh's collectives are aborted
/// so the other places do not wait for it, and reset once every task has returned, so
/// the mesh stays usable. In a mesh over several processes, tasks that `communicate`
/// cannot be unwound that way: an argument mismatch is thrown alike by every member
/// (pdo::mismatch_error) and returned here, any other failure ends the job (end_job).
/// @return the first failure that is a cause, not an echo of another's, or nothing
template <class Mesh, class Task>
std::optional<place_failure> try_run_on_places(const Mesh& m, Task&& task, bool communicate = true) {
  const auto& local = m.local_places();
  if (current_place() != nullptr)
    throw layout_error("pdo: a mesh-wide operation was started from inside a task of place " + current_place()->name +
                       "; call it from the host thread, not from a parallel_do block or an spmd task");
  std::lock_guard serial(mesh_operations_mutex());
  auto& comms = comms_of(m);
  const bool local_only = !m.is_multiprocess();
  std::vector<std::exception_ptr> failures(local.size());
  completion done(local.size());
  for (std::size_t k = 0; k < local.size(); ++k)
    m.place(local[k]).submit([&, k] {
      try {
        task(local[k], k);
      } catch (...) {
        failures[k] = std::current_exception();
        if (local_only) comms.abort();
        else if (communicate && error_kind(failures[k]) != 7)
          end_job(m.place(local[k]).name() + ": " + message_of(failures[k]));
      }
      done.count_down();
    });
  done.wait();
  std::optional<place_failure> first;
  for (std::size_t k = 0; k < local.size(); ++k) {
    if (!failures[k]) continue;
    if (!first || (is_abort_echo(first->error) && !is_abort_echo(failures[k]))) first = place_failure{local[k], failures[k]};
  }
  if (first && local_only) comms.reset();
  return first;
}

/// @brief try_run_on_places, throwing the failure as a pdo::error naming `op` and the place.
template <class Mesh, class Task>
void run_on_places(const char* op, const Mesh& m, Task&& task) {
  if (auto failure = try_run_on_places(m, std::forward<Task>(task)))
    rethrow_with_context(failure->error, std::string(op) + ": on place " + m.place(failure->place).name() + ": ");
}

}  // namespace pdo::detail

namespace pdo {

/// @brief Runs `task(place_index)` on every place of `m` in this process, all at once
/// (single program, multiple data), and returns when all are done. Inside, a task
/// reaches the other places through `communicator_of(m, place_index)` or
/// `communicator_along(m, axis, place_index)`. A task's exception reaches the caller as
/// a pdo::error naming the place; in a mesh of one process the other places are
/// released from their collectives and the mesh stays usable (see try_run_on_places
/// for meshes over several processes).
template <class Mesh, class Task>
void spmd(const Mesh& m, Task&& task) {
  detail::run_on_places("spmd", m, [&](std::size_t p, std::size_t) { task(p); });
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_COMM_RUN_ON_PLACES_HPP
// ---- pdo/comm/threads/communicator.hpp
#ifndef PDO_SINGLE_PDO_COMM_THREADS_COMMUNICATOR_HPP
#define PDO_SINGLE_PDO_COMM_THREADS_COMMUNICATOR_HPP
// pdo/comm/threads/communicator.hpp: the threads backend: places of one process, shared memory.


namespace pdo::threads {

/// @brief A member of a group whose places all live in this process. Collectives read
/// the other members' buffers directly: all_reduce moves each byte once per member
/// (the memory-traffic limit), with no staging copies and no locks on the data path.
using communicator = group_communicator<detail::local_group>;

static_assert(pdo::communicator<communicator>);

}  // namespace pdo::threads
#endif  // PDO_SINGLE_PDO_COMM_THREADS_COMMUNICATOR_HPP

#if defined(PDO_WITH_MPI)
// ---- pdo/comm/mpi/communicator.hpp
#ifndef PDO_SINGLE_PDO_COMM_MPI_COMMUNICATOR_HPP
#define PDO_SINGLE_PDO_COMM_MPI_COMMUNICATOR_HPP
// pdo/comm/mpi/communicator.hpp: the MPI backend: places in several processes, one or more each.

// ---- pdo/place/cpu_place.hpp
#ifndef PDO_SINGLE_PDO_PLACE_CPU_PLACE_HPP
#define PDO_SINGLE_PDO_PLACE_CPU_PLACE_HPP
// pdo/place/cpu_place.hpp: CPU places, each a worker thread on its own cores.


#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace pdo {

/// @brief How a CPU place is made.
struct cpu_place_options {
  bool pin = true;             ///< pin the worker to the place's cores (off when other places share them)
  std::size_t memory_cap = 0;  ///< bytes the place may hold (0: no cap)
  std::string name;            ///< empty: "cpu:<ordinal>"
  int process = 0;             ///< the MPI rank that owns it
};

/// @brief A CPU place: a worker thread that runs the place's work on the cores it was
/// given (pinned there when no other place shares them), and a caching allocator.
class cpu_place : public detail::place_handle<cpu_place> {
 public:
  /// @brief A new place on `cores`.
  cpu_place(int ordinal, std::vector<int> cores, const cpu_place_options& options = {})
      : place_handle(std::make_shared<detail::place_state>(
            place_kind::cpu, ordinal, options.process, true, std::move(cores),
            options.name.empty() ? "cpu:" + std::to_string(ordinal) : options.name)) {
    state_->memory = std::make_unique<caching_allocator>(state_->name, options.memory_cap);
    detail::start_worker(*state_, options.pin ? state_->cores : std::vector<int>{});
  }

  /// @brief A handle to the CPU place behind `state` (which must be a CPU place).
  explicit cpu_place(std::shared_ptr<detail::place_state> state) : place_handle(std::move(state)) {}
};

namespace detail {
/// @brief `n` places over `cores`: with n <= cores each gets its own share (the first
/// ones one more when uneven), pinned when `pin`; with more places than cores, places
/// share cores round-robin and are not pinned. `name(i)` names place i.
template <class Name>
std::vector<cpu_place> share_cores(std::size_t n, const std::vector<int>& cores, bool pin, std::size_t memory_cap,
                                   int process, Name&& name) {
  if (n == 0) throw layout_error("cpu_places: asked for 0 places; ask for at least one");
  const std::size_t c = cores.size();
  std::vector<cpu_place> places;
  places.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<int> mine;
    if (n <= c) {
      const std::size_t first = chunk_offset(c, n, i), count = chunk_size(c, n, i);
      mine.assign(cores.begin() + static_cast<std::ptrdiff_t>(first), cores.begin() + static_cast<std::ptrdiff_t>(first + count));
    } else {
      mine.push_back(cores[i % c]);
    }
    places.emplace_back(static_cast<int>(i), std::move(mine), cpu_place_options{pin && n <= c, memory_cap, name(i), process});
  }
  return places;
}
}  // namespace detail

/// @brief `n` CPU places over the cores of this process. With n <= cores each place
/// gets its own cores (cores / n, the first ones one more when uneven) and is pinned to
/// them; with more places than cores, places share cores round-robin and are not pinned.
/// @param memory_cap per-place cap in bytes (0: none)
inline std::vector<cpu_place> cpu_places(std::size_t n, std::size_t memory_cap = 0) {
  return detail::share_cores(n, detail::process_cores(), true, memory_cap, 0,
                             [](std::size_t i) { return "cpu:" + std::to_string(i); });
}

/// @brief One CPU place per core of this process.
inline std::vector<cpu_place> cpu_places() { return cpu_places(detail::process_cores().size()); }

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_PLACE_CPU_PLACE_HPP

#include <algorithm>
#include <memory>
#include <thread>
#include <string>
#include <vector>

namespace pdo::mpi {

/// @brief A member of a group whose places live in several MPI processes. Members of
/// one process meet through shared memory; one of them carries the combined data over
/// MPI, so each collective costs one MPI collective per process, whatever the number
/// of places there.
using communicator = group_communicator<detail::group>;

static_assert(pdo::communicator<communicator>);

/// @brief The places of every process of MPI_COMM_WORLD, `per_process` each, in rank
/// order: place `r * per_process + i` is place i of rank r, named "rank<r>/cpu:<i>".
/// This process's places are CPU places over its cores, pinned only when the launcher
/// bound the process to some of the machine's cores (else processes would pin their
/// places onto the same ones); the others stand for places of other processes. Every
/// process must call it with the same `per_process` (it starts MPI if needed).
inline std::vector<any_place> world_places(std::size_t per_process = 1, std::size_t memory_cap = 0) {
  const int me = mpi::rank(), n = mpi::size();
  unsigned long long mine_count = per_process, low = 0, high = 0;
  MPI_Allreduce(&mine_count, &low, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&mine_count, &high, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  if (low != high)
    throw layout_error("world_places: processes asked for different numbers of places (" + std::to_string(low) + " to " +
                       std::to_string(high) + "); every process must pass the same per_process");
  auto label = [](int rank, std::size_t i) { return "rank" + std::to_string(rank) + "/cpu:" + std::to_string(i); };
  const std::vector<int> cores = pdo::detail::process_cores();
  const bool bound = cores.size() < std::max(1u, std::thread::hardware_concurrency());
  const std::vector<cpu_place> mine =
      pdo::detail::share_cores(per_process, cores, bound, memory_cap, me, [&](std::size_t i) { return label(me, i); });
  std::vector<any_place> places;
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < per_process; ++i) {
      if (r == me) places.emplace_back(mine[i]);
      else
        places.emplace_back(std::make_shared<pdo::detail::place_state>(place_kind::cpu, static_cast<int>(i), r, false,
                                                                       std::vector<int>{}, label(r, i)));
    }
  return places;
}

}  // namespace pdo::mpi
#endif  // PDO_SINGLE_PDO_COMM_MPI_COMMUNICATOR_HPP
#endif
#endif  // PDO_SINGLE_PDO_COMM_HPP
// ---- pdo/core.hpp
#ifndef PDO_SINGLE_PDO_CORE_HPP
#define PDO_SINGLE_PDO_CORE_HPP
// pdo/core.hpp: the core layer (strings, errors, shapes, element types).

// ---- pdo/core/type_list.hpp
#ifndef PDO_SINGLE_PDO_CORE_TYPE_LIST_HPP
#define PDO_SINGLE_PDO_CORE_TYPE_LIST_HPP
// pdo/core/type_list.hpp: minimal type-level lists used by the layout algebra.

#include <cstddef>
#include <type_traits>

namespace pdo::detail {

template <class... Ts>
struct type_list {
  static constexpr std::size_t size = sizeof...(Ts);
};

/// @brief A `false` that depends on a type, for static_asserts in templates that must
/// only fire when instantiated.
template <class...>
inline constexpr bool always_false = false;

template <class T, template <class...> class Template>
inline constexpr bool is_specialization_of = false;
template <template <class...> class Template, class... Args>
inline constexpr bool is_specialization_of<Template<Args...>, Template> = true;

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_CORE_TYPE_LIST_HPP
#endif  // PDO_SINGLE_PDO_CORE_HPP
// ---- pdo/exec.hpp
#ifndef PDO_SINGLE_PDO_EXEC_HPP
#define PDO_SINGLE_PDO_EXEC_HPP
// pdo/exec.hpp: the execution layer (parallel_do).

// ---- pdo/exec/parallel_do.hpp
#ifndef PDO_SINGLE_PDO_EXEC_PARALLEL_DO_HPP
#define PDO_SINGLE_PDO_EXEC_PARALLEL_DO_HPP
// pdo/exec/parallel_do.hpp: run a block on every place over its local shards, and merge the results.

// ---- pdo/layout/layout_check.hpp
#ifndef PDO_SINGLE_PDO_LAYOUT_LAYOUT_CHECK_HPP
#define PDO_SINGLE_PDO_LAYOUT_LAYOUT_CHECK_HPP
// pdo/layout/layout_check.hpp: compile-time checks of a layout against a tensor rank and a mesh.

// ---- pdo/layout/layout_value.hpp
#ifndef PDO_SINGLE_PDO_LAYOUT_LAYOUT_VALUE_HPP
#define PDO_SINGLE_PDO_LAYOUT_LAYOUT_VALUE_HPP
// pdo/layout/layout_value.hpp: a layout as a constexpr value, for planning and messages.

// ---- pdo/layout/layout.hpp
#ifndef PDO_SINGLE_PDO_LAYOUT_LAYOUT_HPP
#define PDO_SINGLE_PDO_LAYOUT_LAYOUT_HPP
// pdo/layout/layout.hpp: layouts as types: split<"axis">, replicate, partial axes.


#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace pdo {

/// @brief Layout entry of one tensor dim: cut into contiguous chunks along mesh axis `Axis`
/// (sizes differ by at most one, larger chunks first: 10 rows over 4 places are 3,3,2,2).
template <fixed_string Axis>
struct split {
  using split_tag = void;
  static constexpr std::string_view axis = Axis.view();
};

/// @brief Layout entry of one tensor dim: every place holds all of it.
struct replicate {};

// Found by split's member, not by a partial specialization on split<Axis>: nvcc's
// front end does not match partial specializations on string template arguments.
template <class T>
inline constexpr bool is_dim_spec_v = std::is_same_v<T, replicate> || requires { typename T::split_tag; };

/// @brief A layout entry: pdo::split<"axis"> or pdo::replicate.
template <class T>
concept dim_spec = is_dim_spec_v<T>;

template <class Base, fixed_string... Axes>
struct partial_layout;

/// @brief How a tensor is laid out on a mesh: one entry per tensor dim.
/// `layout<...>::partial<"tp">` marks a pending sum over mesh axis "tp": each place
/// holds an addend, and the value is the sum over the places along that axis.
template <class... Dims>
struct layout {
  static_assert((dim_spec<Dims> && ...),
                "pdo: layout: each entry must be pdo::split<\"axis\"> or pdo::replicate (one per tensor dim)");
  using layout_tag = void;
  using base = layout;
  using dims = detail::type_list<Dims...>;
  static constexpr std::size_t rank = sizeof...(Dims);
  static constexpr std::array<std::string_view, rank> dim_axes{[] {
    if constexpr (std::is_same_v<Dims, replicate>) return std::string_view{};
    else return Dims::axis;
  }()...};
  static constexpr std::array<std::string_view, 0> partial_axes{};

  template <fixed_string... Axes>
  using partial = partial_layout<layout, Axes...>;
};

/// @brief `Base` (a pdo::layout) with pending sums over mesh axes `Axes`.
template <class Base, fixed_string... Axes>
struct partial_layout {
  static_assert(sizeof...(Axes) >= 1, "pdo: layout::partial: name at least one mesh axis");
  using layout_tag = void;
  using base = Base;
  using dims = typename Base::dims;
  static constexpr std::size_t rank = Base::rank;
  static constexpr auto dim_axes = Base::dim_axes;
  static constexpr std::array<std::string_view, sizeof...(Axes)> partial_axes{Axes.view()...};

  template <fixed_string... More>
  using partial = partial_layout<Base, Axes..., More...>;
};

namespace detail {
template <class Seq>
struct replicated_layout;
template <std::size_t... I>
struct replicated_layout<std::index_sequence<I...>> {
  using type = layout<std::conditional_t<I == I, replicate, void>...>;
};
/// @brief layout<replicate, ..., replicate> of rank `Rank`.
template <std::size_t Rank>
using replicated_layout_t = typename replicated_layout<std::make_index_sequence<Rank>>::type;
}  // namespace detail

/// @brief A layout type: pdo::layout<...> or pdo::layout<...>::partial<...>.
template <class L>
concept layout_spec = requires {
  typename L::layout_tag;
  L::rank;
  L::dim_axes;
  L::partial_axes;
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_LAYOUT_LAYOUT_HPP

#include <array>
#include <cstddef>
#include <string>
#include <string_view>

namespace pdo::detail {

inline constexpr std::size_t max_rank = 8;  ///< the highest tensor rank a layout may have
inline constexpr std::size_t max_axes = 8;  ///< the most partial axes a layout may have

/// @brief A layout as data: for each dim the axis it is split on ("" when replicated),
/// and the partial axes. Equality treats the partial axes as a set.
struct layout_value {
  std::size_t rank = 0;
  std::array<std::string_view, max_rank> dim_axis{};
  std::size_t npartial = 0;
  std::array<std::string_view, max_axes> partial{};

  /// @brief The dim split on `axis`, or rank when none is.
  [[nodiscard]] constexpr std::size_t split_dim(std::string_view axis) const {
    for (std::size_t d = 0; d < rank; ++d)
      if (dim_axis[d] == axis) return d;
    return rank;
  }
  [[nodiscard]] constexpr bool is_partial(std::string_view axis) const {
    for (std::size_t i = 0; i < npartial; ++i)
      if (partial[i] == axis) return true;
    return false;
  }
  constexpr void add_partial(std::string_view axis) {
    if (!is_partial(axis)) partial[npartial++] = axis;
  }
  constexpr void remove_partial(std::string_view axis) {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < npartial; ++i)
      if (partial[i] != axis) partial[kept++] = partial[i];
    for (std::size_t i = kept; i < npartial; ++i) partial[i] = {};
    npartial = kept;
  }
  friend constexpr bool operator==(const layout_value& a, const layout_value& b) {
    if (a.rank != b.rank || a.npartial != b.npartial) return false;
    for (std::size_t d = 0; d < a.rank; ++d)
      if (a.dim_axis[d] != b.dim_axis[d]) return false;
    for (std::size_t i = 0; i < a.npartial; ++i)
      if (!b.is_partial(a.partial[i])) return false;
    return true;
  }
};

template <layout_spec L>
constexpr layout_value value_of() {
  static_assert(L::rank <= max_rank, "pdo: layout: at most 8 tensor dims are supported");
  static_assert(L::partial_axes.size() <= max_axes, "pdo: layout: at most 8 partial axes are supported");
  layout_value v;
  v.rank = L::rank;
  for (std::size_t d = 0; d < L::rank; ++d) v.dim_axis[d] = L::dim_axes[d];
  for (auto a : L::partial_axes) v.add_partial(a);
  return v;
}

/// @brief "{split<dp>, replicate}" or "{replicate, replicate} partial<tp>".
inline std::string to_string(const layout_value& v) {
  std::string text = "{";
  for (std::size_t d = 0; d < v.rank; ++d) {
    if (d) text += ", ";
    text += v.dim_axis[d].empty() ? std::string("replicate") : "split<" + std::string(v.dim_axis[d]) + ">";
  }
  text += "}";
  for (std::size_t i = 0; i < v.npartial; ++i) text += (i ? ", " : " ") + ("partial<" + std::string(v.partial[i]) + ">");
  return text;
}

}  // namespace pdo::detail

namespace pdo {
/// @brief A layout type spelled out: "{split<dp>, replicate} partial<tp>".
template <layout_spec L>
std::string layout_name() {
  return detail::to_string(detail::value_of<L>());
}
}  // namespace pdo
#endif  // PDO_SINGLE_PDO_LAYOUT_LAYOUT_VALUE_HPP

#include <cstddef>

namespace pdo {

/// @brief What is wrong with a layout on a mesh, if anything.
enum class layout_problem { none, rank_mismatch, axis_not_in_mesh, axis_used_twice };

namespace detail {

template <layout_spec L, class Mesh>
constexpr layout_problem find_layout_problem(std::size_t tensor_rank) {
  constexpr layout_value v = value_of<L>();
  if (v.rank != tensor_rank) return layout_problem::rank_mismatch;
  std::array<std::string_view, max_rank + max_axes> used{};
  std::size_t n = 0;
  for (std::size_t d = 0; d < v.rank; ++d)
    if (!v.dim_axis[d].empty()) used[n++] = v.dim_axis[d];
  for (std::string_view axis : L::partial_axes) used[n++] = axis;
  for (std::size_t i = 0; i < n; ++i) {
    if (!Mesh::has_axis(used[i])) return layout_problem::axis_not_in_mesh;
    for (std::size_t j = i + 1; j < n; ++j)
      if (used[i] == used[j]) return layout_problem::axis_used_twice;
  }
  return layout_problem::none;
}

/// @brief Instantiated where a layout is used; its static_asserts fail with a message
/// that says what is wrong, and the compiler's note names the op, the layout and the
/// mesh (the template arguments of this type).
template <fixed_string Op, layout_spec L, class Mesh, std::size_t Rank>
struct check_layout {
  static constexpr layout_problem problem = find_layout_problem<L, Mesh>(Rank);
  static_assert(problem != layout_problem::rank_mismatch,
                "pdo: layout has a different number of entries than the tensor has dims; give one entry "
                "(pdo::split<\"axis\"> or pdo::replicate) per tensor dim");
  static_assert(problem != layout_problem::axis_not_in_mesh,
                "pdo: layout splits or sums over a mesh axis that the mesh does not have; use one of the "
                "mesh's axis names");
  static_assert(problem != layout_problem::axis_used_twice,
                "pdo: layout uses one mesh axis twice; a mesh axis may split one tensor dim or mark one "
                "partial sum, not both and not two dims");
  static constexpr bool ok = problem == layout_problem::none;
};

}  // namespace detail

/// @brief True when layout `L` fits a tensor of rank `Rank` on mesh type `Mesh`.
template <layout_spec L, class Mesh, std::size_t Rank>
inline constexpr bool valid_layout_v = detail::find_layout_problem<L, Mesh>(Rank) == layout_problem::none;

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_LAYOUT_LAYOUT_CHECK_HPP
// ---- pdo/tensor/dtensor.hpp
#ifndef PDO_SINGLE_PDO_TENSOR_DTENSOR_HPP
#define PDO_SINGLE_PDO_TENSOR_DTENSOR_HPP
// pdo/tensor/dtensor.hpp: pdo::dtensor, a tensor laid out over a mesh: global shape + local shards.

// ---- pdo/tensor/tensor.hpp
#ifndef PDO_SINGLE_PDO_TENSOR_TENSOR_HPP
#define PDO_SINGLE_PDO_TENSOR_TENSOR_HPP
// pdo/tensor/tensor.hpp: pdo::tensor, an owning dense row-major tensor on one place.


#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <utility>

namespace pdo {

namespace detail {
/// @brief Tag: allocate without initialising the elements.
struct uninitialized_t {};
inline constexpr uninitialized_t uninitialized{};

/// @brief The CPU place whose worker runs the calling thread, if any: where tensors
/// made without a place go.
inline place_state* current_cpu_place() {
  place_state* p = current_place();
  return p != nullptr && p->kind == place_kind::cpu ? p : nullptr;
}
}  // namespace detail

/// @brief An owning, dense, row-major tensor on one place (the host when none is given).
/// Copies are deep copies on the same place; moves are cheap.
/// @tparam T an element type (pdo::element)
template <element T, std::size_t Rank>
class tensor {
 public:
  using value_type = T;
  static constexpr std::size_t rank = Rank;

  tensor() = default;
  /// @brief A zero-filled tensor in the memory of the place running the calling thread
  /// (inside a parallel_do block: that place), else on the host.
  explicit tensor(const shape_t<Rank>& shape) : tensor(shape, detail::uninitialized) { fill(T{}); }
  /// @brief A zero-filled tensor in `place`'s memory.
  tensor(const shape_t<Rank>& shape, const any_place& place) : tensor(shape, place, detail::uninitialized) { fill(T{}); }
  /// @brief A tensor holding `values` in row-major order (placed as the one above).
  tensor(const shape_t<Rank>& shape, std::initializer_list<T> values) : tensor(shape, detail::uninitialized) {
    if (values.size() != size())
      throw shape_error("tensor: " + std::to_string(values.size()) + " values given for shape " +
                        detail::format_extents(shape) + " of " + std::to_string(size()) + " elements");
    std::copy(values.begin(), values.end(), data_);
  }
  tensor(const shape_t<Rank>& shape, detail::uninitialized_t)
      : tensor(shape, detail::current_cpu_place() ? detail::current_cpu_place()->memory.get() : &host_allocator(),
               detail::current_cpu_place() ? detail::current_cpu_place()->shared_from_this() : nullptr) {}
  tensor(const shape_t<Rank>& shape, const any_place& place, detail::uninitialized_t)
      : tensor(shape, &place.memory(), place.state()) {}

  tensor(const tensor& other) {
    if (other.allocator_ == nullptr) return;  // a default-constructed tensor copies as one
    tensor copy(other.shape_, other.allocator_, other.place_);
    detail::copy_elements(copy.data_, other.data_, size_of(other.shape_));
    swap(copy);
  }
  tensor(tensor&& other) noexcept { swap(other); }
  tensor& operator=(tensor other) noexcept {
    swap(other);
    return *this;
  }
  ~tensor() {
    if (allocator_ != nullptr) allocator_->deallocate(data_, bytes());
  }
  void swap(tensor& other) noexcept {
    std::swap(shape_, other.shape_);
    std::swap(strides_, other.strides_);
    std::swap(data_, other.data_);
    std::swap(allocator_, other.allocator_);
    std::swap(place_, other.place_);
  }

  [[nodiscard]] const shape_t<Rank>& shape() const { return shape_; }
  [[nodiscard]] std::size_t extent(std::size_t dim) const { return shape_[dim]; }
  [[nodiscard]] const std::array<std::ptrdiff_t, Rank>& strides() const { return strides_; }
  [[nodiscard]] std::size_t size() const { return detail::volume(shape_); }
  [[nodiscard]] std::size_t bytes() const { return size() * sizeof(T); }
  [[nodiscard]] T* data() { return data_; }
  [[nodiscard]] const T* data() const { return data_; }
  [[nodiscard]] std::span<T> span() { return {data_, size()}; }
  [[nodiscard]] std::span<const T> span() const { return {data_, size()}; }
  [[nodiscard]] T* begin() { return data_; }
  [[nodiscard]] T* end() { return data_ + size(); }
  [[nodiscard]] const T* begin() const { return data_; }
  [[nodiscard]] const T* end() const { return data_ + size(); }
  /// @brief The name of the place holding the data ("host" for host tensors).
  [[nodiscard]] std::string place_name() const { return place_ ? place_->name : std::string("host"); }

  template <class... Index>
    requires(sizeof...(Index) == Rank && (std::integral<Index> && ...))
  [[nodiscard]] T& operator()(Index... index) {
    return data_[offset_of(index...)];
  }
  template <class... Index>
    requires(sizeof...(Index) == Rank && (std::integral<Index> && ...))
  [[nodiscard]] const T& operator()(Index... index) const {
    return data_[offset_of(index...)];
  }

  void fill(T value) { std::fill_n(data_, size(), value); }

 private:
  tensor(const shape_t<Rank>& shape, caching_allocator* allocator, std::shared_ptr<detail::place_state> place)
      : shape_(shape),
        strides_(detail::row_major_strides(shape)),
        allocator_(allocator),
        place_(std::move(place)) {
    data_ = static_cast<T*>(allocator_->allocate(bytes()));
  }

  static std::size_t size_of(const shape_t<Rank>& shape) { return detail::volume(shape); }

  template <class... Index>
  std::size_t offset_of(Index... index) const {
    std::size_t offset = 0, d = 0;
    ((offset += static_cast<std::size_t>(index) * static_cast<std::size_t>(strides_[d++])), ...);
    return offset;
  }

  shape_t<Rank> shape_{};
  std::array<std::ptrdiff_t, Rank> strides_{};
  T* data_ = nullptr;
  caching_allocator* allocator_ = nullptr;
  std::shared_ptr<detail::place_state> place_;  ///< keeps the place's allocator alive
};

template <class T>
inline constexpr bool is_tensor_v = false;
template <class T, std::size_t Rank>
inline constexpr bool is_tensor_v<tensor<T, Rank>> = true;

/// @brief "f32[10, 6]".
template <class T, std::size_t Rank>
std::string describe(const tensor<T, Rank>& t) {
  return std::string(detail::dtype_name<T>()) + detail::format_extents(t.shape());
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_TENSOR_TENSOR_HPP

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief The extents of place `p`'s shard of a tensor of `global` shape laid out as `v`.
template <class Mesh, std::size_t Rank>
shape_t<Rank> shard_shape(const Mesh& m, const layout_value& v, const shape_t<Rank>& global, std::size_t p) {
  shape_t<Rank> s = global;
  for (std::size_t d = 0; d < Rank; ++d)
    if (!v.dim_axis[d].empty()) {
      const std::size_t a = Mesh::axis_index(v.dim_axis[d]);
      s[d] = chunk_size(global[d], m.extent(a), m.coord(p, a));
    }
  return s;
}

/// @brief Where place `p`'s shard starts in the global tensor.
template <class Mesh, std::size_t Rank>
shape_t<Rank> shard_offset(const Mesh& m, const layout_value& v, const shape_t<Rank>& global, std::size_t p) {
  shape_t<Rank> o{};
  for (std::size_t d = 0; d < Rank; ++d)
    if (!v.dim_axis[d].empty()) {
      const std::size_t a = Mesh::axis_index(v.dim_axis[d]);
      o[d] = chunk_offset(global[d], m.extent(a), m.coord(p, a));
    }
  return o;
}

/// @brief True when place `p` holds the value of every partial axis of `v` (coordinate 0);
/// the other places hold zeros after a distribute.
template <class Mesh>
bool holds_partial_value(const Mesh& m, const layout_value& v, std::size_t p) {
  for (std::size_t i = 0; i < v.npartial; ++i)
    if (m.coord(p, Mesh::axis_index(v.partial[i])) != 0) return false;
  return true;
}

}  // namespace detail

/// @brief A tensor of global shape `shape()` laid out over `Mesh` as `Layout`; this
/// process holds the shards of its own places (`local_shards()`, in the order of
/// `mesh().local_places()`), each in its place's memory.
/// @tparam Mesh a pdo::mesh type; @tparam Layout a layout_spec valid on it for rank `Rank`
template <element T, std::size_t Rank, mesh_type Mesh, layout_spec Layout>
class dtensor {
  static_assert(detail::check_layout<"dtensor", Layout, Mesh, Rank>::ok);

 public:
  using value_type = T;
  using mesh_type = Mesh;
  using layout_type = Layout;
  static constexpr std::size_t rank = Rank;
  static constexpr detail::layout_value layout_value = detail::value_of<Layout>();

  /// @brief Takes the local shards as they are; each must have the shape the layout gives
  /// its place (else pdo::shape_error naming the place and both shapes).
  dtensor(Mesh m, const shape_t<Rank>& global, std::vector<tensor<T, Rank>> shards)
      : mesh_(std::move(m)), shape_(global), shards_(std::move(shards)) {
    const auto& local = mesh_.local_places();
    if (shards_.size() != local.size())
      throw shape_error("dtensor: " + std::to_string(shards_.size()) + " shards given for " + std::to_string(local.size()) +
                        " local places of " + mesh_.describe());
    for (std::size_t k = 0; k < local.size(); ++k)
      if (shards_[k].shape() != local_shape(local[k]))
        throw shape_error("dtensor: " + describe() + ": the shard of place " + mesh_.place(local[k]).name() + " is " +
                          pdo::describe(shards_[k]) + " but the layout gives it " +
                          detail::format_extents(local_shape(local[k])));
  }

  [[nodiscard]] const Mesh& mesh() const { return mesh_; }
  [[nodiscard]] const shape_t<Rank>& shape() const { return shape_; }
  [[nodiscard]] std::size_t size() const { return detail::volume(shape_); }
  [[nodiscard]] const std::vector<tensor<T, Rank>>& local_shards() const { return shards_; }
  [[nodiscard]] std::vector<tensor<T, Rank>>& local_shards() { return shards_; }

  /// @brief The shard of place `p` (a place of this process).
  [[nodiscard]] const tensor<T, Rank>& shard(std::size_t p) const { return shards_[local_ordinal(p)]; }
  [[nodiscard]] tensor<T, Rank>& shard(std::size_t p) { return shards_[local_ordinal(p)]; }

  /// @brief The shape of place `p`'s shard (any place of the mesh).
  [[nodiscard]] shape_t<Rank> local_shape(std::size_t p) const { return detail::shard_shape(mesh_, layout_value, shape_, p); }
  /// @brief Where place `p`'s shard starts in the global tensor.
  [[nodiscard]] shape_t<Rank> local_offset(std::size_t p) const { return detail::shard_offset(mesh_, layout_value, shape_, p); }

  /// @brief "f32[10, 6]{split<dp>, replicate} on mesh(dp=2, tp=2)".
  [[nodiscard]] std::string describe() const {
    return std::string(detail::dtype_name<T>()) + detail::format_extents(shape_) + detail::to_string(layout_value) + " on " +
           mesh_.describe();
  }

 private:
  std::size_t local_ordinal(std::size_t p) const {
    const auto& local = mesh_.local_places();
    for (std::size_t k = 0; k < local.size(); ++k)
      if (local[k] == p) return k;
    throw layout_error("dtensor: place " + std::to_string(p) + " of " + mesh_.describe() + " does not belong to this process");
  }

  Mesh mesh_;
  shape_t<Rank> shape_;
  std::vector<tensor<T, Rank>> shards_;
};

template <class T>
inline constexpr bool is_dtensor_v = false;
template <class T, std::size_t Rank, class Mesh, class Layout>
inline constexpr bool is_dtensor_v<dtensor<T, Rank, Mesh, Layout>> = true;

/// @brief A pdo::dtensor type.
template <class T>
concept distributed_tensor = is_dtensor_v<std::remove_cvref_t<T>>;

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_TENSOR_DTENSOR_HPP

#include <cstddef>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief What a parallel_do block receives for one argument on place `p`: a dtensor's
/// local shard; anything else as it is.
template <class Arg>
decltype(auto) local_view(const Arg& arg, std::size_t p) {
  if constexpr (distributed_tensor<Arg>) return arg.shard(p);
  else return (arg);
}

template <class Arg>
using local_view_t = decltype(local_view(std::declval<const Arg&>(), std::size_t{}));

template <class Arg, class Mesh>
void check_same_mesh(const Arg& arg, const Mesh& m) {
  if constexpr (distributed_tensor<Arg>) {
    static_assert(std::is_same_v<typename Arg::mesh_type, Mesh>,
                  "pdo: parallel_do: all dtensor arguments must live on the same mesh type");
    if (!(arg.mesh() == m))
      throw layout_error("parallel_do: " + arg.describe() + " lives on another mesh than the first dtensor argument");
  }
}

template <class First, class... Rest>
const auto& first_dtensor(const First& first, const Rest&... rest) {
  if constexpr (distributed_tensor<First>) return first;
  else {
    static_assert(sizeof...(Rest) > 0, "pdo: parallel_do: pass at least one dtensor, so the mesh is known");
    return first_dtensor(rest...);
  }
}

/// @brief What every process learns about every place after the block ran: whether it
/// failed, and the shape of its result. Gathered over the whole mesh when the mesh
/// spans processes (so all of them throw alike, or none), read in place otherwise.
struct block_outcomes {
  std::vector<std::size_t> values;  ///< per place: 0, or 1 + the error_kind of its failure; then Rank extents
  std::size_t width = 0;
  [[nodiscard]] bool failed(std::size_t p) const { return values[p * width] != 0; }
  [[nodiscard]] int kind(std::size_t p) const { return static_cast<int>(values[p * width]) - 1; }
  [[nodiscard]] std::size_t extent(std::size_t p, std::size_t d) const { return values[p * width + 1 + d]; }
};

template <class Mesh, class Result>
block_outcomes share_outcomes(const Mesh& m, const std::vector<std::optional<Result>>& results,
                              const std::optional<place_failure>& failure) {
  constexpr std::size_t rank = Result::rank;
  block_outcomes o{std::vector<std::size_t>(m.size() * (rank + 1), 0), rank + 1};
  auto mine = [&](std::size_t k) {
    std::vector<std::size_t> v(rank + 1, 1);
    if (failure && failure->place == m.local_places()[k]) v[0] = 1 + static_cast<std::size_t>(error_kind(failure->error));
    if (results[k]) {
      v[0] = 0;
      for (std::size_t d = 0; d < rank; ++d) v[1 + d] = results[k]->extent(d);
    }
    return v;
  };
  const auto& local = m.local_places();
  if (!m.is_multiprocess()) {
    for (std::size_t k = 0; k < local.size(); ++k) {
      const auto v = mine(k);
      std::copy(v.begin(), v.end(), o.values.begin() + static_cast<std::ptrdiff_t>(local[k] * o.width));
    }
    return o;
  }
  std::vector<std::vector<std::size_t>> gathered(local.size(), std::vector<std::size_t>(o.values.size()));
  run_on_places("parallel_do", m, [&](std::size_t p, std::size_t k) {
    const auto v = mine(k);
    communicator_of(m, p).all_gather(std::span<const std::size_t>(v), std::span<std::size_t>(gathered[k]));
  });
  o.values = gathered.front();
  return o;
}

/// @brief The message of place `failed`'s error, on every process.
template <class Mesh>
std::string share_message(const Mesh& m, std::size_t failed, const std::string& local_message) {
  if (!m.is_multiprocess()) return local_message;
  std::vector<std::string> texts(m.local_places().size());
  run_on_places("parallel_do", m, [&](std::size_t p, std::size_t k) {
    const auto comm = communicator_of(m, p);
    std::size_t length = p == failed ? local_message.size() : 0;
    comm.broadcast(std::span<std::size_t>(&length, 1), failed);
    std::vector<char> text(length);
    if (p == failed) text.assign(local_message.begin(), local_message.end());
    comm.broadcast(std::span<char>(text), failed);
    texts[k].assign(text.begin(), text.end());
  });
  return texts.front();
}

template <layout_spec Out, class Mesh, std::size_t Rank>
void check_merge(const Mesh& m, const block_outcomes& o, shape_t<Rank>& global) {
  constexpr layout_value v = value_of<Out>();
  auto shape_of = [&](std::size_t p) {
    shape_t<Rank> s;
    for (std::size_t d = 0; d < Rank; ++d) s[d] = o.extent(p, d);
    return s;
  };
  for (std::size_t d = 0; d < Rank; ++d) {
    global[d] = o.extent(0, d);
    if (!v.dim_axis[d].empty()) {
      const std::size_t a = Mesh::axis_index(v.dim_axis[d]);
      global[d] = 0;
      for (std::size_t q : m.group(a, 0)) global[d] += o.extent(q, d);
    }
  }
  for (std::size_t p = 0; p < m.size(); ++p)
    if (shard_shape(m, v, global, p) != shape_of(p))
      throw shape_error("parallel_do: merging as " + to_string(v) + " on " + m.describe() + ": place " + m.place(p).name() +
                        " returned " + format_extents(shape_of(p)) + " but a global " + format_extents(global) +
                        " gives it " + format_extents(shard_shape(m, v, global, p)) +
                        " (split dims are cut evenly, larger chunks first; other dims must agree)");
}

}  // namespace detail

/// @brief Runs `block` on every place of the mesh at once, on its local shards: each
/// dtensor argument arrives as that place's shard (a `const pdo::tensor&`), any other
/// argument as it is. The block returns that place's part of the result, and the parts
/// are merged as `OutLayout` says: concatenated along a split dim, summed over a partial
/// axis, kept as they are for replicate (each place's copy is its replica).
///
/// An exception thrown by the block on some place reaches the caller, on every process,
/// as a pdo::error naming the place; the other places finish their blocks, and the
/// mesh stays usable.
template <layout_spec OutLayout, class Block, class... Args>
  requires(distributed_tensor<Args> || ...)
auto parallel_do(Block&& block, const Args&... args) {
  using result_t = std::remove_cvref_t<std::invoke_result_t<Block&, detail::local_view_t<Args>...>>;
  static_assert(is_tensor_v<result_t>, "pdo: parallel_do: the block must return a pdo::tensor (its place's part of the result)");
  using T = typename result_t::value_type;
  constexpr std::size_t rank = result_t::rank;
  const auto& m = detail::first_dtensor(args...).mesh();
  using mesh_t = std::remove_cvref_t<decltype(m)>;
  static_assert(detail::check_layout<"parallel_do", OutLayout, mesh_t, rank>::ok);
  (detail::check_same_mesh(args, m), ...);

  const auto& local = m.local_places();
  detail::comms_of(m);  // built by every process, those without places too
  if (local.empty())
    throw layout_error("parallel_do: this process holds no place of " + m.describe() + "; call it on the processes that do");
  std::vector<std::optional<result_t>> results(local.size());
  const auto failure = detail::try_run_on_places(
      m, [&](std::size_t p, std::size_t k) { results[k].emplace(block(detail::local_view(args, p)...)); },
      /*communicate=*/false);
  const detail::block_outcomes outcomes = detail::share_outcomes(m, results, failure);
  for (std::size_t p = 0; p < m.size(); ++p) {
    if (!outcomes.failed(p)) continue;
    const std::string here = failure && failure->place == p ? detail::message_of(failure->error) : std::string();
    detail::throw_error_of_kind(outcomes.kind(p), "parallel_do: the block failed on place " + m.place(p).name() + ": " +
                                                      detail::share_message(m, p, here));
  }
  shape_t<rank> global{};
  detail::check_merge<OutLayout>(m, outcomes, global);
  std::vector<tensor<T, rank>> shards;
  shards.reserve(local.size());
  for (auto& r : results) shards.push_back(std::move(*r));
  return dtensor<T, rank, mesh_t, OutLayout>(m, global, std::move(shards));
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXEC_PARALLEL_DO_HPP
#endif  // PDO_SINGLE_PDO_EXEC_HPP
// ---- pdo/layout.hpp
#ifndef PDO_SINGLE_PDO_LAYOUT_HPP
#define PDO_SINGLE_PDO_LAYOUT_HPP
// pdo/layout.hpp: the layout layer (layout types, checks, redistribution plans).

// ---- pdo/layout/redistribute_plan.hpp
#ifndef PDO_SINGLE_PDO_LAYOUT_REDISTRIBUTE_PLAN_HPP
#define PDO_SINGLE_PDO_LAYOUT_REDISTRIBUTE_PLAN_HPP
// pdo/layout/redistribute_plan.hpp: the constexpr plan that turns one layout into another.


#include <array>
#include <cstddef>
#include <string>
#include <string_view>

namespace pdo {

/// @brief One step of a redistribution, along one mesh axis.
enum class step_kind {
  all_reduce,      ///< partial -> replicate
  reduce_scatter,  ///< partial -> split(dim)
  all_gather,      ///< split(dim) -> replicate
  all_to_all,      ///< split(from_dim) -> split(dim)
  local_slice,     ///< replicate -> split(dim): each place keeps its chunk, nothing moves
  keep_on_one,     ///< replicate -> partial: coordinate 0 keeps the value, the others hold zeros
  zero_pad,        ///< split(dim) -> partial: each place puts its chunk in zeros of the full dim
};

constexpr std::string_view step_name(step_kind k) {
  switch (k) {
    case step_kind::all_reduce: return "all_reduce";
    case step_kind::reduce_scatter: return "reduce_scatter";
    case step_kind::all_gather: return "all_gather";
    case step_kind::all_to_all: return "all_to_all";
    case step_kind::local_slice: return "local_slice";
    case step_kind::keep_on_one: return "keep_on_one";
    case step_kind::zero_pad: return "zero_pad";
  }
  return "?";
}

/// @brief True for the steps that communicate.
constexpr bool communicates(step_kind k) {
  return k != step_kind::local_slice && k != step_kind::keep_on_one && k != step_kind::zero_pad;
}

struct redistribute_step {
  step_kind kind{};
  std::string_view axis;
  std::size_t dim = 0;       ///< the dim gathered, scattered or sliced (the target dim of all_to_all)
  std::size_t from_dim = 0;  ///< all_to_all: the dim split before
  detail::layout_value before, after;
};

/// @brief The steps from one layout to another, in order. A value: usable in
/// static_assert, printable with describe().
struct redistribute_plan {
  std::size_t size = 0;
  std::array<redistribute_step, 2 * (detail::max_rank + detail::max_axes)> steps{};

  [[nodiscard]] constexpr const redistribute_step* begin() const { return steps.data(); }
  [[nodiscard]] constexpr const redistribute_step* end() const { return steps.data() + size; }
  /// @brief How many steps of kind `k` the plan has.
  [[nodiscard]] constexpr std::size_t count(step_kind k) const {
    std::size_t n = 0;
    for (std::size_t i = 0; i < size; ++i) n += steps[i].kind == k;
    return n;
  }
  [[nodiscard]] constexpr std::size_t collectives() const {
    std::size_t n = 0;
    for (std::size_t i = 0; i < size; ++i) n += communicates(steps[i].kind);
    return n;
  }
};

namespace detail {

struct axis_state {
  enum { replicated, split, partial } kind = replicated;
  std::size_t dim = 0;
  friend constexpr bool operator==(const axis_state&, const axis_state&) = default;
};

constexpr axis_state state_on(const layout_value& v, std::string_view axis) {
  if (v.is_partial(axis)) return {axis_state::partial, 0};
  const std::size_t d = v.split_dim(axis);
  if (d < v.rank) return {axis_state::split, d};
  return {};
}

/// @brief The plan from `from` to `to` (same rank). Two passes over the axes the
/// layouts name, partial axes first (reducing before gathering moves the least data):
/// first every axis leaves its old state (reductions and gathers, fused into
/// reduce_scatter or all_to_all where the target dim is free; split -> partial pads
/// with zeros in place), then every axis still replicated takes its new state (local
/// slices, keep-on-one), which moves nothing.
constexpr redistribute_plan plan_redistribute(const layout_value& from, const layout_value& to) {
  redistribute_plan plan;
  std::array<std::string_view, 2 * (max_rank + max_axes)> axes{};
  std::size_t naxes = 0;
  auto note = [&](std::string_view a) {
    if (a.empty()) return;
    for (std::size_t i = 0; i < naxes; ++i)
      if (axes[i] == a) return;
    axes[naxes++] = a;
  };
  for (std::size_t i = 0; i < from.npartial; ++i) note(from.partial[i]);
  for (std::size_t d = 0; d < from.rank; ++d) note(from.dim_axis[d]);
  for (std::size_t d = 0; d < to.rank; ++d) note(to.dim_axis[d]);
  for (std::size_t i = 0; i < to.npartial; ++i) note(to.partial[i]);

  layout_value cur = from;
  auto push = [&](step_kind k, std::string_view a, std::size_t dim, std::size_t from_dim, const layout_value& next) {
    plan.steps[plan.size++] = {k, a, dim, from_dim, cur, next};
    cur = next;
  };
  for (std::size_t i = 0; i < naxes; ++i) {
    const std::string_view a = axes[i];
    const axis_state f = state_on(cur, a), t = state_on(to, a);
    if (f == t) continue;
    layout_value next = cur;
    const bool target_free = t.kind == axis_state::split && cur.dim_axis[t.dim].empty();
    if (f.kind == axis_state::partial) {
      next.remove_partial(a);
      if (target_free) {
        next.dim_axis[t.dim] = a;
        push(step_kind::reduce_scatter, a, t.dim, t.dim, next);
      } else {
        push(step_kind::all_reduce, a, 0, 0, next);
      }
    } else if (f.kind == axis_state::split) {
      next.dim_axis[f.dim] = {};
      if (t.kind == axis_state::partial) {
        next.add_partial(a);
        push(step_kind::zero_pad, a, f.dim, f.dim, next);
      } else if (target_free) {
        next.dim_axis[t.dim] = a;
        push(step_kind::all_to_all, a, t.dim, f.dim, next);
      } else {
        push(step_kind::all_gather, a, f.dim, f.dim, next);
      }
    }
  }
  for (std::size_t i = 0; i < naxes; ++i) {
    const std::string_view a = axes[i];
    const axis_state f = state_on(cur, a), t = state_on(to, a);
    if (f == t) continue;
    layout_value next = cur;
    if (t.kind == axis_state::split) {
      next.dim_axis[t.dim] = a;
      push(step_kind::local_slice, a, t.dim, t.dim, next);
    } else if (t.kind == axis_state::partial) {
      next.add_partial(a);
      push(step_kind::keep_on_one, a, 0, 0, next);
    }
  }
  return plan;
}

}  // namespace detail

/// @brief The plan of `redistribute<To>` from layout `From`, at compile time.
template <layout_spec From, layout_spec To>
constexpr redistribute_plan redistribute_plan_of() {
  static_assert(From::rank == To::rank, "pdo: redistribute: the two layouts have different ranks");
  constexpr redistribute_plan plan = detail::plan_redistribute(detail::value_of<From>(), detail::value_of<To>());
  static_assert(plan.size == 0 ? detail::value_of<From>() == detail::value_of<To>()
                               : plan.steps[plan.size - 1].after == detail::value_of<To>(),
                "pdo: redistribute: the plan does not end in the target layout (a bug in pdo's planner)");
  return plan;
}

/// @brief The plan of `redistribute<To>` from layout `From`, as a variable.
template <layout_spec From, layout_spec To>
inline constexpr redistribute_plan redistribute_plan_v = redistribute_plan_of<From, To>();

/// @brief One line per step: "all_gather over tp on dim 1: {split<dp>, split<tp>} -> {split<dp>, replicate}".
inline std::string describe(const redistribute_plan& plan) {
  if (plan.size == 0) return "no steps (layouts are equal)\n";
  std::string text;
  for (const auto& s : plan) {
    text += std::string(step_name(s.kind)) + " over " + std::string(s.axis);
    if (s.kind == step_kind::all_to_all)
      text += " from dim " + std::to_string(s.from_dim) + " to dim " + std::to_string(s.dim);
    else if (s.kind != step_kind::all_reduce && s.kind != step_kind::keep_on_one)
      text += " on dim " + std::to_string(s.dim);
    text += ": " + detail::to_string(s.before) + " -> " + detail::to_string(s.after) + "\n";
  }
  return text;
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_LAYOUT_REDISTRIBUTE_PLAN_HPP
#endif  // PDO_SINGLE_PDO_LAYOUT_HPP
// ---- pdo/memory.hpp
#ifndef PDO_SINGLE_PDO_MEMORY_HPP
#define PDO_SINGLE_PDO_MEMORY_HPP
// pdo/memory.hpp: the memory layer (per-place caching allocators and their statistics).

#endif  // PDO_SINGLE_PDO_MEMORY_HPP
// ---- pdo/place.hpp
#ifndef PDO_SINGLE_PDO_PLACE_HPP
#define PDO_SINGLE_PDO_PLACE_HPP
// pdo/place.hpp: the place layer (places, meshes).

// ---- pdo/place/cpu_place.hpp
#ifndef PDO_SINGLE_PDO_PLACE_CPU_PLACE_HPP
#define PDO_SINGLE_PDO_PLACE_CPU_PLACE_HPP
// pdo/place/cpu_place.hpp: CPU places, each a worker thread on its own cores.


#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace pdo {

/// @brief How a CPU place is made.
struct cpu_place_options {
  bool pin = true;             ///< pin the worker to the place's cores (off when other places share them)
  std::size_t memory_cap = 0;  ///< bytes the place may hold (0: no cap)
  std::string name;            ///< empty: "cpu:<ordinal>"
  int process = 0;             ///< the MPI rank that owns it
};

/// @brief A CPU place: a worker thread that runs the place's work on the cores it was
/// given (pinned there when no other place shares them), and a caching allocator.
class cpu_place : public detail::place_handle<cpu_place> {
 public:
  /// @brief A new place on `cores`.
  cpu_place(int ordinal, std::vector<int> cores, const cpu_place_options& options = {})
      : place_handle(std::make_shared<detail::place_state>(
            place_kind::cpu, ordinal, options.process, true, std::move(cores),
            options.name.empty() ? "cpu:" + std::to_string(ordinal) : options.name)) {
    state_->memory = std::make_unique<caching_allocator>(state_->name, options.memory_cap);
    detail::start_worker(*state_, options.pin ? state_->cores : std::vector<int>{});
  }

  /// @brief A handle to the CPU place behind `state` (which must be a CPU place).
  explicit cpu_place(std::shared_ptr<detail::place_state> state) : place_handle(std::move(state)) {}
};

namespace detail {
/// @brief `n` places over `cores`: with n <= cores each gets its own share (the first
/// ones one more when uneven), pinned when `pin`; with more places than cores, places
/// share cores round-robin and are not pinned. `name(i)` names place i.
template <class Name>
std::vector<cpu_place> share_cores(std::size_t n, const std::vector<int>& cores, bool pin, std::size_t memory_cap,
                                   int process, Name&& name) {
  if (n == 0) throw layout_error("cpu_places: asked for 0 places; ask for at least one");
  const std::size_t c = cores.size();
  std::vector<cpu_place> places;
  places.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<int> mine;
    if (n <= c) {
      const std::size_t first = chunk_offset(c, n, i), count = chunk_size(c, n, i);
      mine.assign(cores.begin() + static_cast<std::ptrdiff_t>(first), cores.begin() + static_cast<std::ptrdiff_t>(first + count));
    } else {
      mine.push_back(cores[i % c]);
    }
    places.emplace_back(static_cast<int>(i), std::move(mine), cpu_place_options{pin && n <= c, memory_cap, name(i), process});
  }
  return places;
}
}  // namespace detail

/// @brief `n` CPU places over the cores of this process. With n <= cores each place
/// gets its own cores (cores / n, the first ones one more when uneven) and is pinned to
/// them; with more places than cores, places share cores round-robin and are not pinned.
/// @param memory_cap per-place cap in bytes (0: none)
inline std::vector<cpu_place> cpu_places(std::size_t n, std::size_t memory_cap = 0) {
  return detail::share_cores(n, detail::process_cores(), true, memory_cap, 0,
                             [](std::size_t i) { return "cpu:" + std::to_string(i); });
}

/// @brief One CPU place per core of this process.
inline std::vector<cpu_place> cpu_places() { return cpu_places(detail::process_cores().size()); }

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_PLACE_CPU_PLACE_HPP
// ---- pdo/place/cuda_place.hpp
#ifndef PDO_SINGLE_PDO_PLACE_CUDA_PLACE_HPP
#define PDO_SINGLE_PDO_PLACE_CUDA_PLACE_HPP
// pdo/place/cuda_place.hpp: GPU places. The type always exists, so generic code and
// meshes can name it; creating one needs a build with PDO_WITH_CUDA.


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
#endif  // PDO_SINGLE_PDO_PLACE_CUDA_PLACE_HPP
#endif  // PDO_SINGLE_PDO_PLACE_HPP
// ---- pdo/tensor.hpp
#ifndef PDO_SINGLE_PDO_TENSOR_HPP
#define PDO_SINGLE_PDO_TENSOR_HPP
// pdo/tensor.hpp: the tensor layer (tensor, dtensor, distribute, redistribute, gather).

// ---- pdo/tensor/copy.hpp
#ifndef PDO_SINGLE_PDO_TENSOR_COPY_HPP
#define PDO_SINGLE_PDO_TENSOR_COPY_HPP
// pdo/tensor/copy.hpp: block copies between row-major buffers: slices, packs along a dim, unpacks.


#include <array>
#include <cstddef>
#include <cstring>

namespace pdo::detail {

/// @brief Copies the block [offsets, offsets + extents) of a row-major `src` of shape
/// `src_shape` into the dense row-major `dst` of shape `extents`, one contiguous run
/// of the last dim at a time.
template <class T, std::size_t Rank>
void copy_block(const T* src, const shape_t<Rank>& src_shape, const shape_t<Rank>& offsets, const shape_t<Rank>& extents,
                T* dst) {
  if (volume(extents) == 0) return;
  if constexpr (Rank == 0) {
    *dst = *src;
  } else {
    const auto strides = row_major_strides(src_shape);
    const std::size_t run = extents[Rank - 1];
    shape_t<Rank> index{};  // over the leading Rank-1 dims of the block
    for (std::size_t out = 0;; out += run) {
      std::size_t in = offsets[Rank - 1];
      for (std::size_t d = 0; d + 1 < Rank; ++d) in += (offsets[d] + index[d]) * static_cast<std::size_t>(strides[d]);
      copy_elements(dst + out, src + in, run);
      std::size_t d = Rank - 1;
      while (d-- > 0) {
        if (++index[d] < extents[d]) break;
        index[d] = 0;
      }
      if (d == static_cast<std::size_t>(-1)) return;
    }
  }
}

/// @brief Chunk `k` of `parts` along the middle dim of `v` (see chunk_size), from `src`
/// laid out as v, into the dense `dst`.
template <class T>
void copy_chunk(const T* src, const dim_view& v, std::size_t parts, std::size_t k, T* dst) {
  const std::size_t off = chunk_offset(v.extent, parts, k), n = chunk_size(v.extent, parts, k);
  for (std::size_t o = 0; o < v.outer; ++o)
    copy_elements(dst + o * n * v.inner, src + (o * v.extent + off) * v.inner, n * v.inner);
}

/// @brief `src` (laid out as v) cut into `parts` chunks along v's middle dim, written
/// chunk after chunk into `dst`: the order collectives send and receive pieces in.
template <class T>
void pack_chunks(const T* src, const dim_view& v, std::size_t parts, T* dst) {
  for (std::size_t k = 0; k < parts; ++k) {
    copy_chunk(src, v, parts, k, dst);
    dst += v.outer * chunk_size(v.extent, parts, k) * v.inner;
  }
}

/// @brief The inverse of copy_chunk: the dense chunk `k` in `src` into its place in `dst`
/// laid out as v.
template <class T>
void place_chunk(const T* src, const dim_view& v, std::size_t parts, std::size_t k, T* dst) {
  const std::size_t off = chunk_offset(v.extent, parts, k), n = chunk_size(v.extent, parts, k);
  for (std::size_t o = 0; o < v.outer; ++o)
    copy_elements(dst + (o * v.extent + off) * v.inner, src + o * n * v.inner, n * v.inner);
}

/// @brief The inverse of pack_chunks: chunks one after another in `src` into `dst` laid out as v.
template <class T>
void unpack_chunks(const T* src, const dim_view& v, std::size_t parts, T* dst) {
  for (std::size_t k = 0; k < parts; ++k) {
    place_chunk(src, v, parts, k, dst);
    src += v.outer * chunk_size(v.extent, parts, k) * v.inner;
  }
}

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_TENSOR_COPY_HPP
// ---- pdo/tensor/redistribute.hpp
#ifndef PDO_SINGLE_PDO_TENSOR_REDISTRIBUTE_HPP
#define PDO_SINGLE_PDO_TENSOR_REDISTRIBUTE_HPP
// pdo/tensor/redistribute.hpp: distribute, redistribute and gather of dtensors.


#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief One step of a redistribution on place `p`: turns `shard` (laid out as
/// step.before) into its shard under step.after. Every place of the mesh runs it at once.
template <step_kind Kind, class T, std::size_t Rank, class Mesh>
tensor<T, Rank> apply_step(const redistribute_step& step, const Mesh& m, const shape_t<Rank>& global, std::size_t p,
                           tensor<T, Rank> shard) {
  const std::size_t a = Mesh::axis_index(step.axis), n = m.extent(a), me = m.coord(p, a);
  const any_place& place = m.place(p);
  const shape_t<Rank> out_shape = shard_shape(m, step.after, global, p);
  if constexpr (Kind == step_kind::keep_on_one) {
    if (me != 0) shard.fill(T{});
    return shard;
  } else if constexpr (Kind == step_kind::zero_pad) {
    tensor<T, Rank> out(out_shape, place);  // zeros
    place_chunk(shard.data(), view_along(out_shape, step.dim), n, me, out.data());
    return out;
  } else if constexpr (Kind == step_kind::local_slice) {
    tensor<T, Rank> out(out_shape, place, uninitialized);
    copy_chunk(shard.data(), view_along(shard.shape(), step.dim), n, me, out.data());
    return out;
  } else {
    const mesh_communicator comm = communicator_along(m, a, p);
    if constexpr (Kind == step_kind::all_reduce) {
      comm.all_reduce(shard.span());
      return shard;
    } else if constexpr (Kind == step_kind::reduce_scatter) {
      // members keep chunks of `dim`: send them chunk-major, unless dim is outermost
      const dim_view v = view_along(shard.shape(), step.dim);
      tensor<T, Rank> out(out_shape, place, uninitialized);
      if (v.outer == 1) {
        comm.reduce_scatter(std::as_const(shard).span(), out.span());
      } else {
        tensor<T, Rank> packed(shard.shape(), place, uninitialized);
        pack_chunks(shard.data(), v, n, packed.data());
        comm.reduce_scatter(std::as_const(packed).span(), out.span());
      }
      return out;
    } else if constexpr (Kind == step_kind::all_gather) {
      tensor<T, Rank> out(out_shape, place, uninitialized);
      const dim_view v = view_along(out_shape, step.dim);
      if (v.outer == 1) {
        comm.all_gather(std::as_const(shard).span(), out.span());
      } else {
        tensor<T, Rank> packed(out_shape, place, uninitialized);
        comm.all_gather(std::as_const(shard).span(), packed.span());
        unpack_chunks(packed.data(), v, n, out.data());
      }
      return out;
    } else {
      static_assert(Kind == step_kind::all_to_all);
      // piece j: my shard's chunk j of the new split dim; piece i received: member i's
      // chunk of the old split dim, to be put back in order along it
      const dim_view send_view = view_along(shard.shape(), step.dim);
      const dim_view recv_view = view_along(out_shape, step.from_dim);
      std::vector<std::size_t> send_counts(n), recv_counts(n);
      for (std::size_t k = 0; k < n; ++k) {
        send_counts[k] = send_view.outer * chunk_size(send_view.extent, n, k) * send_view.inner;
        recv_counts[k] = recv_view.outer * chunk_size(recv_view.extent, n, k) * recv_view.inner;
      }
      tensor<T, Rank> packed(shard.shape(), place, uninitialized);
      pack_chunks(shard.data(), send_view, n, packed.data());
      tensor<T, Rank> received(out_shape, place, uninitialized), out(out_shape, place, uninitialized);
      comm.all_to_all(std::as_const(packed).span(), std::span<const std::size_t>(send_counts), received.span(),
                      std::span<const std::size_t>(recv_counts));
      unpack_chunks(received.data(), recv_view, n, out.data());
      return out;
    }
  }
}

/// @brief Runs the plan from `From` to `To` on place `p`; each step's collective is
/// chosen at compile time from the plan.
template <layout_spec From, layout_spec To, class T, std::size_t Rank, class Mesh>
tensor<T, Rank> apply_plan(const Mesh& m, const shape_t<Rank>& global, std::size_t p, tensor<T, Rank> shard) {
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((shard = apply_step<redistribute_plan_v<From, To>.steps[I].kind>(redistribute_plan_v<From, To>.steps[I], m, global, p,
                                                                      std::move(shard))),
     ...);
  }(std::make_index_sequence<redistribute_plan_v<From, To>.size>{});
  return shard;
}

template <class T, std::size_t Rank, class Mesh, class Layout>
std::string redistribute_context(const dtensor<T, Rank, Mesh, Layout>& x, const std::string& to) {
  return "redistribute: " + x.describe() + " -> " + to;
}

/// @brief Every process must distribute a host tensor of the same shape: checked with
/// one small all_gather, so a process that passed another shape fails on all of them
/// (pdo::mismatch_error, the error every member of a collective throws alike).
template <class Mesh, std::size_t Rank>
void check_same_host_shape(const Mesh& m, std::size_t p, const shape_t<Rank>& shape) {
  std::vector<std::size_t> all(m.size() * Rank);
  communicator_of(m, p).all_gather(std::span<const std::size_t>(shape.data(), Rank), std::span<std::size_t>(all));
  for (std::size_t q = 0; q < m.size(); ++q)
    if (!std::equal(shape.begin(), shape.end(), all.begin() + static_cast<std::ptrdiff_t>(q * Rank)))
      throw mismatch_error("distribute: the processes passed host tensors of different shapes: " + format_extents(shape) +
                        " here, " + format_extents(std::span<const std::size_t>(all.data() + q * Rank, Rank)) + " on " +
                        m.place(q).name() + "; every process must pass the same tensor");
}

}  // namespace detail

/// @brief Cuts the host tensor `host` over `m` as `Layout`: each place of this process
/// gets its chunk of the split dims, in its own memory; for partial axes, the places at
/// coordinate 0 get the value and the others zeros. Every process passes the same tensor.
template <layout_spec Layout, mesh_type Mesh, element T, std::size_t Rank>
dtensor<T, Rank, Mesh, Layout> distribute(const Mesh& m, const tensor<T, Rank>& host) {
  static_assert(detail::check_layout<"distribute", Layout, Mesh, Rank>::ok);
  constexpr detail::layout_value v = detail::value_of<Layout>();
  const auto& local = m.local_places();
  std::vector<tensor<T, Rank>> shards(local.size());
  detail::run_on_places("distribute", m, [&](std::size_t p, std::size_t k) {
    if (m.is_multiprocess()) detail::check_same_host_shape(m, p, host.shape());
    const auto shape = detail::shard_shape(m, v, host.shape(), p);
    tensor<T, Rank> shard(shape, m.place(p), detail::uninitialized);
    if (detail::holds_partial_value(m, v, p))
      detail::copy_block(host.data(), host.shape(), detail::shard_offset(m, v, host.shape(), p), shape, shard.data());
    else
      shard.fill(T{});
    shards[k] = std::move(shard);
  });
  return {m, host.shape(), std::move(shards)};
}

/// @brief `x` laid out as `To`. The steps are planned at compile time
/// (redistribute_plan_of<From, To>()): partial -> replicate is an all_reduce,
/// partial -> split a reduce_scatter, split -> replicate an all_gather, split(d) ->
/// split(d') an all_to_all, and replicate -> split a local slice that moves no data.
template <layout_spec To, element T, std::size_t Rank, mesh_type Mesh, layout_spec From>
dtensor<T, Rank, Mesh, To> redistribute(const dtensor<T, Rank, Mesh, From>& x) {
  static_assert(detail::check_layout<"redistribute", To, Mesh, Rank>::ok);
  const Mesh& m = x.mesh();
  std::vector<tensor<T, Rank>> shards(x.local_shards().size());
  detail::run_on_places(detail::redistribute_context(x, layout_name<To>()).c_str(), m, [&](std::size_t p, std::size_t k) {
    shards[k] = detail::apply_plan<From, To>(m, x.shape(), p, x.local_shards()[k]);
  });
  return {m, x.shape(), std::move(shards)};
}

/// @brief The value of `x` as one host tensor, on every process: partial sums are
/// reduced and split dims gathered.
template <element T, std::size_t Rank, mesh_type Mesh, layout_spec Layout>
tensor<T, Rank> gather(const dtensor<T, Rank, Mesh, Layout>& x) {
  using full = detail::replicated_layout_t<Rank>;
  detail::comms_of(x.mesh());  // built by every process, those without places too
  if (x.mesh().local_places().empty()) throw layout_error("gather: " + x.describe() + ": this process holds no place of the mesh");
  const auto whole = redistribute<full>(x);
  tensor<T, Rank> out(x.shape(), detail::uninitialized);
  const auto& shard = whole.local_shards().front();
  detail::copy_elements(out.data(), shard.data(), out.size());
  return out;
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_TENSOR_REDISTRIBUTE_HPP
#endif  // PDO_SINGLE_PDO_TENSOR_HPP
#endif  // PDO_SINGLE_PDO_PDO_HPP
