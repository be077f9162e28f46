// FP8 blockwise quantization on the GPU (backend.hpp, Fp8RowArgs / Fp8BlockArgs / Fp8ColArgs).
// Semantics and bits: src/cpu/fp8_quant.cpp (amax, scale = max(amax / 448, FLT_MIN) or 1,
// e4m3(x * (1 / scale)) rounded to nearest even and saturated: cvt.rn.satfinite.e4m3x2.f32
// through __nv_cvt_float_to_fp8).
// Each element is read once from global memory; the block and column kernels stage their tiles
// and their e4m3 output in shared memory so that every global load and store is a 16-byte run.
#include <cuda_fp8.h>

#include "cuda/common.cuh"
#include "cuda/fp8_tile.cuh"
#include "cuda/ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

constexpr int kTile = int(kFp8Tile);

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

// Eight bf16 of x (16 bytes, aligned) as floats.
__device__ __forceinline__ void load8(const bf16* p, float (&v)[8]) {
  unpack_bf16x8(*reinterpret_cast<const uint4*>(p), v);
}

// The row quantization's load and store widths: each lane holds V elements of a tile, so a tile
// takes 128 / V lanes and a warp takes 32 V / 128 (row, tile) items at a time.
enum class RowVec { x16, x8, scalar };  // 16-byte / 8-byte loads, or element by element

// Warp-uniform loop over (row, tile) items: lane group `sub` of the warp takes item w0 + sub,
// its lane l elements V l .. V l + V - 1 of the tile. The rows are x's, or with `offsets` the
// window's valid rows only. Row r's values go to q + r q_pitch and its scales to
// scale + r s_pitch (dense q and scale, or packed rows: values then scales in one row of q_pitch
// bytes, whose `pad` last bytes are zeroed).
template <RowVec kVec>
__global__ void quantize_rows_kernel(const bf16* __restrict__ x, uint8_t* __restrict__ q,
                                     float* __restrict__ scale, int64_t rows, int64_t K,
                                     int64_t tiles, int64_t q_pitch, int64_t s_pitch, int pad,
                                     const int32_t* __restrict__ offsets, int groups,
                                     int64_t row_lo) {
  constexpr int V = kVec == RowVec::x16 ? 8 : 4, L = kTile / V, per_warp = 32 / L;
  const int lane = int(threadIdx.x) % 32, sub = lane / L, l = lane % L, c = V * l;
  if (offsets) rows = valid_window_rows(offsets, groups, row_lo, rows);
  const int64_t items = rows * tiles;
  const int64_t stride = int64_t(gridDim.x) * (blockDim.x / 32) * per_warp;
  for (int64_t w0 = (int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) * per_warp;
       w0 < items; w0 += stride) {
    const int64_t w = w0 + sub;
    const bool on = w < items;
    const int64_t r = on ? w / tiles : 0, t = on ? w % tiles : 0, lo = t * kTile;
    const int64_t n = !on ? 0 : K - lo < kTile ? K - lo : kTile;
    const bf16* row = x + r * K + lo;
    float v[V];
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = 0.f;
    if constexpr (kVec == RowVec::x16) {
      if (c < n) load8(row + c, v);
    } else if constexpr (kVec == RowVec::x8) {
      if (c < n) load4(row + c, v);
    } else {
      for (int j = 0; j < V; ++j)
        if (c + j < n) v[j] = __bfloat162float(row[c + j]);
    }
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
    for (int o = L / 2; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (!on) continue;
    const TileQuant tq(amax);
    if (l == 0) scale[r * s_pitch + t] = tq.s;
    if (t == 0 && l < pad) q[(r + 1) * q_pitch - pad + l] = 0;
    uint8_t* out = q + r * q_pitch + lo;
    if constexpr (kVec == RowVec::x16) {
      if (c < n)
        *reinterpret_cast<uint2*>(out + c) =
            make_uint2(e4m3x4(tq, v[0], v[1], v[2], v[3]), e4m3x4(tq, v[4], v[5], v[6], v[7]));
    } else if constexpr (kVec == RowVec::x8) {
      if (c < n) *reinterpret_cast<uint32_t*>(out + c) = e4m3x4(tq, v[0], v[1], v[2], v[3]);
    } else {
      for (int j = 0; j < V; ++j)
        if (c + j < n) out[c + j] = tq(v[j]);
    }
  }
}

// x = q * scale rounded to bf16, one thread per 4 elements of a row (K % 4 == 0), else per one.
// With `per` 8 (K % 8 == 0, q 8-byte and x 16-byte aligned) a thread takes 8 elements of one
// tile: one 8-byte load and one 16-byte store. The rows are x's, or with `offsets` the window's
// valid rows only.
__global__ void dequantize_rows_kernel(const uint8_t* __restrict__ q,
                                       const float* __restrict__ scale, bf16* __restrict__ x,
                                       int64_t rows, int64_t K, int64_t tiles, int per,
                                       const int32_t* __restrict__ offsets, int groups,
                                       int64_t row_lo) {
  if (offsets) rows = valid_window_rows(offsets, groups, row_lo, rows);
  const int64_t n = rows * (K / per);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / (K / per), k = i % (K / per) * per;
    const float s = scale[r * tiles + k / kTile];
    if (per == 8) {
      const uint2 raw = *reinterpret_cast<const uint2*>(q + r * K + k);
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j)
        v[j] = __fmul_rn(from_e4m3(uint8_t((j < 4 ? raw.x : raw.y) >> (8 * (j % 4)))), s);
      *reinterpret_cast<uint4*>(x + r * K + k) = pack_bf16x8(v);
    } else {
      for (int j = 0; j < per; ++j)
        x[r * K + k + j] = __float2bfloat16_rn(__fmul_rn(from_e4m3(q[r * K + k + j]), s));
    }
  }
}

