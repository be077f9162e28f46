// One FP8 tile's quantization on the device (backend.hpp's definition; src/cpu/fp8_quant.cpp the
// reference): e4m3 conversion, the tile's scale and multiplier, four values as one word.
#pragma once

#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

namespace moe_echo::cuda {

__device__ __forceinline__ uint8_t e4m3(float v) {
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// A tile's scale s = max(amax / 448, FLT_MIN) (1 for a tile of zeros: s stays a normal float, so
// its multiplier 1 / s, one IEEE division per tile, is finite): a value x is stored as
// e4m3(x * (1 / s)).
struct TileQuant {
  float s, inv;
  __device__ __forceinline__ explicit TileQuant(float amax)
      : s(amax > 0.f ? fmaxf(amax / 448.f, FLT_MIN) : 1.f), inv(1.f / s) {}
  __device__ __forceinline__ uint8_t operator()(float x) const { return e4m3(x * inv); }
};

// The e4m3 bytes of two values (a lower), one conversion instruction for the pair.
__device__ __forceinline__ uint32_t e4m3x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// The e4m3 bytes of a, b, c, d in one tile as one word (a lowest).
__device__ __forceinline__ uint32_t e4m3x4(const TileQuant& t, float a, float b, float c, float d) {
  return e4m3x2(a * t.inv, b * t.inv) | e4m3x2(c * t.inv, d * t.inv) << 16;
}

}  // namespace moe_echo::cuda
