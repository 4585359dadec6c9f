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

  void arrive_and_wait() {
    const std::uint32_t phase = phase_.load(std::memory_order_acquire);
    throw_if_aborted();
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.fetch_add(1, std::memory_order_release);
      phase_.notify_all();
      return;
    }
    for (int spin = 0; spin < spin_limit; ++spin) {
      if (phase_.load(std::memory_order_acquire) != phase) return throw_if_aborted();
      cpu_relax();
    }
    for (std::uint32_t now = phase; now == phase; now = phase_.load(std::memory_order_acquire))
      phase_.wait(phase, std::memory_order_acquire);
    throw_if_aborted();
  }

  /// @brief Wakes all waiters, now and until reset(), with an error naming `reason`.
  void abort() {
    aborted_.store(true, std::memory_order_release);
    phase_.fetch_add(1, std::memory_order_release);
    phase_.notify_all();
  }
  /// @brief Makes the barrier usable again; call only when no thread is inside it.
  void reset() {
    arrived_.store(0, std::memory_order_relaxed);
    aborted_.store(false, std::memory_order_release);
  }
  [[nodiscard]] bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  [[nodiscard]] std::uint32_t count() const { return count_; }

 private:
  static constexpr int spin_limit = 4000;
  void throw_if_aborted() const {
    if (aborted_.load(std::memory_order_acquire))
      throw communication_error("collective aborted: another place of the group failed");
  }

  const std::uint32_t count_;
  std::atomic<std::uint32_t> arrived_{0};
  std::atomic<std::uint32_t> phase_{0};
  std::atomic<bool> aborted_{false};
};

}  // namespace pdo::detail
