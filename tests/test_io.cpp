// tests/test_io.cpp: sharded checkpoints (every layout pair across meshes, resharding on
// load, corruption cases, safe replacement), .npy and safetensors, in and out of Python.
#include "model_support.hpp"

#include <pdo/io.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>

using pdo::replicate;
using pdo::split;
namespace fs = std::filesystem;

namespace {

/// @brief A fresh directory under the system's temporary directory, removed at the end.
struct scratch_dir {
  fs::path path;
  explicit scratch_dir(const std::string& name) : path(fs::temp_directory_path() / ("pdo_test_io_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~scratch_dir() { fs::remove_all(path); }
};

template <class... Ts, class F>
void for_each_type(std::tuple<Ts...>*, F&& f) {
  (f(static_cast<Ts*>(nullptr)), ...);
}

using line_layouts = std::tuple<pdo::layout<replicate, replicate>, pdo::layout<split<"x">, replicate>, pdo::layout<replicate, split<"x">>,
                                pdo::layout<replicate, replicate>::partial<"x">>;
using grid_layouts = std::tuple<pdo::layout<split<"a">, split<"b">>, pdo::layout<split<"b">, split<"a">>, pdo::layout<replicate, split<"b">>,
                                pdo::layout<split<"b">, replicate>::partial<"a">>;

/// @brief f(mesh, layout*) for every mesh (1-4 places in a line, 2x2) and layout of the tests.
template <class F>
void for_each_config(F&& f) {
  for (std::size_t n : pdo_test::line_sizes()) {
    const auto m = pdo_test::line_mesh(n);
    for_each_type(static_cast<line_layouts*>(nullptr), [&](auto* l) { f(m, l); });
  }
  const auto g = pdo_test::grid_mesh(2, 2);
  for_each_type(static_cast<grid_layouts*>(nullptr), [&](auto* l) { f(g, l); });
}

template <class T>
void check_every_layout_pair(const pdo::shape_t<2>& shape) {
  scratch_dir tmp(std::string(pdo::io::detail::stored_dtype<T>()));
  const auto host = pdo_test::random_tensor<T, 2>(shape, 7);
  // one checkpoint per (mesh, layout) it is saved from...
  std::vector<std::pair<fs::path, std::string>> saved;
  for_each_config([&](const auto& mesh, auto* l) {
    using L = std::remove_pointer_t<decltype(l)>;
    auto x = pdo::distribute<L>(mesh, host);
    const fs::path dir = tmp.path / ("ck" + std::to_string(saved.size()));
    pdo::io::checkpoint c;
    c.add("w", x);
    pdo::io::save(dir, c, {.chunk_bytes = 64});
    saved.emplace_back(dir, mesh.describe() + " " + pdo::layout_name<L>());
  });
  // ...loaded into every (mesh, layout): the same values
  for (const auto& ck : saved) {
    const fs::path& dir = ck.first;
    const std::string& from = ck.second;
    for_each_config([&](const auto& mesh, auto* l) {
      using L = std::remove_pointer_t<decltype(l)>;
      CAPTURE(from, mesh.describe(), pdo::layout_name<L>(), shape);
      auto y = pdo::distribute<L>(mesh, pdo::tensor<T, 2>(shape));
      pdo::io::checkpoint c;
      c.add("w", y);
      pdo::io::load(dir, c);
      CHECK(pdo_test::equal(pdo::gather(y), host));
      CHECK(pdo_test::equal(pdo::gather(pdo::io::read<T, 2, L>(dir, "w", mesh, {.verify = false})), host));
    });
  }
}

void flip_byte(const fs::path& file, std::size_t from_end) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-static_cast<std::streamoff>(from_end), std::ios::end);
  char c = 0;
  f.read(&c, 1);
  f.seekp(-static_cast<std::streamoff>(from_end), std::ios::end);
  c = static_cast<char>(c ^ 0x5a);
  f.write(&c, 1);
}

/// @brief An .npy file of format 1.0 with the header `dict` (padded to 117 characters and a
/// newline, as NumPy aligns it) and `data_bytes` zero bytes of data.
void write_npy_v1(const fs::path& path, std::string dict, std::size_t data_bytes) {
  dict.resize(117, ' ');
  dict += '\n';
  std::ofstream f(path, std::ios::binary);
  f << "\x93NUMPY" << '\x01' << '\x00' << static_cast<char>(dict.size() & 0xff) << static_cast<char>(dict.size() >> 8) << dict
    << std::string(data_bytes, '\0');
}

/// Writes edited metadata to `dir`'s metadata.json without its checksum, as a checkpoint of a
/// pdo that kept none: the load then checks the content itself (with the checksum kept, any
/// edit is refused as a damaged file first).
void write_metadata(const fs::path& dir, nlohmann::json meta) {
  meta.erase("checksum");
  std::ofstream(dir / "metadata.json") << meta.dump();
}

std::string load_error(const fs::path& dir, pdo::io::checkpoint& c) {
  try {
    pdo::io::load(dir, c);
  } catch (const pdo::io_error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("checkpoints: every layout pair, across meshes of 1-4 places and 2x2, uneven and empty shards") {
  check_every_layout_pair<float>({7, 5});
  check_every_layout_pair<double>({3, 2});  // 3 rows over 4 places: one shard is empty
  check_every_layout_pair<std::int32_t>({9, 6});
}

TEST_CASE("checkpoints: host tensors, numbers and text; a dtensor read whole; inspect") {
  scratch_dir tmp("mixed");
  const auto mesh = pdo_test::line_mesh(3);
  const auto host = pdo_test::random_tensor<double, 3>({4, 3, 5}, 3);
  auto x = pdo::distribute<pdo::layout<replicate, split<"x">, replicate>>(mesh, host);
  auto bias = pdo_test::random_tensor<float, 1>({6}, 4);
  std::int64_t step = 1234567890123;
  double lr = 0.1 + 0.2;
  std::string rng_state = "12 34 56";
  pdo::io::checkpoint c;
  c.add("x", x).add("bias", bias).add("step", step).add("lr", lr).add("rng", rng_state);
  pdo::io::save(tmp.path / "ck", c);
  CHECK_FALSE(fs::exists(tmp.path / "ck.partial"));

  auto bias2 = pdo::tensor<float, 1>({6});
  std::int64_t step2 = 0;
  double lr2 = 0;
  std::string rng2;
  auto x2 = pdo::distribute<pdo::layout<split<"x">, replicate, replicate>>(pdo_test::line_mesh(2), pdo::tensor<double, 3>({4, 3, 5}));
  pdo::io::checkpoint back;
  back.add("rng", rng2).add("lr", lr2).add("step", step2).add("bias", bias2).add("x", x2);
  pdo::io::load(tmp.path / "ck", back);
  CHECK(step2 == step);
  CHECK(lr2 == lr);
  CHECK(rng2 == rng_state);
  CHECK(pdo_test::equal(bias2, bias));
  CHECK(pdo_test::equal(pdo::gather(x2), host));
  CHECK(pdo_test::equal(pdo::io::read<double, 3>(tmp.path / "ck", "x"), host));
  // a number of another type, or a tensor, where a number is loaded: both types named
  double step_as_double = 0;
  pdo::io::checkpoint wrong_type;
  wrong_type.add("step", step_as_double);
  CHECK_THROWS_WITH(pdo::io::load(tmp.path / "ck", wrong_type), Catch::Contains("it is a value of int64 in the checkpoint, not a value of float64"));
  pdo::io::checkpoint tensor_as_number;
  tensor_as_number.add("bias", step_as_double);
  CHECK_THROWS_WITH(pdo::io::load(tmp.path / "ck", tensor_as_number), Catch::Contains("it is a tensor of float32 in the checkpoint, not a value of float64"));

  const auto info = pdo::io::inspect(tmp.path / "ck");
  REQUIRE(info.size() == 5);
  CHECK(info[0].name == "x");
  CHECK(info[0].dtype == "float64");
  CHECK(info[0].shape == std::vector<std::size_t>{4, 3, 5});
  CHECK(info[0].layout == "{replicate, split<x>, replicate}");
  CHECK(info[0].mesh == "mesh(x=3)");
  CHECK(info[2].kind == "value");
  CHECK(info[4].kind == "text");
}

TEST_CASE("checkpoints: a save replaces the old checkpoint whole, and leaves nothing beside it") {
  scratch_dir tmp("replace");
  const auto mesh = pdo_test::line_mesh(2);
  auto x = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, pdo_test::random_tensor<float, 2>({6, 4}, 1));
  pdo::io::checkpoint c;
  c.add("x", x);
  pdo::io::save(tmp.path / "ck", c);
  const auto first = pdo::gather(x);
  auto y = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, pdo_test::random_tensor<float, 2>({6, 4}, 2));
  pdo::io::checkpoint c2;
  c2.add("x", y);
  pdo::io::save(tmp.path / "ck", c2);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(tmp.path)) names.push_back(e.path().filename().string());
  CHECK(names == std::vector<std::string>{"ck"});
  CHECK(pdo_test::equal(pdo::io::read<float, 2>(tmp.path / "ck", "x"), pdo::gather(y)));
  CHECK_FALSE(pdo_test::equal(pdo::io::read<float, 2>(tmp.path / "ck", "x"), first));

