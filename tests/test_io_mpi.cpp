// tests/test_io_mpi.cpp: checkpoints over MPI processes. `save DIR` writes, from every
// process, the shards of its places (two places per process when PLACES=2); `load DIR` reads
// them back on another process count, into other layouts, and checks every value;
// `corrupt DIR` damages one shard that only some processes read and checks that every
// process gets a pdo::io_error. Beside the checkpoint, in DIR.pipeline, a pipeline whose
// stages live in different processes is saved after 3 steps by its places, and loaded into a
// pipeline of another cut on the other process count, whose 4th step is one place's. A
// tensor-parallel model's parameters and a local model's are saved to safetensors by every
// process at once, and read back.
#include <pdo/io.hpp>
#include <pdo/nn.hpp>
#include <pdo/pdo.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

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

/// @brief A small MLP (5 layers), the same on every process.
auto make_model() {
  namespace nn = pdo::nn;
  nn::rng gen(5);
  return nn::sequential(nn::linear<double>(6, 8, gen), nn::tanh{}, nn::linear<double>(8, 5, gen), nn::relu{}, nn::linear<double>(5, 3, gen));
}

/// @brief An MLP of two column/row pairs (for tensor parallelism), the same on every process.
auto make_pairs() {
  namespace nn = pdo::nn;
  nn::rng gen(6);
  return nn::sequential(nn::linear<double>(6, 8, gen), nn::tanh{}, nn::linear<double>(8, 5, gen), nn::relu{}, nn::linear<double>(5, 7, gen),
                        nn::gelu{}, nn::linear<double>(7, 3, gen));
}

auto make_sgd() {
  return [](auto params) { return pdo::nn::sgd<double>(std::move(params), {.lr = 0.2, .momentum = 0.5}); };
}

/// @brief f(pipeline) for a pipeline of make_model over the "pp" axis of `m` (2, 3 or 4 stages).
template <class Mesh, class F>
void with_pipeline(const Mesh& m, F&& f) {
  const auto model = make_model();
  switch (m.size()) {
    case 2: { auto pl = pdo::nn::make_pipeline<double, 2, 2>(m, model, make_sgd()); f(pl); break; }
    case 3: { auto pl = pdo::nn::make_pipeline<double, 2, 1, 3>(m, model, make_sgd()); f(pl); break; }
    default: { auto pl = pdo::nn::make_pipeline<double, 2, 1, 2, 4>(m, model, make_sgd()); f(pl); break; }
  }
}

/// @brief The losses of `steps` steps of `make()`'s model on one place, on `x` and `y`.
template <class Make>
std::vector<double> one_place(Make make, const pdo::tensor<double, 2>& x, const pdo::tensor<int, 1>& y, int steps) {
  auto model = make();
  auto opt = make_sgd()(pdo::nn::parameters_of<double>(model));
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    const auto loss = pdo::cross_entropy(model(pdo::var(x)), y);
    pdo::backward(loss);
    opt.step();
    losses.push_back(loss.value().data()[0]);
  }
  return losses;
}

