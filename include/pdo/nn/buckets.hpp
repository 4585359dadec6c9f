// pdo/nn/buckets.hpp: gradient buckets, the one mechanism every trainer syncs replicated
// parameters' gradients with (the data-parallel trainer over "dp", the pipeline over its "dp"
// axis). The gradients of one place's parameters are grouped into buckets of about a given
// size, in the order backward completes them; a bucket whose gradients are complete is an
// engine task on the place's communication lane, which runs while backward goes on. What the
// task runs is the planner's redistribution of the gradient's layout: partial over the axis
// -> replicate (an all_reduce), or -> split over the axis (a reduce_scatter) under ZeRO-1,
// whose updated slices come back by split -> replicate (an all_gather).
#pragma once

#include <pdo/core/fixed_string.hpp>
#include <pdo/core/timeline.hpp>
#include <pdo/exec/engine.hpp>
#include <pdo/exec/mesh_ops.hpp>
#include <pdo/layout/redistribute_plan.hpp>
#include <pdo/nn/module.hpp>
#include <pdo/nn/optim.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace pdo::detail {

/// @brief The sum over the places `line` (mesh indices, this place's among them) of each of
/// `values`, host numbers exchanged through `host`, this place's endpoint in the mesh's host
/// group (whatever the places' devices). Every place of the mesh calls it, each with its own
/// line; the places of a line give as many values (those of other lines may give another
/// number: a pipeline's stages have their own parameters).
inline std::vector<double> sum_each_over(const mesh_communicator& host, std::span<const std::size_t> line, std::span<const double> values) {
  const std::size_t n = values.size();
  std::vector<std::size_t> counts(host.size(), 0);
  for (std::size_t q : line) counts[q] = n;
  std::vector<double> mine, theirs(line.size() * n);
  mine.reserve(line.size() * n);
  for (std::size_t q = 0; q < counts.size(); ++q)
    if (counts[q] != 0) mine.insert(mine.end(), values.begin(), values.end());
  host.all_to_all(std::span<const double>(mine), std::span<const std::size_t>(counts), std::span<double>(theirs),
                  std::span<const std::size_t>(counts));
  std::vector<double> sum(n);
  for (std::size_t q = 0; q < line.size(); ++q)
    for (std::size_t i = 0; i < n; ++i) sum[i] += theirs[q * n + i];
  return sum;
}

}  // namespace pdo::detail

namespace pdo::nn {

/// @brief A span of one step on one place, in microseconds from the step's start.
struct step_event {
  std::size_t place = 0;  ///< the place's index in the mesh
  std::string what;  ///< "forward", "backward", "all_reduce" (or "reduce_scatter", "all_gather" under ZeRO-1), "optimizer"
  std::size_t bucket = 0;  ///< the bucket of a collective (0 for the other events)
  /// @brief When the span began, in microseconds from the step's start.
  double start_us = 0, end_us = 0;
  /// @var end_us
  /// @brief When the span ended, in microseconds from the step's start.

