// tests/cuda_sim/src/runtime.cpp: the simulated CUDA runtime: devices, device memory the
// host cannot touch, streams that run their work on threads of their own, events, copies
// and the simulator's kernel launch. See tests/cuda_sim/README.md for the rules it checks.
#include "sim.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <unordered_map>

#include <execinfo.h>
#include <sys/mman.h>
#include <unistd.h>

namespace cuda_sim {

namespace {

double env_number(const char* name, double fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (end == text || *end != '\0') fatal(std::string(name) + " is \"" + text + "\"; give a number");
  return v;
}

thread_local cudaError_t last_error = cudaSuccess;
thread_local int current = 0;
thread_local bool stream_thread = false;

// ---- device memory: one reserved range per device, PROT_NONE outside device work ----

constexpr std::size_t arena_bytes = std::size_t{32} << 30;  // address space only (MAP_NORESERVE)
constexpr std::size_t block_align = 256;

struct arena {
  char* base = nullptr;
  std::size_t top = 0;                             ///< bytes handed out so far from the start
  std::multimap<std::size_t, std::size_t> free_by_size;  ///< size -> offset of a free block
};

struct memory_state {
  std::mutex mutex;  ///< allocations, arenas' tops, and the protection changes
  std::vector<arena> arenas;
  std::map<char*, allocation> live;  ///< by base
  int active_work = 0;               ///< device work running now (on any stream)
  std::set<std::pair<int, int>> pool_grants, peers;  ///< (owner, accessor), (device, peer)
  std::map<const char*, std::size_t> pinned;          ///< pinned host blocks
};

memory_state& memory() {
  static memory_state* m = new memory_state();  // never destroyed: streams may run at exit
  return *m;
}

std::size_t page_size() {
  static const std::size_t p = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return p;
}
std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// arenas never move once made, so the signal handler may read them without a lock
char* arena_bases[64] = {};
std::atomic<int> arena_count{0};

void protect_all(memory_state& m, int prot) {
  for (auto& a : m.arenas)
    if (a.top > 0) mprotect(a.base, round_up(a.top, page_size()), prot);
}

void on_segv(int sig, siginfo_t* info, void* context);
struct sigaction previous_segv {};

void make_arenas(memory_state& m) {
  if (!m.arenas.empty()) return;
  const int n = config().devices;
  m.arenas.resize(static_cast<std::size_t>(n));
  for (int d = 0; d < n; ++d) {
    void* p = mmap(nullptr, arena_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fatal("cannot reserve address space for the memory of device " + std::to_string(d));
    m.arenas[static_cast<std::size_t>(d)].base = static_cast<char*>(p);
    arena_bases[d] = static_cast<char*>(p);
  }
  arena_count.store(n, std::memory_order_release);
  struct sigaction handler {};
  handler.sa_sigaction = on_segv;
  handler.sa_flags = SA_SIGINFO;
  sigemptyset(&handler.sa_mask);
  sigaction(SIGSEGV, &handler, &previous_segv);
}

void write_text(const char* text) {
  const ssize_t r = ::write(2, text, std::strlen(text));
  (void)r;
}

void on_segv(int sig, siginfo_t* info, void* context) {
  const char* address = static_cast<const char*>(info->si_addr);
  for (int d = 0; d < arena_count.load(std::memory_order_acquire); ++d) {
    if (address < arena_bases[d] || address >= arena_bases[d] + arena_bytes) continue;
    char text[256];
    std::snprintf(text, sizeof text,
                  "pdo cuda simulator: host code touched the memory of device %d at %p; on a GPU this is a crash. Device memory "
                  "is read and written only by device work (kernels, copies, collectives on a stream). Host stack:\n",
                  d, info->si_addr);
    write_text(text);
    void* frames[64];
    const int n = backtrace(frames, 64);
    backtrace_symbols_fd(frames, n, 2);
    std::signal(SIGABRT, SIG_DFL);
    std::abort();
  }
  // not device memory: what would have happened without the simulator
  sigaction(SIGSEGV, &previous_segv, nullptr);
  (void)sig;
  (void)context;
}

// ---- streams ----

struct stream_registry {
  std::mutex mutex;
  std::set<stream*> live;
  std::vector<std::unique_ptr<stream>> defaults;  ///< per device, made on first use
};
stream_registry& streams() {
  static stream_registry* r = new stream_registry();
  return *r;
}

// ---- events ----

struct event_state {
  int device = 0;
  std::mutex mutex;
  std::condition_variable done;
  std::uint64_t recorded = 0, completed = 0;
};
struct event_handle {
  std::shared_ptr<event_state> state;
};
std::mutex events_mutex;
std::set<event_handle*> live_events;

event_handle* handle_of(cudaEvent_t e) {
  auto* h = reinterpret_cast<event_handle*>(e);
  std::lock_guard lock(events_mutex);
  return live_events.count(h) != 0 ? h : nullptr;
}

std::atomic<unsigned long long> staged_peer_copies{0}, device_operations{0};

/// @brief Which side of a copy a pointer is on, checked against the range it covers.
enum class side { host, device, bad };
side side_of(const void* p, std::size_t bytes, const allocation** where) {
  bool overruns = false;
  const allocation* a = find_allocation(p, bytes, &overruns);
  if (where != nullptr) *where = a;
  if (overruns) return side::bad;
  if (a != nullptr) return side::device;
  if (device_of_address(p) >= 0) return side::bad;  // device memory outside any live allocation
  return side::host;
}

/// @brief Checks that `stream_device` may use the device memory `a` in a copy. Between
/// devices that can reach each other the copy is direct, and memory of another device's pool
/// is reachable only where its pool grants access (cudaMemPoolSetAccess: pool allocations
/// do not follow cudaDeviceEnablePeerAccess); between devices that cannot, the driver stages
/// the copy through the host.
cudaError_t check_reach(const allocation* a, int stream_device, const char* call) {
  if (a == nullptr || a->device == stream_device) return cudaSuccess;
  if (!config().peer) {
    staged_peer_copies.fetch_add(1, std::memory_order_relaxed);
    return cudaSuccess;
  }
  if (a->pooled && !pool_access(a->device, stream_device))
    return fail(cudaErrorInvalidValue, std::string(call) + ": memory of device " + std::to_string(a->device) +
                                           "'s pool used by device " + std::to_string(stream_device) +
                                           " without cudaMemPoolSetAccess");
  if (!peer_enabled(stream_device, a->device)) staged_peer_copies.fetch_add(1, std::memory_order_relaxed);
  return cudaSuccess;
}

cudaError_t memcpy_checked(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t s, const char* call,
                           std::size_t rows = 1, std::size_t dpitch = 0, std::size_t spitch = 0) {
  stream* st = stream_of(s);
  if (st == nullptr) return fail(cudaErrorInvalidResourceHandle, std::string(call) + ": not a live stream");
  if (bytes == 0 || rows == 0) return cudaSuccess;
  const std::size_t dspan = (rows - 1) * dpitch + bytes, sspan = (rows - 1) * spitch + bytes;
  const allocation *da = nullptr, *sa = nullptr;
  const side d = side_of(dst, dspan, &da), sr = side_of(src, sspan, &sa);
  if (d == side::bad || sr == side::bad)
    return fail(cudaErrorInvalidValue, std::string(call) + ": a range runs past its device allocation, or is freed device memory");
  const bool want_dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool want_src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind != cudaMemcpyDefault && ((d == side::device) != want_dst_device || (sr == side::device) != want_src_device))
    return fail(cudaErrorInvalidMemcpyDirection, std::string(call) + ": the pointers do not match the copy's direction");
  if (cudaError_t e = check_reach(da, st->device(), call); e != cudaSuccess) return e;
  if (cudaError_t e = check_reach(sa, st->device(), call); e != cudaSuccess) return e;
  st->count_copy();
  auto run = [=] {
    for (std::size_t r = 0; r < rows; ++r) std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, bytes);
  };
  const bool host_dst = d == side::host, host_src = sr == side::host;
  // the documented behaviour of copies with pageable host memory: synchronous
  if ((host_dst && !is_pinned(dst)) || (host_src && !is_pinned(src))) {
    st->synchronize();
    device_work w;
    device_operations.fetch_add(1, std::memory_order_relaxed);
    run();
    return cudaSuccess;
  }
  operation op{run, true, call, host_dst ? dst : host_src ? src : nullptr, host_dst ? dspan : host_src ? sspan : 0};
  st->enqueue(std::move(op));
  return cudaSuccess;
}

}  // namespace

