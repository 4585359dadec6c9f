// pdo/nn/optim.hpp: SGD (momentum, weight decay) and Adam / AdamW, with PyTorch's update rules;
// gradient clipping by global norm; learning-rate schedules. Each optimizer updates the
// parameters it was given, in place, on the cores of the place whose thread calls step():
// under data parallelism every place steps its own copy.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/owned.hpp>
#include <pdo/kernels/place_system.hpp>
#include <pdo/nn/module.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <functional>
#include <memory>
#include <numbers>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo::detail {

/// @brief SGD's update of element i: with a momentum buffer when `Momentum` (`first`: the
/// buffer's first value is the gradient). Branch-free, so that its loop vectorizes.
template <class T, bool Momentum>
struct sgd_update {
  T* p;
  const T* g;
  T* buf;  ///< momentum buffer (Momentum only)
  T lr, momentum, weight_decay;
  bool first;
  PDO_HD void operator()(std::size_t i) const {
    T d = g[i] + weight_decay * p[i];
    if constexpr (Momentum) {
      const T b = first ? d : momentum * buf[i] + d;
      buf[i] = b;
      d = b;
    }
    p[i] -= lr * d;
  }
};

/// @brief Adam's update of element i; AdamW's (`Decoupled`: the weights decay, not the
/// gradient). Branch-free, so that its loop vectorizes. Its coefficients are computed in double
/// and rounded to T once, and the step is taken in PyTorch's order (lr / (1 - beta1^t) times
/// the mean, over the root of the mean square scaled by sqrt(1 - beta2^t), plus eps): a float
/// model takes PyTorch's float steps, not steps off by the rounding of 1 - beta2 in float
/// (7e-6 of each step).
template <class T, bool Decoupled>
struct adam_update {
  T* p;
  const T* g;
  T* m;
  T* v;
  T beta1, rest1, beta2, rest2;   ///< each beta and 1 - beta
  T eps, weight_decay, kept;      ///< kept: 1 - lr * weight_decay, what AdamW keeps of a weight
  T step_size, correction2_root;  ///< lr / (1 - beta1^t), sqrt(1 - beta2^t)
  /// @brief The update of step `t` (counted from 1) with these settings.
  static adam_update at_step(T* p, const T* g, T* m, T* v, double lr, double beta1, double beta2, double eps, double weight_decay,
                             double t) {
    return {p,
            g,
            m,
            v,
            static_cast<T>(beta1),
            static_cast<T>(1 - beta1),
            static_cast<T>(beta2),
            static_cast<T>(1 - beta2),
            static_cast<T>(eps),
            static_cast<T>(weight_decay),
            static_cast<T>(1 - lr * weight_decay),
            static_cast<T>(lr / (1 - std::pow(beta1, t))),
            static_cast<T>(std::sqrt(1 - std::pow(beta2, t)))};
  }
  /// @brief The same update of elements [lo, ...) of the parameter and its moments, whose
  /// gradient starts at `grad` (grad[0] being element lo's): what a fused update applies to
  /// each range it is handed.
  [[nodiscard]] adam_update at_range(std::size_t lo, const T* grad) const {
    adam_update range = *this;
    range.p += lo;
    range.g = grad;
    range.m += lo;
    range.v += lo;
    return range;
  }
  PDO_HD void operator()(std::size_t i) const {
    using std::sqrt;
    T d = g[i];
    T w = p[i];
    if constexpr (Decoupled) w *= kept;
    else d += weight_decay * w;
    const T mi = beta1 * m[i] + rest1 * d;
    const T vi = beta2 * v[i] + rest2 * d * d;
    m[i] = mi;
    v[i] = vi;
    p[i] = w - step_size * mi / (static_cast<T>(sqrt(vi)) / correction2_root + eps);
  }
};

/// @brief Throws a pdo::error naming the optimizer `op` and its setting `name` when `value` is
/// not finite or breaks `ok` (described by `rule`), as PyTorch's optimizers reject such
/// settings when made.
PDO_NOINLINE inline void check_setting(std::string_view op, std::string_view name, double value, bool ok, std::string_view rule) {
  if (ok && std::isfinite(value)) return;
  throw error(std::string(op) + ": " + std::string(name) + " must be " + std::string(rule) + ", not " + format_number(value));
}

