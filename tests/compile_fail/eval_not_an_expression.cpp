// compile_fail/eval_not_an_expression.cpp: eval of a pdo::var (computed at once; its value is var.value()),
// its result used as the tensor the call meant: one error, at the eval.
// expect: pdo: eval takes a pdo::tensor, a pdo::dtensor or an expression of them
#include <pdo/pdo.hpp>

int main() {
  pdo::tensor<float, 2> a({2, 2});
  const pdo::var<pdo::tensor<float, 2>> v(a, true);
  const pdo::tensor<float, 2> t = pdo::eval(v * v);
  return static_cast<int>(t.size());
}