  // two threads saving into one folder at once take turns: each save whole, one checkpoint after
  {
    auto h1 = pdo_test::random_tensor<double, 2>({200, 100}, 3), h2 = pdo_test::random_tensor<double, 2>({200, 100}, 4);
    pdo::io::checkpoint k1, k2;
    k1.add("h", h1);
    k2.add("h", h2);
    std::string failed;
    std::mutex lock;
    auto saves = [&](const pdo::io::checkpoint& k) {
      for (int round = 0; round < 5; ++round) try {
          pdo::io::save(tmp.path / "both", k);
        } catch (const std::exception& e) {
          std::lock_guard guard(lock);
          failed = e.what();
        }
    };
    std::thread other(saves, std::cref(k2));
    saves(k1);
    other.join();
    CHECK(failed == std::string());
    const auto kept = pdo::io::read<double, 2>(tmp.path / "both", "h");
    CHECK((pdo_test::equal(kept, h1) || pdo_test::equal(kept, h2)));
    fs::remove_all(tmp.path / "both");
  }

  // an unfinished save (only the staging directory) is not a checkpoint
  fs::rename(tmp.path / "ck", tmp.path / "gone.partial");
  pdo::io::checkpoint back;
  auto z = pdo::tensor<float, 2>({6, 4});
  back.add("x", z);
  const std::string e = load_error(tmp.path / "gone", back);
  CHECK_THAT(e, Catch::Contains("metadata.json: missing") && Catch::Contains("gone.partial is an unfinished save"));
}

TEST_CASE("checkpoints: a save replaces only a checkpoint; a failed save or load changes nothing; numbers and text kept exactly") {
  scratch_dir tmp("only");
  auto t = pdo_test::random_tensor<float, 2>({3, 4}, 3);
  pdo::io::checkpoint c;
  c.add("t", t);
  auto save_error = [&](const fs::path& dir, const pdo::io::checkpoint& ck) -> std::string {
    try {
      pdo::io::save(dir, ck);
    } catch (const pdo::io_error& e) {
      return e.what();
    }
    return "no error";
  };
  auto listing = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::recursive_directory_iterator(tmp.path)) names.push_back(fs::relative(e.path(), tmp.path).string());
    std::sort(names.begin(), names.end());
    return names;
  };

  // a folder of other files, and a file, are left as they are
  fs::create_directories(tmp.path / "results");
  std::ofstream(tmp.path / "results" / "log.txt") << "keep me";
  CHECK_THAT(save_error(tmp.path / "results", c), Catch::Contains("results is a directory that holds no pdo checkpoint"));
  std::ofstream(tmp.path / "model.ckpt") << "keep me too";
  CHECK_THAT(save_error(tmp.path / "model.ckpt", c), Catch::Contains("model.ckpt exists and is not a directory"));
  CHECK_THAT(save_error(tmp.path / "model.ckpt" / "inner", c), Catch::Contains("io: save"));
  CHECK_THAT(save_error("", c), Catch::Contains("the checkpoint's path is empty"));
  CHECK(listing() == std::vector<std::string>{"model.ckpt", "results", "results/log.txt"});
  // an empty folder, or a checkpoint, is replaced
  fs::create_directories(tmp.path / "empty");
  pdo::io::save(tmp.path / "empty", c);
  pdo::io::save(tmp.path / "empty", c);
  CHECK(pdo_test::equal(pdo::io::read<float, 2>(tmp.path / "empty", "t"), t));
  // a path with a trailing separator names the same checkpoint
  pdo::io::save((tmp.path / "slash").string() + "/", c);
  CHECK(pdo_test::equal(pdo::io::read<float, 2>(tmp.path / "slash", "t"), t));
  fs::remove_all(tmp.path / "slash");

  // text that is not UTF-8 is an error naming the entry, before anything replaces the old checkpoint
  std::string bytes = "ok\xff\xfe";
  pdo::io::checkpoint with_bytes;
  with_bytes.add("t", t).add("loader", bytes);
  CHECK_THAT(save_error(tmp.path / "empty", with_bytes), Catch::Contains("\"loader\"") && Catch::Contains("not valid UTF-8"));
  CHECK(fs::exists(tmp.path / "empty" / "metadata.json"));
  CHECK_FALSE(fs::exists(tmp.path / "empty.partial"));

  // infinities and NaN round-trip; the other numbers exactly
  double inf = std::numeric_limits<double>::infinity(), ninf = -inf, nan = std::nan(""), tenth = 0.1;
  float finf = std::numeric_limits<float>::infinity();
  std::int64_t low = std::numeric_limits<std::int64_t>::min();
  std::uint64_t high = std::numeric_limits<std::uint64_t>::max();
  pdo::io::checkpoint numbers;
  numbers.add("inf", inf).add("ninf", ninf).add("nan", nan).add("tenth", tenth).add("finf", finf).add("low", low).add("high", high);
  pdo::io::save(tmp.path / "numbers", numbers);
  double inf2 = 0, ninf2 = 0, nan2 = 0, tenth2 = 0;
  float finf2 = 0;
  std::int64_t low2 = 0;
  std::uint64_t high2 = 0;
  pdo::io::checkpoint numbers2;
  numbers2.add("inf", inf2).add("ninf", ninf2).add("nan", nan2).add("tenth", tenth2).add("finf", finf2).add("low", low2).add("high", high2);
  pdo::io::load(tmp.path / "numbers", numbers2);
  CHECK((inf2 == inf && ninf2 == ninf && std::isnan(nan2) && tenth2 == tenth && finf2 == finf && low2 == low && high2 == high));
  // a number the type cannot hold is an error naming the entry
  int small = 0;
  pdo::io::checkpoint narrow;
  narrow.add("tenth", small);
  CHECK_THAT(load_error(tmp.path / "numbers", narrow), Catch::Contains("\"tenth\"") && Catch::Contains("float64"));
  // a float32 number beyond float's range in the metadata is not rounded to an infinity
  {
    nlohmann::json meta = nlohmann::json::parse(std::ifstream(tmp.path / "numbers" / "metadata.json"));
    meta["entries"]["finf"]["value"] = 1e300;
    write_metadata(tmp.path / "numbers", meta);
    float huge = 0;
    pdo::io::checkpoint one;
    one.add("finf", huge);
    CHECK_THAT(load_error(tmp.path / "numbers", one), Catch::Contains("\"finf\"") && Catch::Contains("1e+300, not a float32"));
    meta["entries"]["finf"]["value"] = -3.5e38;
    write_metadata(tmp.path / "numbers", meta);
    CHECK_THAT(load_error(tmp.path / "numbers", one), Catch::Contains("not a float32"));
    meta["entries"]["finf"]["value"] = 3.4e38;  // within float's range: loads
    write_metadata(tmp.path / "numbers", meta);
    pdo::io::load(tmp.path / "numbers", one);
    CHECK(huge == 3.4e38f);
  }

  // a load that finds an entry of another shape loads none of the entries
  auto a = pdo_test::random_tensor<float, 2>({3, 4}, 4);
  auto b = pdo::tensor<float, 1>({5});
  pdo::io::checkpoint two;
  two.add("a", a).add("b", b);
  pdo::io::save(tmp.path / "two", two);
  auto a2 = pdo::tensor<float, 2>({3, 4});
  a2.fill(7);
  auto b2 = pdo::tensor<float, 1>({6});
  double missing = 1.5;
  pdo::io::checkpoint other;
  other.add("a", a2).add("b", b2);
  CHECK_THAT(load_error(tmp.path / "two", other), Catch::Contains("\"b\"") && Catch::Contains("[5]") && Catch::Contains("[6]"));
  pdo::io::checkpoint more;
  more.add("a", a2).add("step", missing);
  CHECK_THAT(load_error(tmp.path / "two", more), Catch::Contains("no entry named \"step\""));
  CHECK(a2(2, 3) == 7.0f);
  CHECK(missing == 1.5);

  // a block's file outside the checkpoint's folder is named as such
  nlohmann::json meta = nlohmann::json::parse(std::ifstream(tmp.path / "two" / "metadata.json"));
  meta["entries"]["a"]["blocks"][0]["file"] = "../numbers/t0.bin";
  write_metadata(tmp.path / "two", meta);
  pdo::io::checkpoint just_a;
  just_a.add("a", a2);
  CHECK_THAT(load_error(tmp.path / "two", just_a), Catch::Contains("names the file \"../numbers/t0.bin\", which is not a file of the checkpoint"));
}

