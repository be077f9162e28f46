// NCCL communicator (see nccl_communicator.hpp). Invariants every kernel here keeps:
// - A barrier-using kernel always launches with the same grid on every rank (kCtas CTAs, or one
//   CTA for the count all-gather), whatever its rank-local sizes: CTA i's LSA barrier pairs with
//   CTA i of every peer, so a rank that skipped a launch would hang the others. Rank-local work
//   of zero size still launches and only takes part in the barriers.
// - Each kernel type owns a disjoint range of barrier indices ([type * kMaxCtas, +kMaxCtas)).
// - Pattern of a data-moving kernel: barrier (acq_rel) at entry, so peers are done with the
//   buffers about to be written or read (their earlier kernels finished); the loads and stores;
//   barrier (acq_rel) at exit, so every store is visible to every peer and every peer is done
//   reading before anything overwrites what it read. The kernel that consumes the data is the
//   next one on the stream (all CTAs of this kernel have then passed their exit barriers).
// - Peers are addressed by world rank: construction checks that the LSA team is the whole world,
//   where LSA rank == world rank.
// - Per-step ops read routes, plans and counts on the device; nothing here reads device memory
//   on the host, except the baseline dispatcher (documented, not capturable).
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <vector>

#include "comm/nccl_communicator.hpp"
#include "cuda/common.cuh"
#include "moe_echo/error.hpp"

#define MOE_ECHO_NCCL_CHECK(call)                                                             \
  do {                                                                                        \
    const ncclResult_t moe_echo_nccl_status_ = (call);                                        \
    if (moe_echo_nccl_status_ != ncclSuccess) {                                               \
      std::ostringstream moe_echo_nccl_msg_;                                                  \
      moe_echo_nccl_msg_ << #call << " failed: " << ncclGetErrorString(moe_echo_nccl_status_) \
                         << " (" << int(moe_echo_nccl_status_) << ")";                        \
      const char* moe_echo_nccl_last_ = ncclGetLastError(nullptr);                            \
      if (moe_echo_nccl_last_ && *moe_echo_nccl_last_)                                        \
        moe_echo_nccl_msg_ << ": " << moe_echo_nccl_last_;                                    \
      ::moe_echo::detail::fail(__FILE__, __LINE__, moe_echo_nccl_msg_.str());                 \
    }                                                                                         \
  } while (0)

namespace moe_echo {

const char* to_string(Dispatcher d) { return d == Dispatcher::baseline ? "baseline" : "syncfree"; }

Dispatcher parse_dispatcher(const std::string& text, const std::string& field) {
  if (text == "syncfree") return Dispatcher::syncfree;
  if (text == "baseline") return Dispatcher::baseline;
  reject(field, "'" + text + "'", "syncfree or baseline");
}

int select_device(const DistEnv& env) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  if (env.local_rank >= count) {
    (void)cudaGetLastError();
    reject("LOCAL_RANK", env.local_rank,
           "0 <= LOCAL_RANK < " + std::to_string(count) +
               " (the GPUs this process sees): one process per GPU");
  }
  MOE_ECHO_CUDA_CHECK(cudaSetDevice(env.local_rank));
  return env.local_rank;
}

