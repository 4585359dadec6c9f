// compile_fail/parallel_do_mixes_mesh_types.cpp: a parallel_do over dtensors on meshes of two types
// (the first error is the mesh types', not a comparison of layouts over axes of different meshes).
// expect: pdo: parallel_do: all dtensor arguments must live on the same mesh type
#include <pdo/pdo.hpp>

int main() {
  const auto rows = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  const auto cols = pdo::make_mesh<"tp">(pdo::cpu_places(2));
  const pdo::tensor<float, 2> x_host({8, 4}), w_host({4, 6});
  const auto x = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(rows, x_host);
  const auto w = pdo::distribute<pdo::layout<pdo::replicate, pdo::split<"tp">>>(cols, w_host);
  const auto y = pdo::parallel_do<pdo::layout<pdo::split<"dp">, pdo::replicate>>(
      [](const auto& xs, const auto& ws) { return pdo::matmul(xs, ws); }, x, w);
  (void)y;
  return 0;
}
