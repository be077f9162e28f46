// gin_probe: whether NCCL's device-initiated networking (GIN) joins the ranks of this job, and
// what it moves. Each rank sends one slot of `--bytes` to every other rank with a GIN put from
// the device (one thread per peer, the put carrying an increment of the sender's signal), waits
// for every peer's signal (bounded: `--timeout-s`), checks every word it received, and meets the
// others at a GIN barrier (bounded) before the next round; `--iters` rounds in one kernel, timed
// with %globaltimer. Rank 0 prints what NCCL reports (version, device API, GIN type, LSA teams)
// and a line per rank (rounds, bytes, time, words wrong), and writes them to `--json`.
//
// Then `--protocol-rounds` rounds of the protocol a device-initiated dispatch across nodes is to
// use, one kernel launch a round with no host sync between: each rank sends every other rank a
// number of 1 KiB messages that changes from round to round (0 to 64), each put carrying an
// increment of the sender's data signal, then the count with an increment of its count signal;
// the receiver waits for the count signal, reads the count and waits for the data signal to reach
// what it has consumed so far plus that count (the consumed counts kept in device memory across
// launches), checks every word, and signals a credit back, which the sender waits for before it
// writes into that peer's slots again.
//
// Run under `moe-echo launch -n N -- build/gin_probe`. Two GPUs of one host act as two nodes with
// NCCL_LSA_TEAM_SIZE=1 (each rank its own NVLink team, so every peer is reached through GIN);
// socket GIN (NCCL 2.32, no InfiniBand) also wants NCCL_IB_DISABLE=1 NCCL_GDRCOPY_ENABLE=1
// NCCL_SOCKET_IFNAME=lo. Needs NCCL 2.31 or later (bounded GIN waits); built against an older one
// it says so and exits 2. Exit 0 when GIN works (or is absent and --require-gin was not given),
// 1 when a round timed out or a word was wrong (or GIN is absent under --require-gin).
#include <cuda_runtime.h>
#include <nccl.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moe_echo/cuda.hpp"
#include "moe_echo/cuda_check.hpp"
#include "moe_echo/dist.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 31, 0)
#include <nccl_device.h>
#define GIN_PROBE_HAVE_GIN 1
#endif

using namespace moe_echo;

