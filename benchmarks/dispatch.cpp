// benchmarks/dispatch.cpp: the cost of starting work on every place of a mesh and waiting
// for it (pdo::spmd with an empty task), per operation and per place.
//
// Usage: bench_dispatch [iterations=20000]
// Target (DESIGN §7): dispatch overhead per op per place <= 2 us. Beside it, the same
// round trip through a std::thread created per operation, the cost pdo's resident place
// workers avoid.
#include <pdo/pdo.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

template <class F>
double microseconds_per_call(int iterations, F&& f) {
  f();  // warm-up
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) f();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / iterations;
}

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 20000;
  std::printf("# pdo::spmd round trip with an empty task; anchor: one std::thread per place per operation\n");
  std::printf("# places |  spmd us | per place us |  threads us | ratio\n");
  for (std::size_t n : {1, 2, 4}) {
    const auto mesh = pdo::make_mesh<"x">(pdo::cpu_places(n));
    const double pdo_us = microseconds_per_call(iterations, [&] { pdo::spmd(mesh, [](std::size_t) {}); });
    const double thread_us = microseconds_per_call(iterations / 10, [&] {
      std::vector<std::thread> threads;
      for (std::size_t k = 0; k < n; ++k) threads.emplace_back([] {});
      for (auto& t : threads) t.join();
    });
    std::printf("%8zu | %8.2f | %12.2f | %11.2f | %5.2f\n", n, pdo_us, pdo_us / static_cast<double>(n), thread_us,
                pdo_us / thread_us);
  }
  std::printf("target: <= 2 us per op per place\n");
  return 0;
}