  /// @brief For a bucket's collective: when backward queued it on the communication lane
  /// (start_us is when that lane began it). Otherwise start_us.
  double queued_us = 0;
};

/// @brief How gradients are bucketed.
struct bucket_options {
  /// @brief Gradients are synced in buckets of about this many bytes (at least one
  /// parameter each), in the order backward completes them (PyTorch DDP's default: 25 MiB);
  /// a parameter of half this or more is synced alone, in place (without ZeRO-1).
  std::size_t bucket_bytes = std::size_t{25} << 20;
  /// @brief Start a bucket's collective as soon as its last gradient is ready, while
  /// backward goes on; false: all buckets after backward (for comparison).
  bool overlap = true;
  /// @brief ZeRO stage 1: each bucket is reduce_scattered, each place keeps the sum of its
  /// slice, its optimizer updates that slice, and the slices are all_gathered back.
  bool zero1 = false;
};

/// @brief The gradients of one place's replicated parameters, synced in buckets over a group
/// of places (the place's line along a mesh axis). Each step: begin_step() (before backward),
/// arm() (before the backward whose gradients are the step's last contributions: they fire
/// the buckets), settle_reached() (after it, on every place of the mesh: the parameters no
/// place of the group reached are left without a gradient; optional), finish() (the
/// remaining buckets, then waits for all); under ZeRO-1 the optimizer steps slices() and
/// gather_slices() brings the updated values back. Or, fused: begin_step(), backward,
/// settle_reached(), then sync_and_update(), each bucket's all_reduce handing the sum to the
/// optimizer's update. It depends on the element type alone, so every
/// trainer and mesh of a program shares its code; gradient_buckets<T, Mesh, Axis> makes one
/// for a mesh axis, with the planner's collectives checked at compile time.
template <class T>
class group_gradient_buckets {
 public:
  /// @brief Groups `params`, the parameters of mesh place `place` (`where`), into buckets synced
  /// over `group`, its endpoint on the line of places along mesh axis `axis`: last parameter
  /// first (the order backward completes them); under ZeRO-1 also cuts this place's slice of
  /// each bucket. `host` is its endpoint in the mesh's host group and `line` the mesh indices
  /// of the places of `group` (which settle_reached() sums over).
  group_gradient_buckets(mesh_communicator group, mesh_communicator host, std::vector<std::size_t> line, std::string axis,
                         std::size_t place, any_place where, std::vector<parameter_ref<T>> params, bucket_options o)
      : group_(std::move(group)), host_(std::move(host)), line_(std::move(line)), axis_(std::move(axis)), place_(place),
        where_(std::move(where)), params_(std::move(params)), unreached_(params_.size(), 0), options_(o) {
    const std::size_t parts = group_.size(), me = group_.rank();
    bucket_of_.assign(params_.size(), 0);
    // backward completes the last layers first: buckets follow the parameters in reverse
    // a parameter of half a bucket or more gets a bucket of its own, synced in place: packing
    // it would copy it in and out for no saving in collectives (and the next one starts anew)
    const auto big = [&](std::size_t j) { return 2 * params_[j].bytes() >= o.bucket_bytes && !o.zero1; };
    for (std::size_t j = params_.size(); j-- > 0;) {
      if (buckets_.empty() || buckets_.back().elements * sizeof(T) >= o.bucket_bytes || big(j) || big(buckets_.back().params.back()))
        buckets_.emplace_back();
      buckets_.back().params.push_back(j);
      buckets_.back().elements += params_[j].size();
      bucket_of_[j] = buckets_.size() - 1;
    }
    for (auto& b : buckets_) {
      if (b.params.size() > 1 || o.zero1) b.flat = tensor<T, 1>(shape_t<1>{b.elements}, where_, pdo::detail::uninitialized);
      if (!o.zero1) continue;
      pack(b, /*values=*/true);
      b.slice_offset = pdo::detail::chunk_offset(b.elements, parts, me);
      tensor<T, 1> mine(shape_t<1>{pdo::detail::chunk_size(b.elements, parts, me)}, where_, pdo::detail::uninitialized);
      pdo::detail::copy_bytes(mine.where(), mine.data(), b.flat.where(), b.flat.data() + b.slice_offset, mine.bytes());
      b.slice = parameter(std::move(mine));
    }
  }
  group_gradient_buckets(const group_gradient_buckets&) = delete;
  group_gradient_buckets& operator=(const group_gradient_buckets&) = delete;
  ~group_gradient_buckets() { wait_launched(); }

  /// @brief Before a step's backward: no gradients, no bucket launched; times from now.
  void begin_step() {
    wait_launched();
    start_ = clock::now();
    events_.clear();
    launched_ = 0;
    finished_.store(0);
    failures_.clear();
    for (auto& b : buckets_) {
      b.waiting = b.params.size();
      b.ready = false;
      if (options_.zero1) b.slice.zero_grad();
    }
    for (std::size_t j = 0; j < params_.size(); ++j) {
      params_[j].zero_grad();
      params_[j].on_gradient(nullptr);
    }
    std::fill(unreached_.begin(), unreached_.end(), 0);
  }

