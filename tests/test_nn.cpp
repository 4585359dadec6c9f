// nn: layer gradients against finite differences, optimizers against their update rules,
// and data-parallel training on 1-4 places against one place, step by step.
#include "support.hpp"

#include <pdo/nn.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numbers>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using pdo::shape_t;
template <std::size_t R>
using dt = pdo::tensor<double, R>;

template <std::size_t R>
dt<R> rnd(const shape_t<R>& s, unsigned seed, double shift = 0) {
  return pdo_test::random_tensor<double>(s, seed, shift);
}

/// @brief sum(f(x) * w) for fixed random weights w.
template <class F, std::size_t R>
double weighed(F& f, const dt<R>& x) {
  const auto y = f(pdo::var(x));
  const pdo::var<std::remove_cvref_t<decltype(y.value())>> w(pdo_test::random_tensor<double>(y.shape(), 77));
  return pdo::sum(y * w).value().data()[0];
}

/// @brief Checks the gradient of sum(f(x) * w) with respect to x and to the parameters `ps`.
template <class F, std::size_t R>
void check_layer(F f, dt<R> x, const std::vector<pdo::nn::parameter_ref<double>>& ps) {
  auto X = pdo::parameter(x);
  const auto y = f(X);
  const pdo::var<std::remove_cvref_t<decltype(y.value())>> w(pdo_test::random_tensor<double>(y.shape(), 77));
  for (const auto& p : ps) p.zero_grad();
  pdo::backward(pdo::sum(y * w));
  constexpr double eps = 1e-6;
  auto check = [&](std::span<double> values, std::span<const double> grad, const std::string& what) {
    REQUIRE(grad.size() == values.size());
    for (std::size_t j = 0; j < values.size(); ++j) {
      const double keep = values[j];
      values[j] = keep + eps;
      const double up = weighed(f, x);
      values[j] = keep - eps;
      const double down = weighed(f, x);
      values[j] = keep;
      INFO(what << " element " << j);
      CHECK(grad[j] == Approx((up - down) / (2 * eps)).epsilon(1e-5).margin(1e-7));
    }
  };
  check(x.span(), X.grad().span(), "input");
  for (const auto& p : ps) check(p.value(), p.grad(), p.name());
}

}  // namespace

TEST_CASE("nn: layers are initialised as PyTorch's: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), zeros for no inputs", "[nn]") {
  pdo::nn::rng gen(3);
  const auto within = [](const auto& t, double bound) {
    double largest = 0;
    for (std::size_t i = 0; i < t.size(); ++i) largest = std::max(largest, std::abs(static_cast<double>(t.data()[i])));
    return largest <= bound && largest > bound / 2;  // inside the bound, and spread over it
  };
  const pdo::nn::linear<double> wide(16, 40, gen);
  CHECK(within(wide.weight.value(), 0.25));
  CHECK(within(wide.bias.value(), 0.25));
  const pdo::nn::conv2d<float> conv(2, 30, 3, gen);
  CHECK(within(conv.weight.value(), 1 / std::sqrt(18.0)));
  CHECK(within(conv.bias.value(), 1 / std::sqrt(18.0)));
  const pdo::nn::linear<float> no_inputs(0, 3, gen);
  REQUIRE(no_inputs.bias.value().size() == 3);
  for (std::size_t i = 0; i < 3; ++i) CHECK(no_inputs.bias.value().data()[i] == 0.0f);
}

TEST_CASE("nn: layer gradients against finite differences", "[nn]") {
  pdo::nn::rng gen(1);
  SECTION("linear") {
    pdo::nn::linear<double> l(4, 3, gen);
    check_layer([&](const auto& x) { return l(x); }, rnd<2>({5, 4}, 1), l.parameters("l."));
  }
  SECTION("conv2d, stride 1 and 2, with and without padding") {
    for (std::size_t stride : {1, 2})
      for (std::size_t pad : {0, 1}) {
        INFO("stride " << stride << " padding " << pad);
        pdo::nn::conv2d<double> c(2, 3, 3, gen, {stride, pad});
        check_layer([&](const auto& x) { return c(x); }, rnd<4>({2, 2, 5, 6}, 2), c.parameters("c."));
      }
  }
  SECTION("pools and flatten") {
    check_layer([](const auto& x) { return pdo::nn::max_pool2d{}.operator()(x); }, rnd<4>({2, 3, 4, 6}, 3), {});
    check_layer([](const auto& x) { return pdo::max_pool2d(x, 3, {1, 1}); }, rnd<4>({1, 2, 5, 5}, 4), {});
    check_layer([](const auto& x) { return pdo::avg_pool2d(x, 2); }, rnd<4>({2, 3, 4, 6}, 5), {});
    check_layer([](const auto& x) { return pdo::avg_pool2d(x, 3, {2, 1}); }, rnd<4>({1, 2, 5, 5}, 6), {});
    check_layer([](const auto& x) { return pdo::nn::flatten{}(x); }, rnd<4>({2, 3, 2, 2}, 7), {});
  }
  SECTION("a small CNN end to end") {
    pdo::nn::sequential net(pdo::nn::conv2d<double>(1, 2, 3, gen, {1, 1}), pdo::nn::relu{}, pdo::nn::max_pool2d{},
                            pdo::nn::flatten{}, pdo::nn::linear<double>(8, 3, gen), pdo::nn::tanh{});
    const auto ps = pdo::nn::parameters_of<double>(net);
    REQUIRE(ps.size() == 4);
    CHECK(ps[0].name() == "0.weight");
    CHECK(ps[3].name() == "4.bias");
    check_layer([&](const auto& x) { return net(x); }, rnd<4>({2, 1, 4, 4}, 8), ps);
  }
  SECTION("shape errors name the op and the shapes") {
    pdo::nn::conv2d<double> c(2, 3, 3, gen);
    CHECK_THROWS_WITH(c(pdo::var(rnd<4>({1, 4, 5, 5}, 9))), Catch::Contains("conv2d") && Catch::Contains("[1, 4, 5, 5]"));
    CHECK_THROWS_WITH(pdo::max_pool2d(pdo::var(rnd<4>({1, 1, 1, 1}, 9)), 2), Catch::Contains("max_pool2d"));
    CHECK_THROWS_WITH(pdo::avg_pool2d(pdo::var(rnd<4>({1, 1, 4, 4}, 9)), 2, {.stride = 2, .padding = 2}),
                      Catch::StartsWith("avg_pool2d: padding 2 with kernel 2") && Catch::Contains("at most half the kernel size"));
    // a linear layer names its own shape, not the matmul inside it
    pdo::nn::linear<double> l(3, 2, gen);
    CHECK_THROWS_WITH(l(pdo::var(rnd<2>({4, 5}, 9))),
                      Catch::StartsWith("linear: input [4, 5] for a layer of 3 inputs and 2 outputs") && Catch::Contains("must be 3"));
    CHECK_THROWS_AS(pdo::nn::linear<double>(pdo::parameter(rnd<2>({3, 2}, 1)), pdo::parameter(rnd<1>({3}, 2))), pdo::shape_error);
    CHECK(l(pdo::var(rnd<3>({2, 4, 3}, 9))).value().shape() == pdo::shape_t<3>{2, 4, 2});
    CHECK_THROWS_WITH(pdo::mse(pdo::var(rnd<2>({2, 4}, 1)), pdo::var(rnd<2>({2, 3}, 2))),
                      Catch::StartsWith("mse: subtract: shapes do not broadcast") && Catch::Contains("[2, 3]"));
  }
}

