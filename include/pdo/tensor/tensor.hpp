// pdo/tensor/tensor.hpp: pdo::tensor, an owning dense row-major tensor on one place.
#pragma once

#include <pdo/core/copy_elements.hpp>
#include <pdo/core/dtype.hpp>
#include <pdo/core/error.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/memory/caching_allocator.hpp>
#include <pdo/place/copy.hpp>
#include <pdo/place/place_concept.hpp>

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <utility>

namespace pdo {

namespace detail {
/// @brief Tag: allocate without initialising the elements.
struct uninitialized_t {};
inline constexpr uninitialized_t uninitialized{};

/// @brief The place whose lane runs the calling thread, if any (a CPU or GPU place):
/// where tensors made without a place go.
inline place_state* current_tensor_place() { return current_place(); }
}  // namespace detail

/// @brief An owning, dense, row-major tensor on one place (the host when none is given).
/// Copies are deep copies on the same place; moves are cheap.
/// @tparam T an element type (pdo::element)
template <element T, std::size_t Rank>
class tensor {
 public:
  /// @brief Element type.
  using value_type = T;
  /// @brief Number of dims.
  static constexpr std::size_t rank = Rank;

  tensor() = default;
  /// @brief A zero-filled tensor in the memory of the place running the calling thread
  /// (inside a parallel_do block or on a place's lane: that place), else on the host.
  explicit tensor(const shape_t<Rank>& shape) : tensor(shape, detail::uninitialized) { fill(T{}); }
  /// @brief A zero-filled tensor in `place`'s memory.
  tensor(const shape_t<Rank>& shape, const any_place& place) : tensor(shape, place, detail::uninitialized) { fill(T{}); }
  /// @brief A tensor holding `values` in row-major order (placed as the one above).
  tensor(const shape_t<Rank>& shape, std::initializer_list<T> values) : tensor(shape, detail::uninitialized) {
    if (values.size() != size())
      throw shape_error("tensor: " + std::to_string(values.size()) + " values given for shape " +
                        detail::format_extents(shape) + " of " + std::to_string(size()) + " elements");
    detail::copy_bytes(place_.get(), data_, nullptr, values.begin(), bytes());
  }
  /// @brief Rejects at compile time a shape of another number of extents than the rank
  /// (else `tensor<float, 2>({4})` would be a tensor of shape [4, 0]).
  template <std::integral I, std::size_t N, class... Rest>
    requires(N != Rank)
  explicit tensor(const I (&)[N], Rest&&...) {
    static_assert(N == Rank, "pdo: tensor<T, Rank>: the shape needs one extent per dim, as many as the tensor's rank");
  }
  /// @brief Rejects at compile time values given with a shape of another number of extents
  /// than the rank.
  template <std::integral I, std::size_t N>
    requires(N != Rank)
  tensor(const I (&)[N], std::initializer_list<T>) {
    static_assert(N == Rank, "pdo: tensor<T, Rank>: the shape needs one extent per dim, as many as the tensor's rank");
  }
  /// @brief Rejects at compile time a shape of extents of mixed integer types (`{n, 4}`) of
  /// another number of extents than the rank.
  template <std::size_t N, class... Rest>
    requires(N != Rank)
  explicit tensor(const std::size_t (&)[N], Rest&&...) {
    static_assert(N == Rank, "pdo: tensor<T, Rank>: the shape needs one extent per dim, as many as the tensor's rank");
  }
  /// @brief Rejects at compile time values given with a shape of extents of mixed integer
  /// types of another number of extents than the rank.
  template <std::size_t N>
    requires(N != Rank)
  tensor(const std::size_t (&)[N], std::initializer_list<T>) {
    static_assert(N == Rank, "pdo: tensor<T, Rank>: the shape needs one extent per dim, as many as the tensor's rank");
  }
  /// @brief An uninitialised tensor, placed as the zero-filled one above (calling thread's place, else host).
  tensor(const shape_t<Rank>& shape, detail::uninitialized_t)
      : tensor(shape, detail::current_tensor_place() ? detail::current_tensor_place()->memory.get() : &host_allocator(),
               detail::current_tensor_place() ? detail::current_tensor_place()->shared_from_this() : nullptr) {}
  /// @brief An uninitialised tensor in `place`'s memory.
  tensor(const shape_t<Rank>& shape, const any_place& place, detail::uninitialized_t)
      : tensor(shape, &place.memory(), place.state()) {}

