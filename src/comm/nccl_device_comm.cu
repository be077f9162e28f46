// The device-API side of the NCCL communicator (nccl_base.hpp): the sync-free communicator
// (NcclDeviceComm: dispatch and combine) and the device-API collective ops (all-gather,
// all-reduce, clone weight pull and gradient reduction), kernels of the NCCL device API that load
// and store peers' symmetric windows over NVLink (LSA pointers). Invariants every kernel here
// keeps:
// - A barrier-using kernel always launches with the same grid on every rank (kCtas CTAs, or one
//   CTA for the count all-gather), whatever its rank-local sizes: CTA i's barrier pairs with
//   CTA i of every peer, so a rank that skipped a launch would leave the others waiting (until
//   their waits give up: bounded_barrier.cuh). Rank-local work of zero size still launches and
//   only takes part in the barriers.
// - A barrier that gave up (a peer lost) returns false and the kernel returns without its work.
// - Each kernel type owns a disjoint range of barrier indices ([type * kMaxCtas, +kMaxCtas)).
// - Pattern of a data-moving kernel: barrier (acq_rel) at entry, so peers are done with the
//   buffers about to be written or read (their earlier kernels finished); the loads and stores;
//   barrier (acq_rel) at exit, so every store is visible to every peer and every peer is done
//   reading before anything overwrites what it read. The kernel that consumes the data is the
//   next one on the stream (all CTAs of this kernel have then passed their exit barriers).
// - Peers are addressed by world rank: these kernels run only where the LSA team is the whole
//   world, where LSA rank == world rank (make_nccl_communicator checks it before it builds
//   anything of this file; otherwise the host-API ops of nccl_host_comm.cu run, and none of the
//   kernels with barriers is launched).
// - Per-step ops read routes, plans and counts on the device; nothing here reads device memory
//   on the host.
//
// Dispatch and combine work per token, one warp each (top_k <= 32: lane k holds entry k). The
// lanes find the token's leads in the round's window with one __match_any_sync on the
// destination rank and the lowest window row of each group; the dispatch reads the token row once
// and stores it into each lead's receive row on its rank, with the fan table entries of the lead's
// members; the combine pulls one pre-reduced row per lead and sums them in k order. A token picking
// several experts on one rank thus moves one row each way.
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>

#include "comm/dispatch_token.cuh"
#include "comm/nccl_base.hpp"
#include "comm/nccl_rows.cuh"
#include "comm/token_lanes.cuh"
#include "cuda/common.cuh"
#include "cuda/warp_copy.cuh"
#include "moe_echo/error.hpp"

