// examples/digits.cpp: pdo's main demo. Trains a small CNN on scikit-learn's handwritten
// digits (1797 images of 8x8), data-parallel on N CPU places: every place holds a replica,
// trains on its rows of each global batch, and the gradients are all_reduced in buckets
// while backward runs. Prints the plan once, a line per epoch and the test accuracy.
//
//   digits [--places N] [--epochs E] [--batch B] [--seed S] [--lr LR] [--schedule-epochs N] [--clip NORM]
//          [--bucket-bytes N] [--data PATH] [--target ACC] [--trace FILE] [--checkpoint DIR] [--resume DIR] [--check-data]
//
// The learning rate warms up linearly over the first epoch, then decays along a cosine to a
// twentieth of --lr at --schedule-epochs epochs (15 by default, whatever --epochs says, so that
// a run cut into several resumed ones follows the same rates). --clip NORM clips the gradients
// by their global norm before every update (0, the default: no clipping).
//
// --checkpoint DIR saves the whole training state (parameters, Adam's moments and step count,
// the epochs trained) into DIR at the end of every epoch; --resume DIR starts from such a
// checkpoint and trains --epochs more epochs, on any number of places: 2 epochs, then a resumed
// run of 1, print the same third epoch as 3 epochs straight.
// --trace FILE writes the timeline of the training (every task of every place and lane, the
// bucket collectives, the dependencies) as Chrome trace-event JSON: open it in
// ui.perfetto.dev or chrome://tracing. --check-data only reads the data file and says how
// many samples it holds.
#include "digits_data.hpp"

#include <pdo/pdo.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <thread>

namespace {

struct options {
  std::size_t places = std::max(1u, std::thread::hardware_concurrency());
  std::size_t epochs = 15;
  std::size_t batch = 64;
  std::uint64_t seed = 1;
  double lr = 3e-3;
  std::size_t schedule_epochs = 15;  ///< the cosine schedule ends here
  double clip = 0;                   ///< clip the gradients' global norm to this (0: no clipping)
  std::size_t bucket_bytes = std::size_t{25} << 20;  ///< gradients all_reduced in buckets of about this many bytes
  double target = 0.95;
  std::string data;
  std::string trace;
  std::string checkpoint;  ///< save the training state here after every epoch
  std::string resume;      ///< start from the training state saved here
  bool check_data = false;
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "digits: " << problem
            << "\nusage: digits [--places N] [--epochs E] [--batch B] [--seed S] [--lr LR] [--schedule-epochs N] [--clip NORM] "
               "[--bucket-bytes N] [--data PATH] [--target ACC] [--trace FILE] [--checkpoint DIR] [--resume DIR] [--check-data]\n";
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") usage("train a CNN on the digits set, data-parallel");
    if (arg == "--check-data") {
      o.check_data = true;
      continue;
    }
    if (i + 1 >= argc) usage("missing value for " + arg);
    const std::string value = argv[++i];
    auto number = [&](auto& out) {
      char* end = nullptr;
      const double v = std::strtod(value.c_str(), &end);
      if (end == value.c_str() || *end != '\0' || v < 0) usage("bad value for " + arg + ": " + value);
      out = static_cast<std::remove_reference_t<decltype(out)>>(v);
    };
    if (arg == "--places") number(o.places);
    else if (arg == "--epochs") number(o.epochs);
    else if (arg == "--batch") number(o.batch);
    else if (arg == "--seed") number(o.seed);
    else if (arg == "--lr") number(o.lr);
    else if (arg == "--schedule-epochs") number(o.schedule_epochs);
    else if (arg == "--clip") number(o.clip);
    else if (arg == "--bucket-bytes") number(o.bucket_bytes);
    else if (arg == "--target") number(o.target);
    else if (arg == "--data") o.data = value;
    else if (arg == "--trace") o.trace = value;
    else if (arg == "--checkpoint") o.checkpoint = value;
    else if (arg == "--resume") o.resume = value;
    else usage("unknown option " + arg);
  }
  if (o.places == 0 || o.batch == 0 || o.schedule_epochs == 0) usage("--places, --batch and --schedule-epochs must be positive");
#if !defined(PDO_WITH_IO)
  if (!o.checkpoint.empty() || !o.resume.empty()) usage("--checkpoint and --resume need pdo::io (nlohmann/json), which this build lacks");
#endif
  return o;
}

