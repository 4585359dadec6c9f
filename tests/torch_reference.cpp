// tests/torch_reference.cpp: pdo's results for tests/torch_reference.py to compare with
// PyTorch's. Prints one line per tensor: `name rank extents... values...`, inputs included,
// so that the script rebuilds every input exactly. Covered: the elementwise ops, where,
// reductions, softmax and log_softmax, layer_norm, transpose and reshape, matmul (batched and
// broadcast), the losses, conv2d and the pools (strides, padding), each forward and
// gradient; SGD, Adam, AdamW, clip_grad_norm and step_lr; and an MLP trained data parallel
// over 3 places (uneven batch) and tensor parallel over 2, against one PyTorch process.
#include <pdo/pdo.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

namespace {

template <class T, std::size_t R>
void dump(const std::string& name, const pdo::tensor<T, R>& t) {
  std::printf("%s %zu", name.c_str(), R);
  for (std::size_t d = 0; d < R; ++d) std::printf(" %zu", t.extent(d));
  for (std::size_t i = 0; i < t.size(); ++i) std::printf(" %.9g", static_cast<double>(t.data()[i]));
  std::printf("\n");
}

void dump(const std::string& name, const std::vector<float>& v) {
  pdo::tensor<float, 1> t({v.size()});
  for (std::size_t i = 0; i < v.size(); ++i) t(i) = v[i];
  dump(name, t);
}

/// @brief A tensor of `shape` filled with scale * sin(0.37 i + 1.3 seed) + shift.
template <std::size_t R>
pdo::tensor<float, R> make(const pdo::shape_t<R>& shape, int seed, float scale = 1.0f, float shift = 0.0f) {
  pdo::tensor<float, R> t(shape);
  for (std::size_t i = 0; i < t.size(); ++i) t.data()[i] = scale * std::sin(0.37f * static_cast<float>(i) + 1.3f * static_cast<float>(seed)) + shift;
  return t;
}

/// @brief x, f(x), a weight w of f(x)'s shape, and the gradient of sum(f(x) * w) with respect to x.
template <class F>
void unary(const std::string& name, F f, float shift = 0.0f) {
  const auto xv = make<2>({3, 5}, 1, 2.0f, shift);
  dump(name + "_x", xv);
  const auto x = pdo::parameter(xv);
  const auto y = f(x);
  dump(name + "_y", y.value());
  const auto w = make(y.value().shape(), 2);
  dump(name + "_w", w);
  pdo::backward(pdo::sum(y * pdo::var(w)));
  dump(name + "_gx", x.grad());
}

template <std::size_t RA, std::size_t RB>
void product(const std::string& name, const pdo::shape_t<RA>& sa, const pdo::shape_t<RB>& sb) {
  const auto av = make(sa, 6);
  const auto bv = make(sb, 7);
  dump(name + "_a", av);
  dump(name + "_b", bv);
  const auto a = pdo::parameter(av);
  const auto b = pdo::parameter(bv);
  const auto y = pdo::matmul(a, b);
  dump(name + "_y", y.value());
  const auto w = make(y.value().shape(), 8);
  dump(name + "_w", w);
  pdo::backward(pdo::sum(y * pdo::var(w)));
  dump(name + "_ga", a.grad());
  dump(name + "_gb", b.grad());
}

/// @brief The values of a local parameter, as a tensor of its shape.
template <std::size_t R>
pdo::tensor<float, R> values_of(const pdo::nn::parameter_ref<float>& p) {
  pdo::tensor<float, R> t(p.shape<R>());
  const auto v = p.value();
  std::copy(v.begin(), v.end(), t.data());
  return t;
}

auto make_mlp() {
  pdo::nn::rng gen(5);
  using namespace pdo::nn;
  auto model = sequential(linear<float>(6, 8, gen), gelu{}, linear<float>(8, 8, gen), pdo::nn::tanh{}, linear<float>(8, 6, gen), relu{},
                          linear<float>(6, 4, gen));
  int seed = 30;
  for (auto& p : parameters_of<float>(model)) {
    if (p.rank() == 2) p.assign(make(p.shape<2>(), seed++, 0.4f));
    else p.assign(make(p.shape<1>(), seed++, 0.2f));
  }
  return model;
}

}  // namespace