TEST_CASE("checkpoints: add_blocks whose blocks overlap, leave a gap or fail is refused at the save, which leaves nothing") {
  scratch_dir tmp("blocks");
  const auto m = pdo::make_mesh<"x">(pdo::cpu_places(3));
  std::vector<std::vector<double>> held(3, std::vector<double>(12, 1.0));
  // rows of a [6, 2] tensor: place p holds rows given by `rows(p)` = {first, count}
  auto save_rows = [&](auto rows, bool throws_on_1 = false) -> std::string {
    pdo::io::checkpoint c;
    c.add_blocks<double, 2>("o", m, {6, 2}, [&](std::size_t p) -> pdo::io::held_block<double> {
      if (throws_on_1 && p == 1) throw pdo::error("block 1 unavailable");
      const auto [first, count] = rows(p);
      return {{first, 0}, {count, 2}, held[p].data(), true};
    });
    try {
      pdo::io::save(tmp.path / "o", c);
    } catch (const pdo::io_error& e) {
      CHECK_FALSE(fs::exists(tmp.path / "o"));
      CHECK_FALSE(fs::exists(tmp.path / "o.partial"));
      return e.what();
    }
    return "no error";
  };
  using rows_t = std::pair<std::size_t, std::size_t>;
  // places 0 and 1 both write rows 2..3
  CHECK_THAT(save_rows([](std::size_t p) { return p == 0 ? rows_t{0, 4} : p == 1 ? rows_t{2, 2} : rows_t{4, 2}; }),
             Catch::Contains("\"o\": add_blocks: the blocks of places cpu:0 (offset [0, 0], shape [4, 2]) and cpu:1 (offset [2, 0], "
                             "shape [2, 2]) overlap"));
  // nobody writes rows 4..5
  CHECK_THAT(save_rows([](std::size_t p) { return p == 2 ? rows_t{4, 0} : rows_t{2 * p, 2}; }),
             Catch::Contains("\"o\": add_blocks: the places write blocks of 8 elements, its shape [6, 2] holds 12"));
  // the block function's own error, as an io_error naming the entry and the place
  CHECK_THAT(save_rows([](std::size_t p) { return rows_t{2 * p, 2}; }, true),
             Catch::Contains("\"o\": add_blocks' block function failed on place cpu:1: block 1 unavailable"));
  // rows cut 2, 2, 2: saved, and read back whole
  CHECK(save_rows([](std::size_t p) { return rows_t{2 * p, 2}; }) == "no error");
  const auto whole = pdo::io::read<double, 2>(tmp.path / "o", "o");
  CHECK(whole.shape() == pdo::shape_t<2>{6, 2});
  CHECK(std::all_of(whole.begin(), whole.end(), [](double v) { return v == 1.0; }));
}

