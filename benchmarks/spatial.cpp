// benchmarks/spatial.cpp: a conv2d over one image split along its height (spatial
// parallelism, halo exchange), forward and backward, f32:
//  - 2 places of one core each, the image's rows split over them, against 1 place of one
//    core (the speedup; target at least 1.7x) and against 1 place that owns both cores
//    (target at least 0.9x: splitting the image costs little against threading one conv);
//  - the halo bytes the split sends against the bytes of the activation;
//  - the same conv through PyTorch (python3-torch) with 2 threads, measured in this run.
// Each figure is the median of the steps after a warm-up step.
//
//   bench_spatial [steps] [channels] [size]      (defaults: 3 64 512: a 3x3 conv 64 -> 64 on 1x64x512x512)
#include <pdo/pdo.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using steady = std::chrono::steady_clock;
using R = pdo::replicate;
using H = pdo::layout<R, R, pdo::split<"sp">, R>;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct timing {
  double forward = 0, backward = 0;
  [[nodiscard]] double step() const { return forward + backward; }
};

/// @brief Median forward and backward seconds of the conv on mesh `m`, the input laid out as L.
template <class L, class Mesh>
timing run(const Mesh& m, const pdo::tensor<float, 4>& x, const pdo::tensor<float, 4>& w, const pdo::tensor<float, 1>& b, int steps) {
  auto X = pdo::parameter(pdo::distribute<L>(m, x));
  auto W = pdo::parameter(pdo::distribute<pdo::layout<R, R, R, R>>(m, w));
  auto B = pdo::parameter(pdo::distribute<pdo::layout<R>>(m, b));
  pdo::tensor<float, 4> ones(x.shape());  // 3x3, padding 1, as many channels out as in: the output has the input's shape
  ones.fill(1.0f);
  std::vector<double> fw, bw;
  for (int s = 0; s <= steps; ++s) {
    X.zero_grad();
    W.zero_grad();
    B.zero_grad();
    const auto t0 = steady::now();
    const auto y = pdo::conv2d(X, W, B, {1, 1});
    const auto t1 = steady::now();
    auto seed = pdo::distribute<L>(m, ones);
    const auto t2 = steady::now();
    pdo::backward(y, std::move(seed));
    (void)pdo::gather(W.grad());  // the weight gradient summed over the places: part of a step
    const auto t3 = steady::now();
    if (s == 0) continue;
    fw.push_back(std::chrono::duration<double>(t1 - t0).count());
    bw.push_back(std::chrono::duration<double>(t3 - t2).count());
  }
  return {median(fw), median(bw)};
}

/// @brief The same conv in PyTorch with 2 threads, forward and backward medians; {0, 0} without torch.
timing torch_conv(std::size_t c, std::size_t size, int steps) {
  const std::string script =
      "import time, torch\n"
      "torch.set_num_threads(2)\n"
      "c, n, steps = " + std::to_string(c) + ", " + std::to_string(size) + ", " + std::to_string(steps) + "\n"
      "conv = torch.nn.Conv2d(c, c, 3, padding=1)\n"
      "x = torch.randn(1, c, n, n, requires_grad=True)\n"
      "fw, bw = [], []\n"
      "for s in range(steps + 1):\n"
      "    conv.zero_grad(); x.grad = None\n"
      "    t0 = time.perf_counter(); y = conv(x); t1 = time.perf_counter()\n"
      "    y.backward(torch.ones_like(y)); t2 = time.perf_counter()\n"
      "    if s: fw.append(t1 - t0); bw.append(t2 - t1)\n"
      "fw.sort(); bw.sort()\n"
      "print(fw[len(fw) // 2], bw[len(bw) // 2])\n";
  // the python3 first on the PATH, then Debian's (where python3-torch installs)
  for (const char* python : {"python3", "/usr/bin/python3"}) {
    const std::string command = std::string(python) + " -c '" + script + "' 2>/dev/null";
    FILE* pipe = popen(command.c_str(), "r");
    if (pipe == nullptr) continue;
    timing t;
    const bool read = std::fscanf(pipe, "%lf %lf", &t.forward, &t.backward) == 2;
    pclose(pipe);
    if (read) return t;
  }
  return {};
}

void row(const char* what, const timing& t, const timing& anchor) {
  std::printf("   %-34s forward %8.1f ms  backward %8.1f ms  step %8.1f ms", what, 1e3 * t.forward, 1e3 * t.backward, 1e3 * t.step());
  if (anchor.step() > 0) std::printf("   %.2fx", anchor.step() / t.step());
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 3;
  const std::size_t c = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 64;
  const std::size_t size = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 512;
  pdo::tensor<float, 4> x({1, c, size, size}), w({c, c, 3, 3});
  pdo::tensor<float, 1> b({c});
  for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>((i * 40503u) % 1000) / 1000.0f - 0.5f;
  for (std::size_t i = 0; i < w.size(); ++i) w.data()[i] = static_cast<float>((i * 7919u) % 100) / 1000.0f - 0.05f;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::printf("conv2d 3x3, %zu -> %zu channels, padding 1, on 1x%zux%zux%zu f32, forward and backward, median of %d steps\n", c, c, c, size,
              size, steps);

  auto two = pdo::cpu_places(2);  // one core each on a 2-core machine
  auto one_core = two;
  one_core.pop_back();
  const timing single = run<H>(pdo::make_mesh<"sp">(one_core), x, w, b, steps);
  const timing both = run<H>(pdo::make_mesh<"sp">(pdo::cpu_places(1)), x, w, b, steps);
  const auto mesh = pdo::make_mesh<"sp">(two);
  const timing split = run<H>(mesh, x, w, b, steps);
  const timing torch = torch_conv(c, size, steps);

  row("1 place, 1 core", single, {});
  row("1 place, 2 cores", both, {});
  row("2 places of 1 core, height split", split, {});
  std::printf("   speedup of the split: %.2fx against 1 place of 1 core (target >= 1.7), %.2fx against 1 place of 2 cores (target >= 0.9)\n",
              single.step() / split.step(), both.step() / split.step());
  if (torch.step() > 0) {
    row("PyTorch, 2 threads", torch, {});
    std::printf("   the split against PyTorch with 2 threads: %.2fx (above 1: pdo faster)\n", torch.step() / split.step());
  } else {
    std::printf("   PyTorch: not measured (python3 -c 'import torch' failed: apt-get install python3-torch)\n");
  }

  // the halo: what the exchange sends against the activation it serves
  const auto X = pdo::distribute<H>(mesh, x);
  const auto W = pdo::distribute<pdo::layout<R, R, R, R>>(mesh, w);
  const auto B = pdo::distribute<pdo::layout<R>>(mesh, b);
  const std::string plan = pdo::explain_conv2d(X, W, B, {1, 1});
  std::printf("%s", plan.c_str());
  const std::size_t row_bytes = c * size * sizeof(float), halo = 2 * row_bytes, activation = x.size() * sizeof(float);
  std::printf("   halo bytes sent, all places: %zu (%zu rows of %zu bytes) against the activation's %zu: %.4f%%, each way\n", halo, halo / row_bytes,
              row_bytes, activation, 100.0 * static_cast<double>(halo) / static_cast<double>(activation));
  return 0;
}
