// benchmarks/allreduce_mpi.cpp: MPI-backend all_reduce against calling MPI_Allreduce directly, in one run.
//
// Usage: mpirun -np 2 bench_allreduce_mpi [samples=5] [min_bytes=4K] [max_bytes=256M]
//
// One place per process (pdo::mpi::world_places(1)); each all_reduces its own buffer
// of `size` bytes (float32, sum, in place). The anchor is MPI_Allreduce(MPI_IN_PLACE)
// on MPI_COMM_WORLD over the same buffer, run by the same place thread in the same loop:
// MPI_Barrier, K calls, then the slowest rank's time. Samples of the two alternate.
// nccl-tests conventions: algbw = size / time, busbw = algbw * 2(n-1)/n.
// Only rank 0 prints.
#include "bench_common.hpp"

#include <pdo/pdo.hpp>

#include <mpi.h>

#include <climits>
#include <cstdio>
#include <exception>
#include <span>
#include <stdexcept>
#include <vector>

namespace {

/// @brief What one run shares: the mesh of one place per process and this process's
/// buffer, first written by its place.
struct bench_state {
  explicit bench_state(std::size_t max_count) : mesh(pdo::make_mesh<"x">(pdo::mpi::world_places(1))) {
    pdo::detail::run_on_places("bench_allreduce_mpi: allocate", mesh, [&](std::size_t, std::size_t) {
      data = bench::make_buffer(max_count);
      std::fill_n(data.get(), max_count, 0.0f);
    });
  }