/// @brief The learning rate of optimizer `op`: finite and not negative.
inline void check_lr(std::string_view op, double lr) { check_setting(op, "lr", lr, lr >= 0, "finite and >= 0"); }

/// @brief g[i] *= factor (a gradient clipped by its global norm).
template <class T>
struct scale_update {
  T* g;
  T factor;
  PDO_HD void operator()(std::size_t i) const { g[i] = g[i] * factor; }
};

}  // namespace pdo::detail

namespace pdo::nn {

/// @brief The squared norm of the gradients of `params`, over every element of every
/// parameter counted once whatever its layout (see parameter_ref::grad_squared_norm).
template <class T>
double grad_squared_norm(const std::vector<parameter_ref<T>>& params) {
  double sum = 0;
  for (const auto& p : params) sum += p.grad_squared_norm();
  return sum;
}

/// @brief Multiplies every local block of the gradients of `params` by `factor`.
template <class T>
void scale_grads(const std::vector<parameter_ref<T>>& params, double factor) {
  for (const auto& p : params) {
    const auto grads = p.grad_blocks();
    const auto places = p.block_places();
    for (std::size_t k = 0; k < grads.size(); ++k)
      pdo::detail::for_each_index(places[k], grads[k].size(), pdo::detail::scale_update<T>{grads[k].data(), static_cast<T>(factor)});
  }
}

/// @brief The factor clip_grad_norm scales gradients of global norm `norm` by (PyTorch's
/// rule): max_norm / (norm + 1e-6) when that is below 1, else 1 (and 1 when the norm is not
/// finite: such gradients are left as they are, for the caller to see).
inline double clip_factor(double norm, double max_norm) {
  if (!std::isfinite(norm)) return 1;
  const double f = max_norm / (norm + 1e-6);
  return f < 1 ? f : 1;
}

/// @brief Clips the gradients of `params` by their global norm, as
/// torch.nn.utils.clip_grad_norm_: the norm is taken over every element of every parameter
/// (a dtensor's over all its shards, on every process, each element counted once whatever
/// its layout), and when it exceeds `max_norm` every gradient is scaled by
/// max_norm / (norm + 1e-6). Returns the norm before clipping. Over several processes, every
/// process calls it with the same parameters.
template <class T>
double clip_grad_norm(const std::vector<parameter_ref<T>>& params, double max_norm) {
  pdo::detail::check_setting("clip_grad_norm", "max_norm", max_norm, max_norm > 0, "positive and finite");
  const double norm = std::sqrt(grad_squared_norm(params));
  const double f = clip_factor(norm, max_norm);
  if (f < 1) scale_grads(params, f);
  return norm;
}

/// @brief A learning rate for each optimizer step, given the number of steps taken before it
/// (0 for the first). A trainer with a schedule sets its optimizer's rate from it before
/// every update; since it depends on the step count only, a run resumed from a checkpoint
/// follows it as if it had not stopped.
using lr_schedule = std::function<double(std::size_t step)>;

/// @brief `lr` at every step.
inline lr_schedule constant_lr(double lr) {
  return [lr](std::size_t) { return lr; };
}

/// @brief PyTorch's StepLR, counted in steps: lr * gamma^floor(step / step_size).
inline lr_schedule step_lr(double lr, std::size_t step_size, double gamma = 0.1) {
  if (step_size == 0) throw error("step_lr: step_size must be at least 1");
  return [=](std::size_t step) { return lr * std::pow(gamma, static_cast<double>(step / step_size)); };
}

/// @brief Linear warm-up, then cosine decay: lr * (step + 1) / warmup_steps for the first
/// warmup_steps steps; then min_lr + (lr - min_lr) * (1 + cos(pi * (step - warmup_steps) /
/// (total_steps - warmup_steps))) / 2 until total_steps; min_lr after.
inline lr_schedule cosine_lr(double lr, std::size_t warmup_steps, std::size_t total_steps, double min_lr = 0) {
  if (warmup_steps > total_steps)
    throw error("cosine_lr: " + std::to_string(warmup_steps) + " warm-up steps exceed the " + std::to_string(total_steps) + " steps in all");
  return [=](std::size_t step) {
    if (step < warmup_steps) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
    if (step >= total_steps) return min_lr;
    const double progress = static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
    return min_lr + (lr - min_lr) * 0.5 * (1 + std::cos(std::numbers::pi * progress));
  };
}

/// @brief The update of one parameter's elements from their gradient, made for one step
/// (optimizers' fused_update): `update(lo, hi, g)` applies the step to elements [lo, hi) of the
/// parameter's only block, g[0] being element lo's gradient. A data-parallel trainer hands it
/// the summed gradient while the all_reduce makes it (data_parallel_options::fused_update).
template <class T>
using element_update = std::function<void(std::size_t lo, std::size_t hi, const T* g)>;

/// @brief An update that is linear in the gradient and keeps no state, w <- keep w + scale g
/// element for element (plain SGD: keep = 1 - lr weight_decay, scale = -lr), which a
/// data-parallel trainer can fold into the product that makes a weight's gradient
/// (data_parallel_options::sliced_weight_gradients).
template <class T>
struct linear_update {
  T keep = T(1);   ///< what the value is multiplied by
  T scale = T(0);  ///< what the gradient is multiplied by before it is added
};

/// @brief What every optimizer has: the parameters it updates.
template <class T>
class optimizer_base {
 public:
  /// @brief Forgets the gradients (before the next backward, which would add to them).
  void zero_grad() {
    for (auto& p : params_) p.zero_grad();
  }
  /// @brief The parameters this optimizer updates, in the order it was given them.
  [[nodiscard]] const std::vector<parameter_ref<T>>& parameters() const { return params_; }
  /// @brief Whether this optimizer can update its parameters range by range from gradients
  /// handed to it (fused_update): yes, each element's update reads only its own gradient.
  [[nodiscard]] bool fusable() const { return true; }

