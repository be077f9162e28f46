// The host-API side of the NCCL communicator (nccl_base.hpp): the baseline communicator
// (NcclHostComm: dispatch and combine as most frameworks do them) and the host-API collective ops
// (ncclAllGather, ncclAllReduce, clone weights and gradients as grouped ncclSend/ncclRecv), over
// any NCCL transport, across nodes included. Each op copies what it needs of the routes or the
// plan to the host and waits for it (documented, not capturable); the results are the sync-free
// path's bits (the same rows, sums in the same order) except ncclAllReduce's summation order.
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "comm/host_comm_ops.hpp"
#include "comm/nccl_base.hpp"
#include "comm/nccl_rows.cuh"
#include "cuda/common.cuh"
#include "cuda/warp_copy.cuh"
#include "moe_echo/error.hpp"
#include "moe_echo/nccl_check.hpp"

namespace moe_echo::nccl {
namespace {

using cuda::with_word;
using cuda::word_size;

// ---- kernels -----------------------------------------------------------------------------------

// Words per lane in flight in the baseline's row copies (cuda::warp_copy_row).
constexpr int kCopyInFlight = 4;

// Baseline: dst row (dst_idx ? dst_idx[j] : j) <- src row (src_idx ? src_idx[j] : j).
template <class W>
__global__ void index_copy_kernel(int64_t count, const int32_t* __restrict__ src_idx, const W* src,
                                  const int32_t* __restrict__ dst_idx, W* dst, int64_t row_words) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; j < count; j += warps) {
    const int64_t from = src_idx ? int64_t(src_idx[j]) : j;
    const int64_t to = dst_idx ? int64_t(dst_idx[j]) : j;
    cuda::warp_copy_row<kCopyInFlight>(dst + to * row_words, src + from * row_words, row_words,
                                       lane);
  }
}

// Baseline: dst[dst_idx ? dst_idx[j] : j] <- src[src_idx ? src_idx[j] : j] (single values).
template <class T>
__global__ void index_move_kernel(int64_t count, const int32_t* __restrict__ src_idx, const T* src,
                                  const int32_t* __restrict__ dst_idx, T* dst) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count;
       j += int64_t(gridDim.x) * blockDim.x)
    dst[dst_idx ? int64_t(dst_idx[j]) : j] = src[src_idx ? int64_t(src_idx[j]) : j];
}

// Baseline, the receiving side of a dispatch: incoming lead j carries the window rows of its
// members (lead first, -1 padded: K ints), their weights (K) and the token row. The row goes to
// the lead's receive row, the members and weights to the lead's fan-table rows, and -1 to
// members[q][0] of every other member q (what the sync-free kernel writes).
template <class W, class F>
__global__ void receive_leads_kernel(int64_t count, int K, const int32_t* __restrict__ rec,
                                     const F* __restrict__ wts, const W* __restrict__ staged,
                                     W* recv, int32_t* members, F* weights, int64_t row_words) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; j < count; j += warps) {
    const int64_t p = rec[j * K];
    if (lane < K) {
      const int32_t m = rec[j * K + lane];
      members[p * K + lane] = m;
      if (m >= 0) {
        weights[p * K + lane] = wts[j * K + lane];
        if (lane > 0) members[int64_t(m) * K] = -1;
      }
    }
    cuda::warp_copy_row<kCopyInFlight>(recv + p * row_words, staged + j * row_words, row_words,
                                       lane);
  }
}

// Baseline, the source side of a combine: y[t] <- (add ? y[t] : 0) + the packed rows of t's
// leads in k order (token_leads[token_off[t] ..]), as the sync-free combine sums them; with
// token_sums (chunks), for the tokens where it is 1 only.
template <class Y, class W>
__global__ void sum_leads_kernel(int64_t tokens, const int32_t* __restrict__ token_off,
                                 const int32_t* __restrict__ token_leads,
                                 const int32_t* __restrict__ token_sums, const W* packed,
                                 int64_t row_words, const int32_t* accumulate, W* y) {
  const bool add = accumulate && *accumulate != 0;
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t < tokens; t += warps) {
    if (token_sums && !token_sums[t]) continue;
    const int32_t lo = token_off[t], count = token_off[t + 1] - lo;
    if (count == 0 && add) continue;
    const unsigned long long lane_row =
        lane < count ? reinterpret_cast<unsigned long long>(
                           packed + int64_t(token_leads[lo + lane]) * row_words)
                     : 0ull;
    sum_rows<Y, W>(y + t * row_words, row_words, add, lane_row, count, lane);
  }
}

