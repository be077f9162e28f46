// Layout on the GPU: where every (token, k) row of this rank goes, from the routing map and the
// plan. Semantics: src/cpu/layout.cpp (receive layout per rank: slots in order; inside a slot,
// sources in rank order; inside a source, rows in (token, k) order).
//
// Deterministic without order-dependent atomics, as a stable counting sort in three launches:
//  1. rank_in_chunk (grid over chunks of 256 routes): each route's rank among the routes of the
//     same expert in its chunk (warp match + per-warp counts, prefix over the 8 warps in order),
//     and every chunk's per-expert histogram;
//  2. plan_tables (one block): the per-source assignment of rows to replicas (compute_assignment
//     of src/echo/planner.cpp), every rank's slot offsets, rank_rows, round_active, the first
//     receive row of this source's rows on every replica, and the per-expert exclusive prefix of
//     the chunk histograms (sequential over chunks: the same order as a sequential walk);
//  3. place (grid over routes): position p of the route within its expert = chunk prefix + rank
//     in chunk; the replica is the first whose cumulative share exceeds p.
// Integer atomics appear only in (2) for sums whose order cannot change the result.
#include <climits>

#include "cuda/common.cuh"
#include "cuda/ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

constexpr int kChunk = 256;  // routes per chunk = threads per block of rank_in_chunk
constexpr int kChunkWarps = kChunk / 32;
constexpr int kTableThreads = 512;

struct LayoutScratch {
  int32_t* hist = nullptr;       // [chunks, E]: routes of expert e in chunk c, then its prefix
  int32_t* quota = nullptr;      // [E, M]: replica quota left during the assignment
  int32_t* first_row = nullptr;  // [E, M]: first receive row of this source's rows on replica j
  int32_t* base = nullptr;       // [R, slots + 1]: receive rows per (rank, slot), then prefix
  int32_t* max_rows = nullptr;   // [1]: the most rows any rank receives
};

int64_t chunks_for(int64_t entries) { return (entries + kChunk - 1) / kChunk; }

LayoutScratch carve(ScratchCarver& c, const PlannerConfig& cfg, int slots, int64_t entries) {
  const int64_t E = cfg.experts, M = cfg.max_replicas(), R = cfg.ranks;
  LayoutScratch l;
  l.hist = c.take<int32_t>(chunks_for(entries) * E);
  l.quota = c.take<int32_t>(E * M);
  l.first_row = c.take<int32_t>(E * M);
  l.base = c.take<int32_t>(R * (slots + 1));
  l.max_rows = c.take<int32_t>(1);
  return l;
}

// (1) Rank of each route among the routes of its expert within its chunk, and chunk histograms.
// Routes with an expert outside [0, E) are not counted (place() marks them unrouted).
__global__ void __launch_bounds__(kChunk)
    rank_in_chunk_kernel(int64_t n, int E, const int32_t* __restrict__ topk_idx, int32_t* rank_out,
                         int32_t* hist) {
  extern __shared__ int32_t warp_count[];  // [kChunkWarps, E]
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < kChunkWarps * E; i += kChunk) warp_count[i] = 0;
  __syncthreads();
  const int64_t i = int64_t(blockIdx.x) * kChunk + tid;
  int e = i < n ? topk_idx[i] : -1;
  if (e >= E) e = -1;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int lane_rank = __popc(peers & ((1u << lane) - 1u));
  if (e >= 0 && lane_rank == 0) warp_count[warp * E + e] = __popc(peers);
  __syncthreads();
  for (int x = tid; x < E; x += kChunk) {  // exclusive prefix over the warps, in warp order
    int run = 0;
    for (int w = 0; w < kChunkWarps; ++w) {
      const int c = warp_count[w * E + x];
      warp_count[w * E + x] = run;
      run += c;
    }
    hist[int64_t(blockIdx.x) * E + x] = run;
  }
  __syncthreads();
  if (i < n) rank_out[i] = e >= 0 ? warp_count[warp * E + e] + lane_rank : -1;
}

