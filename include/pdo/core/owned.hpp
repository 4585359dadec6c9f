// pdo/core/owned.hpp: shared ownership of objects of many types through one control block type.
#pragma once

#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>

namespace pdo::detail {

/// @brief Owns `made` (a new `Derived`) through a shared_ptr to its `Base`, whose control
/// block is the same type for every `Derived` of `Base`: a pointer to `Base` and a plain
/// deleter function, which destroys the object as the `Derived` it is (so `Base` needs no
/// virtual destructor). std::make_shared, or a shared_ptr to `Derived`, would compile a
/// dozen functions for each type, and the library makes objects of hundreds of types (an
/// evaluation per expression, an autograd node per value type, a holder per parameter type).
/// If the control block cannot be allocated, `made` is freed and std::bad_alloc thrown.
template <class Base, class Derived>
std::shared_ptr<Base> own_as(Derived* made) {
  static_assert(std::is_base_of_v<Base, Derived>, "pdo: own_as: Derived is a Base");
  using deleter = void (*)(Base*);
  // on failure (no memory for the control block) the deleter frees `made`
  return std::shared_ptr<Base>(static_cast<Base*>(made), deleter{[](Base* b) { delete static_cast<Derived*>(b); }});
}

/// @brief A new copy of `value` (moved when an rvalue), owned through a shared_ptr to const
/// void: its handle and control block are one type for every value type (a leaf that owns
/// a dtensor would compile a shared_ptr of its own for each layout). Read it through a
/// pointer taken from get().
template <class T>
std::shared_ptr<const void> own_value(T&& value) {
  using V = std::remove_cvref_t<T>;
  using deleter = void (*)(const void*);
  const void* const made = new V(std::forward<T>(value));
  // on failure (no memory for the control block) the deleter frees `made`
  return std::shared_ptr<const void>(made, deleter{[](const void* p) { delete static_cast<const V*>(p); }});
}

/// @brief `n` default-made objects of type `T` in one allocation, freed with it: what
/// `std::unique_ptr<T[]>` does, in three functions where it compiles about twenty (its
/// tuple of pointer and deleter) for each `T`; an evaluation has one per expression type.
template <class T>
class owned_array {
 public:
  explicit owned_array(std::size_t n) : items_(new T[n]) {}
  owned_array(const owned_array&) = delete;
  owned_array& operator=(const owned_array&) = delete;
  ~owned_array() { delete[] items_; }
  [[nodiscard]] T& operator[](std::size_t i) const { return items_[i]; }

 private:
  T* items_;
};

}  // namespace pdo::detail
