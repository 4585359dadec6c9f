// Pipeline parallelism: schedules checked before they run, GPipe and 1F1B training that
// matches one place step by step (dp x pp hybrids too), and 1F1B's bounded activations.
#include "model_support.hpp"

#include <pdo/nn.hpp>

#include <cmath>
#include <limits>
#include <vector>

namespace {
using pdo_test::labels_for;
using pdo_test::local_losses;
using pdo_test::make_mlp;
}  // namespace

TEST_CASE("pipeline schedules: GPipe and 1F1B are complete and deadlock-free; bad ones are rejected before running",
          "[model_parallel][pp]") {
  using pdo::nn::pipeline_schedule;
  for (auto kind : {pipeline_schedule::gpipe, pipeline_schedule::one_f_one_b})
    for (std::size_t stages : {1, 2, 3, 4})
      for (std::size_t micros : {1, 2, 5, 8}) {
        const auto plan = pdo::nn::make_schedule(kind, stages, micros);
        CHECK_NOTHROW(pdo::nn::check_schedule(plan, micros));
        if (kind == pipeline_schedule::one_f_one_b)
          for (std::size_t s = 0; s < stages; ++s) {
            std::size_t live = 0, most = 0;
            for (const auto& a : plan[s]) most = std::max(most, a.forward ? ++live : live--);
            CHECK(most <= stages - s);
          }
      }
  // every stage starting with a backward that waits on the next stage: stage 1 waits for stage 0's forward, which comes after its backward
  std::vector<std::vector<pdo::nn::pipeline_action>> swapped{{{true, 0}, {false, 0}, {true, 1}, {false, 1}},
                                                             {{true, 1}, {false, 1}, {true, 0}, {false, 0}}};
  CHECK_THROWS_WITH(pdo::nn::check_schedule(swapped, 2), Catch::Contains("deadlock") && Catch::Contains("stage"));
  std::vector<std::vector<pdo::nn::pipeline_action>> missing{{{true, 0}, {false, 0}}, {{true, 0}, {false, 0}, {true, 1}}};
  CHECK_THROWS_WITH(pdo::nn::check_schedule(missing, 2), Catch::Contains("micro-batch 1"));
}

namespace {

template <class Mesh>
std::vector<double> pipeline_losses(const Mesh& m, pdo::nn::pipeline_schedule kind, std::size_t micros,
                                    const pdo::tensor<double, 2>& x, const pdo::tensor<int, 1>& y, int steps) {
  const auto model = make_mlp();
  auto pipe = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.2, .momentum = 0.5}); };
  std::vector<double> losses;
  auto run = [&](auto&& trainer) {
    for (int s = 0; s < steps; ++s) losses.push_back(trainer.step(x, y));
  };
  const pdo::nn::pipeline_options o{kind, micros};
  // the 7 layers cut into as many stages as the mesh has along "pp"; with a "tp" axis each
  // stage must hold whole Megatron pairs (a cut elsewhere does not compile)
  const std::size_t stages = m.extent(Mesh::axis_index("pp"));
  if constexpr (Mesh::has_axis("tp")) {
    if (stages == 1) run(pdo::nn::make_pipeline<double, 2>(m, model, pipe, o));
    else run(pdo::nn::make_pipeline<double, 2, 3>(m, model, pipe, o));
  } else {
    switch (stages) {
      case 2: run(pdo::nn::make_pipeline<double, 2, 3>(m, model, pipe, o)); break;
      case 3: run(pdo::nn::make_pipeline<double, 2, 1, 4>(m, model, pipe, o)); break;
      default: run(pdo::nn::make_pipeline<double, 2, 1, 3, 5>(m, model, pipe, o)); break;
    }
  }
  return losses;
}

}  // namespace