// (2) One block: assignment, slot offsets, round flags, first rows, chunk prefixes.
__global__ void __launch_bounds__(kTableThreads)
    plan_tables_kernel(int R, int E, int M, int EPR, int slots, int me, int row_block,
                       int64_t chunks, int64_t capacity, int rounds, const int32_t* __restrict__ C,
                       const int32_t* __restrict__ replica_rank,
                       const int32_t* __restrict__ replica_slot,
                       const int32_t* __restrict__ replica_rows, int32_t* assign, LayoutScratch sc,
                       int32_t* group_offsets, int32_t* rank_rows, int32_t* round_active) {
  const int tid = int(threadIdx.x), nt = int(blockDim.x);
  // Assignment of every source's rows of expert e to its replicas (compute_assignment).
  for (int e = tid; e < E; e += nt) {
    const int32_t* rrank = replica_rank + int64_t(e) * M;
    const int32_t* rrows = replica_rows + int64_t(e) * M;
    int32_t* quota = sc.quota + int64_t(e) * M;
    int nrep = 1;
    while (nrep < M && rrank[nrep] >= 0) ++nrep;
    if (nrep == 1) {
      for (int src = 0; src < R; ++src) {
        int32_t* a = assign + (int64_t(src) * E + e) * M;
        a[0] = C[int64_t(src) * E + e];
        for (int j = 1; j < M; ++j) a[j] = 0;
      }
      continue;
    }
    for (int j = 0; j < M; ++j) quota[j] = j < nrep ? rrows[j] : 0;
    // Pass 1: a source keeps its rows on its own rank, up to that replica's quota (row_block 1:
    // with whole blocks the replicas take the expert's rows in order, pass 2 alone).
    for (int src = 0; src < R; ++src) {
      int32_t* a = assign + (int64_t(src) * E + e) * M;
      for (int j = 0; j < M; ++j) a[j] = 0;
      if (row_block > 1) continue;
      const int32_t rows = C[int64_t(src) * E + e];
      for (int j = 0; j < nrep; ++j) {
        if (rrank[j] != src) continue;
        const int32_t take = rows < quota[j] ? rows : quota[j];
        a[j] = take;
        quota[j] -= take;
        break;
      }
    }
    // Pass 2: the rest, sources in rank order, replicas in replica order.
    for (int src = 0; src < R; ++src) {
      int32_t* a = assign + (int64_t(src) * E + e) * M;
      int32_t left = C[int64_t(src) * E + e];
      for (int j = 0; j < M; ++j) left -= a[j];
      for (int j = 0; j < nrep && left > 0; ++j) {
        const int32_t take = left < quota[j] ? left : quota[j];
        a[j] += take;
        quota[j] -= take;
        left -= take;
      }
    }
  }
  // Receive rows of every (rank, slot): at most one replica per (rank, slot), summed anyway.
  const int stride = slots + 1;
  for (int i = tid; i < R * stride; i += nt) sc.base[i] = 0;
  if (tid == 0) *sc.max_rows = 0;
  __syncthreads();
  for (int i = tid; i < E * M; i += nt) {
    const int r = replica_rank[i];
    if (r >= 0) atomicAdd(sc.base + r * stride + replica_slot[i] + 1, replica_rows[i]);
  }
  __syncthreads();
  for (int r = tid; r < R; r += nt) {
    int32_t* b = sc.base + r * stride;
    for (int g = 0; g < slots; ++g) b[g + 1] += b[g];
    rank_rows[r] = b[slots];
    atomicMax(sc.max_rows, b[slots]);
  }
  __syncthreads();
  for (int g = tid; g <= slots; g += nt) group_offsets[g] = sc.base[me * stride + g];
  const int64_t max_rows = *sc.max_rows;
  for (int r = tid; r < rounds; r += nt) round_active[r] = max_rows > r * capacity ? 1 : 0;
  // First receive row of this source's rows for replica j of e.
  for (int i = tid; i < E * M; i += nt) {
    const int r = replica_rank[i];
    if (r < 0) continue;
    const int e = i / M, j = i % M;
    int32_t row = sc.base[r * stride + replica_slot[i]];
    for (int src = 0; src < me; ++src) row += assign[(int64_t(src) * E + e) * M + j];
    sc.first_row[i] = row;
  }
  // Exclusive prefix of the chunk histograms per expert, chunks in order: one warp per expert,
  // 32 chunks per step (a warp scan; integer sums, so the result is the sequential one).
  const int lane = tid & 31;
  for (int e = tid >> 5; e < E; e += nt >> 5) {
    int32_t run = 0;
    for (int64_t c0 = 0; c0 < chunks; c0 += 32) {
      const int64_t c = c0 + lane;
      const int32_t v = c < chunks ? sc.hist[c * E + e] : 0;
      int32_t incl = v;
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
      }
      if (c < chunks) sc.hist[c * E + e] = run + incl - v;
      run += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
}

// (3) Destination of every route. dest_row holds the rank in chunk on entry.
__global__ void place_kernel(int64_t n, int E, int M, int me, const int32_t* __restrict__ topk_idx,
                             const int32_t* __restrict__ assign,
                             const int32_t* __restrict__ replica_rank,
                             const int32_t* __restrict__ hist,
                             const int32_t* __restrict__ first_row, int32_t* dest_rank,
                             int32_t* dest_row) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int e = topk_idx[i];
    const int32_t in_chunk = dest_row[i];
    int32_t out_rank = -1, out_row = -1;
    if (e >= 0 && e < E && in_chunk >= 0) {
      const int32_t p = hist[(i / kChunk) * E + e] + in_chunk;
      const int32_t* a = assign + (int64_t(me) * E + e) * M;
      int32_t cum = 0;
      for (int j = 0; j < M; ++j) {
        if (p < cum + a[j]) {
          out_rank = replica_rank[int64_t(e) * M + j];
          out_row = first_row[int64_t(e) * M + j] + (p - cum);
          break;
        }
        cum += a[j];
      }
    }
    // A route beyond what the routing map gives its source (the map disagrees with the routes)
    // stays unrouted: -1, which dispatch and combine skip.
    dest_rank[i] = out_rank;
    dest_row[i] = out_row;
  }
}

