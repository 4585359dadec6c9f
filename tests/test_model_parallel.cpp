// Model parallelism: tensor parallel (the Megatron pair, derived from parameter layouts),
// hybrid data x tensor meshes, and training that matches one place step by step.
#include "model_support.hpp"

#include <pdo/nn.hpp>

#include <algorithm>
#include <array>
#include <vector>

namespace {

using pdo_test::labels_for;
using pdo_test::local_losses;
using pdo_test::mlp_maker;
using pdo::replicate;
using pdo::split;

/// @brief The losses of make_model()'s model (make_mlp's by default) made tensor parallel
/// along "tp" on `m`, the batch split along "dp" if the mesh has it.
template <class Mesh, class MakeModel = mlp_maker>
std::vector<double> parallel_losses(const Mesh& m, const pdo::tensor<double, 2>& x, const pdo::tensor<int, 1>& y, int steps,
                                    MakeModel make_model = {}) {
  auto model = pdo::nn::tensor_parallel<"tp">(m, make_model());
  pdo::nn::sgd<double> opt(pdo::nn::parameters_of<double>(model), {.lr = 0.2, .momentum = 0.5});
  using rows = std::conditional_t<Mesh::has_axis("dp"), pdo::layout<split<"dp">, replicate>, pdo::layout<replicate, replicate>>;
  using label_rows = std::conditional_t<Mesh::has_axis("dp"), pdo::layout<split<"dp">>, pdo::layout<replicate>>;
  const auto dx = pdo::var(pdo::distribute<rows>(m, x));
  const auto dy = pdo::distribute<label_rows>(m, y);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    const auto loss = pdo::cross_entropy(model(dx), dy);
    pdo::backward(loss);
    opt.step();
    losses.push_back(pdo::gather(loss.value()).data()[0]);
  }
  return losses;
}

}  // namespace

TEST_CASE("tensor parallel: the Megatron pair's collectives follow from the parameter layouts", "[model_parallel][tp]") {
  using mesh_t = pdo::mesh<"tp">;
  using X = pdo::dtensor<float, 2, mesh_t, pdo::layout<replicate, replicate>>;
  using W1 = pdo::dtensor<float, 2, mesh_t, pdo::layout<replicate, split<"tp">>>;
  using B1 = pdo::dtensor<float, 1, mesh_t, pdo::layout<split<"tp">>>;
  using W2 = pdo::dtensor<float, 2, mesh_t, pdo::layout<split<"tp">, replicate>>;
  using B2 = pdo::dtensor<float, 1, mesh_t, pdo::layout<replicate>>;
  // forward: column-parallel then row-parallel: exactly one all_reduce (the partial sum, reduced by the bias add)
  using forward = decltype(pdo::matmul(pdo::gelu(pdo::matmul(std::declval<const X&>(), std::declval<const W1&>()) + std::declval<const B1&>()),
                                       std::declval<const W2&>()) +
                           std::declval<const B2&>());
  static_assert(pdo::plan_of<forward>().collectives() == 1);
  static_assert(pdo::plan_of<forward>().count(pdo::step_kind::all_reduce) == 1);
  static_assert(std::is_same_v<pdo::result_layout_t<forward>, pdo::layout<replicate, replicate>>);
  // backward: the output gradient g is replicated; the hidden gradient g W2ᵀ stays split (no communication) ...
  using G = X;
  using grad_h = decltype(pdo::matmul(std::declval<const G&>(), pdo::transpose(std::declval<const W2&>())));
  static_assert(pdo::plan_of<grad_h>().collectives() == 0);
  static_assert(std::is_same_v<pdo::result_layout_t<grad_h>, pdo::layout<replicate, split<"tp">>>);
  // ... so are the weight gradients ...
  using H = pdo::dtensor<float, 2, mesh_t, pdo::layout<replicate, split<"tp">>>;
  using grad_w1 = decltype(pdo::matmul(pdo::transpose(std::declval<const X&>()), std::declval<const H&>()));
  static_assert(std::is_same_v<pdo::result_layout_t<grad_w1>, W1::layout_type>);
  using grad_w2 = decltype(pdo::matmul(pdo::transpose(std::declval<const H&>()), std::declval<const G&>()));
  static_assert(std::is_same_v<pdo::result_layout_t<grad_w2>, W2::layout_type>);
  // ... and the input gradient g_h W1ᵀ is a partial sum: one all_reduce brings it to x's layout
  using grad_x = decltype(pdo::matmul(std::declval<const H&>(), pdo::transpose(std::declval<const W1&>())));
  static_assert(std::is_same_v<pdo::result_layout_t<grad_x>, X::layout_type::partial<"tp">>);
  static_assert(pdo::redistribute_plan_of<pdo::result_layout_t<grad_x>, X::layout_type>().count(pdo::step_kind::all_reduce) == 1);
}

