// A pipeline on a mesh with a "tp" axis cut between the two linear layers of a column/row
// pair: one error, nothing of the stages or of the pipeline's uses after it.
// expect: pdo: pipeline: on a mesh with a "tp" axis every stage is tensor parallel: cut the model so that each stage holds whole column/row pairs
// nvcc: also
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  using namespace pdo::nn;
  auto model = sequential(linear<float>(4, 8, gen), relu{}, linear<float>(8, 8, gen), relu{}, linear<float>(8, 6, gen), relu{},
                          linear<float>(6, 3, gen));
  auto trainer = make_pipeline<float, 2, 2>(pdo::make_mesh<"pp", "tp">(pdo::cpu_places(4), {2, 2}), model,
                                            [](auto p) { return sgd<float>(std::move(p), {.lr = 0.1}); });
  pdo::tensor<float, 2> x({4, 4});
  pdo::tensor<int, 1> y({4});
  return trainer.step(x, y) > 0 ? 1 : 0;
}
