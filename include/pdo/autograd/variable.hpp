// pdo/autograd/variable.hpp: pdo::var, the graph it records, and pdo::backward.
#pragma once

#include <pdo/core/owned.hpp>
#include <pdo/core/views.hpp>
#include <pdo/exec/eval.hpp>
#include <pdo/exec/mesh_ops.hpp>
#include <pdo/kernels/place_system.hpp>

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief What autograd needs to know of a value: a pdo::tensor (local: on the host or
/// inside a place's block) or a pdo::dtensor (every op runs over its mesh).
template <class V>
struct value_kind {
  static constexpr bool valid = false;
};
template <class T, std::size_t R>
struct value_kind<tensor<T, R>> {
  static constexpr bool valid = true;
  static constexpr bool distributed = false;
  using element_type = T;
  static constexpr std::size_t rank = R;
  using grad_type = tensor<T, R>;
};
template <class T, std::size_t R, class M, class L>
struct value_kind<dtensor<T, R, M, L>> {
  static constexpr bool valid = true;
  static constexpr bool distributed = true;
  using element_type = T;
  static constexpr std::size_t rank = R;
  /// @brief The gradient of a partial value (a pending sum) is the same for every addend:
  /// replicated over those axes. So an all_reduce's gradient is the identity (Megatron's g).
  using grad_type = dtensor<T, R, M, typename L::base>;
};

/// @brief The type of the gradient of a value of type V.
template <class V>
using grad_t = typename value_kind<V>::grad_type;

/// @brief A value autograd can differentiate: a floating-point tensor or dtensor.
template <class V>
concept differentiable = value_kind<V>::valid && std::floating_point<typename value_kind<V>::element_type>;

/// @brief `g`, an evaluated gradient, as the type of the value it is the gradient of. For
/// dtensors this is the redistribution the planner picks between the two layouts: the
/// partial gradient of a replicated parameter used on split data is all_reduced here.
template <class V, class G>
V to_value(G&& g) {
  using g_t = std::remove_cvref_t<G>;
  if constexpr (std::is_same_v<g_t, V>) {
    return std::forward<G>(g);
  } else {
    static_assert(value_kind<V>::distributed && value_kind<g_t>::distributed && value_kind<V>::rank == value_kind<g_t>::rank,
                  "pdo: autograd: a gradient's rank or kind differs from its value's");
    return redistribute<typename V::layout_type>(g);
  }
}

/// @brief Evaluates a gradient expression into the type of the value it belongs to.
template <class V, class E>
V eval_as(E&& e) {
  return to_value<V>(pdo::eval(std::forward<E>(e)));
}

/// @brief out[i] += in[i].
template <class T>
struct add_into_element {
  T* out;
  const T* in;
  PDO_HD void operator()(std::size_t i) const { out[i] += in[i]; }
};

/// @brief `sum += g`, in place, block by block (for a dtensor, each local shard; the two
/// have the same type, so the same layout and shard shapes).
template <class V>
void add_in_place(V& sum, const V& g) {
  auto add = [](auto& out, const auto& in) {
    for_each_index(out.where(), out.size(), add_into_element<typename value_kind<V>::element_type>{out.data(), in.data()});
  };
  if constexpr (value_kind<V>::distributed) {
    for (auto&& [out, in] : views::zip(sum.local_shards(), g.local_shards())) add(out, in);
  } else {
    add(sum, g);
  }
}

/// @brief A node of the recorded graph, type-erased: the value of one op (or a leaf) and
/// how to push its gradient to the nodes it was computed from.
struct grad_node {
  explicit grad_node(std::vector<std::shared_ptr<grad_node>> in) : inputs(std::move(in)), order(next_order()) {}
  grad_node(const grad_node&) = delete;
  grad_node& operator=(const grad_node&) = delete;
  virtual ~grad_node() = default;

  std::vector<std::shared_ptr<grad_node>> inputs;  ///< the operands that need gradients
  std::uint64_t order;                             ///< creation order: inputs come before their uses
  bool leaf = false;
  /// @brief A backward has run through this node and freed what it saved.
  bool released = false;
  /// @brief For leaves: called by backward once this leaf's gradient is complete (all its
  /// uses have contributed), while the rest of backward still runs.
  std::function<void()> on_gradient;
  /// @brief For a leaf that is a local matrix (pdo::tensor<T, 2>): when set, backward hands it
  /// each contribution matmul(aᵀ, g) to this leaf's gradient (as a product's right operand,
  /// `a` and `g` pointing at the tensor<T, 2> operands) instead of adding it; it returns
  /// whether it took the contribution (false: backward adds it). A data-parallel trainer
  /// computes such weight gradients itself (data_parallel_options::sliced_weight_gradients).
  std::function<bool(const void* a, const void* g)> product_gradient;

  [[nodiscard]] virtual bool has_grad() const = 0;
  virtual void propagate() = 0;  ///< adds this node's contribution to its inputs' gradients
  virtual void release() = 0;    ///< frees an intermediate's gradient and saved values

  static std::uint64_t next_order() {
    static std::atomic<std::uint64_t> counter{0};
    return counter.fetch_add(1, std::memory_order_relaxed);
  }
};

template <class V>
struct value_node final : grad_node {
  value_node(V v, std::vector<std::shared_ptr<grad_node>> in) : grad_node(std::move(in)), value(std::move(v)) {}

  V value;
  std::optional<grad_t<V>> grad;
  /// @brief Given this node (its value and gradient), adds to its inputs' gradients.
  std::function<void(value_node&)> backward;

  [[nodiscard]] bool has_grad() const override { return grad.has_value(); }
  void propagate() override {
    if (grad && backward) backward(*this);
  }
  void release() override {
    grad.reset();
    backward = nullptr;
    released = true;
  }
  /// @brief Adds `g` to the gradient. Several threads may add at once: the places of a
  /// parallel_do whose block uses one parameter run their backward passes together.
  void accumulate(grad_t<V> g) {
    std::lock_guard lock(accumulating);
    if (!grad) grad.emplace(std::move(g));
    else add_in_place(*grad, g);
  }
  std::mutex accumulating;
};

}  // namespace detail

