// tests/mpi_faults.cpp: what the processes of a job see when one of them does not take part.
// Run under mpirun with one of these modes as argument; each process checks what it saw and
// exits 0 when it is what it should be:
//   mesh_mismatch  process 0 makes a mesh of another shape than the others: every process
//                  gets a pdo::mismatch_error naming both shapes, at once, not a hang
//   sleeper        the last process sleeps instead of joining an all_reduce (timeout 1 s, from
//                  the mesh, or from PDO_COLLECTIVE_TIMEOUT when the second argument is "env"):
//                  the others get a pdo::collective_timeout within the timeout, naming the
//                  collective, the mesh axis and the rank that did not arrive; the sleeper, on
//                  waking, is told the others gave up; every process can go on. Then the
//                  same for making a mesh (which builds its communicators): the others'
//                  make_mesh gives up, and a new mesh works on every process
//   trainer_leaves the last process leaves a data-parallel training (sleeps instead of its next
//                  step; timeout 1 s): every other process's step throws a pdo::error within the
//                  timeout, naming the collective and the rank that did not arrive
//   late_for_two   the last process sleeps past the timeout (1 s) of two collectives on two
//                  groups of a mesh, which the others give up on one after the other: on
//                  waking, each of its two collectives throws at once, saying they gave up (the
//                  notice of the second, taken in while it is in the first, is kept for it)
//   trainer_late   the last process comes to a data-parallel step after the others gave up
//                  on it (it sleeps past the timeout of 1 s first): the others' step throws as
//                  in trainer_leaves; the late one's step throws at once, saying they gave up,
//                  and never waits forever in the step's later collectives
//   killed         the last process is killed while the others wait in an all_reduce: the
//                  launcher ends the job, and the others say first who had not arrived
//   ended          the last process ends its program (returns from main) while the others
//                  wait for it in an all_reduce, with the default timeout of 30 minutes: they
//                  get a pdo::collective_timeout within seconds, naming the process that ended,
//                  and every process then ends normally
#include <pdo/pdo.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (ok) return;
  std::fprintf(stderr, "rank %d: FAILED: %s\n", pdo::mpi::rank(), what.c_str());
  ++failures;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

void mesh_mismatch() {
  const auto places = pdo::mpi::world_places();
  const int me = pdo::mpi::rank(), n = pdo::mpi::size();
  try {
    if (me == 0) {
      (void)pdo::make_mesh<"x">(places);
    } else {
      (void)pdo::make_mesh<"x", "y">(places, {1, static_cast<std::size_t>(n)});
    }
    expect(false, "make_mesh of different shapes did not throw");
  } catch (const pdo::mismatch_error& e) {
    const std::string m = e.what();
    expect(contains(m, "rank 0 made mesh(x=" + std::to_string(n) + ")"), "the message names rank 0's mesh: " + m);
    expect(contains(m, "made mesh(x=1, y=" + std::to_string(n) + ")"), "the message names the others' mesh: " + m);
  }
  // the processes can go on: a mesh they agree on works
  const auto mesh = pdo::make_mesh<"x">(places);
  std::vector<double> v{1.0};
  pdo::spmd(mesh, [&](std::size_t p) { pdo::communicator_of(mesh, p).all_reduce(std::span<double>(v)); });
  expect(v[0] == n, "an all_reduce after the mismatch");
}

