// pdo/nn/sliced_weights.hpp: a data-parallel trainer's weight gradients made already summed
// and sliced, and folded into the update (data_parallel_options::sliced_weight_gradients).
//
// The gradient of a replicated weight W [K, N] used as x W on rows split over "dp" is
// xᵀ g, partial over "dp": the default sync all_reduces all K N elements of it, then every
// replica updates all of W. When the rows are few next to K N (a batch of 256 rows against a
// 4096 x 4096 weight), moving the product's operands is cheaper than moving the product: each
// place all_gathers x and g over "dp" (rows (K + N) elements per place), computes rows
// [lo, hi) of the summed product, its own K / n of them, with the batch's rows all at once,
// and folds the optimizer's update into that product (w <- keep w + scale xᵀg, one BLAS call
// with alpha = scale and beta = keep: the gradient is never stored). The operands are gathered
// while backward runs (a hook takes the product's gradient in backward's place) and the
// products are made once the weight's last use in backward is done: every use (a tied
// weight's too) has read its old value for its own input's gradient. The updated rows then
// go to every replica (a broadcast per place's rows), K N elements in all, where the default
// all_reduce moves twice that and the update reads and writes the whole weight on every place.
// Where the batch's rows times (K + N) reach K N, gathering the operands would move more than
// the product: such a weight's gradient is all_reduced (after backward) and the same update
// applied to it.
#pragma once

#include <pdo/comm/mesh_comms.hpp>
#include <pdo/core/error.hpp>
#include <pdo/kernels/gemm.hpp>
#include <pdo/nn/module.hpp>
#include <pdo/nn/optim.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace pdo::nn {

/// @brief The local matrices among one place's replica parameters whose gradients the
/// trainer makes sliced (see the file's comment), over mesh axis `axis`. Each step: start(),
/// then take_products() before a backward that every place runs (the hooks take each product
/// x W's gradient from then on), finish_step() after backward (what backward added otherwise is all_reduced and applied, then
/// every place's rows are broadcast); end() whenever a step stops (the hooks let backward
/// add gradients again).
template <class T, class Mesh>
class sliced_weights {
 public:
  /// @brief Takes, among `params` (place `place`'s replica), those listed in `candidates`
  /// that are local matrices, and hooks their products' gradients (inactive until take_products).
  sliced_weights(const Mesh& m, std::size_t axis, std::size_t place, const std::vector<parameter_ref<T>>& params,
                 const std::vector<std::size_t>& candidates)
      : mesh_(m), axis_(axis), place_(place) {
    if constexpr (blas_weights) {
      const std::size_t parts = m.extent(axis), me = m.coord(place, axis);
      for (std::size_t j : candidates) {
        const parameter_ref<T>& p = params[j];
        if (p.rank() != 2 || p.value_blocks().size() != 1 || !p.on_product_gradient(nullptr)) continue;
        // a parameter listed twice is one weight (its hook and its update once)
        if (std::ranges::any_of(weights_, [&](const weight& w) { return w.param.same_parameter(p); })) continue;
        const auto e = p.extents();
        weights_.push_back({j, p, e[0], e[1], pdo::detail::chunk_offset(e[0], parts, me), pdo::detail::chunk_size(e[0], parts, me), {}, false});
      }
      for (std::size_t i = 0; i < weights_.size(); ++i)
        weights_[i].param.on_product_gradient([this, i](const tensor<T, 2>& a, const tensor<T, 2>& g) { return take(i, a, g); });
    }
  }
  sliced_weights(const sliced_weights&) = delete;
  sliced_weights& operator=(const sliced_weights&) = delete;
  /// @brief Unhooks the weights (a copy of the model may outlive the trainer).
  ~sliced_weights() {
    for (auto& w : weights_) w.param.on_product_gradient(nullptr);
  }

  /// @brief The indices (in the replica's parameters) of the weights made sliced.
  [[nodiscard]] std::vector<std::size_t> indices() const {
    std::vector<std::size_t> out;
    for (const auto& w : weights_) out.push_back(w.index);
    return out;
  }
  /// @brief Whether any parameter is made sliced.
  [[nodiscard]] bool empty() const { return weights_.empty(); }

  /// @brief At a step's start: no gradients, no products taken, the hooks inactive.
  void start() {
    end();
    for (auto& w : weights_) {
      w.pending.clear();
      w.folded = false;
      w.param.zero_grad();
    }
  }
  /// @brief Before the step's (one) backward: the hooks take each product's gradient (its
  /// operands gathered), and once a weight's last use in backward is done its products are
  /// made with the update `u` folded in. Every place's backward must then reach the same
  /// products: each place has rows, and all run this backward.
  void take_products(linear_update<T> u) {
    update_ = u;
    active_ = true;
    for (std::size_t i = 0; i < weights_.size(); ++i) weights_[i].param.on_gradient([this, i] { fold(weights_[i], update_); });
  }

  /// @brief After the step's backward, with the step's update `u` (the same on every place):
  /// each weight's products taken in backward, its rows of them with `u` folded in; each
  /// weight that took no product, or got other gradients besides, has those (zeros where
  /// backward left none) all_reduced and applied to its rows; then each place's rows go to
  /// every replica.
  void finish_step(linear_update<T> u) {
    active_ = false;
    const mesh_communicator comm = communicator_along(mesh_, axis_, place_);
    const std::size_t parts = mesh_.extent(axis_);
    for (auto& w : weights_) {
      const std::span<T> value = w.param.value();
      fold(w, u);  // products not made yet
      const bool folded = w.folded;
      w.folded = false;
      // every place takes this branch alike: the same products folded, the same other uses
      if (!folded || !w.param.grad_blocks().empty()) {
        const std::span<T> g = w.param.grad_or_zeros();
        comm.all_reduce(g);
        const T keep = folded ? T(1) : u.keep;
        T* __restrict v = value.data() + w.lo * w.cols;
        const T* __restrict s = g.data() + w.lo * w.cols;
        const std::size_t n = w.rows_here * w.cols;
#pragma omp simd
        for (std::size_t e = 0; e < n; ++e) v[e] = keep * v[e] + u.scale * s[e];
      }
      for (std::size_t c = 0; c < parts; ++c) {
        const std::size_t lo = pdo::detail::chunk_offset(w.rows, parts, c), rows = pdo::detail::chunk_size(w.rows, parts, c);
        if (rows != 0) comm.broadcast(value.subspan(lo * w.cols, rows * w.cols), c);
      }
    }
  }

