// Fan out and fan in on the GPU: the receiver's side of a token's members (FanTable in comm.hpp,
// FanArgs in backend.hpp). Semantics: src/cpu/fan.cpp. bf16 rows, f32 weights, f32 arithmetic.
//
// One warp per lead row. A first kernel lists the lead rows of the valid prefix (a ballot per 32
// rows, one atomic per warp: the list's order varies, what each lead computes does not); the fan
// kernel's warps, all resident, then take list entries w, w + W, w + 2W, ..., so every warp gets
// the same number of leads to within one, however the leads lie in the window (a token's lead is
// its lowest member row, so leads come in runs, and a hot expert's rows are nearly all leads).
// With a chunk (FanArgs::chunk) the list holds that chunk's leads only.
// The valid-row bound and the list length are read on the device; grids depend on host shapes
// only. The list lives in the backend's scratch arena (fan_scratch_bytes).
//
// Per lead row p, the K member rows and weights are read once (lane m holds member m), then the
// row is walked in chunks of a few words per lane:
// - fan_out: the chunk of src[p] is loaded once and written to every member j as w_j * src[p].
//   With d_weight, two members' chunks of `other` are loaded at a time and each one's part of
//   <src[p], other[j]> summed over the warp (a fixed butterfly) and kept by lane m; a lane reads
//   its words of other[j] before it writes the same words of dst[j], so dst == other is safe.
//   With dst == src (the unweighted copy) row p itself is not written.
// - fan_in: the members' chunks are summed in member order in f32 and dst[p] is written once
//   (after its lane read those words of every member, so dst may be src).
// Every sum has a fixed order: results are bit-identical run to run.
//
// Bytes (bf16, L leads of m members): fan_out reads L rows (and L m rows of `other`) and writes
// L m rows (L (m - 1) in place); fan_in reads L m rows and writes L rows. Rows move as 16-byte
// words of 8 bf16 when H % 8 == 0 and every base is 16-byte aligned; otherwise as single bf16.
#include "cuda/common.cuh"
#include "cuda/ops.hpp"
#include "moe_echo/config.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

constexpr int kFanThreads = 256;
// Resident blocks per SM (the launch bounds cap the registers to fit): 32 warps per SM, 24 for
// fan_out with d_weight (which holds a chunk of src[p] and two of `other`).
constexpr int kFanBlocksPerSm = 4, kFanGradBlocksPerSm = 3;
// Words per lane per row and step: fan_out loads one chunk of src[p] (and of two members' rows of
// `other`) at a time; fan_in loads the chunks of kInUnroll members before it adds them.
constexpr int kOutChunk = 4, kInChunk = 2, kInUnroll = 4;

// Lead row p's members: lane m < count holds member m's window row and weight.
struct Lead {
  int64_t row;   // -1 on lanes past the last member
  float weight;  // 1 without weights
  int count;     // members, p included (member 0 is p)
};

__device__ __forceinline__ Lead load_lead(const int32_t* __restrict__ members,
                                          const float* __restrict__ weights, int64_t p, int K,
                                          int lane) {
  Lead l;
  l.row = lane < K ? members[p * K + lane] : -1;
  // The list ends at the first -1.
  const unsigned present = __ballot_sync(0xffffffffu, l.row >= 0);
  l.count = present == 0xffffffffu ? 32 : __ffs(~present) - 1;
  if (lane >= l.count) l.row = -1;
  l.weight = weights != nullptr && lane < l.count ? weights[p * K + lane] : 1.f;
  return l;
}

// The largest member row of lead row p.
__device__ __forceinline__ int64_t last_member(const int32_t* __restrict__ members, int64_t p,
                                               int K) {
  int64_t last = p;
  for (int m = 0; m < K; ++m) {
    const int32_t j = members[p * K + m];
    if (j < 0) break;
    last = j > last ? j : last;
  }
  return last;
}

