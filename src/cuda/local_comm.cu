// The single-GPU communicator (EP size 1): what the expert-parallel exchanges reduce to when every
// expert lives on this GPU, so MoeLayer runs on the CUDA backend without NCCL. Symmetric buffers
// are plain device allocations; all_gather is a device copy; all_reduce has nothing to add;
// dispatch scatters rows into the receive window and combine gathers them back (one warp per row,
// the widest word the alignment allows); the clone kernels read the plan on the device. Every op
// is enqueued on the given stream and is capture-safe.
#include "cuda/common.cuh"
#include "cuda/cuda_backend.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

constexpr int kRowThreads = 256;  // 8 warps, one row each

// Rows between a token/entry array and the receive window. Scatter (dispatch): window row
// (dest_row - row_lo) <- source row i / src_div. Gather (combine): row i <- window row.
// Each lane loads kInFlight words of its row before storing any (for 4 KiB rows of 16-byte words:
// the whole row in flight per warp), so the copy is limited by bandwidth rather than latency.
template <class W>
__global__ void __launch_bounds__(kRowThreads)
    move_rows_kernel(int64_t n, const int32_t* __restrict__ dest_rank,
                     const int32_t* __restrict__ dest_row, int64_t row_lo, int64_t rows,
                     int src_div, bool scatter, const W* __restrict__ src, W* __restrict__ dst,
                     int64_t row_words) {
  constexpr int kInFlight = 8;
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; i < n; i += warps) {
    const int64_t row = int64_t(dest_row[i]) - row_lo;
    if (dest_rank[i] != 0 || row < 0 || row >= rows) continue;
    const W* from = scatter ? src + (i / src_div) * row_words : src + row * row_words;
    W* to = scatter ? dst + row * row_words : dst + i * row_words;
    for (int64_t w0 = lane; w0 < row_words; w0 += 32 * kInFlight) {
      W v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (w0 + 32 * u < row_words) v[u] = from[w0 + 32 * u];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (w0 + 32 * u < row_words) to[w0 + 32 * u] = v[u];
    }
  }
}

// Dispatch of token rows (src_div > 1): one warp per source row, which it reads once and writes
// to the window row of each of its src_div entries (instead of re-reading it per entry).
template <class W>
__global__ void __launch_bounds__(kRowThreads)
    scatter_token_rows_kernel(int64_t n, const int32_t* __restrict__ dest_rank,
                              const int32_t* __restrict__ dest_row, int64_t row_lo,
                              int64_t rows, int src_div, const W* __restrict__ src,
                              W* __restrict__ dst, int64_t row_words) {
  constexpr int kInFlight = 8;
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t src_rows = (n + src_div - 1) / src_div;
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < src_rows;
       r += warps) {
    const int64_t i_begin = r * src_div, i_end = i_begin + src_div < n ? i_begin + src_div : n;
    bool any = false;
    for (int64_t i = i_begin; i < i_end; ++i) {
      const int64_t row = int64_t(dest_row[i]) - row_lo;
      any = any || (dest_rank[i] == 0 && row >= 0 && row < rows);
    }
    if (!any) continue;
    const W* from = src + r * row_words;
    for (int64_t w0 = lane; w0 < row_words; w0 += 32 * kInFlight) {
      W v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (w0 + 32 * u < row_words) v[u] = from[w0 + 32 * u];
      for (int64_t i = i_begin; i < i_end; ++i) {
        const int64_t row = int64_t(dest_row[i]) - row_lo;
        if (dest_rank[i] != 0 || row < 0 || row >= rows) continue;
        W* to = dst + row * row_words;
#pragma unroll
        for (int u = 0; u < kInFlight; ++u)
          if (w0 + 32 * u < row_words) to[w0 + 32 * u] = v[u];
      }
    }
  }
}

// Spare slot s of this rank <- the home slot of the expert the plan puts there.
template <class W>
__global__ void pull_clones_kernel(const int32_t* __restrict__ spare_expert, int spare_slots,
                                   int experts_per_rank, W* weights, int64_t slot_words) {
  const int s = int(blockIdx.y);
  const int e = spare_expert[s];  // rank 0's spare slots come first
  if (e < 0) return;
  const W* from = weights + int64_t(e % experts_per_rank) * slot_words;
  W* to = weights + int64_t(experts_per_rank + s) * slot_words;
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < slot_words;
       w += int64_t(gridDim.x) * blockDim.x)
    to[w] = from[w];
}

// Every home expert adds, in replica order, the gradients of its clones (on this rank: the only
// one).
template <class T>
__global__ void reduce_clones_kernel(const int32_t* __restrict__ replica_rank,
                                     const int32_t* __restrict__ replica_slot, int M,
                                     int experts_per_rank, T* grads, int64_t slot_elems) {
  const int64_t n = int64_t(experts_per_rank) * slot_elems;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = i / slot_elems, x = i - j * slot_elems;
    T acc = grads[i];
    bool any = false;
    for (int rep = 1; rep < M; ++rep) {
      const int64_t at = j * M + rep;  // expert j (rank 0's experts are 0 .. E/R - 1)
      if (replica_rank[at] != 0) continue;
      acc += grads[int64_t(replica_slot[at]) * slot_elems + x];
      any = true;
    }
    if (any) grads[i] = acc;
  }
}

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
    case 16: f(uint4{}); break;
    case 8: f(uint2{}); break;
    case 4: f(uint32_t{}); break;
    case 2: f(uint16_t{}); break;
    default: f(uint8_t{}); break;
  }
}

