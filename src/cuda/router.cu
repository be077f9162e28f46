// Router on the GPU: logits = x W^T (bf16 x, f32 W, f32 accumulation), scores, top-k by
// score + bias with ties to the lower expert index, combine weights, counts, aux and z losses; the
// backward to dW and dx; the aux-loss-free bias update. Semantics: src/cpu/router.cpp.
//
// Precision: logits accumulate in f32 (fixed order: per lane over its h, then a fixed tree).
// Everything per token after the logits (logsumexp, scores, selection keys, combine weights, the
// loss sums) is computed in double from the stored f32 logits, as the CPU reference does, so for
// equal logits the scores, the selection and the weights agree with the CPU to the last bit in
// practice; the selection can differ from the CPU's only where two keys are within the f32
// rounding of the logits.
// Determinism: counts are integer sums (order-free: shared-memory counters per block of tokens,
// then a sum over blocks); every floating-point sum is done by one thread in a fixed order or by
// a fixed warp tree.
//
// The three f32 products (logits = x W^T, dW += dl^T x, dx += dl W) are FFMA kernels shaped for
// a small E: x is read once per product as words of bf16 (32 MiB at T 8192, H 2048), W (E x H
// f32) stays in L1/L2, and every output is summed in a fixed order. They need H % 8 == 0 and
// 16-byte aligned x, W and dx; other shapes take the generic tiled GEMM (tiled_gemm.cuh). The
// per-token forward (scores, top-k, weights, counts, loss partials) is one kernel for E <= 256.
//
// With E >= kTensorMinExperts and T, E, H multiples of 8 the products run on tensor cores instead
// (the grouped GEMM, one group): every f32 operand (W, dl) is split into three bf16 parts
// hi + mid + lo, each the rounding of what the parts before it left, so their sum is the value
// to about 2^-24 relative; a bf16 x bf16 product is exact in f32 and the GEMM accumulates in f32.
// logits = sum over the three parts of x W_i^T and dW += sum of dl_i^T x (x is bf16, exact): f32
// grade results, in a different summation order than the FFMA kernels. dx += dl W keeps the three
// largest of the nine part products (dl0 W0 + dl0 W1 + dl1 W0, about 2^-16 relative), summed
// in f32 in one GEMM over the concatenated parts and rounded to bf16 once. At E 256, H 7168,
// T 8192 the FFMA kernels took 1.7 (logits), 1.2 (dW) and 2.0 ms (dx) on an H200
// (bench/results/router_ffma_2026-11-21.json).
#include <cfloat>
#include <climits>

#include "cuda/common.cuh"
#include "cuda/grouped_gemm.hpp"
#include "cuda/ops.hpp"
#include "cuda/tiled_gemm.cuh"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

constexpr int kTokensPerLossBlock = 32;
constexpr int kWarpsPerBlock = 8;
// The fused selection kernel (E <= 32 * kMaxExpertsPerLane): one block of kSelectWarps warps per
// kTokensPerLossBlock tokens, one warp per token, each lane holding experts lane + 32 p.
constexpr int kSelectWarps = 16, kMaxExpertsPerLane = 8;
// The gradient w.r.t. the logits is kept as [T, padded_experts(E)] (zeros past E), so the
// products can read 8 experts at a time as aligned float4 words.
constexpr int kExpertPad = 8;
int64_t padded_experts(int64_t E) { return (E + kExpertPad - 1) / kExpertPad * kExpertPad; }
// The tensor-core products (see the top): E at least this, T, E and H multiples of 8.
constexpr int64_t kTensorMinExperts = 32;
bool tensor_shapes(int64_t T, int64_t E, int64_t H) {
  return E >= kTensorMinExperts && T % 8 == 0 && E % 8 == 0 && H % 8 == 0;
}

// logits: one warp per (8 tokens, 8 experts); each lane sums 4 h at a time (h = 4 c .. 4 c + 3
// for c = lane, lane + 32, ...), then a reduce-scatter over the lanes. (Measured: this form ran
// faster than one with 2 h per lane and the next x words loaded one step ahead.)
constexpr int kLogitTokens = 8, kLogitExperts = 8;
// dW: a block of 8 warps owns (256 h, 8 experts) and a range of tokens; the warps take every 8th
// token, their sums are added in warp order, and the token ranges ("splits") in split order.
constexpr int kDwExperts = 8, kDwWarps = 8, kDwTokensInFlight = 4;
// dx: a block of kDxGroups x kDxWords threads owns kDxWords words of 8 h; a thread takes
// kDxTokens tokens per step.
constexpr int kDxTokens = 8, kDxWords = 64, kDxGroups = 4;

bool fast_products(const Tensor& x, const Tensor& w) {
  return x.size(1) % 8 == 0 && aligned16(x.data) && aligned16(w.data);
}
// Token splits of the dW product: enough blocks for two waves, at least 64 tokens per split.
int64_t dw_splits(int64_t T, int64_t E, int64_t H) {
  const int64_t blocks = std::max<int64_t>(1, padded_experts(E) / kDwExperts * ((H / 8 + 31) / 32));
  int64_t splits = (2 * sm_count() + blocks - 1) / blocks;
  splits = std::min<int64_t>(splits, (T + 63) / 64);
  return std::max<int64_t>(splits, 1);
}

struct RouterScratch {
  double* lse = nullptr;        // [T] logsumexp of each token's logits
  double* total = nullptr;      // [T] sum over experts of the (unrounded) scores
  double* partial = nullptr;    // [blocks, E] per-block sums of the normalised scores
  double* partial_z = nullptr;  // [blocks] per-block sums of lse^2
  int32_t* block_counts = nullptr;  // [blocks, E] routes per expert of each block
  float* dl = nullptr;          // [T, padded E] gradient w.r.t. the logits (backward)
  // The tensor-core products (tensor_shapes only): one-group windows {0, H} and {0, T}; x^T
  // [H, T]; W's three parts, transposed [3][H, E] (forward) or as [W0; W1; W0] [3E, H]
  // (backward); dl's parts [3][T, E] and [dl0 | dl0 | dl1] [T, 3E].
  int32_t* offsets = nullptr;
  bf16 *x_t = nullptr, *w_parts = nullptr, *dl_parts = nullptr, *dl_cat = nullptr;
  float* split = nullptr;       // split-K partial sums of the tiled GEMMs
  float* dw_partial = nullptr;  // [splits, padded E, H] per-split sums of the dW product
};

int64_t loss_blocks(int64_t T) { return (T + kTokensPerLossBlock - 1) / kTokensPerLossBlock; }

