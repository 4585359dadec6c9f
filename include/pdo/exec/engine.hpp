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
#pragma once

#include <pdo/core/cache_line_allocator.hpp>
#include <pdo/core/error.hpp>
#include <pdo/place/lane.hpp>
#include <pdo/tensor/dtensor.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
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

  /// @brief Waits until no task queued writes (`which` = writers: storage about to be
  /// copied), or reads or writes (all: about to be freed or replaced), any of `buffers`, on a
  /// host thread (a dtensor's shards: detail::wait_for_users). On a lane it does not wait: the
  /// task it runs in may be one of those. With `writers`, gives the failure of a writer of
  /// `buffers` that has ended and failed, its failure kept with them (task_request::
  /// keeps_failure); of several, the first that is not only another place's abort of the
  /// collectives echoed; nothing otherwise.
  std::optional<captured_error> wait_for_users(std::span<const void* const> buffers, shard_users which) {
    const bool waits = current_lane() == nullptr;
    std::vector<task_handle> users, kept;
    for (const void* b : buffers) {
      shard& s = shard_for(b);
      std::lock_guard guard(s.lock);
      const auto found = s.buffers.find(b);
      if (found == s.buffers.end()) continue;
      const task_handle& writer = found->second.writer;
      if (waits && live(writer)) users.push_back(writer);
      if (which == shard_users::writers && keeps_its_failure(writer)) kept.push_back(writer);
      if (waits && which == shard_users::all)
        for (const auto& r : found->second.readers)
          if (live(r)) users.push_back(r);
    }
    if (!users.empty()) {
      std::vector<lane*> homes;  // a task queued quietly waits for its submitter to wake its lane
      for (const auto& t : users)
        if (std::find(homes.begin(), homes.end(), t->home) == homes.end()) homes.push_back(t->home);
      for (lane* home : homes) home->poke();
      for (const auto& t : users) t->wait_ended();
    }
    std::optional<captured_error> first;
    for (const auto& writer : kept) {
      if (!writer->ended.load(std::memory_order_acquire)) continue;
      auto failure = outcome(*writer);
      if (failure && (!first || tells_more_than(failure->kind, first->kind))) first = std::move(failure);
    }
    return first;
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
  engine() {
    // a dtensor's shards are copied once written, and freed or replaced once the tasks that use them have ended
    detail::wait_for_users.store(
        [](std::span<const void* const> buffers, shard_users which) { return instance().wait_for_users(buffers, which); },
        std::memory_order_release);
  }

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

}  // namespace pdo::detail
