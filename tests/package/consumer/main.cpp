// tests/package/consumer/main.cpp: distributes a tensor on two CPU places and checks that gather gives it back
// (comparing with range-v3's zip, which comes with pdo::pdo).
#include <pdo/pdo.hpp>

#include <range/v3/view/enumerate.hpp>
#include <range/v3/view/zip.hpp>

#include <cstddef>
#include <cstdio>
#include <exception>
#include <span>

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
    const std::span<const float> got(back.data(), back.size()), want(host.data(), host.size());
    for (const auto [i, pair] : ranges::views::enumerate(ranges::views::zip(got, want))) {
      const auto [g, w] = pair;
      if (g != w) {
        std::printf("consumer: element %zu is %g, expected %g\n", static_cast<std::size_t>(i), static_cast<double>(g),
                    static_cast<double>(w));
        return 1;
      }
    }
    std::puts("consumer: ok");
    return 0;
  } catch (const std::exception& e) {
    std::printf("consumer: %s\n", e.what());
    return 1;
  }
}
