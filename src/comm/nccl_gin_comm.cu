// The sync-free communicator across nodes (nccl_base.hpp: make_gin_comm): dispatch and combine
// as device kernels that store into the ranks of their own node through LSA pointers, as the
// one-node kernels do (nccl_device_comm.cu), and reach other nodes with NCCL's GIN: puts and
// signals a kernel issues, one copy of a token's row per other node it has entries on, to that
// node's forwarder for the source (the rank with the source's index in its node), which makes the
// writes on its node's ranks. What moves and the bits it gives are those of the in-process world
// with nodes (in_process.cpp), the reference: the forwarder runs the one-node dispatch of a token
// (dispatch_token.cuh) on the entries the source sent with the row, and the combine sums every
// lead row of a token in k order at the source, one row per lead across nodes.
//
// Kernels of a dispatch (every rank launches each, with the same grid):
//   gin_send     node barrier at entry (the node's ranks are done with the buffers about to be
//                written); the credits of the previous dispatch (every forwarder has read what
//                this rank sent it); per token the writes on this node's ranks, and per other
//                node one message (the token's entries on that node, their weights, the row) put
//                into the forwarder's staging with an increment of this rank's data signal there;
//                the last CTA puts each forwarder the count of messages, with an increment of the
//                count signal.
//   gin_forward  per other node's source: its count, then that many messages; each message's
//                dispatch on this node's ranks; the last CTA signals each source its credit; node
//                barrier at exit (every store of the dispatch is visible to the node's ranks).
// Kernels of a combine:
//   gin_request  per token the combine sums and other node it has entries on, a request (the
//                entries there, and the row of the reply region the leads' rows go to) put into
//                the forwarder's staging; the last CTA puts the counts.
//   gin_reply    node barrier at entry (every rank of the node has its reduced rows); per other
//                node's source, its requests; per request the leads' reduced rows (k order) and
//                the entries' fan values put into the source's reply region; node barrier at
//                exit (the node's reduced rows may be written again).
//   gin_sum      the replies (this rank knows how many it asked for); per token the sum of its
//                lead rows in k order, from the node's ranks (LSA) and the reply region; node
//                barrier at exit.
// The signals only grow; what each has reached at the end of the last call that consumed it is
// kept in device memory (GinState::seen), so a call waits for "seen + what this call brings". A
// wait gives up like the barriers' (bounded_barrier.cuh): the abort flag or the wait timeout.
//
// The other ops: NCCL's host-API collectives (all-gather, all-reduce: capturable, no host sync)
// over symmetric windows, and the clone ops as the kernel gin_clones (LSA within the node, puts
// through a clone staging window of P slots across nodes: see "clone ops" below) where that window
// is configured (NcclOptions::gin_clone_slot_bytes), so that the communicator is capturable; else
// grouped sends and receives after the plan is copied to the host (a host sync).
#include <nccl.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <utility>

#include "comm/nccl_base.hpp"
#include "moe_echo/cuda_check.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/nccl_check.hpp"

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 31, 0)
#define MOE_ECHO_HAVE_GIN 1
#include <nccl_device.h>

#include "comm/dispatch_token.cuh"
#include "comm/nccl_rows.cuh"
#include "comm/token_lanes.cuh"
#include "cuda/common.cuh"
#include "cuda/warp_copy.cuh"
#endif

