// pdo/place/lane.hpp: the lanes of a place (the threads that run its work, each in the order
// its tasks were queued) and the tasks they run. What a task waits for, and when it is
// queued, is decided by the engine (pdo/exec/engine.hpp); a lane only runs its queue.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/error.hpp>
#include <pdo/core/timeline.hpp>

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

}  // namespace detail
}  // namespace pdo
