// test_package/main.cpp: splits a tensor over two CPU places, gathers it back and checks every element.
#include <pdo/pdo.hpp>

#include <cstddef>
#include <cstdio>
#include <exception>

int main() {
  try {
    const auto places = pdo::cpu_places(2);
    const auto mesh = pdo::make_mesh<"dp">(places);
    pdo::tensor<int, 2> host({5, 4});
    for (std::size_t i = 0; i < host.size(); ++i) host.data()[i] = static_cast<int>(3 * i + 1);

    const auto rows = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(mesh, host);
    const pdo::tensor<int, 2> back = pdo::gather(rows);

    if (back.shape() != host.shape()) {
      std::puts("test_package: gather returned another shape");
      return 1;
    }
    for (std::size_t i = 0; i < host.size(); ++i) {
      if (back.data()[i] != host.data()[i]) {
        std::printf("test_package: element %zu is %d, expected %d\n", i, back.data()[i], host.data()[i]);
        return 1;
      }
    }
    std::puts("test_package: pdo distribute and gather over 2 places: ok");
    return 0;
  } catch (const std::exception& e) {
    std::printf("test_package: %s\n", e.what());
    return 1;
  }
}
