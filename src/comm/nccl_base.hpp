// What the NCCL communicator types (moe_echo/nccl.hpp) share, and how they divide the work:
//
// - Context (nccl_base.cu): the bootstrap, rank 0's unique id through the host collectives and
//   ncclCommInitRank, the device communicator where the device API is used, window memory (sizes
//   checked equal on every rank first), and the connection of host-API peers at setup.
// - CollectiveOps: all_gather_i32, all_reduce_sum, pull_clone_weights, reduce_clone_grads and the
//   memory of symmetric buffers, one of two kinds:
//   - device API (nccl_device_comm.cu): LSA kernels over NCCL symmetric windows;
//   - host API (nccl_host_comm.cu): ncclAllGather, ncclAllReduce and grouped ncclSend/ncclRecv of
//     clone slots, over plain device memory.
// - NcclCommBase (nccl_base.cu): the Communicator over a Context and CollectiveOps: symmetric
//   buffers, barrier(), every op's argument checks; dispatch and combine are left to the type:
//   - NcclDeviceComm (nccl_device_comm.cu): the sync-free dispatch and combine (LSA kernels), with
//     the device-API collective ops;
//   - NcclHostComm (nccl_host_comm.cu): the baseline dispatch and combine (host-synced, exact-size
//     grouped ncclSend/ncclRecv), with the device-API collective ops on one NVLink team or the
//     host-API ones (host-API mode).
// make_nccl_communicator (nccl_communicator.cu) picks the type and the collective ops from the
// options and the topology, so no op asks which configuration it runs in.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/bounded_barrier.cuh"
#include "moe_echo/comm.hpp"
#include "moe_echo/dist.hpp"
#include "moe_echo/host_collectives.hpp"
#include "moe_echo/nccl.hpp"

namespace moe_echo::nccl {

constexpr int kThreads = 512;  // threads of every barrier kernel
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCtas = 128;     // barrier indices per kernel type
constexpr int kMaxReplicas = 16;  // replicas per expert the clone reduction handles
// Each barrier kernel type owns the barrier indices [range * kMaxCtas, + kMaxCtas).
enum BarrierRange : uint32_t {
  kDispatchBarriers = 0,
  kCombineBarriers,
  kPullBarriers,
  kReduceBarriers,
  kGatherBarriers,
  kAllReduceBarriers,
  kGinSendBarriers,  // the dispatch and combine across nodes (nccl_gin_comm.cu), node barriers
  kGinForwardBarriers,
  kGinReplyBarriers,
  kGinSumBarriers,
  kGinPullBarriers,  // the clone ops across nodes (nccl_gin_comm.cu), node barriers
  kGinReduceBarriers,
  kBarrierRanges
};
constexpr uint32_t barrier_base(BarrierRange r) { return uint32_t(r) * kMaxCtas; }

// The memory of a symmetric buffer: ncclMemAlloc memory registered as an NCCL symmetric window
// (peers' kernels load and store it), or plain cudaMalloc memory (host-API mode: no peer reads
// it; `plain`, no window).
struct Window {
  void* ptr = nullptr;
  size_t bytes = 0;
  ncclWindow_t win = nullptr;
  bool plain = false;
};

// The NCCL communicator of this process's rank, with what it was bootstrapped through.
class Context {
 public:
  // Collective: rank 0's unique id reaches every rank through the bootstrap collectives, then
  // ncclCommInitRank on the current device. The owned collectives and rendezvous (if any) are
  // those `boot` belongs to; they live as long as the context.
  Context(HostCollectives& boot, std::unique_ptr<HostCollectives> owned_boot,
          std::unique_ptr<Rendezvous> owned_rv);
  ~Context();  // the setup stream, the device communicator, the communicator
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  ncclComm_t comm() const { return comm_; }
  HostCollectives& boot() { return boot_; }

