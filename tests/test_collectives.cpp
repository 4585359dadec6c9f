// tests/test_collectives.cpp: the threads backend's collectives against single-place references.
#include "support.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <span>
#include <tuple>

using pdo_test::random_values;

namespace {

/// @brief Where a collective runs: the groups of one kind in one mesh (a line of n places,
/// or the lines along one axis of a 2x2 mesh), and which group and member each place is.
struct setup {
  std::string name;
  std::size_t members = 0;
  std::vector<std::size_t> group_of, member_of;  // per place
  std::function<void(const std::function<void(const pdo::mesh_communicator&, std::size_t place)>&)> run;
};

std::vector<setup> setups() {
  std::vector<setup> all;
  for (std::size_t n : pdo_test::line_sizes()) {
    const auto mesh = pdo_test::line_mesh(n);
    setup s{"line of " + std::to_string(n), n, std::vector<std::size_t>(n, 0), {}, {}};
    for (std::size_t p = 0; p < n; ++p) s.member_of.push_back(p);
    s.run = [mesh](const auto& body) {
      pdo::spmd(mesh, [&](std::size_t p) { body(pdo::communicator_of(mesh, p), p); });
    };
    all.push_back(std::move(s));
  }
  const auto grid = pdo_test::grid_mesh(2, 2);
  for (std::size_t axis : {std::size_t{0}, std::size_t{1}}) {
    setup s{"2x2 along axis " + std::to_string(axis), 2, {}, {}, {}};
    for (std::size_t p = 0; p < 4; ++p) {
      s.group_of.push_back(grid.coord(p, 1 - axis));
      s.member_of.push_back(grid.coord(p, axis));
    }
    s.run = [grid, axis](const auto& body) {
      pdo::spmd(grid, [&](std::size_t p) { body(pdo::communicator_along(grid, axis, p), p); });
    };
    all.push_back(std::move(s));
  }
  return all;
}

/// @brief The seed of member m's data in group g: distinct for every place.
unsigned seed(unsigned base, std::size_t group, std::size_t member) {
  return base + static_cast<unsigned>(16 * group + member);
}

template <class T>
std::vector<T> reference_reduce(std::size_t n, std::size_t count, pdo::reduce_op op, unsigned base, std::size_t group) {
  std::vector<T> acc = random_values<T>(count, seed(base, group, 0));
  for (std::size_t k = 1; k < n; ++k) {
    const auto v = random_values<T>(count, seed(base, group, k));
    for (std::size_t i = 0; i < count; ++i) acc[i] = pdo::detail::apply(op, acc[i], v[i]);
  }
  return acc;
}

}  // namespace

TEMPLATE_TEST_CASE("all_reduce equals the reduction in member order, bitwise", "[collectives]", float, double, int) {
  using T = TestType;
  for (const auto& s : setups())
    for (auto op : {pdo::reduce_op::sum, pdo::reduce_op::max, pdo::reduce_op::min})
      for (std::size_t count : {std::size_t{1}, std::size_t{17}, std::size_t{5000}}) {
        CAPTURE(s.name, pdo::detail::op_name(op), count);
        std::vector<std::vector<T>> got(s.member_of.size());
        s.run([&](const pdo::mesh_communicator& comm, std::size_t p) {
          got[p] = random_values<T>(count, seed(1, s.group_of[p], s.member_of[p]));
          comm.all_reduce(std::span<T>(got[p]), op);
        });
        for (std::size_t p = 0; p < got.size(); ++p) REQUIRE(got[p] == reference_reduce<T>(s.members, count, op, 1, s.group_of[p]));
      }
}

