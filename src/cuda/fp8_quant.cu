// FP8 blockwise quantization on the GPU (backend.hpp, Fp8RowArgs / Fp8BlockArgs / Fp8ColArgs).
// Semantics and bits: src/cpu/fp8_quant.cpp (amax, scale = amax / 448 or 1, e4m3(x / scale) rounded
// to nearest even and saturated: cvt.rn.satfinite.e4m3x2.f32 through __nv_cvt_float_to_fp8).
// Memory-bound: each element is read once per pass (twice for the weight blocks, whose second read
// hits L2).
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

// e4m3 bits as a float (exact: every e4m3 value is a half).
__device__ __forceinline__ float from_e4m3(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(b), __NV_E4M3)));
}

// Four bf16 of x (8 bytes, aligned) as floats.
__device__ __forceinline__ void load4(const bf16* p, float v[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
  const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
  v[0] = __low2float(lo), v[1] = __high2float(lo), v[2] = __low2float(hi), v[3] = __high2float(hi);
}

// One warp per (row, tile): lane l holds elements 4l .. 4l + 3 of the tile (one 8-byte load and
// one 4-byte store when `vec`: K a multiple of 4 and x, q aligned; element by element otherwise).
// Row r's values go to q + r q_pitch and its scales to scale + r s_pitch (dense q and scale, or
// packed rows: values then scales in one row of q_pitch bytes, whose `pad` last bytes are zeroed).
__global__ void quantize_rows_kernel(const bf16* __restrict__ x, uint8_t* __restrict__ q,
                                     float* __restrict__ scale, int64_t rows, int64_t K,
                                     int64_t tiles, bool vec, int64_t q_pitch, int64_t s_pitch,
                                     int pad) {
  const int lane = int(threadIdx.x) % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t w = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; w < rows * tiles;
       w += warps) {
    const int64_t r = w / tiles, t = w % tiles, lo = t * kTile;
    const int64_t n = K - lo < kTile ? K - lo : kTile;
    const bf16* row = x + r * K + lo;
    const int c = 4 * lane;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (vec && c < n) {
      load4(row + c, v);
    } else if (!vec) {
      for (int j = 0; j < 4; ++j)
        if (c + j < n) v[j] = __bfloat162float(row[c + j]);
    }
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = warp_max(amax);
    const float s = tile_scale(amax);
    if (lane == 0) scale[r * s_pitch + t] = s;
    if (t == 0 && lane < pad) q[(r + 1) * q_pitch - pad + lane] = 0;
    uint8_t* out = q + r * q_pitch + lo;
    if (vec) {
      if (c < n)
        *reinterpret_cast<uint32_t*>(out + c) =
            uint32_t(e4m3(v[0] / s)) | uint32_t(e4m3(v[1] / s)) << 8 |
            uint32_t(e4m3(v[2] / s)) << 16 | uint32_t(e4m3(v[3] / s)) << 24;
    } else {
      for (int j = 0; j < 4; ++j)
        if (c + j < n) out[c + j] = e4m3(v[j] / s);
    }
  }
}

// x = q * scale rounded to bf16, one thread per 4 elements of a row (K % 4 == 0), else per one.
__global__ void dequantize_rows_kernel(const uint8_t* __restrict__ q,
                                       const float* __restrict__ scale, bf16* __restrict__ x,
                                       int64_t rows, int64_t K, int64_t tiles, int per) {
  const int64_t n = rows * (K / per);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / (K / per), k = i % (K / per) * per;
    const float s = scale[r * tiles + k / kTile];
    for (int j = 0; j < per; ++j)
      x[r * K + k + j] = __float2bfloat16_rn(__fmul_rn(from_e4m3(q[r * K + k + j]), s));
  }
}

