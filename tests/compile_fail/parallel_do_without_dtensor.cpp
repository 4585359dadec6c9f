// parallel_do given only a host tensor: no mesh to run on. One error saying to distribute it,
// and none for the result's uses.
// expect: pdo: parallel_do: needs a dtensor argument, whose mesh it runs on
#include <pdo/pdo.hpp>

int main() {
  const pdo::tensor<float, 2> h({4, 3});
  const auto r = pdo::parallel_do<pdo::layout<pdo::split<"x">, pdo::replicate>>(
      [](const pdo::tensor<float, 2>& s) { return pdo::eval(s * 2.0f); }, h);
  return pdo::gather(r).size() == 12 ? 0 : 1;
}