  /// @brief The next backward completes the step's gradients: each parameter's last
  /// contribution counts toward its bucket (the timeline marks it), and with `launch` a
  /// complete bucket starts its collective (with bucket_options::overlap).
  void arm(bool launch = true) {
    for (std::size_t j = 0; j < params_.size(); ++j) {
      params_[j].on_gradient([this, j, launch] {
        if (pdo::detail::timeline_on())
          pdo::detail::timeline_instant("gradient", "gradient " + params_[j].name(), [&] { return "bucket " + std::to_string(bucket_of_[j]); });
        auto& b = buckets_[bucket_of_[j]];
        if (--b.waiting == 0) b.ready = true;
        if (launch && options_.overlap) launch_ready();
      });
    }
  }

  /// @brief After the step's backward: the buckets not launched yet (parameters without a
  /// gradient send zeros), then waits for every bucket and unpacks the packed ones. Throws
  /// the first failure of a bucket's collective.
  void finish() {
    for (std::size_t j = 0; j < params_.size(); ++j) params_[j].on_gradient(nullptr);
    for (auto& b : buckets_) b.ready = true;
    launch_ready();
    wait_launched();
    if (!failures_.empty()) failures_.front().rethrow_with_context("gradient " + std::string(step_name(sync_kind())) + ": ");
    if (options_.zero1) return;
    for (auto& b : buckets_)
      if (b.params.size() > 1) unpack(b, /*values=*/false);
    for (std::size_t j = 0; j < params_.size(); ++j)
      if (unreached_[j] != 0) params_[j].zero_grad();
  }

  /// @brief After the step's backward, instead of finish() and the optimizer's step(): every
  /// bucket's all_reduce fused with the update of its parameters (the planner's partial ->
  /// replicate step, its sum handed to `updates[j]`, the update of parameter j for this step,
  /// which may be empty for a parameter the optimizer does not update), on the communication
  /// lane, bucket after bucket; waits for all. Over shared memory each place sums its part of
  /// every bucket and updates that part of every replica (one pass over the gradients and
  /// parameters); the gradients are left as each place's own. Parameters without a gradient
  /// send zeros. Throws the first failure (the buckets before it are updated). For buckets of
  /// CPU places' replicas without ZeRO-1 (a pdo::error otherwise).
  void sync_and_update(const std::vector<element_update<T>>& updates) {
    if (options_.zero1 || where_.kind() != place_kind::cpu || updates.size() != params_.size())
      throw error("gradient_buckets::sync_and_update: fused updates take the buckets of a CPU place's replica without ZeRO-1, "
                  "one update per parameter (" + where_.name() + ", " + std::to_string(updates.size()) + " updates for " +
                  std::to_string(params_.size()) + " parameters" + (options_.zero1 ? ", ZeRO-1" : "") + ")");
    for (std::size_t j = 0; j < params_.size(); ++j) params_[j].on_gradient(nullptr);
    try {
      for (std::size_t b = 0; b < buckets_.size(); ++b) launch(b, &updates);
    } catch (...) {
      wait_launched();  // the queued ones use `updates` until they end
      throw;
    }
    wait_launched();
    if (!failures_.empty())
      failures_.front().rethrow_with_context("gradient " + std::string(step_name(sync_kind())) + " fused with the update: ");
  }

  /// @brief After a step that failed on this place: waits for the buckets already queued
  /// (every place queues them in the same order, so they complete, or are aborted with the
  /// step), queues no more.
  void abandon() {
    for (std::size_t j = 0; j < params_.size(); ++j) params_[j].on_gradient(nullptr);
    wait_launched();
  }