RouterScratch carve(ScratchCarver& c, int64_t T, int64_t E, int64_t H) {
  RouterScratch r;
  r.lse = c.take<double>(T);
  r.total = c.take<double>(T);
  r.partial = c.take<double>(loss_blocks(T) * E);
  r.partial_z = c.take<double>(loss_blocks(T));
  r.block_counts = c.take<int32_t>(loss_blocks(T) * E);
  r.dl = c.take<float>(T * padded_experts(E));
  r.split = c.take<float>(tiled_gemm_scratch_floats());
  r.dw_partial = c.take<float>(dw_splits(T, E, H) * padded_experts(E) * H);
  // Sized for T rounded up to 8 whatever T is, so the bytes never shrink as T grows (the arena is
  // reserved for max_tokens before any capture).
  const int64_t T8 = (T + 7) / 8 * 8;
  if (tensor_shapes(T8, E, H)) {
    r.offsets = c.take<int32_t>(4);
    r.x_t = c.take<bf16>(H * T8);
    r.w_parts = c.take<bf16>(3 * E * H);
    r.dl_parts = c.take<bf16>(3 * T8 * E);
    r.dl_cat = c.take<bf16>(3 * T8 * E);
  }
  return r;
}

// ---- GEMM operands ----------------------------------------------------------------------------

struct LoadTokenRow {  // A(m = t, k = h) = x[t, h]
  const bf16* x;
  int64_t H;
  __device__ float operator()(int64_t m, int64_t k) const { return __bfloat162float(x[m * H + k]); }
};
struct LoadWeightT {  // B(k = h, n = e) = W[e, h]
  const float* w;
  int64_t H;
  __device__ float operator()(int64_t k, int64_t n) const { return w[n * H + k]; }
};
struct StoreLogits {
  float* l;
  int64_t E;
  __device__ void operator()(int64_t m, int64_t n, float v) const { l[m * E + n] = v; }
};
struct LoadDlT {  // A(m = e, k = t) = dl[t, e]; E: the row stride of dl (padded)
  const float* dl;
  int64_t E;
  __device__ float operator()(int64_t m, int64_t k) const { return dl[k * E + m]; }
};
struct LoadTokenCol {  // B(k = t, n = h) = x[t, h]
  const bf16* x;
  int64_t H;
  __device__ float operator()(int64_t k, int64_t n) const { return __bfloat162float(x[k * H + n]); }
};
struct AccumulateWeightGrad {  // dW[e, h] += acc
  float* dw;
  int64_t H;
  __device__ void operator()(int64_t m, int64_t n, float v) const { dw[m * H + n] += v; }
};
struct LoadDl {  // A(m = t, k = e) = dl[t, e]; E: the row stride of dl (padded)
  const float* dl;
  int64_t E;
  __device__ float operator()(int64_t m, int64_t k) const { return dl[m * E + k]; }
};
struct LoadWeight {  // B(k = e, n = h) = W[e, h]
  const float* w;
  int64_t H;
  __device__ float operator()(int64_t k, int64_t n) const { return w[k * H + n]; }
};
struct AccumulateTokenGrad {  // dx[t, h] += acc (bf16 storage)
  bf16* dx;
  int64_t H;
  __device__ void operator()(int64_t m, int64_t n, float v) const {
    bf16* p = dx + m * H + n;
    *p = __float2bfloat16_rn(__bfloat162float(*p) + v);
  }
};

// ---- the f32 products on tensor cores: bf16 parts of the f32 operands -------------------------

// v = hi + mid + lo to about 2^-24 relative (each part the bf16 rounding of what is left).
__device__ inline void split3(float v, bf16& hi, bf16& mid, bf16& lo) {
  hi = __float2bfloat16_rn(v);
  const float r = v - __bfloat162float(hi);
  mid = __float2bfloat16_rn(r);
  lo = __float2bfloat16_rn(r - __bfloat162float(mid));
}

__global__ void router_offsets_kernel(int32_t* o, int32_t h, int32_t t) {
  o[0] = 0, o[1] = h, o[2] = 0, o[3] = t;
}

// out[c, r] = in[r, c] for a [rows, cols] bf16 matrix, through 32 x 32 tiles in shared memory.
__global__ void __launch_bounds__(256)
    transpose_bf16_kernel(int64_t rows, int64_t cols, const bf16* __restrict__ in,
                          bf16* __restrict__ out) {
  __shared__ bf16 tile[32][33];
  const int64_t tiles_c = (cols + 31) / 32, tiles = (rows + 31) / 32 * tiles_c;
  const int tx = int(threadIdx.x) & 31, ty = int(threadIdx.x) >> 5;  // 32 x 8 threads
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = t / tiles_c * 32, c0 = t % tiles_c * 32;
    for (int i = ty; i < 32; i += 8)
      if (r0 + i < rows && c0 + tx < cols) tile[i][tx] = in[(r0 + i) * cols + c0 + tx];
    __syncthreads();
    for (int i = ty; i < 32; i += 8)
      if (c0 + i < cols && r0 + tx < rows) out[(c0 + i) * rows + r0 + tx] = tile[tx][i];
    __syncthreads();
  }
}

// W [E, H] f32 -> its parts: transposed (forward, parts[i] = W_i^T [H, E]) or stacked as
// [W0; W1; W0] [3E, H] (backward, the B operand of dx += [dl0 | dl0 | dl1] [W0; W1; W0]).
__global__ void __launch_bounds__(256)
    split_weight_kernel(int64_t E, int64_t H, const float* __restrict__ w, bf16* __restrict__ parts,
                        bool transposed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < E * H;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = i / H, h = i % H;
    bf16 p[3];
    split3(w[i], p[0], p[1], p[2]);
    if (transposed) {
      for (int k = 0; k < 3; ++k) parts[(k * H + h) * E + e] = p[k];
    } else {
      parts[i] = p[0];
      parts[E * H + i] = p[1];
      parts[2 * E * H + i] = p[0];
    }
  }
}

// dl [T, Ep] f32 -> parts [3][T, E] and cat [T, 3E] = [dl0 | dl0 | dl1] per token.
__global__ void __launch_bounds__(256)
    split_dl_kernel(int64_t T, int64_t E, int64_t Ep, const float* __restrict__ dl,
                    bf16* __restrict__ parts, bf16* __restrict__ cat) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < T * E;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / E, e = i % E;
    bf16 p[3];
    split3(dl[t * Ep + e], p[0], p[1], p[2]);
    for (int k = 0; k < 3; ++k) parts[k * T * E + i] = p[k];
    cat[t * 3 * E + e] = p[0];
    cat[t * 3 * E + E + e] = p[0];
    cat[t * 3 * E + 2 * E + e] = p[1];
  }
}

// ---- the f32 products for H % 8 == 0 ------------------------------------------------------------

