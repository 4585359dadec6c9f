// Under pdo::strict, a conv2d over an input split along its height needs a halo exchange with
// the neighbouring places: communication, which strict does not insert implicitly.
// expect: strict: a window op over an input whose height or width is split exchanges halo rows
#include <pdo/pdo.hpp>

int main() {
  const auto m = pdo::make_mesh<"sp">(pdo::cpu_places(2));
  using R = pdo::replicate;
  auto x = pdo::var(pdo::distribute<pdo::layout<R, R, pdo::split<"sp">, R>>(m, pdo::tensor<float, 4>({1, 1, 8, 8})));
  auto w = pdo::parameter(pdo::distribute<pdo::layout<R, R, R, R>>(m, pdo::tensor<float, 4>({1, 1, 3, 3})));
  auto b = pdo::parameter(pdo::distribute<pdo::layout<R>>(m, pdo::tensor<float, 1>({1})));
  const auto y = pdo::conv2d<pdo::strict>(x, w, b, {1, 1});  // one error: none for y or its use after it
  return y.value().shape()[0] == 1 ? 0 : 1;
}