// The lead rows of the valid prefix into leads[0, *count) (*count zeroed before); with a chunk
// (FanArgs::chunk: window rows [lo, hi) = [chunk[0], chunk[1])), those with lo <= p < hi, or
// with by_last (fan_in) those with p < hi whose last member lies in [lo, hi).
__global__ void __launch_bounds__(kFanThreads)
    find_leads_kernel(const int32_t* __restrict__ offsets, int groups, int64_t row_lo, int64_t rows,
                      int K, const int32_t* __restrict__ members, const int32_t* __restrict__ chunk,
                      bool by_last, int32_t* __restrict__ count, int32_t* __restrict__ leads) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t valid = valid_window_rows(offsets, groups, row_lo, rows);
  int64_t lo = 0, hi = valid;
  const bool by_chunk_last = chunk && by_last;
  const int64_t last_lo = chunk ? chunk[0] : 0, last_hi = chunk ? chunk[1] : 0;
  if (chunk) {
    hi = min(valid, int64_t(chunk[1]));
    if (!by_last) lo = chunk[0];
  }
  for (int64_t p0 = lo + int64_t(blockIdx.x) * blockDim.x; p0 < hi;
       p0 += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = p0 + threadIdx.x;
    bool lead = p < hi && members[p * K] == p;
    if (lead && by_chunk_last) {
      const int64_t last = last_member(members, p, K);
      lead = last >= last_lo && last < last_hi;
    }
    const unsigned mask = __ballot_sync(0xffffffffu, lead);
    int base = 0;
    if (lane == 0 && mask != 0) base = atomicAdd(count, __popc(mask));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (lead) leads[base + __popc(mask & ((1u << lane) - 1u))] = int32_t(p);
  }
}

// body(p) for the listed lead rows that fall to this warp (p is warp-uniform).
template <class F>
__device__ __forceinline__ void for_each_lead(const int32_t* __restrict__ count,
                                              const int32_t* __restrict__ leads, F&& body) {
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t n = *count;
  for (int64_t i = warp; i < n; i += warps) body(int64_t(leads[i]));
}

template <class W, bool kGrad>
__global__ void __launch_bounds__(kFanThreads, kGrad ? kFanGradBlocksPerSm : kFanBlocksPerSm)
    fan_out_kernel(const int32_t* __restrict__ count, const int32_t* __restrict__ leads, int K,
                   const int32_t* __restrict__ members, const float* __restrict__ weights,
                   const W* src, W* dst, const W* other, float* __restrict__ d_weight,
                   int64_t row_words) {
  using Word = RowWord<W, bf16>;
  constexpr int N = Word::n;
  const int lane = int(threadIdx.x) & 31;
  const bool in_place = src == dst;
  const bool weighted = weights != nullptr;
  for_each_lead(count, leads, [&](int64_t p) {
    const Lead lead = load_lead(members, weights, p, K, lane);
    const W* s_row = src + p * row_words;
    // dst[j] <- w * s for the words of this chunk.
    auto store = [&](int64_t j, float w, const W(&s)[kOutChunk], int64_t c0) {
      W* d_row = dst + j * row_words;
#pragma unroll
      for (int u = 0; u < kOutChunk; ++u)
        if (c0 + 32 * u < row_words) {
          if (weighted) {
            float f[N];
            Word::unpack(s[u], f);
#pragma unroll
            for (int e = 0; e < N; ++e) f[e] *= w;
            d_row[c0 + 32 * u] = Word::pack(f);
          } else {
            d_row[c0 + 32 * u] = s[u];
          }
        }
    };
    float dot = 0.f;  // lane m: member m's <src[p], other[j]>
    for (int64_t c0 = lane; c0 - lane < row_words; c0 += 32 * kOutChunk) {
      W s[kOutChunk];
#pragma unroll
      for (int u = 0; u < kOutChunk; ++u)
        if (c0 + 32 * u < row_words) s[u] = s_row[c0 + 32 * u];
      if constexpr (kGrad) {
        // Two members at a time: both chunks of `other` in flight before either is used.
        for (int m = 0; m < lead.count; m += 2) {
          const bool two = m + 1 < lead.count;
          const int64_t j0 = __shfl_sync(0xffffffffu, lead.row, m);
          const int64_t j1 = __shfl_sync(0xffffffffu, lead.row, two ? m + 1 : m);
          const float w0 = __shfl_sync(0xffffffffu, lead.weight, m);
          const float w1 = __shfl_sync(0xffffffffu, lead.weight, two ? m + 1 : m);
          W o0[kOutChunk], o1[kOutChunk];
#pragma unroll
          for (int u = 0; u < kOutChunk; ++u)
            if (c0 + 32 * u < row_words) {
              o0[u] = other[j0 * row_words + c0 + 32 * u];
              if (two) o1[u] = other[j1 * row_words + c0 + 32 * u];
            }
          float part0 = 0.f, part1 = 0.f;
#pragma unroll
          for (int u = 0; u < kOutChunk; ++u)
            if (c0 + 32 * u < row_words) {
              float sf[N], f0[N];
              Word::unpack(s[u], sf);
              Word::unpack(o0[u], f0);
#pragma unroll
              for (int e = 0; e < N; ++e) part0 = fmaf(sf[e], f0[e], part0);
              if (two) {
                float f1[N];
                Word::unpack(o1[u], f1);
#pragma unroll
                for (int e = 0; e < N; ++e) part1 = fmaf(sf[e], f1[e], part1);
              }
            }
          part0 = warp_sum(part0);
          part1 = warp_sum(part1);
          if (lane == m) dot += part0;
          if (two && lane == m + 1) dot += part1;
          store(j0, w0, s, c0);
          if (two) store(j1, w1, s, c0);
        }
      } else {
        for (int m = 0; m < lead.count; ++m) {
          const int64_t j = __shfl_sync(0xffffffffu, lead.row, m);
          const float w = __shfl_sync(0xffffffffu, lead.weight, m);
          if (!(in_place && j == p)) store(j, w, s, c0);
        }
      }
    }
    if (kGrad && lane < lead.count) d_weight[lead.row] = dot;
  });
}