 protected:
  /// @brief The values of parameter `i`, which a fused update takes whole: its only block.
  [[nodiscard]] T* only_block(std::size_t i, const char* op) const {
    const auto values = params_.at(i).value_blocks();
    if (values.size() != 1)
      throw error(std::string(op) + ": parameter " + params_[i].name() + " has " + std::to_string(values.size()) +
                  " blocks on this process; a fused update takes a parameter of one block (a replica)");
    return values[0].data();
  }
  /// @brief Keeps `params` (references: the optimizer updates the model's own values).
  explicit optimizer_base(std::vector<parameter_ref<T>> params) : params_(std::move(params)) {}
  std::vector<parameter_ref<T>> params_;  ///< the parameters updated, in the order given
};

/// @brief Settings of sgd, as PyTorch's torch.optim.SGD (no dampening, no Nesterov).
struct sgd_options {
  double lr = 0.01;         ///< learning rate
  double momentum = 0;      ///< momentum factor; 0: plain SGD, no momentum buffer kept
  double weight_decay = 0;  ///< L2 penalty: weight_decay * p is added to the gradient
};

/// @brief Stochastic gradient descent with optional momentum and (L2) weight decay.
template <class T>
class sgd : public optimizer_base<T> {
  using optimizer_base<T>::params_;

 public:
  /// @brief Rejects at compile time parameters of another element type than the optimizer's.
  template <class U>
    requires(!std::same_as<U, T>)
  sgd(std::vector<parameter_ref<U>>, sgd_options = {}) : optimizer_base<T>(std::vector<parameter_ref<T>>{}) {
    static_assert(pdo::detail::always_false<U>,
                  "pdo: sgd<T>: the parameters' element type is not T; give the optimizer the parameters' type "
                  "(sgd<double> for a linear<double>'s)");
  }
  /// @brief Rejects at compile time a layer or model given for its parameters.
  template <class Layer>
    requires requires(Layer& layer) { layer.parameters(); }
  sgd(Layer&, sgd_options = {}) : optimizer_base<T>(std::vector<parameter_ref<T>>{}) {
    static_assert(pdo::detail::always_false<Layer>,
                  "pdo: sgd: give the optimizer the layer's parameters, sgd<T>(layer.parameters(), {...}), not the layer");
  }
  /// @brief Updates `params` with the settings `o` (by default sgd_options' defaults).
  /// A pdo::error when a setting is negative or not finite.
  sgd(std::vector<parameter_ref<T>> params, sgd_options o = {}) : optimizer_base<T>(std::move(params)), o_(o), buffers_(params_.size()) {
    pdo::detail::check_lr("sgd", o.lr);
    pdo::detail::check_setting("sgd", "momentum", o.momentum, o.momentum >= 0, "finite and >= 0");
    pdo::detail::check_setting("sgd", "weight_decay", o.weight_decay, o.weight_decay >= 0, "finite and >= 0");
  }

