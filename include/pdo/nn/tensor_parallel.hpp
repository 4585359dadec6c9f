// pdo/nn/tensor_parallel.hpp: tensor (intra-op) parallelism by parameter layouts alone.
#pragma once

#include <pdo/nn/layers.hpp>
#include <pdo/tensor/redistribute.hpp>

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

namespace pdo::nn {

template <class L>
inline constexpr bool is_local_linear_v = false;
template <class T>
inline constexpr bool is_local_linear_v<linear<T>> = true;

/// @brief A copy of `l` whose weight is split by columns along `Axis` (W [in, out/n], b
/// [out/n]): its output is split along `Axis` by columns, with no communication.
template <fixed_string Axis, class T, class Mesh>
auto column_parallel(const Mesh& m, const linear<T>& l) {
  using wl = layout<replicate, split<Axis>>;
  using bl = layout<split<Axis>>;
  return linear<T, dtensor<T, 2, Mesh, wl>, dtensor<T, 1, Mesh, bl>>(parameter(distribute<wl>(m, l.weight.value())),
                                                                      parameter(distribute<bl>(m, l.bias.value())));
}

/// @brief A copy of `l` whose weight is split by rows along `Axis` (W [in/n, out], b
/// replicated): fed a column-split input, its product is a partial sum over `Axis`, which
/// the bias addition reduces (one all_reduce).
template <fixed_string Axis, class T, class Mesh>
auto row_parallel(const Mesh& m, const linear<T>& l) {
  using wl = layout<split<Axis>, replicate>;
  using bl = layout<replicate>;
  return linear<T, dtensor<T, 2, Mesh, wl>, dtensor<T, 1, Mesh, bl>>(parameter(distribute<wl>(m, l.weight.value())),
                                                                      parameter(distribute<bl>(m, l.bias.value())));
}

namespace detail_tp {
template <class... Layers>
constexpr std::size_t linears_before(std::size_t i) {
  constexpr bool is_linear[] = {is_local_linear_v<Layers>..., false};
  std::size_t n = 0;
  for (std::size_t k = 0; k < i; ++k) n += is_linear[k];
  return n;
}

template <fixed_string Axis, std::size_t Ordinal, class Mesh, class Layer>
auto convert(const Mesh& m, const Layer& layer) {
  if constexpr (is_local_linear_v<Layer>) {
    if constexpr (Ordinal % 2 == 0) return column_parallel<Axis>(m, layer);
    else return row_parallel<Axis>(m, layer);
  } else {
    static_assert(std::is_empty_v<Layer> || std::is_base_of_v<stateless, Layer>,
                  "pdo: tensor_parallel: the model may hold linear layers and layers without parameters (activations); "
                  "split other layers' parameters explicitly");
    return layer;
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
  static_assert(Mesh::has_axis(Axis.view()), "pdo: tensor_parallel: the mesh has no axis of that name");
  static_assert(detail_tp::linears_before<Layers...>(sizeof...(Layers)) % 2 == 0,
                "pdo: tensor_parallel: the model needs linear layers in column/row pairs (an even number), so that "
                "its output is not left split along the tensor-parallel axis");
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return sequential(detail_tp::convert<Axis, detail_tp::linears_before<Layers...>(I)>(m, std::get<I>(model.layers()))...);
  }(std::index_sequence_for<Layers...>{});
}

}  // namespace pdo::nn