// ---- shared pieces ----

const settings& config() {
  static const settings s = [] {
    settings c;
    c.devices = static_cast<int>(env_number("PDO_SIM_DEVICES", 2));
    c.peer = env_number("PDO_SIM_PEER", 1) != 0;
    c.pools = env_number("PDO_SIM_POOLS", 1) != 0;
    c.deadlock_seconds = env_number("PDO_SIM_DEADLOCK_SECONDS", 20);
    if (c.devices < 0 || c.devices > 64) fatal("PDO_SIM_DEVICES must be between 0 and 64");
    return c;
  }();
  return s;
}

void fatal(const std::string& what) {
  std::fprintf(stderr, "pdo cuda simulator: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

cudaError_t fail(cudaError_t e, const std::string& why) {
  if (e != cudaSuccess) {
    last_error = e;
    if (!why.empty() && std::getenv("PDO_SIM_VERBOSE") != nullptr) std::fprintf(stderr, "pdo cuda simulator: %s\n", why.c_str());
  }
  return e;
}

int current_device() { return current; }
bool on_stream_thread() { return stream_thread; }

const allocation* find_allocation(const void* p, std::size_t bytes, bool* overruns) {
  if (overruns != nullptr) *overruns = false;
  auto& m = memory();
  std::lock_guard lock(m.mutex);
  const char* c = static_cast<const char*>(p);
  auto it = m.live.upper_bound(const_cast<char*>(c));
  if (it == m.live.begin()) return nullptr;
  --it;
  const allocation& a = it->second;
  if (c < a.base || c >= a.base + a.size) return nullptr;
  if (overruns != nullptr) *overruns = c + bytes > a.base + a.size;
  return &a;
}

int device_of_address(const void* p) {
  const char* c = static_cast<const char*>(p);
  for (int d = 0; d < arena_count.load(std::memory_order_acquire); ++d)
    if (c >= arena_bases[d] && c < arena_bases[d] + arena_bytes) return d;
  return -1;
}

void* allocate_device(int device, std::size_t bytes, bool pooled) {
  auto& m = memory();
  std::lock_guard lock(m.mutex);
  make_arenas(m);
  arena& a = m.arenas[static_cast<std::size_t>(device)];
  const std::size_t size = round_up(std::max<std::size_t>(bytes, 1), block_align);
  std::size_t offset = 0;
  if (auto fit = a.free_by_size.lower_bound(size); fit != a.free_by_size.end()) {  // best fit among the freed blocks
    offset = fit->second;
    const std::size_t left = fit->first - size;
    a.free_by_size.erase(fit);
    if (left >= block_align) a.free_by_size.emplace(left, offset + size);
  } else {
    if (a.top + size > arena_bytes) return nullptr;
    offset = a.top;
    const std::size_t old_end = round_up(a.top, page_size());
    a.top += size;
    const std::size_t new_end = round_up(a.top, page_size());
    // newly reached pages take the current protection
    if (new_end > old_end && m.active_work > 0) mprotect(a.base + old_end, new_end - old_end, PROT_READ | PROT_WRITE);
  }
  char* p = a.base + offset;
  m.live[p] = allocation{p, std::max<std::size_t>(bytes, 1), device, pooled};  // the bytes asked for: what a range may use
  return p;
}

void free_device(void* p) {
  auto& m = memory();
  allocation a;
  {
    std::lock_guard lock(m.mutex);
    auto it = m.live.find(static_cast<char*>(p));
    if (it == m.live.end()) return;
    a = it->second;
    m.live.erase(it);
  }
  const std::size_t block = round_up(a.size, block_align);
  {
    device_work w;  // poison: NaN for floating-point data, so use after free shows
    std::memset(a.base, 0xff, block);
  }
  std::lock_guard lock(m.mutex);
  arena& home = m.arenas[static_cast<std::size_t>(a.device)];
  home.free_by_size.emplace(block, static_cast<std::size_t>(a.base - home.base));
}

bool pool_access(int owner, int accessor) {
  auto& m = memory();
  std::lock_guard lock(m.mutex);
  return owner == accessor || m.pool_grants.count({owner, accessor}) != 0;
}
void grant_pool_access(int owner, int accessor) {
  auto& m = memory();
  std::lock_guard lock(m.mutex);
  m.pool_grants.insert({owner, accessor});
}
bool peer_enabled(int device, int peer) {
  auto& m = memory();
  std::lock_guard lock(m.mutex);
  return device == peer || m.peers.count({device, peer}) != 0;
}

device_work::device_work() {
  auto& m = memory();
  std::lock_guard lock(m.mutex);
  if (m.active_work++ == 0) protect_all(m, PROT_READ | PROT_WRITE);
}
device_work::~device_work() {
  auto& m = memory();
  std::lock_guard lock(m.mutex);
  if (--m.active_work == 0) protect_all(m, PROT_NONE);
}

bool is_pinned(const void* p) {
  auto& m = memory();
  std::lock_guard lock(m.mutex);
  const char* c = static_cast<const char*>(p);
  auto it = m.pinned.upper_bound(c);
  if (it == m.pinned.begin()) return false;
  --it;
  return c < it->first + it->second;
}

// ---- streams ----

stream::stream(int device, unsigned) : device_(device) {
  thread_ = std::thread([this] { loop(); });
  std::lock_guard lock(streams().mutex);
  streams().live.insert(this);
}

stream::~stream() {
  {
    std::lock_guard lock(streams().mutex);
    streams().live.erase(this);
  }
  synchronize();
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  work_.notify_all();
  thread_.join();
}

void stream::enqueue(operation op) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(op));
  }
  work_.notify_one();
}

