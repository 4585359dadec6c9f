// compile_fail/strict_implicit_all_reduce.cpp: under pdo::strict, relu of a partial matmul (an implicit all_reduce).
// expect: strict_forbids_implicit_communication<pdo::fixed_string<5>..relu.., 0, pdo::layout<pdo::replicate, pdo::replicate>::partial<pdo::fixed_string<3>..tp..>, pdo::layout<pdo::replicate, pdo::replicate> >
// expect-nvcc: strict_forbids_implicit_communication<Op, Operand, Has, Needs> .with Op=pdo::fixed_string<5UL>..'r', 'e', 'l', 'u'.*Has=pdo::layout<pdo::replicate, pdo::replicate>::partial<
// nvcc: also
#include <pdo/pdo.hpp>

int main() {
  const auto mesh = pdo::make_mesh<"tp">(pdo::cpu_places(2));
  const pdo::tensor<float, 2> x({4, 6}), w({6, 3});
  const auto xs = pdo::distribute<pdo::layout<pdo::replicate, pdo::split<"tp">>>(mesh, x);
  const auto ws = pdo::distribute<pdo::layout<pdo::split<"tp">, pdo::replicate>>(mesh, w);
  const auto y = pdo::eval<pdo::strict>(pdo::relu(pdo::matmul(xs, ws)));
  return static_cast<int>(y.shape()[0]) - 4;
}
