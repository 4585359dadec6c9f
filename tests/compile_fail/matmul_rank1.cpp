// compile_fail/matmul_rank1.cpp: matmul of a batch of matrices by a vector.
// expect: pdo: matmul: both operands need at least 2 dims
#include <pdo/pdo.hpp>

int main() {
  const pdo::tensor<float, 3> a({2, 3, 4});
  const pdo::tensor<float, 1> b({4});
  const auto c = pdo::eval(pdo::matmul(a, b));
  return static_cast<int>(c.size()) - 6;
}