  /// @brief A deep copy in the same place's memory as `other` (empty if `other` is default-constructed).
  tensor(const tensor& other) {
    if (other.allocator_ == nullptr) return;  // a default-constructed tensor copies as one
    tensor copy(other.shape_, other.allocator_, other.place_);
    detail::copy_bytes(place_of(copy), copy.data_, place_of(other), other.data_, other.bytes());
    swap(copy);
  }
  /// @brief Takes `other`'s data and place; `other` is left empty, as if default-constructed.
  tensor(tensor&& other) noexcept { swap(other); }
  /// @brief Copy or move assignment (by value, then swap): a copy is deep, on the source's place.
  tensor& operator=(tensor other) noexcept {
    swap(other);
    return *this;
  }
  ~tensor() {
    if (allocator_ != nullptr) allocator_->deallocate(data_, bytes());
  }
  /// @brief Exchanges data, shape and place with `other`; no element is copied.
  void swap(tensor& other) noexcept {
    std::swap(shape_, other.shape_);
    std::swap(strides_, other.strides_);
    std::swap(data_, other.data_);
    std::swap(allocator_, other.allocator_);
    std::swap(place_, other.place_);
  }

  /// @brief The extents, one per dim.
  [[nodiscard]] const shape_t<Rank>& shape() const { return shape_; }
  /// @brief The extent of dim `dim` (not range-checked).
  [[nodiscard]] std::size_t extent(std::size_t dim) const { return shape_[dim]; }
  /// @brief Row-major strides, in elements: the last dim's is 1.
  [[nodiscard]] const std::array<std::ptrdiff_t, Rank>& strides() const { return strides_; }
  /// @brief The number of elements (1 for rank 0); 0 for a tensor with no storage (default
  /// constructed or moved from), of any rank.
  [[nodiscard]] std::size_t size() const { return allocator_ != nullptr ? detail::volume(shape_) : 0; }
  /// @brief The size of the data in bytes: size() * sizeof(T).
  [[nodiscard]] std::size_t bytes() const { return size() * sizeof(T); }
  /// @brief The first element, in the holding place's memory (a device pointer for GPU tensors).
  [[nodiscard]] T* data() { return data_; }
  /// @brief The first element, in the holding place's memory (a device pointer for GPU tensors).
  [[nodiscard]] const T* data() const { return data_; }
  /// @brief The elements in row-major order (host-readable only when !on_gpu()).
  [[nodiscard]] std::span<T> span() { return {data_, size()}; }
  /// @brief The elements in row-major order (host-readable only when !on_gpu()).
  [[nodiscard]] std::span<const T> span() const { return {data_, size()}; }
  /// @brief Iterator to the first element in row-major order (host-readable only when !on_gpu()).
  [[nodiscard]] T* begin() { return data_; }
  /// @brief Iterator past the last element.
  [[nodiscard]] T* end() { return data_ + size(); }
  /// @brief Iterator to the first element in row-major order (host-readable only when !on_gpu()).
  [[nodiscard]] const T* begin() const { return data_; }
  /// @brief Iterator past the last element.
  [[nodiscard]] const T* end() const { return data_ + size(); }
  /// @brief The place holding the data (nullptr for host tensors).
  [[nodiscard]] detail::place_state* where() const { return place_.get(); }
  /// @brief Whether the data is in a GPU's memory (the host cannot read it through data()).
  [[nodiscard]] bool on_gpu() const { return detail::on_gpu(place_.get()); }
  /// @brief The name of the place holding the data ("host" for host tensors).
  [[nodiscard]] std::string place_name() const { return place_ ? place_->name : std::string("host"); }

  /// @brief The element at `index` (one integer per dim); host memory only, no bounds check.
  template <class... Index>
    requires(std::integral<Index> && ...)
  [[nodiscard]] T& operator()(Index... index) {
    static_assert(sizeof...(Index) == Rank, "pdo: tensor(i, j, ...): give one index per dim of the tensor");
    if constexpr (sizeof...(Index) == Rank) return data_[offset_of(index...)];
    else return data_[0];  // the error was given: nothing more after it
  }
  /// @brief The element at `index` (one integer per dim); host memory only, no bounds check.
  template <class... Index>
    requires(std::integral<Index> && ...)
  [[nodiscard]] const T& operator()(Index... index) const {
    static_assert(sizeof...(Index) == Rank, "pdo: tensor(i, j, ...): give one index per dim of the tensor");
    if constexpr (sizeof...(Index) == Rank) return data_[offset_of(index...)];
    else return data_[0];  // the error was given: nothing more after it
  }

