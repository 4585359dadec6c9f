// benchmarks/redistribute.cpp: redistributions of a float matrix between rows, columns and
// replicated on a line of places, against the copy each place cannot avoid, in one run.
//
// Usage: bench_redistribute [samples=5] [bytes=64M] [places=2]
//
// The anchor of each redistribution: every place at once, on its own thread, copies as many
// bytes as its new shard holds (std::memcpy between two buffers of its own), the least memory
// traffic any way of making that shard takes. ratio = anchor time / pdo's time (1: pdo moves
// the data at the speed of a plain copy). pdo's time is that of the call pdo::redistribute
// from the host, its dispatch to the places included; each figure is a median of samples.
// Each place's peak memory is printed in shards: input, output and any buffer the step holds.
#include "bench_common.hpp"

#include <pdo/pdo.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

namespace {

using rows = pdo::layout<pdo::split<"x">, pdo::replicate>;
using cols = pdo::layout<pdo::replicate, pdo::split<"x">>;
using whole = pdo::layout<pdo::replicate, pdo::replicate>;

/// @brief Seconds per step when every place of `m` copies `bytes` between two buffers of its own at once.
auto anchor(const pdo::mesh<"x">& m, std::size_t bytes) {
  const std::size_t n = m.local_places().size(), count = (bytes + sizeof(float) - 1) / sizeof(float);
  auto from = std::make_shared<std::vector<bench::buffer>>(n), to = std::make_shared<std::vector<bench::buffer>>(n);
  pdo::detail::run_on_places("bench_redistribute: allocate", m, [&](std::size_t, std::size_t k) {
    (*from)[k] = bench::make_buffer(count);
    (*to)[k] = bench::make_buffer(count);
    std::fill_n((*from)[k].get(), count, 1.0f);
    std::fill_n((*to)[k].get(), count, 0.0f);
  });
  return bench::per_call([&m, from, to, count] {
    pdo::detail::run_on_places("bench_redistribute: copy", m, [&](std::size_t, std::size_t k) {
      std::memcpy((*to)[k].get(), (*from)[k].get(), count * sizeof(float));
    });
  });
}

/// @brief Times redistribute<To> of `x` beside its anchor and prints a row; false when the
/// result differs from the host matrix.
template <class To, class X>
bool measure(const char* what, const X& x, const pdo::tensor<float, 2>& host, int samples) {
  const auto& m = x.mesh();
  auto& memory = m.place(0).memory();
  const std::size_t before = memory.stats().bytes_in_use;
  memory.reset_peak();
  std::size_t out_bytes = 0;
  const bool same = [&] {
    const auto y = pdo::redistribute<To>(x);
    out_bytes = y.local_shards()[0].bytes();
    const auto back = pdo::gather(y);
    return std::equal(back.begin(), back.end(), host.begin());
  }();
  const std::size_t peak = memory.stats().peak_bytes_in_use - before;
  const auto medians = bench::interleaved_medians(samples, anchor(m, out_bytes), bench::per_call([&x] {
                                                    const auto y = pdo::redistribute<To>(x);
                                                    bench::clobber_memory();
                                                  }));
  const auto shard = static_cast<double>(x.local_shards()[0].bytes());
  std::printf("  %-22s | %9.2f %8.2f | %9.2f | %6.3f | %5.2f%s\n", what, medians[1] * 1e3, bench::gbps(out_bytes, medians[1]),
              medians[0] * 1e3, medians[0] / medians[1], (static_cast<double>(peak) + shard) / shard, same ? "" : "  WRONG");
  std::fflush(stdout);
  return same;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int samples = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
    const std::size_t bytes = argc > 2 ? bench::parse_bytes(argv[2]) : std::size_t{64} << 20;
    const std::size_t places = argc > 3 ? std::max<std::size_t>(1, std::strtoull(argv[3], nullptr, 10)) : 2;
    const auto side = static_cast<std::size_t>(std::sqrt(static_cast<double>(bytes / sizeof(float))));
    pdo::tensor<float, 2> host({side, side});
    for (std::size_t i = 0; i < host.size(); ++i) host.data()[i] = static_cast<float>(i % 4099);
    const auto m = pdo::make_mesh<"x">(pdo::cpu_places(places));
    std::printf("# pdo redistribute of f32[%zu, %zu] (%s) over %zu places on %zu cores, samples=%d\n", side, side,
                bench::size_text(host.bytes()).c_str(), places, pdo::detail::process_cores().size(), samples);
    std::printf("# anchor: every place copies its new shard's bytes at once (memcpy between its own buffers)\n");
    std::printf("# %-22s | %9s %8s | %9s | %6s | %s\n", "redistribution", "pdo ms", "GB/s", "anchor ms", "ratio", "peak shards");
    const auto by_rows = pdo::distribute<rows>(m, host);
    const auto by_cols = pdo::distribute<cols>(m, host);
    bool ok = measure<cols>("rows -> columns", by_rows, host, samples);
    ok = measure<rows>("columns -> rows", by_cols, host, samples) && ok;
    ok = measure<whole>("rows -> replicated", by_rows, host, samples) && ok;
    ok = measure<whole>("columns -> replicated", by_cols, host, samples) && ok;
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_redistribute: %s\n", e.what());
    return 1;
  }
}
