// pdo/comm/threads/local_group.hpp: collectives among threads of one process over shared memory.
#pragma once

#include <pdo/comm/barrier.hpp>
#include <pdo/comm/communicator_concept.hpp>
#include <pdo/core/config.hpp>
#include <pdo/core/copy_elements.hpp>
#include <pdo/core/dtype.hpp>
#include <pdo/core/error.hpp>
#include <pdo/core/shape.hpp>
#include <pdo/kernels/place_system.hpp>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <utility>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

namespace pdo::detail {

/// @brief Elementwise `acc[i] = op(acc[i], src[i])`, written so the compiler vectorises it.
template <class T>
void reduce_into(T* __restrict acc, const T* __restrict src, std::size_t n, reduce_op op) {
  switch (op) {
    case reduce_op::sum:
      for (std::size_t i = 0; i < n; ++i) acc[i] += src[i];
      break;
    case reduce_op::max:
      for (std::size_t i = 0; i < n; ++i) acc[i] = nan_max(acc[i], src[i]);
      break;
    case reduce_op::min:
      for (std::size_t i = 0; i < n; ++i) acc[i] = nan_min(acc[i], src[i]);
      break;
  }
}

/// @brief `dst[lo, hi) = op over k of srcs[k][lo, hi)`, summed in the order of `srcs`
/// (fixed, so results are bitwise reproducible), then copied to every `dsts[k]`.
/// Works block by block through a buffer that stays in L1.
template <class T>
void reduce_blocks(std::span<const T* const> srcs, std::span<T* const> dsts, std::size_t lo, std::size_t hi,
                   reduce_op op) {
  constexpr std::size_t block = 2048;
  alignas(64) T acc[block];
  for (std::size_t b = lo; b < hi; b += block) {
    const std::size_t n = std::min(block, hi - b);
    copy_elements(acc, srcs[0] + b, n);
    for (std::size_t k = 1; k < srcs.size(); ++k) reduce_into(acc, srcs[k] + b, n, op);
    for (T* d : dsts) copy_elements(d + b, acc, n);
  }
}

/// @brief `sum[0, n) = srcs[0][b + i] + srcs[1][b + i] + ...`, added in the order of `srcs`
/// (that of reduce_in_place and reduce_blocks, so the sum is the all_reduce's, bitwise).
template <class T>
void sum_block(T* __restrict sum, std::span<const T* const> srcs, std::size_t b, std::size_t n) {
  const T* __restrict first = srcs[0] + b;
  if (srcs.size() == 1) {
    copy_elements(sum, first, n);
    return;
  }
  const T* __restrict second = srcs[1] + b;
#pragma omp simd
  for (std::size_t i = 0; i < n; ++i) sum[i] = first[i] + second[i];
  for (std::size_t k = 2; k < srcs.size(); ++k) reduce_into(sum, srcs[k] + b, n, reduce_op::sum);
}

/// @brief In place over `bufs` (N buffers): `bufs[k][i] = op over k of bufs[k][i]` for i in
/// [lo, hi), in one pass: N reads and N writes per element, summed in buffer order.
template <std::size_t N, class T, class Op>
void reduce_in_place(T* const* bufs, std::size_t lo, std::size_t hi, Op op) {
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    T* const b[N] = {bufs[K]...};
    PDO_IVDEP
    for (std::size_t i = lo; i < hi; ++i) {
      T v = b[0][i];
      ((v = K == 0 ? v : op(v, b[K][i])), ...);
      ((b[K][i] = v), ...);
    }
  }(std::make_index_sequence<N>{});
}

/// @brief reduce_in_place for any number of buffers and any reduce_op: one fused pass
/// for up to four buffers (the memory-traffic limit), blocks through an L1-resident
/// accumulator beyond.
template <class T>
void reduce_in_place(std::span<T* const> bufs, std::size_t lo, std::size_t hi, reduce_op op) {
  auto with_op = [&](auto run) {
    switch (op) {
      case reduce_op::sum: return run([](T a, T b) { return a + b; });
      case reduce_op::max: return run([](T a, T b) { return nan_max(a, b); });
      case reduce_op::min: return run([](T a, T b) { return nan_min(a, b); });
    }
  };
  switch (bufs.size()) {
    case 1: return;
    case 2: return with_op([&](auto f) { reduce_in_place<2>(bufs.data(), lo, hi, f); });
    case 3: return with_op([&](auto f) { reduce_in_place<3>(bufs.data(), lo, hi, f); });
    case 4: return with_op([&](auto f) { reduce_in_place<4>(bufs.data(), lo, hi, f); });
    default:
      reduce_blocks<T>(std::span<const T* const>(bufs.data(), bufs.size()), bufs, lo, hi, op);
  }
}

