// pdo/nn/data_parallel.hpp: data-parallel training: a replica of the model on every place
// (CPU or GPU), gradients synced in buckets that overlap backward (pdo/nn/buckets.hpp), the
// optimizer on every place, the next batch cut while the current one trains
// (pdo/nn/batching.hpp): all engine tasks on the places' lanes.
#pragma once

#include <pdo/autograd.hpp>
#include <pdo/exec/run_on_places.hpp>
#include <pdo/layout/redistribute_plan.hpp>
#include <pdo/nn/batching.hpp>
#include <pdo/nn/buckets.hpp>
#include <pdo/nn/layers.hpp>
#include <pdo/nn/losses.hpp>
#include <pdo/nn/optim.hpp>
#include <pdo/nn/sliced_weights.hpp>
#include <pdo/plan/explain.hpp>
#include <pdo/plan/plan.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo::nn {

/// @brief Settings of data_parallel: gradient buckets, ZeRO-1, non-finite steps, replica
/// start-up, gradient clipping and the learning-rate schedule.
struct data_parallel_options {
  /// @brief Gradients are all_reduced in buckets of about this many bytes (at least one
  /// parameter each), in the order backward completes them (PyTorch DDP's default: 25 MiB).
  std::size_t bucket_bytes = std::size_t{25} << 20;
  /// @brief Start a bucket's all_reduce as soon as its last gradient is ready, while
  /// backward goes on; false: all buckets after backward (for comparison).
  bool overlap = true;
  /// @brief ZeRO stage 1: the optimizer state is sharded over "dp". Each bucket's
  /// gradients are reduce_scattered (each place gets the sum of its slice), each place
  /// updates its slice of the parameters with its slice of the optimizer state, and the
  /// slices are all_gathered back. Optimizer memory per place: 1/n.
  bool zero1 = false;
  /// @brief A step whose global loss is not finite (NaN or infinite) is skipped: no update,
  /// and fit leaves it out of the epoch's loss (epoch_stats::skipped_steps counts it). When
  /// false, such a step is a pdo::error naming the step, before any parameter changes.
  bool skip_nonfinite_steps = false;
  /// @brief At start-up every replica's parameters are overwritten by place 0's (a broadcast
  /// over the mesh, as PyTorch DDP does), so replicas start equal whatever the factories did.
  bool broadcast_parameters = true;
  /// @brief At start-up (after the broadcast, if any), check that every replica's parameters
  /// equal place 0's, bit for bit: a pdo::error naming the parameter and the place otherwise.
  /// (check_replicas() does the same at any time.)
  bool check_replicas = false;
  /// @brief When positive, the summed gradients are clipped by their global norm before each
  /// update (clip_grad_norm: scaled by max / (norm + 1e-6) when the norm exceeds it); the norm
  /// of the last step is last_grad_norm(). Under ZeRO-1 the norm is summed over the slices.
  /// 0: no clipping; a negative or non-finite value is a pdo::error when the trainer is made.
  double clip_grad_norm = 0;
  /// @brief When set, the optimizer's learning rate before each update is schedule(steps
  /// taken before it): step_lr, cosine_lr, or any function of the step.
  lr_schedule schedule = {};
  /// @brief On a mesh of CPU places in one process, with an optimizer that takes fused
  /// updates (nn::sgd, nn::adam, any_optimizer holding one): after backward, each bucket's
  /// all_reduce hands the summed gradient to the optimizer's update while it makes it, instead
  /// of writing it back for a step() after. Each place sums its part of every bucket and
  /// updates that part of every replica, in one pass over gradients and parameters (the same
  /// arithmetic: the same values, bit for bit): less memory traffic than the all_reduce and
  /// the update it replaces, but none of it overlaps backward (on two cores the two ways
  /// measure within a few percent of each other: benchmarks/train.cpp). The gradients a step
  /// leaves are then each place's own, not the sum, and a failure inside the fused pass (a
  /// place's failure aborting a bucket) leaves the buckets before it updated, where the
  /// unfused trainer fails before any update. Elsewhere (GPU places, several processes,
  /// ZeRO-1, clip_grad_norm, another optimizer), and by default, the buckets' all_reduces
  /// overlap backward (`overlap`) and step() follows, as PyTorch DDP does.
  bool fused_update = false;
  /// @brief With nn::sgd without momentum (or an any_optimizer holding one), on the places
  /// where fused_update applies: the gradient of each weight W [K, N] used as x W (a local
  /// matrix, a right operand of matmul) is made summed and sliced instead of all_reduced.
  /// Each place all_gathers x and g over "dp" (the batch's rows, K + N elements each) while
  /// backward runs and, once the weight's last use in backward is done, computes its K / n
  /// rows of the summed xᵀ g over all the batch's rows, a BLAS call per product (cut over
  /// the place's cores) whose alpha and beta apply the SGD update (the gradient is never
  /// stored); after backward it broadcasts its updated rows to every replica. Per weight that
  /// moves the gathered rows and K N elements, where the all_reduce moves 2 K N (n - 1) / n
  /// and every replica then updates all of W; a weight for which the batch's rows times
  /// (K + N) reach K N has its gradient all_reduced after backward instead, and the same
  /// update applied (chosen each step, by bytes). Worth it when the batch's rows are few next
  /// to the weights' (benchmarks/train.cpp: 256 rows, 4096 x 4096 weights). The other
  /// parameters (biases) take the fused update (so fused_update() is true too). The same
  /// values as the default within rounding (the products add the rows in another order). In
  /// a step of one micro-batch with rows on every place, the loss is summed and checked
  /// before backward (a step whose loss is not finite runs no backward); backward leaves the
  /// weights no gradient; every place's backward must reach the same weights' products in the
  /// same order (a model whose path depends on its data gets a pdo::mismatch_error on every
  /// place); and a step that fails after a weight's products were made (a failure later in
  /// backward, or in the sync) leaves those rows updated on the places that made them, so
  /// the replicas differ (check_replicas() says where; resume from a checkpoint). A step of
  /// several micro-batches, or one that leaves some place no rows, all_reduces those
  /// gradients after backward and applies the same update, as it does a gradient a weight
  /// gets otherwise (a weight also used as Wᵀ). Elsewhere, the trainer runs as without it
  /// (sliced_weight_gradients() says which).
  bool sliced_weight_gradients = false;
};

}  // namespace pdo::nn

