// pdo/autograd/conv.hpp: conv2d (im2col + gemm) and 2-D pooling on pdo::var, with their backward.
#pragma once

#include <pdo/autograd/variable.hpp>
#include <pdo/kernels/conv.hpp>
#include <pdo/kernels/gemm.hpp>

#include <cstddef>
#include <memory>
#include <string>

namespace pdo {

/// @brief Stride and zero padding of conv2d and the pools.
struct window_options {
  std::size_t stride = 1;
  std::size_t padding = 0;
};

namespace detail {

inline window_geometry window_of(const char* op, const shape_t<4>& x, std::size_t kernel, window_options o) {
  window_geometry g{x[0], x[1], x[2], x[3], kernel, o.stride, o.padding};
  if (!make_window_geometry(g))
    throw shape_error(std::string(op) + ": input " + format_extents(x) + " with kernel " + std::to_string(kernel) + ", stride " +
                      std::to_string(o.stride) + ", padding " + std::to_string(o.padding) +
                      ": the window must fit the padded image, and kernel and stride must be positive");
  return g;
}

}  // namespace detail

/// @brief 2-D convolution: x [N, C, H, W], weight [OC, C, K, K], bias [OC] -> [N, OC, OH, OW],
/// as im2col then one gemm; the backward is two gemms and col2im.
template <class T>
var<tensor<T, 4>> conv2d(const var<tensor<T, 4>>& x, const var<tensor<T, 4>>& weight, const var<tensor<T, 1>>& bias,
                         window_options o = {}) {
  const auto& sw = weight.shape();
  const auto& sx = x.shape();
  if (sw[1] != sx[1] || sw[2] != sw[3] || bias.shape()[0] != sw[0])
    throw shape_error("conv2d: input " + detail::format_extents(sx) + ", weight " + detail::format_extents(sw) + ", bias " +
                      detail::format_extents(bias.shape()) +
                      ": the weight must be [out_channels, in_channels, k, k] with the input's channels, and the bias [out_channels]");
  const detail::window_geometry g = detail::window_of("conv2d", sx, sw[2], o);
  const std::size_t oc = sw[0];
  auto system = detail::current_cpu_system();
  const thrust::counting_iterator<std::size_t> zero(0);
  auto cols = std::make_shared<tensor<T, 2>>(shape_t<2>{g.rows(), g.cols()}, detail::uninitialized);
  thrust::transform(system, zero, zero + cols->size(), cols->data(), detail::im2col_element<T>{x.value().data(), g});
  tensor<T, 2> rows({g.rows(), oc}, detail::uninitialized);
  detail::gemm<T>(system, g.rows(), oc, g.cols(), {cols->data(), g.cols(), false}, {weight.value().data(), g.cols(), true}, rows.data());
  tensor<T, 4> y({g.batch, oc, g.out_height, g.out_width}, detail::uninitialized);
  thrust::transform(system, zero, zero + y.size(), y.data(), detail::rows_to_images<T>{rows.data(), bias.value().data(), oc, g.out_pixels()});
  return detail::record(
      std::move(y),
      [x, weight, bias, cols, g, oc](auto& self) {
        auto sys = detail::current_cpu_system();
        const thrust::counting_iterator<std::size_t> first(0);
        tensor<T, 2> g2({g.rows(), oc}, detail::uninitialized);
        thrust::transform(sys, first, first + g2.size(), g2.data(), detail::images_to_rows<T>{self.grad->data(), oc, g.out_pixels()});
        if (weight.requires_grad()) {
          tensor<T, 4> dw(weight.shape(), detail::uninitialized);
          detail::gemm<T>(sys, oc, g.cols(), g.rows(), {g2.data(), oc, true}, {cols->data(), g.cols(), false}, dw.data());
          detail::add_grad(weight, std::move(dw));
        }
        if (bias.requires_grad()) {
          tensor<T, 1> db({oc}, detail::uninitialized);
          thrust::transform(sys, first, first + oc, db.data(), detail::column_sum<T>{g2.data(), g.rows(), oc});
          detail::add_grad(bias, std::move(db));
        }
        if (x.requires_grad()) {
          tensor<T, 2> dcols({g.rows(), g.cols()}, detail::uninitialized);
          detail::gemm<T>(sys, g.rows(), g.cols(), oc, {g2.data(), oc, false}, {weight.value().data(), g.cols(), false}, dcols.data());
          tensor<T, 4> dx(x.shape(), detail::uninitialized);
          thrust::transform(sys, first, first + dx.size(), dx.data(), detail::col2im_element<T>{dcols.data(), g});
          detail::add_grad(x, std::move(dx));
        }
      },
      x, weight, bias);
}

namespace detail {
template <bool Max, class T>
var<tensor<T, 4>> pool2d(const char* op, const var<tensor<T, 4>>& x, std::size_t kernel, window_options o) {
  const window_geometry g = window_of(op, x.shape(), kernel, o);
  auto system = current_cpu_system();
  const thrust::counting_iterator<std::size_t> zero(0);
  tensor<T, 4> y({g.batch, g.channels, g.out_height, g.out_width}, uninitialized);
  thrust::transform(system, zero, zero + y.size(), y.data(), pool_element<T, Max>{x.value().data(), g});
  return record(
      std::move(y),
      [x, g](auto& self) {
        auto sys = current_cpu_system();
        const thrust::counting_iterator<std::size_t> first(0);
        tensor<T, 4> dx(x.shape(), uninitialized);
        thrust::transform(sys, first, first + dx.size(), dx.data(), pool_backward_element<T, Max>{x.value().data(), self.grad->data(), g});
        add_grad(x, std::move(dx));
      },
      x);
}
}  // namespace detail

/// @brief Max pooling over kernel x kernel windows (stride defaults to the kernel); the
/// gradient goes to each window's first maximum.
template <class T>
var<tensor<T, 4>> max_pool2d(const var<tensor<T, 4>>& x, std::size_t kernel, window_options o = {0, 0}) {
  if (o.stride == 0) o.stride = kernel;
  return detail::pool2d<true>("max_pool2d", x, kernel, o);
}

/// @brief Average pooling over kernel x kernel windows (stride defaults to the kernel;
/// padded cells count as zeros).
template <class T>
var<tensor<T, 4>> avg_pool2d(const var<tensor<T, 4>>& x, std::size_t kernel, window_options o = {0, 0}) {
  if (o.stride == 0) o.stride = kernel;
  return detail::pool2d<false>("avg_pool2d", x, kernel, o);
}

}  // namespace pdo