// logits[t, e] = sum_h x[t, h] W[e, h]. x: [T, H / 4] words of 4 bf16; w: [E, H / 4] float4.
__global__ void __launch_bounds__(256)
    router_logits_kernel(int64_t T, int E, int64_t H4, const uint2* __restrict__ x,
                         const float4* __restrict__ w, float* __restrict__ logits) {
  constexpr int TT = kLogitTokens, TE = kLogitExperts, N = TT * TE;
  const int lane = int(threadIdx.x) & 31;
  const int egroups = (E + TE - 1) / TE;
  const int64_t tasks = (T + TT - 1) / TT * egroups;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  // Neighbouring warps take the expert groups of the same tokens (x rows shared in L1/L2).
  for (int64_t task = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; task < tasks;
       task += warps) {
    const int64_t t0 = task / egroups * TT;
    const int e0 = int(task % egroups) * TE;
    float acc[N];
#pragma unroll
    for (int q = 0; q < N; ++q) acc[q] = 0.f;
    for (int64_t c = lane; c < H4; c += 32) {
      uint2 xv[TT];
#pragma unroll
      for (int i = 0; i < TT; ++i)
        xv[i] = t0 + i < T ? x[(t0 + i) * H4 + c] : make_uint2(0u, 0u);
      float4 wv[TE];
#pragma unroll
      for (int j = 0; j < TE; ++j)
        wv[j] = e0 + j < E ? w[int64_t(e0 + j) * H4 + c] : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int i = 0; i < TT; ++i) {
        const float x0 = __uint_as_float(xv[i].x << 16);
        const float x1 = __uint_as_float(xv[i].x & 0xffff0000u);
        const float x2 = __uint_as_float(xv[i].y << 16);
        const float x3 = __uint_as_float(xv[i].y & 0xffff0000u);
#pragma unroll
        for (int j = 0; j < TE; ++j) {
          float a = acc[i * TE + j];
          a = fmaf(x0, wv[j].x, a);
          a = fmaf(x1, wv[j].y, a);
          a = fmaf(x2, wv[j].z, a);
          a = fmaf(x3, wv[j].w, a);
          acc[i * TE + j] = a;
        }
      }
    }
    warp_reduce_scatter<N>(acc, lane);
#pragma unroll
    for (int p = 0; p < N / 32; ++p) {
      const int q = reduce_scatter_index<N>(lane, p), i = q / TE, j = q % TE;
      if (t0 + i < T && e0 + j < E) logits[(t0 + i) * E + e0 + j] = acc[p];
    }
  }
}

// partial[split, e, h] = sum over the split's tokens t of dl[t, e] x[t, h], for the block's 8
// experts and 256 h. dl: [T, Ep] (Ep = padded E); x: [T, H / 8] words of 8 bf16. Warp w takes
// tokens t_begin + w + 8 j in increasing j, kDwTokensInFlight at a time, the next group's loads
// issued before the current group's FMAs; lane j < 8 loads dl[t, e0 + j] and the warp shares it
// by shuffles.
__global__ void __launch_bounds__(kDwWarps * 32, 2)
    router_dw_partial_kernel(int64_t T, int64_t Ep, int64_t H, int64_t tokens_per_split,
                             const float* __restrict__ dl, const uint4* __restrict__ x,
                             float* __restrict__ partial) {
  constexpr int TE = kDwExperts, TU = kDwTokensInFlight, W = kDwWarps;
  __shared__ float red[W][TE / 2][256];  // one half of the experts at a time: 32 KiB
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const int64_t egroups = Ep / TE, H8 = H / 8;
  const int64_t eg = blockIdx.x % egroups, htile = blockIdx.x / egroups;
  const int64_t c = htile * 32 + lane;  // this lane's word of 8 h
  const bool has_h = c < H8;
  const int64_t e0 = eg * TE;
  const int64_t t_begin = int64_t(blockIdx.y) * tokens_per_split;
  const int64_t t_end = t_begin + tokens_per_split < T ? t_begin + tokens_per_split : T;
  float acc[TE][8];
#pragma unroll
  for (int j = 0; j < TE; ++j)
#pragma unroll
    for (int q = 0; q < 8; ++q) acc[j][q] = 0.f;
  auto load = [&](int64_t t, uint4 (&xv)[TU], float (&dv)[TU]) {
#pragma unroll
    for (int u = 0; u < TU; ++u) {
      const int64_t tu = t + int64_t(W) * u;
      xv[u] = tu < t_end && has_h ? x[tu * H8 + c] : make_uint4(0u, 0u, 0u, 0u);
      dv[u] = tu < t_end && lane < TE ? dl[tu * Ep + e0 + lane] : 0.f;
    }
  };
  uint4 xa[TU];
  float da[TU];
  load(t_begin + warp, xa, da);
  for (int64_t t = t_begin + warp; t < t_end; t += W * TU) {
    uint4 xb[TU];
    float db[TU];
    load(t + int64_t(W) * TU, xb, db);
#pragma unroll
    for (int u = 0; u < TU; ++u) {
      float xf[8];
      unpack_bf16x8(xa[u], xf);
#pragma unroll
      for (int j = 0; j < TE; ++j) {
        const float d = __shfl_sync(0xffffffffu, da[u], j);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[j][q] = fmaf(d, xf[q], acc[j][q]);
      }
    }
#pragma unroll
    for (int u = 0; u < TU; ++u) {
      xa[u] = xb[u];
      da[u] = db[u];
    }
  }
  // Sum over the warps in warp order, half of the experts at a time.
  const int64_t h0 = htile * 256;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int j = 0; j < TE / 2; ++j) {
      float4* r = reinterpret_cast<float4*>(&red[warp][j][lane * 8]);
      const float* a = acc[half * TE / 2 + j];
      r[0] = make_float4(a[0], a[1], a[2], a[3]);
      r[1] = make_float4(a[4], a[5], a[6], a[7]);
    }
    __syncthreads();
    for (int o = int(threadIdx.x); o < TE / 2 * 256; o += W * 32) {
      const int j = o / 256, hh = o % 256;
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < W; ++v) sum += red[v][j][hh];
      if (h0 + hh < H)
        partial[(int64_t(blockIdx.y) * Ep + e0 + half * TE / 2 + j) * H + h0 + hh] = sum;
    }
    __syncthreads();
  }
}

// dW[e, h] += sum over splits, in split order.
__global__ void router_dw_reduce_kernel(int64_t E, int64_t Ep, int64_t H, int64_t splits,
                                        const float* __restrict__ partial, float* dw) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < E * H;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = i / H, h = i - e * H;
    float sum = 0.f;
    for (int64_t z = 0; z < splits; ++z) sum += partial[(z * Ep + e) * H + h];
    dw[i] += sum;
  }
}

