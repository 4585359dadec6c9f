// pdo/core/views.hpp: the range views pdo's loops use to pair shards with places and number them:
// range-v3's (C++20's std::views in g++ 12 have neither zip nor enumerate). nvcc cannot compile
// range-v3's headers: its front end rewrites the conversion operator that range-v3's semiregular_box
// takes from its base into one naming the standard library's template parameter (`operator _Tp &`),
// which the host compiler rejects. Under nvcc the two views are pdo's own, with the same elements:
// tuples of references (zip) and (position, reference) pairs (enumerate).
#pragma once

#include <cstddef>
#include <iterator>
#include <ranges>
#include <tuple>
#include <utility>

#if !defined(__CUDACC__)
#include <range/v3/view/enumerate.hpp>
#include <range/v3/view/zip.hpp>
#endif

namespace pdo::detail::views {

#if !defined(__CUDACC__)

/// @brief The elements of several ranges side by side, as long as the shortest: `for (auto [p, shard] : zip(places, shards))`.
using ranges::views::zip;
/// @brief Each element with its position: `for (auto [k, x] : enumerate(r))`.
using ranges::views::enumerate;

#else

/// @brief zip's range: a tuple of iterators advanced together, ending with the shortest range.
template <std::ranges::view... Vs>
class zip_view : public std::ranges::view_interface<zip_view<Vs...>> {
 public:
  zip_view() = default;
  explicit zip_view(Vs... vs) : views_(std::move(vs)...) {}

  class iterator {
   public:
    using value_type = std::tuple<std::ranges::range_value_t<Vs>...>;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    explicit iterator(std::tuple<std::ranges::iterator_t<Vs>...> at) : at_(std::move(at)) {}
    auto operator*() const {
      return std::apply([](const auto&... it) { return std::tuple<std::ranges::range_reference_t<Vs>...>(*it...); }, at_);
    }
    iterator& operator++() {
      std::apply([](auto&... it) { (++it, ...); }, at_);
      return *this;
    }
    void operator++(int) { ++*this; }
    bool reached(const std::tuple<std::ranges::sentinel_t<Vs>...>& ends) const {
      return [&]<std::size_t... I>(std::index_sequence<I...>) {
        return ((std::get<I>(at_) == std::get<I>(ends)) || ...);
      }(std::index_sequence_for<Vs...>{});
    }

   private:
    std::tuple<std::ranges::iterator_t<Vs>...> at_;
  };
  struct sentinel {
    std::tuple<std::ranges::sentinel_t<Vs>...> ends;
    friend bool operator==(const iterator& it, const sentinel& s) { return it.reached(s.ends); }
  };

  iterator begin() {
    return iterator(std::apply([](auto&... v) { return std::tuple(std::ranges::begin(v)...); }, views_));
  }
  sentinel end() {
    return sentinel{std::apply([](auto&... v) { return std::tuple(std::ranges::end(v)...); }, views_)};
  }

 private:
  std::tuple<Vs...> views_;
};

template <class... Rs>
zip_view(Rs&&...) -> zip_view<std::views::all_t<Rs>...>;

/// @brief The elements of several ranges side by side, as long as the shortest.
inline constexpr auto zip = []<std::ranges::viewable_range... Rs>(Rs&&... rs) {
  return zip_view<std::views::all_t<Rs>...>(std::views::all(std::forward<Rs>(rs))...);
};

/// @brief Each element with its position (a std::size_t).
inline constexpr auto enumerate = []<std::ranges::viewable_range R>(R&& r) {
  return zip(std::views::iota(std::size_t{0}), std::forward<R>(r));
};

#endif

}  // namespace pdo::detail::views