TEST_CASE("all_reduce_apply hands every member's consumer each element of the all_reduce's sum once, bitwise", "[collectives]") {
  // a line of 1-4 places (one of them owning both cores of a 2-core machine: its part is cut
  // among them), a 2x2 mesh's axis groups; sizes below and above a team's grain
  for (const auto& s : setups())
    for (std::size_t count : {std::size_t{1}, std::size_t{5000}, std::size_t{100003}}) {
      CAPTURE(s.name, count);
      struct consumed {
        std::vector<float> sum;
        std::vector<std::atomic<int>> times;
        explicit consumed(std::size_t n) : sum(n), times(n) {}
      };
      std::vector<std::vector<float>> in(s.member_of.size()), reduced(s.member_of.size());
      std::vector<std::unique_ptr<consumed>> out;
      for (std::size_t p = 0; p < s.member_of.size(); ++p) out.push_back(std::make_unique<consumed>(count));
      s.run([&](const pdo::mesh_communicator& comm, std::size_t p) {
        in[p] = random_values<float>(count, seed(4, s.group_of[p], s.member_of[p]));
        reduced[p] = in[p];
        pdo::reduced_consumer<float> take{[](const void* c, std::size_t lo, std::size_t hi, const float* sum) {
                                            auto& o = *static_cast<consumed*>(const_cast<void*>(c));
                                            for (std::size_t i = lo; i < hi; ++i) {
                                              o.sum[i] = sum[i - lo];
                                              o.times[i].fetch_add(1, std::memory_order_relaxed);
                                            }
                                          },
                                          out[p].get()};
        comm.all_reduce_apply(std::span<float>(in[p]), take);
        comm.all_reduce(std::span<float>(reduced[p]));
      });
      for (std::size_t p = 0; p < out.size(); ++p) {
        REQUIRE(std::memcmp(out[p]->sum.data(), reduced[p].data(), count * sizeof(float)) == 0);
        REQUIRE(std::all_of(out[p]->times.begin(), out[p]->times.end(), [](const std::atomic<int>& t) { return t.load() == 1; }));
      }
    }
}

TEST_CASE("all_reduce and reduce_scatter are reproducible run after run", "[collectives]") {
  for (std::size_t n : {std::size_t{3}, std::size_t{4}}) {
    const auto mesh = pdo_test::line_mesh(n);
    std::vector<float> first, first_segment;
    for (int run = 0; run < 5; ++run) {
      std::vector<std::vector<float>> got(n), segment(n);
      pdo::spmd(mesh, [&](std::size_t p) {
        const auto comm = pdo::communicator_of(mesh, p);
        got[p] = random_values<float>(100003, 11 + static_cast<unsigned>(p));
        segment[p].resize(pdo::detail::chunk_size(got[p].size(), n, p));
        comm.reduce_scatter(std::span<const float>(got[p]), std::span<float>(segment[p]));
        comm.all_reduce(std::span<float>(got[p]));
      });
      if (run == 0) first = got[0], first_segment = segment[0];
      for (std::size_t p = 0; p < n; ++p) REQUIRE(std::memcmp(got[p].data(), first.data(), first.size() * sizeof(float)) == 0);
      REQUIRE(std::memcmp(segment[0].data(), first_segment.data(), first_segment.size() * sizeof(float)) == 0);
    }
  }
}

TEMPLATE_TEST_CASE("all_gather concatenates uneven inputs in member order", "[collectives]", float, int) {
  using T = TestType;
  for (const auto& s : setups()) {
    CAPTURE(s.name);
    auto input = [&](std::size_t group, std::size_t member) { return random_values<T>(3 + member * 5, seed(20, group, member)); };
    auto expected = [&](std::size_t group) {
      std::vector<T> all;
      for (std::size_t k = 0; k < s.members; ++k) {
        const auto v = input(group, k);
        all.insert(all.end(), v.begin(), v.end());
      }
      return all;
    };
    std::vector<std::vector<T>> got(s.member_of.size());
    s.run([&](const pdo::mesh_communicator& comm, std::size_t p) {
      const auto mine = input(s.group_of[p], s.member_of[p]);
      got[p].resize(expected(s.group_of[p]).size());
      comm.all_gather(std::span<const T>(mine), std::span<T>(got[p]));
    });
    for (std::size_t p = 0; p < got.size(); ++p) REQUIRE(got[p] == expected(s.group_of[p]));
  }
}