// Half j (0: low) of a word of two bf16, as a float.
__device__ __forceinline__ float bf16_half(uint32_t word, int j) {
  const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(&word);
  return j == 0 ? __low2float(pair) : __high2float(pair);
}

// The e4m3 bytes of the 16 values v(0) .. v(15) of one tile (scale tq) into 16-byte chunk `ch`
// of row y of a staged tile, in store_staged's layout (at chunk ch ^ swz).
template <class V>
__device__ __forceinline__ void stage16(uint8_t* staged, int y, int ch, int swz,
                                        const TileQuant& tq, V v) {
  uint32_t w[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) w[u] = e4m3x4(tq, v(4 * u), v(4 * u + 1), v(4 * u + 2), v(4 * u + 3));
  reinterpret_cast<uint4*>(staged + y * kTile)[ch ^ swz] = make_uint4(w[0], w[1], w[2], w[3]);
}

// A 128 x 128 byte tile staged in shared memory (the 16-byte chunk ch of row y at chunk
// ch ^ swz(y), so that the 8 threads of a store phase hit distinct banks), stored by the block's
// threads as whole chunks (a warp writes four 128-byte rows at a time): rows y < n_rows, `valid`
// bytes each, to dst_row(y); 16-byte stores when vec16, 4-byte when vec4, else bytes.
template <class Swz, class Dst>
__device__ __forceinline__ void store_staged(const uint8_t* staged, int n_rows, int valid,
                                             bool vec16, bool vec4, Swz swz, Dst dst_row) {
  for (int e = int(threadIdx.x); e < kTile * (kTile / 16); e += int(blockDim.x)) {
    const int y = e / (kTile / 16), ch = e % (kTile / 16);
    if (y >= n_rows || 16 * ch >= valid) continue;
    const uint4 v = reinterpret_cast<const uint4*>(staged + y * kTile)[ch ^ swz(y)];
    uint8_t* dst = dst_row(y) + 16 * ch;
    if (vec16 && 16 * ch + 16 <= valid) {
      *reinterpret_cast<uint4*>(dst) = v;
    } else if (vec4 && 16 * ch + 16 <= valid) {
      uint32_t* d = reinterpret_cast<uint32_t*>(dst);
      d[0] = v.x, d[1] = v.y, d[2] = v.z, d[3] = v.w;
    } else {
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int b = 0; b < 16; ++b)
        if (16 * ch + b < valid) dst[b] = uint8_t(w[b / 4] >> (8 * (b % 4)));
    }
  }
}