TEST_CASE("tensor parallel: one all_reduce forward and one backward per pair, run", "[model_parallel][tp]") {
  const auto m = pdo::make_mesh<"tp">(pdo::cpu_places(2));
  pdo::nn::rng gen(3);
  pdo::nn::sequential pair(pdo::nn::linear<double>(6, 8, gen), pdo::nn::gelu{}, pdo::nn::linear<double>(8, 6, gen));
  auto tp = pdo::nn::tensor_parallel<"tp">(m, pair);
  auto x = pdo::parameter(pdo::distribute<pdo::layout<replicate, replicate>>(m, pdo_test::random_tensor<double>(pdo::shape_t<2>{5, 6}, 1)));
  pdo::reset_planned_collectives();
  const auto y = tp(x);
  CHECK(pdo::planned_collectives(pdo::step_kind::all_reduce) == 1);
  const auto loss = pdo::sum(y * y);
  pdo::reset_planned_collectives();
  pdo::backward(loss);
  CHECK(pdo::planned_collectives(pdo::step_kind::all_reduce) == 1);
  CHECK(pdo::planned_collectives(pdo::step_kind::all_gather) == 0);
  CHECK(pdo::planned_collectives(pdo::step_kind::reduce_scatter) == 0);
}

TEST_CASE("tensor parallel: training matches one place step by step, on 1-4 places and data x tensor meshes",
          "[model_parallel][tp]") {
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{9, 6}, 5);
  const auto y = labels_for(9);
  const auto reference = local_losses(x, y, 4);
  REQUIRE(reference.back() < reference.front());
  for (std::size_t n : pdo_test::line_sizes()) {
    INFO(n << " places along tp");
    const auto losses = parallel_losses(pdo::make_mesh<"tp">(pdo::cpu_places(n)), x, y, 4);
    for (std::size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == Approx(reference[s]).epsilon(1e-10));
  }
  for (auto [dp, tp] : {std::pair<std::size_t, std::size_t>{2, 2}, {3, 1}, {1, 3}}) {
    INFO("dp " << dp << " x tp " << tp);
    const auto losses = parallel_losses(pdo::make_mesh<"dp", "tp">(pdo::cpu_places(dp * tp), {dp, tp}), x, y, 4);
    for (std::size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == Approx(reference[s]).epsilon(1e-10));
  }
}

TEST_CASE("tensor parallel: layer norms outside the pairs train as on one place", "[model_parallel][tp]") {
  // a layer_norm before the first pair and one between the pairs: the features are whole on
  // every place there, so each place normalises the same rows as one place does
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{9, 6}, 6, 0.7);
  const auto y = labels_for(9);
  const auto make = [] { return pdo_test::make_normed_mlp(); };
  const auto reference = local_losses(make, x, y, 3);
  REQUIRE(reference.back() < reference.front());
  for (auto [dp, tp] : {std::pair<std::size_t, std::size_t>{2, 2}, {1, 3}}) {  // hidden widths 10 and 7 over 3: uneven
    INFO("dp " << dp << " x tp " << tp);
    const auto losses = parallel_losses(pdo::make_mesh<"dp", "tp">(pdo::cpu_places(dp * tp), {dp, tp}), x, y, 3, make);
    for (std::size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == Approx(reference[s]).epsilon(1e-10));
  }
}

namespace {

/// @brief conv2d of dtensors with the given layouts on `m`, against one place: output, and the gradients of sum(y * r).
template <class LX, class LW, class LB, class Mesh>
void check_distributed_conv(const Mesh& m, pdo::window_options o) {
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<4>{5, 4, 6, 5}, 11);
  const auto w = pdo_test::random_tensor<double>(pdo::shape_t<4>{6, 4, 3, 3}, 12);
  const auto b = pdo_test::random_tensor<double>(pdo::shape_t<1>{6}, 13);
  auto X = pdo::parameter(x), W = pdo::parameter(w);
  auto B = pdo::parameter(b);
  const auto y = pdo::conv2d(X, W, B, o);
  const pdo::var<pdo::tensor<double, 4>> r(pdo_test::random_tensor<double>(y.shape(), 14));
  pdo::backward(pdo::sum(y * r));