TEST_CASE("nn: optimizers follow their update rules", "[nn]") {
  auto param = [] { return pdo::parameter(dt<1>({3}, {1.0, -2.0, 0.5})); };
  const dt<1> g({3}, {0.1, -0.3, 0.2});
  auto set_grad = [&](auto& p) {
    p.zero_grad();
    p.node()->grad.emplace(g);
  };
  SECTION("sgd with momentum and weight decay") {
    auto p = param();
    pdo::nn::sgd<double> opt({{"p", p}}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01});
    std::vector<double> ref{1.0, -2.0, 0.5}, buf(3);
    for (int step = 0; step < 3; ++step) {
      set_grad(p);
      opt.step();
      for (std::size_t i = 0; i < 3; ++i) {
        const double d = g(i) + 0.01 * ref[i];
        buf[i] = step == 0 ? d : 0.9 * buf[i] + d;
        ref[i] -= 0.1 * buf[i];
      }
    }
    for (std::size_t i = 0; i < 3; ++i) CHECK(p.value()(i) == Approx(ref[i]).epsilon(1e-14));
  }
  SECTION("without settings, the options' defaults (PyTorch's): sgd lr 0.01; adam lr 1e-3, betas 0.9 and 0.999, eps 1e-8") {
    auto p = param(), q = param();
    pdo::nn::sgd<double> plain(std::vector<pdo::nn::parameter_ref<double>>{{"p", p}});
    pdo::nn::adam<double> adaptive(std::vector<pdo::nn::parameter_ref<double>>{{"q", q}});
    set_grad(p);
    set_grad(q);
    plain.step();
    adaptive.step();
    const std::vector<double> start{1.0, -2.0, 0.5};
    for (std::size_t i = 0; i < 3; ++i) {
      CHECK(p.value()(i) == Approx(start[i] - 0.01 * g(i)).epsilon(1e-14));
      // Adam's first step: the moments' bias corrections give back g and g²
      CHECK(q.value()(i) == Approx(start[i] - 1e-3 * g(i) / (std::abs(g(i)) + 1e-8)).epsilon(1e-12));
    }
  }
  SECTION("adam and adamw") {
    for (bool decoupled : {false, true}) {
      auto p = param();
      pdo::nn::adam_options o{.lr = 0.01, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1, .decoupled_weight_decay = decoupled};
      pdo::nn::adam<double> opt({{"p", p}}, o);
      std::vector<double> ref{1.0, -2.0, 0.5}, m(3), v(3);
      for (int t = 1; t <= 3; ++t) {
        set_grad(p);
        opt.step();
        for (std::size_t i = 0; i < 3; ++i) {
          double d = g(i);
          if (decoupled) ref[i] -= 0.01 * 0.1 * ref[i];
          else d += 0.1 * ref[i];
          m[i] = 0.9 * m[i] + 0.1 * d;
          v[i] = 0.99 * v[i] + 0.01 * d * d;
          ref[i] -= 0.01 * (m[i] / (1 - std::pow(0.9, t))) / (std::sqrt(v[i] / (1 - std::pow(0.99, t))) + 1e-8);
        }
      }
      INFO("decoupled " << decoupled);
      for (std::size_t i = 0; i < 3; ++i) CHECK(p.value()(i) == Approx(ref[i]).epsilon(1e-12));
    }
  }
  SECTION("adam on floats takes PyTorch's float steps: its coefficients computed in double and rounded once") {
    // torch.optim.Adam([w], lr=1) on a float weight 0 whose gradient is 1: -0.99999988 after a
    // step, -3 after three (the rounding of 1 - beta2 in float made them 7e-6 longer)
    for (const bool decoupled : {false, true}) {
      auto w = pdo::parameter(pdo::tensor<float, 1>({1}));
      w.value()(0) = 0.0f;
      pdo::nn::adam<float> opt({{"w", w}}, {.lr = 1.0, .decoupled_weight_decay = decoupled});
      std::vector<float> after;
      for (int t = 0; t < 3; ++t) {
        opt.zero_grad();
        pdo::backward(pdo::sum(w * 1.0f));
        opt.step();
        after.push_back(w.value()(0));
      }
      INFO("decoupled " << decoupled);
      CHECK(after[0] == Approx(-0.99999988f).margin(1e-7));
      CHECK(after[2] == Approx(-3.0f).margin(4e-7));
    }
  }
  SECTION("adam counts each parameter's steps, as PyTorch's: one first updated at step 2 is corrected as at its first") {
    auto p = param();
    auto late = pdo::parameter(pdo::tensor<double, 1>({1}));
    late.value()(0) = 1.0;
    pdo::nn::adam<double> opt({{"p", p}, {"late", late}}, {.lr = 0.1});
    set_grad(p);
    opt.step();  // late has no gradient
    CHECK(late.value()(0) == 1.0);
    set_grad(p);
    pdo::backward(pdo::sum(late * 3.0));
    opt.step();
    // bias-corrected at t = 1: the update is lr * g / (|g| + eps), 0.1 (torch.optim.Adam gives 0.9)
    CHECK(late.value()(0) == Approx(0.9).epsilon(1e-9));
    CHECK(opt.steps() == 2);
    CHECK(opt.steps(0) == 2);
    CHECK(opt.steps(1) == 1);
  }
  SECTION("settings PyTorch rejects are errors that name them, and nothing is updated") {
    auto p = param();
    const auto sgd = [&](pdo::nn::sgd_options o) { return pdo::nn::sgd<double>({{"p", p}}, o); };
    const auto adam = [&](pdo::nn::adam_options o) { return pdo::nn::adam<double>({{"p", p}}, o); };
    CHECK_THROWS_WITH(sgd({.lr = -0.1}), "sgd: lr must be finite and >= 0, not -0.1");
    CHECK_THROWS_WITH(sgd({.lr = 0.1, .momentum = -0.5}), "sgd: momentum must be finite and >= 0, not -0.5");
    CHECK_THROWS_WITH(sgd({.lr = 0.1, .weight_decay = std::nan("")}), Catch::StartsWith("sgd: weight_decay must be finite"));
    CHECK_THROWS_WITH(adam({.lr = std::numeric_limits<double>::infinity()}), "adam: lr must be finite and >= 0, not inf");
    CHECK_THROWS_WITH(adam({.beta1 = 1.0}), "adam: beta1 must be in [0, 1), not 1");
    CHECK_THROWS_WITH(adam({.beta2 = -0.1}), "adam: beta2 must be in [0, 1), not -0.1");
    CHECK_THROWS_WITH(adam({.eps = -1e-8}), "adam: eps must be finite and >= 0, not -1e-08");
    CHECK_THROWS_WITH(adam(pdo::nn::adamw_options(0.1, -0.01)), "adam: weight_decay must be finite and >= 0, not -0.01");
    auto ok = sgd({.lr = 0.1, .momentum = 1.5});  // PyTorch takes any momentum >= 0, and lr 0
    CHECK_THROWS_WITH(ok.set_lr(-1), "sgd::set_lr: lr must be finite and >= 0, not -1");
    CHECK(ok.lr() == 0.1);
    ok.set_lr(0);
    set_grad(p);
    ok.step();
    CHECK(p.value()(0) == 1.0);
    pdo::nn::any_optimizer<double> any = adam({});
    CHECK_THROWS_WITH(any.set_lr(std::nan("")), "adam::set_lr: lr must be finite and >= 0, not nan");
  }
}

namespace {

auto make_mlp() {
  pdo::nn::rng gen(11);
  return pdo::nn::sequential(pdo::nn::linear<double>(6, 16, gen), pdo::nn::relu{}, pdo::nn::linear<double>(16, 16, gen),
                             pdo::nn::gelu{}, pdo::nn::linear<double>(16, 4, gen));
}

auto make_cnn() {
  pdo::nn::rng gen(12);
  return pdo::nn::sequential(pdo::nn::conv2d<double>(1, 4, 3, gen, {1, 1}), pdo::nn::relu{}, pdo::nn::max_pool2d{},
                             pdo::nn::conv2d<double>(4, 4, 3, gen, {1, 1}), pdo::nn::tanh{}, pdo::nn::avg_pool2d{},
                             pdo::nn::flatten{}, pdo::nn::linear<double>(4, 4, gen));
}

/// @brief The losses of `steps` steps over (x, y) in global batches of `batch` (the last one smaller) on `places` places.
template <class MakeModel, std::size_t R, class MakeOptimizer>
std::vector<double> train_losses(MakeModel make_model, MakeOptimizer make_optimizer, const dt<R>& x, const pdo::tensor<int, 1>& y,
                                 std::size_t batch, std::size_t places, std::size_t bucket_bytes, bool zero1 = false) {
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(places));
  auto trainer = pdo::nn::make_data_parallel<double>(m, make_model, make_optimizer, {.bucket_bytes = bucket_bytes, .zero1 = zero1});
  if (zero1) {
    std::size_t total = 0;
    for (const auto& p : trainer.parameters()) total += p.size();
    CHECK(trainer.optimizer_state_elements() <= (total + places - 1) / places + 8);  // a slice per bucket: about 1/n
  }
  std::vector<double> losses;
  for (int epoch = 0; epoch < 2; ++epoch)
    for (std::size_t first = 0; first < x.extent(0); first += batch) {
      const std::size_t rows = std::min(batch, x.extent(0) - first);
      auto xs = x.shape();
      xs[0] = rows;
      dt<R> xb(xs);
      pdo::tensor<int, 1> yb({rows});
      const std::size_t row = x.size() / x.extent(0);
      std::copy_n(x.data() + first * row, rows * row, xb.data());
      std::copy_n(y.data() + first, rows, yb.data());
      losses.push_back(trainer.step(xb, yb));
    }
  return losses;
}

pdo::tensor<int, 1> labels_for(std::size_t n) {
  pdo::tensor<int, 1> y({n});
  for (std::size_t i = 0; i < n; ++i) y(i) = static_cast<int>((i * 5 + i / 3) % 4);
  return y;
}

}  // namespace

TEST_CASE("data parallel: 1-4 places give the one-place losses step by step (uneven last batch)", "[nn][data_parallel]") {
  // 22 samples in global batches of 8: 8, 8, 6 -> 3 places train 3,3,2 then 2,2,2; 4 places 2,2,2,2 then 2,2,1,1
  const auto y = labels_for(22);
  auto adam = [](auto params) { return pdo::nn::adam<double>(std::move(params), {.lr = 0.01}); };
  auto sgd = [](auto params) { return pdo::nn::sgd<double>(std::move(params), {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3}); };
  SECTION("MLP, Adam, several buckets") {
    const auto x = rnd<2>({22, 6}, 40);
    const auto reference = train_losses(make_mlp, adam, x, y, 8, 1, 512);
    REQUIRE(reference.size() == 6);
    CHECK(reference.back() < reference.front());
    for (std::size_t places : {2, 3, 4}) {
      INFO(places << " places");
      const auto losses = train_losses(make_mlp, adam, x, y, 8, places, 512);
      for (std::size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == Approx(reference[s]).epsilon(1e-10));
    }
  }
  SECTION("CNN, SGD with momentum, one bucket") {
    const auto x = rnd<4>({22, 1, 4, 4}, 41);
    const auto reference = train_losses(make_cnn, sgd, x, y, 8, 1, std::size_t{1} << 20);
    for (std::size_t places : {2, 3, 4}) {
      INFO(places << " places");
      const auto losses = train_losses(make_cnn, sgd, x, y, 8, places, std::size_t{1} << 20);
      for (std::size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == Approx(reference[s]).epsilon(1e-10));
    }
  }
  SECTION("ZeRO-1: optimizer state sharded over the places, same trajectory") {
    const auto x = rnd<2>({22, 6}, 43);
    const auto reference = train_losses(make_mlp, adam, x, y, 8, 1, 512);
    for (std::size_t places : {1, 2, 3, 4}) {
      INFO(places << " places, ZeRO-1");
      const auto losses = train_losses(make_mlp, adam, x, y, 8, places, 512, true);
      for (std::size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == Approx(reference[s]).epsilon(1e-10));
    }
  }
  SECTION("a batch smaller than the mesh: places without rows still take part") {
    const auto x = rnd<2>({3, 6}, 42);
    const auto reference = train_losses(make_mlp, sgd, x, labels_for(3), 3, 1, 256);
    const auto losses = train_losses(make_mlp, sgd, x, labels_for(3), 3, 4, 256);
    for (std::size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == Approx(reference[s]).epsilon(1e-10));
  }
}

