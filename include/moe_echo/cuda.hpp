// The CUDA entry points a user of the library needs besides make_backend("cuda"): device
// queries, the single-GPU communicator, and capturing a step into a CUDA graph. Available in
// builds with the CUDA backend (MOE_ECHO_WITH_CUDA); the NCCL communicator is in moe_echo/nccl.hpp
// (builds with NCCL, MOE_ECHO_WITH_NCCL).
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <memory>

#include "moe_echo/comm.hpp"

namespace moe_echo::cuda {

// GPUs visible to this process; 0 (not an error) when there is no GPU or no driver.
int device_count();
// The calling thread's current device.
int current_device();

// The communicator of a single GPU (EP size 1: rank 0 of 1), for MoeLayer on the CUDA backend
// without NCCL. Symmetric buffers are plain cudaMalloc memory of the backend passed to
// alloc_symmetric; every per-step op is a device copy or kernel on the given stream.
std::unique_ptr<Communicator> make_local_communicator();

// A CUDA graph captured from the work `enqueue` puts on `stream` (which must be a stream other
// than the legacy default stream, e.g. created with cudaStreamNonBlocking), instantiated once and
// replayed with launch(). Everything the work reads (inputs, parameters) is read from device
// memory at replay time, so new values written into the same buffers take effect.
class CapturedGraph {
 public:
  CapturedGraph(cudaStream_t stream, const std::function<void()>& enqueue);
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  void launch(cudaStream_t stream);
  // Nodes of the captured graph at the top level (conditional bodies count as one node each).
  size_t top_level_nodes() const;
  // Conditional nodes at the top level (one per spill round that may run).
  size_t conditional_nodes() const;

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace moe_echo::cuda