namespace moe_echo::nccl {
namespace {

using cuda::as_cuda;
using cuda::with_word;
using cuda::word_size;

// The barriers' inboxes in the symmetric window, addressed through LSA pointers.
struct LsaInbox {
  ncclWindow_t win;
  int ranks;
  __device__ uint32_t* at(int owner, uint32_t index, int from) const {
    return static_cast<uint32_t*>(ncclGetLsaPointer(
        win, (size_t(index) * size_t(ranks) + size_t(from)) * sizeof(uint32_t), owner));
  }
};

// What a barrier kernel takes to meet its peers.
struct Meet {
  LsaInbox inbox;
  BarrierArgs args;
};

using Barrier = BoundedBarrier<LsaInbox>;

// ---- device kernels ----------------------------------------------------------------------------

// Dispatch: one warp per token. The lanes find the token's leads in the window (with chunks,
// those of the pairs whose lead row is in the call's chunk at its rank); the warp reads the token
// row once (kInFlight 16-byte words per lane in flight) and stores it into every lead's receive
// row on its rank, and writes the fan table there: each member's window row and weight into its
// lead's members/weights rows (the lead first, then k order), -1 padding after the last member,
// and -1 at members[q][0] of every non-lead row q.
template <class W, class F>
__global__ void __launch_bounds__(kThreads)
    dispatch_kernel(Meet meet, uint32_t bar, ncclWindow_t recv, ncclWindow_t members,
                    ncclWindow_t weights, int64_t tokens, int K, int ranks,
                    const int32_t* __restrict__ dest_rank, const int32_t* __restrict__ dest_row,
                    const F* __restrict__ weight, int64_t row_lo, int64_t rows, RowChunks chunks,
                    const W* __restrict__ src, int64_t row_words) {
  constexpr int kInFlight = 8;
  Barrier b(meet.inbox, meet.args, bar + blockIdx.x);
  if (!b.sync()) return;
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; t < tokens; t += warps) {
    cuda::TokenLanes e = cuda::route_lanes(t, K, ranks, dest_rank, dest_row, row_lo, rows, lane);
    cuda::keep_chunk(e, chunks);
    dispatch_token<kInFlight>(
        e, K, weight ? weight[t * K + min(lane, K - 1)] : F(1), weight != nullptr,
        src + t * row_words, row_words, lane,
        [&](ncclWindow_t w, size_t off, int r) { return ncclGetLsaPointer(w, off, r); }, recv,
        members, weights);
  }
  b.sync();
}

// Combine: one warp per token. y[t] <- (add ? y[t] : 0) + the red rows of its leads, pulled from
// their ranks in k order (sum_rows); values_out[i] <- the fan values of every entry in the window.
// A token without leads keeps y[t] when adding and gets zeros otherwise. With chunks, the tokens
// the call sums only (cuda::combine_sums).
template <class Y, class W, class F>
__global__ void __launch_bounds__(kThreads)
    combine_kernel(Meet meet, uint32_t bar, ncclWindow_t red, ncclWindow_t values, int64_t tokens,
                   int K, int ranks, const int32_t* __restrict__ dest_rank,
                   const int32_t* __restrict__ dest_row, int64_t row_lo, int64_t rows,
                   RowChunks chunks, const int32_t* accumulate, W* y, int64_t row_words,
                   F* values_out) {
  Barrier b(meet.inbox, meet.args, bar + blockIdx.x);
  if (!b.sync()) return;
  const bool add = accumulate && *accumulate != 0;
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; t < tokens; t += warps) {
    const cuda::TokenLanes e =
        cuda::route_lanes(t, K, ranks, dest_rank, dest_row, row_lo, rows, lane);
    if (!cuda::combine_sums(chunks, e.in, e.rank, e.row)) continue;
    if (values_out && e.in)
      values_out[t * K + lane] =
          *static_cast<const F*>(ncclGetLsaPointer(values, size_t(e.row) * sizeof(F), e.rank));
    if (e.leads == 0 && add) continue;
    const unsigned long long from =
        e.lead ? reinterpret_cast<unsigned long long>(
                     ncclGetLsaPointer(red, size_t(e.row) * size_t(row_words) * sizeof(W), e.rank))
               : 0ull;
    // Lane j takes the address of the j-th lead (k order).
    unsigned rest = e.leads;
    for (int j = 0; j < lane && rest; ++j) rest &= rest - 1;
    const unsigned long long lane_row = __shfl_sync(kFull, from, rest ? __ffs(rest) - 1 : 0);
    sum_rows<Y, W>(y + t * row_words, row_words, add, lane_row, __popc(e.leads), lane);
  }
  b.sync();
}

// Splits the grid over `items` work items, so that items whose data sit on different peers move
// at once, each over its own links: with at least as many CTAs as items, CTA b works on item
// b % items as share b / items of that item's CTAs; with fewer, CTA b takes items b, b + grid, ...
// whole. Calls f(item, share, shares).
template <class F>
__device__ void for_item_shares(int items, F&& f) {
  const int grid = int(gridDim.x), b = int(blockIdx.x);
  if (grid >= items) {
    if (items > 0) f(b % items, b / items, (grid - 1 - b % items) / items + 1);
  } else {
    for (int i = b; i < items; i += grid) f(i, 0, 1);
  }
}

// Spare slot s of this rank <- home slot of the expert the plan puts there, from its home rank;
// the slots are filled at once (their home ranks may differ).
template <class W>
__global__ void __launch_bounds__(kThreads)
    pull_clones_kernel(Meet meet, ncclWindow_t win, uint32_t bar,
                       const int32_t* __restrict__ spare_expert, int rank, int spare_slots,
                       int experts_per_rank, W* spare, int64_t slot_words) {
  Barrier b(meet.inbox, meet.args, bar + blockIdx.x);
  if (!b.sync()) return;
  const int32_t* mine = spare_expert + int64_t(rank) * spare_slots;
  int filled = 0;
  for (int s = 0; s < spare_slots; ++s) filled += mine[s] >= 0;
  for_item_shares(filled, [&](int item, int share, int shares) {
    int s = 0;
    for (int seen = -1; s < spare_slots; ++s)
      if (mine[s] >= 0 && ++seen == item) break;
    const int e = mine[s];
    const W* from = static_cast<const W*>(ncclGetLsaPointer(
        win, size_t(e % experts_per_rank) * size_t(slot_words) * sizeof(W), e / experts_per_rank));
    W* to = spare + int64_t(s) * slot_words;
    const int64_t stride = int64_t(shares) * kThreads;
    for (int64_t w = int64_t(share) * kThreads + threadIdx.x; w < slot_words; w += stride)
      to[w] = from[w];
  });
  b.sync();
}