namespace pdo::detail {

/// @brief The sum over the places of p's line along `axis` of each of `values` (host
/// numbers: a loss, a count), through the mesh's host group whatever its devices.
template <class Mesh>
std::vector<double> sum_each_along(const Mesh& m, std::size_t axis, std::size_t p, std::span<const double> values) {
  return sum_each_over(host_communicator_of(m, p), m.group(axis, p), values);
}
/// @brief sum_each_along of N numbers.
template <class Mesh, std::size_t N>
std::array<double, N> sum_along(const Mesh& m, std::size_t axis, std::size_t p, const std::array<double, N>& values) {
  const std::vector<double> sum = sum_each_along(m, axis, p, std::span<const double>(values));
  std::array<double, N> out{};
  std::copy(sum.begin(), sum.end(), out.begin());
  return out;
}

}  // namespace pdo::detail

namespace pdo::nn {

/// @brief What a data-parallel trainer's fit reports after each epoch.
struct epoch_stats {
  std::size_t epoch = 0;      ///< the epoch's index, from 0, counted on across resumed runs
  double loss = 0;            ///< mean training loss over the epoch's samples
  double accuracy = 0;        ///< on the training samples, from the step's outputs
  double samples_per_second = 0;  ///< all the epoch's samples (skipped steps too) over its wall-clock seconds
  std::size_t samples = 0;         ///< the samples whose loss counts (those of skipped steps do not)
  std::size_t skipped_steps = 0;   ///< steps with a non-finite loss, skipped (data_parallel_options::skip_nonfinite_steps)
};

/// @brief Settings of a data-parallel trainer's fit.
struct fit_options {
  std::size_t epochs = 1;       ///< epochs to train in this call, after those already trained
  std::size_t batch_size = 64;  ///< global batch
  std::uint64_t seed = 0;       ///< for the order of the samples in each epoch
  bool shuffle = true;          ///< a new order each epoch; false: the inputs' order
  /// @brief Each global batch is run as this many micro-batches whose gradients add up
  /// before one sync and one update (see step()).
  std::size_t micro_batches = 1;
};

/// @brief Data-parallel training over the "dp" axis of a mesh, on CPU or GPU places.
///
/// Every place holds its own replica of the model and of the optimizer state, built by
/// the factories on that place (so their memory is the place's). A step splits the global
/// batch by rows along "dp" (uneven shards allowed: 10 rows on 4 places train 3, 3, 2, 2),
/// runs forward and backward on every place at once, and sums the gradients. The loss of
/// each place is weighted by its share of the global batch, so the summed gradient is the
/// gradient of the global batch's mean loss: training on N places follows the same
/// trajectory as on one place with the same global batch.
///
/// How the gradients are summed, the planner derives: a replicated parameter used on rows
/// split along "dp" gets a gradient matmul(xᵀ, g) whose layout is partial over "dp", and
/// the plan that brings it back to the parameter's layout is one all_reduce
/// (`gradient_sync_plan`, checked at compile time below), which each gradient bucket runs.
template <class T, class Model, class Optimizer, class Mesh, class Loss = cross_entropy_loss>
class data_parallel {
 public:
  /// @brief The mesh type trained over; it has an axis named "dp".
  using mesh_type = Mesh;
  /// @brief The index of the "dp" axis among the mesh's axes.
  static constexpr std::size_t dp_axis = Mesh::axis_index("dp");
  static_assert(dp_axis < Mesh::ndim, "pdo: data_parallel: the mesh needs an axis named \"dp\"");

  /// @brief The batch's layout, as the planner sees it: rows split along "dp", the rest replicated.
  using data_layout = layout<split<"dp">, replicate>;
  /// @brief A replicated parameter's layout: every place holds all of it.
  using param_layout = layout<replicate, replicate>;
  /// @brief The layout the planner derives for such a parameter's gradient, matmul(xᵀ, g) of rows split
  /// along "dp": partial over "dp".
  using gradient_layout =
      result_layout_t<decltype(pdo::matmul(pdo::transpose(std::declval<const dtensor<T, 2, Mesh, data_layout>&>()),
                                           std::declval<const dtensor<T, 2, Mesh, data_layout>&>()))>;
  /// @brief The plan from gradient_layout to param_layout: one all_reduce over "dp" (checked just below).
  static constexpr redistribute_plan gradient_sync_plan = redistribute_plan_of<gradient_layout, param_layout>();
  static_assert(gradient_sync_plan.size == 1 && gradient_sync_plan.steps[0].kind == step_kind::all_reduce &&
                    gradient_sync_plan.steps[0].axis == "dp",
                "pdo: data_parallel: the planner should sync replicated gradients with one all_reduce over \"dp\"");
  /// @brief The buckets each replica syncs its gradients in, over "dp".
  using buckets_type = gradient_buckets<T, Mesh, "dp">;
  static_assert(buckets_type::sync_plan.steps[0].kind == gradient_sync_plan.steps[0].kind,
                "pdo: data_parallel: a bucket syncs its gradients as the planner syncs a parameter's");

  /// @brief Builds a replica on every place of this process, on its lane: make_model(), then
  /// make_optimizer(parameters) (under ZeRO-1, of the place's slices), after the broadcast and replica
  /// check that `o` asks for. `loss(output, targets)` is the loss each step minimises.
  template <class MakeModel, class MakeOptimizer>
  data_parallel(const Mesh& m, MakeModel make_model, MakeOptimizer make_optimizer, data_parallel_options o = {}, Loss loss = {})
      : mesh_(m), options_(o), loss_(loss), replicas_(m.local_places().size()) {
    pdo::detail::check_setting("data_parallel", "clip_grad_norm", o.clip_grad_norm, o.clip_grad_norm >= 0,
                               "finite and >= 0 (0: no clipping)");
    pdo::detail::check_holds_places(mesh_, "data_parallel");
    pdo::detail::run_on_places("data_parallel", mesh_, [&](std::size_t p, std::size_t k) {
      auto& r = *(replicas_[k] = std::make_unique<replica>());
      r.place = p;
      r.model.emplace(make_model());
      r.params = parameters_of<T>(*r.model);
      if (options_.broadcast_parameters || options_.check_replicas) check_replica_shapes(p, r.params);
      if (options_.broadcast_parameters) broadcast_from_first(p, r.params);
      if (options_.check_replicas) check_replicas_on(p, r.params);
      r.buckets = std::make_unique<buckets_type>(mesh_, p, r.params, bucket_options{options_.bucket_bytes, options_.overlap, options_.zero1});
      r.synced.resize(r.params.size());
      std::iota(r.synced.begin(), r.synced.end(), std::size_t{0});
      r.optimizer.emplace(make_optimizer(options_.zero1 ? r.buckets->slices() : r.params));
    });
    fused_ = fusable();
    if (fused_ && options_.sliced_weight_gradients) slice_weights();
    // sliced weights take the fused update for the other parameters; without them, as asked
    if (!sliced_weight_gradients()) fused_ = fused_ && options_.fused_update;
  }

