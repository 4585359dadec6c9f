// pdo/comm/barrier.hpp: a reusable barrier that spins briefly, then sleeps, and can be aborted.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/error.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

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

  /// @brief Wakes abortable waiters, now and until reset(), with an error saying why (the
  /// first abort's since the last reset): by default pdo::collective_aborted, "another place
  /// of the group failed" (an echo of that failure); with `why` and `cause`, a
  /// pdo::mismatch_error saying `why` (the members did not make the same collectives).
  void abort(std::string why = {}, bool cause = false) {
    {
      std::lock_guard lock(why_mutex_);
      if (!claimed_) {
        claimed_ = true;
        why_ = std::move(why);
        cause_ = cause && !why_.empty();
      }
    }
    phase_.fetch_or(aborted_bit, std::memory_order_release);
    phase_.notify_all();
  }
  /// @brief Makes the barrier usable again; call only when no thread is inside it.
  void reset() {
    arrived_.store(0, std::memory_order_relaxed);
    {
      std::lock_guard lock(why_mutex_);
      claimed_ = false;
      cause_ = false;
      why_.clear();
    }
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
  [[noreturn]] void throw_aborted() {
    std::string why;
    bool cause = false;
    {
      std::lock_guard lock(why_mutex_);
      why = why_;
      cause = cause_;
    }
    if (cause) throw mismatch_error(why);
    throw collective_aborted(why.empty() ? "collective aborted: another place of the group failed" : why);
  }

  const std::uint32_t count_;
  const int spin_limit_;  ///< spin only while every member can have a core of its own
  std::atomic<std::uint32_t> arrived_{0};
  std::atomic<std::uint32_t> phase_{0};
  std::mutex why_mutex_;
  bool claimed_ = false;  ///< aborted since the last reset: why_ and cause_ say why
  bool cause_ = false;    ///< the abort is a cause (a mismatch), not the echo of a failure
  std::string why_;       ///< empty: another place of the group failed
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
