// pdo/place/mesh.hpp: an N-D grid of places with named axes, in one process or many.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/error.hpp>
#include <pdo/core/fixed_string.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/core/type_list.hpp>
#include <pdo/core/views.hpp>
#include <pdo/place/place_concept.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

namespace pdo {

namespace detail {

struct mesh_comms;  // the mesh's communicators, built by the comm layer (see comms_of_state)

}  // namespace detail

/// @brief How a mesh runs its collectives.
struct mesh_options {
  /// @brief How long a collective over places of several processes waits for the others
  /// before it gives up with pdo::collective_timeout (naming the ranks that did not arrive).
  /// Zero: $PDO_COLLECTIVE_TIMEOUT seconds if set, else 30 minutes.
  std::chrono::duration<double> collective_timeout{0};
};

namespace detail {

// Aligned to a cache line: with make_shared the reference counts of one mesh's state would
// otherwise share a line with the fields of the state made just before it, so that two host
// threads driving two meshes write each other's lines on every operation.
/// @brief What all copies of one mesh share.
struct alignas(64) mesh_state {
  mesh_options options;
  std::vector<std::string> axes;
  std::vector<std::size_t> extents;
  std::vector<any_place> places;      ///< row-major over the axes: the last axis varies fastest
  std::vector<std::size_t> local;     ///< indices of the places of this process
  /// @brief The states of the places of this process in one order whatever the mesh (by
  /// address), fixed by make_mesh: two host threads holding the same places take them in
  /// this order (see detail::place_hold).
  std::vector<place_state*> local_in_order;
  bool multiprocess = false;          ///< the places belong to more than one process
  /// @brief Of a mesh over several processes: the host thread of this process that issued its
  /// first operation, the only one that may issue them (none yet: the default id).
  mutable std::atomic<std::thread::id> driver{};
  std::once_flag comms_once;
  std::shared_ptr<mesh_comms> comms;
  /// @brief Why its communicators could not be built (a process that did not come in time,
  /// say), when that failed: every later use of the mesh's collectives is that error.
  std::optional<captured_error> comms_failure;
};

/// @brief What make_mesh does for a mesh over several processes, where they all meet: check
/// that they made the same mesh, then build its communicators (so that the order in which
/// they are built is the order of make_mesh, the same on every process, whichever threads
/// drive the meshes later). Set by the backend that makes places of other processes
/// (pdo::mpi::world_places), called by make_mesh.
using mesh_agreement = void (*)(mesh_state&, const std::string& description);
inline mesh_agreement& multiprocess_agreement() {
  static mesh_agreement check = nullptr;
  return check;
}


/// @brief "mesh(dp=2, tp=2)".
PDO_NOINLINE inline std::string describe_mesh(const mesh_state& m) {
  std::string text = "mesh(";
  for (std::size_t a = 0; a < m.axes.size(); ++a) text += (a ? ", " : "") + m.axes[a] + "=" + std::to_string(m.extents[a]);
  return text + ")";
}

/// @brief The coordinate along `axis` of place `index` of a grid of `extents` (row-major:
/// the last axis varies fastest); both in range.
inline std::size_t grid_coord(const std::vector<std::size_t>& extents, std::size_t index, std::size_t axis) {
  for (std::size_t a = extents.size(); a-- > axis + 1;) index /= extents[a];
  return index % extents[axis];
}

/// @brief The places of a grid of `extents` that differ from place `index` only along
/// `axis`, in coordinate order; both in range.
inline std::vector<std::size_t> grid_group(const std::vector<std::size_t>& extents, std::size_t axis, std::size_t index) {
  std::size_t stride = 1;  // between places that differ by one along `axis`
  for (std::size_t a = axis + 1; a < extents.size(); ++a) stride *= extents[a];
  const std::size_t first = index - grid_coord(extents, index, axis) * stride;
  std::vector<std::size_t> members(extents[axis]);
  for (std::size_t k = 0; k < members.size(); ++k) members[k] = first + k * stride;
  return members;
}

/// @brief Checks the places of a mesh being made, `name` (none twice, ordered by process),
/// and notes which belong to this process.
inline void take_places(mesh_state& state, const std::string& name) {
  for (const auto [i, p] : views::enumerate(state.places)) {
    const auto before = std::span(state.places).first(static_cast<std::size_t>(i));
    if (std::ranges::find(before, p) != before.end()) throw layout_error("make_mesh: place " + p.name() + " appears twice in " + name);
    if (i > 0 && p.process() < state.places[i - 1].process())
      throw layout_error("make_mesh: places must be ordered by process (" + p.name() + " comes after " + state.places[i - 1].name() + ")");
    if (p.is_local()) state.local.push_back(static_cast<std::size_t>(i));
  }
  for (std::size_t p : state.local) state.local_in_order.push_back(state.places[p].state().get());
  std::ranges::sort(state.local_in_order);
  // the same answer on every process (each takes part in the mesh's agreement and
  // communicators by it): a mesh whose places all live in one other process is not one
  state.multiprocess = !state.places.empty() && state.places.front().process() != state.places.back().process();
}

/// @brief The checks of make_mesh, and the meeting of the processes of a mesh over several of
/// them, once its state holds the axes, extents and places.
PDO_NOINLINE inline void finish_mesh(mesh_state& state) {
  const std::string name = describe_mesh(state);
  std::size_t product = 1;
  for (auto e : state.extents) {
    if (e != 0 && product > std::numeric_limits<std::size_t>::max() / e)
      throw layout_error("make_mesh: extents " + format_extents(state.extents) + " of " + name +
                         " hold more places than a size_t counts; make the product of the extents equal the number of places (" +
                         std::to_string(state.places.size()) + ")");
    product *= e;
  }
  if (state.places.empty() || product == 0)
    throw layout_error("make_mesh: " + name + " has no places (extents " + format_extents(state.extents) + ", " +
                       std::to_string(state.places.size()) + " places given); a mesh needs at least one place and every extent at least 1");
  if (product != state.places.size())
    throw layout_error("make_mesh: extents " + format_extents(state.extents) + " of " + name +
                       " hold " + std::to_string(product) + " places but " + std::to_string(state.places.size()) +
                       " were given; make the product of the extents equal the number of places");
  take_places(state, name);
  if (state.multiprocess) {
    if (multiprocess_agreement() == nullptr)
      throw layout_error("make_mesh: " + name + " has places of other processes but no backend joins them");
    // the places each process holds, in order: "rank 0: cpu, cpu; rank 1: cpu, cpu"
    std::string holdings;
    for (std::size_t i = 0; i < state.places.size(); ++i) {
      const auto& p = state.places[i];
      const bool first = i == 0 || state.places[i - 1].process() != p.process();
      holdings += std::string(first ? (i == 0 ? "" : "; ") + ("rank " + std::to_string(p.process()) + ": ") : ", ") +
                  (p.kind() == place_kind::cuda ? "gpu" : "cpu");
    }
    multiprocess_agreement()(state, name + " over places (" + holdings + ")");
  }
}

}  // namespace detail

namespace detail {
/// @brief The checks of a mesh's axis names, each with its message. Instantiated by the
/// mesh's constructor, not its class: a failed one leaves the class whole, so nothing more is
/// reported about its uses after it (clang would call every member of the class missing).
template <fixed_string... Axes>
struct check_mesh_axes {
  static constexpr bool distinct_names() {
    constexpr std::array<std::string_view, sizeof...(Axes)> names{Axes.view()...};
    for (std::size_t i = 0; i < names.size(); ++i)
      for (std::size_t j = i + 1; j < names.size(); ++j)
        if (names[i] == names[j]) return false;
    return true;
  }
  static_assert(sizeof...(Axes) >= 1, "pdo: mesh: a mesh needs at least one named axis, e.g. pdo::mesh<\"dp\">");
  static_assert(distinct_names(), "pdo: mesh: two axes have the same name; give every mesh axis its own name");
  static_assert(((Axes.view().size() > 0) && ...), "pdo: mesh: an axis name is empty; name every mesh axis, e.g. pdo::mesh<\"dp\">");
};

/// @brief The error of a mesh used after it was moved from (a mesh of `axes` axes).
[[noreturn]] PDO_NOINLINE inline void throw_moved_from_mesh(std::size_t axes) {
  throw error("mesh of " + std::to_string(axes) + (axes == 1 ? " axis" : " axes") +
              ": used after it was moved from; it has no places (copy a mesh to share it: copies are handles on the same places)");
}
}  // namespace detail

/// @brief An N-D grid of places whose axes are named by `Axes` ("dp", "tp", "pp").
/// Extents are run-time values; the axis names are part of the type, so layouts can
/// be checked against the mesh at compile time. Copies share one state.
template <fixed_string... Axes>
class mesh {
 public:
  /// @brief Marks this class as a mesh (see pdo::mesh_type).
  using mesh_tag = void;
  /// @brief The number of axes.
  static constexpr std::size_t ndim = sizeof...(Axes);
  /// @brief The axis names, in order.
  static constexpr std::array<std::string_view, ndim> axis_names{Axes.view()...};
  /// @brief The name of axis `I` as a pdo::fixed_string (to spell layouts of this mesh).
  template <std::size_t I>
  static constexpr auto axis_string = detail::nth_value<I, Axes...>();

