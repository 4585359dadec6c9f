// A mesh of two axes made without their extents: one error that shows how to give them.
// expect: pdo: make_mesh: a mesh of several axes needs their extents, one per axis
#include <pdo/pdo.hpp>

int main() {
  const auto mesh = pdo::make_mesh<"dp", "tp">(pdo::cpu_places(4));
  return mesh.places().size() == 4 ? 0 : 1;
}
