// libmoe_echo_gin_ipc.so: a TEST-ONLY NCCL RMA plugin (ncclRmaPlugin_v14) that lets NCCL's GIN
// proxy run between the processes of one host without a network: no InfiniBand NIC, no GDRCopy,
// no CPU mapping of GPU memory. Load it with NCCL_RMA_PLUGIN=/abs/path/libmoe_echo_gin_ipc.so.
//
// NCCL's GIN proxy thread reads the GPU's put requests from host memory and calls iput /
// iputSignal here. The source sends a message to the target over an AF_UNIX socket; the target
// (in its own progress, which NCCL calls all the time) copies the data straight out of the
// source's GPU memory, mapped into it with CUDA IPC when the memory was registered, with
// cuMemcpyAsync on a non-blocking stream of its own, then adds to the signal word with a
// one-thread kernel on the same stream (NCCL allocates the signal words without a shareable
// handle, so only the target's process can write them), records an event and, once the event has
// completed, acks the source, whose `test` then reports the request done. One stream per
// connection keeps every put and signal in the order they were sent, which is what strong
// signals need. Inline values (putValue) live in the source's host memory and travel in the
// message. Registrations are collective (every rank registers in the same order), so each one
// exchanges its shareable handle (a POSIX fd over SCM_RIGHTS, or a fabric handle) with every
// peer and maps theirs.
//
// Nothing here blocks NCCL's progress thread; the waits of connect, registration and teardown
// are bounded by MOE_ECHO_GIN_IPC_TIMEOUT_S (60 s).
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "rma_abi.hpp"

namespace {

namespace abi = moe_echo::gin_ipc::abi;
using abi::Result;
using Clock = std::chrono::steady_clock;

std::atomic<abi::Logger> g_logger{nullptr};
std::atomic<int> g_refs{0};

void say(int level, unsigned long flags, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
void say(int level, unsigned long flags, int line, const char* fmt, ...) {
  char text[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  if (abi::Logger log = g_logger.load())
    log(level, flags, __FILE__, line, "GIN IPC: %s", text);
  else if (level == abi::kLogWarn)
    std::fprintf(stderr, "GIN IPC: %s\n", text);
}
#define WARN(...) say(abi::kLogWarn, abi::kSubsysAll, __LINE__, __VA_ARGS__)
#define INFO(...) say(abi::kLogInfo, abi::kSubsysInit | abi::kSubsysNet, __LINE__, __VA_ARGS__)

bool cu_ok(CUresult r, const char* what, int line) {
  if (r == CUDA_SUCCESS) return true;
  const char* s = nullptr;
  cuGetErrorString(r, &s);
  say(abi::kLogWarn, abi::kSubsysAll, line, "%s failed: %s", what, s ? s : "unknown CUDA error");
  return false;
}
#define CU(call) cu_ok((call), #call, __LINE__)

Clock::time_point deadline() {
  const char* s = std::getenv("MOE_ECHO_GIN_IPC_TIMEOUT_S");
  const double v = s ? std::atof(s) : 0.0;
  return Clock::now() + std::chrono::milliseconds(int64_t((v > 0 ? v : 60.0) * 1e3));
}

// Waits (bounded) until fd is ready for `events`.
bool wait_fd(int fd, short events, Clock::time_point until) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    if (left < 0) return false;
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, int(left > 1000 ? 1000 : left));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

// The signal kernel, JIT-compiled by the driver at connect: stores `len` (<= 8) bytes of `bits` at
// `dst` (putValue), then adds `add` to the 64-bit word at `sig` with release semantics (if sig).
// One thread; the copies before it on the stream have completed when it runs.
const char kApplyPtx[] = R"(
.version 7.0
.target sm_70
.address_size 64
.visible .entry moe_echo_gin_ipc_apply(.param .u64 dst, .param .u64 bits, .param .u32 len,
                                       .param .u64 sig, .param .u64 add)
{
  .reg .pred %p<3>;
  .reg .b32 %r<4>;
  .reg .b64 %rd<8>;
  ld.param.u64 %rd1, [dst];
  ld.param.u64 %rd2, [bits];
  ld.param.u32 %r1, [len];
  ld.param.u64 %rd3, [sig];
  ld.param.u64 %rd4, [add];
  mov.u32 %r2, 0;
STORE:
  setp.ge.u32 %p1, %r2, %r1;
  @%p1 bra SIGNAL;
  cvt.u64.u32 %rd5, %r2;
  add.u64 %rd6, %rd1, %rd5;
  cvt.u32.u64 %r3, %rd2;
  st.global.u8 [%rd6], %r3;
  shr.u64 %rd2, %rd2, 8;
  add.u32 %r2, %r2, 1;
  bra STORE;
SIGNAL:
  setp.eq.u64 %p2, %rd3, 0;
  @%p2 bra DONE;
  red.release.gpu.global.add.u64 [%rd3], %rd4;
DONE:
  ret;
}
)";

constexpr uint32_t kMagic = 0x6d656769;  // "megi"
constexpr uint32_t kVersion = 1;
constexpr uint64_t kNoRegion = ~0ull;
constexpr int kMaxInflightOps = 512;  // stream operations issued and not retired

// What listen() writes into NCCL's handle, allgathered by NCCL before connect().
struct Handle {
  uint32_t magic, version;
  uint64_t nonce;  // a connecting peer must present it
  uint64_t host;   // hash of the kernel's boot id: every rank must be on this host
  int32_t pid;
  uint32_t nameLen;
  char name[88];  // abstract AF_UNIX address, without its leading NUL
};
static_assert(sizeof(Handle) <= abi::kHandleMaxSize, "the handle must fit NCCL's 128 bytes");

struct Hello {           // the first message on every connection
  uint32_t magic, kind;  // kind 0: registrations, 1: puts and acks
  uint64_t nonce;
  int32_t rank, pad;
};

enum : uint32_t { kPut = 1, kAck = 2 };
constexpr uint32_t kDropped = 1;  // ack flag: the target had no such region (deregistered)
struct Msg {
  uint32_t kind, status;  // status: the ack's Result
  uint64_t id;            // the source's request id
  uint64_t dstRegion, dstOff, size;
  uint64_t srcRegion, srcOff;
  uint64_t sigRegion, sigOff, sigAdd;  // sigRegion == kNoRegion: no signal
  uint64_t bits;                       // the inline value, inlineLen bytes
  uint32_t inlineLen, flags;
};

// A registration as its owner describes it to every peer (with the fd attached when kind == 1).
struct RegDesc {
  uint32_t magic, kind;  // 0 not shareable, 1 POSIX fd, 2 fabric handle
  uint64_t region, mapSize, offset, size;
  unsigned char fabric[64];
};
static_assert(sizeof(CUmemFabricHandle) == 64, "fabric handle size");

struct PeerMap {  // a peer's registration mapped into this process
  CUdeviceptr va = 0;
  size_t mapSize = 0, offset = 0;
};

struct Comm;
struct Reg {
  uint32_t magic = kMagic;
  Comm* comm = nullptr;
  uint64_t region = 0;  // the same on every rank: the registration's number on this connection
  int type = 0;
  char* addr = nullptr;
  size_t size = 0;
  bool shareable = false, ready = false;
  std::vector<PeerMap> peers;
};

struct Request {
  Comm* comm = nullptr;
  uint32_t index = 0, gen = 0;
  bool busy = false, done = false;
  Result status = abi::kSuccess;
  int peer = -1;
  uint64_t id() const { return uint64_t(gen) << 32 | index; }
};

struct Done {  // what an issued operation acks once the batch's event completes
  int peer;    // == this rank: a request of this process completes
  uint64_t id;
  Result status;
  uint32_t flags;
};
struct Batch {
  CUevent ev;
  std::vector<Done> dones;
  int ops;  // stream operations it covers
};

struct Listener {
  uint32_t magic = kMagic;
  int fd = -1;
  uint64_t nonce = 0;
};

struct Comm {
  uint32_t magic = kMagic;
  int rank = 0, nranks = 0;
  CUcontext ctx = nullptr;
  CUdevice dev = 0;
  bool retainedPrimary = false;
  CUstream stream = nullptr;
  CUmodule module = nullptr;
  CUfunction apply = nullptr;
  std::vector<int> outCtrl, inCtrl, outData, inData;  // by peer; -1 for this rank
  std::vector<bool> outClosed, inClosed;
  std::vector<std::deque<Msg>> sendQ, ackQ;  // puts for outData, acks for inData
  std::deque<std::pair<int, Msg>> work;      // puts received, not issued yet
  std::deque<Batch> inflight;
  int inflightOps = 0;
  std::vector<CUevent> events;
  std::deque<Request> requests;
  std::vector<uint32_t> freeRequests;
  std::map<uint64_t, Reg*> regs;
  uint64_t nextRegion = 0;
  Result error = abi::kSuccess;
  bool droppedLogged = false;
  std::vector<pollfd> pfds;
  std::vector<std::pair<int, bool>> pollPeers;  // (peer, outgoing connection) of each pfds entry
  std::mutex mu;                                // everything above
  std::mutex ctrlMu;  // the registration sockets (regMrSym runs outside mu: it waits for peers)
};

struct RmaCtx {
  uint32_t magic = kMagic;
  Comm* comm = nullptr;
  int nContexts = 1;
};

template <typename T>
T* checked(void* p, const char* what) {
  auto* t = static_cast<T*>(p);
  if (!t || t->magic != kMagic) {
    WARN("invalid %s %p", what, p);
    return nullptr;
  }
  return t;
}

struct CtxScope {  // the connection's CUDA context, current on this thread for the scope
  explicit CtxScope(CUcontext c) : ok(CU(cuCtxPushCurrent(c))) {}
  ~CtxScope() {
    CUcontext prev;
    if (ok) cuCtxPopCurrent(&prev);
  }
  bool ok;
};

uint64_t host_hash() {
  char id[64] = {};
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    if (!std::fgets(id, sizeof id, f)) id[0] = 0;
    std::fclose(f);
  }
  uint64_t h = 1469598103934665603ull;
  for (const char* c = id; *c; ++c) h = (h ^ uint8_t(*c)) * 1099511628211ull;
  return h;
}

