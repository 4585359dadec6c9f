// tests/test_collectives.cpp: the threads backend's collectives against single-place references.
#include "support.hpp"

#include <algorithm>
#include <span>
#include <tuple>

using pdo_test::random_values;

namespace {

/// @brief Runs `body(comm, member, place)` on every place of a line mesh of n places.
template <class Body>
void on_line(std::size_t n, Body&& body) {
  const auto mesh = pdo_test::line_mesh(n);
  pdo::detail::run_on_places("test", mesh, [&](std::size_t p, std::size_t) { body(pdo::communicator_of(mesh, p), p); });
}

template <class T>
std::vector<T> reference_reduce(std::size_t n, std::size_t count, pdo::reduce_op op, unsigned seed) {
  std::vector<T> acc = random_values<T>(count, seed);
  for (std::size_t k = 1; k < n; ++k) {
    const auto v = random_values<T>(count, seed + static_cast<unsigned>(k));
    for (std::size_t i = 0; i < count; ++i) acc[i] = pdo::detail::apply(op, acc[i], v[i]);
  }
  return acc;
}

}  // namespace

TEMPLATE_TEST_CASE("all_reduce equals the reduction in member order, bitwise", "[collectives]", float, double, int) {
  using T = TestType;
  for (std::size_t n : pdo_test::line_sizes())
    for (auto op : {pdo::reduce_op::sum, pdo::reduce_op::max, pdo::reduce_op::min})
      for (std::size_t count : {std::size_t{1}, std::size_t{17}, std::size_t{5000}}) {
        CAPTURE(n, pdo::detail::op_name(op), count);
        const auto expected = reference_reduce<T>(n, count, op, 7);
        std::vector<std::vector<T>> got(n);
        on_line(n, [&](const pdo::mesh_communicator& comm, std::size_t p) {
          got[p] = random_values<T>(count, 7 + static_cast<unsigned>(p));
          comm.all_reduce(std::span<T>(got[p]), op);
        });
        for (std::size_t p = 0; p < n; ++p) REQUIRE(got[p] == expected);
      }
}

TEST_CASE("all_reduce is reproducible run after run", "[collectives]") {
  for (std::size_t n : {std::size_t{3}, std::size_t{4}}) {
    std::vector<float> first;
    for (int run = 0; run < 5; ++run) {
      std::vector<std::vector<float>> got(n);
      on_line(n, [&](const pdo::mesh_communicator& comm, std::size_t p) {
        got[p] = random_values<float>(100003, 11 + static_cast<unsigned>(p));
        comm.all_reduce(std::span<float>(got[p]));
      });
      if (run == 0) first = got[0];
      for (std::size_t p = 0; p < n; ++p)
        REQUIRE(std::memcmp(got[p].data(), first.data(), first.size() * sizeof(float)) == 0);
    }
  }
}

TEMPLATE_TEST_CASE("all_gather concatenates uneven inputs in member order", "[collectives]", float, int) {
  using T = TestType;
  for (std::size_t n : pdo_test::line_sizes()) {
    std::vector<T> expected;
    for (std::size_t k = 0; k < n; ++k) {
      const auto v = random_values<T>(3 + k * 5, 20 + static_cast<unsigned>(k));
      expected.insert(expected.end(), v.begin(), v.end());
    }
    std::vector<std::vector<T>> got(n, std::vector<T>(expected.size()));
    on_line(n, [&](const pdo::mesh_communicator& comm, std::size_t p) {
      const auto mine = random_values<T>(3 + p * 5, 20 + static_cast<unsigned>(p));
      comm.all_gather(std::span<const T>(mine), std::span<T>(got[p]));
    });
    for (std::size_t p = 0; p < n; ++p) REQUIRE(got[p] == expected);
  }
}

