// pdo/nn/data_parallel.hpp: data-parallel training: a replica of the model on every place,
// gradients all_reduced in buckets that overlap backward, the optimizer on every place,
// the next batch distributed in the background.
#pragma once

#include <pdo/autograd.hpp>
#include <pdo/comm/run_on_places.hpp>
#include <pdo/layout/redistribute_plan.hpp>
#include <pdo/nn/layers.hpp>
#include <pdo/plan/explain.hpp>
#include <pdo/plan/plan.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo::nn {

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
};

/// @brief A span of one step on one place, in microseconds from the step's start.
struct step_event {
  std::size_t place = 0;
  std::string what;  ///< "forward", "backward", "all_reduce" (or "reduce_scatter", "all_gather" under ZeRO-1), "optimizer"
  std::size_t bucket = 0;
  double start_us = 0, end_us = 0;
  /// @brief For a bucket's collective: when backward handed it to the communication thread
  /// (start_us is when that thread began it). Otherwise start_us.
  double queued_us = 0;
};

/// @brief The rows of a global batch that one place trains on.
template <class T, std::size_t R, class Target>
struct batch_shard {
  tensor<T, R> inputs;
  Target targets;
};

/// @brief Cross-entropy of logits [N, C] against class indices [N]: the default loss.
struct cross_entropy_loss {
  template <class V, class Y>
  auto operator()(const var<V>& logits, const Y& labels) const {
    return pdo::cross_entropy(logits, labels);
  }
};
/// @brief Mean squared error against targets of the output's shape.
struct mse_loss {
  template <class V>
  auto operator()(const var<V>& out, const V& target) const {
    return pdo::mse(out, var<V>(target));
  }
};


}  // namespace pdo::nn

namespace pdo::detail {

/// @brief Rows [first, first + count) of `src` into `dst` (row-major, dim 0 the rows) in the given order.
template <class T, std::size_t R>
void copy_rows(const tensor<T, R>& src, const std::vector<std::size_t>& order, std::size_t first, tensor<T, R>& dst) {
  const std::size_t row = src.extent(0) == 0 ? 0 : src.size() / src.extent(0);
  for (std::size_t i = 0; i < dst.extent(0); ++i)
    std::copy_n(src.data() + order[first + i] * row, row, dst.data() + i * row);
}

template <std::size_t R>
shape_t<R> with_rows(shape_t<R> s, std::size_t rows) {
  s[0] = rows;
  return s;
}

/// @brief Throws pdo::layout_error unless every place of `m` is a CPU place: the trainers
/// (data_parallel, pipeline) read losses, counts and gradient buckets in host memory.
template <class Mesh>
void require_cpu_places(const std::string& op, const Mesh& m) {
  for (std::size_t p = 0; p < m.size(); ++p)
    if (m.place(p).kind() != place_kind::cpu)
      throw layout_error(op + ": place " + m.place(p).name() + " of " + m.describe() + " is a GPU place; " + op +
                         " trains on CPU places (on GPU places, write the step with pdo::spmd or dtensor ops and an optimizer)");
}

}  // namespace pdo::detail

namespace pdo::nn {

/// @brief Data-parallel training over the "dp" axis of a mesh.
///
/// Every place holds its own replica of the model and of the optimizer state, built by
/// the factories on that place (so their memory is the place's). A step splits the global
/// batch by rows along "dp" (uneven shards allowed: 10 rows on 4 places train 3, 3, 2, 2),
/// runs forward and backward on every place at once, and sums the gradients with
/// all_reduce. The loss of each place is weighted by its share of the global batch, so
/// the summed gradient is the gradient of the global batch's mean loss: training on N
/// places follows the same trajectory as on one place with the same global batch.
///
/// Why all_reduce: the planner derives it. A replicated parameter used on rows split
/// along "dp" gets a gradient matmul(xᵀ, g) whose layout is partial over "dp", and the
/// plan that brings it back to the parameter's layout is one all_reduce
/// (`gradient_sync_plan`, checked at compile time below).
template <class T, class Model, class Optimizer, class Mesh, class Loss = cross_entropy_loss>
class data_parallel {
 public:
  using mesh_type = Mesh;
  static constexpr std::size_t dp_axis = Mesh::axis_index("dp");
  static_assert(dp_axis < Mesh::ndim, "pdo: data_parallel: the mesh needs an axis named \"dp\"");

