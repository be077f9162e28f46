// wgrad kernel: per group, c[g] (fp32 [K, N]) += a[rows of g]^T @ b[rows of g] (beta 1), or
// c[g] = ... (beta 0: the epilogue then never loads C).
// CUTLASS view: M = K, N = N, and the group's rows are the reduction (it varies per group):
// A = a's rows read as a ColumnMajor (K x rows) matrix (M-major), B = b's rows RowMajor (N-major),
// fp32 D with C = D and beta = 1. 128x128x64 tiles, cluster 2x1, ping-pong: one warp group's
// fp32 epilogue (a read and a write of C) overlaps the other's main loop. Measured on an H200
// (bench/results): 2-8% faster than 128x256x64 cooperative at the ANCHORS.md shapes.
#include "cuda/gemm/grouped_gemm_cutlass.cuh"

namespace moe_echo::cuda::gemm_detail {

using WgradConfig = KernelConfig<float, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor,
                                 128, 128, 64, 2, 1, true>;

std::unique_ptr<KernelRunner> make_wgrad_runner(const ProblemArrays& p, int max_groups,
                                                const RunnerOptions& o, float beta) {
  return std::make_unique<CutlassRunner<WgradConfig>>(
      p, max_groups, o, beta,
      beta != 0.0f ? "grouped_gemm wgrad 128x128x64 c2x1 pingpong"
                   : "grouped_gemm wgrad (overwrite) 128x128x64 c2x1 pingpong");
}

}  // namespace moe_echo::cuda::gemm_detail
