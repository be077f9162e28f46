// NCCL communicator (see include/moe_echo/nccl.hpp). Invariants every kernel here keeps:
// - A barrier-using kernel always launches with the same grid on every rank (kCtas CTAs, or one
//   CTA for the count all-gather), whatever its rank-local sizes: CTA i's LSA barrier pairs with
//   CTA i of every peer, so a rank that skipped a launch would hang the others. Rank-local work
//   of zero size still launches and only takes part in the barriers.
// - Each kernel type owns a disjoint range of barrier indices ([type * kMaxCtas, +kMaxCtas)).
// - Pattern of a data-moving kernel: barrier (acq_rel) at entry, so peers are done with the
//   buffers about to be written or read (their earlier kernels finished); the loads and stores;
//   barrier (acq_rel) at exit, so every store is visible to every peer and every peer is done
//   reading before anything overwrites what it read. The kernel that consumes the data is the
//   next one on the stream (all CTAs of this kernel have then passed their exit barriers).
// - Peers are addressed by world rank: construction checks that the LSA team is the whole world,
//   where LSA rank == world rank; otherwise (or when asked) the communicator runs in host-API
//   mode (moe_echo/nccl.hpp), where none of the kernels with barriers is launched.
// - Per-step ops read routes, plans and counts on the device; nothing here reads device memory
//   on the host, except the baseline dispatcher (documented, not capturable).
//
// Dispatch and combine work per token, one warp each (top_k <= 32: lane k holds entry k). The
// lanes find the token's leads in the round's window with one __match_any_sync on the
// destination rank; the dispatch reads the token row once and stores it into each lead's
// receive row on its rank, with the fan table entries of the lead's members; the combine pulls
// one pre-reduced row per lead and sums them in k order. A token picking several experts on one
// rank thus moves one row each way.
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <sstream>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/nccl_check.hpp"
#include "cuda/warp_copy.cuh"
#include "moe_echo/config.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_collectives.hpp"
#include "moe_echo/nccl.hpp"

namespace moe_echo {

namespace nccl::detail {

void throw_nccl_error(ncclResult_t code, const char* what, const char* file, int line) {
  std::ostringstream s;
  s << "NCCL error " << int(code) << " (" << ncclGetErrorString(code) << ") in " << what;
  const char* last = ncclGetLastError(nullptr);
  if (last && *last) s << ": " << last;
  ::moe_echo::detail::fail(file, line, s.str());
}

}  // namespace nccl::detail

const char* to_string(Dispatcher d) { return d == Dispatcher::baseline ? "baseline" : "syncfree"; }

Dispatcher parse_dispatcher(const std::string& text, const std::string& field) {
  if (text == "syncfree") return Dispatcher::syncfree;
  if (text == "baseline") return Dispatcher::baseline;
  reject(field, "'" + text + "'", "syncfree or baseline");
}

int select_device(const DistEnv& env) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  if (env.local_rank >= count) {
    (void)cudaGetLastError();
    if (count == 0)
      reject("LOCAL_RANK", env.local_rank,
             "a GPU for this rank, and this process sees none: GPU ranks need one GPU each; "
             "ranks on the CPU backend run as threads of one process (moe-echo bench --backend "
             "cpu --ep N, without launch)");
    reject("LOCAL_RANK", env.local_rank,
           "0 <= LOCAL_RANK < " + std::to_string(count) +
               " (the GPUs this process sees): one process per GPU");
  }
  MOE_ECHO_CUDA_CHECK(cudaSetDevice(env.local_rank));
  return env.local_rank;
}

namespace {

using cuda::as_cuda;
using cuda::with_word;
using cuda::word_size;

constexpr int kThreads = 512;  // threads of every barrier kernel
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCtas = 128;     // barrier indices per kernel type
constexpr int kMaxReplicas = 16;  // replicas per expert the clone reduction handles
enum BarrierRange : uint32_t {
  kDispatchBarriers = 0,
  kCombineBarriers,
  kPullBarriers,
  kReduceBarriers,
  kGatherBarriers,
  kAllReduceBarriers,
  kBarrierRanges
};
constexpr uint32_t barrier_base(BarrierRange r) { return uint32_t(r) * kMaxCtas; }

using Coop = ncclCoopCta;
using Barrier = ncclLsaBarrierSession<Coop>;
constexpr ::cuda::memory_order kAcqRel = ::cuda::memory_order_acq_rel;

// ---- device kernels ----------------------------------------------------------------------------

constexpr unsigned kFull = 0xffffffffu;

// Words per lane in flight in the baseline's row copies (cuda::warp_copy_row).
constexpr int kCopyInFlight = 4;

// A token's entries as its warp sees them: lane k < K holds entry t * K + k (comm.hpp's leads and
// members). `in`: the entry's receive row lies in the window; `group`: the in-window lanes with
// the same destination rank, i.e. the members of (token, rank) in k order; `lead`: the lowest
// lane of its group; `leads`: every lead lane (the same value on every lane).
struct TokenLanes {
  int rank;
  int32_t row;  // window row at `rank`
  bool in, lead;
  unsigned group, leads;
};

__device__ __forceinline__ TokenLanes token_lanes(int64_t t, int K, int ranks,
                                                  const int32_t* __restrict__ dest_rank,
                                                  const int32_t* __restrict__ dest_row,
                                                  int64_t row_lo, int64_t rows, int lane) {
  TokenLanes e{-1, -1, false, false, 0u, 0u};
  if (lane < K) {
    const int64_t i = t * K + lane;
    const int64_t q = int64_t(dest_row[i]) - row_lo;
    e.rank = dest_rank[i];
    e.in = e.rank >= 0 && e.rank < ranks && q >= 0 && q < rows;
    e.row = int32_t(q);
  }
  const unsigned in_lanes = __ballot_sync(kFull, e.in);
  e.group = __match_any_sync(kFull, e.in ? e.rank : -1) & in_lanes;
  e.lead = e.in && (e.group & ((1u << lane) - 1u)) == 0;
  e.leads = __ballot_sync(kFull, e.lead);
  return e;
}

// Rows of Y as words W: N elements per word, summed in Acc (f32 for bf16 and f32, f64 for f64).
template <class Y, class W>
struct Words;
template <>
struct Words<cuda::bf16, uint4> {
  using Acc = float;
  static constexpr int N = 8;
  __device__ static void load(const uint4& w, float (&a)[N]) { cuda::unpack_bf16x8(w, a); }
  __device__ static void add(const uint4& w, float (&a)[N]) {
    float f[N];
    cuda::unpack_bf16x8(w, f);
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] += f[i];
  }
  __device__ static uint4 store(const float (&a)[N]) { return cuda::pack_bf16x8(a); }
};
template <>
struct Words<cuda::bf16, cuda::bf16> {
  using Acc = float;
  static constexpr int N = 1;
  __device__ static void load(const cuda::bf16& w, float (&a)[N]) { a[0] = __bfloat162float(w); }
  __device__ static void add(const cuda::bf16& w, float (&a)[N]) { a[0] += __bfloat162float(w); }
  __device__ static cuda::bf16 store(const float (&a)[N]) { return __float2bfloat16_rn(a[0]); }
};
template <>
struct Words<float, uint4> {
  using Acc = float;
  static constexpr int N = 4;
  __device__ static void load(const uint4& w, float (&a)[N]) {
    a[0] = __uint_as_float(w.x);
    a[1] = __uint_as_float(w.y);
    a[2] = __uint_as_float(w.z);
    a[3] = __uint_as_float(w.w);
  }
  __device__ static void add(const uint4& w, float (&a)[N]) {
    a[0] += __uint_as_float(w.x);
    a[1] += __uint_as_float(w.y);
    a[2] += __uint_as_float(w.z);
    a[3] += __uint_as_float(w.w);
  }
  __device__ static uint4 store(const float (&a)[N]) {
    return make_uint4(__float_as_uint(a[0]), __float_as_uint(a[1]), __float_as_uint(a[2]),
                      __float_as_uint(a[3]));
  }
};
template <>
struct Words<double, uint4> {
  using Acc = double;
  static constexpr int N = 2;
  __device__ static void load(const uint4& w, double (&a)[N]) {
    a[0] = __hiloint2double(int(w.y), int(w.x));
    a[1] = __hiloint2double(int(w.w), int(w.z));
  }
  __device__ static void add(const uint4& w, double (&a)[N]) {
    a[0] += __hiloint2double(int(w.y), int(w.x));
    a[1] += __hiloint2double(int(w.w), int(w.z));
  }
  __device__ static uint4 store(const double (&a)[N]) {
    return make_uint4(unsigned(__double2loint(a[0])), unsigned(__double2hiint(a[0])),
                      unsigned(__double2loint(a[1])), unsigned(__double2hiint(a[1])));
  }
};
template <class Y>
struct Words<Y, Y> {  // f32 and f64 one element at a time
  using Acc = Y;
  static constexpr int N = 1;
  __device__ static void load(const Y& w, Y (&a)[N]) { a[0] = w; }
  __device__ static void add(const Y& w, Y (&a)[N]) { a[0] += w; }
  __device__ static Y store(const Y (&a)[N]) { return a[0]; }
};

