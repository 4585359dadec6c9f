// pdo/exec/run_on_places.hpp: the tasks of one mesh-wide operation, one per place of this
// process, submitted to the engine at one point of its order; how they end.
#pragma once

#include <pdo/comm/mesh_comms.hpp>
#include <pdo/core/error.hpp>
#include <pdo/exec/engine.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(PDO_WITH_MPI)
#include <pdo/comm/mpi/environment.hpp>
#endif

namespace pdo::detail {

/// @brief A failure in the middle of collectives on one process of a multi-process mesh:
/// the other processes are inside MPI calls that wait for this one, and cannot be told.
/// Rather than leave them hanging, the job ends with the error.
[[noreturn]] inline void end_job(const std::string& what) {
  std::fprintf(stderr, "pdo: fatal: %s; the other processes of the mesh cannot go on without this one, ending the job\n",
               what.c_str());
  std::fflush(stderr);
#if defined(PDO_WITH_MPI)
  MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  std::terminate();
}

/// @brief The failure of one place, if any: the first place (in mesh order) whose
/// failure is a cause, not the echo of another place's abort.
struct place_failure {
  std::size_t place = 0;
  captured_error error;
};

/// @brief Throws `failure`, a task's on a place of the mesh `state`, as a pdo::error of
/// `context` (the op, and what it worked on) that names the place.
[[noreturn]] PDO_NOINLINE inline void rethrow_on_place(const mesh_state& state, const place_failure& failure,
                                                       const std::string& context) {
  failure.error.rethrow_with_context(context + ": on place " + state.places[failure.place].name() + ": ");
}

/// @brief How the tasks of one mesh-wide operation take part in the mesh's collectives.
struct batch_options {
  const char* op = "spmd";          ///< a string literal: the trace's name and the errors' first word
  const char* category = "task";    ///< for the trace: "kernel", "collective", "copy", "task"
  /// @brief The tasks run collectives: a failure aborts them in a mesh of this process (so
  /// the others do not wait for it); in a mesh over several processes, a failure the other
  /// processes cannot learn of ends the job (end_job).
  bool communicate = true;
  /// @brief The tasks run the mesh's collectives, each until it ends: a task that ends tells
  /// the others of its groups in this process that it will join no more (mesh_comms::left),
  /// and the last task to end makes the groups usable again (resetting them if a task failed:
  /// an aborted threads group is released; an MPI or NCCL group, which is never aborted, is
  /// left as it is). The operations on a mesh follow each other whole (engine's after_all),
  /// so no task of a later one is inside a collective then.
  bool closing = false;
  /// @brief The lane of each place the tasks run on.
  lane_kind lane = lane_kind::compute;
  /// @brief The caller waits for the tasks at once: the first is queued without waking its
  /// lane, since the caller will run it itself if it can (place_batch::wait).
  bool caller_waits = false;
  /// @brief A step of a program every process runs alike (an evaluation's kernel): in a mesh
  /// over several processes its failure on one process ends the job, as a collective's does
  /// (the other processes go on to the next collective, which waits for this one).
  bool ends_job = false;
  /// @brief The tasks' failures stay with the buffers they write until the caller forgets
  /// them (task_request::keeps_failure).
  bool keeps_failure = false;
};

/// @brief The work of one place in a mesh-wide operation, type-erased: `call(context, p, k)`
/// runs it for mesh place `p`, the `k`-th of this process. A plain function and a pointer, so
/// that every operation shares one submission path (no copy of it per kind of work).
struct place_work {
  void (*call)(void* context, std::size_t p, std::size_t k) = nullptr;
  void* context = nullptr;
};

/// @brief What the tasks of one operation read and write on each place, asked while they are
/// submitted: `call(context, p, k)`, or nothing when `call` is null.
struct place_access {
  access (*call)(const void* context, std::size_t p, std::size_t k) = nullptr;
  const void* context = nullptr;
};

/// @brief The trace's detail of an operation, made only while the timeline records:
/// `call(context)`, or none when `call` is null.
struct place_detail {
  std::string (*call)(const void* context) = nullptr;
  const void* context = nullptr;
};

/// @brief The tasks of one mesh-wide operation, one per place of this process, and how they ended.
struct place_batch {
  explicit place_batch(std::size_t n) : failures(n) {}
  std::vector<task_handle> tasks;
  std::vector<std::size_t> places;                      ///< mesh index of each task's place
  std::vector<std::optional<captured_error>> failures;  ///< per task, once it has ended
  std::atomic<std::size_t> arrived{0};                  ///< tasks done with their work
  std::atomic<std::size_t> done{0};                     ///< tasks done with their work and the mesh's collectives
  place_work work;                                      ///< what each task runs
  std::shared_ptr<void> work_owner;                      ///< keeps work's context alive, when the batch owns it
  mesh_comms* comms = nullptr;                          ///< the mesh's communicators
  bool local_only = true;                               ///< the mesh lies in this process
  bool communicate = true;                              ///< see batch_options
  bool ends_job = false;                                ///< see batch_options
  bool closing = false;                                 ///< see batch_options

