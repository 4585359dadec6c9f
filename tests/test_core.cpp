// tests/test_core.cpp: tensors, memory, places, meshes, layouts and dtensor geometry.
#include "support.hpp"

#include <iomanip>
#include <sstream>

using pdo::replicate;
using pdo::split;

TEST_CASE("tensor: shape, strides, element access, deep copies", "[tensor]") {
  pdo::tensor<float, 3> t({2, 3, 4});
  CHECK(t.size() == 24);
  CHECK(t.strides() == std::array<std::ptrdiff_t, 3>{12, 4, 1});
  t(1, 2, 3) = 5.0f;
  CHECK(t.data()[23] == 5.0f);
  CHECK(t(0, 0, 0) == 0.0f);  // zero-filled
  auto u = t;
  u(1, 2, 3) = 1.0f;
  CHECK(t(1, 2, 3) == 5.0f);
  const pdo::tensor<int, 2> v({2, 2}, {1, 2, 3, 4});
  CHECK(v(1, 0) == 3);
  CHECK_THROWS_AS((pdo::tensor<int, 2>({2, 2}, {1, 2, 3})), pdo::shape_error);
  CHECK(pdo::describe(v) == "i32[2, 2]");
  const std::vector<pdo::tensor<float, 2>> empties(2);  // default-constructed tensors copy as empty ones
  const auto copies = empties;
  CHECK(copies[1].size() == 0);
  CHECK(copies[1].data() == nullptr);
  // rank 0: one element, and none once moved from (or default constructed): nothing to read
  pdo::tensor<double, 0> total({}, {2.5});
  CHECK(total.size() == 1);
  const pdo::tensor<double, 0> taken = std::move(total);
  CHECK((taken.size() == 1 && taken() == 2.5));
  CHECK((total.size() == 0 && total.bytes() == 0 && total.begin() == total.end()));  // NOLINT(bugprone-use-after-move)
  CHECK(pdo::tensor<float, 0>().size() == 0);
  std::ostringstream empty;
  empty << total;
  CHECK(empty.str() == "[]");
  // element types by kind and bits, as NumPy and PyTorch name them
  CHECK(pdo::describe(pdo::tensor<std::uint8_t, 1>({3})) == "u8[3]");
  CHECK(pdo::describe(pdo::tensor<std::int16_t, 1>({3})) == "i16[3]");
  CHECK(pdo::describe(pdo::tensor<std::int8_t, 1>({3})) == "i8[3]");
  CHECK(pdo::describe(pdo::tensor<std::uint64_t, 2>({1, 2})) == "u64[1, 2]");
  CHECK(pdo::describe(pdo::tensor<double, 0>(pdo::shape_t<0>{})) == "f64[]");
}

// What cannot be written, gathered or redistributed says so to code that asks (a test framework's
// printer, a generic helper): deleted, not an error inside a body.
template <class X>
concept writable = requires(std::ostream& os, const X& x) { os << x; };
template <class X>
concept gatherable = requires(const X& x) { pdo::gather(x); };
template <class X>
concept redistributable = requires(const X& x) { pdo::redistribute<pdo::layout<pdo::replicate>>(x); };
using split_vector = pdo::dtensor<float, 1, pdo::mesh<"dp">, pdo::layout<split<"dp">>>;
static_assert(writable<pdo::tensor<float, 2>> && writable<pdo::tensor<std::int8_t, 0>>);
static_assert(!writable<split_vector> && !writable<pdo::var<pdo::tensor<float, 1>>>);
static_assert(!writable<decltype(std::declval<const pdo::tensor<float, 1>&>() * 2.0f)>);
static_assert(gatherable<split_vector> && !gatherable<pdo::tensor<float, 1>> && !gatherable<pdo::var<split_vector>>);
static_assert(redistributable<split_vector> && !redistributable<pdo::tensor<float, 1>>);