// out <- (add ? out : 0) + rows 0 .. count-1 in order, summed in Acc and rounded once. Lane j <
// count holds row j's address in lane_row (count <= 32). Four words per lane and two rows in
// flight at a time; the sum order per element is the row order whatever the batching.
template <class Y, class W>
__device__ __forceinline__ void sum_rows(W* __restrict__ out, int64_t words, bool add,
                                         unsigned long long lane_row, int count, int lane) {
  using V = Words<Y, W>;
  using A = typename V::Acc;
  constexpr int U = 4, N = V::N;
  // The trip count is the same on every lane (the shuffles below need the whole warp).
  for (int64_t base = 0; base < words; base += 32 * U) {
    const int64_t w0 = base + lane;
    A acc[U][N];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (add && w0 + 32 * u < words) {
        V::load(out[w0 + 32 * u], acc[u]);
      } else {
#pragma unroll
        for (int x = 0; x < N; ++x) acc[u][x] = A(0);
      }
    }
    int j = 0;
    for (; j + 1 < count; j += 2) {
      const W* a = reinterpret_cast<const W*>(__shfl_sync(kFull, lane_row, j));
      const W* b = reinterpret_cast<const W*>(__shfl_sync(kFull, lane_row, j + 1));
      W va[U], vb[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (w0 + 32 * u < words) {
          va[u] = a[w0 + 32 * u];
          vb[u] = b[w0 + 32 * u];
        }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (w0 + 32 * u < words) {
          V::add(va[u], acc[u]);
          V::add(vb[u], acc[u]);
        }
    }
    if (j < count) {
      const W* a = reinterpret_cast<const W*>(__shfl_sync(kFull, lane_row, j));
      W va[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (w0 + 32 * u < words) va[u] = a[w0 + 32 * u];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (w0 + 32 * u < words) V::add(va[u], acc[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (w0 + 32 * u < words) out[w0 + 32 * u] = V::store(acc[u]);
  }
}

// Dispatch: one warp per token. The lanes find the token's leads in the window; the warp reads
// the token row once (kInFlight 16-byte words per lane in flight) and stores it into every lead's
// receive row on its rank, and writes the fan table there: each member's window row and weight
// into its lead's members/weights rows (k order), -1 padding after the last member, and -1 at
// members[q][0] of every non-lead row q.
template <class W, class F>
__global__ void __launch_bounds__(kThreads)
    dispatch_kernel(ncclDevComm dc, uint32_t bar, ncclWindow_t recv, ncclWindow_t members,
                    ncclWindow_t weights, int64_t tokens, int K, int ranks,
                    const int32_t* __restrict__ dest_rank, const int32_t* __restrict__ dest_row,
                    const F* __restrict__ weight, int64_t row_lo, int64_t rows,
                    const W* __restrict__ src, int64_t row_words) {
  constexpr int kInFlight = 8;
  Barrier b(Coop(), dc, ncclTeamTagLsa(), bar + blockIdx.x);
  b.sync(Coop(), kAcqRel);
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; t < tokens; t += warps) {
    const TokenLanes e = token_lanes(t, K, ranks, dest_rank, dest_row, row_lo, rows, lane);
    if (e.leads == 0) continue;  // the same on every lane
    // Fan table: member j of a group writes slot j of its lead's row.
    const int32_t lead_row = __shfl_sync(kFull, e.row, e.in ? __ffs(e.group) - 1 : lane);
    if (e.in) {
      int32_t* m = static_cast<int32_t*>(ncclGetLsaPointer(members, 0, e.rank));
      F* w = static_cast<F*>(ncclGetLsaPointer(weights, 0, e.rank));
      const int j = __popc(e.group & ((1u << lane) - 1u));
      m[int64_t(lead_row) * K + j] = e.row;
      w[int64_t(lead_row) * K + j] = weight ? weight[t * K + lane] : F(1);
      if (!e.lead) m[int64_t(e.row) * K] = -1;
    }
    for (unsigned l = e.leads; l; l &= l - 1) {
      const int ll = __ffs(l) - 1;
      const int members_of_l = __popc(__shfl_sync(kFull, e.group, ll));
      const int r = __shfl_sync(kFull, e.rank, ll);
      const int32_t p = __shfl_sync(kFull, e.row, ll);
      if (lane >= members_of_l && lane < K)
        static_cast<int32_t*>(ncclGetLsaPointer(members, 0, r))[int64_t(p) * K + lane] = -1;
    }
    // The row.
    const unsigned long long to =
        e.lead ? reinterpret_cast<unsigned long long>(
                     ncclGetLsaPointer(recv, size_t(e.row) * size_t(row_words) * sizeof(W), e.rank))
               : 0ull;
    cuda::warp_row_steps<kInFlight>(
        src + t * row_words, row_words, lane, [&](const W(&v)[kInFlight], int64_t w0) {
          for (unsigned l = e.leads; l; l &= l - 1)  // the steps are uniform: shuffles are safe
            cuda::warp_store_step(reinterpret_cast<W*>(__shfl_sync(kFull, to, __ffs(l) - 1)), v, w0,
                                  row_words);
        });
  }
  b.sync(Coop(), kAcqRel);
}

// Combine: one warp per token. y[t] <- (add ? y[t] : 0) + the red rows of its leads, pulled from
// their ranks in k order (sum_rows); values_out[i] <- the fan values of every entry in the window.
// A token without leads keeps y[t] when adding and gets zeros otherwise.
template <class Y, class W, class F>
__global__ void __launch_bounds__(kThreads)
    combine_kernel(ncclDevComm dc, uint32_t bar, ncclWindow_t red, ncclWindow_t values,
                   int64_t tokens, int K, int ranks, const int32_t* __restrict__ dest_rank,
                   const int32_t* __restrict__ dest_row, int64_t row_lo, int64_t rows,
                   const int32_t* accumulate, W* y, int64_t row_words, F* values_out) {
  Barrier b(Coop(), dc, ncclTeamTagLsa(), bar + blockIdx.x);
  b.sync(Coop(), kAcqRel);
  const bool add = accumulate && *accumulate != 0;
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; t < tokens; t += warps) {
    const TokenLanes e = token_lanes(t, K, ranks, dest_rank, dest_row, row_lo, rows, lane);
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
  b.sync(Coop(), kAcqRel);
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
    pull_clones_kernel(ncclDevComm dc, ncclWindow_t win, uint32_t bar,
                       const int32_t* __restrict__ spare_expert, int rank, int spare_slots,
                       int experts_per_rank, W* spare, int64_t slot_words) {
  Barrier b(Coop(), dc, ncclTeamTagLsa(), bar + blockIdx.x);
  b.sync(Coop(), kAcqRel);
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
  b.sync(Coop(), kAcqRel);
}

// Every home expert of this rank with clones adds, in replica order, its clones' gradients from
// their ranks; the experts are reduced at once (their clones may sit on different ranks).
template <class T>
__global__ void __launch_bounds__(kThreads)
    reduce_clones_kernel(ncclDevComm dc, ncclWindow_t win, uint32_t bar,
                         const int32_t* __restrict__ replica_rank,
                         const int32_t* __restrict__ replica_slot, int rank, int M,
                         int experts_per_rank, T* home, int64_t slot_elems) {
  Barrier b(Coop(), dc, ncclTeamTagLsa(), bar + blockIdx.x);
  b.sync(Coop(), kAcqRel);
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
  b.sync(Coop(), kAcqRel);
}

// One CTA: this rank's n counts into slot `rank` of every peer's gather window, then the whole
// window (every rank's counts, in rank order) into `all`.
__global__ void __launch_bounds__(kThreads)
    all_gather_kernel(ncclDevComm dc, ncclWindow_t win, uint32_t bar, const int32_t* local,
                      int32_t* all, int64_t n, int rank, int ranks) {
  Barrier b(Coop(), dc, ncclTeamTagLsa(), bar);
  b.sync(Coop(), kAcqRel);
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const int32_t v = local[i];
    for (int p = 0; p < ranks; ++p)
      *static_cast<int32_t*>(ncclGetLsaPointer(win, (size_t(rank) * n + i) * sizeof(int32_t), p)) =
          v;
  }
  b.sync(Coop(), kAcqRel);
  const int32_t* mine = static_cast<const int32_t*>(ncclGetLocalPointer(win, 0));
  for (int64_t i = threadIdx.x; i < int64_t(ranks) * n; i += kThreads) all[i] = __ldcg(mine + i);
}

// t <- sum over ranks of t, in rank order in double (the in-process communicator's arithmetic).
// CTA c owns the same chunk of elements on every rank: it stages them, meets its peers' CTA c,
// sums, and meets them again before the staging window can be overwritten by the next call.
template <class T>
__global__ void __launch_bounds__(kThreads)
    all_reduce_kernel(ncclDevComm dc, ncclWindow_t win, uint32_t bar, T* t, int64_t n, int ranks) {
  const int64_t chunk = (n + gridDim.x - 1) / gridDim.x;
  const int64_t lo = int64_t(blockIdx.x) * chunk, hi = min(n, lo + chunk);
  T* stage = static_cast<T*>(ncclGetLocalPointer(win, 0));
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) stage[i] = t[i];
  Barrier b(Coop(), dc, ncclTeamTagLsa(), bar + blockIdx.x);
  b.sync(Coop(), kAcqRel);
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    double acc = 0;
    for (int r = 0; r < ranks; ++r)
      acc +=
          double(__ldcg(static_cast<const T*>(ncclGetLsaPointer(win, size_t(i) * sizeof(T), r))));
    t[i] = T(acc);
  }
  b.sync(Coop(), kAcqRel);
}

// Baseline: dst row (dst_idx ? dst_idx[j] : j) <- src row (src_idx ? src_idx[j] : j).
template <class W>
__global__ void index_copy_kernel(int64_t count, const int32_t* __restrict__ src_idx, const W* src,
                                  const int32_t* __restrict__ dst_idx, W* dst, int64_t row_words) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; j < count; j += warps) {
    const int64_t from = src_idx ? int64_t(src_idx[j]) : j;
    const int64_t to = dst_idx ? int64_t(dst_idx[j]) : j;
    cuda::warp_copy_row<kCopyInFlight>(dst + to * row_words, src + from * row_words, row_words,
                                       lane);
  }
}

