// benchmarks/allreduce.cpp: threads-backend all_reduce against a naive in-process reference and memcpy, in one run.
//
// Usage: bench_allreduce [samples=5] [min_bytes=4K] [max_bytes=256M] [places=2]
//
// Every place all_reduces its own buffer of `size` bytes (float32, sum, in place).
// nccl-tests conventions: algbw = size / time, busbw = algbw * 2(n-1)/n.
// The anchor runs on the same place threads: each place sums its slice of every
// buffer and writes the sum back into that slice of every buffer, then a spinning
// barrier: n reads and n writes of the buffer in all, the memory-traffic limit.
// Times are taken inside the places (place 0's steady_clock around K calls), so the
// dispatch of run_on_places is not counted; each figure is a median of samples.
#include "bench_common.hpp"

#include <pdo/pdo.hpp>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <span>
#include <thread>
#include <utility>
#include <vector>

namespace {

/// @brief Tells the core that this is a spin-wait (it saves power and frees the other
/// hardware thread of the core).
void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/// @brief The reference's barrier: a generation counter that waiters spin on, yielding
/// after a while so that it still works with more places than cores.
class spin_barrier {
 public:
  explicit spin_barrier(std::size_t count) : count_(count) {}

  void arrive_and_wait() {
    const std::uint64_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spin = 0; generation_.load(std::memory_order_acquire) == generation; ++spin)
      if (spin < 20000) spin_pause();
      else std::this_thread::yield();
  }

 private:
  const std::size_t count_;
  std::atomic<std::size_t> arrived_{0};
  std::atomic<std::uint64_t> generation_{0};
};

/// @brief The part [lo, hi) of `count` elements that place `me` of `n` works on, cut at
/// 16 floats (64 bytes), so no two places write the same cache line.
std::pair<std::size_t, std::size_t> slice_of(std::size_t count, std::size_t n, std::size_t me) {
  const std::size_t lines = (count + 15) / 16;
  return {std::min(count, lines * me / n * 16), std::min(count, lines * (me + 1) / n * 16)};
}

/// @brief a[i] = b[i] = a[i] + b[i] on [lo, hi): one pass, two reads and two writes.
void sum_into_both(float* __restrict a, float* __restrict b, std::size_t lo, std::size_t hi) {
  for (std::size_t i = lo; i < hi; ++i) {
    const float sum = a[i] + b[i];
    a[i] = sum;
    b[i] = sum;
  }
}

/// @brief Place `me`'s share of the reference all_reduce over `buffers`, in place. Only
/// the two-place case is vectorised; three places or more take a plain loop.
void naive_share(std::span<float* const> buffers, std::size_t count, std::size_t me) {
  const auto [lo, hi] = slice_of(count, buffers.size(), me);
  if (buffers.size() == 1) return;  // the sum over one member is its own buffer
  if (buffers.size() == 2) return sum_into_both(buffers[0], buffers[1], lo, hi);
  for (std::size_t i = lo; i < hi; ++i) {
    float sum = buffers[0][i];
    for (std::size_t k = 1; k < buffers.size(); ++k) sum += buffers[k][i];
    for (float* b : buffers) b[i] = sum;
  }
}

/// @brief What one run shares: the mesh, one buffer per place (first written by its
/// own place), place 0's memcpy target, and the reference's barrier (also the start line
/// of every timed loop).
struct bench_state {
  bench_state(std::size_t places, std::size_t max_count)
      : mesh(pdo::make_mesh<"x">(pdo::cpu_places(places))), buffers(places), pointers(places), barrier(places) {
    pdo::detail::run_on_places("bench_allreduce: allocate", mesh, [&](std::size_t place, std::size_t) {
      buffers[place] = bench::make_buffer(max_count);
      std::fill_n(buffers[place].get(), max_count, 0.0f);
      pointers[place] = buffers[place].get();
      if (place != 0) return;
      scratch = bench::make_buffer(max_count);
      std::fill_n(scratch.get(), max_count, 0.0f);
    });
  }

  pdo::mesh<"x"> mesh;
  std::vector<bench::buffer> buffers;
  std::vector<float*> pointers;
  bench::buffer scratch;
  spin_barrier barrier;
};

/// @brief pdo's all_reduce over the first `count` floats: `make(place)` gives that place's step.
auto pdo_step(bench_state& s, std::size_t count) {
  return [&s, count](std::size_t place) {
    return [comm = pdo::communicator_of(s.mesh, place), data = std::span<float>(s.buffers[place].get(), count)] {
      comm.all_reduce(data, pdo::reduce_op::sum);
    };
  };
}

/// @brief The reference all_reduce over the first `count` floats, ending in a barrier.
auto naive_step(bench_state& s, std::size_t count) {
  return [&s, count](std::size_t place) {
    return [&s, count, place] {
      naive_share(s.pointers, count, place);
      s.barrier.arrive_and_wait();
    };
  };
}

/// @brief One std::memcpy of `count` floats by place 0; the other places idle.
auto memcpy_step(bench_state& s, std::size_t count) {
  return [&s, count](std::size_t place) {
    return [&s, count, place] {
      if (place != 0) return;
      std::memcpy(s.scratch.get(), s.buffers[0].get(), count * sizeof(float));
      bench::clobber_memory();
    };
  };
}