TEST_CASE("checkpoints: corrupt, truncated, missing and mismatched files are io_errors naming the file and the tensor") {
  scratch_dir tmp("corrupt");
  const auto mesh = pdo_test::line_mesh(2);
  const auto host = pdo_test::random_tensor<float, 2>({40, 30}, 5);
  auto x = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, host);
  pdo::io::checkpoint c;
  c.add("weights", x);
  const fs::path good = tmp.path / "good";
  pdo::io::save(good, c, {.chunk_bytes = 256});
  auto fresh = [&](const std::string& name) {
    const fs::path dir = tmp.path / name;
    fs::copy(good, dir);
    return dir;
  };
  auto y = pdo::distribute<pdo::layout<replicate, split<"x">>>(pdo_test::line_mesh(3), pdo::tensor<float, 2>({40, 30}));
  pdo::io::checkpoint into;
  into.add("weights", y);

  SECTION("a flipped byte in the data") {
    const auto dir = fresh("flipped");
    flip_byte(dir / "t0.p1.bin", 10);
    const auto e = load_error(dir, into);
    CHECK_THAT(e, Catch::Contains("t0.p1.bin") && Catch::Contains("\"weights\"") && Catch::Contains("corrupt") &&
                      Catch::Contains("do not match their checksum"));
  }
  SECTION("a flipped byte in each field of a shard's header") {
    // bytes 16 to 63: the data's size, the chunk size, the block's identity, the checksum, reserved
    for (const std::size_t at : {16, 17, 20, 21, 24, 25, 32, 40, 48, 56}) {
      const auto dir = fresh("header" + std::to_string(at));
      flip_byte(dir / "t0.p0.bin", fs::file_size(dir / "t0.p0.bin") - at);
      const auto e = load_error(dir, into);
      INFO("byte " << at << ": " << e);
      CHECK_THAT(e, Catch::Contains("t0.p0.bin") && Catch::Contains("\"weights\"") && Catch::Contains("corrupt"));
      CHECK_THAT(e, !Catch::Contains("metadata does not match"));
    }
    // a shard whose chunk checksums pass its first 4096 bytes (625 chunks of 64 bytes): a
    // damaged chunk size must not move where its data is read from unchecked
    const fs::path many = tmp.path / "many";
    pdo::tensor<float, 1> big({10000});
    pdo::io::checkpoint out;
    out.add("big", big);
    pdo::io::save(many, out, {.chunk_bytes = 64});
    for (const std::size_t at : {24, 25, 26}) {
      const fs::path dir = tmp.path / ("many" + std::to_string(at));
      fs::copy(many, dir);
      flip_byte(dir / "t0.bin", fs::file_size(dir / "t0.bin") - at);
      pdo::tensor<float, 1> back({10000});
      pdo::io::checkpoint in;
      in.add("big", back);
      const auto e = load_error(dir, in);
      INFO("byte " << at << ": " << e);
      CHECK_THAT(e, Catch::Contains("t0.bin") && Catch::Contains("corrupt"));
      CHECK_THAT(e, !Catch::Contains("metadata does not match") && !Catch::Contains("truncated"));
    }
  }
  SECTION("a corrupt shard ends the load: the entries after it are left as they were") {
    const fs::path dir = tmp.path / "order";
    pdo::tensor<double, 1> a({4}), b({4});
    for (std::size_t i = 0; i < 4; ++i) a(i) = static_cast<double>(i + 1), b(i) = static_cast<double>(i + 5);
    pdo::io::checkpoint out;
    out.add("a", a);
    out.add("b", b);
    pdo::io::save(dir, out);
    flip_byte(dir / "t0.bin", 1);  // the last byte of a's data
    pdo::tensor<double, 1> a2({4}), b2({4});
    a2.fill(-1);
    b2.fill(-1);
    pdo::io::checkpoint in;
    in.add("a", a2);
    in.add("b", b2);
    CHECK_THAT(load_error(dir, in), Catch::Contains("t0.bin") && Catch::Contains("\"a\"") && Catch::Contains("corrupt"));
    for (std::size_t i = 0; i < 4; ++i) CHECK(b2(i) == -1);
  }
  SECTION("a truncated shard") {
    const auto dir = fresh("truncated");
    fs::resize_file(dir / "t0.p0.bin", fs::file_size(dir / "t0.p0.bin") - 100);
    CHECK_THAT(load_error(dir, into), Catch::Contains("t0.p0.bin") && Catch::Contains("\"weights\"") && Catch::Contains("truncated"));
  }
  SECTION("a missing shard") {
    const auto dir = fresh("missing");
    fs::remove(dir / "t0.p1.bin");
    CHECK_THAT(load_error(dir, into), Catch::Contains("t0.p1.bin (tensor \"weights\", block at [20, 0]): cannot open it to read"));
  }
  SECTION("shard files swapped: the metadata does not match them") {
    const auto dir = fresh("swapped");
    fs::rename(dir / "t0.p0.bin", dir / "tmp");
    fs::rename(dir / "t0.p1.bin", dir / "t0.p0.bin");
    fs::rename(dir / "tmp", dir / "t0.p1.bin");
    CHECK_THAT(load_error(dir, into), Catch::Contains("metadata does not match the shard"));
  }
  SECTION("a shard file copied in from another save of the same tensor") {
    // the same names, offsets and sizes: only the save's identity tells them apart
    const fs::path later = tmp.path / "later";
    auto x2 = pdo::eval(x * 100.0f);
    pdo::io::checkpoint c2;
    c2.add("weights", x2);
    pdo::io::save(later, c2, {.chunk_bytes = 256});
    const auto dir = fresh("mixed");
    fs::copy_file(later / "t0.p1.bin", dir / "t0.p1.bin", fs::copy_options::overwrite_existing);
    CHECK_THAT(load_error(dir, into), Catch::Contains("t0.p1.bin") && Catch::Contains("\"weights\"") &&
                                          Catch::Contains("metadata does not match the shard: the file was written by another save"));
    CHECK_THROWS_WITH((pdo::io::read<float, 2>(dir, "weights")), Catch::Contains("written by another save"));
    // every save has its own identity, in the metadata and in each shard
    nlohmann::json m1 = nlohmann::json::parse(std::ifstream(good / "metadata.json"));
    nlohmann::json m2 = nlohmann::json::parse(std::ifstream(later / "metadata.json"));
    REQUIRE(m1.contains("save"));
    CHECK(m1["save"].get<std::string>().size() == 16);
    CHECK(m1["save"] != m2["save"]);
    // the metadata's identity damaged, or not one
    const auto damaged = fresh("badsave");
    m1["save"] = "00000000000000zz";
    write_metadata(damaged, m1);
    CHECK_THAT(load_error(damaged, into), Catch::Contains("metadata.json: its \"save\" is \"00000000000000zz\", not a save's identity"));
    // a checkpoint whose metadata names no save (written before pdo recorded it) checks
    // its shards as before: these, written with an identity, are then from another save
    m1.erase("save");
    write_metadata(damaged, m1);
    CHECK_THAT(load_error(damaged, into), Catch::Contains("written by another save") && Catch::Contains("not recorded"));
  }
  SECTION("the metadata damaged: every digit or letter changed is refused; its layout of spaces is not content") {
    const auto dir = fresh("metasum");
    std::string text;
    {
      std::ifstream in(good / "metadata.json");
      text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    REQUIRE(nlohmann::json::parse(text).contains("checksum"));
    std::size_t changed = 0;
    for (std::size_t i = 0; i < text.size(); ++i) {
      const char ch = text[i];
      const bool digit = ch >= '0' && ch <= '9', letter = ch >= 'a' && ch <= 'z';
      if (!digit && !letter) continue;
      std::string damaged = text;
      damaged[i] = digit ? static_cast<char>('0' + (ch - '0' + 1) % 10) : (ch == 'z' ? 'a' : static_cast<char>(ch + 1));
      std::ofstream(dir / "metadata.json") << damaged;
      INFO("byte " << i << " changed from " << ch << " to " << damaged[i]);
      CHECK_THAT(load_error(dir, into), Catch::Contains("metadata.json"));
      ++changed;
    }
    CHECK(changed > 100);
    // a number of the content changed: named as a damaged file
    auto meta = nlohmann::ordered_json::parse(text);
    meta["entries"]["weights"]["blocks"][1]["offset"][0] = 21;
    std::ofstream(dir / "metadata.json") << meta.dump(1);
    CHECK_THAT(load_error(dir, into), Catch::Contains("metadata.json: corrupt: its content does not match its checksum"));
    // a key that pdo does not write
    meta = nlohmann::ordered_json::parse(text);
    meta["note"] = "mine";
    std::ofstream(dir / "metadata.json") << meta.dump(1);
    CHECK_THAT(load_error(dir, into), Catch::Contains("metadata.json: corrupt: it holds the key \"note\""));
    // spaces and line breaks are not content; nor is a missing checksum (an older pdo's checkpoint)
    for (const bool keep : {true, false}) {
      meta = nlohmann::ordered_json::parse(text);
      if (!keep) meta.erase("checksum");
      std::ofstream(dir / "metadata.json") << meta.dump(4);
      y = pdo::distribute<pdo::layout<replicate, split<"x">>>(pdo_test::line_mesh(3), pdo::tensor<float, 2>({40, 30}));
      REQUIRE(!pdo_test::equal(pdo::gather(y), host));
      pdo::io::load(dir, into);
      CHECK(pdo_test::equal(pdo::gather(y), host));
    }
  }
  SECTION("blocks in the metadata that overlap, hiding a gap from the count of covered elements") {
    const fs::path three = tmp.path / "three";
    pdo::io::checkpoint c3;
    auto x3 = pdo::distribute<pdo::layout<split<"x">, replicate>>(pdo_test::line_mesh(3), host);
    c3.add("weights", x3);
    pdo::io::save(three, c3);
    nlohmann::json meta = nlohmann::json::parse(std::ifstream(three / "metadata.json"));
    auto& blocks = meta["entries"]["weights"]["blocks"];  // rows [0, 14), [14, 27), [27, 40)
    REQUIRE(blocks.size() == 3);
    blocks[1] = blocks[2];  // rows 14 to 26 described by none, 27 to 39 twice: as many elements as before
    write_metadata(three, meta);
    CHECK_THAT(load_error(three, into), Catch::Contains("\"weights\"") && Catch::Contains("overlap: the metadata does not match the shards"));
    CHECK_THROWS_WITH((pdo::io::read<float, 2>(three, "weights")), Catch::Contains("overlap"));
  }
  SECTION("an element type changed in the metadata to another of the same size") {
    const auto dir = fresh("dtype");
    nlohmann::json meta = nlohmann::json::parse(std::ifstream(dir / "metadata.json"));
    meta["entries"]["weights"]["dtype"] = "int32";
    write_metadata(dir, meta);
    CHECK_THROWS_WITH((pdo::io::read<std::int32_t, 2>(dir, "weights")),
                      Catch::Contains("metadata does not match the shard: the file holds elements of another type than int32"));
  }
  SECTION("metadata that is not JSON, or not a checkpoint's") {
    const auto dir = fresh("badmeta");
    std::ofstream(dir / "metadata.json") << "{\"format\": \"pdo-checkpoint\", ";
    CHECK_THAT(load_error(dir, into), Catch::Contains("metadata.json: not valid JSON"));
    std::ofstream(dir / "metadata.json") << "{\"format\": \"other\"}";
    CHECK_THAT(load_error(dir, into), Catch::Contains("not the metadata of a pdo checkpoint"));
    std::ofstream(dir / "metadata.json") << "{\"format\": 5, \"version\": 1, \"entries\": {}}";
    CHECK_THAT(load_error(dir, into), Catch::Contains("metadata.json: not the metadata of a pdo checkpoint"));
    std::ofstream(dir / "metadata.json") << "{\"format\": \"pdo-checkpoint\", \"version\": \"1\", \"entries\": {}}";
    CHECK_THAT(load_error(dir, into), Catch::Contains("metadata.json: checkpoint format version \"1\""));
  }
  SECTION("a block's shape in the metadata past the tensor's, or too large to count") {
    const auto dir = fresh("bigblock");
    nlohmann::json meta = nlohmann::json::parse(std::ifstream(dir / "metadata.json"));
    meta["entries"]["weights"]["blocks"][0]["shape"] = {std::uint64_t{1} << 62, 30};
    write_metadata(dir, meta);
    CHECK_THAT(load_error(dir, into), Catch::Contains("\"weights\"") && Catch::Contains("does not fit its shape [40, 30]"));
  }
  SECTION("a global shape in the metadata larger than its blocks: io::read names it before allocating") {
    const auto dir = fresh("bigshape");
    nlohmann::json meta = nlohmann::json::parse(std::ifstream(dir / "metadata.json"));
    for (std::uint64_t rows : {std::uint64_t{1000000000000000000}, std::uint64_t{100000000000}, std::uint64_t{41}}) {
      meta["entries"]["weights"]["shape"] = {rows, 30};
      write_metadata(dir, meta);
      INFO(rows << " rows");
      const std::string shape = "metadata.json: tensor \"weights\": its shape [" + std::to_string(rows) + ", 30]";
      CHECK_THROWS_AS((pdo::io::read<float, 2>(dir, "weights")), pdo::io_error);
      CHECK_THROWS_WITH((pdo::io::read<float, 2>(dir, "weights")),
                        Catch::Contains(shape) && Catch::Contains("its blocks only 1200") && Catch::Contains("does not match the shards"));
      CHECK_THROWS_WITH((pdo::io::read<float, 2, pdo::layout<split<"x">, replicate>>(dir, "weights", mesh)),
                        Catch::Contains(shape) && Catch::Contains("its blocks only 1200"));
    }
  }
  SECTION("another global shape, another element type, another name") {
    auto wrong_shape = pdo::tensor<float, 2>({30, 40});
    pdo::io::checkpoint a;
    a.add("weights", wrong_shape);
    CHECK_THAT(load_error(good, a), Catch::Contains("\"weights\"") && Catch::Contains("global shape is [40, 30]") && Catch::Contains("[30, 40]"));
    auto wrong_type = pdo::tensor<double, 2>({40, 30});
    pdo::io::checkpoint b;
    b.add("weights", wrong_type);
    CHECK_THAT(load_error(good, b), Catch::Contains("float32 elements") && Catch::Contains("float64"));
    pdo::io::checkpoint d;
    d.add("weight", wrong_type);
    CHECK_THAT(load_error(good, d), Catch::Contains("no entry named \"weight\" (it holds: weights)"));
    // of many entries, the first 16 are named, then how many there are
    std::vector<std::int64_t> numbers(20);
    pdo::io::checkpoint many;
    for (std::size_t i = 0; i < numbers.size(); ++i) many.add("n" + std::to_string(i), numbers[i]);
    pdo::io::save(tmp.path / "many", many);
    pdo::io::checkpoint one;
    one.add("n20", numbers[0]);
    CHECK_THAT(load_error(tmp.path / "many", one),
               Catch::Contains("no entry named \"n20\" (it holds: n0, n1, n2,") && Catch::Contains(", n15, ... (20 in all))"));
  }
  SECTION("the good one loads") {
    pdo::io::load(good, into);
    CHECK(pdo_test::equal(pdo::gather(y), host));
  }
}

