// The CUDA backend's per-step ops, one host launcher per op (the kernels live in the .cu files of
// their op family: router_*.cu, layout.cu, planner.cu, swiglu.cu, fan.cu, adamw.cu). Semantics are
// exactly those of the CPU reference ops in src/cpu (the spec), in the CUDA backend's dtypes:
// activations and expert weights bf16; router weights, logits, scores, combine weights, losses,
// gradients and optimizer state f32. Every launcher is capture-safe: it allocates nothing, reads
// nothing back to the host and launches grids sized from host shapes only.
//
// Some ops need temporary device memory ("scratch"), carved from one arena owned by the backend
// (`*_scratch_bytes` say how much). The arena is shared by all ops of a backend, so a backend's
// ops must be ordered on one stream at a time.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "moe_echo/backend.hpp"

namespace moe_echo::cuda {

class GroupedGemm;

// Router (router_products.cu, router_select.cu, router_backward.cu). T tokens, E experts, H hidden.
size_t router_scratch_bytes(int64_t tokens, int64_t experts, int64_t hidden);
// `gemm` (may be null): the grouped GEMM the three f32 products run on as bf16 splits on tensor
// cores where the shapes allow (see router_products.cu); without it they take the FFMA kernels.
void router_forward(const RouterForwardArgs& a, void* scratch, GroupedGemm* gemm, cudaStream_t s);
void router_backward(const RouterBackwardArgs& a, void* scratch, GroupedGemm* gemm, cudaStream_t s);
void router_bias_update(const Tensor& routing_map, const Tensor& bias, double rate, cudaStream_t s);

// Layout (layout.cu): `entries` = T * K routes of this rank.
size_t layout_scratch_bytes(const PlannerConfig& cfg, int slots, int64_t entries);
void layout(const LayoutArgs& a, void* scratch, cudaStream_t s);
void chunk_plan(const ChunkPlanArgs& a, cudaStream_t s);

// Planner (planner.cu): plan_echo / plan_none of src/echo/planner.cpp on the device.
size_t planner_scratch_bytes(const PlannerConfig& cfg);
void plan(const Tensor& routing_map, const PlannerConfig& cfg, bool echo, const Tensor& plan,
          void* scratch, cudaStream_t s);
// plan_placed of src/echo/planner.cpp on the device (placement: i32 [R * S] in device memory).
void plan_placed(const Tensor& routing_map, const PlannerConfig& cfg, const Tensor& placement,
                 const Tensor& plan, void* scratch, cudaStream_t s);

// SwiGLU (swiglu.cu), valid rows of the window only.
void swiglu_forward(const SwigluArgs& a, cudaStream_t s);
void swiglu_backward(const SwigluArgs& a, cudaStream_t s);

// Fan out and fan in over a round's fan table (fan.cu): bf16 rows, f32 weights and d_weight.
// Scratch: the window's list of lead rows.
size_t fan_scratch_bytes(int64_t rows);
void fan_out(const FanArgs& a, void* scratch, cudaStream_t s);
void fan_in(const FanArgs& a, void* scratch, cudaStream_t s);
void fan_out_fp8(const Fp8FanArgs& a, void* scratch, cudaStream_t s);

// AdamW (adamw.cu): param f32 or bf16; grad, m, v f32.
void adamw(const AdamWArgs& a, cudaStream_t s);
void add_i32(const Tensor& t, int32_t value, cudaStream_t s);

// FP8 blockwise quantization (fp8_quant.cu): bf16 in, e4m3 and f32 scales out.
void quantize_fp8_rows(const Fp8RowArgs& a, cudaStream_t s);
void dequantize_fp8_rows(const Fp8RowArgs& a, cudaStream_t s);
void quantize_fp8_blocks(const Fp8BlockArgs& a, cudaStream_t s);
void quantize_fp8_cols(const Fp8ColArgs& a, cudaStream_t s);

// Sets a CUDA-graph conditional handle from a device flag (graph.cu).
void set_conditional_from_flag(unsigned long long handle, const int32_t* flag, cudaStream_t s);

// Carves aligned pieces out of a scratch buffer (host-side pointer arithmetic only).
class ScratchCarver {
 public:
  // base: 256-byte aligned, or nullptr to only measure (used() is then the bytes needed).
  explicit ScratchCarver(void* base) : base_(static_cast<char*>(base)) {}
  template <class T>
  T* take(int64_t n) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += round_up(size_t(n < 0 ? 0 : n) * sizeof(T));
    return p;
  }
  size_t used() const { return used_; }
  static size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace moe_echo::cuda
