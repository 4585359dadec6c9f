// distribute given the places where it takes a mesh of them: one error saying to make the mesh
// first, and none for the result's uses.
// expect: pdo: distribute: its first argument is a mesh, not places: lay the places out first
#include <pdo/pdo.hpp>

int main() {
  const auto places = pdo::cpu_places(2);
  const auto a = pdo::distribute<pdo::layout<pdo::split<"x">, pdo::replicate>>(places, pdo::tensor<float, 2>({4, 3}));
  return pdo::gather(a).size() == 12 ? 0 : 1;
}
