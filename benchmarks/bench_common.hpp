// benchmarks/bench_common.hpp: what the all_reduce benchmarks share: options, buffers, calibration, medians.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace bench {

using steady = std::chrono::steady_clock;

/// @brief Seconds from `start` to now.
inline double seconds_since(steady::time_point start) {
  return std::chrono::duration<double>(steady::now() - start).count();
}

/// @brief Settings from the command line: `[samples] [min_bytes] [max_bytes] [places]`.
struct options {
  int samples = 5;
  std::size_t min_bytes = std::size_t{4} << 10;
  std::size_t max_bytes = std::size_t{256} << 20;
  std::size_t places = 2;
};

/// @brief A byte count: digits with an optional K, M or G suffix (powers of 1024).
inline std::size_t parse_bytes(const char* text) {
  char* end = nullptr;
  std::size_t value = std::strtoull(text, &end, 10);
  switch (*end) {
    case 'k': case 'K': return value << 10;
    case 'm': case 'M': return value << 20;
    case 'g': case 'G': return value << 30;
    case '\0': return value;
    default: throw std::invalid_argument(std::string("not a byte count: ") + text + " (try 4096, 4K or 64M)");
  }
}

/// @brief Reads the options; an argument left out keeps its default.
inline options parse_options(int argc, char** argv, options defaults = {}) {
  options o = defaults;
  if (argc > 1) o.samples = std::max(1, std::atoi(argv[1]));
  if (argc > 2) o.min_bytes = parse_bytes(argv[2]);
  if (argc > 3) o.max_bytes = parse_bytes(argv[3]);
  if (argc > 4) o.places = std::max<std::size_t>(1, std::strtoull(argv[4], nullptr, 10));
  if (o.min_bytes < sizeof(float) || o.max_bytes < o.min_bytes)
    throw std::invalid_argument("message sizes: need 4 <= min_bytes <= max_bytes");
  return o;
}

/// @brief The message sizes of a run: min_bytes, doubling, up to max_bytes.
inline std::vector<std::size_t> message_sizes(const options& o) {
  std::vector<std::size_t> sizes;
  for (std::size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) sizes.push_back(bytes);
  return sizes;
}

/// @brief "4 KiB", "64 MiB", or "1000 B" when not a whole number of KiB.
inline std::string size_text(std::size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (u < 3 && bytes >= 1024 && bytes % 1024 == 0) {
    bytes /= 1024;
    ++u;
  }
  return std::to_string(bytes) + " " + units[u];
}

/// @brief Which of `sizes` the summary reports: `wanted` when measured, else the nearest end.
inline std::size_t pick_size(const std::vector<std::size_t>& sizes, std::size_t wanted) {
  if (std::find(sizes.begin(), sizes.end(), wanted) != sizes.end()) return wanted;
  return wanted > sizes.back() ? sizes.back() : sizes.front();
}

/// @brief Gigabytes per second for `bytes` in `seconds`.
inline double gbps(std::size_t bytes, double seconds) { return static_cast<double>(bytes) / seconds / 1e9; }

/// @brief busbw / algbw of all_reduce over `n` members (nccl-tests: 2(n-1)/n).
inline double bus_factor(std::size_t n) { return 2.0 * static_cast<double>(n - 1) / static_cast<double>(n); }

/// @brief Frees what std::aligned_alloc returned.
struct free_deleter {
  void operator()(float* p) const noexcept { std::free(p); }
};
using buffer = std::unique_ptr<float[], free_deleter>;

/// @brief Room for `count` floats on a cache-line boundary, untouched: the thread that
/// writes it first decides where its pages live, so let each place write its own.
inline buffer make_buffer(std::size_t count) {
  const std::size_t bytes = std::max<std::size_t>(64, (count * sizeof(float) + 63) / 64 * 64);
  auto* p = static_cast<float*>(std::aligned_alloc(64, bytes));
  if (p == nullptr) throw std::bad_alloc();
  return buffer(p);
}

/// @brief Member `rank`'s input for the result check: small integers, exact in float.
inline void fill_pattern(std::span<float> data, std::size_t rank) {
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(rank + 1 + i % 8);
}

/// @brief True when `data` holds the sum over `n` members of their fill_pattern inputs.
inline bool holds_sum(std::span<const float> data, std::size_t n) {
  for (std::size_t i = 0; i < data.size(); ++i)
    if (data[i] != static_cast<float>(n * (n + 1) / 2 + n * (i % 8))) return false;
  return true;
}

/// @brief Keeps the compiler from dropping or merging writes across this point, so a
/// memcpy repeated onto the same bytes is done every time.
inline void clobber_memory() {
#if defined(__GNUC__)
  asm volatile("" ::: "memory");
#endif
}

/// @brief Seconds one sample lasts: long enough to average out wake-ups and timer
/// noise, short enough to sweep 17 sizes with several samples in a couple of minutes.
inline constexpr double sample_seconds = 0.075;

/// @brief Iterations per sample so that a sample lasts about sample_seconds, found by
/// doubling from one until a trial lasts a quarter of that (a single short trial is
/// dominated by wake-up noise). `time(iters)` returns seconds per iteration.
template <class Time>
long calibrate(const Time& time) {
  constexpr long most = 10'000'000;
  for (long iters = 1; iters < most; iters *= 2) {
    const double total = time(iters) * static_cast<double>(iters);
    if (total >= sample_seconds / 4)
      return std::clamp(static_cast<long>(sample_seconds / total * static_cast<double>(iters)), 1L, most);
  }
  return most;
}

/// @brief The median of `values` (the mean of the middle two for an even count).
inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

/// @brief Median seconds per iteration of each timer, each calibrated on its own, over
/// `samples` samples taken in turn (0, 1, ..., 0, 1, ...) so that drift in the
/// machine's speed (other jobs, frequency) falls on all of them alike.
template <class... Time>
std::array<double, sizeof...(Time)> interleaved_medians(int samples, const Time&... time) {
  const std::array<long, sizeof...(Time)> iters{calibrate(time)...};
  std::array<std::vector<double>, sizeof...(Time)> seconds;
  for (int k = 0; k < samples; ++k) {
    std::size_t i = 0;
    ((seconds[i].push_back(time(iters[i])), ++i), ...);
  }
  std::array<double, sizeof...(Time)> medians{};
  for (std::size_t i = 0; i < medians.size(); ++i) medians[i] = median(seconds[i]);
  return medians;
}

/// @brief A timer for calibrate-and-sample loops: seconds per call of `f` over `iters` calls.
template <class F>
auto per_call(F f) {
  return [f](long iters) {
    const auto start = steady::now();
    for (long k = 0; k < iters; ++k) f();
    clobber_memory();
    return seconds_since(start) / static_cast<double>(iters);
  };
}

}  // namespace bench
