// The layer itself given to an optimizer, not its parameters: one error that says what to
// give, nothing of the training step after it.
// expect: pdo: sgd: give the optimizer the layer.s parameters
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  pdo::nn::linear<float> layer(3, 2, gen);
  pdo::nn::sgd<float> opt(layer, {.lr = 0.1});
  pdo::backward(pdo::sum(layer(pdo::var(pdo::tensor<float, 2>({4, 3})))));
  opt.step();
  return 0;
}
