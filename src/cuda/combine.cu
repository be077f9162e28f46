// Combine on the GPU: y[t] = sum_k weight[t,k] * gathered[t*K + k] (f32 accumulation in k order,
// bf16 out), and its backward: d_gathered = weight * dy, d_weight = <dy[t], gathered[t*K+k]>
// (one warp per (t, k), per-lane sums in a fixed order, then a fixed butterfly). Semantics:
// src/cpu/combine.cpp.
//
// Bytes (T tokens, K routes, H hidden, bf16): forward reads T K H * 2 and writes T H * 2;
// backward reads T K H * 2 (+ dy once, its K re-reads hit the cache) and writes T K H * 2. Rows
// move as 16-byte words of 8 bf16 when H % 8 == 0 and every base is 16-byte aligned; otherwise
// the scalar kernels below run (same arithmetic, same order per element).
#include "cuda/common.cuh"
#include "cuda/ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per 8 consecutive h of one token; the K rows of the token are loaded before they
// are summed (kBatch loads in flight).
template <bool kWeighted>
__global__ void __launch_bounds__(kThreads)
    combine_forward_vec_kernel(int64_t T, int K, int64_t H8, const uint4* __restrict__ gathered,
                               const float* __restrict__ weight, uint4* __restrict__ y) {
  constexpr int kBatch = 8;
  const int64_t n = T * H8;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / H8, c = i - t * H8;
    const uint4* g = gathered + t * K * H8 + c;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int k0 = 0; k0 < K; k0 += kBatch) {
      uint4 v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (k0 + u < K) v[u] = g[int64_t(k0 + u) * H8];
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (k0 + u < K) {
          const float w = kWeighted ? weight[t * K + k0 + u] : 1.f;
          float f[8];
          unpack_bf16x8(v[u], f);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] = fmaf(w, f[j], acc[j]);
        }
    }
    y[i] = pack_bf16x8(acc);
  }
}

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

// One warp per (t, k) row; each lane loads kBatch words of dy and of the row before using them.
// The dot product: per lane in increasing h within its words, then a butterfly over the lanes.
__global__ void __launch_bounds__(kThreads)
    combine_backward_vec_kernel(int64_t TK, int K, int64_t H8, const uint4* __restrict__ dy,
                                const uint4* __restrict__ gathered,
                                const float* __restrict__ weight, uint4* __restrict__ d_gathered,
                                float* __restrict__ d_weight) {
  constexpr int kBatch = 4;
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; row < TK;
       row += warps) {
    const int64_t t = row / K;
    const float w = weight[row];
    const uint4* g = gathered + row * H8;
    const uint4* d = dy + t * H8;
    uint4* dg = d_gathered + row * H8;
    float dot = 0.f;
    for (int64_t c0 = lane; c0 < H8; c0 += 32 * kBatch) {
      uint4 dv[kBatch], gv[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (c0 + 32 * u < H8) {
          dv[u] = d[c0 + 32 * u];
          gv[u] = g[c0 + 32 * u];
        }
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (c0 + 32 * u < H8) {
          float df[8], gf[8], out[8];
          unpack_bf16x8(dv[u], df);
          unpack_bf16x8(gv[u], gf);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            dot = fmaf(df[j], gf[j], dot);
            out[j] = w * df[j];
          }
          dg[c0 + 32 * u] = pack_bf16x8(out);
        }
    }
    dot = warp_sum(dot);
    if (lane == 0) d_weight[row] = dot;
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
  const bool weighted = a.weight.data != nullptr;
  if (H % 8 == 0 && aligned16(a.gathered.data) && aligned16(a.y.data)) {
    const int64_t H8 = H / 8;
    const unsigned grid = blocks_for(T * H8, kThreads, grid_cap());
    if (weighted)
      MOE_ECHO_LAUNCH(combine_forward_vec_kernel<true>, grid, kThreads, 0, s, T, int(K), H8,
                      static_cast<const uint4*>(a.gathered.data), a.weight.as<float>(),
                      static_cast<uint4*>(a.y.data));
    else
      MOE_ECHO_LAUNCH(combine_forward_vec_kernel<false>, grid, kThreads, 0, s, T, int(K), H8,
                      static_cast<const uint4*>(a.gathered.data), nullptr,
                      static_cast<uint4*>(a.y.data));
    return;
  }
  MOE_ECHO_LAUNCH(combine_forward_kernel, blocks_for(T * H, kThreads, grid_cap()), kThreads, 0, s,
                  T, K, H, a.gathered.as<bf16>(), a.weight.as<float>(), a.y.as<bf16>());
}

void combine_backward(const CombineBackwardArgs& a, cudaStream_t s) {
  const int64_t T = a.dy.size(0), H = a.dy.size(1);
  const int64_t K = T > 0 ? a.gathered.size(0) / T : 0;
  MOE_ECHO_CHECK(a.dy.dtype == DType::bf16 && a.gathered.dtype == DType::bf16 &&
                     a.d_gathered.dtype == DType::bf16 && a.weight.dtype == DType::f32 &&
                     a.d_weight.dtype == DType::f32,
                 "combine backward needs bf16 rows and f32 weights");
  const unsigned grid = blocks_for(T * K, kThreads / 32, grid_cap());
  if (H % 8 == 0 && aligned16(a.dy.data) && aligned16(a.gathered.data) &&
      aligned16(a.d_gathered.data)) {
    MOE_ECHO_LAUNCH(combine_backward_vec_kernel, grid, kThreads, 0, s, T * K, int(K), H / 8,
                    static_cast<const uint4*>(a.dy.data),
                    static_cast<const uint4*>(a.gathered.data), a.weight.as<float>(),
                    static_cast<uint4*>(a.d_gathered.data), a.d_weight.as<float>());
    return;
  }
  MOE_ECHO_LAUNCH(combine_backward_kernel, grid, kThreads, 0, s, T * K, K, H, a.dy.as<bf16>(),
                  a.gathered.as<bf16>(), a.weight.as<float>(), a.d_gathered.as<bf16>(),
                  a.d_weight.as<float>());
}

}  // namespace moe_echo::cuda
