// pdo/nn/losses.hpp: the losses a trainer takes (a callable of the model's output and the targets).
#pragma once

#include <pdo/autograd.hpp>

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

}  // namespace pdo::nn
