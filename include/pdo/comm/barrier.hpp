// pdo/comm/barrier.hpp: a reusable barrier that spins briefly, then sleeps, and can be aborted.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/error.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace pdo::detail {

/// @brief The error of a member whose peer's task ended without the matching call (a
/// collective it did not join, a send or recv it did not make): a pdo::mismatch_error, or a
/// pdo::communication_error when the members are this process's part of a group over several
/// processes (the others cannot be told, so it is not a mismatch every member finds alike).
[[noreturn]] PDO_NOINLINE inline void throw_member_left(const std::string& why, bool part_of_larger) {
  if (part_of_larger) throw communication_error(why);
  throw mismatch_error(why);
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
      throw_member_left(why, part_of_larger_);
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