// One block of 256 threads per (group, K tile, N tile): the 128 x 128 block of w into shared
// memory (16-byte loads when `vec`: N % 8 == 0 and w 16-byte aligned; row r at word r * 65), its
// amax over the threads' loads, then q's rows from shared memory as 8-byte runs (4-byte or single
// bytes at an edge or without `vec`), and q_t's rows (w's columns) as in quantize_cols_kernel:
// thread i takes the two columns of shared word i % 64 and the 32 rows 32 (i / 64) .., stages their
// bytes in shared memory and the block stores whole 128-byte rows (16-byte stores when `t_vec`:
// K % 16 == 0 and q_t 16-byte aligned).
__global__ void __launch_bounds__(256, 3)
    quantize_blocks_kernel(const bf16* __restrict__ w, uint8_t* __restrict__ q,
                           uint8_t* __restrict__ q_t, float* __restrict__ scale,
                           float* __restrict__ scale_t, int64_t K, int64_t N, int64_t k_tiles,
                           int64_t n_tiles, bool vec, bool t_vec) {
  constexpr int kThreads = 256, kWords = kTile / 2, kPitch = kWords + 1;
  __shared__ uint32_t tile[kTile * kPitch];
  __shared__ __align__(16) uint8_t out[kTile * kTile];
  __shared__ float warp_amax[kThreads / 32];
  const int64_t b = blockIdx.x;
  const int64_t g = b / (k_tiles * n_tiles), kt = b / n_tiles % k_tiles, nt = b % n_tiles;
  const int64_t k0 = kt * kTile, n0 = nt * kTile;
  const int kn = int(K - k0 < kTile ? K - k0 : kTile), nn = int(N - n0 < kTile ? N - n0 : kTile);
  const bf16* slab = w + g * K * N;
  const int tid = int(threadIdx.x);
  float amax = 0.f;
  if (vec) {
#pragma unroll 4
    for (int i = tid; i < kTile * kTile / 8; i += kThreads) {
      const int r = i / (kTile / 8), c = i % (kTile / 8) * 8;
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (r < kn && c < nn) raw = *reinterpret_cast<const uint4*>(slab + (k0 + r) * N + n0 + c);
      float v[8];
      unpack_bf16x8(raw, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
      uint32_t* dst = tile + r * kPitch + c / 2;
      dst[0] = raw.x, dst[1] = raw.y, dst[2] = raw.z, dst[3] = raw.w;
    }
  } else {
    for (int i = tid; i < kTile * kTile; i += kThreads) {
      const int r = i / kTile, c = i % kTile;
      const bf16 v = r < kn && c < nn ? slab[(k0 + r) * N + n0 + c] : __float2bfloat16(0.f);
      amax = fmaxf(amax, fabsf(__bfloat162float(v)));
      reinterpret_cast<bf16*>(tile + r * kPitch)[c] = v;
    }
  }
  amax = warp_max(amax);
  if (tid % 32 == 0) warp_amax[tid / 32] = amax;
  __syncthreads();
  amax = 0.f;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) amax = fmaxf(amax, warp_amax[i]);
  const TileQuant tq(amax);
  if (tid == 0) scale[(g * k_tiles + kt) * n_tiles + nt] = tq.s;
  if (tid == 0 && scale_t) scale_t[(g * n_tiles + nt) * k_tiles + kt] = tq.s;
  if (q) {
    // q's rows: thread i takes 8 columns of a row at a time (a warp: two 128-byte rows).
    for (int i = tid; i < kTile * kTile / 8; i += kThreads) {
      const int r = i / (kTile / 8), c = i % (kTile / 8) * 8;
      if (r >= kn || c >= nn) continue;
      const uint32_t* src = tile + r * kPitch + c / 2;
      const uint32_t lo = e4m3x4(tq, bf16_half(src[0], 0), bf16_half(src[0], 1),
                                 bf16_half(src[1], 0), bf16_half(src[1], 1));
      const uint32_t hi = e4m3x4(tq, bf16_half(src[2], 0), bf16_half(src[2], 1),
                                 bf16_half(src[3], 0), bf16_half(src[3], 1));
      uint8_t* dst = q + g * K * N + (k0 + r) * N + n0 + c;
      if (vec && c + 8 <= nn) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
      } else {
        for (int j = 0; j < 8 && c + j < nn; ++j)
          dst[j] = uint8_t((j < 4 ? lo : hi) >> (8 * (j % 4)));
      }
    }
  }
  if (!q_t) return;
  // q_t's rows: column pair cw, rows r0 .. r0 + 31, staged at out row c with swizzle cw & 7.
  const int cw = tid % kWords, r0 = tid / kWords * 32;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int c = 2 * cw + j;
