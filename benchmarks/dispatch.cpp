// benchmarks/dispatch.cpp: the cost of starting work on every place of a mesh and waiting
// for it, per operation and per place: pdo::spmd with an empty task, and pdo::eval of
// x + y on tiny dtensors (what every expression pays besides its kernels).
//
// Usage: bench_dispatch [iterations=20000] [samples=5]
// Target: dispatch overhead per op per place <= 2 us. Beside spmd, the same
// round trip through a std::thread created per operation, the cost pdo's resident place
// lanes avoid; beside eval, the spmd round trip on the same mesh, the part of an eval
// that is dispatch alone. Each sample times `iterations` calls (a tenth of that for the
// threads); samples of the variants alternate, and each figure is their median.
// Then two host threads, each driving a one-place mesh over one of the two places of
// cpu_places(2), against the same work run by one thread, one mesh after the other
// (target: at most 0.6x of that time: the engine runs independent work at once).
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

/// @brief Seconds for `ops` evaluations of relu(x * y + 1) on each of two one-place meshes
/// over the places of cpu_places(2): from one thread, one mesh after the other, and from
/// two threads at once; medians of interleaved samples.
struct two_threads {
  std::size_t elements;
  double one_after_other_s, at_once_s;
};

two_threads measure_two_threads(std::size_t elements, int ops, int samples, bool& wrong) {
  const auto places = pdo::cpu_places(2);
  const auto left = pdo::make_mesh<"x">(std::vector<pdo::cpu_place>{places[0]});
  const auto right = pdo::make_mesh<"x">(std::vector<pdo::cpu_place>{places[1]});
  pdo::tensor<float, 1> xh({elements}), yh({elements});
  for (std::size_t i = 0; i < elements; ++i) {
    xh(i) = static_cast<float>(i % 7) - 3.0f;
    yh(i) = 0.5f;
  }
  using rep = pdo::layout<pdo::replicate>;
  const auto xl = pdo::distribute<rep>(left, xh), yl = pdo::distribute<rep>(left, yh);
  const auto xr = pdo::distribute<rep>(right, xh), yr = pdo::distribute<rep>(right, yh);
  auto drive = [&](const auto& x, const auto& y) {
    for (int i = 0; i < ops; ++i) (void)pdo::eval(pdo::relu(x * y + 1.0f));
  };
  const auto check = pdo::gather(pdo::eval(pdo::relu(xr * yr + 1.0f)));
  for (std::size_t i = 0; i < elements; ++i)
    if (check(i) != std::max(0.0f, xh(i) * yh(i) + 1.0f)) {
      std::printf("WRONG: relu(x * y + 1) element %zu is %g\n", i, check(i));
      wrong = true;
      break;
    }
  auto seconds = [](auto&& f) {
    const auto start = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  auto sequential = [&] {
    drive(xl, yl);
    drive(xr, yr);
  };
  auto concurrent = [&] {
    std::thread other([&] { drive(xr, yr); });
    drive(xl, yl);
    other.join();
  };
  sequential();  // warm-up
  concurrent();
  std::vector<double> a, b;
  for (int k = 0; k < samples; ++k) {
    a.push_back(seconds(sequential));
    b.push_back(seconds(concurrent));
  }
  return {elements, median(a), median(b)};
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
  std::printf("target: <= 2 us per op per place\n");

  std::printf("# two host threads, each evaluating relu(x * y + 1) on a one-place mesh over one of the places of\n"
              "# cpu_places(2); anchor: the same evaluations from one thread, one mesh after the other\n");
  std::printf("# elements |   ops | one after other s | at once s | ratio\n");
  for (std::size_t elements : {std::size_t{4}, std::size_t{1} << 12, std::size_t{1} << 16}) {
    const int ops = static_cast<int>(std::max<std::size_t>(50, static_cast<std::size_t>(iterations) * 16 / (16 + elements / 64)));
    const auto t = measure_two_threads(elements, ops, samples, wrong);
    std::printf("%10zu | %5d | %17.4f | %9.4f | %5.2f\n", t.elements, ops, t.one_after_other_s, t.at_once_s,
                t.at_once_s / t.one_after_other_s);
  }
  std::printf("target: ratio <= 0.6%s\n", wrong ? "; WRONG results" : "");
  return wrong ? 1 : 0;
}
