// tests/package/consumer/main_mpi.cpp: a program on pdo::mpi: one place per process, distribute and gather.
#include <pdo/comm/mpi/communicator.hpp>
#include <pdo/pdo.hpp>

#include <cstddef>
#include <cstdio>
#include <exception>

int main() {
  try {
    const auto mesh = pdo::make_mesh<"dp">(pdo::mpi::world_places());
    pdo::tensor<double, 1> host({8});
    for (std::size_t i = 0; i < host.size(); ++i) host.data()[i] = static_cast<double>(i);
    const auto back = pdo::gather(pdo::distribute<pdo::layout<pdo::split<"dp">>>(mesh, host));
    for (std::size_t i = 0; i < host.size(); ++i)
      if (back.data()[i] != host.data()[i]) return 1;
    if (pdo::mpi::rank() == 0) std::puts("consumer_mpi: ok");
    return 0;
  } catch (const std::exception& e) {
    std::printf("consumer_mpi: %s\n", e.what());
    return 1;
  }
}
