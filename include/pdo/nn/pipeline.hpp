// pdo/nn/pipeline.hpp: pipeline (inter-op) parallelism: the layers of a sequential cut into
// stages on the places of a mesh's "pp" axis, micro-batched with GPipe or 1F1B schedules.
#pragma once

#include <pdo/exec/run_on_places.hpp>
#include <pdo/nn/batching.hpp>
#include <pdo/nn/buckets.hpp>
#include <pdo/nn/data_parallel.hpp>
#include <pdo/nn/layers.hpp>
#include <pdo/nn/optim.hpp>
#include <pdo/nn/tensor_parallel.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo::nn {

enum class pipeline_schedule {
  gpipe,        ///< every micro-batch forward, then every backward: holds all micro-batches' activations
  one_f_one_b,  ///< 1F1B: after a warm-up, one forward then one backward: at most (stages - stage) micro-batches in flight
};

/// @brief One step of a stage's schedule: the forward or the backward of a micro-batch.
struct pipeline_action {
  bool forward = true;    ///< true: the forward of micro-batch `micro`; false: its backward
  std::size_t micro = 0;  ///< the micro-batch's index, from 0
  friend bool operator==(const pipeline_action&, const pipeline_action&) = default;
};

/// @brief The action list of every stage (stage s receives activations from s - 1 and
/// gradients from s + 1; the messages follow from the actions, so every send has its
/// receive by construction).
inline std::vector<std::vector<pipeline_action>> make_schedule(pipeline_schedule kind, std::size_t stages, std::size_t micros) {
  std::vector<std::vector<pipeline_action>> plan(stages);
  for (std::size_t s = 0; s < stages; ++s) {
    auto& a = plan[s];
    if (kind == pipeline_schedule::gpipe) {
      for (std::size_t m = 0; m < micros; ++m) a.push_back({true, m});
      for (std::size_t m = micros; m-- > 0;) a.push_back({false, m});
    } else {
      const std::size_t warmup = std::min(micros, stages - s - 1);
      std::size_t f = 0, b = 0;
      for (; f < warmup; ++f) a.push_back({true, f});
      while (f < micros) {
        a.push_back({true, f++});
        a.push_back({false, b++});
      }
      while (b < micros) a.push_back({false, b++});
    }
  }
  return plan;
}

/// @brief Rejects, before anything runs, a schedule that would not finish: each stage must
/// run each micro-batch's forward and backward once, forward first, and the stages,
/// running their lists in order (a forward waits for the previous stage's forward of that
/// micro-batch, a backward for the next stage's backward), must all reach the end.
/// Sends never wait (each place sends from its own threads), so that is the whole condition.
inline void check_schedule(const std::vector<std::vector<pipeline_action>>& plan, std::size_t micros) {
  const std::size_t stages = plan.size();
  for (std::size_t s = 0; s < stages; ++s) {
    std::vector<int> seen(2 * micros, 0);
    for (const auto& a : plan[s]) {
      if (a.micro >= micros)
        throw error("pipeline schedule: stage " + std::to_string(s) + " names micro-batch " + std::to_string(a.micro) + " of " +
                    std::to_string(micros));
      if (!a.forward && seen[2 * a.micro] == 0)
        throw error("pipeline schedule: stage " + std::to_string(s) + " runs the backward of micro-batch " + std::to_string(a.micro) +
                    " before its forward");
      ++seen[2 * a.micro + (a.forward ? 0 : 1)];
    }
    for (std::size_t k = 0; k < seen.size(); ++k)
      if (seen[k] != 1)
        throw error("pipeline schedule: stage " + std::to_string(s) + " runs the " + (k % 2 == 0 ? "forward" : "backward") +
                    " of micro-batch " + std::to_string(k / 2) + " " + std::to_string(seen[k]) + " times, not once");
  }
  std::vector<std::size_t> next(stages, 0);
  std::vector<std::vector<char>> done_f(stages, std::vector<char>(micros, 0)), done_b = done_f;
  for (bool progress = true; progress;) {
    progress = false;
    for (std::size_t s = 0; s < stages; ++s) {
      while (next[s] < plan[s].size()) {
        const auto a = plan[s][next[s]];
        const bool ready = a.forward ? (s == 0 || done_f[s - 1][a.micro]) : (s + 1 == stages || done_b[s + 1][a.micro]);
        if (!ready) break;
        (a.forward ? done_f : done_b)[s][a.micro] = 1;
        ++next[s];
        progress = true;
      }
    }
  }
  for (std::size_t s = 0; s < stages; ++s)
    if (next[s] < plan[s].size()) {
      const auto a = plan[s][next[s]];
      throw error("pipeline schedule: deadlock: stage " + std::to_string(s) + " waits forever at the " +
                  (a.forward ? "forward" : "backward") + " of micro-batch " + std::to_string(a.micro) + " (its " +
                  (a.forward ? "input from stage " + std::to_string(s - 1) : "gradient from stage " + std::to_string(s + 1)) +
                  " never comes)");
    }
}

namespace detail_pp {

/// @brief A copy of `layer` whose parameters live in `place`'s memory.
template <class Layer>
Layer to_place(const Layer& layer, const any_place& place) {
  auto copy = [&](const auto& v) { return parameter(pdo::to_place(v.value(), place)); };
  if constexpr (requires { layer.options(); }) return Layer(copy(layer.weight), copy(layer.bias), layer.options());
  else if constexpr (requires { layer.weight; }) return Layer(copy(layer.weight), copy(layer.bias));
  else return layer;
}

/// @brief Place `p`'s part of the stage made of the layers [Begin, End) of `model`: a copy in
/// p's memory, or, on a mesh with a "tp" axis, p's shards of the stage made tensor parallel
/// along "tp" (tensor_parallel_shard).
template <std::size_t Begin, std::size_t End, class Mesh, class... Layers>
auto stage_of(const sequential<Layers...>& model, const Mesh& m, std::size_t p) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    if constexpr (Mesh::has_axis("tp")) {
      return tensor_parallel_shard<"tp">(m, p, sequential(std::get<Begin + I>(model.layers())...));
    } else {
      return sequential(to_place(std::get<Begin + I>(model.layers()), m.place(p))...);
    }
  }(std::make_index_sequence<End - Begin>{});
}

