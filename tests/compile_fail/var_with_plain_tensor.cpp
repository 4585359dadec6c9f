// A plain tensor (the input data) as an operand of an op on a var (a parameter): one
// error that says to make it a var, nothing of the loss or backward after it.
// expect: pdo: an op on a pdo::var was given a plain tensor or expression as its other operand
#include <pdo/pdo.hpp>

int main() {
  const pdo::tensor<float, 2> x({4, 3});
  auto w = pdo::var(pdo::tensor<float, 2>({3, 2}), true);
  auto y = pdo::matmul(x, w);
  pdo::backward(pdo::mean(pdo::relu(y)));
  return w.grad()(0, 0) == 0 ? 0 : 1;
}
