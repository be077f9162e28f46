// The barrier of the device-API kernels (nccl_device_comm.cu): every CTA meets the same CTA of
// every peer, as NCCL's LSA barrier does, but no wait is unbounded. A wait for a peer gives up
// when the host raises the abort flag (PeerMonitor found the peer's process gone or stopped) or
// after the wait timeout (a live peer that never arrives), and then records which peer it waited
// for and why, raises the flag itself (so this rank's other waits give up at once), and the CTA's
// sync() returns false: the kernel skips its work and returns. A communicator whose wait gave up
// is unusable; its host side raises the recorded failure at the next op (nccl_base.cu).
//
// Memory:
// - inbox (a symmetric window on every rank): word [index][from] of rank `owner` holds the last
//   epoch rank `from` arrived with at barrier `index`; peers store into it through LSA pointers.
// - epochs (local device memory): word [index] is this rank's epoch of barrier `index`, kept
//   between kernels (each barrier index belongs to one CTA of one kernel type).
// - WaitState (host-mapped): the abort flag both sides raise and the failure the device records.
// - claim (local device memory): elects the one wait that records the failure.
//
// Arrive: a release store of epoch + 1 into every peer's inbox; wait: acquire loads of this
// rank's inbox until every peer's word reached epoch + 1 (modulo 2^32). The clock (%globaltimer)
// and the abort flag (a load over PCIe) are looked at only every kPollsPerLook polls, so a barrier
// whose peers are there costs what NCCL's does.
#pragma once

#include <cuda/atomic>

#include <cstdint>

namespace moe_echo::nccl {

enum WaitFailure : int32_t { kWaitOk = 0, kWaitTimedOut = 1, kWaitAborted = 2 };

// Host-mapped (cudaHostAllocMapped) and zeroed at setup. Plain loads and stores on both sides (a
// GPU's atomics on host memory need hostNativeAtomicSupported, which PCIe hosts lack).
struct WaitState {
  volatile int32_t abort;   // raised by the host (a peer lost) or by a wait that gave up
  volatile int32_t failed;  // WaitFailure of the recorded wait; written last, after a fence
  volatile int32_t peer;    // the rank it waited for
  volatile int32_t where;   // the barrier index it waited at
};

// What every barrier-using kernel takes by value.
struct BarrierArgs {
  uint32_t* epochs = nullptr;  // local, [index]
  int32_t* claim = nullptr;    // local, one word
  WaitState* state = nullptr;  // the device's pointer to the host-mapped state
  uint64_t timeout_ns = 0;     // 0: no time bound (the abort flag only)
  int rank = 0, ranks = 1;
};

constexpr uint32_t kPollsPerLook = 256;

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Records the failure (once per communicator) and raises the abort flag.
__device__ __forceinline__ void give_up(const BarrierArgs& a, WaitFailure why, int peer,
                                        uint32_t index) {
  if (atomicCAS(a.claim, 0, 1) == 0) {
    a.state->peer = peer;
    a.state->where = int32_t(index);
    __threadfence_system();
    a.state->failed = why;
  }
  __threadfence_system();
  a.state->abort = 1;
}

// `Inbox::at(owner, index, from)`: the address of word [index][from] of rank owner's inbox (an LSA
// pointer in the communicator; plain device memory in the tests).
template <class Inbox>
class BoundedBarrier {
 public:
  __device__ BoundedBarrier(const Inbox& inbox, const BarrierArgs& a, uint32_t index)
      : inbox_(inbox), a_(a), index_(index), epoch_(a.epochs[index]) {}
  // The epoch stays with the barrier index for the next kernel of this type (thread 0 writes it
  // after every thread has read it in the constructor: the syncs in between order them).
  __device__ ~BoundedBarrier() {
    if (threadIdx.x == 0) a_.epochs[index_] = epoch_;
  }
  BoundedBarrier(const BoundedBarrier&) = delete;

  // Every thread of the CTA calls it; true on every thread when every peer arrived, false on
  // every thread when a wait gave up (then the state says why).
  __device__ bool sync() {
    __syncthreads();
    const uint32_t next = epoch_ + 1;
    for (int i = int(threadIdx.x); i < a_.ranks - 1; i += int(blockDim.x)) {
      const int peer = i + (a_.rank <= i ? 1 : 0);
      ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system> box(
          *inbox_.at(peer, index_, a_.rank));
      box.store(next, ::cuda::memory_order_release);
    }
    bool gave_up = false;
    for (int i = int(threadIdx.x); i < a_.ranks - 1 && !gave_up; i += int(blockDim.x)) {
      const int peer = i + (a_.rank <= i ? 1 : 0);
      ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system> box(
          *inbox_.at(a_.rank, index_, peer));
      uint64_t start = 0;
      for (uint32_t polls = 1;; ++polls) {
        if (box.load(::cuda::memory_order_acquire) - next <= 0x7fffffffu) break;
        if (polls % kPollsPerLook != 0) continue;
        const uint64_t now = global_ns();
        if (start == 0) start = now;
        if (a_.state->abort) {
          give_up(a_, kWaitAborted, peer, index_);
          gave_up = true;
          break;
        }
        if (a_.timeout_ns && now - start > a_.timeout_ns) {
          give_up(a_, kWaitTimedOut, peer, index_);
          gave_up = true;
          break;
        }
      }
    }
    epoch_ = next;
    return !__syncthreads_or(gave_up);
  }

 private:
  Inbox inbox_;
  BarrierArgs a_;
  uint32_t index_;
  uint32_t epoch_;
};

}  // namespace moe_echo::nccl