/// @brief Whether on `Mesh` every stage of a model of `Layers` cut at `Bounds::values` holds
/// whole column/row pairs of linear layers: any cut does without a "tp" axis; with one, each
/// cut comes after an even number of linear layers.
template <class Mesh, class Bounds, class... Layers>
constexpr bool stages_hold_whole_pairs() {
  if constexpr (Mesh::has_axis("tp")) {
    for (const std::size_t b : Bounds::values)
      if (nn::detail_tp::linears_before<Layers...>(b < sizeof...(Layers) ? b : sizeof...(Layers)) % 2 != 0) return false;
  }
  return true;
}

/// @brief The cut points of a pipeline, as a tag its constructor deduces them from.
template <std::size_t... Cuts>
struct cut_list {};

/// @brief Where the stages of a model of `Layers` layers cut at `Cuts...` begin and end
/// (a cut c starts a stage at layer c, numbered from 0): stage s is [values[s], values[s + 1]).
template <std::size_t Layers, std::size_t... Cuts>
struct stage_bounds {
  /// @brief 0, the cut points, then the number of layers.
  static constexpr std::array<std::size_t, sizeof...(Cuts) + 2> values{0, Cuts..., Layers};
};

/// @brief How a tensor goes between two neighbouring stages' places: through the line along
/// "pp" (`link`: CPU places, in one process or several); by a device copy (`handoff`: GPU
/// places of one process: the receiver copies the sender's block on its own stream, and the
/// sender keeps the block until that copy has run, pdo::detail::offered_block); or through
/// host memory and the mesh's host group (`staged`: GPU places of two processes, whose NCCL
/// point-to-point calls, one stream per GPU, would let a send wait for a receive queued
/// behind it).
enum class transport { link, handoff, staged };

/// @brief How `me` sends to and receives from the neighbouring stage's place `other`.
inline transport transport_between(const pdo::detail::place_state& me, const pdo::detail::place_state& other) {
  if (me.kind == place_kind::cpu) return transport::link;
  return other.local ? transport::handoff : transport::staged;
}

/// @brief A place's links to its neighbouring stages: its line along "pp" (members by "pp"
/// coordinate) for the data, the mesh's host group (members by place index) for shapes, and
/// how tensors go to each neighbour (transport).
struct channel {
  /// @brief The place's line along "pp", which carries the tensors' elements.
  mesh_communicator link, host;
  std::size_t previous = 0, next = 0;              ///< members of `link`
  std::size_t previous_place = 0, next_place = 0;  ///< members of `host`
  transport to_previous = transport::link;         ///< how tensors go to and from the previous stage's place
  transport to_next = transport::link;             ///< how tensors go to and from the next stage's place
  /// @var host
  /// @brief The mesh's host group, which carries the tensors' shapes ahead of their elements
  /// (and, staged, the elements).
  /// @var previous
  /// @brief The previous stage's member of `link` (`next`: the next stage's).
  /// @var previous_place
  /// @brief The previous stage's member of `host` (`next_place`: the next stage's).
};

/// @brief The header of a tensor sent between stages: its extents, then (a handoff) where its
/// block is and the sender's mark of the work that wrote it.
template <std::size_t R>
using send_header = std::array<std::size_t, R + 2>;

/// @brief Sends tensors from a place without waiting for their receiver: engine tasks on
/// one lane of the place, in order (receivers take them in the same order). Forward's sends
/// and backward's go on two lanes, so a send that waits for its receiver never holds up
/// the other direction.
struct async_sender {
  lane_kind lane = lane_kind::communication;  ///< the sending place's lane that runs the sends, in order
  std::vector<pdo::detail::task_handle> sends = {};  ///< the send tasks submitted since the last reset()
#if defined(PDO_WITH_CUDA)
  /// @brief The blocks handed to GPU places that the receivers may still be copying.
  std::vector<std::unique_ptr<pdo::detail::offered_block>> offers = {};
#endif

  /// @brief Sends `t` to the next stage's place (`forward`) or the previous one's: its shape
  /// through `c.host` (the mesh's host group), then its elements through `c.link` (the line
  /// along "pp"), through `c.host` from a copy in host memory (staged), or by a handoff between
  /// GPU places (the receiver copies the block, after the mark made here, on the sending
  /// place's compute lane, of the work that wrote it).
  template <class T, std::size_t R>
  void send(pdo::detail::place_state& from, const channel& c, tensor<T, R> t, bool forward, int tag) {
    auto data = std::make_shared<tensor<T, R>>(std::move(t));
    pdo::detail::task_request r;
    r.home = &pdo::detail::lane_of(from, lane);
    r.op = "pipeline send";
    r.category = "collective";
    r.uses.reads.push_back(data->data());
    if (pdo::detail::timeline_on()) r.detail = std::to_string(data->bytes()) + " bytes, micro-batch " + std::to_string(tag);
    const transport how = forward ? c.to_next : c.to_previous;
    if (how != transport::handoff) {
      r.fn = [c, forward, tag, data, how] {
        // staged: the copy to host memory first, so a failed copy sends nothing
        const std::optional<tensor<T, R>> staged = how == transport::staged ? std::optional(to_host(*data)) : std::nullopt;
        send_header<R> header{};
        for (std::size_t d = 0; d < R; ++d) header[d] = data->shape()[d];
        const std::size_t to_place = forward ? c.next_place : c.previous_place;
        c.host.send(std::span<const std::size_t>(header), to_place, 2 * tag);
        if (staged) c.host.send(staged->span(), to_place, 2 * tag + 1);
        else c.link.send(std::as_const(*data).span(), forward ? c.next : c.previous, 2 * tag + 1);
      };
      sends.push_back(pdo::detail::engine::instance().submit(std::move(r)));
      return;
    }
#if defined(PDO_WITH_CUDA)
    // the blocks whose copies have run are freed as the step goes (1F1B keeps few in flight)
    std::erase_if(offers, [](const auto& o) { return o->released(); });
    // kept here until its receiver's copy has run, or until the step's end shows no receiver
    // will take it (reset(), or drain() of a failed step): the task uses it by address
    offers.push_back(std::make_unique<pdo::detail::offered_block>(from, data, data->data()));
    pdo::detail::offered_block* offer = offers.back().get();
    r.fn = [c, forward, tag, shape = data->shape(), offer] {
      send_header<R> header{};
      for (std::size_t d = 0; d < R; ++d) header[d] = shape[d];
      header[R] = offer->address();  // the receiver claims the block there and says when its copy ends
      try {
        c.host.send(std::span<const std::size_t>(header), forward ? c.next_place : c.previous_place, 2 * tag);
      } catch (...) {
        offer->not_delivered();
        throw;
      }
    };
    sends.push_back(pdo::detail::engine::instance().submit(std::move(r)));
#else
    pdo::detail::no_cuda("pipeline send", from.name);
#endif
  }
  /// @brief Waits until every submitted send has ended, failed or not (see failure()). The
  /// blocks handed to GPU places whose copies have run are freed. After a step that failed
  /// here (`withdraw`) the others are too: those not yet claimed are withdrawn (their
  /// receivers, released by the abort, are told), the copies of those claimed waited for.
  /// Otherwise a block not yet claimed is kept: a send task ends when its header is delivered,
  /// which may be before the receiver takes the block (that receiver's step is still on).
  void drain([[maybe_unused]] bool withdraw = false) {
    for (const auto& s : sends) s->wait_ended();
#if defined(PDO_WITH_CUDA)
    if (withdraw) offers.clear();
    else std::erase_if(offers, [](const auto& o) { return o->released(); });
#endif
  }
  /// @brief The first send that failed, once drained.
  [[nodiscard]] std::optional<pdo::detail::captured_error> failure() const {
    for (const auto& s : sends)
      if (auto e = pdo::detail::outcome(*s)) return e;
    return std::nullopt;
  }
  /// @brief Forgets the submitted sends (once drained), before the next step: the previous
  /// step has ended on every place, so a block handed to a GPU place that no receiver claimed
  /// then never will be (it is withdrawn), and the copies of the others are waited for.
  void reset() {
    sends.clear();
#if defined(PDO_WITH_CUDA)
    offers.clear();
#endif
  }
};