void sleeper(bool from_env) {
  const auto places = pdo::mpi::world_places();
  const int me = pdo::mpi::rank(), n = pdo::mpi::size();
  pdo::mesh_options options;
  if (!from_env) options.collective_timeout = std::chrono::seconds(1);
  const auto mesh = pdo::make_mesh<"x">(places, options);
  std::vector<double> v{1.0};
  pdo::spmd(mesh, [&](std::size_t p) { pdo::communicator_of(mesh, p).all_reduce(std::span<double>(v)); });  // all present
  const auto start = std::chrono::steady_clock::now();
  if (me == n - 1) std::this_thread::sleep_for(std::chrono::seconds(4));
  try {
    pdo::spmd(mesh, [&](std::size_t p) { pdo::communicator_along(mesh, 0, p).all_reduce(std::span<double>(v)); });
    expect(false, "an all_reduce that a process never joined in time did not throw");
  } catch (const pdo::collective_timeout& e) {
    const std::string m = e.what();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (me != n - 1) {
      expect(waited < 3.5, "reported within the timeout and its grace, after " + std::to_string(waited) + " s");
      expect(contains(m, "all_reduce over axis \"x\" of mesh(x=" + std::to_string(n) + ")"), "names the collective and axis: " + m);
      expect(contains(m, "not arrived: rank " + std::to_string(n - 1) + " (did not answer"), "names the rank that did not arrive: " + m);
      expect(contains(m, "(timeout 1 s, then a last round"), "names the timeout it was given: " + m);
    } else {
      expect(contains(m, "gave up"), "the late process is told the others gave up: " + m);
    }
  }
  // the group is unusable after a timeout, at once and alike on every process
  try {
    pdo::spmd(mesh, [&](std::size_t p) { pdo::communicator_along(mesh, 0, p).all_reduce(std::span<double>(v)); });
    expect(false, "a group that timed out was used again");
  } catch (const pdo::collective_timeout& e) {
    expect(contains(e.what(), "timed out earlier"), std::string("says why it cannot be used: ") + e.what());
  }
  // a process late to make a mesh (whose communicators are built as it is made): the others'
  // make_mesh gives up within the mesh's timeout, naming the agreement it waited in; the late
  // process is told they gave up; every process can go on with a new mesh
  const auto all_reduce_on = [&](const auto& m) {
    pdo::spmd(m, [&](std::size_t p) { pdo::communicator_of(m, p).all_reduce(std::span<double>(v)); });
  };
  // (the late process is still asleep: meet it first, on a mesh that waits long enough)
  pdo::mesh_options patient;
  patient.collective_timeout = std::chrono::seconds(60);
  all_reduce_on(pdo::make_mesh<"x">(places, patient));
  const auto late = std::chrono::steady_clock::now();
  if (me == n - 1) std::this_thread::sleep_for(std::chrono::seconds(4));
  try {
    (void)pdo::make_mesh<"x">(places, options);
    expect(false, "make_mesh returned though a process did not come to make the mesh in time");
  } catch (const pdo::collective_timeout& e) {
    const std::string m = e.what();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - late).count();
    expect(contains(m, "make_mesh's agreement on mesh(x=" + std::to_string(n) + ")"), "names what timed out: " + m);
    if (me != n - 1) {
      expect(waited < 3.5, "make_mesh reported within the timeout and its grace, after " + std::to_string(waited) + " s");
      expect(contains(m, "not arrived: rank " + std::to_string(n - 1)), "names the rank that did not arrive: " + m);
    } else {
      expect(contains(m, "gave up"), "the late process is told the others gave up: " + m);
    }
  }
  v = {1.0};
  all_reduce_on(pdo::make_mesh<"x">(places, patient));
  expect(v[0] == static_cast<double>(n), "a new mesh's all_reduce works after the failed one: " + std::to_string(v[0]));
}

/// @brief The last process leaves a data-parallel training (it sleeps past the timeout instead
/// of its next step) or, when it `comes_back` after that sleep, comes to the step late.
void trainer_away(bool comes_back) {
  const int me = pdo::mpi::rank(), n = pdo::mpi::size();
  pdo::mesh_options options;
  options.collective_timeout = std::chrono::seconds(1);
  const auto mesh = pdo::make_mesh<"dp">(pdo::mpi::world_places(), options);
  auto make_model = [] {
    pdo::nn::rng gen(3);
    return pdo::nn::sequential(pdo::nn::linear<double>(4, 8, gen), pdo::nn::relu{}, pdo::nn::linear<double>(8, 2, gen));
  };
  auto trainer = pdo::nn::make_data_parallel<double>(
      mesh, make_model, [](auto ps) { return pdo::nn::sgd<double>(std::move(ps), {.lr = 0.1}); });
  pdo::tensor<double, 2> x({8, 4});
  pdo::tensor<int, 1> y({8});
  for (std::size_t i = 0; i < 8; ++i) {
    y(i) = static_cast<int>(i % 2);
    for (std::size_t j = 0; j < 4; ++j) x(i, j) = static_cast<double>(i + j) / 10;
  }
  trainer.step(x, y);  // every process present
  if (me == n - 1) {
    std::this_thread::sleep_for(std::chrono::seconds(4));
    if (!comes_back) return;  // leaves the training
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    trainer.step(x, y);
    expect(false, comes_back ? "a step that a process came to late did not throw" : "a step that a process left did not throw");
  } catch (const pdo::error& e) {
    const std::string m = e.what();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    expect(waited < 3.5, "reported within the timeout and its grace, after " + std::to_string(waited) + " s: " + m);
    expect(contains(m, "data_parallel"), "names the trainer: " + m);
    if (me != n - 1) expect(contains(m, "not arrived: rank " + std::to_string(n - 1)), "names the rank that is away: " + m);
    else expect(contains(m, "gave up"), "the late process is told the others gave up: " + m);
  }
}