/// @brief One step of SGD on a tensor-parallel model over mesh `m`, on x and y replicated: its loss.
template <class Mesh, class Model, class Opt>
double tp_step(const Mesh& m, Model& model, Opt& opt, const pdo::tensor<double, 2>& x, const pdo::tensor<int, 1>& y) {
  const auto dx = pdo::var(pdo::distribute<pdo::layout<replicate, replicate>>(m, x));
  const auto dy = pdo::distribute<pdo::layout<replicate>>(m, y);
  opt.zero_grad();
  const auto loss = pdo::cross_entropy(model(dx), dy);
  pdo::backward(loss);
  opt.step();
  return pdo::gather(loss.value()).data()[0];
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
  const auto pp = pdo::make_mesh<"pp">(mesh.places());
  const auto px = reference<double, 2>({10, 6}, 5);
  pdo::tensor<int, 1> py({10});
  for (std::size_t i = 0; i < 10; ++i) py(i) = static_cast<int>(i % 3);
  const auto reference_losses = one_place([] { return make_model(); }, px, py, 4);
  const auto tp_losses = one_place([] { return make_pairs(); }, px, py, 4);
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
      with_pipeline(pp, [&](auto& pl) {
        for (int s = 0; s < 3; ++s) check(std::abs(pl.step(px, py) - reference_losses[s]) <= 1e-10, "pipeline step " + std::to_string(s));
        pdo::io::save(dir.string() + ".pipeline", pl);
      });
      // a tensor-parallel model and its optimizer, each place writing its own shards
      const auto tp = pdo::make_mesh<"tp">(mesh.places());
      auto model = pdo::nn::tensor_parallel<"tp">(tp, make_pairs());
      auto opt = make_sgd()(pdo::nn::parameters_of<double>(model));
      for (int s = 0; s < 3; ++s)
        check(std::abs(tp_step(tp, model, opt, px, py) - tp_losses[s]) <= 1e-10, "tensor-parallel step " + std::to_string(s));
      pdo::io::checkpoint state;
      state.spanning(tp);
      pdo::io::add_state(state, "", pdo::nn::parameters_of<double>(model), opt);
      pdo::io::save(dir.string() + ".tp", state);
      // its parameters as one safetensors file, saved by every process (three times over): the
      // process of the mesh's first place writes it, the others wait for it; a local model,
      // which every process writes, leaves one whole file however the writes interleave
      {
        const std::string file = dir.string() + ".safetensors", local_file = dir.string() + ".local.safetensors";
        for (int round = 0; round < 3; ++round) pdo::io::save_parameters<double>(file, model);
        const auto local = make_model();
        for (int round = 0; round < 10; ++round) pdo::io::save_parameters<double>(local_file, local);
        auto back = make_pairs();
        pdo::io::load_parameters<double>(back, file);
        const auto saved = pdo::nn::parameters_of<double>(model), loaded = pdo::nn::parameters_of<double>(back);
        bool equal = saved.size() == loaded.size();
        for (std::size_t i = 0; equal && i < saved.size(); ++i) {
          const auto whole = saved[i].global_values();
          equal = std::equal(whole.begin(), whole.end(), loaded[i].value().begin());
        }
        check(equal, "a tensor-parallel model's parameters saved to safetensors by every process: read back as they are");
        auto local_copy = make_model();
        for (const auto& q : pdo::nn::parameters_of<double>(local_copy)) std::fill(q.value().begin(), q.value().end(), 0.0);
        pdo::io::load_parameters<double>(local_copy, local_file);
        const auto a0 = pdo::nn::parameters_of<double>(local), a1 = pdo::nn::parameters_of<double>(local_copy);
        for (std::size_t i = 0; i < a0.size(); ++i)
          check(std::equal(a0[i].value().begin(), a0[i].value().end(), a1[i].value().begin()), "a local model saved by every process: " + a0[i].name());
        // the writer's failure is an error on every process
        std::string message = "no error";
        try {
          pdo::io::save_parameters<double>(dir.string() + ".nowhere/m.safetensors", model);
        } catch (const pdo::io_error& e) {
          message = e.what();
        }
        check(message.find(pdo::mpi::rank() == 0 ? "m.safetensors" : "process 0, which writes the file, failed") != std::string::npos,
              "a failed save of parameters: " + message);
      }
      // blocks held only by the places of the processes after the first, in a checkpoint
      // whose metadata the first process writes: it learns from them what they wrote
      std::vector<pdo::any_place> later_places;
      for (const auto& q : mesh.places())
        if (q.process() != 0) later_places.push_back(q);
      const auto later = pdo::make_mesh<"x">(later_places);
      const auto whole = reference<float, 1>({12}, 6);
      std::vector<std::vector<float>> held(later.size());
      pdo::io::checkpoint blocks;
      blocks.spanning(mesh);
      blocks.add_blocks<float, 1>("later", later, {12}, [&](std::size_t q) {
        const std::size_t at = pdo::detail::chunk_offset(12, later.size(), q), n = pdo::detail::chunk_size(12, later.size(), q);
        held[q].assign(whole.data() + at, whole.data() + at + n);
        return pdo::io::held_block<float>{{at}, {n}, held[q].data()};
      });
      pdo::io::save(dir.string() + ".later", blocks);
      check(same(pdo::io::read<float, 1>(dir.string() + ".later", "later"), whole),
            "blocks of a mesh without the writer's places: saved, listed in the metadata, read back whole");
      // a checkpoint spanning no mesh, saved by every process into one folder at once: the
      // saves take turns, each whole, and the folder holds one checkpoint after them
      {
        auto h = reference<double, 2>({300, 300}, 7);
        std::int64_t count = 7;
        pdo::io::checkpoint own;
        own.add("h", h).add("count", count);
        for (int round = 0; round < 3; ++round) pdo::io::save(dir.string() + ".own", own);
        check(same(pdo::io::read<double, 2>(dir.string() + ".own", "h"), h), "a checkpoint saved by every process at once: whole");
      }
      // processes whose checkpoints differ: an error on every one, naming what this one holds
      {
        auto xa = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, a);
        std::int64_t extra = 1;
        pdo::io::checkpoint differ;
        differ.add("a", xa);
        if (pdo::mpi::rank() == pdo::mpi::size() - 1) differ.add("extra", extra);
        for (const bool saving : {true, false}) {
          std::string message = "no error";
          try {
            if (saving) pdo::io::save(dir.string() + ".differ", differ);
            else pdo::io::load(dir, differ);
          } catch (const pdo::io_error& e) {
            message = e.what();
          }
          check(message.find("the processes' checkpoints hold other entries") != std::string::npos &&
                    message.find(pdo::mpi::rank() == pdo::mpi::size() - 1 ? "(this process's 2: a, extra)" : "(this process's 1: a)") !=
                        std::string::npos,
                std::string(saving ? "save" : "load") + " of checkpoints that differ between processes: " + message);
        }
        check(!std::filesystem::exists(dir.string() + ".differ"), "a refused save leaves nothing");
      }
      // processes that name other folders (the first process the checkpoint saved above, the
      // others folders of their own): an error on every process, before anything is written
      // or read; the checkpoint is left whole
      {
        auto xa = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, a);
        pdo::io::checkpoint elsewhere;
        elsewhere.add("a", xa);
        const std::filesystem::path own = pdo::mpi::rank() == 0 ? dir : std::filesystem::path(dir.string() + ".own" + std::to_string(pdo::mpi::rank()));
        for (const bool saving : {true, false}) {
          std::string message = "no error";
          try {
            if (saving) pdo::io::save(own, elsewhere);
            else pdo::io::load(own, elsewhere);
          } catch (const pdo::io_error& e) {
            message = e.what();
          }
          check(message.find("the processes name other folders (this process's: " + own.string() + ")") != std::string::npos,
                std::string(saving ? "save" : "load") + " into folders that differ between processes: " + message);
        }
        check(pdo::mpi::rank() == 0 || !std::filesystem::exists(own.string() + ".partial"), "a refused save leaves nothing");
        check(same(pdo::io::read<float, 2>(dir, "a"), a), "the checkpoint another process's folder differed for: whole");
      }
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
      with_pipeline(pp, [&](auto& pl) {
        pdo::io::load(dir.string() + ".pipeline", pl);
        const double loss = pl.step(px, py);
        check(std::abs(loss - reference_losses[3]) <= 1e-10,
              "the pipeline loaded on " + pp.describe() + " takes the 4th step of one place: " + std::to_string(loss) + " against " +
                  std::to_string(reference_losses[3]));
      });
      // the tensor-parallel model, its shards cut for this process count
      const auto tp = pdo::make_mesh<"tp">(mesh.places());
      auto model = pdo::nn::tensor_parallel<"tp">(tp, make_pairs());
      auto opt = make_sgd()(pdo::nn::parameters_of<double>(model));
      pdo::io::checkpoint state;
      state.spanning(tp);
      pdo::io::add_state(state, "", pdo::nn::parameters_of<double>(model), opt);
      pdo::io::load(dir.string() + ".tp", state);
      const double loss = tp_step(tp, model, opt, px, py);
      check(std::abs(loss - tp_losses[3]) <= 1e-10, "the tensor-parallel model loaded on " + tp.describe() +
                                                        " takes the 4th step of one place: " + std::to_string(loss) + " against " +
                                                        std::to_string(tp_losses[3]));
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
      // an entry after "a" whose load is collective over the processes (as a parameter loaded
      // whole is): the process that found "a" corrupt must not stop before it while the
      // others go on into it
      bool host_loaded = false;
      ck.add_computed<double, 1>(
          "host", {4}, [] { return pdo::tensor<double, 1>({4}); },
          [&](const pdo::tensor<double, 1>& t) {
            (void)pdo::distribute<pdo::layout<replicate>>(mesh, t);
            host_loaded = true;
          });
      pdo::spmd(mesh, [](std::size_t) {});  // rank 0 has damaged its copy
      std::string message;
      try {
        pdo::io::load(damaged, ck);
      } catch (const pdo::io_error& e) {
        message = e.what();
      }
      check(message.find("corrupt") != std::string::npos || message.find("failed (its error says why)") != std::string::npos,
            "every process gets an io_error, got: \"" + message + "\"");
      check(!host_loaded, "the load ends at the corrupt entry on every process");
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
