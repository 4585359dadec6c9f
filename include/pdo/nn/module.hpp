// pdo/nn/module.hpp: named parameters, seeded initialisation, and the module concept.
#pragma once

#include <pdo/autograd/variable.hpp>
#include <pdo/core/copy_elements.hpp>
#include <pdo/core/owned.hpp>
#include <pdo/core/views.hpp>
#include <pdo/exec/mesh_ops.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace pdo::nn {

/// @brief The random source of initialisation: the same seed gives the same parameters
/// on every place and every run.
using rng = std::mt19937_64;

/// @brief One named parameter of a model, whatever its rank and kind (a local tensor, or a
/// dtensor whose shards live on the places of this process): its values and its gradient
/// as blocks of memory (one for a tensor, one per local shard for a dtensor), and the hook
/// backward calls when the gradient is complete. Copies refer to the same parameter.
template <class T>
class parameter_ref {
 public:
  /// @brief Refers to `v` (a var of a tensor or dtensor of T) under `name`; `v`'s node is shared, not copied.
  template <class V>
  parameter_ref(std::string name, var<V> v) : name_(std::move(name)), impl_(pdo::detail::own_as<base>(new holder<V>(std::move(v)))) {}
  /// @brief Rejects a plain tensor or dtensor given as a parameter: an optimizer updates vars
  /// that backward gives gradients to.
  template <class X>
    requires(is_tensor_v<X> || is_dtensor_v<X>)
  parameter_ref(std::string, const X&) {
    static_assert(pdo::detail::always_false<X>,
                  "pdo: an optimizer's parameter is a var that backward gives a gradient to, not a plain tensor: make it one, "
                  "auto w = pdo::parameter(tensor), use w in the model and give w here");
  }

