// pdo/nn/layers.hpp: linear, conv2d, pooling, flatten, activations and sequential.
//
// Layers act on pdo::var values. linear, the pools and the activations take local tensors
// and dtensors alike; conv2d takes local images [N, C, H, W] (each place's shard under data
// parallelism; pdo::conv2d itself takes dtensors too).
#pragma once

#include <pdo/autograd/conv.hpp>
#include <pdo/autograd/ops.hpp>
#include <pdo/nn/module.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace pdo::detail {

/// @brief A linear layer's weight [in, out] and bias [out] agree (`out` = bias's length).
PDO_NOINLINE inline void check_linear_shapes(std::span<const std::size_t> weight, std::size_t bias) {
  if (weight.size() == 2 && weight[1] == bias) return;
  throw shape_error("linear: weight " + format_extent_list(weight) + " and bias [" + std::to_string(bias) +
                    "]: the weight must be [in, out] and the bias [out]");
}

/// @brief The input x [..., in] of a linear layer of weight [in, out] has `in` features.
PDO_NOINLINE inline void check_linear_input(std::span<const std::size_t> weight, std::span<const std::size_t> x) {
  if (!x.empty() && x.back() == weight[0]) return;
  throw shape_error("linear: input " + format_extent_list(x) + " for a layer of " + std::to_string(weight[0]) + " inputs and " +
                    std::to_string(weight[1]) + " outputs (weight " + format_extent_list(weight) +
                    "): the input's last dim must be " + std::to_string(weight[0]));
}

}  // namespace pdo::detail

namespace pdo::nn {

/// @brief What every layer and model shares: called on a plain tensor or dtensor, where it
/// takes a pdo::var (which backward follows), it is one error saying how to make one. Each
/// layer brings it in beside its own call operator (`using takes_var::operator();`).
struct takes_var {
  /// @brief Rejected: a layer or model is called on a pdo::var, not a plain tensor; gives an
  /// empty var of the input's type, so that the program's uses of the result report nothing more.
  template <class X>
    requires(is_tensor_v<X> || is_dtensor_v<X>)
  auto operator()(const X&) const {
    static_assert(pdo::detail::always_false<X>, "pdo: a layer or model takes its input as a pdo::var: layer(pdo::var(x)) (an input: "
                                                "no gradient), as every op whose result backward follows");
    return var<X>{};
  }
};

/// @brief y = x W + b, with W [in, out] and b [out]; x [..., in]. The parameters are local
/// tensors, or dtensors with layouts (see tensor_parallel): the same layer, planned.
///
/// Parameters: "weight" [in, out] — the transpose of PyTorch's nn.Linear weight, which is
/// [out, in] (parameter_ref::assign names the mistake) — and "bias" [out]. Initialised as
/// PyTorch's: U(-1/√in, 1/√in).
template <class T, class W = tensor<T, 2>, class B = tensor<T, 1>>
class linear : public takes_var {
 public:
  using takes_var::operator();
  /// @brief Local parameters weight [in, out] and bias [out], drawn from U(-1/√in, 1/√in) with `gen`, in the
  /// memory of the place running the calling thread.
  linear(std::size_t in, std::size_t out, rng& gen)
    requires(std::is_same_v<W, tensor<T, 2>> && std::is_same_v<B, tensor<T, 1>>)
      : weight(parameter(init::fan_in_uniform<T>(shape_t<2>{in, out}, in, gen))),
        bias(parameter(init::fan_in_uniform<T>(shape_t<1>{out}, in, gen))) {}
  /// @brief Takes given parameters: w [in, out] and b [out] (tensors, or dtensors laid out for
  /// tensor parallelism); a pdo::shape_error when b's length is not w's second extent.
  linear(var<W> w, var<B> b) : weight(std::move(w)), bias(std::move(b)) {
    detail::check_linear_shapes(weight.shape(), bias.shape()[0]);
  }

  /// @brief x [..., in] W + b: [..., out]; a pdo::shape_error naming the layer's shape when
  /// x's last extent is not `in`.
  template <class V>
  auto operator()(const var<V>& x) const {
    if constexpr (var<V>::distributed != var<W>::distributed) {
      static_assert(var<V>::distributed || !var<W>::distributed,
                    "pdo: nn::linear: a layer whose parameters are dtensors was called on a local tensor: distribute the input onto the "
                    "parameters' mesh (pdo::distribute<Layout>(mesh, x))");
      static_assert(!var<V>::distributed || var<W>::distributed,
                    "pdo: nn::linear: a layer whose parameters are local tensors was called on a dtensor: train a local model over a "
                    "mesh with nn::make_data_parallel, lay its parameters out with nn::tensor_parallel, or give the layer dtensor parameters");
      return x;  // the error was given: nothing more after it
    } else {
      detail::check_linear_input(weight.shape(), x.shape());
      return pdo::matmul(x, weight) + bias;
    }
  }
  /// @brief "weight" and "bias", each name prefixed with `prefix`.
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(const std::string& prefix = "") const {
    return {{prefix + "weight", weight}, {prefix + "bias", bias}};
  }

