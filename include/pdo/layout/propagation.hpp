// pdo/layout/propagation.hpp: sharding propagation: each op's output layout and the layouts it needs of its operands.
#pragma once

#include <pdo/layout/layout_value.hpp>

#include <array>
#include <cstddef>
#include <string_view>

namespace pdo::detail {

/// @brief What the planner derives for one op from its operands' layouts: the layout each
/// operand must have before the op's local kernel runs (a redistribution where it differs
/// from the operand's own), the output layout, and the mesh axes whose results are
/// combined by a max after the kernel (max over a split dim).
struct op_rule {
  std::size_t arity = 0;
  std::array<layout_value, 3> operands{};
  layout_value out{};
  std::size_t npost_max = 0;
  std::array<std::string_view, max_rank> post_max{};
};

/// @brief How an op treats partial operands (mirrors pdo::op::linearity).
enum class partial_rule { none, additive, scaling, numerator };

constexpr layout_value without_partial(layout_value v) {
  while (v.npartial > 0) v.remove_partial(v.partial[0]);
  return v;
}

constexpr bool same_partials(layout_value a, layout_value b) {
  if (a.npartial != b.npartial) return false;
  for (std::size_t i = 0; i < a.npartial; ++i)
    if (!b.is_partial(a.partial[i])) return false;
  return true;
}

constexpr bool uses_axis(layout_value v, std::string_view axis) {
  return !axis.empty() && (v.split_dim(axis) < v.rank || v.is_partial(axis));
}

/// @brief Elementwise ops (with NumPy broadcasting: operands are aligned on their last
/// dims). Rules, in order:
/// 1. Partial operands stay partial only where the op is linear in them (`rule`): + and -
///    of operands partial over the same axes; * with exactly one partial operand; / with
///    a partial numerator. Otherwise every partial operand is reduced first.
/// 2. A dim is split in the output if some operand splits it; the first operand wins
///    where two split it on different axes, and an axis already used by the output is
///    not used again. An operand split differently from the output is redistributed to
///    the output's split (all_to_all, or all_gather where the output replicates the dim).
/// 3. An operand replicated on a dim the output splits is read at the place's offset:
///    a local slice, no data moves and no copy is made.
/// `scalar[i]` marks operands that are plain numbers (rank 0, no layout).
template <std::size_t N>
constexpr op_rule elementwise_rule(partial_rule rule, const std::array<layout_value, N>& in,
                                   const std::array<bool, N>& scalar, std::size_t out_rank) {
  op_rule r;
  r.arity = N;
  // 1. partial axes
  std::size_t npartial_operands = 0, nscalars = 0;
  for (std::size_t i = 0; i < N; ++i) {
    npartial_operands += in[i].npartial > 0;
    nscalars += scalar[i];
  }
  bool keep = false;
  std::size_t source = 0;
  if (npartial_operands > 0) {
    if (rule == partial_rule::additive) {
      keep = nscalars == 0;
      for (std::size_t i = 1; i < N; ++i) keep = keep && same_partials(in[0], in[i]);
    } else if (rule == partial_rule::scaling) {
      keep = npartial_operands == 1;
      for (std::size_t i = 0; i < N; ++i)
        if (in[i].npartial > 0) source = i;
    } else if (rule == partial_rule::numerator) {
      keep = in[0].npartial > 0 && (N < 2 || in[1].npartial == 0);
    }
  }
  r.out.rank = out_rank;
  if (keep)
    for (std::size_t k = 0; k < in[source].npartial; ++k) r.out.add_partial(in[source].partial[k]);
  // 2. split dims
  for (std::size_t i = 0; i < N; ++i) {
    if (scalar[i]) continue;
    const std::size_t shift = out_rank - in[i].rank;
    for (std::size_t j = 0; j < in[i].rank; ++j) {
      const std::string_view a = in[i].dim_axis[j];
      if (a.empty() || !r.out.dim_axis[shift + j].empty() || uses_axis(r.out, a)) continue;
      r.out.dim_axis[shift + j] = a;
    }
  }
  // operand targets: keep what matches, move what differs, never slice (rule 3)
  for (std::size_t i = 0; i < N; ++i) {
    layout_value t = in[i];
    if (!scalar[i]) {
      const std::size_t shift = out_rank - in[i].rank;
      const bool keeps_partial = keep && same_partials(in[i], r.out);
      if (!keeps_partial) t = without_partial(t);
      for (std::size_t j = 0; j < t.rank; ++j)
        if (!t.dim_axis[j].empty() && t.dim_axis[j] != r.out.dim_axis[shift + j]) t.dim_axis[j] = r.out.dim_axis[shift + j];
    }
    r.operands[i] = t;
  }
  return r;
}

/// @brief matmul of a [..., M, K] and b [..., K, N] (b of rank 2, or of a's rank with the
/// same batch dims). Rules, in order:
/// 1. Both partial: b is reduced first; a partial operand otherwise stays partial (matmul
///    is linear in each operand).
/// 2. K split on an axis in a (or else in b) that neither operand uses for another dim:
///    the output is partial over it (row parallel). The other operand's K is brought to
///    that axis if it is split otherwise, and read at the place's offset if replicated.
///    A K split that cannot be kept is gathered.
/// 3. M keeps a's split (data parallel); N keeps b's split (column parallel) unless its
///    axis is taken, in which case b's N is gathered; batch dims keep a's splits, and b's
///    batch dims follow a's.
constexpr op_rule matmul_rule(layout_value a, layout_value b) {
  op_rule r;
  r.arity = 2;
  layout_value ta = a, tb = b;
  if (a.npartial > 0 && b.npartial > 0) tb = without_partial(tb);
  const std::size_t ra = a.rank, rb = b.rank;
  const std::size_t am = ra - 2, ak = ra - 1, bk = rb - 2, bn = rb - 1;
  // the K axis
  auto free_in_a = [&](std::string_view x) {
    for (std::size_t d = 0; d + 1 < ra; ++d)
      if (ta.dim_axis[d] == x) return false;
    return !ta.is_partial(x) && !tb.is_partial(x);
  };
  auto free_in_b = [&](std::string_view x) {
    for (std::size_t d = 0; d < rb; ++d)
      if (d != bk && tb.dim_axis[d] == x) return false;
    return !ta.is_partial(x) && !tb.is_partial(x);
  };
  std::string_view k;
  if (!a.dim_axis[ak].empty() && free_in_b(a.dim_axis[ak])) k = a.dim_axis[ak];
  else if (!b.dim_axis[bk].empty() && free_in_a(b.dim_axis[bk])) k = b.dim_axis[bk];
  if (ta.dim_axis[ak] != k) ta.dim_axis[ak] = ta.dim_axis[ak].empty() ? std::string_view{} : k;
  if (tb.dim_axis[bk] != k) tb.dim_axis[bk] = tb.dim_axis[bk].empty() ? std::string_view{} : k;
  // an operand split on K along another axis than k was moved to k: if k is empty it is gathered
  // batch dims of b follow a's
  if (rb == ra)
    for (std::size_t d = 0; d < am; ++d)
      if (!tb.dim_axis[d].empty() && tb.dim_axis[d] != ta.dim_axis[d]) tb.dim_axis[d] = ta.dim_axis[d];
  // b's partial axes cannot be axes a splits a dim on: then b is reduced first
  for (std::size_t i = 0; i < tb.npartial; ++i)
    if (ta.split_dim(tb.partial[i]) < ta.rank) {
      tb = without_partial(tb);
      break;
    }
  // output
  r.out.rank = ra;
  for (std::size_t d = 0; d <= am; ++d) r.out.dim_axis[d] = ta.dim_axis[d];
  for (std::size_t i = 0; i < ta.npartial; ++i) r.out.add_partial(ta.partial[i]);
  for (std::size_t i = 0; i < tb.npartial; ++i) r.out.add_partial(tb.partial[i]);
  if (!k.empty()) r.out.add_partial(k);
  const std::string_view n = tb.dim_axis[bn];
  if (!n.empty() && !uses_axis(r.out, n)) r.out.dim_axis[ra - 1] = n;
  else tb.dim_axis[bn] = {};
  r.operands[0] = ta;
  r.operands[1] = tb;
  return r;
}

/// @brief sum or mean over dim `dim` (mean is linear too): the dim leaves the layout; a
/// split on it becomes a partial sum over its axis; partial operands stay partial.
/// max (`is_max`): partial operands are reduced first, and a split dim is combined by an
/// all_reduce(max) over its axis after the local kernel.
constexpr op_rule reduce_rule(layout_value in, std::size_t dim, bool is_max) {
  op_rule r;
  r.arity = 1;
  layout_value t = is_max ? without_partial(in) : in;
  r.operands[0] = t;
  r.out.rank = in.rank - 1;
  for (std::size_t d = 0, o = 0; d < in.rank; ++d)
    if (d != dim) r.out.dim_axis[o++] = t.dim_axis[d];
  for (std::size_t i = 0; i < t.npartial; ++i) r.out.add_partial(t.partial[i]);
  const std::string_view a = t.dim_axis[dim];
  if (!a.empty()) {
    if (is_max) r.post_max[r.npost_max++] = a;
    else r.out.add_partial(a);
  }
  return r;
}

/// @brief sum, mean or max over every dim: a rank-0 result, partial over every split
/// axis (sum, mean) or combined by all_reduce(max) over them (max).
constexpr op_rule reduce_all_rule(layout_value in, bool is_max) {
  op_rule r;
  r.arity = 1;
  layout_value t = is_max ? without_partial(in) : in;
  r.operands[0] = t;
  r.out.rank = 0;
  for (std::size_t i = 0; i < t.npartial; ++i) r.out.add_partial(t.partial[i]);
  for (std::size_t d = 0; d < t.rank; ++d) {
    const std::string_view a = t.dim_axis[d];
    if (a.empty()) continue;
    if (is_max) r.post_max[r.npost_max++] = a;
    else r.out.add_partial(a);
  }
  return r;
}

/// @brief Ops that need a whole dim on one place (softmax, log_softmax along `dim`):
/// partial operands are reduced and the dim is gathered; the other dims keep their split.
constexpr op_rule along_dim_rule(layout_value in, std::size_t dim) {
  op_rule r;
  r.arity = 1;
  layout_value t = without_partial(in);
  t.dim_axis[dim] = {};
  r.operands[0] = t;
  r.out = t;
  return r;
}

/// @brief cross_entropy(logits [N, C], labels [N]), the mean over N of -log softmax at
/// the label: logits are reduced and their classes gathered; labels follow the logits'
/// split of N (read at the offset where replicated); a split N makes the mean partial.
constexpr op_rule cross_entropy_rule(layout_value logits, layout_value labels) {
  op_rule r;
  r.arity = 2;
  layout_value tl = without_partial(logits);
  tl.dim_axis[1] = {};
  layout_value tb = without_partial(labels);
  if (!tb.dim_axis[0].empty() && tb.dim_axis[0] != tl.dim_axis[0]) tb.dim_axis[0] = tl.dim_axis[0];
  r.operands[0] = tl;
  r.operands[1] = tb;
  r.out.rank = 0;
  if (!tl.dim_axis[0].empty()) r.out.add_partial(tl.dim_axis[0]);
  return r;
}

/// @brief transpose of the last two dims: their splits swap; partial stays partial.
constexpr op_rule transpose_rule(layout_value in) {
  op_rule r;
  r.arity = 1;
  r.operands[0] = in;
  r.out = in;
  const std::size_t n = in.rank;
  r.out.dim_axis[n - 2] = in.dim_axis[n - 1];
  r.out.dim_axis[n - 1] = in.dim_axis[n - 2];
  return r;
}

/// @brief The number of leading dims a reshape keeps: through the last split dim.
constexpr std::size_t kept_dims(layout_value in) {
  std::size_t kept = 0;
  for (std::size_t d = 0; d < in.rank; ++d)
    if (!in.dim_axis[d].empty()) kept = d + 1;
  return kept;
}

/// @brief reshape to rank `out_rank`: the leading dims through the last split dim are
/// kept as they are (checked at run time), the others reshaped; partial stays partial.
constexpr op_rule reshape_rule(layout_value in, std::size_t out_rank) {
  op_rule r;
  r.arity = 1;
  r.operands[0] = in;
  r.out = in;
  r.out.rank = out_rank;
  for (std::size_t d = kept_dims(in); d < max_rank; ++d) r.out.dim_axis[d] = {};
  return r;
}

/// @brief A unit dim inserted at `dim`: the dims before it keep their split, the new one is
/// replicated, the ones after it keep theirs one place further; partial stays partial.
constexpr op_rule unsqueeze_rule(layout_value in, std::size_t dim) {
  op_rule r;
  r.arity = 1;
  r.operands[0] = in;
  r.out = in;
  r.out.rank = in.rank + 1;
  for (std::size_t d = in.rank; d > dim; --d) r.out.dim_axis[d] = in.dim_axis[d - 1];
  r.out.dim_axis[dim] = {};
  return r;
}

}  // namespace pdo::detail