TEMPLATE_TEST_CASE("reduce_scatter leaves each member its segment of the reduction", "[collectives]", float, double, int) {
  using T = TestType;
  for (const auto& s : setups())
    for (auto op : {pdo::reduce_op::sum, pdo::reduce_op::max}) {
      CAPTURE(s.name, pdo::detail::op_name(op));
      const std::size_t total = 10 * s.members + 3;  // uneven segments
      std::vector<std::vector<T>> got(s.member_of.size());
      s.run([&](const pdo::mesh_communicator& comm, std::size_t p) {
        const auto in = random_values<T>(total, seed(40, s.group_of[p], s.member_of[p]));
        got[p].resize(pdo::detail::chunk_size(total, s.members, s.member_of[p]));
        comm.reduce_scatter(std::span<const T>(in), std::span<T>(got[p]), op);
      });
      for (std::size_t p = 0; p < got.size(); ++p) {
        const auto full = reference_reduce<T>(s.members, total, op, 40, s.group_of[p]);
        const auto off = static_cast<std::ptrdiff_t>(pdo::detail::chunk_offset(total, s.members, s.member_of[p]));
        REQUIRE(got[p] == std::vector<T>(full.begin() + off, full.begin() + off + static_cast<std::ptrdiff_t>(got[p].size())));
      }
    }
}

TEST_CASE("broadcast copies the root's data to every member", "[collectives]") {
  for (const auto& s : setups())
    for (std::size_t root = 0; root < s.members; ++root) {
      CAPTURE(s.name, root);
      std::vector<std::vector<double>> got(s.member_of.size());
      s.run([&](const pdo::mesh_communicator& comm, std::size_t p) {
        got[p] = random_values<double>(999, seed(60, s.group_of[p], s.member_of[p]));
        comm.broadcast(std::span<double>(got[p]), root);
      });
      for (std::size_t p = 0; p < got.size(); ++p) REQUIRE(got[p] == random_values<double>(999, seed(60, s.group_of[p], root)));
    }
}

TEST_CASE("all_to_all delivers piece i->j to member j, in order", "[collectives]") {
  for (const auto& s : setups()) {
    CAPTURE(s.name);
    const std::size_t n = s.members;
    std::vector<std::vector<int>> got(s.member_of.size());
    s.run([&](const pdo::mesh_communicator& comm, std::size_t p) {
      const std::size_t g = s.group_of[p], me = s.member_of[p];
      std::vector<int> in;
      std::vector<std::size_t> send(n), recv(n);
      for (std::size_t j = 0; j < n; ++j) {
        const auto v = pdo_test::piece(g, me, j);
        in.insert(in.end(), v.begin(), v.end());
        send[j] = v.size();
        recv[j] = pdo_test::piece(g, j, me).size();
      }
      got[p].resize(std::accumulate(recv.begin(), recv.end(), std::size_t{0}));
      comm.all_to_all(std::span<const int>(in), std::span<const std::size_t>(send), std::span<int>(got[p]),
                      std::span<const std::size_t>(recv));
    });
    for (std::size_t p = 0; p < got.size(); ++p) REQUIRE(got[p] == pdo_test::pieces_to(s.group_of[p], s.member_of[p], n));
  }
}

TEST_CASE("send and recv pass data around a ring", "[collectives]") {
  for (const auto& s : setups()) {
    if (s.members < 2) continue;
    CAPTURE(s.name);
    const std::size_t n = s.members;
    std::vector<std::vector<float>> got(s.member_of.size(), std::vector<float>(64));
    s.run([&](const pdo::mesh_communicator& comm, std::size_t p) {
      const std::size_t me = s.member_of[p];
      const auto mine = random_values<float>(64, seed(80, s.group_of[p], me));
      if (me % 2 == 0) {  // even members send first: no cycle of blocked senders
        comm.send(std::span<const float>(mine), (me + 1) % n, 5);
        comm.recv(std::span<float>(got[p]), (me + n - 1) % n, 5);
      } else {
        comm.recv(std::span<float>(got[p]), (me + n - 1) % n, 5);
        comm.send(std::span<const float>(mine), (me + 1) % n, 5);
      }
    });
    for (std::size_t p = 0; p < got.size(); ++p)
      REQUIRE(got[p] == random_values<float>(64, seed(80, s.group_of[p], (s.member_of[p] + n - 1) % n)));
  }
}

