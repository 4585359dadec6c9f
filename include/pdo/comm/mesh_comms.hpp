// pdo/comm/mesh_comms.hpp: the communicators of a mesh: one group per axis line, and the whole mesh.
#pragma once

#include <pdo/comm/group_communicator.hpp>
#include <pdo/comm/threads/local_group.hpp>
#include <pdo/place/mesh.hpp>

#if defined(PDO_WITH_MPI)
#include <pdo/comm/mpi/group.hpp>
#endif

#include <cstddef>
#include <memory>
#include <string>
#include <variant>
#include <vector>

namespace pdo {

namespace detail {

/// @brief A group whose backend was chosen when its mesh was built: threads when all
/// places live in this process, MPI otherwise.
struct any_group {
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
decltype(auto) visit_group(any_group& g, F&& f) {
  return std::visit([&](auto& p) -> decltype(auto) { return f(*p); }, g.impl);
}

/// @brief The groups of one mesh. `lines[a][g]` is the g-th group along axis a; place
/// p is member `coord(p, a)` of group `line_of[a][p]`.
struct mesh_comms {
  std::shared_ptr<any_group> whole;
  std::vector<std::vector<std::shared_ptr<any_group>>> lines;
  std::vector<std::vector<std::size_t>> line_of;

  /// @brief Wakes every place blocked in a collective of this mesh with an error.
  void abort() {
    for_each_group([](any_group& g) { g.abort(); });
  }
  void reset() {
    for_each_group([](any_group& g) { g.reset(); });
  }
  /// @brief Calls `f` on every group with members in this process.
  template <class F>
  void for_each_group(F&& f) {
    if (whole) f(*whole);
    for (auto& axis : lines)
      for (auto& g : axis)
        if (g) f(*g);
  }
};

inline std::shared_ptr<any_group> make_group(const mesh_state& m, const std::vector<std::size_t>& members) {
  std::vector<std::string> names;
  for (auto i : members) names.push_back(m.places[i].name());
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
    return std::make_shared<any_group>(
        any_group{std::make_shared<mpi::detail::group>(comm, per_rank, names, members.size() == m.places.size())});
  }
#endif
  if (m.multiprocess)
    throw communication_error("mesh: places of other processes need the MPI backend; build with PDO_WITH_MPI");
  return std::make_shared<any_group>(any_group{std::make_shared<local_group>(names)});
}

/// @brief The communicators of the mesh behind `state`, built on first use (by every
/// process of a multi-process mesh, at the same point of the program).
template <class Mesh>
mesh_comms& comms_of(const Mesh& m) {
  auto& state = *m.state();
  std::call_once(state.comms_once, [&] {
    auto comms = std::make_shared<mesh_comms>();
    std::vector<std::size_t> all(m.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    comms->whole = make_group(state, all);
    comms->lines.resize(Mesh::ndim);
    comms->line_of.assign(Mesh::ndim, std::vector<std::size_t>(m.size()));
    for (std::size_t a = 0; a < Mesh::ndim; ++a)
      for (std::size_t p = 0; p < m.size(); ++p) {
        if (m.coord(p, a) != 0) continue;
        const auto members = m.group(a, p);
        for (auto q : members) comms->line_of[a][q] = comms->lines[a].size();
        comms->lines[a].push_back(make_group(state, members));
      }
    state.comms = std::move(comms);
  });
  return *state.comms;
}

}  // namespace detail

/// @brief The communicator of a mesh's groups, whichever backend they run on.
using mesh_communicator = group_communicator<detail::any_group>;

static_assert(communicator<mesh_communicator>);

/// @brief Place `index`'s endpoint on the group of places along mesh axis `axis`.
template <class Mesh>
mesh_communicator communicator_along(const Mesh& m, std::size_t axis, std::size_t index) {
  auto& comms = detail::comms_of(m);
  return {comms.lines[axis][comms.line_of[axis][index]], m.coord(index, axis)};
}

/// @brief Place `index`'s endpoint on the group of all places of the mesh.
template <class Mesh>
mesh_communicator communicator_of(const Mesh& m, std::size_t index) {
  return {detail::comms_of(m).whole, index};
}

}  // namespace pdo