  /// @brief One training step on a global batch (host tensors: inputs [B, ...], targets
  /// [B, ...], B at least 1, else pdo::shape_error); returns the mean loss over the global batch. A loss that is not finite is a
  /// pdo::error naming the step, with no parameter updated (or, with
  /// data_parallel_options::skip_nonfinite_steps, returned with no update).
  ///
  /// With `micro_batches` > 1 the global batch is cut into that many micro-batches (by the
  /// chunk rule), each run forward and backward in turn on every place, its gradients added to
  /// the previous ones without any communication (PyTorch DDP's no_sync); the last one's
  /// backward syncs the sum in buckets, and one update follows. The result equals one step on
  /// the whole batch (within rounding), with the activations of one micro-batch at a time.
  template <std::size_t R, class Target>
  T step(const tensor<T, R>& inputs, const Target& targets, std::size_t micro_batches = 1) {
    if constexpr (!detail_nn::loss_takes<Loss, Model, T, R, Target>) {
      static_assert(pdo::detail::always_false<Target>,
                    "pdo: data_parallel::step: the loss cannot take the model's output and these targets: cross_entropy_loss "
                    "takes class indices tensor<int, 1> (one per row), mse_loss a tensor<T, R> of the output's shape, and a "
                    "loss of your own is called as loss(output var, targets)");
      return T{};
    } else {
      return step_checked(inputs, targets, micro_batches);
    }
  }

 private:
  template <std::size_t R, class Target>
  T step_checked(const tensor<T, R>& inputs, const Target& targets, std::size_t micro_batches) {
    if (inputs.extent(0) == 0)
      throw shape_error("data_parallel::step: the batch " + describe(inputs) + " has no rows; a step trains on at least one");
    std::vector<std::size_t> order(inputs.extent(0));
    std::iota(order.begin(), order.end(), std::size_t{0});
    return step_on(cut(inputs, targets, order, 0, inputs.extent(0), micro_batches), inputs.extent(0));
  }

 public:

  /// @brief Checks that every replica's parameters equal place 0's, bit for bit (a
  /// collective: every process calls it). Throws a pdo::error naming the first parameter and
  /// place that differ, on every place and process.
  void check_replicas() {
    pdo::detail::run_on_places("data_parallel::check_replicas", mesh_,
                               [&](std::size_t p, std::size_t k) { check_replicas_on(p, replicas_[k]->params); });
  }

  /// @brief The global norm of the summed gradients of the last step, before clipping
  /// (computed when data_parallel_options::clip_grad_norm is set; 0 otherwise; NaN after a
  /// step whose loss was not finite, which clipped and updated nothing).
  [[nodiscard]] double last_grad_norm() const { return replicas_.empty() ? 0.0 : replicas_[0]->grad_norm; }

  /// @brief What fit reports after each epoch (pdo::nn::epoch_stats).
  using epoch_stats = nn::epoch_stats;
  /// @brief Settings of fit (pdo::nn::fit_options).
  using fit_options = nn::fit_options;

  /// @brief Trains for `epochs` more epochs over (inputs, targets), in global batches (the
  /// last one may be smaller); the next batch is cut and copied to the places by a task on a
  /// copy lane while the current one trains. Calls on_epoch(stats) after each epoch. Epochs
  /// count on from those this trainer has trained (epochs(), restored by a checkpoint): the
  /// samples of epoch e come in the order of the e-th shuffle from `seed`, so training that
  /// resumes from a checkpoint sees the batches it would have seen without the stop.
  template <std::size_t R, class Target, class OnEpoch>
  void fit(const tensor<T, R>& inputs, const Target& targets, fit_options o, OnEpoch&& on_epoch) {
    const std::size_t n = inputs.extent(0);
    if (n == 0 || o.batch_size == 0) throw shape_error("data_parallel::fit: no samples, or a batch size of 0");
    if (o.micro_batches == 0) throw error("data_parallel::fit: micro_batches must be at least 1");
    std::mt19937_64 gen(o.seed);
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t{0});
    const any_place copier = mesh_.place(mesh_.local_places().front());
    if (o.shuffle)  // the orders of the epochs already trained
      for (std::size_t e = 0; e < epochs_; ++e) std::shuffle(order.begin(), order.end(), gen);
    const std::size_t first_epoch = epochs_;
    for (std::size_t epoch = first_epoch; epoch < first_epoch + o.epochs; ++epoch) {
      if (o.shuffle) std::shuffle(order.begin(), order.end(), gen);
      const auto start = std::chrono::steady_clock::now();
      last_epoch_correct_ = 0;  // the epoch's own steps only (not step() calls before, nor a fit that threw)
      double total = 0;
      std::size_t counted = 0, skipped = 0;
      auto prefetch = [&](std::size_t first) {
        const std::size_t rows = std::min(o.batch_size, n - first);
        return pdo::prefetch(copier, [this, &inputs, &targets, &order, first, rows, micro = o.micro_batches] {
          return cut(inputs, targets, order, first, rows, micro);
        });
      };
      auto next = prefetch(0);
      for (std::size_t first = 0; first < n; first += o.batch_size) {
        auto current = next.get();
        const std::size_t rows = std::min(o.batch_size, n - first);
        if (first + rows < n) next = prefetch(first + rows);
        const T loss = step_on(std::move(current), rows);
        if (std::isfinite(static_cast<double>(loss))) {
          total += static_cast<double>(loss) * static_cast<double>(rows);
          counted += rows;
        } else {
          ++skipped;
        }
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      epoch_stats s;
      s.epoch = epoch;  // counted from the first epoch this trainer (or the one it resumed) trained
      s.loss = counted == 0 ? std::numeric_limits<double>::quiet_NaN() : total / static_cast<double>(counted);
      s.samples = counted;
      s.skipped_steps = skipped;
      s.samples_per_second = static_cast<double>(n) / seconds;
      s.accuracy = last_epoch_correct_ / static_cast<double>(n);
      ++epochs_;
      on_epoch(s);
    }
  }

