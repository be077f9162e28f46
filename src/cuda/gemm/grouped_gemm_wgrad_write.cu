// wgrad kernel writing (beta 0): per group, c[g] (fp32 [K, N]) = a[rows of g]^T @ b[rows of g],
// what the layer runs when it overwrites its gradients (the first backward after zero_grad, or
// into gradients it does not hold). The tiles, layouts and schedule of grouped_gemm_wgrad.cu, with
// no C operand at all: no C buffers in shared memory, which leaves room for more main-loop stages.
#include "cuda/gemm/grouped_gemm_cutlass.cuh"

namespace moe_echo::cuda::gemm_detail {

using WgradWriteConfig =
    KernelConfig<float, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, 128, 128, 64, 2, 1,
                 true, 0, false, false, 0, true>;

std::unique_ptr<KernelRunner> make_wgrad_write_runner(const ProblemArrays& p, int max_groups,
                                                      const RunnerOptions& o) {
  return std::make_unique<CutlassRunner<WgradWriteConfig>>(
      p, max_groups, o, 0.0f, "grouped_gemm wgrad (overwrite) 128x128x64 c2x1 pingpong, no C");
}

}  // namespace moe_echo::cuda::gemm_detail
