// pdo/exec/run_on_places.hpp: run one task per local place of a mesh, at once, and collect failures.
#pragma once

#include <pdo/comm/mesh_comms.hpp>
#include <pdo/core/error.hpp>

#include <cstddef>
#include <exception>
#include <latch>
#include <optional>
#include <string>
#include <vector>

namespace pdo::detail {

/// @brief Throws the exception in `failure` again with `context` in front of its
/// message, keeping its pdo::error subclass.
[[noreturn]] inline void rethrow_with_context(const std::exception_ptr& failure, const std::string& context) {
  try {
    std::rethrow_exception(failure);
  } catch (const communication_error& e) {
    throw communication_error(context + e.what());
  } catch (const shape_error& e) {
    throw shape_error(context + e.what());
  } catch (const layout_error& e) {
    throw layout_error(context + e.what());
  } catch (const out_of_memory& e) {
    throw out_of_memory(context + e.what());
  } catch (const io_error& e) {
    throw io_error(context + e.what());
  } catch (const std::exception& e) {
    throw error(context + e.what());
  } catch (...) {
    throw error(context + "unknown exception");
  }
}

inline bool is_abort_echo(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const communication_error& e) {
    return std::string(e.what()).find("aborted") != std::string::npos;
  } catch (...) {
    return false;
  }
}

/// @brief The failure of one place, if any: the first place (in mesh order) whose
/// failure is a cause, not the echo of another place's abort.
struct place_failure {
  std::size_t place = 0;
  std::exception_ptr error;
};

/// @brief Runs `task(place_index, local_ordinal)` on the worker of every place of `m`
/// that lives in this process, all at once, and waits for all of them. When a task
/// fails, the mesh's collectives are aborted so the other places do not wait for it,
/// and reset once every task has returned, so the mesh stays usable.
/// @return the first failure, or nothing
template <class Mesh, class Task>
std::optional<place_failure> try_run_on_places(const Mesh& m, Task&& task) {
  const auto& local = m.local_places();
  for (auto p : local)
    if (m.place(p).state()->runner && m.place(p).state()->runner->is_current())
      throw error("pdo: a mesh-wide operation was started from inside a task of place " + m.place(p).name() +
                  "; call it from the host thread, not from a parallel_do block");
  auto& comms = comms_of(m);
  std::vector<std::exception_ptr> failures(local.size());
  std::latch done(static_cast<std::ptrdiff_t>(local.size()));
  for (std::size_t k = 0; k < local.size(); ++k)
    m.place(local[k]).submit([&, k] {
      try {
        task(local[k], k);
      } catch (...) {
        failures[k] = std::current_exception();
        comms.abort();
      }
      done.count_down();
    });
  done.wait();
  std::optional<place_failure> first;
  for (std::size_t k = 0; k < local.size(); ++k) {
    if (!failures[k]) continue;
    if (!first || (is_abort_echo(first->error) && !is_abort_echo(failures[k]))) first = place_failure{local[k], failures[k]};
  }
  if (first) comms.reset();
  return first;
}

/// @brief try_run_on_places, throwing the failure as a pdo::error naming `op` and the place.
template <class Mesh, class Task>
void run_on_places(const char* op, const Mesh& m, Task&& task) {
  if (auto failure = try_run_on_places(m, std::forward<Task>(task)))
    rethrow_with_context(failure->error, std::string(op) + ": on place " + m.place(failure->place).name() + ": ");
}

}  // namespace pdo::detail