TEST_CASE("pipeline: GPipe and 1F1B training match one place step by step, with dp x pp hybrids", "[model_parallel][pp]") {
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{11, 6}, 8);
  const auto y = labels_for(11);
  const auto reference = local_losses(x, y, 3);
  for (auto kind : {pdo::nn::pipeline_schedule::gpipe, pdo::nn::pipeline_schedule::one_f_one_b})
    for (std::size_t stages : {2, 3, 4})
      for (std::size_t micros : {1, 3, 4}) {  // 11 rows in 3 or 4 micro-batches: uneven
        INFO((kind == pdo::nn::pipeline_schedule::gpipe ? "GPipe" : "1F1B") << ", " << stages << " stages, " << micros << " micro-batches");
        const auto losses = pipeline_losses(pdo::make_mesh<"pp">(pdo::cpu_places(stages)), kind, micros, x, y, 3);
        for (std::size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == Approx(reference[s]).epsilon(1e-10));
      }
  SECTION("a batch of no rows, or a label out of range, is an error, and the trainer goes on") {
    const auto m = pdo::make_mesh<"pp">(pdo::cpu_places(2));
    auto trainer = pdo::nn::make_pipeline<double, 2, 3>(m, make_mlp(), [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.2, .momentum = 0.5}); },
                                                        {pdo::nn::pipeline_schedule::one_f_one_b, 3});
    CHECK_THROWS_WITH(trainer.step(pdo::tensor<double, 2>({0, 6}), pdo::tensor<int, 1>({0})),
                      Catch::Contains("pipeline::step") && Catch::Contains("no rows"));
    CHECK(trainer.step(x, y) == Approx(reference[0]).epsilon(1e-10));
    // no micro-batches: a setting's error, not a layout's
    try {
      pdo::nn::make_pipeline<double, 2, 3>(m, make_mlp(), [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.2}); },
                                           {pdo::nn::pipeline_schedule::gpipe, 0});
      FAIL("no error");
    } catch (const pdo::layout_error& e) {
      FAIL("a layout_error: " << e.what());
    } catch (const pdo::error& e) {
      CHECK_THAT(e.what(), Catch::Contains("micro_batches must be at least 1"));
    }
    // a label out of range in row 9: the last micro-batch (rows 8..10) on the last stage
    auto bad = y;
    bad(9) = 7;
    CHECK_THROWS_WITH(trainer.step(x, bad),
                      Catch::StartsWith("pipeline::step: on place cpu:1: its 3 rows of the batch are the inputs' rows 8..10 (row 0 "
                                        "here is row 8 there): cross_entropy") &&
                          Catch::Contains("the first is 7, at row 1"));
    CHECK(trainer.step(x, y) == Approx(reference[1]).epsilon(1e-10));  // the refused step updated nothing
  }
  SECTION("a step whose loss is not finite updates no stage: a pdo::error, or skipped with skip_nonfinite_steps") {
    auto bad = x;
    bad(4, 2) = std::numeric_limits<double>::quiet_NaN();
    auto opt = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.2, .momentum = 0.5}); };
    for (std::size_t places : {2, 4}) {
      INFO(places << " places");
      const auto m = pdo::make_mesh<"pp", "dp">(pdo::cpu_places(places), {2, places / 2});
      auto refusing = pdo::nn::make_pipeline<double, 2, 3>(m, make_mlp(), opt, {pdo::nn::pipeline_schedule::one_f_one_b, 3});
      CHECK_THROWS_WITH(refusing.step(bad, y), Catch::Contains("pipeline::step: step 1") && Catch::Contains("the loss is") && Catch::Contains("nan") &&
                                                   Catch::Contains("no parameter was updated"));
      CHECK(refusing.skipped_steps() == 1);
      CHECK(refusing.step(x, y) == Approx(reference[0]).epsilon(1e-10));  // nothing was updated, momentum included
      CHECK(refusing.step(x, y) == Approx(reference[1]).epsilon(1e-10));
      // a refused step is not counted: the next refusal names step 3
      CHECK_THROWS_WITH(refusing.step(bad, y), Catch::Contains("pipeline::step: step 3"));
      CHECK(refusing.skipped_steps() == 2);
      pdo::nn::pipeline_options skip{pdo::nn::pipeline_schedule::gpipe, 2};
      skip.skip_nonfinite_steps = true;
      auto skipping = pdo::nn::make_pipeline<double, 2, 3>(m, make_mlp(), opt, skip);
      CHECK(std::isnan(skipping.step(bad, y)));
      CHECK(skipping.skipped_steps() == 1);
      CHECK(skipping.step(x, y) == Approx(reference[0]).epsilon(1e-10));
    }
  }
  SECTION("a regression with mse_loss: targets [rows, outputs], the same as one place's data-parallel trainer") {
    const auto t = pdo_test::random_tensor<double>(pdo::shape_t<2>{11, 4}, 10);
    auto opt = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.05, .momentum = 0.9}); };
    auto one = pdo::nn::make_data_parallel<double>(pdo::make_mesh<"dp">(pdo::cpu_places(1)), make_mlp, opt, {}, pdo::nn::mse_loss{});
    auto piped = pdo::nn::make_pipeline<double, 2, 1, 3>(pdo::make_mesh<"pp">(pdo::cpu_places(3)), make_mlp(), opt,
                                                         {pdo::nn::pipeline_schedule::one_f_one_b, 4}, pdo::nn::mse_loss{});
    for (int s = 0; s < 3; ++s) CHECK(piped.step(x, t) == Approx(one.step(x, t)).epsilon(1e-10));
  }
  SECTION("a learning-rate schedule: the data-parallel trainer's rates and step count; a rate it cannot take refused") {
    auto opt = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.2, .momentum = 0.5}); };
    const auto rates = pdo::nn::step_lr(0.3, 2, 0.5);
    auto one = pdo::nn::make_data_parallel<double>(pdo::make_mesh<"dp">(pdo::cpu_places(1)), make_mlp, opt, {.schedule = rates});
    pdo::nn::pipeline_options o{pdo::nn::pipeline_schedule::one_f_one_b, 3};
    o.learning_rate = rates;
    auto piped = pdo::nn::make_pipeline<double, 2, 3>(pdo::make_mesh<"pp", "dp">(pdo::cpu_places(4), {2, 2}), make_mlp(), opt, o);
    for (int s = 0; s < 5; ++s) CHECK(piped.step(x, y) == Approx(one.step(x, y)).epsilon(1e-10));
    CHECK(piped.steps() == 5);
    for (std::size_t k = 0; k < piped.mesh().local_places().size(); ++k) CHECK(piped.optimizer(k).lr() == Approx(0.3 * 0.25));  // step 4's
    o.learning_rate = [](std::size_t step) { return step == 1 ? -0.1 : 0.1; };
    auto refusing = pdo::nn::make_pipeline<double, 2, 3>(pdo::make_mesh<"pp">(pdo::cpu_places(2)), make_mlp(), opt, o);
    refusing.step(x, y);
    CHECK_THROWS_WITH(refusing.step(x, y), Catch::Contains("pipeline::step: learning_rate(1)") && Catch::Contains("-0.1"));
    CHECK(refusing.steps() == 1);
  }
  SECTION("2 pipeline stages x 2 data-parallel replicas") {
    const auto m = pdo::make_mesh<"pp", "dp">(pdo::cpu_places(4), {2, 2});
    const auto losses = pipeline_losses(m, pdo::nn::pipeline_schedule::one_f_one_b, 2, x, y, 3);
    for (std::size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == Approx(reference[s]).epsilon(1e-10));
  }
}

