// pdo/place/place_state.hpp: what every place handle shares: identity, cores, memory, worker.
#pragma once

#include <pdo/place/worker.hpp>
#include <pdo/memory/caching_allocator.hpp>

#include <memory>
#include <string>
#include <vector>

namespace pdo {

/// @brief The kind of device a place is.
enum class place_kind { cpu, cuda };

namespace detail {

/// @brief The state behind a place handle. A place of another process (an MPI rank)
/// has no worker and no allocator here: only its identity.
struct place_state : std::enable_shared_from_this<place_state> {
  place_kind kind = place_kind::cpu;
  int ordinal = 0;          ///< index among the places of its kind in its process (or device ordinal)
  int process = 0;          ///< the MPI rank that owns it (0 in a single process)
  bool local = true;        ///< owned by this process
  std::vector<int> cores;   ///< the cores its work may use
  std::string name;         ///< "cpu:0", "cuda:1", "rank1/cpu:0"
  std::shared_ptr<void> device;  ///< a GPU place's streams and library handles (detail::cuda_device)
  std::unique_ptr<caching_allocator> memory;  ///< declared after `device`: destroyed before it
  std::unique_ptr<worker> runner;  ///< declared last: destroyed first, before the memory it uses

  place_state(place_kind k, int ord, int proc, bool is_local, std::vector<int> cpu_cores, std::string label)
      : kind(k), ordinal(ord), process(proc), local(is_local), cores(std::move(cpu_cores)), name(std::move(label)) {}
};

/// @brief The place whose worker runs the calling thread, or nullptr on other threads.
inline place_state*& current_place() {
  thread_local place_state* current = nullptr;
  return current;
}

/// @brief Starts `state`'s worker: a thread pinned to `pin_to` that knows its place.
inline void start_worker(place_state& state, std::vector<int> pin_to) {
  state.runner = std::make_unique<worker>(std::move(pin_to));
  state.runner->submit([s = &state] { current_place() = s; });
}

}  // namespace detail
}  // namespace pdo
