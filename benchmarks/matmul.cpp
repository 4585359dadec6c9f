// benchmarks/matmul.cpp: pdo::eval(pdo::matmul(x, w)) with x's rows split over the
// places of a mesh and w replicated, against OpenBLAS's cblas_sgemm called directly.
//
// Usage: bench_matmul [n=2048] [samples=21]      (C = A * B, all n x n float32, row-major)
//
// Variants, timed in turn (sample k of every variant before sample k+1 of any):
//   pdo 1 place     x split<"x"> over a 1-place mesh whose place owns one core
//   pdo 2 places    x split<"x"> over pdo::cpu_places(2) (one core each), w replicated:
//                   each place runs sgemm on its n/2 rows with one thread
//   pdo 1 place, 2 cores   a 1-place mesh whose place owns both cores: its gemm is cut into
//                   one block per core, each a one-thread sgemm on the place's own team
//   OpenBLAS        cblas_sgemm on the calling thread, openblas_set_num_threads(1) and (2)
//   pdo 2 places, B stored transposed   matmul(x, transpose(wt)) with wt = B^T replicated:
//                   gemm reads wt's shard transposed, in place (no transpose kernel), so it
//                   should take the time of "pdo 2 places"
// Only pdo::eval is timed (distribute and gather are not). GFLOP/s counts 2 n^3 per product.
// Targets: pdo 1 place within a few % of OpenBLAS 1 thread; 2 places >= 1.8x one place and
// >= 0.95 of OpenBLAS 2 threads. Each place's gemm uses exactly its own cores: pdo keeps
// OpenBLAS at one thread (this program raises it for its 2-thread anchor and lowers it after).
// The order of the variants (2 places, 2 places B^T, OpenBLAS 2 threads, pdo 1 place, pdo 1
// place of 2 cores, OpenBLAS 1 thread, and round again) puts a one-core run after each run
// that leaves a spinning thread: after OpenBLAS's 2-thread run, whose idle worker spins for
// a while, and after the 2-core place, whose OpenMP team does (a 2-place run there measured
// 0.90-0.93 of itself elsewhere in the order). Results are checked once, exactly (integer inputs), before
// timing; the exit status is 1 when one is wrong.
#include "bench_common.hpp"

#include <cblas.h>
#include <pdo/pdo.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using rows = pdo::layout<pdo::split<"x">, pdo::replicate>;
using whole = pdo::layout<pdo::replicate, pdo::replicate>;

/// @brief Small integers: every partial sum is an integer below 2^24, so any order of the
/// K-sum gives the same bits and results compare exactly.
float a_at(std::size_t i, std::size_t k) { return static_cast<float>((i * 3 + k) % 7) - 3.0f; }
float b_at(std::size_t k, std::size_t j) { return static_cast<float>((k + 2 * j) % 5) - 2.0f; }

void blas_sgemm(int threads, std::size_t n, const float* a, const float* b, float* c) {
  openblas_set_num_threads(threads);
  const int N = static_cast<int>(n);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, N, N, 1.0f, a, N, b, N, 0.0f, c, N);
  openblas_set_num_threads(1);
}

