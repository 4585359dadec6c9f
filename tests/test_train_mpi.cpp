// tests/test_train_mpi.cpp: training over MPI processes, run under mpirun (with one or more
// places per process, PDO_TEST_PLACES_PER_RANK): the data-parallel trainer, a tensor-parallel
// model, a differentiable parallel_do, a pipeline whose stages live in different processes and
// a CNN whose images are split by rows over the processes, each against the same training on
// one place, step by step; and a data-parallel replica made different on purpose.
#define CATCH_CONFIG_RUNNER
#include "model_support.hpp"

#include <pdo/comm/mpi/environment.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <vector>

using pdo::replicate;
using pdo::split;
using pdo_test::labels_for;
using pdo_test::local_losses;
using pdo_test::make_mlp;

namespace {

std::size_t places_per_rank() {
  const char* v = std::getenv("PDO_TEST_PLACES_PER_RANK");
  return v ? static_cast<std::size_t>(std::atoi(v)) : 1;
}

auto sgd() {
  return [](auto params) { return pdo::nn::sgd<double>(std::move(params), {.lr = 0.2, .momentum = 0.5}); };
}

void check_losses(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t s = 0; s < got.size(); ++s) {
    INFO("step " << s);
    CHECK(got[s] == Approx(want[s]).epsilon(1e-10));
  }
}

/// @brief Calls `run(pipeline)` with make_mlp() cut into as many stages as `mesh` has places (1 to 4).
template <class Mesh, class Model, class Run>
void with_pipeline(const Mesh& mesh, const Model& model, const pdo::nn::pipeline_options& o, Run&& run) {
  const auto go = [&](auto&& trainer) { run(trainer); };
  switch (mesh.size()) {
    case 1: go(pdo::nn::make_pipeline<double, 2>(mesh, model, sgd(), o)); break;
    case 2: go(pdo::nn::make_pipeline<double, 2, 3>(mesh, model, sgd(), o)); break;
    case 3: go(pdo::nn::make_pipeline<double, 2, 1, 4>(mesh, model, sgd(), o)); break;
    default: go(pdo::nn::make_pipeline<double, 2, 1, 3, 5>(mesh, model, sgd(), o)); break;
  }
}

}  // namespace

TEST_CASE("MPI: the data-parallel trainer matches one place step by step", "[mpi][train][data_parallel]") {
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{11, 6}, 8);  // uneven over 2, 3 and 4 places
  const auto y = labels_for(11);
  const auto reference = local_losses(x, y, 4);
  const auto mesh = pdo::make_mesh<"dp">(pdo::mpi::world_places(places_per_rank()));
  for (bool zero1 : {false, true}) {
    INFO("ZeRO-1 " << zero1);
    auto trainer = pdo::nn::make_data_parallel<double>(mesh, make_mlp, sgd(), {.bucket_bytes = 256, .zero1 = zero1});
    std::vector<double> losses;
    for (int s = 0; s < 4; ++s) losses.push_back(trainer.step(x, y));
    check_losses(losses, reference);
    CHECK_NOTHROW(trainer.check_replicas());
  }
  // fit: shuffled epochs, the next batch prefetched while the current one trains
  const auto local = pdo::make_mesh<"dp">(pdo::cpu_places(1));
  auto one = pdo::nn::make_data_parallel<double>(local, make_mlp, sgd());
  auto many = pdo::nn::make_data_parallel<double>(mesh, make_mlp, sgd(), {.bucket_bytes = 256});
  double a = 0, b = 0, accuracy_one = 0, accuracy_many = 0;
  one.fit(x, y, {.epochs = 3, .batch_size = 4, .seed = 7}, [&](const auto& e) { a = e.loss; });
  many.fit(x, y, {.epochs = 3, .batch_size = 4, .seed = 7}, [&](const auto& e) { b = e.loss; });
  accuracy_one = one.accuracy(x, y);
  accuracy_many = many.accuracy(x, y);
  CHECK(b == Approx(a).epsilon(1e-10));
  CHECK(accuracy_many == accuracy_one);
  // a label that is no class: the same error on every process, whichever holds its row
  auto bad = y;
  bad(7) = -2;
  CHECK_THROWS_WITH(many.accuracy(x, bad), Catch::Contains("data_parallel::accuracy: 1 label of the batch is not a class index") &&
                                               Catch::Contains("the first is -2, at row 7"));
  CHECK(many.accuracy(x, y) == accuracy_one);
  // replicas made different on purpose (the factory draws from the process's rank) end up equal
  auto different = [] {
    pdo::nn::rng gen(100 + static_cast<unsigned>(pdo::mpi::rank()));
    return pdo::nn::sequential(pdo::nn::linear<double>(6, 4, gen));
  };
  if (pdo::mpi::size() > 1) {
    CHECK_THROWS_WITH(pdo::nn::make_data_parallel<double>(mesh, different, sgd(), {.broadcast_parameters = false, .check_replicas = true}),
                      Catch::Contains("replicas differ"));
  }
  auto synced = pdo::nn::make_data_parallel<double>(mesh, different, sgd(), {.check_replicas = true});
  CHECK_NOTHROW(synced.check_replicas());
}

