// SwiGLU on the GPU over the valid rows of a receive window only: a = silu(gate) * up with
// h = gate | up, and its backward. Semantics: src/cpu/swiglu.cpp. bf16 in and out, f32 math.
// The grid is sized by the window (capacity rows); the valid prefix is read on the device.
//
// Bytes per valid row (bf16): forward reads 2F * 2 and writes F * 2; backward reads h and da once
// (3F * 2) and writes dh (2F * 2). With F % 8 == 0 and 16-byte aligned bases every thread moves
// 8 elements as 16-byte words; otherwise the scalar kernels run (the same f32 expressions).
#include "cuda/common.cuh"
#include "cuda/fp8_tile.cuh"
#include "cuda/ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

__device__ __forceinline__ float sigmoidf_(float v) { return 1.f / (1.f + expf(-v)); }

// The scalar kernels' gate and up of column f of row r of h = gate | up (F columns each), in f32.
struct GateUp {
  float gate, up;
};
__device__ __forceinline__ GateUp load_gate_up(const bf16* __restrict__ h, int64_t r, int64_t F,
                                               int64_t f) {
  return {__bfloat162float(h[r * 2 * F + f]), __bfloat162float(h[r * 2 * F + F + f])};
}

// One thread per 8 consecutive f of one row (F8 = F / 8 words per row of a, 2 F8 of h).
__global__ void swiglu_forward_vec_kernel(const int32_t* __restrict__ offsets, int groups,
                                          int64_t row_lo, int64_t rows, int64_t F8,
                                          const uint4* __restrict__ h, uint4* __restrict__ a) {
  const int64_t n = valid_window_rows(offsets, groups, row_lo, rows) * F8;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / F8, c = i - r * F8;
    const uint4 gv = h[r * 2 * F8 + c], uv = h[r * 2 * F8 + F8 + c];
    float gate[8], up[8], out[8];
    unpack_bf16x8(gv, gate);
    unpack_bf16x8(uv, up);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = gate[j] * sigmoidf_(gate[j]) * up[j];
    a[i] = pack_bf16x8(out);
  }
}

// With a's FP8 rows (F % 128 == 0): the loop runs warp-uniform, 16 lanes hold one 128-wide tile
// of a row (F / 8 is a multiple of 16, so tiles start at multiples of 16 lanes), the tile's amax
// is a 16-lane reduction of the bf16-rounded values, and each lane writes its 8 e4m3 bytes.
__global__ void swiglu_forward_fp8_kernel(const int32_t* __restrict__ offsets, int groups,
                                          int64_t row_lo, int64_t rows, int64_t F8,
                                          const uint4* __restrict__ h, uint4* __restrict__ a,
                                          uint8_t* __restrict__ a_q, float* __restrict__ a_scale) {
  const int64_t n = valid_window_rows(offsets, groups, row_lo, rows) * F8;
  const int lane = int(threadIdx.x) % 32;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x - lane; i0 < n; i0 += stride) {
    const int64_t i = i0 + lane;
    const bool on = i < n;
    const int64_t r = on ? i / F8 : 0, c = on ? i - r * F8 : 0;
    float out[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (on) {
      const uint4 gv = h[r * 2 * F8 + c], uv = h[r * 2 * F8 + F8 + c];
      float gate[8], up[8];
      unpack_bf16x8(gv, gate);
      unpack_bf16x8(uv, up);
#pragma unroll
      for (int j = 0; j < 8; ++j) out[j] = gate[j] * sigmoidf_(gate[j]) * up[j];
      const uint4 packed = pack_bf16x8(out);
      a[i] = packed;
      unpack_bf16x8(packed, out);  // the values a holds
    }
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(out[j]));
#pragma unroll
    for (int o = 8; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (!on) continue;
    const TileQuant tq(amax);
    const int64_t F = 8 * F8;
    if (c % 16 == 0) a_scale[r * (F / 128) + c / 16] = tq.s;
    *reinterpret_cast<uint2*>(a_q + r * F + 8 * c) = make_uint2(
        e4m3x4(tq, out[0], out[1], out[2], out[3]), e4m3x4(tq, out[4], out[5], out[6], out[7]));
  }
}

__global__ void swiglu_backward_vec_kernel(const int32_t* __restrict__ offsets, int groups,
                                           int64_t row_lo, int64_t rows, int64_t F8,
                                           const uint4* __restrict__ h,
                                           const uint4* __restrict__ da, uint4* __restrict__ dh) {
  const int64_t n = valid_window_rows(offsets, groups, row_lo, rows) * F8;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / F8, c = i - r * F8;
    const uint4 gv = h[r * 2 * F8 + c], uv = h[r * 2 * F8 + F8 + c], dv = da[i];
    float gate[8], up[8], d[8], dgate[8], dup[8];
    unpack_bf16x8(gv, gate);
    unpack_bf16x8(uv, up);
    unpack_bf16x8(dv, d);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float sg = sigmoidf_(gate[j]);
      dgate[j] = d[j] * up[j] * sg * (1.f + gate[j] * (1.f - sg));
      dup[j] = d[j] * gate[j] * sg;
    }
    dh[r * 2 * F8 + c] = pack_bf16x8(dgate);
    dh[r * 2 * F8 + F8 + c] = pack_bf16x8(dup);
  }
}