/// @brief Seconds per step when every place runs `iters` steps at once, measured by
/// place 0 from a common start. A step ends in a barrier (or is place 0's alone), so
/// place 0's clock stops when all places are done.
template <class MakeStep>
double seconds_per_step(bench_state& s, long iters, const MakeStep& make_step) {
  double seconds = 0;
  pdo::detail::run_on_places("bench_allreduce", s.mesh, [&](std::size_t place, std::size_t) {
    auto step = make_step(place);
    s.barrier.arrive_and_wait();
    const auto start = bench::steady::now();
    for (long i = 0; i < iters; ++i) step();
    if (place == 0) seconds = bench::seconds_since(start) / static_cast<double>(iters);
  });
  return seconds;
}

/// @brief One step on the check pattern; true when every place's buffer then holds the
/// sum. Leaves the buffers zeroed: repeated in-place sums of anything else overflow.
template <class MakeStep>
bool verify(bench_state& s, std::size_t count, const MakeStep& make_step) {
  std::atomic<bool> ok{true};
  pdo::detail::run_on_places("bench_allreduce: check", s.mesh, [&](std::size_t place, std::size_t) {
    const std::span<float> data(s.buffers[place].get(), count);
    bench::fill_pattern(data, place);
    auto step = make_step(place);
    s.barrier.arrive_and_wait();
    step();
    if (!bench::holds_sum(data, s.buffers.size())) ok.store(false);
    std::fill(data.begin(), data.end(), 0.0f);
  });
  return ok.load();
}

/// @brief The figures of one message size: median seconds per call.
struct row {
  std::size_t bytes = 0;
  double pdo = 0, naive = 0, copy = 0;
  bool pdo_ok = false, naive_ok = false;
};

/// @brief Checks pdo and the reference at `bytes`, then times pdo, the reference and memcpy.
row measure(bench_state& s, const bench::options& o, std::size_t bytes) {
  const std::size_t count = bytes / sizeof(float);
  const auto pdo = pdo_step(s, count);
  const auto naive = naive_step(s, count);
  const auto copy = memcpy_step(s, count);
  row r{.bytes = bytes, .pdo_ok = verify(s, count, pdo), .naive_ok = verify(s, count, naive)};
  auto timer = [&s](const auto& make_step) {
    return [&s, &make_step](long iters) { return seconds_per_step(s, iters, make_step); };
  };
  const auto medians = bench::interleaved_medians(o.samples, timer(naive), timer(pdo), timer(copy));
  r.naive = medians[0];
  r.pdo = medians[1];
  r.copy = medians[2];
  return r;
}

/// @brief What the run measures, and the column heads.
void print_header(const bench::options& o) {
  std::printf("# pdo threads all_reduce, float32 sum in place, %zu places on %zu cores, samples=%d\n", o.places,
              pdo::detail::process_cores().size(), o.samples);
  std::printf("# anchor: naive in-place all_reduce on the same place threads (the memory-traffic limit)%s\n",
              o.places == 2 ? "" : "; vectorised only for 2 places");
  std::printf("# copy-rate busbw: the busbw if the all_reduce's 2n buffer passes ran at 1-thread memcpy speed\n");
  std::printf("# %9s | %10s %8s %8s | %10s %8s | %6s | %11s %15s\n", "size", "pdo us", "algbw", "busbw", "anchor us",
              "busbw", "ratio", "memcpy GB/s", "copy-rate busbw");
}

/// @brief One size's figures; `n` is the number of places.
void print_row(const row& r, std::size_t n) {
  const double f = bench::bus_factor(n), copy = bench::gbps(r.bytes, r.copy);
  std::printf("  %9s | %10.2f %8.2f %8.2f | %10.2f %8.2f | %6.3f | %11.2f %15.2f%s%s\n",
              bench::size_text(r.bytes).c_str(), r.pdo * 1e6, bench::gbps(r.bytes, r.pdo),
              f * bench::gbps(r.bytes, r.pdo), r.naive * 1e6, f * bench::gbps(r.bytes, r.naive), r.naive / r.pdo, copy,
              copy / static_cast<double>(n) * f, r.pdo_ok ? "" : "  WRONG", r.naive_ok ? "" : "  WRONG (anchor)");
  std::fflush(stdout);
}

/// @brief The figures the targets are about: 64 MiB bandwidth and 4 KiB latency
/// (or the nearest sizes measured).
void print_summary(const std::vector<row>& rows, const std::vector<std::size_t>& sizes, std::size_t n) {
  auto at = [&](std::size_t bytes) {
    const std::size_t b = bench::pick_size(sizes, bytes);
    return *std::find_if(rows.begin(), rows.end(), [&](const row& r) { return r.bytes == b; });
  };
  const row big = at(std::size_t{64} << 20), small = at(std::size_t{4} << 10);
  const double f = bench::bus_factor(n);
  std::printf("summary: %s busbw pdo %.2f GB/s, anchor %.2f GB/s, ratio %.3f (target >= 0.90); "
              "%s latency pdo %.2f us, anchor %.2f us (target <= 1 us)\n",
              bench::size_text(big.bytes).c_str(), f * bench::gbps(big.bytes, big.pdo),
              f * bench::gbps(big.bytes, big.naive), big.naive / big.pdo, bench::size_text(small.bytes).c_str(),
              small.pdo * 1e6, small.naive * 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const bench::options o = bench::parse_options(argc, argv);
    const std::vector<std::size_t> sizes = bench::message_sizes(o);
    bench_state s(o.places, sizes.back() / sizeof(float));
    print_header(o);
    std::vector<row> rows;
    for (std::size_t bytes : sizes) {
      rows.push_back(measure(s, o, bytes));
      print_row(rows.back(), o.places);
    }
    print_summary(rows, sizes, o.places);
    const bool all_ok = std::all_of(rows.begin(), rows.end(), [](const row& r) { return r.pdo_ok && r.naive_ok; });
    return all_ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_allreduce: %s\n", e.what());
    return 1;
  }
}
