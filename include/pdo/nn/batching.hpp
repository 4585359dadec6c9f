// pdo/nn/batching.hpp: cutting global batches into the rows each place trains on, in the
// place's memory (the trainers cut the next batch while the current one trains, with
// pdo::prefetch).
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/error.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/exec/prefetch.hpp>
#include <pdo/expr/softmax.hpp>
#include <pdo/place/mesh.hpp>
#include <pdo/tensor/copy.hpp>
#include <pdo/tensor/tensor.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pdo::nn {

/// @brief The rows of a global batch that one place trains on.
template <class T, std::size_t R, class Target>
struct batch_shard {
  tensor<T, R> inputs;            ///< the place's input rows, in its memory; dim 0 is the rows
  Target targets;                 ///< the targets of the same rows, in the same order and memory
  std::vector<std::size_t> rows;  ///< which rows of the data they are, in their order (to name them in an error)
};

}  // namespace pdo::nn

namespace pdo::detail {

/// @brief The refusal of step `step` of `trainer` ("data_parallel", "pipeline"), whose loss
/// `loss` is not finite: a pdo::error naming the step, its batch and mesh, and the option
/// (`trainer`_options::skip_nonfinite_steps) that skips such steps instead.
[[noreturn]] inline void refuse_nonfinite_step(const std::string& trainer, std::size_t step, std::size_t rows,
                                               const std::string& mesh, double loss) {
  throw error(trainer + "::step: step " + std::to_string(step) + " (a global batch of " + std::to_string(rows) + " rows on " + mesh +
              "): the loss is " + (std::isnan(loss) ? std::string("nan") : format_number(loss)) +
              "; no parameter was updated. Check the inputs and the learning rate, or skip such steps with " + trainer +
              "_options::skip_nonfinite_steps");
}

/// @brief "its 2 rows of the batch are the inputs' rows 5..6 (row 0 here is row 5 there): ",
/// what a place's error in a trainer's step adds so that a row it names can be found in the
/// data the caller passed: rows first .. first + count - 1.
PDO_NOINLINE inline std::string rows_context(std::size_t first, std::size_t count) {
  if (count == 0) return "it holds no rows of the batch: ";
  if (count == 1) return "its 1 row of the batch is the inputs' row " + std::to_string(first) + ": ";
  return "its " + std::to_string(count) + " rows of the batch are the inputs' rows " + std::to_string(first) + ".." +
         std::to_string(first + count - 1) + " (row 0 here is row " + std::to_string(first) + " there): ";
}

/// @brief The same for the rows of a shuffled order: the first 128 of them listed (then how
/// many there are), or as above when they follow each other.
PDO_NOINLINE inline std::string rows_context(const std::vector<std::size_t>& rows) {
  const std::size_t n = rows.size();
  std::size_t i = 1;
  while (i < n && rows[i] == rows[0] + i) ++i;
  if (i >= n) return rows_context(n == 0 ? 0 : rows[0], n);
  return "its " + std::to_string(n) + " rows of the batch are the inputs' rows " +
         listed(rows, [](std::size_t r) { return std::to_string(r); }, 128) + " (row i here, counted from 0, is the i-th of them): ";
}

/// @brief `forward()`'s result; a pdo::error it throws gets `context()` (rows_context of the
/// rows it ran on, built only then) in front of its message, keeping its subclass.
template <class Context, class F>
decltype(auto) naming_rows(const Context& context, F&& forward) {
  try {
    return std::forward<F>(forward)();
  } catch (const error&) {
    captured_error::current().rethrow_with_context(context());
  }
}

template <std::size_t R>
shape_t<R> with_rows(shape_t<R> s, std::size_t rows) {
  s[0] = rows;
  return s;
}

template <class T, class Label>
std::array<double, 3> classify_rows(const tensor<T, 2>& out, const tensor<Label, 1>& labels);

/// @brief How many rows of `out` [rows, classes] have their largest output at their label
/// (classify_rows' first count); 0 for outputs that are not such a matrix with class labels.
template <class T, class Label>
std::size_t count_correct(const tensor<T, 2>& out, const tensor<Label, 1>& labels) {
  return static_cast<std::size_t>(classify_rows(out, labels)[0]);
}
template <class Out, class Y>
std::size_t count_correct(const Out&, const Y&) {
  return 0;
}

/// @brief A place's classification of its rows, for accuracy, to be summed over the places
/// that classify: the rows whose largest output is at their label, the labels that are not
/// class indices (not counted as right or wrong), and classes times rows (summed over the
/// places, the classes times the batch's rows: how the batch's error names the classes).
template <class T, class Label>
std::array<double, 3> classify_rows(const tensor<T, 2>& out, const tensor<Label, 1>& labels) {
  if (out.on_gpu() || labels.on_gpu()) return classify_rows(to_host(out), to_host(labels));
  const std::size_t classes = out.extent(1);
  const label_out_of_range<Label> out_of_range{labels.data(), classes};
  std::array<double, 3> counts{0, 0, static_cast<double>(classes) * static_cast<double>(out.extent(0))};
  for (std::size_t i = 0; i < out.extent(0); ++i) {
    const T* row = out.data() + i * classes;
    if (out_of_range(i) != 0) ++counts[1];
    else counts[0] += static_cast<std::size_t>(std::max_element(row, row + classes) - row) == static_cast<std::size_t>(labels(i)) ? 1 : 0;
  }
  return counts;
}

/// @brief After the classification of every row of `labels` (classify_rows, summed over the
/// places): the error of `op` when some labels are not class indices, naming the first with its
/// row (every place and process throws it, having the same sums).
template <class Label>
void check_classified(const char* op, const tensor<Label, 1>& labels, const std::array<double, 3>& totals) {
  if (totals[1] == 0 || labels.extent(0) == 0) return;
  const auto classes = static_cast<std::size_t>(totals[2] / static_cast<double>(labels.extent(0)) + 0.5);
  throw_bad_labels(op, labels.where(), labels.data(), labels.extent(0), 0, classes, static_cast<std::size_t>(totals[1]), "the batch");
}

/// @brief Rows order[first, first + count) of the host tensor `src` (row-major, dim 0 the
/// rows), as a tensor in `where`'s memory (cut on the host, copied up to a GPU place).
template <class X>
X cut_rows(const X& src, const std::vector<std::size_t>& order, std::size_t first, std::size_t count, const any_place& where) {
  const bool gpu = where.kind() == place_kind::cuda;
  X out = gpu ? X::on_host(with_rows(src.shape(), count)) : X(with_rows(src.shape(), count), where, uninitialized);
  const std::size_t row = src.extent(0) == 0 ? 0 : src.size() / src.extent(0);
  for (std::size_t i = 0; i < count; ++i) std::copy_n(src.data() + order[first + i] * row, row, out.data() + i * row);
  return gpu ? to_place(out, where) : out;
}

/// @brief Rows [first, first + count) of `src` in order, as above.
template <class X>
X cut_rows(const X& src, std::size_t first, std::size_t count, const any_place& where) {
  std::vector<std::size_t> order(count);
  for (std::size_t i = 0; i < count; ++i) order[i] = first + i;
  return cut_rows(src, order, 0, count, where);
}

}  // namespace pdo::detail
