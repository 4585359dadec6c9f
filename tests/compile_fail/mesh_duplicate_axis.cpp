// compile_fail/mesh_duplicate_axis.cpp: a mesh type with two axes of the same name.
// expect: pdo: mesh: two axes have the same name. give every mesh axis its own name
#include <pdo/pdo.hpp>

int main() {
  const auto places = pdo::cpu_places(4);
  const pdo::mesh<"dp", "dp"> mesh = pdo::make_mesh<"dp", "dp">(places, {2, 2});
  return static_cast<int>(mesh.size()) - 4;
}
