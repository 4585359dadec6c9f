// pdo/kernels/softmax.hpp: softmax, log_softmax and cross-entropy rows, as Thrust kernels.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/dtype.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/kernels/place_system.hpp>
#include <pdo/kernels/reduce.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace pdo::detail {

/// @brief The log-sum-exp pieces of a row of `extent` elements `stride` apart: its max, and
/// the sum of exp(x - max) over every element but the (first) maximum, whose own term is 1.
/// log(sum) is then log1p(rest): exact for sums near 1, where log(1 + rest) would lose rest
/// to the rounding of 1 + rest. The terms add in sum_accumulator<T>, rest rounded once.
template <class T>
struct log_sum_exp_parts {
  T top;
  T rest;
  PDO_HD log_sum_exp_parts(const T* row, std::size_t extent, std::size_t stride) {
    using std::exp;
    std::size_t at = 0;
    top = row[0];
    for (std::size_t e = 1; e < extent; ++e) {
      const T v = row[e * stride];
      if (v > top || (v != v && top == top)) {  // the first NaN is the max, as with nan_max
        top = v;
        at = e;
      }
    }
    // the max's own term, exp(max - max), is 1 for a finite max and NaN for +-inf (a row with
    // an infinite max is NaN throughout, as PyTorch gives): rest starts from max - max
    sum_accumulator<T> sum = top - top;
    for (std::size_t e = 0; e < extent; ++e)
      if (e != at) sum += static_cast<T>(exp(row[e * stride] - top));
    rest = static_cast<T>(sum);
  }
  /// @brief log(sum of exp(x - max)).
  PDO_HD T log_sum() const {
    using std::log1p;
    return static_cast<T>(log1p(rest));
  }
  /// @brief sum of exp(x - max).
  PDO_HD T sum() const { return T(1) + rest; }
};

/// @brief Row r of a softmax along the middle dim of [outer, extent, inner]: the row's max
/// is subtracted first, so large inputs do not overflow, and log_softmax is
/// (x - max) - log1p(rest) (see log_sum_exp_parts): neither the sum nor its log is rounded
/// to the precision of a large max.
template <class T, bool Log>
struct softmax_row {
  const T* in;
  T* out;
  std::size_t extent, inner;
  PDO_HD void operator()(std::size_t r) const {
    using std::exp;
    const std::size_t base = (r / inner) * extent * inner + r % inner;
    const log_sum_exp_parts<T> parts(in + base, extent, inner);
    if constexpr (Log) {
      const T log_sum = parts.log_sum();
      for (std::size_t e = 0; e < extent; ++e) out[base + e * inner] = (in[base + e * inner] - parts.top) - log_sum;
    } else {
      const T sum = parts.sum();
      for (std::size_t e = 0; e < extent; ++e) out[base + e * inner] = static_cast<T>(exp(in[base + e * inner] - parts.top)) / sum;
    }
  }
};

