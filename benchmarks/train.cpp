// benchmarks/train.cpp: data-parallel training step of an MLP 1024-4096-4096-10 (float32,
// cross-entropy, SGD), global batch 256: on 1 place and on 2 places (strong scaling: the
// same global batch; weak scaling: 256 rows per place), the fraction of the gradient
// all_reduce hidden behind backward, and the step with the all_reduce after backward.
//
// Anchor, measured in the same run: OpenBLAS's sgemm on the step's eight matrix products
// (each layer's forward product and weight gradient, and the input gradients of the second
// and third layers: the batch, the first layer's input, needs none) with the cores of one place; "sgemm-only
// step" is the time those products alone take, and the ratio printed is that time over
// the step's (1.00 would be a step that costs nothing but its gemms). For 2 places the
// limit is two such one-thread sgemm runs at once, one per place's rows (they share the
// memory system as the places do). Then one step of 2 places under pdo::trace: where its
// time goes, per lane of place 0.
//
// The same model in PyTorch: benchmarks/train_torch.py.
//
//   bench_train [steps] [warmup]
#include <pdo/pdo.hpp>

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <latch>
#include <string>
#include <thread>
#include <vector>

namespace {

using steady = std::chrono::steady_clock;
constexpr std::size_t in = 1024, hidden = 4096, classes = 10;

auto make_mlp() {
  pdo::nn::rng gen(7);
  using namespace pdo::nn;
  return sequential(linear<float>(in, hidden, gen), relu{}, linear<float>(hidden, hidden, gen), relu{}, linear<float>(hidden, classes, gen));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct result {
  double step_ms = 0;
  double hidden_fraction = 0;  ///< of the all_reduce time, the part inside backward (place 0)
  double all_reduce_ms = 0;
};

result run(std::size_t places, std::size_t global_batch, bool overlap, int steps, int warmup) {
  // places with one half of the cores each (one core each on a 2-core machine); one place is the first of them
  auto all = pdo::cpu_places(2);
  if (places == 1) all.pop_back();
  const auto mesh = pdo::make_mesh<"dp">(all);
  auto trainer = pdo::nn::make_data_parallel<float>(
      mesh, make_mlp, [](auto ps) { return pdo::nn::sgd<float>(std::move(ps), {.lr = 0.01}); }, {.overlap = overlap});
  pdo::tensor<float, 2> x({global_batch, in});
  pdo::tensor<int, 1> y({global_batch});
  for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
  for (std::size_t i = 0; i < global_batch; ++i) y(i) = static_cast<int>(i % classes);
  std::vector<double> times, hidden_fractions, reduce_times;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto start = steady::now();
    (void)trainer.step(x, y);
    const double ms = std::chrono::duration<double, std::milli>(steady::now() - start).count();
    if (s < warmup) continue;
    times.push_back(ms);
    double backward_start = 0, backward_end = 0, total = 0, inside = 0;
    const auto events = trainer.last_step_events();
    for (const auto& e : events)
      if (e.place == 0 && e.what == "backward") backward_start = e.start_us, backward_end = e.end_us;
    for (const auto& e : events) {
      if (e.place != 0 || e.what != "all_reduce") continue;
      total += e.end_us - e.start_us;
      inside += std::max(0.0, std::min(e.end_us, backward_end) - std::max(e.start_us, backward_start));
    }
    hidden_fractions.push_back(total > 0 ? inside / total : 0);
    reduce_times.push_back(total / 1000);
  }
  return {median(times), places > 1 ? median(hidden_fractions) : 0, places > 1 ? median(reduce_times) : 0};
}

/// @brief The anchor: milliseconds OpenBLAS's sgemm takes for the nine products of one
/// step on `rows` rows, on `threads` threads (once the operands are made; with `start`, once
/// every thread counted by it has made its own).
double sgemm_step_ms(std::size_t rows, int threads, int repeats, std::latch* start = nullptr) {
  openblas_set_num_threads(threads);
  struct product {
    std::size_t m, n, k;
  };
  const std::size_t dims[] = {in, hidden, hidden, classes};
  std::vector<product> products;
  for (std::size_t l = 0; l < 3; ++l) {
    const std::size_t a = dims[l], b = dims[l + 1];
    products.push_back({rows, b, a});              // forward
    products.push_back({a, b, rows});              // weight gradient
    if (l > 0) products.push_back({rows, a, b});  // input gradient (backward computes none for the batch)
  }
  std::vector<float> A(hidden * std::max(rows, hidden)), B(hidden * std::max(rows, hidden)), C(hidden * std::max(rows, hidden));
  std::fill(A.begin(), A.end(), 0.001f);
  std::fill(B.begin(), B.end(), 0.002f);
  std::fill(C.begin(), C.end(), 0.0f);
  if (start != nullptr) start->arrive_and_wait();
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto start = steady::now();
    for (const auto& p : products)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), 1.0f,
                  A.data(), static_cast<int>(p.k), B.data(), static_cast<int>(p.n), 0.0f, C.data(), static_cast<int>(p.n));
    times.push_back(std::chrono::duration<double, std::milli>(steady::now() - start).count());
  }
  return median(times);
}

/// @brief The limit of a step on 2 places: two threads at once, each pinned to one core as a
/// place's lane is, running the step's products on `rows` rows with a one-thread sgemm
/// (started together once both have their operands); milliseconds until both are done.
double two_sgemm_steps_ms(std::size_t rows, int repeats) {
  const std::vector<int> cores = pdo::detail::process_cores();
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    std::latch start(2);
    double ms[2] = {0, 0};
    auto run_on = [&](std::size_t k) {
      if (cores.size() >= 2) pdo::detail::pin_current_thread({cores[k]});
      ms[k] = sgemm_step_ms(rows, 1, 1, &start);
    };
    std::thread first([&] { run_on(0); }), second([&] { run_on(1); });
    first.join();
    second.join();
    times.push_back(std::max(ms[0], ms[1]));
  }
  return median(times);
}

