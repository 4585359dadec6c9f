// examples/tensor_parallel.cpp: tensor (intra-op) parallelism from parameter layouts alone.
// The same MLP code runs on one place, on a line of "tp" places (Megatron column/row
// pairs: one all_reduce forward and one backward per pair, derived by the planner), and
// on a 2 x 2 mesh of "dp" x "tp" (the batch split over "dp" too); a conv layer runs
// channel parallel. Every result is checked against one place.
#include <pdo/pdo.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

auto make_mlp() {
  pdo::nn::rng gen(9);
  using namespace pdo::nn;
  return sequential(linear<float>(32, 64, gen), gelu{}, linear<float>(64, 32, gen), pdo::nn::tanh{}, linear<float>(32, 48, gen),
                    relu{}, linear<float>(48, 10, gen));
}

template <class Mesh, class Rows, class LabelRows>
std::vector<float> train(const Mesh& m, const pdo::tensor<float, 2>& x, const pdo::tensor<int, 1>& y) {
  auto model = pdo::nn::tensor_parallel<"tp">(m, make_mlp());
  pdo::nn::sgd<float> opt(pdo::nn::parameters_of<float>(model), {.lr = 0.1, .momentum = 0.9});
  const auto dx = pdo::var(pdo::distribute<Rows>(m, x));
  const auto dy = pdo::distribute<LabelRows>(m, y);
  std::vector<float> losses;
  for (int s = 0; s < 5; ++s) {
    opt.zero_grad();
    pdo::reset_planned_collectives();
    const auto loss = pdo::cross_entropy(model(dx), dy);
    const auto forward = pdo::planned_collectives(pdo::step_kind::all_reduce);
    pdo::backward(loss);
    const auto backward = pdo::planned_collectives(pdo::step_kind::all_reduce) - forward;
    opt.step();
    losses.push_back(pdo::gather(loss.value()).data()[0]);
    if (s == 0) std::printf("  %s: %zu all_reduces in forward, %zu in backward (per group)\n", m.describe().c_str(), forward, backward);
  }
  return losses;
}

bool close(const std::vector<float>& a, const std::vector<float>& b) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::abs(a[i] - b[i]) > 1e-4f * (1 + std::abs(b[i]))) return false;
  return true;
}

}  // namespace

int main() {
  pdo::tensor<float, 2> x({24, 32});
  pdo::tensor<int, 1> y({24});
  for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = std::cos(0.11f * static_cast<float>(i));
  for (std::size_t i = 0; i < 24; ++i) y(i) = static_cast<int>(i % 10);

  // one place, plain tensors
  auto model = make_mlp();
  pdo::nn::sgd<float> opt(pdo::nn::parameters_of<float>(model), {.lr = 0.1, .momentum = 0.9});
  std::vector<float> reference;
  for (int s = 0; s < 5; ++s) {
    opt.zero_grad();
    const auto loss = pdo::cross_entropy(model(pdo::var(x)), y);
    pdo::backward(loss);
    opt.step();
    reference.push_back(loss.value().data()[0]);
  }
  std::printf("one place: losses %.4f .. %.4f\n", reference.front(), reference.back());

  using whole = pdo::layout<pdo::replicate, pdo::replicate>;
  const auto tp = train<pdo::mesh<"tp">, whole, pdo::layout<pdo::replicate>>(pdo::make_mesh<"tp">(pdo::cpu_places(2)), x, y);
  const auto hybrid = train<pdo::mesh<"dp", "tp">, pdo::layout<pdo::split<"dp">, pdo::replicate>, pdo::layout<pdo::split<"dp">>>(
      pdo::make_mesh<"dp", "tp">(pdo::cpu_places(4), {2, 2}), x, y);
  std::printf("tensor parallel on 2 places: %s; 2 dp x 2 tp: %s\n", close(tp, reference) ? "same losses" : "DIFFERENT",
              close(hybrid, reference) ? "same losses" : "DIFFERENT");

  // a conv layer with its output channels split over "tp" (channel parallel)
  const auto m = pdo::make_mesh<"tp">(pdo::cpu_places(2));
  pdo::nn::rng gen(4);
  pdo::nn::conv2d<float> conv(3, 8, 3, gen, {1, 1});
  pdo::tensor<float, 4> images({2, 3, 6, 6});
  for (std::size_t i = 0; i < images.size(); ++i) images.data()[i] = std::sin(0.3f * static_cast<float>(i));
  using R = pdo::replicate;
  const auto w = pdo::parameter(pdo::distribute<pdo::layout<pdo::split<"tp">, R, R, R>>(m, conv.weight.value()));
  const auto b = pdo::parameter(pdo::distribute<pdo::layout<pdo::split<"tp">>>(m, conv.bias.value()));
  const auto out = pdo::conv2d(pdo::var(pdo::distribute<pdo::layout<R, R, R, R>>(m, images)), w, b, {1, 1});
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(out.value())>::layout_type, pdo::layout<R, pdo::split<"tp">, R, R>>);
  const auto local = conv(pdo::var(images));
  const auto gathered = pdo::gather(out.value());
  float worst = 0;
  for (std::size_t i = 0; i < gathered.size(); ++i) worst = std::max(worst, std::abs(gathered.data()[i] - local.value().data()[i]));
  std::printf("conv2d channel parallel on 2 places: output %s, largest difference %.2g\n", out.value().describe().c_str(), worst);
  return close(tp, reference) && close(hybrid, reference) && worst < 1e-4f ? 0 : 1;
}