  auto dX = pdo::parameter(pdo::distribute<LX>(m, x));
  auto dW = pdo::parameter(pdo::distribute<LW>(m, w));
  auto dB = pdo::parameter(pdo::distribute<LB>(m, b));
  const auto dy = pdo::conv2d(dX, dW, dB, o);
  const auto dr = pdo::var(pdo::distribute<pdo::layout<pdo::replicate, pdo::replicate, pdo::replicate, pdo::replicate>>(m, r.value()));
  pdo::backward(pdo::sum(dy * dr));
  auto same = [](const auto& distributed, const auto& local, const char* what) {
    const auto g = pdo::gather(distributed);
    REQUIRE(g.shape() == local.shape());
    for (std::size_t i = 0; i < g.size(); ++i) {
      INFO(what << " element " << i);
      CHECK(g.data()[i] == Approx(local.data()[i]).epsilon(1e-11).margin(1e-12));
    }
  };
  same(dy.value(), y.value(), "output");
  same(dW.grad(), W.grad(), "weight gradient");
  same(dB.grad(), B.grad(), "bias gradient");
  same(dX.grad(), X.grad(), "input gradient");
}

}  // namespace

TEST_CASE("conv2d over dtensors: channel parallel, input-channel partial sums, with data parallel batches",
          "[model_parallel][conv]") {
  using pdo::layout;
  using R = replicate;
  const auto m = pdo::make_mesh<"dp", "tp">(pdo::cpu_places(4), {2, 2});
  SECTION("output channels split over tp (channel parallel), batch over dp") {
    using LX = layout<split<"dp">, R, R, R>;
    using LW = layout<split<"tp">, R, R, R>;
    using LB = layout<split<"tp">>;
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(pdo::conv2d(std::declval<pdo::var<pdo::dtensor<double, 4, pdo::mesh<"dp", "tp">, LX>>>(),
                                                                         std::declval<pdo::var<pdo::dtensor<double, 4, pdo::mesh<"dp", "tp">, LW>>>(),
                                                                         std::declval<pdo::var<pdo::dtensor<double, 1, pdo::mesh<"dp", "tp">, LB>>>()))>,
                                 pdo::var<pdo::dtensor<double, 4, pdo::mesh<"dp", "tp">, layout<split<"dp">, split<"tp">, R, R>>>>);
    check_distributed_conv<LX, LW, LB>(m, {1, 1});
    check_distributed_conv<LX, LW, LB>(m, {2, 0});
  }
  SECTION("input channels split over tp (partial output), batch over dp") {
    using LX = layout<split<"dp">, split<"tp">, R, R>;
    using LW = layout<R, split<"tp">, R, R>;
    using LB = layout<R>;
    check_distributed_conv<LX, LW, LB>(m, {1, 1});
  }
  SECTION("channel parallel on a line of 3 places (6 channels, 5 images: uneven batches elsewhere)") {
    const auto line = pdo::make_mesh<"tp">(pdo::cpu_places(3));
    check_distributed_conv<layout<R, R, R, R>, layout<split<"tp">, R, R, R>, layout<split<"tp">>>(line, {1, 0});
  }
}

namespace {

using R = replicate;

/// @brief A tensor's elements against another's, relative to the larger magnitude.
template <class A, class B>
void check_close(const A& distributed, const B& local, const char* what) {
  const auto g = pdo::gather(distributed);
  REQUIRE(g.shape() == local.shape());
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double d = std::abs(g.data()[i] - local.data()[i]) / std::max(1.0, std::abs(local.data()[i]));
    if (d > worst) worst = d, at = i;
  }
  INFO(what << ": worst relative difference at element " << at);
  CHECK(worst <= 1e-12);
}

/// @brief conv2d of an input laid out as LX on `m` (weight and bias replicated), forward and
/// backward, against one place.
template <class LX, class Mesh>
void check_spatial_conv(const Mesh& m, const pdo::shape_t<4>& xs, std::size_t kernel, pdo::window_options o, unsigned seed) {
  const auto x = pdo_test::random_tensor<double>(xs, seed);
  const auto w = pdo_test::random_tensor<double>(pdo::shape_t<4>{3, xs[1], kernel, kernel}, seed + 1);
  const auto b = pdo_test::random_tensor<double>(pdo::shape_t<1>{3}, seed + 2);
  auto X = pdo::parameter(x), W = pdo::parameter(w);
  auto B = pdo::parameter(b);
  const auto y = pdo::conv2d(X, W, B, o);
  const pdo::var<pdo::tensor<double, 4>> r(pdo_test::random_tensor<double>(y.shape(), seed + 3));
  pdo::backward(pdo::sum(y * r));

  auto dX = pdo::parameter(pdo::distribute<LX>(m, x));
  auto dW = pdo::parameter(pdo::distribute<pdo::layout<R, R, R, R>>(m, w));
  auto dB = pdo::parameter(pdo::distribute<pdo::layout<R>>(m, b));
  const auto dy = pdo::conv2d(dX, dW, dB, o);
  static_assert(std::is_same_v<typename std::remove_cvref_t<decltype(dy.value())>::layout_type, LX>);
  const auto dr = pdo::var(pdo::distribute<LX>(m, r.value()));
  pdo::backward(pdo::sum(dy * dr));
  check_close(dy.value(), y.value(), "output");
  check_close(dW.grad(), W.grad(), "weight gradient");
  check_close(dB.grad(), B.grad(), "bias gradient");
  check_close(dX.grad(), X.grad(), "input gradient");
}

