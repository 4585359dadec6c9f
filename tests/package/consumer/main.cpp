// tests/package/consumer/main.cpp: distributes a tensor on two CPU places and checks that gather gives it back.
#include <pdo/pdo.hpp>

#include <cstddef>
#include <cstdio>
#include <exception>

int main() {
  try {
    const auto places = pdo::cpu_places(2);
    const auto mesh = pdo::make_mesh<"dp">(places);
    pdo::tensor<float, 2> host({7, 3});
    for (std::size_t i = 0; i < host.size(); ++i) host.data()[i] = 0.25f * static_cast<float>(i) - 1.0f;
    const auto x = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(mesh, host);
    const auto back = pdo::gather(x);
    if (back.shape() != host.shape()) {
      std::puts("consumer: gather returned another shape");
      return 1;
    }
    for (std::size_t i = 0; i < host.size(); ++i)
      if (back.data()[i] != host.data()[i]) {
        std::printf("consumer: element %zu is %g, expected %g\n", i, static_cast<double>(back.data()[i]),
                    static_cast<double>(host.data()[i]));
        return 1;
      }
    std::puts("consumer: ok");
    return 0;
  } catch (const std::exception& e) {
    std::printf("consumer: %s\n", e.what());
    return 1;
  }
}
