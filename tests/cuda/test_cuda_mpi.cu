// tests/cuda/test_cuda_mpi.cu: GPU places over MPI processes, their collectives on NCCL
// bootstrapped over MPI (the unique id broadcast from the first place's process): an
// all_reduce, distribute (whose agreement check on the host shapes goes over the host group,
// not NCCL), parallel_do, gather, a redistribution, the data-parallel trainer; the pipeline
// with stages in different processes (tensors staged through host memory between them, handed
// over by device copies within one); with three or more processes, a mesh over the places of
// the first two, which the others make too while holding none of its places.
// Run it under mpirun with one process per GPU; run alone, it is one process. Without a GPU
// it reports itself skipped (exit 77) with the reason. With the argument `skip`, a place's
// task ends without joining a collective: the job ends with "pdo: fatal" naming it.
#include <pdo/pdo.hpp>

#include <cmath>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#if !defined(PDO_WITH_CUDA) || !defined(PDO_WITH_MPI)
#error "test_cuda_mpi.cu needs PDO_WITH_CUDA and PDO_WITH_MPI (link pdo::cuda and pdo::mpi)"
#endif

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("rank %d: %s %s\n", pdo::mpi::rank(), ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

pdo::tensor<double, 2> numbered(std::size_t rows, std::size_t cols) {
  pdo::tensor<double, 2> t({rows, cols});
  for (std::size_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<double>(i % 97) * 0.5 - 3;
  return t;
}

bool same_values(const pdo::tensor<double, 2>& a, const pdo::tensor<double, 2>& b) {
  if (a.shape() != b.shape()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::abs(a.data()[i] - b.data()[i]) > 1e-12 * (1 + std::abs(b.data()[i]))) return false;
  return true;
}

template <class Mesh>
void programs(const Mesh& m, const std::string& what) {
  using pdo::replicate;
  using pdo::split;
  const std::size_t n = m.size();
  // all_reduce of (place + 1): n (n + 1) / 2 everywhere
  std::vector<double> got(m.local_places().size(), 0);
  pdo::spmd(m, [&](std::size_t p) {
    pdo::tensor<double, 1> t({8}, m.place(p));
    t.fill(static_cast<double>(p + 1));
    pdo::communicator_of(m, p).all_reduce(t.span());
    for (std::size_t k = 0; k < m.local_places().size(); ++k)
      if (m.local_places()[k] == p) got[k] = pdo::to_host(t).data()[7];
  });
  bool sums = true;
  for (double g : got) sums = sums && g == static_cast<double>(n * (n + 1) / 2);
  check(sums, what + ": all_reduce over " + std::to_string(n) + " GPU places");
  // distribute (its host shapes agreed over the host group), redistribute, gather
  const auto host = numbered(11, 6);
  const auto rows = pdo::distribute<pdo::layout<split<"dp">, replicate>>(m, host);
  const auto cols = pdo::redistribute<pdo::layout<replicate, split<"dp">>>(rows);
  check(same_values(pdo::gather(rows), host) && same_values(pdo::gather(cols), host), what + ": distribute, all_to_all and gather");
  // parallel_do: the block's outcomes shared over the host group
  const auto doubled = pdo::parallel_do<pdo::layout<split<"dp">, replicate>>(
      [](const pdo::tensor<double, 2>& shard) {
        auto h = pdo::to_host(shard);
        for (auto& v : h) v *= 2;
        return h;
      },
      rows);
  auto want = host;
  for (auto& v : want) v *= 2;
  check(same_values(pdo::gather(doubled), want), what + ": parallel_do");
  // the data-parallel trainer over these GPU places follows one process's CPU places, step by step
  auto make = [] {
    pdo::nn::rng gen(7);
    return pdo::nn::sequential(pdo::nn::linear<double>(6, 8, gen), pdo::nn::tanh{}, pdo::nn::linear<double>(8, 3, gen));
  };
  auto sgd = [](auto params) { return pdo::nn::sgd<double>(std::move(params), {.lr = 0.2, .momentum = 0.5}); };
  const auto x = numbered(11, 6);
  pdo::tensor<int, 1> y({11});
  for (std::size_t i = 0; i < 11; ++i) y(i) = static_cast<int>(i % 3);
  auto losses = [&](const auto& mesh) {
    auto trainer = pdo::nn::make_data_parallel<double>(mesh, make, sgd, {.bucket_bytes = 128});
    std::vector<double> out;
    for (int s = 0; s < 3; ++s) out.push_back(trainer.step(x, y));
    return out;
  };
  const auto want_losses = losses(pdo::make_mesh<"dp">(pdo::cpu_places(n), {n}));
  const auto got_losses = losses(m);
  bool follows = got_losses.size() == want_losses.size();
  for (std::size_t s = 0; follows && s < got_losses.size(); ++s)
    follows = std::abs(got_losses[s] - want_losses[s]) <= 1e-10 * (1 + std::abs(want_losses[s]));
  check(follows, what + ": the data-parallel trainer's losses equal those of " + std::to_string(n) + " CPU places");
}

/// Pipeline training over "pp" with stages on the GPU places of different processes follows the
/// same training on CPU places of one process, loss by loss, for both schedules: `Cuts...` cut
/// the model into as many stages as `m` has places along "pp".
template <std::size_t... Cuts, class Mesh, class CpuMesh>
void pipeline_follows(const Mesh& m, const CpuMesh& cpu, const std::string& what) {
  auto make = [] {
    pdo::nn::rng gen(5);
    return pdo::nn::sequential(pdo::nn::linear<double>(6, 8, gen), pdo::nn::relu{}, pdo::nn::linear<double>(8, 8, gen), pdo::nn::tanh{},
                               pdo::nn::linear<double>(8, 3, gen));
  };
  auto sgd = [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.2, .momentum = 0.5}); };
  const auto x = numbered(13, 6);
  pdo::tensor<int, 1> y({13});
  for (std::size_t i = 0; i < 13; ++i) y(i) = static_cast<int>(i % 3);
  for (const auto kind : {pdo::nn::pipeline_schedule::gpipe, pdo::nn::pipeline_schedule::one_f_one_b}) {
    auto losses = [&](const auto& mesh) {
      auto trainer = pdo::nn::make_pipeline<double, 2, Cuts...>(mesh, make(), sgd, {kind, 3});
      std::vector<double> out;
      for (int s = 0; s < 3; ++s) out.push_back(trainer.step(x, y));
      return out;
    };
    const auto want = losses(cpu), got = losses(m);
    bool follows = got.size() == want.size();
    for (std::size_t s = 0; follows && s < got.size(); ++s) follows = std::abs(got[s] - want[s]) <= 1e-10 * (1 + std::abs(want[s]));
    check(follows, what + ": the pipeline's losses (" + (kind == pdo::nn::pipeline_schedule::gpipe ? "GPipe" : "1F1B") +
                       ") equal those of CPU places");
  }
}

}  // namespace

