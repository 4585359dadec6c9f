// tests/cuda_sim/src/nccl.cpp: the simulated NCCL. A communicator's ranks live on simulated
// devices, in this process or in other MPI processes. A collective or transfer runs as work
// of the stream it was given: each rank sends its contribution to the ranks that need it (a
// mailbox in the process, MPI between processes) and computes its result from what it
// receives, in rank order (so results are the same from run to run). Checked, as NCCL
// requires: buffers are device memory of the communicator's device; ranks call the same
// collectives in the same order with the same counts, types, ops and roots (else an async
// error, where NCCL would hang or corrupt memory); one thread driving several ranks of a
// process groups its calls (else, as with NCCL, it deadlocks: reported after a while).
#include "sim.hpp"

#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <tuple>

#if defined(CUDA_SIM_WITH_MPI)
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#include <mpi.h>
#endif

namespace {

using clock_type = std::chrono::steady_clock;

// ---- what ranks send each other ----

/// @brief What a rank says about the collective it contributes to, so mismatches show.
struct header {
  int kind = 0;  ///< 1 all_reduce, 2 broadcast, 3 reduce, 4 all_gather, 5 reduce_scatter, 6 send, 7 split
  long long count = 0;
  int type = 0, op = 0, root = 0;
  int a = 0, b = 0;  ///< a split's color and key
};

const char* kind_name(int kind) {
  static const char* names[] = {"?", "ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter", "ncclSend",
                                "ncclCommSplit"};
  return kind >= 0 && kind <= 7 ? names[kind] : "?";
}

std::size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

/// @brief A message's address: communicator, what it belongs to, and its sender and receiver.
using message_key = std::tuple<std::uint64_t, int, std::uint64_t, int, int>;  ///< uid, channel (0 collective, 1 p2p), seq, from, to

struct message {
  header h;
  std::vector<char> payload;
};

constexpr int sim_tag = 32011, init_tag = 32012, table_tag = 32013;

/// @brief The mailbox of this process: messages to ranks that live here, from anywhere.
struct mailbox {
  std::mutex mutex;
  std::condition_variable arrived;
  std::map<message_key, message> box;
};
mailbox& mail() {
  static mailbox* m = new mailbox();
  return *m;
}

#if defined(CUDA_SIM_WITH_MPI)
/// @brief Messages to other processes still being sent.
struct outgoing_sends {
  struct send {
    MPI_Request request;
    std::unique_ptr<std::vector<char>> wire;
  };
  std::mutex mutex;
  std::list<send> sends;
};
outgoing_sends& outgoing() {
  static outgoing_sends* o = new outgoing_sends();
  return *o;
}
#endif

bool mpi_running() {
#if defined(CUDA_SIM_WITH_MPI)
  int started = 0, finished = 0;
  MPI_Initialized(&started);
  MPI_Finalized(&finished);
  return started && !finished;
#else
  return false;
#endif
}

int world_rank() {
#if defined(CUDA_SIM_WITH_MPI)
  if (mpi_running()) {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
  }
#endif
  return 0;
}

// ---- communicators ----

/// @brief The ranks of one communicator that live in this process: they meet when a
/// collective is launched (NCCL's launch of one process's ranks waits for all of them).
struct clique {
  std::mutex mutex;
  std::condition_variable launched_all;
  int local_ranks = 0;
  std::map<std::uint64_t, int> launched;  ///< collective seq -> local ranks that launched it
};

struct comm_state {
  std::uint64_t uid = 0;
  int rank = 0, nranks = 0, device = 0;
  std::vector<int> process_of;  ///< world rank of each rank's process
  std::vector<int> device_of;
  std::shared_ptr<clique> local;
  std::uint64_t next_seq = 0;                 ///< collectives launched (host side)
  std::map<int, std::uint64_t> sent, received;  ///< point-to-point transfers, per peer
  std::atomic<int> async_error{ncclSuccess};
  std::atomic<bool> aborted{false};
  std::mutex error_mutex;
  std::string last_error;
  bool ready = false;  ///< made (an init in a group is made at the group's end)

  void set_error(ncclResult_t e, const std::string& why) {
    int expected = ncclSuccess;
    async_error.compare_exchange_strong(expected, e);
    std::lock_guard lock(error_mutex);
    if (last_error.empty()) last_error = why;
  }
  [[nodiscard]] bool here(int r) const { return process_of[static_cast<std::size_t>(r)] == world_rank() || !mpi_running(); }
};

}  // namespace

struct ncclComm {
  std::shared_ptr<comm_state> state;
};

