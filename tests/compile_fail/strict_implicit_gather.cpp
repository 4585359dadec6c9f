// compile_fail/strict_implicit_gather.cpp: under pdo::strict, softmax along a split dim (an implicit all_gather).
// expect: pdo: strict: this op needs an operand in another layout, which takes communication
#include <pdo/pdo.hpp>

int main() {
  const auto mesh = pdo::make_mesh<"tp">(pdo::cpu_places(2));
  const pdo::tensor<float, 2> x({4, 6});
  const auto xs = pdo::distribute<pdo::layout<pdo::replicate, pdo::split<"tp">>>(mesh, x);
  const auto y = pdo::eval<pdo::strict>(pdo::softmax(xs));
  return static_cast<int>(y.shape()[0]) - 4;
}
