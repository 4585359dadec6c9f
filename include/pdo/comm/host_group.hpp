// pdo/comm/host_group.hpp: the group of host memory a mesh's places communicate through:
// the threads backend when all places live in this process, MPI otherwise.
#pragma once

#include <pdo/comm/threads/local_group.hpp>
#include <pdo/place/mesh.hpp>

#if defined(PDO_WITH_MPI)
#include <pdo/comm/mpi/group.hpp>
#endif

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace pdo::detail {

/// @brief A group of host buffers whose backend was chosen when its mesh was built:
/// threads when all places live in this process, MPI otherwise.
struct host_group {
#if defined(PDO_WITH_MPI)
  std::variant<std::shared_ptr<local_group>, std::shared_ptr<mpi::detail::group>> impl;
#else
  std::variant<std::shared_ptr<local_group>> impl;
#endif
  void abort() {
    std::visit([](auto& g) { g->abort(); }, impl);
  }
  void reset() {
    std::visit([](auto& g) { g->reset(); }, impl);
  }
};

template <class F>
decltype(auto) visit_group(host_group& g, F&& f) {
  return std::visit([&](auto& p) -> decltype(auto) { return f(*p); }, g.impl);
}

/// @brief The members in this process of a host group, as a threads group, and the group's
/// index of the first of them: all of a threads group (from 0), an MPI group's local members.
inline std::pair<local_group*, std::size_t> local_members(local_group& g) { return {&g, 0}; }
#if defined(PDO_WITH_MPI)
inline std::pair<local_group*, std::size_t> local_members(mpi::detail::group& g) { return {&g.local(), g.first()}; }
#endif
inline std::pair<local_group*, std::size_t> local_members(host_group& h) {
  return visit_group(h, [](auto& g) { return local_members(g); });
}

/// @brief The number of the next group made in this process: every process makes the groups
/// of its meshes in one order (the processes agree on each mesh), so a group has the same
/// number everywhere.
inline std::uint64_t next_group_number() {
  static std::atomic<std::uint64_t> next{0};
  return next.fetch_add(1, std::memory_order_relaxed) + 1;
}

/// @brief The host group of `members` (mesh indices) of mesh `m`, or nullptr in a process
/// that holds none of them; `label` names it in messages ("axis \"dp\" of mesh(dp=4)").
inline std::shared_ptr<host_group> make_host_group(const mesh_state& m, const std::vector<std::size_t>& members,
                                                   [[maybe_unused]] const std::string& label) {
  std::vector<std::string> names;
  for (auto i : members) names.push_back(m.places[i].name());
  [[maybe_unused]] const std::uint64_t number = next_group_number();
#if defined(PDO_WITH_MPI)
  if (m.multiprocess) {
    // every process takes part in the split, in the same order; those without members get no comm
    int me = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    std::vector<std::size_t> per_rank;
    int last = -1;
    bool mine = false;
    for (auto i : members) {
      const int r = m.places[i].process();
      if (r != last) per_rank.push_back(0);
      ++per_rank.back();
      last = r;
      mine = mine || r == me;
    }
    MPI_Comm comm = MPI_COMM_NULL;
    mpi::detail::check(MPI_Comm_split(MPI_COMM_WORLD, mine ? 0 : MPI_UNDEFINED, me, &comm), "MPI_Comm_split");
    if (!mine) return nullptr;
    mpi::detail::group_identity identity{number, label, m.options.collective_timeout.count() > 0
                                                            ? m.options.collective_timeout
                                                            : mpi::detail::default_collective_timeout()};
    return std::make_shared<host_group>(host_group{
        std::make_shared<mpi::detail::group>(comm, per_rank, names, members.size() == m.places.size(), std::move(identity))});
  }
#endif
  if (m.multiprocess)
    throw communication_error("mesh: places of other processes need the MPI backend; build with PDO_WITH_MPI");
  return std::make_shared<host_group>(host_group{std::make_shared<local_group>(names)});
}

}  // namespace pdo::detail
