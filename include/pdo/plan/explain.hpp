// pdo/plan/explain.hpp: an expression's plan printed for its actual shapes, with the bytes each collective moves.
#pragma once

#include <pdo/plan/plan.hpp>

#include <cstddef>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief What explain knows of one node: its description and global shape.
struct node_facts {
  std::string text;
  std::vector<std::size_t> shape;
  std::size_t element_size = 0;
};

/// @brief Records every node of `node`'s subtree in evaluation order (the numbering of plan_of).
template <class Node>
void collect_nodes(const Node& node, std::vector<node_facts>& out) {
  if constexpr (Node::is_scalar) {
    return;
  } else {
    if constexpr (!Node::is_leaf) apply_operands([&](const auto&... c) { (collect_nodes(c, out), ...); }, node.children());
    const auto s = node.shape();
    out.push_back({std::string(Node::name) + " " + describe_node(node), {s.begin(), s.end()}, sizeof(typename Node::value_type)});
  }
}

/// @brief Bytes place 0 sends in one redistribution step of a tensor of `shape` (ring
/// algorithms: all_reduce 2(n-1)/n of its block, reduce_scatter and all_to_all (n-1)/n,
/// all_gather (n-1) blocks); local steps send nothing.
template <class Mesh>
std::size_t bytes_sent(const Mesh& m, const redistribute_step& s, const std::vector<std::size_t>& shape, std::size_t element) {
  const std::size_t n = m.extent(Mesh::axis_index(s.axis));
  std::size_t block = element;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    std::size_t e = shape[d];
    if (!s.before.dim_axis[d].empty()) e = chunk_size(e, m.extent(Mesh::axis_index(s.before.dim_axis[d])), 0);
    block *= e;
  }
  switch (s.kind) {
    case step_kind::all_reduce: return 2 * (n - 1) * block / n;
    case step_kind::reduce_scatter:
    case step_kind::all_to_all: return (n - 1) * block / n;
    case step_kind::all_gather: return (n - 1) * block;
    default: return 0;
  }
}

}  // namespace detail

/// @brief The plan of `expr` for its actual shapes, one line per step: each op's kernel
/// with its output layout, ops fused into one kernel marked as such, and each collective
/// with its axis, layouts and the bytes each place sends (place 0's block where shards are uneven).
template <class Expr>
  requires tensor_expression<std::remove_cvref_t<Expr>>
std::string explain(const Expr& expr) {
  const auto& node = expr;
  using node_t = std::remove_cvref_t<Expr>;
  constexpr expression_plan plan = plan_of<node_t>();
  std::vector<detail::node_facts> nodes;
  detail::collect_nodes(node, nodes);
  [[maybe_unused]] const auto* mesh = detail::find_mesh(node);  // nullptr for local expressions
  std::string text = "plan of " + std::string(node_t::name) + " -> " + detail::describe_node(node);
  if constexpr (node_t::distributed) text += " on " + mesh->describe();
  text += ": " + std::to_string(plan.kernels()) + " kernel" + (plan.kernels() == 1 ? "" : "s") + ", " +
          std::to_string(plan.collectives()) + " collective" + (plan.collectives() == 1 ? "" : "s") + "\n";
  // the kernel a fused op runs inside: the first op up its chain of consumers that is not fused
  auto runs_in = [&](const plan_step& fused) {
    std::size_t consumer = fused.into;
    for (bool up = true; up;) {
      up = false;
      for (const auto& s : plan)
        if (s.kind == plan_step_kind::kernel && s.fused && s.node == consumer) {
          consumer = s.into;
          up = true;
          break;
        }
    }
    return consumer;
  };
  std::size_t line = 0;
  for (const auto& s : plan) {
    const auto& facts = nodes[s.node];
    if (s.kind == plan_step_kind::kernel && s.fused) continue;  // printed with the kernel it runs in
    text += "  " + std::to_string(++line) + ". ";
    if (s.kind == plan_step_kind::kernel) {
      std::string fused_ops;
      for (const auto& f : plan)
        if (f.kind == plan_step_kind::kernel && f.fused && runs_in(f) == s.node) fused_ops += std::string(f.op) + " + ";
      text += "kernel " + (fused_ops.empty() ? std::string(s.op) : "fused(" + fused_ops + std::string(s.op) + ")") + " -> " +
              facts.text.substr(facts.text.find(' ') + 1) + "\n";
      continue;
    }
    const auto& operand = nodes[s.operand_node];
    text += std::string(s.kind == plan_step_kind::combine_max ? "all_reduce(max)" : step_name(s.move.kind)) + " over " +
            std::string(s.move.axis) + " for " + std::string(s.op) + (s.kind == plan_step_kind::redistribute
                                                                           ? " operand " + std::to_string(s.operand) + " (" +
                                                                                 operand.text + ")"
                                                                           : std::string()) +
            ": " + detail::to_string(s.move.before) + " -> " + detail::to_string(s.move.after);
    if constexpr (node_t::distributed) {
      const auto& data = s.kind == plan_step_kind::combine_max ? facts : operand;
      text += ", " + std::to_string(detail::bytes_sent(*mesh, s.move, data.shape, data.element_size)) + " bytes sent per place";
    }
    text += "\n";
  }
  if (plan.size == 0) text += "  (nothing to compute: the result is the operand)\n";
  return text;
}

/// @brief Rejects at compile time what is not an expression (a tensor or dtensor itself, a
/// pdo::var): one error.
template <class X>
  requires(!tensor_expression<std::remove_cvref_t<X>>)
std::string explain(const X&) {
  static_assert(detail::always_false<X>,
                "pdo: explain: pass an expression (an op applied to tensors or dtensors; for a pdo::var, its value())");
  return {};
}

}  // namespace pdo
