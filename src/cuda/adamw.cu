// AdamW on the GPU (decoupled weight decay, bias correction with the 1-based step), elementwise
// and in place. Semantics: src/cpu/adamw.cpp. grad, m and v are f32; the parameter is f32 (router
// weight) or bf16 (expert weights).
//
// Precision: the math runs in f32. Without a master copy a bf16 parameter is read, updated and
// rounded back to bf16 in one step: an update smaller than half a bf16 ulp of the weight (about
// |w| * 2^-9) is rounded away, so with small learning rates bf16 experts stop learning long
// before f32 ones would. With an f32 master (AdamWArgs::master, MoeConfig::master_weights: 4 more
// bytes per parameter) the master takes the update and the bf16 parameter is its rounding.
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

// The step lives on the device (a captured graph advances it); each block derives the bias
// corrections from it once, in double like the CPU reference.
template <class P>
__global__ void adamw_kernel(int64_t n, P* param, float* master, const float* __restrict__ grad,
                             float* m, float* v, const int32_t* __restrict__ step, float beta1,
                             float beta2, float lr, float eps, float decay) {
  __shared__ float corr[2];
  if (threadIdx.x == 0) {
    const double t = double(*step);
    corr[0] = float(1.0 / (1.0 - pow(double(beta1), t)));
    corr[1] = float(1.0 / sqrt(1.0 - pow(double(beta2), t)));
  }
  __syncthreads();
  const float inv_c1 = corr[0], inv_sqrt_c2 = corr[1];
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float g = grad[i];
    const float mi = beta1 * m[i] + (1.f - beta1) * g;
    const float vi = beta2 * v[i] + (1.f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float update = (mi * inv_c1) / (sqrtf(vi) * inv_sqrt_c2 + eps);
    const float w = (master ? master[i] : load_f(param + i)) * decay - lr * update;
    if (master) master[i] = w;
    store_f(param + i, w);
  }
}

__global__ void add_i32_kernel(int64_t n, int32_t* t, int32_t value) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    t[i] += value;
}

}  // namespace

void add_i32(const Tensor& t, int32_t value, cudaStream_t s) {
  MOE_ECHO_CHECK(t.dtype == DType::i32, "add_i32 on " << t.describe());
  const int64_t n = t.numel();
  if (n == 0) return;
  MOE_ECHO_LAUNCH(add_i32_kernel, blocks_for(n, 256, grid_cap()), 256, 0, s, n, t.as<int32_t>(),
                  value);
}

void adamw(const AdamWArgs& a, cudaStream_t s) {
  const int64_t n = a.param.numel();
  MOE_ECHO_CHECK(a.grad.numel() == n && a.m.numel() == n && a.v.numel() == n,
                 "adamw shapes differ: " << a.param.describe() << ", " << a.grad.describe());
  MOE_ECHO_CHECK(a.grad.dtype == DType::f32 && a.m.dtype == DType::f32 && a.v.dtype == DType::f32,
                 "adamw needs f32 grad, m and v");
  MOE_ECHO_CHECK(a.step.dtype == DType::i32 && a.step.numel() == 1,
                 "adamw step must be i32[1], got " << a.step.describe());
  MOE_ECHO_CHECK(!a.master.data || (a.master.dtype == DType::f32 && a.master.numel() == n),
                 "adamw master must be f32 of the parameter's size, got " << a.master.describe());
  float* master = a.master.data ? a.master.as<float>() : nullptr;
  const unsigned grid = blocks_for(n, 256, grid_cap());
  const float decay = float(1.0 - a.lr * a.weight_decay);
  if (a.param.dtype == DType::bf16)
    MOE_ECHO_LAUNCH(adamw_kernel<bf16>, grid, 256, 0, s, n, a.param.as<bf16>(), master,
                    a.grad.as<float>(), a.m.as<float>(), a.v.as<float>(), a.step.as<int32_t>(),
                    float(a.beta1), float(a.beta2), float(a.lr), float(a.eps), decay);
  else if (a.param.dtype == DType::f32)
    MOE_ECHO_LAUNCH(adamw_kernel<float>, grid, 256, 0, s, n, a.param.as<float>(), master,
                    a.grad.as<float>(), a.m.as<float>(), a.v.as<float>(), a.step.as<int32_t>(),
                    float(a.beta1), float(a.beta2), float(a.lr), float(a.eps), decay);
  else
    MOE_ECHO_CHECK(false, "adamw parameter must be f32 or bf16, got " << a.param.describe());
}

}  // namespace moe_echo::cuda
