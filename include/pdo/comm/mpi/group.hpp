// pdo/comm/mpi/group.hpp: a group of places spread over MPI processes, one or more per process.
#pragma once

#include <pdo/comm/mpi/environment.hpp>
#include <pdo/comm/mpi/watch.hpp>
#include <pdo/comm/threads/local_group.hpp>
#include <pdo/core/copy_elements.hpp>
#include <pdo/core/error.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pdo::mpi::detail {

using pdo::detail::copy_elements;
using pdo::detail::local_group;

/// @brief What names a group in messages and matches it across processes.
struct group_identity {
  std::uint64_t id = 0;        ///< the same on every process (groups are made in one order everywhere)
  std::string label;           ///< "axis \"dp\" of mesh(dp=4)"
  std::chrono::duration<double> timeout{std::chrono::minutes(30)};  ///< how long a member waits for the others
};

/// @brief Keeps `buffer` alive for good: an MPI request given up after a timeout may still
/// write into it if the late process arrives.
template <class T>
void abandon(std::vector<T>&& buffer) {
  static auto* kept = new std::vector<std::vector<T>>();  // never freed, on purpose
  kept->push_back(std::move(buffer));
}

/// @brief The group's members are numbered in mesh order and live on increasing MPI
/// ranks; this process holds members [first, first + local size). Each collective
/// runs in three steps: the members of this process publish their buffers; the first
/// of them (the leader) exchanges what all members passed, so every process reaches
/// the same verdict on bad arguments (an error everywhere, never a hang); then the
/// members reduce among themselves through shared memory while the leader moves the
/// combined data between processes, and each member copies out its result.
///
/// The exchange is where the processes meet: it waits at most the group's timeout (see
/// watch), and a collective whose exchange times out throws pdo::collective_timeout on
/// every member that arrived, naming the ranks that did not; the group is unusable after.
class group {
 public:
  /// @param members_per_rank for each process of `comm` in rank order, its member count
  /// @param spans_mesh the group holds every place of its mesh (see fail())
  group(MPI_Comm comm, std::vector<std::size_t> members_per_rank, std::vector<std::string> member_names, bool spans_mesh,
        group_identity identity)
      : spans_mesh_(spans_mesh),
        comm_(set_errors_return(comm)),
        rank_(rank_in(comm_)),
        per_rank_(std::move(members_per_rank)),
        first_(first_of(rank_)),
        names_(std::move(member_names)),
        local_(local_names(), /*part_of_larger=*/true),
        args_(local_.size()),
        identity_(std::move(identity)),
        world_ranks_(world_ranks_of(comm_)) {}
  group(const group&) = delete;
  group& operator=(const group&) = delete;
  ~group() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    // a group given up after a timeout keeps its communicator: a request may still be on it
    if (!finalized && comm_ != MPI_COMM_NULL && broken_.empty()) MPI_Comm_free(&comm_);
  }

  [[nodiscard]] std::size_t size() const { return names_.size(); }

  /// @brief MPI errors on `comm` come back as codes (thrown as communication_error)
  /// instead of ending the job.
  static MPI_Comm set_errors_return(MPI_Comm comm) {
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    return comm;
  }
  [[nodiscard]] std::size_t first() const { return first_; }
  [[nodiscard]] local_group& local() { return local_; }
  /// MPI groups are never aborted: the other processes could not be told, and would wait
  /// in MPI calls for members that left (a failure there ends the job; see run_on_places).
  void abort() {}
  void reset() {}

  void barrier(std::size_t me) {
    exchange(me, std::vector<std::size_t>{}, "barrier", "barrier");
    local_.barrier();
  }

  template <class T>
  void all_reduce(std::size_t me, std::span<T> data, reduce_op op) {
    const std::size_t l = me - first();
    args_[l] = {data.data(), data.data()};
    const auto& counts = exchange(me, std::vector<std::size_t>{data.size()}, "all_reduce", pdo::detail::collective_call_text<T>("all_reduce", static_cast<int>(op)));
    for (std::size_t k = 0; k < size(); ++k)
      if (counts[3 * k + 1] != counts[1]) fail("all_reduce: members called it with different sizes (" + listing(counts, 3, 1) + ")");
    if (local_.size() > 1) local_.all_reduce(l, data, op);
    leader_step(l, [&] {
      pdo::mpi::detail::check(MPI_Allreduce(MPI_IN_PLACE, data.data(), pdo::mpi::detail::count(data.size(), "all_reduce"),
                                            datatype<T>(), op_of<T>(op), comm_),
                              "MPI_Allreduce");
    });
    if (l != 0) copy_elements(data.data(), static_cast<const T*>(args_[0].out), data.size());
    local_.barrier();
  }

  template <class T>
  void all_gather(std::size_t me, std::span<const T> in, std::span<T> out) {
    const std::size_t l = me - first();
    args_[l] = {in.data(), out.data()};
    const auto& counts = exchange(me, std::vector<std::size_t>{in.size(), out.size()}, "all_gather", pdo::detail::collective_call_text<T>("all_gather"));
    std::size_t total = 0;
    for (std::size_t k = 0; k < size(); ++k) total += counts[3 * k + 1];
    for (std::size_t k = 0; k < size(); ++k)
      if (counts[3 * k + 2] != total)
        fail("all_gather: inputs add up to " + std::to_string(total) + " elements but outputs hold (" + listing(counts, 3, 2) + ")");
    T* leader_out = static_cast<T*>(args_[0].out);
    copy_elements(leader_out + prefix(counts, 3, 1, me), in.data(), in.size());
    local_.barrier();
    leader_step(l, [&] {
      auto [rank_counts, displs] = rank_blocks(counts, 3, 1);
      pdo::mpi::detail::check(MPI_Allgatherv(MPI_IN_PLACE, 0, datatype<T>(), leader_out, rank_counts.data(), displs.data(),
                                             datatype<T>(), comm_),
                              "MPI_Allgatherv");
    });
    if (l != 0) copy_elements(out.data(), static_cast<const T*>(leader_out), out.size());
    local_.barrier();
  }

  template <class T>
  void reduce_scatter(std::size_t me, std::span<const T> in, std::span<T> out, reduce_op op) {
    const std::size_t l = me - first();
    args_[l] = {in.data(), out.data()};
    const auto& counts = exchange(me, std::vector<std::size_t>{in.size(), out.size()}, "reduce_scatter",
                                 pdo::detail::collective_call_text<T>("reduce_scatter", static_cast<int>(op)));
    std::size_t total = 0;
    for (std::size_t k = 0; k < size(); ++k) {
      if (counts[3 * k + 1] != counts[1]) fail("reduce_scatter: members called it with different sizes (" + listing(counts, 3, 1) + ")");
      total += counts[3 * k + 2];
    }
    if (total != counts[1])
      fail("reduce_scatter: outputs add up to " + std::to_string(total) + " elements but the input has " + std::to_string(counts[1]));
    // Sum this process's inputs first (each member a slice), then across processes.
    const T* send = in.data();
    std::vector<const T*> srcs(local_.size());
    if (local_.size() > 1) {
      if (l == 0) staging_.resize(in.size() * sizeof(T));
      local_.barrier();
      T* stage = reinterpret_cast<T*>(staging_.data());
      const auto [lo, hi] = pdo::detail::work_range<T>(in.size(), local_.size(), l);
      for (std::size_t k = 0; k < local_.size(); ++k) srcs[k] = static_cast<const T*>(args_[k].in);
      pdo::detail::reduce_blocks<T>(srcs, std::span<T* const>(&stage, 1), lo, hi, op);
      send = stage;
      local_.barrier();
    }
    const std::size_t block_offset = prefix(counts, 3, 2, first());
    leader_step(l, [&] {
      auto [rank_counts, displs] = rank_blocks(counts, 3, 2);
      const std::size_t mine = static_cast<std::size_t>(rank_counts[static_cast<std::size_t>(my_rank())]);
      result_.resize(mine * sizeof(T));
      pdo::mpi::detail::check(MPI_Reduce_scatter(send, result_.data(), rank_counts.data(), datatype<T>(), op_of<T>(op), comm_),
                              "MPI_Reduce_scatter");
    });
    copy_elements(out.data(), reinterpret_cast<const T*>(result_.data()) + (prefix(counts, 3, 2, me) - block_offset), out.size());
    local_.barrier();
  }

  template <class T>
  void broadcast(std::size_t me, std::span<T> data, std::size_t root) {
    const std::size_t l = me - first();
    args_[l] = {data.data(), data.data()};
    const auto& counts = exchange(me, std::vector<std::size_t>{data.size(), root}, "broadcast", pdo::detail::collective_call_text<T>("broadcast"));
    for (std::size_t k = 0; k < size(); ++k)
      if (counts[3 * k + 1] != counts[1] || counts[3 * k + 2] != counts[2])
        fail("broadcast: members called it with different sizes or roots (" + listing(counts, 3, 1) + "; roots " + listing(counts, 3, 2) + ")");
    if (root >= size()) fail("broadcast: root " + std::to_string(root) + " is not a member of a group of " + std::to_string(size()));
    local_.barrier();
    const int root_rank = rank_of(root);
    const bool root_here = root_rank == my_rank();
    T* source = static_cast<T*>(args_[root_here ? root - first() : 0].out);
    leader_step(l, [&] {
      pdo::mpi::detail::check(MPI_Bcast(source, pdo::mpi::detail::count(data.size(), "broadcast"), datatype<T>(), root_rank, comm_),
                              "MPI_Bcast");
    });
    if (data.data() != source) copy_elements(data.data(), static_cast<const T*>(source), data.size());
    local_.barrier();
  }

  template <class T>
  void all_to_all(std::size_t me, std::span<const T> in, std::span<const std::size_t> send_counts, std::span<T> out,
                  std::span<const std::size_t> recv_counts) {
    const std::size_t l = me - first();
    const std::size_t n = size();
    args_[l] = {in.data(), out.data()};
    // member k contributes: n send counts, n receive counts, and whether its own
    // arguments are consistent, so that every process fails alike on bad ones
    const bool shaped = send_counts.size() == n && recv_counts.size() == n;
    std::vector<std::size_t> mine(2 * n + 1, 0);
    if (shaped) {
      std::copy(send_counts.begin(), send_counts.end(), mine.begin());
      std::copy(recv_counts.begin(), recv_counts.end(), mine.begin() + static_cast<std::ptrdiff_t>(n));
      mine[2 * n] = std::accumulate(send_counts.begin(), send_counts.end(), std::size_t{0}) == in.size() &&
                    std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t{0}) == out.size();
    }
    exchange(me, std::vector<std::size_t>{}, "all_to_all", pdo::detail::collective_call_text<T>("all_to_all"));  // every member is in an all_to_all: the widths agree
    const auto& m = exchange_values(me, mine, "all_to_all");
    const std::size_t w = 2 * n + 1;
    auto sends = [&](std::size_t i, std::size_t j) { return m[i * w + j]; };
    auto recvs = [&](std::size_t j, std::size_t i) { return m[j * w + n + i]; };
    for (std::size_t k = 0; k < n; ++k)
      if (m[k * w + 2 * n] == 0)
        fail("all_to_all: " + names_[k] + "'s counts are not one per member or do not add up to its buffers");
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < n; ++j)
        if (sends(i, j) != recvs(j, i))
          fail("all_to_all: " + names_[i] + " sends " + std::to_string(sends(i, j)) + " elements to " + names_[j] +
               ", which expects " + std::to_string(recvs(j, i)));
    local_.barrier();
    const std::size_t ranks = per_rank_.size(), f = first(), nl = local_.size();
    auto offset_in = [&](std::size_t i, std::size_t j) {  // where piece i->j starts in member i's input
      std::size_t o = 0;
      for (std::size_t k = 0; k < j; ++k) o += sends(i, k);
      return o;
    };
    leader_step(l, [&] {
      // send block to rank q: for each member j of q, for each local member i: piece i->j
      std::vector<int> scount(ranks), sdispl(ranks), rcount(ranks), rdispl(ranks);
      std::size_t stotal = 0, rtotal = 0;
      for (std::size_t q = 0; q < ranks; ++q) {
        std::size_t s = 0, r = 0;
        for (std::size_t j = first_of(static_cast<int>(q)); j < first_of(static_cast<int>(q)) + per_rank_[q]; ++j)
          for (std::size_t i = f; i < f + nl; ++i) s += sends(i, j);
        for (std::size_t j = f; j < f + nl; ++j)
          for (std::size_t i = first_of(static_cast<int>(q)); i < first_of(static_cast<int>(q)) + per_rank_[q]; ++i) r += sends(i, j);
        scount[q] = pdo::mpi::detail::count(s, "all_to_all");
        rcount[q] = pdo::mpi::detail::count(r, "all_to_all");
        sdispl[q] = pdo::mpi::detail::count(stotal, "all_to_all");
        rdispl[q] = pdo::mpi::detail::count(rtotal, "all_to_all");
        stotal += s;
        rtotal += r;
      }
      staging_.resize(stotal * sizeof(T));
      result_.resize(rtotal * sizeof(T));
      T* pack = reinterpret_cast<T*>(staging_.data());
      for (std::size_t q = 0; q < ranks; ++q)
        for (std::size_t j = first_of(static_cast<int>(q)); j < first_of(static_cast<int>(q)) + per_rank_[q]; ++j)
          for (std::size_t i = f; i < f + nl; ++i) {
            copy_elements(pack, static_cast<const T*>(args_[i - f].in) + offset_in(i, j), sends(i, j));
            pack += sends(i, j);
          }
      pdo::mpi::detail::check(MPI_Alltoallv(staging_.data(), scount.data(), sdispl.data(), datatype<T>(), result_.data(),
                                            rcount.data(), rdispl.data(), datatype<T>(), comm_),
                              "MPI_Alltoallv");
    });
    // received from rank r: for each local member j, for each member i of r: piece i->j
    const T* src = reinterpret_cast<const T*>(result_.data());
    T* dst = out.data();
    for (std::size_t r = 0; r < ranks; ++r) {
      const std::size_t fr = first_of(static_cast<int>(r));
      for (std::size_t j = f; j < f + nl; ++j)
        for (std::size_t i = fr; i < fr + per_rank_[r]; ++i) {
          if (j == me) {
            copy_elements(dst, src, sends(i, j));
            dst += sends(i, j);
          }
          src += sends(i, j);
        }
    }
    local_.barrier();
  }

  template <class T>
  void send(std::size_t me, std::span<const T> data, std::size_t to, int tag) {
    check_peer("send", me, to, tag);
    if (rank_of(to) == my_rank()) return local_only([&] { local_.send(me - first(), data, to - first(), tag); });
    // synchronous: returns once the receiver has started to receive, as the contract says
    MPI_Request request = MPI_REQUEST_NULL;
    pdo::mpi::detail::check(MPI_Issend(data.data(), pdo::mpi::detail::count(data.size(), "send"), datatype<T>(), rank_of(to),
                                      wire_tag(me, to, tag), comm_, &request),
                            "MPI_Issend");
    // a send given up would still read `data`, which the caller frees: its timeout ends the job
    watch::instance().wait([&] { return tested(request); }, transfer_label("send", me, to, tag),
                           {world_ranks_[static_cast<std::size_t>(rank_of(to))]}, identity_.timeout, false);
  }

  template <class T>
  void recv(std::size_t me, std::span<T> data, std::size_t from, int tag) {
    check_peer("recv", me, from, tag);
    if (rank_of(from) == my_rank()) return local_only([&] { local_.recv(me - first(), data, from - first(), tag); });
    MPI_Status status;
    MPI_Message message;
    const int wire = wire_tag(from, me, tag);
    watch::instance().wait(
        [&] {
          int found = 0;
          pdo::mpi::detail::check(MPI_Improbe(rank_of(from), wire, comm_, &found, &message, &status), "MPI_Improbe");
          return found != 0;
        },
        transfer_label("recv", me, from, tag), {world_ranks_[static_cast<std::size_t>(rank_of(from))]}, identity_.timeout, true);
    int got = 0;
    MPI_Get_count(&status, datatype<T>(), &got);
    if (got == MPI_UNDEFINED || static_cast<std::size_t>(got) != data.size()) {
      int bytes = 0;
      MPI_Get_count(&status, MPI_BYTE, &bytes);
      std::vector<unsigned char> drain(static_cast<std::size_t>(bytes));
      MPI_Mrecv(drain.data(), bytes, MPI_BYTE, &message, MPI_STATUS_IGNORE);
      if (got == MPI_UNDEFINED)
        throw communication_error("send/recv: " + names_[from] + " sent " + std::to_string(bytes) + " bytes with tag " +
                             std::to_string(tag) + ", not a whole number of the elements " + names_[me] + " expects");
      throw communication_error("send/recv: " + names_[from] + " sent " + std::to_string(got) + " elements with tag " +
                                std::to_string(tag) + " but " + names_[me] + " expects " + std::to_string(data.size()));
    }
    pdo::mpi::detail::check(MPI_Mrecv(data.data(), got, datatype<T>(), &message, MPI_STATUS_IGNORE), "MPI_Mrecv");
  }

 private:
  struct args {
    const void* in = nullptr;
    void* out = nullptr;
  };

  template <class T>
  static MPI_Datatype datatype() { return pdo::mpi::detail::datatype<T>(); }
  template <class T>
  static MPI_Op op_of(reduce_op op) { return pdo::mpi::detail::op<T>(op); }

  int my_rank() const { return rank_; }
  static int rank_in(MPI_Comm comm) {
    int r = 0;
    MPI_Comm_rank(comm, &r);
    return r;
  }
  std::size_t first_of(int rank) const {
    return std::accumulate(per_rank_.begin(), per_rank_.begin() + rank, std::size_t{0});
  }
  int rank_of(std::size_t member) const {
    std::size_t end = 0;
    for (std::size_t r = 0; r < per_rank_.size(); ++r)
      if (member < (end += per_rank_[r])) return static_cast<int>(r);
    return static_cast<int>(per_rank_.size()) - 1;
  }
  int wire_tag(std::size_t from, std::size_t to, int tag) const {
    return static_cast<int>((static_cast<std::size_t>(tag) * size() + from) * size() + to);
  }
  /// @brief The largest user tag whose wire tag fits MPI_TAG_UB.
  std::size_t max_tag() const {
    int* upper = nullptr;
    int found = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &upper, &found);
    const std::size_t bound = found ? static_cast<std::size_t>(*upper) : 32767;
    return (bound + 1) / (size() * size()) - 1;
  }
  void check_peer(const char* op, std::size_t me, std::size_t peer, int tag) const {
    if (peer >= size() || peer == me || tag < 0 || static_cast<std::size_t>(tag) > max_tag())
      throw communication_error(std::string(op) + ": " + names_[me] + " named member " + std::to_string(peer) + " with tag " +
                                std::to_string(tag) + "; the peer must be another member of the group of " +
                                std::to_string(size()) + " and the tag in [0, " + std::to_string(max_tag()) + "]");
  }
  std::vector<std::string> local_names() const {
    const std::size_t f = first_;
    return {names_.begin() + static_cast<std::ptrdiff_t>(f),
            names_.begin() + static_cast<std::ptrdiff_t>(f + per_rank_[static_cast<std::size_t>(my_rank())])};
  }

  /// @brief Where the processes meet before collective `op` (at most two `values` per
  /// member): every member's [a code of its call, values..., zeros], 3 per member in member
  /// order, on every member. `call` names the call whole (`collective_call_text`: the
  /// collective, its element type, its reduction): a member in another collective, or in one
  /// over another element type or with another reduction, has another code, and every member
  /// finds it alike and fails (mismatch_error). The width is the same whatever the
  /// collective, so MPI never sees messages of two sizes meet (which it reports as a fatal
  /// truncation).
  const std::vector<std::size_t>& exchange(std::size_t me, const std::vector<std::size_t>& values, const char* op,
                                           const std::string& call) {
    std::vector<std::size_t> framed(3, 0);
    framed[0] = collective_code(call);
    std::copy(values.begin(), values.end(), framed.begin() + 1);
    const auto& all = exchange_values(me, framed, op);
    for (std::size_t k = 0; k < size(); ++k)
      if (all[3 * k] != framed[0]) {
        std::string calls;
        for (std::size_t j = 0; j < size(); ++j) calls += (j ? ", " : "") + names_[j] + " in " + collective_name(all[3 * j]);
        fail(std::string(op) + " over " + identity_.label + ": the members called different collectives (" + calls +
             "); every member of a group must call the same collectives, over the same element type, in the same order");
      }
    return all;
  }

  static constexpr std::size_t collective_code(std::string_view call) { return pdo::detail::collective_code(call); }
  /// @brief The call of `code`: each collective, reduction and element type tried.
  PDO_NOINLINE static std::string collective_name(std::size_t code) {
    std::vector<std::pair<char, std::size_t>> elements{{0, 0}};
    for (const char kind : {'f', 'i', 'u'})
      for (std::size_t bytes : {1, 2, 4, 8, 16}) elements.emplace_back(kind, bytes);
    for (std::string_view op : {"barrier", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"})
      for (int reduction = -1; reduction <= static_cast<int>(reduce_op::min); ++reduction)
        for (const auto& [element, bytes] : elements)
          if (std::string call = pdo::detail::collective_call_text(op, element, bytes, reduction); collective_code(call) == code)
            return call;
    return "another collective";
  }

  /// @brief Every member's `values` (all of one width), in member order, on every member.
  /// Its wait is watched (see watch): past the group's timeout every member that arrived
  /// throws pdo::collective_timeout.
  const std::vector<std::size_t>& exchange_values(std::size_t me, const std::vector<std::size_t>& values, const char* op) {
    if (!broken_.empty())  // read by every member alike: it was set before the last collective ended
      throw collective_timeout(std::string(op) + " over " + identity_.label + ": the group timed out earlier and cannot be used: " + broken_);
    const std::size_t l = me - first(), width = values.size();
    if (l == 0) {
      local_values_.assign(local_.size() * width, 0);
      width_ = width;
    }
    local_.barrier();
    std::copy(values.begin(), values.end(), local_values_.begin() + static_cast<std::ptrdiff_t>(l * width));
    local_.barrier();
    leader_step(l, [&] {
      MPI_Request request = MPI_REQUEST_NULL;
      counts_.assign(per_rank_.size(), 0);
      displs_.assign(per_rank_.size(), 0);
      for (std::size_t r = 0; r < per_rank_.size(); ++r) {
        counts_[r] = static_cast<int>(per_rank_[r] * width_);
        displs_[r] = static_cast<int>(first_of(static_cast<int>(r)) * width_);
      }
      all_values_.assign(size() * width_, 0);
      pdo::mpi::detail::check(MPI_Iallgatherv(local_values_.data(), static_cast<int>(local_values_.size()), MPI_UINT64_T,
                                              all_values_.data(), counts_.data(), displs_.data(), MPI_UINT64_T, comm_, &request),
                              "MPI_Iallgatherv");
      const wait_label label{identity_.id, ++collectives_, std::string(op) + " over " + identity_.label};
      std::vector<int> peers;
      for (std::size_t r = 0; r < world_ranks_.size(); ++r)
        if (static_cast<int>(r) != my_rank()) peers.push_back(world_ranks_[r]);
      try {
        watch::instance().wait([&] { return tested(request); }, label, peers, identity_.timeout, true);
      } catch (const collective_timeout& e) {
        broken_ = e.what();
        abandon(std::move(local_values_));
        abandon(std::move(all_values_));
        abandon(std::move(counts_));
        abandon(std::move(displs_));
        throw;
      }
    });
    return all_values_;
  }

  static bool tested(MPI_Request& request) {
    int done = 0;
    pdo::mpi::detail::check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
    return done != 0;
  }
  wait_label transfer_label(const char* op, std::size_t me, std::size_t peer, int tag) const {
    return {identity_.id, 0, std::string(op) + " between " + names_[me] + " and " + names_[peer] + " (tag " + std::to_string(tag) +
                                 ") over " + identity_.label};
  }
  /// @brief The MPI_COMM_WORLD rank of each rank of `comm`.
  static std::vector<int> world_ranks_of(MPI_Comm comm) {
    int n = 0;
    MPI_Comm_size(comm, &n);
    std::vector<int> ranks(static_cast<std::size_t>(n)), world(static_cast<std::size_t>(n));
    std::iota(ranks.begin(), ranks.end(), 0);
    MPI_Group mine = MPI_GROUP_NULL, all = MPI_GROUP_NULL;
    MPI_Comm_group(comm, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &all);
    MPI_Group_translate_ranks(mine, n, ranks.data(), all, world.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&all);
    return world;
  }

  /// @brief The leader runs `work` (its MPI calls); a failure there reaches every member,
  /// as the same pdo::error subclass. Problems alternate between two slots, step after
  /// step, so the leader never overwrites one that a member is still reading.
  template <class Work>
  void leader_step(std::size_t l, Work&& work) {
    std::optional<pdo::detail::captured_error>& problem = problems_[steps_[l]++ & 1];
    if (l == 0) {
      problem.reset();
      try {
        work();
      } catch (...) {
        problem = pdo::detail::captured_error::current();
      }
    }
    local_.barrier();
    if (problem) {
      const pdo::detail::captured_error failure = *problem;
      local_.barrier();
      failure.rethrow_with_context("");
    }
  }

  /// @brief An argument error every member of every process has found alike.
  /// Every member of the group finds it alike. When the group spans the mesh every place
  /// throws it and the program can go on (mismatch_error); in a smaller group the places
  /// outside it may already wait in their next collective for these, so it is an error
  /// that ends the job (communication_error; see run_on_places).
  [[noreturn]] void fail(const std::string& what) {
    local_.barrier();
    if (spans_mesh_) throw mismatch_error(what);
    throw communication_error(what + " (in a group that does not span the mesh)");
  }
  static std::size_t prefix(const std::vector<std::size_t>& v, std::size_t width, std::size_t field, std::size_t upto) {
    std::size_t s = 0;
    for (std::size_t k = 0; k < upto; ++k) s += v[k * width + field];
    return s;
  }
  std::pair<std::vector<int>, std::vector<int>> rank_blocks(const std::vector<std::size_t>& v, std::size_t width,
                                                            std::size_t field) const {
    std::vector<int> counts(per_rank_.size()), displs(per_rank_.size());
    for (std::size_t r = 0; r < per_rank_.size(); ++r) {
      const std::size_t f = first_of(static_cast<int>(r));
      displs[r] = pdo::mpi::detail::count(prefix(v, width, field, f), "collective");
      counts[r] = pdo::mpi::detail::count(prefix(v, width, field, f + per_rank_[r]) - prefix(v, width, field, f), "collective");
    }
    return {counts, displs};
  }
  std::string listing(const std::vector<std::size_t>& v, std::size_t width, std::size_t field) const {
    std::string text;
    for (std::size_t k = 0; k < size(); ++k) text += (k ? ", " : "") + names_[k] + ": " + std::to_string(v[k * width + field]);
    return text;
  }

  /// @brief Point to point between two places of this process: a size mismatch is known
  /// to those two only, so it is not one the other places can go on from.
  template <class F>
  static void local_only(F&& f) {
    try {
      f();
    } catch (const mismatch_error& e) {
      throw communication_error(e.what());
    }
  }

  bool spans_mesh_;
  MPI_Comm comm_;
  int rank_;                         ///< this process's rank in comm_
  std::vector<std::size_t> per_rank_;
  std::size_t first_;                ///< the member index of this process's first member
  std::vector<std::string> names_;
  local_group local_;
  std::vector<args> args_;
  std::vector<std::size_t> local_values_, all_values_;
  std::vector<int> counts_, displs_;
  std::size_t width_ = 0;
  std::vector<unsigned char> staging_, result_;
  std::optional<pdo::detail::captured_error> problems_[2];
  group_identity identity_;
  std::vector<int> world_ranks_;     ///< the MPI_COMM_WORLD rank of each rank of comm_
  std::uint64_t collectives_ = 0;    ///< collectives begun on this group (by this process's leader)
  std::string broken_;               ///< why the group cannot be used (a timeout), or empty
  std::vector<std::size_t> steps_ = std::vector<std::size_t>(local_.size(), 0);  ///< leader steps per local member
};

}  // namespace pdo::mpi::detail
