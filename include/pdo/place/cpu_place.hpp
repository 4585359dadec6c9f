// pdo/place/cpu_place.hpp: CPU places, each a worker thread on its own cores.
#pragma once

#include <pdo/core/error.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/place/place_concept.hpp>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace pdo {

/// @brief A CPU place: a worker thread that runs the place's work on the cores it was
/// given (pinned there when no other place shares them), and a caching allocator.
class cpu_place : public detail::place_handle<cpu_place> {
 public:
  /// @brief A new place named `cpu:<ordinal>` on `cores`, with an optional memory cap.
  /// @param pin pin the worker to `cores` (off when cores are shared with other places)
  cpu_place(int ordinal, std::vector<int> cores, bool pin = true, std::size_t memory_cap = 0)
      : cpu_place(std::make_shared<detail::place_state>(place_kind::cpu, ordinal, 0, true, std::move(cores),
                                                        "cpu:" + std::to_string(ordinal)),
                  pin, memory_cap) {}

  /// @brief A handle to the CPU place behind `state` (which must be a CPU place).
  explicit cpu_place(std::shared_ptr<detail::place_state> state) : place_handle(std::move(state)) {}

 private:
  cpu_place(std::shared_ptr<detail::place_state> state, bool pin, std::size_t cap) : place_handle(std::move(state)) {
    state_->memory = std::make_unique<caching_allocator>(state_->name, cap);
    detail::start_worker(*state_, pin ? state_->cores : std::vector<int>{});
  }
};

/// @brief `n` CPU places over the cores of this process. With n <= cores each place
/// gets its own cores (cores / n, the first ones one more when uneven) and is pinned to
/// them; with more places than cores, places share cores round-robin and are not pinned.
/// @param memory_cap per-place cap in bytes (0: none)
inline std::vector<cpu_place> cpu_places(std::size_t n, std::size_t memory_cap = 0) {
  if (n == 0) throw error("cpu_places: asked for 0 places; ask for at least one");
  const std::vector<int> cores = detail::process_cores();
  const std::size_t c = cores.size();
  std::vector<cpu_place> places;
  places.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<int> mine;
    if (n <= c) {
      const std::size_t first = detail::chunk_offset(c, n, i), count = detail::chunk_size(c, n, i);
      mine.assign(cores.begin() + static_cast<std::ptrdiff_t>(first),
                  cores.begin() + static_cast<std::ptrdiff_t>(first + count));
    } else {
      mine.push_back(cores[i % c]);
    }
    places.emplace_back(static_cast<int>(i), std::move(mine), n <= c, memory_cap);
  }
  return places;
}

/// @brief One CPU place per core of this process.
inline std::vector<cpu_place> cpu_places() { return cpu_places(detail::process_cores().size()); }

}  // namespace pdo
