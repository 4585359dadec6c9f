// A layer_norm between the column and the row layer of a Megatron pair, where each place holds
// a slice of the features: one error from tensor_parallel, nothing of the model's uses after it.
// expect: pdo: tensor_parallel: a layer_norm sits between the column and the row layer of a pair
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  using namespace pdo::nn;
  auto model = sequential(linear<float>(4, 8, gen), relu{}, layer_norm{}, linear<float>(8, 3, gen));
  const auto m = pdo::make_mesh<"tp">(pdo::cpu_places(2));
  auto tp = tensor_parallel<"tp">(m, model);
  pdo::tensor<float, 2> x({5, 4});
  const auto y = tp(pdo::var(pdo::distribute<pdo::layout<pdo::replicate, pdo::replicate>>(m, x)));
  return y.shape()[0] == 5 ? 0 : 1;
}