/// @brief Max and average pooling of an input laid out as LX on `m`, forward and backward, against one place.
template <class LX, class Mesh>
void check_spatial_pool(const Mesh& m, const pdo::shape_t<4>& xs, std::size_t kernel, pdo::window_options o, unsigned seed) {
  const auto x = pdo_test::random_tensor<double>(xs, seed);
  auto X = pdo::parameter(x);
  auto dX = pdo::parameter(pdo::distribute<LX>(m, x));
  for (bool max : {true, false}) {
    INFO((max ? "max_pool2d" : "avg_pool2d"));
    X.zero_grad();
    dX.zero_grad();
    const auto y = max ? pdo::max_pool2d(X, kernel, o) : pdo::avg_pool2d(X, kernel, o);
    const pdo::var<pdo::tensor<double, 4>> r(pdo_test::random_tensor<double>(y.shape(), seed + 3));
    pdo::backward(pdo::sum(y * r));
    const auto dy = max ? pdo::max_pool2d(dX, kernel, o) : pdo::avg_pool2d(dX, kernel, o);
    pdo::backward(pdo::sum(dy * pdo::var(pdo::distribute<LX>(m, r.value()))));
    check_close(dy.value(), y.value(), "output");
    check_close(dX.grad(), X.grad(), "input gradient");
  }
}

}  // namespace

TEST_CASE("spatial conv2d: height, width or both split, halos from as many places as they need, forward and backward",
          "[model_parallel][conv][spatial]") {
  // 11 x 9 images: uneven shards on 2, 3 and 4 places; a kernel of 7 over 4 places reads rows
  // of three of them; strides and paddings leave some places no output rows, or only padding
  using H = pdo::layout<R, R, split<"sp">, R>;
  using W = pdo::layout<R, R, R, split<"sp">>;
  using HW = pdo::layout<R, R, split<"sh">, split<"sw">>;
  const pdo::shape_t<4> xs{2, 2, 11, 9};
  unsigned seed = 100;
  for (std::size_t kernel : {1, 3, 5, 7})
    for (std::size_t stride : {1, 2, 3})
      for (std::size_t padding = 0; padding <= 3; ++padding) {
        const pdo::window_options o{stride, padding};
        INFO("kernel " << kernel << ", stride " << stride << ", padding " << padding);
        for (std::size_t n : {2, 3, 4}) {
          INFO(n << " places");
          const auto line = pdo::make_mesh<"sp">(pdo::cpu_places(n));
          check_spatial_conv<H>(line, xs, kernel, o, ++seed);
          check_spatial_conv<W>(line, xs, kernel, o, ++seed);
        }
        for (auto [sh, sw] : {std::pair<std::size_t, std::size_t>{2, 2}, {3, 1}, {1, 3}, {2, 1}}) {
          INFO(sh << " x " << sw << " places");
          check_spatial_conv<HW>(pdo::make_mesh<"sh", "sw">(pdo::cpu_places(sh * sw), {sh, sw}), xs, kernel, o, ++seed);
        }
      }
  // the dim that is not split so narrow that all its windows fall in the padding (each output is
  // its bias, the input gets no gradient): the block of a whole dim is still padded as the image is
  const auto line = pdo::make_mesh<"sp">(pdo::cpu_places(3));
  for (auto [kernel, stride, padding] : {std::array<std::size_t, 3>{1, 3, 1}, {1, 4, 1}, {2, 4, 2}})
    for (std::size_t narrow : {1, 2}) {
      INFO("kernel " << kernel << ", stride " << stride << ", padding " << padding << ", the whole dim " << narrow << " wide");
      const pdo::window_options o{stride, padding};
      check_spatial_conv<H>(line, pdo::shape_t<4>{2, 2, 7, narrow}, kernel, o, ++seed);
      check_spatial_conv<W>(line, pdo::shape_t<4>{2, 2, narrow, 7}, kernel, o, ++seed);
    }
}

