// pdo/tensor/dtensor.hpp: pdo::dtensor, a tensor laid out over a mesh: global shape + local shards.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/error.hpp>
#include <pdo/core/fixed_string.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/layout/layout_check.hpp>
#include <pdo/layout/layout_value.hpp>
#include <pdo/place/mesh.hpp>
#include <pdo/tensor/tensor.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief The extents of place `p`'s shard of a tensor of `global` shape laid out as `v`.
template <class Mesh, std::size_t Rank>
shape_t<Rank> shard_shape(const Mesh& m, const layout_value& v, const shape_t<Rank>& global, std::size_t p) {
  shape_t<Rank> s = global;
  for (std::size_t d = 0; d < Rank; ++d)
    if (!v.dim_axis[d].empty()) {
      const std::size_t a = Mesh::axis_index(v.dim_axis[d]);
      s[d] = chunk_size(global[d], m.extent(a), m.coord(p, a));
    }
  return s;
}

/// @brief Where place `p`'s shard starts in the global tensor.
template <class Mesh, std::size_t Rank>
shape_t<Rank> shard_offset(const Mesh& m, const layout_value& v, const shape_t<Rank>& global, std::size_t p) {
  shape_t<Rank> o{};
  for (std::size_t d = 0; d < Rank; ++d)
    if (!v.dim_axis[d].empty()) {
      const std::size_t a = Mesh::axis_index(v.dim_axis[d]);
      o[d] = chunk_offset(global[d], m.extent(a), m.coord(p, a));
    }
  return o;
}

/// @brief True when place `p` holds the value of every partial axis of `v` (coordinate 0);
/// the other places hold zeros after a distribute.
template <class Mesh>
bool holds_partial_value(const Mesh& m, const layout_value& v, std::size_t p) {
  for (std::size_t i = 0; i < v.npartial; ++i)
    if (m.coord(p, Mesh::axis_index(v.partial[i])) != 0) return false;
  return true;
}

/// @brief "f32[10, 6]", followed by the layout when there is one.
PDO_NOINLINE inline std::string describe_block(std::string_view dtype, std::span<const std::size_t> extents, const layout_value* layout) {
  std::string text = std::string(dtype) + format_extent_list(extents);
  if (layout != nullptr) text += to_string(*layout);
  return text;
}

/// @brief "f32[10, 6]{split<dp>, replicate} on mesh(dp=2, tp=2)": a dtensor's description (one
/// function for every layout of a mesh, element type and rank).
template <class T, std::size_t Rank, class Mesh>
PDO_NOINLINE std::string describe_dtensor(const Mesh& m, const layout_value& v, const shape_t<Rank>& global) {
  return describe_block(dtype_name<T>(), global, &v) + " on " + m.describe();
}

/// @brief The error of a dtensor used after it was moved from (`what`: its type, as
/// describe_block writes it).
[[noreturn]] PDO_NOINLINE inline void throw_moved_from(const std::string& what) {
  throw error("dtensor " + what + ": used after it was moved from; it holds no mesh and no shards (std::move of a dtensor, or "
              "pdo::async_result::get() on an rvalue, empties it)");
}

/// @brief The checks of a dtensor's constructor: one shard for each place of this process,
/// each of the shape the layout gives its place (else pdo::shape_error).
template <class T, std::size_t Rank, class Mesh>
PDO_NOINLINE void check_shards(const Mesh& m, const layout_value& v, const shape_t<Rank>& global, const std::vector<tensor<T, Rank>>& shards) {
  checked_volume(global, "dtensor", sizeof(T));
  const auto& local = m.local_places();
  if (shards.size() != local.size())
    throw shape_error("dtensor: " + std::to_string(shards.size()) + " shards given for " + std::to_string(local.size()) +
                      " local places of " + m.describe());
  for (std::size_t k = 0; k < local.size(); ++k) {
    const auto want = shard_shape(m, v, global, local[k]);
    if (shards[k].shape() != want)
      throw shape_error("dtensor: " + describe_dtensor<T>(m, v, global) + ": the shard of place " + m.place(local[k]).name() + " is " +
                        pdo::describe(shards[k]) + " but the layout gives it " + format_extents(want));
  }
}

/// @brief The position of place `p` among the places of `m` in this process (else
/// pdo::layout_error).
template <class Mesh>
PDO_NOINLINE std::size_t local_ordinal(const Mesh& m, std::size_t p) {
  const auto& local = m.local_places();
  for (std::size_t k = 0; k < local.size(); ++k)
    if (local[k] == p) return k;
  throw layout_error("dtensor: place " + std::to_string(p) + " of " + m.describe() + " does not belong to this process");
}