void stream::loop() {
  stream_thread = true;
  current = device_;
  for (;;) {
    operation op;
    {
      std::unique_lock lock(mutex_);
      work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      op = std::move(queue_.front());
      running_ = true;
    }
    if (op.device) {
      device_work w;
      device_operations.fetch_add(1, std::memory_order_relaxed);
      op.run();
    } else {
      op.run();
    }
    {
      std::lock_guard lock(mutex_);
      queue_.pop_front();
      running_ = false;
    }
    drained_.notify_all();
  }
}

void stream::synchronize() {
  if (stream_thread && current == device_) {
    // a stream's own thread waiting for itself would never return
    std::unique_lock lock(mutex_);
    if (std::this_thread::get_id() == thread_.get_id()) fatal("a stream waited for itself");
  }
  std::unique_lock lock(mutex_);
  drained_.wait(lock, [&] { return queue_.empty(); });
}

bool stream::idle() {
  std::lock_guard lock(mutex_);
  return queue_.empty();
}

bool stream::uses_host_range(const void* p, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  const char* b = static_cast<const char*>(p);
  for (const auto& op : queue_) {
    const char* o = static_cast<const char*>(op.host_begin);
    if (o != nullptr && o < b + bytes && b < o + op.host_bytes) return true;
  }
  return false;
}