template <class W>
__global__ void __launch_bounds__(kFanThreads, kFanBlocksPerSm)
    fan_in_kernel(const int32_t* __restrict__ count, const int32_t* __restrict__ leads, int K,
                  const int32_t* __restrict__ members, const float* __restrict__ weights,
                  const W* src, W* dst, int64_t row_words) {
  using Word = RowWord<W, bf16>;
  constexpr int N = Word::n;
  const int lane = int(threadIdx.x) & 31;
  for_each_lead(count, leads, [&](int64_t p) {
    const Lead lead = load_lead(members, weights, p, K, lane);
    W* d_row = dst + p * row_words;  // dst may be src: each lane reads its words, then writes them
    for (int64_t c0 = lane; c0 - lane < row_words; c0 += 32 * kInChunk) {
      float acc[kInChunk][N];
#pragma unroll
      for (int u = 0; u < kInChunk; ++u)
#pragma unroll
        for (int e = 0; e < N; ++e) acc[u][e] = 0.f;
#pragma unroll kInUnroll
      for (int m = 0; m < lead.count; ++m) {
        const int64_t j = __shfl_sync(0xffffffffu, lead.row, m);
        const float w = __shfl_sync(0xffffffffu, lead.weight, m);
        const W* s_row = src + j * row_words;
        W v[kInChunk];
#pragma unroll
        for (int u = 0; u < kInChunk; ++u)
          if (c0 + 32 * u < row_words) v[u] = s_row[c0 + 32 * u];
#pragma unroll
        for (int u = 0; u < kInChunk; ++u)
          if (c0 + 32 * u < row_words) {
            float f[N];
            Word::unpack(v[u], f);
#pragma unroll
            for (int e = 0; e < N; ++e) acc[u][e] = fmaf(w, f[e], acc[u][e]);
          }
      }
#pragma unroll
      for (int u = 0; u < kInChunk; ++u)
        if (c0 + 32 * u < row_words) d_row[c0 + 32 * u] = Word::pack(acc[u]);
    }
  });
}

void check_rows(const Tensor& t, const char* name, int64_t rows, int64_t H) {
  MOE_ECHO_CHECK(
      t.dtype == DType::bf16 && t.ndim == 2 && t.size(0) >= rows && t.size(1) == H,
      "fan: " << name << " must be bf16 [>= " << rows << ", " << H << "], got " << t.describe());
}