/// @brief The part of [0, n) that member `me` of `members` works on, cut at 64-byte
/// boundaries so no two members write the same cache line.
template <class T>
std::pair<std::size_t, std::size_t> work_range(std::size_t n, std::size_t members, std::size_t me) {
  constexpr std::size_t align = std::max<std::size_t>(1, 64 / sizeof(T));
  const std::size_t units = (n + align - 1) / align;
  const std::size_t lo = std::min(n, chunk_offset(units, members, me) * align);
  const std::size_t hi = std::min(n, (chunk_offset(units, members, me) + chunk_size(units, members, me)) * align);
  return {lo, hi};
}

/// @brief How a collective call is named in a mismatch: "all_reduce(sum) of f32",
/// "broadcast of u16", "barrier". The element is its kind ('f' floating point, 'i' signed,
/// 'u' unsigned; 0 for none) and its bits, so types of one representation (long and long
/// long of 8 bytes) name one call. `op` is a reduce_op, or -1 for none.
PDO_NOINLINE inline std::string collective_call_text(std::string_view collective, char element_kind, std::size_t element_bytes, int op) {
  std::string text(collective);
  if (op >= 0) text += "(" + std::string(op_name(static_cast<reduce_op>(op))) + ")";
  if (element_kind == 0) return text;
  return text + " of " + element_kind + std::to_string(8 * element_bytes);
}

/// @brief The kind of element T in a call text: 'f', 'i' or 'u'.
template <class T>
constexpr char element_kind() {
  return std::is_floating_point_v<T> ? 'f' : std::is_signed_v<T> ? 'i' : 'u';
}

/// @brief A code for the call text `call` (its bytes hashed), to compare calls between processes.
constexpr std::size_t collective_code(std::string_view call) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : call) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return static_cast<std::size_t>(h);
}

/// @brief The call text of a collective over elements of type T.
template <class T>
std::string collective_call_text(std::string_view collective, int op = -1) {
  return collective_call_text(collective, element_kind<T>(), sizeof(T), op);
}

/// @brief The members of one group that live in this process, and the shared slots
/// through which they see each other's buffers. Every collective is called by all
/// `size()` members at once, each from its own thread, with its own member index.
///
/// Protocol: publish the buffers and what was called (the collective, its element type,
/// its reduction), barrier, check that every member called the same and that the
/// arguments agree (all members reach the same verdict from the same slots, so a mismatch
/// is an error on every member, never a hang), do this member's share of the work, barrier.
class local_group {
 public:
  /// @param part_of_larger the members are this process's part of a group over several
  /// processes (see group_barrier)
  explicit local_group(std::vector<std::string> member_names, bool part_of_larger = false)
      : names_(std::move(member_names)),
        slots_(names_.size()),
        barrier_(static_cast<std::uint32_t>(names_.size()), &names_, part_of_larger),
        departed_(names_.size(), false),
        part_of_larger_(part_of_larger) {}

  [[nodiscard]] std::size_t size() const { return names_.size(); }
  [[nodiscard]] const std::string& name(std::size_t member) const { return names_[member]; }

  /// @brief A plain barrier of the members (a step inside another group's collective).
  void barrier() { barrier_.arrive_and_wait(); }
  /// @brief The barrier collective: an error on every member when another called a
  /// different collective.
  void barrier(std::size_t me) {
    slot s;
    s.collective = "barrier";
    publish(me, s);
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_same_call();
  }