namespace {

using cuda::as_cuda;

constexpr int kThreads = 512;  // threads of every barrier kernel
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCtas = 128;     // barrier indices per kernel type
constexpr int kMaxReplicas = 16;  // replicas per expert the clone reduction handles
enum BarrierRange : uint32_t {
  kDispatchBarriers = 0,
  kCombineBarriers,
  kPullBarriers,
  kReduceBarriers,
  kGatherBarriers,
  kAllReduceBarriers,
  kBarrierRanges
};
constexpr uint32_t barrier_base(BarrierRange r) { return uint32_t(r) * kMaxCtas; }

using Coop = ncclCoopCta;
using Barrier = ncclLsaBarrierSession<Coop>;
constexpr ::cuda::memory_order kAcqRel = ::cuda::memory_order_acq_rel;

// ---- device kernels ----------------------------------------------------------------------------

// One warp copies one row, four words per lane in flight.
template <class W>
__device__ __forceinline__ void copy_row(W* __restrict__ to, const W* __restrict__ from,
                                         int64_t words, int lane) {
  constexpr int U = 4;
  int64_t w = lane;
  for (; w + 32 * (U - 1) < words; w += 32 * U) {
    W v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = from[w + 32 * u];
#pragma unroll
    for (int u = 0; u < U; ++u) to[w + 32 * u] = v[u];
  }
  for (; w < words; w += 32) to[w] = from[w];
}

// Dispatch (kPush): row (dest_row - row_lo) of `win` on rank dest_rank <- src row i / src_div.
// Combine (!kPush): dst row i <- row (dest_row - row_lo) of `win` on rank dest_rank.
template <class W, bool kPush>
__global__ void __launch_bounds__(kThreads)
    move_rows_kernel(ncclDevComm dc, ncclWindow_t win, uint32_t bar, int64_t n,
                     const int32_t* __restrict__ dest_rank, const int32_t* __restrict__ dest_row,
                     int64_t row_lo, int64_t rows, int src_div, const W* src, W* dst,
                     int64_t row_words) {
  Barrier b(Coop(), dc, ncclTeamTagLsa(), bar + blockIdx.x);
  b.sync(Coop(), kAcqRel);
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t i = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; i < n; i += warps) {
    const int r = dest_rank[i];
    const int64_t row = int64_t(dest_row[i]) - row_lo;
    if (r < 0 || row < 0 || row >= rows) continue;
    W* peer =
        static_cast<W*>(ncclGetLsaPointer(win, size_t(row) * size_t(row_words) * sizeof(W), r));
    if constexpr (kPush)
      copy_row<W>(peer, src + (i / src_div) * row_words, row_words, lane);
    else
      copy_row<W>(dst + i * row_words, peer, row_words, lane);
  }
  b.sync(Coop(), kAcqRel);
}

// Spare slot s of this rank <- home slot of the expert the plan puts there, from its home rank.
template <class W>
__global__ void __launch_bounds__(kThreads)
    pull_clones_kernel(ncclDevComm dc, ncclWindow_t win, uint32_t bar,
                       const int32_t* __restrict__ spare_expert, int rank, int spare_slots,
                       int experts_per_rank, W* weights, int64_t slot_words) {
  Barrier b(Coop(), dc, ncclTeamTagLsa(), bar + blockIdx.x);
  b.sync(Coop(), kAcqRel);
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int s = 0; s < spare_slots; ++s) {
    const int e = spare_expert[rank * spare_slots + s];
    if (e < 0) continue;
    const W* from = static_cast<const W*>(ncclGetLsaPointer(
        win, size_t(e % experts_per_rank) * size_t(slot_words) * sizeof(W), e / experts_per_rank));
    W* to = weights + int64_t(experts_per_rank + s) * slot_words;
    for (int64_t w = int64_t(blockIdx.x) * kThreads + threadIdx.x; w < slot_words; w += stride)
      to[w] = from[w];
  }
  b.sync(Coop(), kAcqRel);
}

// Every home expert of this rank adds, in replica order, its clones' gradients from their ranks.
template <class T>
__global__ void __launch_bounds__(kThreads)
    reduce_clones_kernel(ncclDevComm dc, ncclWindow_t win, uint32_t bar,
                         const int32_t* __restrict__ replica_rank,
                         const int32_t* __restrict__ replica_slot, int rank, int M,
                         int experts_per_rank, T* grads, int64_t slot_elems) {
  Barrier b(Coop(), dc, ncclTeamTagLsa(), bar + blockIdx.x);
  b.sync(Coop(), kAcqRel);
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int j = 0; j < experts_per_rank; ++j) {
    const int e = rank * experts_per_rank + j;
    const T* from[kMaxReplicas];
    int clones = 0;
    for (int rep = 1; rep < M; ++rep) {
      const int r = replica_rank[e * M + rep];
      if (r < 0) continue;
      from[clones++] = static_cast<const T*>(ncclGetLsaPointer(
          win, size_t(replica_slot[e * M + rep]) * size_t(slot_elems) * sizeof(T), r));
    }
    if (clones == 0) continue;
    T* to = grads + int64_t(j) * slot_elems;
    for (int64_t x = int64_t(blockIdx.x) * kThreads + threadIdx.x; x < slot_elems; x += stride) {
      T acc = to[x];
      for (int c = 0; c < clones; ++c) acc += from[c][x];
      to[x] = acc;
    }
  }
  b.sync(Coop(), kAcqRel);
}