TEMPLATE_TEST_CASE("reduce_scatter leaves each member its segment of the reduction", "[collectives]", float, double, int) {
  using T = TestType;
  for (std::size_t n : pdo_test::line_sizes())
    for (auto op : {pdo::reduce_op::sum, pdo::reduce_op::max}) {
      const std::size_t total = 10 * n + 3;  // uneven segments
      const auto full = reference_reduce<T>(n, total, op, 40);
      std::vector<std::vector<T>> got(n);
      on_line(n, [&](const pdo::mesh_communicator& comm, std::size_t p) {
        const auto in = random_values<T>(total, 40 + static_cast<unsigned>(p));
        got[p].resize(pdo::detail::chunk_size(total, n, p));
        comm.reduce_scatter(std::span<const T>(in), std::span<T>(got[p]), op);
      });
      for (std::size_t p = 0; p < n; ++p) {
        const auto off = static_cast<std::ptrdiff_t>(pdo::detail::chunk_offset(total, n, p));
        REQUIRE(got[p] == std::vector<T>(full.begin() + off, full.begin() + off + static_cast<std::ptrdiff_t>(got[p].size())));
      }
    }
}

TEST_CASE("broadcast copies the root's data to every member", "[collectives]") {
  for (std::size_t n : pdo_test::line_sizes())
    for (std::size_t root = 0; root < n; ++root) {
      std::vector<std::vector<double>> got(n);
      on_line(n, [&](const pdo::mesh_communicator& comm, std::size_t p) {
        got[p] = random_values<double>(999, 60 + static_cast<unsigned>(p));
        comm.broadcast(std::span<double>(got[p]), root);
      });
      const auto expected = random_values<double>(999, 60 + static_cast<unsigned>(root));
      for (std::size_t p = 0; p < n; ++p) REQUIRE(got[p] == expected);
    }
}

TEST_CASE("all_to_all delivers piece i->j to member j, in order", "[collectives]") {
  for (std::size_t n : pdo_test::line_sizes()) {
    auto piece = [](std::size_t i, std::size_t j) {  // uneven: i + 2j + 1 elements, values naming i and j
      return std::vector<int>(i + 2 * j + 1, static_cast<int>(100 * i + j));
    };
    std::vector<std::vector<int>> got(n);
    on_line(n, [&](const pdo::mesh_communicator& comm, std::size_t p) {
      std::vector<int> in;
      std::vector<std::size_t> send(n), recv(n);
      for (std::size_t j = 0; j < n; ++j) {
        const auto v = piece(p, j);
        in.insert(in.end(), v.begin(), v.end());
        send[j] = v.size();
        recv[j] = piece(j, p).size();
      }
      got[p].resize(std::accumulate(recv.begin(), recv.end(), std::size_t{0}));
      comm.all_to_all(std::span<const int>(in), std::span<const std::size_t>(send), std::span<int>(got[p]),
                      std::span<const std::size_t>(recv));
    });
    for (std::size_t j = 0; j < n; ++j) {
      std::vector<int> expected;
      for (std::size_t i = 0; i < n; ++i) {
        const auto v = piece(i, j);
        expected.insert(expected.end(), v.begin(), v.end());
      }
      REQUIRE(got[j] == expected);
    }
  }
}

TEST_CASE("send and recv pass data around a ring", "[collectives]") {
  for (std::size_t n : {std::size_t{2}, std::size_t{3}, std::size_t{4}}) {
    std::vector<std::vector<float>> got(n, std::vector<float>(64));
    on_line(n, [&](const pdo::mesh_communicator& comm, std::size_t p) {
      const auto mine = random_values<float>(64, 80 + static_cast<unsigned>(p));
      if (p % 2 == 0) {  // even members send first: no cycle of blocked senders
        comm.send(std::span<const float>(mine), (p + 1) % n, 5);
        comm.recv(std::span<float>(got[p]), (p + n - 1) % n, 5);
      } else {
        comm.recv(std::span<float>(got[p]), (p + n - 1) % n, 5);
        comm.send(std::span<const float>(mine), (p + 1) % n, 5);
      }
    });
    for (std::size_t p = 0; p < n; ++p) REQUIRE(got[p] == random_values<float>(64, 80 + static_cast<unsigned>((p + n - 1) % n)));
  }
}

