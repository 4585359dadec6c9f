// pdo/place/place_state.hpp: what every place handle shares: identity, cores, memory, worker.
#pragma once

#include <pdo/core/error.hpp>
#include <pdo/place/worker.hpp>
#include <pdo/memory/caching_allocator.hpp>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
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

/// @brief Whether a tensor of place `p` (null: the host) lives in a GPU's memory.
inline bool on_gpu(const place_state* p) { return p != nullptr && p->kind == place_kind::cuda; }

/// @brief The memory a tensor of place `p` lives in: its GPU's (that place), or host memory
/// (null), which the host and every CPU place share.
inline place_state* memory_of(place_state* p) { return on_gpu(p) ? p : nullptr; }

/// @brief Runs `f` on `p`'s worker and returns what it returns, the calling thread waiting
/// (on that worker itself, at once). A failure is thrown again here, with its pdo::error
/// subclass and message.
template <class F>
auto run_on_place(place_state& p, F&& f) -> decltype(f()) {
  using result_t = decltype(f());
  if (current_place() == &p) return f();
  if (!p.runner) throw layout_error("place " + p.name + " belongs to another process; its work runs there");
  std::conditional_t<std::is_void_v<result_t>, bool, std::optional<result_t>> result{};
  std::optional<captured_error> failure;
  std::mutex m;
  std::condition_variable finished;
  bool done = false;
  p.runner->submit([&] {
    try {
      if constexpr (std::is_void_v<result_t>) f();
      else result.emplace(f());
    } catch (...) {
      failure = captured_error::current();
    }
    std::lock_guard lock(m);
    done = true;
    finished.notify_one();
  });
  std::unique_lock lock(m);
  finished.wait(lock, [&] { return done; });
  if (failure) failure->rethrow_with_context("");
  if constexpr (!std::is_void_v<result_t>) return std::move(*result);
}

}  // namespace detail
}  // namespace pdo
