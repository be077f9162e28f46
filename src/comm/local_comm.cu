// The single-GPU communicator (EP size 1): what the expert-parallel exchanges reduce to when every
// expert lives on this GPU, so MoeLayer runs on the CUDA backend without NCCL. Symmetric buffers
// are plain device allocations; all_gather is a device copy; all_reduce has nothing to add;
// dispatch copies each token's row once into its lead row and writes the fan table, combine adds
// each token's lead row back (one warp per token, the widest word the alignment allows); the
// clone kernels read the plan on the device. Every op is enqueued on the given stream and is
// capture-safe.
//
// With one rank, all of a token's entries in a window go to rank 0: a token has at most one lead
// per window, its entry in the window with the lowest window row, and its members are all its
// entries in the window. Entries whose rank is not 0 (-1: unrouted) are in no window. With chunks
// (RowRoute::chunks) a dispatch moves the tokens whose lead row is in its chunk, a combine sums
// those whose last entry row is.
#include "comm/comm_args.hpp"
#include "comm/token_lanes.cuh"
#include "cuda/common.cuh"
#include "cuda/cuda_backend.hpp"
#include "cuda/warp_copy.cuh"
#include "moe_echo/comm.hpp"
#include "moe_echo/config.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

constexpr int kRowThreads = 256;  // 8 warps, one token each
constexpr int kInFlight = 8;      // words per lane loaded before any is stored

// Token t's entries in the window: lane k < K holds entry t K + k's window row; the ballot of the
// lanes whose entry is in the window.
struct TokenEntries {
  int64_t row;
  bool in;
  unsigned mask;
};

__device__ __forceinline__ TokenEntries token_entries(const int32_t* __restrict__ dest_rank,
                                                      const int32_t* __restrict__ dest_row,
                                                      int64_t t, int K, int64_t row_lo,
                                                      int64_t rows, int lane) {
  TokenEntries e{-1, false, 0u};
  if (lane < K) {
    const int64_t i = t * K + lane;
    e.row = int64_t(dest_row[i]) - row_lo;
    e.in = dest_rank[i] == 0 && e.row >= 0 && e.row < rows;
  }
  e.mask = __ballot_sync(0xffffffffu, e.in);
  return e;
}

// Dispatch: per token with entries in the window (and its lead row in the chunk), the fan table
// of its lead row p (p first, then its other members' window rows in k order, then -1; their
// weights), members[q][0] = -1 for its other member rows q, and row t of src copied into row p
// of recv.
template <class W>
__global__ void __launch_bounds__(kRowThreads)
    dispatch_kernel(int64_t tokens, int K, const int32_t* __restrict__ dest_rank,
                    const int32_t* __restrict__ dest_row, const float* __restrict__ weight,
                    int64_t row_lo, int64_t rows, RowChunks chunks, const W* __restrict__ src,
                    W* __restrict__ recv, int64_t row_words, int32_t* __restrict__ members,
                    float* __restrict__ weights) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t < tokens; t += warps) {
    const TokenEntries e = token_entries(dest_rank, dest_row, t, K, row_lo, rows, lane);
    if (e.mask == 0) continue;
    const int64_t p = group_low_row(e.row, e.mask, K);
    if (row_chunk(chunks, 0, p) != chunks.chunk) continue;
    const unsigned lead_bit = __ballot_sync(0xffffffffu, e.in && e.row == p);
    const int count = __popc(e.mask);
    if (e.in) {
      const int m = member_slot(e.mask, lead_bit, lane);
      members[p * K + m] = int32_t(e.row);
      weights[p * K + m] = weight != nullptr ? weight[t * K + lane] : 1.f;
      if (e.row != p) members[e.row * K] = -1;
    }
    if (lane >= count && lane < K) members[p * K + lane] = -1;
    warp_copy_row<kInFlight>(recv + p * row_words, src + t * row_words, row_words, lane);
  }
}

