// compile_fail/eval_not_an_expression.cpp: eval of a number.
// expect: pdo: eval takes a pdo::tensor, a pdo::dtensor or an expression of them
#include <pdo/pdo.hpp>

int main() {
  const auto c = pdo::eval(3);
  return c;
}
