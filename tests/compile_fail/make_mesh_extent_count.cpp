// compile_fail/make_mesh_extent_count.cpp: make_mesh with one extent for a two-axis mesh.
// expect: pdo: make_mesh: give exactly one extent per mesh axis
#include <pdo/pdo.hpp>

int main() {
  const auto places = pdo::cpu_places(4);
  const auto mesh = pdo::make_mesh<"dp", "tp">(places, {4});
  return static_cast<int>(mesh.size()) - 4;
}
