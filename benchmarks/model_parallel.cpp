// benchmarks/model_parallel.cpp: model parallelism on CPU places.
//  1. pipeline bubble: the fraction of a step a stage sits idle, measured (1 - mean stage
//     compute time / step time) beside the theory of a balanced pipeline, (p-1)/(m+p-1),
//     for 2 stages and 1..16 micro-batches, GPipe and 1F1B;
//  2. tensor-parallel training step on 2 places vs the same model on 1 place;
//  3. peak memory per place of one training step in each mode: data parallel, ZeRO-1,
//     tensor parallel, pipeline GPipe and 1F1B, pipeline stages made tensor parallel (pp x tp,
//     and dp x pp x tp on a 3-D mesh).
// Places have half the machine's cores each (one on a 2-core machine).
//
//   bench_model_parallel [steps]
#include <pdo/pdo.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using steady = std::chrono::steady_clock;
constexpr std::size_t width = 1024, classes = 16;

auto make_mlp() {
  pdo::nn::rng gen(3);
  using namespace pdo::nn;
  return sequential(linear<float>(width, width, gen), relu{}, linear<float>(width, width, gen), relu{}, linear<float>(width, width, gen),
                    relu{}, linear<float>(width, classes, gen));
}
auto sgd() {
  return [](auto ps) { return pdo::nn::sgd<float>(std::move(ps), {.lr = 0.01}); };
}

