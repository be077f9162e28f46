// AdamW on the GPU (decoupled weight decay, bias correction with the 1-based step), elementwise
// and in place. Semantics: src/cpu/adamw.cpp. grad, m and v are f32; the parameter is f32 (router
// weight) or bf16 (expert weights).
//
// Precision trade-off: the math runs in f32 and a bf16 parameter is read, updated and rounded back
// to bf16 in one step; there is no f32 master copy. An update smaller than half a bf16 ulp of the
// weight (about |w| * 2^-9) is rounded away, so with small learning rates bf16 experts stop
// learning long before f32 ones would; m and v keep full f32 state, so nothing else drifts. A
// training setup that needs exact small updates keeps f32 master weights (3 extra bytes per
// parameter) or adds stochastic rounding; the layer here trades that for memory.
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

template <class P>
__global__ void adamw_kernel(int64_t n, P* param, const float* __restrict__ grad, float* m,
                             float* v, float beta1, float beta2, float inv_c1, float inv_sqrt_c2,
                             float lr, float eps, float decay) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float g = grad[i];
    const float mi = beta1 * m[i] + (1.f - beta1) * g;
    const float vi = beta2 * v[i] + (1.f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float update = (mi * inv_c1) / (sqrtf(vi) * inv_sqrt_c2 + eps);
    store_f(param + i, load_f(param + i) * decay - lr * update);
  }
}

}  // namespace

void adamw(const AdamWArgs& a, cudaStream_t s) {
  const int64_t n = a.param.numel();
  MOE_ECHO_CHECK(a.grad.numel() == n && a.m.numel() == n && a.v.numel() == n,
                 "adamw shapes differ: " << a.param.describe() << ", " << a.grad.describe());
  MOE_ECHO_CHECK(a.grad.dtype == DType::f32 && a.m.dtype == DType::f32 && a.v.dtype == DType::f32,
                 "adamw needs f32 grad, m and v");
  const double c1 = 1.0 - std::pow(a.beta1, double(a.step));
  const double c2 = 1.0 - std::pow(a.beta2, double(a.step));
  const unsigned grid = blocks_for(n, 256, grid_cap());
  const float inv_c1 = float(1.0 / c1), inv_sqrt_c2 = float(1.0 / std::sqrt(c2));
  const float decay = float(1.0 - a.lr * a.weight_decay);
  if (a.param.dtype == DType::bf16)
    MOE_ECHO_LAUNCH(adamw_kernel<bf16>, grid, 256, 0, s, n, a.param.as<bf16>(), a.grad.as<float>(),
                    a.m.as<float>(), a.v.as<float>(), float(a.beta1), float(a.beta2), inv_c1,
                    inv_sqrt_c2, float(a.lr), float(a.eps), decay);
  else if (a.param.dtype == DType::f32)
    MOE_ECHO_LAUNCH(adamw_kernel<float>, grid, 256, 0, s, n, a.param.as<float>(),
                    a.grad.as<float>(), a.m.as<float>(), a.v.as<float>(), float(a.beta1),
                    float(a.beta2), inv_c1, inv_sqrt_c2, float(a.lr), float(a.eps), decay);
  else
    MOE_ECHO_CHECK(false, "adamw parameter must be f32 or bf16, got " << a.param.describe());
}

}  // namespace moe_echo::cuda