  /// @brief The position of axis `name`, or ndim when the mesh has no such axis.
  static constexpr std::size_t axis_index(std::string_view name) {
    for (std::size_t i = 0; i < ndim; ++i)
      if (axis_names[i] == name) return i;
    return ndim;
  }
  /// @brief Whether the mesh has an axis named `name`.
  static constexpr bool has_axis(std::string_view name) { return axis_index(name) < ndim; }

  /// @brief A handle on `state`, shared with the other copies (pdo::make_mesh builds and checks it: use that).
  explicit mesh(std::shared_ptr<detail::mesh_state> state) : state_(std::move(state)) {
    static_assert(sizeof(detail::check_mesh_axes<Axes...>) != 0);
  }

  /// @brief The number of places, of every process: the product of the extents.
  [[nodiscard]] std::size_t size() const { return live().places.size(); }
  /// @brief The number of places along axis number `axis`; pdo::layout_error when axis >= ndim.
  [[nodiscard]] std::size_t extent(std::size_t axis) const {
    check_axis(axis, "extent");
    return live().extents[axis];
  }
  /// @brief The number of places along the axis named `axis`; pdo::layout_error if there is none.
  [[nodiscard]] std::size_t extent(std::string_view axis) const { return extent(checked_axis(axis)); }
  /// @brief The extents, one per axis, in axis order.
  [[nodiscard]] const std::vector<std::size_t>& extents() const { return live().extents; }
  /// @brief Place `index` (row-major over the axes); pdo::layout_error when index >= size().
  [[nodiscard]] const any_place& place(std::size_t index) const {
    if (index >= size())
      throw layout_error(describe() + " has " + std::to_string(size()) + " places; there is no place " + std::to_string(index));
    return live().places[index];
  }
  /// @brief Every place, row-major over the axes (the last axis varies fastest).
  [[nodiscard]] const std::vector<any_place>& places() const { return live().places; }
  /// @brief Indices of the places that belong to this process.
  [[nodiscard]] const std::vector<std::size_t>& local_places() const { return live().local; }
  /// @brief Whether the places belong to more than one process (the same answer on every
  /// process: a mesh whose places all live in one process is not, seen from any process).
  [[nodiscard]] bool is_multiprocess() const { return live().multiprocess; }

