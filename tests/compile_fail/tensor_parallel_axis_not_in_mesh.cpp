// tensor_parallel along an axis the mesh does not have: one error, nothing of the model's
// uses after it (training code that calls it, takes its parameters and runs backward).
// expect: pdo: tensor_parallel<Axis>: the mesh has no axis of that name
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  auto mlp = pdo::nn::sequential(pdo::nn::linear<float>(8, 16, gen), pdo::nn::relu{}, pdo::nn::linear<float>(16, 4, gen));
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  auto model = pdo::nn::tensor_parallel<"tp">(m, mlp);
  pdo::nn::sgd<float> opt(pdo::nn::parameters_of<float>(model), {.lr = 0.1});
  pdo::tensor<float, 2> x({4, 8});
  pdo::tensor<int, 1> y({4});
  const auto dx = pdo::var(pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(m, x));
  const auto dy = pdo::distribute<pdo::layout<pdo::split<"dp">>>(m, y);
  const auto loss = pdo::cross_entropy(model(dx), dy);
  pdo::backward(loss);
  opt.step();
  return 0;
}
