// compile_fail/pipeline_cut_past_last_layer.cpp: a pipeline cut at layer 7 of a model of 3 layers:
// one error, nothing of the pipeline's uses after it.
// expect: pdo: pipeline: every stage needs at least one layer: the cut points must increase and lie inside the model
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  auto model = pdo::nn::sequential(pdo::nn::linear<float>(5, 4, gen), pdo::nn::relu{}, pdo::nn::linear<float>(4, 2, gen));
  auto trainer = pdo::nn::make_pipeline<float, 2, 7>(pdo::make_mesh<"pp">(pdo::cpu_places(2)), model,
                                                     [](auto p) { return pdo::nn::sgd<float>(std::move(p), {.lr = 0.1}); });
  // its uses report nothing more
  pdo::tensor<float, 2> x({4, 5});
  pdo::tensor<int, 1> y({4});
  trainer.set_steps(trainer.steps() + trainer.skipped_steps());
  trainer.set_skipped_steps(0);
  const bool quiet = trainer.busy_seconds().empty() && trainer.max_in_flight().empty() && trainer.last_step_seconds() == 0 &&
                     trainer.parameters(0).empty() && trainer.accuracy(x, y) == 0;
  return trainer.step(x, y) > 0 && quiet ? 1 : 0;
}