  /// @brief The coordinates of place `index` (row-major: the last axis varies fastest);
  /// pdo::layout_error when index >= size().
  [[nodiscard]] std::array<std::size_t, ndim> coords(std::size_t index) const {
    check_place(index, "coords");
    const auto& grid = live().extents;
    std::array<std::size_t, ndim> c{};
    for (std::size_t a = ndim; a-- > 0;) {
      c[a] = index % grid[a];
      index /= grid[a];
    }
    return c;
  }
  /// @brief The coordinate of place `index` along axis number `axis` (both checked, as by coords() and extent()).
  [[nodiscard]] std::size_t coord(std::size_t index, std::size_t axis) const {
    check_axis(axis, "coord");
    check_place(index, "coord");
    return detail::grid_coord(live().extents, index, axis);
  }
  /// @brief The index of the place at coordinates `c` (row-major; the inverse of coords());
  /// pdo::layout_error when a coordinate is not below its axis's extent.
  [[nodiscard]] std::size_t index(const std::array<std::size_t, ndim>& c) const {
    const auto& grid = live().extents;
    std::size_t i = 0;
    for (std::size_t a = 0; a < ndim; ++a) {
      if (c[a] >= grid[a])
        throw layout_error(describe() + ": index: coordinate " + std::to_string(c[a]) + " along \"" + std::string(axis_names[a]) +
                           "\" is outside its extent " + std::to_string(grid[a]));
      i = i * grid[a] + c[a];
    }
    return i;
  }