TEST_CASE("tensor: written to a stream nested by dim, long dims elided, in the stream's format", "[tensor]") {
  const auto written = [](const auto& t, int precision = 6) {
    std::ostringstream os;
    os << std::setprecision(precision) << t;
    return os.str();
  };
  CHECK(written(pdo::tensor<float, 2>({2, 3}, {0, 0.5f, 1, 1.5f, 2, 2.5f})) == "[[0, 0.5, 1],\n [1.5, 2, 2.5]]");
  CHECK(written(pdo::tensor<int, 3>({2, 1, 2}, {1, 2, 3, 4})) == "[[[1, 2]],\n\n [[3, 4]]]");
  CHECK(written(pdo::tensor<std::int8_t, 1>({3}, {-5, 0, 65})) == "[-5, 0, 65]");  // numbers, not characters
  CHECK(written(pdo::tensor<double, 0>({}, {2.0 / 3}), 3) == "0.667");
  CHECK(written(pdo::tensor<float, 2>({2, 0})) == "[]");  // no elements, as NumPy writes them, whichever extent is 0
  CHECK(written(pdo::tensor<float, 3>({3, 0, 5})) == "[]");
  CHECK(written(pdo::tensor<double, 1>({2}, {-std::numeric_limits<double>::quiet_NaN(), 1.5})) == "[nan, 1.5]");
  CHECK(written(pdo::tensor<float, 2>()) == "[]");
  CHECK(written(pdo::tensor<float, 0>()) == "[]");
  pdo::tensor<int, 2> big({40, 30});  // 1200 elements: the middle of each dim left out
  for (std::size_t i = 0; i < big.size(); ++i) big.data()[i] = static_cast<int>(i);
  const std::string b = written(big);
  CHECK(b.starts_with("[[0, 1, 2, ..., 27, 28, 29],\n [30, 31, 32, ..., 57, 58, 59],\n [60, 61, 62, ..., 87, 88, 89],\n ...,\n [1110,"));
  CHECK(b.ends_with("[1170, 1171, 1172, ..., 1197, 1198, 1199]]"));
  pdo::tensor<int, 1> whole({1000});  // 1000 elements: all written
  CHECK(written(whole).find("...") == std::string::npos);
}

TEST_CASE("caching allocator: statistics, reuse, cap", "[memory]") {
  pdo::caching_allocator a("cpu:7", 1 << 20);
  void* p = a.allocate(1000);
  CHECK(a.stats().bytes_in_use == 1024);
  CHECK(a.stats().allocations == 1);
  a.deallocate(p, 1000);
  CHECK(a.stats().bytes_in_use == 0);
  CHECK(a.stats().bytes_cached == 1024);
  void* q = a.allocate(900);  // same size class: reused
  CHECK(q == p);
  CHECK(a.stats().system_allocations == 1);
  CHECK(a.stats().peak_bytes_in_use == 1024);
  try {
    (void)a.allocate(2 << 20);
    FAIL("no out_of_memory");
  } catch (const pdo::out_of_memory& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("cpu:7") && Catch::Contains("2097152") && Catch::Contains("1048576"));
  }
  a.deallocate(q, 900);
  a.release_cache();
  CHECK(a.stats().bytes_cached == 0);
  CHECK(a.stats().allocations == 2);  // the refused request is not counted
  CHECK_THROWS_AS(a.allocate(~std::size_t{0} - 8), pdo::out_of_memory);  // no overflow in rounding
  a.set_cap(512);  // a lowered cap holds for cached blocks too
  void* r = a.allocate(256);
  a.deallocate(r, 256);
  CHECK_THROWS_AS(a.allocate(1000), pdo::out_of_memory);
}

TEST_CASE("a place's cap stops a distribute with out_of_memory naming the place", "[memory]") {
  const auto places = pdo::cpu_places(2, 64 << 10);
  const auto mesh = pdo::make_mesh<"x">(places);
  CHECK_NOTHROW(pdo::distribute<pdo::layout<split<"x">>>(mesh, pdo::tensor<float, 1>({20000})));  // 40 KB a place
  CHECK_THROWS_AS(pdo::distribute<pdo::layout<replicate>>(mesh, pdo::tensor<float, 1>({20000})), pdo::out_of_memory);
  CHECK_THROWS_WITH(pdo::distribute<pdo::layout<replicate>>(mesh, pdo::tensor<float, 1>({20000})),
                    Catch::Contains("distribute") && Catch::Contains("cpu:") && Catch::Contains("cap of 65536"));
}