/// @brief A value that records the ops applied to it, so pdo::backward can compute
/// gradients: a pdo::tensor (local) or a pdo::dtensor (distributed; each op runs over the
/// mesh with the layouts the planner derives, and so does each gradient). Copies share
/// the same node (like handles).
template <class V>
class var {
 public:
  static_assert(detail::value_kind<V>::valid, "pdo: var holds a pdo::tensor or a pdo::dtensor");
  /// @brief The held value's type: a pdo::tensor or a pdo::dtensor.
  using value_type = V;
  /// @brief The value's element type.
  using element_type = typename detail::value_kind<V>::element_type;
  /// @brief The value's number of dims.
  static constexpr std::size_t rank = detail::value_kind<V>::rank;
  /// @brief Whether the value is a dtensor (laid out over a mesh) rather than a local tensor.
  static constexpr bool distributed = detail::value_kind<V>::distributed;

  /// @brief An empty var, to assign later; using it before then throws pdo::error.
  var() = default;
  /// @brief A leaf: a constant, or (with `requires_grad`) a value to differentiate with respect to.
  explicit var(V value, bool requires_grad = false)
      : var(new detail::value_node<V>(std::move(value), std::vector<std::shared_ptr<detail::grad_node>>{}), requires_grad) {
    node_->leaf = true;
  }
  /// @brief An op's result, recorded with the nodes it was computed from: takes over `made`
  /// (a new node).
  var(detail::value_node<V>* made, bool requires_grad) : node_(detail::own_as<detail::grad_node>(made)), requires_grad_(requires_grad) {}