#pragma unroll
    for (int i = 0; i < 2; ++i)
      stage16(out, c, r0 / 16 + i, cw & 7, tq,
              [&](int y) { return bf16_half(tile[(r0 + 16 * i + y) * kPitch + cw], j); });
  }
  __syncthreads();
  store_staged(
      out, nn, kn, t_vec, false, [](int c) { return c / 2 & 7; },
      [&](int c) { return q_t + g * N * K + (n0 + c) * K + k0; });
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
// and rows [kb * 128, kb * 128 + 128) of q_t (columns of x): the 128 x 128 block of x into shared
// memory (row r at word r * kPitch, an odd pitch), then each pass gives every thread whole runs of
// one tile, so a tile's amax is a thread's own loop plus one combine through shared memory (no
// warp reductions) and each thread writes 16-byte runs:
// - with row_q (bf16 x), the rows along K: thread i takes the 64 columns 64 (i / 128) .. of block
//   row i % 128 (a warp reads 32 rows at one word: 32 banks, the pitch being odd);
// - the columns: thread i takes the kPer columns of shared word i % kWords and the kRun rows
//   kRun (i / kWords) .. (a warp reads consecutive words of one row), and writes the kRun bytes of
//   each of its columns as q_t row bytes (kRun: 32 for bf16, 16 for e4m3).
// With an e4m3 x (kFp8In), the block keeps x's bytes and each row's scale of this K tile, and a
// value is their f32 product (the scale of x row i's tile kb is x_scale[i * tiles + kb]).
// vec: 16-byte loads (kn a multiple of 16 bytes' elements); row_vec: 16-byte row_q stores
// (K % 16 == 0, row_q 16-byte aligned); qt_vec: 16-byte q_t stores (q_t 16-byte aligned; else
// 4-byte).
template <bool kFp8In>
__global__ void __launch_bounds__(256, 4)
    quantize_cols_kernel(const void* __restrict__ x_in, const float* __restrict__ x_scale,
                         const int32_t* __restrict__ offsets, const int32_t* __restrict__ padded,
                         int groups, int64_t row_lo, int64_t rows, int64_t K, int64_t P,
                         uint8_t* __restrict__ q_t, float* __restrict__ scale, bool vec,
                         bool row_vec, bool qt_vec, uint8_t* __restrict__ row_q,
                         float* __restrict__ row_scale) {
  constexpr int kThreads = 256;
  constexpr int kPer = kFp8In ? 4 : 2;      // x columns per shared word
  constexpr int kWords = kTile / kPer;      // words per block row
  constexpr int kPitch = kWords + 1;        // words per shared row (odd)
  constexpr int kRuns = kThreads / kWords;  // row runs per column: 4 (bf16) or 8 (e4m3)
  constexpr int kRun = kTile / kRuns;       // rows per run: 32 or 16
  __shared__ uint32_t tile[kTile * kPitch];
  __shared__ float x_row_scale[kFp8In ? kTile : 1];
  __shared__ float col_part[kRuns][kTile];              // per run: each column's amax over its rows
  __shared__ float row_part[2][kTile];                  // per half row: its amax
  __shared__ __align__(16) uint8_t out[kTile * kTile];  // one pass's e4m3 bytes (swizzled)
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
  const int64_t k_tiles = (K + kTile - 1) / kTile;
  const int tid = int(threadIdx.x);
  if constexpr (kFp8In)
    for (int r = tid; r < kTile; r += kThreads)
      x_row_scale[r] = r < n ? x_scale[(first + r) * k_tiles + blockIdx.y] : 0.f;
  // The block: 16-byte loads when `vec`, element by element otherwise; zeros past n rows and kn
  // columns.
  constexpr int kChunk = 16 / (kFp8In ? 1 : 2);  // elements of a 16-byte load
  if (vec) {
#pragma unroll 4
    for (int i = tid; i < kTile * kTile / kChunk; i += kThreads) {
      const int r = i / (kTile / kChunk), c = i % (kTile / kChunk) * kChunk;
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (r < n && c < kn) {
        const int64_t at = (first + r) * K + k0 + c;
        raw = kFp8In ? *reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(x_in) + at)
                     : *reinterpret_cast<const uint4*>(static_cast<const bf16*>(x_in) + at);
      }
      uint32_t* dst = tile + r * kPitch + c / kPer;
      dst[0] = raw.x, dst[1] = raw.y, dst[2] = raw.z, dst[3] = raw.w;
    }
  } else {
    for (int i = tid; i < kTile * kTile; i += kThreads) {
      const int r = i / kTile, c = i % kTile;
      const bool in = r < n && c < kn;
      const int64_t at = (first + r) * K + k0 + c;
      if constexpr (kFp8In)
        reinterpret_cast<uint8_t*>(tile + r * kPitch)[c] =
            in ? static_cast<const uint8_t*>(x_in)[at] : uint8_t(0);
      else
        reinterpret_cast<bf16*>(tile + r * kPitch)[c] =
            in ? static_cast<const bf16*>(x_in)[at] : __float2bfloat16(0.f);
    }
  }
  __syncthreads();
  // Pass 1: the amax of every half row (with row_q) and of every column run.
  const bool rows_too = !kFp8In && row_q != nullptr;
  const int r = tid % kTile, h = tid / kTile;  // rows: columns 64 h .. 64 h + 63 of block row r
  const uint32_t* row_words = tile + r * kPitch + 32 * h;
  if constexpr (!kFp8In) {
    if (rows_too) {
      float amax = 0.f;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(&row_words[j]);
        amax = fmaxf(amax, fmaxf(fabsf(__low2float(pair)), fabsf(__high2float(pair))));
      }
      row_part[h][r] = amax;
    }
  }
  // Columns: word cw (x columns kPer cw ..), rows r0 .. r0 + kRun - 1.
  const int cw = tid % kWords, run = tid / kWords, r0 = run * kRun;
  const uint32_t* col_words = tile + r0 * kPitch + cw;  // row r0 + i at i * kPitch
  // The value of column j of a word in row `row`.
  auto value = [&](uint32_t word, int j, int row) {
    if constexpr (kFp8In) {
      return __fmul_rn(from_e4m3(uint8_t(word >> (8 * j))), x_row_scale[row]);
    } else {
      return bf16_half(word, j);
    }
  };
  {
    float amax[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) amax[j] = 0.f;
#pragma unroll
    for (int i = 0; i < kRun; ++i) {
      const uint32_t word = col_words[i * kPitch];
#pragma unroll
      for (int j = 0; j < kPer; ++j) amax[j] = fmaxf(amax[j], fabsf(value(word, j, r0 + i)));
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) col_part[run][kPer * cw + j] = amax[j];
  }
  __syncthreads();
  // Pass 2: the e4m3 bytes staged in `out` (store_staged's layout), then stored from there.
  if constexpr (!kFp8In) {
    if (rows_too) {
      const TileQuant tq(fmaxf(row_part[0][r], row_part[1][r]));
      if (h == 0 && r < n) row_scale[(first + r) * k_tiles + blockIdx.y] = tq.s;
#pragma unroll
      for (int i = 0; i < 4; ++i)  // chunk 4 h + i: columns 64 h + 16 i ..
        stage16(out, r, 4 * h + i, r & 7, tq,
                [&](int e) { return bf16_half(row_words[8 * i + e / 2], e % 2); });
      __syncthreads();
      store_staged(
          out, n, kn, row_vec, false, [](int y) { return y & 7; },
          [&](int y) { return row_q + (first + y) * K + k0; });
      __syncthreads();
    }
  }
  float* tile_scales = scale + K * (padded[g] / kTile) + t * K + k0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int c = kPer * cw + j;
    float a = col_part[0][c];
