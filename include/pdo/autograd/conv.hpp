// pdo/autograd/conv.hpp: conv2d (im2col + gemm) and 2-D pooling on pdo::var, with their backward.
#pragma once

#include <pdo/autograd/variable.hpp>
#include <pdo/core/views.hpp>
#include <pdo/exec/mesh_ops.hpp>
#include <pdo/kernels/conv.hpp>
#include <pdo/kernels/gemm.hpp>
#include <pdo/layout/layout_type.hpp>
#include <pdo/plan/plan.hpp>
#include <pdo/tensor/halo.hpp>

#include <array>
#include <cstddef>
#include <memory>
#include <string_view>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

/// @brief Stride and zero padding of conv2d and the pools.
struct window_options {
  std::size_t stride = 1;   ///< step between windows, in pixels, along H and W; 0 in a pool means the kernel size
  std::size_t padding = 0;  ///< zero cells added on each side of H and W
};

namespace detail {

/// @brief The windows of conv2d or a pool over x; a pdo::shape_error naming `op`, the shapes
/// and `layouts` (" (layouts ...)" for dtensors, else empty) when they do not fit.
inline window_geometry window_of(const char* op, const shape_t<4>& x, std::size_t kernel, window_options o, const std::string& layouts = "") {
  window_geometry g{x[0], x[1], x[2], x[3], kernel, o.stride, o.padding, o.padding};
  if (!make_window_geometry(g))
    throw shape_error(std::string(op) + ": input " + format_extents(x) + layouts + " with kernel " + std::to_string(kernel) + ", stride " +
                      std::to_string(o.stride) + ", padding " + std::to_string(o.padding) +
                      ": the window must fit the padded image, and kernel and stride must be positive");
  // the im2col matrix [rows, cols] conv2d makes, and the output, must be addressable
  checked_volume(shape_t<4>{g.rows(), x[1], kernel, kernel}, op, 8);
  checked_volume(shape_t<4>{g.batch, g.channels, g.out_height, g.out_width}, op, 8);
  return g;
}

/// @brief The windows of a pool: stride 0 means the kernel size; the padding at most half the
/// kernel (as PyTorch's pools), so that every window holds a cell of the input.
inline window_geometry pool_window_of(const char* op, const shape_t<4>& x, std::size_t kernel, window_options& o,
                                      const std::string& layouts = "") {
  if (o.stride == 0) o.stride = kernel;
  if (2 * o.padding > kernel)
    throw shape_error(std::string(op) + ": padding " + std::to_string(o.padding) + " with kernel " + std::to_string(kernel) + " on input " +
                      format_extents(x) + layouts +
                      ": the padding must be at most half the kernel size (a window would hold only padding)");
  return window_of(op, x, kernel, o, layouts);
}

}  // namespace detail

namespace detail {

/// @brief The local conv2d's output from its im2col matrix: y = cols * w^T + bias (bias may be null).
template <class T>
tensor<T, 4> conv2d_from_cols(const tensor<T, 2>& cols, const tensor<T, 4>& w, const T* bias, const window_geometry& g) {
  const std::size_t oc = w.extent(0);
  auto system = kernel_system("conv2d", {cols.where(), w.where()});
  const thrust::counting_iterator<std::size_t> zero(0);
  tensor<T, 2> rows({g.rows(), oc}, uninitialized);
  gemm<T>(system, g.rows(), oc, g.cols(), {cols.data(), g.cols(), false}, {w.data(), g.cols(), true}, rows.data());
  tensor<T, 4> y({g.batch, oc, g.out_height, g.out_width}, uninitialized);
  thrust::transform(system, zero, zero + y.size(), y.data(), rows_to_images<T>{rows.data(), bias, oc, g.out_pixels()});
  return y;
}

/// @brief The im2col rows of the output pixels of `region` (geometry g over a block) into
/// `cols`, read from `src`, which holds the block's rows from `row0` and columns from `col0`.
template <class T>
void im2col_region(tensor<T, 2>& cols, const tensor<T, 4>& src, std::ptrdiff_t row0, std::ptrdiff_t col0, const window_geometry& g,
                   const pixel_region& region) {
  if (region.pixels() == 0 || g.batch == 0) return;
  auto system = kernel_system("conv2d", {src.where(), cols.where()});
  thrust::for_each_n(system, thrust::counting_iterator<std::size_t>(0), g.batch * region.pixels() * g.cols(),
                     im2col_region_element<T>{src.data(), cols.data(), g, region, row0, col0, src.extent(2), src.extent(3)});
}

/// @brief The local conv2d: y = conv(x, w) + bias (bias may be null), and the im2col
/// matrix the backward needs. Tensors go to the calling thread's place.
template <class T>
std::pair<tensor<T, 4>, std::shared_ptr<tensor<T, 2>>> conv2d_forward(const tensor<T, 4>& x, const tensor<T, 4>& w, const T* bias,
                                                                       const window_geometry& g) {
  auto system = kernel_system("conv2d", {x.where(), w.where()});
  const thrust::counting_iterator<std::size_t> zero(0);
  auto cols = std::make_shared<tensor<T, 2>>(shape_t<2>{g.rows(), g.cols()}, uninitialized);
  thrust::transform(system, zero, zero + cols->size(), cols->data(), im2col_element<T>{x.data(), g});
  return {conv2d_from_cols(*cols, w, bias, g), std::move(cols)};
}

/// @brief The local conv2d's output gradient dy as the rows of its gemm: [rows, out_channels].
template <class T>
tensor<T, 2> conv2d_grad_rows(const tensor<T, 4>& dy, const window_geometry& g) {
  const std::size_t oc = dy.extent(1);
  auto sys = kernel_system("conv2d backward", {dy.where()});
  const thrust::counting_iterator<std::size_t> first(0);
  tensor<T, 2> g2({g.rows(), oc}, uninitialized);
  thrust::transform(sys, first, first + g2.size(), g2.data(), images_to_rows<T>{dy.data(), oc, g.out_pixels()});
  return g2;
}

/// @brief The local conv2d's input gradient from dy as rows (conv2d_grad_rows): col2im(g2 * w).
template <class T>
tensor<T, 4> conv2d_input_grad(const tensor<T, 2>& g2, const tensor<T, 4>& w, const window_geometry& g) {
  const std::size_t oc = w.extent(0);
  auto sys = kernel_system("conv2d backward", {g2.where(), w.where()});
  const thrust::counting_iterator<std::size_t> first(0);
  tensor<T, 2> dcols({g.rows(), g.cols()}, uninitialized);
  gemm<T>(sys, g.rows(), g.cols(), oc, {g2.data(), oc, false}, {w.data(), g.cols(), false}, dcols.data());
  tensor<T, 4> dx(shape_t<4>{g.batch, g.channels, g.height, g.width}, uninitialized);
  thrust::transform(sys, first, first + dx.size(), dx.data(), col2im_element<T>{dcols.data(), g});
  return dx;
}

/// @brief The local conv2d's weight and bias gradients from dy as rows, each computed when asked for (non-null).
template <class T>
void conv2d_weight_grads(const tensor<T, 2>& g2, const tensor<T, 2>& cols, const shape_t<4>& w_shape, const window_geometry& g,
                         tensor<T, 4>* dw, tensor<T, 1>* db) {
  const std::size_t oc = w_shape[0];
  auto sys = kernel_system("conv2d backward", {g2.where(), cols.where()});
  if (dw != nullptr) {
    *dw = tensor<T, 4>(w_shape, uninitialized);
    gemm<T>(sys, oc, g.cols(), g.rows(), {g2.data(), oc, true}, {cols.data(), g.cols(), false}, dw->data());
  }
  if (db != nullptr) {
    *db = tensor<T, 1>(shape_t<1>{oc}, uninitialized);
    const thrust::counting_iterator<std::size_t> first(0);
    thrust::transform(sys, first, first + oc, db->data(), column_sum<T>{g2.data(), g.rows(), oc});
  }
}

/// @brief The local conv2d backward from dy: dw, db and dx, each computed when asked for (non-null).
template <class T>
void conv2d_backward(const tensor<T, 4>& dy, const tensor<T, 2>& cols, const tensor<T, 4>& w, const window_geometry& g,
                     tensor<T, 4>* dw, tensor<T, 1>* db, tensor<T, 4>* dx) {
  const tensor<T, 2> g2 = conv2d_grad_rows(dy, g);
  conv2d_weight_grads(g2, cols, w.shape(), g, dw, db);
  if (dx != nullptr) *dx = conv2d_input_grad(g2, w, g);
}

inline void check_conv_shapes(const shape_t<4>& sx, const shape_t<4>& sw, const shape_t<1>& sb, const std::string& layouts) {
  if (sw[1] != sx[1] || sw[2] != sw[3] || sb[0] != sw[0])
    throw shape_error("conv2d: input " + format_extents(sx) + ", weight " + format_extents(sw) + ", bias " + format_extents(sb) + layouts +
                      ": the weight must be [out_channels, in_channels, k, k] with the input's channels, and the bias [out_channels]");
}

}  // namespace detail

