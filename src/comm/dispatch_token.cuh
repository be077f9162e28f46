// What a device dispatch does for one token once its warp knows the token's lanes (TokenLanes):
// the fan table rows and the row stores at the leads' ranks, through `at(window, offset, rank)`,
// the rank's pointer to a symmetric window (an LSA pointer). The sync-free dispatch
// (nccl_device_comm.cu) runs it on the token rows it routes; the dispatch across nodes
// (nccl_gin_comm.cu) on the rows of its own node's ranks and, as a forwarder, on the rows other
// nodes sent it, so that both write the same bits where one node would.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>

#include "comm/nccl_rows.cuh"
#include "comm/token_lanes.cuh"
#include "cuda/warp_copy.cuh"

namespace moe_echo::nccl {

// Fan table: each member's window row and weight (`weight`, this lane's; 1 when !weighted) into
// its lead's members/weights rows (the lead first, then k order), -1 padding after the last
// member, -1 at members[q][0] of every non-lead row q. Then the row `src` (row_words words W,
// kInFlight per lane in flight) into every lead's receive row. Every lane of the warp calls it.
template <int kInFlight, class W, class F, class At>
__device__ __forceinline__ void dispatch_token(const cuda::TokenLanes& e, int K, F weight,
                                               bool weighted, const W* __restrict__ src,
                                               int64_t row_words, int lane, At&& at,
                                               ncclWindow_t recv, ncclWindow_t members,
                                               ncclWindow_t weights) {
  if (e.leads == 0) return;  // the same on every lane
  const int32_t lead_row = int32_t(e.low);
  if (e.in) {
    int32_t* m = static_cast<int32_t*>(at(members, 0, e.rank));
    F* w = static_cast<F*>(at(weights, 0, e.rank));
    const int j = cuda::member_slot(e.group, e.group & e.leads, lane);
    m[int64_t(lead_row) * K + j] = e.row;
    w[int64_t(lead_row) * K + j] = weighted ? weight : F(1);
    if (!e.lead) m[int64_t(e.row) * K] = -1;
  }
  for (unsigned l = e.leads; l; l &= l - 1) {
    const int ll = __ffs(l) - 1;
    const int members_of_l = __popc(__shfl_sync(kFull, e.group, ll));
    const int r = __shfl_sync(kFull, e.rank, ll);
    const int32_t p = __shfl_sync(kFull, e.row, ll);
    if (lane >= members_of_l && lane < K)
      static_cast<int32_t*>(at(members, 0, r))[int64_t(p) * K + lane] = -1;
  }
  const unsigned long long to =
      e.lead ? reinterpret_cast<unsigned long long>(
                   at(recv, size_t(e.row) * size_t(row_words) * sizeof(W), e.rank))
             : 0ull;
  cuda::warp_row_steps<kInFlight>(src, row_words, lane, [&](const W(&v)[kInFlight], int64_t w0) {
    for (unsigned l = e.leads; l; l &= l - 1)  // the steps are uniform: shuffles are safe
      cuda::warp_store_step(reinterpret_cast<W*>(__shfl_sync(kFull, to, __ffs(l) - 1)), v, w0,
                            row_words);
  });
}

}  // namespace moe_echo::nccl