sockaddr_un address(const char* name, uint32_t len, socklen_t* alen) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path + 1, name, len);  // sun_path[0] == 0: the abstract namespace
  *alen = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + len);
  return a;
}

bool send_all(int fd, const void* p, size_t n, Clock::time_point until) {
  if (!wait_fd(fd, POLLOUT, until)) return false;
  return send(fd, p, n, MSG_NOSIGNAL) == ssize_t(n);
}

bool recv_all(int fd, void* p, size_t n, Clock::time_point until) {
  if (!wait_fd(fd, POLLIN, until)) return false;
  return recv(fd, p, n, MSG_DONTWAIT) == ssize_t(n);
}

// ---- data path (all with c.mu held) ----------------------------------------------------------

Request* new_request(Comm& c, int peer) {
  uint32_t i;
  if (!c.freeRequests.empty()) {
    i = c.freeRequests.back();
    c.freeRequests.pop_back();
  } else {
    i = uint32_t(c.requests.size());
    c.requests.emplace_back();
    c.requests.back().index = i;
  }
  Request& r = c.requests[i];
  r.comm = &c;
  r.gen++;
  r.busy = true;
  r.done = false;
  r.status = abi::kSuccess;
  r.peer = peer;
  return &r;
}

void finish(Comm& c, uint64_t id, Result status, uint32_t flags) {
  const uint32_t i = uint32_t(id), gen = uint32_t(id >> 32);
  if (i >= c.requests.size()) return;
  Request& r = c.requests[i];
  if (!r.busy || r.gen != gen || r.done) return;  // a request of a context already destroyed
  r.done = true;
  r.status = status;
  if ((flags & kDropped) && !c.droppedLogged) {
    c.droppedLogged = true;
    INFO("rank %d dropped a put of rank %d: the region was deregistered there", r.peer, c.rank);
  }
}