TEST_CASE("data parallel: another host thread's operations on the trainer's places, on its mesh and another, at the same time",
          "[nn][data_parallel][threads]") {
  // the step queues its buckets' collectives while it runs: the other thread's collectives on
  // the same places must not come between them in a different order on different places
  const auto places = pdo::cpu_places(2);
  const auto mesh = pdo::make_mesh<"dp">(places);
  const auto other = pdo::make_mesh<"dp">(places);
  const auto x = rnd<2>({8, 6}, 44);
  const auto y = labels_for(8);
  auto sgd = [](auto params) { return pdo::nn::sgd<double>(std::move(params), {.lr = 0.05, .momentum = 0.9}); };
  auto train = [&] {
    auto trainer = pdo::nn::make_data_parallel<double>(mesh, make_mlp, sgd, {.bucket_bytes = 256});
    std::vector<double> losses;
    for (int s = 0; s < 20; ++s) losses.push_back(trainer.step(x, y));
    return losses;
  };
  const auto reference = train();
  const auto host = pdo_test::iota_tensor<double, 2>({7, 3});
  double total = 0;
  for (std::size_t i = 0; i < host.size(); ++i) total += host.data()[i];  // halves: the sum is exact in any order
  std::atomic<bool> trained{false};
  std::size_t wrong = 0, rounds = 0;
  std::thread evaluations([&] {
    for (; !trained.load() || rounds < 40; ++rounds) {
      const auto& m = rounds % 2 == 0 ? mesh : other;
      const auto d = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(m, host);
      if (pdo::gather(pdo::eval(pdo::sum(d))).data()[0] != total) ++wrong;
    }
  });
  std::vector<double> losses;
  try {
    losses = train();
  } catch (...) {
    trained = true;
    evaluations.join();
    throw;
  }
  trained = true;
  evaluations.join();
  CHECK(wrong == 0);
  REQUIRE(losses.size() == reference.size());
  for (std::size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == reference[s]);
}

TEST_CASE("data parallel: bucketed all_reduce overlaps backward", "[nn][data_parallel]") {
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  auto make = [] {
    pdo::nn::rng gen(5);
    return pdo::nn::sequential(pdo::nn::linear<double>(64, 512, gen), pdo::nn::relu{}, pdo::nn::linear<double>(512, 512, gen),
                               pdo::nn::relu{}, pdo::nn::linear<double>(512, 512, gen), pdo::nn::relu{},
                               pdo::nn::linear<double>(512, 4, gen));
  };
  auto trainer = pdo::nn::make_data_parallel<double>(
      m, make, [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.01}); }, {.bucket_bytes = 256 << 10});
  CHECK(!trainer.fused_update());
  const auto buckets = trainer.buckets();
  REQUIRE(buckets.size() >= 3);
  CHECK(buckets.front().front() == "6.bias");  // the last layer's gradients are complete first
  const auto x = rnd<2>({256, 64}, 50);
  const auto y = labels_for(256);
  // Every bucket is handed to the communication thread while backward runs (deterministic:
  // the hooks fire inside backward). That the thread also begins some all_reduce before
  // backward ends depends on the OS giving it a core; on a loaded machine it may not in one
  // step, so a few steps are allowed.
  bool overlapped = false;
  for (int step = 0; step < 4 && !overlapped; ++step) {
    (void)trainer.step(x, y);
    const auto events = trainer.last_step_events();
    for (std::size_t p = 0; p < 2; ++p) {
      INFO("place " << p);
      double backward_end = -1;
      for (const auto& e : events)
        if (e.place == p && e.what == "backward") backward_end = e.end_us;
      REQUIRE(backward_end > 0);
      std::size_t all_reduces = 0;
      for (const auto& e : events) {
        if (e.place != p || e.what != "all_reduce") continue;
        ++all_reduces;
        CHECK(e.queued_us < backward_end);
        CHECK(e.queued_us <= e.start_us);
        overlapped = overlapped || e.start_us < backward_end;
      }
      CHECK(all_reduces == buckets.size());
    }
  }
  CHECK(overlapped);
}

TEST_CASE("data parallel: a failing step names the op and place, and the trainer goes on", "[nn][data_parallel]") {
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  const auto sgd = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.1}); };
  CHECK_THROWS_WITH(pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, {.clip_grad_norm = -1}),
                    "data_parallel: clip_grad_norm must be finite and >= 0 (0: no clipping), not -1");
  auto trainer = pdo::nn::make_data_parallel<double>(m, make_mlp, [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.1}); });
  const auto bad = rnd<2>({8, 5}, 60);  // the model takes 6 features
  CHECK_THROWS_WITH(trainer.step(bad, labels_for(8)), Catch::Contains("data_parallel::step") && Catch::Contains("linear: input [4, 5] for a layer of 6 inputs"));
  pdo::tensor<int, 1> wrong({8});
  wrong.fill(9);  // 4 classes
  CHECK_THROWS_WITH(trainer.step(rnd<2>({8, 6}, 61), wrong), Catch::Contains("cross_entropy"));
  // a label out of range in row 6 of 7: place 1 holds rows 4..6, and the error says so
  auto one_bad = labels_for(7);
  one_bad(6) = 7;
  CHECK_THROWS_WITH(trainer.step(rnd<2>({7, 6}, 63), one_bad),
                    Catch::StartsWith("data_parallel::step: on place cpu:1: its 3 rows of the batch are the inputs' rows 4..6 (row 0 "
                                      "here is row 4 there): cross_entropy") &&
                        Catch::Contains("the first is 7, at row 2"));
  // in a shuffled epoch (the first shuffle from the seed) the place that holds row 11 lists
  // its rows in their order, and the row the loss names is 11's place among them
  auto bad_in_epoch = labels_for(16);
  bad_in_epoch(11) = 8;
  std::vector<std::size_t> order(16);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::mt19937_64 gen(5);
  std::shuffle(order.begin(), order.end(), gen);
  const auto at = static_cast<std::size_t>(std::find(order.begin(), order.end(), 11) - order.begin());
  std::string listed;
  for (std::size_t i = at / 8 * 8; i < at / 8 * 8 + 8; ++i) listed += (listed.empty() ? "" : ", ") + std::to_string(order[i]);
  CHECK_THROWS_WITH(trainer.fit(rnd<2>({16, 6}, 64), bad_in_epoch, {.batch_size = 16, .seed = 5}, [](const auto&) {}),
                    Catch::StartsWith("data_parallel::step: on place cpu:" + std::to_string(at / 8) + ": its 8 rows of the batch are the inputs' rows " +
                                      listed + " (row i here, counted from 0, is the i-th of them): cross_entropy") &&
                        Catch::Contains("the first is 8, at row " + std::to_string(at % 8)));
  const auto before = trainer.parameters()[0].value()[0];
  CHECK_THROWS_WITH(trainer.step(pdo::tensor<double, 2>({0, 6}), pdo::tensor<int, 1>({0})),
                    Catch::Contains("data_parallel::step") && Catch::Contains("[0, 6]") && Catch::Contains("no rows"));
  CHECK(trainer.parameters()[0].value()[0] == before);
  const double loss = trainer.step(rnd<2>({8, 6}, 62), labels_for(8));
  CHECK(std::isfinite(loss));
  CHECK(trainer.accuracy(rnd<2>({8, 6}, 62), labels_for(8)) >= 0.0);
}

TEST_CASE("data parallel: a non-finite loss stops with an error naming the step, or is skipped on request",
          "[nn][data_parallel]") {
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  auto sgd = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.1}); };
  auto poisoned = rnd<2>({8, 6}, 70);
  poisoned(5, 2) = std::numeric_limits<double>::quiet_NaN();
  const auto good = rnd<2>({8, 6}, 71);
  auto values_of = [](const auto& trainer) {
    std::vector<double> all;
    for (const auto& p : trainer.parameters())
      for (double v : p.value()) all.push_back(v);
    return all;
  };
  {
    auto trainer = pdo::nn::make_data_parallel<double>(m, make_mlp, sgd);
    (void)trainer.step(good, labels_for(8));
    const auto before = values_of(trainer);
    CHECK_THROWS_WITH(trainer.step(poisoned, labels_for(8)), Catch::Contains("step 2") && Catch::Contains("the loss is nan") &&
                                                                 Catch::Contains("no parameter was updated"));
    CHECK(values_of(trainer) == before);
    CHECK(trainer.steps() == 1);  // a refused step is not counted
    CHECK(std::isfinite(trainer.step(good, labels_for(8))));
    // an infinite input makes a NaN of any sign: it is named "nan", not "-nan"
    auto infinite = good;
    infinite(2, 1) = std::numeric_limits<double>::infinity();
    CHECK_THROWS_WITH(trainer.step(infinite, labels_for(8)), Catch::Contains("the loss is nan;"));
  }
  {
    // nor does it move the learning-rate schedule: a refusal caught leaves the trainer as if
    // its batch had not been given
    const pdo::nn::data_parallel_options scheduled{.schedule = pdo::nn::step_lr(0.1, 1, 0.5)};
    auto steady = pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, scheduled);
    auto refused = pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, scheduled);
    for (int s = 0; s < 3; ++s) {
      if (s == 1) CHECK_THROWS_WITH(refused.step(poisoned, labels_for(8)), Catch::Contains("step 2"));
      CHECK(refused.step(good, labels_for(8)) == steady.step(good, labels_for(8)));
    }
    CHECK(values_of(refused) == values_of(steady));
    CHECK(refused.steps() == 3);
  }
  {
    auto trainer = pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, {.skip_nonfinite_steps = true});
    const auto before = values_of(trainer);
    CHECK(std::isnan(trainer.step(poisoned, labels_for(8))));
    CHECK(values_of(trainer) == before);
    // with clipping, a skipped step's norm is NaN, not the last step's
    auto clipping = pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, {.skip_nonfinite_steps = true, .clip_grad_norm = 1e-3});
    (void)clipping.step(good, labels_for(8));
    CHECK(clipping.last_grad_norm() > 1e-3);
    CHECK(std::isnan(clipping.step(poisoned, labels_for(8))));
    CHECK(std::isnan(clipping.last_grad_norm()));
    CHECK_THAT(clipping.explain(), Catch::Contains("clipped by their global norm (max 0.001)"));
    // fit leaves the skipped step out of the epoch's loss
    pdo::tensor<double, 2> data({16, 6});
    std::copy_n(good.data(), good.size(), data.data());
    std::copy_n(poisoned.data(), poisoned.size(), data.data() + good.size());
    trainer.fit(data, labels_for(16), {.epochs = 1, .batch_size = 8, .shuffle = false}, [](const auto& s) {
      CHECK(s.skipped_steps == 1);
      CHECK(s.samples == 8);
      CHECK(std::isfinite(s.loss));
    });
  }
}

