// examples/collectives.cpp: collectives along the axes of a 2x2 mesh from pdo::spmd tasks:
// a sum along "tp", a gather along "dp", and a ring of send/recv over the whole mesh.
#include <pdo/pdo.hpp>

#include <iostream>
#include <numeric>
#include <span>
#include <vector>

static_assert(pdo::communicator<pdo::mesh_communicator>);

int main() {
  const auto mesh = pdo::make_mesh<"dp", "tp">(pdo::cpu_places(4), {2, 2});
  constexpr std::size_t dp = decltype(mesh)::axis_index("dp"), tp = decltype(mesh)::axis_index("tp");
  static_assert(dp == 0 && tp == 1);
  std::vector<std::vector<double>> sums(4), gathered(4);
  std::vector<int> from_left(4);
  pdo::spmd(mesh, [&](std::size_t p) {
    sums[p].assign(1 << 16, static_cast<double>(p));
    pdo::communicator_along(mesh, tp, p).all_reduce(std::span<double>(sums[p]));
    const std::vector<double> mine{static_cast<double>(p)};
    gathered[p].resize(2);
    pdo::communicator_along(mesh, dp, p).all_gather(std::span<const double>(mine), std::span<double>(gathered[p]));
    const auto all = pdo::communicator_of(mesh, p);
    const int me = static_cast<int>(p);
    if (p % 2 == 0) {  // even places send first: the ring never waits on itself
      all.send(std::span<const int>(&me, 1), (p + 1) % 4);
      all.recv(std::span<int>(&from_left[p], 1), (p + 3) % 4);
    } else {
      all.recv(std::span<int>(&from_left[p], 1), (p + 3) % 4);
      all.send(std::span<const int>(&me, 1), (p + 1) % 4);
    }
  });
  bool ok = true;
  for (std::size_t p = 0; p < 4; ++p) {
    double line_sum = 0;
    for (auto q : mesh.group(tp, p)) line_sum += static_cast<double>(q);
    const auto column = mesh.group(dp, p);
    ok = ok && sums[p].back() == line_sum && gathered[p][0] == static_cast<double>(column[0]) &&
         gathered[p][1] == static_cast<double>(column[1]) && from_left[p] == static_cast<int>((p + 3) % 4);
    std::cout << mesh.place(p).name() << ": tp-sum " << sums[p].back() << ", dp-gather [" << gathered[p][0] << ", "
              << gathered[p][1] << "], from the left " << from_left[p] << "\n";
  }
  std::cout << (ok ? "all collectives correct\n" : "WRONG\n");
  return ok ? 0 : 1;
}