  /// @brief Whenever a step's backward is over: backward adds gradients again.
  void end() {
    active_ = false;
    for (auto& w : weights_) w.param.on_gradient(nullptr);
  }
  /// @brief After a step that failed: the operands gathered for it are dropped too.
  void abandon() {
    end();
    for (auto& w : weights_) w.pending.clear();
  }

 private:
  static constexpr bool blas_weights = pdo::detail::blas_gemm_v<T>;

  struct weight {
    std::size_t index;  ///< among the replica's parameters
    parameter_ref<T> param;
    std::size_t rows, cols;  ///< K, N
    std::size_t lo, rows_here;  ///< this place's rows [lo, lo + rows_here)
    /// @brief The operands of each product taken this step, gathered over the axis (x and g
    /// of the batch's rows), for finish_step.
    std::vector<std::pair<tensor<T, 2>, tensor<T, 2>>> pending;
    bool folded = false;  ///< products were folded into the rows this step
  };

  /// @brief Makes the products `w` took, into its rows with the update `u` folded in (the
  /// first applies u's keep, the next ones add); after the weight's last use in backward
  /// (no rule reads its value after it) or after backward.
  void fold(weight& w, linear_update<T> u) {
    if (w.pending.empty()) return;
    T* const rows = w.param.value().data() + w.lo * w.cols;
    for (const auto& [a_all, g_all] : w.pending) {
      if (w.rows_here == 0) break;
#if defined(PDO_WITH_BLAS)
      if constexpr (blas_weights) {
        pdo::detail::cpu_system system;
        system.threads = pdo::detail::current_place_system().threads;
        // rows [lo, lo + rows_here) of aᵀ g: a_all's columns lo.. read transposed
        pdo::detail::blas_gemm_on_cores(system, w.rows_here, w.cols, a_all.extent(0),
                                        pdo::detail::matrix_ref<T>{a_all.data() + w.lo, w.rows, true},
                                        pdo::detail::matrix_ref<T>{g_all.data(), w.cols, false}, rows, w.cols, u.scale,
                                        w.folded ? T(1) : u.keep);
      }
#endif
      w.folded = true;
    }
    w.folded = true;
    w.pending.clear();
  }

  /// @brief The hook of weight i: takes the gradient matmul(aᵀ, g) of this place's rows a
  /// [r, K] and g [r, N], its operands gathered over the axis for finish_step.
  bool take(std::size_t i, const tensor<T, 2>& a, const tensor<T, 2>& g) {
    weight& w = weights_[i];
    // inactive, or not this weight's product (the same answer on every place: K and N are)
    if (!active_ || a.extent(1) != w.rows || g.extent(1) != w.cols || a.on_gpu() || g.on_gpu()) return false;
    const mesh_communicator comm = communicator_along(mesh_, axis_, place_);
    const std::size_t parts = mesh_.extent(axis_);
    // every place's weight and rows: the places must be at the same weight's product (a
    // model whose path depends on its data could reach different ones: every place throws)
    std::vector<double> seen(2 * parts);
    const std::array<double, 2> mine{static_cast<double>(i), static_cast<double>(a.extent(0))};
    comm.all_gather(std::span<const double>(mine), std::span<double>(seen));
    std::size_t total = 0;
    for (std::size_t c = 0; c < parts; ++c) {
      const auto other = static_cast<std::size_t>(seen[2 * c]);
      if (other != static_cast<std::size_t>(seen[0]))
        throw mismatch_error("data_parallel: sliced weight gradients: the places' backward passes reach different weights' products (" +
                             mesh_.place(mesh_.group(axis_, place_)[0]).name() + ": " + weights_.at(static_cast<std::size_t>(seen[0])).param.name() +
                             ", " + mesh_.place(mesh_.group(axis_, place_)[c]).name() + ": " + weights_.at(other).param.name() +
                             "); with sliced_weight_gradients every place's backward must use the same weights in the same order "
                             "(leave the option off for a model whose path depends on its data)");
      total += static_cast<std::size_t>(seen[2 * c + 1]);
    }
    if (total == 0) return true;  // no rows anywhere: nothing to add
    // the operands' rows cost more than the product would: all_reduce the product instead
    // (the same answer on every place: the same rows, K and N)
    if (total * (w.rows + w.cols) >= w.rows * w.cols) return false;
    const any_place where = mesh_.place(place_);
    tensor<T, 2> a_all(shape_t<2>{total, w.rows}, where, pdo::detail::uninitialized), g_all(shape_t<2>{total, w.cols}, where, pdo::detail::uninitialized);
    comm.all_gather(std::span<const T>(a.data(), a.size()), a_all.span());
    comm.all_gather(std::span<const T>(g.data(), g.size()), g_all.span());
    w.pending.emplace_back(std::move(a_all), std::move(g_all));
    return true;
  }

  Mesh mesh_;
  std::size_t axis_, place_;
  std::vector<weight> weights_;
  linear_update<T> update_{};
  bool active_ = false;
};

}  // namespace pdo::nn