namespace moe_echo::nccl {

#ifndef MOE_ECHO_HAVE_GIN

bool gin_ready(Context&, std::string* why) {
  if (why) *why = "built against NCCL before 2.31, which has no bounded GIN waits";
  return false;
}
std::unique_ptr<Communicator> make_gin_comm(std::unique_ptr<Context>, const NcclOptions&) {
  throw Error("make_gin_comm: built against NCCL before 2.31");
}

#else

namespace {

using cuda::as_cuda;
using cuda::with_word;
using cuda::word_size;

constexpr int kMaxGinRanks = 64;
constexpr int kMaxNodes = 64;
constexpr int kMaxTopK = 32;
constexpr int kMaxCloneSlots = 8;  // NcclOptions::gin_clone_slots

// Signal kinds; signal kind * ranks + p belongs to peer p (its sender, or the credit's giver).
enum Sig : int {
  kDData,
  kDCount,
  kDCredit,
  kReqData,
  kReqCount,
  kRepData,
  kClData,    // a clone op's item put into the consumer's clone staging (by its source)
  kClCredit,  // a clone op's credit: the consumer's staging slot for the item is free
  kSigKinds
};

// Device memory kept between kernels (zeroed, then `seen` read from the signals at setup).
struct GinState {
  uint64_t seen[kSigKinds][kMaxGinRanks];  // each signal's value consumed so far
  uint32_t sent[kMaxNodes];                // gin_send: messages to each node this call
  uint32_t asked[kMaxNodes];               // gin_request: requests to each node this call
  uint32_t lead_rows[kMaxNodes];           // gin_request: reply rows asked of each node
  uint32_t asked_last[kMaxNodes];          // the last combine's requests, for gin_sum
  uint32_t values_last;                    // whether the last combine asked for fan values
  uint32_t done[6];                        // CTAs done, per kernel: the last one closes the call
  uint32_t item_done[kMaxCloneSlots];      // a clone op's consumer CTAs done with a staged item
  uint32_t dispatches;                     // gin_send calls so far (their credits)
};

// Where things are: the ranks, the nodes, and the staging window's regions (per other node).
struct Geo {
  int rank, ranks, per_node, lsa_rank, node, nodes;
  int64_t max_tokens;
  size_t msg_max, req_max, rep_row_max;  // strides: a message, a request, a reply row
  int clone_slots;                       // P: the clone staging's slots (of clone_slot_bytes)
  size_t clone_slot_bytes;
  size_t d_send, d_recv, q_send, q_recv, r_send, r_recv, v_send, v_recv, counts;
  __host__ __device__ size_t d_region() const { return size_t(max_tokens) * msg_max; }
  __host__ __device__ size_t q_region() const { return size_t(max_tokens) * req_max; }
  __host__ __device__ size_t r_region() const {
    return size_t(max_tokens) * size_t(per_node) * rep_row_max;
  }
  __host__ __device__ size_t v_region() const { return size_t(max_tokens) * kMaxTopK * 8; }
  __device__ int node_of(int r) const { return r / per_node; }
  __device__ int lsa_of(int r) const { return r - node_of(r) * per_node; }
  // The rank of node n that forwards for this rank / the source of node n this rank forwards for.
  __device__ int peer_on(int n) const { return n * per_node + lsa_rank; }
  __device__ int sig(Sig k, int p) const { return int(k) * ranks + p; }
};

__host__ __device__ inline size_t round16(size_t b) { return (b + 15) / 16 * 16; }
__host__ __device__ size_t header_bytes(int K, size_t fl) {
  return (size_t(K) * (8 + fl) + 15) / 16 * 16;
}
__host__ __device__ size_t request_bytes(int K) { return (8 + size_t(K) * 8 + 15) / 16 * 16; }

// The node's barrier inboxes (LSA pointers by the rank's index in its node; the window's words
// are laid out with the world's stride).
struct NodeInbox {
  ncclWindow_t win;
  int stride;
  __device__ uint32_t* at(int owner, uint32_t index, int from) const {
    return static_cast<uint32_t*>(ncclGetLsaPointer(
        win, (size_t(index) * size_t(stride) + size_t(from)) * sizeof(uint32_t), owner));
  }
};
using NodeBarrier = BoundedBarrier<NodeInbox>;
struct NodeMeet {
  NodeInbox inbox;
  BarrierArgs args;  // rank and ranks: within the node
};

// Thread 0: waits until signal `sig` reached `least` (bounded like the barriers'); false when it
// gave up (then recorded).
__device__ bool wait_signal(const ncclGin& gin, int sig, uint64_t least, const BarrierArgs& a,
                            int peer, uint32_t where) {
  uint64_t start = 0;
  for (uint32_t polls = 1;; ++polls) {
    if (int64_t(gin.readSignal(ncclGinSignal_t(sig)) - least) >= 0) return true;
    if (polls % kPollsPerLook != 0) continue;
    const uint64_t now = global_ns();
    if (start == 0) start = now;
    if (a.state->abort) {
      give_up(a, kWaitAborted, peer, where);
      return false;
    }
    if (a.timeout_ns && now - start > a.timeout_ns) {
      give_up(a, kWaitTimedOut, peer, where);
      return false;
    }
  }
}

// Every thread: whether this CTA is the kernel's last to get here (then every other CTA's work
// is visible to it). Resets the counter for the next call.
__device__ bool last_cta(uint32_t* done) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(done, 1u) == gridDim.x - 1;
    if (last) *done = 0;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// Every thread: flushes this CTA's puts (their sources may be written again), giving up like a
// wait (clock cycles bound it: at most 2 GHz, so at least timeout_ns); false when it gave up.
// `peer`: the rank named when it gives up (a rank of another node).
__device__ bool flush_cta(const ncclGin& gin, const BarrierArgs& a, uint32_t where, int peer) {
  __shared__ int gave_up;
  if (a.timeout_ns == 0) {
    gin.flush(ncclCoopCta());
    return true;
  }
  const ncclResult_t rc =
      gin.flush(ncclCoopCta(), ::cuda::memory_order_acquire, ncclGin_None{}, 2 * a.timeout_ns);
  if (threadIdx.x == 0) {
    gave_up = rc != ncclSuccess;
    if (gave_up) give_up(a, kWaitTimedOut, peer, where);
  }
  __syncthreads();
  return !gave_up;
}

// Every thread: as a forwarder, each other node's source's count of messages (put into counts
// slot `slot` with increments of signal kind `count_kind`), then that many increments of
// `data_kind` (thread 0 waits, bounded); count[n] per node n (0 for this one). False on every
// thread when a wait gave up.
__device__ bool receive(const ncclGin& gin, const Geo& g, const GinState* st, ncclWindow_t stage,
                        Sig count_kind, Sig data_kind, int slot, uint32_t* count,
                        const BarrierArgs& a, uint32_t where) {
  __shared__ int failed;
  if (threadIdx.x == 0) {
    failed = 0;
    for (int n = 0; n < g.nodes && !failed; ++n) {
      count[n] = 0;
      if (n == g.node) continue;
      const int s = g.peer_on(n);
      if (!wait_signal(gin, g.sig(count_kind, s), st->seen[count_kind][s] + 1, a, s, where)) {
        failed = 1;
        break;
      }
      const auto* c = static_cast<const volatile uint64_t*>(
          ncclGetLocalPointer(stage, g.counts + size_t(slot * g.ranks + s) * 8));
      count[n] = uint32_t(*c);
      failed =
          !wait_signal(gin, g.sig(data_kind, s), st->seen[data_kind][s] + count[n], a, s, where);
    }
  }
  __syncthreads();
  return !failed;
}

// Message x of the received ones, node after node: its node n and its index there.
__device__ int64_t message_of(int64_t x, const uint32_t* count, int& n) {
  n = 0;
  while (x >= int64_t(count[n])) x -= count[n++];
  return x;
}

// LSA pointers by world rank, within the node.
struct NodeAt {
  Geo g;
  __device__ void* operator()(ncclWindow_t w, size_t off, int r) const {
    return ncclGetLsaPointer(w, off, g.lsa_of(r));
  }
};

// ---- dispatch
// ------------------------------------------------------------------------------------

template <class W, class F>
__global__ void __launch_bounds__(kThreads)
    gin_send(NodeMeet meet, uint32_t bar, ncclDevComm dc, ncclWindow_t stage, Geo g, GinState* st,
             ncclWindow_t recv, ncclWindow_t members, ncclWindow_t weights, int64_t tokens, int K,
             const int32_t* __restrict__ dest_rank, const int32_t* __restrict__ dest_row,
             const F* __restrict__ weight, int64_t row_lo, int64_t rows, RowChunks chunks,
             const W* __restrict__ src, int64_t row_words) {
  constexpr int kInFlight = 8;
  NodeBarrier b(meet.inbox, meet.args, bar + blockIdx.x);
  if (!b.sync()) return;
  ncclGin gin(dc, 0);
  __shared__ int failed;
  if (threadIdx.x == 0) {
    failed = 0;
    const uint32_t calls = st->dispatches;
    for (int n = 0; n < g.nodes && calls > 0 && !failed; ++n) {
      const int f = g.peer_on(n);
      if (n != g.node)
        failed = !wait_signal(gin, g.sig(kDCredit, f), st->seen[kDCredit][f] + calls, meet.args, f,
                              bar + blockIdx.x);
    }
  }
  __syncthreads();
  if (failed) return;
  const size_t hdr = header_bytes(K, sizeof(F));
  const size_t msg = round16(hdr + size_t(row_words) * sizeof(W));
  auto* stage_base = static_cast<char*>(ncclGetLocalPointer(stage, 0));
  const NodeAt at{g};
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; t < tokens; t += warps) {
    cuda::TokenLanes e = cuda::route_lanes(t, K, g.ranks, dest_rank, dest_row, row_lo, rows, lane);
    cuda::keep_chunk(e, chunks);
    const int node = e.in ? g.node_of(e.rank) : -1;
    const F wt = weight ? weight[t * K + min(lane, K - 1)] : F(1);
    // This node's ranks: the one-node dispatch of the token's entries here.
    const unsigned here = __ballot_sync(kFull, node == g.node);
    cuda::TokenLanes mine = e;
    mine.in = e.in && node == g.node;
    mine.lead = e.lead && node == g.node;
    mine.group &= here;
    mine.leads &= here;
    dispatch_token<kInFlight>(mine, K, wt, weight != nullptr, src + t * row_words, row_words, lane,
                              at, recv, members, weights);
    // Every other node: one message to its forwarder.
    for (unsigned away = __ballot_sync(kFull, e.in && node != g.node); away;) {
      const int n = __shfl_sync(kFull, node, __ffs(away) - 1);
      const unsigned there = __ballot_sync(kFull, node == n);
      away &= ~there;
      uint32_t j = 0;
      if (lane == 0) j = atomicAdd(&st->sent[n], 1u);
      j = __shfl_sync(kFull, j, 0);
      const size_t off = g.d_send + size_t(n) * g.d_region() + size_t(j) * msg;
      char* m = stage_base + off;
      if (lane < K) {
        const bool on = (there >> lane) & 1u;
        reinterpret_cast<int2*>(m)[lane] = on ? make_int2(e.rank, e.row) : make_int2(-1, -1);
        reinterpret_cast<F*>(m + size_t(K) * 8)[lane] = on && weight ? wt : F(1);
      }
      cuda::warp_copy_row<kInFlight>(reinterpret_cast<W*>(m + hdr), src + t * row_words, row_words,
                                     lane);
      __syncwarp();
      if (lane == 0)
        gin.put(ncclTeamWorld(dc), g.peer_on(n), stage,
                g.d_recv + size_t(g.node) * g.d_region() + size_t(j) * msg, stage, off, msg,
                ncclGin_SignalInc{ncclGinSignal_t(g.sig(kDData, g.rank))});
    }
  }
  if (!flush_cta(gin, meet.args, bar + blockIdx.x, g.peer_on((g.node + 1) % g.nodes))) return;
  if (last_cta(&st->done[0]) && threadIdx.x == 0) {
    for (int n = 0; n < g.nodes; ++n) {
      if (n == g.node) continue;
      const uint64_t count = st->sent[n];
      st->sent[n] = 0;
      gin.putValue(ncclTeamWorld(dc), g.peer_on(n), stage,
                   g.counts + size_t(0 * g.ranks + g.rank) * 8, count,
                   ncclGin_SignalInc{ncclGinSignal_t(g.sig(kDCount, g.rank))});
    }
    ++st->dispatches;
  }
}

template <class W, class F>
__global__ void __launch_bounds__(kThreads)
    gin_forward(NodeMeet meet, uint32_t bar, ncclDevComm dc, ncclWindow_t stage, Geo g,
                GinState* st, ncclWindow_t recv, ncclWindow_t members, ncclWindow_t weights, int K,
                int64_t row_words) {
  constexpr int kInFlight = 8;
  NodeBarrier b(meet.inbox, meet.args, bar + blockIdx.x);
  ncclGin gin(dc, 0);
  __shared__ uint32_t count[kMaxNodes];
  if (!receive(gin, g, st, stage, kDCount, kDData, 0, count, meet.args, bar + blockIdx.x)) return;
  const size_t hdr = header_bytes(K, sizeof(F));
  const size_t msg = round16(hdr + size_t(row_words) * sizeof(W));
  const auto* stage_base = static_cast<const char*>(ncclGetLocalPointer(stage, 0));
  const NodeAt at{g};
  const int lane = int(threadIdx.x) & 31;
  int64_t total = 0;
  for (int n = 0; n < g.nodes; ++n) total += count[n];
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t x = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; x < total; x += warps) {
    int n = 0;
    const int64_t j = message_of(x, count, n);
    const char* m = stage_base + g.d_recv + size_t(n) * g.d_region() + size_t(j) * msg;
    int rank = -1;
    int64_t q = -1;
    F wt = F(1);
    if (lane < K) {
      const int2 rr = reinterpret_cast<const int2*>(m)[lane];
      rank = rr.x, q = rr.y;
      wt = reinterpret_cast<const F*>(m + size_t(K) * 8)[lane];
    }
    const cuda::TokenLanes e = cuda::lanes_of(rank, q, rank >= 0, K);
    dispatch_token<kInFlight>(e, K, wt, true, reinterpret_cast<const W*>(m + hdr), row_words, lane,
                              at, recv, members, weights);
  }
  if (last_cta(&st->done[1]) && threadIdx.x == 0) {
    for (int n = 0; n < g.nodes; ++n) {
      if (n == g.node) continue;
      const int s = g.peer_on(n);
      st->seen[kDCount][s] += 1;
      st->seen[kDData][s] += count[n];
      gin.signal(ncclTeamWorld(dc), s, ncclGin_SignalInc{ncclGinSignal_t(g.sig(kDCredit, g.rank))});
    }
  }
  b.sync();
}

