// make_pipeline given a make_optimizer that does not take the stage's parameters: one
// error that says what it must be, nothing of the pipeline's uses after it.
// expect: pdo: make_pipeline: make_optimizer must be a callable that takes a stage's parameters
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  auto model = pdo::nn::sequential(pdo::nn::linear<float>(5, 4, gen), pdo::nn::relu{}, pdo::nn::linear<float>(4, 2, gen));
  auto trainer = pdo::nn::make_pipeline<float, 2, 2>(pdo::make_mesh<"pp">(pdo::cpu_places(2)), model, [] { return 1; });
  pdo::tensor<float, 2> x({4, 5});
  pdo::tensor<int, 1> y({4});
  return trainer.step(x, y) > 0 ? 1 : 0;
}
