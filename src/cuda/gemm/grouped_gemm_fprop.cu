// fprop kernel: per group, c[rows, N] = a[rows, K] @ b[g] with b[g] a row-major [K, N] slab (or,
// with beta 1, c += ...: the epilogue reads C = D).
// CUTLASS view: A RowMajor (K-major), B RowMajor (N-major), bf16 D. 128x256x64 tiles, cluster
// 2x1, cooperative: the configuration torch._grouped_mm takes for large bf16 problems.
#include "cuda/gemm/grouped_gemm_cutlass.cuh"

namespace moe_echo::cuda::gemm_detail {

using FpropConfig = KernelConfig<cutlass::bfloat16_t, cutlass::layout::RowMajor,
                                 cutlass::layout::RowMajor, 128, 256, 64, 2, 1, false>;

std::unique_ptr<KernelRunner> make_fprop_runner(const ProblemArrays& p, int max_groups,
                                                const RunnerOptions& o, float beta) {
  return std::make_unique<CutlassRunner<FpropConfig>>(
      p, max_groups, o, beta,
      beta == 0.0f ? "grouped_gemm fprop 128x256x64 c2x1 coop"
                   : "grouped_gemm fprop (add) 128x256x64 c2x1 coop");
}

}  // namespace moe_echo::cuda::gemm_detail
