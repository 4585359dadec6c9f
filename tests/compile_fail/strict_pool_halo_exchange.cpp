// Under pdo::strict, max pooling over an input split along its width needs the halo columns
// of the neighbouring place (windows that straddle the cut): communication, which strict does
// not insert implicitly.
// expect: pdo: strict: a window op over an input whose height or width is split exchanges halo rows
#include <pdo/pdo.hpp>

int main() {
  const auto m = pdo::make_mesh<"sp">(pdo::cpu_places(2));
  using R = pdo::replicate;
  auto x = pdo::var(pdo::distribute<pdo::layout<R, R, R, pdo::split<"sp">>>(m, pdo::tensor<float, 4>({1, 1, 6, 6})));
  const auto y = pdo::max_pool2d<pdo::strict>(x, 3, {1, 1});  // one error: none for y or its use after it
  return y.value().shape()[3] == 6 ? 0 : 1;
}
