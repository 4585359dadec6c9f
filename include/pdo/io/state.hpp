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

/// @brief Entries for the parameters `params_of(k)[i]` and the optimizer state `opt_of(k)` of
/// `copies` identical copies (the replicas of data parallelism; 1 otherwise): each saved from
/// copy 0, each loaded into every copy.
template <class T, class Params, class Opt>
void add_parameters_and_state(checkpoint& c, const std::string& prefix, std::size_t copies, Params params_of, Opt opt_of) {
  const std::vector<nn::parameter_ref<T>> params = params_of(0);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    with_rank(p.rank(), p.name(), [&]<std::size_t R>(std::integral_constant<std::size_t, R>) {
      const shape_t<R> shape = p.template shape<R>();
      c.add_computed<T, R>(
          prefix + "model." + p.name(), shape, [params_of, i, shape] { return shaped(params_of(0)[i].global_values(), shape); },
          [params_of, copies, i](const tensor<T, R>& t) {
            for (std::size_t k = 0; k < copies; ++k) params_of(k)[i].assign(t);
          });
      for (const std::string& s : opt_of(0).state_names())
        c.add_computed<T, R>(
            prefix + "optimizer." + p.name() + "." + s, shape,
            [params_of, opt_of, i, s, shape] { return shaped(params_of(0)[i].gather_state(opt_of(0).state(s, i)), shape); },
            [params_of, opt_of, copies, i, s](const tensor<T, R>& t) {
              for (std::size_t k = 0; k < copies; ++k) params_of(k)[i].scatter_state(t.data(), opt_of(k).state(s, i));
            });
    });
  }
  c.add_computed<long>(
      prefix + "optimizer.steps", [opt_of] { return opt_of(0).steps(); },
      [opt_of, copies](long t) {
        for (std::size_t k = 0; k < copies; ++k) opt_of(k).set_steps(t);
      });
}

}  // namespace detail

/// @brief Adds to `c` a model's parameters (their global values, as "<prefix>model.<name>")
/// and `opt`'s state ("<prefix>optimizer.<name>.<state>", "<prefix>optimizer.steps"). The
/// parameters may be local tensors or dtensors of any layout (the tensor-parallel model's):
/// each is saved as its global value and loaded into whatever layout the parameter has then.
/// For parameters over the places of several processes, call c.spanning(mesh) first.
template <class T, class Optimizer>
checkpoint& add_state(checkpoint& c, const std::string& prefix, std::vector<nn::parameter_ref<T>> params, Optimizer& opt) {
  static_assert(detail::optimizer_with_state<Optimizer>,
                "pdo: io::add_state: the optimizer must expose its state (state_names(), state(name, i), steps(), set_steps(t)), as "
                "pdo::nn::sgd, adam and any_optimizer do");
  detail::add_parameters_and_state<T>(
      c, prefix, 1, [params = std::move(params)](std::size_t) { return params; }, [&opt](std::size_t) -> Optimizer& { return opt; });
  return c;
}

/// @brief Adds to `c` the whole state of a data-parallel trainer: the parameters and the
/// optimizer state (saved from the first replica, loaded into every one), the steps and
/// epochs trained. Loaded into a trainer of the same model on any mesh, it trains on as the
/// saved one would have: bitwise the same losses on the same mesh.
template <class T, class Model, class Optimizer, class Mesh, class Loss>
checkpoint& add_state(checkpoint& c, const std::string& prefix, nn::data_parallel<T, Model, Optimizer, Mesh, Loss>& trainer) {
  static_assert(detail::optimizer_with_state<Optimizer>,
                "pdo: io::add_state: the optimizer must expose its state (state_names(), state(name, i), steps(), set_steps(t)), as "
                "pdo::nn::sgd, adam and any_optimizer do");
  if (trainer.options().zero1)
    throw io_error("io: add_state: a data_parallel trainer with ZeRO-1 keeps its optimizer state in slices over \"dp\", which "
                   "checkpoints do not hold yet; save a trainer without zero1");
  c.spanning(trainer.mesh());
  auto* t = &trainer;
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
/// "<prefix>optimizer.steps"). Each stage's places write their own parameters, all at once
/// (over MPI each process its stages'; a stage's shards along "tp" each by its place, once
/// per "dp" row); a load fills each place's parameters and moments from the blocks they
/// overlap, so a checkpoint loads into a pipeline of the same model cut, split or replicated
/// otherwise (another mesh, other cut points, "tp" or "dp" axes or none).
template <class T, std::size_t InRank, class Target, class Mesh, class Optimizer, class Loss, class... Stages>
checkpoint& add_state(checkpoint& c, const std::string& prefix, nn::pipeline<T, InRank, Target, Mesh, Optimizer, Loss, Stages...>& pipeline) {
  static_assert(detail::optimizer_with_state<Optimizer>,
                "pdo: io::add_state: the optimizer must expose its state (state_names(), state(name, i), steps(), set_steps(t)), as "
                "pdo::nn::sgd, adam and any_optimizer do");
  auto* pl = &pipeline;
  c.spanning(pl->mesh());
  // the block place p holds of model parameter g: its values (state "") or an optimizer state
  auto block_of = [pl](std::size_t g, const std::string& state) {
    return [pl, g, state](std::size_t p) -> held_block<T> {
      const auto& local = pl->mesh().local_places();
      const std::size_t k = static_cast<std::size_t>(std::find(local.begin(), local.end(), p) - local.begin());
      const auto part = pl->part_of(k, g);
      if (part.index == part.npos) return {};
      const nn::parameter_ref<T> q = pl->parameters(k)[part.index];  // parameters(k) is a copy
      T* data = state.empty() ? q.value_blocks().at(0).data() : pl->optimizer(k).state(state, part.index).at(0).data();
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
  return c;
}

/// @brief Saves the whole state of `pipeline` into `dir` (see add_state).
template <class T, std::size_t InRank, class Target, class Mesh, class Optimizer, class Loss, class... Stages>
void save(const std::filesystem::path& dir, nn::pipeline<T, InRank, Target, Mesh, Optimizer, Loss, Stages...>& pipeline,
          const save_options& o = {}) {
  checkpoint c;
  add_state(c, "", pipeline);
  c.save(dir, o);
}

/// @brief Restores the whole state of `pipeline` from `dir` (see add_state).
template <class T, std::size_t InRank, class Target, class Mesh, class Optimizer, class Loss, class... Stages>
void load(const std::filesystem::path& dir, nn::pipeline<T, InRank, Target, Mesh, Optimizer, Loss, Stages...>& pipeline,
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

}  // namespace pdo::io
