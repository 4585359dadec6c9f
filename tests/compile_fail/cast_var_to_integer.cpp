// A var cast to integers, which have no gradient: one error saying to cast its value,
// nothing of backward after it.
// expect: pdo: cast of a var: converts between floating-point types
#include <pdo/pdo.hpp>

int main() {
  const auto v = pdo::parameter(pdo::tensor<float, 2>({2, 3}));
  pdo::backward(pdo::sum(pdo::cast<int>(v)));
  return 0;
}
