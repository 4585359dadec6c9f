// tensor_parallel over a model that holds a layer with parameters other than linear (a conv):
// one error, nothing of the model's conversion or of its uses after it.
// expect: pdo: tensor_parallel: the model may hold linear layers and layers without parameters
#include <pdo/pdo.hpp>

int main() {
  auto mesh = pdo::make_mesh<"dp", "tp">(pdo::cpu_places(4), {2, 2});
  pdo::nn::rng gen(5);
  using namespace pdo::nn;
  auto local = sequential(conv2d<float>(1, 2, 3, gen, {1, 1}), relu{}, flatten{}, linear<float>(32, 6, gen), relu{}, linear<float>(6, 3, gen));
  auto model = tensor_parallel<"tp">(mesh, local);
  pdo::tensor<float, 4> images({4, 1, 4, 4});
  const auto out = model(pdo::var(pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate, pdo::replicate, pdo::replicate>>(mesh, images)));
  return out.value().shape()[0] == 4 ? 0 : 1;
}
