// The CPU reference ops, one function per op, templated on the element type T (float or
// double). Every activation, weight and probability is a T; sums accumulate in double.
// These are the specification every CUDA kernel is tested against: plain loops a reader can
// check by eye, no tiling, no threads.
#pragma once

#include "moe_echo/backend.hpp"

namespace moe_echo::cpu {

// The ops of one argument struct, templated on T, as X(op, Args): declared here, each defined in
// its op family's file and instantiated there for float and double (MOE_ECHO_CPU_INSTANTIATE),
// and called by CpuBackend in its dtype. The FP8 quantizers read x and w of element type T as
// float; the FP8 grouped GEMMs (backend.hpp, Fp8GemmArgs) decode their e4m3 operands exactly, sum
// each 128-block of the reduction in double, scale it by its two scales, and write T (wgrad: T's
// float).
#define MOE_ECHO_CPU_TYPED_OPS(X)        \
  X(router_forward, RouterForwardArgs)   \
  X(router_backward, RouterBackwardArgs) \
  X(gemm_fprop, GemmArgs)                \
  X(gemm_dgrad, GemmArgs)                \
  X(gemm_wgrad, GemmArgs)                \
  X(swiglu_forward, SwigluArgs)          \
  X(swiglu_backward, SwigluArgs)         \
  X(fan_out, FanArgs)                    \
  X(fan_in, FanArgs)                     \
  X(adamw, AdamWArgs)                    \
  X(quantize_fp8_rows, Fp8RowArgs)       \
  X(dequantize_fp8_rows, Fp8RowArgs)     \
  X(quantize_fp8_blocks, Fp8BlockArgs)   \
  X(quantize_fp8_cols, Fp8ColArgs)       \
  X(gemm_fp8_fprop, Fp8GemmArgs)         \
  X(gemm_fp8_dgrad, Fp8GemmArgs)         \
  X(gemm_fp8_wgrad, Fp8GemmArgs)

#define MOE_ECHO_CPU_DECLARE(op, Args) \
  template <class T>                   \
  void op(const Args& a);
MOE_ECHO_CPU_TYPED_OPS(MOE_ECHO_CPU_DECLARE)
#undef MOE_ECHO_CPU_DECLARE

// op<float> and op<double>, in the file that defines op.
#define MOE_ECHO_CPU_INSTANTIATE(op, Args) \
  template void op<float>(const Args&);    \
  template void op<double>(const Args&)

// The other ops.
template <class T>
void router_bias_update(const Tensor& routing_map, const Tensor& bias, double rate);
void layout(const LayoutArgs& a);
void chunk_plan(const ChunkPlanArgs& a);
void fan_out_fp8(const Fp8FanArgs& a);

// Rows [begin, end) of the window that group g owns (window-relative), and the valid rows of the
// window (groups are contiguous from receive row 0, so valid rows are a prefix).
struct RowRange {
  int64_t begin, end;
};
RowRange group_rows(const GroupWindow& w, int g);
int64_t valid_rows(const GroupWindow& w);

}  // namespace moe_echo::cpu