namespace {

#define PROBE_NCCL(call)                                                       \
  do {                                                                         \
    const ncclResult_t rc_ = (call);                                           \
    if (rc_ != ncclSuccess)                                                    \
      throw Error(std::string(#call) + ": " + ncclGetErrorString(rc_) + " (" + \
                  ncclGetLastError(nullptr) + ")");                            \
  } while (0)

struct Options {
  size_t bytes = size_t(1) << 20;
  int iters = 50;
  int protocol_rounds = 200;
  double timeout_s = 30;
  bool require_gin = false;
  std::string json;
};

// What each rank's kernel leaves in host-mapped memory.
struct Result {
  int32_t status = 0;  // 0 ok; 1 a signal wait timed out; 2 the barrier timed out
  int32_t peer = -1;   // the peer whose signal did not come
  int32_t round = -1;  // the round it stopped in
  int32_t rounds_done = 0;
  uint64_t wrong_words = 0;
  uint64_t ns = 0;            // %globaltimer from the first round's puts to the last barrier
  uint64_t messages = 0;      // protocol: messages received and checked
  uint64_t wrong_counts = 0;  // protocol: counts that were not what the sender sends
};

// What every rank's line of the JSON holds for either kind of round; `what` names its status.
nlohmann::json rank_json(int rank, const Result& x, const char* what) {
  return {{"rank", rank},
          {"status", what},
          {"peer", x.peer},
          {"round", x.round},
          {"rounds_done", x.rounds_done},
          {"wrong_words", x.wrong_words},
          {"seconds", double(x.ns) * 1e-9}};
}

// The protocol rounds' state on the device, kept across launches: per peer, the signal values at
// the start and what was consumed since.
constexpr int kMaxRanks = 64;
constexpr int kMaxMessages = 64;
constexpr size_t kMessageBytes = 1024;
struct Protocol {
  uint64_t count_base[kMaxRanks], data_base[kMaxRanks], credit_base[kMaxRanks];
  uint64_t data_seen[kMaxRanks];
  uint64_t t0;
};

#ifdef GIN_PROBE_HAVE_GIN
__device__ uint32_t word(int src, int round, size_t i) {
  return uint32_t(src) * 0x9e3779b1u ^ uint32_t(round) * 0x85ebca77u ^ uint32_t(i) * 0xc2b2ae3du;
}

__device__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The window: slot 0 is this rank's send slot, slot 1 + r receives rank r's.
__global__ void exchange(ncclDevComm dc, ncclWindow_t win, size_t slot, int iters,
                         uint64_t timeout_cycles, Result* out) {
  ncclGin gin(dc, 0);
  const int R = dc.nRanks, me = dc.rank;
  const size_t words = slot / sizeof(uint32_t);
  auto* send = static_cast<uint32_t*>(ncclGetLocalPointer(win, 0));
  __shared__ uint64_t base[64];
  __shared__ int failed;
  __shared__ unsigned long long wrong;
  if (threadIdx.x == 0) failed = 0, wrong = 0;
  for (int p = threadIdx.x; p < R; p += blockDim.x) base[p] = gin.readSignal(ncclGinSignal_t(p));
  ncclGinBarrierSession<ncclCoopCta> bar(ncclCoopCta(), gin, ncclTeamTagWorld(), 0);
  // No peer puts before every rank has read its signals' starting values.
  if (bar.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel, ncclGinFenceLevel::None,
               timeout_cycles) != ncclSuccess)
    failed = 2;
  __syncthreads();
  if (failed) {
    if (threadIdx.x == 0) out->status = failed, out->round = -1;
    return;
  }
  const uint64_t t0 = now_ns();
  int round = 0;
  for (; round < iters; ++round) {
    for (size_t i = threadIdx.x; i < words; i += blockDim.x) send[i] = word(me, round, i);
    __syncthreads();
    for (int p = threadIdx.x; p < R; p += blockDim.x)
      if (p != me)
        gin.put(ncclTeamWorld(dc), p, win, size_t(1 + me) * slot, win, 0, slot,
                ncclGin_SignalInc{ncclGinSignal_t(me)});  // its release covers the CTA's
                                                          // writes, seen at the __syncthreads
    for (int p = 0; p < R && !failed; ++p) {
      if (p == me) continue;
      // Only thread 0 is told of a timeout: it shares it.
      const ncclResult_t rc =
          gin.waitSignal(ncclCoopCta(), ncclGinSignal_t(p), base[p] + uint64_t(round) + 1, 64,
                         ::cuda::memory_order_acquire, timeout_cycles);
      if (threadIdx.x == 0 && rc != ncclSuccess) {
        failed = 1;
        out->peer = p;
      }
      __syncthreads();
    }
    if (failed) break;
    unsigned long long bad = 0;
    for (int p = 0; p < R; ++p) {
      if (p == me) continue;
      const auto* got =
          static_cast<const uint32_t*>(ncclGetLocalPointer(win, size_t(1 + p) * slot));
      for (size_t i = threadIdx.x; i < words; i += blockDim.x) bad += got[i] != word(p, round, i);
    }
    if (bad) atomicAdd(&wrong, bad);
    gin.flush(ncclCoopCta());  // the send slot may be written again
    // Nobody's next round lands in a slot this rank is still reading.
    if (bar.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel, ncclGinFenceLevel::None,
                 timeout_cycles) != ncclSuccess)
      failed = 2;
    __syncthreads();
    if (failed) break;
  }
  if (threadIdx.x == 0) {
    out->status = failed;
    out->round = failed ? round : -1;
    out->rounds_done = round;
    out->wrong_words = wrong;
    out->ns = now_ns() - t0;
  }
}

// Signals of the protocol (the plain rounds use [0, R)): from rank p, its count R + p, its data
// 2R + p, its credit 3R + p.
__device__ int messages(int src, int dst, int round) {
  return int(word(src * kMaxRanks + dst, round, 7) % uint32_t(kMaxMessages + 1));
}