// Combine: y[t] = (accumulate ? y[t] : 0) + red[lead row], in f32, rounded once (a plain copy
// when not accumulating: one row's sum is the row); tokens with no entry in the window keep y[t]
// or get 0. values_out[i] <- values[row of entry i] for every entry in the window. With chunks,
// the tokens the call sums only (combine_sums).
template <class W, class T>
__global__ void __launch_bounds__(kRowThreads)
    combine_kernel(int64_t tokens, int K, const int32_t* __restrict__ dest_rank,
                   const int32_t* __restrict__ dest_row, int64_t row_lo, int64_t rows,
                   RowChunks chunks, const W* __restrict__ red, W* __restrict__ y,
                   int64_t row_words, const int32_t* __restrict__ accumulate,
                   const float* __restrict__ values, float* __restrict__ values_out) {
  using Word = RowWord<W, T>;
  constexpr int N = Word::n;
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const bool add = accumulate != nullptr && *accumulate != 0;
  for (int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t < tokens; t += warps) {
    const TokenEntries e = token_entries(dest_rank, dest_row, t, K, row_lo, rows, lane);
    if (!combine_sums(chunks, e.in, 0, e.row)) continue;
    if (values_out != nullptr && e.in) values_out[t * K + lane] = values[e.row];
    W* y_row = y + t * row_words;
    if (e.mask == 0) {
      if (add) continue;
      const float z[N] = {};
      const W zero = Word::pack(z);
      for (int64_t w = lane; w < row_words; w += 32) y_row[w] = zero;
      continue;
    }
    const int64_t p = group_low_row(e.row, e.mask, K);
    const W* r_row = red + p * row_words;
    for (int64_t w0 = lane; w0 < row_words; w0 += 32 * kInFlight) {
      W r[kInFlight], o[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (w0 + 32 * u < row_words) {
          r[u] = r_row[w0 + 32 * u];
          if (add) o[u] = y_row[w0 + 32 * u];
        }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (w0 + 32 * u < row_words) {
          if (add) {
            float a[N], b[N];
            Word::unpack(o[u], a);
            Word::unpack(r[u], b);
#pragma unroll
            for (int i = 0; i < N; ++i) a[i] += b[i];
            y_row[w0 + 32 * u] = Word::pack(a);
          } else {
            y_row[w0 + 32 * u] = r[u];
          }
        }
    }
  }
}

// Spare slot s of this rank <- the home slot of the expert the plan puts there.
template <class W>
__global__ void pull_clones_kernel(const int32_t* __restrict__ spare_expert, int spare_slots,
                                   int experts_per_rank, const W* home, W* spare,
                                   int64_t slot_words) {
  const int s = int(blockIdx.y);
  const int e = spare_expert[s];  // rank 0's spare slots come first
  if (e < 0) return;
  const W* from = home + int64_t(e % experts_per_rank) * slot_words;
  W* to = spare + int64_t(s) * slot_words;
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < slot_words;
       w += int64_t(gridDim.x) * blockDim.x)
    to[w] = from[w];
}

