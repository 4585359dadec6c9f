// A model of float layers cut into a make_pipeline<double>: one error that names the element
// types' mismatch, nothing of the stages' insides or of the pipeline's uses after it.
// expect: pdo: make_pipeline<T>: the model's parameters are not of element type T
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  auto model = pdo::nn::sequential(pdo::nn::linear<float>(5, 4, gen), pdo::nn::relu{}, pdo::nn::linear<float>(4, 2, gen));
  auto trainer = pdo::nn::make_pipeline<double, 2, 2>(pdo::make_mesh<"pp">(pdo::cpu_places(2)), model,
                                                      [](auto p) { return pdo::nn::sgd<double>(std::move(p), {.lr = 0.1}); });
  pdo::tensor<double, 2> x({4, 5});
  pdo::tensor<int, 1> y({4});
  return trainer.step(x, y) > 0 ? 1 : 0;
}