// ---- combine
// -------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    gin_request(BarrierArgs args, uint32_t bar, ncclDevComm dc, ncclWindow_t stage, Geo g,
                GinState* st, int2* slots, int64_t tokens, int K,
                const int32_t* __restrict__ dest_rank, const int32_t* __restrict__ dest_row,
                int64_t row_lo, int64_t rows, RowChunks chunks, bool want_values) {
  ncclGin gin(dc, 0);
  const size_t req = request_bytes(K);
  auto* stage_base = static_cast<char*>(ncclGetLocalPointer(stage, 0));
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; t < tokens; t += warps) {
    const cuda::TokenLanes e =
        cuda::route_lanes(t, K, g.ranks, dest_rank, dest_row, row_lo, rows, lane);
    if (!cuda::combine_sums(chunks, e.in, e.rank, e.row)) continue;
    const int node = e.in ? g.node_of(e.rank) : -1;
    for (unsigned away = __ballot_sync(kFull, e.in && node != g.node); away;) {
      const int n = __shfl_sync(kFull, node, __ffs(away) - 1);
      const unsigned there = __ballot_sync(kFull, node == n);
      away &= ~there;
      int2 jo = make_int2(0, 0);
      if (lane == 0) {
        jo.x = int(atomicAdd(&st->asked[n], 1u));
        jo.y = int(atomicAdd(&st->lead_rows[n], unsigned(__popc(e.leads & there))));
        slots[t * g.nodes + n] = jo;
      }
      jo.x = __shfl_sync(kFull, jo.x, 0);
      jo.y = __shfl_sync(kFull, jo.y, 0);
      const size_t off = g.q_send + size_t(n) * g.q_region() + size_t(jo.x) * req;
      char* m = stage_base + off;
      if (lane == 0) reinterpret_cast<int2*>(m)[0] = make_int2(jo.y, want_values ? 1 : 0);
      if (lane < K)
        reinterpret_cast<int2*>(m + 8)[lane] =
            ((there >> lane) & 1u) ? make_int2(e.rank, e.row) : make_int2(-1, -1);
      __syncwarp();
      if (lane == 0)
        gin.put(ncclTeamWorld(dc), g.peer_on(n), stage,
                g.q_recv + size_t(g.node) * g.q_region() + size_t(jo.x) * req, stage, off, req,
                ncclGin_SignalInc{ncclGinSignal_t(g.sig(kReqData, g.rank))});
    }
  }
  if (!flush_cta(gin, args, bar + blockIdx.x, g.peer_on((g.node + 1) % g.nodes))) return;
  if (last_cta(&st->done[2]) && threadIdx.x == 0) {
    for (int n = 0; n < g.nodes; ++n) {
      st->asked_last[n] = st->asked[n];
      if (n != g.node)
        gin.putValue(ncclTeamWorld(dc), g.peer_on(n), stage,
                     g.counts + size_t(1 * g.ranks + g.rank) * 8, uint64_t(st->asked[n]),
                     ncclGin_SignalInc{ncclGinSignal_t(g.sig(kReqCount, g.rank))});
      st->asked[n] = 0;
      st->lead_rows[n] = 0;
    }
    st->values_last = want_values ? 1u : 0u;
  }
}

