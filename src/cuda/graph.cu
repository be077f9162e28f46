// CUDA-graph conditional nodes for Backend::run_if: a one-thread kernel turns a device flag into
// the value of a conditional handle (cudaGraphSetConditional needs no -rdc).
#include "cuda/common.cuh"
#include "cuda/ops.hpp"

namespace moe_echo::cuda {
namespace {

__global__ void set_conditional_kernel(cudaGraphConditionalHandle handle, const int32_t* flag) {
  cudaGraphSetConditional(handle, *flag != 0 ? 1u : 0u);
}

}  // namespace

void set_conditional_from_flag(unsigned long long handle, const int32_t* flag, cudaStream_t s) {
  MOE_ECHO_LAUNCH(set_conditional_kernel, 1, 1, 0, s, cudaGraphConditionalHandle(handle), flag);
}

}  // namespace moe_echo::cuda
