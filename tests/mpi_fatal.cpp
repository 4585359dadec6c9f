// tests/mpi_fatal.cpp: a failure that the other processes cannot be told of ends the job
// with a message instead of a hang. Places 0 and 1 (on process 0) call an all_reduce of
// their "tp" line with different sizes while the other line is fine; the ctest expects
// the job to end with "pdo: fatal" (and fails on a time-out).
// With the argument `eval`: an evaluation whose kernel fails on process 1 only (a label out
// of range in its rows); process 0 goes on to the gather's collective, which would wait for
// process 1 until the collective timeout: the job ends instead.
// With the argument `skip`: two places per process; the task of place 1 (on process 0) ends
// without joining the all_reduce the others make. Place 0 would wait for it forever on its
// process (the timeout watches other processes only): the job ends, naming place 1.
#include <pdo/pdo.hpp>

#include <cstring>
#include <span>
#include <vector>

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "eval") == 0) {
    const auto line = pdo::make_mesh<"x">(pdo::mpi::world_places());
    const std::size_t rows = 2 * line.size();
    pdo::tensor<float, 2> logits({rows, 4});
    pdo::tensor<int, 1> labels({rows});
    for (std::size_t i = 0; i < rows; ++i) labels(i) = i == 3 ? 9 : static_cast<int>(i % 4);  // row 3: on process 1
    const auto x = pdo::distribute<pdo::layout<pdo::split<"x">, pdo::replicate>>(line, logits);
    const auto y = pdo::distribute<pdo::layout<pdo::split<"x">>>(line, labels);
    try {
      (void)pdo::gather(pdo::eval(pdo::cross_entropy(x, y)));
    } catch (const pdo::error&) {
    }
    (void)pdo::gather(pdo::eval(x * 2.0f));
    return 0;  // not reached: the job ends
  }
  if (argc > 1 && std::strcmp(argv[1], "skip") == 0) {
    const auto line = pdo::make_mesh<"x">(pdo::mpi::world_places(2));
    pdo::spmd(line, [&](std::size_t p) {
      if (p == 1) return;  // joins nothing
      std::vector<float> v(8, 1.0f);
      pdo::communicator_of(line, p).all_reduce(std::span<float>(v));
    });
    return 0;  // not reached: the job ends
  }
  const auto places = pdo::mpi::world_places(2);
  const auto mesh = pdo::make_mesh<"dp", "tp">(places, {places.size() / 2, 2});
  pdo::spmd(mesh, [&](std::size_t p) {
    std::vector<float> v(p == 0 ? 3 : 4);
    pdo::communicator_along(mesh, 1, p).all_reduce(std::span<float>(v));
    pdo::communicator_along(mesh, 0, p).all_reduce(std::span<float>(v));
  });
  return 0;  // not reached on process 0; the job ends
}