  // Collective: the device communicator and the bounded barriers of every kernel type (their
  // inboxes, a symmetric window, and epochs, zeroed on every rank before any rank returns).
  void create_device_comm();
  const ncclDevComm& dev() const { return dev_; }
  // Collective: the device communicator made again with one GIN context of `signals` signals
  // (the windows registered so far stay; NCCL 2.29 or later).
  void enable_gin(int signals);
  // What the barrier kernels take (after create_device_comm()).
  BarrierArgs barrier_args() const;
  ncclWindow_t inbox() const { return inbox_.win; }

  // Throws moe_echo::Error naming the lost peer (or the wait that gave up) once one was found;
  // every op calls it first. A host read: no sync.
  void check_alive();
  // Whether the device communicator's NVLink (LSA) team is the whole world, where LSA rank ==
  // world rank: the device-API kernels address peers by world rank.
  bool lsa_team_is_world() const { return dev_.lsaSize == size_ && dev_.lsaRank == rank_; }

  // Collective: a symmetric window / plain device memory of `bytes` rounded up to 4 KiB. The size
  // is checked equal on every rank through the bootstrap first (a mismatch is an error naming
  // `what`, not an NCCL hang).
  Window make_symmetric_window(size_t bytes, const std::string& what);
  Window make_plain_window(size_t bytes, const std::string& what);
  void release_window(Window& w);

  // Host-API peers connect lazily: one ncclAllReduce of the float at `scratch` (device memory of
  // every rank), waited for, connects them now, so that the first captured (or timed) step does
  // not.
  void connect(void* scratch);

  // t <- sum over ranks (f32 or f64, non-empty) by ncclAllReduce: NCCL's summation order, the
  // same bits on every rank.
  void all_reduce_host_api(const Tensor& t, cudaStream_t s);

 private:
  void check_same_size(size_t bytes, const std::string& what);
  void watch_peers();
  // A peer was found lost (teardown then aborts).
  bool peer_lost() const { return monitor_ && monitor_->lost().has_value(); }
  std::optional<PeerLoss> failed_wait() const;
  void destroy();

  std::unique_ptr<Rendezvous> owned_rv_;         // a rendezvous of its own, if made for it
  std::unique_ptr<HostCollectives> owned_boot_;  // the collectives over owned_rv_ or a caller's
  HostCollectives& boot_;
  int rank_ = 0, size_ = 1, device_ = 0;
  ncclComm_t comm_ = nullptr;
  ncclDevComm dev_{};
  bool have_dev_ = false;
  cudaStream_t setup_stream_ = nullptr;
  WaitState* wait_ = nullptr;      // host-mapped
  WaitState* wait_dev_ = nullptr;  // the device's pointer to it
  uint32_t* epochs_ = nullptr;     // [kBarrierRanges * kMaxCtas] epochs, then the claim word
  Window inbox_;
  uint64_t wait_timeout_ns_ = 0;
  std::unique_ptr<PeerMonitor> monitor_;
};

// The ops other than dispatch and combine, past NcclCommBase's argument checks, and the memory of
// symmetric buffers.
class CollectiveOps {
 public:
  virtual ~CollectiveOps() = default;
  // Whether these are NCCL's host-API ops (host-API mode).
  virtual bool host_api() const = 0;
  // Collective: the memory of a symmetric buffer (see Window).
  virtual Window make_window(size_t bytes, const std::string& what) = 0;
  // 0 <= n <= NcclOptions::max_gather_ints (n == 0 included: a barrier kernel launches anyway).
  virtual void all_gather_i32(const int32_t* local, int32_t* all, int64_t n, cudaStream_t s) = 0;
  // t non-empty, f32 or f64.
  virtual void all_reduce_sum(const Tensor& t, cudaStream_t s) = 0;
  // A plan with spare slots and slot_bytes > 0; `home` holds this rank's E/R home slots.
  virtual void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg,
                                  const Window& home, void* spare, size_t slot_bytes,
                                  cudaStream_t s) = 0;
  // A plan that may hold clones, slot_elems > 0, dtype f32 or f64, max_replicas <= kMaxReplicas.
  virtual void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg,
                                  const Window& spare, void* home, int64_t slot_elems, DType dtype,
                                  cudaStream_t s) = 0;
};