// Baseline: dst[dst_idx ? dst_idx[j] : j] <- src[src_idx ? src_idx[j] : j] (single values).
template <class T>
__global__ void index_move_kernel(int64_t count, const int32_t* __restrict__ src_idx, const T* src,
                                  const int32_t* __restrict__ dst_idx, T* dst) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count;
       j += int64_t(gridDim.x) * blockDim.x)
    dst[dst_idx ? int64_t(dst_idx[j]) : j] = src[src_idx ? int64_t(src_idx[j]) : j];
}

// Baseline, the receiving side of a dispatch: incoming lead j carries the window rows of its
// members (lead first, -1 padded: K ints), their weights (K) and the token row. The row goes to
// the lead's receive row, the members and weights to the lead's fan-table rows, and -1 to
// members[q][0] of every other member q (what the sync-free kernel writes).
template <class W, class F>
__global__ void receive_leads_kernel(int64_t count, int K, const int32_t* __restrict__ rec,
                                     const F* __restrict__ wts, const W* __restrict__ staged,
                                     W* recv, int32_t* members, F* weights, int64_t row_words) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; j < count; j += warps) {
    const int64_t p = rec[j * K];
    if (lane < K) {
      const int32_t m = rec[j * K + lane];
      members[p * K + lane] = m;
      if (m >= 0) {
        weights[p * K + lane] = wts[j * K + lane];
        if (lane > 0) members[int64_t(m) * K] = -1;
      }
    }
    cuda::warp_copy_row<kCopyInFlight>(recv + p * row_words, staged + j * row_words, row_words,
                                       lane);
  }
}

// Baseline, the source side of a combine: y[t] <- (add ? y[t] : 0) + the packed rows of t's
// leads in k order (token_leads[token_off[t] ..]), as the sync-free combine sums them.
template <class Y, class W>
__global__ void sum_leads_kernel(int64_t tokens, const int32_t* __restrict__ token_off,
                                 const int32_t* __restrict__ token_leads, const W* packed,
                                 int64_t row_words, const int32_t* accumulate, W* y) {
  const bool add = accumulate && *accumulate != 0;
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t < tokens; t += warps) {
    const int32_t lo = token_off[t], count = token_off[t + 1] - lo;
    if (count == 0 && add) continue;
    const unsigned long long lane_row =
        lane < count ? reinterpret_cast<unsigned long long>(
                           packed + int64_t(token_leads[lo + lane]) * row_words)
                     : 0ull;
    sum_rows<Y, W>(y + t * row_words, row_words, add, lane_row, count, lane);
  }
}

// ---- host helpers ------------------------------------------------------------------------------

// The fan table's float type (f32 or f64).
template <class F>
void with_float(DType t, F&& f) {
  if (t == DType::f64)
    f(double{});
  else
    f(float{});
}

// Rows of y's dtype (bf16, f32, f64) as 16-byte words when `vec`, else one element at a time:
// f(element, word).
template <class F>
void with_rows(DType t, bool vec, F&& f) {
  switch (t) {
    case DType::bf16: vec ? f(cuda::bf16{}, uint4{}) : f(cuda::bf16{}, cuda::bf16{}); break;
    case DType::f32: vec ? f(float{}, uint4{}) : f(float{}, float{}); break;
    default: vec ? f(double{}, uint4{}) : f(double{}, double{}); break;
  }
}

// Host-API mode, the home side of a clone gradient reduction: to[x] += from[0][x], from[1][x], ...
// in replica order, per element (the sums of reduce_clones_kernel, bit for bit).
template <class T>
struct ClonePointers {
  const T* p[kMaxReplicas];
};

template <class T>
__global__ void add_clones_kernel(T* to, ClonePointers<T> from, int clones, int64_t n) {
  for (int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; x < n;
       x += int64_t(gridDim.x) * blockDim.x) {
    T acc = to[x];
    for (int c = 0; c < clones; ++c) acc += from.p[c][x];
    to[x] = acc;
  }
}

size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }

// Host memory that grows, pinned (the baseline's copies to and from the host).
template <class T>
struct PinnedVector {
  T* data = nullptr;
  size_t capacity = 0;
  ~PinnedVector() {
    if (data) (void)cudaFreeHost(data);
  }
  void reserve(size_t n) {
    if (n <= capacity) return;
    if (data) MOE_ECHO_CUDA_CHECK(cudaFreeHost(data));
    data = nullptr;
    capacity = std::max(n, 2 * capacity);
    MOE_ECHO_CUDA_CHECK(cudaMallocHost(&data, capacity * sizeof(T)));
  }
};

