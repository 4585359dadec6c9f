// pdo/exec/eval.hpp: evaluating expressions: at once (eval) or queued on the places (eval_async, wait_all).
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/owned.hpp>
#include <pdo/exec/run_on_places.hpp>
#include <pdo/exec/run_plan.hpp>
#include <pdo/expr/operators.hpp>
#include <pdo/plan/explain.hpp>
#include <pdo/plan/plan.hpp>

#include <atomic>
#include <cstddef>
#include <exception>
#include <memory>
#include <tuple>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief What evaluating the expression node `Node` gives when it is not well formed (its
/// error was given where it was made): a value of the type it would most likely have had
/// (its element type and rank; on its mesh, replicated), so that the program's uses of the
/// result report nothing more.
template <class Node, bool = Node::distributed>
struct unformed_value {
  using type = tensor<typename Node::value_type, Node::rank>;
};
template <class Node>
struct unformed_value<Node, true> {
  using type = replicated_dtensor_t<typename Node::value_type, Node::rank, typename Node::mesh_type>;
};
template <class Node>
using unformed_value_t = typename unformed_value<Node>::type;

/// @brief An evaluation queued on the places of a mesh: the tasks of each step of its plan,
/// in the plan's order, and how to name it in an error (built only when one is thrown).
/// What does not depend on the expression's type lives here, compiled once, not once per
/// expression.
struct queued_evaluation {
  std::vector<std::shared_ptr<place_batch>> steps;
  /// @brief The addresses the runs' tasks write, taken when they are queued: the result may
  /// have been moved out (and freed) by the time the evaluation is.
  std::vector<const void*> written;
  /// @brief The mesh the evaluation runs on (its places name the failures).
  std::shared_ptr<const mesh_state> mesh;
  mesh_comms* comms = nullptr;
  /// @brief Whether a wait() or get() of its result, on any thread, has been called: the
  /// wait_all() of the thread that queued it then waits for it without throwing its
  /// failure again.
  mutable std::atomic<bool> waited{false};
  [[nodiscard]] virtual std::string what() const = 0;

  /// @brief Waits for every task, ignoring failures (before the evaluation is freed).
  void finish_quietly() const noexcept {
    for (const auto& b : steps)
      for (const auto& t : b->tasks) t->wait_ended();
  }
  /// @brief Whether every task of every step has ended.
  [[nodiscard]] bool finished() const {
    for (const auto& b : steps)
      if (!b->finished()) return false;
    return true;
  }
  /// @brief Waits for every task; throws the failure of the first step that failed (the
  /// later ones were cancelled by it) as a pdo::error naming the op and place.
  void finish() const {
    for (const auto& b : steps) b->wait();
    for (const auto& b : steps)
      if (const auto failure = b->first_failure())
        rethrow_on_place(*mesh, *failure, what());
  }

  /// @brief Queues one step of the plan on every place of the mesh in this process: a kernel
  /// on the compute lanes, a collective on the communication lanes.
  PDO_NOINLINE void queue(const char* op, bool collective, bool caller_waits, place_work work, place_access uses, place_detail detail) {
    const batch_options o{.op = op,
                          .category = collective ? "collective" : "kernel",
                          .communicate = collective,
                          .closing = collective,
                          .lane = collective ? lane_kind::communication : lane_kind::compute,
                          .caller_waits = caller_waits,
                          .ends_job = true,
                          .keeps_failure = true};
    steps.push_back(submit_on_mesh(*mesh, *comms, work, nullptr, o, uses, detail));
  }