  /// @brief The places that differ from place `index` only along `axis`, in
  /// coordinate order: the group a collective along that axis runs over.
  [[nodiscard]] std::vector<std::size_t> group(std::size_t axis, std::size_t index) const {
    check_axis(axis, "group");
    check_place(index, "group");
    return detail::grid_group(live().extents, axis, index);
  }


  /// @brief "mesh(dp=2, tp=2)".
  [[nodiscard]] std::string describe() const { return detail::describe_mesh(live()); }

  /// @brief pdo::layout_error naming `op` and this mesh unless `index` is one of its places.
  void check_place(std::size_t index, std::string_view op) const {
    if (index >= size())
      throw layout_error(describe() + ": " + std::string(op) + ": there is no place " + std::to_string(index) + " (it has " +
                         std::to_string(size()) + ")");
  }
  /// @brief pdo::layout_error naming `op` and this mesh unless `axis` is one of its axis numbers.
  void check_axis(std::size_t axis, std::string_view op) const {
    if (axis >= ndim)
      throw layout_error(describe() + ": " + std::string(op) + ": there is no axis number " + std::to_string(axis) + " (it has " +
                         std::to_string(ndim) + (ndim == 1 ? " axis)" : " axes)"));
  }

  /// @brief The state all copies of this mesh share (places, extents, communicators).
  [[nodiscard]] const std::shared_ptr<detail::mesh_state>& state() const { return state_; }
  friend bool operator==(const mesh& a, const mesh& b) { return a.state_ == b.state_; }

