// A parallel_do block whose parameter cannot take a shard (a non-const reference: each
// place's shard arrives as a const pdo::tensor&): one error, and none for the result's uses.
// expect: pdo: parallel_do: the block cannot be called with the arguments as it receives them
#include <pdo/pdo.hpp>

int main() {
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  using L = pdo::layout<pdo::split<"dp">, pdo::replicate>;
  const auto x = pdo::distribute<L>(m, pdo::tensor<float, 2>({4, 3}));
  const auto y = pdo::parallel_do<L>([](pdo::tensor<float, 2>& shard) { return pdo::relu(shard); }, x);
  return pdo::gather(y)(0, 0) > 0 ? 0 : 1;
}