  var<W> weight;  ///< W [in, out]
  var<B> bias;    ///< b [out]
};

/// @brief 2-D convolution over [N, in_channels, H, W] with a square kernel.
///
/// Parameters, as PyTorch's nn.Conv2d: "weight" [out_channels, in_channels, k, k] and "bias"
/// [out_channels]; initialised U(-1/√fan_in, 1/√fan_in), fan_in = in_channels k².
template <class T>
class conv2d : public takes_var {
 public:
  using takes_var::operator();
  /// @brief Parameters drawn from U(-1/√fan_in, 1/√fan_in) with `gen`; `o`: stride (not 0) and padding.
  conv2d(std::size_t in_channels, std::size_t out_channels, std::size_t kernel, rng& gen, window_options o = {})
      : weight(parameter(init::fan_in_uniform<T>(shape_t<4>{out_channels, in_channels, kernel, kernel}, in_channels * kernel * kernel, gen))),
        bias(parameter(init::fan_in_uniform<T>(shape_t<1>{out_channels}, in_channels * kernel * kernel, gen))),
        options_(o) {}
  /// @brief Takes given parameters: w [out_channels, in_channels, k, k] and b [out_channels].
  conv2d(var<tensor<T, 4>> w, var<tensor<T, 1>> b, window_options o) : weight(std::move(w)), bias(std::move(b)), options_(o) {}
  /// @brief The stride and padding the layer convolves with.
  [[nodiscard]] window_options options() const { return options_; }

  /// @brief The convolution of local images x [N, in_channels, H, W]: [N, out_channels, H', W'].
  var<tensor<T, 4>> operator()(const var<tensor<T, 4>>& x) const { return pdo::conv2d(x, weight, bias, options_); }
  /// @brief Rejected: a layer of local parameters on images that are not a local var [N, C, H, W] of T.
  template <class V>
  var<tensor<T, 4>> operator()(const var<V>&) const {
    static_assert(!var<V>::distributed,
                  "pdo: nn::conv2d: the layer's parameters are local tensors and its input is a dtensor: train it over a mesh with "
                  "nn::make_data_parallel, or call pdo::conv2d on a var of dtensor images with dtensor parameters");
    static_assert(var<V>::distributed, "pdo: nn::conv2d: the layer takes a var of tensor<T, 4> images [N, C, H, W] of its element type");
    return {};
  }
  /// @brief "weight" and "bias", each name prefixed with `prefix`.
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(const std::string& prefix = "") const {
    return {{prefix + "weight", weight}, {prefix + "bias", bias}};
  }

  var<tensor<T, 4>> weight;  ///< [out_channels, in_channels, k, k]
  var<tensor<T, 1>> bias;    ///< [out_channels]

