// pdo/io/state.hpp: the whole state of a training run in a checkpoint: a model's parameters,
// its optimizer's moments and step count, and a data-parallel trainer's progress, so that
// training resumes exactly where it stopped, on the same mesh or another.
#pragma once

#include <pdo/io/checkpoint.hpp>
#include <pdo/nn/data_parallel.hpp>
#include <pdo/nn/module.hpp>
#include <pdo/nn/pipeline.hpp>

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace pdo::io {

namespace detail {

/// @brief f(std::integral_constant<std::size_t, R>{}) for the rank R of a parameter (1 to 6).
template <class F>
void with_rank(std::size_t rank, const std::string& name, F&& f) {
  auto one = [&]<std::size_t R>() {
    if (rank == R) f(std::integral_constant<std::size_t, R>{});
  };
  [&]<std::size_t... R>(std::index_sequence<R...>) { (one.template operator()<R + 1>(), ...); }(std::make_index_sequence<6>{});
  if (rank < 1 || rank > 6)
    throw io_error("io: parameter " + name + " has rank " + std::to_string(rank) + "; checkpoints hold parameters of rank 1 to 6");
}

template <class T, std::size_t R>
tensor<T, R> shaped(const tensor<T, 1>& flat, const shape_t<R>& shape) {
  auto t = tensor<T, R>::on_host(shape);
  pdo::detail::copy_elements(t.data(), flat.data(), t.size());
  return t;
}

template <class O>
concept optimizer_with_state = requires(O& o, const O& co, const std::string& name, long t) {
  { co.state_names() } -> std::convertible_to<std::vector<std::string>>;
  o.state(name, std::size_t{0});
  { co.steps() } -> std::convertible_to<long>;
  o.set_steps(t);
};

/// @brief An optimizer that counts each parameter's steps (adam, any_optimizer).
template <class O>
concept steps_per_parameter = requires(O& o, const O& co, std::size_t i, long t) {
  { co.steps(i) } -> std::convertible_to<long>;
  o.set_steps(i, t);
};

using pdo::detail::not_held;

/// @brief For each of `params`, the index of the same parameter among `opt`'s, or not_held: an
/// optimizer made for part of a model's parameters (a frozen layer), or for them in another
/// order, keeps state for its own list. An optimizer that does not list its parameters is
/// taken to hold `params` in their order.
template <class T, class Optimizer>
std::vector<std::size_t> held_as(const std::vector<nn::parameter_ref<T>>& params, const Optimizer& opt) {
  if constexpr (requires { { opt.parameters() } -> std::convertible_to<const std::vector<nn::parameter_ref<T>>&>; }) {
    return pdo::detail::positions_among(params, opt.parameters());
  } else {
    std::vector<std::size_t> out(params.size());
    std::iota(out.begin(), out.end(), std::size_t{0});
    return out;
  }
}

/// @brief held_as for each of `copies` copies (`params_of(k)` and `opt_of(k)`): [copy][parameter].
template <class T, class Params, class Opt>
std::shared_ptr<const std::vector<std::vector<std::size_t>>> held_by_copies(std::size_t copies, Params params_of, Opt opt_of) {
  auto held = std::make_shared<std::vector<std::vector<std::size_t>>>();
  for (std::size_t k = 0; k < copies; ++k) held->push_back(held_as<T>(params_of(k), opt_of(k)));
  return held;
}

/// @brief An io_error, `what(name)`, naming the first place of `places` that is not a CPU
/// place: for state these checkpoints take from host memory only (every process sees every
/// place of a mesh, so all refuse alike, before any entry is added).
template <class What>
void require_cpu_places(const std::vector<any_place>& places, What what) {
  for (const any_place& q : places)
    if (q.kind() != place_kind::cpu) throw io_error(what(q.name()));
}

/// @brief An io_error, `what(k, i)`, for the first parameter `i` of a copy `k` that its optimizer
/// does not update (`held` as held_by_copies): for the checkpoints whose state entries hold
/// every parameter's blocks (a pipeline's, a ZeRO-1 trainer's slices).
template <class What>
void require_all_held(const std::vector<std::vector<std::size_t>>& held, What what) {
  for (std::size_t k = 0; k < held.size(); ++k)
    for (std::size_t i = 0; i < held[k].size(); ++i)
      if (held[k][i] == not_held) throw io_error(what(k, i));
}

/// @brief After the entry "<prefix>optimizer.steps": for an optimizer that counts each
/// parameter's steps, "<prefix>optimizer.<name>.steps" for each parameter it updates (saved
/// from copy 0, loaded into every copy of `copies`; `held` as held_by_copies), so a parameter
/// that skipped steps (no gradient in them) resumes with its own bias corrections. Optional: a
/// checkpoint saved without them loads with every parameter at the optimizer's count.
template <class T, class Opt>
void add_parameter_steps(checkpoint& c, const std::string& prefix, const std::vector<nn::parameter_ref<T>>& params, std::size_t copies,
                         Opt opt_of, const std::shared_ptr<const std::vector<std::vector<std::size_t>>>& held) {
  using optimizer_t = std::remove_cvref_t<decltype(opt_of(0))>;
  if constexpr (steps_per_parameter<optimizer_t>) {
    for (std::size_t i = 0; i < params.size(); ++i)
      if ((*held)[0][i] != not_held)
        c.add_computed<long>(
            prefix + "optimizer." + params[i].name() + ".steps", [opt_of, held, i] { return static_cast<long>(opt_of(0).steps((*held)[0][i])); },
            [opt_of, copies, held, i](long t) {
              for (std::size_t k = 0; k < copies; ++k)
                if ((*held)[k][i] != not_held) opt_of(k).set_steps((*held)[k][i], t);
            },
            /*optional=*/true);
  }
}

/// @brief Entry "<prefix>model.<name>" of parameter `params_of(k)[i]` of `copies` identical
/// copies, as a global value: saved from copy 0 (gathered), loaded into every copy, after which
/// `loaded(k)` runs for that copy.
template <class T, class Params, class Loaded>
void add_model_entry(checkpoint& c, const std::string& prefix, std::size_t copies, Params params_of, std::size_t i, Loaded loaded) {
  const nn::parameter_ref<T> p = params_of(0)[i];
  with_rank(p.rank(), p.name(), [&]<std::size_t R>(std::integral_constant<std::size_t, R>) {
    const shape_t<R> shape = p.template shape<R>();
    c.add_computed<T, R>(
        prefix + "model." + p.name(), shape, [params_of, i, shape] { return shaped(params_of(0)[i].global_values(), shape); },
        [params_of, copies, i, loaded](const tensor<T, R>& t) {
          for (std::size_t k = 0; k < copies; ++k) {
            params_of(k)[i].assign(t);
            loaded(k);
          }
        });
  });
}

/// @brief Entries for parameter `params_of(k)[i]` and its optimizer state in `opt_of(k)`, of
/// `copies` identical copies (the replicas of data parallelism; 1 otherwise), as global values:
/// each saved from copy 0 (gathered), each loaded into every copy. A parameter the optimizer
/// does not update (`held`, as held_by_copies) has no optimizer entries.
template <class T, class Params, class Opt>
void add_parameter_whole(checkpoint& c, const std::string& prefix, std::size_t copies, Params params_of, Opt opt_of, std::size_t i,
                         const std::shared_ptr<const std::vector<std::vector<std::size_t>>>& held) {
  add_model_entry<T>(c, prefix, copies, params_of, i, [](std::size_t) {});
  if ((*held)[0][i] == not_held) return;
  const nn::parameter_ref<T> p = params_of(0)[i];
  with_rank(p.rank(), p.name(), [&]<std::size_t R>(std::integral_constant<std::size_t, R>) {
    const shape_t<R> shape = p.template shape<R>();
    for (const std::string& s : opt_of(0).state_names())
      c.add_computed<T, R>(
          prefix + "optimizer." + p.name() + "." + s, shape,
          [params_of, opt_of, held, i, s, shape] { return shaped(params_of(0)[i].gather_state(opt_of(0).state(s, (*held)[0][i])), shape); },
          [params_of, opt_of, copies, held, i, s](const tensor<T, R>& t) {
            for (std::size_t k = 0; k < copies; ++k)
              if ((*held)[k][i] != not_held) params_of(k)[i].scatter_state(t.data(), opt_of(k).state(s, (*held)[k][i]));
          });
  });
}

/// @brief Entries for the parameters `params_of(k)[i]` and the optimizer state `opt_of(k)` of
/// `copies` identical copies: each saved from copy 0, each loaded into every copy.
template <class T, class Params, class Opt>
void add_parameters_and_state(checkpoint& c, const std::string& prefix, std::size_t copies, Params params_of, Opt opt_of) {
  const std::size_t n = params_of(0).size();
  const auto held = held_by_copies<T>(copies, params_of, opt_of);
  for (std::size_t i = 0; i < n; ++i) add_parameter_whole<T>(c, prefix, copies, params_of, opt_of, i, held);
  c.add_computed<long>(
      prefix + "optimizer.steps", [opt_of] { return opt_of(0).steps(); },
      [opt_of, copies](long t) {
        for (std::size_t k = 0; k < copies; ++k) opt_of(k).set_steps(t);
      });
  add_parameter_steps<T>(c, prefix, params_of(0), copies, opt_of, held);
}

/// @brief The entries of a data-parallel trainer with ZeRO-1. Its parameters are whole on every
/// replica ("<prefix>model.<name>", saved from the first, loaded into every one, and each
/// replica's slices cut again from them). Its optimizer state lies in the places' slices of the
/// gradient buckets: each state of a parameter is an entry of the parameter's elements in
/// row-major order ("<prefix>optimizer.<name>.<state>", of shape [elements]), to which every
/// place writes the run its slices hold, and from which a load fills each place's runs,
/// whatever the number of places then.
template <class T, class Trainer>
void add_zero1_state(checkpoint& c, const std::string& prefix, Trainer& trainer) {
  require_cpu_places(trainer.mesh().places(), [](const std::string& gpu) {
    return "io: add_state: a data_parallel trainer with ZeRO-1 on GPU places (" + gpu +
           ") keeps its optimizer state's slices in device memory, which checkpoints of ZeRO-1 state do not take yet; save a "
           "trainer on CPU places, or one without zero1";
  });
  auto* t = &trainer;
  // each replica's bucket slices among its optimizer's parameters (make_optimizer was given
  // slices() and may list them in another order): a state entry holds every slice's runs
  const auto held = held_by_copies<T>(
      trainer.replica_count(), [t](std::size_t k) { return t->replica_buckets(k).slices(); },
      [t](std::size_t k) -> auto& { return t->optimizer(k); });
  require_all_held(*held, [t](std::size_t k, std::size_t b) {
    return "io: add_state: the optimizer of the ZeRO-1 trainer's replica on place " + t->mesh().place(t->mesh().local_places()[k]).name() +
           " does not update bucket " + std::to_string(b) +
           "'s slice (a frozen slice); a ZeRO-1 checkpoint holds the optimizer state of every slice: give make_optimizer's "
           "optimizer all the slices it is given";
  });
  const std::vector<nn::parameter_ref<T>> params = trainer.parameters(0);
  const auto& m = trainer.mesh();
  using mesh_type = std::decay_t<decltype(m)>;
  // a replica along another axis than "dp" holds the same slices: only the first writes
  auto writes = [t](std::size_t place) {
    constexpr std::size_t dp = mesh_type::axis_index("dp");
    for (std::size_t a = 0; a < mesh_type::ndim; ++a)
      if (a != dp && t->mesh().coord(place, a) != 0) return false;
    return true;
  };
  auto block_of = [t, writes, held](std::size_t i, const std::string& state) {
    return [t, writes, held, i, state](std::size_t place) -> held_block<T> {
      const auto& local = t->mesh().local_places();
      const std::size_t k = static_cast<std::size_t>(std::find(local.begin(), local.end(), place) - local.begin());
      if (k == local.size()) return {};
      for (const auto& run : t->replica_buckets(k).slice_runs()) {
        if (run.param != i) continue;
        T* data = t->optimizer(k).state(state, (*held)[k][run.bucket]).at(0).data() + run.at;
        return {{run.first}, {run.count}, data, writes(place)};
      }
      return {};
    };
  };
  const std::vector<std::string> states = trainer.replica_count() == 0 ? std::vector<std::string>{} : trainer.optimizer(0).state_names();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const nn::parameter_ref<T>& p = params[i];
    add_model_entry<T>(c, prefix, trainer.replica_count(), [t](std::size_t k) { return t->parameters(k); }, i,
                       [t, i](std::size_t k) { t->replica_buckets(k).reslice(i); });
    for (const std::string& s : states)
      c.add_blocks<T, 1>(prefix + "optimizer." + p.name() + "." + s, m, shape_t<1>{p.size_global()}, block_of(i, s));
  }
  c.add_computed<long>(
      prefix + "optimizer.steps", [t] { return t->replica_count() == 0 ? 0L : static_cast<long>(t->optimizer(0).steps()); },
      [t](long v) {
        for (std::size_t k = 0; k < t->replica_count(); ++k) t->optimizer(k).set_steps(v);
      });
}

/// @brief Whether parameter `p` can be saved and loaded as its places' blocks: a dtensor on CPU
/// places with no pending sums.
template <class T>
bool held_in_blocks(const nn::parameter_ref<T>& p) {
  // decided from what every process sees alike (the mesh's places, the layout), never from
  // this process's blocks: the blocks' entries are collective over the mesh
  if (!p.distributed() || p.partial()) return false;
  for (const any_place& q : p.mesh_places())
    if (q.kind() != place_kind::cpu) return false;
  return true;
}

}  // namespace detail

