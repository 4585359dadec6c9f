// examples/model_parallel_memory.cpp: why model parallelism exists. Each place has a
// memory cap; the model's parameters, gradients and Adam state together exceed one place's
// cap, so training on one place fails with pdo::out_of_memory, and trains on 2 and 4
// places with tensor parallelism (each place holds 1/n of the big weights) or with a
// pipeline (each place holds its stages' layers). Every way gives the same losses.
#include <pdo/pdo.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace {

constexpr std::size_t cap = std::size_t{40} << 20;  // bytes per place
constexpr std::size_t width = 1024, classes = 16, batch = 32;
constexpr int steps = 3;

auto make_model() {
  pdo::nn::rng gen(5);
  using namespace pdo::nn;
  return sequential(linear<float>(width, width, gen), gelu{}, linear<float>(width, width, gen), gelu{}, linear<float>(width, width, gen),
                    gelu{}, linear<float>(width, classes, gen));
}

auto adam() {
  return [](auto params) { return pdo::nn::adam<float>(std::move(params), {.lr = 1e-3}); };
}

std::string mib(std::size_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

/// @brief The largest peak of the places of `m`.
template <class Mesh>
std::size_t peak_of(const Mesh& m) {
  std::size_t peak = 0;
  for (const auto& p : m.places()) peak = std::max(peak, p.memory().stats().peak_bytes_in_use);
  return peak;
}

template <class Mesh>
std::vector<float> tensor_parallel(const Mesh& m, const pdo::tensor<float, 2>& x, const pdo::tensor<int, 1>& y) {
  auto model = pdo::nn::tensor_parallel<"tp">(m, make_model());
  auto opt = adam()(pdo::nn::parameters_of<float>(model));
  const auto dx = pdo::var(pdo::distribute<pdo::layout<pdo::replicate, pdo::replicate>>(m, x));
  const auto dy = pdo::distribute<pdo::layout<pdo::replicate>>(m, y);
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    const auto loss = pdo::cross_entropy(model(dx), dy);
    pdo::backward(loss);
    opt.step();
    losses.push_back(pdo::gather(loss.value()).data()[0]);
  }
  return losses;
}

template <std::size_t... Cuts, class Mesh>
std::vector<float> pipeline(const Mesh& m, const pdo::tensor<float, 2>& x, const pdo::tensor<int, 1>& y) {
  auto trainer = pdo::nn::make_pipeline<float, 2, Cuts...>(m, make_model(), adam(), {pdo::nn::pipeline_schedule::one_f_one_b, 4});
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) losses.push_back(trainer.step(x, y));
  return losses;
}

bool report(const char* what, std::size_t places, const std::vector<float>& losses, std::size_t peak, const std::vector<float>& reference) {
  std::printf("%-16s on %zu places: losses", what, places);
  bool same = true;
  for (std::size_t s = 0; s < losses.size(); ++s) {
    std::printf(" %.5f", losses[s]);
    same = same && std::abs(losses[s] - reference[s]) <= 1e-4f * (1 + std::abs(reference[s]));
  }
  std::printf("   peak per place %s of %s%s\n", mib(peak).c_str(), mib(cap).c_str(), same ? "" : "   DIFFERENT LOSSES");
  return same && peak <= cap;
}

}  // namespace

int main() {
  pdo::tensor<float, 2> x({batch, width});
  pdo::tensor<int, 1> y({batch});
  for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = std::sin(0.37f * static_cast<float>(i));
  for (std::size_t i = 0; i < batch; ++i) y(i) = static_cast<int>((i * 5) % classes);
  std::size_t params = 0;
  for (const auto& p : pdo::nn::parameters_of<float>(make_model())) params += p.bytes();
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::printf("model: %s of parameters; with their gradients and Adam's two moments %s; cap per place %s\n", mib(params).c_str(),
              mib(4 * params).c_str(), mib(cap).c_str());

  // one place: too small
  try {
    const auto one = pdo::make_mesh<"tp">(pdo::cpu_places(1, cap));
    (void)tensor_parallel(one, x, y);
    std::fprintf(stderr, "model_parallel_memory: the model trained on one place, but it should not fit\n");
    return 1;
  } catch (const pdo::out_of_memory& e) {
    std::printf("1 place: pdo::out_of_memory: %s\n", e.what());
  }

  // the reference losses, on the host (no cap)
  auto model = make_model();
  auto opt = adam()(pdo::nn::parameters_of<float>(model));
  std::vector<float> reference;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    const auto loss = pdo::cross_entropy(model(pdo::var(x)), y);
    pdo::backward(loss);
    opt.step();
    reference.push_back(loss.value().data()[0]);
  }

  bool ok = true;
  for (std::size_t n : {2, 4}) {
    const auto m = pdo::make_mesh<"tp">(pdo::cpu_places(n, cap));
    const auto losses = tensor_parallel(m, x, y);
    ok = report("tensor parallel", n, losses, peak_of(m), reference) && ok;
  }
  {
    const auto m = pdo::make_mesh<"pp">(pdo::cpu_places(2, cap));
    const auto losses = pipeline<4>(m, x, y);
    ok = report("pipeline (1F1B)", 2, losses, peak_of(m), reference) && ok;
  }
  {
    const auto m = pdo::make_mesh<"pp">(pdo::cpu_places(4, cap));
    const auto losses = pipeline<2, 4, 6>(m, x, y);
    ok = report("pipeline (1F1B)", 4, losses, peak_of(m), reference) && ok;
  }
  return ok ? 0 : 1;
}
