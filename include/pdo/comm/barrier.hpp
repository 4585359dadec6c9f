// pdo/comm/barrier.hpp: a reusable barrier that spins briefly, then sleeps, and can be aborted.
#pragma once

#include <pdo/core/error.hpp>

#include <atomic>
#include <cstdint>
#include <string>

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
/// abort() wakes every waiter with pdo::communication_error until reset().
class group_barrier {
 public:
  explicit group_barrier(std::uint32_t count) : count_(count) {}

  // phase_ counts completed phases in steps of 2; its low bit says "aborted", so a waiter
  // whose phase completed returns normally even if an abort follows right after.
  void arrive_and_wait() {
    const std::uint32_t phase = phase_.load(std::memory_order_acquire);
    if (phase & aborted_bit) throw_aborted();
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.fetch_add(2, std::memory_order_release);
      phase_.notify_all();
      return;
    }
    std::uint32_t now = phase;
    for (int spin = 0; spin < spin_limit && now == phase; ++spin) {
      cpu_relax();
      now = phase_.load(std::memory_order_acquire);
    }
    while (now == phase) {
      phase_.wait(phase, std::memory_order_acquire);
      now = phase_.load(std::memory_order_acquire);
    }
    if ((now & ~aborted_bit) == phase) throw_aborted();  // woken by abort(), not by the last arrival
  }

  /// @brief Wakes all waiters, now and until reset(), with pdo::communication_error.
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
  static constexpr int spin_limit = 4000;
  static constexpr std::uint32_t aborted_bit = 1;
  [[noreturn]] static void throw_aborted() {
    throw communication_error("collective aborted: another place of the group failed");
  }

  const std::uint32_t count_;
  std::atomic<std::uint32_t> arrived_{0};
  std::atomic<std::uint32_t> phase_{0};
};

}  // namespace pdo::detail
