// benchmarks/train.cpp: data-parallel training step of an MLP 1024-4096-4096-10 (float32,
// cross-entropy, SGD), global batch 256: on 1 place and on 2 places (strong scaling: the
// same global batch; weak scaling: 256 rows per place); on 2 places with the buckets'
// all_reduces overlapping backward (the default), with the fraction of the all_reduce hidden
// behind backward, with the gradients' sync fused with the update
// (data_parallel_options::fused_update), and with sliced weight gradients (each place makes
// its rows of each weight's summed gradient from the batch's activations all_gathered, the
// SGD update folded into that product: data_parallel_options::sliced_weight_gradients).
//
// Anchor: OpenBLAS's sgemm on the step's eight matrix products (each layer's forward product
// and weight gradient, and the input gradients of the second and third layers: the batch, the
// first layer's input, needs none), each called as the step calls it (the weight gradient
// xᵀg and the input gradient g wᵀ read an operand transposed), with the cores of one place; "sgemm-only step" is the time
// those products alone take, and the ratio printed is that time over the step's (1.00 would
// be a step that costs nothing but its gemms). For 2 places the limit is two such one-thread
// sgemm runs at once, one per place's rows (they share the memory system as the places do).
// A second anchor is the least a 2-place step can do besides: after those products, the
// gradients summed and the SGD update applied to both replicas in one pass by hand-written
// loops (each core half of the elements). A third is the sliced step's own products, called
// as it calls them, two one-thread runs at once: its weight gradients are other products
// (half a weight's rows over all 256 rows, beta 1) than the limit's.
//
// The machines these run on change speed from one second to the next (other tenants), so
// each sample runs the anchors and every trainer's step one after the other, and each ratio
// is the median of the samples' ratios, not a ratio of medians. Then one step of 2 places
// under pdo::trace: where its time goes, per lane of place 0.
//
// The same model in PyTorch: benchmarks/train_torch.py.
//
//   bench_train [samples] [warmup]
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

/// @brief The anchor: milliseconds OpenBLAS's sgemm takes for the eight products of one
/// step on `rows` rows, called as the step calls them (a layer's weight gradient xᵀg reads x
/// transposed, its input gradient g wᵀ reads w transposed), on `threads` threads (once the
/// operands are made; with `start`, once every thread counted by it has made its own). With
/// `sliced`, each weight gradient is called as a 2-place step with sliced weight gradients
/// calls it: half the weight's rows, over both places' rows (2 `rows`), C read and written
/// (beta 1: the update folded in).
double sgemm_step_ms(std::size_t rows, int threads, int repeats, std::latch* start = nullptr, bool sliced = false) {
  openblas_set_num_threads(threads);
  struct product {
    CBLAS_TRANSPOSE ta, tb;
    std::size_t m, n, k;
    float beta = 0;
  };
  const std::size_t dims[] = {in, hidden, hidden, classes};
  std::vector<product> products;
  for (std::size_t l = 0; l < 3; ++l) {
    const std::size_t a = dims[l], b = dims[l + 1];
    products.push_back({CblasNoTrans, CblasNoTrans, rows, b, a});           // forward: x w
    if (sliced) products.push_back({CblasTrans, CblasNoTrans, a / 2, b, 2 * rows, 1.0f});  // its rows of xᵀ g, updating w
    else products.push_back({CblasTrans, CblasNoTrans, a, b, rows});                      // weight gradient: xᵀ g
    if (l > 0) products.push_back({CblasNoTrans, CblasTrans, rows, a, b});  // input gradient g wᵀ (none for the batch)
  }
  std::vector<float> A(hidden * std::max(rows, hidden)), B(hidden * std::max(rows, hidden)), C(hidden * std::max(rows, hidden));
  std::fill(A.begin(), A.end(), 0.001f);
  std::fill(B.begin(), B.end(), 0.002f);
  std::fill(C.begin(), C.end(), 0.0f);
  if (start != nullptr) start->arrive_and_wait();
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto start = steady::now();
    for (const auto& p : products) {
      // row-major: a stored operand's rows are its second extent long
      const int lda = static_cast<int>(p.ta == CblasNoTrans ? p.k : (p.beta != 0 ? 2 * p.m : p.m)), ldb = static_cast<int>(p.tb == CblasNoTrans ? p.n : p.k);
      cblas_sgemm(CblasRowMajor, p.ta, p.tb, static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), 1.0f, A.data(), lda,
                  B.data(), ldb, p.beta, C.data(), static_cast<int>(p.n));
    }
    times.push_back(std::chrono::duration<double, std::milli>(steady::now() - start).count());
  }
  return median(times);
}