TEST_CASE("conv2d of operands on different meshes: a layout_error naming the operand and both meshes",
          "[model_parallel][conv][errors]") {
  const auto three = pdo::make_mesh<"x">(pdo::cpu_places(3));
  const auto one = pdo::make_mesh<"x">(pdo::cpu_places(1));
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<4>{1, 1, 6, 4}, 7);
  const auto w = pdo_test::random_tensor<double>(pdo::shape_t<4>{1, 1, 3, 3}, 8);
  const auto b = pdo_test::random_tensor<double>(pdo::shape_t<1>{1}, 9);
  using H = pdo::layout<R, R, split<"x">, R>;
  using RW = pdo::layout<R, R, R, R>;
  const auto X = pdo::parameter(pdo::distribute<H>(three, x));
  const auto W3 = pdo::parameter(pdo::distribute<RW>(three, w)), W1 = pdo::parameter(pdo::distribute<RW>(one, w));
  const auto B3 = pdo::parameter(pdo::distribute<pdo::layout<R>>(three, b)), B1 = pdo::parameter(pdo::distribute<pdo::layout<R>>(one, b));
  CHECK_THROWS_AS(pdo::conv2d(X, W1, B3, {1, 1}), pdo::layout_error);
  CHECK_THROWS_WITH(pdo::conv2d(X, W1, B3, {1, 1}),
                    Catch::Contains("conv2d: the weight") && Catch::Contains("lives on mesh(x=1), another mesh than the input's (mesh(x=3))"));
  CHECK_THROWS_WITH(pdo::conv2d(X, W3, B1, {1, 1}), Catch::Contains("conv2d: the bias") && Catch::Contains("another mesh than the input's"));
  // on one mesh the same operands convolve
  CHECK(pdo::gather(pdo::conv2d(X, W3, B3, {1, 1}).value()).shape() == pdo::shape_t<4>{1, 1, 6, 4});
}

TEST_CASE("spatial interior: the output rows whose windows read no halo row are exactly those computed before the halo",
          "[model_parallel][conv][spatial]") {
  // every geometry of the spatial tests and more: each output row of each place is in its
  // interior exactly when the rows of the image its window reads are its own
  std::size_t nonempty = 0, checked = 0;
  for (std::size_t extent = 1; extent <= 13; ++extent)
    for (std::size_t parts = 1; parts <= 4; ++parts)
      for (std::size_t kernel = 1; kernel <= 7; ++kernel)
        for (std::size_t stride = 1; stride <= 3; ++stride)
          for (std::size_t padding = 0; padding <= 3; ++padding) {
            if (extent + 2 * padding < kernel) continue;
            const std::size_t out = (extent + 2 * padding - kernel) / stride + 1;
            const pdo::detail::halo_dim d{extent, out, kernel, stride, padding, parts};
            for (std::size_t c = 0; c < parts; ++c) {
              const auto inner = d.interior(c);
              const auto own = d.own(c), rows = d.out(c);
              nonempty += inner.size() != 0;
              std::vector<bool> own_only;  // per output row of the place
              for (std::size_t r = rows.begin; r < rows.end; ++r) {
                // window r reads padded rows [r * stride, r * stride + kernel): image rows from r * stride - padding
                const std::size_t lo = std::max(r * stride, padding), hi = std::min(r * stride + kernel, extent + padding);
                own_only.push_back(lo >= hi || (lo - padding >= own.begin && hi - padding <= own.end));
              }
              // one run: the interior is that run; else (rows of padding past a halo row) empty
              std::size_t runs = 0;
              for (std::size_t i = 0; i < own_only.size(); ++i) runs += own_only[i] && (i == 0 || !own_only[i - 1]);
              for (std::size_t i = 0; i < own_only.size(); ++i) {
                INFO("extent " << extent << ", " << parts << " parts, kernel " << kernel << ", stride " << stride << ", padding "
                               << padding << ", place " << c << ", output row " << rows.begin + i);
                CHECK((runs == 1 && own_only[i]) == (i >= inner.begin && i < inner.end));
                ++checked;
              }
            }
          }
  CHECK(nonempty > 1000);
  CHECK(checked > 10000);
}

