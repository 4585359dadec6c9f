// tests/cuda/test_cuda.cu: the CUDA backend against the CPU path, on every visible GPU.
// Each check runs the same program on CPU places and on GPU places and compares the
// results. Without a GPU the program reports itself skipped (exit 77) with the reason.
#include <pdo/nn.hpp>
#include <pdo/pdo.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <variant>
#include <vector>

#include <unistd.h>

#if !defined(PDO_WITH_CUDA)
#error "test_cuda.cu must be built with PDO_WITH_CUDA (link pdo::cuda)"
#endif

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

template <class T, std::size_t R>
bool close(const pdo::tensor<T, R>& a, const pdo::tensor<T, R>& b, double tolerance) {
  if (a.shape() != b.shape()) return false;
  const auto ha = pdo::to_host(a), hb = pdo::to_host(b);
  for (std::size_t i = 0; i < ha.size(); ++i) {
    const auto x = static_cast<double>(ha.data()[i]), y = static_cast<double>(hb.data()[i]);
    if (std::isnan(x) || std::isnan(y)) {  // NaN only where the other has NaN
      if (std::isnan(x) != std::isnan(y)) return false;
      continue;
    }
    if (x == y) continue;  // infinities of one sign
    if (!(std::abs(x - y) <= tolerance * (1 + std::abs(y)))) return false;
  }
  return true;
}

