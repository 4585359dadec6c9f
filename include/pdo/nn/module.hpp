// pdo/nn/module.hpp: named parameters, seeded initialisation, and the module concept.
#pragma once

#include <pdo/autograd/variable.hpp>

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace pdo::nn {

/// @brief The random source of initialisation: the same seed gives the same parameters
/// on every place and every run.
using rng = std::mt19937_64;

/// @brief One named parameter of a model, whatever its rank: its values, its gradient,
/// and the hook backward calls when that gradient is complete. Copies refer to the same parameter.
template <class T>
class parameter_ref {
 public:
  template <std::size_t R>
  parameter_ref(std::string name, var<tensor<T, R>> v) : name_(std::move(name)), impl_(std::make_shared<holder<R>>(std::move(v))) {}

  [[nodiscard]] const std::string& name() const { return name_; }
  [[nodiscard]] std::span<T> value() const { return impl_->value(); }
  [[nodiscard]] std::size_t size() const { return impl_->value().size(); }
  [[nodiscard]] std::size_t bytes() const { return size() * sizeof(T); }
  /// @brief The gradient; empty when backward has given none.
  [[nodiscard]] std::span<T> grad() const { return impl_->grad(); }
  /// @brief A zero gradient, allocated if there is none (a place with no samples still takes part).
  [[nodiscard]] std::span<T> grad_or_zeros() const { return impl_->grad_or_zeros(); }
  void zero_grad() const { impl_->zero_grad(); }
  void on_gradient(std::function<void()> f) const { impl_->on_gradient(std::move(f)); }
  [[nodiscard]] std::string shape_text() const { return impl_->shape_text(); }

 private:
  struct base {
    virtual ~base() = default;
    virtual std::span<T> value() = 0;
    virtual std::span<T> grad() = 0;
    virtual std::span<T> grad_or_zeros() = 0;
    virtual void zero_grad() = 0;
    virtual void on_gradient(std::function<void()> f) = 0;
    virtual std::string shape_text() = 0;
  };
  template <std::size_t R>
  struct holder final : base {
    explicit holder(var<tensor<T, R>> x) : v(std::move(x)) {}
    var<tensor<T, R>> v;
    std::span<T> value() override { return v.value().span(); }
    std::span<T> grad() override { return v.has_grad() ? v.grad().span() : std::span<T>(); }
    std::span<T> grad_or_zeros() override {
      if (!v.has_grad()) v.node()->grad.emplace(v.shape());
      return v.grad().span();
    }
    void zero_grad() override { v.zero_grad(); }
    void on_gradient(std::function<void()> f) override { v.on_gradient(std::move(f)); }
    std::string shape_text() override { return describe(v.value()); }
  };
  std::string name_;
  std::shared_ptr<base> impl_;
};

/// @brief A layer or model: callable on a var, listing its parameters with names.
template <class M, class T>
concept module = requires(const M& m) {
  { m.parameters(std::string()) } -> std::same_as<std::vector<parameter_ref<T>>>;
};

namespace init {

/// @brief A tensor of `shape` drawn uniformly from [-bound, bound).
template <class T, std::size_t R>
tensor<T, R> uniform(const shape_t<R>& shape, T bound, rng& gen) {
  tensor<T, R> t(shape, detail::uninitialized);
  std::uniform_real_distribution<double> dist(-static_cast<double>(bound), static_cast<double>(bound));
  for (auto& x : t) x = static_cast<T>(dist(gen));
  return t;
}

/// @brief PyTorch's default for linear and conv layers: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
template <class T, std::size_t R>
tensor<T, R> fan_in_uniform(const shape_t<R>& shape, std::size_t fan_in, rng& gen) {
  return uniform<T>(shape, static_cast<T>(1.0 / std::sqrt(static_cast<double>(fan_in == 0 ? 1 : fan_in))), gen);
}

}  // namespace init

}  // namespace pdo::nn
