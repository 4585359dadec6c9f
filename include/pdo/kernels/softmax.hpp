// pdo/kernels/softmax.hpp: softmax, log_softmax and cross-entropy rows, as Thrust kernels.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/dtype.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/kernels/place_system.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace pdo::detail {

/// @brief The log-sum-exp pieces of a row of `extent` elements `stride` apart: its max, and
/// the sum of exp(x - max) over every element but the (first) maximum, whose own term is 1.
/// log(sum) is then log1p(rest): exact for sums near 1, where log(1 + rest) would lose rest
/// to the rounding of 1 + rest.
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
    rest = T(0);
    for (std::size_t e = 0; e < extent; ++e)
      if (e != at) rest += static_cast<T>(exp(row[e * stride] - top));
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

/// @brief softmax (or log_softmax) of `in` laid out as `v`, along its middle dim, into `out`.
template <bool Log, class T>
void softmax_dim(place_system& system, const T* in, const dim_view& v, T* out) {
  if (v.extent == 0) return;
  thrust::for_each_n(system, thrust::counting_iterator<std::size_t>(0), v.outer * v.inner,
                     softmax_row<T, Log>{in, out, v.extent, v.inner});
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