#pragma unroll
    for (int u = 1; u < kRuns; ++u) a = fmaxf(a, col_part[u][c]);
    const TileQuant tq(a);
    if (run == 0 && c < kn) tile_scales[c] = tq.s;
#pragma unroll
    for (int i = 0; i < kRun / 16; ++i)  // chunk r0 / 16 + i of out row c
      stage16(out, c, r0 / 16 + i, cw & 7, tq,
              [&](int y) { return value(col_words[(16 * i + y) * kPitch], j, r0 + 16 * i + y); });
  }
  __syncthreads();
  store_staged(
      out, kn, kTile, qt_vec, true, [](int y) { return y / kPer & 7; },
      [&](int y) { return q_t + (k0 + y) * P + c0; });
}

}  // namespace

void quantize_fp8_rows(const Fp8RowArgs& a, cudaStream_t s) {
  const int64_t KT = check_fp8_row_args(a, DType::bf16), rows = a.x.size(0), K = a.x.size(1);
  if (rows == 0 || K == 0) return;
  const bool packed = a.packed.data != nullptr;
  uint8_t* q = packed ? a.packed.as<uint8_t>() : a.q.as<uint8_t>();
  float* scale = packed ? reinterpret_cast<float*>(q + K) : a.scale.as<float>();
  const int64_t pitch = packed ? fp8_packed_row_bytes(K) : K;
  const auto x_at = reinterpret_cast<uintptr_t>(a.x.data), q_at = reinterpret_cast<uintptr_t>(q);
  const RowVec vec = K % 8 == 0 && x_at % 16 == 0 && q_at % 8 == 0  ? RowVec::x16
                     : K % 4 == 0 && x_at % 8 == 0 && q_at % 4 == 0 ? RowVec::x8
                                                                    : RowVec::scalar;
  const GroupWindow& w = a.window;
  const int64_t n = w.group_offsets ? w.rows : rows;
  auto launch = [&](auto kernel, int per_warp) {
    MOE_ECHO_LAUNCH(kernel, blocks_for(n * KT, 8 * per_warp, grid_cap()), 256, 0, s, a.x.as<bf16>(),
                    q, scale, n, K, KT, pitch, packed ? pitch / int64_t(sizeof(float)) : KT,
                    packed ? int(pitch - K - KT * int64_t(sizeof(float))) : 0, w.group_offsets,
                    w.groups, w.row_lo);
  };
  if (vec == RowVec::x16)
    launch(quantize_rows_kernel<RowVec::x16>, 2);
  else if (vec == RowVec::x8)
    launch(quantize_rows_kernel<RowVec::x8>, 1);
  else
    launch(quantize_rows_kernel<RowVec::scalar>, 1);
}

