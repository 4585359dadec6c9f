// examples/example_places.hpp: the places an example runs on: n CPU places, or with --gpu
// every GPU of the machine (in a build with the CUDA backend; exit 77, "skipped", without one).
#pragma once

#include <pdo/pdo.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace example {

/// @brief Whether the command line asks for GPU places.
inline bool wants_gpu(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--gpu") return true;
  return false;
}

/// @brief `cpu_count` CPU places, or with --gpu every GPU (an even number of them, for a 2 x n/2 mesh).
inline std::vector<pdo::any_place> places(int argc, char** argv, std::size_t cpu_count) {
  std::vector<pdo::any_place> out;
  if (!wants_gpu(argc, argv)) {
    for (const auto& p : pdo::cpu_places(cpu_count)) out.emplace_back(p);
    return out;
  }
#if defined(PDO_WITH_CUDA)
  if (const std::string why = pdo::cuda_unavailable_reason(); !why.empty()) {
    std::printf("SKIPPED: no GPU (%s)\n", why.c_str());
    std::exit(77);
  }
  for (const auto& p : pdo::cuda_places()) out.emplace_back(p);
  if (out.size() % 2 != 0) out.pop_back();  // a 2 x n/2 mesh
  if (out.empty()) {
    std::printf("SKIPPED: one GPU; the example's mesh needs two\n");
    std::exit(77);
  }
  return out;
#else
  std::fprintf(stderr, "--gpu: this program was built without the CUDA backend (PDO_WITH_CUDA)\n");
  std::exit(2);
#endif
}

}  // namespace example
