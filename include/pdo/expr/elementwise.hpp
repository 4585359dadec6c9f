// pdo/expr/elementwise.hpp: elementwise nodes; a chain of them runs as one fused kernel.
#pragma once

#include <pdo/core/config.hpp>
#include <pdo/expr/expression.hpp>
#include <pdo/expr/ops.hpp>

#include <array>
#include <cstddef>
#include <initializer_list>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace pdo {
namespace detail {

// Readers: what a fused kernel is made of. Each gives the value of its subexpression at
// output element i (coordinates c of the fused group's output), on host and device.
// With Dense, every operand is laid out exactly as the output and is read at i.

template <class T, std::size_t Rank>
struct block_reader {
  const T* data;
  std::array<std::ptrdiff_t, Rank> stride;  ///< per output dim; 0 where the operand broadcasts
  template <bool Dense>
  PDO_HD T at(std::size_t i, const std::size_t* c) const {
    if constexpr (Dense) {
      return data[i];
    } else {
      std::ptrdiff_t o = 0;
      for (std::size_t d = 0; d < Rank; ++d) o += static_cast<std::ptrdiff_t>(c[d]) * stride[d];
      return data[o];
    }
  }
};

template <class T>
struct scalar_reader {
  T value;
  template <bool Dense>
  PDO_HD T at(std::size_t, const std::size_t*) const {
    return value;
  }
};

template <class Op, class... Readers>
struct op_reader;
template <class Op, class A>
struct op_reader<Op, A> {
  A a;
  template <bool Dense>
  PDO_HD auto at(std::size_t i, const std::size_t* c) const {
    return Op::apply(a.template at<Dense>(i, c));
  }
};
template <class Op, class A, class B>
struct op_reader<Op, A, B> {
  A a;
  B b;
  template <bool Dense>
  PDO_HD auto at(std::size_t i, const std::size_t* c) const {
    return Op::apply(a.template at<Dense>(i, c), b.template at<Dense>(i, c));
  }
};
template <class Op, class A, class B, class C>
struct op_reader<Op, A, B, C> {
  A a;
  B b;
  C c3;
  template <bool Dense>
  PDO_HD auto at(std::size_t i, const std::size_t* c) const {
    return Op::apply(a.template at<Dense>(i, c), b.template at<Dense>(i, c), c3.template at<Dense>(i, c));
  }
};

/// @brief The fused kernel: output element i of a group of rank `Rank` with local `extent`.
template <bool Dense, std::size_t Rank, class T, class Reader>
struct fused_kernel {
  Reader reader;
  std::array<std::size_t, Rank> extent;
  PDO_HD T operator()(std::size_t i) const {
    if constexpr (Dense) {
      return reader.template at<true>(i, nullptr);
    } else {
      std::size_t c[Rank == 0 ? 1 : Rank] = {};
      std::size_t rest = i;
      for (std::size_t d = Rank; d-- > 0;) {
        c[d] = rest % extent[d];
        rest /= extent[d];
      }
      return reader.template at<false>(i, c);
    }
  }
};

/// @brief The fused kernel over whole rows (the last dim) of an output of rank `Rank` >= 1
/// whose operands are not all laid out as it is: item r writes row r, its coordinates worked
/// out once (one division per dim per row, not per element).
template <std::size_t Rank, class T, class Reader>
struct fused_rows {
  Reader reader;
  std::array<std::size_t, Rank> extent;
  T* out;
  PDO_HD void operator()(std::size_t r) const {
    std::size_t c[Rank] = {};
    std::size_t rest = r;
    for (std::size_t d = Rank - 1; d-- > 0;) {
      c[d] = rest % extent[d];
      rest /= extent[d];
    }
    const std::size_t length = extent[Rank - 1], first = r * length;
    for (std::size_t j = 0; j < length; ++j) {
      c[Rank - 1] = j;
      out[first + j] = reader.template at<false>(first + j, c);
    }
  }
};

/// @brief Where the output block of a fused group lies: its local extents and global offset.
template <std::size_t Rank>
struct group_frame {
  shape_t<Rank> shape;
  shape_t<Rank> offset;
  bool dense = true;  ///< every operand so far is laid out as the output
};

/// @brief A reader for `block` inside a group framed by `frame`: aligned on the last dims
/// (broadcasting), offset where the block holds more of a dim than the output block
/// (a replicated operand of a split output: the local slice, read in place).
template <std::size_t Rank, class T, std::size_t R>
block_reader<T, Rank> read_block(const block_view<T, R>& block, group_frame<Rank>& frame, std::string_view op) {
  static_assert(R <= Rank);
  block_reader<T, Rank> reader{block.data, {}};
  const auto strides = row_major_strides(block.shape);
  constexpr std::size_t shift = Rank - R;
  bool same = R == Rank;
  for (std::size_t j = 0; j < R; ++j) {
    const std::size_t d = shift + j;
    if (block.shape[j] == frame.shape[d] && block.offset[j] == frame.offset[d]) {
      reader.stride[d] = strides[j];
    } else if (block.global[j] == 1) {
      reader.stride[d] = 0;
      same = false;
    } else if (block.offset[j] <= frame.offset[d] && frame.offset[d] + frame.shape[d] <= block.offset[j] + block.shape[j]) {
      reader.data += static_cast<std::ptrdiff_t>(frame.offset[d] - block.offset[j]) * strides[j];
      reader.stride[d] = strides[j];
      same = same && block.shape[j] == frame.shape[d];
    } else {
      throw layout_error(std::string(op) + ": an operand's block " + format_extents(block.shape) + " at " +
                         format_extents(block.offset) + " does not cover the output block " + format_extents(frame.shape) +
                         " at " + format_extents(frame.offset) + " (a bug in pdo's planner)");
    }
  }
  frame.dense = frame.dense && same;
  return reader;
}

template <class Rule>
constexpr partial_rule partial_rule_of() {
  switch (Rule::rule) {
    case op::linearity::additive: return partial_rule::additive;
    case op::linearity::scaling: return partial_rule::scaling;
    case op::linearity::numerator: return partial_rule::numerator;
    default: return partial_rule::none;
  }
}

template <std::size_t... Ranks>
constexpr std::size_t max_rank_of() {
  std::size_t m = 0;
  ((m = Ranks > m ? Ranks : m), ...);
  return m;
}

}  // namespace detail