// Every home expert of this rank with clones adds, in replica order, its clones' gradients from
// their ranks; the experts are reduced at once (their clones may sit on different ranks).
template <class T>
__global__ void __launch_bounds__(kThreads)
    reduce_clones_kernel(Meet meet, ncclWindow_t win, uint32_t bar,
                         const int32_t* __restrict__ replica_rank,
                         const int32_t* __restrict__ replica_slot, int rank, int M,
                         int experts_per_rank, T* home, int64_t slot_elems) {
  Barrier b(meet.inbox, meet.args, bar + blockIdx.x);
  if (!b.sync()) return;
  auto has_clones = [&](int j) {
    const int e = rank * experts_per_rank + j;
    for (int rep = 1; rep < M; ++rep)
      if (replica_rank[e * M + rep] >= 0) return true;
    return false;
  };
  int cloned = 0;
  for (int j = 0; j < experts_per_rank; ++j) cloned += has_clones(j);
  for_item_shares(cloned, [&](int item, int share, int shares) {
    int j = 0;
    for (int seen = -1; j < experts_per_rank; ++j)
      if (has_clones(j) && ++seen == item) break;
    const int e = rank * experts_per_rank + j;
    const T* from[kMaxReplicas];
    int clones = 0;
    for (int rep = 1; rep < M; ++rep) {
      const int r = replica_rank[e * M + rep];
      if (r < 0) continue;
      from[clones++] = static_cast<const T*>(ncclGetLsaPointer(
          win,
          size_t(replica_slot[e * M + rep] - experts_per_rank) * size_t(slot_elems) * sizeof(T),
          r));
    }
    T* to = home + int64_t(j) * slot_elems;
    const int64_t stride = int64_t(shares) * kThreads;
    const int64_t first = int64_t(share) * kThreads + threadIdx.x;
    if constexpr (std::is_same_v<T, float>) {
      if (slot_elems % 4 == 0) {  // 16-byte words (slots of 16-byte multiples in 4 KiB windows)
        // Per element the same sum in the same order; two words per thread in flight.
        const int64_t words = slot_elems / 4;
        float4* to4 = reinterpret_cast<float4*>(to);
        for (int64_t x = first; x < words; x += 2 * stride) {
          const bool second = x + stride < words;
          float4 a0 = to4[x], a1 = second ? to4[x + stride] : float4{};
          for (int c = 0; c < clones; ++c) {
            const float4* f = reinterpret_cast<const float4*>(from[c]);
            const float4 b0 = f[x], b1 = second ? f[x + stride] : float4{};
            a0.x += b0.x, a0.y += b0.y, a0.z += b0.z, a0.w += b0.w;
            a1.x += b1.x, a1.y += b1.y, a1.z += b1.z, a1.w += b1.w;
          }
          to4[x] = a0;
          if (second) to4[x + stride] = a1;
        }
        return;
      }
    }
    for (int64_t x = first; x < slot_elems; x += stride) {
      T acc = to[x];
      for (int c = 0; c < clones; ++c) acc += from[c][x];
      to[x] = acc;
    }
  });
  b.sync();
}

// One CTA: this rank's n counts into slot `rank` of every peer's gather window, then the whole
// window (every rank's counts, in rank order) into `all`.
__global__ void __launch_bounds__(kThreads)
    all_gather_kernel(Meet meet, ncclWindow_t win, uint32_t bar, const int32_t* local, int32_t* all,
                      int64_t n, int rank, int ranks) {
  Barrier b(meet.inbox, meet.args, bar);
  if (!b.sync()) return;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const int32_t v = local[i];
    for (int p = 0; p < ranks; ++p)
      *static_cast<int32_t*>(ncclGetLsaPointer(win, (size_t(rank) * n + i) * sizeof(int32_t), p)) =
          v;
  }
  b.sync();
  const int32_t* mine = static_cast<const int32_t*>(ncclGetLocalPointer(win, 0));
  for (int64_t i = threadIdx.x; i < int64_t(ranks) * n; i += kThreads) all[i] = __ldcg(mine + i);
}

