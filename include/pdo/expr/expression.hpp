// pdo/expr/expression.hpp: what every expression node has, and the leaves. How a plan of nodes
// runs is exec's (pdo/exec/run_plan.hpp): a node's kernel reads its operands through the
// context it is given.
#pragma once

#include <pdo/comm/mesh_comms.hpp>
#include <pdo/core/config.hpp>
#include <pdo/core/error.hpp>
#include <pdo/core/owned.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/kernels/place_system.hpp>
#include <pdo/layout/propagation.hpp>
#include <pdo/layout/redistribute_plan.hpp>
#include <pdo/plan/step.hpp>
#include <pdo/tensor/dtensor.hpp>
#include <pdo/tensor/redistribute.hpp>
#include <pdo/tensor/tensor.hpp>

#include <cstddef>
#include <iosfwd>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo {

/// @brief An expression node: a lazy value that pdo::eval materializes. Nodes opt in
/// with `using expression_tag = void;` and describe themselves with `value_type`, `rank`,
/// `distributed`, `mesh_type`, `name`, `rule` (the planner's op_rule), `shape()`, their
/// children and, for ops, `kernel(context, out)`: the op's local kernel, which reads operand
/// I as a block through `context.template operand<I>()` (or, fused into it, through
/// `context.template fused<I>()`) and writes `out`, this place's block of the result.
template <class E>
concept tensor_expression = requires { typename std::remove_cvref_t<E>::expression_tag; };

/// @brief Deleted: an expression has no elements until it is evaluated (deleted, so that code
/// asking whether it can be written finds it cannot).
template <tensor_expression E>
std::ostream& operator<<(std::ostream& os, const E& e) = delete;  // pdo: an expression is not written to a stream: write pdo::eval(e)

namespace detail {

/// @brief A place's block of an operand, ready for a kernel: its local data, local
/// extents, and where the block starts in the operand's global shape.
template <class T, std::size_t Rank>
struct block_view {
  const T* data = nullptr;
  shape_t<Rank> shape{};
  shape_t<Rank> offset{};
  shape_t<Rank> global{};
};

/// @brief "f32[10, 6]" for local nodes, "f32[10, 6]{split<x>, replicate}" for distributed ones.
template <class Node>
std::string describe_node(const Node& n) {
  const auto shape = n.shape();
  if constexpr (Node::distributed) return describe_block(dtype_name<typename Node::value_type>(), shape, &Node::rule.out);
  else return describe_block(dtype_name<typename Node::value_type>(), shape, nullptr);
}

template <class... Ts>
struct first_mesh {
  using type = void;
};
template <class T, class... Ts>
struct first_mesh<T, Ts...> {
  using type = std::conditional_t<!std::is_void_v<typename T::mesh_type>, typename T::mesh_type,
                                  typename first_mesh<Ts...>::type>;
};

/// @brief What every node declares about its operands: same element type, one mesh.
template <class... Children>
struct operand_traits {
  using mesh_type = typename first_mesh<Children...>::type;
  static constexpr bool distributed = (Children::distributed || ...);
  static constexpr bool any_local_tensor = ((!Children::distributed && !Children::is_scalar) || ...);
  static constexpr bool no_mixing = !distributed || !any_local_tensor;
  static constexpr bool one_mesh = ((std::is_void_v<typename Children::mesh_type> || std::is_same_v<typename Children::mesh_type, mesh_type>) && ...);
  static_assert(no_mixing,
                "pdo: an expression mixes pdo::tensor and pdo::dtensor operands; distribute the tensor onto the "
                "mesh first (pdo::distribute<Layout>(mesh, t)), or use the local shards inside pdo::parallel_do");
  static_assert(one_mesh, "pdo: an expression mixes dtensors of different mesh types; every operand must live on one mesh");
  /// @brief Whether the operands agree (the checks above) here and in every operand's subtree:
  /// what evaluates an expression instantiates nothing more when they do not (one error).
  static constexpr bool agree = no_mixing && one_mesh && (Children::well_formed && ...);
};

/// @brief The element type of an op over `Children`: that of its first tensor operand
/// (plain numbers take it); of the first operand when all are numbers.
template <class... Children>
struct common_value {
  using type = typename std::tuple_element_t<0, std::tuple<Children...>>::value_type;
};
template <class First, class... Rest>
  requires(First::is_scalar && sizeof...(Rest) > 0 && ((!Rest::is_scalar) || ...))
struct common_value<First, Rest...> : common_value<Rest...> {};

/// @brief Operand `I` of an op node (see operands_of).
template <std::size_t I, class Child>
struct operand_slot {
  Child value;
};

template <class Indices, class... Children>
struct operands_of;
/// @brief The operands of an op node, a member each. Not a std::tuple: a tuple compiles a
/// dozen functions per operand (its recursive bases, std::get's and std::apply's helpers), and
/// every expression type has a tuple of its own.
template <std::size_t... I, class... Children>
struct operands_of<std::index_sequence<I...>, Children...> : operand_slot<I, Children>... {
  explicit operands_of(Children... c) : operand_slot<I, Children>{std::move(c)}... {}
};
template <class... Children>
using operands = operands_of<std::index_sequence_for<Children...>, Children...>;

/// @brief Operand `I` of `children` (an op node's `children()`).
template <std::size_t I, class Child>
const Child& operand(const operand_slot<I, Child>& children) {
  return children.value;
}

/// @brief f(operands...) of `children` (an op node's `children()`).
template <class F, std::size_t... I, class... Children>
decltype(auto) apply_operands(F&& f, const operands_of<std::index_sequence<I...>, Children...>& children) {
  return f(static_cast<const operand_slot<I, Children>&>(children).value...);
}

/// @brief What every op node has: its operands (`children()`), the mesh type they live
/// on, and whether the op is distributed. Ops derive from it and add `value_type`,
/// `rank`, `name`, `elementwise`, the planner's `rule`, `shape()` and `kernel(ctx, out)`.
template <class... Children>
class op_node {
  using traits = operand_traits<Children...>;