TEST_CASE("nn: parameters have typed shapes; assign checks them and names a transposed weight", "[nn]") {
  pdo::nn::rng gen(3);
  pdo::nn::linear<double> layer(6, 4, gen);
  const auto ps = layer.parameters("fc.");
  REQUIRE(ps[0].rank() == 2);
  CHECK(ps[0].shape<2>() == shape_t<2>{6, 4});
  CHECK(ps[1].extents() == std::vector<std::size_t>{4});
  CHECK_THROWS_AS(ps[0].shape<1>(), pdo::shape_error);
  const auto w = rnd<2>({6, 4}, 80);
  ps[0].assign(w);
  CHECK(pdo_test::equal(layer.weight.value(), w));
  // a PyTorch nn.Linear weight is [out, in]: its shape here is the transpose of pdo's
  CHECK_THROWS_WITH(ps[0].assign(rnd<2>({4, 6}, 81)), Catch::Contains("parameter fc.weight") && Catch::Contains("[4, 6]") &&
                                                          Catch::Contains("its transpose"));
  CHECK_THROWS_AS(ps[1].assign(rnd<1>({5}, 82)), pdo::shape_error);
  CHECK(pdo_test::equal(layer.weight.value(), w));  // nothing written by a refused assign
  // a dtensor parameter takes each local shard's part
  const auto mesh = pdo::make_mesh<"tp">(pdo::cpu_places(3));
  auto split_weight = pdo::parameter(pdo::distribute<pdo::layout<pdo::replicate, pdo::split<"tp">>>(mesh, rnd<2>({6, 4}, 83)));
  pdo::nn::parameter_ref<double> ref("w", split_weight);
  CHECK(ref.shape<2>() == shape_t<2>{6, 4});
  // what the parameter's type says: a dtensor or not, with pending sums or not
  CHECK((ref.distributed() && !ref.partial() && ref.mesh_places().size() == 3));
  CHECK((!ps[0].distributed() && !ps[0].partial() && ps[0].mesh_places().empty()));
  auto summed = pdo::parameter(pdo::distribute<pdo::layout<pdo::replicate, pdo::replicate>::partial<"tp">>(mesh, rnd<2>({6, 4}, 84)));
  const pdo::nn::parameter_ref<double> pending("s", summed);
  CHECK((pending.distributed() && pending.partial()));
  ref.assign(w);
  CHECK(pdo_test::equal(pdo::gather(split_weight.value()), w));
}

TEST_CASE("nn: max and average pooling of batch- or channel-split dtensors equal one place, forward and backward", "[nn]") {
  const auto x = rnd<4>({5, 3, 6, 6}, 90);
  auto check = [&](auto pool, const auto& mesh, auto layout_tag) {
    using L = typename decltype(layout_tag)::type;
    CAPTURE(mesh.describe(), pdo::layout_name<L>());
    auto local = pdo::parameter(x);
    const auto y = pool(local);
    pdo::backward(pdo::sum(y * y));
    auto d = pdo::parameter(pdo::distribute<L>(mesh, x));
    const auto yd = pool(d);
    static_assert(std::is_same_v<typename std::remove_cvref_t<decltype(yd.value())>::layout_type, L>);
    pdo::backward(pdo::sum(yd * yd));
    CHECK(pdo_test::close(pdo::gather(yd.value()), y.value(), 1e-15));
    CHECK(pdo_test::close(pdo::gather(d.grad()), local.grad(), 1e-15));
  };
  using pdo::replicate;
  using batch = pdo::layout<pdo::split<"x">, replicate, replicate, replicate>;
  using channels = pdo::layout<replicate, pdo::split<"x">, replicate, replicate>;
  using both = pdo::layout<pdo::split<"x">, pdo::split<"y">, replicate, replicate>;
  auto max_pool = [](const auto& v) { return pdo::nn::max_pool2d{}(v); };
  auto avg_pool = [](const auto& v) { return pdo::avg_pool2d(v, 3, {2, 1}); };
  for (std::size_t n : pdo_test::line_sizes()) {
    const auto mesh = pdo::make_mesh<"x", "y">(pdo::cpu_places(n), {n, 1});
    check(max_pool, mesh, std::type_identity<batch>{});
    check(avg_pool, mesh, std::type_identity<channels>{});
  }
  const auto grid = pdo::make_mesh<"x", "y">(pdo::cpu_places(4), {2, 2});
  check(max_pool, grid, std::type_identity<both>{});
  check(avg_pool, grid, std::type_identity<both>{});
}

TEST_CASE("nn: optimizers share one interface; any_optimizer holds one chosen at run time", "[nn]") {
  static_assert(pdo::nn::optimizer<pdo::nn::sgd<double>, double>);
  static_assert(pdo::nn::optimizer<pdo::nn::adam<double>, double>);
  static_assert(!pdo::nn::optimizer<int, double>);
  auto run = [](bool use_adam) {
    pdo::nn::rng gen(4);
    pdo::nn::linear<double> layer(3, 2, gen);
    pdo::nn::any_optimizer<double> opt = use_adam ? pdo::nn::any_optimizer<double>(pdo::nn::adam<double>(layer.parameters(), {.lr = 0.1}))
                                                  : pdo::nn::any_optimizer<double>(pdo::nn::sgd<double>(layer.parameters(), {.lr = 0.1}));
    const auto x = pdo::var(rnd<2>({4, 3}, 91));
    opt.zero_grad();
    pdo::backward(pdo::sum(layer(x)));
    opt.step();
    opt.set_lr(0.05);
    CHECK(opt.lr() == 0.05);
    CHECK(opt.parameters().size() == 2);
    return layer.weight.value();
  };
  // the same update as the optimizer held directly
  pdo::nn::rng gen(4);
  pdo::nn::linear<double> direct(3, 2, gen);
  pdo::nn::sgd<double> sgd(direct.parameters(), {.lr = 0.1});
  pdo::backward(pdo::sum(direct(pdo::var(rnd<2>({4, 3}, 91)))));
  sgd.step();
  CHECK(pdo_test::equal(run(false), direct.weight.value()));
  CHECK(!pdo_test::equal(run(true), direct.weight.value()));
  // and trainers take it: the optimizer chosen when the program runs
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  const bool use_adam = m.size() == 2;
  auto trainer = pdo::nn::make_data_parallel<double>(m, make_mlp, [&](auto ps) -> pdo::nn::any_optimizer<double> {
    if (use_adam) return pdo::nn::adam<double>(std::move(ps), {.lr = 0.01});
    return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.01});
  });
  CHECK(std::isfinite(trainer.step(rnd<2>({8, 6}, 92), labels_for(8))));
}

namespace {

/// @brief The values of the parameters of `trainer`'s replica `k`, flattened one after another.
template <class Trainer>
std::vector<double> values_of(const Trainer& trainer, std::size_t k = 0) {
  std::vector<double> out;
  for (const auto& p : trainer.parameters(k)) out.insert(out.end(), p.value().begin(), p.value().end());
  return out;
}

void check_close(const std::vector<double>& a, const std::vector<double>& b, double eps) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO("element " << i);
    CHECK(a[i] == Approx(b[i]).epsilon(eps).margin(1e-15));
  }
}

}  // namespace

