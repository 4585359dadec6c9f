// distribute given an expression of local tensors, which it does not evaluate: one error saying
// to evaluate it first, and none for the result's uses.
// expect: pdo: distribute: takes a pdo::tensor, not an expression: evaluate it first
#include <pdo/pdo.hpp>

int main() {
  const auto mesh = pdo::make_mesh<"x">(pdo::cpu_places(2));
  const pdo::tensor<float, 2> h({4, 3});
  const auto a = pdo::distribute<pdo::layout<pdo::split<"x">, pdo::replicate>>(mesh, h * 2.0f);
  return pdo::gather(a).size() == 12 ? 0 : 1;
}