 public:
  using expression_tag = void;
  using mesh_type = typename traits::mesh_type;
  /// @brief The operands' types, as a list (std::tuple_element_t<I, children_type>), not storage.
  using children_type = std::tuple<Children...>;
  static constexpr bool distributed = traits::distributed, is_leaf = false, is_scalar = false;
  /// @brief Whether the operands of this op and of every op below it agree (one element
  /// type's mesh, no pdo::tensor beside a pdo::dtensor).
  static constexpr bool well_formed = traits::agree;

  [[nodiscard]] const operands<Children...>& children() const { return children_; }

 protected:
  explicit op_node(Children... c) : children_(std::move(c)...) {}
  operands<Children...> children_;
};

template <class T, class... Children>
inline constexpr bool same_element_types = ((Children::is_scalar || std::is_same_v<typename Children::value_type, T>) && ...);

}  // namespace detail

/// @brief Leaf: a local pdo::tensor, by reference (or owned, when given as an rvalue).
template <element T, std::size_t Rank>
class tensor_leaf {
 public:
  /// @brief Marks this class as an expression node (see pdo::tensor_expression).
  using expression_tag = void;
  /// @brief Element type of the tensor read.
  using value_type = T;
  /// @brief void: a local tensor belongs to no mesh.
  using mesh_type = void;
  /// @brief Number of dims of the tensor.
  static constexpr std::size_t rank = Rank;
  /// @brief false: a local tensor, not laid out over a mesh.
  static constexpr bool distributed = false, is_leaf = true, is_scalar = false, elementwise = false;
  /// @brief true: a leaf is well formed.
  static constexpr bool well_formed = true;
  /// @var is_leaf
  /// @brief true: a leaf has no children.
  /// @var is_scalar
  /// @brief false: a tensor, not a plain number.
  /// @var elementwise
  /// @brief false: a leaf is read as a block, never fused into an elementwise kernel.

  /// @brief "tensor": how plans and error messages name this leaf.
  static constexpr std::string_view name = "tensor";
  /// @brief The planner's rule: an output layout of rank `Rank` with no split or partial axis (a local value).
  static constexpr detail::op_rule rule = [] {
    detail::op_rule r;
    r.out.rank = Rank;
    return r;
  }();

