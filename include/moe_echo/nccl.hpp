// The multi-GPU communicator on NCCL 2.28: one process per GPU, every Communicator op of
// include/moe_echo/comm.hpp with exactly the semantics of the in-process reference
// (src/comm/in_process.cpp), enqueued on the caller's stream.
//
// Sync-free path (the default): symmetric buffers are ncclMemAlloc memory registered as NCCL
// symmetric windows when a layer is built; per-step ops are kernels of the NCCL device API that
// load and store peers' windows over NVLink (LSA pointers), bracketed by barriers. They never
// wait on the host, allocate nothing and are CUDA-graph capturable, conditional-node bodies
// included. Every rank must enqueue the same ops in the same order with the same shapes. No
// device wait is unbounded: a wait gives up when the communicator's PeerMonitor (dist.hpp) finds a
// peer's process on this host gone or stopped, or after MOE_ECHO_TIMEOUT_S (a live peer that
// skipped an op, or one on another host); the op's kernel then returns without its work and every
// later op of the communicator throws moe_echo::Error naming the peer (docs/launch.md).
//
// Dispatch and combine move one row per (token, destination rank) of a round window (the lead
// row, comm.hpp): the dispatch writes the fan table on the receiver with the row, the receiver
// fans it out and in, and the combine pulls one pre-reduced row per rank and sums them.
//
// Baseline path (Dispatcher::baseline): dispatch and combine as most frameworks do them: routes
// copied to the host, counts exchanged (ncclAllGather, then a host sync), rows packed per
// destination and moved with exact-size grouped ncclSend/ncclRecv. The same rows as the
// sync-free path (leads found on the host; each lead's members and weights travel with its row)
// and the same sums in the same order, so both give the same bits. Not capturable; kept for
// comparison. Its combine exchanges per-entry values only where values_out is given, so every
// rank must pass one or none. The other ops are those of the sync-free path.
//
// Host-API mode (NcclOptions::host_api, or on its own when the ranks span more than one NVLink
// (LSA) team and the baseline dispatcher is chosen): every op on NCCL's host API over plain
// device memory, so it runs wherever NCCL runs, across nodes included: no device communicator
// and no windows; the count all-gather is ncclAllGather, the all-reduce ncclAllReduce, dispatch
// and combine the baseline's, and the clone weight pull and gradient reduction grouped
// ncclSend/ncclRecv of whole slots after the plan is copied to the host (one sync each). The
// same bits as the sync-free path except the all-reduce (NCCL's order, the same on every rank).
//
// The sync-free path needs every rank in one NVLink team: across nodes the device API needs a
// GIN-capable network, which this communicator does not use; construction with the sync-free
// dispatcher throws there, naming the baseline dispatcher as the way across nodes.
//
// Implementation (src/comm/nccl_base.hpp): two communicator types over one bootstrap and window
// code, picked by make_nccl_communicator from the options and the NVLink team, so that no op
// branches on a mode. The sync-free dispatcher is the device-API type (every op a kernel); the
// baseline dispatcher is the host-API type (host-synced dispatch and combine), whose other ops
// are the device API's kernels on one NVLink team and NCCL's host API in host-API mode.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "moe_echo/comm.hpp"
#include "moe_echo/dist.hpp"
#include "moe_echo/host_collectives.hpp"