namespace {

std::mutex cliques_mutex;
std::map<std::uint64_t, std::weak_ptr<clique>> cliques;

std::shared_ptr<clique> clique_of(std::uint64_t uid, int local_ranks) {
  std::lock_guard lock(cliques_mutex);
  auto found = cliques[uid].lock();
  if (!found) {
    found = std::make_shared<clique>();
    found->local_ranks = local_ranks;
    cliques[uid] = found;
  }
  return found;
}

thread_local std::string last_error_text;

ncclResult_t refuse(ncclResult_t e, const std::string& why) {
  last_error_text = why;
  if (std::getenv("PDO_SIM_VERBOSE") != nullptr) std::fprintf(stderr, "pdo cuda simulator: NCCL: %s\n", why.c_str());
  return e;
}

// ---- sending and receiving ----

void post(const comm_state& c, int channel, std::uint64_t seq, int to, const message& m) {
  const message_key key{c.uid, channel, seq, c.rank, to};
  if (c.here(to)) {
    auto& box = mail();
    {
      std::lock_guard lock(box.mutex);
      box.box[key] = m;
    }
    box.arrived.notify_all();
    return;
  }
#if defined(CUDA_SIM_WITH_MPI)
  // header words: uid, channel, seq, from, to, then the header, then the payload; sent without
  // waiting (two processes sending each other large contributions must not block each other)
  auto wire = std::make_unique<std::vector<char>>(5 * sizeof(std::uint64_t) + sizeof(header) + m.payload.size());
  const std::uint64_t words[5] = {c.uid, static_cast<std::uint64_t>(channel), seq, static_cast<std::uint64_t>(c.rank),
                                  static_cast<std::uint64_t>(to)};
  std::memcpy(wire->data(), words, sizeof words);
  std::memcpy(wire->data() + sizeof words, &m.h, sizeof(header));
  if (!m.payload.empty()) std::memcpy(wire->data() + sizeof words + sizeof(header), m.payload.data(), m.payload.size());
  auto& out = outgoing();
  std::lock_guard lock(out.mutex);
  out.sends.push_back({MPI_REQUEST_NULL, std::move(wire)});
  auto& s = out.sends.back();
  MPI_Isend(s.wire->data(), static_cast<int>(s.wire->size()), MPI_BYTE, c.process_of[static_cast<std::size_t>(to)], sim_tag,
            MPI_COMM_WORLD, &s.request);
#endif
}

/// @brief Moves the messages that arrived from other processes into the mailbox, and lets go
/// of the sends that completed.
void pump() {
#if defined(CUDA_SIM_WITH_MPI)
  if (!mpi_running()) return;
  {
    auto& out = outgoing();
    std::lock_guard lock(out.mutex);
    for (auto it = out.sends.begin(); it != out.sends.end();) {
      int done = 0;
      MPI_Test(&it->request, &done, MPI_STATUS_IGNORE);
      it = done ? out.sends.erase(it) : std::next(it);
    }
  }
  int flag = 0;
  MPI_Message handle;
  MPI_Status status;
  while (MPI_Improbe(MPI_ANY_SOURCE, sim_tag, MPI_COMM_WORLD, &flag, &handle, &status) == MPI_SUCCESS && flag) {
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    std::vector<char> wire(static_cast<std::size_t>(bytes));
    MPI_Mrecv(wire.data(), bytes, MPI_BYTE, &handle, MPI_STATUS_IGNORE);
    std::uint64_t words[5];
    std::memcpy(words, wire.data(), sizeof words);
    message m;
    std::memcpy(&m.h, wire.data() + sizeof words, sizeof(header));
    m.payload.assign(wire.begin() + static_cast<std::ptrdiff_t>(sizeof words + sizeof(header)), wire.end());
    auto& box = mail();
    {
      std::lock_guard lock(box.mutex);
      box.box[message_key{words[0], static_cast<int>(words[1]), words[2], static_cast<int>(words[3]), static_cast<int>(words[4])}] =
          std::move(m);
    }
    box.arrived.notify_all();
  }
#endif
}

/// @brief The message `from` sent to this rank, waiting for it; nothing when the
/// communicator is aborted while waiting.
std::optional<message> take(comm_state& c, int channel, std::uint64_t seq, int from) {
  const message_key key{c.uid, channel, seq, from, c.rank};
  auto& box = mail();
  const auto start = clock_type::now();
  for (;;) {
    if (!c.here(from)) pump();
    {
      std::unique_lock lock(box.mutex);
      if (auto it = box.box.find(key); it != box.box.end()) {
        message m = std::move(it->second);
        box.box.erase(it);
        return m;
      }
      if (c.aborted.load()) return std::nullopt;
      box.arrived.wait_for(lock, std::chrono::microseconds(c.here(from) ? 2000 : 100));
    }
    if (clock_type::now() - start > std::chrono::duration<double>(cuda_sim::config().deadlock_seconds))
      cuda_sim::fatal("rank " + std::to_string(c.rank) + " of a communicator waited " + std::to_string(cuda_sim::config().deadlock_seconds) +
                      " s for rank " + std::to_string(from) + "'s part of its " + (channel == 0 ? "collective" : "transfer") + " #" +
                      std::to_string(seq) + ", which never came: NCCL would hang here (abort the communicator when a rank fails)");
  }
}

/// @brief What a kernel does after the simulator found its collective broken (an async
/// error is set): it stays on its stream, as NCCL's would hang, until the communicator is
/// aborted.
void wait_for_abort(comm_state& c, const char* what) {
  const auto start = clock_type::now();
  while (!c.aborted.load()) {
    if (clock_type::now() - start > std::chrono::duration<double>(cuda_sim::config().deadlock_seconds))
      cuda_sim::fatal(std::string(what) + " set an asynchronous error that nobody checked (ncclCommGetAsyncError) or "
                      "answered by aborting the communicator (ncclCommAbort) within " +
                      std::to_string(cuda_sim::config().deadlock_seconds) + " s: NCCL would hang here");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// ---- collectives ----

template <class T>
void reduce_into(T* acc, const T* in, std::size_t n, ncclRedOp_t op) {
  for (std::size_t i = 0; i < n; ++i) {
    switch (op) {
      case ncclSum: case ncclAvg: acc[i] = acc[i] + in[i]; break;
      case ncclProd: acc[i] = acc[i] * in[i]; break;
      case ncclMax: acc[i] = in[i] > acc[i] ? in[i] : acc[i]; break;  // NCCL's max: fmax-like for floats
      case ncclMin: acc[i] = in[i] < acc[i] ? in[i] : acc[i]; break;
      default: break;
    }
  }
}

void reduce_bytes(char* acc, const char* in, std::size_t count, ncclDataType_t t, ncclRedOp_t op) {
  switch (t) {
    case ncclInt8: reduce_into(reinterpret_cast<std::int8_t*>(acc), reinterpret_cast<const std::int8_t*>(in), count, op); break;
    case ncclUint8: reduce_into(reinterpret_cast<std::uint8_t*>(acc), reinterpret_cast<const std::uint8_t*>(in), count, op); break;
    case ncclInt32: reduce_into(reinterpret_cast<std::int32_t*>(acc), reinterpret_cast<const std::int32_t*>(in), count, op); break;
    case ncclUint32: reduce_into(reinterpret_cast<std::uint32_t*>(acc), reinterpret_cast<const std::uint32_t*>(in), count, op); break;
    case ncclInt64: reduce_into(reinterpret_cast<std::int64_t*>(acc), reinterpret_cast<const std::int64_t*>(in), count, op); break;
    case ncclUint64: reduce_into(reinterpret_cast<std::uint64_t*>(acc), reinterpret_cast<const std::uint64_t*>(in), count, op); break;
    case ncclFloat32: reduce_into(reinterpret_cast<float*>(acc), reinterpret_cast<const float*>(in), count, op); break;
    case ncclFloat64: reduce_into(reinterpret_cast<double*>(acc), reinterpret_cast<const double*>(in), count, op); break;
    default: break;
  }
}

template <class T>
void scale(char* p, std::size_t n, int ranks) {
  T* v = reinterpret_cast<T*>(p);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(v[i] / static_cast<T>(ranks));
}

/// @brief A collective of one rank, as its stream runs it: sends its contribution to every
/// other rank, takes theirs, checks they agree, and writes its result.
struct collective {
  std::shared_ptr<comm_state> c;
  std::uint64_t seq = 0;
  header h;
  const char* send = nullptr;
  char* recv = nullptr;

  std::size_t bytes(long long count) const { return static_cast<std::size_t>(count) * type_size(static_cast<ncclDataType_t>(h.type)); }

  void operator()() const {
    const int n = c->nranks, me = c->rank;
    message mine{h, {}};
    const std::size_t in_bytes = h.kind == 5 ? bytes(h.count) * static_cast<std::size_t>(n) : bytes(h.count);
    const bool contributes = h.kind != 2 || me == h.root;
    if (contributes && in_bytes != 0) {
      cuda_sim::device_work w;
      mine.payload.assign(send, send + in_bytes);
    }
    for (int q = 0; q < n; ++q)
      if (q != me) post(*c, 0, seq, q, mine);
    std::vector<message> all(static_cast<std::size_t>(n));
    all[static_cast<std::size_t>(me)] = std::move(mine);
    for (int q = 0; q < n; ++q) {
      if (q == me) continue;
      auto got = take(*c, 0, seq, q);
      if (!got) return;  // aborted: the kernel ends without a result
      all[static_cast<std::size_t>(q)] = std::move(*got);
    }
    for (int q = 0; q < n; ++q) {
      const header& o = all[static_cast<std::size_t>(q)].h;
      if (o.kind != h.kind || o.count != h.count || o.type != h.type || o.op != h.op || o.root != h.root) {
        c->set_error(ncclInvalidUsage, std::string("ranks called different collectives at position ") + std::to_string(seq) + ": rank " +
                                           std::to_string(me) + " " + kind_name(h.kind) + " of " + std::to_string(h.count) +
                                           ", rank " + std::to_string(q) + " " + kind_name(o.kind) + " of " + std::to_string(o.count) +
                                           " (NCCL would hang or corrupt memory here)");
        wait_for_abort(*c, "a mismatched collective");
        return;
      }
    }
    const auto type = static_cast<ncclDataType_t>(h.type);
    const auto op = static_cast<ncclRedOp_t>(h.op);
    cuda_sim::device_work w;
    switch (h.kind) {
      case 1: {  // all_reduce: in rank order
        std::vector<char> acc(all[0].payload);
        for (int q = 1; q < n; ++q) reduce_bytes(acc.data(), all[static_cast<std::size_t>(q)].payload.data(), static_cast<std::size_t>(h.count), type, op);
        if (op == ncclAvg) average(acc.data(), static_cast<std::size_t>(h.count), type, n);
        if (!acc.empty()) std::memcpy(recv, acc.data(), acc.size());
        break;
      }
      case 2:  // broadcast
        if (!all[static_cast<std::size_t>(h.root)].payload.empty())
          std::memcpy(recv, all[static_cast<std::size_t>(h.root)].payload.data(), all[static_cast<std::size_t>(h.root)].payload.size());
        break;
      case 3: {  // reduce: the root's result
        if (me != h.root) break;
        std::vector<char> acc(all[0].payload);
        for (int q = 1; q < n; ++q) reduce_bytes(acc.data(), all[static_cast<std::size_t>(q)].payload.data(), static_cast<std::size_t>(h.count), type, op);
        if (op == ncclAvg) average(acc.data(), static_cast<std::size_t>(h.count), type, n);
        if (!acc.empty()) std::memcpy(recv, acc.data(), acc.size());
        break;
      }
      case 4: {  // all_gather: rank order
        std::size_t at = 0;
        for (int q = 0; q < n; ++q) {
          const auto& p = all[static_cast<std::size_t>(q)].payload;
          if (!p.empty()) std::memcpy(recv + at, p.data(), p.size());
          at += bytes(h.count);
        }
        break;
      }
      case 5: {  // reduce_scatter: this rank's segment, in rank order
        const std::size_t seg = bytes(h.count), at = seg * static_cast<std::size_t>(me);
        if (seg == 0) break;
        std::vector<char> acc(all[0].payload.begin() + static_cast<std::ptrdiff_t>(at), all[0].payload.begin() + static_cast<std::ptrdiff_t>(at + seg));
        for (int q = 1; q < n; ++q)
          reduce_bytes(acc.data(), all[static_cast<std::size_t>(q)].payload.data() + at, static_cast<std::size_t>(h.count), type, op);
        if (op == ncclAvg) average(acc.data(), static_cast<std::size_t>(h.count), type, n);
        std::memcpy(recv, acc.data(), seg);
        break;
      }
      default: break;
    }
  }

  static void average(char* p, std::size_t count, ncclDataType_t t, int ranks) {
    if (t == ncclFloat32) scale<float>(p, count, ranks);
    else if (t == ncclFloat64) scale<double>(p, count, ranks);
  }
};

/// @brief A send or a receive of one rank, as its stream runs it.
struct transfer {
  std::shared_ptr<comm_state> c;
  std::uint64_t seq = 0;
  int peer = 0;
  bool sending = false;
  long long count = 0;
  int type = 0;
  const char* send = nullptr;
  char* recv = nullptr;

  void operator()() const {
    const std::size_t n = static_cast<std::size_t>(count) * type_size(static_cast<ncclDataType_t>(type));
    if (sending) {
      message m{header{6, count, type, 0, 0, 0, 0}, {}};
      if (n != 0) {
        cuda_sim::device_work w;
        m.payload.assign(send, send + n);
      }
      post(*c, 1, seq, peer, m);
      return;
    }
    auto got = take(*c, 1, seq, peer);
    if (!got) return;
    if (got->h.count != count || got->h.type != type) {
      c->set_error(ncclInvalidUsage, "rank " + std::to_string(peer) + " sent " + std::to_string(got->h.count) + " elements to rank " +
                                         std::to_string(c->rank) + ", which receives " + std::to_string(count) +
                                         " (NCCL would hang or corrupt memory here)");
      wait_for_abort(*c, "a mismatched transfer");
      return;
    }
    if (n != 0) {
      cuda_sim::device_work w;
      std::memcpy(recv, got->payload.data(), n);
    }
  }
};

// ---- groups ----

/// @brief What a launch leaves to do: a collective's meeting with the other ranks of its
/// process (NCCL's launch waits for them), or the second half of an init or a split.
struct pending {
  std::function<ncclResult_t()> first;   ///< at the call (or the group's end)
  std::function<ncclResult_t()> second;  ///< after every first of the group
};

thread_local int group_depth = 0;
thread_local std::vector<pending> group_work;

ncclResult_t run_or_defer(pending p) {
  if (group_depth > 0) {
    group_work.push_back(std::move(p));
    return ncclSuccess;
  }
  if (const ncclResult_t r = p.first(); r != ncclSuccess) return r;
  return p.second ? p.second() : ncclSuccess;
}

/// @brief Waits until every rank of this process has launched collective `seq` of `c`.
ncclResult_t meet_at_launch(comm_state& c, std::uint64_t seq, const char* call) {
  auto& k = *c.local;
  std::unique_lock lock(k.mutex);
  const auto limit = std::chrono::duration<double>(cuda_sim::config().deadlock_seconds);
  const bool met = k.launched_all.wait_for(lock, limit, [&] { return k.launched[seq] >= k.local_ranks || c.aborted.load(); });
  if (!met)
    cuda_sim::fatal(std::string(call) + " on rank " + std::to_string(c.rank) + " of a communicator with " + std::to_string(k.local_ranks) +
                    " ranks in this process waited " + std::to_string(limit.count()) +
                    " s for the others to launch it: a deadlock, as with NCCL. One thread driving several devices must group its "
                    "calls (ncclGroupStart/ncclGroupEnd)");
  if (seq > 1024) k.launched.erase(k.launched.begin(), k.launched.lower_bound(seq - 1024));  // long met
  return ncclSuccess;
}

comm_state* usable(ncclComm_t comm) {
  if (comm == nullptr || !comm->state || !comm->state->ready || comm->state->aborted.load()) return nullptr;
  return comm->state.get();
}

/// @brief Checks a buffer of a collective: device memory of the communicator's device,
/// holding `bytes`.
bool device_buffer(const void* p, std::size_t bytes, const comm_state& c) {
  if (bytes == 0) return true;
  bool overruns = false;
  const cuda_sim::allocation* a = cuda_sim::find_allocation(p, bytes, &overruns);
  return a != nullptr && !overruns && a->device == c.device;
}

ncclResult_t launch_collective(ncclComm_t comm, cudaStream_t stream, header h, const void* send, void* recv, std::size_t send_bytes,
                               std::size_t recv_bytes, const char* call) {
  comm_state* c = usable(comm);
  if (c == nullptr) return refuse(ncclInvalidArgument, std::string(call) + ": not a live communicator");
  cuda_sim::stream* st = cuda_sim::stream_of(stream);
  if (st == nullptr || st->device() != c->device)
    return refuse(ncclInvalidArgument, std::string(call) + ": the stream is not one of the communicator's device " + std::to_string(c->device));
  if (h.type < 0 || h.type >= ncclNumTypes) return refuse(ncclInvalidArgument, std::string(call) + ": not a data type");
  if (h.count < 0) return refuse(ncclInvalidArgument, std::string(call) + ": a negative count");
  if (!device_buffer(send, send_bytes, *c) || !device_buffer(recv, recv_bytes, *c))
    return refuse(ncclInvalidArgument, std::string(call) + " on rank " + std::to_string(c->rank) +
                                           ": a buffer is not device memory of the communicator's device " + std::to_string(c->device) +
                                           " (host memory, another device's, or too small)");
  const std::uint64_t seq = ++c->next_seq;
  auto state = comm->state;
  collective work{state, seq, h, static_cast<const char*>(send), static_cast<char*>(recv)};
  return run_or_defer(pending{
      [state, st, work, seq] {
        st->enqueue(cuda_sim::operation{work, false, kind_name(work.h.kind)});  // device work inside, around the waits
        auto& k = *state->local;
        {
          std::lock_guard lock(k.mutex);
          ++k.launched[seq];
        }
        k.launched_all.notify_all();
        return ncclSuccess;
      },
      [state, seq, call] { return meet_at_launch(*state, seq, call); }});
}

ncclResult_t launch_transfer(ncclComm_t comm, cudaStream_t stream, bool sending, const void* buffer, long long count, ncclDataType_t type,
                             int peer, const char* call) {
  comm_state* c = usable(comm);
  if (c == nullptr) return refuse(ncclInvalidArgument, std::string(call) + ": not a live communicator");
  cuda_sim::stream* st = cuda_sim::stream_of(stream);
  if (st == nullptr || st->device() != c->device)
    return refuse(ncclInvalidArgument, std::string(call) + ": the stream is not one of the communicator's device");
  if (peer < 0 || peer >= c->nranks) return refuse(ncclInvalidArgument, std::string(call) + ": not a rank of the communicator");
  if (type < 0 || type >= ncclNumTypes || count < 0) return refuse(ncclInvalidArgument, std::string(call) + ": a bad count or type");
  if (!device_buffer(buffer, static_cast<std::size_t>(count) * type_size(type), *c))
    return refuse(ncclInvalidArgument, std::string(call) + " on rank " + std::to_string(c->rank) +
                                           ": the buffer is not device memory of the communicator's device");
  const std::uint64_t seq = sending ? ++c->sent[peer] : ++c->received[peer];
  transfer work{comm->state, seq, peer, sending, count, type, sending ? static_cast<const char*>(buffer) : nullptr,
                sending ? nullptr : static_cast<char*>(const_cast<void*>(buffer))};
  return run_or_defer(pending{[st, work] {
                                st->enqueue(cuda_sim::operation{work, false, work.sending ? "ncclSend" : "ncclRecv"});
                                return ncclSuccess;
                              },
                              nullptr});
}

std::uint64_t random_uid() {
  static std::mt19937_64 gen(std::random_device{}() ^ static_cast<std::uint64_t>(clock_type::now().time_since_epoch().count()));
  static std::mutex m;
  std::lock_guard lock(m);
  return gen() | 1;
}

// ---- making communicators across processes ----

struct registration {
  int rank = 0, device = 0, process = 0;
};
struct init_board {
  std::mutex mutex;
  std::condition_variable changed;
  std::map<std::uint64_t, std::vector<registration>> seen;  ///< uid -> registrations the creator collected
  std::map<std::uint64_t, std::vector<registration>> tables;  ///< uid -> the whole table, once known here
};
init_board& board() {
  static init_board* b = new init_board();
  return *b;
}

void pump_init() {
#if defined(CUDA_SIM_WITH_MPI)
  if (!mpi_running()) return;
  for (int tag : {init_tag, table_tag}) {
    int flag = 0;
    MPI_Message handle;
    MPI_Status status;
    while (MPI_Improbe(MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, &flag, &handle, &status) == MPI_SUCCESS && flag) {
      int count = 0;
      MPI_Get_count(&status, MPI_LONG_LONG, &count);
      std::vector<long long> words(static_cast<std::size_t>(count));
      MPI_Mrecv(words.data(), count, MPI_LONG_LONG, &handle, MPI_STATUS_IGNORE);
      const auto uid = static_cast<std::uint64_t>(words[0]);
      auto& b = board();
      std::lock_guard lock(b.mutex);
      if (tag == init_tag) {
        b.seen[uid].push_back({static_cast<int>(words[1]), static_cast<int>(words[2]), static_cast<int>(words[3])});
      } else {
        std::vector<registration> table;
        for (std::size_t i = 1; i + 2 < words.size(); i += 3)
          table.push_back({static_cast<int>(words[i]), static_cast<int>(words[i + 1]), static_cast<int>(words[i + 2])});
        b.tables[uid] = std::move(table);
      }
      b.changed.notify_all();
    }
  }
#endif
}

struct unique_id_fields {
  std::uint64_t uid;
  int creator;
};
unique_id_fields fields_of(const ncclUniqueId& id) {
  unique_id_fields f{};
  std::memcpy(&f, id.internal, sizeof f);
  return f;
}

/// @brief The first half of ncclCommInitRank: this rank tells the creator of the id where it is.
ncclResult_t register_rank(const unique_id_fields& id, int rank, int device) {
  const int me = world_rank();
  if (id.creator == me || !mpi_running()) {
    auto& b = board();
    std::lock_guard lock(b.mutex);
    b.seen[id.uid].push_back({rank, device, me});
    b.changed.notify_all();
    return ncclSuccess;
  }
#if defined(CUDA_SIM_WITH_MPI)
  const long long words[4] = {static_cast<long long>(id.uid), rank, device, me};
  MPI_Send(words, 4, MPI_LONG_LONG, id.creator, init_tag, MPI_COMM_WORLD);
#endif
  return ncclSuccess;
}

/// @brief The second half: the whole table (the creator collects it and sends it out).
std::vector<registration> table_of(const unique_id_fields& id, int nranks) {
  auto& b = board();
  const int me = world_rank();
  const auto limit = clock_type::now() + std::chrono::duration_cast<clock_type::duration>(
                                             std::chrono::duration<double>(cuda_sim::config().deadlock_seconds));
  for (;;) {
    pump_init();
    std::unique_lock lock(b.mutex);
    if (auto t = b.tables.find(id.uid); t != b.tables.end()) return t->second;
    if ((id.creator == me || !mpi_running()) && static_cast<int>(b.seen[id.uid].size()) == nranks) {
      auto table = b.seen[id.uid];
      std::sort(table.begin(), table.end(), [](const auto& x, const auto& y) { return x.rank < y.rank; });
      b.tables[id.uid] = table;
#if defined(CUDA_SIM_WITH_MPI)
      std::vector<long long> words{static_cast<long long>(id.uid)};
      std::vector<int> processes;
      for (const auto& r : table) {
        words.insert(words.end(), {r.rank, r.device, r.process});
        if (r.process != me && std::find(processes.begin(), processes.end(), r.process) == processes.end()) processes.push_back(r.process);
      }
      lock.unlock();
      for (int p : processes) MPI_Send(words.data(), static_cast<int>(words.size()), MPI_LONG_LONG, p, table_tag, MPI_COMM_WORLD);
#endif
      return table;
    }
    if (clock_type::now() > limit)
      cuda_sim::fatal("ncclCommInitRank waited " + std::to_string(cuda_sim::config().deadlock_seconds) + " s for the " +
                      std::to_string(nranks) + " ranks of a communicator to join; " + std::to_string(b.seen[id.uid].size()) +
                      " had (on the process that made the id)");
    b.changed.wait_for(lock, std::chrono::milliseconds(1));
  }
}

void fill(comm_state& c, const std::vector<registration>& table) {
  c.process_of.resize(table.size());
  c.device_of.resize(table.size());
  int local = 0;
  for (const auto& r : table) {
    c.process_of[static_cast<std::size_t>(r.rank)] = r.process;
    c.device_of[static_cast<std::size_t>(r.rank)] = r.device;
  }
  for (std::size_t r = 0; r < table.size(); ++r) local += c.here(static_cast<int>(r)) ? 1 : 0;
  c.local = clique_of(c.uid, local);
  c.ready = true;
}

}  // namespace

extern "C" {

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  if (comm != nullptr && comm->state) {
    std::lock_guard lock(comm->state->error_mutex);
    if (!comm->state->last_error.empty()) {
      last_error_text = comm->state->last_error;
    }
  }
  return last_error_text.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return refuse(ncclInvalidArgument, "ncclGetUniqueId: null id");
  std::memset(id->internal, 0, sizeof id->internal);
  const unique_id_fields f{random_uid(), world_rank()};
  std::memcpy(id->internal, &f, sizeof f);
  return ncclSuccess;
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (comms == nullptr || ndev <= 0) return refuse(ncclInvalidArgument, "ncclCommInitAll: no communicators to make");
  for (int i = 0; i < ndev; ++i) {
    const int d = devlist != nullptr ? devlist[i] : i;
    if (d < 0 || d >= cuda_sim::config().devices) return refuse(ncclInvalidArgument, "ncclCommInitAll: no device " + std::to_string(d));
    for (int j = 0; j < i; ++j)
      if ((devlist != nullptr ? devlist[j] : j) == d)
        return refuse(ncclInvalidUsage, "ncclCommInitAll: device " + std::to_string(d) + " appears twice (one rank per device)");
  }
  const std::uint64_t uid = random_uid();
  std::vector<registration> table;
  for (int i = 0; i < ndev; ++i) table.push_back({i, devlist != nullptr ? devlist[i] : i, world_rank()});
  for (int i = 0; i < ndev; ++i) {
    auto s = std::make_shared<comm_state>();
    s->uid = uid;
    s->rank = i;
    s->nranks = ndev;
    s->device = table[static_cast<std::size_t>(i)].device;
    fill(*s, table);
    comms[i] = new ncclComm{std::move(s)};
  }
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  if (comm == nullptr || nranks <= 0 || rank < 0 || rank >= nranks) return refuse(ncclInvalidArgument, "ncclCommInitRank: bad rank or size");
  const unique_id_fields f = fields_of(id);
  if (f.uid == 0) return refuse(ncclInvalidArgument, "ncclCommInitRank: not an id from ncclGetUniqueId");
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return refuse(ncclUnhandledCudaError, "ncclCommInitRank: no current device");
  auto s = std::make_shared<comm_state>();
  s->uid = f.uid;
  s->rank = rank;
  s->nranks = nranks;
  s->device = device;
  *comm = new ncclComm{s};
  return run_or_defer(pending{[f, rank, device] { return register_rank(f, rank, device); },
                              [s, f, nranks] {
                                fill(*s, table_of(f, nranks));
                                return ncclSuccess;
                              }});
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t*) {
  comm_state* c = usable(comm);
  if (c == nullptr || newcomm == nullptr) return refuse(ncclInvalidArgument, "ncclCommSplit: not a live communicator");
  auto parent = comm->state;
  const std::uint64_t seq = ++parent->next_seq;  // a split is collective over the parent, in order with its collectives
  auto made = std::make_shared<comm_state>();
  *newcomm = nullptr;
  ncclComm_t* out = newcomm;
  return run_or_defer(pending{
      [parent, seq, color, key] {
        message m{header{7, 0, 0, 0, 0, color, key}, {}};
        for (int q = 0; q < parent->nranks; ++q)
          if (q != parent->rank) post(*parent, 0, seq, q, m);
        return ncclSuccess;
      },
      [parent, seq, color, key, made, out] {
        std::vector<std::pair<int, int>> picks(static_cast<std::size_t>(parent->nranks));  // color, key per rank
        picks[static_cast<std::size_t>(parent->rank)] = {color, key};
        for (int q = 0; q < parent->nranks; ++q) {
          if (q == parent->rank) continue;
          auto got = take(*parent, 0, seq, q);
          if (!got || got->h.kind != 7) return refuse(ncclInvalidUsage, "ncclCommSplit: a rank did not split at the same position");
          picks[static_cast<std::size_t>(q)] = {got->h.a, got->h.b};
        }
        if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
        std::vector<int> members;
        for (int q = 0; q < parent->nranks; ++q)
          if (picks[static_cast<std::size_t>(q)].first == color) members.push_back(q);
        std::stable_sort(members.begin(), members.end(), [&](int x, int y) { return picks[static_cast<std::size_t>(x)].second < picks[static_cast<std::size_t>(y)].second; });
        made->uid = (parent->uid * 0x9E3779B97F4A7C15ull) ^ (seq << 20) ^ static_cast<std::uint64_t>(color + 1);
        made->nranks = static_cast<int>(members.size());
        made->device = parent->device;
        std::vector<registration> table;
        for (std::size_t i = 0; i < members.size(); ++i) {
          if (members[i] == parent->rank) made->rank = static_cast<int>(i);
          table.push_back({static_cast<int>(i), parent->device_of[static_cast<std::size_t>(members[i])],
                           parent->process_of[static_cast<std::size_t>(members[i])]});
        }
        fill(*made, table);
        *out = new ncclComm{made};
        return ncclSuccess;
      }});
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return refuse(ncclInvalidArgument, "ncclCommDestroy: null");
  delete comm;  // queued work keeps the state
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return refuse(ncclInvalidArgument, "ncclCommAbort: null");
  if (comm->state) {
    comm->state->aborted.store(true);
    mail().arrived.notify_all();
    if (comm->state->local) comm->state->local->launched_all.notify_all();
  }
  // the handle is left alive (a few bytes): another thread may be inside a call on it, which
  // NCCL allows, and now finds it aborted
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* error) {
  if (comm == nullptr || error == nullptr || !comm->state) return refuse(ncclInvalidArgument, "ncclCommGetAsyncError: null");
  *error = static_cast<ncclResult_t>(comm->state->async_error.load());
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (comm == nullptr || count == nullptr) return ncclInvalidArgument;
  *count = comm->state->nranks;
  return ncclSuccess;
}
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (comm == nullptr || device == nullptr) return ncclInvalidArgument;
  *device = comm->state->device;
  return ncclSuccess;
}
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr || rank == nullptr) return ncclInvalidArgument;
  *rank = comm->state->rank;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) return refuse(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--group_depth > 0) return ncclSuccess;
  std::vector<pending> work;
  work.swap(group_work);
  ncclResult_t result = ncclSuccess;
  for (auto& p : work)
    if (const ncclResult_t r = p.first(); r != ncclSuccess && result == ncclSuccess) result = r;
  for (auto& p : work)
    if (p.second)
      if (const ncclResult_t r = p.second(); r != ncclSuccess && result == ncclSuccess) result = r;
  return result;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  const std::size_t b = count * type_size(type);
  return launch_collective(comm, stream, header{1, static_cast<long long>(count), type, op, 0, 0, 0}, send, recv, b, b, "ncclAllReduce");
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm, cudaStream_t stream) {
  comm_state* c = usable(comm);
  const std::size_t b = count * type_size(type);
  const bool is_root = c != nullptr && c->rank == root;
  if (c != nullptr && (root < 0 || root >= c->nranks)) return refuse(ncclInvalidArgument, "ncclBroadcast: root is not a rank");
  return launch_collective(comm, stream, header{2, static_cast<long long>(count), type, 0, root, 0, 0}, send, recv, is_root ? b : 0, b,
                           "ncclBroadcast");
}

ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, int root, ncclComm_t comm,
                        cudaStream_t stream) {
  comm_state* c = usable(comm);
  const std::size_t b = count * type_size(type);
  const bool is_root = c != nullptr && c->rank == root;
  if (c != nullptr && (root < 0 || root >= c->nranks)) return refuse(ncclInvalidArgument, "ncclReduce: root is not a rank");
  return launch_collective(comm, stream, header{3, static_cast<long long>(count), type, op, root, 0, 0}, send, recv, b, is_root ? b : 0,
                           "ncclReduce");
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type, ncclComm_t comm, cudaStream_t stream) {
  comm_state* c = usable(comm);
  const std::size_t b = count * type_size(type);
  return launch_collective(comm, stream, header{4, static_cast<long long>(count), type, 0, 0, 0, 0}, send, recv, b,
                           c != nullptr ? b * static_cast<std::size_t>(c->nranks) : 0, "ncclAllGather");
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  comm_state* c = usable(comm);
  const std::size_t b = count * type_size(type);
  return launch_collective(comm, stream, header{5, static_cast<long long>(count), type, op, 0, 0, 0}, send, recv,
                           c != nullptr ? b * static_cast<std::size_t>(c->nranks) : 0, b, "ncclReduceScatter");
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
  return launch_transfer(comm, stream, true, send, static_cast<long long>(count), type, peer, "ncclSend");
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
  return launch_transfer(comm, stream, false, recv, static_cast<long long>(count), type, peer, "ncclRecv");
}

}  // extern "C"
