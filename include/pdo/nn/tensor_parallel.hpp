// pdo/nn/tensor_parallel.hpp: tensor (intra-op) parallelism by parameter layouts alone.
#pragma once

#include <pdo/autograd/collectives.hpp>
#include <pdo/nn/layers.hpp>
#include <pdo/exec/mesh_ops.hpp>

#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdo::nn {

template <class L>
inline constexpr bool is_local_linear_v = false;
template <class T>
inline constexpr bool is_local_linear_v<linear<T>> = true;

/// @brief The layouts of a Megatron pair along `Axis`: the first linear split by columns
/// (W [in, out/n], b [out/n]), the second by rows (W [in/n, out], b replicated).
template <fixed_string Axis>
struct column_layouts {
  using weight = layout<replicate, split<Axis>>;  ///< W [in, out] split by columns (out) along `Axis`
  using bias = layout<split<Axis>>;               ///< b [out] split along `Axis`, as W's columns
};
/// @brief The layouts of the second linear of a Megatron pair (see column_layouts): split by rows.
template <fixed_string Axis>
struct row_layouts {
  using weight = layout<split<Axis>, replicate>;  ///< W [in, out] split by rows (in) along `Axis`
  using bias = layout<replicate>;                 ///< b [out] whole on every place
};

namespace detail_tp {
template <class Layouts, class T, class Mesh>
auto distribute_linear(const Mesh& m, const linear<T>& l) {
  using wl = typename Layouts::weight;
  using bl = typename Layouts::bias;
  return linear<T, dtensor<T, 2, Mesh, wl>, dtensor<T, 1, Mesh, bl>>(parameter(distribute<wl>(m, l.weight.value())),
                                                                      parameter(distribute<bl>(m, l.bias.value())));
}
}  // namespace detail_tp

/// @brief A copy of `l` whose weight is split by columns along `Axis` (W [in, out/n], b
/// [out/n]): its output is split along `Axis` by columns, with no communication.
template <fixed_string Axis, class T, class Mesh>
auto column_parallel(const Mesh& m, const linear<T>& l) {
  return detail_tp::distribute_linear<column_layouts<Axis>>(m, l);
}

/// @brief A copy of `l` whose weight is split by rows along `Axis` (W [in/n, out], b
/// replicated): fed a column-split input, its product is a partial sum over `Axis`, which
/// the bias addition reduces (one all_reduce).
template <fixed_string Axis, class T, class Mesh>
auto row_parallel(const Mesh& m, const linear<T>& l) {
  return detail_tp::distribute_linear<row_layouts<Axis>>(m, l);
}

/// @brief One place's shard of a Megatron linear, for SPMD code that runs on each place of
/// the tensor-parallel group with local tensors (a pipeline stage): W and b are the place's
/// shards as column_parallel / row_parallel lay them out, and the collectives the planner
/// derives for those layouts are written in:
/// - column (`Column`): the input, the same on every member, has its gradient summed over
///   the group in backward (pdo::replicated_across, Megatron's f);
/// - row: fed its column shard of the activations, its product is summed over the group
///   (one all_reduce forward, none backward: pdo::sum_across, Megatron's g), then the
///   replicated bias added.
template <class T, bool Column>
class linear_shard : public takes_var {
 public:
  using takes_var::operator();
  /// @brief Takes this place's shards `w` and `b` and the tensor-parallel group `g` it belongs to.
  linear_shard(var<tensor<T, 2>> w, var<tensor<T, 1>> b, mesh_communicator g)
      : weight(std::move(w)), bias(std::move(b)), group(std::move(g)) {}
  /// @brief x [N, in] (column) or this place's column shard of it (row) times W, plus b, with the
  /// collectives above: [N, out/n] (column) or [N, out] (row).
  auto operator()(const var<tensor<T, 2>>& x) const {
    if constexpr (Column) return pdo::matmul(pdo::replicated_across(x, group), weight) + bias;
    else return pdo::sum_across(pdo::matmul(x, weight), group) + bias;
  }
  /// @brief "weight" and "bias" (this place's shards), each name prefixed with `prefix`.
  [[nodiscard]] std::vector<parameter_ref<T>> parameters(const std::string& prefix = "") const {
    return {{prefix + "weight", weight}, {prefix + "bias", bias}};
  }
  var<tensor<T, 2>> weight;  ///< this place's shard of W: [in, out/n] (column) or [in/n, out] (row)
  var<tensor<T, 1>> bias;    ///< this place's shard of b: [out/n] (column), or all of b [out] (row)
  mesh_communicator group;   ///< the tensor-parallel group the collectives run over
};
template <class T>
using column_parallel_shard = linear_shard<T, true>;
template <class T>
using row_parallel_shard = linear_shard<T, false>;

