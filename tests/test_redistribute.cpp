// tests/test_redistribute.cpp: distribute, every redistribution pair, and gather against the host tensor.
#include "support.hpp"

#include <tuple>

using pdo::replicate;
using pdo::split;

namespace {

template <class... Ts, class F>
void for_each_type(std::tuple<Ts...>*, F&& f) {
  (f(static_cast<Ts*>(nullptr)), ...);
}

/// @brief The value `x` holds, made partial over `Axis` with real addends: the place at
/// coordinate c along Axis holds (c + 1) times its shard, so the value is n(n+1)/2 times x.
template <class Layout, pdo::fixed_string Axis, class DT>
auto spread_over(const DT& x) {
  const auto& mesh = x.mesh();
  const std::size_t axis = std::remove_cvref_t<decltype(mesh)>::axis_index(Axis.view());
  return pdo::parallel_do<Layout>(
      [&mesh, axis](const auto& shard) {
        auto out = shard;
        const std::size_t p = [&] {
          for (std::size_t q : mesh.local_places())
            if (pdo::detail::current_place() == mesh.place(q).state().get()) return q;
          return std::size_t{0};
        }();
        for (auto& v : out) v *= static_cast<int>(mesh.coord(p, axis) + 1);
        return out;
      },
      x);
}

template <class From, class To, class Mesh>
void check_pair(const Mesh& mesh, const pdo::tensor<int, 2>& host) {
  CAPTURE(mesh.describe(), pdo::layout_name<From>(), pdo::layout_name<To>());
  const auto x = pdo::distribute<From>(mesh, host);
  const auto y = pdo::redistribute<To>(x);
  static_assert(std::is_same_v<typename decltype(y)::layout_type, To>);
  for (std::size_t k = 0; k < mesh.local_places().size(); ++k)
    REQUIRE(y.local_shards()[k].shape() == y.local_shape(mesh.local_places()[k]));
  REQUIRE(pdo_test::equal(pdo::gather(y), host));
}

}  // namespace

TEST_CASE("every redistribution pair on a line of 1..4 places, uneven shards", "[redistribute]") {
  using layouts = std::tuple<pdo::layout<replicate, replicate>, pdo::layout<split<"x">, replicate>, pdo::layout<replicate, split<"x">>,
                             pdo::layout<replicate, replicate>::partial<"x">>;
  const auto host = pdo_test::iota_tensor<int, 2>({10, 7});
  for (std::size_t n : pdo_test::line_sizes()) {
    const auto mesh = pdo_test::line_mesh(n);
    for_each_type(static_cast<layouts*>(nullptr), [&]<class From>(From*) {
      for_each_type(static_cast<layouts*>(nullptr), [&]<class To>(To*) { check_pair<From, To>(mesh, host); });
    });
  }
}

TEST_CASE("every redistribution pair on a 2x2 and a 3x2 mesh", "[redistribute]") {
  using layouts = std::tuple<pdo::layout<replicate, replicate>, pdo::layout<split<"a">, replicate>, pdo::layout<replicate, split<"b">>,
                             pdo::layout<split<"a">, split<"b">>, pdo::layout<split<"b">, split<"a">>, pdo::layout<split<"b">, replicate>,
                             pdo::layout<replicate, replicate>::partial<"a">, pdo::layout<split<"b">, replicate>::partial<"a">,
                             pdo::layout<replicate, replicate>::partial<"a", "b">>;
  const auto host = pdo_test::iota_tensor<int, 2>({7, 5});
  for (auto [a, b] : {std::pair<std::size_t, std::size_t>{2, 2}, {3, 2}}) {
    const auto mesh = pdo_test::grid_mesh(a, b);
    for_each_type(static_cast<layouts*>(nullptr), [&]<class From>(From*) {
      for_each_type(static_cast<layouts*>(nullptr), [&]<class To>(To*) { check_pair<From, To>(mesh, host); });
    });
  }
}