/// @brief The queued tasks a host thread waits for before it touches a dtensor's shards:
/// those that write them (before copying them), or all that use them (before freeing or
/// replacing them).
enum class shard_users { writers, all };

/// @brief Waits, on a host thread, until no queued task of the kind given writes, or uses,
/// the blocks whose storage_keys are given; with `writers`, gives the failure of a writer
/// that failed while its failure stays with what it wrote (an evaluation's result: its values
/// were never computed), nothing otherwise. Set by the engine when it is made
/// (pdo/exec/engine.hpp); before that no task uses any storage.
inline std::atomic<std::optional<captured_error> (*)(std::span<const void* const>, shard_users)> wait_for_users{nullptr};

/// @brief Waits until no queued task of the kind given uses any of `shards` (wait_for_users),
/// handing their keys to the engine a few dozen at a time; with `writers`, the failure of one
/// that wrote them (of several, the first that is not only an echo of another place's abort).
template <class Shards>
std::optional<captured_error> wait_for_shard_users(const Shards& shards, shard_users which) {
  const auto wait = wait_for_users.load(std::memory_order_acquire);
  if (wait == nullptr) return {};
  constexpr std::size_t batch = 32;
  std::array<const void*, batch> keys{};
  std::size_t n = 0;
  std::optional<captured_error> failure;
  const auto flush = [&] {
    auto f = wait(std::span<const void* const>(keys.data(), n), which);
    if (f && (!failure || tells_more_than(f->kind, failure->kind))) failure = std::move(f);
    n = 0;
  };
  for (const auto& s : shards) {
    keys[n++] = storage_key(s);
    if (n == batch) flush();
  }
  if (n != 0) flush();
  return failure;
}

}  // namespace detail

/// @brief A tensor of global shape `shape()` laid out over `Mesh` as `Layout`; this
/// process holds the shards of its own places (`local_shards()`, in the order of
/// `mesh().local_places()`), each in its place's memory.
/// @tparam Mesh a pdo::mesh type; @tparam Layout a layout_spec valid on it for rank `Rank`
template <element T, std::size_t Rank, mesh_type Mesh, layout_spec Layout>
class dtensor {
  // the layout's checks, each with its message (no second error when one fails)
  static_assert(sizeof(detail::check_layout<"dtensor", Layout, Mesh, Rank>) != 0);

 public:
  /// @brief Element type of the shards.
  using value_type = T;
  /// @brief Type of the mesh the tensor is laid out over.
  using mesh_type = Mesh;
  /// @brief The layout_spec type: how each dim is split over the mesh axes (or replicated, or partial).
  using layout_type = Layout;
  /// @brief Number of dims.
  static constexpr std::size_t rank = Rank;
  /// @brief `Layout` as a value the planner computes with.
  static constexpr detail::layout_value layout_value = detail::value_of<Layout>();

  /// @brief Takes the local shards as they are; each must have the shape the layout gives
  /// its place (else pdo::shape_error naming the place and both shapes).
  dtensor(Mesh m, const shape_t<Rank>& global, std::vector<tensor<T, Rank>> shards)
      : mesh_(std::move(m)), shape_(global), shards_(std::move(shards)) {
    detail::check_shards(mesh_, layout_value, shape_, shards_);
  }
  /// @brief A copy: the same mesh, and a deep copy of each shard on its place, taken once
  /// the work queued that writes `other` (an eval_async not yet waited for) has written it.
  dtensor(const dtensor& other) : mesh_(other.mesh_), shape_(other.shape_), shards_(copied_shards(other)) {}
  /// @brief Takes `other`'s mesh and shards, leaving it moved from, once the work queued that
  /// reads or writes them has ended: an eval_async not yet waited for that refers to `other`
  /// sees it as it was.
  dtensor(dtensor&& other) noexcept
      : mesh_((detail::wait_for_shard_users(other.shards_, detail::shard_users::all), std::move(other.mesh_))),
        shape_(other.shape_),
        shards_(std::move(other.shards_)) {}
  /// @brief Copy or move assignment (by value, then swap). Work queued that reads or writes
  /// this dtensor (an eval_async not yet waited for) ends first: it sees the dtensor as it
  /// was when it was queued.
  dtensor& operator=(dtensor other) noexcept {
    detail::wait_for_shard_users(shards_, detail::shard_users::all);
    std::vector<tensor<T, Rank>> old;  // freed here, not by other's destructor, which would wait again
    old.swap(shards_);
    shards_.swap(other.shards_);
    std::swap(mesh_, other.mesh_);
    std::swap(shape_, other.shape_);
    return *this;
  }
  /// @brief Frees the shards once the work queued that reads or writes them has ended (an
  /// eval_async of an expression of this dtensor, not yet waited for).
  ~dtensor() { detail::wait_for_shard_users(shards_, detail::shard_users::all); }