// dx[t, h] += sum_e dl[t, e] W[e, h] (e in increasing order). A block owns kDxWords words of 8 h
// (its W columns, E x 512 f32, stay in L1) and a range of tokens; each thread takes kDxTokens
// tokens of one word per step.
__global__ void __launch_bounds__(kDxWords * kDxGroups)
    router_dx_kernel(int64_t T, int E, int64_t Ep, int64_t H8, int64_t hblocks,
                     int64_t tokens_per_block, const float* __restrict__ dl,
                     const float4* __restrict__ w, uint4* __restrict__ dx) {
  constexpr int TT = kDxTokens;
  const int64_t hb = blockIdx.x % hblocks, tb = blockIdx.x / hblocks;
  const int64_t c = hb * kDxWords + int(threadIdx.x) % kDxWords;
  const int group = int(threadIdx.x) / kDxWords;
  if (c >= H8) return;  // no barriers below
  const int64_t t_lo = tb * tokens_per_block;
  const int64_t t_hi = t_lo + tokens_per_block < T ? t_lo + tokens_per_block : T;
  for (int64_t t0 = t_lo + group * TT; t0 < t_hi; t0 += kDxGroups * TT) {
    float acc[TT][8];
#pragma unroll
    for (int u = 0; u < TT; ++u)
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
    for (int e0 = 0; e0 < E; e0 += 4) {
      float4 dv[TT];
#pragma unroll
      for (int u = 0; u < TT; ++u)
        dv[u] = t0 + u < t_hi ? *reinterpret_cast<const float4*>(dl + (t0 + u) * Ep + e0)
                              : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (e0 + k >= E) break;
        const float4* wr = w + (int64_t(e0 + k) * H8 + c) * 2;
        const float4 wa = wr[0], wb = wr[1];
        const float wf[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
        for (int u = 0; u < TT; ++u) {
          const float d = k == 0 ? dv[u].x : k == 1 ? dv[u].y : k == 2 ? dv[u].z : dv[u].w;
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[u][q] = fmaf(d, wf[q], acc[u][q]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < TT; ++u) {
      if (t0 + u >= t_hi) break;
      uint4* p = dx + (t0 + u) * H8 + c;
      float old[8];
      unpack_bf16x8(*p, old);
#pragma unroll
      for (int q = 0; q < 8; ++q) old[q] = old[q] + acc[u][q];
      *p = pack_bf16x8(old);
    }
  }
}

// ---- forward ----------------------------------------------------------------------------------

// (key, index) order of the selection: larger key first, then the lower index.
__device__ __forceinline__ bool ranks_before(double ka, int a, double kb, int b) {
  return ka > kb || (ka == kb && a < b);
}

// logsumexp over a token's logits held by the warp: lane j holds experts j, j + 32, ... in l[p];
// entries at or beyond E are ignored. Every lane gets the result.
template <int P>
__device__ __forceinline__ double warp_logsumexp(const double (&l)[P], int lane, int E) {
  double mx = -INFINITY;
#pragma unroll
  for (int p = 0; p < P; ++p)
    if (lane + 32 * p < E) mx = fmax(mx, l[p]);
  mx = warp_max(mx);
  double sum_exp = 0;
#pragma unroll
  for (int p = 0; p < P; ++p)
    if (lane + 32 * p < E) sum_exp += exp(l[p] - mx);
  return mx + log(warp_sum(sum_exp));
}

// One warp per token: scores, top-k, combine weights, counts, and the per-token loss terms.
__global__ void router_topk_kernel(int64_t T, int E, int K, const float* __restrict__ logits,
                                   const float* __restrict__ bias, float* scores, int32_t* idx,
                                   float* weights, int32_t* counts, double* lse_out,
                                   double* total_out, bool sigmoid, bool normalize) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t < T; t += warps) {
    const float* l = logits + t * E;
    float* s = scores + t * E;
    double mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmax(mx, double(l[e]));
    mx = warp_max(mx);
    double sum_exp = 0;
    for (int e = lane; e < E; e += 32) sum_exp += exp(double(l[e]) - mx);
    sum_exp = warp_sum(sum_exp);
    const double lse = mx + log(sum_exp);
    double total = 0;
    for (int e = lane; e < E; e += 32) {
      const double v = sigmoid ? 1.0 / (1.0 + exp(-double(l[e]))) : exp(double(l[e]) - lse);
      s[e] = float(v);
      total += v;
    }
    total = warp_sum(total);
    if (lane == 0) {
      lse_out[t] = lse;
      total_out[t] = total;
    }
    __syncwarp();  // the stored scores of every lane are visible to the whole warp

    // K rounds of arg-max over the experts ranked after the previous pick.
    double prev_key = 0, sel_sum = 0;
    int prev = -1;
    for (int k = 0; k < K; ++k) {
      double best_key = -INFINITY;
      int best = INT_MAX;
      for (int e = lane; e < E; e += 32) {
        const double key = double(s[e]) + double(bias[e]);
        const bool after = prev < 0 || ranks_before(prev_key, prev, key, e);
        if (after && (best == INT_MAX || ranks_before(key, e, best_key, best))) {
          best_key = key;
          best = e;
        }
      }
      for (int o = 16; o > 0; o >>= 1) {
        const double ok = __shfl_xor_sync(0xffffffffu, best_key, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best, o);
        if (oi != INT_MAX && (best == INT_MAX || ranks_before(ok, oi, best_key, best))) {
          best_key = ok;
          best = oi;
        }
      }
      if (best == INT_MAX) best = 0;  // only when every key is NaN
      prev_key = best_key;
      prev = best;
      sel_sum += double(s[best]);
      if (lane == 0) {
        idx[t * K + k] = best;
        atomicAdd(counts + best, 1);
      }
    }
    __syncwarp();
    for (int k = lane; k < K; k += 32) {
      const double sv = double(s[idx[t * K + k]]);
      weights[t * K + k] = float(normalize ? sv / sel_sum : sv);
    }
  }
}

// The forward per token in one pass, for E <= 32 P: scores, top-k, combine weights, and per block
// of kTokensPerLossBlock tokens the routes per expert (shared-memory counters, no global atomics),
// sum_t p[t, e] and sum_t lse_t^2. Each lane keeps its experts' logits, scores and bias in
// registers; the arithmetic per token is that of router_topk_kernel and
// router_loss_partial_kernel (the same double expressions in the same order per lane).
template <int P>
__global__ void __launch_bounds__(kSelectWarps * 32)
    router_select_kernel(int64_t T, int E, int K, const float* __restrict__ logits,
                         const float* __restrict__ bias, float* __restrict__ scores,
                         int32_t* __restrict__ idx, float* __restrict__ weights,
                         int32_t* __restrict__ block_counts, double* __restrict__ partial,
                         double* __restrict__ partial_z, bool sigmoid, bool normalize) {
  extern __shared__ double select_smem[];  // [kSelectWarps, E] p sums, [kSelectWarps] z, [E] hist
  double* warp_p = select_smem;
  double* warp_z = warp_p + kSelectWarps * E;
  int32_t* hist = reinterpret_cast<int32_t*>(warp_z + kSelectWarps);
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  for (int e = int(threadIdx.x); e < E; e += int(blockDim.x)) hist[e] = 0;
  __syncthreads();
  double b[P], p_sum[P];
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int e = lane + 32 * p;
    b[p] = e < E ? double(bias[e]) : 0.0;
    p_sum[p] = 0.0;
  }
  double z_sum = 0.0;
  const int64_t t_begin = int64_t(blockIdx.x) * kTokensPerLossBlock;
  const int64_t t_end = t_begin + kTokensPerLossBlock < T ? t_begin + kTokensPerLossBlock : T;
  for (int64_t t = t_begin + warp; t < t_end; t += kSelectWarps) {
    double l[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int e = lane + 32 * p;
      l[p] = e < E ? double(logits[t * E + e]) : 0.0;
    }
    const double lse = warp_logsumexp(l, lane, E);
    double v[P], total = 0;
    float sf[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int e = lane + 32 * p;
      v[p] = 0.0;
      sf[p] = 0.f;
      if (e < E) {
        v[p] = sigmoid ? 1.0 / (1.0 + exp(-l[p])) : exp(l[p] - lse);
        sf[p] = float(v[p]);
        scores[t * E + e] = sf[p];
        total += v[p];
      }
    }
    total = warp_sum(total);
#pragma unroll
    for (int p = 0; p < P; ++p)
      if (lane + 32 * p < E) p_sum[p] += v[p] / total;
    z_sum += lse * lse;

    // K rounds of arg-max over the experts ranked after the previous pick; the winner's score
    // travels with it through the butterfly.
    double prev_key = 0, sel_sum = 0;
    int prev = -1;
    int my_idx[P];
    float my_score[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      my_idx[p] = 0;
      my_score[p] = 0.f;
    }
    for (int k = 0; k < K; ++k) {
      double best_key = -INFINITY;
      int best = INT_MAX;
      float best_score = 0.f;
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int e = lane + 32 * p;
        if (e >= E) continue;
        const double key = double(sf[p]) + b[p];
        const bool after = prev < 0 || ranks_before(prev_key, prev, key, e);
        if (after && (best == INT_MAX || ranks_before(key, e, best_key, best))) {
          best_key = key;
          best = e;
          best_score = sf[p];
        }
      }
      for (int o = 16; o > 0; o >>= 1) {
        const double ok = __shfl_xor_sync(0xffffffffu, best_key, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best, o);
        const float os = __shfl_xor_sync(0xffffffffu, best_score, o);
        if (oi != INT_MAX && (best == INT_MAX || ranks_before(ok, oi, best_key, best))) {
          best_key = ok;
          best = oi;
          best_score = os;
        }
      }
      // Lane 0's pick for every lane (they agree unless keys are NaN); every key NaN: expert 0.
      const float score0 = __shfl_sync(0xffffffffu, sf[0], 0);
      best_key = __shfl_sync(0xffffffffu, best_key, 0);
      best = __shfl_sync(0xffffffffu, best, 0);
      best_score = __shfl_sync(0xffffffffu, best_score, 0);
      if (best == INT_MAX) {
        best = 0;
        best_score = score0;
      }
      prev_key = best_key;
      prev = best;
      sel_sum += double(best_score);
#pragma unroll
      for (int p = 0; p < P; ++p)
        if (k == lane + 32 * p) {
          my_idx[p] = best;
          my_score[p] = best_score;
        }
      if (lane == 0) atomicAdd(hist + best, 1);  // shared memory, integers: order-free
    }
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int k = lane + 32 * p;
      if (k < K) {
        idx[t * K + k] = my_idx[p];
        const double sv = double(my_score[p]);
        weights[t * K + k] = float(normalize ? sv / sel_sum : sv);
      }
    }
  }
  // The block's sums: warps in warp order.