void dequantize_fp8_rows(const Fp8RowArgs& a, cudaStream_t s) {
  const int64_t KT = check_fp8_dequant_args(a, DType::bf16), K = a.x.size(1);
  const GroupWindow& w = a.window;
  const int64_t rows = w.group_offsets ? w.rows : a.x.size(0);
  if (rows == 0 || K == 0) return;
  const int per = K % 8 == 0 && reinterpret_cast<uintptr_t>(a.q.data) % 8 == 0 &&
                          reinterpret_cast<uintptr_t>(a.x.data) % 16 == 0
                      ? 8
                      : 1;
  MOE_ECHO_LAUNCH(dequantize_rows_kernel, blocks_for(rows * (K / per), 256, grid_cap()), 256, 0, s,
                  a.q.as<uint8_t>(), a.scale.as<float>(), a.x.as<bf16>(), rows, K, KT, per,
                  w.group_offsets, w.groups, w.row_lo);
}

void quantize_fp8_blocks(const Fp8BlockArgs& a, cudaStream_t s) {
  check_fp8_block_args(a, DType::bf16);
  const int64_t G = a.w.size(0), K = a.w.size(1), N = a.w.size(2), KT = fp8_tiles(K),
                NT = fp8_tiles(N);
  MOE_ECHO_CHECK(G * KT * NT <= INT32_MAX, "quantize_fp8_blocks: " << G * KT * NT << " blocks");
  const bool vec = N % 8 == 0 && reinterpret_cast<uintptr_t>(a.w.data) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(a.q.data) % 8 == 0;
  const bool t_vec = K % 16 == 0 && reinterpret_cast<uintptr_t>(a.q_t.data) % 16 == 0;
  MOE_ECHO_LAUNCH(quantize_blocks_kernel, unsigned(G * KT * NT), 256, 0, s, a.w.as<bf16>(),
                  a.q.as<uint8_t>(), a.q_t.as<uint8_t>(), a.scale.as<float>(),
                  a.scale_t.as<float>(), K, N, KT, NT, vec, t_vec);
}

