// compile_fail/unsqueeze_past_rank.cpp: unsqueeze of a var at a dim past its rank.
// expect: pdo: unsqueeze: the dim to insert is out of range: 0 to the operand.s rank, or -1
#include <pdo/pdo.hpp>

int main() {
  const pdo::tensor<double, 2> h({2, 3});
  const auto x = pdo::parameter(h);
  (void)pdo::unsqueeze<3>(x);
  return 0;
}