template <class W, class F>
__global__ void __launch_bounds__(kThreads)
    gin_reply(NodeMeet meet, uint32_t bar, ncclDevComm dc, ncclWindow_t stage, Geo g, GinState* st,
              ncclWindow_t red, ncclWindow_t values, int K, int64_t row_words) {
  constexpr int kInFlight = 8;
  NodeBarrier b(meet.inbox, meet.args, bar + blockIdx.x);
  if (!b.sync()) return;
  ncclGin gin(dc, 0);
  __shared__ uint32_t count[kMaxNodes];
  if (!receive(gin, g, st, stage, kReqCount, kReqData, 1, count, meet.args, bar + blockIdx.x))
    return;
  const size_t req = request_bytes(K);
  const size_t row_bytes = size_t(row_words) * sizeof(W), rstride = round16(row_bytes);
  auto* stage_base = static_cast<char*>(ncclGetLocalPointer(stage, 0));
  const NodeAt at{g};
  const int lane = int(threadIdx.x) & 31;
  int64_t total = 0;
  for (int n = 0; n < g.nodes; ++n) total += count[n];
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t x = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; x < total; x += warps) {
    int n = 0;
    const int64_t j = message_of(x, count, n);
    const char* m = stage_base + g.q_recv + size_t(n) * g.q_region() + size_t(j) * req;
    const int2 head = reinterpret_cast<const int2*>(m)[0];
    int rank = -1;
    int64_t q = -1;
    if (lane < K) {
      const int2 rr = reinterpret_cast<const int2*>(m + 8)[lane];
      rank = rr.x, q = rr.y;
    }
    const cuda::TokenLanes e = cuda::lanes_of(rank, q, rank >= 0, K);
    const int s = g.peer_on(n);
    F* vals = reinterpret_cast<F*>(stage_base + g.v_send + size_t(n) * g.v_region() +
                                   size_t(j) * kMaxTopK * sizeof(F));
    if (head.y && lane < K)
      vals[lane] =
          e.in ? *static_cast<const F*>(at(values, size_t(e.row) * sizeof(F), e.rank)) : F(0);
    const size_t rows_off = g.r_send + size_t(n) * g.r_region() + size_t(head.x) * rstride;
    int i = 0;
    for (unsigned l = e.leads; l; l &= l - 1, ++i) {
      const int ll = __ffs(l) - 1;
      const int r = __shfl_sync(kFull, e.rank, ll);
      const int32_t p = __shfl_sync(kFull, e.row, ll);
      cuda::warp_copy_row<kInFlight>(
          reinterpret_cast<W*>(stage_base + rows_off + size_t(i) * rstride),
          static_cast<const W*>(at(red, size_t(p) * row_bytes, r)), row_words, lane);
    }
    __syncwarp();
    if (lane == 0) {
      gin.put(ncclTeamWorld(dc), s, stage,
              g.r_recv + size_t(g.node) * g.r_region() + size_t(head.x) * rstride, stage, rows_off,
              size_t(i) * rstride, ncclGin_SignalInc{ncclGinSignal_t(g.sig(kRepData, g.rank))});
      if (head.y)
        gin.put(ncclTeamWorld(dc), s, stage,
                g.v_recv + size_t(g.node) * g.v_region() + size_t(j) * kMaxTopK * sizeof(F), stage,
                g.v_send + size_t(n) * g.v_region() + size_t(j) * kMaxTopK * sizeof(F),
                size_t(K) * sizeof(F), ncclGin_SignalInc{ncclGinSignal_t(g.sig(kRepData, g.rank))});
    }
  }
  if (!flush_cta(gin, meet.args, bar + blockIdx.x, g.peer_on((g.node + 1) % g.nodes))) return;
  if (last_cta(&st->done[3]) && threadIdx.x == 0) {
    for (int n = 0; n < g.nodes; ++n) {
      if (n == g.node) continue;
      const int s = g.peer_on(n);
      st->seen[kReqCount][s] += 1;
      st->seen[kReqData][s] += count[n];
    }
  }
  b.sync();
}

