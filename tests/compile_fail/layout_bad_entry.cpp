// compile_fail/layout_bad_entry.cpp: a layout entry that is neither split nor replicate.
// expect: pdo: layout: each entry must be pdo::split<.?.axis.?.> or pdo::replicate
#include <pdo/pdo.hpp>

int main() {
  const auto places = pdo::cpu_places(2);
  const auto mesh = pdo::make_mesh<"dp">(places);
  const pdo::tensor<float, 2> host({4, 4});
  const auto x = pdo::distribute<pdo::layout<int, pdo::replicate>>(mesh, host);
  return static_cast<int>(x.shape()[0]) - 4;
}