void late_for_two() {
  const int me = pdo::mpi::rank(), n = pdo::mpi::size();
  pdo::mesh_options options;
  options.collective_timeout = std::chrono::seconds(1);
  const auto mesh = pdo::make_mesh<"x">(pdo::mpi::world_places(), options);
  std::vector<double> v{1.0};
  const auto along = [&](std::size_t p) { pdo::communicator_along(mesh, 0, p).all_reduce(std::span<double>(v)); };
  const auto whole = [&](std::size_t p) { pdo::communicator_of(mesh, p).all_reduce(std::span<double>(v)); };
  pdo::spmd(mesh, along);  // every process present, on both groups
  pdo::spmd(mesh, whole);
  if (me == n - 1) std::this_thread::sleep_for(std::chrono::seconds(4));
  for (const char* group : {"over axis \"x\"", "over the whole mesh"}) {
    const auto start = std::chrono::steady_clock::now();
    try {
      if (std::strcmp(group, "over the whole mesh") == 0) pdo::spmd(mesh, whole);
      else pdo::spmd(mesh, along);
      expect(false, std::string("an all_reduce ") + group + " that a process came to late did not throw");
    } catch (const pdo::collective_timeout& e) {
      const std::string m = e.what();
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      expect(waited < 3.5, "reported within the timeout and its grace, after " + std::to_string(waited) + " s: " + m);
      expect(contains(m, std::string("all_reduce ") + group), "names the collective: " + m);
      if (me != n - 1) expect(contains(m, "not arrived: rank " + std::to_string(n - 1)), "names the late rank: " + m);
      else expect(contains(m, "gave up"), "the late process is told the others gave up: " + m);
    }
  }
}

void killed() {
  const auto places = pdo::mpi::world_places();
  const int me = pdo::mpi::rank(), n = pdo::mpi::size();
  const auto mesh = pdo::make_mesh<"x">(places);
  std::vector<double> v{1.0};
  pdo::spmd(mesh, [&](std::size_t p) { pdo::communicator_of(mesh, p).all_reduce(std::span<double>(v)); });  // all present
  if (me == n - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    std::raise(SIGKILL);
  }
  pdo::spmd(mesh, [&](std::size_t p) { pdo::communicator_of(mesh, p).all_reduce(std::span<double>(v)); });
}

void ended() {
  const auto places = pdo::mpi::world_places();
  const int me = pdo::mpi::rank(), n = pdo::mpi::size();
  const auto mesh = pdo::make_mesh<"x">(places);
  std::vector<double> v{1.0};
  pdo::spmd(mesh, [&](std::size_t p) { pdo::communicator_of(mesh, p).all_reduce(std::span<double>(v)); });  // all present
  if (me == n - 1) return;  // its program ends here
  const auto start = std::chrono::steady_clock::now();
  try {
    pdo::spmd(mesh, [&](std::size_t p) { pdo::communicator_of(mesh, p).all_reduce(std::span<double>(v)); });
    expect(false, "the all_reduce completed without the process that ended");
  } catch (const pdo::collective_timeout& e) {
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (me == 0) std::printf("rank 0 was told, %.1f s into the wait: %s\n", waited, e.what());
    expect(waited < 20, "the error came after " + std::to_string(waited) + " s");
    expect(contains(e.what(), "all_reduce over the whole mesh(x=" + std::to_string(n) + ")") &&
               contains(e.what(), "rank " + std::to_string(n - 1) + " has ended its program"),
           std::string("the error names the collective and the process that ended: ") + e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "mesh_mismatch") mesh_mismatch();
  else if (mode == "sleeper") sleeper(argc > 2 && std::strcmp(argv[2], "env") == 0);
  else if (mode == "trainer_late") trainer_away(true);
  else if (mode == "late_for_two") late_for_two();
  else if (mode == "trainer_leaves") trainer_away(false);
  else if (mode == "killed") killed();
  else if (mode == "ended") ended();
  else {
    std::fprintf(stderr, "usage: mpi_faults mesh_mismatch|sleeper [env]|trainer_leaves|late_for_two|trainer_late|killed|ended\n");
    return 2;
  }
  if (failures == 0) std::printf("rank %d: ok\n", pdo::mpi::rank());
  return failures == 0 ? 0 : 1;
}