/// @brief 2-D convolution: x [N, C, H, W], weight [OC, C, K, K], bias [OC] -> [N, OC, OH, OW],
/// as im2col then one gemm; the backward is two gemms and col2im.
/// A local conv2d communicates nothing: pdo::strict (conv2d<pdo::strict>) accepts it.
template <class Policy = implicit, class T>
var<tensor<T, 4>> conv2d(const var<tensor<T, 4>>& x, const var<tensor<T, 4>>& weight, const var<tensor<T, 1>>& bias,
                         window_options o = {}) {
  static_assert(std::is_same_v<Policy, implicit> || std::is_same_v<Policy, strict>, "pdo: conv2d: the policy must be pdo::implicit or pdo::strict");
  detail::check_conv_shapes(x.shape(), weight.shape(), bias.shape(), "");
  const detail::window_geometry g = detail::window_of("conv2d", x.shape(), weight.shape()[2], o);
  auto forward = detail::conv2d_forward(x.value(), weight.value(), bias.value().data(), g);
  auto cols = std::move(forward.second);  // a plain variable: lambdas may not capture structured bindings in clang 14
  return detail::record(
      std::move(forward.first),
      [x, weight, bias, cols, g](auto& self) {
        tensor<T, 4> dw, dx;
        tensor<T, 1> db;
        detail::conv2d_backward(*self.grad, *cols, weight.value(), g, weight.requires_grad() ? &dw : nullptr,
                                bias.requires_grad() ? &db : nullptr, x.requires_grad() ? &dx : nullptr);
        if (weight.requires_grad()) detail::add_grad(weight, std::move(dw));
        if (bias.requires_grad()) detail::add_grad(bias, std::move(db));
        if (x.requires_grad()) detail::add_grad(x, std::move(dx));
      },
      x, weight, bias);
}