TEST_CASE("data parallel: the gradients' sync fused with the optimizer's update gives the unfused trainer's values, bit for bit",
          "[nn][data_parallel]") {
  // 11 rows in global batches of 4: 4, 4, 3 (uneven over 2 and 3 places; a place of 1 mesh);
  // 512-byte buckets pack several parameters, and a bucket's range cuts parameters apart
  const auto x = rnd<2>({11, 6}, 60);
  const auto y = labels_for(11);
  using any = pdo::nn::any_optimizer<double>;
  const std::vector<std::pair<const char*, std::function<any(std::vector<pdo::nn::parameter_ref<double>>)>>> optimizers{
      {"sgd", [](auto ps) -> any { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.05}); }},
      {"sgd with momentum and decay", [](auto ps) -> any { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3}); }},
      {"adam", [](auto ps) -> any { return pdo::nn::adam<double>(std::move(ps), {.lr = 0.01, .weight_decay = 1e-3}); }},
      {"adamw", [](auto ps) -> any { return pdo::nn::adam<double>(std::move(ps), pdo::nn::adamw_options(0.01)); }}};
  for (const auto& [name, make_optimizer] : optimizers)
    for (std::size_t places : {1, 2, 3})
      for (std::size_t bucket_bytes : {std::size_t{512}, std::size_t{1} << 20}) {
        INFO(name << " on " << places << " places, buckets of " << bucket_bytes << " B");
        const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(places));
        auto fused = pdo::nn::make_data_parallel<double>(m, make_mlp, make_optimizer, {.bucket_bytes = bucket_bytes, .fused_update = true});
        auto plain = pdo::nn::make_data_parallel<double>(m, make_mlp, make_optimizer, {.bucket_bytes = bucket_bytes, .fused_update = false});
        REQUIRE(fused.fused_update());
        REQUIRE(!plain.fused_update());
        CHECK_THAT(fused.explain(), Catch::Contains("fused with the optimizer's update"));
        for (int epoch = 0; epoch < 2; ++epoch)
          for (std::size_t first = 0; first < 11; first += 4) {
            const std::size_t rows = std::min<std::size_t>(4, 11 - first);
            dt<2> xb({rows, 6});
            pdo::tensor<int, 1> yb({rows});
            std::copy_n(x.data() + first * 6, rows * 6, xb.data());
            std::copy_n(y.data() + first, rows, yb.data());
            CHECK(fused.step(xb, yb) == plain.step(xb, yb));
          }
        for (std::size_t k = 0; k < places; ++k) CHECK(values_of(fused, k) == values_of(plain, k));
        CHECK(fused.optimizer().steps() == plain.optimizer().steps());
        // the buckets' collectives ran after backward, queued by it, one per bucket
        const auto events = fused.last_step_events();
        std::size_t collectives = 0;
        for (std::size_t p = 0; p < places; ++p) {
          double backward_end = -1;
          for (const auto& e : events)
            if (e.place == p && e.what == "backward") backward_end = e.end_us;
          for (const auto& e : events)
            if (e.place == p && e.what == "all_reduce") {
              ++collectives;
              CHECK(e.start_us >= backward_end);
            }
        }
        CHECK(collectives == places * fused.buckets().size());
      }
  // where it does not apply, the trainer syncs and steps as before
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  const auto sgd = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.05}); };
  CHECK(!pdo::nn::make_data_parallel<double>(m, make_mlp, sgd).fused_update());  // not by default
  CHECK(!pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, {.zero1 = true, .fused_update = true}).fused_update());
  CHECK(!pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, {.clip_grad_norm = 1.0, .fused_update = true}).fused_update());
  // explain says so
  CHECK_THAT(pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, {.zero1 = true, .fused_update = true}).explain(),
             Catch::Contains("fused_update was asked for and is not used"));
  CHECK_THAT(pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, {.fused_update = true}).explain(),
             !Catch::Contains("fused_update was asked for"));
  // an optimizer of only some of the parameters updates those only, fused too
  auto frozen = pdo::nn::make_data_parallel<double>(
      m, make_mlp,
      [](auto ps) {
        ps.erase(ps.begin());  // the first layer's weight stays as it is
        return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.05});
      },
      {.fused_update = true});
  CHECK(frozen.fused_update());
  const auto before = std::vector<double>(frozen.parameters()[0].value().begin(), frozen.parameters()[0].value().end());
  const auto bias_before = std::vector<double>(frozen.parameters()[1].value().begin(), frozen.parameters()[1].value().end());
  (void)frozen.step(rnd<2>({8, 6}, 61), labels_for(8));
  CHECK(std::vector<double>(frozen.parameters()[0].value().begin(), frozen.parameters()[0].value().end()) == before);
  CHECK(std::vector<double>(frozen.parameters()[1].value().begin(), frozen.parameters()[1].value().end()) != bias_before);
  // buckets under ZeRO-1 reduce_scatter their gradients: a fused update is refused, not skipped
  pdo::nn::gradient_buckets<double, pdo::mesh<"dp">, "dp"> sliced(m, 0, frozen.parameters(0), {.zero1 = true});
  CHECK_THROWS_WITH(sliced.sync_and_update(std::vector<pdo::nn::element_update<double>>(frozen.parameters(0).size())),
                    Catch::Contains("sync_and_update") && Catch::Contains("ZeRO-1"));
}

namespace {

/// @brief Whether branchy's middle layer runs (every replica reads it; tests set it between steps).
bool use_branch = true;

/// @brief An MLP whose middle layer runs only while use_branch is set: in the other steps no
/// place's backward reaches its parameters.
struct branchy {
  pdo::nn::linear<double> in, branch, head;
  branchy() : branchy(pdo::nn::rng(21)) {}
  explicit branchy(pdo::nn::rng gen) : in(6, 8, gen), branch(8, 8, gen), head(8, 4, gen) {}
  template <class V>
  auto operator()(const pdo::var<V>& x) const {
    auto h = pdo::relu(in(x));
    if (use_branch) h = pdo::tanh(branch(h)) + h;
    return head(h);
  }
  [[nodiscard]] std::vector<pdo::nn::parameter_ref<double>> parameters(const std::string& prefix = "") const {
    auto out = in.parameters(prefix + "in.");
    for (const auto& p : branch.parameters(prefix + "branch.")) out.push_back(p);
    for (const auto& p : head.parameters(prefix + "head.")) out.push_back(p);
    return out;
  }
};

}  // namespace

TEST_CASE("data parallel: a parameter no place's backward reaches in a step is left alone by the update, as on one place",
          "[nn][data_parallel]") {
  // 7 rows over 1-3 places (3 places: 3, 2, 2 rows; 2 micro-batches leave a place none); the
  // branch runs in steps 0 and 3 only, so weight decay, momentum and Adam's per-parameter step
  // count must not move it in the others (they would with zero gradients)
  const auto x = rnd<2>({7, 6}, 70);
  const auto y = labels_for(7);
  const std::vector<bool> uses{true, false, false, true, false};
  using any = pdo::nn::any_optimizer<double>;
  const std::vector<std::pair<const char*, std::function<any(std::vector<pdo::nn::parameter_ref<double>>)>>> optimizers{
      {"sgd with momentum and decay", [](auto ps) -> any { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.05, .momentum = 0.9, .weight_decay = 0.1}); }},
      {"adam with decay", [](auto ps) -> any { return pdo::nn::adam<double>(std::move(ps), {.lr = 0.01, .weight_decay = 0.1}); }}};
  for (const auto& [name, make_optimizer] : optimizers) {
    branchy model;
    auto opt = make_optimizer(model.parameters());
    for (const bool u : uses) {
      use_branch = u;
      opt.zero_grad();
      pdo::backward(pdo::cross_entropy(model(pdo::var(x)), y));
      opt.step();
    }
    std::vector<double> expected, branch_start;
    for (const auto& p : model.parameters()) expected.insert(expected.end(), p.value().begin(), p.value().end());
    for (const auto& p : branchy().branch.parameters()) branch_start.insert(branch_start.end(), p.value().begin(), p.value().end());
    for (std::size_t places : {1, 2, 3})
      for (const bool fused : {false, true})
        for (const std::size_t micro : {1, 2}) {
          INFO(name << " on " << places << " places, fused " << fused << ", " << micro << " micro-batches");
          auto trainer = pdo::nn::make_data_parallel<double>(pdo::make_mesh<"dp">(pdo::cpu_places(places)), [] { return branchy(); },
                                                             make_optimizer, {.bucket_bytes = 512, .fused_update = fused});
          CHECK(trainer.fused_update() == fused);
          for (const bool u : uses) {
            use_branch = u;
            (void)trainer.step(x, y, micro);
          }
          for (std::size_t k = 0; k < places; ++k) check_close(values_of(trainer, k), expected, 1e-12);
          // the branch did move in its steps (what is compared above is not its start)
          std::vector<double> branch_now;
          for (const auto& p : trainer.model(0).branch.parameters()) branch_now.insert(branch_now.end(), p.value().begin(), p.value().end());
          CHECK(branch_now != branch_start);
        }
  }
  use_branch = true;
}

namespace {

/// @brief A square weight used three times: as x W twice (two products' gradients) and as
/// Wᵀ (a gradient that is not a product's right operand), between two other layers.
struct tied_mlp {
  pdo::nn::linear<double> in, square, head;
  template <class V>
  auto operator()(const pdo::var<V>& x) const {
    const auto h = pdo::relu(square(in(x)));
    const auto z = square(h) + pdo::matmul(h, pdo::transpose(square.weight));
    return head(pdo::tanh(z));
  }
  [[nodiscard]] std::vector<pdo::nn::parameter_ref<double>> parameters(const std::string& prefix = "") const {
    auto out = in.parameters(prefix + "in.");
    for (const auto& more : {square.parameters(prefix + "square."), head.parameters(prefix + "head.")}) out.insert(out.end(), more.begin(), more.end());
    return out;
  }
};

/// @brief Two experts of one shape, the rows' first value choosing which one a place's
/// rows go through: a path that depends on the data.
struct routed_mlp {
  pdo::nn::linear<double> first, second, head;
  template <class V>
  auto operator()(const pdo::var<V>& x) const {
    const bool pick_first = x.value().data()[0] > 0;
    return head(pdo::relu(pick_first ? first(x) : second(x)));
  }
  [[nodiscard]] std::vector<pdo::nn::parameter_ref<double>> parameters(const std::string& prefix = "") const {
    auto out = first.parameters(prefix + "first.");
    for (const auto& more : {second.parameters(prefix + "second."), head.parameters(prefix + "head.")}) out.insert(out.end(), more.begin(), more.end());
    return out;
  }
};

tied_mlp make_tied() {
  pdo::nn::rng gen(12);
  return {pdo::nn::linear<double>(6, 16, gen), pdo::nn::linear<double>(16, 16, gen), pdo::nn::linear<double>(16, 4, gen)};
}

/// @brief Trains `make_model`'s model on the 11 rows of `x`, `y` in global batches of 4 (4,
/// 4, 3), two epochs, the second batch of each epoch in 2 micro-batches; returns the losses.
template <class Trainer>
std::vector<double> train_batches(Trainer& trainer, const dt<2>& x, const pdo::tensor<int, 1>& y) {
  std::vector<double> losses;
  for (int epoch = 0; epoch < 2; ++epoch)
    for (std::size_t first = 0; first < 11; first += 4) {
      const std::size_t rows = std::min<std::size_t>(4, 11 - first);
      dt<2> xb({rows, 6});
      pdo::tensor<int, 1> yb({rows});
      std::copy_n(x.data() + first * 6, rows * 6, xb.data());
      std::copy_n(y.data() + first, rows, yb.data());
      losses.push_back(trainer.step(xb, yb, first == 4 ? 2 : 1));
    }
  return losses;
}

}  // namespace