namespace {

/// @brief Whether skippable layers run (every stage reads it; the test sets it between steps).
bool use_branch = true;

/// @brief A linear layer that is skipped (its input passed on) while use_branch is unset: in
/// those steps no replica's backward reaches its parameters.
struct skippable : pdo::nn::linear<double> {
  using pdo::nn::linear<double>::linear;
  template <class V>
  auto operator()(const pdo::var<V>& x) const {
    return use_branch ? pdo::tanh(pdo::nn::linear<double>::operator()(x)) + x : x;
  }
};

}  // namespace

TEST_CASE("pipeline over dp: a parameter no replica's backward reaches in a step is left alone by the update, as on one place",
          "[model_parallel][pp]") {
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{11, 6}, 8);
  const auto y = labels_for(11);
  // the branch runs in steps 0 and 3 only: weight decay and momentum must not move it in the
  // others (they would with zero gradients), or step 3's loss differs
  const std::vector<bool> uses{true, false, false, true, false};
  auto make_model = [] {
    pdo::nn::rng gen(5);
    namespace nn = pdo::nn;
    return nn::sequential(nn::linear<double>(6, 8, gen), nn::relu{}, skippable(8, 8, gen), nn::linear<double>(8, 4, gen));
  };
  auto make_optimizer = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.2}); };
  std::vector<double> reference;
  {
    auto model = make_model();
    auto opt = make_optimizer(pdo::nn::parameters_of<double>(model));
    for (const bool u : uses) {
      use_branch = u;
      opt.zero_grad();
      const auto loss = pdo::cross_entropy(model(pdo::var(x)), y);
      pdo::backward(loss);
      opt.step();
      reference.push_back(loss.value().data()[0]);
    }
  }
  for (const std::size_t dp : {1, 2, 3}) {
    INFO("2 stages x " << dp << " replicas");
    auto trainer = pdo::nn::make_pipeline<double, 2, 2>(pdo::make_mesh<"pp", "dp">(pdo::cpu_places(2 * dp), {2, dp}), make_model(),
                                                        make_optimizer, {pdo::nn::pipeline_schedule::one_f_one_b, 3});
    for (std::size_t s = 0; s < uses.size(); ++s) {
      use_branch = uses[s];
      CHECK(trainer.step(x, y) == Approx(reference[s]).epsilon(1e-10));
    }
  }
  use_branch = true;
}