TEST_CASE("spatial conv2d with batch and channel splits: dp x sp and sp x tp", "[model_parallel][conv][spatial]") {
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<4>{3, 4, 10, 7}, 7);
  const auto w = pdo_test::random_tensor<double>(pdo::shape_t<4>{6, 4, 3, 3}, 8);
  const auto b = pdo_test::random_tensor<double>(pdo::shape_t<1>{6}, 9);
  auto X = pdo::parameter(x), Wt = pdo::parameter(w);
  auto B = pdo::parameter(b);
  const pdo::window_options o{1, 1};
  const auto y = pdo::conv2d(X, Wt, B, o);
  const pdo::var<pdo::tensor<double, 4>> r(pdo_test::random_tensor<double>(y.shape(), 10));
  pdo::backward(pdo::sum(y * r));
  auto run = [&]<class LX, class LW, class LB, class LY>(const auto& m) {
    auto dX = pdo::parameter(pdo::distribute<LX>(m, x));
    auto dW = pdo::parameter(pdo::distribute<LW>(m, w));
    auto dB = pdo::parameter(pdo::distribute<LB>(m, b));
    const auto dy = pdo::conv2d(dX, dW, dB, o);
    static_assert(std::is_same_v<typename std::remove_cvref_t<decltype(dy.value())>::layout_type, LY>);
    pdo::backward(pdo::sum(dy * pdo::var(pdo::distribute<LY>(m, r.value()))));
    check_close(dy.value(), y.value(), "output");
    check_close(dW.grad(), Wt.grad(), "weight gradient");
    check_close(dB.grad(), B.grad(), "bias gradient");
    check_close(dX.grad(), X.grad(), "input gradient");
  };
  SECTION("dp x sp") {
    using LX = pdo::layout<split<"dp">, R, split<"sp">, R>;
    run.template operator()<LX, pdo::layout<R, R, R, R>, pdo::layout<R>, LX>(pdo::make_mesh<"dp", "sp">(pdo::cpu_places(4), {2, 2}));
  }
  SECTION("sp x tp: output channels over tp") {
    using LX = pdo::layout<R, R, split<"sp">, R>;
    run.template operator()<LX, pdo::layout<split<"tp">, R, R, R>, pdo::layout<split<"tp">>, pdo::layout<R, split<"tp">, split<"sp">, R>>(
        pdo::make_mesh<"sp", "tp">(pdo::cpu_places(4), {2, 2}));
  }
  SECTION("sp x tp: input channels over tp (partial output)") {
    using LX = pdo::layout<R, split<"tp">, R, split<"sp">>;
    using LY = pdo::layout<R, R, R, split<"sp">>::partial<"tp">;
    run.template operator()<LX, pdo::layout<R, split<"tp">, R, R>, pdo::layout<R>, LY>(pdo::make_mesh<"sp", "tp">(pdo::cpu_places(6), {3, 2}));
  }
}

TEST_CASE("spatial pooling: max and average over split height and width, forward and backward", "[model_parallel][conv][spatial]") {
  using H = pdo::layout<R, R, split<"sp">, R>;
  using HW = pdo::layout<R, R, split<"sh">, split<"sw">>;
  const pdo::shape_t<4> xs{2, 3, 11, 9};
  unsigned seed = 500;
  for (std::size_t kernel : {2, 3, 5})
    for (std::size_t stride : {0, 1, 2, 3})  // 0: the kernel
      for (std::size_t padding = 0; 2 * padding <= kernel; ++padding) {
        const pdo::window_options o{stride, padding};
        INFO("kernel " << kernel << ", stride " << stride << ", padding " << padding);
        for (std::size_t n : {2, 3, 4}) {
          INFO(n << " places");
          check_spatial_pool<H>(pdo::make_mesh<"sp">(pdo::cpu_places(n)), xs, kernel, o, ++seed);
        }
        check_spatial_pool<HW>(pdo::make_mesh<"sh", "sw">(pdo::cpu_places(4), {2, 2}), xs, kernel, o, ++seed);
      }
  // ties: equal values in a window send the gradient to its first maximum, as on one place
  auto X = pdo::parameter(pdo::tensor<double, 4>(pdo::shape_t<4>{1, 1, 6, 4}));
  auto dX = pdo::parameter(pdo::distribute<H>(pdo::make_mesh<"sp">(pdo::cpu_places(3)), X.value()));
  pdo::backward(pdo::sum(pdo::max_pool2d(X, 3, {1, 1})));
  pdo::backward(pdo::sum(pdo::max_pool2d(dX, 3, {1, 1})));
  check_close(dX.grad(), X.grad(), "input gradient of ties");

  // windows that do not fit: a pdo::shape_error naming the op, the shapes and the layouts
  const auto m3 = pdo::make_mesh<"sp">(pdo::cpu_places(3));
  const auto small = pdo::var(pdo::distribute<H>(m3, pdo::tensor<double, 4>(pdo::shape_t<4>{1, 2, 7, 5})));
  CHECK_THROWS_WITH(pdo::max_pool2d(small, 9),
                    Catch::StartsWith("max_pool2d: input [1, 2, 7, 5] (layout {replicate, replicate, split<sp>, replicate}) with kernel 9"));
  CHECK_THROWS_WITH(pdo::avg_pool2d(small, 2, {2, 2}),
                    Catch::StartsWith("avg_pool2d: padding 2 with kernel 2 on input [1, 2, 7, 5] (layout {replicate, replicate, split<sp>, replicate})"));
  const auto w = pdo::parameter(pdo::distribute<pdo::layout<R, R, R, R>>(m3, pdo::tensor<double, 4>(pdo::shape_t<4>{3, 2, 9, 9})));
  const auto b = pdo::parameter(pdo::distribute<pdo::layout<R>>(m3, pdo::tensor<double, 1>(pdo::shape_t<1>{3})));
  CHECK_THROWS_WITH(pdo::conv2d(small, w, b, pdo::window_options{}),
                    Catch::StartsWith("conv2d: input [1, 2, 7, 5] (layouts {replicate, replicate, split<sp>, replicate}, "
                                      "{replicate, replicate, replicate, replicate}, {replicate}) with kernel 9"));
  CHECK_THROWS_WITH(pdo::explain_conv2d(small, w, b), Catch::Contains("(layouts {replicate, replicate, split<sp>, replicate}"));
}