  /// @brief The parameter's name, prefixed as the model listed it ("0.weight").
  [[nodiscard]] const std::string& name() const { return name_; }
  /// @brief Whether `other` refers to the same parameter (the same var), whatever its name
  /// and however each was obtained (a model's parameters(), an optimizer's copy of them).
  [[nodiscard]] bool same_parameter(const parameter_ref& other) const { return impl_->identity() == other.impl_->identity(); }
  /// @brief The values, one block per tensor or local shard.
  [[nodiscard]] std::vector<std::span<T>> value_blocks() const { return impl_->value_blocks(); }
  /// @brief Zero-filled state for each block (an optimizer's moments), each in the memory
  /// of the place that holds the block.
  [[nodiscard]] std::vector<tensor<T, 1>> zero_state() const { return impl_->zero_state(); }
  /// @brief The gradient's blocks (none when backward has given no gradient).
  [[nodiscard]] std::vector<std::span<T>> grad_blocks() const { return impl_->grad_blocks(); }
  /// @brief The place whose memory holds each block (null: host memory), for the kernels
  /// that update them.
  [[nodiscard]] std::vector<detail::place_state*> block_places() const { return impl_->block_places(); }
  /// @brief Where one of this process's blocks sits in the whole parameter: the mesh place
  /// that holds it, its offset and extents, and whether that place is the one that writes it
  /// to a checkpoint (false for a replica of a block another place writes).
  struct block_position {
    std::size_t place = 0;                  ///< the index of the holding place in the parameter's mesh (0 for a local parameter)
    std::vector<std::size_t> offset;  ///< where the block starts in the whole parameter, one index per dim
    std::vector<std::size_t> shape;   ///< the block's extents, one per dim
    bool write = true;                       ///< false for a replica along an axis the layout does not split
  };
  /// @brief One position per value block, in the order of value_blocks(); empty for a dtensor
  /// laid out with pending sums (partial), whose blocks are not parts of its value.
  [[nodiscard]] std::vector<block_position> block_positions() const { return impl_->block_positions(); }
  /// @brief The places of a dtensor parameter's mesh (every process's, in mesh order); empty
  /// for a local parameter.
  [[nodiscard]] std::vector<any_place> mesh_places() const { return impl_->mesh_places(); }
  /// @brief Whether the parameter is a dtensor (false for a local pdo::tensor parameter).
  [[nodiscard]] bool distributed() const { return impl_->is_distributed; }
  /// @brief Whether the parameter is a dtensor laid out with pending sums (partial).
  [[nodiscard]] bool partial() const { return impl_->is_partial; }
  /// @brief The values of a local parameter (one block).
  [[nodiscard]] std::span<T> value() const { return single(impl_->value_blocks(), "value"); }
  /// @brief Whether backward has given the parameter a gradient (since its last zero_grad).
  [[nodiscard]] bool has_grad() const { return impl_->has_grad(); }
  /// @brief The gradient of a local parameter; empty when backward has given none.
  [[nodiscard]] std::span<T> grad() const {
    const auto blocks = impl_->grad_blocks();
    return blocks.empty() ? std::span<T>() : single(blocks, "grad");
  }
  /// @brief The elements of this process's blocks.
  [[nodiscard]] std::size_t size() const {
    std::size_t n = 0;
    for (const auto& b : impl_->value_blocks()) n += b.size();
    return n;
  }
  /// @brief The bytes of this process's blocks: size() * sizeof(T).
  [[nodiscard]] std::size_t bytes() const { return size() * sizeof(T); }
  /// @brief A local parameter's gradient, zero-filled first if there is none (a place with
  /// no samples still takes part in the gradient all_reduce).
  [[nodiscard]] std::span<T> grad_or_zeros() const { return impl_->grad_or_zeros(); }
  /// @brief The sum of the squares of the gradient's elements, added in double, over the whole parameter:
  /// a dtensor's over all its shards on every process, each element counted once whatever
  /// the layout (replicated blocks are not counted twice). 0 without a gradient. For a
  /// dtensor this is a collective: every process calls it.
  [[nodiscard]] double grad_squared_norm() const { return impl_->grad_squared_norm(); }
  /// @brief Each element of `v` becomes its largest value over the processes of a dtensor
  /// parameter's mesh (a collective of `op`: every process of the mesh calls it, passing its
  /// own); left as it is for a local parameter or a mesh of one process. How processes that
  /// save a model learn whether the one that wrote it failed, and wait for it.
  void max_over_processes(std::span<long long> v, const char* op) const { impl_->max_over_processes(v, op); }
  /// @brief Drops the parameter's gradient, so the next backward starts from none (see var::zero_grad).
  void zero_grad() const { impl_->zero_grad(); }
  /// @brief Has backward call `f()` once this parameter's gradient is complete; replaces any earlier hook.
  void on_gradient(std::function<void()> f) const { impl_->on_gradient(std::move(f)); }
  /// @brief For a local matrix (a pdo::tensor<T, 2>): has backward hand `f(a, g)` each
  /// contribution matmul(aᵀ, g) this parameter's gradient gets as a product's right operand,
  /// instead of adding it, when `f` returns true (false: backward adds it); an empty `f`
  /// removes the hook. Returns false, and sets nothing, for a parameter of another kind.
  bool on_product_gradient(std::function<bool(const tensor<T, 2>& a, const tensor<T, 2>& g)> f) const {
    return impl_->on_product_gradient(std::move(f));
  }
  /// @brief "f32[16, 8]" for a local parameter, "f32[16, 8]{split<tp>, replicate} on mesh(tp=2)" for a dtensor.
  [[nodiscard]] std::string shape_text() const { return impl_->shape_text(); }
  /// @brief The parameter's rank.
  [[nodiscard]] std::size_t rank() const { return impl_->extents().size(); }
  /// @brief The parameter's (global) extents.
  [[nodiscard]] std::vector<std::size_t> extents() const { return impl_->extents(); }
  /// @brief The parameter's (global) shape as a shape_t<R>; a pdo::shape_error when its rank is not R.
  template <std::size_t R>
  [[nodiscard]] shape_t<R> shape() const {
    const auto e = impl_->extents();
    if (e.size() != R)
      throw shape_error("parameter " + name_ + ": " + shape_text() + " has rank " + std::to_string(e.size()) + ", not " + std::to_string(R));
    shape_t<R> s{};
    std::copy(e.begin(), e.end(), s.begin());
    return s;
  }
  /// @brief Sets the parameter's (global) value to `values`, a host tensor of exactly its
  /// shape (a dtensor parameter takes each local shard's part). Any other shape is a
  /// pdo::shape_error naming the parameter and both shapes, before anything is written.
  template <std::size_t R>
  void assign(const tensor<T, R>& values) const {
    impl_->assign(values.data(), std::vector<std::size_t>(values.shape().begin(), values.shape().end()), name_);
  }
  /// @brief Sets the parameter's (global) value from its elements in row-major order, in host
  /// memory (as many as size_global()).
  void assign_flat(const T* values) const { impl_->assign(values, impl_->extents(), name_); }
  /// @brief The number of elements of the parameter's global value.
  [[nodiscard]] std::size_t size_global() const {
    std::size_t n = 1;
    for (auto e : impl_->extents()) n *= e;
    return n;
  }
  /// @brief The parameter's global value, row-major, in host memory (a dtensor parameter is
  /// gathered: every process of its mesh calls this together).
  [[nodiscard]] tensor<T, 1> global_values() const { return gather_state(impl_->value_tensors()); }
  /// @brief The global value, row-major in host memory, of state laid out as the parameter:
  /// one block per local block (an optimizer's moments, from zero_state()). A dtensor
  /// parameter's blocks are gathered by its layout (every process of its mesh calls this).
  [[nodiscard]] tensor<T, 1> gather_state(const std::vector<tensor<T, 1>>& blocks) const { return impl_->gather_state(blocks, name_); }
  /// @brief The inverse: each local block of `blocks` set to its part of `global` (host
  /// memory, row-major, the parameter's global size).
  void scatter_state(const T* global, std::vector<tensor<T, 1>>& blocks) const { impl_->scatter_state(global, blocks, name_); }

