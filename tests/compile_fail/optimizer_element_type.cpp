// compile_fail/optimizer_element_type.cpp: an sgd<float> over the parameters of a linear<double>.
// expect: pdo: sgd<T>: the parameters' element type is not T
#include <pdo/pdo.hpp>

int main() {
  pdo::nn::rng gen(1);
  pdo::nn::linear<double> layer(4, 2, gen);
  pdo::nn::sgd<float> opt(pdo::nn::parameters_of<double>(layer), {.lr = 0.1});
  opt.step();
  return 0;
}