/// @brief Elements of `got` that differ from `want`; prints the first.
std::size_t mismatches(const char* what, const float* got, const float* want, std::size_t count) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < count; ++i)
    if (got[i] != want[i] && bad++ == 0) std::printf("WRONG: %s: element %zu is %g, want %g\n", what, i, got[i], want[i]);
  return bad;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 2048;
  const int samples = argc > 2 ? std::max(1, std::atoi(argv[2])) : 21;
  if (n < 2 || n > 8192) throw std::invalid_argument("n: need 2 <= n <= 8192");
  const std::vector<int> cores = pdo::detail::process_cores();

  pdo::tensor<float, 2> a({n, n}), b({n, n}), bt({n, n}), c({n, n});
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t k = 0; k < n; ++k) {
      a(i, k) = a_at(i, k);
      b(i, k) = b_at(i, k);
      bt(k, i) = b_at(i, k);
    }

  const auto mesh1 = pdo::make_mesh<"x">(std::vector<pdo::cpu_place>{pdo::cpu_place(0, {cores.front()})});
  const auto mesh2 = pdo::make_mesh<"x">(pdo::cpu_places(2));
  const auto mesh_wide = pdo::make_mesh<"x">(pdo::cpu_places(1));  // one place, every core
  const auto xw = pdo::distribute<rows>(mesh_wide, a);
  const auto ww = pdo::distribute<whole>(mesh_wide, b);
  const auto x1 = pdo::distribute<rows>(mesh1, a);
  const auto w1 = pdo::distribute<whole>(mesh1, b);
  const auto x2 = pdo::distribute<rows>(mesh2, a);
  const auto w2 = pdo::distribute<whole>(mesh2, b);
  const auto wt2 = pdo::distribute<whole>(mesh2, bt);

  std::printf("# C = A * B, float32, n = %zu (%.1f GFLOP per product), %d samples, median\n", n,
              2.0 * static_cast<double>(n * n) * static_cast<double>(n) / 1e9, samples);
  std::printf("# OpenBLAS %s, core %s; cores of this process: %zu; pdo 2 places: %s, %s\n", openblas_get_config(),
              openblas_get_corename(), cores.size(), mesh2.place(0).name().c_str(), mesh2.place(1).name().c_str());
  std::string plan = pdo::explain(pdo::matmul(x2, w2));
  for (std::size_t at = 0; (at = plan.find('\n', at)) != std::string::npos && at + 1 < plan.size(); at += 3)
    plan.replace(at, 1, "\n# ");
  std::printf("# %s", plan.c_str());

  // Checks: OpenBLAS (1 thread) against direct dot products on a few elements, then every
  // other variant against OpenBLAS element by element.
  std::size_t bad = 0;
  blas_sgemm(1, n, a.data(), b.data(), c.data());
  for (std::size_t i : {std::size_t{0}, n / 3, n - 1})
    for (std::size_t j : {std::size_t{0}, n / 2 + 1, n - 1}) {
      double want = 0;
      for (std::size_t k = 0; k < n; ++k) want += static_cast<double>(a_at(i, k)) * b_at(k, j);
      if (c(i, j) != static_cast<float>(want) && bad++ == 0)
        std::printf("WRONG: OpenBLAS 1 thread: C(%zu, %zu) is %g, want %g\n", i, j, c(i, j), want);
    }
  {
    pdo::tensor<float, 2> c2({n, n});
    blas_sgemm(2, n, a.data(), b.data(), c2.data());
    bad += mismatches("OpenBLAS 2 threads", c2.data(), c.data(), n * n);
  }
  bad += mismatches("pdo 1 place", pdo::gather(pdo::eval(pdo::matmul(x1, w1))).data(), c.data(), n * n);
  bad += mismatches("pdo 2 places", pdo::gather(pdo::eval(pdo::matmul(x2, w2))).data(), c.data(), n * n);
  bad += mismatches("pdo 1 place, 2 cores", pdo::gather(pdo::eval(pdo::matmul(xw, ww))).data(), c.data(), n * n);
  bad += mismatches("pdo 2 places, B stored transposed", pdo::gather(pdo::eval(pdo::matmul(x2, pdo::transpose(wt2)))).data(),
                    c.data(), n * n);

  const auto s = bench::interleaved_medians(
      samples, bench::per_call([&] { (void)pdo::eval(pdo::matmul(x2, w2)); }),
      bench::per_call([&] { (void)pdo::eval(pdo::matmul(x2, pdo::transpose(wt2))); }),
      bench::per_call([&] { blas_sgemm(2, n, a.data(), b.data(), c.data()); }),
      bench::per_call([&] { (void)pdo::eval(pdo::matmul(x1, w1)); }),
      bench::per_call([&] { (void)pdo::eval(pdo::matmul(xw, ww)); }),
      bench::per_call([&] { blas_sgemm(1, n, a.data(), b.data(), c.data()); }));
  enum { pdo2, pdo2t, blas2, pdo1, pdo_wide, blas1, count };
  const char* names[count] = {"pdo 2 places (1 core each)", "pdo 2 places, B^T stored", "OpenBLAS, 2 threads",
                              "pdo 1 place (1 core)", "pdo 1 place (2 cores)", "OpenBLAS, 1 thread"};
  const double flop = 2.0 * static_cast<double>(n * n) * static_cast<double>(n);
  double gf[count];
  for (int v = 0; v < count; ++v) gf[v] = flop / s[v] / 1e9;
  std::printf("%-28s | %9s | %8s\n", "variant", "ms", "GFLOP/s");
  for (int v : {pdo1, pdo2, pdo_wide, pdo2t, blas1, blas2}) std::printf("%-28s | %9.2f | %8.1f\n", names[v], s[v] * 1e3, gf[v]);
  std::printf("%-28s | %8s | %-28s | %8s | %5s\n", "pdo", "GFLOP/s", "anchor (same run)", "GFLOP/s", "ratio");
  auto ratio = [&](int p, int anchor) {
    std::printf("%-28s | %8.1f | %-28s | %8.1f | %5.2f\n", names[p], gf[p], names[anchor], gf[anchor], gf[p] / gf[anchor]);
  };
  ratio(pdo1, blas1);
  ratio(pdo2, pdo1);
  ratio(pdo2, blas2);
  ratio(pdo_wide, blas2);
  ratio(pdo2t, pdo2);
  ratio(blas2, blas1);
  std::printf("summary: n=%zu pdo 1 place %.1f GFLOP/s (%.2f of OpenBLAS 1 thread), 2 places %.1f GFLOP/s: "
              "speedup %.2f over 1 place (target >= 1.8), %.2f of OpenBLAS 2 threads%s\n",
              n, gf[pdo1], gf[pdo1] / gf[blas1], gf[pdo2], gf[pdo2] / gf[pdo1], gf[pdo2] / gf[blas2],
              bad ? "; WRONG results" : "");
  return bad ? 1 : 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_matmul: %s\n", e.what());
  return 1;
}