int main() {
  unary("exp", [](const auto& x) { return pdo::exp(x); });
  unary("log", [](const auto& x) { return pdo::log(x); }, 2.5f);
  unary("sqrt", [](const auto& x) { return pdo::sqrt(x); }, 2.5f);
  unary("tanh", [](const auto& x) { return pdo::tanh(x); });
  unary("sigmoid", [](const auto& x) { return pdo::sigmoid(x); });
  unary("relu", [](const auto& x) { return pdo::relu(x); });
  unary("gelu", [](const auto& x) { return pdo::gelu(x); });
  unary("gelu_tanh", [](const auto& x) { return pdo::gelu_tanh(x); });
  unary("softmax1", [](const auto& x) { return pdo::softmax<1>(x); });
  unary("softmax0", [](const auto& x) { return pdo::softmax<0>(x); });
  unary("log_softmax1", [](const auto& x) { return pdo::log_softmax<1>(x); });
  unary("log_softmax0", [](const auto& x) { return pdo::log_softmax<0>(x); });
  unary("layer_norm", [](const auto& x) { return pdo::layer_norm(x); });
  unary("sum0", [](const auto& x) { return pdo::sum<0>(x); });
  unary("mean1", [](const auto& x) { return pdo::mean<1>(x); });
  unary("max1", [](const auto& x) { return pdo::max<1>(x); });
  unary("max0", [](const auto& x) { return pdo::max<0>(x); });
  unary("transpose", [](const auto& x) { return pdo::transpose(x); });
  unary("reciprocal", [](const auto& x) { return 1.0f / (x + 3.0f); });
  unary("square", [](const auto& x) { return x * x - x; });
  unary("reshape", [](const auto& x) { return pdo::reshape(x, {5, 3}); });
  unary("where", [](const auto& x) { return pdo::where(pdo::greater(x.value(), 0.0f), x * 2.0f, x * x); });
  {  // two operands, broadcast
    const auto av = make<2>({3, 5}, 3), w = make<2>({3, 5}, 5);
    const auto bv = make<1>({5}, 4);
    dump("binary_a", av);
    dump("binary_b", bv);
    dump("binary_w", w);
    const auto a = pdo::parameter(av);
    const auto b = pdo::parameter(bv);
    const auto y = pdo::maximum(a, b) * 2.0f + pdo::minimum(a, b) - a / (b + 3.0f);
    dump("binary_y", y.value());
    pdo::backward(pdo::sum(y * pdo::var(w)));
    dump("binary_ga", a.grad());
    dump("binary_gb", b.grad());
  }
  product("mm", pdo::shape_t<2>{4, 6}, pdo::shape_t<2>{6, 3});
  product("bmm", pdo::shape_t<3>{2, 4, 6}, pdo::shape_t<3>{2, 6, 3});
  product("bcast_mm", pdo::shape_t<3>{2, 4, 6}, pdo::shape_t<2>{6, 3});
  {
    const auto lv = make<2>({5, 4}, 12, 3.0f);
    const pdo::tensor<int, 1> labels({5}, {0, 3, 1, 2, 3});
    dump("ce_logits", lv);
    const auto l = pdo::parameter(lv);
    const auto loss = pdo::cross_entropy(l, labels);
    dump("ce_y", loss.value());
    pdo::backward(loss);
    dump("ce_g", l.grad());
  }
  {
    const auto av = make<2>({3, 4}, 13), bv = make<2>({3, 4}, 14);
    dump("mse_a", av);
    dump("mse_b", bv);
    const auto a = pdo::parameter(av), b = pdo::parameter(bv);
    const auto loss = pdo::mse(a, b);
    dump("mse_y", loss.value());
    pdo::backward(loss);
    dump("mse_ga", a.grad());
    dump("mse_gb", b.grad());
  }
  // conv2d: {stride 1, padding 0}, {2, 1}, {1, 1}
  for (int cfg = 0; cfg < 3; ++cfg) {
    const std::size_t stride = cfg == 1 ? 2 : 1, padding = cfg == 0 ? 0 : 1;
    const auto xv = make<4>({2, 3, 7, 6}, 15), wv = make<4>({4, 3, 3, 3}, 16, 0.5f);
    const auto bv = make<1>({4}, 17);
    const std::string p = "conv" + std::to_string(cfg) + "_";
    dump(p + "x", xv);
    dump(p + "weight", wv);
    dump(p + "bias", bv);
    const auto x = pdo::parameter(xv), w = pdo::parameter(wv);
    const auto b = pdo::parameter(bv);
    const auto y = pdo::conv2d(x, w, b, {stride, padding});
    dump(p + "y", y.value());
    const auto g = make(y.value().shape(), 18);
    dump(p + "w", g);
    pdo::backward(pdo::sum(y * pdo::var(g)));
    dump(p + "gx", x.grad());
    dump(p + "gweight", w.grad());
    dump(p + "gbias", b.grad());
  }
  // pools: kernel 2 (stride = kernel), kernel 2 stride 1, kernel 3 padding 1
  for (int cfg = 0; cfg < 3; ++cfg) {
    const std::size_t kernel = cfg == 2 ? 3 : 2, stride = cfg == 1 ? 1 : 0, padding = cfg == 2 ? 1 : 0;
    for (const bool average : {false, true}) {
      const auto xv = make<4>({2, 2, 7, 6}, 19);
      const std::string p = std::string(average ? "avgpool" : "maxpool") + std::to_string(cfg) + "_";
      dump(p + "x", xv);
      const auto x = pdo::parameter(xv);
      const auto y = average ? pdo::avg_pool2d(x, kernel, {stride, padding}) : pdo::max_pool2d(x, kernel, {stride, padding});
      dump(p + "y", y.value());
      const auto g = make(y.value().shape(), 20);
      dump(p + "w", g);
      pdo::backward(pdo::sum(y * pdo::var(g)));
      dump(p + "gx", x.grad());
    }
  }
  // optimizers: a linear layer 4 -> 3 fitted by mse, 4 steps each
  const auto x_opt = make<2>({5, 4}, 23), t_opt = make<2>({5, 3}, 24);
  const auto w0 = make<2>({4, 3}, 21, 0.5f);
  const auto b0 = make<1>({3}, 22, 0.5f);
  dump("opt_w0", w0);
  dump("opt_b0", b0);
  dump("opt_x", x_opt);
  dump("opt_t", t_opt);
  for (int o = 0; o < 5; ++o) {
    pdo::nn::linear<float> layer(pdo::parameter(w0), pdo::parameter(b0));
    const auto ps = layer.parameters();
    using any = pdo::nn::any_optimizer<float>;
    any opt = o == 0   ? any(pdo::nn::sgd<float>(ps, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01}))
              : o == 1 ? any(pdo::nn::adam<float>(ps, {.lr = 0.05}))
              : o == 2 ? any(pdo::nn::adam<float>(ps, pdo::nn::adamw_options(0.05, 0.1)))
              : o == 3 ? any(pdo::nn::adam<float>(ps, {.lr = 0.05, .weight_decay = 0.1}))
                       : any(pdo::nn::sgd<float>(ps, {.lr = 0.2}));
    const std::string p = "opt" + std::to_string(o) + "_";
    std::vector<float> norms;
    for (int s = 0; s < 4; ++s) {
      opt.zero_grad();
      pdo::backward(pdo::mse(layer(pdo::var(x_opt)), pdo::var(t_opt)));
      if (o == 4) norms.push_back(static_cast<float>(pdo::nn::clip_grad_norm(ps, 0.05)));
      opt.step();
    }
    if (o == 4) dump(p + "norms", norms);
    dump(p + "w", values_of<2>(ps[0]));
    dump(p + "b", values_of<1>(ps[1]));
  }
  {
    const auto schedule = pdo::nn::step_lr(0.1, 3, 0.5);
    std::vector<float> lrs;
    for (std::size_t s = 0; s < 12; ++s) lrs.push_back(static_cast<float>(schedule(s)));
    dump("step_lr", lrs);
  }
  // an MLP: its initial parameters, the batch, then data parallel over 3 places (10 rows: 4, 3, 3)
  // with Adam, and tensor parallel over 2 places with SGD
  const auto x = make<2>({10, 6}, 40);
  pdo::tensor<int, 1> y({10});
  for (std::size_t i = 0; i < 10; ++i) y(i) = static_cast<int>((i * 7) % 4);
  dump("mlp_x", x);
  dump("mlp_y", y);
  {
    const auto model = make_mlp();
    for (const auto& p : pdo::nn::parameters_of<float>(model)) {
      if (p.rank() == 2) dump("mlp_init_" + p.name(), values_of<2>(p));
      else dump("mlp_init_" + p.name(), values_of<1>(p));
    }
  }
  {
    const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(3));
    auto trainer = pdo::nn::make_data_parallel<float>(m, make_mlp, [](auto ps) { return pdo::nn::adam<float>(std::move(ps), {.lr = 0.01}); });
    std::vector<float> losses;
    for (int s = 0; s < 5; ++s) losses.push_back(trainer.step(x, y));
    dump("dp_losses", losses);
    for (const auto& p : pdo::nn::parameters_of<float>(trainer.model())) {
      if (p.rank() == 2) dump("dp_" + p.name(), values_of<2>(p));
      else dump("dp_" + p.name(), values_of<1>(p));
    }
  }
  {
    const auto m = pdo::make_mesh<"tp">(pdo::cpu_places(2));
    auto model = pdo::nn::tensor_parallel<"tp">(m, make_mlp());
    pdo::nn::sgd<float> opt(pdo::nn::parameters_of<float>(model), {.lr = 0.1, .momentum = 0.9});
    const auto dx = pdo::var(pdo::distribute<pdo::layout<pdo::replicate, pdo::replicate>>(m, x));
    const auto dy = pdo::distribute<pdo::layout<pdo::replicate>>(m, y);
    std::vector<float> losses;
    for (int s = 0; s < 5; ++s) {
      opt.zero_grad();
      const auto loss = pdo::cross_entropy(model(dx), dy);
      pdo::backward(loss);
      opt.step();
      losses.push_back(pdo::gather(loss.value()).data()[0]);
    }
    dump("tp_losses", losses);
  }
  return 0;
}
