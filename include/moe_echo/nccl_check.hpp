// Error checks for NCCL calls, beside the CUDA ones (cuda_check.hpp): MOE_ECHO_NCCL_CHECK(call)
// throws moe_echo::Error naming the failed call, the ncclResult_t code and its name
// (ncclGetErrorString), and NCCL's last error message where it has one, with file and line. For
// code built against NCCL: throw_nccl_error is defined in the moe_echo_nccl library. Library code
// never exits on an NCCL error.
#pragma once

#include <nccl.h>

#include "moe_echo/error.hpp"

namespace moe_echo::nccl::detail {

[[noreturn]] void throw_nccl_error(ncclResult_t code, const char* what, const char* file, int line);

}  // namespace moe_echo::nccl::detail

#define MOE_ECHO_NCCL_CHECK(call)                                                              \
  MOE_ECHO_STATUS_CHECK(ncclResult_t, ncclSuccess, ::moe_echo::nccl::detail::throw_nccl_error, \
                        call, #call)
