// compile_fail/layout_rank_mismatch.cpp: a rank-1 layout for a rank-2 tensor.
// expect: pdo: layout has a different number of entries than the tensor has dims
// nvcc: also
#include <pdo/pdo.hpp>

int main() {
  const auto places = pdo::cpu_places(2);
  const auto mesh = pdo::make_mesh<"dp">(places);
  const pdo::tensor<float, 2> host({4, 4});
  const auto x = pdo::distribute<pdo::layout<pdo::split<"dp">>>(mesh, host);
  return static_cast<int>(x.shape()[0]) - 4;
}