TEST_CASE("places: cores are shared out without oversubscription", "[place]") {
  const auto cores = pdo::detail::process_cores();
  const auto one = pdo::cpu_places(1);
  CHECK(one[0].cores() == cores);
  const auto many = pdo::cpu_places(cores.size() + 1);
  for (const auto& p : many) CHECK(p.cores().size() == 1);
  STATIC_REQUIRE(pdo::place<pdo::cpu_place>);
  STATIC_REQUIRE(pdo::place<pdo::cuda_place>);
  STATIC_REQUIRE(pdo::place<pdo::any_place>);
  STATIC_REQUIRE(!pdo::place<int>);
  CHECK_THROWS_AS(pdo::cpu_places(0), pdo::error);
}

TEST_CASE("mesh: coordinates, groups along an axis, description", "[mesh]") {
  const auto mesh = pdo::make_mesh<"dp", "tp">(pdo::cpu_places(6), {3, 2});
  CHECK(mesh.size() == 6);
  CHECK(mesh.coords(3) == std::array<std::size_t, 2>{1, 1});
  CHECK(mesh.index({2, 0}) == 4);
  CHECK(mesh.group(0, 3) == std::vector<std::size_t>{1, 3, 5});
  CHECK(mesh.group(1, 3) == std::vector<std::size_t>{2, 3});
  CHECK(mesh.describe() == "mesh(dp=3, tp=2)");
  CHECK(mesh.extent("tp") == 2);
  STATIC_REQUIRE(decltype(mesh)::axis_index("tp") == 1);
  STATIC_REQUIRE(!decltype(mesh)::has_axis("pp"));
  CHECK_THROWS_WITH((pdo::make_mesh<"dp", "tp">(pdo::cpu_places(4), {3, 2})),
                    Catch::Contains("make_mesh") && Catch::Contains("[3, 2]") && Catch::Contains("4 were given"));
  CHECK_THROWS_WITH(pdo::make_mesh<"x">(std::vector<pdo::cpu_place>{}), Catch::Contains("make_mesh") && Catch::Contains("has no places"));
  // extents computed at run time, in a container
  CHECK(pdo::make_mesh<"dp", "tp">(pdo::cpu_places(6), std::array<std::size_t, 2>{2, 3}).describe() == "mesh(dp=2, tp=3)");
  const std::vector<int> extents{3, 2};
  CHECK(pdo::make_mesh<"dp", "tp">(pdo::cpu_places(6), extents).coords(3) == std::array<std::size_t, 2>{1, 1});
  CHECK_THROWS_WITH((pdo::make_mesh<"dp", "tp">(pdo::cpu_places(6), std::vector<std::size_t>{6, 1, 1})),
                    Catch::Contains("make_mesh: 3 extents [6, 1, 1] for a mesh of 2 axes (\"dp\", \"tp\")"));
  CHECK_THROWS_WITH((pdo::make_mesh<"dp", "tp">(pdo::cpu_places(6), std::vector<int>{-3, -2})), Catch::Contains("extent -3 is negative"));
  CHECK_THROWS_WITH((pdo::make_mesh<"dp", "tp">(pdo::cpu_places(4), extents)), Catch::Contains("[3, 2]") && Catch::Contains("4 were given"));
  // extents whose product would wrap around to the number of places
  CHECK_THROWS_WITH((pdo::make_mesh<"dp", "tp">(pdo::cpu_places(4), std::vector<std::size_t>{4, (std::size_t{1} << 62) + 1})),
                    Catch::Contains("hold more places than a size_t counts"));
}