/// @brief Adds to `c` a model's parameters (as "<prefix>model.<name>") and `opt`'s state
/// ("<prefix>optimizer.<name>.<state>", "<prefix>optimizer.steps", and for an optimizer that
/// counts each parameter's steps, as adam does, "<prefix>optimizer.<name>.steps"; an
/// any_optimizer writes them whatever it holds, 0 for one that keeps no count). Each parameter's
/// state is found among `opt`'s parameters as the same parameter, in whatever order `opt` lists
/// them; one `opt` does not update (a frozen layer) has no optimizer entries. The parameters may be
/// local tensors or dtensors of any layout (the tensor-parallel model's). A dtensor on CPU
/// places is saved by its places, each writing its own block at once (a replica's by the first
/// place along the axes its layout does not split), and loaded into whatever layout and mesh
/// the parameter has then, each place reading the parts of the saved blocks its block overlaps;
/// a local tensor, or a dtensor on GPU places, is saved as its global value. Every process of
/// the parameters' meshes calls this, in the same order. For parameters over the places of
/// several processes, call c.spanning(mesh) first.
template <class T, class Optimizer>
checkpoint& add_state(checkpoint& c, const std::string& prefix, std::vector<nn::parameter_ref<T>> params, Optimizer& opt) {
  static_assert(detail::optimizer_with_state<Optimizer>,
                "pdo: io::add_state: the optimizer must expose its state (state_names(), state(name, i), steps(), set_steps(t)), as "
                "pdo::nn::sgd, adam and any_optimizer do");
  auto params_of = [params](std::size_t) { return params; };
  auto opt_of = [&opt](std::size_t) -> Optimizer& { return opt; };
  const auto held = detail::held_by_copies<T>(1, params_of, opt_of);
  // one mesh of every place of a parameter's mesh, in its order, for the blocks' entries
  std::vector<std::pair<std::vector<any_place>, mesh<"place">>> meshes;
  auto mesh_over = [&meshes](const std::vector<any_place>& places) -> const mesh<"place">& {
    for (const auto& [these, m] : meshes)
      if (these == places) return m;
    return meshes.emplace_back(places, make_mesh<"place">(places)).second;
  };
  for (std::size_t i = 0; i < params.size(); ++i) {
    const nn::parameter_ref<T>& p = params[i];
    if (!detail::held_in_blocks(p)) {
      detail::add_parameter_whole<T>(c, prefix, 1, params_of, opt_of, i, held);
      continue;
    }
    // a dtensor on CPU places: each place writes its own block, and a load fills each block
    // from the parts of the saved blocks it overlaps
    const mesh<"place">& m = mesh_over(p.mesh_places());
    const auto positions = std::make_shared<const std::vector<typename nn::parameter_ref<T>::block_position>>(p.block_positions());
    // called by the places' lanes at once: the optimizer makes a state's blocks on first use,
    // one lane at a time
    const auto state_mutex = std::make_shared<std::mutex>();
    const std::size_t j = (*held)[0][i];  // its index among the optimizer's parameters
    auto block_of = [p, positions, state_mutex, &opt, j](const std::string& state) {
      return [p, positions, state_mutex, &opt, j, state](std::size_t place) -> held_block<T> {
        for (std::size_t k = 0; k < positions->size(); ++k) {
          const auto& at = (*positions)[k];
          if (at.place != place) continue;
          T* data = nullptr;
          if (state.empty()) {
            data = p.value_blocks().at(k).data();
          } else {
            std::lock_guard lock(*state_mutex);
            data = opt.state(state, j).at(k).data();
          }
          return {at.offset, at.shape, data, at.write};
        }
        return {};
      };
    };
    detail::with_rank(p.rank(), p.name(), [&]<std::size_t R>(std::integral_constant<std::size_t, R>) {
      const shape_t<R> shape = p.template shape<R>();
      c.add_blocks<T, R>(prefix + "model." + p.name(), m, shape, block_of(""));
      if (j != detail::not_held)
        for (const std::string& s : opt.state_names()) c.add_blocks<T, R>(prefix + "optimizer." + p.name() + "." + s, m, shape, block_of(s));
    });
  }
  c.add_computed<long>(
      prefix + "optimizer.steps", [&opt] { return opt.steps(); }, [&opt](long t) { opt.set_steps(t); });
  detail::add_parameter_steps<T>(c, prefix, params, 1, opt_of, held);
  return c;
}