  using data_layout = layout<split<"dp">, replicate>;
  using param_layout = layout<replicate, replicate>;
  using gradient_layout =
      result_layout_t<decltype(pdo::matmul(pdo::transpose(std::declval<const dtensor<T, 2, Mesh, data_layout>&>()),
                                           std::declval<const dtensor<T, 2, Mesh, data_layout>&>()))>;
  static constexpr redistribute_plan gradient_sync_plan = redistribute_plan_of<gradient_layout, param_layout>();
  static_assert(gradient_sync_plan.size == 1 && gradient_sync_plan.steps[0].kind == step_kind::all_reduce &&
                    gradient_sync_plan.steps[0].axis == "dp",
                "pdo: data_parallel: the planner should sync replicated gradients with one all_reduce over \"dp\"");

  template <class MakeModel, class MakeOptimizer>
  data_parallel(const Mesh& m, MakeModel make_model, MakeOptimizer make_optimizer, data_parallel_options o = {}, Loss loss = {})
      : mesh_(m), options_(o), loss_(loss), replicas_(m.local_places().size()) {
    pdo::detail::require_cpu_places("data_parallel", m);
    pdo::detail::run_on_places("data_parallel", mesh_, [&](std::size_t p, std::size_t k) {
      auto& r = *(replicas_[k] = std::make_unique<replica>());
      r.place = p;
      r.model.emplace(make_model());
      r.params = parameters_of<T>(*r.model);
      r.make_buckets(options_.bucket_bytes, options_.zero1, mesh_.extent(dp_axis), mesh_.coord(p, dp_axis));
      if (options_.zero1) {
        std::vector<parameter_ref<T>> slices;
        for (std::size_t b = 0; b < r.buckets.size(); ++b)
          slices.emplace_back("bucket" + std::to_string(b) + ".slice", r.buckets[b].slice);
        r.optimizer.emplace(make_optimizer(std::move(slices)));
      } else {
        r.optimizer.emplace(make_optimizer(r.params));
      }
    });
  }

  /// @brief One training step on a global batch (host tensors: inputs [B, ...], targets
  /// [B, ...]); returns the mean loss over the global batch. A loss that is not finite is a
  /// pdo::error naming the step, with no parameter updated (or, with
  /// data_parallel_options::skip_nonfinite_steps, returned with no update).
  template <std::size_t R, class Target>
  T step(const tensor<T, R>& inputs, const Target& targets) {
    std::vector<std::size_t> order(inputs.extent(0));
    std::iota(order.begin(), order.end(), std::size_t{0});
    return step_on(shard(inputs, targets, order, 0, inputs.extent(0)), inputs.extent(0));
  }

  struct epoch_stats {
    std::size_t epoch = 0;
    double loss = 0;            ///< mean training loss over the epoch's samples
    double accuracy = 0;        ///< on the training samples, from the step's outputs
    double samples_per_second = 0;
    std::size_t samples = 0;         ///< the samples whose loss counts (those of skipped steps do not)
    std::size_t skipped_steps = 0;   ///< steps with a non-finite loss, skipped (data_parallel_options::skip_nonfinite_steps)
  };

  struct fit_options {
    std::size_t epochs = 1;
    std::size_t batch_size = 64;  ///< global batch
    std::uint64_t seed = 0;       ///< for the order of the samples in each epoch
    bool shuffle = true;
  };

  /// @brief Trains for `epochs` over (inputs, targets), in global batches (the last one
  /// may be smaller); the next batch is cut and copied to the places by a background
  /// thread while the current one trains. Calls on_epoch(stats) after each epoch.
  template <std::size_t R, class Target, class OnEpoch>
  void fit(const tensor<T, R>& inputs, const Target& targets, fit_options o, OnEpoch&& on_epoch) {
    const std::size_t n = inputs.extent(0);
    if (n == 0 || o.batch_size == 0) throw shape_error("data_parallel::fit: no samples, or a batch size of 0");
    std::mt19937_64 gen(o.seed);
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t{0});
    for (std::size_t epoch = 0; epoch < o.epochs; ++epoch) {
      if (o.shuffle) std::shuffle(order.begin(), order.end(), gen);
      const auto start = std::chrono::steady_clock::now();
      double total = 0;
      std::size_t counted = 0, skipped = 0;
      auto cut = [&](std::size_t first) {
        const std::size_t rows = std::min(o.batch_size, n - first);
        return std::async(std::launch::async, [this, &inputs, &targets, &order, first, rows] {
          return shard(inputs, targets, order, first, rows);
        });
      };
      auto next = cut(0);
      for (std::size_t first = 0; first < n; first += o.batch_size) {
        auto current = next.get();
        const std::size_t rows = std::min(o.batch_size, n - first);
        if (first + rows < n) next = cut(first + rows);
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
      s.epoch = epoch;
      s.loss = counted == 0 ? std::numeric_limits<double>::quiet_NaN() : total / static_cast<double>(counted);
      s.samples = counted;
      s.skipped_steps = skipped;
      s.samples_per_second = static_cast<double>(n) / seconds;
      s.accuracy = last_epoch_correct_ / static_cast<double>(n);
      last_epoch_correct_ = 0;
      on_epoch(s);
    }
  }