TEST_CASE("collectives along one axis of a 2x2 mesh stay inside their group", "[collectives]") {
  const auto mesh = pdo_test::grid_mesh(2, 2);
  for (std::size_t axis : {std::size_t{0}, std::size_t{1}}) {
    std::vector<std::vector<int>> got(4);
    pdo::detail::run_on_places("test", mesh, [&](std::size_t p, std::size_t) {
      got[p] = {static_cast<int>(p), 1};
      pdo::communicator_along(mesh, axis, p).all_reduce(std::span<int>(got[p]));
    });
    for (std::size_t p = 0; p < 4; ++p) {
      int expected = 0;
      for (auto q : mesh.group(axis, p)) expected += static_cast<int>(q);
      CHECK(got[p] == std::vector<int>{expected, 2});
    }
  }
}

TEST_CASE("mismatched sizes are an error on every member, never a hang", "[collectives][errors]") {
  const auto mesh = pdo_test::line_mesh(3);
  std::vector<std::string> messages(3);
  REQUIRE_THROWS_AS(pdo::detail::run_on_places("test", mesh,
                                               [&](std::size_t p, std::size_t) {
                                                 std::vector<float> v(10 + p);
                                                 try {
                                                   pdo::communicator_of(mesh, p).all_reduce(std::span<float>(v));
                                                 } catch (const pdo::communication_error& e) {
                                                   messages[p] = e.what();
                                                   throw;
                                                 }
                                               }),
                    pdo::communication_error);
  for (const auto& m : messages) {
    CHECK_THAT(m, Catch::Contains("all_reduce") && Catch::Contains("different sizes") && Catch::Contains("cpu:2: 12"));
  }
  // the mesh still works afterwards
  std::vector<std::vector<float>> got(3, std::vector<float>(4, 1.0f));
  pdo::detail::run_on_places("test", mesh, [&](std::size_t p, std::size_t) {
    pdo::communicator_of(mesh, p).all_reduce(std::span<float>(got[p]));
  });
  CHECK(got[2] == std::vector<float>(4, 3.0f));
}

TEST_CASE("a place failing before a collective does not leave the others waiting", "[collectives][errors]") {
  const auto mesh = pdo_test::line_mesh(4);
  try {
    pdo::detail::run_on_places("test", mesh, [&](std::size_t p, std::size_t) {
      if (p == 2) throw std::runtime_error("boom");
      std::vector<float> v(8);
      pdo::communicator_of(mesh, p).all_reduce(std::span<float>(v));
    });
    FAIL("no error reached the caller");
  } catch (const pdo::error& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("cpu:2") && Catch::Contains("boom"));
  }
  std::vector<std::vector<int>> got(4, std::vector<int>(3, 2));
  pdo::detail::run_on_places("test", mesh, [&](std::size_t p, std::size_t) {
    pdo::communicator_of(mesh, p).all_reduce(std::span<int>(got[p]));
  });
  CHECK(got[0] == std::vector<int>(3, 8));
}

TEST_CASE("send/recv with different sizes fails on both sides", "[collectives][errors]") {
  const auto mesh = pdo_test::line_mesh(2);
  REQUIRE_THROWS_WITH(pdo::detail::run_on_places("test", mesh,
                                                 [&](std::size_t p, std::size_t) {
                                                   const auto comm = pdo::communicator_of(mesh, p);
                                                   std::vector<float> v(p == 0 ? 5 : 6);
                                                   if (p == 0) comm.send(std::span<const float>(v), 1, 3);
                                                   else comm.recv(std::span<float>(v), 0, 3);
                                                 }),
                      Catch::Contains("sent 5 elements") && Catch::Contains("expects 6"));
}