  /// @brief Whether every task is done (its results written, its failure recorded).
  [[nodiscard]] bool finished() const { return done.load(std::memory_order_acquire) == failures.size(); }
  /// @brief Waits for every task (a pdo::error at once when that would wait forever):
  /// looks a while, yielding the core, then sleeps.
  void wait() const {
    for (const auto& t : tasks) check_not_own_lane(*t, t->op);
    // a task its lane has not started, and could start now, runs here: no hand-over to its
    // lane's thread and back (the others run on their lanes meanwhile)
    for (const auto& t : tasks)
      if (!t->ended.load(std::memory_order_acquire) && !t->home->run_here(*t)) t->home->poke();
    const std::size_t n = failures.size();
    for (int poll = 0; poll < 200; ++poll) {
      if (done.load(std::memory_order_acquire) == n) return;
      std::this_thread::yield();
    }
    for (std::size_t now = done.load(std::memory_order_acquire); now != n; now = done.load(std::memory_order_acquire))
      done.wait(now, std::memory_order_acquire);
  }
  /// @brief The first failure that is a cause, not an echo of another's (call after wait()).
  [[nodiscard]] std::optional<place_failure> first_failure() const {
    std::optional<place_failure> first;
    for (std::size_t k = 0; k < failures.size(); ++k) {
      if (!failures[k]) continue;
      if (!first || tells_more_than(failures[k]->kind, first->error.kind)) first = place_failure{places[k], *failures[k]};
    }
    return first;
  }

