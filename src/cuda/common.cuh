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

#include "cuda/cuda_check.hpp"
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

// Rows of a receive window that belong to some group (groups are contiguous from receive row 0,
// so the valid rows are a prefix): clamp(offsets[groups] - row_lo, 0, rows).
__device__ __forceinline__ int64_t valid_window_rows(const int32_t* offsets, int groups,
                                                     int64_t row_lo, int64_t rows) {
  const int64_t v = int64_t(offsets[groups]) - row_lo;
  return v < 0 ? 0 : (v > rows ? rows : v);
}

}  // namespace moe_echo::cuda