namespace detail_tp {
template <class... Layers>
constexpr std::size_t linears_before(std::size_t i) {
  constexpr bool is_linear[] = {is_local_linear_v<Layers>..., false};
  std::size_t n = 0;
  for (std::size_t k = 0; k < i; ++k) n += is_linear[k];
  return n;
}

/// @brief Whether tensor parallelism can take `Layer`: a linear layer, or a layer without parameters.
template <class Layer>
inline constexpr bool convertible_v = is_local_linear_v<Layer> || std::is_empty_v<Layer> || std::is_base_of_v<stateless, Layer>;

/// @brief Whether no layer_norm of a model of `Layers` sits between the column and the row
/// layer of a pair, where each place holds a slice of the features (a place's shard would
/// normalise its slice alone).
template <class... Layers>
constexpr bool norms_outside_pairs() {
  constexpr bool is_norm[] = {std::is_same_v<Layers, layer_norm>..., false};
  for (std::size_t i = 0; i < sizeof...(Layers); ++i)
    if (is_norm[i] && linears_before<Layers...>(i) % 2 == 1) return false;
  return true;
}

/// @brief Whether a model of `Layers` can be made tensor parallel; when it cannot, one error
/// says why (its layers, else its linear layers not in pairs, else a layer_norm inside a
/// pair), and the caller instantiates nothing more.
template <class... Layers>
constexpr bool check_model() {
  constexpr bool convertible = (convertible_v<Layers> && ...);
  constexpr bool pairs = linears_before<Layers...>(sizeof...(Layers)) % 2 == 0;
  constexpr bool norms = norms_outside_pairs<Layers...>();
  static_assert(convertible,
                "pdo: tensor_parallel: the model may hold linear layers and layers without parameters (activations); "
                "split other layers' parameters explicitly");
  static_assert(!convertible || pairs,
                "pdo: tensor_parallel: the model needs linear layers in column/row pairs (an even number), so that "
                "its output is not left split along the tensor-parallel axis");
  static_assert(!convertible || !pairs || norms,
                "pdo: tensor_parallel: a layer_norm sits between the column and the row layer of a pair, where the features "
                "are split along the tensor-parallel axis; put it before the pair's first linear layer or after its second");
  return convertible && pairs && norms;
}

/// @brief The element type of a model's first linear layer (float when it has none).
template <class... Layers>
struct first_linear_element {
  using type = float;
};
template <class Layer, class... Rest>
struct first_linear_element<Layer, Rest...> {
  using type = typename first_linear_element<Rest...>::type;
};
template <class T, class... Rest>
struct first_linear_element<linear<T>, Rest...> {
  using type = T;
};

/// @brief What tensor_parallel gives after its error, so that the model's uses report nothing
/// more: it takes any input to an empty var of `Output`, the type a model's output would most
/// likely have (of the element type of its first linear layer, rank 2: replicated on the mesh
/// for tensor_parallel, a local tensor for tensor_parallel_shard), and holds no parameters.
template <class Output>
struct unformed_model {
  template <class X>
  auto operator()(const X&) const {
    return var<Output>{};
  }
  template <class U = typename var<Output>::element_type>
  [[nodiscard]] std::vector<parameter_ref<U>> parameters(const std::string& = "") const {
    return {};
  }
};

/// @brief unformed_model of tensor_parallel on `Mesh` of a model of `Layers`.
template <class Mesh, class... Layers>
using unformed_parallel_model = unformed_model<pdo::detail::replicated_dtensor_t<typename first_linear_element<Layers...>::type, 2, Mesh>>;
/// @brief unformed_model of tensor_parallel_shard of a model of `Layers`.
template <class... Layers>
using unformed_shard_model = unformed_model<tensor<typename first_linear_element<Layers...>::type, 2>>;

template <fixed_string Axis, std::size_t Ordinal, class Mesh, class Layer>
auto convert(const Mesh& m, const Layer& layer) {
  if constexpr (!is_local_linear_v<Layer>) return layer;
  else if constexpr (Ordinal % 2 == 0) return column_parallel<Axis>(m, layer);
  else return row_parallel<Axis>(m, layer);
}

/// @brief Place `p`'s shard of `layer` (see tensor_parallel_shard), in p's memory.
template <fixed_string Axis, std::size_t Ordinal, class Mesh, class Layer>
auto shard(const Mesh& m, std::size_t p, const Layer& layer) {
  if constexpr (!is_local_linear_v<Layer>) {
    return layer;
  } else {
    using T = typename decltype(layer.bias)::element_type;
    using layouts = std::conditional_t<Ordinal % 2 == 0, column_layouts<Axis>, row_layouts<Axis>>;
    auto w = parameter(pdo::detail::shard_of<typename layouts::weight>(m, layer.weight.value(), p));
    auto b = parameter(pdo::detail::shard_of<typename layouts::bias>(m, layer.bias.value(), p));
    auto group = communicator_along(m, Mesh::axis_index(Axis.view()), p);
    return linear_shard<T, Ordinal % 2 == 0>(std::move(w), std::move(b), std::move(group));
  }
}
}  // namespace detail_tp