  /// @brief After the step's backward, before finish() or sync_and_update(), called by every
  /// place of the mesh (an exchange over its host group): finds the parameters that no place
  /// of the group gave a gradient this step (a branch the model did not take). finish() leaves
  /// them without a gradient (after sending zeros for them), so that the optimizer's step
  /// leaves them alone, as on one place; under ZeRO-1 their elements of the slices are updated
  /// with zeros. `extra`, numbers of this place (a loss, a count), is summed over the group
  /// in the same exchange: the sums are returned.
  std::vector<double> settle_reached(std::span<const double> extra = {}) {
    std::vector<double> mine(params_.size() + extra.size());
    for (std::size_t j = 0; j < params_.size(); ++j) mine[j] = params_[j].has_grad() ? 1.0 : 0.0;
    std::copy(extra.begin(), extra.end(), mine.begin() + static_cast<std::ptrdiff_t>(params_.size()));
    std::vector<double> sums = pdo::detail::sum_each_over(host_, line_, mine);
    for (std::size_t j = 0; j < params_.size(); ++j) unreached_[j] = sums[j] == 0 ? 1 : 0;
    sums.erase(sums.begin(), sums.begin() + static_cast<std::ptrdiff_t>(params_.size()));
    return sums;
  }
  /// @brief Whether some place of the group gave parameter `j` a gradient this step (true
  /// unless settle_reached() found none did): a fused update is given only for these.
  [[nodiscard]] bool reached(std::size_t j) const { return unreached_[j] == 0; }

  /// @brief ZeRO-1: this place's slice of each bucket, the parameters its optimizer updates.
  [[nodiscard]] std::vector<parameter_ref<T>> slices() const {
    std::vector<parameter_ref<T>> out;
    for (std::size_t b = 0; b < buckets_.size(); ++b) out.emplace_back("bucket" + std::to_string(b) + ".slice", buckets_[b].slice);
    return out;
  }

  /// @brief ZeRO-1: every place's updated slice, gathered into this place's parameters.
  void gather_slices() {
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      auto& bk = buckets_[b];
      const double from = since_start();
      pdo::detail::apply_flat_step<step_kind::all_gather>(group_, bk.slice.value().span(), bk.flat.span());
      unpack(bk, /*values=*/true);
      record("all_gather", b, from, since_start());
    }
  }

