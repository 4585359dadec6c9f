// pdo/comm/mpi/communicator.hpp: the MPI backend: places in several processes, one or more each.
#pragma once

#include <pdo/comm/group_communicator.hpp>
#include <pdo/comm/mesh_comms.hpp>
#include <pdo/comm/mpi/environment.hpp>
#include <pdo/comm/mpi/group.hpp>
#include <pdo/comm/mpi/watch.hpp>
#include <pdo/place/cpu_place.hpp>
#include <pdo/place/mesh.hpp>
#include <pdo/place/cuda_place.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
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

namespace detail {

/// @brief make_mesh's check that every process made the same mesh (see
/// pdo::detail::multiprocess_agreement): each process's description of the mesh (axes,
/// extents, the places each process holds) is compared, by length and hash, then, when they
/// differ, gathered so that every process throws pdo::mismatch_error naming all of them.
inline void agree_on_mesh(const pdo::detail::mesh_state& m, const std::string& description) {
  watch& w = watch::instance();
  const MPI_Comm comm = w.agreement_comm();
  int n = 0;
  MPI_Comm_size(comm, &n);
  const std::vector<int> peers = w.others();
  const auto timeout = m.options.collective_timeout.count() > 0 ? m.options.collective_timeout : default_collective_timeout();
  const wait_label label = w.next_agreement("make_mesh's agreement on " + description);
  auto all_gather = [&](const void* mine, int count, MPI_Datatype type, void* all, const int* counts, const int* displs) {
    MPI_Request request = MPI_REQUEST_NULL;
    check(MPI_Iallgatherv(mine, count, type, all, counts, displs, type, comm, &request), "MPI_Iallgatherv");
    w.wait(
        [&] {
          int done = 0;
          check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
          return done != 0;
        },
        label, peers, timeout, true);
  };
  std::uint64_t fingerprint = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : description) fingerprint = (fingerprint ^ c) * 1099511628211ull;
  std::vector<std::uint64_t> mine{description.size(), fingerprint}, all(2 * static_cast<std::size_t>(n));
  std::vector<int> counts(static_cast<std::size_t>(n), 2), displs(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) displs[static_cast<std::size_t>(r)] = 2 * r;
  try {
    all_gather(mine.data(), 2, MPI_UINT64_T, all.data(), counts.data(), displs.data());
  } catch (const collective_timeout&) {
    abandon(std::move(mine));
    abandon(std::move(all));
    abandon(std::move(counts));
    abandon(std::move(displs));
    throw;
  }
  bool same = true;
  for (int r = 0; r < n; ++r) same = same && all[2 * r] == mine[0] && all[2 * r + 1] == mine[1];
  if (same) return;
  // they differ: every process learns every description
  std::size_t total = 0;
  for (int r = 0; r < n; ++r) {
    counts[static_cast<std::size_t>(r)] = static_cast<int>(all[2 * r]);
    displs[static_cast<std::size_t>(r)] = static_cast<int>(total);
    total += all[2 * r];
  }
  std::string texts(total, '\0');
  all_gather(description.data(), static_cast<int>(description.size()), MPI_CHAR, texts.data(), counts.data(), displs.data());
  std::vector<std::pair<std::string, std::string>> kinds;  // description, the ranks that made it
  for (int r = 0; r < n; ++r) {
    const std::string d = texts.substr(static_cast<std::size_t>(displs[static_cast<std::size_t>(r)]), all[2 * r]);
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == d; });
    if (it == kinds.end()) kinds.emplace_back(d, "rank " + std::to_string(r));
    else it->second += ", " + std::to_string(r);
  }
  std::string listing;
  for (const auto& [d, ranks] : kinds) listing += (listing.empty() ? "" : "; ") + ranks + " made " + d;
  throw mismatch_error("make_mesh: the processes made different meshes: " + listing +
                       ". Every process must make the same meshes, with the same arguments, in the same order");
}

