// pdo/expr/matmul.hpp: matmul of [..., M, K] by [..., K, N] (2-D, or batched), on BLAS.
#pragma once

#include <pdo/expr/expression.hpp>
#include <pdo/expr/transpose.hpp>
#include <pdo/kernels/gemm.hpp>

#include <cstddef>
#include <string>
#include <tuple>

namespace pdo {

namespace detail {
/// @brief Whether C is the transpose of a stored matrix (a leaf): gemm then reads the
/// leaf transposed, with no copy.
template <class C>
inline constexpr bool is_transposed_leaf_v = false;
template <class C>
inline constexpr bool is_transposed_leaf_v<transpose_node<C>> = C::is_leaf && C::rank == 2;
}  // namespace detail

/// @brief matmul(a, b): a [..., M, K] by b [K, N] (one matrix for the whole batch) or by
/// b [..., K, N] with a's batch dims. See detail::matmul_rule for the layouts.
template <class A, class B>
class matmul_node : public detail::op_node<A, B> {

 public:
  /// @brief Element type of both operands and of the result (b's: when a's differs, the
  /// error below is given, and what follows a layer's product, its weight's type, is kept).
  using value_type = typename B::value_type;
  static_assert(std::is_same_v<value_type, typename A::value_type>,
                "pdo: matmul: the operands have different element types; convert one first, pdo::cast<U>(x)");
  static_assert(A::rank >= 2 && B::rank >= 2, "pdo: matmul: both operands need at least 2 dims ([M, K] and [K, N])");
  static_assert(A::rank < 2 || B::rank < 2 || B::rank == 2 || B::rank == A::rank,
                "pdo: matmul: b must be a matrix [K, N] or have a's batch dims [..., K, N]");
  /// @brief Whether the operands' ranks make a product (the checks above): when they do not,
  /// nothing of the product is instantiated after the error, and eval stops there.
  static constexpr bool ranks_fit = A::rank >= 2 && (B::rank == 2 || B::rank == A::rank);
  /// @brief Whether this product and every op below it is well formed (see detail::op_node).
  static constexpr bool well_formed =
      detail::op_node<A, B>::well_formed && ranks_fit && std::is_same_v<value_type, typename A::value_type>;
  /// @brief a's rank: the result is [..., M, N].
  static constexpr std::size_t rank = A::rank;
  /// @brief false: a matmul is never fused into an elementwise group.
  static constexpr bool elementwise = false;
  /// @brief "matmul": how plans and error messages name this op.
  static constexpr std::string_view name = "matmul";
  /// @brief The planner's rule (detail::matmul_rule): which of M, K, N and the batch dims stay split.
  static constexpr detail::op_rule rule = ranks_fit ? detail::matmul_rule(A::rule.out, B::rule.out) : detail::op_rule{};
  /// @brief A 2-D product reads operand I in place when it is the transpose of a stored
  /// matrix: gemm takes it as a transposed operand, with no copy (fused, in its plan). On a
  /// mesh, only where the transposed shard is the block the product needs (no redistribution
  /// between them: detail::fuses_child).
  template <std::size_t I>
  static constexpr bool reads_in_place = rank == 2 && detail::is_transposed_leaf_v<std::tuple_element_t<I, std::tuple<A, B>>>;

  /// @brief pdo::shape_error unless a's last dim equals b's second-to-last and the batch dims agree.
  matmul_node(A a, B b) : detail::op_node<A, B>(std::move(a), std::move(b)) {
    if constexpr (ranks_fit) set_shape();
  }

  /// @brief [..., M, N]: a's dims with the last one replaced by b's last.
  [[nodiscard]] const shape_t<rank>& shape() const { return shape_; }

  /// @brief Writes this place's block of the product into `out` with gemm, batch by batch (on a GPU, one
  /// strided batched cuBLAS call when the operand blocks hold exactly the output's batches).
  template <class Ctx>
  void kernel(Ctx& ctx, tensor<value_type, rank>& out) const {
    if constexpr (detail::fuses_child<matmul_node, 0> || detail::fuses_child<matmul_node, 1>) {
      run_matrices(ctx, out);
    } else {
      run_blocks(ctx, out);
    }
  }

 private:
  void set_shape() {
    const auto sa = detail::operand<0>(this->children_).shape();
    const auto sb = detail::operand<1>(this->children_).shape();
    bool ok = sa[rank - 1] == sb[B::rank - 2];
    if constexpr (B::rank == rank)
      for (std::size_t d = 0; d + 2 < rank; ++d) ok = ok && sa[d] == sb[d];
    if (!ok)
      throw shape_error("matmul: " + detail::describe_node(detail::operand<0>(this->children_)) + " by " +
                        detail::describe_node(detail::operand<1>(this->children_)) +
                        ": a's last dim must equal b's second-to-last, and batch dims must agree");
    for (std::size_t d = 0; d + 1 < rank; ++d) shape_[d] = sa[d];
    shape_[rank - 1] = sb[B::rank - 1];
  }

  /// @brief Operand I of a 2-D product on this place: where its block starts in the
  /// operand's global shape, its extents, and how gemm reads it.
  struct matrix_block {
    detail::matrix_ref<value_type> ref;
    std::size_t rows = 0, cols = 0, row0 = 0, col0 = 0;
    /// @brief The block from its element (r, c) on.
    [[nodiscard]] detail::matrix_ref<value_type> from(std::size_t r, std::size_t c) const {
      return {ref.data + (ref.trans ? c * ref.ld + r : r * ref.ld + c), ref.ld, ref.trans};
    }
  };

