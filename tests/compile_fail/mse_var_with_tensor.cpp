// compile_fail/mse_var_with_tensor.cpp: mse of a model's output (a var) against a plain
// tensor of targets: one error that says to make the targets a var, nothing of backward.
// expect: pdo: an op on a pdo::var was given a plain tensor or expression as its other operand
// nvcc: also
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  pdo::nn::linear<float> layer(3, 2, gen);
  const pdo::tensor<float, 2> x({4, 3}), target({4, 2});
  const auto loss = pdo::mse(layer(pdo::var(x)), target);
  pdo::backward(loss);
  return 0;
}