/// @brief Throws on every process unless all passed the same `per_process` to `op`.
inline void check_same_per_process(const char* op, std::size_t per_process) {
  unsigned long long mine_count = per_process, low = 0, high = 0;
  MPI_Allreduce(&mine_count, &low, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&mine_count, &high, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  if (low != high)
    throw layout_error(std::string(op) + ": processes asked for different numbers of places (" + std::to_string(low) + " to " +
                       std::to_string(high) + "); every process must pass the same per_process");
}

/// @brief make_mesh's meeting of the processes of a mesh over several of them: the agreement
/// on the mesh, then its communicators, built at once (each a collective over the world: their
/// order is make_mesh's, the same on every process, so threads that drive their own meshes
/// later cannot cross them). One host thread of this process at a time.
inline void meet_on_mesh(pdo::detail::mesh_state& m, const std::string& description) {
  static std::mutex one_at_a_time;
  const std::lock_guard lock(one_at_a_time);
  agree_on_mesh(m, description);
  (void)pdo::detail::comms_of_state(m);
}

/// @brief What meshes over places of several processes need, started by every process where
/// it makes such places: the watch of the waits, and make_mesh's meeting.
inline void start_watch() {
  watch::instance().start();
  pdo::detail::multiprocess_agreement() = &meet_on_mesh;
}
}  // namespace detail

/// @brief The places of every process of MPI_COMM_WORLD, `per_process` each, in rank
/// order: place `r * per_process + i` is place i of rank r, named "rank<r>/cpu:<i>".
/// This process's places are CPU places over its cores, pinned only when the launcher
/// bound the process to some of the machine's cores (else processes would pin their
/// places onto the same ones); the others stand for places of other processes. Every
/// process must call it with the same `per_process` (it starts MPI if needed).
inline std::vector<any_place> world_places(std::size_t per_process = 1, std::size_t memory_cap = 0) {
  const int me = mpi::rank(), n = mpi::size();
  detail::check_same_per_process("world_places", per_process);
  detail::start_watch();
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

#if defined(PDO_WITH_CUDA)
/// @brief GPU places of every process of MPI_COMM_WORLD, `per_process` each, in rank order
/// (place `r * per_process + i` is "rank<r>/cuda:<d>"): this process's are the GPUs
/// local_rank * per_process + i of its node (local rank: its rank among the processes on
/// the same node), modulo the GPUs it sees. A mesh over them runs its collectives on NCCL,
/// bootstrapped over MPI. Every process must call it with the same `per_process`.
inline std::vector<any_place> world_cuda_places(std::size_t per_process = 1, std::size_t memory_cap = 0) {
  const int me = mpi::rank(), n = mpi::size();
  detail::check_same_per_process("world_cuda_places", per_process);
  detail::start_watch();
  if (per_process == 0) throw layout_error("world_cuda_places: asked for 0 places per process; ask for at least one");
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, me, MPI_INFO_NULL, &node);
  int local_rank = 0;
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_free(&node);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    throw error("world_cuda_places: rank " + std::to_string(me) + " sees no GPU: " + cuda_unavailable_reason());
  // every process's device ordinals, so each can name the others' places
  std::vector<int> ordinals(per_process), all(per_process * static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < per_process; ++i)
    ordinals[i] = static_cast<int>((static_cast<std::size_t>(local_rank) * per_process + i) % static_cast<std::size_t>(devices));
  MPI_Allgather(ordinals.data(), static_cast<int>(per_process), MPI_INT, all.data(), static_cast<int>(per_process), MPI_INT, MPI_COMM_WORLD);
  std::vector<any_place> places;
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < per_process; ++i) {
      const int d = all[static_cast<std::size_t>(r) * per_process + i];
      if (r == me) {
        places.emplace_back(cuda_place(d, cuda_place_options{memory_cap, "rank" + std::to_string(r) + "/cuda:" + std::to_string(d), r}));
      } else {
        places.emplace_back(std::make_shared<pdo::detail::place_state>(place_kind::cuda, d, r, false, std::vector<int>{},
                                                                       "rank" + std::to_string(r) + "/cuda:" + std::to_string(d)));
      }
    }
  return places;
}
#endif

}  // namespace pdo::mpi
