// compile_fail/data_parallel_mesh_without_dp.cpp: a data-parallel trainer on a mesh with no "dp" axis:
// one error, nothing of the trainer's uses after it.
// expect: pdo: data_parallel: the mesh needs an axis named
#include <pdo/pdo.hpp>

int main() {
  const auto m = pdo::make_mesh<"x">(pdo::cpu_places(2));
  auto trainer = pdo::nn::make_data_parallel<float>(
      m, [] { pdo::nn::rng gen(1); return pdo::nn::sequential(pdo::nn::linear<float>(5, 4, gen)); },
      [](auto p) { return pdo::nn::sgd<float>(std::move(p), {.lr = 0.1}); });
  pdo::tensor<float, 2> x({4, 5});
  pdo::tensor<int, 1> y({4});
  return trainer.step(x, y) > 0 && trainer.parameters().empty() ? 1 : 0;
}
