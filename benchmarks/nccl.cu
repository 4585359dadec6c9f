// benchmarks/nccl.cu: NCCL on GPU places.
//  1. all_reduce bus bandwidth through pdo (a mesh of every visible GPU, one spmd task per
//     place) beside raw NCCL in the same run (ncclCommInitAll, one thread, group calls,
//     the way nccl-tests drives one process), and the ratio; the theoretical bandwidth of
//     the links between the GPUs (from nvidia-smi, or PDO_LINK_GBPS) printed above them;
//  2. a 64 MiB copy between two GPUs, directly (peer) and staged through pinned host memory.
// busbw = size / time * 2 (n - 1) / n, as nccl-tests defines it.
//
//   bench_nccl [samples] [min_bytes] [max_bytes]
#include <pdo/pdo.hpp>

#include "bench_common.hpp"

#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace {

/// @brief The first line `command` prints, or "" (nvidia-smi absent).
std::string first_line(const char* command) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command, "r"), pclose);
  if (!pipe) return "";
  char line[512] = {};
  if (std::fgets(line, sizeof line, pipe.get()) == nullptr) return "";
  std::string s(line);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

/// @brief The links between the GPUs, as nvidia-smi reports them.
void print_links() {
  if (const char* given = std::getenv("PDO_LINK_GBPS")) {
    std::printf("theoretical link bandwidth (PDO_LINK_GBPS): %s GB/s per direction\n", given);
    return;
  }
  const std::string nvlink = first_line("nvidia-smi nvlink --status -i 0 2>/dev/null | grep -c 'GB/s'");
  const std::string speed = first_line("nvidia-smi nvlink --status -i 0 2>/dev/null | grep -o '[0-9.]* GB/s' | head -n 1");
  const std::string pcie = first_line("nvidia-smi --query-gpu=pcie.link.gen.current,pcie.link.width.current --format=csv,noheader -i 0 2>/dev/null");
  if (!nvlink.empty() && nvlink != "0")
    std::printf("theoretical link bandwidth: GPU 0 has %s NVLink links at %s each (sum them for the per-direction figure)\n",
                nvlink.c_str(), speed.c_str());
  if (!pcie.empty()) std::printf("PCIe link of GPU 0 (generation, width): %s (gen4 x16: 31.5 GB/s, gen5 x16: 63 GB/s per direction)\n", pcie.c_str());
  if (nvlink.empty() && pcie.empty()) std::printf("theoretical link bandwidth: unknown (no nvidia-smi; set PDO_LINK_GBPS)\n");
}

void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(r));
}
void check_cuda(cudaError_t r, const char* what) {
  if (r != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(r));
}

}  // namespace

int main(int argc, char** argv) {
  const auto o = bench::parse_options(argc, argv, {5, std::size_t{8} << 10, std::size_t{256} << 20, 0});
  const std::string reason = pdo::cuda_unavailable_reason();
  if (!reason.empty()) {
    std::printf("no GPU: %s\n", reason.c_str());
    return 0;
  }
  const auto gpus = pdo::cuda_places();
  const std::size_t n = gpus.size();
  const int n_int = static_cast<int>(n);
  std::printf("1. all_reduce of float32 over %zu GPU(s), busbw GB/s (median of %d)\n", n, o.samples);
  print_links();
  const auto mesh = pdo::make_mesh<"dp">(gpus, {n});

  // the anchor: raw NCCL, its own communicators and buffers
  std::vector<int> devices(n);
  for (std::size_t d = 0; d < n; ++d) devices[d] = gpus[d].device();
  std::vector<ncclComm_t> comms(n);
  check_nccl(ncclCommInitAll(comms.data(), n_int, devices.data()), "ncclCommInitAll");
  std::vector<cudaStream_t> streams(n);
  std::vector<float*> raw(n);
  for (std::size_t d = 0; d < n; ++d) {
    check_cuda(cudaSetDevice(devices[d]), "cudaSetDevice");
    check_cuda(cudaStreamCreate(&streams[d]), "cudaStreamCreate");
    check_cuda(cudaMalloc(&raw[d], o.max_bytes), "cudaMalloc");
  }
  const double bus = n > 1 ? 2.0 * static_cast<double>(n - 1) / static_cast<double>(n) : 1.0;
  std::printf("%12s %12s %12s %8s\n", "bytes", "pdo", "NCCL", "ratio");
  for (std::size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 4) {
    const std::size_t count = bytes / sizeof(float);
    const int iters = bytes <= (std::size_t{1} << 20) ? 50 : 10;
    std::vector<pdo::tensor<float, 1>> buffers;
    for (const auto& g : gpus) buffers.emplace_back(pdo::shape_t<1>{count}, g);
    std::vector<double> mine, theirs;
    for (int s = 0; s < o.samples + 1; ++s) {
      auto start = bench::steady::now();
      pdo::spmd(mesh, [&](std::size_t p) {
        const auto comm = pdo::communicator_of(mesh, p);
        for (int i = 0; i < iters; ++i) comm.all_reduce(buffers[p].span());
        gpus[p].synchronize();
      });
      const double t_pdo = bench::seconds_since(start) / iters;
      start = bench::steady::now();
      for (int i = 0; i < iters; ++i) {
        check_nccl(ncclGroupStart(), "ncclGroupStart");
        for (std::size_t d = 0; d < n; ++d)
          check_nccl(ncclAllReduce(raw[d], raw[d], count, ncclFloat32, ncclSum, comms[d], streams[d]), "ncclAllReduce");
        check_nccl(ncclGroupEnd(), "ncclGroupEnd");
      }
      for (std::size_t d = 0; d < n; ++d) check_cuda(cudaStreamSynchronize(streams[d]), "cudaStreamSynchronize");
      const double t_raw = bench::seconds_since(start) / iters;
      if (s == 0) continue;  // warm-up
      mine.push_back(static_cast<double>(bytes) / t_pdo * bus / 1e9);
      theirs.push_back(static_cast<double>(bytes) / t_raw * bus / 1e9);
    }
    const double a = bench::median(mine), b = bench::median(theirs);
    std::printf("%12zu %12.2f %12.2f %8.3f\n", bytes, a, b, a / b);
  }
  for (std::size_t d = 0; d < n; ++d) {
    cudaSetDevice(devices[d]);
    cudaFree(raw[d]);
    cudaStreamDestroy(streams[d]);
    ncclCommDestroy(comms[d]);
  }

  if (n > 1) {
    std::printf("2. 64 MiB from %s to %s (%s peer access), GB/s\n", gpus[0].name().c_str(), gpus[1].name().c_str(),
                gpus[1].can_access_peer(gpus[0]) ? "with" : "without");
    const pdo::tensor<float, 1> src(pdo::shape_t<1>{std::size_t{16} << 20}, gpus[0]);
    pdo::tensor<float, 1> dst(pdo::shape_t<1>{std::size_t{16} << 20}, gpus[1]);
    for (auto how : {pdo::peer_copy::direct, pdo::peer_copy::staged}) {
      std::vector<double> rates;
      for (int s = 0; s < o.samples + 1; ++s) {
        const auto start = bench::steady::now();
        pdo::copy(src, dst, pdo::copy_completion::host_safe, how);
        gpus[1].synchronize();
        if (s > 0) rates.push_back(static_cast<double>(src.bytes()) / bench::seconds_since(start) / 1e9);
      }
      std::printf("   %-8s %8.2f\n", how == pdo::peer_copy::direct ? "peer" : "staged", bench::median(rates));
    }
  }
  return 0;
}