namespace detail {

/// @brief Whether the op `Op` gives a value of another kind than its operand's for integers
/// (exp, log, sqrt, tanh, sigmoid, gelu): it takes only floating-point operands, as an
/// integer result would be cut to an integer.
template <class Op>
inline constexpr bool floating_point_only =
    std::is_same_v<Op, op::exp> || std::is_same_v<Op, op::log> || std::is_same_v<Op, op::sqrt> || std::is_same_v<Op, op::tanh> ||
    std::is_same_v<Op, op::sigmoid> || std::is_same_v<Op, op::gelu> || std::is_same_v<Op, op::gelu_derivative> ||
    std::is_same_v<Op, op::gelu_tanh> || std::is_same_v<Op, op::gelu_tanh_derivative>;

/// @brief The first dim of an operand of `shape` that broadcasts (extent 1 in a result dim
/// `out` that is not) while `target` splits it, or shape.size() when there is none.
template <std::size_t Rank>
std::size_t split_broadcast_dim(const shape_t<Rank>& shape, std::span<const std::size_t> out, const layout_value& target) {
  for (std::size_t j = 0; j < Rank; ++j)
    if (shape[j] == 1 && out[j] != 1 && !target.dim_axis[j].empty()) return j;
  return Rank;
}

[[noreturn]] PDO_NOINLINE inline void throw_split_broadcast(std::string_view op, std::size_t dim, const std::string& operand,
                                                            std::size_t extent, std::string_view axis) {
  throw layout_error(std::string(op) + ": dim " + std::to_string(dim) + " of " + operand + " has extent 1 and broadcasts to extent " +
                     std::to_string(extent) + ", which the result splits on \"" + std::string(axis) +
                     "\"; the plan, made from the layouts before extents are known, gives the operand that split, so its one "
                     "element would sit on some of the places only. Replicate that dim of the operand first (pdo::redistribute to a "
                     "layout with replicate there), or keep the unit dim in a layout that replicates it");
}

[[noreturn]] PDO_NOINLINE inline void throw_no_broadcast(std::string_view op, const std::string& operands) {
  throw shape_error(std::string(op) + ": shapes do not broadcast: " + operands);
}

/// @brief "a, b, c".
PDO_NOINLINE inline std::string join_operands(std::initializer_list<std::string> operands) {
  std::string text;
  for (const auto& o : operands) text += (text.empty() ? "" : ", ") + o;
  return text;
}

}  // namespace detail