  /// @brief The value (pdo::error on an empty var: default-constructed, or moved from).
  [[nodiscard]] const V& value() const { return held().value; }
  /// @brief The value, to change in place (optimizers update parameters this way).
  [[nodiscard]] V& value() { return held().value; }
  /// @brief The value's (global) extents.
  [[nodiscard]] const auto& shape() const { return held().value.shape(); }
  /// @brief Whether backward computes a gradient for this value: a parameter, or a result of one.
  [[nodiscard]] bool requires_grad() const { return requires_grad_; }
  /// @brief Whether this var was made from a value (a constant or a parameter) rather than by an op.
  [[nodiscard]] bool is_leaf() const { return held().leaf; }
  /// @brief Whether a gradient is held now (backward reached this value and it was not zeroed or freed).
  [[nodiscard]] bool has_grad() const { return held().grad.has_value(); }
  /// @brief The gradient accumulated by pdo::backward (for a partial dtensor: replicated over its partial axes).
  [[nodiscard]] const detail::grad_t<V>& grad() const {
    if (!held().grad)
      throw error("var::grad: no gradient: " + std::string(requires_grad_ ? "backward has not reached this value"
                                                                          : "the value does not require a gradient"));
    return *node()->grad;
  }
  /// @brief The gradient, writable; pdo::error when there is none (see the const overload).
  [[nodiscard]] detail::grad_t<V>& grad() { return const_cast<detail::grad_t<V>&>(std::as_const(*this).grad()); }
  /// @brief Forgets the gradient (before the next backward, which would add to it).
  void zero_grad() { held().grad.reset(); }
  /// @brief Calls `f()` during backward once this leaf's gradient is complete.
  void on_gradient(std::function<void()> f) { held().on_gradient = std::move(f); }

  /// @brief The recorded graph node shared by copies of this var: its value, gradient and
  /// backward function (null for an empty var).
  [[nodiscard]] detail::value_node<V>* node() const { return static_cast<detail::value_node<V>*>(node_.get()); }
  /// @brief The same node, as the graph holds it (an op's result holds its operands' nodes).
  [[nodiscard]] const std::shared_ptr<detail::grad_node>& graph_node() const { return node_; }

 private:
  detail::value_node<V>& held() const {
    if (!node_) throw error("var: this var is empty (default-constructed, or moved from); assign it a value, a parameter or an op's result first");
    return *node();
  }
  /// @brief A detail::value_node<V> (a handle of one type for every V: a shared_ptr to each
  /// node type would compile a dozen functions for each value type).
  std::shared_ptr<detail::grad_node> node_;
  bool requires_grad_ = false;
};

/// @brief A leaf that requires a gradient: a parameter or an input to differentiate by.
template <class V>
var<V> parameter(V value) {
  return var<V>(std::move(value), true);
}

template <class T>
inline constexpr bool is_var_v = false;
template <class V>
inline constexpr bool is_var_v<var<V>> = true;

/// @brief Deleted: a var is a value and its gradient; write the value (deleted, so that code
/// asking whether a var can be written finds it cannot).
template <class V>
std::ostream& operator<<(std::ostream& os, const var<V>& v) = delete;  // pdo: a pdo::var is not written to a stream: write v.value()