  /// @brief The `k`-th task's work on mesh place `p`, and how it ends: a failure is recorded,
  /// releases the mesh's other places from their collectives (or ends the job when they are
  /// in other processes and cannot learn of it), and reaches the engine.
  void run(std::size_t p, std::size_t k) {
    try {
      if (const captured_error* cause = cancelled_by(); cause != nullptr) cause->rethrow_with_context("");
      work.call(work.context, p, k);
    } catch (...) {
      failures[k] = captured_error::current();
      if (local_only) {
        if (communicate) comms->abort();
      } else if ((communicate || ends_job) && !shared_by_all_members(failures[k]->kind)) {
        end_job(current_place()->name + ": " + failures[k]->message);
      }
    }
    // a task that ended has made all its collectives: the others of its groups in this
    // process, waiting in one or entering one, would wait for it forever (other processes'
    // members are found by MPI's watch)
    if (closing && !failures[k]) comms->left(p);
    if (closing && arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == failures.size()) {
      // the last of the operation's tasks: the others are past their collectives, and no
      // later operation's task starts before this one ends
      bool failed = false;
      for (const auto& f : failures) failed = failed || f.has_value();
      if (failed) comms->reset();
      comms->rejoin();
    }
    // the caller may go on now: nothing below touches the mesh, the caller's task or its results
    done.fetch_add(1, std::memory_order_acq_rel);
    done.notify_all();
    // the engine learns of the failure: the tasks that need this one's results are cancelled
    // (the task holds the batch)
    if (failures[k]) failures[k]->rethrow_with_context("");
  }
};

/// @brief No buffers declared: the tasks are ordered by their lanes only.
struct no_access {
  access operator()(std::size_t, std::size_t) const { return {}; }
};

/// @brief Throws a pdo::error at once when called on a place's lane: a mesh-wide operation
/// started inside a task of that mesh would queue behind the task it runs in.
inline void check_not_nested(const char* op) {
  if (const lane* l = current_lane(); l != nullptr)
    throw layout_error(std::string(op) + ": a mesh-wide operation was started inside a task of place " + l->place_name() + " (its " +
                       lane_name(l->kind()) + " lane); call it from a host thread, not from a parallel_do block or an spmd "
                       "task (inside them, work on the local shards with pdo::eval of local tensors and the communicators)");
}

[[noreturn]] PDO_NOINLINE inline void throw_no_local_places(std::string_view op, const std::string& mesh) {
  throw layout_error(std::string(op) + ": this process holds no place of " + mesh + "; call it on the processes that do");
}

/// @brief Builds the communicators of `m` (every process takes part, those that hold none of
/// its places too), then throws a pdo::layout_error naming `op` when this process holds none
/// of its places: `op` runs on the processes that do.
template <class Mesh>
void check_holds_places(const Mesh& m, const char* op) {
  comms_of(m);
  if (m.local_places().empty()) throw_no_local_places(op, m.describe());
}

[[noreturn]] PDO_NOINLINE inline void throw_other_driver(const mesh_state& state, const char* op) {
  throw error(std::string(op) + ": " + describe_mesh(state) +
              " spans processes, and another host thread of this process issues its operations: the processes pair a "
              "mesh's operations by the order each process issues them, which two threads would not keep (their results "
              "would mix). Issue them from one host thread per process, or make a mesh for each thread that drives one");
}

/// @brief Throws a pdo::error at once when an operation on a mesh over several processes
/// comes from another host thread than the one that issued its first (see mesh_state::driver).
inline void check_driver(const mesh_state& state, const char* op) {
  if (!state.multiprocess) return;
  const std::thread::id me = std::this_thread::get_id();
  std::thread::id first{};
  if (!state.driver.compare_exchange_strong(first, me) && first != me) throw_other_driver(state, op);
}

/// @brief Holds the places of this process of a mesh for one host thread's operation whose
/// tasks queue more work on the places' lanes while they run (a data-parallel step's bucket
/// collectives, a pipeline's sends): what other host threads submit on those places waits
/// until the hold ends, so that on every place it is queued after all of that work, in one
/// order (else one place's communication lane could hold another thread's collective ahead of
/// the step's, and another place behind it: each would wait for the other). Taken before the
/// operation is submitted, once no other thread is submitting on the places.
class place_hold {
 public:
  explicit place_hold(const mesh_state& state) : places_(state.local_in_order) {
    const std::thread::id me = std::this_thread::get_id();
    for (place_state* s : places_) {
      for (std::thread::id free{}; !s->held_by.compare_exchange_strong(free, me); free = {}) s->held_by.wait(free);
      for (int n = s->submitting.load(); n != 0; n = s->submitting.load()) s->submitting.wait(n);
    }
  }
  place_hold(const place_hold&) = delete;
  place_hold& operator=(const place_hold&) = delete;
  ~place_hold() {
    for (place_state* s : places_) {
      s->held_by.store(std::thread::id{});
      s->held_by.notify_all();
    }
  }

 private:
  const std::vector<place_state*>& places_;
};

/// @brief A host thread's submission of one operation on the places of this process of the
/// mesh `state`: it waits while another thread's place_hold holds one of them, and counts
/// itself on each (a hold waits for the submissions under way).
class place_submission {
 public:
  explicit place_submission(const mesh_state& state) : places_(state.local_in_order) {
    const std::thread::id me = std::this_thread::get_id();
    for (std::size_t i = 0; i < places_.size();) {
      place_state* s = places_[i];
      s->submitting.fetch_add(1);
      const std::thread::id holder = s->held_by.load();
      if (holder == std::thread::id{} || holder == me) {
        ++i;
        continue;
      }
      // held by another thread: give back every place taken (its hold may wait for them), wait, start again
      for (std::size_t j = 0; j <= i; ++j) leave(*places_[j]);
      s->held_by.wait(holder);
      i = 0;
    }
  }
  place_submission(const place_submission&) = delete;
  place_submission& operator=(const place_submission&) = delete;
  ~place_submission() {
    for (place_state* s : places_) leave(*s);
  }