/// @brief Adds to `c` the whole state of a data-parallel trainer: the parameters and the
/// optimizer state (saved from the first replica, loaded into every one), the steps and
/// epochs trained. Loaded into a trainer of the same model on any mesh, it trains on as the
/// saved one would have: bitwise the same losses on the same mesh. Under ZeRO-1 the optimizer
/// state is written by the places whose slices hold it (see detail::add_zero1_state), and
/// loads into ZeRO-1 trainers of any number of places.
template <class T, class Model, class Optimizer, class Mesh, class Loss>
checkpoint& add_state(checkpoint& c, const std::string& prefix, nn::data_parallel<T, Model, Optimizer, Mesh, Loss>& trainer) {
  static_assert(detail::optimizer_with_state<Optimizer>,
                "pdo: io::add_state: the optimizer must expose its state (state_names(), state(name, i), steps(), set_steps(t)), as "
                "pdo::nn::sgd, adam and any_optimizer do");
  c.spanning(trainer.mesh());
  auto* t = &trainer;
  if (trainer.options().zero1)
    detail::add_zero1_state<T>(c, prefix, trainer);
  else
    detail::add_parameters_and_state<T>(
        c, prefix, trainer.replica_count(), [t](std::size_t k) { return t->parameters(k); },
        [t](std::size_t k) -> Optimizer& { return t->optimizer(k); });
  c.add_computed<std::uint64_t>(
      prefix + "steps", [t] { return static_cast<std::uint64_t>(t->steps()); },
      [t](std::uint64_t s) { t->set_progress(s, t->epochs()); });
  c.add_computed<std::uint64_t>(
      prefix + "epochs", [t] { return static_cast<std::uint64_t>(t->epochs()); },
      [t](std::uint64_t e) { t->set_progress(t->steps(), e); });
  return c;
}

