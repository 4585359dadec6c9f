// The execution engine: dependency order over random task graphs, host threads that drive
// meshes at once, waits that cover what their caller queued, nested mesh-wide operations,
// failures that cancel what depends on them. Also run under ThreadSanitizer.
#include "support.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

using pdo::replicate;
using pdo::split;

namespace {

/// @brief Busy work of about `n` steps (no sleep): gives tasks random durations.
std::uint64_t spin(std::uint64_t n, std::uint64_t seed) {
  volatile std::uint64_t x = seed;
  for (std::uint64_t i = 0; i < n; ++i) x = x * 6364136223846793005ULL + 1442695040888963407ULL;
  return x;
}

/// @brief A task on `home` that reads `reads`, writes `writes` and runs `fn`.
pdo::detail::task_request request(pdo::detail::lane* home, std::vector<const void*> reads, std::vector<const void*> writes,
                                  pdo::detail::task fn, const char* op) {
  pdo::detail::task_request r;
  r.home = home;
  r.uses.reads = std::move(reads);
  r.uses.writes = std::move(writes);
  r.fn = std::move(fn);
  r.op = op;
  return r;
}

std::uint64_t mix(std::uint64_t a, std::uint64_t b) { return (a ^ (b + 0x9e3779b97f4a7c15ULL + (a << 6) + (a >> 2))) * 31 + 7; }

/// @brief Runs `f` on its own thread; a run longer than `seconds` ends the test program with a
/// message (a hang becomes a failure, not a stuck test).
template <class F>
void within(int seconds, const char* what, F f) {
  auto done = std::async(std::launch::async, std::move(f));
  if (done.wait_for(std::chrono::seconds(seconds)) != std::future_status::ready) {
    std::fprintf(stderr, "test_engine: %s did not finish within %d s (a hang)\n", what, seconds);
    std::fflush(stderr);
    std::_Exit(1);
  }
  done.get();
}

}  // namespace

TEST_CASE("random task graphs give the result of running the tasks one by one", "[engine]") {
  constexpr std::size_t buffers = 6, graphs = 300, tasks = 40;
  const auto places = pdo::cpu_places(4);
  std::mt19937_64 gen(20261123);
  std::size_t dependent = 0, traced_graphs = 0;
  for (std::size_t g = 0; g < graphs; ++g) {
    const std::size_t nplaces = 1 + g % 4;
    // every tenth graph is traced: the tasks then carry the ids of those they wait for
    const bool traced = g % 10 == 0;
    traced_graphs += traced;
    if (traced) pdo::trace::start();
    std::array<std::uint64_t, buffers> values{}, expected{};
    for (std::size_t b = 0; b < buffers; ++b) values[b] = expected[b] = gen();
    std::vector<pdo::detail::task_handle> handles;
    for (std::size_t t = 0; t < tasks; ++t) {
      std::vector<std::size_t> reads, writes;
      for (std::size_t b = 0; b < buffers; ++b) {
        const auto roll = gen() % 6;
        if (roll == 0) writes.push_back(b);
        else if (roll <= 2) reads.push_back(b);
      }
      const std::uint64_t id = g * tasks + t, work = gen() % 3000;
      // what the task does: each buffer it writes becomes a mix of itself, the buffers it reads and its id
      auto apply = [reads, writes, id](std::array<std::uint64_t, buffers>& v) {
        std::uint64_t in = id;
        for (std::size_t b : reads) in = mix(in, v[b]);
        for (std::size_t b : writes) v[b] = mix(v[b], in);
      };
      apply(expected);
      pdo::detail::task_request r;
      const auto& place = places[gen() % nplaces];
      r.home = &pdo::detail::lane_of(*place.state(), static_cast<pdo::lane_kind>(gen() % pdo::lane_kinds));
      r.op = "random task";
      for (std::size_t b : reads) r.uses.reads.push_back(&values[b]);
      for (std::size_t b : writes) r.uses.writes.push_back(&values[b]);
      r.fn = [apply, &values, work, id] {
        spin(work, id);
        apply(values);
      };
      handles.push_back(pdo::detail::engine::instance().submit(std::move(r)));
      dependent += traced && !handles.back()->after.empty();
    }
    for (const auto& h : handles) pdo::detail::wait(h);
    if (traced) pdo::trace::stop();
    INFO("graph " << g << " on " << nplaces << " places");
    REQUIRE(values == expected);
  }
  CHECK(dependent > traced_graphs * tasks / 4);  // the graphs do have dependencies, which the engine links
}

TEST_CASE("a failed task cancels what depends on it, with its error; independent tasks run", "[engine][errors]") {
  const auto places = pdo::cpu_places(2);
  int a = 0, b = 0, c = 0;
  auto& e = pdo::detail::engine::instance();
  auto on = [&](std::size_t p, pdo::lane_kind k) { return &pdo::detail::lane_of(*places[p].state(), k); };
  std::atomic<bool> ran_dependent{false};
  const auto f = e.submit(request(on(0, pdo::lane_kind::compute), {}, {&a}, [] { throw pdo::shape_error("bad rows 3 != 4"); }, "producer"));
  const auto d1 = e.submit(request(on(1, pdo::lane_kind::compute), {&a}, {&b}, [&] { ran_dependent = true; }, "consumer"));
  const auto d2 = e.submit(request(on(1, pdo::lane_kind::copy), {&b}, {}, [&] { ran_dependent = true; }, "second consumer"));
  const auto i = e.submit(request(on(1, pdo::lane_kind::communication), {}, {&c}, [&] { c = 42; }, "independent"));
  CHECK_THROWS_AS(pdo::detail::wait(f), pdo::shape_error);
  try {
    pdo::detail::wait(d2);
    FAIL("the task that needs a failed one ran");
  } catch (const pdo::shape_error& err) {  // the failure's own kind
    CHECK_THAT(err.what(), Catch::Contains("second consumer on cpu:1") && Catch::Contains("cancelled") &&
                               Catch::Contains("producer on cpu:0") && Catch::Contains("bad rows 3 != 4"));
  }
  CHECK_THROWS_AS(pdo::detail::wait(d1), pdo::shape_error);
  pdo::detail::wait(i);
  CHECK(c == 42);
  CHECK_FALSE(ran_dependent.load());
  // the buffer is usable again: a new writer does not inherit the failure
  pdo::detail::wait(e.submit(request(on(1, pdo::lane_kind::compute), {}, {&a}, [&] { a = 7; }, "rewrite")));
  CHECK(a == 7);
}