// Peer p's end of one data connection closed (or failed): requests waiting for its acks fail.
void peer_gone(Comm& c, int p, bool out, const char* why) {
  std::vector<bool>& closed = out ? c.outClosed : c.inClosed;
  if (closed[size_t(p)]) return;
  closed[size_t(p)] = true;
  int lost = 0;
  if (out) {
    for (Request& r : c.requests)
      if (r.busy && !r.done && r.peer == p) r.done = true, r.status = abi::kRemoteError, ++lost;
    c.sendQ[size_t(p)].clear();
  } else {
    c.ackQ[size_t(p)].clear();
  }
  if (lost)
    WARN("rank %d: connection to rank %d lost (%s) with %d operations outstanding", c.rank, p, why,
         lost);
  else
    INFO("rank %d: rank %d closed its connection (%s)", c.rank, p, why);
}

Result receive(Comm& c) {
  c.pfds.clear();
  c.pollPeers.clear();
  for (int p = 0; p < c.nranks; ++p) {
    if (p == c.rank) continue;
    for (bool out : {false, true}) {
      if ((out ? c.outClosed : c.inClosed)[size_t(p)]) continue;
      c.pfds.push_back({(out ? c.outData : c.inData)[size_t(p)], POLLIN, 0});
      c.pollPeers.emplace_back(p, out);
    }
  }
  if (c.pfds.empty() || poll(c.pfds.data(), c.pfds.size(), 0) <= 0) return abi::kSuccess;
  for (size_t k = 0; k < c.pfds.size(); ++k) {
    if (!c.pfds[k].revents) continue;
    const auto [p, out] = c.pollPeers[k];
    for (int n = 0; n < 256; ++n) {
      Msg m;
      const ssize_t got = recv(c.pfds[k].fd, &m, sizeof m, MSG_DONTWAIT);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (got <= 0) {
        peer_gone(c, p, out, got == 0 ? "closed" : std::strerror(errno));
        break;
      }
      if (got != ssize_t(sizeof m) || m.kind != (out ? kAck : kPut)) {
        WARN("rank %d: malformed message from rank %d (%zd bytes, kind %u)", c.rank, p, got,
             m.kind);
        return abi::kInternalError;
      }
      if (out)
        finish(c, m.id, Result(m.status), m.flags);
      else
        c.work.emplace_back(p, m);
    }
  }
  return abi::kSuccess;
}

Reg* find(Comm& c, uint64_t region) {
  auto it = c.regs.find(region);
  return it == c.regs.end() ? nullptr : it->second;
}

// Where [off, off + n) of peer p's copy of `g` is in this process, or 0.
CUdeviceptr peer_ptr(Comm& c, Reg& g, int p, uint64_t off, uint64_t n) {
  if (off > g.size || n > g.size - off) return 0;
  if (p == c.rank) return CUdeviceptr(g.addr + off);
  const PeerMap& m = g.peers[size_t(p)];
  return m.va ? m.va + m.offset + off : 0;
}

enum class Verdict { kIssued, kRetry, kCudaFailed };

// Issues one put that peer p sent: the copy out of p's memory, then the inline store and the
// signal. A region unknown here was deregistered: the put is dropped (acked as such).
Verdict issue_put(Comm& c, int p, const Msg& m, Done& d, int* ops) {
  Reg* dst = m.size ? find(c, m.dstRegion) : nullptr;
  Reg* src = m.size && !m.inlineLen ? find(c, m.srcRegion) : nullptr;
  Reg* sig = m.sigRegion != kNoRegion ? find(c, m.sigRegion) : nullptr;
  if ((m.size && !dst) || (m.size && !m.inlineLen && !src) || (m.sigRegion != kNoRegion && !sig)) {
    d.flags = kDropped;
    return Verdict::kIssued;
  }
  if ((dst && !dst->ready) || (src && !src->ready) || (sig && !sig->ready)) return Verdict::kRetry;
  CUdeviceptr to = 0, from = 0, word = 0;
  const char* bad = nullptr;
  if (m.size) {
    to = dst->type == abi::kPtrCuda ? peer_ptr(c, *dst, c.rank, m.dstOff, m.size) : 0;
    if (!to) bad = "destination not in device memory or out of range";
    if (src && !(from = peer_ptr(c, *src, p, m.srcOff, m.size)))
      bad =
          "source not shared with this process (not a cuMem allocation with a POSIX fd or "
          "fabric handle) or out of range";
    if (m.inlineLen > 8 || (m.inlineLen && m.inlineLen != m.size))
      bad = "inline value over 8 bytes";
  }
  if (sig) {
    word = sig->type == abi::kPtrCuda && m.sigOff % 8 == 0 ? peer_ptr(c, *sig, c.rank, m.sigOff, 8)
                                                           : 0;
    if (!word) bad = "signal not an aligned word of device memory";
  }
  if (bad) {
    WARN("rank %d: put from rank %d (region %lu + %lu, %lu bytes): %s", c.rank, p,
         (unsigned long)m.dstRegion, (unsigned long)m.dstOff, (unsigned long)m.size, bad);
    d.status = abi::kInvalidArgument;
    return Verdict::kIssued;
  }
  if (from && !CU(cuMemcpyAsync(to, from, m.size, c.stream))) return Verdict::kCudaFailed;
  if (m.inlineLen || word) {
    CUdeviceptr store = m.inlineLen ? to : 0;
    uint64_t bits = m.bits, add = m.sigAdd;
    uint32_t len = m.inlineLen;
    void* args[] = {&store, &bits, &len, &word, &add};
    if (!CU(cuLaunchKernel(c.apply, 1, 1, 1, 1, 1, 1, 0, c.stream, args, nullptr)))
      return Verdict::kCudaFailed;
  }
  *ops += int(from != 0) + int(m.inlineLen || word);
  return Verdict::kIssued;
}