stream* stream_of(cudaStream_t s) {
  auto& r = streams();
  if (s == nullptr) {
    const int d = current;
    std::unique_ptr<stream> made;
    {
      std::lock_guard lock(r.mutex);
      if (r.defaults.empty()) r.defaults.resize(static_cast<std::size_t>(std::max(config().devices, 1)));
      if (d < 0 || d >= static_cast<int>(r.defaults.size())) return nullptr;
      if (r.defaults[static_cast<std::size_t>(d)]) return r.defaults[static_cast<std::size_t>(d)].get();
    }
    made = std::make_unique<stream>(d, 0);
    std::lock_guard lock(r.mutex);
    if (!r.defaults[static_cast<std::size_t>(d)]) r.defaults[static_cast<std::size_t>(d)] = std::move(made);
    return r.defaults[static_cast<std::size_t>(d)].get();
  }
  auto* p = reinterpret_cast<stream*>(s);
  std::lock_guard lock(r.mutex);
  return r.live.count(p) != 0 ? p : nullptr;
}

std::vector<stream*> all_streams() {
  std::lock_guard lock(streams().mutex);
  return {streams().live.begin(), streams().live.end()};
}

}  // namespace cuda_sim

using namespace cuda_sim;

extern "C" {

// ---- devices ----

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return fail(cudaErrorInvalidValue);
  *count = config().devices;
  return config().devices == 0 ? fail(cudaErrorNoDevice) : cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= config().devices) return fail(cudaErrorInvalidDevice, "cudaSetDevice: no device " + std::to_string(device));
  current = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return fail(cudaErrorInvalidValue);
  if (config().devices == 0) return fail(cudaErrorNoDevice);
  *device = current;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (value == nullptr) return fail(cudaErrorInvalidValue);
  if (device < 0 || device >= config().devices) return fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMemoryPoolsSupported: *value = config().pools ? 1 : 0; break;
    case cudaDevAttrMultiProcessorCount: *value = 1; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    default: return fail(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  if (can == nullptr) return fail(cudaErrorInvalidValue);
  if (device < 0 || device >= config().devices || peer < 0 || peer >= config().devices) return fail(cudaErrorInvalidDevice);
  *can = (config().peer && device != peer) ? 1 : 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
  if (flags != 0) return fail(cudaErrorInvalidValue);
  int can = 0;
  if (cudaError_t e = cudaDeviceCanAccessPeer(&can, current, peer); e != cudaSuccess) return e;
  if (can == 0) return fail(cudaErrorInvalidDevice, "cudaDeviceEnablePeerAccess: device " + std::to_string(current) +
                                                        " cannot access device " + std::to_string(peer));
  auto& m = memory();
  std::lock_guard lock(m.mutex);
  if (!m.peers.insert({current, peer}).second) return fail(cudaErrorPeerAccessAlreadyEnabled);
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  for (stream* s : all_streams())
    if (s->device() == current) s->synchronize();
  if (stream* d = stream_of(nullptr)) d->synchronize();
  return cudaSuccess;
}

