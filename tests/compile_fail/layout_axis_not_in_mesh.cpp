// compile_fail/layout_axis_not_in_mesh.cpp: a layout that splits over an axis the mesh lacks.
// expect: pdo: layout splits or sums over a mesh axis that the mesh does not have
// nvcc: also
#include <pdo/pdo.hpp>

int main() {
  const auto places = pdo::cpu_places(2);
  const auto mesh = pdo::make_mesh<"dp">(places);
  const pdo::tensor<float, 2> host({4, 4});
  const auto x = pdo::distribute<pdo::layout<pdo::split<"tp">, pdo::replicate>>(mesh, host);
  return static_cast<int>(x.shape()[0]) - 4;
}