// Host-API mode, the home side of a clone gradient reduction: to[x] += from[0][x], from[1][x], ...
// in replica order, per element (the sums of reduce_clones_kernel, bit for bit).
template <class T>
struct ClonePointers {
  const T* p[kMaxReplicas];
};

template <class T>
__global__ void add_clones_kernel(T* to, ClonePointers<T> from, int clones, int64_t n) {
  for (int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; x < n;
       x += int64_t(gridDim.x) * blockDim.x) {
    T acc = to[x];
    for (int c = 0; c < clones; ++c) acc += from.p[c][x];
    to[x] = acc;
  }
}

// ---- host memory and staging ------------------------------------------------------------------

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

// ---- the host-API collective ops ---------------------------------------------------------------

// Over plain device memory: no peer reads a buffer of this rank, NCCL moves everything.
class HostApiCollectiveOps final : public CollectiveOps {
 public:
  HostApiCollectiveOps(Context& ctx, bool symmetric)
      : ctx_(ctx), rank_(ctx.rank()), size_(ctx.size()), comm_(ctx.comm()), symmetric_(symmetric) {
    connect_ = ctx_.make_plain_window(4096, "the connecting all-reduce's buffer");
    ctx_.connect(connect_.ptr);
  }
  ~HostApiCollectiveOps() override { ctx_.release_window(connect_); }

  bool host_api() const override { return !symmetric_; }

  Window make_window(size_t bytes, const std::string& what) override {
    return symmetric_ ? ctx_.make_symmetric_window(bytes, what)
                      : ctx_.make_plain_window(bytes, what);
  }

  void all_gather_i32(const int32_t* local, int32_t* all, int64_t n, cudaStream_t s) override {
    if (n > 0) MOE_ECHO_NCCL_CHECK(ncclAllGather(local, all, size_t(n), ncclInt32, comm_, s));
  }

  void all_reduce_sum(const Tensor& t, cudaStream_t s) override { ctx_.all_reduce_host_api(t, s); }