TEST_CASE("MPI: a tensor-parallel model matches one place step by step", "[mpi][train][tp]") {
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{9, 6}, 5);
  const auto y = labels_for(9);
  const auto reference = local_losses(x, y, 4);
  const auto mesh = pdo::make_mesh<"tp">(pdo::mpi::world_places(places_per_rank()));
  auto model = pdo::nn::tensor_parallel<"tp">(mesh, make_mlp());
  pdo::nn::sgd<double> opt(pdo::nn::parameters_of<double>(model), {.lr = 0.2, .momentum = 0.5});
  const auto dx = pdo::var(pdo::distribute<pdo::layout<replicate, replicate>>(mesh, x));
  const auto dy = pdo::distribute<pdo::layout<replicate>>(mesh, y);
  std::vector<double> losses;
  for (int s = 0; s < 4; ++s) {
    opt.zero_grad();
    const auto loss = pdo::cross_entropy(model(dx), dy);
    pdo::backward(loss);
    opt.step();
    losses.push_back(pdo::gather(loss.value()).data()[0]);
  }
  check_losses(losses, reference);
  // the last step's gradients: their squared norm (each element once, summed over the
  // processes) is that of the gradients gathered as state; scattered back, they are unchanged
  double gathered = 0, norms = 0;
  for (const auto& p : pdo::nn::parameters_of<double>(model)) {
    INFO(p.name() << ": " << p.shape_text());
    std::vector<pdo::tensor<double, 1>> blocks;
    for (const auto g : p.grad_blocks()) {
      pdo::tensor<double, 1> b(pdo::shape_t<1>{g.size()});
      std::copy(g.begin(), g.end(), b.data());
      blocks.push_back(std::move(b));
    }
    const auto whole = p.gather_state(blocks);
    REQUIRE(whole.size() == p.size_global());
    for (std::size_t i = 0; i < whole.size(); ++i) gathered += whole.data()[i] * whole.data()[i];
    norms += p.grad_squared_norm();
    auto back = p.zero_state();
    p.scatter_state(whole.data(), back);
    REQUIRE(back.size() == blocks.size());
    for (std::size_t k = 0; k < back.size(); ++k)
      for (std::size_t i = 0; i < back[k].size(); ++i) CHECK(back[k].data()[i] == blocks[k].data()[i]);
  }
  CHECK(gathered > 0);
  CHECK(norms == Approx(gathered).epsilon(1e-12));
}

