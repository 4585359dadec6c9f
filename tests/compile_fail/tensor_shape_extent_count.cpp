// A shape with another number of extents than the tensor's rank: one error (fewer extents
// would otherwise make a tensor whose last dims are 0), nothing of its uses after it.
// expect: pdo: tensor<T, Rank>: the shape needs one extent per dim
// nvcc: also
#include <pdo/pdo.hpp>

int main() {
  pdo::tensor<float, 2> t({4});
  pdo::tensor<float, 2> u({4, 4});
  auto v = pdo::eval(t + u);
  return v(0, 0) == 0 ? 0 : 1;
}