// Every home expert with clones adds, in replica order, the gradients of its clones (on this
// rank: the only one); experts without clones are not read (at one rank the planner places none,
// and a pass over every home gradient would cost as much as a GEMM).
template <class T>
__global__ void reduce_clones_kernel(const int32_t* __restrict__ replica_rank,
                                     const int32_t* __restrict__ replica_slot, int M,
                                     int experts_per_rank, const T* spare, T* home,
                                     int64_t slot_elems) {
  for (int j = 0; j < experts_per_rank; ++j) {  // expert j (rank 0's experts are 0 .. E/R - 1)
    bool any = false;
    for (int rep = 1; rep < M; ++rep) any |= replica_rank[j * M + rep] == 0;
    if (!any) continue;
    T* to = home + int64_t(j) * slot_elems;
    for (int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; x < slot_elems;
         x += int64_t(gridDim.x) * blockDim.x) {
      T acc = to[x];
      for (int rep = 1; rep < M; ++rep) {
        const int64_t at = int64_t(j) * M + rep;
        if (replica_rank[at] != 0) continue;
        acc += spare[int64_t(replica_slot[at] - experts_per_rank) * slot_elems + x];
      }
      to[x] = acc;
    }
  }
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
    comm_args::check_sum_dtype("all_reduce_sum", t.dtype);
  }
  void dispatch(const RowRoute& route, RoundWindow window, const void* src, size_t row_bytes,
                const SymmetricBuffer& recv, const FanTable& fan, Stream s) override {
    comm_args::check_route("dispatch", route, window, fan, {DType::f32});  // CUDA's f32 fan table
    comm_args::check_window_fits("dispatch", window, recv, row_bytes, fan);
    const int64_t tokens = route.n / route.top_k;
    if (tokens == 0 || window.rows == 0 || row_bytes == 0) return;
    with_word(word_size(row_bytes, {src, recv.local}), [&](auto word) {
      using W = decltype(word);
      MOE_ECHO_LAUNCH(
          dispatch_kernel<W>, blocks_for(tokens, kRowThreads / 32, grid_cap()), kRowThreads, 0,
          as_cuda(s), tokens, route.top_k, route.dest_rank, route.dest_row,
          static_cast<const float*>(route.weight), window.row_lo, window.rows, route.chunks,
          static_cast<const W*>(src), static_cast<W*>(recv.local), int64_t(row_bytes / sizeof(W)),
          static_cast<int32_t*>(fan.members.local), static_cast<float*>(fan.weights.local));
    });
  }
  void combine(const RowRoute& route, RoundWindow window, const SymmetricBuffer& red,
               const Tensor& y, const int32_t* accumulate, const FanTable& fan, void* values_out,
               Stream s) override {
    comm_args::check_route("combine", route, window, fan, {DType::f32});
    comm_args::check_combine_rows(route, y, {DType::bf16, DType::f32});
    const size_t row_bytes = size_t(y.size(1)) * dtype_size(y.dtype);
    comm_args::check_window_fits("combine", window, red, row_bytes, fan);
    const int64_t tokens = y.size(0);
    if (tokens == 0) return;
    const unsigned grid = blocks_for(tokens, kRowThreads / 32, grid_cap());
    auto run = [&](auto word, auto element) {
      using W = decltype(word);
      using T = decltype(element);
      MOE_ECHO_LAUNCH((combine_kernel<W, T>), grid, kRowThreads, 0, as_cuda(s), tokens, route.top_k,
                      route.dest_rank, route.dest_row, window.row_lo, window.rows, route.chunks,
                      static_cast<const W*>(red.local), static_cast<W*>(y.data),
                      int64_t(row_bytes / sizeof(W)), accumulate,
                      static_cast<const float*>(fan.values.local), static_cast<float*>(values_out));
    };
    const bool vec = row_bytes % 16 == 0 && aligned16(y.data) && aligned16(red.local);
    if (y.dtype == DType::bf16) {
      if (vec)
        run(uint4{}, bf16{});
      else
        run(bf16{}, bf16{});
    } else {
      if (vec)
        run(uint4{}, float{});
      else
        run(float{}, float{});
    }
  }
  void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& home, void* spare, size_t slot_bytes,
                          Stream s) override {
    comm_args::check_plan("pull_clone_weights", cfg, 1);
    if (cfg.spare_slots == 0 || slot_bytes == 0) return;
    with_word(word_size(slot_bytes, {home.local, spare}), [&](auto word) {
      using W = decltype(word);
      const int64_t words = int64_t(slot_bytes / sizeof(W));
      const dim3 grid(blocks_for(words, 256, 64), unsigned(cfg.spare_slots));
      MOE_ECHO_LAUNCH(pull_clones_kernel<W>, grid, 256, 0, as_cuda(s), plan.spare_expert,
                      cfg.spare_slots, cfg.experts_per_rank(), static_cast<const W*>(home.local),
                      static_cast<W*>(spare), words);
    });
  }
  void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& spare, void* home, int64_t slot_elems, DType dtype,
                          Stream s) override {
    comm_args::check_plan("reduce_clone_grads", cfg, 1);
    comm_args::check_sum_dtype("reduce_clone_grads", dtype);
    if (cfg.spare_slots == 0 || cfg.max_replicas() == 1 || slot_elems == 0) return;
    const unsigned grid = blocks_for(slot_elems, 256, grid_cap());
    if (dtype == DType::f32)
      MOE_ECHO_LAUNCH(reduce_clones_kernel<float>, grid, 256, 0, as_cuda(s), plan.replica_rank,
                      plan.replica_slot, cfg.max_replicas(), cfg.experts_per_rank(),
                      static_cast<const float*>(spare.local), static_cast<float*>(home),
                      slot_elems);
    else
      MOE_ECHO_LAUNCH(reduce_clones_kernel<double>, grid, 256, 0, as_cuda(s), plan.replica_rank,
                      plan.replica_slot, cfg.max_replicas(), cfg.experts_per_rank(),
                      static_cast<const double*>(spare.local), static_cast<double*>(home),
                      slot_elems);
  }

 private:
  int next_id_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator() {
  return std::make_unique<LocalCommunicator>();
}

}  // namespace moe_echo::cuda
