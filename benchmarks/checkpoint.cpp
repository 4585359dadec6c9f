// benchmarks/checkpoint.cpp: saving and loading a sharded checkpoint (a float tensor split by
// rows over 2 places, each place writing and reading its own shard file) against `dd` writing
// and reading the same number of bytes on the same disk, in the same run.
//
//   bench_checkpoint [GiB=1] [DIR=system temporary directory] [samples=3]
//
// Both sides flush to the disk before they stop the clock (the checkpoint: fsync of every
// file; dd: conv=fdatasync). Before each read, the files are dropped from the page cache
// (posix_fadvise DONTNEED, which needs no privilege), so both read from the disk; the load
// checks every checksum as it reads.
#include <pdo/io.hpp>
#include <pdo/pdo.hpp>

#include "bench_common.hpp"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include <fcntl.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace {

/// @brief Seconds `command` takes in the shell (it must succeed).
double time_command(const std::string& command) {
  const auto start = bench::steady::now();
  if (std::system(command.c_str()) != 0) throw std::runtime_error("failed: " + command);
  return bench::seconds_since(start);
}

/// @brief Drops `path` (a file, or every file under a directory) from the page cache.
void evict(const fs::path& path) {
  auto one = [](const fs::path& file) {
    const int fd = ::open(file.c_str(), O_RDONLY);
    if (fd < 0) throw std::runtime_error("cannot open " + file.string());
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  };
  if (fs::is_directory(path)) {
    for (const auto& e : fs::directory_iterator(path))
      if (e.is_regular_file()) one(e.path());
  } else {
    one(path);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const double gib = argc > 1 ? std::atof(argv[1]) : 1.0;
  const fs::path base = argc > 2 ? fs::path(argv[2]) : fs::temp_directory_path();
  const int samples = argc > 3 ? std::max(1, std::atoi(argv[3])) : 3;
  const fs::path dir = base / "pdo_bench_checkpoint", dd_file = base / "pdo_bench_dd.bin";
  const std::size_t cols = 4096;
  const std::size_t rows = static_cast<std::size_t>(gib * double(std::size_t{1} << 30) / (cols * sizeof(float)));
  const std::size_t bytes = rows * cols * sizeof(float);
  const std::size_t mib = bytes >> 20;

  const auto mesh = pdo::make_mesh<"x">(pdo::cpu_places(2));
  using rows_split = pdo::layout<pdo::split<"x">, pdo::replicate>;
  auto x = pdo::distribute<rows_split>(mesh, pdo::tensor<float, 2>({rows, cols}));
  pdo::spmd(mesh, [&](std::size_t p) {  // values that are not all zeros
    auto& shard = x.shard(p);
    for (std::size_t i = 0; i < shard.size(); ++i) shard.data()[i] = static_cast<float>(i % 1021) * 0.5f;
  });
  auto y = pdo::distribute<rows_split>(mesh, pdo::tensor<float, 2>({rows, cols}));
  pdo::io::checkpoint out, in;
  out.add("x", x);
  in.add("x", y);

  std::printf("checkpoint of f32[%zu, %zu] (%zu MiB) split by rows over 2 places, in %s; dd moves the same bytes\n", rows, cols, mib,
              base.string().c_str());
  double save = 1e9, load = 1e9, dd_write = 1e9, dd_read = 1e9;
  const std::string count = std::to_string(mib);
  for (int s = 0; s < samples; ++s) {
    fs::remove_all(dir);
    dd_write = std::min(dd_write, time_command("dd if=/dev/zero of=" + dd_file.string() + " bs=1M count=" + count +
                                                   " conv=fdatasync status=none"));
    evict(dd_file);
    dd_read = std::min(dd_read, time_command("dd if=" + dd_file.string() + " of=/dev/null bs=1M status=none"));
    fs::remove(dd_file);
    auto start = bench::steady::now();
    pdo::io::save(dir, out);
    save = std::min(save, bench::seconds_since(start));
    evict(dir);
    start = bench::steady::now();
    pdo::io::load(dir, in);
    load = std::min(load, bench::seconds_since(start));
  }
  bool same = true;
  for (std::size_t k = 0; k < x.local_shards().size(); ++k)
    same = same && std::equal(x.local_shards()[k].begin(), x.local_shards()[k].end(), y.local_shards()[k].begin());
  fs::remove_all(dir);
  const double g = double(bytes) / double(std::size_t{1} << 30);
  std::printf("%-34s %8.3f s  %6.2f GiB/s\n", "anchor: dd write (conv=fdatasync)", dd_write, g / dd_write);
  std::printf("%-34s %8.3f s  %6.2f GiB/s  ratio %.2f (target >= 0.8)\n", "pdo::io::save (fsync every file)", save, g / save, dd_write / save);
  std::printf("%-34s %8.3f s  %6.2f GiB/s\n", "anchor: dd read (from the disk)", dd_read, g / dd_read);
  std::printf("%-34s %8.3f s  %6.2f GiB/s  ratio %.2f (target >= 0.8)\n", "pdo::io::load (checksums checked)", load, g / load, dd_read / load);
  std::printf("loaded values %s\n", same ? "equal the saved ones" : "DIFFER from the saved ones");
  return same ? 0 : 1;
}