/// @brief Two equal stages for the bubble measurement: 2 + 2 layers of width x width.
auto make_balanced() {
  pdo::nn::rng gen(4);
  using namespace pdo::nn;
  return sequential(linear<float>(width, width, gen), relu{}, linear<float>(width, width, gen), relu{}, linear<float>(width, width, gen),
                    relu{}, linear<float>(width, width, gen), relu{});
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct data {
  pdo::tensor<float, 2> x;
  pdo::tensor<int, 1> y;
};
data make_data(std::size_t rows) {
  data d{pdo::tensor<float, 2>({rows, width}), pdo::tensor<int, 1>({rows})};
  for (std::size_t i = 0; i < d.x.size(); ++i) d.x.data()[i] = static_cast<float>((i * 40503u) % 1000) / 1000.0f - 0.5f;
  for (std::size_t i = 0; i < rows; ++i) d.y(i) = static_cast<int>(i % classes);
  return d;
}

template <class Mesh>
std::size_t peak(const Mesh& m) {
  std::size_t p = 0;
  for (const auto& place : m.places()) p = std::max(p, place.memory().stats().peak_bytes_in_use);
  return p;
}
template <class Mesh>
void reset_peaks(const Mesh& m) {
  for (const auto& place : m.places()) place.memory().reset_peak();
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 3;
  const auto d = make_data(256);

  std::printf("1. pipeline bubble, 2 equal stages of 2 layers %zux%zu, global batch 256, median of %d steps\n", width, width, steps);
  auto wide = make_data(256);
  for (std::size_t i = 0; i < 256; ++i) wide.y(i) = static_cast<int>((i * 37) % width);
  std::printf("   %-6s %6s %10s %14s %10s\n", "sched", "micro", "step ms", "bubble meas.", "theory");
  for (auto kind : {pdo::nn::pipeline_schedule::gpipe, pdo::nn::pipeline_schedule::one_f_one_b})
    for (std::size_t micro : {1, 2, 4, 8, 16}) {
      const auto m = pdo::make_mesh<"pp">(pdo::cpu_places(2));
      auto trainer = pdo::nn::make_pipeline<float, 2, 4>(m, make_balanced(), sgd(), {kind, micro});
      std::vector<double> times, bubbles;
      for (int s = 0; s < steps + 1; ++s) {
        (void)trainer.step(wide.x, wide.y);
        if (s == 0) continue;
        const auto busy = trainer.busy_seconds();
        const double step = trainer.last_step_seconds();
        double mean_busy = 0;
        for (double b : busy) mean_busy += b / static_cast<double>(busy.size());
        times.push_back(1000 * step);
        bubbles.push_back(1 - mean_busy / step);
      }
      const double theory = 1.0 / static_cast<double>(micro + 1);  // (p-1)/(m+p-1), p = 2
      std::printf("   %-6s %6zu %10.1f %14.2f %10.2f\n", kind == pdo::nn::pipeline_schedule::gpipe ? "GPipe" : "1F1B", micro, median(times),
                  median(bubbles), theory);
    }

  std::printf("2. tensor-parallel training step, MLP %zu-%zu-%zu-%zu-%zu, batch 256, SGD\n", width, width, width, width, classes);
  double one_place = 0;
  for (std::size_t n : {1, 2}) {
    auto all = pdo::cpu_places(2);
    if (n == 1) all.pop_back();
    const auto m = pdo::make_mesh<"tp">(all);
    auto model = pdo::nn::tensor_parallel<"tp">(m, make_mlp());
    pdo::nn::sgd<float> opt(pdo::nn::parameters_of<float>(model), {.lr = 0.01});
    const auto x = pdo::var(pdo::distribute<pdo::layout<pdo::replicate, pdo::replicate>>(m, d.x));
    const auto y = pdo::distribute<pdo::layout<pdo::replicate>>(m, d.y);
    std::vector<double> times;
    for (int s = 0; s < steps + 1; ++s) {
      const auto start = steady::now();
      opt.zero_grad();
      pdo::backward(pdo::cross_entropy(model(x), y));
      opt.step();
      if (s > 0) times.push_back(std::chrono::duration<double, std::milli>(steady::now() - start).count());
    }
    const double t = median(times);
    if (n == 1) one_place = t;
    std::printf("   %zu place%s: step %7.1f ms%s\n", n, n == 1 ? " " : "s", t,
                n == 1 ? "" : ("  speedup " + std::to_string(one_place / t).substr(0, 4) + "x").c_str());
  }

  std::printf("3. peak memory per place in one step (MiB), the same model, batch 256\n");
  auto row = [](const char* what, std::size_t bytes) { std::printf("   %-42s %8.1f\n", what, static_cast<double>(bytes) / (1 << 20)); };
  for (std::size_t n : {2, 4})
    for (bool zero1 : {false, true}) {
      const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(n));
      auto trainer = pdo::nn::make_data_parallel<float>(
          m, make_mlp, [](auto ps) { return pdo::nn::adam<float>(std::move(ps), {.lr = 1e-3}); }, {.zero1 = zero1});
      (void)trainer.step(d.x, d.y);
      reset_peaks(m);
      (void)trainer.step(d.x, d.y);
      const std::string what = std::string(zero1 ? "data parallel + ZeRO-1" : "data parallel") + ", Adam, " + std::to_string(n) + " places";
      row(what.c_str(), peak(m));
    }
  {
    const auto m = pdo::make_mesh<"tp">(pdo::cpu_places(2));
    auto model = pdo::nn::tensor_parallel<"tp">(m, make_mlp());
    pdo::nn::adam<float> opt(pdo::nn::parameters_of<float>(model), {.lr = 1e-3});
    const auto x = pdo::var(pdo::distribute<pdo::layout<pdo::replicate, pdo::replicate>>(m, d.x));
    const auto y = pdo::distribute<pdo::layout<pdo::replicate>>(m, d.y);
    for (int s = 0; s < 2; ++s) {
      if (s == 1) reset_peaks(m);
      opt.zero_grad();
      pdo::backward(pdo::cross_entropy(model(x), y));
      opt.step();
    }
    row("tensor parallel, Adam, 2 places", peak(m));
  }
  auto pipeline_row = [&](const char* what, const auto& m, pdo::nn::pipeline_schedule kind) {
    auto trainer = pdo::nn::make_pipeline<float, 2, 3>(m, make_mlp(), [](auto ps) { return pdo::nn::adam<float>(std::move(ps), {.lr = 1e-3}); },
                                                       {kind, 8});
    (void)trainer.step(d.x, d.y);
    reset_peaks(m);
    (void)trainer.step(d.x, d.y);
    row(what, peak(m));
  };
  pipeline_row("pipeline GPipe, 8 micro, Adam, 2 st.", pdo::make_mesh<"pp">(pdo::cpu_places(2)), pdo::nn::pipeline_schedule::gpipe);
  pipeline_row("pipeline 1F1B, 8 micro, Adam, 2 st.", pdo::make_mesh<"pp">(pdo::cpu_places(2)), pdo::nn::pipeline_schedule::one_f_one_b);
  pipeline_row("1F1B, 2 st. x 2 tensor parallel (4 places)", pdo::make_mesh<"pp", "tp">(pdo::cpu_places(4), {2, 2}),
               pdo::nn::pipeline_schedule::one_f_one_b);
  pipeline_row("1F1B, 2 dp x 2 st. x 2 tp (8 places)", pdo::make_mesh<"dp", "pp", "tp">(pdo::cpu_places(8), {2, 2, 2}),
               pdo::nn::pipeline_schedule::one_f_one_b);
  return 0;
}