TEST_CASE("spatial plans: the halo exchange is a step of its own, counted by the plan, shown by explain with its bytes",
          "[model_parallel][conv][spatial][explain]") {
  using H = pdo::layout<R, R, split<"sp">, R>;
  using HW = pdo::layout<R, R, split<"sh">, split<"sw">>;
  using XH = pdo::dtensor<double, 4, pdo::mesh<"sp">, H>;
  using WR = pdo::dtensor<double, 4, pdo::mesh<"sp">, pdo::layout<R, R, R, R>>;
  using BR = pdo::dtensor<double, 1, pdo::mesh<"sp">, pdo::layout<R>>;
  constexpr auto conv_plan = pdo::conv2d_plan<XH, WR, BR>();
  static_assert(conv_plan.size == 2 && conv_plan.collectives() == 1 && conv_plan.kernels() == 1);
  static_assert(conv_plan.count(pdo::step_kind::all_to_all) == 1);  // a halo exchange runs as one all_to_all
  static_assert(conv_plan.steps[0].kind == pdo::plan_step_kind::halo_exchange && conv_plan.steps[0].move.axis == "sp" &&
                conv_plan.steps[0].move.dim == 2 && conv_plan.result_layout() == pdo::detail::value_of<H>());
  using XHW = pdo::dtensor<double, 4, pdo::mesh<"sh", "sw">, HW>;
  static_assert(pdo::pool2d_plan<XHW>().collectives() == 2 && pdo::pool2d_plan<XHW, false>().steps[1].move.axis == "sw");
  // batch and channel splits need no halo
  static_assert(pdo::pool2d_plan<pdo::dtensor<double, 4, pdo::mesh<"dp">, pdo::layout<split<"dp">, R, R, R>>>().collectives() == 0);

  // 11 rows over 3 places: 4, 4, 3; a kernel of 5 with padding 2 reads 2 rows each side, so place 0
  // sends rows 2-3 to place 1, place 1 rows 4-5 to place 0 and 6-7 to place 2, place 2 rows 8-9 to
  // place 1; a row of a [2, 3, ., 9] double shard is 2 * 3 * 9 * 8 = 432 bytes
  const auto line = pdo::make_mesh<"sp">(pdo::cpu_places(3));
  const auto x = pdo::distribute<H>(line, pdo_test::random_tensor<double>(pdo::shape_t<4>{2, 3, 11, 9}, 1));
  const auto w = pdo::distribute<pdo::layout<R, R, R, R>>(line, pdo_test::random_tensor<double>(pdo::shape_t<4>{4, 3, 5, 5}, 2));
  const auto b = pdo::distribute<pdo::layout<R>>(line, pdo_test::random_tensor<double>(pdo::shape_t<1>{4}, 3));
  const std::string text = pdo::explain_conv2d(x, w, b, {1, 2});
  INFO(text);
  CHECK(text.find("plan of conv2d -> [2, 4, 11, 9]") == 0);
  CHECK(text.find("1 kernel, 1 collective\n") != std::string::npos);
  CHECK(text.find("1. halo_exchange over sp for conv2d operand 0") != std::string::npos);
  CHECK(text.find("rows received per place: 2, 4, 2; bytes sent per place: 864, 1728, 864\n") != std::string::npos);
  CHECK(text.find("2. kernel conv2d") != std::string::npos);
  CHECK(text.find("weight and bias gradients partial over sp") != std::string::npos);
  // what runs is counted as the plan counts it: the halo exchange, and the way back of its
  // rows' gradient, each one all_to_all of the one group of places along sp
  pdo::reset_planned_collectives();
  const auto y = pdo::conv2d(pdo::parameter(x), pdo::parameter(w), pdo::parameter(b), {1, 2});
  CHECK(pdo::planned_collectives(pdo::step_kind::all_to_all) == conv_plan.count(pdo::step_kind::all_to_all));
  pdo::backward(pdo::sum(y));
  CHECK(pdo::planned_collectives(pdo::step_kind::all_to_all) == 2);

  // 2 x 2 places over 11 x 9 (shards of 6 + 5 rows, 5 + 4 columns), 3 x 3 windows, stride 2, padding 1:
  // 6 x 5 outputs, 3 + 3 rows and 3 + 2 columns. Row 1's windows read input rows [5, 11): row 5 from
  // row 0 (80 bytes from place (0, 0): 2 channels x 5 columns x 8; 64 from (0, 1), 4 columns); row 0's
  // read [0, 6), its own. Column 0's windows read columns [0, 6): column 5 from column 1, whose
  // blocks have 6 rows after the height's exchange (2 x 6 x 8 = 96 bytes); column 1's read its own.
  const auto grid = pdo::make_mesh<"sh", "sw">(pdo::cpu_places(4), {2, 2});
  const auto xg = pdo::distribute<HW>(grid, pdo_test::random_tensor<double>(pdo::shape_t<4>{1, 2, 11, 9}, 4));
  const std::string pool = pdo::explain_max_pool2d(xg, 3, {2, 1});
  INFO(pool);
  CHECK(pool.find("plan of max_pool2d -> [1, 2, 6, 5]") == 0);
  CHECK(pool.find("1 kernel, 2 collectives\n") != std::string::npos);
  CHECK(pool.find("1. halo_exchange over sh for max_pool2d operand 0 ([1, 2, 11, 9] ") != std::string::npos);
  CHECK(pool.find("rows received per place: 0, 0, 1, 1; bytes sent per place: 80, 64, 0, 0\n") != std::string::npos);
  CHECK(pool.find("2. halo_exchange over sw") != std::string::npos);
  CHECK(pool.find("columns received per place: 1, 0, 1, 0; bytes sent per place: 0, 96, 0, 96\n") != std::string::npos);
  CHECK(pool.find("3. kernel max_pool2d") != std::string::npos);
  CHECK(pool.find("backward: kernel max_pool2d backward, then the halo rows' gradient sent back to their owners over sw, sh") !=
        std::string::npos);
  // on 2 x 2 places each exchange runs in two groups (one per row of places, one per column)
  pdo::reset_planned_collectives();
  const auto pooled = pdo::max_pool2d(pdo::parameter(xg), 3, {2, 1});
  CHECK(pdo::planned_collectives(pdo::step_kind::all_to_all) == 4);
  pdo::backward(pdo::sum(pooled));
  CHECK(pdo::planned_collectives(pdo::step_kind::all_to_all) == 8);
}

