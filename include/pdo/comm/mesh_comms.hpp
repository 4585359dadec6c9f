// pdo/comm/mesh_comms.hpp: the communicators of a mesh: one group per axis line, and the whole mesh.
#pragma once

#include <pdo/comm/group_communicator.hpp>
#include <pdo/comm/host_group.hpp>
#include <pdo/comm/threads/local_group.hpp>
#include <pdo/place/cuda_place.hpp>
#include <pdo/place/mesh.hpp>

#if defined(PDO_WITH_MPI)
#include <pdo/comm/mpi/group.hpp>
#endif
#if defined(PDO_WITH_CUDA)
#include <pdo/comm/nccl/group.hpp>
#include <pdo/comm/staged_group.hpp>
#endif

#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace pdo {

namespace detail {

/// @brief A group whose backend was chosen when its mesh was built: threads when all
/// places live in this process, MPI otherwise; with GPU places, NCCL when every place is
/// a GPU, and the host group with GPU buffers staged through host memory when CPU and GPU
/// places mix.
struct any_group {
  std::variant<std::shared_ptr<local_group>
#if defined(PDO_WITH_MPI)
               ,
               std::shared_ptr<mpi::detail::group>
#endif
#if defined(PDO_WITH_CUDA)
               ,
               std::shared_ptr<nccl::detail::group>, std::shared_ptr<staged_group>
#endif
               >
      impl;
  std::string label;  ///< "axis \"dp\" of mesh(dp=4)": for the timeline
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
inline std::string group_label(const any_group& g) { return g.label; }

/// @brief The groups of one mesh. `lines[a][g]` is the g-th group along axis a; place
/// p is member `coord(p, a)` of group `line_of[a][p]`.
struct mesh_comms {
  std::shared_ptr<any_group> whole;
  /// @brief The threads or MPI group of all the places, whatever their devices: small
  /// exchanges of host values (agreement checks) go through it on any mesh, never NCCL.
  std::shared_ptr<any_group> whole_host;
  std::vector<std::vector<std::shared_ptr<any_group>>> lines;
  std::vector<std::vector<std::size_t>> line_of;
  std::vector<std::vector<std::size_t>> member_in_line;  ///< [a][p]: p's member index in its group along a (its coordinate)

