// A layer without parameters (every layer shares the rejection) called on a plain tensor,
// where it takes a pdo::var: one error saying how to make one, nothing of backward after it.
// expect: pdo: a layer or model takes its input as a pdo::var: layer\(pdo::var\(x\)\)
#include <pdo/pdo.hpp>

int main() {
  const pdo::tensor<float, 2> x({2, 4});
  pdo::backward(pdo::sum(pdo::nn::relu{}(x)));
  return 0;
}