__global__ void swiglu_forward_kernel(const int32_t* __restrict__ offsets, int groups,
                                      int64_t row_lo, int64_t rows, int64_t F,
                                      const bf16* __restrict__ h, bf16* a) {
  const int64_t n = valid_window_rows(offsets, groups, row_lo, rows) * F;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / F, f = i - r * F;
    const auto [gate, up] = load_gate_up(h, r, F, f);
    a[i] = __float2bfloat16_rn(gate * sigmoidf_(gate) * up);
  }
}

__global__ void swiglu_backward_kernel(const int32_t* __restrict__ offsets, int groups,
                                       int64_t row_lo, int64_t rows, int64_t F,
                                       const bf16* __restrict__ h, const bf16* __restrict__ da,
                                       bf16* dh) {
  const int64_t n = valid_window_rows(offsets, groups, row_lo, rows) * F;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / F, f = i - r * F;
    const auto [gate, up] = load_gate_up(h, r, F, f);
    const float sg = sigmoidf_(gate), d = __bfloat162float(da[i]);
    dh[r * 2 * F + f] = __float2bfloat16_rn(d * up * sg * (1.f + gate * (1.f - sg)));
    dh[r * 2 * F + F + f] = __float2bfloat16_rn(d * gate * sg);
  }
}

}  // namespace

void swiglu_forward(const SwigluArgs& a, cudaStream_t s) {
  MOE_ECHO_CHECK(a.h.dtype == DType::bf16 && a.a.dtype == DType::bf16,
                 "swiglu needs bf16 h and a, got " << a.h.describe() << ", " << a.a.describe());
  const GroupWindow& w = a.window;
  const int64_t F = a.a.size(1);
  if (a.a_q.data || a.a_scale.data) {
    check_fp8_row_args({a.a, a.a_q, a.a_scale, {}, w}, DType::bf16);
    if (F % 128 == 0 && aligned16(a.h.data) && aligned16(a.a.data) &&
        reinterpret_cast<uintptr_t>(a.a_q.data) % 8 == 0) {
      MOE_ECHO_LAUNCH(swiglu_forward_fp8_kernel, blocks_for(w.rows * (F / 8), 256, grid_cap()), 256,
                      0, s, w.group_offsets, w.groups, w.row_lo, w.rows, F / 8,
                      static_cast<const uint4*>(a.h.data), static_cast<uint4*>(a.a.data),
                      a.a_q.as<uint8_t>(), a.a_scale.as<float>());
      return;
    }
    swiglu_forward({w, a.h, a.a, Tensor(), Tensor()}, s);  // then the rows apart
    quantize_fp8_rows({a.a, a.a_q, a.a_scale, {}, w}, s);
    return;
  }
  if (F % 8 == 0 && aligned16(a.h.data) && aligned16(a.a.data)) {
    MOE_ECHO_LAUNCH(swiglu_forward_vec_kernel, blocks_for(w.rows * (F / 8), 256, grid_cap()), 256,
                    0, s, w.group_offsets, w.groups, w.row_lo, w.rows, F / 8,
                    static_cast<const uint4*>(a.h.data), static_cast<uint4*>(a.a.data));
    return;
  }
  MOE_ECHO_LAUNCH(swiglu_forward_kernel, blocks_for(w.rows * F, 256, grid_cap()), 256, 0, s,
                  w.group_offsets, w.groups, w.row_lo, w.rows, F, a.h.as<bf16>(), a.a.as<bf16>());
}

void swiglu_backward(const SwigluArgs& a, cudaStream_t s) {
  MOE_ECHO_CHECK(a.h.dtype == DType::bf16 && a.da.dtype == DType::bf16 && a.dh.dtype == DType::bf16,
                 "swiglu backward needs bf16 h, da and dh");
  const GroupWindow& w = a.window;
  const int64_t F = a.da.size(1);
  if (F % 8 == 0 && aligned16(a.h.data) && aligned16(a.da.data) && aligned16(a.dh.data)) {
    MOE_ECHO_LAUNCH(swiglu_backward_vec_kernel, blocks_for(w.rows * (F / 8), 256, grid_cap()), 256,
                    0, s, w.group_offsets, w.groups, w.row_lo, w.rows, F / 8,
                    static_cast<const uint4*>(a.h.data), static_cast<const uint4*>(a.da.data),
                    static_cast<uint4*>(a.dh.data));
    return;
  }
  MOE_ECHO_LAUNCH(swiglu_backward_kernel, blocks_for(w.rows * F, 256, grid_cap()), 256, 0, s,
                  w.group_offsets, w.groups, w.row_lo, w.rows, F, a.h.as<bf16>(), a.da.as<bf16>(),
                  a.dh.as<bf16>());
}

}  // namespace moe_echo::cuda