namespace detail {

/// @brief The layouts of a distributed conv2d: batch split -> data parallel;
/// output channels split (weight dim 0, bias) -> channel parallel, output split by
/// channels; input channels split (input dim 1 and weight dim 1 on one axis) -> a partial
/// output; height or width split (input dims 2, 3) -> spatial: the output's rows split on
/// the same axes, each place reading its neighbours' rows its windows need (halo
/// exchange), weight and bias gradients partial over those axes. Also the layouts of the
/// places' local gradient contributions.
struct conv_layouts {
  bool ok = true;
  const char* problem = "";
  layout_value y, dw, db, dx;
};

constexpr conv_layouts conv_rule(layout_value x, layout_value w, layout_value b) {
  conv_layouts r;
  auto fail = [&](const char* why) {
    r.ok = false;
    r.problem = why;
    return r;
  };
  if (x.npartial != 0 || w.npartial != 0 || b.npartial != 0) return fail("operands must not be partial (reduce them first)");
  if (!w.dim_axis[2].empty() || !w.dim_axis[3].empty()) return fail("the kernel's dims (weight dims 2, 3) must not be split");
  if (x.dim_axis[1] != w.dim_axis[1]) return fail("the input's channels (dim 1) and the weight's dim 1 must be split alike");
  if (b.dim_axis[0] != w.dim_axis[0]) return fail("the bias must be split as the weight's output channels (dim 0)");
  if (!w.dim_axis[0].empty() && (w.dim_axis[0] == x.dim_axis[0] || w.dim_axis[0] == w.dim_axis[1]))
    return fail("one mesh axis cannot split two dims");
  if (!x.dim_axis[0].empty() && x.dim_axis[0] == x.dim_axis[1]) return fail("one mesh axis cannot split two dims");
  for (std::size_t d = 2; d < 4; ++d)
    if (!x.dim_axis[d].empty() && x.dim_axis[d] == w.dim_axis[0]) return fail("one mesh axis cannot split two dims");
  r.y.rank = 4;
  r.y.dim_axis[0] = x.dim_axis[0];
  r.y.dim_axis[1] = w.dim_axis[0];
  r.y.dim_axis[2] = x.dim_axis[2];
  r.y.dim_axis[3] = x.dim_axis[3];
  if (!w.dim_axis[1].empty()) r.y.add_partial(w.dim_axis[1]);
  r.dw = w;
  r.db = b;
  for (std::size_t d : {0, 2, 3})  // the places of these axes convolve other pixels with the same weights
    if (!x.dim_axis[d].empty()) {
      r.dw.add_partial(x.dim_axis[d]);
      r.db.add_partial(x.dim_axis[d]);
    }
  r.dx = x;
  if (!w.dim_axis[0].empty()) r.dx.add_partial(w.dim_axis[0]);
  return r;
}

template <class LX, class LW, class LB>
struct conv_rule_of {
  static constexpr conv_layouts value = conv_rule(value_of<LX>(), value_of<LW>(), value_of<LB>());
};
template <class LX, class LW, class LB, layout_value conv_layouts::*Which>
struct conv_layout_provider {
  static constexpr layout_value value = conv_rule_of<LX, LW, LB>::value.*Which;
};

}  // namespace detail

namespace detail {

/// @brief How a window op's input of layout `x` is cut along its height and width (dims 2
/// and 3) on a mesh: per dim, the halo_dim of the axis that splits it (1 part when none
/// does) and that axis's index.
struct spatial_cut {
  std::array<halo_dim, 2> dims;
  std::array<std::size_t, 2> axis{};
  std::array<bool, 2> split{};