TEST_CASE("work submitted to a place runs on its compute lane in order; what it throws reaches the handle's wait",
          "[engine][errors]") {
  const auto places = pdo::cpu_places(2);
  std::vector<int> order;
  std::atomic<bool> on_lane{true};
  const pdo::any_place p = places[1];
  std::vector<pdo::place_task> tasks;
  for (int k = 0; k < 3; ++k)
    tasks.push_back(p.submit([&, k] {
      on_lane = on_lane && pdo::detail::current_place() == p.state().get();
      order.push_back(k);
    }));
  const auto failed = p.submit([] { throw pdo::shape_error("rows 3 != 4"); });
  const auto after = p.submit([&] { order.push_back(3); });  // a failure cancels nothing queued behind it
  for (const auto& t : tasks) t.wait();
  try {
    failed.wait();
    FAIL("the failure was dropped");
  } catch (const pdo::shape_error& err) {  // its own kind, naming the place
    CHECK_THAT(err.what(), Catch::Contains("submit on cpu:1") && Catch::Contains("rows 3 != 4"));
  }
  CHECK_THROWS_AS(failed.wait(), pdo::shape_error);  // every wait says so
  after.wait();
  CHECK(after.ready());
  CHECK(order == std::vector<int>{0, 1, 2, 3});
  CHECK(on_lane.load());
  CHECK(pdo::place_task().ready());
  // waiting inside the place's own work for work queued behind it is an error, not a hang
  std::optional<pdo::place_task> behind;
  std::string inner;
  std::atomic<bool> release{false};
  const auto outer = p.submit([&] {
    while (!release.load()) std::this_thread::yield();
    try {
      behind->wait();
    } catch (const pdo::error& err) {
      inner = err.what();
    }
  });
  behind.emplace(p.submit([] {}));
  release = true;
  outer.wait();
  behind->wait();
  CHECK_THAT(inner, Catch::Contains("lane") && Catch::Contains("wait"));
}

TEST_CASE("an evaluation that needs a failed one is cancelled with its error; the mesh goes on", "[engine][errors]") {
  const auto mesh = pdo_test::line_mesh(2);
  using L = pdo::layout<split<"x">, replicate>;
  const auto h = pdo_test::random_tensor<double, 2>({6, 4}, 7);
  const auto x = pdo::distribute<L>(mesh, h);
  const auto labels = pdo::distribute<pdo::layout<split<"x">>>(mesh, pdo::tensor<double, 1>({6}, {0, 1, 2, 3, 9, 0}));
  auto failing = pdo::eval_async(pdo::cross_entropy(x, labels) * 1.0);  // label 9 of 4 classes, on cpu:1
  auto dependent = pdo::eval_async(failing * 2.0);
  auto independent = pdo::eval_async(pdo::exp(x));
  try {
    dependent.wait();
    FAIL("no error");
  } catch (const pdo::shape_error& e) {
    CHECK_THAT(e.what(), Catch::Contains("cancelled") && Catch::Contains("cross_entropy") && Catch::Contains("cpu:1"));
  }
  CHECK_THROWS_AS(failing.wait(), pdo::shape_error);
  CHECK(pdo_test::close(pdo::gather(independent.get()), pdo::eval(pdo::exp(h)), 1e-15));
  const auto next = pdo::eval(pdo::sum<0>(x * 2.0));
  CHECK(pdo_test::close(pdo::gather(next), pdo::eval(pdo::sum<0>(h * 2.0)), 1e-14));

  // once a failed evaluation is freed, storage that takes the address of its result is new
  // to the engine: a task that reads it is neither held nor cancelled by the old failure
  const void* freed = nullptr;
  {
    auto lost = pdo::eval_async(pdo::cross_entropy(x, labels) * 1.0);
    freed = lost.value().local_shards()[1].data();
    CHECK_THROWS_AS(lost.wait(), pdo::shape_error);
  }
  auto& e = pdo::detail::engine::instance();
  bool ran = false;
  pdo::detail::wait(e.submit(request(&pdo::detail::lane_of(*mesh.place(1).state()), {freed}, {}, [&] { ran = true; }, "reader")));
  CHECK(ran);
}

