// tests/package/consumer/main_cuda.cpp: a consumer of the installed package that runs on GPU
// places (built against simulated devices with -DPDO_CUDA_SIMULATOR=ON).
#include <pdo/pdo.hpp>

#include <cstdio>

int main() {
  const auto gpus = pdo::cuda_places();
  if (gpus.empty()) {
    std::printf("no GPU place: %s\n", pdo::cuda_unavailable_reason().c_str());
    return 1;
  }
  const auto mesh = pdo::make_mesh<"dp">(gpus, {gpus.size()});
  pdo::tensor<float, 2> host({7, 3});
  for (std::size_t i = 0; i < host.size(); ++i) host.data()[i] = static_cast<float>(i) - 10.0f;
  const auto x = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(mesh, host);
  const auto y = pdo::gather(pdo::eval(pdo::relu(x * 2.0f)));
  for (std::size_t i = 0; i < host.size(); ++i) {
    const float want = host.data()[i] > 0 ? 2 * host.data()[i] : 0;
    if (y.data()[i] != want) {
      std::printf("element %zu is %g, want %g\n", i, y.data()[i], want);
      return 1;
    }
  }
  std::printf("relu(x * 2) on %zu GPU places: ok\n", gpus.size());
  return 0;
}