int main(int argc, char** argv) {
  pdo::mpi::initialize();
  const std::string reason = pdo::cuda_unavailable_reason();
  if (!reason.empty()) {
    std::printf("SKIPPED: no CUDA device (%s)\n", reason.c_str());
    return 77;
  }
  if (argc > 1 && std::string(argv[1]) == "skip") {
    // two GPU places per process; the task of place 1 (on process 0) ends without joining the
    // all_reduce the others make: place 0 would wait for it forever in the host agreement
    // before the NCCL call; the job ends instead, naming place 1 (the ctest expects "pdo: fatal")
    const auto line = pdo::make_mesh<"x">(pdo::mpi::world_cuda_places(2));
    pdo::spmd(line, [&](std::size_t p) {
      if (p == 1) return;  // joins nothing
      pdo::tensor<float, 1> t({8}, line.place(p));
      pdo::communicator_of(line, p).all_reduce(t.span());
    });
    return 0;  // not reached: the job ends
  }
  try {
    const auto places = pdo::mpi::world_cuda_places(1);
    programs(pdo::make_mesh<"dp">(places, {places.size()}), "every process");
    if (places.size() == 2) {
      // a stage in each process: every tensor between stages goes through host memory
      pipeline_follows<3>(pdo::make_mesh<"pp">(places, {2}), pdo::make_mesh<"pp">(pdo::cpu_places(2), {2}), "2 stages in 2 processes");
      // two GPU places in each process: stages 0 and 1, 2 and 3 hand tensors over by device
      // copies, 1 and 2 through host memory; then "pp" across the processes and "dp" within each
      const auto four = pdo::mpi::world_cuda_places(2);
      pipeline_follows<1, 2, 3>(pdo::make_mesh<"pp">(four, {4}), pdo::make_mesh<"pp">(pdo::cpu_places(4), {4}), "4 stages in 2 processes");
      pipeline_follows<3>(pdo::make_mesh<"pp", "dp">(four, {2, 2}), pdo::make_mesh<"pp", "dp">(pdo::cpu_places(4), {2, 2}),
                          "2 pp (across processes) x 2 dp");
    }
    if (places.size() >= 3) {
      // a mesh over the places of the first two processes: the others hold none of its places
      const std::vector<pdo::any_place> first_two{places[0], places[1]};
      const auto m = pdo::make_mesh<"dp">(first_two, {2});
      if (m.local_places().empty()) {
        pdo::detail::comms_of(m);  // every process builds the mesh's communicators
        check(true, "a process without places of a GPU mesh builds its communicators");
      } else {
        programs(m, "the first two processes");
      }
    }
  } catch (const std::exception& e) {
    check(false, e.what());
  }
  return failures == 0 ? 0 : 1;
}
