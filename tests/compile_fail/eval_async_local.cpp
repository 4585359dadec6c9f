// compile_fail/eval_async_local.cpp: eval_async of an expression of local tensors only.
// expect: pdo: eval_async: the expression has no dtensor operand
#include <pdo/pdo.hpp>

int main() {
  const pdo::tensor<float, 2> h({2, 3});
  (void)pdo::eval_async(pdo::relu(h));
  return 0;
}