 private:
  std::span<T> single(const std::vector<std::span<T>>& blocks, const char* what) const {
    if (blocks.size() != 1)
      throw layout_error("parameter " + name_ + ": " + what + "(): the parameter has " + std::to_string(blocks.size()) +
                         " local blocks; use " + what + "_blocks()");
    return blocks[0];
  }
  struct base {
    /// @brief What the parameter's type says: whether it is a dtensor, laid out with pending sums.
    base(bool distributed, bool partial) : is_distributed(distributed), is_partial(partial) {}
    virtual ~base() = default;
    const bool is_distributed;
    const bool is_partial;
    virtual const void* identity() const = 0;
    virtual std::vector<std::span<T>> value_blocks() = 0;
    virtual std::vector<std::span<T>> grad_blocks() = 0;
    virtual bool has_grad() = 0;
    virtual std::vector<detail::place_state*> block_places() = 0;
    virtual std::vector<block_position> block_positions() = 0;
    virtual std::vector<any_place> mesh_places() = 0;
    virtual std::vector<tensor<T, 1>> zero_state() = 0;
    virtual std::span<T> grad_or_zeros() = 0;
    virtual double grad_squared_norm() = 0;
    virtual void max_over_processes(std::span<long long> v, const char* op) = 0;
    virtual void zero_grad() = 0;
    virtual void on_gradient(std::function<void()> f) = 0;
    virtual bool on_product_gradient(std::function<bool(const tensor<T, 2>&, const tensor<T, 2>&)> f) = 0;
    virtual std::string shape_text() = 0;
    virtual std::vector<std::size_t> extents() = 0;
    virtual void assign(const T* values, const std::vector<std::size_t>& shape, const std::string& name) = 0;
    virtual std::vector<tensor<T, 1>> value_tensors() = 0;
    virtual tensor<T, 1> gather_state(const std::vector<tensor<T, 1>>& blocks, const std::string& name) = 0;
    virtual void scatter_state(const T* global, std::vector<tensor<T, 1>>& blocks, const std::string& name) = 0;
  };
  template <class V>
  struct holder final : base {
    explicit holder(var<V> x) : base(var<V>::distributed, partial_layout()), v(std::move(x)) {}
    static constexpr bool partial_layout() {
      if constexpr (var<V>::distributed) return V::layout_value.npartial != 0;
      else return false;
    }
    var<V> v;
    const void* identity() const override { return v.node(); }
    template <class X>
    static std::vector<std::span<T>> blocks_of(X& value) {
      if constexpr (var<V>::distributed) {
        std::vector<std::span<T>> out;
        for (auto& shard : value.local_shards()) out.push_back(shard.span());
        return out;
      } else {
        return {value.span()};
      }
    }
    std::vector<std::span<T>> value_blocks() override { return blocks_of(v.value()); }
    std::vector<detail::place_state*> block_places() override {
      if constexpr (var<V>::distributed) {
        std::vector<detail::place_state*> out;
        for (const auto& shard : v.value().local_shards()) out.push_back(shard.where());
        return out;
      } else {
        return {v.value().where()};
      }
    }
    std::vector<block_position> block_positions() override {
      std::vector<block_position> out;
      if constexpr (var<V>::distributed) {
        const auto& x = v.value();
        constexpr detail::layout_value layout = V::layout_value;
        if (layout.npartial != 0) return out;
        for (std::size_t p : x.mesh().local_places()) {
          const auto offset = x.local_offset(p), shape = x.local_shape(p);
          out.push_back({p, {offset.begin(), offset.end()}, {shape.begin(), shape.end()}, detail::writes_block(x.mesh(), layout, p)});
        }
      } else {
        out.push_back({0, std::vector<std::size_t>(var<V>::rank, 0), extents(), true});
      }
      return out;
    }
    std::vector<any_place> mesh_places() override {
      if constexpr (var<V>::distributed) return v.value().mesh().places();
      else return {};
    }
    std::vector<tensor<T, 1>> zero_state() override {
      std::vector<tensor<T, 1>> out;
      if constexpr (var<V>::distributed) {
        for (const auto& shard : v.value().local_shards()) out.push_back(shard.template zeros_alike<T, 1>(shape_t<1>{shard.size()}));
      } else {
        out.push_back(v.value().template zeros_alike<T, 1>(shape_t<1>{v.value().size()}));
      }
      return out;
    }
    std::vector<std::span<T>> grad_blocks() override {
      return v.has_grad() ? blocks_of(v.grad()) : std::vector<std::span<T>>{};
    }
    bool has_grad() override { return v.has_grad(); }
    std::span<T> grad_or_zeros() override {
      if constexpr (var<V>::distributed) {
        throw layout_error("parameter: grad_or_zeros() is for local parameters; " + shape_text() + " is a dtensor");
      } else {
        if (!v.has_grad()) v.node()->grad.emplace(v.shape());
        return v.grad().span();
      }
    }
    double grad_squared_norm() override {
      if (!v.has_grad()) return 0;
      const auto& g = v.grad();
      if constexpr (var<V>::distributed) {
        // pending sums (a partial layout) added first: the squares are of the gradient's elements
        return detail::with_sums_done("grad_squared_norm", g, [](const auto& whole) {
          return detail::sum_of_squares(whole.mesh(), whole.layout_value, whole.shape(), whole.local_shards(), "grad_squared_norm");
        });
      } else {
        return detail::sum_of_squares(g.where(), g.data(), g.size());
      }
    }
    void max_over_processes(std::span<long long> s, const char* op) override {
      if constexpr (var<V>::distributed) detail::max_over_processes(v.value().mesh(), s, op);
    }
    void zero_grad() override { v.zero_grad(); }
    void on_gradient(std::function<void()> f) override { v.on_gradient(std::move(f)); }
    bool on_product_gradient(std::function<bool(const tensor<T, 2>&, const tensor<T, 2>&)> f) override {
      if constexpr (std::is_same_v<V, tensor<T, 2>>) {
        auto& hook = v.node()->product_gradient;
        if (!f) hook = nullptr;
        else
          hook = [f = std::move(f)](const void* a, const void* g) {
            return f(*static_cast<const tensor<T, 2>*>(a), *static_cast<const tensor<T, 2>*>(g));
          };
        return true;
      } else {
        return false;
      }
    }
    std::string shape_text() override {
      if constexpr (var<V>::distributed) return v.value().describe();
      else return describe(v.value());
    }
    std::vector<std::size_t> extents() override { return {v.shape().begin(), v.shape().end()}; }
    /// @brief The values as blocks of state (copies), for gather_state.
    std::vector<tensor<T, 1>> value_tensors() override {
      std::vector<tensor<T, 1>> out;
      auto flat = [](const auto& t) {
        tensor<T, 1> b = t.template zeros_alike<T, 1>(shape_t<1>{t.size()});
        detail::copy_bytes(b.where(), b.data(), t.where(), t.data(), t.bytes());
        return b;
      };
      if constexpr (var<V>::distributed) {
        for (const auto& shard : v.value().local_shards()) out.push_back(flat(shard));
      } else {
        out.push_back(flat(v.value()));
      }
      return out;
    }
    void check_blocks(const std::vector<tensor<T, 1>>& blocks, const std::string& name) {
      const auto values = value_blocks();
      bool fits = blocks.size() == values.size();
      for (std::size_t k = 0; fits && k < blocks.size(); ++k) fits = blocks[k].size() == values[k].size();
      if (!fits)
        throw shape_error("parameter " + name + ": " + shape_text() + ": " + std::to_string(blocks.size()) +
                          " blocks of state given, which are not laid out as its " + std::to_string(values.size()) + " local blocks");
    }
    tensor<T, 1> gather_state(const std::vector<tensor<T, 1>>& blocks, const std::string& name) override {
      check_blocks(blocks, name);
      auto flat = tensor<T, 1>::on_host({detail::volume(v.shape())});
      if constexpr (var<V>::distributed) {
        const auto& x = v.value();
        std::vector<tensor<T, var<V>::rank>> shards;
        for (std::size_t k = 0; k < blocks.size(); ++k) {
          auto& shard = shards.emplace_back(x.local_shards()[k].template zeros_alike<T, var<V>::rank>(x.local_shards()[k].shape()));
          detail::copy_bytes(shard.where(), shard.data(), blocks[k].where(), blocks[k].data(), blocks[k].bytes());
        }
        // pending sums (a partial layout) added first, as pdo::gather does
        const auto whole = detail::with_sums_done("gather", V(x.mesh(), x.shape(), std::move(shards)), [](const auto& d) {
          return detail::gather_blocks(d.mesh(), d.layout_value, d.shape(), d.local_shards(), "gather");
        });
        detail::copy_elements(flat.data(), whole.data(), whole.size());
      } else {
        detail::copy_bytes(nullptr, flat.data(), blocks[0].where(), blocks[0].data(), blocks[0].bytes());
      }
      return flat;
    }
    void scatter_state(const T* global, std::vector<tensor<T, 1>>& blocks, const std::string& name) override {
      check_blocks(blocks, name);
      if constexpr (var<V>::distributed) {
        auto host = tensor<T, var<V>::rank>::on_host(v.shape());
        detail::copy_elements(host.data(), global, host.size());
        const auto cut = detail::distribute_shards(v.value().mesh(), V::layout_value, host);
        for (std::size_t k = 0; k < blocks.size(); ++k)
          detail::copy_bytes(blocks[k].where(), blocks[k].data(), cut[k].where(), cut[k].data(), blocks[k].bytes());
      } else {
        detail::copy_bytes(blocks[0].where(), blocks[0].data(), nullptr, global, blocks[0].bytes());
      }
    }
    void assign(const T* values, const std::vector<std::size_t>& shape, const std::string& name) override {
      constexpr std::size_t r = var<V>::rank;
      if (shape != extents()) {
        const bool transposed = r == 2 && shape.size() == 2 && shape[0] == v.shape()[1] && shape[1] == v.shape()[0];
        throw shape_error("parameter " + name + ": " + shape_text() + " cannot take values of shape " + detail::format_extents(shape) +
                          (transposed ? ", its transpose (a PyTorch nn.Linear weight is [out, in], a pdo::nn::linear weight "
                                        "[in, out]: assign the transpose)"
                                      : ""));
      }
      shape_t<r> s{};
      std::copy(shape.begin(), shape.end(), s.begin());
      auto host = tensor<T, r>::on_host(s);
      detail::copy_elements(host.data(), values, host.size());
      if constexpr (var<V>::distributed) {
        const auto cut = detail::distribute_shards(v.value().mesh(), V::layout_value, host);
        for (auto&& [from, to] : detail::views::zip(cut, v.value().local_shards())) pdo::copy(from, to);
      } else {
        pdo::copy(host, v.value());
      }
    }
  };
  std::string name_;
  std::shared_ptr<base> impl_;
};

