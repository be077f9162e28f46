// wgrad writing bf16: per group, c[g] (bf16 [K, N]) = a[rows of g]^T @ b[rows of g], accumulated
// in fp32 and rounded once to bf16 in the epilogue (what the fp32 kernel's output cast to bf16
// gives, without writing and reading the fp32 slab). The fp32 kernel's tiles and schedule
// (grouped_gemm_wgrad.cu), with a bf16 D and no C: a backward whose expert gradients nothing adds
// to afterwards writes them this way in the parameters' bf16 (MoeLayer::backward_into).
#include "cuda/gemm/grouped_gemm_cutlass.cuh"

namespace moe_echo::cuda::gemm_detail {

using WgradBf16Config =
    KernelConfig<cutlass::bfloat16_t, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, 128,
                 128, 64, 2, 1, true, 0, false, false, 0, /*NoSource=*/true>;

std::unique_ptr<KernelRunner> make_wgrad_bf16_runner(const ProblemArrays& p, int max_groups,
                                                     const RunnerOptions& o) {
  return std::make_unique<CutlassRunner<WgradBf16Config>>(
      p, max_groups, o, 0.0f, "grouped_gemm wgrad (overwrite, bf16) 128x128x64 c2x1 pingpong");
}

}  // namespace moe_echo::cuda::gemm_detail