/// @brief Adds to `c` the whole state of a pipeline: each parameter of the model under its
/// name in the whole model ("<prefix>model.<layer>.<name>", as a data-parallel trainer of the
/// same model saves it), the optimizers' state ("<prefix>optimizer.<layer>.<name>.<state>",
/// "<prefix>optimizer.steps") and the trainer's steps ("<prefix>steps", and of them those it
/// skipped, "<prefix>skipped_steps"). Each stage's places
/// write their own parameters, all at once
/// (over MPI each process its stages'; a stage's shards along "tp" each by its place, once
/// per "dp" row); a load fills each place's parameters and moments from the blocks they
/// overlap, so a checkpoint loads into a pipeline of the same model cut, split or replicated
/// otherwise (another mesh, other cut points, "tp" or "dp" axes or none).
template <class T, std::size_t InRank, class Mesh, class Optimizer, class Loss, class... Stages>
checkpoint& add_state(checkpoint& c, const std::string& prefix, nn::pipeline<T, InRank, Mesh, Optimizer, Loss, Stages...>& pipeline) {
  static_assert(detail::optimizer_with_state<Optimizer>,
                "pdo: io::add_state: the optimizer must expose its state (state_names(), state(name, i), steps(), set_steps(t)), as "
                "pdo::nn::sgd, adam and any_optimizer do");
  detail::require_cpu_places(pipeline.mesh().places(), [](const std::string& gpu) {
    return "io: add_state: a pipeline on GPU places (" + gpu +
           ") keeps its stages' parameters and optimizer state in device memory, which pipeline checkpoints do not take yet; "
           "save a pipeline on CPU places";
  });
  auto* pl = &pipeline;
  // each local place's stage parameters among its optimizer's: a state entry holds every
  // parameter's blocks, so each must have its state (checked before any entry is added)
  const std::size_t locals = pl->mesh().local_places().size();
  const auto held = detail::held_by_copies<T>(locals, [pl](std::size_t k) { return pl->parameters(k); },
                                              [pl](std::size_t k) -> Optimizer& { return pl->optimizer(k); });
  detail::require_all_held(*held, [pl](std::size_t k, std::size_t i) {
    return "io: add_state: the optimizer of the pipeline stage on place " + pl->mesh().place(pl->mesh().local_places()[k]).name() +
           " does not update the stage's parameter " + pl->parameters(k)[i].name() +
           " (a frozen parameter); a pipeline's checkpoint holds each stage's optimizer state for every parameter of the stage: "
           "give make_optimizer's optimizer all the parameters it is given";
  });
  c.spanning(pl->mesh());
  // the block place p holds of model parameter g: its values (state "") or an optimizer state
  auto block_of = [pl, held](std::size_t g, const std::string& state) {
    return [pl, held, g, state](std::size_t p) -> held_block<T> {
      const auto& local = pl->mesh().local_places();
      const std::size_t k = static_cast<std::size_t>(std::find(local.begin(), local.end(), p) - local.begin());
      const auto part = pl->part_of(k, g);
      if (part.index == part.npos) return {};
      const nn::parameter_ref<T> q = pl->parameters(k)[part.index];  // parameters(k) is a copy
      T* data = state.empty() ? q.value_blocks().at(0).data() : pl->optimizer(k).state(state, (*held)[k][part.index]).at(0).data();
      return {part.offset, q.extents(), data, part.first};
    };
  };
  const auto& params = pl->model_parameters();
  const std::vector<std::string> states = pl->mesh().local_places().empty() ? std::vector<std::string>{} : pl->optimizer(0).state_names();
  for (std::size_t g = 0; g < params.size(); ++g) {
    const auto& q = params[g];
    detail::with_rank(q.extents.size(), q.name, [&]<std::size_t R>(std::integral_constant<std::size_t, R>) {
      shape_t<R> shape{};
      std::copy(q.extents.begin(), q.extents.end(), shape.begin());
      c.add_blocks<T, R>(prefix + "model." + q.name, pl->mesh(), shape, block_of(g, ""));
      for (const std::string& s : states) c.add_blocks<T, R>(prefix + "optimizer." + q.name + "." + s, pl->mesh(), shape, block_of(g, s));
    });
  }
  c.add_computed<long>(
      prefix + "optimizer.steps", [pl] { return pl->mesh().local_places().empty() ? 0L : static_cast<long>(pl->optimizer(0).steps()); },
      [pl](long t) {
        for (std::size_t k = 0; k < pl->mesh().local_places().size(); ++k) pl->optimizer(k).set_steps(t);
      });
  // the trainer's steps (its learning-rate schedule's count), as a data-parallel trainer saves
  // them, and how many it skipped; optional: a checkpoint saved without them leaves the counts
  // as they are
  c.add_computed<std::uint64_t>(
      prefix + "steps", [pl] { return static_cast<std::uint64_t>(pl->steps()); },
      [pl](std::uint64_t s) { pl->set_steps(static_cast<std::size_t>(s)); }, true);
  c.add_computed<std::uint64_t>(
      prefix + "skipped_steps", [pl] { return static_cast<std::uint64_t>(pl->skipped_steps()); },
      [pl](std::uint64_t s) { pl->set_skipped_steps(static_cast<std::size_t>(s)); }, true);
  return c;
}