  /// @brief The fraction of rows whose largest output is at their label (classification),
  /// computed on every place over its share of the rows.
  template <std::size_t R, class Label>
  double accuracy(const tensor<T, R>& inputs, const tensor<Label, 1>& labels) {
    std::vector<std::size_t> order(inputs.extent(0));
    std::iota(order.begin(), order.end(), std::size_t{0});
    auto shards = shard(inputs, labels, order, 0, inputs.extent(0));
    std::vector<double> correct(replicas_.size(), 0);
    pdo::detail::run_on_places("data_parallel::accuracy", mesh_, [&](std::size_t p, std::size_t k) {
      auto& s = shards[k];
      double c = s.inputs.extent(0) == 0 ? 0.0 : static_cast<double>(count_correct((*replicas_[k]->model)(var(s.inputs)).value(), s.targets));
      communicator_along(mesh_, dp_axis, p).all_reduce(std::span<double>(&c, 1));
      correct[k] = c;
    });
    return inputs.extent(0) == 0 ? 0.0 : correct[0] / static_cast<double>(inputs.extent(0));
  }

  /// @brief The model of the `k`-th place of this process.
  [[nodiscard]] const Model& model(std::size_t k = 0) const { return *replicas_[k]->model; }
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(std::size_t k = 0) const { return replicas_[k]->params; }
  /// @brief The parameters of each bucket, by name, in the order they are all_reduced.
  [[nodiscard]] std::vector<std::vector<std::string>> buckets() const {
    std::vector<std::vector<std::string>> out;
    for (const auto& b : replicas_[0]->buckets) {
      out.emplace_back();
      for (std::size_t i : b.params) out.back().push_back(replicas_[0]->params[i].name());
    }
    return out;
  }
  /// @brief The parameter elements whose optimizer state place `k` of this process keeps:
  /// all of them, or under ZeRO-1 its slices (about 1/n).
  [[nodiscard]] std::size_t optimizer_state_elements(std::size_t k = 0) const {
    std::size_t n = 0;
    for (const auto& b : replicas_[k]->buckets) n += options_.zero1 ? b.slice.shape()[0] : b.elements;
    return n;
  }
  /// @brief What every place of this process did in the last step, with times.
  [[nodiscard]] std::vector<step_event> last_step_events() const {
    std::vector<step_event> all;
    for (const auto& r : replicas_) all.insert(all.end(), r->events.begin(), r->events.end());
    return all;
  }
  [[nodiscard]] const Mesh& mesh() const { return mesh_; }

  /// @brief The plan of a step, as text: how the batch is cut, the gradient layout the
  /// planner derives for the replicated parameters, the collective that syncs it, and the
  /// buckets with the bytes each place sends for them.
  [[nodiscard]] std::string explain() const {
    const auto& step = gradient_sync_plan.steps[0];
    std::string text = "data_parallel on " + mesh_.describe() + ": each place trains the rows " + pdo::layout_name<data_layout>() +
                       " of the global batch on its own replica\n";
    text += "  gradient of a replicated parameter used on those rows: matmul(xᵀ, g) -> " + pdo::layout_name<gradient_layout>() + "\n";
    if (options_.zero1)
      text += "  ZeRO-1: reduce_scattered over \"" + std::string(step.axis) + "\" (each place sums and updates its slice, with its "
              "slice of the optimizer state), the slices all_gathered back; in buckets of ~" + std::to_string(options_.bucket_bytes) + " B\n";
    else
      text += "  synced to " + pdo::layout_name<param_layout>() + " by " + std::string(step_name(step.kind)) + " over \"" +
              std::string(step.axis) + "\", in buckets of ~" + std::to_string(options_.bucket_bytes) + " B, " +
              (options_.overlap ? "each started as soon as backward completes it" : "after backward") + "\n";
    const auto& r = *replicas_[0];
    for (std::size_t b = 0; b < r.buckets.size(); ++b) {
      const auto& bk = r.buckets[b];
      text += "  bucket " + std::to_string(b) + ": " + std::to_string(bk.elements * sizeof(T)) + " B, each place sends " +
              std::to_string(pdo::detail::bytes_sent(mesh_, step, {bk.elements}, sizeof(T))) + " B:";
      for (std::size_t j : bk.params) text += " " + r.params[j].name() + " " + r.params[j].shape_text();
      text += "\n";
    }
    return text;
  }

