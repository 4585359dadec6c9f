// benchmarks/dispatch.cpp: the cost of starting work on every place of a mesh and waiting
// for it, per operation and per place: pdo::spmd with an empty task, and pdo::eval of
// x + y on tiny dtensors (what every expression pays besides its kernels).
//
// Usage: bench_dispatch [iterations=20000] [samples=5]
// Target (DESIGN §7): dispatch overhead per op per place <= 2 us. Beside spmd, the same
// round trip through a std::thread created per operation, the cost pdo's resident place
// workers avoid; beside eval, the spmd round trip on the same mesh, the part of an eval
// that is dispatch alone. Each sample times `iterations` calls (a tenth of that for the
// threads); samples of the variants alternate, and each figure is their median.
#include <pdo/pdo.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

template <class F>
double microseconds_per_call(int iterations, F&& f) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) f();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / iterations;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct figures {
  double spmd_us, eval_us, thread_us;
};

/// @brief spmd, eval(x + y) and a thread per place on `n` places: medians of interleaved samples.
figures measure(std::size_t n, int iterations, int samples, bool& wrong) {
  const auto mesh = pdo::make_mesh<"x">(pdo::cpu_places(n));
  pdo::tensor<float, 1> xh({4}, {1, 2, 3, 4}), yh({4}, {10, 20, 30, 40});
  const auto x = pdo::distribute<pdo::layout<pdo::split<"x">>>(mesh, xh);
  const auto y = pdo::distribute<pdo::layout<pdo::split<"x">>>(mesh, yh);
  const auto sum = pdo::gather(pdo::eval(x + y));
  for (std::size_t i = 0; i < 4; ++i)
    if (sum(i) != xh(i) + yh(i)) {
      std::printf("WRONG: eval(x + y) on %zu places: element %zu is %g, want %g\n", n, i, sum(i), xh(i) + yh(i));
      wrong = true;
    }
  auto spmd = [&] { pdo::spmd(mesh, [](std::size_t) {}); };
  auto eval = [&] { (void)pdo::eval(x + y); };
  auto threads = [&] {
    std::vector<std::thread> t;
    for (std::size_t k = 0; k < n; ++k) t.emplace_back([] {});
    for (auto& th : t) th.join();
  };
  spmd();  // warm-up
  eval();
  threads();
  std::vector<double> s, e, t;
  for (int k = 0; k < samples; ++k) {
    s.push_back(microseconds_per_call(iterations, spmd));
    e.push_back(microseconds_per_call(iterations, eval));
    t.push_back(microseconds_per_call(std::max(1, iterations / 10), threads));
  }
  return {median(s), median(e), median(t)};
}

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::max(1, std::atoi(argv[1])) : 20000;
  const int samples = argc > 2 ? std::max(1, std::atoi(argv[2])) : 5;
  bool wrong = false;
  std::vector<figures> f;
  for (std::size_t n : {1, 2, 4}) f.push_back(measure(n, iterations, samples, wrong));

  std::printf("# %d samples of %d calls, median\n", samples, iterations);
  std::printf("# pdo::spmd round trip with an empty task; anchor: one std::thread per place per operation\n");
  std::printf("# places |  spmd us | per place us |  threads us | ratio\n");
  for (std::size_t i = 0; i < f.size(); ++i) {
    const double n = static_cast<double>(std::size_t{1} << i);
    std::printf("%8zu | %8.2f | %12.2f | %11.2f | %5.2f\n", std::size_t{1} << i, f[i].spmd_us, f[i].spmd_us / n,
                f[i].thread_us, f[i].spmd_us / f[i].thread_us);
  }
  std::printf("# pdo::eval(x + y), x and y f32[4] split<x> over the places; anchor: the spmd round trip above\n");
  std::printf("# places |  eval us | per place us |  spmd us | ratio | eval - spmd us\n");
  for (std::size_t i = 0; i < f.size(); ++i) {
    const double n = static_cast<double>(std::size_t{1} << i);
    std::printf("%8zu | %8.2f | %12.2f | %8.2f | %5.2f | %14.2f\n", std::size_t{1} << i, f[i].eval_us, f[i].eval_us / n,
                f[i].spmd_us, f[i].eval_us / f[i].spmd_us, f[i].eval_us - f[i].spmd_us);
  }
  std::printf("target: <= 2 us per op per place%s\n", wrong ? "; WRONG results" : "");
  return wrong ? 1 : 0;
}
