// A data-parallel trainer with mse_loss given targets of another rank than the model's
// output: one error at the step, that says what each loss takes.
// expect: pdo: data_parallel::step: the loss cannot take the model's output and these targets
#include <pdo/pdo.hpp>

int main() {
  auto trainer = pdo::nn::make_data_parallel<float>(
      pdo::make_mesh<"dp">(pdo::cpu_places(2)),
      [] {
        pdo::nn::rng gen(1);
        return pdo::nn::linear<float>(4, 3, gen);
      },
      [](auto p) { return pdo::nn::sgd<float>(std::move(p), {.lr = 0.1}); }, {}, pdo::nn::mse_loss{});
  pdo::tensor<float, 2> x({8, 4});
  pdo::tensor<float, 1> targets({8});
  return trainer.step(x, targets) > 0 ? 1 : 0;
}
