// A pipeline on a mesh with a "tp" axis, whose stages are tensor parallel, over a model that
// holds a conv layer: one error, nothing of the stages or of the pipeline's uses after it.
// expect: pdo: pipeline: on a mesh with a "tp" axis every stage is tensor parallel: the model may hold linear layers and layers without parameters
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(5);
  using namespace pdo::nn;
  auto model = sequential(conv2d<float>(1, 2, 3, gen, {1, 1}), relu{}, flatten{}, linear<float>(32, 6, gen), relu{}, linear<float>(6, 3, gen));
  auto trainer = make_pipeline<float, 4, 3>(pdo::make_mesh<"pp", "tp">(pdo::cpu_places(4), {2, 2}), model,
                                            [](auto p) { return sgd<float>(std::move(p)); });
  pdo::tensor<float, 4> images({4, 1, 4, 4});
  pdo::tensor<int, 1> labels({4});
  return trainer.step(images, labels) > 0 ? 1 : 0;
}
