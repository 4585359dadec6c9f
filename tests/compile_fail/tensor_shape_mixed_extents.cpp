// A shape of extents of mixed integer types (a size_t and a literal) with fewer extents than
// the tensor's rank: one error (it would otherwise be a tensor whose last dim is 0).
// expect: pdo: tensor<T, Rank>: the shape needs one extent per dim
#include <pdo/pdo.hpp>

#include <cstddef>

int main() {
  const std::size_t rows = 4;
  pdo::tensor<float, 3> t({rows, 8});
  return t.size() == 0 ? 0 : 1;
}
