// pdo/comm/staged_group.hpp: the groups of a mesh that mixes CPU and GPU places: the threads
// or MPI group of the mesh, with each GPU member's buffers staged through host memory
// (copied down before the collective, and its results copied back up after it).
#pragma once

#include <pdo/comm/host_group.hpp>
#include <pdo/core/dtype.hpp>
#include <pdo/place/copy.hpp>

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

namespace pdo::detail {

class staged_group {
 public:
  /// @brief Its buffers may be GPU memory (staged through host memory by the group).
  static constexpr bool device_buffers = true;
  /// @param places member m's place (null for members of other processes)
  staged_group(std::vector<std::shared_ptr<place_state>> places, std::shared_ptr<host_group> host)
      : places_(std::move(places)), host_(std::move(host)) {}

  [[nodiscard]] std::size_t size() const { return places_.size(); }
  /// @brief The threads or MPI group of the same members, which carries the collectives.
  [[nodiscard]] host_group& host() const { return *host_; }
  void abort() { host_->abort(); }
  void reset() { host_->reset(); }
  void barrier(std::size_t me) {
    visit_group(*host_, [&](auto& h) { h.barrier(me); });
  }

  template <class T>
  void all_reduce(std::size_t me, std::span<T> data, reduce_op op) {
    auto d = down(me, std::span<const T>(data));
    visit_group(*host_, [&](auto& h) { h.all_reduce(me, std::span<T>(d), op); });
    up(me, std::span<const T>(d), data);
  }
  template <class T>
  void all_gather(std::size_t me, std::span<const T> in, std::span<T> out) {
    auto i = down(me, in);
    std::vector<T> o(out.size());
    visit_group(*host_, [&](auto& h) { h.all_gather(me, std::span<const T>(i), std::span<T>(o)); });
    up(me, std::span<const T>(o), out);
  }
  template <class T>
  void reduce_scatter(std::size_t me, std::span<const T> in, std::span<T> out, reduce_op op) {
    auto i = down(me, in);
    std::vector<T> o(out.size());
    visit_group(*host_, [&](auto& h) { h.reduce_scatter(me, std::span<const T>(i), std::span<T>(o), op); });
    up(me, std::span<const T>(o), out);
  }
  template <class T>
  void broadcast(std::size_t me, std::span<T> data, std::size_t root) {
    auto d = down(me, std::span<const T>(data));
    visit_group(*host_, [&](auto& h) { h.broadcast(me, std::span<T>(d), root); });
    up(me, std::span<const T>(d), data);
  }
  template <class T>
  void all_to_all(std::size_t me, std::span<const T> in, std::span<const std::size_t> send_counts, std::span<T> out,
                  std::span<const std::size_t> recv_counts) {
    auto i = down(me, in);
    std::vector<T> o(out.size());
    visit_group(*host_, [&](auto& h) { h.all_to_all(me, std::span<const T>(i), send_counts, std::span<T>(o), recv_counts); });
    up(me, std::span<const T>(o), out);
  }
  template <class T>
  void send(std::size_t me, std::span<const T> data, std::size_t to, int tag) {
    auto d = down(me, data);
    visit_group(*host_, [&](auto& h) { h.send(me, std::span<const T>(d), to, tag); });
  }
  template <class T>
  void recv(std::size_t me, std::span<T> data, std::size_t from, int tag) {
    std::vector<T> d(data.size());
    visit_group(*host_, [&](auto& h) { h.recv(me, std::span<T>(d), from, tag); });
    up(me, std::span<const T>(d), data);
  }

 private:
  /// @brief Member `me`'s buffer `in` in host memory (a copy, whichever its place).
  template <class T>
  std::vector<T> down(std::size_t me, std::span<const T> in) const {
    std::vector<T> host(in.size());
    copy_bytes(nullptr, host.data(), places_[me].get(), in.data(), in.size_bytes());
    return host;
  }
  template <class T>
  void up(std::size_t me, std::span<const T> host, std::span<T> out) const {
    copy_bytes(places_[me].get(), out.data(), nullptr, host.data(), host.size_bytes());
  }

  std::vector<std::shared_ptr<place_state>> places_;
  std::shared_ptr<host_group> host_;
};

}  // namespace pdo::detail