/// @brief Saves the whole state of `pipeline` into `dir` (see add_state).
template <class T, std::size_t InRank, class Mesh, class Optimizer, class Loss, class... Stages>
void save(const std::filesystem::path& dir, nn::pipeline<T, InRank, Mesh, Optimizer, Loss, Stages...>& pipeline,
          const save_options& o = {}) {
  checkpoint c;
  add_state(c, "", pipeline);
  c.save(dir, o);
}

/// @brief Restores the whole state of `pipeline` from `dir` (see add_state).
template <class T, std::size_t InRank, class Mesh, class Optimizer, class Loss, class... Stages>
void load(const std::filesystem::path& dir, nn::pipeline<T, InRank, Mesh, Optimizer, Loss, Stages...>& pipeline,
          const load_options& o = {}) {
  checkpoint c;
  add_state(c, "", pipeline);
  c.load(dir, o);
}

/// @brief Saves the whole state of `trainer` into `dir` (see add_state).
template <class T, class Model, class Optimizer, class Mesh, class Loss>
void save(const std::filesystem::path& dir, nn::data_parallel<T, Model, Optimizer, Mesh, Loss>& trainer, const save_options& o = {}) {
  checkpoint c;
  add_state(c, "", trainer);
  c.save(dir, o);
}

/// @brief Restores the whole state of `trainer` from `dir` (see add_state).
template <class T, class Model, class Optimizer, class Mesh, class Loss>
void load(const std::filesystem::path& dir, nn::data_parallel<T, Model, Optimizer, Mesh, Loss>& trainer, const load_options& o = {}) {
  checkpoint c;
  add_state(c, "", trainer);
  c.load(dir, o);
}

/// @brief What make_data_parallel or make_pipeline gave after its compile error: nothing is
/// added, so that the trainer's checkpoint reports nothing more than that error.
template <class T>
checkpoint& add_state(checkpoint& c, const std::string&, nn::detail_dp::unformed_trainer<T>&) {
  return c;
}
/// @brief What make_data_parallel or make_pipeline gave after its compile error: nothing is saved.
template <class T>
void save(const std::filesystem::path&, nn::detail_dp::unformed_trainer<T>&, const save_options& = {}) {}
/// @brief What make_data_parallel or make_pipeline gave after its compile error: nothing is loaded.
template <class T>
void load(const std::filesystem::path&, nn::detail_dp::unformed_trainer<T>&, const load_options& = {}) {}

}  // namespace pdo::io
