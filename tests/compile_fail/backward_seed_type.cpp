// A seed gradient of another rank than the value it seeds: one error naming what the seed
// must be.
// expect: pdo: backward.out, seed.: the seed is d.loss./d.out., a value of out.s gradient type
#include <pdo/pdo.hpp>

int main() {
  auto w = pdo::var(pdo::tensor<float, 2>({3, 2}), true);
  auto y = w * w;
  pdo::backward(y, pdo::tensor<float, 1>({3}));
  return w.grad()(0, 0) == 0 ? 0 : 1;
}