// The shapes both ops share; returns K.
int check_fan(const FanArgs& a) {
  const int64_t rows = a.window.rows, H = a.src.ndim == 2 ? a.src.size(1) : -1;
  MOE_ECHO_CHECK(rows >= 0 && a.window.groups >= 0 && a.window.group_offsets != nullptr,
                 "fan: window of " << rows << " rows, " << a.window.groups << " groups");
  check_rows(a.src, "src", rows, H);
  check_rows(a.dst, "dst", rows, H);
  MOE_ECHO_CHECK(a.members.dtype == DType::i32 && a.members.ndim == 2 &&
                     a.members.size(0) >= rows && a.members.size(1) >= 1 &&
                     a.members.size(1) <= kMaxTopK,
                 "fan: members must be i32 [>= " << rows << ", K <= " << kMaxTopK << "], got "
                                                 << a.members.describe());
  const int64_t K = a.members.size(1);
  MOE_ECHO_CHECK(
      a.weights.data == nullptr || (a.weights.dtype == DType::f32 && a.weights.ndim == 2 &&
                                    a.weights.size(0) >= rows && a.weights.size(1) == K),
      "fan: weights must be f32 [>= " << rows << ", " << K << "], got " << a.weights.describe());
  return int(K);
}

// The lead list of the window in the scratch arena: [count, pad to 256 bytes, leads[rows]].
struct LeadList {
  int32_t* count;
  int32_t* leads;
};

LeadList list_leads(const GroupWindow& w, const Tensor& members, int K, const int32_t* chunk,
                    bool by_last, void* scratch, cudaStream_t s) {
  ScratchCarver c(scratch);
  LeadList l{c.take<int32_t>(1), c.take<int32_t>(w.rows)};
  MOE_ECHO_CUDA_CHECK(cudaMemsetAsync(l.count, 0, sizeof(int32_t), s));
  MOE_ECHO_LAUNCH(find_leads_kernel, blocks_for(w.rows, kFanThreads, grid_cap()), kFanThreads, 0, s,
                  w.group_offsets, w.groups, w.row_lo, w.rows, K, members.as<int32_t>(), chunk,
                  by_last, l.count, l.leads);
  return l;
}
LeadList list_leads(const FanArgs& a, int K, bool by_last, void* scratch, cudaStream_t s) {
  return list_leads(a.window, a.members, K, a.chunk, by_last, scratch, s);
}

// Blocks for the fan kernels: what the GPU holds at once, and no more warps than rows.
unsigned fan_grid(int64_t rows, int blocks_per_sm) {
  return blocks_for(rows, kFanThreads / 32, int64_t(sm_count()) * blocks_per_sm);
}

// Fp8FanArgs: per lead row and member (in member order, warp-uniform), the packed row's value
// words (16 bytes when aligned) and scales are copied to the member's q and scale rows; the
// lead's row is read from L1/L2 after the first member.
template <class W>
__global__ void __launch_bounds__(kFanThreads, kFanBlocksPerSm)
    fan_out_fp8_kernel(const int32_t* __restrict__ count, const int32_t* __restrict__ leads, int K,
                       const int32_t* __restrict__ members, const uint8_t* __restrict__ src,
                       int64_t pitch, int64_t H, int64_t scales, uint8_t* __restrict__ q,
                       float* __restrict__ scale) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t words = H / int64_t(sizeof(W));
  for_each_lead(count, leads, [&](int64_t p) {
    const Lead lead = load_lead(members, nullptr, p, K, lane);
    const W* s_row = reinterpret_cast<const W*>(src + p * pitch);
    const float* s_scales = reinterpret_cast<const float*>(src + p * pitch + H);
    for (int m = 0; m < lead.count; ++m) {
      const int64_t j = __shfl_sync(0xffffffffu, lead.row, m);
      W* d_row = reinterpret_cast<W*>(q + j * H);
      for (int64_t c = lane; c < words; c += 32) d_row[c] = s_row[c];
      for (int64_t c = lane; c < scales; c += 32) scale[j * scales + c] = s_scales[c];
    }
  });
}

}  // namespace

size_t fan_scratch_bytes(int64_t rows) {
  ScratchCarver c(nullptr);
  c.take<int32_t>(1);
  c.take<int32_t>(rows);
  return c.used();
}