TEST_CASE("pipeline with tensor-parallel stages: pp x tp and dp x pp x tp meshes match one place step by step",
          "[model_parallel][pp][tp]") {
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{11, 6}, 8);
  const auto y = labels_for(11);
  const auto reference = local_losses(x, y, 3);
  auto check = [&](const auto& m, pdo::nn::pipeline_schedule kind, std::size_t micros) {
    INFO(m.describe() << (kind == pdo::nn::pipeline_schedule::gpipe ? ", GPipe, " : ", 1F1B, ") << micros << " micro-batches");
    const auto losses = pipeline_losses(m, kind, micros, x, y, 3);
    REQUIRE(losses.size() == reference.size());
    for (std::size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == Approx(reference[s]).epsilon(1e-10));
  };
  for (auto kind : {pdo::nn::pipeline_schedule::gpipe, pdo::nn::pipeline_schedule::one_f_one_b}) {
    check(pdo::make_mesh<"pp", "tp">(pdo::cpu_places(4), {2, 2}), kind, 3);
    // hidden widths 10 and 7 over 3 places: uneven shards
    check(pdo::make_mesh<"pp", "tp">(pdo::cpu_places(6), {2, 3}), kind, 4);
  }
  check(pdo::make_mesh<"pp", "tp">(pdo::cpu_places(3), {1, 3}), pdo::nn::pipeline_schedule::one_f_one_b, 2);
  SECTION("3-D: 2 data-parallel replicas x 2 pipeline stages x 2 tensor-parallel shards") {
    const auto m = pdo::make_mesh<"dp", "pp", "tp">(pdo::cpu_places(8), {2, 2, 2});
    check(m, pdo::nn::pipeline_schedule::one_f_one_b, 3);
    check(m, pdo::nn::pipeline_schedule::gpipe, 2);
  }
}

TEST_CASE("pipeline with tensor-parallel stages: layer norms outside the pairs train as on one place", "[model_parallel][pp][tp]") {
  // each stage's shard on a "tp" place normalises whole rows (the norms sit outside the pairs)
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{11, 6}, 9, 0.5);
  const auto y = labels_for(11);
  const auto reference = local_losses([] { return pdo_test::make_normed_mlp(); }, x, y, 3);
  const auto m = pdo::make_mesh<"pp", "tp">(pdo::cpu_places(6), {2, 3});
  auto trainer = pdo::nn::make_pipeline<double, 2, 4>(
      m, pdo_test::make_normed_mlp(), [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.2, .momentum = 0.5}); },
      {pdo::nn::pipeline_schedule::one_f_one_b, 3});
  for (std::size_t s = 0; s < reference.size(); ++s) CHECK(trainer.step(x, y) == Approx(reference[s]).epsilon(1e-10));
}