  /// @brief The fraction of rows whose largest output is at their label (classification),
  /// computed on every place over its share of the rows. Labels that are not class indices
  /// of the outputs are a pdo::shape_error naming the first, on every place and process.
  template <std::size_t R, class Label>
  double accuracy(const tensor<T, R>& inputs, const tensor<Label, 1>& labels) {
    std::vector<std::size_t> order(inputs.extent(0));
    std::iota(order.begin(), order.end(), std::size_t{0});
    auto shards = shard(inputs, labels, order, 0, inputs.extent(0));
    std::vector<std::array<double, 3>> totals(replicas_.size());
    pdo::detail::run_on_places("data_parallel::accuracy", mesh_, [&](std::size_t p, std::size_t k) {
      auto& s = shards[k];
      std::array<double, 3> counts{};
      if (s.inputs.extent(0) != 0) counts = pdo::detail::classify_rows((*replicas_[k]->model)(var(s.inputs)).value(), s.targets);
      totals[k] = pdo::detail::sum_along<Mesh, 3>(mesh_, dp_axis, p, counts);
    });
    if (inputs.extent(0) == 0) return 0.0;
    pdo::detail::check_classified("data_parallel::accuracy", labels, totals[0]);
    return totals[0][0] / static_cast<double>(inputs.extent(0));
  }

  /// @brief The model of the `k`-th place of this process.
  [[nodiscard]] const Model& model(std::size_t k = 0) const { return *replicas_[k]->model; }
  /// @brief The parameters of the `k`-th place's replica, named as the model lists them.
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(std::size_t k = 0) const { return replicas_[k]->params; }
  /// @brief The parameters of each bucket, by name, in the order they are all_reduced.
  [[nodiscard]] std::vector<std::vector<std::string>> buckets() const {
    std::vector<std::vector<std::string>> out;
    for (const auto& b : replicas_[0]->buckets->members()) {
      out.emplace_back();
      for (std::size_t i : b) out.back().push_back(replicas_[0]->params[replicas_[0]->synced[i]].name());
    }
    return out;
  }
  /// @brief The parameter elements whose optimizer state place `k` of this process keeps:
  /// all of them, or under ZeRO-1 its slices (about 1/n).
  [[nodiscard]] std::size_t optimizer_state_elements(std::size_t k = 0) const {
    if (options_.zero1) return replicas_[k]->buckets->optimizer_state_elements();
    std::size_t n = 0;
    for (const auto& p : replicas_[k]->params) n += p.size();
    return n;
  }
  /// @brief What every place of this process did in the last step, with times.
  [[nodiscard]] std::vector<step_event> last_step_events() const {
    std::vector<step_event> all;
    for (const auto& r : replicas_) {
      const auto e = r->buckets->events();
      all.insert(all.end(), e.begin(), e.end());
    }
    return all;
  }
  /// @brief The mesh trained over.
  [[nodiscard]] const Mesh& mesh() const { return mesh_; }
  /// @brief The optimizer of the `k`-th place of this process.
  [[nodiscard]] Optimizer& optimizer(std::size_t k = 0) { return *replicas_[k]->optimizer; }
  /// @brief The places of this process, each with its replica.
  [[nodiscard]] std::size_t replica_count() const { return replicas_.size(); }
  /// @brief The gradient buckets of replica k (under ZeRO-1 also its slices of the parameters).
  [[nodiscard]] buckets_type& replica_buckets(std::size_t k) { return *replicas_[k]->buckets; }
  /// @brief The settings given at construction.
  [[nodiscard]] const data_parallel_options& options() const { return options_; }
  /// @brief Steps and epochs trained (skipped steps included; a step refused with a
  /// pdo::error is not counted), restored with set_progress when training resumes from a
  /// checkpoint.
  [[nodiscard]] std::size_t steps() const { return steps_; }
  /// @brief Epochs trained by fit (see steps()).
  [[nodiscard]] std::size_t epochs() const { return epochs_; }
  /// @brief Sets the steps and epochs trained, as a checkpoint restores them.
  void set_progress(std::size_t steps, std::size_t epochs) {
    steps_ = steps;
    epochs_ = epochs;
  }

  /// @brief Whether steps sync each bucket's gradients fused with the optimizer's update
  /// (data_parallel_options::fused_update, where it applies).
  [[nodiscard]] bool fused_update() const { return fused_; }
  /// @brief Whether steps make the weights' gradients sliced and fold them into the update
  /// (data_parallel_options::sliced_weight_gradients, where it applies).
  [[nodiscard]] bool sliced_weight_gradients() const { return !replicas_.empty() && replicas_[0]->sliced != nullptr; }

