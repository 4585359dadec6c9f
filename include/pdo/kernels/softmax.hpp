// pdo/kernels/softmax.hpp: softmax, log_softmax and cross-entropy rows, as Thrust kernels.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/kernels/place_system.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace pdo::detail {

/// @brief Row r of a softmax along the middle dim of [outer, extent, inner]: the row's
/// max is subtracted first, so large inputs do not overflow.
template <class T, bool Log>
struct softmax_row {
  const T* in;
  T* out;
  std::size_t extent, inner;
  PDO_HD void operator()(std::size_t r) const {
    using std::exp;
    using std::log;
    const std::size_t base = (r / inner) * extent * inner + r % inner;
    T top = in[base];
    for (std::size_t e = 1; e < extent; ++e) top = in[base + e * inner] > top ? in[base + e * inner] : top;
    T total{};
    for (std::size_t e = 0; e < extent; ++e) total += static_cast<T>(exp(in[base + e * inner] - top));
    if constexpr (Log) {
      const T shift = top + static_cast<T>(log(total));
      for (std::size_t e = 0; e < extent; ++e) out[base + e * inner] = in[base + e * inner] - shift;
    } else {
      for (std::size_t e = 0; e < extent; ++e) out[base + e * inner] = static_cast<T>(exp(in[base + e * inner] - top)) / total;
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

/// @brief The loss of sample i: log-sum-exp of its logits minus the logit of its label.
template <class T, class Label>
struct cross_entropy_row {
  const T* logits;
  const Label* labels;
  std::size_t classes;
  PDO_HD T operator()(std::size_t i) const {
    using std::exp;
    using std::log;
    const T* row = logits + i * classes;
    T top = row[0];
    for (std::size_t c = 1; c < classes; ++c) top = row[c] > top ? row[c] : top;
    T total{};
    for (std::size_t c = 0; c < classes; ++c) total += static_cast<T>(exp(row[c] - top));
    return top + static_cast<T>(log(total)) - row[static_cast<std::size_t>(labels[i])];
  }
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
