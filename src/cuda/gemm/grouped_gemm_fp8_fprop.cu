// The FP8 blockwise fprop/dgrad kernel (grouped_gemm_detail.hpp): CUTLASS 4.2's ptr-array
// FP8BlockScaledAccum kernel with our Fp8OverlapMainloop consumer, 128x128x128 tiles, cluster 2x1,
// cooperative. One instantiation per translation unit (see grouped_gemm_cutlass.cuh).
#include "cuda/gemm/grouped_gemm_cutlass.cuh"

namespace moe_echo::cuda::gemm_detail {

// fprop and dgrad: A = activation rows (RowMajor, K-major), B = the weight slab as (N x K) rows
// (ColumnMajor B, K-major), scales 1 x 128 on A and 128 x 128 on B, bf16 D.
using Fp8Config =
    KernelConfig<cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, 128,
                 128, 128, 2, 1, false, 128, false, true>;

std::unique_ptr<KernelRunner> make_fp8_runner(const ProblemArrays& p, int max_groups,
                                              const RunnerOptions& o) {
  return std::make_unique<CutlassRunner<Fp8Config>>(p, max_groups, o, 0.0f,
                                                    "grouped_gemm fp8 128x128x128 c2x1 coop");
}

}  // namespace moe_echo::cuda::gemm_detail
