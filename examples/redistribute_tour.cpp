// examples/redistribute_tour.cpp: every step of the redistribution table on a 2x2 mesh.
// Each plan is checked at compile time (static_assert), printed, run, and its result
// compared with the host tensor. With --gpu it runs on the machine's GPUs instead (2 x n/2).
#include "example_places.hpp"

#include <pdo/pdo.hpp>

#include <iostream>

namespace {

using pdo::replicate;
using pdo::split;

using mesh_t = pdo::mesh<"dp", "tp">;
using rows = pdo::layout<split<"dp">, replicate>;
using cols = pdo::layout<replicate, split<"tp">>;
using blocks = pdo::layout<split<"dp">, split<"tp">>;
using swapped = pdo::layout<split<"tp">, split<"dp">>;
using whole = pdo::layout<replicate, replicate>;
using row_sums = pdo::layout<split<"dp">, replicate>::partial<"tp">;

// the table, one line each: what the planner chooses, before anything runs
static_assert(pdo::redistribute_plan_of<whole, rows>().collectives() == 0);                            // local slice
static_assert(pdo::redistribute_plan_of<rows, whole>().count(pdo::step_kind::all_gather) == 1);
static_assert(pdo::redistribute_plan_of<blocks, swapped>().collectives() == 2);  // gather dp, all_to_all tp, slice
static_assert(pdo::redistribute_plan_of<row_sums, rows>().count(pdo::step_kind::all_reduce) == 1);
static_assert(pdo::redistribute_plan_of<row_sums, blocks>().count(pdo::step_kind::reduce_scatter) == 1);
static_assert(pdo::redistribute_plan_of<blocks, row_sums>().collectives() == 0);                       // zero-pad
static_assert(pdo::redistribute_plan_of<rows, row_sums>().count(pdo::step_kind::keep_on_one) == 1);

template <class From, class To>
bool tour_step(const mesh_t& mesh, const pdo::tensor<int, 2>& host) {
  std::cout << pdo::layout_name<From>() << " -> " << pdo::layout_name<To>() << ":\n  "
            << pdo::describe(pdo::redistribute_plan_of<From, To>());
  const auto x = pdo::redistribute<To>(pdo::distribute<From>(mesh, host));
  const auto back = pdo::gather(x);
  for (std::size_t i = 0; i < host.size(); ++i)
    if (back.data()[i] != host.data()[i]) return false;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const auto places = example::places(argc, argv, 4);
  const auto mesh = pdo::make_mesh<"dp", "tp">(places, {2, places.size() / 2});
  pdo::tensor<int, 2> host({7, 5});  // uneven over both axes
  for (std::size_t i = 0; i < host.size(); ++i) host.data()[i] = static_cast<int>(i);
  const bool ok = tour_step<whole, rows>(mesh, host) && tour_step<rows, whole>(mesh, host) &&
                  tour_step<blocks, swapped>(mesh, host) && tour_step<row_sums, rows>(mesh, host) &&
                  tour_step<row_sums, blocks>(mesh, host) && tour_step<blocks, row_sums>(mesh, host) &&
                  tour_step<rows, row_sums>(mesh, host) && tour_step<cols, rows>(mesh, host);
  std::cout << (ok ? "every redistribution gave back the host tensor\n" : "WRONG\n");
  return ok ? 0 : 1;
}