/// @brief `model` with its parameters laid out for tensor parallelism along mesh axis
/// `Axis`, as Megatron pairs them: the 1st, 3rd, ... linear layers split by columns, the
/// 2nd, 4th, ... by rows; activations unchanged. The model code does not change: it runs
/// on dtensor inputs (replicated along `Axis`, split along others, e.g. rows over "dp"), and
/// the planner derives, from the parameters' layouts alone, one all_reduce per pair in
/// forward (the row-parallel partial sum) and one in backward (the input gradient of the
/// column-parallel layer). Parameters start as the local model's, so training matches it.
template <fixed_string Axis, class Mesh, class... Layers>
auto tensor_parallel(const Mesh& m, const sequential<Layers...>& model) {
  static_assert(Mesh::has_axis(Axis.view()),
                "pdo: tensor_parallel<Axis>: the mesh has no axis of that name; name one of the mesh's axes "
                "(make_mesh<\"dp\", \"tp\">: tensor_parallel<\"tp\">)");
  // after an error, nothing more is instantiated
  if constexpr (!Mesh::has_axis(Axis.view())) {
    return detail_tp::unformed_parallel_model<Mesh, Layers...>{};
  } else if constexpr (!detail_tp::check_model<Layers...>()) {
    return detail_tp::unformed_parallel_model<Mesh, Layers...>{};
  } else {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return sequential(detail_tp::convert<Axis, detail_tp::linears_before<Layers...>(I)>(m, std::get<I>(model.layers()))...);
    }(std::index_sequence_for<Layers...>{});
  }
}

/// @brief Place `p`'s part of tensor_parallel<Axis>(m, model), for SPMD code that runs the
/// model on every place of the group along `Axis` with local tensors (each pipeline stage
/// of a mesh with a "tp" axis does): the same Megatron pairs, each place holding the
/// shards those layouts give it (column_parallel_shard, row_parallel_shard), with the
/// collectives the planner would derive written in: one all_reduce per pair forward, one
/// backward. Inputs and outputs are the same on every member of the group.
template <fixed_string Axis, class Mesh, class... Layers>
auto tensor_parallel_shard(const Mesh& m, std::size_t p, const sequential<Layers...>& model) {
  static_assert(Mesh::has_axis(Axis.view()),
                "pdo: tensor_parallel_shard<Axis>: the mesh has no axis of that name; name one of the mesh's axes "
                "(make_mesh<\"dp\", \"tp\">: tensor_parallel<\"tp\">)");
  // after an error, nothing more is instantiated
  if constexpr (!Mesh::has_axis(Axis.view())) {
    return detail_tp::unformed_shard_model<Layers...>{};
  } else if constexpr (!detail_tp::check_model<Layers...>()) {
    return detail_tp::unformed_shard_model<Layers...>{};
  } else {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return sequential(detail_tp::shard<Axis, detail_tp::linears_before<Layers...>(I)>(m, p, std::get<I>(model.layers()))...);
    }(std::index_sequence_for<Layers...>{});
  }
}

}  // namespace pdo::nn
