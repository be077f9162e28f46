// What the NCCL communicator types share (nccl_base.hpp): the bootstrap, window memory, the
// symmetric buffers and every op's argument checks (comm_args.hpp's, and the windows' own).
#include "comm/nccl_base.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "comm/comm_args.hpp"
#include "cuda/common.cuh"
#include "moe_echo/config.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/nccl_check.hpp"

namespace moe_echo {

namespace nccl::detail {

void throw_nccl_error(ncclResult_t code, const char* what, const char* file, int line) {
  std::ostringstream s;
  s << "NCCL error " << int(code) << " (" << ncclGetErrorString(code) << ") in " << what;
  const char* last = ncclGetLastError(nullptr);
  if (last && *last) s << ": " << last;
  ::moe_echo::detail::fail(file, line, s.str());
}

}  // namespace nccl::detail

namespace nccl {
namespace {

size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }

constexpr size_t kProcessIdBytes = 256;  // a ProcessId's bytes, zero-padded, through all_gather
constexpr int kBarriers = int(kBarrierRanges) * kMaxCtas;

const char* barrier_op(int32_t index) {
  switch (index / kMaxCtas) {
    case kDispatchBarriers: return "dispatch";
    case kCombineBarriers: return "combine";
    case kPullBarriers: return "clone weight pull";
    case kReduceBarriers: return "clone gradient reduction";
    case kGatherBarriers: return "count all-gather";
    case kAllReduceBarriers: return "all-reduce";
    case kGinSendBarriers: return "dispatch across nodes (send, credits)";
    case kGinForwardBarriers: return "dispatch across nodes (forward, the sources' messages)";
    case kGinReplyBarriers: return "combine across nodes (reply, the requests)";
    case kGinSumBarriers: return "combine across nodes (sum, the replies)";
    case kGinPullBarriers: return "clone weight pull across nodes";
    case kGinReduceBarriers: return "clone gradient reduction across nodes";
    default: return "an unknown op";
  }
}

}  // namespace

// ---- Context ----------------------------------------------------------------------------------

Context::Context(HostCollectives& boot, std::unique_ptr<HostCollectives> owned_boot,
                 std::unique_ptr<Rendezvous> owned_rv)
    : owned_rv_(std::move(owned_rv)), owned_boot_(std::move(owned_boot)), boot_(boot) {
  rank_ = boot_.rank();
  size_ = boot_.size();
  MOE_ECHO_CUDA_CHECK(cudaGetDevice(&device_));
  // The unique id of rank 0 reaches every rank through an all-gather of one id per rank (the
  // other ranks' entries are zeros and unused).
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (rank_ == 0) MOE_ECHO_NCCL_CHECK(ncclGetUniqueId(&id));
  Bytes ids(size_t(size_) * sizeof id);
  boot_.all_gather(&id, ids.data(), sizeof id);
  std::memcpy(&id, ids.data(), sizeof id);
  MOE_ECHO_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
  try {
    watch_peers();
  } catch (...) {
    destroy();
    throw;
  }
}

Context::~Context() { destroy(); }

void Context::watch_peers() {
  PeerMonitor::Options watch;
  watch.raised_grace = lost_peer_exit();  // MOE_ECHO_LOST_PEER_EXIT_S
  MOE_ECHO_CUDA_CHECK(
      cudaHostAlloc(reinterpret_cast<void**>(&wait_), sizeof(WaitState), cudaHostAllocMapped));
  std::memset(static_cast<void*>(wait_), 0, sizeof(WaitState));
  MOE_ECHO_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&wait_dev_), wait_, 0));
  wait_timeout_ns_ = uint64_t(std::chrono::nanoseconds(default_timeout()).count());
  // Every rank's process id.
  const Bytes mine = ProcessId::self().to_bytes();
  MOE_ECHO_CHECK(mine.size() + 8 <= kProcessIdBytes, "process id of " << mine.size() << " bytes");
  Bytes local(kProcessIdBytes, 0), all(size_t(size_) * kProcessIdBytes);
  const uint64_t n = mine.size();
  std::memcpy(local.data(), &n, 8);
  std::memcpy(local.data() + 8, mine.data(), mine.size());
  boot_.all_gather(local.data(), all.data(), kProcessIdBytes);
  std::vector<ProcessId> ids;
  for (int r = 0; r < size_; ++r) {
    const uint8_t* p = all.data() + size_t(r) * kProcessIdBytes;
    uint64_t len = 0;
    std::memcpy(&len, p, 8);
    MOE_ECHO_CHECK(len + 8 <= kProcessIdBytes, "rank " << r << "'s process id");
    ids.push_back(ProcessId::from_bytes(Bytes(p + 8, p + 8 + len)));
  }
  WaitState* state = wait_;
  monitor_ = std::make_unique<PeerMonitor>(
      rank_, std::move(ids), [this] { return failed_wait(); },
      [state](const PeerLoss&) { state->abort = 1; }, watch);
}