// ---- errors ----

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorPeerAccessAlreadyEnabled: return "cudaErrorPeerAccessAlreadyEnabled";
    case cudaErrorPeerAccessNotEnabled: return "cudaErrorPeerAccessNotEnabled";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    default: return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorPeerAccessAlreadyEnabled: return "peer access is already enabled";
    case cudaErrorNotSupported: return "operation not supported";
    default: return "unknown error";
  }
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return last_error; }

// ---- memory ----

cudaError_t cudaMalloc(void** p, size_t size) {
  if (p == nullptr) return fail(cudaErrorInvalidValue);
  if (config().devices == 0) return fail(cudaErrorNoDevice);
  *p = size == 0 ? nullptr : allocate_device(current, size, false);
  return (*p == nullptr && size != 0) ? fail(cudaErrorMemoryAllocation) : cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  const allocation* a = find_allocation(p);
  if (a == nullptr || a->base != p) return fail(cudaErrorInvalidValue, "cudaFree: not the start of a device allocation");
  const int device = a->device;
  for (stream* s : all_streams())  // cudaFree waits for the device's work, as CUDA's does
    if (s->device() == device) s->synchronize();
  free_device(p);
  return cudaSuccess;
}

cudaError_t cudaMallocAsync(void** p, size_t size, cudaStream_t s) {
  if (p == nullptr) return fail(cudaErrorInvalidValue);
  if (!config().pools) return fail(cudaErrorNotSupported, "cudaMallocAsync: the device has no memory pools (PDO_SIM_POOLS=0)");
  stream* st = stream_of(s);
  if (st == nullptr) return fail(cudaErrorInvalidResourceHandle);
  *p = size == 0 ? nullptr : allocate_device(st->device(), size, true);
  return (*p == nullptr && size != 0) ? fail(cudaErrorMemoryAllocation) : cudaSuccess;
}

cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  if (p == nullptr) return cudaSuccess;
  stream* st = stream_of(s);
  if (st == nullptr) return fail(cudaErrorInvalidResourceHandle);
  const allocation* a = find_allocation(p);
  if (a == nullptr || a->base != p) return fail(cudaErrorInvalidValue, "cudaFreeAsync: not the start of a device allocation");
  // stream-ordered: freed (and poisoned) when the stream reaches it
  st->enqueue(operation{[p] { free_device(p); }, false, "cudaFreeAsync"});
  return cudaSuccess;
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  if (pool == nullptr) return fail(cudaErrorInvalidValue);
  if (device < 0 || device >= config().devices) return fail(cudaErrorInvalidDevice);
  if (!config().pools) return fail(cudaErrorNotSupported);
  *pool = reinterpret_cast<cudaMemPool_t>(static_cast<std::uintptr_t>(device + 1));
  return cudaSuccess;
}

