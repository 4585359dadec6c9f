// A pipeline on a mesh with a "tp" axis over a model with a layer_norm between the column and
// the row layer of a pair: one error, nothing of the stages or of the pipeline's uses after it.
// expect: pdo: pipeline: on a mesh with a "tp" axis every stage is tensor parallel: a layer_norm sits between the column and the row layer of a pair
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  using namespace pdo::nn;
  auto model = sequential(linear<float>(4, 8, gen), layer_norm{}, relu{}, linear<float>(8, 6, gen), relu{}, linear<float>(6, 6, gen),
                          relu{}, linear<float>(6, 3, gen));
  auto trainer = make_pipeline<float, 2, 4>(pdo::make_mesh<"pp", "tp">(pdo::cpu_places(4), {2, 2}), model,
                                            [](auto p) { return sgd<float>(std::move(p), {.lr = 0.1}); });
  pdo::tensor<float, 2> x({4, 4});
  pdo::tensor<int, 1> y({4});
  return trainer.step(x, y) > 0 ? 1 : 0;
}
