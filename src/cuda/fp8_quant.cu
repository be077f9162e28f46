// FP8 blockwise quantization on the GPU (backend.hpp, Fp8RowArgs / Fp8BlockArgs). Semantics and
// bits: src/cpu/fp8_quant.cpp (amax, scale = amax / 448 or 1, e4m3(x / scale) rounded to nearest
// even and saturated: cvt.rn.satfinite.e4m3x2.f32 through __nv_cvt_float_to_fp8). Memory-bound:
// each element is read once per pass (twice for the weight blocks, whose second read hits L2).
#include <cuda_fp8.h>

#include "cuda/common.cuh"
#include "cuda/ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

constexpr int kTile = int(kFp8Tile);

__device__ __forceinline__ float tile_scale(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }

__device__ __forceinline__ uint8_t e4m3(float v) {
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// One warp per (row, tile): lane l holds elements l, l + 32, l + 64, l + 96 of the tile.
__global__ void quantize_rows_kernel(const bf16* __restrict__ x, uint8_t* __restrict__ q,
                                     float* __restrict__ scale, int64_t rows, int64_t K,
                                     int64_t tiles) {
  const int lane = int(threadIdx.x) % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t w = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; w < rows * tiles;
       w += warps) {
    const int64_t r = w / tiles, t = w % tiles, lo = t * kTile;
    const int64_t n = K - lo < kTile ? K - lo : kTile;
    const bf16* row = x + r * K + lo;
    float v[4];
    float amax = 0.f;
    for (int j = 0; j < 4; ++j) {
      const int c = lane + 32 * j;
      v[j] = c < n ? __bfloat162float(row[c]) : 0.f;
      amax = fmaxf(amax, fabsf(v[j]));
    }
    amax = warp_max(amax);
    const float s = tile_scale(amax);
    if (lane == 0) scale[r * tiles + t] = s;
    uint8_t* out = q + r * K + lo;
    for (int j = 0; j < 4; ++j) {
      const int c = lane + 32 * j;
      if (c < n) out[c] = e4m3(v[j] / s);
    }
  }
}

// One block of 256 threads per (group, K tile, N tile): the block's amax, then every element
// quantized into q (rows of N) and, through shared memory, into q_t (rows of K).
__global__ void __launch_bounds__(256)
    quantize_blocks_kernel(const bf16* __restrict__ w, uint8_t* __restrict__ q,
                           uint8_t* __restrict__ q_t, float* __restrict__ scale, int64_t K,
                           int64_t N, int64_t k_tiles, int64_t n_tiles) {
  __shared__ float warp_amax[8];
  __shared__ uint8_t tile[kTile][kTile + 4];
  const int64_t b = blockIdx.x;
  const int64_t g = b / (k_tiles * n_tiles), kt = b / n_tiles % k_tiles, nt = b % n_tiles;
  const int64_t k0 = kt * kTile, n0 = nt * kTile;
  const int kn = int(K - k0 < kTile ? K - k0 : kTile), nn = int(N - n0 < kTile ? N - n0 : kTile);
  const bf16* slab = w + g * K * N;
  float amax = 0.f;
  for (int i = int(threadIdx.x); i < kTile * kTile; i += int(blockDim.x)) {
    const int r = i / kTile, c = i % kTile;
    if (r < kn && c < nn) amax = fmaxf(amax, fabsf(__bfloat162float(slab[(k0 + r) * N + n0 + c])));
  }
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0.f;
  for (int i = 0; i < int(blockDim.x / 32); ++i) amax = fmaxf(amax, warp_amax[i]);
  const float s = tile_scale(amax);
  if (threadIdx.x == 0) scale[(g * k_tiles + kt) * n_tiles + nt] = s;
  for (int i = int(threadIdx.x); i < kTile * kTile; i += int(blockDim.x)) {
    const int r = i / kTile, c = i % kTile;
    if (r < kn && c < nn) {
      const uint8_t v = e4m3(__bfloat162float(slab[(k0 + r) * N + n0 + c]) / s);
      if (q) q[g * K * N + (k0 + r) * N + n0 + c] = v;
      tile[r][c] = v;
    }
  }
  if (!q_t) return;
  __syncthreads();
  for (int i = int(threadIdx.x); i < kTile * kTile; i += int(blockDim.x)) {
    const int c = i / kTile, r = i % kTile;  // row c of q_t's block, along K
    if (r < kn && c < nn) q_t[g * N * K + (n0 + c) * K + k0 + r] = tile[r][c];
  }
}

int64_t tiles(int64_t n) { return (n + kFp8Tile - 1) / kFp8Tile; }

}  // namespace

void quantize_fp8_rows(const Fp8RowArgs& a, cudaStream_t s) {
  check_tensor(a.x, "quantize_fp8_rows x", DType::bf16, {-1, -1});
  const int64_t rows = a.x.size(0), K = a.x.size(1), KT = tiles(K);
  check_tensor(a.q, "quantize_fp8_rows q", DType::e4m3, {rows, K});
  check_tensor(a.scale, "quantize_fp8_rows scale", DType::f32, {rows, KT});
  MOE_ECHO_LAUNCH(quantize_rows_kernel, blocks_for(rows * KT, 8, grid_cap()), 256, 0, s,
                  a.x.as<bf16>(), a.q.as<uint8_t>(), a.scale.as<float>(), rows, K, KT);
}

void quantize_fp8_blocks(const Fp8BlockArgs& a, cudaStream_t s) {
  check_tensor(a.w, "quantize_fp8_blocks w", DType::bf16, {-1, -1, -1});
  const int64_t G = a.w.size(0), K = a.w.size(1), N = a.w.size(2), KT = tiles(K), NT = tiles(N);
  check_tensor(a.scale, "quantize_fp8_blocks scale", DType::f32, {G, KT, NT});
  if (a.q.data) check_tensor(a.q, "quantize_fp8_blocks q", DType::e4m3, {G, K, N});
  if (a.q_t.data) check_tensor(a.q_t, "quantize_fp8_blocks q_t", DType::e4m3, {G, N, K});
  MOE_ECHO_CHECK(G * KT * NT <= INT32_MAX, "quantize_fp8_blocks: " << G * KT * NT << " blocks");
  MOE_ECHO_LAUNCH(quantize_blocks_kernel, unsigned(G * KT * NT), 256, 0, s, a.w.as<bf16>(),
                  a.q.as<uint8_t>(), a.q_t.as<uint8_t>(), a.scale.as<float>(), K, N, KT, NT);
}

}  // namespace moe_echo::cuda
