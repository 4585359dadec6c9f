// One layout entry given where a layout is asked for: pdo::split<"dp"> for
// pdo::layout<pdo::split<"dp">>. One error, and none for the result's uses.
// expect: pdo: distribute: give a layout, pdo::layout<...> with one entry per tensor dim
#include <pdo/pdo.hpp>

int main() {
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  const auto x = pdo::distribute<pdo::split<"dp">>(m, pdo::tensor<float, 1>({4}));
  return pdo::gather(pdo::eval(x * 2.0f))(0) > 0 ? 0 : 1;
}