  template <class Mesh>
  spatial_cut(const Mesh& m, const layout_value& x, const window_geometry& whole, std::size_t padding) {
    const std::array<std::size_t, 2> extent{whole.height, whole.width}, out{whole.out_height, whole.out_width};
    for (std::size_t i = 0; i < 2; ++i) {
      split[i] = !x.dim_axis[2 + i].empty();
      axis[i] = split[i] ? Mesh::axis_index(x.dim_axis[2 + i]) : 0;
      dims[i] = {extent[i], out[i], whole.kernel, whole.stride, padding, split[i] ? m.extent(axis[i]) : 1};
    }
  }
  [[nodiscard]] bool any() const { return split[0] || split[1]; }
  /// @brief Place p's position along dim i's axis (0 when the dim is whole).
  template <class Mesh>
  [[nodiscard]] std::size_t coord(const Mesh& m, std::size_t p, std::size_t i) const {
    return split[i] ? m.coord(p, axis[i]) : 0;
  }
  /// @brief Place p's shard widened by the rows and columns its windows read beyond it (a
  /// halo exchange along each split axis: every place of the mesh calls it at once).
  template <class T, class Mesh>
  [[nodiscard]] tensor<T, 4> gather(const Mesh& m, std::size_t p, tensor<T, 4> block) const {
    for (std::size_t i = 0; i < 2; ++i)
      if (split[i]) {
        count_planned(step_kind::all_to_all, coord(m, p, i) == 0);
        block = halo_gather(communicator_along(m, axis[i], p), dims[i], coord(m, p, i), 2 + i, block, m.place(p));
      }
    return block;
  }
  /// @brief The transpose of gather: the gradient of place p's block, back to its shard.
  template <class T, class Mesh>
  [[nodiscard]] tensor<T, 4> give_back(const Mesh& m, std::size_t p, tensor<T, 4> dblock) const {
    for (std::size_t i = 2; i-- > 0;)
      if (split[i]) {
        count_planned(step_kind::all_to_all, coord(m, p, i) == 0);
        dblock = halo_return(communicator_along(m, axis[i], p), dims[i], coord(m, p, i), 2 + i, dblock, m.place(p));
      }
    return dblock;
  }
  /// @brief The shape of the block place p's windows read: its shard's, widened along each
  /// split dim to the rows its output needs (what gather returns); with `dims_done` < 2, the
  /// block after the exchanges of the first `dims_done` spatial dims only.
  template <class Mesh>
  [[nodiscard]] shape_t<4> block_shape(const Mesh& m, std::size_t p, shape_t<4> shard, std::size_t dims_done = 2) const {
    for (std::size_t i = 0; i < dims_done; ++i)
      if (split[i]) shard[2 + i] = dims[i].need(coord(m, p, i)).size();
    return shard;
  }
  /// @brief Where place p's shard starts in its block along dim i (its block's first row
  /// may come after the shard's first: a place whose windows begin below its own first row).
  template <class Mesh>
  [[nodiscard]] std::ptrdiff_t shard_offset(const Mesh& m, std::size_t p, std::size_t i) const {
    if (!split[i]) return 0;
    const std::size_t c = coord(m, p, i);
    return static_cast<std::ptrdiff_t>(dims[i].own(c).begin) - static_cast<std::ptrdiff_t>(dims[i].need(c).begin);
  }
  /// @brief The output pixels of place p (of geometry g over its block) whose windows read
  /// none of its halo: computable from its shard before the halo exchange ends (empty when
  /// no row or no column is such).
  template <class Mesh>
  [[nodiscard]] pixel_region interior(const Mesh& m, std::size_t p, const window_geometry& g) const {
    const row_range rows = split[0] ? dims[0].interior(coord(m, p, 0)) : row_range{0, g.out_height};
    const row_range cols = split[1] ? dims[1].interior(coord(m, p, 1)) : row_range{0, g.out_width};
    if (rows.size() == 0 || cols.size() == 0) return {};
    return {rows.begin, rows.end, cols.begin, cols.end};
  }
  /// @brief The window geometry of place p over its block (its shard when nothing is split):
  /// the output rows and columns it owns, the padding of the image edges the block touches.
  template <class Mesh>
  [[nodiscard]] window_geometry local(const Mesh& m, std::size_t p, const shape_t<4>& block) const {
    const std::size_t ch = coord(m, p, 0), cw = coord(m, p, 1);
    // a whole dim's block is the whole image along it, padded as the image is (pad_before counts
    // from the rows a split dim's windows read, none when they all fall in the padding)
    const std::size_t pad_h = split[0] ? dims[0].pad_before(ch) : dims[0].padding;
    const std::size_t pad_w = split[1] ? dims[1].pad_before(cw) : dims[1].padding;
    return {block[0], block[1], block[2], block[3], dims[0].kernel, dims[0].stride, pad_h, pad_w, dims[0].out(ch).size(),
            dims[1].out(cw).size()};
  }
  /// @brief The window geometry of place p over the block its shard (of shape `shard`) widens to.
  template <class Mesh>
  [[nodiscard]] window_geometry block_geometry(const Mesh& m, std::size_t p, const shape_t<4>& shard) const {
    return local(m, p, block_shape(m, p, shard));
  }
};


/// @brief conv2d over an input split along its height or width, on every place of `m` in
/// this process: each place's halo exchange runs on its communication lane while its
/// compute lane gathers the im2col rows of its interior (the output pixels whose windows
/// read only its own rows and columns) from its shard; once the halo is in, the frame's
/// rows come from the widened block, then one gemm. `bias_of(p, k)`: the bias place p adds,
/// or null. Fills ys and cols (kept for the backward) per local place.
template <class T, class Mesh, class BiasOf>
void conv2d_spatial_forward(const Mesh& m, const spatial_cut& cut, const std::vector<tensor<T, 4>>& xs, const std::vector<tensor<T, 4>>& ws,
                            const BiasOf& bias_of, std::vector<tensor<T, 4>>& ys, std::vector<std::shared_ptr<tensor<T, 2>>>& cols) {
  const auto& local = m.local_places();
  std::vector<window_geometry> geometry(local.size());
  std::vector<pixel_region> inner(local.size());
  std::vector<tensor<T, 4>> blocks(local.size());
  for (auto&& [p, x, g, in] : views::zip(local, xs, geometry, inner)) {
    g = cut.block_geometry(m, p, x.shape());
    in = cut.interior(m, p, g);
  }
  batch_sequence ops("conv2d");
  ops.submit(
      m, lane_kind::compute, false,
      [&](std::size_t p, std::size_t k) {
        const window_geometry& g = geometry[k];
        cols[k] = std::make_shared<tensor<T, 2>>(shape_t<2>{g.rows(), g.cols()}, uninitialized);
        im2col_region(*cols[k], xs[k], cut.shard_offset(m, p, 0), cut.shard_offset(m, p, 1), g, inner[k]);
      },
      [&](std::size_t, std::size_t k) { return access{{xs[k].data()}, {&cols[k]}}; });
  ops.submit(
      m, lane_kind::communication, true, [&](std::size_t p, std::size_t k) { blocks[k] = cut.gather(m, p, xs[k]); },
      [&](std::size_t, std::size_t k) { return access{{xs[k].data()}, {&blocks[k]}}; });
  ops.submit(
      m, lane_kind::compute, false,
      [&](std::size_t p, std::size_t k) {
        const window_geometry& g = geometry[k];
        const pixel_region in = inner[k];
        // the frame around the interior: the rows above and below it, whole; beside it, left and right
        for (const pixel_region r : {pixel_region{0, in.row_begin, 0, g.out_width}, pixel_region{in.row_end, g.out_height, 0, g.out_width},
                                     pixel_region{in.row_begin, in.row_end, 0, in.col_begin},
                                     pixel_region{in.row_begin, in.row_end, in.col_end, g.out_width}})
          im2col_region(*cols[k], blocks[k], 0, 0, g, r);
        blocks[k] = {};
        ys[k] = conv2d_from_cols(*cols[k], ws[k], bias_of(p, k), g);
      },
      [&](std::size_t, std::size_t k) { return access{{&blocks[k], &cols[k], ws[k].data()}, {&blocks[k], &cols[k], &ys[k]}}; });
  ops.finish(m);
}

/// @brief conv2d's backward over an input split along its height or width, on every place of
/// `m` in this process: each place computes its block's input gradient first; its halo part
/// goes back to the neighbours on the communication lane while the compute lane computes
/// the weight and bias gradients (when asked for: dws, dbs non-null). Fills dxs.
template <class T, class Mesh>
void conv2d_spatial_backward(const Mesh& m, const spatial_cut& cut, const std::vector<tensor<T, 4>>& dys,
                             const std::vector<std::shared_ptr<tensor<T, 2>>>& cols, const std::vector<tensor<T, 4>>& ws,
                             const std::vector<tensor<T, 4>>& xs, std::vector<tensor<T, 4>>* dws, std::vector<tensor<T, 1>>* dbs,
                             std::vector<tensor<T, 4>>& dxs) {
  const auto& local = m.local_places();
  std::vector<window_geometry> geometry(local.size());
  std::vector<tensor<T, 2>> rows(local.size());
  std::vector<tensor<T, 4>> dblocks(local.size());
  for (auto&& [p, x, g] : views::zip(local, xs, geometry)) g = cut.block_geometry(m, p, x.shape());
  batch_sequence ops("conv2d backward");
  ops.submit(
      m, lane_kind::compute, false,
      [&](std::size_t, std::size_t k) {
        rows[k] = conv2d_grad_rows(dys[k], geometry[k]);
        dblocks[k] = conv2d_input_grad(rows[k], ws[k], geometry[k]);
      },
      [&](std::size_t, std::size_t k) { return access{{dys[k].data(), ws[k].data()}, {&rows[k], &dblocks[k]}}; });
  ops.submit(
      m, lane_kind::communication, true,
      [&](std::size_t p, std::size_t k) {
        dxs[k] = cut.give_back(m, p, std::move(dblocks[k]));
        dblocks[k] = {};
      },
      [&](std::size_t, std::size_t k) { return access{{&dblocks[k]}, {&dblocks[k], &dxs[k]}}; });
  if (dws != nullptr || dbs != nullptr)
    ops.submit(
        m, lane_kind::compute, false,
        [&](std::size_t, std::size_t k) {
          conv2d_weight_grads(rows[k], *cols[k], ws[k].shape(), geometry[k], dws != nullptr ? &(*dws)[k] : nullptr,
                              dbs != nullptr ? &(*dbs)[k] : nullptr);
        },
        [&](std::size_t, std::size_t k) {
          access a{{&rows[k], cols[k].get()}, {}};
          if (dws != nullptr) a.writes.push_back(&(*dws)[k]);
          if (dbs != nullptr) a.writes.push_back(&(*dbs)[k]);
          return a;
        });
  ops.finish(m);
}

}  // namespace detail

