// tests/test_mpi.cpp: the MPI backend, run under mpirun: collectives, redistributions and
// parallel_do over places of several processes, against single-place references.
#define CATCH_CONFIG_RUNNER
#include "support.hpp"

#include <pdo/comm/mpi/environment.hpp>

#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <tuple>

using pdo::replicate;
using pdo_test::random_values;
using pdo::split;

namespace {

std::size_t places_per_rank() {
  const char* v = std::getenv("PDO_TEST_PLACES_PER_RANK");
  return v ? static_cast<std::size_t>(std::atoi(v)) : 1;
}

pdo::mesh<"x"> world_line() { return pdo::make_mesh<"x">(pdo::mpi::world_places(places_per_rank())); }

template <class Body>
void on_world(const pdo::mesh<"x">& mesh, Body&& body) {
  pdo::spmd(mesh, [&](std::size_t p) { body(pdo::communicator_of(mesh, p), p); });
}

template <class... Ts, class F>
void for_each_type(std::tuple<Ts...>*, F&& f) {
  (f(static_cast<Ts*>(nullptr)), ...);
}

}  // namespace

TEMPLATE_TEST_CASE("MPI all_reduce matches the single-place reduction and is reproducible", "[mpi]", float, double, int) {
  using T = TestType;
  const auto mesh = world_line();
  const std::size_t n = mesh.size();
  for (auto op : {pdo::reduce_op::sum, pdo::reduce_op::max, pdo::reduce_op::min})
    for (std::size_t count : {std::size_t{1}, std::size_t{1000}, std::size_t{300000}}) {
      std::vector<T> expected = random_values<T>(count, 3);
      for (std::size_t k = 1; k < n; ++k) {
        const auto v = random_values<T>(count, 3 + static_cast<unsigned>(k));
        for (std::size_t i = 0; i < count; ++i) expected[i] = pdo::detail::apply(op, expected[i], v[i]);
      }
      std::vector<T> first;
      for (int run = 0; run < 3; ++run) {
        std::vector<std::vector<T>> got(n);
        on_world(mesh, [&](const pdo::mesh_communicator& comm, std::size_t p) {
          got[p] = random_values<T>(count, 3 + static_cast<unsigned>(p));
          comm.all_reduce(std::span<T>(got[p]), op);
        });
        for (std::size_t p : mesh.local_places()) {
          std::size_t wrong = 0;  // the order of summation across processes is MPI's: compare within rounding
          for (std::size_t i = 0; i < count; ++i) wrong += !(got[p][i] == Approx(expected[i]).epsilon(1e-5).margin(1e-5));
          REQUIRE(wrong == 0);
          if (first.empty()) first = got[p];
          REQUIRE(std::memcmp(got[p].data(), first.data(), count * sizeof(T)) == 0);  // bitwise, run after run
        }
      }
    }
}