TEST_CASE("spatial training: a small CNN on a dp x sp mesh equals one place step by step", "[model_parallel][conv][spatial]") {
  // images 12 x 10 over 1 or 2 "dp" places and 2 or 3 "sp" places: uneven row shards
  const pdo_test::cnn_problem d(4, 12, 10, 21);
  const auto train = [&](auto distribute_x, auto distribute_p) { return pdo_test::train_cnn(d, distribute_x, distribute_p, 2e-7, 4); };
  const auto [reference, w_reference] = train([](const auto& t) { return t; }, [](const auto& t) { return t; });
  REQUIRE(reference.back() < reference.front());
  for (auto [dp, sp] : {std::pair<std::size_t, std::size_t>{2, 2}, {1, 3}, {2, 3}}) {
    INFO("dp " << dp << " x sp " << sp);
    const auto m = pdo::make_mesh<"dp", "sp">(pdo::cpu_places(dp * sp), {dp, sp});
    const auto [losses, w] = train([&](const auto& t) { return pdo::distribute<pdo::layout<split<"dp">, R, split<"sp">, R>>(m, t); },
                                   [&]<class T, std::size_t N>(const pdo::tensor<T, N>& t) {
                                     return pdo::distribute<pdo::detail::replicated_layout_t<N>>(m, t);
                                   });
    for (std::size_t s = 0; s < losses.size(); ++s) CHECK(losses[s] == Approx(reference[s]).epsilon(1e-12));
    for (std::size_t i = 0; i < w.size(); ++i) CHECK(w.data()[i] == Approx(w_reference.data()[i]).epsilon(1e-12));
  }
}