Result record(Comm& c, std::vector<Done>&& dones, int ops) {
  CUevent ev;
  if (!c.events.empty()) {
    ev = c.events.back();
    c.events.pop_back();
  } else if (!CU(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING))) {
    return abi::kUnhandledCudaError;
  }
  if (!CU(cuEventRecord(ev, c.stream))) {
    c.events.push_back(ev);
    return abi::kUnhandledCudaError;
  }
  c.inflight.push_back({ev, std::move(dones), ops});
  c.inflightOps += ops;
  return abi::kSuccess;
}

Result issue(Comm& c) {
  std::vector<Done> dones;
  int ops = 0;
  while (!c.work.empty() && c.inflightOps + ops < kMaxInflightOps) {
    const auto& [p, m] = c.work.front();
    Done d{p, m.id, abi::kSuccess, 0};
    const Verdict v = issue_put(c, p, m, d, &ops);
    if (v == Verdict::kRetry) break;  // a registration still mapping peers' memory
    if (v == Verdict::kCudaFailed) return abi::kUnhandledCudaError;
    dones.push_back(d);
    c.work.pop_front();
  }
  return dones.empty() ? abi::kSuccess : record(c, std::move(dones), ops);
}

Result retire(Comm& c) {
  while (!c.inflight.empty()) {
    Batch& b = c.inflight.front();
    const CUresult q = cuEventQuery(b.ev);
    if (q == CUDA_ERROR_NOT_READY) break;
    if (!cu_ok(q, "cuEventQuery", __LINE__)) return abi::kUnhandledCudaError;
    for (const Done& d : b.dones) {
      if (d.peer == c.rank) {
        finish(c, d.id, d.status, d.flags);
      } else if (!c.inClosed[size_t(d.peer)]) {
        Msg a{};
        a.kind = kAck, a.id = d.id, a.status = uint32_t(d.status), a.flags = d.flags;
        c.ackQ[size_t(d.peer)].push_back(a);
      }
    }
    c.inflightOps -= b.ops;
    c.events.push_back(b.ev);
    c.inflight.pop_front();
  }
  return abi::kSuccess;
}

