// compile_fail/redistribute_rank_mismatch.cpp: redistribute a rank-2 dtensor to a rank-1 layout.
// expect: pdo: layout has a different number of entries than the tensor has dims
#include <pdo/pdo.hpp>

int main() {
  const auto mesh = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  const pdo::tensor<float, 2> host({4, 4});
  const auto x = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(mesh, host);
  const auto y = pdo::redistribute<pdo::layout<pdo::replicate>>(x);
  return static_cast<int>(y.shape()[0]) - 4;
}
