// pdo/place/cpu_place.hpp: CPU places, each with its lanes, its compute lane on its own cores.
#pragma once

#include <pdo/core/error.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/place/place_concept.hpp>

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
