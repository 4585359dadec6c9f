// A model called on a plain tensor, where it takes a pdo::var: one error saying how to make
// one, nothing of backward after it.
// expect: pdo: a layer or model takes its input as a pdo::var: layer\(pdo::var\(x\)\)
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  auto model = pdo::nn::sequential(pdo::nn::linear<float>(4, 8, gen), pdo::nn::relu{}, pdo::nn::linear<float>(8, 3, gen));
  const pdo::tensor<float, 2> x({2, 4});
  pdo::backward(pdo::sum(model(x)));
  return 0;
}