TEST_CASE("rank-3 tensors: gathers, slices and all_to_all on inner dims", "[redistribute]") {
  using layouts = std::tuple<pdo::layout<replicate, replicate, split<"x">>, pdo::layout<split<"x">, replicate, replicate>,
                             pdo::layout<replicate, split<"x">, replicate>, pdo::layout<replicate, replicate, replicate>::partial<"x">>;
  pdo::tensor<double, 3> host({5, 3, 7});
  for (std::size_t i = 0; i < host.size(); ++i) host.data()[i] = 0.25 * static_cast<double>(i);
  for (std::size_t n : {std::size_t{2}, std::size_t{3}}) {
    const auto mesh = pdo_test::line_mesh(n);
    for_each_type(static_cast<layouts*>(nullptr), [&]<class From>(From*) {
      for_each_type(static_cast<layouts*>(nullptr), [&]<class To>(To*) {
        CAPTURE(n, pdo::layout_name<From>(), pdo::layout_name<To>());
        REQUIRE(pdo_test::equal(pdo::gather(pdo::redistribute<To>(pdo::distribute<From>(mesh, host))), host));
      });
    });
  }
}

TEST_CASE("partial values with real addends reduce to their sum", "[redistribute]") {
  const auto host = pdo_test::iota_tensor<int, 2>({9, 4});
  for (std::size_t n : pdo_test::line_sizes()) {
    const auto mesh = pdo_test::line_mesh(n);
    using P = pdo::layout<replicate, replicate>::partial<"x">;
    const auto x = spread_over<P, "x">(pdo::distribute<pdo::layout<replicate, replicate>>(mesh, host));
    auto expected = host;
    for (auto& v : expected) v *= static_cast<int>(n * (n + 1) / 2);
    CHECK(pdo_test::equal(pdo::gather(x), expected));
    CHECK(pdo_test::equal(pdo::gather(pdo::redistribute<pdo::layout<split<"x">, replicate>>(x)), expected));  // reduce_scatter
    CHECK(pdo_test::equal(pdo::gather(pdo::redistribute<pdo::layout<replicate, split<"x">>>(x)), expected));  // packed reduce_scatter
    CHECK(pdo_test::equal(pdo::gather(pdo::redistribute<pdo::layout<replicate, replicate>>(x)), expected));  // all_reduce
  }
  const auto grid = pdo_test::grid_mesh(2, 2);
  using PA = pdo::layout<split<"b">, replicate>::partial<"a">;
  const auto y = spread_over<PA, "a">(pdo::distribute<pdo::layout<split<"b">, replicate>>(grid, host));
  auto expected = host;
  for (auto& v : expected) v *= 3;
  CHECK(pdo_test::equal(pdo::gather(pdo::redistribute<pdo::layout<split<"b">, split<"a">>>(y)), expected));
}