  pdo::mesh<"x"> mesh;
  bench::buffer data;
};

/// @brief pdo's all_reduce over the first `count` floats: `make(place)` gives the step.
auto pdo_step(bench_state& s, std::size_t count) {
  return [&s, count](std::size_t place) {
    return [comm = pdo::communicator_of(s.mesh, place), data = std::span<float>(s.data.get(), count)] {
      comm.all_reduce(data, pdo::reduce_op::sum);
    };
  };
}

/// @brief MPI_Allreduce in place on MPI_COMM_WORLD over the first `count` floats.
auto mpi_step(bench_state& s, std::size_t count) {
  return [&s, count](std::size_t) {
    return [data = s.data.get(), n = static_cast<int>(count)] {
      MPI_Allreduce(MPI_IN_PLACE, data, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    };
  };
}

/// @brief Seconds per step of `iters` steps from a common start (MPI_Barrier), the
/// slowest rank's, identical on every rank (so all ranks calibrate alike).
template <class MakeStep>
double seconds_per_step(bench_state& s, long iters, const MakeStep& make_step) {
  double seconds = 0;
  pdo::detail::run_on_places("bench_allreduce_mpi", s.mesh, [&](std::size_t place, std::size_t) {
    auto step = make_step(place);
    MPI_Barrier(MPI_COMM_WORLD);
    const auto start = bench::steady::now();
    for (long i = 0; i < iters; ++i) step();
    const double mine = bench::seconds_since(start) / static_cast<double>(iters);
    MPI_Allreduce(&mine, &seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  });
  return seconds;
}

/// @brief One step on the check pattern; true on every rank when every rank's buffer
/// then holds the sum. Leaves the buffer zeroed: repeated in-place sums of anything
/// else overflow.
template <class MakeStep>
bool verify(bench_state& s, std::size_t count, const MakeStep& make_step) {
  int all_ok = 0;
  pdo::detail::run_on_places("bench_allreduce_mpi: check", s.mesh, [&](std::size_t place, std::size_t) {
    const std::span<float> data(s.data.get(), count);
    bench::fill_pattern(data, place);
    make_step(place)();
    const int ok = bench::holds_sum(data, s.mesh.size()) ? 1 : 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    std::fill(data.begin(), data.end(), 0.0f);
  });
  return all_ok != 0;
}

/// @brief The figures of one message size: median seconds per call.
struct row {
  std::size_t bytes = 0;
  double pdo = 0, mpi = 0;
  bool pdo_ok = false, mpi_ok = false;
  [[nodiscard]] double overhead() const { return (pdo - mpi) / mpi; }
};

/// @brief Checks pdo and MPI_Allreduce at `bytes`, then times both.
row measure(bench_state& s, const bench::options& o, std::size_t bytes) {
  const std::size_t count = bytes / sizeof(float);
  const auto pdo = pdo_step(s, count);
  const auto mpi = mpi_step(s, count);
  row r{.bytes = bytes, .pdo_ok = verify(s, count, pdo), .mpi_ok = verify(s, count, mpi)};
  auto timer = [&s](const auto& make_step) {
    return [&s, &make_step](long iters) { return seconds_per_step(s, iters, make_step); };
  };
  const auto medians = bench::interleaved_medians(o.samples, timer(mpi), timer(pdo));
  r.mpi = medians[0];
  r.pdo = medians[1];
  return r;
}

/// @brief What the run measures, with the MPI library's name, and the column heads.
void print_header(const bench::options& o, std::size_t ranks) {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(version, &length);
  std::printf("# pdo MPI-backend all_reduce, float32 sum in place, %zu ranks x 1 place, samples=%d\n", ranks,
              o.samples);
  std::printf("# anchor: MPI_Allreduce(MPI_IN_PLACE) on MPI_COMM_WORLD, %.*s\n", std::min(length, 60), version);
  std::printf("# %9s | %10s %8s | %10s %8s | %8s\n", "size", "pdo us", "busbw", "MPI us", "busbw", "overhead");
}

/// @brief One size's figures; `n` is the number of ranks.
void print_row(const row& r, std::size_t n) {
  const double f = bench::bus_factor(n);
  std::printf("  %9s | %10.2f %8.2f | %10.2f %8.2f | %7.2f%%%s%s\n", bench::size_text(r.bytes).c_str(),
              r.pdo * 1e6, f * bench::gbps(r.bytes, r.pdo), r.mpi * 1e6, f * bench::gbps(r.bytes, r.mpi),
              100 * r.overhead(), r.pdo_ok ? "" : "  WRONG", r.mpi_ok ? "" : "  WRONG (anchor)");
  std::fflush(stdout);
}

/// @brief The 64 MiB figures (or the nearest size measured) and the worst overhead at
/// 1 MiB and above, where the target applies.
void print_summary(const std::vector<row>& rows, const std::vector<std::size_t>& sizes, std::size_t n) {
  const std::size_t b = bench::pick_size(sizes, std::size_t{64} << 20);
  const row big = *std::find_if(rows.begin(), rows.end(), [&](const row& r) { return r.bytes == b; });
  const row* worst = nullptr;
  for (const row& r : rows)
    if (r.bytes >= (std::size_t{1} << 20) && (!worst || r.overhead() > worst->overhead())) worst = &r;
  const double f = bench::bus_factor(n);
  std::printf("summary: %s busbw pdo %.2f GB/s, anchor %.2f GB/s, ratio %.3f, overhead %.2f%%",
              bench::size_text(b).c_str(), f * bench::gbps(b, big.pdo), f * bench::gbps(b, big.mpi), big.mpi / big.pdo,
              100 * big.overhead());
  if (worst)
    std::printf("; worst overhead >= 1 MiB %.2f%% at %s (target <= 3%%)", 100 * worst->overhead(),
                bench::size_text(worst->bytes).c_str());
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const bench::options o = bench::parse_options(argc, argv);
    const std::vector<std::size_t> sizes = bench::message_sizes(o);
    if (sizes.back() / sizeof(float) > static_cast<std::size_t>(INT_MAX))
      throw std::invalid_argument("max_bytes: more floats than MPI's int count holds");
    bench_state s(sizes.back() / sizeof(float));
    const bool printer = pdo::mpi::rank() == 0;
    const std::size_t ranks = s.mesh.size();
    if (printer) print_header(o, ranks);
    std::vector<row> rows;
    for (std::size_t bytes : sizes) {
      rows.push_back(measure(s, o, bytes));
      if (printer) print_row(rows.back(), ranks);
    }
    if (printer) print_summary(rows, sizes, ranks);
    const bool all_ok = std::all_of(rows.begin(), rows.end(), [](const row& r) { return r.pdo_ok && r.mpi_ok; });
    return all_ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_allreduce_mpi: %s\n", e.what());
    int started = 0;
    MPI_Initialized(&started);
    if (started) MPI_Abort(MPI_COMM_WORLD, 1);  // the other ranks would wait in a collective
    return 1;
  }
}
