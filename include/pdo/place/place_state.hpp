// pdo/place/place_state.hpp: what every place handle shares: identity, cores, memory, lanes.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/error.hpp>
#include <pdo/memory/caching_allocator.hpp>
#include <pdo/place/lane.hpp>

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace pdo {

/// @brief The kind of device a place is.
enum class place_kind { cpu, cuda };

namespace detail {

// Aligned to a cache line, as mesh_state: the places of cpu_places(n) are made one after the
// other, and every tensor's copy of a place handle writes its reference counts.
/// @brief The state behind a place handle. A place of another process (an MPI rank)
/// has no lanes and no allocator here: only its identity.
struct alignas(64) place_state : std::enable_shared_from_this<place_state> {
  place_kind kind = place_kind::cpu;
  int ordinal = 0;          ///< index among the places of its kind in its process (or device ordinal)
  int process = 0;          ///< the MPI rank that owns it (0 in a single process)
  bool local = true;        ///< owned by this process
  std::vector<int> cores;   ///< the cores its work may use
  std::string name;         ///< "cpu:0", "cuda:1", "rank1/cpu:0"
  std::shared_ptr<void> device;  ///< a GPU place's streams and library handles (detail::cuda_device)
  std::unique_ptr<caching_allocator> memory;  ///< declared after `device`: destroyed before it
  std::function<void()> lane_setup;  ///< runs first on each lane's thread (a GPU place selects its device)
  std::vector<int> pin;              ///< the cores its lanes are pinned to (empty: not pinned)
  std::mutex lanes_mutex;
  /// @brief The host thread whose operation holds the place (see place_hold), or none.
  std::atomic<std::thread::id> held_by{};
  /// @brief The host threads submitting an operation on the place now (see place_hold).
  std::atomic<int> submitting{0};
  /// @brief Its lanes, by lane_kind: the compute lane from the start, the others made on
  /// first use. Declared last: destroyed first, before the memory their work uses.
  std::array<std::unique_ptr<lane>, lane_kinds> lanes;

  place_state(place_kind k, int ord, int proc, bool is_local, std::vector<int> cpu_cores, std::string label)
      : kind(k), ordinal(ord), process(proc), local(is_local), cores(std::move(cpu_cores)), name(std::move(label)) {}
};

/// @brief Place `p`'s lane of kind `k`, made on first use. Only places of this process have lanes.
inline lane& lane_of(place_state& p, lane_kind k = lane_kind::compute) {
  const auto i = static_cast<std::size_t>(k);
  std::lock_guard lock(p.lanes_mutex);
  if (!p.lanes[i]) {
    if (!p.local) throw layout_error("place " + p.name + " belongs to another process; its work runs there");
    std::function<void()> setup = p.lane_setup ? p.lane_setup : [] {};
    // every lane of a place runs on the place's cores: its collectives and copies move the
    // place's memory (two places' communication lanes left to float can share one core while
    // the other idles, and a data-parallel step's fused sync and update then takes twice as
    // long); a CPU place's tasks may run on a host thread that waits for them (lane::run_here)
    p.lanes[i] = std::make_unique<lane>(p, p.name, k, p.pin, std::move(setup), p.kind == place_kind::cpu);
  }
  return *p.lanes[i];
}

/// @brief Starts `state`'s compute lane, pinned to `pin_to`; `setup` runs first on each of its lanes.
inline void start_lanes(place_state& state, std::vector<int> pin_to, std::function<void()> setup = {}) {
  state.pin = std::move(pin_to);
  state.lane_setup = std::move(setup);
  lane_of(state, lane_kind::compute);
}

/// @brief Queues `fn` on `p`'s lane `k`, behind the work queued there before, and returns
/// its task (waiting for nothing else: the engine's ordering by buffers is not involved).
inline task_handle queue_on_lane(place_state& p, task fn, const char* op, lane_kind k = lane_kind::compute) {
  lane& l = lane_of(p, k);
  auto t = std::make_shared<task_state>();
  t->fn = std::move(fn);
  t->home = &l;
  t->op = op;
  t->waiting.store(0, std::memory_order_relaxed);  // it waits for nothing: runs after the lane's earlier tasks
  l.push(t);
  return t;
}

/// @brief Whether a tensor of place `p` (null: the host) lives in a GPU's memory.
inline bool on_gpu(const place_state* p) { return p != nullptr && p->kind == place_kind::cuda; }

/// @brief The memory a tensor of place `p` lives in: its GPU's (that place), or host memory
/// (null), which the host and every CPU place share.
inline place_state* memory_of(place_state* p) { return on_gpu(p) ? p : nullptr; }

/// @brief Runs `call(context)` on `p`'s compute lane, the calling thread waiting; a failure
/// is thrown again here, with its pdo::error subclass and message.
PDO_NOINLINE inline void run_waiting(place_state& p, void (*call)(void*), void* context) {
  std::optional<captured_error> failure;
  const task_handle t = queue_on_lane(p, [&] {
    try {
      call(context);
    } catch (...) {
      failure = captured_error::current();
    }
  }, "run_on_place");
  t->wait_ended();
  if (failure) failure->rethrow_with_context("");
}

/// @brief Runs `f` on `p`'s compute lane and returns what it returns, the calling thread
/// waiting (on one of p's lanes already: at once, there). A failure is thrown again here,
/// with its pdo::error subclass and message.
template <class F>
auto run_on_place(place_state& p, F&& f) -> decltype(f()) {
  using result_t = decltype(f());
  if (current_place() == &p) return f();
  if constexpr (std::is_void_v<result_t>) {
    run_waiting(p, [](void* c) { (*static_cast<std::remove_reference_t<F>*>(c))(); }, const_cast<void*>(static_cast<const void*>(&f)));
  } else {
    std::optional<result_t> result;
    auto body = [&] { result.emplace(f()); };
    run_waiting(p, [](void* c) { (*static_cast<decltype(body)*>(c))(); }, &body);
    return std::move(*result);
  }
}

}  // namespace detail
}  // namespace pdo