#pragma unroll
  for (int p = 0; p < P; ++p)
    if (lane + 32 * p < E) warp_p[warp * E + lane + 32 * p] = p_sum[p];
  if (lane == 0) warp_z[warp] = z_sum;
  __syncthreads();
  for (int e = int(threadIdx.x); e < E; e += int(blockDim.x)) {
    double acc = 0;
    for (int w = 0; w < kSelectWarps; ++w) acc += warp_p[w * E + e];
    partial[int64_t(blockIdx.x) * E + e] = acc;
    block_counts[int64_t(blockIdx.x) * E + e] = hist[e];
  }
  if (threadIdx.x == 0) {
    double z = 0;
    for (int w = 0; w < kSelectWarps; ++w) z += warp_z[w];
    partial_z[blockIdx.x] = z;
  }
}

size_t select_smem_bytes(int64_t E) {
  return size_t(kSelectWarps) * size_t(E) * sizeof(double) + kSelectWarps * sizeof(double) +
         size_t(E) * sizeof(int32_t);
}

// Per block of tokens: sum_t p[t, e] (scores normalised over experts) and sum_t lse_t^2.
__global__ void router_loss_partial_kernel(int64_t T, int E, const float* __restrict__ logits,
                                           const double* __restrict__ lse,
                                           const double* __restrict__ total, bool sigmoid,
                                           double* partial, double* partial_z) {
  const int64_t t0 = int64_t(blockIdx.x) * kTokensPerLossBlock;
  const int64_t t1 = t0 + kTokensPerLossBlock < T ? t0 + kTokensPerLossBlock : T;
  for (int e = int(threadIdx.x); e < E; e += int(blockDim.x)) {
    double acc = 0;
    for (int64_t t = t0; t < t1; ++t) {
      const double l = double(logits[t * E + e]);
      const double v = sigmoid ? 1.0 / (1.0 + exp(-l)) : exp(l - lse[t]);
      acc += v / total[t];
    }
    partial[int64_t(blockIdx.x) * E + e] = acc;
  }
  if (threadIdx.x == 0) {
    double z = 0;
    for (int64_t t = t0; t < t1; ++t) z += lse[t] * lse[t];
    partial_z[blockIdx.x] = z;
  }
}

// One block: aux = coeff * E * sum_e f_e P_e, z = coeff * mean_t lse^2. partial[0, :] is reused
// for the per-expert terms. One warp per expert sums the blocks (lanes in block order, then a
// fixed butterfly), so the block count does not serialise.
// With block_counts, counts[e] is first written as the sum of the blocks' routes to e.
__global__ void router_loss_final_kernel(int64_t T, int E, int K, int64_t blocks,
                                         double* partial, const double* __restrict__ partial_z,
                                         const int32_t* __restrict__ block_counts,
                                         int32_t* counts, double aux_coeff, double z_coeff,
                                         float* losses) {
  __shared__ double z_sum;
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const int warps = int(blockDim.x) >> 5;
  for (int e = warp; e < E; e += warps) {
    double p = 0;
    for (int64_t b = lane; b < blocks; b += 32) p += partial[b * E + e];
    p = warp_sum(p);
    if (block_counts) {
      int32_t c = 0;
      for (int64_t b = lane; b < blocks; b += 32) c += block_counts[b * E + e];
      c = warp_sum(c);
      if (lane == 0) counts[e] = c;
      __syncwarp();
    }
    __syncwarp();  // every lane has read partial[0, e] before lane 0 overwrites it
    if (lane == 0) partial[e] = double(counts[e]) / double(T * K) * (p / double(T));
  }
  if (warp == 0) {
    double z = 0;
    for (int64_t b = lane; b < blocks; b += 32) z += partial_z[b];
    z = warp_sum(z);
    if (lane == 0) z_sum = z;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double aux = 0;
    for (int e = 0; e < E; ++e) aux += partial[e];
    losses[0] = float(aux * aux_coeff * double(E));
    losses[1] = float(z_coeff * z_sum / double(T));
  }
}

