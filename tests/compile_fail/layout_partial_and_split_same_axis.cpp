// compile_fail/layout_partial_and_split_same_axis.cpp: a partial sum over the axis that also splits a dim.
// expect: pdo: layout uses one mesh axis twice. a mesh axis may split one tensor dim or mark one partial sum
#include <pdo/pdo.hpp>

int main() {
  const auto places = pdo::cpu_places(2);
  const auto mesh = pdo::make_mesh<"dp">(places);
  const pdo::tensor<float, 2> host({4, 4});
  using bad = pdo::layout<pdo::split<"dp">, pdo::replicate>::partial<"dp">;
  const auto x = pdo::distribute<bad>(mesh, host);
  return static_cast<int>(x.shape()[0]) - 4;
}