TEST_CASE("data parallel: sliced weight gradients, the SGD update folded into each place's rows of the product, train as one place does",
          "[nn][data_parallel]") {
  // batches of 4, 4 (in 2 micro-batches: gradients all_reduced instead), 3 rows (on 4 places
  // one place has none: the same); weights of 6 and 16 rows cut unevenly over 3 and 4; the
  // head's weight, 16 x 4, all_reduced in the 4-row steps (its operands' rows cost more)
  const auto x = rnd<2>({11, 6}, 62);
  const auto y = labels_for(11);
  using any = pdo::nn::any_optimizer<double>;
  const std::vector<std::pair<const char*, std::function<any(std::vector<pdo::nn::parameter_ref<double>>)>>> optimizers{
      {"sgd", [](auto ps) -> any { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.05}); }},
      {"sgd with weight decay", [](auto ps) -> any { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.05, .weight_decay = 0.01}); }}};
  const auto check_model = [&](auto make_model, const char* model, bool products_only) {
    for (const auto& [name, make_optimizer] : optimizers) {
      auto one = pdo::nn::make_data_parallel<double>(pdo::make_mesh<"dp">(pdo::cpu_places(1)), make_model, make_optimizer,
                                                     {.schedule = pdo::nn::step_lr(0.05, 2, 0.5)});
      const auto reference = train_batches(one, x, y);
      for (std::size_t places : {1, 2, 3, 4}) {
        INFO(model << ", " << name << ", " << places << " places");
        const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(places));
        auto sliced = pdo::nn::make_data_parallel<double>(m, make_model, make_optimizer,
                                                          {.schedule = pdo::nn::step_lr(0.05, 2, 0.5), .sliced_weight_gradients = true});
        REQUIRE(sliced.sliced_weight_gradients());
        CHECK_THAT(sliced.explain(), Catch::Contains("with the SGD update folded in"));
        const auto losses = train_batches(sliced, x, y);
        for (std::size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == Approx(reference[s]).epsilon(1e-12));
        check_close(values_of(sliced), values_of(one), 1e-11);
        CHECK_NOTHROW(sliced.check_replicas());  // each place's rows reached every replica
        // the first weight's gradient, all products', went into the update: backward left it
        // none (the last batch, 3 rows, leaves one of 4 places none: all_reduced instead)
        const auto params = sliced.parameters();
        CHECK(params[0].grad_blocks().empty() == (places < 4));
        // the square weight also used as Wᵀ gets that gradient too, all_reduced and applied
        if (!products_only) CHECK(!params[2].grad_blocks().empty());
      }
    }
  };
  check_model(make_mlp, "mlp", true);
  check_model(make_tied, "a weight used twice as x W and once as Wᵀ", false);

  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  const auto sgd = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.05}); };
  SECTION("a step whose loss is not finite runs no backward and changes nothing") {
    auto trainer = pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, {.skip_nonfinite_steps = true, .sliced_weight_gradients = true});
    REQUIRE(trainer.sliced_weight_gradients());
    const auto before = values_of(trainer);
    auto bad = rnd<2>({4, 6}, 63);
    bad(3, 2) = std::numeric_limits<double>::quiet_NaN();
    CHECK(std::isnan(trainer.step(bad, labels_for(4))));
    CHECK(values_of(trainer) == before);
    CHECK(values_of(trainer, 1) == before);
    CHECK(std::isfinite(trainer.step(rnd<2>({4, 6}, 64), labels_for(4))));
    CHECK(values_of(trainer) != before);
  }
  SECTION("each weight's way, by bytes: its operands' rows gathered, or its product all_reduced") {
    auto trainer = pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, {.sliced_weight_gradients = true});
    (void)trainer.step(rnd<2>({4, 6}, 68), labels_for(4));
    const auto params = trainer.parameters();
    CHECK(params[0].grad_blocks().empty());   // 6 x 16: 4 rows x (6 + 16) = 88 < 96, gathered
    CHECK(!params[4].grad_blocks().empty());  // 16 x 4: 4 x 20 = 80 >= 64, all_reduced
    CHECK_NOTHROW(trainer.check_replicas());
  }
  SECTION("places whose backward passes reach different weights: a mismatch_error on every place, not mixed weights") {
    const auto make_routed = [] {
      pdo::nn::rng gen(13);
      return routed_mlp{pdo::nn::linear<double>(6, 16, gen), pdo::nn::linear<double>(6, 16, gen), pdo::nn::linear<double>(16, 4, gen)};
    };
    auto trainer = pdo::nn::make_data_parallel<double>(m, make_routed, sgd, {.sliced_weight_gradients = true});
    REQUIRE(trainer.sliced_weight_gradients());
    auto x = rnd<2>({4, 6}, 69);
    x(0, 0) = 1;   // place 0's rows: the first expert
    x(2, 0) = -1;  // place 1's: the second
    try {
      (void)trainer.step(x, labels_for(4));
      FAIL("the step went through");
    } catch (const pdo::mismatch_error& e) {
      CHECK_THAT(std::string(e.what()), Catch::Contains("reach different weights' products") && Catch::Contains("first.weight") &&
                                            Catch::Contains("second.weight"));
    }
    // the mesh goes on: a batch that takes one path on every place trains
    x(2, 0) = 1;
    CHECK(std::isfinite(trainer.step(x, labels_for(4))));
  }
  SECTION("where it does not apply the trainer runs as without it") {
    const auto adam = [](auto ps) { return pdo::nn::adam<double>(std::move(ps), {.lr = 0.01}); };
    const auto momentum = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.01, .momentum = 0.9}); };
    CHECK(!pdo::nn::make_data_parallel<double>(m, make_mlp, sgd).sliced_weight_gradients());  // not by default
    CHECK(!pdo::nn::make_data_parallel<double>(m, make_mlp, adam, {.sliced_weight_gradients = true}).sliced_weight_gradients());
    CHECK(!pdo::nn::make_data_parallel<double>(m, make_mlp, momentum, {.sliced_weight_gradients = true}).sliced_weight_gradients());
    CHECK(!pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, {.zero1 = true, .sliced_weight_gradients = true}).sliced_weight_gradients());
    auto with_adam = pdo::nn::make_data_parallel<double>(m, make_mlp, adam, {.sliced_weight_gradients = true});
    auto plain = pdo::nn::make_data_parallel<double>(m, make_mlp, adam);
    CHECK(!with_adam.fused_update());  // nor fused, as not asked
    CHECK(with_adam.step(rnd<2>({5, 6}, 65), labels_for(5)) == plain.step(rnd<2>({5, 6}, 65), labels_for(5)));
    CHECK(values_of(with_adam) == values_of(plain));
  }
  SECTION("the model outlives its trainer: backward adds its weights' gradients again") {
    std::optional<decltype(make_mlp())> model;
    {
      auto trainer = pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, {.sliced_weight_gradients = true});
      (void)trainer.step(rnd<2>({4, 6}, 66), labels_for(4));
      model.emplace(trainer.model());  // shares the replica's parameters
    }
    pdo::backward(pdo::cross_entropy((*model)(pdo::var(rnd<2>({3, 6}, 67))), labels_for(3)));
    for (const auto& p : pdo::nn::parameters_of<double>(*model)) CHECK(!p.grad_blocks().empty());
  }
}

TEST_CASE("data parallel: replicas start equal by a broadcast from place 0, and can be checked", "[nn][data_parallel]") {
  // a factory that builds a different replica on every place
  std::atomic<unsigned> seed{100};
  auto make_different = [&] {
    pdo::nn::rng gen(seed++);
    return pdo::nn::sequential(pdo::nn::linear<double>(6, 16, gen), pdo::nn::relu{}, pdo::nn::linear<double>(16, 4, gen));
  };
  auto sgd = [](auto params) { return pdo::nn::sgd<double>(std::move(params), {.lr = 0.1}); };
  for (std::size_t places : {2, 3, 4}) {
    INFO(places << " places");
    const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(places));
    auto trainer = pdo::nn::make_data_parallel<double>(m, make_different, sgd);
    for (std::size_t k = 1; k < places; ++k) CHECK(values_of(trainer, k) == values_of(trainer));
    CHECK_NOTHROW(trainer.check_replicas());
    trainer.step(rnd<2>({10, 6}, 93), labels_for(10));
    for (std::size_t k = 1; k < places; ++k) CHECK(values_of(trainer, k) == values_of(trainer));
    CHECK_NOTHROW(trainer.check_replicas());

    // without the broadcast the replicas differ, and the check says where
    auto unsynced = pdo::nn::make_data_parallel<double>(m, make_different, sgd, {.broadcast_parameters = false});
    CHECK(values_of(unsynced, 1) != values_of(unsynced));
    CHECK_THROWS_WITH(unsynced.check_replicas(), Catch::Contains("replicas differ") && Catch::Contains("parameter 0.weight") &&
                                                     Catch::Contains("at element 0"));
    CHECK_THROWS_WITH(pdo::nn::make_data_parallel<double>(m, make_different, sgd, {.broadcast_parameters = false, .check_replicas = true}),
                      Catch::Contains("replicas differ"));

    // replicas of different shapes: the broadcast would mismatch sizes; the first parameter that differs is named
    std::atomic<std::size_t> made{0};
    auto make_wider_last = [&] {
      pdo::nn::rng gen(5);
      const std::size_t hidden = made++ + 1 == places ? 17 : 16;
      return pdo::nn::sequential(pdo::nn::linear<double>(6, hidden, gen), pdo::nn::relu{}, pdo::nn::linear<double>(hidden, 4, gen));
    };
    CHECK_THROWS_WITH((pdo::nn::make_data_parallel<double>(m, make_wider_last, sgd)),
                      Catch::Contains("the replicas differ: parameter 0.weight has ") && Catch::Contains(" on place cpu:0") &&
                          Catch::Contains("one architecture"));
  }
}