// One CTA: this rank's n counts into slot `rank` of every peer's gather window, then the whole
// window (every rank's counts, in rank order) into `all`.
__global__ void __launch_bounds__(kThreads)
    all_gather_kernel(ncclDevComm dc, ncclWindow_t win, uint32_t bar, const int32_t* local,
                      int32_t* all, int64_t n, int rank, int ranks) {
  Barrier b(Coop(), dc, ncclTeamTagLsa(), bar);
  b.sync(Coop(), kAcqRel);
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const int32_t v = local[i];
    for (int p = 0; p < ranks; ++p)
      *static_cast<int32_t*>(ncclGetLsaPointer(win, (size_t(rank) * n + i) * sizeof(int32_t), p)) =
          v;
  }
  b.sync(Coop(), kAcqRel);
  const int32_t* mine = static_cast<const int32_t*>(ncclGetLocalPointer(win, 0));
  for (int64_t i = threadIdx.x; i < int64_t(ranks) * n; i += kThreads) all[i] = __ldcg(mine + i);
}

// t <- sum over ranks of t, in rank order in double (the in-process communicator's arithmetic).
// CTA c owns the same chunk of elements on every rank: it stages them, meets its peers' CTA c,
// sums, and meets them again before the staging window can be overwritten by the next call.
template <class T>
__global__ void __launch_bounds__(kThreads)
    all_reduce_kernel(ncclDevComm dc, ncclWindow_t win, uint32_t bar, T* t, int64_t n, int ranks) {
  const int64_t chunk = (n + gridDim.x - 1) / gridDim.x;
  const int64_t lo = int64_t(blockIdx.x) * chunk, hi = min(n, lo + chunk);
  T* stage = static_cast<T*>(ncclGetLocalPointer(win, 0));
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) stage[i] = t[i];
  Barrier b(Coop(), dc, ncclTeamTagLsa(), bar + blockIdx.x);
  b.sync(Coop(), kAcqRel);
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    double acc = 0;
    for (int r = 0; r < ranks; ++r)
      acc +=
          double(__ldcg(static_cast<const T*>(ncclGetLsaPointer(win, size_t(i) * sizeof(T), r))));
    t[i] = T(acc);
  }
  b.sync(Coop(), kAcqRel);
}

// Baseline: dst row (dst_idx ? dst_idx[j] : j) <- src row (src_idx ? src_idx[j] : j) / src_div.
template <class W>
__global__ void index_copy_kernel(int64_t count, const int32_t* __restrict__ src_idx, int src_div,
                                  const W* src, const int32_t* __restrict__ dst_idx, W* dst,
                                  int64_t row_words) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; j < count; j += warps) {
    const int64_t from = (src_idx ? int64_t(src_idx[j]) : j) / src_div;
    const int64_t to = dst_idx ? int64_t(dst_idx[j]) : j;
    copy_row<W>(dst + to * row_words, src + from * row_words, row_words, lane);
  }
}

// ---- host helpers ------------------------------------------------------------------------------

// The widest word that divides the row size and every base address.
size_t word_size(size_t row_bytes, std::initializer_list<const void*> bases) {
  for (size_t w : {size_t(16), size_t(8), size_t(4), size_t(2)}) {
    bool ok = row_bytes % w == 0;
    for (const void* p : bases) ok = ok && reinterpret_cast<uintptr_t>(p) % w == 0;
    if (ok) return w;
  }
  return 1;
}

template <class F>
void with_word(size_t w, F&& f) {
  switch (w) {
    case 16:
      f(uint4{});
      break;
    case 8:
      f(uint2{});
      break;
    case 4:
      f(uint32_t{});
      break;
    case 2:
      f(uint16_t{});
      break;
    default:
      f(uint8_t{});
      break;
  }
}

size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }

// Host memory that grows, pinned (the baseline's copies to and from the host).
template <class T>
struct PinnedVector {
  T* data = nullptr;
  size_t capacity = 0;
  ~PinnedVector() {
    if (data) (void)cudaFreeHost(data);
  }
  void reserve(size_t n) {
    if (n <= capacity) return;
    if (data) MOE_ECHO_CUDA_CHECK(cudaFreeHost(data));
    data = nullptr;
    capacity = std::max(n, 2 * capacity);
    MOE_ECHO_CUDA_CHECK(cudaMallocHost(&data, capacity * sizeof(T)));
  }
};