template <class T, std::size_t R>
tensor<T, R> receive(const channel& c, bool from_previous, int tag, const any_place& place) {
  send_header<R> header{};
  const std::size_t from = from_previous ? c.previous_place : c.next_place;
  const transport how = from_previous ? c.to_previous : c.to_next;
  c.host.recv(std::span<std::size_t>(header), from, 2 * tag);
  shape_t<R> shape{};
  for (std::size_t d = 0; d < R; ++d) shape[d] = header[d];
  if (how == transport::staged) {
    auto staged = tensor<T, R>::on_host(shape);
    c.host.recv(staged.span(), from, 2 * tag + 1);
    return to_place(staged, place);
  }
  std::optional<tensor<T, R>> made;
  try {
    made.emplace(shape, place, pdo::detail::uninitialized);
  } catch (...) {
#if defined(PDO_WITH_CUDA)
    if (how == transport::handoff) pdo::detail::leave_block(header[R]);  // the sender withdraws it
#endif
    throw;
  }
  tensor<T, R>& t = *made;
  if (how == transport::link) {
    c.link.recv(t.span(), from_previous ? c.previous : c.next, 2 * tag + 1);
    return std::move(t);
  }
#if defined(PDO_WITH_CUDA)
  // take the sender's block on this place's stream, after the sender's mark of the work that
  // wrote it; the sender keeps it until this copy has run
  pdo::detail::take_block(*place.state(), t.data(), header[R], t.bytes());
#else
  pdo::detail::no_cuda("pipeline receive", place.name());
#endif
  return std::move(t);
}

}  // namespace detail_pp

/// @brief Settings of pipeline: the schedule, the micro-batches and, over "dp", the gradient buckets.
struct pipeline_options {
  pipeline_schedule schedule = pipeline_schedule::one_f_one_b;  ///< the order of each stage's forwards and backwards
  std::size_t micro_batches = 4;  ///< micro-batches each place's rows of a global batch are cut into (at least 1)
  /// @brief On a mesh with a "dp" axis, each stage's gradients are all_reduced over "dp" in
  /// buckets of about this many bytes (pdo/nn/buckets.hpp), started during the last
  /// micro-batch's backward.
  std::size_t bucket_bytes = std::size_t{25} << 20;
  /// @brief A step whose global loss is not finite (NaN or infinite) is skipped: no stage
  /// updates its parameters. When false, such a step is a pdo::error naming the step, before
  /// any parameter changes. pipeline::skipped_steps counts such steps either way.
  bool skip_nonfinite_steps = false;
  /// @brief When set, every stage's optimizer's learning rate before each update is
  /// learning_rate(steps taken before it, skipped ones included): step_lr, cosine_lr, or any
  /// function of the step, as data_parallel_options::schedule. A rate it gives that is
  /// negative or not finite is a pdo::error before the step runs.
  lr_schedule learning_rate = {};
  /// @brief When positive, before each update the gradients of the whole model are clipped by
  /// their global norm, as torch.nn.utils.clip_grad_norm_ on one place: the norm over every
  /// element of every stage's parameters, each counted once (summed over "pp" and over the
  /// shards along "tp", not again over "dp" replicas or over copies along "tp"), and when it
  /// exceeds this every stage's gradients are scaled by clip_grad_norm / (norm + 1e-6).
  /// pipeline::last_grad_norm() gives the norm. 0: no clipping.
  double clip_grad_norm = 0;
};

/// @brief Pipeline training over the "pp" axis of a mesh, data parallel over "dp" and tensor
/// parallel over "tp" if the mesh has them: stage s, the layers [cut s-1, cut s) of the
/// model, lives on the places with "pp" coordinate s and only there (its parameters and
/// optimizer state are in their memory; along "tp" each place holds its shards of the
/// stage's Megatron pairs, and the stage's input and output are the same on each, so place
/// (dp, pp, tp) sends to and receives from (dp, pp +- 1, tp)). A step cuts the global batch by rows along "dp", then into micro-batches;
/// activations go forward and their gradients back between neighbouring stages; each
/// stage accumulates its parameters' gradients over the micro-batches (weighted by their
/// share of the global batch), all_reduces them over "dp", and steps its optimizer. So
/// the step equals one place's step on the global batch.
template <class T, std::size_t InRank, class Mesh, class Optimizer, class Loss, class... Stages>
class pipeline {
 public:
  /// @brief The number of stages; the mesh has as many places along "pp".
  static constexpr std::size_t stage_count = sizeof...(Stages);
  /// @brief The index of the "pp" axis among the mesh's axes.
  static constexpr std::size_t pp_axis = Mesh::axis_index("pp");
  /// @brief Whether the mesh has a "dp" axis: each stage is then data parallel over it.
  static constexpr bool has_dp = Mesh::has_axis("dp");
  /// @brief Whether the mesh has a "tp" axis: each stage is then tensor parallel over it.
  static constexpr bool has_tp = Mesh::has_axis("tp");
  static_assert(pp_axis < Mesh::ndim, "pdo: pipeline: the mesh needs an axis named \"pp\"");

