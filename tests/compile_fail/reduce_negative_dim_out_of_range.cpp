// compile_fail/reduce_negative_dim_out_of_range.cpp: a negative dim past the first (-3 of a
// rank-2 var): one error naming the dims a reduction takes, nothing of backward after it.
// expect: pdo: sum/mean/max: the dim to reduce is out of range for the operand.s rank: 0 to rank - 1, or -1 \(the last\) back to -rank
#include <pdo/pdo.hpp>

int main() {
  const auto v = pdo::parameter(pdo::tensor<double, 2>({2, 3}));
  pdo::backward(pdo::sum(pdo::mean<-3>(v)));
  return 0;
}