TEST_CASE("MPI: a differentiable parallel_do (an MLP block over split rows, SGD on every replica) matches one place step by step",
          "[mpi][train][parallel_do]") {
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{11, 5}, 21);
  const auto y = labels_for(11);
  const auto w1 = pdo_test::random_tensor<double>(pdo::shape_t<2>{5, 8}, 22), w2 = pdo_test::random_tensor<double>(pdo::shape_t<2>{8, 4}, 23);
  auto mlp = [](const auto& xl, const auto& a, const auto& b) { return pdo::matmul(pdo::relu(pdo::matmul(xl, a)), b); };
  auto W1 = pdo::parameter(w1), W2 = pdo::parameter(w2);
  pdo::nn::sgd<double> opt({{"w1", W1}, {"w2", W2}}, {.lr = 0.2, .momentum = 0.5});
  std::vector<double> want;
  for (int s = 0; s < 4; ++s) {
    const auto loss = pdo::cross_entropy(mlp(pdo::var(x), W1, W2), y);
    want.push_back(loss.value().data()[0]);
    opt.zero_grad();
    pdo::backward(loss);
    opt.step();
  }
  const auto mesh = pdo::make_mesh<"dp">(pdo::mpi::world_places(places_per_rank()));
  using rows = pdo::layout<split<"dp">, replicate>;
  using whole = pdo::layout<replicate, replicate>;
  const auto X = pdo::distribute<rows>(mesh, x);  // 11 rows: uneven over 2 and 4 places
  const auto Y = pdo::distribute<pdo::layout<split<"dp">>>(mesh, y);
  auto dW1 = pdo::parameter(pdo::distribute<whole>(mesh, w1)), dW2 = pdo::parameter(pdo::distribute<whole>(mesh, w2));
  pdo::nn::sgd<double> dopt({{"w1", dW1}, {"w2", dW2}}, {.lr = 0.2, .momentum = 0.5});
  std::vector<double> got;
  for (int s = 0; s < 4; ++s) {
    const auto loss = pdo::cross_entropy(pdo::parallel_do<rows>(mlp, pdo::var(X), dW1, dW2), Y);
    got.push_back(pdo::gather(loss.value()).data()[0]);
    dopt.zero_grad();
    pdo::backward(loss);
    dopt.step();
  }
  check_losses(got, want);
  const auto trained = pdo::gather(dW2.value());
  for (std::size_t i = 0; i < trained.size(); ++i) CHECK(trained.data()[i] == Approx(W2.value().data()[i]).epsilon(1e-10));
}

TEST_CASE("MPI: a pipeline whose stages live in different processes matches one place step by step", "[mpi][train][pp]") {
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{11, 6}, 8);
  const auto y = labels_for(11);
  const auto reference = local_losses(x, y, 3);
  const auto mesh = pdo::make_mesh<"pp">(pdo::mpi::world_places(places_per_rank()));
  const auto model = make_mlp();
  for (auto kind : {pdo::nn::pipeline_schedule::gpipe, pdo::nn::pipeline_schedule::one_f_one_b}) {
    INFO((kind == pdo::nn::pipeline_schedule::gpipe ? "GPipe" : "1F1B"));
    const pdo::nn::pipeline_options o{kind, 3};
    std::vector<double> losses;
    with_pipeline(mesh, model, o, [&](auto& trainer) {
      for (int s = 0; s < 3; ++s) losses.push_back(trainer.step(x, y));
    });
    check_losses(losses, reference);
  }
}

TEST_CASE("MPI: a CNN whose images are split by rows over the processes (halo exchanges over MPI) matches one place step by step",
          "[mpi][train][spatial]") {
  // 13 x 10 images: uneven row shards on 3 and 4 places; the 5 x 5 kernel reads two rows of each neighbour
  const pdo_test::cnn_problem d(2, 13, 10, 31);
  const auto train = [&](auto distribute_x, auto distribute_p) { return pdo_test::train_cnn(d, distribute_x, distribute_p, 1e-6, 3).first; };
  const auto same = [](const auto& t) { return t; };
  const auto reference = train(same, same);
  REQUIRE(reference.back() < reference.front());
  const auto places = pdo::mpi::world_places(places_per_rank());
  const auto replicated = [](const auto& m) {
    return [&m]<class T, std::size_t N>(const pdo::tensor<T, N>& t) { return pdo::distribute<pdo::detail::replicated_layout_t<N>>(m, t); };
  };
  {
    INFO("height split over " << places.size() << " places");
    const auto m = pdo::make_mesh<"sp">(places);
    check_losses(train([&](const auto& t) { return pdo::distribute<pdo::layout<replicate, replicate, split<"sp">, replicate>>(m, t); },
                       replicated(m)),
                 reference);
  }
  if (places.size() == 4) {
    INFO("height x width split over 2 x 2 places");
    const auto m = pdo::make_mesh<"sh", "sw">(places, {2, 2});
    check_losses(train([&](const auto& t) { return pdo::distribute<pdo::layout<replicate, replicate, split<"sh">, split<"sw">>>(m, t); },
                       replicated(m)),
                 reference);
  }
}

