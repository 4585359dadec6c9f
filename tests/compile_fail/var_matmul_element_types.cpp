// A product of vars of different element types (a double input through a float layer): one
// error, and nothing of the product's backward, the layer's bias or the loss after it.
// expect: pdo: matmul: the operands have different element types
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  pdo::nn::linear<float> layer(4, 2, gen);
  auto x = pdo::var(pdo::tensor<double, 2>({3, 4}));
  auto y = layer(x);
  pdo::backward(pdo::mean(pdo::relu(y)));
  return y.value()(0, 0) > 0 ? 0 : 1;
}
