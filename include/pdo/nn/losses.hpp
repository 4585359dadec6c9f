// pdo/nn/losses.hpp: the losses a trainer takes (a callable of the model's output and the targets).
#pragma once

#include <pdo/autograd.hpp>

#include <cstddef>
#include <type_traits>

namespace pdo::nn {

/// @brief Cross-entropy of logits [N, C] against class indices [N]: the default loss.
struct cross_entropy_loss {
  /// @brief pdo::cross_entropy(logits, labels): the mean over the N rows of -log softmax(logits)[label].
  template <class V, class Y>
  auto operator()(const var<V>& logits, const Y& labels) const {
    return pdo::cross_entropy(logits, labels);
  }
};

/// @brief Mean squared error against targets of the output's shape.
struct mse_loss {
  /// @brief mean((out - target)²) over every element; `target` is a constant (no gradient).
  /// Targets of another shape are a pdo::shape_error (pdo::mse would broadcast them: a target
  /// column [N, 1] against outputs [N, C] is a mistake a trainer should not take silently).
  template <class V>
  auto operator()(const var<V>& out, const V& target) const {
    if (out.value().shape() != target.shape())
      throw shape_error("nn::mse_loss: the output is " + pdo::detail::format_extents(out.value().shape()) + " and the targets " +
                        pdo::detail::format_extents(target.shape()) + ": give targets of the output's shape");
    return pdo::mse(out, var<V>(target));
  }
};

namespace detail_nn {

/// @brief Whether a trainer's `Loss` takes what `Model` gives for inputs tensor<T, R>, with
/// targets `Target` (true where the model does not take such inputs: that is the model's error).
template <class Loss, class Model, class T, std::size_t R, class Target>
consteval bool loss_takes_output() {
  if constexpr (!std::is_invocable_v<Model&, var<tensor<T, R>>>) return true;
  else return std::is_invocable_v<Loss&, const std::invoke_result_t<Model&, var<tensor<T, R>>>&, const Target&>;
}
template <class Loss, class Model, class T, std::size_t R, class Target>
inline constexpr bool loss_takes = loss_takes_output<Loss, Model, T, R, Target>();

}  // namespace detail_nn

}  // namespace pdo::nn