  /// @brief One update of every parameter that has a gradient (of each of its local blocks).
  void step() {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto values = params_[i].value_blocks();
      const auto grads = params_[i].grad_blocks();
      if (grads.empty()) continue;
      const auto places = params_[i].block_places();
      auto& buffers = buffers_[i];
      const bool first = buffers.empty() && o_.momentum != 0;
      if (first) buffers = params_[i].zero_state();
      for (std::size_t k = 0; k < values.size(); ++k) {
        auto update = [&]<bool Momentum>() {
          pdo::detail::for_each_index(places[k], values[k].size(),
                                      pdo::detail::sgd_update<T, Momentum>{values[k].data(), grads[k].data(), Momentum ? buffers[k].data() : nullptr,
                                                                           static_cast<T>(o_.lr), static_cast<T>(o_.momentum),
                                                                           static_cast<T>(o_.weight_decay), first});
        };
        if (o_.momentum != 0) update.template operator()<true>();
        else update.template operator()<false>();
      }
    }
  }
  /// @brief Begins a step taken by fused updates (nothing to count for SGD).
  void begin_fused_step() {}
  /// @brief This step's update of parameter `i` (of one block), for step() applied range by
  /// range to gradients handed to it: the same rule, element for element.
  [[nodiscard]] element_update<T> fused_update(std::size_t i) {
    T* const p = this->only_block(i, "sgd::fused_update");
    auto& buffers = buffers_[i];
    const bool first = buffers.empty() && o_.momentum != 0;
    if (first) buffers = params_[i].zero_state();
    const T lr = static_cast<T>(o_.lr), momentum = static_cast<T>(o_.momentum), decay = static_cast<T>(o_.weight_decay);
    if (o_.momentum == 0)
      return [=](std::size_t lo, std::size_t hi, const T* g) {
        pdo::detail::for_each_element_range(pdo::detail::sgd_update<T, false>{p + lo, g, nullptr, lr, momentum, decay, false}, 0, 0, hi - lo);
      };
    T* const buf = buffers.at(0).data();
    return [=](std::size_t lo, std::size_t hi, const T* g) {
      pdo::detail::for_each_element_range(pdo::detail::sgd_update<T, true>{p + lo, g, buf + lo, lr, momentum, decay, first}, 0, 0, hi - lo);
    };
  }
  /// @brief This step's update as w <- keep w + scale g when it is one (no momentum: SGD
  /// then keeps no state), else none. The same rule as step(), rounded differently.
  [[nodiscard]] std::optional<linear_update<T>> linear_step() const {
    if (o_.momentum != 0) return std::nullopt;
    return linear_update<T>{static_cast<T>(1 - o_.lr * o_.weight_decay), static_cast<T>(-o_.lr)};
  }
  /// @brief Sets the learning rate of the next steps (a schedule calls this before each one);
  /// a pdo::error when it is negative or not finite.
  void set_lr(double lr) {
    pdo::detail::check_lr("sgd::set_lr", lr);
    o_.lr = lr;
  }
  /// @brief The current learning rate.
  [[nodiscard]] double lr() const { return o_.lr; }