  /// @brief Wakes every member blocked in this group with an error; see reset().
  void abort() {
    barrier_.abort();
    std::lock_guard lock(mail_mutex_);
    mail_aborted_ = true;
    mail_ready_.notify_all();
  }
  /// @brief Member `member`'s task has ended: a collective of the group can no longer
  /// complete, so the members waiting in one, or entering one, get an error saying so
  /// (pdo::mismatch_error; pdo::communication_error for this process's part of a group over
  /// several processes, which ends the job), until reopen(). A send to it or a recv from it
  /// that waits, or comes later, fails alike; messages between the others go on.
  void leave(std::size_t member) {
    barrier_.abort_departed(static_cast<std::uint32_t>(member));
    std::lock_guard lock(mail_mutex_);
    departed_[member] = true;
    mail_ready_.notify_all();
  }
  /// @brief After leave(): the collectives are usable again (call once no member is inside one).
  void reopen() {
    barrier_.reset();
    std::lock_guard lock(mail_mutex_);
    departed_.assign(size(), false);
  }
  /// @brief Makes the group usable again once no member is inside a collective.
  void reset() {
    barrier_.reset();
    std::lock_guard lock(mail_mutex_);
    mail_aborted_ = false;
    departed_.assign(size(), false);
    mailbox_.clear();
  }

  template <class T>
  void all_reduce(std::size_t me, std::span<T> data, reduce_op op) {
    std::array<T*, 4> few{};  // allocated before the entry barrier: nothing throws between the barriers
    std::vector<T*> many(size() > few.size() ? size() : 0);
    T** bufs = many.empty() ? few.data() : many.data();
    publish(me, call<T>("all_reduce", data.data(), data.data(), data.size(), data.size(), op));
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_same_call();
    check_equal_counts("all_reduce", &slot::in_count, me);
    const auto [lo, hi] = work_range<T>(data.size(), size(), me);
    for (std::size_t k = 0; k < size(); ++k) bufs[k] = static_cast<T*>(slots_[k].out);
    reduce_in_place<T>(std::span<T* const>(bufs, size()), lo, hi, op);
  }

  /// @brief The sum over members of their `data`, handed block by block to every member's
  /// `consume` (see group_communicator::all_reduce_apply): member `me` sums its part of the
  /// elements (in member order, as all_reduce does) into a block that stays in L1 and hands
  /// each block to every member's consumer; on a place of several cores, its part is cut
  /// again among them (the consumers take disjoint ranges).
  template <class T>
  void all_reduce_apply(std::size_t me, std::span<const T> data, const reduced_consumer<T>& consume) {
    std::array<const T*, 4> few{};  // allocated before the entry barrier: nothing throws between the barriers
    std::array<const reduced_consumer<T>*, 4> few_consumers{};
    std::vector<const T*> many(size() > few.size() ? size() : 0);
    std::vector<const reduced_consumer<T>*> many_consumers(many.size());
    const T** srcs = many.empty() ? few.data() : many.data();
    const reduced_consumer<T>** consumers = many.empty() ? few_consumers.data() : many_consumers.data();
    publish(me, call<T>("all_reduce_apply", data.data(), const_cast<reduced_consumer<T>*>(&consume), data.size(), data.size(), reduce_op::sum));
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_same_call();
    check_equal_counts("all_reduce_apply", &slot::in_count, me);
    for (std::size_t k = 0; k < size(); ++k) {
      srcs[k] = static_cast<const T*>(slots_[k].in);
      consumers[k] = static_cast<const reduced_consumer<T>*>(slots_[k].out);
    }
    const auto [lo, hi] = work_range<T>(data.size(), size(), me);
    struct job {
      std::span<const T* const> srcs;
      const reduced_consumer<T>* const* consumers;
      std::size_t lo, hi;
      /// @brief Elements [from, to): summed a block at a time, each block handed to every consumer.
      void run(std::size_t from, std::size_t to) const {
        constexpr std::size_t block = 2048;
        alignas(64) T sum[block];
        for (std::size_t b = from; b < to; b += block) {
          const std::size_t n = std::min(block, to - b);
          sum_block(sum, srcs, b, n);
          for (std::size_t k = 0; k < srcs.size(); ++k) (*consumers[k])(b, b + n, sum);
        }
      }
    };
    const job j{std::span<const T* const>(srcs, size()), consumers, lo, hi};
    const int threads = current_place_system().threads;  // the cores of the place whose lane calls
    if (threads > 1 && hi - lo >= parallel_grain) {
      run_team(threads, [](void* c, std::size_t t, std::size_t nt) {
        const job& j = *static_cast<const job*>(c);
        constexpr std::size_t line = std::max<std::size_t>(1, 64 / sizeof(T));  // parts cut at cache lines
        const auto [first, last] = team_part((j.hi - j.lo + line - 1) / line, t, nt);
        j.run(std::min(j.hi, j.lo + first * line), std::min(j.hi, j.lo + last * line));
      }, const_cast<job*>(&j));
    } else {
      j.run(lo, hi);
    }
  }

