// Grouped GEMMs over a receive window whose group sizes live only in device memory (CUTLASS 4.2
// ptr-array kernels on sm_90a). A prep kernel turns GroupWindow offsets into per-group problem
// shapes, pointers and strides on the device; the GEMM grids and workspaces are fixed, so every
// call is capture-safe. bf16 operands, fp32 accumulation.
//
//   fprop: c[i, :] = a[i, :] @ b[g]           a bf16 [rows, K], b bf16 [G, K, N], c bf16 [rows, N]
//   dgrad: c[i, :] = a[i, :] @ b[g]^T         a bf16 [rows, N], b bf16 [G, K, N], c bf16 [rows, K]
//   wgrad: c[g] += a[rows g]^T @ b[rows g]    a bf16 [rows, K], b bf16 [rows, N], c f32 [G, K, N]
//          (c[g] = ... with GemmArgs::accumulate false: a second kernel whose epilogue skips C;
//          a group with rows only outside the window is zeroed)
// Rows outside every group are neither read nor written; a group with no rows in the window
// leaves its wgrad output untouched (no K = 0 problem reaches CUTLASS).
// Alignment (TMA moves 16-byte boxes): K and N must be multiples of 8 and a, b, c 16-byte
// aligned; every call checks it (moe_echo::Error otherwise). Calls of one op on one GroupedGemm
// must be stream-ordered (the op's problem arrays and kernel workspace are reused).
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "moe_echo/backend.hpp"

namespace moe_echo::cuda {

class GroupedGemm {
 public:
  // Build time: allocates the prep arrays and CUTLASS workspaces for up to max_groups groups.
  // The kernels' persistent grids use sm_count SMs (0: all of the GPU's; at most all).
  explicit GroupedGemm(int max_groups, int sm_count = 0);
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;

  int max_groups() const;
  void fprop(const GemmArgs& a, cudaStream_t s);
  // c[i, :] += a[i, :] @ b[g] (bf16 c read once, the sum rounded once).
  void fprop_add(const GemmArgs& a, cudaStream_t s);
  void dgrad(const GemmArgs& a, cudaStream_t s);
  void wgrad(const GemmArgs& a, cudaStream_t s);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe_echo::cuda
