// A model given to make_data_parallel where it takes a callable that builds one (it builds a
// replica on every place): one error, nothing of the trainer's uses after it.
// expect: pdo: make_data_parallel: make_model must be a callable that builds a replica
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  auto mlp = pdo::nn::sequential(pdo::nn::linear<float>(8, 16, gen), pdo::nn::relu{}, pdo::nn::linear<float>(16, 4, gen));
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  auto trainer = pdo::nn::make_data_parallel<float>(m, mlp, [](auto p) { return pdo::nn::sgd<float>(std::move(p), {.lr = 0.1}); });
  pdo::tensor<float, 2> x({4, 8});
  pdo::tensor<int, 1> y({4});
  return trainer.step(x, y) > 0 ? 1 : 0;
}