// ---- backward ---------------------------------------------------------------------------------

// One warp per token: dl[t, :] = d(task + aux + z) / d logits[t, :].
__global__ void router_dlogits_kernel(int64_t T, int E, int K, const float* __restrict__ logits,
                                      const float* __restrict__ scores,
                                      const int32_t* __restrict__ idx,
                                      const float* __restrict__ weights,
                                      const int32_t* __restrict__ counts,
                                      const float* __restrict__ d_weights, bool sigmoid,
                                      bool normalize, double aux_coeff, double z_coeff,
                                      int Ep, float* dl_out) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t < T; t += warps) {
    const float* s = scores + t * E;
    const float* l = logits + t * E;
    const int32_t* sel = idx + t * K;
    double sel_sum = 0, gw = 0;
    for (int k = 0; k < K; ++k) {
      sel_sum += double(s[sel[k]]);
      gw += double(d_weights[t * K + k]) * double(weights[t * K + k]);
    }
    auto d_p = [&](int e) {
      return aux_coeff * double(E) * double(counts[e]) / double(T * K) / double(T);
    };
    double S = 1, dps = 0;  // sigmoid aux: sum of scores and sum of d_p * s
    if (aux_coeff != 0 && sigmoid) {
      S = 0;
      for (int e = lane; e < E; e += 32) {
        S += double(s[e]);
        dps += d_p(e) * double(s[e]);
      }
      S = warp_sum(S);
      dps = warp_sum(dps);
    }
    auto ds_of = [&](int e) {
      double ds = 0;
      for (int k = 0; k < K; ++k)
        if (sel[k] == e) {
          const double g = double(d_weights[t * K + k]);
          ds += normalize ? (g - gw) / sel_sum : g;
        }
      if (aux_coeff != 0) ds += sigmoid ? d_p(e) / S - dps / (S * S) : d_p(e);
      return ds;
    };
    double dot = 0;
    if (!sigmoid) {
      for (int e = lane; e < E; e += 32) dot += ds_of(e) * double(s[e]);
      dot = warp_sum(dot);
    }
    double lse = 0, zc = 0;
    if (z_coeff != 0) {
      double mx = -INFINITY;
      for (int e = lane; e < E; e += 32) mx = fmax(mx, double(l[e]));
      mx = warp_max(mx);
      double se = 0;
      for (int e = lane; e < E; e += 32) se += exp(double(l[e]) - mx);
      se = warp_sum(se);
      lse = mx + log(se);
      zc = z_coeff * 2.0 * lse / double(T);
    }
    for (int e = lane; e < E; e += 32) {
      const double sv = double(s[e]), ds = ds_of(e);
      double d = sigmoid ? ds * sv * (1.0 - sv) : sv * (ds - dot);
      if (z_coeff != 0) d += zc * exp(double(l[e]) - lse);
      dl_out[t * Ep + e] = float(d);
    }
    for (int e = E + lane; e < Ep; e += 32) dl_out[t * Ep + e] = 0.f;
  }
}

// The same gradient for E <= 32 P with the token's data in registers: lane l holds experts
// l + 32 p and routes l + 32 p, and route k reaches every lane by a shuffle (no dependent global
// loads in the loops over k). Per expert the sums run in the order of router_dlogits_kernel; the
// sums over routes (sel_sum, gw) are warp trees instead of sequential.
template <int P>
__global__ void router_dlogits_reg_kernel(int64_t T, int E, int K,
                                          const float* __restrict__ logits,
                                          const float* __restrict__ scores,
                                          const int32_t* __restrict__ idx,
                                          const float* __restrict__ weights,
                                          const int32_t* __restrict__ counts,
                                          const float* __restrict__ d_weights, bool sigmoid,
                                          bool normalize, double aux_coeff, double z_coeff,
                                          int Ep, float* __restrict__ dl_out) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  double d_p[P];  // aux-loss gradient w.r.t. p[e]
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int e = lane + 32 * p;
    d_p[p] = e < E ? aux_coeff * double(E) * double(counts[e]) / double(T * K) / double(T) : 0.0;
  }
  for (int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t < T; t += warps) {
    double sv[P], l[P];
    int sel[P];
    double g[P];
    double sel_part = 0, gw_part = 0;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int e = lane + 32 * p;
      sv[p] = e < E ? double(scores[t * E + e]) : 0.0;
      l[p] = e < E ? double(logits[t * E + e]) : 0.0;
      sel[p] = -1;
      g[p] = 0.0;
      if (lane + 32 * p < K) {
        const int64_t at = t * K + lane + 32 * p;
        sel[p] = idx[at];
        g[p] = double(d_weights[at]);
        gw_part += g[p] * double(weights[at]);
        sel_part += double(scores[t * E + sel[p]]);
      }
    }
    const double sel_sum = warp_sum(sel_part), gw = warp_sum(gw_part);
    double S = 1, dps = 0;  // sigmoid aux: sum of scores and sum of d_p * s
    if (aux_coeff != 0 && sigmoid) {
      S = 0;
#pragma unroll
      for (int p = 0; p < P; ++p)
        if (lane + 32 * p < E) {
          S += sv[p];
          dps += d_p[p] * sv[p];
        }
      S = warp_sum(S);
      dps = warp_sum(dps);
    }
    double ds[P];
#pragma unroll
    for (int p = 0; p < P; ++p) ds[p] = 0.0;
#pragma unroll
    for (int q = 0; q < P; ++q) {  // routes 32 q .. 32 q + 31, in increasing k
      if (32 * q >= K) break;
      for (int j = 0; j < 32 && 32 * q + j < K; ++j) {
        const int e = __shfl_sync(0xffffffffu, sel[q], j);
        const double gk = __shfl_sync(0xffffffffu, g[q], j);
        const double term = normalize ? (gk - gw) / sel_sum : gk;
#pragma unroll
        for (int p = 0; p < P; ++p)
          if (e == lane + 32 * p) ds[p] += term;
      }
    }
    if (aux_coeff != 0) {
#pragma unroll
      for (int p = 0; p < P; ++p) ds[p] += sigmoid ? d_p[p] / S - dps / (S * S) : d_p[p];
    }
    double dot = 0;
    if (!sigmoid) {
#pragma unroll
      for (int p = 0; p < P; ++p)
        if (lane + 32 * p < E) dot += ds[p] * sv[p];
      dot = warp_sum(dot);
    }
    double lse = 0, zc = 0;
    if (z_coeff != 0) {
      lse = warp_logsumexp(l, lane, E);
      zc = z_coeff * 2.0 * lse / double(T);
    }
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int e = lane + 32 * p;
      if (e < E) {
        double d = sigmoid ? ds[p] * sv[p] * (1.0 - sv[p]) : sv[p] * (ds[p] - dot);
        if (z_coeff != 0) d += zc * exp(l[p] - lse);
        dl_out[t * Ep + e] = float(d);
      } else if (e < Ep) {
        dl_out[t * Ep + e] = 0.f;
      }
    }
    for (int e = 32 * P + lane; e < Ep; e += 32) dl_out[t * Ep + e] = 0.f;
  }
}