TEST_CASE("data parallel: micro-batches accumulate gradients without syncing, one update equals the whole batch's",
          "[nn][data_parallel]") {
  const auto x = rnd<2>({32, 6}, 94);
  const auto y = labels_for(32);
  auto adam = [](auto params) { return pdo::nn::adam<double>(std::move(params), {.lr = 0.01}); };
  for (std::size_t places : {1, 3, 4}) {
    INFO(places << " places");
    const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(places));
    auto whole = pdo::nn::make_data_parallel<double>(m, make_mlp, adam, {.bucket_bytes = 512});
    auto micro = pdo::nn::make_data_parallel<double>(m, make_mlp, adam, {.bucket_bytes = 512});
    for (int s = 0; s < 3; ++s) {
      const double a = whole.step(x, y);
      const double b = micro.step(x, y, 4);  // 4 micro-steps of 8 rows
      CHECK(b == Approx(a).epsilon(1e-12));
      check_close(values_of(micro), values_of(whole), 1e-12);
    }
    // the buckets synced once, after the last micro-batch: as many collectives as buckets, and
    // none before the last backward began
    const auto events = micro.last_step_events();
    std::size_t collectives = 0, backwards = 0;
    double last_backward_start = 0, first_collective = 1e300;
    for (const auto& e : events) {
      if (e.place != 0) continue;
      if (e.what == "backward") {
        ++backwards;
        last_backward_start = std::max(last_backward_start, e.start_us);
      }
      if (e.what == "all_reduce") {
        ++collectives;
        first_collective = std::min(first_collective, e.queued_us);
      }
    }
    CHECK(backwards == 4);
    CHECK(collectives == micro.buckets().size());
    CHECK(first_collective >= last_backward_start);
  }
  // fit takes micro-batches too: the same epoch as whole batches
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  auto whole = pdo::nn::make_data_parallel<double>(m, make_mlp, adam);
  auto micro = pdo::nn::make_data_parallel<double>(m, make_mlp, adam);
  double a = 0, b = 0;
  whole.fit(x, y, {.epochs = 2, .batch_size = 16, .seed = 3}, [&](const auto& s) { a = s.loss; });
  micro.fit(x, y, {.epochs = 2, .batch_size = 16, .seed = 3, .micro_batches = 3}, [&](const auto& s) { b = s.loss; });
  CHECK(b == Approx(a).epsilon(1e-12));
  check_close(values_of(micro), values_of(whole), 1e-12);
  CHECK_THROWS_WITH(micro.step(x, y, 0), Catch::Contains("micro_batches must be at least 1"));
  // an epoch's accuracy counts that epoch's steps only, not step() calls made before fit: with
  // a learning rate of 0 it is the accuracy of the unchanged model on the same rows
  auto still = pdo::nn::make_data_parallel<double>(m, make_mlp, [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.0}); });
  for (int s = 0; s < 3; ++s) (void)still.step(x, y);
  const double expected = still.accuracy(x, y);
  // a label that is no class is named, not counted as a wrong answer
  auto bad = y;
  bad(bad.extent(0) - 1) = 4;
  CHECK_THROWS_WITH(still.accuracy(x, bad), Catch::Contains("data_parallel::accuracy: 1 label of the batch is not a class index in [0, 4)") &&
                                                Catch::Contains("the first is 4, at row " + std::to_string(bad.extent(0) - 1)));
  std::vector<double> seen;
  still.fit(x, y, {.epochs = 2, .batch_size = 5, .seed = 3}, [&](const auto& s) { seen.push_back(s.accuracy); });
  REQUIRE(seen.size() == 2);
  for (const double acc : seen) CHECK(acc == Approx(expected).epsilon(1e-12));
}

TEST_CASE("data parallel: a regression with mse_loss, the same on 1 and 3 places; targets of another shape are refused", "[nn][data_parallel]") {
  const auto x = rnd<2>({11, 6}, 131);
  const auto t = rnd<2>({11, 4}, 132);
  auto sgd = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.05, .momentum = 0.9}); };
  auto one = pdo::nn::make_data_parallel<double>(pdo::make_mesh<"dp">(pdo::cpu_places(1)), make_mlp, sgd, {}, pdo::nn::mse_loss{});
  auto three = pdo::nn::make_data_parallel<double>(pdo::make_mesh<"dp">(pdo::cpu_places(3)), make_mlp, sgd, {}, pdo::nn::mse_loss{});
  // the loss by hand, on the model as it starts
  auto model = make_mlp();
  const auto out = model(pdo::var(x)).value();
  double expected = 0;
  for (std::size_t i = 0; i < 11; ++i)
    for (std::size_t j = 0; j < 4; ++j) expected += (out(i, j) - t(i, j)) * (out(i, j) - t(i, j)) / 44.0;
  for (int s = 0; s < 3; ++s) {
    const double a = one.step(x, t), b = three.step(x, t);
    if (s == 0) CHECK(a == Approx(expected).epsilon(1e-12));
    CHECK(b == Approx(a).epsilon(1e-12));
  }
  check_close(values_of(three), values_of(one), 1e-12);
  const auto column = rnd<2>({11, 1}, 133);
  CHECK_THROWS_AS(three.step(x, column), pdo::shape_error);
  CHECK_THROWS_WITH(one.step(x, column), Catch::Contains("nn::mse_loss") && Catch::Contains("[11, 4]") && Catch::Contains("[11, 1]"));
  CHECK(three.step(x, t) == Approx(one.step(x, t)).epsilon(1e-12));  // both go on after the refusal
}

TEST_CASE("data parallel: gradients clipped by their global norm, the same on 1 and 4 places and as the formula", "[nn][data_parallel]") {
  const auto x = rnd<2>({12, 6}, 95);
  const auto y = labels_for(12);
  const double lr = 0.1, max_norm = 0.05;
  // the formula, on one model by hand
  auto model = make_mlp();
  const auto params = pdo::nn::parameters_of<double>(model);
  std::vector<double> before, expected;
  for (const auto& p : params) before.insert(before.end(), p.value().begin(), p.value().end());
  pdo::backward(pdo::nn::cross_entropy_loss{}(model(pdo::var(x)), y));
  double squared = 0;
  for (const auto& p : params)
    for (double g : p.grad()) squared += g * g;
  const double norm = std::sqrt(squared);
  REQUIRE(norm > max_norm);  // so the clip bites
  const double factor = max_norm / (norm + 1e-6);
  std::size_t at = 0;
  for (const auto& p : params)
    for (double g : p.grad()) expected.push_back(before[at++] - lr * factor * g);

  auto sgd = [&](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = lr}); };
  for (std::size_t places : {1, 4}) {
    for (bool zero1 : {false, true}) {
      INFO(places << " places, ZeRO-1 " << zero1);
      const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(places));
      auto trainer = pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, {.bucket_bytes = 512, .zero1 = zero1, .clip_grad_norm = max_norm});
      trainer.step(x, y);
      CHECK(trainer.last_grad_norm() == Approx(norm).epsilon(1e-12));
      for (std::size_t k = 0; k < places; ++k) check_close(values_of(trainer, k), expected, 1e-12);
    }
  }
  // a norm under the limit leaves the gradients alone
  auto model2 = make_mlp();
  const auto params2 = pdo::nn::parameters_of<double>(model2);
  pdo::backward(pdo::nn::cross_entropy_loss{}(model2(pdo::var(x)), y));
  const std::vector<double> g0(params2[0].grad().begin(), params2[0].grad().end());
  CHECK(pdo::nn::clip_grad_norm(params2, 10 * norm) == Approx(norm).epsilon(1e-12));
  CHECK(std::vector<double>(params2[0].grad().begin(), params2[0].grad().end()) == g0);
  CHECK_THROWS_WITH(pdo::nn::clip_grad_norm(params2, 0.0), Catch::Contains("clip_grad_norm: max_norm must be positive"));
}

