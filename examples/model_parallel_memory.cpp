// examples/model_parallel_memory.cpp: why model parallelism exists. Each place has a
// memory cap; the model's parameters, gradients and Adam state together exceed one place's
// cap, so training on one place fails with pdo::out_of_memory, and trains on 2 and 4
// places with tensor parallelism (each place holds 1/n of the big weights) or with a
// pipeline (each place holds its stages' layers). Every way gives the same losses.
// Then activations: a fully convolutional network on one large image (1x16xSxS activations,
// S = 1024 by default, `--image S`) whose activations and im2col buffers exceed one place's
// cap, trained with the image split along its height over 2 and 4 places (spatial
// parallelism: each place computes its rows, with a halo exchange for the rows its windows
// read from its neighbours).
#include <pdo/pdo.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
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

bool report(const char* what, std::size_t places, const std::vector<float>& losses, std::size_t peak, const std::vector<float>& reference,
            std::size_t limit = cap, float tolerance = 1e-4f) {
  std::printf("%-16s on %zu places: losses", what, places);
  bool same = true;
  for (std::size_t s = 0; s < losses.size(); ++s) {
    std::printf(" %.5f", losses[s]);
    same = same && std::abs(losses[s] - reference[s]) <= tolerance * (1 + std::abs(reference[s]));
  }
  std::printf("   peak per place %s of %s%s\n", mib(peak).c_str(), mib(limit).c_str(), same ? "" : "   DIFFERENT LOSSES");
  return same && peak <= limit;
}

/// @brief The fully convolutional network of the spatial part: conv 3x3 1 -> 16, relu, conv
/// 3x3 16 -> 16, relu, conv 3x3 16 -> 1 (padding 1: the image's size throughout), trained
/// by SGD on the squared error against a target image; `place` lays tensors out (on the
/// host, or distributed with the image's rows split).
struct fcn_data {
  pdo::tensor<float, 4> image, target, w1, w2, w3;
  pdo::tensor<float, 1> b1, b2, b3;
};
fcn_data make_fcn(std::size_t size) {
  constexpr std::size_t c = 16;
  fcn_data d{pdo::tensor<float, 4>({1, 1, size, size}), pdo::tensor<float, 4>({1, 1, size, size}), pdo::tensor<float, 4>({c, 1, 3, 3}),
             pdo::tensor<float, 4>({c, c, 3, 3}), pdo::tensor<float, 4>({1, c, 3, 3}), pdo::tensor<float, 1>({c}),
             pdo::tensor<float, 1>({c}), pdo::tensor<float, 1>({1})};
  for (std::size_t i = 0; i < d.image.size(); ++i) {
    const float r = static_cast<float>(i / size), col = static_cast<float>(i % size);
    d.image.data()[i] = std::sin(0.05f * r) * std::cos(0.031f * col);
    d.target.data()[i] = d.image.data()[i] > 0.2f ? 1.0f : 0.0f;  // a segmentation mask
  }
  auto fill = [](auto& t, float scale, unsigned salt) {
    for (std::size_t i = 0; i < t.size(); ++i) t.data()[i] = scale * std::sin(0.7f * static_cast<float>(i * 13 + salt));
  };
  fill(d.w1, 0.3f, 1), fill(d.w2, 0.08f, 2), fill(d.w3, 0.08f, 3), fill(d.b1, 0.01f, 4), fill(d.b2, 0.01f, 5), fill(d.b3, 0.01f, 6);
  return d;
}

template <class Image, class Param>
std::vector<float> train_fcn(const fcn_data& d, Image image_layout, Param param_layout) {
  auto w1 = pdo::parameter(param_layout(d.w1)), w2 = pdo::parameter(param_layout(d.w2)), w3 = pdo::parameter(param_layout(d.w3));
  auto b1 = pdo::parameter(param_layout(d.b1)), b2 = pdo::parameter(param_layout(d.b2)), b3 = pdo::parameter(param_layout(d.b3));
  pdo::nn::sgd<float> opt({{"w1", w1}, {"b1", b1}, {"w2", w2}, {"b2", b2}, {"w3", w3}, {"b3", b3}}, {.lr = 2e-8f});
  const auto x = pdo::var(image_layout(d.image)), t = pdo::var(image_layout(d.target));
  std::vector<float> losses;
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    const auto h = pdo::relu(pdo::conv2d(pdo::relu(pdo::conv2d(x, w1, b1, {1, 1})), w2, b2, {1, 1}));
    const auto e = pdo::conv2d(h, w3, b3, {1, 1}) - t;
    const auto loss = pdo::sum(e * e);
    pdo::backward(loss);
    opt.step();
    if constexpr (requires { pdo::gather(loss.value()); }) losses.push_back(pdo::gather(loss.value()).data()[0]);
    else losses.push_back(loss.value().data()[0]);
  }
  return losses;
}

/// @brief The spatial part: one place's cap is too small for the network's activations on a
/// size x size image; 2 and 4 places with the image's rows split train it.
bool spatial(std::size_t size) {
  using R = pdo::replicate;
  using rows = pdo::layout<R, R, pdo::split<"sp">, R>;
  const fcn_data d = make_fcn(size);
  // one step on one place peaks at about 580 floats per pixel (activations of 16 channels, and
  // im2col buffers of 16 x 9 values per pixel with their gradients): a cap of 400 does not hold it
  const std::size_t pixels = size * size, image_cap = sizeof(float) * 400 * pixels;
  std::printf("\nspatial: a fully convolutional network (3x3 convs 1 -> 16 -> 16 -> 1) on a 1x1x%zux%zu image: activations 1x16x%zux%zu "
              "(%s each); cap per place %s\n",
              size, size, size, size, mib(sizeof(float) * 16 * pixels).c_str(), mib(image_cap).c_str());
  auto on = [&](const auto& m) {
    return std::pair{[&m](const pdo::tensor<float, 4>& t) { return pdo::distribute<rows>(m, t); },
                     [&m]<std::size_t N>(const pdo::tensor<float, N>& t) { return pdo::distribute<pdo::detail::replicated_layout_t<N>>(m, t); }};
  };
  try {
    const auto one = pdo::make_mesh<"sp">(pdo::cpu_places(1, image_cap));
    auto [image, param] = on(one);
    (void)train_fcn(d, image, param);
    std::fprintf(stderr, "model_parallel_memory: the network trained on one place, but it should not fit\n");
    return false;
  } catch (const pdo::out_of_memory& e) {
    std::printf("1 place: pdo::out_of_memory: %s\n", e.what());
  }
  const auto same = [](const auto& t) { return t; };
  const auto reference = train_fcn(d, same, same);  // on the host, no cap
  std::printf("on the host (no cap):     losses");
  for (float l : reference) std::printf(" %.1f", l);
  std::printf("\n");
  bool ok = true;
  for (std::size_t n : {2, 4}) {
    const auto m = pdo::make_mesh<"sp">(pdo::cpu_places(n, image_cap));
    auto [image, param] = on(m);
    const auto losses = train_fcn(d, image, param);
    // the weight gradients are float sums over a million pixels, in blocks of rows here, whole on
    // the host: after a step the losses agree to about 1e-4 (1e-5 on 512 x 512)
    ok = report("spatial split", n, losses, peak_of(m), reference, image_cap, 1e-3f) && ok;
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t image = 1024;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--image") == 0) image = std::max<std::size_t>(8, std::strtoull(argv[i + 1], nullptr, 10));
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
  ok = spatial(image) && ok;
  return ok ? 0 : 1;
}