/// @brief An elementwise op over 1 to 3 operands with NumPy broadcasting (operands are
/// aligned on their last dims; a dim of extent 1 stretches). Chains of these nodes run
/// as one kernel with no temporaries.
template <class Op, class... Children>
class elementwise_node : public detail::op_node<Children...> {

 public:
  /// @brief Element type of the result: that of the first tensor operand (numbers are converted to it).
  using value_type = typename detail::common_value<Children...>::type;
  static_assert(detail::same_element_types<value_type, Children...>,
                "pdo: an elementwise op's tensor operands have different element types; convert one first, pdo::cast<U>(x)");
  /// @brief Whether the op takes the operands' element type (see detail::floating_point_only).
  static constexpr bool element_fits = !detail::floating_point_only<Op> || std::is_floating_point_v<value_type>;
  static_assert(element_fits, "pdo: exp, log, sqrt, tanh, sigmoid and gelu need floating-point operands (float, double): of integers "
                              "their results would be cut to integers; convert them first, pdo::cast<float>(x)");
  /// @brief Whether the operands have one element type that the op takes, and this op and
  /// every op below it is well formed (see detail::op_node): when not, eval stops after the error.
  static constexpr bool well_formed =
      detail::op_node<Children...>::well_formed && detail::same_element_types<value_type, Children...> && element_fits;
  /// @brief The largest rank among the operands.
  static constexpr std::size_t rank = detail::max_rank_of<Children::rank...>();
  /// @brief true: elementwise children that need no redistribution run inside this node's kernel.
  static constexpr bool elementwise = true;
  /// @brief The op's name (Op::name), as plans and error messages print it.
  static constexpr std::string_view name = Op::name;
  /// @brief The planner's rule (detail::elementwise_rule): operand layouts broadcast to `rank` dims, partial
  /// operands kept partial where Op::rule allows.
  static constexpr detail::op_rule rule = detail::elementwise_rule<sizeof...(Children)>(
      detail::partial_rule_of<Op>(), {Children::rule.out...}, {Children::is_scalar...}, rank);

  /// @brief Broadcasts the operands' shapes: pdo::shape_error when they do not broadcast, pdo::layout_error
  /// when a dim of extent 1 that broadcasts is split.
  explicit elementwise_node(Children... c) : detail::op_node<Children...>(std::move(c)...) {
    shape_.fill(1);
    bool ok = true;
    detail::apply_operands([&](const auto&... child) { (broadcast_into(child, ok), ...); }, this->children_);
    if (!ok) detail::throw_no_broadcast(name, operands_text());
    if constexpr (elementwise_node::distributed) check_split_broadcast(std::index_sequence_for<Children...>{});
  }

  /// @brief The operands' broadcast shape.
  [[nodiscard]] const shape_t<rank>& shape() const { return shape_; }

  /// @brief The reader of this node's subexpression inside a fused group; children that
  /// need no redistribution are fused, the others evaluated and read as blocks.
  template <class Ctx, std::size_t Rank>
  auto reader(Ctx& ctx, detail::group_frame<Rank>& frame) const {
    return reader_of(ctx, frame, std::index_sequence_for<Children...>{});
  }