  /// @brief Refers to `t`, which must outlive every evaluation of the expression.
  explicit tensor_leaf(const tensor<T, Rank>& t) : t_(&t) {}
  /// @brief Takes `t` over; copies of this leaf share it.
  explicit tensor_leaf(tensor<T, Rank>&& t) : owned_(detail::own_value(std::move(t))), t_(static_cast<const tensor<T, Rank>*>(owned_.get())) {}

  /// @brief The tensor's extents.
  [[nodiscard]] const shape_t<Rank>& shape() const { return t_->shape(); }
  /// @brief The tensor this leaf reads.
  [[nodiscard]] const tensor<T, Rank>& value() const { return *t_; }
  /// @brief The whole tensor, whatever the context: a local tensor is a single block.
  template <class Ctx>
  [[nodiscard]] const tensor<T, Rank>& shard(const Ctx&) const {
    return *t_;
  }

 private:
  std::shared_ptr<const void> owned_;  ///< the tensor, when this leaf owns it
  const tensor<T, Rank>* t_;
};

/// @brief Leaf: a pdo::dtensor, by reference (or owned, when given as an rvalue).
template <class DTensor>
class dtensor_leaf {
 public:
  /// @brief Marks this class as an expression node (see pdo::tensor_expression).
  using expression_tag = void;
  /// @brief Element type of the dtensor read.
  using value_type = typename DTensor::value_type;
  /// @brief Type of the mesh the dtensor is laid out over.
  using mesh_type = typename DTensor::mesh_type;
  /// @brief Number of dims of the dtensor.
  static constexpr std::size_t rank = DTensor::rank;
  /// @brief true: the dtensor is laid out over a mesh, one shard per place.
  static constexpr bool distributed = true, is_leaf = true, is_scalar = false, elementwise = false;
  /// @brief true: a leaf is well formed.
  static constexpr bool well_formed = true;
  /// @var is_leaf
  /// @brief true: a leaf has no children.
  /// @var is_scalar
  /// @brief false: a tensor, not a plain number.
  /// @var elementwise
  /// @brief false: a leaf is read as a block, never fused into an elementwise kernel.

  /// @brief "dtensor": how plans and error messages name this leaf.
  static constexpr std::string_view name = "dtensor";
  /// @brief The planner's rule: the output layout is the dtensor's own (DTensor::layout_value).
  static constexpr detail::op_rule rule = [] {
    detail::op_rule r;
    r.out = DTensor::layout_value;
    return r;
  }();

  /// @brief Refers to `t`, which must outlive every evaluation of the expression.
  explicit dtensor_leaf(const DTensor& t) : t_(&t) {}
  /// @brief Takes `t` over; copies of this leaf share it.
  explicit dtensor_leaf(DTensor&& t) : owned_(detail::own_value(std::move(t))), t_(static_cast<const DTensor*>(owned_.get())) {}
  /// @brief A dtensor kept alive by `t` (the result of an eval_async, say).
  explicit dtensor_leaf(std::shared_ptr<const DTensor> t) : owned_(t), t_(t.get()) {}

  /// @brief The dtensor's global extents.
  [[nodiscard]] const shape_t<rank>& shape() const { return t_->shape(); }
  /// @brief The mesh the dtensor is laid out over.
  [[nodiscard]] const mesh_type& mesh() const { return t_->mesh(); }
  /// @brief The dtensor this leaf reads.
  [[nodiscard]] const DTensor& value() const { return *t_; }
  /// @brief The shard of the context's place `ctx.p` (a place of this process; else pdo::layout_error).
  template <class Ctx>
  [[nodiscard]] const tensor<value_type, rank>& shard(const Ctx& ctx) const {
    return t_->shard(ctx.p);  // the context of a place of the dtensor's mesh
  }

 private:
  std::shared_ptr<const void> owned_;  ///< the dtensor (or what keeps it alive), when this leaf owns it
  const DTensor* t_;
};

