// tests/cuda/test_cuda_mpi.cu: GPU places over MPI processes, their collectives on NCCL
// bootstrapped over MPI (the unique id broadcast from the first place's process). Run it
// under mpirun with one process per GPU; run alone, it is one process. Without a GPU it
// reports itself skipped (exit 77) with the reason.
#include <pdo/pdo.hpp>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#if !defined(PDO_WITH_CUDA) || !defined(PDO_WITH_MPI)
#error "test_cuda_mpi.cu needs PDO_WITH_CUDA and PDO_WITH_MPI (link pdo::cuda and pdo::mpi)"
#endif

int main() {
  pdo::mpi::initialize();
  const std::string reason = pdo::cuda_unavailable_reason();
  if (!reason.empty()) {
    std::printf("SKIPPED: no CUDA device (%s)\n", reason.c_str());
    return 77;
  }
  try {
    const auto places = pdo::mpi::world_cuda_places(1);
    const std::size_t n = places.size();
    const auto m = pdo::make_mesh<"dp">(places, {n});
    // all_reduce of (rank + 1) over the processes: n (n + 1) / 2 everywhere
    std::vector<double> got(1);
    pdo::spmd(m, [&](std::size_t p) {
      pdo::tensor<double, 1> t({8}, m.place(p));
      t.fill(static_cast<double>(p + 1));
      pdo::communicator_of(m, p).all_reduce(t.span());
      got[0] = pdo::to_host(t).data()[7];
    });
    const double want = static_cast<double>(n * (n + 1) / 2);
    std::printf("%s: all_reduce over %zu GPU place(s): %g (want %g)\n", got[0] == want ? "ok" : "FAIL", n, got[0], want);
    return got[0] == want ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
}