  void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg, const Window& home,
                          void* spare, size_t slot_bytes, cudaStream_t s) override {
    host_pull_clones(plan, cfg, home, spare, slot_bytes, s);
  }

  void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg, const Window& spare,
                          void* home, int64_t slot_elems, DType dtype, cudaStream_t s) override {
    if (dtype == DType::f32)
      return host_reduce_clones<float>(plan, cfg, spare, static_cast<float*>(home), slot_elems, s);
    host_reduce_clones<double>(plan, cfg, spare, static_cast<double*>(home), slot_elems, s);
  }

 private:
  // Fields of a plan on the device, copied to the host one after another (one sync).
  const int32_t* plan_on_host(std::initializer_list<std::pair<const int32_t*, size_t>> fields,
                              cudaStream_t s) {
    size_t total = 0;
    for (const auto& f : fields) total += f.second;
    h_plan_fields_.reserve(std::max<size_t>(total, 1));
    size_t at = 0;
    for (const auto& f : fields) {
      if (f.second)
        MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(h_plan_fields_.data + at, f.first,
                                            f.second * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
      at += f.second;
    }
    MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
    return h_plan_fields_.data;
  }

  // Spare slot s of rank r <- the home slot of spare_expert[r][s] from its home rank. Every pair
  // of ranks visits the slots in (r, s) order on both sides, so sends and receives match.
  void host_pull_clones(const PlanView& plan, const PlannerConfig& cfg, const Window& w,
                        void* spare_slots, size_t slot_bytes, cudaStream_t s) {
    const int S = cfg.spare_slots, epr = cfg.experts_per_rank();
    const int32_t* spare = plan_on_host({{plan.spare_expert, size_t(size_) * size_t(S)}}, s);
    char* base = static_cast<char*>(w.ptr);
    MOE_ECHO_NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < size_; ++r)
      for (int sl = 0; sl < S; ++sl) {
        const int e = spare[r * S + sl];
        if (e < 0) continue;
        const int home = e / epr;
        char* to = static_cast<char*>(spare_slots) + size_t(sl) * slot_bytes;
        const char* from = base + size_t(e % epr) * slot_bytes;
        if (r == rank_ && home == rank_)
          MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(to, from, slot_bytes, cudaMemcpyDeviceToDevice, s));
        else if (r == rank_)
          MOE_ECHO_NCCL_CHECK(ncclRecv(to, slot_bytes, ncclUint8, home, comm_, s));
        else if (home == rank_)
          MOE_ECHO_NCCL_CHECK(ncclSend(from, slot_bytes, ncclUint8, r, comm_, s));
      }
    MOE_ECHO_NCCL_CHECK(ncclGroupEnd());
  }

  // Each clone's gradient slot travels to its expert's home rank (replica order, the same order
  // on both sides of every pair), which adds them in replica order (add_clones_kernel).
  template <class T>
  void host_reduce_clones(const PlanView& plan, const PlannerConfig& cfg, const Window& w, T* home,
                          int64_t slot_elems, cudaStream_t s) {
    const int M = cfg.max_replicas(), epr = cfg.experts_per_rank(), E = cfg.experts;
    const size_t EM = size_t(E) * size_t(M);
    const int32_t* rep_rank = plan_on_host({{plan.replica_rank, EM}, {plan.replica_slot, EM}}, s);
    const int32_t* rep_slot = rep_rank + EM;
    T* grads = static_cast<T*>(w.ptr);
    const size_t slot = size_t(slot_elems) * sizeof(T);
    size_t incoming = 0;
    for (int j = 0; j < epr; ++j)
      for (int rep = 1; rep < M; ++rep) {
        const int r = rep_rank[size_t(rank_ * epr + j) * size_t(M) + size_t(rep)];
        incoming += r >= 0 && r != rank_;
      }
    T* staged = static_cast<T*>(clone_scratch_.get(std::max<size_t>(incoming * slot, 1)));
    std::vector<ClonePointers<T>> from(static_cast<size_t>(epr));
    std::vector<int> clones(static_cast<size_t>(epr), 0);
    size_t next = 0;
    MOE_ECHO_NCCL_CHECK(ncclGroupStart());
    for (int e = 0; e < E; ++e)
      for (int rep = 1; rep < M; ++rep) {
        const size_t at = size_t(e) * size_t(M) + size_t(rep);
        const int r = rep_rank[at], home_rank = e / epr;
        if (r < 0) continue;
        const T* held = grads + int64_t(rep_slot[at] - epr) * slot_elems;
        if (home_rank == rank_) {
          const T* src = held;
          if (r != rank_) {
            T* to = staged + int64_t(next++) * slot_elems;
            MOE_ECHO_NCCL_CHECK(ncclRecv(to, slot, ncclUint8, r, comm_, s));
            src = to;
          }
          const int j = e % epr;
          from[size_t(j)].p[clones[size_t(j)]++] = src;
        } else if (r == rank_) {
          MOE_ECHO_NCCL_CHECK(ncclSend(held, slot, ncclUint8, home_rank, comm_, s));
        }
      }
    MOE_ECHO_NCCL_CHECK(ncclGroupEnd());
    for (int j = 0; j < epr; ++j)
      if (clones[size_t(j)] > 0)
        MOE_ECHO_LAUNCH(add_clones_kernel<T>, cuda::blocks_for(slot_elems, 256, cuda::grid_cap()),
                        256, 0, s, home + int64_t(j) * slot_elems, from[size_t(j)],
                        clones[size_t(j)], slot_elems);
  }

  Context& ctx_;
  const int rank_, size_;
  const ncclComm_t comm_;
  const bool symmetric_;  // symmetric windows for the layer's buffers (the GIN communicator)
  Window connect_;
  PinnedVector<int32_t> h_plan_fields_;
  DeviceScratch clone_scratch_;
};

// ---- the baseline communicator -----------------------------------------------------------------

// Dispatch and combine host-synced with exact-size grouped ncclSend/ncclRecv; the other ops those
// of its collective ops (the device API's on one NVLink team, else the host API's).
class NcclHostComm final : public NcclCommBase {
 public:
  NcclHostComm(std::unique_ptr<Context> ctx, std::unique_ptr<CollectiveOps> ops,
               const NcclOptions& o)
      : NcclCommBase(std::move(ctx), std::move(ops), o) {}
  ~NcclHostComm() override { quiesce(); }  // before the staging below is freed

  // Dispatch and combine wait on the host inside a step.
  bool capturable() const override { return false; }