// Device memory that grows (baseline staging; never inside a capture).
struct DeviceScratch {
  void* data = nullptr;
  size_t bytes = 0;
  ~DeviceScratch() {
    if (data) (void)cudaFree(data);
  }
  void* get(size_t need) {
    if (need > bytes) {
      if (data) MOE_ECHO_CUDA_CHECK(cudaFree(data));
      data = nullptr;
      bytes = std::max(need, 2 * bytes);
      MOE_ECHO_CUDA_CHECK(cudaMalloc(&data, bytes));
    }
    return data;
  }
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Rendezvous& rv, std::unique_ptr<Rendezvous> owned, const NcclOptions& o)
      : owned_rv_(std::move(owned)), rv_(rv), opts_(o) {
    rank_ = rv.rank();
    size_ = rv.world_size();
    if (opts_.ctas < 1 || opts_.ctas > kMaxCtas)
      reject("ctas", opts_.ctas, "1 <= ctas <= " + std::to_string(kMaxCtas));
    if (opts_.max_gather_ints < 1) reject("max_gather_ints", opts_.max_gather_ints, ">= 1");
    MOE_ECHO_CUDA_CHECK(cudaGetDevice(&device_));

    ncclUniqueId id;
    Bytes bytes(sizeof id, 0);
    if (rank_ == 0) {
      MOE_ECHO_NCCL_CHECK(ncclGetUniqueId(&id));
      std::memcpy(bytes.data(), &id, sizeof id);
    }
    bytes = rv_.broadcast_bytes(bytes);
    MOE_ECHO_CHECK(bytes.size() == sizeof id, "NCCL unique id of " << bytes.size() << " bytes");
    std::memcpy(&id, bytes.data(), sizeof id);
    MOE_ECHO_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));

    ncclDevCommRequirements reqs;
    std::memset(&reqs, 0, sizeof reqs);  // NCCL 2.28.9 has no initializer macro
    reqs.lsaBarrierCount = int(kBarrierRanges) * kMaxCtas;
    try {
      MOE_ECHO_NCCL_CHECK(ncclDevCommCreate(comm_, &reqs, &dev_));
      have_dev_ = true;
      if (dev_.lsaSize != size_ || dev_.lsaRank != rank_) {
        std::ostringstream m;
        m << "the NCCL communicator's NVLink (LSA) team holds " << dev_.lsaSize << " of " << size_
          << " ranks (this rank is " << dev_.lsaRank << " in it, " << rank_
          << " in the world): this communicator needs every rank on one node, joined by NVLink";
        throw Error(m.str());
      }
      MOE_ECHO_CUDA_CHECK(cudaStreamCreateWithFlags(&setup_stream_, cudaStreamNonBlocking));
      gather_ = make_window(size_t(size_) * size_t(opts_.max_gather_ints) * sizeof(int32_t));
      staging_ = make_window(std::max<size_t>(opts_.all_reduce_staging_bytes, 4096));
      // Host-API peers connect lazily: connect now, so that the first captured step (or the
      // first timed one) does not.
      MOE_ECHO_NCCL_CHECK(
          ncclAllReduce(staging_.ptr, staging_.ptr, 1, ncclFloat32, ncclSum, comm_, setup_stream_));
      MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(setup_stream_));
    } catch (...) {
      destroy_comm();
      throw;
    }
    rv_.barrier();
  }

  ~NcclCommunicator() override {
    (void)cudaSetDevice(device_);
    (void)cudaDeviceSynchronize();
    for (Window& w : windows_) release_window(w);
    release_window(gather_);
    release_window(staging_);
    destroy_comm();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  ncclComm_t handle() const { return comm_; }

  SymmetricBuffer alloc_symmetric(Backend&, size_t bytes) override {
    SymmetricBuffer buf;
    Window w = make_window(bytes);
    buf.local = w.ptr;
    buf.bytes = bytes;
    buf.id = int(windows_.size());
    windows_.push_back(w);
    return buf;
  }

  void free_symmetric(Backend&, SymmetricBuffer& buf) override {
    if (!buf.local) return;
    MOE_ECHO_CHECK(
        buf.id >= 0 && buf.id < int(windows_.size()) && windows_[size_t(buf.id)].ptr == buf.local,
        "symmetric buffer " << buf.id << " is not one of this communicator's");
    MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
    release_window(windows_[size_t(buf.id)]);
    buf.local = nullptr;
  }

  void barrier() override { rv_.barrier(); }

  void all_gather_i32(const int32_t* local, int32_t* all, int64_t n, Stream s) override {
    MOE_ECHO_CHECK(n >= 0 && n <= opts_.max_gather_ints,
                   "all_gather_i32 of " << n << " ints per rank; this communicator was built for "
                                        << opts_.max_gather_ints
                                        << " (NcclOptions::max_gather_ints)");
    MOE_ECHO_LAUNCH(all_gather_kernel, 1, kThreads, 0, as_cuda(s), dev_, gather_.win,
                    barrier_base(kGatherBarriers), local, all, n, rank_, size_);
  }

  void all_reduce_sum(const Tensor& t, Stream s) override {
    MOE_ECHO_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64,
                   "all_reduce_sum supports f32 and f64, not " << to_string(t.dtype));
    const int64_t n = t.numel();
    if (n == 0) return;
    if (t.bytes() <= staging_.bytes) {
      const unsigned grid = unsigned(std::min<int64_t>(opts_.ctas, (n + kThreads - 1) / kThreads));
      if (t.dtype == DType::f32)
        MOE_ECHO_LAUNCH(all_reduce_kernel<float>, grid, kThreads, 0, as_cuda(s), dev_, staging_.win,
                        barrier_base(kAllReduceBarriers), t.as<float>(), n, size_);
      else
        MOE_ECHO_LAUNCH(all_reduce_kernel<double>, grid, kThreads, 0, as_cuda(s), dev_,
                        staging_.win, barrier_base(kAllReduceBarriers), t.as<double>(), n, size_);
      return;
    }
    MOE_ECHO_NCCL_CHECK(ncclAllReduce(t.data, t.data, size_t(n),
                                      t.dtype == DType::f32 ? ncclFloat32 : ncclFloat64, ncclSum,
                                      comm_, as_cuda(s)));
  }

  void dispatch(const RowRoute& route, RoundWindow window, const void* src, size_t row_bytes,
                const SymmetricBuffer& recv, Stream s) override {
    const Window& w = window_of(recv, size_t(window.rows) * row_bytes, "dispatch");
    check_route(route);
    if (opts_.dispatcher == Dispatcher::baseline)
      return baseline_dispatch(route, window, src, row_bytes, w, as_cuda(s));
    with_word(word_size(row_bytes, {src}), [&](auto word) {
      using W = decltype(word);
      MOE_ECHO_LAUNCH((move_rows_kernel<W, true>), unsigned(opts_.ctas), kThreads, 0, as_cuda(s),
                      dev_, w.win, barrier_base(kDispatchBarriers), route.n, route.dest_rank,
                      route.dest_row, window.row_lo, window.rows, route.src_div,
                      static_cast<const W*>(src), static_cast<W*>(nullptr),
                      int64_t(row_bytes / sizeof(W)));
    });
  }

  void combine(const RowRoute& route, RoundWindow window, const SymmetricBuffer& out,
               size_t row_bytes, void* gathered, Stream s) override {
    const Window& w = window_of(out, size_t(window.rows) * row_bytes, "combine");
    check_route(route);
    if (opts_.dispatcher == Dispatcher::baseline)
      return baseline_combine(route, window, w, row_bytes, gathered, as_cuda(s));
    with_word(word_size(row_bytes, {gathered}), [&](auto word) {
      using W = decltype(word);
      MOE_ECHO_LAUNCH((move_rows_kernel<W, false>), unsigned(opts_.ctas), kThreads, 0, as_cuda(s),
                      dev_, w.win, barrier_base(kCombineBarriers), route.n, route.dest_rank,
                      route.dest_row, window.row_lo, window.rows, 1, static_cast<const W*>(nullptr),
                      static_cast<W*>(gathered), int64_t(row_bytes / sizeof(W)));
    });
  }

  void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& weights, size_t slot_bytes, Stream s) override {
    MOE_ECHO_CHECK(cfg.ranks == size_, "plan for " << cfg.ranks << " ranks on " << size_);
    if (cfg.spare_slots == 0 || slot_bytes == 0) return;  // the same on every rank
    const int epr = cfg.experts_per_rank();
    const Window& w =
        window_of(weights, size_t(epr + cfg.spare_slots) * slot_bytes, "pull_clone_weights");
    with_word(word_size(slot_bytes, {w.ptr}), [&](auto word) {
      using W = decltype(word);
      MOE_ECHO_LAUNCH(pull_clones_kernel<W>, unsigned(opts_.ctas), kThreads, 0, as_cuda(s), dev_,
                      w.win, barrier_base(kPullBarriers), plan.spare_expert, rank_, cfg.spare_slots,
                      epr, static_cast<W*>(w.ptr), int64_t(slot_bytes / sizeof(W)));
    });
  }

  void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& grads, int64_t slot_elems, DType dtype,
                          Stream s) override {
    MOE_ECHO_CHECK(cfg.ranks == size_, "plan for " << cfg.ranks << " ranks on " << size_);
    MOE_ECHO_CHECK(dtype == DType::f32 || dtype == DType::f64,
                   "clone gradient reduction supports f32 and f64, not " << to_string(dtype));
    const int M = cfg.max_replicas();
    MOE_ECHO_CHECK(M <= kMaxReplicas, "max_replicas " << M << " > " << kMaxReplicas);
    if (cfg.spare_slots == 0 || M == 1 || slot_elems == 0) return;  // no clones on any rank
    const int epr = cfg.experts_per_rank();
    const Window& w =
        window_of(grads, size_t(epr + cfg.spare_slots) * size_t(slot_elems) * dtype_size(dtype),
                  "reduce_clone_grads");
    if (dtype == DType::f32)
      MOE_ECHO_LAUNCH(reduce_clones_kernel<float>, unsigned(opts_.ctas), kThreads, 0, as_cuda(s),
                      dev_, w.win, barrier_base(kReduceBarriers), plan.replica_rank,
                      plan.replica_slot, rank_, M, epr, static_cast<float*>(w.ptr), slot_elems);
    else
      MOE_ECHO_LAUNCH(reduce_clones_kernel<double>, unsigned(opts_.ctas), kThreads, 0, as_cuda(s),
                      dev_, w.win, barrier_base(kReduceBarriers), plan.replica_rank,
                      plan.replica_slot, rank_, M, epr, static_cast<double*>(w.ptr), slot_elems);
  }

 private:
  struct Window {
    void* ptr = nullptr;
    size_t bytes = 0;
    ncclWindow_t win = nullptr;
  };

  // Collective: ncclMemAlloc + symmetric registration, the same size on every rank (checked
  // first through the rendezvous, so a mismatch is an error rather than an NCCL hang).
  Window make_window(size_t bytes) {
    const uint64_t want = bytes;
    Bytes mine(sizeof want);
    std::memcpy(mine.data(), &want, sizeof want);
    const std::vector<Bytes> all = rv_.all_gather_bytes(mine);
    for (int r = 0; r < size_; ++r) {
      uint64_t theirs = 0;
      std::memcpy(&theirs, all[size_t(r)].data(), sizeof theirs);
      MOE_ECHO_CHECK(theirs == want, "symmetric buffer "
                                         << windows_.size() << ": rank " << r << " allocates "
                                         << theirs << " bytes, rank " << rank_ << " " << want);
    }
    Window w;
    w.bytes = round_up(std::max<size_t>(bytes, 1), 4096);
    MOE_ECHO_NCCL_CHECK(ncclMemAlloc(&w.ptr, w.bytes));
    MOE_ECHO_NCCL_CHECK(
        ncclCommWindowRegister(comm_, w.ptr, w.bytes, &w.win, NCCL_WIN_COLL_SYMMETRIC));
    return w;
  }

  void release_window(Window& w) {
    if (!w.ptr) return;
    if (w.win) (void)ncclCommWindowDeregister(comm_, w.win);
    (void)ncclMemFree(w.ptr);
    w = Window{};
  }

  void destroy_comm() {
    if (setup_stream_) (void)cudaStreamDestroy(setup_stream_);
    setup_stream_ = nullptr;
    if (have_dev_) (void)ncclDevCommDestroy(comm_, &dev_);
    have_dev_ = false;
    if (comm_) (void)ncclCommDestroy(comm_);
    comm_ = nullptr;
  }

  const Window& window_of(const SymmetricBuffer& buf, size_t need, const char* op) const {
    MOE_ECHO_CHECK(
        buf.id >= 0 && buf.id < int(windows_.size()) && buf.local &&
            windows_[size_t(buf.id)].ptr == buf.local,
        op << ": symmetric buffer " << buf.id << " is not a live buffer of this communicator");
    const Window& w = windows_[size_t(buf.id)];
    MOE_ECHO_CHECK(need <= w.bytes,
                   op << ": " << need << " bytes into a symmetric buffer of " << buf.bytes);
    return w;
  }

  static void check_route(const RowRoute& route) {
    MOE_ECHO_CHECK(route.n >= 0 && route.src_div >= 1,
                   "route of " << route.n << " entries, src_div " << route.src_div);
  }

  // ---- baseline: host-synced, exact-size grouped send/recv ----------------------------------

  // Routes to the host (one sync), then this rank's entries in the window grouped by
  // destination: order[] (entry indices, entry order within a destination), rows[] (window row
  // at the destination), send_count[d].
  void plan_sends(const RowRoute& route, RoundWindow window, cudaStream_t s) {
    const size_t n = size_t(route.n);
    h_rank_.reserve(std::max<size_t>(n, 1));
    h_row_.reserve(std::max<size_t>(n, 1));
    if (n) {
      MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(h_rank_.data, route.dest_rank, n * sizeof(int32_t),
                                          cudaMemcpyDeviceToHost, s));
      MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(h_row_.data, route.dest_row, n * sizeof(int32_t),
                                          cudaMemcpyDeviceToHost, s));
    }
    MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
    send_count_.assign(size_t(size_), 0);
    for (size_t i = 0; i < n; ++i) {
      const int r = h_rank_.data[i];
      const int64_t row = int64_t(h_row_.data[i]) - window.row_lo;
      if (r < 0 || row < 0 || row >= window.rows) continue;
      MOE_ECHO_CHECK(r < size_, "entry " << i << " routed to rank " << r);
      ++send_count_[size_t(r)];
    }
    send_off_.assign(size_t(size_) + 1, 0);
    for (int d = 0; d < size_; ++d)
      send_off_[size_t(d) + 1] = send_off_[size_t(d)] + send_count_[size_t(d)];
    const size_t total = size_t(send_off_[size_t(size_)]);
    h_order_.reserve(std::max<size_t>(2 * total, 1));  // order, then rows
    std::vector<int64_t> at(send_off_.begin(), send_off_.end() - 1);
    for (size_t i = 0; i < n; ++i) {
      const int r = h_rank_.data[i];
      const int64_t row = int64_t(h_row_.data[i]) - window.row_lo;
      if (r < 0 || row < 0 || row >= window.rows) continue;
      const int64_t j = at[size_t(r)]++;
      h_order_.data[j] = int32_t(i);
      h_order_.data[total + size_t(j)] = int32_t(row);
    }
  }

  // Every rank's send counts (ncclAllGather, one host sync): recv_count_[src] = rows src sends
  // here.
  void exchange_counts(cudaStream_t s) {
    int32_t* d =
        static_cast<int32_t*>(counts_.get(2 * size_t(size_) * size_t(size_) * sizeof(int32_t)));
    h_counts_.reserve(size_t(size_) * size_t(size_));
    for (int r = 0; r < size_; ++r) h_counts_.data[r] = int32_t(send_count_[size_t(r)]);
    MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(d, h_counts_.data, size_t(size_) * sizeof(int32_t),
                                        cudaMemcpyHostToDevice, s));
    MOE_ECHO_NCCL_CHECK(ncclAllGather(d, d + size_ * size_, size_t(size_), ncclInt32, comm_, s));
    MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(h_counts_.data, d + size_ * size_,
                                        size_t(size_) * size_t(size_) * sizeof(int32_t),
                                        cudaMemcpyDeviceToHost, s));
    MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
    recv_off_.assign(size_t(size_) + 1, 0);
    for (int src = 0; src < size_; ++src)
      recv_off_[size_t(src) + 1] = recv_off_[size_t(src)] + h_counts_.data[src * size_ + rank_];
  }

  // Rows: send segment d of `send` to d, receive segment src of `recv` from src (row_bytes each).
  // Indices travel the same way when `send_idx` is given.
  void exchange(const void* send, void* recv, size_t row_bytes, const std::vector<int64_t>& soff,
                const std::vector<int64_t>& roff, cudaStream_t s) {
    MOE_ECHO_NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < size_; ++p) {
      const int64_t sc = soff[size_t(p) + 1] - soff[size_t(p)];
      const int64_t rc = roff[size_t(p) + 1] - roff[size_t(p)];
      if (sc)
        MOE_ECHO_NCCL_CHECK(
            ncclSend(static_cast<const char*>(send) + size_t(soff[size_t(p)]) * row_bytes,
                     size_t(sc) * row_bytes, ncclUint8, p, comm_, s));
      if (rc)
        MOE_ECHO_NCCL_CHECK(ncclRecv(static_cast<char*>(recv) + size_t(roff[size_t(p)]) * row_bytes,
                                     size_t(rc) * row_bytes, ncclUint8, p, comm_, s));
    }
    MOE_ECHO_NCCL_CHECK(ncclGroupEnd());
  }

  template <class W>
  void index_copy(int64_t count, const int32_t* src_idx, int src_div, const void* src,
                  const int32_t* dst_idx, void* dst, size_t row_bytes, cudaStream_t s) {
    MOE_ECHO_LAUNCH(index_copy_kernel<W>, cuda::blocks_for(count, 8, cuda::grid_cap()), 256, 0, s,
                    count, src_idx, src_div, static_cast<const W*>(src), dst_idx,
                    static_cast<W*>(dst), int64_t(row_bytes / sizeof(W)));
  }

  // Device copies of this rank's order[] and rows[] (plan_sends), and room for the indices that
  // arrive: returns {order, rows, recv_rows}.
  struct IndexBuffers {
    int32_t* order;
    int32_t* rows;
    int32_t* recv_rows;
  };
  IndexBuffers upload_indices(cudaStream_t s) {
    const size_t total = size_t(send_off_[size_t(size_)]),
                 incoming = size_t(recv_off_[size_t(size_)]);
    int32_t* d = static_cast<int32_t*>(indices_.get((2 * total + incoming + 1) * sizeof(int32_t)));
    if (total)
      MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(d, h_order_.data, 2 * total * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, s));
    return {d, d + total, d + 2 * total};
  }

  void baseline_dispatch(const RowRoute& route, RoundWindow window, const void* src,
                         size_t row_bytes, const Window& recv, cudaStream_t s) {
    plan_sends(route, window, s);
    exchange_counts(s);
    const int64_t total = send_off_[size_t(size_)], incoming = recv_off_[size_t(size_)];
    const IndexBuffers ix = upload_indices(s);
    void* packed = send_rows_.get(std::max<size_t>(size_t(total) * row_bytes, 1));
    void* staged = recv_rows_.get(std::max<size_t>(size_t(incoming) * row_bytes, 1));
    with_word(word_size(row_bytes, {src, packed, staged, recv.ptr}), [&](auto word) {
      using W = decltype(word);
      index_copy<W>(total, ix.order, route.src_div, src, nullptr, packed, row_bytes, s);
      exchange(ix.rows, ix.recv_rows, sizeof(int32_t), send_off_, recv_off_, s);
      exchange(packed, staged, row_bytes, send_off_, recv_off_, s);
      index_copy<W>(incoming, nullptr, 1, staged, ix.recv_rows, recv.ptr, row_bytes, s);
    });
  }

  void baseline_combine(const RowRoute& route, RoundWindow window, const Window& out,
                        size_t row_bytes, void* gathered, cudaStream_t s) {
    plan_sends(route, window, s);
    exchange_counts(s);
    const int64_t total = send_off_[size_t(size_)], incoming = recv_off_[size_t(size_)];
    const IndexBuffers ix = upload_indices(s);
    void* packed = send_rows_.get(std::max<size_t>(size_t(total) * row_bytes, 1));
    void* staged = recv_rows_.get(std::max<size_t>(size_t(incoming) * row_bytes, 1));
    with_word(word_size(row_bytes, {gathered, packed, staged, out.ptr}), [&](auto word) {
      using W = decltype(word);
      // The rows each source wants, then those rows back to it.
      exchange(ix.rows, ix.recv_rows, sizeof(int32_t), send_off_, recv_off_, s);
      index_copy<W>(incoming, ix.recv_rows, 1, out.ptr, nullptr, staged, row_bytes, s);
      exchange(staged, packed, row_bytes, recv_off_, send_off_, s);
      index_copy<W>(total, nullptr, 1, packed, ix.order, gathered, row_bytes, s);
    });
  }

  std::unique_ptr<Rendezvous> owned_rv_;
  Rendezvous& rv_;
  NcclOptions opts_;
  int rank_ = 0, size_ = 1, device_ = 0;
  ncclComm_t comm_ = nullptr;
  ncclDevComm dev_{};
  bool have_dev_ = false;
  cudaStream_t setup_stream_ = nullptr;
  std::vector<Window> windows_;  // by SymmetricBuffer id; freed ones stay as empty entries
  Window gather_, staging_;
  // Baseline state.
  PinnedVector<int32_t> h_rank_, h_row_, h_order_, h_counts_;
  std::vector<int64_t> send_count_, send_off_, recv_off_;
  DeviceScratch counts_, indices_, send_rows_, recv_rows_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Rendezvous& rendezvous,
                                                     const NcclOptions& options) {
  return std::make_unique<NcclCommunicator>(rendezvous, nullptr, options);
}

std::unique_ptr<Communicator> make_nccl_communicator(const DistEnv& env,
                                                     const NcclOptions& options) {
  auto rv = std::make_unique<Rendezvous>(env);
  Rendezvous& ref = *rv;
  return std::make_unique<NcclCommunicator>(ref, std::move(rv), options);
}

void* nccl_comm_handle(Communicator& comm) {
  auto* nccl = dynamic_cast<NcclCommunicator*>(&comm);
  return nccl ? static_cast<void*>(nccl->handle()) : nullptr;
}

}  // namespace moe_echo
