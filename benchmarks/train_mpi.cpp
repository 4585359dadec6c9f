// benchmarks/train_mpi.cpp: the data-parallel training step of bench_train (an MLP
// 1024-4096-4096-10, float32, cross-entropy, SGD lr 0.01, global batch 256) over MPI.
//
//   bench_train_mpi [steps] [warmup]                  2 places in this one process
//   mpirun -np 2 bench_train_mpi [steps] [warmup]     one place per process
//
// benchmarks/train_mpi.sh runs both, and PyTorch DDP over gloo (train_torch.py), in one run
// and prints the ratios.
#include <pdo/pdo.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

constexpr std::size_t in = 1024, hidden = 4096, classes = 10, batch = 256;

auto make_mlp() {
  pdo::nn::rng gen(7);
  using namespace pdo::nn;
  return sequential(linear<float>(in, hidden, gen), relu{}, linear<float>(hidden, hidden, gen), relu{}, linear<float>(hidden, classes, gen));
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 10;
  const int warmup = argc > 2 ? std::atoi(argv[2]) : 3;
  pdo::mpi::initialize();
  const bool processes = pdo::mpi::size() > 1;
  std::vector<pdo::any_place> places = pdo::mpi::world_places();
  if (!processes) {
    const auto cpus = pdo::cpu_places(2);
    places.assign(cpus.begin(), cpus.end());
  }
  const auto mesh = pdo::make_mesh<"dp">(places);
  auto trainer = pdo::nn::make_data_parallel<float>(
      mesh, make_mlp, [](auto ps) { return pdo::nn::sgd<float>(std::move(ps), {.lr = 0.01}); });
  pdo::tensor<float, 2> x({batch, in});
  pdo::tensor<int, 1> y({batch});
  std::mt19937 gen(3);
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(gen);
  for (std::size_t i = 0; i < batch; ++i) y(i) = static_cast<int>(i % classes);
  std::vector<double> ms;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto start = std::chrono::steady_clock::now();
    trainer.step(x, y);
    const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (s >= warmup) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  if (pdo::mpi::rank() == 0)
    std::printf("%s: data-parallel step, global batch %zu: %.1f ms (median of %d)\n",
                processes ? "2 MPI processes, 1 place each" : "2 places in one process", batch, ms[ms.size() / 2], steps);
  return 0;
}