  /// @brief The K range both operand blocks hold: its length, and where it starts in a's
  /// block and in b's (the smaller block, read from the larger at its offset); each block
  /// given by its extent along K and its offset along K in the operand's global shape.
  struct k_range {
    std::size_t k, a0, b0;
  };
  static constexpr k_range common_k(std::size_t ka, std::size_t a_offset, std::size_t kb, std::size_t b_offset) {
    const std::size_t k = ka < kb ? ka : kb;
    return {k, ka > k ? b_offset - a_offset : 0, kb > k ? a_offset - b_offset : 0};
  }

  /// @brief Operand I as gemm reads it: a transposed leaf in place (its stored shard, read
  /// transposed), any other operand as its block.
  template <std::size_t I, class Ctx>
  matrix_block matrix_of(Ctx& ctx) const {
    if constexpr (detail::fuses_child<matmul_node, I>) {
      const auto inner = ctx.template fused<I>();  // the transpose, run inside this kernel
      const auto& leaf = detail::operand<0>(detail::operand<I>(this->children_).children());
      const auto& stored = inner.shard(leaf);
      const auto at = inner.local_offset(std::remove_cvref_t<decltype(leaf)>::rule.out, leaf.shape());
      return {{stored.data(), stored.shape()[1], true}, stored.shape()[1], stored.shape()[0], at[1], at[0]};
    } else {
      const auto block = ctx.template operand<I>();
      return {{block.data, block.shape[1], false}, block.shape[0], block.shape[1], block.offset[0], block.offset[1]};
    }
  }

  /// @brief A 2-D product with an operand read in place, by one gemm over the K range both
  /// blocks hold.
  template <class Ctx>
  void run_matrices(Ctx& ctx, tensor<value_type, rank>& out) const {
    const matrix_block a = matrix_of<0>(ctx), b = matrix_of<1>(ctx);
    const auto [k, a_k0, b_k0] = common_k(a.cols, a.col0, b.rows, b.row0);
    const auto frame = ctx.local_offset(rule.out, shape_);
    detail::gemm<value_type>(ctx.system, out.shape()[0], out.shape()[1], k, a.from(frame[0] - a.row0, a_k0),
                             b.from(b_k0, frame[1] - b.col0), out.data());
  }

  template <class Ctx>
  void run_blocks(Ctx& ctx, tensor<value_type, rank>& out) const {
    const auto a = ctx.template operand<0>();
    const auto b = ctx.template operand<1>();
    constexpr std::size_t rb = B::rank;
    const auto [k, a_k0, b_k0] = common_k(a.shape[rank - 1], a.offset[rank - 1], b.shape[rb - 2], b.offset[rb - 2]);
    const std::size_t m = out.shape()[rank - 2], n = out.shape()[rank - 1];
    const std::size_t lda = a.shape[rank - 1], ldb = b.shape[rb - 1];
    std::size_t batches = 1;
    for (std::size_t d = 0; d + 2 < rank; ++d) batches *= out.shape()[d];
    // offsets of the output block's rows and columns within the operand blocks
    const auto frame = ctx.local_offset(rule.out, shape_);
    const std::size_t a_m0 = frame[rank - 2] - a.offset[rank - 2];
    const std::size_t b_n0 = frame[rank - 1] - b.offset[rb - 1];
    // when the operand blocks hold exactly the output's batches: one strided batched call
    // where the place's backend has one (cuBLAS)
    if (batches > 1) {
      bool regular = true;
      for (std::size_t d = 0; d + 2 < rank; ++d) {
        regular = regular && frame[d] == a.offset[d] && a.shape[d] == out.shape()[d];
        if constexpr (rb == rank) regular = regular && frame[d] == b.offset[d] && b.shape[d] == out.shape()[d];
      }
      const std::size_t stride_b = rb == rank ? b.shape[rb - 2] * ldb : 0;
      if (regular && detail::gemm_strided_batched<value_type>(ctx.system, batches, m, n, k, {a.data + a_m0 * lda + a_k0, lda},
                                                               a.shape[rank - 2] * lda, {b.data + b_k0 * ldb + b_n0, ldb}, stride_b,
                                                               out.data()))
        return;
    }
    shape_t<rank> index{};
    for (std::size_t batch = 0; batch < batches; ++batch) {
      std::size_t a_off = 0, b_off = 0;
      for (std::size_t d = 0; d + 2 < rank; ++d) {
        a_off = a_off * a.shape[d] + (frame[d] - a.offset[d] + index[d]);
        if constexpr (rb == rank) b_off = b_off * b.shape[d] + (frame[d] - b.offset[d] + index[d]);
      }
      const value_type* pa = a.data + (a_off * a.shape[rank - 2] + a_m0) * lda + a_k0;
      const value_type* pb = b.data + (b_off * b.shape[rb - 2] + b_k0) * ldb + b_n0;
      detail::gemm<value_type>(ctx.system, m, n, k, {pa, lda}, {pb, ldb}, out.data() + batch * m * n);
      for (std::size_t d = rank - 2; d-- > 0;) {
        if (++index[d] < out.shape()[d]) break;
        index[d] = 0;
      }
    }
  }

  shape_t<rank> shape_{};
};

}  // namespace pdo