  /// @brief `out` (same size on every member) = the members' `in` concatenated in
  /// member order; inputs may differ in size.
  template <class T>
  void all_gather(std::size_t me, std::span<const T> in, std::span<T> out) {
    publish(me, call<T>("all_gather", in.data(), out.data(), in.size(), out.size()));
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_same_call();
    check_total("all_gather", me);
    std::size_t offset = 0;
    for (const slot& s : slots_) {
      copy_elements(out.data() + offset, static_cast<const T*>(s.in), s.in_count);
      offset += s.in_count;
    }
  }

  /// @brief `in` (same size on every member) reduced over members; member k keeps the
  /// k-th segment, whose size is its `out.size()`.
  template <class T>
  void reduce_scatter(std::size_t me, std::span<const T> in, std::span<T> out, reduce_op op) {
    std::vector<const T*> srcs(size());  // allocated before the entry barrier
    publish(me, call<T>("reduce_scatter", in.data(), out.data(), in.size(), out.size(), op));
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_same_call();
    check_equal_counts("reduce_scatter", &slot::in_count, me);
    check_total("reduce_scatter", me, /*outputs_sum_to_input=*/true);
    std::size_t offset = 0;
    for (std::size_t k = 0; k < me; ++k) offset += slots_[k].out_count;
    for (std::size_t k = 0; k < size(); ++k) srcs[k] = static_cast<const T*>(slots_[k].in) + offset;
    T* dst = out.data();
    reduce_blocks<T>(srcs, std::span<T* const>(&dst, 1), 0, out.size(), op);
  }

  template <class T>
  void broadcast(std::size_t me, std::span<T> data, std::size_t root) {
    publish(me, call<T>("broadcast", data.data(), data.data(), data.size(), root));
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_same_call();
    check_equal_counts("broadcast", &slot::in_count, me);
    for (const slot& s : slots_)
      if (s.out_count != root)
        fail_after_barrier("broadcast: members named different roots (" + counts_text(&slot::out_count) + ")");
    if (root >= size()) fail_after_barrier("broadcast: root " + std::to_string(root) + " is not a member of a group of " + std::to_string(size()));
    if (me != root) copy_elements(data.data(), static_cast<const T*>(slots_[root].in), data.size());
  }

  /// @brief Member i sends `in`'s i->j piece (send_counts[j] elements, pieces in member
  /// order) to member j, which receives recv_counts[i] elements from i, in member order.
  template <class T>
  void all_to_all(std::size_t me, std::span<const T> in, std::span<const std::size_t> send_counts, std::span<T> out,
                  std::span<const std::size_t> recv_counts) {
    slot s = call<T>("all_to_all", in.data(), out.data(), in.size(), out.size());
    s.send_counts = send_counts.data();
    s.recv_counts = recv_counts.data();
    s.counts_size = send_counts.size() == recv_counts.size() ? send_counts.size() : 0;
    publish(me, s);
    barrier_.arrive_and_wait();
    const closing_barrier closing(barrier_);
    check_same_call();
    check_all_to_all(me);
    std::size_t out_offset = 0;
    for (std::size_t i = 0; i < size(); ++i) {
      const slot& src = slots_[i];
      std::size_t in_offset = 0;
      for (std::size_t j = 0; j < me; ++j) in_offset += src.send_counts[j];
      copy_elements(out.data() + out_offset, static_cast<const T*>(src.in) + in_offset, recv_counts[i]);
      out_offset += recv_counts[i];
    }
  }

  /// @brief Blocks until member `to` has received `data` with a matching recv.
  template <class T>
  void send(std::size_t me, std::span<const T> data, std::size_t to, int tag) {
    check_peer("send", me, to, tag);
    std::unique_lock lock(mail_mutex_);
    const auto mine = post_for({me, to, tag});
    mine->data = data.data();
    mine->count = data.size();
    mine->posted = true;
    mail_ready_.notify_all();
    mail_ready_.wait(lock, [&] { return mine->done || mail_aborted_ || departed_[to]; });
    if (!mine->done) {  // withdraw the post: its buffer is about to go away
      if (auto it = mailbox_.find({me, to, tag}); it != mailbox_.end() && it->second == mine) mailbox_.erase(it);
      if (mail_aborted_) throw collective_aborted("send aborted: another place of the group failed");
      peer_left("send", "a recv from", me, to, tag);
    }
    if (!mine->problem.empty()) throw mismatch_error(mine->problem);
  }