template <class Y, class W, class F>
__global__ void __launch_bounds__(kThreads)
    gin_sum(NodeMeet meet, uint32_t bar, ncclDevComm dc, ncclWindow_t stage, Geo g, GinState* st,
            const int2* slots, ncclWindow_t red, ncclWindow_t values, int64_t tokens, int K,
            const int32_t* __restrict__ dest_rank, const int32_t* __restrict__ dest_row,
            int64_t row_lo, int64_t rows, RowChunks chunks, const int32_t* accumulate, W* y,
            int64_t row_words, F* values_out) {
  NodeBarrier b(meet.inbox, meet.args, bar + blockIdx.x);
  ncclGin gin(dc, 0);
  __shared__ int failed;
  const uint32_t per_request = 1u + st->values_last;
  if (threadIdx.x == 0) {
    failed = 0;
    for (int n = 0; n < g.nodes && !failed; ++n) {
      const int f = g.peer_on(n);
      if (n != g.node)
        failed = !wait_signal(gin, g.sig(kRepData, f),
                              st->seen[kRepData][f] + uint64_t(st->asked_last[n]) * per_request,
                              meet.args, f, bar + blockIdx.x);
    }
  }
  __syncthreads();
  if (failed) return;
  const bool add = accumulate && *accumulate != 0;
  const size_t row_bytes = size_t(row_words) * sizeof(W), rstride = round16(row_bytes);
  const auto* stage_base = static_cast<const char*>(ncclGetLocalPointer(stage, 0));
  const NodeAt at{g};
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; t < tokens; t += warps) {
    const cuda::TokenLanes e =
        cuda::route_lanes(t, K, g.ranks, dest_rank, dest_row, row_lo, rows, lane);
    if (!cuda::combine_sums(chunks, e.in, e.rank, e.row)) continue;
    const int node = e.in ? g.node_of(e.rank) : -1;
    const bool away = e.in && node != g.node;
    const int2 jo = away ? slots[t * g.nodes + node] : make_int2(0, 0);
    if (values_out && e.in)
      values_out[t * K + lane] =
          away ? reinterpret_cast<const F*>(stage_base + g.v_recv + size_t(node) * g.v_region() +
                                            size_t(jo.x) * kMaxTopK * sizeof(F))[lane]
               : *static_cast<const F*>(at(values, size_t(e.row) * sizeof(F), e.rank));
    if (e.leads == 0 && add) continue;
    unsigned long long from = 0ull;
    // The lead lanes of the token's node, for the index of a lead among its node's leads.
    const unsigned same_node = __match_any_sync(kFull, node);
    if (e.lead)
      from = away
                 ? reinterpret_cast<unsigned long long>(
                       stage_base + g.r_recv + size_t(node) * g.r_region() +
                       (size_t(jo.y) + size_t(__popc(e.leads & same_node & ((1u << lane) - 1u)))) *
                           rstride)
                 : reinterpret_cast<unsigned long long>(at(red, size_t(e.row) * row_bytes, e.rank));
    // Lane j takes the address of the j-th lead (k order).
    unsigned rest = e.leads;
    for (int j = 0; j < lane && rest; ++j) rest &= rest - 1;
    const unsigned long long lane_row = __shfl_sync(kFull, from, rest ? __ffs(rest) - 1 : 0);
    sum_rows<Y, W>(y + t * row_words, row_words, add, lane_row, __popc(e.leads), lane);
  }
  if (last_cta(&st->done[4]) && threadIdx.x == 0) {
    for (int n = 0; n < g.nodes; ++n)
      if (n != g.node)
        st->seen[kRepData][g.peer_on(n)] += uint64_t(st->asked_last[n]) * per_request;
  }
  b.sync();
}

// ---- clone ops
// -------------------------------------------------------------------------------------

// The items of a clone op at a consumer rank d, in order. Pull: d's spare slots s that hold an
// expert, from the expert's home rank (its home slot). Reduce: d's home experts j and their
// replicas rep = 1..M-1, from the replica's rank (its spare slot), so that d adds them in replica
// order, as one node does. An item from d's own node moves over LSA; one from another node
// through d's clone staging: its source puts it into slot i % P (i: its index among d's items
// from other nodes) once d has granted it a credit, with an increment of the source's data
// signal at d. d grants the first P credits at entry and item i + P's once every consumer CTA is
// done with item i: P slots whatever the plan.
struct ClonePlan {
  const int32_t* spare_expert;  // [R * S]
  const int32_t* replica_rank;  // [E * M]
  const int32_t* replica_slot;  // [E * M]
  int S, M, epr;
};

struct CloneItem {
  int src;       // the source rank
  int src_slot;  // pull: the home slot at src; reduce: the spare slot at src
  int dst_slot;  // pull: the spare slot at d; reduce: the home expert at d
};

// f(item) for d's items in order, while f returns true.
template <bool kPull, class Fn>
__device__ void for_items(const ClonePlan& p, int d, Fn&& f) {
  if constexpr (kPull) {
    for (int s = 0; s < p.S; ++s) {
      const int e = p.spare_expert[int64_t(d) * p.S + s];
      if (e >= 0 && !f(CloneItem{e / p.epr, e % p.epr, s})) return;
    }
  } else {
    for (int j = 0; j < p.epr; ++j) {
      const int64_t e = int64_t(d) * p.epr + j;
      for (int rep = 1; rep < p.M; ++rep) {
        const int r = p.replica_rank[e * p.M + rep];
        if (r >= 0 && !f(CloneItem{r, p.replica_slot[e * p.M + rep] - p.epr, j})) return;
      }
    }
  }
}

// f(item, i) for d's items from other nodes, i their index, while f returns true.
template <bool kPull, class Fn>
__device__ void for_staged(const ClonePlan& p, const Geo& g, int d, Fn&& f) {
  int i = 0;
  for_items<kPull>(
      p, d, [&](const CloneItem& it) { return g.node_of(it.src) == g.node_of(d) || f(it, i++); });
}