 private:
  using clock = std::chrono::steady_clock;

  struct bucket {
    std::vector<std::size_t> params;  ///< indices into replica::params
    std::size_t elements = 0;
    tensor<T, 1> flat;        ///< the gradients packed (buckets of several parameters, and all under ZeRO-1); under
                              ///< ZeRO-1 also where the updated slices are gathered
    var<tensor<T, 1>> slice;  ///< ZeRO-1: this place's slice of the parameters, which its optimizer updates
    std::size_t slice_offset = 0;
    std::size_t waiting = 0;  ///< gradients not yet complete in this step
    bool ready = false;
  };

  struct replica {
    std::size_t place = 0;
    std::optional<Model> model;
    std::vector<parameter_ref<T>> params;
    std::optional<Optimizer> optimizer;
    std::vector<bucket> buckets;
    std::vector<std::size_t> bucket_of;  ///< per parameter
    std::size_t launched = 0;            ///< buckets handed to the communication thread this step
    std::atomic<std::size_t> finished{0};
    std::optional<pdo::detail::captured_error> comm_failure;
    std::mutex events_mutex;
    std::vector<step_event> events;
    clock::time_point start;
    std::unique_ptr<pdo::detail::worker> comm;  ///< runs this place's all_reduces while backward goes on

    void make_buckets(std::size_t bytes, bool zero1, std::size_t parts, std::size_t me) {
      bucket_of.assign(params.size(), 0);
      // backward completes the last layers first: buckets follow the parameters in reverse
      for (std::size_t j = params.size(); j-- > 0;) {
        if (buckets.empty() || (buckets.back().elements * sizeof(T) >= bytes)) buckets.emplace_back();
        buckets.back().params.push_back(j);
        buckets.back().elements += params[j].size();
        bucket_of[j] = buckets.size() - 1;
      }
      for (auto& b : buckets) {
        if (b.params.size() > 1 || zero1) b.flat = tensor<T, 1>(shape_t<1>{b.elements}, pdo::detail::uninitialized);
        if (!zero1) continue;
        pack_values(b, b.flat.data());
        b.slice_offset = pdo::detail::chunk_offset(b.elements, parts, me);
        tensor<T, 1> mine(shape_t<1>{pdo::detail::chunk_size(b.elements, parts, me)}, pdo::detail::uninitialized);
        std::copy_n(b.flat.data() + b.slice_offset, mine.size(), mine.data());
        b.slice = parameter(std::move(mine));
      }
      comm = std::make_unique<pdo::detail::worker>(std::vector<int>{});
    }
    void pack_values(const bucket& b, T* out) const {
      for (std::size_t j : b.params) {
        const auto v = params[j].value();
        out = std::copy(v.begin(), v.end(), out);
      }
    }
    void unpack_values(const bucket& b, const T* in) const {
      for (std::size_t j : b.params) {
        const auto v = params[j].value();
        std::copy_n(in, v.size(), v.data());
        in += v.size();
      }
    }
    double since_start() const { return std::chrono::duration<double, std::micro>(clock::now() - start).count(); }
    void record(std::string what, std::size_t b, double from, double to, double queued = -1) {
      std::lock_guard lock(events_mutex);
      events.push_back({place, std::move(what), b, from, to, queued < 0 ? from : queued});
    }
  };

