// test_package/main.cpp: splits a tensor over two CPU places, gathers it back and checks every element
// (paired with range-v3's zip, which comes with pdo::pdo).
#include <pdo/pdo.hpp>

#include <range/v3/view/zip.hpp>

#include <cstddef>
#include <cstdio>
#include <exception>
#include <span>

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
    // range-v3 comes with pdo::pdo
    std::size_t i = 0;
    for (const auto [got, want] : ranges::views::zip(std::span(back.data(), back.size()), std::span(host.data(), host.size()))) {
      if (got != want) {
        std::printf("test_package: element %zu is %d, expected %d\n", i, got, want);
        return 1;
      }
      ++i;
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
    // the kernels of a place with several cores use them all when the package declares OpenMP (with_openmp, the default)
#if defined(_OPENMP)
    std::puts("test_package: kernels on OpenMP: ok");
#else
    std::puts("test_package: kernels without OpenMP: ok");
#endif
    return 0;
  } catch (const std::exception& e) {
    std::printf("test_package: %s\n", e.what());
    return 1;
  }
}