// A clone op (pull: copy the words E of a slot; reduce: add its elements E) on every rank, with
// the same grid of at least 2 CTAs: CTA 0 sends (this rank's first P credits, then per rank d of
// another node, a thread each, the items this rank is the source of at d, in d's order, each
// after its credit); CTAs 1.. consume this rank's items in order (a share of each slot's elements
// per CTA). `src_win`: pull, the home slots; reduce, the spare slots (slot_elems E each).
// `dst`: pull, the spare slots; reduce, the home experts' gradients.
template <bool kPull, class E>
__global__ void __launch_bounds__(kThreads)
    gin_clones(NodeMeet meet, uint32_t bar, ncclDevComm dc, ncclWindow_t cstage, Geo g,
               GinState* st, ClonePlan p, ncclWindow_t src_win, E* dst, int64_t slot_elems) {
  NodeBarrier b(meet.inbox, meet.args, bar + blockIdx.x);
  if (!b.sync()) return;
  ncclGin gin(dc, 0);
  const size_t slot_bytes = size_t(slot_elems) * sizeof(E);
  const int P = g.clone_slots;
  const uint32_t where = bar + blockIdx.x;
  const int away_peer = g.peer_on((g.node + 1) % g.nodes);
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0)
      for_staged<kPull>(p, g, g.rank, [&](const CloneItem& it, int i) {
        if (i >= P) return false;
        gin.signal(ncclTeamWorld(dc), it.src,
                   ncclGin_SignalInc{ncclGinSignal_t(g.sig(kClCredit, g.rank))});
        return true;
      });
    const int d = int(threadIdx.x);
    if (d < g.ranks && g.node_of(d) != g.node) {
      uint64_t m = 0;
      for_staged<kPull>(p, g, d, [&](const CloneItem& it, int i) {
        if (it.src != g.rank) return true;
        if (!wait_signal(gin, g.sig(kClCredit, d), st->seen[kClCredit][d] + ++m, meet.args, d,
                         where)) {
          failed = 1;
          return false;
        }
        gin.put(ncclTeamWorld(dc), d, cstage, size_t(i % P) * g.clone_slot_bytes, src_win,
                size_t(it.src_slot) * slot_bytes, slot_bytes,
                ncclGin_SignalInc{ncclGinSignal_t(g.sig(kClData, g.rank))});
        return true;
      });
    }
    __syncthreads();
    if (failed || !flush_cta(gin, meet.args, where, away_peer)) return;
  } else {
    __shared__ uint32_t from[kMaxGinRanks];  // items consumed so far from each source
    for (int r = int(threadIdx.x); r < g.ranks; r += kThreads) from[r] = 0;
    __syncthreads();
    const int consumers = int(gridDim.x) - 1;
    const int64_t first = int64_t(blockIdx.x - 1) * kThreads + threadIdx.x;
    const int64_t stride = int64_t(consumers) * kThreads;
    const auto* stage = static_cast<const char*>(ncclGetLocalPointer(cstage, 0));
    int i = 0;  // staged items consumed
    for_items<kPull>(p, g.rank, [&](const CloneItem& it) {
      E* to = dst + int64_t(it.dst_slot) * slot_elems;
      const bool away = g.node_of(it.src) != g.node;
      const E* from_row;
      if (!away) {
        from_row = static_cast<const E*>(
            ncclGetLsaPointer(src_win, size_t(it.src_slot) * slot_bytes, g.lsa_of(it.src)));
      } else {
        if (threadIdx.x == 0)
          failed =
              !wait_signal(gin, g.sig(kClData, it.src), st->seen[kClData][it.src] + ++from[it.src],
                           meet.args, it.src, where);
        __syncthreads();
        if (failed) return false;
        from_row = reinterpret_cast<const E*>(stage + size_t(i % P) * g.clone_slot_bytes);
      }
      for (int64_t x = first; x < slot_elems; x += stride) {
        // The staging slot is written again within this kernel: past L1.
        const E v = away ? __ldcg(from_row + x) : from_row[x];
        if constexpr (kPull)
          to[x] = v;
        else
          to[x] += v;
      }
      if (away) {
        __syncthreads();
        if (threadIdx.x == 0) {
          __threadfence();
          if (atomicAdd(&st->item_done[i % P], 1u) == uint32_t(consumers) - 1) {
            st->item_done[i % P] = 0;
            const int next = i + P;
            for_staged<kPull>(p, g, g.rank, [&](const CloneItem& nx, int k) {
              if (k < next) return true;
              gin.signal(ncclTeamWorld(dc), nx.src,
                         ncclGin_SignalInc{ncclGinSignal_t(g.sig(kClCredit, g.rank))});
              return false;
            });
          }
        }
        ++i;
      }
      return true;
    });
    if (failed) return;
  }
  if (last_cta(&st->done[5]) && threadIdx.x == 0) {
    // What this call consumed of each signal: the items from each source on another node, and
    // the credits each consumer on another node granted this rank.
    for_staged<kPull>(p, g, g.rank, [&](const CloneItem& it, int) {
      st->seen[kClData][it.src] += 1;
      return true;
    });
    for (int d = 0; d < g.ranks; ++d)
      if (g.node_of(d) != g.node)
        for_staged<kPull>(p, g, d, [&](const CloneItem& it, int) {
          if (it.src == g.rank) st->seen[kClCredit][d] += 1;
          return true;
        });
  }
  b.sync();
}

__global__ void read_signals(ncclDevComm dc, int signals, GinState* st, int ranks) {
  ncclGin gin(dc, 0);
  for (int i = int(threadIdx.x); i < signals; i += int(blockDim.x))
    st->seen[i / ranks][i % ranks] = gin.readSignal(ncclGinSignal_t(i));
}

// ---- the communicator
// ----------------------------------------------------------------------------

// What the kernels above share on a rank: where things are, the staging windows and the device
// state. Made before the collective ops and the communicator, which both launch its kernels.
class GinCore {
 public:
  GinCore(Context& c, const NcclOptions& o) : ctx_(c), opts_(o) {
    const ncclDevComm& d = c.dev();
    g.rank = c.rank(), g.ranks = c.size(), g.per_node = d.lsaSize, g.lsa_rank = d.lsaRank;
    g.node = g.rank / g.per_node, g.nodes = g.ranks / g.per_node;
    g.max_tokens = o.gin_max_tokens;
    g.msg_max = round16(header_bytes(kMaxTopK, 8) + o.gin_max_row_bytes);
    g.req_max = request_bytes(kMaxTopK);
    g.rep_row_max = round16(o.gin_max_row_bytes);
    g.clone_slots = o.gin_clone_slots;
    g.clone_slot_bytes = round16(o.gin_clone_slot_bytes);
    const size_t N = size_t(g.nodes);
    size_t at = 0;
    auto take = [&](size_t region) {
      const size_t here = at;
      at += N * round16(region);
      return here;
    };
    g.d_send = take(g.d_region()), g.d_recv = take(g.d_region());
    g.q_send = take(g.q_region()), g.q_recv = take(g.q_region());
    g.r_send = take(g.r_region()), g.r_recv = take(g.r_region());
    g.v_send = take(g.v_region()), g.v_recv = take(g.v_region());
    g.counts = at;
    at += 2 * size_t(g.ranks) * 8;
    stage = c.make_symmetric_window(at,
                                    "the GIN staging window (NcclOptions::gin_max_tokens, "
                                    "gin_max_row_bytes)");
    if (g.clone_slot_bytes > 0)
      clone_stage = c.make_symmetric_window(
          size_t(g.clone_slots) * g.clone_slot_bytes,
          "the GIN clone staging window (NcclOptions::gin_clone_slots, gin_clone_slot_bytes)");
    // One device communicator, made again with GIN after the staging windows are registered.
    c.enable_gin(kSigKinds * g.ranks);
    MOE_ECHO_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&st), sizeof(GinState)));
    MOE_ECHO_CUDA_CHECK(cudaMemset(st, 0, sizeof(GinState)));
    MOE_ECHO_CUDA_CHECK(
        cudaMalloc(reinterpret_cast<void**>(&slots), size_t(g.max_tokens) * N * sizeof(int2)));
    load_kernels();
    MOE_ECHO_LAUNCH(read_signals, 1, 256, 0, nullptr, c.dev(), kSigKinds * g.ranks, st, g.ranks);
    MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
    c.boot().barrier();  // no rank puts before every rank has read its signals
  }
  // After the device is idle (the communicator's quiesce()).
  ~GinCore() {
    if (slots) (void)cudaFree(slots);
    if (st) (void)cudaFree(st);
    ctx_.release_window(clone_stage);
    ctx_.release_window(stage);
  }
  GinCore(const GinCore&) = delete;
  GinCore& operator=(const GinCore&) = delete;

  // Whether the clone ops are device kernels (the clone staging window exists): no host sync.
  bool device_clones() const { return g.clone_slot_bytes > 0; }
  Context& ctx() const { return ctx_; }
  const NcclOptions& opts() const { return opts_; }

  NodeMeet node_meet() const {
    BarrierArgs a = ctx_.barrier_args();
    a.rank = g.lsa_rank;
    a.ranks = g.per_node;
    return NodeMeet{NodeInbox{ctx_.inbox(), ctx_.size()}, a};
  }

  Geo g{};
  Window stage, clone_stage;
  GinState* st = nullptr;
  int2* slots = nullptr;  // gin_request's (request, reply row) per (token, node), for gin_sum

 private:
  // Loads every kernel of this file now. CUDA loads a kernel at its first launch by default, and
  // loading may wait for the device's running kernels; a first launch while a kernel of a
  // dispatch waits on the peer's GIN traffic (whose plugin thread may in turn wait for this
  // device) would never end.
  static void load_kernels() {
    cudaFuncAttributes a;
    auto load = [&](const void* f) { MOE_ECHO_CUDA_CHECK(cudaFuncGetAttributes(&a, f)); };
    for (DType fdt : {DType::f32, DType::f64})
      with_float(fdt, [&](auto fl) {
        using F = decltype(fl);
        for (size_t w : {16, 8, 4, 2, 1})
          with_word(w, [&](auto word) {
            using W = decltype(word);
            load(reinterpret_cast<const void*>(&gin_send<W, F>));
            load(reinterpret_cast<const void*>(&gin_forward<W, F>));
          });
        for (DType y : {DType::bf16, DType::f32, DType::f64})
          for (bool vec : {false, true})
            with_rows(y, vec, [&](auto elem, auto word) {
              using Y = decltype(elem);
              using W = decltype(word);
              load(reinterpret_cast<const void*>(&gin_reply<W, F>));
              load(reinterpret_cast<const void*>(&gin_sum<Y, W, F>));
            });
        load(reinterpret_cast<const void*>(&gin_clones<false, F>));
      });
    for (size_t w : {16, 8, 4, 2, 1})
      with_word(w, [&](auto word) {
        load(reinterpret_cast<const void*>(&gin_clones<true, decltype(word)>));
      });
    load(reinterpret_cast<const void*>(&gin_request));
    load(reinterpret_cast<const void*>(&read_signals));
  }

  Context& ctx_;
  NcclOptions opts_;
};