TEST_CASE("plans are chosen at compile time by the table", "[redistribute][plan]") {
  using R = pdo::layout<replicate, replicate>;
  using SX = pdo::layout<split<"x">, replicate>;
  using SX1 = pdo::layout<replicate, split<"x">>;
  using P = R::partial<"x">;
  constexpr auto count = [](const pdo::redistribute_plan& p, pdo::step_kind k) { return p.count(k); };
  STATIC_REQUIRE(pdo::redistribute_plan_of<R, SX>().collectives() == 0);  // replicate -> split moves nothing
  STATIC_REQUIRE(count(pdo::redistribute_plan_of<R, SX>(), pdo::step_kind::local_slice) == 1);
  STATIC_REQUIRE(count(pdo::redistribute_plan_of<SX, R>(), pdo::step_kind::all_gather) == 1);
  STATIC_REQUIRE(count(pdo::redistribute_plan_of<SX, SX1>(), pdo::step_kind::all_to_all) == 1);
  STATIC_REQUIRE(pdo::redistribute_plan_of<SX, SX1>().size == 1);
  STATIC_REQUIRE(count(pdo::redistribute_plan_of<P, R>(), pdo::step_kind::all_reduce) == 1);
  STATIC_REQUIRE(count(pdo::redistribute_plan_of<P, SX>(), pdo::step_kind::reduce_scatter) == 1);
  STATIC_REQUIRE(pdo::redistribute_plan_of<P, SX>().size == 1);
  STATIC_REQUIRE(count(pdo::redistribute_plan_of<R, P>(), pdo::step_kind::keep_on_one) == 1);
  STATIC_REQUIRE(pdo::redistribute_plan_of<SX, SX>().size == 0);
  // split -> partial pads the local chunk with zeros: no communication
  STATIC_REQUIRE(pdo::redistribute_plan_of<SX, P>().size == 1);
  STATIC_REQUIRE(pdo::redistribute_plan_of<SX, P>().collectives() == 0);
  STATIC_REQUIRE(count(pdo::redistribute_plan_of<SX, P>(), pdo::step_kind::zero_pad) == 1);
  // partial axes are reduced before split axes are gathered: the reduction moves less data
  using SP = pdo::layout<split<"a">, replicate>::partial<"b">;
  STATIC_REQUIRE(pdo::redistribute_plan_of<SP, pdo::layout<replicate, replicate>>().steps[0].kind == pdo::step_kind::all_reduce);
  // two axes: each moves on its own
  using AB = pdo::layout<split<"a">, split<"b">>;
  using BA = pdo::layout<split<"b">, split<"a">>;
  STATIC_REQUIRE(pdo::redistribute_plan_of<AB, BA>().collectives() >= 2);
  STATIC_REQUIRE(pdo::redistribute_plan_of<AB, pdo::layout<replicate, replicate>>().count(pdo::step_kind::all_gather) == 2);
  CHECK(pdo::describe(pdo::redistribute_plan_of<SX, SX1>()) ==
        "all_to_all over x from dim 0 to dim 1: {split<x>, replicate} -> {replicate, split<x>}\n");
}

TEST_CASE("replicate -> split moves no data and allocates only the new shards", "[redistribute]") {
  const auto mesh = pdo_test::line_mesh(4);
  const auto host = pdo_test::iota_tensor<float, 2>({10, 6});
  const auto x = pdo::distribute<pdo::layout<replicate, replicate>>(mesh, host);
  const auto y = pdo::redistribute<pdo::layout<split<"x">, replicate>>(x);
  const std::size_t rows[] = {3, 3, 2, 2};
  for (std::size_t p = 0; p < 4; ++p) {
    CHECK(y.shard(p).extent(0) == rows[p]);
    CHECK(y.local_offset(p)[0] == pdo::detail::chunk_offset(10, 4, p));
    CHECK(y.shard(p)(0, 0) == host(y.local_offset(p)[0], 0));
  }
}

TEST_CASE("a redistribution holds no more than its input, one packed copy and its output on a place", "[redistribute][memory]") {
  // [rows, cols] of floats, so that every shard is a whole number of the allocator's blocks
  using rows = pdo::layout<split<"x">, replicate>;
  using cols = pdo::layout<replicate, split<"x">>;
  using whole = pdo::layout<replicate, replicate>;
  // the extra bytes place 0 of x's mesh held at most while `To` was made from x (whose value is `host`)
  auto peak_of = []<class To>(const auto& x, const auto& host) {
    auto& memory = x.mesh().place(0).memory();
    const std::size_t before = memory.stats().bytes_in_use;
    memory.reset_peak();
    const auto y = pdo::redistribute<To>(x);
    const std::size_t peak = memory.stats().peak_bytes_in_use - before;
    REQUIRE(pdo_test::equal(pdo::gather(y), host));
    return peak;
  };
  const auto host = pdo_test::iota_tensor<float, 2>({256, 128});
  for (std::size_t n : {2, 4}) {
    const auto mesh = pdo_test::line_mesh(n);
    const std::size_t bytes = host.bytes();
    CAPTURE(n);
    const auto by_rows = pdo::distribute<rows>(mesh, host);
    const auto by_cols = pdo::distribute<cols>(mesh, host);
    const auto everywhere = pdo::distribute<whole>(mesh, host);
    // all_to_all: rows -> columns packs the columns' pieces and receives them in order (the
    // output and a packed copy of the input); columns -> rows sends the shard as it is and
    // puts the pieces received in order (the output and the pieces)
    CHECK(peak_of.template operator()<cols>(by_rows, host) == 2 * bytes / n);
    CHECK(peak_of.template operator()<rows>(by_cols, host) == 2 * bytes / n);
    // all_gather of rows: straight into the output; of columns: the pieces, then the output
    CHECK(peak_of.template operator()<whole>(by_rows, host) == bytes);
    CHECK(peak_of.template operator()<whole>(by_cols, host) == 2 * bytes);
    // a local slice: the new shard only
    CHECK(peak_of.template operator()<rows>(everywhere, host) == bytes / n);
  }
  // rank 3, from dim 1 split to dim 2 split: pieces packed to send and put in order when
  // received, the packed ones freed before the output is made (two shards of half of it)
  const auto cube = pdo_test::iota_tensor<float, 3>({4, 128, 64});
  const auto x = pdo::distribute<pdo::layout<replicate, split<"x">, replicate>>(pdo_test::line_mesh(2), cube);
  CHECK(peak_of.template operator()<pdo::layout<replicate, replicate, split<"x">>>(x, cube) == cube.bytes());
}