 protected:
  // Not virtual: an evaluation is owned through own_as, whose deleter destroys it as
  // what it is (a virtual destructor would add a deleting one to every evaluation's code).
  ~queued_evaluation() = default;
  /// @brief Notes the mesh and its communicators, and room for the addresses written.
  PDO_NOINLINE void start(std::shared_ptr<const mesh_state> m, mesh_comms& c, std::size_t writes) {
    mesh = std::move(m);
    comms = &c;
    written.reserve(writes);
  }
  /// @brief "eval of matmul -> f32[8, 4]{split<dp>, replicate}".
  PDO_NOINLINE static std::string describe_evaluation(std::string_view op, const std::string& result) {
    return "eval of " + std::string(op) + " -> " + result;
  }
  /// @brief Its tasks have ended (the derived evaluation frees each place's run after this).
  /// When one failed, the engine forgets the buffers they wrote, so storage allocated there
  /// later is not taken for the result of a failed task (a writer that succeeded holds
  /// nothing up once it has ended).
  PDO_NOINLINE void end() noexcept {
    finish_quietly();
    bool failed = false;
    for (const auto& b : steps)
      for (const auto& f : b->failures) failed = failed || f.has_value();
    if (failed) engine::instance().forget(written);
  }
};

/// @brief What an evaluation shares with the tasks it queued: the expression (its leaves
/// refer to the caller's tensors), the result, whose shards the tasks fill, and each local
/// place's run of the plan.
template <class Node, class Result>
struct evaluation final : queued_evaluation {
  using mesh_t = typename Node::mesh_type;
  using run_t = plan_run<Node, mesh_context<mesh_t>>;
  evaluation(Node e, Result r, mesh_comms& c)
      : expr(std::move(e)), result(std::move(r)), run_count(result.local_shards().size()), runs(run_count) {
    // a shard for each place of this process (result_shards made them)
    const mesh_t& m = result.mesh();
    start(m.state(), c, run_count * (run_t::nodes + 1));
    const auto& local = mesh->local;
    for (std::size_t k = 0; k < run_count; ++k) {
      runs[k].bind(expr, mesh_context<mesh_t>(m, local[k]), result.local_shards()[k]);
      runs[k].add_written(written);
    }
  }
  evaluation(const evaluation&) = delete;
  evaluation& operator=(const evaluation&) = delete;
  ~evaluation() { end(); }
  Node expr;
  Result result;
  std::size_t run_count;
  /// @brief One run per local place, referring to expr and result.
  owned_array<run_t> runs;
  [[nodiscard]] std::string what() const override { return describe_evaluation(Node::name, describe_node(expr)); }
};

/// @brief The trace's detail of step `S` of `Node`'s plan (built only while tracing).
template <class Node, std::size_t S, class Mesh>
std::string step_detail(const Node& root, const Mesh& m) {
  constexpr plan_step step = plan_run<Node, mesh_context<Mesh>>::plan.steps[S];
  if constexpr (step.kind == plan_step_kind::kernel) {
    return describe_node(node_numbered<step.node>(root));
  } else {
    constexpr std::size_t data = step.kind == plan_step_kind::redistribute ? step.operand_node : step.node;
    const auto& node = node_numbered<data>(root);
    const auto shape = node.shape();
    const std::vector<std::size_t> extents(shape.begin(), shape.end());
    const std::size_t bytes = bytes_sent(m, step.move, extents, sizeof(typename std::remove_cvref_t<decltype(node)>::value_type));
    return std::string(step.kind == plan_step_kind::combine_max ? "all_reduce(max)" : step_name(step.move.kind)) + " over " +
           std::string(step.move.axis) + " of " + describe_node(node) + ", " + std::to_string(bytes) + " bytes sent per place";
  }
}

/// @brief Queues step `S` of the plan of `state`'s expression on every place of its mesh in
/// this process: a kernel on the compute lanes; a collective on the communication lanes.
template <std::size_t S, class State>
void queue_step(State* state, bool caller_waits) {
  using node_t = std::remove_cvref_t<decltype(state->expr)>;
  constexpr plan_step step = State::run_t::plan.steps[S];
  if constexpr (step.kind == plan_step_kind::kernel && step.fused) {
    return;  // runs inside the kernel of the op that reads it
  } else {
    constexpr bool collective = step.kind == plan_step_kind::combine_max ||
                                (step.kind == plan_step_kind::redistribute && communicates(step.move.kind));
    // plain functions of the evaluation: the tasks share the submission path of every operation
    state->queue(step.op.data(), collective, caller_waits,
                 place_work{[](void* s, std::size_t, std::size_t k) { static_cast<State*>(s)->runs[k].template run_step<S>(); }, state},
                 place_access{[](const void* s, std::size_t, std::size_t k) { return static_cast<const State*>(s)->runs[k].template uses<S>(); },
                              state},
                 place_detail{[](const void* s) {
                                const auto& e = *static_cast<const State*>(s);
                                return step_detail<node_t, S>(e.expr, e.result.mesh());
                              },
                              state});
  }
}