// Collective (each makes its internal windows and connects the peers): the device-API ops (every
// rank in one NVLink team, the device communicator created) and the host-API ones.
std::unique_ptr<CollectiveOps> make_device_collective_ops(Context& ctx, const NcclOptions& o);
// With `symmetric`, make_window gives symmetric windows (what the layer's buffers need where a
// device dispatch reaches them), the ops staying NCCL's host API.
std::unique_ptr<CollectiveOps> make_host_api_collective_ops(Context& ctx, bool symmetric = false);

class NcclCommBase : public Communicator {
 public:
  ~NcclCommBase() override;

  int rank() const final { return ctx_->rank(); }
  int size() const final { return ctx_->size(); }
  ncclComm_t handle() const { return ctx_->comm(); }
  bool host_api() const { return ops_->host_api(); }
  void check_peers() final { ctx_->check_alive(); }

  SymmetricBuffer alloc_symmetric(Backend& backend, size_t bytes) final;
  void free_symmetric(Backend& backend, SymmetricBuffer& buf) final;
  void barrier() final;

  void all_gather_i32(const int32_t* local, int32_t* all, int64_t n, Stream s) final;
  void all_reduce_sum(const Tensor& t, Stream s) final;
  void dispatch(const RowRoute& route, RoundWindow window, const void* src, size_t row_bytes,
                const SymmetricBuffer& recv, const FanTable& fan, Stream s) final;
  void combine(const RowRoute& route, RoundWindow window, const SymmetricBuffer& red,
               const Tensor& y, const int32_t* accumulate, const FanTable& fan, void* values_out,
               Stream s) final;
  void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& home, void* spare, size_t slot_bytes,
                          Stream s) final;
  void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& spare, void* home, int64_t slot_elems, DType dtype,
                          Stream s) final;

 protected:
  NcclCommBase(std::unique_ptr<Context> ctx, std::unique_ptr<CollectiveOps> ops,
               const NcclOptions& o);

  // Dispatch and combine past the argument checks, on the windows of their buffers (`values`:
  // the fan values' window when values_out is given, else nullptr); fdt is the fan table's float
  // dtype (f32 or f64).
  virtual void dispatch_rows(const RowRoute& route, RoundWindow window, const void* src,
                             size_t row_bytes, const Window& recv, const Window& members,
                             const Window& weights, DType fdt, cudaStream_t s) = 0;
  virtual void combine_rows(const RowRoute& route, RoundWindow window, const Window& red,
                            const Tensor& y, const int32_t* accumulate, const Window* values,
                            DType fdt, void* values_out, cudaStream_t s) = 0;

  // This rank's device made current and idle (before anything of a communicator is freed).
  void quiesce() const noexcept;

  Context& ctx() { return *ctx_; }
  const NcclOptions& opts() const { return opts_; }

 private:
  const Window& window_of(const SymmetricBuffer& buf, size_t need, const char* op) const;

  std::unique_ptr<Context> ctx_;
  std::unique_ptr<CollectiveOps> ops_;
  NcclOptions opts_;
  std::vector<Window> windows_;  // by SymmetricBuffer id; freed ones stay as empty entries
};

// Collective: the sync-free communicator (device-API ops throughout; every rank in one NVLink
// team, the device communicator created), and the baseline one over the given collective ops.
std::unique_ptr<Communicator> make_device_comm(std::unique_ptr<Context> ctx, const NcclOptions& o);
std::unique_ptr<Communicator> make_host_comm(std::unique_ptr<Context> ctx,
                                             std::unique_ptr<CollectiveOps> ops,
                                             const NcclOptions& o);
// Whether NCCL joins these ranks with GIN (device-initiated puts and signals) and a device API,
// and the ranks of every NVLink team are consecutive world ranks of one size: what the
// communicator across nodes needs (false when built against NCCL before 2.31). `why` says
// which is missing.
bool gin_ready(Context& ctx, std::string* why);
// Collective: the communicator across nodes (nccl_gin_comm.cu), after gin_ready.
std::unique_ptr<Communicator> make_gin_comm(std::unique_ptr<Context> ctx, const NcclOptions& o);

}  // namespace moe_echo::nccl