// t <- sum over ranks of t, in rank order in double (the in-process communicator's arithmetic).
// CTA c owns the same chunk of elements on every rank: it stages them, meets its peers' CTA c,
// sums, and meets them again before the staging window can be overwritten by the next call.
template <class T>
__global__ void __launch_bounds__(kThreads)
    all_reduce_kernel(Meet meet, ncclWindow_t win, uint32_t bar, T* t, int64_t n, int ranks) {
  const int64_t chunk = (n + gridDim.x - 1) / gridDim.x;
  const int64_t lo = int64_t(blockIdx.x) * chunk, hi = min(n, lo + chunk);
  T* stage = static_cast<T*>(ncclGetLocalPointer(win, 0));
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) stage[i] = t[i];
  Barrier b(meet.inbox, meet.args, bar + blockIdx.x);
  if (!b.sync()) return;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    double acc = 0;
    for (int r = 0; r < ranks; ++r)
      acc +=
          double(__ldcg(static_cast<const T*>(ncclGetLsaPointer(win, size_t(i) * sizeof(T), r))));
    t[i] = T(acc);
  }
  b.sync();
}

// ---- the device-API collective ops -------------------------------------------------------------

Meet ctx_meet(const Context& c) { return Meet{LsaInbox{c.inbox(), c.size()}, c.barrier_args()}; }

// Two internal windows: the count all-gather's and the all-reduce's staging.
class DeviceCollectiveOps final : public CollectiveOps {
 public:
  DeviceCollectiveOps(Context& ctx, const NcclOptions& o) : ctx_(ctx), opts_(o) {
    gather_ = ctx_.make_symmetric_window(
        size_t(ctx_.size()) * size_t(opts_.max_gather_ints) * sizeof(int32_t),
        "the all-gather window (NcclOptions::max_gather_ints)");
    staging_ = ctx_.make_symmetric_window(
        std::max<size_t>(opts_.all_reduce_staging_bytes, 4096),
        "the all-reduce staging window (NcclOptions::all_reduce_staging_bytes)");
    ctx_.connect(staging_.ptr);
  }
  ~DeviceCollectiveOps() override {
    ctx_.release_window(gather_);
    ctx_.release_window(staging_);
  }

  bool host_api() const override { return false; }

  Window make_window(size_t bytes, const std::string& what) override {
    return ctx_.make_symmetric_window(bytes, what);
  }

  void all_gather_i32(const int32_t* local, int32_t* all, int64_t n, cudaStream_t s) override {
    MOE_ECHO_LAUNCH(all_gather_kernel, 1, kThreads, 0, s, ctx_meet(ctx_), gather_.win,
                    barrier_base(kGatherBarriers), local, all, n, ctx_.rank(), ctx_.size());
  }

  // Up to the staging window's size an LSA kernel summing in double in rank order (the
  // in-process communicator's bits); larger tensors through ncclAllReduce.
  void all_reduce_sum(const Tensor& t, cudaStream_t s) override {
    const int64_t n = t.numel();
    if (t.bytes() > staging_.bytes) return ctx_.all_reduce_host_api(t, s);
    const unsigned grid = unsigned(std::min<int64_t>(opts_.ctas, (n + kThreads - 1) / kThreads));
    if (t.dtype == DType::f32)
      MOE_ECHO_LAUNCH(all_reduce_kernel<float>, grid, kThreads, 0, s, ctx_meet(ctx_), staging_.win,
                      barrier_base(kAllReduceBarriers), t.as<float>(), n, ctx_.size());
    else
      MOE_ECHO_LAUNCH(all_reduce_kernel<double>, grid, kThreads, 0, s, ctx_meet(ctx_), staging_.win,
                      barrier_base(kAllReduceBarriers), t.as<double>(), n, ctx_.size());
  }

