// examples/mpi_quickstart.cpp: the quickstart over MPI processes: each process owns one
// place of a mesh; a batch is split across them, a partial sum is reduced, and every
// process gets the merged result. Run with `mpirun -np 2 mpi_quickstart`.
#include <pdo/pdo.hpp>

#include <iostream>

using rows = pdo::layout<pdo::split<"dp">, pdo::replicate>;
using column_sums = pdo::layout<pdo::replicate>::partial<"dp">;
// gathering the sums is one all_reduce over "dp"
static_assert(pdo::redistribute_plan_of<column_sums, pdo::layout<pdo::replicate>>().count(pdo::step_kind::all_reduce) == 1);

int main() {
  try {
    const auto mesh = pdo::make_mesh<"dp">(pdo::mpi::world_places());
    pdo::tensor<double, 2> x({9, 4});
    for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<double>(i);
    const auto xs = pdo::distribute<rows>(mesh, x);
    // each place sums its rows: the column sums are a partial value over "dp"
    const auto sums = pdo::parallel_do<column_sums>(
        [](const pdo::tensor<double, 2>& rows) {
          pdo::tensor<double, 1> s({rows.extent(1)});
          for (std::size_t i = 0; i < rows.extent(0); ++i)
            for (std::size_t j = 0; j < rows.extent(1); ++j) s(j) += rows(i, j);
          return s;
        },
        xs);
    const auto total = pdo::gather(sums);  // all_reduce over "dp"
    bool ok = true;
    for (std::size_t j = 0; j < 4; ++j) {
      double expected = 0;
      for (std::size_t i = 0; i < 9; ++i) expected += x(i, j);
      ok = ok && total(j) == expected;
    }
    if (pdo::mpi::rank() == 0)
      std::cout << mesh.describe() << " over " << pdo::mpi::size() << " processes: column sums " << total(0) << " "
                << total(1) << " " << total(2) << " " << total(3) << (ok ? " (correct)" : " (WRONG)") << "\n";
    return ok ? 0 : 1;
  } catch (const pdo::error& e) {
    std::cerr << "mpi_quickstart: " << e.what() << "\n";
    return 1;
  }
}