// Device memory that grows (baseline staging; never inside a capture).
struct DeviceScratch {
  void* data = nullptr;
  size_t bytes = 0;
  ~DeviceScratch() {
    if (data) (void)cudaFree(data);
  }
  void* get(size_t need) {
    if (need > bytes) {
      if (data) MOE_ECHO_CUDA_CHECK(cudaFree(data));
      data = nullptr;
      bytes = std::max(need, 2 * bytes);
      MOE_ECHO_CUDA_CHECK(cudaMalloc(&data, bytes));
    }
    return data;
  }
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(HostCollectives& boot, std::unique_ptr<HostCollectives> owned,
                   std::unique_ptr<Rendezvous> owned_rv, const NcclOptions& o)
      : owned_rv_(std::move(owned_rv)), owned_boot_(std::move(owned)), boot_(boot), opts_(o) {
    rank_ = boot.rank();
    size_ = boot.size();
    if (size_ < 1 || rank_ < 0 || rank_ >= size_)
      reject("bootstrap rank", rank_, "0 <= rank < size (" + std::to_string(size_) + ")");
    if (opts_.ctas < 1 || opts_.ctas > kMaxCtas)
      reject("ctas", opts_.ctas, "1 <= ctas <= " + std::to_string(kMaxCtas));
    if (opts_.max_gather_ints < 1) reject("max_gather_ints", opts_.max_gather_ints, ">= 1");
    if (opts_.host_api && opts_.dispatcher != Dispatcher::baseline)
      reject("host_api", "true",
             "with the baseline dispatcher (the sync-free one needs the device API)");
    host_api_ = opts_.host_api;
    MOE_ECHO_CUDA_CHECK(cudaGetDevice(&device_));

    // The unique id of rank 0 reaches every rank through an all-gather of one id per rank (the
    // other ranks' entries are zeros and unused).
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (rank_ == 0) MOE_ECHO_NCCL_CHECK(ncclGetUniqueId(&id));
    Bytes ids(size_t(size_) * sizeof id);
    boot_.all_gather(&id, ids.data(), sizeof id);
    std::memcpy(&id, ids.data(), sizeof id);
    MOE_ECHO_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));

    try {
      if (!host_api_) {
        ncclDevCommRequirements reqs;
        std::memset(&reqs, 0, sizeof reqs);  // NCCL 2.28.9 has no initializer macro
        reqs.lsaBarrierCount = int(kBarrierRanges) * kMaxCtas;
        MOE_ECHO_NCCL_CHECK(ncclDevCommCreate(comm_, &reqs, &dev_));
        have_dev_ = true;
        if (dev_.lsaSize != size_ || dev_.lsaRank != rank_) {
          if (opts_.dispatcher != Dispatcher::baseline) {
            std::ostringstream m;
            m << "the NCCL communicator's NVLink (LSA) team holds " << dev_.lsaSize << " of "
              << size_ << " ranks (this rank is " << dev_.lsaRank << " in it, " << rank_
              << " in the world): the sync-free dispatcher needs every rank on one node, joined "
                 "by NVLink; across nodes use the baseline dispatcher (--dispatcher baseline), "
                 "which runs every op on NCCL's host API";
            throw Error(m.str());
          }
          host_api_ = true;
          if (rank_ == 0)
            std::fprintf(stderr,
                         "moe-echo: the %d ranks span more than one NVLink team (this one holds "
                         "%d): every communication op runs on NCCL's host API\n",
                         size_, dev_.lsaSize);
        }
      }
      MOE_ECHO_CUDA_CHECK(cudaStreamCreateWithFlags(&setup_stream_, cudaStreamNonBlocking));
      if (!host_api_) {
        gather_ = make_window(size_t(size_) * size_t(opts_.max_gather_ints) * sizeof(int32_t));
        staging_ = make_window(std::max<size_t>(opts_.all_reduce_staging_bytes, 4096));
      } else {
        staging_ = make_window(4096);  // plain memory, for the connecting all-reduce below
      }
      // Host-API peers connect lazily: connect now, so that the first captured step (or the
      // first timed one) does not.
      MOE_ECHO_NCCL_CHECK(
          ncclAllReduce(staging_.ptr, staging_.ptr, 1, ncclFloat32, ncclSum, comm_, setup_stream_));
      MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(setup_stream_));
    } catch (...) {
      destroy_comm();
      throw;
    }
    boot_.barrier();
  }

  ~NcclCommunicator() override {
    (void)cudaSetDevice(device_);
    (void)cudaDeviceSynchronize();
    for (Window& w : windows_) release_window(w);
    release_window(gather_);
    release_window(staging_);
    destroy_comm();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  ncclComm_t handle() const { return comm_; }
  bool host_api() const { return host_api_; }
  // The baseline dispatcher and host-API mode wait on the host inside a step.
  bool capturable() const override {
    return !host_api_ && opts_.dispatcher != Dispatcher::baseline;
  }

  SymmetricBuffer alloc_symmetric(Backend&, size_t bytes) override {
    SymmetricBuffer buf;
    Window w = make_window(bytes);
    buf.local = w.ptr;
    buf.bytes = bytes;
    buf.id = int(windows_.size());
    windows_.push_back(w);
    return buf;
  }

  void free_symmetric(Backend&, SymmetricBuffer& buf) override {
    if (!buf.local) return;
    MOE_ECHO_CHECK(
        buf.id >= 0 && buf.id < int(windows_.size()) && windows_[size_t(buf.id)].ptr == buf.local,
        "symmetric buffer " << buf.id << " is not one of this communicator's");
    MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
    release_window(windows_[size_t(buf.id)]);
    buf.local = nullptr;
  }

  void barrier() override { boot_.barrier(); }

  void all_gather_i32(const int32_t* local, int32_t* all, int64_t n, Stream s) override {
    MOE_ECHO_CHECK(n >= 0 && n <= opts_.max_gather_ints,
                   "all_gather_i32 of " << n << " ints per rank; this communicator was built for "
                                        << opts_.max_gather_ints
                                        << " (NcclOptions::max_gather_ints)");
    if (host_api_) {
      if (n > 0)
        MOE_ECHO_NCCL_CHECK(ncclAllGather(local, all, size_t(n), ncclInt32, comm_, as_cuda(s)));
      return;
    }
    MOE_ECHO_LAUNCH(all_gather_kernel, 1, kThreads, 0, as_cuda(s), dev_, gather_.win,
                    barrier_base(kGatherBarriers), local, all, n, rank_, size_);
  }

  void all_reduce_sum(const Tensor& t, Stream s) override {
    MOE_ECHO_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64,
                   "all_reduce_sum supports f32 and f64, not " << to_string(t.dtype));
    const int64_t n = t.numel();
    if (n == 0) return;
    if (!host_api_ && t.bytes() <= staging_.bytes) {
      const unsigned grid = unsigned(std::min<int64_t>(opts_.ctas, (n + kThreads - 1) / kThreads));
      if (t.dtype == DType::f32)
        MOE_ECHO_LAUNCH(all_reduce_kernel<float>, grid, kThreads, 0, as_cuda(s), dev_, staging_.win,
                        barrier_base(kAllReduceBarriers), t.as<float>(), n, size_);
      else
        MOE_ECHO_LAUNCH(all_reduce_kernel<double>, grid, kThreads, 0, as_cuda(s), dev_,
                        staging_.win, barrier_base(kAllReduceBarriers), t.as<double>(), n, size_);
      return;
    }
    MOE_ECHO_NCCL_CHECK(ncclAllReduce(t.data, t.data, size_t(n),
                                      t.dtype == DType::f32 ? ncclFloat32 : ncclFloat64, ncclSum,
                                      comm_, as_cuda(s)));
  }

  void dispatch(const RowRoute& route, RoundWindow window, const void* src, size_t row_bytes,
                const SymmetricBuffer& recv, const FanTable& fan, Stream s) override {
    check_route(route, fan);
    const size_t rows = size_t(std::max<int64_t>(window.rows, 0)), K = size_t(route.top_k);
    const Window& w = window_of(recv, rows * row_bytes, "dispatch");
    const Window& m = window_of(fan.members, rows * K * sizeof(int32_t), "dispatch (fan members)");
    const Window& wt =
        window_of(fan.weights, rows * K * dtype_size(fan.float_dtype), "dispatch (fan weights)");
    if (opts_.dispatcher == Dispatcher::baseline)
      return baseline_dispatch(route, window, src, row_bytes, w, m, wt, fan.float_dtype,
                               as_cuda(s));
    with_float(fan.float_dtype, [&](auto fl) {
      using F = decltype(fl);
      with_word(word_size(row_bytes, {src}), [&](auto word) {
        using W = decltype(word);
        MOE_ECHO_LAUNCH((dispatch_kernel<W, F>), unsigned(opts_.ctas), kThreads, 0, as_cuda(s),
                        dev_, barrier_base(kDispatchBarriers), w.win, m.win, wt.win,
                        route.n / route.top_k, route.top_k, size_, route.dest_rank, route.dest_row,
                        static_cast<const F*>(route.weight), window.row_lo, window.rows,
                        static_cast<const W*>(src), int64_t(row_bytes / sizeof(W)));
      });
    });
  }

  void combine(const RowRoute& route, RoundWindow window, const SymmetricBuffer& red,
               const Tensor& y, const int32_t* accumulate, const FanTable& fan, void* values_out,
               Stream s) override {
    check_route(route, fan);
    MOE_ECHO_CHECK(y.dtype == DType::bf16 || y.dtype == DType::f32 || y.dtype == DType::f64,
                   "combine: rows of bf16, f32 or f64, not " << to_string(y.dtype));
    MOE_ECHO_CHECK(
        y.ndim == 2 && y.size(0) * route.top_k == route.n,
        "combine: y " << y.describe() << " for " << route.n << " entries of top_k " << route.top_k);
    const size_t rows = size_t(std::max<int64_t>(window.rows, 0));
    const size_t row_bytes = size_t(y.size(1)) * dtype_size(y.dtype);
    const Window& r = window_of(red, rows * row_bytes, "combine");
    const Window* v = values_out ? &window_of(fan.values, rows * dtype_size(fan.float_dtype),
                                              "combine (fan values)")
                                 : nullptr;
    if (opts_.dispatcher == Dispatcher::baseline)
      return baseline_combine(route, window, r, y, accumulate, v, fan.float_dtype, values_out,
                              as_cuda(s));
    const bool vec = row_bytes % 16 == 0 && cuda::aligned16(y.data);
    with_float(fan.float_dtype, [&](auto fl) {
      using F = decltype(fl);
      with_rows(y.dtype, vec, [&](auto elem, auto word) {
        using Y = decltype(elem);
        using W = decltype(word);
        MOE_ECHO_LAUNCH((combine_kernel<Y, W, F>), unsigned(opts_.ctas), kThreads, 0, as_cuda(s),
                        dev_, barrier_base(kCombineBarriers), r.win,
                        v ? v->win : static_cast<ncclWindow_t>(nullptr), y.size(0), route.top_k,
                        size_, route.dest_rank, route.dest_row, window.row_lo, window.rows,
                        accumulate, static_cast<W*>(y.data), int64_t(row_bytes / sizeof(W)),
                        static_cast<F*>(values_out));
      });
    });
  }

  void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& home, void* spare, size_t slot_bytes,
                          Stream s) override {
    MOE_ECHO_CHECK(cfg.ranks == size_, "plan for " << cfg.ranks << " ranks on " << size_);
    if (cfg.spare_slots == 0 || slot_bytes == 0) return;  // the same on every rank
    const int epr = cfg.experts_per_rank();
    const Window& w = window_of(home, size_t(epr) * slot_bytes, "pull_clone_weights");
    MOE_ECHO_CHECK(spare != nullptr, "pull_clone_weights: spare slots at null");
    if (host_api_) return host_pull_clones(plan, cfg, w, spare, slot_bytes, as_cuda(s));
    with_word(word_size(slot_bytes, {w.ptr, spare}), [&](auto word) {
      using W = decltype(word);
      MOE_ECHO_LAUNCH(pull_clones_kernel<W>, unsigned(opts_.ctas), kThreads, 0, as_cuda(s), dev_,
                      w.win, barrier_base(kPullBarriers), plan.spare_expert, rank_, cfg.spare_slots,
                      epr, static_cast<W*>(spare), int64_t(slot_bytes / sizeof(W)));
    });
  }

  void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& spare, void* home, int64_t slot_elems, DType dtype,
                          Stream s) override {
    MOE_ECHO_CHECK(cfg.ranks == size_, "plan for " << cfg.ranks << " ranks on " << size_);
    MOE_ECHO_CHECK(dtype == DType::f32 || dtype == DType::f64,
                   "clone gradient reduction supports f32 and f64, not " << to_string(dtype));
    const int M = cfg.max_replicas();
    MOE_ECHO_CHECK(M <= kMaxReplicas, "max_replicas " << M << " > " << kMaxReplicas);
    if (cfg.spare_slots == 0 || M == 1 || slot_elems == 0) return;  // no clones on any rank
    const int epr = cfg.experts_per_rank();
    const Window& w =
        window_of(spare, size_t(cfg.spare_slots) * size_t(slot_elems) * dtype_size(dtype),
                  "reduce_clone_grads");
    if (host_api_) {
      if (dtype == DType::f32)
        return host_reduce_clones<float>(plan, cfg, w, static_cast<float*>(home), slot_elems,
                                         as_cuda(s));
      return host_reduce_clones<double>(plan, cfg, w, static_cast<double*>(home), slot_elems,
                                        as_cuda(s));
    }
    if (dtype == DType::f32)
      MOE_ECHO_LAUNCH(reduce_clones_kernel<float>, unsigned(opts_.ctas), kThreads, 0, as_cuda(s),
                      dev_, w.win, barrier_base(kReduceBarriers), plan.replica_rank,
                      plan.replica_slot, rank_, M, epr, static_cast<float*>(home), slot_elems);
    else
      MOE_ECHO_LAUNCH(reduce_clones_kernel<double>, unsigned(opts_.ctas), kThreads, 0, as_cuda(s),
                      dev_, w.win, barrier_base(kReduceBarriers), plan.replica_rank,
                      plan.replica_slot, rank_, M, epr, static_cast<double*>(home), slot_elems);
  }

 private:
  struct Window {
    void* ptr = nullptr;
    size_t bytes = 0;
    ncclWindow_t win = nullptr;
    bool plain = false;  // cudaMalloc memory of host-API mode, not an NCCL window
  };

  // Collective: ncclMemAlloc + symmetric registration, the same size on every rank (checked
  // first through the rendezvous, so a mismatch is an error rather than an NCCL hang).
  Window make_window(size_t bytes) {
    const uint64_t want = bytes;
    std::vector<uint64_t> all(static_cast<size_t>(size_));
    boot_.all_gather(&want, all.data(), sizeof want);
    for (int r = 0; r < size_; ++r) {
      const uint64_t theirs = all[size_t(r)];
      MOE_ECHO_CHECK(theirs == want, "symmetric buffer "
                                         << windows_.size() << ": rank " << r << " allocates "
                                         << theirs << " bytes, rank " << rank_ << " " << want);
    }
    Window w;
    w.bytes = round_up(std::max<size_t>(bytes, 1), 4096);
    if (host_api_) {  // no peer reads it: plain device memory
      MOE_ECHO_CUDA_CHECK(cudaMalloc(&w.ptr, w.bytes));
      w.plain = true;
      return w;
    }
    MOE_ECHO_NCCL_CHECK(ncclMemAlloc(&w.ptr, w.bytes));
    MOE_ECHO_NCCL_CHECK(
        ncclCommWindowRegister(comm_, w.ptr, w.bytes, &w.win, NCCL_WIN_COLL_SYMMETRIC));
    return w;
  }

  void release_window(Window& w) {
    if (!w.ptr) return;
    if (w.plain) {
      (void)cudaFree(w.ptr);
    } else {
      if (w.win) (void)ncclCommWindowDeregister(comm_, w.win);
      (void)ncclMemFree(w.ptr);
    }
    w = Window{};
  }

  void destroy_comm() {
    if (setup_stream_) (void)cudaStreamDestroy(setup_stream_);
    setup_stream_ = nullptr;
    if (have_dev_) (void)ncclDevCommDestroy(comm_, &dev_);
    have_dev_ = false;
    if (comm_) (void)ncclCommDestroy(comm_);
    comm_ = nullptr;
  }

  const Window& window_of(const SymmetricBuffer& buf, size_t need, const char* op) const {
    MOE_ECHO_CHECK(
        buf.id >= 0 && buf.id < int(windows_.size()) && buf.local &&
            windows_[size_t(buf.id)].ptr == buf.local,
        op << ": symmetric buffer " << buf.id << " is not a live buffer of this communicator");
    const Window& w = windows_[size_t(buf.id)];
    MOE_ECHO_CHECK(need <= w.bytes,
                   op << ": " << need << " bytes into a symmetric buffer of " << buf.bytes);
    return w;
  }

  static void check_route(const RowRoute& route, const FanTable& fan) {
    MOE_ECHO_CHECK(
        route.top_k >= 1 && route.top_k <= kMaxTopK && route.n >= 0 && route.n % route.top_k == 0,
        "route of " << route.n << " entries, top_k " << route.top_k << " (1.." << kMaxTopK
                    << ", dividing the entries)");
    MOE_ECHO_CHECK(fan.top_k == route.top_k,
                   "fan table of top_k " << fan.top_k << " for a route of top_k " << route.top_k);
    MOE_ECHO_CHECK(fan.float_dtype == DType::f32 || fan.float_dtype == DType::f64,
                   "fan table float dtype f32 or f64, not " << to_string(fan.float_dtype));
  }

  // ---- host-API mode: clone transfers as grouped send/recv ----------------------------------

  // Fields of a plan on the device, copied to the host one after another (one sync).
  const int32_t* plan_on_host(std::initializer_list<std::pair<const int32_t*, size_t>> fields,
                              cudaStream_t s) {
    size_t total = 0;
    for (const auto& f : fields) total += f.second;
    h_plan_fields_.reserve(std::max<size_t>(total, 1));
    size_t at = 0;
    for (const auto& f : fields) {
      if (f.second)
        MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(h_plan_fields_.data + at, f.first,
                                            f.second * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
      at += f.second;
    }
    MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
    return h_plan_fields_.data;
  }

  // Spare slot s of rank r <- the home slot of spare_expert[r][s] from its home rank. Every pair
  // of ranks visits the slots in (r, s) order on both sides, so sends and receives match.
  void host_pull_clones(const PlanView& plan, const PlannerConfig& cfg, const Window& w,
                        void* spare_slots, size_t slot_bytes, cudaStream_t s) {
    const int S = cfg.spare_slots, epr = cfg.experts_per_rank();
    const int32_t* spare = plan_on_host({{plan.spare_expert, size_t(size_) * size_t(S)}}, s);
    char* base = static_cast<char*>(w.ptr);
    MOE_ECHO_NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < size_; ++r)
      for (int sl = 0; sl < S; ++sl) {
        const int e = spare[r * S + sl];
        if (e < 0) continue;
        const int home = e / epr;
        char* to = static_cast<char*>(spare_slots) + size_t(sl) * slot_bytes;
        const char* from = base + size_t(e % epr) * slot_bytes;
        if (r == rank_ && home == rank_)
          MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(to, from, slot_bytes, cudaMemcpyDeviceToDevice, s));
        else if (r == rank_)
          MOE_ECHO_NCCL_CHECK(ncclRecv(to, slot_bytes, ncclUint8, home, comm_, s));
        else if (home == rank_)
          MOE_ECHO_NCCL_CHECK(ncclSend(from, slot_bytes, ncclUint8, r, comm_, s));
      }
    MOE_ECHO_NCCL_CHECK(ncclGroupEnd());
  }

  // Each clone's gradient slot travels to its expert's home rank (replica order, the same order
  // on both sides of every pair), which adds them in replica order (add_clones_kernel).
  template <class T>
  void host_reduce_clones(const PlanView& plan, const PlannerConfig& cfg, const Window& w, T* home,
                          int64_t slot_elems, cudaStream_t s) {
    const int M = cfg.max_replicas(), epr = cfg.experts_per_rank(), E = cfg.experts;
    const size_t EM = size_t(E) * size_t(M);
    const int32_t* rep_rank = plan_on_host({{plan.replica_rank, EM}, {plan.replica_slot, EM}}, s);
    const int32_t* rep_slot = rep_rank + EM;
    T* grads = static_cast<T*>(w.ptr);
    const size_t slot = size_t(slot_elems) * sizeof(T);
    size_t incoming = 0;
    for (int j = 0; j < epr; ++j)
      for (int rep = 1; rep < M; ++rep) {
        const int r = rep_rank[size_t(rank_ * epr + j) * size_t(M) + size_t(rep)];
        incoming += r >= 0 && r != rank_;
      }
    T* staged = static_cast<T*>(clone_scratch_.get(std::max<size_t>(incoming * slot, 1)));
    std::vector<ClonePointers<T>> from(static_cast<size_t>(epr));
    std::vector<int> clones(static_cast<size_t>(epr), 0);
    size_t next = 0;
    MOE_ECHO_NCCL_CHECK(ncclGroupStart());
    for (int e = 0; e < E; ++e)
      for (int rep = 1; rep < M; ++rep) {
        const size_t at = size_t(e) * size_t(M) + size_t(rep);
        const int r = rep_rank[at], home = e / epr;
        if (r < 0) continue;
        const T* held = grads + int64_t(rep_slot[at] - epr) * slot_elems;
        if (home == rank_) {
          const T* src = held;
          if (r != rank_) {
            T* to = staged + int64_t(next++) * slot_elems;
            MOE_ECHO_NCCL_CHECK(ncclRecv(to, slot, ncclUint8, r, comm_, s));
            src = to;
          }
          const int j = e % epr;
          from[size_t(j)].p[clones[size_t(j)]++] = src;
        } else if (r == rank_) {
          MOE_ECHO_NCCL_CHECK(ncclSend(held, slot, ncclUint8, home, comm_, s));
        }
      }
    MOE_ECHO_NCCL_CHECK(ncclGroupEnd());
    for (int j = 0; j < epr; ++j)
      if (clones[size_t(j)] > 0)
        MOE_ECHO_LAUNCH(add_clones_kernel<T>, cuda::blocks_for(slot_elems, 256, cuda::grid_cap()),
                        256, 0, s, home + int64_t(j) * slot_elems, from[size_t(j)],
                        clones[size_t(j)], slot_elems);
  }

  // ---- baseline: host-synced, exact-size grouped send/recv ----------------------------------

  // This rank's leads of a window (comm.hpp), from the routes copied to the host (one sync),
  // grouped by destination rank in token order; lead_off_[d] indexes destination d's. h_plan_
  // holds, as the device wants them:
  //   dispatch part: lead_token [L], lead_members [L][K] (window rows, lead first, -1 padded);
  //   combine part (at plan_combine_): lead_row [L], token_off [T + 1], token_leads (per token,
  //   the index of each lead in k order) [L], and with `entries` every in-window entry grouped
  //   by destination (entry_off_): entry_row [Ne], entry_idx [Ne].
  // h_weights_ holds each lead's K member weights (bytes of the float dtype) when `weights`.
  void plan_leads(const RowRoute& route, RoundWindow window, DType fdt, bool weights, bool entries,
                  cudaStream_t s) {
    const size_t n = size_t(route.n), fl = dtype_size(fdt);
    const int K = route.top_k;
    const int64_t T = route.n / K;
    h_rank_.reserve(std::max<size_t>(n, 1));
    h_row_.reserve(std::max<size_t>(n, 1));
    const bool have_w = weights && route.weight;
    if (have_w) h_weight_in_.reserve(std::max<size_t>(n * fl, 1));
    if (n) {
      MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(h_rank_.data, route.dest_rank, n * sizeof(int32_t),
                                          cudaMemcpyDeviceToHost, s));
      MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(h_row_.data, route.dest_row, n * sizeof(int32_t),
                                          cudaMemcpyDeviceToHost, s));
      if (have_w)
        MOE_ECHO_CUDA_CHECK(
            cudaMemcpyAsync(h_weight_in_.data, route.weight, n * fl, cudaMemcpyDeviceToHost, s));
    }
    MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
    auto in = [&](size_t i) {
      const int64_t row = int64_t(h_row_.data[i]) - window.row_lo;
      return h_rank_.data[i] >= 0 && row >= 0 && row < window.rows;
    };
    auto is_lead = [&](size_t first, int k) {
      for (int k2 = 0; k2 < k; ++k2)
        if (in(first + size_t(k2)) &&
            h_rank_.data[first + size_t(k2)] == h_rank_.data[first + size_t(k)])
          return false;
      return true;
    };
    // Counts per destination.
    const size_t R = size_t(size_);
    std::vector<int64_t> leads(R, 0), ents(R, 0);
    for (size_t i = 0; i < n; ++i) {
      if (!in(i)) continue;
      const int d = h_rank_.data[i];
      MOE_ECHO_CHECK(d < size_, "entry " << i << " routed to rank " << d);
      ++ents[size_t(d)];
      leads[size_t(d)] += is_lead(i - i % size_t(K), int(i % size_t(K)));
    }
    lead_off_.assign(R + 1, 0);
    entry_off_.assign(R + 1, 0);
    for (size_t d = 0; d < R; ++d) {
      lead_off_[d + 1] = lead_off_[d] + leads[d];
      entry_off_[d + 1] = entry_off_[d] + (entries ? ents[d] : 0);
    }
    const int64_t L = lead_off_[R], Ne = entry_off_[R];
    plan_combine_ = size_t(L) * size_t(K + 1);
    h_plan_.reserve(plan_combine_ + size_t(2 * L + T + 1 + 2 * Ne));
    if (weights) h_weights_.reserve(std::max<size_t>(size_t(L) * size_t(K) * fl, 1));
    int32_t* lead_token = h_plan_.data;
    int32_t* lead_members = lead_token + L;
    int32_t* lead_row = h_plan_.data + plan_combine_;
    int32_t* token_off = lead_row + L;
    int32_t* token_leads = token_off + T + 1;
    int32_t* entry_row = token_leads + L;
    int32_t* entry_idx = entry_row + Ne;
    std::vector<int64_t> at(lead_off_.begin(), lead_off_.end() - 1);
    std::vector<int64_t> eat(entry_off_.begin(), entry_off_.end() - 1);
    int64_t listed = 0;
    for (int64_t t = 0; t < T; ++t) {
      const size_t first = size_t(t) * size_t(K);
      token_off[t] = int32_t(listed);
      for (int k = 0; k < K; ++k) {
        const size_t i = first + size_t(k);
        if (!in(i)) continue;
        const int d = h_rank_.data[i];
        const int32_t row = int32_t(int64_t(h_row_.data[i]) - window.row_lo);
        if (entries) {
          const int64_t e = eat[size_t(d)]++;
          entry_row[e] = row;
          entry_idx[e] = int32_t(i);
        }
        if (!is_lead(first, k)) continue;
        const int64_t j = at[size_t(d)]++;
        lead_token[j] = int32_t(t);
        lead_row[j] = row;
        token_leads[listed++] = int32_t(j);
        int32_t* mem = lead_members + j * K;
        int m = 0;
        for (int k2 = k; k2 < K; ++k2) {
          const size_t i2 = first + size_t(k2);
          if (!in(i2) || h_rank_.data[i2] != d) continue;
          mem[m] = int32_t(int64_t(h_row_.data[i2]) - window.row_lo);
          if (weights) {
            uint8_t* to = h_weights_.data + (size_t(j) * size_t(K) + size_t(m)) * fl;
            if (have_w) {
              std::memcpy(to, h_weight_in_.data + i2 * fl, fl);
            } else if (fdt == DType::f64) {
              const double one = 1.0;
              std::memcpy(to, &one, fl);
            } else {
              const float one = 1.0f;
              std::memcpy(to, &one, fl);
            }
          }
          ++m;
        }
        for (; m < K; ++m) mem[m] = -1;
      }
    }
    token_off[T] = int32_t(listed);
  }

  // Every rank's lead and entry counts (ncclAllGather, one host sync): recv_lead_off_[src] and
  // recv_entry_off_[src] index what src sends here.
  void exchange_counts(cudaStream_t s) {
    const size_t R = size_t(size_);
    int32_t* d = static_cast<int32_t*>(counts_.get(2 * R * (R + 1) * sizeof(int32_t)));
    h_counts_.reserve(2 * R * (R + 1));
    for (size_t r = 0; r < R; ++r) {
      h_counts_.data[r] = int32_t(lead_off_[r + 1] - lead_off_[r]);
      h_counts_.data[R + r] = int32_t(entry_off_[r + 1] - entry_off_[r]);
    }
    MOE_ECHO_CUDA_CHECK(
        cudaMemcpyAsync(d, h_counts_.data, 2 * R * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    MOE_ECHO_NCCL_CHECK(ncclAllGather(d, d + 2 * R, 2 * R, ncclInt32, comm_, s));
    MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(h_counts_.data + 2 * R, d + 2 * R,
                                        2 * R * R * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
    const int32_t* all = h_counts_.data + 2 * R;
    recv_lead_off_.assign(R + 1, 0);
    recv_entry_off_.assign(R + 1, 0);
    for (size_t src = 0; src < R; ++src) {
      recv_lead_off_[src + 1] = recv_lead_off_[src] + all[src * 2 * R + size_t(rank_)];
      recv_entry_off_[src + 1] = recv_entry_off_[src] + all[src * 2 * R + R + size_t(rank_)];
    }
  }

  // Rows: send segment d of `send` to d, receive segment src of `recv` from src (row_bytes each).
  void exchange(const void* send, void* recv, size_t row_bytes, const std::vector<int64_t>& soff,
                const std::vector<int64_t>& roff, cudaStream_t s) {
    if (row_bytes == 0) return;
    MOE_ECHO_NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < size_; ++p) {
      const int64_t sc = soff[size_t(p) + 1] - soff[size_t(p)];
      const int64_t rc = roff[size_t(p) + 1] - roff[size_t(p)];
      if (sc)
        MOE_ECHO_NCCL_CHECK(
            ncclSend(static_cast<const char*>(send) + size_t(soff[size_t(p)]) * row_bytes,
                     size_t(sc) * row_bytes, ncclUint8, p, comm_, s));
      if (rc)
        MOE_ECHO_NCCL_CHECK(ncclRecv(static_cast<char*>(recv) + size_t(roff[size_t(p)]) * row_bytes,
                                     size_t(rc) * row_bytes, ncclUint8, p, comm_, s));
    }
    MOE_ECHO_NCCL_CHECK(ncclGroupEnd());
  }

  template <class W>
  void index_copy(int64_t count, const int32_t* src_idx, const void* src, const int32_t* dst_idx,
                  void* dst, size_t row_bytes, cudaStream_t s) {
    MOE_ECHO_LAUNCH(index_copy_kernel<W>, cuda::blocks_for(count, 8, cuda::grid_cap()), 256, 0, s,
                    count, src_idx, static_cast<const W*>(src), dst_idx, static_cast<W*>(dst),
                    int64_t(row_bytes / sizeof(W)));
  }

  template <class T>
  void index_move(int64_t count, const int32_t* src_idx, const void* src, const int32_t* dst_idx,
                  void* dst, cudaStream_t s) {
    MOE_ECHO_LAUNCH(index_move_kernel<T>, cuda::blocks_for(count, 256, cuda::grid_cap()), 256, 0, s,
                    count, src_idx, static_cast<const T*>(src), dst_idx, static_cast<T*>(dst));
  }

  // Leads to their ranks: token rows packed by destination, with their members and weights;
  // each receiver writes the rows and its fan table (receive_leads_kernel).
  void baseline_dispatch(const RowRoute& route, RoundWindow window, const void* src,
                         size_t row_bytes, const Window& recv, const Window& members,
                         const Window& weights, DType fdt, cudaStream_t s) {
    const int K = route.top_k;
    const size_t fl = dtype_size(fdt), R = size_t(size_);
    plan_leads(route, window, fdt, /*weights=*/true, /*entries=*/false, s);
    exchange_counts(s);
    const int64_t L = lead_off_[R], incoming = recv_lead_off_[R];
    int32_t* ix = static_cast<int32_t*>(
        indices_.get((plan_combine_ + size_t(incoming) * size_t(K) + 1) * sizeof(int32_t)));
    int32_t* in_members = ix + plan_combine_;
    void* wsend = fl_send_.get(std::max<size_t>(size_t(L) * size_t(K) * fl, 1));
    if (L) {
      MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(ix, h_plan_.data, plan_combine_ * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, s));
      MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(wsend, h_weights_.data, size_t(L) * size_t(K) * fl,
                                          cudaMemcpyHostToDevice, s));
    }
    void* wrecv = fl_recv_.get(std::max<size_t>(size_t(incoming) * size_t(K) * fl, 1));
    void* packed = send_rows_.get(std::max<size_t>(size_t(L) * row_bytes, 1));
    void* staged = recv_rows_.get(std::max<size_t>(size_t(incoming) * row_bytes, 1));
    with_float(fdt, [&](auto f) {
      using F = decltype(f);
      with_word(word_size(row_bytes, {src, packed, staged, recv.ptr}), [&](auto word) {
        using W = decltype(word);
        index_copy<W>(L, ix, src, nullptr, packed, row_bytes, s);
        exchange(ix + L, in_members, size_t(K) * sizeof(int32_t), lead_off_, recv_lead_off_, s);
        exchange(wsend, wrecv, size_t(K) * fl, lead_off_, recv_lead_off_, s);
        exchange(packed, staged, row_bytes, lead_off_, recv_lead_off_, s);
        MOE_ECHO_LAUNCH((receive_leads_kernel<W, F>),
                        cuda::blocks_for(incoming, 8, cuda::grid_cap()), 256, 0, s, incoming, K,
                        in_members, static_cast<const F*>(wrecv), static_cast<const W*>(staged),
                        static_cast<W*>(recv.ptr), static_cast<int32_t*>(members.ptr),
                        static_cast<F*>(weights.ptr), int64_t(row_bytes / sizeof(W)));
      });
    });
  }

  // Each rank asks the lead rows' ranks for them (the window rows travel there), they send the
  // red rows back, and each token sums its leads' rows in k order (sum_leads_kernel); the fan
  // values travel the same way, per entry, when values_out is given.
  void baseline_combine(const RowRoute& route, RoundWindow window, const Window& red,
                        const Tensor& y, const int32_t* accumulate, const Window* values, DType fdt,
                        void* values_out, cudaStream_t s) {
    const size_t R = size_t(size_), fl = dtype_size(fdt);
    const size_t row_bytes = size_t(y.size(1)) * dtype_size(y.dtype);
    const int64_t T = y.size(0);
    plan_leads(route, window, fdt, /*weights=*/false, /*entries=*/values_out != nullptr, s);
    exchange_counts(s);
    const int64_t L = lead_off_[R], Ne = entry_off_[R];
    const int64_t incoming = recv_lead_off_[R], in_entries = recv_entry_off_[R];
    const size_t plan_ints = size_t(2 * L + T + 1 + 2 * Ne);
    int32_t* ix = static_cast<int32_t*>(
        indices_.get((plan_ints + size_t(incoming + in_entries) + 1) * sizeof(int32_t)));
    MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(ix, h_plan_.data + plan_combine_,
                                        plan_ints * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    const int32_t* lead_row = ix;
    const int32_t* token_off = lead_row + L;
    const int32_t* token_leads = token_off + T + 1;
    const int32_t* entry_row = token_leads + L;
    const int32_t* entry_idx = entry_row + Ne;
    int32_t* in_rows = ix + plan_ints;
    int32_t* in_entry_rows = in_rows + incoming;
    void* packed = send_rows_.get(std::max<size_t>(size_t(L) * row_bytes, 1));
    void* staged = recv_rows_.get(std::max<size_t>(size_t(incoming) * row_bytes, 1));
    const bool vec = row_bytes % 16 == 0 && cuda::aligned16(y.data);
    exchange(lead_row, in_rows, sizeof(int32_t), lead_off_, recv_lead_off_, s);
    with_rows(y.dtype, vec, [&](auto elem, auto word) {
      using Y = decltype(elem);
      using W = decltype(word);
      index_copy<W>(incoming, in_rows, red.ptr, nullptr, staged, row_bytes, s);
      exchange(staged, packed, row_bytes, recv_lead_off_, lead_off_, s);
      MOE_ECHO_LAUNCH((sum_leads_kernel<Y, W>), cuda::blocks_for(T, 8, cuda::grid_cap()), 256, 0, s,
                      T, token_off, token_leads, static_cast<const W*>(packed),
                      int64_t(row_bytes / sizeof(W)), accumulate, static_cast<W*>(y.data));
    });
    if (!values_out) return;
    void* fsend = fl_send_.get(std::max<size_t>(size_t(Ne) * fl, 1));
    void* frecv = fl_recv_.get(std::max<size_t>(size_t(in_entries) * fl, 1));
    exchange(entry_row, in_entry_rows, sizeof(int32_t), entry_off_, recv_entry_off_, s);
    with_float(fdt, [&](auto f) {
      using F = decltype(f);
      index_move<F>(in_entries, in_entry_rows, values->ptr, nullptr, frecv, s);
      exchange(frecv, fsend, fl, recv_entry_off_, entry_off_, s);
      index_move<F>(Ne, nullptr, fsend, entry_idx, values_out, s);
    });
  }

  std::unique_ptr<Rendezvous> owned_rv_;         // a rendezvous of its own, if made here
  std::unique_ptr<HostCollectives> owned_boot_;  // the collectives over owned_rv_ or a caller's
  HostCollectives& boot_;
  NcclOptions opts_;
  int rank_ = 0, size_ = 1, device_ = 0;
  ncclComm_t comm_ = nullptr;
  ncclDevComm dev_{};
  bool have_dev_ = false;
  bool host_api_ = false;  // host-API mode (moe_echo/nccl.hpp)
  cudaStream_t setup_stream_ = nullptr;
  std::vector<Window> windows_;  // by SymmetricBuffer id; freed ones stay as empty entries
  Window gather_, staging_;
  // Baseline state.
  PinnedVector<int32_t> h_rank_, h_row_, h_plan_, h_counts_;
  PinnedVector<uint8_t> h_weight_in_, h_weights_;
  size_t plan_combine_ = 0;  // where the combine part of h_plan_ starts
  std::vector<int64_t> lead_off_, entry_off_, recv_lead_off_, recv_entry_off_;
  DeviceScratch counts_, indices_, send_rows_, recv_rows_, fl_send_, fl_recv_;
  // Host-API mode state.
  PinnedVector<int32_t> h_plan_fields_;
  DeviceScratch clone_scratch_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(HostCollectives& bootstrap,
                                                     const NcclOptions& options) {
  return std::make_unique<NcclCommunicator>(bootstrap, nullptr, nullptr, options);
}

std::unique_ptr<Communicator> make_nccl_communicator(Rendezvous& rendezvous,
                                                     const NcclOptions& options) {
  auto boot = make_rendezvous_collectives(rendezvous);
  HostCollectives& ref = *boot;
  return std::make_unique<NcclCommunicator>(ref, std::move(boot), nullptr, options);
}

std::unique_ptr<Communicator> make_nccl_communicator(const DistEnv& env,
                                                     const NcclOptions& options) {
  auto rv = std::make_unique<Rendezvous>(env);
  auto boot = make_rendezvous_collectives(*rv);
  HostCollectives& ref = *boot;
  return std::make_unique<NcclCommunicator>(ref, std::move(boot), std::move(rv), options);
}

void* nccl_comm_handle(Communicator& comm) {
  auto* nccl = dynamic_cast<NcclCommunicator*>(&comm);
  return nccl ? static_cast<void*>(nccl->handle()) : nullptr;
}

bool nccl_uses_host_api(Communicator& comm) {
  auto* nccl = dynamic_cast<NcclCommunicator*>(&comm);
  return nccl && nccl->host_api();
}

}  // namespace moe_echo
