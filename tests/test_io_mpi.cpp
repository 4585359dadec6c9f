// tests/test_io_mpi.cpp: checkpoints over MPI processes. `save DIR` writes, from every
// process, the shards of its places (two places per process when PLACES=2); `load DIR` reads
// them back on another process count, into other layouts, and checks every value;
// `corrupt DIR` damages one shard that only some processes read and checks that every
// process gets a pdo::io_error.
#include <pdo/io.hpp>
#include <pdo/pdo.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

using pdo::replicate;
using pdo::split;

namespace {

template <class T, std::size_t R>
pdo::tensor<T, R> reference(const pdo::shape_t<R>& shape, int salt) {
  auto t = pdo::tensor<T, R>::on_host(shape);
  for (std::size_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>((static_cast<long>(i) * 7919 + salt) % 1013) / T(4);
  return t;
}

int failures = 0;
void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::cerr << "rank " << pdo::mpi::rank() << ": FAILED: " << what << "\n";
  }
}

template <class T, std::size_t R>
bool same(const pdo::tensor<T, R>& a, const pdo::tensor<T, R>& b) {
  return a.shape() == b.shape() && std::equal(a.begin(), a.end(), b.begin());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: test_io_mpi save|load|corrupt DIR\n";
    return 2;
  }
  const std::string mode = argv[1];
  const std::filesystem::path dir = argv[2];
  const char* per = std::getenv("PLACES");
  const auto mesh = pdo::make_mesh<"x">(pdo::mpi::world_places(per ? std::stoul(per) : 1));
  const auto a = reference<float, 2>({13, 6}, 1);
  const auto b = reference<double, 3>({5, 7, 3}, 2);
  const auto c = reference<std::int32_t, 1>({11}, 3);
  try {
    if (mode == "save") {
      auto xa = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, a);
      auto xb = pdo::distribute<pdo::layout<replicate, replicate, split<"x">>>(mesh, b);
      auto xc = pdo::distribute<pdo::layout<replicate>::partial<"x">>(mesh, c);
      auto host = reference<double, 1>({4}, 4);
      std::int64_t step = 42;
      pdo::io::checkpoint ck;
      ck.add("a", xa).add("b", xb).add("c", xc).add("host", host).add("step", step);
      pdo::io::save(dir, ck, {.chunk_bytes = 128});
      pdo::io::save(dir, ck, {.chunk_bytes = 128});  // over the first: replaced whole
    } else if (mode == "load") {
      auto ya = pdo::distribute<pdo::layout<replicate, split<"x">>>(mesh, pdo::tensor<float, 2>({13, 6}));
      auto yb = pdo::distribute<pdo::layout<split<"x">, replicate, replicate>>(mesh, pdo::tensor<double, 3>({5, 7, 3}));
      auto yc = pdo::distribute<pdo::layout<split<"x">>>(mesh, pdo::tensor<std::int32_t, 1>({11}));
      auto host = pdo::tensor<double, 1>({4});
      std::int64_t step = 0;
      pdo::io::checkpoint ck;
      ck.add("a", ya).add("b", yb).add("c", yc).add("host", host).add("step", step);
      pdo::io::load(dir, ck);
      check(same(pdo::gather(ya), a), "a (saved split by rows, loaded split by columns)");
      check(same(pdo::gather(yb), b), "b (saved split on dim 2, loaded split on dim 0)");
      check(same(pdo::gather(yc), c), "c (saved partial, loaded split)");
      check(same(host, reference<double, 1>({4}, 4)), "host");
      check(step == 42, "step");
      check(same(pdo::io::read<float, 2>(dir, "a"), a), "read whole");
    } else if (mode == "corrupt") {
      // the last shard of "a", which only the processes holding its last rows read
      const std::filesystem::path damaged = dir.string() + ".damaged";
      if (pdo::mpi::rank() == 0) {
        std::filesystem::remove_all(damaged);
        std::filesystem::copy(dir, damaged);
        std::filesystem::path last;
        for (const auto& e : std::filesystem::directory_iterator(damaged))
          if (e.path().filename().string().starts_with("t0.") && e.path().filename() > last.filename()) last = e.path();
        std::fstream f(last, std::ios::in | std::ios::out | std::ios::binary);
        f.seekp(-3, std::ios::end);
        f.put('\x7f');
      }
      auto ya = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, pdo::tensor<float, 2>({13, 6}));
      pdo::io::checkpoint ck;
      ck.add("a", ya);
      pdo::spmd(mesh, [](std::size_t) {});  // rank 0 has damaged its copy
      std::string message;
      try {
        pdo::io::load(damaged, ck);
      } catch (const pdo::io_error& e) {
        message = e.what();
      }
      check(message.find("corrupt") != std::string::npos || message.find("failed (its error says why)") != std::string::npos,
            "every process gets an io_error, got: \"" + message + "\"");
      pdo::spmd(mesh, [](std::size_t) {});
      if (pdo::mpi::rank() == 0) std::filesystem::remove_all(damaged);
    }
  } catch (const pdo::error& e) {
    std::cerr << "rank " << pdo::mpi::rank() << ": " << e.what() << "\n";
    return 1;
  }
  if (failures == 0 && pdo::mpi::rank() == 0) std::cout << "test_io_mpi " << mode << ": " << mesh.describe() << " ok\n";
  return failures == 0 ? 0 : 1;
}