namespace detail {

/// @brief The plan of a window op `op` (conv2d, max_pool2d, avg_pool2d) with `arity`
/// operands, its input laid out as `x` and its output as `y`: a halo exchange along each
/// split spatial dim (the height's first), then the op's kernel. Nodes: the operands, then the op.
constexpr expression_plan window_plan(std::string_view op, std::size_t arity, const layout_value& x, const layout_value& y) {
  expression_plan plan;
  plan.nodes = arity + 1;
  for (std::size_t d = 2; d < 4; ++d)
    if (!x.dim_axis[d].empty()) {
      plan_step s{plan_step_kind::halo_exchange, op, arity, 0, 0};
      s.move = {step_kind::all_to_all, x.dim_axis[d], d, d, x, x};  // it travels as one all_to_all along the axis
      plan.push(s);
    }
  plan_step k{plan_step_kind::kernel, op, arity};
  k.layout = y;
  plan.push(k);
  return plan;
}

/// @brief The layout type of a window op's operand: a dtensor or a var of one.
template <class V>
struct window_operand {
  using type = typename V::layout_type;
};
template <class V>
struct window_operand<var<V>> {
  using type = typename V::layout_type;
};
template <class V>
using window_operand_t = typename window_operand<std::remove_cvref_t<V>>::type;

/// @brief Instantiated for conv2d operands of layouts it does not take: the failed
/// assertion's context names the layouts and why.
template <fixed_string Why, class LX, class LW, class LB>
struct conv2d_does_not_take_these_layouts {
  static_assert(always_false<LX, LW, LB>, "pdo: conv2d: these layouts of the input, weight and bias are not supported");
  static constexpr bool ok = false;
};
template <class LX, class LW, class LB>
constexpr bool check_conv_layouts() {
  constexpr conv_layouts r = conv_rule_of<LX, LW, LB>::value;
  if constexpr (r.ok) return true;
  else return conv2d_does_not_take_these_layouts<fixed_string<std::string_view(r.problem).size() + 1>(std::string_view(r.problem)), LX, LW, LB>::ok;
}

/// @brief Instantiated for a window op under pdo::strict whose input's height or width is
/// split: the halo exchange it needs is communication.
template <fixed_string Op, class LX>
struct strict_forbids_halo_exchange {
  static_assert(always_false<LX>,
                "pdo: strict: a window op over an input whose height or width is split exchanges halo rows with its "
                "neighbours, which takes communication; gather the spatial dims first (pdo::redistribute), or call it without pdo::strict");
  static constexpr bool ok = false;
};
/// @brief Whether a window op under `Policy` takes an input laid out as LX (no error given:
/// check_window_policy gives it).
template <class Policy, class LX>
constexpr bool window_policy_allows() {
  constexpr layout_value x = value_of<LX>();
  return std::is_same_v<Policy, implicit> || (std::is_same_v<Policy, strict> && x.dim_axis[2].empty() && x.dim_axis[3].empty());
}
/// @brief The layout a window op's policy check looks at: a dtensor's, or (a local
/// tensor) one that splits nothing.
template <class V>
struct window_layout {
  using type = layout<replicate, replicate, replicate, replicate>;
};
template <class T, class M, class L>
struct window_layout<dtensor<T, 4, M, L>> {
  using type = L;
};
template <class V>
using window_layout_t = typename window_layout<V>::type;
template <class Policy, fixed_string Op, class LX>
constexpr bool check_window_policy() {
  static_assert(std::is_same_v<Policy, implicit> || std::is_same_v<Policy, strict>,
                "pdo: conv2d/max_pool2d/avg_pool2d: the policy must be pdo::implicit or pdo::strict");
  if constexpr (!std::is_same_v<Policy, implicit> && !std::is_same_v<Policy, strict>) return false;
  else if constexpr (!window_policy_allows<Policy, LX>()) return strict_forbids_halo_exchange<Op, LX>::ok;
  else return true;
}

/// @brief explain's text for a window op run by `plan` on mesh m over an input of
/// `x_shape` laid out as `lx` cut as `cut`: its halo exchanges with the bytes each place
/// sends, its kernel, and its backward.
template <class Mesh>
std::string explain_window(std::string_view op, const expression_plan& plan, const Mesh& m, const shape_t<4>& x_shape,
                           const layout_value& lx, const shape_t<4>& y_shape, const spatial_cut& cut, std::size_t element,
                           const std::string& backward_extra) {
  const auto x_text = format_extents(x_shape) + " " + to_string(lx);
  std::string text = "plan of " + std::string(op) + " -> " + format_extents(y_shape) + " " + to_string(plan.result_layout()) + " on " +
                     m.describe() + ": " + std::to_string(plan.kernels()) + " kernel, " + std::to_string(plan.collectives()) +
                     (plan.collectives() == 1 ? " collective" : " collectives") + "\n";
  std::size_t line = 0;
  std::string halo_axes;
  for (const auto& s : plan) {
    text += "  " + std::to_string(++line) + ". ";
    if (s.kind == plan_step_kind::kernel) {
      text += "kernel " + std::string(op) + " -> " + format_extents(y_shape) + " " + to_string(s.layout) + "\n";
      continue;
    }
    const std::size_t i = s.move.dim - 2;
    const halo_dim& d = cut.dims[i];
    halo_axes = std::string(s.move.axis) + (halo_axes.empty() ? "" : ", ") + halo_axes;
    text += "halo_exchange over " + std::string(s.move.axis) + " for " + std::string(op) + " operand 0 (" + x_text + "): " +
            (i == 0 ? "height" : "width") + " (dim " + std::to_string(s.move.dim) + ") of " + std::to_string(d.extent) + " in " +
            std::to_string(d.parts) + " shards, windows of " + std::to_string(d.kernel) + ", stride " + std::to_string(d.stride) +
            ", padding " + std::to_string(d.padding) + "; " + (i == 0 ? "rows" : "columns") + " received per place:";
    std::string bytes;
    for (std::size_t p = 0; p < m.size(); ++p) {
      // the block before this exchange: the shard, widened by the exchanges before it
      const shape_t<4> block = cut.block_shape(m, p, shard_shape(m, lx, x_shape, p), i);
      const std::size_t row_bytes = element * volume(block) / std::max<std::size_t>(block[s.move.dim], 1);
      const std::size_t c = cut.coord(m, p, i);
      text += (p == 0 ? " " : ", ") + std::to_string(d.halo_rows(c));
      bytes += (p == 0 ? " " : ", ") + std::to_string(halo_bytes_sent(d, c, row_bytes));
    }
    text += "; bytes sent per place:" + bytes + "\n";
  }
  text += "  backward: kernel " + std::string(op) + " backward" +
          (halo_axes.empty() ? std::string() : ", then the halo rows' gradient sent back to their owners over " + halo_axes +
                                                   " (the bytes of the exchange, the other way)") +
          backward_extra + "\n";
  return text;
}

}  // namespace detail