 private:
  // This rank's leads of a window (comm.hpp), from the routes copied to the host (one sync),
  // grouped by destination rank in token order; lead_off_[d] indexes destination d's. With
  // chunks, a dispatch's (`combine` false) pairs whose lead row is in its chunk, a combine's
  // tokens that it sums (host_comm's dispatch_moves and combine_sums). h_plan_ holds, as the
  // device wants them:
  //   dispatch part: lead_token [L], lead_members [L][K] (window rows, lead first, -1 padded);
  //   combine part (at plan_combine_): lead_row [L], token_off [T + 1], token_leads (per token,
  //   the index of each lead in k order) [L], and with `entries` every in-window entry grouped
  //   by destination (entry_off_): entry_row [Ne], entry_idx [Ne]; then with chunks, token_sums
  //   [T] (1 where the combine sums the token).
  // h_weights_ holds each lead's K member weights (bytes of the float dtype) when `weights`.
  void plan_leads(const RowRoute& route, RoundWindow window, DType fdt, bool combine, bool weights,
                  bool entries, cudaStream_t s) {
    const size_t n = size_t(route.n), fl = dtype_size(fdt);
    const int K = route.top_k;
    const int64_t T = route.n / K;
    h_rank_.reserve(std::max<size_t>(n, 1));
    h_row_.reserve(std::max<size_t>(n, 1));
    const bool have_w = weights && route.weight;
    if (have_w) h_weight_in_.reserve(std::max<size_t>(n * fl, 1));
    const RowChunks& chunks = route.chunks;
    const size_t bounds = chunks.bounds ? size_t(size()) * size_t(chunks.chunks + 1) : 0;
    if (bounds) {  // chunks checked by comm_args::check_route (NcclCommBase)
      h_bounds_.reserve(bounds);
      MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(h_bounds_.data, chunks.bounds, bounds * sizeof(int32_t),
                                          cudaMemcpyDeviceToHost, s));
    }
    if (n) {
      MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(h_rank_.data, route.dest_rank, n * sizeof(int32_t),
                                          cudaMemcpyDeviceToHost, s));
      MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(h_row_.data, route.dest_row, n * sizeof(int32_t),
                                          cudaMemcpyDeviceToHost, s));
      if (have_w)
        MOE_ECHO_CUDA_CHECK(
            cudaMemcpyAsync(h_weight_in_.data, route.weight, n * fl, cudaMemcpyDeviceToHost, s));
    }
    MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
    RowRoute h{h_rank_.data, h_row_.data, have_w ? h_weight_in_.data : nullptr, route.n, K, chunks};
    if (bounds) h.chunks.bounds = h_bounds_.data;
    auto in = [&](size_t i) {
      return h_rank_.data[i] >= 0 && host_comm::in_window(h, window, int64_t(i));
    };
    // Whether entry first + k (in the window) is in this call, and whether it is a lead.
    auto moves = [&](size_t first, int k) {
      return combine ? host_comm::combine_sums(h, window, int64_t(first))
                     : host_comm::dispatch_moves(h, window, int64_t(first), k);
    };
    auto is_lead = [&](size_t first, int k) {
      return host_comm::lead_entry(h, window, int64_t(first), k) == k;
    };
    // Counts per destination.
    const size_t R = size_t(size());
    std::vector<int64_t> leads(R, 0), ents(R, 0);
    for (size_t i = 0; i < n; ++i) {
      if (!in(i)) continue;
      const int d = h_rank_.data[i];
      MOE_ECHO_CHECK(d < size(), "entry " << i << " routed to rank " << d);
      const size_t first = i - i % size_t(K);
      const int k = int(i % size_t(K));
      if (!moves(first, k)) continue;
      ++ents[size_t(d)];
      leads[size_t(d)] += is_lead(first, k);
    }
    lead_off_.assign(R + 1, 0);
    entry_off_.assign(R + 1, 0);
    for (size_t d = 0; d < R; ++d) {
      lead_off_[d + 1] = lead_off_[d] + leads[d];
      entry_off_[d + 1] = entry_off_[d] + (entries ? ents[d] : 0);
    }
    const int64_t L = lead_off_[R], Ne = entry_off_[R];
    plan_combine_ = size_t(L) * size_t(K + 1);
    h_plan_.reserve(plan_combine_ + size_t(2 * L + T + 1 + 2 * Ne + (bounds ? T : 0)));
    if (weights) h_weights_.reserve(std::max<size_t>(size_t(L) * size_t(K) * fl, 1));
    std::vector<uint8_t> unused_weights(size_t(K) * fl);
    int32_t* lead_token = h_plan_.data;
    int32_t* lead_members = lead_token + L;
    int32_t* lead_row = h_plan_.data + plan_combine_;
    int32_t* token_off = lead_row + L;
    int32_t* token_leads = token_off + T + 1;
    int32_t* entry_row = token_leads + L;
    int32_t* entry_idx = entry_row + Ne;
    int32_t* token_sums = entry_idx + Ne;
    std::vector<int64_t> at(lead_off_.begin(), lead_off_.end() - 1);
    std::vector<int64_t> eat(entry_off_.begin(), entry_off_.end() - 1);
    int64_t listed = 0;
    for (int64_t t = 0; t < T; ++t) {
      const size_t first = size_t(t) * size_t(K);
      token_off[t] = int32_t(listed);
      if (bounds) token_sums[t] = !combine || host_comm::combine_sums(h, window, int64_t(first));
      for (int k = 0; k < K; ++k) {
        const size_t i = first + size_t(k);
        if (!in(i) || !moves(first, k)) continue;
        const int d = h_rank_.data[i];
        const int32_t row = int32_t(int64_t(h_row_.data[i]) - window.row_lo);
        if (entries) {
          const int64_t e = eat[size_t(d)]++;
          entry_row[e] = row;
          entry_idx[e] = int32_t(i);
        }
        if (!is_lead(first, k)) continue;
        const int64_t j = at[size_t(d)]++;
        lead_token[j] = int32_t(t);
        lead_row[j] = row;
        token_leads[listed++] = int32_t(j);
        char* w = weights ? reinterpret_cast<char*>(h_weights_.data) + size_t(j) * size_t(K) * fl
                          : reinterpret_cast<char*>(unused_weights.data());
        host_comm::list_members(h, window, int64_t(first), k, fdt, lead_members + j * K, w);
      }
    }
    token_off[T] = int32_t(listed);
  }

  // Every rank's lead and entry counts (ncclAllGather, one host sync): recv_lead_off_[src] and
  // recv_entry_off_[src] index what src sends here.
  void exchange_counts(cudaStream_t s) {
    const size_t R = size_t(size());
    int32_t* d = static_cast<int32_t*>(counts_.get(2 * R * (R + 1) * sizeof(int32_t)));
    h_counts_.reserve(2 * R * (R + 1));
    for (size_t r = 0; r < R; ++r) {
      h_counts_.data[r] = int32_t(lead_off_[r + 1] - lead_off_[r]);
      h_counts_.data[R + r] = int32_t(entry_off_[r + 1] - entry_off_[r]);
    }
    MOE_ECHO_CUDA_CHECK(
        cudaMemcpyAsync(d, h_counts_.data, 2 * R * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    MOE_ECHO_NCCL_CHECK(ncclAllGather(d, d + 2 * R, 2 * R, ncclInt32, handle(), s));
    MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(h_counts_.data + 2 * R, d + 2 * R,
                                        2 * R * R * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
    const int32_t* all = h_counts_.data + 2 * R;
    recv_lead_off_.assign(R + 1, 0);
    recv_entry_off_.assign(R + 1, 0);
    for (size_t src = 0; src < R; ++src) {
      recv_lead_off_[src + 1] = recv_lead_off_[src] + all[src * 2 * R + size_t(rank())];
      recv_entry_off_[src + 1] = recv_entry_off_[src] + all[src * 2 * R + R + size_t(rank())];
    }
  }

  // Rows: send segment d of `send` to d, receive segment src of `recv` from src (row_bytes each).
  void exchange(const void* send, void* recv, size_t row_bytes, const std::vector<int64_t>& soff,
                const std::vector<int64_t>& roff, cudaStream_t s) {
    if (row_bytes == 0) return;
    MOE_ECHO_NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < size(); ++p) {
      const int64_t sc = soff[size_t(p) + 1] - soff[size_t(p)];
      const int64_t rc = roff[size_t(p) + 1] - roff[size_t(p)];
      if (sc)
        MOE_ECHO_NCCL_CHECK(
            ncclSend(static_cast<const char*>(send) + size_t(soff[size_t(p)]) * row_bytes,
                     size_t(sc) * row_bytes, ncclUint8, p, handle(), s));
      if (rc)
        MOE_ECHO_NCCL_CHECK(ncclRecv(static_cast<char*>(recv) + size_t(roff[size_t(p)]) * row_bytes,
                                     size_t(rc) * row_bytes, ncclUint8, p, handle(), s));
    }
    MOE_ECHO_NCCL_CHECK(ncclGroupEnd());
  }

  template <class W>
  void index_copy(int64_t count, const int32_t* src_idx, const void* src, const int32_t* dst_idx,
                  void* dst, size_t row_bytes, cudaStream_t s) {
    MOE_ECHO_LAUNCH(index_copy_kernel<W>, cuda::blocks_for(count, 8, cuda::grid_cap()), 256, 0, s,
                    count, src_idx, static_cast<const W*>(src), dst_idx, static_cast<W*>(dst),
                    int64_t(row_bytes / sizeof(W)));
  }

  template <class T>
  void index_move(int64_t count, const int32_t* src_idx, const void* src, const int32_t* dst_idx,
                  void* dst, cudaStream_t s) {
    MOE_ECHO_LAUNCH(index_move_kernel<T>, cuda::blocks_for(count, 256, cuda::grid_cap()), 256, 0, s,
                    count, src_idx, static_cast<const T*>(src), dst_idx, static_cast<T*>(dst));
  }

  // Leads to their ranks: token rows packed by destination, with their members and weights;
  // each receiver writes the rows and its fan table (receive_leads_kernel).
  void dispatch_rows(const RowRoute& route, RoundWindow window, const void* src, size_t row_bytes,
                     const Window& recv, const Window& members, const Window& weights, DType fdt,
                     cudaStream_t s) override {
    const int K = route.top_k;
    const size_t fl = dtype_size(fdt), R = size_t(size());
    plan_leads(route, window, fdt, /*combine=*/false, /*weights=*/true, /*entries=*/false, s);
    exchange_counts(s);
    const int64_t L = lead_off_[R], incoming = recv_lead_off_[R];
    int32_t* ix = static_cast<int32_t*>(
        indices_.get((plan_combine_ + size_t(incoming) * size_t(K) + 1) * sizeof(int32_t)));
    int32_t* in_members = ix + plan_combine_;
    void* wsend = fl_send_.get(std::max<size_t>(size_t(L) * size_t(K) * fl, 1));
    if (L) {
      MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(ix, h_plan_.data, plan_combine_ * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, s));
      MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(wsend, h_weights_.data, size_t(L) * size_t(K) * fl,
                                          cudaMemcpyHostToDevice, s));
    }
    void* wrecv = fl_recv_.get(std::max<size_t>(size_t(incoming) * size_t(K) * fl, 1));
    void* packed = send_rows_.get(std::max<size_t>(size_t(L) * row_bytes, 1));
    void* staged = recv_rows_.get(std::max<size_t>(size_t(incoming) * row_bytes, 1));
    with_float(fdt, [&](auto f) {
      using F = decltype(f);
      with_word(word_size(row_bytes, {src, packed, staged, recv.ptr}), [&](auto word) {
        using W = decltype(word);
        index_copy<W>(L, ix, src, nullptr, packed, row_bytes, s);
        exchange(ix + L, in_members, size_t(K) * sizeof(int32_t), lead_off_, recv_lead_off_, s);
        exchange(wsend, wrecv, size_t(K) * fl, lead_off_, recv_lead_off_, s);
        exchange(packed, staged, row_bytes, lead_off_, recv_lead_off_, s);
        MOE_ECHO_LAUNCH((receive_leads_kernel<W, F>),
                        cuda::blocks_for(incoming, 8, cuda::grid_cap()), 256, 0, s, incoming, K,
                        in_members, static_cast<const F*>(wrecv), static_cast<const W*>(staged),
                        static_cast<W*>(recv.ptr), static_cast<int32_t*>(members.ptr),
                        static_cast<F*>(weights.ptr), int64_t(row_bytes / sizeof(W)));
      });
    });
  }

  // Each rank asks the lead rows' ranks for them (the window rows travel there), they send the
  // red rows back, and each token sums its leads' rows in k order (sum_leads_kernel); the fan
  // values travel the same way, per entry, when values_out is given.
  void combine_rows(const RowRoute& route, RoundWindow window, const Window& red, const Tensor& y,
                    const int32_t* accumulate, const Window* values, DType fdt, void* values_out,
                    cudaStream_t s) override {
    const size_t R = size_t(size()), fl = dtype_size(fdt);
    const size_t row_bytes = size_t(y.size(1)) * dtype_size(y.dtype);
    const int64_t T = y.size(0);
    plan_leads(route, window, fdt, /*combine=*/true, /*weights=*/false,
               /*entries=*/values_out != nullptr, s);
    exchange_counts(s);
    const int64_t L = lead_off_[R], Ne = entry_off_[R];
    const int64_t incoming = recv_lead_off_[R], in_entries = recv_entry_off_[R];
    const bool chunked = route.chunks.bounds != nullptr;
    const size_t plan_ints = size_t(2 * L + T + 1 + 2 * Ne + (chunked ? T : 0));
    int32_t* ix = static_cast<int32_t*>(
        indices_.get((plan_ints + size_t(incoming + in_entries) + 1) * sizeof(int32_t)));
    MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(ix, h_plan_.data + plan_combine_,
                                        plan_ints * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    const int32_t* lead_row = ix;
    const int32_t* token_off = lead_row + L;
    const int32_t* token_leads = token_off + T + 1;
    const int32_t* entry_row = token_leads + L;
    const int32_t* entry_idx = entry_row + Ne;
    const int32_t* token_sums = chunked ? entry_idx + Ne : nullptr;
    int32_t* in_rows = ix + plan_ints;
    int32_t* in_entry_rows = in_rows + incoming;
    void* packed = send_rows_.get(std::max<size_t>(size_t(L) * row_bytes, 1));
    void* staged = recv_rows_.get(std::max<size_t>(size_t(incoming) * row_bytes, 1));
    const bool vec = row_bytes % 16 == 0 && cuda::aligned16(y.data);
    exchange(lead_row, in_rows, sizeof(int32_t), lead_off_, recv_lead_off_, s);
    with_rows(y.dtype, vec, [&](auto elem, auto word) {
      using Y = decltype(elem);
      using W = decltype(word);
      index_copy<W>(incoming, in_rows, red.ptr, nullptr, staged, row_bytes, s);
      exchange(staged, packed, row_bytes, recv_lead_off_, lead_off_, s);
      MOE_ECHO_LAUNCH((sum_leads_kernel<Y, W>), cuda::blocks_for(T, 8, cuda::grid_cap()), 256, 0, s,
                      T, token_off, token_leads, token_sums, static_cast<const W*>(packed),
                      int64_t(row_bytes / sizeof(W)), accumulate, static_cast<W*>(y.data));
    });
    if (!values_out) return;
    void* fsend = fl_send_.get(std::max<size_t>(size_t(Ne) * fl, 1));
    void* frecv = fl_recv_.get(std::max<size_t>(size_t(in_entries) * fl, 1));
    exchange(entry_row, in_entry_rows, sizeof(int32_t), entry_off_, recv_entry_off_, s);
    with_float(fdt, [&](auto f) {
      using F = decltype(f);
      index_move<F>(in_entries, in_entry_rows, values->ptr, nullptr, frecv, s);
      exchange(frecv, fsend, fl, recv_entry_off_, entry_off_, s);
      index_move<F>(Ne, nullptr, fsend, entry_idx, values_out, s);
    });
  }

  PinnedVector<int32_t> h_rank_, h_row_, h_plan_, h_counts_, h_bounds_;
  PinnedVector<uint8_t> h_weight_in_, h_weights_;
  size_t plan_combine_ = 0;  // where the combine part of h_plan_ starts
  std::vector<int64_t> lead_off_, entry_off_, recv_lead_off_, recv_entry_off_;
  DeviceScratch counts_, indices_, send_rows_, recv_rows_, fl_send_, fl_recv_;
};

}  // namespace

std::unique_ptr<CollectiveOps> make_host_api_collective_ops(Context& ctx, bool symmetric) {
  return std::make_unique<HostApiCollectiveOps>(ctx, symmetric);
}

std::unique_ptr<Communicator> make_host_comm(std::unique_ptr<Context> ctx,
                                             std::unique_ptr<CollectiveOps> ops,
                                             const NcclOptions& o) {
  return std::make_unique<NcclHostComm>(std::move(ctx), std::move(ops), o);
}

}  // namespace moe_echo::nccl