/// @brief Leaf: a plain number, converted to the element type of the tensors it meets.
template <element T>
class scalar_leaf {
 public:
  /// @brief Marks this class as an expression node (see pdo::tensor_expression).
  using expression_tag = void;
  /// @brief The number's own type; an op converts it to its tensor operands' element type.
  using value_type = T;
  /// @brief void: a number belongs to no mesh.
  using mesh_type = void;
  /// @brief 0: a number has no dims.
  static constexpr std::size_t rank = 0;
  /// @brief false: a number is not laid out over a mesh (every place reads the same value).
  static constexpr bool distributed = false, is_leaf = true, is_scalar = true, elementwise = false;
  /// @brief true: a leaf is well formed.
  static constexpr bool well_formed = true;
  /// @var is_leaf
  /// @brief true: a leaf has no children.
  /// @var is_scalar
  /// @brief true: a plain number, broadcast to the shape of the tensors it meets.
  /// @var elementwise
  /// @brief false: a number is no op; elementwise kernels read it as a constant.

  /// @brief "scalar": how plans and error messages name this leaf.
  static constexpr std::string_view name = "scalar";
  /// @brief The planner's rule: empty (rank 0, nothing split); a number needs no layout.
  static constexpr detail::op_rule rule{};

  /// @brief Holds the number `v`.
  explicit scalar_leaf(T v) : value(v) {}
  /// @brief The empty shape of rank 0.
  [[nodiscard]] shape_t<0> shape() const { return {}; }
  /// @brief The number, read by every element of the op it is an operand of.
  T value;
};

