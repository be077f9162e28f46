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

}  // namespace moe_echo::cuda