 private:
  static void leave(place_state& s) {
    s.submitting.fetch_sub(1);
    s.submitting.notify_all();
  }
  const std::vector<place_state*>& places_;
};

/// @brief Submits `work` for every place of the mesh `state` in this process, on its lane
/// `o.lane`, reading and writing what `uses` says, and returns without waiting. `owner`
/// keeps work's context alive until the tasks are freed (null: the caller keeps it alive).
PDO_NOINLINE inline std::shared_ptr<place_batch> submit_on_mesh(const mesh_state& state, mesh_comms& comms, place_work work,
                                                   std::shared_ptr<void> owner, batch_options o, place_access uses = {},
                                                   place_detail describe = {}) {
  check_not_nested(o.op);
  check_driver(state, o.op);
  const place_submission submission(state);
  const auto& local = state.local;
  auto batch = std::make_shared<place_batch>(local.size());
  batch->places = local;
  batch->work = work;
  batch->work_owner = std::move(owner);
  batch->comms = &comms;
  batch->local_only = !state.multiprocess;
  batch->communicate = o.communicate;
  batch->ends_job = o.ends_job;
  batch->closing = o.closing;
  std::vector<task_request> requests(local.size());
  std::string detail;
  if (describe.call != nullptr && timeline_on()) detail = describe.call(describe.context);
  for (std::size_t k = 0; k < local.size(); ++k) {
    task_request& r = requests[k];
    r.home = &lane_of(*state.places[local[k]].state(), o.lane);
    r.op = o.op;
    r.category = o.category;
    r.detail = detail;
    r.runs_cancelled = true;  // a cancelled task still meets the others of its operation
    r.quiet = o.caller_waits && k == 0;
    r.keeps_failure = o.keeps_failure;
    if (uses.call != nullptr) r.uses = uses.call(uses.context, local[k], k);
    if (o.communicate) r.uses.after_all = &comms;  // operations that communicate on one mesh follow each other whole
    r.fn = [batch, k, p = local[k]] { batch->run(p, k); };
  }
  batch->tasks = engine::instance().submit(requests);
  return batch;
}

/// @brief `access_of(place_index, local_ordinal)` (kept alive by the caller) as the plain
/// function the submission asks; nothing for no_access.
template <class Access>
place_access access_of_places(const Access& access_of) {
  if constexpr (std::is_same_v<Access, no_access>) return {};
  else return {[](const void* c, std::size_t p, std::size_t k) { return access((*static_cast<const Access*>(c))(p, k)); }, &access_of};
}

/// @brief Submits `task(place_index, local_ordinal)` for every place of `m` in this process,
/// on its lane `o.lane`, reading and writing what `access_of(place_index, local_ordinal)`
/// says, and returns without waiting (the batch keeps `task` until its tasks are freed).
/// `describe()` gives the trace's detail (called only while the timeline records).
template <class Mesh, class Task, class Access = no_access, class Describe = std::nullptr_t>
std::shared_ptr<place_batch> submit_on_places(const Mesh& m, Task task, batch_options o, Access access_of = {},
                                              Describe describe = nullptr) {
  auto owner = std::make_shared<Task>(std::move(task));
  const place_work work{[](void* c, std::size_t p, std::size_t k) { std::as_const(*static_cast<Task*>(c))(p, k); }, owner.get()};
  const place_access uses = access_of_places(access_of);
  place_detail detail;
  if constexpr (!std::is_same_v<Describe, std::nullptr_t>)
    detail = {[](const void* c) { return std::string((*static_cast<const Describe*>(c))()); }, &describe};
  return submit_on_mesh(*m.state(), comms_of(m), work, std::move(owner), o, uses, detail);
}

/// @brief Runs `task(place_index, local_ordinal)` on every place of `m` that lives in this
/// process, all at once, and waits for all of them.
///
/// When a task fails in a mesh of this process only, the mesh's collectives are aborted
/// so the other places do not wait for it, and reset once every task has returned, so
/// the mesh stays usable. In a mesh over several processes, tasks that `communicate`
/// cannot be unwound that way: an argument mismatch is thrown alike by every member
/// (pdo::mismatch_error) and returned here, any other failure ends the job (end_job).
/// `access_of(place_index, local_ordinal)` names what each task reads and writes: it waits
/// for the tasks queued before that write what it reads, and is cancelled with the error of
/// one that failed. The tasks run on each place's `lane`.
/// @return the ended batch: each local place's failure, if any (`failures`, by local ordinal)
template <class Mesh, class Task, class Access = no_access>
std::shared_ptr<place_batch> run_batch_on_places(const Mesh& m, Task&& task, bool communicate, const char* op, const char* category,
                                                 Access access_of = {}, lane_kind lane = lane_kind::compute) {
  const bool local_only = !m.is_multiprocess();
  // waited for here: the tasks call `task` and `access_of` where they are, owning nothing
  using task_t = std::remove_reference_t<Task>;
  const place_work work{[](void* c, std::size_t p, std::size_t k) { (*static_cast<task_t*>(c))(p, k); },
                        const_cast<void*>(static_cast<const void*>(std::addressof(task)))};
  const place_access uses = access_of_places(access_of);
  auto batch = submit_on_mesh(*m.state(), comms_of(m), work, nullptr,
                              batch_options{op, category, communicate || local_only, communicate || local_only, lane, true}, uses);
  batch->wait();
  return batch;
}

/// @brief run_batch_on_places, giving the first failure that is a cause, not an echo of
/// another's, or nothing.
template <class Mesh, class Task, class Access = no_access>
std::optional<place_failure> try_run_on_places(const Mesh& m, Task&& task, bool communicate = true, const char* op = "spmd",
                                               const char* category = "task", Access access_of = {},
                                               lane_kind lane = lane_kind::compute) {
  return run_batch_on_places(m, std::forward<Task>(task), communicate, op, category, access_of, lane)->first_failure();
}

/// @brief try_run_on_places, throwing the failure as a pdo::error naming `op` and the place.
template <class Mesh, class Task>
void run_on_places(const char* op, const Mesh& m, Task&& task, const char* category = "task") {
  if (auto failure = try_run_on_places(m, std::forward<Task>(task), true, op, category)) rethrow_on_place(*m.state(), *failure, op);
}

/// @brief run_on_places for an operation whose tasks queue more work on the places' lanes
/// while they run: other host threads' operations on the places wait until it has ended (see
/// place_hold).
template <class Mesh, class Task>
void run_holding_places(const char* op, const Mesh& m, Task&& task) {
  const place_hold hold(*m.state());
  run_on_places(op, m, std::forward<Task>(task));
}

/// @brief The mesh-wide operations of one op, submitted one after another on different
/// lanes (a halo exchange on the communication lanes beside kernels on the compute lanes,
/// ordered by the buffers they name), waited for together. Its tasks may use the caller's
/// locals: it waits for every task to end before it goes, also when a submission throws.
class batch_sequence {
 public:
  explicit batch_sequence(const char* op) : op_(op) {}
  batch_sequence(const batch_sequence&) = delete;
  batch_sequence& operator=(const batch_sequence&) = delete;
  ~batch_sequence() {
    for (const auto& b : batches_)
      for (const auto& t : b->tasks) t->wait_ended();
  }

