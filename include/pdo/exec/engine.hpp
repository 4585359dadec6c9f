// pdo/exec/engine.hpp: the engine that runs pdo's work: tasks that say which buffers they
// read and write, ordered per buffer, run on the lanes of their places.
//
// Every task declares the buffers it reads and writes (any address that names storage: a
// tensor's data, the slot a later task fills). The engine makes it wait for the last task
// that wrote a buffer it reads (read after write), and for the last writer and the readers
// since of a buffer it writes (write after read, write after write). Tasks that do not
// conflict run at the same time, on different lanes and places (pdo/place/lane.hpp).
//
// Submission is one total order: a task waits only for tasks submitted before it, and the
// tasks of one mesh-wide operation (one per place) are submitted at one point of that order,
// none waiting for another. Lanes run their tasks in submission order. So the earliest task
// that has not ended always has every task it waits for ended and every task before it on
// its lane ended: it runs, and with it the other tasks of its operation, whose collectives
// therefore meet. Nothing waits forever, whichever threads submit.
//
// A task that fails cancels the tasks that read what it wrote (and, in turn, those that read
// theirs), with its error; a task that only overwrites its buffers runs, as do independent
// ones. Waiting on a task throws the error it failed or was cancelled with.
#pragma once

#include <pdo/core/error.hpp>
#include <pdo/place/lane.hpp>

#include <atomic>
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
  std::string detail;          ///< for the trace (shapes, layouts, bytes); may stay empty
};