  template <class Target>
  static auto cut_targets(const Target& targets, const std::vector<std::size_t>& order, std::size_t first, std::size_t rows,
                          const any_place& where) {
    Target t(pdo::detail::with_rows(targets.shape(), rows), where, pdo::detail::uninitialized);
    pdo::detail::copy_rows(targets, order, first, t);
    return t;
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
      tensor<T, R> x(pdo::detail::with_rows(inputs.shape(), count), mesh_.place(p), pdo::detail::uninitialized);
      pdo::detail::copy_rows(inputs, order, at, x);
      out.push_back({std::move(x), cut_targets(targets, order, at, count, mesh_.place(p))});
    }
    return out;
  }

  /// @brief Hands bucket `b` to the communication thread, which all_reduces it: a bucket of
  /// one parameter in place, a bucket of several packed into one buffer.
  void launch(replica& r, std::size_t b) {
    auto& bk = r.buckets[b];
    std::span<T> data = bk.flat.span();
    if (bk.params.size() == 1 && !options_.zero1) {
      data = r.params[bk.params[0]].grad_or_zeros();
    } else {
      std::size_t at = 0;
      for (std::size_t j : bk.params) {
        const auto g = r.params[j].grad_or_zeros();
        std::copy(g.begin(), g.end(), bk.flat.data() + at);
        at += g.size();
        // under ZeRO-1 the packed copy is all that is reduced, and the step gathers values,
        // not gradients: the parameter's gradient is freed while backward goes on
        if (options_.zero1) r.params[j].zero_grad();
      }
    }
    ++r.launched;
    const std::size_t p = r.place;
    if (options_.zero1) bk.slice.node()->grad.emplace(shape_t<1>{bk.slice.shape()[0]});
    const std::span<T> slice_grad = options_.zero1 ? bk.slice.grad().span() : std::span<T>();
    const double queued = r.since_start();
    r.comm->submit([this, &r, data, slice_grad, b, p, queued] {
      const double from = r.since_start();
      try {
        const mesh_communicator comm = communicator_along(mesh_, dp_axis, p);
        if (options_.zero1) comm.reduce_scatter(std::span<const T>(data), slice_grad);
        else comm.all_reduce(data);
      } catch (...) {
        r.comm_failure = pdo::detail::captured_error::current();
      }
      r.record(options_.zero1 ? "reduce_scatter" : "all_reduce", b, from, r.since_start(), queued);
      r.finished.fetch_add(1, std::memory_order_acq_rel);
      r.finished.notify_all();
    });
  }
  /// @brief Launches the ready buckets, in bucket order (every place all_reduces them in the same order).
  void launch_ready(replica& r) {
    while (r.launched < r.buckets.size() && r.buckets[r.launched].ready) launch(r, r.launched);
  }
  void wait_launched(replica& r) {
    for (std::size_t f = r.finished.load(std::memory_order_acquire); f < r.launched; f = r.finished.load(std::memory_order_acquire))
      r.finished.wait(f, std::memory_order_acquire);
  }