  /// @brief Submits one operation: `task(place_index, local_ordinal)` on every place of `m` in
  /// this process, on lane `lane`, with `access_of(place_index, local_ordinal)`'s reads and
  /// writes; `communicate`: its tasks run the mesh's collectives.
  template <class Mesh, class Task, class Access>
  void submit(const Mesh& m, lane_kind lane, bool communicate, Task task, Access access_of) {
    auto written = [&](std::size_t p, std::size_t k) {
      access a = access_of(p, k);
      written_.insert(written_.end(), a.writes.begin(), a.writes.end());
      return a;
    };
    batches_.push_back(submit_on_places(m, std::move(task),
                                        batch_options{op_, communicate ? "collective" : "kernel", communicate, communicate, lane, false},
                                        written));
  }

  /// @brief Waits for every task; throws the failure of the first operation that failed (the
  /// later ones' tasks that needed its results were cancelled by it) naming the op and place.
  template <class Mesh>
  void finish(const Mesh& m) {
    for (const auto& b : batches_) b->wait();
    for (const auto& b : batches_)
      if (const auto failure = b->first_failure()) {
        engine::instance().forget(written_);  // the caller's buffers: later storage may take their addresses
        rethrow_on_place(*m.state(), *failure, op_);
      }
  }

 private:
  const char* op_;
  std::vector<std::shared_ptr<place_batch>> batches_;
  std::vector<const void*> written_;
};

}  // namespace pdo::detail

namespace pdo {

/// @brief Runs `task(place_index)` on every place of `m` in this process, all at once
/// (single program, multiple data), and returns when all are done. Inside, a task
/// reaches the other places through `communicator_of(m, place_index)` or
/// `communicator_along(m, axis, place_index)`. A task's exception reaches the caller as
/// a pdo::error naming the place; in a mesh of one process the other places are
/// released from their collectives and the mesh stays usable (see try_run_on_places
/// for meshes over several processes).
template <class Mesh, class Task>
void spmd(const Mesh& m, Task&& task) {
  detail::run_on_places("spmd", m, [&](std::size_t p, std::size_t) { task(p); });
}

}  // namespace pdo
