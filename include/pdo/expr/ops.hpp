// pdo/expr/ops.hpp: the elementwise operations, as functors callable on host and device.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/dtype.hpp>

#include <cmath>
#include <string_view>

namespace pdo::op {

/// @brief How an elementwise op treats a partial (pending-sum) operand: whether
/// op(sum of addends) equals the sum of op(addend) for the operands named.
enum class linearity {
  none,         ///< partial operands are reduced first
  additive,     ///< + and -: both operands partial over the same axes stay partial
  scaling,      ///< * and negate: exactly one operand partial stays partial
  numerator,    ///< /: a partial numerator over a non-partial denominator stays partial
};

// Unary ops. `apply` is the math; `name` is what plans and errors print.
struct negate {
  static constexpr std::string_view name = "negate";
  static constexpr linearity rule = linearity::scaling;
  template <class T>
  PDO_HD static T apply(T x) { return -x; }
};
struct exp {
  static constexpr std::string_view name = "exp";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T x) { using std::exp; return static_cast<T>(exp(x)); }
};
struct log {
  static constexpr std::string_view name = "log";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T x) { using std::log; return static_cast<T>(log(x)); }
};
struct sqrt {
  static constexpr std::string_view name = "sqrt";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T x) { using std::sqrt; return static_cast<T>(sqrt(x)); }
};
struct tanh {
  static constexpr std::string_view name = "tanh";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T x) { using std::tanh; return static_cast<T>(tanh(x)); }
};
struct sigmoid {
  static constexpr std::string_view name = "sigmoid";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T x) { using std::exp; return static_cast<T>(T(1) / (T(1) + exp(-x))); }
};
struct relu {
  static constexpr std::string_view name = "relu";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T x) { return (x > T(0) || x != x) ? x : T(0); }  // NaN stays NaN
};
/// @brief GELU, exact: x * Φ(x) = 0.5 x (1 + erf(x / √2)), PyTorch's default (F.gelu).
struct gelu {
  static constexpr std::string_view name = "gelu";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T x) {
    using std::erf;
    const double v = static_cast<double>(x);
    return static_cast<T>(0.5 * v * (1.0 + erf(v * 0.7071067811865476)));
  }
};

/// @brief The derivative of the exact gelu: Φ(x) + x φ(x).
struct gelu_derivative {
  static constexpr std::string_view name = "gelu_derivative";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T x) {
    using std::erf;
    using std::exp;
    const double v = static_cast<double>(x);
    return static_cast<T>(0.5 * (1.0 + erf(v * 0.7071067811865476)) + v * 0.3989422804014327 * exp(-0.5 * v * v));
  }
};

/// @brief GELU, tanh approximation: 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))), as in GPT-2
/// and PyTorch's F.gelu(x, approximate="tanh").
struct gelu_tanh {
  static constexpr std::string_view name = "gelu_tanh";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T x) {
    using std::tanh;
    const double v = static_cast<double>(x);
    return static_cast<T>(0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))));
  }
};

/// @brief The derivative of gelu_tanh, for its backward.
struct gelu_tanh_derivative {
  static constexpr std::string_view name = "gelu_tanh_derivative";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T x) {
    using std::tanh;
    const double v = static_cast<double>(x), c = 0.7978845608028654;
    const double t = tanh(c * (v + 0.044715 * v * v * v)), sech2 = 1.0 - t * t;
    // where tanh is saturated the second term is 0, also for |x| so large that x² overflows
    return static_cast<T>(0.5 * (1.0 + t) + (sech2 == 0.0 ? 0.0 : 0.5 * v * sech2 * c * (1.0 + 3.0 * 0.044715 * v * v)));
  }
};

// Binary ops.
/// @brief expand(a, like): a broadcast to the shape of `like` (whose values are not read).
struct expand {
  static constexpr std::string_view name = "expand";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T a, T) { return a; }
};
struct add {
  static constexpr std::string_view name = "add";
  static constexpr linearity rule = linearity::additive;
  template <class T>
  PDO_HD static T apply(T a, T b) { return a + b; }
};
struct subtract {
  static constexpr std::string_view name = "subtract";
  static constexpr linearity rule = linearity::additive;
  template <class T>
  PDO_HD static T apply(T a, T b) { return a - b; }
};
struct multiply {
  static constexpr std::string_view name = "multiply";
  static constexpr linearity rule = linearity::scaling;
  template <class T>
  PDO_HD static T apply(T a, T b) { return a * b; }
};
struct divide {
  static constexpr std::string_view name = "divide";
  static constexpr linearity rule = linearity::numerator;
  template <class T>
  PDO_HD static T apply(T a, T b) { return a / b; }
};
struct maximum {
  static constexpr std::string_view name = "maximum";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T a, T b) { return detail::nan_max(a, b); }
};
struct minimum {
  static constexpr std::string_view name = "minimum";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T a, T b) { return detail::nan_min(a, b); }
};
// Comparisons give 1 where they hold and 0 elsewhere, in the operands' element type.
struct less {
  static constexpr std::string_view name = "less";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T a, T b) { return a < b ? T(1) : T(0); }
};
struct less_equal {
  static constexpr std::string_view name = "less_equal";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T a, T b) { return a <= b ? T(1) : T(0); }
};
struct greater {
  static constexpr std::string_view name = "greater";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T a, T b) { return a > b ? T(1) : T(0); }
};
struct greater_equal {
  static constexpr std::string_view name = "greater_equal";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T a, T b) { return a >= b ? T(1) : T(0); }
};
struct equal {
  static constexpr std::string_view name = "equal";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T a, T b) { return a == b ? T(1) : T(0); }
};
struct not_equal {
  static constexpr std::string_view name = "not_equal";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T a, T b) { return a != b ? T(1) : T(0); }
};

// What the backward of max and min reads.
/// @brief 1 where a equals b, NaN matching NaN, else 0: the elements a maximum (or minimum)
/// reached, among which its gradient is shared.
struct matches {
  static constexpr std::string_view name = "matches";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T a, T b) { return (a == b || (a != a && b != b)) ? T(1) : T(0); }
};
/// @brief The share of maximum(a, b)'s gradient that goes to a: 1 where a is chosen (larger,
/// or NaN where b is not), 1/2 where they tie (equal, or both NaN), else 0 (PyTorch's rule).
struct maximum_share {
  static constexpr std::string_view name = "maximum_share";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T a, T b) {
    if (a == b || (a != a && b != b)) return T(0.5);
    return (a > b || a != a) ? T(1) : T(0);
  }
};
/// @brief The share of minimum(a, b)'s gradient that goes to a (see maximum_share).
struct minimum_share {
  static constexpr std::string_view name = "minimum_share";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T a, T b) {
    if (a == b || (a != a && b != b)) return T(0.5);
    return (a < b || a != a) ? T(1) : T(0);
  }
};

// Ternary op.
/// @brief where(c, a, b): a where c is nonzero, else b.
struct where {
  static constexpr std::string_view name = "where";
  static constexpr linearity rule = linearity::none;
  template <class T>
  PDO_HD static T apply(T c, T a, T b) { return c != T(0) ? a : b; }
};

}  // namespace pdo::op