  /// @brief The state kept per parameter, by PyTorch's names: "momentum_buffer" (with momentum).
  [[nodiscard]] std::vector<std::string> state_names() const {
    return o_.momentum != 0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  }
  /// @brief State `name` of parameter `i`: one block per local block of the parameter
  /// (zero-filled first if no step has made it yet), for checkpoints.
  [[nodiscard]] std::vector<tensor<T, 1>>& state(const std::string& name, std::size_t i) {
    if (name != "momentum_buffer" || o_.momentum == 0 || i >= params_.size())
      throw error("sgd::state: no state \"" + name + "\" for parameter " + std::to_string(i) + " (sgd keeps a momentum_buffer when momentum is not 0)");
    if (buffers_[i].empty()) buffers_[i] = params_[i].zero_state();
    return buffers_[i];
  }
  /// @brief Steps taken (SGD's update does not depend on it).
  [[nodiscard]] long steps() const { return 0; }
  /// @brief Does nothing: SGD keeps no step count (a checkpoint's is ignored).
  void set_steps(long) {}

 private:
  sgd_options o_;
  std::vector<std::vector<tensor<T, 1>>> buffers_;  ///< momentum, per parameter and block
};

/// @brief Settings of adam, as PyTorch's torch.optim.Adam (and AdamW with decoupled_weight_decay).
struct adam_options {
  double lr = 1e-3;         ///< learning rate
  double beta1 = 0.9;       ///< decay rate of the first moment (the mean of the gradients)
  double beta2 = 0.999;     ///< decay rate of the second moment (the mean of their squares)
  double eps = 1e-8;        ///< added to the square root of the second moment, against division by 0
  double weight_decay = 0;  ///< L2 penalty added to the gradient, or with AdamW p -= lr * weight_decay * p
  bool decoupled_weight_decay = false;  ///< true: AdamW
};

/// @brief Adam, or AdamW with decoupled_weight_decay (see adamw_options()).
template <class T>
class adam : public optimizer_base<T> {
  using optimizer_base<T>::params_;

 public:
  /// @brief Rejects at compile time parameters of another element type than the optimizer's.
  template <class U>
    requires(!std::same_as<U, T>)
  adam(std::vector<parameter_ref<U>>, adam_options = {}) : optimizer_base<T>(std::vector<parameter_ref<T>>{}) {
    static_assert(pdo::detail::always_false<U>,
                  "pdo: adam<T>: the parameters' element type is not T; give the optimizer the parameters' type "
                  "(adam<double> for a linear<double>'s)");
  }
  /// @brief Rejects at compile time a layer or model given for its parameters.
  template <class Layer>
    requires requires(Layer& layer) { layer.parameters(); }
  adam(Layer&, adam_options = {}) : optimizer_base<T>(std::vector<parameter_ref<T>>{}) {
    static_assert(pdo::detail::always_false<Layer>,
                  "pdo: adam: give the optimizer the layer's parameters, adam<T>(layer.parameters(), {...}), not the layer");
  }
  /// @brief Updates `params` with the settings `o` (by default adam_options' defaults).
  /// A pdo::error when a setting is out of its range (betas in [0, 1), the others >= 0) or not finite.
  adam(std::vector<parameter_ref<T>> params, adam_options o = {})
      : optimizer_base<T>(std::move(params)), o_(o), m_(params_.size()), v_(params_.size()), t_(params_.size(), 0) {
    pdo::detail::check_lr("adam", o.lr);
    pdo::detail::check_setting("adam", "beta1", o.beta1, o.beta1 >= 0 && o.beta1 < 1, "in [0, 1)");
    pdo::detail::check_setting("adam", "beta2", o.beta2, o.beta2 >= 0 && o.beta2 < 1, "in [0, 1)");
    pdo::detail::check_setting("adam", "eps", o.eps, o.eps >= 0, "finite and >= 0");
    pdo::detail::check_setting("adam", "weight_decay", o.weight_decay, o.weight_decay >= 0, "finite and >= 0");
  }

