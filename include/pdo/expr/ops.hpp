// pdo/expr/ops.hpp: the elementwise operations, as functors callable on host and device.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/core/dtype.hpp>

#include <cmath>
#include <type_traits>
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
/// @brief negate(x) = -x.
struct negate {
  /// @brief The name plans and error messages print for this op ("negate").
  static constexpr std::string_view name = "negate";
  /// @brief linearity::scaling: the negation of a partial operand stays partial.
  static constexpr linearity rule = linearity::scaling;
  /// @brief Returns -x.
  template <class T>
  PDO_HD static T apply(T x) { return -x; }
};
/// @brief exp(x) = e^x.
struct exp {
  /// @brief The name plans and error messages print for this op ("exp").
  static constexpr std::string_view name = "exp";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns e^x (std::exp, or T's own exp found by argument-dependent lookup).
  template <class T>
  PDO_HD static T apply(T x) { using std::exp; return static_cast<T>(exp(x)); }
};
/// @brief log(x): the natural logarithm.
struct log {
  /// @brief The name plans and error messages print for this op ("log").
  static constexpr std::string_view name = "log";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns ln x (std::log, or T's own log found by argument-dependent lookup).
  template <class T>
  PDO_HD static T apply(T x) { using std::log; return static_cast<T>(log(x)); }
};
/// @brief sqrt(x): the square root.
struct sqrt {
  /// @brief The name plans and error messages print for this op ("sqrt").
  static constexpr std::string_view name = "sqrt";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns √x (std::sqrt, or T's own sqrt found by argument-dependent lookup).
  template <class T>
  PDO_HD static T apply(T x) { using std::sqrt; return static_cast<T>(sqrt(x)); }
};
/// @brief tanh(x): the hyperbolic tangent.
struct tanh {
  /// @brief The name plans and error messages print for this op ("tanh").
  static constexpr std::string_view name = "tanh";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns tanh x (std::tanh, or T's own tanh found by argument-dependent lookup).
  template <class T>
  PDO_HD static T apply(T x) { using std::tanh; return static_cast<T>(tanh(x)); }
};
/// @brief sigmoid(x) = 1 / (1 + e^-x), the logistic function.
struct sigmoid {
  /// @brief The name plans and error messages print for this op ("sigmoid").
  static constexpr std::string_view name = "sigmoid";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns 1 / (1 + e^-x), computed in T.
  template <class T>
  PDO_HD static T apply(T x) { using std::exp; return static_cast<T>(T(1) / (T(1) + exp(-x))); }
};
/// @brief relu(x) = max(x, 0); NaN stays NaN.
struct relu {
  /// @brief The name plans and error messages print for this op ("relu").
  static constexpr std::string_view name = "relu";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns x where x > 0 or x is NaN, else 0.
  template <class T>
  PDO_HD static T apply(T x) { return (x > T(0) || x != x) ? x : T(0); }  // NaN stays NaN
};
/// @brief GELU, exact: x * Φ(x) = 0.5 x (1 + erf(x / √2)), PyTorch's default (F.gelu).
struct gelu {
  /// @brief The name plans and error messages print for this op ("gelu").
  static constexpr std::string_view name = "gelu";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns the exact gelu of x, computed in double and converted to T.
  template <class T>
  PDO_HD static T apply(T x) {
    using std::erf;
    const double v = static_cast<double>(x);
    return static_cast<T>(0.5 * v * (1.0 + erf(v * 0.7071067811865476)));
  }
};

/// @brief The derivative of the exact gelu: Φ(x) + x φ(x).
struct gelu_derivative {
  /// @brief The name plans and error messages print for this op ("gelu_derivative").
  static constexpr std::string_view name = "gelu_derivative";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns Φ(x) + x φ(x), computed in double and converted to T.
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
  /// @brief The name plans and error messages print for this op ("gelu_tanh").
  static constexpr std::string_view name = "gelu_tanh";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns the tanh-approximated gelu of x, computed in double and converted to T.
  template <class T>
  PDO_HD static T apply(T x) {
    using std::tanh;
    const double v = static_cast<double>(x);
    return static_cast<T>(0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))));
  }
};

/// @brief The derivative of gelu_tanh, for its backward.
struct gelu_tanh_derivative {
  /// @brief The name plans and error messages print for this op ("gelu_tanh_derivative").
  static constexpr std::string_view name = "gelu_tanh_derivative";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns the derivative of gelu_tanh at x, computed in double; 0.5 (1 + t) where tanh saturates.
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
  /// @brief The name plans and error messages print for this op ("expand").
  static constexpr std::string_view name = "expand";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns a; the second operand only supplies the shape.
  template <class T>
  PDO_HD static T apply(T a, T) { return a; }
};
/// @brief add(a, b) = a + b.
struct add {
  /// @brief The name plans and error messages print for this op ("add").
  static constexpr std::string_view name = "add";
  /// @brief linearity::additive: the sum of operands partial over the same axes stays partial.
  static constexpr linearity rule = linearity::additive;
  /// @brief Returns a + b.
  template <class T>
  PDO_HD static T apply(T a, T b) { return a + b; }
};
/// @brief subtract(a, b) = a - b.
struct subtract {
  /// @brief The name plans and error messages print for this op ("subtract").
  static constexpr std::string_view name = "subtract";
  /// @brief linearity::additive: the difference of operands partial over the same axes stays partial.
  static constexpr linearity rule = linearity::additive;
  /// @brief Returns a - b.
  template <class T>
  PDO_HD static T apply(T a, T b) { return a - b; }
};
/// @brief multiply(a, b) = a * b.
struct multiply {
  /// @brief The name plans and error messages print for this op ("multiply").
  static constexpr std::string_view name = "multiply";
  /// @brief linearity::scaling: a product with exactly one partial operand stays partial.
  static constexpr linearity rule = linearity::scaling;
  /// @brief Returns a * b.
  template <class T>
  PDO_HD static T apply(T a, T b) { return a * b; }
};
/// @brief divide(a, b) = a / b.
struct divide {
  /// @brief The name plans and error messages print for this op ("divide").
  static constexpr std::string_view name = "divide";
  /// @brief linearity::numerator: a partial numerator over a non-partial denominator stays partial.
  static constexpr linearity rule = linearity::numerator;
  /// @brief Returns a / b. Integers truncate toward zero; as NumPy's, an integer divided by
  /// zero gives 0 and the lowest signed value divided by -1 gives itself (the quotient wraps),
  /// where C++ has no result (a crash on x86).
  template <class T>
  PDO_HD static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      if (b == T(0)) return T(0);
      if constexpr (std::is_signed_v<T>)
        if (b == T(-1)) return static_cast<T>(static_cast<std::make_unsigned_t<T>>(0) - static_cast<std::make_unsigned_t<T>>(a));
    }
    return a / b;
  }
};
/// @brief maximum(a, b): the larger operand, NaN where either is NaN (as PyTorch's maximum).
struct maximum {
  /// @brief The name plans and error messages print for this op ("maximum").
  static constexpr std::string_view name = "maximum";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns the larger of a and b, or NaN if either is NaN.
  template <class T>
  PDO_HD static T apply(T a, T b) { return detail::nan_max(a, b); }
};
/// @brief minimum(a, b): the smaller operand, NaN where either is NaN (as PyTorch's minimum).
struct minimum {
  /// @brief The name plans and error messages print for this op ("minimum").
  static constexpr std::string_view name = "minimum";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns the smaller of a and b, or NaN if either is NaN.
  template <class T>
  PDO_HD static T apply(T a, T b) { return detail::nan_min(a, b); }
};
// Comparisons give 1 where they hold and 0 elsewhere, in the operands' element type.
/// @brief less(a, b): 1 where a < b, else 0.
struct less {
  /// @brief The name plans and error messages print for this op ("less").
  static constexpr std::string_view name = "less";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a < b, else T(0) (also when either is NaN).
  template <class T>
  PDO_HD static T apply(T a, T b) { return a < b ? T(1) : T(0); }
};
/// @brief less_equal(a, b): 1 where a <= b, else 0.
struct less_equal {
  /// @brief The name plans and error messages print for this op ("less_equal").
  static constexpr std::string_view name = "less_equal";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a <= b, else T(0) (also when either is NaN).
  template <class T>
  PDO_HD static T apply(T a, T b) { return a <= b ? T(1) : T(0); }
};
/// @brief greater(a, b): 1 where a > b, else 0.
struct greater {
  /// @brief The name plans and error messages print for this op ("greater").
  static constexpr std::string_view name = "greater";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a > b, else T(0) (also when either is NaN).
  template <class T>
  PDO_HD static T apply(T a, T b) { return a > b ? T(1) : T(0); }
};
/// @brief greater_equal(a, b): 1 where a >= b, else 0.
struct greater_equal {
  /// @brief The name plans and error messages print for this op ("greater_equal").
  static constexpr std::string_view name = "greater_equal";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a >= b, else T(0) (also when either is NaN).
  template <class T>
  PDO_HD static T apply(T a, T b) { return a >= b ? T(1) : T(0); }
};
/// @brief equal(a, b): 1 where a == b, else 0.
struct equal {
  /// @brief The name plans and error messages print for this op ("equal").
  static constexpr std::string_view name = "equal";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a == b, else T(0) (NaN equals nothing).
  template <class T>
  PDO_HD static T apply(T a, T b) { return a == b ? T(1) : T(0); }
};
/// @brief not_equal(a, b): 1 where a != b, else 0.
struct not_equal {
  /// @brief The name plans and error messages print for this op ("not_equal").
  static constexpr std::string_view name = "not_equal";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a != b, else T(0) (NaN differs from everything).
  template <class T>
  PDO_HD static T apply(T a, T b) { return a != b ? T(1) : T(0); }
};

