// Error checks for CUDA runtime calls: MOE_ECHO_CUDA_CHECK(call) throws moe_echo::Error naming
// the failed call, the error code's name and its description, with file and line. Usable from
// .cpp and .cu files of builds with the CUDA backend (MOE_ECHO_WITH_CUDA); library code never
// exits on a CUDA error.
#pragma once

#include <cuda_runtime.h>

#include "moe_echo/error.hpp"

namespace moe_echo::cuda::detail {

[[noreturn]] void throw_cuda_error(cudaError_t code, const char* what, const char* file, int line);

}  // namespace moe_echo::cuda::detail

#define MOE_ECHO_CUDA_CHECK(call)                                                             \
  MOE_ECHO_STATUS_CHECK(cudaError_t, cudaSuccess, ::moe_echo::cuda::detail::throw_cuda_error, \
                        call, #call)