  /// @brief Writes this place's block of the result into `out`: the whole fused group in one pass.
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    detail::group_frame<rank> frame{out.shape(), ctx.local_offset(rule.out, shape_)};
    const auto r = reader(ctx, frame);
    const thrust::counting_iterator<std::size_t> first(0), last(out.size());
    if (frame.dense) {
      thrust::transform(ctx.system, first, last, out.data(),
                        detail::fused_kernel<true, rank, value_type, decltype(r)>{r, out.shape()});
      return;
    }
    if constexpr (rank >= 1) {
      // host loops: row by row, the coordinates carried along each row, the rows over the
      // place's cores when there is work for them all (a small kernel starts no team; a few
      // long rows run element by element, over every core)
      const std::size_t rows = out.size() == 0 ? 0 : out.size() / out.shape()[rank - 1];
      const bool parallel = out.size() >= detail::parallel_grain;
      if (ctx.system.gpu == nullptr && (!parallel || rows >= static_cast<std::size_t>(ctx.system.threads))) {
        detail::cpu_system host;
        host.threads = parallel ? ctx.system.threads : 1;
        detail::for_each_n(host, first, rows, detail::fused_rows<rank, value_type, decltype(r)>{r, out.shape(), out.data()});
        return;
      }
    }
    thrust::transform(ctx.system, first, last, out.data(), detail::fused_kernel<false, rank, value_type, decltype(r)>{r, out.shape()});
  }

 private:
  template <class Child>
  void broadcast_into(const Child& c, bool& ok) {
    const auto s = c.shape();
    constexpr std::size_t shift = rank - Child::rank;
    for (std::size_t j = 0; j < Child::rank; ++j) {
      std::size_t& e = shape_[shift + j];
      if (e == 1) e = s[j];
      else if (s[j] != 1 && s[j] != e) ok = false;
    }
  }

  std::string operands_text() const {
    return detail::apply_operands([&](const auto&... c) { return detail::join_operands({detail::describe_node(c)...}); }, this->children_);
  }

  /// @brief A dim of extent 1 that broadcasts cannot be split: its one element would sit on one place only.
  template <std::size_t... I>
  void check_split_broadcast(std::index_sequence<I...>) const {
    auto check = [&](const auto& c, const detail::layout_value& target) {
      using child_t = std::remove_cvref_t<decltype(c)>;
      const auto s = c.shape();
      const std::size_t j = detail::split_broadcast_dim(s, std::span<const std::size_t>(shape_).last(child_t::rank), target);
      if (j < child_t::rank)
        detail::throw_split_broadcast(name, j, detail::describe_node(c), shape_[rank - child_t::rank + j], target.dim_axis[j]);
    };
    (check(detail::operand<I>(this->children_), rule.operands[I]), ...);
  }

  template <std::size_t I, class Ctx, std::size_t Rank>
  auto child_reader(Ctx& ctx, detail::group_frame<Rank>& frame) const {
    const auto& c = detail::operand<I>(this->children_);
    using child_t = std::remove_cvref_t<decltype(c)>;
    if constexpr (child_t::is_scalar) {
      return detail::scalar_reader<value_type>{static_cast<value_type>(c.value)};
    } else if constexpr (detail::fuses_child<elementwise_node, I>) {
      auto inner = ctx.template fused<I>();
      return c.reader(inner, frame);
    } else {
      return detail::read_block(ctx.template operand<I>(), frame, name);
    }
  }

  template <class Ctx, std::size_t Rank, std::size_t... I>
  auto reader_of(Ctx& ctx, detail::group_frame<Rank>& frame, std::index_sequence<I...>) const {
    return detail::op_reader<Op, decltype(child_reader<I>(ctx, frame))...>{child_reader<I>(ctx, frame)...};
  }

  shape_t<rank> shape_{};
};

}  // namespace pdo
