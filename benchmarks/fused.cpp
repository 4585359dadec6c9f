// benchmarks/fused.cpp: the fused elementwise kernel of pdo's expression layer,
// d = relu(a*b + c) over N float32, against hand-written loops, STREAM triad and Eigen's
// Tensor module on the same machine in the same run.
//
// Usage: bench_fused [N=64M] [samples=11]      (N in elements; K, M, G suffixes are powers of 1024)
//
// Variants, timed in turn (sample k of every variant before sample k+1 of any):
//   pdo 1 core      pdo::eval(pdo::relu(a*b + c)) on dtensors split over a 1-place mesh
//                   whose place owns one core
//   pdo local       the same expression over pdo::tensor operands, on the calling thread
//   pdo 2 cores     as "pdo 1 core", the one place owning every core of the process
//   hand loop       `#pragma omp parallel for simd` over the same arrays, 1 and 2 threads
//                   (the reference fused-loop anchor)
//   triad           STREAM triad t[i] = b[i] + s*c[i], 1 and 2 threads (the STREAM anchor)
//   Eigen           Tensor module, (ta*tb + tc).cwiseMax(0): DefaultDevice (1 thread) and
//                   ThreadPoolDevice over a 2-thread pool
// GB/s counts 16 B per element for relu(a*b + c) (3 reads, 1 write) and 12 B for the triad
// (2 reads, 1 write); write-allocate traffic is not counted. Ratios are pdo GB/s / anchor
// GB/s. Target: pdo >= 0.90 of the hand loop with the same cores.
// Every variant's result is checked once against the exact values before it is timed;
// the exit status is 1 when one is wrong.
#define EIGEN_USE_THREADS
#include "bench_common.hpp"

#include <pdo/pdo.hpp>

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unsupported/Eigen/CXX11/Tensor>
#include <vector>