/// @brief The engine's lock. What it guards takes a fraction of a microsecond, and host threads
/// that submit short operations at once would otherwise put each other to sleep on it (a
/// futex wait and wake-up costs more than the operations): a waiter spins, then yields its
/// core (to the holder, when there are more threads than cores), and never sleeps.
class spin_lock {
 public:
  void lock() noexcept {
    for (int tries = 0; locked_.exchange(true, std::memory_order_acquire); ++tries)
      while (locked_.load(std::memory_order_relaxed)) {
        if (tries < 64) {
          ++tries;
        } else {
          std::this_thread::yield();
        }
      }
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

/// @brief The dependency engine: the last writer and the readers since of every buffer in
/// use, and the total order of submission.
class engine {
 public:
  static engine& instance() {
    static engine* e = new engine();  // never destroyed: lanes may still run while the program exits
    return *e;
  }

  /// @brief Submits `requests` at one point of the total order (the tasks of one operation:
  /// none waits for another of them) and returns their handles, in order.
  std::vector<task_handle> submit(std::vector<task_request>& requests) {
    std::vector<task_handle> handles;
    handles.reserve(requests.size());
    for (auto& r : requests) handles.push_back(make(r));
    {
      std::lock_guard guard(lock_);
      for (auto& h : handles) h->id = ++submitted_;
      for (std::size_t i = 0; i < requests.size(); ++i) link_all(handles[i], requests[i].uses);
      for (std::size_t i = 0; i < requests.size(); ++i) record(handles[i], requests[i].uses);
      // the operation's tasks become what the next operation on their after_all waits for
      for (std::size_t i = 0; i < requests.size(); ++i) {
        const void* token = requests[i].uses.after_all;
        if (token == nullptr) continue;
        auto& last = operations_[token];
        if (i == 0 || requests[i - 1].uses.after_all != token) last.clear();
        last.push_back(handles[i]);
      }
      for (auto& h : handles) queue(h);
    }
    return handles;
  }

  /// @brief Submits one task.
  task_handle submit(task_request request) {
    task_handle h = make(request);
    {
      std::lock_guard guard(lock_);
      h->id = ++submitted_;
      link_all(h, request.uses);
      record(h, request.uses);
      if (request.uses.after_all != nullptr) operations_[request.uses.after_all] = {h};
      queue(h);
    }
    return h;
  }

  /// @brief Forgets `buffers` whose tasks have all ended: storage about to be freed, whose
  /// address later storage may take. A later task that reads that new storage must not wait
  /// for, or be cancelled by the failure of, a task that wrote the old one.
  void forget(const std::vector<const void*>& buffers) {
    std::lock_guard guard(lock_);
    for (const void* b : buffers) {
      const auto found = buffers_.find(b);
      if (found == buffers_.end() || live(found->second.writer)) continue;
      bool reading = false;
      for (const auto& r : found->second.readers) reading = reading || live(r);
      if (!reading) buffers_.erase(found);
    }
  }

  /// @brief The buffers the engine tracks now (for tests: finished work is forgotten).
  [[nodiscard]] std::size_t tracked_buffers() {
    std::lock_guard guard(lock_);
    sweep();
    return buffers_.size();
  }

 private:
  engine() = default;

  struct buffer_state {
    task_handle writer;
    std::vector<task_handle> readers;  ///< since the last write
  };

  /// @brief A task of `r`; its id, its place in the order, is given under the lock.
  static task_handle make(task_request& r) {
    auto t = std::make_shared<task_state>();
    t->fn = std::move(r.fn);
    t->home = r.home;
    t->op = r.op;
    t->category = r.category;
    t->runs_cancelled = r.runs_cancelled;
    t->quiet = r.quiet;
    t->detail = std::move(r.detail);
    return t;
  }

  /// @brief Gives up the submission's own count on `t`, then queues it on its lane: a lane
  /// looks at its head again on every push, so no extra wake-up is needed for a task whose
  /// dependencies have all ended.
  static void queue(const task_handle& t) {
    t->waiting.fetch_sub(1, std::memory_order_acq_rel);
    t->home->push(t);
  }

  static bool live(const task_handle& t) { return t && !t->ended.load(std::memory_order_acquire); }

  /// @brief Makes `t` wait for what it conflicts with (under the lock).
  void link_all(const task_handle& t, const access& uses) {
    if (uses.after_all != nullptr)
      if (const auto found = operations_.find(uses.after_all); found != operations_.end())
        for (const auto& before : found->second) link(t, *before, false);
    for (const void* b : uses.reads) {
      const auto found = buffers_.find(b);
      if (found != buffers_.end() && found->second.writer) link(t, *found->second.writer, true);  // read after write
    }
    for (const void* b : uses.writes) {
      const auto found = buffers_.find(b);
      if (found == buffers_.end()) continue;
      if (found->second.writer) link(t, *found->second.writer, false);  // write after write: an order, not a result
      for (const auto& r : found->second.readers)
        if (r.get() != t.get()) link(t, *r, false);  // write after read
    }
  }

  /// @brief Records `t` as a reader and writer of its buffers (under the lock).
  void record(const task_handle& t, const access& uses) {
    for (const void* b : uses.reads) {
      auto& s = buffers_[b];
      // readers that have ended no longer matter: dropped now and then, not on every read
      if (s.readers.size() >= 16) std::erase_if(s.readers, [](const task_handle& r) { return !live(r); });
      s.readers.push_back(t);
    }
    for (const void* b : uses.writes) {
      auto& s = buffers_[b];
      s.writer = t;
      s.readers.clear();
    }
    if (++since_sweep_ >= 4096) sweep();
  }

  /// @brief Forgets the buffers whose tasks have all ended.
  void sweep() {
    since_sweep_ = 0;
    std::erase_if(operations_, [](const auto& entry) {
      for (const auto& t : entry.second)
        if (live(t)) return false;
      return true;
    });
    std::erase_if(buffers_, [](const auto& entry) {
      const buffer_state& s = entry.second;
      if (live(s.writer)) return false;
      for (const auto& r : s.readers)
        if (live(r)) return false;
      return true;
    });
  }

  spin_lock lock_;
  std::unordered_map<const void*, buffer_state> buffers_;
  std::unordered_map<const void*, std::vector<task_handle>> operations_;  ///< by after_all: the last operation's tasks
  std::uint64_t submitted_ = 0;
  std::size_t since_sweep_ = 0;
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
