// pdo/plan/plan.hpp: the plan of an expression, computed from its type at compile time.
#pragma once

#include <pdo/core/error.hpp>
#include <pdo/core/fixed_string.hpp>
#include <pdo/expr/expression.hpp>
#include <pdo/layout/layout_type.hpp>
#include <pdo/layout/redistribute_plan.hpp>
#include <pdo/plan/step.hpp>

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

namespace pdo {

/// @brief The plan of an expression: its steps in order. A value: usable in
/// static_assert (`pdo::plan_of<E>().count(pdo::step_kind::all_reduce) == 1`).
struct expression_plan {
  static constexpr std::size_t capacity = 96;  ///< the most steps a plan holds
  std::size_t size = 0;                        ///< the number of steps in use, at the front of `steps`
  std::size_t nodes = 0;  ///< nodes numbered (leaves included)
  std::array<plan_step, capacity> steps{};     ///< the steps, in the order they run

  /// @brief The first step.
  [[nodiscard]] constexpr const plan_step* begin() const { return steps.data(); }
  /// @brief Past the last step in use (steps + size).
  [[nodiscard]] constexpr const plan_step* end() const { return steps.data() + size; }
  /// @brief How many collectives of kind `k` the plan runs (an all_reduce(max) counts as an
  /// all_reduce, a halo exchange as the all_to_all it runs as; pdo::planned_collectives
  /// counts what ran the same way).
  [[nodiscard]] constexpr std::size_t count(step_kind k) const {
    std::size_t n = 0;
    for (const auto& s : *this)
      n += (s.kind == plan_step_kind::redistribute && s.move.kind == k) ||
           (s.kind == plan_step_kind::combine_max && k == step_kind::all_reduce) ||
           (s.kind == plan_step_kind::halo_exchange && k == step_kind::all_to_all);
    return n;
  }
  /// @brief How many steps communicate (halo exchanges included).
  [[nodiscard]] constexpr std::size_t collectives() const {
    std::size_t n = 0;
    for (const auto& s : *this)
      n += (s.kind == plan_step_kind::redistribute && communicates(s.move.kind)) || s.kind == plan_step_kind::combine_max ||
           s.kind == plan_step_kind::halo_exchange;
    return n;
  }
  /// @brief How many passes over memory the kernels make: fused ops share one.
  [[nodiscard]] constexpr std::size_t kernels() const {
    std::size_t n = 0;
    for (const auto& s : *this) n += s.kind == plan_step_kind::kernel && !s.fused;
    return n;
  }
  /// @brief The layout of the expression's result.
  [[nodiscard]] constexpr detail::layout_value result_layout() const {
    for (std::size_t i = size; i-- > 0;)
      if (steps[i].kind == plan_step_kind::kernel) return steps[i].layout;
    return {};
  }
  /// @brief Appends `s`; beyond `capacity` steps, a compile-time error in a constant expression
  /// (pdo::layout_error at run time).
  constexpr void push(const plan_step& s) {
    if (size == capacity)
      throw layout_error("plan_of: the expression has more than " + std::to_string(capacity) +
                         " steps, more than a plan holds; evaluate part of it first");
    steps[size++] = s;
  }
};

namespace detail {

/// @brief The node number of a redistribution step pushed before its op is numbered.
inline constexpr std::size_t unnumbered = static_cast<std::size_t>(-1);

// Node numbers: the nodes of an expression are numbered in evaluation order, children
// before their op (post-order), leaves included and plain numbers left out. A step of a
// plan names its op and operand by these numbers; the executor finds the nodes by them.

/// @brief How many numbers the subtree of `Node` takes.
template <class Node>
constexpr std::size_t numbered_nodes() {
  if constexpr (Node::is_leaf) {
    return Node::is_scalar ? 0 : 1;
  } else {
    return []<std::size_t... I>(std::index_sequence<I...>) {
      return (numbered_nodes<std::tuple_element_t<I, typename Node::children_type>>() + ... + 1);
    }(std::make_index_sequence<std::tuple_size_v<typename Node::children_type>>{});
  }
}

/// @brief The number of child `I` of `Node`, when `Node` is numbered `Id`.
template <class Node, std::size_t Id, std::size_t I>
constexpr std::size_t child_number() {
  std::size_t n = Id + 1 - numbered_nodes<Node>();  // the subtree's first number
  [&]<std::size_t... J>(std::index_sequence<J...>) {
    ((n += numbered_nodes<std::tuple_element_t<J, typename Node::children_type>>()), ...);
  }(std::make_index_sequence<I + 1>{});
  return n - 1;
}

template <std::size_t N, std::size_t I, class Node>
const auto& numbered_child(const Node& node);

/// @brief The node numbered `N` in the subtree of `node` (numbered from 0).
template <std::size_t N, class Node>
const auto& node_numbered(const Node& node) {
  static_assert(N < numbered_nodes<Node>(), "pdo: internal: no node has this number");
  if constexpr (N + 1 == numbered_nodes<Node>()) return node;
  else return numbered_child<N, 0>(node);
}

/// @brief The node numbered `N` among the subtrees of the children of `node` from child `I` on.
template <std::size_t N, std::size_t I, class Node>
const auto& numbered_child(const Node& node) {
  constexpr std::size_t taken = numbered_nodes<std::tuple_element_t<I, typename Node::children_type>>();
  if constexpr (N < taken) return node_numbered<N>(detail::operand<I>(node.children()));
  else return numbered_child<N - taken, I + 1>(node);
}

/// @brief The type of the node numbered `N` in the subtree of `Root`.
template <std::size_t N, class Root>
using node_numbered_t = std::remove_cvref_t<decltype(node_numbered<N>(std::declval<const Root&>()))>;

/// @brief Appends the steps of `Node`'s subtree to `plan` in evaluation order and returns
/// the node's number: for each operand in turn, its subtree's steps and the redistributions
/// that bring it to the layout the op needs; then the op's kernel; then its combines.
template <class Node>
constexpr std::size_t add_steps(expression_plan& plan, bool fused) {
  if constexpr (Node::is_leaf) {
    return Node::is_scalar ? expression_plan::capacity : plan.nodes++;
  } else {
    constexpr std::size_t arity = std::tuple_size_v<typename Node::children_type>;
    std::array<std::size_t, arity> child{};
    const std::size_t first = plan.size;  // this subtree's first step
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (
          [&] {
            child[I] = add_steps<std::tuple_element_t<I, typename Node::children_type>>(plan, fuses_child<Node, I>);
            if constexpr (Node::distributed) {
              for (const auto& s : operand_plan_v<Node, I>) {
                plan_step step{plan_step_kind::redistribute, Node::name, unnumbered, I, child[I]};
                step.move = s;
                plan.push(step);
              }
            }
          }(),
          ...);
    }(std::make_index_sequence<arity>{});
    // numbered after its operands: the steps pushed above learn the number now
    const std::size_t id = plan.nodes++;
    for (std::size_t k = first; k < plan.size; ++k) {
      plan_step& s = plan.steps[k];
      if (s.kind == plan_step_kind::redistribute && s.node == unnumbered) s.node = id;
      if (s.kind == plan_step_kind::kernel && s.fused)
        for (std::size_t c = 0; c < arity; ++c)
          if (s.node == child[c]) s.into = id;
    }
    plan_step kernel{plan_step_kind::kernel, Node::name, id};
    kernel.fused = fused;
    kernel.layout = Node::rule.out;
    plan.push(kernel);
    for (std::size_t i = 0; i < Node::rule.npost_max; ++i) {
      plan_step step{plan_step_kind::combine_max, Node::name, id};
      step.move.kind = step_kind::all_reduce;
      step.move.axis = Node::rule.post_max[i];
      step.move.before = step.move.after = Node::rule.out;
      plan.push(step);
    }
    return id;
  }
}

}  // namespace detail

