// pdo/exec/eval.hpp: evaluating expressions: at once (eval) or queued on the places (eval_async, wait_all).
#pragma once

#include <pdo/exec/run_on_places.hpp>
#include <pdo/expr/operators.hpp>
#include <pdo/plan/plan.hpp>

#include <cstddef>
#include <exception>
#include <memory>
#include <tuple>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief An evaluation queued on the places of a mesh: its tasks, and how to name it in
/// an error (built only when one is thrown).
struct queued_evaluation {
  std::shared_ptr<place_batch> batch;
  virtual ~queued_evaluation() = default;
  [[nodiscard]] virtual std::string what() const = 0;
  [[nodiscard]] virtual std::string place_name(std::size_t p) const = 0;

  /// @brief Waits for every task; throws the first failure as a pdo::error naming the op and place.
  void finish() const {
    batch->wait();
    if (const auto failure = batch->first_failure())
      failure->error.rethrow_with_context(what() + ": on place " + place_name(failure->place) + ": ");
  }
};

/// @brief What an evaluation shares with the tasks it queued: the expression (its leaves
/// refer to the caller's tensors) and the result, whose shards the tasks fill.
template <class Node, class Result>
struct evaluation final : queued_evaluation {
  evaluation(Node e, Result r) : expr(std::move(e)), result(std::move(r)) {}
  Node expr;
  Result result;
  [[nodiscard]] std::string what() const override {
    return "eval of " + std::string(Node::name) + " -> " + describe_node(expr);
  }
  [[nodiscard]] std::string place_name(std::size_t p) const override { return result.mesh().place(p).name(); }
};

/// @brief The evaluations this thread queued with eval_async and has not waited for: what
/// its wait_all waits for (another thread's wait_all waits for that thread's own).
inline std::vector<std::shared_ptr<const queued_evaluation>>& pending_evaluations() {
  thread_local std::vector<std::shared_ptr<const queued_evaluation>> pending;
  return pending;
}

/// @brief The shards of the dtensor leaves of `node` on place `k` of this process, for the
/// engine: what the evaluation's task on that place reads.
template <class Node>
void add_shard_reads(const Node& node, std::size_t k, std::vector<const void*>& reads) {
  if constexpr (Node::is_leaf) {
    if constexpr (Node::distributed) reads.push_back(node.value().local_shards()[k].data());
  } else {
    std::apply([&](const auto&... c) { (add_shard_reads(c, k, reads), ...); }, node.children());
  }
}

/// @brief Allocates the result's shards and queues the evaluation of `expr` on every
/// place of its mesh in this process.
template <class Policy, class Expr>
auto queue_evaluation(Expr&& expr) {
  using node_t = expression_t<Expr>;
  static_assert(node_t::distributed,
                "pdo: eval_async: the expression has no dtensor operand; evaluate local tensors with pdo::eval");
  check_policy<Policy, node_t>();
  using T = typename node_t::value_type;
  using mesh_t = typename node_t::mesh_type;
  using result_t = dtensor<T, node_t::rank, mesh_t, result_layout_t<node_t>>;
  constexpr std::size_t collectives = plan_of<node_t>().collectives();

  check_not_nested("eval");
  node_t node = as_expression(std::forward<Expr>(expr));
  const mesh_t& m = *find_mesh(node);
  check_one_mesh(node, m);
  comms_of(m);  // built by every process, those without places too
  if (m.local_places().empty()) throw layout_error("eval: this process holds no place of " + m.describe());
  const auto global = node.shape();
  checked_volume(global, node_t::name, sizeof(T));
  std::vector<tensor<T, node_t::rank>> shards;
  shards.reserve(m.local_places().size());
  for (std::size_t p : m.local_places()) shards.emplace_back(shard_shape(m, node_t::rule.out, global, p), m.place(p), uninitialized);
  auto state = std::make_shared<evaluation<node_t, result_t>>(std::move(node), result_t(m, global, std::move(shards)));
  state->batch = submit_on_places(
      m,
      [raw = state.get()](std::size_t p, std::size_t k) {
        mesh_context<mesh_t> ctx(raw->result.mesh(), p);
        detail::run_node(raw->expr, ctx, raw->result.local_shards()[k]);
      },
      batch_options{"eval", "kernel", collectives > 0, collectives > 0 && !m.is_multiprocess()},
      [raw = state.get()](std::size_t, std::size_t k) {
        access uses;
        add_shard_reads(raw->expr, k, uses.reads);
        uses.writes.push_back(raw->result.local_shards()[k].data());
        return uses;
      },
      [raw = state.get()] { return raw->what() + ": " + raw->result.describe(); });
  return state;
}

}  // namespace detail

