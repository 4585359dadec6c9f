// A pipeline made for inputs of rank 4 (images) given a batch of rank 2, of another element
// type: one error at the step, that says what the inputs must be.
// expect: pdo: pipeline::step: the inputs must be a host pdo::tensor<T, InRank>
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  auto model = pdo::nn::sequential(pdo::nn::linear<float>(5, 4, gen), pdo::nn::relu{}, pdo::nn::linear<float>(4, 2, gen));
  auto trainer = pdo::nn::make_pipeline<float, 4, 2>(pdo::make_mesh<"pp">(pdo::cpu_places(2)), model,
                                                     [](auto p) { return pdo::nn::sgd<float>(std::move(p), {.lr = 0.1}); });
  pdo::tensor<double, 2> x({4, 5});
  pdo::tensor<int, 1> y({4});
  return trainer.step(x, y) > 0 ? 1 : 0;
}