/// @brief Queues the copy that evaluates an expression that is a dtensor.
template <class State>
void queue_copy(State* state, bool caller_waits) {
  const place_work work{[](void* s, std::size_t, std::size_t k) { static_cast<State*>(s)->runs[k].copy_leaf(); }, state};
  const place_access uses{[](const void* s, std::size_t, std::size_t k) { return static_cast<const State*>(s)->runs[k].copy_uses(); },
                          state};
  state->steps.push_back(submit_on_mesh(*state->mesh, *state->comms, work, nullptr,
                                        batch_options{.op = "copy",
                                                      .category = "copy",
                                                      .communicate = false,
                                                      .caller_waits = caller_waits,
                                                      .ends_job = true,
                                                      .keeps_failure = true},
                                        uses));
}

/// @brief The error being handled (a place's memory full, say), again as an error of `caller`
/// ("eval", "eval_async") of `op` allocating its result, described by `result`.
[[noreturn]] PDO_NOINLINE inline void rethrow_result_failure(const char* caller, std::string_view op, const std::string& result) {
  captured_error::current().rethrow_with_context(std::string(caller) + " of " + std::string(op) + ": its result " + result + ": ");
}

/// @brief The shards of the result of an evaluation on `m`, of shape `global` laid out as
/// `out`, one for each place of this process, allocated in its memory (uninitialized). A
/// failure (a place's memory full, say) is an error of `caller` ("eval", "eval_async") of `op`.
template <class T, std::size_t Rank, class Mesh>
PDO_NOINLINE std::vector<tensor<T, Rank>> result_shards(const Mesh& m, const layout_value& out, const shape_t<Rank>& global,
                                                        std::string_view op, const char* caller) {
  if (m.local_places().empty()) throw_no_local_places(std::string(caller) + " of " + std::string(op), m.describe());
  checked_volume(global, op, sizeof(T));
  std::vector<tensor<T, Rank>> shards;
  shards.reserve(m.local_places().size());
  try {
    for (std::size_t p : m.local_places()) shards.emplace_back(shard_shape(m, out, global, p), m.place(p), uninitialized);
  } catch (const error&) {
    rethrow_result_failure(caller, op, describe_dtensor<T>(m, out, global));
  }
  return shards;
}

/// @brief Evaluates the local expression `node` where `ctx` says, into a new tensor (a failure
/// to allocate it is an error of eval of the node's op, naming the result).
template <class Node>
PDO_NOINLINE tensor<typename Node::value_type, Node::rank> run_local(const Node& node, local_context ctx) {
  using T = typename Node::value_type;
  checked_volume(node.shape(), Node::name, sizeof(T));
  tensor<T, Node::rank> out;
  try {
    out = ctx.template allocate<T>(node.shape());
  } catch (const error&) {
    rethrow_result_failure("eval", Node::name, describe_block(dtype_name<T>(), node.shape(), nullptr));
  }
  plan_run<Node, local_context>(node, ctx, out).run_all();
  return out;
}

/// @brief The evaluations this thread queued with eval_async and has not waited for: what
/// its wait_all waits for (another thread's wait_all waits for that thread's own).
inline std::vector<std::shared_ptr<const queued_evaluation>>& pending_evaluations() {
  thread_local std::vector<std::shared_ptr<const queued_evaluation>> pending;
  return pending;
}

/// @brief Notes `e`, just queued by eval_async, among those the calling thread's wait_all
/// waits for; those another thread has waited for, and that have ended, need it no more.
PDO_NOINLINE inline void note_pending(std::shared_ptr<const queued_evaluation> e) {
  auto& pending = pending_evaluations();
  std::erase_if(pending, [](const auto& p) { return p->waited.load(std::memory_order_acquire) && p->finished(); });
  pending.push_back(std::move(e));
}