// One block of 256 threads per (group, K tile, N tile): the block's amax, then every element
// quantized into q (rows of N) and, through shared memory, into q_t (rows of K).
__global__ void __launch_bounds__(256)
    quantize_blocks_kernel(const bf16* __restrict__ w, uint8_t* __restrict__ q,
                           uint8_t* __restrict__ q_t, float* __restrict__ scale,
                           float* __restrict__ scale_t, int64_t K, int64_t N, int64_t k_tiles,
                           int64_t n_tiles) {
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
  if (threadIdx.x == 0 && scale_t) scale_t[(g * n_tiles + nt) * k_tiles + kt] = s;
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

// Fp8ColArgs, step 1 (one thread): every group's padded column offset.
__global__ void padded_offsets_kernel(const int32_t* __restrict__ offsets, int groups,
                                      int64_t row_lo, int64_t rows, int32_t* __restrict__ padded) {
  int64_t p = 0;
  for (int g = 0; g < groups; ++g) {
    padded[g] = int32_t(p);
    const int64_t begin = offsets[g], end = offsets[g + 1];
    const int64_t lo = begin > row_lo ? begin : row_lo;
    const int64_t hi = end < row_lo + rows ? end : row_lo + rows;
    if (hi > lo) p += (hi - lo + kTile - 1) / kTile * kTile;
  }
  padded[groups] = int32_t(p);
}

// Fp8ColArgs, step 2: block (t, kb) takes column tile t of q_t (128 columns, inside one group)
// and rows [kb * 128, kb * 128 + 128) of q_t (columns of x): the 128 x 128 bf16 block of x into
// shared memory (16-byte loads along x's rows when `vec`), then warp w takes q_t rows
// w, w + 8, ...: lane l holds tile columns l, l + 32, l + 64, l + 96, so the amax is one warp
// reduction and every store is 32 consecutive bytes.
// With an e4m3 x (kFp8In), the block keeps x's bytes and each row's scale of this K tile, and a
// value is their f32 product (the scale of x row i's tile kb is x_scale[i * tiles + kb]).
template <bool kFp8In>
__global__ void __launch_bounds__(256)
    quantize_cols_kernel(const void* __restrict__ x_in, const float* __restrict__ x_scale,
                         const int32_t* __restrict__ offsets, const int32_t* __restrict__ padded,
                         int groups, int64_t row_lo, int64_t rows, int64_t K, int64_t P,
                         uint8_t* __restrict__ q_t, float* __restrict__ scale, bool vec) {
  // bf16: odd word stride (65 words), so column reads hit 32 banks; e4m3: 33 words.
  __shared__ alignas(16) unsigned char smem[kFp8In ? kTile * (kTile + 4) : kTile * (kTile + 2) * 2];
  __shared__ float row_scale[kFp8In ? kTile : 1];
  [[maybe_unused]] auto block = reinterpret_cast<bf16(*)[kTile + 2]>(smem);
  [[maybe_unused]] auto bytes = reinterpret_cast<uint8_t(*)[kTile + 4]>(smem);
  [[maybe_unused]] const bf16* x = static_cast<const bf16*>(x_in);
  [[maybe_unused]] const uint8_t* xq = static_cast<const uint8_t*>(x_in);
  const int64_t c0 = int64_t(blockIdx.x) * kTile, k0 = int64_t(blockIdx.y) * kTile;
  if (c0 >= padded[groups]) return;
  int lo_g = 0, hi_g = groups - 1;  // the group whose padded columns hold c0
  while (lo_g < hi_g) {
    const int mid = (lo_g + hi_g + 1) / 2;
    if (padded[mid] <= c0)
      lo_g = mid;
    else
      hi_g = mid - 1;
  }
  const int g = lo_g;
  const int64_t begin = offsets[g] > row_lo ? offsets[g] : row_lo;
  const int64_t end = offsets[g + 1] < row_lo + rows ? offsets[g + 1] : row_lo + rows;
  const int64_t m = end - begin, t = (c0 - padded[g]) / kTile;
  const int64_t first = begin - row_lo + t * kTile;  // window row of the tile's column 0
  const int n = int(m - t * kTile < kTile ? m - t * kTile : kTile);
  const int kn = int(K - k0 < kTile ? K - k0 : kTile);
  if constexpr (kFp8In) {
    const int64_t k_tiles = (K + kTile - 1) / kTile;
    for (int r = int(threadIdx.x); r < kTile; r += int(blockDim.x))
      row_scale[r] = r < n ? x_scale[(first + r) * k_tiles + blockIdx.y] : 0.f;
    if (vec) {  // 4 e4m3 per load; kn is a multiple of 4
      for (int i = int(threadIdx.x); i < kTile * kTile / 4; i += int(blockDim.x)) {
        const int r = i / (kTile / 4), c = i % (kTile / 4) * 4;
        uint32_t raw = 0;
        if (r < n && c < kn)
          raw = *reinterpret_cast<const uint32_t*>(xq + (first + r) * K + k0 + c);
        *reinterpret_cast<uint32_t*>(&bytes[r][c]) = raw;
      }
    } else {
      for (int i = int(threadIdx.x); i < kTile * kTile; i += int(blockDim.x)) {
        const int r = i / kTile, c = i % kTile;
        bytes[r][c] = r < n && c < kn ? xq[(first + r) * K + k0 + c] : uint8_t(0);
      }
    }
  } else if (vec) {  // 8 bf16 per load; kn is a multiple of 8
    for (int i = int(threadIdx.x); i < kTile * kTile / 8; i += int(blockDim.x)) {
      const int r = i / (kTile / 8), c = i % (kTile / 8) * 8;
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (r < n && c < kn) raw = *reinterpret_cast<const uint4*>(x + (first + r) * K + k0 + c);
      const bf16* e = reinterpret_cast<const bf16*>(&raw);
      for (int j = 0; j < 8; ++j) block[r][c + j] = e[j];
    }
  } else {
    for (int i = int(threadIdx.x); i < kTile * kTile; i += int(blockDim.x)) {
      const int r = i / kTile, c = i % kTile;
      block[r][c] = r < n && c < kn ? x[(first + r) * K + k0 + c] : __float2bfloat16(0.f);
    }
  }
  __syncthreads();
  const int lane = int(threadIdx.x) % 32;
  float* tile_scales = scale + K * (padded[g] / kTile) + t * K + k0;
  for (int c = int(threadIdx.x) / 32; c < kn; c += int(blockDim.x) / 32) {
    float v[4];
    float amax = 0.f;
    for (int j = 0; j < 4; ++j) {
      const int r = lane + 32 * j;
      if constexpr (kFp8In)
        v[j] = r < n ? __fmul_rn(from_e4m3(bytes[r][c]), row_scale[r]) : 0.f;
      else
        v[j] = r < n ? __bfloat162float(block[r][c]) : 0.f;
      amax = fmaxf(amax, fabsf(v[j]));
    }
    amax = warp_max(amax);
    const float s = tile_scale(amax);
    if (lane == 0) tile_scales[c] = s;
    uint8_t* out = q_t + (k0 + c) * P + c0;
    for (int j = 0; j < 4; ++j) {
      const int r = lane + 32 * j;
      out[r] = r < n ? e4m3(v[j] / s) : uint8_t(0);
    }
  }
}

}  // namespace

