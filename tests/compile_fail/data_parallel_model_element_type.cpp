// A model of float layers trained as make_data_parallel<double>: one error that names the
// element types' mismatch, nothing of the layers' insides or of the trainer's uses after it.
// expect: pdo: make_data_parallel<T>: the model's parameters are not of element type T
// nvcc: also
#include <pdo/pdo.hpp>

int main() {
  auto make_mlp = [] {
    pdo::nn::rng gen(1);
    return pdo::nn::sequential(pdo::nn::linear<float>(8, 16, gen), pdo::nn::relu{}, pdo::nn::linear<float>(16, 4, gen));
  };
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  auto trainer =
      pdo::nn::make_data_parallel<double>(m, make_mlp, [](auto p) { return pdo::nn::sgd<double>(std::move(p), {.lr = 0.1}); });
  pdo::tensor<double, 2> x({4, 8});
  pdo::tensor<int, 1> y({4});
  return trainer.step(x, y) > 0 ? 1 : 0;
}