void move_rows(const RowRoute& route, RoundWindow win, const void* src, void* dst,
               size_t row_bytes, bool scatter, cudaStream_t s) {
  if (route.n == 0 || win.rows == 0 || row_bytes == 0) return;
  MOE_ECHO_CHECK(route.src_div >= 1, "src_div = " << route.src_div);
  with_word(word_size(row_bytes, {src, dst}), [&](auto word) {
    using W = decltype(word);
    if (scatter && route.src_div > 1) {
      const int64_t src_rows = (route.n + route.src_div - 1) / route.src_div;
      MOE_ECHO_LAUNCH(scatter_token_rows_kernel<W>,
                      blocks_for(src_rows, kRowThreads / 32, grid_cap()), kRowThreads, 0, s,
                      route.n, route.dest_rank, route.dest_row, win.row_lo, win.rows,
                      route.src_div, static_cast<const W*>(src), static_cast<W*>(dst),
                      int64_t(row_bytes / sizeof(W)));
      return;
    }
    MOE_ECHO_LAUNCH(move_rows_kernel<W>, blocks_for(route.n, kRowThreads / 32, grid_cap()),
                    kRowThreads, 0, s, route.n, route.dest_rank, route.dest_row, win.row_lo,
                    win.rows, route.src_div, scatter, static_cast<const W*>(src),
                    static_cast<W*>(dst), int64_t(row_bytes / sizeof(W)));
  });
}

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }

  SymmetricBuffer alloc_symmetric(Backend& backend, size_t bytes) override {
    SymmetricBuffer buf;
    buf.local = backend.allocate(bytes);
    buf.bytes = bytes;
    buf.id = next_id_++;
    return buf;
  }
  void free_symmetric(Backend& backend, SymmetricBuffer& buf) override {
    if (!buf.local) return;
    backend.deallocate(buf.local);
    buf.local = nullptr;
  }
  void barrier() override {}

  void all_gather_i32(const int32_t* local, int32_t* all, int64_t n, Stream s) override {
    if (n > 0 && all != local)
      MOE_ECHO_CUDA_CHECK(cudaMemcpyAsync(all, local, size_t(n) * sizeof(int32_t),
                                          cudaMemcpyDeviceToDevice, as_cuda(s)));
  }
  void all_reduce_sum(const Tensor& t, Stream) override {
    MOE_ECHO_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64,
                   "all_reduce_sum supports f32 and f64, not " << to_string(t.dtype));
  }
  void dispatch(const RowRoute& route, RoundWindow window, const void* src, size_t row_bytes,
                const SymmetricBuffer& recv, Stream s) override {
    move_rows(route, window, src, recv.local, row_bytes, true, as_cuda(s));
  }
  void combine(const RowRoute& route, RoundWindow window, const SymmetricBuffer& out,
               size_t row_bytes, void* gathered, Stream s) override {
    move_rows(route, window, out.local, gathered, row_bytes, false, as_cuda(s));
  }
  void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& weights, size_t slot_bytes, Stream s) override {
    MOE_ECHO_CHECK(cfg.ranks == 1, "the local communicator has one rank, the plan " << cfg.ranks);
    if (cfg.spare_slots == 0 || slot_bytes == 0) return;
    with_word(word_size(slot_bytes, {weights.local}), [&](auto word) {
      using W = decltype(word);
      const int64_t words = int64_t(slot_bytes / sizeof(W));
      const dim3 grid(blocks_for(words, 256, 64), unsigned(cfg.spare_slots));
      MOE_ECHO_LAUNCH(pull_clones_kernel<W>, grid, 256, 0, as_cuda(s), plan.spare_expert,
                      cfg.spare_slots, cfg.experts_per_rank(), static_cast<W*>(weights.local),
                      words);
    });
  }
  void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& grads, int64_t slot_elems, DType dtype,
                          Stream s) override {
    MOE_ECHO_CHECK(cfg.ranks == 1, "the local communicator has one rank, the plan " << cfg.ranks);
    const int64_t n = int64_t(cfg.experts_per_rank()) * slot_elems;
    const unsigned grid = blocks_for(n, 256, grid_cap());
    if (dtype == DType::f32)
      MOE_ECHO_LAUNCH(reduce_clones_kernel<float>, grid, 256, 0, as_cuda(s), plan.replica_rank,
                      plan.replica_slot, cfg.max_replicas(), cfg.experts_per_rank(),
                      static_cast<float*>(grads.local), slot_elems);
    else if (dtype == DType::f64)
      MOE_ECHO_LAUNCH(reduce_clones_kernel<double>, grid, 256, 0, as_cuda(s), plan.replica_rank,
                      plan.replica_slot, cfg.max_replicas(), cfg.experts_per_rank(),
                      static_cast<double*>(grads.local), slot_elems);
    else
      MOE_ECHO_CHECK(false, "clone gradient reduction supports f32 and f64, not "
                                << to_string(dtype));
  }

 private:
  int next_id_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator() {
  return std::make_unique<LocalCommunicator>();
}

}  // namespace moe_echo::cuda
