// pdo/exec/run_plan.hpp: evaluation runs the plan. The steps of plan_of<E>() (kernels,
// redistributions of operands, combines) are executed in the plan's order, each by the
// code its step names: a local evaluation runs them one after the other on the calling
// thread; a distributed one submits each step to the engine as a task on every place (a
// kernel on the compute lane, a collective on the communication lane), ordered by the
// buffers it reads and writes.
#pragma once

#include <pdo/exec/run_on_places.hpp>
#include <pdo/plan/plan.hpp>
#include <pdo/tensor/redistribute.hpp>

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo::detail {

/// @brief Where a local expression runs: the calling thread, on the cores of its place (or
/// its GPU). With `host_loops`, on the calling thread as plain host loops, the result in host
/// memory: for operands in host memory while the calling thread drives a GPU.
struct local_context {
  static constexpr bool distributed = false;
  local_context() = default;
  explicit local_context(bool host_loops) : on_host(host_loops) {
    if (host_loops) system = place_system{};
  }
  bool on_host = false;
  place_system system = current_place_system();

  template <std::size_t Rank>
  shape_t<Rank> local_shape(const layout_value&, const shape_t<Rank>& global) const {
    return global;
  }
  template <std::size_t Rank>
  shape_t<Rank> local_offset(const layout_value&, const shape_t<Rank>&) const {
    return {};
  }
  template <class T, std::size_t Rank>
  tensor<T, Rank> allocate(const shape_t<Rank>& shape) const {
    return on_host ? tensor<T, Rank>::on_host(shape) : tensor<T, Rank>(shape, uninitialized);
  }
  /// @brief The place of this context in the record of executed steps.
  [[nodiscard]] std::size_t recorded_place() const { return 0; }
};

/// @brief Where a distributed expression runs on one place: place `p` of mesh `m`, on the
/// lane of the task that runs the step (each step's kernel takes its system there: steps of
/// one place may run at once on different lanes, so the context holds nothing they write).
template <class Mesh>
struct mesh_context {
  static constexpr bool distributed = true;
  mesh_context() = default;
  mesh_context(const Mesh& mesh, std::size_t place) : m(&mesh), p(place) {}
  const Mesh* m = nullptr;
  std::size_t p = 0;

  template <std::size_t Rank>
  shape_t<Rank> local_shape(const layout_value& v, const shape_t<Rank>& global) const {
    return shard_shape(*m, v, global, p);
  }
  template <std::size_t Rank>
  shape_t<Rank> local_offset(const layout_value& v, const shape_t<Rank>& global) const {
    return shard_offset(*m, v, global, p);
  }
  template <class T, std::size_t Rank>
  tensor<T, Rank> allocate(const shape_t<Rank>& shape) const {
    return tensor<T, Rank>(shape, m->place(p), uninitialized);
  }
  [[nodiscard]] std::size_t recorded_place() const { return p; }
};

/// @brief The index in `Plan` of the kernel step of node `N`.
template <const expression_plan& Plan, std::size_t N>
constexpr std::size_t kernel_step_of() {
  for (std::size_t i = 0; i < Plan.size; ++i)
    if (Plan.steps[i].kind == plan_step_kind::kernel && Plan.steps[i].node == N) return i;
  return Plan.size;
}

template <class Run, std::size_t N>
class kernel_context;

/// @brief Adds to `out` the addresses of `n` slots from `slots`, then `result`.
PDO_NOINLINE inline void add_addresses(std::vector<const void*>& out, const std::shared_ptr<void>* slots, std::size_t n, const void* result) {
  for (std::size_t i = 0; i < n; ++i) out.push_back(slots + i);
  out.push_back(result);
}

/// @brief One place's run of the plan of `Root`: the expression, where it runs, and a slot
/// per node number for the block a step leaves for a later one (an op's result, or an
/// operand brought to the layout its op needs). The root's kernel writes the result.
template <class Root, class Place>
class plan_run {
 public:
  using root_type = Root;
  using place_type = Place;
  using value_type = typename Root::value_type;
  static constexpr std::size_t rank = Root::rank;
  static constexpr expression_plan plan = plan_of<Root>();
  static constexpr std::size_t nodes = numbered_nodes<Root>();
  static constexpr std::size_t root_number = nodes - 1;

  plan_run() = default;
  plan_run(const Root& root, Place place, tensor<value_type, rank>& result) : root_(&root), place_(std::move(place)), result_(&result) {}
  /// @brief Makes a run made empty the run of `root` on `place`, into `result`.
  void bind(const Root& root, Place place, tensor<value_type, rank>& result) {
    root_ = &root;
    place_ = std::move(place);
    result_ = &result;
  }

  [[nodiscard]] const Root& root() const { return *root_; }
  [[nodiscard]] Place& place() { return place_; }

  /// @brief Whether operand `I` of `Node` is read from a slot (an op's result, or an operand
  /// that was redistributed), not from where a leaf keeps it.
  template <class Node, std::size_t I>
  static constexpr bool in_slot = [] {
    using child_t = std::tuple_element_t<I, typename Node::children_type>;
    if constexpr (fuses_child<Node, I>) return false;
    else if constexpr (child_t::is_leaf) return Place::distributed && operand_plan_v<Node, I>.size > 0;
    else return true;
  }();

  /// @brief The block in the slot of node `N`.
  template <std::size_t N>
  [[nodiscard]] auto& slot() const {
    using node_t = node_numbered_t<N, Root>;
    return *static_cast<tensor<typename node_t::value_type, node_t::rank>*>(slots_[N].get());
  }

  /// @brief Runs step `S` of the plan on this place.
  template <std::size_t S>
  void run_step() {
    constexpr plan_step step = plan.steps[S];
    if constexpr (step.kind == plan_step_kind::kernel) {
      if constexpr (step.fused) {
        // runs inside the kernel of the op that reads it (kernel_context::fused), which records it
      } else {
        run_kernel<step.node, S>();
      }
    } else if constexpr (step.kind == plan_step_kind::redistribute) {
      move_operand<S>();
    } else {
      combine<S>();
    }
  }

  /// @brief Runs every step in the plan's order (a local evaluation); an expression that is
  /// a leaf is copied.
  void run_all() {
    if constexpr (Root::is_leaf) {
      copy_leaf();
    } else {
      [&]<std::size_t... S>(std::index_sequence<S...>) { (run_step<S>(), ...); }(std::make_index_sequence<plan.size>{});
    }
  }

  /// @brief The result is the leaf the expression is.
  void copy_leaf() {
    const auto& shard = root_->shard(place_);
    copy_bytes(result_->where(), result_->data(), shard.where(), shard.data(), result_->bytes());
  }

  /// @brief What step `S` reads and writes on this place, for the engine: the slots (by
  /// address), the shards of dtensor leaves (by data), the result's storage.
  template <std::size_t S>
  [[nodiscard]] access uses() const {
    constexpr plan_step step = plan.steps[S];
    access a;
    if constexpr (step.kind == plan_step_kind::kernel) {
      add_kernel_reads<step.node>(a);
      a.writes.push_back(storage_of<step.node>());
    } else if constexpr (step.kind == plan_step_kind::redistribute) {
      constexpr std::size_t c = step.operand_node;
      if constexpr (first_move<S>() && node_numbered_t<c, Root>::is_leaf) add_leaf_read(node_numbered<c>(*root_), a);
      else a.reads.push_back(&slots_[c]);
      a.writes.push_back(&slots_[c]);
    } else {
      a.reads.push_back(storage_of<step.node>());
      a.writes.push_back(storage_of<step.node>());
    }
    return a;
  }

  /// @brief Adds to `out` the buffers this run's tasks write: the slots and the result's
  /// storage (for the engine to forget when they are freed).
  void add_written(std::vector<const void*>& out) const {
    add_addresses(out, slots_.data(), nodes, storage_key(*result_));
  }

  /// @brief What a task that copies a leaf expression reads and writes.
  [[nodiscard]] access copy_uses() const {
    access a;
    add_leaf_read(*root_, a);
    a.writes.push_back(storage_key(*result_));
    return a;
  }

 private:
  template <class, std::size_t>
  friend class kernel_context;

  /// @brief The system for kernels on this place, on the calling lane (a distributed run's
  /// steps run on several lanes, some at once: each kernel asks for its own).
  static place_system system_for(const Place& place) {
    if constexpr (Place::distributed) return current_place_system();
    else return place.system;
  }

  /// @brief Whether step `S` is the first of the redistribution of its operand.
  template <std::size_t S>
  static constexpr bool first_move() {
    if constexpr (S == 0) {
      return true;
    } else {
      constexpr plan_step before = plan.steps[S - 1], step = plan.steps[S];
      return !(before.kind == plan_step_kind::redistribute && before.node == step.node && before.operand == step.operand);
    }
  }

  /// @brief Node `N`'s block: in its slot, or the result for the root.
  template <std::size_t N>
  [[nodiscard]] auto& block_of() const {
    if constexpr (N == root_number) return *result_;
    else return slot<N>();
  }

  /// @brief Where node `N`'s block is kept: the slot, or the result's storage for the root.
  template <std::size_t N>
  [[nodiscard]] const void* storage_of() const {
    if constexpr (N == root_number) return storage_key(*result_);
    else return &slots_[N];
  }

  template <class Leaf>
  void add_leaf_read(const Leaf& leaf, access& a) const {
    if constexpr (Leaf::distributed) a.reads.push_back(storage_key(leaf.shard(place_)));
  }

  /// @brief The blocks the kernel of node `N` reads: its operands', and those of the
  /// operands fused into it.
  template <std::size_t N>
  void add_kernel_reads(access& a) const {
    using node_t = node_numbered_t<N, Root>;
    const node_t& node = node_numbered<N>(*root_);
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (
          [&] {
            using child_t = std::tuple_element_t<I, typename node_t::children_type>;
            constexpr std::size_t c = child_number<node_t, N, I>();
            if constexpr (child_t::is_scalar) {
            } else if constexpr (fuses_child<node_t, I>) {
              add_kernel_reads<c>(a);
            } else if constexpr (in_slot<node_t, I>) {
              a.reads.push_back(&slots_[c]);
            } else {
              add_leaf_read(detail::operand<I>(node.children()), a);
            }
          }(),
          ...);
    }(std::make_index_sequence<std::tuple_size_v<typename node_t::children_type>>{});
  }

  /// @brief The kernel of node `N` (step `S`): into a new block in its slot (the result, for
  /// the root); the blocks of its subtree are released once it has read them.
  template <std::size_t N, std::size_t S>
  void run_kernel() {
    using node_t = node_numbered_t<N, Root>;
    using T = typename node_t::value_type;
    const node_t& node = node_numbered<N>(*root_);
    checked_volume(node.shape(), node_t::name, sizeof(T));
    kernel_context<plan_run, N> ctx(*this);
    if constexpr (N == root_number) {
      node.kernel(ctx, *result_);
    } else {
      auto out = std::make_shared<tensor<T, node_t::rank>>(place_.template allocate<T>(place_.local_shape(node_t::rule.out, node.shape())));
      node.kernel(ctx, *out);
      slots_[N] = std::move(out);
    }
    for (std::size_t i = N + 1 - numbered_nodes<node_t>(); i < N; ++i) slots_[i].reset();
    if (step_recorder::on()) {
      plan_step ran{plan_step_kind::kernel, node_t::name, N};
      ran.layout = node_t::rule.out;
      step_recorder::record(place_.recorded_place(), S, ran);
    }
  }

  /// @brief Step `S`: one step of the redistribution of an operand, from its slot (or, for
  /// the first step of a leaf's, from the leaf's shard) into its slot.
  template <std::size_t S>
  void move_operand() {
    constexpr plan_step step = plan.steps[S];
    constexpr std::size_t c = step.operand_node;
    using child_t = node_numbered_t<c, Root>;
    using T = typename child_t::value_type;
    const child_t& child = node_numbered<c>(*root_);
    // a leaf's shard is read where it is; a slot's block is handed over to the step
    tensor<T, child_t::rank> block;
    if constexpr (first_move<S>() && child_t::is_leaf)
      block = apply_step<step.move.kind>(step.move, *place_.m, child.shape(), place_.p, child.shard(place_));
    else
      block = apply_step<step.move.kind>(step.move, *place_.m, child.shape(), place_.p, std::move(slot<c>()));
    slots_[c] = std::make_shared<tensor<T, child_t::rank>>(std::move(block));
    if (step_recorder::on()) {
      plan_step ran{plan_step_kind::redistribute, node_numbered_t<step.node, Root>::name, step.node, step.operand, c};
      ran.move = step.move;
      step_recorder::record(place_.recorded_place(), S, ran);
    }
  }

  /// @brief Step `S`: the all_reduce(max) of node's block over the step's axis.
  template <std::size_t S>
  void combine() {
    constexpr plan_step step = plan.steps[S];
    using node_t = node_numbered_t<step.node, Root>;
    auto& out = block_of<step.node>();
    using mesh_t = std::remove_cvref_t<decltype(*place_.m)>;
    constexpr std::size_t axis = mesh_t::axis_index(step.move.axis);
    count_planned(step_kind::all_reduce, place_.m->coord(place_.p, axis) == 0);
    communicator_along(*place_.m, axis, place_.p).all_reduce(out.span(), reduce_op::max);
    if (step_recorder::on()) {
      plan_step ran{plan_step_kind::combine_max, node_t::name, step.node};
      ran.move.kind = step_kind::all_reduce;
      ran.move.axis = step.move.axis;
      ran.move.before = ran.move.after = node_t::rule.out;
      step_recorder::record(place_.recorded_place(), S, ran);
    }
  }

  const Root* root_ = nullptr;
  Place place_;
  tensor<value_type, rank>* result_ = nullptr;
  std::array<std::shared_ptr<void>, nodes> slots_{};
};