/// @brief The rows [j, j + n) of outer index o of a softmax (or log_softmax) along a dim that
/// is not the innermost, on the CPU (a block of for_each_inner_block): their statistics stay in
/// buffers while the elements along the dim stream past a line of the block at a time. Each
/// row gets the bits softmax_row gives it (the same max, the same terms added in the same
/// order), but the block reads lines, not columns strided by the inner extent.
template <class T, bool Log>
struct softmax_rows_block {
  static constexpr std::size_t width = 256;  ///< rows per block: their statistics fit in L1
  const T* in;
  T* out;
  dim_view v;
  void operator()(std::size_t o, std::size_t j, std::size_t n) const {
    using std::exp;
    const std::size_t first = o * v.extent * v.inner + j;
    alignas(64) T top[width];
    alignas(64) T rest[width];
    alignas(64) sum_accumulator<T> sum[width];
    std::size_t at[width];
    for (std::size_t i = 0; i < n; ++i) {
      top[i] = in[first + i];
      at[i] = 0;
    }
    for (std::size_t e = 1; e < v.extent; ++e) {
      const T* line = in + first + e * v.inner;
      for (std::size_t i = 0; i < n; ++i) {
        const T x = line[i];
        const bool above = x > top[i] || (x != x && top[i] == top[i]);  // as log_sum_exp_parts
        top[i] = above ? x : top[i];
        at[i] = above ? e : at[i];
      }
    }
    for (std::size_t i = 0; i < n; ++i) sum[i] = top[i] - top[i];
    for (std::size_t e = 0; e < v.extent; ++e) {
      const T* line = in + first + e * v.inner;
      for (std::size_t i = 0; i < n; ++i)
        if (e != at[i]) sum[i] += static_cast<T>(exp(line[i] - top[i]));
    }
    for (std::size_t i = 0; i < n; ++i) {  // log_sum() or sum() of log_sum_exp_parts
      using std::log1p;
      rest[i] = static_cast<T>(sum[i]);
      if constexpr (Log) rest[i] = static_cast<T>(log1p(rest[i]));
      else rest[i] = T(1) + rest[i];
    }
    for (std::size_t e = 0; e < v.extent; ++e) {
      const T* line = in + first + e * v.inner;
      T* to = out + first + e * v.inner;
      for (std::size_t i = 0; i < n; ++i) {
        if constexpr (Log) to[i] = (line[i] - top[i]) - rest[i];
        else to[i] = static_cast<T>(exp(line[i] - top[i])) / rest[i];
      }
    }
  }
};

/// @brief The sum of exp(x - max) over a row, in two parts: how many elements equal the max
/// (each adds exactly 1), and the sum over the others. log_sum_exp_parts' `rest` is then
/// (ties - 1) + others, exact for a row with one max, whatever order the terms were added in.
/// Both add in sum_accumulator<T>.
template <class T>
struct exp_sum_parts {
  sum_accumulator<T> ties;
  sum_accumulator<T> others;
};

template <class T>
struct add_exp_sum_parts {
  PDO_HD exp_sum_parts<T> operator()(const exp_sum_parts<T>& a, const exp_sum_parts<T>& b) const {
    return {a.ties + b.ties, a.others + b.others};
  }
};

/// @brief Element e of row r's exp_sum_parts, given the rows' maxima `tops`.
template <class T>
struct exp_sum_part_of {
  element_along_dim<T> element;
  const T* tops;
  PDO_HD exp_sum_parts<T> operator()(std::size_t r, std::size_t e) const {
    using std::exp;
    using A = sum_accumulator<T>;
    const T x = element(r, e);
    if (x == tops[r]) return {A(1), A(x - x)};  // x - x: NaN for an infinite max, as log_sum_exp_parts
    return {A(0), A(static_cast<T>(exp(x - tops[r])))};
  }
};

/// @brief (ties - 1) + others: the sum of exp(x - max) over a row but for one maximum (see
/// exp_sum_parts), log_sum_exp_parts' `rest`.
template <class T>
PDO_HD T rest_of(const exp_sum_parts<T>& p) {
  return static_cast<T>((p.ties - 1) + p.others);
}

/// @brief log(sum of exp(x - max)) of a row from its parts: log1p(rest), as log_sum_exp_parts.
template <class T>
PDO_HD T log_sum_of(const exp_sum_parts<T>& p) {
  using std::log1p;
  return static_cast<T>(log1p(rest_of(p)));
}

/// @brief The log-sum-exp statistics of the rows of [outer, extent, inner] along the middle
/// dim, in the memory of a GPU place for the kernels of one op, computed by two segmented
/// reductions (a block of threads per long row): tops()[r] the row's max, parts()[r] its
/// exp_sum_parts.
template <class T>
class row_statistics {
 public:
  row_statistics(gpu_system& system, const T* in, const dim_view& v)
      : tops_(*system.place, v.outer * v.inner), parts_(*system.place, v.outer * v.inner) {
    const element_along_dim<T> element{in, v.extent, v.inner};
    const bool contiguous = v.inner == 1;
    const std::size_t rows = v.outer * v.inner;
    segmented_reduce(system, rows, v.extent, contiguous, element, reduction_identity<T>(reduction::max), max_of<T>{}, tops_.data());
    segmented_reduce(system, rows, v.extent, contiguous, exp_sum_part_of<T>{element, tops_.data()}, exp_sum_parts<T>{0, 0},
                     add_exp_sum_parts<T>{}, parts_.data());
  }
  [[nodiscard]] const T* tops() const { return tops_.data(); }
  [[nodiscard]] const exp_sum_parts<T>* parts() const { return parts_.data(); }