// ChunkPlanArgs (backend.hpp), one block: thread r < R writes rank r's bounds, then the threads
// narrow this rank's group offsets to each chunk.
__global__ void chunk_plan_kernel(int R, int C, int G1, int rank, int64_t row_lo, int64_t capacity,
                                  const int32_t* __restrict__ rank_rows,
                                  const int32_t* __restrict__ group_offsets,
                                  int32_t* __restrict__ bounds, int32_t* __restrict__ offsets) {
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    const int64_t n = min(max(int64_t(rank_rows[r]) - row_lo, int64_t(0)), capacity);
    for (int c = 0; c <= C; ++c) bounds[r * (C + 1) + c] = int32_t(int64_t(c) * n / C);
  }
  __syncthreads();
  const int32_t* mine = bounds + int64_t(rank) * (C + 1);
  for (int i = threadIdx.x; i < C * G1; i += blockDim.x) {
    const int c = i / G1;
    const int64_t o = group_offsets[i % G1];
    offsets[i] = int32_t(min(max(o, row_lo + mine[c]), row_lo + mine[c + 1]));
  }
}

}  // namespace

void chunk_plan(const ChunkPlanArgs& a, cudaStream_t s) {
  check_chunk_plan(a);
  const int R = int(a.rank_rows.size(0)), C = int(a.bounds.size(1) - 1),
            G1 = int(a.group_offsets.size(0));
  MOE_ECHO_LAUNCH(chunk_plan_kernel, 1, 256, 0, s, R, C, G1, a.rank, a.row_lo, a.capacity,
                  a.rank_rows.as<int32_t>(), a.group_offsets.as<int32_t>(), a.bounds.as<int32_t>(),
                  a.offsets.as<int32_t>());
}

size_t layout_scratch_bytes(const PlannerConfig& cfg, int slots, int64_t entries) {
  ScratchCarver c(nullptr);
  carve(c, cfg, slots, entries);
  return c.used();
}

void layout(const LayoutArgs& a, void* scratch, cudaStream_t s) {
  const PlannerConfig& cfg = a.planner;
  const int R = cfg.ranks, E = cfg.experts, M = cfg.max_replicas(), EPR = cfg.experts_per_rank();
  MOE_ECHO_CHECK(a.slots == EPR + cfg.spare_slots,
                 "slots " << a.slots << " != E/R + S = " << EPR + cfg.spare_slots);
  const int64_t n = a.topk_idx.numel(), chunks = chunks_for(n);
  ScratchCarver c(scratch);
  const LayoutScratch sc = carve(c, cfg, a.slots, n);
  const PlanView plan = plan_view(a.plan.as<int32_t>(), cfg);
  const size_t smem = size_t(kChunkWarps) * size_t(E) * sizeof(int32_t);
  if (smem > 48 * 1024)
    MOE_ECHO_CUDA_CHECK(cudaFuncSetAttribute(
        rank_in_chunk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  MOE_ECHO_LAUNCH(rank_in_chunk_kernel, unsigned(chunks), kChunk, smem, s, n, E,
                  a.topk_idx.as<int32_t>(), a.dest_row.as<int32_t>(), sc.hist);
  MOE_ECHO_LAUNCH(plan_tables_kernel, 1, kTableThreads, 0, s, R, E, M, EPR, a.slots, a.rank,
                  cfg.row_block, chunks, a.capacity, int(a.round_active.size(0)),
                  a.routing_map.as<int32_t>(), plan.replica_rank, plan.replica_slot,
                  plan.replica_rows, a.assign.as<int32_t>(), sc, a.group_offsets.as<int32_t>(),
                  a.rank_rows.as<int32_t>(), a.round_active.as<int32_t>());
  MOE_ECHO_LAUNCH(place_kernel, blocks_for(n, 256, grid_cap()), 256, 0, s, n, E, M, a.rank,
                  a.topk_idx.as<int32_t>(), a.assign.as<int32_t>(), plan.replica_rank, sc.hist,
                  sc.first_row, a.dest_rank.as<int32_t>(), a.dest_row.as<int32_t>());
}

}  // namespace moe_echo::cuda