/// @brief The plan of conv2d for operands of types X, W, B (dtensors, or vars of them): a
/// halo exchange along each split spatial dim, then the kernel. A value, usable in
/// static_assert (`pdo::conv2d_plan<decltype(x), decltype(w), decltype(b)>().collectives() == 1`).
template <class X, class W, class B>
constexpr expression_plan conv2d_plan() {
  using LX = detail::window_operand_t<X>;
  using LW = detail::window_operand_t<W>;
  using LB = detail::window_operand_t<B>;
  static_assert(detail::check_conv_layouts<LX, LW, LB>());
  return detail::window_plan("conv2d", 3, detail::value_of<LX>(), detail::conv_rule_of<LX, LW, LB>::value.y);
}

/// @brief The plan of max_pool2d (Max) or avg_pool2d over an input of type X (a dtensor or a var of one).
template <class X, bool Max = true>
constexpr expression_plan pool2d_plan() {
  constexpr detail::layout_value x = detail::value_of<detail::window_operand_t<X>>();
  return detail::window_plan(Max ? "max_pool2d" : "avg_pool2d", 1, x, x);
}

namespace detail {

/// @brief conv2d over dtensors whose layouts conv_rule takes.
template <class T, class Mesh, class LX, class LW, class LB>
auto distributed_conv2d(const var<dtensor<T, 4, Mesh, LX>>& x, const var<dtensor<T, 4, Mesh, LW>>& weight,
                        const var<dtensor<T, 1, Mesh, LB>>& bias, window_options o) {
  using rule = detail::conv_rule_of<LX, LW, LB>;
  using LY = detail::layout_type_t<Mesh, detail::conv_layout_provider<LX, LW, LB, &detail::conv_layouts::y>>;
  using LDW = detail::layout_type_t<Mesh, detail::conv_layout_provider<LX, LW, LB, &detail::conv_layouts::dw>>;
  using LDB = detail::layout_type_t<Mesh, detail::conv_layout_provider<LX, LW, LB, &detail::conv_layouts::db>>;
  using LDX = detail::layout_type_t<Mesh, detail::conv_layout_provider<LX, LW, LB, &detail::conv_layouts::dx>>;
  const auto& xv = x.value();
  const auto& wv = weight.value();
  const auto& bv = bias.value();
  const Mesh& m = xv.mesh();
  if (!(wv.mesh() == m)) detail::throw_other_mesh("conv2d", "the weight " + wv.describe(), wv.mesh().describe(), m.describe(), "the input's");
  if (!(bv.mesh() == m)) detail::throw_other_mesh("conv2d", "the bias " + bv.describe(), bv.mesh().describe(), m.describe(), "the input's");
  const std::string layouts = " (layouts " + layout_name<LX>() + ", " + layout_name<LW>() + ", " + layout_name<LB>() + ")";
  detail::check_conv_shapes(xv.shape(), wv.shape(), bv.shape(), layouts);
  const detail::window_geometry whole = detail::window_of("conv2d", xv.shape(), wv.shape()[2], o, layouts);
  const auto cut = std::make_shared<const detail::spatial_cut>(m, detail::value_of<LX>(), whole, o.padding);
  const shape_t<4> y_shape{whole.batch, wv.shape()[0], whole.out_height, whole.out_width};
  const auto& local = m.local_places();
  std::vector<tensor<T, 4>> ys(local.size());
  auto cols = std::make_shared<std::vector<std::shared_ptr<tensor<T, 2>>>>(local.size());
  // a partial output: the bias is added once, by the first place along the partial axis
  const auto bias_of = [&](std::size_t p, std::size_t k) -> const T* {
    for (std::size_t i = 0; i < rule::value.y.npartial; ++i)
      if (m.coord(p, Mesh::axis_index(rule::value.y.partial[i])) != 0) return nullptr;
    return bv.local_shards()[k].data();
  };
  if (cut->any()) {
    detail::conv2d_spatial_forward(m, *cut, xv.local_shards(), wv.local_shards(), bias_of, ys, *cols);
  } else {
    detail::run_on_places("conv2d", m, [&](std::size_t p, std::size_t k) {
      const auto& xs = xv.local_shards()[k];
      auto [y, c] = detail::conv2d_forward(xs, wv.local_shards()[k], bias_of(p, k), cut->local(m, p, xs.shape()));
      ys[k] = std::move(y);
      (*cols)[k] = std::move(c);
    });
  }
  dtensor<T, 4, Mesh, LY> y(m, y_shape, std::move(ys));
  return detail::record(
      std::move(y),
      [x, weight, bias, cols, cut](auto& self) {
        const auto& xv = x.value();
        const auto& wv = weight.value();
        const Mesh& m = xv.mesh();
        const auto& local = m.local_places();
        std::vector<tensor<T, 4>> dws(local.size()), dxs(local.size());
        std::vector<tensor<T, 1>> dbs(local.size());
        if (x.requires_grad() && cut->any()) {
          detail::conv2d_spatial_backward(m, *cut, self.grad->local_shards(), *cols, wv.local_shards(), xv.local_shards(),
                                          weight.requires_grad() ? &dws : nullptr, bias.requires_grad() ? &dbs : nullptr, dxs);
        } else {
          detail::run_on_places("conv2d backward", m, [&](std::size_t p, std::size_t k) {
            const auto g = cut->block_geometry(m, p, xv.local_shards()[k].shape());
            detail::conv2d_backward(self.grad->local_shards()[k], *(*cols)[k], wv.local_shards()[k], g,
                                    weight.requires_grad() ? &dws[k] : nullptr, bias.requires_grad() ? &dbs[k] : nullptr,
                                    x.requires_grad() ? &dxs[k] : nullptr);
          });
        }
        if (weight.requires_grad()) detail::add_grad(weight, dtensor<T, 4, Mesh, LDW>(m, wv.shape(), std::move(dws)));
        if (bias.requires_grad()) detail::add_grad(bias, dtensor<T, 1, Mesh, LDB>(m, bias.value().shape(), std::move(dbs)));
        if (x.requires_grad()) detail::add_grad(x, dtensor<T, 4, Mesh, LDX>(m, xv.shape(), std::move(dxs)));
      },
      x, weight, bias);
}

}  // namespace detail

