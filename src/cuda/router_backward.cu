// The router's backward on the GPU: dl = d(task + aux + z) / d logits per token, then dW += dl^T x
// and dx += dl W (router_products.cu); and the aux-loss-free bias update. Semantics:
// src/cpu/router.cpp; precision and determinism: router_detail.cuh.
//
// dl is computed in double from the stored f32 scores and logits and stored as f32 in
// [T, padded_experts(E)] with zeros past E. For E <= 32 * kMaxExpertsPerLane one kernel keeps a
// token's data in registers (router_dlogits_reg_kernel); larger E reads them from memory
// (router_dlogits_kernel), with the per-expert sums in the same order.
#include "cuda/router_detail.cuh"

namespace moe_echo::cuda::router_detail {
namespace {

// One warp per token: dl[t, :] = d(task + aux + z) / d logits[t, :].
__global__ void router_dlogits_kernel(int64_t T, int E, int K, const float* __restrict__ logits,
                                      const float* __restrict__ scores,
                                      const int32_t* __restrict__ idx,
                                      const float* __restrict__ weights,
                                      const int32_t* __restrict__ counts,
                                      const float* __restrict__ d_weights, bool sigmoid,
                                      bool normalize, double aux_coeff, double z_coeff, int Ep,
                                      float* dl_out, double scale, SequenceLoss seq) {
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
    const bool aux = aux_coeff != 0 || seq.sequences > 0;
    auto d_p = [&](int e) {
      double d = aux_coeff * double(E) * double(counts[e]) / double(T * K) / double(T);
      if (seq.sequences > 0) d += seq.d_p(T, E, K, t, e);
      return d;
    };
    double S = 1, dps = 0;  // sigmoid aux: sum of scores and sum of d_p * s
    if (aux && sigmoid) {
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
          ds += normalize ? (scale * g - gw) / sel_sum : scale * g;
        }
      if (aux) ds += sigmoid ? d_p(e) / S - dps / (S * S) : d_p(e);
      return ds;
    };
    double dot = 0;
    if (!sigmoid) {
      for (int e = lane; e < E; e += 32) dot += ds_of(e) * double(s[e]);
      dot = warp_sum(dot);
    }
    double lse = 0, zc = 0;
    if (z_coeff != 0) {
      lse = warp_logsumexp(l, lane, E);
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
__global__ void router_dlogits_reg_kernel(
    int64_t T, int E, int K, const float* __restrict__ logits, const float* __restrict__ scores,
    const int32_t* __restrict__ idx, const float* __restrict__ weights,
    const int32_t* __restrict__ counts, const float* __restrict__ d_weights, bool sigmoid,
    bool normalize, double aux_coeff, double z_coeff, int Ep, float* __restrict__ dl_out,
    double scale, SequenceLoss seq) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const bool aux = aux_coeff != 0 || seq.sequences > 0;
  double d_p_batch[P];  // the batch aux loss's gradient w.r.t. p[e]
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int e = lane + 32 * p;
    d_p_batch[p] =
        e < E ? aux_coeff * double(E) * double(counts[e]) / double(T * K) / double(T) : 0.0;
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
    double d_p[P];  // every aux loss's gradient w.r.t. p[t, e]
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int e = lane + 32 * p;
      d_p[p] = d_p_batch[p];
      if (seq.sequences > 0 && e < E) d_p[p] += seq.d_p(T, E, K, t, e);
    }
    double S = 1, dps = 0;  // sigmoid aux: sum of scores and sum of d_p * s
    if (aux && sigmoid) {
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
        const double term = normalize ? (scale * gk - gw) / sel_sum : scale * gk;
#pragma unroll
        for (int p = 0; p < P; ++p)
          if (e == lane + 32 * p) ds[p] += term;
      }
    }
    if (aux) {
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

}  // namespace
}  // namespace moe_echo::cuda::router_detail

namespace moe_echo::cuda {

using namespace router_detail;

void router_backward(const RouterBackwardArgs& a, void* scratch, GroupedGemm* gemm,
                     cudaStream_t s) {
  const RouterTensors& io = a.tensors;
  const RouterConfig& cfg = a.config;
  check_router_dtypes(io.x, io.weight);
  const int64_t T = io.x.size(0), H = io.x.size(1), E = io.weight.size(0), K = io.topk_idx.size(1);
  if (T == 0) return;
  ScratchCarver c(scratch);
  const RouterScratch sc = carve(c, T, E, H);
  const int64_t Ep = padded_experts(E);
  SequenceLoss seq;
  seq.sequences = router_sequences(cfg, T);
  if (seq.sequences > 0) {  // the forward's routes per sequence, counted again
    sequence_counts(T, int(E), int(K), cfg.seq_len, seq.sequences, io.topk_idx.as<int32_t>(),
                    sc.seq_counts, s);
    seq.counts = sc.seq_counts;
    seq.seq_len = cfg.seq_len;
    seq.coeff = cfg.seq_aux_loss_coeff;
  }
  auto dlogits = [&](auto kernel) {
    MOE_ECHO_LAUNCH(kernel, token_warp_blocks(T), 32 * kWarpsPerBlock, 0, s, T, int(E), int(K),
                    io.logits.as<float>(), io.scores.as<float>(), io.topk_idx.as<int32_t>(),
                    io.topk_weight.as<float>(), io.counts.as<int32_t>(),
                    a.d_topk_weight.as<float>(), cfg.score_function == ScoreFunction::sigmoid,
                    cfg.normalize_topk, cfg.aux_loss_coeff, cfg.z_loss_coeff, int(Ep), sc.dl,
                    cfg.routed_scaling_factor, seq);
  };
  const bool in_registers = with_experts_per_lane(
      E, [&](auto p) { dlogits(router_dlogits_reg_kernel<decltype(p)::value>); });
  if (!in_registers) dlogits(router_dlogits_kernel);
  // dW[E, H] += dl^T x (reduction over tokens), dx[T, H] += dl W (reduction over experts).
  grad_products(io.x, io.weight, a.d_weight, a.dx, sc, gemm, s);
}

void router_bias_update(const Tensor& routing_map, const Tensor& bias, double rate,
                        cudaStream_t s) {
  MOE_ECHO_CHECK(bias.dtype == DType::f32, "router bias must be f32, got " << bias.describe());
  const int64_t R = routing_map.size(0), E = routing_map.size(1);
  MOE_ECHO_LAUNCH(router_bias_update_kernel, E > 0 ? 1 : 0, 256, 0, s, int(R), int(E),
                  routing_map.as<int32_t>(), bias.as<float>(), rate);
}

}  // namespace moe_echo::cuda