std::optional<PeerLoss> Context::failed_wait() const {
  const int32_t why = wait_->failed;
  if (why == kWaitOk) return std::nullopt;
  const int peer = wait_->peer;
  std::ostringstream m;
  if (why == kWaitTimedOut)
    m << "rank " << peer << " did not arrive at the " << barrier_op(wait_->where)
      << " barrier within " << double(wait_timeout_ns_) * 1e-9
      << " s (MOE_ECHO_TIMEOUT_S; its process is alive or not on this host)";
  else
    m << "this rank's wait for rank " << peer << " at the " << barrier_op(wait_->where)
      << " barrier was aborted";
  return PeerLoss{PeerLoss::Kind::other, peer, 0, m.str()};
}

void Context::check_alive() {
  std::optional<PeerLoss> loss = monitor_ ? monitor_->lost() : std::nullopt;
  if (!loss) {
    // An error NCCL met on its own threads (a proxy, GIN's progress) fails the next op.
    ncclResult_t async = ncclSuccess;
    if (comm_ && ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess &&
        async != ncclInProgress)
      throw Error("NCCL communicator, rank " + std::to_string(rank_) + " of " +
                  std::to_string(size_) + ": NCCL reported " + ncclGetErrorString(async) +
                  " on its own threads (" + ncclGetLastError(comm_) +
                  "); the communicator is unusable");
    return;
  }
  monitor_->consume();
  std::ostringstream m;
  m << "NCCL communicator, rank " << rank_ << " of " << size_ << ": " << loss->message;
  if (loss->kind != PeerLoss::Kind::other && wait_->failed != kWaitOk)
    m << " (this rank's wait for it at the " << barrier_op(wait_->where) << " barrier gave up)";
  m << "; the communicator is unusable";
  throw Error(m.str());
}

BarrierArgs Context::barrier_args() const {
  BarrierArgs a;
  a.epochs = epochs_;
  a.claim = reinterpret_cast<int32_t*>(epochs_ + kBarriers);
  a.state = wait_dev_;
  a.timeout_ns = wait_timeout_ns_;
  a.rank = rank_;
  a.ranks = size_;
  return a;
}

void Context::destroy() {
  const bool lost = peer_lost();
  if (setup_stream_) (void)cudaStreamDestroy(setup_stream_);
  setup_stream_ = nullptr;
  if (lost) {
    // A peer is gone: NCCL's collective teardown would wait for it. The windows' memory stays
    // to the process's exit (freeing memory a peer's mapping may still name is not worth it).
    if (comm_) (void)ncclCommAbort(comm_);
  } else {
    release_window(inbox_);
    if (have_dev_) (void)ncclDevCommDestroy(comm_, &dev_);
    if (comm_) (void)ncclCommDestroy(comm_);
  }
  have_dev_ = false;
  comm_ = nullptr;
  if (epochs_) (void)cudaFree(epochs_);
  epochs_ = nullptr;
  monitor_.reset();  // after the device is idle: the waits it can end are over
  if (wait_) (void)cudaFreeHost(wait_);
  wait_ = wait_dev_ = nullptr;
}

void Context::create_device_comm() {
  // No NCCL barriers (ours are in bounded_barrier.cuh), no GIN. NCCL 2.29 and later refuse
  // requirements not made by their initializer (it stamps size, magic and version); 2.28 has none.
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
  ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  ncclDevCommRequirements reqs;
  std::memset(&reqs, 0, sizeof reqs);
#endif
  MOE_ECHO_NCCL_CHECK(ncclDevCommCreate(comm_, &reqs, &dev_));
  have_dev_ = true;
  inbox_ = make_symmetric_window(size_t(kBarriers) * size_t(size_) * sizeof(uint32_t),
                                 "the barrier inboxes");
  MOE_ECHO_CUDA_CHECK(cudaMemset(inbox_.ptr, 0, inbox_.bytes));
  const size_t epoch_bytes = size_t(kBarriers + 1) * sizeof(uint32_t);
  MOE_ECHO_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&epochs_), epoch_bytes));
  MOE_ECHO_CUDA_CHECK(cudaMemset(epochs_, 0, epoch_bytes));
  MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
  boot_.barrier();  // no rank arrives at a barrier before every inbox is zero
}