  /// @brief Updates every parameter that has a gradient (each of its local blocks), with
  /// bias-corrected moments. As PyTorch's, each parameter counts its own steps (those it had
  /// a gradient in): a parameter whose first gradient comes at the tenth step is corrected
  /// as at its first.
  void step() {
    ++steps_;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto values = params_[i].value_blocks();
      const auto grads = params_[i].grad_blocks();
      if (grads.empty()) continue;
      const double t = static_cast<double>(++t_[i]);
      const auto places = params_[i].block_places();
      if (m_[i].empty()) {
        m_[i] = params_[i].zero_state();
        v_[i] = params_[i].zero_state();
      }
      for (std::size_t k = 0; k < values.size(); ++k) {
        auto update = [&]<bool Decoupled>() {
          pdo::detail::for_each_index(places[k], values[k].size(),
                                      pdo::detail::adam_update<T, Decoupled>::at_step(values[k].data(), grads[k].data(), m_[i][k].data(),
                                                                                      v_[i][k].data(), o_.lr, o_.beta1, o_.beta2, o_.eps,
                                                                                      o_.weight_decay, t));
        };
        if (o_.decoupled_weight_decay) update.template operator()<true>();
        else update.template operator()<false>();
      }
    }
  }
  /// @brief Begins a step taken by fused updates: counts it, as step() does.
  void begin_fused_step() { ++steps_; }
  /// @brief This step's update of parameter `i` (of one block), for step() applied range by
  /// range to gradients handed to it: counts the parameter's step, and applies the same rule,
  /// element for element.
  [[nodiscard]] element_update<T> fused_update(std::size_t i) {
    T* const p = this->only_block(i, "adam::fused_update");
    const double t = static_cast<double>(++t_[i]);
    if (m_[i].empty()) {
      m_[i] = params_[i].zero_state();
      v_[i] = params_[i].zero_state();
    }
    T* const m = m_[i].at(0).data();
    T* const v = v_[i].at(0).data();
    auto update = [&]<bool Decoupled>() -> element_update<T> {
      const auto rule = pdo::detail::adam_update<T, Decoupled>::at_step(p, nullptr, m, v, o_.lr, o_.beta1, o_.beta2, o_.eps, o_.weight_decay, t);
      return [rule](std::size_t lo, std::size_t hi, const T* g) { pdo::detail::for_each_element_range(rule.at_range(lo, g), 0, 0, hi - lo); };
    };
    return o_.decoupled_weight_decay ? update.template operator()<true>() : update.template operator()<false>();
  }
  /// @brief Sets the learning rate of the next steps (a schedule calls this before each one);
  /// a pdo::error when it is negative or not finite.
  void set_lr(double lr) {
    pdo::detail::check_lr("adam::set_lr", lr);
    o_.lr = lr;
  }
  /// @brief The current learning rate.
  [[nodiscard]] double lr() const { return o_.lr; }

  /// @brief The state kept per parameter, by PyTorch's names: the moments "exp_avg" and "exp_avg_sq".
  [[nodiscard]] std::vector<std::string> state_names() const { return {"exp_avg", "exp_avg_sq"}; }
  /// @brief State `name` of parameter `i`: one block per local block of the parameter
  /// (zero-filled first if no step has made it yet), for checkpoints.
  [[nodiscard]] std::vector<tensor<T, 1>>& state(const std::string& name, std::size_t i) {
    if ((name != "exp_avg" && name != "exp_avg_sq") || i >= params_.size())
      throw error("adam::state: no state \"" + name + "\" for parameter " + std::to_string(i) + " (adam keeps exp_avg and exp_avg_sq)");
    if (m_[i].empty()) {
      m_[i] = params_[i].zero_state();
      v_[i] = params_[i].zero_state();
    }
    return name == "exp_avg" ? m_[i] : v_[i];
  }
  /// @brief Steps taken (calls of step()).
  [[nodiscard]] long steps() const { return steps_; }
  /// @brief Steps parameter `i` has taken (those it had a gradient in): its bias corrections'
  /// t.
  [[nodiscard]] long steps(std::size_t i) const { return t_.at(i); }
  /// @brief Sets the steps taken, of the optimizer and of every parameter (a checkpoint
  /// restores it, then each parameter's own count with set_steps(i, t), so the bias
  /// corrections continue).
  void set_steps(long t) {
    steps_ = t;
    std::fill(t_.begin(), t_.end(), t);
  }
  /// @brief Sets the steps parameter `i` has taken (a checkpoint restores each parameter's).
  void set_steps(std::size_t i, long t) { t_.at(i) = t; }

 private:
  adam_options o_;
  std::vector<std::vector<tensor<T, 1>>> m_, v_;  ///< moments, per parameter and block
  std::vector<long> t_;                           ///< steps per parameter
  long steps_ = 0;
};