/// @brief conv2d over dtensors: each place convolves its shards, with the layouts of
/// detail::conv_rule: batch split over "dp" is data parallel (weight gradients partial over
/// "dp"); the weight's output channels split over an axis give an output split by
/// channels (channel parallel; the input gradient is a partial sum over that axis); the
/// input channels split with the weight's dim 1 give a partial output (summed where it is
/// consumed; the bias is added once); the height or width split (spatial) gives an output
/// split alike, each place receiving from its neighbours the rows its windows read (a halo
/// exchange, from as many places as the halo is wide) and sending back their gradient.
/// Gradients go back to the operands' layouts by the planner's redistributions.
template <class Policy = implicit, class T, class Mesh, class LX, class LW, class LB>
auto conv2d(const var<dtensor<T, 4, Mesh, LX>>& x, const var<dtensor<T, 4, Mesh, LW>>& weight,
            const var<dtensor<T, 1, Mesh, LB>>& bias, window_options o = {}) {
  // layouts it does not take, or a policy that refuses the input's: one error, naming them and
  // why, then an empty result of a type the call could have, so that no other error follows
  // (the conditions are plain predicates: the checks that give the errors are called inside)
  if constexpr (!detail::conv_rule_of<LX, LW, LB>::value.ok) {
    (void)detail::check_conv_layouts<LX, LW, LB>();
    return var<dtensor<T, 4, Mesh, LX>>();
  } else if constexpr (!detail::window_policy_allows<Policy, LX>()) {
    (void)detail::check_window_policy<Policy, "conv2d", LX>();
    return var<dtensor<T, 4, Mesh, detail::layout_type_t<Mesh, detail::conv_layout_provider<LX, LW, LB, &detail::conv_layouts::y>>>>();
  } else {
    return detail::distributed_conv2d(x, weight, bias, o);
  }
}

namespace detail {

/// @brief The local pool of x over the windows of g (on the calling thread's place).
template <bool Max, class T>
tensor<T, 4> pool2d_forward(const char* op, const tensor<T, 4>& x, const window_geometry& g) {
  auto system = kernel_system(op, {x.where()});
  const thrust::counting_iterator<std::size_t> zero(0);
  tensor<T, 4> y({g.batch, g.channels, g.out_height, g.out_width}, uninitialized);
  thrust::transform(system, zero, zero + y.size(), y.data(), pool_element<T, Max>{x.data(), g});
  return y;
}

/// @brief The local pool's input gradient from dy.
template <bool Max, class T>
tensor<T, 4> pool2d_backward(const char* op, const tensor<T, 4>& x, const tensor<T, 4>& dy, const window_geometry& g) {
  auto system = kernel_system(op, {x.where(), dy.where()});
  const thrust::counting_iterator<std::size_t> first(0);
  tensor<T, 4> dx(x.shape(), uninitialized);
  thrust::transform(system, first, first + dx.size(), dx.data(), pool_backward_element<T, Max>{x.data(), dy.data(), g});
  return dx;
}

template <bool Max, class T>
var<tensor<T, 4>> pool2d(const char* op, const var<tensor<T, 4>>& x, std::size_t kernel, window_options o) {
  const window_geometry g = pool_window_of(op, x.shape(), kernel, o);
  return record(
      pool2d_forward<Max>(op, x.value(), g),
      [x, g, op](auto& self) { add_grad(x, pool2d_backward<Max>(op, x.value(), *self.grad, g)); }, x);
}

/// @brief Whether pooling can run on an input laid out as `x`: not partial; batch and
/// channels split run on each place's shard alone; height and width split exchange halos.
constexpr bool pool_layout_ok(layout_value x) { return x.npartial == 0; }

/// @brief Pooling of a dtensor: each place pools its shard (widened by its halo where the
/// height or width is split); the output and the input gradient keep the input's layout.
template <bool Max, class T, class Mesh, class L>
var<dtensor<T, 4, Mesh, L>> pool2d(const char* op, const var<dtensor<T, 4, Mesh, L>>& x, std::size_t kernel, window_options o) {
  static_assert(pool_layout_ok(value_of<L>()), "pdo: max_pool2d/avg_pool2d: the input must not be partial: reduce it first");
  using value_t = dtensor<T, 4, Mesh, L>;
  const value_t& xv = x.value();
  const window_geometry whole = pool_window_of(op, xv.shape(), kernel, o, " (layout " + layout_name<L>() + ")");
  const Mesh& m = xv.mesh();
  const auto cut = std::make_shared<const spatial_cut>(m, value_of<L>(), whole, o.padding);
  std::vector<tensor<T, 4>> ys(m.local_places().size());
  // the blocks the windows read, for the backward of a max pool (its shards, when nothing is split)
  auto blocks = std::make_shared<std::vector<tensor<T, 4>>>(cut->any() ? ys.size() : 0);
  run_on_places(op, m, [&](std::size_t p, std::size_t k) {
    const auto& xs = xv.local_shards()[k];
    if (cut->any()) (*blocks)[k] = cut->gather(m, p, xs);
    const tensor<T, 4>& in = cut->any() ? (*blocks)[k] : xs;
    ys[k] = pool2d_forward<Max>(op, in, cut->local(m, p, in.shape()));
  });
  const shape_t<4> y_shape{whole.batch, whole.channels, whole.out_height, whole.out_width};
  return record(
      value_t(m, y_shape, std::move(ys)),
      [x, op, cut, blocks](auto& self) {
        const value_t& xv = x.value();
        const Mesh& m = xv.mesh();
        std::vector<tensor<T, 4>> dxs(xv.local_shards().size());
        run_on_places(op, m, [&](std::size_t p, std::size_t k) {
          const tensor<T, 4>& in = cut->any() ? (*blocks)[k] : xv.local_shards()[k];
          dxs[k] = pool2d_backward<Max>(op, in, self.grad->local_shards()[k], cut->local(m, p, in.shape()));
          if (cut->any()) dxs[k] = cut->give_back(m, p, std::move(dxs[k]));
        });
        add_grad(x, value_t(m, xv.shape(), std::move(dxs)));
      },
      x);
}

}  // namespace detail