// What the backward of max and min reads.
/// @brief 1 where a equals b, NaN matching NaN, else 0: the elements a maximum (or minimum)
/// reached, among which its gradient is shared.
struct matches {
  /// @brief The name plans and error messages print for this op ("matches").
  static constexpr std::string_view name = "matches";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns T(1) if a == b or both are NaN, else T(0).
  template <class T>
  PDO_HD static T apply(T a, T b) { return (a == b || (a != a && b != b)) ? T(1) : T(0); }
};
/// @brief The share of maximum(a, b)'s gradient that goes to a: 1 where a is chosen (larger,
/// or NaN where b is not), 1/2 where they tie (equal, or both NaN), else 0 (PyTorch's rule).
struct maximum_share {
  /// @brief The name plans and error messages print for this op ("maximum_share").
  static constexpr std::string_view name = "maximum_share";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns 1/2 on a tie or where both are NaN, 1 where a > b or only a is NaN, else 0.
  template <class T>
  PDO_HD static T apply(T a, T b) {
    if (a == b || (a != a && b != b)) return T(0.5);
    return (a > b || a != a) ? T(1) : T(0);
  }
};
/// @brief The share of minimum(a, b)'s gradient that goes to a (see maximum_share).
struct minimum_share {
  /// @brief The name plans and error messages print for this op ("minimum_share").
  static constexpr std::string_view name = "minimum_share";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns 1/2 on a tie or where both are NaN, 1 where a < b or only a is NaN, else 0.
  template <class T>
  PDO_HD static T apply(T a, T b) {
    if (a == b || (a != a && b != b)) return T(0.5);
    return (a < b || a != a) ? T(1) : T(0);
  }
};

// Ternary op.
/// @brief where(c, a, b): a where c is nonzero, else b.
struct where {
  /// @brief The name plans and error messages print for this op ("where").
  static constexpr std::string_view name = "where";
  /// @brief linearity::none: a partial (pending-sum) operand is reduced before this op is applied.
  static constexpr linearity rule = linearity::none;
  /// @brief Returns a if c is nonzero, else b.
  template <class T>
  PDO_HD static T apply(T c, T a, T b) { return c != T(0) ? a : b; }
};

}  // namespace pdo::op
