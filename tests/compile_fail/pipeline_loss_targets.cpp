// A pipeline with mse_loss given targets of another rank than its last stage's output: one
// error at the step, that says what each loss takes.
// expect: pdo: pipeline::step: the loss cannot take the last stage's output and these targets
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  auto model = pdo::nn::sequential(pdo::nn::linear<float>(4, 8, gen), pdo::nn::relu{}, pdo::nn::linear<float>(8, 3, gen));
  auto trainer = pdo::nn::make_pipeline<float, 2, 2>(pdo::make_mesh<"pp">(pdo::cpu_places(2)), model,
                                                     [](auto p) { return pdo::nn::sgd<float>(std::move(p), {.lr = 0.1}); },
                                                     {pdo::nn::pipeline_schedule::gpipe, 2}, pdo::nn::mse_loss{});
  pdo::tensor<float, 2> x({8, 4});
  pdo::tensor<float, 1> targets({8});
  return trainer.step(x, targets) > 0 ? 1 : 0;
}