  /// @brief The plan of a step, as text: how the batch is cut, the gradient layout the
  /// planner derives for the replicated parameters, the collective that syncs it, and the
  /// buckets with the bytes each place sends for them.
  [[nodiscard]] std::string explain() const {
    const auto& step = buckets_type::step_of(options_.zero1);
    std::string text = "data_parallel on " + mesh_.describe() + ": each place trains the rows " + pdo::layout_name<data_layout>() +
                       " of the global batch on its own replica\n";
    text += "  gradient of a replicated parameter used on those rows: matmul(xᵀ, g) -> " + pdo::layout_name<gradient_layout>() + "\n";
    if (sliced_weight_gradients()) {
      text += "  weights used as x W (the rest below):";
      for (std::size_t j : replicas_[0]->sliced->indices()) text += " " + replicas_[0]->params[j].name();
      text += "; each place all_gathers x and g over \"dp\", computes its rows of the summed xᵀ g with the SGD update folded in "
              "(one BLAS call; the gradient is not stored), and broadcasts those rows to every replica; where the batch's rows "
              "times (K + N) reach K N, all_reduced after backward instead\n";
    }
    if (options_.zero1)
      text += "  ZeRO-1: reduce_scattered over \"" + std::string(step.axis) + "\" (each place sums and updates its slice, with its "
              "slice of the optimizer state), the slices all_gathered back; in buckets of ~" + std::to_string(options_.bucket_bytes) + " B\n";
    else if (fused_)
      text += "  synced to " + pdo::layout_name<param_layout>() + " by " + std::string(step_name(step.kind)) + " over \"" +
              std::string(step.axis) + "\", in buckets of ~" + std::to_string(options_.bucket_bytes) +
              " B after backward, each fused with the optimizer's update (each place sums its part of a bucket and updates it "
              "on every replica)\n";
    else
      text += "  synced to " + pdo::layout_name<param_layout>() + " by " + std::string(step_name(step.kind)) + " over \"" +
              std::string(step.axis) + "\", in buckets of ~" + std::to_string(options_.bucket_bytes) + " B, " +
              (options_.overlap ? "each started as soon as backward completes it" : "after backward") + "\n";
    if (options_.fused_update && !fused_)
      text += "  fused_update was asked for and is not used: it needs CPU places of one process, an optimizer that takes fused "
              "updates (sgd, adam), no ZeRO-1 and no clip_grad_norm\n";
    if (options_.clip_grad_norm > 0)
      text += "  the summed gradients clipped by their global norm (max " + pdo::detail::format_number(options_.clip_grad_norm) +
              ") before the optimizer's update\n";
    const auto& r = *replicas_[0];
    const auto members = r.buckets->members();
    for (std::size_t b = 0; b < members.size(); ++b) {
      const std::size_t elements = r.buckets->elements(b);
      text += "  bucket " + std::to_string(b) + ": " + std::to_string(elements * sizeof(T)) + " B, each place sends " +
              std::to_string(pdo::detail::bytes_sent(mesh_, step, {elements}, sizeof(T))) + " B:";
      for (std::size_t j : members[b]) text += " " + r.params[r.synced[j]].name() + " " + r.params[r.synced[j]].shape_text();
      text += "\n";
    }
    return text;
  }

 private:
  struct replica {
    std::size_t place = 0;
    std::optional<Model> model;
    std::vector<parameter_ref<T>> params;
    std::unique_ptr<buckets_type> buckets;
    /// @brief The parameters the buckets sync, by index in params (all, unless some are sliced).
    std::vector<std::size_t> synced;
    /// @brief The weights whose gradients are made sliced (sliced_weight_gradients), if any.
    std::unique_ptr<sliced_weights<T, Mesh>> sliced;
    std::optional<Optimizer> optimizer;  ///< declared after the buckets: under ZeRO-1 it updates their slices
    double grad_norm = 0;                ///< of the last step's summed gradients, when clipping
    /// @brief For each of params, its index among the optimizer's parameters, or npos (fused updates).
    std::vector<std::size_t> updated_as;
  };

  /// @brief Whether steps can fuse the gradients' sync with the optimizer's update (see
  /// data_parallel_options::fused_update): also notes, for each replica, where each of its
  /// parameters is among its optimizer's (all of those must be the replica's own).
  bool fusable() {
    if (!(options_.fused_update || options_.sliced_weight_gradients) || options_.zero1 || options_.clip_grad_norm > 0 || mesh_.is_multiprocess()) return false;
    for (const any_place& q : mesh_.places())
      if (q.kind() != place_kind::cpu) return false;
    if constexpr (!fused_optimizer<Optimizer, T>) {
      return false;
    } else {
      for (auto& held : replicas_) {
        replica& r = *held;
        if (!r.optimizer->fusable()) return false;
        const auto& updated = r.optimizer->parameters();
        for (const auto& u : updated)
          if (u.value_blocks().size() != 1) return false;
        r.updated_as = pdo::detail::positions_among(r.params, updated);
        // the optimizer updates something the buckets do not sync
        if (static_cast<std::size_t>(std::ranges::count_if(r.updated_as, [](std::size_t j) { return j != npos; })) != updated.size())
          return false;
      }
      return true;
    }
  }
  static constexpr std::size_t npos = pdo::detail::not_held;

  /// @brief The optimizer's update as w <- keep w + scale g, when it is one (see linear_update).
  static std::optional<linear_update<T>> linear_step_of(const Optimizer& o) {
    if constexpr (requires { o.linear_step(); }) return o.linear_step();
    else return std::nullopt;
  }

  /// @brief With an optimizer whose update is linear (plain SGD) on every replica: the weights
  /// it updates get their gradients sliced, and the buckets sync the other parameters.
  void slice_weights() {
    for (const auto& r : replicas_)
      if (!linear_step_of(*r->optimizer)) return;
    pdo::detail::run_on_places("data_parallel", mesh_, [&](std::size_t p, std::size_t k) {
      replica& r = *replicas_[k];
      std::vector<std::size_t> updated;
      for (std::size_t j = 0; j < r.params.size(); ++j)
        if (r.updated_as[j] != npos) updated.push_back(j);
      auto sliced = std::make_unique<sliced_weights<T, Mesh>>(mesh_, dp_axis, p, r.params, updated);
      if (sliced->empty()) return;
      const auto taken = sliced->indices();
      r.synced.clear();
      std::vector<parameter_ref<T>> rest;
      for (std::size_t j = 0; j < r.params.size(); ++j)
        if (std::ranges::find(taken, j) == taken.end()) {
          r.synced.push_back(j);
          rest.push_back(r.params[j]);
        }
      r.buckets = std::make_unique<buckets_type>(mesh_, p, std::move(rest), bucket_options{options_.bucket_bytes, options_.overlap, false});
      r.sliced = std::move(sliced);
    });
  }