int main(int argc, char** argv) {
  pdo::mpi::initialize();
  const int result = Catch::Session().run(argc, argv);
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

TEST_CASE("MPI: the trainers refuse, on every process, a batch whose shape differs between processes, and train on after it",
          "[mpi][train][errors]") {
  const bool last = pdo::mpi::rank() + 1 == pdo::mpi::size();
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{11, 6}, 8);
  const auto y = labels_for(11);
  const auto x10 = pdo_test::random_tensor<double>(pdo::shape_t<2>{10, 6}, 8);
  const auto y10 = labels_for(10);
  const double first = local_losses(x, y, 1)[0];
  // (named matchers: a combination holds its parts by address)
  const auto differ = Catch::Contains("different shapes");
  const auto eleven = Catch::Contains("[11, 6] and [11]");
  const auto ten = Catch::Contains("[10, 6] and [10]");
  // the last process passes one row fewer: every process throws before anything trains, and
  // the next step, on the same batch everywhere, is the first step of the training
  const auto line = pdo::make_mesh<"dp">(pdo::mpi::world_places(places_per_rank()));
  auto trainer = pdo::nn::make_data_parallel<double>(line, make_mlp, sgd());
  CHECK_THROWS_WITH(last ? trainer.step(x10, y10) : trainer.step(x, y), Catch::Contains("data_parallel::step") && differ && eleven && ten);
  CHECK(trainer.step(x, y) == Approx(first).epsilon(1e-10));
  const auto stages = pdo::make_mesh<"pp">(pdo::mpi::world_places(places_per_rank()));
  with_pipeline(stages, make_mlp(), pdo::nn::pipeline_options{pdo::nn::pipeline_schedule::one_f_one_b, 3}, [&](auto& pipeline) {
    CHECK_THROWS_WITH(last ? pipeline.step(x10, y10) : pipeline.step(x, y), Catch::Contains("pipeline::step") && differ && eleven && ten);
    CHECK(pipeline.step(x, y) == Approx(first).epsilon(1e-10));
  });
}

TEST_CASE("MPI: a process that holds no place of a trainer's mesh is told so when it makes the trainer; the others train",
          "[mpi][train][errors]") {
  const bool last = pdo::mpi::rank() + 1 == pdo::mpi::size();
  const auto x = pdo_test::random_tensor<double>(pdo::shape_t<2>{11, 6}, 8);
  const auto y = labels_for(11);
  const double first = local_losses(x, y, 1)[0];
  // the places of every process but the last (made by every process: making a mesh is a meeting of all)
  auto places = pdo::mpi::world_places(places_per_rank());
  places.erase(places.end() - static_cast<std::ptrdiff_t>(places_per_rank()), places.end());
  const auto line = pdo::make_mesh<"dp">(places);
  const auto stages = pdo::make_mesh<"pp">(places);
  const auto no_place = Catch::Contains("this process holds no place of");
  // what gives a dtensor gives one with no shards there; spmd runs no task there
  const auto xs = pdo::distribute<pdo::layout<split<"dp">, replicate>>(line, x);
  const auto whole = pdo::redistribute<pdo::layout<replicate, replicate>>(xs);
  std::atomic<std::size_t> tasks{0};
  pdo::spmd(line, [&](std::size_t) { ++tasks; });
  CHECK(xs.local_shards().size() == (last ? 0 : places_per_rank()));
  CHECK(whole.local_shards().size() == xs.local_shards().size());
  CHECK(tasks == xs.local_shards().size());
  if (last) {
    CHECK_THROWS_WITH(pdo::eval(xs * 2.0), Catch::Contains("eval of multiply: ") && no_place);
    CHECK_THROWS_WITH(pdo::gather(xs), Catch::Contains("gather: ") && no_place);
    CHECK_THROWS_WITH(pdo::nn::make_data_parallel<double>(line, make_mlp, sgd()), Catch::Contains("data_parallel: ") && no_place);
    CHECK_THROWS_WITH(with_pipeline(stages, make_mlp(), {}, [](auto&) {}), Catch::Contains("pipeline: ") && no_place);
  } else {
    auto trainer = pdo::nn::make_data_parallel<double>(line, make_mlp, sgd());
    CHECK(trainer.step(x, y) == Approx(first).epsilon(1e-10));
    with_pipeline(stages, make_mlp(), {}, [&](auto& pipeline) { CHECK(pipeline.step(x, y) == Approx(first).epsilon(1e-10)); });
  }
}
