// Model parallelism: tensor parallel (the Megatron pair, derived from parameter layouts),
// hybrid data x tensor meshes, and training that matches one place step by step.
#include "model_support.hpp"

#include <pdo/nn.hpp>

#include <vector>

namespace {

using pdo_test::labels_for;
using pdo_test::local_losses;
using pdo_test::make_mlp;
using pdo::replicate;
using pdo::split;

/// @brief The same, tensor parallel along "tp" on `m`, the batch split along "dp" if the mesh has it.
template <class Mesh>
std::vector<double> parallel_losses(const Mesh& m, const pdo::tensor<double, 2>& x, const pdo::tensor<int, 1>& y, int steps) {
  auto model = pdo::nn::tensor_parallel<"tp">(m, make_mlp());
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