  /// @brief Wakes every place blocked in a collective of this mesh with an error.
  void abort() {
    for_each_group([](any_group& g) { g.abort(); });
  }
  void reset() {
    for_each_group([](any_group& g) { g.reset(); });
  }
  /// @brief The task of place `p` (a place of this process) has ended: the collectives of its
  /// groups that need it cannot complete any more, so the other members of this process
  /// waiting in one, or entering one, get an error instead of waiting for it forever
  /// (local_group::leave), until rejoin(). In one process every member is told
  /// (pdo::mismatch_error); over MPI, the other places of this process in its groups
  /// (pdo::communication_error: the other processes cannot be told, so the job ends). On GPU
  /// places it is the host group of each NCCL or staged group that is told: every call there
  /// starts with a host agreement of its members, which a departed member cannot join.
  void left(std::size_t p) {
    each_group_of(p, [](local_group& g, std::size_t member) { g.leave(member); });
  }
  /// @brief After left(): the collectives are usable again (once no task of the mesh is in one).
  void rejoin() {
    for_each_group([](any_group& g) { local_members_of(g).first->reopen(); });
  }
  /// @brief `f(local group, p's member index in it)` for each group of place `p`, through the
  /// part in this process of the group's host group (the whole of a threads group, an MPI
  /// group's local members; whole_host is whole's host group); none for groups of one member
  /// in this process.
  template <class F>
  void each_group_of(std::size_t p, F&& f) {
    auto visit = [&](any_group* g, std::size_t member) {
      if (g == nullptr) return;
      const auto [local, first] = local_members_of(*g);
      if (local->size() > 1) f(*local, member - first);
    };
    visit(whole.get(), p);
    for (std::size_t a = 0; a < lines.size(); ++a) {
      const std::size_t line = line_of[a][p];
      if (line < lines[a].size()) visit(lines[a][line].get(), member_in_line[a][p]);
    }
  }
  /// @brief The members in this process of `g`'s host group (g itself for a threads or MPI
  /// group; the group that carries the host agreements of a GPU group), and g's index of the
  /// first of them (local_members).
  static std::pair<local_group*, std::size_t> local_members_of(any_group& g) {
    return std::visit(
        [](auto& group) {
          if constexpr (requires { group->host(); }) return local_members(group->host());
          else return local_members(*group);
        },
        g.impl);
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

/// @brief `host` as an any_group (nullptr stays nullptr).
inline std::shared_ptr<any_group> from_host(const std::shared_ptr<host_group>& host) {
  if (!host) return nullptr;
  return std::visit([](auto& g) { return std::make_shared<any_group>(any_group{g, {}}); }, host->impl);
}

/// @brief How the places of a mesh are: all CPU, all GPU, or both.
enum class mesh_devices { cpu, gpu, mixed };
inline mesh_devices devices_of(const mesh_state& m) {
  bool cpu = false, gpu = false;
  for (const auto& p : m.places) (p.kind() == place_kind::cuda ? gpu : cpu) = true;
  return gpu ? (cpu ? mesh_devices::mixed : mesh_devices::gpu) : mesh_devices::cpu;
}

#if defined(PDO_WITH_CUDA)
/// @brief The group of `members` over `host`, for a mesh with GPU places: NCCL on `comms`
/// (all GPU), else the host group with GPU buffers staged through host memory.
inline std::shared_ptr<any_group> device_group(const mesh_state& m, const std::vector<std::size_t>& members,
                                               std::shared_ptr<host_group> host, std::shared_ptr<nccl::detail::comm_set> comms) {
  if (!host) return nullptr;
  std::vector<std::shared_ptr<place_state>> places;
  for (auto i : members) places.push_back(m.places[i].is_local() ? m.places[i].state() : nullptr);
  if (comms) return std::make_shared<any_group>(any_group{std::make_shared<nccl::detail::group>(std::move(places), std::move(comms), std::move(host)), {}});
  return std::make_shared<any_group>(any_group{std::make_shared<staged_group>(std::move(places), std::move(host)), {}});
}
#endif

/// @brief Builds the communicators of the mesh behind `state` (once; for a mesh over several
/// processes, by every process, in make_mesh).
PDO_NOINLINE inline void build_comms(mesh_state& state) {
  const std::string name = describe_mesh(state);
  const std::size_t size = state.places.size(), ndim = state.extents.size();
  auto comms = std::make_shared<mesh_comms>();
  std::vector<std::size_t> all(size);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
  const mesh_devices devices = devices_of(state);
  // over several processes, making communicators blocks until every process takes part: this
  // runs right after make_mesh's agreement, a watched meeting of them all (meet_on_mesh)
  if (devices != mesh_devices::cpu && !cuda_enabled)
    throw communication_error("mesh: " + name + " has GPU places; their collectives need a build with PDO_WITH_CUDA");
#if defined(PDO_WITH_CUDA)
  using nccl_comms = std::shared_ptr<nccl::detail::comm_set>;
  const nccl_comms whole_nccl = devices == mesh_devices::gpu ? nccl::detail::init_mesh(state) : nullptr;
  auto wrap = [&](const std::vector<std::size_t>& members, nccl_comms nc, const std::string& label,
                  std::shared_ptr<any_group>* host_out = nullptr) {
    auto host = make_host_group(state, members, label);
    if (host_out != nullptr) *host_out = from_host(host);
    return devices == mesh_devices::cpu ? from_host(host) : device_group(state, members, std::move(host), std::move(nc));
  };
#else
  using nccl_comms = std::nullptr_t;
  const nccl_comms whole_nccl = nullptr;
  auto wrap = [&](const std::vector<std::size_t>& members, nccl_comms, const std::string& label,
                  std::shared_ptr<any_group>* host_out = nullptr) {
    auto host = from_host(make_host_group(state, members, label));
    if (host_out != nullptr) *host_out = host;
    return host;
  };
#endif
  comms->whole = wrap(all, whole_nccl, "the whole " + name, &comms->whole_host);
  if (comms->whole) comms->whole->label = "the whole " + name;
  if (comms->whole_host) comms->whole_host->label = "the whole " + name + " (host)";
  comms->lines.resize(ndim);
  comms->line_of.assign(ndim, std::vector<std::size_t>(size));
  comms->member_in_line.assign(ndim, std::vector<std::size_t>(size));
  for (std::size_t a = 0; a < ndim; ++a) {
    std::vector<std::vector<std::size_t>> line_members;
    for (std::size_t p = 0; p < size; ++p) {
      if (grid_coord(state.extents, p, a) != 0) continue;
      const auto members = grid_group(state.extents, a, p);
      for (std::size_t i = 0; i < members.size(); ++i) {
        comms->line_of[a][members[i]] = line_members.size();
        comms->member_in_line[a][members[i]] = i;
      }
      line_members.push_back(members);
    }
    std::vector<nccl_comms> line_nccl(line_members.size());
#if defined(PDO_WITH_CUDA)
    if (whole_nccl) {
      std::vector<std::size_t> coords(size);
      for (std::size_t p = 0; p < size; ++p) coords[p] = grid_coord(state.extents, p, a);
      line_nccl = nccl::detail::split_lines(state, *whole_nccl, comms->line_of[a], line_members.size(), coords, state.extents[a]);
    }
#endif
    const std::string label = "axis \"" + state.axes[a] + "\" of " + name;
    for (std::size_t g = 0; g < line_members.size(); ++g) {
      comms->lines[a].push_back(wrap(line_members[g], line_nccl[g], label));
      if (comms->lines[a].back()) comms->lines[a].back()->label = label;
    }
  }
  state.comms = std::move(comms);
}

/// @brief The communicators of the mesh behind `state`: those of a mesh over several
/// processes are built by make_mesh, by every process (pdo::mpi's meet_on_mesh); those of a
/// mesh in this process on first use. When building them failed, every later call throws its
/// error again: the processes did not all build them, so none may use them (nor try again,
/// which some would do alone).
PDO_NOINLINE inline mesh_comms& comms_of_state(mesh_state& state) {
  std::exception_ptr failed_here;
  std::call_once(state.comms_once, [&] {
    try {
      build_comms(state);
    } catch (...) {
      state.comms_failure = captured_error::current();
      failed_here = std::current_exception();
    }
  });
  if (failed_here) std::rethrow_exception(failed_here);
  if (state.comms_failure)
    state.comms_failure->rethrow_with_context(describe_mesh(state) + ": its communicators could not be built, so it has no collectives: ");
  return *state.comms;
}

/// @brief The communicators of mesh `m` (see comms_of_state).
template <class Mesh>
mesh_comms& comms_of(const Mesh& m) {
  return comms_of_state(*m.state());
}

}  // namespace detail

namespace detail {

/// @brief pdo::layout_error naming `op` unless place `index` of `m` exists and belongs to this
/// process (an endpoint is used by the place's own lane).
template <class Mesh>
void check_local_member(const Mesh& m, std::size_t index, std::string_view op) {
  m.check_place(index, op);
  if (!m.place(index).is_local())
    throw layout_error(m.describe() + ": " + std::string(op) + ": place " + std::to_string(index) + " (" + m.place(index).name() +
                       ") belongs to process " + std::to_string(m.place(index).process()) + ", not this one");
}

}  // namespace detail

/// @brief The communicator of a mesh's groups, whichever backend they run on.
using mesh_communicator = group_communicator<detail::any_group>;

static_assert(communicator<mesh_communicator>);

/// @brief Place `index`'s endpoint on the group of places along mesh axis `axis`.
/// pdo::layout_error when the mesh has no such axis or place, or the place is another process's.
template <class Mesh>
mesh_communicator communicator_along(const Mesh& m, std::size_t axis, std::size_t index) {
  m.check_axis(axis, "communicator_along");
  detail::check_local_member(m, index, "communicator_along");
  auto& comms = detail::comms_of(m);
  return {comms.lines[axis][comms.line_of[axis][index]], m.coord(index, axis)};
}

/// @brief Place `index`'s endpoint on the group of all places of the mesh; pdo::layout_error
/// when the mesh has no such place, or it is another process's.
template <class Mesh>
mesh_communicator communicator_of(const Mesh& m, std::size_t index) {
  detail::check_local_member(m, index, "communicator_of");
  return {detail::comms_of(m).whole, index};
}

/// @brief Place `index`'s endpoint on the host group of all places of the mesh (threads or
/// MPI, whatever the places' devices), for buffers in host memory: on a mesh of GPU places
/// communicator_of's group is NCCL, which takes device memory only.
template <class Mesh>
mesh_communicator host_communicator_of(const Mesh& m, std::size_t index) {
  detail::check_local_member(m, index, "host_communicator_of");
  return {detail::comms_of(m).whole_host, index};
}

}  // namespace pdo