TEST_CASE("npy and safetensors: round trips, and bad files") {
  scratch_dir tmp("formats");
  const auto a = pdo_test::random_tensor<double, 3>({2, 3, 4}, 8);
  pdo::io::save_npy(tmp.path / "a.npy", a);
  CHECK(pdo_test::equal(pdo::io::load_npy<double, 3>(tmp.path / "a.npy"), a));
  const auto v = pdo_test::random_tensor<std::int64_t, 1>({5}, 9);
  pdo::io::save_npy(tmp.path / "v.npy", v);
  CHECK(pdo_test::equal(pdo::io::load_npy<std::int64_t, 1>(tmp.path / "v.npy"), v));
  CHECK_THROWS_WITH((pdo::io::load_npy<float, 3>(tmp.path / "a.npy")), Catch::Contains("'<f8'") && Catch::Contains("'<f4'"));
  CHECK_THROWS_WITH((pdo::io::load_npy<double, 2>(tmp.path / "a.npy")), Catch::Contains("rank 3 [2, 3, 4]"));
  fs::resize_file(tmp.path / "a.npy", fs::file_size(tmp.path / "a.npy") - 8);
  CHECK_THROWS_WITH((pdo::io::load_npy<double, 3>(tmp.path / "a.npy")), Catch::Contains("a.npy") && Catch::Contains("truncated"));
  // a header that claims a shape far beyond the file is an io_error before anything is allocated
  write_npy_v1(tmp.path / "huge.npy", "{'descr': '<f8', 'fortran_order': False, 'shape': (100000000000000, 3), }", 48);
  CHECK_THROWS_AS((pdo::io::load_npy<double, 2>(tmp.path / "huge.npy")), pdo::io_error);
  CHECK_THROWS_WITH((pdo::io::load_npy<double, 2>(tmp.path / "huge.npy")), Catch::Contains("huge.npy") && Catch::Contains("damaged header"));
  // an extent past 2^64 (2^64 + 3) is not wrapped around to a small one
  write_npy_v1(tmp.path / "wrap.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (18446744073709551619, 4), }", 48);
  CHECK_THROWS_WITH((pdo::io::load_npy<float, 2>(tmp.path / "wrap.npy")), Catch::Contains("wrap.npy") && Catch::Contains("too large to count"));
  // a save that fails leaves no temporary file behind
  {  // a version-2 header whose length field claims 4 GiB: refused before anything is allocated
    std::string bytes = std::string("\x93NUMPY\x02\x00", 8) + std::string("\xf0\xff\xff\xff", 4) + "{'descr': '<f4'";
    std::ofstream(tmp.path / "v2huge.npy", std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    CHECK_THROWS_WITH((pdo::io::load_npy<float, 2>(tmp.path / "v2huge.npy")),
                      Catch::Contains("v2huge.npy") && Catch::Contains("header claims 4294967280 bytes") && Catch::Contains("has 27 bytes"));
  }
  fs::create_directories(tmp.path / "adir.npy");
  CHECK_THROWS_AS(pdo::io::save_npy(tmp.path / "adir.npy", a), pdo::io_error);
  CHECK_FALSE(fs::exists(tmp.path / "adir.npy.partial"));

  pdo::io::safetensors_writer w;
  w.add("a", a).add("v", v).metadata("format", "pt");
  w.write(tmp.path / "m.safetensors");
  const pdo::io::safetensors_reader r(tmp.path / "m.safetensors");
  CHECK(r.names() == std::vector<std::string>{"a", "v"});
  CHECK(r.metadata().at("format") == "pt");
  CHECK(pdo_test::equal(r.get<double, 3>("a"), a));
  CHECK(pdo_test::equal(r.get<std::int64_t, 1>("v"), v));
  CHECK_THROWS_WITH((r.get<float, 3>("a")), Catch::Contains("F64") && Catch::Contains("F32"));
  CHECK_THROWS_WITH((r.get<double, 3>("b")), Catch::Contains("no tensor named \"b\" (it holds: a, v)"));
  {  // a conversion keeps every value or fails, naming the element
    pdo::tensor<std::int64_t, 1> ints({4}, {5, -100, 300, -2});
    pdo::tensor<double, 1> reals({4}, {1.75, -2.5, 1e300, 3});
    pdo::tensor<double, 1> nan_at_2({3}, {0, 1, std::nan("")});
    pdo::tensor<double, 1> fits({3}, {127.9, -128.9, 0.5});
    pdo::io::safetensors_writer cw;
    cw.add("ints", ints).add("reals", reals).add("nan", nan_at_2).add("fits", fits);
    cw.write(tmp.path / "convert.safetensors");
    const pdo::io::safetensors_reader cr(tmp.path / "convert.safetensors");
    CHECK_THROWS_WITH((cr.get<std::int8_t, 1>("ints", true)),
                      Catch::Contains("convert.safetensors") && Catch::Contains("\"ints\"") && Catch::Contains("element 2 is 300, which I8 cannot hold"));
    CHECK(pdo_test::equal(cr.get<std::int16_t, 1>("ints", true), pdo::tensor<std::int16_t, 1>({4}, {5, -100, 300, -2})));
    CHECK_THROWS_WITH((cr.get<std::uint8_t, 1>("ints", true)), Catch::Contains("element 1 is -100, which U8 cannot hold"));
    CHECK_THROWS_WITH((cr.get<std::int32_t, 1>("reals", true)), Catch::Contains("element 2 is 1e+300, which I32 cannot hold (converting F64 to I32)"));
    CHECK_THROWS_WITH((cr.get<std::int64_t, 1>("nan", true)), Catch::Contains("element 2 is nan, which I64 cannot hold"));
    CHECK(pdo_test::equal(cr.get<std::int8_t, 1>("fits", true), pdo::tensor<std::int8_t, 1>({3}, {127, -128, 0})));
    const auto as_float = cr.get<float, 1>("reals", true);  // F64 to F32 rounds, as C++ converts
    CHECK((as_float(0) == 1.75f && as_float(1) == -2.5f && std::isinf(as_float(2)) && as_float(3) == 3.0f));
  }
  {  // a file that also holds types pdo does not read (a PyTorch half-precision tensor): the
     // others read as usual; reading one of those says what it is
    const std::uint16_t halves[6] = {0x3c00, 0x4000, 0x4200, 0x4400, 0x4500, 0x4600};
    const std::uint8_t flags[3] = {1, 0, 1};
    pdo::io::safetensors_writer mixed;
    mixed.add("v", v).add_raw("half", "F16", {2, 3}, halves, sizeof(halves)).add_raw("mask", "BOOL", {3}, flags, sizeof(flags));
    mixed.write(tmp.path / "mixed.safetensors");
    const pdo::io::safetensors_reader mr(tmp.path / "mixed.safetensors");
    CHECK(mr.names() == std::vector<std::string>{"half", "mask", "v"});
    CHECK(mr.entry("half").shape == std::vector<std::size_t>{2, 3});
    CHECK(pdo_test::equal(mr.get<std::int64_t, 1>("v"), v));
    CHECK_THROWS_WITH((mr.get<float, 2>("half", true)),
                      Catch::Contains("mixed.safetensors: \"half\" has type F16, which pdo does not read") &&
                          Catch::Contains("the file's other tensors can be read"));
    std::vector<std::uint8_t> out(3);
    CHECK_THROWS_WITH(mr.read_into("mask", out.data(), out.size()), Catch::Contains("\"mask\" has type BOOL"));
    // bytes that are not the shape's, and a name that is no type, are refused when added
    CHECK_THROWS_WITH(pdo::io::safetensors_writer().add_raw("t", "F32", {3, 2}, halves, 16),
                      Catch::Contains("\"t\": 16 bytes given, its shape F32[3, 2] needs 24"));
    CHECK_THROWS_WITH(pdo::io::safetensors_writer().add_raw("t", "F33", {1}, halves, 4), Catch::Contains("F33 is not a safetensors type"));
    // extents no tensor can address: an io_error naming the tensor, not a shape error of another op
    CHECK_THROWS_AS(pdo::io::safetensors_writer().add_raw("t", "F32", {std::size_t{1} << 40, std::size_t{1} << 40}, halves, 16), pdo::io_error);
    CHECK_THROWS_WITH(pdo::io::safetensors_writer().add_raw("t", "F32", {std::size_t{1} << 40, std::size_t{1} << 40}, halves, 16),
                      Catch::Contains("io: safetensors: \"t\": extents [1099511627776, 1099511627776]"));
  }
  fs::resize_file(tmp.path / "m.safetensors", fs::file_size(tmp.path / "m.safetensors") - 1);
  CHECK_THROWS_WITH(pdo::io::safetensors_reader(tmp.path / "m.safetensors"), Catch::Contains("truncated"));

  // headers that lie: an io_error naming the file and the tensor, for each
  auto with_header = [&](const std::string& header) {
    const fs::path path = tmp.path / "bad.safetensors";
    std::ofstream f(path, std::ios::binary);
    const std::uint64_t n = header.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << header << std::string(64, '\0');
    f.close();
    try {
      pdo::io::safetensors_reader bad(path);
    } catch (const pdo::io_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(with_header(R"({"t": {"dtype": "F32", "shape": [-3, 4], "data_offsets": [0, 48]}})"),
             Catch::Contains("bad.safetensors") && Catch::Contains("\"t\"") && Catch::Contains("[-3,4]") && Catch::Contains("not a whole number"));
  CHECK_THAT(with_header(R"({"t": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 16]}})"),
             Catch::Contains("bad.safetensors: not a valid safetensors file: \"t\": extents [4611686018427387904, 4] hold"));
  CHECK_THAT(with_header(R"({"t": {"dtype": "F32", "shape": [4, 2], "data_offsets": [18446744073709551600, 32]}})"),
             Catch::Contains("bad.safetensors") && Catch::Contains("end before they begin"));
  CHECK_THAT(with_header(R"({"t": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, -32]}})"),
             Catch::Contains("bad.safetensors") && Catch::Contains("not a pair of whole numbers"));
  CHECK_THAT(with_header(R"({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}})"), Catch::Equals("no error"));
}

TEST_CASE("safetensors: a model's parameters by name, local and tensor-parallel") {
  scratch_dir tmp("model");
  pdo::nn::rng gen(1);
  const pdo::nn::sequential model(pdo::nn::linear<double>(4, 3, gen), pdo::nn::relu{}, pdo::nn::linear<double>(3, 2, gen));
  pdo::io::save_parameters<double>(tmp.path / "model.safetensors", model);
  pdo::nn::rng other(2);
  pdo::nn::sequential copy(pdo::nn::linear<double>(4, 3, other), pdo::nn::relu{}, pdo::nn::linear<double>(3, 2, other));
  pdo::io::load_parameters<double>(copy, tmp.path / "model.safetensors");
  const auto p = pdo::nn::parameters_of<double>(model), q = pdo::nn::parameters_of<double>(copy);
  REQUIRE(p.size() == q.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    CHECK(p[i].name() == q[i].name());
    CHECK(std::equal(p[i].value().begin(), p[i].value().end(), q[i].value().begin()));
  }
  // a float32 file loads into a double model; a missing name and another shape are named
  const pdo::io::safetensors_reader r(tmp.path / "model.safetensors");
  pdo::io::safetensors_writer f32;
  for (const auto& name : r.names()) {
    const auto& e = r.entry(name);
    std::vector<double> d(e.shape.size() == 2 ? e.shape[0] * e.shape[1] : e.shape[0]);
    r.read_into(name, d.data(), d.size());
    std::vector<float> f(d.begin(), d.end());
    f32.add_raw(name, "F32", e.shape, f.data(), f.size() * 4);
  }
  f32.write(tmp.path / "f32.safetensors");
  pdo::io::load_parameters<double>(copy, tmp.path / "f32.safetensors");
  CHECK(static_cast<float>(q[0].value()[1]) == static_cast<float>(p[0].value()[1]));
  pdo::nn::sequential wider(pdo::nn::linear<double>(4, 5, other), pdo::nn::relu{}, pdo::nn::linear<double>(5, 2, other));
  CHECK_THROWS_WITH(pdo::io::load_parameters<double>(wider, tmp.path / "model.safetensors"),
                    Catch::Contains("\"0.weight\" is F64[4, 3]") && Catch::Contains("f64[4, 5]"));
  CHECK_THROWS_WITH(pdo::io::load_parameters<double>(model, tmp.path / "model.safetensors", "encoder."),
                    Catch::Contains("no tensor named \"encoder.0.weight\""));
}

namespace {

/// @brief A data-parallel trainer of make_mlp with Adam on `places` places; `reversed`: the
/// optimizer lists what it is given (parameters, or ZeRO-1's slices) in reverse.
auto make_trainer(std::size_t places, unsigned seed_shift = 0, bool zero1 = false, bool reversed = false) {
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(places));
  return pdo::nn::make_data_parallel<double>(
      m,
      [seed_shift] {
        auto model = pdo_test::make_mlp();
        if (seed_shift != 0)  // another start, which the checkpoint overwrites
          for (const auto& p : pdo::nn::parameters_of<double>(model))
            for (auto& v : p.value()) v += 0.25 * seed_shift;
        return model;
      },
      [reversed](auto params) {
        if (reversed) std::reverse(params.begin(), params.end());
        return pdo::nn::adam<double>(std::move(params), {.lr = 0.01});
      },
      {.bucket_bytes = 256, .zero1 = zero1});
}

/// @brief The losses of steps [from, to) on batches of the fixed data set (batch s: rows s*5..s*5+12 mod 40).
template <class Trainer>
std::vector<double> train(Trainer& t, int from, int to) {
  const auto x = pdo_test::random_tensor<double, 2>({40, 6}, 31);
  const auto y = pdo_test::labels_for(40);
  std::vector<double> losses;
  for (int s = from; s < to; ++s) {
    pdo::tensor<double, 2> xb({12, 6});
    pdo::tensor<int, 1> yb({12});
    for (std::size_t i = 0; i < 12; ++i) {
      const std::size_t r = (static_cast<std::size_t>(s) * 5 + i) % 40;
      for (std::size_t j = 0; j < 6; ++j) xb(i, j) = x(r, j);
      yb(i) = y(r);
    }
    losses.push_back(t.step(xb, yb));
  }
  return losses;
}

}  // namespace

TEST_CASE("resume: a data-parallel trainer saved after 10 steps and loaded trains on as 20 straight steps") {
  scratch_dir tmp("resume_dp");
  auto straight = make_trainer(2);
  const auto all = train(straight, 0, 20);

  auto first = make_trainer(2);
  const auto head = train(first, 0, 10);
  CHECK(std::equal(head.begin(), head.end(), all.begin()));
  pdo::io::save(tmp.path / "dp", first);
  const auto info = pdo::io::inspect(tmp.path / "dp");
  CHECK(std::any_of(info.begin(), info.end(), [](const auto& e) { return e.name == "optimizer.0.weight.exp_avg_sq"; }));

  // a fresh trainer (other parameters, no optimizer state): the checkpoint restores all of it
  auto resumed = make_trainer(2, 1);
  pdo::io::load(tmp.path / "dp", resumed);
  CHECK(resumed.steps() == 10);
  const auto tail = train(resumed, 10, 20);
  for (std::size_t i = 0; i < tail.size(); ++i) CHECK(tail[i] == all[10 + i]);  // bitwise

  // on another mesh: the same trajectory up to the order of the sums
  for (std::size_t places : {1, 3}) {
    CAPTURE(places);
    auto other = make_trainer(places, 2);
    pdo::io::load(tmp.path / "dp", other);
    const auto more = train(other, 10, 20);
    for (std::size_t i = 0; i < more.size(); ++i) CHECK(std::abs(more[i] - all[10 + i]) <= 1e-12 * std::abs(all[10 + i]));
  }
}

TEST_CASE("resume: an optimizer of part of the parameters (a frozen layer), in another order than the model's") {
  scratch_dir tmp("resume_frozen");
  // adam over the model's parameters but 0.weight and 2.bias, in reverse order
  auto trainer = [](unsigned seed_shift) {
    const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
    return pdo::nn::make_data_parallel<double>(
        m,
        [seed_shift] {
          auto model = pdo_test::make_mlp();
          for (const auto& p : pdo::nn::parameters_of<double>(model))
            for (auto& v : p.value()) v += 0.25 * seed_shift;
          return model;
        },
        [](auto params) {
          std::erase_if(params, [](const auto& p) { return p.name() == "0.weight" || p.name() == "2.bias"; });
          std::reverse(params.begin(), params.end());
          return pdo::nn::adam<double>(std::move(params), {.lr = 0.01});
        },
        {.bucket_bytes = 256});
  };
  auto straight = trainer(0);
  const auto all = train(straight, 0, 12);
  auto first = trainer(0);
  train(first, 0, 6);
  pdo::io::save(tmp.path / "dp", first);
  std::map<std::string, std::vector<std::size_t>> shapes;
  for (const auto& e : pdo::io::inspect(tmp.path / "dp")) shapes[e.name] = e.shape;
  for (const std::string name : {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias", "6.weight", "6.bias"}) {
    CAPTURE(name);
    REQUIRE(shapes.count("model." + name) == 1);
    const bool frozen = name == "0.weight" || name == "2.bias";
    CHECK(shapes.count("optimizer." + name + ".exp_avg") == (frozen ? 0U : 1U));
    CHECK(shapes.count("optimizer." + name + ".steps") == (frozen ? 0U : 1U));
    if (!frozen) CHECK(shapes["optimizer." + name + ".exp_avg_sq"] == shapes["model." + name]);
  }
  auto resumed = trainer(1);
  pdo::io::load(tmp.path / "dp", resumed);
  const auto tail = train(resumed, 6, 12);
  for (std::size_t i = 0; i < tail.size(); ++i) CHECK(tail[i] == all[6 + i]);  // bitwise
  const auto want = straight.parameters(0), got = resumed.parameters(0);
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(std::ranges::equal(got[i].value(), want[i].value()));

  // a model and an optimizer of one of its two parameters
  auto p = pdo::parameter(pdo::tensor<double, 1>({2}, {0.5, -1.0}));
  auto late = pdo::parameter(pdo::tensor<double, 1>({3}, {1.0, 2.0, 3.0}));
  pdo::nn::adam<double> opt({{"late", late}}, {.lr = 0.1});
  opt.zero_grad();
  pdo::backward(pdo::sum(late * late));
  opt.step();
  pdo::io::checkpoint c;
  pdo::io::add_state<double>(c, "m.", {{"p", p}, {"late", late}}, opt);
  c.save(tmp.path / "model");
  std::map<std::string, std::vector<std::size_t>> saved;
  for (const auto& e : pdo::io::inspect(tmp.path / "model")) saved[e.name] = e.shape;
  CHECK(saved.count("m.optimizer.p.exp_avg") == 0);
  CHECK(saved["m.optimizer.late.exp_avg"] == std::vector<std::size_t>{3});
  auto late2 = pdo::parameter(pdo::tensor<double, 1>({3}));
  auto p2 = pdo::parameter(pdo::tensor<double, 1>({2}));
  pdo::nn::adam<double> opt2({{"late", late2}}, {.lr = 0.1});
  pdo::io::checkpoint back;
  pdo::io::add_state<double>(back, "m.", {{"p", p2}, {"late", late2}}, opt2);
  back.load(tmp.path / "model");
  CHECK(std::ranges::equal(p2.value(), p.value()));
  CHECK(opt2.steps(0) == 1);
  opt.zero_grad();
  pdo::backward(pdo::sum(late * late));
  opt.step();
  opt2.zero_grad();
  pdo::backward(pdo::sum(late2 * late2));
  opt2.step();
  CHECK(std::ranges::equal(late2.value(), late.value()));  // bitwise: the moments were restored
}

TEST_CASE("resume: adam's count of each parameter's steps, for a parameter that skipped steps; older checkpoints without it") {
  scratch_dir tmp("resume_adam_steps");
  // `late` gets a gradient from step 3 on: adam corrects it as at its first step then
  struct run {
    pdo::var<pdo::tensor<double, 1>> p = pdo::parameter(pdo::tensor<double, 1>({2}, {0.5, -1.0}));
    pdo::var<pdo::tensor<double, 1>> late = pdo::parameter(pdo::tensor<double, 1>({2}, {1.0, 2.0}));
    pdo::nn::adam<double> opt{{{"p", p}, {"late", late}}, {.lr = 0.1}};
    void steps(int from, int to) {
      for (int s = from; s < to; ++s) {
        opt.zero_grad();
        if (s < 2) pdo::backward(pdo::sum(p * p));
        else pdo::backward(pdo::sum(p * p) + pdo::sum(late * late * 3.0));
        opt.step();
      }
    }
    std::vector<double> values() const { return {p.value()(0), p.value()(1), late.value()(0), late.value()(1)}; }
  };
  run straight;
  straight.steps(0, 6);
  run first;
  first.steps(0, 3);  // saved when late has taken 1 step of 3
  CHECK(first.opt.steps(1) == 1);
  pdo::io::checkpoint c;
  pdo::io::add_state(c, "a.", first.opt.parameters(), first.opt);
  c.save(tmp.path / "adam");
  auto resume = [&](const fs::path& dir) {
    run again;
    again.p.value()(0) = 7;  // overwritten by the load
    pdo::io::checkpoint back;
    pdo::io::add_state(back, "a.", again.opt.parameters(), again.opt);
    back.load(dir);
    return again;
  };
  run resumed = resume(tmp.path / "adam");
  CHECK(resumed.opt.steps() == 3);
  CHECK(resumed.opt.steps(0) == 3);
  CHECK(resumed.opt.steps(1) == 1);
  resumed.steps(3, 6);
  CHECK(resumed.values() == straight.values());  // bitwise

  // a checkpoint saved without the counts per parameter (before they were kept) still loads:
  // every parameter resumes at the optimizer's count
  nlohmann::json meta = nlohmann::json::parse(std::ifstream(tmp.path / "adam" / "metadata.json"));
  CHECK(meta["entries"].contains("a.optimizer.late.steps"));
  meta["entries"].erase("a.optimizer.p.steps");
  meta["entries"].erase("a.optimizer.late.steps");
  write_metadata(tmp.path / "adam", meta);
  run older = resume(tmp.path / "adam");
  CHECK(older.opt.steps(1) == 3);
  older.steps(3, 6);
  CHECK(older.values() != straight.values());
}

TEST_CASE("resume: a ZeRO-1 trainer's sliced optimizer state, on the same mesh and on another number of places") {
  scratch_dir tmp("resume_zero1");
  auto straight = make_trainer(2, 0, true);
  const auto all = train(straight, 0, 14);
  auto first = make_trainer(2, 0, true);
  train(first, 0, 7);
  pdo::io::save(tmp.path / "z", first);
  // each state is the parameter's elements in row-major order, written by the places whose slices hold them
  const auto meta = nlohmann::json::parse(std::ifstream(tmp.path / "z" / "metadata.json"));
  CHECK(meta["entries"]["optimizer.0.weight.exp_avg"]["shape"] == std::vector<std::size_t>{60});
  CHECK(meta["entries"]["model.0.weight"]["shape"] == std::vector<std::size_t>{6, 10});
  for (std::size_t places : {2, 3, 1}) {
    CAPTURE(places);
    auto resumed = make_trainer(places, 1, true);
    pdo::io::load(tmp.path / "z", resumed);
    CHECK(resumed.steps() == 7);
    const auto tail = train(resumed, 7, 14);
    for (std::size_t i = 0; i < tail.size(); ++i) {
      if (places == 2) CHECK(tail[i] == all[7 + i]);  // bitwise
      else CHECK(std::abs(tail[i] - all[7 + i]) <= 1e-12 * std::abs(all[7 + i]));
    }
  }

  // an optimizer that lists the slices in reverse: each slice's state saved as its own, so the
  // checkpoint resumes bitwise, and loads into a trainer whose optimizer keeps their order
  auto reversed = make_trainer(2, 0, true, true);
  train(reversed, 0, 7);
  pdo::io::save(tmp.path / "r", reversed);
  for (const bool again_reversed : {true, false}) {
    CAPTURE(again_reversed);
    auto resumed = make_trainer(2, 1, true, again_reversed);
    pdo::io::load(tmp.path / "r", resumed);
    const auto tail = train(resumed, 7, 14);
    for (std::size_t i = 0; i < tail.size(); ++i) CHECK(tail[i] == all[7 + i]);
  }
  // one that leaves a slice out cannot be saved whole: an io_error before anything is written
  const auto m = pdo::make_mesh<"dp">(pdo::cpu_places(2));
  auto frozen = pdo::nn::make_data_parallel<double>(
      m, [] { return pdo_test::make_mlp(); },
      [](auto slices) {
        slices.pop_back();
        return pdo::nn::adam<double>(std::move(slices), {.lr = 0.01});
      },
      {.bucket_bytes = 256, .zero1 = true});
  train(frozen, 0, 2);
  CHECK_THROWS_WITH(pdo::io::save(tmp.path / "f", frozen), Catch::Contains("does not update bucket") && Catch::Contains("slice"));
  CHECK(!fs::exists(tmp.path / "f"));
}

TEST_CASE("resume: a tensor-parallel model and its optimizer, on the same mesh and on another") {
  scratch_dir tmp("resume_tp");
  const auto x = pdo_test::random_tensor<double, 2>({9, 6}, 41);
  const auto y = pdo_test::labels_for(9);
  auto run = [&](auto& model, auto& opt, const auto& mesh, int steps) {
    using R = pdo::layout<replicate, replicate>;
    const auto dx = pdo::var(pdo::distribute<R>(mesh, x));
    const auto dy = pdo::distribute<pdo::layout<replicate>>(mesh, y);
    std::vector<double> losses;
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      const auto loss = pdo::cross_entropy(model(dx), dy);
      pdo::backward(loss);
      opt.step();
      losses.push_back(pdo::gather(loss.value()).data()[0]);
    }
    return losses;
  };
  auto make = [](const auto& mesh) {
    auto model = pdo::nn::tensor_parallel<"tp">(mesh, pdo_test::make_mlp());
    auto opt = pdo::nn::sgd<double>(pdo::nn::parameters_of<double>(model), {.lr = 0.2, .momentum = 0.5});
    return std::make_pair(std::move(model), std::move(opt));
  };
  const auto m3 = pdo::make_mesh<"tp">(pdo::cpu_places(3));
  auto [model, opt] = make(m3);
  const auto all = run(model, opt, m3, 12);
  auto [first, first_opt] = make(m3);
  run(first, first_opt, m3, 6);
  pdo::io::checkpoint c;
  pdo::io::add_state(c, "tp.", pdo::nn::parameters_of<double>(first), first_opt);
  c.save(tmp.path / "tp");
  // written by the places that hold them: a weight split over 3 places in 3 blocks, its momentum
  // too, the replicated bias of a row-parallel layer once
  const auto meta = nlohmann::json::parse(std::ifstream(tmp.path / "tp" / "metadata.json"));
  CHECK(meta["entries"]["tp.model.0.weight"]["blocks"].size() == 3);
  CHECK(meta["entries"]["tp.optimizer.0.weight.momentum_buffer"]["blocks"].size() == 3);
  CHECK(meta["entries"]["tp.model.2.weight"]["blocks"].size() == 3);
  CHECK(meta["entries"]["tp.model.2.bias"]["blocks"].size() == 1);

  for (std::size_t places : {3, 2}) {
    CAPTURE(places);
    const auto m = pdo::make_mesh<"tp">(pdo::cpu_places(places));
    auto [again, again_opt] = make(m);
    pdo::io::checkpoint back;
    pdo::io::add_state(back, "tp.", pdo::nn::parameters_of<double>(again), again_opt);
    back.load(tmp.path / "tp");
    const auto tail = run(again, again_opt, m, 6);
    for (std::size_t i = 0; i < tail.size(); ++i) {
      if (places == 3) CHECK(tail[i] == all[6 + i]);  // bitwise
      else CHECK(std::abs(tail[i] - all[6 + i]) <= 1e-12 * std::abs(all[6 + i]));
    }
  }
}

TEST_CASE("resume: a pipeline saved by its stages' places loads into another cut, \"tp\" shards and \"dp\" replicas") {
  scratch_dir tmp("resume_pp");
  auto adam = [](auto params) { return pdo::nn::adam<double>(std::move(params), {.lr = 0.02}); };
  pdo::nn::pipeline_options o{pdo::nn::pipeline_schedule::one_f_one_b, 3};
  // a learning-rate schedule: a resumed run takes the rate of its step (the trainer's steps are saved)
  o.learning_rate = pdo::nn::step_lr(0.02, 4, 0.5);
  // A: 3 stages (cut after layers 1 and 4); B: 2 stages of 2 "tp" shards; C: 2 stages x 2 "dp" replicas
  const auto a_mesh = pdo::make_mesh<"pp">(pdo::cpu_places(3));
  const auto b_mesh = pdo::make_mesh<"pp", "tp">(pdo::cpu_places(4), {2, 2});
  const auto c_mesh = pdo::make_mesh<"dp", "pp">(pdo::cpu_places(4), {2, 2});
  auto make_a = [&] { return pdo::nn::make_pipeline<double, 2, 1, 4>(a_mesh, pdo_test::make_mlp(), adam, o); };
  auto make_b = [&] { return pdo::nn::make_pipeline<double, 2, 3>(b_mesh, pdo_test::make_mlp(), adam, o); };
  auto make_c = [&] { return pdo::nn::make_pipeline<double, 2, 3>(c_mesh, pdo_test::make_mlp(), adam, o); };
  const auto near = [](const std::vector<double>& got, const std::vector<double>& want, std::size_t from) {
    for (std::size_t i = 0; i < got.size(); ++i) CHECK(std::abs(got[i] - want[from + i]) <= 1e-12 * std::abs(want[from + i]));
  };

  auto straight = make_a();
  const auto all = train(straight, 0, 21);
  auto first = make_a();
  train(first, 0, 10);
  first.set_skipped_steps(3);  // as if 3 of its steps had had a loss that was not finite
  pdo::io::save(tmp.path / "a", first);
  // every parameter under its name in the whole model, its moments beside it
  const auto info = pdo::io::inspect(tmp.path / "a");
  CHECK(std::any_of(info.begin(), info.end(), [](const auto& e) { return e.name == "model.6.weight" && e.shape == std::vector<std::size_t>{7, 4}; }));
  CHECK(std::any_of(info.begin(), info.end(), [](const auto& e) { return e.name == "optimizer.2.bias.exp_avg_sq"; }));

  // the same mesh: bitwise
  auto resumed = make_a();
  pdo::io::load(tmp.path / "a", resumed);
  CHECK(resumed.steps() == 10);
  CHECK(resumed.skipped_steps() == 3);
  const auto tail = train(resumed, 10, 20);
  for (std::size_t i = 0; i < tail.size(); ++i) CHECK(tail[i] == all[10 + i]);

  // another cut with "tp" shards: each stage's places read their shards' parts
  auto b = make_b();
  pdo::io::load(tmp.path / "a", b);
  near(train(b, 10, 20), all, 10);
  // saved by B's places: a column-split weight in one block per "tp" shard, a replicated bias in one
  pdo::io::save(tmp.path / "b", b);
  const auto meta = nlohmann::json::parse(std::ifstream(tmp.path / "b" / "metadata.json"));
  CHECK(meta["entries"]["model.0.weight"]["blocks"].size() == 2);
  CHECK(meta["entries"]["model.6.bias"]["blocks"].size() == 1);
  CHECK(meta["entries"]["optimizer.4.weight.exp_avg"]["blocks"].size() == 2);
  // back into the first cut, and into "dp" replicas: step 21 as the straight run's
  auto a_again = make_a();
  pdo::io::load(tmp.path / "b", a_again);
  near(train(a_again, 20, 21), all, 20);
  auto c = make_c();
  pdo::io::load(tmp.path / "b", c);
  near(train(c, 20, 21), all, 20);
  pdo::io::save(tmp.path / "c", c);
  const auto meta_c = nlohmann::json::parse(std::ifstream(tmp.path / "c" / "metadata.json"));
  CHECK(meta_c["entries"]["model.0.weight"]["blocks"].size() == 1);  // written by the first "dp" replica only

  // a checkpoint of another model is refused, naming the parameter and both shapes
  pdo::io::checkpoint wrong;
  pdo::tensor<double, 2> w0({10, 7});
  wrong.add("model.0.weight", w0);
  wrong.save(tmp.path / "wrong");
  auto d = make_a();
  CHECK_THROWS_WITH(pdo::io::load(tmp.path / "wrong", d), Catch::Contains("model.0.weight") && Catch::Contains("[10, 7]"));

  // stage optimizers that list their parameters in reverse: each state saved under its own
  // parameter, so the checkpoint loads into the first cut's pipeline bitwise
  auto reversed_adam = [](auto params) {
    std::reverse(params.begin(), params.end());
    return pdo::nn::adam<double>(std::move(params), {.lr = 0.02});
  };
  auto r = pdo::nn::make_pipeline<double, 2, 1, 4>(a_mesh, pdo_test::make_mlp(), reversed_adam, o);
  train(r, 0, 10);
  pdo::io::save(tmp.path / "r", r);
  auto from_r = make_a();
  pdo::io::load(tmp.path / "r", from_r);
  const auto tail_r = train(from_r, 10, 20);
  for (std::size_t i = 0; i < tail_r.size(); ++i) CHECK(tail_r[i] == all[10 + i]);
  // one that leaves a parameter out (a frozen one) cannot be saved whole: an io_error at once
  auto frozen_adam = [](auto params) {
    params.pop_back();
    return pdo::nn::adam<double>(std::move(params), {.lr = 0.02});
  };
  auto f = pdo::nn::make_pipeline<double, 2, 1, 4>(a_mesh, pdo_test::make_mlp(), frozen_adam, o);
  train(f, 0, 2);
  CHECK_THROWS_AS(pdo::io::save(tmp.path / "f", f), pdo::io_error);
  CHECK_THROWS_WITH(pdo::io::save(tmp.path / "f", f), Catch::Contains("does not update the stage's parameter"));
  CHECK(!fs::exists(tmp.path / "f"));
}

#ifdef PDO_PYTHON
TEST_CASE("npy and safetensors: files written by NumPy load in pdo, and pdo's load in NumPy") {
  scratch_dir tmp("python");
  const auto a = pdo_test::random_tensor<float, 2>({3, 5}, 11);
  const auto b = pdo_test::random_tensor<std::int32_t, 1>({7}, 12);
  const auto c = pdo_test::random_tensor<double, 3>({2, 1, 4}, 13);
  pdo::io::save_npy(tmp.path / "pdo_a.npy", a);
  pdo::io::safetensors_writer w;
  w.add("a", a).add("b", b).add("c", c);
  w.write(tmp.path / "pdo.safetensors");
  {
    std::ofstream expected(tmp.path / "expected.txt");
    expected.precision(17);
    for (const float v : a) expected << v << ' ';
    expected << '\n';
    for (const std::int32_t v : b) expected << v << ' ';
    expected << '\n';
    for (const double v : c) expected << v << ' ';
    expected << '\n';
  }
  // the script checks pdo's files against the values it computes the same way, then writes its own
  const std::string command = PDO_PYTHON " " PDO_SOURCE_DIR "/tests/io_interop.py " + tmp.path.string();
  REQUIRE(std::system(command.c_str()) == 0);
  const auto x = pdo::io::load_npy<double, 2>(tmp.path / "py_x.npy");
  REQUIRE(x.shape() == pdo::shape_t<2>{2, 3});
  for (std::size_t i = 0; i < 6; ++i) CHECK(x.data()[i] == 0.25 * static_cast<double>(i) - 1);
  const pdo::io::safetensors_reader r(tmp.path / "py.safetensors");
  const auto y = r.get<float, 2>("y");
  for (std::size_t i = 0; i < 12; ++i) CHECK(y.data()[i] == static_cast<float>(i) / 8.0f);
  const auto z = r.get<std::int64_t, 1>("z");
  for (std::size_t i = 0; i < 4; ++i) CHECK(z.data()[i] == static_cast<std::int64_t>(i) * 1000000007);
  CHECK(pdo_test::equal(r.get<float, 2>("a_from_pdo"), a));
}
#endif
