// pdo/autograd/parallel_do.hpp: parallel_do over pdo::var operands, differentiable: each
// place records its block's graph, and backward runs the blocks' backward on every place and
// merges each operand's gradient by its layout.
#pragma once

#include <pdo/autograd/variable.hpp>
#include <pdo/exec/parallel_do.hpp>
#include <pdo/layout/layout_type.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

namespace pdo {

namespace detail {

/// @brief What a differentiable block receives for one argument: a var over a dtensor
/// becomes a var over the place's shard (a leaf of the place's graph, needing a gradient
/// when the operand does); a dtensor, its shard; anything else, itself.
template <class Arg>
struct block_argument {
  using type = local_view_t<Arg>;
};
template <class T, std::size_t R, class M, class L>
struct block_argument<var<dtensor<T, R, M, L>>> {
  using type = var<tensor<T, R>>;
};
template <class Arg>
using block_argument_t = typename block_argument<Arg>::type;

template <class Arg>
block_argument_t<Arg> block_argument_of(const Arg& arg, std::size_t p) {
  if constexpr (is_distributed_var_v<Arg>) return block_argument_t<Arg>(arg.value().shard(p), arg.requires_grad());
  else return local_view(arg, p);
}

/// @brief An operand as the checks see it: the dtensor a var holds, or the argument itself.
template <class Arg>
using operand_holder_t = std::remove_cvref_t<decltype(unwrap_var<is_distributed_var_v<Arg>>(std::declval<const Arg&>()))>;

/// @brief An operand's layout type (a dtensor's, or the dtensor's a var holds), or void.
template <class Arg>
using operand_layout_t = typename argument_layout<operand_holder_t<Arg>>::type;

/// @brief The layout of the gradients the places compute for an operand laid out as
/// `Layout`: its split dims as they are, and a pending sum over every mesh axis that no dim
/// splits (the places along such an axis hold replicas, each used by its own block).
template <class Mesh, class Layout>
struct replica_gradient_layout {
  static constexpr layout_value value = [] {
    layout_value v = value_of<typename Layout::base>();
    for (std::size_t a = 0; a < Mesh::ndim; ++a) {
      bool splits = false;
      for (std::size_t d = 0; d < v.rank; ++d) splits = splits || v.dim_axis[d] == Mesh::axis_names[a];
      if (!splits) v.partial[v.npartial++] = Mesh::axis_names[a];
    }
    return v;
  }();
};

/// @brief How many places hold each value of a dtensor laid out as `v` on `m`: the product
/// of the extents of the axes it is neither split nor partial over.
template <class Mesh>
std::size_t replica_count(const Mesh& m, const layout_value& v) {
  std::size_t n = 1;
  for (std::size_t a = 0; a < Mesh::ndim; ++a)
    if (!uses_axis(v, Mesh::axis_names[a])) n *= m.extent(a);
  return n;
}

/// @brief A block's result on one place as a var over a local tensor: a var as it is; a
/// tensor or an expression (of values that need no gradient), evaluated, as a constant.
template <class R>
auto as_block_result(R&& r) {
  using plain = std::remove_cvref_t<R>;
  if constexpr (is_var_v<plain>) {
    static_assert(!value_kind<typename plain::value_type>::distributed,
                  "pdo: parallel_do: a block returns its place's part of the result, a pdo::var over a local tensor, not over a dtensor");
    return plain(std::forward<R>(r));
  } else {
    static_assert(is_block_part<plain>(),
                  "pdo: parallel_do: the block must return a pdo::var over a local tensor, a pdo::tensor or an expression of local "
                  "tensors (its place's part of the result)");
    auto t = as_block_part(std::forward<R>(r));
    return var<decltype(t)>(std::move(t));
  }
}

/// @brief What one place keeps of an argument for backward: the leaf it made of a var over a
/// dtensor; nothing of the others.
template <class Arg>
using block_leaf_t = std::conditional_t<is_distributed_var_v<Arg>, block_argument_t<Arg>, std::monostate>;

/// @brief What one place recorded in forward: the leaves it made of the operands that are
/// vars over dtensors, and its result.
template <class Out, class... Args>
struct block_tape {
  std::tuple<block_leaf_t<Args>...> leaves;
  Out out;
};

/// @brief Keeps, in a place's tape, the leaves it made of the operands that are vars over dtensors.
template <class... Args, class Leaves, class Arguments, std::size_t... I>
void keep_leaves(Leaves& leaves, const Arguments& arguments, std::index_sequence<I...>) {
  (
      [&] {
        if constexpr (is_distributed_var_v<std::tuple_element_t<I, std::tuple<Args...>>>) std::get<I>(leaves) = std::get<I>(arguments);
      }(),
      ...);
}

/// @brief What backward keeps of an operand: a var over a dtensor (a handle); nothing of the others.
template <class Arg>
auto kept_operand(const Arg& arg) {
  if constexpr (is_distributed_var_v<Arg>) return arg;
  else return std::monostate{};
}

template <class Arg>
void add_input(const Arg& arg, std::vector<std::shared_ptr<grad_node>>& inputs) {
  if constexpr (is_distributed_var_v<Arg>)
    if (arg.requires_grad()) inputs.push_back(arg.graph_node());
}

/// @brief Adds to `inputs` (once each: `seen` holds the nodes met so far, over every place's
/// graph, and the inputs already there) the nodes made before `first` that the graph of a
/// place's block result `out` uses: the values the block captured (parameters, or values
/// computed from them). They are the boundary of the place's backward (see
/// detail::backward_pass), and inputs of the parallel_do's node, so that the outer backward
/// passes their gradients on once every place has added to them.
PDO_NOINLINE inline void add_captured(const std::shared_ptr<grad_node>& out, std::uint64_t first,
                                      std::vector<std::shared_ptr<grad_node>>& inputs, std::unordered_set<const grad_node*>& seen) {
  std::vector<const std::shared_ptr<grad_node>*> stack{&out};
  while (!stack.empty()) {
    const std::shared_ptr<grad_node>& n = *stack.back();
    stack.pop_back();
    if (!seen.insert(n.get()).second) continue;
    if (n->order < first) {
      inputs.push_back(n);
      continue;
    }
    for (const auto& in : n->inputs) stack.push_back(&in);
  }
}

/// @brief Adds to operand `I`'s gradient (if it is a var over a dtensor that needs one) the
/// gradients the places computed for their blocks, merged by the operand's layout: the
/// places' blocks form a dtensor that is partial over every axis the operand is replicated
/// on, which the planner's redistribution reduces to the gradient's layout.
template <std::size_t I, class Mesh, class Tapes, class Operands>
void merge_operand_gradient(const Mesh& m, const Tapes& tapes, const Operands& operands) {
  using operand_t = std::tuple_element_t<I, Operands>;
  if constexpr (is_distributed_var_v<operand_t>) {
    const operand_t& arg = std::get<I>(operands);
    if (!arg.requires_grad()) return;
    using value_t = typename operand_t::value_type;
    using U = typename value_t::value_type;
    constexpr std::size_t r = value_t::rank;
    using grad_layout = layout_type_t<Mesh, replica_gradient_layout<Mesh, typename value_t::layout_type>>;
    std::vector<tensor<U, r>> blocks;
    blocks.reserve(tapes.size());
    for (std::size_t k = 0; k < tapes.size(); ++k) {
      const auto& leaf = std::get<I>(tapes[k]->leaves);
      blocks.push_back(leaf.has_grad() ? leaf.grad() : tensor<U, r>(leaf.shape(), m.place(m.local_places()[k])));
    }
    dtensor<U, r, Mesh, grad_layout> places_grads(m, arg.shape(), std::move(blocks));
    using target_t = grad_t<value_t>;
    if constexpr (std::is_same_v<decltype(places_grads), target_t>) arg.node()->accumulate(std::move(places_grads));
    else arg.node()->accumulate(redistribute<typename target_t::layout_type>(places_grads));
  }
}

template <class Mesh, class Tapes, class Operands, std::size_t... I>
void merge_operand_gradients(const Mesh& m, const Tapes& tapes, const Operands& operands, std::index_sequence<I...>) {
  (merge_operand_gradient<I>(m, tapes, operands), ...);
}

}  // namespace detail

/// @brief parallel_do over `pdo::var` operands: runs `block` on every place at once, and
/// records it for pdo::backward. Each var over a dtensor arrives in the block as a var over
/// its place's shard (each place records its own graph); a plain dtensor as its shard; any
/// other argument as it is. The block returns a var over a local tensor (or an expression),
/// its place's part of the result; the parts are merged as `OutLayout` says, into a var
/// over the merged dtensor.
///
/// pdo::backward through it splits the output's gradient by `OutLayout`, runs the block's
/// backward on every place (as tasks on the places' lanes, at once; places that hold copies
/// of one value, along an axis the output is replicated on, share its gradient), and merges each
/// operand's gradient by that operand's layout: a split operand gets its shards' gradients;
/// a replicated one (used by every place's block) gets the sum of the places' gradients,
/// the `partial` gradient the planner reduces (an all_reduce). Vars the block captured (its
/// parameters, or values computed from them outside the block) collect the gradients of
/// every place's use, and backward goes on from them once: a parameter's on_gradient hook
/// fires once, with the complete gradient.
template <layout_spec OutLayout, class Block, class... Args>
  requires(detail::is_distributed_var_v<Args> || ...)
auto parallel_do(Block&& block, const Args&... args) {
  using part_t = decltype(detail::as_block_result(std::declval<std::invoke_result_t<Block&, detail::block_argument_t<Args>...>>()));
  using local_t = typename part_t::value_type;
  using T = typename local_t::value_type;
  constexpr std::size_t rank = local_t::rank;
  const auto& m = detail::first_dtensor(detail::unwrap_var<detail::is_distributed_var_v<Args>>(args)...).mesh();
  using mesh_t = std::remove_cvref_t<decltype(m)>;
  using merged_t = dtensor<T, rank, mesh_t, OutLayout>;
  // each check's error is given once, with nothing instantiated after it (an empty var of
  // the type the result would most likely have had stands for the result)
  using unformed_t = var<detail::replicated_dtensor_t<T, OutLayout::rank, mesh_t>>;
  if constexpr (!detail::check_layout<"parallel_do", OutLayout, mesh_t, rank>::ok) {
    return unformed_t{};
  } else if constexpr (!detail::check_one_mesh_type<mesh_t, detail::operand_holder_t<Args>...>::ok) {
    return unformed_t{};
  } else if constexpr (!detail::check_parts_mergeable<OutLayout, detail::operand_layout_t<Args>...>::ok) {
    return unformed_t{};
  } else {
    (detail::check_same_mesh(detail::unwrap_var<detail::is_distributed_var_v<Args>>(args), m), ...);

    using tape_t = detail::block_tape<part_t, Args...>;
    auto tapes = std::make_shared<std::vector<std::optional<tape_t>>>(m.local_places().size());
    // the nodes the blocks make come after this one; those made before are what they captured
    const std::uint64_t first = detail::grad_node::next_order();
    merged_t merged = detail::merge_parts<OutLayout>(m, [&](std::size_t p, std::size_t k) -> local_t {
      tape_t& tape = (*tapes)[k].emplace();
      std::tuple<detail::block_argument_t<Args>...> arguments(detail::block_argument_of(args, p)...);
      detail::keep_leaves<Args...>(tape.leaves, arguments, std::index_sequence_for<Args...>{});
      tape.out = detail::as_block_result(detail::checked_block_call(block, arguments));
      return tape.out.value();
    }, [&](std::size_t, std::size_t k) { return detail::shards_read(k, detail::unwrap_var<detail::is_distributed_var_v<Args>>(args)...); });

    bool needs_grad = false;
    for (const auto& t : *tapes) needs_grad = needs_grad || t->out.requires_grad();
    if (!needs_grad) return var<merged_t>(std::move(merged));

    // the graph's inputs: the operands that need a gradient, and what the blocks captured
    // that needs one (a parameter, a value computed from one): the places' backward passes
    // add to their gradients, and the outer backward passes them on once all have
    std::vector<std::shared_ptr<detail::grad_node>> inputs;
    (detail::add_input(args, inputs), ...);
    std::unordered_set<const detail::grad_node*> seen;
    for (const auto& n : inputs) seen.insert(n.get());
    for (const auto& t : *tapes)
      if (t->out.requires_grad()) detail::add_captured(t->out.graph_node(), first, inputs, seen);
    var<merged_t> out(new detail::value_node<merged_t>(std::move(merged), std::move(inputs)), true);
    out.node()->backward = [tapes, m, first, operands = std::make_tuple(detail::kept_operand(args)...)](detail::value_node<merged_t>& self) {
      const detail::grad_t<merged_t>& g = *self.grad;
      // every place's backward at once, from its part of the output's gradient; the places
      // along an axis the output is replicated on computed one value n times, and share its
      // gradient: each takes 1/n of it (the gradients are summed below)
      const std::size_t copies = detail::replica_count(m, detail::value_of<OutLayout>());
      detail::run_on_places("parallel_do backward", m, [&](std::size_t, std::size_t k) {
        auto& tape = *(*tapes)[k];
        if (!tape.out.requires_grad()) return;
        if (copies == 1) detail::backward_within(tape.out, tensor<T, rank>(g.local_shards()[k]), first);
        else detail::backward_within(tape.out, pdo::eval(g.local_shards()[k] * (T(1) / static_cast<T>(copies))), first);
      });
      detail::merge_operand_gradients(m, *tapes, operands, std::index_sequence_for<Args...>{});
      for (auto& t : *tapes) t.reset();  // the places' graphs are spent
    };
    return out;
  }
}

}  // namespace pdo
