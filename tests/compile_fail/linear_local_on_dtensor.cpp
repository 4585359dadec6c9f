// compile_fail/linear_local_on_dtensor.cpp: a model of local parameters called on a var of a
// distributed batch: one error at its first layer that says how to train it over a mesh,
// nothing of the later layers, the loss or backward.
// expect: pdo: nn::linear: a layer whose parameters are local tensors was called on a dtensor
#include <pdo/pdo.hpp>

int main() {
  const auto mesh = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  pdo::nn::rng gen(1);
  auto model = pdo::nn::sequential(pdo::nn::linear<float>(4, 8, gen), pdo::nn::relu{}, pdo::nn::linear<float>(8, 2, gen));
  const auto x = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(mesh, pdo::tensor<float, 2>({6, 4}));
  const auto y = pdo::distribute<pdo::layout<pdo::split<"dp">>>(mesh, pdo::tensor<int, 1>({6}));
  pdo::backward(pdo::cross_entropy(model(pdo::var(x)), y));
  return 0;
}