TEST_CASE("a failure on one place is an error of the operation, naming what it worked on and the place", "[engine][errors]") {
  const auto mesh = pdo_test::line_mesh(3);
  CHECK_THROWS_WITH(pdo::spmd(mesh,
                              [](std::size_t p) {
                                if (p == 2) throw pdo::shape_error("boom");
                              }),
                    Catch::Equals("spmd: on place cpu:2: boom"));
  // 7 rows over 3 places: cpu:2 holds rows 5 and 6, and label 9 of 4 classes is row 5's
  using L = pdo::layout<split<"x">, replicate>;
  const auto logits = pdo::distribute<L>(mesh, pdo_test::random_tensor<double, 2>({7, 4}, 5));
  const auto labels = pdo::distribute<pdo::layout<split<"x">>>(mesh, pdo::tensor<double, 1>({7}, {0, 1, 2, 3, 0, 9, 1}));
  CHECK_THROWS_WITH(pdo::eval(pdo::cross_entropy(logits, labels) * 1.0),
                    Catch::StartsWith("eval of multiply -> f64[]{} partial<x>: on place cpu:2: cross_entropy: 1 label of"));
  // a dtensor [7, 4] split by rows whose shard on cpu:2 was written by a task that failed:
  // each operation that reads it fails with that error, on that place
  const auto d = pdo::distribute<L>(mesh, pdo_test::random_tensor<double, 2>({7, 4}, 6));
  const void* shard = pdo::detail::storage_key(d.local_shards()[2]);
  auto& e = pdo::detail::engine::instance();
  CHECK_THROWS_WITH(pdo::detail::wait(e.submit(request(&pdo::detail::lane_of(*mesh.place(2).state()), {}, {shard},
                                                     [] { throw pdo::shape_error("the shard's writer failed"); }, "writer"))),
                    Catch::Equals("writer on cpu:2: the shard's writer failed"));
  const std::string what = "f64[7, 4]{split<x>, replicate} on mesh(x=3)";
  using whole = pdo::layout<replicate, replicate>;
  CHECK_THROWS_WITH(pdo::redistribute<whole>(d),
                    Catch::StartsWith("redistribute: " + what + " -> {replicate, replicate}: on place cpu:2: cancelled: ") &&
                        Catch::EndsWith("the shard's writer failed"));
  CHECK_THROWS_WITH(pdo::gather(d), Catch::StartsWith("gather: " + what + ": on place cpu:2: ") && Catch::EndsWith("the shard's writer failed"));
  CHECK_THROWS_WITH(pdo::gather_to(d, 0),
                    Catch::StartsWith("gather_to: " + what + ": on place cpu:2: ") && Catch::EndsWith("the shard's writer failed"));
  e.forget({shard});
  CHECK(pdo_test::close(pdo::gather(pdo::eval(d * 2.0)), pdo::eval(pdo::gather(d) * 2.0), 0));
}

TEST_CASE("gather and redistribute of an eval_async result not yet waited for read it once written, or fail with its error",
          "[engine][errors]") {
  const auto mesh = pdo_test::line_mesh(2);
  using L = pdo::layout<split<"x">, replicate>;
  using whole = pdo::layout<replicate, replicate>;
  // 7 rows over 2 places (uneven); products long enough that the reads come before the writes
  const auto h = pdo_test::random_tensor<double, 2>({7, 160}, 3);
  const auto w = pdo_test::random_tensor<double, 2>({160, 160}, 4);
  const auto x = pdo::distribute<L>(mesh, h);
  const auto dw = pdo::distribute<whole>(mesh, w);
  const auto reference = pdo::eval(pdo::matmul(pdo::matmul(pdo::matmul(h, w), w), w));
  for (int round = 0; round < 20; ++round) {
    auto a = pdo::eval_async(pdo::matmul(pdo::matmul(pdo::matmul(x, dw), dw), dw));
    CHECK(pdo_test::close(pdo::gather(a.value()), reference, 1e-12));
    auto b = pdo::eval_async(pdo::matmul(pdo::matmul(pdo::matmul(x, dw), dw), dw));
    CHECK(pdo_test::close(pdo::gather(pdo::redistribute<whole>(b.value())), reference, 1e-12));
    pdo::wait_all();
  }
  const auto labels = pdo::distribute<pdo::layout<split<"x">>>(mesh, pdo::tensor<double, 1>({7}, {0, 1, 2, 3, 9, 0, 1}));
  const auto logits = pdo::distribute<L>(mesh, pdo_test::random_tensor<double, 2>({7, 4}, 5));  // label 9 of 4 classes on cpu:1
  auto failing = pdo::eval_async(pdo::cross_entropy(logits, labels) * 1.0);
  // the result is a pending sum: the gather's all_reduce is what is cancelled
  CHECK_THROWS_WITH(pdo::gather(failing.value()), Catch::Contains("cancelled") && Catch::Contains("cross_entropy") && Catch::Contains("cpu:1"));
  auto failing_too = pdo::eval_async(pdo::cross_entropy(logits, labels) * 1.0);
  CHECK_THROWS_WITH(pdo::redistribute<pdo::layout<>>(failing_too.value()), Catch::Contains("redistribute") && Catch::Contains("cross_entropy"));
  CHECK_THROWS_AS(failing.wait(), pdo::shape_error);
  CHECK_THROWS_AS(failing_too.wait(), pdo::shape_error);
  // after the wait, and after enough other work that the engine has swept its table many
  // times: reading the failed result is still its error, while the evaluation is alive
  for (int i = 0; i < 300; ++i) (void)pdo::eval(x * static_cast<double>(i));
  CHECK(pdo::detail::engine::instance().tracked_buffers() > 0);  // sweeps every shard of the table
  CHECK_THROWS_WITH(pdo::gather(failing.value()), Catch::Contains("cross_entropy") && Catch::Contains("cpu:1"));
  CHECK_THROWS_WITH(pdo::gather(failing_too.value()), Catch::Contains("cross_entropy") && Catch::Contains("cpu:1"));
  CHECK(pdo_test::close(pdo::gather(pdo::eval(x * 2.0)), pdo::eval(h * 2.0), 1e-15));
}

