// compile_fail/strict_implicit_max.cpp: under pdo::strict, max over a split dim (an implicit all_reduce(max)).
// expect: pdo: strict: max over a split dim needs an all_reduce\(max\) across the places
#include <pdo/pdo.hpp>

int main() {
  const auto mesh = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  const pdo::tensor<float, 2> x({4, 6});
  const auto xs = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(mesh, x);
  const auto y = pdo::eval<pdo::strict>(pdo::max<0>(xs));
  return static_cast<int>(y.shape()[0]) - 6;
}
