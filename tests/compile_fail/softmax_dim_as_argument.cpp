// compile_fail/softmax_dim_as_argument.cpp: the dim given as an argument, as PyTorch takes it,
// on a var: one error that says dims are template arguments, nothing of backward after it.
// expect: pdo: sum, mean, max, softmax and log_softmax take the dim as a template argument
// nvcc: also
#include <pdo/pdo.hpp>

int main() {
  const auto v = pdo::parameter(pdo::tensor<float, 2>({2, 3}));
  pdo::backward(pdo::mean(pdo::softmax(v, -1)));
  return 0;
}