  /// @brief Cuts `model` (a sequential) at the layers `Cuts...` (each the first layer of a stage,
  /// numbered from 0) and builds, on each place of this
  /// process, its stage and make_optimizer(its parameters). pdo::layout_error for a mesh of CPU
  /// and GPU places, a "pp" extent other than stage_count, or 0 micro-batches; pdo::error for a schedule that would not finish.
  template <class MakeOptimizer, class Model, std::size_t... Cuts>
  pipeline(const Mesh& m, const Model& model, detail_pp::cut_list<Cuts...>, MakeOptimizer make_optimizer, pipeline_options o, Loss loss)
      : mesh_(m), options_(o), loss_(loss), schedule_(make_schedule(o.schedule, stage_count, o.micro_batches)),
        states_(m.local_places().size()) {
    pdo::detail::check_holds_places(m, "pipeline");
    // neighbouring stages hand tensors over as their places' kind says (detail_pp::transport)
    for (std::size_t q = 0; q < m.size(); ++q)
      if (m.place(q).kind() != m.place(0).kind())
        throw layout_error("pipeline: place " + m.place(q).name() + " of " + m.describe() + " is not of the kind of " + m.place(0).name() +
                           "; the stages run on CPU places or on GPU places, not both");
    if (m.extent(pp_axis) != stage_count)
      throw layout_error("pipeline: the model is cut into " + std::to_string(stage_count) + " stages but " + m.describe() + " has " +
                         std::to_string(m.extent(pp_axis)) + " places along \"pp\"");
    if (o.micro_batches == 0) throw error("pipeline: micro_batches must be at least 1");
    pdo::detail::check_setting("pipeline", "clip_grad_norm", o.clip_grad_norm, o.clip_grad_norm >= 0, "finite and >= 0 (0: no clipping)");
    check_schedule(schedule_, o.micro_batches);
    using bounds =
        detail_pp::stage_bounds<std::tuple_size_v<std::remove_cvref_t<decltype(std::declval<const Model&>().layers())>>, Cuts...>;
    // the whole model's parameters, "<layer>.<name>" as a sequential names them, each with its stage
    for (const auto& q : parameters_of<T>(model)) {
      const std::size_t layer = std::stoul(q.name().substr(0, q.name().find('.')));
      std::size_t stage = 0;
      while (stage + 1 < stage_count && bounds::values[stage + 1] <= layer) ++stage;
      model_parameters_.push_back({q.name(), q.extents(), stage});
    }
    pdo::detail::run_on_places("pipeline", mesh_, [&](std::size_t p, std::size_t k) {
      auto& st = *(states_[k] = std::make_unique<place_state>());
      st.stage = mesh_.coord(p, pp_axis);
      with_stage(st.stage, [&]<std::size_t S>() {
        auto& slot = std::get<S>(st.models);
        slot.emplace(detail_pp::stage_of<bounds::values[S], bounds::values[S + 1]>(model, mesh_, p));
        st.params = parameters_of<T>(*slot);
      });
      // the parameters this place counts in the gradients' global norm (see speaks_for)
      std::size_t j = 0;
      for (const auto& q : model_parameters_) {
        if (q.stage != st.stage) continue;
        st.counted.push_back(speaks_for(p, st.params.at(j++).extents() == q.extents));
      }
      if constexpr (has_dp) st.buckets = std::make_unique<dp_buckets>(mesh_, p, st.params, bucket_options{options_.bucket_bytes, true, false});
      st.optimizer.emplace(make_optimizer(st.params));
    });
  }

  /// @brief One step on a global batch (host tensors of at least one row, else pdo::shape_error); returns its mean loss.
  /// The targets are what the loss takes (class labels `tensor<int, 1>` for cross_entropy_loss,
  /// `tensor<T, 2>` for mse_loss). A step whose loss is not finite updates nothing: a
  /// pdo::error, or with pipeline_options::skip_nonfinite_steps, the loss returned.
  template <class Inputs, class Targets>
  T step(const Inputs& inputs, const Targets& targets) {
    if constexpr (!std::is_same_v<Inputs, tensor<T, InRank>>) {
      static_assert(std::is_same_v<Inputs, tensor<T, InRank>>,
                    "pdo: pipeline::step: the inputs must be a host pdo::tensor<T, InRank>, of the pipeline's element type T "
                    "and of the rank InRank given to make_pipeline<T, InRank, Cuts...>");
      return T{};
    } else if constexpr (!takes_targets<Targets>()) {
      static_assert(pdo::detail::always_false<Targets>,
                    "pdo: pipeline::step: the loss cannot take the last stage's output and these targets: cross_entropy_loss "
                    "takes class indices tensor<int, 1> (one per row), mse_loss a tensor<T, R> of the output's shape, and a "
                    "loss of your own is called as loss(output var, targets)");
      return T{};
    } else {
      return step_on(inputs, targets);
    }
  }

  /// @brief The fraction of the rows of `inputs` (a host tensor<T, InRank>) whose largest
  /// output is at their label (class indices, one per row), as data_parallel::accuracy: the
  /// stages run their forwards only, on the micro-batches of a step, and nothing is updated.
  /// 0 for no rows. Labels that are not class indices of the outputs are a pdo::shape_error
  /// naming the first, on every place and process.
  template <class Label>
  double accuracy(const tensor<T, InRank>& inputs, const tensor<Label, 1>& labels) {
    if (labels.extent(0) != inputs.extent(0))
      throw shape_error("pipeline::accuracy: inputs " + describe(inputs) + " and labels " + describe(labels) + " differ in rows");
    if (inputs.extent(0) == 0) return 0.0;
    std::vector<std::array<double, 3>> totals(states_.size());
    // its tasks queue their sends as the stages run: the places are held
    pdo::detail::run_holding_places("pipeline::accuracy", mesh_, [&](std::size_t p, std::size_t k) {
      place_state& st = *states_[k];
      with_stage(st.stage, [&]<std::size_t S>() { totals[k] = classified_on_stage<S>(p, st, inputs, labels); });
    });
    pdo::detail::check_classified("pipeline::accuracy", labels, totals[0]);
    return totals[0][0] / static_cast<double>(inputs.extent(0));
  }

  /// @brief The steps taken so far, skipped ones included (a step refused with a pdo::error is
  /// not counted): the step number pipeline_options::learning_rate is given.
  [[nodiscard]] std::size_t steps() const { return steps_; }
  /// @brief Sets the steps taken (pdo::io's add_state restores it when training resumes from
  /// a checkpoint, so the learning-rate schedule goes on where it was).
  void set_steps(std::size_t steps) { steps_ = steps; }