/// @brief What async_result::wait does, for every result type: notes that `e` was waited
/// for, takes it out of the calling thread's list, then waits for it (throwing its failure).
PDO_NOINLINE inline void wait_for_evaluation(const queued_evaluation& e) {
  e.waited.store(true, std::memory_order_release);
  std::erase_if(pending_evaluations(), [&](const auto& p) { return p.get() == &e; });
  e.finish();
}

/// @brief A queued evaluation, shared by those who wait for it (owned as its base: a
/// shared_ptr to each evaluation type would compile a dozen functions for each expression),
/// and its result.
template <class Result>
struct queued_result {
  std::shared_ptr<const queued_evaluation> state;
  Result* result;
};

/// @brief Allocates the result's shards and queues the steps of the plan of `expr` on every
/// place of its mesh in this process.
template <class Policy, class Expr>
auto queue_evaluation(Expr&& expr, bool caller_waits) {
  using node_t = expression_t<Expr>;
  static_assert(node_t::distributed,
                "pdo: eval_async: the expression has no dtensor operand; evaluate local tensors with pdo::eval");
  check_policy<Policy, node_t>();
  using T = typename node_t::value_type;
  using mesh_t = typename node_t::mesh_type;
  using result_t = dtensor<T, node_t::rank, mesh_t, result_layout_t<node_t>>;
  const char* const caller = caller_waits ? "eval" : "eval_async";
  check_not_nested(caller);
  node_t node = as_expression(std::forward<Expr>(expr));
  const mesh_t& m = *find_mesh(node);
  check_one_mesh(node, m, caller, node_t::name);
  mesh_comms& comms = comms_of(m);  // built by every process, those without places too
  const auto global = node.shape();
  auto shards = result_shards<T>(m, node_t::rule.out, global, node_t::name, caller);
  using state_t = evaluation<node_t, result_t>;
  auto* const state = new state_t(std::move(node), result_t(m, global, std::move(shards)), comms);
  std::shared_ptr<const queued_evaluation> owner = own_as<queued_evaluation>(state);
  if constexpr (node_t::is_leaf) {
    queue_copy(state, caller_waits);
  } else {
    [&]<std::size_t... S>(std::index_sequence<S...>) { (queue_step<S>(state, caller_waits), ...); }(std::make_index_sequence<plan_of<node_t>().size>{});
  }
  return queued_result<result_t>{std::move(owner), &state->result};
}

}  // namespace detail

/// @brief The result of pdo::eval_async: a dtensor whose shards its places fill in the
/// order they run their queued work. The dtensor may be used at once in further
/// expressions (each place reads its shard after writing it), gathered or copied (once its
/// shards are written); read its shards on the host (`local_shards()`) after wait() or get().
/// An operand assigned to or freed before then waits for this work first.
template <class DTensor>
class async_result {
 public:
  /// @brief The result's dtensor type.
  using value_type = DTensor;
  /// @brief Marks this class as an async result: expressions take it as a dtensor operand.
  using async_result_tag = void;

  /// @brief The result `*result`, owned by the queued evaluation `state` (what eval_async returns).
  async_result(std::shared_ptr<const detail::queued_evaluation> state, DTensor* result)
      : state_(std::move(state)), result_(result) {}
  /// @brief Another handle on the same evaluation. An async_result has no move of its own:
  /// moving one copies it, so one moved from can still be waited for.
  async_result(const async_result&) = default;
  /// @brief Makes this a handle on `other`'s evaluation (a move does the same).
  async_result& operator=(const async_result&) = default;
  /// @brief Lets go of the evaluation; pdo::wait_all still waits for it when it was not waited for.
  ~async_result() = default;

