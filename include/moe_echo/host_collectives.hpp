// Expert parallelism over any transport that offers blocking host collectives (torch.distributed
// with gloo, MPI, ...): a Communicator whose every op is built on the three collectives of
// HostCollectives, which the caller implements.
//
// The communicator gives the in-process communicator's results bit for bit (comm.hpp's contract:
// leads and fan table, per-token sums in k order, rank-order all-reduce, clone gradients added in
// replica order), so a MoeLayer over it equals one over InProcessWorld. Peers never touch each
// other's memory: routes, rows and plans are copied to the host, moved by the collectives and
// copied back, all through the Backend's copy_to_host / copy_from_host (host memory on the CPU
// backend; on a device backend those copies synchronise the device, which orders them after the
// step's work already enqueued). Every op therefore waits on the host: capturable() is false and
// a MoeLayer runs its steps op by op. Pieces of a buffer that lie side by side are moved with one
// copy; a device backend still pays one copy per run of adjacent rows.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "moe_echo/backend.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/dist.hpp"

namespace moe_echo {

// Blocking collectives among size() processes (ranks), every rank calling the same ones in the
// same order. All pointers are host memory; send and receive buffers never overlap. An
// implementation throws (or ends the job) on failure; it must not return with partial results.
class HostCollectives {
 public:
  virtual ~HostCollectives() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // recv[r * bytes .. (r + 1) * bytes) <- the `send` of rank r; every rank passes the same
  // `bytes` (torch.distributed.all_gather_into_tensor, MPI_Allgather).
  virtual void all_gather(const void* send, void* recv, size_t bytes) = 0;
  // Segments back to back in rank order on both sides: this rank sends send_bytes[d] bytes to
  // each rank d, from send + send_bytes[0] + ... + send_bytes[d - 1], and receives recv_bytes[s]
  // bytes from each rank s into recv + recv_bytes[0] + ... + recv_bytes[s - 1]. Both vectors
  // have size() entries; recv_bytes[s] equals rank s's send_bytes[rank()] (the communicator
  // knows it from an earlier all_gather of counts). Segments may be empty, the one to this rank
  // itself included (torch.distributed.all_to_all_single with split sizes, MPI_Alltoallv).
  virtual void all_to_all_v(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                            const std::vector<size_t>& recv_bytes) = 0;
  // Returns once every rank has called it.
  virtual void barrier() = 0;
};

// A Communicator of collectives.size() ranks over `collectives` and `backend` (neither owned;
// both must outlive it). Symmetric buffers are allocated through `backend`: alloc_symmetric and
// free_symmetric must be given the same Backend object, and every buffer an op reads or writes
// (its own and its arguments: route, rows, tensors, plan) is memory of `backend`. Throws
// ConfigError when the collectives' rank or size is out of range.
//
// The collectives each op calls, in order (every rank the same ones):
//   alloc_symmetric      all_gather (the sizes, so that a mismatch throws on every rank)
//   free_symmetric       none
//   barrier              barrier
//   all_gather_i32       all_gather
//   all_reduce_sum       all_gather (summed on every rank in rank order)
//   dispatch             all_gather (lead counts), all_to_all_v (rows with members and weights)
//   combine              all_gather (counts), all_to_all_v (row requests), all_to_all_v (rows)
//   pull_clone_weights   all_to_all_v (clone slots; none without spare slots or clones)
//   reduce_clone_grads   all_to_all_v (clone gradients; the same)
std::unique_ptr<Communicator> make_host_collectives_communicator(HostCollectives& collectives,
                                                                 Backend& backend);

// HostCollectives over a Rendezvous (not owned; it must outlive the result): the rendezvous's TCP
// store moves every byte, all_to_all_v by sending each rank's whole send buffer to every rank.
// For setup (the NCCL communicator's bootstrap) and tests, not a step's hot path.
std::unique_ptr<HostCollectives> make_rendezvous_collectives(Rendezvous& rendezvous);

}  // namespace moe_echo