 private:
  template <class Targets>
  T step_on(const tensor<T, InRank>& inputs, const Targets& targets) {
    if (targets.extent(0) != inputs.extent(0))
      throw shape_error("pipeline: inputs " + describe(inputs) + " and targets " + describe(targets) + " differ in rows");
    const std::size_t rows = inputs.extent(0);
    if (rows == 0) throw shape_error("pipeline::step: the batch " + describe(inputs) + " has no rows; a step trains on at least one");
    // the step's rate, decided (and checked) before any stage runs
    std::optional<double> lr;
    if (options_.learning_rate) {
      lr = options_.learning_rate(steps_);
      pdo::detail::check_lr("pipeline::step: learning_rate(" + std::to_string(steps_) + ")", *lr);
    }
    std::vector<T> losses(states_.size());
    // its tasks queue their sends as the stages run: the places are held
    pdo::detail::run_holding_places("pipeline::step", mesh_, [&](std::size_t p, std::size_t k) {
      // over several processes each passes its own batch: they must agree before any stage runs
      if (mesh_.is_multiprocess()) pdo::detail::check_same_host_shapes(mesh_, p, inputs.shape(), targets.shape());
      place_state& st = *states_[k];
      with_stage(st.stage, [&]<std::size_t S>() { losses[k] = run_stage<S>(p, st, inputs, targets, rows, lr); });
    });
    if (!std::isfinite(static_cast<double>(losses[0]))) {
      ++skipped_steps_;
      // a refused step is not counted: the next one has the number it had
      if (!options_.skip_nonfinite_steps)
        pdo::detail::refuse_nonfinite_step("pipeline", steps_ + 1, rows, mesh_.describe(), static_cast<double>(losses[0]));
    }
    ++steps_;
    return losses[0];
  }

 public:

  /// @brief The steps taken so far whose loss was not finite, so that nothing was updated
  /// (skipped with pipeline_options::skip_nonfinite_steps, or a pdo::error without it).
  [[nodiscard]] std::size_t skipped_steps() const { return skipped_steps_; }
  /// @brief Sets the count of skipped steps (pdo::io's add_state restores it with the steps).
  void set_skipped_steps(std::size_t n) { skipped_steps_ = n; }

  /// @brief The most micro-batches whose activations each stage of this process held at once in the last step.
  [[nodiscard]] std::vector<std::size_t> max_in_flight() const {
    std::vector<std::size_t> out;
    for (const auto& s : states_) out.push_back(s->max_in_flight);
    return out;
  }
  /// @brief The action list of every stage, indexed by stage (see make_schedule).
  [[nodiscard]] const std::vector<std::vector<pipeline_action>>& schedule() const { return schedule_; }
  /// @brief The parameters of this process's k-th place (those of its stage, or its shards of them along "tp").
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(std::size_t k) const { return states_[k]->params; }
  /// @brief The optimizer of this process's k-th place (its stage's parameters).
  [[nodiscard]] Optimizer& optimizer(std::size_t k) { return *states_[k]->optimizer; }
  /// @brief The mesh trained over.
  [[nodiscard]] const Mesh& mesh() const { return mesh_; }

  /// @brief A parameter of the whole model as make_pipeline was given it: its name there
  /// ("<layer>.<name>"), its whole shape, and the stage that holds it.
  struct model_parameter {
    std::string name;                  ///< "<layer>.<name>", as the whole sequential names it
    std::vector<std::size_t> extents;  ///< the whole parameter's shape
    std::size_t stage = 0;             ///< the stage whose places hold it
  };
  /// @brief The whole model's parameters, in the model's order (the same on every process).
  [[nodiscard]] const std::vector<model_parameter>& model_parameters() const { return model_parameters_; }

  /// @brief Where this process's k-th place holds model parameter g: its index in
  /// parameters(k) (npos when the place's stage does not hold it), the offset of the place's
  /// block in the whole parameter (a shard along "tp" starts inside it), and whether the place
  /// is the one that speaks for the block (the first along "dp", and along "tp" when every
  /// member holds it whole).
  struct parameter_part {
    static constexpr std::size_t npos = static_cast<std::size_t>(-1);  ///< `index` of a parameter not held
    std::size_t index = npos;          ///< the parameter's index in parameters(k), or npos
    std::vector<std::size_t> offset;   ///< where the place's block starts in the whole parameter, per dim
    bool first = false;                ///< whether this place speaks for the block (saves it, say)
  };
  /// @brief Where this process's k-th place holds model parameter `g` (an index into model_parameters()).
  [[nodiscard]] parameter_part part_of(std::size_t k, std::size_t g) const {
    const place_state& st = *states_[k];
    const model_parameter& q = model_parameters_.at(g);
    parameter_part part;
    if (q.stage != st.stage) return part;
    std::size_t j = 0;
    for (std::size_t i = 0; i < g; ++i) j += model_parameters_[i].stage == st.stage ? 1 : 0;
    const std::size_t p = mesh_.local_places()[k];
    const auto held = st.params.at(j).extents();
    part.index = j;
    part.offset.assign(held.size(), 0);
    bool whole = true;
    for (std::size_t d = 0; d < held.size(); ++d) {
      if (held[d] == q.extents[d]) continue;
      whole = false;
      if constexpr (has_tp) {
        const std::size_t tp = Mesh::axis_index("tp");
        part.offset[d] = pdo::detail::chunk_offset(q.extents[d], mesh_.extent(tp), mesh_.coord(p, tp));
      } else {
        throw layout_error("pipeline: parameter " + q.name + " of stage " + std::to_string(q.stage) + " is " +
                           pdo::detail::format_extents(q.extents) + " in the model but " + pdo::detail::format_extents(held) +
                           " on place " + mesh_.place(p).name());
      }
    }
    part.first = speaks_for(p, whole);
    return part;
  }
  /// @brief The global norm of the gradients the last step clipped, before clipping (the same
  /// on every place; computed when pipeline_options::clip_grad_norm is set, 0 otherwise; NaN
  /// after a step whose loss was not finite, which clipped and updated nothing).
  [[nodiscard]] double last_grad_norm() const { return states_.empty() ? 0.0 : states_[0]->grad_norm; }
  /// @brief Seconds each place of this process spent computing in the last step, and the step's length.
  [[nodiscard]] std::vector<double> busy_seconds() const {
    std::vector<double> out;
    for (const auto& s : states_) out.push_back(s->busy);
    return out;
  }
  /// @brief The last step's length in seconds: the longest time among this process's places.
  [[nodiscard]] double last_step_seconds() const {
    double longest = 0;
    for (const auto& s : states_) longest = std::max(longest, s->seconds);
    return longest;
  }