TEST_CASE("an evaluation runs its plan's steps as tasks: kernels on compute lanes, collectives on communication lanes",
          "[engine][plan]") {
  for (std::size_t n : {2, 3}) {
    INFO(n << " places");
    const auto mesh = pdo_test::line_mesh(n);
    const auto a = pdo_test::random_tensor<double, 2>({5, 7}, 11), w = pdo_test::random_tensor<double, 2>({7, 3}, 12);
    const auto x = pdo::distribute<pdo::layout<replicate, split<"x">>>(mesh, a);
    const auto wd = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, w);
    // matmul over a split K is partial over "x"; relu needs the sum first: kernel, all_reduce, kernel
    auto expr = pdo::relu(pdo::matmul(x, wd));
    constexpr auto plan = pdo::plan_of<decltype(expr)>();
    STATIC_REQUIRE(plan.size == 3);
    STATIC_REQUIRE(plan.count(pdo::step_kind::all_reduce) == 1);
    pdo::trace::start();
    const auto y = pdo::eval(expr);
    pdo::trace::stop();
    CHECK(pdo_test::close(pdo::gather(y), pdo::eval(pdo::relu(pdo::matmul(a, w))), 1e-12));
    const auto events = pdo::detail::trace_recorder::instance().events();
    for (std::size_t p = 0; p < n; ++p) {
      const std::string place = mesh.place(p).name();
      const pdo::detail::timeline_event *product = nullptr, *sum = nullptr, *activation = nullptr;
      for (const auto& e : events) {
        if (e.id == 0 || e.track->place != place) continue;
        if (e.name == "matmul") product = &e;
        else if (e.name == "relu" && std::string(e.category) == "collective") sum = &e;
        else if (e.name == "relu") activation = &e;
      }
      REQUIRE(product != nullptr);
      REQUIRE(sum != nullptr);
      REQUIRE(activation != nullptr);
      CHECK(product->track->lane == "compute");
      CHECK(sum->track->lane == "communication");
      CHECK(activation->track->lane == "compute");
      CHECK_THAT(sum->detail, Catch::Contains("all_reduce over x") && Catch::Contains("bytes sent per place"));
      // each step started after the one whose block it reads ended (in the plan's order)
      CHECK(product->id < sum->id);
      CHECK(sum->id < activation->id);
      CHECK(sum->start >= product->end);
      CHECK(activation->start >= sum->end);
    }
  }
}

TEST_CASE("a standalone redistribute runs a collective on the communication lanes, a local slice on the compute lanes",
          "[engine][plan]") {
  for (std::size_t n : {2, 3}) {
    INFO(n << " places");
    const auto mesh = pdo_test::line_mesh(n);
    const auto a = pdo_test::random_tensor<double, 2>({7, 5}, 13);
    const auto x = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, a);
    pdo::trace::start();
    const auto whole = pdo::redistribute<pdo::layout<replicate, replicate>>(x);     // all_gather
    const auto cut = pdo::redistribute<pdo::layout<replicate, split<"x">>>(whole);  // local slice
    pdo::trace::stop();
    CHECK(pdo_test::close(pdo::gather(whole), a, 0.0));
    CHECK(pdo_test::close(pdo::gather(cut), a, 0.0));
    const auto events = pdo::detail::trace_recorder::instance().events();
    for (std::size_t p = 0; p < n; ++p) {
      const std::string place = mesh.place(p).name();
      std::vector<const pdo::detail::timeline_event*> tasks;
      for (const auto& e : events)
        if (e.id != 0 && e.track->place == place && e.name == "redistribute") tasks.push_back(&e);
      REQUIRE(tasks.size() == 2);
      std::sort(tasks.begin(), tasks.end(), [](const auto* l, const auto* r) { return l->id < r->id; });
      CHECK(tasks[0]->track->lane == "communication");
      CHECK(std::string(tasks[0]->category) == "collective");
      CHECK(tasks[1]->track->lane == "compute");
      CHECK(std::string(tasks[1]->category) == "kernel");
    }
  }
}

TEST_CASE("an evaluation whose result does not fit a place's memory is an out_of_memory naming the call, the op and the result; "
          "a dtensor copy that does not fit names the copy and the dtensor",
          "[engine][memory]") {
  const auto mesh = pdo::make_mesh<"x">(pdo::cpu_places(2, 64 << 10));
  const auto a = pdo_test::random_tensor<double, 2>({200, 1}, 21), b = pdo_test::random_tensor<double, 2>({1, 200}, 22);
  const auto x = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, a);
  const auto w = pdo::distribute<pdo::layout<replicate, replicate>>(mesh, b);
  // the product's rows are split: 100 x 200 doubles (160 KB) a place, past the 64 KiB cap
  CHECK_THROWS_AS(pdo::eval_async(pdo::matmul(x, w)), pdo::out_of_memory);
  CHECK_THROWS_WITH(pdo::eval_async(pdo::matmul(x, w)),
                    Catch::StartsWith("eval_async of matmul: its result f64[200, 200]{split<x>, replicate}") &&
                        Catch::Contains("cpu:") && Catch::Contains("cap of 65536"));
  CHECK_THROWS_WITH(pdo::eval(pdo::matmul(x, w)), Catch::StartsWith("eval of matmul: its result"));
  // nothing was queued: the mesh and the operands are as before
  CHECK(pdo_test::close(pdo::gather(pdo::eval(x * 2.0)), pdo::eval(a * 2.0), 0.0));
  CHECK_NOTHROW(pdo::wait_all());

  // a copy of a dtensor that does not fit beside it (as pdo::parameter(d) makes) names the copy and the dtensor
  const auto roomy = pdo::make_mesh<"x">(pdo::cpu_places(4, 1 << 20));
  const auto big = pdo::distribute<pdo::layout<replicate, split<"x">>>(roomy, pdo::tensor<float, 2>({600, 1500}));  // 900 KB a place
  CHECK_THROWS_AS([&] { const auto copy = big; }(), pdo::out_of_memory);
  CHECK_THROWS_WITH([&] { const auto copy = big; }(),
                    Catch::StartsWith("copy of dtensor f32[600, 1500]{replicate, split<x>} on mesh(x=4): out of memory on cpu:"));