void flush(Comm& c) {
  for (int p = 0; p < c.nranks; ++p) {
    if (p == c.rank) continue;
    for (int out = 0; out < 2; ++out) {
      std::deque<Msg>& q = out ? c.sendQ[size_t(p)] : c.ackQ[size_t(p)];
      const int fd = out ? c.outData[size_t(p)] : c.inData[size_t(p)];
      while (!q.empty()) {
        const ssize_t n = send(fd, &q.front(), sizeof(Msg), MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n == ssize_t(sizeof(Msg))) {
          q.pop_front();
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        peer_gone(c, p, out, n < 0 ? std::strerror(errno) : "short send");
        break;
      }
    }
  }
}

// Everything that can move without waiting. NCCL calls it (through rmaProgress and test) from
// its progress thread, all the time.
Result progress(Comm& c) {
  if (c.error != abi::kSuccess) return c.error;
  Result r = receive(c);
  if (r == abi::kSuccess && (!c.work.empty() || !c.inflight.empty())) {
    CtxScope scope(c.ctx);
    r = !scope.ok ? abi::kUnhandledCudaError : issue(c);
    if (r == abi::kSuccess) r = retire(c);
  }
  if (r == abi::kSuccess) flush(c);
  if (r != abi::kSuccess) c.error = r;
  return r;
}

// Waits (bounded, polling) until the stream has run everything issued on it.
bool drain(Comm& c) {
  const auto until = deadline();
  for (;;) {
    const CUresult q = cuStreamQuery(c.stream);
    if (q == CUDA_SUCCESS) return true;
    if (q != CUDA_ERROR_NOT_READY) return cu_ok(q, "cuStreamQuery", __LINE__);
    if (Clock::now() > until) {
      WARN("rank %d: copies and signals still running at the timeout", c.rank);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void unmap(PeerMap& m) {
  if (!m.va) return;
  CU(cuMemUnmap(m.va, m.mapSize));
  CU(cuMemAddressFree(m.va, m.mapSize));
  m.va = 0;
}

// ---- the plugin's functions ------------------------------------------------------------------

Result plugin_init(void** ctx, uint64_t, abi::Logger log) {
  if (log) g_logger.store(log);
  if (!CU(cuInit(0))) return abi::kUnhandledCudaError;
  if (g_refs.fetch_add(1) == 0)
    INFO("test-only RMA plugin: GIN between the processes of one host over CUDA IPC");
  static int instance;
  if (ctx) *ctx = &instance;
  return abi::kSuccess;
}

Result plugin_devices(int* ndev) {
  *ndev = 1;
  return abi::kSuccess;
}

Result plugin_get_properties(int dev, abi::NetProperties* props) {
  if (dev != 0 || !props) return abi::kInvalidArgument;
  static char name[] = "moe_echo_gin_ipc";
  std::memset(props, 0, sizeof *props);
  props->name = name;
  props->pciPath = nullptr;  // NCCL attaches the device to the first CPU
  props->guid = 0x6d6f655f65636830ull;
  props->ptrSupport = abi::kPtrHost | abi::kPtrCuda;  // no DMA-BUF: single-segment windows only
  props->speed = 400000;
  props->maxComms = 1 << 20;
  props->maxRecvs = 1;
  props->netDeviceType = abi::kDeviceGinProxy;
  props->vProps.ndevs = 1;
  props->maxP2pBytes = props->maxCollBytes = size_t(1) << 30;
  props->maxMultiRequestSize = 1;
  props->railId = props->planeId = abi::kIdUndef;
  return abi::kSuccess;
}

Result plugin_listen(void*, int dev, void* opaque, void** listenComm) {
  if (dev != 0 || !opaque || !listenComm) return abi::kInvalidArgument;
  auto* l = new Listener;
  std::random_device rd;
  l->nonce = (uint64_t(rd()) << 32 | rd()) ^ uint64_t(Clock::now().time_since_epoch().count());
  static std::atomic<uint32_t> serial{0};
  Handle h{};
  h.magic = kMagic, h.version = kVersion, h.nonce = l->nonce, h.host = host_hash(),
  h.pid = getpid();
  const int len = std::snprintf(h.name, sizeof h.name, "moe_echo_gin_ipc.%d.%u.%016llx", int(h.pid),
                                serial.fetch_add(1), (unsigned long long)l->nonce);
  h.nameLen = uint32_t(len);
  socklen_t alen;
  const sockaddr_un a = address(h.name, h.nameLen, &alen);
  l->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (l->fd < 0 || bind(l->fd, reinterpret_cast<const sockaddr*>(&a), alen) != 0 ||
      ::listen(l->fd, 512) != 0) {
    WARN("cannot listen on AF_UNIX address @%s: %s", h.name, std::strerror(errno));
    if (l->fd >= 0) close(l->fd);
    delete l;
    return abi::kSystemError;
  }
  std::memset(opaque, 0, abi::kHandleMaxSize);
  std::memcpy(opaque, &h, sizeof h);
  *listenComm = l;
  return abi::kSuccess;
}

Result plugin_close_listen(void* listenComm) {
  Listener* l = checked<Listener>(listenComm, "listen comm");
  if (!l) return abi::kInvalidArgument;
  close(l->fd);
  l->magic = 0;
  delete l;
  return abi::kSuccess;
}

Result close_comm(Comm* c);

// Connects to every peer twice (registrations, data) and accepts their two connections: a
// connect to a listening AF_UNIX socket completes without the peer's accept, so no rank waits
// for another's connects.
Result plugin_connect(void*, void* handles[], int nranks, int rank, void* listenComm,
                      void** collComm) {
  Listener* l = checked<Listener>(listenComm, "listen comm");
  if (!l || !handles || nranks < 1 || rank < 0 || rank >= nranks || !collComm)
    return abi::kInvalidArgument;
  auto* c = new Comm;
  c->rank = rank, c->nranks = nranks;
  const size_t n = size_t(nranks);
  for (auto* v : {&c->outCtrl, &c->inCtrl, &c->outData, &c->inData}) v->assign(n, -1);
  c->outClosed.assign(n, false), c->inClosed.assign(n, false);
  c->sendQ.resize(n), c->ackQ.resize(n);
  auto fail = [&](Result r) {
    close_comm(c);
    return r;
  };
  const uint64_t host = host_hash();
  for (int p = 0; p < nranks; ++p) {
    const auto* h = static_cast<const Handle*>(handles[p]);
    if (h->magic != kMagic || h->version != kVersion || h->nameLen >= sizeof h->name) {
      WARN("rank %d: rank %d's handle is not this plugin's (version %u)", rank, p, h->version);
      return fail(abi::kInvalidUsage);
    }
    if (h->host != host) {
      WARN("rank %d: rank %d runs on another host; this plugin joins the processes of one host",
           rank, p);
      return fail(abi::kInvalidUsage);
    }
  }
  // CUDA: the context NCCL made current, a stream of our own and the kernel, loaded now (lazy
  // loading later could wait for a running kernel that spins on a signal it is to apply).
  if (!CU(cuCtxGetCurrent(&c->ctx))) return fail(abi::kUnhandledCudaError);
  if (!c->ctx) {
    int d = 0;
    if (cudaGetDevice(&d) != cudaSuccess || !CU(cuDevicePrimaryCtxRetain(&c->ctx, d)))
      return fail(abi::kUnhandledCudaError);
    c->dev = d;
    c->retainedPrimary = true;
  }
  {
    CtxScope scope(c->ctx);
    if (!scope.ok || !CU(cuCtxGetDevice(&c->dev)) ||
        !CU(cuStreamCreate(&c->stream, CU_STREAM_NON_BLOCKING)) ||
        !CU(cuModuleLoadData(&c->module, kApplyPtx)) ||
        !CU(cuModuleGetFunction(&c->apply, c->module, "moe_echo_gin_ipc_apply")))
      return fail(abi::kUnhandledCudaError);
    CUdeviceptr zero = 0;
    uint64_t none = 0;
    uint32_t len = 0;
    void* args[] = {&zero, &none, &len, &zero, &none};
    if (!CU(cuLaunchKernel(c->apply, 1, 1, 1, 1, 1, 1, 0, c->stream, args, nullptr)) || !drain(*c))
      return fail(abi::kUnhandledCudaError);
  }
  const auto until = deadline();
  for (int p = 0; p < nranks; ++p) {
    if (p == rank) continue;
    const auto* h = static_cast<const Handle*>(handles[p]);
    for (uint32_t kind = 0; kind < 2; ++kind) {
      socklen_t alen;
      const sockaddr_un a = address(h->name, h->nameLen, &alen);
      const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
      (kind ? c->outData : c->outCtrl)[size_t(p)] = fd;
      const Hello hello{kMagic, kind, h->nonce, rank, 0};
      if (fd < 0 || ::connect(fd, reinterpret_cast<const sockaddr*>(&a), alen) != 0 ||
          !send_all(fd, &hello, sizeof hello, until)) {
        WARN(
            "rank %d cannot reach rank %d at @%s: %s (every rank must be a process of this host, "
            "in this network namespace)",
            rank, p, h->name, std::strerror(errno));
        return fail(abi::kSystemError);
      }
    }
  }
  for (int k = 0; k < 2 * (nranks - 1); ++k) {
    Hello hello{};
    int fd = -1;
    if (wait_fd(l->fd, POLLIN, until)) fd = accept4(l->fd, nullptr, nullptr, SOCK_CLOEXEC);
    const bool ok = fd >= 0 && recv_all(fd, &hello, sizeof hello, until) && hello.magic == kMagic &&
                    hello.nonce == l->nonce && hello.kind < 2 && hello.rank >= 0 &&
                    hello.rank < nranks && hello.rank != rank;
    int* slot = ok ? &(hello.kind ? c->inData : c->inCtrl)[size_t(hello.rank)] : nullptr;
    if (!slot || *slot >= 0) {
      WARN(
          "rank %d: %d of %d peer connections arrived in time (the rest: timeout or a stray "
          "connection)",
          rank, k, 2 * (nranks - 1));
      if (fd >= 0) close(fd);
      return fail(abi::kRemoteError);
    }
    *slot = fd;
  }
  for (int p = 0; p < nranks; ++p)
    if (p != rank)
      for (int fd : {c->outData[size_t(p)], c->inData[size_t(p)]})
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  INFO("rank %d of %d connected to its peers (AF_UNIX), CUDA device %d", rank, nranks, int(c->dev));
  *collComm = c;
  return abi::kSuccess;
}

Result close_comm(Comm* c) {
  Result r = abi::kSuccess;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    if (c->ctx) {
      CtxScope scope(c->ctx);
      if (c->stream && !drain(*c)) r = abi::kInternalError;
      for (auto& [region, g] : c->regs) {
        if (r == abi::kSuccess)
          for (PeerMap& m : g->peers) unmap(m);
        g->magic = 0;
        delete g;
      }
      for (Batch& b : c->inflight) c->events.push_back(b.ev);
      for (CUevent ev : c->events) cuEventDestroy(ev);
      if (c->stream) cuStreamDestroy(c->stream);
      if (c->module) cuModuleUnload(c->module);
    }
    if (c->retainedPrimary) cuDevicePrimaryCtxRelease(c->dev);
    for (auto* v : {&c->outCtrl, &c->inCtrl, &c->outData, &c->inData})
      for (int fd : *v)
        if (fd >= 0) close(fd);
    c->magic = 0;
  }
  delete c;
  return r;
}

Result plugin_close_coll(void* collComm) {
  Comm* c = checked<Comm>(collComm, "connection");
  return c ? close_comm(c) : abi::kInvalidArgument;
}

Result plugin_create_context(void* collComm, abi::RmaConfig* config, void** rmaCtx) {
  Comm* c = checked<Comm>(collComm, "connection");
  if (!c || !rmaCtx) return abi::kInvalidArgument;
  auto* x = new RmaCtx;
  x->comm = c;
  x->nContexts = config && config->nContexts > 0 ? config->nContexts : 1;
  *rmaCtx = x;
  return abi::kSuccess;
}

Result plugin_destroy_context(void* rmaCtx) {
  RmaCtx* x = checked<RmaCtx>(rmaCtx, "RMA context");
  if (!x) return abi::kInvalidArgument;
  x->magic = 0;
  delete x;
  return abi::kSuccess;
}

// Fills `d` for a registration of [data, data + size): shareable when it is a cuMem allocation
// created with a POSIX fd or fabric handle type (NCCL's windows); NCCL's signal words are not.
void describe(void* data, size_t size, int type, RegDesc* d, int* fd, const char** why) {
  *why = type == abi::kPtrHost ? "host memory" : "not a cuMem allocation";
  CUmemGenericAllocationHandle h;
  if (type != abi::kPtrCuda || cuMemRetainAllocationHandle(&h, data) != CUDA_SUCCESS) return;
  CUdeviceptr base = 0;
  size_t len = 0;
  CUmemAllocationProp prop{};
  *why = "spans more than one allocation";
  if (CU(cuMemGetAddressRange(&base, &len, CUdeviceptr(data))) &&
      CU(cuMemGetAllocationPropertiesFromHandle(&prop, h)) &&
      CUdeviceptr(data) + size <= base + len) {
    *why = "no shareable handle type";
    d->mapSize = len, d->offset = CUdeviceptr(data) - base;
    const int types = int(prop.requestedHandleTypes);
    if ((types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) &&
        CU(cuMemExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))
      d->kind = 1;
    else if ((types & CU_MEM_HANDLE_TYPE_FABRIC) &&
             CU(cuMemExportToShareableHandle(d->fabric, h, CU_MEM_HANDLE_TYPE_FABRIC, 0)))
      d->kind = 2;
  }
  cuMemRelease(h);
}

bool send_desc(int sock, const RegDesc& d, int fd, Clock::time_point until) {
  iovec iov{const_cast<RegDesc*>(&d), sizeof d};
  alignas(cmsghdr) char space[CMSG_SPACE(sizeof(int))] = {};
  msghdr mh{};
  mh.msg_iov = &iov, mh.msg_iovlen = 1;
  if (fd >= 0) {
    mh.msg_control = space, mh.msg_controllen = sizeof space;
    cmsghdr* cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET, cm->cmsg_type = SCM_RIGHTS, cm->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cm), &fd, sizeof fd);
  }
  return wait_fd(sock, POLLOUT, until) && sendmsg(sock, &mh, MSG_NOSIGNAL) == ssize_t(sizeof d);
}

bool recv_desc(int sock, RegDesc* d, int* fd, Clock::time_point until) {
  iovec iov{d, sizeof *d};
  alignas(cmsghdr) char space[CMSG_SPACE(sizeof(int))] = {};
  msghdr mh{};
  mh.msg_iov = &iov, mh.msg_iovlen = 1, mh.msg_control = space, mh.msg_controllen = sizeof space;
  *fd = -1;
  if (!wait_fd(sock, POLLIN, until) ||
      recvmsg(sock, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) != ssize_t(sizeof *d))
    return false;
  for (cmsghdr* cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
      std::memcpy(fd, CMSG_DATA(cm), sizeof *fd);
  return d->magic == kMagic;
}

// Maps peer memory `d` (fd when d.kind == 1) into this process, readable by this device.
bool import(Comm& c, const RegDesc& d, int fd, PeerMap* m) {
  CUmemGenericAllocationHandle h;
  void* shared =
      d.kind == 1 ? reinterpret_cast<void*>(uintptr_t(fd)) : const_cast<unsigned char*>(d.fabric);
  if (!CU(cuMemImportFromShareableHandle(
          &h, shared,
          d.kind == 1 ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_FABRIC)))
    return false;
  bool ok = CU(cuMemAddressReserve(&m->va, d.mapSize, 0, 0, 0));
  if (ok && !CU(cuMemMap(m->va, d.mapSize, 0, h, 0))) {
    cuMemAddressFree(m->va, d.mapSize);
    ok = false;
  }
  m->mapSize = d.mapSize, m->offset = d.offset;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = int(c.dev);
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (ok && !CU(cuMemSetAccess(m->va, d.mapSize, &access, 1))) {
    unmap(*m);
    ok = false;
  }
  if (!ok) m->va = 0;
  cuMemRelease(h);  // the mapping holds the memory
  return ok;
}

// Collective: every rank registers the same regions in the same order, so each registration
// gets the same number everywhere, and the ranks trade their handles here.
Result plugin_reg_mr_sym(void* collComm, void* data, size_t size, int type, uint64_t,
                         void** mhandle) {
  Comm* c = checked<Comm>(collComm, "connection");
  if (!c || !mhandle || (type != abi::kPtrHost && type != abi::kPtrCuda) || (!data && size))
    return abi::kInvalidArgument;
  CtxScope scope(c->ctx);
  if (!scope.ok) return abi::kUnhandledCudaError;
  std::lock_guard<std::mutex> ctrl(c->ctrlMu);
  auto* g = new Reg;
  g->comm = c, g->type = type, g->addr = static_cast<char*>(data), g->size = size;
  g->peers.resize(size_t(c->nranks));
  RegDesc mine{};
  mine.magic = kMagic, mine.size = size;
  int fd = -1;
  const char* why = nullptr;
  describe(data, size, type, &mine, &fd, &why);
  g->shareable = mine.kind != 0;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    g->region = mine.region = c->nextRegion++;
    c->regs[g->region] = g;  // before any peer can know the region: its puts may come right away
  }
  const auto until = deadline();
  Result r = abi::kSuccess;
  for (int p = 0; p < c->nranks && r == abi::kSuccess; ++p)
    if (p != c->rank && !send_desc(c->outCtrl[size_t(p)], mine, fd, until)) {
      WARN("rank %d: cannot send region %lu to rank %d", c->rank, (unsigned long)g->region, p);
      r = abi::kRemoteError;
    }
  if (fd >= 0) close(fd);
  for (int p = 0; p < c->nranks && r == abi::kSuccess; ++p) {
    if (p == c->rank) continue;
    RegDesc d{};
    int pfd = -1;
    if (!recv_desc(c->inCtrl[size_t(p)], &d, &pfd, until)) {
      WARN("rank %d: no registration of region %lu from rank %d in time", c->rank,
           (unsigned long)g->region, p);
      r = abi::kRemoteError;
    } else if (d.region != g->region) {
      WARN("rank %d registers region %lu while rank %d registers %lu: registrations out of order",
           c->rank, (unsigned long)g->region, p, (unsigned long)d.region);
      r = abi::kInvalidUsage;
    } else if (d.kind && (d.kind == 1) != (pfd >= 0)) {
      WARN("rank %d: rank %d's region %lu came without its handle", c->rank, p,
           (unsigned long)d.region);
      r = abi::kRemoteError;
    } else if (d.kind && !import(*c, d, pfd, &g->peers[size_t(p)])) {
      r = abi::kUnhandledCudaError;
    }
    if (pfd >= 0) close(pfd);
  }
  std::lock_guard<std::mutex> lock(c->mu);
  if (r != abi::kSuccess) {
    c->regs.erase(g->region);
    for (PeerMap& m : g->peers) unmap(m);
    delete g;
    return r;
  }
  g->ready = true;
  INFO("rank %d: region %lu (%s memory, %zu bytes) registered, %s", c->rank,
       (unsigned long)g->region, type == abi::kPtrCuda ? "device" : "host", size,
       g->shareable ? "mapped by its peers" : why);
  *mhandle = g;
  return abi::kSuccess;
}

Result plugin_reg_mr_sym_dmabuf(void* collComm, void* data, size_t size, int type, uint64_t, int,
                                uint64_t mrFlags, void** mhandle) {
  return plugin_reg_mr_sym(collComm, data, size, type, mrFlags, mhandle);  // the fd is not needed
}

Result plugin_dereg_mr_sym(void* collComm, void* mhandle) {
  Comm* c = checked<Comm>(collComm, "connection");
  Reg* g = checked<Reg>(mhandle, "memory handle");
  if (!c || !g || g->comm != c) return abi::kInvalidArgument;
  std::lock_guard<std::mutex> lock(c->mu);
  c->regs.erase(g->region);  // later puts into it are dropped
  CtxScope scope(c->ctx);
  if (!scope.ok || !drain(*c)) return abi::kInternalError;  // leaves the mappings in place
  for (PeerMap& m : g->peers) unmap(m);
  g->magic = 0;
  delete g;
  return abi::kSuccess;
}

// iput and iputSignal: the message to the target (or, to this rank, straight into the work).
Result submit(void* rmaCtx, int context, uint64_t srcOff, void* srcMh, size_t size, uint64_t dstOff,
              void* dstMh, uint32_t rank, bool hasSignal, uint64_t sigOff, void* sigMh,
              uint64_t sigValue, uint32_t sigOp, void** request) {
  RmaCtx* x = checked<RmaCtx>(rmaCtx, "RMA context");
  if (!x || !request || context < 0 || context >= x->nContexts) return abi::kInvalidArgument;
  Comm& c = *x->comm;
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.error != abi::kSuccess) return c.error;
  if (rank >= uint32_t(c.nranks)) return abi::kInvalidArgument;
  Msg m{};
  m.kind = kPut, m.sigRegion = kNoRegion;
  if (size) {
    Reg* s = checked<Reg>(srcMh, "source handle");
    Reg* d = checked<Reg>(dstMh, "destination handle");
    if (!s || !d || s->comm != &c || d->comm != &c || srcOff > s->size || size > s->size - srcOff)
      return abi::kInvalidArgument;
    m.dstRegion = d->region, m.dstOff = dstOff, m.size = size;
    if (s->type == abi::kPtrHost) {
      if (size > 8) {
        WARN("a put from host memory carries at most 8 bytes (putValue); this one has %zu", size);
        return abi::kInvalidUsage;
      }
      std::memcpy(&m.bits, s->addr + srcOff, size);
      m.inlineLen = uint32_t(size);
    } else if (!s->shareable && int(rank) != c.rank) {
      WARN("put source region %lu is not shared with other processes", (unsigned long)s->region);
      return abi::kInvalidUsage;
    } else {
      m.srcRegion = s->region, m.srcOff = srcOff;
    }
  }
  if (hasSignal) {
    Reg* g = checked<Reg>(sigMh, "signal handle");
    if (!g || g->comm != &c || (sigOp != abi::kSignalInc && sigOp != abi::kSignalAdd))
      return abi::kInvalidArgument;
    m.sigRegion = g->region, m.sigOff = sigOff;
    m.sigAdd = sigOp == abi::kSignalInc ? 1 : sigValue;
  }
  const int to = int(rank);
  if (to != c.rank && c.outClosed[size_t(to)]) return abi::kRemoteError;
  Request* r = new_request(c, to);
  m.id = r->id();
  if (to == c.rank)
    c.work.emplace_back(to, m);
  else
    c.sendQ[size_t(to)].push_back(m);
  flush(c);
  *request = r;
  return abi::kSuccess;
}

