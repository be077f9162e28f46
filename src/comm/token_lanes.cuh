// What the device communicators' dispatch and combine kernels work out alike for a token, one
// warp per token with lane k < K holding entry k (comm.hpp): the lead of a (token, rank) pair,
// its member with the lowest window row, and with chunks (RowChunks) which call moves a pair and
// which one sums a token.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moe_echo/backend.hpp"

namespace moe_echo::cuda {

// The lowest of the lanes' window rows over the lanes of `group` (K: the lanes holding entries).
// Every lane of the warp calls it.
__device__ __forceinline__ int64_t group_low_row(int64_t row, unsigned group, int K) {
  int64_t low = INT64_MAX;
  for (int j = 0; j < K; ++j) {
    const int64_t r = __shfl_sync(0xffffffffu, row, j);
    if ((group >> j) & 1u) low = r < low ? r : low;
  }
  return low;
}

// The chunk of window row q at rank r; 0 without chunks.
__device__ __forceinline__ int row_chunk(const RowChunks& c, int r, int64_t q) {
  if (c.bounds == nullptr) return 0;
  const int32_t* b = c.bounds + int64_t(r) * (c.chunks + 1);
  int k = 0;
  while (k + 1 < c.chunks && q >= b[k + 1]) ++k;
  return k;
}

// Whether a combine call sums the token: the highest chunk of its entries in the window (`in`,
// at rank r, window row q; 0 without any) is the call's. Every lane of the warp calls it.
__device__ __forceinline__ bool combine_sums(const RowChunks& c, bool in, int r, int64_t q) {
  if (c.bounds == nullptr) return true;
  const unsigned mine = in ? unsigned(row_chunk(c, r, q)) : 0u;
  return __reduce_max_sync(0xffffffffu, mine) == unsigned(c.chunk);
}

// The slot of a member in its lead's fan table row: the lead first, then the others in k order.
__device__ __forceinline__ int member_slot(unsigned group, unsigned lead_bit, int lane) {
  return (group & (1u << lane)) == lead_bit ? 0
                                            : 1 + __popc(group & ~lead_bit & ((1u << lane) - 1u));
}

// A token's entries as its warp sees them: lane k < K holds entry k. `in`: the entry's receive
// row lies in the window; `group`: the in-window lanes with the same destination rank, i.e. the
// members of (token, rank) in k order; `low`: the lowest window row of the group, the lead's;
// `lead`: the lane holding it; `leads`: every lead lane (the same value on every lane).
struct TokenLanes {
  int rank;
  int32_t row;  // window row at `rank`
  bool in, lead;
  unsigned group, leads;
  int64_t low;
};

// The lanes of an entry at (rank, window row q), `in` when it is in the window. Every lane of the
// warp calls it.
__device__ __forceinline__ TokenLanes lanes_of(int rank, int64_t q, bool in, int K) {
  TokenLanes e{rank, int32_t(q), in, false, 0u, 0u, 0};
  const unsigned in_lanes = __ballot_sync(0xffffffffu, e.in);
  e.group = __match_any_sync(0xffffffffu, e.in ? e.rank : -1) & in_lanes;
  e.low = group_low_row(e.row, e.group, K);
  e.lead = e.in && e.row == e.low;
  e.leads = __ballot_sync(0xffffffffu, e.lead);
  return e;
}

// The lanes of token t of a route (lane k < K: entry t * K + k) in the window [row_lo, row_lo +
// rows) of destination ranks [0, ranks).
__device__ __forceinline__ TokenLanes route_lanes(int64_t t, int K, int ranks,
                                                  const int32_t* __restrict__ dest_rank,
                                                  const int32_t* __restrict__ dest_row,
                                                  int64_t row_lo, int64_t rows, int lane) {
  int rank = -1;
  int64_t q = -1;
  bool in = false;
  if (lane < K) {
    const int64_t i = t * K + lane;
    q = int64_t(dest_row[i]) - row_lo;
    rank = dest_rank[i];
    in = rank >= 0 && rank < ranks && q >= 0 && q < rows;
  }
  return lanes_of(rank, q, in, K);
}

// Keeps the (token, rank) pairs whose lead row is in the call's chunk (every pair without
// chunks). Every lane of the warp calls it.
__device__ __forceinline__ void keep_chunk(TokenLanes& e, const RowChunks& chunks) {
  if (!chunks.bounds) return;
  const bool moves = e.in && row_chunk(chunks, e.rank, e.low) == chunks.chunk;
  const unsigned moving = __ballot_sync(0xffffffffu, moves);
  e.in = moves;
  e.lead = e.lead && moves;
  e.group &= moving;
  e.leads &= moving;
}

}  // namespace moe_echo::cuda
