// A conv2d whose weight is split along its kernel's height: not a layout conv2d takes (the
// input's height may be split, with halo exchange; the kernel never is).
// expect: conv2d: these layouts of the input, weight and bias are not supported
// nvcc: also
#include <pdo/pdo.hpp>

int main() {
  const auto m = pdo::make_mesh<"sp">(pdo::cpu_places(2));
  using R = pdo::replicate;
  auto x = pdo::var(pdo::distribute<pdo::layout<R, R, pdo::split<"sp">, R>>(m, pdo::tensor<float, 4>({1, 1, 4, 4})));
  auto w = pdo::parameter(pdo::distribute<pdo::layout<R, R, pdo::split<"sp">, R>>(m, pdo::tensor<float, 4>({1, 1, 3, 3})));
  auto b = pdo::parameter(pdo::distribute<pdo::layout<R>>(m, pdo::tensor<float, 1>({1})));
  const auto y = pdo::conv2d(x, w, b);  // one error (with g++ and clang++): none for y or its use after it
  return y.value().shape()[0] == 1 ? 0 : 1;
}