  /// @brief ZeRO-1: a run of parameter `param`'s elements (row-major) that this place's slice of
  /// bucket `bucket` holds: elements [first, first + count) of the parameter, at `at` in the slice.
  struct slice_run {
    std::size_t param = 0;   ///< index of the parameter
    std::size_t bucket = 0;  ///< index of the bucket (and of its slice among slices())
    std::size_t first = 0;   ///< the run's first element in the parameter
    std::size_t count = 0;   ///< the run's length
    std::size_t at = 0;      ///< where the run starts in the slice
  };
  /// @brief ZeRO-1: the runs of every parameter that this place's slices hold, bucket by bucket
  /// (a parameter lies in one bucket, so a place holds at most one run of it).
  [[nodiscard]] std::vector<slice_run> slice_runs() const {
    std::vector<slice_run> out;
    if (!options_.zero1) return out;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      const bucket& bk = buckets_[b];
      const std::size_t begin = bk.slice_offset, end = begin + bk.slice.shape()[0];
      std::size_t at = 0;
      for (std::size_t j : bk.params) {
        const std::size_t n = params_[j].size(), lo = std::max(at, begin), hi = std::min(at + n, end);
        if (lo < hi) out.push_back({j, b, lo - at, hi - lo, lo - begin});
        at += n;
      }
    }
    return out;
  }
  /// @brief ZeRO-1: this place's slice of parameter `param`'s bucket taken again from the
  /// parameters' values (after they were set from outside, as a checkpoint's load does).
  void reslice(std::size_t param) {
    if (!options_.zero1) return;
    bucket& bk = buckets_[bucket_of_[param]];
    pack(bk, /*values=*/true);
    const std::span<T> mine = bk.slice.value().span();
    pdo::detail::copy_bytes(bk.slice.value().where(), mine.data(), bk.flat.where(), bk.flat.data() + bk.slice_offset, mine.size_bytes());
  }

  /// @brief The parameters of each bucket, by index.
  [[nodiscard]] std::vector<std::vector<std::size_t>> members() const {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : buckets_) out.push_back(b.params);
    return out;
  }
  /// @brief The number of gradient elements in bucket `b`.
  [[nodiscard]] std::size_t elements(std::size_t b) const { return buckets_[b].elements; }
  /// @brief The number of buckets.
  [[nodiscard]] std::size_t size() const { return buckets_.size(); }
  /// @brief The optimizer state this place keeps: all the elements, or under ZeRO-1 its slices.
  [[nodiscard]] std::size_t optimizer_state_elements() const {
    std::size_t n = 0;
    for (const auto& b : buckets_) n += options_.zero1 ? b.slice.shape()[0] : b.elements;
    return n;
  }
  /// @brief The collective this place's buckets run: reduce_scatter under ZeRO-1, else all_reduce.
  [[nodiscard]] step_kind sync_kind() const { return options_.zero1 ? step_kind::reduce_scatter : step_kind::all_reduce; }

  /// @brief Microseconds since begin_step().
  [[nodiscard]] double since_start() const { return std::chrono::duration<double, std::micro>(clock::now() - start_).count(); }
  /// @brief Adds an event of this place's step (the trainer's forward, backward, optimizer).
  void record(std::string what, std::size_t b, double from, double to, double queued = -1) {
    std::lock_guard lock(events_mutex_);
    events_.push_back({place_, std::move(what), b, from, to, queued < 0 ? from : queued});
  }
  /// @brief The events recorded since begin_step(), in the order recorded.
  [[nodiscard]] std::vector<step_event> events() const {
    std::lock_guard lock(events_mutex_);
    return events_;
  }

 private:
  using clock = std::chrono::steady_clock;

  struct bucket {
    std::vector<std::size_t> params;  ///< indices into params_
    std::size_t elements = 0;
    tensor<T, 1> flat;        ///< the gradients packed (buckets of several parameters, and all under ZeRO-1); under
                              ///< ZeRO-1 also where the updated slices are gathered
    var<tensor<T, 1>> slice;  ///< ZeRO-1: this place's slice of the parameters, which its optimizer updates
    std::size_t slice_offset = 0;
    std::size_t waiting = 0;  ///< gradients not yet complete in this step
    bool ready = false;
  };

  /// @brief The gradients (or, with `values`, the values) of b's parameters into b.flat.
  void pack(bucket& b, bool values) {
    std::size_t at = 0;
    for (std::size_t j : b.params) {
      const std::span<T> from = values ? params_[j].value() : params_[j].grad_or_zeros();
      pdo::detail::copy_bytes(b.flat.where(), b.flat.data() + at, where_.state().get(), from.data(), from.size_bytes());
      at += from.size();
    }
  }
  /// @brief b.flat back into its parameters' gradients (or values).
  void unpack(bucket& b, bool values) {
    std::size_t at = 0;
    for (std::size_t j : b.params) {
      const std::span<T> to = values ? params_[j].value() : params_[j].grad_or_zeros();
      pdo::detail::copy_bytes(where_.state().get(), to.data(), b.flat.where(), b.flat.data() + at, to.size_bytes());
      at += to.size();
    }
  }

  /// @brief What a fused bucket's all_reduce hands its sum to: the updates of the bucket's
  /// parameters, each given its part of the range (called by every place of the group).
  struct bucket_consumer {
    const bucket* b = nullptr;
    const std::vector<parameter_ref<T>>* params = nullptr;
    const std::vector<element_update<T>>* updates = nullptr;
    static void call(const void* context, std::size_t lo, std::size_t hi, const T* sum) {
      const auto& c = *static_cast<const bucket_consumer*>(context);
      std::size_t at = 0;  // where parameter j begins in the bucket
      for (std::size_t j : c.b->params) {
        const std::size_t n = (*c.params)[j].size(), from = std::max(lo, at), to = std::min(hi, at + n);
        if (from < to && (*c.updates)[j]) (*c.updates)[j](from - at, to - at, sum + (from - lo));
        at += n;
        if (at >= hi) break;
      }
    }
  };

  /// @brief Queues bucket `b`'s collective on the place's communication lane: a bucket of one
  /// parameter in place, a bucket of several packed into one buffer. With `updates`, its
  /// all_reduce is fused with them (sync_and_update).
  void launch(std::size_t b, const std::vector<element_update<T>>* updates = nullptr) {
    auto& bk = buckets_[b];
    std::span<T> data = bk.flat.span();
    if (bk.params.size() == 1 && !options_.zero1) {
      data = params_[bk.params[0]].grad_or_zeros();
    } else {
      pack(bk, /*values=*/false);
      // under ZeRO-1 the packed copy is all that is reduced, and the step gathers values,
      // not gradients: the parameter's gradient is freed while backward goes on
      if (options_.zero1)
        for (std::size_t j : bk.params) params_[j].zero_grad();
    }
    ++launched_;
    if (options_.zero1) bk.slice.node()->grad.emplace(shape_t<1>{bk.slice.shape()[0]}, where_);
    const std::span<T> slice_grad = options_.zero1 ? bk.slice.grad().span() : std::span<T>();
    const double queued = since_start();
    pdo::detail::task_request request;
    request.home = &pdo::detail::lane_of(*where_.state(), lane_kind::communication);
    request.op = options_.zero1 ? "bucket reduce_scatter" : "bucket all_reduce";
    request.category = "collective";
    request.uses.reads.push_back(data.data());
    request.uses.writes.push_back(options_.zero1 ? static_cast<const void*>(slice_grad.data()) : data.data());
    if (updates != nullptr)
      for (std::size_t j : bk.params) request.uses.writes.push_back(params_[j].value().data());
    if (pdo::detail::timeline_on())
      request.detail = "bucket " + std::to_string(b) + ": " + std::to_string(data.size_bytes()) + " bytes over \"" +
                       axis_ + "\" (" + std::to_string(bk.params.size()) + " parameters)" +
                       (updates != nullptr ? ", fused with the optimizer's update" : "");
    request.fn = [this, data, slice_grad, b, queued, updates] {
      const double from = since_start();
      try {
        if (options_.zero1) {
          pdo::detail::apply_flat_step<step_kind::reduce_scatter>(group_, data, slice_grad);
        } else if (updates != nullptr) {
          const bucket_consumer consumer{&buckets_[b], &params_, updates};
          pdo::detail::apply_flat_sum(group_, data, reduced_consumer<T>{&bucket_consumer::call, &consumer});
        } else {
          pdo::detail::apply_flat_step<step_kind::all_reduce>(group_, data);
        }
      } catch (...) {
        std::lock_guard lock(events_mutex_);
        failures_.push_back(pdo::detail::captured_error::current());
      }
      record(options_.zero1 ? "reduce_scatter" : "all_reduce", b, from, since_start(), queued);
      finished_.fetch_add(1, std::memory_order_acq_rel);
      finished_.notify_all();
    };
    pdo::detail::engine::instance().submit(std::move(request));
  }
  /// @brief Launches the ready buckets, in bucket order (every place syncs them in the same order).
  void launch_ready() {
    while (launched_ < buckets_.size() && buckets_[launched_].ready) launch(launched_);
  }
  void wait_launched() {
    for (std::size_t f = finished_.load(std::memory_order_acquire); f < launched_; f = finished_.load(std::memory_order_acquire))
      finished_.wait(f, std::memory_order_acquire);
  }

  mesh_communicator group_;
  mesh_communicator host_;         ///< this place's endpoint in the mesh's host group
  std::vector<std::size_t> line_;  ///< the mesh indices of the group's places
  std::string axis_;  ///< the mesh axis the group lies along (its name, for the timeline)
  std::size_t place_;
  any_place where_;
  std::vector<parameter_ref<T>> params_;
  std::vector<char> unreached_;  ///< per parameter: 1 when settle_reached() found no place of the group gave it a gradient
  bucket_options options_;
  std::vector<bucket> buckets_;
  std::vector<std::size_t> bucket_of_;  ///< per parameter
  std::size_t launched_ = 0;            ///< buckets queued this step
  std::atomic<std::size_t> finished_{0};
  mutable std::mutex events_mutex_;
  std::vector<step_event> events_;
  std::vector<pdo::detail::captured_error> failures_;
  clock::time_point start_ = clock::now();
};

