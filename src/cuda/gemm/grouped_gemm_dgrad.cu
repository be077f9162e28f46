// dgrad kernel: per group, c[rows, K] = a[rows, N] @ b[g]^T with b[g] a row-major [K, N] slab.
// CUTLASS view: A RowMajor (K-major), B = b[g] read as a ColumnMajor (N x K) matrix (K-major),
// bf16 D. 128x256x64 tiles, cluster 2x1, cooperative.
#include "cuda/gemm/grouped_gemm_cutlass.cuh"

namespace moe_echo::cuda::gemm_detail {

using DgradConfig = KernelConfig<cutlass::bfloat16_t, cutlass::layout::RowMajor,
                                 cutlass::layout::ColumnMajor, 128, 256, 64, 2, 1, false>;

std::unique_ptr<KernelRunner> make_dgrad_runner(const ProblemArrays& p, int max_groups,
                                                const RunnerOptions& o) {
  return std::make_unique<CutlassRunner<DgradConfig>>(p, max_groups, o, 0.0f,
                                                      "grouped_gemm dgrad 128x256x64 c2x1 coop");
}

}  // namespace moe_echo::cuda::gemm_detail