// The ops other than dispatch and combine across nodes: NCCL's host-API collectives over
// symmetric windows, and the clone ops as the gin_clones kernels where the clone staging window
// exists (NcclOptions::gin_clone_slot_bytes > 0), else NCCL's host API too.
class GinCollectiveOps final : public CollectiveOps {
 public:
  GinCollectiveOps(std::unique_ptr<CollectiveOps> host, const GinCore& core)
      : host_(std::move(host)), core_(core) {}

  bool host_api() const override { return host_->host_api(); }
  Window make_window(size_t bytes, const std::string& what) override {
    return host_->make_window(bytes, what);
  }
  void all_gather_i32(const int32_t* local, int32_t* all, int64_t n, cudaStream_t s) override {
    host_->all_gather_i32(local, all, n, s);
  }
  void all_reduce_sum(const Tensor& t, cudaStream_t s) override { host_->all_reduce_sum(t, s); }

  void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg, const Window& home,
                          void* spare, size_t slot_bytes, cudaStream_t s) override {
    if (!core_.device_clones())
      return host_->pull_clone_weights(plan, cfg, home, spare, slot_bytes, s);
    check_slot(slot_bytes, "pull_clone_weights");
    with_word(word_size(slot_bytes, {home.ptr, spare}), [&](auto word) {
      using W = decltype(word);
      launch<true>(plan, cfg, home, static_cast<W*>(spare), int64_t(slot_bytes / sizeof(W)),
                   kGinPullBarriers, s);
    });
  }

  void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg, const Window& spare,
                          void* home, int64_t slot_elems, DType dtype, cudaStream_t s) override {
    if (!core_.device_clones())
      return host_->reduce_clone_grads(plan, cfg, spare, home, slot_elems, dtype, s);
    check_slot(size_t(slot_elems) * dtype_size(dtype), "reduce_clone_grads");
    with_float(dtype, [&](auto fl) {
      using F = decltype(fl);
      launch<false>(plan, cfg, spare, static_cast<F*>(home), slot_elems, kGinReduceBarriers, s);
    });
  }

 private:
  void check_slot(size_t bytes, const char* op) const {
    if (bytes > core_.opts().gin_clone_slot_bytes)
      reject("gin_clone_slot_bytes (MOE_ECHO_GIN_CLONE_SLOT_BYTES)",
             core_.opts().gin_clone_slot_bytes,
             std::string("at least the ") + std::to_string(bytes) + "-byte slots of this " + op);
  }

  template <bool kPull, class E>
  void launch(const PlanView& plan, const PlannerConfig& cfg, const Window& src, E* dst,
              int64_t slot_elems, BarrierRange range, cudaStream_t s) {
    const ClonePlan p{plan.spare_expert, plan.replica_rank,  plan.replica_slot,
                      cfg.spare_slots,   cfg.max_replicas(), cfg.experts_per_rank()};
    MOE_ECHO_LAUNCH((gin_clones<kPull, E>), unsigned(core_.opts().ctas), kThreads, 0, s,
                    core_.node_meet(), barrier_base(range), core_.ctx().dev(),
                    core_.clone_stage.win, core_.g, core_.st, p, src.win, dst, slot_elems);
  }

  std::unique_ptr<CollectiveOps> host_;
  const GinCore& core_;
};

class NcclGinComm final : public NcclCommBase {
 public:
  NcclGinComm(std::unique_ptr<Context> ctx, std::unique_ptr<CollectiveOps> ops,
              std::unique_ptr<GinCore> core, const NcclOptions& o)
      : NcclCommBase(std::move(ctx), std::move(ops), o), core_(std::move(core)) {}

  ~NcclGinComm() override {
    quiesce();
    core_.reset();
  }

  // Every op a kernel or a host-API collective, with no host sync, where the clone ops are
  // kernels too (NcclOptions::gin_clone_slot_bytes > 0); else the clone ops copy the plan to the
  // host.
  bool capturable() const override { return core_->device_clones(); }

 private:
  void check_call(int64_t tokens, int K, size_t row_bytes, const char* op) const {
    if (tokens > core_->g.max_tokens)
      reject("gin_max_tokens (MOE_ECHO_GIN_MAX_TOKENS)", core_->g.max_tokens,
             std::string("at least the ") + std::to_string(tokens) + " tokens of this " + op);
    if (row_bytes > core_->opts().gin_max_row_bytes)
      reject("gin_max_row_bytes (MOE_ECHO_GIN_MAX_ROW_BYTES)", core_->opts().gin_max_row_bytes,
             std::string("at least the ") + std::to_string(row_bytes) + "-byte rows of this " + op);
    if (K > kMaxTopK) reject("top_k", K, "at most 32 across nodes");
  }

