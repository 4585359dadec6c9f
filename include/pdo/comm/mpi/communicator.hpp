// pdo/comm/mpi/communicator.hpp: the MPI backend: places in several processes, one or more each.
#pragma once

#include <pdo/comm/group_communicator.hpp>
#include <pdo/comm/mpi/environment.hpp>
#include <pdo/comm/mpi/group.hpp>
#include <pdo/place/cpu_place.hpp>

#include <algorithm>
#include <memory>
#include <thread>
#include <string>
#include <vector>

namespace pdo::mpi {

/// @brief A member of a group whose places live in several MPI processes. Members of
/// one process meet through shared memory; one of them carries the combined data over
/// MPI, so each collective costs one MPI collective per process, whatever the number
/// of places there.
using communicator = group_communicator<detail::group>;

static_assert(pdo::communicator<communicator>);

/// @brief The places of every process of MPI_COMM_WORLD, `per_process` each, in rank
/// order: place `r * per_process + i` is place i of rank r, named "rank<r>/cpu:<i>".
/// This process's places are CPU places over its cores, pinned only when the launcher
/// bound the process to some of the machine's cores (else processes would pin their
/// places onto the same ones); the others stand for places of other processes. Every
/// process must call it with the same `per_process` (it starts MPI if needed).
inline std::vector<any_place> world_places(std::size_t per_process = 1, std::size_t memory_cap = 0) {
  const int me = mpi::rank(), n = mpi::size();
  unsigned long long mine_count = per_process, low = 0, high = 0;
  MPI_Allreduce(&mine_count, &low, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&mine_count, &high, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  if (low != high)
    throw layout_error("world_places: processes asked for different numbers of places (" + std::to_string(low) + " to " +
                       std::to_string(high) + "); every process must pass the same per_process");
  auto label = [](int rank, std::size_t i) { return "rank" + std::to_string(rank) + "/cpu:" + std::to_string(i); };
  const std::vector<int> cores = pdo::detail::process_cores();
  const bool bound = cores.size() < std::max(1u, std::thread::hardware_concurrency());
  const std::vector<cpu_place> mine =
      pdo::detail::share_cores(per_process, cores, bound, memory_cap, me, [&](std::size_t i) { return label(me, i); });
  std::vector<any_place> places;
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < per_process; ++i) {
      if (r == me) places.emplace_back(mine[i]);
      else
        places.emplace_back(std::make_shared<pdo::detail::place_state>(place_kind::cpu, static_cast<int>(i), r, false,
                                                                       std::vector<int>{}, label(r, i)));
    }
  return places;
}

}  // namespace pdo::mpi
