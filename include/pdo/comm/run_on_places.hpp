// pdo/comm/run_on_places.hpp: run one task per local place of a mesh, at once, and collect failures.
#pragma once

#include <pdo/comm/mesh_comms.hpp>
#include <pdo/core/error.hpp>

#include <cstddef>
#include <atomic>
#include <cstdio>
#include <memory>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#if defined(PDO_WITH_MPI)
#include <pdo/comm/mpi/environment.hpp>
#endif

namespace pdo::detail {

/// @brief Mesh-wide operations of one process run one at a time: two host threads whose
/// operations share places would otherwise queue their tasks in different orders on
/// different places and wait for each other forever.
inline std::mutex& mesh_operations_mutex() {
  static std::mutex m;
  return m;
}

/// @brief A failure in the middle of collectives on one process of a multi-process mesh:
/// the other processes are inside MPI calls that wait for this one, and cannot be told.
/// Rather than leave them hanging, the job ends with the error.
[[noreturn]] inline void end_job(const std::string& what) {
  std::fprintf(stderr, "pdo: fatal: %s; the other processes of the mesh cannot go on without this one, ending the job\n",
               what.c_str());
  std::fflush(stderr);
#if defined(PDO_WITH_MPI)
  MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  std::terminate();
}

/// @brief The failure of one place, if any: the first place (in mesh order) whose
/// failure is a cause, not the echo of another place's abort.
struct place_failure {
  std::size_t place = 0;
  captured_error error;
};

/// @brief The tasks of one mesh-wide operation, one per local place, and how they ended.
struct place_batch {
  explicit place_batch(std::size_t n) : done(n), failures(n), arrived(0) {}
  completion done;
  std::vector<std::size_t> places;               ///< mesh index of each task's place
  std::vector<std::optional<captured_error>> failures;  ///< per task, once done
  std::atomic<std::size_t> arrived;              ///< tasks at the closing barrier
  std::atomic<bool> released{false};

  /// @brief The first failure that is a cause, not an echo of another's (call after done.wait()).
  [[nodiscard]] std::optional<place_failure> first_failure() const {
    std::optional<place_failure> first;
    for (std::size_t k = 0; k < failures.size(); ++k) {
      if (!failures[k]) continue;
      if (!first || (first->error.is_abort_echo() && !failures[k]->is_abort_echo())) first = place_failure{places[k], *failures[k]};
    }
    return first;
  }
};

/// @brief Queues `task(place_index, local_ordinal)` on the worker of every place of `m`
/// in this process and returns without waiting. The caller holds mesh_operations_mutex,
/// so every place queues the operations of this process in one order.
///
/// A task that fails in a mesh of this process aborts the mesh's collectives when the
/// tasks `communicate`, so the other places do not wait for it. With `closing`, the tasks
/// then meet once more after their work: the last to arrive resets the collectives if any
/// failed, and only then may any place start its next operation (operations queued behind
/// this one are never caught by its abort). Without it, the caller resets them once done.
/// In a mesh over several processes a failure that the other processes cannot learn of
/// ends the job (end_job); argument mismatches are thrown alike by every member.
template <class Mesh, class Task>
std::shared_ptr<place_batch> submit_on_places(const Mesh& m, Task task, bool communicate, bool closing) {
  const auto& local = m.local_places();
  if (current_place() != nullptr)
    throw layout_error("pdo: a mesh-wide operation was started from inside a task of place " + current_place()->name +
                       "; call it from the host thread, not from a parallel_do block or an spmd task");
  auto& comms = comms_of(m);
  const bool local_only = !m.is_multiprocess();
  auto batch = std::make_shared<place_batch>(local.size());
  batch->places = local;
  for (std::size_t k = 0; k < local.size(); ++k)
    m.place(local[k]).submit([&comms, local_only, communicate, closing, batch, task, k, p = local[k]] {
      try {
        task(p, k);
      } catch (...) {
        batch->failures[k] = captured_error::current();
        if (local_only) {
          if (communicate) comms.abort();
        } else if (communicate && !shared_by_all_members(batch->failures[k]->kind)) {
          end_job(current_place()->name + ": " + batch->failures[k]->message);
        }
      }
      if (closing) {
        if (batch->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == batch->failures.size()) {
          bool failed = false;
          for (const auto& f : batch->failures) failed = failed || f.has_value();
          if (failed) comms.reset();
          batch->released.store(true, std::memory_order_release);
          batch->released.notify_all();
        } else {
          while (!batch->released.load(std::memory_order_acquire)) batch->released.wait(false, std::memory_order_acquire);
        }
      }
      batch->done.count_down();
    });
  return batch;
}

/// @brief Runs `task(place_index, local_ordinal)` on the worker of every place of `m`
/// that lives in this process, all at once, and waits for all of them.
///
/// When a task fails in a mesh of this process only, the mesh's collectives are aborted
/// so the other places do not wait for it, and reset once every task has returned, so
/// the mesh stays usable. In a mesh over several processes, tasks that `communicate`
/// cannot be unwound that way: an argument mismatch is thrown alike by every member
/// (pdo::mismatch_error) and returned here, any other failure ends the job (end_job).
/// @return the first failure that is a cause, not an echo of another's, or nothing
template <class Mesh, class Task>
std::optional<place_failure> try_run_on_places(const Mesh& m, Task&& task, bool communicate = true) {
  std::lock_guard serial(mesh_operations_mutex());
  const auto batch = submit_on_places(m, [&task](std::size_t p, std::size_t k) { task(p, k); }, communicate || !m.is_multiprocess(),
                                      false);
  batch->done.wait();
  auto first = batch->first_failure();
  if (first && !m.is_multiprocess()) comms_of(m).reset();
  return first;
}

/// @brief try_run_on_places, throwing the failure as a pdo::error naming `op` and the place.
template <class Mesh, class Task>
void run_on_places(const char* op, const Mesh& m, Task&& task) {
  if (auto failure = try_run_on_places(m, std::forward<Task>(task)))
    failure->error.rethrow_with_context(std::string(op) + ": on place " + m.place(failure->place).name() + ": ");
}

}  // namespace pdo::detail

namespace pdo {

/// @brief Runs `task(place_index)` on every place of `m` in this process, all at once
/// (single program, multiple data), and returns when all are done. Inside, a task
/// reaches the other places through `communicator_of(m, place_index)` or
/// `communicator_along(m, axis, place_index)`. A task's exception reaches the caller as
/// a pdo::error naming the place; in a mesh of one process the other places are
/// released from their collectives and the mesh stays usable (see try_run_on_places
/// for meshes over several processes).
template <class Mesh, class Task>
void spmd(const Mesh& m, Task&& task) {
  detail::run_on_places("spmd", m, [&](std::size_t p, std::size_t) { task(p); });
}

}  // namespace pdo