#if !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)  // (their allocators stop the program instead)
  // so does a local evaluation whose result the system refuses (4 TiB)
  const pdo::tensor<float, 2> u({std::size_t{1} << 20, 1}), v({1, std::size_t{1} << 20});
  CHECK_THROWS_WITH(pdo::eval(u + v), Catch::StartsWith("eval of add: its result f32[1048576, 1048576]: out of memory on host"));
#endif
}

TEST_CASE("a task that started before the trace did is left out, and so are the spans inside it", "[engine][trace]") {
  const auto mesh = pdo_test::line_mesh(1);
  const auto x = pdo::distribute<pdo::layout<split<"x">>>(mesh, pdo_test::random_tensor<double, 1>({64}, 3));
  std::atomic<bool> started{false}, go{false};
  std::thread host([&] {
    (void)pdo::parallel_do<pdo::layout<split<"x">>>(
        [&](const pdo::tensor<double, 1>& s) {
          started = true;
          while (!go.load()) std::this_thread::yield();
          pdo::tensor<double, 1> out(s.shape());
          pdo::detail::copy_bytes(nullptr, out.data(), nullptr, s.data(), s.bytes());  // a span inside the task
          return out;
        },
        x);
  });
  while (!started.load()) std::this_thread::yield();
  pdo::trace::start();
  go = true;
  host.join();
  // a copy made now, outside any task, is recorded
  pdo::tensor<double, 1> a({4}), b({4});
  pdo::detail::copy_bytes(nullptr, b.data(), nullptr, a.data(), a.bytes());
  pdo::trace::stop();
  std::size_t copies = 0;
  for (const auto& e : pdo::detail::trace_recorder::instance().events()) {
    CHECK(std::string(e.name) != "parallel_do");
    copies += std::string(e.category) == "copy" ? 1 : 0;
  }
  CHECK(copies == 1);
}

TEST_CASE("the trace's strings are valid JSON whatever bytes a message carries", "[engine][trace]") {
  // a failure message may carry a file name's raw bytes: each byte that is not well-formed
  // UTF-8 becomes U+FFFD; well-formed sequences, quotes and control characters as JSON has them
  const auto json = [](const std::string& s) {
    std::string out;
    pdo::detail::append_json_string(out, s);
    return out;
  };
  CHECK(json("caf\xe9.bin") == "\"caf\\ufffd.bin\"");
  CHECK(json("\xe2\x82\xac \xf0\x9f\x99\x82 \xc3\xa9") == "\"\xe2\x82\xac \xf0\x9f\x99\x82 \xc3\xa9\"");
  CHECK(json("\xe2\x82") == "\"\\ufffd\\ufffd\"");                  // truncated
  CHECK(json("\xc0\xaf \xed\xa0\x80") == "\"\\ufffd\\ufffd \\ufffd\\ufffd\\ufffd\"");  // overlong, surrogate
  CHECK(json("a\"b\\c\nd\x01") == "\"a\\\"b\\\\c\\nd\\u0001\"");
}

namespace {

using grid = pdo::mesh<"x">;

/// @brief A chain of expressions and collectives on `m`, checked against the host result.
void chain(const grid& m, const pdo::tensor<double, 2>& h, const pdo::tensor<double, 2>& w, const pdo::tensor<double, 2>& want) {
  using rows = pdo::layout<split<"x">, replicate>;
  const auto x = pdo::distribute<rows>(m, h);
  const auto wd = pdo::distribute<pdo::layout<replicate, split<"x">>>(m, w);
  const auto y = pdo::eval(pdo::relu(pdo::matmul(x, wd)));  // split x split
  auto queued = pdo::eval_async(y * 0.5);
  const auto z = pdo::redistribute<rows>(queued.get());  // all_gather over x
  const auto total = pdo::eval(pdo::sum<0>(z));          // partial, then reduced by gather
  const auto got = pdo::gather(total);
  for (std::size_t j = 0; j < want.extent(1); ++j)
    if (std::abs(got(j) - want(0, j)) > 1e-9 * (1 + std::abs(want(0, j)))) throw std::runtime_error("wrong result on " + m.describe());
}

}  // namespace

TEST_CASE("two host threads drive two meshes, or one mesh, at once", "[engine][threads]") {
  const auto h = pdo_test::random_tensor<double, 2>({10, 6}, 11), w = pdo_test::random_tensor<double, 2>({6, 5}, 12);
  pdo::tensor<double, 2> want({1, 5});
  {
    const auto r = pdo::eval(pdo::relu(pdo::matmul(h, w)) * 0.5);
    for (std::size_t j = 0; j < 5; ++j)
      for (std::size_t i = 0; i < 10; ++i) want(0, j) += r(i, j);
  }
  constexpr int rounds = 200;
  const auto places = pdo::cpu_places(2);
  const grid forward = pdo::make_mesh<"x">(places);
  const grid backward = pdo::make_mesh<"x">(std::vector<pdo::cpu_place>{places[1], places[0]});  // the same places, the other order
  auto run = [&](const grid& a, const grid& b) {
    std::exception_ptr failures[2];
    within(300, "two threads", [&] {
      std::thread one([&] {
        try {
          for (int i = 0; i < rounds; ++i) chain(a, h, w, want);
        } catch (...) {
          failures[0] = std::current_exception();
        }
      });
      std::thread two([&] {
        try {
          for (int i = 0; i < rounds; ++i) chain(b, h, w, want);
        } catch (...) {
          failures[1] = std::current_exception();
        }
      });
      one.join();
      two.join();
    });
    for (const auto& f : failures)
      if (f) std::rethrow_exception(f);
  };
  SECTION("two meshes over the same places") { run(forward, backward); }
  SECTION("one shared mesh") { run(forward, forward); }
  SECTION("two meshes over different places") {
    const grid left = pdo::make_mesh<"x">(pdo::cpu_places(2)), right = pdo::make_mesh<"x">(pdo::cpu_places(3));
    run(left, right);
  }
}