 private:
  /// @brief Stage S's model, and the values it takes and gives (stage 0 takes the inputs).
  template <std::size_t S, bool First = (S == 0)>
  struct stage_types;
  template <std::size_t S>
  struct stage_types<S, true> {
    using model = std::tuple_element_t<S, std::tuple<Stages...>>;
    using in = tensor<T, InRank>;
    using out = std::remove_cvref_t<decltype(std::declval<const model&>()(std::declval<const var<in>&>()).value())>;
  };
  template <std::size_t S>
  struct stage_types<S, false> {
    using model = std::tuple_element_t<S, std::tuple<Stages...>>;
    using in = typename stage_types<S - 1>::out;
    using out = std::remove_cvref_t<decltype(std::declval<const model&>()(std::declval<const var<in>&>()).value())>;
  };

  /// @brief Whether the loss takes the last stage's output and targets `Targets`.
  template <class Targets>
  static constexpr bool takes_targets() {
    using last = stage_types<stage_count - 1>;
    using output = std::invoke_result_t<const typename last::model&, const var<typename last::in>&>;
    return std::is_invocable_v<Loss&, const output&, const Targets&>;
  }

  struct no_buckets {};
  /// @brief A stage's gradient buckets over "dp" (a mesh without "dp" has none).
  using dp_buckets = typename std::conditional_t<has_dp, std::type_identity<gradient_buckets<T, Mesh, "dp">>,
                                                 std::type_identity<no_buckets>>::type;

  struct place_state {
    std::size_t stage = 0;
    std::tuple<std::optional<Stages>...> models;
    std::vector<parameter_ref<T>> params;
    std::unique_ptr<dp_buckets> buckets;  ///< with a "dp" axis: the stage's gradients, synced over it
    std::optional<Optimizer> optimizer;
    detail_pp::async_sender forward_sends{lane_kind::communication}, backward_sends{lane_kind::copy};
    std::vector<bool> counted;  ///< per parameter: whether this place counts it in the global norm
    double grad_norm = 0;       ///< the gradients' global norm in the last step (when clipping)
    std::size_t max_in_flight = 0;
    double busy = 0;     ///< seconds computing in the last step
    double seconds = 0;  ///< the last step, as this place saw it
  };

  /// @brief Whether place p speaks for its block of a parameter (held `whole`, or its shard
  /// along "tp"): the first along "dp" (the others hold the same after the sync), and along
  /// "tp" the first when every member holds the parameter whole. Each element of the model
  /// has exactly one such place.
  [[nodiscard]] bool speaks_for(std::size_t p, bool whole) const {
    bool first = true;
    if constexpr (has_dp) first = mesh_.coord(p, Mesh::axis_index("dp")) == 0;
    if constexpr (has_tp)
      if (whole) first = first && mesh_.coord(p, Mesh::axis_index("tp")) == 0;
    return first;
  }

  template <class F>
  static void with_stage(std::size_t s, F&& f) {
    [&]<std::size_t... S>(std::index_sequence<S...>) {
      ((s == S ? (f.template operator()<S>(), 0) : 0), ...);
    }(std::make_index_sequence<stage_count>{});
  }

  /// @brief Place p's links to the places before and after it along "pp".
  [[nodiscard]] detail_pp::channel link_of(std::size_t p) const {
    const auto& place = mesh_.place(p);
    const std::size_t me = mesh_.coord(p, pp_axis);
    detail_pp::channel link{communicator_along(mesh_, pp_axis, p), host_communicator_of(mesh_, p)};
    const auto line = mesh_.group(pp_axis, p);
    link.previous = me == 0 ? me : me - 1;
    link.next = me + 1 < line.size() ? me + 1 : me;
    link.previous_place = line[link.previous];
    link.next_place = line[link.next];
    link.to_previous = detail_pp::transport_between(*place.state(), *mesh_.place(link.previous_place).state());
    link.to_next = detail_pp::transport_between(*place.state(), *mesh_.place(link.next_place).state());
    return link;
  }
  /// @brief Place p's rows of a batch of `global_rows`: its "dp" share, as {first, count}
  /// (all of them without a "dp" axis).
  [[nodiscard]] std::pair<std::size_t, std::size_t> rows_of(std::size_t p, std::size_t global_rows) const {
    if constexpr (has_dp) {
      const std::size_t dp = Mesh::axis_index("dp"), n = mesh_.extent(dp), c = mesh_.coord(p, dp);
      return {pdo::detail::chunk_offset(global_rows, n, c), pdo::detail::chunk_size(global_rows, n, c)};
    } else {
      return {0, global_rows};
    }
  }

  /// @brief The classification of place p's rows of the batch (classify_rows): stage S runs
  /// its forwards only, micro-batch by micro-batch, receiving from the stage before and
  /// sending to the one after; the last stage counts (once per "tp" group). Summed over the
  /// whole mesh, so every place returns the batch's counts.
  template <std::size_t S, class Labels>
  std::array<double, 3> classified_on_stage(std::size_t p, place_state& st, const tensor<T, InRank>& inputs, const Labels& labels) {
    using types = stage_types<S>;
    using in_t = typename types::in;
    constexpr bool first = S == 0, last = S + 1 == stage_count;
    const auto& place = mesh_.place(p);
    const auto& model = *std::get<S>(st.models);
    const detail_pp::channel link = link_of(p);
    const auto share = rows_of(p, inputs.extent(0));
    const std::size_t first_row = share.first, my_rows = share.second;
    const std::size_t micros = options_.micro_batches;
    std::array<double, 3> counts{};
    st.forward_sends.reset();
    try {
      for (std::size_t m = 0; m < micros; ++m) {
        const std::size_t m0 = first_row + pdo::detail::chunk_offset(my_rows, micros, m);
        const std::size_t mr = pdo::detail::chunk_size(my_rows, micros, m);
        const int tag = static_cast<int>(m);
        var<in_t> x;
        if constexpr (first) x = var<in_t>(pdo::detail::cut_rows(inputs, m0, mr, place));
        else x = var<in_t>(detail_pp::receive<T, in_t::rank>(link, true, tag, place));
        // a failure of the forward is named in the caller's rows
        const auto y = pdo::detail::naming_rows([&] { return pdo::detail::rows_context(m0, mr); }, [&] { return model(x); });
        if constexpr (last) {
          bool counted = mr > 0;
          if constexpr (has_tp) counted = counted && mesh_.coord(p, Mesh::axis_index("tp")) == 0;
          if (counted) {
            const auto c = pdo::detail::classify_rows(y.value(), pdo::detail::cut_rows(labels, m0, mr, place));
            for (std::size_t i = 0; i < c.size(); ++i) counts[i] += c[i];
          }
        } else {
          st.forward_sends.send(*place.state(), link, typename types::out(y.value()), true, tag);
        }
      }
    } catch (...) {
      pdo::detail::comms_of(mesh_).abort();  // release the other stages before waiting for our sends
      st.forward_sends.drain(/*withdraw=*/true);
      throw;
    }
    st.forward_sends.drain();
    if (const auto f = st.forward_sends.failure()) f->rethrow_with_context("pipeline send: ");
    host_communicator_of(mesh_, p).all_reduce(std::span<double>(counts));
    return counts;
  }