cudaError_t cudaMemPoolSetAccess(cudaMemPool_t pool, const cudaMemAccessDesc* list, size_t count) {
  const int owner = static_cast<int>(reinterpret_cast<std::uintptr_t>(pool)) - 1;
  if (owner < 0 || owner >= config().devices || (list == nullptr && count != 0)) return fail(cudaErrorInvalidValue);
  for (size_t i = 0; i < count; ++i) {
    const int accessor = list[i].location.id;
    if (list[i].location.type != cudaMemLocationTypeDevice || accessor < 0 || accessor >= config().devices)
      return fail(cudaErrorInvalidValue);
    if (accessor != owner && list[i].flags == cudaMemAccessFlagsProtReadWrite) grant_pool_access(owner, accessor);
  }
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** p, size_t size, unsigned int) {
  if (p == nullptr) return fail(cudaErrorInvalidValue);
  *p = std::aligned_alloc(4096, round_up(std::max<size_t>(size, 1), 4096));
  if (*p == nullptr) return fail(cudaErrorMemoryAllocation);
  auto& m = memory();
  std::lock_guard lock(m.mutex);
  m.pinned[static_cast<const char*>(*p)] = size;
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t size) { return cudaHostAlloc(p, size, 0); }

cudaError_t cudaFreeHost(void* p) {
  if (p == nullptr) return cudaSuccess;
  std::size_t size = 0;
  {
    auto& m = memory();
    std::lock_guard lock(m.mutex);
    auto it = m.pinned.find(static_cast<const char*>(p));
    if (it == m.pinned.end()) return fail(cudaErrorInvalidValue, "cudaFreeHost: not pinned memory");
    size = it->second;
  }
  for (stream* s : all_streams())
    if (s->uses_host_range(p, size))
      fatal("cudaFreeHost of pinned memory that a queued copy still reads or writes (device " + std::to_string(s->device()) +
            "); wait for the copy (an event, or its stream) before freeing the buffer");
  {
    auto& m = memory();
    std::lock_guard lock(m.mutex);
    m.pinned.erase(static_cast<const char*>(p));
  }
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t s) {
  return memcpy_checked(dst, src, count, kind, s, "cudaMemcpyAsync");
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  if (cudaError_t e = memcpy_checked(dst, src, count, kind, nullptr, "cudaMemcpy"); e != cudaSuccess) return e;
  stream_of(nullptr)->synchronize();
  return cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height, cudaMemcpyKind kind,
                              cudaStream_t s) {
  if (width > dpitch || width > spitch) return fail(cudaErrorInvalidValue, "cudaMemcpy2DAsync: width exceeds a pitch");
  return memcpy_checked(dst, src, width, kind, s, "cudaMemcpy2DAsync", height, dpitch, spitch);
}

cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_device, const void* src, int src_device, size_t count, cudaStream_t s) {
  const allocation *da = find_allocation(dst, count), *sa = find_allocation(src, count);
  if (count != 0 && (da == nullptr || sa == nullptr || da->device != dst_device || sa->device != src_device))
    return fail(cudaErrorInvalidValue, "cudaMemcpyPeerAsync: a pointer is not device memory of the device named");
  return memcpy_checked(dst, src, count, cudaMemcpyDeviceToDevice, s, "cudaMemcpyPeerAsync");
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t count, cudaStream_t s) {
  stream* st = stream_of(s);
  if (st == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (count == 0) return cudaSuccess;
  bool overruns = false;
  const allocation* a = find_allocation(p, count, &overruns);
  if (a == nullptr || overruns) return fail(cudaErrorInvalidValue, "cudaMemsetAsync: not device memory, or past its allocation");
  if (cudaError_t e = check_reach(a, st->device(), "cudaMemsetAsync"); e != cudaSuccess) return e;
  st->count_copy();
  st->enqueue(operation{[=] { std::memset(p, value, count); }, true, "cudaMemsetAsync"});
  return cudaSuccess;
}

// ---- streams and events ----

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  if (s == nullptr) return fail(cudaErrorInvalidValue);
  if (config().devices == 0) return fail(cudaErrorNoDevice);
  *s = reinterpret_cast<cudaStream_t>(new stream(current, flags));
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  stream* st = s == nullptr ? nullptr : stream_of(s);
  if (st == nullptr) return fail(cudaErrorInvalidResourceHandle);
  delete st;  // its queued work finishes first, as CUDA's
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  stream* st = stream_of(s);
  if (st == nullptr) return fail(cudaErrorInvalidResourceHandle);
  st->synchronize();
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t s) {
  stream* st = stream_of(s);
  if (st == nullptr) return fail(cudaErrorInvalidResourceHandle);
  return st->idle() ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamGetDevice(cudaStream_t s, int* device) {
  stream* st = stream_of(s);
  if (st == nullptr || device == nullptr) return fail(cudaErrorInvalidResourceHandle);
  *device = st->device();
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* data) {
  stream* st = stream_of(s);
  if (st == nullptr || fn == nullptr) return fail(cudaErrorInvalidResourceHandle);
  st->enqueue(operation{[fn, data] { fn(data); }, false, "cudaLaunchHostFunc"});  // a host function: not device work
  return cudaSuccess;
}

cudaError_t cudaSimLaunchKernel(cudaStream_t s, unsigned long long n, void (*body)(void*, unsigned long long, unsigned long long), void* args,
                                void (*release)(void*)) {
  stream* st = stream_of(s);
  if (st == nullptr || body == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (st->device() != current)
    return fail(cudaErrorInvalidResourceHandle, "a kernel launched on a stream of device " + std::to_string(st->device()) +
                                                    " while device " + std::to_string(current) + " is current");
  st->enqueue(operation{[=] {
                          body(args, 0, n);
                          if (release != nullptr) release(args);
                        },
                        true, "kernel"});
  return cudaSuccess;
}

cudaError_t cudaSimStreamCopies(cudaStream_t s, unsigned long long* copies) {
  stream* st = stream_of(s);
  if (st == nullptr || copies == nullptr) return fail(cudaErrorInvalidValue);
  *copies = st->copies();
  return cudaSuccess;
}

cudaError_t cudaSimGetStats(cudaSimStats* stats) {
  if (stats == nullptr) return fail(cudaErrorInvalidValue);
  stats->driver_staged_peer_copies = staged_peer_copies.load();
  stats->device_work = device_operations.load();
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  if (e == nullptr) return fail(cudaErrorInvalidValue);
  auto* h = new event_handle{std::make_shared<event_state>()};
  h->state->device = current;
  std::lock_guard lock(events_mutex);
  live_events.insert(h);
  *e = reinterpret_cast<cudaEvent_t>(h);
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  event_handle* h = handle_of(e);
  stream* st = stream_of(s);
  if (h == nullptr || st == nullptr) return fail(cudaErrorInvalidResourceHandle);
  auto state = h->state;
  if (state->device != st->device())
    return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: an event of device " + std::to_string(state->device) +
                                                    " recorded on a stream of device " + std::to_string(st->device()));
  std::uint64_t mark = 0;
  {
    std::lock_guard lock(state->mutex);
    mark = ++state->recorded;
  }
  st->enqueue(operation{[state, mark] {
                          std::lock_guard lock(state->mutex);
                          state->completed = std::max(state->completed, mark);
                          state->done.notify_all();
                        },
                        false, "cudaEventRecord"});
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
  event_handle* h = handle_of(e);
  stream* st = stream_of(s);
  if (h == nullptr || st == nullptr || flags != 0) return fail(cudaErrorInvalidResourceHandle);
  auto state = h->state;
  std::uint64_t target = 0;
  {
    std::lock_guard lock(state->mutex);
    target = state->recorded;  // the record made most recently before this call
  }
  st->enqueue(operation{[state, target] {
                          std::unique_lock lock(state->mutex);
                          if (!state->done.wait_for(lock, std::chrono::duration<double>(config().deadlock_seconds),
                                                    [&] { return state->completed >= target; }))
                            fatal("a stream waited " + std::to_string(config().deadlock_seconds) +
                                  " s for an event that never completed: a deadlock between streams");
                        },
                        false, "cudaStreamWaitEvent"});
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  event_handle* h = handle_of(e);
  if (h == nullptr) return fail(cudaErrorInvalidResourceHandle);
  auto state = h->state;
  std::unique_lock lock(state->mutex);
  const std::uint64_t target = state->recorded;
  state->done.wait(lock, [&] { return state->completed >= target; });
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  event_handle* h = handle_of(e);
  if (h == nullptr) return fail(cudaErrorInvalidResourceHandle);
  std::lock_guard lock(h->state->mutex);
  return h->state->completed >= h->state->recorded ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  event_handle* h = handle_of(e);
  if (h == nullptr) return fail(cudaErrorInvalidResourceHandle);
  {
    std::lock_guard lock(events_mutex);
    live_events.erase(h);
  }
  delete h;  // a queued record or wait keeps the state alive
  return cudaSuccess;
}

}  // extern "C"