namespace {

using layout_x = pdo::layout<pdo::split<"x">>;

/// @brief The exact inputs: products and sums of these are exact in float, so every
/// correct evaluation order gives the same bits.
float a_at(std::size_t i) { return static_cast<float>(i % 7) - 3.0f; }
float b_at(std::size_t) { return 0.5f; }
float c_at(std::size_t i) { return static_cast<float>(i % 3) * 0.25f; }
float want_at(std::size_t i) { return std::max(0.0f, a_at(i) * b_at(i) + c_at(i)); }
constexpr float triad_scale = 3.0f;
float triad_at(std::size_t i) { return b_at(i) + triad_scale * c_at(i); }

/// @brief Counts the elements of `data` that differ from want(i); prints the first.
template <class Want>
std::size_t mismatches(const char* what, const float* data, std::size_t n, Want want) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i)
    if (data[i] != want(i)) {
      if (bad++ == 0) std::printf("WRONG: %s: element %zu is %g, want %g\n", what, i, data[i], want(i));
    }
  return bad;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::size_t n = argc > 1 ? bench::parse_bytes(argv[1]) : std::size_t{64} << 20;
  const int samples = argc > 2 ? std::max(1, std::atoi(argv[2])) : 11;
  if (n == 0) throw std::invalid_argument("N: need at least one element");
  const std::vector<int> cores = pdo::detail::process_cores();
  const int all_threads = static_cast<int>(cores.size());

  // Host operands: the local form reads them, and so do the anchors.
  pdo::tensor<float, 1> a({n}), b({n}), c({n});
  for (std::size_t i = 0; i < n; ++i) {
    a.data()[i] = a_at(i);
    b.data()[i] = b_at(i);
    c.data()[i] = c_at(i);
  }
  bench::buffer d = bench::make_buffer(n), t = bench::make_buffer(n);
  float* const pa = a.data();
  float* const pb = b.data();
  float* const pc = c.data();
  float* const pd = d.get();
  float* const pt = t.get();

  // pdo: one place on one core, and one place on every core.
  const auto mesh1 = pdo::make_mesh<"x">(std::vector<pdo::cpu_place>{pdo::cpu_place(0, {cores.front()})});
  const auto mesh2 = pdo::make_mesh<"x">(std::vector<pdo::cpu_place>{pdo::cpu_place(1, cores)});
  const auto a1 = pdo::distribute<layout_x>(mesh1, a), b1 = pdo::distribute<layout_x>(mesh1, b),
             c1 = pdo::distribute<layout_x>(mesh1, c);
  const auto a2 = pdo::distribute<layout_x>(mesh2, a), b2 = pdo::distribute<layout_x>(mesh2, b),
             c2 = pdo::distribute<layout_x>(mesh2, c);

  // Anchors.
  auto hand_loop = [=](int threads) {
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (std::size_t i = 0; i < n; ++i) {
      const float v = pa[i] * pb[i] + pc[i];
      pd[i] = v > 0.0f ? v : 0.0f;
    }
  };
  auto triad = [=](int threads) {
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (std::size_t i = 0; i < n; ++i) pt[i] = pb[i] + triad_scale * pc[i];
  };
  using eigen_map = Eigen::TensorMap<Eigen::Tensor<float, 1, Eigen::RowMajor>, Eigen::Aligned64>;
  const auto en = static_cast<Eigen::Index>(n);
  eigen_map ta(pa, en), tb(pb, en), tc(pc, en), td(pd, en);
  Eigen::DefaultDevice eigen_default;
  Eigen::ThreadPool eigen_threads(2);
  Eigen::ThreadPoolDevice eigen_pool(&eigen_threads, 2);

  std::printf("# relu(a*b + c), N = %zu float32 (%s moved per evaluation, 16 B/element), %d samples, median\n", n,
              bench::size_text(16 * n).c_str(), samples);
  std::printf("# cores of this process: %d; \"pdo 2 cores\" is one place on all of them\n", all_threads);
  std::string plan = pdo::explain(pdo::relu(a1 * b1 + c1));
  for (std::size_t at = 0; (at = plan.find('\n', at)) != std::string::npos && at + 1 < plan.size(); at += 3)
    plan.replace(at, 1, "\n# ");
  std::printf("# %s", plan.c_str());

  // Check every variant once, then time them.
  std::size_t bad = 0;
  bad += mismatches("pdo 1 core", pdo::gather(pdo::eval(pdo::relu(a1 * b1 + c1))).data(), n, want_at);
  bad += mismatches("pdo local", pdo::eval(pdo::relu(a * b + c)).data(), n, want_at);
  bad += mismatches("pdo 2 cores", pdo::gather(pdo::eval(pdo::relu(a2 * b2 + c2))).data(), n, want_at);
  for (int threads : {1, 2}) {
    std::fill_n(pd, n, -1.0f);
    hand_loop(threads);
    bad += mismatches(threads == 1 ? "hand loop, 1 thread" : "hand loop, 2 threads", pd, n, want_at);
    std::fill_n(pt, n, -1.0f);
    triad(threads);
    bad += mismatches(threads == 1 ? "triad, 1 thread" : "triad, 2 threads", pt, n, triad_at);
  }
  std::fill_n(pd, n, -1.0f);
  td.device(eigen_default) = (ta * tb + tc).cwiseMax(0.0f);
  bad += mismatches("Eigen DefaultDevice", pd, n, want_at);
  std::fill_n(pd, n, -1.0f);
  td.device(eigen_pool) = (ta * tb + tc).cwiseMax(0.0f);
  bad += mismatches("Eigen ThreadPoolDevice", pd, n, want_at);

  const auto s = bench::interleaved_medians(
      samples, bench::per_call([&] { (void)pdo::eval(pdo::relu(a1 * b1 + c1)); }),
      bench::per_call([&] { (void)pdo::eval(pdo::relu(a * b + c)); }),
      bench::per_call([&] { (void)pdo::eval(pdo::relu(a2 * b2 + c2)); }), bench::per_call([&] { hand_loop(1); }),
      bench::per_call([&] { hand_loop(2); }), bench::per_call([&] { triad(1); }), bench::per_call([&] { triad(2); }),
      bench::per_call([&] { td.device(eigen_default) = (ta * tb + tc).cwiseMax(0.0f); }),
      bench::per_call([&] { td.device(eigen_pool) = (ta * tb + tc).cwiseMax(0.0f); }));

  enum { pdo1, pdo_local, pdo2, loop1, loop2, triad1, triad2, eigen1, eigen2, count };
  const char* names[count] = {"pdo 1 core (1-place mesh)",   "pdo local (pdo::tensor, host thread)",
                              "pdo 2 cores (1 place)",       "hand loop, 1 thread",
                              "hand loop, 2 threads",        "triad, 1 thread",
                              "triad, 2 threads",            "Eigen DefaultDevice",
                              "Eigen ThreadPoolDevice(2)"};
  double gb[count];
  for (int v = 0; v < count; ++v) gb[v] = bench::gbps((v == triad1 || v == triad2 ? 12 : 16) * n, s[v]);
  std::printf("%-38s | %9s | %7s\n", "variant", "ms", "GB/s");
  for (int v = 0; v < count; ++v) std::printf("%-38s | %9.2f | %7.2f\n", names[v], s[v] * 1e3, gb[v]);

  std::printf("%-38s | %7s | %-26s | %7s | %5s\n", "pdo", "GB/s", "anchor (same run)", "GB/s", "ratio");
  auto ratio = [&](int p, int anchor) {
    std::printf("%-38s | %7.2f | %-26s | %7.2f | %5.2f\n", names[p], gb[p], names[anchor], gb[anchor], gb[p] / gb[anchor]);
  };
  for (int p : {pdo1, pdo_local})
    for (int anchor : {loop1, triad1, eigen1}) ratio(p, anchor);
  for (int anchor : {loop2, triad2, eigen2}) ratio(pdo2, anchor);
  std::printf("summary: pdo 1 core %.2f GB/s = %.2f of the hand loop (1 thread), local %.2f of it; "
              "pdo 2 cores %.2f GB/s = %.2f of the hand loop (2 threads) (target >= 0.90)%s\n",
              gb[pdo1], gb[pdo1] / gb[loop1], gb[pdo_local] / gb[loop1], gb[pdo2], gb[pdo2] / gb[loop2],
              bad ? "; WRONG results" : "");
  return bad ? 1 : 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_fused: %s\n", e.what());
  return 1;
}
