// compile_fail/expr_mixes_tensor_and_dtensor.cpp: a local tensor and a dtensor in one expression.
// expect: pdo: an expression mixes pdo::tensor and pdo::dtensor operands
#include <pdo/pdo.hpp>

int main() {
  const auto mesh = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  const pdo::tensor<float, 2> x({4, 6});
  const auto xs = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(mesh, x);
  const auto y = pdo::eval(xs + x);
  return static_cast<int>(y.shape()[0]) - 4;
}
