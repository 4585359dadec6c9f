// compile_fail/tensor_index_count.cpp: one index for an element of a rank-2 tensor.
// expect: pdo: tensor\(i, j, ...\): give one index per dim of the tensor
#include <pdo/pdo.hpp>

int main() {
  const pdo::tensor<float, 2> h({4, 4});
  return static_cast<int>(h(1));
}
