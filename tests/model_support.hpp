// tests/model_support.hpp: the model the model-parallel tests train, and its one-place losses.
#pragma once

#include "support.hpp"

#include <pdo/nn.hpp>

#include <vector>

namespace pdo_test {

/// @brief An MLP of two Megatron pairs, in double.
inline auto make_mlp() {
  pdo::nn::rng gen(21);
  namespace nn = pdo::nn;
  // two Megatron pairs; hidden widths 10 and 7 do not divide by 3 or 4: uneven shards
  return nn::sequential(nn::linear<double>(6, 10, gen), nn::gelu{}, nn::linear<double>(10, 5, gen), nn::tanh{},
                        nn::linear<double>(5, 7, gen), nn::relu{}, nn::linear<double>(7, 4, gen));
}

inline pdo::tensor<int, 1> labels_for(std::size_t n) {
  pdo::tensor<int, 1> y({n});
  for (std::size_t i = 0; i < n; ++i) y(i) = static_cast<int>((i * 7 + 1) % 4);
  return y;
}

/// @brief Losses of `steps` SGD steps of the local model on (x, y).
inline std::vector<double> local_losses(const pdo::tensor<double, 2>& x, const pdo::tensor<int, 1>& y, int steps) {
  auto model = make_mlp();
  pdo::nn::sgd<double> opt(pdo::nn::parameters_of<double>(model), {.lr = 0.2, .momentum = 0.5});
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    const auto loss = pdo::cross_entropy(model(pdo::var(x)), y);
    pdo::backward(loss);
    opt.step();
    losses.push_back(loss.value().data()[0]);
  }
  return losses;
}

}  // namespace pdo_test