/// @brief An optimizer of parameters of element type T: sgd, adam, any_optimizer, or a type
/// of the user's with these members. Checkpoints (pdo::io) also need its state:
/// state_names(), state(name, i), steps() and set_steps(t), as sgd and adam have.
template <class O, class T>
concept optimizer = requires(O& o, const O& co, double lr) {
  o.step();
  o.zero_grad();
  o.set_lr(lr);
  { co.lr() } -> std::convertible_to<double>;
  { co.parameters() } -> std::convertible_to<const std::vector<parameter_ref<T>>&>;
};

/// @brief An optimizer that can take a step as fused updates (sgd, adam, any_optimizer): a
/// data-parallel trainer on CPU places of one process hands each parameter's update the summed
/// gradient while the all_reduce makes it, instead of calling step() after it. `fusable()`
/// says whether it can (any_optimizer: whether what it holds can).
template <class O, class T>
concept fused_optimizer = requires(O& o, const O& co, std::size_t i) {
  { co.fusable() } -> std::convertible_to<bool>;
  o.begin_fused_step();
  { o.fused_update(i) } -> std::convertible_to<element_update<T>>;
};

/// @brief Any optimizer of T parameters, chosen at run time (SGD or Adam from a command-line
/// flag, say): holds one and forwards to it. Copies share the optimizer they hold.
template <class T>
class any_optimizer {
 public:
  /// @brief Holds `o` (copied or moved in); implicit, so a factory may return any optimizer.
  template <class O>
    requires(optimizer<std::remove_cvref_t<O>, T> && !std::same_as<std::remove_cvref_t<O>, any_optimizer>)
  any_optimizer(O&& o)  // NOLINT: implicit, so a factory may return any optimizer
      : impl_(pdo::detail::own_as<base>(new holder<std::remove_cvref_t<O>>(std::forward<O>(o)))) {}

  /// @brief The held optimizer's step().
  void step() { impl_->step(); }
  /// @brief The held optimizer's zero_grad(): forgets its parameters' gradients.
  void zero_grad() { impl_->zero_grad(); }
  /// @brief Sets the held optimizer's learning rate.
  void set_lr(double lr) { impl_->set_lr(lr); }
  /// @brief The held optimizer's learning rate.
  [[nodiscard]] double lr() const { return impl_->lr(); }
  /// @brief The parameters the held optimizer updates.
  [[nodiscard]] const std::vector<parameter_ref<T>>& parameters() const { return impl_->parameters(); }
  /// @brief The held optimizer's state, for checkpoints (none when it keeps no state_names()).
  [[nodiscard]] std::vector<std::string> state_names() const { return impl_->state_names(); }
  /// @brief The held optimizer's state `name` of parameter `i`; pdo::error if it has no state(name, i).
  [[nodiscard]] std::vector<tensor<T, 1>>& state(const std::string& name, std::size_t i) { return impl_->state(name, i); }
  /// @brief The held optimizer's step count (0 if it keeps none).
  [[nodiscard]] long steps() const { return impl_->steps(); }
  /// @brief Sets the held optimizer's step count (ignored if it keeps none).
  void set_steps(long t) { impl_->set_steps(t); }
  /// @brief Whether the held optimizer takes fused updates (fusable(), begin_fused_step(),
  /// fused_update(i), as sgd and adam do).
  [[nodiscard]] bool fusable() const { return impl_->fusable(); }
  /// @brief The held optimizer's begin_fused_step() (only when fusable()).
  void begin_fused_step() { impl_->begin_fused_step(); }
  /// @brief The held optimizer's fused_update(i) (only when fusable()).
  [[nodiscard]] element_update<T> fused_update(std::size_t i) { return impl_->fused_update(i); }
  /// @brief The held optimizer's linear_step() (sgd's), or none when it has none.
  [[nodiscard]] std::optional<linear_update<T>> linear_step() const { return impl_->linear_step(); }
  /// @brief The steps parameter `i` has taken, if the held optimizer counts them per
  /// parameter (adam); else its step count.
  [[nodiscard]] long steps(std::size_t i) const { return impl_->steps(i); }
  /// @brief Sets the steps parameter `i` has taken (ignored if the held optimizer keeps no
  /// count per parameter).
  void set_steps(std::size_t i, long t) { impl_->set_steps(i, t); }

