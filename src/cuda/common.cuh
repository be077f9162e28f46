// Shared pieces of the CUDA kernels: element conversions, warp reductions, the launch helper
// (written once: empty grids are skipped, every launch is checked) and grid sizing.
//
// Rules every kernel of src/cuda keeps:
// - Grids are sized from host shapes (capacity, tokens), never from routing; kernels read the
//   routing-dependent extents (group offsets, valid rows) on the device and skip the rest.
// - No atomics whose order changes a floating-point result: every sum is done by one thread in a
//   fixed order or by a fixed reduction tree, so results are bit-identical run to run.
// - Nothing allocates, synchronises or reads device memory on the host: every launch is
//   capture-safe.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "moe_echo/cuda_check.hpp"
#include "moe_echo/tensor.hpp"

namespace moe_echo::cuda {

using bf16 = __nv_bfloat16;

inline cudaStream_t as_cuda(Stream s) { return static_cast<cudaStream_t>(s); }

// Multiprocessors of the current device (cached per device).
int sm_count();

// Blocks for n work items of `per_block` items each, capped at `cap` blocks (grid-stride loops
// cover the rest). 0 when n == 0 (the launch is then skipped).
inline unsigned blocks_for(int64_t n, int64_t per_block, int64_t cap) {
  if (n <= 0) return 0;
  return unsigned(std::min<int64_t>((n + per_block - 1) / per_block, cap));
}
// The usual cap of a grid-stride kernel: enough blocks to fill the GPU several times over.
inline int64_t grid_cap() { return int64_t(sm_count()) * 16; }

namespace detail {
void check_launch(const char* kernel_name);
}  // namespace detail

// Launches kernel<<<grid, block, smem, stream>>>(args...) unless the grid is empty, then checks
// the launch (bad configurations raise moe_echo::Error naming the kernel).
template <class... KernelArgs, class... Args>
void launch(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
            cudaStream_t stream, Args&&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  kernel<<<grid, block, smem, stream>>>(static_cast<KernelArgs>(args)...);
  detail::check_launch(name);
}
#define MOE_ECHO_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::moe_echo::cuda::launch(#kernel, kernel, grid, block, smem, stream, __VA_ARGS__)

// ---- element conversions ----------------------------------------------------------------------

template <class T>
__device__ __forceinline__ float load_f(const T* p) {
  if constexpr (sizeof(T) == 2)
    return __bfloat162float(*p);
  else
    return float(*p);
}
template <class T>
__device__ __forceinline__ void store_f(T* p, float v) {
  if constexpr (sizeof(T) == 2)
    *p = __float2bfloat16_rn(v);
  else
    *p = T(v);
}

// ---- 16-byte vectors of 8 bf16 -----------------------------------------------------------------
// The memory-bound kernels move rows as 16-byte words (8 bf16) when every row and base pointer is
// 16-byte aligned (hidden and FFN sizes that are multiples of 8, which the model configs have),
// and fall back to scalar kernels otherwise (odd sizes in the tests).

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Row copies of any element type: the widest word (16, 8, 4, 2 or 1 bytes) that divides the row
// size and every base address, and a call of f with a value of that word type.
inline size_t word_size(size_t row_bytes, std::initializer_list<const void*> bases) {
  for (size_t w : {size_t(16), size_t(8), size_t(4), size_t(2)}) {
    bool ok = row_bytes % w == 0;
    for (const void* p : bases) ok = ok && reinterpret_cast<uintptr_t>(p) % w == 0;
    if (ok) return w;
  }
  return 1;
}

template <class F>
void with_word(size_t w, F&& f) {
  switch (w) {
    case 16: f(uint4{}); break;
    case 8: f(uint2{}); break;
    case 4: f(uint32_t{}); break;
    case 2: f(uint16_t{}); break;
    default: f(uint8_t{}); break;
  }
}

// bf16 -> f32 is exact (the bf16 bits are the top half of the f32).
__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
// f32 -> bf16 round to nearest even, as __float2bfloat16_rn.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}
__device__ __forceinline__ uint4 pack_bf16x8(const float (&f)[8]) {
  return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                    pack_bf16x2(f[6], f[7]));
}

// ---- row words as floats ------------------------------------------------------------------------
// RowWord<W, T>: one word W of a row of T elements (T = bf16 or float) to and from floats: a
// 16-byte word (8 bf16 or 4 floats) or a single element. Kernels that take the word type as a
// template parameter run the same arithmetic in the same order per element on either path.
template <class W, class T>
struct RowWord;
template <>
struct RowWord<uint4, bf16> {
  static constexpr int n = 8;
  static __device__ __forceinline__ void unpack(const uint4& v, float (&f)[8]) {
    unpack_bf16x8(v, f);
  }
  static __device__ __forceinline__ uint4 pack(const float (&f)[8]) { return pack_bf16x8(f); }
};
template <>
struct RowWord<uint4, float> {
  static constexpr int n = 4;
  static __device__ __forceinline__ void unpack(const uint4& v, float (&f)[4]) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  static __device__ __forceinline__ uint4 pack(const float (&f)[4]) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
};
template <class T>
struct RowWord<T, T> {
  static constexpr int n = 1;
  static __device__ __forceinline__ void unpack(const T& v, float (&f)[1]) { f[0] = load_f(&v); }
  static __device__ __forceinline__ T pack(const float (&f)[1]) {
    T v;
    store_f(&v, f[0]);
    return v;
  }
};

// ---- warp reductions (fixed butterfly order: deterministic) -----------------------------------

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <class T>
__device__ __forceinline__ T warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Reduce-scatter of N per-lane values over the warp (N a multiple of 64): afterwards lane l holds
// in v[p], p < N / 32, the warp's sum of value reduce_scatter_index<N>(l, p). Each sum is formed
// by a fixed tree (the same on every run), with N - 2 shuffles instead of 5 N for N butterflies.
namespace detail {
template <int N, int S>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[N], int lane) {
  constexpr int o = 16 >> S, half = N >> (S + 1);
  const bool upper = (lane & o) != 0;
#pragma unroll
  for (int p = 0; p < half; ++p) {
    const float send = upper ? v[p] : v[p + half];
    const float keep = upper ? v[p + half] : v[p];
    v[p] = keep + __shfl_xor_sync(0xffffffffu, send, o);
  }
}
}  // namespace detail
template <int N>
__device__ __forceinline__ void warp_reduce_scatter(float (&v)[N], int lane) {
  static_assert(N % 64 == 0, "N must be a multiple of 64");
  detail::reduce_scatter_step<N, 0>(v, lane);
  detail::reduce_scatter_step<N, 1>(v, lane);
  detail::reduce_scatter_step<N, 2>(v, lane);
  detail::reduce_scatter_step<N, 3>(v, lane);
  detail::reduce_scatter_step<N, 4>(v, lane);
}
template <int N>
__device__ __forceinline__ int reduce_scatter_index(int lane, int p) {
  int idx = p;
#pragma unroll
  for (int s = 0; s < 5; ++s)
    if (lane & (16 >> s)) idx += N >> (s + 1);
  return idx;
}

// Rows of a receive window that belong to some group (groups are contiguous from receive row 0,
// so the valid rows are a prefix): clamp(offsets[groups] - row_lo, 0, rows).
__device__ __forceinline__ int64_t valid_window_rows(const int32_t* offsets, int groups,
                                                     int64_t row_lo, int64_t rows) {
  const int64_t v = int64_t(offsets[groups]) - row_lo;
  return v < 0 ? 0 : (v > rows ? rows : v);
}

}  // namespace moe_echo::cuda
