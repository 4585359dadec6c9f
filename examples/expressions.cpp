// examples/expressions.cpp: a two-layer MLP forward pass written once as an expression and
// run on a 2 x 2 mesh (batch over "dp", the Megatron column/row pair over "tp"). The planner
// derives every layout and the one all_reduce from the weights' layouts; the plans are
// checked at compile time, printed with explain, and the result is checked against one place.
// With --gpu it runs on the machine's GPUs instead (2 x n/2).
#include "example_places.hpp"

#include <pdo/pdo.hpp>

#include <cmath>
#include <iostream>

namespace {

using pdo::replicate;
using pdo::split;

pdo::tensor<float, 2> pattern(std::size_t rows, std::size_t cols, float scale) {
  pdo::tensor<float, 2> t({rows, cols});
  for (std::size_t i = 0; i < t.size(); ++i) t.data()[i] = scale * static_cast<float>(static_cast<int>(i % 11) - 5);
  return t;
}

/// @brief The model, for tensors and dtensors alike: logits = gelu(x w1 + b1) w2.
template <class X, class W1, class B1, class W2>
auto mlp(const X& x, const W1& w1, const B1& b1, const W2& w2) {
  return pdo::matmul(pdo::gelu(pdo::matmul(x, w1) + b1), w2);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const auto places = example::places(argc, argv, 4);
    const auto mesh = pdo::make_mesh<"dp", "tp">(places, {2, places.size() / 2});
    // a batch of 9 samples (uneven over "dp": 5 and 4), 6 features, 10 hidden units, 3 classes
    const auto x_host = pattern(9, 6, 0.1f), w1_host = pattern(6, 10, 0.2f), w2_host = pattern(10, 3, 0.15f);
    pdo::tensor<float, 1> b1_host({10});
    for (std::size_t i = 0; i < 10; ++i) b1_host(i) = 0.05f * static_cast<float>(i);
    pdo::tensor<float, 1> labels_host({9}, {0, 1, 2, 0, 1, 2, 0, 1, 2});

    const auto x = pdo::distribute<pdo::layout<split<"dp">, replicate>>(mesh, x_host);
    const auto w1 = pdo::distribute<pdo::layout<replicate, split<"tp">>>(mesh, w1_host);  // column parallel
    const auto b1 = pdo::distribute<pdo::layout<split<"tp">>>(mesh, b1_host);
    const auto w2 = pdo::distribute<pdo::layout<split<"tp">, replicate>>(mesh, w2_host);  // row parallel
    const auto labels = pdo::distribute<pdo::layout<split<"dp">>>(mesh, labels_host);

    const auto logits = mlp(x, w1, b1, w2);
    using logits_t = decltype(logits);
    // the hidden layer stays split over "tp"; the second matmul leaves a partial sum over it
    static_assert(std::is_same_v<pdo::result_layout_t<logits_t>, pdo::layout<split<"dp">, replicate>::partial<"tp">>);
    static_assert(pdo::plan_of<logits_t>().collectives() == 0);
    // the loss needs whole rows of logits: exactly one all_reduce over "tp"
    const auto loss = pdo::cross_entropy(logits, labels);
    constexpr auto plan = pdo::plan_of<decltype(loss)>();
    static_assert(plan.count(pdo::step_kind::all_reduce) == 1 && plan.collectives() == 1);
    std::cout << pdo::explain(loss);

    const auto value = pdo::gather(pdo::eval(loss));
    const auto expected = pdo::eval(pdo::cross_entropy(mlp(x_host, w1_host, b1_host, w2_host), labels_host));
    std::cout << "loss on " << mesh.describe() << ": " << value.data()[0] << ", on one place: " << expected.data()[0] << "\n";
    if (std::abs(value.data()[0] - expected.data()[0]) > 1e-4f * (1 + std::abs(expected.data()[0]))) {
      std::cerr << "expressions: the mesh and the single place disagree\n";
      return 1;
    }
  } catch (const pdo::error& e) {
    std::cerr << "expressions: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
