// compile_fail/backward_needs_var.cpp: backward of a loss computed from plain tensors.
// expect: pdo: backward takes a pdo::var
// nvcc: also
#include <pdo/pdo.hpp>

int main() {
  const pdo::tensor<double, 2> h({2, 3}, {1, 2, 3, 4, 5, 6});
  const auto loss = pdo::eval(pdo::sum(pdo::tanh(h)));
  pdo::backward(loss);
  return 0;
}
