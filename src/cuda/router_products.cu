// The router's three f32 products: logits = x W^T (forward), dW += dl^T x and dx += dl W
// (backward), and the scratch of every router op (carve: most of it is the products').
//
// The three f32 products (logits = x W^T, dW += dl^T x, dx += dl W) are FFMA kernels shaped for
// a small E: x is read once per product as words of bf16 (32 MiB at T 8192, H 2048), W (E x H
// f32) stays in L1/L2, and every output is summed in a fixed order. They need H % 8 == 0 and
// 16-byte aligned x, W and dx; other shapes take the generic tiled GEMM (tiled_gemm.cuh).
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
//
// Invariants: every output element is summed in a fixed order (per lane over its h, then a fixed
// tree; dW per split in warp order, then the splits in split order; dx over e in increasing
// order), so results are bit-identical run to run on one path.
#include <algorithm>
#include <initializer_list>

#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/tiled_gemm.cuh"
#include "cuda/router_detail.cuh"

namespace moe_echo::cuda::router_detail {
namespace {

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
// The tensor-core dW product's row groups: its output (E x H per group) has few 128 x 128 tiles
// (16 at E 64, H 2048), so the T token rows are cut into groups whose partial products, each in
// its own [E, H] slab, fill the SMs; router_dw_reduce_kernel sums the slabs in group order. At
// most kTensorDwGroups groups of at least 256 rows, and no more than the GEMM was built for.
constexpr int64_t kTensorDwGroups = 8;
int64_t tensor_dw_groups(int64_t T, int64_t E, int64_t H, int max_groups) {
  const int64_t tiles = std::max<int64_t>(1, (E + 127) / 128 * ((H + 127) / 128));
  const int64_t groups =
      std::min({sm_count() / tiles, kTensorDwGroups, T / 256, int64_t(max_groups)});
  return std::max<int64_t>(groups, 1);
}

// Token splits of the dW product: enough blocks for two waves, at least 64 tokens per split.
int64_t dw_splits(int64_t T, int64_t E, int64_t H) {
  const int64_t blocks = std::max<int64_t>(1, padded_experts(E) / kDwExperts * ((H / 8 + 31) / 32));
  int64_t splits = (2 * sm_count() + blocks - 1) / blocks;
  splits = std::min<int64_t>(splits, (T + 63) / 64);
  return std::max<int64_t>(splits, 1);
}

}  // namespace

RouterScratch carve(ScratchCarver& c, int64_t T, int64_t E, int64_t H) {
  RouterScratch r;
  r.lse = c.take<double>(T);
  r.total = c.take<double>(T);
  r.partial = c.take<double>(loss_blocks(T) * E);
  r.partial_z = c.take<double>(loss_blocks(T));
  r.block_counts = c.take<int32_t>(loss_blocks(T) * E);
  r.dl = c.take<float>(T * padded_experts(E));
  r.seq_counts = c.take<int32_t>(T * E);
  r.seq_terms = c.take<double>(T * E);
  r.split = c.take<float>(tiled_gemm_scratch_floats());
  // Sized for T rounded up to 8 whatever T is, so the bytes never shrink as T grows (the arena is
  // reserved for max_tokens before any capture).
  const int64_t T8 = (T + 7) / 8 * 8;
  const bool tensor = tensor_shapes(T8, E, H);
  r.dw_partial = c.take<float>(
      std::max(dw_splits(T, E, H) * padded_experts(E), tensor ? kTensorDwGroups * E : int64_t(0)) *
      H);
  if (tensor) {
    r.offsets = c.take<int32_t>(4 + kTensorDwGroups + 1);
    r.x_t = c.take<bf16>(H * T8);
    r.w_parts = c.take<bf16>(3 * E * H);
    r.dl_parts = c.take<bf16>(3 * T8 * E);
    r.dl_cat = c.take<bf16>(3 * T8 * E);
  }
  return r;
}

namespace {

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

// The windows' offsets: {0, h} and {0, t} (one group each), then t rows in `groups` groups.
__global__ void router_offsets_kernel(int32_t* o, int32_t h, int32_t t, int32_t groups) {
  o[0] = 0, o[1] = h, o[2] = 0, o[3] = t;
  for (int32_t g = 0; g <= groups; ++g) o[4 + g] = int32_t(int64_t(t) * g / groups);
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
      for (int i = 0; i < TT; ++i) xv[i] = t0 + i < T ? x[(t0 + i) * H4 + c] : make_uint2(0u, 0u);
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
  auto load = [&](int64_t t, uint4(&xv)[TU], float(&dv)[TU]) {
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
__global__ void __launch_bounds__(kDxWords* kDxGroups)
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

// One-group windows of the tensor-core products: rows [0, H) and [0, T).
GroupWindow h_window(const RouterScratch& sc, int64_t H) {
  return GroupWindow{{0, H}, sc.offsets, 1};
}
GroupWindow t_window(const RouterScratch& sc, int64_t T) {
  return GroupWindow{{0, T}, sc.offsets + 2, 1};
}

// logits [T, E] = sum over the parts W_i of x W_i^T: three wgrad products over the H rows of
// x^T and W_i^T (the first writes, the others add).
void tensor_logits(const Tensor& x, const Tensor& w, float* logits, const RouterScratch& sc,
                   GroupedGemm& gemm, int64_t T, int64_t E, int64_t H, cudaStream_t s) {
  MOE_ECHO_LAUNCH(router_offsets_kernel, 1, 1, 0, s, sc.offsets, int32_t(H), int32_t(T), 1);
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

// dW [E, H] += sum over the parts dl_i of dl_i^T x (three wgrad products over the T rows, in
// row groups whose slabs are then summed in group order);
// dx [T, H] += [dl0 | dl0 | dl1] [W0; W1; W0] (one fprop product, added to dx).
void tensor_grads(const Tensor& x, const Tensor& w, const Tensor& d_weight, const Tensor& dx,
                  const RouterScratch& sc, GroupedGemm& gemm, int64_t T, int64_t E, int64_t H,
                  cudaStream_t s) {
  const int64_t groups = tensor_dw_groups(T, E, H, gemm.max_groups());
  MOE_ECHO_LAUNCH(router_offsets_kernel, 1, 1, 0, s, sc.offsets, int32_t(H), int32_t(T),
                  int32_t(groups));
  MOE_ECHO_LAUNCH(split_dl_kernel, blocks_for(T * E, 256, grid_cap()), 256, 0, s, T, E,
                  padded_experts(E), sc.dl, sc.dl_parts, sc.dl_cat);
  MOE_ECHO_LAUNCH(split_weight_kernel, blocks_for(E * H, 256, grid_cap()), 256, 0, s, E, H,
                  w.as<float>(), sc.w_parts, false);
  for (int i = 0; i < 3; ++i) {
    GemmArgs g;
    g.window = GroupWindow{{0, T}, sc.offsets + 4, int(groups)};
    g.a = Tensor(sc.dl_parts + i * T * E, DType::bf16, {T, E});
    g.b = x;
    g.c = Tensor(sc.dw_partial, DType::f32, {groups, E, H});
    g.accumulate = i > 0;              // the first part writes each group's slab,
    g.zero_empty_below = int(groups);  // zero where a group has no rows
    gemm.wgrad(g, s);
  }
  MOE_ECHO_LAUNCH(router_dw_reduce_kernel, blocks_for(E * H, 256, grid_cap()), 256, 0, s, E, E, H,
                  groups, sc.dw_partial, d_weight.as<float>());
  GemmArgs g;
  g.window = t_window(sc, T);
  g.a = Tensor(sc.dl_cat, DType::bf16, {T, 3 * E});
  g.b = Tensor(sc.w_parts, DType::bf16, {1, 3 * E, H});
  g.c = dx;
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

void logits_product(const Tensor& x, const Tensor& w, const Tensor& logits_out,
                    const RouterScratch& sc, GroupedGemm* gemm, cudaStream_t s) {
  const int64_t T = x.size(0), H = x.size(1), E = w.size(0);
  float* logits = logits_out.as<float>();
  if (use_tensor(gemm, T, E, H, {x.data, w.data, logits_out.data})) {
    tensor_logits(x, w, logits, sc, *gemm, T, E, H, s);
  } else if (fast_products(x, w)) {
    const int64_t tasks =
        (T + kLogitTokens - 1) / kLogitTokens * ((E + kLogitExperts - 1) / kLogitExperts);
    MOE_ECHO_LAUNCH(router_logits_kernel, blocks_for(tasks, 8, grid_cap()), 256, 0, s, T, int(E),
                    H / 4, static_cast<const uint2*>(x.data), static_cast<const float4*>(w.data),
                    logits);
  } else {
    tiled_gemm<true, true>("router_logits", T, E, H, LoadTokenRow{x.as<bf16>(), H},
                           LoadWeightT{w.as<float>(), H}, StoreLogits{logits, E}, s, sc.split);
  }
}

void grad_products(const Tensor& x, const Tensor& w, const Tensor& d_weight, const Tensor& dx,
                   const RouterScratch& sc, GroupedGemm* gemm, cudaStream_t s) {
  const int64_t T = x.size(0), H = x.size(1), E = w.size(0);
  const int64_t Ep = padded_experts(E);
  if (use_tensor(gemm, T, E, H, {x.data, w.data, dx.data, d_weight.data})) {
    tensor_grads(x, w, d_weight, dx, sc, *gemm, T, E, H, s);
    return;
  }
  if (fast_products(x, w) && aligned16(dx.data)) {
    const int64_t splits = dw_splits(T, E, H), per_split = (T + splits - 1) / splits;
    const dim3 grid(unsigned(Ep / kDwExperts * ((H / 8 + 31) / 32)), unsigned(splits));
    MOE_ECHO_LAUNCH(router_dw_partial_kernel, grid, kDwWarps * 32, 0, s, T, Ep, H, per_split, sc.dl,
                    static_cast<const uint4*>(x.data), sc.dw_partial);
    MOE_ECHO_LAUNCH(router_dw_reduce_kernel, blocks_for(E * H, 256, grid_cap()), 256, 0, s, E, Ep,
                    H, splits, sc.dw_partial, d_weight.as<float>());
    // dx: about 3 blocks per multiprocessor; token ranges in whole steps of 32 tokens.
    const int64_t H8 = H / 8, hblocks = (H8 + kDxWords - 1) / kDxWords;
    const int64_t step = int64_t(kDxGroups) * kDxTokens;
    int64_t tblocks =
        std::clamp<int64_t>((3 * sm_count() + hblocks - 1) / hblocks, 1, (T + step - 1) / step);
    const int64_t per_block = ((T + tblocks - 1) / tblocks + step - 1) / step * step;
    tblocks = (T + per_block - 1) / per_block;
    MOE_ECHO_LAUNCH(router_dx_kernel, unsigned(hblocks * tblocks), kDxWords * kDxGroups, 0, s, T,
                    int(E), Ep, H8, hblocks, per_block, sc.dl, static_cast<const float4*>(w.data),
                    static_cast<uint4*>(dx.data));
    return;
  }
  tiled_gemm<false, false>("router_weight_grad", E, H, T, LoadDlT{sc.dl, Ep},
                           LoadTokenCol{x.as<bf16>(), H},
                           AccumulateWeightGrad{d_weight.as<float>(), H}, s, sc.split);
  tiled_gemm<true, false>("router_token_grad", T, H, E, LoadDl{sc.dl, Ep},
                          LoadWeight{w.as<float>(), H}, AccumulateTokenGrad{dx.as<bf16>(), H}, s,
                          sc.split);
}

}  // namespace moe_echo::cuda::router_detail

namespace moe_echo::cuda {

size_t router_scratch_bytes(int64_t tokens, int64_t experts, int64_t hidden) {
  ScratchCarver c(nullptr);
  router_detail::carve(c, tokens, experts, hidden);
  return c.used();
}

}  // namespace moe_echo::cuda