TEST_CASE("mesh: a place or axis number out of range is a layout_error naming the mesh and the call", "[mesh]") {
  const auto mesh = pdo::make_mesh<"dp", "tp">(pdo::cpu_places(6), {3, 2});
// (matchers made in the check itself: Catch's && keeps references to its operands)
#define no_place(op) Catch::Contains("mesh(dp=3, tp=2)") && Catch::Contains(op) && Catch::Contains("no place 9")
#define no_axis(op) Catch::Contains("mesh(dp=3, tp=2)") && Catch::Contains(op) && Catch::Contains("no axis number 2")
  CHECK_THROWS_AS(mesh.coords(9), pdo::layout_error);
  CHECK_THROWS_WITH(mesh.coords(9), no_place("coords"));
  CHECK_THROWS_WITH(mesh.coord(0, 2), no_axis("coord"));
  CHECK_THROWS_WITH(mesh.coord(9, 0), no_place("coord"));
  CHECK_THROWS_WITH(mesh.extent(std::size_t{2}), no_axis("extent"));
  CHECK_THROWS_WITH(mesh.group(2, 0), no_axis("group"));
  CHECK_THROWS_WITH(mesh.group(0, 9), no_place("group"));
  CHECK_THROWS_WITH(mesh.index({3, 0}), Catch::Contains("coordinate 3 along \"dp\"") && Catch::Contains("extent 3"));
  CHECK_THROWS_WITH(pdo::communicator_along(mesh, 2, 0), no_axis("communicator_along"));
  CHECK_THROWS_WITH(pdo::communicator_along(mesh, 0, 9), no_place("communicator_along"));
  CHECK_THROWS_WITH(pdo::communicator_of(mesh, 9), no_place("communicator_of"));
  CHECK_THROWS_WITH(pdo::host_communicator_of(mesh, 9), no_place("host_communicator_of"));
  const auto x = pdo::distribute<pdo::layout<replicate, split<"tp">>>(mesh, pdo_test::iota_tensor<float, 2>({4, 5}));
  CHECK_THROWS_WITH(x.local_shape(9), no_place("dtensor::local_shape"));
  CHECK_THROWS_WITH(x.local_offset(9), no_place("dtensor::local_offset"));
  // the places that exist still answer
  CHECK(x.local_shape(5) == pdo::shape_t<2>{4, 2});
  CHECK(x.local_offset(5) == pdo::shape_t<2>{0, 3});
  CHECK(mesh.coord(5, 1) == 1);
  for (std::size_t p = 0; p < mesh.size(); ++p)
    for (std::size_t a = 0; a < 2; ++a) {
      CHECK(mesh.coord(p, a) == mesh.coords(p)[a]);
      for (std::size_t q : mesh.group(a, p)) CHECK((mesh.coords(q)[1 - a] == mesh.coords(p)[1 - a]));
      CHECK(mesh.group(a, p).size() == mesh.extent(a));
    }
#undef no_place
#undef no_axis
}

TEST_CASE("layouts: validity is known at compile time, both ways", "[layout]") {
  using M = pdo::mesh<"dp", "tp">;
  STATIC_REQUIRE(pdo::valid_layout_v<pdo::layout<split<"dp">, replicate>, M, 2>);
  STATIC_REQUIRE(pdo::valid_layout_v<pdo::layout<split<"dp">, split<"tp">>, M, 2>);
  STATIC_REQUIRE(pdo::valid_layout_v<pdo::layout<split<"dp">, replicate>::partial<"tp">, M, 2>);
  STATIC_REQUIRE(!pdo::valid_layout_v<pdo::layout<split<"pp">, replicate>, M, 2>);          // no such axis
  STATIC_REQUIRE(!pdo::valid_layout_v<pdo::layout<split<"dp">, split<"dp">>, M, 2>);            // axis twice
  STATIC_REQUIRE(!pdo::valid_layout_v<pdo::layout<split<"dp">, replicate>::partial<"dp">, M, 2>);
  STATIC_REQUIRE(!pdo::valid_layout_v<pdo::layout<split<"dp">>, M, 2>);                      // rank
  STATIC_REQUIRE(pdo::layout_spec<pdo::layout<replicate>::partial<"dp">>);
  STATIC_REQUIRE(!pdo::layout_spec<int>);
  CHECK(pdo::layout_name<pdo::layout<split<"dp">, replicate>::partial<"tp">>() == "{split<dp>, replicate} partial<tp>");
}

TEST_CASE("dtensor: uneven shards are cut 3,3,2,2", "[dtensor]") {
  const auto mesh = pdo_test::line_mesh(4);
  const auto host = pdo_test::iota_tensor<float, 2>({10, 3});
  const auto x = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, host);
  const std::size_t rows[] = {3, 3, 2, 2}, offsets[] = {0, 3, 6, 8};
  for (std::size_t p = 0; p < 4; ++p) {
    CHECK(x.shard(p).shape() == pdo::shape_t<2>{rows[p], 3});
    CHECK(x.local_offset(p)[0] == offsets[p]);
    CHECK(x.shard(p)(0, 1) == host(offsets[p], 1));
    CHECK(x.shard(p).place_name() == "cpu:" + std::to_string(p));
  }
  CHECK(x.describe() == "f32[10, 3]{split<x>, replicate} on mesh(x=4)");
  // more places than rows: empty shards are allowed
  const auto y = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, pdo_test::iota_tensor<float, 2>({2, 3}));
  CHECK(y.shard(3).size() == 0);
  CHECK(pdo_test::equal(pdo::gather(y), pdo_test::iota_tensor<float, 2>({2, 3})));
}