namespace detail {

/// @brief The value var `x` holds when `Unwrap` (the caller's kind of var: any, or a
/// distributed one), else `x` itself: an operand as an op or a check looks into it.
template <bool Unwrap, class X>
const auto& unwrap_var(const X& x) {
  if constexpr (Unwrap) return x.value();
  else return x;
}

/// @brief The forward value of an op on vars whose expression is not well formed (its error
/// was given): of the type the op would have given, and marked so that record instantiates
/// nothing of the op's backward after the error.
template <class V>
struct unformed_forward {
  using type = V;
};
/// @brief Evaluates an op's forward expression `expr`: its value, or (not well formed) an
/// unformed_forward.
template <class Expr>
auto eval_forward(Expr&& expr) {
  using node_t = expression_t<Expr>;
  if constexpr (!node_t::well_formed) return unformed_forward<unformed_value_t<node_t>>{};
  else return pdo::eval(std::forward<Expr>(expr));
}
template <class V>
struct value_kind<unformed_forward<V>> : value_kind<V> {};

/// @brief For an op whose expression was not well formed: an empty var of the type it would
/// have given (the backward rule is not instantiated).
template <class V, class Backward, class... Operands>
var<V> record(unformed_forward<V>, Backward&&, const Operands&...) {
  return var<V>{};
}

/// @brief Records the result of an op: `value`, computed from `operands`, whose gradient
/// `backward(node)` pushes back to them. A result of operands that need no gradient is a
/// plain constant, and nothing is recorded.
template <class V, class Backward, class... Operands>
var<V> record(V value, Backward backward, const Operands&... operands) {
  std::vector<std::shared_ptr<grad_node>> inputs;
  (
      [&] {
        if (operands.requires_grad()) inputs.push_back(operands.graph_node());
      }(),
      ...);
  if (inputs.empty()) return var<V>(std::move(value));
  var<V> out(new value_node<V>(std::move(value), std::move(inputs)), true);
  out.node()->backward = std::move(backward);
  return out;
}

/// @brief Adds the gradient expression `g` (evaluated into A's type) to `a`'s gradient, if `a` needs one.
template <class A, class G>
void add_grad(const var<A>& a, G&& g) {
  if (!a.requires_grad()) return;
  using target = grad_t<A>;
  if constexpr (std::is_same_v<std::remove_cvref_t<G>, target>) a.node()->accumulate(target(std::forward<G>(g)));
  else a.node()->accumulate(eval_as<target>(std::forward<G>(g)));
}

/// @brief The element of a rank-0 value, on the host (gathered for a dtensor, copied down
/// from a GPU's memory).
template <class V>
auto scalar_of(const V& v) {
  static_assert(value_kind<V>::rank == 0, "pdo: autograd: expected a rank-0 value");
  if constexpr (value_kind<V>::distributed) {
    return gather(v).data()[0];
  } else {
    typename value_kind<V>::element_type x{};
    copy_bytes(nullptr, &x, v.where(), v.data(), sizeof x);
    return x;
  }
}

}  // namespace detail

