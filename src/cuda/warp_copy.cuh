// Row copies by one warp, for the kernels that move token or expert rows (the single-GPU and the
// NCCL communicators): a row of `words` words W (16-byte words where the rows' size and alignment
// allow, see word_size in common.cuh) is walked in steps of 32 * kInFlight words. In a step, lane
// l loads the words w0 + 32 u (w0 = step start + l, u < kInFlight) that lie in the row, all of
// them before any store, so every load instruction of the warp reads 32 consecutive words.
//
// Invariants: the steps are the same on every lane (a lane whose words lie past the row's end
// skips their loads and stores but not the step), so the code between a step's loads and stores
// may use warp shuffles; every word is loaded and stored exactly once per destination.
#pragma once

#include <cstdint>

namespace moe_echo::cuda {

// The stores of one step: to[w0 + 32 u] = v[u] for the words in the row.
template <int kInFlight, class W>
__device__ __forceinline__ void warp_store_step(W* to, const W (&v)[kInFlight], int64_t w0,
                                                int64_t words) {
#pragma unroll
  for (int u = 0; u < kInFlight; ++u)
    if (w0 + 32 * u < words) to[w0 + 32 * u] = v[u];
}

// Walks the row `from` step by step: loads this lane's words of the step into v, then calls
// store(v, w0), which writes them wherever the row goes (warp_store_step per destination).
template <int kInFlight, class W, class Store>
__device__ __forceinline__ void warp_row_steps(const W* __restrict__ from, int64_t words, int lane,
                                               Store&& store) {
  for (int64_t base = 0; base < words; base += 32 * kInFlight) {
    const int64_t w0 = base + lane;
    W v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (w0 + 32 * u < words) v[u] = from[w0 + 32 * u];
    store(v, w0);
  }
}

// One destination: to[w] = from[w] for w < words.
template <int kInFlight, class W>
__device__ __forceinline__ void warp_copy_row(W* __restrict__ to, const W* __restrict__ from,
                                              int64_t words, int lane) {
  warp_row_steps<kInFlight>(from, words, lane, [&](const W(&v)[kInFlight], int64_t w0) {
    warp_store_step(to, v, w0, words);
  });
}

}  // namespace moe_echo::cuda
