// tests/model_support.hpp: the models the model-parallel and MPI training tests train, and their one-place losses.
#pragma once

#include "support.hpp"

#include <pdo/nn.hpp>

#include <cstddef>
#include <utility>
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

/// @brief The same MLP with layer norms outside its pairs, where Megatron places them: before
/// the first pair and between the two (the features whole on every place).
inline auto make_normed_mlp() {
  pdo::nn::rng gen(21);
  namespace nn = pdo::nn;
  return nn::sequential(nn::layer_norm{}, nn::linear<double>(6, 10, gen), nn::gelu{}, nn::linear<double>(10, 5, gen), nn::tanh{},
                        nn::layer_norm{1e-3}, nn::linear<double>(5, 7, gen), nn::relu{}, nn::linear<double>(7, 4, gen));
}

/// @brief make_mlp as a function object, for a template's default argument (nvcc takes no
/// lambda there).
struct mlp_maker {
  auto operator()() const { return make_mlp(); }
};

inline pdo::tensor<int, 1> labels_for(std::size_t n) {
  pdo::tensor<int, 1> y({n});
  for (std::size_t i = 0; i < n; ++i) y(i) = static_cast<int>((i * 7 + 1) % 4);
  return y;
}

/// @brief Losses of `steps` SGD steps of the local model make_model() gives on (x, y).
template <class MakeModel>
std::vector<double> local_losses(MakeModel make_model, const pdo::tensor<double, 2>& x, const pdo::tensor<int, 1>& y, int steps) {
  auto model = make_model();
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

/// @brief Losses of `steps` SGD steps of make_mlp()'s model on (x, y).
inline std::vector<double> local_losses(const pdo::tensor<double, 2>& x, const pdo::tensor<int, 1>& y, int steps) {
  return local_losses(mlp_maker{}, x, y, steps);
}

/// @brief The tensors of a small CNN's training: images x [n, 2, h, w], targets [n, 3, h/2, w/2],
/// conv weights w1 [4, 2, 3, 3], w2 [3, 4, 5, 5] and their biases; random from `seed` on.
struct cnn_problem {
  pdo::tensor<double, 4> x, target, w1;
  pdo::tensor<double, 1> b1;
  pdo::tensor<double, 4> w2;
  pdo::tensor<double, 1> b2;

  cnn_problem(std::size_t n, std::size_t h, std::size_t w, unsigned seed)
      : x(random_tensor<double>(pdo::shape_t<4>{n, 2, h, w}, seed)),
        target(random_tensor<double>(pdo::shape_t<4>{n, 3, h / 2, w / 2}, seed + 1)),
        w1(random_tensor<double>(pdo::shape_t<4>{4, 2, 3, 3}, seed + 2, -0.5)),
        b1(random_tensor<double>(pdo::shape_t<1>{4}, seed + 3)),
        w2(random_tensor<double>(pdo::shape_t<4>{3, 4, 5, 5}, seed + 4, -0.5)),
        b2(random_tensor<double>(pdo::shape_t<1>{3}, seed + 5)) {}
};

/// @brief `steps` steps of SGD (momentum 0.9) on conv 3x3 -> relu -> max pool 2 -> conv 5x5
/// (padding 2) -> squared error, with the images and targets laid out by `distribute_x` and the
/// parameters by `distribute_p` (identities for one place): each step's loss and the last
/// conv's weight after the steps, on the host.
template <class DistributeX, class DistributeP>
std::pair<std::vector<double>, pdo::tensor<double, 4>> train_cnn(const cnn_problem& d, DistributeX distribute_x,
                                                                 DistributeP distribute_p, double lr, int steps) {
  const auto on_host = [](const auto& v) {
    if constexpr (requires { pdo::gather(v); }) return pdo::gather(v);
    else return v;
  };
  auto W1 = pdo::parameter(distribute_p(d.w1)), W2 = pdo::parameter(distribute_p(d.w2));
  auto B1 = pdo::parameter(distribute_p(d.b1)), B2 = pdo::parameter(distribute_p(d.b2));
  pdo::nn::sgd<double> opt({{"w1", W1}, {"b1", B1}, {"w2", W2}, {"b2", B2}}, {.lr = lr, .momentum = 0.9});
  const auto in = pdo::var(distribute_x(d.x));
  const auto t = pdo::var(distribute_x(d.target));
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    const auto h = pdo::max_pool2d(pdo::relu(pdo::conv2d(in, W1, B1, {1, 1})), 2);
    const auto e = pdo::conv2d(h, W2, B2, {1, 2}) - t;
    const auto loss = pdo::sum(e * e);
    pdo::backward(loss);
    opt.step();
    losses.push_back(on_host(loss.value()).data()[0]);
  }
  return {losses, on_host(W2.value())};
}

}  // namespace pdo_test