TEST_CASE("wait_all waits for what its own thread queued, and reports its own errors", "[engine][threads][errors]") {
  constexpr int rounds = 1000;
  using L = pdo::layout<split<"x">, replicate>;
  const auto h = pdo_test::random_tensor<double, 2>({6, 4}, 5);
  const pdo::tensor<double, 1> bad({6}, {0, 1, 2, 3, 9, 0});
  auto thread_body = [&](const std::string& name, int parity) {
    pdo::cpu_place_options o;
    o.pin = false;
    std::vector<pdo::cpu_place> mine;
    for (int i = 0; i < 2; ++i) {
      o.name = name + ":" + std::to_string(i);
      mine.emplace_back(i, std::vector<int>{0}, o);
    }
    const grid m = pdo::make_mesh<"x">(mine);
    const auto x = pdo::distribute<L>(m, h);
    const auto labels = pdo::distribute<pdo::layout<split<"x">>>(m, bad);
    const auto expected = pdo::eval(pdo::exp(h));
    for (int i = 0; i < rounds; ++i) {
      auto good = pdo::eval_async(pdo::exp(x));
      const bool fail = (i % 2) == parity;
      std::optional<pdo::async_result<std::remove_cvref_t<decltype(pdo::eval(pdo::cross_entropy(x, labels)))>>> failing;
      if (fail) failing.emplace(pdo::eval_async(pdo::cross_entropy(x, labels)));
      try {
        pdo::wait_all();
        if (fail) throw std::runtime_error(name + ": round " + std::to_string(i) + ": wait_all returned without its error");
      } catch (const pdo::shape_error& e) {
        if (!fail) throw std::runtime_error(name + ": round " + std::to_string(i) + ": an error that is not its own: " + e.what());
        if (std::string(e.what()).find(name + ":1") == std::string::npos)
          throw std::runtime_error(name + ": round " + std::to_string(i) + ": another thread's error: " + e.what());
      }
      // every evaluation of this thread has ended: its result is there, without another wait
      if (!good.ready()) throw std::runtime_error(name + ": round " + std::to_string(i) + ": wait_all returned before its work ended");
      if (!pdo_test::equal(pdo::gather(good.value()), expected)) throw std::runtime_error(name + ": wrong result");
    }
  };
  std::exception_ptr failures[2];
  within(300, "two threads in wait_all", [&] {
    std::thread one([&] {
      try {
        thread_body("left", 0);
      } catch (...) {
        failures[0] = std::current_exception();
      }
    });
    std::thread two([&] {
      try {
        thread_body("right", 1);
      } catch (...) {
        failures[1] = std::current_exception();
      }
    });
    one.join();
    two.join();
  });
  for (const auto& f : failures)
    if (f) std::rethrow_exception(f);
}

TEST_CASE("an evaluation waited for on another thread is not reported again by the wait_all of the thread that queued it",
          "[engine][threads][errors]") {
  const auto places = pdo::cpu_places(2);
  const auto mesh = pdo::make_mesh<"x">(places);
  const auto h = pdo_test::random_tensor<double, 2>({6, 4}, 5);
  const pdo::tensor<double, 1> bad({6}, {0, 1, 2, 3, 9, 0});
  const auto x = pdo::distribute<pdo::layout<split<"x">, replicate>>(mesh, h);
  const auto labels = pdo::distribute<pdo::layout<split<"x">>>(mesh, bad);
  for (int how = 0; how < 2; ++how) {
    const auto failing = pdo::eval_async(pdo::cross_entropy(x, labels));
    bool thrown = false;
    std::thread other([&] {
      try {
        if (how == 0) failing.wait();
        else (void)failing.get();
      } catch (const pdo::shape_error&) {
        thrown = true;
      }
    });
    other.join();
    CHECK(thrown);
    CHECK_NOTHROW(pdo::wait_all());
  }
  // one nobody waited for: the wait_all of the thread that queued it reports it, once
  const auto failing = pdo::eval_async(pdo::cross_entropy(x, labels));
  CHECK_THROWS_AS(pdo::wait_all(), pdo::shape_error);
  CHECK_NOTHROW(pdo::wait_all());
  CHECK_THROWS_AS(failing.wait(), pdo::shape_error);

  // one another thread waited for, whose handles are gone, no longer holds its result once
  // the thread that queued it queues the next (no wait_all needed)
  const auto in_use = [&] { return places[0].memory().stats().bytes_in_use; };
  const std::size_t before = in_use();
  {
    const auto big = pdo::eval_async(x * 2.0);
    std::thread([&] { big.wait(); }).join();
    CHECK(in_use() > before);
  }
  const auto small = pdo::eval_async(pdo::sum<1>(x));
  small.wait();
  // small's shard (3 of the 6 sums) is all that is left in use, not big's shard beside it
  CHECK(in_use() - before == pdo::caching_allocator::size_class(3 * sizeof(double)));
  CHECK(pdo_test::close(pdo::gather(small.value()), pdo::eval(pdo::sum<1>(h)), 1e-12));
}

