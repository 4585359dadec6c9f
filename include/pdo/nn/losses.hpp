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
  template <class V>
  auto operator()(const var<V>& out, const V& target) const {
    return pdo::mse(out, var<V>(target));
  }
};

}  // namespace pdo::nn