  void dispatch_rows(const RowRoute& route, RoundWindow window, const void* src, size_t row_bytes,
                     const Window& recv, const Window& members, const Window& weights, DType fdt,
                     cudaStream_t s) override {
    const int K = route.top_k;
    const int64_t tokens = route.n / K;
    check_call(tokens, K, row_bytes, "dispatch");
    const unsigned grid = unsigned(opts().ctas);
    with_float(fdt, [&](auto fl) {
      using F = decltype(fl);
      with_word(word_size(row_bytes, {src}), [&](auto word) {
        using W = decltype(word);
        const int64_t words = int64_t(row_bytes / sizeof(W));
        MOE_ECHO_LAUNCH((gin_send<W, F>), grid, kThreads, 0, s, core_->node_meet(),
                        barrier_base(kGinSendBarriers), ctx().dev(), core_->stage.win, core_->g,
                        core_->st, recv.win, members.win, weights.win, tokens, K, route.dest_rank,
                        route.dest_row, static_cast<const F*>(route.weight), window.row_lo,
                        window.rows, route.chunks, static_cast<const W*>(src), words);
        MOE_ECHO_LAUNCH((gin_forward<W, F>), grid, kThreads, 0, s, core_->node_meet(),
                        barrier_base(kGinForwardBarriers), ctx().dev(), core_->stage.win, core_->g,
                        core_->st, recv.win, members.win, weights.win, K, words);
      });
    });
  }

  void combine_rows(const RowRoute& route, RoundWindow window, const Window& red, const Tensor& y,
                    const int32_t* accumulate, const Window* values, DType fdt, void* values_out,
                    cudaStream_t s) override {
    const int K = route.top_k;
    const size_t row_bytes = size_t(y.size(1)) * dtype_size(y.dtype);
    check_call(y.size(0), K, row_bytes, "combine");
    const bool vec = row_bytes % 16 == 0 && cuda::aligned16(y.data);
    const unsigned grid = unsigned(opts().ctas);
    const ncclWindow_t vwin = values ? values->win : static_cast<ncclWindow_t>(nullptr);
    MOE_ECHO_LAUNCH(gin_request, grid, kThreads, 0, s, core_->node_meet().args,
                    barrier_base(kGinReplyBarriers), ctx().dev(), core_->stage.win, core_->g,
                    core_->st, core_->slots, y.size(0), K, route.dest_rank, route.dest_row,
                    window.row_lo, window.rows, route.chunks, values_out != nullptr);
    with_float(fdt, [&](auto fl) {
      using F = decltype(fl);
      with_rows(y.dtype, vec, [&](auto elem, auto word) {
        using Y = decltype(elem);
        using W = decltype(word);
        const int64_t words = int64_t(row_bytes / sizeof(W));
        MOE_ECHO_LAUNCH((gin_reply<W, F>), grid, kThreads, 0, s, core_->node_meet(),
                        barrier_base(kGinReplyBarriers), ctx().dev(), core_->stage.win, core_->g,
                        core_->st, red.win, vwin, K, words);
        MOE_ECHO_LAUNCH((gin_sum<Y, W, F>), grid, kThreads, 0, s, core_->node_meet(),
                        barrier_base(kGinSumBarriers), ctx().dev(), core_->stage.win, core_->g,
                        core_->st, core_->slots, red.win, vwin, y.size(0), K, route.dest_rank,
                        route.dest_row, window.row_lo, window.rows, route.chunks, accumulate,
                        static_cast<W*>(y.data), words, static_cast<F*>(values_out));
      });
    });
  }

  std::unique_ptr<GinCore> core_;
};

}  // namespace

bool gin_ready(Context& ctx, std::string* why) {
  ncclCommProperties_t props = NCCL_COMM_PROPERTIES_INITIALIZER;
  MOE_ECHO_NCCL_CHECK(ncclCommQueryProperties(ctx.comm(), &props));
  const ncclDevComm& d = ctx.dev();
  std::ostringstream m;
  if (props.ginType == NCCL_GIN_TYPE_NONE || !props.deviceApiSupport)
    m << "NCCL offers no GIN (device-initiated networking) between these ranks";
  else if (ctx.size() > kMaxGinRanks || ctx.size() % d.lsaSize != 0 ||
           d.lsaRank != ctx.rank() % d.lsaSize || ctx.size() / d.lsaSize > kMaxNodes)
    m << "the NVLink teams are not " << d.lsaSize << " consecutive world ranks each (rank "
      << ctx.rank() << " is " << d.lsaRank << " of " << d.lsaSize << " in its team, " << ctx.size()
      << " ranks, at most " << kMaxGinRanks << ")";
  if (why) *why = m.str();
  return m.str().empty();
}

namespace {

// The environment's `name` as an integer in [lo, hi], or `fallback` where it is not set.
int64_t env_int(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const char* v = std::getenv(name);
  if (!v) return fallback;
  const std::string s = v;
  long long x = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || x < lo || x > hi)
    reject(name, "'" + s + "'",
           "an integer from " + std::to_string(lo) + " to " + std::to_string(hi));
  return x;
}

}  // namespace

std::unique_ptr<Communicator> make_gin_comm(std::unique_ptr<Context> ctx,
                                            const NcclOptions& options) {
  // The environment replaces the staging sizes (for callers that set no options: the PyTorch
  // module).
  NcclOptions o = options;
  o.gin_max_tokens = env_int("MOE_ECHO_GIN_MAX_TOKENS", o.gin_max_tokens, 1, int64_t(1) << 24);
  o.gin_max_row_bytes = size_t(
      env_int("MOE_ECHO_GIN_MAX_ROW_BYTES", int64_t(o.gin_max_row_bytes), 16, int64_t(1) << 24));
  if (o.gin_max_tokens < 1) reject("gin_max_tokens", o.gin_max_tokens, ">= 1");
  if (o.gin_max_row_bytes < 16) reject("gin_max_row_bytes", o.gin_max_row_bytes, ">= 16");
  o.gin_clone_slot_bytes = size_t(env_int("MOE_ECHO_GIN_CLONE_SLOT_BYTES",
                                          int64_t(o.gin_clone_slot_bytes), 0, int64_t(1) << 40));
  o.gin_clone_slots =
      int(env_int("MOE_ECHO_GIN_CLONE_SLOTS", o.gin_clone_slots, 1, kMaxCloneSlots));
  if (o.gin_clone_slots < 1 || o.gin_clone_slots > kMaxCloneSlots)
    reject("gin_clone_slots", o.gin_clone_slots, "from 1 to " + std::to_string(kMaxCloneSlots));
  if (o.gin_clone_slot_bytes > 0 && o.ctas < 2)
    reject("ctas", o.ctas,
           "at least 2 where gin_clone_slot_bytes > 0 (a CTA sends, the others "
           "take what comes)");
  auto core = std::make_unique<GinCore>(*ctx, o);
  auto ops = std::make_unique<GinCollectiveOps>(make_host_api_collective_ops(*ctx, true), *core);
  return std::make_unique<NcclGinComm>(std::move(ctx), std::move(ops), std::move(core), o);
}

#endif  // MOE_ECHO_HAVE_GIN

}  // namespace moe_echo::nccl