TEST_CASE("nn: clip_grad_norm over dtensor parameters counts every element once, whatever the layout", "[nn][mesh]") {
  using rows = pdo::layout<pdo::split<"x">, pdo::replicate>;
  using whole = pdo::layout<pdo::replicate, pdo::replicate>;
  const auto x = rnd<2>({4, 7}, 96), w1 = rnd<2>({7, 5}, 97), w2 = rnd<2>({5, 3}, 98);
  auto program = [](const auto& X, const auto& W1, const auto& W2) { return pdo::sum(pdo::tanh(pdo::matmul(pdo::matmul(X, W1), W2))); };
  auto W1 = pdo::parameter(w1), W2 = pdo::parameter(w2);
  pdo::backward(program(pdo::var(x), W1, W2));
  const std::vector<pdo::nn::parameter_ref<double>> local{{"w1", W1}, {"w2", W2}};
  const double max_norm = 0.3;
  const double norm = pdo::nn::clip_grad_norm(local, max_norm);
  REQUIRE(norm > max_norm);
  for (std::size_t n : pdo_test::line_sizes()) {
    INFO(n << " places");
    const auto m = pdo_test::line_mesh(n);
    auto dW1 = pdo::parameter(pdo::distribute<rows>(m, w1));  // 7 rows: uneven shards
    auto dW2 = pdo::parameter(pdo::distribute<whole>(m, w2));  // on every place: counted once
    pdo::backward(program(pdo::var(pdo::distribute<whole>(m, x)), dW1, dW2));
    const std::vector<pdo::nn::parameter_ref<double>> distributed{{"w1", dW1}, {"w2", dW2}};
    CHECK(pdo::nn::clip_grad_norm(distributed, max_norm) == Approx(norm).epsilon(1e-12));
    const auto g1 = pdo::gather(dW1.grad()), g2 = pdo::gather(dW2.grad());
    for (std::size_t i = 0; i < g1.size(); ++i) CHECK(g1.data()[i] == Approx(W1.grad().data()[i]).epsilon(1e-12));
    for (std::size_t i = 0; i < g2.size(); ++i) CHECK(g2.data()[i] == Approx(W2.grad().data()[i]).epsilon(1e-12));
  }
  // a 2-D mesh: blocks split along both axes (uneven), and blocks replicated along one axis
  const double squared = norm * norm;  // (W1 and W2 were clipped above: norm is from before)
  for (const auto& [a, b] : {std::pair<std::size_t, std::size_t>{2, 2}, {3, 1}, {1, 3}}) {
    INFO(a << " x " << b << " places");
    const auto m = pdo_test::grid_mesh(a, b);
    auto dW1 = pdo::parameter(pdo::distribute<pdo::layout<pdo::split<"a">, pdo::split<"b">>>(m, w1));
    auto dW2 = pdo::parameter(pdo::distribute<pdo::layout<pdo::replicate, pdo::split<"b">>>(m, w2));
    pdo::backward(program(pdo::var(pdo::distribute<pdo::layout<pdo::replicate, pdo::replicate>>(m, x)), dW1, dW2));
    const std::vector<pdo::nn::parameter_ref<double>> distributed{{"w1", dW1}, {"w2", dW2}};
    CHECK(distributed[0].grad_squared_norm() + distributed[1].grad_squared_norm() == Approx(squared).epsilon(1e-12));
    CHECK(pdo::nn::clip_grad_norm(distributed, max_norm) == Approx(norm).epsilon(1e-12));
  }
}

TEST_CASE("nn: learning-rate schedules follow their formulas, and a trainer applies them step by step", "[nn]") {
  const auto step = pdo::nn::step_lr(0.1, 3, 0.5);
  const double steps[] = {0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025};
  for (std::size_t s = 0; s < 7; ++s) CHECK(step(s) == Approx(steps[s]).epsilon(1e-15));
  const auto cosine = pdo::nn::cosine_lr(1.0, 4, 12, 0.1);
  CHECK(cosine(0) == Approx(0.25));
  CHECK(cosine(1) == Approx(0.5));
  CHECK(cosine(3) == Approx(1.0));
  CHECK(cosine(4) == Approx(1.0));
  CHECK(cosine(6) == Approx(0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 2 / 8))));
  CHECK(cosine(8) == Approx(0.55));
  CHECK(cosine(12) == Approx(0.1));
  CHECK(cosine(1000) == Approx(0.1));
  CHECK(pdo::nn::constant_lr(0.3)(77) == 0.3);
  CHECK_THROWS_WITH(pdo::nn::step_lr(0.1, 0), Catch::Contains("step_lr: step_size must be at least 1"));
  CHECK_THROWS_WITH(pdo::nn::cosine_lr(0.1, 5, 4), Catch::Contains("cosine_lr: 5 warm-up steps exceed the 4 steps"));

  // a trainer with a schedule steps as one whose rate is set by hand before every step
  const auto x = rnd<2>({8, 6}, 99);
  const auto y = labels_for(8);
  auto sgd = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 1.0, .momentum = 0.9}); };
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  auto scheduled = pdo::nn::make_data_parallel<double>(m, make_mlp, sgd, {.schedule = pdo::nn::cosine_lr(0.2, 2, 5, 0.01)});
  auto by_hand = pdo::nn::make_data_parallel<double>(m, make_mlp, sgd);
  const auto rate = pdo::nn::cosine_lr(0.2, 2, 5, 0.01);
  for (std::size_t s = 0; s < 6; ++s) {
    for (std::size_t k = 0; k < by_hand.replica_count(); ++k) by_hand.optimizer(k).set_lr(rate(s));
    CHECK(scheduled.step(x, y) == by_hand.step(x, y));
    CHECK(scheduled.optimizer().lr() == rate(s));
  }
  CHECK(values_of(scheduled) == values_of(by_hand));

  // a rate the optimizer cannot take is refused before any place runs: nothing moves, on
  // the plain path and on the one whose weight products take the update in backward
  for (const bool sliced : {false, true}) {
    INFO("sliced_weight_gradients " << sliced);
    auto refusing = pdo::nn::make_data_parallel<double>(
        m, make_mlp, sgd,
        {.schedule = [](std::size_t s) { return s == 1 ? std::numeric_limits<double>::quiet_NaN() : 0.1; },
         .sliced_weight_gradients = sliced});
    refusing.step(x, y);
    const auto before = values_of(refusing);
    CHECK_THROWS_WITH(refusing.step(x, y), Catch::Contains("data_parallel::step: schedule(1)") && Catch::Contains("lr"));
    CHECK(refusing.steps() == 1);
    CHECK(values_of(refusing) == before);
    CHECK(refusing.optimizer().lr() == 0.1);
  }
}

TEST_CASE("spatial conv2d overlaps its halo exchange: the exchange on the communication lanes, the interior and the "
          "weight gradient on the compute lanes beside it",
          "[nn][conv][spatial][engine]") {
  using pdo::replicate;
  using H = pdo::layout<replicate, replicate, pdo::split<"sp">, replicate>;
  using HW = pdo::layout<replicate, replicate, pdo::split<"sh">, pdo::split<"sw">>;
  const auto x = rnd<4>({1, 3, 16, 12}, 7);
  const auto w = rnd<4>({4, 3, 3, 3}, 8);
  const auto b = rnd<1>({4}, 9);
  auto run = [&]<class L>(const auto& m, L) {
    auto X = pdo::parameter(pdo::distribute<L>(m, x));
    auto W = pdo::parameter(pdo::distribute<pdo::layout<replicate, replicate, replicate, replicate>>(m, w));
    auto B = pdo::parameter(pdo::distribute<pdo::layout<replicate>>(m, b));
    pdo::trace::start();
    const auto y = pdo::conv2d(X, W, B, {1, 1});
    pdo::backward(pdo::sum(y));
    pdo::trace::stop();
    const auto events = pdo::detail::trace_recorder::instance().events();
    for (std::size_t p = 0; p < m.size(); ++p) {
      INFO(m.place(p).name());
      // the tasks of each pass on this place, in submission order (ids grow with it)
      std::vector<const pdo::detail::timeline_event*> forward, backward;
      for (const auto& e : events) {
        if (e.id == 0 || e.track->place != m.place(p).name()) continue;
        if (e.name == "conv2d") forward.push_back(&e);
        if (e.name == "conv2d backward") backward.push_back(&e);
      }
      for (auto* pass : {&forward, &backward})
        std::sort(pass->begin(), pass->end(), [](auto* a, auto* b) { return a->id < b->id; });
      REQUIRE(forward.size() == 3);
      REQUIRE(backward.size() == 3);
      // forward: the interior's im2col, the halo exchange, then the frame and the gemm
      CHECK(forward[0]->track->lane == "compute");
      CHECK(forward[1]->track->lane == "communication");
      CHECK(std::string(forward[1]->category) == "collective");
      CHECK(forward[2]->track->lane == "compute");
      CHECK(forward[2]->start >= forward[1]->end);  // the frame reads the halo
      // backward: the input gradient, its halo rows sent back, the weight gradient beside it
      CHECK(backward[0]->track->lane == "compute");
      CHECK(backward[1]->track->lane == "communication");
      CHECK(backward[2]->track->lane == "compute");
      CHECK(backward[1]->start >= backward[0]->end);
      CHECK(std::find(backward[2]->after.begin(), backward[2]->after.end(), backward[1]->id) == backward[2]->after.end());
    }
    // and the result is one place's
    auto X1 = pdo::parameter(x), W1 = pdo::parameter(w);
    auto B1 = pdo::parameter(b);
    const auto y1 = pdo::conv2d(X1, W1, B1, {1, 1});
    pdo::backward(pdo::sum(y1));
    CHECK(pdo_test::close(pdo::gather(y.value()), y1.value(), 1e-12));
    CHECK(pdo_test::close(pdo::gather(X.grad()), X1.grad(), 1e-12));
    CHECK(pdo_test::close(pdo::gather(W.grad()), W1.grad(), 1e-12));
  };
  run(pdo::make_mesh<"sp">(pdo::cpu_places(2)), H{});
  run(pdo::make_mesh<"sh", "sw">(pdo::cpu_places(4), {2, 2}), HW{});
}

TEST_CASE("a trace outlives the places and threads that recorded it", "[trace]") {
  pdo::trace::start();
  {
    const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
    pdo::cpu_place_options o;
    o.name = "short-lived";
    o.pin = false;
    const auto other = pdo::make_mesh<"dp">(std::vector<pdo::cpu_place>{pdo::cpu_place(0, std::vector<int>{0}, o)});
    auto make = [] {
      pdo::nn::rng gen(3);
      return pdo::nn::sequential(pdo::nn::linear<double>(4, 4, gen));
    };
    auto trainer = pdo::nn::make_data_parallel<double>(m, make, [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.1}); });
    (void)trainer.step(rnd<2>({6, 4}, 70), labels_for(6));
    (void)pdo::gather(pdo::eval(pdo::distribute<pdo::layout<pdo::split<"dp">>>(other, rnd<1>({5}, 71)) * 2.0));
  }  // the places, their lanes and the trainer are gone
  pdo::trace::stop();
  const std::string json = pdo::trace::json();
  CHECK_THAT(json, Catch::Contains("\"name\":\"short-lived\"") && Catch::Contains("bucket all_reduce") &&
                       Catch::Contains("\"queued_on\":\"compute\"") && Catch::Contains("\"name\":\"queues\""));
}