namespace detail {

/// @brief The nodes one backward runs through, from its root: the root and what it depends
/// on, last computed first, each with the number of its uses among them. A backward within a
/// part of a graph (a parallel_do block's, on one place) runs through the nodes made at or
/// after `first` (in creation order); a node made before, that the part uses (a value its
/// block captured), is the part's boundary: it takes its gradient from the part but does
/// not pass it on (the outer graph's backward does, once every part has added to it).
struct backward_pass {
  std::vector<grad_node*> nodes;
  std::unordered_map<grad_node*, std::size_t> uses;
  std::uint64_t first = 0;
  [[nodiscard]] bool inside(const grad_node* n) const { return n->order >= first; }
};

/// @brief The pass of a backward from `root` through the nodes made at or after `first`; a
/// pdo::error if one of them (or of the boundary) was freed by an earlier backward.
PDO_NOINLINE inline backward_pass plan_backward(grad_node* root, std::uint64_t first) {
  backward_pass pass;
  pass.first = first;
  std::vector<grad_node*> stack{root};
  pass.uses[root] = 0;
  while (!stack.empty()) {
    grad_node* n = stack.back();
    stack.pop_back();
    pass.nodes.push_back(n);
    if (!pass.inside(n)) continue;  // the boundary: its inputs belong to the outer graph
    for (const auto& in : n->inputs) {
      auto [it, fresh] = pass.uses.try_emplace(in.get(), 0);
      ++it->second;
      if (fresh) stack.push_back(in.get());
    }
  }
  for (const grad_node* n : pass.nodes)
    if (n->released)
      throw error("backward: part of the graph of this value was used by an earlier backward, which freed it; compute the value "
                  "again (run the forward again) to take another gradient");
  std::sort(pass.nodes.begin(), pass.nodes.end(), [](const auto* a, const auto* b) { return a->order > b->order; });
  return pass;
}

/// @brief Runs a pass whose root has its gradient: each node inside, last computed first,
/// adds its contribution to its inputs' gradients and frees what it kept; a leaf inside
/// learns that its gradient is complete (on_gradient) once its last use has added to it.
PDO_NOINLINE inline void run_backward(backward_pass& pass, grad_node* root) {
  const timeline_span span("kernel", "backward", [&] { return std::to_string(pass.nodes.size()) + " nodes"; });
  for (grad_node* n : pass.nodes) {
    if (n->leaf || !pass.inside(n)) continue;
    n->propagate();
    for (const auto& in : n->inputs)
      if (--pass.uses[in.get()] == 0 && in->leaf && in->on_gradient && pass.inside(in.get())) in->on_gradient();
    n->release();
  }
  if (root->leaf && root->on_gradient && pass.inside(root)) root->on_gradient();
}

/// @brief pdo::backward(out, seed) through the nodes made at or after `first` (see backward_pass).
template <class V>
void backward_within(const var<V>& out, grad_t<V> seed, std::uint64_t first) {
  if (!out.requires_grad()) throw error("backward: the value does not depend on anything that requires a gradient");
  if (seed.shape() != out.shape())
    throw shape_error("backward: the seed gradient " + format_extents(seed.shape()) + " does not have the shape of the value " +
                      format_extents(out.shape()) + " it is the gradient of");
  backward_pass pass = plan_backward(out.node(), first);
  out.node()->accumulate(std::move(seed));
  run_backward(pass, out.node());
}

}  // namespace detail

/// @brief Reverse mode: adds d(out)/d(leaf), weighted by `seed` (d(loss)/d(out)), to the
/// gradient of every leaf `out` depends on that requires one. Nodes run from the last
/// computed to the first; a leaf's on_gradient hook fires as soon as its last use has
/// contributed. Intermediate gradients and what the ops saved for them are freed as they
/// are consumed, so a graph takes one backward: a second one through any part of it is a
/// pdo::error (as PyTorch's without retain_graph), nothing is added.
template <class V>
void backward(const var<V>& out, detail::grad_t<V> seed) {
  detail::backward_within(out, std::move(seed), 0);
}

/// @brief Reverse mode from a rank-0 value (a loss): the seed is 1.
template <class V>
void backward(const var<V>& loss) {
  static_assert(detail::value_kind<V>::rank == 0,
                "pdo: backward(loss) needs a rank-0 value; pass the seed gradient for other values: backward(out, seed)");
  using T = typename detail::value_kind<V>::element_type;
  backward(loss, detail::eval_as<detail::grad_t<V>>(detail::make_elementwise<op::expand>(T(1), loss.value())));
}

/// @brief Rejects at compile time a seed that is not a gradient of `out` (another element
/// type or rank; for a dtensor, another mesh, or a layout that does not convert).
template <class V, class Seed>
  requires(!std::convertible_to<const Seed&, detail::grad_t<V>>)
void backward(const var<V>&, const Seed&) {
  static_assert(detail::always_false<Seed>,
                "pdo: backward(out, seed): the seed is d(loss)/d(out), a value of out's gradient type: out's element type and rank "
                "(for a dtensor, its mesh and layout)");
}

/// @brief Rejects at compile time a value that is not a pdo::var: it has no graph to take
/// a gradient through.
template <class V, class... Seed>
  requires(!is_var_v<std::remove_cvref_t<V>>)
void backward(const V&, const Seed&...) {
  static_assert(detail::always_false<V>,
                "pdo: backward takes a pdo::var: compute the loss from inputs wrapped in pdo::var(t) (or pdo::parameter(t) for "
                "what needs a gradient), not from plain tensors or expressions");
}

}  // namespace pdo