TEST_CASE("pipeline: gradients clipped by the whole model's norm, each element counted once, as one place clips them",
          "[model_parallel][pp][tp]") {
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{11, 6}, 8);
  const auto y = labels_for(11);
  auto opt = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.2, .momentum = 0.5}); };
  const double max_norm = 0.02;
  // one place's data-parallel trainer clips as torch.nn.utils.clip_grad_norm_ (test_nn)
  std::vector<double> losses, norms;
  auto one = pdo::nn::make_data_parallel<double>(pdo::make_mesh<"dp">(pdo::cpu_places(1)), make_mlp, opt, {.clip_grad_norm = max_norm});
  for (int s = 0; s < 3; ++s) {
    losses.push_back(one.step(x, y));
    norms.push_back(one.last_grad_norm());
    REQUIRE(norms.back() > 2 * max_norm);  // every step is clipped
  }
  auto check = [&](const auto& m) {
    INFO(m.describe());
    pdo::nn::pipeline_options o{pdo::nn::pipeline_schedule::one_f_one_b, 3};
    o.clip_grad_norm = max_norm;
    auto piped = pdo::nn::make_pipeline<double, 2, 3>(m, make_mlp(), opt, o);
    for (std::size_t s = 0; s < losses.size(); ++s) {
      CHECK(piped.step(x, y) == Approx(losses[s]).epsilon(1e-10));
      CHECK(piped.last_grad_norm() == Approx(norms[s]).epsilon(1e-10));
    }
  };
  check(pdo::make_mesh<"pp">(pdo::cpu_places(2)));
  check(pdo::make_mesh<"pp", "dp">(pdo::cpu_places(6), {2, 3}));  // 11 rows over 3 replicas
  // hidden widths 10 and 7 over 3 places: uneven shards; the biases of row-parallel layers
  // are whole on every "tp" place and counted once
  check(pdo::make_mesh<"pp", "tp">(pdo::cpu_places(6), {2, 3}));
  check(pdo::make_mesh<"dp", "pp", "tp">(pdo::cpu_places(8), {2, 2, 2}));
  // without clipping the norm is not computed; a negative bound is refused
  // a skipped step (its loss not finite) clipped nothing: its norm is NaN, not the last step's
  {
    pdo::nn::pipeline_options o{pdo::nn::pipeline_schedule::gpipe, 2};
    o.clip_grad_norm = max_norm;
    o.skip_nonfinite_steps = true;
    auto skipping = pdo::nn::make_pipeline<double, 2, 3>(pdo::make_mesh<"pp", "dp">(pdo::cpu_places(4), {2, 2}), make_mlp(), opt, o);
    (void)skipping.step(x, y);
    CHECK(skipping.last_grad_norm() == Approx(norms[0]).epsilon(1e-10));
    auto bad = x;
    bad(4, 2) = std::numeric_limits<double>::quiet_NaN();
    CHECK(std::isnan(skipping.step(bad, y)));
    CHECK(std::isnan(skipping.last_grad_norm()));
    CHECK(skipping.step(x, y) == Approx(losses[1]).epsilon(1e-10));  // the skipped step changed nothing
  }
  auto plain = pdo::nn::make_pipeline<double, 2, 3>(pdo::make_mesh<"pp">(pdo::cpu_places(2)), make_mlp(), opt);
  (void)plain.step(x, y);
  CHECK(plain.last_grad_norm() == 0);
  pdo::nn::pipeline_options bad;
  bad.clip_grad_norm = -1;
  const auto two = pdo::make_mesh<"pp">(pdo::cpu_places(2));
  auto refused = [&] { return pdo::nn::make_pipeline<double, 2, 3>(two, make_mlp(), opt, bad); };
  CHECK_THROWS_WITH(refused(), Catch::Contains("pipeline") && Catch::Contains("clip_grad_norm"));
}