TEST_CASE("dtensor: shards that do not fit the layout are a shape error", "[dtensor][errors]") {
  const auto mesh = pdo_test::line_mesh(2);
  std::vector<pdo::tensor<float, 1>> shards;
  shards.emplace_back(pdo::shape_t<1>{3});
  shards.emplace_back(pdo::shape_t<1>{3});
  using D = pdo::dtensor<float, 1, pdo::mesh<"x">, pdo::layout<split<"x">>>;
  CHECK_THROWS_WITH(D(mesh, {5}, shards), Catch::Contains("cpu:1") && Catch::Contains("f32[3]") && Catch::Contains("[2]"));
  CHECK_THROWS_AS(D(mesh, {5}, {}), pdo::shape_error);
}

TEST_CASE("chunking follows the even rule", "[shape]") {
  STATIC_REQUIRE(pdo::detail::chunk_size(10, 4, 0) == 3);
  STATIC_REQUIRE(pdo::detail::chunk_size(10, 4, 3) == 2);
  STATIC_REQUIRE(pdo::detail::chunk_offset(10, 4, 3) == 8);
  STATIC_REQUIRE(pdo::detail::chunk_offset(10, 4, 2) == 6);
}

TEST_CASE("sizes: extents whose product or byte count overflows are a shape_error naming the op", "[tensor][errors]") {
  const std::size_t big = std::size_t{1} << 33;
  CHECK_THROWS_AS((pdo::tensor<float, 2>({big, big})), pdo::shape_error);
  CHECK_THROWS_WITH((pdo::tensor<float, 1>({(std::size_t{1} << 62) + 1})), Catch::Contains("tensor: extents [4611686018427387905]"));
  const pdo::tensor<float, 2> tall({std::size_t{1} << 32, 0}), wide({0, std::size_t{1} << 32});
  CHECK_THROWS_WITH(pdo::eval(pdo::matmul(tall, wide)), Catch::Contains("matmul: extents [4294967296, 4294967296]"));
  const pdo::tensor<float, 1> none({0});
  CHECK_THROWS_AS(pdo::reshape(none, {std::size_t{1} << 32, std::size_t{1} << 32}), pdo::shape_error);
  const auto mesh = pdo::make_mesh<"x">(pdo::cpu_places(2));
  const auto d_tall = pdo::distribute<pdo::layout<pdo::split<"x">, pdo::replicate>>(mesh, tall);
  const auto d_wide = pdo::distribute<pdo::layout<pdo::replicate, pdo::replicate>>(mesh, wide);
  CHECK_THROWS_WITH(pdo::eval(pdo::matmul(d_tall, d_wide)), Catch::Contains("matmul: extents"));
  // the kind asked for: extents a file gives are an io_error of that file
  CHECK_THROWS_AS(pdo::detail::checked_volume(std::vector<std::size_t>{big, big}, "io: f", 4, pdo::error_kind::io), pdo::io_error);
}

TEST_CASE("messages: a list is cut after its first items, saying how many there are", "[errors]") {
  const auto name = [](int i) { return "n" + std::to_string(i); };
  CHECK(pdo::detail::listed(std::vector<int>{}, name, 3).empty());
  CHECK(pdo::detail::listed(std::vector<int>{1, 2, 3}, name, 3) == "n1, n2, n3");
  CHECK(pdo::detail::listed(std::vector<int>{1, 2, 3, 4, 5}, name, 3) == "n1, n2, n3, ... (5 in all)");
  // the rows of a shuffled batch a trainer's error names: the first 128, then how many
  std::vector<std::size_t> rows(200);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = 2 * i;
  const std::string text = pdo::detail::rows_context(rows);
  CHECK_THAT(text, Catch::StartsWith("its 200 rows of the batch are the inputs' rows 0, 2, 4,") &&
                       Catch::Contains(", 254, ... (200 in all) (row i here") && !Catch::Contains("256"));
  CHECK(pdo::detail::rows_context(std::vector<std::size_t>{7, 8, 9}) ==
        "its 3 rows of the batch are the inputs' rows 7..9 (row 0 here is row 7 there): ");
}
