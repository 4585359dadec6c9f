// compile_fail/data_parallel_mesh_without_dp.cpp: a data-parallel trainer on a mesh with no "dp" axis:
// one error, nothing of the trainer's uses after it (its members, fit with its options, a checkpoint of it).
// expect: pdo: data_parallel: the mesh needs an axis named
#include <pdo/io.hpp>
#include <pdo/pdo.hpp>

int main() {
  const auto m = pdo::make_mesh<"x">(pdo::cpu_places(2));
  auto trainer = pdo::nn::make_data_parallel<float>(
      m, [] { pdo::nn::rng gen(1); return pdo::nn::sequential(pdo::nn::linear<float>(5, 4, gen)); },
      [](auto p) { return pdo::nn::sgd<float>(std::move(p), {.lr = 0.1}); });
  pdo::tensor<float, 2> x({4, 5});
  pdo::tensor<int, 1> y({4});
  trainer.fit(x, y, {.epochs = 1, .batch_size = 2}, [](const auto& stats) { (void)stats.loss; });
  trainer.check_replicas();
  pdo::io::save("ck", trainer);
  pdo::io::load("ck", trainer);
  const bool quiet = trainer.fused_update() || trainer.sliced_weight_gradients() || trainer.replica_count() == 0 ||
                     trainer.buckets().empty() || trainer.last_step_events().empty() || trainer.optimizer_state_elements() == 0;
  trainer.set_progress(1, 1);
  return trainer.step(x, y) > 0 && trainer.parameters().empty() && quiet ? 1 : 0;
}
