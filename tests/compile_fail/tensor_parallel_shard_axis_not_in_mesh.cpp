// tensor_parallel_shard (the SPMD form, one place's part) along an axis the mesh does not
// have: one error, nothing of the shard's uses after it (a training step on local tensors).
// expect: pdo: tensor_parallel_shard<Axis>: the mesh has no axis of that name
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  auto mlp = pdo::nn::sequential(pdo::nn::linear<float>(8, 16, gen), pdo::nn::relu{}, pdo::nn::linear<float>(16, 4, gen));
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  auto part = pdo::nn::tensor_parallel_shard<"tp">(m, 0, mlp);
  pdo::nn::sgd<float> opt(pdo::nn::parameters_of<float>(part), {.lr = 0.1});
  pdo::tensor<float, 2> x({4, 8});
  pdo::tensor<int, 1> y({4});
  const auto loss = pdo::cross_entropy(part(pdo::var(x)), y);
  pdo::backward(loss);
  opt.step();
  return 0;
}
