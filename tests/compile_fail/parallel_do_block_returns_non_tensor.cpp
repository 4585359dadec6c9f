// compile_fail/parallel_do_block_returns_non_tensor.cpp: a parallel_do block that returns an int.
// expect: pdo: parallel_do: the block must return a pdo::tensor
// nvcc: also
#include <pdo/pdo.hpp>

int main() {
  const auto places = pdo::cpu_places(2);
  const auto mesh = pdo::make_mesh<"dp">(places);
  const pdo::tensor<float, 2> host({4, 4});
  const auto x = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(mesh, host);
  const auto y = pdo::parallel_do<pdo::layout<pdo::split<"dp">, pdo::replicate>>(
      [](const pdo::tensor<float, 2>& shard) { return static_cast<int>(shard.size()); }, x);
  return static_cast<int>(y.shape()[0]) - 4;
}