  /// @brief The result, possibly still being computed by its places. Used as an operand
  /// (`pdo::exp(r)`), an async_result keeps its evaluation alive until the expression is done.
  [[nodiscard]] const DTensor& value() const { return *result_; }
  /// @brief The result, sharing ownership of the evaluation that computes it.
  [[nodiscard]] std::shared_ptr<const DTensor> shared_value() const { return {state_, result_}; }
  /// @brief Whether every place has finished.
  [[nodiscard]] bool ready() const { return state_->finished(); }
  /// @brief Waits for every place; throws the first failure (a pdo::error naming the op and
  /// place; an evaluation that needed the result of one that failed is cancelled with that
  /// failure). Called on any thread, pdo::wait_all of the thread that queued it then no
  /// longer throws that failure.
  void wait() const { detail::wait_for_evaluation(*state_); }
  /// @brief Waits, then gives (a copy of) the result.
  [[nodiscard]] DTensor get() const& {
    wait();
    return *result_;
  }
  /// @brief Waits, then gives the result itself: this async_result and its copies then hold
  /// an empty dtensor, whose every use is a pdo::error.
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
  if constexpr (!detail::expression_t<Expr>::well_formed) {
    // the operands' error was given where the expression was made: nothing more after it
    using node_t = detail::expression_t<Expr>;
    if constexpr (node_t::distributed) return detail::unformed_result<async_result<detail::unformed_value_t<node_t>>>();
    else return detail::unformed_result<detail::unformed_value_t<node_t>>();
  } else if constexpr (!detail::expression_t<Expr>::distributed) {
    static_assert(detail::always_false<Expr>,
                  "pdo: eval_async: the expression has no dtensor operand; evaluate local tensors with pdo::eval");
    return 0;
  } else {
    auto queued = detail::queue_evaluation<Policy>(std::forward<Expr>(expr), false);
    detail::note_pending(queued.state);
    return async_result<std::remove_cvref_t<decltype(*queued.result)>>(std::move(queued.state), queued.result);
  }
}

/// @brief Waits for every evaluation that the calling thread queued with pdo::eval_async
/// and has not waited for (those of other threads are theirs to wait for); throws the first
/// failure among them (a pdo::error naming the op and place). One whose result's wait() or
/// get() another thread has called is waited for, its failure not thrown again.
inline void wait_all() {
  std::vector<std::shared_ptr<const detail::queued_evaluation>> pending;
  pending.swap(detail::pending_evaluations());
  std::exception_ptr first;
  for (const auto& e : pending) {
    if (e->waited.load(std::memory_order_acquire)) {
      e->finish_quietly();
      continue;
    }
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
  if constexpr (!node_t::well_formed) {
    // the operands' error was given where the expression was made: nothing more after it
    return detail::unformed_result<detail::unformed_value_t<node_t>>();
  } else if constexpr (node_t::distributed) {  // queue_evaluation checks the policy
    const auto queued = detail::queue_evaluation<Policy>(std::forward<Expr>(expr), true);
    queued.state->finish();
    return std::move(*queued.result);
  } else {
    detail::check_policy<Policy, node_t>();
    // not const: for a const variable nvcc's front end first tries constant initialization,
    // through every level of the expression's type, in time that grows fourfold a level
    node_t node = detail::as_expression(std::forward<Expr>(expr));
    // the kernels run where the operands are: on their GPU's place (on its compute lane), or
    // over host memory on the calling thread
    if (detail::place_state* const gpu = detail::local_home(node); gpu != nullptr)
      return detail::run_on_place(*gpu, [&] { return detail::run_local(node, detail::local_context{}); });
    return detail::run_local(node, detail::local_context(detail::on_gpu(detail::current_place())));
  }
}

/// @brief Rejects at compile time what is not a tensor expression (a number, a pdo::var).
template <class Policy = implicit, class Expr>
  requires(!detail::tensor_operand<Expr>)
auto eval(Expr&& expr) {
  static_assert(detail::always_false<Expr>,
                "pdo: eval takes a pdo::tensor, a pdo::dtensor or an expression of them (a pdo::var is computed at once: its "
                "value is var.value())");
  // of the type the call meant (a var's value), so that the line that uses it gives no second error
  if constexpr (requires { expr.value(); }) return detail::unformed_result<std::remove_cvref_t<decltype(expr.value())>>();
  else return detail::unformed_result<std::remove_cvref_t<Expr>>();
}

}  // namespace pdo
