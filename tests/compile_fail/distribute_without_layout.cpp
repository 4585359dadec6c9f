// distribute without its layout, as if it took the one of its tensor: one error saying that the
// layout is a template argument, and none for the result's uses.
// expect: pdo: distribute: give the layout as a template argument, one entry per tensor dim
#include <pdo/pdo.hpp>

int main() {
  const auto mesh = pdo::make_mesh<"x">(pdo::cpu_places(2));
  const pdo::tensor<float, 2> h({4, 3});
  const auto a = pdo::distribute(mesh, h);
  return pdo::gather(a).size() == 12 ? 0 : 1;
}