Result plugin_iput(void* rmaCtx, int context, uint64_t srcOff, void* srcMh, size_t size,
                   uint64_t dstOff, void* dstMh, uint32_t rank, void** request) {
  return submit(rmaCtx, context, srcOff, srcMh, size, dstOff, dstMh, rank, false, 0, nullptr, 0, 0,
                request);
}

Result plugin_iput_signal(void* rmaCtx, int context, uint64_t srcOff, void* srcMh, size_t size,
                          uint64_t dstOff, void* dstMh, uint32_t rank, uint64_t sigOff, void* sigMh,
                          uint64_t sigValue, uint32_t sigOp, bool, void** request) {
  // Strong or weak, a signal follows every earlier put of this connection: one stream per target.
  return submit(rmaCtx, context, srcOff, srcMh, size, dstOff, dstMh, rank, true, sigOff, sigMh,
                sigValue, sigOp, request);
}

// A get reads the peer's memory, mapped here at registration: a local copy.
Result plugin_iget(void* rmaCtx, int context, uint64_t remoteOff, void* remoteMh, size_t size,
                   uint64_t localOff, void* localMh, uint32_t rank, void** request) {
  RmaCtx* x = checked<RmaCtx>(rmaCtx, "RMA context");
  Reg* remote = checked<Reg>(remoteMh, "remote handle");
  Reg* local = checked<Reg>(localMh, "local handle");
  if (!x || !remote || !local || !request || context < 0 || context >= x->nContexts)
    return abi::kInvalidArgument;
  Comm& c = *x->comm;
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.error != abi::kSuccess) return c.error;
  if (rank >= uint32_t(c.nranks) || remote->comm != &c || local->comm != &c)
    return abi::kInvalidArgument;
  const CUdeviceptr from = peer_ptr(c, *remote, int(rank), remoteOff, size);
  const CUdeviceptr to =
      local->type == abi::kPtrCuda ? peer_ptr(c, *local, c.rank, localOff, size) : 0;
  if (size && (!from || !to)) {
    WARN("get of %zu bytes from rank %u: memory not shared, not on the device or out of range",
         size, rank);
    return abi::kInvalidUsage;
  }
  CtxScope scope(c.ctx);
  if (!scope.ok || (size && !CU(cuMemcpyAsync(to, from, size, c.stream))))
    return abi::kUnhandledCudaError;
  Request* r = new_request(c, c.rank);
  const Result res = record(c, {Done{c.rank, r->id(), abi::kSuccess, 0}}, size ? 1 : 0);
  *request = r;
  return res;
}

