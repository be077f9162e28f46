// The CUDA backend (bf16 activations and expert weights, fp32 router, accumulation and
// gradients; Hopper sm_90a). Internal header: users reach it through make_backend("cuda"|"auto").
//
// Per-step ops allocate nothing, never synchronise with the host and are capture-safe: a whole
// step (forward, backward, optimizer) can be captured into one CUDA graph on a non-default stream
// and replayed with new inputs. The one exception is run_if outside a capture, which reads its
// flag on the host (inside a capture it is a conditional graph node). Build-time calls (allocate,
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

namespace moe_echo::cuda {

// GPUs visible to this process; 0 (not an error) when there is no GPU or no driver.
int device_count();

// A backend on the current device.
std::unique_ptr<Backend> make_cuda_backend();

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