  /// @brief Receives exactly `data.size()` elements from member `from` (an error on both
  /// sides when the sizes differ).
  template <class T>
  void recv(std::size_t me, std::span<T> data, std::size_t from, int tag) {
    check_peer("recv", me, from, tag);
    std::unique_lock lock(mail_mutex_);
    const auto theirs = post_for({from, me, tag});
    mail_ready_.wait(lock, [&] { return mail_aborted_ || theirs->posted || departed_[from]; });
    if (mail_aborted_) throw collective_aborted("recv aborted: another place of the group failed");
    if (!theirs->posted) {  // the sender's task ended without this send: drop the empty post
      if (auto it = mailbox_.find({from, me, tag}); it != mailbox_.end() && it->second == theirs) mailbox_.erase(it);
      peer_left("recv", "a send to", me, from, tag);
    }
    mailbox_.erase({from, me, tag});  // consumed: the next send with this key makes a new post
    if (theirs->count != data.size())
      theirs->problem = "send/recv: " + names_[from] + " sent " + std::to_string(theirs->count) + " elements with tag " +
                        std::to_string(tag) + " but " + names_[me] + " expects " + std::to_string(data.size());
    else
      copy_elements(data.data(), static_cast<const T*>(theirs->data), data.size());
    theirs->done = true;
    mail_ready_.notify_all();
    if (!theirs->problem.empty()) throw mismatch_error(theirs->problem);
  }

  /// @brief Whether member `member`'s task has ended (leave) since the last reopen().
  [[nodiscard]] bool has_left(std::size_t member) const {
    std::lock_guard lock(mail_mutex_);
    return departed_[member];
  }
  /// @brief The error of a send or recv whose peer's task ended without the matching call
  /// (throw_member_left, as the barrier's): "recv aborted: the task of place cpu:1 ended
  /// without a send to cpu:0 with tag 7 ...".
  [[noreturn]] PDO_NOINLINE void peer_left(const char* op, const char* missing, std::size_t me, std::size_t peer, int tag) const {
    throw_member_left(std::string(op) + " aborted: the task of place " + names_[peer] + " ended without " + missing + " " + names_[me] +
                          " with tag " + std::to_string(tag) + " (every send needs a matching recv)",
                      part_of_larger_);
  }

 private:
  struct slot {
    const void* in = nullptr;
    void* out = nullptr;
    std::size_t in_count = 0;
    std::size_t out_count = 0;
    const std::size_t* send_counts = nullptr;
    const std::size_t* recv_counts = nullptr;
    std::size_t counts_size = 0;
    std::string_view collective;  ///< what the member called
    char element_kind = 0;        ///< its element type (see collective_call_text; 0 for a barrier)
    std::size_t element_bytes = 0;
    int op = -1;  ///< its reduce_op, or -1
  };
  struct post {
    const void* data = nullptr;
    std::size_t count = 0;
    bool posted = false;
    bool done = false;
    std::string problem;
  };

  void publish(std::size_t me, const slot& s) { slots_[me] = s; }

  /// @brief `s` marked as a call of `collective` over elements of type T (reducing with `op`).
  template <class T>
  static slot call(std::string_view collective, const void* in, void* out, std::size_t in_count, std::size_t out_count, int op = -1) {
    slot s;
    s.in = in;
    s.out = out;
    s.in_count = in_count;
    s.out_count = out_count;
    s.collective = collective;
    s.element_kind = element_kind<T>();
    s.element_bytes = sizeof(T);
    s.op = op;
    return s;
  }
  template <class T>
  static slot call(std::string_view collective, const void* in, void* out, std::size_t in_count, std::size_t out_count, reduce_op op) {
    return call<T>(collective, in, out, in_count, out_count, static_cast<int>(op));
  }

  static std::string call_text(const slot& s) { return collective_call_text(s.collective, s.element_kind, s.element_bytes, s.op); }