void Context::enable_gin(int signals) {
  MOE_ECHO_CHECK(have_dev_, "enable_gin: no device communicator");
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
  ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
  reqs.ginConnectionType = NCCL_GIN_CONNECTION_FULL;
  reqs.ginContextCount = 1;
  reqs.ginSignalCount = signals;
  reqs.ginVaSignalsRequired = false;
  MOE_ECHO_NCCL_CHECK(ncclDevCommDestroy(comm_, &dev_));
  have_dev_ = false;
  MOE_ECHO_NCCL_CHECK(ncclDevCommCreate(comm_, &reqs, &dev_));
  have_dev_ = true;
#else
  throw Error("enable_gin: built against NCCL " + std::to_string(NCCL_VERSION_CODE) +
              ", which has no GIN requirements (" + std::to_string(signals) + " signals asked)");
#endif
}

void Context::check_same_size(size_t bytes, const std::string& what) {
  const uint64_t want = bytes;
  std::vector<uint64_t> all(static_cast<size_t>(size_));
  boot_.all_gather(&want, all.data(), sizeof want);
  for (int r = 0; r < size_; ++r) {
    const uint64_t theirs = all[size_t(r)];
    MOE_ECHO_CHECK(theirs == want, what << ": rank " << r << " allocates " << theirs
                                        << " bytes, rank " << rank_ << " " << want);
  }
}

Window Context::make_symmetric_window(size_t bytes, const std::string& what) {
  check_same_size(bytes, what);
  Window w;
  w.bytes = round_up(std::max<size_t>(bytes, 1), 4096);
  MOE_ECHO_NCCL_CHECK(ncclMemAlloc(&w.ptr, w.bytes));
  MOE_ECHO_NCCL_CHECK(
      ncclCommWindowRegister(comm_, w.ptr, w.bytes, &w.win, NCCL_WIN_COLL_SYMMETRIC));
  return w;
}

Window Context::make_plain_window(size_t bytes, const std::string& what) {
  check_same_size(bytes, what);
  Window w;
  w.bytes = round_up(std::max<size_t>(bytes, 1), 4096);
  MOE_ECHO_CUDA_CHECK(cudaMalloc(&w.ptr, w.bytes));
  w.plain = true;
  return w;
}

void Context::release_window(Window& w) {
  if (!w.ptr) return;
  if (peer_lost()) {  // see destroy()
    w = Window{};
    return;
  }
  if (w.plain) {
    (void)cudaFree(w.ptr);
  } else {
    if (w.win) (void)ncclCommWindowDeregister(comm_, w.win);
    (void)ncclMemFree(w.ptr);
  }
  w = Window{};
}

void Context::connect(void* scratch) {
  if (!setup_stream_)
    MOE_ECHO_CUDA_CHECK(cudaStreamCreateWithFlags(&setup_stream_, cudaStreamNonBlocking));
  MOE_ECHO_NCCL_CHECK(
      ncclAllReduce(scratch, scratch, 1, ncclFloat32, ncclSum, comm_, setup_stream_));
  MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(setup_stream_));
}

void Context::all_reduce_host_api(const Tensor& t, cudaStream_t s) {
  MOE_ECHO_NCCL_CHECK(ncclAllReduce(t.data, t.data, size_t(t.numel()),
                                    t.dtype == DType::f32 ? ncclFloat32 : ncclFloat64, ncclSum,
                                    comm_, s));
}

// ---- NcclCommBase -----------------------------------------------------------------------------

NcclCommBase::NcclCommBase(std::unique_ptr<Context> ctx, std::unique_ptr<CollectiveOps> ops,
                           const NcclOptions& o)
    : ctx_(std::move(ctx)), ops_(std::move(ops)), opts_(o) {}

NcclCommBase::~NcclCommBase() {
  quiesce();
  for (Window& w : windows_) ctx_->release_window(w);
  ops_.reset();  // its internal windows
  ctx_.reset();
}

void NcclCommBase::quiesce() const noexcept {
  (void)cudaSetDevice(ctx_->device());
  (void)cudaDeviceSynchronize();
}

SymmetricBuffer NcclCommBase::alloc_symmetric(Backend&, size_t bytes) {
  ctx_->check_alive();
  SymmetricBuffer buf;
  const Window w = ops_->make_window(bytes, "symmetric buffer " + std::to_string(windows_.size()));
  buf.local = w.ptr;
  buf.bytes = bytes;
  buf.id = int(windows_.size());
  windows_.push_back(w);
  return buf;
}

void NcclCommBase::free_symmetric(Backend&, SymmetricBuffer& buf) {
  if (!buf.local) return;
  MOE_ECHO_CHECK(
      buf.id >= 0 && buf.id < int(windows_.size()) && windows_[size_t(buf.id)].ptr == buf.local,
      "symmetric buffer " << buf.id << " is not one of this communicator's");
  MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
  ctx_->release_window(windows_[size_t(buf.id)]);
  buf.local = nullptr;
}

void NcclCommBase::barrier() {
  ctx_->check_alive();
  ctx_->boot().barrier();
}