TEST_CASE("a mesh-wide operation inside a parallel_do block or an spmd task is an error at once, not a hang",
          "[engine][errors]") {
  const auto mesh = pdo_test::line_mesh(2);
  using L = pdo::layout<split<"x">, replicate>;
  const auto x = pdo::distribute<L>(mesh, pdo_test::random_tensor<double, 2>({4, 3}, 3));
  within(60, "nested operations", [&] {
    CHECK_THROWS_WITH(pdo::parallel_do<L>(
                          [&](const auto& shard) {
                            (void)pdo::redistribute<pdo::layout<replicate, replicate>>(x);
                            return pdo::tensor<double, 2>(shard.shape());
                          },
                          x),
                      Catch::Contains("redistribute") && Catch::Contains("inside a task of place cpu:"));
    CHECK_THROWS_WITH(pdo::parallel_do<L>(
                          [&](const auto& shard) {
                            (void)pdo::eval(x * 2.0);
                            return pdo::tensor<double, 2>(shard.shape());
                          },
                          x),
                      Catch::Contains("eval") && Catch::Contains("parallel_do block"));
    CHECK_THROWS_WITH(pdo::spmd(mesh, [&](std::size_t) { (void)pdo::redistribute<pdo::layout<replicate, replicate>>(x); }),
                      Catch::Contains("spmd") && Catch::Contains("redistribute"));
    CHECK_THROWS_WITH(pdo::spmd(mesh, [&](std::size_t) { (void)pdo::eval(pdo::exp(x)); }),
                      Catch::Contains("eval") && Catch::Contains("inside a task of place"));
    CHECK_THROWS_WITH(pdo::spmd(mesh, [&](std::size_t) { (void)pdo::gather(x); }), Catch::Contains("gather"));
    CHECK_THROWS_WITH(pdo::spmd(mesh, [&](std::size_t) { (void)pdo::eval_async(x * 2.0); }),
                      Catch::Contains("eval_async: a mesh-wide operation was started inside a task of place"));
    // local work inside a block is what a block is for
    const auto y = pdo::parallel_do<L>([](const auto& shard) { return pdo::eval(shard * 2.0); }, x);
    CHECK(pdo_test::close(pdo::gather(y), pdo::eval(pdo::gather(x) * 2.0), 0));
  });
}

TEST_CASE("the engine forgets buffers once their tasks have ended", "[engine]") {
  const auto places = pdo::cpu_places(1);
  std::vector<int> many(10000);
  std::vector<pdo::detail::task_handle> handles;
  for (auto& v : many) {
    handles.push_back(pdo::detail::engine::instance().submit(request(&pdo::detail::lane_of(*places[0].state()), {}, {&v}, [&v] { v = 1; }, "fill")));
  }
  for (const auto& h : handles) pdo::detail::wait(h);
  handles.clear();
  CHECK(pdo::detail::engine::instance().tracked_buffers() < 100);
  for (int v : many) REQUIRE(v == 1);
}

namespace {

/// @brief Runs `scenario(queue, release)`: `queue()` holds each of `places`' compute lanes
/// with a task that waits; `release()` lets them go from another thread at once (so the
/// host thread may wait for the work queued behind them, and the work runs late, after
/// what the host thread does right after `release()`).
template <class Scenario>
void with_held_lanes(const std::vector<pdo::cpu_place>& places, Scenario scenario) {
  std::atomic<bool> go{false}, open{false};
  std::vector<pdo::place_task> holds;
  std::thread opener([&] {
    while (!go.load()) std::this_thread::yield();
    open = true;
  });
  scenario([&] {
    for (const auto& p : places)
      holds.push_back(p.submit([&] {
        while (!open.load()) std::this_thread::yield();
      }));
  }, [&] { go = true; });
  go = true;
  opener.join();
  for (const auto& h : holds) h.wait();
}

}  // namespace

