// compile_fail/layout_axis_used_twice.cpp: a layout that splits two dims over one mesh axis.
// expect: pdo: layout uses one mesh axis twice. a mesh axis may split one tensor dim or mark one partial sum
#include <pdo/pdo.hpp>

int main() {
  const auto places = pdo::cpu_places(2);
  const auto mesh = pdo::make_mesh<"dp">(places);
  const pdo::tensor<float, 2> host({4, 4});
  const auto x = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::split<"dp">>>(mesh, host);
  return static_cast<int>(x.shape()[0]) - 4;
}
