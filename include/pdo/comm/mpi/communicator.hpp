// pdo/comm/mpi/communicator.hpp: the MPI backend: places in several processes, one or more each.
#pragma once

#include <pdo/comm/group_communicator.hpp>
#include <pdo/comm/mpi/environment.hpp>
#include <pdo/comm/mpi/group.hpp>
#include <pdo/place/cpu_place.hpp>

#include <memory>
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
/// order: place `r * per_process + i` is place i of rank r. This process's places are
/// CPU places over its cores; the others stand for places of other processes.
/// Every process must call it (it starts MPI if needed).
inline std::vector<any_place> world_places(std::size_t per_process = 1, std::size_t memory_cap = 0) {
  const int me = mpi::rank(), n = mpi::size();
  std::vector<any_place> places;
  const std::vector<cpu_place> mine = cpu_places(per_process, memory_cap);
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < per_process; ++i) {
      if (r == me) {
        const auto& s = mine[i].state();
        s->process = r;
        s->name = "rank" + std::to_string(r) + "/cpu:" + std::to_string(i);
        places.emplace_back(mine[i]);
      } else {
        places.emplace_back(std::make_shared<pdo::detail::place_state>(
            place_kind::cpu, static_cast<int>(i), r, false, std::vector<int>{},
            "rank" + std::to_string(r) + "/cpu:" + std::to_string(i)));
      }
    }
  return places;
}

}  // namespace pdo::mpi