  /// @brief Checks that place p's `params` are as many, and each of as many elements, as every
  /// other place's (before the broadcast or comparison of their values): the first difference
  /// is a pdo::mismatch_error that every place throws alike.
  void check_replica_shapes(std::size_t p, const std::vector<parameter_ref<T>>& params) const {
    const auto comm = host_communicator_of(mesh_, p);
    const std::size_t n = mesh_.size();
    const auto fail = [&](const std::string& what) {
      throw mismatch_error("data_parallel: the replicas differ: " + what + " (the model factory must build replicas of one architecture)");
    };
    const auto at = [&](std::size_t q) { return "place " + mesh_.place(q).name(); };
    std::vector<std::size_t> counts(n);
    const std::size_t count = params.size();
    comm.all_gather(std::span<const std::size_t>(&count, 1), std::span<std::size_t>(counts));
    for (std::size_t q = 1; q < n; ++q)
      if (counts[q] != counts[0])
        fail("the model has " + std::to_string(counts[q]) + " parameters on " + at(q) + ", " + std::to_string(counts[0]) + " on " + at(0));
    std::vector<std::size_t> sizes;
    for (const auto& param : params) sizes.push_back(param.size());
    std::vector<std::size_t> all(n * count);
    comm.all_gather(std::span<const std::size_t>(sizes), std::span<std::size_t>(all));
    for (std::size_t q = 1; q < n; ++q)
      for (std::size_t j = 0; j < count; ++j)
        if (all[q * count + j] != all[j])
          fail("parameter " + params[j].name() + " has " + std::to_string(all[q * count + j]) + " elements on " + at(q) + ", " +
               std::to_string(all[j]) + " on " + at(0));
  }

  /// @brief Place 0's parameter values into `params`, place p's (a broadcast over the mesh).
  void broadcast_from_first(std::size_t p, const std::vector<parameter_ref<T>>& params) const {
    const mesh_communicator comm = communicator_of(mesh_, p);
    for (const auto& param : params) comm.broadcast(param.value(), 0);
  }

  /// @brief Compares place p's `params` with place 0's (broadcast into a scratch buffer) and
  /// agrees with every place on the first difference: every place throws the same error.
  void check_replicas_on(std::size_t p, const std::vector<parameter_ref<T>>& params) const {
    const mesh_communicator comm = communicator_of(mesh_, p);
    std::array<double, 2> found{-1, -1};  // parameter, element
    // every place takes part in every broadcast (place 0 finds no difference with itself)
    for (std::size_t j = 0; j < params.size(); ++j) {
      const std::span<T> mine = params[j].value();
      tensor<T, 1> theirs(shape_t<1>{mine.size()}, mesh_.place(p), pdo::detail::uninitialized);
      if (p == 0) pdo::detail::copy_bytes(theirs.where(), theirs.data(), theirs.where(), mine.data(), mine.size_bytes());
      comm.broadcast(theirs.span(), 0);
      const auto host_theirs = to_host(theirs);
      std::vector<T> host_mine(mine.size());
      pdo::detail::copy_bytes(nullptr, host_mine.data(), theirs.where(), mine.data(), mine.size_bytes());
      for (std::size_t i = 0; i < mine.size() && found[0] < 0; ++i)
        if (std::memcmp(&host_mine[i], host_theirs.data() + i, sizeof(T)) != 0) {
          found = {static_cast<double>(j), static_cast<double>(i)};
          break;
        }
    }
    // every place learns every place's finding: all throw the first one's
    std::vector<double> all(mesh_.size() * 2);
    host_communicator_of(mesh_, p).all_gather(std::span<const double>(found.data(), 2), std::span<double>(all));
    for (std::size_t q = 0; q < mesh_.size(); ++q) {
      if (all[2 * q] < 0) continue;
      const auto& param = params[static_cast<std::size_t>(all[2 * q])];
      // every place throws it alike (a mismatch_error): over MPI no process is left waiting
      throw mismatch_error("data_parallel: the replicas differ: parameter " + param.name() + " " + param.shape_text() + " on place " +
                  mesh_.place(q).name() + " differs from place " + mesh_.place(0).name() + "'s at element " +
                  std::to_string(static_cast<std::size_t>(all[2 * q + 1])) +
                  " (the model factory must build equal replicas, or leave data_parallel_options::broadcast_parameters on)");
    }
  }

  /// @brief Rows order[first, first + rows) of the data, cut into `micro` micro-batches (the
  /// chunk rule), each into one shard per place of this process.
  template <std::size_t R, class Target>
  std::vector<std::vector<batch_shard<T, R, Target>>> cut(const tensor<T, R>& inputs, const Target& targets,
                                                          const std::vector<std::size_t>& order, std::size_t first, std::size_t rows,
                                                          std::size_t micro) const {
    if (micro == 0) throw error("data_parallel::step: micro_batches must be at least 1");
    std::vector<std::vector<batch_shard<T, R, Target>>> out;
    for (std::size_t m = 0; m < micro; ++m)
      out.push_back(shard(inputs, targets, order, first + pdo::detail::chunk_offset(rows, micro, m), pdo::detail::chunk_size(rows, micro, m)));
    return out;
  }

  /// @brief Rows order[first, first + rows) of the data, cut into one shard per place of
  /// this process (in that place's memory).
  template <std::size_t R, class Target>
  std::vector<batch_shard<T, R, Target>> shard(const tensor<T, R>& inputs, const Target& targets, const std::vector<std::size_t>& order,
                                               std::size_t first, std::size_t rows) const {
    if (targets.extent(0) != inputs.extent(0))
      throw shape_error("data_parallel: inputs " + describe(inputs) + " and targets " + describe(targets) + " differ in rows");
    const std::size_t parts = mesh_.extent(dp_axis);
    std::vector<batch_shard<T, R, Target>> out;
    for (std::size_t p : mesh_.local_places()) {
      const std::size_t c = mesh_.coord(p, dp_axis);
      const std::size_t at = first + pdo::detail::chunk_offset(rows, parts, c), count = pdo::detail::chunk_size(rows, parts, c);
      out.push_back({pdo::detail::cut_rows(inputs, order, at, count, mesh_.place(p)),
                     pdo::detail::cut_rows(targets, order, at, count, mesh_.place(p)),
                     std::vector<std::size_t>(order.begin() + static_cast<std::ptrdiff_t>(at),
                                              order.begin() + static_cast<std::ptrdiff_t>(at + count))});
    }
    return out;
  }

