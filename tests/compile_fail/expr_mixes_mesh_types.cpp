// compile_fail/expr_mixes_mesh_types.cpp: a sum of dtensors on meshes of two types, evaluated.
// expect: pdo: an expression mixes dtensors of different mesh types
// nvcc: also
#include <pdo/pdo.hpp>

int main() {
  const auto rows = pdo::make_mesh<"x">(pdo::cpu_places(2));
  const auto cols = pdo::make_mesh<"y">(pdo::cpu_places(2));
  const pdo::tensor<float, 2> host({7, 5});
  const auto a = pdo::distribute<pdo::layout<pdo::split<"x">, pdo::replicate>>(rows, host);
  const auto b = pdo::distribute<pdo::layout<pdo::split<"y">, pdo::replicate>>(cols, host);
  const auto sum = pdo::eval(a + b);
  (void)sum;
  return 0;
}