template <class T, std::size_t R>
pdo::tensor<T, R> filled(const pdo::shape_t<R>& shape, unsigned seed) {
  auto t = pdo::tensor<T, R>::on_host(shape);  // also when called inside a GPU place's task
  for (std::size_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(((i * 2654435761u + seed) % 1000) / 500.0 - 1.0);
  return t;
}

/// @brief Labels 0, 1, 2, 0, 1, ... of `rows` samples (three classes).
pdo::tensor<int, 1> three_classes(std::size_t rows) {
  pdo::tensor<int, 1> y({rows});
  for (std::size_t i = 0; i < rows; ++i) y(i) = static_cast<int>(i % 3);
  return y;
}

/// @brief The 6-8-3 MLP the trainers' checks train, its weights drawn from `seed`.
auto small_mlp(std::uint64_t seed) {
  pdo::nn::rng gen(seed);
  return pdo::nn::sequential(pdo::nn::linear<float>(6, 8, gen), pdo::nn::relu{}, pdo::nn::linear<float>(8, 3, gen));
}

/// @brief Runs `program(mesh)` on a "dp" mesh of CPU places and of GPU places (as many of
/// each) and compares the host tensors they return.
template <class Program>
void same_on_both(const std::string& what, const std::vector<pdo::cuda_place>& gpus, Program program, double tolerance) {
  try {
    const auto cpu = program(pdo::make_mesh<"dp">(pdo::cpu_places(gpus.size()), {gpus.size()}));
    const auto gpu = program(pdo::make_mesh<"dp">(gpus, {gpus.size()}));
    check(close(gpu, cpu, tolerance), what);
  } catch (const std::exception& e) {
    check(false, what + ": " + e.what());
  }
}

void places_and_memory(const std::vector<pdo::cuda_place>& gpus) {
  const auto& g = gpus.front();
  const auto before = g.memory().stats();
  {
    pdo::tensor<float, 2> t({256, 256}, g);  // zero-filled on the device
    check(g.memory().stats().bytes_in_use >= before.bytes_in_use + t.bytes(), "a GPU tensor counts in its place's statistics");
    const auto host = pdo::to_host(t);
    bool zero = true;
    for (float v : host) zero = zero && v == 0.0f;
    check(zero, "a GPU tensor starts zero-filled");
    t.fill(2.5f);
    const auto again = pdo::to_host(t);
    check(again.data()[0] == 2.5f && again.data()[again.size() - 1] == 2.5f, "fill on a GPU place");
  }
  check(g.memory().stats().bytes_in_use == before.bytes_in_use, "freed GPU blocks return to the cache");
  pdo::cuda_place capped(g.device(), std::size_t{1} << 20);
  bool refused = false;
  try {
    pdo::tensor<float, 1> big({std::size_t{1} << 20}, capped);
  } catch (const pdo::out_of_memory& e) {
    refused = std::string(e.what()).find("cuda:") != std::string::npos;
  }
  check(refused, "a GPU place's cap gives pdo::out_of_memory naming the place");
  pdo::cuda_event e;
  e.record(g.compute_stream());
  e.wait(g.comm_stream());
  g.synchronize();
  check(e.done(), "events order the compute and communication streams");
}

void copies(const std::vector<pdo::cuda_place>& gpus) {
  const auto host = filled<double, 2>({37, 129}, 3);
  for (const auto& a : gpus)
    for (const auto& b : gpus)
      for (auto how : {pdo::peer_copy::direct, pdo::peer_copy::staged}) {
        const auto on_a = pdo::to_place(host, a);
        const auto on_b = pdo::to_place(on_a, b, how);
        check(close(pdo::to_host(on_b), host, 0), a.name() + " -> " + b.name() + (how == pdo::peer_copy::direct ? " peer" : " staged") +
                                                        " copy");
      }
  // larger than the two staging buffers together: several chunks in flight
  if (gpus.size() > 1) {
    const auto big = filled<float, 1>({std::size_t{5} << 20}, 4);
    const auto on_b = pdo::to_place(pdo::to_place(big, gpus[0]), gpus[1], pdo::peer_copy::staged);
    check(close(pdo::to_host(on_b), big, 0), "a staged copy of 20 MiB between GPUs");
  }
}

void expressions(const std::vector<pdo::cuda_place>& gpus) {
  using pdo::replicate;
  using pdo::split;
  const auto a = filled<float, 2>({23, 17}, 1), b = filled<float, 2>({23, 17}, 2), c = filled<float, 2>({17, 9}, 5);
  same_on_both("fused elementwise relu(a * b + 1) on GPU places", gpus, [&](const auto& m) {
    const auto x = pdo::distribute<pdo::layout<split<"dp">, replicate>>(m, a);
    const auto y = pdo::distribute<pdo::layout<split<"dp">, replicate>>(m, b);
    return pdo::gather(pdo::eval(pdo::relu(x * y + 1.0f)));
  }, 1e-6);
  same_on_both("cast to int and back, of a split and of a partial operand (summed first)", gpus, [&](const auto& m) {
    const auto x = pdo::distribute<pdo::layout<replicate, split<"dp">>>(m, a);
    const auto p = pdo::distribute<pdo::layout<replicate, replicate>::partial<"dp">>(m, b);
    return pdo::gather(pdo::eval(pdo::cast<float>(pdo::cast<int>(x * 100.0f)) + pdo::cast<float>(pdo::cast<int>(p * 100.0f))));
  }, 0.0);
  same_on_both("matmul (cuBLAS) of row-split by replicated", gpus, [&](const auto& m) {
    const auto x = pdo::distribute<pdo::layout<split<"dp">, replicate>>(m, a);
    const auto w = pdo::distribute<pdo::layout<replicate, replicate>>(m, c);
    return pdo::gather(pdo::eval(pdo::matmul(x, w)));
  }, 1e-5);
  same_on_both("matmul with K split: partial sums all_reduced (NCCL)", gpus, [&](const auto& m) {
    const auto x = pdo::distribute<pdo::layout<replicate, split<"dp">>>(m, a);
    const auto w = pdo::distribute<pdo::layout<split<"dp">, replicate>>(m, c);
    return pdo::gather(pdo::eval(pdo::matmul(x, w)));
  }, 1e-5);
  // stored transposed, read in place by cuBLAS as a transposed operand (no transpose kernel)
  const auto ct = pdo::eval(pdo::transpose(c)), at = pdo::eval(pdo::transpose(a));
  same_on_both("matmul reading a transposed shard in place, K split: partial sums all_reduced", gpus, [&](const auto& m) {
    const auto x = pdo::distribute<pdo::layout<replicate, split<"dp">>>(m, a);
    const auto w = pdo::distribute<pdo::layout<replicate, split<"dp">>>(m, ct);
    return pdo::gather(pdo::eval(pdo::relu(pdo::matmul(x, pdo::transpose(w)))));
  }, 1e-5);
  same_on_both("matmul reading a transposed shard in place, rows split", gpus, [&](const auto& m) {
    const auto x = pdo::distribute<pdo::layout<replicate, split<"dp">>>(m, at);
    const auto w = pdo::distribute<pdo::layout<replicate, replicate>>(m, c);
    return pdo::gather(pdo::eval(pdo::matmul(pdo::transpose(x), w)));
  }, 1e-5);
  const auto batch = filled<double, 3>({6, 5, 4}, 7), right = filled<double, 3>({6, 4, 3}, 8);
  same_on_both("batched matmul (cuBLAS strided batched)", gpus, [&](const auto& m) {
    const auto x = pdo::distribute<pdo::layout<split<"dp">, replicate, replicate>>(m, batch);
    const auto y = pdo::distribute<pdo::layout<split<"dp">, replicate, replicate>>(m, right);
    return pdo::gather(pdo::eval(pdo::matmul(x, y)));
  }, 1e-12);
  same_on_both("sum over a split dim and softmax", gpus, [&](const auto& m) {
    const auto x = pdo::distribute<pdo::layout<split<"dp">, replicate>>(m, a);
    const auto s = pdo::eval(pdo::softmax<1>(x));
    return pdo::gather(pdo::eval(pdo::sum<0>(s)));
  }, 1e-5);
  // rows of 300 and 1000: on a GPU, segmented reductions (a block of threads per row under nvcc)
  const auto wide = filled<double, 3>({5, 300, 7}, 9);
  const auto logits = filled<double, 2>({9, 1000}, 10);
  same_on_both("sum, mean and max along a long dim, on a split and a whole one", gpus, [&](const auto& m) {
    const auto x = pdo::distribute<pdo::layout<split<"dp">, replicate, replicate>>(m, wide);
    const auto s = pdo::gather(pdo::eval(pdo::sum<1>(x))), mean = pdo::gather(pdo::eval(pdo::mean<1>(x)));
    const auto top = pdo::gather(pdo::eval(pdo::max<1>(x))), over_split = pdo::gather(pdo::eval(pdo::sum<0>(x)));
    pdo::tensor<double, 1> all({s.size() + mean.size() + top.size() + over_split.size()});
    std::size_t at = 0;
    for (const auto* t : {&s, &mean, &top, &over_split}) {
      std::copy(t->data(), t->data() + t->size(), all.data() + at);
      at += t->size();
    }
    return all;
  }, 1e-12);
  // rows with infinities: one +inf (NaN throughout, as PyTorch gives), two (ties at +inf), -inf
  auto spiked = filled<double, 2>({9, 1000}, 10);
  auto spiked_wide = filled<double, 3>({5, 300, 7}, 9);
  const double inf = std::numeric_limits<double>::infinity();
  spiked(1, 5) = inf;
  spiked(2, 3) = spiked(2, 700) = inf;
  spiked(3, 0) = spiked(3, 999) = -inf;
  spiked(4, 17) = spiked(4, 18) = 1.0;  // ties at a finite max
  spiked_wide(0, 10, 0) = inf;
  spiked_wide(1, 20, 3) = -inf;
  same_on_both("softmax and log_softmax along long rows (300 elements 7 apart; 1000 contiguous), with infinities", gpus,
               [&](const auto& m) {
    const auto x = pdo::distribute<pdo::layout<split<"dp">, replicate, replicate>>(m, spiked_wide);
    const auto y = pdo::distribute<pdo::layout<split<"dp">, replicate>>(m, spiked);
    const auto a = pdo::gather(pdo::eval(pdo::softmax<1>(x))), b = pdo::gather(pdo::eval(pdo::log_softmax<1>(x)));
    const auto c = pdo::gather(pdo::eval(pdo::softmax<1>(y))), d = pdo::gather(pdo::eval(pdo::log_softmax<1>(y)));
    pdo::tensor<double, 1> all({a.size() + b.size() + c.size() + d.size()});
    std::copy(a.data(), a.data() + a.size(), all.data());
    std::copy(b.data(), b.data() + b.size(), all.data() + a.size());
    std::copy(c.data(), c.data() + c.size(), all.data() + a.size() + b.size());
    std::copy(d.data(), d.data() + d.size(), all.data() + a.size() + b.size() + c.size());
    return all;
  }, 1e-12);
  same_on_both("layer_norm over rows of 1000 (segmented means), rows split; the var's gradient", gpus, [&](const auto& m) {
    const auto x = pdo::distribute<pdo::layout<split<"dp">, replicate>>(m, logits);
    const auto y = pdo::gather(pdo::eval(pdo::layer_norm(x)));
    auto v = pdo::parameter(x);
    pdo::backward(pdo::sum(pdo::layer_norm(v) * pdo::var(x)));
    const auto grad = pdo::gather(v.grad());
    pdo::tensor<double, 1> all({y.size() + grad.size()});
    std::copy(y.data(), y.data() + y.size(), all.data());
    std::copy(grad.data(), grad.data() + grad.size(), all.data() + y.size());
    return all;
  }, 1e-10);
  same_on_both("cross_entropy over 1000 classes, rows split, and its gradient", gpus, [&](const auto& m) {
    pdo::tensor<int, 1> labels({9});
    for (std::size_t i = 0; i < 9; ++i) labels(i) = static_cast<int>((i * 337) % 1000);
    const auto y = pdo::distribute<pdo::layout<split<"dp">, replicate>>(m, logits);
    const auto l = pdo::distribute<pdo::layout<split<"dp">>>(m, labels);
    auto w = pdo::parameter(y);
    const auto loss = pdo::cross_entropy(w, l);
    pdo::backward(loss);
    const auto grad = pdo::gather(w.grad());
    pdo::tensor<double, 1> all({grad.size() + 1});
    std::copy(grad.data(), grad.data() + grad.size(), all.data());
    all.data()[grad.size()] = pdo::gather(loss.value())();
    return all;
  }, 1e-12);
  same_on_both("the squared norms of gradients of parameters split by rows, replicated and local, and of their sum", gpus,
               [&](const auto& m) {
    auto rows = pdo::parameter(pdo::distribute<pdo::layout<split<"dp">, replicate>>(m, a));
    auto whole = pdo::parameter(pdo::distribute<pdo::layout<replicate, replicate>>(m, b));
    auto local = pdo::parameter(pdo::to_place(c, m.place(m.size() - 1)));
    pdo::backward(pdo::sum(rows * rows));
    pdo::backward(pdo::sum(whole * whole));
    pdo::backward(pdo::sum(local * local));
    const std::vector<pdo::nn::parameter_ref<float>> params{{"rows", rows}, {"whole", whole}, {"local", local}};
    pdo::tensor<double, 1> norms({4});
    for (std::size_t k = 0; k < 3; ++k) norms(k) = params[k].grad_squared_norm();
    norms(3) = pdo::nn::grad_squared_norm(params);
    // the gradient of sum(x * x) is 2x: its squared norm is 4 |x|^2, here added on the host
    double expected = 0;
    for (const auto* t : {&a, &b, &c})
      for (std::size_t i = 0; i < t->size(); ++i) expected += 4.0 * t->data()[i] * t->data()[i];
    check(std::abs(norms(3) - expected) <= 1e-9 * expected, "grad_squared_norm of split, replicated and local parameters on " + m.describe());
    return norms;
  }, 1e-12);
  same_on_both("redistribute split rows -> split columns (all_to_all)", gpus, [&](const auto& m) {
    const auto x = pdo::distribute<pdo::layout<split<"dp">, replicate>>(m, a);
    return pdo::gather(pdo::redistribute<pdo::layout<replicate, split<"dp">>>(x));
  }, 0);
}

void convolution(const std::vector<pdo::cuda_place>& gpus) {
  const auto x = filled<float, 4>({2, 3, 9, 9}, 11), w = filled<float, 4>({4, 3, 3, 3}, 12);
  const auto bias = filled<float, 1>({4}, 13);
  same_on_both("conv2d forward and backward (im2col + cuBLAS) in spmd tasks", gpus, [&](const auto& m) {
    std::vector<pdo::tensor<float, 4>> out(m.local_places().size());
    pdo::spmd(m, [&](std::size_t p) {
      const auto& place = m.place(p);
      auto xv = pdo::var(pdo::to_place(x, place));
      auto wv = pdo::parameter(pdo::to_place(w, place));
      auto bv = pdo::parameter(pdo::to_place(bias, place));
      const auto y = pdo::conv2d(xv, wv, bv, {1, 1});
      pdo::backward(pdo::sum(y * y));
      if (p == 0) out[0] = pdo::to_host(wv.grad());
    });
    return out[0];
  }, 1e-4);
}

/// @brief The elements of host tensors one after the other.
template <class T, class... Tensors>
pdo::tensor<T, 1> joined(const pdo::tensor<T, 4>& first, const Tensors&... rest) {
  pdo::tensor<T, 1> all({first.size() + (rest.size() + ...)});
  std::size_t at = 0;
  for (const auto* t : {&first, &rest...}) {
    std::copy(t->data(), t->data() + t->size(), all.data() + at);
    at += t->size();
  }
  return all;
}

/// @brief conv2d and max pooling of images split by rows (and by rows and columns on 4
/// places) over GPU places: the halo rows travel by NCCL all_to_all, the halo gradients back
/// the same way; the results and the input and weight gradients follow the CPU places.
void spatial(const std::vector<pdo::cuda_place>& gpus) {
  using pdo::replicate;
  using pdo::split;
  const auto x = filled<float, 4>({2, 3, 11, 9}, 21), w = filled<float, 4>({4, 3, 5, 5}, 22);
  const auto bias = filled<float, 1>({4}, 23);
  // the output, then the input's gradient, then the weight's, each flattened
  auto program = [&]<class LX>(const auto& m) {
    auto X = pdo::parameter(pdo::distribute<LX>(m, x));
    auto W = pdo::parameter(pdo::distribute<pdo::layout<replicate, replicate, replicate, replicate>>(m, w));
    auto B = pdo::parameter(pdo::distribute<pdo::layout<replicate>>(m, bias));
    const auto y = pdo::max_pool2d(pdo::conv2d(X, W, B, {1, 2}), 3, {2, 1});
    pdo::backward(pdo::sum(y * y));
    return joined(pdo::gather(y.value()), pdo::gather(X.grad()), pdo::gather(W.grad()));
  };
  auto on = [&]<class LX>(const auto& places, auto make) { return program.template operator()<LX>(make(places)); };
  using H = pdo::layout<replicate, replicate, split<"sp">, replicate>;
  const auto line = [](const auto& places) { return pdo::make_mesh<"sp">(places); };
  try {
    const auto cpu = on.template operator()<H>(pdo::cpu_places(gpus.size()), line);
    const auto gpu = on.template operator()<H>(gpus, line);
    check(close(gpu, cpu, 1e-4), "conv2d and max_pool2d with the rows split over GPU places (halos by NCCL), forward and backward");
    if (gpus.size() == 4) {
      using HW = pdo::layout<replicate, replicate, split<"sh">, split<"sw">>;
      const auto grid = [](const auto& places) { return pdo::make_mesh<"sh", "sw">(places, {2, 2}); };
      const auto cpu2 = on.template operator()<HW>(pdo::cpu_places(4), grid);
      const auto gpu2 = on.template operator()<HW>(gpus, grid);
      check(close(gpu2, cpu2, 1e-4), "conv2d and max_pool2d with rows and columns split over 2 x 2 GPU places");
    }
  } catch (const std::exception& e) {
    check(false, std::string("spatial split on GPU places: ") + e.what());
  }
}

void collectives(const std::vector<pdo::cuda_place>& gpus) {
  const std::size_t n = gpus.size();
  same_on_both("all_reduce, uneven all_gather and reduce_scatter, broadcast, all_to_all, send/recv", gpus, [&](const auto& m) {
    // every collective's result lands in one host tensor per place; place 0's is returned
    std::vector<pdo::tensor<double, 1>> out(m.local_places().size());
    pdo::spmd(m, [&](std::size_t p) {
      const auto comm = pdo::communicator_of(m, p);
      const auto& place = m.place(p);
      auto v = pdo::to_place(filled<double, 1>({10 + p}, static_cast<unsigned>(p)), place);
      auto sum = pdo::to_place(filled<double, 1>({10}, static_cast<unsigned>(p)), place);
      comm.all_reduce(sum.span());
      std::size_t total = 0;
      for (std::size_t k = 0; k < n; ++k) total += 10 + k;
      pdo::tensor<double, 1> gathered({total}, place);
      comm.all_gather(std::as_const(v).span(), gathered.span());
      pdo::tensor<double, 1> segment({10 + p}, place);
      comm.reduce_scatter(std::as_const(gathered).span(), segment.span());
      pdo::tensor<double, 1> root = pdo::to_place(filled<double, 1>({6}, 40 + static_cast<unsigned>(p)), place);
      comm.broadcast(root.span(), n - 1);
      std::vector<std::size_t> counts(n, 2);
      pdo::tensor<double, 1> mine = pdo::to_place(filled<double, 1>({2 * n}, 50 + static_cast<unsigned>(p)), place), theirs({2 * n}, place);
      comm.all_to_all(std::as_const(mine).span(), std::span<const std::size_t>(counts), theirs.span(), std::span<const std::size_t>(counts));
      pdo::tensor<double, 1> ring({3}, place);
      if (n > 1) {
        const auto next = (p + 1) % n, prev = (p + n - 1) % n;
        const auto payload = pdo::to_place(filled<double, 1>({3}, 60 + static_cast<unsigned>(p)), place);
        if (p % 2 == 0) {
          comm.send(payload.span(), next, 5);
          comm.recv(ring.span(), prev, 5);
        } else {
          comm.recv(ring.span(), prev, 5);
          comm.send(payload.span(), next, 5);
        }
      }
      if (p != 0) return;
      const auto parts = {pdo::to_host(sum), pdo::to_host(gathered), pdo::to_host(segment), pdo::to_host(root), pdo::to_host(theirs),
                          pdo::to_host(ring)};
      std::size_t size = 0;
      for (const auto& t : parts) size += t.size();
      auto all = pdo::tensor<double, 1>::on_host({size});
      double* at = all.data();
      for (const auto& t : parts)
        for (double x : t) *at++ = x;
      out[0] = all;
    });
    return out[0];
  }, 1e-12);
  // arguments that disagree: an error on every member, not a hang
  const auto m = pdo::make_mesh<"dp">(gpus, {n});
  bool mismatch = n == 1;
  if (n > 1) {
    try {
      pdo::spmd(m, [&](std::size_t p) {
        pdo::tensor<float, 1> t({4 + p}, m.place(p));
        pdo::communicator_of(m, p).all_reduce(t.span());
      });
    } catch (const pdo::mismatch_error&) {
      mismatch = true;
    }
  }
  check(mismatch, "NCCL collectives with sizes that disagree throw mismatch_error on every member");
  // a consumer of the sum runs on the host: over NCCL's device buffers it is refused, on every member
  std::vector<int> refused(n, 0);
  pdo::spmd(m, [&](std::size_t p) {
    pdo::tensor<float, 1> t({4}, m.place(p));
    try {
      pdo::communicator_of(m, p).all_reduce_apply(t.span(), pdo::reduced_consumer<float>{[](const void*, std::size_t, std::size_t, const float*) {}, nullptr});
    } catch (const pdo::communication_error& e) {
      refused[p] = std::string(e.what()).find("GPU places") != std::string::npos;
    }
  });
  check(std::count(refused.begin(), refused.end(), 1) == static_cast<std::ptrdiff_t>(n), "all_reduce_apply over GPU places is a communication_error");
  // the same size, another reduction: every member names what it called, then the mesh goes on
  std::vector<std::string> said(n);
  if (n > 1) {
    pdo::spmd(m, [&](std::size_t p) {
      pdo::tensor<float, 1> t({4}, m.place(p));
      try {
        pdo::communicator_of(m, p).all_reduce(t.span(), p == 0 ? pdo::reduce_op::sum : pdo::reduce_op::max);
      } catch (const pdo::mismatch_error& e) {
        said[p] = e.what();
      }
    });
  }
  bool named = true;
  for (std::size_t p = 0; p < n && n > 1; ++p)
    named = named && said[p].find("different collectives") != std::string::npos &&
            said[p].find(p == 0 ? "all_reduce(sum) of f32" : "all_reduce(max) of f32") != std::string::npos;
  pdo::tensor<float, 1> twos({3});
  twos.fill(2.0f);
  const auto after = pdo::gather(pdo::eval(pdo::distribute<pdo::layout<pdo::replicate>>(m, twos) * 3.0f));
  check(named && after(0) == 6.0f, "NCCL all_reduces with different reductions: mismatch_error on every member naming its call");
  // an all_gather of floats against one of ints (the same bytes): an error, not ints read as floats
  std::size_t caught = 0;
  if (n > 1) {
    std::vector<int> threw(n, 0);
    pdo::spmd(m, [&](std::size_t p) {
      try {
        if (p == 0) {
          pdo::tensor<float, 1> in({2}, m.place(p)), out({2 * n}, m.place(p));
          pdo::communicator_of(m, p).all_gather(std::span<const float>(in.data(), 2), out.span());
        } else {
          pdo::tensor<int, 1> in({2}, m.place(p)), out({2 * n}, m.place(p));
          pdo::communicator_of(m, p).all_gather(std::span<const int>(in.data(), 2), out.span());
        }
      } catch (const pdo::mismatch_error& e) {
        threw[p] = std::string(e.what()).find("all_gather of") != std::string::npos;
      }
    });
    for (int t : threw) caught += static_cast<std::size_t>(t);
  }
  check(n == 1 || caught == n, "NCCL all_gathers over different element types: mismatch_error on every member");
  // a place whose task ends without joining a collective, or without the send another's recv
  // waits for (or the recv another's send waits for): the others get the error at once, as on
  // CPU places, and the mesh goes on
  for (int round = 0; round < 6 && n > 1; ++round) {
    const std::size_t last = n - 1;
    const int kind = round % 3;  // 0: a skipped all_reduce, 1: a recv without its send, 2: a send without its recv
    std::string said;
    try {
      pdo::spmd(m, [&](std::size_t p) {
        pdo::tensor<float, 1> t({4}, m.place(p));
        if (p == last) return;
        const auto comm = pdo::communicator_of(m, p);
        if (kind == 0) comm.all_reduce(t.span());
        else if (kind == 1 && p == 0) comm.recv(t.span(), last, 3);
        else if (kind == 2 && p == 0) comm.send(std::as_const(t).span(), last, 3);
      });
    } catch (const pdo::mismatch_error& e) {
      said = e.what();
    }
    const std::string who = m.place(last).name(), first = m.place(0).name();
    const std::string expected = kind == 0 ? "the task of place " + who + " ended without joining it"
                                 : kind == 1 ? "recv aborted: the task of place " + who + " ended without a send to " + first + " with tag 3"
                                             : "send aborted: the task of place " + who + " ended without a recv from " + first + " with tag 3";
    const auto sum = pdo::gather(pdo::eval(pdo::sum(pdo::distribute<pdo::layout<pdo::split<"dp">>>(m, twos))));
    check(said.find(expected) != std::string::npos && sum.data()[0] == 6.0f,
          "NCCL: a place whose task ends without the matching call is an error at once, not a hang (" + expected + "; got: " + said + ")");
  }
}

/// @brief NCCL's max and min skip NaN (as fmax and fmin); pdo's keep it wherever it sits, as
/// on CPU places: all_reduce and reduce_scatter (even and uneven segments) with max and min,
/// and max along a split dim and over every dim.
void nan_in_max_and_min(const std::vector<pdo::cuda_place>& gpus) {
  const std::size_t n = gpus.size();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  same_on_both("max and min all_reduce and reduce_scatter keep a NaN held by any place", gpus, [&](const auto& m) {
    std::vector<pdo::tensor<float, 1>> out(m.local_places().size());
    pdo::spmd(m, [&](std::size_t p) {
      const auto comm = pdo::communicator_of(m, p);
      const auto& place = m.place(p);
      auto h = filled<float, 1>({4 * n}, 70 + static_cast<unsigned>(p));
      h(p) = nan;                          // element p: NaN on place p only
      if (p == 0) h(4 * n - 2) = nan;      // in the last place's segment: from place 0
      if (p == 1) h(4 * n - 1) = nan;      // and from place 1
      auto high = pdo::to_place(h, place), low = pdo::to_place(h, place);
      comm.all_reduce(high.span(), pdo::reduce_op::max);
      comm.all_reduce(low.span(), pdo::reduce_op::min);
      const auto from = pdo::to_place(h, place);
      pdo::tensor<float, 1> even({4}, place), uneven({p == 0 ? 3 + n : 3}, place);
      comm.reduce_scatter(std::as_const(from).span(), even.span(), pdo::reduce_op::max);
      comm.reduce_scatter(std::as_const(from).span(), uneven.span(), pdo::reduce_op::min);
      if (p != n - 1) return;
      const auto parts = {pdo::to_host(high), pdo::to_host(low), pdo::to_host(even), pdo::to_host(uneven)};
      std::size_t size = 0;
      for (const auto& t : parts) size += t.size();
      auto all = pdo::tensor<float, 1>::on_host({size});
      float* at = all.data();
      for (const auto& t : parts)
        for (float x : t) *at++ = x;
      out[n - 1] = all;
    });
    return out[n - 1];
  }, 0);
  same_on_both("max along a split dim and over every dim keep a NaN held by the last place", gpus, [&](const auto& m) {
    auto x = filled<double, 2>({3 * n + 1, 3}, 71);
    x(3 * n, 1) = std::numeric_limits<double>::quiet_NaN();  // the last row: on the last place
    const auto d = pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(m, x);
    const auto along = pdo::to_host(pdo::gather(pdo::eval(pdo::max<0>(d))));
    const auto whole = pdo::to_host(pdo::gather(pdo::eval(pdo::max(d))));
    auto out = pdo::tensor<double, 1>::on_host({4});
    for (std::size_t j = 0; j < 3; ++j) out(j) = along(j);
    out(3) = whole();
    return out;
  }, 0);
}

void mixed_mesh(const std::vector<pdo::cuda_place>& gpus) {
  // a CPU place and a GPU place in one mesh: collectives staged through host memory
  std::vector<pdo::any_place> places{pdo::cpu_places(1).front(), gpus.front()};
  const auto m = pdo::make_mesh<"pp">(places, {2});
  std::vector<double> sums(2), received(2);
  try {
    pdo::spmd(m, [&](std::size_t p) {
      const auto comm = pdo::communicator_of(m, p);
      pdo::tensor<double, 1> t({5}, m.place(p));
      t.fill(static_cast<double>(p + 1));
      comm.all_reduce(t.span());
      sums[p] = pdo::to_host(t).data()[4];
      if (p == 0) {
        comm.send(std::as_const(t).span(), 1, 3);  // a CPU stage feeding a GPU stage
      } else {
        pdo::tensor<double, 1> in({5}, m.place(p));
        comm.recv(in.span(), 0, 3);
        received[p] = pdo::to_host(in).data()[0];
      }
    });
    check(sums[0] == 3.0 && sums[1] == 3.0 && received[1] == 3.0, "a mesh of a CPU and a GPU place: all_reduce and send/recv");
  } catch (const std::exception& e) {
    check(false, std::string("mixed mesh: ") + e.what());
  }
  // the GPU place's task ends without the all_reduce the CPU place makes: an error at once
  std::string said;
  try {
    pdo::spmd(m, [&](std::size_t p) {
      pdo::tensor<double, 1> t({5}, m.place(p));
      if (p == 0) pdo::communicator_of(m, p).all_reduce(t.span());
    });
  } catch (const pdo::mismatch_error& e) {
    said = e.what();
  }
  check(said.find("the task of place " + m.place(1).name() + " ended without joining it") != std::string::npos,
        "a mesh of a CPU and a GPU place: a skipped collective is an error, not a hang (got: " + said + ")");
}

/// Kernels run where their operands are, whichever thread asks for them.
void operand_places(const std::vector<pdo::cuda_place>& gpus) {
  const auto& g = gpus.front();
  const auto a = filled<float, 2>({31, 7}, 21), b = filled<float, 2>({31, 7}, 22);
  const auto expected = pdo::eval(a * b + 1.0f);  // host memory, host loops
  const auto da = pdo::to_place(a, g), db = pdo::to_place(b, g);
  const auto on_gpu = pdo::eval(da * db + 1.0f);  // from the host thread: runs on g's compute lane
  check(on_gpu.on_gpu() && close(on_gpu, expected, 1e-6), "eval of GPU tensors from the host thread runs on their GPU");
  bool two_memories = false;
  try {
    (void)pdo::eval(a * db);
  } catch (const pdo::error& e) {
    two_memories = std::string(e.what()).find("two memories") != std::string::npos &&
                   std::string(e.what()).find(g.name()) != std::string::npos;
  }
  check(two_memories, "eval over host and GPU operands is a pdo::error naming both memories");
  auto sum = pdo::to_place(a, g);
  pdo::detail::for_each_index(sum.where(), sum.size(), pdo::detail::add_into_element<float>{sum.data(), db.data()});
  check(close(sum, pdo::eval(a + b), 1e-6), "an in-place update of GPU tensors from the host thread runs on their GPU");
  // host operands evaluated on a GPU place's compute lane: host loops, the result in host memory
  const auto from_worker = pdo::detail::run_on_place(*da.where(), [&] { return pdo::eval(a * b + 1.0f); });
  check(!from_worker.on_gpu() && close(from_worker, expected, 0), "host operands evaluated on a GPU place's compute lane stay on the host");
  bool refused = false;
  try {
    const auto x = pdo::var(pdo::to_place(filled<float, 4>({1, 2, 5, 5}, 23), g));
    const auto w = pdo::parameter(pdo::to_place(filled<float, 4>({3, 2, 3, 3}, 24), g));
    const auto bias = pdo::parameter(pdo::to_place(filled<float, 1>({3}, 25), g));
    (void)pdo::conv2d(x, w, bias, {1, 1});
  } catch (const pdo::error& e) {
    refused = std::string(e.what()).find("conv2d") != std::string::npos && std::string(e.what()).find("cannot read") != std::string::npos;
  }
  check(refused, "conv2d of GPU vars on the host thread is a pdo::error naming the op and the places");
  const auto m = pdo::make_mesh<"dp">(gpus, {gpus.size()});
  using rows = pdo::layout<pdo::split<"dp">, pdo::replicate>;
  const auto doubled = pdo::parallel_do<rows>(
      [](const pdo::tensor<float, 2>& shard) {
        auto h = pdo::to_host(shard);  // a part made in host memory
        for (auto& v : h) v *= 2;
        return h;
      },
      pdo::distribute<rows>(m, a));
  check(doubled.local_shards()[0].on_gpu() && close(pdo::gather(doubled), pdo::eval(a * 2.0f), 0),
        "parallel_do moves a part made in host memory to its GPU place");
}

void errors(const std::vector<pdo::cuda_place>& gpus) {
  bool named = false;
  try {
    pdo::detail::cuda_check(cudaErrorInvalidValue, "cudaMemcpyAsync", gpus.front().name());
  } catch (const pdo::error& e) {
    named = std::string(e.what()).find("cudaMemcpyAsync on cuda:") != std::string::npos;
  }
  check(named, "CUDA errors become pdo::error naming the call and the place");
}

// ---- the defects a reading of the GPU code found, one check each (they run on real and simulated devices) ----

/// 1. Results of full reductions, the cross-entropy loss, the seed of backward and the
/// initialisers of layers are written by device work, not by host code into device memory.
void host_never_writes_device_memory(const std::vector<pdo::cuda_place>& gpus) {
  const auto& g = gpus.front();
  const auto a = filled<double, 2>({9, 7}, 31);
  const auto on_g = pdo::to_place(a, g);
  const double want = pdo::eval(pdo::sum(a))(), got = pdo::to_host(pdo::eval(pdo::sum(on_g)))();
  const double max_want = pdo::eval(pdo::max(a))(), max_got = pdo::to_host(pdo::eval(pdo::max(on_g)))();
  check(std::abs(got - want) < 1e-12 && max_got == max_want, "sum and max over all dims of a GPU tensor are written on the device");
  const pdo::tensor<int, 1> labels({9}, {0, 1, 2, 3, 4, 5, 6, 0, 1});
  const double ce_want = pdo::eval(pdo::cross_entropy(a, labels))();
  double ce_got = 0;
  std::vector<double> grad_got, grad_want;
  {
    auto w = pdo::parameter(a);
    pdo::backward(pdo::cross_entropy(w, labels));
    grad_want.assign(w.grad().begin(), w.grad().end());
  }
  g.submit([] {}).wait();  // the place's compute lane is alive
  pdo::detail::run_on_place(*g.state(), [&] {
    auto w = pdo::parameter(pdo::to_place(a, g));
    const auto loss = pdo::cross_entropy(w, pdo::to_place(labels, g));
    ce_got = pdo::to_host(loss.value())();
    pdo::backward(loss);
    const auto grad = pdo::to_host(w.grad());
    grad_got.assign(grad.begin(), grad.end());
  });
  bool same = grad_got.size() == grad_want.size();
  for (std::size_t i = 0; same && i < grad_got.size(); ++i) same = std::abs(grad_got[i] - grad_want[i]) < 1e-12;
  check(std::abs(ce_got - ce_want) < 1e-12 && same, "cross_entropy on a GPU place: its loss and backward's seed stay on the device");
  {
    // a label that is not a class index, read back from the device to be named, with its
    // global row: on one GPU place, and over the places of a mesh with the rows split
    pdo::tensor<int, 1> bad(labels);
    bad(4) = 7;  // 7 classes
    std::string local, split_rows;
    pdo::detail::run_on_place(*g.state(), [&] {
      try {
        (void)pdo::eval(pdo::cross_entropy(pdo::to_place(a, g), pdo::to_place(bad, g)));
      } catch (const pdo::shape_error& e) {
        local = e.what();
      }
    });
    bad(4) = 4;
    bad(7) = -1;
    const auto m = pdo::make_mesh<"dp">(gpus, {gpus.size()});
    try {
      (void)pdo::eval(pdo::cross_entropy(pdo::distribute<pdo::layout<pdo::split<"dp">, pdo::replicate>>(m, a),
                                         pdo::distribute<pdo::layout<pdo::split<"dp">>>(m, bad)));
    } catch (const pdo::error& e) {
      split_rows = e.what();
    }
    check(local.find("1 label of i32[9] is not a class index in [0, 7)") != std::string::npos &&
              local.find("the first is 7, at row 4") != std::string::npos &&
              split_rows.find("the first is -1, at row 7") != std::string::npos,
          "a label that is no class index on GPU places is named with its value and global row: " + local + " | " + split_rows);
  }
  std::vector<float> made_here, made_there;
  {
    pdo::nn::rng gen(3);
    pdo::nn::linear<float> layer(5, 4, gen);
    made_here.assign(layer.weight.value().begin(), layer.weight.value().end());
  }
  pdo::detail::run_on_place(*g.state(), [&] {
    pdo::nn::rng gen(3);
    pdo::nn::linear<float> layer(5, 4, gen);
    const auto w = pdo::to_host(layer.weight.value());
    made_there.assign(w.begin(), w.end());
    check(layer.weight.value().on_gpu(), "a layer made on a GPU place holds its parameters in the GPU's memory");
  });
  check(made_here == made_there, "a layer made on a GPU place is initialised as on the host");
}

/// 2. Copies staged through the host between two GPUs: events recorded on their own
/// device's streams, and the staging buffers freed only after their last upload.
void staged_copies(const std::vector<pdo::cuda_place>& gpus) {
  if (gpus.size() < 2) return;
  const auto big = filled<float, 1>({std::size_t{3} << 20}, 32);  // 12 MiB: three chunks, both buffers reused
  pdo::tensor<float, 1> arrived;
  {
    pdo::cuda_place to(gpus[1].device());    // made first, destroyed last
    pdo::cuda_place from(gpus[0].device());  // its staging buffers go first
    const auto on_from = pdo::to_place(big, from);
    arrived = pdo::to_host(pdo::to_place(on_from, to, pdo::peer_copy::staged));
  }
  check(close(arrived, big, 0), "a staged copy between GPUs, its source place destroyed right after");
}

/// 3. A copy between GPUs waits only for the work queued before it on each side: a
/// collective that one place queued before the copy and the other after cannot deadlock.
void copies_do_not_deadlock_collectives(const std::vector<pdo::cuda_place>& gpus) {
  if (gpus.size() < 2) return;
  const auto m = pdo::make_mesh<"dp">(std::vector<pdo::cuda_place>{gpus[0], gpus[1]}, {2});
  using cols = pdo::layout<pdo::replicate, pdo::split<"dp">>;
  using rows = pdo::layout<pdo::split<"dp">, pdo::replicate>;
  const auto a = filled<double, 2>({6, 8}, 33), b = filled<double, 2>({8, 5}, 34);
  const auto x = pdo::distribute<cols>(m, a);
  const auto w = pdo::distribute<rows>(m, b);
  const auto data = pdo::to_place(filled<double, 1>({1000}, 35), gpus[0]);
  // the second place's compute lane is held while the first queues its part of an all_reduce
  std::mutex hold;
  std::unique_lock held(hold);
  const auto holder = gpus[1].submit([&hold] { std::lock_guard wait(hold); });
  auto product = pdo::eval_async(pdo::matmul(x, w));  // K split: an all_reduce on both places
  auto copy = std::async(std::launch::async, [&] { return pdo::to_place(data, gpus[1], pdo::peer_copy::automatic); });
  held.unlock();
  const auto moved = copy.get();
  holder.wait();
  const auto result = pdo::gather(product.get());
  check(close(pdo::to_host(moved), pdo::to_host(data), 0) && close(result, pdo::eval(pdo::matmul(a, b)), 1e-12),
        "a copy between GPUs beside a collective queued in another order: no deadlock");
}

/// 6. An uneven all_gather whose output has the wrong size on one member throws on every
/// member before any queues a kernel; the mesh goes on.
void all_gather_agrees_first(const std::vector<pdo::cuda_place>& gpus) {
  if (gpus.size() < 2) return;
  const std::size_t n = gpus.size();
  const auto m = pdo::make_mesh<"dp">(gpus, {n});
  bool everywhere = false;
  try {
    pdo::spmd(m, [&](std::size_t p) {
      pdo::tensor<float, 1> in({1 + p}, m.place(p)), out({n * (n + 1) / 2 + (p == 0 ? 1 : 0)}, m.place(p));
      pdo::communicator_of(m, p).all_gather(std::as_const(in).span(), out.span());
    });
  } catch (const pdo::mismatch_error& e) {
    everywhere = std::string(e.what()).find("all_gather") != std::string::npos;
  }
  std::vector<float> after(n);
  pdo::spmd(m, [&](std::size_t p) {
    pdo::tensor<float, 1> t({3}, m.place(p));
    t.fill(1.0f);
    pdo::communicator_of(m, p).all_reduce(t.span());
    after[p] = pdo::to_host(t)(2);
  });
  check(everywhere && after[0] == static_cast<float>(n), "an all_gather of a wrong output size: mismatch_error on every member, then the mesh goes on");
}

/// 7. A member whose NCCL call fails after the others queued theirs: the others' queued
/// collectives are ended (the communicators aborted), the error reaches the caller, and the
/// mesh works again with new communicators. A collective the ranks called differently
/// (NCCL's asynchronous error) ends a wait on the stream with an error instead of a hang.
void nccl_failures(const std::vector<pdo::cuda_place>& gpus) {
  if (gpus.size() < 2) return;
  const std::size_t n = gpus.size();
  const auto m = pdo::make_mesh<"dp">(gpus, {n});
  bool failed = false;
  try {
    pdo::spmd(m, [&](std::size_t p) {
      pdo::tensor<float, 1> t({16}, m.place(p));
      std::vector<float> host(16, 1.0f);  // member 0 passes host memory: NCCL refuses it there only
      const std::span<float> data = p == 0 ? std::span<float>(host) : t.span();
      pdo::communicator_of(m, p).all_reduce(data);
      pdo::to_host(t);  // waits for its stream: the collective queued here can no longer complete
    });
  } catch (const pdo::error& e) {
    failed = true;
  }
  std::vector<float> after(n);
  pdo::spmd(m, [&](std::size_t p) {
    pdo::tensor<float, 1> t({4}, m.place(p));
    t.fill(2.0f);
    pdo::communicator_of(m, p).all_reduce(t.span());
    after[p] = pdo::to_host(t)(0);
  });
  check(failed && after[n - 1] == 2.0f * static_cast<float>(n), "a member's failed NCCL call after the others queued theirs: an error, then new communicators");
#if defined(PDO_CUDA_SIMULATOR)
  // two members calling different collectives at one position: NCCL's asynchronous error
  auto& group = std::get<std::shared_ptr<pdo::nccl::detail::group>>(pdo::detail::comms_of(m).whole->impl);
  std::string seen;
  try {
    pdo::spmd(m, [&](std::size_t p) {
      pdo::tensor<float, 1> t({8}, m.place(p));
      auto& d = pdo::detail::cuda_device_of(*m.place(p).state());
      if (p == 0) ncclAllReduce(t.data(), t.data(), 8, ncclFloat32, ncclSum, group->comm(p), d.comm);
      else ncclBroadcast(t.data(), t.data(), 8, ncclFloat32, 0, group->comm(p), d.comm);
      pdo::cuda_place(m.place(p).state()).synchronize();
    });
  } catch (const pdo::communication_error& e) {
    seen = e.what();
  }
  check(seen.find("different collectives") != std::string::npos, "an asynchronous NCCL error ends the wait on the stream with an error: " + seen);
  pdo::detail::comms_of(m).reset();
#endif
}

/// 8. Two places on one device: the source's later writes wait for a copy that reads it.
void two_places_on_one_device(const std::vector<pdo::cuda_place>& gpus) {
  pdo::cuda_place a(gpus.front().device()), b(gpus.front().device());
  auto src = pdo::to_place(filled<float, 1>({1000}, 36), a);
  const auto want = pdo::to_host(src);
  // b's stream is busy for a while before the copy reaches it
  pdo::tensor<float, 2> busy({512, 512}, b);
  (void)pdo::detail::run_on_place(*b.state(), [&] { return pdo::eval(pdo::matmul(busy, busy)); });
  pdo::tensor<float, 1> dst({1000}, b);
  pdo::copy(src, dst, pdo::copy_completion::queued);
  src.fill(-1.0f);  // a's next write to the source
  check(close(pdo::to_host(dst), want, 0), "two places on one device: the source is not overwritten before the copy reads it");
}

/// 9. Batched matmuls whose blocks are empty (k or n of 0 under uneven splits) never reach
/// cuBLAS with a leading dimension of 0.
void empty_blocks(const std::vector<pdo::cuda_place>& gpus) {
  const std::size_t n = gpus.size();
  if (n < 2) return;
  using pdo::replicate;
  using pdo::split;
  const auto a = filled<double, 3>({3, 4, 1}, 37), b = filled<double, 3>({3, 1, 1}, 38);
  const auto m = pdo::make_mesh<"dp">(gpus, {n});
  const auto x = pdo::distribute<pdo::layout<replicate, replicate, split<"dp">>>(m, a);
  const auto y = pdo::distribute<pdo::layout<replicate, split<"dp">, replicate>>(m, b);
  const auto k_split = pdo::gather(pdo::eval(pdo::matmul(x, y)));  // K = 1 over n places: empty K blocks
  const auto yn = pdo::distribute<pdo::layout<replicate, replicate, split<"dp">>>(m, b);
  const auto xn = pdo::distribute<pdo::layout<replicate, replicate, replicate>>(m, a);
  const auto n_split = pdo::gather(pdo::eval(pdo::matmul(xn, yn)));  // N = 1 over n places: empty N blocks
  const auto want = pdo::eval(pdo::matmul(a, b));
  check(close(k_split, want, 1e-12) && close(n_split, want, 1e-12), "batched matmul with empty blocks (k or n of 0) on GPU places");
}

/// 11. Peer access is enabled before direct copies; an event is made on the device of the
/// stream it is recorded on.
void peers_and_events(const std::vector<pdo::cuda_place>& gpus) {
  if (gpus.size() < 2) return;
#if defined(PDO_CUDA_SIMULATOR)
  int can = 0;
  cudaDeviceCanAccessPeer(&can, gpus[0].device(), gpus[1].device());
  cudaSimStats before{}, after{};
  cudaSimGetStats(&before);
  const auto on_b = pdo::to_place(pdo::to_place(filled<float, 1>({256}, 39), gpus[0]), gpus[1], pdo::peer_copy::direct);
  cudaSimGetStats(&after);
  check(can == 0 || after.driver_staged_peer_copies == before.driver_staged_peer_copies,
        "direct copies between devices that can reach each other go peer to peer (access enabled)");
#endif
  pdo::cuda_event e;  // made on the host thread, whose current device is the first
  e.record(gpus[1].compute_stream());
  e.wait(gpus[0].compute_stream());
  gpus[0].synchronize();
  check(e.done(), "a cuda_event recorded on another device's stream");
}

/// @brief A mesh of CPU places and a mesh of GPU places driven at once by two host threads:
/// the engine runs both, without a lock held for a whole operation.
void cpu_and_gpu_meshes_at_once(const std::vector<pdo::cuda_place>& gpus) {
  const std::size_t n = gpus.size();
  const auto h = filled<float, 2>({12, 8}, 5);
  using rows = pdo::layout<pdo::split<"dp">, pdo::replicate>;
  const auto expected = pdo::eval(pdo::sum<0>(pdo::relu(h * 2.0f - 0.5f)));
  auto drive = [&](const auto& mesh, bool& ok) {
    const auto x = pdo::distribute<rows>(mesh, h);
    for (int i = 0; i < 40 && ok; ++i) ok = close(pdo::gather(pdo::eval(pdo::sum<0>(pdo::relu(x * 2.0f - 0.5f)))), expected, 1e-5);
  };
  bool cpu_ok = true, gpu_ok = true;
  std::string failure;
  const auto cpu_mesh = pdo::make_mesh<"dp">(pdo::cpu_places(n), {n});
  const auto gpu_mesh = pdo::make_mesh<"dp">(gpus, {n});
  auto other = std::async(std::launch::async, [&] { drive(cpu_mesh, cpu_ok); });
  try {
    drive(gpu_mesh, gpu_ok);
  } catch (const std::exception& e) {
    gpu_ok = false;
    failure = e.what();
  }
  try {
    other.get();
  } catch (const std::exception& e) {
    cpu_ok = false;
    failure += e.what();
  }
  check(cpu_ok && gpu_ok, "a CPU mesh and a GPU mesh driven by two threads at once give their results " + failure);
}

/// @brief The data-parallel trainer on GPU places (its buckets, losses and optimizer in the
/// places' memory; plain and ZeRO-1) gives the losses of the same training on CPU places.
void trainers(const std::vector<pdo::cuda_place>& gpus) {
  const std::size_t n = gpus.size();
  const auto x = filled<float, 2>({20, 6}, 3);
  const auto y = three_classes(20);
  auto make = [] { return small_mlp(7); };
  auto adam = [](auto ps) { return pdo::nn::adam<float>(std::move(ps), {.lr = 0.01}); };
  for (const bool zero1 : {false, true}) {
    auto losses = [&](const auto& mesh) {
      auto trainer = pdo::nn::make_data_parallel<float>(mesh, make, adam, {.bucket_bytes = 64, .zero1 = zero1});
      pdo::tensor<float, 1> out({5});  // four losses, then the accuracy
      for (std::size_t s = 0; s < 4; ++s) out(s) = trainer.step(x, y);
      out(4) = static_cast<float>(trainer.accuracy(x, y));
      return out;
    };
    try {
      const auto cpu = losses(pdo::make_mesh<"dp">(pdo::cpu_places(n), {n}));
      const auto gpu = losses(pdo::make_mesh<"dp">(gpus, {n}));
      check(close(gpu, cpu, 1e-4), std::string("data_parallel on GPU places follows the CPU places (losses and accuracy)") + (zero1 ? " (ZeRO-1)" : ""));
    } catch (const std::exception& e) {
      check(false, std::string("data_parallel on GPU places: ") + e.what());
    }
  }
  // the pipeline: stages on GPU places hand activations and their gradients over by device
  // copies (no NCCL stream shared by sends and receives); over "dp" x "pp" its buckets sync
  // each stage's gradients with NCCL
  auto make_deep = [] {
    pdo::nn::rng gen(5);
    return pdo::nn::sequential(pdo::nn::linear<float>(6, 8, gen), pdo::nn::relu{}, pdo::nn::linear<float>(8, 8, gen), pdo::nn::tanh{},
                               pdo::nn::linear<float>(8, 3, gen));
  };
  auto sgd = [](auto ps) { return pdo::nn::sgd<float>(std::move(ps), {.lr = 0.2, .momentum = 0.5}); };
  for (const auto kind : {pdo::nn::pipeline_schedule::gpipe, pdo::nn::pipeline_schedule::one_f_one_b}) {
    auto pipeline_losses = [&](const auto& mesh) {
      auto trainer = pdo::nn::make_pipeline<float, 2, 3>(mesh, make_deep(), sgd, {kind, 3});
      pdo::tensor<float, 1> out({4});
      for (std::size_t s = 0; s < 4; ++s) out(s) = trainer.step(x, y);
      return out;
    };
    const std::string name = kind == pdo::nn::pipeline_schedule::gpipe ? "GPipe" : "1F1B";
    try {
      const auto one = pipeline_losses(pdo::make_mesh<"pp">(pdo::cpu_places(2), {2}));
      const auto gpu = pipeline_losses(pdo::make_mesh<"pp">(std::vector<pdo::cuda_place>(gpus.begin(), gpus.begin() + 2), {2}));
      check(close(gpu, one, 1e-4), "pipeline (" + name + ") on 2 GPU places follows the CPU places (losses)");
      if (n >= 4) {
        const std::vector<pdo::cuda_place> four(gpus.begin(), gpus.begin() + 4);
        const auto hybrid = pipeline_losses(pdo::make_mesh<"dp", "pp">(four, {2, 2}));
        check(close(hybrid, one, 1e-4), "pipeline (" + name + ") on 2 dp x 2 pp GPU places follows the CPU places (losses)");
        // stages of Megatron pairs, tensor parallel over "tp" (uneven shards: widths 10 and 7)
        auto make_pairs = [] {
          pdo::nn::rng gen(21);
          return pdo::nn::sequential(pdo::nn::linear<float>(6, 10, gen), pdo::nn::relu{}, pdo::nn::linear<float>(10, 5, gen), pdo::nn::tanh{},
                                     pdo::nn::linear<float>(5, 7, gen), pdo::nn::relu{}, pdo::nn::linear<float>(7, 3, gen));
        };
        auto pairs_losses = [&](const auto& mesh) {
          auto trainer = pdo::nn::make_pipeline<float, 2, 3>(mesh, make_pairs(), sgd, {kind, 3});
          pdo::tensor<float, 1> out({4});
          for (std::size_t s = 0; s < 4; ++s) out(s) = trainer.step(x, y);
          return out;
        };
        const auto cpu_pairs = pairs_losses(pdo::make_mesh<"pp">(pdo::cpu_places(2), {2}));
        const auto gpu_pairs = pairs_losses(pdo::make_mesh<"pp", "tp">(four, {2, 2}));
        check(close(gpu_pairs, cpu_pairs, 1e-4), "pipeline (" + name + ") on 2 pp x 2 tp GPU places follows the CPU places (losses)");
      }
    } catch (const std::exception& e) {
      check(false, "pipeline (" + name + ") on GPU places: " + e.what());
    }
  }
  // the hand-written data-parallel program: a differentiable parallel_do over a split batch with
  // replicated parameters, its loss, backward (the replicas' gradients summed by the planner's
  // all_reduce, NCCL on GPU places) and SGD on every place
  same_on_both("differentiable parallel_do: 3 steps of an MLP on a split batch (losses and weights)", gpus, [&](const auto& m) {
    using rows = pdo::layout<pdo::split<"dp">, pdo::replicate>;
    using whole = pdo::layout<pdo::replicate, pdo::replicate>;
    const auto xd = filled<double, 2>({13, 6}, 21), w1 = filled<double, 2>({6, 9}, 22), w2 = filled<double, 2>({9, 3}, 23);
    const auto labels = three_classes(13);
    auto mlp = [](const auto& xl, const auto& a, const auto& b) { return pdo::matmul(pdo::tanh(pdo::matmul(xl, a)), b); };
    const auto X = pdo::distribute<rows>(m, xd);
    const auto Y = pdo::distribute<pdo::layout<pdo::split<"dp">>>(m, labels);
    auto W1 = pdo::parameter(pdo::distribute<whole>(m, w1)), W2 = pdo::parameter(pdo::distribute<whole>(m, w2));
    pdo::nn::sgd<double> opt({{"w1", W1}, {"w2", W2}}, {.lr = 0.3, .momentum = 0.9});
    pdo::tensor<double, 1> out({3 + 9 * 3});
    for (std::size_t step = 0; step < 3; ++step) {
      const auto loss = pdo::cross_entropy(pdo::parallel_do<rows>(mlp, pdo::var(X), W1, W2), Y);
      out(step) = pdo::to_host(pdo::gather(loss.value()))();
      opt.zero_grad();
      pdo::backward(loss);
      opt.step();
    }
    const auto w = pdo::gather(W2.value());
    std::copy(w.data(), w.data() + w.size(), out.data() + 3);
    return out;
  }, 1e-10);
  // prefetch: the next batch cut onto the GPU places (host -> device on their copy lanes) while
  // the current one is used
  same_on_both("prefetch of batches onto the places, used by parallel_do", gpus, [&](const auto& m) {
    using rows = pdo::layout<pdo::split<"dp">, pdo::replicate>;
    auto batch = [](std::size_t i) { return filled<double, 2>({9, 4}, 40 + static_cast<unsigned>(i)); };
    const auto w = filled<double, 2>({4, 3}, 39);
    const auto W = pdo::distribute<pdo::layout<pdo::replicate, pdo::replicate>>(m, w);
    auto next = pdo::prefetch<rows>(m, batch(0));
    pdo::tensor<double, 1> out({3 * 9 * 3});
    for (std::size_t i = 0; i < 3; ++i) {
      const auto X = next.get();
      if (i + 1 < 3) next = pdo::prefetch<rows>(m, batch(i + 1));
      const auto y = pdo::gather(pdo::parallel_do<rows>(
          [](const auto& xl, const auto& wl) { return pdo::eval(pdo::tanh(pdo::matmul(xl, wl))); }, X, W));
      std::copy(y.data(), y.data() + y.size(), out.data() + i * 27);
    }
    return out;
  }, 1e-12);
  // the uploads of a prefetch onto a GPU place go on its copy stream, not on its compute
  // stream, whose later work does not wait for them; what the compute stream queued before
  // (the block's last users) comes first: the result is right
  {
    const auto m = pdo::make_mesh<"dp">(gpus, {n});
    using rows = pdo::layout<pdo::split<"dp">, pdo::replicate>;
    const auto h = filled<float, 2>({4 * n + 1, 6}, 44);
    auto earlier = pdo::eval(pdo::exp(pdo::distribute<rows>(m, h)));  // work queued on the compute streams
#if defined(PDO_CUDA_SIMULATOR)
    std::vector<unsigned long long> copy_before(n), compute_before(n), copy_after(n), compute_after(n);
    for (std::size_t p = 0; p < n; ++p) {
      cudaSimStreamCopies(gpus[p].copy_stream(), &copy_before[p]);
      cudaSimStreamCopies(gpus[p].compute_stream(), &compute_before[p]);
    }
#endif
    auto next = pdo::prefetch<rows>(m, h);
    const auto got = next.get();
#if defined(PDO_CUDA_SIMULATOR)
    bool on_copy = true;
    for (std::size_t p = 0; p < n; ++p) {
      cudaSimStreamCopies(gpus[p].copy_stream(), &copy_after[p]);
      cudaSimStreamCopies(gpus[p].compute_stream(), &compute_after[p]);
      on_copy = on_copy && copy_after[p] > copy_before[p] && compute_after[p] == compute_before[p];
    }
    check(on_copy, "a prefetch's uploads go on the GPU places' copy streams, none on their compute streams");
#endif
    check(close(pdo::gather(got), h, 0) && close(pdo::gather(pdo::eval(pdo::log(earlier))), h, 1e-5),
          "a prefetch on the copy streams beside work on the compute streams gives both results");
  }
  // a pipeline over CPU and GPU places at once is refused, saying why
  try {
    const auto mesh = pdo::make_mesh<"pp">(std::vector<pdo::any_place>{pdo::cpu_places(1).front(), gpus.front()}, {2});
    auto sgd_once = [](auto ps) { return pdo::nn::sgd<float>(std::move(ps), {.lr = 0.1}); };
    (void)pdo::nn::make_pipeline<float, 2, 2>(mesh, make(), sgd_once);
    check(false, "a pipeline over a CPU place and a GPU place is refused");
  } catch (const pdo::layout_error& e) {
    check(std::string(e.what()).find("CPU places or on GPU places") != std::string::npos,
          "a pipeline over a CPU place and a GPU place is refused, saying why");
  }
}

#if defined(PDO_WITH_IO)
/// @brief Checkpoints of what lives in GPU memory: dtensors' blocks staged through the host,
/// loaded into other places and layouts, a data-parallel trainer resumed, and the states these
/// checkpoints do not take (a ZeRO-1 trainer's and a pipeline's on GPU places) refused.
void checkpoints(const std::vector<pdo::cuda_place>& gpus) {
  const std::size_t n = gpus.size();
  const auto dir = std::filesystem::temp_directory_path() / ("pdo_cuda_checkpoints_" + std::to_string(::getpid()));
  using rows = pdo::layout<pdo::split<"dp">, pdo::replicate>;
  using cols = pdo::layout<pdo::replicate, pdo::split<"dp">>;
  const auto gpu_mesh = pdo::make_mesh<"dp">(gpus, {n});
  const auto cpu_mesh = pdo::make_mesh<"dp">(pdo::cpu_places(n), {n});
  const auto w = filled<float, 2>({2 * n + 1, 5}, 61);  // uneven rows, and uneven columns over 2 or 4 places
  auto doubled = pdo::tensor<float, 2>::on_host(w.shape());
  for (std::size_t i = 0; i < w.size(); ++i) doubled.data()[i] = 2 * w.data()[i];
  try {
    // saved from GPU places right after the kernels that make the blocks were queued
    auto on_gpus = pdo::eval(pdo::distribute<rows>(gpu_mesh, w) * 2.0f);
    pdo::io::checkpoint out;
    out.add("w", on_gpus);
    pdo::io::save(dir, out);
    auto on_cpus = pdo::distribute<cols>(cpu_mesh, pdo::tensor<float, 2>(w.shape()));
    pdo::io::checkpoint in;
    in.add("w", on_cpus);
    pdo::io::load(dir, in);
    check(close(pdo::gather(on_cpus), doubled, 0), "a dtensor saved from GPU places loads on CPU places, split otherwise");
    // loaded into GPU places split by columns, and used there at once
    auto back = pdo::distribute<cols>(gpu_mesh, pdo::tensor<float, 2>(w.shape()));
    pdo::io::checkpoint again;
    again.add("w", back);
    pdo::io::load(dir, again);
    const auto halved = pdo::gather(pdo::eval(back * 0.5f));
    check(close(halved, w, 0), "a checkpoint loads into a dtensor on GPU places, split by columns, and computes on at once");
    check(close(pdo::gather(pdo::io::read<float, 2, rows>(dir, "w", gpu_mesh)), doubled, 0), "io::read makes a dtensor on GPU places");
    // a tensor on one GPU place, whole, into a tensor on another, and .npy of a GPU tensor
    pdo::tensor<float, 2> one(w.shape(), gpus.front()), other(w.shape(), gpus.back());
    pdo::copy(w, one);
    pdo::io::checkpoint single;
    single.add("t", one);
    pdo::io::save(dir, single);
    pdo::io::checkpoint single_in;
    single_in.add("t", other);
    pdo::io::load(dir, single_in);
    check(close(other, w, 0), "a tensor on a GPU place saves and loads into a tensor on another");
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    pdo::io::save_npy(dir / "t.npy", one);
    check(close(pdo::io::load_npy<float, 2>(dir / "t.npy"), w, 0), "save_npy of a tensor on a GPU place");
  } catch (const std::exception& e) {
    check(false, std::string("checkpoints of dtensors on GPU places: ") + e.what());
  }
  std::filesystem::remove_all(dir);

  // a data-parallel trainer on GPU places saved after 2 steps, resumed on GPU places and on CPU
  // places: steps 3 and 4 as the uninterrupted run's
  const auto x = filled<float, 2>({18, 6}, 63);
  const auto y = three_classes(18);
  auto make = [] { return small_mlp(11); };
  auto adam = [](auto ps) { return pdo::nn::adam<float>(std::move(ps), {.lr = 0.02}); };
  try {
    auto straight = pdo::nn::make_data_parallel<float>(gpu_mesh, make, adam);
    std::vector<float> losses;
    for (int s = 0; s < 4; ++s) losses.push_back(straight.step(x, y));
    auto first = pdo::nn::make_data_parallel<float>(gpu_mesh, make, adam);
    for (int s = 0; s < 2; ++s) (void)first.step(x, y);
    pdo::io::save(dir, first);
    auto on_gpus = pdo::nn::make_data_parallel<float>(gpu_mesh, make, adam);
    pdo::io::load(dir, on_gpus);
    const float third = on_gpus.step(x, y), fourth = on_gpus.step(x, y);
    check(third == losses[2] && fourth == losses[3] && on_gpus.steps() == 4,
          "a data_parallel trainer on GPU places resumes bitwise from its checkpoint");
    auto on_cpus = pdo::nn::make_data_parallel<float>(cpu_mesh, make, adam);
    pdo::io::load(dir, on_cpus);
    const float cpu_third = on_cpus.step(x, y), cpu_fourth = on_cpus.step(x, y);
    check(std::abs(cpu_third - losses[2]) <= 1e-5f && std::abs(cpu_fourth - losses[3]) <= 1e-5f,
          "a data_parallel trainer's checkpoint from GPU places resumes on CPU places");
  } catch (const std::exception& e) {
    check(false, std::string("a data_parallel trainer's checkpoint on GPU places: ") + e.what());
  }
  std::filesystem::remove_all(dir);

  // what these checkpoints do not take is refused before anything is written, saying why
  auto refused = [&](const std::string& what, auto&& save, const std::string& says) {
    try {
      save();
      check(false, what + " is refused");
    } catch (const pdo::io_error& e) {
      check(std::string(e.what()).find(says) != std::string::npos && !std::filesystem::exists(dir), what + " is refused, saying why");
    }
  };
  auto zero1 = pdo::nn::make_data_parallel<float>(gpu_mesh, make, adam, {.zero1 = true});
  (void)zero1.step(x, y);
  refused("saving a ZeRO-1 trainer on GPU places", [&] { pdo::io::save(dir, zero1); }, "ZeRO-1 on GPU places");
  auto sgd = [](auto ps) { return pdo::nn::sgd<float>(std::move(ps), {.lr = 0.1}); };
  auto pipeline = pdo::nn::make_pipeline<float, 2, 2>(pdo::make_mesh<"pp">(std::vector<pdo::cuda_place>(gpus.begin(), gpus.begin() + 2), {2}),
                                                      make(), sgd);
  (void)pipeline.step(x, y);
  refused("saving a pipeline on GPU places", [&] { pdo::io::save(dir, pipeline); }, "a pipeline on GPU places");
  std::filesystem::remove_all(dir);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const std::string reason = pdo::cuda_unavailable_reason();
  if (!reason.empty()) {
    std::printf("SKIPPED: no CUDA device (%s)\n", reason.c_str());
    return 77;
  }
  const auto gpus = pdo::cuda_places();
  std::printf("%zu GPU place(s)\n", gpus.size());
  using part = void (*)(const std::vector<pdo::cuda_place>&);
  const std::vector<std::pair<const char*, part>> parts{{"places_and_memory", places_and_memory},
                                                        {"copies", copies},
                                                        {"expressions", expressions},
                                                        {"convolution", convolution},
                                                        {"spatial", spatial},
                                                        {"collectives", collectives},
                                                        {"nan_in_max_and_min", nan_in_max_and_min},
                                                        {"mixed_mesh", mixed_mesh},
                                                        {"operand_places", operand_places},
                                                        {"errors", errors},
                                                        {"host_never_writes_device_memory", host_never_writes_device_memory},
                                                        {"staged_copies", staged_copies},
                                                        {"copies_do_not_deadlock_collectives", copies_do_not_deadlock_collectives},
                                                        {"all_gather_agrees_first", all_gather_agrees_first},
                                                        {"nccl_failures", nccl_failures},
                                                        {"two_places_on_one_device", two_places_on_one_device},
                                                        {"empty_blocks", empty_blocks},
                                                        {"peers_and_events", peers_and_events},
                                                        {"cpu_and_gpu_meshes_at_once", cpu_and_gpu_meshes_at_once},
                                                        {"trainers", trainers},
#if defined(PDO_WITH_IO)
                                                        {"checkpoints", checkpoints},
#endif
  };
  // an argument names the one part to run
  for (const auto& [name, run] : parts) {
    if (argc > 1 && std::string(argv[1]) != name) continue;
    try {
      run(gpus);
    } catch (const std::exception& e) {
      check(false, e.what());
    }
  }
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