/// @brief The gradients of one place's replicated parameters, synced in buckets over mesh axis
/// `Axis` (see group_gradient_buckets): the planner's redistribution of a bucket's layout,
/// checked here at compile time, is one all_reduce over the axis (partial -> replicate), or
/// under ZeRO-1 one reduce_scatter (partial -> split) whose updated slices come back by one
/// all_gather (split -> replicate); the buckets run those collectives over the place's line
/// along the axis.
template <class T, class Mesh, fixed_string Axis>
class gradient_buckets : public group_gradient_buckets<T> {
 public:
  /// @brief The index of `Axis` among the mesh's axes.
  static constexpr std::size_t axis = Mesh::axis_index(Axis);
  static_assert(axis < Mesh::ndim, "pdo: gradient_buckets: the mesh has no such axis");

  /// @brief A bucket's layouts as the planner sees them (flat): the gradient, a partial sum
  /// over the axis; replicated; sliced over the axis. (As values: nvcc's front end loses
  /// the template parameter object of a partial<"axis"> type first named here.)
  static constexpr detail::layout_value gradient_layout = [] {
    detail::layout_value v;
    v.rank = 1;
    v.add_partial(std::string_view(Axis));
    return v;
  }();
  /// @brief A bucket replicated: every place holds the whole sum (after the all_reduce).
  static constexpr detail::layout_value replicated = [] {
    detail::layout_value v;
    v.rank = 1;
    return v;
  }();
  /// @brief A bucket sliced over the axis: each place holds the sum of its chunk (ZeRO-1, after the reduce_scatter).
  static constexpr detail::layout_value sliced = [] {
    detail::layout_value v;
    v.rank = 1;
    v.dim_axis[0] = std::string_view(Axis);
    return v;
  }();
  /// @brief The planner's plan from gradient_layout to replicated: one all_reduce (checked below).
  static constexpr redistribute_plan sync_plan = detail::plan_redistribute(gradient_layout, replicated);
  /// @brief The planner's plan from gradient_layout to sliced (ZeRO-1): one reduce_scatter.
  static constexpr redistribute_plan scatter_plan = detail::plan_redistribute(gradient_layout, sliced);
  /// @brief The planner's plan from sliced to replicated (ZeRO-1's updated slices): one all_gather.
  static constexpr redistribute_plan gather_plan = detail::plan_redistribute(sliced, replicated);
  static_assert(sync_plan.size == 1 && sync_plan.steps[0].kind == step_kind::all_reduce && sync_plan.steps[0].axis == std::string_view(Axis),
                "pdo: gradient_buckets: the planner should sync a partial gradient with one all_reduce over the axis");
  static_assert(scatter_plan.size == 1 && scatter_plan.steps[0].kind == step_kind::reduce_scatter && scatter_plan.steps[0].axis == std::string_view(Axis),
                "pdo: gradient_buckets: the planner should shard a partial gradient with one reduce_scatter over the axis");
  static_assert(gather_plan.size == 1 && gather_plan.steps[0].kind == step_kind::all_gather && gather_plan.steps[0].axis == std::string_view(Axis),
                "pdo: gradient_buckets: the planner should gather slices with one all_gather over the axis");

  /// @brief The redistribution step each bucket runs.
  [[nodiscard]] static constexpr const redistribute_step& step_of(bool zero1) {
    return zero1 ? scatter_plan.steps[0] : sync_plan.steps[0];
  }

  /// @brief Groups `params`, the parameters of mesh place `place`, into buckets synced over
  /// its line along `Axis` (see group_gradient_buckets).
  gradient_buckets(const Mesh& m, std::size_t place, std::vector<parameter_ref<T>> params, bucket_options o)
      : group_gradient_buckets<T>(communicator_along(m, axis, place), host_communicator_of(m, place), m.group(axis, place),
                                  std::string(std::string_view(Axis)), place, m.place(place), std::move(params), o) {}
};

}  // namespace pdo::nn
