// compile_fail/pipeline_cut_past_last_layer.cpp: a pipeline cut at layer 7 of a model of 3 layers.
// expect: pdo: pipeline: every stage needs at least one layer: the cut points must increase and lie inside the model
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  auto model = pdo::nn::sequential(pdo::nn::linear<float>(5, 4, gen), pdo::nn::relu{}, pdo::nn::linear<float>(4, 2, gen));
  auto trainer = pdo::nn::make_pipeline<float, 2, 7>(pdo::make_mesh<"pp">(pdo::cpu_places(2)), model,
                                                     [](auto p) { return pdo::nn::sgd<float>(std::move(p), {.lr = 0.1}); });
  (void)trainer;
  return 0;
}
