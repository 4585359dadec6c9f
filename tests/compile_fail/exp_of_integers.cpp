// exp (and log, sqrt, tanh, sigmoid, gelu) of an integer tensor, whose result would be cut to
// integers: one error, in an expression and on a var, nothing of backward after it.
// expect: pdo: exp, log, sqrt, tanh, sigmoid and gelu need floating-point operands
#include <pdo/pdo.hpp>

int main() {
  const auto v = pdo::parameter(pdo::tensor<int, 1>({4}));
  pdo::backward(pdo::sum(pdo::sigmoid(v)));
  return 0;
}