__global__ void protocol_start(ncclDevComm dc, Protocol* st) {
  ncclGin gin(dc, 0);
  const int R = dc.nRanks;
  for (int p = threadIdx.x; p < R; p += blockDim.x) {
    st->count_base[p] = gin.readSignal(ncclGinSignal_t(R + p));
    st->data_base[p] = gin.readSignal(ncclGinSignal_t(2 * R + p));
    st->credit_base[p] = gin.readSignal(ncclGinSignal_t(3 * R + p));
    st->data_seen[p] = 0;
  }
  if (threadIdx.x == 0) st->t0 = now_ns();
}

// One round. The protocol part of the window (at `base`): R send regions of kMaxMessages
// messages, R receive regions, R counts.
__global__ void protocol_round(ncclDevComm dc, ncclWindow_t win, size_t base, int round,
                               uint64_t timeout_cycles, Protocol* st, Result* out) {
  __shared__ int failed;
  __shared__ unsigned long long wrong, wrong_counts, got;
  if (threadIdx.x == 0) failed = out->status, wrong = 0, wrong_counts = 0, got = 0;
  __syncthreads();
  if (failed) return;  // an earlier round gave up: so does every later one
  ncclGin gin(dc, 0);
  const int R = dc.nRanks, me = dc.rank;
  const size_t region = size_t(kMaxMessages) * kMessageBytes;
  const size_t send = base, recv = base + size_t(R) * region, counts = recv + size_t(R) * region;
  const size_t words = kMessageBytes / sizeof(uint32_t);
  auto wait = [&](int signal, uint64_t least, int peer, int why) {
    const ncclResult_t rc = gin.waitSignal(ncclCoopCta(), ncclGinSignal_t(signal), least, 64,
                                           ::cuda::memory_order_acquire, timeout_cycles);
    if (threadIdx.x == 0 && rc != ncclSuccess) failed = why, out->peer = peer;
    __syncthreads();
    return failed == 0;
  };
  // Every peer has consumed what this rank sent it last round.
  for (int p = 0; p < R; ++p)
    if (p != me && round > 0 && !wait(3 * R + p, st->credit_base[p] + uint64_t(round), p, 3)) break;
  if (failed) {
    if (threadIdx.x == 0) out->status = failed, out->round = round;
    return;
  }
  // The messages, then each peer's count.
  for (int p = 0; p < R; ++p) {
    if (p == me) continue;
    auto* m = static_cast<uint32_t*>(ncclGetLocalPointer(win, send + size_t(p) * region));
    const int n = messages(me, p, round);
    for (size_t i = threadIdx.x; i < size_t(n) * words; i += blockDim.x)
      m[i] = word(me * kMaxRanks + p, round, i);
  }
  __syncthreads();
  for (int j = threadIdx.x; j < R * kMaxMessages; j += blockDim.x) {
    const int p = j / kMaxMessages, i = j % kMaxMessages;
    if (p == me || i >= messages(me, p, round)) continue;
    gin.put(ncclTeamWorld(dc), p, win, recv + size_t(me) * region + size_t(i) * kMessageBytes, win,
            send + size_t(p) * region + size_t(i) * kMessageBytes, kMessageBytes,
            ncclGin_SignalInc{ncclGinSignal_t(2 * R + me)});
  }
  __syncthreads();
  for (int p = threadIdx.x; p < R; p += blockDim.x)
    if (p != me)
      gin.putValue(ncclTeamWorld(dc), p, win, counts + size_t(me) * sizeof(uint64_t),
                   uint64_t(messages(me, p, round)), ncclGin_SignalInc{ncclGinSignal_t(R + me)});
  // Receive: the count, then that many messages.
  for (int p = 0; p < R && !failed; ++p) {
    if (p == me) continue;
    if (!wait(R + p, st->count_base[p] + uint64_t(round) + 1, p, 1)) break;
    const uint64_t sent =
        *static_cast<volatile uint64_t*>(ncclGetLocalPointer(win, counts + size_t(p) * 8));
    const int want = messages(p, me, round);
    const int n = int(sent > uint64_t(kMaxMessages) ? uint64_t(kMaxMessages) : sent);
    if (threadIdx.x == 0 && n != want) atomicAdd(&wrong_counts, 1ull);
    if (!wait(2 * R + p, st->data_base[p] + st->data_seen[p] + uint64_t(n), p, 1)) break;
    const auto* m =
        static_cast<const uint32_t*>(ncclGetLocalPointer(win, recv + size_t(p) * region));
    unsigned long long bad = 0;
    for (size_t i = threadIdx.x; i < size_t(n) * words; i += blockDim.x)
      bad += m[i] != word(p * kMaxRanks + me, round, i);
    if (bad) atomicAdd(&wrong, bad);
    __syncthreads();
    if (threadIdx.x == 0) st->data_seen[p] += uint64_t(n), got += uint64_t(n);
  }
  __syncthreads();
  if (!failed) {
    gin.flush(ncclCoopCta());  // this rank's send regions may be written again
    for (int p = threadIdx.x; p < R; p += blockDim.x)
      if (p != me) gin.signal(ncclTeamWorld(dc), p, ncclGin_SignalInc{ncclGinSignal_t(3 * R + me)});
  }
  if (threadIdx.x == 0) {
    out->messages += got;
    out->wrong_words += wrong;
    out->wrong_counts += wrong_counts;
    if (failed) {
      out->status = failed;
      out->round = round;
    } else {
      out->rounds_done = round + 1;
    }
    out->ns = now_ns() - st->t0;
  }
}
#endif