/// @brief The result of pdo::eval_async: a dtensor whose shards its places fill in the
/// order they run their queued work. The dtensor may be used at once in further
/// expressions (each place reads its shard after writing it); read it on the host after
/// wait() or get(). The operands must stay alive until then.
template <class DTensor>
class async_result {
 public:
  using value_type = DTensor;
  using async_result_tag = void;

  async_result(std::shared_ptr<const detail::queued_evaluation> state, DTensor* result)
      : state_(std::move(state)), result_(result) {}

  /// @brief The result, possibly still being computed by its places. Used as an operand
  /// (`pdo::exp(r)`), an async_result keeps its evaluation alive until the expression is done.
  [[nodiscard]] const DTensor& value() const { return *result_; }
  /// @brief The result, sharing ownership of the evaluation that computes it.
  [[nodiscard]] std::shared_ptr<const DTensor> shared_value() const { return {state_, result_}; }
  /// @brief Whether every place has finished.
  [[nodiscard]] bool ready() const { return state_->batch->finished(); }
  /// @brief Waits for every place; throws the first failure (a pdo::error naming the op and
  /// place; an evaluation that needed the result of one that failed is cancelled with that
  /// failure). pdo::wait_all of the thread that queued it no longer waits for it.
  void wait() const {
    std::erase_if(detail::pending_evaluations(), [&](const auto& e) { return e.get() == state_.get(); });
    state_->finish();
  }
  /// @brief Waits, then gives (a copy of) the result.
  [[nodiscard]] DTensor get() const& {
    wait();
    return *result_;
  }
  /// @brief Waits, then gives the result itself.
  [[nodiscard]] DTensor get() && {
    wait();
    return std::move(*result_);
  }

 private:
  std::shared_ptr<const detail::queued_evaluation> state_;
  DTensor* result_;
};

/// @brief Queues the evaluation of a dtensor expression on every place of its mesh and
/// returns at once. Each place's part waits for the parts that write the shards it reads
/// (the engine orders them), so an expression may use the value of an earlier
/// async_result; independent work runs at the same time. Errors surface at wait(), get()
/// or pdo::wait_all() of the thread that queued it.
/// @tparam Policy pdo::implicit (default) or pdo::strict
template <class Policy = implicit, class Expr>
  requires detail::tensor_operand<Expr>
auto eval_async(Expr&& expr) {
  auto state = detail::queue_evaluation<Policy>(std::forward<Expr>(expr));
  detail::pending_evaluations().push_back(state);
  return async_result<std::remove_cvref_t<decltype(state->result)>>(state, &state->result);
}

/// @brief Waits for every evaluation that the calling thread queued with pdo::eval_async
/// and has not waited for (those of other threads are theirs to wait for); throws the first
/// failure among them (a pdo::error naming the op and place).
inline void wait_all() {
  std::vector<std::shared_ptr<const detail::queued_evaluation>> pending;
  pending.swap(detail::pending_evaluations());
  std::exception_ptr first;
  for (const auto& e : pending) {
    try {
      e->finish();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

/// @brief Evaluates an expression. Over dtensors: on every place of the mesh at once, with
/// the communication the plan calls for, giving a dtensor in the planned layout
/// (`pdo::result_layout_t<Expr>`). Over local tensors (on the host, or inside a
/// parallel_do block on that place's cores; on a GPU's place when they live in its memory,
/// from any thread): a pdo::tensor. Elementwise chains run as
/// one kernel that writes the result and allocates nothing else.
/// @tparam Policy pdo::implicit (default) or pdo::strict
template <class Policy = implicit, class Expr>
  requires detail::tensor_operand<Expr>
auto eval(Expr&& expr) {
  using node_t = detail::expression_t<Expr>;
  if constexpr (node_t::distributed) {  // queue_evaluation checks the policy
    const auto state = detail::queue_evaluation<Policy>(std::forward<Expr>(expr));
    state->finish();
    return std::move(state->result);
  } else {
    detail::check_policy<Policy, node_t>();
    // not const: for a const variable nvcc's front end first tries constant initialization,
    // through every level of the expression's type, in time that grows fourfold a level
    node_t node = detail::as_expression(std::forward<Expr>(expr));
    // the kernels run where the operands are: on their GPU's place (on its compute lane), or
    // over host memory on the calling thread
    if (detail::place_state* const gpu = detail::local_home(node); gpu != nullptr) {
      return detail::run_on_place(*gpu, [&] {
        detail::local_context ctx;
        return detail::materialize(node, ctx);
      });
    }
    detail::local_context ctx(detail::on_gpu(detail::current_place()));
    return detail::materialize(node, ctx);
  }
}

}  // namespace pdo