__global__ void router_bias_update_kernel(int R, int E, const int32_t* __restrict__ C, float* bias,
                                          double rate) {
  __shared__ unsigned long long total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  unsigned long long mine = 0;
  for (int64_t i = threadIdx.x; i < int64_t(R) * E; i += blockDim.x) mine += (long long)C[i];
  atomicAdd(&total, mine);  // integers: the order does not change the sum
  __syncthreads();
  const int64_t all = (int64_t)total;
  for (int e = int(threadIdx.x); e < E; e += int(blockDim.x)) {
    int64_t count = 0;
    for (int r = 0; r < R; ++r) count += C[int64_t(r) * E + e];
    const int64_t diff = all - int64_t(E) * count;
    const double sgn = diff > 0 ? 1.0 : (diff < 0 ? -1.0 : 0.0);
    bias[e] = float(double(bias[e]) + rate * sgn);
  }
}

void check_router_dtypes(const Tensor& x, const Tensor& w) {
  MOE_ECHO_CHECK(x.dtype == DType::bf16, "router x must be bf16 on the CUDA backend, got "
                                             << x.describe());
  MOE_ECHO_CHECK(w.dtype == DType::f32, "router weight must be f32 on the CUDA backend, got "
                                            << w.describe());
}

unsigned token_warp_blocks(int64_t T) {
  return blocks_for(T, kWarpsPerBlock, grid_cap());
}

// One-group windows of the tensor-core products: rows [0, H) and [0, T).
GroupWindow h_window(const RouterScratch& sc, int64_t H) {
  return GroupWindow{sc.offsets, 1, 0, H};
}
GroupWindow t_window(const RouterScratch& sc, int64_t T) {
  return GroupWindow{sc.offsets + 2, 1, 0, T};
}

// logits [T, E] = sum over the parts W_i of x W_i^T: three wgrad products over the H rows of
// x^T and W_i^T (the first writes, the others add).
void tensor_logits(const Tensor& x, const Tensor& w, float* logits, const RouterScratch& sc,
                   GroupedGemm& gemm, int64_t T, int64_t E, int64_t H, cudaStream_t s) {
  MOE_ECHO_LAUNCH(router_offsets_kernel, 1, 1, 0, s, sc.offsets, int32_t(H), int32_t(T));
  MOE_ECHO_LAUNCH(transpose_bf16_kernel, blocks_for((T + 31) / 32 * ((H + 31) / 32), 1, grid_cap()),
                  256, 0, s, T, H, x.as<bf16>(), sc.x_t);
  MOE_ECHO_LAUNCH(split_weight_kernel, blocks_for(E * H, 256, grid_cap()), 256, 0, s, E, H,
                  w.as<float>(), sc.w_parts, true);
  for (int i = 0; i < 3; ++i) {
    GemmArgs g;
    g.window = h_window(sc, H);
    g.a = Tensor(sc.x_t, DType::bf16, {H, T});
    g.b = Tensor(sc.w_parts + i * H * E, DType::bf16, {H, E});
    g.c = Tensor(logits, DType::f32, {1, T, E});
    g.accumulate = i > 0;
    gemm.wgrad(g, s);
  }
}

// dW [E, H] += sum over the parts dl_i of dl_i^T x (three wgrad products over the T rows);
// dx [T, H] += [dl0 | dl0 | dl1] [W0; W1; W0] (one fprop product, added to dx).
void tensor_grads(const RouterBackwardArgs& a, const RouterScratch& sc, GroupedGemm& gemm,
                  int64_t T, int64_t E, int64_t H, cudaStream_t s) {
  MOE_ECHO_LAUNCH(router_offsets_kernel, 1, 1, 0, s, sc.offsets, int32_t(H), int32_t(T));
  MOE_ECHO_LAUNCH(split_dl_kernel, blocks_for(T * E, 256, grid_cap()), 256, 0, s, T, E,
                  padded_experts(E), sc.dl, sc.dl_parts, sc.dl_cat);
  MOE_ECHO_LAUNCH(split_weight_kernel, blocks_for(E * H, 256, grid_cap()), 256, 0, s, E, H,
                  a.weight.as<float>(), sc.w_parts, false);
  for (int i = 0; i < 3; ++i) {
    GemmArgs g;
    g.window = t_window(sc, T);
    g.a = Tensor(sc.dl_parts + i * T * E, DType::bf16, {T, E});
    g.b = a.x;
    g.c = Tensor(a.d_weight.data, DType::f32, {1, E, H});
    gemm.wgrad(g, s);
  }
  GemmArgs g;
  g.window = t_window(sc, T);
  g.a = Tensor(sc.dl_cat, DType::bf16, {T, 3 * E});
  g.b = Tensor(sc.w_parts, DType::bf16, {1, 3 * E, H});
  g.c = a.dx;
  gemm.fprop_add(g, s);
}

bool use_tensor(const GroupedGemm* gemm, int64_t T, int64_t E, int64_t H,
                std::initializer_list<const void*> ptrs) {
  if (!gemm || !tensor_shapes(T, E, H)) return false;
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

}  // namespace

size_t router_scratch_bytes(int64_t tokens, int64_t experts, int64_t hidden) {
  ScratchCarver c(nullptr);
  carve(c, tokens, experts, hidden);
  return c.used();
}

