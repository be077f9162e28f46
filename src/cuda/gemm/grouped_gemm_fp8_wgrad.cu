// The FP8 blockwise wgrad kernel (grouped_gemm_detail.hpp): CUTLASS 4.2's ptr-array
// FP8BlockScaledAccum kernel with our Fp8OverlapMainloop consumer, 128x128x128 tiles, cluster 2x1,
// cooperative, fp32 D.
#include "cuda/gemm/grouped_gemm_cutlass.cuh"

namespace moe_echo::cuda::gemm_detail {

// wgrad: A = x^T and B = dy^T, both rows of the transposed, group-padded quantization (K-major),
// one scale per row and 128 tokens on both, MN-major ([tiles][rows] per group: the 128 + 128
// scales of one K block are two contiguous runs), fp32 D.
using Fp8WgradConfig = KernelConfig<float, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor,
                                    128, 128, 128, 2, 1, false, 1, true, true>;

std::unique_ptr<KernelRunner> make_fp8_wgrad_runner(const ProblemArrays& p, int max_groups,
                                                    const RunnerOptions& o, float beta) {
  return std::make_unique<CutlassRunner<Fp8WgradConfig>>(
      p, max_groups, o, beta,
      beta != 0.0f ? "grouped_gemm fp8 wgrad 128x128x128 c2x1 coop"
                   : "grouped_gemm fp8 wgrad (overwrite) 128x128x128 c2x1 coop");
}

}  // namespace moe_echo::cuda::gemm_detail