/// @brief Max pooling over kernel x kernel windows (stride defaults to the kernel) of
/// x [N, C, H, W], a local tensor or a dtensor (batch or channels split: each place pools
/// its shard; height or width split: with its halo, as conv2d). NaN in a window gives NaN; the gradient goes to each
/// window's first maximum (its last NaN, if any), as PyTorch's.
template <class Policy = implicit, class V>
  requires(detail::value_kind<V>::rank == 4)
var<V> max_pool2d(const var<V>& x, std::size_t kernel, window_options o = {0, 0}) {
  if constexpr (!detail::window_policy_allows<Policy, detail::window_layout_t<V>>()) {
    (void)detail::check_window_policy<Policy, "max_pool2d", detail::window_layout_t<V>>();
    return var<V>{};  // the error was given: nothing more after it
  } else {
    return detail::pool2d<true>("max_pool2d", x, kernel, o);
  }
}

/// @brief Average pooling over kernel x kernel windows (stride defaults to the kernel;
/// padded cells count as zeros), of a local tensor or a dtensor (split as max_pool2d's).
template <class Policy = implicit, class V>
  requires(detail::value_kind<V>::rank == 4)
var<V> avg_pool2d(const var<V>& x, std::size_t kernel, window_options o = {0, 0}) {
  if constexpr (!detail::window_policy_allows<Policy, detail::window_layout_t<V>>()) {
    (void)detail::check_window_policy<Policy, "avg_pool2d", detail::window_layout_t<V>>();
    return var<V>{};  // the error was given: nothing more after it
  } else {
    return detail::pool2d<false>("avg_pool2d", x, kernel, o);
  }
}

namespace detail {
template <class V>
const auto& window_value(const V& v) {
  if constexpr (requires { v.value(); }) return v.value();
  else return v;
}
template <bool Max, class X>
std::string explain_pool2d(const X& x, std::size_t kernel, window_options o) {
  const auto& xv = window_value(x);
  using value_t = std::remove_cvref_t<decltype(xv)>;
  const char* op = Max ? "max_pool2d" : "avg_pool2d";
  const window_geometry whole = pool_window_of(op, xv.shape(), kernel, o, " (layout " + layout_name<typename value_t::layout_type>() + ")");
  const spatial_cut cut(xv.mesh(), value_t::layout_value, whole, o.padding);
  return explain_window(op, pool2d_plan<value_t, Max>(), xv.mesh(), xv.shape(), value_t::layout_value,
                        {whole.batch, whole.channels, whole.out_height, whole.out_width}, cut, sizeof(typename value_t::value_type), "");
}
}  // namespace detail

/// @brief The plan of conv2d(x, weight, bias, o) for the operands' shapes and layouts (dtensors,
/// or vars of them), one line per step: each halo exchange with its axis, the rows each place
/// receives and the bytes each place sends; the kernel with its output layout; the backward.
template <class X, class W, class B>
std::string explain_conv2d(const X& x, const W& weight, const B& bias, window_options o = {}) {
  const auto& xv = detail::window_value(x);
  const auto& wv = detail::window_value(weight);
  const auto& bv = detail::window_value(bias);
  using XV = std::remove_cvref_t<decltype(xv)>;
  using WV = std::remove_cvref_t<decltype(wv)>;
  using BV = std::remove_cvref_t<decltype(bv)>;
  constexpr auto plan = conv2d_plan<XV, WV, BV>();
  constexpr detail::conv_layouts rule = detail::conv_rule_of<typename XV::layout_type, typename WV::layout_type, typename BV::layout_type>::value;
  const std::string layouts = " (layouts " + layout_name<typename XV::layout_type>() + ", " + layout_name<typename WV::layout_type>() + ", " +
                              layout_name<typename BV::layout_type>() + ")";
  detail::check_conv_shapes(xv.shape(), wv.shape(), bv.shape(), layouts);
  const detail::window_geometry whole = detail::window_of("conv2d", xv.shape(), wv.shape()[2], o, layouts);
  const detail::spatial_cut cut(xv.mesh(), XV::layout_value, whole, o.padding);
  std::string extra;
  if (rule.dw.npartial > 0) {
    extra = "; weight and bias gradients partial over";
    for (std::size_t i = 0; i < rule.dw.npartial; ++i) extra += (i == 0 ? " " : ", ") + std::string(rule.dw.partial[i]);
    extra += " (summed where they are read)";
  }
  return detail::explain_window("conv2d", plan, xv.mesh(), xv.shape(), XV::layout_value,
                                {whole.batch, wv.shape()[0], whole.out_height, whole.out_width}, cut, sizeof(typename XV::value_type), extra);
}

/// @brief The plan of max_pool2d(x, kernel, o), as explain_conv2d's.
template <class X>
std::string explain_max_pool2d(const X& x, std::size_t kernel, window_options o = {0, 0}) {
  return detail::explain_pool2d<true>(x, kernel, o);
}

/// @brief The plan of avg_pool2d(x, kernel, o), as explain_conv2d's.
template <class X>
std::string explain_avg_pool2d(const X& x, std::size_t kernel, window_options o = {0, 0}) {
  return detail::explain_pool2d<false>(x, kernel, o);
}

}  // namespace pdo