  /// @brief An error on every member when the members called different collectives, or one
  /// over another element type or with another reduction.
  PDO_NOINLINE void check_same_call() const {
    const slot& first = slots_[0];
    for (const slot& s : slots_)
      if (s.collective != first.collective || s.element_kind != first.element_kind || s.element_bytes != first.element_bytes || s.op != first.op) {
        std::string calls;
        for (std::size_t k = 0; k < size(); ++k) calls += (k ? ", " : "") + names_[k] + " in " + call_text(slots_[k]);
        fail_after_barrier(std::string(first.collective) +
                           ": the members of the group called different collectives (" + calls +
                           "); every member of a group must call the same collectives, over the same element type, in the same order");
      }
  }

  using mail_key = std::tuple<std::size_t, std::size_t, int>;  ///< from, to, tag

  /// @brief The post for `key`, made by whichever of sender and receiver comes first.
  std::shared_ptr<post> post_for(const mail_key& key) {
    auto& slot = mailbox_[key];
    if (!slot) slot = std::make_shared<post>();
    return slot;
  }

  void check_peer(const char* op, std::size_t me, std::size_t peer, int tag) const {
    if (peer >= size() || peer == me || tag < 0)
      throw communication_error(std::string(op) + ": " + names_[me] + " named member " + std::to_string(peer) +
                                " with tag " + std::to_string(tag) + "; the peer must be another member of the group of " +
                                std::to_string(size()) + " and the tag non-negative");
  }

  /// @brief The error every member of a collective finds alike; the closing barrier of
  /// the collective is passed as the exception leaves its scope.
  [[noreturn]] static void fail_after_barrier(const std::string& what) { throw mismatch_error(what); }

  std::string counts_text(std::size_t slot::*field) const {
    std::string text;
    for (std::size_t k = 0; k < size(); ++k)
      text += (k ? ", " : "") + names_[k] + ": " + std::to_string(slots_[k].*field);
    return text;
  }

  void check_equal_counts(const char* op, std::size_t slot::*field, std::size_t) {
    for (const slot& s : slots_)
      if (s.*field != slots_[0].*field)
        fail_after_barrier(std::string(op) + ": members called it with different sizes (" + counts_text(field) + ")");
  }

  void check_total(const char* op, std::size_t, bool outputs_sum_to_input = false) {
    std::size_t total = 0;
    if (outputs_sum_to_input) {
      for (const slot& s : slots_) total += s.out_count;
      if (total != slots_[0].in_count)
        fail_after_barrier(std::string(op) + ": outputs add up to " + std::to_string(total) +
                           " elements but the input has " + std::to_string(slots_[0].in_count) + " (" +
                           counts_text(&slot::out_count) + ")");
      return;
    }
    for (const slot& s : slots_) total += s.in_count;
    for (const slot& s : slots_)
      if (s.out_count != total)
        fail_after_barrier(std::string(op) + ": inputs add up to " + std::to_string(total) +
                           " elements but outputs hold (" + counts_text(&slot::out_count) + ")");
  }

  void check_all_to_all(std::size_t) {
    for (std::size_t i = 0; i < size(); ++i) {
      const slot& si = slots_[i];
      std::size_t sent = 0, received = 0;
      if (si.counts_size != size())
        fail_after_barrier("all_to_all: " + names_[i] + " gave send and receive counts that are not one per member of a group of " +
                           std::to_string(size()));
      for (std::size_t j = 0; j < size(); ++j) {
        sent += si.send_counts[j];
        received += si.recv_counts[j];
      }
      if (sent != si.in_count || received != si.out_count)
        fail_after_barrier("all_to_all: " + names_[i] + "'s counts do not add up to its buffers");
    }
    for (std::size_t i = 0; i < size(); ++i)
      for (std::size_t j = 0; j < size(); ++j)
        if (slots_[i].send_counts[j] != slots_[j].recv_counts[i])
          fail_after_barrier("all_to_all: " + names_[i] + " sends " + std::to_string(slots_[i].send_counts[j]) +
                             " elements to " + names_[j] + ", which expects " +
                             std::to_string(slots_[j].recv_counts[i]));
  }

  std::vector<std::string> names_;
  std::vector<slot> slots_;
  group_barrier barrier_;

  mutable std::mutex mail_mutex_;
  std::condition_variable mail_ready_;
  std::map<mail_key, std::shared_ptr<post>> mailbox_;
  bool mail_aborted_ = false;
  std::vector<bool> departed_;  ///< the members whose task has ended since the last reopen() (see leave)
  const bool part_of_larger_;
};

}  // namespace pdo::detail
