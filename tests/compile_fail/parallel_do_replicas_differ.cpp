// compile_fail/parallel_do_replicas_differ.cpp: a parallel_do whose weight is cut along "tp" while its
// out layout replicates over "tp": each place along "tp" returns other columns, not copies of one value.
// expect: pdo: parallel_do: an operand is split
#include <pdo/pdo.hpp>

int main() {
  const auto mesh = pdo::make_mesh<"dp", "tp">(pdo::cpu_places(4), {2, 2});
  const pdo::tensor<float, 2> x_host({8, 4}), w_host({4, 6});
  const auto x = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(mesh, x_host);
  const auto w = pdo::distribute<pdo::layout<pdo::replicate, pdo::split<"tp">>>(mesh, w_host);
  const auto y = pdo::parallel_do<pdo::layout<pdo::split<"dp">, pdo::replicate>>(
      [](const auto& xs, const auto& ws) { return pdo::matmul(xs, ws); }, x, w);
  (void)y;
  return 0;
}