const Window& NcclCommBase::window_of(const SymmetricBuffer& buf, size_t need,
                                      const char* op) const {
  MOE_ECHO_CHECK(
      buf.id >= 0 && buf.id < int(windows_.size()) && buf.local &&
          windows_[size_t(buf.id)].ptr == buf.local,
      op << ": symmetric buffer " << buf.id << " is not a live buffer of this communicator");
  const Window& w = windows_[size_t(buf.id)];
  MOE_ECHO_CHECK(need <= w.bytes,
                 op << ": " << need << " bytes into a symmetric buffer of " << buf.bytes);
  return w;
}

void NcclCommBase::all_gather_i32(const int32_t* local, int32_t* all, int64_t n, Stream s) {
  ctx_->check_alive();
  MOE_ECHO_CHECK(n >= 0 && n <= opts_.max_gather_ints,
                 "all_gather_i32 of " << n << " ints per rank; this communicator was built for "
                                      << opts_.max_gather_ints
                                      << " (NcclOptions::max_gather_ints)");
  ops_->all_gather_i32(local, all, n, cuda::as_cuda(s));
}

void NcclCommBase::all_reduce_sum(const Tensor& t, Stream s) {
  ctx_->check_alive();
  comm_args::check_sum_dtype("all_reduce_sum", t.dtype);
  if (t.numel() == 0) return;
  ops_->all_reduce_sum(t, cuda::as_cuda(s));
}

void NcclCommBase::dispatch(const RowRoute& route, RoundWindow window, const void* src,
                            size_t row_bytes, const SymmetricBuffer& recv, const FanTable& fan,
                            Stream s) {
  ctx_->check_alive();
  comm_args::check_route("dispatch", route, window, fan, {DType::f32, DType::f64});
  const size_t rows = size_t(std::max<int64_t>(window.rows, 0)), K = size_t(route.top_k);
  const Window& w = window_of(recv, rows * row_bytes, "dispatch");
  const Window& m = window_of(fan.members, rows * K * sizeof(int32_t), "dispatch (fan members)");
  const Window& wt =
      window_of(fan.weights, rows * K * dtype_size(fan.float_dtype), "dispatch (fan weights)");
  dispatch_rows(route, window, src, row_bytes, w, m, wt, fan.float_dtype, cuda::as_cuda(s));
}

void NcclCommBase::combine(const RowRoute& route, RoundWindow window, const SymmetricBuffer& red,
                           const Tensor& y, const int32_t* accumulate, const FanTable& fan,
                           void* values_out, Stream s) {
  ctx_->check_alive();
  comm_args::check_route("combine", route, window, fan, {DType::f32, DType::f64});
  comm_args::check_combine_rows(route, y, {DType::bf16, DType::f32, DType::f64});
  const size_t rows = size_t(std::max<int64_t>(window.rows, 0));
  const size_t row_bytes = size_t(y.size(1)) * dtype_size(y.dtype);
  const Window& r = window_of(red, rows * row_bytes, "combine");
  const Window* v = values_out ? &window_of(fan.values, rows * dtype_size(fan.float_dtype),
                                            "combine (fan values)")
                               : nullptr;
  combine_rows(route, window, r, y, accumulate, v, fan.float_dtype, values_out, cuda::as_cuda(s));
}

void NcclCommBase::pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg,
                                      const SymmetricBuffer& home, void* spare, size_t slot_bytes,
                                      Stream s) {
  ctx_->check_alive();
  comm_args::check_plan("pull_clone_weights", cfg, size());
  if (cfg.spare_slots == 0 || slot_bytes == 0) return;  // the same on every rank
  const Window& w =
      window_of(home, size_t(cfg.experts_per_rank()) * slot_bytes, "pull_clone_weights");
  MOE_ECHO_CHECK(spare != nullptr, "pull_clone_weights: spare slots at null");
  ops_->pull_clone_weights(plan, cfg, w, spare, slot_bytes, cuda::as_cuda(s));
}

void NcclCommBase::reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg,
                                      const SymmetricBuffer& spare, void* home, int64_t slot_elems,
                                      DType dtype, Stream s) {
  ctx_->check_alive();
  comm_args::check_plan("reduce_clone_grads", cfg, size());
  comm_args::check_sum_dtype("reduce_clone_grads", dtype);
  const int M = cfg.max_replicas();
  MOE_ECHO_CHECK(M <= kMaxReplicas, "max_replicas " << M << " > " << kMaxReplicas);
  if (cfg.spare_slots == 0 || M == 1 || slot_elems == 0) return;  // no clones on any rank
  const Window& w =
      window_of(spare, size_t(cfg.spare_slots) * size_t(slot_elems) * dtype_size(dtype),
                "reduce_clone_grads");
  ops_->reduce_clone_grads(plan, cfg, w, home, slot_elems, dtype, cuda::as_cuda(s));
}

}  // namespace nccl
}  // namespace moe_echo