namespace detail {

/// @brief Any operand as an expression node: tensors and dtensors become leaves, numbers
/// scalars, expressions stay as they are.
template <class A>
auto as_expression(A&& a) {
  using plain = std::remove_cvref_t<A>;
  if constexpr (tensor_expression<plain>) return plain(std::forward<A>(a));
  else if constexpr (requires { typename plain::async_result_tag; })
    return dtensor_leaf<typename plain::value_type>(a.shared_value());
  else if constexpr (is_tensor_v<plain>) return tensor_leaf<typename plain::value_type, plain::rank>(std::forward<A>(a));
  else if constexpr (is_dtensor_v<plain>) return dtensor_leaf<plain>(std::forward<A>(a));
  else {
    static_assert(element<plain>, "pdo: an operand must be a pdo::tensor, a pdo::dtensor, an expression or a number");
    return scalar_leaf<plain>(a);
  }
}

template <class A>
using expression_t = decltype(as_expression(std::declval<A>()));

/// @brief An operand of a pdo op: a tensor, a dtensor or an expression (not a bare number).
template <class A>
concept tensor_operand = tensor_expression<A> || is_tensor_v<std::remove_cvref_t<A>> || is_dtensor_v<std::remove_cvref_t<A>> ||
                         requires { typename std::remove_cvref_t<A>::async_result_tag; };

/// @brief The mesh of the first dtensor leaf of `node`'s subtree.
template <class Node>
const typename Node::mesh_type* find_mesh(const Node& node) {
  if constexpr (Node::is_leaf) {
    if constexpr (Node::distributed) return &node.mesh();
    else return nullptr;
  } else {
    const typename Node::mesh_type* found = nullptr;
    apply_operands(
        [&](const auto&... c) {
          (([&] {
             if constexpr (std::remove_cvref_t<decltype(c)>::distributed)
               if (found == nullptr) found = find_mesh(c);
           }()),
           ...);
        },
        node.children());
    return found;
  }
}

/// @brief The error of an operation `op` whose `operand` lives on `its_mesh`, not on `mesh`, that
/// of its `first` operand (check_one_mesh's, conv2d's).
[[noreturn]] PDO_NOINLINE inline void throw_other_mesh(std::string_view op, const std::string& operand, const std::string& its_mesh,
                                                       const std::string& mesh,
                                                       std::string_view first = "the expression's first dtensor") {
  const std::string head = std::string(op) + ": " + operand + " lives on ";
  if (its_mesh == mesh)
    throw layout_error(head + "another mesh than " + std::string(first) + ", though both are " + mesh +
                       " (each make_mesh call makes a mesh of its own); make the operands on one mesh");
  throw layout_error(head + its_mesh + ", another mesh than " + std::string(first) + " (" + mesh +
                     "); move it onto that mesh first: pdo::distribute<Layout>(mesh, pdo::gather(x))");
}

/// @brief Throws pdo::layout_error unless every dtensor of `node`'s subtree lives on `m`: an
/// error of `caller` ("eval", "eval_async") of `op` (the op of the expression's root).
template <class Node, class Mesh>
void check_one_mesh(const Node& node, const Mesh& m, const char* caller, std::string_view op) {
  if constexpr (Node::is_leaf) {
    if constexpr (Node::distributed)
      if (!(node.mesh() == m))
        throw_other_mesh(std::string(caller) + " of " + std::string(op), "an operand " + describe_node(node), node.mesh().describe(),
                         m.describe());
  } else {
    apply_operands([&](const auto&... c) { (check_one_mesh(c, m, caller, op), ...); }, node.children());
  }
}

/// @brief f(leaf) for every local tensor leaf of `node`'s subtree.
template <class Node, class F>
void for_each_tensor_leaf(const Node& node, F&& f) {
  if constexpr (Node::is_leaf) {
    if constexpr (!Node::distributed && !Node::is_scalar) f(node);
  } else {
    apply_operands([&](const auto&... c) { (for_each_tensor_leaf(c, f), ...); }, node.children());
  }
}

/// @brief The GPU place whose memory holds the local tensors of `node`, or null when they
/// are in host memory (which CPU places share). Operands in two memories are a pdo::error
/// naming the op, the operands and their places.
[[noreturn]] PDO_NOINLINE inline void throw_two_memories(std::string_view op, const std::vector<std::pair<std::string, const place_state*>>& operands) {
  std::string text;
  for (const auto& [operand, memory] : operands)
    text += (text.empty() ? "" : ", ") + operand + " on " + (memory != nullptr ? memory->name : std::string("the host"));
  throw error("eval of " + std::string(op) + ": operands in two memories (" + text +
              "); copy them to one place first (pdo::to_place, pdo::to_host)");
}

template <class Node>
place_state* local_home(const Node& node) {
  place_state* home = nullptr;
  bool seen = false, mixed = false;
  for_each_tensor_leaf(node, [&](const auto& leaf) {
    place_state* const memory = memory_of(leaf.value().where());
    if (!seen) home = memory;
    mixed = mixed || memory != home;
    seen = true;
  });
  if (mixed) {
    std::vector<std::pair<std::string, const place_state*>> operands;
    for_each_tensor_leaf(node, [&](const auto& leaf) { operands.emplace_back(describe_node(leaf), memory_of(leaf.value().where())); });
    throw_two_memories(Node::name, operands);
  }
  return home;
}

/// @brief The plan that brings child `I` of `Node` to the layout the node needs of it.
template <class Node, std::size_t I>
inline constexpr redistribute_plan operand_plan_v =
    plan_redistribute(std::tuple_element_t<I, typename Node::children_type>::rule.out, Node::rule.operands[I]);

/// @brief Whether child `I` of `Node` runs inside `Node`'s kernel (fused): both are
/// elementwise and nothing moves between them, or `Node` reads the child in place and
/// nothing moves between them (a node says so with a `reads_in_place<I>` member: a 2-D
/// matmul reads a transposed tensor as it is stored). The one place fusion is decided: the
/// kernels read fused children through it, and plan_of marks their steps fused.
template <class Node, std::size_t I>
inline constexpr bool fuses_child = [] {
  using child_t = std::tuple_element_t<I, typename Node::children_type>;
  if constexpr (Node::is_leaf || child_t::is_leaf) return false;
  else if constexpr (requires { Node::template reads_in_place<I>; })
    return Node::template reads_in_place<I> && (!Node::distributed || operand_plan_v<Node, I>.size == 0);
  else return Node::elementwise && child_t::elementwise && (!Node::distributed || operand_plan_v<Node, I>.size == 0);
}();

}  // namespace detail
}  // namespace pdo
