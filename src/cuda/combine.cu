// Combine on the GPU: y[t] = sum_k weight[t,k] * gathered[t*K + k] (f32 accumulation in k order,
// bf16 out), and its backward: d_gathered = weight * dy, d_weight = <dy[t], gathered[t*K+k]>
// (one warp per (t, k), fixed butterfly reduction). Semantics: src/cpu/combine.cpp.
#include "cuda/common.cuh"
#include "cuda/ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

__global__ void combine_forward_kernel(int64_t T, int64_t K, int64_t H,
                                       const bf16* __restrict__ gathered,
                                       const float* __restrict__ weight, bf16* y) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < T * H;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / H, h = i - t * H;
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const float w = weight ? weight[t * K + k] : 1.f;
      acc = fmaf(w, __bfloat162float(gathered[(t * K + k) * H + h]), acc);
    }
    y[i] = __float2bfloat16_rn(acc);
  }
}

__global__ void combine_backward_kernel(int64_t TK, int64_t K, int64_t H,
                                        const bf16* __restrict__ dy,
                                        const bf16* __restrict__ gathered,
                                        const float* __restrict__ weight, bf16* d_gathered,
                                        float* d_weight) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; row < TK;
       row += warps) {
    const int64_t t = row / K;
    const float w = weight[row];
    const bf16* g = gathered + row * H;
    const bf16* d = dy + t * H;
    bf16* dg = d_gathered + row * H;
    float dot = 0.f;
    for (int64_t h = lane; h < H; h += 32) {
      const float dv = __bfloat162float(d[h]);
      dot = fmaf(dv, __bfloat162float(g[h]), dot);
      dg[h] = __float2bfloat16_rn(w * dv);
    }
    dot = warp_sum(dot);
    if (lane == 0) d_weight[row] = dot;
  }
}

}  // namespace

void combine_forward(const CombineArgs& a, cudaStream_t s) {
  const int64_t T = a.y.size(0), H = a.y.size(1);
  const int64_t K = T > 0 ? a.gathered.size(0) / T : 0;
  MOE_ECHO_CHECK(a.y.dtype == DType::bf16 && a.gathered.dtype == DType::bf16,
                 "combine needs bf16 rows, got " << a.gathered.describe() << " -> " << a.y.describe());
  MOE_ECHO_CHECK(a.weight.data == nullptr || a.weight.dtype == DType::f32,
                 "combine weight must be f32, got " << a.weight.describe());
  MOE_ECHO_LAUNCH(combine_forward_kernel, blocks_for(T * H, 256, grid_cap()), 256, 0, s, T, K, H,
                  a.gathered.as<bf16>(), a.weight.as<float>(), a.y.as<bf16>());
}

void combine_backward(const CombineBackwardArgs& a, cudaStream_t s) {
  const int64_t T = a.dy.size(0), H = a.dy.size(1);
  const int64_t K = T > 0 ? a.gathered.size(0) / T : 0;
  MOE_ECHO_CHECK(a.dy.dtype == DType::bf16 && a.gathered.dtype == DType::bf16 &&
                     a.d_gathered.dtype == DType::bf16 && a.weight.dtype == DType::f32 &&
                     a.d_weight.dtype == DType::f32,
                 "combine backward needs bf16 rows and f32 weights");
  MOE_ECHO_LAUNCH(combine_backward_kernel, blocks_for(T * K, 8, grid_cap()), 256, 0, s, T * K, K,
                  H, a.dy.as<bf16>(), a.gathered.as<bf16>(), a.weight.as<float>(),
                  a.d_gathered.as<bf16>(), a.d_weight.as<float>());
}

}  // namespace moe_echo::cuda