  template <std::size_t S, class Inputs, class Targets>
  T run_stage(std::size_t p, place_state& st, const Inputs& inputs, const Targets& targets, std::size_t global_rows,
              std::optional<double> lr) {
    using types = stage_types<S>;
    using in_t = typename types::in;
    using out_t = typename types::out;
    constexpr bool first = S == 0, last = S + 1 == stage_count;
    const auto& place = mesh_.place(p);
    const auto& model = *std::get<S>(st.models);
    const detail_pp::channel link = link_of(p);
    const auto share = rows_of(p, global_rows);
    const std::size_t first_row = share.first, my_rows = share.second;
    const std::size_t micros = options_.micro_batches;
    std::vector<std::optional<var<in_t>>> xs(micros);
    std::vector<std::optional<var<out_t>>> ys(micros);
    std::vector<std::optional<var<tensor<T, 0>>>> micro_losses(micros);
    st.forward_sends.reset();
    st.backward_sends.reset();
    st.max_in_flight = 0;
    st.busy = 0;
    const auto step_start = std::chrono::steady_clock::now();
    if constexpr (has_dp) {
      st.buckets->begin_step();  // no gradients yet
    } else {
      for (auto& q : st.params) q.zero_grad();
    }
    // the last backward completes the gradients: it starts the "dp" buckets
    std::size_t last_backward = 0;
    for (std::size_t i = 0; i < schedule_[S].size(); ++i)
      if (!schedule_[S][i].forward) last_backward = i;
    std::size_t in_flight = 0, action = 0;
    T total{};
    try {
      for (const auto& a : schedule_[S]) {
        if constexpr (has_dp)
          if (action++ == last_backward) st.buckets->arm();
        const std::size_t m0 = first_row + pdo::detail::chunk_offset(my_rows, micros, a.micro);
        const std::size_t mr = pdo::detail::chunk_size(my_rows, micros, a.micro);
        const int tag = static_cast<int>(a.micro);
        if (a.forward) {
          var<in_t> x;
          if constexpr (first) x = var<in_t>(pdo::detail::cut_rows(inputs, m0, mr, place));
          else x = parameter(detail_pp::receive<T, in_t::rank>(link, true, tag, place));
          const auto t0 = std::chrono::steady_clock::now();
          // a mistake in the data (a label out of range, say) is named in the caller's rows
          const auto rows = [&] { return pdo::detail::rows_context(m0, mr); };
          auto y = pdo::detail::naming_rows(rows, [&] { return model(x); });
          if constexpr (last) {
            if (mr > 0) {
              auto loss = pdo::detail::naming_rows(rows, [&] {
                return loss_(y, pdo::detail::cut_rows(targets, m0, mr, place)) * (static_cast<T>(mr) / static_cast<T>(global_rows));
              });
              total += pdo::detail::scalar_of(loss.value());
              micro_losses[a.micro] = std::move(loss);
            }
          } else {
            st.forward_sends.send(*place.state(), link, out_t(y.value()), true, tag);
            ys[a.micro] = std::move(y);
          }
          st.busy += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          xs[a.micro] = std::move(x);
          st.max_in_flight = std::max(st.max_in_flight, ++in_flight);
        } else {
          if constexpr (last) {
            const auto t0 = std::chrono::steady_clock::now();
            if (micro_losses[a.micro]) pdo::backward(*micro_losses[a.micro]);
            st.busy += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          } else {
            auto g = detail_pp::receive<T, out_t::rank>(link, false, tag, place);
            const auto t0 = std::chrono::steady_clock::now();
            if (ys[a.micro]->requires_grad()) pdo::backward(*ys[a.micro], std::move(g));
            st.busy += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          }
          if constexpr (!first) {
            const auto& x = *xs[a.micro];
            st.backward_sends.send(*place.state(), link, x.has_grad() ? in_t(x.grad()) : in_t(x.shape(), place), false, tag);
          }
          xs[a.micro].reset();
          ys[a.micro].reset();
          micro_losses[a.micro].reset();
          --in_flight;
        }
      }
    } catch (...) {
      pdo::detail::comms_of(mesh_).abort();  // release the other stages before waiting for our sends
      st.forward_sends.drain(/*withdraw=*/true);
      st.backward_sends.drain(/*withdraw=*/true);
      if constexpr (has_dp) st.buckets->abandon();
      throw;
    }
    st.forward_sends.drain();
    st.backward_sends.drain();
    if (const auto f = st.forward_sends.failure()) f->rethrow_with_context("pipeline send: ");
    if (const auto f = st.backward_sends.failure()) f->rethrow_with_context("pipeline send: ");
    if constexpr (has_dp) {
      // a parameter no replica's backward reached (a branch its layers did not take) is left
      // without a gradient, so the update leaves it alone, as on one place
      st.buckets->settle_reached();
      st.buckets->finish();
    }
    // the step's loss, known to the last stage of each "dp" row (once per "tp" group), and
    // with clipping the squares of the gradients each place speaks for: summed over the whole
    // mesh, so every stage knows them before it updates anything
    std::array<double, 2> sums{static_cast<double>(total), 0.0};
    if constexpr (has_tp) sums[0] = mesh_.coord(p, Mesh::axis_index("tp")) == 0 ? sums[0] : 0.0;
    const bool clip = options_.clip_grad_norm > 0;
    if (clip)
      for (std::size_t j = 0; j < st.params.size(); ++j)
        if (st.counted[j]) sums[1] += st.params[j].grad_squared_norm();
    host_communicator_of(mesh_, p).all_reduce(std::span<double>(sums.data(), clip ? 2 : 1));
    const double sum = sums[0];
    // a step that updates nothing clipped nothing: its norm is NaN, not the last step's
    if (clip) st.grad_norm = std::numeric_limits<double>::quiet_NaN();
    // the loss as step() returns it (in T) decides, so that an update and its report agree
    if (std::isfinite(static_cast<double>(static_cast<T>(sum)))) {  // else no stage updates (step() says why)
      if (clip) {
        st.grad_norm = std::sqrt(sums[1]);
        const double f = clip_factor(st.grad_norm, options_.clip_grad_norm);
        if (f < 1) scale_grads(st.params, f);
      }
      if (lr) st.optimizer->set_lr(*lr);
      st.optimizer->step();
    }
    st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
    return static_cast<T>(sum);
  }