// Every rank's result, in rank order.
std::vector<Result> gather(Rendezvous& rv, const Result& mine) {
  const auto* p = reinterpret_cast<const uint8_t*>(&mine);
  std::vector<Result> all;
  for (const Bytes& b : rv.all_gather_bytes(Bytes(p, p + sizeof mine))) {
    Result x;
    std::memcpy(&x, b.data(), sizeof x);
    all.push_back(x);
  }
  return all;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) reject(a.substr(2), "(missing)", "a value after " + a);
      return argv[++i];
    };
    // The option's value as a number in [lo, hi] whose `ok` holds, or the option's error.
    auto number = [&](double lo, double hi, bool integer, const std::string& allowed,
                      bool (*ok)(double) = nullptr) {
      const std::string v = value();
      char* end = nullptr;
      const double x =
          integer ? double(std::strtoll(v.c_str(), &end, 10)) : std::strtod(v.c_str(), &end);
      if (v.empty() || *end || !(x >= lo && x <= hi) || (ok && !ok(x)))
        reject(a.substr(2), "'" + v + "'", allowed);
      return x;
    };
    if (a == "--bytes") {
      o.bytes = size_t(number(4, double(1ll << 30), true, "a multiple of 4 in [4, 2^30]",
                              [](double x) { return std::fmod(x, 4.0) == 0; }));
    } else if (a == "--iters") {
      o.iters = int(number(1, 1000000, true, "an integer in [1, 1000000]"));
    } else if (a == "--protocol-rounds") {
      o.protocol_rounds = int(number(0, 1000000, true, "an integer in [0, 1000000]"));
    } else if (a == "--timeout-s") {
      o.timeout_s = number(0, 3600, false, "seconds in (0, 3600]", [](double x) { return x > 0; });
    } else if (a == "--json") {
      o.json = value();
    } else if (a == "--require-gin") {
      o.require_gin = true;
    } else {
      reject("argument", "'" + a + "'",
             "--bytes B, --iters N, --protocol-rounds N, --timeout-s S, --json FILE, "
             "--require-gin");
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    check_output_path("json", o.json);
    const DistEnv env = DistEnv::from_env();
    const int R = env.world_size, me = env.rank;
    if (R < 2 || R > kMaxRanks)
      reject("WORLD_SIZE", R, "2 to 64 ranks (run under `moe-echo launch -n N`)");
#ifndef GIN_PROBE_HAVE_GIN
    if (me == 0)
      std::fprintf(stderr,
                   "gin_probe: built against NCCL %d, which has no bounded GIN waits; "
                   "needs NCCL 2.31 or later\n",
                   NCCL_VERSION_CODE);
    return 2;
#else
    MOE_ECHO_CUDA_CHECK(cudaSetDevice(env.local_rank));
    Rendezvous rv(env);
    ncclUniqueId id{};
    if (me == 0) PROBE_NCCL(ncclGetUniqueId(&id));
    const Bytes idb = rv.broadcast_bytes(Bytes(reinterpret_cast<const uint8_t*>(&id),
                                               reinterpret_cast<const uint8_t*>(&id) + sizeof id));
    std::memcpy(&id, idb.data(), sizeof id);
    ncclComm_t comm = nullptr;
    PROBE_NCCL(ncclCommInitRank(&comm, R, id, me));
    int version = 0;
    PROBE_NCCL(ncclGetVersion(&version));
    ncclCommProperties_t props = NCCL_COMM_PROPERTIES_INITIALIZER;
    PROBE_NCCL(ncclCommQueryProperties(comm, &props));
    nlohmann::json doc = {{"nccl_version", version},
                          {"ranks", R},
                          {"device_api", props.deviceApiSupport},
                          {"gin_type", int(props.ginType)},
                          {"railed_gin_type", int(props.railedGinType)},
                          {"lsa_teams", props.nLsaTeams},
                          {"bytes_per_slot", o.bytes},
                          {"iters", o.iters}};
    if (me == 0)
      std::printf(
          "NCCL %d, %d ranks: device API %s, GIN type %d (railed %d; 0 none, 2 proxy, "
          "3 GDAKI), %d LSA team(s)\n",
          version, R, props.deviceApiSupport ? "yes" : "no", int(props.ginType),
          int(props.railedGinType), props.nLsaTeams);
    int rc = 0;
    if (props.ginType == NCCL_GIN_TYPE_NONE || !props.deviceApiSupport) {
      if (me == 0) std::printf("no GIN between these ranks\n");
      doc["gin"] = false;
      rc = o.require_gin ? 1 : 0;
    } else {
      doc["gin"] = true;
      const size_t slot = (o.bytes + 4095) / 4096 * 4096;
      const size_t protocol_base = slot * size_t(1 + R);
      const size_t win_bytes =
          protocol_base + size_t(2 * R) * kMaxMessages * kMessageBytes + size_t(R) * 8;
      void* buf = nullptr;
      ncclWindow_t win{};
      PROBE_NCCL(ncclMemAlloc(&buf, win_bytes));
      PROBE_NCCL(ncclCommWindowRegister(comm, buf, win_bytes, &win, NCCL_WIN_COLL_SYMMETRIC));
      ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
      reqs.ginConnectionType = NCCL_GIN_CONNECTION_FULL;
      reqs.ginContextCount = 1;
      reqs.ginSignalCount = 4 * R;
      reqs.worldGinBarrierCount = 1;
      reqs.ginVaSignalsRequired = false;
      ncclDevComm dc{};
      PROBE_NCCL(ncclDevCommCreate(comm, &reqs, &dc));
      doc["lsa_size"] = dc.lsaSize;
      Result* res = nullptr;
      MOE_ECHO_CUDA_CHECK(
          cudaHostAlloc(reinterpret_cast<void**>(&res), sizeof(Result), cudaHostAllocMapped));
      *res = Result{};
      Result* res_dev = nullptr;
      MOE_ECHO_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&res_dev), res, 0));
      int clock_khz = 0;
      MOE_ECHO_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, env.local_rank));
      const uint64_t timeout_cycles = uint64_t(o.timeout_s * double(clock_khz) * 1e3);
      int iters = o.iters;
      void* args[] = {
          &dc,     &win, const_cast<size_t*>(&slot), &iters, const_cast<uint64_t*>(&timeout_cycles),
          &res_dev};
      MOE_ECHO_CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(&exchange), dim3(1),
                                           dim3(512), args, 0, nullptr));
      MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<Result> all = gather(rv, *res);
      nlohmann::json per_rank = nlohmann::json::array();
      for (int r = 0; r < R; ++r) {
        const Result& x = all[size_t(r)];
        const double s = double(x.ns) * 1e-9;
        const double moved = double(slot) * double(R - 1) * double(x.rounds_done);
        const char* what = x.status == 0   ? "ok"
                           : x.status == 1 ? "signal wait timed out"
                                           : "barrier timed out";
        nlohmann::json one = rank_json(r, x, what);
        one["bytes_sent"] = moved;
        one["gb_per_s_sent"] = s > 0 ? moved / s * 1e-9 : 0.0;
        per_rank.push_back(one);
        if (x.status != 0 || x.wrong_words != 0) rc = 1;
        if (me == 0)
          std::printf(
              "rank %d: %s%s, %d of %d rounds, %llu wrong words, %.3f ms, %.3f GB/s sent "
              "(%zu bytes to each of %d peers a round)\n",
              r, what, x.status == 1 ? (" (peer " + std::to_string(x.peer) + ")").c_str() : "",
              x.rounds_done, o.iters, static_cast<unsigned long long>(x.wrong_words), s * 1e3,
              s > 0 ? moved / s * 1e-9 : 0.0, slot, R - 1);
      }
      doc["per_rank"] = per_rank;
      if (rc == 0 && o.protocol_rounds > 0) {
        Protocol* st = nullptr;
        MOE_ECHO_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&st), sizeof(Protocol)));
        *res = Result{};
        void* start_args[] = {&dc, &st};
        MOE_ECHO_CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(&protocol_start),
                                             dim3(1), dim3(64), start_args, 0, nullptr));
        MOE_ECHO_CUDA_CHECK(cudaGetLastError());
        MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
        rv.barrier();  // no rank sends before every rank has read its signals' starting values
        for (int round = 0; round < o.protocol_rounds; ++round) {
          size_t at = protocol_base;
          uint64_t timeout = timeout_cycles;
          void* round_args[] = {&dc, &win, &at, &round, &timeout, &st, &res_dev};
          MOE_ECHO_CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(&protocol_round),
                                               dim3(1), dim3(512), round_args, 0, nullptr));
          MOE_ECHO_CUDA_CHECK(cudaGetLastError());
        }
        MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
        (void)cudaFree(st);
        const std::vector<Result> pall = gather(rv, *res);
        nlohmann::json proto = nlohmann::json::array();
        for (int r = 0; r < R; ++r) {
          const Result& x = pall[size_t(r)];
          const char* what = x.status == 0   ? "ok"
                             : x.status == 1 ? "count or data signal wait timed out"
                                             : "credit wait timed out";
          nlohmann::json one = rank_json(r, x, what);
          one["messages"] = x.messages;
          one["wrong_counts"] = x.wrong_counts;
          proto.push_back(one);
          if (x.status != 0 || x.wrong_words != 0 || x.wrong_counts != 0) rc = 1;
          if (me == 0)
            std::printf(
                "rank %d, protocol: %s%s, %d of %d rounds, %llu messages, %llu wrong "
                "counts, %llu wrong words, %.3f ms\n",
                r, what,
                x.status != 0 ? (" (peer " + std::to_string(x.peer) + ", round " +
                                 std::to_string(x.round) + ")")
                                    .c_str()
                              : "",
                x.rounds_done, o.protocol_rounds, static_cast<unsigned long long>(x.messages),
                static_cast<unsigned long long>(x.wrong_counts),
                static_cast<unsigned long long>(x.wrong_words), double(x.ns) * 1e-6);
        }
        doc["protocol"] = proto;
        doc["protocol_rounds"] = o.protocol_rounds;
      }
      if (rc == 0) {
        PROBE_NCCL(ncclDevCommDestroy(comm, &dc));
        PROBE_NCCL(ncclCommWindowDeregister(comm, win));
        PROBE_NCCL(ncclMemFree(buf));
      }
      (void)cudaFreeHost(res);
    }
    if (me == 0 && !o.json.empty()) write_file(o.json, doc.dump(1) + "\n");
    if (rc == 0) {
      rv.barrier();
      PROBE_NCCL(ncclCommDestroy(comm));
    } else {
      (void)ncclCommAbort(comm);  // a peer may be gone or stuck: wait for none
    }
    return rc;
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gin_probe: %s\n", e.what());
    return 1;
  }
}