 private:
  window_options options_;
};

/// @brief A layer without parameters.
struct stateless : takes_var {
  /// @brief No parameters: an empty list.
  template <class T>
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(const std::string& = "") const {
    return {};
  }
};

/// @brief Max pooling over kernel x kernel windows (stride: the kernel unless given).
struct max_pool2d : stateless {
  using takes_var::operator();
  std::size_t kernel = 2;        ///< window side, in pixels
  window_options options{0, 0};  ///< stride (0: the kernel) and zero padding
  /// @brief pdo::max_pool2d of x [N, C, H, W], a local tensor or a dtensor.
  template <class V>
  var<V> operator()(const var<V>& x) const {
    return pdo::max_pool2d(x, kernel, options);
  }
};

/// @brief Average pooling over kernel x kernel windows (stride: the kernel unless given).
struct avg_pool2d : stateless {
  using takes_var::operator();
  std::size_t kernel = 2;        ///< window side, in pixels
  window_options options{0, 0};  ///< stride (0: the kernel) and zero padding (counted as zeros)
  /// @brief pdo::avg_pool2d of x [N, C, H, W], a local tensor or a dtensor.
  template <class V>
  var<V> operator()(const var<V>& x) const {
    return pdo::avg_pool2d(x, kernel, options);
  }
};

/// @brief [N, ...] -> [N, product of the rest].
struct flatten : stateless {
  using takes_var::operator();
  /// @brief x reshaped to [N, product of its other extents] (of a dtensor, only dim 0 may be split).
  template <class V>
  auto operator()(const var<V>& x) const {
    const auto& s = x.shape();
    std::size_t rest = 1;
    for (std::size_t d = 1; d < s.size(); ++d) rest *= s[d];
    return pdo::reshape(x, shape_t<2>{s[0], rest});
  }
};

/// @brief ReLU, max(x, 0) elementwise: PyTorch's nn.ReLU().
struct relu : stateless {
  using takes_var::operator();
  /// @brief pdo::relu(x).
  template <class V>
  auto operator()(const var<V>& x) const { return pdo::relu(x); }
};
/// @brief Hyperbolic tangent, elementwise: PyTorch's nn.Tanh().
struct tanh : stateless {
  using takes_var::operator();
  /// @brief pdo::tanh(x).
  template <class V>
  auto operator()(const var<V>& x) const { return pdo::tanh(x); }
};
/// @brief Logistic sigmoid 1 / (1 + e^-x), elementwise: PyTorch's nn.Sigmoid().
struct sigmoid : stateless {
  using takes_var::operator();
  /// @brief pdo::sigmoid(x).
  template <class V>
  auto operator()(const var<V>& x) const { return pdo::sigmoid(x); }
};
/// @brief GELU, exact (erf form): PyTorch's nn.GELU().
struct gelu : stateless {
  using takes_var::operator();
  /// @brief pdo::gelu(x).
  template <class V>
  auto operator()(const var<V>& x) const { return pdo::gelu(x); }
};
/// @brief GELU, tanh approximation: PyTorch's nn.GELU(approximate="tanh").
struct gelu_tanh : stateless {
  using takes_var::operator();
  /// @brief pdo::gelu_tanh(x).
  template <class V>
  auto operator()(const var<V>& x) const { return pdo::gelu_tanh(x); }
};

/// @brief Layer normalisation over the last dim without weight and bias: PyTorch's
/// nn.LayerNorm(features, eps, elementwise_affine=False). In a model made tensor parallel it
/// sits outside the column/row pairs (before a column layer or after a row layer), where the
/// features are whole on every place, as Megatron places it.
struct layer_norm : stateless {
  using takes_var::operator();
  /// @brief eps 1e-5, PyTorch's default.
  layer_norm() = default;
  /// @brief `eps`, added to each row's variance.
  explicit layer_norm(double eps) : eps(eps) {}
  /// @brief pdo::layer_norm(x, eps).
  template <class V>
  auto operator()(const var<V>& x) const { return pdo::layer_norm(x, eps); }
  double eps = 1e-5;  ///< added to each row's variance before its square root
};

/// @brief The parameters of a layer or model, names prefixed with `prefix`.
template <class T, class M>
std::vector<parameter_ref<T>> parameters_of(const M& m, const std::string& prefix = "") {
  if constexpr (requires { m.template parameters<T>(prefix); }) return m.template parameters<T>(prefix);
  else return m.parameters(prefix);
}

/// @brief Layers applied in order; parameters named "<index>.<name>" ("0.weight").
template <class... Layers>
class sequential : public takes_var {
 public:
  using takes_var::operator();
  /// @brief The layers, applied first to last.
  explicit sequential(Layers... layers) : layers_(std::move(layers)...) {}

  /// @brief x through every layer in order (x itself when there are none).
  template <class V>
  auto operator()(const var<V>& x) const {
    return apply<0>(x);
  }
  /// @brief Every layer's parameters in order, named `prefix` + "<index>." + the layer's name for them.
  template <class T>
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(const std::string& prefix = "") const {
    std::vector<parameter_ref<T>> all;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (append(all, parameters_of<T>(std::get<I>(layers_), prefix + std::to_string(I) + ".")), ...);
    }(std::index_sequence_for<Layers...>{});
    return all;
  }
  /// @brief The layers, in order.
  [[nodiscard]] const std::tuple<Layers...>& layers() const { return layers_; }

 private:
  template <std::size_t I, class V>
  auto apply(const var<V>& x) const {
    if constexpr (I == sizeof...(Layers)) return x;
    else return apply<I + 1>(std::get<I>(layers_)(x));
  }
  template <class T>
  static void append(std::vector<parameter_ref<T>>& all, std::vector<parameter_ref<T>> more) {
    for (auto& p : more) all.push_back(std::move(p));
  }
  std::tuple<Layers...> layers_;
};

namespace detail_nn {
/// @brief Whether the parameters of the layer or model `M` are of element type `T`: a
/// sequential's when every layer's are; a layer without parameters (its list is made for any
/// T) always; any other's when `parameters(prefix)` lists parameter_ref<T>.
template <class T, class M>
struct holds_parameters_of
    : std::bool_constant<requires(const M& m) { m.template parameters<T>(std::string()); } ||
                         requires(const M& m) {
                           { m.parameters(std::string()) } -> std::same_as<std::vector<parameter_ref<T>>>;
                         }> {};
template <class T, class... Layers>
struct holds_parameters_of<T, sequential<Layers...>> : std::bool_constant<(holds_parameters_of<T, Layers>::value && ...)> {};
}  // namespace detail_nn

}  // namespace pdo::nn