/// @brief The limit of a step on 2 places: two threads at once, each pinned to one core as a
/// place's lane is, running the step's products on `rows` rows with a one-thread sgemm
/// (started together once both have their operands); milliseconds until both are done. With
/// `sliced`, the products as a step with sliced weight gradients calls them.
double two_sgemm_steps_ms(std::size_t rows, int repeats, bool sliced = false) {
  const std::vector<int> cores = pdo::detail::process_cores();
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    std::latch start(2);
    double ms[2] = {0, 0};
    auto run_on = [&](std::size_t k) {
      if (cores.size() >= 2) pdo::detail::pin_current_thread({cores[k]});
      ms[k] = sgemm_step_ms(rows, 1, 1, &start, sliced);
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

/// @brief A data-parallel trainer of the MLP with SGD on `places` of the two places of
/// cpu_places(2) (one core each on a 2-core machine), fused or not, with sliced weight
/// gradients or not.
auto make_trainer(std::size_t places, bool fused, bool sliced = false) {
  auto all = pdo::cpu_places(2);
  if (places == 1) all.pop_back();
  const auto mesh = pdo::make_mesh<"dp">(all);
  return pdo::nn::make_data_parallel<float>(
      mesh, make_mlp, [](auto ps) { return pdo::nn::sgd<float>(std::move(ps), {.lr = 0.01}); },
      {.fused_update = fused, .sliced_weight_gradients = sliced});
}

/// @brief A global batch of `rows` rows.
std::pair<pdo::tensor<float, 2>, pdo::tensor<int, 1>> batch_of(std::size_t rows) {
  pdo::tensor<float, 2> x({rows, in});
  pdo::tensor<int, 1> y({rows});
  for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
  for (std::size_t i = 0; i < rows; ++i) y(i) = static_cast<int>(i % classes);
  return {std::move(x), std::move(y)};
}

/// @brief Milliseconds one step of `trainer` takes.
template <class Trainer, class Batch>
double step_ms(Trainer& trainer, const Batch& b) {
  const auto start = steady::now();
  (void)trainer.step(b.first, b.second);
  return std::chrono::duration<double, std::milli>(steady::now() - start).count();
}

/// @brief Of the last step of `trainer`, on place 0: the all_reduces' time (ms) and the fraction of it inside backward.
template <class Trainer>
std::pair<double, double> all_reduce_of(const Trainer& trainer) {
  double backward_start = 0, backward_end = 0, total = 0, inside = 0;
  const auto events = trainer.last_step_events();
  for (const auto& e : events)
    if (e.place == 0 && e.what == "backward") backward_start = e.start_us, backward_end = e.end_us;
  for (const auto& e : events) {
    if (e.place != 0 || e.what != "all_reduce") continue;
    total += e.end_us - e.start_us;
    inside += std::max(0.0, std::min(e.end_us, backward_end) - std::max(e.start_us, backward_start));
  }
  return {total / 1000, total > 0 ? inside / total : 0};
}

/// @brief The second anchor: the least a 2-place step does besides its products. Two threads,
/// pinned as the places' lanes are, run the step's products on 128 rows each (one-thread
/// sgemm), meet, then sum the two replicas' gradients and apply SGD to both replicas' values
/// in one pass, each thread half of the elements; milliseconds until both are done.
struct ideal_step {
  std::size_t elements = in * hidden + hidden + hidden * hidden + hidden + hidden * classes + classes;
  std::vector<float> values[2], grads[2];
  ideal_step() {
    for (int k = 0; k < 2; ++k) {
      values[k].assign(elements, 0.01f);
      grads[k].assign(elements, 0.001f * static_cast<float>(k + 1));
    }
  }
  double run() {
    const std::vector<int> cores = pdo::detail::process_cores();
    std::latch start(2), products(2);
    double ms[2] = {0, 0}, pass[2] = {0, 0};
    auto on = [&](std::size_t k) {
      if (cores.size() >= 2) pdo::detail::pin_current_thread({cores[k]});
      ms[k] = sgemm_step_ms(128, 1, 1, &start);  // timed from when both have their operands
      products.arrive_and_wait();
      const auto t0 = steady::now();
      float* __restrict a = values[0].data();
      float* __restrict b = values[1].data();
      const float* __restrict g0 = grads[0].data();
      const float* __restrict g1 = grads[1].data();
      const std::size_t lo = k * elements / 2, hi = (k + 1) * elements / 2;
#pragma omp simd
      for (std::size_t i = lo; i < hi; ++i) {
        const float v = a[i] - 0.01f * (g0[i] + g1[i]);
        a[i] = v;
        b[i] = v;
      }
      pass[k] = std::chrono::duration<double, std::milli>(steady::now() - t0).count();
    };
    std::thread first([&] { on(0); }), second([&] { on(1); });
    first.join();
    second.join();
    return std::max(ms[0], ms[1]) + std::max(pass[0], pass[1]);
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int samples = argc > 1 ? std::max(1, std::atoi(argv[1])) : 7;
  const int warmup = argc > 2 ? std::max(0, std::atoi(argv[2])) : 2;
  const std::size_t batch = 256;
  std::printf("MLP %zu-%zu-%zu-%zu, float32, SGD, %d samples after %d warm-up steps; in each sample the anchors and every "
              "trainer's step run one after the other; figures are medians (ratios: of the samples' ratios)\n",
              in, hidden, hidden, classes, samples, warmup);
  auto one = make_trainer(1, false);
  auto overlapped = make_trainer(2, false);  // the default
  auto fused = make_trainer(2, true);
  auto sliced = make_trainer(2, true, true);
  std::printf("2 places: %s", overlapped.explain().substr(0, overlapped.explain().find("  bucket 0")).c_str());
  const auto b256 = batch_of(batch), b512 = batch_of(2 * batch);
  for (int s = 0; s < warmup; ++s) {
    (void)one.step(b256.first, b256.second);
    (void)overlapped.step(b256.first, b256.second);
    (void)fused.step(b256.first, b256.second);
    (void)sliced.step(b256.first, b256.second);
    (void)overlapped.step(b512.first, b512.second);
  }
  ideal_step ideal;
  std::vector<double> a1, t1, r1, a2, i2, ri, t2, r2, reduce_o, hidden_o, t2f, r2f, reduce_f, t2s, r2s, a2s, r2ss, tw, rw;
  for (int s = 0; s < samples; ++s) {
    a1.push_back(sgemm_step_ms(batch, 1, 1));
    t1.push_back(step_ms(one, b256));
    r1.push_back(a1.back() / t1.back());
    a2.push_back(two_sgemm_steps_ms(batch / 2, 1));
    i2.push_back(ideal.run());
    ri.push_back(a2.back() / i2.back());
    t2.push_back(step_ms(overlapped, b256));
    r2.push_back(a2.back() / t2.back());
    const auto [ms, hidden_part] = all_reduce_of(overlapped);
    reduce_o.push_back(ms);
    hidden_o.push_back(hidden_part);
    t2f.push_back(step_ms(fused, b256));
    r2f.push_back(a2.back() / t2f.back());
    reduce_f.push_back(all_reduce_of(fused).first);
    t2s.push_back(step_ms(sliced, b256));
    r2s.push_back(a2.back() / t2s.back());
    a2s.push_back(two_sgemm_steps_ms(batch / 2, 1, true));
    r2ss.push_back(a2s.back() / t2s.back());
    tw.push_back(step_ms(overlapped, b512));
    rw.push_back(t1.back() / tw.back());
  }
  std::printf("anchor: OpenBLAS sgemm, the step's 8 products as it calls them, 1 thread, 256 rows: %.1f ms\n", median(a1));
  std::printf("1 place (half the cores), batch 256:                  step %7.1f ms  %6.0f samples/s  sgemm-only step / step = %.2f\n",
              median(t1), 1000.0 * batch / median(t1), median(r1));
  std::printf("anchor: two one-thread sgemm runs of the step's products at once, 128 rows each: %.1f ms (the limit of 2 places)\n",
              median(a2));
  std::printf("anchor: those products, then the gradients' sum and SGD on both replicas in one hand-written pass: %.1f ms, "
              "limit / that = %.2f (the best any 2-place step can do here)\n",
              median(i2), median(ri));
  std::printf("2 places, global batch 256 (strong):                 step %7.1f ms  %6.0f samples/s  speedup %.2fx  limit / step = %.2f\n",
              median(t2), 1000.0 * batch / median(t2), median(t1) / median(t2), median(r2));
  std::printf("    all_reduce %.1f ms per step, %.0f%% of it hidden behind backward\n", median(reduce_o), 100 * median(hidden_o));
  std::printf("2 places, global batch 256, .fused_update:           step %7.1f ms  limit / step = %.2f\n", median(t2f), median(r2f));
  std::printf("    the buckets' all_reduces fused with the update: %.1f ms per step, after backward\n", median(reduce_f));
  std::printf("2 places, global batch 256, .sliced_weight_gradients: step %7.1f ms  limit / step = %.2f\n", median(t2s), median(r2s));
  std::printf("    (each weight's gradient made from x and g all_gathered, its rows per place, the SGD update folded into the product)\n");
  std::printf("    anchor: its products as it calls them (each weight gradient: half the rows of w over all 256 rows, beta 1), two "
              "one-thread sgemm runs at once: %.1f ms; that / step = %.2f\n",
              median(a2s), median(r2ss));
  std::printf("2 places, 256 rows each, global 512 (weak):          step %7.1f ms  %6.0f samples/s  weak-scaling efficiency %.2f\n",
              median(tw), 1000.0 * 2 * batch / median(tw), median(rw));
  for (int s = 0; s < warmup; ++s) (void)overlapped.step(b256.first, b256.second);
  trace_breakdown(overlapped, b256.first, b256.second);
  return 0;
}
