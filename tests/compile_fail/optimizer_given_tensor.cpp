// An optimizer given a plain tensor as a parameter: one error saying to make it a
// pdo::parameter, nothing of the training step after it.
// expect: pdo: an optimizer.s parameter is a var that backward gives a gradient to, not a plain tensor
#include <pdo/pdo.hpp>

int main() {
  const pdo::tensor<float, 2> w({3, 2});
  pdo::nn::sgd<float> opt({{"w", w}}, {.lr = 0.1});
  opt.zero_grad();
  opt.step();
  return 0;
}