  void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg, const Window& home,
                          void* spare, size_t slot_bytes, cudaStream_t s) override {
    with_word(word_size(slot_bytes, {home.ptr, spare}), [&](auto word) {
      using W = decltype(word);
      MOE_ECHO_LAUNCH(pull_clones_kernel<W>, unsigned(opts_.ctas), kThreads, 0, s, ctx_meet(ctx_),
                      home.win, barrier_base(kPullBarriers), plan.spare_expert, ctx_.rank(),
                      cfg.spare_slots, cfg.experts_per_rank(), static_cast<W*>(spare),
                      int64_t(slot_bytes / sizeof(W)));
    });
  }

  void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg, const Window& spare,
                          void* home, int64_t slot_elems, DType dtype, cudaStream_t s) override {
    const int M = cfg.max_replicas(), epr = cfg.experts_per_rank();
    if (dtype == DType::f32)
      MOE_ECHO_LAUNCH(reduce_clones_kernel<float>, unsigned(opts_.ctas), kThreads, 0, s,
                      ctx_meet(ctx_), spare.win, barrier_base(kReduceBarriers), plan.replica_rank,
                      plan.replica_slot, ctx_.rank(), M, epr, static_cast<float*>(home),
                      slot_elems);
    else
      MOE_ECHO_LAUNCH(reduce_clones_kernel<double>, unsigned(opts_.ctas), kThreads, 0, s,
                      ctx_meet(ctx_), spare.win, barrier_base(kReduceBarriers), plan.replica_rank,
                      plan.replica_slot, ctx_.rank(), M, epr, static_cast<double*>(home),
                      slot_elems);
  }

 private:
  Context& ctx_;
  NcclOptions opts_;
  Window gather_, staging_;
};

// ---- the sync-free communicator ----------------------------------------------------------------

// Every op a device-API kernel: no host sync, capturable.
class NcclDeviceComm final : public NcclCommBase {
 public:
  NcclDeviceComm(std::unique_ptr<Context> ctx, std::unique_ptr<CollectiveOps> ops,
                 const NcclOptions& o)
      : NcclCommBase(std::move(ctx), std::move(ops), o) {}

  bool capturable() const override { return true; }

 private:
  void dispatch_rows(const RowRoute& route, RoundWindow window, const void* src, size_t row_bytes,
                     const Window& recv, const Window& members, const Window& weights, DType fdt,
                     cudaStream_t s) override {
    with_float(fdt, [&](auto fl) {
      using F = decltype(fl);
      with_word(word_size(row_bytes, {src}), [&](auto word) {
        using W = decltype(word);
        MOE_ECHO_LAUNCH((dispatch_kernel<W, F>), unsigned(opts().ctas), kThreads, 0, s,
                        ctx_meet(ctx()), barrier_base(kDispatchBarriers), recv.win, members.win,
                        weights.win, route.n / route.top_k, route.top_k, size(), route.dest_rank,
                        route.dest_row, static_cast<const F*>(route.weight), window.row_lo,
                        window.rows, route.chunks, static_cast<const W*>(src),
                        int64_t(row_bytes / sizeof(W)));
      });
    });
  }

  void combine_rows(const RowRoute& route, RoundWindow window, const Window& red, const Tensor& y,
                    const int32_t* accumulate, const Window* values, DType fdt, void* values_out,
                    cudaStream_t s) override {
    const size_t row_bytes = size_t(y.size(1)) * dtype_size(y.dtype);
    const bool vec = row_bytes % 16 == 0 && cuda::aligned16(y.data);
    with_float(fdt, [&](auto fl) {
      using F = decltype(fl);
      with_rows(y.dtype, vec, [&](auto elem, auto word) {
        using Y = decltype(elem);
        using W = decltype(word);
        MOE_ECHO_LAUNCH((combine_kernel<Y, W, F>), unsigned(opts().ctas), kThreads, 0, s,
                        ctx_meet(ctx()), barrier_base(kCombineBarriers), red.win,
                        values ? values->win : static_cast<ncclWindow_t>(nullptr), y.size(0),
                        route.top_k, size(), route.dest_rank, route.dest_row, window.row_lo,
                        window.rows, route.chunks, accumulate, static_cast<W*>(y.data),
                        int64_t(row_bytes / sizeof(W)), static_cast<F*>(values_out));
      });
    });
  }
};

}  // namespace

std::unique_ptr<CollectiveOps> make_device_collective_ops(Context& ctx, const NcclOptions& o) {
  return std::make_unique<DeviceCollectiveOps>(ctx, o);
}

std::unique_ptr<Communicator> make_device_comm(std::unique_ptr<Context> ctx, const NcclOptions& o) {
  auto ops = make_device_collective_ops(*ctx, o);
  return std::make_unique<NcclDeviceComm>(std::move(ctx), std::move(ops), o);
}

}  // namespace moe_echo::nccl