TEST_CASE("collectives along one axis of a 2x2 mesh stay inside their group", "[collectives]") {
  const auto mesh = pdo_test::grid_mesh(2, 2);
  for (std::size_t axis : {std::size_t{0}, std::size_t{1}}) {
    std::vector<std::vector<int>> got(4);
    pdo::spmd(mesh, [&](std::size_t p) {
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
  REQUIRE_THROWS_AS(pdo::spmd(mesh,
                                               [&](std::size_t p) {
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
  pdo::spmd(mesh, [&](std::size_t p) {
    pdo::communicator_of(mesh, p).all_reduce(std::span<float>(got[p]));
  });
  CHECK(got[2] == std::vector<float>(4, 3.0f));
}

TEST_CASE("a place failing before a collective does not leave the others waiting", "[collectives][errors]") {
  const auto mesh = pdo_test::line_mesh(4);
  try {
    pdo::spmd(mesh, [&](std::size_t p) {
      if (p == 2) throw std::runtime_error("boom");
      std::vector<float> v(8);
      pdo::communicator_of(mesh, p).all_reduce(std::span<float>(v));
    });
    FAIL("no error reached the caller");
  } catch (const pdo::error& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("cpu:2") && Catch::Contains("boom"));
  }
  std::vector<std::vector<int>> got(4, std::vector<int>(3, 2));
  pdo::spmd(mesh, [&](std::size_t p) {
    pdo::communicator_of(mesh, p).all_reduce(std::span<int>(got[p]));
  });
  CHECK(got[0] == std::vector<int>(3, 8));
}

TEST_CASE("a place whose task ends without joining a collective does not leave the others waiting", "[collectives][errors]") {
  const auto mesh = pdo_test::line_mesh(3);
  for (int round = 0; round < 20; ++round) {  // place 2 ends before the others arrive, or while they wait
    try {
      pdo::spmd(mesh, [&](std::size_t p) {
        std::vector<float> v(4, 1.0f);
        if (p != 2) pdo::communicator_of(mesh, p).all_reduce(std::span<float>(v));
      });
      FAIL("no error reached the caller");
    } catch (const pdo::mismatch_error& e) {  // the members did not make the same collectives
      CHECK_THAT(std::string(e.what()), Catch::Contains("place cpu:2 ended without joining it"));
    }
    // the mesh works afterwards
    std::vector<std::vector<int>> got(3, std::vector<int>(2, 1));
    pdo::spmd(mesh, [&](std::size_t p) {
      pdo::communicator_of(mesh, p).all_reduce(std::span<int>(got[p]));
      pdo::communicator_along(mesh, 0, p).all_reduce(std::span<int>(got[p]));
    });
    CHECK(got[0] == std::vector<int>(2, 9));
    CHECK(got[2] == std::vector<int>(2, 9));
  }
}

TEST_CASE("a skipped collective on a 2x2 mesh is reported as the skip, not as the others it aborted", "[collectives][errors]") {
  const auto mesh = pdo_test::grid_mesh(2, 2);
  for (int round = 0; round < 20; ++round) {
    try {
      pdo::spmd(mesh, [&](std::size_t p) {
        std::vector<int> v(2, 1);
        // every place reduces along axis 1; then along axis 0, which the last place skips
        pdo::communicator_along(mesh, 1, p).all_reduce(std::span<int>(v));
        if (p != 3) pdo::communicator_along(mesh, 0, p).all_reduce(std::span<int>(v));
      });
      FAIL("no error reached the caller");
    } catch (const pdo::mismatch_error& e) {
      CHECK_THAT(std::string(e.what()), Catch::Contains("place cpu:3 ended without joining it"));
    }
  }
}

TEST_CASE("on a 2x2 mesh, places outside a group may end while the group's members run its collectives", "[collectives]") {
  const auto mesh = pdo_test::grid_mesh(2, 2);
  for (int round = 0; round < 20; ++round) {
    std::vector<std::vector<int>> got(4, std::vector<int>(2, 0));
    pdo::spmd(mesh, [&](std::size_t p) {
      if (mesh.coord(p, 0) != 0) return;  // only the first row reduces, along axis 1
      got[p] = {static_cast<int>(p) + 1, 1};
      for (int i = 0; i < 3; ++i) pdo::communicator_along(mesh, 1, p).all_reduce(std::span<int>(got[p]));
    });
    for (std::size_t p = 0; p < 4; ++p) {
      if (mesh.coord(p, 0) != 0) continue;
      int first = 0;
      for (auto q : mesh.group(1, p)) first += static_cast<int>(q) + 1;
      CHECK(got[p] == std::vector<int>{first * 4, 8});
    }
  }
}

TEST_CASE("a send or recv whose peer's task ends without the matching call is an error, not a hang", "[collectives][errors]") {
  const auto mesh = pdo_test::line_mesh(3);
  for (int round = 0; round < 20; ++round) {  // the peer ends before the call, or while it waits
    const bool sending = round % 2 == 0;
    std::vector<float> from_2(3, 0.0f);
    try {
      pdo::spmd(mesh, [&](std::size_t p) {
        const auto comm = pdo::communicator_of(mesh, p);
        std::vector<float> v(4, 1.0f);
        if (p == 2) comm.send(std::span<const float>(std::vector<float>(3, 2.0f)), 0, 1);  // between the others: goes on
        if (p == 0) {
          comm.recv(std::span<float>(from_2), 2, 1);
          if (sending) comm.send(std::span<const float>(v), 1, 7);
          else comm.recv(std::span<float>(v), 1, 7);
        }
      });
      FAIL("no error reached the caller");
    } catch (const pdo::mismatch_error& e) {
      CHECK_THAT(std::string(e.what()), Catch::Contains(sending ? "send aborted: the task of place cpu:1 ended without a recv from cpu:0 with tag 7"
                                                                : "recv aborted: the task of place cpu:1 ended without a send to cpu:0 with tag 7"));
    }
    CHECK(from_2 == std::vector<float>(3, 2.0f));
    // the mesh works afterwards, messages too
    std::vector<std::vector<int>> got(3, std::vector<int>(2, 1));
    pdo::spmd(mesh, [&](std::size_t p) {
      const auto comm = pdo::communicator_of(mesh, p);
      if (p == 1) comm.send(std::span<const int>(got[1]), 0, 7);
      if (p == 0) comm.recv(std::span<int>(got[0]), 1, 7);
      comm.all_reduce(std::span<int>(got[p]));
    });
    CHECK(got[0] == std::vector<int>(2, 3));
  }
}

TEST_CASE("send/recv with different sizes fails on both sides", "[collectives][errors]") {
  const auto mesh = pdo_test::line_mesh(2);
  REQUIRE_THROWS_WITH(pdo::spmd(mesh,
                                                 [&](std::size_t p) {
                                                   const auto comm = pdo::communicator_of(mesh, p);
                                                   std::vector<float> v(p == 0 ? 5 : 6);
                                                   if (p == 0) comm.send(std::span<const float>(v), 1, 3);
                                                   else comm.recv(std::span<float>(v), 0, 3);
                                                 }),
                      Catch::Contains("sent 5 elements") && Catch::Contains("expects 6"));
}

TEST_CASE("two sends in a row with one tag arrive once each, in order", "[collectives]") {
  const auto mesh = pdo_test::line_mesh(2);
  std::vector<int> first(3), second(3);
  pdo::spmd(mesh, [&](std::size_t p) {
    const auto comm = pdo::communicator_of(mesh, p);
    if (p == 0) {
      const std::vector<int> a{1, 2, 3}, b{4, 5, 6};
      comm.send(std::span<const int>(a), 1, 9);
      comm.send(std::span<const int>(b), 1, 9);
    } else {
      comm.recv(std::span<int>(first), 0, 9);
      comm.recv(std::span<int>(second), 0, 9);
    }
  });
  CHECK(first == std::vector<int>{1, 2, 3});
  CHECK(second == std::vector<int>{4, 5, 6});
}

TEST_CASE("bad peers, tags and roots are errors, not hangs", "[collectives][errors]") {
  const auto mesh = pdo_test::line_mesh(2);
  auto on_both = [&](auto body) { pdo::spmd(mesh, [&](std::size_t p) { body(pdo::communicator_of(mesh, p), p); }); };
  std::vector<float> v(4);
  CHECK_THROWS_WITH(on_both([&](const pdo::mesh_communicator& comm, std::size_t p) {
                      if (p == 0) comm.send(std::span<const float>(v), 0, 1);
                    }),
                    Catch::Contains("peer must be another member"));
  CHECK_THROWS_WITH(on_both([&](const pdo::mesh_communicator& comm, std::size_t p) {
                      if (p == 1) comm.recv(std::span<float>(v), 5, 1);
                    }),
                    Catch::Contains("peer must be another member"));
  CHECK_THROWS_WITH(on_both([&](const pdo::mesh_communicator& comm, std::size_t p) {
                      std::vector<float> mine(4);
                      comm.broadcast(std::span<float>(mine), p);
                    }),
                    Catch::Contains("different roots"));
  CHECK_THROWS_AS(on_both([&](const pdo::mesh_communicator& comm, std::size_t) {
                    std::vector<float> mine(4), out(4);
                    const std::vector<std::size_t> three{1, 1, 2};
                    comm.all_to_all(std::span<const float>(mine), std::span<const std::size_t>(three), std::span<float>(out),
                                    std::span<const std::size_t>(three));
                  }),
                  pdo::mismatch_error);
}

TEST_CASE("places in different collectives, element types or reductions fail alike, and the mesh goes on", "[collectives][errors]") {
  // each case: what place 0 calls, what the others call, and the words every place's error names
  struct call_case {
    std::function<void(const pdo::mesh_communicator&)> first, others;
    std::vector<std::string> named;
  };
  auto reduce = [](pdo::reduce_op op) {
    return [op](const pdo::mesh_communicator& comm) {
      std::vector<float> v(6, 1.0f);
      comm.all_reduce(std::span<float>(v), op);
    };
  };
  const std::vector<call_case> cases{
      {reduce(pdo::reduce_op::sum), reduce(pdo::reduce_op::max), {"all_reduce(sum) of f32", "all_reduce(max) of f32"}},
      {reduce(pdo::reduce_op::sum),
       [](const pdo::mesh_communicator& comm) {
         std::vector<double> v(6, 1.0);
         comm.all_reduce(std::span<double>(v));
       },
       {"all_reduce(sum) of f32", "all_reduce(sum) of f64"}},
      {reduce(pdo::reduce_op::sum),
       [](const pdo::mesh_communicator& comm) {
         std::vector<float> v(6, 1.0f);
         comm.broadcast(std::span<float>(v), 6);  // its count field holds the root: the sizes alone would agree
       },
       {"all_reduce(sum) of f32", "broadcast of f32"}},
      {[](const pdo::mesh_communicator& comm) { comm.barrier(); }, reduce(pdo::reduce_op::sum), {"barrier", "all_reduce(sum)"}},
      {[](const pdo::mesh_communicator& comm) {
         std::vector<std::int16_t> in(3), out(3 * comm.size());
         comm.all_gather(std::span<const std::int16_t>(in), std::span<std::int16_t>(out));
       },
       [](const pdo::mesh_communicator& comm) {
         std::vector<std::uint16_t> in(3), out(3 * comm.size());
         comm.all_gather(std::span<const std::uint16_t>(in), std::span<std::uint16_t>(out));
       },
       {"all_gather of i16", "all_gather of u16"}},
  };
  for (const std::size_t n : {2, 3}) {
    const auto mesh = pdo_test::line_mesh(n);
    for (const auto& c : cases) {
      std::vector<std::string> errors(n);
      pdo::spmd(mesh, [&](std::size_t p) {
        try {
          (p == 0 ? c.first : c.others)(pdo::communicator_of(mesh, p));
        } catch (const pdo::mismatch_error& e) {
          errors[p] = e.what();
        }
      });
      for (std::size_t p = 0; p < n; ++p) {
        CAPTURE(n, p, errors[p]);
        CHECK_THAT(errors[p], Catch::Contains("different collectives"));
        for (const auto& word : c.named) CHECK_THAT(errors[p], Catch::Contains(word));
      }
    }
    std::vector<std::vector<float>> ok(n, std::vector<float>(5, 2.0f));
    pdo::spmd(mesh, [&](std::size_t p) { pdo::communicator_of(mesh, p).all_reduce(std::span<float>(ok[p]), pdo::reduce_op::max); });
    for (const auto& v : ok) CHECK(v == std::vector<float>(5, 2.0f));
    // two types of one representation (long and long long, 8-byte signed) make the same call
    static_assert(sizeof(long) == sizeof(long long));
    std::vector<long> longs(3, 2);
    std::vector<std::vector<long long>> long_longs(n, std::vector<long long>(3, 2));
    pdo::spmd(mesh, [&](std::size_t p) {
      if (p == 0) pdo::communicator_of(mesh, p).all_reduce(std::span<long>(longs));
      else pdo::communicator_of(mesh, p).all_reduce(std::span<long long>(long_longs[p]));
    });
    CHECK(longs == std::vector<long>(3, static_cast<long>(2 * n)));
  }
}
