// pdo/place/worker.hpp: the thread a place runs its work on, in submission order.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <new>
#include <type_traits>
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

/// @brief A move-only `void()` callable that keeps small callables (up to 64 bytes: what
/// pdo's operations queue) in place, so queueing work on a place allocates nothing.
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

  void submit(task work) {
    bool asleep = false;
    {
      std::lock_guard lock(mutex_);
      tasks_.push_back(std::move(work));
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
      task next;
      {
        std::unique_lock lock(mutex_);
        sleeping_ = true;
        wake_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        sleeping_ = false;
        if (tasks_.empty()) return;
        next = std::move(tasks_.front());
        tasks_.pop_front();
        queued_.fetch_sub(1, std::memory_order_relaxed);
      }
      next();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<task> tasks_;
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
  /// @brief True once every task has counted down.
  [[nodiscard]] bool finished() const { return left_.load(std::memory_order_acquire) == 0; }
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