TEST_CASE("pipeline::accuracy: forwards only, on every mesh the same count as one place's", "[model_parallel][pp][tp]") {
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{11, 6}, 8);
  const auto y = labels_for(11);
  auto opt = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.2, .momentum = 0.5}); };
  // one place's trainer after two steps, and the same two steps on each mesh
  auto one = pdo::nn::make_data_parallel<double>(pdo::make_mesh<"dp">(pdo::cpu_places(1)), make_mlp, opt);
  const double untrained = one.accuracy(x, y);
  (void)one.step(x, y);
  (void)one.step(x, y);
  const double trained = one.accuracy(x, y);
  REQUIRE(trained > 0);
  REQUIRE(trained < 1);
  auto check = [&](const auto& m, std::size_t micros) {
    INFO(m.describe() << ", " << micros << " micro-batches");
    auto piped = pdo::nn::make_pipeline<double, 2, 3>(m, make_mlp(), opt, {pdo::nn::pipeline_schedule::one_f_one_b, micros});
    CHECK(piped.accuracy(x, y) == untrained);
    (void)piped.step(x, y);
    (void)piped.step(x, y);
    auto values = [&] {
      std::vector<double> all;
      for (const auto& q : piped.parameters(0))
        for (double v : q.value()) all.push_back(v);
      return all;
    };
    const auto before = values();
    CHECK(piped.accuracy(x, y) == trained);
    CHECK(values() == before);  // nothing trained
    CHECK(piped.steps() == 2);
    // labels that are not classes are named on every place, whichever stage counts them
    auto bad = y;
    bad(9) = 99;
    bad(4) = -1;
    CHECK_THROWS_WITH(piped.accuracy(x, bad), Catch::Contains("pipeline::accuracy: 2 labels of the batch are not class indices in [0, 4)") &&
                                                  Catch::Contains("the first is -1, at row 4"));
    CHECK(piped.accuracy(x, y) == trained);  // and the pipeline goes on
  };
  check(pdo::make_mesh<"pp">(pdo::cpu_places(2)), 3);
  check(pdo::make_mesh<"pp", "dp">(pdo::cpu_places(6), {2, 3}), 4);  // 11 rows over 3 replicas, some micro-batches empty
  check(pdo::make_mesh<"pp", "tp">(pdo::cpu_places(6), {2, 3}), 2);
  check(pdo::make_mesh<"dp", "pp", "tp">(pdo::cpu_places(8), {2, 2, 2}), 3);
  auto piped = pdo::nn::make_pipeline<double, 2, 3>(pdo::make_mesh<"pp">(pdo::cpu_places(2)), make_mlp(), opt);
  CHECK(piped.accuracy(pdo::tensor<double, 2>({0, 6}), pdo::tensor<int, 1>({0})) == 0);
  CHECK_THROWS_WITH(piped.accuracy(x, labels_for(10)), Catch::Contains("pipeline::accuracy") && Catch::Contains("differ in rows"));
}

TEST_CASE("sum_across and replicated_across: Megatron's g and f inside SPMD code, with their gradients", "[model_parallel][tp]") {
  const auto m = pdo::make_mesh<"tp">(pdo::cpu_places(3));
  std::vector<double> dx_sum(3), dx_rep(3), y0(3);
  pdo::spmd(m, [&](std::size_t p) {
    const auto group = pdo::communicator_along(m, 0, p);
    const double c = static_cast<double>(p + 1);
    pdo::tensor<double, 1> v({2}, m.place(p));
    v.fill(c);
    // y = sum over places of (c_p * x_p) with x_p = c_p: y = 1 + 4 + 9 on every place; d(sum y)/dx_p = c_p
    auto x = pdo::parameter(v);
    auto y = pdo::sum_across(x * c, group);
    y0[p] = y.value().data()[0];
    pdo::backward(pdo::sum(y));
    dx_sum[p] = x.grad().data()[0];
    // z_p = c_p * x with x the same on every place: d(sum_p sum z_p)/dx = 1 + 2 + 3 on every place
    auto r = pdo::parameter(v);
    pdo::backward(pdo::sum(pdo::replicated_across(r, group) * c));
    dx_rep[p] = r.grad().data()[1];
  });
  for (std::size_t p = 0; p < 3; ++p) {
    CHECK(y0[p] == 14.0);
    CHECK(dx_sum[p] == static_cast<double>(p + 1));
    CHECK(dx_rep[p] == 6.0);
  }
}

TEST_CASE("pipeline: 1F1B holds at most as many micro-batches as there are stages, GPipe all of them", "[model_parallel][pp]") {
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{64, 6}, 9);
  const auto y = labels_for(64);
  const auto model = make_mlp();
  auto opt = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.1}); };
  std::size_t peak[2] = {};
  for (int which = 0; which < 2; ++which) {
    const auto kind = which == 0 ? pdo::nn::pipeline_schedule::gpipe : pdo::nn::pipeline_schedule::one_f_one_b;
    const auto m = pdo::make_mesh<"pp">(pdo::cpu_places(2));
    auto trainer = pdo::nn::make_pipeline<double, 2, 3>(m, model, opt, {kind, 8});
    (void)trainer.step(x, y);
    m.place(0).memory().reset_peak();
    const auto before = m.place(0).memory().stats().bytes_in_use;
    (void)trainer.step(x, y);
    peak[which] = m.place(0).memory().stats().peak_bytes_in_use - before;
    const auto in_flight = trainer.max_in_flight();
    CHECK(in_flight[0] == (which == 0 ? 8u : 2u));
    CHECK(in_flight[1] == (which == 0 ? 8u : 1u));
  }
  CHECK(peak[1] < peak[0]);
}