 private:
  struct base {
    virtual ~base() = default;
    virtual void step() = 0;
    virtual void zero_grad() = 0;
    virtual void set_lr(double) = 0;
    [[nodiscard]] virtual double lr() const = 0;
    [[nodiscard]] virtual const std::vector<parameter_ref<T>>& parameters() const = 0;
    [[nodiscard]] virtual std::vector<std::string> state_names() const = 0;
    [[nodiscard]] virtual std::vector<tensor<T, 1>>& state(const std::string& name, std::size_t i) = 0;
    [[nodiscard]] virtual long steps() const = 0;
    virtual void set_steps(long t) = 0;
    [[nodiscard]] virtual long steps(std::size_t i) const = 0;
    virtual void set_steps(std::size_t i, long t) = 0;
    [[nodiscard]] virtual bool fusable() const = 0;
    virtual void begin_fused_step() = 0;
    [[nodiscard]] virtual element_update<T> fused_update(std::size_t i) = 0;
    [[nodiscard]] virtual std::optional<linear_update<T>> linear_step() const = 0;
  };
  template <class O>
  struct holder final : base {
    explicit holder(O x) : o(std::move(x)) {}
    O o;
    void step() override { o.step(); }
    void zero_grad() override { o.zero_grad(); }
    void set_lr(double lr) override { o.set_lr(lr); }
    [[nodiscard]] double lr() const override { return o.lr(); }
    [[nodiscard]] const std::vector<parameter_ref<T>>& parameters() const override { return o.parameters(); }
    [[nodiscard]] std::vector<std::string> state_names() const override {
      if constexpr (requires { o.state_names(); }) return o.state_names();
      else return {};
    }
    [[nodiscard]] std::vector<tensor<T, 1>>& state(const std::string& name, std::size_t i) override {
      if constexpr (requires { o.state(name, i); }) return o.state(name, i);
      else throw error("any_optimizer::state: the optimizer it holds keeps no state a checkpoint can save (no state(name, i)); asked for \"" + name + "\"");
    }
    [[nodiscard]] long steps() const override {
      if constexpr (requires { o.steps(); }) return o.steps();
      else return 0;
    }
    void set_steps(long t) override {
      if constexpr (requires { o.set_steps(t); }) o.set_steps(t);
    }
    [[nodiscard]] long steps(std::size_t i) const override {
      if constexpr (requires { o.steps(i); }) return o.steps(i);
      else return steps();
    }
    void set_steps(std::size_t i, long t) override {
      if constexpr (requires { o.set_steps(i, t); }) o.set_steps(i, t);
    }
    [[nodiscard]] bool fusable() const override {
      if constexpr (fused_optimizer<O, T>) return o.fusable();
      else return false;
    }
    void begin_fused_step() override {
      if constexpr (fused_optimizer<O, T>) o.begin_fused_step();
      else throw error("any_optimizer::begin_fused_step: the optimizer it holds takes no fused updates");
    }
    [[nodiscard]] element_update<T> fused_update(std::size_t i) override {
      if constexpr (fused_optimizer<O, T>) return o.fused_update(i);
      else throw error("any_optimizer::fused_update: the optimizer it holds takes no fused updates");
    }
    [[nodiscard]] std::optional<linear_update<T>> linear_step() const override {
      if constexpr (requires { o.linear_step(); }) return o.linear_step();
      else return std::nullopt;
    }
  };
  std::shared_ptr<base> impl_;
};

static_assert(optimizer<sgd<float>, float> && optimizer<adam<double>, double> && optimizer<any_optimizer<float>, float>);
static_assert(fused_optimizer<sgd<float>, float> && fused_optimizer<adam<double>, double> && fused_optimizer<any_optimizer<float>, float>);

/// @brief AdamW's usual settings: decoupled weight decay 0.01.
inline adam_options adamw_options(double lr = 1e-3, double weight_decay = 0.01) {
  adam_options o;
  o.lr = lr;
  o.weight_decay = weight_decay;
  o.decoupled_weight_decay = true;
  return o;
}

}  // namespace pdo::nn