  template <std::size_t R, class Target>
  T step_on(std::vector<std::vector<batch_shard<T, R, Target>>> micro, std::size_t global_rows) {
    std::vector<T> losses(replicas_.size());
    std::vector<double> corrects(replicas_.size());
    // the step's rate, decided (and checked) once, before any place runs
    std::optional<double> lr;
    if (options_.schedule) {
      lr = options_.schedule(steps_);
      pdo::detail::check_lr("data_parallel::step: schedule(" + std::to_string(steps_) + ")", *lr);
    }
    // sliced weight gradients: the products' gradients are taken in backward when every
    // place runs the one backward (one micro-batch, rows on every place; one process)
    bool take_products = sliced_weight_gradients() && micro.size() == 1;
    for (const auto& shard : micro.back()) take_products = take_products && shard.inputs.extent(0) != 0;
    // its tasks queue the buckets' collectives as backward makes them: the places are held
    pdo::detail::run_holding_places("data_parallel::step", mesh_, [&](std::size_t p, std::size_t k) {
      // over several processes each passes its own batch: they must agree before anything trains
      if (mesh_.is_multiprocess()) {
        const auto& s = micro.front()[k];
        auto inputs = s.inputs.shape();
        auto targets = s.targets.shape();
        inputs[0] = targets[0] = global_rows;
        pdo::detail::check_same_host_shapes(mesh_, p, inputs, targets);
      }
      replica& r = *replicas_[k];
      buckets_type& buckets = *r.buckets;
      buckets.begin_step();
      if (r.sliced) r.sliced->start();
      T local{};
      std::size_t correct = 0;
      bool summed = false;  // the loss was summed before backward (take_products)
      std::array<double, 2> totals{};
      {
        // whatever happens, the communication lane is done with this step's buffers before we
        // return, and backward adds gradients again
        struct drain {
          buckets_type& b;
          sliced_weights<T, Mesh>* sliced;
          bool done = false;
          ~drain() {
            if (sliced != nullptr) done ? sliced->end() : sliced->abandon();
            if (!done) b.abandon();
          }
        } guard{buckets, r.sliced.get()};
        // micro-batches before the last add their gradients without any communication; the
        // last one's backward completes them and fires the buckets
        for (std::size_t m = 0; m < micro.size(); ++m) {
          if (m + 1 == micro.size()) buckets.arm(/*launch=*/!fused_);
          auto& s = micro[m][k];
          const std::size_t rows = s.inputs.extent(0);
          if (rows == 0) continue;
          const double forward_start = buckets.since_start();
          std::optional<pdo::detail::timeline_span> forward_span;
          forward_span.emplace("kernel", "forward", [&] { return std::to_string(rows) + " rows"; });
          // a mistake in the data (a label out of range, say) is named in the caller's rows
          const auto forward = pdo::detail::naming_rows([&] { return pdo::detail::rows_context(s.rows); }, [&] {
            auto y = (*r.model)(var(s.inputs));
            auto l = loss_(y, s.targets) * (static_cast<T>(rows) / static_cast<T>(global_rows));
            return std::pair(std::move(y), std::move(l));
          });
          const auto& out = forward.first;
          const auto& loss = forward.second;
          forward_span.reset();
          const double forward_end = buckets.since_start();
          buckets.record("forward", 0, forward_start, forward_end);
          if constexpr (std::is_integral_v<typename Target::value_type>) correct += pdo::detail::count_correct(out.value(), s.targets);
          local += pdo::detail::scalar_of(loss.value());
          if (take_products) {
            // the products backward takes get the update folded in as it runs: the loss is
            // checked first, and the update's learning rate set
            totals = pdo::detail::sum_along<Mesh, 2>(mesh_, dp_axis, p, {static_cast<double>(local), static_cast<double>(correct)});
            summed = true;
            if (!std::isfinite(static_cast<double>(static_cast<T>(totals[0])))) break;
            if (lr) r.optimizer->set_lr(*lr);
            r.sliced->take_products(linear_step_of(*r.optimizer).value());
          }
          pdo::backward(loss);
          buckets.record("backward", 0, forward_end, buckets.since_start());
        }
        // one exchange over "dp": which parameters some place's backward reached (one no
        // place reached, a branch the model did not take, is left without a gradient, so the
        // update leaves it alone, as on one place) and the global batch's loss and count of
        // correct predictions, on every place, before any update: a step whose loss is not
        // finite changes nothing
        const std::array<double, 2> mine{static_cast<double>(local), static_cast<double>(correct)};
        const std::vector<double> sums = buckets.settle_reached(summed ? std::span<const double>() : std::span<const double>(mine));
        if (!summed) totals = {sums[0], sums[1]};
        guard.done = true;
        if (!fused_) buckets.finish();  // parameters without a gradient (no rows here, or unused) send zeros
      }
      losses[k] = static_cast<T>(totals[0]);
      corrects[k] = totals[1];
      if (!std::isfinite(static_cast<double>(losses[k]))) {  // as step() reports it (in T)
        if (options_.clip_grad_norm > 0) r.grad_norm = std::numeric_limits<double>::quiet_NaN();  // nothing was clipped
        return;
      }
      const double opt_start = buckets.since_start();
      if (options_.clip_grad_norm > 0) {
        // replicated gradients: every place has them all; ZeRO-1 slices: summed over "dp"
        const auto& updated = r.optimizer->parameters();
        double squared = grad_squared_norm(updated);
        if (options_.zero1) squared = pdo::detail::sum_along<Mesh, 1>(mesh_, dp_axis, p, {squared})[0];
        r.grad_norm = std::sqrt(squared);
        const double f = clip_factor(r.grad_norm, options_.clip_grad_norm);
        if (f < 1) scale_grads(updated, f);
      }
      if (lr && !summed) r.optimizer->set_lr(*lr);
      if constexpr (fused_optimizer<Optimizer, T>) {
        if (fused_) {
          // the sync and the update in one pass (parameters without a gradient send zeros)
          r.optimizer->begin_fused_step();
          std::vector<element_update<T>> updates(r.synced.size());
          for (std::size_t i = 0; i < r.synced.size(); ++i)
            if (buckets.reached(i) && r.updated_as[r.synced[i]] != npos) updates[i] = r.optimizer->fused_update(r.updated_as[r.synced[i]]);
          buckets.sync_and_update(updates);
          // the weights whose products took the update (and any gradient they got besides)
          if (r.sliced) r.sliced->finish_step(linear_step_of(*r.optimizer).value());
          buckets.record("optimizer", 0, opt_start, buckets.since_start());
          return;
        }
      }
      r.optimizer->step();
      buckets.record("optimizer", 0, opt_start, buckets.since_start());
      if (options_.zero1) buckets.gather_slices();
    });
    // a refused step leaves the trainer as if its batch had not been given (the schedule and
    // a checkpoint's step count do not move); a skipped one counts, as fit's epochs count it
    const bool finite = std::isfinite(static_cast<double>(losses[0]));
    if (!finite && !options_.skip_nonfinite_steps)
      pdo::detail::refuse_nonfinite_step("data_parallel", steps_ + 1, global_rows, mesh_.describe(), static_cast<double>(losses[0]));
    ++steps_;
    if (finite) last_epoch_correct_ += corrects[0];
    return losses[0];
  }

