// Router on the GPU: logits = x W^T (bf16 x, f32 W, f32 accumulation), scores, top-k by
// score + bias with ties to the lower expert index, combine weights, counts, aux and z losses; the
// backward to dW and dx; the aux-loss-free bias update. Semantics: src/cpu/router.cpp.
//
// Precision: logits accumulate in f32 (tiled GEMM, fixed k order). Everything per token after
// the logits (logsumexp, scores, selection keys, combine weights, the loss sums) is computed in
// double from the stored f32 logits, as the CPU reference does, so for equal logits the scores,
// the selection and the weights agree with the CPU to the last bit in practice; the selection can
// differ from the CPU's only where two keys are within the f32 rounding of the logits.
// Determinism: counts use integer atomics (order-free); every floating-point sum is done by one
// thread in a fixed order or by a fixed warp butterfly.
#include <cfloat>
#include <climits>

#include "cuda/common.cuh"
#include "cuda/ops.hpp"
#include "cuda/tiled_gemm.cuh"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

constexpr int kTokensPerLossBlock = 64;
constexpr int kWarpsPerBlock = 8;

struct RouterScratch {
  double* lse = nullptr;        // [T] logsumexp of each token's logits
  double* total = nullptr;      // [T] sum over experts of the (unrounded) scores
  double* partial = nullptr;    // [blocks, E] per-block sums of the normalised scores
  double* partial_z = nullptr;  // [blocks] per-block sums of lse^2
  float* dl = nullptr;          // [T, E] gradient w.r.t. the logits (backward)
  float* split = nullptr;       // split-K partial sums of the tiled GEMMs
};

int64_t loss_blocks(int64_t T) { return (T + kTokensPerLossBlock - 1) / kTokensPerLossBlock; }

RouterScratch carve(ScratchCarver& c, int64_t T, int64_t E) {
  RouterScratch r;
  r.lse = c.take<double>(T);
  r.total = c.take<double>(T);
  r.partial = c.take<double>(loss_blocks(T) * E);
  r.partial_z = c.take<double>(loss_blocks(T));
  r.dl = c.take<float>(T * E);
  r.split = c.take<float>(tiled_gemm_scratch_floats());
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
struct LoadDlT {  // A(m = e, k = t) = dl[t, e]
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
struct LoadDl {  // A(m = t, k = e) = dl[t, e]
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

// ---- forward ----------------------------------------------------------------------------------

// (key, index) order of the selection: larger key first, then the lower index.
__device__ __forceinline__ bool ranks_before(double ka, int a, double kb, int b) {
  return ka > kb || (ka == kb && a < b);
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
// for the per-expert terms.
__global__ void router_loss_final_kernel(int64_t T, int E, int K, int64_t blocks,
                                         double* partial, const double* __restrict__ partial_z,
                                         const int32_t* __restrict__ counts, double aux_coeff,
                                         double z_coeff, float* losses) {
  for (int e = int(threadIdx.x); e < E; e += int(blockDim.x)) {
    double p = 0;
    for (int64_t b = 0; b < blocks; ++b) p += partial[b * E + e];
    partial[e] = double(counts[e]) / double(T * K) * (p / double(T));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double aux = 0, z = 0;
    for (int e = 0; e < E; ++e) aux += partial[e];
    for (int64_t b = 0; b < blocks; ++b) z += partial_z[b];
    losses[0] = float(aux * aux_coeff * double(E));
    losses[1] = float(z_coeff * z / double(T));
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
                                      float* dl_out) {
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
      dl_out[t * E + e] = float(d);
    }
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

}  // namespace

size_t router_scratch_bytes(int64_t tokens, int64_t experts) {
  ScratchCarver c(nullptr);
  carve(c, tokens, experts);
  return c.used();
}

void router_forward(const RouterForwardArgs& a, void* scratch, cudaStream_t s) {
  check_router_dtypes(a.x, a.weight);
  const int64_t T = a.x.size(0), H = a.x.size(1), E = a.weight.size(0), K = a.topk_idx.size(1);
  MOE_ECHO_CUDA_CHECK(cudaMemsetAsync(a.counts.data, 0, size_t(E) * sizeof(int32_t), s));
  if (T == 0) {
    MOE_ECHO_CUDA_CHECK(cudaMemsetAsync(a.losses.data, 0, 2 * sizeof(float), s));
    return;
  }
  ScratchCarver c(scratch);
  const RouterScratch sc = carve(c, T, E);
  float* logits = a.logits.as<float>();
  tiled_gemm<true, true>("router_logits", T, E, H, LoadTokenRow{a.x.as<bf16>(), H},
                         LoadWeightT{a.weight.as<float>(), H}, StoreLogits{logits, E}, s,
                         sc.split);
  const bool sigmoid = a.score_function == ScoreFunction::sigmoid;
  MOE_ECHO_LAUNCH(router_topk_kernel, token_warp_blocks(T), 32 * kWarpsPerBlock, 0, s, T, int(E),
                  int(K), logits, a.bias.as<float>(), a.scores.as<float>(),
                  a.topk_idx.as<int32_t>(), a.topk_weight.as<float>(), a.counts.as<int32_t>(),
                  sc.lse, sc.total, sigmoid, a.normalize_topk);
  const int64_t blocks = loss_blocks(T);
  MOE_ECHO_LAUNCH(router_loss_partial_kernel, unsigned(blocks), 256, 0, s, T, int(E), logits,
                  sc.lse, sc.total, sigmoid, sc.partial, sc.partial_z);
  MOE_ECHO_LAUNCH(router_loss_final_kernel, 1, 256, 0, s, T, int(E), int(K), blocks, sc.partial,
                  sc.partial_z, a.counts.as<int32_t>(), a.aux_loss_coeff, a.z_loss_coeff,
                  a.losses.as<float>());
}

void router_backward(const RouterBackwardArgs& a, void* scratch, cudaStream_t s) {
  check_router_dtypes(a.x, a.weight);
  const int64_t T = a.x.size(0), H = a.x.size(1), E = a.weight.size(0), K = a.topk_idx.size(1);
  if (T == 0) return;
  ScratchCarver c(scratch);
  const RouterScratch sc = carve(c, T, E);
  MOE_ECHO_LAUNCH(router_dlogits_kernel, token_warp_blocks(T), 32 * kWarpsPerBlock, 0, s, T,
                  int(E), int(K), a.logits.as<float>(), a.scores.as<float>(),
                  a.topk_idx.as<int32_t>(), a.topk_weight.as<float>(), a.counts.as<int32_t>(),
                  a.d_topk_weight.as<float>(), a.score_function == ScoreFunction::sigmoid,
                  a.normalize_topk, a.aux_loss_coeff, a.z_loss_coeff, sc.dl);
  // dW[E, H] += dl^T x (reduction over tokens), dx[T, H] += dl W (reduction over experts).
  tiled_gemm<false, false>("router_weight_grad", E, H, T, LoadDlT{sc.dl, E},
                           LoadTokenCol{a.x.as<bf16>(), H},
                           AccumulateWeightGrad{a.d_weight.as<float>(), H}, s, sc.split);
  tiled_gemm<true, false>("router_token_grad", T, H, E, LoadDl{sc.dl, E},
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
