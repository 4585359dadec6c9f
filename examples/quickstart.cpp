// examples/quickstart.cpp: the quick start. Distributes a batch and a weight matrix over a
// mesh of CPU places, runs a dense layer with parallel_do, redistributes the result, and
// checks it against the same program on one place, printing what happened at each step.
#include <pdo/pdo.hpp>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>

namespace {

using pdo::replicate;
using pdo::split;

/// @brief relu(x * w) on one place: the program every place runs on its shard.
pdo::tensor<float, 2> dense_relu(const pdo::tensor<float, 2>& x, const pdo::tensor<float, 2>& w) {
  pdo::tensor<float, 2> y({x.extent(0), w.extent(1)});
  for (std::size_t i = 0; i < x.extent(0); ++i)
    for (std::size_t l = 0; l < x.extent(1); ++l)
      for (std::size_t j = 0; j < w.extent(1); ++j) y(i, j) += x(i, l) * w(l, j);
  for (auto& v : y) v = v > 0 ? v : 0;
  return y;
}

pdo::tensor<float, 2> pattern(std::size_t rows, std::size_t cols, float scale) {
  pdo::tensor<float, 2> t({rows, cols});
  for (std::size_t i = 0; i < t.size(); ++i) t.data()[i] = scale * static_cast<float>(static_cast<int>(i % 13) - 6);
  return t;
}

template <class D>
void show_shards(const D& d) {
  std::cout << "  " << d.describe() << "\n";
  for (std::size_t p : d.mesh().local_places())
    std::cout << "    " << d.mesh().place(p).name() << " holds " << pdo::describe(d.shard(p)) << " at offset "
              << pdo::detail::format_extents(d.local_offset(p)) << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t n = 4;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--places") n = static_cast<std::size_t>(std::atoi(argv[i + 1]));
  if (n < 2 || n % 2 != 0) {
    std::cerr << "quickstart: --places takes an even number >= 2 (the mesh is 2 x places/2)\n";
    return 2;
  }
  try {
    const auto places = pdo::cpu_places(n);
    const auto mesh = pdo::make_mesh<"dp", "tp">(places, {2, n / 2});
    std::cout << "mesh: " << mesh.describe() << "\n";

    // a batch of 11 rows (uneven: 6 and 5 over "dp") and a 6 x 8 weight matrix
    const auto x_host = pattern(11, 6, 0.5f), w_host = pattern(6, 8, 0.25f);
    using batch_split = pdo::layout<split<"dp">, replicate>;
    using column_split = pdo::layout<replicate, split<"tp">>;
    const auto x = pdo::distribute<batch_split>(mesh, x_host);
    const auto w = pdo::distribute<column_split>(mesh, w_host);
    std::cout << "distribute:\n";
    show_shards(x);
    show_shards(w);

    // every place computes its block of rows x columns
    using out_layout = pdo::layout<split<"dp">, split<"tp">>;
    const auto y = pdo::parallel_do<out_layout>(dense_relu, x, w);
    std::cout << "parallel_do -> " << pdo::layout_name<out_layout>() << ":\n";
    show_shards(y);

    // gather the columns back: the planner picks an all_gather over "tp"
    using rows_only = pdo::layout<split<"dp">, replicate>;
    constexpr auto plan = pdo::redistribute_plan_of<out_layout, rows_only>();
    static_assert(plan.count(pdo::step_kind::all_gather) == 1 && plan.collectives() == 1);
    std::cout << "redistribute plan:\n  " << pdo::describe(plan);
    const auto z = pdo::redistribute<rows_only>(y);
    show_shards(z);

    const auto out = pdo::gather(z);
    const auto expected = dense_relu(x_host, w_host);
    double worst = 0;
    for (std::size_t i = 0; i < out.size(); ++i) worst = std::max(worst, double(std::abs(out.data()[i] - expected.data()[i])));
    std::cout << "gather: " << pdo::describe(out) << ", max difference from the single-place program: " << worst << "\n";
    for (const auto& p : places) {
      const auto s = p.memory().stats();
      std::cout << "  " << p.name() << ": peak " << s.peak_bytes_in_use << " bytes, " << s.allocations << " allocations\n";
    }
    return worst == 0 ? 0 : 1;
  } catch (const pdo::error& e) {
    std::cerr << "quickstart: " << e.what() << "\n";
    return 1;
  }
}