 private:
  /// The state, or a pdo::error for a mesh that was moved from (it has none).
  const detail::mesh_state& live() const {
    if (!state_) [[unlikely]]
      detail::throw_moved_from_mesh(ndim);
    return *state_;
  }
  std::size_t checked_axis(std::string_view name) const {
    const std::size_t a = axis_index(name);
    if (a == ndim) throw layout_error(describe() + " has no axis \"" + std::string(name) + "\"");
    return a;
  }
  std::shared_ptr<detail::mesh_state> state_;
};

// Found by mesh's member, not by a partial specialization on mesh<Axes...>: nvcc's
// front end does not match partial specializations on string template arguments.
template <class M>
inline constexpr bool is_mesh_v = requires { typename M::mesh_tag; };

/// @brief A mesh type: pdo::mesh<"a", ...>.
template <class M>
concept mesh_type = is_mesh_v<M>;

namespace detail {

/// @brief make_mesh's work, once the extents are a vector of one per axis.
template <fixed_string... Axes, class Places>
mesh<Axes...> make_mesh_with(const Places& places, std::vector<std::size_t> extents, const mesh_options& options) {
  auto state = std::make_shared<mesh_state>();
  state->options = options;
  state->axes = {std::string(Axes.view())...};
  state->extents = std::move(extents);
  for (const auto& p : places) state->places.emplace_back(p);
  finish_mesh(*state);
  return mesh<Axes...>(state);
}

}  // namespace detail

/// @brief Lays `places` out as a grid with the given extents, one per axis:
/// `make_mesh<"dp", "tp">(places, {2, 2})`. The product of the extents must be the
/// number of places. A mesh over places of several processes (pdo::mpi::world_places)
/// must be made by every process, with the same arguments, in the same order: the
/// processes check that they agree (axes, extents, places per process) and throw
/// pdo::mismatch_error on every process, naming each one's mesh, when they do not; then they
/// build its communicators. So make_mesh of such a mesh waits for every process, up to the
/// mesh's collective timeout (then pdo::collective_timeout), one host thread of a process at a
/// time; the threads that drive the meshes afterwards may do so at the same time.
template <fixed_string... Axes, std::ranges::input_range Places, std::size_t N>
  requires place<std::ranges::range_value_t<Places>>
mesh<Axes...> make_mesh(const Places& places, const std::size_t (&extents)[N], const mesh_options& options = {}) {
  static_assert(N == sizeof...(Axes), "pdo: make_mesh: give exactly one extent per mesh axis");
  return detail::make_mesh_with<Axes...>(places, std::vector<std::size_t>(extents, extents + N), options);
}

/// @brief make_mesh with extents computed at run time, in a container of integers (a
/// std::array, a std::vector): one per axis, checked at compile time when the container's
/// size is (a std::array), else a pdo::layout_error; a negative extent is a pdo::layout_error.
template <fixed_string... Axes, std::ranges::input_range Places, std::ranges::sized_range Extents>
  requires place<std::ranges::range_value_t<Places>> && std::integral<std::ranges::range_value_t<Extents>>
mesh<Axes...> make_mesh(const Places& places, const Extents& extents, const mesh_options& options = {}) {
  if constexpr (requires { std::tuple_size<Extents>::value; })
    static_assert(std::tuple_size_v<Extents> == sizeof...(Axes), "pdo: make_mesh: give exactly one extent per mesh axis");
  std::vector<std::size_t> sizes;
  for (const auto e : extents) {
    if constexpr (std::is_signed_v<std::remove_cvref_t<decltype(e)>>)
      if (e < 0) throw layout_error("make_mesh: extent " + std::to_string(e) + " is negative: give one extent >= 1 per mesh axis");
    sizes.push_back(static_cast<std::size_t>(e));
  }
  if (sizes.size() != sizeof...(Axes)) {
    std::string axes;
    ((axes += (axes.empty() ? "\"" : ", \"") + std::string(Axes.view()) + "\""), ...);
    throw layout_error("make_mesh: " + std::to_string(sizes.size()) + (sizes.size() == 1 ? " extent " : " extents ") +
                       detail::format_extents(sizes) + " for a mesh of " + std::to_string(sizeof...(Axes)) + (sizeof...(Axes) == 1 ? " axis (" : " axes (") + axes +
                       "): give exactly one extent per mesh axis");
  }
  return detail::make_mesh_with<Axes...>(places, std::move(sizes), options);
}

/// @brief Rejects a mesh of several axes made without their extents.
template <fixed_string First, fixed_string Second, fixed_string... Rest, std::ranges::input_range Places>
  requires place<std::ranges::range_value_t<Places>>
mesh<First, Second, Rest...> make_mesh(const Places& places, const mesh_options& options = {}) {
  static_assert(detail::always_false<Places>, "pdo: make_mesh: a mesh of several axes needs their extents, one per axis, whose "
                                              "product is the number of places: pdo::make_mesh<\"dp\", \"tp\">(places, {2, 2})");
  return detail::make_mesh_with<First, Second, Rest...>(places, {}, options);
}

/// @brief A one-axis mesh over all of `places`.
template <fixed_string Axis, std::ranges::input_range Places>
  requires place<std::ranges::range_value_t<Places>>
mesh<Axis> make_mesh(const Places& places, const mesh_options& options = {}) {
  const std::size_t n = static_cast<std::size_t>(std::ranges::distance(places));
  return make_mesh<Axis>(places, {n}, options);
}

}  // namespace pdo