/// @brief The model: two conv / relu / max-pool blocks and two linear layers.
auto make_cnn(std::uint64_t seed) {
  pdo::nn::rng gen(seed);
  using namespace pdo::nn;
  return sequential(conv2d<float>(1, 16, 3, gen, {1, 1}), relu{}, max_pool2d{},   // [N, 16, 4, 4]
                    conv2d<float>(16, 32, 3, gen, {1, 1}), relu{}, max_pool2d{},  // [N, 32, 2, 2]
                    flatten{}, linear<float>(128, 64, gen), relu{}, linear<float>(64, 10, gen));
}

/// @brief Rows `order[first, last)` of the set.
digits::dataset take(const digits::dataset& d, const std::vector<std::size_t>& order, std::size_t first, std::size_t last) {
  digits::dataset out{pdo::tensor<float, 4>({last - first, 1, 8, 8}), pdo::tensor<int, 1>({last - first})};
  for (std::size_t i = first; i < last; ++i) {
    std::copy_n(d.images.data() + order[i] * 64, 64, out.images.data() + (i - first) * 64);
    out.labels(i - first) = d.labels(order[i]);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    const digits::dataset all = digits::load(o.data);
    if (o.check_data) {
      std::printf("digits: %zu samples\n", all.labels.size());
      return 0;
    }
    // a fixed, seeded split: 80% to train, 20% to test
    std::vector<std::size_t> order(all.labels.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::shuffle(order.begin(), order.end(), std::mt19937_64(o.seed));
    const std::size_t n_train = order.size() * 4 / 5;
    const auto train = take(all, order, 0, n_train);
    const auto test = take(all, order, n_train, order.size());

    const auto mesh = pdo::make_mesh<"dp">(pdo::cpu_places(o.places));
    const std::size_t steps_per_epoch = (n_train + o.batch - 1) / o.batch;
    auto trainer = pdo::nn::make_data_parallel<float>(
        mesh, [&] { return make_cnn(o.seed); },
        [&](auto params) { return pdo::nn::adam<float>(std::move(params), {.lr = o.lr}); },
        {.bucket_bytes = o.bucket_bytes,
         .clip_grad_norm = o.clip,
         .schedule = pdo::nn::cosine_lr(o.lr, steps_per_epoch, steps_per_epoch * o.schedule_epochs, o.lr / 20)});
    std::cout << "digits: " << train.labels.size() << " training and " << test.labels.size() << " test images of 8x8, "
              << o.places << " places, global batch " << o.batch << "\n"
              << trainer.explain();

#if defined(PDO_WITH_IO)
    if (!o.resume.empty()) {
      pdo::io::load(o.resume, trainer);
      std::printf("resumed from %s after %zu epochs (%zu steps)\n", o.resume.c_str(), trainer.epochs(), trainer.steps());
    }
#endif

    if (!o.trace.empty()) pdo::trace::start();
    trainer.fit(train.images, train.labels, {.epochs = o.epochs, .batch_size = o.batch, .seed = o.seed},
                [&](const auto& s) {
                  std::printf("epoch %3zu  loss %.4f  accuracy %.4f  %8.0f samples/s\n", s.epoch + 1, s.loss, s.accuracy,
                              s.samples_per_second);
#if defined(PDO_WITH_IO)
                  if (!o.checkpoint.empty()) pdo::io::save(o.checkpoint, trainer);
#endif
                  std::fflush(stdout);
                });
    const double accuracy = trainer.accuracy(test.images, test.labels);
    if (!o.trace.empty()) {
      pdo::trace::stop();
      pdo::trace::save(o.trace);
      std::printf("trace: %zu events in %s (open it in ui.perfetto.dev or chrome://tracing)\n", pdo::trace::size(), o.trace.c_str());
    }
    std::printf("test accuracy: %.4f (%zu images)\n", accuracy, test.labels.size());
    if (accuracy < o.target) {
      std::fprintf(stderr, "digits: test accuracy %.4f is below the target %.2f\n", accuracy, o.target);
      return 1;
    }
    return 0;
  } catch (const pdo::error& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