  /// @brief The mesh the tensor is laid out over (a pdo::error for a dtensor that was moved
  /// from: every operation on one says so).
  [[nodiscard]] const Mesh& mesh() const { return live_mesh(); }
  /// @brief The global extents (not those of a shard).
  [[nodiscard]] const shape_t<Rank>& shape() const { return shape_; }
  /// @brief The global number of elements.
  [[nodiscard]] std::size_t size() const { return detail::volume(shape_); }
  /// @brief This process's shards, in the order of `mesh().local_places()`.
  [[nodiscard]] const std::vector<tensor<T, Rank>>& local_shards() const { return shards_; }
  /// @brief This process's shards, in the order of `mesh().local_places()`, writable (keep their shapes).
  [[nodiscard]] std::vector<tensor<T, Rank>>& local_shards() { return shards_; }

  /// @brief The shard of place `p` (a place of this process; else pdo::layout_error).
  [[nodiscard]] const tensor<T, Rank>& shard(std::size_t p) const { return shards_[local_ordinal(p)]; }
  /// @brief The shard of place `p`, writable (a place of this process; else pdo::layout_error).
  [[nodiscard]] tensor<T, Rank>& shard(std::size_t p) { return shards_[local_ordinal(p)]; }

  /// @brief The shape of place `p`'s shard (any place of the mesh).
  [[nodiscard]] shape_t<Rank> local_shape(std::size_t p) const {
    live_mesh().check_place(p, "dtensor::local_shape");
    return detail::shard_shape(mesh_, layout_value, shape_, p);
  }
  /// @brief Where place `p`'s shard starts in the global tensor.
  [[nodiscard]] shape_t<Rank> local_offset(std::size_t p) const {
    live_mesh().check_place(p, "dtensor::local_offset");
    return detail::shard_offset(mesh_, layout_value, shape_, p);
  }

  /// @brief "f32[10, 6]{split<dp>, replicate} on mesh(dp=2, tp=2)".
  [[nodiscard]] std::string describe() const {
    return moved_from() ? type_text() + " (moved from)" : detail::describe_dtensor<T>(mesh_, layout_value, shape_);
  }

 private:
  std::size_t local_ordinal(std::size_t p) const { return detail::local_ordinal(live_mesh(), p); }
  /// `other`'s shards, once the work queued that writes them has ended.
  /// (a failure, a place's memory full, say, is an error of the copy, naming the dtensor)
  static std::vector<tensor<T, Rank>> copied_shards(const dtensor& other) {
    // the result of an evaluation that failed holds no values: copying it is that failure
    if (const auto failure = detail::wait_for_shard_users(other.shards_, detail::shard_users::writers))
      failure->rethrow_with_context("copy of dtensor " + other.describe() + ": its values were not computed: ");
    try {
      return other.shards_;
    } catch (const error&) {
      detail::captured_error::current().rethrow_with_context("copy of dtensor " + other.describe() + ": ");
    }
  }
  /// A moved-from dtensor has no mesh state (and no shards).
  bool moved_from() const { return !mesh_.state(); }
  /// "f32[7, 5]{split<x>, replicate}": the element type, extents and layout.
  std::string type_text() const { return detail::describe_block(detail::dtype_name<T>(), shape_, &layout_value); }
  const Mesh& live_mesh() const {
    if (moved_from()) [[unlikely]]
      detail::throw_moved_from(type_text());
    return mesh_;
  }

  Mesh mesh_;
  shape_t<Rank> shape_;
  std::vector<tensor<T, Rank>> shards_;
};

template <class T>
inline constexpr bool is_dtensor_v = false;
template <class T, std::size_t Rank, class Mesh, class Layout>
inline constexpr bool is_dtensor_v<dtensor<T, Rank, Mesh, Layout>> = true;

/// @brief A pdo::dtensor type.
template <class T>
concept distributed_tensor = is_dtensor_v<std::remove_cvref_t<T>>;

namespace detail {
/// @brief The replicated dtensor of element type `T` and rank `Rank` on `Mesh`: the stand-in
/// result of an operation whose error was given (see unformed_result).
template <class T, std::size_t Rank, class Mesh>
using replicated_dtensor_t = dtensor<T, Rank, Mesh, replicated_layout_t<Rank>>;
}  // namespace detail

}  // namespace pdo