/// @brief What the kernel of node `N` sees of a plan run: the system it runs on, where its
/// output block lies, and its operands as blocks (`operand<I>()`) or, for an operand fused
/// into it, that operand's own context (`fused<I>()`).
template <class Run, std::size_t N>
class kernel_context {
 public:
  using node_type = node_numbered_t<N, typename Run::root_type>;
  static constexpr bool distributed = Run::place_type::distributed;

  explicit kernel_context(Run& run) : system(Run::system_for(run.place())), run_(&run) {}

  place_system system;

  template <std::size_t Rank>
  [[nodiscard]] shape_t<Rank> local_offset(const layout_value& v, const shape_t<Rank>& global) const {
    return run_->place().local_offset(v, global);
  }

  /// @brief The block of `leaf` on this place, as the leaf keeps it.
  template <class Leaf>
  [[nodiscard]] decltype(auto) shard(const Leaf& leaf) const {
    return leaf.shard(run_->place());
  }

  /// @brief Operand `I` of the node, in the layout the node needs: its local block, local
  /// extents, and where the block starts in the operand's global shape.
  template <std::size_t I>
  [[nodiscard]] auto operand() const {
    const node_type& node = node_numbered<N>(run_->root());
    const auto& c = detail::operand<I>(node.children());
    using child_t = std::remove_cvref_t<decltype(c)>;
    block_view<typename child_t::value_type, child_t::rank> view;
    view.global = c.shape();
    view.offset = local_offset(node_type::rule.operands[I], c.shape());
    const auto& block = [&]() -> const auto& {
      if constexpr (Run::template in_slot<node_type, I>) return run_->template slot<child_number<node_type, N, I>()>();
      else return c.shard(run_->place());
    }();
    view.data = block.data();
    view.shape = block.shape();
    return view;
  }

  /// @brief The context of operand `I`, whose kernel runs inside this node's (fused): the
  /// step of its kernel is recorded as run here.
  template <std::size_t I>
  [[nodiscard]] auto fused() const {
    constexpr std::size_t c = child_number<node_type, N, I>();
    if (step_recorder::on()) {
      using child_t = node_numbered_t<c, typename Run::root_type>;
      plan_step ran{plan_step_kind::kernel, child_t::name, c};
      ran.fused = true;
      ran.layout = child_t::rule.out;
      step_recorder::record(run_->place().recorded_place(), kernel_step_of<Run::plan, c>(), ran);
    }
    return kernel_context<Run, c>(*run_);
  }

 private:
  Run* run_;
};

}  // namespace pdo::detail