TEST_CASE("gather writes each block into the host tensor: a tensor that fits only when split can be gathered",
          "[redistribute][gather]") {
  // 4 places capped at 336 KiB each hold two 160 KiB blocks of a 640 KiB tensor but not a
  // replicated copy of it: the old gather, through a replicate layout, failed there with
  // out_of_memory
  const std::size_t cap = std::size_t{336} << 10;
  const auto host = pdo_test::iota_tensor<double, 2>({512, 160});
  const auto mesh = pdo::make_mesh<"x">(pdo::cpu_places(4, cap));
  const auto rows = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, host);
  CHECK(pdo_test::equal(pdo::gather(rows), host));
  const auto cols = pdo::distribute<pdo::layout<replicate, split<"x">>>(mesh, host);
  CHECK(pdo_test::equal(pdo::gather(cols), host));
  using whole = pdo::layout<replicate, replicate>;
  CHECK_THROWS_AS(pdo::redistribute<whole>(rows), pdo::out_of_memory);
  // gather_to: the result on process 0 only (here: the only process)
  const auto at_root = pdo::gather_to(cols, 0);
  REQUIRE(at_root.has_value());
  CHECK(pdo_test::equal(*at_root, host));
  CHECK_THROWS_WITH(pdo::gather_to(cols, 1), Catch::Contains("process 1 holds no place of the mesh"));
}

TEST_CASE("gather and gather_to of every layout on 1-4 places and 2 x 2, partial ones included", "[redistribute][gather]") {
  const auto host = pdo_test::iota_tensor<int, 2>({9, 7});
  auto check = [&](const auto& mesh) {
    CAPTURE(mesh.describe());
    using layouts = std::tuple<pdo::layout<replicate, replicate>, pdo::layout<split<"a">, replicate>, pdo::layout<replicate, split<"b">>,
                               pdo::layout<split<"b">, split<"a">>, pdo::layout<split<"a">, replicate>::partial<"b">,
                               pdo::layout<replicate, replicate>::partial<"a">>;
    for_each_type(static_cast<layouts*>(nullptr), [&]<class L>(L*) {
      CAPTURE(pdo::layout_name<L>());
      const auto x = pdo::distribute<L>(mesh, host);
      CHECK(pdo_test::equal(pdo::gather(x), host));
      CHECK(pdo_test::equal(*pdo::gather_to(x), host));
    });
    // partial sums of real addends (place at coordinate c along "b" holds c + 1 times its block)
    const auto spread = spread_over<pdo::layout<split<"a">, replicate>::partial<"b">, "b">(
        pdo::distribute<pdo::layout<split<"a">, replicate>>(mesh, host));
    const int times = static_cast<int>(mesh.extent(1) * (mesh.extent(1) + 1) / 2);
    auto want = host;
    for (auto& v : want) v *= times;
    CHECK(pdo_test::equal(pdo::gather(spread), want));
    CHECK(pdo_test::equal(*pdo::gather_to(spread), want));
  };
  for (std::size_t n : pdo_test::line_sizes()) check(pdo_test::grid_mesh(n, 1));
  check(pdo_test::grid_mesh(2, 2));
  check(pdo_test::grid_mesh(1, 3));
}
