// FP8 grouped GEMMs over a receive window (backend.hpp, Fp8GemmArgs): e4m3 operands with
// blockwise fp32 scales, group sizes only in device memory, on CUTLASS 4.2's ptr-array
// FP8BlockScaledAccum kernels (sm_90a; the consumer side is Fp8OverlapMainloop). As GroupedGemm:
// a prep kernel writes every group's problem (shape, operand and scale pointers, leading
// dimensions) on the device, the persistent grids and workspaces are fixed at construction, and
// every call is capture-safe. Calls of one op must be stream-ordered.
//
//   fprop: c[i] = a[i] @ w[g]     (m_g x K) . (K x N), B = q_t [G, N, K], scales scale_t
//   dgrad: c[i] = a[i] @ w[g]^T   (m_g x N) . (N x K), B = q [G, K, N], scales scale
//   wgrad: c[g] (+)= x_g^T dy_g   (K x P_g) . (P_g x N), P_g = round_up(m_g, 128) columns of the
//          transposed, group-padded quantizations (Fp8ColArgs) of x and dy
// K and N must be multiples of 16 (TMA's 16-byte rows of e4m3; bf16 rows of the output).
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "cuda/gemm/grouped_gemm_detail.hpp"
#include "moe_echo/backend.hpp"

namespace moe_echo::cuda {

class GroupedGemmFp8 {
 public:
  explicit GroupedGemmFp8(int max_groups, int sm_count = 0);  // sm_count as GroupedGemm's
  ~GroupedGemmFp8();
  GroupedGemmFp8(const GroupedGemmFp8&) = delete;
  GroupedGemmFp8& operator=(const GroupedGemmFp8&) = delete;

  int max_groups() const;
  void fprop(const Fp8GemmArgs& a, cudaStream_t s);
  void dgrad(const Fp8GemmArgs& a, cudaStream_t s);
  void wgrad(const Fp8GemmArgs& a, cudaStream_t s);

  // For benchmarks of alternative kernel configurations: op's kernels (both tile orders; for
  // wgrad the adding one, the writing one stays) made by `make` instead, on the same prep.
  using RunnerFactory = std::unique_ptr<gemm_detail::KernelRunner> (*)(
      const gemm_detail::ProblemArrays&, int, const gemm_detail::RunnerOptions&);
  void replace_kernel(gemm_detail::GemmOp op, RunnerFactory make);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe_echo::cuda