void fan_out(const FanArgs& a, void* scratch, cudaStream_t s) {
  const int K = check_fan(a);
  const int64_t rows = a.window.rows, H = a.src.size(1);
  const bool grad = a.d_weight.data != nullptr;
  MOE_ECHO_CHECK(!(a.weights.data != nullptr && a.dst.data == a.src.data),
                 "fan_out in place (dst == src) copies unweighted: pass no weights");
  MOE_ECHO_CHECK(!grad || a.other.data != nullptr, "fan_out: d_weight needs `other`");
  if (a.other.data) check_rows(a.other, "other", rows, H);
  MOE_ECHO_CHECK(
      !grad || (a.d_weight.dtype == DType::f32 && a.d_weight.numel() >= rows),
      "fan_out: d_weight must be f32 [>= " << rows << "], got " << a.d_weight.describe());
  if (rows == 0 || H == 0) return;
  const LeadList l = list_leads(a, K, false, scratch, s);
  const unsigned grid = fan_grid(rows, grad ? kFanGradBlocksPerSm : kFanBlocksPerSm);
  auto run = [&](auto word) {
    using W = decltype(word);
    const int64_t row_words = H * int64_t(sizeof(bf16)) / int64_t(sizeof(W));
    const W* src = static_cast<const W*>(a.src.data);
    W* dst = static_cast<W*>(a.dst.data);
    const W* other = static_cast<const W*>(a.other.data);
    if (grad)
      MOE_ECHO_LAUNCH((fan_out_kernel<W, true>), grid, kFanThreads, 0, s, l.count, l.leads, K,
                      a.members.as<int32_t>(), a.weights.as<float>(), src, dst, other,
                      a.d_weight.as<float>(), row_words);
    else
      MOE_ECHO_LAUNCH((fan_out_kernel<W, false>), grid, kFanThreads, 0, s, l.count, l.leads, K,
                      a.members.as<int32_t>(), a.weights.as<float>(), src, dst, other, nullptr,
                      row_words);
  };
  if (H % 8 == 0 && aligned16(a.src.data) && aligned16(a.dst.data) &&
      (a.other.data == nullptr || aligned16(a.other.data)))
    run(uint4{});
  else
    run(bf16{});
}

void fan_in(const FanArgs& a, void* scratch, cudaStream_t s) {
  const int K = check_fan(a);
  const int64_t rows = a.window.rows, H = a.src.size(1);
  if (rows == 0 || H == 0) return;
  const LeadList l = list_leads(a, K, true, scratch, s);
  const unsigned grid = fan_grid(rows, kFanBlocksPerSm);
  auto run = [&](auto word) {
    using W = decltype(word);
    const int64_t row_words = H * int64_t(sizeof(bf16)) / int64_t(sizeof(W));
    MOE_ECHO_LAUNCH(fan_in_kernel<W>, grid, kFanThreads, 0, s, l.count, l.leads, K,
                    a.members.as<int32_t>(), a.weights.as<float>(),
                    static_cast<const W*>(a.src.data), static_cast<W*>(a.dst.data), row_words);
  };
  if (H % 8 == 0 && aligned16(a.src.data) && aligned16(a.dst.data))
    run(uint4{});
  else
    run(bf16{});
}

void fan_out_fp8(const Fp8FanArgs& a, void* scratch, cudaStream_t s) {
  const int64_t scales = check_fp8_fan_args(a), rows = a.window.rows, H = a.q.size(1);
  const int K = int(a.members.size(1));
  MOE_ECHO_CHECK(K <= kMaxTopK,
                 "fan_out_fp8: members " << a.members.describe() << ", K <= " << kMaxTopK);
  if (rows == 0 || H == 0) return;
  const LeadList l = list_leads(a.window, a.members, K, a.chunk, false, scratch, s);
  const unsigned grid = fan_grid(rows, kFanBlocksPerSm);
  const int64_t pitch = fp8_packed_row_bytes(H);
  auto run = [&](auto word) {
    MOE_ECHO_LAUNCH(fan_out_fp8_kernel<decltype(word)>, grid, kFanThreads, 0, s, l.count, l.leads,
                    K, a.members.as<int32_t>(), a.src.as<uint8_t>(), pitch, H, scales,
                    a.q.as<uint8_t>(), a.scale.as<float>());
  };
  if (H % 16 == 0 && aligned16(a.src.data) && aligned16(a.q.data))
    run(uint4{});
  else
    run(uint8_t{});
}

}  // namespace moe_echo::cuda
