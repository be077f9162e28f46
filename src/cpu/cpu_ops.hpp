// The CPU reference ops, one function per op, templated on the element type T (float or
// double). Every activation, weight and probability is a T; sums accumulate in double.
// These are the specification every CUDA kernel is tested against: plain loops a reader can
// check by eye, no tiling, no threads.
#pragma once

#include "moe_echo/backend.hpp"

namespace moe_echo::cpu {

template <class T>
void router_forward(const RouterForwardArgs& a);
template <class T>
void router_backward(const RouterBackwardArgs& a);
template <class T>
void router_bias_update(const Tensor& routing_map, const Tensor& bias, double rate);
void layout(const LayoutArgs& a);
void chunk_plan(const ChunkPlanArgs& a);
template <class T>
void gemm_fprop(const GemmArgs& a);
template <class T>
void gemm_dgrad(const GemmArgs& a);
template <class T>
void gemm_wgrad(const GemmArgs& a);
template <class T>
void swiglu_forward(const SwigluArgs& a);
template <class T>
void swiglu_backward(const SwigluArgs& a);
template <class T>
void fan_out(const FanArgs& a);
template <class T>
void fan_in(const FanArgs& a);
void fan_out_fp8(const Fp8FanArgs& a);
template <class T>
void adamw(const AdamWArgs& a);
// FP8 quantization (backend.hpp): x and w of element type T, read as float.
template <class T>
void quantize_fp8_rows(const Fp8RowArgs& a);
template <class T>
void dequantize_fp8_rows(const Fp8RowArgs& a);
template <class T>
void quantize_fp8_blocks(const Fp8BlockArgs& a);
template <class T>
void quantize_fp8_cols(const Fp8ColArgs& a);
// FP8 grouped GEMMs (backend.hpp, Fp8GemmArgs): e4m3 operands decoded exactly, each 128-block of
// the reduction summed in double and scaled by its two scales; out in T (wgrad: T's float).
template <class T>
void gemm_fp8_fprop(const Fp8GemmArgs& a);
template <class T>
void gemm_fp8_dgrad(const Fp8GemmArgs& a);
template <class T>
void gemm_fp8_wgrad(const Fp8GemmArgs& a);

// Rows [begin, end) of the window that group g owns (window-relative), and the valid rows of the
// window (groups are contiguous from receive row 0, so valid rows are a prefix).
struct RowRange {
  int64_t begin, end;
};
RowRange group_rows(const GroupWindow& w, int g);
int64_t valid_rows(const GroupWindow& w);

}  // namespace moe_echo::cpu