TEST_CASE("a dtensor replaced, moved, copied or freed while an eval_async uses it waits for that work, which sees it as it was",
          "[engine][async]") {
  const auto places = pdo::cpu_places(2);
  const auto m = pdo::make_mesh<"x">(places);
  using rows = pdo::layout<split<"x">, replicate>;
  pdo::tensor<double, 2> h({5, 3});  // uneven: 3 rows and 2
  pdo::tensor<double, 2> other({5, 3});
  for (std::size_t i = 0; i < h.size(); ++i) {
    h.data()[i] = 0.1 * static_cast<double>(i);
    other.data()[i] = 7.0;
  }
  using dt = pdo::dtensor<double, 2, pdo::mesh<"x">, rows>;
  const auto want = pdo::eval(pdo::exp(h));
  auto check = [&](const pdo::tensor<double, 2>& got) {
    for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(got.data()[i] == Approx(want.data()[i]));
  };

  SECTION("assigned: the queued work reads the values it was queued with") {
    auto a = pdo::distribute<rows>(m, h);
    auto replacement = pdo::distribute<rows>(m, other);
    std::optional<pdo::async_result<dt>> r;
    with_held_lanes(places, [&](auto hold, auto release) {
      hold();
      r.emplace(pdo::eval_async(pdo::exp(a)));
      release();
      a = std::move(replacement);  // waits for r's work on a
    });
    check(pdo::gather(r->get()));
    const auto now = pdo::gather(a);
    for (double v : now.span()) REQUIRE(v == 7.0);
  }
  SECTION("moved from: the queued work reads the shards it was queued with, and the new dtensor holds them") {
    auto a = pdo::distribute<rows>(m, h);
    std::optional<pdo::async_result<dt>> r;
    std::optional<dt> b;
    with_held_lanes(places, [&](auto hold, auto release) {
      hold();
      r.emplace(pdo::eval_async(pdo::exp(a)));
      release();
      b.emplace(std::move(a));  // waits for r's work on a
    });
    check(pdo::gather(r->get()));
    const auto now = pdo::gather(*b);
    for (std::size_t i = 0; i < now.size(); ++i) REQUIRE(now.data()[i] == h.data()[i]);
  }
  SECTION("moved out of an eval_async result (get() on an rvalue) while a later eval_async reads it") {
    const auto a = pdo::distribute<rows>(m, h);
    std::optional<pdo::async_result<dt>> first, second;
    std::optional<dt> taken;
    with_held_lanes(places, [&](auto hold, auto release) {
      hold();
      first.emplace(pdo::eval_async(pdo::exp(a)));
      second.emplace(pdo::eval_async(pdo::log(*first)));  // reads first's result on each place
      release();
      // get() waits for first's work, then moves its result, which waits for second's reads of
      // it (second runs right behind first on each lane: "moved from" above is the case whose
      // work surely runs after the move)
      taken.emplace(std::move(*first).get());
    });
    check(pdo::gather(*taken));
    const auto back = pdo::gather(second->get());
    for (std::size_t i = 0; i < back.size(); ++i) REQUIRE(back.data()[i] == Approx(h.data()[i]).margin(1e-12));
  }
  SECTION("moved by a vector that grows: the queued work reads the dtensor before it moves") {
    std::vector<dt> v;
    v.reserve(1);
    v.push_back(pdo::distribute<rows>(m, h));
    auto extra = pdo::distribute<rows>(m, other);  // made before the lanes are held: distribute waits for them
    std::optional<pdo::async_result<dt>> r;
    with_held_lanes(places, [&](auto hold, auto release) {
      hold();
      r.emplace(pdo::eval_async(pdo::exp(v[0])));
      release();
      v.push_back(std::move(extra));  // moves v[0] to new storage, which waits for r's work
    });
    check(pdo::gather(r->get()));
    check(pdo::gather(pdo::eval(pdo::exp(v[0]))));
  }
  SECTION("copied before the wait: the copy holds the values the queued work writes") {
    const auto a = pdo::distribute<rows>(m, h);
    std::optional<pdo::async_result<dt>> r;
    std::optional<dt> copy;
    with_held_lanes(places, [&](auto hold, auto release) {
      hold();
      r.emplace(pdo::eval_async(pdo::exp(a)));
      release();
      copy.emplace(r->value());  // waits for the shards' writers, not for the wait
    });
    check(pdo::gather(*copy));
    r->wait();
  }
  SECTION("freed: its storage is not handed out before the queued work has read it") {
    std::optional<dt> b(pdo::distribute<rows>(m, h));
    std::optional<pdo::async_result<dt>> r;
    std::optional<dt> reuse;
    with_held_lanes(places, [&](auto hold, auto release) {
      hold();
      r.emplace(pdo::eval_async(pdo::exp(*b)));
      release();
      b.reset();                                  // waits for r's work on b
      reuse.emplace(pdo::distribute<rows>(m, other));  // may take b's blocks
    });
    check(pdo::gather(r->get()));
  }
}

TEST_CASE("the tasks on empty shards are ordered by each shard, not with every other empty block", "[engine][async]") {
  using rows = pdo::layout<split<"x">, replicate>;
  const auto places = pdo::cpu_places(4);
  const auto line = pdo::make_mesh<"x">(places);
  pdo::tensor<float, 2> h3({3, 2});  // 3 rows on 4 places: cpu:3 holds none
  for (std::size_t i = 0; i < h3.size(); ++i) h3.data()[i] = static_cast<float>(i);
  const auto e = pdo::distribute<rows>(line, h3);

  SECTION("freeing a dtensor with an empty shard waits only for the work on its own shards") {
    const auto pair = pdo::make_mesh<"x">(std::vector<pdo::cpu_place>{places[0], places[1]});
    pdo::tensor<float, 2> h1({1, 2});  // 1 row on 2 places: cpu:1 holds none
    std::optional<pdo::dtensor<float, 2, pdo::mesh<"x">, rows>> u(pdo::distribute<rows>(pair, h1));
    std::atomic<bool> open{false};
    const auto hold = places[3].submit([&] {
      while (!open.load()) std::this_thread::yield();
    });
    auto r = pdo::eval_async(e + 1.0f);  // its part on cpu:3 waits behind the hold
    u.reset();                           // nothing queued reads u: returns at once (waited for r's work on cpu:3, for ever)
    open = true;
    hold.wait();
    const auto got = pdo::gather(r.get());
    for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(got.data()[i] == h3.data()[i] + 1.0f);
  }
  SECTION("a failed evaluation does not cancel later work on other empty shards") {
    pdo::tensor<float, 2> logits({3, 5});
    pdo::tensor<int, 1> labels({3}, {1, 7, 2});  // 7 of 5 classes
    const auto dl = pdo::distribute<rows>(line, logits);
    const auto dy = pdo::distribute<pdo::layout<split<"x">>>(line, labels);
    auto failed = pdo::eval_async(e + pdo::cross_entropy(dl, dy));
    CHECK_THROWS_AS(failed.wait(), pdo::error);
    pdo::tensor<float, 2> ones({3, 2}, {1, 1, 1, 1, 1, 1});
    const auto c = pdo::distribute<rows>(line, ones);
    const auto doubled = pdo::gather(pdo::eval(c * 2.0f));  // cpu:3's empty shard read: not the failed result's
    for (float v : doubled.span()) REQUIRE(v == 2.0f);
  }
}
