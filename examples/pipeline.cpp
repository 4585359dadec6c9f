// examples/pipeline.cpp: pipeline (inter-op) parallelism. A sequential is cut into stages
// on the places of the "pp" axis; micro-batches flow through them with the GPipe or the
// 1F1B schedule (checked for deadlocks before it runs); on a 2 "pp" x 2 "dp" mesh each
// data-parallel replica is a pipeline, and on a 2 x 2 x 2 "dp" x "pp" x "tp" mesh each stage
// is also tensor parallel. Every way trains like one place.
#include <pdo/pdo.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

auto make_mlp() {
  pdo::nn::rng gen(13);
  using namespace pdo::nn;
  return sequential(linear<float>(16, 64, gen), relu{}, linear<float>(64, 64, gen), relu{}, linear<float>(64, 64, gen), relu{},
                    linear<float>(64, 5, gen));
}

auto sgd() {
  return [](auto params) { return pdo::nn::sgd<float>(std::move(params), {.lr = 0.05, .momentum = 0.9}); };
}

}  // namespace

int main() {
  pdo::tensor<float, 2> x({40, 16});
  pdo::tensor<int, 1> y({40});
  for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = std::sin(0.7f * static_cast<float>(i));
  for (std::size_t i = 0; i < 40; ++i) y(i) = static_cast<int>((i * 3) % 5);

  auto model = make_mlp();
  auto opt = sgd()(pdo::nn::parameters_of<float>(model));
  std::vector<float> reference;
  for (int s = 0; s < 4; ++s) {
    opt.zero_grad();
    const auto loss = pdo::cross_entropy(model(pdo::var(x)), y);
    pdo::backward(loss);
    opt.step();
    reference.push_back(loss.value().data()[0]);
  }

  bool ok = true;
  auto report = [&](const char* what, auto& trainer) {
    std::vector<float> losses;
    for (int s = 0; s < 4; ++s) losses.push_back(trainer.step(x, y));
    bool same = true;
    for (std::size_t i = 0; i < losses.size(); ++i) same = same && std::abs(losses[i] - reference[i]) <= 1e-4f * (1 + reference[i]);
    std::printf("%-28s losses %.4f .. %.4f (%s); micro-batches in flight per stage:", what, losses.front(), losses.back(),
                same ? "as on one place" : "DIFFERENT");
    for (auto n : trainer.max_in_flight()) std::printf(" %zu", n);
    std::printf("\n");
    ok = ok && same;
  };
  const auto line = pdo::make_mesh<"pp">(pdo::cpu_places(4));
  auto gpipe = pdo::nn::make_pipeline<float, 2, 2, 4, 6>(line, make_mlp(), sgd(), {pdo::nn::pipeline_schedule::gpipe, 8});
  report("GPipe, 4 stages, 8 micro", gpipe);
  auto one_f_one_b = pdo::nn::make_pipeline<float, 2, 2, 4, 6>(line, make_mlp(), sgd(), {pdo::nn::pipeline_schedule::one_f_one_b, 8});
  report("1F1B, 4 stages, 8 micro", one_f_one_b);
  const auto grid = pdo::make_mesh<"pp", "dp">(pdo::cpu_places(4), {2, 2});
  auto hybrid = pdo::nn::make_pipeline<float, 2, 4>(grid, make_mlp(), sgd(), {pdo::nn::pipeline_schedule::one_f_one_b, 4});
  report("1F1B, 2 stages x 2 replicas", hybrid);
  // 3-D: each stage tensor parallel over "tp" (its linear layers in Megatron pairs, cut so
  // every stage holds whole pairs), each pipeline a data-parallel replica over "dp"
  const auto cube = pdo::make_mesh<"dp", "pp", "tp">(pdo::cpu_places(8), {2, 2, 2});
  auto three_d = pdo::nn::make_pipeline<float, 2, 4>(cube, make_mlp(), sgd(), {pdo::nn::pipeline_schedule::one_f_one_b, 4});
  report("1F1B, 2 dp x 2 pp x 2 tp", three_d);

  // a schedule that cannot finish is rejected before anything runs
  try {
    pdo::nn::check_schedule({{{true, 0}, {false, 0}, {true, 1}, {false, 1}}, {{true, 1}, {false, 1}, {true, 0}, {false, 0}}}, 2);
    ok = false;
  } catch (const pdo::error& e) {
    std::printf("rejected: %s\n", e.what());
  }
  return ok ? 0 : 1;
}