void router_forward(const RouterForwardArgs& a, void* scratch, GroupedGemm* gemm,
                    cudaStream_t s) {
  check_router_dtypes(a.x, a.weight);
  const int64_t T = a.x.size(0), H = a.x.size(1), E = a.weight.size(0), K = a.topk_idx.size(1);
  if (T == 0) {
    MOE_ECHO_CUDA_CHECK(cudaMemsetAsync(a.counts.data, 0, size_t(E) * sizeof(int32_t), s));
    MOE_ECHO_CUDA_CHECK(cudaMemsetAsync(a.losses.data, 0, 2 * sizeof(float), s));
    return;
  }
  ScratchCarver c(scratch);
  const RouterScratch sc = carve(c, T, E, H);
  float* logits = a.logits.as<float>();
  if (use_tensor(gemm, T, E, H, {a.x.data, a.weight.data, a.logits.data})) {
    tensor_logits(a.x, a.weight, logits, sc, *gemm, T, E, H, s);
  } else if (fast_products(a.x, a.weight)) {
    const int64_t tasks =
        (T + kLogitTokens - 1) / kLogitTokens * ((E + kLogitExperts - 1) / kLogitExperts);
    MOE_ECHO_LAUNCH(router_logits_kernel, blocks_for(tasks, 8, grid_cap()), 256, 0, s, T, int(E),
                    H / 4, static_cast<const uint2*>(a.x.data),
                    static_cast<const float4*>(a.weight.data), logits);
  } else {
    tiled_gemm<true, true>("router_logits", T, E, H, LoadTokenRow{a.x.as<bf16>(), H},
                           LoadWeightT{a.weight.as<float>(), H}, StoreLogits{logits, E}, s,
                           sc.split);
  }
  const bool sigmoid = a.score_function == ScoreFunction::sigmoid;
  const int64_t blocks = loss_blocks(T);
  const int32_t* block_counts = nullptr;
  auto select = [&](auto kernel) {
    MOE_ECHO_LAUNCH(kernel, unsigned(blocks), kSelectWarps * 32, select_smem_bytes(E), s, T,
                    int(E), int(K), logits, a.bias.as<float>(), a.scores.as<float>(),
                    a.topk_idx.as<int32_t>(), a.topk_weight.as<float>(), sc.block_counts,
                    sc.partial, sc.partial_z, sigmoid, a.normalize_topk);
    block_counts = sc.block_counts;
  };
  if (E <= 32) select(router_select_kernel<1>);
  else if (E <= 64) select(router_select_kernel<2>);
  else if (E <= 128) select(router_select_kernel<4>);
  else if (E <= 32 * kMaxExpertsPerLane) select(router_select_kernel<kMaxExpertsPerLane>);
  else {
    MOE_ECHO_CUDA_CHECK(cudaMemsetAsync(a.counts.data, 0, size_t(E) * sizeof(int32_t), s));
    MOE_ECHO_LAUNCH(router_topk_kernel, token_warp_blocks(T), 32 * kWarpsPerBlock, 0, s, T,
                    int(E), int(K), logits, a.bias.as<float>(), a.scores.as<float>(),
                    a.topk_idx.as<int32_t>(), a.topk_weight.as<float>(), a.counts.as<int32_t>(),
                    sc.lse, sc.total, sigmoid, a.normalize_topk);
    MOE_ECHO_LAUNCH(router_loss_partial_kernel, unsigned(blocks), 256, 0, s, T, int(E), logits,
                    sc.lse, sc.total, sigmoid, sc.partial, sc.partial_z);
  }
  MOE_ECHO_LAUNCH(router_loss_final_kernel, 1, 256, 0, s, T, int(E), int(K), blocks, sc.partial,
                  sc.partial_z, block_counts, a.counts.as<int32_t>(), a.aux_loss_coeff,
                  a.z_loss_coeff, a.losses.as<float>());
}

void router_backward(const RouterBackwardArgs& a, void* scratch, GroupedGemm* gemm,
                     cudaStream_t s) {
  check_router_dtypes(a.x, a.weight);
  const int64_t T = a.x.size(0), H = a.x.size(1), E = a.weight.size(0), K = a.topk_idx.size(1);
  if (T == 0) return;
  ScratchCarver c(scratch);
  const RouterScratch sc = carve(c, T, E, H);
  const int64_t Ep = padded_experts(E);
  auto dlogits = [&](auto kernel) {
    MOE_ECHO_LAUNCH(kernel, token_warp_blocks(T), 32 * kWarpsPerBlock, 0, s, T, int(E), int(K),
                    a.logits.as<float>(), a.scores.as<float>(), a.topk_idx.as<int32_t>(),
                    a.topk_weight.as<float>(), a.counts.as<int32_t>(),
                    a.d_topk_weight.as<float>(), a.score_function == ScoreFunction::sigmoid,
                    a.normalize_topk, a.aux_loss_coeff, a.z_loss_coeff, int(Ep), sc.dl);
  };
  if (E <= 32) dlogits(router_dlogits_reg_kernel<1>);
  else if (E <= 64) dlogits(router_dlogits_reg_kernel<2>);
  else if (E <= 128) dlogits(router_dlogits_reg_kernel<4>);
  else if (E <= 32 * kMaxExpertsPerLane) dlogits(router_dlogits_reg_kernel<kMaxExpertsPerLane>);
  else dlogits(router_dlogits_kernel);
  // dW[E, H] += dl^T x (reduction over tokens), dx[T, H] += dl W (reduction over experts).
  if (use_tensor(gemm, T, E, H, {a.x.data, a.weight.data, a.dx.data, a.d_weight.data})) {
    tensor_grads(a, sc, *gemm, T, E, H, s);
    return;
  }
  if (fast_products(a.x, a.weight) && aligned16(a.dx.data)) {
    const int64_t splits = dw_splits(T, E, H), per_split = (T + splits - 1) / splits;
    const dim3 grid(unsigned(Ep / kDwExperts * ((H / 8 + 31) / 32)), unsigned(splits));
    MOE_ECHO_LAUNCH(router_dw_partial_kernel, grid, kDwWarps * 32, 0, s, T, Ep, H, per_split,
                    sc.dl, static_cast<const uint4*>(a.x.data), sc.dw_partial);
    MOE_ECHO_LAUNCH(router_dw_reduce_kernel, blocks_for(E * H, 256, grid_cap()), 256, 0, s, E, Ep,
                    H, splits, sc.dw_partial, a.d_weight.as<float>());
    // dx: about 3 blocks per multiprocessor; token ranges in whole steps of 32 tokens.
    const int64_t H8 = H / 8, hblocks = (H8 + kDxWords - 1) / kDxWords;
    const int64_t step = int64_t(kDxGroups) * kDxTokens;
    int64_t tblocks = std::clamp<int64_t>((3 * sm_count() + hblocks - 1) / hblocks, 1,
                                          (T + step - 1) / step);
    const int64_t per_block = ((T + tblocks - 1) / tblocks + step - 1) / step * step;
    tblocks = (T + per_block - 1) / per_block;
    MOE_ECHO_LAUNCH(router_dx_kernel, unsigned(hblocks * tblocks), kDxWords * kDxGroups, 0, s, T,
                    int(E), Ep, H8, hblocks, per_block, sc.dl,
                    static_cast<const float4*>(a.weight.data), static_cast<uint4*>(a.dx.data));
    return;
  }
  tiled_gemm<false, false>("router_weight_grad", E, H, T, LoadDlT{sc.dl, Ep},
                           LoadTokenCol{a.x.as<bf16>(), H},
                           AccumulateWeightGrad{a.d_weight.as<float>(), H}, s, sc.split);
  tiled_gemm<true, false>("router_token_grad", T, H, E, LoadDl{sc.dl, Ep},
                          LoadWeight{a.weight.as<float>(), H},
                          AccumulateTokenGrad{a.dx.as<bf16>(), H}, s, sc.split);
}

void router_bias_update(const Tensor& routing_map, const Tensor& bias, double rate,
                        cudaStream_t s) {
  MOE_ECHO_CHECK(bias.dtype == DType::f32, "router bias must be f32, got " << bias.describe());
  const int64_t R = routing_map.size(0), E = routing_map.size(1);
  MOE_ECHO_LAUNCH(router_bias_update_kernel, E > 0 ? 1 : 0, 256, 0, s, int(R), int(E),
                  routing_map.as<int32_t>(), bias.as<float>(), rate);
}

}  // namespace moe_echo::cuda