Result plugin_iflush(void* rmaCtx, int, void*, uint32_t, void** request) {
  // A completed get has landed (its event completed after the copy): nothing to flush.
  if (!checked<RmaCtx>(rmaCtx, "RMA context") || !request) return abi::kInvalidArgument;
  *request = nullptr;
  return abi::kSuccess;
}

Result plugin_test(void* collComm, void* request, int* done) {
  Comm* c = checked<Comm>(collComm, "connection");
  auto* r = static_cast<Request*>(request);
  if (!c || !r || !done || r->comm != c || !r->busy) return abi::kInvalidArgument;
  std::lock_guard<std::mutex> lock(c->mu);
  if (!r->done) progress(*c);
  *done = r->done;
  if (!r->done) return c->error;
  r->busy = false;
  c->freeRequests.push_back(r->index);
  return r->status;
}

Result plugin_progress(void* rmaCtx) {
  RmaCtx* x = checked<RmaCtx>(rmaCtx, "RMA context");
  if (!x) return abi::kInvalidArgument;
  std::lock_guard<std::mutex> lock(x->comm->mu);
  return progress(*x->comm);
}

Result plugin_query_last_error(void* rmaCtx, bool* hasError) {
  RmaCtx* x = checked<RmaCtx>(rmaCtx, "RMA context");
  if (!x || !hasError) return abi::kInvalidArgument;
  std::lock_guard<std::mutex> lock(x->comm->mu);
  *hasError = x->comm->error != abi::kSuccess;
  return abi::kSuccess;
}

Result plugin_finalize(void*) {
  g_refs.fetch_sub(1);
  return abi::kSuccess;
}

}  // namespace

// The symbol NCCL looks up in the library named by NCCL_RMA_PLUGIN.
extern "C" {
__attribute__((visibility("default"))) abi::RmaV14 ncclRmaPlugin_v14 = {
    "moe_echo_gin_ipc",
    plugin_init,
    plugin_devices,
    plugin_get_properties,
    plugin_listen,
    plugin_connect,
    plugin_create_context,
    plugin_reg_mr_sym,
    plugin_reg_mr_sym_dmabuf,
    plugin_dereg_mr_sym,
    plugin_destroy_context,
    plugin_close_coll,
    plugin_close_listen,
    plugin_iput,
    plugin_iput_signal,
    plugin_iget,
    plugin_iflush,
    plugin_test,
    plugin_progress,
    plugin_query_last_error,
    plugin_finalize,
};
}