  /// @brief Sets every element to `value`, on the host or on the holding GPU.
  void fill(T value) {
    if (on_gpu()) detail::fill_bytes(place_.get(), data_, &value, sizeof(T), size());
    else std::fill_n(data_, size(), value);
  }

  /// @brief An uninitialised tensor in host memory, whichever thread asks.
  [[nodiscard]] static tensor on_host(const shape_t<Rank>& shape) { return tensor(shape, &host_allocator(), nullptr); }

  /// @brief A zero-filled tensor of another shape (and element type) in the same place's
  /// memory as this one (the host's for host tensors).
  template <element U = T, std::size_t R = Rank>
  [[nodiscard]] tensor<U, R> zeros_alike(const shape_t<R>& shape) const {
    tensor<U, R> t(shape, allocator_ != nullptr ? allocator_ : &host_allocator(), place_);
    t.fill(U{});
    return t;
  }

 private:
  template <element U, std::size_t R>
  friend class tensor;

  tensor(const shape_t<Rank>& shape, caching_allocator* allocator, std::shared_ptr<detail::place_state> place)
      : shape_(shape), allocator_(allocator), place_(std::move(place)) {
    const std::size_t n = detail::checked_volume(shape, "tensor", sizeof(T));  // before the strides: their products fit then
    strides_ = detail::row_major_strides(shape);
    data_ = static_cast<T*>(allocator_->allocate(n * sizeof(T)));
  }

  static detail::place_state* place_of(const tensor& t) { return t.place_.get(); }

  template <class... Index>
  std::size_t offset_of(Index... index) const {
    std::size_t offset = 0, d = 0;
    ((offset += static_cast<std::size_t>(index) * static_cast<std::size_t>(strides_[d++])), ...);
    return offset;
  }

  shape_t<Rank> shape_{};
  std::array<std::ptrdiff_t, Rank> strides_{};
  T* data_ = nullptr;
  caching_allocator* allocator_ = nullptr;
  std::shared_ptr<detail::place_state> place_;  ///< keeps the place's allocator alive
};

template <class T>
inline constexpr bool is_tensor_v = false;
template <class T, std::size_t Rank>
inline constexpr bool is_tensor_v<tensor<T, Rank>> = true;

namespace detail {
/// @brief The address by which the engine orders the tasks that use `t`'s storage: its data,
/// or for an empty tensor, which has none, the tensor itself. So the tasks of two empty
/// blocks are not ordered with, or cancelled by, each other, and the owner of an empty block
/// finds the tasks that use it.
template <class T, std::size_t Rank>
const void* storage_key(const tensor<T, Rank>& t) {
  return t.data() != nullptr ? static_cast<const void*>(t.data()) : static_cast<const void*>(&t);
}
}  // namespace detail

/// @brief "f32[10, 6]".
template <class T, std::size_t Rank>
std::string describe(const tensor<T, Rank>& t) {
  return std::string(detail::dtype_name<T>()) + detail::format_extents(t.shape());
}

/// @brief Copies `src` into `dst` (same shape), whatever places hold them: host, CPU or GPU
/// places (see pdo/place/copy.hpp for how GPU copies go). With copy_completion::queued a
/// copy between a GPU and host memory only queues on the GPU place's stream: keep both
/// tensors alive and untouched until that place synchronizes.
template <class T, std::size_t Rank>
void copy(const tensor<T, Rank>& src, tensor<T, Rank>& dst, copy_completion completion = copy_completion::host_safe,
          peer_copy how = peer_copy::automatic) {
  if (src.shape() != dst.shape())
    throw shape_error("copy: from " + describe(src) + " on " + src.place_name() + " to " + describe(dst) + " on " + dst.place_name() +
                      ": the shapes differ");
  detail::copy_bytes(dst.where(), dst.data(), src.where(), src.data(), src.bytes(), completion, how);
}

/// @brief A copy of `t` in `place`'s memory.
template <class T, std::size_t Rank>
tensor<T, Rank> to_place(const tensor<T, Rank>& t, const any_place& place, peer_copy how = peer_copy::automatic) {
  tensor<T, Rank> out(t.shape(), place, detail::uninitialized);
  copy(t, out, copy_completion::host_safe, how);
  return out;
}

/// @brief A copy of `t` in host memory (readable through data() whatever held `t`).
template <class T, std::size_t Rank>
tensor<T, Rank> to_host(const tensor<T, Rank>& t) {
  auto out = tensor<T, Rank>::on_host(t.shape());
  copy(t, out);
  return out;
}

}  // namespace pdo
