// compile_fail/redistribute_to_bad_layout.cpp: redistribute to a layout naming an axis the mesh lacks.
// expect: pdo: layout splits or sums over a mesh axis that the mesh does not have
#include <pdo/pdo.hpp>

int main() {
  const auto places = pdo::cpu_places(2);
  const auto mesh = pdo::make_mesh<"dp">(places);
  const pdo::tensor<float, 2> host({4, 4});
  const auto x = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(mesh, host);
  const auto y = pdo::redistribute<pdo::layout<pdo::replicate, pdo::split<"tp">>>(x);
  return static_cast<int>(y.shape()[0]) - 4;
}