void quantize_fp8_cols(const Fp8ColArgs& a, cudaStream_t s) {
  const GroupWindow& w = a.window;
  const int64_t P = check_fp8_col_args(a, DType::bf16), K = a.x.size(1);
  MOE_ECHO_LAUNCH(padded_offsets_kernel, 1, 1, 0, s, w.group_offsets, w.groups, w.row_lo, w.rows,
                  a.padded_offsets.as<int32_t>());
  MOE_ECHO_CHECK(P / kFp8Tile <= INT32_MAX && fp8_tiles(K) <= 65535,
                 "quantize_fp8_cols: " << P << " columns, K " << K);
  if (P == 0) return;
  MOE_ECHO_CHECK(reinterpret_cast<uintptr_t>(a.q_t.data) % 4 == 0,
                 "quantize_fp8_cols: q_t at " << a.q_t.data << " must be 4-byte aligned");
  const dim3 grid(unsigned(P / kFp8Tile), unsigned(fp8_tiles(K)));
  const bool qt_vec = reinterpret_cast<uintptr_t>(a.q_t.data) % 16 == 0;
  if (a.x.dtype == DType::e4m3)
    MOE_ECHO_LAUNCH(quantize_cols_kernel<true>, grid, 256, 0, s, a.x.data, a.x_scale.as<float>(),
                    w.group_offsets, a.padded_offsets.as<int32_t>(), w.groups, w.row_lo, w.rows, K,
                    P, a.q_t.as<uint8_t>(), a.scale.as<float>(),
                    K % 16 == 0 && reinterpret_cast<uintptr_t>(a.x.data) % 16 == 0, false, qt_vec,
                    nullptr, nullptr);
  else
    MOE_ECHO_LAUNCH(quantize_cols_kernel<false>, grid, 256, 0, s, a.x.data, nullptr,
                    w.group_offsets, a.padded_offsets.as<int32_t>(), w.groups, w.row_lo, w.rows, K,
                    P, a.q_t.as<uint8_t>(), a.scale.as<float>(),
                    K % 8 == 0 && reinterpret_cast<uintptr_t>(a.x.data) % 16 == 0,
                    K % 16 == 0 && reinterpret_cast<uintptr_t>(a.row_q.data) % 16 == 0, qt_vec,
                    a.row_q.as<uint8_t>(), a.row_scale.as<float>());
}

}  // namespace moe_echo::cuda