/// @brief The plan of expression type `Expr` (what `pdo::eval` runs), at compile time:
/// each op's kernel, with the redistributions its operands need before it, in order.
template <class Expr>
constexpr expression_plan plan_of() {
  using node = detail::expression_t<Expr>;
  expression_plan plan;
  detail::add_steps<node>(plan, false);
  return plan;
}

/// @brief The plan of `expr`'s type.
template <class Expr>
constexpr expression_plan plan_of(const Expr&) {
  return plan_of<Expr>();
}

/// @brief Evaluation policies: `implicit` lets the planner insert the communication its
/// rules call for; `strict` makes every such communication a compile error that names
/// the op and the two layouts, so all communication is written out (pdo::redistribute).
struct implicit {};
struct strict {};

namespace detail {

template <class Node, std::size_t I>
struct operand_layout {
  static constexpr layout_value value = std::tuple_element_t<I, typename Node::children_type>::rule.out;
};
template <class Node, std::size_t I>
struct needed_layout {
  static constexpr layout_value value = Node::rule.operands[I];
};
template <class Node>
struct output_layout {
  static constexpr layout_value value = Node::rule.out;
};

template <class Node>
constexpr auto op_name_of() {
  return fixed_string<Node::name.size() + 1>(Node::name);
}

/// @brief Instantiated for an op whose operand must move under pdo::strict: the failed
/// assertion's context names the op, the operand's layout and the layout the op needs.
template <fixed_string Op, std::size_t Operand, class Has, class Needs>
struct strict_forbids_implicit_communication {
  static_assert(always_false<Has, Needs>,
                "pdo: strict: this op needs an operand in another layout, which takes communication; "
                "redistribute that operand explicitly (pdo::redistribute<Needs>(x), where the instantiation of "
                "strict_forbids_implicit_communication<Op, Operand, Has, Needs> named with this error gives the op, the "
                "operand's number, its layout and the layout the op needs), or evaluate without pdo::strict");
  static constexpr bool ok = false;
};
template <fixed_string Op, class Before, class After>
struct strict_forbids_implicit_max_reduction {
  static_assert(always_false<Before, After>,
                "pdo: strict: max over a split dim needs an all_reduce(max) across the places; gather the dim "
                "first (pdo::redistribute), or evaluate without pdo::strict");
  static constexpr bool ok = false;
};

/// @brief Checks every op of `Node`'s subtree under pdo::strict.
template <class Node>
constexpr bool check_strict() {
  if constexpr (Node::is_leaf || !Node::distributed) {
    return true;
  } else {
    using mesh_t = typename Node::mesh_type;
    constexpr std::size_t arity = std::tuple_size_v<typename Node::children_type>;
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return (check_strict<std::tuple_element_t<I, typename Node::children_type>>() && ...) &&
             ([] {
               if constexpr (operand_plan_v<Node, I>.collectives() > 0)
                 return strict_forbids_implicit_communication<op_name_of<Node>(), I,
                                                              layout_type_t<mesh_t, operand_layout<Node, I>>,
                                                              layout_type_t<mesh_t, needed_layout<Node, I>>>::ok;
               else
                 return true;
             }() && ...) &&
             [] {
               if constexpr (Node::rule.npost_max > 0)
                 return strict_forbids_implicit_max_reduction<op_name_of<Node>(), layout_type_t<mesh_t, needed_layout<Node, 0>>,
                                                              layout_type_t<mesh_t, output_layout<Node>>>::ok;
               else
                 return true;
             }();
    }(std::make_index_sequence<arity>{});
  }
}

template <class Policy, class Node>
constexpr void check_policy() {
  static_assert(std::is_same_v<Policy, implicit> || std::is_same_v<Policy, strict>,
                "pdo: eval: the policy must be pdo::implicit or pdo::strict");
  if constexpr (std::is_same_v<Policy, strict>) {
    // its failing step's message (called, not held in a constexpr variable: clang would add
    // that the variable is not initialized by a constant)
    (void)check_strict<Node>();
  }
}

}  // namespace detail

/// @brief The layout type of the result of evaluating `Expr` (a dtensor expression).
template <class Expr>
using result_layout_t = detail::layout_type_t<typename detail::expression_t<Expr>::mesh_type,
                                              detail::output_layout<detail::expression_t<Expr>>>;

}  // namespace pdo