namespace moe_echo {

enum class Dispatcher { syncfree, baseline };
const char* to_string(Dispatcher d);
// "syncfree" or "baseline"; ConfigError naming `field` otherwise.
Dispatcher parse_dispatcher(const std::string& text, const std::string& field);

struct NcclOptions {
  Dispatcher dispatcher = Dispatcher::syncfree;
  // Largest n of all_gather_i32 (ints per rank); sizes a symmetric window of size * n ints.
  int64_t max_gather_ints = 1 << 14;
  // all_reduce_sum of tensors up to this many bytes runs as an LSA kernel that sums in double in
  // rank order (the in-process communicator's bits exactly); larger ones go to ncclAllReduce
  // (the same bits on every rank, NCCL's summation order).
  size_t all_reduce_staging_bytes = size_t(16) << 20;
  // CTAs of every row-moving kernel, 1..128 (512 threads each; the same on every rank). 128
  // moved rows 3-6% faster than 64 on 2 H200s (bench/nccl_comm_bench.cu).
  int ctas = 128;
  // Every op on NCCL's host API (see above) even when the ranks share one NVLink team, as they
  // would across nodes; needs the baseline dispatcher.
  bool host_api = false;
  // The sync-free dispatcher across nodes (NCCL's GIN, docs/multigpu.md) stages what crosses
  // nodes in a window sized for at most gin_max_tokens tokens a call, of rows of at most
  // gin_max_row_bytes bytes; a call past either is refused, naming the option. The environment's
  // MOE_ECHO_GIN_MAX_TOKENS and MOE_ECHO_GIN_MAX_ROW_BYTES replace them where set.
  int64_t gin_max_tokens = 4096;
  size_t gin_max_row_bytes = 16384;
  // Across nodes, clone weights and gradients move between nodes through a window of
  // gin_clone_slots slots of gin_clone_slot_bytes bytes (a slot a clone at a time, in a
  // pipeline), by device kernels with no host sync, so that the communicator is capturable. With
  // gin_clone_slot_bytes 0 (the default) they move by NCCL's host API after the plan is copied to
  // the host (a host sync; the communicator is then not capturable). A clone op whose slot is
  // larger is refused, naming the option. MOE_ECHO_GIN_CLONE_SLOT_BYTES and
  // MOE_ECHO_GIN_CLONE_SLOTS replace them where set.
  size_t gin_clone_slot_bytes = 0;
  int gin_clone_slots = 2;
};

// Makes GPU `env.local_rank` this thread's current device and returns its index. Throws
// ConfigError when the process sees fewer GPUs than LOCAL_RANK + 1.
int select_device(const DistEnv& env);

// Builds the communicator of this process's rank: NCCL unique id from rank 0 through the
// rendezvous, ncclCommInitRank on the current device, the device communicator and the barriers'
// inboxes (not in host-API mode), the PeerMonitor over the ranks' processes, the type the options
// and the NVLink team call for (above) and its internal windows. Collective and blocking: every
// rank calls it at the same point. The rendezvous must outlive the communicator (barrier() uses
// it).
std::unique_ptr<Communicator> make_nccl_communicator(Rendezvous& rendezvous,
                                                     const NcclOptions& options = {});
// The same with a rendezvous of its own, from the launcher's variables.
std::unique_ptr<Communicator> make_nccl_communicator(const DistEnv& env,
                                                     const NcclOptions& options = {});
// The same bootstrapped through any host collectives (not owned; they must outlive the
// communicator): the unique id travels in one all_gather, the symmetric buffer sizes are checked
// with all_gather, barrier() is theirs. The ranks are the collectives' rank() and size(); an
// NCCL process group of torch.distributed serves (moe_echo.torch), so no extra port is opened.
// Only setup and barrier() call the collectives, never a step's op.
std::unique_ptr<Communicator> make_nccl_communicator(HostCollectives& bootstrap,
                                                     const NcclOptions& options = {});

// The version of the NCCL library this process runs (ncclGetVersion: 23203 for 2.32.3), which
// may differ from the headers it was built with; PyTorch's NCCL in the same process is this one.
int nccl_runtime_version();

// The ncclComm_t behind an NCCL communicator (as void*), or nullptr for any other Communicator.
// For benchmarks that run NCCL's own collectives next to ours.
void* nccl_comm_handle(Communicator& comm);
// Whether an NCCL communicator runs every op on the host API (host-API mode above).
bool nccl_uses_host_api(Communicator& comm);

}  // namespace moe_echo