void quantize_fp8_rows(const Fp8RowArgs& a, cudaStream_t s) {
  const int64_t KT = check_fp8_row_args(a, DType::bf16), rows = a.x.size(0), K = a.x.size(1);
  if (rows == 0 || K == 0) return;
  const bool packed = a.packed.data != nullptr;
  uint8_t* q = packed ? a.packed.as<uint8_t>() : a.q.as<uint8_t>();
  float* scale = packed ? reinterpret_cast<float*>(q + K) : a.scale.as<float>();
  const int64_t pitch = packed ? fp8_packed_row_bytes(K) : K;
  const bool vec = K % 4 == 0 && reinterpret_cast<uintptr_t>(a.x.data) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(q) % 4 == 0;
  MOE_ECHO_LAUNCH(quantize_rows_kernel, blocks_for(rows * KT, 8, grid_cap()), 256, 0, s,
                  a.x.as<bf16>(), q, scale, rows, K, KT, vec, pitch,
                  packed ? pitch / int64_t(sizeof(float)) : KT,
                  packed ? int(pitch - K - KT * int64_t(sizeof(float))) : 0);
}

void dequantize_fp8_rows(const Fp8RowArgs& a, cudaStream_t s) {
  MOE_ECHO_CHECK(a.packed.data == nullptr,
                 "dequantize_fp8_rows reads q and scale, not packed rows");
  const int64_t KT = check_fp8_row_args(a, DType::bf16), rows = a.x.size(0), K = a.x.size(1);
  if (rows == 0 || K == 0) return;
  const int per = K % 4 == 0 ? 4 : 1;
  MOE_ECHO_LAUNCH(dequantize_rows_kernel, blocks_for(rows * (K / per), 256, grid_cap()), 256, 0, s,
                  a.q.as<uint8_t>(), a.scale.as<float>(), a.x.as<bf16>(), rows, K, KT, per);
}