TEST_CASE("MPI reduce_scatter is bitwise reproducible run after run", "[mpi]") {
  const auto mesh = world_line();
  const std::size_t n = mesh.size(), total = 200003;
  std::vector<std::vector<float>> first(n);
  for (int run = 0; run < 4; ++run) {
    std::vector<std::vector<float>> got(n);
    on_world(mesh, [&](const pdo::mesh_communicator& comm, std::size_t p) {
      const auto in = random_values<float>(total, 90 + static_cast<unsigned>(p));
      got[p].resize(pdo::detail::chunk_size(total, n, p));
      comm.reduce_scatter(std::span<const float>(in), std::span<float>(got[p]));
    });
    for (std::size_t p : mesh.local_places()) {
      if (run == 0) first[p] = got[p];
      REQUIRE(std::memcmp(got[p].data(), first[p].data(), got[p].size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("MPI all_gather, reduce_scatter, broadcast, all_to_all with uneven pieces", "[mpi]") {
  const auto mesh = world_line();
  const std::size_t n = mesh.size();
  std::vector<int> gathered;
  for (std::size_t k = 0; k < n; ++k) {
    const auto v = random_values<int>(2 + k, 9 + static_cast<unsigned>(k));
    gathered.insert(gathered.end(), v.begin(), v.end());
  }
  const std::size_t total = 5 * n + 3;
  std::vector<int> summed(total, 0);
  for (std::size_t k = 0; k < n; ++k) {
    const auto v = random_values<int>(total, 30 + static_cast<unsigned>(k));
    for (std::size_t i = 0; i < total; ++i) summed[i] += v[i];
  }
  std::vector<std::vector<int>> ag(n, std::vector<int>(gathered.size())), rs(n), bc(n), a2a(n);
  on_world(mesh, [&](const pdo::mesh_communicator& comm, std::size_t p) {
    const auto mine = random_values<int>(2 + p, 9 + static_cast<unsigned>(p));
    comm.all_gather(std::span<const int>(mine), std::span<int>(ag[p]));
    const auto in = random_values<int>(total, 30 + static_cast<unsigned>(p));
    rs[p].resize(pdo::detail::chunk_size(total, n, p));
    comm.reduce_scatter(std::span<const int>(in), std::span<int>(rs[p]));
    bc[p] = random_values<int>(77, 50 + static_cast<unsigned>(p));
    comm.broadcast(std::span<int>(bc[p]), n - 1);
    std::vector<int> send_data;
    std::vector<std::size_t> sc(n), rc(n);
    for (std::size_t j = 0; j < n; ++j) {
      const auto v = pdo_test::piece(0, p, j);
      send_data.insert(send_data.end(), v.begin(), v.end());
      sc[j] = v.size();
      rc[j] = pdo_test::piece(0, j, p).size();
    }
    a2a[p].resize(std::accumulate(rc.begin(), rc.end(), std::size_t{0}));
    comm.all_to_all(std::span<const int>(send_data), std::span<const std::size_t>(sc), std::span<int>(a2a[p]),
                    std::span<const std::size_t>(rc));
  });
  for (std::size_t p : mesh.local_places()) {
    CHECK(ag[p] == gathered);
    const auto off = static_cast<std::ptrdiff_t>(pdo::detail::chunk_offset(total, n, p));
    CHECK(rs[p] == std::vector<int>(summed.begin() + off, summed.begin() + off + static_cast<std::ptrdiff_t>(rs[p].size())));
    CHECK(bc[p] == random_values<int>(77, 50 + static_cast<unsigned>(n - 1)));
    CHECK(a2a[p] == pdo_test::pieces_to(0, p, n));
  }
}

TEST_CASE("MPI send/recv around a ring, across and within processes", "[mpi]") {
  const auto mesh = world_line();
  const std::size_t n = mesh.size();
  std::vector<std::vector<double>> got(n, std::vector<double>(33));
  on_world(mesh, [&](const pdo::mesh_communicator& comm, std::size_t p) {
    const auto mine = random_values<double>(33, 70 + static_cast<unsigned>(p));
    if (p % 2 == 0) {
      comm.send(std::span<const double>(mine), (p + 1) % n, 1);
      comm.recv(std::span<double>(got[p]), (p + n - 1) % n, 1);
    } else {
      comm.recv(std::span<double>(got[p]), (p + n - 1) % n, 1);
      comm.send(std::span<const double>(mine), (p + 1) % n, 1);
    }
  });
  for (std::size_t p : mesh.local_places()) CHECK(got[p] == random_values<double>(33, 70 + static_cast<unsigned>((p + n - 1) % n)));
}

TEST_CASE("MPI collectives with different sizes fail on every process, never hang", "[mpi][errors]") {
  const auto mesh = world_line();
  REQUIRE_THROWS_WITH(on_world(mesh,
                               [&](const pdo::mesh_communicator& comm, std::size_t p) {
                                 std::vector<float> v(10 + p);
                                 comm.all_reduce(std::span<float>(v));
                               }),
                      Catch::Contains("all_reduce") && Catch::Contains("different sizes"));
  std::vector<std::vector<float>> ok(mesh.size(), std::vector<float>(3, 1.0f));
  on_world(mesh, [&](const pdo::mesh_communicator& comm, std::size_t p) { comm.all_reduce(std::span<float>(ok[p])); });
  CHECK(ok[mesh.local_places().front()][0] == static_cast<float>(mesh.size()));
}

TEST_CASE("MPI processes in different collectives fail alike on every process, never crash", "[mpi][errors]") {
  // the first process's places call all_reduce (or a barrier), the others' all_to_all: their
  // meetings exchange the same number of values, so each finds the other's collective
  const auto mesh = world_line();
  const std::size_t n = mesh.size();
  for (const bool barrier : {false, true}) {
    REQUIRE_THROWS_WITH(on_world(mesh,
                                 [&](const pdo::mesh_communicator& comm, std::size_t p) {
                                   if (mesh.place(p).process() == 0) {
                                     std::vector<float> v(3, 1.0f);
                                     if (barrier) comm.barrier();
                                     else comm.all_reduce(std::span<float>(v));
                                   } else {
                                     std::vector<int> in(n, 1), out(n);
                                     const std::vector<std::size_t> counts(n, 1);
                                     comm.all_to_all(std::span<const int>(in), std::span<const std::size_t>(counts), std::span<int>(out),
                                                     std::span<const std::size_t>(counts));
                                   }
                                 }),
                        Catch::Contains("different collectives") && Catch::Contains("all_to_all") &&
                            Catch::Contains(barrier ? "barrier" : "all_reduce"));
  }
  // the same collective over another element type, or with another reduction
  for (const bool type : {false, true}) {
    REQUIRE_THROWS_WITH(on_world(mesh,
                                 [&](const pdo::mesh_communicator& comm, std::size_t p) {
                                   std::vector<float> v(4, 1.0f);
                                   std::vector<double> w(4, 1.0);
                                   if (mesh.place(p).process() == 0) comm.all_reduce(std::span<float>(v));
                                   else if (type) comm.all_reduce(std::span<double>(w));
                                   else comm.all_reduce(std::span<float>(v), pdo::reduce_op::max);
                                 }),
                        Catch::Contains("different collectives") && Catch::Contains("all_reduce(sum) of f32") &&
                            Catch::Contains(type ? "all_reduce(sum) of f64" : "all_reduce(max) of f32"));
  }
  std::vector<std::vector<float>> ok(n, std::vector<float>(3, 1.0f));
  on_world(mesh, [&](const pdo::mesh_communicator& comm, std::size_t p) { comm.all_reduce(std::span<float>(ok[p])); });
  CHECK(ok[mesh.local_places().front()][0] == static_cast<float>(n));
}

TEST_CASE("MPI redistribution pairs on a line and on a 2-D mesh", "[mpi][redistribute]") {
  const auto host = pdo_test::iota_tensor<int, 2>({9, 7});
  const auto line = world_line();
  using line_layouts = std::tuple<pdo::layout<replicate, replicate>, pdo::layout<split<"x">, replicate>,
                                  pdo::layout<replicate, split<"x">>, pdo::layout<replicate, replicate>::partial<"x">>;
  for_each_type(static_cast<line_layouts*>(nullptr), [&]<class From>(From*) {
    for_each_type(static_cast<line_layouts*>(nullptr), [&]<class To>(To*) {
      CAPTURE(pdo::layout_name<From>(), pdo::layout_name<To>());
      REQUIRE(pdo_test::equal(pdo::gather(pdo::redistribute<To>(pdo::distribute<From>(line, host))), host));
    });
  });
  const auto places = pdo::mpi::world_places(places_per_rank());
  if (places.size() % 2 != 0) return;
  const auto grid = pdo::make_mesh<"a", "b">(places, {places.size() / 2, 2});
  using grid_layouts = std::tuple<pdo::layout<split<"a">, split<"b">>, pdo::layout<split<"b">, split<"a">>, pdo::layout<replicate, replicate>,
                                  pdo::layout<split<"b">, replicate>::partial<"a">>;
  for_each_type(static_cast<grid_layouts*>(nullptr), [&]<class From>(From*) {
    for_each_type(static_cast<grid_layouts*>(nullptr), [&]<class To>(To*) {
      CAPTURE(pdo::layout_name<From>(), pdo::layout_name<To>());
      REQUIRE(pdo_test::equal(pdo::gather(pdo::redistribute<To>(pdo::distribute<From>(grid, host))), host));
    });
  });
}

TEST_CASE("MPI parallel_do: merged results, and one place's failure reaches every process", "[mpi][parallel_do]") {
  const auto mesh = world_line();
  const auto host = pdo_test::iota_tensor<double, 2>({11, 3});
  const auto x = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, host);
  const auto y = pdo::parallel_do<pdo::layout<split<"x">, replicate>>(
      [](const pdo::tensor<double, 2>& s) {
        auto o = s;
        for (auto& v : o) v = 2 * v + 1;
        return o;
      },
      x);
  auto expected = host;
  for (auto& v : expected) v = 2 * v + 1;
  CHECK(pdo_test::equal(pdo::gather(y), expected));
  const std::size_t last = mesh.size() - 1;
  const std::string last_name = mesh.place(last).name();
  CHECK_THROWS_WITH((pdo::parallel_do<pdo::layout<split<"x">, replicate>>(
                        [&](const pdo::tensor<double, 2>& s) {
                          if (pdo::detail::current_place() == mesh.place(last).state().get()) throw std::runtime_error("bad input");
                          return s;
                        },
                        x)),
                    Catch::Contains(last_name) && Catch::Contains("bad input"));
  CHECK(pdo_test::equal(pdo::gather(x), host));  // still usable
}

TEST_CASE("MPI parallel_do on an eval_async result not yet waited for reads it after its collectives", "[mpi][parallel_do]") {
  const auto mesh = world_line();
  const std::size_t n = std::size_t{1} << 18;  // long enough that the all_reduce is still running when the block is queued
  const auto host = pdo_test::iota_tensor<float, 2>({mesh.size(), n});
  const auto x = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, host);
  const auto expected = pdo::eval(pdo::max<0>(host));
  for (int round = 0; round < 3; ++round) {
    const auto r = pdo::eval_async(pdo::max<0>(x));  // a kernel, then an all_reduce(max) over "x"
    const auto y = pdo::parallel_do<pdo::layout<replicate>>([](const pdo::tensor<float, 1>& s) { return pdo::tensor<float, 1>(s); }, r.value());
    CHECK(pdo_test::equal(pdo::gather(y), expected));
    r.wait();
  }
}

TEST_CASE("MPI distribute: processes that pass host tensors of different shapes all fail", "[mpi][errors]") {
  const auto mesh = world_line();
  const std::size_t rows = pdo::mpi::rank() == 0 ? 6 : 7;
  std::string message;
  try {
    (void)pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, pdo::tensor<float, 2>({rows, 2}));
  } catch (const pdo::mismatch_error& e) {
    message = e.what();
  }
  INFO(message);
  // the op once, with the layout it was to give, then what differs
  CHECK(message.rfind("distribute to f32[" + std::to_string(rows) + ", 2]{split<x>, replicate} on mesh(x=", 0) == 0);
  CHECK(message.find("distribute", 1) == std::string::npos);
  CHECK(message.find("the processes passed host tensors of different shapes: [" + std::to_string(rows) + ", 2] here") != std::string::npos);
  CHECK(message.find("[7, 2]") != std::string::npos);
}

TEST_CASE("MPI a mesh over processes takes its operations from one host thread per process; threads drive their own at once", "[mpi][errors]") {
  const auto mesh = world_line();
  const auto host = pdo_test::iota_tensor<double, 1>({2 * mesh.size() + 1});
  const auto x = pdo::distribute<pdo::layout<split<"x">>>(mesh, host);  // this thread drives the mesh now
  // another thread's operation is refused at once on every process, before it communicates
  std::string refused;
  std::thread other([&] {
    try {
      (void)pdo::eval(x * 2.0);
    } catch (const pdo::error& e) {
      refused = e.what();
    }
  });
  other.join();
  CHECK_THAT(refused, Catch::Contains("multiply: mesh(x=") && Catch::Contains("spans processes") &&
                          Catch::Contains("another host thread of this process issues its operations"));
  // the mesh goes on from its own thread
  const auto doubled = pdo::gather(pdo::eval(x * 2.0));
  for (std::size_t i = 0; i < host.size(); ++i) REQUIRE(doubled(i) == 2 * host(i));
  // a mesh made (by every process, in the same order) for another thread is that thread's to drive
  const auto theirs = world_line();
  pdo::tensor<double, 1> plus_one;
  std::string failure;
  std::thread driver([&] {
    try {
      plus_one = pdo::gather(pdo::eval(pdo::distribute<pdo::layout<split<"x">>>(theirs, host) + 1.0));
    } catch (const pdo::error& e) {
      failure = e.what();
    }
  });
  driver.join();
  REQUIRE(failure.empty());
  for (std::size_t i = 0; i < host.size(); ++i) REQUIRE(plus_one(i) == host(i) + 1);
  // two meshes made (by every process, in the same order) for two threads, which drive them
  // at the same time: each its own sums (all_reduce) and all_gathers, none crossing the other's
  const std::array<pdo::mesh<"x">, 2> meshes{world_line(), world_line()};
  constexpr int rounds = 20;
  std::array<std::string, 2> failures;
  std::array<std::array<double, rounds>, 2> sums{};
  std::array<bool, 2> gathered{true, true};
  auto drive = [&](std::size_t who) {
    try {
      for (int r = 0; r < rounds; ++r) {
        const auto d = pdo::distribute<pdo::layout<split<"x">>>(meshes[who], host);
        const double k = static_cast<double>(r + 10 * static_cast<int>(who));
        sums[who][static_cast<std::size_t>(r)] = pdo::gather(pdo::eval(pdo::sum(d * k))).data()[0];
        const auto whole = pdo::gather(pdo::redistribute<pdo::layout<replicate>>(pdo::eval(d + k)));
        for (std::size_t i = 0; i < host.size(); ++i) gathered[who] = gathered[who] && whole(i) == host(i) + k;
      }
    } catch (const pdo::error& e) {
      failures[who] = e.what();
    }
  };
  std::thread one(drive, 0), two(drive, 1);
  one.join();
  two.join();
  double total = 0;
  for (std::size_t i = 0; i < host.size(); ++i) total += host(i);
  for (std::size_t who = 0; who < 2; ++who) {
    INFO("thread " << who);
    REQUIRE(failures[who].empty());
    CHECK(gathered[who]);
    for (int r = 0; r < rounds; ++r) CHECK(sums[who][static_cast<std::size_t>(r)] == total * (r + 10 * static_cast<int>(who)));
  }
}

int main(int argc, char** argv) {
  pdo::mpi::initialize();
  const int result = Catch::Session().run(argc, argv);
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

TEST_CASE("MPI all_reduce of max and min gives NaN whichever process holds it", "[mpi]") {
  const auto mesh = world_line();
  const std::size_t n = mesh.size();
  for (std::size_t holder = 0; holder < n; ++holder)
    for (auto op : {pdo::reduce_op::max, pdo::reduce_op::min}) {
      CAPTURE(holder, pdo::detail::op_name(op));
      std::vector<std::vector<double>> got(n);
      on_world(mesh, [&](const pdo::mesh_communicator& comm, std::size_t p) {
        got[p] = {1.0, p == holder ? std::numeric_limits<double>::quiet_NaN() : -1.0};
        comm.all_reduce(std::span<double>(got[p]), op);
      });
      for (std::size_t p : mesh.local_places()) {
        CHECK(got[p][0] == 1.0);
        CHECK(std::isnan(got[p][1]));
      }
    }
}

TEST_CASE("MPI gather and gather_to write each block from the place that holds it", "[mpi]") {
  const auto mesh = world_line();
  const auto host = pdo_test::iota_tensor<int, 2>({11, 7});
  const int processes = pdo::mpi::size();
  auto check = [&]<class L>(L*) {
    CAPTURE(pdo::layout_name<L>());
    const auto x = pdo::distribute<L>(mesh, host);
    CHECK(pdo_test::equal(pdo::gather(x), host));
    for (int root = 0; root < processes; ++root) {
      const auto at_root = pdo::gather_to(x, root);
      CHECK(at_root.has_value() == (pdo::mpi::rank() == root));
      if (at_root) CHECK(pdo_test::equal(*at_root, host));
    }
  };
  check(static_cast<pdo::layout<split<"x">, replicate>*>(nullptr));
  check(static_cast<pdo::layout<replicate, split<"x">>*>(nullptr));
  check(static_cast<pdo::layout<replicate, replicate>*>(nullptr));
  check(static_cast<pdo::layout<replicate, replicate>::partial<"x">*>(nullptr));
}