 private:
  kernel_scratch<T> tops_;
  kernel_scratch<exp_sum_parts<T>> parts_;
};

/// @brief Element i of softmax (or log_softmax) of [outer, extent, inner] along the middle
/// dim, from its row's statistics.
template <class T, bool Log>
struct softmax_element {
  const T* in;
  const T* tops;
  const exp_sum_parts<T>* parts;
  std::size_t extent, inner;
  PDO_HD T operator()(std::size_t i) const {
    using std::exp;
    const std::size_t r = (i / (extent * inner)) * inner + i % inner;
    if constexpr (Log) return (in[i] - tops[r]) - log_sum_of(parts[r]);
    else return static_cast<T>(exp(in[i] - tops[r])) / (T(1) + rest_of(parts[r]));
  }
};

/// @brief softmax (or log_softmax) of `in` laid out as `v`, along its middle dim, into `out`.
/// Short rows on a GPU, and rows along the innermost dim on a CPU place: one work item per row.
/// Along another dim on a CPU place: blocks of rows read line by line (softmax_rows_block).
/// Long rows on a GPU: the rows' statistics by segmented reductions (a block of threads per
/// row), then one thread per element.
template <bool Log, class T>
void softmax_dim(place_system& system, const T* in, const dim_view& v, T* out) {
  if (v.extent == 0) return;
  const std::size_t rows = v.outer * v.inner;
  const thrust::counting_iterator<std::size_t> begin(0);
  system.visit([&](auto& backend) {
    if constexpr (gpu_backend<decltype(backend)>) {
      if (v.extent >= long_segment) {
        const row_statistics<T> stats(backend, in, v);
        transform(backend, begin, begin + static_cast<std::ptrdiff_t>(rows * v.extent), out,
                  softmax_element<T, Log>{in, stats.tops(), stats.parts(), v.extent, v.inner});
        return;
      }
    } else if (v.inner > 1) {
      for_each_inner_block(backend, v, softmax_rows_block<T, Log>{in, out, v});
      return;
    }
    for_each_n(backend, begin, rows, softmax_row<T, Log>{in, out, v.extent, v.inner});
  });
}

/// @brief The loss of sample i: log-sum-exp of its logits minus the logit of its label,
/// as log1p(rest) - (logit - max) (see log_sum_exp_parts), so a large max costs no precision.
template <class T, class Label>
struct cross_entropy_row {
  const T* logits;
  const Label* labels;
  std::size_t classes;
  PDO_HD T operator()(std::size_t i) const {
    const T* row = logits + i * classes;
    const log_sum_exp_parts<T> parts(row, classes, 1);
    return parts.log_sum() - (row[static_cast<std::size_t>(labels[i])] - parts.top);
  }
};

/// @brief The loss of sample i from its row's statistics (as cross_entropy_row).
template <class T, class Label>
struct cross_entropy_from_parts {
  const T* logits;
  const Label* labels;
  const T* tops;
  const exp_sum_parts<T>* parts;
  std::size_t classes;
  PDO_HD T operator()(std::size_t i) const {
    return log_sum_of(parts[i]) - (logits[i * classes + static_cast<std::size_t>(labels[i])] - tops[i]);
  }
};

