// The CUDA backend (bf16 activations and expert weights, fp32 router, accumulation and
// gradients; Hopper sm_90a). Internal header: users reach it through make_backend("cuda"|"auto").
//
// Per-step ops allocate nothing, never synchronise with the host and are capture-safe: a whole
// step (forward, backward, optimizer) can be captured into one CUDA graph on a non-default stream
// and replayed with new inputs. The one exception is run_if outside a capture, which reads its
// flag on the host (inside a capture it is a conditional graph node); enqueue_as_graph runs such
// work as a graph outside a capture too (MoeLayer's eager steps do). Build-time calls (allocate,
// copies to and from the host, synchronize, reserve) may block.
//
// One backend object serves one stream at a time: its ops share a scratch arena (sized in
// reserve()) and the grouped-GEMM schedules, so ops of one backend must not run concurrently on
// two streams (use one backend per stream for that).
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <memory>

#include "moe_echo/backend.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/cuda.hpp"  // device_count, make_local_communicator, CapturedGraph

namespace moe_echo::cuda {

// A backend on the current device.
std::unique_ptr<Backend> make_cuda_backend();

}  // namespace moe_echo::cuda
