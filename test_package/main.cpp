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

    // matmul, on the system's BLAS when the package declares it (with_blas, the default)
    pdo::tensor<double, 2> a({2, 3});
    pdo::tensor<double, 2> b({3, 2});
    for (std::size_t i = 0; i < 6; ++i) {
      a.data()[i] = static_cast<double>(i + 1);
      b.data()[i] = static_cast<double>(i) - 2.0;
    }
    const pdo::tensor<double, 2> c = pdo::eval(pdo::matmul(a, b));
    const double expected[4] = {4.0, 10.0, 4.0, 19.0};
    for (std::size_t i = 0; i < 4; ++i) {
      if (c.data()[i] != expected[i]) {
        std::printf("test_package: matmul element %zu is %g, expected %g\n", i, c.data()[i], expected[i]);
        return 1;
      }
    }
#if defined(PDO_WITH_BLAS)
    std::puts("test_package: matmul on BLAS: ok");
#else
    std::puts("test_package: matmul without BLAS: ok");
#endif
    return 0;
  } catch (const std::exception& e) {
    std::printf("test_package: %s\n", e.what());
    return 1;
  }
}