  template <std::size_t R, class Target>
  T step_on(std::vector<batch_shard<T, R, Target>> shards, std::size_t global_rows) {
    std::vector<T> losses(replicas_.size());
    std::vector<double> corrects(replicas_.size());
    pdo::detail::run_on_places("data_parallel::step", mesh_, [&](std::size_t p, std::size_t k) {
      replica& r = *replicas_[k];
      auto& s = shards[k];
      r.events.clear();
      r.start = clock::now();
      r.launched = 0;
      r.finished.store(0);
      r.comm_failure.reset();
      for (auto& b : r.buckets) {
        b.waiting = b.params.size();
        b.ready = false;
      }
      for (auto& b : r.buckets)
        if (options_.zero1) b.slice.zero_grad();
      for (std::size_t j = 0; j < r.params.size(); ++j) {
        r.params[j].zero_grad();
        r.params[j].on_gradient([this, &r, j] {
          auto& b = r.buckets[r.bucket_of[j]];
          if (--b.waiting == 0) b.ready = true;
          if (options_.overlap) launch_ready(r);
        });
      }
      // whatever happens, the communication thread is done with this step's buffers before we return
      struct drain {
        data_parallel* self;
        replica& r;
        ~drain() { self->wait_launched(r); }
      } guard{this, r};
      T local{};
      std::size_t correct = 0;
      const std::size_t rows = s.inputs.extent(0);
      if (rows > 0) {
        const auto out = (*r.model)(var(s.inputs));
        const auto loss = loss_(out, s.targets) * (static_cast<T>(rows) / static_cast<T>(global_rows));
        const double forward_end = r.since_start();
        r.record("forward", 0, 0, forward_end);
        if constexpr (std::is_integral_v<typename Target::value_type>) correct = count_correct(out.value(), s.targets);
        local = loss.value().data()[0];
        pdo::backward(loss);
        r.record("backward", 0, forward_end, r.since_start());
      }
      for (auto& b : r.buckets) b.ready = true;  // parameters without gradient (no rows here, or unused) send zeros
      launch_ready(r);
      wait_launched(r);
      if (r.comm_failure) r.comm_failure->rethrow_with_context("gradient all_reduce: ");
      if (!options_.zero1) {
        for (auto& b : r.buckets) {
          if (b.params.size() == 1) continue;  // reduced in place
          std::size_t at = 0;
          for (std::size_t j : b.params) {
            const auto g = r.params[j].grad_or_zeros();
            std::copy_n(b.flat.data() + at, g.size(), g.data());
            at += g.size();
          }
        }
      }
      // the global batch's loss and count of correct predictions, on every place, before any
      // update: a step whose loss is not finite changes nothing
      double totals[2] = {static_cast<double>(local), static_cast<double>(correct)};
      communicator_along(mesh_, dp_axis, p).all_reduce(std::span<double>(totals, 2));
      losses[k] = static_cast<T>(totals[0]);
      corrects[k] = totals[1];
      if (!std::isfinite(totals[0])) return;
      const double opt_start = r.since_start();
      r.optimizer->step();
      r.record("optimizer", 0, opt_start, r.since_start());
      if (options_.zero1) {
        // every place's updated slice, gathered into every replica's parameters
        const mesh_communicator comm = communicator_along(mesh_, dp_axis, p);
        for (std::size_t b = 0; b < r.buckets.size(); ++b) {
          auto& bk = r.buckets[b];
          const double from = r.since_start();
          comm.all_gather(std::span<const T>(bk.slice.value().span()), bk.flat.span());
          r.unpack_values(bk, bk.flat.data());
          r.record("all_gather", b, from, r.since_start());
        }
      }
    });
    ++steps_;
    if (!std::isfinite(static_cast<double>(losses[0]))) {
      if (!options_.skip_nonfinite_steps)
        throw error("data_parallel::step: step " + std::to_string(steps_) + " (a global batch of " + std::to_string(global_rows) +
                    " rows on " + mesh_.describe() + "): the loss is " + std::to_string(static_cast<double>(losses[0])) +
                    "; no parameter was updated. Check the inputs and the learning rate, or skip such steps with "
                    "data_parallel_options::skip_nonfinite_steps");
      return losses[0];
    }
    last_epoch_correct_ += corrects[0];
    return losses[0];
  }

  template <class Label>
  static std::size_t count_correct(const tensor<T, 2>& out, const tensor<Label, 1>& labels) {
    std::size_t c = 0;
    const std::size_t classes = out.extent(1);
    for (std::size_t i = 0; i < out.extent(0); ++i) {
      const T* row = out.data() + i * classes;
      c += static_cast<std::size_t>(std::max_element(row, row + classes) - row) == static_cast<std::size_t>(labels(i));
    }
    return c;
  }
  template <class Out, class Y>
  static std::size_t count_correct(const Out&, const Y&) {
    return 0;
  }

  Mesh mesh_;
  data_parallel_options options_;
  Loss loss_;
  std::vector<std::unique_ptr<replica>> replicas_;
  double last_epoch_correct_ = 0;
  std::size_t steps_ = 0;  ///< steps taken, skipped ones included
};

/// @brief A data-parallel trainer: `make_model()` builds a replica (it runs on every place,
/// so use a fixed seed: all replicas must start equal) and `make_optimizer(parameters)`
/// its optimizer.
template <class T, class Mesh, class MakeModel, class MakeOptimizer, class Loss = cross_entropy_loss>
auto make_data_parallel(const Mesh& m, MakeModel make_model, MakeOptimizer make_optimizer, data_parallel_options o = {},
                        Loss loss = {}) {
  using model_t = std::invoke_result_t<MakeModel&>;
  using optimizer_t = std::invoke_result_t<MakeOptimizer&, std::vector<parameter_ref<T>>>;
  return data_parallel<T, model_t, optimizer_t, Mesh, Loss>(m, std::move(make_model), std::move(make_optimizer), o, loss);
}

}  // namespace pdo::nn
