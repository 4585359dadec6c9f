// tests/mpi_fatal.cpp: a failure that the other processes cannot be told of ends the job
// with a message instead of a hang. Places 0 and 1 (on process 0) call an all_reduce of
// their "tp" line with different sizes while the other line is fine; the ctest expects
// the job to end with "pdo: fatal" (and fails on a time-out).
#include <pdo/pdo.hpp>

#include <span>
#include <vector>

int main() {
  const auto places = pdo::mpi::world_places(2);
  const auto mesh = pdo::make_mesh<"dp", "tp">(places, {places.size() / 2, 2});
  pdo::spmd(mesh, [&](std::size_t p) {
    std::vector<float> v(p == 0 ? 3 : 4);
    pdo::communicator_along(mesh, 1, p).all_reduce(std::span<float>(v));
    pdo::communicator_along(mesh, 0, p).all_reduce(std::span<float>(v));
  });
  return 0;  // not reached on process 0; the job ends
}