/// @brief One step of `trainer` under pdo::trace: milliseconds per (lane, name) on place 0,
/// and how much of the bucket collectives' time falls inside backward.
template <class Trainer, class X, class Y>
void trace_breakdown(Trainer& trainer, const X& x, const Y& y) {
  pdo::trace::start();
  (void)trainer.step(x, y);
  pdo::trace::stop();
  const auto events = pdo::detail::trace_recorder::instance().events();
  struct row {
    std::string lane, name;
    double ms = 0;
  };
  std::vector<row> rows;
  double backward_start = 0, backward_end = 0, step_ms = 0;
  auto us = [&](auto t) { return std::chrono::duration<double, std::micro>(t - pdo::detail::trace_recorder::instance().origin()).count(); };
  for (const auto& e : events) {
    if (e.track->place != "cpu:0" || e.instant) continue;
    const double ms = std::chrono::duration<double, std::milli>(e.end - e.start).count();
    if (e.name == "backward") backward_start = us(e.start), backward_end = us(e.end);
    if (e.name == "data_parallel::step") step_ms = ms;
    auto found = std::find_if(rows.begin(), rows.end(), [&](const row& r) { return r.lane == e.track->lane && r.name == e.name; });
    if (found == rows.end()) rows.push_back({e.track->lane, e.name, ms});
    else found->ms += ms;
  }
  double buckets = 0, inside = 0;
  for (const auto& e : events)
    if (e.track->place == "cpu:0" && e.name == "bucket all_reduce") {
      buckets += us(e.end) - us(e.start);
      inside += std::max(0.0, std::min(us(e.end), backward_end) - std::max(us(e.start), backward_start));
    }
  std::printf("one traced step on 2 places, place cpu:0 (step %.1f ms; spans inside a task are counted in it too):\n", step_ms);
  for (const auto& r : rows) std::printf("    %-14s %-22s %8.2f ms\n", r.lane.c_str(), r.name.c_str(), r.ms);
  std::printf("    bucket collectives: %.1f ms, %.0f%% of it while backward runs\n", buckets / 1000, buckets > 0 ? 100 * inside / buckets : 0.0);
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
  const int warmup = argc > 2 ? std::max(0, std::atoi(argv[2])) : 2;
  const std::size_t batch = 256;
  std::printf("MLP %zu-%zu-%zu-%zu, float32, SGD, median of %d steps after %d\n", in, hidden, hidden, classes, steps, warmup);

  const double gemm_1core_256 = sgemm_step_ms(batch, 1, 3);
  const double gemm_1core_128 = sgemm_step_ms(batch / 2, 1, 3);
  std::printf("anchor: OpenBLAS sgemm, the step's 8 products, 1 thread: %.1f ms at 256 rows, %.1f ms at 128 rows\n", gemm_1core_256,
              gemm_1core_128);

  const result one = run(1, batch, true, steps, warmup);
  std::printf("1 place (half the cores), batch 256:               step %7.1f ms  %6.0f samples/s  sgemm-only step / step = %.2f\n",
              one.step_ms, 1000.0 * batch / one.step_ms, gemm_1core_256 / one.step_ms);
  const double limit_2 = two_sgemm_steps_ms(batch / 2, 3);
  std::printf("anchor: two one-thread sgemm runs of the step's products at once, 128 rows each: %.1f ms (the limit of 2 places)\n", limit_2);
  const result strong = run(2, batch, true, steps, warmup);
  std::printf("2 places, global batch 256 (strong):               step %7.1f ms  %6.0f samples/s  speedup %.2fx  limit / step = %.2f\n",
              strong.step_ms, 1000.0 * batch / strong.step_ms, one.step_ms / strong.step_ms, limit_2 / strong.step_ms);
  std::printf("    all_reduce %.1f ms per step, %.0f%% of it hidden behind backward\n", strong.all_reduce_ms, 100 * strong.hidden_fraction);
  const result strong_serial = run(2, batch, false, steps, warmup);
  std::printf("2 places, global batch 256, all_reduce after backward: step %7.1f ms (overlap saves %.1f%%)\n", strong_serial.step_ms,
              100 * (strong_serial.step_ms - strong.step_ms) / strong_serial.step_ms);
  const result weak = run(2, 2 * batch, true, steps, warmup);
  std::printf("2 places, 256 rows each, global 512 (weak):        step %7.1f ms  %6.0f samples/s  weak-scaling efficiency %.2f\n",
              weak.step_ms, 1000.0 * 2 * batch / weak.step_ms, one.step_ms / weak.step_ms);
  std::printf("    all_reduce %.1f ms per step, %.0f%% of it hidden behind backward\n", weak.all_reduce_ms, 100 * weak.hidden_fraction);
  {
    const auto mesh = pdo::make_mesh<"dp">(pdo::cpu_places(2));
    auto trainer = pdo::nn::make_data_parallel<float>(mesh, make_mlp, [](auto ps) { return pdo::nn::sgd<float>(std::move(ps), {.lr = 0.01}); });
    pdo::tensor<float, 2> x({batch, in});
    pdo::tensor<int, 1> y({batch});
    for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    for (std::size_t i = 0; i < batch; ++i) y(i) = static_cast<int>(i % classes);
    for (int s = 0; s < warmup; ++s) (void)trainer.step(x, y);
    trace_breakdown(trainer, x, y);
  }
  return 0;
}
