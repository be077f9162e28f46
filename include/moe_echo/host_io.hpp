// Host I/O: reading and writing a backend's tensors as host doubles, for build time and tests,
// and the host's one bf16 conversion.
//
// Invariants: read_tensor and write_tensor synchronise the backend (never use them inside a
// step); values convert to and from the tensor's dtype, bf16 through to_bf16 / from_bf16 below.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "moe_echo/backend.hpp"
#include "moe_echo/tensor.hpp"

namespace moe_echo {

// The tensor's elements as doubles.
std::vector<double> read_tensor(Backend& backend, const Tensor& t);
// Writes `values` (one per element) into the tensor, converted to its dtype.
void write_tensor(Backend& backend, const Tensor& t, const std::vector<double>& values);

// f32 -> bf16 bits, rounded to nearest even as __float2bfloat16_rn (a NaN stays a NaN).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// bf16 bits -> f32 (exact).
inline float from_bf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// f32 -> e4m3 (OCP E4M3FN) bits, rounded to nearest even and saturated to +-448 (infinities
// included), a NaN to 0x7F: what CUDA's __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3)
// does.
uint8_t to_e4m3(float f);
// e4m3 bits -> f32 (exact; 0x7F and 0xFF are NaN).
float from_e4m3(uint8_t b);

}  // namespace moe_echo
