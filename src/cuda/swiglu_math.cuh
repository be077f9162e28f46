// SwiGLU's f32 arithmetic on the device, one definition for every kernel that computes it (the
// SwiGLU kernels, and the column quantization that takes SwiGLU's input gradient from its
// inputs), so that they give the same bits. Semantics: src/cpu/swiglu.cpp.
#pragma once

namespace moe_echo::cuda {

__device__ __forceinline__ float sigmoidf_(float v) { return 1.f / (1.f + expf(-v)); }

// The gradients of a = silu(gate) * up with respect to gate and up, from the gradient d of a.
__device__ __forceinline__ void swiglu_grads(float gate, float up, float d, float& dgate,
                                             float& dup) {
  const float sg = sigmoidf_(gate);
  dgate = d * up * sg * (1.f + gate * (1.f - sg));
  dup = d * gate * sg;
}

}  // namespace moe_echo::cuda