void quantize_fp8_blocks(const Fp8BlockArgs& a, cudaStream_t s) {
  check_tensor(a.w, "quantize_fp8_blocks w", DType::bf16, {-1, -1, -1});
  const int64_t G = a.w.size(0), K = a.w.size(1), N = a.w.size(2), KT = fp8_tiles(K),
                NT = fp8_tiles(N);
  check_tensor(a.scale, "quantize_fp8_blocks scale", DType::f32, {G, KT, NT});
  if (a.q.data) check_tensor(a.q, "quantize_fp8_blocks q", DType::e4m3, {G, K, N});
  if (a.q_t.data) check_tensor(a.q_t, "quantize_fp8_blocks q_t", DType::e4m3, {G, N, K});
  if (a.scale_t.data)
    check_tensor(a.scale_t, "quantize_fp8_blocks scale_t", DType::f32, {G, NT, KT});
  MOE_ECHO_CHECK(G * KT * NT <= INT32_MAX, "quantize_fp8_blocks: " << G * KT * NT << " blocks");
  MOE_ECHO_LAUNCH(quantize_blocks_kernel, unsigned(G * KT * NT), 256, 0, s, a.w.as<bf16>(),
                  a.q.as<uint8_t>(), a.q_t.as<uint8_t>(), a.scale.as<float>(),
                  a.scale_t.as<float>(), K, N, KT, NT);
}

void quantize_fp8_cols(const Fp8ColArgs& a, cudaStream_t s) {
  const GroupWindow& w = a.window;
  const int64_t P = check_fp8_col_args(a, DType::bf16), K = a.x.size(1);
  MOE_ECHO_LAUNCH(padded_offsets_kernel, 1, 1, 0, s, w.group_offsets, w.groups, w.row_lo, w.rows,
                  a.padded_offsets.as<int32_t>());
  MOE_ECHO_CHECK(P / kFp8Tile <= INT32_MAX && fp8_tiles(K) <= 65535,
                 "quantize_fp8_cols: " << P << " columns, K " << K);
  if (P == 0) return;
  const dim3 grid(unsigned(P / kFp8Tile), unsigned(fp8_tiles(K)));
  if (a.x.dtype == DType::e4m3)
    MOE_ECHO_LAUNCH(quantize_cols_kernel<true>, grid, 256, 0, s, a.x.data, a.x_scale.as<float>(),
                    w.group_offsets, a.padded_offsets.as<int32_t>(), w.groups, w.row_lo, w.rows, K,
                    P, a.q_t.as<uint8_t>(), a.scale.as<float>(),
                    K % 4 == 0 && reinterpret_cast<uintptr_t>(a.x.data) % 4 == 0);
  else
    MOE_ECHO_LAUNCH(quantize_cols_kernel<false>, grid, 256, 0, s, a.x.data, nullptr,
                    w.group_offsets, a.padded_offsets.as<int32_t>(), w.groups, w.row_lo, w.rows, K,
                    P, a.q_t.as<uint8_t>(), a.scale.as<float>(),
                    K % 8 == 0 && reinterpret_cast<uintptr_t>(a.x.data) % 16 == 0);
}

}  // namespace moe_echo::cuda