/// @brief *out (in the memory of the system's place) = the sum of the losses of `rows` samples
/// of `classes` logits each. A CPU place and few classes on a GPU: a work item per sample; many
/// classes on a GPU: the rows' statistics by segmented reductions first.
template <class T, class Label>
void cross_entropy_sum_into(place_system& system, const T* logits, const Label* labels, std::size_t rows, std::size_t classes, T* out) {
  const thrust::counting_iterator<std::size_t> begin(0), end(rows);
  system.visit([&](auto& backend) {
    if constexpr (gpu_backend<decltype(backend)>) {
      if (classes >= long_segment) {
        const row_statistics<T> stats(backend, logits, dim_view{rows, classes, 1});
        transform_reduce_into(backend, begin, end, cross_entropy_from_parts<T, Label>{logits, labels, stats.tops(), stats.parts(), classes},
                              T{}, thrust::plus<T>{}, out);
        return;
      }
    }
    transform_reduce_into(backend, begin, end, cross_entropy_row<T, Label>{logits, labels, classes}, T{}, thrust::plus<T>{}, out);
  });
}

/// @brief Row r of d(mean cross-entropy)/d(logits), times `scale`: (softmax(row) - one_hot(label)) * scale.
template <class T, class Label>
struct cross_entropy_grad_row {
  const T* logits;
  const Label* labels;
  T* out;
  std::size_t classes;
  T scale;
  PDO_HD void operator()(std::size_t r) const {
    softmax_row<T, false>{logits + r * classes, out + r * classes, classes, 1}(0);
    const auto label = static_cast<std::size_t>(labels[r]);
    for (std::size_t c = 0; c < classes; ++c) out[r * classes + c] = (out[r * classes + c] - (c == label ? T(1) : T(0))) * scale;
  }
};

/// @brief Element i of the cross-entropy gradient, from its row's statistics (as cross_entropy_grad_row).
template <class T, class Label>
struct cross_entropy_grad_element {
  softmax_element<T, false> softmax;
  const Label* labels;
  T scale;
  PDO_HD T operator()(std::size_t i) const {
    const std::size_t r = i / softmax.extent, c = i % softmax.extent;
    return (softmax(i) - (c == static_cast<std::size_t>(labels[r]) ? T(1) : T(0))) * scale;
  }
};

/// @brief out = (softmax(logits) - one_hot(labels)) * scale for `rows` rows of `classes`. A CPU
/// place and few classes on a GPU: a work item per row; many classes on a GPU: the rows'
/// statistics by segmented reductions, then a thread per element.
template <class T, class Label>
void cross_entropy_grad(place_system& system, const T* logits, const Label* labels, std::size_t rows, std::size_t classes, T scale,
                        T* out) {
  const thrust::counting_iterator<std::size_t> begin(0);
  system.visit([&](auto& backend) {
    if constexpr (gpu_backend<decltype(backend)>) {
      if (classes >= long_segment) {
        const row_statistics<T> stats(backend, logits, dim_view{rows, classes, 1});
        transform(backend, begin, begin + static_cast<std::ptrdiff_t>(rows * classes), out,
                  cross_entropy_grad_element<T, Label>{{logits, stats.tops(), stats.parts(), classes, 1}, labels, scale});
        return;
      }
    }
    for_each_n(backend, begin, rows, cross_entropy_grad_row<T, Label>{logits, labels, out, classes, scale});
  });
}

/// @brief *out = *out / count (the mean of a sum), NaN for no samples (the mean of nothing,
/// as PyTorch gives).
template <class T>
struct mean_of_sum {
  T* out;
  std::size_t count;
  PDO_HD void operator()(std::size_t) const { *out = count == 0 ? T(0) / T(0) : *out / static_cast<T>(count); }
};

/// @brief 1 for a label outside [0, classes), else 0.
template <class Label>
struct label_out_of_range {
  const Label* labels;
  std::size_t classes;
  PDO_HD std::size_t operator()(std::size_t i) const {
    const Label l = labels[i];
    if (!(l >= Label(0) && static_cast<double>(l) < static_cast<double>(classes))) return 1;  // NaN too
    return l != Label(static_cast<std::int64_t>(l)) ? 1 : 0;                                  // a fraction
  }
};

}  // namespace pdo::detail