  Mesh mesh_;
  data_parallel_options options_;
  Loss loss_;
  std::vector<std::unique_ptr<replica>> replicas_;
  bool fused_ = false;  ///< steps fuse the gradients' sync with the optimizer's update (fusable())
  double last_epoch_correct_ = 0;  ///< rows the steps of fit's current epoch classified right
  std::size_t steps_ = 0;   ///< steps taken, skipped ones included
  std::size_t epochs_ = 0;  ///< epochs fit has trained
};

namespace detail_dp {
/// @brief What make_data_parallel and make_pipeline give after their errors, so that the
/// trainer's uses report nothing more: the members of a data-parallel trainer and of a
/// pipeline, of the types theirs have, doing nothing (io::save, load and add_state take it too).
template <class T>
struct unformed_trainer {
  template <class... Args>
  T step(const Args&...) {
    return T{};
  }
  template <class X, class Y, class... OnEpoch>
  void fit(const X&, const Y&, const fit_options&, const OnEpoch&...) {}
  template <class... Args>
  double accuracy(const Args&...) {
    return 0;
  }
  void check_replicas() {}
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(std::size_t = 0) const { return {}; }
  [[nodiscard]] std::vector<std::vector<std::string>> buckets() const { return {}; }
  [[nodiscard]] std::size_t optimizer_state_elements(std::size_t = 0) const { return 0; }
  [[nodiscard]] std::vector<step_event> last_step_events() const { return {}; }
  [[nodiscard]] std::size_t replica_count() const { return 0; }
  [[nodiscard]] double last_grad_norm() const { return 0; }
  [[nodiscard]] std::size_t steps() const { return 0; }
  [[nodiscard]] std::size_t epochs() const { return 0; }
  void set_progress(std::size_t, std::size_t) {}
  void set_steps(std::size_t) {}
  [[nodiscard]] std::size_t skipped_steps() const { return 0; }
  void set_skipped_steps(std::size_t) {}
  [[nodiscard]] bool fused_update() const { return false; }
  [[nodiscard]] bool sliced_weight_gradients() const { return false; }
  [[nodiscard]] std::vector<std::size_t> max_in_flight() const { return {}; }
  [[nodiscard]] std::vector<double> busy_seconds() const { return {}; }
  [[nodiscard]] double last_step_seconds() const { return 0; }
  [[nodiscard]] std::string explain() const { return {}; }
};
}  // namespace detail_dp

/// @brief A data-parallel trainer: `make_model()` builds a replica (it runs on every place,
/// so use a fixed seed: all replicas must start equal) and `make_optimizer(parameters)`
/// its optimizer.
template <class T, class Mesh, class MakeModel, class MakeOptimizer, class Loss = cross_entropy_loss>
auto make_data_parallel(const Mesh& m, MakeModel make_model, MakeOptimizer make_optimizer, data_parallel_options o = {},
                        Loss loss = {}) {
  // each check's error is given once, with nothing instantiated after it
  if constexpr (!Mesh::has_axis("dp")) {
    static_assert(Mesh::has_axis("dp"), "pdo: data_parallel: the mesh needs an axis named \"dp\"");
    return detail_dp::unformed_trainer<T>{};
  } else if constexpr (!std::is_invocable_v<MakeModel&>) {
    static_assert(std::is_invocable_v<MakeModel&>,
                  "pdo: make_data_parallel: make_model must be a callable that builds a replica, called once per place "
                  "([] { return make_mlp(); }), not a model");
    return detail_dp::unformed_trainer<T>{};
  } else if constexpr (!std::is_invocable_v<MakeOptimizer&, std::vector<parameter_ref<T>>>) {
    static_assert(std::is_invocable_v<MakeOptimizer&, std::vector<parameter_ref<T>>>,
                  "pdo: make_data_parallel: make_optimizer must be a callable that takes a replica's parameters, "
                  "std::vector<pdo::nn::parameter_ref<T>>, and builds its optimizer ([](auto p) { return sgd<T>(std::move(p), {...}); })");
    return detail_dp::unformed_trainer<T>{};
  } else if constexpr (!optimizer<std::invoke_result_t<MakeOptimizer&, std::vector<parameter_ref<T>>>, T>) {
    static_assert(pdo::detail::always_false<MakeOptimizer>,
                  "pdo: make_data_parallel<T>: make_optimizer must build an optimizer of T parameters (sgd<T>, adam<T>, "
                  "any_optimizer<T>, or a type that meets pdo::nn::optimizer<O, T>)");
    return detail_dp::unformed_trainer<T>{};
  } else if constexpr (!detail_nn::holds_parameters_of<T, std::invoke_result_t<MakeModel&>>::value) {
    static_assert(detail_nn::holds_parameters_of<T, std::invoke_result_t<MakeModel&>>::value,
                  "pdo: make_data_parallel<T>: the model's parameters are not of element type T: build its layers with T "
                  "(linear<T>, conv2d<T>) or train it as make_data_parallel<its element type>");
    return detail_dp::unformed_trainer<T>{};
  } else {
    using model_t = std::invoke_result_t<MakeModel&>;
    using optimizer_t = std::invoke_result_t<MakeOptimizer&, std::vector<parameter_ref<T>>>;
    return data_parallel<T, model_t, optimizer_t, Mesh, Loss>(m, std::move(make_model), std::move(make_optimizer), o, loss);
  }
}

}  // namespace pdo::nn
