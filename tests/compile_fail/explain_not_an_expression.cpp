// explain of a dtensor itself, not of an op applied to it: one error, and none for the text's use.
// expect: pdo: explain: pass an expression
#include <pdo/pdo.hpp>

int main() {
  const auto m = pdo::make_mesh<"x">(pdo::cpu_places(2));
  const auto a = pdo::distribute<pdo::layout<pdo::split<"x">, pdo::replicate>>(m, pdo::tensor<float, 2>({4, 4}));
  return pdo::explain(a).empty() ? 1 : 0;
}