/// @brief A layer or model: callable on a var, listing its parameters with names.
template <class M, class T>
concept module = requires(const M& m) {
  { m.parameters(std::string()) } -> std::same_as<std::vector<parameter_ref<T>>>;
};

namespace init {

/// @brief A tensor of `shape` drawn uniformly from [-bound, bound), in the memory of the place
/// running the calling thread (drawn on the host, then copied up to a GPU place).
template <class T, std::size_t R>
tensor<T, R> uniform(const shape_t<R>& shape, T bound, rng& gen) {
  detail::place_state* const here = detail::current_place();
  const bool gpu = detail::on_gpu(here);
  tensor<T, R> t = gpu ? tensor<T, R>::on_host(shape) : tensor<T, R>(shape, detail::uninitialized);
  std::uniform_real_distribution<double> dist(-static_cast<double>(bound), static_cast<double>(bound));
  for (auto& x : t) x = static_cast<T>(dist(gen));
  if (gpu) return to_place(t, any_place(here->shared_from_this()));
  return t;
}

/// @brief PyTorch's default for linear and conv layers: U(-1/sqrt(fan_in), 1/sqrt(fan_in));
/// zeros for a fan_in of 0 (a layer of no inputs), as PyTorch's bias then.
template <class T, std::size_t R>
tensor<T, R> fan_in_uniform(const shape_t<R>& shape, std::size_t fan_in, rng& gen) {
  return uniform<T>(shape, fan_in == 0 ? T(0) : static_cast<T>(1.0 / std::sqrt(static_cast<double>(fan_in))), gen);
}

}  // namespace init

}  // namespace pdo::nn

namespace pdo::detail {

/// @brief What positions_among gives a parameter that `among` lacks.
inline constexpr std::size_t not_held = static_cast<std::size_t>(-1);

/// @brief For each of `these`, the index of the same parameter (parameter_ref::same_parameter)
/// in `among`, or not_held: where an optimizer, made for part of a model's parameters or for
/// them in another order, keeps each one's state.
template <class T>
std::vector<std::size_t> positions_among(const std::vector<nn::parameter_ref<T>>& these, const std::vector<nn::parameter_ref<T>>& among) {
  std::vector<std::size_t> out(these.size(), not_held);
  for (std::size_t i = 0; i < these.size(); ++i)
    for (std::size_t j = 0; j < among.size() && out[i] == not_held; ++j)
      if (these[i].same_parameter(among[j])) out[i] = j;
  return out;
}

}  // namespace pdo::detail
