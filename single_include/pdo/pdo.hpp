// pdo: parallel tensor programs over meshes of places. Single-header edition.
// Generated from include/ by tools/amalgamate.py: do not edit by hand.
#pragma once
// ---- pdo/pdo.hpp
#ifndef PDO_SINGLE_PDO_PDO_HPP
#define PDO_SINGLE_PDO_PDO_HPP
// pdo/pdo.hpp: the whole public API of pdo.

// ---- pdo/autograd.hpp
#ifndef PDO_SINGLE_PDO_AUTOGRAD_HPP
#define PDO_SINGLE_PDO_AUTOGRAD_HPP
// pdo/autograd.hpp: reverse-mode autograd over pdo::tensor and pdo::dtensor (pdo::var, pdo::backward),
// parallel_do over vars.

// ---- pdo/autograd/ops.hpp
#ifndef PDO_SINGLE_PDO_AUTOGRAD_OPS_HPP
#define PDO_SINGLE_PDO_AUTOGRAD_OPS_HPP
// pdo/autograd/ops.hpp: the ops of pdo/expr on pdo::var, each with its backward rule.
//
// Each op evaluates its forward expression (fused and planned as pdo::eval does) and
// records a backward rule that is itself a pdo expression. So the gradient of a dtensor op
// is planned by the same rules as the forward: its layout is a type, derived at compile
// time, and it is brought to the layout of the value it is the gradient of by the
// redistribution the planner picks (detail::to_value). A replicated weight used on row-split
// data gets a partial gradient, which that step all_reduces.

// ---- pdo/autograd/variable.hpp
#ifndef PDO_SINGLE_PDO_AUTOGRAD_VARIABLE_HPP
#define PDO_SINGLE_PDO_AUTOGRAD_VARIABLE_HPP
// pdo/autograd/variable.hpp: pdo::var, the graph it records, and pdo::backward.

// ---- pdo/core/views.hpp
#ifndef PDO_SINGLE_PDO_CORE_VIEWS_HPP
#define PDO_SINGLE_PDO_CORE_VIEWS_HPP
// pdo/core/views.hpp: the range views pdo's loops use to pair shards with places and number them:
// range-v3's (C++20's std::views in g++ 12 have neither zip nor enumerate). nvcc cannot compile
// range-v3's headers: its front end rewrites the conversion operator that range-v3's semiregular_box
// takes from its base into one naming the standard library's template parameter (`operator _Tp &`),
// which the host compiler rejects. Under nvcc the two views are pdo's own, with the same elements:
// tuples of references (zip) and (position, reference) pairs (enumerate).

#include <cstddef>
#include <iterator>
#include <ranges>
#include <tuple>
#include <utility>

#if !defined(__CUDACC__)
#include <range/v3/view/enumerate.hpp>
#include <range/v3/view/zip.hpp>
#endif

namespace pdo::detail::views {

#if !defined(__CUDACC__)

/// @brief The elements of several ranges side by side, as long as the shortest: `for (auto [p, shard] : zip(places, shards))`.
using ranges::views::zip;
/// @brief Each element with its position: `for (auto [k, x] : enumerate(r))`.
using ranges::views::enumerate;

#else

/// @brief zip's range: a tuple of iterators advanced together, ending with the shortest range.
template <std::ranges::view... Vs>
class zip_view : public std::ranges::view_interface<zip_view<Vs...>> {
 public:
  zip_view() = default;
  explicit zip_view(Vs... vs) : views_(std::move(vs)...) {}

  class iterator {
   public:
    using value_type = std::tuple<std::ranges::range_value_t<Vs>...>;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    explicit iterator(std::tuple<std::ranges::iterator_t<Vs>...> at) : at_(std::move(at)) {}
    auto operator*() const {
      return std::apply([](const auto&... it) { return std::tuple<std::ranges::range_reference_t<Vs>...>(*it...); }, at_);
    }
    iterator& operator++() {
      std::apply([](auto&... it) { (++it, ...); }, at_);
      return *this;
    }
    void operator++(int) { ++*this; }
    bool reached(const std::tuple<std::ranges::sentinel_t<Vs>...>& ends) const {
      return [&]<std::size_t... I>(std::index_sequence<I...>) {
        return ((std::get<I>(at_) == std::get<I>(ends)) || ...);
      }(std::index_sequence_for<Vs...>{});
    }

   private:
    std::tuple<std::ranges::iterator_t<Vs>...> at_;
  };
  struct sentinel {
    std::tuple<std::ranges::sentinel_t<Vs>...> ends;
    friend bool operator==(const iterator& it, const sentinel& s) { return it.reached(s.ends); }
  };

  iterator begin() {
    return iterator(std::apply([](auto&... v) { return std::tuple(std::ranges::begin(v)...); }, views_));
  }
  sentinel end() {
    return sentinel{std::apply([](auto&... v) { return std::tuple(std::ranges::end(v)...); }, views_)};
  }

 private:
  std::tuple<Vs...> views_;
};

template <class... Rs>
zip_view(Rs&&...) -> zip_view<std::views::all_t<Rs>...>;

/// @brief The elements of several ranges side by side, as long as the shortest.
inline constexpr auto zip = []<std::ranges::viewable_range... Rs>(Rs&&... rs) {
  return zip_view<std::views::all_t<Rs>...>(std::views::all(std::forward<Rs>(rs))...);
};

/// @brief Each element with its position (a std::size_t).
inline constexpr auto enumerate = []<std::ranges::viewable_range R>(R&& r) {
  return zip(std::views::iota(std::size_t{0}), std::forward<R>(r));
};

#endif

}  // namespace pdo::detail::views
#endif  // PDO_SINGLE_PDO_CORE_VIEWS_HPP
// ---- pdo/exec/eval.hpp
#ifndef PDO_SINGLE_PDO_EXEC_EVAL_HPP
#define PDO_SINGLE_PDO_EXEC_EVAL_HPP
// pdo/exec/eval.hpp: evaluating expressions: at once (eval) or queued on the places (eval_async, wait_all).

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

/// @brief Keeps a function out of its callers: for the bookkeeping of an operation (checks,
/// messages, submission) that every instantiation of a template calls, so that it is
/// compiled once in a translation unit, not again inside each instantiation.
#if defined(__GNUC__) || defined(__clang__)
#define PDO_NOINLINE __attribute__((noinline))
#else
#define PDO_NOINLINE
#endif

#define PDO_VERSION_MAJOR 0
#define PDO_VERSION_MINOR 1
#define PDO_VERSION_PATCH 0

namespace pdo::detail {

/// @brief Tells the core the calling thread is spinning (x86's pause, Arm's yield), so a
/// short spin costs the other hyperthread and the memory system little.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_CORE_CONFIG_HPP
// ---- pdo/exec/run_on_places.hpp
#ifndef PDO_SINGLE_PDO_EXEC_RUN_ON_PLACES_HPP
#define PDO_SINGLE_PDO_EXEC_RUN_ON_PLACES_HPP
// pdo/exec/run_on_places.hpp: the tasks of one mesh-wide operation, one per place of this
// process, submitted to the engine at one point of its order; how they end.

// ---- pdo/comm/mesh_comms.hpp
#ifndef PDO_SINGLE_PDO_COMM_MESH_COMMS_HPP
#define PDO_SINGLE_PDO_COMM_MESH_COMMS_HPP
// pdo/comm/mesh_comms.hpp: the communicators of a mesh: one group per axis line, and the whole mesh.

// ---- pdo/comm/group_communicator.hpp
#ifndef PDO_SINGLE_PDO_COMM_GROUP_COMMUNICATOR_HPP
#define PDO_SINGLE_PDO_COMM_GROUP_COMMUNICATOR_HPP
// pdo/comm/group_communicator.hpp: a member's endpoint on a group, for any backend's group type.

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

/// @brief The larger of `a` and `b`; NaN when either is NaN, whichever it is (as PyTorch's
/// maximum and NumPy's max): every max of pdo, reductions and collectives included, is this one.
template <class T>
PDO_HD constexpr T nan_max(T a, T b) {
  return (a != a || a > b) ? a : b;  // a != a: a is NaN (never for integers)
}
/// @brief The smaller of `a` and `b`; NaN when either is NaN.
template <class T>
PDO_HD constexpr T nan_min(T a, T b) {
  return (a != a || a < b) ? a : b;
}

template <class T>
constexpr T apply(reduce_op op, T a, T b) {
  switch (op) {
    case reduce_op::sum: return a + b;
    case reduce_op::max: return nan_max(a, b);
    case reduce_op::min: return nan_min(a, b);
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
// ---- pdo/core/timeline.hpp
#ifndef PDO_SINGLE_PDO_CORE_TIMELINE_HPP
#define PDO_SINGLE_PDO_CORE_TIMELINE_HPP
// pdo/core/timeline.hpp: what the timeline (pdo::trace, pdo/exec/trace.hpp) learns while it
// records: the engine's tasks, and spans inside them (kernels, collectives, copies). While
// nothing records, a span costs one relaxed atomic load.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace pdo::detail {

using timeline_clock = std::chrono::steady_clock;

/// @brief A row of the timeline: one lane of one place, or a host thread.
struct timeline_track {
  std::string place;  ///< "cpu:0", "rank1/cuda:0"; "host" for a thread that is no place's lane
  std::string lane;   ///< "compute", "communication", "copy"; for a host thread, "thread <n>"
};

/// @brief One recorded interval (or instant, when start == end).
struct timeline_event {
  const char* category = "task";  ///< "kernel", "collective", "copy", "task", "gradient"
  std::string name;
  std::string detail;             ///< shapes and layouts, bytes, from and to
  const timeline_track* track = nullptr;
  timeline_clock::time_point start, end;
  std::uint64_t id = 0;              ///< the engine's task id (0: a span inside a task)
  std::vector<std::uint64_t> after;  ///< the tasks a task waited for (flow arrows)
  /// @brief For a task queued by another while it ran (a bucket's collective by backward): the
  /// row of the task that queued it and when (a flow arrow from there); null otherwise.
  const timeline_track* queued_on = nullptr;
  timeline_clock::time_point queued_at;
  bool instant = false;
};

/// @brief Where events go while the timeline records.
struct timeline_sink {
  virtual ~timeline_sink() = default;
  virtual void record(timeline_event e) = 0;
};

inline std::atomic<timeline_sink*>& timeline() {
  static std::atomic<timeline_sink*> sink{nullptr};
  return sink;
}

/// @brief Whether the timeline records now.
inline bool timeline_on() { return timeline().load(std::memory_order_relaxed) != nullptr; }

/// @brief The calling thread's row: its lane's (set by the lane), else one of its own.
inline const timeline_track*& current_track() {
  thread_local const timeline_track* track = nullptr;
  return track;
}

inline const timeline_track* track_of_this_thread() {
  if (const timeline_track* t = current_track(); t != nullptr) return t;
  static std::atomic<int> threads{0};
  thread_local const timeline_track own{"host", "thread " + std::to_string(threads.fetch_add(1))};
  return &own;
}

/// @brief Whether the calling thread runs a task that started before the timeline recorded:
/// the spans inside it are not recorded either (a span is shown inside its task).
inline bool& in_untraced_task() {
  thread_local bool untraced = false;
  return untraced;
}

/// @brief Records the interval from its construction to its end, while the timeline records:
/// `describe()` (the detail) is called only then.
class timeline_span {
 public:
  template <class Describe>
  timeline_span(const char* category, const char* name, Describe&& describe) {
    if (!timeline_on() || in_untraced_task()) return;
    event_ = std::make_unique<timeline_event>();
    auto& e = *event_;
    e.category = category;
    e.name = name;
    e.detail = std::forward<Describe>(describe)();
    e.track = track_of_this_thread();
    e.start = timeline_clock::now();
  }
  timeline_span(const timeline_span&) = delete;
  timeline_span& operator=(const timeline_span&) = delete;
  ~timeline_span() {
    if (!event_) return;
    event_->end = timeline_clock::now();
    if (timeline_sink* sink = timeline().load(std::memory_order_acquire); sink != nullptr) sink->record(std::move(*event_));
  }

 private:
  std::unique_ptr<timeline_event> event_;  ///< null while the timeline is off
};

/// @brief Records an instant (a gradient complete, say), while the timeline records.
template <class Describe>
void timeline_instant(const char* category, std::string name, Describe&& describe) {
  timeline_sink* sink = timeline().load(std::memory_order_acquire);
  if (sink == nullptr || in_untraced_task()) return;
  timeline_event e;
  e.category = category;
  e.name = std::move(name);
  e.detail = std::forward<Describe>(describe)();
  e.track = track_of_this_thread();
  e.start = e.end = timeline_clock::now();
  e.instant = true;
  sink->record(std::move(e));
}

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_CORE_TIMELINE_HPP

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>

namespace pdo {

namespace detail {
/// @brief Calls `f` with the backend group behind `g`; groups that choose their backend
/// at run time (any_group) overload it.
template <class Group, class F>
decltype(auto) visit_group(Group& g, F&& f) {
  return std::forward<F>(f)(g);
}
/// @brief How the timeline names a group; groups that know their mesh axis overload it.
template <class Group>
std::string group_label(const Group&) {
  return "a group";
}
}  // namespace detail

/// @brief Member `rank()` of a group of places; see pdo::communicator for the contract.
/// @tparam Group a backend group: detail::local_group (threads), mpi::detail::group,
///         or detail::any_group (whichever the mesh was built on).
template <class Group>
class group_communicator {
 public:
  /// @brief Marks this class as a communicator (see pdo::communicator).
  using communicator_tag = void;

  /// @brief Member `member` (0 to the group's size - 1) of `group`, which copies of the endpoint share.
  group_communicator(std::shared_ptr<Group> group, std::size_t member) : group_(std::move(group)), member_(member) {}

  /// @brief The number of members of the group.
  [[nodiscard]] std::size_t size() const {
    using detail::visit_group;
    return visit_group(*group_, [](auto& g) { return g.size(); });
  }
  /// @brief This endpoint's member index in the group, from 0.
  [[nodiscard]] std::size_t rank() const { return member_; }

  /// @brief Returns once every member of the group has called barrier().
  void barrier() const {
    const detail::timeline_span span("collective", "barrier", [&] { return describe(0); });
    with([&](auto& g) { g.barrier(member_); });
  }
  /// @brief `data` = op over members of their `data` (same size on all).
  template <element T>
  void all_reduce(std::span<T> data, reduce_op op = reduce_op::sum) const {
    const detail::timeline_span span("collective", "all_reduce", [&] { return describe(data.size_bytes()); });
    with([&](auto& g) { g.all_reduce(member_, data, op); });
  }
  /// @brief `out` = every member's `in`, concatenated in member order (sizes may differ).
  template <element T>
  void all_gather(std::span<const T> in, std::span<T> out) const {
    const detail::timeline_span span("collective", "all_gather", [&] { return describe(out.size_bytes()); });
    with([&](auto& g) { g.all_gather(member_, in, out); });
  }
  /// @brief `out` = this member's segment of op over members of `in`; segment k has the
  /// size member k passes as `out`.
  template <element T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op = reduce_op::sum) const {
    const detail::timeline_span span("collective", "reduce_scatter", [&] { return describe(in.size_bytes()); });
    with([&](auto& g) { g.reduce_scatter(member_, in, out, op); });
  }
  /// @brief `data` = member `root`'s `data`.
  template <element T>
  void broadcast(std::span<T> data, std::size_t root) const {
    const detail::timeline_span span("collective", "broadcast", [&] { return describe(data.size_bytes()); });
    with([&](auto& g) { g.broadcast(member_, data, root); });
  }
  /// @brief Piece j of `in` (send_counts[j] elements) goes to member j; `out` holds the
  /// pieces received from members 0..n-1 in order (recv_counts[i] elements from i).
  template <element T>
  void all_to_all(std::span<const T> in, std::span<const std::size_t> send_counts, std::span<T> out,
                  std::span<const std::size_t> recv_counts) const {
    const detail::timeline_span span("collective", "all_to_all", [&] { return describe(in.size_bytes()); });
    with([&](auto& g) { g.all_to_all(member_, in, send_counts, out, recv_counts); });
  }
  /// @brief Sends `data` to member `to`; returns once it has been received.
  template <element T>
  void send(std::span<const T> data, std::size_t to, int tag = 0) const {
    const detail::timeline_span span("collective", "send", [&] { return describe(data.size_bytes()); });
    with([&](auto& g) { g.send(member_, data, to, tag); });
  }
  /// @brief Receives exactly `data.size()` elements from member `from`.
  template <element T>
  void recv(std::span<T> data, std::size_t from, int tag = 0) const {
    const detail::timeline_span span("collective", "recv", [&] { return describe(data.size_bytes()); });
    with([&](auto& g) { g.recv(member_, data, from, tag); });
  }

 private:
  /// @brief The timeline's detail of a collective: its group, this member, the bytes it passes.
  [[nodiscard]] std::string describe(std::size_t bytes) const {
    using detail::group_label;
    return "over " + group_label(*group_) + ", member " + std::to_string(member_) + " of " + std::to_string(size()) + ", " +
           std::to_string(bytes) + " bytes";
  }

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
// ---- pdo/comm/host_group.hpp
#ifndef PDO_SINGLE_PDO_COMM_HOST_GROUP_HPP
#define PDO_SINGLE_PDO_COMM_HOST_GROUP_HPP
// pdo/comm/host_group.hpp: the group of host memory a mesh's places communicate through:
// the threads backend when all places live in this process, MPI otherwise.

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
// pdo/core/error.hpp: the exception hierarchy every run-time failure is reported with, and
// how a failure travels to another thread or process (detail::captured_error).

#include <exception>
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

/// @brief A collective that waited longer than its mesh's timeout for members that did not
/// arrive (see mesh_options::collective_timeout). Every member that arrived throws it, so
/// the program can go on (to save its state, say); the group it ran on is unusable after it.
class collective_timeout : public communication_error {
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

/// @brief Which pdo::error subclass a failure is: how a failure travels to another thread
/// or process, where it is thrown again as the same subclass.
enum class error_kind : unsigned char {
  other,             ///< not a pdo::error (a std::exception of another kind)
  generic,           ///< pdo::error itself
  shape,             ///< pdo::shape_error
  layout,            ///< pdo::layout_error
  out_of_memory,     ///< pdo::out_of_memory
  io,                ///< pdo::io_error
  communication,     ///< pdo::communication_error
  mismatch,          ///< pdo::mismatch_error
  aborted,           ///< pdo::collective_aborted
  timeout,           ///< pdo::collective_timeout
};

namespace detail {

/// @brief The error_kind of `failure`.
inline error_kind kind_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const collective_aborted&) {
    return error_kind::aborted;
  } catch (const collective_timeout&) {
    return error_kind::timeout;
  } catch (const mismatch_error&) {
    return error_kind::mismatch;
  } catch (const communication_error&) {
    return error_kind::communication;
  } catch (const shape_error&) {
    return error_kind::shape;
  } catch (const layout_error&) {
    return error_kind::layout;
  } catch (const out_of_memory&) {
    return error_kind::out_of_memory;
  } catch (const io_error&) {
    return error_kind::io;
  } catch (const error&) {
    return error_kind::generic;
  } catch (...) {
    return error_kind::other;
  }
}

/// @brief Throws the pdo::error subclass of `kind` with `message` (pdo::error for `other`).
[[noreturn]] inline void throw_error_of_kind(error_kind kind, const std::string& message) {
  switch (kind) {
    case error_kind::shape: throw shape_error(message);
    case error_kind::layout: throw layout_error(message);
    case error_kind::out_of_memory: throw out_of_memory(message);
    case error_kind::io: throw io_error(message);
    case error_kind::communication: throw communication_error(message);
    case error_kind::mismatch: throw mismatch_error(message);
    case error_kind::aborted: throw collective_aborted(message);
    case error_kind::timeout: throw collective_timeout(message);
    case error_kind::other:
    case error_kind::generic: break;
  }
  throw error(message);
}

/// @brief Whether every member of a group that spans processes learns of a failure of this
/// kind alike (argument mismatches, timeouts), so each process can go on after it.
constexpr bool shared_by_all_members(error_kind kind) { return kind == error_kind::mismatch || kind == error_kind::timeout; }

inline std::string message_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

/// @brief A caught exception as its error_kind and message, so it can be thrown
/// again on another thread or process. The exception object itself stays on the thread
/// that caught it: an exception_ptr released on a different thread than the one that read
/// it races in the eyes of ThreadSanitizer (libstdc++ counts its references uninstrumented).
struct captured_error {
  error_kind kind = error_kind::other;
  std::string message;

  /// @brief The exception being handled (call inside a catch block).
  [[nodiscard]] static captured_error current() {
    const std::exception_ptr failure = std::current_exception();
    return {kind_of(failure), message_of(failure)};
  }
  /// @brief Whether this failure only echoes another place's abort of the collectives.
  [[nodiscard]] bool is_abort_echo() const { return kind == error_kind::aborted; }
  /// @brief Throws it again with `context` in front of its message, keeping its pdo::error subclass.
  [[noreturn]] void rethrow_with_context(const std::string& context) const { throw_error_of_kind(kind, context + message); }
};

}  // namespace detail
}  // namespace pdo
#endif  // PDO_SINGLE_PDO_CORE_ERROR_HPP

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace pdo::detail {

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
  /// @param names the members' names, for the error that names a member whose task left
  /// (kept by the caller for the barrier's life), or null
  /// @param part_of_larger the members are this process's part of a group over several
  /// processes: a member's departure is then a pdo::communication_error (the other processes
  /// cannot be told of it, so it ends the job), not a pdo::mismatch_error every member throws
  explicit group_barrier(std::uint32_t count, const std::vector<std::string>* names = nullptr, bool part_of_larger = false)
      : count_(count),
        spin_limit_(count <= std::max(1u, std::thread::hardware_concurrency()) ? 4000 : 16),
        names_(names),
        part_of_larger_(part_of_larger) {}

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

  /// @brief Wakes abortable waiters, now and until reset(), with pdo::collective_aborted:
  /// "another place of the group failed" (an echo of that failure), unless an earlier abort
  /// since the last reset said otherwise.
  void abort() { abort_because(echo); }
  /// @brief Wakes abortable waiters, now and until reset(), with a pdo::mismatch_error saying
  /// that member `member`'s task ended without joining the collective (unless an earlier
  /// abort since the last reset said otherwise). Nothing is formatted here: a task's end on
  /// a mesh of CPU places calls this for each group it belongs to, and the text is made only
  /// when a waiter throws it.
  void abort_departed(std::uint32_t member) { abort_because(departed + member); }
  /// @brief Makes the barrier usable again; call only when no thread is inside it.
  void reset() {
    arrived_.store(0, std::memory_order_relaxed);
    reason_.store(none, std::memory_order_relaxed);
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
  /// @brief Why the barrier was aborted: none, an echo of a failure, or `departed + m`.
  static constexpr std::uint32_t none = 0, echo = 1, departed = 2;

  /// @brief The first abort since the last reset gives its reason; then waiters are woken.
  void abort_because(std::uint32_t reason) {
    std::uint32_t expected = none;
    reason_.compare_exchange_strong(expected, reason, std::memory_order_acq_rel);
    phase_.fetch_or(aborted_bit, std::memory_order_release);
    phase_.notify_all();
  }
  [[noreturn]] PDO_NOINLINE void throw_aborted() const {
    const std::uint32_t reason = reason_.load(std::memory_order_acquire);
    if (reason >= departed) {
      const std::uint32_t member = reason - departed;
      const std::string who = names_ != nullptr && member < names_->size() ? (*names_)[member] : "member " + std::to_string(member);
      const std::string why =
          "collective aborted: the task of place " + who + " ended without joining it (every member of a group must make the same collectives)";
      if (part_of_larger_) throw communication_error(why);
      throw mismatch_error(why);
    }
    throw collective_aborted("collective aborted: another place of the group failed");
  }

  const std::uint32_t count_;
  const int spin_limit_;  ///< spin only while every member can have a core of its own
  std::atomic<std::uint32_t> arrived_{0};
  std::atomic<std::uint32_t> phase_{0};
  std::atomic<std::uint32_t> reason_{none};  ///< why it was aborted since the last reset
  const std::vector<std::string>* names_;    ///< the members' names (the errors name the one that left), or null
  const bool part_of_larger_;                ///< see the constructor
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
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
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

/// @brief The largest number of bytes one tensor may span: pointer differences and strides
/// (std::ptrdiff_t) must be able to reach its end.
inline constexpr std::size_t max_tensor_bytes = static_cast<std::size_t>(PTRDIFF_MAX);

template <class Range>
std::string format_extents(const Range& extents);

/// @brief The product of `extents`, checked: when it, or its size in bytes at
/// `element_bytes` each, exceeds what memory can hold (max_tensor_bytes), a
/// pdo::shape_error naming `op` and the extents.
/// @brief The error of checked_volume.
[[noreturn]] PDO_NOINLINE inline void throw_too_large(std::string_view op, const std::string& extents, long double elements,
                                                      std::size_t element_bytes) {
  std::ostringstream os;
  os << op << ": extents " << extents << " hold " << elements << " elements of " << element_bytes
     << " bytes, more than one tensor can address (" << max_tensor_bytes << " bytes); use smaller extents";
  throw shape_error(os.str());
}

template <class Range>
std::size_t checked_volume(const Range& extents, std::string_view op, std::size_t element_bytes = 1) {
  std::size_t n = 1;
  bool over = false, empty = false;
  long double exact = 1;  // for the message: the product that did not fit
  for (auto e : extents) {
    exact *= static_cast<long double>(e);
    empty = empty || e == 0;
    over = over || __builtin_mul_overflow(n, static_cast<std::size_t>(e), &n);
  }
  if (empty) return 0;  // an empty tensor: any other extent is fine
  std::size_t bytes = 0;
  if (over || __builtin_mul_overflow(n, element_bytes, &bytes) || bytes > max_tensor_bytes)
    throw_too_large(op, format_extents(extents), exact, element_bytes);
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

/// @brief "[10, 6]": extents as messages print them.
PDO_NOINLINE inline std::string format_extent_list(std::span<const std::size_t> extents) {
  std::string text = "[";
  for (std::size_t i = 0; i < extents.size(); ++i) text += (i ? ", " : "") + std::to_string(extents[i]);
  return text + "]";
}

template <class Range>
std::string format_extents(const Range& extents) {
  if constexpr (std::is_convertible_v<const Range&, std::span<const std::size_t>>) {
    return format_extent_list(extents);
  } else {
    std::string text = "[";
    for (bool first = true; auto e : extents) {
      text += (first ? "" : ", ") + std::to_string(e);
      first = false;
    }
    return text + "]";
  }
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
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <utility>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
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
      for (std::size_t i = 0; i < n; ++i) acc[i] = nan_max(acc[i], src[i]);
      break;
    case reduce_op::min:
      for (std::size_t i = 0; i < n; ++i) acc[i] = nan_min(acc[i], src[i]);
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
      case reduce_op::max: return run([](T a, T b) { return nan_max(a, b); });
      case reduce_op::min: return run([](T a, T b) { return nan_min(a, b); });
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

/// @brief How a collective call is named in a mismatch: "all_reduce(sum) of f32",
/// "broadcast of u16", "barrier". The element is its kind ('f' floating point, 'i' signed,
/// 'u' unsigned; 0 for none) and its bits, so types of one representation (long and long
/// long of 8 bytes) name one call. `op` is a reduce_op, or -1 for none.
PDO_NOINLINE inline std::string collective_call_text(std::string_view collective, char element_kind, std::size_t element_bytes, int op) {
  std::string text(collective);
  if (op >= 0) text += "(" + std::string(op_name(static_cast<reduce_op>(op))) + ")";
  if (element_kind == 0) return text;
  return text + " of " + element_kind + std::to_string(8 * element_bytes);
}

/// @brief The kind of element T in a call text: 'f', 'i' or 'u'.
template <class T>
constexpr char element_kind() {
  return std::is_floating_point_v<T> ? 'f' : std::is_signed_v<T> ? 'i' : 'u';
}

/// @brief A code for the call text `call` (its bytes hashed), to compare calls between processes.
constexpr std::size_t collective_code(std::string_view call) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : call) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return static_cast<std::size_t>(h);
}

/// @brief The call text of a collective over elements of type T.
template <class T>
std::string collective_call_text(std::string_view collective, int op = -1) {
  return collective_call_text(collective, element_kind<T>(), sizeof(T), op);
}

/// @brief The members of one group that live in this process, and the shared slots
/// through which they see each other's buffers. Every collective is called by all
/// `size()` members at once, each from its own thread, with its own member index.
///
/// Protocol: publish the buffers and what was called (the collective, its element type,
/// its reduction), barrier, check that every member called the same and that the
/// arguments agree (all members reach the same verdict from the same slots, so a mismatch
/// is an error on every member, never a hang), do this member's share of the work, barrier.
class local_group {
 public:
  /// @param part_of_larger the members are this process's part of a group over several
  /// processes (see group_barrier)
  explicit local_group(std::vector<std::string> member_names, bool part_of_larger = false)
      : names_(std::move(member_names)),
        slots_(names_.size()),
        barrier_(static_cast<std::uint32_t>(names_.size()), &names_, part_of_larger) {}

  [[nodiscard]] std::size_t size() const { return names_.size(); }
  [[nodiscard]] const std::string& name(std::size_t member) const { return names_[member]; }

  /// @brief A plain barrier of the members (a step inside another group's collective).
  void barrier() { barrier_.arrive_and_wait(); }
  /// @brief The barrier collective: an error on every member when another called a
  /// different collective.
  void barrier(std::size_t me) {
    slot s;
    s.collective = "barrier";
    publish(me, s);
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_same_call();
  }

  /// @brief Wakes every member blocked in this group with an error; see reset().
  void abort() {
    barrier_.abort();
    std::lock_guard lock(mail_mutex_);
    mail_aborted_ = true;
    mail_ready_.notify_all();
  }
  /// @brief Member `member`'s task has ended: a collective of the group can no longer
  /// complete, so the members waiting in one, or entering one, get an error saying so
  /// (pdo::mismatch_error; pdo::communication_error for this process's part of a group over
  /// several processes, which ends the job), until reopen() (messages between the others go on).
  void leave(std::size_t member) { barrier_.abort_departed(static_cast<std::uint32_t>(member)); }
  /// @brief After leave(): the collectives are usable again (call once no member is inside one).
  void reopen() { barrier_.reset(); }
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
    publish(me, call<T>("all_reduce", data.data(), data.data(), data.size(), data.size(), op));
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_same_call();
    check_equal_counts("all_reduce", &slot::in_count, me);
    const auto [lo, hi] = work_range<T>(data.size(), size(), me);
    for (std::size_t k = 0; k < size(); ++k) bufs[k] = static_cast<T*>(slots_[k].out);
    reduce_in_place<T>(std::span<T* const>(bufs, size()), lo, hi, op);
  }

  /// @brief `out` (same size on every member) = the members' `in` concatenated in
  /// member order; inputs may differ in size.
  template <class T>
  void all_gather(std::size_t me, std::span<const T> in, std::span<T> out) {
    publish(me, call<T>("all_gather", in.data(), out.data(), in.size(), out.size()));
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_same_call();
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
    publish(me, call<T>("reduce_scatter", in.data(), out.data(), in.size(), out.size(), op));
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_same_call();
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
    publish(me, call<T>("broadcast", data.data(), data.data(), data.size(), root));
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_same_call();
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
    slot s = call<T>("all_to_all", in.data(), out.data(), in.size(), out.size());
    s.send_counts = send_counts.data();
    s.recv_counts = recv_counts.data();
    s.counts_size = send_counts.size() == recv_counts.size() ? send_counts.size() : 0;
    publish(me, s);
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_same_call();
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
    std::string_view collective;  ///< what the member called
    char element_kind = 0;        ///< its element type (see collective_call_text; 0 for a barrier)
    std::size_t element_bytes = 0;
    int op = -1;  ///< its reduce_op, or -1
  };
  struct post {
    const void* data = nullptr;
    std::size_t count = 0;
    bool posted = false;
    bool done = false;
    std::string problem;
  };

  void publish(std::size_t me, const slot& s) { slots_[me] = s; }

  /// @brief `s` marked as a call of `collective` over elements of type T (reducing with `op`).
  template <class T>
  static slot call(std::string_view collective, const void* in, void* out, std::size_t in_count, std::size_t out_count, int op = -1) {
    slot s;
    s.in = in;
    s.out = out;
    s.in_count = in_count;
    s.out_count = out_count;
    s.collective = collective;
    s.element_kind = element_kind<T>();
    s.element_bytes = sizeof(T);
    s.op = op;
    return s;
  }
  template <class T>
  static slot call(std::string_view collective, const void* in, void* out, std::size_t in_count, std::size_t out_count, reduce_op op) {
    return call<T>(collective, in, out, in_count, out_count, static_cast<int>(op));
  }

  static std::string call_text(const slot& s) { return collective_call_text(s.collective, s.element_kind, s.element_bytes, s.op); }

  /// @brief An error on every member when the members called different collectives, or one
  /// over another element type or with another reduction.
  PDO_NOINLINE void check_same_call() const {
    const slot& first = slots_[0];
    for (const slot& s : slots_)
      if (s.collective != first.collective || s.element_kind != first.element_kind || s.element_bytes != first.element_bytes || s.op != first.op) {
        std::string calls;
        for (std::size_t k = 0; k < size(); ++k) calls += (k ? ", " : "") + names_[k] + " in " + call_text(slots_[k]);
        fail_after_barrier(std::string(first.collective) +
                           ": the members of the group called different collectives (" + calls +
                           "); every member of a group must call the same collectives, over the same element type, in the same order");
      }
  }

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
  char chars[N]{};  ///< the characters, then the literal's terminating NUL

  /// @brief The literal `text` (implicit, so `split<"dp">` works).
  constexpr fixed_string(const char (&text)[N]) { std::copy_n(text, N, chars); }
  /// @brief The first N - 1 characters of `text`, at compile time (a name kept as a string_view);
  /// a shorter `text` is padded with NULs.
  constexpr explicit fixed_string(std::string_view text) { std::copy_n(text.data(), std::min(text.size(), N - 1), chars); }

  /// @brief The N - 1 characters, without the terminator.
  [[nodiscard]] constexpr std::string_view view() const { return {chars, N - 1}; }
  /// @brief view(), implicitly.
  [[nodiscard]] constexpr operator std::string_view() const { return view(); }

  /// @brief Whether both hold the same characters (strings of different lengths compare unequal).
  template <std::size_t M>
  [[nodiscard]] constexpr bool operator==(const fixed_string<M>& other) const {
    return view() == other.view();
  }
};

namespace detail {
/// @brief Value `I` of a pack of values (the name of mesh axis I, say).
template <std::size_t I, auto First, auto... Rest>
constexpr auto nth_value() {
  if constexpr (I == 0) return First;
  else return nth_value<I - 1, Rest...>();
}
}  // namespace detail

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_CORE_FIXED_STRING_HPP
// ---- pdo/place/place_concept.hpp
#ifndef PDO_SINGLE_PDO_PLACE_PLACE_CONCEPT_HPP
#define PDO_SINGLE_PDO_PLACE_PLACE_CONCEPT_HPP
// pdo/place/place_concept.hpp: the `place` concept and the type-erased place handle.

// ---- pdo/place/place_state.hpp
#ifndef PDO_SINGLE_PDO_PLACE_PLACE_STATE_HPP
#define PDO_SINGLE_PDO_PLACE_PLACE_STATE_HPP
// pdo/place/place_state.hpp: what every place handle shares: identity, cores, memory, lanes.

// ---- pdo/memory/caching_allocator.hpp
#ifndef PDO_SINGLE_PDO_MEMORY_CACHING_ALLOCATOR_HPP
#define PDO_SINGLE_PDO_MEMORY_CACHING_ALLOCATOR_HPP
// pdo/memory/caching_allocator.hpp: per-place caching allocator with statistics and a cap.

// ---- pdo/core/cache_line_allocator.hpp
#ifndef PDO_SINGLE_PDO_CORE_CACHE_LINE_ALLOCATOR_HPP
#define PDO_SINGLE_PDO_CORE_CACHE_LINE_ALLOCATOR_HPP
// pdo/core/cache_line_allocator.hpp: a standard allocator that gives every allocation cache
// lines of its own, for bookkeeping that several host threads write at once.

#include <cstddef>
#include <new>

namespace pdo::detail {

/// @brief A standard allocator whose every allocation has cache lines of its own (64-byte
/// aligned, its size rounded up to whole lines): for the nodes and arrays of containers that
/// different host threads write at once, which the heap would otherwise put side by side
/// (two threads then write one line: each write makes the other's copy stale).
template <class T>
struct cache_line_allocator {
  using value_type = T;  ///< what it allocates
  cache_line_allocator() = default;
  /// @brief From the allocator of another type (containers rebind it).
  template <class U>
  cache_line_allocator(const cache_line_allocator<U>&) noexcept {}  // NOLINT: implicit, as standard allocators are
  /// @brief Room for `n` objects.
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(rounded(n), std::align_val_t{64})); }
  /// @brief Gives back what allocate(n) gave.
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{64}); }  // unsized: clang declares no sized aligned delete by default
  /// @brief Every such allocator frees what another gave.
  template <class U>
  bool operator==(const cache_line_allocator<U>&) const noexcept {
    return true;
  }

 private:
  static std::size_t rounded(std::size_t n) { return (n * sizeof(T) + 63) / 64 * 64; }
};

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_CORE_CACHE_LINE_ALLOCATOR_HPP
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
  /// @brief A new block of `bytes` bytes, or nullptr when the system refuses (it must not throw).
  void* (*allocate)(std::size_t bytes, void* context);
  /// @brief Gives back block `p`, of the `bytes` it was allocated with.
  void (*deallocate)(void* p, std::size_t bytes, void* context) noexcept;
  void* context = nullptr;  ///< what the two need besides the size (a GPU place's device and stream)
  const char* name = "host";  ///< the memory's name, for messages ("host" for host memory)
};

/// @brief Host memory, 64-byte aligned (one cache line, one AVX-512 vector).
inline memory_system host_memory_system() {
  constexpr std::align_val_t alignment{64};
  return {[](std::size_t bytes, void*) -> void* { return ::operator new(bytes, alignment, std::nothrow); },
          [](void* p, std::size_t, void*) noexcept { ::operator delete(p, alignment); }, nullptr, "host"};
}

/// @brief A thread-safe caching allocator owned by one place.
///
/// Freed blocks are kept in size classes and reused; when a request would take the
/// place over its cap, the cache is released first and, if that is not enough, the
/// request fails with pdo::out_of_memory naming the place, the request and the cap.
// Aligned, and its free lists on cache lines of their own: the places of cpu_places(n) are
// made one after the other (and a free list is made by the thread that first frees a block
// of its size), while two host threads that each drive one place allocate and free on every
// operation.
class alignas(64) caching_allocator {
 public:
  /// @brief An allocator of place `owner` (the name errors give) taking blocks from `system`; `cap`: the most
  /// bytes in use at once, counted in rounded block sizes (0: no cap).
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
    void* p = system_.allocate(block, system_.context);
    if (p == nullptr) {
      release_cache_locked();
      p = system_.allocate(block, system_.context);
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
      system_.deallocate(p, block, system_.context);
    }
  }

  /// @brief Gives every cached block back to the system.
  void release_cache() {
    std::lock_guard lock(mutex_);
    release_cache_locked();
  }

  /// @brief A snapshot of the counters: bytes in use, cached and at peak, system allocations, the cap.
  [[nodiscard]] memory_stats stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }
  /// @brief Sets the cap on bytes in use (0: none); it applies to later requests, nothing is freed.
  void set_cap(std::size_t cap) {
    std::lock_guard lock(mutex_);
    stats_.cap = cap;
  }
  /// @brief Restarts the peak from the bytes in use now.
  void reset_peak() {
    std::lock_guard lock(mutex_);
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
  }
  /// @brief The name of the place that owns this allocator, as its errors name it.
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
      for (void* p : blocks) system_.deallocate(p, block, system_.context);
    cache_.clear();
    stats_.bytes_cached = 0;
  }

  std::string owner_;
  memory_system system_;
  mutable std::mutex mutex_;
  using free_list = std::vector<void*, detail::cache_line_allocator<void*>>;
  std::map<std::size_t, free_list, std::less<>, detail::cache_line_allocator<std::pair<const std::size_t, free_list>>> cache_;
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
// ---- pdo/place/lane.hpp
#ifndef PDO_SINGLE_PDO_PLACE_LANE_HPP
#define PDO_SINGLE_PDO_PLACE_LANE_HPP
// pdo/place/lane.hpp: the lanes of a place (the threads that run its work, each in the order
// its tasks were queued) and the tasks they run. What a task waits for, and when it is
// queued, is decided by the engine (pdo/exec/engine.hpp); a lane only runs its queue.


#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

// Under CUDA every task is also an NVTX range (Nsight Systems shows them on the lane's thread).
#if defined(PDO_WITH_CUDA) && defined(__has_include)
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define PDO_NVTX 1
#endif
#endif

namespace pdo {

/// @brief The lanes of a place: what kind of work a task is. Each lane of a place runs its
/// tasks one after the other; the lanes of a place run at the same time.
enum class lane_kind : unsigned char {
  compute,        ///< kernels, on the place's cores (a GPU place: its compute stream)
  communication,  ///< collectives and transfers between places (a GPU place: its NCCL stream)
  copy,           ///< copies between memories and batch prefetch
};

inline constexpr std::size_t lane_kinds = 3;

/// @brief "compute", "communication" or "copy".
constexpr const char* lane_name(lane_kind k) {
  switch (k) {
    case lane_kind::compute: return "compute";
    case lane_kind::communication: return "communication";
    case lane_kind::copy: return "copy";
  }
  return "?";
}

namespace detail {

struct place_state;

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

/// @brief A move-only `void()` callable that keeps small callables (up to 64 bytes: what
/// pdo's operations queue) in place, so queueing work allocates nothing for it.
class task {
 public:
  task() = default;
  template <class F>
    requires(!std::is_same_v<std::decay_t<F>, task> && std::is_invocable_v<std::decay_t<F>&>)
  task(F&& f) {  // NOLINT: implicit, like std::function
    using callable = std::decay_t<F>;
    if constexpr (sizeof(callable) <= inline_bytes && alignof(callable) <= alignof(std::max_align_t) &&
                  std::is_nothrow_move_constructible_v<callable>) {
      ::new (static_cast<void*>(storage_)) callable(std::forward<F>(f));
      ops_ = &inline_ops<callable>;
    } else {
      *reinterpret_cast<callable**>(storage_) = new callable(std::forward<F>(f));
      ops_ = &heap_ops<callable>;
    }
  }
  task(task&& other) noexcept : ops_(other.ops_) {
    if (ops_ != nullptr) ops_->move(other.storage_, storage_);
    other.ops_ = nullptr;
  }
  task& operator=(task&& other) noexcept {
    if (this != &other) {
      reset();
      ops_ = other.ops_;
      if (ops_ != nullptr) ops_->move(other.storage_, storage_);
      other.ops_ = nullptr;
    }
    return *this;
  }
  task(const task&) = delete;
  task& operator=(const task&) = delete;
  ~task() { reset(); }

  void operator()() { ops_->call(storage_); }
  explicit operator bool() const { return ops_ != nullptr; }

 private:
  static constexpr std::size_t inline_bytes = 64;
  struct operations {
    void (*call)(unsigned char*);
    void (*move)(unsigned char* from, unsigned char* to) noexcept;  ///< and destroys `from`
    void (*destroy)(unsigned char*) noexcept;
  };
  template <class F>
  static constexpr operations inline_ops{
      [](unsigned char* s) { (*std::launder(reinterpret_cast<F*>(s)))(); },
      [](unsigned char* from, unsigned char* to) noexcept {
        F* f = std::launder(reinterpret_cast<F*>(from));
        ::new (static_cast<void*>(to)) F(std::move(*f));
        f->~F();
      },
      [](unsigned char* s) noexcept { std::launder(reinterpret_cast<F*>(s))->~F(); }};
  template <class F>
  static constexpr operations heap_ops{
      [](unsigned char* s) { (**reinterpret_cast<F**>(s))(); },
      [](unsigned char* from, unsigned char* to) noexcept { *reinterpret_cast<F**>(to) = *reinterpret_cast<F**>(from); },
      [](unsigned char* s) noexcept { delete *reinterpret_cast<F**>(s); }};

  void reset() noexcept {
    if (ops_ != nullptr) ops_->destroy(storage_);
    ops_ = nullptr;
  }

  alignas(std::max_align_t) unsigned char storage_[inline_bytes];
  const operations* ops_ = nullptr;
};

class lane;
struct task_state;
inline captured_error cancellation_of(const task_state& t);
using task_handle = std::shared_ptr<task_state>;

/// @brief One task: its work, its lane, what it waits for, and how it ended.
///
/// A task runs once `waiting` is 0: the engine counts one for each task it must wait for,
/// and one held until the task is fully queued. The fields under `mutex` are what a task
/// that ends changes in the tasks that wait for it.
struct task_state {
  task fn;
  lane* home = nullptr;
  const char* op = "task";       ///< what it is, for errors and the trace (a string literal)
  const char* category = "task"; ///< for the trace: "kernel", "collective", "copy", "task"
  std::string detail;            ///< shapes, layouts, bytes: filled only while tracing
  std::uint64_t id = 0;          ///< its place in the engine's order of submission, given while the timeline records (else 0)
  bool runs_cancelled = false;   ///< run fn even when cancelled (cancelled_by() tells it so)
  /// @brief Queued without waking its lane: the thread that submitted it waits for it at once,
  /// and runs it itself or wakes the lane then (place_batch::wait).
  bool quiet = false;
  bool keeps_failure = false;  ///< see task_request::keeps_failure
  std::atomic<std::uint32_t> waiting{1};
  std::atomic<bool> ended{false};

  std::mutex mutex;
  bool finished = false;  ///< ended (read under mutex while linking)
  bool failed = false;
  bool cancelled = false;  ///< a task it waited for failed; `error` is that task's error
  std::optional<captured_error> error;
  std::string cause;       ///< for a cancelled task: the task that failed ("op on place")
  struct dependent {
    task_handle task;
    bool needs_result;  ///< it reads what this task wrote: this task's failure cancels it
  };
  std::vector<dependent> dependents;
  std::vector<std::uint64_t> after;  ///< the ids of the tasks it waited for, those that have one (the trace's flow arrows)
  /// @brief While tracing, for a task queued from a lane (by the task it runs): that lane's
  /// row and when (the trace's "queued by" arrow).
  const timeline_track* queued_on = nullptr;
  timeline_clock::time_point queued_at;

  /// @brief Waits (spinning briefly, then sleeping) until the task has ended.
  void wait_ended() const {
    for (int poll = 0; poll < 200; ++poll) {
      if (ended.load(std::memory_order_acquire)) return;
      std::this_thread::yield();
    }
    while (!ended.load(std::memory_order_acquire)) ended.wait(false, std::memory_order_acquire);
  }
};

/// @brief Where the failure that a task ended with began: "op on place" of the task that
/// threw it (the task itself, or the one whose failure cancelled it).
inline std::string failure_site(const task_state& t);

/// @brief Makes `t` (being queued) wait for `before`, unless `before` has ended. With
/// `needs_result` (t reads what `before` wrote) a failure of `before` cancels `t` with its
/// error, at once if it has failed already; an order alone (t overwrites what `before` read
/// or wrote) does not. Called by the engine, in submission order.
inline void link(const task_handle& t, task_state& before, bool needs_result) {
  std::lock_guard lock(before.mutex);
  if (before.finished) {
    if (before.failed && needs_result) {
      std::lock_guard mine(t->mutex);
      if (!t->cancelled) {
        t->cancelled = true;
        t->error = before.error;
        t->cause = failure_site(before);
      }
    }
    return;
  }
  // a task that waits for `before` twice (it reads two buffers `before` wrote) is counted
  // twice and let go twice: no search of the list
  before.dependents.push_back({t, needs_result});
  t->waiting.fetch_add(1, std::memory_order_relaxed);
  // for the timeline's arrows (ids are given while it records), each task it waits for once
  if (before.id != 0 && std::find(t->after.begin(), t->after.end(), before.id) == t->after.end()) t->after.push_back(before.id);
}

/// @brief The error the running task was cancelled with (see cancellation_of), for a task
/// that runs when cancelled (task_state::runs_cancelled); null otherwise.
inline const captured_error*& cancelled_by() {
  thread_local const captured_error* e = nullptr;
  return e;
}

/// @brief The lane whose thread is the calling thread, or null.
inline lane*& current_lane() {
  thread_local lane* l = nullptr;
  return l;
}

/// @brief The place whose lane runs the calling thread, or nullptr on other threads.
inline place_state*& current_place() {
  thread_local place_state* current = nullptr;
  return current;
}

/// @brief One lane of a place: a thread that runs its queue in order, each task once the
/// tasks it waits for have ended. After its last task the thread keeps looking for work
/// for a few microseconds (yielding its core) before it sleeps, so a program that issues
/// short operations one after another does not pay a wake-up for each.
class alignas(64) lane {
 public:
  /// @param setup runs first on the lane's thread (a GPU place selects its device)
  /// @param runs_anywhere its tasks may run on any host thread (a CPU place's: see run_here)
  template <class Setup>
  lane(place_state& p, std::string place_name, lane_kind k, std::vector<int> pin_to, Setup setup, bool runs_anywhere = false)
      : place_(p), name_(std::move(place_name)), kind_(k), track_{name_, lane_name(k)}, runs_anywhere_(runs_anywhere) {
    thread_ = std::thread([this, pins = std::move(pin_to), setup = std::move(setup)]() mutable {
      pin_current_thread(pins);
      current_place() = &place_;
      current_lane() = this;
      current_track() = &track_;
      setup();
      loop();
    });
  }
  lane(const lane&) = delete;
  lane& operator=(const lane&) = delete;
  ~lane() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
      signal_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    thread_.join();
  }

  [[nodiscard]] place_state& place() const { return place_; }
  [[nodiscard]] const std::string& place_name() const { return name_; }
  [[nodiscard]] lane_kind kind() const { return kind_; }
  /// @brief Whether the calling thread runs this lane's work now: its own thread, or a host
  /// thread running one of its tasks (run_here).
  [[nodiscard]] bool on_this_thread() const { return current_lane() == this; }

  /// @brief Queues `t` behind the lane's earlier tasks.
  void push(task_handle t) {
    bool asleep = false;
    {
      std::lock_guard lock(mutex_);
      asleep = append(std::move(t));
    }
    if (asleep) wake_.notify_one();
  }

  /// @brief Queues `tasks` (of one operation, on their own lanes) at one instant: every lane
  /// involved is locked while they are queued, so no task queued by another thread comes
  /// between them on one lane and not on another.
  static void push_together(const std::vector<task_handle>& tasks) {
    if (tasks.size() == 1) {
      tasks.front()->home->push(tasks.front());
      return;
    }
    // the distinct lanes in address order (a mesh has few places: no allocation up to 16)
    std::array<lane*, 16> small{};
    std::vector<lane*> large;
    std::span<lane*> lanes;
    if (tasks.size() <= small.size()) {
      lanes = std::span(small.data(), tasks.size());
    } else {
      large.resize(tasks.size());
      lanes = large;
    }
    std::size_t distinct = 0;
    for (const auto& t : tasks) {  // insertion into the sorted distinct lanes (a mesh has few places)
      lane* l = t->home;
      std::size_t at = 0;
      while (at < distinct && std::less<>{}(lanes[at], l)) ++at;
      if (at < distinct && lanes[at] == l) continue;
      for (std::size_t j = distinct; j > at; --j) lanes[j] = lanes[j - 1];
      lanes[at] = l;
      ++distinct;
    }
    lanes = lanes.first(distinct);
    std::uint64_t asleep = 0;  // one bit per lane, for the first 64 (the others are woken whatever)
    for (lane* l : lanes) l->mutex_.lock();  // in address order: whoever else locks two of them does too
    for (const auto& t : tasks) {
      lane* home = t->home;
      std::size_t at = 0;
      while (lanes[at] != home) ++at;
      const bool wake = home->append(t);
      if (wake && at < 64) asleep |= std::uint64_t{1} << at;
    }
    for (lane* l : lanes) l->mutex_.unlock();
    for (std::size_t i = 0; i < lanes.size(); ++i)
      if (i >= 64 || (asleep >> i & 1) != 0) lanes[i]->wake_.notify_one();
  }

  /// @brief Runs `t` on the calling thread, as this lane would, when `t` is the lane's next
  /// task, is ready, and the lane is between tasks; returns whether it did. A host thread that
  /// waits for its own task runs it rather than hand it over and wait for the lane to wake
  /// (the order of the lane's tasks, and what each waits for, are kept). Only for lanes whose
  /// tasks may run on any thread (a CPU place's: a GPU place's lanes hold its device).
  bool run_here(const task_state& t) {
    if (!runs_anywhere_ || current_lane() != nullptr) return false;
    task_handle next;
    {
      std::lock_guard lock(mutex_);
      if (busy_ || !head_ready() || queue_.front().get() != &t) return false;
      next = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    {
      // the task sees this lane as its place and lane, as on the lane's own thread
      struct as_lane {
        lane& l;
        place_state* place = current_place();
        const timeline_track* track = current_track();
        explicit as_lane(lane& self) : l(self) {
          current_place() = &l.place_;
          current_lane() = &l;
          current_track() = &l.track_;
        }
        ~as_lane() {
          current_place() = place;
          current_lane() = nullptr;
          current_track() = track;
        }
      } guard(*this);
      run(next);
    }
    // the lane is woken only when it has a task to run: one queued behind this one that is
    // ready now (the lane passed over it while this one ran). Waking it for nothing would set
    // its thread polling for work beside the host threads (the cost of short operations from
    // several host threads at once); a task that becomes ready later pokes it then.
    bool asleep = false;
    {
      std::lock_guard lock(mutex_);
      busy_ = false;
      if (head_ready()) {
        signal_.fetch_add(1, std::memory_order_release);
        asleep = sleeping_;
      }
    }
    if (asleep) wake_.notify_one();
    return true;
  }

  /// @brief Wakes the lane: a task it holds may have become ready.
  void poke() {
    bool asleep = false;
    {
      std::lock_guard lock(mutex_);
      signal_.fetch_add(1, std::memory_order_release);
      asleep = sleeping_;
    }
    if (asleep) wake_.notify_one();
  }

 private:
  static constexpr int idle_polls = 200;

  /// @brief Appends `t` to the queue (under the lock); returns whether the thread sleeps and must be woken.
  bool append(task_handle t) {
    const bool quiet = t->quiet && runs_anywhere_;
    queue_.push_back(std::move(t));
    if (quiet) return false;
    signal_.fetch_add(1, std::memory_order_release);
    return sleeping_;
  }

  [[nodiscard]] bool head_ready() const { return !queue_.empty() && queue_.front()->waiting.load(std::memory_order_acquire) == 0; }

  void loop() {
    for (;;) {
      task_handle next;
      std::uint64_t seen = 0;
      {
        std::lock_guard lock(mutex_);
        seen = signal_.load(std::memory_order_acquire);
        if (!busy_ && head_ready()) {
          next = std::move(queue_.front());
          queue_.pop_front();
          busy_ = true;
        } else if (stop_ && queue_.empty() && !busy_) {
          return;  // a stopping lane first runs what is queued on it
        }
      }
      if (next) {
        run(next);
        std::lock_guard lock(mutex_);
        busy_ = false;
        continue;
      }
      // nothing to run: look for a change without the lock for a while (yielding the core),
      // then sleep until a push or a poke
      // (yielding, not pausing: the host thread that queues the work may need this core)
      for (int poll = 0; poll < idle_polls && signal_.load(std::memory_order_acquire) == seen; ++poll) std::this_thread::yield();
      std::unique_lock lock(mutex_);
      sleeping_ = true;
      wake_.wait(lock, [&] { return signal_.load(std::memory_order_acquire) != seen || stop_; });
      sleeping_ = false;
    }
  }

  void run(const task_handle& t) {
    bool cancelled = false;
    {
      std::lock_guard lock(t->mutex);
      cancelled = t->cancelled;
    }
    const bool traced = timeline_on();
    const timeline_clock::time_point start = traced ? timeline_clock::now() : timeline_clock::time_point{};
#if defined(PDO_NVTX)
    nvtxRangePushA(t->op);
#endif
    std::optional<captured_error> failure;
    if (cancelled && !t->runs_cancelled) {
      failure = t->error;
    } else {
      std::optional<captured_error> cause;
      if (cancelled) cause = cancellation_of(*t);
      cancelled_by() = cause ? &*cause : nullptr;
      const bool outer_untraced = in_untraced_task();
      in_untraced_task() = !traced;
      try {
        t->fn();
      } catch (...) {
        if (!cancelled) failure = captured_error::current();
      }
      in_untraced_task() = outer_untraced;
      cancelled_by() = nullptr;
      if (cancelled) failure = t->error;
    }
#if defined(PDO_NVTX)
    nvtxRangePop();
#endif
    if (traced) {
      if (timeline_sink* sink = timeline().load(std::memory_order_acquire); sink != nullptr) {
        timeline_event e;
        e.category = t->category;
        e.name = t->op;
        e.detail = cancelled ? "cancelled: " + t->cause + " failed" : failure ? "failed: " + failure->message : t->detail;
        e.track = &track_;
        e.start = start;
        e.end = timeline_clock::now();
        e.id = t->id;
        e.after = t->after;
        e.queued_on = t->queued_on;
        e.queued_at = t->queued_at;
        sink->record(std::move(e));
      }
    }
    finish(*t, std::move(failure), cancelled);
  }

  /// @brief Marks `t` ended, lets the tasks that wait for it go (cancelled, if it failed).
  static void finish(task_state& t, std::optional<captured_error> failure, bool was_cancelled) {
    std::vector<task_state::dependent> dependents;
    {
      std::lock_guard lock(t.mutex);
      t.finished = true;
      t.failed = failure.has_value();
      if (failure && !was_cancelled) t.error = std::move(failure);
      dependents.swap(t.dependents);
    }
    for (const auto& [d, needs_result] : dependents) {
      if (t.failed && needs_result) {
        std::lock_guard lock(d->mutex);
        if (!d->cancelled) {
          d->cancelled = true;
          d->error = t.error;
          d->cause = failure_site(t);
        }
      }
      if (d->waiting.fetch_sub(1, std::memory_order_acq_rel) == 1) d->home->poke();
    }
    t.fn = task();  // what it captured goes now, not with the last handle
    t.ended.store(true, std::memory_order_release);
    t.ended.notify_all();
  }

  place_state& place_;
  std::string name_;
  lane_kind kind_;
  timeline_track track_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<task_handle> queue_;
  std::atomic<std::uint64_t> signal_{0};  ///< counts pushes and pokes: a change may have made the head ready
  bool sleeping_ = false;
  bool stop_ = false;
  bool busy_ = false;  ///< a task of the lane runs now (on its thread, or on a host thread: run_here)
  bool runs_anywhere_ = false;
  std::thread thread_;
};

inline std::string failure_site(const task_state& t) {
  if (!t.cause.empty()) return t.cause;
  return std::string(t.op) + " on " + t.home->place_name() + "'s " + lane_name(t.home->kind()) + " lane";
}

/// @brief The error a cancelled task ends with: the error of the task that failed, its
/// message saying where that failure began.
inline captured_error cancellation_of(const task_state& t) {
  captured_error e = *t.error;
  e.message = "cancelled: it needs the result of " + t.cause + ", which failed: " + e.message;
  return e;
}

}  // namespace detail
}  // namespace pdo
#endif  // PDO_SINGLE_PDO_PLACE_LANE_HPP

#include <array>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace pdo {

/// @brief The kind of device a place is.
enum class place_kind { cpu, cuda };

namespace detail {

// Aligned to a cache line, as mesh_state: the places of cpu_places(n) are made one after the
// other, and every tensor's copy of a place handle writes its reference counts.
/// @brief The state behind a place handle. A place of another process (an MPI rank)
/// has no lanes and no allocator here: only its identity.
struct alignas(64) place_state : std::enable_shared_from_this<place_state> {
  place_kind kind = place_kind::cpu;
  int ordinal = 0;          ///< index among the places of its kind in its process (or device ordinal)
  int process = 0;          ///< the MPI rank that owns it (0 in a single process)
  bool local = true;        ///< owned by this process
  std::vector<int> cores;   ///< the cores its work may use
  std::string name;         ///< "cpu:0", "cuda:1", "rank1/cpu:0"
  std::shared_ptr<void> device;  ///< a GPU place's streams and library handles (detail::cuda_device)
  std::unique_ptr<caching_allocator> memory;  ///< declared after `device`: destroyed before it
  std::function<void()> lane_setup;  ///< runs first on each lane's thread (a GPU place selects its device)
  std::vector<int> pin;              ///< the cores its compute lane is pinned to (empty: not pinned)
  std::mutex lanes_mutex;
  /// @brief Its lanes, by lane_kind: the compute lane from the start, the others made on
  /// first use. Declared last: destroyed first, before the memory their work uses.
  std::array<std::unique_ptr<lane>, lane_kinds> lanes;

  place_state(place_kind k, int ord, int proc, bool is_local, std::vector<int> cpu_cores, std::string label)
      : kind(k), ordinal(ord), process(proc), local(is_local), cores(std::move(cpu_cores)), name(std::move(label)) {}
};

/// @brief Place `p`'s lane of kind `k`, made on first use. Only places of this process have lanes.
inline lane& lane_of(place_state& p, lane_kind k = lane_kind::compute) {
  const auto i = static_cast<std::size_t>(k);
  std::lock_guard lock(p.lanes_mutex);
  if (!p.lanes[i]) {
    if (!p.local) throw layout_error("place " + p.name + " belongs to another process; its work runs there");
    std::function<void()> setup = p.lane_setup ? p.lane_setup : [] {};
    // the compute lane runs on the place's cores; the others only move data, wherever the system puts them
    // a CPU place's tasks may run on a host thread that waits for them (lane::run_here)
    p.lanes[i] = std::make_unique<lane>(p, p.name, k, k == lane_kind::compute ? p.pin : std::vector<int>{}, std::move(setup),
                                        p.kind == place_kind::cpu);
  }
  return *p.lanes[i];
}

/// @brief Starts `state`'s compute lane, pinned to `pin_to`; `setup` runs first on each of its lanes.
inline void start_lanes(place_state& state, std::vector<int> pin_to, std::function<void()> setup = {}) {
  state.pin = std::move(pin_to);
  state.lane_setup = std::move(setup);
  lane_of(state, lane_kind::compute);
}

/// @brief Queues `fn` on `p`'s lane `k`, behind the work queued there before, and returns
/// its task (waiting for nothing else: the engine's ordering by buffers is not involved).
inline task_handle queue_on_lane(place_state& p, task fn, const char* op, lane_kind k = lane_kind::compute) {
  lane& l = lane_of(p, k);
  auto t = std::make_shared<task_state>();
  t->fn = std::move(fn);
  t->home = &l;
  t->op = op;
  t->waiting.store(0, std::memory_order_relaxed);  // it waits for nothing: runs after the lane's earlier tasks
  l.push(t);
  return t;
}

/// @brief Whether a tensor of place `p` (null: the host) lives in a GPU's memory.
inline bool on_gpu(const place_state* p) { return p != nullptr && p->kind == place_kind::cuda; }

/// @brief The memory a tensor of place `p` lives in: its GPU's (that place), or host memory
/// (null), which the host and every CPU place share.
inline place_state* memory_of(place_state* p) { return on_gpu(p) ? p : nullptr; }

/// @brief Runs `call(context)` on `p`'s compute lane, the calling thread waiting; a failure
/// is thrown again here, with its pdo::error subclass and message.
PDO_NOINLINE inline void run_waiting(place_state& p, void (*call)(void*), void* context) {
  std::optional<captured_error> failure;
  const task_handle t = queue_on_lane(p, [&] {
    try {
      call(context);
    } catch (...) {
      failure = captured_error::current();
    }
  }, "run_on_place");
  t->wait_ended();
  if (failure) failure->rethrow_with_context("");
}

/// @brief Runs `f` on `p`'s compute lane and returns what it returns, the calling thread
/// waiting (on one of p's lanes already: at once, there). A failure is thrown again here,
/// with its pdo::error subclass and message.
template <class F>
auto run_on_place(place_state& p, F&& f) -> decltype(f()) {
  using result_t = decltype(f());
  if (current_place() == &p) return f();
  if constexpr (std::is_void_v<result_t>) {
    run_waiting(p, [](void* c) { (*static_cast<std::remove_reference_t<F>*>(c))(); }, const_cast<void*>(static_cast<const void*>(&f)));
  } else {
    std::optional<result_t> result;
    auto body = [&] { result.emplace(f()); };
    run_waiting(p, [](void* c) { (*static_cast<decltype(body)*>(c))(); }, &body);
    return std::move(*result);
  }
}

}  // namespace detail
}  // namespace pdo
#endif  // PDO_SINGLE_PDO_PLACE_PLACE_STATE_HPP

#include <concepts>
#include <memory>
#include <string>
#include <utility>

namespace pdo {

/// @brief A place: one device that owns memory and runs work (CPU cores, a GPU).
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
  /// @brief Runs `task` on the place's compute lane, after the work queued there before it;
  /// returns at once. What it throws is dropped: report failures through what it writes.
  template <class Task>
  void submit(Task&& task) const {
    if (!state_->local) throw layout_error("submit: place " + state_->name + " belongs to another process");
    detail::queue_on_lane(*state_, detail::task(std::forward<Task>(task)), "submit");
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
  /// @brief The place `p`, of any kind (implicit: a place is an any_place); copies share its state.
  template <place P>
    requires(!std::same_as<P, any_place>)
  any_place(const P& p) : place_handle(p.state()) {}  // NOLINT: implicit, a place is an any_place
  /// @brief A handle on the place whose state is `s`.
  explicit any_place(std::shared_ptr<detail::place_state> s) : place_handle(std::move(s)) {}
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_PLACE_PLACE_CONCEPT_HPP

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace pdo {

namespace detail {

struct mesh_comms;  // the mesh's communicators, built by the comm layer on first use

}  // namespace detail

/// @brief How a mesh runs its collectives.
struct mesh_options {
  /// @brief How long a collective over places of several processes waits for the others
  /// before it gives up with pdo::collective_timeout (naming the ranks that did not arrive).
  /// Zero: $PDO_COLLECTIVE_TIMEOUT seconds if set, else 30 minutes.
  std::chrono::duration<double> collective_timeout{0};
};

namespace detail {

// Aligned to a cache line: with make_shared the reference counts of one mesh's state would
// otherwise share a line with the fields of the state made just before it, so that two host
// threads driving two meshes write each other's lines on every operation.
/// @brief What all copies of one mesh share.
struct alignas(64) mesh_state {
  mesh_options options;
  std::vector<std::string> axes;
  std::vector<std::size_t> extents;
  std::vector<any_place> places;      ///< row-major over the axes: the last axis varies fastest
  std::vector<std::size_t> local;     ///< indices of the places of this process
  bool multiprocess = false;          ///< the places belong to more than one process
  std::once_flag comms_once;
  std::shared_ptr<mesh_comms> comms;
};

/// @brief How the processes of a mesh over several of them check, when it is made, that they
/// all made the same mesh: set by the backend that makes places of other processes
/// (pdo::mpi::world_places), called by make_mesh.
using mesh_agreement = void (*)(const mesh_state&, const std::string& description);
inline mesh_agreement& multiprocess_agreement() {
  static mesh_agreement check = nullptr;
  return check;
}


/// @brief "mesh(dp=2, tp=2)".
PDO_NOINLINE inline std::string describe_mesh(const mesh_state& m) {
  std::string text = "mesh(";
  for (std::size_t a = 0; a < m.axes.size(); ++a) text += (a ? ", " : "") + m.axes[a] + "=" + std::to_string(m.extents[a]);
  return text + ")";
}

/// @brief The coordinate along `axis` of place `index` of a grid of `extents` (row-major:
/// the last axis varies fastest); both in range.
inline std::size_t grid_coord(const std::vector<std::size_t>& extents, std::size_t index, std::size_t axis) {
  for (std::size_t a = extents.size(); a-- > axis + 1;) index /= extents[a];
  return index % extents[axis];
}

/// @brief The places of a grid of `extents` that differ from place `index` only along
/// `axis`, in coordinate order; both in range.
inline std::vector<std::size_t> grid_group(const std::vector<std::size_t>& extents, std::size_t axis, std::size_t index) {
  std::size_t stride = 1;  // between places that differ by one along `axis`
  for (std::size_t a = axis + 1; a < extents.size(); ++a) stride *= extents[a];
  const std::size_t first = index - grid_coord(extents, index, axis) * stride;
  std::vector<std::size_t> members(extents[axis]);
  for (std::size_t k = 0; k < members.size(); ++k) members[k] = first + k * stride;
  return members;
}

/// @brief Checks the places of a mesh being made, `name` (none twice, ordered by process),
/// and notes which belong to this process.
inline void take_places(mesh_state& state, const std::string& name) {
  for (const auto [i, p] : views::enumerate(state.places)) {
    const auto before = std::span(state.places).first(static_cast<std::size_t>(i));
    if (std::ranges::find(before, p) != before.end()) throw layout_error("make_mesh: place " + p.name() + " appears twice in " + name);
    if (i > 0 && p.process() < state.places[i - 1].process())
      throw layout_error("make_mesh: places must be ordered by process (" + p.name() + " comes after " + state.places[i - 1].name() + ")");
    if (p.is_local()) state.local.push_back(static_cast<std::size_t>(i));
  }
  // the same answer on every process (each takes part in the mesh's agreement and
  // communicators by it): a mesh whose places all live in one other process is not one
  state.multiprocess = !state.places.empty() && state.places.front().process() != state.places.back().process();
}

/// @brief The checks and agreement of make_mesh, once its state holds the axes, extents and places.
PDO_NOINLINE inline void finish_mesh(mesh_state& state) {
  const std::string name = describe_mesh(state);
  std::size_t product = 1;
  for (auto e : state.extents) product *= e;
  if (product != state.places.size() || product == 0)
    throw layout_error("make_mesh: extents " + format_extents(state.extents) + " of " + name +
                       " hold " + std::to_string(product) + " places but " + std::to_string(state.places.size()) +
                       " were given; make the product of the extents equal the number of places");
  take_places(state, name);
  if (state.multiprocess) {
    if (multiprocess_agreement() == nullptr)
      throw layout_error("make_mesh: " + name + " has places of other processes but no backend joins them");
    // the places each process holds, in order: "rank 0: cpu, cpu; rank 1: cpu, cpu"
    std::string holdings;
    for (std::size_t i = 0; i < state.places.size(); ++i) {
      const auto& p = state.places[i];
      const bool first = i == 0 || state.places[i - 1].process() != p.process();
      holdings += std::string(first ? (i == 0 ? "" : "; ") + ("rank " + std::to_string(p.process()) + ": ") : ", ") +
                  (p.kind() == place_kind::cuda ? "gpu" : "cpu");
    }
    multiprocess_agreement()(state, name + " over places (" + holdings + ")");
  }
}

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
  /// @brief Marks this class as a mesh (see pdo::mesh_type).
  using mesh_tag = void;
  /// @brief The number of axes.
  static constexpr std::size_t ndim = sizeof...(Axes);
  /// @brief The axis names, in order.
  static constexpr std::array<std::string_view, ndim> axis_names{Axes.view()...};
  /// @brief The name of axis `I` as a pdo::fixed_string (to spell layouts of this mesh).
  template <std::size_t I>
  static constexpr auto axis_string = detail::nth_value<I, Axes...>();

  /// @brief The position of axis `name`, or ndim when the mesh has no such axis.
  static constexpr std::size_t axis_index(std::string_view name) {
    for (std::size_t i = 0; i < ndim; ++i)
      if (axis_names[i] == name) return i;
    return ndim;
  }
  /// @brief Whether the mesh has an axis named `name`.
  static constexpr bool has_axis(std::string_view name) { return axis_index(name) < ndim; }

  /// @brief A handle on `state`, shared with the other copies (pdo::make_mesh builds and checks it: use that).
  explicit mesh(std::shared_ptr<detail::mesh_state> state) : state_(std::move(state)) {}

  /// @brief The number of places, of every process: the product of the extents.
  [[nodiscard]] std::size_t size() const { return state_->places.size(); }
  /// @brief The number of places along axis number `axis`; pdo::layout_error when axis >= ndim.
  [[nodiscard]] std::size_t extent(std::size_t axis) const {
    check_axis(axis, "extent");
    return state_->extents[axis];
  }
  /// @brief The number of places along the axis named `axis`; pdo::layout_error if there is none.
  [[nodiscard]] std::size_t extent(std::string_view axis) const { return extent(checked_axis(axis)); }
  /// @brief The extents, one per axis, in axis order.
  [[nodiscard]] const std::vector<std::size_t>& extents() const { return state_->extents; }
  /// @brief Place `index` (row-major over the axes); pdo::layout_error when index >= size().
  [[nodiscard]] const any_place& place(std::size_t index) const {
    if (index >= size())
      throw layout_error(describe() + " has " + std::to_string(size()) + " places; there is no place " + std::to_string(index));
    return state_->places[index];
  }
  /// @brief Every place, row-major over the axes (the last axis varies fastest).
  [[nodiscard]] const std::vector<any_place>& places() const { return state_->places; }
  /// @brief Indices of the places that belong to this process.
  [[nodiscard]] const std::vector<std::size_t>& local_places() const { return state_->local; }
  /// @brief Whether the places belong to more than one process (the same answer on every
  /// process: a mesh whose places all live in one process is not, seen from any process).
  [[nodiscard]] bool is_multiprocess() const { return state_->multiprocess; }

  /// @brief The coordinates of place `index` (row-major: the last axis varies fastest);
  /// pdo::layout_error when index >= size().
  [[nodiscard]] std::array<std::size_t, ndim> coords(std::size_t index) const {
    check_place(index, "coords");
    std::array<std::size_t, ndim> c{};
    for (std::size_t a = ndim; a-- > 0;) {
      c[a] = index % state_->extents[a];
      index /= state_->extents[a];
    }
    return c;
  }
  /// @brief The coordinate of place `index` along axis number `axis` (both checked, as by coords() and extent()).
  [[nodiscard]] std::size_t coord(std::size_t index, std::size_t axis) const {
    check_axis(axis, "coord");
    check_place(index, "coord");
    return detail::grid_coord(state_->extents, index, axis);
  }
  /// @brief The index of the place at coordinates `c` (row-major; the inverse of coords());
  /// pdo::layout_error when a coordinate is not below its axis's extent.
  [[nodiscard]] std::size_t index(const std::array<std::size_t, ndim>& c) const {
    std::size_t i = 0;
    for (std::size_t a = 0; a < ndim; ++a) {
      if (c[a] >= state_->extents[a])
        throw layout_error(describe() + ": index: coordinate " + std::to_string(c[a]) + " along \"" + std::string(axis_names[a]) +
                           "\" is outside its extent " + std::to_string(state_->extents[a]));
      i = i * state_->extents[a] + c[a];
    }
    return i;
  }

  /// @brief The places that differ from place `index` only along `axis`, in
  /// coordinate order: the group a collective along that axis runs over.
  [[nodiscard]] std::vector<std::size_t> group(std::size_t axis, std::size_t index) const {
    check_axis(axis, "group");
    check_place(index, "group");
    return detail::grid_group(state_->extents, axis, index);
  }


  /// @brief "mesh(dp=2, tp=2)".
  [[nodiscard]] std::string describe() const { return detail::describe_mesh(*state_); }

  /// @brief pdo::layout_error naming `op` and this mesh unless `index` is one of its places.
  void check_place(std::size_t index, std::string_view op) const {
    if (index >= size())
      throw layout_error(describe() + ": " + std::string(op) + ": there is no place " + std::to_string(index) + " (it has " +
                         std::to_string(size()) + ")");
  }
  /// @brief pdo::layout_error naming `op` and this mesh unless `axis` is one of its axis numbers.
  void check_axis(std::size_t axis, std::string_view op) const {
    if (axis >= ndim)
      throw layout_error(describe() + ": " + std::string(op) + ": there is no axis number " + std::to_string(axis) + " (it has " +
                         std::to_string(ndim) + (ndim == 1 ? " axis)" : " axes)"));
  }

  /// @brief The state all copies of this mesh share (places, extents, communicators).
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
/// must be made by every process, with the same arguments, in the same order: the
/// processes check that they agree (axes, extents, places per process) and throw
/// pdo::mismatch_error on every process, naming each one's mesh, when they do not.
template <fixed_string... Axes, std::ranges::input_range Places, std::size_t N>
  requires place<std::ranges::range_value_t<Places>>
mesh<Axes...> make_mesh(const Places& places, const std::size_t (&extents)[N], const mesh_options& options = {}) {
  static_assert(N == sizeof...(Axes), "pdo: make_mesh: give exactly one extent per mesh axis");
  auto state = std::make_shared<detail::mesh_state>();
  state->options = options;
  state->axes = {std::string(Axes.view())...};
  state->extents.assign(extents, extents + N);
  for (const auto& p : places) state->places.emplace_back(p);
  detail::finish_mesh(*state);
  return mesh<Axes...>(state);
}

/// @brief A one-axis mesh over all of `places`.
template <fixed_string Axis, std::ranges::input_range Places>
  requires place<std::ranges::range_value_t<Places>>
mesh<Axis> make_mesh(const Places& places, const mesh_options& options = {}) {
  const std::size_t n = static_cast<std::size_t>(std::ranges::distance(places));
  return make_mesh<Axis>(places, {n}, options);
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
#include <type_traits>

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

/// @brief MPI's user function for max (Max) or min over floating-point elements: NaN
/// wins wherever it sits (MPI_MAX's result depends on which rank holds the NaN).
template <bool Max>
void nan_extremum(void* in, void* inout, int* length, MPI_Datatype* type) {
  auto run = [&](auto* a) {
    using T = std::remove_pointer_t<decltype(a)>;
    const T* b = static_cast<const T*>(in);
    for (int i = 0; i < *length; ++i) a[i] = Max ? pdo::detail::nan_max(b[i], a[i]) : pdo::detail::nan_min(b[i], a[i]);
  };
  if (*type == MPI_FLOAT) run(static_cast<float*>(inout));
  else if (*type == MPI_DOUBLE) run(static_cast<double*>(inout));
  else run(static_cast<long double*>(inout));
}

/// @brief The MPI_Op of nan_extremum<Max>, made on first use (after MPI started); MPI_Finalize
/// releases it.
template <bool Max>
MPI_Op nan_extremum_op() {
  static const MPI_Op made = [] {
    MPI_Op o = MPI_OP_NULL;
    check(MPI_Op_create(&nan_extremum<Max>, /*commute=*/1, &o), "MPI_Op_create");
    return o;
  }();
  return made;
}

/// @brief The MPI reduction of `o` over elements of type T.
template <class T>
MPI_Op op(reduce_op o) {
  switch (o) {
    case reduce_op::sum: return MPI_SUM;
    case reduce_op::max: return std::floating_point<T> ? nan_extremum_op<true>() : MPI_MAX;
    case reduce_op::min: return std::floating_point<T> ? nan_extremum_op<false>() : MPI_MIN;
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
// ---- pdo/comm/mpi/watch.hpp
#ifndef PDO_SINGLE_PDO_COMM_MPI_WATCH_HPP
#define PDO_SINGLE_PDO_COMM_MPI_WATCH_HPP
// pdo/comm/mpi/watch.hpp: waits on MPI with a timeout, and what a waiting process tells the
// others, so that a collective that times out names the processes that did not arrive.
//
// Every wait of the MPI backend that depends on other processes arriving (the agreement step
// that opens each collective, barriers, point-to-point transfers, the agreement on a mesh)
// polls its request here. While it polls, it answers the other processes' questions: "where
// are you waiting?". A wait that runs past the timeout asks every other member of its group
// that question, names those that are not in the same collective (and where they are, if
// they answered), tells the members that did arrive that it gave up, and throws
// pdo::collective_timeout. A wait that lasts more than a moment asks once early, so that a
// process ended by its launcher (a peer died) can say on its way out who had not arrived.


#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

namespace pdo::mpi::detail {

using watch_clock = std::chrono::steady_clock;

/// @brief The timeout of a collective when its mesh sets none: $PDO_COLLECTIVE_TIMEOUT
/// seconds, else 30 minutes (PyTorch's process-group default).
inline std::chrono::duration<double> default_collective_timeout() {
  if (const char* text = std::getenv("PDO_COLLECTIVE_TIMEOUT"); text != nullptr && *text != '\0') {
    char* end = nullptr;
    const double seconds = std::strtod(text, &end);
    if (end == text || *end != '\0' || !(seconds > 0))
      throw communication_error(std::string("mpi: PDO_COLLECTIVE_TIMEOUT is \"") + text + "\"; give a positive number of seconds");
    return std::chrono::duration<double>(seconds);
  }
  return std::chrono::minutes(30);
}

/// @brief What a process waits in: a collective of a group (its id is the same on every
/// process, `seq` counts the group's collectives), or a transfer (seq 0), and how to name it.
struct wait_label {
  std::uint64_t group = 0;
  std::uint64_t seq = 0;
  std::string what;  ///< "all_reduce over axis \"dp\" of mesh(dp=4)"
};

/// @brief The waits of this process, and the conversation with the other processes about them.
class watch {
 public:
  static watch& instance() {
    static watch* w = new watch();  // never destroyed: waits may run while the program exits
    return *w;
  }

  /// @brief Makes the communicators the conversation and the mesh agreements travel on.
  /// Collective over MPI_COMM_WORLD: every process calls it at the same point of the program
  /// (pdo::mpi::world_places does), the first time only.
  void start() {
    std::call_once(started_, [this] {
      check(MPI_Comm_dup(MPI_COMM_WORLD, &talk_), "MPI_Comm_dup");
      check(MPI_Comm_dup(MPI_COMM_WORLD, &agree_), "MPI_Comm_dup");
      MPI_Comm_rank(MPI_COMM_WORLD, &me_);
      install_signal_note();
    });
  }
  [[nodiscard]] MPI_Comm agreement_comm() const { return agree_; }
  [[nodiscard]] int rank() const { return me_; }
  /// @brief The label of the next step every process takes together on the agreement
  /// communicator (group 0: the steps are numbered alike on every process).
  wait_label next_agreement(std::string what) { return {0, ++agreements_, std::move(what)}; }
  /// @brief Every process but this one, by world rank.
  [[nodiscard]] std::vector<int> others() const {
    int n = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    std::vector<int> peers;
    for (int r = 0; r < n; ++r)
      if (r != me_) peers.push_back(r);
    return peers;
  }

  /// @brief Waits, watched, until every process reaches this point (an MPI_Ibarrier on the
  /// agreement communicator): what precedes MPI calls that would block for a missing process
  /// without a timeout (making communicators).
  void meet_all(const std::string& what, std::chrono::duration<double> timeout) {
    MPI_Request request = MPI_REQUEST_NULL;
    check(MPI_Ibarrier(agree_, &request), "MPI_Ibarrier");
    wait(
        [&] {
          int done = 0;
          check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
          return done != 0;
        },
        next_agreement(what), others(), timeout, true);
  }

  /// @brief Polls `done()` (an MPI_Test, an MPI_Improbe) until it returns true. Past
  /// `timeout`, or when a member of `peers` (world ranks) says it gave up on the same
  /// collective, throws pdo::collective_timeout naming `label` and the peers that did not
  /// arrive; with `can_go_on` false (the request would read a buffer the caller frees) it
  /// prints that message and ends the job instead.
  template <class Done>
  void wait(Done&& done, const wait_label& label, const std::vector<int>& peers, std::chrono::duration<double> timeout,
            bool can_go_on) {
    active_wait w{&label, false, {}};
    enlist(&w);
    struct leave {
      watch* self;
      active_wait* w;
      ~leave() { self->delist(w); }
    } guard{this, &w};
    const auto start = watch_clock::now(), deadline = start + std::chrono::duration_cast<watch_clock::duration>(timeout);
    // how long a round waits for answers: the last one, which decides, up to 2 s; the others 0.2 s
    const auto grace = std::chrono::duration_cast<watch_clock::duration>(
        std::clamp(timeout / 4, std::chrono::duration<double>(0.2), std::chrono::duration<double>(2.0)));
    const auto early_grace = std::chrono::duration_cast<watch_clock::duration>(std::chrono::duration<double>(0.2));
    const auto period = std::chrono::duration_cast<watch_clock::duration>(
        std::max(timeout / 8, std::chrono::duration<double>(2.0)));
    auto next_round = start + std::chrono::milliseconds(100);
    round r;
    bool final_round = false;
    for (std::size_t spins = 0;; ++spins) {
      serve();
      if (w.given_up) fail(w.give_up_text, can_go_on);
      if (done()) {
        serve();  // a peer may have given up on this collective before it could complete here
        if (w.given_up) fail(w.give_up_text, can_go_on);
        return;
      }
      const auto now = watch_clock::now();
      if (r.open) {
        const std::size_t before = r.answered;
        collect(r, label, peers);
        if (r.answered != before) note_status(label, r, peers, now - start);
        if (r.answered == peers.size() || now >= r.ends) {
          r.open = false;
          note_status(label, r, peers, now - start);
          if (final_round) give_up(label, r, peers, now - start, can_go_on);
        }
      } else if (now >= deadline) {
        final_round = true;
        ask(r, label, peers, now + grace);
      } else if (now >= next_round) {
        ask(r, label, peers, now + early_grace);
        note_status(label, r, peers, now - start);
        next_round = now + period;
      }
      back_off(spins, now - start);
    }
  }

 private:
  static constexpr int tag_question = 1, tag_give_up = 2, tag_answers = 100, answer_tags = 16000;

  struct active_wait {
    const wait_label* label;
    bool given_up = false;
    std::string give_up_text;
  };
  /// @brief One round of questions: what each peer answered, if it did.
  struct round {
    bool open = false;
    std::uint64_t id = 0;
    watch_clock::time_point ends{};
    std::size_t answered = 0;
    std::vector<int> state;            ///< per peer: 0 no answer, 1 in this collective, 2 elsewhere
    std::vector<std::string> where;    ///< per peer: what it said it waits in
  };
  struct pending_send {
    MPI_Request request = MPI_REQUEST_NULL;
    std::string payload;
  };

  watch() = default;

  static int answer_tag(std::uint64_t group) { return tag_answers + static_cast<int>(group % answer_tags); }

  void enlist(active_wait* w) {
    std::lock_guard lock(mutex_);
    waits_.push_back(w);
  }
  void delist(active_wait* w) {
    std::lock_guard lock(mutex_);
    std::erase(waits_, w);
    if (waits_.empty()) status_ready_.store(false, std::memory_order_release);
  }

  /// @brief Sends `payload` to `to` without waiting (kept until it completes).
  void post(std::string payload, int to, int tag) {
    std::lock_guard lock(mutex_);
    sends_.push_back({MPI_REQUEST_NULL, std::move(payload)});
    auto& s = sends_.back();
    MPI_Isend(s.payload.data(), static_cast<int>(s.payload.size()), MPI_CHAR, to, tag, talk_, &s.request);
  }

  /// @brief The text of a message matched by `message`, received.
  static std::string receive(MPI_Message& message, MPI_Status& status) {
    int length = 0;
    MPI_Get_count(&status, MPI_CHAR, &length);
    std::string text(static_cast<std::size_t>(length), '\0');
    MPI_Mrecv(text.data(), length, MPI_CHAR, &message, MPI_STATUS_IGNORE);
    return text;
  }

  /// @brief Answers the questions that arrived, takes in the give-up notices, and frees the
  /// sends that completed. Any waiting thread does it for the whole process.
  void serve() {
    int flag = 0;
    MPI_Message message;
    MPI_Status status;
    while (MPI_Improbe(MPI_ANY_SOURCE, tag_question, talk_, &flag, &message, &status) == MPI_SUCCESS && flag) {
      std::istringstream in(receive(message, status));
      int reply_tag = 0;
      std::uint64_t round_id = 0;
      in >> reply_tag >> round_id;
      std::string answer = std::to_string(round_id) + "\n";
      {
        std::lock_guard lock(mutex_);
        for (const active_wait* w : waits_)
          answer += std::to_string(w->label->group) + " " + std::to_string(w->label->seq) + " " + w->label->what + "\n";
      }
      post(std::move(answer), status.MPI_SOURCE, reply_tag);
    }
    while (MPI_Improbe(MPI_ANY_SOURCE, tag_give_up, talk_, &flag, &message, &status) == MPI_SUCCESS && flag) {
      const std::string text = receive(message, status);
      std::istringstream in(text);
      std::uint64_t group = 0, seq = 0;
      in >> group >> seq;
      std::string rest;
      std::getline(in, rest);
      std::getline(in, rest, '\0');
      std::lock_guard lock(mutex_);
      for (active_wait* w : waits_)
        if (w->label->group == group && w->label->seq == seq && !w->given_up) {
          w->given_up = true;
          w->give_up_text = rest;
        }
    }
    std::lock_guard lock(mutex_);
    for (auto it = sends_.begin(); it != sends_.end();) {
      int complete = 0;
      MPI_Test(&it->request, &complete, MPI_STATUS_IGNORE);
      it = complete ? sends_.erase(it) : std::next(it);
    }
  }

  /// @brief Opens a round: asks every peer where it waits.
  void ask(round& r, const wait_label& label, const std::vector<int>& peers, watch_clock::time_point ends) {
    r = round{true, next_round_id_.fetch_add(1, std::memory_order_relaxed) + 1, ends, 0, std::vector<int>(peers.size(), 0),
              std::vector<std::string>(peers.size())};
    for (int peer : peers) post(std::to_string(answer_tag(label.group)) + " " + std::to_string(r.id), peer, tag_question);
  }

  /// @brief Takes in the answers that arrived (late answers of earlier rounds are dropped).
  void collect(round& r, const wait_label& label, const std::vector<int>& peers) {
    for (std::size_t i = 0; i < peers.size(); ++i) {
      int flag = 0;
      MPI_Message message;
      MPI_Status status;
      while (MPI_Improbe(peers[i], answer_tag(label.group), talk_, &flag, &message, &status) == MPI_SUCCESS && flag) {
        std::istringstream in(receive(message, status));
        std::uint64_t id = 0;
        in >> id;
        if (id != r.id || r.state[i] != 0) continue;
        ++r.answered;
        r.state[i] = 2;
        std::string line;
        std::getline(in, line);
        while (std::getline(in, line)) {
          std::istringstream fields(line);
          std::uint64_t group = 0, seq = 0;
          fields >> group >> seq;
          std::string what;
          std::getline(fields >> std::ws, what);
          if (group == label.group && seq == label.seq) r.state[i] = 1;
          else r.where[i] += (r.where[i].empty() ? "" : "; ") + what + (seq != 0 ? " (collective #" + std::to_string(seq) + " there)" : "");
        }
      }
    }
  }

  /// @brief "rank 2 (waiting in ...), rank 3 (did not answer: ...)" for the peers not in this collective.
  static std::string missing(const round& r, const std::vector<int>& peers) {
    std::string text;
    for (std::size_t i = 0; i < peers.size(); ++i) {
      if (r.state[i] == 1) continue;
      text += (text.empty() ? "" : ", ") + std::string("rank ") + std::to_string(peers[i]);
      if (r.state[i] == 2)
        text += r.where[i].empty() ? " (not waiting in any collective of pdo)" : " (waiting in " + r.where[i] + ")";
      else
        text += " (did not answer: busy outside pdo's collectives, stopped, or gone)";
    }
    return text;
  }

  static std::string describe(const wait_label& label) {
    return label.what + (label.seq != 0 ? " (collective #" + std::to_string(label.seq) + " of its group)" : "");
  }

  /// @brief Keeps a line about this wait for the signal note (see install_signal_note).
  void note_status(const wait_label& label, const round& r, const std::vector<int>& peers, watch_clock::duration waited) {
    const std::string who = missing(r, peers);
    std::ostringstream os;
    os << "pdo: rank " << me_ << ": ended while waiting in " << describe(label) << "; after "
       << std::chrono::duration<double>(waited).count() << " s, "
       << (who.empty() ? std::string("every other member had arrived") : "not arrived: " + who) << "\n";
    const std::string line = os.str();
    std::lock_guard lock(mutex_);
    const std::size_t n = std::min(line.size(), sizeof(status_) - 1);
    std::memcpy(status_, line.data(), n);
    status_[n] = '\0';
    status_length_ = n;
    status_ready_.store(true, std::memory_order_release);
  }

  /// @brief The timeout: the message, sent to every peer (those that arrived give up too,
  /// with it), then thrown or, when the process cannot go on, printed before the job ends.
  [[noreturn]] void give_up(const wait_label& label, const round& r, const std::vector<int>& peers, watch_clock::duration waited,
                            bool can_go_on) {
    std::ostringstream os;
    os << describe(label) << " timed out after " << std::chrono::duration<double>(waited).count() << " s on rank " << me_
       << ": not arrived: " << missing(r, peers)
       << ". The group cannot be used after this; if those processes are only slow, raise the timeout "
          "(PDO_COLLECTIVE_TIMEOUT=<seconds>, or mesh_options::collective_timeout)";
    const std::string message = os.str();
    for (int peer : peers)
      post(std::to_string(label.group) + " " + std::to_string(label.seq) + "\nrank " + std::to_string(me_) + " gave up: " + message,
           peer, tag_give_up);
    serve();
    fail(message, can_go_on);
  }

  [[noreturn]] static void fail(const std::string& message, bool can_go_on) {
    if (can_go_on) throw collective_timeout(message);
    std::fprintf(stderr, "pdo: fatal: %s; a transfer still holds a buffer of this process, ending the job\n", message.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::terminate();
  }

  /// @brief Spins while the wait is young, then yields, then sleeps briefly between polls.
  static void back_off(std::size_t spins, watch_clock::duration waited) {
    if (spins < 2000) pdo::detail::cpu_relax();
    else if (waited < std::chrono::milliseconds(10)) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  }

  /// @brief On SIGTERM (how a launcher ends the job when a process died), writes the line
  /// note_status kept, then ends as SIGTERM would have. Installed only where the program has
  /// no handler of its own.
  void install_signal_note() {
    struct sigaction current {};
    if (sigaction(SIGTERM, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) return;
    struct sigaction note {};
    note.sa_handler = [](int) {
      watch& w = instance();
      if (w.status_ready_.load(std::memory_order_acquire)) {
        const ssize_t written = ::write(2, w.status_, w.status_length_);
        (void)written;
      }
      std::signal(SIGTERM, SIG_DFL);
      std::raise(SIGTERM);
    };
    sigemptyset(&note.sa_mask);
    sigaction(SIGTERM, &note, nullptr);
  }

  std::once_flag started_;
  MPI_Comm talk_ = MPI_COMM_NULL, agree_ = MPI_COMM_NULL;
  int me_ = 0;
  std::mutex mutex_;
  std::vector<active_wait*> waits_;
  std::list<pending_send> sends_;
  std::atomic<std::uint64_t> next_round_id_{0};
  std::uint64_t agreements_ = 0;  ///< steps taken on the agreement communicator
  char status_[1024] = {};
  std::size_t status_length_ = 0;
  std::atomic<bool> status_ready_{false};
};

}  // namespace pdo::mpi::detail
#endif  // PDO_SINGLE_PDO_COMM_MPI_WATCH_HPP

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pdo::mpi::detail {

using pdo::detail::copy_elements;
using pdo::detail::local_group;

/// @brief What names a group in messages and matches it across processes.
struct group_identity {
  std::uint64_t id = 0;        ///< the same on every process (groups are made in one order everywhere)
  std::string label;           ///< "axis \"dp\" of mesh(dp=4)"
  std::chrono::duration<double> timeout{std::chrono::minutes(30)};  ///< how long a member waits for the others
};

/// @brief Keeps `buffer` alive for good: an MPI request given up after a timeout may still
/// write into it if the late process arrives.
template <class T>
void abandon(std::vector<T>&& buffer) {
  static auto* kept = new std::vector<std::vector<T>>();  // never freed, on purpose
  kept->push_back(std::move(buffer));
}

/// @brief The group's members are numbered in mesh order and live on increasing MPI
/// ranks; this process holds members [first, first + local size). Each collective
/// runs in three steps: the members of this process publish their buffers; the first
/// of them (the leader) exchanges what all members passed, so every process reaches
/// the same verdict on bad arguments (an error everywhere, never a hang); then the
/// members reduce among themselves through shared memory while the leader moves the
/// combined data between processes, and each member copies out its result.
///
/// The exchange is where the processes meet: it waits at most the group's timeout (see
/// watch), and a collective whose exchange times out throws pdo::collective_timeout on
/// every member that arrived, naming the ranks that did not; the group is unusable after.
class group {
 public:
  /// @param members_per_rank for each process of `comm` in rank order, its member count
  /// @param spans_mesh the group holds every place of its mesh (see fail())
  group(MPI_Comm comm, std::vector<std::size_t> members_per_rank, std::vector<std::string> member_names, bool spans_mesh,
        group_identity identity)
      : spans_mesh_(spans_mesh),
        comm_(set_errors_return(comm)),
        rank_(rank_in(comm_)),
        per_rank_(std::move(members_per_rank)),
        first_(first_of(rank_)),
        names_(std::move(member_names)),
        local_(local_names(), /*part_of_larger=*/true),
        args_(local_.size()),
        identity_(std::move(identity)),
        world_ranks_(world_ranks_of(comm_)) {}
  group(const group&) = delete;
  group& operator=(const group&) = delete;
  ~group() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    // a group given up after a timeout keeps its communicator: a request may still be on it
    if (!finalized && comm_ != MPI_COMM_NULL && broken_.empty()) MPI_Comm_free(&comm_);
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
    exchange(me, std::vector<std::size_t>{}, "barrier", "barrier");
    local_.barrier();
  }

  template <class T>
  void all_reduce(std::size_t me, std::span<T> data, reduce_op op) {
    const std::size_t l = me - first();
    args_[l] = {data.data(), data.data()};
    const auto& counts = exchange(me, std::vector<std::size_t>{data.size()}, "all_reduce", pdo::detail::collective_call_text<T>("all_reduce", static_cast<int>(op)));
    for (std::size_t k = 0; k < size(); ++k)
      if (counts[3 * k + 1] != counts[1]) fail("all_reduce: members called it with different sizes (" + listing(counts, 3, 1) + ")");
    if (local_.size() > 1) local_.all_reduce(l, data, op);
    leader_step(l, [&] {
      pdo::mpi::detail::check(MPI_Allreduce(MPI_IN_PLACE, data.data(), pdo::mpi::detail::count(data.size(), "all_reduce"),
                                            datatype<T>(), op_of<T>(op), comm_),
                              "MPI_Allreduce");
    });
    if (l != 0) copy_elements(data.data(), static_cast<const T*>(args_[0].out), data.size());
    local_.barrier();
  }

  template <class T>
  void all_gather(std::size_t me, std::span<const T> in, std::span<T> out) {
    const std::size_t l = me - first();
    args_[l] = {in.data(), out.data()};
    const auto& counts = exchange(me, std::vector<std::size_t>{in.size(), out.size()}, "all_gather", pdo::detail::collective_call_text<T>("all_gather"));
    std::size_t total = 0;
    for (std::size_t k = 0; k < size(); ++k) total += counts[3 * k + 1];
    for (std::size_t k = 0; k < size(); ++k)
      if (counts[3 * k + 2] != total)
        fail("all_gather: inputs add up to " + std::to_string(total) + " elements but outputs hold (" + listing(counts, 3, 2) + ")");
    T* leader_out = static_cast<T*>(args_[0].out);
    copy_elements(leader_out + prefix(counts, 3, 1, me), in.data(), in.size());
    local_.barrier();
    leader_step(l, [&] {
      auto [rank_counts, displs] = rank_blocks(counts, 3, 1);
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
    const auto& counts = exchange(me, std::vector<std::size_t>{in.size(), out.size()}, "reduce_scatter",
                                 pdo::detail::collective_call_text<T>("reduce_scatter", static_cast<int>(op)));
    std::size_t total = 0;
    for (std::size_t k = 0; k < size(); ++k) {
      if (counts[3 * k + 1] != counts[1]) fail("reduce_scatter: members called it with different sizes (" + listing(counts, 3, 1) + ")");
      total += counts[3 * k + 2];
    }
    if (total != counts[1])
      fail("reduce_scatter: outputs add up to " + std::to_string(total) + " elements but the input has " + std::to_string(counts[1]));
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
    const std::size_t block_offset = prefix(counts, 3, 2, first());
    leader_step(l, [&] {
      auto [rank_counts, displs] = rank_blocks(counts, 3, 2);
      const std::size_t mine = static_cast<std::size_t>(rank_counts[static_cast<std::size_t>(my_rank())]);
      result_.resize(mine * sizeof(T));
      pdo::mpi::detail::check(MPI_Reduce_scatter(send, result_.data(), rank_counts.data(), datatype<T>(), op_of<T>(op), comm_),
                              "MPI_Reduce_scatter");
    });
    copy_elements(out.data(), reinterpret_cast<const T*>(result_.data()) + (prefix(counts, 3, 2, me) - block_offset), out.size());
    local_.barrier();
  }

  template <class T>
  void broadcast(std::size_t me, std::span<T> data, std::size_t root) {
    const std::size_t l = me - first();
    args_[l] = {data.data(), data.data()};
    const auto& counts = exchange(me, std::vector<std::size_t>{data.size(), root}, "broadcast", pdo::detail::collective_call_text<T>("broadcast"));
    for (std::size_t k = 0; k < size(); ++k)
      if (counts[3 * k + 1] != counts[1] || counts[3 * k + 2] != counts[2])
        fail("broadcast: members called it with different sizes or roots (" + listing(counts, 3, 1) + "; roots " + listing(counts, 3, 2) + ")");
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
    exchange(me, std::vector<std::size_t>{}, "all_to_all", pdo::detail::collective_call_text<T>("all_to_all"));  // every member is in an all_to_all: the widths agree
    const auto& m = exchange_values(me, mine, "all_to_all");
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
    MPI_Request request = MPI_REQUEST_NULL;
    pdo::mpi::detail::check(MPI_Issend(data.data(), pdo::mpi::detail::count(data.size(), "send"), datatype<T>(), rank_of(to),
                                      wire_tag(me, to, tag), comm_, &request),
                            "MPI_Issend");
    // a send given up would still read `data`, which the caller frees: its timeout ends the job
    watch::instance().wait([&] { return tested(request); }, transfer_label("send", me, to, tag),
                           {world_ranks_[static_cast<std::size_t>(rank_of(to))]}, identity_.timeout, false);
  }

  template <class T>
  void recv(std::size_t me, std::span<T> data, std::size_t from, int tag) {
    check_peer("recv", me, from, tag);
    if (rank_of(from) == my_rank()) return local_only([&] { local_.recv(me - first(), data, from - first(), tag); });
    MPI_Status status;
    MPI_Message message;
    const int wire = wire_tag(from, me, tag);
    watch::instance().wait(
        [&] {
          int found = 0;
          pdo::mpi::detail::check(MPI_Improbe(rank_of(from), wire, comm_, &found, &message, &status), "MPI_Improbe");
          return found != 0;
        },
        transfer_label("recv", me, from, tag), {world_ranks_[static_cast<std::size_t>(rank_of(from))]}, identity_.timeout, true);
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
  template <class T>
  static MPI_Op op_of(reduce_op op) { return pdo::mpi::detail::op<T>(op); }

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

  /// @brief Where the processes meet before collective `op` (at most two `values` per
  /// member): every member's [a code of its call, values..., zeros], 3 per member in member
  /// order, on every member. `call` names the call whole (`collective_call_text`: the
  /// collective, its element type, its reduction): a member in another collective, or in one
  /// over another element type or with another reduction, has another code, and every member
  /// finds it alike and fails (mismatch_error). The width is the same whatever the
  /// collective, so MPI never sees messages of two sizes meet (which it reports as a fatal
  /// truncation).
  const std::vector<std::size_t>& exchange(std::size_t me, const std::vector<std::size_t>& values, const char* op,
                                           const std::string& call) {
    std::vector<std::size_t> framed(3, 0);
    framed[0] = collective_code(call);
    std::copy(values.begin(), values.end(), framed.begin() + 1);
    const auto& all = exchange_values(me, framed, op);
    for (std::size_t k = 0; k < size(); ++k)
      if (all[3 * k] != framed[0]) {
        std::string calls;
        for (std::size_t j = 0; j < size(); ++j) calls += (j ? ", " : "") + names_[j] + " in " + collective_name(all[3 * j]);
        fail(std::string(op) + " over " + identity_.label + ": the members called different collectives (" + calls +
             "); every member of a group must call the same collectives, over the same element type, in the same order");
      }
    return all;
  }

  static constexpr std::size_t collective_code(std::string_view call) { return pdo::detail::collective_code(call); }
  /// @brief The call of `code`: each collective, reduction and element type tried.
  PDO_NOINLINE static std::string collective_name(std::size_t code) {
    std::vector<std::pair<char, std::size_t>> elements{{0, 0}};
    for (const char kind : {'f', 'i', 'u'})
      for (std::size_t bytes : {1, 2, 4, 8, 16}) elements.emplace_back(kind, bytes);
    for (std::string_view op : {"barrier", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"})
      for (int reduction = -1; reduction <= static_cast<int>(reduce_op::min); ++reduction)
        for (const auto& [element, bytes] : elements)
          if (std::string call = pdo::detail::collective_call_text(op, element, bytes, reduction); collective_code(call) == code)
            return call;
    return "another collective";
  }

  /// @brief Every member's `values` (all of one width), in member order, on every member.
  /// Its wait is watched (see watch): past the group's timeout every member that arrived
  /// throws pdo::collective_timeout.
  const std::vector<std::size_t>& exchange_values(std::size_t me, const std::vector<std::size_t>& values, const char* op) {
    if (!broken_.empty())  // read by every member alike: it was set before the last collective ended
      throw collective_timeout(std::string(op) + " over " + identity_.label + ": the group timed out earlier and cannot be used: " + broken_);
    const std::size_t l = me - first(), width = values.size();
    if (l == 0) {
      local_values_.assign(local_.size() * width, 0);
      width_ = width;
    }
    local_.barrier();
    std::copy(values.begin(), values.end(), local_values_.begin() + static_cast<std::ptrdiff_t>(l * width));
    local_.barrier();
    leader_step(l, [&] {
      MPI_Request request = MPI_REQUEST_NULL;
      counts_.assign(per_rank_.size(), 0);
      displs_.assign(per_rank_.size(), 0);
      for (std::size_t r = 0; r < per_rank_.size(); ++r) {
        counts_[r] = static_cast<int>(per_rank_[r] * width_);
        displs_[r] = static_cast<int>(first_of(static_cast<int>(r)) * width_);
      }
      all_values_.assign(size() * width_, 0);
      pdo::mpi::detail::check(MPI_Iallgatherv(local_values_.data(), static_cast<int>(local_values_.size()), MPI_UINT64_T,
                                              all_values_.data(), counts_.data(), displs_.data(), MPI_UINT64_T, comm_, &request),
                              "MPI_Iallgatherv");
      const wait_label label{identity_.id, ++collectives_, std::string(op) + " over " + identity_.label};
      std::vector<int> peers;
      for (std::size_t r = 0; r < world_ranks_.size(); ++r)
        if (static_cast<int>(r) != my_rank()) peers.push_back(world_ranks_[r]);
      try {
        watch::instance().wait([&] { return tested(request); }, label, peers, identity_.timeout, true);
      } catch (const collective_timeout& e) {
        broken_ = e.what();
        abandon(std::move(local_values_));
        abandon(std::move(all_values_));
        abandon(std::move(counts_));
        abandon(std::move(displs_));
        throw;
      }
    });
    return all_values_;
  }

  static bool tested(MPI_Request& request) {
    int done = 0;
    pdo::mpi::detail::check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
    return done != 0;
  }
  wait_label transfer_label(const char* op, std::size_t me, std::size_t peer, int tag) const {
    return {identity_.id, 0, std::string(op) + " between " + names_[me] + " and " + names_[peer] + " (tag " + std::to_string(tag) +
                                 ") over " + identity_.label};
  }
  /// @brief The MPI_COMM_WORLD rank of each rank of `comm`.
  static std::vector<int> world_ranks_of(MPI_Comm comm) {
    int n = 0;
    MPI_Comm_size(comm, &n);
    std::vector<int> ranks(static_cast<std::size_t>(n)), world(static_cast<std::size_t>(n));
    std::iota(ranks.begin(), ranks.end(), 0);
    MPI_Group mine = MPI_GROUP_NULL, all = MPI_GROUP_NULL;
    MPI_Comm_group(comm, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &all);
    MPI_Group_translate_ranks(mine, n, ranks.data(), all, world.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&all);
    return world;
  }

  /// @brief The leader runs `work` (its MPI calls); a failure there reaches every member,
  /// as the same pdo::error subclass. Problems alternate between two slots, step after
  /// step, so the leader never overwrites one that a member is still reading.
  template <class Work>
  void leader_step(std::size_t l, Work&& work) {
    std::optional<pdo::detail::captured_error>& problem = problems_[steps_[l]++ & 1];
    if (l == 0) {
      problem.reset();
      try {
        work();
      } catch (...) {
        problem = pdo::detail::captured_error::current();
      }
    }
    local_.barrier();
    if (problem) {
      const pdo::detail::captured_error failure = *problem;
      local_.barrier();
      failure.rethrow_with_context("");
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
  std::vector<int> counts_, displs_;
  std::size_t width_ = 0;
  std::vector<unsigned char> staging_, result_;
  std::optional<pdo::detail::captured_error> problems_[2];
  group_identity identity_;
  std::vector<int> world_ranks_;     ///< the MPI_COMM_WORLD rank of each rank of comm_
  std::uint64_t collectives_ = 0;    ///< collectives begun on this group (by this process's leader)
  std::string broken_;               ///< why the group cannot be used (a timeout), or empty
  std::vector<std::size_t> steps_ = std::vector<std::size_t>(local_.size(), 0);  ///< leader steps per local member
};

}  // namespace pdo::mpi::detail
#endif  // PDO_SINGLE_PDO_COMM_MPI_GROUP_HPP
#endif

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

namespace pdo::detail {

/// @brief A group of host buffers whose backend was chosen when its mesh was built:
/// threads when all places live in this process, MPI otherwise.
struct host_group {
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
decltype(auto) visit_group(host_group& g, F&& f) {
  return std::visit([&](auto& p) -> decltype(auto) { return f(*p); }, g.impl);
}

/// @brief The number of the next group made in this process: every process makes the groups
/// of its meshes in one order (the processes agree on each mesh), so a group has the same
/// number everywhere.
inline std::uint64_t next_group_number() {
  static std::atomic<std::uint64_t> next{0};
  return next.fetch_add(1, std::memory_order_relaxed) + 1;
}

/// @brief The host group of `members` (mesh indices) of mesh `m`, or nullptr in a process
/// that holds none of them; `label` names it in messages ("axis \"dp\" of mesh(dp=4)").
inline std::shared_ptr<host_group> make_host_group(const mesh_state& m, const std::vector<std::size_t>& members,
                                                   [[maybe_unused]] const std::string& label) {
  std::vector<std::string> names;
  for (auto i : members) names.push_back(m.places[i].name());
  [[maybe_unused]] const std::uint64_t number = next_group_number();
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
    mpi::detail::group_identity identity{number, label, m.options.collective_timeout.count() > 0
                                                            ? m.options.collective_timeout
                                                            : mpi::detail::default_collective_timeout()};
    return std::make_shared<host_group>(host_group{
        std::make_shared<mpi::detail::group>(comm, per_rank, names, members.size() == m.places.size(), std::move(identity))});
  }
#endif
  if (m.multiprocess)
    throw communication_error("mesh: places of other processes need the MPI backend; build with PDO_WITH_MPI");
  return std::make_shared<host_group>(host_group{std::make_shared<local_group>(names)});
}

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_COMM_HOST_GROUP_HPP
// ---- pdo/place/cuda_place.hpp
#ifndef PDO_SINGLE_PDO_PLACE_CUDA_PLACE_HPP
#define PDO_SINGLE_PDO_PLACE_CUDA_PLACE_HPP
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
#endif  // PDO_SINGLE_PDO_PLACE_CUDA_PLACE_HPP

#if defined(PDO_WITH_MPI)
#endif
#if defined(PDO_WITH_CUDA)
// ---- pdo/comm/nccl/group.hpp
#ifndef PDO_SINGLE_PDO_COMM_NCCL_GROUP_HPP
#define PDO_SINGLE_PDO_COMM_NCCL_GROUP_HPP
// pdo/comm/nccl/group.hpp: the NCCL backend: a group of GPU places whose collectives run
// on each place's communication stream, ordered after the work already queued on its
// compute stream and before the work queued after them (events, no host wait).
//
// Every NCCL call is preceded by a small host collective over the same members (the
// threads or MPI group of the mesh) that checks the arguments agree, so a mismatch is a
// pdo::mismatch_error on every member and a failed member releases the others (an
// aborted mesh) before any of them has queued a kernel that would wait for it forever.


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
    enqueue(me, "ncclAllReduce", [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(data.data(), data.data(), data.size(), type_of<T>(), op_of(op), c, s);
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
    enqueue(me, even ? "ncclReduceScatter" : "ncclReduce", [&](ncclComm_t c, cudaStream_t s) {
      if (even) return ncclReduceScatter(in.data(), out.data(), out.size(), type_of<T>(), op_of(op), c, s);
      ncclResult_t status = ncclGroupStart();
      std::size_t at = 0;
      for (std::size_t k = 0; k < counts.size() && status == ncclSuccess; at += counts[k], ++k)
        status = ncclReduce(in.data() + at, k == me ? out.data() : nullptr, counts[k], type_of<T>(), op_of(op), static_cast<int>(k), c, s);
      const ncclResult_t end = ncclGroupEnd();
      return status != ncclSuccess ? status : end;
    });
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
    on_host([&](auto& h) { h.send(me, std::span<const std::uint64_t>(header), to, header_tag); });
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
    on_host([&](auto& h) { h.recv(me, std::span<std::uint64_t>(header), from, header_tag); });
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
#endif  // PDO_SINGLE_PDO_COMM_NCCL_GROUP_HPP
// ---- pdo/comm/staged_group.hpp
#ifndef PDO_SINGLE_PDO_COMM_STAGED_GROUP_HPP
#define PDO_SINGLE_PDO_COMM_STAGED_GROUP_HPP
// pdo/comm/staged_group.hpp: the groups of a mesh that mixes CPU and GPU places: the threads
// or MPI group of the mesh, with each GPU member's buffers staged through host memory
// (copied down before the collective, and its results copied back up after it).

// ---- pdo/place/copy.hpp
#ifndef PDO_SINGLE_PDO_PLACE_COPY_HPP
#define PDO_SINGLE_PDO_PLACE_COPY_HPP
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
#endif  // PDO_SINGLE_PDO_PLACE_COPY_HPP

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

namespace pdo::detail {

class staged_group {
 public:
  /// @param places member m's place (null for members of other processes)
  staged_group(std::vector<std::shared_ptr<place_state>> places, std::shared_ptr<host_group> host)
      : places_(std::move(places)), host_(std::move(host)) {}

  [[nodiscard]] std::size_t size() const { return places_.size(); }
  void abort() { host_->abort(); }
  void reset() { host_->reset(); }
  void barrier(std::size_t me) {
    visit_group(*host_, [&](auto& h) { h.barrier(me); });
  }

  template <class T>
  void all_reduce(std::size_t me, std::span<T> data, reduce_op op) {
    auto d = down(me, std::span<const T>(data));
    visit_group(*host_, [&](auto& h) { h.all_reduce(me, std::span<T>(d), op); });
    up(me, std::span<const T>(d), data);
  }
  template <class T>
  void all_gather(std::size_t me, std::span<const T> in, std::span<T> out) {
    auto i = down(me, in);
    std::vector<T> o(out.size());
    visit_group(*host_, [&](auto& h) { h.all_gather(me, std::span<const T>(i), std::span<T>(o)); });
    up(me, std::span<const T>(o), out);
  }
  template <class T>
  void reduce_scatter(std::size_t me, std::span<const T> in, std::span<T> out, reduce_op op) {
    auto i = down(me, in);
    std::vector<T> o(out.size());
    visit_group(*host_, [&](auto& h) { h.reduce_scatter(me, std::span<const T>(i), std::span<T>(o), op); });
    up(me, std::span<const T>(o), out);
  }
  template <class T>
  void broadcast(std::size_t me, std::span<T> data, std::size_t root) {
    auto d = down(me, std::span<const T>(data));
    visit_group(*host_, [&](auto& h) { h.broadcast(me, std::span<T>(d), root); });
    up(me, std::span<const T>(d), data);
  }
  template <class T>
  void all_to_all(std::size_t me, std::span<const T> in, std::span<const std::size_t> send_counts, std::span<T> out,
                  std::span<const std::size_t> recv_counts) {
    auto i = down(me, in);
    std::vector<T> o(out.size());
    visit_group(*host_, [&](auto& h) { h.all_to_all(me, std::span<const T>(i), send_counts, std::span<T>(o), recv_counts); });
    up(me, std::span<const T>(o), out);
  }
  template <class T>
  void send(std::size_t me, std::span<const T> data, std::size_t to, int tag) {
    auto d = down(me, data);
    visit_group(*host_, [&](auto& h) { h.send(me, std::span<const T>(d), to, tag); });
  }
  template <class T>
  void recv(std::size_t me, std::span<T> data, std::size_t from, int tag) {
    std::vector<T> d(data.size());
    visit_group(*host_, [&](auto& h) { h.recv(me, std::span<T>(d), from, tag); });
    up(me, std::span<const T>(d), data);
  }

 private:
  /// @brief Member `me`'s buffer `in` in host memory (a copy, whichever its place).
  template <class T>
  std::vector<T> down(std::size_t me, std::span<const T> in) const {
    std::vector<T> host(in.size());
    copy_bytes(nullptr, host.data(), places_[me].get(), in.data(), in.size_bytes());
    return host;
  }
  template <class T>
  void up(std::size_t me, std::span<const T> host, std::span<T> out) const {
    copy_bytes(places_[me].get(), out.data(), nullptr, host.data(), host.size_bytes());
  }

  std::vector<std::shared_ptr<place_state>> places_;
  std::shared_ptr<host_group> host_;
};

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_COMM_STAGED_GROUP_HPP
#endif

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace pdo {

namespace detail {

/// @brief A group whose backend was chosen when its mesh was built: threads when all
/// places live in this process, MPI otherwise; with GPU places, NCCL when every place is
/// a GPU, and the host group with GPU buffers staged through host memory when CPU and GPU
/// places mix.
struct any_group {
  std::variant<std::shared_ptr<local_group>
#if defined(PDO_WITH_MPI)
               ,
               std::shared_ptr<mpi::detail::group>
#endif
#if defined(PDO_WITH_CUDA)
               ,
               std::shared_ptr<nccl::detail::group>, std::shared_ptr<staged_group>
#endif
               >
      impl;
  std::string label;  ///< "axis \"dp\" of mesh(dp=4)": for the timeline
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
inline std::string group_label(const any_group& g) { return g.label; }

/// @brief The groups of one mesh. `lines[a][g]` is the g-th group along axis a; place
/// p is member `coord(p, a)` of group `line_of[a][p]`.
struct mesh_comms {
  std::shared_ptr<any_group> whole;
  /// @brief The threads or MPI group of all the places, whatever their devices: small
  /// exchanges of host values (agreement checks) go through it on any mesh, never NCCL.
  std::shared_ptr<any_group> whole_host;
  std::vector<std::vector<std::shared_ptr<any_group>>> lines;
  std::vector<std::vector<std::size_t>> line_of;
  std::vector<std::vector<std::size_t>> member_in_line;  ///< [a][p]: p's member index in its group along a (its coordinate)

  /// @brief Wakes every place blocked in a collective of this mesh with an error.
  void abort() {
    for_each_group([](any_group& g) { g.abort(); });
  }
  void reset() {
    for_each_group([](any_group& g) { g.reset(); });
  }
  /// @brief The task of place `p` (a place of this process) has ended: the collectives of its
  /// groups that need it cannot complete any more, so the other members of this process
  /// waiting in one, or entering one, get an error instead of waiting for it forever
  /// (local_group::leave), until rejoin(). On a mesh of CPU places in this process, every
  /// member is told (pdo::mismatch_error); over MPI, the other places of this process in its
  /// groups (pdo::communication_error: the other processes cannot be told, so the job ends);
  /// nothing on meshes with GPU places.
  void left(std::size_t p) {
    each_group_of(p, [](local_group& g, std::size_t member) { g.leave(member); });
  }
  /// @brief After left(): the collectives are usable again (once no task of the mesh is in one).
  void rejoin() {
    if (!whole || local_part(*whole) == nullptr) return;
    for_each_group([](any_group& g) { local_part(g)->reopen(); });
  }
  /// @brief `f(local group, p's member index in it)` for each group of place `p`, through the
  /// part of the group in this process (the whole of a threads group, an MPI group's local
  /// members), on a mesh of CPU places (whole_host is then whole's group); none for groups of
  /// one member in this process.
  template <class F>
  void each_group_of(std::size_t p, F&& f) {
    if (!whole || local_part(*whole) == nullptr) return;  // GPU places: NCCL or staged groups
    auto visit = [&](any_group* g, std::size_t member) {
      if (local_group* local = g != nullptr ? local_part(*g) : nullptr; local != nullptr && local->size() > 1)
        f(*local, member - first_local(*g));
    };
    visit(whole.get(), p);
    for (std::size_t a = 0; a < lines.size(); ++a) {
      const std::size_t line = line_of[a][p];
      if (line < lines[a].size()) visit(lines[a][line].get(), member_in_line[a][p]);
    }
  }
  /// @brief The members of `g` in this process as a threads group: all of a threads group,
  /// the local part of an MPI group; null for GPU groups.
  static local_group* local_part(any_group& g) {
    if (auto* threads = std::get_if<std::shared_ptr<local_group>>(&g.impl)) return threads->get();
#if defined(PDO_WITH_MPI)
    if (auto* processes = std::get_if<std::shared_ptr<mpi::detail::group>>(&g.impl)) return &(*processes)->local();
#endif
    return nullptr;
  }
  /// @brief The member index in `g` of its first member in this process.
  static std::size_t first_local([[maybe_unused]] const any_group& g) {
#if defined(PDO_WITH_MPI)
    if (const auto* processes = std::get_if<std::shared_ptr<mpi::detail::group>>(&g.impl)) return (*processes)->first();
#endif
    return 0;
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

/// @brief `host` as an any_group (nullptr stays nullptr).
inline std::shared_ptr<any_group> from_host(const std::shared_ptr<host_group>& host) {
  if (!host) return nullptr;
  return std::visit([](auto& g) { return std::make_shared<any_group>(any_group{g, {}}); }, host->impl);
}

/// @brief How the places of a mesh are: all CPU, all GPU, or both.
enum class mesh_devices { cpu, gpu, mixed };
inline mesh_devices devices_of(const mesh_state& m) {
  bool cpu = false, gpu = false;
  for (const auto& p : m.places) (p.kind() == place_kind::cuda ? gpu : cpu) = true;
  return gpu ? (cpu ? mesh_devices::mixed : mesh_devices::gpu) : mesh_devices::cpu;
}

#if defined(PDO_WITH_CUDA)
/// @brief The group of `members` over `host`, for a mesh with GPU places: NCCL on `comms`
/// (all GPU), else the host group with GPU buffers staged through host memory.
inline std::shared_ptr<any_group> device_group(const mesh_state& m, const std::vector<std::size_t>& members,
                                               std::shared_ptr<host_group> host, std::shared_ptr<nccl::detail::comm_set> comms) {
  if (!host) return nullptr;
  std::vector<std::shared_ptr<place_state>> places;
  for (auto i : members) places.push_back(m.places[i].is_local() ? m.places[i].state() : nullptr);
  if (comms) return std::make_shared<any_group>(any_group{std::make_shared<nccl::detail::group>(std::move(places), std::move(comms), std::move(host)), {}});
  return std::make_shared<any_group>(any_group{std::make_shared<staged_group>(std::move(places), std::move(host)), {}});
}
#endif

/// @brief The communicators of the mesh behind `state`, built on first use (by every
/// process of a multi-process mesh, at the same point of the program).
PDO_NOINLINE inline mesh_comms& comms_of_state(mesh_state& state) {
  std::call_once(state.comms_once, [&] {
    const std::string name = describe_mesh(state);
    const std::size_t size = state.places.size(), ndim = state.extents.size();
    auto comms = std::make_shared<mesh_comms>();
    std::vector<std::size_t> all(size);
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    const mesh_devices devices = devices_of(state);
#if defined(PDO_WITH_MPI)
    // making communicators blocks until every process takes part: meet first, watched
    if (state.multiprocess)
      mpi::detail::watch::instance().meet_all("building the communicators of " + name,
                                              state.options.collective_timeout.count() > 0 ? state.options.collective_timeout
                                                                                          : mpi::detail::default_collective_timeout());
#endif
    if (devices != mesh_devices::cpu && !cuda_enabled)
      throw communication_error("mesh: " + name + " has GPU places; their collectives need a build with PDO_WITH_CUDA");
#if defined(PDO_WITH_CUDA)
    using nccl_comms = std::shared_ptr<nccl::detail::comm_set>;
    const nccl_comms whole_nccl = devices == mesh_devices::gpu ? nccl::detail::init_mesh(state) : nullptr;
    auto wrap = [&](const std::vector<std::size_t>& members, nccl_comms nc, const std::string& label,
                    std::shared_ptr<any_group>* host_out = nullptr) {
      auto host = make_host_group(state, members, label);
      if (host_out != nullptr) *host_out = from_host(host);
      return devices == mesh_devices::cpu ? from_host(host) : device_group(state, members, std::move(host), std::move(nc));
    };
#else
    using nccl_comms = std::nullptr_t;
    const nccl_comms whole_nccl = nullptr;
    auto wrap = [&](const std::vector<std::size_t>& members, nccl_comms, const std::string& label,
                    std::shared_ptr<any_group>* host_out = nullptr) {
      auto host = from_host(make_host_group(state, members, label));
      if (host_out != nullptr) *host_out = host;
      return host;
    };
#endif
    comms->whole = wrap(all, whole_nccl, "the whole " + name, &comms->whole_host);
    if (comms->whole) comms->whole->label = "the whole " + name;
    if (comms->whole_host) comms->whole_host->label = "the whole " + name + " (host)";
    comms->lines.resize(ndim);
    comms->line_of.assign(ndim, std::vector<std::size_t>(size));
    comms->member_in_line.assign(ndim, std::vector<std::size_t>(size));
    for (std::size_t a = 0; a < ndim; ++a) {
      std::vector<std::vector<std::size_t>> line_members;
      for (std::size_t p = 0; p < size; ++p) {
        if (grid_coord(state.extents, p, a) != 0) continue;
        const auto members = grid_group(state.extents, a, p);
        for (std::size_t i = 0; i < members.size(); ++i) {
          comms->line_of[a][members[i]] = line_members.size();
          comms->member_in_line[a][members[i]] = i;
        }
        line_members.push_back(members);
      }
      std::vector<nccl_comms> line_nccl(line_members.size());
#if defined(PDO_WITH_CUDA)
      if (whole_nccl) {
        std::vector<std::size_t> coords(size);
        for (std::size_t p = 0; p < size; ++p) coords[p] = grid_coord(state.extents, p, a);
        line_nccl = nccl::detail::split_lines(state, *whole_nccl, comms->line_of[a], line_members.size(), coords, state.extents[a]);
      }
#endif
      const std::string label = "axis \"" + state.axes[a] + "\" of " + name;
      for (std::size_t g = 0; g < line_members.size(); ++g) {
        comms->lines[a].push_back(wrap(line_members[g], line_nccl[g], label));
        if (comms->lines[a].back()) comms->lines[a].back()->label = label;
      }
    }
    state.comms = std::move(comms);
  });
  return *state.comms;
}

/// @brief The communicators of mesh `m`, built on first use (by every process of a
/// multi-process mesh, at the same point of the program).
template <class Mesh>
mesh_comms& comms_of(const Mesh& m) {
  return comms_of_state(*m.state());
}

}  // namespace detail

namespace detail {

/// @brief pdo::layout_error naming `op` unless place `index` of `m` exists and belongs to this
/// process (an endpoint is used by the place's own lane).
template <class Mesh>
void check_local_member(const Mesh& m, std::size_t index, std::string_view op) {
  m.check_place(index, op);
  if (!m.place(index).is_local())
    throw layout_error(m.describe() + ": " + std::string(op) + ": place " + std::to_string(index) + " (" + m.place(index).name() +
                       ") belongs to process " + std::to_string(m.place(index).process()) + ", not this one");
}

}  // namespace detail

/// @brief The communicator of a mesh's groups, whichever backend they run on.
using mesh_communicator = group_communicator<detail::any_group>;

static_assert(communicator<mesh_communicator>);

/// @brief Place `index`'s endpoint on the group of places along mesh axis `axis`.
/// pdo::layout_error when the mesh has no such axis or place, or the place is another process's.
template <class Mesh>
mesh_communicator communicator_along(const Mesh& m, std::size_t axis, std::size_t index) {
  m.check_axis(axis, "communicator_along");
  detail::check_local_member(m, index, "communicator_along");
  auto& comms = detail::comms_of(m);
  return {comms.lines[axis][comms.line_of[axis][index]], m.coord(index, axis)};
}

/// @brief Place `index`'s endpoint on the group of all places of the mesh; pdo::layout_error
/// when the mesh has no such place, or it is another process's.
template <class Mesh>
mesh_communicator communicator_of(const Mesh& m, std::size_t index) {
  detail::check_local_member(m, index, "communicator_of");
  return {detail::comms_of(m).whole, index};
}

/// @brief Place `index`'s endpoint on the host group of all places of the mesh (threads or
/// MPI, whatever the places' devices), for buffers in host memory: on a mesh of GPU places
/// communicator_of's group is NCCL, which takes device memory only.
template <class Mesh>
mesh_communicator host_communicator_of(const Mesh& m, std::size_t index) {
  detail::check_local_member(m, index, "host_communicator_of");
  return {detail::comms_of(m).whole_host, index};
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_COMM_MESH_COMMS_HPP
// ---- pdo/exec/engine.hpp
#ifndef PDO_SINGLE_PDO_EXEC_ENGINE_HPP
#define PDO_SINGLE_PDO_EXEC_ENGINE_HPP
// pdo/exec/engine.hpp: the engine that runs pdo's work: tasks that say which buffers they
// read and write, ordered per buffer, run on the lanes of their places.
//
// Every task declares the buffers it reads and writes (any address that names storage: a
// tensor's data, the slot a later task fills). The engine makes it wait for the last task
// that wrote a buffer it reads (read after write), and for the last writer and the readers
// since of a buffer it writes (write after read, write after write). Tasks that do not
// conflict run at the same time, on different lanes and places (pdo/place/lane.hpp).
//
// The engine's table of buffers is cut into shards by address, each with its own lock, so
// host threads that submit work on different buffers do not wait for each other. A
// submission locks the shards of every buffer it names (in shard order), links its tasks to
// what they conflict with and records them, and queues them on their lanes before it lets
// the shards go; the tasks of one mesh-wide operation (one per place) are queued at one
// instant, every lane involved locked at once (lane::push_together). So a task waits only
// for tasks queued before it, lanes run their tasks in the order they were queued, and the
// tasks of an operation stand in the same order against every other task on all their
// lanes. The task queued earliest of those that have not ended therefore has every task it
// waits for ended and every task before it on its lane ended: it runs, and with it the other
// tasks of its operation, whose collectives meet. Nothing waits forever, whichever threads
// submit.
//
// A task that fails cancels the tasks that read what it wrote (and, in turn, those that read
// theirs), with its error; a task that only overwrites its buffers runs, as do independent
// ones. Waiting on a task throws the error it failed or was cancelled with.


#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pdo::detail {

/// @brief What a task reads and writes: addresses that name storage.
struct access {
  std::vector<const void*> reads, writes;
  /// @brief The operations that name the same `after_all` (a mesh's communicators) follow
  /// each other whole: every task of one waits for every task of the one submitted before.
  /// So when an operation's collectives fail and are reset, no task of a later one is
  /// inside them.
  const void* after_all = nullptr;
};

/// @brief A task to submit: its lane, its reads and writes, its work, its name.
struct task_request {
  lane* home = nullptr;
  access uses;
  task fn;
  const char* op = "task";        ///< a string literal
  const char* category = "task";  ///< for the trace: "kernel", "collective", "copy", "task"
  bool runs_cancelled = false;  ///< run fn even when cancelled (it releases the others of its collective)
  bool quiet = false;           ///< queued without waking its lane (see task_state::quiet)
  /// @brief Its failure stays with the buffers it wrote until they are forgotten (forget()),
  /// not swept with the ended tasks: an evaluation's result, which the evaluation forgets
  /// when it is freed, read after its wait still gives the failure, not what the memory holds.
  bool keeps_failure = false;
  std::string detail;          ///< for the trace (shapes, layouts, bytes); may stay empty
};

/// @brief A lock of the engine. What it guards takes a fraction of a microsecond, and host
/// threads that submit short operations at once would otherwise put each other to sleep on
/// it (a futex wait and wake-up costs more than the operations): a waiter spins, then yields
/// its core (to the holder, when there are more threads than cores), and never sleeps.
class spin_lock {
 public:
  void lock() noexcept {
    for (int spins = 0; locked_.exchange(true, std::memory_order_acquire);)
      while (locked_.load(std::memory_order_relaxed))
        if (++spins > 64) std::this_thread::yield();
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

/// @brief The dependency engine: the last writer and the readers since of every buffer in
/// use, in shards by address, and the order of submission.
class engine {
 public:
  static engine& instance() {
    static engine* e = new engine();  // never destroyed: lanes may still run while the program exits
    return *e;
  }

  /// @brief Submits `requests`, the tasks of one operation (none waits for another of them),
  /// queued at one instant on their lanes, and returns their handles, in order.
  std::vector<task_handle> submit(std::vector<task_request>& requests) {
    std::vector<task_handle> handles;
    handles.reserve(requests.size());
    for (auto& r : requests) handles.push_back(make(r));
    shard_set mask{};
    for (const auto& r : requests) add_shards(r.uses, mask);
    const shard_locks locked(*this, mask);
    for (auto& h : handles) h->id = next_id();
    for (std::size_t i = 0; i < requests.size(); ++i) link_all(handles[i], requests[i].uses);
    for (std::size_t i = 0; i < requests.size(); ++i) record(handles[i], requests[i].uses);
    // the operation's tasks become what the next operation on their after_all waits for
    for (std::size_t i = 0; i < requests.size(); ++i) {
      const void* token = requests[i].uses.after_all;
      if (token == nullptr) continue;
      auto& last = shard_for(token).operations[token];
      if (i == 0 || requests[i - 1].uses.after_all != token) last.clear();
      last.push_back(handles[i]);
    }
    for (auto& h : handles) h->waiting.fetch_sub(1, std::memory_order_acq_rel);  // the submission's own count
    lane::push_together(handles);
    return handles;
  }

  /// @brief Submits one task.
  task_handle submit(task_request request) {
    task_handle h = make(request);
    shard_set mask{};
    add_shards(request.uses, mask);
    const shard_locks locked(*this, mask);
    h->id = next_id();
    link_all(h, request.uses);
    record(h, request.uses);
    if (request.uses.after_all != nullptr) shard_for(request.uses.after_all).operations[request.uses.after_all] = {h};
    // gives up the submission's own count, then queues: a lane looks at its head again on
    // every push, so no extra wake-up is needed for a task whose dependencies have all ended
    h->waiting.fetch_sub(1, std::memory_order_acq_rel);
    h->home->push(h);
    return h;
  }

  /// @brief Forgets `buffers` whose tasks have all ended: storage about to be freed, whose
  /// address later storage may take. A later task that reads that new storage must not wait
  /// for, or be cancelled by, a task that wrote the old one.
  void forget(const std::vector<const void*>& buffers) {
    for (const void* b : buffers) {
      shard& s = shard_for(b);
      std::lock_guard guard(s.lock);
      const auto found = s.buffers.find(b);
      if (found == s.buffers.end() || live(found->second.writer)) continue;
      bool reading = false;
      for (const auto& r : found->second.readers) reading = reading || live(r);
      if (!reading) s.buffers.erase(found);
    }
  }

  /// @brief The buffers the engine tracks now (for tests: finished work is forgotten).
  [[nodiscard]] std::size_t tracked_buffers() {
    std::size_t n = 0;
    for (shard& s : shards_) {
      std::lock_guard guard(s.lock);
      sweep(s);
      n += s.buffers.size();
    }
    return n;
  }

 private:
  engine() = default;

  struct buffer_state {
    task_handle writer;
    std::vector<task_handle, cache_line_allocator<task_handle>> readers;  ///< since the last write
  };

  /// @brief One part of the table: the buffers (and operation tokens) whose address hashes to it.
  struct alignas(64) shard {
    spin_lock lock;
    // nodes and arrays on cache lines of their own: a thread that made the entries of
    // another thread's buffers (it used them first) would otherwise share lines with it
    template <class V>
    using table = std::unordered_map<const void*, V, std::hash<const void*>, std::equal_to<>,
                                     cache_line_allocator<std::pair<const void* const, V>>>;
    table<buffer_state> buffers;
    table<std::vector<task_handle, cache_line_allocator<task_handle>>> operations;  ///< by after_all: the last operation's tasks
    std::size_t since_sweep = 0;
  };
  // Many shards, so that two host threads whose operations touch different buffers seldom
  // meet on one: with 64, two threads each using five buffers shared a shard in a third of
  // the runs (and then on every operation, as the caching allocators hand back the same
  // addresses), which cost each thread a fifth more time per operation.
  static constexpr std::size_t shard_count = 1024;
  static constexpr std::size_t words = shard_count / 64;
  /// @brief A set of shards, one bit each.
  using shard_set = std::array<std::uint64_t, words>;

  static std::size_t shard_index(const void* p) {
    return static_cast<std::size_t>(((reinterpret_cast<std::uintptr_t>(p) >> 4) * 0x9E3779B97F4A7C15ull) >> (64 - std::countr_zero(shard_count)));
  }
  shard& shard_for(const void* p) { return shards_[shard_index(p)]; }

  /// @brief Adds the shards a task's buffers and operation token fall in to `set`.
  static void add_shards(const access& uses, shard_set& set) {
    auto add = [&](const void* p) {
      const std::size_t i = shard_index(p);
      set[i / 64] |= std::uint64_t{1} << (i % 64);
    };
    for (const void* b : uses.reads) add(b);
    for (const void* b : uses.writes) add(b);
    if (uses.after_all != nullptr) add(uses.after_all);
  }

  /// @brief Holds the locks of the shards in `mask`, taken in shard order (so two
  /// submissions never hold one each of two shards the other wants).
  class shard_locks {
   public:
    shard_locks(engine& e, const shard_set& set) : e_(e), set_(set) {
      each([&](shard& s) { s.lock.lock(); });
    }
    ~shard_locks() {
      each([&](shard& s) { s.lock.unlock(); });
    }
    shard_locks(const shard_locks&) = delete;
    shard_locks& operator=(const shard_locks&) = delete;

   private:
    template <class F>
    void each(F f) {
      for (std::size_t w = 0; w < words; ++w)
        for (std::uint64_t m = set_[w]; m != 0; m &= m - 1) f(e_.shards_[w * 64 + static_cast<std::size_t>(std::countr_zero(m))]);
    }
    engine& e_;
    const shard_set& set_;
  };
  static_assert(std::has_single_bit(shard_count) && shard_count % 64 == 0, "shards are counted in 64-bit words, a power of two of them");

  /// @brief A task of `r`; its id, its place in the order, is given under the locks.
  static task_handle make(task_request& r) {
    auto t = std::make_shared<task_state>();
    t->fn = std::move(r.fn);
    t->home = r.home;
    t->op = r.op;
    t->category = r.category;
    t->runs_cancelled = r.runs_cancelled;
    t->quiet = r.quiet;
    t->keeps_failure = r.keeps_failure;
    t->detail = std::move(r.detail);
    if (current_lane() != nullptr && timeline_on()) {  // queued by the task its lane runs
      t->queued_on = current_track();
      t->queued_at = timeline_clock::now();
    }
    return t;
  }

  static bool live(const task_handle& t) { return t && !t->ended.load(std::memory_order_acquire); }
  /// @brief Whether `t` failed and its failure stays with what it wrote (task_request::keeps_failure).
  static bool keeps_its_failure(const task_handle& t) {
    if (!t || !t->keeps_failure) return false;
    std::lock_guard lock(t->mutex);
    return t->failed;
  }

  /// @brief The id of a task being submitted (under its shards' locks): its place in the order
  /// of submission, which the timeline shows. Tasks submitted while no timeline records get
  /// none (0): the counter is the one thing every submission of every host thread would write.
  std::uint64_t next_id() { return timeline_on() ? submitted_.fetch_add(1, std::memory_order_relaxed) + 1 : 0; }

  /// @brief Makes `t` wait for what it conflicts with (under the locks of its shards).
  void link_all(const task_handle& t, const access& uses) {
    if (uses.after_all != nullptr) {
      auto& operations = shard_for(uses.after_all).operations;
      if (const auto found = operations.find(uses.after_all); found != operations.end())
        for (const auto& before : found->second) link(t, *before, false);
    }
    for (const void* b : uses.reads) {
      auto& buffers = shard_for(b).buffers;
      const auto found = buffers.find(b);
      if (found != buffers.end() && found->second.writer) link(t, *found->second.writer, true);  // read after write
    }
    for (const void* b : uses.writes) {
      auto& buffers = shard_for(b).buffers;
      const auto found = buffers.find(b);
      if (found == buffers.end()) continue;
      if (found->second.writer) link(t, *found->second.writer, false);  // write after write: an order, not a result
      for (const auto& r : found->second.readers)
        if (r.get() != t.get()) link(t, *r, false);  // write after read
    }
  }

  /// @brief Records `t` as a reader and writer of its buffers (under the locks of its shards).
  void record(const task_handle& t, const access& uses) {
    // a shard forgets its ended tasks every 16 records
    auto note = [](shard& s) {
      if (++s.since_sweep >= 16) sweep(s);
    };
    for (const void* b : uses.reads) {
      shard& sh = shard_for(b);
      auto& s = sh.buffers[b];
      // readers that have ended no longer matter: dropped now and then, not on every read
      if (s.readers.size() >= 16) std::erase_if(s.readers, [](const task_handle& r) { return !live(r); });
      s.readers.push_back(t);
      note(sh);
    }
    for (const void* b : uses.writes) {
      shard& sh = shard_for(b);
      auto& s = sh.buffers[b];
      s.writer = t;
      s.readers.clear();
      note(sh);
    }
  }

  /// @brief Forgets the buffers of shard `s` whose tasks have all ended (under its lock).
  static void sweep(shard& s) {
    s.since_sweep = 0;
    std::erase_if(s.operations, [](const auto& entry) {
      for (const auto& t : entry.second)
        if (live(t)) return false;
      return true;
    });
    std::erase_if(s.buffers, [](const auto& entry) {
      const buffer_state& b = entry.second;
      if (live(b.writer) || keeps_its_failure(b.writer)) return false;
      for (const auto& r : b.readers)
        if (live(r)) return false;
      return true;
    });
  }

  std::array<shard, shard_count> shards_;
  std::atomic<std::uint64_t> submitted_{0};
};

/// @brief How `t` ended, once it has: nothing, or the error it failed or was cancelled with,
/// its message saying where the failure began when it was cancelled.
inline std::optional<captured_error> outcome(const task_state& t) {
  std::lock_guard lock(const_cast<task_state&>(t).mutex);
  if (!t.failed) return std::nullopt;
  return t.cancelled ? cancellation_of(t) : *t.error;
}

/// @brief Throws a pdo::error at once if the calling thread is `t`'s lane and `t` has not
/// ended: a lane that waits for a task queued on itself would wait forever.
inline void check_not_own_lane(const task_state& t, const char* op) {
  if (!t.ended.load(std::memory_order_acquire) && t.home != nullptr && t.home->on_this_thread())
    throw error(std::string(op) + ": called on " + t.home->place_name() + "'s " + lane_name(t.home->kind()) +
                " lane, it would wait for work queued behind the task it runs in (" + t.op +
                "); mesh-wide operations and waits run on the host thread, not inside a parallel_do block or an spmd task");
}

/// @brief Waits until `t` has ended; throws what it failed or was cancelled with (its
/// pdo::error subclass), after "`op` on place: ".
inline void wait(const task_handle& t) {
  check_not_own_lane(*t, t->op);
  t->wait_ended();
  if (auto e = outcome(*t)) e->rethrow_with_context(std::string(t->op) + " on " + t->home->place_name() + ": ");
}

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_EXEC_ENGINE_HPP

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(PDO_WITH_MPI)
#endif

namespace pdo::detail {

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
  captured_error error;
};

/// @brief How the tasks of one mesh-wide operation take part in the mesh's collectives.
struct batch_options {
  const char* op = "spmd";          ///< a string literal: the trace's name and the errors' first word
  const char* category = "task";    ///< for the trace: "kernel", "collective", "copy", "task"
  /// @brief The tasks run collectives: a failure aborts them in a mesh of this process (so
  /// the others do not wait for it); in a mesh over several processes, a failure the other
  /// processes cannot learn of ends the job (end_job).
  bool communicate = true;
  /// @brief The tasks run the mesh's collectives, each until it ends: a task that ends tells
  /// the others of its groups in this process that it will join no more (mesh_comms::left),
  /// and the last task to end makes the groups usable again (resetting them if a task
  /// failed, in a mesh of this process). The operations on a mesh follow each other whole
  /// (engine's after_all), so no task of a later one is inside a collective then.
  bool closing = false;
  /// @brief The lane of each place the tasks run on.
  lane_kind lane = lane_kind::compute;
  /// @brief The caller waits for the tasks at once: the first is queued without waking its
  /// lane, since the caller will run it itself if it can (place_batch::wait).
  bool caller_waits = false;
  /// @brief A step of a program every process runs alike (an evaluation's kernel): in a mesh
  /// over several processes its failure on one process ends the job, as a collective's does
  /// (the other processes go on to the next collective, which waits for this one).
  bool ends_job = false;
  /// @brief The tasks' failures stay with the buffers they write until the caller forgets
  /// them (task_request::keeps_failure).
  bool keeps_failure = false;
};

/// @brief The work of one place in a mesh-wide operation, type-erased: `call(context, p, k)`
/// runs it for mesh place `p`, the `k`-th of this process. A plain function and a pointer, so
/// that every operation shares one submission path (no copy of it per kind of work).
struct place_work {
  void (*call)(void* context, std::size_t p, std::size_t k) = nullptr;
  void* context = nullptr;
};

/// @brief What the tasks of one operation read and write on each place, asked while they are
/// submitted: `call(context, p, k)`, or nothing when `call` is null.
struct place_access {
  access (*call)(const void* context, std::size_t p, std::size_t k) = nullptr;
  const void* context = nullptr;
};

/// @brief The trace's detail of an operation, made only while the timeline records:
/// `call(context)`, or none when `call` is null.
struct place_detail {
  std::string (*call)(const void* context) = nullptr;
  const void* context = nullptr;
};

/// @brief The tasks of one mesh-wide operation, one per place of this process, and how they ended.
struct place_batch {
  explicit place_batch(std::size_t n) : failures(n) {}
  std::vector<task_handle> tasks;
  std::vector<std::size_t> places;                      ///< mesh index of each task's place
  std::vector<std::optional<captured_error>> failures;  ///< per task, once it has ended
  std::atomic<std::size_t> arrived{0};                  ///< tasks done with their work
  std::atomic<std::size_t> done{0};                     ///< tasks done with their work and the mesh's collectives
  place_work work;                                      ///< what each task runs
  std::shared_ptr<void> work_owner;                      ///< keeps work's context alive, when the batch owns it
  mesh_comms* comms = nullptr;                          ///< the mesh's communicators
  bool local_only = true;                               ///< the mesh lies in this process
  bool communicate = true;                              ///< see batch_options
  bool ends_job = false;                                ///< see batch_options
  bool closing = false;                                 ///< see batch_options

  /// @brief Whether every task is done (its results written, its failure recorded).
  [[nodiscard]] bool finished() const { return done.load(std::memory_order_acquire) == failures.size(); }
  /// @brief Waits for every task (a pdo::error at once when that would wait forever):
  /// looks a while, yielding the core, then sleeps.
  void wait() const {
    for (const auto& t : tasks) check_not_own_lane(*t, t->op);
    // a task its lane has not started, and could start now, runs here: no hand-over to its
    // lane's thread and back (the others run on their lanes meanwhile)
    for (const auto& t : tasks)
      if (!t->ended.load(std::memory_order_acquire) && !t->home->run_here(*t)) t->home->poke();
    const std::size_t n = failures.size();
    for (int poll = 0; poll < 200; ++poll) {
      if (done.load(std::memory_order_acquire) == n) return;
      std::this_thread::yield();
    }
    for (std::size_t now = done.load(std::memory_order_acquire); now != n; now = done.load(std::memory_order_acquire))
      done.wait(now, std::memory_order_acquire);
  }
  /// @brief The first failure that is a cause, not an echo of another's (call after wait()).
  [[nodiscard]] std::optional<place_failure> first_failure() const {
    std::optional<place_failure> first;
    for (std::size_t k = 0; k < failures.size(); ++k) {
      if (!failures[k]) continue;
      if (!first || (first->error.is_abort_echo() && !failures[k]->is_abort_echo())) first = place_failure{places[k], *failures[k]};
    }
    return first;
  }

  /// @brief The `k`-th task's work on mesh place `p`, and how it ends: a failure is recorded,
  /// releases the mesh's other places from their collectives (or ends the job when they are
  /// in other processes and cannot learn of it), and reaches the engine.
  void run(std::size_t p, std::size_t k) {
    try {
      if (const captured_error* cause = cancelled_by(); cause != nullptr) cause->rethrow_with_context("");
      work.call(work.context, p, k);
    } catch (...) {
      failures[k] = captured_error::current();
      if (local_only) {
        if (communicate) comms->abort();
      } else if ((communicate || ends_job) && !shared_by_all_members(failures[k]->kind)) {
        end_job(current_place()->name + ": " + failures[k]->message);
      }
    }
    // a task that ended has made all its collectives: the others of its groups in this
    // process, waiting in one or entering one, would wait for it forever (other processes'
    // members are found by MPI's watch)
    if (closing && !failures[k]) comms->left(p);
    if (closing && arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == failures.size()) {
      // the last of the operation's tasks: the others are past their collectives, and no
      // later operation's task starts before this one ends
      bool failed = false;
      for (const auto& f : failures) failed = failed || f.has_value();
      if (failed) comms->reset();
      comms->rejoin();
    }
    // the caller may go on now: nothing below touches the mesh, the caller's task or its results
    done.fetch_add(1, std::memory_order_acq_rel);
    done.notify_all();
    // the engine learns of the failure: the tasks that need this one's results are cancelled
    // (the task holds the batch)
    if (failures[k]) failures[k]->rethrow_with_context("");
  }
};

/// @brief No buffers declared: the tasks are ordered by their lanes only.
struct no_access {
  access operator()(std::size_t, std::size_t) const { return {}; }
};

/// @brief Throws a pdo::error at once when called on a place's lane: a mesh-wide operation
/// started inside a task of that mesh would queue behind the task it runs in.
inline void check_not_nested(const char* op) {
  if (const lane* l = current_lane(); l != nullptr)
    throw layout_error(std::string(op) + ": a mesh-wide operation was started inside a task of place " + l->place_name() + " (its " +
                       lane_name(l->kind()) + " lane); call it from a host thread, not from a parallel_do block or an spmd "
                       "task (inside them, work on the local shards with pdo::eval of local tensors and the communicators)");
}

/// @brief Submits `work` for every place of the mesh `state` in this process, on its lane
/// `o.lane`, reading and writing what `uses` says, and returns without waiting. `owner`
/// keeps work's context alive until the tasks are freed (null: the caller keeps it alive).
PDO_NOINLINE inline std::shared_ptr<place_batch> submit_on_mesh(const mesh_state& state, mesh_comms& comms, place_work work,
                                                   std::shared_ptr<void> owner, batch_options o, place_access uses = {},
                                                   place_detail describe = {}) {
  check_not_nested(o.op);
  const auto& local = state.local;
  auto batch = std::make_shared<place_batch>(local.size());
  batch->places = local;
  batch->work = work;
  batch->work_owner = std::move(owner);
  batch->comms = &comms;
  batch->local_only = !state.multiprocess;
  batch->communicate = o.communicate;
  batch->ends_job = o.ends_job;
  batch->closing = o.closing;
  std::vector<task_request> requests(local.size());
  std::string detail;
  if (describe.call != nullptr && timeline_on()) detail = describe.call(describe.context);
  for (std::size_t k = 0; k < local.size(); ++k) {
    task_request& r = requests[k];
    r.home = &lane_of(*state.places[local[k]].state(), o.lane);
    r.op = o.op;
    r.category = o.category;
    r.detail = detail;
    r.runs_cancelled = true;  // a cancelled task still meets the others of its operation
    r.quiet = o.caller_waits && k == 0;
    r.keeps_failure = o.keeps_failure;
    if (uses.call != nullptr) r.uses = uses.call(uses.context, local[k], k);
    if (o.communicate) r.uses.after_all = &comms;  // operations that communicate on one mesh follow each other whole
    r.fn = [batch, k, p = local[k]] { batch->run(p, k); };
  }
  batch->tasks = engine::instance().submit(requests);
  return batch;
}

/// @brief `access_of(place_index, local_ordinal)` (kept alive by the caller) as the plain
/// function the submission asks; nothing for no_access.
template <class Access>
place_access access_of_places(const Access& access_of) {
  if constexpr (std::is_same_v<Access, no_access>) return {};
  else return {[](const void* c, std::size_t p, std::size_t k) { return access((*static_cast<const Access*>(c))(p, k)); }, &access_of};
}

/// @brief Submits `task(place_index, local_ordinal)` for every place of `m` in this process,
/// on its lane `o.lane`, reading and writing what `access_of(place_index, local_ordinal)`
/// says, and returns without waiting (the batch keeps `task` until its tasks are freed).
/// `describe()` gives the trace's detail (called only while the timeline records).
template <class Mesh, class Task, class Access = no_access, class Describe = std::nullptr_t>
std::shared_ptr<place_batch> submit_on_places(const Mesh& m, Task task, batch_options o, Access access_of = {},
                                              Describe describe = nullptr) {
  auto owner = std::make_shared<Task>(std::move(task));
  const place_work work{[](void* c, std::size_t p, std::size_t k) { std::as_const(*static_cast<Task*>(c))(p, k); }, owner.get()};
  const place_access uses = access_of_places(access_of);
  place_detail detail;
  if constexpr (!std::is_same_v<Describe, std::nullptr_t>)
    detail = {[](const void* c) { return std::string((*static_cast<const Describe*>(c))()); }, &describe};
  return submit_on_mesh(*m.state(), comms_of(m), work, std::move(owner), o, uses, detail);
}

/// @brief Runs `task(place_index, local_ordinal)` on every place of `m` that lives in this
/// process, all at once, and waits for all of them.
///
/// When a task fails in a mesh of this process only, the mesh's collectives are aborted
/// so the other places do not wait for it, and reset once every task has returned, so
/// the mesh stays usable. In a mesh over several processes, tasks that `communicate`
/// cannot be unwound that way: an argument mismatch is thrown alike by every member
/// (pdo::mismatch_error) and returned here, any other failure ends the job (end_job).
/// `access_of(place_index, local_ordinal)` names what each task reads and writes: it waits
/// for the tasks queued before that write what it reads, and is cancelled with the error of
/// one that failed.
/// @return the ended batch: each local place's failure, if any (`failures`, by local ordinal)
template <class Mesh, class Task, class Access = no_access>
std::shared_ptr<place_batch> run_batch_on_places(const Mesh& m, Task&& task, bool communicate, const char* op, const char* category,
                                                 Access access_of = {}) {
  const bool local_only = !m.is_multiprocess();
  // waited for here: the tasks call `task` and `access_of` where they are, owning nothing
  using task_t = std::remove_reference_t<Task>;
  const place_work work{[](void* c, std::size_t p, std::size_t k) { (*static_cast<task_t*>(c))(p, k); },
                        const_cast<void*>(static_cast<const void*>(std::addressof(task)))};
  const place_access uses = access_of_places(access_of);
  auto batch = submit_on_mesh(*m.state(), comms_of(m), work, nullptr,
                              batch_options{op, category, communicate || local_only, communicate || local_only, lane_kind::compute, true}, uses);
  batch->wait();
  return batch;
}

/// @brief run_batch_on_places, giving the first failure that is a cause, not an echo of
/// another's, or nothing.
template <class Mesh, class Task, class Access = no_access>
std::optional<place_failure> try_run_on_places(const Mesh& m, Task&& task, bool communicate = true, const char* op = "spmd",
                                               const char* category = "task", Access access_of = {}) {
  return run_batch_on_places(m, std::forward<Task>(task), communicate, op, category, access_of)->first_failure();
}

/// @brief try_run_on_places, throwing the failure as a pdo::error naming `op` and the place.
template <class Mesh, class Task>
void run_on_places(const char* op, const Mesh& m, Task&& task, const char* category = "task") {
  if (auto failure = try_run_on_places(m, std::forward<Task>(task), true, op, category))
    failure->error.rethrow_with_context(std::string(op) + ": on place " + m.place(failure->place).name() + ": ");
}

/// @brief The mesh-wide operations of one op, submitted one after another on different
/// lanes (a halo exchange on the communication lanes beside kernels on the compute lanes,
/// ordered by the buffers they name), waited for together. Its tasks may use the caller's
/// locals: it waits for every task to end before it goes, also when a submission throws.
class batch_sequence {
 public:
  explicit batch_sequence(const char* op) : op_(op) {}
  batch_sequence(const batch_sequence&) = delete;
  batch_sequence& operator=(const batch_sequence&) = delete;
  ~batch_sequence() {
    for (const auto& b : batches_)
      for (const auto& t : b->tasks) t->wait_ended();
  }

  /// @brief Submits one operation: `task(place_index, local_ordinal)` on every place of `m` in
  /// this process, on lane `lane`, with `access_of(place_index, local_ordinal)`'s reads and
  /// writes; `communicate`: its tasks run the mesh's collectives.
  template <class Mesh, class Task, class Access>
  void submit(const Mesh& m, lane_kind lane, bool communicate, Task task, Access access_of) {
    auto written = [&](std::size_t p, std::size_t k) {
      access a = access_of(p, k);
      written_.insert(written_.end(), a.writes.begin(), a.writes.end());
      return a;
    };
    batches_.push_back(submit_on_places(m, std::move(task),
                                        batch_options{op_, communicate ? "collective" : "kernel", communicate, communicate, lane, false},
                                        written));
  }

  /// @brief Waits for every task; throws the failure of the first operation that failed (the
  /// later ones' tasks that needed its results were cancelled by it) naming the op and place.
  template <class Mesh>
  void finish(const Mesh& m) {
    for (const auto& b : batches_) b->wait();
    for (const auto& b : batches_)
      if (const auto failure = b->first_failure()) {
        engine::instance().forget(written_);  // the caller's buffers: later storage may take their addresses
        failure->error.rethrow_with_context(std::string(op_) + ": on place " + m.place(failure->place).name() + ": ");
      }
  }

 private:
  const char* op_;
  std::vector<std::shared_ptr<place_batch>> batches_;
  std::vector<const void*> written_;
};

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
#endif  // PDO_SINGLE_PDO_EXEC_RUN_ON_PLACES_HPP
// ---- pdo/exec/run_plan.hpp
#ifndef PDO_SINGLE_PDO_EXEC_RUN_PLAN_HPP
#define PDO_SINGLE_PDO_EXEC_RUN_PLAN_HPP
// pdo/exec/run_plan.hpp: evaluation runs the plan. The steps of plan_of<E>() (kernels,
// redistributions of operands, combines) are executed in the plan's order, each by the
// code its step names: a local evaluation runs them one after the other on the calling
// thread; a distributed one submits each step to the engine as a task on every place (a
// kernel on the compute lane, a collective on the communication lane), ordered by the
// buffers it reads and writes.

// ---- pdo/plan/plan.hpp
#ifndef PDO_SINGLE_PDO_PLAN_PLAN_HPP
#define PDO_SINGLE_PDO_PLAN_PLAN_HPP
// pdo/plan/plan.hpp: the plan of an expression, computed from its type at compile time.

// ---- pdo/expr/expression.hpp
#ifndef PDO_SINGLE_PDO_EXPR_EXPRESSION_HPP
#define PDO_SINGLE_PDO_EXPR_EXPRESSION_HPP
// pdo/expr/expression.hpp: what every expression node has, and the leaves. How a plan of nodes
// runs is exec's (pdo/exec/run_plan.hpp): a node's kernel reads its operands through the
// context it is given.

// ---- pdo/kernels/place_system.hpp
#ifndef PDO_SINGLE_PDO_KERNELS_PLACE_SYSTEM_HPP
#define PDO_SINGLE_PDO_KERNELS_PLACE_SYSTEM_HPP
// pdo/kernels/place_system.hpp: a Thrust system per backend (a CPU place's cores, a GPU place's
// compute stream), each with its own algorithms, and the system of the place a kernel runs on.

// ---- pdo/kernels/cuda_system.hpp
#ifndef PDO_SINGLE_PDO_KERNELS_CUDA_SYSTEM_HPP
#define PDO_SINGLE_PDO_KERNELS_CUDA_SYSTEM_HPP
// pdo/kernels/cuda_system.hpp: the algorithms of pdo's kernels on a GPU place: the same
// functors as on CPU places (each a PDO_HD functor of an output index), run on the place's
// compute stream without waiting for them. Under nvcc they are Thrust's for_each (CUB's
// DeviceFor), CUB's DeviceReduce and, for reductions along a dim or a row, CUB's
// DeviceSegmentedReduce (a block of threads per long row), whose temporary storage comes from
// the place's caching allocator (in its cap and statistics, and stream-ordered). Built against the simulated
// devices of tests/cuda_sim (PDO_CUDA_SIMULATOR), the same functors run as the stream's
// device work. A reduction either writes its result into device memory (no wait), or brings
// it back to the host, waiting for its own stream only.
//
// In a translation unit compiled by a host compiler against the real CUDA runtime, work on
// a GPU place that needs a kernel throws a pdo::error that says so (cuBLAS and the copies
// need no kernel of ours and work from any translation unit).


#include <cstddef>
#include <cstdint>
#include <string>

// Host-only builds take Thrust's C++ system as the device system, so no CUDA header is needed.
#if !defined(__CUDACC__) && !defined(THRUST_DEVICE_SYSTEM)
#define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_CPP
#endif
#include <thrust/iterator/counting_iterator.h>

#if defined(PDO_WITH_CUDA) && defined(__CUDACC__)
#include <cub/device/device_reduce.cuh>
#include <cub/device/device_segmented_reduce.cuh>
#include <thrust/iterator/transform_iterator.h>
#include <thrust/for_each.h>
#include <thrust/system/cuda/execution_policy.h>
#include <thrust/system_error.h>
#endif

namespace pdo::detail {

/// @brief `n` elements of T in the memory of place `p`, for the kernels of one op, given back
/// when it goes. A GPU place's allocator is stream-ordered on its compute stream, so the kernels
/// queued there before then still have them.
template <class T>
class kernel_scratch {
 public:
  kernel_scratch(place_state& p, std::size_t n)
      : place_(p), bytes_((n == 0 ? 1 : n) * sizeof(T)), data_(static_cast<T*>(p.memory->allocate(bytes_))) {}
  ~kernel_scratch() { place_.memory->deallocate(data_, bytes_); }
  kernel_scratch(const kernel_scratch&) = delete;
  kernel_scratch& operator=(const kernel_scratch&) = delete;
  [[nodiscard]] T* data() const { return data_; }

 private:
  place_state& place_;
  std::size_t bytes_;
  T* data_;
};

/// @brief Segment s of a segmented reduction: reduce over k in [0, length) of f(s, k) with
/// `op`, from `init`, in order; one work item per segment (a CPU place's loop, and a GPU's
/// kernel for short segments).
template <class F, class T, class Op>
struct reduce_segment {
  F f;
  T init;
  Op op;
  std::size_t length;
  PDO_HD T operator()(std::size_t s) const {
    T acc = init;
    for (std::size_t k = 0; k < length; ++k) acc = op(acc, f(s, k));
    return acc;
  }
};

/// @brief Segments at least this long are reduced by a block of GPU threads each (CUB's
/// segmented reduction); shorter ones by one thread each.
inline constexpr std::size_t long_segment = 256;

#if defined(PDO_WITH_CUDA) && (defined(__CUDACC__) || defined(PDO_CUDA_SIMULATOR))
inline constexpr bool cuda_kernels_enabled = true;

/// @brief out[i - base] = f(i): a transform over an index range as one for_each work item.
template <class Out, class F>
struct write_element {
  Out out;
  F f;
  std::size_t base;
  PDO_HD void operator()(std::size_t i) const { out[i - base] = f(i); }
};

/// @brief out[0] = reduce over k in [first, last) of f(k), from `init`, sequentially: the
/// simulator's reduction kernel.
template <class F, class T, class Op>
struct reduce_range {
  F f;
  T init;
  Op op;
  std::size_t first, last;
  T* out;
  PDO_HD void operator()(std::size_t) const {
    T acc = init;
    for (std::size_t k = first; k < last; ++k) acc = op(acc, f(k));
    *out = acc;
  }
};

#if defined(__CUDACC__)
/// @brief Runs `launch(policy)` with the CUDA policy of GPU place `p` (its compute stream),
/// turning Thrust's and CUDA's failures into a pdo::error naming the place.
template <class Launch>
auto on_gpu_stream(place_state& p, const char* what, Launch&& launch) {
  cuda_device& d = cuda_device_of(p);
  device_guard guard(d.ordinal);
  try {
    auto result = launch(thrust::cuda::par_nosync.on(d.compute));
    cuda_check(cudaGetLastError(), what, p.name);
    return result;
  } catch (const thrust::system_error& e) {
    throw error(std::string(what) + " on " + p.name + ": " + e.what());
  }
}

/// @brief f(first + k) for k in [0, n) on the place's compute stream, as Thrust's for_each
/// (CUB's DeviceFor: one kernel per functor).
template <class F>
void launch_indices(place_state& p, std::size_t first, std::size_t n, F f, const char* what) {
  on_gpu_stream(p, what, [&](auto policy) { return thrust::for_each_n(policy, thrust::counting_iterator<std::size_t>(first), n, f); });
}

/// @brief out[0] = reduce of f over [first, last) on the place's compute stream: CUB's
/// DeviceReduce, its temporary storage from the place's allocator (freed, stream-ordered,
/// once the reduction is queued: later work of the stream reuses it only after).
template <class F, class T, class Op>
void launch_reduce_into(place_state& p, std::size_t first, std::size_t last, F f, T init, Op op, T* out) {
  cuda_device& d = cuda_device_of(p);
  device_guard guard(d.ordinal);
  const thrust::counting_iterator<std::size_t> in(first);
  std::size_t bytes = 0;
  cuda_check(cub::DeviceReduce::TransformReduce(nullptr, bytes, in, out, last - first, op, f, init, d.compute),
             "cub::DeviceReduce::TransformReduce", p.name);
  const kernel_scratch<unsigned char> storage(p, bytes);
  cuda_check(cub::DeviceReduce::TransformReduce(storage.data(), bytes, in, out, last - first, op, f, init, d.compute),
             "cub::DeviceReduce::TransformReduce", p.name);
}

/// @brief f(s, k) as element s * length + k of one flat sequence, whose segments CUB reduces.
template <class F, class T>
struct segment_element {
  F f;
  std::size_t length;
  PDO_HD T operator()(std::size_t i) const { return f(i / length, i % length); }
};

/// @brief Where segment s starts in the flat sequence.
struct segment_start {
  std::size_t length;
  PDO_HD std::int64_t operator()(std::size_t s) const { return static_cast<std::int64_t>(s * length); }
};

/// @brief out[s] = reduce over k of f(s, k), for s in [0, segments), on the place's compute
/// stream: CUB's DeviceSegmentedReduce (a block of threads per segment) for long segments whose
/// elements are `contiguous` in memory, its temporary storage from the place's allocator; one
/// thread per segment for short ones and for strided ones (whose threads then read neighbouring
/// elements at each step).
template <class F, class T, class Op, class Out>
void launch_segmented_reduce(place_state& p, std::size_t segments, std::size_t length, bool contiguous, F f, T init, Op op, Out out) {
  if (segments == 0) return;
  if (length < long_segment || !contiguous) {  // strided rows: neighbouring threads read neighbouring elements
    launch_indices(p, 0, segments, write_element<Out, reduce_segment<F, T, Op>>{out, {f, init, op, length}, 0}, "segmented reduction kernel");
    return;
  }
  cuda_device& d = cuda_device_of(p);
  device_guard guard(d.ordinal);
  const auto in = thrust::make_transform_iterator(thrust::counting_iterator<std::size_t>(0), segment_element<F, T>{f, length});
  const auto begins = thrust::make_transform_iterator(thrust::counting_iterator<std::size_t>(0), segment_start{length});
  const auto ends = begins + 1;
  const auto count = static_cast<std::int64_t>(segments);
  std::size_t bytes = 0;
  cuda_check(cub::DeviceSegmentedReduce::Reduce(nullptr, bytes, in, out, count, begins, ends, op, init, d.compute),
             "cub::DeviceSegmentedReduce::Reduce", p.name);
  const kernel_scratch<unsigned char> storage(p, bytes);
  cuda_check(cub::DeviceSegmentedReduce::Reduce(storage.data(), bytes, in, out, count, begins, ends, op, init, d.compute),
             "cub::DeviceSegmentedReduce::Reduce", p.name);
}
#else
/// @brief f(first + k) for k in [0, n) as device work of the place's compute stream (the
/// simulated device runs it on the stream's thread, after the work queued before it).
template <class F>
void launch_indices(place_state& p, std::size_t first, std::size_t n, F f, const char* what) {
  if (n == 0) return;
  struct job {
    F f;
    std::size_t first;
  };
  cuda_device& d = cuda_device_of(p);
  device_guard guard(d.ordinal);
  auto* work = new job{f, first};
  cuda_check(cudaSimLaunchKernel(
                 d.compute, n,
                 [](void* args, unsigned long long begin, unsigned long long end) {
                   const job& j = *static_cast<const job*>(args);
                   for (unsigned long long k = begin; k < end; ++k) j.f(j.first + static_cast<std::size_t>(k));
                 },
                 work, [](void* args) { delete static_cast<job*>(args); }),
             what, p.name);
}

template <class F, class T, class Op>
void launch_reduce_into(place_state& p, std::size_t first, std::size_t last, F f, T init, Op op, T* out) {
  launch_indices(p, 0, 1, reduce_range<F, T, Op>{f, init, op, first, last, out}, "reduction kernel");
}

/// @brief out[s] = reduce over k of f(s, k), for s in [0, segments): a work item per segment.
template <class F, class T, class Op, class Out>
void launch_segmented_reduce(place_state& p, std::size_t segments, std::size_t length, bool, F f, T init, Op op, Out out) {
  launch_indices(p, 0, segments, write_element<Out, reduce_segment<F, T, Op>>{out, {f, init, op, length}, 0}, "segmented reduction kernel");
}
#endif

/// @brief out[k] = f(first + k) on the place's compute stream.
template <class Out, class F>
Out gpu_transform(place_state& p, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last, Out out, F f) {
  const std::size_t n = *last - *first;
  launch_indices(p, *first, n, write_element<Out, F>{out, f, *first}, "thrust::for_each_n");
  return out + static_cast<std::ptrdiff_t>(n);
}
template <class F>
thrust::counting_iterator<std::size_t> gpu_for_each_n(place_state& p, thrust::counting_iterator<std::size_t> first, std::size_t n, F f) {
  launch_indices(p, *first, n, f, "thrust::for_each_n");
  return first + static_cast<std::ptrdiff_t>(n);
}

/// @brief *out (device memory of `p`) = the reduction, queued on the place's compute stream.
template <class F, class T, class Op>
void gpu_transform_reduce_into(place_state& p, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last,
                               F f, T init, Op op, T* out) {
  launch_reduce_into(p, *first, *last, f, init, op, out);
}

/// @brief out[s] (device memory of `p`) = reduce over k in [0, length) of f(s, k), for s in
/// [0, segments), queued on the place's compute stream; `contiguous`: each segment's elements
/// are next to each other in memory.
template <class F, class T, class Op, class Out>
void gpu_segmented_reduce(place_state& p, std::size_t segments, std::size_t length, bool contiguous, F f, T init, Op op, Out out) {
  launch_segmented_reduce(p, segments, length, contiguous, f, init, op, out);
}

/// @brief The reduction, brought back to the host (waits for the place's compute stream).
template <class F, class T, class Op>
T gpu_transform_reduce(place_state& p, thrust::counting_iterator<std::size_t> first, thrust::counting_iterator<std::size_t> last, F f,
                       T init, Op op) {
  cuda_device& d = cuda_device_of(p);
  const kernel_scratch<T> scalar(p, 1);
  launch_reduce_into(p, *first, *last, f, init, op, scalar.data());
  T result{};
  device_guard guard(d.ordinal);
  cuda_check(cudaMemcpyAsync(&result, scalar.data(), sizeof(T), cudaMemcpyDeviceToHost, d.compute), "cudaMemcpyAsync", p.name);
  wait_for_stream(d, d.compute);
  return result;
}
#else
inline constexpr bool cuda_kernels_enabled = false;

[[noreturn]] inline void no_gpu_kernels(const place_state& p) {
  if constexpr (!cuda_enabled) no_cuda("a kernel", p.name);
  throw error("a kernel on " + p.name + ": GPU kernels are compiled by nvcc; compile this translation unit as CUDA");
}
template <class Out, class First, class F>
Out gpu_transform(place_state& p, First, First, Out, F) {
  no_gpu_kernels(p);
}
template <class First, class F>
First gpu_for_each_n(place_state& p, First, std::size_t, F) {
  no_gpu_kernels(p);
}
template <class F, class T, class Op, class First>
T gpu_transform_reduce(place_state& p, First, First, F, T, Op) {
  no_gpu_kernels(p);
}
template <class F, class T, class Op, class First>
void gpu_transform_reduce_into(place_state& p, First, First, F, T, Op, T*) {
  no_gpu_kernels(p);
}
template <class F, class T, class Op, class Out>
void gpu_segmented_reduce(place_state& p, std::size_t, std::size_t, bool, F, T, Op, Out) {
  no_gpu_kernels(p);
}
#endif

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_KERNELS_CUDA_SYSTEM_HPP

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

/// @brief f(first + k) for k in [0, n), for work items that write several outputs each
/// (a row of a softmax); items run in parallel over the place's cores.
template <class F>
thrust::counting_iterator<std::size_t> for_each_n([[maybe_unused]] cpu_system& system, thrust::counting_iterator<std::size_t> first,
                                                  std::size_t n, F f) {
  const std::size_t base = *first;
  if (system.threads > 1 && n > 1) {
    struct job {
      const F& f;
      std::size_t base, n;
    } j{f, base, n};
    run_team(system.threads, [](void* c, std::size_t t, std::size_t nt) {
      const job& j = *static_cast<const job*>(c);
      const auto [begin, end] = team_part(j.n, t, nt);
      for_each_range(j.f, j.base, begin, end);
    }, &j);
  } else {
    for_each_range(f, base, 0, n);
  }
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

/// @brief f(i) for i in [0, n), over data in the memory of `where` (a tensor's place; null:
/// host memory), run where that memory can be read: on a GPU's place (from its compute lane, the
/// calling thread waiting, when called from elsewhere), else as host loops over the calling
/// thread's cores (one core on a GPU place's lane).
template <class F>
void for_each_index(place_state* where, std::size_t n, F f) {
  if (on_gpu(where) && current_place() != where) return run_on_place(*where, [&] { for_each_index(where, n, f); });
  place_system system = current_place_system();
  if (system.gpu != memory_of(where)) system = place_system{};
  thrust::for_each_n(system, thrust::counting_iterator<std::size_t>(0), n, f);
}

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_KERNELS_PLACE_SYSTEM_HPP
// ---- pdo/layout/propagation.hpp
#ifndef PDO_SINGLE_PDO_LAYOUT_PROPAGATION_HPP
#define PDO_SINGLE_PDO_LAYOUT_PROPAGATION_HPP
// pdo/layout/propagation.hpp: sharding propagation: each op's output layout and the layouts it needs of its operands.

// ---- pdo/layout/layout_value.hpp
#ifndef PDO_SINGLE_PDO_LAYOUT_LAYOUT_VALUE_HPP
#define PDO_SINGLE_PDO_LAYOUT_LAYOUT_VALUE_HPP
// pdo/layout/layout_value.hpp: a layout as a constexpr value, for planning and messages.

// ---- pdo/layout/layout.hpp
#ifndef PDO_SINGLE_PDO_LAYOUT_LAYOUT_HPP
#define PDO_SINGLE_PDO_LAYOUT_LAYOUT_HPP
// pdo/layout/layout.hpp: layouts as types: split<"axis">, replicate, partial axes.

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
  /// @brief Marks this type as a split entry (see pdo::dim_spec).
  using split_tag = void;
  /// @brief The name of the mesh axis the dim is cut along.
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

/// @brief How a tensor is laid out on a mesh: one entry per tensor dim.
/// `layout<...>::partial<"tp">` marks a pending sum over mesh axis "tp": each place
/// holds an addend, and the value is the sum over the places along that axis.
template <class... Dims>
struct layout {
  static_assert((dim_spec<Dims> && ...),
                "pdo: layout: each entry must be pdo::split<\"axis\"> or pdo::replicate (one per tensor dim)");
  /// @brief Marks this type as a layout (see pdo::layout_spec).
  using layout_tag = void;
  /// @brief The layout without pending sums: this layout itself.
  using base = layout;
  /// @brief The entries, one per tensor dim.
  using dims = detail::type_list<Dims...>;
  /// @brief The number of tensor dims the layout describes.
  static constexpr std::size_t rank = sizeof...(Dims);
  /// @brief For each dim, the mesh axis it is split along, or "" where it is replicated.
  static constexpr std::array<std::string_view, rank> dim_axes{[] {
    if constexpr (dim_spec<Dims> && !std::is_same_v<Dims, replicate>) return Dims::axis;
    else return std::string_view{};  // (a bad entry: the assertion above says so, once)
  }()...};
  /// @brief The axes of pending sums: none.
  static constexpr std::array<std::string_view, 0> partial_axes{};

  /// @brief This layout with pending sums over mesh axes `Axes` (a class, not an alias:
  /// nvcc's front end cannot take string literals as arguments of alias templates).
  template <fixed_string... Axes>
  struct partial {
    static_assert(sizeof...(Axes) >= 1, "pdo: layout::partial: name at least one mesh axis");
    /// @brief Marks this type as a layout (see pdo::layout_spec).
    using layout_tag = void;
    /// @brief The enclosing layout, without the pending sums.
    using base = layout;
    /// @brief The entries, one per tensor dim (those of the enclosing layout).
    using dims = detail::type_list<Dims...>;
    /// @brief The number of tensor dims.
    static constexpr std::size_t rank = sizeof...(Dims);
    /// @brief For each dim, the mesh axis it is split along, or "" where it is replicated.
    static constexpr auto dim_axes = layout::dim_axes;
    /// @brief The mesh axes the value is a pending sum over, in the order given.
    static constexpr std::array<std::string_view, sizeof...(Axes)> partial_axes{Axes.view()...};
  };
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

#include <array>
#include <cstddef>
#include <string_view>

namespace pdo::detail {

/// @brief What the planner derives for one op from its operands' layouts: the layout each
/// operand must have before the op's local kernel runs (a redistribution where it differs
/// from the operand's own), the output layout, and the mesh axes whose results are
/// combined by a max after the kernel (max over a split dim).
struct op_rule {
  std::size_t arity = 0;
  std::array<layout_value, 3> operands{};
  layout_value out{};
  std::size_t npost_max = 0;
  std::array<std::string_view, max_rank> post_max{};
};

/// @brief How an op treats partial operands (mirrors pdo::op::linearity).
enum class partial_rule { none, additive, scaling, numerator };

constexpr layout_value without_partial(layout_value v) {
  while (v.npartial > 0) v.remove_partial(v.partial[0]);
  return v;
}

constexpr bool same_partials(layout_value a, layout_value b) {
  if (a.npartial != b.npartial) return false;
  for (std::size_t i = 0; i < a.npartial; ++i)
    if (!b.is_partial(a.partial[i])) return false;
  return true;
}

constexpr bool uses_axis(layout_value v, std::string_view axis) {
  return !axis.empty() && (v.split_dim(axis) < v.rank || v.is_partial(axis));
}

/// @brief Elementwise ops (with NumPy broadcasting: operands are aligned on their last
/// dims). Rules, in order:
/// 1. Partial operands stay partial only where the op is linear in them (`rule`): + and -
///    of operands partial over the same axes; * with exactly one partial operand; / with
///    a partial numerator. Otherwise every partial operand is reduced first.
/// 2. A dim is split in the output if some operand splits it; the first operand wins
///    where two split it on different axes, and an axis already used by the output is
///    not used again. An operand split differently from the output is redistributed to
///    the output's split (all_to_all, or all_gather where the output replicates the dim).
/// 3. An operand replicated on a dim the output splits is read at the place's offset:
///    a local slice, no data moves and no copy is made.
/// `scalar[i]` marks operands that are plain numbers (rank 0, no layout).
template <std::size_t N>
constexpr op_rule elementwise_rule(partial_rule rule, const std::array<layout_value, N>& in,
                                   const std::array<bool, N>& scalar, std::size_t out_rank) {
  op_rule r;
  r.arity = N;
  // 1. partial axes
  std::size_t npartial_operands = 0, nscalars = 0;
  for (std::size_t i = 0; i < N; ++i) {
    npartial_operands += in[i].npartial > 0;
    nscalars += scalar[i];
  }
  bool keep = false;
  std::size_t source = 0;
  if (npartial_operands > 0) {
    if (rule == partial_rule::additive) {
      keep = nscalars == 0;
      for (std::size_t i = 1; i < N; ++i) keep = keep && same_partials(in[0], in[i]);
    } else if (rule == partial_rule::scaling) {
      keep = npartial_operands == 1;
      for (std::size_t i = 0; i < N; ++i)
        if (in[i].npartial > 0) source = i;
    } else if (rule == partial_rule::numerator) {
      keep = in[0].npartial > 0 && (N < 2 || in[1].npartial == 0);
    }
  }
  r.out.rank = out_rank;
  if (keep)
    for (std::size_t k = 0; k < in[source].npartial; ++k) r.out.add_partial(in[source].partial[k]);
  // 2. split dims
  for (std::size_t i = 0; i < N; ++i) {
    if (scalar[i]) continue;
    const std::size_t shift = out_rank - in[i].rank;
    for (std::size_t j = 0; j < in[i].rank; ++j) {
      const std::string_view a = in[i].dim_axis[j];
      if (a.empty() || !r.out.dim_axis[shift + j].empty() || uses_axis(r.out, a)) continue;
      r.out.dim_axis[shift + j] = a;
    }
  }
  // operand targets: keep what matches, move what differs, never slice (rule 3)
  for (std::size_t i = 0; i < N; ++i) {
    layout_value t = in[i];
    if (!scalar[i]) {
      const std::size_t shift = out_rank - in[i].rank;
      const bool keeps_partial = keep && same_partials(in[i], r.out);
      if (!keeps_partial) t = without_partial(t);
      for (std::size_t j = 0; j < t.rank; ++j)
        if (!t.dim_axis[j].empty() && t.dim_axis[j] != r.out.dim_axis[shift + j]) t.dim_axis[j] = r.out.dim_axis[shift + j];
    }
    r.operands[i] = t;
  }
  return r;
}

/// @brief matmul of a [..., M, K] and b [..., K, N] (b of rank 2, or of a's rank with the
/// same batch dims). Rules, in order:
/// 1. Both partial: b is reduced first; a partial operand otherwise stays partial (matmul
///    is linear in each operand).
/// 2. K split on an axis in a (or else in b) that neither operand uses for another dim:
///    the output is partial over it (row parallel). The other operand's K is brought to
///    that axis if it is split otherwise, and read at the place's offset if replicated.
///    A K split that cannot be kept is gathered.
/// 3. M keeps a's split (data parallel); N keeps b's split (column parallel) unless its
///    axis is taken, in which case b's N is gathered; batch dims keep a's splits, and b's
///    batch dims follow a's.
constexpr op_rule matmul_rule(layout_value a, layout_value b) {
  op_rule r;
  r.arity = 2;
  layout_value ta = a, tb = b;
  if (a.npartial > 0 && b.npartial > 0) tb = without_partial(tb);
  const std::size_t ra = a.rank, rb = b.rank;
  const std::size_t am = ra - 2, ak = ra - 1, bk = rb - 2, bn = rb - 1;
  // the K axis
  auto free_in_a = [&](std::string_view x) {
    for (std::size_t d = 0; d + 1 < ra; ++d)
      if (ta.dim_axis[d] == x) return false;
    return !ta.is_partial(x) && !tb.is_partial(x);
  };
  auto free_in_b = [&](std::string_view x) {
    for (std::size_t d = 0; d < rb; ++d)
      if (d != bk && tb.dim_axis[d] == x) return false;
    return !ta.is_partial(x) && !tb.is_partial(x);
  };
  std::string_view k;
  if (!a.dim_axis[ak].empty() && free_in_b(a.dim_axis[ak])) k = a.dim_axis[ak];
  else if (!b.dim_axis[bk].empty() && free_in_a(b.dim_axis[bk])) k = b.dim_axis[bk];
  if (ta.dim_axis[ak] != k) ta.dim_axis[ak] = ta.dim_axis[ak].empty() ? std::string_view{} : k;
  if (tb.dim_axis[bk] != k) tb.dim_axis[bk] = tb.dim_axis[bk].empty() ? std::string_view{} : k;
  // an operand split on K along another axis than k was moved to k: if k is empty it is gathered
  // batch dims of b follow a's
  if (rb == ra)
    for (std::size_t d = 0; d < am; ++d)
      if (!tb.dim_axis[d].empty() && tb.dim_axis[d] != ta.dim_axis[d]) tb.dim_axis[d] = ta.dim_axis[d];
  // b's partial axes cannot be axes a splits a dim on: then b is reduced first
  for (std::size_t i = 0; i < tb.npartial; ++i)
    if (ta.split_dim(tb.partial[i]) < ta.rank) {
      tb = without_partial(tb);
      break;
    }
  // output
  r.out.rank = ra;
  for (std::size_t d = 0; d <= am; ++d) r.out.dim_axis[d] = ta.dim_axis[d];
  for (std::size_t i = 0; i < ta.npartial; ++i) r.out.add_partial(ta.partial[i]);
  for (std::size_t i = 0; i < tb.npartial; ++i) r.out.add_partial(tb.partial[i]);
  if (!k.empty()) r.out.add_partial(k);
  const std::string_view n = tb.dim_axis[bn];
  if (!n.empty() && !uses_axis(r.out, n)) r.out.dim_axis[ra - 1] = n;
  else tb.dim_axis[bn] = {};
  r.operands[0] = ta;
  r.operands[1] = tb;
  return r;
}

/// @brief sum or mean over dim `dim` (mean is linear too): the dim leaves the layout; a
/// split on it becomes a partial sum over its axis; partial operands stay partial.
/// max (`is_max`): partial operands are reduced first, and a split dim is combined by an
/// all_reduce(max) over its axis after the local kernel.
constexpr op_rule reduce_rule(layout_value in, std::size_t dim, bool is_max) {
  op_rule r;
  r.arity = 1;
  layout_value t = is_max ? without_partial(in) : in;
  r.operands[0] = t;
  r.out.rank = in.rank - 1;
  for (std::size_t d = 0, o = 0; d < in.rank; ++d)
    if (d != dim) r.out.dim_axis[o++] = t.dim_axis[d];
  for (std::size_t i = 0; i < t.npartial; ++i) r.out.add_partial(t.partial[i]);
  const std::string_view a = t.dim_axis[dim];
  if (!a.empty()) {
    if (is_max) r.post_max[r.npost_max++] = a;
    else r.out.add_partial(a);
  }
  return r;
}

/// @brief sum, mean or max over every dim: a rank-0 result, partial over every split
/// axis (sum, mean) or combined by all_reduce(max) over them (max).
constexpr op_rule reduce_all_rule(layout_value in, bool is_max) {
  op_rule r;
  r.arity = 1;
  layout_value t = is_max ? without_partial(in) : in;
  r.operands[0] = t;
  r.out.rank = 0;
  for (std::size_t i = 0; i < t.npartial; ++i) r.out.add_partial(t.partial[i]);
  for (std::size_t d = 0; d < t.rank; ++d) {
    const std::string_view a = t.dim_axis[d];
    if (a.empty()) continue;
    if (is_max) r.post_max[r.npost_max++] = a;
    else r.out.add_partial(a);
  }
  return r;
}

/// @brief Ops that need a whole dim on one place (softmax, log_softmax along `dim`):
/// partial operands are reduced and the dim is gathered; the other dims keep their split.
constexpr op_rule along_dim_rule(layout_value in, std::size_t dim) {
  op_rule r;
  r.arity = 1;
  layout_value t = without_partial(in);
  t.dim_axis[dim] = {};
  r.operands[0] = t;
  r.out = t;
  return r;
}

/// @brief cross_entropy(logits [N, C], labels [N]), the mean over N of -log softmax at
/// the label: logits are reduced and their classes gathered; labels follow the logits'
/// split of N (read at the offset where replicated); a split N makes the mean partial.
constexpr op_rule cross_entropy_rule(layout_value logits, layout_value labels) {
  op_rule r;
  r.arity = 2;
  layout_value tl = without_partial(logits);
  tl.dim_axis[1] = {};
  layout_value tb = without_partial(labels);
  if (!tb.dim_axis[0].empty() && tb.dim_axis[0] != tl.dim_axis[0]) tb.dim_axis[0] = tl.dim_axis[0];
  r.operands[0] = tl;
  r.operands[1] = tb;
  r.out.rank = 0;
  if (!tl.dim_axis[0].empty()) r.out.add_partial(tl.dim_axis[0]);
  return r;
}

/// @brief transpose of the last two dims: their splits swap; partial stays partial.
constexpr op_rule transpose_rule(layout_value in) {
  op_rule r;
  r.arity = 1;
  r.operands[0] = in;
  r.out = in;
  const std::size_t n = in.rank;
  r.out.dim_axis[n - 2] = in.dim_axis[n - 1];
  r.out.dim_axis[n - 1] = in.dim_axis[n - 2];
  return r;
}

/// @brief The number of leading dims a reshape keeps: through the last split dim.
constexpr std::size_t kept_dims(layout_value in) {
  std::size_t kept = 0;
  for (std::size_t d = 0; d < in.rank; ++d)
    if (!in.dim_axis[d].empty()) kept = d + 1;
  return kept;
}

/// @brief reshape to rank `out_rank`: the leading dims through the last split dim are
/// kept as they are (checked at run time), the others reshaped; partial stays partial.
constexpr op_rule reshape_rule(layout_value in, std::size_t out_rank) {
  op_rule r;
  r.arity = 1;
  r.operands[0] = in;
  r.out = in;
  r.out.rank = out_rank;
  for (std::size_t d = kept_dims(in); d < max_rank; ++d) r.out.dim_axis[d] = {};
  return r;
}

/// @brief A unit dim inserted at `dim`: the dims before it keep their split, the new one is
/// replicated, the ones after it keep theirs one place further; partial stays partial.
constexpr op_rule unsqueeze_rule(layout_value in, std::size_t dim) {
  op_rule r;
  r.arity = 1;
  r.operands[0] = in;
  r.out = in;
  r.out.rank = in.rank + 1;
  for (std::size_t d = in.rank; d > dim; --d) r.out.dim_axis[d] = in.dim_axis[d - 1];
  r.out.dim_axis[dim] = {};
  return r;
}

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_LAYOUT_PROPAGATION_HPP
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

/// @brief One step of a redistribute_plan: a collective (or a local step) along one mesh axis,
/// with the layouts before and after it.
struct redistribute_step {
  step_kind kind{};       ///< what the step does
  std::string_view axis;  ///< the mesh axis it runs along
  std::size_t dim = 0;       ///< the dim gathered, scattered or sliced (the target dim of all_to_all)
  std::size_t from_dim = 0;  ///< all_to_all: the dim split before
  /// @brief The layout before the step.
  detail::layout_value before, after;
  /// @var after
  /// @brief The layout after the step.
};

/// @brief The steps from one layout to another, in order. A value: usable in
/// static_assert, printable with describe().
struct redistribute_plan {
  std::size_t size = 0;  ///< the number of steps in use, at the front of `steps`
  std::array<redistribute_step, 2 * (detail::max_rank + detail::max_axes)> steps{};  ///< the steps, in order

  /// @brief The first step.
  [[nodiscard]] constexpr const redistribute_step* begin() const { return steps.data(); }
  /// @brief Past the last step in use (steps + size).
  [[nodiscard]] constexpr const redistribute_step* end() const { return steps.data() + size; }
  /// @brief How many steps of kind `k` the plan has.
  [[nodiscard]] constexpr std::size_t count(step_kind k) const {
    std::size_t n = 0;
    for (std::size_t i = 0; i < size; ++i) n += steps[i].kind == k;
    return n;
  }
  /// @brief How many steps communicate (all but local_slice, keep_on_one and zero_pad).
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
constexpr redistribute_plan plan_redistribute(layout_value from, layout_value to) {
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
// ---- pdo/plan/step.hpp
#ifndef PDO_SINGLE_PDO_PLAN_STEP_HPP
#define PDO_SINGLE_PDO_PLAN_STEP_HPP
// pdo/plan/step.hpp: one step of an expression's plan, and the record of the steps evaluation runs.


#include <algorithm>
#include <atomic>
#include <cstddef>
#include <mutex>
#include <string_view>
#include <vector>

namespace pdo {

/// @brief What one step of an expression's plan does.
enum class plan_step_kind {
  kernel,        ///< an op's local kernel (on every place at once)
  redistribute,  ///< one step bringing an operand to the layout its op needs
  combine_max,   ///< an all_reduce(max) over an axis after the kernel (max over a split dim)
  halo_exchange, ///< a window op's (conv2d, pooling) input widened by the rows of its neighbours along a split
                 ///< height or width: move.axis, move.dim (2 or 3), move.before = move.after = its layout
};

/// @brief One step of a plan. Nodes are numbered in evaluation order (post-order, leaves
/// included), so a step names the op it belongs to and, for a redistribution, the operand.
struct plan_step {
  plan_step_kind kind{};          ///< what the step does
  std::string_view op;            ///< the op the step belongs to ("matmul", "relu")
  std::size_t node = 0;           ///< that op's node number
  std::size_t operand = 0;        ///< redistribute: which operand of the op
  std::size_t operand_node = 0;   ///< redistribute: that operand's node number
  bool fused = false;             ///< kernel: runs inside the kernel of the op that consumes it
  std::size_t into = 0;           ///< fused kernel: the node whose kernel runs it
  redistribute_step move{};       ///< redistribute: the step; combine_max: its axis and layouts
  detail::layout_value layout{};  ///< kernel: the op's output layout
};

/// @brief Whether two steps do the same thing (the same kind of step of the same op, the same
/// operand, fusion, collective, axis and layouts), whatever their node numbers.
constexpr bool same_work(const plan_step& a, const plan_step& b) {
  if (a.kind != b.kind || a.op != b.op) return false;
  switch (a.kind) {
    case plan_step_kind::kernel: return a.fused == b.fused && a.layout == b.layout;
    case plan_step_kind::redistribute:
      return a.operand == b.operand && a.move.kind == b.move.kind && a.move.axis == b.move.axis && a.move.dim == b.move.dim &&
             a.move.from_dim == b.move.from_dim && a.move.before == b.move.before &&
             a.move.after == b.move.after;
    case plan_step_kind::combine_max: return a.move.axis == b.move.axis;
    case plan_step_kind::halo_exchange:
      return a.operand == b.operand && a.move.axis == b.move.axis && a.move.dim == b.move.dim && a.move.before == b.move.before;
  }
  return false;
}

namespace detail {

/// @brief The steps evaluation ran, per place (a local evaluation is place 0), while a
/// recorder is installed: what a test compares with plan_of, step for step. Each is recorded
/// by the code that ran it, with the index of the plan step it ran: steps that do not depend
/// on each other may run at once on a place's lanes, and are listed in the plan's order.
class step_recorder {
 public:
  step_recorder() { active().store(this, std::memory_order_release); }
  ~step_recorder() { active().store(nullptr, std::memory_order_release); }
  step_recorder(const step_recorder&) = delete;
  step_recorder& operator=(const step_recorder&) = delete;

  /// @brief The steps place `place` ran, in the order of their index in the plan (a
  /// recorder watches one evaluation).
  [[nodiscard]] std::vector<plan_step> of(std::size_t place) const {
    std::lock_guard lock(mutex_);
    std::vector<plan_step> out;
    if (place >= steps_.size()) return out;
    auto ran = steps_[place];
    std::stable_sort(ran.begin(), ran.end(), [](const entry& a, const entry& b) { return a.index < b.index; });
    for (const auto& e : ran) out.push_back(e.step);
    return out;
  }
  /// @brief Whether a recorder is installed: evaluation builds the steps it records only then.
  [[nodiscard]] static bool on() { return active().load(std::memory_order_acquire) != nullptr; }

  /// @brief Records `s`, step `index` of its plan, as run on `place`, if a recorder is installed.
  static void record(std::size_t place, std::size_t index, const plan_step& s) {
    step_recorder* r = active().load(std::memory_order_acquire);
    if (r == nullptr) return;
    std::lock_guard lock(r->mutex_);
    if (r->steps_.size() <= place) r->steps_.resize(place + 1);
    r->steps_[place].push_back({index, s});
  }

 private:
  struct entry {
    std::size_t index = 0;
    plan_step step;
  };
  static std::atomic<step_recorder*>& active() {
    static std::atomic<step_recorder*> current{nullptr};
    return current;
  }
  mutable std::mutex mutex_;
  std::vector<std::vector<entry>> steps_;
};

}  // namespace detail
}  // namespace pdo
#endif  // PDO_SINGLE_PDO_PLAN_STEP_HPP
// ---- pdo/tensor/dtensor.hpp
#ifndef PDO_SINGLE_PDO_TENSOR_DTENSOR_HPP
#define PDO_SINGLE_PDO_TENSOR_DTENSOR_HPP
// pdo/tensor/dtensor.hpp: pdo::dtensor, a tensor laid out over a mesh: global shape + local shards.

// ---- pdo/layout/layout_check.hpp
#ifndef PDO_SINGLE_PDO_LAYOUT_LAYOUT_CHECK_HPP
#define PDO_SINGLE_PDO_LAYOUT_LAYOUT_CHECK_HPP
// pdo/layout/layout_check.hpp: compile-time checks of a layout against a tensor rank and a mesh.


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
// ---- pdo/tensor/tensor.hpp
#ifndef PDO_SINGLE_PDO_TENSOR_TENSOR_HPP
#define PDO_SINGLE_PDO_TENSOR_TENSOR_HPP
// pdo/tensor/tensor.hpp: pdo::tensor, an owning dense row-major tensor on one place.

// ---- pdo/place/copy.hpp
#ifndef PDO_SINGLE_PDO_PLACE_COPY_HPP
#define PDO_SINGLE_PDO_PLACE_COPY_HPP
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
#endif  // PDO_SINGLE_PDO_PLACE_COPY_HPP

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

/// @brief The place whose lane runs the calling thread, if any (a CPU or GPU place):
/// where tensors made without a place go.
inline place_state* current_tensor_place() { return current_place(); }
}  // namespace detail

/// @brief An owning, dense, row-major tensor on one place (the host when none is given).
/// Copies are deep copies on the same place; moves are cheap.
/// @tparam T an element type (pdo::element)
template <element T, std::size_t Rank>
class tensor {
 public:
  /// @brief Element type.
  using value_type = T;
  /// @brief Number of dims.
  static constexpr std::size_t rank = Rank;

  tensor() = default;
  /// @brief A zero-filled tensor in the memory of the place running the calling thread
  /// (inside a parallel_do block or on a place's lane: that place), else on the host.
  explicit tensor(const shape_t<Rank>& shape) : tensor(shape, detail::uninitialized) { fill(T{}); }
  /// @brief A zero-filled tensor in `place`'s memory.
  tensor(const shape_t<Rank>& shape, const any_place& place) : tensor(shape, place, detail::uninitialized) { fill(T{}); }
  /// @brief A tensor holding `values` in row-major order (placed as the one above).
  tensor(const shape_t<Rank>& shape, std::initializer_list<T> values) : tensor(shape, detail::uninitialized) {
    if (values.size() != size())
      throw shape_error("tensor: " + std::to_string(values.size()) + " values given for shape " +
                        detail::format_extents(shape) + " of " + std::to_string(size()) + " elements");
    detail::copy_bytes(place_.get(), data_, nullptr, values.begin(), bytes());
  }
  /// @brief An uninitialised tensor, placed as the zero-filled one above (calling thread's place, else host).
  tensor(const shape_t<Rank>& shape, detail::uninitialized_t)
      : tensor(shape, detail::current_tensor_place() ? detail::current_tensor_place()->memory.get() : &host_allocator(),
               detail::current_tensor_place() ? detail::current_tensor_place()->shared_from_this() : nullptr) {}
  /// @brief An uninitialised tensor in `place`'s memory.
  tensor(const shape_t<Rank>& shape, const any_place& place, detail::uninitialized_t)
      : tensor(shape, &place.memory(), place.state()) {}

  /// @brief A deep copy in the same place's memory as `other` (empty if `other` is default-constructed).
  tensor(const tensor& other) {
    if (other.allocator_ == nullptr) return;  // a default-constructed tensor copies as one
    tensor copy(other.shape_, other.allocator_, other.place_);
    detail::copy_bytes(place_of(copy), copy.data_, place_of(other), other.data_, other.bytes());
    swap(copy);
  }
  /// @brief Takes `other`'s data and place; `other` is left empty, as if default-constructed.
  tensor(tensor&& other) noexcept { swap(other); }
  /// @brief Copy or move assignment (by value, then swap): a copy is deep, on the source's place.
  tensor& operator=(tensor other) noexcept {
    swap(other);
    return *this;
  }
  ~tensor() {
    if (allocator_ != nullptr) allocator_->deallocate(data_, bytes());
  }
  /// @brief Exchanges data, shape and place with `other`; no element is copied.
  void swap(tensor& other) noexcept {
    std::swap(shape_, other.shape_);
    std::swap(strides_, other.strides_);
    std::swap(data_, other.data_);
    std::swap(allocator_, other.allocator_);
    std::swap(place_, other.place_);
  }

  /// @brief The extents, one per dim.
  [[nodiscard]] const shape_t<Rank>& shape() const { return shape_; }
  /// @brief The extent of dim `dim` (not range-checked).
  [[nodiscard]] std::size_t extent(std::size_t dim) const { return shape_[dim]; }
  /// @brief Row-major strides, in elements: the last dim's is 1.
  [[nodiscard]] const std::array<std::ptrdiff_t, Rank>& strides() const { return strides_; }
  /// @brief The number of elements (1 for rank 0).
  [[nodiscard]] std::size_t size() const { return detail::volume(shape_); }
  /// @brief The size of the data in bytes: size() * sizeof(T).
  [[nodiscard]] std::size_t bytes() const { return size() * sizeof(T); }
  /// @brief The first element, in the holding place's memory (a device pointer for GPU tensors).
  [[nodiscard]] T* data() { return data_; }
  /// @brief The first element, in the holding place's memory (a device pointer for GPU tensors).
  [[nodiscard]] const T* data() const { return data_; }
  /// @brief The elements in row-major order (host-readable only when !on_gpu()).
  [[nodiscard]] std::span<T> span() { return {data_, size()}; }
  /// @brief The elements in row-major order (host-readable only when !on_gpu()).
  [[nodiscard]] std::span<const T> span() const { return {data_, size()}; }
  /// @brief Iterator to the first element in row-major order (host-readable only when !on_gpu()).
  [[nodiscard]] T* begin() { return data_; }
  /// @brief Iterator past the last element.
  [[nodiscard]] T* end() { return data_ + size(); }
  /// @brief Iterator to the first element in row-major order (host-readable only when !on_gpu()).
  [[nodiscard]] const T* begin() const { return data_; }
  /// @brief Iterator past the last element.
  [[nodiscard]] const T* end() const { return data_ + size(); }
  /// @brief The place holding the data (nullptr for host tensors).
  [[nodiscard]] detail::place_state* where() const { return place_.get(); }
  /// @brief Whether the data is in a GPU's memory (the host cannot read it through data()).
  [[nodiscard]] bool on_gpu() const { return detail::on_gpu(place_.get()); }
  /// @brief The name of the place holding the data ("host" for host tensors).
  [[nodiscard]] std::string place_name() const { return place_ ? place_->name : std::string("host"); }

  /// @brief The element at `index` (one integer per dim); host memory only, no bounds check.
  template <class... Index>
    requires(sizeof...(Index) == Rank && (std::integral<Index> && ...))
  [[nodiscard]] T& operator()(Index... index) {
    return data_[offset_of(index...)];
  }
  /// @brief The element at `index` (one integer per dim); host memory only, no bounds check.
  template <class... Index>
    requires(sizeof...(Index) == Rank && (std::integral<Index> && ...))
  [[nodiscard]] const T& operator()(Index... index) const {
    return data_[offset_of(index...)];
  }

  /// @brief Sets every element to `value`, on the host or on the holding GPU.
  void fill(T value) {
    if (on_gpu()) detail::fill_bytes(place_.get(), data_, &value, sizeof(T), size());
    else std::fill_n(data_, size(), value);
  }

  /// @brief An uninitialised tensor in host memory, whichever thread asks.
  [[nodiscard]] static tensor on_host(const shape_t<Rank>& shape) { return tensor(shape, &host_allocator(), nullptr); }

  /// @brief A zero-filled tensor of another shape (and element type) in the same place's
  /// memory as this one (the host's for host tensors).
  template <element U = T, std::size_t R = Rank>
  [[nodiscard]] tensor<U, R> zeros_alike(const shape_t<R>& shape) const {
    tensor<U, R> t(shape, allocator_ != nullptr ? allocator_ : &host_allocator(), place_);
    t.fill(U{});
    return t;
  }

 private:
  template <element U, std::size_t R>
  friend class tensor;

  tensor(const shape_t<Rank>& shape, caching_allocator* allocator, std::shared_ptr<detail::place_state> place)
      : shape_(shape), allocator_(allocator), place_(std::move(place)) {
    const std::size_t n = detail::checked_volume(shape, "tensor", sizeof(T));  // before the strides: their products fit then
    strides_ = detail::row_major_strides(shape);
    data_ = static_cast<T*>(allocator_->allocate(n * sizeof(T)));
  }

  static detail::place_state* place_of(const tensor& t) { return t.place_.get(); }

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

/// @brief Copies `src` into `dst` (same shape), whatever places hold them: host, CPU or GPU
/// places (see pdo/place/copy.hpp for how GPU copies go). With copy_completion::queued a
/// copy between a GPU and host memory only queues on the GPU place's stream: keep both
/// tensors alive and untouched until that place synchronizes.
template <class T, std::size_t Rank>
void copy(const tensor<T, Rank>& src, tensor<T, Rank>& dst, copy_completion completion = copy_completion::host_safe,
          peer_copy how = peer_copy::automatic) {
  if (src.shape() != dst.shape())
    throw shape_error("copy: from " + describe(src) + " on " + src.place_name() + " to " + describe(dst) + " on " + dst.place_name() +
                      ": the shapes differ");
  detail::copy_bytes(dst.where(), dst.data(), src.where(), src.data(), src.bytes(), completion, how);
}

/// @brief A copy of `t` in `place`'s memory.
template <class T, std::size_t Rank>
tensor<T, Rank> to_place(const tensor<T, Rank>& t, const any_place& place, peer_copy how = peer_copy::automatic) {
  tensor<T, Rank> out(t.shape(), place, detail::uninitialized);
  copy(t, out, copy_completion::host_safe, how);
  return out;
}

/// @brief A copy of `t` in host memory (readable through data() whatever held `t`).
template <class T, std::size_t Rank>
tensor<T, Rank> to_host(const tensor<T, Rank>& t) {
  auto out = tensor<T, Rank>::on_host(t.shape());
  copy(t, out);
  return out;
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_TENSOR_TENSOR_HPP

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
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

/// @brief "f32[10, 6]", followed by the layout when there is one.
PDO_NOINLINE inline std::string describe_block(std::string_view dtype, std::span<const std::size_t> extents, const layout_value* layout) {
  std::string text = std::string(dtype) + format_extent_list(extents);
  if (layout != nullptr) text += to_string(*layout);
  return text;
}

/// @brief "f32[10, 6]{split<dp>, replicate} on mesh(dp=2, tp=2)": a dtensor's description (one
/// function for every layout of a mesh, element type and rank).
template <class T, std::size_t Rank, class Mesh>
PDO_NOINLINE std::string describe_dtensor(const Mesh& m, const layout_value& v, const shape_t<Rank>& global) {
  return describe_block(dtype_name<T>(), global, &v) + " on " + m.describe();
}

/// @brief The error of a dtensor used after it was moved from (`what`: its type, as
/// describe_block writes it).
[[noreturn]] PDO_NOINLINE inline void throw_moved_from(const std::string& what) {
  throw error("dtensor " + what + ": used after it was moved from; it holds no mesh and no shards (std::move of a dtensor, or "
              "pdo::async_result::get() on an rvalue, empties it)");
}

/// @brief The checks of a dtensor's constructor: one shard for each place of this process,
/// each of the shape the layout gives its place (else pdo::shape_error).
template <class T, std::size_t Rank, class Mesh>
PDO_NOINLINE void check_shards(const Mesh& m, const layout_value& v, const shape_t<Rank>& global, const std::vector<tensor<T, Rank>>& shards) {
  checked_volume(global, "dtensor", sizeof(T));
  const auto& local = m.local_places();
  if (shards.size() != local.size())
    throw shape_error("dtensor: " + std::to_string(shards.size()) + " shards given for " + std::to_string(local.size()) +
                      " local places of " + m.describe());
  for (std::size_t k = 0; k < local.size(); ++k) {
    const auto want = shard_shape(m, v, global, local[k]);
    if (shards[k].shape() != want)
      throw shape_error("dtensor: " + describe_dtensor<T>(m, v, global) + ": the shard of place " + m.place(local[k]).name() + " is " +
                        pdo::describe(shards[k]) + " but the layout gives it " + format_extents(want));
  }
}

/// @brief The position of place `p` among the places of `m` in this process (else
/// pdo::layout_error).
template <class Mesh>
PDO_NOINLINE std::size_t local_ordinal(const Mesh& m, std::size_t p) {
  const auto& local = m.local_places();
  for (std::size_t k = 0; k < local.size(); ++k)
    if (local[k] == p) return k;
  throw layout_error("dtensor: place " + std::to_string(p) + " of " + m.describe() + " does not belong to this process");
}

}  // namespace detail

/// @brief A tensor of global shape `shape()` laid out over `Mesh` as `Layout`; this
/// process holds the shards of its own places (`local_shards()`, in the order of
/// `mesh().local_places()`), each in its place's memory.
/// @tparam Mesh a pdo::mesh type; @tparam Layout a layout_spec valid on it for rank `Rank`
template <element T, std::size_t Rank, mesh_type Mesh, layout_spec Layout>
class dtensor {
  // the layout's checks, each with its message (no second error when one fails)
  static_assert(sizeof(detail::check_layout<"dtensor", Layout, Mesh, Rank>) != 0);

 public:
  /// @brief Element type of the shards.
  using value_type = T;
  /// @brief Type of the mesh the tensor is laid out over.
  using mesh_type = Mesh;
  /// @brief The layout_spec type: how each dim is split over the mesh axes (or replicated, or partial).
  using layout_type = Layout;
  /// @brief Number of dims.
  static constexpr std::size_t rank = Rank;
  /// @brief `Layout` as a value the planner computes with.
  static constexpr detail::layout_value layout_value = detail::value_of<Layout>();

  /// @brief Takes the local shards as they are; each must have the shape the layout gives
  /// its place (else pdo::shape_error naming the place and both shapes).
  dtensor(Mesh m, const shape_t<Rank>& global, std::vector<tensor<T, Rank>> shards)
      : mesh_(std::move(m)), shape_(global), shards_(std::move(shards)) {
    detail::check_shards(mesh_, layout_value, shape_, shards_);
  }

  /// @brief The mesh the tensor is laid out over (a pdo::error for a dtensor that was moved
  /// from: every operation on one says so).
  [[nodiscard]] const Mesh& mesh() const { return live_mesh(); }
  /// @brief The global extents (not those of a shard).
  [[nodiscard]] const shape_t<Rank>& shape() const { return shape_; }
  /// @brief The global number of elements.
  [[nodiscard]] std::size_t size() const { return detail::volume(shape_); }
  /// @brief This process's shards, in the order of `mesh().local_places()`.
  [[nodiscard]] const std::vector<tensor<T, Rank>>& local_shards() const { return shards_; }
  /// @brief This process's shards, in the order of `mesh().local_places()`, writable (keep their shapes).
  [[nodiscard]] std::vector<tensor<T, Rank>>& local_shards() { return shards_; }

  /// @brief The shard of place `p` (a place of this process; else pdo::layout_error).
  [[nodiscard]] const tensor<T, Rank>& shard(std::size_t p) const { return shards_[local_ordinal(p)]; }
  /// @brief The shard of place `p`, writable (a place of this process; else pdo::layout_error).
  [[nodiscard]] tensor<T, Rank>& shard(std::size_t p) { return shards_[local_ordinal(p)]; }

  /// @brief The shape of place `p`'s shard (any place of the mesh).
  [[nodiscard]] shape_t<Rank> local_shape(std::size_t p) const {
    live_mesh().check_place(p, "dtensor::local_shape");
    return detail::shard_shape(mesh_, layout_value, shape_, p);
  }
  /// @brief Where place `p`'s shard starts in the global tensor.
  [[nodiscard]] shape_t<Rank> local_offset(std::size_t p) const {
    live_mesh().check_place(p, "dtensor::local_offset");
    return detail::shard_offset(mesh_, layout_value, shape_, p);
  }

  /// @brief "f32[10, 6]{split<dp>, replicate} on mesh(dp=2, tp=2)".
  [[nodiscard]] std::string describe() const {
    return moved_from() ? type_text() + " (moved from)" : detail::describe_dtensor<T>(mesh_, layout_value, shape_);
  }

 private:
  std::size_t local_ordinal(std::size_t p) const { return detail::local_ordinal(live_mesh(), p); }
  /// A moved-from dtensor has no mesh state (and no shards).
  bool moved_from() const { return !mesh_.state(); }
  /// "f32[7, 5]{split<x>, replicate}": the element type, extents and layout.
  std::string type_text() const { return detail::describe_block(detail::dtype_name<T>(), shape_, &layout_value); }
  const Mesh& live_mesh() const {
    if (moved_from()) [[unlikely]]
      detail::throw_moved_from(type_text());
    return mesh_;
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
// ---- pdo/tensor/redistribute.hpp
#ifndef PDO_SINGLE_PDO_TENSOR_REDISTRIBUTE_HPP
#define PDO_SINGLE_PDO_TENSOR_REDISTRIBUTE_HPP
// pdo/tensor/redistribute.hpp: what one place does in a distribute, a redistribution and a
// gather of dtensors (the operations themselves, which run these on every place of a mesh,
// are in pdo/exec/mesh_ops.hpp).

// ---- pdo/tensor/copy.hpp
#ifndef PDO_SINGLE_PDO_TENSOR_COPY_HPP
#define PDO_SINGLE_PDO_TENSOR_COPY_HPP
// pdo/tensor/copy.hpp: block copies between row-major buffers: slices, packs along a dim, unpacks.
// The chunk copies take the place whose memory holds both buffers (nullptr: the host), so
// they run as strided device copies on a GPU place.


#include <array>
#include <cstddef>
#include <cstring>

namespace pdo::detail {

/// @brief f(big, dense, run) for each contiguous run of the last dim of the block
/// [offsets, offsets + extents) of a row-major tensor of shape `shape`: `big` is the run's
/// element offset in that tensor, `dense` in the block laid out densely.
template <std::size_t Rank, class F>
void for_each_block_run(const shape_t<Rank>& shape, const shape_t<Rank>& offsets, const shape_t<Rank>& extents, F&& f) {
  if (volume(extents) == 0) return;
  if constexpr (Rank == 0) {
    f(std::size_t{0}, std::size_t{0}, std::size_t{1});
  } else {
    const auto strides = row_major_strides(shape);
    const std::size_t run = extents[Rank - 1];
    shape_t<Rank> index{};  // over the leading Rank-1 dims of the block
    for (std::size_t dense = 0;; dense += run) {
      std::size_t big = offsets[Rank - 1];
      for (std::size_t d = 0; d + 1 < Rank; ++d) big += (offsets[d] + index[d]) * static_cast<std::size_t>(strides[d]);
      f(big, dense, run);
      std::size_t d = Rank - 1;
      while (d-- > 0) {
        if (++index[d] < extents[d]) break;
        index[d] = 0;
      }
      if (d == static_cast<std::size_t>(-1)) return;
    }
  }
}

/// @brief Copies the block [offsets, offsets + extents) of a row-major `src` of shape
/// `src_shape` into the dense row-major `dst` of shape `extents`.
template <class T, std::size_t Rank>
void copy_block(const T* src, const shape_t<Rank>& src_shape, const shape_t<Rank>& offsets, const shape_t<Rank>& extents,
                T* dst) {
  for_each_block_run(src_shape, offsets, extents,
                     [&](std::size_t big, std::size_t dense, std::size_t run) { copy_elements(dst + dense, src + big, run); });
}

/// @brief The inverse of copy_block: the dense `src` of shape `extents` into the block at
/// `offsets` of the row-major `dst` of shape `dst_shape`.
template <class T, std::size_t Rank>
void place_block(const T* src, const shape_t<Rank>& extents, T* dst, const shape_t<Rank>& dst_shape, const shape_t<Rank>& offsets) {
  for_each_block_run(dst_shape, offsets, extents,
                     [&](std::size_t big, std::size_t dense, std::size_t run) { copy_elements(dst + big, src + dense, run); });
}

/// @brief Rows [off, off + count) of the middle dim of `src` laid out as v, into the dense `dst`.
template <class T>
void copy_rows(const T* src, const dim_view& v, std::size_t off, std::size_t count, T* dst, place_state* where = nullptr) {
  if (v.outer == 0 || count * v.inner == 0) return;  // nothing to copy (its buffers may be null)
  copy_strided(where, dst, count * v.inner * sizeof(T), src + off * v.inner, v.extent * v.inner * sizeof(T),
               count * v.inner * sizeof(T), v.outer);
}

/// @brief The inverse of copy_rows: the dense `src` into rows [off, off + count) of `dst` laid out as v.
template <class T>
void place_rows(const T* src, const dim_view& v, std::size_t off, std::size_t count, T* dst, place_state* where = nullptr) {
  if (v.outer == 0 || count * v.inner == 0) return;
  copy_strided(where, dst + off * v.inner, v.extent * v.inner * sizeof(T), src, count * v.inner * sizeof(T),
               count * v.inner * sizeof(T), v.outer);
}

/// @brief Chunk `k` of `parts` along the middle dim of `v` (see chunk_size), from `src`
/// laid out as v, into the dense `dst`.
template <class T>
void copy_chunk(const T* src, const dim_view& v, std::size_t parts, std::size_t k, T* dst, place_state* where = nullptr) {
  copy_rows(src, v, chunk_offset(v.extent, parts, k), chunk_size(v.extent, parts, k), dst, where);
}

/// @brief `src` (laid out as v) cut into `parts` chunks along v's middle dim, written
/// chunk after chunk into `dst`: the order collectives send and receive pieces in.
template <class T>
void pack_chunks(const T* src, const dim_view& v, std::size_t parts, T* dst, place_state* where = nullptr) {
  for (std::size_t k = 0; k < parts; ++k) {
    copy_chunk(src, v, parts, k, dst, where);
    dst += v.outer * chunk_size(v.extent, parts, k) * v.inner;
  }
}

/// @brief The inverse of copy_chunk: the dense chunk `k` in `src` into its place in `dst`
/// laid out as v.
template <class T>
void place_chunk(const T* src, const dim_view& v, std::size_t parts, std::size_t k, T* dst, place_state* where = nullptr) {
  place_rows(src, v, chunk_offset(v.extent, parts, k), chunk_size(v.extent, parts, k), dst, where);
}

/// @brief The inverse of pack_chunks: chunks one after another in `src` into `dst` laid out as v.
template <class T>
void unpack_chunks(const T* src, const dim_view& v, std::size_t parts, T* dst, place_state* where = nullptr) {
  for (std::size_t k = 0; k < parts; ++k) {
    place_chunk(src, v, parts, k, dst, where);
    src += v.outer * chunk_size(v.extent, parts, k) * v.inner;
  }
}

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_TENSOR_COPY_HPP

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief How many collectives of each kind the plans have run (see planned_collectives).
inline std::array<std::atomic<std::size_t>, 7>& planned_collective_counts() {
  static std::array<std::atomic<std::size_t>, 7> counts{};
  return counts;
}

/// @brief The collective of redistribution step `step` on place `p` over a flat buffer (a
/// gradient bucket: one parameter's gradient, or several packed): partial -> replicate
/// (all_reduce) in place in `data`; partial -> split of dim 0 (reduce_scatter) into `out`,
/// this place's chunk; split of dim 0 -> replicate (all_gather) of the chunk `data` into
/// `out`. apply_step runs these same collectives for tensors.
template <step_kind Kind, class T, class Mesh>
void apply_flat_step(const redistribute_step& step, const Mesh& m, std::size_t p, std::span<T> data, std::span<T> out = {}) {
  static_assert(Kind == step_kind::all_reduce || Kind == step_kind::reduce_scatter || Kind == step_kind::all_gather,
                "pdo: a flat buffer is synced by an all_reduce, a reduce_scatter or an all_gather of dim 0");
  const std::size_t a = Mesh::axis_index(step.axis);
  const mesh_communicator comm = communicator_along(m, a, p);
  if (m.coord(p, a) == 0) planned_collective_counts()[static_cast<std::size_t>(Kind)].fetch_add(1, std::memory_order_relaxed);
  if constexpr (Kind == step_kind::all_reduce) comm.all_reduce(data);
  else if constexpr (Kind == step_kind::reduce_scatter) comm.reduce_scatter(std::span<const T>(data), out);
  else comm.all_gather(std::span<const T>(data), out);
}

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
    place_chunk(shard.data(), view_along(out_shape, step.dim), n, me, out.data(), out.where());
    return out;
  } else if constexpr (Kind == step_kind::local_slice) {
    tensor<T, Rank> out(out_shape, place, uninitialized);
    copy_chunk(shard.data(), view_along(shard.shape(), step.dim), n, me, out.data(), out.where());
    return out;
  } else if constexpr (Kind == step_kind::all_reduce) {
    apply_flat_step<Kind>(step, m, p, shard.span());
    return shard;
  } else {
    const mesh_communicator comm = communicator_along(m, a, p);
    if (me == 0) planned_collective_counts()[static_cast<std::size_t>(Kind)].fetch_add(1, std::memory_order_relaxed);
    if constexpr (Kind == step_kind::reduce_scatter) {
      // members keep chunks of `dim`: send them chunk-major, unless dim is outermost
      const dim_view v = view_along(shard.shape(), step.dim);
      tensor<T, Rank> out(out_shape, place, uninitialized);
      if (v.outer == 1) {
        comm.reduce_scatter(std::as_const(shard).span(), out.span());
      } else {
        tensor<T, Rank> packed(shard.shape(), place, uninitialized);
        pack_chunks(shard.data(), v, n, packed.data(), packed.where());
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
        unpack_chunks(packed.data(), v, n, out.data(), out.where());
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
      pack_chunks(shard.data(), send_view, n, packed.data(), packed.where());
      tensor<T, Rank> received(out_shape, place, uninitialized), out(out_shape, place, uninitialized);
      comm.all_to_all(std::as_const(packed).span(), std::span<const std::size_t>(send_counts), received.span(),
                      std::span<const std::size_t>(recv_counts));
      unpack_chunks(received.data(), recv_view, n, out.data(), out.where());
      return out;
    }
  }
}

/// @brief Runs `Plan` on place `p`; each step's collective is chosen at compile time.
template <const redistribute_plan& Plan, class T, std::size_t Rank, class Mesh>
tensor<T, Rank> apply_plan(const Mesh& m, const shape_t<Rank>& global, std::size_t p, tensor<T, Rank> shard) {
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((shard = apply_step<Plan.steps[I].kind>(Plan.steps[I], m, global, p, std::move(shard))), ...);
  }(std::make_index_sequence<Plan.size>{});
  return shard;
}

/// @brief Runs the plan from `From` to `To` on place `p`.
template <layout_spec From, layout_spec To, class T, std::size_t Rank, class Mesh>
tensor<T, Rank> apply_plan(const Mesh& m, const shape_t<Rank>& global, std::size_t p, tensor<T, Rank> shard) {
  return apply_plan<redistribute_plan_v<From, To>>(m, global, p, std::move(shard));
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
  host_communicator_of(m, p).all_gather(std::span<const std::size_t>(shape.data(), Rank), std::span<std::size_t>(all));
  for (std::size_t q = 0; q < m.size(); ++q)
    if (!std::equal(shape.begin(), shape.end(), all.begin() + static_cast<std::ptrdiff_t>(q * Rank)))
      throw mismatch_error("distribute: the processes passed host tensors of different shapes: " + format_extents(shape) +
                        " here, " + format_extents(std::span<const std::size_t>(all.data() + q * Rank, Rank)) + " on " +
                        m.place(q).name() + "; every process must pass the same tensor");
}

}  // namespace detail

/// @brief How many collectives of kind `k` the planned redistributions have run in this
/// process since reset_planned_collectives() (eval, redistribute, autograd's gradients),
/// each counted once per group of places that ran it together. For tests and tuning:
/// `pdo::plan_of` says what a plan will run; this says what ran.
inline std::size_t planned_collectives(step_kind k) {
  return detail::planned_collective_counts()[static_cast<std::size_t>(k)].load(std::memory_order_relaxed);
}
inline void reset_planned_collectives() {
  for (auto& c : detail::planned_collective_counts()) c.store(0, std::memory_order_relaxed);
}

namespace detail {
/// @brief Place `p`'s shard of `host` laid out over `m` as `Layout`, in p's memory: its
/// chunk of the split dims; for partial axes, the value at coordinate 0 and zeros elsewhere.
template <layout_spec Layout, mesh_type Mesh, element T, std::size_t Rank>
tensor<T, Rank> shard_of(const Mesh& m, const tensor<T, Rank>& host, std::size_t p) {
  constexpr layout_value v = value_of<Layout>();
  const auto shape = shard_shape(m, v, host.shape(), p);
  tensor<T, Rank> shard(shape, m.place(p), uninitialized);
  if (!holds_partial_value(m, v, p)) {
    shard.fill(T{});
  } else if (shard.on_gpu()) {  // cut on the host, then copied up
    std::vector<T> cut(volume(shape));
    copy_block(host.data(), host.shape(), shard_offset(m, v, host.shape(), p), shape, cut.data());
    copy_bytes(shard.where(), shard.data(), nullptr, cut.data(), cut.size() * sizeof(T));
  } else {
    copy_block(host.data(), host.shape(), shard_offset(m, v, host.shape(), p), shape, shard.data());
  }
  return shard;
}
}  // namespace detail

namespace detail {

/// @brief Whether place `p` holds a block that a gather writes: the one at coordinate 0
/// along every axis that `v` (no partial axes) does not split; the others hold copies.
template <class Mesh>
bool writes_block(const Mesh& m, const layout_value& v, std::size_t p) {
  for (std::size_t a = 0; a < Mesh::ndim; ++a) {
    bool splits = false;
    for (std::size_t d = 0; d < v.rank; ++d) splits = splits || v.dim_axis[d] == Mesh::axis_names[a];
    if (!splits && m.coord(p, a) != 0) return false;
  }
  return true;
}

/// @brief `block` (in any memory) into the block at `offset` of `out` (host memory).
template <class T, std::size_t Rank>
void write_block(const tensor<T, Rank>& block, tensor<T, Rank>& out, const shape_t<Rank>& offset) {
  if (block.on_gpu()) {
    const auto staged = to_host(block);
    place_block(staged.data(), block.shape(), out.data(), out.shape(), offset);
  } else {
    place_block(block.data(), block.shape(), out.data(), out.shape(), offset);
  }
}


}  // namespace detail

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_TENSOR_REDISTRIBUTE_HPP

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo {

/// @brief An expression node: a lazy value that pdo::eval materializes. Nodes opt in
/// with `using expression_tag = void;` and describe themselves with `value_type`, `rank`,
/// `distributed`, `mesh_type`, `name`, `rule` (the planner's op_rule), `shape()`, their
/// children and, for ops, `kernel(context, out)`: the op's local kernel, which reads operand
/// I as a block through `context.template operand<I>()` (or, fused into it, through
/// `context.template fused<I>()`) and writes `out`, this place's block of the result.
template <class E>
concept tensor_expression = requires { typename std::remove_cvref_t<E>::expression_tag; };

namespace detail {

/// @brief A place's block of an operand, ready for a kernel: its local data, local
/// extents, and where the block starts in the operand's global shape.
template <class T, std::size_t Rank>
struct block_view {
  const T* data = nullptr;
  shape_t<Rank> shape{};
  shape_t<Rank> offset{};
  shape_t<Rank> global{};
};

/// @brief "f32[10, 6]" for local nodes, "f32[10, 6]{split<x>, replicate}" for distributed ones.
template <class Node>
std::string describe_node(const Node& n) {
  const auto shape = n.shape();
  if constexpr (Node::distributed) return describe_block(dtype_name<typename Node::value_type>(), shape, &Node::rule.out);
  else return describe_block(dtype_name<typename Node::value_type>(), shape, nullptr);
}

template <class... Ts>
struct first_mesh {
  using type = void;
};
template <class T, class... Ts>
struct first_mesh<T, Ts...> {
  using type = std::conditional_t<!std::is_void_v<typename T::mesh_type>, typename T::mesh_type,
                                  typename first_mesh<Ts...>::type>;
};

/// @brief What every node declares about its operands: same element type, one mesh.
template <class... Children>
struct operand_traits {
  using mesh_type = typename first_mesh<Children...>::type;
  static constexpr bool distributed = (Children::distributed || ...);
  static constexpr bool any_local_tensor = ((!Children::distributed && !Children::is_scalar) || ...);
  static constexpr bool no_mixing = !distributed || !any_local_tensor;
  static constexpr bool one_mesh = ((std::is_void_v<typename Children::mesh_type> || std::is_same_v<typename Children::mesh_type, mesh_type>) && ...);
  static_assert(no_mixing,
                "pdo: an expression mixes pdo::tensor and pdo::dtensor operands; distribute the tensor onto the "
                "mesh first (pdo::distribute<Layout>(mesh, t)), or use the local shards inside pdo::parallel_do");
  static_assert(one_mesh, "pdo: an expression mixes dtensors of different mesh types; every operand must live on one mesh");
  /// @brief Whether the operands agree (the checks above) here and in every operand's subtree:
  /// what evaluates an expression instantiates nothing more when they do not (one error).
  static constexpr bool agree = no_mixing && one_mesh && (Children::well_formed && ...);
};

/// @brief The element type of an op over `Children`: that of its first tensor operand
/// (plain numbers take it); of the first operand when all are numbers.
template <class... Children>
struct common_value {
  using type = typename std::tuple_element_t<0, std::tuple<Children...>>::value_type;
};
template <class First, class... Rest>
  requires(First::is_scalar && sizeof...(Rest) > 0 && ((!Rest::is_scalar) || ...))
struct common_value<First, Rest...> : common_value<Rest...> {};

/// @brief What every op node has: its operands (`children()`), the mesh type they live
/// on, and whether the op is distributed. Ops derive from it and add `value_type`,
/// `rank`, `name`, `elementwise`, the planner's `rule`, `shape()` and `kernel(ctx, out)`.
template <class... Children>
class op_node {
  using traits = operand_traits<Children...>;

 public:
  using expression_tag = void;
  using mesh_type = typename traits::mesh_type;
  using children_type = std::tuple<Children...>;
  static constexpr bool distributed = traits::distributed, is_leaf = false, is_scalar = false;
  /// @brief Whether the operands of this op and of every op below it agree (one element
  /// type's mesh, no pdo::tensor beside a pdo::dtensor).
  static constexpr bool well_formed = traits::agree;

  [[nodiscard]] const children_type& children() const { return children_; }

 protected:
  explicit op_node(Children... c) : children_(std::move(c)...) {}
  children_type children_;
};

template <class T, class... Children>
inline constexpr bool same_element_types = ((Children::is_scalar || std::is_same_v<typename Children::value_type, T>) && ...);

}  // namespace detail

/// @brief Leaf: a local pdo::tensor, by reference (or owned, when given as an rvalue).
template <element T, std::size_t Rank>
class tensor_leaf {
 public:
  /// @brief Marks this class as an expression node (see pdo::tensor_expression).
  using expression_tag = void;
  /// @brief Element type of the tensor read.
  using value_type = T;
  /// @brief void: a local tensor belongs to no mesh.
  using mesh_type = void;
  /// @brief Number of dims of the tensor.
  static constexpr std::size_t rank = Rank;
  /// @brief false: a local tensor, not laid out over a mesh.
  static constexpr bool distributed = false, is_leaf = true, is_scalar = false, elementwise = false;
  /// @brief true: a leaf is well formed.
  static constexpr bool well_formed = true;
  /// @var is_leaf
  /// @brief true: a leaf has no children.
  /// @var is_scalar
  /// @brief false: a tensor, not a plain number.
  /// @var elementwise
  /// @brief false: a leaf is read as a block, never fused into an elementwise kernel.

  /// @brief "tensor": how plans and error messages name this leaf.
  static constexpr std::string_view name = "tensor";
  /// @brief The planner's rule: an output layout of rank `Rank` with no split or partial axis (a local value).
  static constexpr detail::op_rule rule = [] {
    detail::op_rule r;
    r.out.rank = Rank;
    return r;
  }();

  /// @brief Refers to `t`, which must outlive every evaluation of the expression.
  explicit tensor_leaf(const tensor<T, Rank>& t) : t_(&t) {}
  /// @brief Takes `t` over; copies of this leaf share it.
  explicit tensor_leaf(tensor<T, Rank>&& t) : owned_(std::make_shared<const tensor<T, Rank>>(std::move(t))), t_(owned_.get()) {}

  /// @brief The tensor's extents.
  [[nodiscard]] const shape_t<Rank>& shape() const { return t_->shape(); }
  /// @brief The tensor this leaf reads.
  [[nodiscard]] const tensor<T, Rank>& value() const { return *t_; }
  /// @brief The whole tensor, whatever the context: a local tensor is a single block.
  template <class Ctx>
  [[nodiscard]] const tensor<T, Rank>& shard(const Ctx&) const {
    return *t_;
  }

 private:
  std::shared_ptr<const tensor<T, Rank>> owned_;
  const tensor<T, Rank>* t_;
};

/// @brief Leaf: a pdo::dtensor, by reference (or owned, when given as an rvalue).
template <class DTensor>
class dtensor_leaf {
 public:
  /// @brief Marks this class as an expression node (see pdo::tensor_expression).
  using expression_tag = void;
  /// @brief Element type of the dtensor read.
  using value_type = typename DTensor::value_type;
  /// @brief Type of the mesh the dtensor is laid out over.
  using mesh_type = typename DTensor::mesh_type;
  /// @brief Number of dims of the dtensor.
  static constexpr std::size_t rank = DTensor::rank;
  /// @brief true: the dtensor is laid out over a mesh, one shard per place.
  static constexpr bool distributed = true, is_leaf = true, is_scalar = false, elementwise = false;
  /// @brief true: a leaf is well formed.
  static constexpr bool well_formed = true;
  /// @var is_leaf
  /// @brief true: a leaf has no children.
  /// @var is_scalar
  /// @brief false: a tensor, not a plain number.
  /// @var elementwise
  /// @brief false: a leaf is read as a block, never fused into an elementwise kernel.

  /// @brief "dtensor": how plans and error messages name this leaf.
  static constexpr std::string_view name = "dtensor";
  /// @brief The planner's rule: the output layout is the dtensor's own (DTensor::layout_value).
  static constexpr detail::op_rule rule = [] {
    detail::op_rule r;
    r.out = DTensor::layout_value;
    return r;
  }();

  /// @brief Refers to `t`, which must outlive every evaluation of the expression.
  explicit dtensor_leaf(const DTensor& t) : t_(&t) {}
  /// @brief Takes `t` over; copies of this leaf share it.
  explicit dtensor_leaf(DTensor&& t) : owned_(std::make_shared<const DTensor>(std::move(t))), t_(owned_.get()) {}
  /// @brief A dtensor kept alive by `t` (the result of an eval_async, say).
  explicit dtensor_leaf(std::shared_ptr<const DTensor> t) : owned_(std::move(t)), t_(owned_.get()) {}

  /// @brief The dtensor's global extents.
  [[nodiscard]] const shape_t<rank>& shape() const { return t_->shape(); }
  /// @brief The mesh the dtensor is laid out over.
  [[nodiscard]] const mesh_type& mesh() const { return t_->mesh(); }
  /// @brief The dtensor this leaf reads.
  [[nodiscard]] const DTensor& value() const { return *t_; }
  /// @brief The shard of the context's place `ctx.p` (a place of this process; else pdo::layout_error).
  template <class Ctx>
  [[nodiscard]] const tensor<value_type, rank>& shard(const Ctx& ctx) const {
    return t_->shard(ctx.p);  // the context of a place of the dtensor's mesh
  }

 private:
  std::shared_ptr<const DTensor> owned_;
  const DTensor* t_;
};

/// @brief Leaf: a plain number, converted to the element type of the tensors it meets.
template <element T>
class scalar_leaf {
 public:
  /// @brief Marks this class as an expression node (see pdo::tensor_expression).
  using expression_tag = void;
  /// @brief The number's own type; an op converts it to its tensor operands' element type.
  using value_type = T;
  /// @brief void: a number belongs to no mesh.
  using mesh_type = void;
  /// @brief 0: a number has no dims.
  static constexpr std::size_t rank = 0;
  /// @brief false: a number is not laid out over a mesh (every place reads the same value).
  static constexpr bool distributed = false, is_leaf = true, is_scalar = true, elementwise = false;
  /// @brief true: a leaf is well formed.
  static constexpr bool well_formed = true;
  /// @var is_leaf
  /// @brief true: a leaf has no children.
  /// @var is_scalar
  /// @brief true: a plain number, broadcast to the shape of the tensors it meets.
  /// @var elementwise
  /// @brief false: a number is no op; elementwise kernels read it as a constant.

  /// @brief "scalar": how plans and error messages name this leaf.
  static constexpr std::string_view name = "scalar";
  /// @brief The planner's rule: empty (rank 0, nothing split); a number needs no layout.
  static constexpr detail::op_rule rule{};

  /// @brief Holds the number `v`.
  explicit scalar_leaf(T v) : value(v) {}
  /// @brief The empty shape of rank 0.
  [[nodiscard]] shape_t<0> shape() const { return {}; }
  /// @brief The number, read by every element of the op it is an operand of.
  T value;
};

namespace detail {

/// @brief Any operand as an expression node: tensors and dtensors become leaves, numbers
/// scalars, expressions stay as they are.
template <class A>
auto as_expression(A&& a) {
  using plain = std::remove_cvref_t<A>;
  if constexpr (tensor_expression<plain>) return plain(std::forward<A>(a));
  else if constexpr (requires { typename plain::async_result_tag; })
    return dtensor_leaf<typename plain::value_type>(a.shared_value());
  else if constexpr (is_tensor_v<plain>) return tensor_leaf<typename plain::value_type, plain::rank>(std::forward<A>(a));
  else if constexpr (is_dtensor_v<plain>) return dtensor_leaf<plain>(std::forward<A>(a));
  else {
    static_assert(element<plain>, "pdo: an operand must be a pdo::tensor, a pdo::dtensor, an expression or a number");
    return scalar_leaf<plain>(a);
  }
}

template <class A>
using expression_t = decltype(as_expression(std::declval<A>()));

/// @brief An operand of a pdo op: a tensor, a dtensor or an expression (not a bare number).
template <class A>
concept tensor_operand = tensor_expression<A> || is_tensor_v<std::remove_cvref_t<A>> || is_dtensor_v<std::remove_cvref_t<A>> ||
                         requires { typename std::remove_cvref_t<A>::async_result_tag; };

/// @brief The mesh of the first dtensor leaf of `node`'s subtree.
template <class Node>
const typename Node::mesh_type* find_mesh(const Node& node) {
  if constexpr (Node::is_leaf) {
    if constexpr (Node::distributed) return &node.mesh();
    else return nullptr;
  } else {
    const typename Node::mesh_type* found = nullptr;
    std::apply(
        [&](const auto&... c) {
          (([&] {
             if constexpr (std::remove_cvref_t<decltype(c)>::distributed)
               if (found == nullptr) found = find_mesh(c);
           }()),
           ...);
        },
        node.children());
    return found;
  }
}

/// @brief The error of check_one_mesh.
[[noreturn]] PDO_NOINLINE inline void throw_other_mesh(const std::string& operand, const std::string& its_mesh, const std::string& mesh) {
  if (its_mesh == mesh)
    throw layout_error("eval: an operand " + operand + " lives on another mesh than the expression's first dtensor, though both are " +
                       mesh + " (each make_mesh call makes a mesh of its own); make the operands on one mesh");
  throw layout_error("eval: an operand " + operand + " lives on " + its_mesh + ", another mesh than the expression's first dtensor (" +
                     mesh + "); redistribute it onto one mesh first");
}

/// @brief Throws pdo::layout_error unless every dtensor of `node`'s subtree lives on `m`.
template <class Node, class Mesh>
void check_one_mesh(const Node& node, const Mesh& m) {
  if constexpr (Node::is_leaf) {
    if constexpr (Node::distributed)
      if (!(node.mesh() == m)) throw_other_mesh(describe_node(node), node.mesh().describe(), m.describe());
  } else {
    std::apply([&](const auto&... c) { (check_one_mesh(c, m), ...); }, node.children());
  }
}

/// @brief f(leaf) for every local tensor leaf of `node`'s subtree.
template <class Node, class F>
void for_each_tensor_leaf(const Node& node, F&& f) {
  if constexpr (Node::is_leaf) {
    if constexpr (!Node::distributed && !Node::is_scalar) f(node);
  } else {
    std::apply([&](const auto&... c) { (for_each_tensor_leaf(c, f), ...); }, node.children());
  }
}

/// @brief The GPU place whose memory holds the local tensors of `node`, or null when they
/// are in host memory (which CPU places share). Operands in two memories are a pdo::error
/// naming the op, the operands and their places.
[[noreturn]] PDO_NOINLINE inline void throw_two_memories(std::string_view op, const std::vector<std::pair<std::string, const place_state*>>& operands) {
  std::string text;
  for (const auto& [operand, memory] : operands)
    text += (text.empty() ? "" : ", ") + operand + " on " + (memory != nullptr ? memory->name : std::string("the host"));
  throw error("eval of " + std::string(op) + ": operands in two memories (" + text +
              "); copy them to one place first (pdo::to_place, pdo::to_host)");
}

template <class Node>
place_state* local_home(const Node& node) {
  place_state* home = nullptr;
  bool seen = false, mixed = false;
  for_each_tensor_leaf(node, [&](const auto& leaf) {
    place_state* const memory = memory_of(leaf.value().where());
    if (!seen) home = memory;
    mixed = mixed || memory != home;
    seen = true;
  });
  if (mixed) {
    std::vector<std::pair<std::string, const place_state*>> operands;
    for_each_tensor_leaf(node, [&](const auto& leaf) { operands.emplace_back(describe_node(leaf), memory_of(leaf.value().where())); });
    throw_two_memories(Node::name, operands);
  }
  return home;
}

/// @brief The plan that brings child `I` of `Node` to the layout the node needs of it.
template <class Node, std::size_t I>
inline constexpr redistribute_plan operand_plan_v =
    plan_redistribute(std::tuple_element_t<I, typename Node::children_type>::rule.out, Node::rule.operands[I]);

/// @brief Whether child `I` of `Node` runs inside `Node`'s kernel (fused): both are
/// elementwise and nothing moves between them, or `Node` reads the child in place (a node
/// says so with a `reads_in_place<I>` member: a local matmul reads a transposed tensor as
/// it is stored). The one place fusion is decided: the kernels read fused children through
/// it, and plan_of marks their steps fused.
template <class Node, std::size_t I>
inline constexpr bool fuses_child = [] {
  using child_t = std::tuple_element_t<I, typename Node::children_type>;
  if constexpr (Node::is_leaf || child_t::is_leaf) return false;
  else if constexpr (requires { Node::template reads_in_place<I>; }) return Node::template reads_in_place<I>;
  else return Node::elementwise && child_t::elementwise && (!Node::distributed || operand_plan_v<Node, I>.size == 0);
}();

}  // namespace detail
}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXPR_EXPRESSION_HPP
// ---- pdo/layout/layout_type.hpp
#ifndef PDO_SINGLE_PDO_LAYOUT_LAYOUT_TYPE_HPP
#define PDO_SINGLE_PDO_LAYOUT_LAYOUT_TYPE_HPP
// pdo/layout/layout_type.hpp: a layout computed as a value turned back into a layout type of a mesh.


#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>

namespace pdo::detail {

template <class Mesh, std::size_t Axis>
constexpr auto dim_spec_of() {
  if constexpr (Axis == Mesh::ndim) return std::type_identity<replicate>{};
  else return std::type_identity<split<Mesh::template axis_string<Axis>>>{};
}

/// @brief Builds the layout type of `Value::value` from the mesh axis numbers of its
/// entries (the mesh's rank where a dim is replicated).
template <class Mesh, class Value>
struct layout_type_builder {
  static constexpr layout_value v = Value::value;
  static constexpr std::array<std::size_t, max_rank> dims = [] {
    std::array<std::size_t, max_rank> a{};
    for (std::size_t d = 0; d < v.rank; ++d) a[d] = v.dim_axis[d].empty() ? Mesh::ndim : Mesh::axis_index(v.dim_axis[d]);
    return a;
  }();
  static constexpr std::array<std::size_t, max_axes> partial = [] {
    std::array<std::size_t, max_axes> a{};
    for (std::size_t i = 0; i < v.npartial; ++i) a[i] = Mesh::axis_index(v.partial[i]);
    return a;
  }();

  template <std::size_t... D, std::size_t... P>
  static constexpr auto make(std::index_sequence<D...>, std::index_sequence<P...>) {
    using base = layout<typename decltype(dim_spec_of<Mesh, dims[D]>())::type...>;
    if constexpr (sizeof...(P) == 0) return std::type_identity<base>{};
    else return std::type_identity<typename base::template partial<Mesh::template axis_string<partial[P]>...>>{};
  }
  using type = typename decltype(make(std::make_index_sequence<v.rank>{}, std::make_index_sequence<v.npartial>{}))::type;
};

/// @brief The layout type, on mesh type `Mesh`, of the constexpr layout_value `Value::value`
/// (the planner computes layouts as values; dtensor types need them as types).
template <class Mesh, class Value>
using layout_type_t = typename layout_type_builder<Mesh, Value>::type;

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_LAYOUT_LAYOUT_TYPE_HPP

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

namespace pdo {

/// @brief The plan of an expression: its steps in order. A value: usable in
/// static_assert (`pdo::plan_of<E>().count(pdo::step_kind::all_reduce) == 1`).
struct expression_plan {
  static constexpr std::size_t capacity = 96;  ///< the most steps a plan holds
  std::size_t size = 0;                        ///< the number of steps in use, at the front of `steps`
  std::size_t nodes = 0;  ///< nodes numbered (leaves included)
  std::array<plan_step, capacity> steps{};     ///< the steps, in the order they run

  /// @brief The first step.
  [[nodiscard]] constexpr const plan_step* begin() const { return steps.data(); }
  /// @brief Past the last step in use (steps + size).
  [[nodiscard]] constexpr const plan_step* end() const { return steps.data() + size; }
  /// @brief How many collectives of kind `k` the plan runs (an all_reduce(max) counts as an all_reduce).
  [[nodiscard]] constexpr std::size_t count(step_kind k) const {
    std::size_t n = 0;
    for (const auto& s : *this)
      n += (s.kind == plan_step_kind::redistribute && s.move.kind == k) ||
           (s.kind == plan_step_kind::combine_max && k == step_kind::all_reduce);
    return n;
  }
  /// @brief How many steps communicate (halo exchanges included).
  [[nodiscard]] constexpr std::size_t collectives() const {
    std::size_t n = 0;
    for (const auto& s : *this)
      n += (s.kind == plan_step_kind::redistribute && communicates(s.move.kind)) || s.kind == plan_step_kind::combine_max ||
           s.kind == plan_step_kind::halo_exchange;
    return n;
  }
  /// @brief How many passes over memory the kernels make: fused ops share one.
  [[nodiscard]] constexpr std::size_t kernels() const {
    std::size_t n = 0;
    for (const auto& s : *this) n += s.kind == plan_step_kind::kernel && !s.fused;
    return n;
  }
  /// @brief The layout of the expression's result.
  [[nodiscard]] constexpr detail::layout_value result_layout() const {
    for (std::size_t i = size; i-- > 0;)
      if (steps[i].kind == plan_step_kind::kernel) return steps[i].layout;
    return {};
  }
  /// @brief Appends `s`; beyond `capacity` steps, a compile-time error in a constant expression
  /// (pdo::layout_error at run time).
  constexpr void push(const plan_step& s) {
    if (size == capacity)
      throw layout_error("plan_of: the expression has more than " + std::to_string(capacity) +
                         " steps, more than a plan holds; evaluate part of it first");
    steps[size++] = s;
  }
};

namespace detail {

/// @brief The node number of a redistribution step pushed before its op is numbered.
inline constexpr std::size_t unnumbered = static_cast<std::size_t>(-1);

// Node numbers: the nodes of an expression are numbered in evaluation order, children
// before their op (post-order), leaves included and plain numbers left out. A step of a
// plan names its op and operand by these numbers; the executor finds the nodes by them.

/// @brief How many numbers the subtree of `Node` takes.
template <class Node>
constexpr std::size_t numbered_nodes() {
  if constexpr (Node::is_leaf) {
    return Node::is_scalar ? 0 : 1;
  } else {
    return []<std::size_t... I>(std::index_sequence<I...>) {
      return (numbered_nodes<std::tuple_element_t<I, typename Node::children_type>>() + ... + 1);
    }(std::make_index_sequence<std::tuple_size_v<typename Node::children_type>>{});
  }
}

/// @brief The number of child `I` of `Node`, when `Node` is numbered `Id`.
template <class Node, std::size_t Id, std::size_t I>
constexpr std::size_t child_number() {
  std::size_t n = Id + 1 - numbered_nodes<Node>();  // the subtree's first number
  [&]<std::size_t... J>(std::index_sequence<J...>) {
    ((n += numbered_nodes<std::tuple_element_t<J, typename Node::children_type>>()), ...);
  }(std::make_index_sequence<I + 1>{});
  return n - 1;
}

template <std::size_t N, std::size_t I, class Node>
const auto& numbered_child(const Node& node);

/// @brief The node numbered `N` in the subtree of `node` (numbered from 0).
template <std::size_t N, class Node>
const auto& node_numbered(const Node& node) {
  static_assert(N < numbered_nodes<Node>(), "pdo: internal: no node has this number");
  if constexpr (N + 1 == numbered_nodes<Node>()) return node;
  else return numbered_child<N, 0>(node);
}

/// @brief The node numbered `N` among the subtrees of the children of `node` from child `I` on.
template <std::size_t N, std::size_t I, class Node>
const auto& numbered_child(const Node& node) {
  constexpr std::size_t taken = numbered_nodes<std::tuple_element_t<I, typename Node::children_type>>();
  if constexpr (N < taken) return node_numbered<N>(std::get<I>(node.children()));
  else return numbered_child<N - taken, I + 1>(node);
}

/// @brief The type of the node numbered `N` in the subtree of `Root`.
template <std::size_t N, class Root>
using node_numbered_t = std::remove_cvref_t<decltype(node_numbered<N>(std::declval<const Root&>()))>;

/// @brief Appends the steps of `Node`'s subtree to `plan` in evaluation order and returns
/// the node's number: for each operand in turn, its subtree's steps and the redistributions
/// that bring it to the layout the op needs; then the op's kernel; then its combines.
template <class Node>
constexpr std::size_t add_steps(expression_plan& plan, bool fused) {
  if constexpr (Node::is_leaf) {
    return Node::is_scalar ? expression_plan::capacity : plan.nodes++;
  } else {
    constexpr std::size_t arity = std::tuple_size_v<typename Node::children_type>;
    std::array<std::size_t, arity> child{};
    const std::size_t first = plan.size;  // this subtree's first step
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (
          [&] {
            child[I] = add_steps<std::tuple_element_t<I, typename Node::children_type>>(plan, fuses_child<Node, I>);
            if constexpr (Node::distributed) {
              for (const auto& s : operand_plan_v<Node, I>) {
                plan_step step{plan_step_kind::redistribute, Node::name, unnumbered, I, child[I]};
                step.move = s;
                plan.push(step);
              }
            }
          }(),
          ...);
    }(std::make_index_sequence<arity>{});
    // numbered after its operands: the steps pushed above learn the number now
    const std::size_t id = plan.nodes++;
    for (std::size_t k = first; k < plan.size; ++k) {
      plan_step& s = plan.steps[k];
      if (s.kind == plan_step_kind::redistribute && s.node == unnumbered) s.node = id;
      if (s.kind == plan_step_kind::kernel && s.fused)
        for (std::size_t c = 0; c < arity; ++c)
          if (s.node == child[c]) s.into = id;
    }
    plan_step kernel{plan_step_kind::kernel, Node::name, id};
    kernel.fused = fused;
    kernel.layout = Node::rule.out;
    plan.push(kernel);
    for (std::size_t i = 0; i < Node::rule.npost_max; ++i) {
      plan_step step{plan_step_kind::combine_max, Node::name, id};
      step.move.kind = step_kind::all_reduce;
      step.move.axis = Node::rule.post_max[i];
      step.move.before = step.move.after = Node::rule.out;
      plan.push(step);
    }
    return id;
  }
}

}  // namespace detail

/// @brief The plan of expression type `Expr` (what `pdo::eval` runs), at compile time:
/// each op's kernel, with the redistributions its operands need before it, in order.
template <class Expr>
constexpr expression_plan plan_of() {
  using node = detail::expression_t<Expr>;
  expression_plan plan;
  detail::add_steps<node>(plan, false);
  return plan;
}

/// @brief The plan of `expr`'s type.
template <class Expr>
constexpr expression_plan plan_of(const Expr&) {
  return plan_of<Expr>();
}

/// @brief Evaluation policies: `implicit` lets the planner insert the communication its
/// rules call for; `strict` makes every such communication a compile error that names
/// the op and the two layouts, so all communication is written out (pdo::redistribute).
struct implicit {};
struct strict {};

namespace detail {

template <class Node, std::size_t I>
struct operand_layout {
  static constexpr layout_value value = std::tuple_element_t<I, typename Node::children_type>::rule.out;
};
template <class Node, std::size_t I>
struct needed_layout {
  static constexpr layout_value value = Node::rule.operands[I];
};
template <class Node>
struct output_layout {
  static constexpr layout_value value = Node::rule.out;
};

template <class Node>
constexpr auto op_name_of() {
  return fixed_string<Node::name.size() + 1>(Node::name);
}

/// @brief Instantiated for an op whose operand must move under pdo::strict: the failed
/// assertion's context names the op, the operand's layout and the layout the op needs.
template <fixed_string Op, std::size_t Operand, class Has, class Needs>
struct strict_forbids_implicit_communication {
  static_assert(always_false<Has, Needs>,
                "pdo: strict: this op needs an operand in another layout, which takes communication; "
                "redistribute the operand explicitly (pdo::redistribute<Needs>), or evaluate without pdo::strict");
  static constexpr bool ok = false;
};
template <fixed_string Op, class Before, class After>
struct strict_forbids_implicit_max_reduction {
  static_assert(always_false<Before, After>,
                "pdo: strict: max over a split dim needs an all_reduce(max) across the places; gather the dim "
                "first (pdo::redistribute), or evaluate without pdo::strict");
  static constexpr bool ok = false;
};

/// @brief Checks every op of `Node`'s subtree under pdo::strict.
template <class Node>
constexpr bool check_strict() {
  if constexpr (Node::is_leaf || !Node::distributed) {
    return true;
  } else {
    using mesh_t = typename Node::mesh_type;
    constexpr std::size_t arity = std::tuple_size_v<typename Node::children_type>;
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return (check_strict<std::tuple_element_t<I, typename Node::children_type>>() && ...) &&
             ([] {
               if constexpr (operand_plan_v<Node, I>.collectives() > 0)
                 return strict_forbids_implicit_communication<op_name_of<Node>(), I,
                                                              layout_type_t<mesh_t, operand_layout<Node, I>>,
                                                              layout_type_t<mesh_t, needed_layout<Node, I>>>::ok;
               else
                 return true;
             }() && ...) &&
             [] {
               if constexpr (Node::rule.npost_max > 0)
                 return strict_forbids_implicit_max_reduction<op_name_of<Node>(), layout_type_t<mesh_t, needed_layout<Node, 0>>,
                                                              layout_type_t<mesh_t, output_layout<Node>>>::ok;
               else
                 return true;
             }();
    }(std::make_index_sequence<arity>{});
  }
}

template <class Policy, class Node>
constexpr void check_policy() {
  static_assert(std::is_same_v<Policy, implicit> || std::is_same_v<Policy, strict>,
                "pdo: eval: the policy must be pdo::implicit or pdo::strict");
  if constexpr (std::is_same_v<Policy, strict>) {
    [[maybe_unused]] constexpr bool checked = check_strict<Node>();  // its failing step's message, and no second error
  }
}

}  // namespace detail

/// @brief The layout type of the result of evaluating `Expr` (a dtensor expression).
template <class Expr>
using result_layout_t = detail::layout_type_t<typename detail::expression_t<Expr>::mesh_type,
                                              detail::output_layout<detail::expression_t<Expr>>>;

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_PLAN_PLAN_HPP

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo::detail {

/// @brief Where a local expression runs: the calling thread, on the cores of its place (or
/// its GPU). With `host_loops`, on the calling thread as plain host loops, the result in host
/// memory: for operands in host memory while the calling thread drives a GPU.
struct local_context {
  static constexpr bool distributed = false;
  local_context() = default;
  explicit local_context(bool host_loops) : on_host(host_loops) {
    if (host_loops) system = place_system{};
  }
  bool on_host = false;
  place_system system = current_place_system();

  template <std::size_t Rank>
  shape_t<Rank> local_shape(const layout_value&, const shape_t<Rank>& global) const {
    return global;
  }
  template <std::size_t Rank>
  shape_t<Rank> local_offset(const layout_value&, const shape_t<Rank>&) const {
    return {};
  }
  template <class T, std::size_t Rank>
  tensor<T, Rank> allocate(const shape_t<Rank>& shape) const {
    return on_host ? tensor<T, Rank>::on_host(shape) : tensor<T, Rank>(shape, uninitialized);
  }
  /// @brief The place of this context in the record of executed steps.
  [[nodiscard]] std::size_t recorded_place() const { return 0; }
};

/// @brief Where a distributed expression runs on one place: place `p` of mesh `m`, on the
/// lane of the task that runs the step (each step's kernel takes its system there: steps of
/// one place may run at once on different lanes, so the context holds nothing they write).
template <class Mesh>
struct mesh_context {
  static constexpr bool distributed = true;
  mesh_context() = default;
  mesh_context(const Mesh& mesh, std::size_t place) : m(&mesh), p(place) {}
  const Mesh* m = nullptr;
  std::size_t p = 0;

  template <std::size_t Rank>
  shape_t<Rank> local_shape(const layout_value& v, const shape_t<Rank>& global) const {
    return shard_shape(*m, v, global, p);
  }
  template <std::size_t Rank>
  shape_t<Rank> local_offset(const layout_value& v, const shape_t<Rank>& global) const {
    return shard_offset(*m, v, global, p);
  }
  template <class T, std::size_t Rank>
  tensor<T, Rank> allocate(const shape_t<Rank>& shape) const {
    return tensor<T, Rank>(shape, m->place(p), uninitialized);
  }
  [[nodiscard]] std::size_t recorded_place() const { return p; }
};

/// @brief The index in `Plan` of the kernel step of node `N`.
template <const expression_plan& Plan, std::size_t N>
constexpr std::size_t kernel_step_of() {
  for (std::size_t i = 0; i < Plan.size; ++i)
    if (Plan.steps[i].kind == plan_step_kind::kernel && Plan.steps[i].node == N) return i;
  return Plan.size;
}

template <class Run, std::size_t N>
class kernel_context;

/// @brief Adds to `out` the addresses of `n` slots from `slots`, then `result`.
PDO_NOINLINE inline void add_addresses(std::vector<const void*>& out, const std::shared_ptr<void>* slots, std::size_t n, const void* result) {
  for (std::size_t i = 0; i < n; ++i) out.push_back(slots + i);
  out.push_back(result);
}

/// @brief One place's run of the plan of `Root`: the expression, where it runs, and a slot
/// per node number for the block a step leaves for a later one (an op's result, or an
/// operand brought to the layout its op needs). The root's kernel writes the result.
template <class Root, class Place>
class plan_run {
 public:
  using root_type = Root;
  using place_type = Place;
  using value_type = typename Root::value_type;
  static constexpr std::size_t rank = Root::rank;
  static constexpr expression_plan plan = plan_of<Root>();
  static constexpr std::size_t nodes = numbered_nodes<Root>();
  static constexpr std::size_t root_number = nodes - 1;

  plan_run() = default;
  plan_run(const Root& root, Place place, tensor<value_type, rank>& result) : root_(&root), place_(std::move(place)), result_(&result) {}
  /// @brief Makes a run made empty the run of `root` on `place`, into `result`.
  void bind(const Root& root, Place place, tensor<value_type, rank>& result) {
    root_ = &root;
    place_ = std::move(place);
    result_ = &result;
  }

  [[nodiscard]] const Root& root() const { return *root_; }
  [[nodiscard]] Place& place() { return place_; }

  /// @brief Whether operand `I` of `Node` is read from a slot (an op's result, or an operand
  /// that was redistributed), not from where a leaf keeps it.
  template <class Node, std::size_t I>
  static constexpr bool in_slot = [] {
    using child_t = std::tuple_element_t<I, typename Node::children_type>;
    if constexpr (fuses_child<Node, I>) return false;
    else if constexpr (child_t::is_leaf) return Place::distributed && operand_plan_v<Node, I>.size > 0;
    else return true;
  }();

  /// @brief The block in the slot of node `N`.
  template <std::size_t N>
  [[nodiscard]] auto& slot() const {
    using node_t = node_numbered_t<N, Root>;
    return *static_cast<tensor<typename node_t::value_type, node_t::rank>*>(slots_[N].get());
  }

  /// @brief Runs step `S` of the plan on this place.
  template <std::size_t S>
  void run_step() {
    constexpr plan_step step = plan.steps[S];
    if constexpr (step.kind == plan_step_kind::kernel) {
      if constexpr (step.fused) {
        // runs inside the kernel of the op that reads it (kernel_context::fused), which records it
      } else {
        run_kernel<step.node, S>();
      }
    } else if constexpr (step.kind == plan_step_kind::redistribute) {
      move_operand<S>();
    } else {
      combine<S>();
    }
  }

  /// @brief Runs every step in the plan's order (a local evaluation); an expression that is
  /// a leaf is copied.
  void run_all() {
    if constexpr (Root::is_leaf) {
      copy_leaf();
    } else {
      [&]<std::size_t... S>(std::index_sequence<S...>) { (run_step<S>(), ...); }(std::make_index_sequence<plan.size>{});
    }
  }

  /// @brief The result is the leaf the expression is.
  void copy_leaf() {
    const auto& shard = root_->shard(place_);
    copy_bytes(result_->where(), result_->data(), shard.where(), shard.data(), result_->bytes());
  }

  /// @brief What step `S` reads and writes on this place, for the engine: the slots (by
  /// address), the shards of dtensor leaves (by data), the result's storage.
  template <std::size_t S>
  [[nodiscard]] access uses() const {
    constexpr plan_step step = plan.steps[S];
    access a;
    if constexpr (step.kind == plan_step_kind::kernel) {
      add_kernel_reads<step.node>(a);
      a.writes.push_back(storage_of<step.node>());
    } else if constexpr (step.kind == plan_step_kind::redistribute) {
      constexpr std::size_t c = step.operand_node;
      if constexpr (first_move<S>() && node_numbered_t<c, Root>::is_leaf) add_leaf_read(node_numbered<c>(*root_), a);
      else a.reads.push_back(&slots_[c]);
      a.writes.push_back(&slots_[c]);
    } else {
      a.reads.push_back(storage_of<step.node>());
      a.writes.push_back(storage_of<step.node>());
    }
    return a;
  }

  /// @brief Adds to `out` the buffers this run's tasks write: the slots and the result's
  /// storage (for the engine to forget when they are freed).
  void add_written(std::vector<const void*>& out) const {
    add_addresses(out, slots_.data(), nodes, result_->data());
  }

  /// @brief What a task that copies a leaf expression reads and writes.
  [[nodiscard]] access copy_uses() const {
    access a;
    add_leaf_read(*root_, a);
    a.writes.push_back(result_->data());
    return a;
  }

 private:
  template <class, std::size_t>
  friend class kernel_context;

  /// @brief The system for kernels on this place, on the calling lane (a distributed run's
  /// steps run on several lanes, some at once: each kernel asks for its own).
  static place_system system_for(const Place& place) {
    if constexpr (Place::distributed) return current_place_system();
    else return place.system;
  }

  /// @brief Whether step `S` is the first of the redistribution of its operand.
  template <std::size_t S>
  static constexpr bool first_move() {
    if constexpr (S == 0) {
      return true;
    } else {
      constexpr plan_step before = plan.steps[S - 1], step = plan.steps[S];
      return !(before.kind == plan_step_kind::redistribute && before.node == step.node && before.operand == step.operand);
    }
  }

  /// @brief Node `N`'s block: in its slot, or the result for the root.
  template <std::size_t N>
  [[nodiscard]] auto& block_of() const {
    if constexpr (N == root_number) return *result_;
    else return slot<N>();
  }

  /// @brief Where node `N`'s block is kept: the slot, or the result's storage for the root.
  template <std::size_t N>
  [[nodiscard]] const void* storage_of() const {
    if constexpr (N == root_number) return result_->data();
    else return &slots_[N];
  }

  template <class Leaf>
  void add_leaf_read(const Leaf& leaf, access& a) const {
    if constexpr (Leaf::distributed) a.reads.push_back(leaf.shard(place_).data());
  }

  /// @brief The blocks the kernel of node `N` reads: its operands', and those of the
  /// operands fused into it.
  template <std::size_t N>
  void add_kernel_reads(access& a) const {
    using node_t = node_numbered_t<N, Root>;
    const node_t& node = node_numbered<N>(*root_);
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (
          [&] {
            using child_t = std::tuple_element_t<I, typename node_t::children_type>;
            constexpr std::size_t c = child_number<node_t, N, I>();
            if constexpr (child_t::is_scalar) {
            } else if constexpr (fuses_child<node_t, I>) {
              add_kernel_reads<c>(a);
            } else if constexpr (in_slot<node_t, I>) {
              a.reads.push_back(&slots_[c]);
            } else {
              add_leaf_read(std::get<I>(node.children()), a);
            }
          }(),
          ...);
    }(std::make_index_sequence<std::tuple_size_v<typename node_t::children_type>>{});
  }

  /// @brief The kernel of node `N` (step `S`): into a new block in its slot (the result, for
  /// the root); the blocks of its subtree are released once it has read them.
  template <std::size_t N, std::size_t S>
  void run_kernel() {
    using node_t = node_numbered_t<N, Root>;
    using T = typename node_t::value_type;
    const node_t& node = node_numbered<N>(*root_);
    checked_volume(node.shape(), node_t::name, sizeof(T));
    kernel_context<plan_run, N> ctx(*this);
    if constexpr (N == root_number) {
      node.kernel(ctx, *result_);
    } else {
      auto out = std::make_shared<tensor<T, node_t::rank>>(place_.template allocate<T>(place_.local_shape(node_t::rule.out, node.shape())));
      node.kernel(ctx, *out);
      slots_[N] = std::move(out);
    }
    for (std::size_t i = N + 1 - numbered_nodes<node_t>(); i < N; ++i) slots_[i].reset();
    if (step_recorder::on()) {
      plan_step ran{plan_step_kind::kernel, node_t::name, N};
      ran.layout = node_t::rule.out;
      step_recorder::record(place_.recorded_place(), S, ran);
    }
  }

  /// @brief Step `S`: one step of the redistribution of an operand, from its slot (or, for
  /// the first step of a leaf's, from the leaf's shard) into its slot.
  template <std::size_t S>
  void move_operand() {
    constexpr plan_step step = plan.steps[S];
    constexpr std::size_t c = step.operand_node;
    using child_t = node_numbered_t<c, Root>;
    using T = typename child_t::value_type;
    const child_t& child = node_numbered<c>(*root_);
    tensor<T, child_t::rank> block;
    if constexpr (first_move<S>() && child_t::is_leaf) block = tensor<T, child_t::rank>(child.shard(place_));
    else block = std::move(slot<c>());
    block = apply_step<step.move.kind>(step.move, *place_.m, child.shape(), place_.p, std::move(block));
    slots_[c] = std::make_shared<tensor<T, child_t::rank>>(std::move(block));
    if (step_recorder::on()) {
      plan_step ran{plan_step_kind::redistribute, node_numbered_t<step.node, Root>::name, step.node, step.operand, c};
      ran.move = step.move;
      step_recorder::record(place_.recorded_place(), S, ran);
    }
  }

  /// @brief Step `S`: the all_reduce(max) of node's block over the step's axis.
  template <std::size_t S>
  void combine() {
    constexpr plan_step step = plan.steps[S];
    using node_t = node_numbered_t<step.node, Root>;
    auto& out = block_of<step.node>();
    using mesh_t = std::remove_cvref_t<decltype(*place_.m)>;
    communicator_along(*place_.m, mesh_t::axis_index(step.move.axis), place_.p).all_reduce(out.span(), reduce_op::max);
    if (step_recorder::on()) {
      plan_step ran{plan_step_kind::combine_max, node_t::name, step.node};
      ran.move.kind = step_kind::all_reduce;
      ran.move.axis = step.move.axis;
      ran.move.before = ran.move.after = node_t::rule.out;
      step_recorder::record(place_.recorded_place(), S, ran);
    }
  }

  const Root* root_ = nullptr;
  Place place_;
  tensor<value_type, rank>* result_ = nullptr;
  std::array<std::shared_ptr<void>, nodes> slots_{};
};

/// @brief What the kernel of node `N` sees of a plan run: the system it runs on, where its
/// output block lies, and its operands as blocks (`operand<I>()`) or, for an operand fused
/// into it, that operand's own context (`fused<I>()`).
template <class Run, std::size_t N>
class kernel_context {
 public:
  using node_type = node_numbered_t<N, typename Run::root_type>;
  static constexpr bool distributed = Run::place_type::distributed;

  explicit kernel_context(Run& run) : system(Run::system_for(run.place())), run_(&run) {}

  place_system system;

  template <std::size_t Rank>
  [[nodiscard]] shape_t<Rank> local_offset(const layout_value& v, const shape_t<Rank>& global) const {
    return run_->place().local_offset(v, global);
  }

  /// @brief The block of `leaf` on this place, as the leaf keeps it.
  template <class Leaf>
  [[nodiscard]] decltype(auto) shard(const Leaf& leaf) const {
    return leaf.shard(run_->place());
  }

  /// @brief Operand `I` of the node, in the layout the node needs: its local block, local
  /// extents, and where the block starts in the operand's global shape.
  template <std::size_t I>
  [[nodiscard]] auto operand() const {
    const node_type& node = node_numbered<N>(run_->root());
    const auto& c = std::get<I>(node.children());
    using child_t = std::remove_cvref_t<decltype(c)>;
    block_view<typename child_t::value_type, child_t::rank> view;
    view.global = c.shape();
    view.offset = local_offset(node_type::rule.operands[I], c.shape());
    const auto& block = [&]() -> const auto& {
      if constexpr (Run::template in_slot<node_type, I>) return run_->template slot<child_number<node_type, N, I>()>();
      else return c.shard(run_->place());
    }();
    view.data = block.data();
    view.shape = block.shape();
    return view;
  }

  /// @brief The context of operand `I`, whose kernel runs inside this node's (fused): the
  /// step of its kernel is recorded as run here.
  template <std::size_t I>
  [[nodiscard]] auto fused() const {
    constexpr std::size_t c = child_number<node_type, N, I>();
    if (step_recorder::on()) {
      using child_t = node_numbered_t<c, typename Run::root_type>;
      plan_step ran{plan_step_kind::kernel, child_t::name, c};
      ran.fused = true;
      ran.layout = child_t::rule.out;
      step_recorder::record(run_->place().recorded_place(), kernel_step_of<Run::plan, c>(), ran);
    }
    return kernel_context<Run, c>(*run_);
  }

 private:
  Run* run_;
};

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_EXEC_RUN_PLAN_HPP
// ---- pdo/expr/operators.hpp
#ifndef PDO_SINGLE_PDO_EXPR_OPERATORS_HPP
#define PDO_SINGLE_PDO_EXPR_OPERATORS_HPP
// pdo/expr/operators.hpp: the functions and operators that build expressions.

// ---- pdo/expr/elementwise.hpp
#ifndef PDO_SINGLE_PDO_EXPR_ELEMENTWISE_HPP
#define PDO_SINGLE_PDO_EXPR_ELEMENTWISE_HPP
// pdo/expr/elementwise.hpp: elementwise nodes; a chain of them runs as one fused kernel.

// ---- pdo/expr/ops.hpp
#ifndef PDO_SINGLE_PDO_EXPR_OPS_HPP
#define PDO_SINGLE_PDO_EXPR_OPS_HPP
// pdo/expr/ops.hpp: the elementwise operations, as functors callable on host and device.


#include <cmath>
#include <type_traits>
#include <string_view>

namespace pdo::op {

/// @brief How an elementwise op treats a partial (pending-sum) operand: whether
/// op(sum of addends) equals the sum of op(addend) for the operands named.
enum class linearity {
  none,         ///< partial operands are reduced first
  additive,     ///< + and -: both operands partial over the same axes stay partial
  scaling,      ///< * and negate: exactly one operand partial stays partial
  numerator,    ///< /: a partial numerator over a non-partial denominator stays partial
};

// Unary ops. `apply` is the math; `name` is what plans and errors print.
/// @brief negate(x) = -x.
struct negate {
  /// @brief The name plans and error messages print for this op ("negate").
  static constexpr std::string_view name = "negate";
  /// @brief linearity::scaling: the negation of a partial operand stays partial.
  static constexpr linearity rule = linearity::scaling;
  /// @brief Returns -x.
  template <class T>
  PDO_HD static T apply(T x) { return -x; }
};
/// @brief exp(x) = e^x.
struct exp {
  /// @brief The name plans and error messages print for this op ("exp").
  static constexpr std::string_view name = "exp";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns e^x (std::exp, or T's own exp found by argument-dependent lookup).
  template <class T>
  PDO_HD static T apply(T x) { using std::exp; return static_cast<T>(exp(x)); }
};
/// @brief log(x): the natural logarithm.
struct log {
  /// @brief The name plans and error messages print for this op ("log").
  static constexpr std::string_view name = "log";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns ln x (std::log, or T's own log found by argument-dependent lookup).
  template <class T>
  PDO_HD static T apply(T x) { using std::log; return static_cast<T>(log(x)); }
};
/// @brief sqrt(x): the square root.
struct sqrt {
  /// @brief The name plans and error messages print for this op ("sqrt").
  static constexpr std::string_view name = "sqrt";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns √x (std::sqrt, or T's own sqrt found by argument-dependent lookup).
  template <class T>
  PDO_HD static T apply(T x) { using std::sqrt; return static_cast<T>(sqrt(x)); }
};
/// @brief tanh(x): the hyperbolic tangent.
struct tanh {
  /// @brief The name plans and error messages print for this op ("tanh").
  static constexpr std::string_view name = "tanh";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns tanh x (std::tanh, or T's own tanh found by argument-dependent lookup).
  template <class T>
  PDO_HD static T apply(T x) { using std::tanh; return static_cast<T>(tanh(x)); }
};
/// @brief sigmoid(x) = 1 / (1 + e^-x), the logistic function.
struct sigmoid {
  /// @brief The name plans and error messages print for this op ("sigmoid").
  static constexpr std::string_view name = "sigmoid";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns 1 / (1 + e^-x), computed in T.
  template <class T>
  PDO_HD static T apply(T x) { using std::exp; return static_cast<T>(T(1) / (T(1) + exp(-x))); }
};
/// @brief relu(x) = max(x, 0); NaN stays NaN.
struct relu {
  /// @brief The name plans and error messages print for this op ("relu").
  static constexpr std::string_view name = "relu";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns x where x > 0 or x is NaN, else 0.
  template <class T>
  PDO_HD static T apply(T x) { return (x > T(0) || x != x) ? x : T(0); }  // NaN stays NaN
};
/// @brief GELU, exact: x * Φ(x) = 0.5 x (1 + erf(x / √2)), PyTorch's default (F.gelu).
struct gelu {
  /// @brief The name plans and error messages print for this op ("gelu").
  static constexpr std::string_view name = "gelu";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns the exact gelu of x, computed in double and converted to T.
  template <class T>
  PDO_HD static T apply(T x) {
    using std::erf;
    const double v = static_cast<double>(x);
    return static_cast<T>(0.5 * v * (1.0 + erf(v * 0.7071067811865476)));
  }
};

/// @brief The derivative of the exact gelu: Φ(x) + x φ(x).
struct gelu_derivative {
  /// @brief The name plans and error messages print for this op ("gelu_derivative").
  static constexpr std::string_view name = "gelu_derivative";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns Φ(x) + x φ(x), computed in double and converted to T.
  template <class T>
  PDO_HD static T apply(T x) {
    using std::erf;
    using std::exp;
    const double v = static_cast<double>(x);
    return static_cast<T>(0.5 * (1.0 + erf(v * 0.7071067811865476)) + v * 0.3989422804014327 * exp(-0.5 * v * v));
  }
};

/// @brief GELU, tanh approximation: 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))), as in GPT-2
/// and PyTorch's F.gelu(x, approximate="tanh").
struct gelu_tanh {
  /// @brief The name plans and error messages print for this op ("gelu_tanh").
  static constexpr std::string_view name = "gelu_tanh";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns the tanh-approximated gelu of x, computed in double and converted to T.
  template <class T>
  PDO_HD static T apply(T x) {
    using std::tanh;
    const double v = static_cast<double>(x);
    return static_cast<T>(0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))));
  }
};

/// @brief The derivative of gelu_tanh, for its backward.
struct gelu_tanh_derivative {
  /// @brief The name plans and error messages print for this op ("gelu_tanh_derivative").
  static constexpr std::string_view name = "gelu_tanh_derivative";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns the derivative of gelu_tanh at x, computed in double; 0.5 (1 + t) where tanh saturates.
  template <class T>
  PDO_HD static T apply(T x) {
    using std::tanh;
    const double v = static_cast<double>(x), c = 0.7978845608028654;
    const double t = tanh(c * (v + 0.044715 * v * v * v)), sech2 = 1.0 - t * t;
    // where tanh is saturated the second term is 0, also for |x| so large that x² overflows
    return static_cast<T>(0.5 * (1.0 + t) + (sech2 == 0.0 ? 0.0 : 0.5 * v * sech2 * c * (1.0 + 3.0 * 0.044715 * v * v)));
  }
};

// Binary ops.
/// @brief expand(a, like): a broadcast to the shape of `like` (whose values are not read).
struct expand {
  /// @brief The name plans and error messages print for this op ("expand").
  static constexpr std::string_view name = "expand";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns a; the second operand only supplies the shape.
  template <class T>
  PDO_HD static T apply(T a, T) { return a; }
};
/// @brief add(a, b) = a + b.
struct add {
  /// @brief The name plans and error messages print for this op ("add").
  static constexpr std::string_view name = "add";
  /// @brief linearity::additive: the sum of operands partial over the same axes stays partial.
  static constexpr linearity rule = linearity::additive;
  /// @brief Returns a + b.
  template <class T>
  PDO_HD static T apply(T a, T b) { return a + b; }
};
/// @brief subtract(a, b) = a - b.
struct subtract {
  /// @brief The name plans and error messages print for this op ("subtract").
  static constexpr std::string_view name = "subtract";
  /// @brief linearity::additive: the difference of operands partial over the same axes stays partial.
  static constexpr linearity rule = linearity::additive;
  /// @brief Returns a - b.
  template <class T>
  PDO_HD static T apply(T a, T b) { return a - b; }
};
/// @brief multiply(a, b) = a * b.
struct multiply {
  /// @brief The name plans and error messages print for this op ("multiply").
  static constexpr std::string_view name = "multiply";
  /// @brief linearity::scaling: a product with exactly one partial operand stays partial.
  static constexpr linearity rule = linearity::scaling;
  /// @brief Returns a * b.
  template <class T>
  PDO_HD static T apply(T a, T b) { return a * b; }
};
/// @brief divide(a, b) = a / b.
struct divide {
  /// @brief The name plans and error messages print for this op ("divide").
  static constexpr std::string_view name = "divide";
  /// @brief linearity::numerator: a partial numerator over a non-partial denominator stays partial.
  static constexpr linearity rule = linearity::numerator;
  /// @brief Returns a / b. Integers truncate toward zero; as NumPy's, an integer divided by
  /// zero gives 0 and the lowest signed value divided by -1 gives itself (the quotient wraps),
  /// where C++ has no result (a crash on x86).
  template <class T>
  PDO_HD static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      if (b == T(0)) return T(0);
      if constexpr (std::is_signed_v<T>)
        if (b == T(-1)) return static_cast<T>(static_cast<std::make_unsigned_t<T>>(0) - static_cast<std::make_unsigned_t<T>>(a));
    }
    return a / b;
  }
};
/// @brief maximum(a, b): the larger operand, NaN where either is NaN (as PyTorch's maximum).
struct maximum {
  /// @brief The name plans and error messages print for this op ("maximum").
  static constexpr std::string_view name = "maximum";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns the larger of a and b, or NaN if either is NaN.
  template <class T>
  PDO_HD static T apply(T a, T b) { return detail::nan_max(a, b); }
};
/// @brief minimum(a, b): the smaller operand, NaN where either is NaN (as PyTorch's minimum).
struct minimum {
  /// @brief The name plans and error messages print for this op ("minimum").
  static constexpr std::string_view name = "minimum";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns the smaller of a and b, or NaN if either is NaN.
  template <class T>
  PDO_HD static T apply(T a, T b) { return detail::nan_min(a, b); }
};
// Comparisons give 1 where they hold and 0 elsewhere, in the operands' element type.
/// @brief less(a, b): 1 where a < b, else 0.
struct less {
  /// @brief The name plans and error messages print for this op ("less").
  static constexpr std::string_view name = "less";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a < b, else T(0) (also when either is NaN).
  template <class T>
  PDO_HD static T apply(T a, T b) { return a < b ? T(1) : T(0); }
};
/// @brief less_equal(a, b): 1 where a <= b, else 0.
struct less_equal {
  /// @brief The name plans and error messages print for this op ("less_equal").
  static constexpr std::string_view name = "less_equal";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a <= b, else T(0) (also when either is NaN).
  template <class T>
  PDO_HD static T apply(T a, T b) { return a <= b ? T(1) : T(0); }
};
/// @brief greater(a, b): 1 where a > b, else 0.
struct greater {
  /// @brief The name plans and error messages print for this op ("greater").
  static constexpr std::string_view name = "greater";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a > b, else T(0) (also when either is NaN).
  template <class T>
  PDO_HD static T apply(T a, T b) { return a > b ? T(1) : T(0); }
};
/// @brief greater_equal(a, b): 1 where a >= b, else 0.
struct greater_equal {
  /// @brief The name plans and error messages print for this op ("greater_equal").
  static constexpr std::string_view name = "greater_equal";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a >= b, else T(0) (also when either is NaN).
  template <class T>
  PDO_HD static T apply(T a, T b) { return a >= b ? T(1) : T(0); }
};
/// @brief equal(a, b): 1 where a == b, else 0.
struct equal {
  /// @brief The name plans and error messages print for this op ("equal").
  static constexpr std::string_view name = "equal";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a == b, else T(0) (NaN equals nothing).
  template <class T>
  PDO_HD static T apply(T a, T b) { return a == b ? T(1) : T(0); }
};
/// @brief not_equal(a, b): 1 where a != b, else 0.
struct not_equal {
  /// @brief The name plans and error messages print for this op ("not_equal").
  static constexpr std::string_view name = "not_equal";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a != b, else T(0) (NaN differs from everything).
  template <class T>
  PDO_HD static T apply(T a, T b) { return a != b ? T(1) : T(0); }
};

// What the backward of max and min reads.
/// @brief 1 where a equals b, NaN matching NaN, else 0: the elements a maximum (or minimum)
/// reached, among which its gradient is shared.
struct matches {
  /// @brief The name plans and error messages print for this op ("matches").
  static constexpr std::string_view name = "matches";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a == b or both are NaN, else T(0).
  template <class T>
  PDO_HD static T apply(T a, T b) { return (a == b || (a != a && b != b)) ? T(1) : T(0); }
};
/// @brief The share of maximum(a, b)'s gradient that goes to a: 1 where a is chosen (larger,
/// or NaN where b is not), 1/2 where they tie (equal, or both NaN), else 0 (PyTorch's rule).
struct maximum_share {
  /// @brief The name plans and error messages print for this op ("maximum_share").
  static constexpr std::string_view name = "maximum_share";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns 1/2 on a tie or where both are NaN, 1 where a > b or only a is NaN, else 0.
  template <class T>
  PDO_HD static T apply(T a, T b) {
    if (a == b || (a != a && b != b)) return T(0.5);
    return (a > b || a != a) ? T(1) : T(0);
  }
};
/// @brief The share of minimum(a, b)'s gradient that goes to a (see maximum_share).
struct minimum_share {
  /// @brief The name plans and error messages print for this op ("minimum_share").
  static constexpr std::string_view name = "minimum_share";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns 1/2 on a tie or where both are NaN, 1 where a < b or only a is NaN, else 0.
  template <class T>
  PDO_HD static T apply(T a, T b) {
    if (a == b || (a != a && b != b)) return T(0.5);
    return (a < b || a != a) ? T(1) : T(0);
  }
};

// Ternary op.
/// @brief where(c, a, b): a where c is nonzero, else b.
struct where {
  /// @brief The name plans and error messages print for this op ("where").
  static constexpr std::string_view name = "where";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns a if c is nonzero, else b.
  template <class T>
  PDO_HD static T apply(T c, T a, T b) { return c != T(0) ? a : b; }
};

}  // namespace pdo::op
#endif  // PDO_SINGLE_PDO_EXPR_OPS_HPP

#include <array>
#include <cstddef>
#include <initializer_list>
#include <span>
#include <string>
#include <tuple>
#include <utility>

namespace pdo {
namespace detail {

// Readers: what a fused kernel is made of. Each gives the value of its subexpression at
// output element i (coordinates c of the fused group's output), on host and device.
// With Dense, every operand is laid out exactly as the output and is read at i.

template <class T, std::size_t Rank>
struct block_reader {
  const T* data;
  std::array<std::ptrdiff_t, Rank> stride;  ///< per output dim; 0 where the operand broadcasts
  template <bool Dense>
  PDO_HD T at(std::size_t i, const std::size_t* c) const {
    if constexpr (Dense) {
      return data[i];
    } else {
      std::ptrdiff_t o = 0;
      for (std::size_t d = 0; d < Rank; ++d) o += static_cast<std::ptrdiff_t>(c[d]) * stride[d];
      return data[o];
    }
  }
};

template <class T>
struct scalar_reader {
  T value;
  template <bool Dense>
  PDO_HD T at(std::size_t, const std::size_t*) const {
    return value;
  }
};

template <class Op, class... Readers>
struct op_reader;
template <class Op, class A>
struct op_reader<Op, A> {
  A a;
  template <bool Dense>
  PDO_HD auto at(std::size_t i, const std::size_t* c) const {
    return Op::apply(a.template at<Dense>(i, c));
  }
};
template <class Op, class A, class B>
struct op_reader<Op, A, B> {
  A a;
  B b;
  template <bool Dense>
  PDO_HD auto at(std::size_t i, const std::size_t* c) const {
    return Op::apply(a.template at<Dense>(i, c), b.template at<Dense>(i, c));
  }
};
template <class Op, class A, class B, class C>
struct op_reader<Op, A, B, C> {
  A a;
  B b;
  C c3;
  template <bool Dense>
  PDO_HD auto at(std::size_t i, const std::size_t* c) const {
    return Op::apply(a.template at<Dense>(i, c), b.template at<Dense>(i, c), c3.template at<Dense>(i, c));
  }
};

/// @brief The fused kernel: output element i of a group of rank `Rank` with local `extent`.
template <bool Dense, std::size_t Rank, class T, class Reader>
struct fused_kernel {
  Reader reader;
  std::array<std::size_t, Rank> extent;
  PDO_HD T operator()(std::size_t i) const {
    if constexpr (Dense) {
      return reader.template at<true>(i, nullptr);
    } else {
      std::size_t c[Rank == 0 ? 1 : Rank] = {};
      std::size_t rest = i;
      for (std::size_t d = Rank; d-- > 0;) {
        c[d] = rest % extent[d];
        rest /= extent[d];
      }
      return reader.template at<false>(i, c);
    }
  }
};

/// @brief The fused kernel over whole rows (the last dim) of an output of rank `Rank` >= 1
/// whose operands are not all laid out as it is: item r writes row r, its coordinates worked
/// out once (one division per dim per row, not per element).
template <std::size_t Rank, class T, class Reader>
struct fused_rows {
  Reader reader;
  std::array<std::size_t, Rank> extent;
  T* out;
  PDO_HD void operator()(std::size_t r) const {
    std::size_t c[Rank] = {};
    std::size_t rest = r;
    for (std::size_t d = Rank - 1; d-- > 0;) {
      c[d] = rest % extent[d];
      rest /= extent[d];
    }
    const std::size_t length = extent[Rank - 1], first = r * length;
    for (std::size_t j = 0; j < length; ++j) {
      c[Rank - 1] = j;
      out[first + j] = reader.template at<false>(first + j, c);
    }
  }
};

/// @brief Where the output block of a fused group lies: its local extents and global offset.
template <std::size_t Rank>
struct group_frame {
  shape_t<Rank> shape;
  shape_t<Rank> offset;
  bool dense = true;  ///< every operand so far is laid out as the output
};

/// @brief A reader for `block` inside a group framed by `frame`: aligned on the last dims
/// (broadcasting), offset where the block holds more of a dim than the output block
/// (a replicated operand of a split output: the local slice, read in place).
template <std::size_t Rank, class T, std::size_t R>
block_reader<T, Rank> read_block(const block_view<T, R>& block, group_frame<Rank>& frame, std::string_view op) {
  static_assert(R <= Rank);
  block_reader<T, Rank> reader{block.data, {}};
  const auto strides = row_major_strides(block.shape);
  constexpr std::size_t shift = Rank - R;
  bool same = R == Rank;
  for (std::size_t j = 0; j < R; ++j) {
    const std::size_t d = shift + j;
    if (block.shape[j] == frame.shape[d] && block.offset[j] == frame.offset[d]) {
      reader.stride[d] = strides[j];
    } else if (block.global[j] == 1) {
      reader.stride[d] = 0;
      same = false;
    } else if (block.offset[j] <= frame.offset[d] && frame.offset[d] + frame.shape[d] <= block.offset[j] + block.shape[j]) {
      reader.data += static_cast<std::ptrdiff_t>(frame.offset[d] - block.offset[j]) * strides[j];
      reader.stride[d] = strides[j];
      same = same && block.shape[j] == frame.shape[d];
    } else {
      throw layout_error(std::string(op) + ": an operand's block " + format_extents(block.shape) + " at " +
                         format_extents(block.offset) + " does not cover the output block " + format_extents(frame.shape) +
                         " at " + format_extents(frame.offset) + " (a bug in pdo's planner)");
    }
  }
  frame.dense = frame.dense && same;
  return reader;
}

template <class Rule>
constexpr partial_rule partial_rule_of() {
  switch (Rule::rule) {
    case op::linearity::additive: return partial_rule::additive;
    case op::linearity::scaling: return partial_rule::scaling;
    case op::linearity::numerator: return partial_rule::numerator;
    default: return partial_rule::none;
  }
}

template <std::size_t... Ranks>
constexpr std::size_t max_rank_of() {
  std::size_t m = 0;
  ((m = Ranks > m ? Ranks : m), ...);
  return m;
}

}  // namespace detail

namespace detail {

/// @brief The first dim of an operand of `shape` that broadcasts (extent 1 in a result dim
/// `out` that is not) while `target` splits it, or shape.size() when there is none.
template <std::size_t Rank>
std::size_t split_broadcast_dim(const shape_t<Rank>& shape, std::span<const std::size_t> out, const layout_value& target) {
  for (std::size_t j = 0; j < Rank; ++j)
    if (shape[j] == 1 && out[j] != 1 && !target.dim_axis[j].empty()) return j;
  return Rank;
}

[[noreturn]] PDO_NOINLINE inline void throw_split_broadcast(std::string_view op, std::size_t dim, const std::string& operand,
                                                            std::string_view axis) {
  throw layout_error(std::string(op) + ": dim " + std::to_string(dim) + " of " + operand + " has extent 1 and broadcasts, but is split on \"" +
                     std::string(axis) + "\"; replicate it");
}

[[noreturn]] PDO_NOINLINE inline void throw_no_broadcast(std::string_view op, const std::string& operands) {
  throw shape_error(std::string(op) + ": shapes do not broadcast: " + operands);
}

/// @brief "a, b, c".
PDO_NOINLINE inline std::string join_operands(std::initializer_list<std::string> operands) {
  std::string text;
  for (const auto& o : operands) text += (text.empty() ? "" : ", ") + o;
  return text;
}

}  // namespace detail

/// @brief An elementwise op over 1 to 3 operands with NumPy broadcasting (operands are
/// aligned on their last dims; a dim of extent 1 stretches). Chains of these nodes run
/// as one kernel with no temporaries.
template <class Op, class... Children>
class elementwise_node : public detail::op_node<Children...> {

 public:
  /// @brief Element type of the result: that of the first tensor operand (numbers are converted to it).
  using value_type = typename detail::common_value<Children...>::type;
  static_assert(detail::same_element_types<value_type, Children...>,
                "pdo: an elementwise op's tensor operands have different element types; convert one first");
  /// @brief The largest rank among the operands.
  static constexpr std::size_t rank = detail::max_rank_of<Children::rank...>();
  /// @brief true: elementwise children that need no redistribution run inside this node's kernel.
  static constexpr bool elementwise = true;
  /// @brief The op's name (Op::name), as plans and error messages print it.
  static constexpr std::string_view name = Op::name;
  /// @brief The planner's rule (detail::elementwise_rule): operand layouts broadcast to `rank` dims, partial
  /// operands kept partial where Op::rule allows.
  static constexpr detail::op_rule rule = detail::elementwise_rule<sizeof...(Children)>(
      detail::partial_rule_of<Op>(), {Children::rule.out...}, {Children::is_scalar...}, rank);

  /// @brief Broadcasts the operands' shapes: pdo::shape_error when they do not broadcast, pdo::layout_error
  /// when a dim of extent 1 that broadcasts is split.
  explicit elementwise_node(Children... c) : detail::op_node<Children...>(std::move(c)...) {
    shape_.fill(1);
    bool ok = true;
    std::apply([&](const auto&... child) { (broadcast_into(child, ok), ...); }, this->children_);
    if (!ok) detail::throw_no_broadcast(name, operands_text());
    if constexpr (elementwise_node::distributed) check_split_broadcast(std::index_sequence_for<Children...>{});
  }

  /// @brief The operands' broadcast shape.
  [[nodiscard]] const shape_t<rank>& shape() const { return shape_; }

  /// @brief The reader of this node's subexpression inside a fused group; children that
  /// need no redistribution are fused, the others evaluated and read as blocks.
  template <class Ctx, std::size_t Rank>
  auto reader(Ctx& ctx, detail::group_frame<Rank>& frame) const {
    return reader_of(ctx, frame, std::index_sequence_for<Children...>{});
  }

  /// @brief Writes this place's block of the result into `out`: the whole fused group in one pass.
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    detail::group_frame<rank> frame{out.shape(), ctx.local_offset(rule.out, shape_)};
    const auto r = reader(ctx, frame);
    const thrust::counting_iterator<std::size_t> first(0), last(out.size());
    if (frame.dense) {
      thrust::transform(ctx.system, first, last, out.data(),
                        detail::fused_kernel<true, rank, value_type, decltype(r)>{r, out.shape()});
      return;
    }
    if constexpr (rank >= 1) {
      // host loops: row by row, the coordinates carried along each row, the rows over the
      // place's cores when there is work for them all (a small kernel starts no team; a few
      // long rows run element by element, over every core)
      const std::size_t rows = out.size() == 0 ? 0 : out.size() / out.shape()[rank - 1];
      const bool parallel = out.size() >= detail::parallel_grain;
      if (ctx.system.gpu == nullptr && (!parallel || rows >= static_cast<std::size_t>(ctx.system.threads))) {
        detail::cpu_system host;
        host.threads = parallel ? ctx.system.threads : 1;
        detail::for_each_n(host, first, rows, detail::fused_rows<rank, value_type, decltype(r)>{r, out.shape(), out.data()});
        return;
      }
    }
    thrust::transform(ctx.system, first, last, out.data(), detail::fused_kernel<false, rank, value_type, decltype(r)>{r, out.shape()});
  }

 private:
  template <class Child>
  void broadcast_into(const Child& c, bool& ok) {
    const auto s = c.shape();
    constexpr std::size_t shift = rank - Child::rank;
    for (std::size_t j = 0; j < Child::rank; ++j) {
      std::size_t& e = shape_[shift + j];
      if (e == 1) e = s[j];
      else if (s[j] != 1 && s[j] != e) ok = false;
    }
  }

  std::string operands_text() const {
    return std::apply([&](const auto&... c) { return detail::join_operands({detail::describe_node(c)...}); }, this->children_);
  }

  /// @brief A dim of extent 1 that broadcasts cannot be split: its one element would sit on one place only.
  template <std::size_t... I>
  void check_split_broadcast(std::index_sequence<I...>) const {
    auto check = [&](const auto& c, const detail::layout_value& target) {
      using child_t = std::remove_cvref_t<decltype(c)>;
      const auto s = c.shape();
      const std::size_t j = detail::split_broadcast_dim(s, std::span<const std::size_t>(shape_).last(child_t::rank), target);
      if (j < child_t::rank) detail::throw_split_broadcast(name, j, detail::describe_node(c), target.dim_axis[j]);
    };
    (check(std::get<I>(this->children_), rule.operands[I]), ...);
  }

  template <std::size_t I, class Ctx, std::size_t Rank>
  auto child_reader(Ctx& ctx, detail::group_frame<Rank>& frame) const {
    const auto& c = std::get<I>(this->children_);
    using child_t = std::remove_cvref_t<decltype(c)>;
    if constexpr (child_t::is_scalar) {
      return detail::scalar_reader<value_type>{static_cast<value_type>(c.value)};
    } else if constexpr (detail::fuses_child<elementwise_node, I>) {
      auto inner = ctx.template fused<I>();
      return c.reader(inner, frame);
    } else {
      return detail::read_block(ctx.template operand<I>(), frame, name);
    }
  }

  template <class Ctx, std::size_t Rank, std::size_t... I>
  auto reader_of(Ctx& ctx, detail::group_frame<Rank>& frame, std::index_sequence<I...>) const {
    return detail::op_reader<Op, decltype(child_reader<I>(ctx, frame))...>{child_reader<I>(ctx, frame)...};
  }

  shape_t<rank> shape_{};
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXPR_ELEMENTWISE_HPP
// ---- pdo/expr/matmul.hpp
#ifndef PDO_SINGLE_PDO_EXPR_MATMUL_HPP
#define PDO_SINGLE_PDO_EXPR_MATMUL_HPP
// pdo/expr/matmul.hpp: matmul of [..., M, K] by [..., K, N] (2-D, or batched), on BLAS.

// ---- pdo/expr/transpose.hpp
#ifndef PDO_SINGLE_PDO_EXPR_TRANSPOSE_HPP
#define PDO_SINGLE_PDO_EXPR_TRANSPOSE_HPP
// pdo/expr/transpose.hpp: the last two dims swapped.


#include <cstddef>
#include <tuple>

namespace pdo {

namespace detail {
/// @brief Output element i of [batch, cols, rows] read from the input [batch, rows, cols].
template <class T>
struct transpose_element {
  const T* in;
  std::size_t rows, cols;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t b = i / (rows * cols), rest = i % (rows * cols);
    const std::size_t c = rest / rows, r = rest % rows;
    return in[b * rows * cols + r * cols + c];
  }
};
}  // namespace detail

/// @brief transpose(x): x with its last two dims swapped (their splits swap too).
template <class C>
class transpose_node : public detail::op_node<C> {
 public:
  /// @brief The operand's element type, which the result keeps.
  using value_type = typename C::value_type;
  static_assert(C::rank >= 2, "pdo: transpose: needs at least 2 dims");
  /// @brief The operand's rank (at least 2).
  static constexpr std::size_t rank = C::rank;
  /// @brief false: a transpose is never fused into an elementwise group (a local matmul may read it in place).
  static constexpr bool elementwise = false;
  /// @brief "transpose": how plans and error messages name this op.
  static constexpr std::string_view name = "transpose";
  /// @brief The planner's rule (detail::transpose_rule): the last two dims' splits swap; partial stays partial.
  static constexpr detail::op_rule rule = detail::transpose_rule(C::rule.out);

  /// @brief Takes the operand's shape with its last two extents swapped.
  explicit transpose_node(C c) : detail::op_node<C>(std::move(c)) {
    shape_ = std::get<0>(this->children_).shape();
    std::swap(shape_[rank - 2], shape_[rank - 1]);
  }
  /// @brief The operand's shape with its last two extents swapped.
  [[nodiscard]] const shape_t<rank>& shape() const { return shape_; }

  /// @brief Writes the transpose of this place's block of the operand into `out`.
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto in = ctx.template operand<0>();
    thrust::transform(ctx.system, thrust::counting_iterator<std::size_t>(0), thrust::counting_iterator<std::size_t>(out.size()),
                      out.data(), detail::transpose_element<value_type>{in.data, in.shape[rank - 2], in.shape[rank - 1]});
  }

 private:
  shape_t<rank> shape_{};
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXPR_TRANSPOSE_HPP
// ---- pdo/kernels/gemm.hpp
#ifndef PDO_SINGLE_PDO_KERNELS_GEMM_HPP
#define PDO_SINGLE_PDO_KERNELS_GEMM_HPP
// pdo/kernels/gemm.hpp: C = A * B on a place: BLAS ?gemm (CPU places) or cuBLAS (GPU places)
// for float and double, a Thrust kernel otherwise.


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
/// @brief C = A * B by one BLAS call on the calling thread, C's rows `ldc` apart. BLAS's
/// own threads are off (see blas_threads_off): a place's gemm uses its cores by cutting
/// the product into one block per core (gemm).
template <class T>
void blas_gemm(std::size_t m, std::size_t n, std::size_t k, matrix_ref<T> a, matrix_ref<T> b, T* c, std::size_t ldc) {
  const auto M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  const auto ta = a.trans ? CblasTrans : CblasNoTrans, tb = b.trans ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, 1.0f, a.data, static_cast<int>(a.ld), b.data, static_cast<int>(b.ld), 0.0f, c,
                static_cast<int>(ldc));
  else
    cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, 1.0, a.data, static_cast<int>(a.ld), b.data, static_cast<int>(b.ld), 0.0, c,
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

/// @brief C (m x n, dense, row-major) = A (m x k) * B (k x n) on a CPU place's cores. On a
/// place of several cores the product is cut into one block of C's rows (or, for few rows,
/// columns) per core, each a one-thread BLAS call on the place's own OpenMP team: a place's
/// gemm uses exactly its cores, whatever the other places do. Without BLAS (or for other
/// element types), a Thrust kernel.
template <class T>
void gemm(cpu_system& system, std::size_t m, std::size_t n, std::size_t k, matrix_ref<T> a, matrix_ref<T> b, T* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    std::fill_n(c, m * n, T{});
    return;
  }
  if constexpr (blas_gemm_v<T>) {
#if defined(PDO_WITH_BLAS)
    blas_threads_off();
    const std::size_t parts = static_cast<std::size_t>(system.threads);
    if (parts <= 1 || m * n * k < gemm_split_grain) return blas_gemm(m, n, k, a, b, c, n);
    const bool by_rows = m >= n || m >= 16 * parts;
    // block t: rows [lo, hi) of C (A's rows), or columns [lo, hi) (B's columns)
    auto block = [&](std::size_t t) {
      const auto [lo, hi] = gemm_block(by_rows ? m : n, parts, t);
      if (lo == hi) return;
      if (by_rows) {
        const matrix_ref<T> rows{a.trans ? a.data + lo : a.data + lo * a.ld, a.ld, a.trans};
        blas_gemm(hi - lo, n, k, rows, b, c + lo * n, n);
      } else {
        const matrix_ref<T> cols{b.trans ? b.data + lo * b.ld : b.data + lo, b.ld, b.trans};
        blas_gemm(m, hi - lo, k, a, cols, c + lo, n);
      }
    };
    // block t on thread t (and block t + nt, when the team is smaller than asked)
    const std::pair<const decltype(block)*, std::size_t> job{&block, parts};
    run_team(system.threads, [](void* c, std::size_t t, std::size_t nt) {
      const auto& [blocks, count] = *static_cast<const decltype(job)*>(c);
      for (std::size_t b = t; b < count; b += nt) (*blocks)(b);
    }, const_cast<void*>(static_cast<const void*>(&job)));
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
#endif  // PDO_SINGLE_PDO_KERNELS_GEMM_HPP

#include <cstddef>
#include <string>
#include <tuple>

namespace pdo {

namespace detail {
/// @brief Whether C is the transpose of a stored matrix (a leaf): gemm then reads the
/// leaf transposed, with no copy.
template <class C>
inline constexpr bool is_transposed_leaf_v = false;
template <class C>
inline constexpr bool is_transposed_leaf_v<transpose_node<C>> = C::is_leaf && C::rank == 2;
}  // namespace detail

/// @brief matmul(a, b): a [..., M, K] by b [K, N] (one matrix for the whole batch) or by
/// b [..., K, N] with a's batch dims. See detail::matmul_rule for the layouts.
template <class A, class B>
class matmul_node : public detail::op_node<A, B> {

 public:
  /// @brief Element type of both operands and of the result.
  using value_type = typename A::value_type;
  static_assert(std::is_same_v<value_type, typename B::value_type>,
                "pdo: matmul: the operands have different element types; convert one first");
  static_assert(A::rank >= 2 && B::rank >= 2, "pdo: matmul: both operands need at least 2 dims ([M, K] and [K, N])");
  static_assert(B::rank == 2 || B::rank == A::rank,
                "pdo: matmul: b must be a matrix [K, N] or have a's batch dims [..., K, N]");
  /// @brief a's rank: the result is [..., M, N].
  static constexpr std::size_t rank = A::rank;
  /// @brief false: a matmul is never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "matmul": how plans and error messages name this op.
  static constexpr std::string_view name = "matmul";
  /// @brief The planner's rule (detail::matmul_rule): which of M, K, N and the batch dims stay split.
  static constexpr detail::op_rule rule = detail::matmul_rule(A::rule.out, B::rule.out);
  /// @brief A local 2-D product reads operand I in place when it is the transpose of a
  /// stored matrix: gemm takes it as a transposed operand, with no copy (fused, in its plan).
  template <std::size_t I>
  static constexpr bool reads_in_place =
      !detail::op_node<A, B>::distributed && rank == 2 && detail::is_transposed_leaf_v<std::tuple_element_t<I, std::tuple<A, B>>>;

  /// @brief pdo::shape_error unless a's last dim equals b's second-to-last and the batch dims agree.
  matmul_node(A a, B b) : detail::op_node<A, B>(std::move(a), std::move(b)) {
    const auto sa = std::get<0>(this->children_).shape();
    const auto sb = std::get<1>(this->children_).shape();
    bool ok = sa[rank - 1] == sb[B::rank - 2];
    if constexpr (B::rank == rank)
      for (std::size_t d = 0; d + 2 < rank; ++d) ok = ok && sa[d] == sb[d];
    if (!ok)
      throw shape_error("matmul: " + detail::describe_node(std::get<0>(this->children_)) + " by " +
                        detail::describe_node(std::get<1>(this->children_)) +
                        ": a's last dim must equal b's second-to-last, and batch dims must agree");
    for (std::size_t d = 0; d + 1 < rank; ++d) shape_[d] = sa[d];
    shape_[rank - 1] = sb[B::rank - 1];
  }

  /// @brief [..., M, N]: a's dims with the last one replaced by b's last.
  [[nodiscard]] const shape_t<rank>& shape() const { return shape_; }

  /// @brief Writes this place's block of the product into `out` with gemm, batch by batch (on a GPU, one
  /// strided batched cuBLAS call when the operand blocks hold exactly the output's batches).
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    if constexpr (!Ctx::distributed && (reads_in_place<0> || reads_in_place<1>)) {
      const auto ra = matrix_of<0>(ctx), rb = matrix_of<1>(ctx);
      const auto sa = std::get<0>(this->children_).shape();
      detail::gemm<value_type>(ctx.system, shape_[0], shape_[1], sa[1], ra, rb, out.data());
    } else {
      run_blocks(ctx, out);
    }
  }

 private:
  /// @brief Operand I of a local 2-D product as gemm reads it: a transposed leaf in place.
  template <std::size_t I, class Ctx>
  detail::matrix_ref<value_type> matrix_of(Ctx& ctx) const {
    if constexpr (reads_in_place<I>) {
      const auto inner = ctx.template fused<I>();  // the transpose, run inside this kernel
      const auto& stored = inner.shard(std::get<0>(std::get<I>(this->children_).children()));
      return {stored.data(), stored.shape()[1], true};
    } else {
      const auto block = ctx.template operand<I>();
      return {block.data, block.shape[1], false};
    }
  }

  template <class Ctx>
  void run_blocks(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto a = ctx.template operand<0>();
    const auto b = ctx.template operand<1>();
    constexpr std::size_t rb = B::rank;
    // the K range both blocks hold: the smaller block, read from the larger at its offset
    const std::size_t ka = a.shape[rank - 1], kb = b.shape[rb - 2];
    const std::size_t k = ka < kb ? ka : kb;
    const std::size_t a_k0 = ka > k ? b.offset[rb - 2] - a.offset[rank - 1] : 0;
    const std::size_t b_k0 = kb > k ? a.offset[rank - 1] - b.offset[rb - 2] : 0;
    const std::size_t m = out.shape()[rank - 2], n = out.shape()[rank - 1];
    const std::size_t lda = a.shape[rank - 1], ldb = b.shape[rb - 1];
    std::size_t batches = 1;
    for (std::size_t d = 0; d + 2 < rank; ++d) batches *= out.shape()[d];
    // offsets of the output block's rows and columns within the operand blocks
    const auto frame = ctx.local_offset(rule.out, shape_);
    const std::size_t a_m0 = frame[rank - 2] - a.offset[rank - 2];
    const std::size_t b_n0 = frame[rank - 1] - b.offset[rb - 1];
    // when the operand blocks hold exactly the output's batches: one strided batched call
    // where the place's backend has one (cuBLAS)
    if (batches > 1) {
      bool regular = true;
      for (std::size_t d = 0; d + 2 < rank; ++d) {
        regular = regular && frame[d] == a.offset[d] && a.shape[d] == out.shape()[d];
        if constexpr (rb == rank) regular = regular && frame[d] == b.offset[d] && b.shape[d] == out.shape()[d];
      }
      const std::size_t stride_b = rb == rank ? b.shape[rb - 2] * ldb : 0;
      if (regular && detail::gemm_strided_batched<value_type>(ctx.system, batches, m, n, k, {a.data + a_m0 * lda + a_k0, lda},
                                                               a.shape[rank - 2] * lda, {b.data + b_k0 * ldb + b_n0, ldb}, stride_b,
                                                               out.data()))
        return;
    }
    shape_t<rank> index{};
    for (std::size_t batch = 0; batch < batches; ++batch) {
      std::size_t a_off = 0, b_off = 0;
      for (std::size_t d = 0; d + 2 < rank; ++d) {
        a_off = a_off * a.shape[d] + (frame[d] - a.offset[d] + index[d]);
        if constexpr (rb == rank) b_off = b_off * b.shape[d] + (frame[d] - b.offset[d] + index[d]);
      }
      const value_type* pa = a.data + (a_off * a.shape[rank - 2] + a_m0) * lda + a_k0;
      const value_type* pb = b.data + (b_off * b.shape[rb - 2] + b_k0) * ldb + b_n0;
      detail::gemm<value_type>(ctx.system, m, n, k, {pa, lda}, {pb, ldb}, out.data() + batch * m * n);
      for (std::size_t d = rank - 2; d-- > 0;) {
        if (++index[d] < out.shape()[d]) break;
        index[d] = 0;
      }
    }
  }

  shape_t<rank> shape_{};
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXPR_MATMUL_HPP
// ---- pdo/expr/reduce.hpp
#ifndef PDO_SINGLE_PDO_EXPR_REDUCE_HPP
#define PDO_SINGLE_PDO_EXPR_REDUCE_HPP
// pdo/expr/reduce.hpp: sum, mean and max over one dim or over all dims.

// ---- pdo/kernels/reduce.hpp
#ifndef PDO_SINGLE_PDO_KERNELS_REDUCE_HPP
#define PDO_SINGLE_PDO_KERNELS_REDUCE_HPP
// pdo/kernels/reduce.hpp: sums and maxima along one dim or over everything, as Thrust kernels.


#include <thrust/iterator/transform_output_iterator.h>

#include <cstddef>
#include <limits>

namespace pdo::detail {

/// @brief What a reduction computes.
enum class reduction { sum, mean, max };

/// @brief What a reduction starts from: 0, or for max the least value (-inf where T has it,
/// so that the max of -inf is -inf).
template <class T>
PDO_HD T reduction_identity(reduction r) {
  if (r != reduction::max) return T{};
  return std::numeric_limits<T>::has_infinity ? -std::numeric_limits<T>::infinity() : std::numeric_limits<T>::lowest();
}

/// @brief Element e of the row of output element o, along the middle dim of [outer, extent, inner].
template <class T>
struct element_along_dim {
  const T* in;
  std::size_t extent, inner;
  PDO_HD T operator()(std::size_t o, std::size_t e) const { return in[(o / inner) * extent * inner + o % inner + e * inner]; }
};

template <class T>
struct read_at {
  const T* in;
  PDO_HD T operator()(std::size_t i) const { return in[i]; }
};

template <class T>
struct max_of {
  PDO_HD T operator()(T a, T b) const { return nan_max(a, b); }
};

/// @brief x * factor: what a mean's output iterator writes for a sum x.
template <class T>
struct scale_by {
  T factor;
  PDO_HD T operator()(T x) const { return x * factor; }
};

/// @brief out[o] = the reduction along dim `v` of `in` (a segmented reduction: a row per output
/// element); `global_extent` divides a mean.
template <class T>
void reduce_dim(place_system& system, const T* in, const dim_view& v, reduction what, std::size_t global_extent, T* out) {
  const std::size_t outputs = v.outer * v.inner;
  const element_along_dim<T> element{in, v.extent, v.inner};
  if (what == reduction::max) {
    segmented_reduce(system, outputs, v.extent, v.inner == 1, element, reduction_identity<T>(what), max_of<T>{}, out);
    return;
  }
  if (what == reduction::mean)  // each sum scaled as it is written
    segmented_reduce(system, outputs, v.extent, v.inner == 1, element, T{}, thrust::plus<T>{},
                     thrust::make_transform_output_iterator(out, scale_by<T>{T(1) / static_cast<T>(global_extent)}));
  else
    segmented_reduce(system, outputs, v.extent, v.inner == 1, element, T{}, thrust::plus<T>{}, out);
}

/// @brief *out = *out * factor, for the one element of a rank-0 result.
template <class T>
struct scale_element {
  T* out;
  T factor;
  PDO_HD void operator()(std::size_t) const { *out = *out * factor; }
};

/// @brief *out (in the memory of the system's place) = the reduction of all `n` elements of
/// `in`; `global_count` divides a mean. On a GPU place the result is written by kernels.
template <class T>
void reduce_all_into(place_system& system, const T* in, std::size_t n, reduction what, std::size_t global_count, T* out) {
  const thrust::counting_iterator<std::size_t> first(0), last(n);
  if (what == reduction::max) {
    transform_reduce_into(system, first, last, read_at<T>{in}, reduction_identity<T>(what), max_of<T>{}, out);
    return;
  }
  transform_reduce_into(system, first, last, read_at<T>{in}, T{}, thrust::plus<T>{}, out);
  if (what == reduction::mean) thrust::for_each_n(system, first, std::size_t{1}, scale_element<T>{out, T(1) / static_cast<T>(global_count)});
}

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_KERNELS_REDUCE_HPP

#include <cstddef>
#include <string>
#include <tuple>

namespace pdo {

/// @brief A reduction of its operand over dim `Dim`, or over every dim when `All`
/// (a rank-0 result). See detail::reduce_rule for the layouts.
template <detail::reduction What, std::size_t Dim, bool All, class C>
class reduce_node : public detail::op_node<C> {
 public:
  /// @brief The operand's element type, which the result keeps.
  using value_type = typename C::value_type;
  static_assert(All || Dim < C::rank, "pdo: sum/mean/max: the dim to reduce is out of range for the operand's rank");
  static_assert(What != detail::reduction::mean || std::is_floating_point_v<value_type>,
                "pdo: mean: needs a floating-point operand");
  /// @brief 0 when `All`, else the operand's rank less the reduced dim.
  static constexpr std::size_t rank = All ? 0 : C::rank - 1;
  /// @brief false: a reduction is never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "sum", "mean" or "max", as plans and error messages print it.
  static constexpr std::string_view name =
      What == detail::reduction::sum ? "sum" : What == detail::reduction::mean ? "mean" : "max";
  /// @brief The planner's rule: a split reduced dim leaves a partial sum (sum, mean), or an all_reduce(max)
  /// after the kernel (max); see detail::reduce_rule and detail::reduce_all_rule.
  static constexpr detail::op_rule rule = All ? detail::reduce_all_rule(C::rule.out, What == detail::reduction::max)
                                              : detail::reduce_rule(C::rule.out, Dim, What == detail::reduction::max);

  /// @brief pdo::shape_error for a max over no elements.
  explicit reduce_node(C c) : detail::op_node<C>(std::move(c)) {
    const auto s = std::get<0>(this->children_).shape();
    if (What == detail::reduction::max && (All ? detail::volume(s) : s[All ? 0 : Dim]) == 0)
      throw shape_error("max: " + detail::describe_node(std::get<0>(this->children_)) + ": the maximum of no elements");
    if constexpr (!All)
      for (std::size_t d = 0, o = 0; d < C::rank; ++d)
        if (d != Dim) shape_[o++] = s[d];
  }

  /// @brief The operand's shape without dim `Dim` (empty when `All`).
  [[nodiscard]] const shape_t<rank>& shape() const { return shape_; }

  /// @brief Reduces this place's block of the operand into `out`; a mean divides by the global count.
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto in = ctx.template operand<0>();
    if constexpr (All) {
      detail::reduce_all_into(ctx.system, in.data, detail::volume(in.shape), What, detail::volume(in.global), out.data());
    } else {
      detail::reduce_dim(ctx.system, in.data, detail::view_along(in.shape, Dim), What, in.global[Dim], out.data());
    }
  }

 private:
  shape_t<rank> shape_{};
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXPR_REDUCE_HPP
// ---- pdo/expr/reshape.hpp
#ifndef PDO_SINGLE_PDO_EXPR_RESHAPE_HPP
#define PDO_SINGLE_PDO_EXPR_RESHAPE_HPP
// pdo/expr/reshape.hpp: the same elements in row-major order under another shape: reshape,
// and unsqueeze (a unit dim inserted, whatever the operand's split).


#include <cstddef>
#include <string>
#include <tuple>

namespace pdo {

/// @brief reshape<Rank>(x, shape): x's elements under `shape`. The leading dims through
/// x's last split dim are kept as they are (same extents); the rest, all replicated,
/// may be reshaped freely (see detail::reshape_rule).
template <std::size_t Rank, class C>
class reshape_node : public detail::op_node<C> {
 public:
  /// @brief The operand's element type, which the result keeps.
  using value_type = typename C::value_type;
  /// @brief Number of dims of the new shape.
  static constexpr std::size_t rank = Rank;
  /// @brief false: a reshape is never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "reshape": how plans and error messages name this op.
  static constexpr std::string_view name = "reshape";
  static_assert(detail::kept_dims(C::rule.out) <= Rank,
                "pdo: reshape: the result must keep every dim up to the operand's last split dim; gather the split "
                "dims first (pdo::redistribute) or reshape only trailing replicated dims");
  /// @brief The planner's rule (detail::reshape_rule): kept dims keep their split, the rest are replicated.
  static constexpr detail::op_rule rule = detail::reshape_rule(C::rule.out, Rank);

  /// @brief pdo::shape_error unless `shape` has the operand's element count and keeps the dims up to its
  /// last split one.
  reshape_node(C c, const shape_t<Rank>& shape) : detail::op_node<C>(std::move(c)), shape_(shape) {
    const auto s = std::get<0>(this->children_).shape();
    bool ok = detail::volume(s) == detail::checked_volume(shape_, "reshape", sizeof(value_type));
    for (std::size_t d = 0; d < detail::kept_dims(C::rule.out); ++d) ok = ok && s[d] == shape_[d];
    if (!ok)
      throw shape_error("reshape: " + detail::describe_node(std::get<0>(this->children_)) + " to " + detail::format_extents(shape_) +
                        ": the number of elements must stay the same, and the dims up to the last split one must be kept");
  }
  /// @brief The new shape.
  [[nodiscard]] const shape_t<Rank>& shape() const { return shape_; }

  /// @brief Copies this place's block of the operand into `out` unchanged (row-major order is kept).
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto in = ctx.template operand<0>();
    detail::copy_bytes(out.where(), out.data(), out.where(), in.data, out.bytes());  // operands live on out's place
  }

 private:
  shape_t<Rank> shape_;
};

/// @brief unsqueeze<Dim>(x): x with a dim of extent 1 inserted at `Dim` (0 to x's rank). The
/// elements keep their order, so every dim keeps its split, whichever dims are split (see
/// detail::unsqueeze_rule): what a reduction's gradient is broadcast back through.
template <std::size_t Dim, class C>
class unsqueeze_node : public detail::op_node<C> {
 public:
  /// @brief The operand's element type, which the result keeps.
  using value_type = typename C::value_type;
  /// @brief One more than the operand's rank.
  static constexpr std::size_t rank = C::rank + 1;
  static_assert(Dim <= C::rank, "pdo: unsqueeze: the dim to insert is beyond the operand's rank");
  static_assert(rank <= detail::max_rank, "pdo: unsqueeze: the result would have more dims than pdo's layouts hold");
  /// @brief false: an unsqueeze is never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "unsqueeze": how plans and error messages name this op.
  static constexpr std::string_view name = "unsqueeze";
  /// @brief The planner's rule (detail::unsqueeze_rule): the new dim is replicated, the others keep their split.
  static constexpr detail::op_rule rule = detail::unsqueeze_rule(C::rule.out, Dim);

  /// @brief Takes the operand's shape with a 1 inserted at `Dim`.
  explicit unsqueeze_node(C c) : detail::op_node<C>(std::move(c)) {
    const auto s = std::get<0>(this->children_).shape();
    for (std::size_t d = 0, i = 0; d < rank; ++d) shape_[d] = d == Dim ? 1 : s[i++];
  }
  /// @brief The operand's shape with a dim of extent 1 at `Dim`.
  [[nodiscard]] const shape_t<rank>& shape() const { return shape_; }

  /// @brief Copies this place's block of the operand into `out` unchanged.
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto in = ctx.template operand<0>();
    detail::copy_bytes(out.where(), out.data(), out.where(), in.data, out.bytes());  // operands live on out's place
  }

 private:
  shape_t<rank> shape_{};
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXPR_RESHAPE_HPP
// ---- pdo/expr/softmax.hpp
#ifndef PDO_SINGLE_PDO_EXPR_SOFTMAX_HPP
#define PDO_SINGLE_PDO_EXPR_SOFTMAX_HPP
// pdo/expr/softmax.hpp: softmax and log_softmax along one dim, and the cross-entropy loss.

// ---- pdo/kernels/softmax.hpp
#ifndef PDO_SINGLE_PDO_KERNELS_SOFTMAX_HPP
#define PDO_SINGLE_PDO_KERNELS_SOFTMAX_HPP
// pdo/kernels/softmax.hpp: softmax, log_softmax and cross-entropy rows, as Thrust kernels.


#include <cmath>
#include <cstddef>
#include <cstdint>

namespace pdo::detail {

/// @brief The log-sum-exp pieces of a row of `extent` elements `stride` apart: its max, and
/// the sum of exp(x - max) over every element but the (first) maximum, whose own term is 1.
/// log(sum) is then log1p(rest): exact for sums near 1, where log(1 + rest) would lose rest
/// to the rounding of 1 + rest.
template <class T>
struct log_sum_exp_parts {
  T top;
  T rest;
  PDO_HD log_sum_exp_parts(const T* row, std::size_t extent, std::size_t stride) {
    using std::exp;
    std::size_t at = 0;
    top = row[0];
    for (std::size_t e = 1; e < extent; ++e) {
      const T v = row[e * stride];
      if (v > top || (v != v && top == top)) {  // the first NaN is the max, as with nan_max
        top = v;
        at = e;
      }
    }
    // the max's own term, exp(max - max), is 1 for a finite max and NaN for +-inf (a row with
    // an infinite max is NaN throughout, as PyTorch gives): rest starts from max - max
    rest = top - top;
    for (std::size_t e = 0; e < extent; ++e)
      if (e != at) rest += static_cast<T>(exp(row[e * stride] - top));
  }
  /// @brief log(sum of exp(x - max)).
  PDO_HD T log_sum() const {
    using std::log1p;
    return static_cast<T>(log1p(rest));
  }
  /// @brief sum of exp(x - max).
  PDO_HD T sum() const { return T(1) + rest; }
};

/// @brief Row r of a softmax along the middle dim of [outer, extent, inner]: the row's max
/// is subtracted first, so large inputs do not overflow, and log_softmax is
/// (x - max) - log1p(rest) (see log_sum_exp_parts): neither the sum nor its log is rounded
/// to the precision of a large max.
template <class T, bool Log>
struct softmax_row {
  const T* in;
  T* out;
  std::size_t extent, inner;
  PDO_HD void operator()(std::size_t r) const {
    using std::exp;
    const std::size_t base = (r / inner) * extent * inner + r % inner;
    const log_sum_exp_parts<T> parts(in + base, extent, inner);
    if constexpr (Log) {
      const T log_sum = parts.log_sum();
      for (std::size_t e = 0; e < extent; ++e) out[base + e * inner] = (in[base + e * inner] - parts.top) - log_sum;
    } else {
      const T sum = parts.sum();
      for (std::size_t e = 0; e < extent; ++e) out[base + e * inner] = static_cast<T>(exp(in[base + e * inner] - parts.top)) / sum;
    }
  }
};

/// @brief The sum of exp(x - max) over a row, in two parts: how many elements equal the max
/// (each adds exactly 1), and the sum over the others. log_sum_exp_parts' `rest` is then
/// (ties - 1) + others, exact for a row with one max, whatever order the terms were added in.
template <class T>
struct exp_sum_parts {
  T ties;
  T others;
};

template <class T>
struct add_exp_sum_parts {
  PDO_HD exp_sum_parts<T> operator()(const exp_sum_parts<T>& a, const exp_sum_parts<T>& b) const {
    return {a.ties + b.ties, a.others + b.others};
  }
};

/// @brief Element e of row r's exp_sum_parts, given the rows' maxima `tops`.
template <class T>
struct exp_sum_part_of {
  element_along_dim<T> element;
  const T* tops;
  PDO_HD exp_sum_parts<T> operator()(std::size_t r, std::size_t e) const {
    using std::exp;
    const T x = element(r, e);
    if (x == tops[r]) return {T(1), x - x};  // x - x: NaN for an infinite max, as log_sum_exp_parts
    return {T(0), static_cast<T>(exp(x - tops[r]))};
  }
};

/// @brief (ties - 1) + others: the sum of exp(x - max) over a row but for one maximum (see
/// exp_sum_parts), log_sum_exp_parts' `rest`.
template <class T>
PDO_HD T rest_of(const exp_sum_parts<T>& p) {
  return (p.ties - T(1)) + p.others;
}

/// @brief log(sum of exp(x - max)) of a row from its parts: log1p(rest), as log_sum_exp_parts.
template <class T>
PDO_HD T log_sum_of(const exp_sum_parts<T>& p) {
  using std::log1p;
  return static_cast<T>(log1p(rest_of(p)));
}

/// @brief The log-sum-exp statistics of the rows of [outer, extent, inner] along the middle
/// dim, in the memory of a GPU place for the kernels of one op, computed by two segmented
/// reductions (a block of threads per long row): tops()[r] the row's max, parts()[r] its
/// exp_sum_parts.
template <class T>
class row_statistics {
 public:
  row_statistics(gpu_system& system, const T* in, const dim_view& v)
      : tops_(*system.place, v.outer * v.inner), parts_(*system.place, v.outer * v.inner) {
    const element_along_dim<T> element{in, v.extent, v.inner};
    const bool contiguous = v.inner == 1;
    const std::size_t rows = v.outer * v.inner;
    segmented_reduce(system, rows, v.extent, contiguous, element, reduction_identity<T>(reduction::max), max_of<T>{}, tops_.data());
    segmented_reduce(system, rows, v.extent, contiguous, exp_sum_part_of<T>{element, tops_.data()}, exp_sum_parts<T>{T(0), T(0)},
                     add_exp_sum_parts<T>{}, parts_.data());
  }
  [[nodiscard]] const T* tops() const { return tops_.data(); }
  [[nodiscard]] const exp_sum_parts<T>* parts() const { return parts_.data(); }

 private:
  kernel_scratch<T> tops_;
  kernel_scratch<exp_sum_parts<T>> parts_;
};

/// @brief Element i of softmax (or log_softmax) of [outer, extent, inner] along the middle
/// dim, from its row's statistics.
template <class T, bool Log>
struct softmax_element {
  const T* in;
  const T* tops;
  const exp_sum_parts<T>* parts;
  std::size_t extent, inner;
  PDO_HD T operator()(std::size_t i) const {
    using std::exp;
    const std::size_t r = (i / (extent * inner)) * inner + i % inner;
    if constexpr (Log) return (in[i] - tops[r]) - log_sum_of(parts[r]);
    else return static_cast<T>(exp(in[i] - tops[r])) / (T(1) + rest_of(parts[r]));
  }
};

/// @brief softmax (or log_softmax) of `in` laid out as `v`, along its middle dim, into `out`.
/// A CPU place and short rows on a GPU: one work item per row. Long rows on a GPU: the rows'
/// statistics by segmented reductions (a block of threads per row), then one thread per element.
template <bool Log, class T>
void softmax_dim(place_system& system, const T* in, const dim_view& v, T* out) {
  if (v.extent == 0) return;
  const std::size_t rows = v.outer * v.inner;
  const thrust::counting_iterator<std::size_t> begin(0);
  system.visit([&](auto& backend) {
    if constexpr (gpu_backend<decltype(backend)>) {
      if (v.extent >= long_segment) {
        const row_statistics<T> stats(backend, in, v);
        transform(backend, begin, begin + static_cast<std::ptrdiff_t>(rows * v.extent), out,
                  softmax_element<T, Log>{in, stats.tops(), stats.parts(), v.extent, v.inner});
        return;
      }
    }
    for_each_n(backend, begin, rows, softmax_row<T, Log>{in, out, v.extent, v.inner});
  });
}

/// @brief The loss of sample i: log-sum-exp of its logits minus the logit of its label,
/// as log1p(rest) - (logit - max) (see log_sum_exp_parts), so a large max costs no precision.
template <class T, class Label>
struct cross_entropy_row {
  const T* logits;
  const Label* labels;
  std::size_t classes;
  PDO_HD T operator()(std::size_t i) const {
    const T* row = logits + i * classes;
    const log_sum_exp_parts<T> parts(row, classes, 1);
    return parts.log_sum() - (row[static_cast<std::size_t>(labels[i])] - parts.top);
  }
};

/// @brief The loss of sample i from its row's statistics (as cross_entropy_row).
template <class T, class Label>
struct cross_entropy_from_parts {
  const T* logits;
  const Label* labels;
  const T* tops;
  const exp_sum_parts<T>* parts;
  std::size_t classes;
  PDO_HD T operator()(std::size_t i) const {
    return log_sum_of(parts[i]) - (logits[i * classes + static_cast<std::size_t>(labels[i])] - tops[i]);
  }
};

/// @brief *out (in the memory of the system's place) = the sum of the losses of `rows` samples
/// of `classes` logits each. A CPU place and few classes on a GPU: a work item per sample; many
/// classes on a GPU: the rows' statistics by segmented reductions first.
template <class T, class Label>
void cross_entropy_sum_into(place_system& system, const T* logits, const Label* labels, std::size_t rows, std::size_t classes, T* out) {
  const thrust::counting_iterator<std::size_t> begin(0), end(rows);
  system.visit([&](auto& backend) {
    if constexpr (gpu_backend<decltype(backend)>) {
      if (classes >= long_segment) {
        const row_statistics<T> stats(backend, logits, dim_view{rows, classes, 1});
        transform_reduce_into(backend, begin, end, cross_entropy_from_parts<T, Label>{logits, labels, stats.tops(), stats.parts(), classes},
                              T{}, thrust::plus<T>{}, out);
        return;
      }
    }
    transform_reduce_into(backend, begin, end, cross_entropy_row<T, Label>{logits, labels, classes}, T{}, thrust::plus<T>{}, out);
  });
}

/// @brief Row r of d(mean cross-entropy)/d(logits), times `scale`: (softmax(row) - one_hot(label)) * scale.
template <class T, class Label>
struct cross_entropy_grad_row {
  const T* logits;
  const Label* labels;
  T* out;
  std::size_t classes;
  T scale;
  PDO_HD void operator()(std::size_t r) const {
    softmax_row<T, false>{logits + r * classes, out + r * classes, classes, 1}(0);
    const auto label = static_cast<std::size_t>(labels[r]);
    for (std::size_t c = 0; c < classes; ++c) out[r * classes + c] = (out[r * classes + c] - (c == label ? T(1) : T(0))) * scale;
  }
};

/// @brief Element i of the cross-entropy gradient, from its row's statistics (as cross_entropy_grad_row).
template <class T, class Label>
struct cross_entropy_grad_element {
  softmax_element<T, false> softmax;
  const Label* labels;
  T scale;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t r = i / softmax.extent, c = i % softmax.extent;
    return (softmax(i) - (c == static_cast<std::size_t>(labels[r]) ? T(1) : T(0))) * scale;
  }
};

/// @brief out = (softmax(logits) - one_hot(labels)) * scale for `rows` rows of `classes`. A CPU
/// place and few classes on a GPU: a work item per row; many classes on a GPU: the rows'
/// statistics by segmented reductions, then a thread per element.
template <class T, class Label>
void cross_entropy_grad(place_system& system, const T* logits, const Label* labels, std::size_t rows, std::size_t classes, T scale,
                        T* out) {
  const thrust::counting_iterator<std::size_t> begin(0);
  system.visit([&](auto& backend) {
    if constexpr (gpu_backend<decltype(backend)>) {
      if (classes >= long_segment) {
        const row_statistics<T> stats(backend, logits, dim_view{rows, classes, 1});
        transform(backend, begin, begin + static_cast<std::ptrdiff_t>(rows * classes), out,
                  cross_entropy_grad_element<T, Label>{{logits, stats.tops(), stats.parts(), classes, 1}, labels, scale});
        return;
      }
    }
    for_each_n(backend, begin, rows, cross_entropy_grad_row<T, Label>{logits, labels, out, classes, scale});
  });
}

/// @brief *out = *out / count (the mean of a sum), NaN for no samples (the mean of nothing,
/// as PyTorch gives).
template <class T>
struct mean_of_sum {
  T* out;
  std::size_t count;
  PDO_HD void operator()(std::size_t) const { *out = count == 0 ? T(0) / T(0) : *out / static_cast<T>(count); }
};

/// @brief 1 for a label outside [0, classes), else 0.
template <class Label>
struct label_out_of_range {
  const Label* labels;
  std::size_t classes;
  PDO_HD std::size_t operator()(std::size_t i) const {
    const Label l = labels[i];
    if (!(l >= Label(0) && static_cast<double>(l) < static_cast<double>(classes))) return 1;  // NaN too
    return l != Label(static_cast<std::int64_t>(l)) ? 1 : 0;                                  // a fraction
  }
};

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_KERNELS_SOFTMAX_HPP

#include <cstddef>
#include <limits>
#include <string>
#include <tuple>

namespace pdo {

/// @brief softmax (or log_softmax when `Log`) of its operand along dim `Dim`. The dim is
/// gathered first where it is split (see detail::along_dim_rule).
template <bool Log, std::size_t Dim, class C>
class softmax_node : public detail::op_node<C> {
 public:
  /// @brief The operand's floating-point element type, which the result keeps.
  using value_type = typename C::value_type;
  static_assert(Dim < C::rank, "pdo: softmax: the dim is out of range for the operand's rank");
  static_assert(std::is_floating_point_v<value_type>, "pdo: softmax: needs a floating-point operand");
  /// @brief The operand's rank.
  static constexpr std::size_t rank = C::rank;
  /// @brief false: a softmax is never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "softmax" or "log_softmax", as plans and error messages print it.
  static constexpr std::string_view name = Log ? "log_softmax" : "softmax";
  /// @brief The planner's rule (detail::along_dim_rule): dim `Dim` whole on each place, partials reduced.
  static constexpr detail::op_rule rule = detail::along_dim_rule(C::rule.out, Dim);

  /// @brief Wraps the operand; no check runs here (the dim and type are checked at compile time).
  explicit softmax_node(C c) : detail::op_node<C>(std::move(c)) {}
  /// @brief The operand's shape.
  [[nodiscard]] shape_t<rank> shape() const { return std::get<0>(this->children_).shape(); }

  /// @brief Writes the softmax (or log_softmax) along `Dim` of this place's block of the operand into `out`.
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto in = ctx.template operand<0>();
    detail::softmax_dim<Log>(ctx.system, in.data, detail::view_along(in.shape, Dim), out.data());
  }

 private:
};

/// @brief cross_entropy(logits [N, C], labels [N]): the mean over the N samples of
/// -log softmax(logits)[label]. Labels are class indices of any element type.
template <class Logits, class Labels>
class cross_entropy_node : public detail::op_node<Logits, Labels> {

 public:
  /// @brief The logits' floating-point element type, which the loss has.
  using value_type = typename Logits::value_type;
  static_assert(Logits::rank == 2 && Labels::rank == 1, "pdo: cross_entropy: takes logits [N, C] and labels [N]");
  static_assert(std::is_floating_point_v<value_type>, "pdo: cross_entropy: needs floating-point logits");
  /// @brief 0: the loss is one number.
  static constexpr std::size_t rank = 0;
  /// @brief false: a cross_entropy is never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "cross_entropy": how plans and error messages name this op.
  static constexpr std::string_view name = "cross_entropy";
  /// @brief The planner's rule (detail::cross_entropy_rule): classes gathered, labels beside their rows; a split
  /// N makes the result partial.
  static constexpr detail::op_rule rule = detail::cross_entropy_rule(Logits::rule.out, Labels::rule.out);

  /// @brief pdo::shape_error unless there is one label per row of logits and, for N > 0, at least one class.
  cross_entropy_node(Logits logits, Labels labels) : detail::op_node<Logits, Labels>(std::move(logits), std::move(labels)) {
    const auto sl = std::get<0>(this->children_).shape();
    const auto sb = std::get<1>(this->children_).shape();
    if (sl[0] != sb[0] || (sl[1] == 0 && sl[0] != 0))
      throw shape_error("cross_entropy: logits " + detail::describe_node(std::get<0>(this->children_)) + " and labels " +
                        detail::describe_node(std::get<1>(this->children_)) +
                        ": need one label per row of logits and at least one class");
  }
  /// @brief The empty shape of rank 0.
  [[nodiscard]] shape_t<0> shape() const { return {}; }

  /// @brief Writes into `out` this place's rows' summed losses divided by the global N; pdo::shape_error when
  /// a label is not a class index in [0, C).
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, 0>& out) const {
    const auto logits = ctx.template operand<0>();
    const auto labels = ctx.template operand<1>();
    using label_t = typename Labels::value_type;
    const std::size_t rows = logits.shape[0], classes = logits.shape[1];
    const label_t* first = labels.data + (logits.offset[0] - labels.offset[0]);  // replicated labels: read at the rows' offset
    const thrust::counting_iterator<std::size_t> begin(0), end(rows);
    const std::size_t bad = thrust::transform_reduce(ctx.system, begin, end, detail::label_out_of_range<label_t>{first, classes},
                                                     std::size_t{0}, thrust::plus<std::size_t>{});
    if (bad != 0)
      throw shape_error("cross_entropy: " + std::to_string(bad) + " labels of " + detail::describe_node(std::get<1>(this->children_)) +
                        " are not class indices in [0, " + std::to_string(classes) + ")");
    // the sum of the rows' losses, then divided by the global row count, where the result lives
    detail::cross_entropy_sum_into(ctx.system, logits.data, first, rows, classes, out.data());
    thrust::for_each_n(ctx.system, begin, std::size_t{1}, detail::mean_of_sum<value_type>{out.data(), logits.global[0]});
  }

 private:
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXPR_SOFTMAX_HPP

#include <cstddef>
#include <utility>

namespace pdo {

namespace detail {
/// @brief An operand of an arithmetic operator: a tensor operand, or a number beside one.
template <class A, class B>
concept arithmetic_operands = (tensor_operand<A> || tensor_operand<B>) && (tensor_operand<A> || element<std::remove_cvref_t<A>>) &&
                              (tensor_operand<B> || element<std::remove_cvref_t<B>>);

template <class Op, class... Args>
auto make_elementwise(Args&&... args) {
  return elementwise_node<Op, expression_t<Args>...>(as_expression(std::forward<Args>(args))...);
}
}  // namespace detail

/// @brief The value of `dim` that means "every dim" (sum, mean, max) or "the last dim" (softmax).
inline constexpr std::size_t all_dims = static_cast<std::size_t>(-1);
inline constexpr std::size_t last_dim = static_cast<std::size_t>(-1);

// Arithmetic: tensor operands, with plain numbers on either side.
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto operator+(A&& a, B&& b) {
  return detail::make_elementwise<op::add>(std::forward<A>(a), std::forward<B>(b));
}
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto operator-(A&& a, B&& b) {
  return detail::make_elementwise<op::subtract>(std::forward<A>(a), std::forward<B>(b));
}
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto operator*(A&& a, B&& b) {
  return detail::make_elementwise<op::multiply>(std::forward<A>(a), std::forward<B>(b));
}
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto operator/(A&& a, B&& b) {
  return detail::make_elementwise<op::divide>(std::forward<A>(a), std::forward<B>(b));
}
template <detail::tensor_operand A>
auto operator-(A&& a) {
  return detail::make_elementwise<op::negate>(std::forward<A>(a));
}

// Elementwise functions.
template <detail::tensor_operand A>
auto exp(A&& a) { return detail::make_elementwise<op::exp>(std::forward<A>(a)); }
template <detail::tensor_operand A>
auto log(A&& a) { return detail::make_elementwise<op::log>(std::forward<A>(a)); }
template <detail::tensor_operand A>
auto sqrt(A&& a) { return detail::make_elementwise<op::sqrt>(std::forward<A>(a)); }
template <detail::tensor_operand A>
auto tanh(A&& a) { return detail::make_elementwise<op::tanh>(std::forward<A>(a)); }
template <detail::tensor_operand A>
auto sigmoid(A&& a) { return detail::make_elementwise<op::sigmoid>(std::forward<A>(a)); }
template <detail::tensor_operand A>
auto relu(A&& a) { return detail::make_elementwise<op::relu>(std::forward<A>(a)); }
/// @brief GELU, exact (erf form): what PyTorch's F.gelu computes by default.
template <detail::tensor_operand A>
auto gelu(A&& a) { return detail::make_elementwise<op::gelu>(std::forward<A>(a)); }
/// @brief GELU, tanh approximation: PyTorch's F.gelu(x, approximate="tanh") (GPT-2's).
template <detail::tensor_operand A>
auto gelu_tanh(A&& a) { return detail::make_elementwise<op::gelu_tanh>(std::forward<A>(a)); }

/// @brief Elementwise maximum and minimum of two operands.
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto maximum(A&& a, B&& b) { return detail::make_elementwise<op::maximum>(std::forward<A>(a), std::forward<B>(b)); }
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto minimum(A&& a, B&& b) { return detail::make_elementwise<op::minimum>(std::forward<A>(a), std::forward<B>(b)); }

// Comparisons: 1 where they hold, 0 elsewhere, in the operands' element type.
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto less(A&& a, B&& b) { return detail::make_elementwise<op::less>(std::forward<A>(a), std::forward<B>(b)); }
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto less_equal(A&& a, B&& b) { return detail::make_elementwise<op::less_equal>(std::forward<A>(a), std::forward<B>(b)); }
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto greater(A&& a, B&& b) { return detail::make_elementwise<op::greater>(std::forward<A>(a), std::forward<B>(b)); }
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto greater_equal(A&& a, B&& b) {
  return detail::make_elementwise<op::greater_equal>(std::forward<A>(a), std::forward<B>(b));
}
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto equal(A&& a, B&& b) { return detail::make_elementwise<op::equal>(std::forward<A>(a), std::forward<B>(b)); }
template <class A, class B>
  requires detail::arithmetic_operands<A, B>
auto not_equal(A&& a, B&& b) { return detail::make_elementwise<op::not_equal>(std::forward<A>(a), std::forward<B>(b)); }

/// @brief a where `cond` is nonzero, else b (each may be a number).
template <detail::tensor_operand C, class A, class B>
  requires(detail::tensor_operand<A> || element<std::remove_cvref_t<A>>) && (detail::tensor_operand<B> || element<std::remove_cvref_t<B>>)
auto where(C&& cond, A&& a, B&& b) {
  return detail::make_elementwise<op::where>(std::forward<C>(cond), std::forward<A>(a), std::forward<B>(b));
}

/// @brief Matrix product: a [..., M, K] by b [K, N] or [..., K, N].
template <detail::tensor_operand A, detail::tensor_operand B>
auto matmul(A&& a, B&& b) {
  return matmul_node<detail::expression_t<A>, detail::expression_t<B>>(detail::as_expression(std::forward<A>(a)),
                                                                       detail::as_expression(std::forward<B>(b)));
}

namespace detail {
template <reduction What, std::size_t Dim, class A>
auto make_reduction(A&& a) {
  using e = expression_t<A>;
  if constexpr (Dim == all_dims) return reduce_node<What, 0, true, e>(as_expression(std::forward<A>(a)));
  else return reduce_node<What, Dim, false, e>(as_expression(std::forward<A>(a)));
}
}  // namespace detail

/// @brief Sum over dim `Dim` (which leaves the shape), or over every dim by default.
template <std::size_t Dim = all_dims, detail::tensor_operand A>
auto sum(A&& a) { return detail::make_reduction<detail::reduction::sum, Dim>(std::forward<A>(a)); }
/// @brief Mean over dim `Dim`, or over every dim by default.
template <std::size_t Dim = all_dims, detail::tensor_operand A>
auto mean(A&& a) { return detail::make_reduction<detail::reduction::mean, Dim>(std::forward<A>(a)); }
/// @brief Maximum over dim `Dim`, or over every dim by default.
template <std::size_t Dim = all_dims, detail::tensor_operand A>
auto max(A&& a) { return detail::make_reduction<detail::reduction::max, Dim>(std::forward<A>(a)); }

/// @brief softmax along dim `Dim` (the last by default).
template <std::size_t Dim = last_dim, detail::tensor_operand A>
auto softmax(A&& a) {
  using e = detail::expression_t<A>;
  return softmax_node<false, Dim == last_dim ? e::rank - 1 : Dim, e>(detail::as_expression(std::forward<A>(a)));
}
/// @brief log_softmax along dim `Dim` (the last by default).
template <std::size_t Dim = last_dim, detail::tensor_operand A>
auto log_softmax(A&& a) {
  using e = detail::expression_t<A>;
  return softmax_node<true, Dim == last_dim ? e::rank - 1 : Dim, e>(detail::as_expression(std::forward<A>(a)));
}
/// @brief Mean cross-entropy of logits [N, C] against class indices [N].
template <detail::tensor_operand L, detail::tensor_operand Y>
auto cross_entropy(L&& logits, Y&& labels) {
  return cross_entropy_node<detail::expression_t<L>, detail::expression_t<Y>>(detail::as_expression(std::forward<L>(logits)),
                                                                              detail::as_expression(std::forward<Y>(labels)));
}

/// @brief The last two dims swapped.
template <detail::tensor_operand A>
auto transpose(A&& a) {
  return transpose_node<detail::expression_t<A>>(detail::as_expression(std::forward<A>(a)));
}

/// @brief The same elements under `shape` (see reshape_node for what may change).
template <detail::tensor_operand A, std::size_t Rank>
auto reshape(A&& a, const std::size_t (&shape)[Rank]) {
  shape_t<Rank> s{};
  for (std::size_t d = 0; d < Rank; ++d) s[d] = shape[d];
  return reshape_node<Rank, detail::expression_t<A>>(detail::as_expression(std::forward<A>(a)), s);
}
template <detail::tensor_operand A, std::size_t Rank>
auto reshape(A&& a, const shape_t<Rank>& shape) {
  return reshape_node<Rank, detail::expression_t<A>>(detail::as_expression(std::forward<A>(a)), shape);
}

/// @brief `a` with a dim of extent 1 inserted at `Dim`; every dim keeps its split.
template <std::size_t Dim, detail::tensor_operand A>
auto unsqueeze(A&& a) {
  return unsqueeze_node<Dim, detail::expression_t<A>>(detail::as_expression(std::forward<A>(a)));
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXPR_OPERATORS_HPP
// ---- pdo/plan/explain.hpp
#ifndef PDO_SINGLE_PDO_PLAN_EXPLAIN_HPP
#define PDO_SINGLE_PDO_PLAN_EXPLAIN_HPP
// pdo/plan/explain.hpp: an expression's plan printed for its actual shapes, with the bytes each collective moves.


#include <cstddef>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief What explain knows of one node: its description and global shape.
struct node_facts {
  std::string text;
  std::vector<std::size_t> shape;
  std::size_t element_size = 0;
};

/// @brief Records every node of `node`'s subtree in evaluation order (the numbering of plan_of).
template <class Node>
void collect_nodes(const Node& node, std::vector<node_facts>& out) {
  if constexpr (Node::is_scalar) {
    return;
  } else {
    if constexpr (!Node::is_leaf) std::apply([&](const auto&... c) { (collect_nodes(c, out), ...); }, node.children());
    const auto s = node.shape();
    out.push_back({std::string(Node::name) + " " + describe_node(node), {s.begin(), s.end()}, sizeof(typename Node::value_type)});
  }
}

/// @brief Bytes place 0 sends in one redistribution step of a tensor of `shape` (ring
/// algorithms: all_reduce 2(n-1)/n of its block, reduce_scatter and all_to_all (n-1)/n,
/// all_gather (n-1) blocks); local steps send nothing.
template <class Mesh>
std::size_t bytes_sent(const Mesh& m, const redistribute_step& s, const std::vector<std::size_t>& shape, std::size_t element) {
  const std::size_t n = m.extent(Mesh::axis_index(s.axis));
  std::size_t block = element;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    std::size_t e = shape[d];
    if (!s.before.dim_axis[d].empty()) e = chunk_size(e, m.extent(Mesh::axis_index(s.before.dim_axis[d])), 0);
    block *= e;
  }
  switch (s.kind) {
    case step_kind::all_reduce: return 2 * (n - 1) * block / n;
    case step_kind::reduce_scatter:
    case step_kind::all_to_all: return (n - 1) * block / n;
    case step_kind::all_gather: return (n - 1) * block;
    default: return 0;
  }
}

}  // namespace detail

/// @brief The plan of `expr` for its actual shapes, one line per step: each op's kernel
/// with its output layout, ops fused into one kernel marked as such, and each collective
/// with its axis, layouts and the bytes each place sends (place 0's block where shards are uneven).
template <class Expr>
std::string explain(const Expr& expr) {
  const auto& node = expr;
  using node_t = std::remove_cvref_t<Expr>;
  static_assert(tensor_expression<node_t>, "pdo: explain: pass an expression (an op applied to tensors or dtensors)");
  constexpr expression_plan plan = plan_of<node_t>();
  std::vector<detail::node_facts> nodes;
  detail::collect_nodes(node, nodes);
  [[maybe_unused]] const auto* mesh = detail::find_mesh(node);  // nullptr for local expressions
  std::string text = "plan of " + std::string(node_t::name) + " -> " + detail::describe_node(node);
  if constexpr (node_t::distributed) text += " on " + mesh->describe();
  text += ": " + std::to_string(plan.kernels()) + " kernel" + (plan.kernels() == 1 ? "" : "s") + ", " +
          std::to_string(plan.collectives()) + " collective" + (plan.collectives() == 1 ? "" : "s") + "\n";
  // the kernel a fused op runs inside: the first op up its chain of consumers that is not fused
  auto runs_in = [&](const plan_step& fused) {
    std::size_t consumer = fused.into;
    for (bool up = true; up;) {
      up = false;
      for (const auto& s : plan)
        if (s.kind == plan_step_kind::kernel && s.fused && s.node == consumer) {
          consumer = s.into;
          up = true;
          break;
        }
    }
    return consumer;
  };
  std::size_t line = 0;
  for (const auto& s : plan) {
    const auto& facts = nodes[s.node];
    if (s.kind == plan_step_kind::kernel && s.fused) continue;  // printed with the kernel it runs in
    text += "  " + std::to_string(++line) + ". ";
    if (s.kind == plan_step_kind::kernel) {
      std::string fused_ops;
      for (const auto& f : plan)
        if (f.kind == plan_step_kind::kernel && f.fused && runs_in(f) == s.node) fused_ops += std::string(f.op) + " + ";
      text += "kernel " + (fused_ops.empty() ? std::string(s.op) : "fused(" + fused_ops + std::string(s.op) + ")") + " -> " +
              facts.text.substr(facts.text.find(' ') + 1) + "\n";
      continue;
    }
    const auto& operand = nodes[s.operand_node];
    text += std::string(s.kind == plan_step_kind::combine_max ? "all_reduce(max)" : step_name(s.move.kind)) + " over " +
            std::string(s.move.axis) + " for " + std::string(s.op) + (s.kind == plan_step_kind::redistribute
                                                                           ? " operand " + std::to_string(s.operand) + " (" +
                                                                                 operand.text + ")"
                                                                           : std::string()) +
            ": " + detail::to_string(s.move.before) + " -> " + detail::to_string(s.move.after);
    if constexpr (node_t::distributed) {
      const auto& data = s.kind == plan_step_kind::combine_max ? facts : operand;
      text += ", " + std::to_string(detail::bytes_sent(*mesh, s.move, data.shape, data.element_size)) + " bytes sent per place";
    }
    text += "\n";
  }
  if (plan.size == 0) text += "  (nothing to compute: the result is the operand)\n";
  return text;
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_PLAN_EXPLAIN_HPP

#include <cstddef>
#include <exception>
#include <memory>
#include <tuple>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief An evaluation queued on the places of a mesh: the tasks of each step of its plan,
/// in the plan's order, and how to name it in an error (built only when one is thrown).
/// What does not depend on the expression's type lives here, compiled once, not once per
/// expression.
struct queued_evaluation {
  std::vector<std::shared_ptr<place_batch>> steps;
  /// @brief The addresses the runs' tasks write, taken when they are queued: the result may
  /// have been moved out (and freed) by the time the evaluation is.
  std::vector<const void*> written;
  /// @brief The mesh the evaluation runs on (its places name the failures).
  std::shared_ptr<const mesh_state> mesh;
  mesh_comms* comms = nullptr;
  [[nodiscard]] virtual std::string what() const = 0;
  [[nodiscard]] std::string place_name(std::size_t p) const { return mesh->places[p].name(); }

  /// @brief Waits for every task, ignoring failures (before the evaluation is freed).
  void finish_quietly() const noexcept {
    for (const auto& b : steps)
      for (const auto& t : b->tasks) t->wait_ended();
  }
  /// @brief Whether every task of every step has ended.
  [[nodiscard]] bool finished() const {
    for (const auto& b : steps)
      if (!b->finished()) return false;
    return true;
  }
  /// @brief Waits for every task; throws the failure of the first step that failed (the
  /// later ones were cancelled by it) as a pdo::error naming the op and place.
  void finish() const {
    for (const auto& b : steps) b->wait();
    for (const auto& b : steps)
      if (const auto failure = b->first_failure())
        failure->error.rethrow_with_context(what() + ": on place " + place_name(failure->place) + ": ");
  }

  /// @brief Queues one step of the plan on every place of the mesh in this process: a kernel
  /// on the compute lanes, a collective on the communication lanes.
  PDO_NOINLINE void queue(const char* op, bool collective, bool caller_waits, place_work work, place_access uses, place_detail detail) {
    const batch_options o{.op = op,
                          .category = collective ? "collective" : "kernel",
                          .communicate = collective,
                          .closing = collective,
                          .lane = collective ? lane_kind::communication : lane_kind::compute,
                          .caller_waits = caller_waits,
                          .ends_job = true,
                          .keeps_failure = true};
    steps.push_back(submit_on_mesh(*mesh, *comms, work, nullptr, o, uses, detail));
  }

 protected:
  // Not virtual: an evaluation is owned through make_owned, whose deleter destroys it as
  // what it is (a virtual destructor would add a deleting one to every evaluation's code).
  ~queued_evaluation() = default;
  /// @brief Notes the mesh and its communicators, and room for the addresses written.
  PDO_NOINLINE void start(std::shared_ptr<const mesh_state> m, mesh_comms& c, std::size_t writes) {
    mesh = std::move(m);
    comms = &c;
    written.reserve(writes);
  }
  /// @brief "eval of matmul -> f32[8, 4]{split<dp>, replicate}".
  PDO_NOINLINE static std::string describe_evaluation(std::string_view op, const std::string& result) {
    return "eval of " + std::string(op) + " -> " + result;
  }
  /// @brief Its tasks have ended (the derived evaluation frees each place's run after this).
  /// When one failed, the engine forgets the buffers they wrote, so storage allocated there
  /// later is not taken for the result of a failed task (a writer that succeeded holds
  /// nothing up once it has ended).
  PDO_NOINLINE void end() noexcept {
    finish_quietly();
    bool failed = false;
    for (const auto& b : steps)
      for (const auto& f : b->failures) failed = failed || f.has_value();
    if (failed) engine::instance().forget(written);
  }
};

/// @brief What an evaluation shares with the tasks it queued: the expression (its leaves
/// refer to the caller's tensors), the result, whose shards the tasks fill, and each local
/// place's run of the plan.
template <class Node, class Result>
struct evaluation final : queued_evaluation {
  using mesh_t = typename Node::mesh_type;
  using run_t = plan_run<Node, mesh_context<mesh_t>>;
  evaluation(Node e, Result r, mesh_comms& c) : expr(std::move(e)), result(std::move(r)), runs(result.mesh().local_places().size()) {
    start(result.mesh().state(), c, runs.size() * (run_t::nodes + 1));
    const auto& local = mesh->local;
    for (std::size_t k = 0; k < runs.size(); ++k) {
      runs[k].bind(expr, mesh_context<mesh_t>(result.mesh(), local[k]), result.local_shards()[k]);
      runs[k].add_written(written);
    }
  }
  evaluation(const evaluation&) = delete;
  evaluation& operator=(const evaluation&) = delete;
  ~evaluation() { end(); }
  Node expr;
  Result result;
  std::vector<run_t> runs;  ///< refer to expr and result
  [[nodiscard]] std::string what() const override { return describe_evaluation(Node::name, describe_node(expr)); }
};

/// @brief Owns a new `State` (an evaluation) through a shared_ptr whose control block is the
/// same type for every evaluation (a pointer to queued_evaluation and a plain deleter
/// function): make_shared would instantiate a control block of a dozen functions for each
/// expression type.
template <class State, class... Args>
std::shared_ptr<State> make_owned(Args&&... args) {
  using deleter = void (*)(queued_evaluation*);
  State* const made = new State(std::forward<Args>(args)...);
  std::shared_ptr<queued_evaluation> owner(static_cast<queued_evaluation*>(made),
                                           deleter{[](queued_evaluation* e) { delete static_cast<State*>(e); }});
  return std::shared_ptr<State>(std::move(owner), made);
}

/// @brief The trace's detail of step `S` of `Node`'s plan (built only while tracing).
template <class Node, std::size_t S, class Mesh>
std::string step_detail(const Node& root, const Mesh& m) {
  constexpr plan_step step = plan_run<Node, mesh_context<Mesh>>::plan.steps[S];
  if constexpr (step.kind == plan_step_kind::kernel) {
    return describe_node(node_numbered<step.node>(root));
  } else {
    constexpr std::size_t data = step.kind == plan_step_kind::redistribute ? step.operand_node : step.node;
    const auto& node = node_numbered<data>(root);
    const auto shape = node.shape();
    const std::vector<std::size_t> extents(shape.begin(), shape.end());
    const std::size_t bytes = bytes_sent(m, step.move, extents, sizeof(typename std::remove_cvref_t<decltype(node)>::value_type));
    return std::string(step.kind == plan_step_kind::combine_max ? "all_reduce(max)" : step_name(step.move.kind)) + " over " +
           std::string(step.move.axis) + " of " + describe_node(node) + ", " + std::to_string(bytes) + " bytes sent per place";
  }
}

/// @brief Queues step `S` of the plan of `state`'s expression on every place of its mesh in
/// this process: a kernel on the compute lanes; a collective on the communication lanes.
template <std::size_t S, class State>
void queue_step(const std::shared_ptr<State>& state, bool caller_waits) {
  using node_t = std::remove_cvref_t<decltype(state->expr)>;
  constexpr plan_step step = State::run_t::plan.steps[S];
  if constexpr (step.kind == plan_step_kind::kernel && step.fused) {
    return;  // runs inside the kernel of the op that reads it
  } else {
    constexpr bool collective = step.kind == plan_step_kind::combine_max ||
                                (step.kind == plan_step_kind::redistribute && communicates(step.move.kind));
    // plain functions of the evaluation: the tasks share the submission path of every operation
    state->queue(step.op.data(), collective, caller_waits,
                 place_work{[](void* s, std::size_t, std::size_t k) { static_cast<State*>(s)->runs[k].template run_step<S>(); }, state.get()},
                 place_access{[](const void* s, std::size_t, std::size_t k) { return static_cast<const State*>(s)->runs[k].template uses<S>(); },
                              state.get()},
                 place_detail{[](const void* s) {
                                const auto& e = *static_cast<const State*>(s);
                                return step_detail<node_t, S>(e.expr, e.result.mesh());
                              },
                              state.get()});
  }
}

/// @brief Queues the copy that evaluates an expression that is a dtensor.
template <class State>
void queue_copy(const std::shared_ptr<State>& state, bool caller_waits) {
  const place_work work{[](void* s, std::size_t, std::size_t k) { static_cast<State*>(s)->runs[k].copy_leaf(); }, state.get()};
  const place_access uses{[](const void* s, std::size_t, std::size_t k) { return static_cast<const State*>(s)->runs[k].copy_uses(); },
                          state.get()};
  state->steps.push_back(submit_on_mesh(*state->mesh, *state->comms, work, nullptr,
                                        batch_options{.op = "copy",
                                                      .category = "copy",
                                                      .communicate = false,
                                                      .caller_waits = caller_waits,
                                                      .ends_job = true,
                                                      .keeps_failure = true},
                                        uses));
}

/// @brief The shards of the result of an evaluation on `m`, of shape `global` laid out as
/// `out`, one for each place of this process, allocated in its memory (uninitialized).
template <class T, std::size_t Rank, class Mesh>
PDO_NOINLINE std::vector<tensor<T, Rank>> result_shards(const Mesh& m, const layout_value& out, const shape_t<Rank>& global,
                                                        std::string_view op) {
  if (m.local_places().empty()) throw layout_error("eval: this process holds no place of " + m.describe());
  checked_volume(global, op, sizeof(T));
  std::vector<tensor<T, Rank>> shards;
  shards.reserve(m.local_places().size());
  for (std::size_t p : m.local_places()) shards.emplace_back(shard_shape(m, out, global, p), m.place(p), uninitialized);
  return shards;
}

/// @brief Evaluates the local expression `node` where `ctx` says, into a new tensor.
template <class Node>
PDO_NOINLINE tensor<typename Node::value_type, Node::rank> run_local(const Node& node, local_context ctx) {
  checked_volume(node.shape(), Node::name, sizeof(typename Node::value_type));
  auto out = ctx.template allocate<typename Node::value_type>(node.shape());
  plan_run<Node, local_context>(node, ctx, out).run_all();
  return out;
}

/// @brief The evaluations this thread queued with eval_async and has not waited for: what
/// its wait_all waits for (another thread's wait_all waits for that thread's own).
inline std::vector<std::shared_ptr<const queued_evaluation>>& pending_evaluations() {
  thread_local std::vector<std::shared_ptr<const queued_evaluation>> pending;
  return pending;
}

/// @brief Allocates the result's shards and queues the steps of the plan of `expr` on every
/// place of its mesh in this process.
template <class Policy, class Expr>
auto queue_evaluation(Expr&& expr, bool caller_waits) {
  using node_t = expression_t<Expr>;
  static_assert(node_t::distributed,
                "pdo: eval_async: the expression has no dtensor operand; evaluate local tensors with pdo::eval");
  check_policy<Policy, node_t>();
  using T = typename node_t::value_type;
  using mesh_t = typename node_t::mesh_type;
  using result_t = dtensor<T, node_t::rank, mesh_t, result_layout_t<node_t>>;
  check_not_nested("eval");
  node_t node = as_expression(std::forward<Expr>(expr));
  const mesh_t& m = *find_mesh(node);
  check_one_mesh(node, m);
  mesh_comms& comms = comms_of(m);  // built by every process, those without places too
  const auto global = node.shape();
  auto shards = result_shards<T>(m, node_t::rule.out, global, node_t::name);
  auto state = make_owned<evaluation<node_t, result_t>>(std::move(node), result_t(m, global, std::move(shards)), comms);
  if constexpr (node_t::is_leaf) {
    queue_copy(state, caller_waits);
  } else {
    [&]<std::size_t... S>(std::index_sequence<S...>) { (queue_step<S>(state, caller_waits), ...); }(std::make_index_sequence<plan_of<node_t>().size>{});
  }
  return state;
}

}  // namespace detail

/// @brief The result of pdo::eval_async: a dtensor whose shards its places fill in the
/// order they run their queued work. The dtensor may be used at once in further
/// expressions (each place reads its shard after writing it); read it on the host after
/// wait() or get(). The operands must stay alive until then.
template <class DTensor>
class async_result {
 public:
  /// @brief The result's dtensor type.
  using value_type = DTensor;
  /// @brief Marks this class as an async result: expressions take it as a dtensor operand.
  using async_result_tag = void;

  /// @brief The result `*result`, owned by the queued evaluation `state` (what eval_async returns).
  async_result(std::shared_ptr<const detail::queued_evaluation> state, DTensor* result)
      : state_(std::move(state)), result_(result) {}

  /// @brief The result, possibly still being computed by its places. Used as an operand
  /// (`pdo::exp(r)`), an async_result keeps its evaluation alive until the expression is done.
  [[nodiscard]] const DTensor& value() const { return *result_; }
  /// @brief The result, sharing ownership of the evaluation that computes it.
  [[nodiscard]] std::shared_ptr<const DTensor> shared_value() const { return {state_, result_}; }
  /// @brief Whether every place has finished.
  [[nodiscard]] bool ready() const { return state_->finished(); }
  /// @brief Waits for every place; throws the first failure (a pdo::error naming the op and
  /// place; an evaluation that needed the result of one that failed is cancelled with that
  /// failure). pdo::wait_all of the thread that queued it no longer waits for it.
  void wait() const {
    std::erase_if(detail::pending_evaluations(), [&](const auto& e) { return e.get() == state_.get(); });
    state_->finish();
  }
  /// @brief Waits, then gives (a copy of) the result.
  [[nodiscard]] DTensor get() const& {
    wait();
    return *result_;
  }
  /// @brief Waits, then gives the result itself: this async_result and its copies then hold
  /// an empty dtensor, whose every use is a pdo::error.
  [[nodiscard]] DTensor get() && {
    wait();
    return std::move(*result_);
  }

 private:
  std::shared_ptr<const detail::queued_evaluation> state_;
  DTensor* result_;
};

/// @brief Queues the evaluation of a dtensor expression on every place of its mesh and
/// returns at once. Each place's part waits for the parts that write the shards it reads
/// (the engine orders them), so an expression may use the value of an earlier
/// async_result; independent work runs at the same time. Errors surface at wait(), get()
/// or pdo::wait_all() of the thread that queued it.
/// @tparam Policy pdo::implicit (default) or pdo::strict
template <class Policy = implicit, class Expr>
  requires detail::tensor_operand<Expr>
auto eval_async(Expr&& expr) {
  if constexpr (!detail::expression_t<Expr>::well_formed) {
    return 0;  // the operands' error was given where the expression was made: nothing more after it
  } else {
    auto state = detail::queue_evaluation<Policy>(std::forward<Expr>(expr), false);
    detail::pending_evaluations().push_back(state);
    return async_result<std::remove_cvref_t<decltype(state->result)>>(state, &state->result);
  }
}

/// @brief Waits for every evaluation that the calling thread queued with pdo::eval_async
/// and has not waited for (those of other threads are theirs to wait for); throws the first
/// failure among them (a pdo::error naming the op and place).
inline void wait_all() {
  std::vector<std::shared_ptr<const detail::queued_evaluation>> pending;
  pending.swap(detail::pending_evaluations());
  std::exception_ptr first;
  for (const auto& e : pending) {
    try {
      e->finish();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

/// @brief Evaluates an expression. Over dtensors: on every place of the mesh at once, with
/// the communication the plan calls for, giving a dtensor in the planned layout
/// (`pdo::result_layout_t<Expr>`). Over local tensors (on the host, or inside a
/// parallel_do block on that place's cores; on a GPU's place when they live in its memory,
/// from any thread): a pdo::tensor. Elementwise chains run as
/// one kernel that writes the result and allocates nothing else.
/// @tparam Policy pdo::implicit (default) or pdo::strict
template <class Policy = implicit, class Expr>
  requires detail::tensor_operand<Expr>
auto eval(Expr&& expr) {
  using node_t = detail::expression_t<Expr>;
  if constexpr (!node_t::well_formed) {
    return 0;  // the operands' error was given where the expression was made: nothing more after it
  } else if constexpr (node_t::distributed) {  // queue_evaluation checks the policy
    const auto state = detail::queue_evaluation<Policy>(std::forward<Expr>(expr), true);
    state->finish();
    return std::move(state->result);
  } else {
    detail::check_policy<Policy, node_t>();
    // not const: for a const variable nvcc's front end first tries constant initialization,
    // through every level of the expression's type, in time that grows fourfold a level
    node_t node = detail::as_expression(std::forward<Expr>(expr));
    // the kernels run where the operands are: on their GPU's place (on its compute lane), or
    // over host memory on the calling thread
    if (detail::place_state* const gpu = detail::local_home(node); gpu != nullptr)
      return detail::run_on_place(*gpu, [&] { return detail::run_local(node, detail::local_context{}); });
    return detail::run_local(node, detail::local_context(detail::on_gpu(detail::current_place())));
  }
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXEC_EVAL_HPP
// ---- pdo/exec/mesh_ops.hpp
#ifndef PDO_SINGLE_PDO_EXEC_MESH_OPS_HPP
#define PDO_SINGLE_PDO_EXEC_MESH_OPS_HPP
// pdo/exec/mesh_ops.hpp: distribute, redistribute and gather of dtensors: tasks on every
// place of the mesh, each running its part (pdo/tensor/redistribute.hpp).


#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {
/// @brief What a task that reads the storage at `data` declares (nothing for an empty
/// shard, which has none).
inline access reading(const void* data) {
  access a;
  if (data != nullptr) a.reads.push_back(data);
  return a;
}
}  // namespace detail

/// @brief Cuts the host tensor `host` over `m` as `Layout`: each place of this process
/// gets its chunk of the split dims, in its own memory; for partial axes, the places at
/// coordinate 0 get the value and the others zeros. Every process passes the same tensor.
template <layout_spec Layout, mesh_type Mesh, element T, std::size_t Rank>
dtensor<T, Rank, Mesh, Layout> distribute(const Mesh& m, const tensor<T, Rank>& host) {
  static_assert(sizeof(detail::check_layout<"distribute", Layout, Mesh, Rank>) != 0);
  const auto& local = m.local_places();
  std::vector<tensor<T, Rank>> shards(local.size());
  detail::run_on_places(
      "distribute", m,
      [&](std::size_t p, std::size_t k) {
        if (m.is_multiprocess()) detail::check_same_host_shape(m, p, host.shape());
        shards[k] = detail::shard_of<Layout>(m, host, p);
      },
      "copy");
  return {m, host.shape(), std::move(shards)};
}

/// @brief `x` laid out as `To`. The steps are planned at compile time
/// (redistribute_plan_of<From, To>()): partial -> replicate is an all_reduce,
/// partial -> split a reduce_scatter, split -> replicate an all_gather, split(d) ->
/// split(d') an all_to_all, and replicate -> split a local slice that moves no data.
template <layout_spec To, element T, std::size_t Rank, mesh_type Mesh, layout_spec From>
dtensor<T, Rank, Mesh, To> redistribute(const dtensor<T, Rank, Mesh, From>& x) {
  static_assert(sizeof(detail::check_layout<"redistribute", To, Mesh, Rank>) != 0);
  const Mesh& m = x.mesh();
  std::vector<tensor<T, Rank>> shards(x.local_shards().size());
  // each place's task reads its shard: it waits for the work queued to write it (an
  // eval_async's), and is cancelled with that work's error if it failed
  const auto failure = detail::try_run_on_places(
      m, [&](std::size_t p, std::size_t k) { shards[k] = detail::apply_plan<From, To>(m, x.shape(), p, x.local_shards()[k]); }, true,
      "redistribute", "collective", [&](std::size_t, std::size_t k) { return detail::reading(x.local_shards()[k].data()); });
  if (failure)
    failure->error.rethrow_with_context(detail::redistribute_context(x, layout_name<To>()) + ": on place " +
                                        m.place(failure->place).name() + ": ");
  return {m, x.shape(), std::move(shards)};
}

namespace detail {

/// @brief `x` with its partial axes summed (an all_reduce over each, shard by shard: no
/// place holds more than its shard), or `x` itself when it has none; then `f` of it. A
/// failure of the sum is an error of `op` (the operation that asked for it).
template <class T, std::size_t Rank, class Mesh, class Layout, class F>
decltype(auto) with_sums_done(const char* op, const dtensor<T, Rank, Mesh, Layout>& x, F&& f) {
  if constexpr (value_of<Layout>().npartial > 0) {
    std::optional<dtensor<T, Rank, Mesh, typename Layout::base>> whole;
    try {
      whole.emplace(redistribute<typename Layout::base>(x));
    } catch (const error&) {
      captured_error::current().rethrow_with_context(std::string(op) + ": ");
    }
    return f(*whole);
  } else {
    return f(x);
  }
}

/// @brief The blocks of `x` (no partial axes) that places of this process hold, written
/// into `out` (host memory, of x's global shape), each by a task of its place that reads
/// the shard: after the work queued to write it (an eval_async's) has ended, and never from
/// work that failed (its error is thrown, naming `op` and the place).
template <class T, std::size_t Rank, class Mesh, class Layout>
void write_local_blocks(const dtensor<T, Rank, Mesh, Layout>& x, tensor<T, Rank>& out, const char* op) {
  const auto& m = x.mesh();
  const auto failure = try_run_on_places(
      m,
      [&](std::size_t p, std::size_t k) {
        if (writes_block(m, value_of<Layout>(), p)) write_block(x.local_shards()[k], out, x.local_offset(p));
      },
      false, op, "copy", [&](std::size_t, std::size_t k) { return reading(x.local_shards()[k].data()); });
  if (failure) failure->error.rethrow_with_context(std::string(op) + ": " + x.describe() + ": on place " + m.place(failure->place).name() + ": ");
}

/// @brief The blocks of `x` (no partial axes) that places of other processes hold, into
/// `out` (host memory): with `to_all`, each block is broadcast over the whole mesh and
/// every process writes it; else each is sent to place `to`, whose process writes it. One
/// block is in flight at a time, so no place holds more than one block beside its shard.
template <class T, std::size_t Rank, class Mesh, class Layout>
void move_remote_blocks(const dtensor<T, Rank, Mesh, Layout>& x, tensor<T, Rank>* out, std::size_t to, bool to_all, const char* op) {
  const auto& m = x.mesh();
  const std::size_t first_local = m.local_places().front();
  run_on_places(op, m, [&](std::size_t p, std::size_t k) {
    const mesh_communicator comm = communicator_of(m, p);
    const int here = m.place(p).process();
    for (std::size_t q = 0; q < m.size(); ++q) {
      if (!writes_block(m, value_of<Layout>(), q)) continue;
      const bool remote = m.place(q).process() != here;
      if (to_all) {  // a collective: every place takes part
        tensor<T, Rank> received;
        // the root's buffer is only read by a broadcast
        std::span<T> buffer = p == q ? std::span<T>(const_cast<T*>(x.local_shards()[k].data()), x.local_shards()[k].size())
                                     : (received = tensor<T, Rank>(x.local_shape(q), m.place(p), uninitialized)).span();
        comm.broadcast(buffer, q);
        if (p == first_local && remote) write_block(received, *out, x.local_offset(q));
      } else if (m.place(q).process() != m.place(to).process()) {
        if (p == q) {
          comm.send(std::span<const T>(x.local_shards()[k].span()), to, 0);
        } else if (p == to) {
          tensor<T, Rank> received(x.local_shape(q), m.place(p), uninitialized);
          comm.recv(received.span(), q, 0);
          write_block(received, *out, x.local_offset(q));
        }
      }
    }
  });
}

}  // namespace detail

/// @brief The value of `x` as one host tensor, on every process: partial sums are reduced
/// (over each partial axis, shard by shard) and each block of the split dims is written into
/// the host tensor from its place, so no place ever holds the whole tensor (a tensor that
/// fits only when split can be gathered). Over several processes each block travels by a
/// broadcast; gather_to(x, root) brings it to one process only.
template <element T, std::size_t Rank, mesh_type Mesh, layout_spec Layout>
tensor<T, Rank> gather(const dtensor<T, Rank, Mesh, Layout>& x) {
  detail::check_not_nested("gather");
  const Mesh& m = x.mesh();
  detail::comms_of(m);  // built by every process, those without places too
  if (m.local_places().empty()) throw layout_error("gather: " + x.describe() + ": this process holds no place of the mesh");
  return detail::with_sums_done("gather", x, [&](const auto& whole) {
    auto out = tensor<T, Rank>::on_host(x.shape());
    detail::write_local_blocks(whole, out, "gather");
    if (m.is_multiprocess()) detail::move_remote_blocks(whole, &out, 0, true, "gather");
    return out;
  });
}

/// @brief The value of `x` as one host tensor on process `root` only (an MPI rank that owns
/// places of the mesh; 0 in a program of one process), and nothing on the others: each
/// block is sent from its place to the root, one at a time, so only the root holds the
/// whole tensor. Every process of the mesh calls it.
template <element T, std::size_t Rank, mesh_type Mesh, layout_spec Layout>
std::optional<tensor<T, Rank>> gather_to(const dtensor<T, Rank, Mesh, Layout>& x, int root = 0) {
  detail::check_not_nested("gather_to");
  const Mesh& m = x.mesh();
  detail::comms_of(m);
  std::size_t to = m.size();
  for (std::size_t q = 0; q < m.size() && to == m.size(); ++q)
    if (m.place(q).process() == root) to = q;
  if (to == m.size())
    throw layout_error("gather_to: " + x.describe() + ": process " + std::to_string(root) + " holds no place of the mesh");
  const auto& local = m.local_places();
  return detail::with_sums_done("gather_to", x, [&](const auto& whole) -> std::optional<tensor<T, Rank>> {
    if (local.empty()) return std::nullopt;
    const bool is_root = m.place(local.front()).process() == root;
    std::optional<tensor<T, Rank>> out;
    if (is_root) {
      out.emplace(tensor<T, Rank>::on_host(x.shape()));
      detail::write_local_blocks(whole, *out, "gather_to");
    }
    if (m.is_multiprocess()) detail::move_remote_blocks(whole, out ? &*out : nullptr, to, false, "gather_to");
    return out;
  });
}


}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXEC_MESH_OPS_HPP

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief What autograd needs to know of a value: a pdo::tensor (local: on the host or
/// inside a place's block) or a pdo::dtensor (every op runs over its mesh).
template <class V>
struct value_kind {
  static constexpr bool valid = false;
};
template <class T, std::size_t R>
struct value_kind<tensor<T, R>> {
  static constexpr bool valid = true;
  static constexpr bool distributed = false;
  using element_type = T;
  static constexpr std::size_t rank = R;
  using grad_type = tensor<T, R>;
};
template <class T, std::size_t R, class M, class L>
struct value_kind<dtensor<T, R, M, L>> {
  static constexpr bool valid = true;
  static constexpr bool distributed = true;
  using element_type = T;
  static constexpr std::size_t rank = R;
  /// @brief The gradient of a partial value (a pending sum) is the same for every addend:
  /// replicated over those axes. So an all_reduce's gradient is the identity (Megatron's g).
  using grad_type = dtensor<T, R, M, typename L::base>;
};

/// @brief The type of the gradient of a value of type V.
template <class V>
using grad_t = typename value_kind<V>::grad_type;

/// @brief A value autograd can differentiate: a floating-point tensor or dtensor.
template <class V>
concept differentiable = value_kind<V>::valid && std::floating_point<typename value_kind<V>::element_type>;

/// @brief `g`, an evaluated gradient, as the type of the value it is the gradient of. For
/// dtensors this is the redistribution the planner picks between the two layouts: the
/// partial gradient of a replicated parameter used on split data is all_reduced here.
template <class V, class G>
V to_value(G&& g) {
  using g_t = std::remove_cvref_t<G>;
  if constexpr (std::is_same_v<g_t, V>) {
    return std::forward<G>(g);
  } else {
    static_assert(value_kind<V>::distributed && value_kind<g_t>::distributed && value_kind<V>::rank == value_kind<g_t>::rank,
                  "pdo: autograd: a gradient's rank or kind differs from its value's");
    return redistribute<typename V::layout_type>(g);
  }
}

/// @brief Evaluates a gradient expression into the type of the value it belongs to.
template <class V, class E>
V eval_as(E&& e) {
  return to_value<V>(pdo::eval(std::forward<E>(e)));
}

/// @brief out[i] += in[i].
template <class T>
struct add_into_element {
  T* out;
  const T* in;
  PDO_HD void operator()(std::size_t i) const { out[i] += in[i]; }
};

/// @brief `sum += g`, in place, block by block (for a dtensor, each local shard; the two
/// have the same type, so the same layout and shard shapes).
template <class V>
void add_in_place(V& sum, const V& g) {
  auto add = [](auto& out, const auto& in) {
    for_each_index(out.where(), out.size(), add_into_element<typename value_kind<V>::element_type>{out.data(), in.data()});
  };
  if constexpr (value_kind<V>::distributed) {
    for (auto&& [out, in] : views::zip(sum.local_shards(), g.local_shards())) add(out, in);
  } else {
    add(sum, g);
  }
}

/// @brief A node of the recorded graph, type-erased: the value of one op (or a leaf) and
/// how to push its gradient to the nodes it was computed from.
struct grad_node {
  explicit grad_node(std::vector<std::shared_ptr<grad_node>> in) : inputs(std::move(in)), order(next_order()) {}
  grad_node(const grad_node&) = delete;
  grad_node& operator=(const grad_node&) = delete;
  virtual ~grad_node() = default;

  std::vector<std::shared_ptr<grad_node>> inputs;  ///< the operands that need gradients
  std::uint64_t order;                             ///< creation order: inputs come before their uses
  bool leaf = false;
  /// @brief A backward has run through this node and freed what it saved.
  bool released = false;
  /// @brief For leaves: called by backward once this leaf's gradient is complete (all its
  /// uses have contributed), while the rest of backward still runs.
  std::function<void()> on_gradient;

  [[nodiscard]] virtual bool has_grad() const = 0;
  virtual void propagate() = 0;  ///< adds this node's contribution to its inputs' gradients
  virtual void release() = 0;    ///< frees an intermediate's gradient and saved values

  static std::uint64_t next_order() {
    static std::atomic<std::uint64_t> counter{0};
    return counter.fetch_add(1, std::memory_order_relaxed);
  }
};

template <class V>
struct value_node final : grad_node {
  value_node(V v, std::vector<std::shared_ptr<grad_node>> in) : grad_node(std::move(in)), value(std::move(v)) {}

  V value;
  std::optional<grad_t<V>> grad;
  /// @brief Given this node (its value and gradient), adds to its inputs' gradients.
  std::function<void(value_node&)> backward;

  [[nodiscard]] bool has_grad() const override { return grad.has_value(); }
  void propagate() override {
    if (grad && backward) backward(*this);
  }
  void release() override {
    grad.reset();
    backward = nullptr;
    released = true;
  }
  /// @brief Adds `g` to the gradient. Several threads may add at once: the places of a
  /// parallel_do whose block uses one parameter run their backward passes together.
  void accumulate(grad_t<V> g) {
    std::lock_guard lock(accumulating);
    if (!grad) grad.emplace(std::move(g));
    else add_in_place(*grad, g);
  }
  std::mutex accumulating;
};

}  // namespace detail

/// @brief A value that records the ops applied to it, so pdo::backward can compute
/// gradients: a pdo::tensor (local) or a pdo::dtensor (distributed; each op runs over the
/// mesh with the layouts the planner derives, and so does each gradient). Copies share
/// the same node (like handles).
template <class V>
class var {
 public:
  static_assert(detail::value_kind<V>::valid, "pdo: var holds a pdo::tensor or a pdo::dtensor");
  /// @brief The held value's type: a pdo::tensor or a pdo::dtensor.
  using value_type = V;
  /// @brief The value's element type.
  using element_type = typename detail::value_kind<V>::element_type;
  /// @brief The value's number of dims.
  static constexpr std::size_t rank = detail::value_kind<V>::rank;
  /// @brief Whether the value is a dtensor (laid out over a mesh) rather than a local tensor.
  static constexpr bool distributed = detail::value_kind<V>::distributed;

  /// @brief An empty var, to assign later; using it before then throws pdo::error.
  var() = default;
  /// @brief A leaf: a constant, or (with `requires_grad`) a value to differentiate with respect to.
  explicit var(V value, bool requires_grad = false)
      : node_(std::make_shared<detail::value_node<V>>(std::move(value), std::vector<std::shared_ptr<detail::grad_node>>{})),
        requires_grad_(requires_grad) {
    node_->leaf = true;
  }
  /// @brief An op's result, recorded with the nodes it was computed from.
  var(std::shared_ptr<detail::value_node<V>> node, bool requires_grad) : node_(std::move(node)), requires_grad_(requires_grad) {}

  /// @brief The value (pdo::error on an empty, default-constructed var).
  [[nodiscard]] const V& value() const { return held().value; }
  /// @brief The value, to change in place (optimizers update parameters this way).
  [[nodiscard]] V& value() { return held().value; }
  /// @brief The value's (global) extents.
  [[nodiscard]] const auto& shape() const { return held().value.shape(); }
  /// @brief Whether backward computes a gradient for this value: a parameter, or a result of one.
  [[nodiscard]] bool requires_grad() const { return requires_grad_; }
  /// @brief Whether this var was made from a value (a constant or a parameter) rather than by an op.
  [[nodiscard]] bool is_leaf() const { return held().leaf; }
  /// @brief Whether a gradient is held now (backward reached this value and it was not zeroed or freed).
  [[nodiscard]] bool has_grad() const { return held().grad.has_value(); }
  /// @brief The gradient accumulated by pdo::backward (for a partial dtensor: replicated over its partial axes).
  [[nodiscard]] const detail::grad_t<V>& grad() const {
    if (!held().grad)
      throw error("var::grad: no gradient: " + std::string(requires_grad_ ? "backward has not reached this value"
                                                                          : "the value does not require a gradient"));
    return *node_->grad;
  }
  /// @brief The gradient, writable; pdo::error when there is none (see the const overload).
  [[nodiscard]] detail::grad_t<V>& grad() { return const_cast<detail::grad_t<V>&>(std::as_const(*this).grad()); }
  /// @brief Forgets the gradient (before the next backward, which would add to it).
  void zero_grad() { held().grad.reset(); }
  /// @brief Calls `f()` during backward once this leaf's gradient is complete.
  void on_gradient(std::function<void()> f) { held().on_gradient = std::move(f); }

  /// @brief The recorded graph node shared by copies of this var: its value, gradient and backward function.
  [[nodiscard]] const std::shared_ptr<detail::value_node<V>>& node() const { return node_; }

 private:
  detail::value_node<V>& held() const {
    if (!node_) throw error("var: this var is empty (default-constructed); assign it a value, a parameter or an op's result first");
    return *node_;
  }
  std::shared_ptr<detail::value_node<V>> node_;
  bool requires_grad_ = false;
};

/// @brief A leaf that requires a gradient: a parameter or an input to differentiate by.
template <class V>
var<V> parameter(V value) {
  return var<V>(std::move(value), true);
}

template <class T>
inline constexpr bool is_var_v = false;
template <class V>
inline constexpr bool is_var_v<var<V>> = true;

namespace detail {

/// @brief Records the result of an op: `value`, computed from `operands`, whose gradient
/// `backward(node)` pushes back to them. A result of operands that need no gradient is a
/// plain constant, and nothing is recorded.
template <class V, class Backward, class... Operands>
var<V> record(V value, Backward backward, const Operands&... operands) {
  std::vector<std::shared_ptr<grad_node>> inputs;
  (
      [&] {
        if (operands.requires_grad()) inputs.push_back(operands.node());
      }(),
      ...);
  if (inputs.empty()) return var<V>(std::move(value));
  auto node = std::make_shared<value_node<V>>(std::move(value), std::move(inputs));
  node->backward = std::move(backward);
  return var<V>(std::move(node), true);
}

/// @brief Adds the gradient expression `g` (evaluated into A's type) to `a`'s gradient, if `a` needs one.
template <class A, class G>
void add_grad(const var<A>& a, G&& g) {
  if (!a.requires_grad()) return;
  using target = grad_t<A>;
  if constexpr (std::is_same_v<std::remove_cvref_t<G>, target>) a.node()->accumulate(target(std::forward<G>(g)));
  else a.node()->accumulate(eval_as<target>(std::forward<G>(g)));
}

/// @brief The element of a rank-0 value, on the host (gathered for a dtensor, copied down
/// from a GPU's memory).
template <class V>
auto scalar_of(const V& v) {
  static_assert(value_kind<V>::rank == 0, "pdo: autograd: expected a rank-0 value");
  if constexpr (value_kind<V>::distributed) {
    return gather(v).data()[0];
  } else {
    typename value_kind<V>::element_type x{};
    copy_bytes(nullptr, &x, v.where(), v.data(), sizeof x);
    return x;
  }
}

}  // namespace detail

/// @brief Reverse mode: adds d(out)/d(leaf), weighted by `seed` (d(loss)/d(out)), to the
/// gradient of every leaf `out` depends on that requires one. Nodes run from the last
/// computed to the first; a leaf's on_gradient hook fires as soon as its last use has
/// contributed. Intermediate gradients and what the ops saved for them are freed as they
/// are consumed, so a graph takes one backward: a second one through any part of it is a
/// pdo::error (as PyTorch's without retain_graph), nothing is added.
template <class V>
void backward(const var<V>& out, detail::grad_t<V> seed) {
  if (!out.requires_grad()) throw error("backward: the value does not depend on anything that requires a gradient");
  if (seed.shape() != out.shape())
    throw shape_error("backward: the seed gradient " + detail::format_extents(seed.shape()) + " does not have the shape of the value " +
                      detail::format_extents(out.shape()) + " it is the gradient of");
  std::vector<detail::grad_node*> nodes;
  std::unordered_map<detail::grad_node*, std::size_t> uses;
  std::vector<detail::grad_node*> stack{out.node().get()};
  uses[out.node().get()] = 0;
  while (!stack.empty()) {
    detail::grad_node* n = stack.back();
    stack.pop_back();
    nodes.push_back(n);
    for (const auto& in : n->inputs) {
      auto [it, fresh] = uses.try_emplace(in.get(), 0);
      ++it->second;
      if (fresh) stack.push_back(in.get());
    }
  }
  for (const detail::grad_node* n : nodes)
    if (n->released)
      throw error("backward: part of the graph of this value was used by an earlier backward, which freed it; compute the value "
                  "again (run the forward again) to take another gradient");
  std::sort(nodes.begin(), nodes.end(), [](const auto* a, const auto* b) { return a->order > b->order; });
  const detail::timeline_span span("kernel", "backward", [&] { return std::to_string(nodes.size()) + " nodes"; });
  out.node()->accumulate(std::move(seed));
  for (detail::grad_node* n : nodes) {
    if (n->leaf) continue;
    n->propagate();
    for (const auto& in : n->inputs)
      if (--uses[in.get()] == 0 && in->leaf && in->on_gradient) in->on_gradient();
    n->release();
  }
  if (out.node()->leaf && out.node()->on_gradient) out.node()->on_gradient();
}

/// @brief Reverse mode from a rank-0 value (a loss): the seed is 1.
template <class V>
void backward(const var<V>& loss) {
  static_assert(detail::value_kind<V>::rank == 0,
                "pdo: backward(loss) needs a rank-0 value; pass the seed gradient for other values: backward(out, seed)");
  using T = typename detail::value_kind<V>::element_type;
  backward(loss, detail::eval_as<detail::grad_t<V>>(detail::make_elementwise<op::expand>(T(1), loss.value())));
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_AUTOGRAD_VARIABLE_HPP
// ---- pdo/expr/cross_entropy_grad.hpp
#ifndef PDO_SINGLE_PDO_EXPR_CROSS_ENTROPY_GRAD_HPP
#define PDO_SINGLE_PDO_EXPR_CROSS_ENTROPY_GRAD_HPP
// pdo/expr/cross_entropy_grad.hpp: the gradient of cross_entropy with respect to its logits.


#include <cstddef>
#include <string>
#include <tuple>

namespace pdo {


/// @brief (softmax(logits) - one_hot(labels)) * scale / N, with N the global row count:
/// the gradient of `scale * cross_entropy(logits, labels)` with respect to the logits. Its
/// operands take the layouts cross_entropy takes (classes whole, labels beside their rows),
/// and so does its result.
template <class Logits, class Labels>
class cross_entropy_grad_node : public detail::op_node<Logits, Labels> {
 public:
  /// @brief The logits' element type, which the gradient has.
  using value_type = typename Logits::value_type;
  static_assert(Logits::rank == 2 && Labels::rank == 1, "pdo: cross_entropy: takes logits [N, C] and labels [N]");
  /// @brief 2: the gradient is [N, C], like the logits.
  static constexpr std::size_t rank = 2;
  /// @brief false: never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "cross_entropy_grad": how plans and error messages name this op.
  static constexpr std::string_view name = "cross_entropy_grad";
  /// @brief The planner's rule: cross_entropy's operand layouts, with the output laid out as the logits operand.
  static constexpr detail::op_rule rule = [] {
    detail::op_rule r = detail::cross_entropy_rule(Logits::rule.out, Labels::rule.out);
    r.out = r.operands[0];
    return r;
  }();

  /// @brief The gradient of `scale * cross_entropy(logits, labels)`; pdo::shape_error unless there is one label
  /// per row of logits.
  cross_entropy_grad_node(Logits logits, Labels labels, value_type scale)
      : detail::op_node<Logits, Labels>(std::move(logits), std::move(labels)), scale_(scale) {
    shape_ = std::get<0>(this->children_).shape();
    if (std::get<1>(this->children_).shape()[0] != shape_[0])
      throw shape_error("cross_entropy backward: logits " + detail::describe_node(std::get<0>(this->children_)) + " and labels " +
                        detail::describe_node(std::get<1>(this->children_)) + ": need one label per row of logits");
  }
  /// @brief The logits' shape, [N, C].
  [[nodiscard]] const shape_t<2>& shape() const { return shape_; }

  /// @brief Writes this place's rows of the gradient into `out`, scaled by `scale` / global N. Labels are not
  /// range-checked: a row whose label is outside [0, C) gets softmax * scale / N, with no one-hot term.
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, 2>& out) const {
    const auto logits = ctx.template operand<0>();
    const auto labels = ctx.template operand<1>();
    using label_t = typename Labels::value_type;
    const label_t* first = labels.data + (logits.offset[0] - labels.offset[0]);
    const value_type scale = logits.global[0] == 0 ? value_type{} : scale_ / static_cast<value_type>(logits.global[0]);
    detail::cross_entropy_grad(ctx.system, logits.data, first, logits.shape[0], logits.shape[1], scale, out.data());
  }

 private:
  shape_t<2> shape_{};
  value_type scale_;
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXPR_CROSS_ENTROPY_GRAD_HPP

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

namespace pdo {

namespace detail {

template <class V>
using var_element_t = typename value_kind<V>::element_type;

template <std::size_t D, class Target, class G>
Target sum_kept_dims(const G& g, const shape_t<value_kind<Target>::rank>& target) {
  constexpr std::size_t r = value_kind<Target>::rank;
  if constexpr (D == r) {
    return to_value<Target>(G(g));
  } else {
    if (target[D] != 1 || g.shape()[D] == 1) return sum_kept_dims<D + 1, Target>(g, target);
    shape_t<r> kept = g.shape();
    kept[D] = 1;
    // a dtensor's layout may change here (summing a split dim leaves a pending sum): the
    // result is brought to the value's layout at the end (to_value)
    return sum_kept_dims<D + 1, Target>(pdo::eval(pdo::reshape(pdo::sum<D>(g), kept)), target);
  }
}

/// @brief `g` summed over the dims that `target` broadcast along, so it has `target`'s
/// shape: leading dims `target` lacks, and dims where `target` has extent 1.
template <class Target, class G>
Target sum_to(const G& g, const shape_t<value_kind<Target>::rank>& target) {
  constexpr std::size_t r = value_kind<Target>::rank, rg = value_kind<G>::rank;
  if constexpr (rg > r) {
    return sum_to<Target>(pdo::eval(pdo::sum<0>(g)), target);
  } else {
    return sum_kept_dims<0, Target>(g, target);
  }
}

/// @brief `g` with the extent-1 dim at `Dim` that a reduction over `Dim` removed, put back
/// (whatever dims of `g` are split).
template <std::size_t Dim, class G, std::size_t R>
auto keep_dim(const G& g, const shape_t<R>&) {
  return pdo::unsqueeze<Dim>(g);
}

}  // namespace detail

// ---- elementwise, two operands (with NumPy broadcasting) ----

template <class A, class B>
auto operator+(const var<A>& a, const var<B>& b) {
  auto y = pdo::eval(a.value() + b.value());
  using V = decltype(y);
  return detail::record(
      std::move(y),
      [a, b](detail::value_node<V>& self) {
        if (a.requires_grad()) detail::add_grad(a, detail::sum_to<detail::grad_t<A>>(*self.grad, a.shape()));
        if (b.requires_grad()) detail::add_grad(b, detail::sum_to<detail::grad_t<B>>(*self.grad, b.shape()));
      },
      a, b);
}

template <class A, class B>
auto operator-(const var<A>& a, const var<B>& b) {
  auto y = pdo::eval(a.value() - b.value());
  using V = decltype(y);
  return detail::record(
      std::move(y),
      [a, b](detail::value_node<V>& self) {
        if (a.requires_grad()) detail::add_grad(a, detail::sum_to<detail::grad_t<A>>(*self.grad, a.shape()));
        if (b.requires_grad()) detail::add_grad(b, detail::sum_to<detail::grad_t<B>>(pdo::eval(-*self.grad), b.shape()));
      },
      a, b);
}

template <class A, class B>
auto operator*(const var<A>& a, const var<B>& b) {
  auto y = pdo::eval(a.value() * b.value());
  using V = decltype(y);
  return detail::record(
      std::move(y),
      [a, b](detail::value_node<V>& self) {
        if (a.requires_grad()) detail::add_grad(a, detail::sum_to<detail::grad_t<A>>(pdo::eval(*self.grad * b.value()), a.shape()));
        if (b.requires_grad()) detail::add_grad(b, detail::sum_to<detail::grad_t<B>>(pdo::eval(*self.grad * a.value()), b.shape()));
      },
      a, b);
}

template <class A, class B>
auto operator/(const var<A>& a, const var<B>& b) {
  auto y = pdo::eval(a.value() / b.value());
  using V = decltype(y);
  return detail::record(
      std::move(y),
      [a, b](detail::value_node<V>& self) {
        if (a.requires_grad()) detail::add_grad(a, detail::sum_to<detail::grad_t<A>>(pdo::eval(*self.grad / b.value()), a.shape()));
        if (b.requires_grad())
          detail::add_grad(b, detail::sum_to<detail::grad_t<B>>(pdo::eval(-(*self.grad * self.value) / b.value()), b.shape()));
      },
      a, b);
}

namespace detail {
/// @brief maximum (Max) or minimum of two vars. The gradient goes to the operand chosen;
/// where the two tie (or are both NaN) each gets half (PyTorch's rule).
template <bool Max, class A, class B>
auto extremum(const var<A>& a, const var<B>& b) {
  auto y = [&] {
    if constexpr (Max) return pdo::eval(pdo::maximum(a.value(), b.value()));
    else return pdo::eval(pdo::minimum(a.value(), b.value()));
  }();
  using V = decltype(y);
  using T = var_element_t<V>;
  using share_op = std::conditional_t<Max, op::maximum_share, op::minimum_share>;
  return record(
      std::move(y),
      [a, b](auto& self) {
        const auto& g = *self.grad;
        const auto to_a = pdo::eval(make_elementwise<share_op>(a.value(), b.value()));
        if (a.requires_grad()) add_grad(a, sum_to<grad_t<A>>(pdo::eval(g * to_a), a.shape()));
        if (b.requires_grad()) add_grad(b, sum_to<grad_t<B>>(pdo::eval(g * (T(1) - to_a)), b.shape()));
      },
      a, b);
}
}  // namespace detail

/// @brief Elementwise maximum (NaN where either is NaN); where both are equal each gets
/// half the gradient.
template <class A, class B>
auto maximum(const var<A>& a, const var<B>& b) {
  return detail::extremum<true>(a, b);
}
/// @brief Elementwise minimum (NaN where either is NaN); where both are equal each gets
/// half the gradient.
template <class A, class B>
auto minimum(const var<A>& a, const var<B>& b) {
  return detail::extremum<false>(a, b);
}

/// @brief a where `cond` (a value, not differentiated) is nonzero, else b.
template <class C, class A, class B>
  requires(!is_var_v<std::remove_cvref_t<C>>)
auto where(const C& condition, const var<A>& a, const var<B>& b) {
  auto cond = pdo::eval(condition);
  auto y = pdo::eval(pdo::where(cond, a.value(), b.value()));
  using V = decltype(y);
  using T = detail::var_element_t<V>;
  return detail::record(
      std::move(y),
      [cond, a, b](detail::value_node<V>& self) {
        const auto& g = *self.grad;
        if (a.requires_grad()) detail::add_grad(a, detail::sum_to<detail::grad_t<A>>(pdo::eval(pdo::where(cond, g, T(0))), a.shape()));
        if (b.requires_grad()) detail::add_grad(b, detail::sum_to<detail::grad_t<B>>(pdo::eval(pdo::where(cond, T(0), g)), b.shape()));
      },
      a, b);
}

// ---- with a number on one side ----

template <class A>
auto operator+(const var<A>& a, detail::var_element_t<A> s) {
  return detail::record(
      pdo::eval(a.value() + s), [a](auto& self) { detail::add_grad(a, *self.grad); }, a);
}
template <class A>
auto operator+(detail::var_element_t<A> s, const var<A>& a) {
  return a + s;
}
template <class A>
auto operator-(const var<A>& a, detail::var_element_t<A> s) {
  return a + (-s);
}
template <class A>
auto operator-(detail::var_element_t<A> s, const var<A>& a) {
  return detail::record(
      pdo::eval(s - a.value()), [a](auto& self) { detail::add_grad(a, -*self.grad); }, a);
}
template <class A>
auto operator*(const var<A>& a, detail::var_element_t<A> s) {
  return detail::record(
      pdo::eval(a.value() * s), [a, s](auto& self) { detail::add_grad(a, *self.grad * s); }, a);
}
template <class A>
auto operator*(detail::var_element_t<A> s, const var<A>& a) {
  return a * s;
}
template <class A>
auto operator/(const var<A>& a, detail::var_element_t<A> s) {
  return detail::record(
      pdo::eval(a.value() / s), [a, s](auto& self) { detail::add_grad(a, *self.grad / s); }, a);
}
template <class A>
auto operator/(detail::var_element_t<A> s, const var<A>& a) {
  return detail::record(
      pdo::eval(s / a.value()),
      [a](auto& self) { detail::add_grad(a, -(*self.grad * self.value) / a.value()); }, a);
}

// ---- elementwise, one operand ----

template <class A>
auto operator-(const var<A>& a) {
  return detail::record(
      pdo::eval(-a.value()), [a](auto& self) { detail::add_grad(a, -*self.grad); }, a);
}
template <class A>
auto exp(const var<A>& a) {
  return detail::record(
      pdo::eval(pdo::exp(a.value())), [a](auto& self) { detail::add_grad(a, *self.grad * self.value); }, a);
}
template <class A>
auto log(const var<A>& a) {
  return detail::record(
      pdo::eval(pdo::log(a.value())), [a](auto& self) { detail::add_grad(a, *self.grad / a.value()); }, a);
}
template <class A>
auto sqrt(const var<A>& a) {
  using T = detail::var_element_t<A>;
  return detail::record(
      pdo::eval(pdo::sqrt(a.value())),
      [a](auto& self) { detail::add_grad(a, *self.grad / (self.value * T(2))); }, a);
}
template <class A>
auto tanh(const var<A>& a) {
  using T = detail::var_element_t<A>;
  return detail::record(
      pdo::eval(pdo::tanh(a.value())),
      [a](auto& self) { detail::add_grad(a, *self.grad * (T(1) - self.value * self.value)); }, a);
}
template <class A>
auto sigmoid(const var<A>& a) {
  using T = detail::var_element_t<A>;
  return detail::record(
      pdo::eval(pdo::sigmoid(a.value())),
      [a](auto& self) { detail::add_grad(a, *self.grad * self.value * (T(1) - self.value)); }, a);
}
template <class A>
auto relu(const var<A>& a) {
  using T = detail::var_element_t<A>;
  return detail::record(
      pdo::eval(pdo::relu(a.value())),
      [a](auto& self) { detail::add_grad(a, pdo::where(pdo::greater(a.value(), T(0)), *self.grad, T(0))); }, a);
}
/// @brief GELU, exact (erf form), PyTorch's default.
template <class A>
auto gelu(const var<A>& a) {
  return detail::record(
      pdo::eval(pdo::gelu(a.value())),
      [a](auto& self) {
        detail::add_grad(a, *self.grad * detail::make_elementwise<op::gelu_derivative>(a.value()));
      },
      a);
}
/// @brief GELU, tanh approximation (PyTorch's approximate="tanh").
template <class A>
auto gelu_tanh(const var<A>& a) {
  return detail::record(
      pdo::eval(pdo::gelu_tanh(a.value())),
      [a](auto& self) {
        detail::add_grad(a, *self.grad * detail::make_elementwise<op::gelu_tanh_derivative>(a.value()));
      },
      a);
}

// ---- matmul ----

/// @brief matmul(a [..., M, K], b [K, N] or [..., K, N]); gradients matmul(g, bᵀ) and
/// matmul(aᵀ, g) (summed over the batch when b is one matrix for the whole batch).
template <class A, class B>
auto matmul(const var<A>& a, const var<B>& b) {
  auto y = pdo::eval(pdo::matmul(a.value(), b.value()));
  using V = decltype(y);
  constexpr std::size_t ra = detail::value_kind<A>::rank, rb = detail::value_kind<B>::rank;
  return detail::record(
      std::move(y),
      [a, b](detail::value_node<V>& self) {
        const auto& g = *self.grad;
        if (a.requires_grad()) detail::add_grad(a, pdo::matmul(g, pdo::transpose(b.value())));
        if (b.requires_grad()) {
          if constexpr (rb == ra) {
            detail::add_grad(b, pdo::matmul(pdo::transpose(a.value()), g));
          } else {
            // one matrix for the whole batch: the batch dims fold into the rows
            const auto& sa = a.shape();
            std::size_t rows = 1;
            for (std::size_t d = 0; d + 1 < ra; ++d) rows *= sa[d];
            const auto a2 = pdo::eval(pdo::reshape(a.value(), shape_t<2>{rows, sa[ra - 1]}));
            const auto g2 = pdo::eval(pdo::reshape(g, shape_t<2>{rows, g.shape()[ra - 1]}));
            detail::add_grad(b, pdo::matmul(pdo::transpose(a2), g2));
          }
        }
      },
      a, b);
}

// ---- reductions ----

namespace detail {
template <reduction What, std::size_t Dim, class A>
auto reduce_var(const var<A>& a) {
  using T = var_element_t<A>;
  auto y = pdo::eval(detail::make_reduction<What, Dim>(a.value()));
  using V = decltype(y);
  return record(
      std::move(y),
      [a](value_node<V>& self) {
        const auto& g = *self.grad;
        const auto& x = a.value();
        if constexpr (What == reduction::max) {
          // shared evenly among the elements that reach the maximum (NaN matching NaN), as
          // PyTorch's amax: the components add up to the output's gradient
          if constexpr (Dim == all_dims) {
            const auto reached = pdo::eval(make_elementwise<op::matches>(x, self.value));
            const auto share = pdo::eval(g / pdo::sum(reached));
            add_grad(a, reached * share);
          } else {
            const auto reached = pdo::eval(make_elementwise<op::matches>(x, keep_dim<Dim>(self.value, x.shape())));
            const auto share = pdo::eval(g / pdo::sum<Dim>(reached));
            add_grad(a, reached * keep_dim<Dim>(share, x.shape()));
          }
        } else {
          const T scale = [&] {
            if constexpr (What == reduction::sum) return T(1);
            else if constexpr (Dim == all_dims) return T(1) / static_cast<T>(volume(x.shape()));
            else return T(1) / static_cast<T>(x.shape()[Dim]);
          }();
          if constexpr (Dim == all_dims) add_grad(a, make_elementwise<op::expand>(g, x) * scale);
          else add_grad(a, make_elementwise<op::expand>(keep_dim<Dim>(g, x.shape()), x) * scale);
        }
      },
      a);
}
}  // namespace detail

/// @brief Sum over dim `Dim`, or over every dim.
template <std::size_t Dim = all_dims, class A>
auto sum(const var<A>& a) {
  return detail::reduce_var<detail::reduction::sum, Dim>(a);
}
/// @brief Mean over dim `Dim`, or over every dim.
template <std::size_t Dim = all_dims, class A>
auto mean(const var<A>& a) {
  return detail::reduce_var<detail::reduction::mean, Dim>(a);
}
/// @brief Maximum over dim `Dim`, or over every dim (NaN when any element is NaN); the
/// gradient is shared evenly among the elements equal to the maximum (the NaNs, for a NaN
/// maximum), as PyTorch's amax.
template <std::size_t Dim = all_dims, class A>
auto max(const var<A>& a) {
  return detail::reduce_var<detail::reduction::max, Dim>(a);
}

// ---- softmax and losses ----

/// @brief softmax along `Dim` (the last by default); gradient y * (g - sum(g * y)).
template <std::size_t Dim = last_dim, class A>
auto softmax(const var<A>& a) {
  constexpr std::size_t d = Dim == last_dim ? var<A>::rank - 1 : Dim;
  return detail::record(
      pdo::eval(pdo::softmax<d>(a.value())),
      [a](auto& self) {
        const auto& g = *self.grad;
        const auto& y = self.value;
        const auto s = pdo::eval(pdo::sum<d>(g * y));
        detail::add_grad(a, y * (g - detail::keep_dim<d>(s, y.shape())));
      },
      a);
}

/// @brief log_softmax along `Dim` (the last by default); gradient g - exp(y) * sum(g).
template <std::size_t Dim = last_dim, class A>
auto log_softmax(const var<A>& a) {
  constexpr std::size_t d = Dim == last_dim ? var<A>::rank - 1 : Dim;
  return detail::record(
      pdo::eval(pdo::log_softmax<d>(a.value())),
      [a](auto& self) {
        const auto& g = *self.grad;
        const auto& y = self.value;
        const auto s = pdo::eval(pdo::sum<d>(g));
        detail::add_grad(a, g - pdo::exp(y) * detail::keep_dim<d>(s, y.shape()));
      },
      a);
}

/// @brief Mean cross-entropy of logits [N, C] against class indices [N] (a value, not
/// differentiated); gradient (softmax(logits) - one_hot(labels)) * g / N.
template <class L, class Y>
  requires(!is_var_v<std::remove_cvref_t<Y>>)
auto cross_entropy(const var<L>& logits, const Y& labels) {
  auto y = pdo::eval(pdo::cross_entropy(logits.value(), labels));
  using V = decltype(y);
  using T = detail::var_element_t<L>;
  return detail::record(
      std::move(y),
      [logits, labels](detail::value_node<V>& self) {
        const T scale = static_cast<T>(detail::scalar_of(*self.grad));
        detail::add_grad(logits, cross_entropy_grad_node<detail::expression_t<const L&>, detail::expression_t<const Y&>>(
                                     detail::as_expression(logits.value()), detail::as_expression(labels), scale));
      },
      logits);
}

/// @brief Mean squared error: mean((a - b)²) over every element (a and b broadcast as in
/// a - b; shapes that do not are a pdo::shape_error that names mse).
template <class A, class B>
auto mse(const var<A>& a, const var<B>& b) {
  const auto d = [&] {
    try {
      return a - b;
    } catch (const shape_error& e) {
      throw shape_error(std::string("mse: ") + e.what());
    }
  }();
  return pdo::mean(d * d);
}

// ---- layout of the data ----

/// @brief The last two dims swapped.
template <class A>
auto transpose(const var<A>& a) {
  auto y = pdo::eval(pdo::transpose(a.value()));
  using V = decltype(y);
  return detail::record(
      std::move(y), [a](detail::value_node<V>& self) { detail::add_grad(a, pdo::transpose(*self.grad)); }, a);
}

/// @brief The same elements under `shape`.
template <class A, std::size_t Rank>
auto reshape(const var<A>& a, const shape_t<Rank>& shape) {
  auto y = pdo::eval(pdo::reshape(a.value(), shape));
  using V = decltype(y);
  return detail::record(
      std::move(y), [a](detail::value_node<V>& self) { detail::add_grad(a, pdo::reshape(*self.grad, a.shape())); }, a);
}
template <class A, std::size_t Rank>
auto reshape(const var<A>& a, const std::size_t (&shape)[Rank]) {
  shape_t<Rank> s{};
  for (std::size_t d = 0; d < Rank; ++d) s[d] = shape[d];
  return pdo::reshape(a, s);
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_AUTOGRAD_OPS_HPP
// ---- pdo/autograd/conv.hpp
#ifndef PDO_SINGLE_PDO_AUTOGRAD_CONV_HPP
#define PDO_SINGLE_PDO_AUTOGRAD_CONV_HPP
// pdo/autograd/conv.hpp: conv2d (im2col + gemm) and 2-D pooling on pdo::var, with their backward.

// ---- pdo/kernels/conv.hpp
#ifndef PDO_SINGLE_PDO_KERNELS_CONV_HPP
#define PDO_SINGLE_PDO_KERNELS_CONV_HPP
// pdo/kernels/conv.hpp: conv2d by im2col + gemm, and 2-D pooling, forward and backward.
// Every kernel is a functor of one output index (PDO_HD), run by thrust::transform or
// for_each_n on the place's system: gathers, never scatters, so no two indices write
// the same element.


#include <cstddef>
#include <cstdint>

namespace pdo::detail {

/// @brief The geometry of a 2-D window op over x [batch, channels, height, width]:
/// square kernel, stride, the output extents, and the zero padding in front of the first
/// row (pad_h) and column (pad_w): window (oh, ow) reads padded rows [oh * stride, oh *
/// stride + kernel), row r being x's row r - pad_h; rows outside x are padding (behind it
/// too). A whole image is padded alike on both sides; a block of a split image (its own rows
/// and its halo) has the padding of the image's edges it touches, on that side only.
struct window_geometry {
  std::size_t batch = 0, channels = 0, height = 0, width = 0;
  std::size_t kernel = 1, stride = 1, pad_h = 0, pad_w = 0;
  std::size_t out_height = 0, out_width = 0;

  PDO_HD std::size_t out_pixels() const { return out_height * out_width; }
  /// @brief Output rows of the im2col matrix: one per (image, output pixel).
  PDO_HD std::size_t rows() const { return batch * out_pixels(); }
  /// @brief Its columns: one per (channel, kernel row, kernel column).
  PDO_HD std::size_t cols() const { return channels * kernel * kernel; }
};

/// @brief The geometry of a whole image padded alike on all sides, with output extents;
/// false when the window does not fit.
inline bool make_window_geometry(window_geometry& g) {
  constexpr std::size_t most = static_cast<std::size_t>(-1) / 4;  // padded extents are computed without overflow below this
  if (g.pad_h > most || g.pad_w > most || g.height > most || g.width > most) return false;
  if (g.kernel == 0 || g.stride == 0 || g.height + 2 * g.pad_h < g.kernel || g.width + 2 * g.pad_w < g.kernel) return false;
  g.out_height = (g.height + 2 * g.pad_h - g.kernel) / g.stride + 1;
  g.out_width = (g.width + 2 * g.pad_w - g.kernel) / g.stride + 1;
  return true;
}

/// @brief Element i of the im2col matrix [rows, cols] of x.
template <class T>
struct im2col_element {
  const T* x;
  window_geometry g;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t row = i / g.cols(), col = i % g.cols();
    const std::size_t n = row / g.out_pixels(), pixel = row % g.out_pixels();
    const std::size_t oh = pixel / g.out_width, ow = pixel % g.out_width;
    const std::size_t c = col / (g.kernel * g.kernel), k = col % (g.kernel * g.kernel);
    const std::size_t h = oh * g.stride + k / g.kernel, w = ow * g.stride + k % g.kernel;  // in padded coordinates
    if (h < g.pad_h || w < g.pad_w || h - g.pad_h >= g.height || w - g.pad_w >= g.width) return T(0);
    return x[((n * g.channels + c) * g.height + (h - g.pad_h)) * g.width + (w - g.pad_w)];
  }
};

/// @brief A rectangle of output pixels: rows [row_begin, row_end), columns [col_begin, col_end).
struct pixel_region {
  std::size_t row_begin = 0, row_end = 0, col_begin = 0, col_end = 0;
  [[nodiscard]] PDO_HD std::size_t pixels() const { return (row_end - row_begin) * (col_end - col_begin); }
};

/// @brief Element i of the im2col rows of the output pixels of `region` (of geometry g, whose
/// input is a block of `g.height` x `g.width` pixels), for each image: cols's entries for
/// those pixels, read from `src`, which holds rows [row0, row0 + src_height) and columns
/// [col0, col0 + src_width) of the block (the block itself, or a part of it held apart,
/// such as a place's own rows before its halo has come). The region's windows must read no
/// block pixel outside `src`; padding reads as zero.
template <class T>
struct im2col_region_element {
  const T* src;
  T* cols;
  window_geometry g;
  pixel_region region;
  std::ptrdiff_t row0 = 0, col0 = 0;
  std::size_t src_height = 0, src_width = 0;
  PDO_HD void operator()(std::size_t i) const {
    const std::size_t per_image = region.pixels() * g.cols(), n = i / per_image, rest = i % per_image;
    const std::size_t pixel = rest / g.cols(), col = rest % g.cols(), region_width = region.col_end - region.col_begin;
    const std::size_t oh = region.row_begin + pixel / region_width, ow = region.col_begin + pixel % region_width;
    const std::size_t c = col / (g.kernel * g.kernel), k = col % (g.kernel * g.kernel);
    const std::size_t h = oh * g.stride + k / g.kernel, w = ow * g.stride + k % g.kernel;  // in padded coordinates
    T value(0);
    if (h >= g.pad_h && w >= g.pad_w && h - g.pad_h < g.height && w - g.pad_w < g.width) {
      const std::size_t sh = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(h - g.pad_h) - row0);
      const std::size_t sw = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(w - g.pad_w) - col0);
      value = src[((n * g.channels + c) * src_height + sh) * src_width + sw];
    }
    cols[(n * g.out_pixels() + oh * g.out_width + ow) * g.cols() + col] = value;
  }
};

/// @brief Element i of dx [batch, channels, height, width]: the sum of the im2col
/// gradient entries that read it.
template <class T>
struct col2im_element {
  const T* dcols;
  window_geometry g;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t w = i % g.width, h = (i / g.width) % g.height;
    const std::size_t c = (i / (g.width * g.height)) % g.channels, n = i / (g.width * g.height * g.channels);
    T acc{};
    for (std::size_t kh = 0; kh < g.kernel; ++kh) {
      const std::size_t ph = h + g.pad_h;  // padded row
      if (ph < kh || (ph - kh) % g.stride != 0) continue;
      const std::size_t oh = (ph - kh) / g.stride;
      if (oh >= g.out_height) continue;
      for (std::size_t kw = 0; kw < g.kernel; ++kw) {
        const std::size_t pw = w + g.pad_w;
        if (pw < kw || (pw - kw) % g.stride != 0) continue;
        const std::size_t ow = (pw - kw) / g.stride;
        if (ow >= g.out_width) continue;
        const std::size_t row = n * g.out_pixels() + oh * g.out_width + ow;
        acc += dcols[row * g.cols() + (c * g.kernel + kh) * g.kernel + kw];
      }
    }
    return acc;
  }
};

/// @brief y [batch, out_channels, oh, ow] from the gemm result [rows, out_channels], plus the bias (if any).
template <class T>
struct rows_to_images {
  const T* rows;
  const T* bias;
  std::size_t out_channels, pixels;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t p = i % pixels, oc = (i / pixels) % out_channels, n = i / (pixels * out_channels);
    return rows[(n * pixels + p) * out_channels + oc] + (bias != nullptr ? bias[oc] : T(0));
  }
};

/// @brief The inverse reordering: g [batch, out_channels, oh, ow] as [rows, out_channels].
template <class T>
struct images_to_rows {
  const T* images;
  std::size_t out_channels, pixels;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t oc = i % out_channels, row = i / out_channels;
    const std::size_t n = row / pixels, p = row % pixels;
    return images[(n * out_channels + oc) * pixels + p];
  }
};

/// @brief Column oc of a [rows, columns] matrix, summed (the bias gradient).
template <class T>
struct column_sum {
  const T* m;
  std::size_t rows, columns;
  PDO_HD T operator()(std::size_t oc) const {
    T acc{};
    for (std::size_t r = 0; r < rows; ++r) acc += m[r * columns + oc];
    return acc;
  }
};

/// @brief Output element i of a max (Max) or average pool over windows of x (no padding
/// for max pooling: padded cells never win; average pooling counts them as zeros).
template <class T, bool Max>
struct pool_element {
  const T* x;
  window_geometry g;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t ow = i % g.out_width, oh = (i / g.out_width) % g.out_height, nc = i / g.out_pixels();
    const T* plane = x + nc * g.height * g.width;
    T acc{};
    bool first = true;
    for (std::size_t kh = 0; kh < g.kernel; ++kh)
      for (std::size_t kw = 0; kw < g.kernel; ++kw) {
        const std::size_t h = oh * g.stride + kh, w = ow * g.stride + kw;
        if (h < g.pad_h || w < g.pad_w || h - g.pad_h >= g.height || w - g.pad_w >= g.width) continue;
        const T v = plane[(h - g.pad_h) * g.width + (w - g.pad_w)];
        if constexpr (Max) {
          acc = first ? v : nan_max(acc, v);
          first = false;
        } else {
          acc += v;
        }
      }
    if constexpr (Max) return acc;
    else return acc / static_cast<T>(g.kernel * g.kernel);
  }
};

/// @brief Element i of dx for a pool: the output gradients of the windows that read it;
/// for max pooling only those whose maximum it is (the first maximum of a window, in
/// reading order, as PyTorch picks).
template <class T, bool Max>
struct pool_backward_element {
  const T* x;
  const T* dy;
  window_geometry g;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t w = i % g.width, h = (i / g.width) % g.height, nc = i / (g.width * g.height);
    const T* plane = x + nc * g.height * g.width;
    T acc{};
    const std::size_t ph = h + g.pad_h, pw = w + g.pad_w;
    for (std::size_t kh = 0; kh < g.kernel; ++kh) {
      if (ph < kh || (ph - kh) % g.stride != 0 || (ph - kh) / g.stride >= g.out_height) continue;
      const std::size_t oh = (ph - kh) / g.stride;
      for (std::size_t kw = 0; kw < g.kernel; ++kw) {
        if (pw < kw || (pw - kw) % g.stride != 0 || (pw - kw) / g.stride >= g.out_width) continue;
        const std::size_t ow = (pw - kw) / g.stride;
        const T grad = dy[nc * g.out_pixels() + oh * g.out_width + ow];
        if constexpr (Max) {
          if (first_max_at(plane, oh, ow) == h * g.width + w) acc += grad;
        } else {
          acc += grad / static_cast<T>(g.kernel * g.kernel);
        }
      }
    }
    return acc;
  }
  /// @brief Where, in its plane, window (oh, ow)'s first maximum lies.
  PDO_HD std::size_t first_max_at(const T* plane, std::size_t oh, std::size_t ow) const {
    std::size_t at = 0;
    bool first = true;
    T best{};
    for (std::size_t kh = 0; kh < g.kernel; ++kh)
      for (std::size_t kw = 0; kw < g.kernel; ++kw) {
        const std::size_t h = oh * g.stride + kh, w = ow * g.stride + kw;
        if (h < g.pad_h || w < g.pad_w || h - g.pad_h >= g.height || w - g.pad_w >= g.width) continue;
        const std::size_t idx = (h - g.pad_h) * g.width + (w - g.pad_w);
        const T v = plane[idx];
        if (first || v > best || (v != v && best == best)) {  // the first NaN wins, as PyTorch's
          best = v;
          at = idx;
          first = false;
        }
      }
    return at;
  }
};

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_KERNELS_CONV_HPP
// ---- pdo/tensor/halo.hpp
#ifndef PDO_SINGLE_PDO_TENSOR_HALO_HPP
#define PDO_SINGLE_PDO_TENSOR_HALO_HPP
// pdo/tensor/halo.hpp: what one place does in a halo exchange. A window op (conv2d, pooling)
// over an image split along its height or width computes, on each place, the output rows
// the output's layout gives it (the chunk rule on the output extent); their windows read,
// beyond the place's own input rows, a few rows of its neighbours (its halo), as many
// neighbours as the halo is wide. halo_gather brings them: one all_to_all along the mesh
// axis in which each place sends each other the rows of its shard that the other's windows
// read (nothing to places whose windows do not reach it). halo_return is its transpose for
// the backward: the gradient of the rows read from a neighbour goes back to it and is added
// to its own. A split of both dims is one exchange along each axis in turn, so corners
// travel with the second (the first has already widened the block by its rows).


#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace pdo::detail {

/// @brief Rows [begin, end) of one dim.
struct row_range {
  std::size_t begin = 0, end = 0;
  [[nodiscard]] constexpr std::size_t size() const { return end - begin; }
  friend constexpr row_range intersect(row_range a, row_range b) {
    const std::size_t lo = std::max(a.begin, b.begin), hi = std::min(a.end, b.end);
    return lo < hi ? row_range{lo, hi} : row_range{lo, lo};
  }
};

/// @brief A window op's geometry along one spatial dim cut over `parts` places of a mesh
/// axis: input rows by the chunk rule on `extent`, output rows by the chunk rule on
/// `out_extent` (the layouts of input and output cut the dim alike).
struct halo_dim {
  std::size_t extent = 0, out_extent = 0, kernel = 1, stride = 1, padding = 0, parts = 1;

  /// @brief The input rows place `c` of the axis holds.
  [[nodiscard]] constexpr row_range own(std::size_t c) const {
    const std::size_t b = chunk_offset(extent, parts, c);
    return {b, b + chunk_size(extent, parts, c)};
  }
  /// @brief The output rows it computes.
  [[nodiscard]] constexpr row_range out(std::size_t c) const {
    const std::size_t b = chunk_offset(out_extent, parts, c);
    return {b, b + chunk_size(out_extent, parts, c)};
  }
  /// @brief Its windows' first row, in padded coordinates (row r of the image is r + padding).
  [[nodiscard]] constexpr std::size_t window_begin(std::size_t c) const { return out(c).begin * stride; }
  /// @brief The input rows its windows read (padding aside): its own rows and its halo.
  [[nodiscard]] constexpr row_range need(std::size_t c) const {
    const row_range o = out(c);
    if (o.size() == 0) return {};
    const std::size_t lo = std::max(o.begin * stride, padding), hi = std::min((o.end - 1) * stride + kernel, extent + padding);
    return lo < hi ? row_range{lo - padding, hi - padding} : row_range{};
  }
  /// @brief Padding rows in front of the first row it reads, within its windows.
  [[nodiscard]] constexpr std::size_t pad_before(std::size_t c) const {
    const row_range n = need(c);
    return n.size() == 0 ? 0 : n.begin + padding - window_begin(c);
  }
  /// @brief Its output rows, counted from its first, whose windows read none of its halo
  /// (only its own rows, or padding): computable before the halo has come. Empty when
  /// there are none, or when they are not one run.
  [[nodiscard]] constexpr row_range interior(std::size_t c) const {
    const std::size_t outs = out(c).size(), pad = pad_before(c);
    const row_range n = need(c), o = intersect(n, own(c));
    // in the padded coordinates of its block: window r reads rows [r * stride, r * stride + kernel)
    const std::size_t own_lo = o.begin - n.begin + pad, own_hi = o.end - n.begin + pad, real_hi = pad + n.size();
    std::size_t first = outs, last = 0;
    for (std::size_t r = 0; r < outs; ++r) {
      const std::size_t lo = std::max(r * stride, pad), hi = std::min(r * stride + kernel, real_hi);
      if (lo < hi && (lo < own_lo || hi > own_hi)) continue;  // reads a halo row
      if (first != outs && last != r) return {};               // a second run
      if (first == outs) first = r;
      last = r + 1;
    }
    return first < last ? row_range{first, last} : row_range{};
  }
  /// @brief The rows it receives from other places (its halo).
  [[nodiscard]] constexpr std::size_t halo_rows(std::size_t c) const { return need(c).size() - intersect(need(c), own(c)).size(); }
};

/// @brief Element i of the dense rows `src` added to rows [off, off + count) of `dst` laid out as v.
template <class T>
struct add_rows_element {
  const T* src;
  T* dst;
  dim_view v;
  std::size_t off, count;
  PDO_HD void operator()(std::size_t i) const {
    const std::size_t run = count * v.inner, o = i / run, r = i % run;
    dst[(o * v.extent + off) * v.inner + r] += src[i];
  }
};

/// @brief The rows each member sends each other in a halo exchange along `d` on member
/// `me`: sends[j] = my rows j's windows read; recvs[j] = j's rows mine read.
struct halo_pieces {
  std::vector<row_range> sends, recvs;
  halo_pieces(const halo_dim& d, std::size_t me) : sends(d.parts), recvs(d.parts) {
    for (std::size_t j = 0; j < d.parts; ++j) {
      sends[j] = intersect(d.need(j), d.own(me));
      recvs[j] = intersect(d.need(me), d.own(j));
    }
  }
};

/// @brief Bytes place `me` of the axis sends in a halo exchange along `d` of a block whose
/// rows along the dim hold `row_bytes` bytes each (the dims before and after it included):
/// the rows of its shard the other places' windows read. halo_return sends as many back.
inline std::size_t halo_bytes_sent(const halo_dim& d, std::size_t me, std::size_t row_bytes) {
  const halo_pieces pieces(d, me);
  std::size_t rows = 0;
  for (std::size_t j = 0; j < d.parts; ++j) rows += j == me ? 0 : pieces.sends[j].size();
  return rows * row_bytes;
}

/// @brief The exchange halo_gather and halo_return share: rows `sends[j]` of `src` (laid
/// out as `sv` along its dim, its first row being row `src_first` of the image) packed for
/// member j, one all_to_all along the axis, and the rows `recvs[j]` received from j handed
/// to `take(j, data, rows)` (rows relative to `dst_first`, laid out as `dv`).
template <class T, class Take>
void halo_exchange(const mesh_communicator& comm, const T* src, const dim_view& sv, std::size_t src_first, const std::vector<row_range>& sends,
                   const dim_view& dv, std::size_t dst_first, const std::vector<row_range>& recvs, const any_place& place, Take take) {
  const std::size_t parts = sends.size();
  std::vector<std::size_t> send_counts(parts), recv_counts(parts);
  std::size_t sent = 0, received = 0;
  for (std::size_t j = 0; j < parts; ++j) {
    sent += send_counts[j] = sv.outer * sends[j].size() * sv.inner;
    received += recv_counts[j] = dv.outer * recvs[j].size() * dv.inner;
  }
  tensor<T, 1> packed(shape_t<1>{sent}, place, uninitialized), in(shape_t<1>{received}, place, uninitialized);
  for (std::size_t j = 0, at = 0; j < parts; at += send_counts[j++])
    copy_rows(src, sv, sends[j].begin - src_first, sends[j].size(), packed.data() + at, packed.where());
  comm.all_to_all(std::as_const(packed).span(), std::span<const std::size_t>(send_counts), in.span(),
                  std::span<const std::size_t>(recv_counts));
  for (std::size_t j = 0, at = 0; j < parts; at += recv_counts[j++])
    if (recv_counts[j] != 0) take(in.data() + at, recvs[j].begin - dst_first, recvs[j].size());
}

/// @brief Place `me` of the axis `comm` spans (laid out as `d` along tensor dim `dim`): its
/// shard `x` (its own rows along `dim`) widened to the rows its windows read (need(me)),
/// the others' rows received from them. Every member of the axis calls it at once.
template <class T, std::size_t Rank>
tensor<T, Rank> halo_gather(const mesh_communicator& comm, const halo_dim& d, std::size_t me, std::size_t dim,
                            const tensor<T, Rank>& x, const any_place& place) {
  const halo_pieces pieces(d, me);
  shape_t<Rank> out_shape = x.shape();
  out_shape[dim] = d.need(me).size();
  const dim_view ov = view_along(out_shape, dim);
  tensor<T, Rank> out(out_shape, place, uninitialized);  // the pieces cover it: own(j) cut the image
  halo_exchange(comm, x.data(), view_along(x.shape(), dim), d.own(me).begin, pieces.sends, ov, d.need(me).begin, pieces.recvs, place,
                [&](const T* rows, std::size_t off, std::size_t count) { place_rows(rows, ov, off, count, out.data(), out.where()); });
  return out;
}

/// @brief The transpose of halo_gather: `dwide` (the gradient of need(me)'s rows) sent back
/// by rows to their owners, and the pieces received added up on place `me`'s own rows.
template <class T, std::size_t Rank>
tensor<T, Rank> halo_return(const mesh_communicator& comm, const halo_dim& d, std::size_t me, std::size_t dim,
                            const tensor<T, Rank>& dwide, const any_place& place) {
  const halo_pieces pieces(d, me);
  shape_t<Rank> out_shape = dwide.shape();
  out_shape[dim] = d.own(me).size();
  const dim_view ov = view_along(out_shape, dim);
  tensor<T, Rank> out(out_shape, place);  // zeros: rows no window read have no gradient
  auto system = kernel_system("halo exchange", {out.where()});
  halo_exchange(comm, dwide.data(), view_along(dwide.shape(), dim), d.need(me).begin, pieces.recvs, ov, d.own(me).begin, pieces.sends, place,
                [&](const T* rows, std::size_t off, std::size_t count) {
                  thrust::for_each_n(system, thrust::counting_iterator<std::size_t>(0), ov.outer * count * ov.inner,
                                     add_rows_element<T>{rows, out.data(), ov, off, count});
                });
  return out;
}

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_TENSOR_HALO_HPP

#include <array>
#include <cstddef>
#include <memory>
#include <string_view>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

/// @brief Stride and zero padding of conv2d and the pools.
struct window_options {
  std::size_t stride = 1;   ///< step between windows, in pixels, along H and W; 0 in a pool means the kernel size
  std::size_t padding = 0;  ///< zero cells added on each side of H and W
};

namespace detail {

inline window_geometry window_of(const char* op, const shape_t<4>& x, std::size_t kernel, window_options o) {
  window_geometry g{x[0], x[1], x[2], x[3], kernel, o.stride, o.padding, o.padding};
  if (!make_window_geometry(g))
    throw shape_error(std::string(op) + ": input " + format_extents(x) + " with kernel " + std::to_string(kernel) + ", stride " +
                      std::to_string(o.stride) + ", padding " + std::to_string(o.padding) +
                      ": the window must fit the padded image, and kernel and stride must be positive");
  // the im2col matrix [rows, cols] conv2d makes, and the output, must be addressable
  checked_volume(shape_t<4>{g.rows(), x[1], kernel, kernel}, op, 8);
  checked_volume(shape_t<4>{g.batch, g.channels, g.out_height, g.out_width}, op, 8);
  return g;
}

/// @brief The windows of a pool: stride 0 means the kernel size; the padding at most half the
/// kernel (as PyTorch's pools), so that every window holds a cell of the input.
inline window_geometry pool_window_of(const char* op, const shape_t<4>& x, std::size_t kernel, window_options& o) {
  if (o.stride == 0) o.stride = kernel;
  if (2 * o.padding > kernel)
    throw shape_error(std::string(op) + ": padding " + std::to_string(o.padding) + " with kernel " + std::to_string(kernel) +
                      ": the padding must be at most half the kernel size (a window would hold only padding)");
  return window_of(op, x, kernel, o);
}

}  // namespace detail

namespace detail {

/// @brief The local conv2d's output from its im2col matrix: y = cols * w^T + bias (bias may be null).
template <class T>
tensor<T, 4> conv2d_from_cols(const tensor<T, 2>& cols, const tensor<T, 4>& w, const T* bias, const window_geometry& g) {
  const std::size_t oc = w.extent(0);
  auto system = kernel_system("conv2d", {cols.where(), w.where()});
  const thrust::counting_iterator<std::size_t> zero(0);
  tensor<T, 2> rows({g.rows(), oc}, uninitialized);
  gemm<T>(system, g.rows(), oc, g.cols(), {cols.data(), g.cols(), false}, {w.data(), g.cols(), true}, rows.data());
  tensor<T, 4> y({g.batch, oc, g.out_height, g.out_width}, uninitialized);
  thrust::transform(system, zero, zero + y.size(), y.data(), rows_to_images<T>{rows.data(), bias, oc, g.out_pixels()});
  return y;
}

/// @brief The im2col rows of the output pixels of `region` (geometry g over a block) into
/// `cols`, read from `src`, which holds the block's rows from `row0` and columns from `col0`.
template <class T>
void im2col_region(tensor<T, 2>& cols, const tensor<T, 4>& src, std::ptrdiff_t row0, std::ptrdiff_t col0, const window_geometry& g,
                   const pixel_region& region) {
  if (region.pixels() == 0 || g.batch == 0) return;
  auto system = kernel_system("conv2d", {src.where(), cols.where()});
  thrust::for_each_n(system, thrust::counting_iterator<std::size_t>(0), g.batch * region.pixels() * g.cols(),
                     im2col_region_element<T>{src.data(), cols.data(), g, region, row0, col0, src.extent(2), src.extent(3)});
}

/// @brief The local conv2d: y = conv(x, w) + bias (bias may be null), and the im2col
/// matrix the backward needs. Tensors go to the calling thread's place.
template <class T>
std::pair<tensor<T, 4>, std::shared_ptr<tensor<T, 2>>> conv2d_forward(const tensor<T, 4>& x, const tensor<T, 4>& w, const T* bias,
                                                                       const window_geometry& g) {
  auto system = kernel_system("conv2d", {x.where(), w.where()});
  const thrust::counting_iterator<std::size_t> zero(0);
  auto cols = std::make_shared<tensor<T, 2>>(shape_t<2>{g.rows(), g.cols()}, uninitialized);
  thrust::transform(system, zero, zero + cols->size(), cols->data(), im2col_element<T>{x.data(), g});
  return {conv2d_from_cols(*cols, w, bias, g), std::move(cols)};
}

/// @brief The local conv2d's output gradient dy as the rows of its gemm: [rows, out_channels].
template <class T>
tensor<T, 2> conv2d_grad_rows(const tensor<T, 4>& dy, const window_geometry& g) {
  const std::size_t oc = dy.extent(1);
  auto sys = kernel_system("conv2d backward", {dy.where()});
  const thrust::counting_iterator<std::size_t> first(0);
  tensor<T, 2> g2({g.rows(), oc}, uninitialized);
  thrust::transform(sys, first, first + g2.size(), g2.data(), images_to_rows<T>{dy.data(), oc, g.out_pixels()});
  return g2;
}

/// @brief The local conv2d's input gradient from dy as rows (conv2d_grad_rows): col2im(g2 * w).
template <class T>
tensor<T, 4> conv2d_input_grad(const tensor<T, 2>& g2, const tensor<T, 4>& w, const window_geometry& g) {
  const std::size_t oc = w.extent(0);
  auto sys = kernel_system("conv2d backward", {g2.where(), w.where()});
  const thrust::counting_iterator<std::size_t> first(0);
  tensor<T, 2> dcols({g.rows(), g.cols()}, uninitialized);
  gemm<T>(sys, g.rows(), g.cols(), oc, {g2.data(), oc, false}, {w.data(), g.cols(), false}, dcols.data());
  tensor<T, 4> dx(shape_t<4>{g.batch, g.channels, g.height, g.width}, uninitialized);
  thrust::transform(sys, first, first + dx.size(), dx.data(), col2im_element<T>{dcols.data(), g});
  return dx;
}

/// @brief The local conv2d's weight and bias gradients from dy as rows, each computed when asked for (non-null).
template <class T>
void conv2d_weight_grads(const tensor<T, 2>& g2, const tensor<T, 2>& cols, const shape_t<4>& w_shape, const window_geometry& g,
                         tensor<T, 4>* dw, tensor<T, 1>* db) {
  const std::size_t oc = w_shape[0];
  auto sys = kernel_system("conv2d backward", {g2.where(), cols.where()});
  if (dw != nullptr) {
    *dw = tensor<T, 4>(w_shape, uninitialized);
    gemm<T>(sys, oc, g.cols(), g.rows(), {g2.data(), oc, true}, {cols.data(), g.cols(), false}, dw->data());
  }
  if (db != nullptr) {
    *db = tensor<T, 1>(shape_t<1>{oc}, uninitialized);
    const thrust::counting_iterator<std::size_t> first(0);
    thrust::transform(sys, first, first + oc, db->data(), column_sum<T>{g2.data(), g.rows(), oc});
  }
}

/// @brief The local conv2d backward from dy: dw, db and dx, each computed when asked for (non-null).
template <class T>
void conv2d_backward(const tensor<T, 4>& dy, const tensor<T, 2>& cols, const tensor<T, 4>& w, const window_geometry& g,
                     tensor<T, 4>* dw, tensor<T, 1>* db, tensor<T, 4>* dx) {
  const tensor<T, 2> g2 = conv2d_grad_rows(dy, g);
  conv2d_weight_grads(g2, cols, w.shape(), g, dw, db);
  if (dx != nullptr) *dx = conv2d_input_grad(g2, w, g);
}

inline void check_conv_shapes(const shape_t<4>& sx, const shape_t<4>& sw, const shape_t<1>& sb, const std::string& layouts) {
  if (sw[1] != sx[1] || sw[2] != sw[3] || sb[0] != sw[0])
    throw shape_error("conv2d: input " + format_extents(sx) + ", weight " + format_extents(sw) + ", bias " + format_extents(sb) + layouts +
                      ": the weight must be [out_channels, in_channels, k, k] with the input's channels, and the bias [out_channels]");
}

}  // namespace detail

/// @brief 2-D convolution: x [N, C, H, W], weight [OC, C, K, K], bias [OC] -> [N, OC, OH, OW],
/// as im2col then one gemm; the backward is two gemms and col2im.
/// A local conv2d communicates nothing: pdo::strict (conv2d<pdo::strict>) accepts it.
template <class Policy = implicit, class T>
var<tensor<T, 4>> conv2d(const var<tensor<T, 4>>& x, const var<tensor<T, 4>>& weight, const var<tensor<T, 1>>& bias,
                         window_options o = {}) {
  static_assert(std::is_same_v<Policy, implicit> || std::is_same_v<Policy, strict>, "pdo: conv2d: the policy must be pdo::implicit or pdo::strict");
  detail::check_conv_shapes(x.shape(), weight.shape(), bias.shape(), "");
  const detail::window_geometry g = detail::window_of("conv2d", x.shape(), weight.shape()[2], o);
  auto forward = detail::conv2d_forward(x.value(), weight.value(), bias.value().data(), g);
  auto cols = std::move(forward.second);  // a plain variable: lambdas may not capture structured bindings in clang 14
  return detail::record(
      std::move(forward.first),
      [x, weight, bias, cols, g](auto& self) {
        tensor<T, 4> dw, dx;
        tensor<T, 1> db;
        detail::conv2d_backward(*self.grad, *cols, weight.value(), g, weight.requires_grad() ? &dw : nullptr,
                                bias.requires_grad() ? &db : nullptr, x.requires_grad() ? &dx : nullptr);
        if (weight.requires_grad()) detail::add_grad(weight, std::move(dw));
        if (bias.requires_grad()) detail::add_grad(bias, std::move(db));
        if (x.requires_grad()) detail::add_grad(x, std::move(dx));
      },
      x, weight, bias);
}

namespace detail {

/// @brief The layouts of a distributed conv2d: batch split -> data parallel;
/// output channels split (weight dim 0, bias) -> channel parallel, output split by
/// channels; input channels split (input dim 1 and weight dim 1 on one axis) -> a partial
/// output; height or width split (input dims 2, 3) -> spatial: the output's rows split on
/// the same axes, each place reading its neighbours' rows its windows need (halo
/// exchange), weight and bias gradients partial over those axes. Also the layouts of the
/// places' local gradient contributions.
struct conv_layouts {
  bool ok = true;
  const char* problem = "";
  layout_value y, dw, db, dx;
};

constexpr conv_layouts conv_rule(layout_value x, layout_value w, layout_value b) {
  conv_layouts r;
  auto fail = [&](const char* why) {
    r.ok = false;
    r.problem = why;
    return r;
  };
  if (x.npartial != 0 || w.npartial != 0 || b.npartial != 0) return fail("operands must not be partial (reduce them first)");
  if (!w.dim_axis[2].empty() || !w.dim_axis[3].empty()) return fail("the kernel's dims (weight dims 2, 3) must not be split");
  if (x.dim_axis[1] != w.dim_axis[1]) return fail("the input's channels (dim 1) and the weight's dim 1 must be split alike");
  if (b.dim_axis[0] != w.dim_axis[0]) return fail("the bias must be split as the weight's output channels (dim 0)");
  if (!w.dim_axis[0].empty() && (w.dim_axis[0] == x.dim_axis[0] || w.dim_axis[0] == w.dim_axis[1]))
    return fail("one mesh axis cannot split two dims");
  if (!x.dim_axis[0].empty() && x.dim_axis[0] == x.dim_axis[1]) return fail("one mesh axis cannot split two dims");
  for (std::size_t d = 2; d < 4; ++d)
    if (!x.dim_axis[d].empty() && x.dim_axis[d] == w.dim_axis[0]) return fail("one mesh axis cannot split two dims");
  r.y.rank = 4;
  r.y.dim_axis[0] = x.dim_axis[0];
  r.y.dim_axis[1] = w.dim_axis[0];
  r.y.dim_axis[2] = x.dim_axis[2];
  r.y.dim_axis[3] = x.dim_axis[3];
  if (!w.dim_axis[1].empty()) r.y.add_partial(w.dim_axis[1]);
  r.dw = w;
  r.db = b;
  for (std::size_t d : {0, 2, 3})  // the places of these axes convolve other pixels with the same weights
    if (!x.dim_axis[d].empty()) {
      r.dw.add_partial(x.dim_axis[d]);
      r.db.add_partial(x.dim_axis[d]);
    }
  r.dx = x;
  if (!w.dim_axis[0].empty()) r.dx.add_partial(w.dim_axis[0]);
  return r;
}

template <class LX, class LW, class LB>
struct conv_rule_of {
  static constexpr conv_layouts value = conv_rule(value_of<LX>(), value_of<LW>(), value_of<LB>());
};
template <class LX, class LW, class LB, layout_value conv_layouts::*Which>
struct conv_layout_provider {
  static constexpr layout_value value = conv_rule_of<LX, LW, LB>::value.*Which;
};

}  // namespace detail

namespace detail {

/// @brief How a window op's input of layout `x` is cut along its height and width (dims 2
/// and 3) on a mesh: per dim, the halo_dim of the axis that splits it (1 part when none
/// does) and that axis's index.
struct spatial_cut {
  std::array<halo_dim, 2> dims;
  std::array<std::size_t, 2> axis{};
  std::array<bool, 2> split{};

  template <class Mesh>
  spatial_cut(const Mesh& m, const layout_value& x, const window_geometry& whole, std::size_t padding) {
    const std::array<std::size_t, 2> extent{whole.height, whole.width}, out{whole.out_height, whole.out_width};
    for (std::size_t i = 0; i < 2; ++i) {
      split[i] = !x.dim_axis[2 + i].empty();
      axis[i] = split[i] ? Mesh::axis_index(x.dim_axis[2 + i]) : 0;
      dims[i] = {extent[i], out[i], whole.kernel, whole.stride, padding, split[i] ? m.extent(axis[i]) : 1};
    }
  }
  [[nodiscard]] bool any() const { return split[0] || split[1]; }
  /// @brief Place p's position along dim i's axis (0 when the dim is whole).
  template <class Mesh>
  [[nodiscard]] std::size_t coord(const Mesh& m, std::size_t p, std::size_t i) const {
    return split[i] ? m.coord(p, axis[i]) : 0;
  }
  /// @brief Place p's shard widened by the rows and columns its windows read beyond it (a
  /// halo exchange along each split axis: every place of the mesh calls it at once).
  template <class T, class Mesh>
  [[nodiscard]] tensor<T, 4> gather(const Mesh& m, std::size_t p, tensor<T, 4> block) const {
    for (std::size_t i = 0; i < 2; ++i)
      if (split[i]) block = halo_gather(communicator_along(m, axis[i], p), dims[i], coord(m, p, i), 2 + i, block, m.place(p));
    return block;
  }
  /// @brief The transpose of gather: the gradient of place p's block, back to its shard.
  template <class T, class Mesh>
  [[nodiscard]] tensor<T, 4> give_back(const Mesh& m, std::size_t p, tensor<T, 4> dblock) const {
    for (std::size_t i = 2; i-- > 0;)
      if (split[i]) dblock = halo_return(communicator_along(m, axis[i], p), dims[i], coord(m, p, i), 2 + i, dblock, m.place(p));
    return dblock;
  }
  /// @brief The shape of the block place p's windows read: its shard's, widened along each
  /// split dim to the rows its output needs (what gather returns); with `dims_done` < 2, the
  /// block after the exchanges of the first `dims_done` spatial dims only.
  template <class Mesh>
  [[nodiscard]] shape_t<4> block_shape(const Mesh& m, std::size_t p, shape_t<4> shard, std::size_t dims_done = 2) const {
    for (std::size_t i = 0; i < dims_done; ++i)
      if (split[i]) shard[2 + i] = dims[i].need(coord(m, p, i)).size();
    return shard;
  }
  /// @brief Where place p's shard starts in its block along dim i (its block's first row
  /// may come after the shard's first: a place whose windows begin below its own first row).
  template <class Mesh>
  [[nodiscard]] std::ptrdiff_t shard_offset(const Mesh& m, std::size_t p, std::size_t i) const {
    if (!split[i]) return 0;
    const std::size_t c = coord(m, p, i);
    return static_cast<std::ptrdiff_t>(dims[i].own(c).begin) - static_cast<std::ptrdiff_t>(dims[i].need(c).begin);
  }
  /// @brief The output pixels of place p (of geometry g over its block) whose windows read
  /// none of its halo: computable from its shard before the halo exchange ends (empty when
  /// no row or no column is such).
  template <class Mesh>
  [[nodiscard]] pixel_region interior(const Mesh& m, std::size_t p, const window_geometry& g) const {
    const row_range rows = split[0] ? dims[0].interior(coord(m, p, 0)) : row_range{0, g.out_height};
    const row_range cols = split[1] ? dims[1].interior(coord(m, p, 1)) : row_range{0, g.out_width};
    if (rows.size() == 0 || cols.size() == 0) return {};
    return {rows.begin, rows.end, cols.begin, cols.end};
  }
  /// @brief The window geometry of place p over its block (its shard when nothing is split):
  /// the output rows and columns it owns, the padding of the image edges the block touches.
  template <class Mesh>
  [[nodiscard]] window_geometry local(const Mesh& m, std::size_t p, const shape_t<4>& block) const {
    const std::size_t ch = coord(m, p, 0), cw = coord(m, p, 1);
    return {block[0], block[1], block[2], block[3], dims[0].kernel, dims[0].stride, dims[0].pad_before(ch),
            dims[1].pad_before(cw), dims[0].out(ch).size(), dims[1].out(cw).size()};
  }
  /// @brief The window geometry of place p over the block its shard (of shape `shard`) widens to.
  template <class Mesh>
  [[nodiscard]] window_geometry block_geometry(const Mesh& m, std::size_t p, const shape_t<4>& shard) const {
    return local(m, p, block_shape(m, p, shard));
  }
};


/// @brief conv2d over an input split along its height or width, on every place of `m` in
/// this process: each place's halo exchange runs on its communication lane while its
/// compute lane gathers the im2col rows of its interior (the output pixels whose windows
/// read only its own rows and columns) from its shard; once the halo is in, the frame's
/// rows come from the widened block, then one gemm. `bias_of(p, k)`: the bias place p adds,
/// or null. Fills ys and cols (kept for the backward) per local place.
template <class T, class Mesh, class BiasOf>
void conv2d_spatial_forward(const Mesh& m, const spatial_cut& cut, const std::vector<tensor<T, 4>>& xs, const std::vector<tensor<T, 4>>& ws,
                            const BiasOf& bias_of, std::vector<tensor<T, 4>>& ys, std::vector<std::shared_ptr<tensor<T, 2>>>& cols) {
  const auto& local = m.local_places();
  std::vector<window_geometry> geometry(local.size());
  std::vector<pixel_region> inner(local.size());
  std::vector<tensor<T, 4>> blocks(local.size());
  for (auto&& [p, x, g, in] : views::zip(local, xs, geometry, inner)) {
    g = cut.block_geometry(m, p, x.shape());
    in = cut.interior(m, p, g);
  }
  batch_sequence ops("conv2d");
  ops.submit(
      m, lane_kind::compute, false,
      [&](std::size_t p, std::size_t k) {
        const window_geometry& g = geometry[k];
        cols[k] = std::make_shared<tensor<T, 2>>(shape_t<2>{g.rows(), g.cols()}, uninitialized);
        im2col_region(*cols[k], xs[k], cut.shard_offset(m, p, 0), cut.shard_offset(m, p, 1), g, inner[k]);
      },
      [&](std::size_t, std::size_t k) { return access{{xs[k].data()}, {&cols[k]}}; });
  ops.submit(
      m, lane_kind::communication, true, [&](std::size_t p, std::size_t k) { blocks[k] = cut.gather(m, p, xs[k]); },
      [&](std::size_t, std::size_t k) { return access{{xs[k].data()}, {&blocks[k]}}; });
  ops.submit(
      m, lane_kind::compute, false,
      [&](std::size_t p, std::size_t k) {
        const window_geometry& g = geometry[k];
        const pixel_region in = inner[k];
        // the frame around the interior: the rows above and below it, whole; beside it, left and right
        for (const pixel_region r : {pixel_region{0, in.row_begin, 0, g.out_width}, pixel_region{in.row_end, g.out_height, 0, g.out_width},
                                     pixel_region{in.row_begin, in.row_end, 0, in.col_begin},
                                     pixel_region{in.row_begin, in.row_end, in.col_end, g.out_width}})
          im2col_region(*cols[k], blocks[k], 0, 0, g, r);
        blocks[k] = {};
        ys[k] = conv2d_from_cols(*cols[k], ws[k], bias_of(p, k), g);
      },
      [&](std::size_t, std::size_t k) { return access{{&blocks[k], &cols[k], ws[k].data()}, {&blocks[k], &cols[k], &ys[k]}}; });
  ops.finish(m);
}

/// @brief conv2d's backward over an input split along its height or width, on every place of
/// `m` in this process: each place computes its block's input gradient first; its halo part
/// goes back to the neighbours on the communication lane while the compute lane computes
/// the weight and bias gradients (when asked for: dws, dbs non-null). Fills dxs.
template <class T, class Mesh>
void conv2d_spatial_backward(const Mesh& m, const spatial_cut& cut, const std::vector<tensor<T, 4>>& dys,
                             const std::vector<std::shared_ptr<tensor<T, 2>>>& cols, const std::vector<tensor<T, 4>>& ws,
                             const std::vector<tensor<T, 4>>& xs, std::vector<tensor<T, 4>>* dws, std::vector<tensor<T, 1>>* dbs,
                             std::vector<tensor<T, 4>>& dxs) {
  const auto& local = m.local_places();
  std::vector<window_geometry> geometry(local.size());
  std::vector<tensor<T, 2>> rows(local.size());
  std::vector<tensor<T, 4>> dblocks(local.size());
  for (auto&& [p, x, g] : views::zip(local, xs, geometry)) g = cut.block_geometry(m, p, x.shape());
  batch_sequence ops("conv2d backward");
  ops.submit(
      m, lane_kind::compute, false,
      [&](std::size_t, std::size_t k) {
        rows[k] = conv2d_grad_rows(dys[k], geometry[k]);
        dblocks[k] = conv2d_input_grad(rows[k], ws[k], geometry[k]);
      },
      [&](std::size_t, std::size_t k) { return access{{dys[k].data(), ws[k].data()}, {&rows[k], &dblocks[k]}}; });
  ops.submit(
      m, lane_kind::communication, true,
      [&](std::size_t p, std::size_t k) {
        dxs[k] = cut.give_back(m, p, std::move(dblocks[k]));
        dblocks[k] = {};
      },
      [&](std::size_t, std::size_t k) { return access{{&dblocks[k]}, {&dblocks[k], &dxs[k]}}; });
  if (dws != nullptr || dbs != nullptr)
    ops.submit(
        m, lane_kind::compute, false,
        [&](std::size_t, std::size_t k) {
          conv2d_weight_grads(rows[k], *cols[k], ws[k].shape(), geometry[k], dws != nullptr ? &(*dws)[k] : nullptr,
                              dbs != nullptr ? &(*dbs)[k] : nullptr);
        },
        [&](std::size_t, std::size_t k) {
          access a{{&rows[k], cols[k].get()}, {}};
          if (dws != nullptr) a.writes.push_back(&(*dws)[k]);
          if (dbs != nullptr) a.writes.push_back(&(*dbs)[k]);
          return a;
        });
  ops.finish(m);
}

}  // namespace detail

namespace detail {

/// @brief The plan of a window op `op` (conv2d, max_pool2d, avg_pool2d) with `arity`
/// operands, its input laid out as `x` and its output as `y`: a halo exchange along each
/// split spatial dim (the height's first), then the op's kernel. Nodes: the operands, then the op.
constexpr expression_plan window_plan(std::string_view op, std::size_t arity, const layout_value& x, const layout_value& y) {
  expression_plan plan;
  plan.nodes = arity + 1;
  for (std::size_t d = 2; d < 4; ++d)
    if (!x.dim_axis[d].empty()) {
      plan_step s{plan_step_kind::halo_exchange, op, arity, 0, 0};
      s.move = {step_kind::all_to_all, x.dim_axis[d], d, d, x, x};  // it travels as one all_to_all along the axis
      plan.push(s);
    }
  plan_step k{plan_step_kind::kernel, op, arity};
  k.layout = y;
  plan.push(k);
  return plan;
}

/// @brief The layout type of a window op's operand: a dtensor or a var of one.
template <class V>
struct window_operand {
  using type = typename V::layout_type;
};
template <class V>
struct window_operand<var<V>> {
  using type = typename V::layout_type;
};
template <class V>
using window_operand_t = typename window_operand<std::remove_cvref_t<V>>::type;

/// @brief Instantiated for conv2d operands of layouts it does not take: the failed
/// assertion's context names the layouts and why.
template <fixed_string Why, class LX, class LW, class LB>
struct conv2d_does_not_take_these_layouts {
  static_assert(always_false<LX, LW, LB>, "pdo: conv2d: these layouts of the input, weight and bias are not supported");
  static constexpr bool ok = false;
};
template <class LX, class LW, class LB>
constexpr bool check_conv_layouts() {
  constexpr conv_layouts r = conv_rule_of<LX, LW, LB>::value;
  if constexpr (r.ok) return true;
  else return conv2d_does_not_take_these_layouts<fixed_string<std::string_view(r.problem).size() + 1>(std::string_view(r.problem)), LX, LW, LB>::ok;
}

/// @brief Instantiated for a window op under pdo::strict whose input's height or width is
/// split: the halo exchange it needs is communication.
template <fixed_string Op, class LX>
struct strict_forbids_halo_exchange {
  static_assert(always_false<LX>,
                "pdo: strict: a window op over an input whose height or width is split exchanges halo rows with its "
                "neighbours, which takes communication; gather the spatial dims first (pdo::redistribute), or call it without pdo::strict");
  static constexpr bool ok = false;
};
template <class Policy, fixed_string Op, class LX>
constexpr bool check_window_policy() {
  static_assert(std::is_same_v<Policy, implicit> || std::is_same_v<Policy, strict>,
                "pdo: conv2d/max_pool2d/avg_pool2d: the policy must be pdo::implicit or pdo::strict");
  constexpr layout_value x = value_of<LX>();
  if constexpr (std::is_same_v<Policy, strict> && (!x.dim_axis[2].empty() || !x.dim_axis[3].empty()))
    return strict_forbids_halo_exchange<Op, LX>::ok;
  else
    return true;
}

/// @brief explain's text for a window op run by `plan` on mesh m over an input of
/// `x_shape` laid out as `lx` cut as `cut`: its halo exchanges with the bytes each place
/// sends, its kernel, and its backward.
template <class Mesh>
std::string explain_window(std::string_view op, const expression_plan& plan, const Mesh& m, const shape_t<4>& x_shape,
                           const layout_value& lx, const shape_t<4>& y_shape, const spatial_cut& cut, std::size_t element,
                           const std::string& backward_extra) {
  const auto x_text = format_extents(x_shape) + " " + to_string(lx);
  std::string text = "plan of " + std::string(op) + " -> " + format_extents(y_shape) + " " + to_string(plan.result_layout()) + " on " +
                     m.describe() + ": " + std::to_string(plan.kernels()) + " kernel, " + std::to_string(plan.collectives()) +
                     (plan.collectives() == 1 ? " collective" : " collectives") + "\n";
  std::size_t line = 0;
  std::string halo_axes;
  for (const auto& s : plan) {
    text += "  " + std::to_string(++line) + ". ";
    if (s.kind == plan_step_kind::kernel) {
      text += "kernel " + std::string(op) + " -> " + format_extents(y_shape) + " " + to_string(s.layout) + "\n";
      continue;
    }
    const std::size_t i = s.move.dim - 2;
    const halo_dim& d = cut.dims[i];
    halo_axes = std::string(s.move.axis) + (halo_axes.empty() ? "" : ", ") + halo_axes;
    text += "halo_exchange over " + std::string(s.move.axis) + " for " + std::string(op) + " operand 0 (" + x_text + "): " +
            (i == 0 ? "height" : "width") + " (dim " + std::to_string(s.move.dim) + ") of " + std::to_string(d.extent) + " in " +
            std::to_string(d.parts) + " shards, windows of " + std::to_string(d.kernel) + ", stride " + std::to_string(d.stride) +
            ", padding " + std::to_string(d.padding) + "; " + (i == 0 ? "rows" : "columns") + " received per place:";
    std::string bytes;
    for (std::size_t p = 0; p < m.size(); ++p) {
      // the block before this exchange: the shard, widened by the exchanges before it
      const shape_t<4> block = cut.block_shape(m, p, shard_shape(m, lx, x_shape, p), i);
      const std::size_t row_bytes = element * volume(block) / std::max<std::size_t>(block[s.move.dim], 1);
      const std::size_t c = cut.coord(m, p, i);
      text += (p == 0 ? " " : ", ") + std::to_string(d.halo_rows(c));
      bytes += (p == 0 ? " " : ", ") + std::to_string(halo_bytes_sent(d, c, row_bytes));
    }
    text += "; bytes sent per place:" + bytes + "\n";
  }
  text += "  backward: kernel " + std::string(op) + " backward" +
          (halo_axes.empty() ? std::string() : ", then the halo rows' gradient sent back to their owners over " + halo_axes +
                                                   " (the bytes of the exchange, the other way)") +
          backward_extra + "\n";
  return text;
}

}  // namespace detail

/// @brief The plan of conv2d for operands of types X, W, B (dtensors, or vars of them): a
/// halo exchange along each split spatial dim, then the kernel. A value, usable in
/// static_assert (`pdo::conv2d_plan<decltype(x), decltype(w), decltype(b)>().collectives() == 1`).
template <class X, class W, class B>
constexpr expression_plan conv2d_plan() {
  using LX = detail::window_operand_t<X>;
  using LW = detail::window_operand_t<W>;
  using LB = detail::window_operand_t<B>;
  static_assert(detail::check_conv_layouts<LX, LW, LB>());
  return detail::window_plan("conv2d", 3, detail::value_of<LX>(), detail::conv_rule_of<LX, LW, LB>::value.y);
}

/// @brief The plan of max_pool2d (Max) or avg_pool2d over an input of type X (a dtensor or a var of one).
template <class X, bool Max = true>
constexpr expression_plan pool2d_plan() {
  constexpr detail::layout_value x = detail::value_of<detail::window_operand_t<X>>();
  return detail::window_plan(Max ? "max_pool2d" : "avg_pool2d", 1, x, x);
}

namespace detail {

/// @brief conv2d over dtensors whose layouts conv_rule takes.
template <class T, class Mesh, class LX, class LW, class LB>
auto distributed_conv2d(const var<dtensor<T, 4, Mesh, LX>>& x, const var<dtensor<T, 4, Mesh, LW>>& weight,
                        const var<dtensor<T, 1, Mesh, LB>>& bias, window_options o) {
  using rule = detail::conv_rule_of<LX, LW, LB>;
  using LY = detail::layout_type_t<Mesh, detail::conv_layout_provider<LX, LW, LB, &detail::conv_layouts::y>>;
  using LDW = detail::layout_type_t<Mesh, detail::conv_layout_provider<LX, LW, LB, &detail::conv_layouts::dw>>;
  using LDB = detail::layout_type_t<Mesh, detail::conv_layout_provider<LX, LW, LB, &detail::conv_layouts::db>>;
  using LDX = detail::layout_type_t<Mesh, detail::conv_layout_provider<LX, LW, LB, &detail::conv_layouts::dx>>;
  const auto& xv = x.value();
  const auto& wv = weight.value();
  const auto& bv = bias.value();
  const Mesh& m = xv.mesh();
  detail::check_conv_shapes(xv.shape(), wv.shape(), bv.shape(),
                            " (layouts " + layout_name<LX>() + ", " + layout_name<LW>() + ", " + layout_name<LB>() + ")");
  const detail::window_geometry whole = detail::window_of("conv2d", xv.shape(), wv.shape()[2], o);
  const auto cut = std::make_shared<const detail::spatial_cut>(m, detail::value_of<LX>(), whole, o.padding);
  const shape_t<4> y_shape{whole.batch, wv.shape()[0], whole.out_height, whole.out_width};
  const auto& local = m.local_places();
  std::vector<tensor<T, 4>> ys(local.size());
  auto cols = std::make_shared<std::vector<std::shared_ptr<tensor<T, 2>>>>(local.size());
  // a partial output: the bias is added once, by the first place along the partial axis
  const auto bias_of = [&](std::size_t p, std::size_t k) -> const T* {
    for (std::size_t i = 0; i < rule::value.y.npartial; ++i)
      if (m.coord(p, Mesh::axis_index(rule::value.y.partial[i])) != 0) return nullptr;
    return bv.local_shards()[k].data();
  };
  if (cut->any()) {
    detail::conv2d_spatial_forward(m, *cut, xv.local_shards(), wv.local_shards(), bias_of, ys, *cols);
  } else {
    detail::run_on_places("conv2d", m, [&](std::size_t p, std::size_t k) {
      const auto& xs = xv.local_shards()[k];
      auto [y, c] = detail::conv2d_forward(xs, wv.local_shards()[k], bias_of(p, k), cut->local(m, p, xs.shape()));
      ys[k] = std::move(y);
      (*cols)[k] = std::move(c);
    });
  }
  dtensor<T, 4, Mesh, LY> y(m, y_shape, std::move(ys));
  return detail::record(
      std::move(y),
      [x, weight, bias, cols, cut](auto& self) {
        const auto& xv = x.value();
        const auto& wv = weight.value();
        const Mesh& m = xv.mesh();
        const auto& local = m.local_places();
        std::vector<tensor<T, 4>> dws(local.size()), dxs(local.size());
        std::vector<tensor<T, 1>> dbs(local.size());
        if (x.requires_grad() && cut->any()) {
          detail::conv2d_spatial_backward(m, *cut, self.grad->local_shards(), *cols, wv.local_shards(), xv.local_shards(),
                                          weight.requires_grad() ? &dws : nullptr, bias.requires_grad() ? &dbs : nullptr, dxs);
        } else {
          detail::run_on_places("conv2d backward", m, [&](std::size_t p, std::size_t k) {
            const auto g = cut->block_geometry(m, p, xv.local_shards()[k].shape());
            detail::conv2d_backward(self.grad->local_shards()[k], *(*cols)[k], wv.local_shards()[k], g,
                                    weight.requires_grad() ? &dws[k] : nullptr, bias.requires_grad() ? &dbs[k] : nullptr,
                                    x.requires_grad() ? &dxs[k] : nullptr);
          });
        }
        if (weight.requires_grad()) detail::add_grad(weight, dtensor<T, 4, Mesh, LDW>(m, wv.shape(), std::move(dws)));
        if (bias.requires_grad()) detail::add_grad(bias, dtensor<T, 1, Mesh, LDB>(m, bias.value().shape(), std::move(dbs)));
        if (x.requires_grad()) detail::add_grad(x, dtensor<T, 4, Mesh, LDX>(m, xv.shape(), std::move(dxs)));
      },
      x, weight, bias);
}

}  // namespace detail

/// @brief conv2d over dtensors: each place convolves its shards, with the layouts of
/// detail::conv_rule: batch split over "dp" is data parallel (weight gradients partial over
/// "dp"); the weight's output channels split over an axis give an output split by
/// channels (channel parallel; the input gradient is a partial sum over that axis); the
/// input channels split with the weight's dim 1 give a partial output (summed where it is
/// consumed; the bias is added once); the height or width split (spatial) gives an output
/// split alike, each place receiving from its neighbours the rows its windows read (a halo
/// exchange, from as many places as the halo is wide) and sending back their gradient.
/// Gradients go back to the operands' layouts by the planner's redistributions.
template <class Policy = implicit, class T, class Mesh, class LX, class LW, class LB>
auto conv2d(const var<dtensor<T, 4, Mesh, LX>>& x, const var<dtensor<T, 4, Mesh, LW>>& weight,
            const var<dtensor<T, 1, Mesh, LB>>& bias, window_options o = {}) {
  // layouts it does not take: one error, naming them and why, and nothing of the op instantiated after it
  if constexpr (detail::check_conv_layouts<LX, LW, LB>() && detail::check_window_policy<Policy, "conv2d", LX>())
    return detail::distributed_conv2d(x, weight, bias, o);
}

namespace detail {

/// @brief The local pool of x over the windows of g (on the calling thread's place).
template <bool Max, class T>
tensor<T, 4> pool2d_forward(const char* op, const tensor<T, 4>& x, const window_geometry& g) {
  auto system = kernel_system(op, {x.where()});
  const thrust::counting_iterator<std::size_t> zero(0);
  tensor<T, 4> y({g.batch, g.channels, g.out_height, g.out_width}, uninitialized);
  thrust::transform(system, zero, zero + y.size(), y.data(), pool_element<T, Max>{x.data(), g});
  return y;
}

/// @brief The local pool's input gradient from dy.
template <bool Max, class T>
tensor<T, 4> pool2d_backward(const char* op, const tensor<T, 4>& x, const tensor<T, 4>& dy, const window_geometry& g) {
  auto system = kernel_system(op, {x.where(), dy.where()});
  const thrust::counting_iterator<std::size_t> first(0);
  tensor<T, 4> dx(x.shape(), uninitialized);
  thrust::transform(system, first, first + dx.size(), dx.data(), pool_backward_element<T, Max>{x.data(), dy.data(), g});
  return dx;
}

template <bool Max, class T>
var<tensor<T, 4>> pool2d(const char* op, const var<tensor<T, 4>>& x, std::size_t kernel, window_options o) {
  const window_geometry g = pool_window_of(op, x.shape(), kernel, o);
  return record(
      pool2d_forward<Max>(op, x.value(), g),
      [x, g, op](auto& self) { add_grad(x, pool2d_backward<Max>(op, x.value(), *self.grad, g)); }, x);
}

/// @brief Whether pooling can run on an input laid out as `x`: not partial; batch and
/// channels split run on each place's shard alone; height and width split exchange halos.
constexpr bool pool_layout_ok(layout_value x) { return x.npartial == 0; }

/// @brief Pooling of a dtensor: each place pools its shard (widened by its halo where the
/// height or width is split); the output and the input gradient keep the input's layout.
template <bool Max, class T, class Mesh, class L>
var<dtensor<T, 4, Mesh, L>> pool2d(const char* op, const var<dtensor<T, 4, Mesh, L>>& x, std::size_t kernel, window_options o) {
  static_assert(pool_layout_ok(value_of<L>()), "pdo: max_pool2d/avg_pool2d: the input must not be partial: reduce it first");
  using value_t = dtensor<T, 4, Mesh, L>;
  const value_t& xv = x.value();
  const window_geometry whole = pool_window_of(op, xv.shape(), kernel, o);
  const Mesh& m = xv.mesh();
  const auto cut = std::make_shared<const spatial_cut>(m, value_of<L>(), whole, o.padding);
  std::vector<tensor<T, 4>> ys(m.local_places().size());
  // the blocks the windows read, for the backward of a max pool (its shards, when nothing is split)
  auto blocks = std::make_shared<std::vector<tensor<T, 4>>>(cut->any() ? ys.size() : 0);
  run_on_places(op, m, [&](std::size_t p, std::size_t k) {
    const auto& xs = xv.local_shards()[k];
    if (cut->any()) (*blocks)[k] = cut->gather(m, p, xs);
    const tensor<T, 4>& in = cut->any() ? (*blocks)[k] : xs;
    ys[k] = pool2d_forward<Max>(op, in, cut->local(m, p, in.shape()));
  });
  const shape_t<4> y_shape{whole.batch, whole.channels, whole.out_height, whole.out_width};
  return record(
      value_t(m, y_shape, std::move(ys)),
      [x, op, cut, blocks](auto& self) {
        const value_t& xv = x.value();
        const Mesh& m = xv.mesh();
        std::vector<tensor<T, 4>> dxs(xv.local_shards().size());
        run_on_places(op, m, [&](std::size_t p, std::size_t k) {
          const tensor<T, 4>& in = cut->any() ? (*blocks)[k] : xv.local_shards()[k];
          dxs[k] = pool2d_backward<Max>(op, in, self.grad->local_shards()[k], cut->local(m, p, in.shape()));
          if (cut->any()) dxs[k] = cut->give_back(m, p, std::move(dxs[k]));
        });
        add_grad(x, value_t(m, xv.shape(), std::move(dxs)));
      },
      x);
}

}  // namespace detail

/// @brief Max pooling over kernel x kernel windows (stride defaults to the kernel) of
/// x [N, C, H, W], a local tensor or a dtensor (batch or channels split: each place pools
/// its shard; height or width split: with its halo, as conv2d). NaN in a window gives NaN; the gradient goes to each
/// window's first maximum (its first NaN, if any), as PyTorch's.
template <class Policy = implicit, class V>
  requires(detail::value_kind<V>::rank == 4)
var<V> max_pool2d(const var<V>& x, std::size_t kernel, window_options o = {0, 0}) {
  if constexpr (detail::value_kind<V>::distributed) static_assert(detail::check_window_policy<Policy, "max_pool2d", typename V::layout_type>());
  else static_assert(std::is_same_v<Policy, implicit> || std::is_same_v<Policy, strict>, "pdo: max_pool2d: the policy must be pdo::implicit or pdo::strict");
  return detail::pool2d<true>("max_pool2d", x, kernel, o);
}

/// @brief Average pooling over kernel x kernel windows (stride defaults to the kernel;
/// padded cells count as zeros), of a local tensor or a dtensor (split as max_pool2d's).
template <class Policy = implicit, class V>
  requires(detail::value_kind<V>::rank == 4)
var<V> avg_pool2d(const var<V>& x, std::size_t kernel, window_options o = {0, 0}) {
  if constexpr (detail::value_kind<V>::distributed) static_assert(detail::check_window_policy<Policy, "avg_pool2d", typename V::layout_type>());
  else static_assert(std::is_same_v<Policy, implicit> || std::is_same_v<Policy, strict>, "pdo: avg_pool2d: the policy must be pdo::implicit or pdo::strict");
  return detail::pool2d<false>("avg_pool2d", x, kernel, o);
}

namespace detail {
template <class V>
const auto& window_value(const V& v) {
  if constexpr (requires { v.value(); }) return v.value();
  else return v;
}
template <bool Max, class X>
std::string explain_pool2d(const X& x, std::size_t kernel, window_options o) {
  const auto& xv = window_value(x);
  using value_t = std::remove_cvref_t<decltype(xv)>;
  const char* op = Max ? "max_pool2d" : "avg_pool2d";
  const window_geometry whole = pool_window_of(op, xv.shape(), kernel, o);
  const spatial_cut cut(xv.mesh(), value_t::layout_value, whole, o.padding);
  return explain_window(op, pool2d_plan<value_t, Max>(), xv.mesh(), xv.shape(), value_t::layout_value,
                        {whole.batch, whole.channels, whole.out_height, whole.out_width}, cut, sizeof(typename value_t::value_type), "");
}
}  // namespace detail

/// @brief The plan of conv2d(x, weight, bias, o) for the operands' shapes and layouts (dtensors,
/// or vars of them), one line per step: each halo exchange with its axis, the rows each place
/// receives and the bytes each place sends; the kernel with its output layout; the backward.
template <class X, class W, class B>
std::string explain_conv2d(const X& x, const W& weight, const B& bias, window_options o = {}) {
  const auto& xv = detail::window_value(x);
  const auto& wv = detail::window_value(weight);
  const auto& bv = detail::window_value(bias);
  using XV = std::remove_cvref_t<decltype(xv)>;
  using WV = std::remove_cvref_t<decltype(wv)>;
  using BV = std::remove_cvref_t<decltype(bv)>;
  constexpr auto plan = conv2d_plan<XV, WV, BV>();
  constexpr detail::conv_layouts rule = detail::conv_rule_of<typename XV::layout_type, typename WV::layout_type, typename BV::layout_type>::value;
  detail::check_conv_shapes(xv.shape(), wv.shape(), bv.shape(), "");
  const detail::window_geometry whole = detail::window_of("conv2d", xv.shape(), wv.shape()[2], o);
  const detail::spatial_cut cut(xv.mesh(), XV::layout_value, whole, o.padding);
  std::string extra;
  if (rule.dw.npartial > 0) {
    extra = "; weight and bias gradients partial over";
    for (std::size_t i = 0; i < rule.dw.npartial; ++i) extra += (i == 0 ? " " : ", ") + std::string(rule.dw.partial[i]);
    extra += " (summed where they are read)";
  }
  return detail::explain_window("conv2d", plan, xv.mesh(), xv.shape(), XV::layout_value,
                                {whole.batch, wv.shape()[0], whole.out_height, whole.out_width}, cut, sizeof(typename XV::value_type), extra);
}

/// @brief The plan of max_pool2d(x, kernel, o), as explain_conv2d's.
template <class X>
std::string explain_max_pool2d(const X& x, std::size_t kernel, window_options o = {0, 0}) {
  return detail::explain_pool2d<true>(x, kernel, o);
}

/// @brief The plan of avg_pool2d(x, kernel, o), as explain_conv2d's.
template <class X>
std::string explain_avg_pool2d(const X& x, std::size_t kernel, window_options o = {0, 0}) {
  return detail::explain_pool2d<false>(x, kernel, o);
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_AUTOGRAD_CONV_HPP
// ---- pdo/autograd/collectives.hpp
#ifndef PDO_SINGLE_PDO_AUTOGRAD_COLLECTIVES_HPP
#define PDO_SINGLE_PDO_AUTOGRAD_COLLECTIVES_HPP
// pdo/autograd/collectives.hpp: collectives on pdo::var inside SPMD code (an spmd task, a
// pipeline stage), each with its backward rule: Megatron's two conjugate operators.
//
// On dtensors the planner inserts these collectives itself (see pdo/nn/tensor_parallel.hpp);
// code that runs on one place of a group, holding local tensors, says where they go.


#include <cstddef>
#include <utility>

namespace pdo {

/// @brief The sum over the members of `group` of their `x` (every member of the group calls
/// it, in the same order as its other collectives; each passes its addend). The gradient
/// of each addend is the gradient of the sum, so backward moves no data (Megatron's g).
template <class T, std::size_t R>
var<tensor<T, R>> sum_across(const var<tensor<T, R>>& x, const mesh_communicator& group) {
  tensor<T, R> y = x.value();
  group.all_reduce(y.span());
  return detail::record(
      std::move(y), [x](detail::value_node<tensor<T, R>>& self) { detail::add_grad(x, std::move(*self.grad)); }, x);
}

/// @brief `x`, the same value on every member of `group`, used by each member for its own
/// part of the work (its shard of a column-parallel layer): forward moves no data; the
/// gradient of `x` is the sum of the members' gradients, all_reduced in backward (Megatron's f).
template <class T, std::size_t R>
var<tensor<T, R>> replicated_across(const var<tensor<T, R>>& x, const mesh_communicator& group) {
  return detail::record(
      tensor<T, R>(x.value()),
      [x, group](detail::value_node<tensor<T, R>>& self) {
        tensor<T, R> g = std::move(*self.grad);
        group.all_reduce(g.span());
        detail::add_grad(x, std::move(g));
      },
      x);
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_AUTOGRAD_COLLECTIVES_HPP
// ---- pdo/autograd/parallel_do.hpp
#ifndef PDO_SINGLE_PDO_AUTOGRAD_PARALLEL_DO_HPP
#define PDO_SINGLE_PDO_AUTOGRAD_PARALLEL_DO_HPP
// pdo/autograd/parallel_do.hpp: parallel_do over pdo::var operands, differentiable: each
// place records its block's graph, and backward runs the blocks' backward on every place and
// merges each operand's gradient by its layout.

// ---- pdo/exec/parallel_do.hpp
#ifndef PDO_SINGLE_PDO_EXEC_PARALLEL_DO_HPP
#define PDO_SINGLE_PDO_EXEC_PARALLEL_DO_HPP
// pdo/exec/parallel_do.hpp: run a block on every place over its local shards, and merge the results.


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

/// @brief What the block of this process's `k`-th place reads: the local shards of the
/// dtensors among `args`. So it waits for the work queued to write them (an eval_async's,
/// its collectives included), and is cancelled with that work's error if it failed.
template <class... Args>
access shards_read(std::size_t k, const Args&... args) {
  access a;
  (
      [&] {
        if constexpr (distributed_tensor<Args>)
          if (const void* d = args.local_shards()[k].data(); d != nullptr) a.reads.push_back(d);
      }(),
      ...);
  return a;
}

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
  [[nodiscard]] error_kind kind(std::size_t p) const { return static_cast<error_kind>(values[p * width] - 1); }
  [[nodiscard]] std::size_t extent(std::size_t p, std::size_t d) const { return values[p * width + 1 + d]; }
};

template <class Mesh, class Result>
block_outcomes share_outcomes(const Mesh& m, const std::vector<std::optional<Result>>& results,
                              const std::vector<std::optional<captured_error>>& failures) {
  constexpr std::size_t rank = Result::rank;
  block_outcomes o{std::vector<std::size_t>(m.size() * (rank + 1), 0), rank + 1};
  auto mine = [&](std::size_t k) {
    std::vector<std::size_t> v(rank + 1, 1);
    if (failures[k]) v[0] = 1 + static_cast<std::size_t>(failures[k]->kind);
    if (results[k]) {
      v[0] = 0;
      for (std::size_t d = 0; d < rank; ++d) v[1 + d] = results[k]->extent(d);
    }
    return v;
  };
  const auto& local = m.local_places();
  if (!m.is_multiprocess()) {
    for (const auto [k, p] : views::enumerate(local)) {
      const auto v = mine(static_cast<std::size_t>(k));
      std::copy(v.begin(), v.end(), o.values.begin() + static_cast<std::ptrdiff_t>(p * o.width));
    }
    return o;
  }
  std::vector<std::vector<std::size_t>> gathered(local.size(), std::vector<std::size_t>(o.values.size()));
  run_on_places("parallel_do", m, [&](std::size_t p, std::size_t k) {
    const auto v = mine(k);
    host_communicator_of(m, p).all_gather(std::span<const std::size_t>(v), std::span<std::size_t>(gathered[k]));
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
    const auto comm = host_communicator_of(m, p);
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

namespace detail {

/// @brief Runs `part(p, k)` (place p, the k-th of this process) on every place of `m` in
/// this process, all at once, and merges the tensors they return into a dtensor laid out as
/// `OutLayout`: a part that failed, or parts whose shapes do not fit the layout, are a
/// pdo::error on every process, naming the place and the shapes; the mesh stays usable.
template <layout_spec OutLayout, class Mesh, class Part, class Access = no_access>
auto merge_parts(const Mesh& m, Part&& part, Access reads = {}) {
  using result_t = std::remove_cvref_t<std::invoke_result_t<Part&, std::size_t, std::size_t>>;
  using T = typename result_t::value_type;
  constexpr std::size_t rank = result_t::rank;
  check_not_nested("parallel_do");
  const auto& local = m.local_places();
  comms_of(m);  // built by every process, those without places too
  if (local.empty())
    throw layout_error("parallel_do: this process holds no place of " + m.describe() + "; call it on the processes that do");
  std::vector<std::optional<result_t>> results(local.size());
  const auto batch = run_batch_on_places(
      m,
      [&](std::size_t p, std::size_t k) {
        result_t r = part(p, k);
        // a part made in another memory than its place's (a host tensor on a GPU place) moves there
        if (memory_of(r.where()) != memory_of(m.place(p).state().get())) r = to_place(r, m.place(p));
        results[k].emplace(std::move(r));
      },
      /*communicate=*/false, "parallel_do", "task", reads);
  const block_outcomes outcomes = share_outcomes(m, results, batch->failures);
  // the place whose error is reported, the same on every process: the first that failed by
  // itself, else the first whose collective was aborted by another's failure
  std::optional<std::size_t> reported;
  for (std::size_t p = 0; p < m.size(); ++p)
    if (outcomes.failed(p) && (!reported || (outcomes.kind(*reported) == error_kind::aborted && outcomes.kind(p) != error_kind::aborted)))
      reported = p;
  if (reported) {
    const std::size_t p = *reported;
    std::string here;
    for (std::size_t k = 0; k < local.size(); ++k)
      if (local[k] == p && batch->failures[k]) here = batch->failures[k]->message;
    throw_error_of_kind(outcomes.kind(p), "parallel_do: the block failed on place " + m.place(p).name() + ": " + share_message(m, p, here));
  }
  shape_t<rank> global{};
  check_merge<OutLayout>(m, outcomes, global);
  std::vector<tensor<T, rank>> shards;
  shards.reserve(local.size());
  for (auto& r : results) shards.push_back(std::move(*r));
  return dtensor<T, rank, Mesh, OutLayout>(m, global, std::move(shards));
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
/// mesh stays usable. (With `pdo::var` operands, pdo/autograd/parallel_do.hpp's overload
/// records the block for pdo::backward.)
template <layout_spec OutLayout, class Block, class... Args>
  requires(distributed_tensor<Args> || ...)
auto parallel_do(Block&& block, const Args&... args) {
  using result_t = std::remove_cvref_t<std::invoke_result_t<Block&, detail::local_view_t<Args>...>>;
  static_assert(is_tensor_v<result_t>, "pdo: parallel_do: the block must return a pdo::tensor (its place's part of the result)");
  if constexpr (is_tensor_v<result_t>) {  // else nothing more: one error
    const auto& m = detail::first_dtensor(args...).mesh();
    using mesh_t = std::remove_cvref_t<decltype(m)>;
    static_assert(sizeof(detail::check_layout<"parallel_do", OutLayout, mesh_t, result_t::rank>) != 0);
    (detail::check_same_mesh(args, m), ...);
    return detail::merge_parts<OutLayout>(
        m, [&](std::size_t p, std::size_t) -> result_t { return block(detail::local_view(args, p)...); },
        [&](std::size_t, std::size_t k) { return detail::shards_read(k, args...); });
  }
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXEC_PARALLEL_DO_HPP

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace pdo {

namespace detail {

template <class A>
inline constexpr bool is_distributed_var_v = false;
template <class V>
inline constexpr bool is_distributed_var_v<var<V>> = value_kind<V>::distributed;

/// @brief What a differentiable block receives for one argument: a var over a dtensor
/// becomes a var over the place's shard (a leaf of the place's graph, needing a gradient
/// when the operand does); a dtensor, its shard; anything else, itself.
template <class Arg>
struct block_argument {
  using type = local_view_t<Arg>;
};
template <class T, std::size_t R, class M, class L>
struct block_argument<var<dtensor<T, R, M, L>>> {
  using type = var<tensor<T, R>>;
};
template <class Arg>
using block_argument_t = typename block_argument<Arg>::type;

template <class Arg>
block_argument_t<Arg> block_argument_of(const Arg& arg, std::size_t p) {
  if constexpr (is_distributed_var_v<Arg>) return block_argument_t<Arg>(arg.value().shard(p), arg.requires_grad());
  else return local_view(arg, p);
}

template <class Arg>
const auto& mesh_holder(const Arg& arg) {
  if constexpr (is_distributed_var_v<Arg>) return arg.value();
  else return arg;
}

/// @brief The layout of the gradients the places compute for an operand laid out as
/// `Layout`: its split dims as they are, and a pending sum over every mesh axis that no dim
/// splits (the places along such an axis hold replicas, each used by its own block).
template <class Mesh, class Layout>
struct replica_gradient_layout {
  static constexpr layout_value value = [] {
    layout_value v = value_of<typename Layout::base>();
    for (std::size_t a = 0; a < Mesh::ndim; ++a) {
      bool splits = false;
      for (std::size_t d = 0; d < v.rank; ++d) splits = splits || v.dim_axis[d] == Mesh::axis_names[a];
      if (!splits) v.partial[v.npartial++] = Mesh::axis_names[a];
    }
    return v;
  }();
};

/// @brief How many places hold each value of a dtensor laid out as `v` on `m`: the product
/// of the extents of the axes it is neither split nor partial over.
template <class Mesh>
std::size_t replica_count(const Mesh& m, const layout_value& v) {
  std::size_t n = 1;
  for (std::size_t a = 0; a < Mesh::ndim; ++a) {
    bool used = false;
    for (std::size_t d = 0; d < v.rank; ++d) used = used || v.dim_axis[d] == Mesh::axis_names[a];
    for (std::size_t i = 0; i < v.npartial; ++i) used = used || v.partial[i] == Mesh::axis_names[a];
    if (!used) n *= m.extent(a);
  }
  return n;
}

/// @brief A block's result on one place as a var over a local tensor: a var as it is; a
/// tensor or an expression (of values that need no gradient), evaluated, as a constant.
template <class R>
auto as_block_result(R&& r) {
  using plain = std::remove_cvref_t<R>;
  if constexpr (is_var_v<plain>) {
    static_assert(!value_kind<typename plain::value_type>::distributed,
                  "pdo: parallel_do: a block returns its place's part of the result, a pdo::var over a local tensor, not over a dtensor");
    return plain(std::forward<R>(r));
  } else {
    static_assert(tensor_operand<plain>,
                  "pdo: parallel_do: the block must return a pdo::var over a local tensor, a pdo::tensor or an expression (its "
                  "place's part of the result)");
    auto t = pdo::eval(std::forward<R>(r));
    return var<decltype(t)>(std::move(t));
  }
}

/// @brief What one place keeps of an argument for backward: the leaf it made of a var over a
/// dtensor; nothing of the others.
template <class Arg>
using block_leaf_t = std::conditional_t<is_distributed_var_v<Arg>, block_argument_t<Arg>, std::monostate>;

/// @brief What one place recorded in forward: the leaves it made of the operands that are
/// vars over dtensors, and its result.
template <class Out, class... Args>
struct block_tape {
  std::tuple<block_leaf_t<Args>...> leaves;
  Out out;
};

/// @brief Keeps, in a place's tape, the leaves it made of the operands that are vars over dtensors.
template <class... Args, class Leaves, class Arguments, std::size_t... I>
void keep_leaves(Leaves& leaves, const Arguments& arguments, std::index_sequence<I...>) {
  (
      [&] {
        if constexpr (is_distributed_var_v<std::tuple_element_t<I, std::tuple<Args...>>>) std::get<I>(leaves) = std::get<I>(arguments);
      }(),
      ...);
}

/// @brief What backward keeps of an operand: a var over a dtensor (a handle); nothing of the others.
template <class Arg>
auto kept_operand(const Arg& arg) {
  if constexpr (is_distributed_var_v<Arg>) return arg;
  else return std::monostate{};
}

template <class Arg>
void add_input(const Arg& arg, std::vector<std::shared_ptr<grad_node>>& inputs) {
  if constexpr (is_distributed_var_v<Arg>)
    if (arg.requires_grad()) inputs.push_back(arg.node());
}

/// @brief Adds to operand `I`'s gradient (if it is a var over a dtensor that needs one) the
/// gradients the places computed for their blocks, merged by the operand's layout: the
/// places' blocks form a dtensor that is partial over every axis the operand is replicated
/// on, which the planner's redistribution reduces to the gradient's layout.
template <std::size_t I, class Mesh, class Tapes, class Operands>
void merge_operand_gradient(const Mesh& m, const Tapes& tapes, const Operands& operands) {
  using operand_t = std::tuple_element_t<I, Operands>;
  if constexpr (is_distributed_var_v<operand_t>) {
    const operand_t& arg = std::get<I>(operands);
    if (!arg.requires_grad()) return;
    using value_t = typename operand_t::value_type;
    using U = typename value_t::value_type;
    constexpr std::size_t r = value_t::rank;
    using grad_layout = layout_type_t<Mesh, replica_gradient_layout<Mesh, typename value_t::layout_type>>;
    std::vector<tensor<U, r>> blocks;
    blocks.reserve(tapes.size());
    for (std::size_t k = 0; k < tapes.size(); ++k) {
      const auto& leaf = std::get<I>(tapes[k]->leaves);
      blocks.push_back(leaf.has_grad() ? leaf.grad() : tensor<U, r>(leaf.shape(), m.place(m.local_places()[k])));
    }
    dtensor<U, r, Mesh, grad_layout> places_grads(m, arg.shape(), std::move(blocks));
    using target_t = grad_t<value_t>;
    if constexpr (std::is_same_v<decltype(places_grads), target_t>) arg.node()->accumulate(std::move(places_grads));
    else arg.node()->accumulate(redistribute<typename target_t::layout_type>(places_grads));
  }
}

template <class Mesh, class Tapes, class Operands, std::size_t... I>
void merge_operand_gradients(const Mesh& m, const Tapes& tapes, const Operands& operands, std::index_sequence<I...>) {
  (merge_operand_gradient<I>(m, tapes, operands), ...);
}

}  // namespace detail

/// @brief parallel_do over `pdo::var` operands: runs `block` on every place at once, and
/// records it for pdo::backward. Each var over a dtensor arrives in the block as a var over
/// its place's shard (each place records its own graph); a plain dtensor as its shard; any
/// other argument as it is. The block returns a var over a local tensor (or an expression),
/// its place's part of the result; the parts are merged as `OutLayout` says, into a var
/// over the merged dtensor.
///
/// pdo::backward through it splits the output's gradient by `OutLayout`, runs the block's
/// backward on every place (as tasks on the places' lanes, at once; places that hold copies
/// of one value, along an axis the output is replicated on, share its gradient), and merges each
/// operand's gradient by that operand's layout: a split operand gets its shards' gradients;
/// a replicated one (used by every place's block) gets the sum of the places' gradients,
/// the `partial` gradient the planner reduces (an all_reduce). Parameters the block holds
/// itself (captured by its closure) collect the gradients of every place's use.
template <layout_spec OutLayout, class Block, class... Args>
  requires(detail::is_distributed_var_v<Args> || ...)
auto parallel_do(Block&& block, const Args&... args) {
  using part_t = decltype(detail::as_block_result(std::declval<std::invoke_result_t<Block&, detail::block_argument_t<Args>...>>()));
  using local_t = typename part_t::value_type;
  using T = typename local_t::value_type;
  constexpr std::size_t rank = local_t::rank;
  const auto& m = detail::first_dtensor(detail::mesh_holder(args)...).mesh();
  using mesh_t = std::remove_cvref_t<decltype(m)>;
  using merged_t = dtensor<T, rank, mesh_t, OutLayout>;
  static_assert(sizeof(detail::check_layout<"parallel_do", OutLayout, mesh_t, rank>) != 0);
  (detail::check_same_mesh(detail::mesh_holder(args), m), ...);

  using tape_t = detail::block_tape<part_t, Args...>;
  auto tapes = std::make_shared<std::vector<std::optional<tape_t>>>(m.local_places().size());
  merged_t merged = detail::merge_parts<OutLayout>(m, [&](std::size_t p, std::size_t k) -> local_t {
    tape_t& tape = (*tapes)[k].emplace();
    std::tuple<detail::block_argument_t<Args>...> arguments(detail::block_argument_of(args, p)...);
    detail::keep_leaves<Args...>(tape.leaves, arguments, std::index_sequence_for<Args...>{});
    tape.out = detail::as_block_result(std::apply(block, arguments));
    return tape.out.value();
  }, [&](std::size_t, std::size_t k) { return detail::shards_read(k, detail::mesh_holder(args)...); });

  bool needs_grad = false;
  for (const auto& t : *tapes) needs_grad = needs_grad || t->out.requires_grad();
  if (!needs_grad) return var<merged_t>(std::move(merged));

  // the graph's inputs: the operands that need a gradient (a block's own parameters are
  // reached through the places' graphs)
  std::vector<std::shared_ptr<detail::grad_node>> inputs;
  (detail::add_input(args, inputs), ...);
  auto node = std::make_shared<detail::value_node<merged_t>>(std::move(merged), std::move(inputs));
  node->backward = [tapes, m, operands = std::make_tuple(detail::kept_operand(args)...)](detail::value_node<merged_t>& self) {
    const detail::grad_t<merged_t>& g = *self.grad;
    // every place's backward at once, from its part of the output's gradient; the places
    // along an axis the output is replicated on computed one value n times, and share its
    // gradient: each takes 1/n of it (the gradients are summed below)
    const std::size_t copies = detail::replica_count(m, detail::value_of<OutLayout>());
    detail::run_on_places("parallel_do backward", m, [&](std::size_t, std::size_t k) {
      auto& tape = *(*tapes)[k];
      if (!tape.out.requires_grad()) return;
      if (copies == 1) pdo::backward(tape.out, tensor<T, rank>(g.local_shards()[k]));
      else pdo::backward(tape.out, pdo::eval(g.local_shards()[k] * (T(1) / static_cast<T>(copies))));
    });
    detail::merge_operand_gradients(m, *tapes, operands, std::index_sequence_for<Args...>{});
    for (auto& t : *tapes) t.reset();  // the places' graphs are spent
  };
  return var<merged_t>(std::move(node), true);
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_AUTOGRAD_PARALLEL_DO_HPP
#endif  // PDO_SINGLE_PDO_AUTOGRAD_HPP
// ---- pdo/comm.hpp
#ifndef PDO_SINGLE_PDO_COMM_HPP
#define PDO_SINGLE_PDO_COMM_HPP
// pdo/comm.hpp: the comm layer (communicator concept, threads and MPI backends, mesh groups).

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
// pdo/place/cpu_place.hpp: CPU places, each with its lanes, its compute lane on its own cores.


#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace pdo {

/// @brief How a CPU place is made.
struct cpu_place_options {
  bool pin = true;             ///< pin the compute lane to the place's cores (off when other places share them)
  std::size_t memory_cap = 0;  ///< bytes the place may hold (0: no cap)
  std::string name;            ///< empty: "cpu:<ordinal>"
  int process = 0;             ///< the MPI rank that owns it
};

/// @brief A CPU place: lanes that run the place's work (its compute lane on the cores it
/// was given, pinned there when no other place shares them), and a caching allocator.
class cpu_place : public detail::place_handle<cpu_place> {
 public:
  /// @brief A new place on `cores`.
  cpu_place(int ordinal, std::vector<int> cores, const cpu_place_options& options = {})
      : place_handle(std::make_shared<detail::place_state>(
            place_kind::cpu, ordinal, options.process, true, std::move(cores),
            options.name.empty() ? "cpu:" + std::to_string(ordinal) : options.name)) {
    state_->memory = std::make_unique<caching_allocator>(state_->name, options.memory_cap);
    detail::start_lanes(*state_, options.pin ? state_->cores : std::vector<int>{});
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
#include <cstdint>
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

namespace detail {

/// @brief make_mesh's check that every process made the same mesh (see
/// pdo::detail::multiprocess_agreement): each process's description of the mesh (axes,
/// extents, the places each process holds) is compared, by length and hash, then, when they
/// differ, gathered so that every process throws pdo::mismatch_error naming all of them.
inline void agree_on_mesh(const pdo::detail::mesh_state& m, const std::string& description) {
  watch& w = watch::instance();
  const MPI_Comm comm = w.agreement_comm();
  int n = 0;
  MPI_Comm_size(comm, &n);
  const std::vector<int> peers = w.others();
  const auto timeout = m.options.collective_timeout.count() > 0 ? m.options.collective_timeout : default_collective_timeout();
  const wait_label label = w.next_agreement("make_mesh's agreement on " + description);
  auto all_gather = [&](const void* mine, int count, MPI_Datatype type, void* all, const int* counts, const int* displs) {
    MPI_Request request = MPI_REQUEST_NULL;
    check(MPI_Iallgatherv(mine, count, type, all, counts, displs, type, comm, &request), "MPI_Iallgatherv");
    w.wait(
        [&] {
          int done = 0;
          check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
          return done != 0;
        },
        label, peers, timeout, true);
  };
  std::uint64_t fingerprint = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : description) fingerprint = (fingerprint ^ c) * 1099511628211ull;
  std::vector<std::uint64_t> mine{description.size(), fingerprint}, all(2 * static_cast<std::size_t>(n));
  std::vector<int> counts(static_cast<std::size_t>(n), 2), displs(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) displs[static_cast<std::size_t>(r)] = 2 * r;
  try {
    all_gather(mine.data(), 2, MPI_UINT64_T, all.data(), counts.data(), displs.data());
  } catch (const collective_timeout&) {
    abandon(std::move(mine));
    abandon(std::move(all));
    abandon(std::move(counts));
    abandon(std::move(displs));
    throw;
  }
  bool same = true;
  for (int r = 0; r < n; ++r) same = same && all[2 * r] == mine[0] && all[2 * r + 1] == mine[1];
  if (same) return;
  // they differ: every process learns every description
  std::size_t total = 0;
  for (int r = 0; r < n; ++r) {
    counts[static_cast<std::size_t>(r)] = static_cast<int>(all[2 * r]);
    displs[static_cast<std::size_t>(r)] = static_cast<int>(total);
    total += all[2 * r];
  }
  std::string texts(total, '\0');
  all_gather(description.data(), static_cast<int>(description.size()), MPI_CHAR, texts.data(), counts.data(), displs.data());
  std::vector<std::pair<std::string, std::string>> kinds;  // description, the ranks that made it
  for (int r = 0; r < n; ++r) {
    const std::string d = texts.substr(static_cast<std::size_t>(displs[static_cast<std::size_t>(r)]), all[2 * r]);
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == d; });
    if (it == kinds.end()) kinds.emplace_back(d, "rank " + std::to_string(r));
    else it->second += ", " + std::to_string(r);
  }
  std::string listing;
  for (const auto& [d, ranks] : kinds) listing += (listing.empty() ? "" : "; ") + ranks + " made " + d;
  throw mismatch_error("make_mesh: the processes made different meshes: " + listing +
                       ". Every process must make the same meshes, with the same arguments, in the same order");
}

/// @brief Throws on every process unless all passed the same `per_process` to `op`.
inline void check_same_per_process(const char* op, std::size_t per_process) {
  unsigned long long mine_count = per_process, low = 0, high = 0;
  MPI_Allreduce(&mine_count, &low, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&mine_count, &high, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  if (low != high)
    throw layout_error(std::string(op) + ": processes asked for different numbers of places (" + std::to_string(low) + " to " +
                       std::to_string(high) + "); every process must pass the same per_process");
}

/// @brief What meshes over places of several processes need, started by every process where
/// it makes such places: the watch of the waits, and make_mesh's agreement.
inline void start_watch() {
  watch::instance().start();
  pdo::detail::multiprocess_agreement() = &agree_on_mesh;
}
}  // namespace detail

/// @brief The places of every process of MPI_COMM_WORLD, `per_process` each, in rank
/// order: place `r * per_process + i` is place i of rank r, named "rank<r>/cpu:<i>".
/// This process's places are CPU places over its cores, pinned only when the launcher
/// bound the process to some of the machine's cores (else processes would pin their
/// places onto the same ones); the others stand for places of other processes. Every
/// process must call it with the same `per_process` (it starts MPI if needed).
inline std::vector<any_place> world_places(std::size_t per_process = 1, std::size_t memory_cap = 0) {
  const int me = mpi::rank(), n = mpi::size();
  detail::check_same_per_process("world_places", per_process);
  detail::start_watch();
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

#if defined(PDO_WITH_CUDA)
/// @brief GPU places of every process of MPI_COMM_WORLD, `per_process` each, in rank order
/// (place `r * per_process + i` is "rank<r>/cuda:<d>"): this process's are the GPUs
/// local_rank * per_process + i of its node (local rank: its rank among the processes on
/// the same node), modulo the GPUs it sees. A mesh over them runs its collectives on NCCL,
/// bootstrapped over MPI. Every process must call it with the same `per_process`.
inline std::vector<any_place> world_cuda_places(std::size_t per_process = 1, std::size_t memory_cap = 0) {
  const int me = mpi::rank(), n = mpi::size();
  detail::check_same_per_process("world_cuda_places", per_process);
  detail::start_watch();
  if (per_process == 0) throw layout_error("world_cuda_places: asked for 0 places per process; ask for at least one");
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, me, MPI_INFO_NULL, &node);
  int local_rank = 0;
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_free(&node);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    throw error("world_cuda_places: rank " + std::to_string(me) + " sees no GPU: " + cuda_unavailable_reason());
  // every process's device ordinals, so each can name the others' places
  std::vector<int> ordinals(per_process), all(per_process * static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < per_process; ++i)
    ordinals[i] = static_cast<int>((static_cast<std::size_t>(local_rank) * per_process + i) % static_cast<std::size_t>(devices));
  MPI_Allgather(ordinals.data(), static_cast<int>(per_process), MPI_INT, all.data(), static_cast<int>(per_process), MPI_INT, MPI_COMM_WORLD);
  std::vector<any_place> places;
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < per_process; ++i) {
      const int d = all[static_cast<std::size_t>(r) * per_process + i];
      if (r == me) {
        places.emplace_back(cuda_place(d, cuda_place_options{memory_cap, "rank" + std::to_string(r) + "/cuda:" + std::to_string(d), r}));
      } else {
        places.emplace_back(std::make_shared<pdo::detail::place_state>(place_kind::cuda, d, r, false, std::vector<int>{},
                                                                       "rank" + std::to_string(r) + "/cuda:" + std::to_string(d)));
      }
    }
  return places;
}
#endif

}  // namespace pdo::mpi
#endif  // PDO_SINGLE_PDO_COMM_MPI_COMMUNICATOR_HPP
#endif
#endif  // PDO_SINGLE_PDO_COMM_HPP
// ---- pdo/core.hpp
#ifndef PDO_SINGLE_PDO_CORE_HPP
#define PDO_SINGLE_PDO_CORE_HPP
// pdo/core.hpp: the core layer (strings, errors, shapes, element types).

#endif  // PDO_SINGLE_PDO_CORE_HPP
// ---- pdo/exec.hpp
#ifndef PDO_SINGLE_PDO_EXEC_HPP
#define PDO_SINGLE_PDO_EXEC_HPP
// pdo/exec.hpp: the execution layer: the engine, mesh-wide operations (spmd, distribute,
// redistribute, gather), evaluation (eval, eval_async, wait_all), parallel_do,
// prefetch.

// ---- pdo/exec/prefetch.hpp
#ifndef PDO_SINGLE_PDO_EXEC_PREFETCH_HPP
#define PDO_SINGLE_PDO_EXEC_PREFETCH_HPP
// pdo/exec/prefetch.hpp: prefetch, work that moves the next inputs to their places while the
// current step runs: engine tasks on the places' copy lanes, waited for when the inputs are
// needed.


#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo {

/// @brief Work queued on copy lanes that gives a `Result` (the inputs of a later step, in
/// their places' memory): `get()` waits for it and gives the result, or throws the error it
/// failed with (a pdo::error naming the op and place). Destroying a prefetched that was not
/// taken waits for its work, so the work never outlives what it reads.
template <class Result>
class prefetched {
 public:
  prefetched() = default;
  /// @brief `tasks`' work fills the result; `take()` makes it, once they have all ended.
  prefetched(std::vector<detail::task_handle> tasks, std::function<Result()> take)
      : tasks_(std::move(tasks)), take_(std::move(take)) {}
  /// @brief Takes over `other`'s work and result.
  prefetched(prefetched&&) noexcept = default;
  /// @brief Waits for this one's own work (its result is dropped), then takes over `other`'s.
  prefetched& operator=(prefetched&& other) noexcept {
    if (this != &other) {
      finish();
      tasks_ = std::move(other.tasks_);
      take_ = std::move(other.take_);
    }
    return *this;
  }
  prefetched(const prefetched&) = delete;
  prefetched& operator=(const prefetched&) = delete;
  ~prefetched() { finish(); }

  /// @brief Whether the work has ended (get() will not wait).
  [[nodiscard]] bool ready() const {
    for (const auto& t : tasks_)
      if (!t->ended.load(std::memory_order_acquire)) return false;
    return true;
  }
  /// @brief Whether it holds work whose result was not taken yet.
  [[nodiscard]] bool valid() const { return static_cast<bool>(take_); }

  /// @brief Waits for the work and gives its result (once).
  Result get() {
    if (!take_) throw error("prefetched::get: nothing to take (the result was taken, or nothing was prefetched)");
    finish_checked();
    auto take = std::move(take_);
    take_ = nullptr;
    tasks_.clear();
    return take();
  }

 private:
  void finish() noexcept {
    for (const auto& t : tasks_) t->wait_ended();
  }
  void finish_checked() {
    std::optional<detail::captured_error> first;
    for (const auto& t : tasks_) {
      detail::check_not_own_lane(*t, t->op);
      t->wait_ended();
      if (!first) first = detail::outcome(*t);
    }
    if (first) first->rethrow_with_context(std::string("prefetch: "));
  }

  std::vector<detail::task_handle> tasks_;
  std::function<Result()> take_;
};

/// @brief Runs `f()` on `where`'s copy lane while the caller goes on; get() gives what it
/// returned. For inputs made by a function of the caller's (cut, decoded, copied to a GPU).
/// `f` runs with `where` as its place: tensors it makes without naming a place live there.
template <class F>
auto prefetch(const any_place& where, F f) {
  using result_t = std::invoke_result_t<F&>;
  auto slot = std::make_shared<std::optional<result_t>>();
  detail::task_request request;
  request.home = &detail::lane_of(*where.state(), lane_kind::copy);
  request.op = "prefetch";
  request.category = "copy";
  request.uses.writes.push_back(slot.get());
  request.fn = [slot, f = std::move(f)]() mutable { slot->emplace(f()); };
  std::vector<detail::task_handle> tasks{detail::engine::instance().submit(std::move(request))};
  return prefetched<result_t>(std::move(tasks), [slot] { return std::move(**slot); });
}

/// @brief `pdo::distribute<Layout>(m, host)` done on the places' copy lanes while the caller
/// goes on: each place of this process cuts its shard into its own memory (copied up to a
/// GPU), all at once. The host tensor is moved in (pass a copy to keep yours). get() gives
/// the dtensor; every process passes the same host tensor.
template <layout_spec Layout, mesh_type Mesh, element T, std::size_t Rank>
prefetched<dtensor<T, Rank, Mesh, Layout>> prefetch(const Mesh& m, tensor<T, Rank> host) {
  static_assert(sizeof(detail::check_layout<"prefetch", Layout, Mesh, Rank>) != 0);
  detail::check_not_nested("prefetch");
  struct state {
    tensor<T, Rank> host;
    std::vector<tensor<T, Rank>> shards;
  };
  auto s = std::make_shared<state>(state{std::move(host), std::vector<tensor<T, Rank>>(m.local_places().size())});
  const bool multiprocess = m.is_multiprocess();
  auto batch = detail::submit_on_places(
      m,
      [s, m, multiprocess](std::size_t p, std::size_t k) {
        if (multiprocess) detail::check_same_host_shape(m, p, s->host.shape());
        s->shards[k] = detail::shard_of<Layout>(m, s->host, p);
      },
      detail::batch_options{"prefetch", "copy", multiprocess, false, lane_kind::copy},
      [raw = s.get()](std::size_t, std::size_t k) {
        detail::access a;
        a.writes.push_back(&raw->shards[k]);
        return a;
      });
  return prefetched<dtensor<T, Rank, Mesh, Layout>>(batch->tasks, [s, batch, m]() {
    if (const auto failure = batch->first_failure())
      failure->error.rethrow_with_context("prefetch: on place " + m.place(failure->place).name() + ": ");
    return dtensor<T, Rank, Mesh, Layout>(m, s->host.shape(), std::move(s->shards));
  });
}

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXEC_PREFETCH_HPP
// ---- pdo/exec/trace.hpp
#ifndef PDO_SINGLE_PDO_EXEC_TRACE_HPP
#define PDO_SINGLE_PDO_EXEC_TRACE_HPP
// pdo/exec/trace.hpp: pdo::trace, the timeline of everything the engine runs: every task
// with its place and lane, start and end, what it waited for (flow arrows), and the kernels,
// collectives and copies inside it; written as Chrome trace-event JSON, which Perfetto
// (ui.perfetto.dev) and chrome://tracing open.


#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief The recorder behind pdo::trace: events in the order they ended. An event's rows
/// are the recorder's own copies (by place and lane name), so a recording outlives the
/// places whose lanes, and the threads, that recorded it.
class trace_recorder final : public timeline_sink {
 public:
  static trace_recorder& instance() {
    static trace_recorder* r = new trace_recorder();  // never destroyed: lanes may record while the program exits
    return *r;
  }
  void record(timeline_event e) override {
    std::lock_guard lock(mutex_);
    e.track = own(e.track);
    if (e.queued_on != nullptr) e.queued_on = own(e.queued_on);
    events_.push_back(std::move(e));
  }
  std::vector<timeline_event> events() {
    std::lock_guard lock(mutex_);
    return events_;
  }
  void clear() {
    std::lock_guard lock(mutex_);
    events_.clear();
  }
  [[nodiscard]] timeline_clock::time_point origin() const { return origin_; }
  void restart_clock() { origin_ = timeline_clock::now(); }

 private:
  trace_recorder() = default;
  /// @brief The recorder's row named as `t` (made on first use; never freed).
  const timeline_track* own(const timeline_track* t) {
    if (t == nullptr) return nullptr;
    return &tracks_.try_emplace({t->place, t->lane}, timeline_track{t->place, t->lane}).first->second;
  }
  std::mutex mutex_;
  std::vector<timeline_event> events_;
  std::map<std::pair<std::string, std::string>, timeline_track> tracks_;
  timeline_clock::time_point origin_ = timeline_clock::now();
};

inline void append_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

}  // namespace detail

/// @brief The timeline of what pdo runs. Between start() and stop() every engine task is
/// recorded (op, category, place and lane, start and end, the tasks it waited for) with the
/// spans inside it: kernels (op, shapes and layout), collectives (kind, group, bytes), copies
/// (bytes, from and to). json() and save() give Chrome trace-event JSON: one process per place,
/// one thread row per lane, dependencies as flow arrows. Off (the default), it costs one
/// relaxed atomic load per task.
///
///     pdo::trace::start();
///     ... train a step ...
///     pdo::trace::stop();
///     pdo::trace::save("step.json");  // open in ui.perfetto.dev or chrome://tracing
class trace {
 public:
  /// @brief Starts recording (after clearing what an earlier recording left).
  static void start() {
    auto& r = detail::trace_recorder::instance();
    r.clear();
    r.restart_clock();
    detail::timeline().store(&r, std::memory_order_release);
  }
  /// @brief Stops recording; what was recorded stays until the next start().
  static void stop() { detail::timeline().store(nullptr, std::memory_order_release); }
  /// @brief Whether it records now.
  static bool recording() { return detail::timeline_on(); }
  /// @brief How many events were recorded.
  static std::size_t size() { return detail::trace_recorder::instance().events().size(); }

  /// @brief The recording as Chrome trace-event JSON.
  static std::string json() {
    auto& r = detail::trace_recorder::instance();
    const auto events = r.events();
    const auto origin = r.origin();
    // one "process" per place (the host threads together), one "thread" per lane
    std::map<std::string, int> pids;
    std::map<std::pair<std::string, std::string>, int> tids;
    auto pid_of = [&](const detail::timeline_track* t) {
      return pids.emplace(t->place, static_cast<int>(pids.size()) + 1).first->second;
    };
    auto tid_of = [&](const detail::timeline_track* t) {
      return tids.emplace(std::pair{t->place, t->lane}, static_cast<int>(tids.size()) + 1).first->second;
    };
    auto us = [&](detail::timeline_clock::time_point t) {
      return std::chrono::duration<double, std::micro>(t - origin).count();
    };
    std::map<std::uint64_t, const detail::timeline_event*> tasks;
    for (const auto& e : events)
      if (e.id != 0) tasks[e.id] = &e;

    std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
    bool first = true;
    auto begin = [&] {
      if (!first) out += ",\n";
      first = false;
    };
    char number[64];
    auto put_number = [&](const char* key, double v) {
      std::snprintf(number, sizeof number, "\"%s\":%.3f", key, v);
      out += number;
    };
    // a flow arrow `id` from `from` at `at` to the start of task `to`
    auto put_flow = [&](const char* name, const std::string& id, const detail::timeline_track* from, detail::timeline_clock::time_point at,
                        const detail::timeline_event& to) {
      for (const bool start : {true, false}) {
        begin();
        out += std::string("{\"name\":\"") + name + "\",\"cat\":\"dependency\",\"ph\":" + (start ? "\"s\"" : "\"f\",\"bp\":\"e\"") +
               ",\"id\":\"" + id + "\",";
        put_number("ts", us(start ? at : to.start));
        const detail::timeline_track* row = start ? from : to.track;
        out += ",\"pid\":" + std::to_string(pid_of(row)) + ",\"tid\":" + std::to_string(tid_of(row)) + "}";
      }
    };
    for (const auto& e : events) {
      begin();
      out += "{\"name\":";
      detail::append_json_string(out, e.name);
      out += ",\"cat\":";
      detail::append_json_string(out, e.category);
      out += e.instant ? ",\"ph\":\"i\",\"s\":\"t\"," : ",\"ph\":\"X\",";
      put_number("ts", us(e.start));
      if (!e.instant) {
        out += ',';
        put_number("dur", std::max(0.0, us(e.end) - us(e.start)));
      }
      out += ",\"pid\":" + std::to_string(pid_of(e.track)) + ",\"tid\":" + std::to_string(tid_of(e.track));
      out += ",\"args\":{\"place\":";
      detail::append_json_string(out, e.track->place);
      out += ",\"lane\":";
      detail::append_json_string(out, e.track->lane);
      if (!e.detail.empty()) {
        out += ",\"detail\":";
        detail::append_json_string(out, e.detail);
      }
      if (e.id != 0) {
        out += ",\"task\":" + std::to_string(e.id) + ",\"after\":[";
        for (std::size_t i = 0; i < e.after.size(); ++i) out += (i ? "," : "") + std::to_string(e.after[i]);
        out += "]";
        if (e.queued_on != nullptr && e.queued_at >= origin) {
          out += ",\"queued_on\":";
          detail::append_json_string(out, e.queued_on->lane);
          out += ',';
          put_number("queued_at", us(e.queued_at));
        }
      }
      out += "}}";
      // a flow arrow from where a task queued it (inside that task's span) to its start
      if (e.queued_on != nullptr && e.id != 0 && e.queued_at >= origin)
        put_flow("queues", "q" + std::to_string(e.id), e.queued_on, e.queued_at, e);
      // a flow arrow from the end of each task it waited for to its start
      for (std::uint64_t before : e.after) {
        const auto found = tasks.find(before);
        if (found == tasks.end()) continue;
        put_flow("waits for", std::to_string(before) + "." + std::to_string(e.id), found->second->track, found->second->end, e);
      }
    }
    // names of the rows
    for (const auto& [place, pid] : pids) {
      begin();
      out += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + std::to_string(pid) + ",\"args\":{\"name\":";
      detail::append_json_string(out, place);
      out += "}}";
    }
    for (const auto& [key, tid] : tids) {
      begin();
      out += "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + std::to_string(pids.at(key.first)) + ",\"tid\":" +
             std::to_string(tid) + ",\"args\":{\"name\":";
      detail::append_json_string(out, key.second);
      out += "}}";
    }
    out += "\n]}\n";
    return out;
  }

  /// @brief Writes json() to `path`; a file that cannot be written is a pdo::io_error.
  static void save(const std::string& path) {
    const std::string text = json();
    std::ofstream f(path, std::ios::binary);
    if (!f) throw io_error("pdo::trace::save: cannot open " + path + " for writing");
    f.write(text.data(), static_cast<std::streamsize>(text.size()));
    if (!f) throw io_error("pdo::trace::save: could not write " + path);
  }
};

}  // namespace pdo
#endif  // PDO_SINGLE_PDO_EXEC_TRACE_HPP
#endif  // PDO_SINGLE_PDO_EXEC_HPP
// ---- pdo/expr.hpp
#ifndef PDO_SINGLE_PDO_EXPR_HPP
#define PDO_SINGLE_PDO_EXPR_HPP
// pdo/expr.hpp: the expression layer (elementwise ops, matmul, reductions, softmax, losses, reshapes).

#endif  // PDO_SINGLE_PDO_EXPR_HPP
// ---- pdo/kernels.hpp
#ifndef PDO_SINGLE_PDO_KERNELS_HPP
#define PDO_SINGLE_PDO_KERNELS_HPP
// pdo/kernels.hpp: the kernels CPU places run (Thrust elementwise, reductions, softmax, gemm).

#endif  // PDO_SINGLE_PDO_KERNELS_HPP
// ---- pdo/layout.hpp
#ifndef PDO_SINGLE_PDO_LAYOUT_HPP
#define PDO_SINGLE_PDO_LAYOUT_HPP
// pdo/layout.hpp: the layout layer (layout types, checks, redistribution plans).

#endif  // PDO_SINGLE_PDO_LAYOUT_HPP
// ---- pdo/memory.hpp
#ifndef PDO_SINGLE_PDO_MEMORY_HPP
#define PDO_SINGLE_PDO_MEMORY_HPP
// pdo/memory.hpp: the memory layer (per-place caching allocators and their statistics).

#endif  // PDO_SINGLE_PDO_MEMORY_HPP
// ---- pdo/nn.hpp
#ifndef PDO_SINGLE_PDO_NN_HPP
#define PDO_SINGLE_PDO_NN_HPP
// pdo/nn.hpp: layers, losses, optimizers and data-parallel training.

// ---- pdo/nn/batching.hpp
#ifndef PDO_SINGLE_PDO_NN_BATCHING_HPP
#define PDO_SINGLE_PDO_NN_BATCHING_HPP
// pdo/nn/batching.hpp: cutting global batches into the rows each place trains on, in the
// place's memory (the trainers cut the next batch while the current one trains, with
// pdo::prefetch).


#include <algorithm>
#include <cstddef>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace pdo::nn {

/// @brief The rows of a global batch that one place trains on.
template <class T, std::size_t R, class Target>
struct batch_shard {
  tensor<T, R> inputs;  ///< the place's input rows, in its memory; dim 0 is the rows
  Target targets;       ///< the targets of the same rows, in the same order and memory
};

}  // namespace pdo::nn

namespace pdo::detail {

template <std::size_t R>
shape_t<R> with_rows(shape_t<R> s, std::size_t rows) {
  s[0] = rows;
  return s;
}

/// @brief Rows order[first, first + count) of the host tensor `src` (row-major, dim 0 the
/// rows), as a tensor in `where`'s memory (cut on the host, copied up to a GPU place).
template <class X>
X cut_rows(const X& src, const std::vector<std::size_t>& order, std::size_t first, std::size_t count, const any_place& where) {
  const bool gpu = where.kind() == place_kind::cuda;
  X out = gpu ? X::on_host(with_rows(src.shape(), count)) : X(with_rows(src.shape(), count), where, uninitialized);
  const std::size_t row = src.extent(0) == 0 ? 0 : src.size() / src.extent(0);
  for (std::size_t i = 0; i < count; ++i) std::copy_n(src.data() + order[first + i] * row, row, out.data() + i * row);
  return gpu ? to_place(out, where) : out;
}

/// @brief Rows [first, first + count) of `src` in order, as above.
template <class X>
X cut_rows(const X& src, std::size_t first, std::size_t count, const any_place& where) {
  std::vector<std::size_t> order(count);
  for (std::size_t i = 0; i < count; ++i) order[i] = first + i;
  return cut_rows(src, order, 0, count, where);
}

}  // namespace pdo::detail
#endif  // PDO_SINGLE_PDO_NN_BATCHING_HPP
// ---- pdo/nn/buckets.hpp
#ifndef PDO_SINGLE_PDO_NN_BUCKETS_HPP
#define PDO_SINGLE_PDO_NN_BUCKETS_HPP
// pdo/nn/buckets.hpp: gradient buckets, the one mechanism every trainer syncs replicated
// parameters' gradients with (the data-parallel trainer over "dp", the pipeline over its "dp"
// axis). The gradients of one place's parameters are grouped into buckets of about a given
// size, in the order backward completes them; a bucket whose gradients are complete is an
// engine task on the place's communication lane, which runs while backward goes on. What the
// task runs is the planner's redistribution of the gradient's layout: partial over the axis
// -> replicate (an all_reduce), or -> split over the axis (a reduce_scatter) under ZeRO-1,
// whose updated slices come back by split -> replicate (an all_gather).

// ---- pdo/nn/module.hpp
#ifndef PDO_SINGLE_PDO_NN_MODULE_HPP
#define PDO_SINGLE_PDO_NN_MODULE_HPP
// pdo/nn/module.hpp: named parameters, seeded initialisation, and the module concept.


#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace pdo::nn {

/// @brief The random source of initialisation: the same seed gives the same parameters
/// on every place and every run.
using rng = std::mt19937_64;

/// @brief One named parameter of a model, whatever its rank and kind (a local tensor, or a
/// dtensor whose shards live on the places of this process): its values and its gradient
/// as blocks of memory (one for a tensor, one per local shard for a dtensor), and the hook
/// backward calls when the gradient is complete. Copies refer to the same parameter.
template <class T>
class parameter_ref {
 public:
  /// @brief Refers to `v` (a var of a tensor or dtensor of T) under `name`; `v`'s node is shared, not copied.
  template <class V>
  parameter_ref(std::string name, var<V> v) : name_(std::move(name)), impl_(std::make_shared<holder<V>>(std::move(v))) {}

  /// @brief The parameter's name, prefixed as the model listed it ("0.weight").
  [[nodiscard]] const std::string& name() const { return name_; }
  /// @brief The values, one block per tensor or local shard.
  [[nodiscard]] std::vector<std::span<T>> value_blocks() const { return impl_->value_blocks(); }
  /// @brief Zero-filled state for each block (an optimizer's moments), each in the memory
  /// of the place that holds the block.
  [[nodiscard]] std::vector<tensor<T, 1>> zero_state() const { return impl_->zero_state(); }
  /// @brief The gradient's blocks (none when backward has given no gradient).
  [[nodiscard]] std::vector<std::span<T>> grad_blocks() const { return impl_->grad_blocks(); }
  /// @brief The place whose memory holds each block (null: host memory), for the kernels
  /// that update them.
  [[nodiscard]] std::vector<detail::place_state*> block_places() const { return impl_->block_places(); }
  /// @brief Where one of this process's blocks sits in the whole parameter: the mesh place
  /// that holds it, its offset and extents, and whether that place is the one that writes it
  /// to a checkpoint (false for a replica of a block another place writes).
  struct block_position {
    std::size_t place = 0;                  ///< the index of the holding place in the parameter's mesh (0 for a local parameter)
    std::vector<std::size_t> offset;  ///< where the block starts in the whole parameter, one index per dim
    std::vector<std::size_t> shape;   ///< the block's extents, one per dim
    bool write = true;                       ///< false for a replica along an axis the layout does not split
  };
  /// @brief One position per value block, in the order of value_blocks(); empty for a dtensor
  /// laid out with pending sums (partial), whose blocks are not parts of its value.
  [[nodiscard]] std::vector<block_position> block_positions() const { return impl_->block_positions(); }
  /// @brief The places of a dtensor parameter's mesh (every process's, in mesh order); empty
  /// for a local parameter.
  [[nodiscard]] std::vector<any_place> mesh_places() const { return impl_->mesh_places(); }
  /// @brief Whether the parameter is a dtensor laid out with pending sums (partial).
  [[nodiscard]] bool partial() const { return impl_->partial(); }
  /// @brief The values of a local parameter (one block).
  [[nodiscard]] std::span<T> value() const { return single(impl_->value_blocks(), "value"); }
  /// @brief The gradient of a local parameter; empty when backward has given none.
  [[nodiscard]] std::span<T> grad() const {
    const auto blocks = impl_->grad_blocks();
    return blocks.empty() ? std::span<T>() : single(blocks, "grad");
  }
  /// @brief The elements of this process's blocks.
  [[nodiscard]] std::size_t size() const {
    std::size_t n = 0;
    for (const auto& b : impl_->value_blocks()) n += b.size();
    return n;
  }
  /// @brief The bytes of this process's blocks: size() * sizeof(T).
  [[nodiscard]] std::size_t bytes() const { return size() * sizeof(T); }
  /// @brief A local parameter's gradient, zero-filled first if there is none (a place with
  /// no samples still takes part in the gradient all_reduce).
  [[nodiscard]] std::span<T> grad_or_zeros() const { return impl_->grad_or_zeros(); }
  /// @brief The sum of the squares of the gradient's elements, over the whole parameter:
  /// a dtensor's over all its shards on every process, each element counted once whatever
  /// the layout (replicated blocks are not counted twice). 0 without a gradient. For a
  /// dtensor this is a collective: every process calls it.
  [[nodiscard]] double grad_squared_norm() const { return impl_->grad_squared_norm(); }
  /// @brief Drops the parameter's gradient, so the next backward starts from none (see var::zero_grad).
  void zero_grad() const { impl_->zero_grad(); }
  /// @brief Has backward call `f()` once this parameter's gradient is complete; replaces any earlier hook.
  void on_gradient(std::function<void()> f) const { impl_->on_gradient(std::move(f)); }
  /// @brief "f32[16, 8]" for a local parameter, "f32[16, 8]{split<tp>, replicate} on mesh(tp=2)" for a dtensor.
  [[nodiscard]] std::string shape_text() const { return impl_->shape_text(); }
  /// @brief The parameter's rank.
  [[nodiscard]] std::size_t rank() const { return impl_->extents().size(); }
  /// @brief The parameter's (global) extents.
  [[nodiscard]] std::vector<std::size_t> extents() const { return impl_->extents(); }
  /// @brief The parameter's (global) shape as a shape_t<R>; a pdo::shape_error when its rank is not R.
  template <std::size_t R>
  [[nodiscard]] shape_t<R> shape() const {
    const auto e = impl_->extents();
    if (e.size() != R)
      throw shape_error("parameter " + name_ + ": " + shape_text() + " has rank " + std::to_string(e.size()) + ", not " + std::to_string(R));
    shape_t<R> s{};
    std::copy(e.begin(), e.end(), s.begin());
    return s;
  }
  /// @brief Sets the parameter's (global) value to `values`, a host tensor of exactly its
  /// shape (a dtensor parameter takes each local shard's part). Any other shape is a
  /// pdo::shape_error naming the parameter and both shapes, before anything is written.
  template <std::size_t R>
  void assign(const tensor<T, R>& values) const {
    impl_->assign(values.data(), std::vector<std::size_t>(values.shape().begin(), values.shape().end()), name_);
  }
  /// @brief Sets the parameter's (global) value from its elements in row-major order, in host
  /// memory (as many as size_global()).
  void assign_flat(const T* values) const { impl_->assign(values, impl_->extents(), name_); }
  /// @brief The number of elements of the parameter's global value.
  [[nodiscard]] std::size_t size_global() const {
    std::size_t n = 1;
    for (auto e : impl_->extents()) n *= e;
    return n;
  }
  /// @brief The parameter's global value, row-major, in host memory (a dtensor parameter is
  /// gathered: every process of its mesh calls this together).
  [[nodiscard]] tensor<T, 1> global_values() const { return gather_state(impl_->value_tensors()); }
  /// @brief The global value, row-major in host memory, of state laid out as the parameter:
  /// one block per local block (an optimizer's moments, from zero_state()). A dtensor
  /// parameter's blocks are gathered by its layout (every process of its mesh calls this).
  [[nodiscard]] tensor<T, 1> gather_state(const std::vector<tensor<T, 1>>& blocks) const { return impl_->gather_state(blocks, name_); }
  /// @brief The inverse: each local block of `blocks` set to its part of `global` (host
  /// memory, row-major, the parameter's global size).
  void scatter_state(const T* global, std::vector<tensor<T, 1>>& blocks) const { impl_->scatter_state(global, blocks, name_); }

 private:
  std::span<T> single(const std::vector<std::span<T>>& blocks, const char* what) const {
    if (blocks.size() != 1)
      throw layout_error("parameter " + name_ + ": " + what + "(): the parameter has " + std::to_string(blocks.size()) +
                         " local blocks; use " + what + "_blocks()");
    return blocks[0];
  }
  struct base {
    virtual ~base() = default;
    virtual std::vector<std::span<T>> value_blocks() = 0;
    virtual std::vector<std::span<T>> grad_blocks() = 0;
    virtual std::vector<detail::place_state*> block_places() = 0;
    virtual std::vector<block_position> block_positions() = 0;
    virtual std::vector<any_place> mesh_places() = 0;
    virtual bool partial() = 0;
    virtual std::vector<tensor<T, 1>> zero_state() = 0;
    virtual std::span<T> grad_or_zeros() = 0;
    virtual double grad_squared_norm() = 0;
    virtual void zero_grad() = 0;
    virtual void on_gradient(std::function<void()> f) = 0;
    virtual std::string shape_text() = 0;
    virtual std::vector<std::size_t> extents() = 0;
    virtual void assign(const T* values, const std::vector<std::size_t>& shape, const std::string& name) = 0;
    virtual std::vector<tensor<T, 1>> value_tensors() = 0;
    virtual tensor<T, 1> gather_state(const std::vector<tensor<T, 1>>& blocks, const std::string& name) = 0;
    virtual void scatter_state(const T* global, std::vector<tensor<T, 1>>& blocks, const std::string& name) = 0;
  };
  template <class V>
  struct holder final : base {
    explicit holder(var<V> x) : v(std::move(x)) {}
    var<V> v;
    template <class X>
    static std::vector<std::span<T>> blocks_of(X& value) {
      if constexpr (var<V>::distributed) {
        std::vector<std::span<T>> out;
        for (auto& shard : value.local_shards()) out.push_back(shard.span());
        return out;
      } else {
        return {value.span()};
      }
    }
    std::vector<std::span<T>> value_blocks() override { return blocks_of(v.value()); }
    std::vector<detail::place_state*> block_places() override {
      if constexpr (var<V>::distributed) {
        std::vector<detail::place_state*> out;
        for (const auto& shard : v.value().local_shards()) out.push_back(shard.where());
        return out;
      } else {
        return {v.value().where()};
      }
    }
    std::vector<block_position> block_positions() override {
      std::vector<block_position> out;
      if constexpr (var<V>::distributed) {
        const auto& x = v.value();
        constexpr detail::layout_value layout = V::layout_value;
        if (layout.npartial != 0) return out;
        for (std::size_t p : x.mesh().local_places()) {
          const auto offset = x.local_offset(p), shape = x.local_shape(p);
          out.push_back({p, {offset.begin(), offset.end()}, {shape.begin(), shape.end()}, detail::writes_block(x.mesh(), layout, p)});
        }
      } else {
        out.push_back({0, std::vector<std::size_t>(var<V>::rank, 0), extents(), true});
      }
      return out;
    }
    std::vector<any_place> mesh_places() override {
      if constexpr (var<V>::distributed) return v.value().mesh().places();
      else return {};
    }
    bool partial() override {
      if constexpr (var<V>::distributed) return V::layout_value.npartial != 0;
      else return false;
    }
    std::vector<tensor<T, 1>> zero_state() override {
      std::vector<tensor<T, 1>> out;
      if constexpr (var<V>::distributed) {
        for (const auto& shard : v.value().local_shards()) out.push_back(shard.template zeros_alike<T, 1>(shape_t<1>{shard.size()}));
      } else {
        out.push_back(v.value().template zeros_alike<T, 1>(shape_t<1>{v.value().size()}));
      }
      return out;
    }
    std::vector<std::span<T>> grad_blocks() override {
      return v.has_grad() ? blocks_of(v.grad()) : std::vector<std::span<T>>{};
    }
    std::span<T> grad_or_zeros() override {
      if constexpr (var<V>::distributed) {
        throw layout_error("parameter: grad_or_zeros() is for local parameters; " + shape_text() + " is a dtensor");
      } else {
        if (!v.has_grad()) v.node()->grad.emplace(v.shape());
        return v.grad().span();
      }
    }
    double grad_squared_norm() override {
      if (!v.has_grad()) return 0;
      const auto& g = v.grad();
      return static_cast<double>(detail::scalar_of(pdo::eval(pdo::sum(g * g))));
    }
    void zero_grad() override { v.zero_grad(); }
    void on_gradient(std::function<void()> f) override { v.on_gradient(std::move(f)); }
    std::string shape_text() override {
      if constexpr (var<V>::distributed) return v.value().describe();
      else return describe(v.value());
    }
    std::vector<std::size_t> extents() override { return {v.shape().begin(), v.shape().end()}; }
    /// @brief The values as blocks of state (copies), for gather_state.
    std::vector<tensor<T, 1>> value_tensors() override {
      std::vector<tensor<T, 1>> out;
      auto flat = [](const auto& t) {
        tensor<T, 1> b = t.template zeros_alike<T, 1>(shape_t<1>{t.size()});
        detail::copy_bytes(b.where(), b.data(), t.where(), t.data(), t.bytes());
        return b;
      };
      if constexpr (var<V>::distributed) {
        for (const auto& shard : v.value().local_shards()) out.push_back(flat(shard));
      } else {
        out.push_back(flat(v.value()));
      }
      return out;
    }
    void check_blocks(const std::vector<tensor<T, 1>>& blocks, const std::string& name) {
      const auto values = value_blocks();
      bool fits = blocks.size() == values.size();
      for (std::size_t k = 0; fits && k < blocks.size(); ++k) fits = blocks[k].size() == values[k].size();
      if (!fits)
        throw shape_error("parameter " + name + ": " + shape_text() + ": " + std::to_string(blocks.size()) +
                          " blocks of state given, which are not laid out as its " + std::to_string(values.size()) + " local blocks");
    }
    tensor<T, 1> gather_state(const std::vector<tensor<T, 1>>& blocks, const std::string& name) override {
      check_blocks(blocks, name);
      auto flat = tensor<T, 1>::on_host({detail::volume(v.shape())});
      if constexpr (var<V>::distributed) {
        const auto& x = v.value();
        std::vector<tensor<T, var<V>::rank>> shards;
        for (std::size_t k = 0; k < blocks.size(); ++k) {
          auto& shard = shards.emplace_back(x.local_shards()[k].template zeros_alike<T, var<V>::rank>(x.local_shards()[k].shape()));
          detail::copy_bytes(shard.where(), shard.data(), blocks[k].where(), blocks[k].data(), blocks[k].bytes());
        }
        const V state(x.mesh(), x.shape(), std::move(shards));
        const auto whole = pdo::gather(state);
        detail::copy_elements(flat.data(), whole.data(), whole.size());
      } else {
        detail::copy_bytes(nullptr, flat.data(), blocks[0].where(), blocks[0].data(), blocks[0].bytes());
      }
      return flat;
    }
    void scatter_state(const T* global, std::vector<tensor<T, 1>>& blocks, const std::string& name) override {
      check_blocks(blocks, name);
      if constexpr (var<V>::distributed) {
        using L = typename V::layout_type;
        auto host = tensor<T, var<V>::rank>::on_host(v.shape());
        detail::copy_elements(host.data(), global, host.size());
        const auto cut = pdo::distribute<L>(v.value().mesh(), host);
        for (std::size_t k = 0; k < blocks.size(); ++k)
          detail::copy_bytes(blocks[k].where(), blocks[k].data(), cut.local_shards()[k].where(), cut.local_shards()[k].data(), blocks[k].bytes());
      } else {
        detail::copy_bytes(blocks[0].where(), blocks[0].data(), nullptr, global, blocks[0].bytes());
      }
    }
    void assign(const T* values, const std::vector<std::size_t>& shape, const std::string& name) override {
      constexpr std::size_t r = var<V>::rank;
      if (shape != extents()) {
        const bool transposed = r == 2 && shape.size() == 2 && shape[0] == v.shape()[1] && shape[1] == v.shape()[0];
        throw shape_error("parameter " + name + ": " + shape_text() + " cannot take values of shape " + detail::format_extents(shape) +
                          (transposed ? ", its transpose (a PyTorch nn.Linear weight is [out, in], a pdo::nn::linear weight "
                                        "[in, out]: assign the transpose)"
                                      : ""));
      }
      shape_t<r> s{};
      std::copy(shape.begin(), shape.end(), s.begin());
      auto host = tensor<T, r>::on_host(s);
      detail::copy_elements(host.data(), values, host.size());
      if constexpr (var<V>::distributed) {
        using L = typename V::layout_type;
        const auto cut = pdo::distribute<L>(v.value().mesh(), host);
        for (auto&& [from, to] : detail::views::zip(cut.local_shards(), v.value().local_shards())) pdo::copy(from, to);
      } else {
        pdo::copy(host, v.value());
      }
    }
  };
  std::string name_;
  std::shared_ptr<base> impl_;
};

/// @brief A layer or model: callable on a var, listing its parameters with names.
template <class M, class T>
concept module = requires(const M& m) {
  { m.parameters(std::string()) } -> std::same_as<std::vector<parameter_ref<T>>>;
};

namespace init {

/// @brief A tensor of `shape` drawn uniformly from [-bound, bound), in the memory of the place
/// running the calling thread (drawn on the host, then copied up to a GPU place).
template <class T, std::size_t R>
tensor<T, R> uniform(const shape_t<R>& shape, T bound, rng& gen) {
  detail::place_state* const here = detail::current_place();
  const bool gpu = detail::on_gpu(here);
  tensor<T, R> t = gpu ? tensor<T, R>::on_host(shape) : tensor<T, R>(shape, detail::uninitialized);
  std::uniform_real_distribution<double> dist(-static_cast<double>(bound), static_cast<double>(bound));
  for (auto& x : t) x = static_cast<T>(dist(gen));
  if (gpu) return to_place(t, any_place(here->shared_from_this()));
  return t;
}

/// @brief PyTorch's default for linear and conv layers: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
template <class T, std::size_t R>
tensor<T, R> fan_in_uniform(const shape_t<R>& shape, std::size_t fan_in, rng& gen) {
  return uniform<T>(shape, static_cast<T>(1.0 / std::sqrt(static_cast<double>(fan_in == 0 ? 1 : fan_in))), gen);
}

}  // namespace init

}  // namespace pdo::nn
#endif  // PDO_SINGLE_PDO_NN_MODULE_HPP

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pdo::nn {

/// @brief A span of one step on one place, in microseconds from the step's start.
struct step_event {
  std::size_t place = 0;  ///< the place's index in the mesh
  std::string what;  ///< "forward", "backward", "all_reduce" (or "reduce_scatter", "all_gather" under ZeRO-1), "optimizer"
  std::size_t bucket = 0;  ///< the bucket of a collective (0 for the other events)
  /// @brief When the span began, in microseconds from the step's start.
  double start_us = 0, end_us = 0;
  /// @var end_us
  /// @brief When the span ended, in microseconds from the step's start.

  /// @brief For a bucket's collective: when backward queued it on the communication lane
  /// (start_us is when that lane began it). Otherwise start_us.
  double queued_us = 0;
};

/// @brief How gradients are bucketed.
struct bucket_options {
  /// @brief Gradients are synced in buckets of about this many bytes (at least one
  /// parameter each), in the order backward completes them (PyTorch DDP's default: 25 MiB);
  /// a parameter of half this or more is synced alone, in place (without ZeRO-1).
  std::size_t bucket_bytes = std::size_t{25} << 20;
  /// @brief Start a bucket's collective as soon as its last gradient is ready, while
  /// backward goes on; false: all buckets after backward (for comparison).
  bool overlap = true;
  /// @brief ZeRO stage 1: each bucket is reduce_scattered, each place keeps the sum of its
  /// slice, its optimizer updates that slice, and the slices are all_gathered back.
  bool zero1 = false;
};

/// @brief The gradients of one place's replicated parameters, synced over mesh axis `Axis`
/// in buckets. Each step: begin_step() (before backward), arm() (before the backward whose
/// gradients are the step's last contributions: they fire the buckets), finish() (after it:
/// the remaining buckets, then waits for all); under ZeRO-1 the optimizer steps slices()
/// and gather_slices() brings the updated values back.
template <class T, class Mesh, fixed_string Axis>
class gradient_buckets {
 public:
  /// @brief The index of `Axis` among the mesh's axes.
  static constexpr std::size_t axis = Mesh::axis_index(Axis);
  static_assert(axis < Mesh::ndim, "pdo: gradient_buckets: the mesh has no such axis");

  /// @brief A bucket's layouts as the planner sees them (flat): the gradient, a partial sum
  /// over the axis; replicated; sliced over the axis. (As values: nvcc's front end loses
  /// the template parameter object of a partial<"axis"> type first named here.)
  static constexpr detail::layout_value gradient_layout = [] {
    detail::layout_value v;
    v.rank = 1;
    v.add_partial(std::string_view(Axis));
    return v;
  }();
  /// @brief A bucket replicated: every place holds the whole sum (after the all_reduce).
  static constexpr detail::layout_value replicated = [] {
    detail::layout_value v;
    v.rank = 1;
    return v;
  }();
  /// @brief A bucket sliced over the axis: each place holds the sum of its chunk (ZeRO-1, after the reduce_scatter).
  static constexpr detail::layout_value sliced = [] {
    detail::layout_value v;
    v.rank = 1;
    v.dim_axis[0] = std::string_view(Axis);
    return v;
  }();
  /// @brief The planner's plan from gradient_layout to replicated: one all_reduce (checked below).
  static constexpr redistribute_plan sync_plan = detail::plan_redistribute(gradient_layout, replicated);
  /// @brief The planner's plan from gradient_layout to sliced (ZeRO-1): one reduce_scatter.
  static constexpr redistribute_plan scatter_plan = detail::plan_redistribute(gradient_layout, sliced);
  /// @brief The planner's plan from sliced to replicated (ZeRO-1's updated slices): one all_gather.
  static constexpr redistribute_plan gather_plan = detail::plan_redistribute(sliced, replicated);
  static_assert(sync_plan.size == 1 && sync_plan.steps[0].kind == step_kind::all_reduce,
                "pdo: gradient_buckets: the planner should sync a partial gradient with one all_reduce");
  static_assert(scatter_plan.size == 1 && scatter_plan.steps[0].kind == step_kind::reduce_scatter,
                "pdo: gradient_buckets: the planner should shard a partial gradient with one reduce_scatter");
  static_assert(gather_plan.size == 1 && gather_plan.steps[0].kind == step_kind::all_gather,
                "pdo: gradient_buckets: the planner should gather slices with one all_gather");

  /// @brief Groups `params`, the parameters of mesh place `place`, into buckets, last parameter first (the
  /// order backward completes them); under ZeRO-1 also cuts this place's slice of each bucket.
  gradient_buckets(const Mesh& m, std::size_t place, std::vector<parameter_ref<T>> params, bucket_options o)
      : mesh_(m), place_(place), params_(std::move(params)), options_(o) {
    const std::size_t parts = m.extent(axis), me = m.coord(place, axis);
    where_ = m.place(place);
    bucket_of_.assign(params_.size(), 0);
    // backward completes the last layers first: buckets follow the parameters in reverse
    // a parameter of half a bucket or more gets a bucket of its own, synced in place: packing
    // it would copy it in and out for no saving in collectives (and the next one starts anew)
    const auto big = [&](std::size_t j) { return 2 * params_[j].bytes() >= o.bucket_bytes && !o.zero1; };
    for (std::size_t j = params_.size(); j-- > 0;) {
      if (buckets_.empty() || buckets_.back().elements * sizeof(T) >= o.bucket_bytes || big(j) || big(buckets_.back().params.back()))
        buckets_.emplace_back();
      buckets_.back().params.push_back(j);
      buckets_.back().elements += params_[j].size();
      bucket_of_[j] = buckets_.size() - 1;
    }
    for (auto& b : buckets_) {
      if (b.params.size() > 1 || o.zero1) b.flat = tensor<T, 1>(shape_t<1>{b.elements}, where_, pdo::detail::uninitialized);
      if (!o.zero1) continue;
      pack(b, /*values=*/true);
      b.slice_offset = pdo::detail::chunk_offset(b.elements, parts, me);
      tensor<T, 1> mine(shape_t<1>{pdo::detail::chunk_size(b.elements, parts, me)}, where_, pdo::detail::uninitialized);
      pdo::detail::copy_bytes(mine.where(), mine.data(), b.flat.where(), b.flat.data() + b.slice_offset, mine.bytes());
      b.slice = parameter(std::move(mine));
    }
  }
  gradient_buckets(const gradient_buckets&) = delete;
  gradient_buckets& operator=(const gradient_buckets&) = delete;
  ~gradient_buckets() { wait_launched(); }

  /// @brief Before a step's backward: no gradients, no bucket launched; times from now.
  void begin_step() {
    wait_launched();
    start_ = clock::now();
    events_.clear();
    launched_ = 0;
    finished_.store(0);
    failures_.clear();
    for (auto& b : buckets_) {
      b.waiting = b.params.size();
      b.ready = false;
      if (options_.zero1) b.slice.zero_grad();
    }
    for (std::size_t j = 0; j < params_.size(); ++j) {
      params_[j].zero_grad();
      params_[j].on_gradient(nullptr);
    }
  }

  /// @brief The next backward completes the step's gradients: each parameter's last
  /// contribution counts toward its bucket, and a complete bucket starts its collective.
  void arm() {
    for (std::size_t j = 0; j < params_.size(); ++j) {
      params_[j].on_gradient([this, j] {
        if (pdo::detail::timeline_on())
          pdo::detail::timeline_instant("gradient", "gradient " + params_[j].name(), [&] { return "bucket " + std::to_string(bucket_of_[j]); });
        auto& b = buckets_[bucket_of_[j]];
        if (--b.waiting == 0) b.ready = true;
        if (options_.overlap) launch_ready();
      });
    }
  }

  /// @brief After the step's backward: the buckets not launched yet (parameters without a
  /// gradient send zeros), then waits for every bucket and unpacks the packed ones. Throws
  /// the first failure of a bucket's collective.
  void finish() {
    for (std::size_t j = 0; j < params_.size(); ++j) params_[j].on_gradient(nullptr);
    for (auto& b : buckets_) b.ready = true;
    launch_ready();
    wait_launched();
    if (!failures_.empty()) failures_.front().rethrow_with_context("gradient " + std::string(step_name(step().kind)) + ": ");
    if (options_.zero1) return;
    for (auto& b : buckets_)
      if (b.params.size() > 1) unpack(b, /*values=*/false);
  }

  /// @brief After a step that failed on this place: waits for the buckets already queued
  /// (every place queues them in the same order, so they complete, or are aborted with the
  /// step), queues no more.
  void abandon() {
    for (std::size_t j = 0; j < params_.size(); ++j) params_[j].on_gradient(nullptr);
    wait_launched();
  }

  /// @brief ZeRO-1: this place's slice of each bucket, the parameters its optimizer updates.
  [[nodiscard]] std::vector<parameter_ref<T>> slices() const {
    std::vector<parameter_ref<T>> out;
    for (std::size_t b = 0; b < buckets_.size(); ++b) out.emplace_back("bucket" + std::to_string(b) + ".slice", buckets_[b].slice);
    return out;
  }

  /// @brief ZeRO-1: every place's updated slice, gathered into this place's parameters.
  void gather_slices() {
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      auto& bk = buckets_[b];
      const double from = since_start();
      pdo::detail::apply_flat_step<step_kind::all_gather>(gather_plan.steps[0], mesh_, place_, bk.slice.value().span(), bk.flat.span());
      unpack(bk, /*values=*/true);
      record("all_gather", b, from, since_start());
    }
  }

  /// @brief ZeRO-1: a run of parameter `param`'s elements (row-major) that this place's slice of
  /// bucket `bucket` holds: elements [first, first + count) of the parameter, at `at` in the slice.
  struct slice_run {
    std::size_t param = 0;   ///< index of the parameter
    std::size_t bucket = 0;  ///< index of the bucket (and of its slice among slices())
    std::size_t first = 0;   ///< the run's first element in the parameter
    std::size_t count = 0;   ///< the run's length
    std::size_t at = 0;      ///< where the run starts in the slice
  };
  /// @brief ZeRO-1: the runs of every parameter that this place's slices hold, bucket by bucket
  /// (a parameter lies in one bucket, so a place holds at most one run of it).
  [[nodiscard]] std::vector<slice_run> slice_runs() const {
    std::vector<slice_run> out;
    if (!options_.zero1) return out;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      const bucket& bk = buckets_[b];
      const std::size_t begin = bk.slice_offset, end = begin + bk.slice.shape()[0];
      std::size_t at = 0;
      for (std::size_t j : bk.params) {
        const std::size_t n = params_[j].size(), lo = std::max(at, begin), hi = std::min(at + n, end);
        if (lo < hi) out.push_back({j, b, lo - at, hi - lo, lo - begin});
        at += n;
      }
    }
    return out;
  }
  /// @brief ZeRO-1: this place's slice of parameter `param`'s bucket taken again from the
  /// parameters' values (after they were set from outside, as a checkpoint's load does).
  void reslice(std::size_t param) {
    if (!options_.zero1) return;
    bucket& bk = buckets_[bucket_of_[param]];
    pack(bk, /*values=*/true);
    const std::span<T> mine = bk.slice.value().span();
    pdo::detail::copy_bytes(bk.slice.value().where(), mine.data(), bk.flat.where(), bk.flat.data() + bk.slice_offset, mine.size_bytes());
  }

  /// @brief The parameters of each bucket, by index.
  [[nodiscard]] std::vector<std::vector<std::size_t>> members() const {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : buckets_) out.push_back(b.params);
    return out;
  }
  /// @brief The number of gradient elements in bucket `b`.
  [[nodiscard]] std::size_t elements(std::size_t b) const { return buckets_[b].elements; }
  /// @brief The number of buckets.
  [[nodiscard]] std::size_t size() const { return buckets_.size(); }
  /// @brief The optimizer state this place keeps: all the elements, or under ZeRO-1 its slices.
  [[nodiscard]] std::size_t optimizer_state_elements() const {
    std::size_t n = 0;
    for (const auto& b : buckets_) n += options_.zero1 ? b.slice.shape()[0] : b.elements;
    return n;
  }
  /// @brief The redistribution step each bucket runs.
  [[nodiscard]] static constexpr const redistribute_step& step_of(bool zero1) {
    return zero1 ? scatter_plan.steps[0] : sync_plan.steps[0];
  }
  /// @brief The redistribution step this place's buckets run: reduce_scatter under ZeRO-1, else all_reduce.
  [[nodiscard]] const redistribute_step& step() const { return step_of(options_.zero1); }

  /// @brief Microseconds since begin_step().
  [[nodiscard]] double since_start() const { return std::chrono::duration<double, std::micro>(clock::now() - start_).count(); }
  /// @brief Adds an event of this place's step (the trainer's forward, backward, optimizer).
  void record(std::string what, std::size_t b, double from, double to, double queued = -1) {
    std::lock_guard lock(events_mutex_);
    events_.push_back({place_, std::move(what), b, from, to, queued < 0 ? from : queued});
  }
  /// @brief The events recorded since begin_step(), in the order recorded.
  [[nodiscard]] std::vector<step_event> events() const {
    std::lock_guard lock(events_mutex_);
    return events_;
  }

 private:
  using clock = std::chrono::steady_clock;

  struct bucket {
    std::vector<std::size_t> params;  ///< indices into params_
    std::size_t elements = 0;
    tensor<T, 1> flat;        ///< the gradients packed (buckets of several parameters, and all under ZeRO-1); under
                              ///< ZeRO-1 also where the updated slices are gathered
    var<tensor<T, 1>> slice;  ///< ZeRO-1: this place's slice of the parameters, which its optimizer updates
    std::size_t slice_offset = 0;
    std::size_t waiting = 0;  ///< gradients not yet complete in this step
    bool ready = false;
  };

  /// @brief The gradients (or, with `values`, the values) of b's parameters into b.flat.
  void pack(bucket& b, bool values) {
    std::size_t at = 0;
    for (std::size_t j : b.params) {
      const std::span<T> from = values ? params_[j].value() : params_[j].grad_or_zeros();
      pdo::detail::copy_bytes(b.flat.where(), b.flat.data() + at, where_.state().get(), from.data(), from.size_bytes());
      at += from.size();
    }
  }
  /// @brief b.flat back into its parameters' gradients (or values).
  void unpack(bucket& b, bool values) {
    std::size_t at = 0;
    for (std::size_t j : b.params) {
      const std::span<T> to = values ? params_[j].value() : params_[j].grad_or_zeros();
      pdo::detail::copy_bytes(where_.state().get(), to.data(), b.flat.where(), b.flat.data() + at, to.size_bytes());
      at += to.size();
    }
  }

  /// @brief Queues bucket `b`'s collective on the place's communication lane: a bucket of one
  /// parameter in place, a bucket of several packed into one buffer.
  void launch(std::size_t b) {
    auto& bk = buckets_[b];
    std::span<T> data = bk.flat.span();
    if (bk.params.size() == 1 && !options_.zero1) {
      data = params_[bk.params[0]].grad_or_zeros();
    } else {
      pack(bk, /*values=*/false);
      // under ZeRO-1 the packed copy is all that is reduced, and the step gathers values,
      // not gradients: the parameter's gradient is freed while backward goes on
      if (options_.zero1)
        for (std::size_t j : bk.params) params_[j].zero_grad();
    }
    ++launched_;
    if (options_.zero1) bk.slice.node()->grad.emplace(shape_t<1>{bk.slice.shape()[0]}, where_);
    const std::span<T> slice_grad = options_.zero1 ? bk.slice.grad().span() : std::span<T>();
    const double queued = since_start();
    pdo::detail::task_request request;
    request.home = &pdo::detail::lane_of(*where_.state(), lane_kind::communication);
    request.op = options_.zero1 ? "bucket reduce_scatter" : "bucket all_reduce";
    request.category = "collective";
    request.uses.reads.push_back(data.data());
    request.uses.writes.push_back(options_.zero1 ? static_cast<const void*>(slice_grad.data()) : data.data());
    if (pdo::detail::timeline_on())
      request.detail = "bucket " + std::to_string(b) + ": " + std::to_string(data.size_bytes()) + " bytes over \"" +
                       std::string(std::string_view(Axis)) + "\" (" + std::to_string(bk.params.size()) + " parameters)";
    request.fn = [this, data, slice_grad, b, queued] {
      const double from = since_start();
      try {
        if (options_.zero1) pdo::detail::apply_flat_step<step_kind::reduce_scatter>(scatter_plan.steps[0], mesh_, place_, data, slice_grad);
        else pdo::detail::apply_flat_step<step_kind::all_reduce>(sync_plan.steps[0], mesh_, place_, data);
      } catch (...) {
        std::lock_guard lock(events_mutex_);
        failures_.push_back(pdo::detail::captured_error::current());
      }
      record(options_.zero1 ? "reduce_scatter" : "all_reduce", b, from, since_start(), queued);
      finished_.fetch_add(1, std::memory_order_acq_rel);
      finished_.notify_all();
    };
    pdo::detail::engine::instance().submit(std::move(request));
  }
  /// @brief Launches the ready buckets, in bucket order (every place syncs them in the same order).
  void launch_ready() {
    while (launched_ < buckets_.size() && buckets_[launched_].ready) launch(launched_);
  }
  void wait_launched() {
    for (std::size_t f = finished_.load(std::memory_order_acquire); f < launched_; f = finished_.load(std::memory_order_acquire))
      finished_.wait(f, std::memory_order_acquire);
  }

  Mesh mesh_;
  std::size_t place_;
  any_place where_ = any_place(std::shared_ptr<pdo::detail::place_state>());
  std::vector<parameter_ref<T>> params_;
  bucket_options options_;
  std::vector<bucket> buckets_;
  std::vector<std::size_t> bucket_of_;  ///< per parameter
  std::size_t launched_ = 0;            ///< buckets queued this step
  std::atomic<std::size_t> finished_{0};
  mutable std::mutex events_mutex_;
  std::vector<step_event> events_;
  std::vector<pdo::detail::captured_error> failures_;
  clock::time_point start_ = clock::now();
};

}  // namespace pdo::nn
#endif  // PDO_SINGLE_PDO_NN_BUCKETS_HPP
// ---- pdo/nn/data_parallel.hpp
#ifndef PDO_SINGLE_PDO_NN_DATA_PARALLEL_HPP
#define PDO_SINGLE_PDO_NN_DATA_PARALLEL_HPP
// pdo/nn/data_parallel.hpp: data-parallel training: a replica of the model on every place
// (CPU or GPU), gradients synced in buckets that overlap backward (pdo/nn/buckets.hpp), the
// optimizer on every place, the next batch cut while the current one trains
// (pdo/nn/batching.hpp): all engine tasks on the places' lanes.

// ---- pdo/nn/layers.hpp
#ifndef PDO_SINGLE_PDO_NN_LAYERS_HPP
#define PDO_SINGLE_PDO_NN_LAYERS_HPP
// pdo/nn/layers.hpp: linear, conv2d, pooling, flatten, activations and sequential.
//
// Layers act on pdo::var values. linear, the pools and the activations take local tensors
// and dtensors alike; conv2d takes local images [N, C, H, W] (each place's shard under data
// parallelism; pdo::conv2d itself takes dtensors too).


#include <cstddef>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace pdo::detail {

/// @brief A linear layer's weight [in, out] and bias [out] agree (`out` = bias's length).
PDO_NOINLINE inline void check_linear_shapes(std::span<const std::size_t> weight, std::size_t bias) {
  if (weight.size() == 2 && weight[1] == bias) return;
  throw shape_error("linear: weight " + format_extent_list(weight) + " and bias [" + std::to_string(bias) +
                    "]: the weight must be [in, out] and the bias [out]");
}

/// @brief The input x [..., in] of a linear layer of weight [in, out] has `in` features.
PDO_NOINLINE inline void check_linear_input(std::span<const std::size_t> weight, std::span<const std::size_t> x) {
  if (!x.empty() && x.back() == weight[0]) return;
  throw shape_error("linear: input " + format_extent_list(x) + " for a layer of " + std::to_string(weight[0]) + " inputs and " +
                    std::to_string(weight[1]) + " outputs (weight " + format_extent_list(weight) +
                    "): the input's last dim must be " + std::to_string(weight[0]));
}

}  // namespace pdo::detail

namespace pdo::nn {

/// @brief y = x W + b, with W [in, out] and b [out]; x [..., in]. The parameters are local
/// tensors, or dtensors with layouts (see tensor_parallel): the same layer, planned.
///
/// Parameters: "weight" [in, out] — the transpose of PyTorch's nn.Linear weight, which is
/// [out, in] (parameter_ref::assign names the mistake) — and "bias" [out]. Initialised as
/// PyTorch's: U(-1/√in, 1/√in).
template <class T, class W = tensor<T, 2>, class B = tensor<T, 1>>
class linear {
 public:
  /// @brief Local parameters weight [in, out] and bias [out], drawn from U(-1/√in, 1/√in) with `gen`, in the
  /// memory of the place running the calling thread.
  linear(std::size_t in, std::size_t out, rng& gen)
    requires(std::is_same_v<W, tensor<T, 2>> && std::is_same_v<B, tensor<T, 1>>)
      : weight(parameter(init::fan_in_uniform<T>(shape_t<2>{in, out}, in, gen))),
        bias(parameter(init::fan_in_uniform<T>(shape_t<1>{out}, in, gen))) {}
  /// @brief Takes given parameters: w [in, out] and b [out] (tensors, or dtensors laid out for
  /// tensor parallelism); a pdo::shape_error when b's length is not w's second extent.
  linear(var<W> w, var<B> b) : weight(std::move(w)), bias(std::move(b)) {
    detail::check_linear_shapes(weight.shape(), bias.shape()[0]);
  }

  /// @brief x [..., in] W + b: [..., out]; a pdo::shape_error naming the layer's shape when
  /// x's last extent is not `in`.
  template <class V>
  auto operator()(const var<V>& x) const {
    detail::check_linear_input(weight.shape(), x.shape());
    return pdo::matmul(x, weight) + bias;
  }
  /// @brief "weight" and "bias", each name prefixed with `prefix`.
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(const std::string& prefix = "") const {
    return {{prefix + "weight", weight}, {prefix + "bias", bias}};
  }

  var<W> weight;  ///< W [in, out]
  var<B> bias;    ///< b [out]
};

/// @brief 2-D convolution over [N, in_channels, H, W] with a square kernel.
///
/// Parameters, as PyTorch's nn.Conv2d: "weight" [out_channels, in_channels, k, k] and "bias"
/// [out_channels]; initialised U(-1/√fan_in, 1/√fan_in), fan_in = in_channels k².
template <class T>
class conv2d {
 public:
  /// @brief Parameters drawn from U(-1/√fan_in, 1/√fan_in) with `gen`; `o`: stride (not 0) and padding.
  conv2d(std::size_t in_channels, std::size_t out_channels, std::size_t kernel, rng& gen, window_options o = {})
      : weight(parameter(init::fan_in_uniform<T>(shape_t<4>{out_channels, in_channels, kernel, kernel}, in_channels * kernel * kernel, gen))),
        bias(parameter(init::fan_in_uniform<T>(shape_t<1>{out_channels}, in_channels * kernel * kernel, gen))),
        options_(o) {}
  /// @brief Takes given parameters: w [out_channels, in_channels, k, k] and b [out_channels].
  conv2d(var<tensor<T, 4>> w, var<tensor<T, 1>> b, window_options o) : weight(std::move(w)), bias(std::move(b)), options_(o) {}
  /// @brief The stride and padding the layer convolves with.
  [[nodiscard]] window_options options() const { return options_; }

  /// @brief The convolution of local images x [N, in_channels, H, W]: [N, out_channels, H', W'].
  var<tensor<T, 4>> operator()(const var<tensor<T, 4>>& x) const { return pdo::conv2d(x, weight, bias, options_); }
  /// @brief "weight" and "bias", each name prefixed with `prefix`.
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(const std::string& prefix = "") const {
    return {{prefix + "weight", weight}, {prefix + "bias", bias}};
  }

  var<tensor<T, 4>> weight;  ///< [out_channels, in_channels, k, k]
  var<tensor<T, 1>> bias;    ///< [out_channels]

 private:
  window_options options_;
};

/// @brief A layer without parameters.
struct stateless {
  /// @brief No parameters: an empty list.
  template <class T>
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(const std::string& = "") const {
    return {};
  }
};

/// @brief Max pooling over kernel x kernel windows (stride: the kernel unless given).
struct max_pool2d : stateless {
  std::size_t kernel = 2;        ///< window side, in pixels
  window_options options{0, 0};  ///< stride (0: the kernel) and zero padding
  /// @brief pdo::max_pool2d of x [N, C, H, W], a local tensor or a dtensor.
  template <class V>
  var<V> operator()(const var<V>& x) const {
    return pdo::max_pool2d(x, kernel, options);
  }
};

/// @brief Average pooling over kernel x kernel windows (stride: the kernel unless given).
struct avg_pool2d : stateless {
  std::size_t kernel = 2;        ///< window side, in pixels
  window_options options{0, 0};  ///< stride (0: the kernel) and zero padding (counted as zeros)
  /// @brief pdo::avg_pool2d of x [N, C, H, W], a local tensor or a dtensor.
  template <class V>
  var<V> operator()(const var<V>& x) const {
    return pdo::avg_pool2d(x, kernel, options);
  }
};

/// @brief [N, ...] -> [N, product of the rest].
struct flatten : stateless {
  /// @brief x reshaped to [N, product of its other extents] (of a dtensor, only dim 0 may be split).
  template <class V>
  auto operator()(const var<V>& x) const {
    const auto& s = x.shape();
    std::size_t rest = 1;
    for (std::size_t d = 1; d < s.size(); ++d) rest *= s[d];
    return pdo::reshape(x, shape_t<2>{s[0], rest});
  }
};

/// @brief ReLU, max(x, 0) elementwise: PyTorch's nn.ReLU().
struct relu : stateless {
  /// @brief pdo::relu(x).
  template <class V>
  auto operator()(const var<V>& x) const { return pdo::relu(x); }
};
/// @brief Hyperbolic tangent, elementwise: PyTorch's nn.Tanh().
struct tanh : stateless {
  /// @brief pdo::tanh(x).
  template <class V>
  auto operator()(const var<V>& x) const { return pdo::tanh(x); }
};
/// @brief Logistic sigmoid 1 / (1 + e^-x), elementwise: PyTorch's nn.Sigmoid().
struct sigmoid : stateless {
  /// @brief pdo::sigmoid(x).
  template <class V>
  auto operator()(const var<V>& x) const { return pdo::sigmoid(x); }
};
/// @brief GELU, exact (erf form): PyTorch's nn.GELU().
struct gelu : stateless {
  /// @brief pdo::gelu(x).
  template <class V>
  auto operator()(const var<V>& x) const { return pdo::gelu(x); }
};
/// @brief GELU, tanh approximation: PyTorch's nn.GELU(approximate="tanh").
struct gelu_tanh : stateless {
  /// @brief pdo::gelu_tanh(x).
  template <class V>
  auto operator()(const var<V>& x) const { return pdo::gelu_tanh(x); }
};

/// @brief The parameters of a layer or model, names prefixed with `prefix`.
template <class T, class M>
std::vector<parameter_ref<T>> parameters_of(const M& m, const std::string& prefix = "") {
  if constexpr (requires { m.template parameters<T>(prefix); }) return m.template parameters<T>(prefix);
  else return m.parameters(prefix);
}

/// @brief Layers applied in order; parameters named "<index>.<name>" ("0.weight").
template <class... Layers>
class sequential {
 public:
  /// @brief The layers, applied first to last.
  explicit sequential(Layers... layers) : layers_(std::move(layers)...) {}

  /// @brief x through every layer in order (x itself when there are none).
  template <class V>
  auto operator()(const var<V>& x) const {
    return apply<0>(x);
  }
  /// @brief Every layer's parameters in order, named `prefix` + "<index>." + the layer's name for them.
  template <class T>
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(const std::string& prefix = "") const {
    std::vector<parameter_ref<T>> all;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (append(all, parameters_of<T>(std::get<I>(layers_), prefix + std::to_string(I) + ".")), ...);
    }(std::index_sequence_for<Layers...>{});
    return all;
  }
  /// @brief The layers, in order.
  [[nodiscard]] const std::tuple<Layers...>& layers() const { return layers_; }

 private:
  template <std::size_t I, class V>
  auto apply(const var<V>& x) const {
    if constexpr (I == sizeof...(Layers)) return x;
    else return apply<I + 1>(std::get<I>(layers_)(x));
  }
  template <class T>
  static void append(std::vector<parameter_ref<T>>& all, std::vector<parameter_ref<T>> more) {
    for (auto& p : more) all.push_back(std::move(p));
  }
  std::tuple<Layers...> layers_;
};

}  // namespace pdo::nn
#endif  // PDO_SINGLE_PDO_NN_LAYERS_HPP
// ---- pdo/nn/losses.hpp
#ifndef PDO_SINGLE_PDO_NN_LOSSES_HPP
#define PDO_SINGLE_PDO_NN_LOSSES_HPP
// pdo/nn/losses.hpp: the losses a trainer takes (a callable of the model's output and the targets).


namespace pdo::nn {

/// @brief Cross-entropy of logits [N, C] against class indices [N]: the default loss.
struct cross_entropy_loss {
  /// @brief pdo::cross_entropy(logits, labels): the mean over the N rows of -log softmax(logits)[label].
  template <class V, class Y>
  auto operator()(const var<V>& logits, const Y& labels) const {
    return pdo::cross_entropy(logits, labels);
  }
};

/// @brief Mean squared error against targets of the output's shape.
struct mse_loss {
  /// @brief mean((out - target)²) over every element; `target` is a constant (no gradient).
  template <class V>
  auto operator()(const var<V>& out, const V& target) const {
    return pdo::mse(out, var<V>(target));
  }
};

}  // namespace pdo::nn
#endif  // PDO_SINGLE_PDO_NN_LOSSES_HPP
// ---- pdo/nn/optim.hpp
#ifndef PDO_SINGLE_PDO_NN_OPTIM_HPP
#define PDO_SINGLE_PDO_NN_OPTIM_HPP
// pdo/nn/optim.hpp: SGD (momentum, weight decay) and Adam / AdamW, with PyTorch's update rules;
// gradient clipping by global norm; learning-rate schedules. Each optimizer updates the
// parameters it was given, in place, on the cores of the place whose thread calls step():
// under data parallelism every place steps its own copy.


#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <memory>
#include <numbers>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo::detail {

template <class T>
struct sgd_update {
  T* p;
  const T* g;
  T* buf;  ///< momentum buffer, or null
  T lr, momentum, weight_decay;
  bool first;
  PDO_HD void operator()(std::size_t i) const {
    T d = g[i] + weight_decay * p[i];
    if (buf != nullptr) {
      buf[i] = first ? d : momentum * buf[i] + d;
      d = buf[i];
    }
    p[i] -= lr * d;
  }
};

template <class T>
struct adam_update {
  T* p;
  const T* g;
  T* m;
  T* v;
  T lr, beta1, beta2, eps, weight_decay;
  T correction1, correction2;  ///< 1 - beta^t
  bool decoupled;              ///< AdamW: decay the weights, not the gradient
  PDO_HD void operator()(std::size_t i) const {
    using std::sqrt;
    T d = g[i];
    if (decoupled) p[i] -= lr * weight_decay * p[i];
    else d += weight_decay * p[i];
    m[i] = beta1 * m[i] + (T(1) - beta1) * d;
    v[i] = beta2 * v[i] + (T(1) - beta2) * d * d;
    const T mhat = m[i] / correction1, vhat = v[i] / correction2;
    p[i] -= lr * mhat / (static_cast<T>(sqrt(vhat)) + eps);
  }
};

/// @brief Throws a pdo::error naming the optimizer `op` and its setting `name` when `value` is
/// not finite or breaks `ok` (described by `rule`), as PyTorch's optimizers reject such
/// settings when made.
PDO_NOINLINE inline void check_setting(std::string_view op, std::string_view name, double value, bool ok, std::string_view rule) {
  if (ok && std::isfinite(value)) return;
  char text[32];
  std::snprintf(text, sizeof text, "%g", value);
  throw error(std::string(op) + ": " + std::string(name) + " must be " + std::string(rule) + ", not " + text);
}

/// @brief The learning rate of optimizer `op`: finite and not negative.
inline void check_lr(std::string_view op, double lr) { check_setting(op, "lr", lr, lr >= 0, "finite and >= 0"); }

/// @brief g[i] *= factor (a gradient clipped by its global norm).
template <class T>
struct scale_update {
  T* g;
  T factor;
  PDO_HD void operator()(std::size_t i) const { g[i] = g[i] * factor; }
};

}  // namespace pdo::detail

namespace pdo::nn {

/// @brief The squared norm of the gradients of `params`, over every element of every
/// parameter counted once whatever its layout (see parameter_ref::grad_squared_norm).
template <class T>
double grad_squared_norm(const std::vector<parameter_ref<T>>& params) {
  double sum = 0;
  for (const auto& p : params) sum += p.grad_squared_norm();
  return sum;
}

/// @brief Multiplies every local block of the gradients of `params` by `factor`.
template <class T>
void scale_grads(const std::vector<parameter_ref<T>>& params, double factor) {
  for (const auto& p : params) {
    const auto grads = p.grad_blocks();
    const auto places = p.block_places();
    for (std::size_t k = 0; k < grads.size(); ++k)
      pdo::detail::for_each_index(places[k], grads[k].size(), pdo::detail::scale_update<T>{grads[k].data(), static_cast<T>(factor)});
  }
}

/// @brief The factor clip_grad_norm scales gradients of global norm `norm` by (PyTorch's
/// rule): max_norm / (norm + 1e-6) when that is below 1, else 1 (and 1 when the norm is not
/// finite: such gradients are left as they are, for the caller to see).
inline double clip_factor(double norm, double max_norm) {
  if (!std::isfinite(norm)) return 1;
  const double f = max_norm / (norm + 1e-6);
  return f < 1 ? f : 1;
}

/// @brief Clips the gradients of `params` by their global norm, as
/// torch.nn.utils.clip_grad_norm_: the norm is taken over every element of every parameter
/// (a dtensor's over all its shards, on every process, each element counted once whatever
/// its layout), and when it exceeds `max_norm` every gradient is scaled by
/// max_norm / (norm + 1e-6). Returns the norm before clipping. Over several processes, every
/// process calls it with the same parameters.
template <class T>
double clip_grad_norm(const std::vector<parameter_ref<T>>& params, double max_norm) {
  pdo::detail::check_setting("clip_grad_norm", "max_norm", max_norm, max_norm > 0, "positive and finite");
  const double norm = std::sqrt(grad_squared_norm(params));
  const double f = clip_factor(norm, max_norm);
  if (f < 1) scale_grads(params, f);
  return norm;
}

/// @brief A learning rate for each optimizer step, given the number of steps taken before it
/// (0 for the first). A trainer with a schedule sets its optimizer's rate from it before
/// every update; since it depends on the step count only, a run resumed from a checkpoint
/// follows it as if it had not stopped.
using lr_schedule = std::function<double(std::size_t step)>;

/// @brief `lr` at every step.
inline lr_schedule constant_lr(double lr) {
  return [lr](std::size_t) { return lr; };
}

/// @brief PyTorch's StepLR, counted in steps: lr * gamma^floor(step / step_size).
inline lr_schedule step_lr(double lr, std::size_t step_size, double gamma = 0.1) {
  if (step_size == 0) throw error("step_lr: step_size must be at least 1");
  return [=](std::size_t step) { return lr * std::pow(gamma, static_cast<double>(step / step_size)); };
}

/// @brief Linear warm-up, then cosine decay: lr * (step + 1) / warmup_steps for the first
/// warmup_steps steps; then min_lr + (lr - min_lr) * (1 + cos(pi * (step - warmup_steps) /
/// (total_steps - warmup_steps))) / 2 until total_steps; min_lr after.
inline lr_schedule cosine_lr(double lr, std::size_t warmup_steps, std::size_t total_steps, double min_lr = 0) {
  if (warmup_steps > total_steps)
    throw error("cosine_lr: " + std::to_string(warmup_steps) + " warm-up steps exceed the " + std::to_string(total_steps) + " steps in all");
  return [=](std::size_t step) {
    if (step < warmup_steps) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
    if (step >= total_steps) return min_lr;
    const double progress = static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
    return min_lr + (lr - min_lr) * 0.5 * (1 + std::cos(std::numbers::pi * progress));
  };
}

/// @brief What every optimizer has: the parameters it updates.
template <class T>
class optimizer_base {
 public:
  /// @brief Forgets the gradients (before the next backward, which would add to them).
  void zero_grad() {
    for (auto& p : params_) p.zero_grad();
  }
  /// @brief The parameters this optimizer updates, in the order it was given them.
  [[nodiscard]] const std::vector<parameter_ref<T>>& parameters() const { return params_; }

 protected:
  /// @brief Keeps `params` (references: the optimizer updates the model's own values).
  explicit optimizer_base(std::vector<parameter_ref<T>> params) : params_(std::move(params)) {}
  std::vector<parameter_ref<T>> params_;  ///< the parameters updated, in the order given
};

/// @brief Settings of sgd, as PyTorch's torch.optim.SGD (no dampening, no Nesterov).
struct sgd_options {
  double lr = 0.01;         ///< learning rate
  double momentum = 0;      ///< momentum factor; 0: plain SGD, no momentum buffer kept
  double weight_decay = 0;  ///< L2 penalty: weight_decay * p is added to the gradient
};

/// @brief Stochastic gradient descent with optional momentum and (L2) weight decay.
template <class T>
class sgd : public optimizer_base<T> {
  using optimizer_base<T>::params_;

 public:
  /// @brief Updates `params` with the settings `o`.
  /// A pdo::error when a setting is negative or not finite.
  sgd(std::vector<parameter_ref<T>> params, sgd_options o) : optimizer_base<T>(std::move(params)), o_(o), buffers_(params_.size()) {
    pdo::detail::check_lr("sgd", o.lr);
    pdo::detail::check_setting("sgd", "momentum", o.momentum, o.momentum >= 0, "finite and >= 0");
    pdo::detail::check_setting("sgd", "weight_decay", o.weight_decay, o.weight_decay >= 0, "finite and >= 0");
  }

  /// @brief One update of every parameter that has a gradient (of each of its local blocks).
  void step() {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto values = params_[i].value_blocks();
      const auto grads = params_[i].grad_blocks();
      if (grads.empty()) continue;
      const auto places = params_[i].block_places();
      auto& buffers = buffers_[i];
      const bool first = buffers.empty() && o_.momentum != 0;
      if (first) buffers = params_[i].zero_state();
      for (std::size_t k = 0; k < values.size(); ++k) {
        pdo::detail::for_each_index(places[k], values[k].size(),
                                    pdo::detail::sgd_update<T>{values[k].data(), grads[k].data(), o_.momentum != 0 ? buffers[k].data() : nullptr,
                                                               static_cast<T>(o_.lr), static_cast<T>(o_.momentum),
                                                               static_cast<T>(o_.weight_decay), first});
      }
    }
  }
  /// @brief Sets the learning rate of the next steps (a schedule calls this before each one);
  /// a pdo::error when it is negative or not finite.
  void set_lr(double lr) {
    pdo::detail::check_lr("sgd::set_lr", lr);
    o_.lr = lr;
  }
  /// @brief The current learning rate.
  [[nodiscard]] double lr() const { return o_.lr; }

  /// @brief The state kept per parameter, by PyTorch's names: "momentum_buffer" (with momentum).
  [[nodiscard]] std::vector<std::string> state_names() const {
    return o_.momentum != 0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  }
  /// @brief State `name` of parameter `i`: one block per local block of the parameter
  /// (zero-filled first if no step has made it yet), for checkpoints.
  [[nodiscard]] std::vector<tensor<T, 1>>& state(const std::string& name, std::size_t i) {
    if (name != "momentum_buffer" || o_.momentum == 0 || i >= params_.size())
      throw error("sgd::state: no state \"" + name + "\" for parameter " + std::to_string(i) + " (sgd keeps a momentum_buffer when momentum is not 0)");
    if (buffers_[i].empty()) buffers_[i] = params_[i].zero_state();
    return buffers_[i];
  }
  /// @brief Steps taken (SGD's update does not depend on it).
  [[nodiscard]] long steps() const { return 0; }
  /// @brief Does nothing: SGD keeps no step count (a checkpoint's is ignored).
  void set_steps(long) {}

 private:
  sgd_options o_;
  std::vector<std::vector<tensor<T, 1>>> buffers_;  ///< momentum, per parameter and block
};

/// @brief Settings of adam, as PyTorch's torch.optim.Adam (and AdamW with decoupled_weight_decay).
struct adam_options {
  double lr = 1e-3;         ///< learning rate
  double beta1 = 0.9;       ///< decay rate of the first moment (the mean of the gradients)
  double beta2 = 0.999;     ///< decay rate of the second moment (the mean of their squares)
  double eps = 1e-8;        ///< added to the square root of the second moment, against division by 0
  double weight_decay = 0;  ///< L2 penalty added to the gradient, or with AdamW p -= lr * weight_decay * p
  bool decoupled_weight_decay = false;  ///< true: AdamW
};

/// @brief Adam, or AdamW with decoupled_weight_decay (see adamw_options()).
template <class T>
class adam : public optimizer_base<T> {
  using optimizer_base<T>::params_;

 public:
  /// @brief Updates `params` with the settings `o`.
  /// A pdo::error when a setting is out of its range (betas in [0, 1), the others >= 0) or not finite.
  adam(std::vector<parameter_ref<T>> params, adam_options o)
      : optimizer_base<T>(std::move(params)), o_(o), m_(params_.size()), v_(params_.size()), t_(params_.size(), 0) {
    pdo::detail::check_lr("adam", o.lr);
    pdo::detail::check_setting("adam", "beta1", o.beta1, o.beta1 >= 0 && o.beta1 < 1, "in [0, 1)");
    pdo::detail::check_setting("adam", "beta2", o.beta2, o.beta2 >= 0 && o.beta2 < 1, "in [0, 1)");
    pdo::detail::check_setting("adam", "eps", o.eps, o.eps >= 0, "finite and >= 0");
    pdo::detail::check_setting("adam", "weight_decay", o.weight_decay, o.weight_decay >= 0, "finite and >= 0");
  }

  /// @brief Updates every parameter that has a gradient (each of its local blocks), with
  /// bias-corrected moments. As PyTorch's, each parameter counts its own steps (those it had
  /// a gradient in): a parameter whose first gradient comes at the tenth step is corrected
  /// as at its first.
  void step() {
    ++steps_;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto values = params_[i].value_blocks();
      const auto grads = params_[i].grad_blocks();
      if (grads.empty()) continue;
      const double t = static_cast<double>(++t_[i]);
      const T c1 = static_cast<T>(1 - std::pow(o_.beta1, t));
      const T c2 = static_cast<T>(1 - std::pow(o_.beta2, t));
      const auto places = params_[i].block_places();
      if (m_[i].empty()) {
        m_[i] = params_[i].zero_state();
        v_[i] = params_[i].zero_state();
      }
      for (std::size_t k = 0; k < values.size(); ++k)
        pdo::detail::for_each_index(places[k], values[k].size(),
                                    pdo::detail::adam_update<T>{values[k].data(), grads[k].data(), m_[i][k].data(), v_[i][k].data(),
                                                                static_cast<T>(o_.lr), static_cast<T>(o_.beta1), static_cast<T>(o_.beta2),
                                                                static_cast<T>(o_.eps), static_cast<T>(o_.weight_decay), c1, c2,
                                                                o_.decoupled_weight_decay});
    }
  }
  /// @brief Sets the learning rate of the next steps (a schedule calls this before each one);
  /// a pdo::error when it is negative or not finite.
  void set_lr(double lr) {
    pdo::detail::check_lr("adam::set_lr", lr);
    o_.lr = lr;
  }
  /// @brief The current learning rate.
  [[nodiscard]] double lr() const { return o_.lr; }

  /// @brief The state kept per parameter, by PyTorch's names: the moments "exp_avg" and "exp_avg_sq".
  [[nodiscard]] std::vector<std::string> state_names() const { return {"exp_avg", "exp_avg_sq"}; }
  /// @brief State `name` of parameter `i`: one block per local block of the parameter
  /// (zero-filled first if no step has made it yet), for checkpoints.
  [[nodiscard]] std::vector<tensor<T, 1>>& state(const std::string& name, std::size_t i) {
    if ((name != "exp_avg" && name != "exp_avg_sq") || i >= params_.size())
      throw error("adam::state: no state \"" + name + "\" for parameter " + std::to_string(i) + " (adam keeps exp_avg and exp_avg_sq)");
    if (m_[i].empty()) {
      m_[i] = params_[i].zero_state();
      v_[i] = params_[i].zero_state();
    }
    return name == "exp_avg" ? m_[i] : v_[i];
  }
  /// @brief Steps taken (calls of step()).
  [[nodiscard]] long steps() const { return steps_; }
  /// @brief Steps parameter `i` has taken (those it had a gradient in): its bias corrections'
  /// t.
  [[nodiscard]] long steps(std::size_t i) const { return t_.at(i); }
  /// @brief Sets the steps taken, of the optimizer and of every parameter (a checkpoint
  /// restores it, then each parameter's own count with set_steps(i, t), so the bias
  /// corrections continue).
  void set_steps(long t) {
    steps_ = t;
    std::fill(t_.begin(), t_.end(), t);
  }
  /// @brief Sets the steps parameter `i` has taken (a checkpoint restores each parameter's).
  void set_steps(std::size_t i, long t) { t_.at(i) = t; }

 private:
  adam_options o_;
  std::vector<std::vector<tensor<T, 1>>> m_, v_;  ///< moments, per parameter and block
  std::vector<long> t_;                           ///< steps per parameter
  long steps_ = 0;
};

/// @brief An optimizer of parameters of element type T: sgd, adam, any_optimizer, or a type
/// of the user's with these members. Checkpoints (pdo::io) also need its state:
/// state_names(), state(name, i), steps() and set_steps(t), as sgd and adam have.
template <class O, class T>
concept optimizer = requires(O& o, const O& co, double lr) {
  o.step();
  o.zero_grad();
  o.set_lr(lr);
  { co.lr() } -> std::convertible_to<double>;
  { co.parameters() } -> std::convertible_to<const std::vector<parameter_ref<T>>&>;
};

/// @brief Any optimizer of T parameters, chosen at run time (SGD or Adam from a command-line
/// flag, say): holds one and forwards to it. Copies share the optimizer they hold.
template <class T>
class any_optimizer {
 public:
  /// @brief Holds `o` (copied or moved in); implicit, so a factory may return any optimizer.
  template <class O>
    requires(optimizer<std::remove_cvref_t<O>, T> && !std::same_as<std::remove_cvref_t<O>, any_optimizer>)
  any_optimizer(O&& o)  // NOLINT: implicit, so a factory may return any optimizer
      : impl_(std::make_shared<holder<std::remove_cvref_t<O>>>(std::forward<O>(o))) {}

  /// @brief The held optimizer's step().
  void step() { impl_->step(); }
  /// @brief The held optimizer's zero_grad(): forgets its parameters' gradients.
  void zero_grad() { impl_->zero_grad(); }
  /// @brief Sets the held optimizer's learning rate.
  void set_lr(double lr) { impl_->set_lr(lr); }
  /// @brief The held optimizer's learning rate.
  [[nodiscard]] double lr() const { return impl_->lr(); }
  /// @brief The parameters the held optimizer updates.
  [[nodiscard]] const std::vector<parameter_ref<T>>& parameters() const { return impl_->parameters(); }
  /// @brief The held optimizer's state, for checkpoints (none when it keeps no state_names()).
  [[nodiscard]] std::vector<std::string> state_names() const { return impl_->state_names(); }
  /// @brief The held optimizer's state `name` of parameter `i`; pdo::error if it has no state(name, i).
  [[nodiscard]] std::vector<tensor<T, 1>>& state(const std::string& name, std::size_t i) { return impl_->state(name, i); }
  /// @brief The held optimizer's step count (0 if it keeps none).
  [[nodiscard]] long steps() const { return impl_->steps(); }
  /// @brief Sets the held optimizer's step count (ignored if it keeps none).
  void set_steps(long t) { impl_->set_steps(t); }
  /// @brief The steps parameter `i` has taken, if the held optimizer counts them per
  /// parameter (adam); else its step count.
  [[nodiscard]] long steps(std::size_t i) const { return impl_->steps(i); }
  /// @brief Sets the steps parameter `i` has taken (ignored if the held optimizer keeps no
  /// count per parameter).
  void set_steps(std::size_t i, long t) { impl_->set_steps(i, t); }

 private:
  struct base {
    virtual ~base() = default;
    virtual void step() = 0;
    virtual void zero_grad() = 0;
    virtual void set_lr(double) = 0;
    [[nodiscard]] virtual double lr() const = 0;
    [[nodiscard]] virtual const std::vector<parameter_ref<T>>& parameters() const = 0;
    [[nodiscard]] virtual std::vector<std::string> state_names() const = 0;
    [[nodiscard]] virtual std::vector<tensor<T, 1>>& state(const std::string& name, std::size_t i) = 0;
    [[nodiscard]] virtual long steps() const = 0;
    virtual void set_steps(long t) = 0;
    [[nodiscard]] virtual long steps(std::size_t i) const = 0;
    virtual void set_steps(std::size_t i, long t) = 0;
  };
  template <class O>
  struct holder final : base {
    explicit holder(O x) : o(std::move(x)) {}
    O o;
    void step() override { o.step(); }
    void zero_grad() override { o.zero_grad(); }
    void set_lr(double lr) override { o.set_lr(lr); }
    [[nodiscard]] double lr() const override { return o.lr(); }
    [[nodiscard]] const std::vector<parameter_ref<T>>& parameters() const override { return o.parameters(); }
    [[nodiscard]] std::vector<std::string> state_names() const override {
      if constexpr (requires { o.state_names(); }) return o.state_names();
      else return {};
    }
    [[nodiscard]] std::vector<tensor<T, 1>>& state(const std::string& name, std::size_t i) override {
      if constexpr (requires { o.state(name, i); }) return o.state(name, i);
      else throw error("any_optimizer::state: the optimizer it holds keeps no state a checkpoint can save (no state(name, i)); asked for \"" + name + "\"");
    }
    [[nodiscard]] long steps() const override {
      if constexpr (requires { o.steps(); }) return o.steps();
      else return 0;
    }
    void set_steps(long t) override {
      if constexpr (requires { o.set_steps(t); }) o.set_steps(t);
    }
    [[nodiscard]] long steps(std::size_t i) const override {
      if constexpr (requires { o.steps(i); }) return o.steps(i);
      else return steps();
    }
    void set_steps(std::size_t i, long t) override {
      if constexpr (requires { o.set_steps(i, t); }) o.set_steps(i, t);
    }
  };
  std::shared_ptr<base> impl_;
};

static_assert(optimizer<sgd<float>, float> && optimizer<adam<double>, double> && optimizer<any_optimizer<float>, float>);

/// @brief AdamW's usual settings: decoupled weight decay 0.01.
inline adam_options adamw_options(double lr = 1e-3, double weight_decay = 0.01) {
  adam_options o;
  o.lr = lr;
  o.weight_decay = weight_decay;
  o.decoupled_weight_decay = true;
  return o;
}

}  // namespace pdo::nn
#endif  // PDO_SINGLE_PDO_NN_OPTIM_HPP

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo::nn {

/// @brief Settings of data_parallel: gradient buckets, ZeRO-1, non-finite steps, replica
/// start-up, gradient clipping and the learning-rate schedule.
struct data_parallel_options {
  /// @brief Gradients are all_reduced in buckets of about this many bytes (at least one
  /// parameter each), in the order backward completes them (PyTorch DDP's default: 25 MiB).
  std::size_t bucket_bytes = std::size_t{25} << 20;
  /// @brief Start a bucket's all_reduce as soon as its last gradient is ready, while
  /// backward goes on; false: all buckets after backward (for comparison).
  bool overlap = true;
  /// @brief ZeRO stage 1: the optimizer state is sharded over "dp". Each bucket's
  /// gradients are reduce_scattered (each place gets the sum of its slice), each place
  /// updates its slice of the parameters with its slice of the optimizer state, and the
  /// slices are all_gathered back. Optimizer memory per place: 1/n.
  bool zero1 = false;
  /// @brief A step whose global loss is not finite (NaN or infinite) is skipped: no update,
  /// and fit leaves it out of the epoch's loss (epoch_stats::skipped_steps counts it). When
  /// false, such a step is a pdo::error naming the step, before any parameter changes.
  bool skip_nonfinite_steps = false;
  /// @brief At start-up every replica's parameters are overwritten by place 0's (a broadcast
  /// over the mesh, as PyTorch DDP does), so replicas start equal whatever the factories did.
  bool broadcast_parameters = true;
  /// @brief At start-up (after the broadcast, if any), check that every replica's parameters
  /// equal place 0's, bit for bit: a pdo::error naming the parameter and the place otherwise.
  /// (check_replicas() does the same at any time.)
  bool check_replicas = false;
  /// @brief When positive, the summed gradients are clipped by their global norm before each
  /// update (clip_grad_norm: scaled by max / (norm + 1e-6) when the norm exceeds it); the norm
  /// of the last step is last_grad_norm(). Under ZeRO-1 the norm is summed over the slices.
  /// 0: no clipping; a negative or non-finite value is a pdo::error when the trainer is made.
  double clip_grad_norm = 0;
  /// @brief When set, the optimizer's learning rate before each update is schedule(steps
  /// taken before it): step_lr, cosine_lr, or any function of the step.
  lr_schedule schedule = {};
};

}  // namespace pdo::nn

namespace pdo::detail {

/// @brief The sum over the places of p's line along `axis` of each of `values` (host
/// numbers: a loss, a count), through the mesh's host group whatever its devices.
template <class Mesh, std::size_t N>
std::array<double, N> sum_along(const Mesh& m, std::size_t axis, std::size_t p, const std::array<double, N>& values) {
  std::vector<double> all(m.size() * N);
  host_communicator_of(m, p).all_gather(std::span<const double>(values.data(), N), std::span<double>(all));
  std::array<double, N> sum{};
  for (std::size_t q : m.group(axis, p))
    for (std::size_t i = 0; i < N; ++i) sum[i] += all[q * N + i];
  return sum;
}

}  // namespace pdo::detail

namespace pdo::nn {

/// @brief Data-parallel training over the "dp" axis of a mesh, on CPU or GPU places.
///
/// Every place holds its own replica of the model and of the optimizer state, built by
/// the factories on that place (so their memory is the place's). A step splits the global
/// batch by rows along "dp" (uneven shards allowed: 10 rows on 4 places train 3, 3, 2, 2),
/// runs forward and backward on every place at once, and sums the gradients. The loss of
/// each place is weighted by its share of the global batch, so the summed gradient is the
/// gradient of the global batch's mean loss: training on N places follows the same
/// trajectory as on one place with the same global batch.
///
/// How the gradients are summed, the planner derives: a replicated parameter used on rows
/// split along "dp" gets a gradient matmul(xᵀ, g) whose layout is partial over "dp", and
/// the plan that brings it back to the parameter's layout is one all_reduce
/// (`gradient_sync_plan`, checked at compile time below), which each gradient bucket runs.
template <class T, class Model, class Optimizer, class Mesh, class Loss = cross_entropy_loss>
class data_parallel {
 public:
  /// @brief The mesh type trained over; it has an axis named "dp".
  using mesh_type = Mesh;
  /// @brief The index of the "dp" axis among the mesh's axes.
  static constexpr std::size_t dp_axis = Mesh::axis_index("dp");
  static_assert(dp_axis < Mesh::ndim, "pdo: data_parallel: the mesh needs an axis named \"dp\"");

  /// @brief The batch's layout, as the planner sees it: rows split along "dp", the rest replicated.
  using data_layout = layout<split<"dp">, replicate>;
  /// @brief A replicated parameter's layout: every place holds all of it.
  using param_layout = layout<replicate, replicate>;
  /// @brief The layout the planner derives for such a parameter's gradient, matmul(xᵀ, g) of rows split
  /// along "dp": partial over "dp".
  using gradient_layout =
      result_layout_t<decltype(pdo::matmul(pdo::transpose(std::declval<const dtensor<T, 2, Mesh, data_layout>&>()),
                                           std::declval<const dtensor<T, 2, Mesh, data_layout>&>()))>;
  /// @brief The plan from gradient_layout to param_layout: one all_reduce over "dp" (checked just below).
  static constexpr redistribute_plan gradient_sync_plan = redistribute_plan_of<gradient_layout, param_layout>();
  static_assert(gradient_sync_plan.size == 1 && gradient_sync_plan.steps[0].kind == step_kind::all_reduce &&
                    gradient_sync_plan.steps[0].axis == "dp",
                "pdo: data_parallel: the planner should sync replicated gradients with one all_reduce over \"dp\"");
  /// @brief The buckets each replica syncs its gradients in, over "dp".
  using buckets_type = gradient_buckets<T, Mesh, "dp">;
  static_assert(buckets_type::sync_plan.steps[0].kind == gradient_sync_plan.steps[0].kind,
                "pdo: data_parallel: a bucket syncs its gradients as the planner syncs a parameter's");

  /// @brief Builds a replica on every place of this process, on its lane: make_model(), then
  /// make_optimizer(parameters) (under ZeRO-1, of the place's slices), after the broadcast and replica
  /// check that `o` asks for. `loss(output, targets)` is the loss each step minimises.
  template <class MakeModel, class MakeOptimizer>
  data_parallel(const Mesh& m, MakeModel make_model, MakeOptimizer make_optimizer, data_parallel_options o = {}, Loss loss = {})
      : mesh_(m), options_(o), loss_(loss), replicas_(m.local_places().size()) {
    pdo::detail::check_setting("data_parallel", "clip_grad_norm", o.clip_grad_norm, o.clip_grad_norm >= 0,
                               "finite and >= 0 (0: no clipping)");
    pdo::detail::run_on_places("data_parallel", mesh_, [&](std::size_t p, std::size_t k) {
      auto& r = *(replicas_[k] = std::make_unique<replica>());
      r.place = p;
      r.model.emplace(make_model());
      r.params = parameters_of<T>(*r.model);
      if (options_.broadcast_parameters) broadcast_from_first(p, r.params);
      if (options_.check_replicas) check_replicas_on(p, r.params);
      r.buckets = std::make_unique<buckets_type>(mesh_, p, r.params, bucket_options{options_.bucket_bytes, options_.overlap, options_.zero1});
      r.optimizer.emplace(make_optimizer(options_.zero1 ? r.buckets->slices() : r.params));
    });
  }

  /// @brief One training step on a global batch (host tensors: inputs [B, ...], targets
  /// [B, ...], B at least 1, else pdo::shape_error); returns the mean loss over the global batch. A loss that is not finite is a
  /// pdo::error naming the step, with no parameter updated (or, with
  /// data_parallel_options::skip_nonfinite_steps, returned with no update).
  ///
  /// With `micro_batches` > 1 the global batch is cut into that many micro-batches (by the
  /// chunk rule), each run forward and backward in turn on every place, its gradients added to
  /// the previous ones without any communication (PyTorch DDP's no_sync); the last one's
  /// backward syncs the sum in buckets, and one update follows. The result equals one step on
  /// the whole batch (within rounding), with the activations of one micro-batch at a time.
  template <std::size_t R, class Target>
  T step(const tensor<T, R>& inputs, const Target& targets, std::size_t micro_batches = 1) {
    if (inputs.extent(0) == 0)
      throw shape_error("data_parallel::step: the batch " + describe(inputs) + " has no rows; a step trains on at least one");
    std::vector<std::size_t> order(inputs.extent(0));
    std::iota(order.begin(), order.end(), std::size_t{0});
    return step_on(cut(inputs, targets, order, 0, inputs.extent(0), micro_batches), inputs.extent(0));
  }

  /// @brief Checks that every replica's parameters equal place 0's, bit for bit (a
  /// collective: every process calls it). Throws a pdo::error naming the first parameter and
  /// place that differ, on every place and process.
  void check_replicas() {
    pdo::detail::run_on_places("data_parallel::check_replicas", mesh_,
                               [&](std::size_t p, std::size_t k) { check_replicas_on(p, replicas_[k]->params); });
  }

  /// @brief The global norm of the summed gradients of the last step, before clipping
  /// (computed when data_parallel_options::clip_grad_norm is set; 0 otherwise).
  [[nodiscard]] double last_grad_norm() const { return replicas_.empty() ? 0.0 : replicas_[0]->grad_norm; }

  /// @brief What fit reports after each epoch.
  struct epoch_stats {
    std::size_t epoch = 0;      ///< the epoch's index, from 0, counted on across resumed runs
    double loss = 0;            ///< mean training loss over the epoch's samples
    double accuracy = 0;        ///< on the training samples, from the step's outputs
    double samples_per_second = 0;  ///< all the epoch's samples (skipped steps too) over its wall-clock seconds
    std::size_t samples = 0;         ///< the samples whose loss counts (those of skipped steps do not)
    std::size_t skipped_steps = 0;   ///< steps with a non-finite loss, skipped (data_parallel_options::skip_nonfinite_steps)
  };

  /// @brief Settings of fit.
  struct fit_options {
    std::size_t epochs = 1;       ///< epochs to train in this call, after those already trained
    std::size_t batch_size = 64;  ///< global batch
    std::uint64_t seed = 0;       ///< for the order of the samples in each epoch
    bool shuffle = true;          ///< a new order each epoch; false: the inputs' order
    /// @brief Each global batch is run as this many micro-batches whose gradients add up
    /// before one sync and one update (see step()).
    std::size_t micro_batches = 1;
  };

  /// @brief Trains for `epochs` more epochs over (inputs, targets), in global batches (the
  /// last one may be smaller); the next batch is cut and copied to the places by a task on a
  /// copy lane while the current one trains. Calls on_epoch(stats) after each epoch. Epochs
  /// count on from those this trainer has trained (epochs(), restored by a checkpoint): the
  /// samples of epoch e come in the order of the e-th shuffle from `seed`, so training that
  /// resumes from a checkpoint sees the batches it would have seen without the stop.
  template <std::size_t R, class Target, class OnEpoch>
  void fit(const tensor<T, R>& inputs, const Target& targets, fit_options o, OnEpoch&& on_epoch) {
    const std::size_t n = inputs.extent(0);
    if (n == 0 || o.batch_size == 0) throw shape_error("data_parallel::fit: no samples, or a batch size of 0");
    if (o.micro_batches == 0) throw error("data_parallel::fit: micro_batches must be at least 1");
    std::mt19937_64 gen(o.seed);
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t{0});
    const any_place copier = mesh_.place(mesh_.local_places().front());
    if (o.shuffle)  // the orders of the epochs already trained
      for (std::size_t e = 0; e < epochs_; ++e) std::shuffle(order.begin(), order.end(), gen);
    const std::size_t first_epoch = epochs_;
    for (std::size_t epoch = first_epoch; epoch < first_epoch + o.epochs; ++epoch) {
      if (o.shuffle) std::shuffle(order.begin(), order.end(), gen);
      const auto start = std::chrono::steady_clock::now();
      double total = 0;
      std::size_t counted = 0, skipped = 0;
      auto prefetch = [&](std::size_t first) {
        const std::size_t rows = std::min(o.batch_size, n - first);
        return pdo::prefetch(copier, [this, &inputs, &targets, &order, first, rows, micro = o.micro_batches] {
          return cut(inputs, targets, order, first, rows, micro);
        });
      };
      auto next = prefetch(0);
      for (std::size_t first = 0; first < n; first += o.batch_size) {
        auto current = next.get();
        const std::size_t rows = std::min(o.batch_size, n - first);
        if (first + rows < n) next = prefetch(first + rows);
        const T loss = step_on(std::move(current), rows);
        if (std::isfinite(static_cast<double>(loss))) {
          total += static_cast<double>(loss) * static_cast<double>(rows);
          counted += rows;
        } else {
          ++skipped;
        }
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      epoch_stats s;
      s.epoch = epoch;  // counted from the first epoch this trainer (or the one it resumed) trained
      s.loss = counted == 0 ? std::numeric_limits<double>::quiet_NaN() : total / static_cast<double>(counted);
      s.samples = counted;
      s.skipped_steps = skipped;
      s.samples_per_second = static_cast<double>(n) / seconds;
      s.accuracy = last_epoch_correct_ / static_cast<double>(n);
      last_epoch_correct_ = 0;
      ++epochs_;
      on_epoch(s);
    }
  }

  /// @brief The fraction of rows whose largest output is at their label (classification),
  /// computed on every place over its share of the rows.
  template <std::size_t R, class Label>
  double accuracy(const tensor<T, R>& inputs, const tensor<Label, 1>& labels) {
    std::vector<std::size_t> order(inputs.extent(0));
    std::iota(order.begin(), order.end(), std::size_t{0});
    auto shards = shard(inputs, labels, order, 0, inputs.extent(0));
    std::vector<double> correct(replicas_.size(), 0);
    pdo::detail::run_on_places("data_parallel::accuracy", mesh_, [&](std::size_t p, std::size_t k) {
      auto& s = shards[k];
      const double c = s.inputs.extent(0) == 0 ? 0.0 : static_cast<double>(count_correct((*replicas_[k]->model)(var(s.inputs)).value(), s.targets));
      correct[k] = pdo::detail::sum_along<Mesh, 1>(mesh_, dp_axis, p, {c})[0];
    });
    return inputs.extent(0) == 0 ? 0.0 : correct[0] / static_cast<double>(inputs.extent(0));
  }

  /// @brief The model of the `k`-th place of this process.
  [[nodiscard]] const Model& model(std::size_t k = 0) const { return *replicas_[k]->model; }
  /// @brief The parameters of the `k`-th place's replica, named as the model lists them.
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(std::size_t k = 0) const { return replicas_[k]->params; }
  /// @brief The parameters of each bucket, by name, in the order they are all_reduced.
  [[nodiscard]] std::vector<std::vector<std::string>> buckets() const {
    std::vector<std::vector<std::string>> out;
    for (const auto& b : replicas_[0]->buckets->members()) {
      out.emplace_back();
      for (std::size_t i : b) out.back().push_back(replicas_[0]->params[i].name());
    }
    return out;
  }
  /// @brief The parameter elements whose optimizer state place `k` of this process keeps:
  /// all of them, or under ZeRO-1 its slices (about 1/n).
  [[nodiscard]] std::size_t optimizer_state_elements(std::size_t k = 0) const { return replicas_[k]->buckets->optimizer_state_elements(); }
  /// @brief What every place of this process did in the last step, with times.
  [[nodiscard]] std::vector<step_event> last_step_events() const {
    std::vector<step_event> all;
    for (const auto& r : replicas_) {
      const auto e = r->buckets->events();
      all.insert(all.end(), e.begin(), e.end());
    }
    return all;
  }
  /// @brief The mesh trained over.
  [[nodiscard]] const Mesh& mesh() const { return mesh_; }
  /// @brief The optimizer of the `k`-th place of this process.
  [[nodiscard]] Optimizer& optimizer(std::size_t k = 0) { return *replicas_[k]->optimizer; }
  /// @brief The places of this process, each with its replica.
  [[nodiscard]] std::size_t replica_count() const { return replicas_.size(); }
  /// @brief The gradient buckets of replica k (under ZeRO-1 also its slices of the parameters).
  [[nodiscard]] buckets_type& replica_buckets(std::size_t k) { return *replicas_[k]->buckets; }
  /// @brief The settings given at construction.
  [[nodiscard]] const data_parallel_options& options() const { return options_; }
  /// @brief Steps and epochs trained (skipped steps included), restored with set_progress
  /// when training resumes from a checkpoint.
  [[nodiscard]] std::size_t steps() const { return steps_; }
  /// @brief Epochs trained by fit (see steps()).
  [[nodiscard]] std::size_t epochs() const { return epochs_; }
  /// @brief Sets the steps and epochs trained, as a checkpoint restores them.
  void set_progress(std::size_t steps, std::size_t epochs) {
    steps_ = steps;
    epochs_ = epochs;
  }

  /// @brief The plan of a step, as text: how the batch is cut, the gradient layout the
  /// planner derives for the replicated parameters, the collective that syncs it, and the
  /// buckets with the bytes each place sends for them.
  [[nodiscard]] std::string explain() const {
    const auto& step = buckets_type::step_of(options_.zero1);
    std::string text = "data_parallel on " + mesh_.describe() + ": each place trains the rows " + pdo::layout_name<data_layout>() +
                       " of the global batch on its own replica\n";
    text += "  gradient of a replicated parameter used on those rows: matmul(xᵀ, g) -> " + pdo::layout_name<gradient_layout>() + "\n";
    if (options_.zero1)
      text += "  ZeRO-1: reduce_scattered over \"" + std::string(step.axis) + "\" (each place sums and updates its slice, with its "
              "slice of the optimizer state), the slices all_gathered back; in buckets of ~" + std::to_string(options_.bucket_bytes) + " B\n";
    else
      text += "  synced to " + pdo::layout_name<param_layout>() + " by " + std::string(step_name(step.kind)) + " over \"" +
              std::string(step.axis) + "\", in buckets of ~" + std::to_string(options_.bucket_bytes) + " B, " +
              (options_.overlap ? "each started as soon as backward completes it" : "after backward") + "\n";
    const auto& r = *replicas_[0];
    const auto members = r.buckets->members();
    for (std::size_t b = 0; b < members.size(); ++b) {
      const std::size_t elements = r.buckets->elements(b);
      text += "  bucket " + std::to_string(b) + ": " + std::to_string(elements * sizeof(T)) + " B, each place sends " +
              std::to_string(pdo::detail::bytes_sent(mesh_, step, {elements}, sizeof(T))) + " B:";
      for (std::size_t j : members[b]) text += " " + r.params[j].name() + " " + r.params[j].shape_text();
      text += "\n";
    }
    return text;
  }

 private:
  struct replica {
    std::size_t place = 0;
    std::optional<Model> model;
    std::vector<parameter_ref<T>> params;
    std::unique_ptr<buckets_type> buckets;
    std::optional<Optimizer> optimizer;  ///< declared after the buckets: under ZeRO-1 it updates their slices
    double grad_norm = 0;                ///< of the last step's summed gradients, when clipping
  };

  /// @brief Place 0's parameter values into `params`, place p's (a broadcast over the mesh).
  void broadcast_from_first(std::size_t p, const std::vector<parameter_ref<T>>& params) const {
    const mesh_communicator comm = communicator_of(mesh_, p);
    for (const auto& param : params) comm.broadcast(param.value(), 0);
  }

  /// @brief Compares place p's `params` with place 0's (broadcast into a scratch buffer) and
  /// agrees with every place on the first difference: every place throws the same error.
  void check_replicas_on(std::size_t p, const std::vector<parameter_ref<T>>& params) const {
    const mesh_communicator comm = communicator_of(mesh_, p);
    std::array<double, 2> found{-1, -1};  // parameter, element
    // every place takes part in every broadcast (place 0 finds no difference with itself)
    for (std::size_t j = 0; j < params.size(); ++j) {
      const std::span<T> mine = params[j].value();
      tensor<T, 1> theirs(shape_t<1>{mine.size()}, mesh_.place(p), pdo::detail::uninitialized);
      if (p == 0) pdo::detail::copy_bytes(theirs.where(), theirs.data(), theirs.where(), mine.data(), mine.size_bytes());
      comm.broadcast(theirs.span(), 0);
      const auto host_theirs = to_host(theirs);
      std::vector<T> host_mine(mine.size());
      pdo::detail::copy_bytes(nullptr, host_mine.data(), theirs.where(), mine.data(), mine.size_bytes());
      for (std::size_t i = 0; i < mine.size() && found[0] < 0; ++i)
        if (std::memcmp(&host_mine[i], host_theirs.data() + i, sizeof(T)) != 0) {
          found = {static_cast<double>(j), static_cast<double>(i)};
          break;
        }
    }
    // every place learns every place's finding: all throw the first one's
    std::vector<double> all(mesh_.size() * 2);
    host_communicator_of(mesh_, p).all_gather(std::span<const double>(found.data(), 2), std::span<double>(all));
    for (std::size_t q = 0; q < mesh_.size(); ++q) {
      if (all[2 * q] < 0) continue;
      const auto& param = params[static_cast<std::size_t>(all[2 * q])];
      // every place throws it alike (a mismatch_error): over MPI no process is left waiting
      throw mismatch_error("data_parallel: the replicas differ: parameter " + param.name() + " " + param.shape_text() + " on place " +
                  mesh_.place(q).name() + " differs from place " + mesh_.place(0).name() + "'s at element " +
                  std::to_string(static_cast<std::size_t>(all[2 * q + 1])) +
                  " (the model factory must build equal replicas, or leave data_parallel_options::broadcast_parameters on)");
    }
  }

  /// @brief Rows order[first, first + rows) of the data, cut into `micro` micro-batches (the
  /// chunk rule), each into one shard per place of this process.
  template <std::size_t R, class Target>
  std::vector<std::vector<batch_shard<T, R, Target>>> cut(const tensor<T, R>& inputs, const Target& targets,
                                                          const std::vector<std::size_t>& order, std::size_t first, std::size_t rows,
                                                          std::size_t micro) const {
    if (micro == 0) throw error("data_parallel::step: micro_batches must be at least 1");
    std::vector<std::vector<batch_shard<T, R, Target>>> out;
    for (std::size_t m = 0; m < micro; ++m)
      out.push_back(shard(inputs, targets, order, first + pdo::detail::chunk_offset(rows, micro, m), pdo::detail::chunk_size(rows, micro, m)));
    return out;
  }

  /// @brief Rows order[first, first + rows) of the data, cut into one shard per place of
  /// this process (in that place's memory).
  template <std::size_t R, class Target>
  std::vector<batch_shard<T, R, Target>> shard(const tensor<T, R>& inputs, const Target& targets, const std::vector<std::size_t>& order,
                                               std::size_t first, std::size_t rows) const {
    if (targets.extent(0) != inputs.extent(0))
      throw shape_error("data_parallel: inputs " + describe(inputs) + " and targets " + describe(targets) + " differ in rows");
    const std::size_t parts = mesh_.extent(dp_axis);
    std::vector<batch_shard<T, R, Target>> out;
    for (std::size_t p : mesh_.local_places()) {
      const std::size_t c = mesh_.coord(p, dp_axis);
      const std::size_t at = first + pdo::detail::chunk_offset(rows, parts, c), count = pdo::detail::chunk_size(rows, parts, c);
      out.push_back({pdo::detail::cut_rows(inputs, order, at, count, mesh_.place(p)),
                     pdo::detail::cut_rows(targets, order, at, count, mesh_.place(p))});
    }
    return out;
  }

  template <std::size_t R, class Target>
  T step_on(std::vector<std::vector<batch_shard<T, R, Target>>> micro, std::size_t global_rows) {
    std::vector<T> losses(replicas_.size());
    std::vector<double> corrects(replicas_.size());
    pdo::detail::run_on_places("data_parallel::step", mesh_, [&](std::size_t p, std::size_t k) {
      replica& r = *replicas_[k];
      buckets_type& buckets = *r.buckets;
      buckets.begin_step();
      T local{};
      std::size_t correct = 0;
      {
        // whatever happens, the communication lane is done with this step's buffers before we return
        struct drain {
          buckets_type& b;
          bool done = false;
          ~drain() {
            if (!done) b.abandon();
          }
        } guard{buckets};
        // micro-batches before the last add their gradients without any communication; the
        // last one's backward completes them and fires the buckets
        for (std::size_t m = 0; m < micro.size(); ++m) {
          if (m + 1 == micro.size()) buckets.arm();
          auto& s = micro[m][k];
          const std::size_t rows = s.inputs.extent(0);
          if (rows == 0) continue;
          const double forward_start = buckets.since_start();
          std::optional<pdo::detail::timeline_span> forward_span;
          forward_span.emplace("kernel", "forward", [&] { return std::to_string(rows) + " rows"; });
          const auto out = (*r.model)(var(s.inputs));
          const auto loss = loss_(out, s.targets) * (static_cast<T>(rows) / static_cast<T>(global_rows));
          forward_span.reset();
          const double forward_end = buckets.since_start();
          buckets.record("forward", 0, forward_start, forward_end);
          if constexpr (std::is_integral_v<typename Target::value_type>) correct += count_correct(out.value(), s.targets);
          local += pdo::detail::scalar_of(loss.value());
          pdo::backward(loss);
          buckets.record("backward", 0, forward_end, buckets.since_start());
        }
        guard.done = true;
        buckets.finish();  // parameters without a gradient (no rows here, or unused) send zeros
      }
      // the global batch's loss and count of correct predictions, on every place, before any
      // update: a step whose loss is not finite changes nothing
      const auto totals = pdo::detail::sum_along<Mesh, 2>(mesh_, dp_axis, p, {static_cast<double>(local), static_cast<double>(correct)});
      losses[k] = static_cast<T>(totals[0]);
      corrects[k] = totals[1];
      if (!std::isfinite(totals[0])) return;
      const double opt_start = buckets.since_start();
      if (options_.clip_grad_norm > 0) {
        // replicated gradients: every place has them all; ZeRO-1 slices: summed over "dp"
        const auto& updated = r.optimizer->parameters();
        double squared = grad_squared_norm(updated);
        if (options_.zero1) squared = pdo::detail::sum_along<Mesh, 1>(mesh_, dp_axis, p, {squared})[0];
        r.grad_norm = std::sqrt(squared);
        const double f = clip_factor(r.grad_norm, options_.clip_grad_norm);
        if (f < 1) scale_grads(updated, f);
      }
      if (options_.schedule) r.optimizer->set_lr(options_.schedule(steps_));
      r.optimizer->step();
      buckets.record("optimizer", 0, opt_start, buckets.since_start());
      if (options_.zero1) buckets.gather_slices();
    });
    ++steps_;
    if (!std::isfinite(static_cast<double>(losses[0]))) {
      if (!options_.skip_nonfinite_steps)
        throw error("data_parallel::step: step " + std::to_string(steps_) + " (a global batch of " + std::to_string(global_rows) +
                    " rows on " + mesh_.describe() + "): the loss is " + std::to_string(static_cast<double>(losses[0])) +
                    "; no parameter was updated. Check the inputs and the learning rate, or skip such steps with "
                    "data_parallel_options::skip_nonfinite_steps");
      return losses[0];
    }
    last_epoch_correct_ += corrects[0];
    return losses[0];
  }

  /// @brief How many rows of `out` have their largest output at their label (read on the host).
  template <class Label>
  static std::size_t count_correct(const tensor<T, 2>& out, const tensor<Label, 1>& labels) {
    if (out.on_gpu() || labels.on_gpu()) return count_correct(to_host(out), to_host(labels));
    std::size_t c = 0;
    const std::size_t classes = out.extent(1);
    for (std::size_t i = 0; i < out.extent(0); ++i) {
      const T* row = out.data() + i * classes;
      c += static_cast<std::size_t>(std::max_element(row, row + classes) - row) == static_cast<std::size_t>(labels(i));
    }
    return c;
  }
  template <class Out, class Y>
  static std::size_t count_correct(const Out&, const Y&) {
    return 0;
  }

  Mesh mesh_;
  data_parallel_options options_;
  Loss loss_;
  std::vector<std::unique_ptr<replica>> replicas_;
  double last_epoch_correct_ = 0;
  std::size_t steps_ = 0;   ///< steps taken, skipped ones included
  std::size_t epochs_ = 0;  ///< epochs fit has trained
};

/// @brief A data-parallel trainer: `make_model()` builds a replica (it runs on every place,
/// so use a fixed seed: all replicas must start equal) and `make_optimizer(parameters)`
/// its optimizer.
template <class T, class Mesh, class MakeModel, class MakeOptimizer, class Loss = cross_entropy_loss>
auto make_data_parallel(const Mesh& m, MakeModel make_model, MakeOptimizer make_optimizer, data_parallel_options o = {},
                        Loss loss = {}) {
  static_assert(Mesh::has_axis("dp"), "pdo: data_parallel: the mesh needs an axis named \"dp\"");
  if constexpr (Mesh::has_axis("dp")) {  // else nothing more is instantiated after the error
    using model_t = std::invoke_result_t<MakeModel&>;
    using optimizer_t = std::invoke_result_t<MakeOptimizer&, std::vector<parameter_ref<T>>>;
    return data_parallel<T, model_t, optimizer_t, Mesh, Loss>(m, std::move(make_model), std::move(make_optimizer), o, loss);
  } else {
    return 0;
  }
}

}  // namespace pdo::nn
#endif  // PDO_SINGLE_PDO_NN_DATA_PARALLEL_HPP
// ---- pdo/nn/tensor_parallel.hpp
#ifndef PDO_SINGLE_PDO_NN_TENSOR_PARALLEL_HPP
#define PDO_SINGLE_PDO_NN_TENSOR_PARALLEL_HPP
// pdo/nn/tensor_parallel.hpp: tensor (intra-op) parallelism by parameter layouts alone.


#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

namespace pdo::nn {

template <class L>
inline constexpr bool is_local_linear_v = false;
template <class T>
inline constexpr bool is_local_linear_v<linear<T>> = true;

/// @brief The layouts of a Megatron pair along `Axis`: the first linear split by columns
/// (W [in, out/n], b [out/n]), the second by rows (W [in/n, out], b replicated).
template <fixed_string Axis>
struct column_layouts {
  using weight = layout<replicate, split<Axis>>;  ///< W [in, out] split by columns (out) along `Axis`
  using bias = layout<split<Axis>>;               ///< b [out] split along `Axis`, as W's columns
};
/// @brief The layouts of the second linear of a Megatron pair (see column_layouts): split by rows.
template <fixed_string Axis>
struct row_layouts {
  using weight = layout<split<Axis>, replicate>;  ///< W [in, out] split by rows (in) along `Axis`
  using bias = layout<replicate>;                 ///< b [out] whole on every place
};

namespace detail_tp {
template <class Layouts, class T, class Mesh>
auto distribute_linear(const Mesh& m, const linear<T>& l) {
  using wl = typename Layouts::weight;
  using bl = typename Layouts::bias;
  return linear<T, dtensor<T, 2, Mesh, wl>, dtensor<T, 1, Mesh, bl>>(parameter(distribute<wl>(m, l.weight.value())),
                                                                      parameter(distribute<bl>(m, l.bias.value())));
}
}  // namespace detail_tp

/// @brief A copy of `l` whose weight is split by columns along `Axis` (W [in, out/n], b
/// [out/n]): its output is split along `Axis` by columns, with no communication.
template <fixed_string Axis, class T, class Mesh>
auto column_parallel(const Mesh& m, const linear<T>& l) {
  return detail_tp::distribute_linear<column_layouts<Axis>>(m, l);
}

/// @brief A copy of `l` whose weight is split by rows along `Axis` (W [in/n, out], b
/// replicated): fed a column-split input, its product is a partial sum over `Axis`, which
/// the bias addition reduces (one all_reduce).
template <fixed_string Axis, class T, class Mesh>
auto row_parallel(const Mesh& m, const linear<T>& l) {
  return detail_tp::distribute_linear<row_layouts<Axis>>(m, l);
}

/// @brief One place's shard of a Megatron linear, for SPMD code that runs on each place of
/// the tensor-parallel group with local tensors (a pipeline stage): W and b are the place's
/// shards as column_parallel / row_parallel lay them out, and the collectives the planner
/// derives for those layouts are written in:
/// - column (`Column`): the input, the same on every member, has its gradient summed over
///   the group in backward (pdo::replicated_across, Megatron's f);
/// - row: fed its column shard of the activations, its product is summed over the group
///   (one all_reduce forward, none backward: pdo::sum_across, Megatron's g), then the
///   replicated bias added.
template <class T, bool Column>
class linear_shard {
 public:
  /// @brief Takes this place's shards `w` and `b` and the tensor-parallel group `g` it belongs to.
  linear_shard(var<tensor<T, 2>> w, var<tensor<T, 1>> b, mesh_communicator g)
      : weight(std::move(w)), bias(std::move(b)), group(std::move(g)) {}
  /// @brief x [N, in] (column) or this place's column shard of it (row) times W, plus b, with the
  /// collectives above: [N, out/n] (column) or [N, out] (row).
  auto operator()(const var<tensor<T, 2>>& x) const {
    if constexpr (Column) return pdo::matmul(pdo::replicated_across(x, group), weight) + bias;
    else return pdo::sum_across(pdo::matmul(x, weight), group) + bias;
  }
  /// @brief "weight" and "bias" (this place's shards), each name prefixed with `prefix`.
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(const std::string& prefix = "") const {
    return {{prefix + "weight", weight}, {prefix + "bias", bias}};
  }
  var<tensor<T, 2>> weight;  ///< this place's shard of W: [in, out/n] (column) or [in/n, out] (row)
  var<tensor<T, 1>> bias;    ///< this place's shard of b: [out/n] (column), or all of b [out] (row)
  mesh_communicator group;   ///< the tensor-parallel group the collectives run over
};
template <class T>
using column_parallel_shard = linear_shard<T, true>;
template <class T>
using row_parallel_shard = linear_shard<T, false>;

namespace detail_tp {
template <class... Layers>
constexpr std::size_t linears_before(std::size_t i) {
  constexpr bool is_linear[] = {is_local_linear_v<Layers>..., false};
  std::size_t n = 0;
  for (std::size_t k = 0; k < i; ++k) n += is_linear[k];
  return n;
}

template <class Layer>
constexpr void check_convertible() {
  static_assert(is_local_linear_v<Layer> || std::is_empty_v<Layer> || std::is_base_of_v<stateless, Layer>,
                "pdo: tensor_parallel: the model may hold linear layers and layers without parameters (activations); "
                "split other layers' parameters explicitly");
}

template <class... Layers>
constexpr void check_pairs() {
  static_assert(linears_before<Layers...>(sizeof...(Layers)) % 2 == 0,
                "pdo: tensor_parallel: the model needs linear layers in column/row pairs (an even number), so that "
                "its output is not left split along the tensor-parallel axis");
}

template <fixed_string Axis, std::size_t Ordinal, class Mesh, class Layer>
auto convert(const Mesh& m, const Layer& layer) {
  check_convertible<Layer>();
  if constexpr (!is_local_linear_v<Layer>) return layer;
  else if constexpr (Ordinal % 2 == 0) return column_parallel<Axis>(m, layer);
  else return row_parallel<Axis>(m, layer);
}

/// @brief Place `p`'s shard of `layer` (see tensor_parallel_shard), in p's memory.
template <fixed_string Axis, std::size_t Ordinal, class Mesh, class Layer>
auto shard(const Mesh& m, std::size_t p, const Layer& layer) {
  check_convertible<Layer>();
  if constexpr (!is_local_linear_v<Layer>) {
    return layer;
  } else {
    using T = typename decltype(layer.bias)::element_type;
    using layouts = std::conditional_t<Ordinal % 2 == 0, column_layouts<Axis>, row_layouts<Axis>>;
    auto w = parameter(pdo::detail::shard_of<typename layouts::weight>(m, layer.weight.value(), p));
    auto b = parameter(pdo::detail::shard_of<typename layouts::bias>(m, layer.bias.value(), p));
    auto group = communicator_along(m, Mesh::axis_index(Axis.view()), p);
    return linear_shard<T, Ordinal % 2 == 0>(std::move(w), std::move(b), std::move(group));
  }
}
}  // namespace detail_tp

/// @brief `model` with its parameters laid out for tensor parallelism along mesh axis
/// `Axis`, as Megatron pairs them: the 1st, 3rd, ... linear layers split by columns, the
/// 2nd, 4th, ... by rows; activations unchanged. The model code does not change: it runs
/// on dtensor inputs (replicated along `Axis`, split along others, e.g. rows over "dp"), and
/// the planner derives, from the parameters' layouts alone, one all_reduce per pair in
/// forward (the row-parallel partial sum) and one in backward (the input gradient of the
/// column-parallel layer). Parameters start as the local model's, so training matches it.
template <fixed_string Axis, class Mesh, class... Layers>
auto tensor_parallel(const Mesh& m, const sequential<Layers...>& model) {
  static_assert(Mesh::has_axis(Axis.view()), "pdo: tensor_parallel: the mesh has no axis of that name");
  if constexpr (Mesh::has_axis(Axis.view())) {  // else nothing more is instantiated after the error
    detail_tp::check_pairs<Layers...>();
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return sequential(detail_tp::convert<Axis, detail_tp::linears_before<Layers...>(I)>(m, std::get<I>(model.layers()))...);
    }(std::index_sequence_for<Layers...>{});
  } else {
    return model;
  }
}

/// @brief Place `p`'s part of tensor_parallel<Axis>(m, model), for SPMD code that runs the
/// model on every place of the group along `Axis` with local tensors (each pipeline stage
/// of a mesh with a "tp" axis does): the same Megatron pairs, each place holding the
/// shards those layouts give it (column_parallel_shard, row_parallel_shard), with the
/// collectives the planner would derive written in: one all_reduce per pair forward, one
/// backward. Inputs and outputs are the same on every member of the group.
template <fixed_string Axis, class Mesh, class... Layers>
auto tensor_parallel_shard(const Mesh& m, std::size_t p, const sequential<Layers...>& model) {
  static_assert(Mesh::has_axis(Axis.view()), "pdo: tensor_parallel_shard: the mesh has no axis of that name");
  detail_tp::check_pairs<Layers...>();
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return sequential(detail_tp::shard<Axis, detail_tp::linears_before<Layers...>(I)>(m, p, std::get<I>(model.layers()))...);
  }(std::index_sequence_for<Layers...>{});
}

}  // namespace pdo::nn
#endif  // PDO_SINGLE_PDO_NN_TENSOR_PARALLEL_HPP
// ---- pdo/nn/pipeline.hpp
#ifndef PDO_SINGLE_PDO_NN_PIPELINE_HPP
#define PDO_SINGLE_PDO_NN_PIPELINE_HPP
// pdo/nn/pipeline.hpp: pipeline (inter-op) parallelism: the layers of a sequential cut into
// stages on the places of a mesh's "pp" axis, micro-batched with GPipe or 1F1B schedules.


#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo::nn {

enum class pipeline_schedule {
  gpipe,        ///< every micro-batch forward, then every backward: holds all micro-batches' activations
  one_f_one_b,  ///< 1F1B: after a warm-up, one forward then one backward: at most (stages - stage) micro-batches in flight
};

/// @brief One step of a stage's schedule: the forward or the backward of a micro-batch.
struct pipeline_action {
  bool forward = true;    ///< true: the forward of micro-batch `micro`; false: its backward
  std::size_t micro = 0;  ///< the micro-batch's index, from 0
  friend bool operator==(const pipeline_action&, const pipeline_action&) = default;
};

/// @brief The action list of every stage (stage s receives activations from s - 1 and
/// gradients from s + 1; the messages follow from the actions, so every send has its
/// receive by construction).
inline std::vector<std::vector<pipeline_action>> make_schedule(pipeline_schedule kind, std::size_t stages, std::size_t micros) {
  std::vector<std::vector<pipeline_action>> plan(stages);
  for (std::size_t s = 0; s < stages; ++s) {
    auto& a = plan[s];
    if (kind == pipeline_schedule::gpipe) {
      for (std::size_t m = 0; m < micros; ++m) a.push_back({true, m});
      for (std::size_t m = micros; m-- > 0;) a.push_back({false, m});
    } else {
      const std::size_t warmup = std::min(micros, stages - s - 1);
      std::size_t f = 0, b = 0;
      for (; f < warmup; ++f) a.push_back({true, f});
      while (f < micros) {
        a.push_back({true, f++});
        a.push_back({false, b++});
      }
      while (b < micros) a.push_back({false, b++});
    }
  }
  return plan;
}

/// @brief Rejects, before anything runs, a schedule that would not finish: each stage must
/// run each micro-batch's forward and backward once, forward first, and the stages,
/// running their lists in order (a forward waits for the previous stage's forward of that
/// micro-batch, a backward for the next stage's backward), must all reach the end.
/// Sends never wait (each place sends from its own threads), so that is the whole condition.
inline void check_schedule(const std::vector<std::vector<pipeline_action>>& plan, std::size_t micros) {
  const std::size_t stages = plan.size();
  for (std::size_t s = 0; s < stages; ++s) {
    std::vector<int> seen(2 * micros, 0);
    for (const auto& a : plan[s]) {
      if (a.micro >= micros)
        throw error("pipeline schedule: stage " + std::to_string(s) + " names micro-batch " + std::to_string(a.micro) + " of " +
                    std::to_string(micros));
      if (!a.forward && seen[2 * a.micro] == 0)
        throw error("pipeline schedule: stage " + std::to_string(s) + " runs the backward of micro-batch " + std::to_string(a.micro) +
                    " before its forward");
      ++seen[2 * a.micro + (a.forward ? 0 : 1)];
    }
    for (std::size_t k = 0; k < seen.size(); ++k)
      if (seen[k] != 1)
        throw error("pipeline schedule: stage " + std::to_string(s) + " runs the " + (k % 2 == 0 ? "forward" : "backward") +
                    " of micro-batch " + std::to_string(k / 2) + " " + std::to_string(seen[k]) + " times, not once");
  }
  std::vector<std::size_t> next(stages, 0);
  std::vector<std::vector<char>> done_f(stages, std::vector<char>(micros, 0)), done_b = done_f;
  for (bool progress = true; progress;) {
    progress = false;
    for (std::size_t s = 0; s < stages; ++s) {
      while (next[s] < plan[s].size()) {
        const auto a = plan[s][next[s]];
        const bool ready = a.forward ? (s == 0 || done_f[s - 1][a.micro]) : (s + 1 == stages || done_b[s + 1][a.micro]);
        if (!ready) break;
        (a.forward ? done_f : done_b)[s][a.micro] = 1;
        ++next[s];
        progress = true;
      }
    }
  }
  for (std::size_t s = 0; s < stages; ++s)
    if (next[s] < plan[s].size()) {
      const auto a = plan[s][next[s]];
      throw error("pipeline schedule: deadlock: stage " + std::to_string(s) + " waits forever at the " +
                  (a.forward ? "forward" : "backward") + " of micro-batch " + std::to_string(a.micro) + " (its " +
                  (a.forward ? "input from stage " + std::to_string(s - 1) : "gradient from stage " + std::to_string(s + 1)) +
                  " never comes)");
    }
}

namespace detail_pp {

/// @brief A copy of `layer` whose parameters live in `place`'s memory.
template <class Layer>
Layer to_place(const Layer& layer, const any_place& place) {
  auto copy = [&](const auto& v) { return parameter(pdo::to_place(v.value(), place)); };
  if constexpr (requires { layer.options(); }) return Layer(copy(layer.weight), copy(layer.bias), layer.options());
  else if constexpr (requires { layer.weight; }) return Layer(copy(layer.weight), copy(layer.bias));
  else return layer;
}

/// @brief Place `p`'s part of the stage made of the layers [Begin, End) of `model`: a copy in
/// p's memory, or, on a mesh with a "tp" axis, p's shards of the stage made tensor parallel
/// along "tp" (tensor_parallel_shard).
template <std::size_t Begin, std::size_t End, class Mesh, class... Layers>
auto stage_of(const sequential<Layers...>& model, const Mesh& m, std::size_t p) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    if constexpr (Mesh::has_axis("tp")) {
      using stage_layers = std::tuple<std::tuple_element_t<Begin + I, std::tuple<Layers...>>...>;
      static_assert(nn::detail_tp::linears_before<std::tuple_element_t<I, stage_layers>...>(End - Begin) % 2 == 0,
                    "pdo: pipeline: on a mesh with a \"tp\" axis every stage is tensor parallel: cut the model so that each "
                    "stage holds whole column/row pairs of linear layers");
      return tensor_parallel_shard<"tp">(m, p, sequential(std::get<Begin + I>(model.layers())...));
    } else {
      return sequential(to_place(std::get<Begin + I>(model.layers()), m.place(p))...);
    }
  }(std::make_index_sequence<End - Begin>{});
}

/// @brief The cut points of a pipeline, as a tag its constructor deduces them from.
template <std::size_t... Cuts>
struct cut_list {};

/// @brief Where the stages of a model of `Layers` layers cut after `Cuts...` begin and end:
/// stage s is [values[s], values[s + 1]).
template <std::size_t Layers, std::size_t... Cuts>
struct stage_bounds {
  /// @brief 0, the cut points, then the number of layers.
  static constexpr std::array<std::size_t, sizeof...(Cuts) + 2> values{0, Cuts..., Layers};
};

/// @brief How a tensor goes between two neighbouring stages' places: through the line along
/// "pp" (`link`: CPU places, in one process or several); by a device copy (`handoff`: GPU
/// places of one process: the receiver copies the sender's block on its own stream, and the
/// sender keeps the block until that copy has run, pdo::detail::offered_block); or through
/// host memory and the mesh's host group (`staged`: GPU places of two processes, whose NCCL
/// point-to-point calls, one stream per GPU, would let a send wait for a receive queued
/// behind it).
enum class transport { link, handoff, staged };

/// @brief How `me` sends to and receives from the neighbouring stage's place `other`.
inline transport transport_between(const pdo::detail::place_state& me, const pdo::detail::place_state& other) {
  if (me.kind == place_kind::cpu) return transport::link;
  return other.local ? transport::handoff : transport::staged;
}

/// @brief A place's links to its neighbouring stages: its line along "pp" (members by "pp"
/// coordinate) for the data, the mesh's host group (members by place index) for shapes, and
/// how tensors go to each neighbour (transport).
struct channel {
  /// @brief The place's line along "pp", which carries the tensors' elements.
  mesh_communicator link, host;
  std::size_t previous = 0, next = 0;              ///< members of `link`
  std::size_t previous_place = 0, next_place = 0;  ///< members of `host`
  transport to_previous = transport::link;         ///< how tensors go to and from the previous stage's place
  transport to_next = transport::link;             ///< how tensors go to and from the next stage's place
  /// @var host
  /// @brief The mesh's host group, which carries the tensors' shapes ahead of their elements
  /// (and, staged, the elements).
  /// @var previous
  /// @brief The previous stage's member of `link` (`next`: the next stage's).
  /// @var previous_place
  /// @brief The previous stage's member of `host` (`next_place`: the next stage's).
};

/// @brief The header of a tensor sent between stages: its extents, then (a handoff) where its
/// block is and the sender's mark of the work that wrote it.
template <std::size_t R>
using send_header = std::array<std::size_t, R + 2>;

/// @brief Sends tensors from a place without waiting for their receiver: engine tasks on
/// one lane of the place, in order (receivers take them in the same order). Forward's sends
/// and backward's go on two lanes, so a send that waits for its receiver never holds up
/// the other direction.
struct async_sender {
  lane_kind lane = lane_kind::communication;  ///< the sending place's lane that runs the sends, in order
  std::vector<pdo::detail::task_handle> sends = {};  ///< the send tasks submitted since the last reset()
#if defined(PDO_WITH_CUDA)
  /// @brief The blocks handed to GPU places that the receivers may still be copying.
  std::vector<std::unique_ptr<pdo::detail::offered_block>> offers = {};
#endif

  /// @brief Sends `t` to the next stage's place (`forward`) or the previous one's: its shape
  /// through `c.host` (the mesh's host group), then its elements through `c.link` (the line
  /// along "pp"), through `c.host` from a copy in host memory (staged), or by a handoff between
  /// GPU places (the receiver copies the block, after the mark made here, on the sending
  /// place's compute lane, of the work that wrote it).
  template <class T, std::size_t R>
  void send(pdo::detail::place_state& from, const channel& c, tensor<T, R> t, bool forward, int tag) {
    auto data = std::make_shared<tensor<T, R>>(std::move(t));
    pdo::detail::task_request r;
    r.home = &pdo::detail::lane_of(from, lane);
    r.op = "pipeline send";
    r.category = "collective";
    r.uses.reads.push_back(data->data());
    if (pdo::detail::timeline_on()) r.detail = std::to_string(data->bytes()) + " bytes, micro-batch " + std::to_string(tag);
    const transport how = forward ? c.to_next : c.to_previous;
    if (how != transport::handoff) {
      r.fn = [c, forward, tag, data, how] {
        // staged: the copy to host memory first, so a failed copy sends nothing
        const std::optional<tensor<T, R>> staged = how == transport::staged ? std::optional(to_host(*data)) : std::nullopt;
        send_header<R> header{};
        for (std::size_t d = 0; d < R; ++d) header[d] = data->shape()[d];
        const std::size_t to_place = forward ? c.next_place : c.previous_place;
        c.host.send(std::span<const std::size_t>(header), to_place, 2 * tag);
        if (staged) c.host.send(staged->span(), to_place, 2 * tag + 1);
        else c.link.send(std::as_const(*data).span(), forward ? c.next : c.previous, 2 * tag + 1);
      };
      sends.push_back(pdo::detail::engine::instance().submit(std::move(r)));
      return;
    }
#if defined(PDO_WITH_CUDA)
    // the blocks whose copies have run are freed as the step goes (1F1B keeps few in flight)
    std::erase_if(offers, [](const auto& o) { return o->released(); });
    // kept here until its receiver's copy has run, or until the step's end shows no receiver
    // will take it (reset(), or drain() of a failed step): the task uses it by address
    offers.push_back(std::make_unique<pdo::detail::offered_block>(from, data, data->data()));
    pdo::detail::offered_block* offer = offers.back().get();
    r.fn = [c, forward, tag, shape = data->shape(), offer] {
      send_header<R> header{};
      for (std::size_t d = 0; d < R; ++d) header[d] = shape[d];
      header[R] = offer->address();  // the receiver claims the block there and says when its copy ends
      try {
        c.host.send(std::span<const std::size_t>(header), forward ? c.next_place : c.previous_place, 2 * tag);
      } catch (...) {
        offer->not_delivered();
        throw;
      }
    };
    sends.push_back(pdo::detail::engine::instance().submit(std::move(r)));
#else
    pdo::detail::no_cuda("pipeline send", from.name);
#endif
  }
  /// @brief Waits until every submitted send has ended, failed or not (see failure()). The
  /// blocks handed to GPU places whose copies have run are freed. After a step that failed
  /// here (`withdraw`) the others are too: those not yet claimed are withdrawn (their
  /// receivers, released by the abort, are told), the copies of those claimed waited for.
  /// Otherwise a block not yet claimed is kept: a send task ends when its header is delivered,
  /// which may be before the receiver takes the block (that receiver's step is still on).
  void drain([[maybe_unused]] bool withdraw = false) {
    for (const auto& s : sends) s->wait_ended();
#if defined(PDO_WITH_CUDA)
    if (withdraw) offers.clear();
    else std::erase_if(offers, [](const auto& o) { return o->released(); });
#endif
  }
  /// @brief The first send that failed, once drained.
  [[nodiscard]] std::optional<pdo::detail::captured_error> failure() const {
    for (const auto& s : sends)
      if (auto e = pdo::detail::outcome(*s)) return e;
    return std::nullopt;
  }
  /// @brief Forgets the submitted sends (once drained), before the next step: the previous
  /// step has ended on every place, so a block handed to a GPU place that no receiver claimed
  /// then never will be (it is withdrawn), and the copies of the others are waited for.
  void reset() {
    sends.clear();
#if defined(PDO_WITH_CUDA)
    offers.clear();
#endif
  }
};

template <class T, std::size_t R>
tensor<T, R> receive(const channel& c, bool from_previous, int tag, const any_place& place) {
  send_header<R> header{};
  const std::size_t from = from_previous ? c.previous_place : c.next_place;
  const transport how = from_previous ? c.to_previous : c.to_next;
  c.host.recv(std::span<std::size_t>(header), from, 2 * tag);
  shape_t<R> shape{};
  for (std::size_t d = 0; d < R; ++d) shape[d] = header[d];
  if (how == transport::staged) {
    auto staged = tensor<T, R>::on_host(shape);
    c.host.recv(staged.span(), from, 2 * tag + 1);
    return to_place(staged, place);
  }
  std::optional<tensor<T, R>> made;
  try {
    made.emplace(shape, place, pdo::detail::uninitialized);
  } catch (...) {
#if defined(PDO_WITH_CUDA)
    if (how == transport::handoff) pdo::detail::leave_block(header[R]);  // the sender withdraws it
#endif
    throw;
  }
  tensor<T, R>& t = *made;
  if (how == transport::link) {
    c.link.recv(t.span(), from_previous ? c.previous : c.next, 2 * tag + 1);
    return std::move(t);
  }
#if defined(PDO_WITH_CUDA)
  // take the sender's block on this place's stream, after the sender's mark of the work that
  // wrote it; the sender keeps it until this copy has run
  pdo::detail::take_block(*place.state(), t.data(), header[R], t.bytes());
#else
  pdo::detail::no_cuda("pipeline receive", place.name());
#endif
  return std::move(t);
}

}  // namespace detail_pp

/// @brief Settings of pipeline: the schedule, the micro-batches and, over "dp", the gradient buckets.
struct pipeline_options {
  pipeline_schedule schedule = pipeline_schedule::one_f_one_b;  ///< the order of each stage's forwards and backwards
  std::size_t micro_batches = 4;  ///< micro-batches each place's rows of a global batch are cut into (at least 1)
  /// @brief On a mesh with a "dp" axis, each stage's gradients are all_reduced over "dp" in
  /// buckets of about this many bytes (pdo/nn/buckets.hpp), started during the last
  /// micro-batch's backward.
  std::size_t bucket_bytes = std::size_t{25} << 20;
};

/// @brief Pipeline training over the "pp" axis of a mesh, data parallel over "dp" and tensor
/// parallel over "tp" if the mesh has them: stage s, the layers [cut s-1, cut s) of the
/// model, lives on the places with "pp" coordinate s and only there (its parameters and
/// optimizer state are in their memory; along "tp" each place holds its shards of the
/// stage's Megatron pairs, and the stage's input and output are the same on each, so place
/// (dp, pp, tp) sends to and receives from (dp, pp +- 1, tp)). A step cuts the global batch by rows along "dp", then into micro-batches;
/// activations go forward and their gradients back between neighbouring stages; each
/// stage accumulates its parameters' gradients over the micro-batches (weighted by their
/// share of the global batch), all_reduces them over "dp", and steps its optimizer. So
/// the step equals one place's step on the global batch.
template <class T, std::size_t InRank, class Target, class Mesh, class Optimizer, class Loss, class... Stages>
class pipeline {
 public:
  /// @brief The number of stages; the mesh has as many places along "pp".
  static constexpr std::size_t stage_count = sizeof...(Stages);
  /// @brief The index of the "pp" axis among the mesh's axes.
  static constexpr std::size_t pp_axis = Mesh::axis_index("pp");
  /// @brief Whether the mesh has a "dp" axis: each stage is then data parallel over it.
  static constexpr bool has_dp = Mesh::has_axis("dp");
  /// @brief Whether the mesh has a "tp" axis: each stage is then tensor parallel over it.
  static constexpr bool has_tp = Mesh::has_axis("tp");
  static_assert(pp_axis < Mesh::ndim, "pdo: pipeline: the mesh needs an axis named \"pp\"");

  /// @brief Cuts `model` (a sequential) after the layers `Cuts...` and builds, on each place of this
  /// process, its stage and make_optimizer(its parameters). pdo::layout_error for a mesh of CPU
  /// and GPU places, a "pp" extent other than stage_count, or 0 micro-batches; pdo::error for a schedule that would not finish.
  template <class MakeOptimizer, class Model, std::size_t... Cuts>
  pipeline(const Mesh& m, const Model& model, detail_pp::cut_list<Cuts...>, MakeOptimizer make_optimizer, pipeline_options o, Loss loss)
      : mesh_(m), options_(o), loss_(loss), schedule_(make_schedule(o.schedule, stage_count, o.micro_batches)),
        states_(m.local_places().size()) {
    // neighbouring stages hand tensors over as their places' kind says (detail_pp::transport)
    for (std::size_t q = 0; q < m.size(); ++q)
      if (m.place(q).kind() != m.place(0).kind())
        throw layout_error("pipeline: place " + m.place(q).name() + " of " + m.describe() + " is not of the kind of " + m.place(0).name() +
                           "; the stages run on CPU places or on GPU places, not both");
    if (m.extent(pp_axis) != stage_count)
      throw layout_error("pipeline: the model is cut into " + std::to_string(stage_count) + " stages but " + m.describe() + " has " +
                         std::to_string(m.extent(pp_axis)) + " places along \"pp\"");
    if (o.micro_batches == 0) throw layout_error("pipeline: micro_batches must be at least 1");
    check_schedule(schedule_, o.micro_batches);
    using bounds =
        detail_pp::stage_bounds<std::tuple_size_v<std::remove_cvref_t<decltype(std::declval<const Model&>().layers())>>, Cuts...>;
    // the whole model's parameters, "<layer>.<name>" as a sequential names them, each with its stage
    for (const auto& q : parameters_of<T>(model)) {
      const std::size_t layer = std::stoul(q.name().substr(0, q.name().find('.')));
      std::size_t stage = 0;
      while (stage + 1 < stage_count && bounds::values[stage + 1] <= layer) ++stage;
      model_parameters_.push_back({q.name(), q.extents(), stage});
    }
    pdo::detail::run_on_places("pipeline", mesh_, [&](std::size_t p, std::size_t k) {
      auto& st = *(states_[k] = std::make_unique<place_state>());
      st.stage = mesh_.coord(p, pp_axis);
      with_stage(st.stage, [&]<std::size_t S>() {
        auto& slot = std::get<S>(st.models);
        slot.emplace(detail_pp::stage_of<bounds::values[S], bounds::values[S + 1]>(model, mesh_, p));
        st.params = parameters_of<T>(*slot);
      });
      if constexpr (has_dp) st.buckets = std::make_unique<dp_buckets>(mesh_, p, st.params, bucket_options{options_.bucket_bytes, true, false});
      st.optimizer.emplace(make_optimizer(st.params));
    });
  }

  /// @brief One step on a global batch (host tensors of at least one row, else pdo::shape_error); returns its mean loss.
  template <class Inputs>
  T step(const Inputs& inputs, const Target& targets) {
    if (targets.extent(0) != inputs.extent(0))
      throw shape_error("pipeline: inputs " + describe(inputs) + " and targets " + describe(targets) + " differ in rows");
    const std::size_t rows = inputs.extent(0);
    if (rows == 0) throw shape_error("pipeline::step: the batch " + describe(inputs) + " has no rows; a step trains on at least one");
    std::vector<T> losses(states_.size());
    pdo::detail::run_on_places("pipeline::step", mesh_, [&](std::size_t p, std::size_t k) {
      place_state& st = *states_[k];
      with_stage(st.stage, [&]<std::size_t S>() { losses[k] = run_stage<S>(p, st, inputs, targets, rows); });
    });
    return losses[0];
  }

  /// @brief The most micro-batches whose activations each stage of this process held at once in the last step.
  [[nodiscard]] std::vector<std::size_t> max_in_flight() const {
    std::vector<std::size_t> out;
    for (const auto& s : states_) out.push_back(s->max_in_flight);
    return out;
  }
  /// @brief The action list of every stage, indexed by stage (see make_schedule).
  [[nodiscard]] const std::vector<std::vector<pipeline_action>>& schedule() const { return schedule_; }
  /// @brief The parameters of this process's k-th place (those of its stage, or its shards of them along "tp").
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(std::size_t k) const { return states_[k]->params; }
  /// @brief The optimizer of this process's k-th place (its stage's parameters).
  [[nodiscard]] Optimizer& optimizer(std::size_t k) { return *states_[k]->optimizer; }
  /// @brief The mesh trained over.
  [[nodiscard]] const Mesh& mesh() const { return mesh_; }

  /// @brief A parameter of the whole model as make_pipeline was given it: its name there
  /// ("<layer>.<name>"), its whole shape, and the stage that holds it.
  struct model_parameter {
    std::string name;                  ///< "<layer>.<name>", as the whole sequential names it
    std::vector<std::size_t> extents;  ///< the whole parameter's shape
    std::size_t stage = 0;             ///< the stage whose places hold it
  };
  /// @brief The whole model's parameters, in the model's order (the same on every process).
  [[nodiscard]] const std::vector<model_parameter>& model_parameters() const { return model_parameters_; }

  /// @brief Where this process's k-th place holds model parameter g: its index in
  /// parameters(k) (npos when the place's stage does not hold it), the offset of the place's
  /// block in the whole parameter (a shard along "tp" starts inside it), and whether the place
  /// is the one that speaks for the block (the first along "dp", and along "tp" when every
  /// member holds it whole).
  struct parameter_part {
    static constexpr std::size_t npos = static_cast<std::size_t>(-1);  ///< `index` of a parameter not held
    std::size_t index = npos;          ///< the parameter's index in parameters(k), or npos
    std::vector<std::size_t> offset;   ///< where the place's block starts in the whole parameter, per dim
    bool first = false;                ///< whether this place speaks for the block (saves it, say)
  };
  /// @brief Where this process's k-th place holds model parameter `g` (an index into model_parameters()).
  [[nodiscard]] parameter_part part_of(std::size_t k, std::size_t g) const {
    const place_state& st = *states_[k];
    const model_parameter& q = model_parameters_.at(g);
    parameter_part part;
    if (q.stage != st.stage) return part;
    std::size_t j = 0;
    for (std::size_t i = 0; i < g; ++i) j += model_parameters_[i].stage == st.stage ? 1 : 0;
    const std::size_t p = mesh_.local_places()[k];
    const auto held = st.params.at(j).extents();
    part.index = j;
    part.offset.assign(held.size(), 0);
    bool whole = true;
    for (std::size_t d = 0; d < held.size(); ++d) {
      if (held[d] == q.extents[d]) continue;
      whole = false;
      if constexpr (has_tp) {
        const std::size_t tp = Mesh::axis_index("tp");
        part.offset[d] = pdo::detail::chunk_offset(q.extents[d], mesh_.extent(tp), mesh_.coord(p, tp));
      } else {
        throw layout_error("pipeline: parameter " + q.name + " of stage " + std::to_string(q.stage) + " is " +
                           pdo::detail::format_extents(q.extents) + " in the model but " + pdo::detail::format_extents(held) +
                           " on place " + mesh_.place(p).name());
      }
    }
    part.first = true;
    if constexpr (has_dp) part.first = mesh_.coord(p, Mesh::axis_index("dp")) == 0;
    if constexpr (has_tp)
      if (whole) part.first = part.first && mesh_.coord(p, Mesh::axis_index("tp")) == 0;
    return part;
  }
  /// @brief Seconds each place of this process spent computing in the last step, and the step's length.
  [[nodiscard]] std::vector<double> busy_seconds() const {
    std::vector<double> out;
    for (const auto& s : states_) out.push_back(s->busy);
    return out;
  }
  /// @brief The last step's length in seconds: the longest time among this process's places.
  [[nodiscard]] double last_step_seconds() const {
    double longest = 0;
    for (const auto& s : states_) longest = std::max(longest, s->seconds);
    return longest;
  }

 private:
  /// @brief Stage S's model, and the values it takes and gives (stage 0 takes the inputs).
  template <std::size_t S, bool First = (S == 0)>
  struct stage_types;
  template <std::size_t S>
  struct stage_types<S, true> {
    using model = std::tuple_element_t<S, std::tuple<Stages...>>;
    using in = tensor<T, InRank>;
    using out = std::remove_cvref_t<decltype(std::declval<const model&>()(std::declval<const var<in>&>()).value())>;
  };
  template <std::size_t S>
  struct stage_types<S, false> {
    using model = std::tuple_element_t<S, std::tuple<Stages...>>;
    using in = typename stage_types<S - 1>::out;
    using out = std::remove_cvref_t<decltype(std::declval<const model&>()(std::declval<const var<in>&>()).value())>;
  };

  struct no_buckets {};
  /// @brief A stage's gradient buckets over "dp" (a mesh without "dp" has none).
  using dp_buckets = typename std::conditional_t<has_dp, std::type_identity<gradient_buckets<T, Mesh, "dp">>,
                                                 std::type_identity<no_buckets>>::type;

  struct place_state {
    std::size_t stage = 0;
    std::tuple<std::optional<Stages>...> models;
    std::vector<parameter_ref<T>> params;
    std::unique_ptr<dp_buckets> buckets;  ///< with a "dp" axis: the stage's gradients, synced over it
    std::optional<Optimizer> optimizer;
    detail_pp::async_sender forward_sends{lane_kind::communication}, backward_sends{lane_kind::copy};
    std::size_t max_in_flight = 0;
    double busy = 0;     ///< seconds computing in the last step
    double seconds = 0;  ///< the last step, as this place saw it
  };

  template <class F>
  static void with_stage(std::size_t s, F&& f) {
    [&]<std::size_t... S>(std::index_sequence<S...>) {
      ((s == S ? (f.template operator()<S>(), 0) : 0), ...);
    }(std::make_index_sequence<stage_count>{});
  }

  template <std::size_t S, class Inputs>
  T run_stage(std::size_t p, place_state& st, const Inputs& inputs, const Target& targets, std::size_t global_rows) {
    using types = stage_types<S>;
    using in_t = typename types::in;
    using out_t = typename types::out;
    constexpr bool first = S == 0, last = S + 1 == stage_count;
    const auto& place = mesh_.place(p);
    const auto& model = *std::get<S>(st.models);
    const std::size_t me = mesh_.coord(p, pp_axis);
    detail_pp::channel link{communicator_along(mesh_, pp_axis, p), host_communicator_of(mesh_, p)};
    {
      const auto line = mesh_.group(pp_axis, p);
      link.previous = me == 0 ? me : me - 1;
      link.next = me + 1 < line.size() ? me + 1 : me;
      link.previous_place = line[link.previous];
      link.next_place = line[link.next];
      link.to_previous = detail_pp::transport_between(*place.state(), *mesh_.place(link.previous_place).state());
      link.to_next = detail_pp::transport_between(*place.state(), *mesh_.place(link.next_place).state());
    }
    // this place's rows: its "dp" share of the batch, cut into micro-batches
    std::size_t first_row = 0, my_rows = global_rows;
    if constexpr (has_dp) {
      const std::size_t dp = Mesh::axis_index("dp"), n = mesh_.extent(dp), c = mesh_.coord(p, dp);
      first_row = pdo::detail::chunk_offset(global_rows, n, c);
      my_rows = pdo::detail::chunk_size(global_rows, n, c);
    }
    const std::size_t micros = options_.micro_batches;
    std::vector<std::optional<var<in_t>>> xs(micros);
    std::vector<std::optional<var<out_t>>> ys(micros);
    std::vector<std::optional<var<tensor<T, 0>>>> micro_losses(micros);
    st.forward_sends.reset();
    st.backward_sends.reset();
    st.max_in_flight = 0;
    st.busy = 0;
    const auto step_start = std::chrono::steady_clock::now();
    if constexpr (has_dp) {
      st.buckets->begin_step();  // no gradients yet
    } else {
      for (auto& q : st.params) q.zero_grad();
    }
    // the last backward completes the gradients: it starts the "dp" buckets
    std::size_t last_backward = 0;
    for (std::size_t i = 0; i < schedule_[S].size(); ++i)
      if (!schedule_[S][i].forward) last_backward = i;
    std::size_t in_flight = 0, action = 0;
    T total{};
    try {
      for (const auto& a : schedule_[S]) {
        if constexpr (has_dp)
          if (action++ == last_backward) st.buckets->arm();
        const std::size_t m0 = first_row + pdo::detail::chunk_offset(my_rows, micros, a.micro);
        const std::size_t mr = pdo::detail::chunk_size(my_rows, micros, a.micro);
        const int tag = static_cast<int>(a.micro);
        if (a.forward) {
          var<in_t> x;
          if constexpr (first) x = var<in_t>(pdo::detail::cut_rows(inputs, m0, mr, place));
          else x = parameter(detail_pp::receive<T, in_t::rank>(link, true, tag, place));
          const auto t0 = std::chrono::steady_clock::now();
          auto y = model(x);
          if constexpr (last) {
            if (mr > 0) {
              auto loss = loss_(y, pdo::detail::cut_rows(targets, m0, mr, place)) * (static_cast<T>(mr) / static_cast<T>(global_rows));
              total += pdo::detail::scalar_of(loss.value());
              micro_losses[a.micro] = std::move(loss);
            }
          } else {
            st.forward_sends.send(*place.state(), link, out_t(y.value()), true, tag);
            ys[a.micro] = std::move(y);
          }
          st.busy += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          xs[a.micro] = std::move(x);
          st.max_in_flight = std::max(st.max_in_flight, ++in_flight);
        } else {
          if constexpr (last) {
            const auto t0 = std::chrono::steady_clock::now();
            if (micro_losses[a.micro]) pdo::backward(*micro_losses[a.micro]);
            st.busy += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          } else {
            auto g = detail_pp::receive<T, out_t::rank>(link, false, tag, place);
            const auto t0 = std::chrono::steady_clock::now();
            if (ys[a.micro]->requires_grad()) pdo::backward(*ys[a.micro], std::move(g));
            st.busy += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          }
          if constexpr (!first) {
            const auto& x = *xs[a.micro];
            st.backward_sends.send(*place.state(), link, x.has_grad() ? in_t(x.grad()) : in_t(x.shape(), place), false, tag);
          }
          xs[a.micro].reset();
          ys[a.micro].reset();
          micro_losses[a.micro].reset();
          --in_flight;
        }
      }
    } catch (...) {
      pdo::detail::comms_of(mesh_).abort();  // release the other stages before waiting for our sends
      st.forward_sends.drain(/*withdraw=*/true);
      st.backward_sends.drain(/*withdraw=*/true);
      if constexpr (has_dp) st.buckets->abandon();
      throw;
    }
    st.forward_sends.drain();
    st.backward_sends.drain();
    if (const auto f = st.forward_sends.failure()) f->rethrow_with_context("pipeline send: ");
    if (const auto f = st.backward_sends.failure()) f->rethrow_with_context("pipeline send: ");
    if constexpr (has_dp) st.buckets->finish();
    st.optimizer->step();
    // the step's loss, known to the last stage of each "dp" row (once per "tp" group): summed over the whole mesh
    double sum = static_cast<double>(total);
    if constexpr (has_tp) sum = mesh_.coord(p, Mesh::axis_index("tp")) == 0 ? sum : 0.0;
    host_communicator_of(mesh_, p).all_reduce(std::span<double>(&sum, 1));
    st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
    return static_cast<T>(sum);
  }

  Mesh mesh_;
  pipeline_options options_;
  Loss loss_;
  std::vector<std::vector<pipeline_action>> schedule_;
  std::vector<std::unique_ptr<place_state>> states_;
  std::vector<model_parameter> model_parameters_;
};

/// @brief A pipeline over the "pp" axis of `m`: `model` (a sequential, built anywhere) is cut
/// after the layers `Cuts...` into stages whose layers are copied to their places.
/// `make_optimizer(parameters)` builds each stage's optimizer on its place.
/// @tparam InRank the rank of the inputs (2 for [batch, features], 4 for images)
template <class T, std::size_t InRank, std::size_t... Cuts, class Mesh, class... Layers, class MakeOptimizer,
          class Target = tensor<int, 1>, class Loss = cross_entropy_loss>
auto make_pipeline(const Mesh& m, const sequential<Layers...>& model, MakeOptimizer make_optimizer, pipeline_options o = {},
                   Loss loss = {}) {
  using bounds = detail_pp::stage_bounds<sizeof...(Layers), Cuts...>;
  constexpr bool cuts_fit = [] {
    for (std::size_t s = 0; s + 1 < bounds::values.size(); ++s)
      if (bounds::values[s] >= bounds::values[s + 1]) return false;
    return true;
  }();
  static_assert(cuts_fit,
                "pdo: pipeline: every stage needs at least one layer: the cut points must increase and lie inside the model "
                "(a sequential of N layers is cut after layers 1 .. N-1)");
  if constexpr (cuts_fit) {
    using optimizer_t = std::invoke_result_t<MakeOptimizer&, std::vector<parameter_ref<T>>>;
    return [&]<std::size_t... S>(std::index_sequence<S...>) {
      using pipeline_t = pipeline<T, InRank, Target, Mesh, optimizer_t, Loss,
                                  decltype(detail_pp::stage_of<bounds::values[S], bounds::values[S + 1]>(model, m, std::size_t{}))...>;
      return pipeline_t(m, model, detail_pp::cut_list<Cuts...>{}, std::move(make_optimizer), o, loss);
    }(std::make_index_sequence<sizeof...(Cuts) + 1>{});
  } else {
    return 0;  // not reached: the static_assert above is the error
  }
}

}  // namespace pdo::nn
#endif  // PDO_SINGLE_PDO_NN_PIPELINE_HPP
#endif  // PDO_SINGLE_PDO_NN_HPP
// ---- pdo/place.hpp
#ifndef PDO_SINGLE_PDO_PLACE_HPP
#define PDO_SINGLE_PDO_PLACE_HPP
// pdo/place.hpp: the place layer (places, their lanes, copies between their memories, meshes).

// ---- pdo/place/cpu_place.hpp
#ifndef PDO_SINGLE_PDO_PLACE_CPU_PLACE_HPP
#define PDO_SINGLE_PDO_PLACE_CPU_PLACE_HPP
// pdo/place/cpu_place.hpp: CPU places, each with its lanes, its compute lane on its own cores.


#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace pdo {

/// @brief How a CPU place is made.
struct cpu_place_options {
  bool pin = true;             ///< pin the compute lane to the place's cores (off when other places share them)
  std::size_t memory_cap = 0;  ///< bytes the place may hold (0: no cap)
  std::string name;            ///< empty: "cpu:<ordinal>"
  int process = 0;             ///< the MPI rank that owns it
};

/// @brief A CPU place: lanes that run the place's work (its compute lane on the cores it
/// was given, pinned there when no other place shares them), and a caching allocator.
class cpu_place : public detail::place_handle<cpu_place> {
 public:
  /// @brief A new place on `cores`.
  cpu_place(int ordinal, std::vector<int> cores, const cpu_place_options& options = {})
      : place_handle(std::make_shared<detail::place_state>(
            place_kind::cpu, ordinal, options.process, true, std::move(cores),
            options.name.empty() ? "cpu:" + std::to_string(ordinal) : options.name)) {
    state_->memory = std::make_unique<caching_allocator>(state_->name, options.memory_cap);
    detail::start_lanes(*state_, options.pin ? state_->cores : std::vector<int>{});
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
#endif  // PDO_SINGLE_PDO_PLACE_HPP
// ---- pdo/plan.hpp
#ifndef PDO_SINGLE_PDO_PLAN_HPP
#define PDO_SINGLE_PDO_PLAN_HPP
// pdo/plan.hpp: the planner's public face (plan_of, explain, strict).

#endif  // PDO_SINGLE_PDO_PLAN_HPP
// ---- pdo/tensor.hpp
#ifndef PDO_SINGLE_PDO_TENSOR_HPP
#define PDO_SINGLE_PDO_TENSOR_HPP
// pdo/tensor.hpp: the tensor layer (tensor, dtensor, copies, what each place does in a redistribution).

#endif  // PDO_SINGLE_PDO_TENSOR_HPP

// checkpoints, safetensors and .npy: with the pdo::io target (it needs nlohmann/json)
#if defined(PDO_WITH_IO)
// ---- pdo/io.hpp
#ifndef PDO_SINGLE_PDO_IO_HPP
#define PDO_SINGLE_PDO_IO_HPP
// pdo/io.hpp: the io layer: sharded checkpoints (save, load with resharding), safetensors and
// .npy files. Needs nlohmann/json (the pdo::io target brings it; PDO_WITH_IO is then defined).

// ---- pdo/io/checkpoint.hpp
#ifndef PDO_SINGLE_PDO_IO_CHECKPOINT_HPP
#define PDO_SINGLE_PDO_IO_CHECKPOINT_HPP
// pdo/io/checkpoint.hpp: sharded checkpoints. A save writes named tensors, dtensors, numbers
// and strings into a directory: metadata.json (global shapes, element types, layouts, which
// block of each tensor each shard file holds) and one shard file per block, written by the
// place that holds it, all places at once. A load fills tensors of any mesh and layout: each
// place reads only the blocks, and the parts of them, that its new shard needs.

// ---- pdo/io/file.hpp
#ifndef PDO_SINGLE_PDO_IO_FILE_HPP
#define PDO_SINGLE_PDO_IO_FILE_HPP
// pdo/io/file.hpp: what every file format of pdo::io shares: element type names, the
// checksum of stored bytes, and files read and written whole or at an offset, whose
// failures are pdo::io_errors naming the file.


#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace pdo::io {

static_assert(std::endian::native == std::endian::little,
              "pdo: io: checkpoints, safetensors and .npy files hold little-endian data; this host is not little-endian");

namespace detail {

/// @brief The name of an element type in checkpoint metadata ("float32", "int64", ...).
template <class T>
constexpr std::string_view stored_dtype() {
  if constexpr (std::is_floating_point_v<T>) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "pdo: io: floating-point elements are float or double");
    return sizeof(T) == 4 ? "float32" : "float64";
  } else {
    constexpr bool s = std::is_signed_v<T>;
    if constexpr (sizeof(T) == 1) return s ? "int8" : "uint8";
    else if constexpr (sizeof(T) == 2) return s ? "int16" : "uint16";
    else if constexpr (sizeof(T) == 4) return s ? "int32" : "uint32";
    else return s ? "int64" : "uint64";
  }
}

/// @brief A 64-bit checksum of `n` bytes: four lanes of 8-byte words, each word multiplied
/// into its lane and rotated, then the lanes and the length mixed. It reads memory at the
/// speed of the memory bus, so checking what is read costs little beside the read itself.
inline std::uint64_t checksum(const void* data, std::size_t n, std::uint64_t seed = 0) {
  constexpr std::uint64_t k1 = 0x9E3779B97F4A7C15ull, k2 = 0xC2B2AE3D27D4EB4Full, k3 = 0x165667B19E3779F9ull;
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t lane[4] = {seed + k1, seed + k2, seed ^ k3, seed - k1};
  auto word = [](const unsigned char* q) {
    std::uint64_t w;
    std::memcpy(&w, q, 8);
    return w;
  };
  auto round = [](std::uint64_t acc, std::uint64_t w) { return std::rotl(acc + w * k2, 31) * k1; };
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int l = 0; l < 4; ++l) lane[l] = round(lane[l], word(p + i + 8 * static_cast<std::size_t>(l)));
  std::uint64_t h = std::rotl(lane[0], 1) + std::rotl(lane[1], 7) + std::rotl(lane[2], 12) + std::rotl(lane[3], 18);
  for (int l = 0; l < 4; ++l) h = (h ^ round(0, lane[l])) * k1 + k3;
  h += n;
  for (; i + 8 <= n; i += 8) h = std::rotl(h ^ round(0, word(p + i)), 27) * k1 + k3;
  for (; i < n; ++i) h = std::rotl(h ^ (p[i] * k1), 11) * k2;
  h ^= h >> 33;
  h *= k2;
  h ^= h >> 29;
  h *= k3;
  return h ^ (h >> 32);
}

/// @brief An open file: every failure is a pdo::io_error naming it and what was asked.
class file {
 public:
  enum class mode { read, write };
  file(std::filesystem::path path, mode m) : path_(std::move(path)) {
    fd_ = m == mode::read ? ::open(path_.c_str(), O_RDONLY | O_CLOEXEC) : ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail(m == mode::read ? "cannot open it to read" : "cannot create it");
  }
  file(const file&) = delete;
  file& operator=(const file&) = delete;
  ~file() {
    if (fd_ >= 0) ::close(fd_);
  }

  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  [[nodiscard]] std::size_t size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) fail("cannot read its size");
    return static_cast<std::size_t>(st.st_size);
  }
  /// @brief `n` bytes at `offset`; fewer in the file is an io_error saying it is truncated.
  void read_at(void* out, std::size_t n, std::size_t offset) const {
    auto* p = static_cast<char*>(out);
    while (n > 0) {
      const ::ssize_t got = ::pread(fd_, p, n, static_cast<::off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) fail("cannot read " + std::to_string(n) + " bytes at offset " + std::to_string(offset));
      if (got == 0)
        throw io_error("io: " + path_.string() + ": truncated: it ends at byte " + std::to_string(offset) + ", " + std::to_string(n) +
                       " bytes before the end its contents need");
      p += got, n -= static_cast<std::size_t>(got), offset += static_cast<std::size_t>(got);
    }
  }
  void write_at(const void* data, std::size_t n, std::size_t offset) {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const ::ssize_t put = ::pwrite(fd_, p, n, static_cast<::off_t>(offset));
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) fail("cannot write " + std::to_string(n) + " bytes at offset " + std::to_string(offset));
      p += put, n -= static_cast<std::size_t>(put), offset += static_cast<std::size_t>(put);
    }
  }
  /// @brief Waits until what was written is on the disk.
  void flush() {
    if (::fsync(fd_) != 0) fail("cannot flush it to the disk");
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw io_error("io: " + path_.string() + ": " + what + ": " + std::strerror(errno));
  }
  std::filesystem::path path_;
  int fd_ = -1;
};

/// @brief The whole of a small file (metadata, headers) as a string.
inline std::string read_text(const std::filesystem::path& path) {
  const file f(path, file::mode::read);
  std::string text(f.size(), '\0');
  f.read_at(text.data(), text.size(), 0);
  return text;
}

/// @brief Writes `path` safely: `write(file&)` fills a temporary name beside it, which is
/// flushed, then renamed over `path`, so a reader finds the old file or the new one, never a part.
template <class Write>
void write_atomically(const std::filesystem::path& path, Write&& write) {
  std::filesystem::path temporary = path;
  temporary += ".partial";
  {
    file f(temporary, file::mode::write);
    write(f);
    f.flush();
  }
  std::error_code ec;
  std::filesystem::rename(temporary, path, ec);
  if (ec) throw io_error("io: " + path.string() + ": cannot rename " + temporary.string() + " to it: " + ec.message());
}

inline void write_text_atomically(const std::filesystem::path& path, std::string_view text) {
  write_atomically(path, [&](file& f) { f.write_at(text.data(), text.size(), 0); });
}

/// @brief Flushes a directory's entries (new files, renames) to the disk.
inline void flush_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // not every file system lets a directory be opened; its entries then go with the files
  ::fsync(fd);
  ::close(fd);
}

}  // namespace detail
}  // namespace pdo::io
#endif  // PDO_SINGLE_PDO_IO_FILE_HPP

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo::io {

/// @brief How a checkpoint is written.
struct save_options {
  /// @brief Bytes covered by one checksum of a shard file: a load that reads part of a block
  /// reads (and checks) the whole chunks its elements are in.
  std::size_t chunk_bytes = std::size_t{1} << 20;
  /// @brief Wait until every file is on the disk before the checkpoint replaces the old one
  /// (off: faster, but a power failure may leave the new checkpoint incomplete).
  bool flush = true;
};

/// @brief How a checkpoint is read.
struct load_options {
  /// @brief Check every chunk read against its checksum (off: read exactly the bytes needed,
  /// unchecked).
  bool verify = true;
};

/// @brief The part of a tensor one place holds, for checkpoint::add_blocks: where it sits in
/// the whole tensor (`offset`, `shape`) and its elements, row-major in the place's (host)
/// memory; `data` null when the place holds none of it. `write` is false for a copy of a
/// block another place writes (a replica along a data-parallel axis).
template <class T>
struct held_block {
  /// @brief Where the block starts in the whole tensor, one index per dim.
  std::vector<std::size_t> offset, shape;
  /// @var shape
  /// @brief The block's extents, one per dim.

  T* data = nullptr;  ///< the block's elements, row-major, in host memory; null when the place holds none
  bool write = true;  ///< false for a replica of a block another place writes
};

/// @brief What a checkpoint holds under one name (see inspect()).
struct entry_info {
  std::string name;                  ///< the name it was added under
  std::string kind;                  ///< "tensor", "value" (a number) or "text"
  std::string dtype;                 ///< "float32", "int64", ... ("" for text)
  std::vector<std::size_t> shape;    ///< global extents (empty for numbers and text)
  std::string layout;                ///< the layout it was saved from ("" for host tensors)
  std::string mesh;                  ///< the mesh it was saved from ("" for host tensors)
};

namespace detail {

inline constexpr char shard_magic[8] = {'P', 'D', 'O', 'S', 'H', 'A', 'R', 'D'};
inline constexpr std::uint64_t shard_version = 1;
inline constexpr std::size_t shard_header_bytes = 64;
inline constexpr std::size_t shard_data_alignment = 4096;

/// @brief The first 64 bytes of a shard file; then one checksum per chunk of data; then,
/// from the next multiple of 4096 bytes, the block's elements, row-major.
struct shard_header {
  char magic[8];
  std::uint64_t version;
  std::uint64_t data_bytes;
  std::uint64_t chunk_bytes;
  std::uint64_t identity;   ///< checksum of the tensor's name and the block's offset: which block this is
  std::uint64_t checksum;   ///< of the header's other fields and the chunk checksums
  std::uint64_t reserved[2];
};
static_assert(sizeof(shard_header) == shard_header_bytes);

inline std::size_t chunks_of(std::size_t data_bytes, std::size_t chunk_bytes) { return (data_bytes + chunk_bytes - 1) / chunk_bytes; }
inline std::size_t data_offset_of(std::size_t nchunks) {
  const std::size_t used = shard_header_bytes + 8 * nchunks;
  return (used + shard_data_alignment - 1) / shard_data_alignment * shard_data_alignment;
}
inline std::uint64_t header_checksum(shard_header h, const std::vector<std::uint64_t>& chunk_sums) {
  h.checksum = 0;
  return checksum(chunk_sums.data(), chunk_sums.size() * 8, checksum(&h, sizeof h));
}
inline std::uint64_t block_identity(const std::string& name, const std::vector<std::size_t>& offset) {
  std::string key = name;
  for (auto o : offset) key += "/" + std::to_string(o);
  return checksum(key.data(), key.size());
}

/// @brief Writes one block (`bytes` of host memory) as a shard file.
inline void write_shard(const std::filesystem::path& path, const std::string& name, const std::vector<std::size_t>& offset,
                        const void* data, std::size_t bytes, const save_options& o) {
  const std::size_t chunk = std::max<std::size_t>(o.chunk_bytes, 64);
  const std::size_t n = chunks_of(bytes, chunk);
  std::vector<std::uint64_t> sums(n);
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t c = 0; c < n; ++c) sums[c] = checksum(p + c * chunk, std::min(chunk, bytes - c * chunk));
  shard_header h{};
  std::memcpy(h.magic, shard_magic, 8);
  h.version = shard_version;
  h.data_bytes = bytes;
  h.chunk_bytes = chunk;
  h.identity = block_identity(name, offset);
  h.checksum = header_checksum(h, sums);
  file f(path, file::mode::write);
  f.write_at(&h, sizeof h, 0);
  if (n > 0) f.write_at(sums.data(), n * 8, sizeof h);
  const std::size_t at = data_offset_of(n);
  constexpr std::size_t piece = std::size_t{1} << 28;  // one write call moves at most 2 GiB on Linux
  for (std::size_t done = 0; done < bytes; done += piece) f.write_at(p + done, std::min(piece, bytes - done), at + done);
  if (bytes == 0) f.write_at("", 0, at);
  if (o.flush) f.flush();
}

/// @brief One saved block of a tensor, as the metadata describes it.
struct block_meta {
  std::string file;
  std::vector<std::size_t> offset, shape;
};

/// @brief The last chunk read and checked whole, for the runs that want parts of it.
struct chunk_cache {
  std::size_t chunk = static_cast<std::size_t>(-1);
  std::vector<unsigned char> bytes;
};

/// @brief A shard file opened to read, its header checked against what the metadata says.
class shard_reader {
 public:
  shard_reader(const std::filesystem::path& path, const std::string& name, const block_meta& b, std::size_t element_bytes)
      : f_(path, file::mode::read) {
    const std::string where = "io: " + path.string() + " (tensor \"" + name + "\", block at " + pdo::detail::format_extents(b.offset) + "): ";
    if (f_.size() < shard_header_bytes) throw io_error(where + "truncated: " + std::to_string(f_.size()) + " bytes, shorter than a shard header");
    f_.read_at(&h_, sizeof h_, 0);
    if (std::memcmp(h_.magic, shard_magic, 8) != 0) throw io_error(where + "not a pdo shard file (its first bytes are not PDOSHARD)");
    if (h_.version != shard_version)
      throw io_error(where + "shard format version " + std::to_string(h_.version) + ", this pdo reads version " + std::to_string(shard_version));
    std::size_t expected = 0;
    try {
      expected = pdo::detail::checked_volume(b.shape, "a block", element_bytes) * element_bytes;
    } catch (const pdo::error& e) {
      throw io_error(where + "the metadata is corrupt: " + e.what());
    }
    if (h_.data_bytes != expected)
      throw io_error(where + "the metadata does not match the shard: the block " + pdo::detail::format_extents(b.shape) + " needs " +
                     std::to_string(expected) + " bytes, the file holds " + std::to_string(h_.data_bytes));
    if (h_.identity != block_identity(name, b.offset))
      throw io_error(where + "the metadata does not match the shard: the file holds another tensor's block, or another block");
    if (h_.chunk_bytes == 0) throw io_error(where + "corrupt header (chunk size 0)");
    sums_.resize(chunks_of(h_.data_bytes, h_.chunk_bytes));
    data_at_ = data_offset_of(sums_.size());
    const std::size_t need = data_at_ + h_.data_bytes;
    if (f_.size() < need)
      throw io_error(where + "truncated: " + std::to_string(f_.size()) + " bytes, its block needs " + std::to_string(need));
    if (f_.size() > need)
      throw io_error(where + "the metadata does not match the shard: " + std::to_string(f_.size() - need) + " bytes more than its block");
    if (!sums_.empty()) f_.read_at(sums_.data(), sums_.size() * 8, sizeof h_);
    if (header_checksum(h_, sums_) != h_.checksum) throw io_error(where + "corrupt: the header's checksum does not match");
    where_ = where;
  }

  /// @brief Bytes [from, to) of the block's data into `out`. With `verify`, every chunk they
  /// touch is checked: whole chunks are read straight into `out` and checked there; a chunk
  /// only partly wanted is read into `cache` (which keeps the last one, for the next run).
  void read(std::size_t from, std::size_t to, unsigned char* out, bool verify, chunk_cache& cache) const {
    if (!verify) {
      if (to > from) f_.read_at(out, to - from, data_at_ + from);
      return;
    }
    const std::size_t cb = h_.chunk_bytes, total = h_.data_bytes;
    std::size_t at = from;
    while (at < to) {
      const std::size_t c = at / cb, start = c * cb, end = std::min(start + cb, total);
      if (at == start && end <= to) {  // whole chunks from here on: straight into out
        const std::size_t last = to == total ? total : to / cb * cb;
        f_.read_at(out + (at - from), last - at, data_at_ + at);
        for (std::size_t k = c; k * cb < last; ++k) check_chunk(k, out + (k * cb - from));
        at = last;
        continue;
      }
      if (cache.chunk != c) {
        cache.bytes.resize(end - start);
        f_.read_at(cache.bytes.data(), end - start, data_at_ + start);
        check_chunk(c, cache.bytes.data());
        cache.chunk = c;
      }
      const std::size_t n = std::min(to, end) - at;
      std::memcpy(out + (at - from), cache.bytes.data() + (at - start), n);
      at += n;
    }
  }
  [[nodiscard]] std::size_t chunk_bytes() const { return h_.chunk_bytes; }

 private:
  void check_chunk(std::size_t c, const unsigned char* data) const {
    const std::size_t cb = h_.chunk_bytes, n = std::min<std::size_t>(cb, h_.data_bytes - c * cb);
    if (checksum(data, n) != sums_[c])
      throw io_error(where_ + "corrupt: bytes " + std::to_string(c * cb) + " to " + std::to_string(c * cb + n) +
                     " of its data do not match their checksum");
  }
  file f_;
  shard_header h_{};
  std::vector<std::uint64_t> sums_;
  std::size_t data_at_ = 0;
  std::string where_;
};

/// @brief A tensor's entry in the metadata, read back.
struct tensor_meta {
  std::string name, dtype;
  std::vector<std::size_t> shape;
  std::vector<block_meta> blocks;
};

/// @brief The elements [offset, offset + extents) of the saved tensor `t` into `out`, a dense
/// row-major host buffer of `extents`: from every saved block that overlaps them, only the
/// runs they need (and, when verifying, the whole chunks they touch), consecutive runs read at once.
template <class T, std::size_t R>
void read_region(const std::filesystem::path& dir, const tensor_meta& t, const shape_t<R>& offset, const shape_t<R>& extents, T* out,
                 const load_options& o) {
  const std::size_t want = pdo::detail::volume(extents);
  if (want == 0) return;
  std::size_t covered = 0;
  for (const block_meta& b : t.blocks) {
    shape_t<R> lo{}, hi{}, bshape{}, boff{};
    bool empty = false;
    for (std::size_t d = 0; d < R; ++d) {
      bshape[d] = b.shape[d], boff[d] = b.offset[d];
      lo[d] = std::max(offset[d], boff[d]);
      hi[d] = std::min(offset[d] + extents[d], boff[d] + bshape[d]);
      empty = empty || lo[d] >= hi[d];
    }
    if (empty) continue;
    shape_t<R> inter{}, in_block{}, in_out{};
    for (std::size_t d = 0; d < R; ++d) inter[d] = hi[d] - lo[d], in_block[d] = lo[d] - boff[d], in_out[d] = lo[d] - offset[d];
    covered += pdo::detail::volume(inter);
    // the runs, as (offset in the block, offset in out, length), consecutive ones merged
    struct run {
      std::size_t src, dst, n;
    };
    std::vector<std::size_t> dst;
    pdo::detail::for_each_block_run(extents, in_out, inter, [&](std::size_t big, std::size_t, std::size_t) { dst.push_back(big); });
    std::vector<run> runs;
    std::size_t i = 0;
    pdo::detail::for_each_block_run(bshape, in_block, inter, [&](std::size_t big, std::size_t, std::size_t n) {
      const std::size_t d = dst[i++];
      if (!runs.empty() && runs.back().src + runs.back().n == big && runs.back().dst + runs.back().n == d) runs.back().n += n;
      else runs.push_back({big, d, n});
    });
    const shard_reader reader(dir / b.file, t.name, b, sizeof(T));
    chunk_cache cache;
    for (const run& r : runs)
      reader.read(r.src * sizeof(T), (r.src + r.n) * sizeof(T), reinterpret_cast<unsigned char*>(out + r.dst), o.verify, cache);
  }
  if (covered != want)
    throw io_error("io: " + (dir / "metadata.json").string() + ": tensor \"" + t.name + "\": its blocks cover " + std::to_string(covered) +
                   " of the " + std::to_string(want) + " elements asked for: the metadata does not match the shards");
}

/// @brief The checkpoint being written: its directory, its metadata, the first failure.
struct save_context {
  std::filesystem::path dir;
  save_options options;
  nlohmann::ordered_json entries = nlohmann::ordered_json::object();
  bool writer = true;        ///< this process writes the host tensors and the metadata
  std::size_t index = 0;     ///< the entry's position: its shard files' names
  /// @brief Each element becomes its largest value over the checkpoint's processes (they all
  /// call it, in the same order); absent in a checkpoint of one process.
  std::function<void(std::span<long long>)> max_over_processes;
  std::optional<pdo::detail::captured_error> failure;
  void fail() {
    if (!failure) failure = pdo::detail::captured_error::current();
  }
};

/// @brief The checkpoint being read.
struct load_context {
  std::filesystem::path dir;
  load_options options;
  nlohmann::ordered_json entries;
  /// @brief The first pass of a load: each entry only checks that the checkpoint holds it as
  /// what it is loaded into (kind, element type, shape), changing nothing.
  bool checking = false;
  std::optional<pdo::detail::captured_error> failure;
  void fail() {
    if (!failure) failure = pdo::detail::captured_error::current();
  }
  /// @brief The metadata of entry `name`, or an io_error listing what the checkpoint holds.
  const nlohmann::ordered_json& entry(const std::string& name) const {
    const auto it = entries.find(name);
    if (it == entries.end()) {
      std::string held;
      for (const auto& [k, v] : entries.items()) held += (held.empty() ? "" : ", ") + k;
      throw io_error("io: " + (dir / "metadata.json").string() + ": no entry named \"" + name + "\" (it holds: " + (held.empty() ? "nothing" : held) + ")");
    }
    return *it;
  }
  [[nodiscard]] std::string where(const std::string& name) const { return "io: load of \"" + name + "\" from " + dir.string() + ": "; }
};

inline std::vector<std::size_t> sizes_of(const nlohmann::ordered_json& j, const std::string& what) {
  if (!j.is_array()) throw io_error("io: metadata: " + what + " is not a list of extents");
  std::vector<std::size_t> out;
  for (const auto& e : j) {
    if (!e.is_number_unsigned()) throw io_error("io: metadata: " + what + " holds " + e.dump() + ", not an extent");
    out.push_back(e.get<std::size_t>());
  }
  return out;
}

/// @brief Entry `name` of the metadata as a tensor of element type `dtype` and shape
/// `shape`; anything else is an io_error naming the tensor and both.
inline tensor_meta tensor_entry(const load_context& c, const std::string& name, std::string_view dtype, const std::vector<std::size_t>& shape) {
  const auto& e = c.entry(name);
  tensor_meta t;
  t.name = name;
  try {
    if (e.at("kind") != "tensor") throw io_error(c.where(name) + "it is a " + e.at("kind").get<std::string>() + " in the checkpoint, not a tensor");
    t.dtype = e.at("dtype").get<std::string>();
    t.shape = sizes_of(e.at("shape"), "the shape of \"" + name + "\"");
    for (const auto& b : e.at("blocks")) {
      block_meta m{b.at("file").get<std::string>(), sizes_of(b.at("offset"), "a block offset of \"" + name + "\""),
                   sizes_of(b.at("shape"), "a block shape of \"" + name + "\"")};
      if (m.file.empty() || m.file.find('/') != std::string::npos || m.file == "." || m.file == "..")
        throw io_error(c.where(name) + "the metadata's block " + b.dump() + " names the file \"" + m.file +
                       "\", which is not a file of the checkpoint's folder");
      bool inside = m.offset.size() == t.shape.size() && m.shape.size() == t.shape.size();
      for (std::size_t d = 0; inside && d < t.shape.size(); ++d) inside = m.shape[d] <= t.shape[d] && m.offset[d] <= t.shape[d] - m.shape[d];
      if (!inside)
        throw io_error(c.where(name) + "the metadata's block " + b.dump() + " does not fit its shape " + pdo::detail::format_extents(t.shape));
      t.blocks.push_back(std::move(m));
    }
  } catch (const nlohmann::json::exception& x) {
    throw io_error(c.where(name) + "its metadata is malformed: " + x.what());
  }
  if (t.dtype != dtype)
    throw io_error(c.where(name) + "it holds " + t.dtype + " elements, the tensor it is loaded into " + std::string(dtype) + " ones");
  if (t.shape != shape)
    throw io_error(c.where(name) + "its global shape is " + pdo::detail::format_extents(t.shape) + ", the tensor it is loaded into has " +
                   pdo::detail::format_extents(shape));
  return t;
}

/// @brief A number as the metadata keeps it: exactly, as JSON's number; a floating-point
/// infinity or NaN, which JSON has no number for, as the string "inf", "-inf" or "nan".
template <class V>
nlohmann::ordered_json number_json(V v) {
  if constexpr (std::is_floating_point_v<V>) {
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  }
  return v;
}

/// @brief The number entry `name` holds (see number_json), or an io_error naming it.
template <class V>
V number_of(const load_context& c, const std::string& name, const nlohmann::ordered_json& j) {
  if constexpr (std::is_floating_point_v<V>) {
    if (j.is_string()) {
      const auto& s = j.get_ref<const std::string&>();
      if (s == "nan") return std::numeric_limits<V>::quiet_NaN();
      if (s == "inf") return std::numeric_limits<V>::infinity();
      if (s == "-inf") return -std::numeric_limits<V>::infinity();
    }
    if (j.is_number()) return j.get<V>();
  } else if constexpr (std::is_signed_v<V>) {
    if (j.is_number_integer()) {
      const auto x = j.get<std::int64_t>();
      if (x >= std::numeric_limits<V>::min() && x <= std::numeric_limits<V>::max()) return static_cast<V>(x);
    }
  } else {
    if (j.is_number_unsigned()) {
      const auto x = j.get<std::uint64_t>();
      if (x <= std::numeric_limits<V>::max()) return static_cast<V>(x);
    }
  }
  throw io_error(c.where(name) + "its value in the metadata is " + j.dump() + ", not a " + std::string(stored_dtype<V>()));
}

/// @brief A string entry must be valid UTF-8 (JSON text): an io_error naming it when not,
/// before anything is written.
inline void check_text(const std::string& name, const std::string& text) {
  try {
    (void)nlohmann::ordered_json(text).dump();
  } catch (const nlohmann::json::exception&) {
    throw io_error("io: save of \"" + name + "\": the string is not valid UTF-8 text (a checkpoint keeps strings in its JSON "
                   "metadata); keep bytes in a tensor of std::uint8_t");
  }
}

/// @brief Each element of `v` becomes its largest value over the processes of `m` (each
/// process passes its own): how they learn that one of them failed, and what the others
/// wrote. In a mesh of one process, `v` is left as it is.
template <class Mesh>
void max_over_processes(const Mesh& m, std::span<long long> v) {
  if (!m.is_multiprocess()) return;
  std::vector<long long> result(v.begin(), v.end());
  pdo::detail::run_on_places("checkpoint", m, [&](std::size_t p, std::size_t k) {
    std::vector<long long> x(v.begin(), v.end());
    host_communicator_of(m, p).all_reduce(std::span<long long>(x), reduce_op::max);
    if (k == 0) result = std::move(x);
  });
  std::copy(result.begin(), result.end(), v.begin());
}

}  // namespace detail

/// @brief The named things one save writes and one load fills: tensors (host), dtensors (of
/// any mesh and layout), numbers and strings (a step counter, an RNG's state). It refers to
/// them; they must outlive it. Every process of a mesh builds the same checkpoint and calls
/// save (or load) with it together.
class checkpoint {
 public:
  /// @brief A host tensor: saved by one process, loaded whole by every process.
  template <element T, std::size_t R>
  checkpoint& add(std::string name, tensor<T, R>& t) {
    check_name(name);
    entries_.push_back({std::move(name), [&t](detail::save_context& c, const std::string& n) { save_host(c, n, t); },
                        [&t](detail::load_context& c, const std::string& n) { load_host(c, n, t); }});
    return *this;
  }

  /// @brief A dtensor: each place writes the blocks it holds (partial sums are reduced
  /// first); a load fills each local shard from the blocks it overlaps, whatever the mesh and
  /// layout the checkpoint was saved from.
  template <element T, std::size_t R, mesh_type Mesh, layout_spec L>
  checkpoint& add(std::string name, dtensor<T, R, Mesh, L>& x) {
    check_name(name);
    spanning(x.mesh());
    entries_.push_back({std::move(name), [&x](detail::save_context& c, const std::string& n) { save_distributed(c, n, x); },
                        [&x](detail::load_context& c, const std::string& n) { load_distributed(c, n, x); }});
    return *this;
  }

  /// @brief A tensor of global `shape` held in blocks by the places of `m` (CPU places), as
  /// `block(p)` says for each place p of this process: the stages of a pipeline, their shards
  /// along "tp", an optimizer's moments laid out as the parameters. On save each place writes
  /// its block at once, then the places tell each other what they wrote, so the metadata lists
  /// every block; a load fills each place's block from the saved blocks it overlaps, whatever
  /// the blocks were when it was saved.
  template <element T, std::size_t R, mesh_type Mesh>
  checkpoint& add_blocks(std::string name, const Mesh& m, const shape_t<R>& shape, std::function<held_block<T>(std::size_t)> block) {
    check_name(name);
    spanning(m);
    entries_.push_back({std::move(name), [m, shape, block](detail::save_context& c, const std::string& n) { save_blocks<T, R>(c, n, m, shape, block); },
                        [m, shape, block](detail::load_context& c, const std::string& n) { load_blocks<T, R>(c, n, m, shape, block); }});
    return *this;
  }

  /// @brief A number (a step counter, a learning rate), kept in the metadata exactly.
  template <class V>
    requires(std::is_arithmetic_v<V> && !std::is_same_v<V, bool>)
  checkpoint& add(std::string name, V& value) {
    return add_computed<V>(std::move(name), [&value] { return value; }, [&value](V v) { value = v; });
  }

  /// @brief A host tensor of `shape` made when the checkpoint is saved (`get`, called on
  /// every process: it may gather) and handed to `set` when it is loaded: for state that
  /// lives elsewhere (a model's parameters, an optimizer's moments).
  template <element T, std::size_t R>
  checkpoint& add_computed(std::string name, const shape_t<R>& shape, std::function<tensor<T, R>()> get,
                           std::function<void(const tensor<T, R>&)> set) {
    check_name(name);
    entries_.push_back({std::move(name), [get](detail::save_context& c, const std::string& n) { save_host(c, n, get()); },
                        [set, shape](detail::load_context& c, const std::string& n) {
                          if (c.checking) {
                            detail::tensor_entry(c, n, detail::stored_dtype<T>(), {shape.begin(), shape.end()});
                            return;
                          }
                          auto t = tensor<T, R>::on_host(shape);
                          load_host(c, n, t);
                          set(t);
                        }});
    return *this;
  }

  /// @brief A number made when the checkpoint is saved and handed to `set` when it is loaded.
  /// An `optional` entry may be absent from the checkpoint loaded (one saved before the entry
  /// was added to a state): `set` is then not called.
  template <class V>
    requires(std::is_arithmetic_v<V> && !std::is_same_v<V, bool>)
  checkpoint& add_computed(std::string name, std::function<V()> get, std::function<void(V)> set, bool optional = false) {
    check_name(name);
    entries_.push_back({std::move(name),
                        [get](detail::save_context& c, const std::string& n) {
                          c.entries[n] = {{"kind", "value"}, {"dtype", std::string(detail::stored_dtype<V>())}, {"value", detail::number_json(get())}};
                        },
                        [set, optional](detail::load_context& c, const std::string& n) {
                          if (optional && !c.entries.contains(n)) return;
                          const auto& e = c.entry(n);
                          if (e.value("kind", "") != "value" || e.value("dtype", "") != detail::stored_dtype<V>())
                            throw io_error(c.where(n) + "it is " + e.value("kind", "?") + " " + e.value("dtype", "?") +
                                           " in the checkpoint, not a " + std::string(detail::stored_dtype<V>()) + " value");
                          const V v = detail::number_of<V>(c, n, e.at("value"));
                          if (!c.checking) set(v);
                        }});
    return *this;
  }

  /// @brief The processes of `m` save and load this checkpoint together: they learn of each
  /// other's failures, and the process of m's first place writes the host tensors and the
  /// metadata. Adding a dtensor does this for its mesh (the first mesh added counts).
  template <mesh_type Mesh>
  checkpoint& spanning(const Mesh& m) {
    if (!agree_) {
      agree_ = [m](std::span<long long> v) { detail::max_over_processes(m, v); };
      writer_ = m.place(0).is_local();
      rank_ = m.local_places().empty() ? 0 : m.place(m.local_places().front()).process();
    }
    return *this;
  }

  /// @brief A string (an RNG's state written with operator<<, a data loader's position).
  checkpoint& add(std::string name, std::string& text) {
    check_name(name);
    entries_.push_back({std::move(name),
                        [&text](detail::save_context& c, const std::string& n) {
                          detail::check_text(n, text);
                          c.entries[n] = {{"kind", "text"}, {"value", text}};
                        },
                        [&text](detail::load_context& c, const std::string& n) {
                          const auto& e = c.entry(n);
                          if (e.value("kind", "") != "text" || !e.contains("value") || !e["value"].is_string())
                            throw io_error(c.where(n) + "it is not text in the checkpoint");
                          if (!c.checking) text = e["value"].get<std::string>();
                        }});
    return *this;
  }

  /// @brief The number of entries added so far (one per add, add_blocks or add_computed call).
  [[nodiscard]] std::size_t size() const { return entries_.size(); }

  /// @brief Writes every entry into `dir` safely: into `dir` + ".partial" first, flushed,
  /// then swapped in for `dir` in one rename, so `dir` holds the old checkpoint or the new
  /// one, never a part. `dir` must not exist, be empty, or hold a checkpoint (pdo replaces
  /// nothing else). Any failure is a pdo::io_error, on every process, and leaves `dir` as
  /// it was and no `dir` + ".partial".
  void save(const std::filesystem::path& dir, const save_options& o = {}) const {
    pdo::detail::check_not_nested("io::save");
    if (dir.empty()) throw io_error("io: save: the checkpoint's path is empty");
    detail::save_context c;
    c.options = o;
    c.writer = writer_;
    c.max_over_processes = agree_;
    std::filesystem::path target = std::filesystem::absolute(dir).lexically_normal();
    if (!target.has_filename()) target = target.parent_path();  // "ckpt/" is "ckpt"
    c.dir = target;
    c.dir += ".partial";
    // a failure after the staging directory was made removes it (every process has stopped writing by then)
    const auto settle = [&] {
      try {
        agree(c.failure, "save", target);
      } catch (...) {
        std::error_code ec;
        if (c.writer) std::filesystem::remove_all(c.dir, ec);
        throw;
      }
    };
    try {  // a fresh staging directory (the writer clears what a failed save left)
      if (c.writer) {
        check_target(target);
        std::filesystem::remove_all(c.dir);
      }
    } catch (const std::filesystem::filesystem_error& e) {
      c.failure = pdo::detail::captured_error{error_kind::io, "io: save: cannot clear " + c.dir.string() + ": " + e.code().message()};
    } catch (...) {
      c.fail();
    }
    agree(c.failure, "save", target);
    try {
      std::filesystem::create_directories(c.dir);
    } catch (const std::filesystem::filesystem_error& e) {
      if (!c.failure) c.failure = pdo::detail::captured_error{error_kind::io, "io: save: cannot create " + c.dir.string() + ": " + e.code().message()};
    }
    // every entry runs, failed or not: a dtensor's partial sums are collectives every process joins
    for (const auto& e : entries_) {
      try {
        e.save(c, e.name);
      } catch (...) {
        c.fail();
      }
      ++c.index;
    }
    settle();
    if (c.writer) {
      try {
        nlohmann::ordered_json meta = {{"format", "pdo-checkpoint"}, {"version", 1}, {"entries", c.entries}};
        std::string text;
        try {
          text = meta.dump(1);
        } catch (const nlohmann::json::exception& e) {
          throw io_error("io: save of " + target.string() + ": the metadata cannot be written as JSON (an entry's name that is not UTF-8?): " +
                         e.what());
        }
        detail::write_text_atomically(c.dir / "metadata.json", text);
        detail::flush_directory(c.dir);
        commit(c.dir, target);
      } catch (...) {
        c.fail();
      }
    }
    settle();
  }

  /// @brief Fills every entry from the checkpoint in `dir`; a missing, corrupt or truncated
  /// file, metadata that does not match the shards, or an entry of another global shape or
  /// element type is a pdo::io_error naming the file, the entry and what is wrong, on every
  /// process. Every entry's metadata is checked first: a checkpoint that lacks an entry, or
  /// holds one of another kind, element type or shape, loads nothing. A shard file found
  /// corrupt while the data is read fails the load with the entries before it filled.
  void load(const std::filesystem::path& dir, const load_options& o = {}) {
    pdo::detail::check_not_nested("io::load");
    detail::load_context c;
    c.dir = dir;
    c.options = o;
    try {
      c.entries = read_metadata(dir).at("entries");
    } catch (...) {
      c.fail();
    }
    for (const bool checking : {true, false}) {
      c.checking = checking;
      if (!c.failure)
        for (const auto& e : entries_) {
          try {
            e.load(c, e.name);
          } catch (const nlohmann::json::exception& x) {
            if (!c.failure) c.failure = pdo::detail::captured_error{error_kind::io, c.where(e.name) + "its metadata is malformed: " + x.what()};
          } catch (...) {
            c.fail();
          }
        }
      agree(c.failure, "load", dir);
    }
  }

  /// @brief The metadata of the checkpoint in `dir` (an io_error when it is missing or not one).
  static nlohmann::ordered_json read_metadata(const std::filesystem::path& dir) {
    const auto path = dir / "metadata.json";
    if (!std::filesystem::exists(path)) {
      std::filesystem::path partial = dir;
      partial += ".partial";
      throw io_error("io: " + path.string() + ": missing: " + dir.string() + " holds no checkpoint" +
                     (std::filesystem::exists(partial) ? " (" + partial.string() + " is an unfinished save)" : ""));
    }
    nlohmann::ordered_json meta;
    try {
      meta = nlohmann::ordered_json::parse(detail::read_text(path));
    } catch (const nlohmann::json::exception& e) {
      throw io_error("io: " + path.string() + ": not valid JSON: " + e.what());
    }
    if (!meta.is_object() || !meta.contains("format") || meta["format"] != "pdo-checkpoint" || !meta.contains("entries") ||
        !meta["entries"].is_object())
      throw io_error("io: " + path.string() + ": not the metadata of a pdo checkpoint");
    if (!meta.contains("version") || meta["version"] != 1)
      throw io_error("io: " + path.string() + ": checkpoint format version " + meta["version"].dump() + ", this pdo reads version 1");
    return meta;
  }

 private:
  struct entry {
    std::string name;
    std::function<void(detail::save_context&, const std::string&)> save;
    std::function<void(detail::load_context&, const std::string&)> load;
  };

  void check_name(const std::string& name) const {
    if (name.empty()) throw io_error("io: checkpoint: an entry needs a name");
    for (const auto& e : entries_)
      if (e.name == name) throw io_error("io: checkpoint: two entries are named \"" + name + "\"");
  }

  /// @brief Every process learns whether one of them failed: the one that did throws its own
  /// error, the others an io_error naming it.
  void agree(const std::optional<pdo::detail::captured_error>& failure, const char* op, const std::filesystem::path& dir) const {
    long long failed = failure ? rank_ + 1 : 0;
    if (agree_) agree_(std::span<long long>(&failed, 1));
    if (failure) failure->rethrow_with_context("");
    if (failed > 0)
      throw io_error(std::string("io: ") + op + " of " + dir.string() + ": process " + std::to_string(failed - 1) +
                     " failed (its error says why); nothing was " + (op[0] == 's' ? "replaced" : "loaded reliably"));
  }

  /// @brief An io_error unless `target` is absent, an empty directory or a checkpoint's: a
  /// save replaces only a checkpoint (what it replaces is removed).
  static void check_target(const std::filesystem::path& target) {
    const auto st = std::filesystem::status(target);
    if (!std::filesystem::exists(st)) return;
    if (!std::filesystem::is_directory(st))
      throw io_error("io: save: " + target.string() + " exists and is not a directory (a checkpoint is a directory); it was left as it is: " +
                     "save to another path");
    if (!std::filesystem::exists(target / "metadata.json") && !std::filesystem::is_empty(target))
      throw io_error("io: save: " + target.string() + " is a directory that holds no pdo checkpoint (no metadata.json); a save replaces " +
                     "only a checkpoint, so it was left as it is: save to another path, or empty it");
  }

  /// @brief `staged` becomes `target`; the checkpoint `target` held, if any, is removed.
  static void commit(const std::filesystem::path& staged, const std::filesystem::path& target) {
    std::error_code ec;
    if (std::filesystem::exists(target)) {
      // one atomic swap where the system has it; else two renames, the old one kept until the new is in
      if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0) {
        std::filesystem::path old = target;
        old += ".old";
        std::filesystem::remove_all(old, ec);
        std::filesystem::rename(target, old, ec);
        if (ec) throw io_error("io: save: cannot move the old checkpoint " + target.string() + " aside: " + ec.message());
        std::filesystem::rename(staged, target, ec);
        if (ec) {
          std::error_code back;
          std::filesystem::rename(old, target, back);  // the old checkpoint where it was
          throw io_error("io: save: cannot rename " + staged.string() + " to " + target.string() + ": " + ec.message());
        }
        std::filesystem::remove_all(old, ec);
      } else {
        std::filesystem::remove_all(staged, ec);  // the old checkpoint, now under the staging name
      }
    } else {
      std::filesystem::rename(staged, target, ec);
      if (ec) throw io_error("io: save: cannot rename " + staged.string() + " to " + target.string() + ": " + ec.message());
    }
    detail::flush_directory(target.parent_path());
  }

  /// @brief The first failure of this process's places (one per local place) becomes the
  /// save's or load's, unless it has one already; `name_place` puts the place in its message.
  template <class Context, class Mesh>
  static void keep_first_failure(Context& c, const Mesh& m, const std::vector<std::optional<pdo::detail::captured_error>>& failures,
                                 bool name_place) {
    for (std::size_t k = 0; k < failures.size() && !c.failure; ++k)
      if (failures[k]) {
        c.failure = failures[k];
        if (name_place) c.failure->message = "on place " + m.place(m.local_places()[k]).name() + ": " + c.failure->message;
      }
  }

  template <class T, std::size_t R>
  static nlohmann::ordered_json tensor_json(const shape_t<R>& shape) {
    return {{"kind", "tensor"}, {"dtype", std::string(detail::stored_dtype<T>())},
            {"shape", std::vector<std::size_t>(shape.begin(), shape.end())}, {"blocks", nlohmann::ordered_json::array()}};
  }

  template <class T, std::size_t R>
  static void save_host(detail::save_context& c, const std::string& name, const tensor<T, R>& t) {
    auto j = tensor_json<T, R>(t.shape());
    const std::string file = "t" + std::to_string(c.index) + ".bin";
    j["blocks"].push_back({{"file", file}, {"offset", std::vector<std::size_t>(R, 0)}, {"shape", std::vector<std::size_t>(t.shape().begin(), t.shape().end())}});
    j["layout"] = "";
    c.entries[name] = std::move(j);
    if (!c.writer) return;
    const tensor<T, R> staged = t.on_gpu() ? to_host(t) : tensor<T, R>();
    const T* data = t.on_gpu() ? staged.data() : t.data();
    detail::write_shard(c.dir / file, name, std::vector<std::size_t>(R, 0), data, t.bytes(), c.options);
  }

  template <class T, std::size_t R>
  static void load_host(detail::load_context& c, const std::string& name, tensor<T, R>& t) {
    const auto meta = detail::tensor_entry(c, name, detail::stored_dtype<T>(), {t.shape().begin(), t.shape().end()});
    if (c.checking) return;
    if (t.on_gpu()) {
      auto host = tensor<T, R>::on_host(t.shape());
      detail::read_region<T, R>(c.dir, meta, shape_t<R>{}, t.shape(), host.data(), c.options);
      copy(host, t);
    } else {
      detail::read_region<T, R>(c.dir, meta, shape_t<R>{}, t.shape(), t.data(), c.options);
    }
  }

  template <class T, std::size_t R, class Mesh, class L>
  static void save_distributed(detail::save_context& c, const std::string& name, const dtensor<T, R, Mesh, L>& x) {
    pdo::detail::with_sums_done("io::save", x, [&](const auto& whole) {
      const Mesh& m = whole.mesh();
      constexpr pdo::detail::layout_value v = std::remove_cvref_t<decltype(whole)>::layout_value;
      auto j = tensor_json<T, R>(x.shape());
      j["layout"] = pdo::detail::to_string(pdo::detail::value_of<L>());
      j["mesh"] = m.describe();
      auto file_of = [&](std::size_t q) { return "t" + std::to_string(c.index) + ".p" + std::to_string(q) + ".bin"; };
      for (std::size_t q = 0; q < m.size(); ++q) {
        if (!pdo::detail::writes_block(m, v, q)) continue;
        const auto off = whole.local_offset(q), shape = whole.local_shape(q);
        j["blocks"].push_back({{"file", file_of(q)}, {"offset", std::vector<std::size_t>(off.begin(), off.end())},
                               {"shape", std::vector<std::size_t>(shape.begin(), shape.end())}});
      }
      c.entries[name] = std::move(j);
      // every place writes its block at once, each on its own lane
      std::vector<std::optional<pdo::detail::captured_error>> failures(m.local_places().size());
      pdo::detail::run_on_places(
          "io::save", m,
          [&](std::size_t p, std::size_t k) {
            if (!pdo::detail::writes_block(m, v, p)) return;
            try {
              const auto& shard = whole.local_shards()[k];
              const auto off = whole.local_offset(p);
              const tensor<T, R> staged = shard.on_gpu() ? to_host(shard) : tensor<T, R>();
              detail::write_shard(c.dir / file_of(p), name, std::vector<std::size_t>(off.begin(), off.end()),
                                  shard.on_gpu() ? staged.data() : shard.data(), shard.bytes(), c.options);
            } catch (...) {
              failures[k] = pdo::detail::captured_error::current();
            }
          },
          "copy");
      keep_first_failure(c, m, failures, false);
    });
  }

  template <class T, std::size_t R, class Mesh, class L>
  static void load_distributed(detail::load_context& c, const std::string& name, dtensor<T, R, Mesh, L>& x) {
    const auto meta = detail::tensor_entry(c, name, detail::stored_dtype<T>(), {x.shape().begin(), x.shape().end()});
    if (c.checking) return;
    const Mesh& m = x.mesh();
    std::vector<std::optional<pdo::detail::captured_error>> failures(m.local_places().size());
    pdo::detail::run_on_places(
        "io::load", m,
        [&](std::size_t p, std::size_t k) {
          try {
            auto& shard = x.local_shards()[k];
            if (!pdo::detail::holds_partial_value(m, x.layout_value, p)) {
              shard.fill(T{});  // the partial sum's other terms
              return;
            }
            if (shard.on_gpu()) {
              auto host = tensor<T, R>::on_host(shard.shape());
              detail::read_region<T, R>(c.dir, meta, x.local_offset(p), shard.shape(), host.data(), c.options);
              copy(host, shard);
            } else {
              detail::read_region<T, R>(c.dir, meta, x.local_offset(p), shard.shape(), shard.data(), c.options);
            }
          } catch (...) {
            failures[k] = pdo::detail::captured_error::current();
          }
        },
        "copy");
    keep_first_failure(c, m, failures, true);
  }

  /// @brief Place p's block as add_blocks takes it, checked to lie inside `shape`.
  template <class T, std::size_t R, class Mesh>
  static held_block<T> checked_block(const std::string& name, const Mesh& m, const shape_t<R>& shape,
                                     const std::function<held_block<T>(std::size_t)>& block, std::size_t p) {
    held_block<T> b = block(p);
    if (!b.data) return b;
    if (m.place(p).kind() != place_kind::cpu)
      throw io_error("io: \"" + name + "\": add_blocks takes blocks in host memory; place " + m.place(p).name() +
                     " is a GPU place (add its tensors as dtensors)");
    bool inside = b.offset.size() == R && b.shape.size() == R;
    for (std::size_t d = 0; inside && d < R; ++d) inside = b.offset[d] + b.shape[d] <= shape[d];
    if (!inside)
      throw io_error("io: \"" + name + "\": the block of place " + m.place(p).name() + " (offset " + pdo::detail::format_extents(b.offset) +
                     ", shape " + pdo::detail::format_extents(b.shape) + ") does not lie inside the tensor's shape " + pdo::detail::format_extents(shape));
    return b;
  }

  template <class T, std::size_t R, class Mesh>
  static void save_blocks(detail::save_context& c, const std::string& name, const Mesh& m, const shape_t<R>& shape,
                          const std::function<held_block<T>(std::size_t)>& block) {
    auto file_of = [&](std::size_t q) { return "t" + std::to_string(c.index) + ".p" + std::to_string(q) + ".bin"; };
    // per place: whether it wrote a block, then its offset and shape
    constexpr std::size_t record = 1 + 2 * R;
    std::vector<long long> table(m.size() * record, 0);
    std::vector<std::optional<pdo::detail::captured_error>> failures(m.local_places().size());
    pdo::detail::run_on_places(
        "io::save", m,
        [&](std::size_t p, std::size_t k) {
          std::array<long long, record> mine{};
          try {
            const held_block<T> b = checked_block<T, R>(name, m, shape, block, p);
            if (b.data && b.write) {
              std::size_t elements = 1;
              for (std::size_t e : b.shape) elements *= e;
              detail::write_shard(c.dir / file_of(p), name, b.offset, b.data, elements * sizeof(T), c.options);
              mine[0] = 1;
              for (std::size_t d = 0; d < R; ++d) {
                mine[1 + d] = static_cast<long long>(b.offset[d]);
                mine[1 + R + d] = static_cast<long long>(b.shape[d]);
              }
            }
          } catch (...) {
            failures[k] = pdo::detail::captured_error::current();
            mine[0] = 0;
          }
          // every place takes part, failed or not: the others wait for its record
          std::vector<long long> all(table.size());
          host_communicator_of(m, p).all_gather(std::span<const long long>(mine), std::span<long long>(all));
          if (k == 0) table = std::move(all);
        },
        "copy");
    keep_first_failure(c, m, failures, false);
    // the processes that hold no place of `m` (the writer of the metadata among them, maybe)
    // learn the table from those that do
    if (c.max_over_processes) c.max_over_processes(std::span<long long>(table));
    auto j = tensor_json<T, R>(shape);
    j["layout"] = "blocks";
    j["mesh"] = m.describe();
    for (std::size_t q = 0; q < m.size(); ++q) {
      const long long* r = table.data() + q * record;
      if (r[0] == 0) continue;
      j["blocks"].push_back({{"file", file_of(q)}, {"offset", std::vector<std::size_t>(r + 1, r + 1 + R)},
                             {"shape", std::vector<std::size_t>(r + 1 + R, r + 1 + 2 * R)}});
    }
    c.entries[name] = std::move(j);
  }

  template <class T, std::size_t R, class Mesh>
  static void load_blocks(detail::load_context& c, const std::string& name, const Mesh& m, const shape_t<R>& shape,
                          const std::function<held_block<T>(std::size_t)>& block) {
    const auto meta = detail::tensor_entry(c, name, detail::stored_dtype<T>(), {shape.begin(), shape.end()});
    if (c.checking) return;
    std::vector<std::optional<pdo::detail::captured_error>> failures(m.local_places().size());
    pdo::detail::run_on_places(
        "io::load", m,
        [&](std::size_t p, std::size_t k) {
          try {
            const held_block<T> b = checked_block<T, R>(name, m, shape, block, p);
            if (!b.data) return;
            shape_t<R> offset{}, extents{};
            std::copy(b.offset.begin(), b.offset.end(), offset.begin());
            std::copy(b.shape.begin(), b.shape.end(), extents.begin());
            detail::read_region<T, R>(c.dir, meta, offset, extents, b.data, c.options);
          } catch (...) {
            failures[k] = pdo::detail::captured_error::current();
          }
        },
        "copy");
    keep_first_failure(c, m, failures, true);
  }

  std::vector<entry> entries_;
  std::function<void(std::span<long long>)> agree_;  ///< elementwise max over the processes of the first mesh added
  bool writer_ = true;
  long long rank_ = 0;
};

/// @brief Saves `c` into `dir` (see checkpoint::save).
inline void save(const std::filesystem::path& dir, const checkpoint& c, const save_options& o = {}) { c.save(dir, o); }
/// @brief Loads `c` from `dir` (see checkpoint::load).
inline void load(const std::filesystem::path& dir, checkpoint& c, const load_options& o = {}) { c.load(dir, o); }

/// @brief What the checkpoint in `dir` holds, entry by entry.
inline std::vector<entry_info> inspect(const std::filesystem::path& dir) {
  std::vector<entry_info> out;
  const auto meta = checkpoint::read_metadata(dir);
  try {
    for (const auto& [name, e] : meta["entries"].items()) {
      entry_info i{name, e.value("kind", ""), e.value("dtype", ""), {}, e.value("layout", ""), e.value("mesh", "")};
      if (e.contains("shape")) i.shape = detail::sizes_of(e["shape"], "the shape of \"" + name + "\"");
      out.push_back(std::move(i));
    }
  } catch (const nlohmann::json::exception& e) {
    throw io_error("io: " + (dir / "metadata.json").string() + ": malformed: " + e.what());
  }
  return out;
}

/// @brief The tensor `name` of the checkpoint in `dir`, whole, in host memory.
template <element T, std::size_t R>
tensor<T, R> read(const std::filesystem::path& dir, const std::string& name, const load_options& o = {}) {
  shape_t<R> shape{};
  bool found = false;
  for (const auto& e : inspect(dir))
    if (e.name == name) {
      if (e.shape.size() != R)
        throw io_error("io: read of \"" + name + "\" from " + dir.string() + ": it has rank " + std::to_string(e.shape.size()) + ", not " +
                       std::to_string(R));
      std::copy(e.shape.begin(), e.shape.end(), shape.begin());
      found = true;
    }
  if (!found) shape = {};  // the load below names what the checkpoint holds
  auto out = tensor<T, R>::on_host(shape);
  checkpoint c;
  c.add(name, out);
  c.load(dir, o);
  return out;
}

/// @brief The tensor `name` of the checkpoint in `dir` laid out over `m` as `Layout` (any
/// layout: each place reads only what its shard needs).
template <element T, std::size_t R, layout_spec Layout, mesh_type Mesh>
dtensor<T, R, Mesh, Layout> read(const std::filesystem::path& dir, const std::string& name, const Mesh& m, const load_options& o = {}) {
  static_assert(sizeof(pdo::detail::check_layout<"io::read", Layout, Mesh, R>) != 0);
  shape_t<R> shape{};
  for (const auto& e : inspect(dir))
    if (e.name == name) {
      if (e.shape.size() != R)
        throw io_error("io: read of \"" + name + "\" from " + dir.string() + ": it has rank " + std::to_string(e.shape.size()) + ", not " +
                       std::to_string(R));
      std::copy(e.shape.begin(), e.shape.end(), shape.begin());
    }
  std::vector<tensor<T, R>> shards;
  for (std::size_t p : m.local_places())
    shards.emplace_back(pdo::detail::shard_shape(m, pdo::detail::value_of<Layout>(), shape, p), m.place(p), pdo::detail::uninitialized);
  dtensor<T, R, Mesh, Layout> out(m, shape, std::move(shards));
  checkpoint c;
  c.add(name, out);
  c.load(dir, o);
  return out;
}

}  // namespace pdo::io
#endif  // PDO_SINGLE_PDO_IO_CHECKPOINT_HPP
// ---- pdo/io/npy.hpp
#ifndef PDO_SINGLE_PDO_IO_NPY_HPP
#define PDO_SINGLE_PDO_IO_NPY_HPP
// pdo/io/npy.hpp: single tensors in NumPy's .npy format (numpy.save / numpy.load), C order,
// little-endian.


#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

namespace pdo::io {

namespace detail {

/// @brief NumPy's type string of T ("<f4", "<i8", "|u1").
template <class T>
std::string npy_descr() {
  const char kind = std::is_floating_point_v<T> ? 'f' : (std::is_signed_v<T> ? 'i' : 'u');
  return std::string(1, sizeof(T) == 1 ? '|' : '<') + kind + std::to_string(sizeof(T));
}

/// @brief The three keys of an .npy header, read from its Python dict literal.
struct npy_header {
  std::string descr;
  bool fortran_order = false;
  std::vector<std::size_t> shape;
  std::size_t data_offset = 0;
};

inline npy_header parse_npy_header(const std::filesystem::path& path, const std::string& text, std::size_t data_offset) {
  auto bad = [&](const std::string& what) { return io_error("io: " + path.string() + ": not a valid .npy header (" + what + "): " + text); };
  auto value_of = [&](const std::string& key) {
    const auto k = text.find("'" + key + "'");
    if (k == std::string::npos) throw bad("no '" + key + "'");
    auto at = text.find(':', k);
    if (at == std::string::npos) throw bad("no value for '" + key + "'");
    ++at;
    while (at < text.size() && text[at] == ' ') ++at;
    return at;
  };
  npy_header h;
  h.data_offset = data_offset;
  std::size_t at = value_of("descr");
  if (at >= text.size() || (text[at] != '\'' && text[at] != '"')) throw bad("descr is not a string");
  const auto close = text.find(text[at], at + 1);
  if (close == std::string::npos) throw bad("descr is not closed");
  h.descr = text.substr(at + 1, close - at - 1);
  at = value_of("fortran_order");
  if (text.compare(at, 4, "True") == 0) h.fortran_order = true;
  else if (text.compare(at, 5, "False") != 0) throw bad("fortran_order is neither True nor False");
  at = value_of("shape");
  if (at >= text.size() || text[at] != '(') throw bad("shape is not a tuple");
  const auto end = text.find(')', at);
  if (end == std::string::npos) throw bad("shape is not closed");
  std::size_t i = at + 1;
  while (i < end) {
    while (i < end && (text[i] == ' ' || text[i] == ',')) ++i;
    if (i >= end) break;
    if (!std::isdigit(static_cast<unsigned char>(text[i]))) throw bad("an extent is not a number");
    std::size_t v = 0;
    while (i < end && std::isdigit(static_cast<unsigned char>(text[i]))) v = v * 10 + static_cast<std::size_t>(text[i++] - '0');
    h.shape.push_back(v);
  }
  return h;
}

inline npy_header read_npy_header(const file& f) {
  char head[12] = {};
  if (f.size() < 10) throw io_error("io: " + f.path().string() + ": not an .npy file (shorter than its magic string)");
  f.read_at(head, 10, 0);
  if (std::string(head, 6) != "\x93NUMPY") throw io_error("io: " + f.path().string() + ": not an .npy file (no \\x93NUMPY magic string)");
  const unsigned major = static_cast<unsigned char>(head[6]);
  std::size_t length = 0, at = 0;
  if (major == 1) {
    length = static_cast<unsigned char>(head[8]) | (static_cast<std::size_t>(static_cast<unsigned char>(head[9])) << 8);
    at = 10;
  } else if (major == 2 || major == 3) {
    f.read_at(head, 12, 0);
    std::uint32_t n = 0;
    std::memcpy(&n, head + 8, 4);
    length = n, at = 12;
  } else {
    throw io_error("io: " + f.path().string() + ": .npy format version " + std::to_string(major) + " (pdo reads versions 1 to 3)");
  }
  std::string text(length, '\0');
  f.read_at(text.data(), length, at);
  return parse_npy_header(f.path(), text, at + length);
}

}  // namespace detail

/// @brief Writes `t` (any place's memory) to `path` as an .npy file, safely (a temporary
/// name, flushed, then renamed).
template <element T, std::size_t R>
void save_npy(const std::filesystem::path& path, const tensor<T, R>& t) {
  std::string dict = "{'descr': '" + detail::npy_descr<T>() + "', 'fortran_order': False, 'shape': (";
  for (std::size_t d = 0; d < R; ++d) dict += std::to_string(t.shape()[d]) + (R == 1 || d + 1 < R ? "," : "") + (d + 1 < R ? " " : "");
  dict += "), }";
  std::size_t total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict += '\n';
  std::string head = std::string("\x93NUMPY\x01\x00", 8);
  head += static_cast<char>(dict.size() & 0xff);
  head += static_cast<char>((dict.size() >> 8) & 0xff);
  head += dict;
  const tensor<T, R> host = t.on_gpu() ? to_host(t) : tensor<T, R>();
  const T* data = t.on_gpu() ? host.data() : t.data();
  detail::write_atomically(path, [&](detail::file& f) {
    f.write_at(head.data(), head.size(), 0);
    f.write_at(data, t.bytes(), head.size());
  });
}

/// @brief The .npy file `path` as a host tensor: its element type must be T and its rank R
/// (else a pdo::io_error naming the file, what it holds and what was asked).
template <element T, std::size_t R>
tensor<T, R> load_npy(const std::filesystem::path& path) {
  const detail::file f(path, detail::file::mode::read);
  const auto h = detail::read_npy_header(f);
  const std::string want = detail::npy_descr<T>();
  const bool same_type = h.descr == want || (sizeof(T) == 1 && h.descr.substr(1) == want.substr(1)) ||
                         (h.descr.size() == want.size() && h.descr[0] == '=' && h.descr.substr(1) == want.substr(1));
  if (!same_type)
    throw io_error("io: " + path.string() + ": holds elements of NumPy type '" + h.descr + "', the tensor asked for '" + want + "' (" +
                   std::string(detail::stored_dtype<T>()) + ")");
  if (h.fortran_order)
    throw io_error("io: " + path.string() + ": is in Fortran (column-major) order; save it from numpy.ascontiguousarray(...)");
  if (h.shape.size() != R)
    throw io_error("io: " + path.string() + ": holds a tensor of rank " + std::to_string(h.shape.size()) + " " +
                   pdo::detail::format_extents(h.shape) + ", the tensor asked for has rank " + std::to_string(R));
  shape_t<R> shape{};
  std::copy(h.shape.begin(), h.shape.end(), shape.begin());
  // the file's size is checked against the header before anything is allocated (a damaged
  // header may claim any shape)
  const bool empty = std::find(h.shape.begin(), h.shape.end(), std::size_t{0}) != h.shape.end();
  std::size_t bytes = empty ? 0 : sizeof(T);
  bool overflow = false;
  for (std::size_t e : h.shape) {
    if (empty) break;
    overflow = overflow || bytes > std::numeric_limits<std::size_t>::max() / e;
    if (!overflow) bytes *= e;
  }
  overflow = overflow || bytes > std::numeric_limits<std::size_t>::max() - h.data_offset;
  if (overflow || f.size() != h.data_offset + bytes)
    throw io_error("io: " + path.string() + ": " + std::to_string(f.size()) + " bytes, its header " + pdo::detail::format_extents(h.shape) +
                   " needs " + (overflow ? std::string("more than memory can address") : std::to_string(h.data_offset + bytes)) +
                   (overflow || f.size() < h.data_offset + bytes ? " (truncated, or a damaged header)" : ""));
  auto out = tensor<T, R>::on_host(shape);
  f.read_at(out.data(), out.bytes(), h.data_offset);
  return out;
}

}  // namespace pdo::io
#endif  // PDO_SINGLE_PDO_IO_NPY_HPP
// ---- pdo/io/safetensors.hpp
#ifndef PDO_SINGLE_PDO_IO_SAFETENSORS_HPP
#define PDO_SINGLE_PDO_IO_SAFETENSORS_HPP
// pdo/io/safetensors.hpp: the safetensors format (an 8-byte little-endian header length, a
// JSON header naming each tensor's type, shape and byte range, then the raw little-endian
// data), so that weights move between PyTorch and pdo; and a module's parameters saved to
// or loaded from such a file by name.


#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace pdo::io {

namespace detail {

/// @brief The safetensors name of T ("F32", "I64", "U8").
template <class T>
std::string safetensors_dtype() {
  const char kind = std::is_floating_point_v<T> ? 'F' : (std::is_signed_v<T> ? 'I' : 'U');
  return std::string(1, kind) + std::to_string(8 * sizeof(T));
}

/// @brief The size of one element of the safetensors type `dtype`, 0 when pdo cannot hold it.
inline std::size_t safetensors_element_bytes(const std::string& dtype) {
  static const std::map<std::string, std::size_t> sizes = {{"F64", 8}, {"F32", 4}, {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},
                                                           {"U64", 8}, {"U32", 4}, {"U16", 2}, {"U8", 1}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

/// @brief Elements of the safetensors type `dtype` at `src` converted to T.
template <class T>
void convert_from(const std::string& dtype, const unsigned char* src, T* out, std::size_t n) {
  auto each = [&]<class S>(S) {
    for (std::size_t i = 0; i < n; ++i) {
      S v;
      std::memcpy(&v, src + i * sizeof(S), sizeof(S));
      out[i] = static_cast<T>(v);
    }
  };
  if (dtype == "F64") each(double{});
  else if (dtype == "F32") each(float{});
  else if (dtype == "I64") each(std::int64_t{});
  else if (dtype == "I32") each(std::int32_t{});
  else if (dtype == "I16") each(std::int16_t{});
  else if (dtype == "I8") each(std::int8_t{});
  else if (dtype == "U64") each(std::uint64_t{});
  else if (dtype == "U32") each(std::uint32_t{});
  else if (dtype == "U16") each(std::uint16_t{});
  else each(std::uint8_t{});
}

}  // namespace detail

/// @brief One tensor of a safetensors file, as its header describes it.
struct safetensors_entry {
  std::string dtype;                ///< "F32", "I64", ...
  std::vector<std::size_t> shape;  ///< extents, one per dim (empty for a scalar)
  /// @brief Where its bytes begin, counted from the start of the data (after the header).
  std::size_t begin = 0, end = 0;
  /// @var end
  /// @brief Where its bytes end (exclusive), counted as `begin`.
};

/// @brief A safetensors file opened to read. The header is checked when it is opened
/// (lengths, types, byte ranges inside the file and not overlapping); each tensor is read
/// when asked for.
class safetensors_reader {
 public:
  /// @brief Opens `path` and checks its header; a pdo::io_error saying what is wrong otherwise.
  explicit safetensors_reader(const std::filesystem::path& path) : f_(path, detail::file::mode::read) {
    auto bad = [&](const std::string& what) { return io_error("io: " + path.string() + ": not a valid safetensors file: " + what); };
    const std::size_t size = f_.size();
    if (size < 8) throw bad("shorter than its 8-byte header length");
    std::uint64_t n = 0;
    f_.read_at(&n, 8, 0);
    if (n > size - 8) throw bad("its header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(size) + " bytes)");
    std::string text(n, '\0');
    f_.read_at(text.data(), n, 8);
    data_at_ = 8 + n;
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw bad(std::string("its header is not JSON: ") + e.what());
    }
    if (!header.is_object()) throw bad("its header is not a JSON object");
    std::vector<std::pair<std::size_t, std::size_t>> ranges;
    for (const auto& [name, e] : header.items()) {
      if (name == "__metadata__") {
        if (!e.is_object()) throw bad("__metadata__ is not an object");
        for (const auto& [k, v] : e.items()) {
          if (!v.is_string()) throw bad("__metadata__[\"" + k + "\"] is not a string");
          metadata_[k] = v.get<std::string>();
        }
        continue;
      }
      safetensors_entry t;
      try {
        t.dtype = e.at("dtype").get<std::string>();
        const auto& shape = e.at("shape");
        if (!shape.is_array()) throw bad("\"" + name + "\": its shape is not a list of extents");
        for (const auto& x : shape) {
          if (!x.is_number_unsigned()) throw bad("\"" + name + "\": its shape " + shape.dump() + " has an extent that is not a whole number >= 0");
          t.shape.push_back(x.get<std::size_t>());
        }
        const auto& offsets = e.at("data_offsets");
        if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
          throw bad("\"" + name + "\": data_offsets " + offsets.dump() + " is not a pair of whole numbers >= 0");
        t.begin = offsets[0].get<std::size_t>();
        t.end = offsets[1].get<std::size_t>();
      } catch (const nlohmann::json::exception& x) {
        throw bad("\"" + name + "\": " + x.what());
      }
      const std::size_t element = detail::safetensors_element_bytes(t.dtype);
      if (element == 0) throw bad("\"" + name + "\" has type " + t.dtype + ", which pdo does not read (it reads F64, F32, I64 to I8, U64 to U8)");
      std::size_t bytes = 0;
      try {
        bytes = pdo::detail::checked_volume(t.shape, "safetensors", element) * element;
      } catch (const pdo::error& x) {
        throw bad("\"" + name + "\": " + x.what());
      }
      if (t.end < t.begin)
        throw bad("\"" + name + "\": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "] end before they begin");
      if (t.end - t.begin != bytes)
        throw bad("\"" + name + "\": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "] hold " +
                  std::to_string(t.end - t.begin) + " bytes, its shape " + pdo::detail::format_extents(t.shape) + " needs " + std::to_string(bytes));
      if (t.end > size - data_at_)
        throw bad("\"" + name + "\": its data runs past the end of the file (truncated: " + std::to_string(size - data_at_) + " bytes of data)");
      ranges.emplace_back(t.begin, t.end);
      entries_[name] = std::move(t);
    }
    std::sort(ranges.begin(), ranges.end());
    for (std::size_t i = 1; i < ranges.size(); ++i)
      if (ranges[i].first < ranges[i - 1].second) throw bad("two tensors' data overlap");
  }

  /// @brief The file's path, as given.
  [[nodiscard]] const std::filesystem::path& path() const { return f_.path(); }
  /// @brief The names of its tensors, sorted.
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [k, v] : entries_) out.push_back(k);
    return out;
  }
  /// @brief Whether the file holds a tensor named `name`.
  [[nodiscard]] bool contains(const std::string& name) const { return entries_.contains(name); }
  /// @brief The header's entry of `name` (an io_error listing the names when there is none).
  [[nodiscard]] const safetensors_entry& entry(const std::string& name) const {
    const auto it = entries_.find(name);
    if (it == entries_.end()) {
      std::string held;
      for (const auto& [k, v] : entries_) held += (held.empty() ? "" : ", ") + k;
      throw io_error("io: " + path().string() + ": no tensor named \"" + name + "\" (it holds: " + (held.empty() ? "nothing" : held) + ")");
    }
    return it->second;
  }
  /// @brief The header's __metadata__ strings, by key (empty when it has none).
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const { return metadata_; }

  /// @brief Tensor `name` as a host tensor of element type T: stored as T, or converted from
  /// another stored type when `convert`; its rank must be R.
  template <element T, std::size_t R>
  [[nodiscard]] tensor<T, R> get(const std::string& name, bool convert = false) const {
    const auto& e = entry(name);
    if (e.shape.size() != R)
      throw io_error("io: " + path().string() + ": \"" + name + "\" is " + e.dtype + pdo::detail::format_extents(e.shape) + ", of rank " +
                     std::to_string(e.shape.size()) + ", not " + std::to_string(R));
    if (!convert && e.dtype != detail::safetensors_dtype<T>())
      throw io_error("io: " + path().string() + ": \"" + name + "\" holds " + e.dtype + " elements, the tensor asked for " +
                     detail::safetensors_dtype<T>());
    shape_t<R> shape{};
    std::copy(e.shape.begin(), e.shape.end(), shape.begin());
    auto out = tensor<T, R>::on_host(shape);
    read_into(name, out.data(), out.size());
    return out;
  }

  /// @brief The `n` elements of tensor `name` into `out`, converted to T from its stored type.
  template <element T>
  void read_into(const std::string& name, T* out, std::size_t n) const {
    const auto& e = entry(name);
    const std::size_t bytes = e.end - e.begin;
    if (bytes != n * detail::safetensors_element_bytes(e.dtype))
      throw io_error("io: " + path().string() + ": \"" + name + "\" holds " + std::to_string(bytes / detail::safetensors_element_bytes(e.dtype)) +
                     " elements, " + std::to_string(n) + " asked for");
    if (e.dtype == detail::safetensors_dtype<T>()) {
      f_.read_at(out, bytes, data_at_ + e.begin);
    } else {
      std::vector<unsigned char> raw(bytes);
      f_.read_at(raw.data(), bytes, data_at_ + e.begin);
      detail::convert_from(e.dtype, raw.data(), out, n);
    }
  }

 private:
  detail::file f_;
  std::size_t data_at_ = 0;
  std::map<std::string, safetensors_entry> entries_;
  std::map<std::string, std::string> metadata_;
};

/// @brief Named tensors gathered to be written as one safetensors file (it copies them).
class safetensors_writer {
 public:
  /// @brief A copy of `t` (copied down first if it is in a GPU's memory) under `name`; a pdo::io_error for an
  /// empty name, "__metadata__" or a name already added.
  template <element T, std::size_t R>
  safetensors_writer& add(const std::string& name, const tensor<T, R>& t) {
    return add_raw(name, detail::safetensors_dtype<T>(), std::vector<std::size_t>(t.shape().begin(), t.shape().end()),
                   t.on_gpu() ? to_host(t).data() : t.data(), t.bytes());
  }
  /// @brief `bytes` of host memory holding a tensor of `shape` of the safetensors type `dtype`.
  safetensors_writer& add_raw(const std::string& name, const std::string& dtype, std::vector<std::size_t> shape, const void* data,
                              std::size_t bytes) {
    if (name.empty() || name == "__metadata__") throw io_error("io: safetensors: \"" + name + "\" cannot name a tensor");
    if (tensors_.contains(name)) throw io_error("io: safetensors: two tensors are named \"" + name + "\"");
    const auto* p = static_cast<const unsigned char*>(data);
    tensors_[name] = {dtype, std::move(shape), std::vector<unsigned char>(p, p + bytes)};
    return *this;
  }
  /// @brief Free-form strings kept in the header's __metadata__.
  safetensors_writer& metadata(const std::string& key, const std::string& value) {
    metadata_[key] = value;
    return *this;
  }
  /// @brief Writes the file safely (a temporary name, flushed, then renamed): tensors in the
  /// order of their names, the header padded with spaces to a multiple of 8 bytes.
  void write(const std::filesystem::path& path) const {
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!metadata_.empty()) header["__metadata__"] = metadata_;
    std::size_t at = 0;
    for (const auto& [name, t] : tensors_) {
      header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes.size()}}};
      at += t.bytes.size();
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    const std::uint64_t n = text.size();
    detail::write_atomically(path, [&](detail::file& f) {
      f.write_at(&n, 8, 0);
      f.write_at(text.data(), text.size(), 8);
      std::size_t offset = 8 + text.size();
      for (const auto& [name, t] : tensors_) {
        f.write_at(t.bytes.data(), t.bytes.size(), offset);
        offset += t.bytes.size();
      }
    });
  }

 private:
  struct stored {
    std::string dtype;
    std::vector<std::size_t> shape;
    std::vector<unsigned char> bytes;
  };
  std::map<std::string, stored> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// @brief Sets every parameter of `model` (named as nn::parameters_of names them: "0.weight")
/// from the tensor of that name in the safetensors file `path`, converting its element type
/// (a float32 file loads into a double model). A missing name or another shape is a
/// pdo::io_error naming the parameter, the file and both shapes, before any parameter is set.
template <class T, class M>
void load_parameters(M& model, const std::filesystem::path& path, const std::string& prefix = "") {
  const safetensors_reader file(path);
  const auto params = nn::parameters_of<T>(model, prefix);
  for (const auto& p : params) {
    const auto& e = file.entry(p.name());
    if (e.shape != p.extents()) {
      const auto& want = p.extents();
      const bool transposed = want.size() == 2 && e.shape.size() == 2 && e.shape[0] == want[1] && e.shape[1] == want[0];
      throw io_error("io: " + path.string() + ": \"" + p.name() + "\" is " + e.dtype + pdo::detail::format_extents(e.shape) +
                     ", the parameter is " + p.shape_text() +
                     (transposed ? " (its transpose: a PyTorch nn.Linear weight is [out, in], a pdo::nn::linear weight [in, out])" : ""));
    }
  }
  for (const auto& p : params) {
    auto host = tensor<T, 1>::on_host({p.size_global()});
    file.read_into(p.name(), host.data(), host.size());
    p.assign_flat(host.data());
  }
}

/// @brief Writes every parameter of `model` (its global value: dtensor parameters are
/// gathered) to the safetensors file `path`, under the names nn::parameters_of gives.
template <class T, class M>
void save_parameters(const std::filesystem::path& path, const M& model, const std::string& prefix = "") {
  safetensors_writer w;
  for (const auto& p : nn::parameters_of<T>(model, prefix)) {
    const auto values = p.global_values();
    w.add_raw(p.name(), detail::safetensors_dtype<T>(), p.extents(), values.data(), values.bytes());
  }
  w.write(path);
}

}  // namespace pdo::io
#endif  // PDO_SINGLE_PDO_IO_SAFETENSORS_HPP
// ---- pdo/io/state.hpp
#ifndef PDO_SINGLE_PDO_IO_STATE_HPP
#define PDO_SINGLE_PDO_IO_STATE_HPP
// pdo/io/state.hpp: the whole state of a training run in a checkpoint: a model's parameters,
// its optimizer's moments and step count, and a data-parallel trainer's progress, so that
// training resumes exactly where it stopped, on the same mesh or another.


#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace pdo::io {

namespace detail {

/// @brief f(std::integral_constant<std::size_t, R>{}) for the rank R of a parameter (1 to 6).
template <class F>
void with_rank(std::size_t rank, const std::string& name, F&& f) {
  auto one = [&]<std::size_t R>() {
    if (rank == R) f(std::integral_constant<std::size_t, R>{});
  };
  [&]<std::size_t... R>(std::index_sequence<R...>) { (one.template operator()<R + 1>(), ...); }(std::make_index_sequence<6>{});
  if (rank < 1 || rank > 6)
    throw io_error("io: parameter " + name + " has rank " + std::to_string(rank) + "; checkpoints hold parameters of rank 1 to 6");
}

template <class T, std::size_t R>
tensor<T, R> shaped(const tensor<T, 1>& flat, const shape_t<R>& shape) {
  auto t = tensor<T, R>::on_host(shape);
  pdo::detail::copy_elements(t.data(), flat.data(), t.size());
  return t;
}

template <class O>
concept optimizer_with_state = requires(O& o, const O& co, const std::string& name, long t) {
  { co.state_names() } -> std::convertible_to<std::vector<std::string>>;
  o.state(name, std::size_t{0});
  { co.steps() } -> std::convertible_to<long>;
  o.set_steps(t);
};

/// @brief An optimizer that counts each parameter's steps (adam, any_optimizer).
template <class O>
concept steps_per_parameter = requires(O& o, const O& co, std::size_t i, long t) {
  { co.steps(i) } -> std::convertible_to<long>;
  o.set_steps(i, t);
};

/// @brief After the entry "<prefix>optimizer.steps": for an optimizer that counts each
/// parameter's steps, "<prefix>optimizer.<name>.steps" for each parameter (saved from copy 0,
/// loaded into every copy of `copies`), so a parameter that skipped steps (no gradient in them)
/// resumes with its own bias corrections. Optional: a checkpoint saved without them loads with
/// every parameter at the optimizer's count.
template <class T, class Opt>
void add_parameter_steps(checkpoint& c, const std::string& prefix, const std::vector<nn::parameter_ref<T>>& params, std::size_t copies,
                         Opt opt_of) {
  using optimizer_t = std::remove_cvref_t<decltype(opt_of(0))>;
  if constexpr (steps_per_parameter<optimizer_t>) {
    for (std::size_t i = 0; i < params.size(); ++i)
      c.add_computed<long>(
          prefix + "optimizer." + params[i].name() + ".steps", [opt_of, i] { return static_cast<long>(opt_of(0).steps(i)); },
          [opt_of, copies, i](long t) {
            for (std::size_t k = 0; k < copies; ++k) opt_of(k).set_steps(i, t);
          },
          /*optional=*/true);
  }
}

/// @brief Entry "<prefix>model.<name>" of parameter `params_of(k)[i]` of `copies` identical
/// copies, as a global value: saved from copy 0 (gathered), loaded into every copy, after which
/// `loaded(k)` runs for that copy.
template <class T, class Params, class Loaded>
void add_model_entry(checkpoint& c, const std::string& prefix, std::size_t copies, Params params_of, std::size_t i, Loaded loaded) {
  const nn::parameter_ref<T> p = params_of(0)[i];
  with_rank(p.rank(), p.name(), [&]<std::size_t R>(std::integral_constant<std::size_t, R>) {
    const shape_t<R> shape = p.template shape<R>();
    c.add_computed<T, R>(
        prefix + "model." + p.name(), shape, [params_of, i, shape] { return shaped(params_of(0)[i].global_values(), shape); },
        [params_of, copies, i, loaded](const tensor<T, R>& t) {
          for (std::size_t k = 0; k < copies; ++k) {
            params_of(k)[i].assign(t);
            loaded(k);
          }
        });
  });
}

/// @brief Entries for parameter `params_of(k)[i]` and its optimizer state in `opt_of(k)`, of
/// `copies` identical copies (the replicas of data parallelism; 1 otherwise), as global values:
/// each saved from copy 0 (gathered), each loaded into every copy.
template <class T, class Params, class Opt>
void add_parameter_whole(checkpoint& c, const std::string& prefix, std::size_t copies, Params params_of, Opt opt_of, std::size_t i) {
  add_model_entry<T>(c, prefix, copies, params_of, i, [](std::size_t) {});
  const nn::parameter_ref<T> p = params_of(0)[i];
  with_rank(p.rank(), p.name(), [&]<std::size_t R>(std::integral_constant<std::size_t, R>) {
    const shape_t<R> shape = p.template shape<R>();
    for (const std::string& s : opt_of(0).state_names())
      c.add_computed<T, R>(
          prefix + "optimizer." + p.name() + "." + s, shape,
          [params_of, opt_of, i, s, shape] { return shaped(params_of(0)[i].gather_state(opt_of(0).state(s, i)), shape); },
          [params_of, opt_of, copies, i, s](const tensor<T, R>& t) {
            for (std::size_t k = 0; k < copies; ++k) params_of(k)[i].scatter_state(t.data(), opt_of(k).state(s, i));
          });
  });
}

/// @brief Entries for the parameters `params_of(k)[i]` and the optimizer state `opt_of(k)` of
/// `copies` identical copies: each saved from copy 0, each loaded into every copy.
template <class T, class Params, class Opt>
void add_parameters_and_state(checkpoint& c, const std::string& prefix, std::size_t copies, Params params_of, Opt opt_of) {
  const std::size_t n = params_of(0).size();
  for (std::size_t i = 0; i < n; ++i) add_parameter_whole<T>(c, prefix, copies, params_of, opt_of, i);
  c.add_computed<long>(
      prefix + "optimizer.steps", [opt_of] { return opt_of(0).steps(); },
      [opt_of, copies](long t) {
        for (std::size_t k = 0; k < copies; ++k) opt_of(k).set_steps(t);
      });
  add_parameter_steps<T>(c, prefix, params_of(0), copies, opt_of);
}

/// @brief The entries of a data-parallel trainer with ZeRO-1. Its parameters are whole on every
/// replica ("<prefix>model.<name>", saved from the first, loaded into every one, and each
/// replica's slices cut again from them). Its optimizer state lies in the places' slices of the
/// gradient buckets: each state of a parameter is an entry of the parameter's elements in
/// row-major order ("<prefix>optimizer.<name>.<state>", of shape [elements]), to which every
/// place writes the run its slices hold, and from which a load fills each place's runs,
/// whatever the number of places then.
template <class T, class Trainer>
void add_zero1_state(checkpoint& c, const std::string& prefix, Trainer& trainer) {
  for (const any_place& q : trainer.mesh().places())  // every process sees every place: all refuse alike
    if (q.kind() != place_kind::cpu)
      throw io_error("io: add_state: a data_parallel trainer with ZeRO-1 on GPU places (" + q.name() +
                     ") keeps its optimizer state's slices in device memory, which checkpoints of ZeRO-1 state do not take "
                     "yet; save a trainer on CPU places, or one without zero1");
  auto* t = &trainer;
  const std::vector<nn::parameter_ref<T>> params = trainer.parameters(0);
  const auto& m = trainer.mesh();
  using mesh_type = std::decay_t<decltype(m)>;
  // a replica along another axis than "dp" holds the same slices: only the first writes
  auto writes = [t](std::size_t place) {
    constexpr std::size_t dp = mesh_type::axis_index("dp");
    for (std::size_t a = 0; a < mesh_type::ndim; ++a)
      if (a != dp && t->mesh().coord(place, a) != 0) return false;
    return true;
  };
  auto block_of = [t, writes](std::size_t i, const std::string& state) {
    return [t, writes, i, state](std::size_t place) -> held_block<T> {
      const auto& local = t->mesh().local_places();
      const std::size_t k = static_cast<std::size_t>(std::find(local.begin(), local.end(), place) - local.begin());
      if (k == local.size()) return {};
      for (const auto& run : t->replica_buckets(k).slice_runs()) {
        if (run.param != i) continue;
        T* data = t->optimizer(k).state(state, run.bucket).at(0).data() + run.at;
        return {{run.first}, {run.count}, data, writes(place)};
      }
      return {};
    };
  };
  const std::vector<std::string> states = trainer.replica_count() == 0 ? std::vector<std::string>{} : trainer.optimizer(0).state_names();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const nn::parameter_ref<T>& p = params[i];
    add_model_entry<T>(c, prefix, trainer.replica_count(), [t](std::size_t k) { return t->parameters(k); }, i,
                       [t, i](std::size_t k) { t->replica_buckets(k).reslice(i); });
    for (const std::string& s : states)
      c.add_blocks<T, 1>(prefix + "optimizer." + p.name() + "." + s, m, shape_t<1>{p.size_global()}, block_of(i, s));
  }
  c.add_computed<long>(
      prefix + "optimizer.steps", [t] { return t->replica_count() == 0 ? 0L : static_cast<long>(t->optimizer(0).steps()); },
      [t](long v) {
        for (std::size_t k = 0; k < t->replica_count(); ++k) t->optimizer(k).set_steps(v);
      });
}

/// @brief Whether parameter `p` can be saved and loaded as its places' blocks: a dtensor on CPU
/// places with no pending sums.
template <class T>
bool held_in_blocks(const nn::parameter_ref<T>& p) {
  // decided from what every process sees alike (the mesh's places, the layout), never from
  // this process's blocks: the blocks' entries are collective over the mesh
  if (p.mesh_places().empty() || p.partial()) return false;
  for (const any_place& q : p.mesh_places())
    if (q.kind() != place_kind::cpu) return false;
  return true;
}

}  // namespace detail

/// @brief Adds to `c` a model's parameters (as "<prefix>model.<name>") and `opt`'s state
/// ("<prefix>optimizer.<name>.<state>", "<prefix>optimizer.steps", and for an optimizer that
/// counts each parameter's steps, as adam does, "<prefix>optimizer.<name>.steps"). The parameters may be
/// local tensors or dtensors of any layout (the tensor-parallel model's). A dtensor on CPU
/// places is saved by its places, each writing its own block at once (a replica's by the first
/// place along the axes its layout does not split), and loaded into whatever layout and mesh
/// the parameter has then, each place reading the parts of the saved blocks its block overlaps;
/// a local tensor, or a dtensor on GPU places, is saved as its global value. Every process of
/// the parameters' meshes calls this, in the same order. For parameters over the places of
/// several processes, call c.spanning(mesh) first.
template <class T, class Optimizer>
checkpoint& add_state(checkpoint& c, const std::string& prefix, std::vector<nn::parameter_ref<T>> params, Optimizer& opt) {
  static_assert(detail::optimizer_with_state<Optimizer>,
                "pdo: io::add_state: the optimizer must expose its state (state_names(), state(name, i), steps(), set_steps(t)), as "
                "pdo::nn::sgd, adam and any_optimizer do");
  auto params_of = [params](std::size_t) { return params; };
  auto opt_of = [&opt](std::size_t) -> Optimizer& { return opt; };
  // one mesh of every place of a parameter's mesh, in its order, for the blocks' entries
  std::vector<std::pair<std::vector<any_place>, mesh<"place">>> meshes;
  auto mesh_over = [&meshes](const std::vector<any_place>& places) -> const mesh<"place">& {
    for (const auto& [these, m] : meshes)
      if (these == places) return m;
    return meshes.emplace_back(places, make_mesh<"place">(places)).second;
  };
  for (std::size_t i = 0; i < params.size(); ++i) {
    const nn::parameter_ref<T>& p = params[i];
    if (!detail::held_in_blocks(p)) {
      detail::add_parameter_whole<T>(c, prefix, 1, params_of, opt_of, i);
      continue;
    }
    // a dtensor on CPU places: each place writes its own block, and a load fills each block
    // from the parts of the saved blocks it overlaps
    const mesh<"place">& m = mesh_over(p.mesh_places());
    const auto positions = std::make_shared<const std::vector<typename nn::parameter_ref<T>::block_position>>(p.block_positions());
    // called by the places' lanes at once: the optimizer makes a state's blocks on first use,
    // one lane at a time
    const auto state_mutex = std::make_shared<std::mutex>();
    auto block_of = [p, positions, state_mutex, &opt, i](const std::string& state) {
      return [p, positions, state_mutex, &opt, i, state](std::size_t place) -> held_block<T> {
        for (std::size_t k = 0; k < positions->size(); ++k) {
          const auto& at = (*positions)[k];
          if (at.place != place) continue;
          T* data = nullptr;
          if (state.empty()) {
            data = p.value_blocks().at(k).data();
          } else {
            std::lock_guard lock(*state_mutex);
            data = opt.state(state, i).at(k).data();
          }
          return {at.offset, at.shape, data, at.write};
        }
        return {};
      };
    };
    detail::with_rank(p.rank(), p.name(), [&]<std::size_t R>(std::integral_constant<std::size_t, R>) {
      const shape_t<R> shape = p.template shape<R>();
      c.add_blocks<T, R>(prefix + "model." + p.name(), m, shape, block_of(""));
      for (const std::string& s : opt.state_names()) c.add_blocks<T, R>(prefix + "optimizer." + p.name() + "." + s, m, shape, block_of(s));
    });
  }
  c.add_computed<long>(
      prefix + "optimizer.steps", [&opt] { return opt.steps(); }, [&opt](long t) { opt.set_steps(t); });
  detail::add_parameter_steps<T>(c, prefix, params, 1, opt_of);
  return c;
}

/// @brief Adds to `c` the whole state of a data-parallel trainer: the parameters and the
/// optimizer state (saved from the first replica, loaded into every one), the steps and
/// epochs trained. Loaded into a trainer of the same model on any mesh, it trains on as the
/// saved one would have: bitwise the same losses on the same mesh. Under ZeRO-1 the optimizer
/// state is written by the places whose slices hold it (see detail::add_zero1_state), and
/// loads into ZeRO-1 trainers of any number of places.
template <class T, class Model, class Optimizer, class Mesh, class Loss>
checkpoint& add_state(checkpoint& c, const std::string& prefix, nn::data_parallel<T, Model, Optimizer, Mesh, Loss>& trainer) {
  static_assert(detail::optimizer_with_state<Optimizer>,
                "pdo: io::add_state: the optimizer must expose its state (state_names(), state(name, i), steps(), set_steps(t)), as "
                "pdo::nn::sgd, adam and any_optimizer do");
  c.spanning(trainer.mesh());
  auto* t = &trainer;
  if (trainer.options().zero1)
    detail::add_zero1_state<T>(c, prefix, trainer);
  else
    detail::add_parameters_and_state<T>(
        c, prefix, trainer.replica_count(), [t](std::size_t k) { return t->parameters(k); },
        [t](std::size_t k) -> Optimizer& { return t->optimizer(k); });
  c.add_computed<std::uint64_t>(
      prefix + "steps", [t] { return static_cast<std::uint64_t>(t->steps()); },
      [t](std::uint64_t s) { t->set_progress(s, t->epochs()); });
  c.add_computed<std::uint64_t>(
      prefix + "epochs", [t] { return static_cast<std::uint64_t>(t->epochs()); },
      [t](std::uint64_t e) { t->set_progress(t->steps(), e); });
  return c;
}

/// @brief Adds to `c` the whole state of a pipeline: each parameter of the model under its
/// name in the whole model ("<prefix>model.<layer>.<name>", as a data-parallel trainer of the
/// same model saves it), the optimizers' state ("<prefix>optimizer.<layer>.<name>.<state>",
/// "<prefix>optimizer.steps"). Each stage's places write their own parameters, all at once
/// (over MPI each process its stages'; a stage's shards along "tp" each by its place, once
/// per "dp" row); a load fills each place's parameters and moments from the blocks they
/// overlap, so a checkpoint loads into a pipeline of the same model cut, split or replicated
/// otherwise (another mesh, other cut points, "tp" or "dp" axes or none).
template <class T, std::size_t InRank, class Target, class Mesh, class Optimizer, class Loss, class... Stages>
checkpoint& add_state(checkpoint& c, const std::string& prefix, nn::pipeline<T, InRank, Target, Mesh, Optimizer, Loss, Stages...>& pipeline) {
  static_assert(detail::optimizer_with_state<Optimizer>,
                "pdo: io::add_state: the optimizer must expose its state (state_names(), state(name, i), steps(), set_steps(t)), as "
                "pdo::nn::sgd, adam and any_optimizer do");
  auto* pl = &pipeline;
  c.spanning(pl->mesh());
  // the block place p holds of model parameter g: its values (state "") or an optimizer state
  auto block_of = [pl](std::size_t g, const std::string& state) {
    return [pl, g, state](std::size_t p) -> held_block<T> {
      const auto& local = pl->mesh().local_places();
      const std::size_t k = static_cast<std::size_t>(std::find(local.begin(), local.end(), p) - local.begin());
      const auto part = pl->part_of(k, g);
      if (part.index == part.npos) return {};
      const nn::parameter_ref<T> q = pl->parameters(k)[part.index];  // parameters(k) is a copy
      T* data = state.empty() ? q.value_blocks().at(0).data() : pl->optimizer(k).state(state, part.index).at(0).data();
      return {part.offset, q.extents(), data, part.first};
    };
  };
  const auto& params = pl->model_parameters();
  const std::vector<std::string> states = pl->mesh().local_places().empty() ? std::vector<std::string>{} : pl->optimizer(0).state_names();
  for (std::size_t g = 0; g < params.size(); ++g) {
    const auto& q = params[g];
    detail::with_rank(q.extents.size(), q.name, [&]<std::size_t R>(std::integral_constant<std::size_t, R>) {
      shape_t<R> shape{};
      std::copy(q.extents.begin(), q.extents.end(), shape.begin());
      c.add_blocks<T, R>(prefix + "model." + q.name, pl->mesh(), shape, block_of(g, ""));
      for (const std::string& s : states) c.add_blocks<T, R>(prefix + "optimizer." + q.name + "." + s, pl->mesh(), shape, block_of(g, s));
    });
  }
  c.add_computed<long>(
      prefix + "optimizer.steps", [pl] { return pl->mesh().local_places().empty() ? 0L : static_cast<long>(pl->optimizer(0).steps()); },
      [pl](long t) {
        for (std::size_t k = 0; k < pl->mesh().local_places().size(); ++k) pl->optimizer(k).set_steps(t);
      });
  return c;
}

/// @brief Saves the whole state of `pipeline` into `dir` (see add_state).
template <class T, std::size_t InRank, class Target, class Mesh, class Optimizer, class Loss, class... Stages>
void save(const std::filesystem::path& dir, nn::pipeline<T, InRank, Target, Mesh, Optimizer, Loss, Stages...>& pipeline,
          const save_options& o = {}) {
  checkpoint c;
  add_state(c, "", pipeline);
  c.save(dir, o);
}

/// @brief Restores the whole state of `pipeline` from `dir` (see add_state).
template <class T, std::size_t InRank, class Target, class Mesh, class Optimizer, class Loss, class... Stages>
void load(const std::filesystem::path& dir, nn::pipeline<T, InRank, Target, Mesh, Optimizer, Loss, Stages...>& pipeline,
          const load_options& o = {}) {
  checkpoint c;
  add_state(c, "", pipeline);
  c.load(dir, o);
}

/// @brief Saves the whole state of `trainer` into `dir` (see add_state).
template <class T, class Model, class Optimizer, class Mesh, class Loss>
void save(const std::filesystem::path& dir, nn::data_parallel<T, Model, Optimizer, Mesh, Loss>& trainer, const save_options& o = {}) {
  checkpoint c;
  add_state(c, "", trainer);
  c.save(dir, o);
}

/// @brief Restores the whole state of `trainer` from `dir` (see add_state).
template <class T, class Model, class Optimizer, class Mesh, class Loss>
void load(const std::filesystem::path& dir, nn::data_parallel<T, Model, Optimizer, Mesh, Loss>& trainer, const load_options& o = {}) {
  checkpoint c;
  add_state(c, "", trainer);
  c.load(dir, o);
}

}  // namespace pdo::io
#endif  // PDO_SINGLE_PDO_IO_STATE_HPP
#endif  // PDO_SINGLE_PDO_IO_HPP
#endif
#endif  // PDO_SINGLE_PDO_PDO_HPP
