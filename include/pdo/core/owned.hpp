// pdo/core/owned.hpp: shared ownership of objects of many types through one control block type.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

namespace pdo::detail {

/// @brief Owns a new `Derived` (made from `args`) through a shared_ptr whose control block is
/// the same type for every `Derived` of `Base`: a pointer to `Base` and a plain deleter
/// function, which destroys the object as the `Derived` it is (so `Base` needs no virtual
/// destructor). std::make_shared would compile a control block of a dozen functions for each
/// type, and the library makes objects of hundreds of types (an evaluation per expression, an
/// autograd node per value type, a holder per parameter type).
template <class Base, class Derived, class... Args>
std::shared_ptr<Derived> make_owned(Args&&... args) {
  static_assert(std::is_base_of_v<Base, Derived>, "pdo: make_owned: Derived is a Base");
  using deleter = void (*)(Base*);
  Derived* const made = new Derived(std::forward<Args>(args)...);
  // on failure (no memory for the control block) the deleter frees `made`
  std::shared_ptr<Base> owner(static_cast<Base*>(made), deleter{[](Base* b) { delete static_cast<Derived*>(b); }});
  return std::shared_ptr<Derived>(std::move(owner), made);
}

}  // namespace pdo::detail