  Mesh mesh_;
  pipeline_options options_;
  Loss loss_;
  std::vector<std::vector<pipeline_action>> schedule_;
  std::vector<std::unique_ptr<place_state>> states_;
  std::vector<model_parameter> model_parameters_;
  std::size_t steps_ = 0;          ///< steps taken, refused ones not counted (their number names a failed one)
  std::size_t skipped_steps_ = 0;  ///< steps whose loss was not finite
};

/// @brief A pipeline over the "pp" axis of `m`: `model` (a sequential, built anywhere) is cut
/// at the layers `Cuts...` (each the first layer of a stage, numbered from 0 as in the parameters'
/// names: cuts 2, 4 give stages of layers 0-1, 2-3 and 4 on) into stages whose layers are
/// copied to their places.
/// `make_optimizer(parameters)` builds each stage's optimizer on its place.
/// @tparam InRank the rank of the inputs (2 for [batch, features], 4 for images)
template <class T, std::size_t InRank, std::size_t... Cuts, class Mesh, class... Layers, class MakeOptimizer,
          class Loss = cross_entropy_loss>
auto make_pipeline(const Mesh& m, const sequential<Layers...>& model, MakeOptimizer make_optimizer, pipeline_options o = {},
                   Loss loss = {}) {
  using bounds = detail_pp::stage_bounds<sizeof...(Layers), Cuts...>;
  constexpr bool cuts_fit = [] {
    for (std::size_t s = 0; s + 1 < bounds::values.size(); ++s)
      if (bounds::values[s] >= bounds::values[s + 1]) return false;
    return true;
  }();
  static_assert(cuts_fit,
                "pdo: pipeline: every stage needs at least one layer: the cut points must increase and lie inside the model "
                "(a cut c starts a stage at layer c, counted from 0: a sequential of N layers takes cuts 1 .. N-1)");
  // after an error, a trainer doing nothing: the uses of the pipeline report nothing more
  if constexpr (!cuts_fit) {
    return detail_dp::unformed_trainer<T>{};
  } else if constexpr (!detail_nn::holds_parameters_of<T, sequential<Layers...>>::value) {
    static_assert(detail_nn::holds_parameters_of<T, sequential<Layers...>>::value,
                  "pdo: make_pipeline<T>: the model's parameters are not of element type T: build its layers with T "
                  "(linear<T>, conv2d<T>) or pipeline it as make_pipeline<its element type>");
    return detail_dp::unformed_trainer<T>{};
  } else if constexpr (Mesh::has_axis("tp") && !(detail_tp::convertible_v<Layers> && ...)) {
    static_assert(pdo::detail::always_false<Mesh>,
                  "pdo: pipeline: on a mesh with a \"tp\" axis every stage is tensor parallel: the model may hold linear "
                  "layers and layers without parameters (activations); train other layers on a mesh without \"tp\"");
    return detail_dp::unformed_trainer<T>{};
  } else if constexpr (!detail_pp::stages_hold_whole_pairs<Mesh, bounds, Layers...>()) {
    static_assert(detail_pp::stages_hold_whole_pairs<Mesh, bounds, Layers...>(),
                  "pdo: pipeline: on a mesh with a \"tp\" axis every stage is tensor parallel: cut the model so that each "
                  "stage holds whole column/row pairs of linear layers (an even number of them: cut after the model's "
                  "2nd, 4th, ... linear layer)");
    return detail_dp::unformed_trainer<T>{};
  } else if constexpr (Mesh::has_axis("tp") && !detail_tp::norms_outside_pairs<Layers...>()) {
    static_assert(pdo::detail::always_false<Mesh>,
                  "pdo: pipeline: on a mesh with a \"tp\" axis every stage is tensor parallel: a layer_norm sits between the "
                  "column and the row layer of a pair, where the features are split along \"tp\"; put it before the pair's "
                  "first linear layer or after its second");
    return detail_dp::unformed_trainer<T>{};
  } else if constexpr (!std::is_invocable_v<MakeOptimizer&, std::vector<parameter_ref<T>>>) {
    static_assert(std::is_invocable_v<MakeOptimizer&, std::vector<parameter_ref<T>>>,
                  "pdo: make_pipeline: make_optimizer must be a callable that takes a stage's parameters, "
                  "std::vector<pdo::nn::parameter_ref<T>>, and builds its optimizer ([](auto p) { return sgd<T>(std::move(p), {...}); })");
    return detail_dp::unformed_trainer<T>{};
  } else if constexpr (!optimizer<std::invoke_result_t<MakeOptimizer&, std::vector<parameter_ref<T>>>, T>) {
    static_assert(pdo::detail::always_false<MakeOptimizer>,
                  "pdo: make_pipeline<T>: make_optimizer must build an optimizer of T parameters (sgd<T>, adam<T>, "
                  "any_optimizer<T>, or a type that meets pdo::nn::optimizer<O, T>)");
    return detail_dp::unformed_trainer<T>{};
  } else {
    using optimizer_t = std::invoke_result_t<MakeOptimizer&, std::vector<parameter_ref<T>>>;
    return [&]<std::size_t... S>(std::index_sequence<S...>) {
      using pipeline_t = pipeline<T, InRank, Mesh, optimizer_t, Loss,
                                  decltype(detail_pp::stage_of<bounds::values[S], bounds::values[S + 1]>(model, m, std::size_t{}))...>;
      return pipeline_t(m, model, detail_pp::cut_list<Cuts...>{}, std::move(make_optimizer), o, loss);
    }(std::make_index_sequence<sizeof...(Cuts) + 1>{});
  }
}

}  // namespace pdo::nn
