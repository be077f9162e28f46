// The router's forward on the GPU: logits (router_products.cu), then per token the scores,
// top-k by score + bias with ties to the lower expert index, combine weights, counts, and the aux
// and z losses. Semantics: src/cpu/router.cpp; precision and determinism: router_detail.cuh.
//
// The per-token forward (scores, top-k, weights, counts, loss partials) is one kernel for
// E <= 32 * kMaxExpertsPerLane (router_select_kernel, with the arithmetic per token of the two it
// replaces); larger E takes router_topk_kernel and router_loss_partial_kernel.
#include <algorithm>
#include <cfloat>
#include <climits>

#include "cuda/router_detail.cuh"

namespace moe_echo::cuda::router_detail {
namespace {

// (key, index) order of the selection: larger key first, then the lower index; a NaN key after
// every number, NaN keys by index (the CPU's rank_before in src/cpu/router.cpp). A total order, so
// every lane's butterfly ends on the same pick and K picks are K distinct experts.
__device__ __forceinline__ bool ranks_before(double ka, int a, double kb, int b) {
  const bool na = isnan(ka), nb = isnan(kb);
  if (na || nb) return na == nb ? a < b : nb;
  return ka > kb || (ka == kb && a < b);
}

// The group limit's options for the kernels.
struct GroupLimit {
  int groups = 1;  // G; 1: no limit
  int per = 1;     // experts per group
  int topk_groups = 1;
  bool top2 = true;  // group score: sum of the two largest keys (else the largest)
};

// k into the two largest values seen, first >= second (the CPU's scan).
__device__ __forceinline__ void top2_insert(double k, double& first, double& second) {
  if (k > first) {
    second = first;
    first = k;
  } else if (k > second) {
    second = k;
  }
}

// Bit g set for the token's topk_groups best groups by group score (ties to the lower group), in
// every lane. each(f) calls f(group, key) for every expert the lane holds. Lane g keeps group g's
// score (G <= 32). A group's two largest keys are merged over the warp as values, so every lane
// gets the same two values the CPU's scan finds.
template <class Each>
__device__ uint32_t chosen_groups(int lane, const GroupLimit& gl, Each each) {
  double mine = -INFINITY;
  for (int g = 0; g < gl.groups; ++g) {
    double first = -INFINITY, second = -INFINITY;
    each([&](int group, double key) {
      if (group == g) top2_insert(key, first, second);
    });
    for (int o = 16; o > 0; o >>= 1) {
      const double of = __shfl_xor_sync(0xffffffffu, first, o);
      const double os = __shfl_xor_sync(0xffffffffu, second, o);
      if (of > first) {
        second = first > os ? first : os;
        first = of;
      } else {
        second = second > of ? second : of;
      }
    }
    if (lane == g) mine = gl.top2 ? first + second : first;
  }
  uint32_t mask = 0;
  for (int i = 0; i < gl.topk_groups; ++i) {
    double best_key = -INFINITY;
    int best = INT_MAX;
    if (lane < gl.groups && !((mask >> lane) & 1u)) {
      best_key = mine;
      best = lane;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const double ok = __shfl_xor_sync(0xffffffffu, best_key, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best, o);
      if (oi != INT_MAX && (best == INT_MAX || ranks_before(ok, oi, best_key, best))) {
        best_key = ok;
        best = oi;
      }
    }
    best = __shfl_sync(0xffffffffu, best, 0);
    if (best != INT_MAX) mask |= 1u << best;
  }
  return mask;
}

// One warp per token: scores, top-k, combine weights, counts, and the per-token loss terms.
__global__ void router_topk_kernel(int64_t T, int E, int K, const float* __restrict__ logits,
                                   const float* __restrict__ bias, float* scores, int32_t* idx,
                                   float* weights, int32_t* counts, double* lse_out,
                                   double* total_out, bool sigmoid, bool normalize, GroupLimit gl,
                                   double scale) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t < T; t += warps) {
    const float* l = logits + t * E;
    float* s = scores + t * E;
    const double lse = warp_logsumexp(l, lane, E);
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
    const uint32_t allowed = gl.groups > 1
                                 ? chosen_groups(lane, gl,
                                                 [&](auto f) {
                                                   for (int e = lane; e < E; e += 32)
                                                     f(e / gl.per, double(s[e]) + double(bias[e]));
                                                 })
                                 : 1u;

    // K rounds of arg-max over the allowed experts ranked after the previous pick.
    double prev_key = 0, sel_sum = 0;
    int prev = -1;
    for (int k = 0; k < K; ++k) {
      double best_key = -INFINITY;
      int best = INT_MAX;
      for (int e = lane; e < E; e += 32) {
        if (!((allowed >> (e / gl.per)) & 1u)) continue;
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
      if (best == INT_MAX) best = 0;  // only when no allowed expert is left (K > allowed)
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
      weights[t * K + k] = float((normalize ? sv / sel_sum : sv) * scale);
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
                         double* __restrict__ partial_z, bool sigmoid, bool normalize,
                         GroupLimit gl, double scale, double* __restrict__ lse_out,
                         double* __restrict__ total_out) {
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
    if (lse_out && lane == 0) {  // for the sequence aux loss
      lse_out[t] = lse;
      total_out[t] = total;
    }
    // The experts this token may pick: those of its chosen groups.
    bool allowed[P];
    uint32_t groups = 1u;
    if (gl.groups > 1)
      groups = chosen_groups(lane, gl, [&](auto f) {
#pragma unroll
        for (int p = 0; p < P; ++p)
          if (lane + 32 * p < E) f((lane + 32 * p) / gl.per, double(sf[p]) + b[p]);
      });
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int e = lane + 32 * p;
      allowed[p] = e < E && (gl.groups <= 1 || ((groups >> (e / gl.per)) & 1u));
    }

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
        if (!allowed[p]) continue;
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
      // Lane 0's pick for every lane (they agree: the order is total); none left: expert 0.
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
        weights[t * K + k] = float((normalize ? sv / sel_sum : sv) * scale);
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

// Routes per expert of each sequence: counts [sequences, E] (zeroed before), one thread per
// route (integer atomics: order-free).
__global__ void router_seq_counts_kernel(int64_t T, int E, int K, int seq_len,
                                         const int32_t* __restrict__ idx, int32_t* counts) {
  const int64_t n = T * K, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    atomicAdd(counts + (i / K) / seq_len * E + idx[i], 1);
}

// One block per (expert e, sequence q): terms[q, e] = count_qe / (L K) * (sum_t p[t, e]) / L over
// the sequence's L tokens, p recomputed from the logits as the forward computes it. The threads
// sum their tokens in order, then a fixed tree.
constexpr int kSeqThreads = 128;
__global__ void __launch_bounds__(kSeqThreads)
    router_seq_terms_kernel(int64_t T, int E, int K, int seq_len, int64_t sequences,
                            const float* __restrict__ logits, const double* __restrict__ lse,
                            const double* __restrict__ total, bool sigmoid,
                            const int32_t* __restrict__ counts, double* __restrict__ terms) {
  __shared__ double red[kSeqThreads];
  const int e = int(blockIdx.x);
  for (int64_t q = blockIdx.y; q < sequences; q += gridDim.y) {
    const int64_t t0 = q * seq_len, t1 = t0 + seq_len < T ? t0 + seq_len : T;
    double acc = 0;
    for (int64_t t = t0 + threadIdx.x; t < t1; t += kSeqThreads) {
      const double l = double(logits[t * E + e]);
      const double v = sigmoid ? 1.0 / (1.0 + exp(-l)) : exp(l - lse[t]);
      acc += v / total[t];
    }
    red[threadIdx.x] = acc;
    __syncthreads();
    for (int w = kSeqThreads / 2; w > 0; w >>= 1) {
      if (int(threadIdx.x) < w) red[threadIdx.x] += red[threadIdx.x + w];
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      const double L = double(t1 - t0);
      terms[q * E + e] = double(counts[q * E + e]) / (L * double(K)) * (red[0] / L);
    }
    __syncthreads();
  }
}

// One block: aux = coeff * E * sum_e f_e P_e, z = coeff * mean_t lse^2. partial[0, :] is reused
// for the per-expert terms. One warp per expert sums the blocks (lanes in block order, then a
// fixed butterfly), so the block count does not serialise.
// With block_counts, counts[e] is first written as the sum of the blocks' routes to e.
__global__ void router_loss_final_kernel(int64_t T, int E, int K, int64_t blocks, double* partial,
                                         const double* __restrict__ partial_z,
                                         const int32_t* __restrict__ block_counts, int32_t* counts,
                                         double aux_coeff, double z_coeff, float* losses,
                                         int64_t sequences, double* seq_terms, double seq_coeff) {
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
  // Sequence aux: one warp per sequence sums its terms (lanes in expert order, then a fixed
  // butterfly) into seq_terms[q, 0].
  for (int64_t q = warp; q < sequences; q += warps) {
    double v = 0;
    for (int e = lane; e < E; e += 32) v += seq_terms[q * E + e];
    v = warp_sum(v);
    __syncwarp();  // every lane has read seq_terms[q, 0] before lane 0 overwrites it
    if (lane == 0) seq_terms[q * E] = v;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double aux = 0;
    for (int e = 0; e < E; ++e) aux += partial[e];
    losses[0] = float(aux * aux_coeff * double(E));
    losses[1] = float(z_coeff * z_sum / double(T));
    double seq = 0;
    for (int64_t q = 0; q < sequences; ++q) seq += seq_terms[q * E];
    losses[2] = sequences > 0 ? float(seq * (seq_coeff * double(E) / double(sequences))) : 0.f;
  }
}

}  // namespace

void sequence_counts(int64_t T, int E, int K, int seq_len, int64_t sequences, const int32_t* idx,
                     int32_t* counts, cudaStream_t s) {
  MOE_ECHO_CUDA_CHECK(
      cudaMemsetAsync(counts, 0, size_t(sequences) * size_t(E) * sizeof(int32_t), s));
  MOE_ECHO_LAUNCH(router_seq_counts_kernel, blocks_for(T * K, 256, grid_cap()), 256, 0, s, T, E, K,
                  seq_len, idx, counts);
}

}  // namespace moe_echo::cuda::router_detail

namespace moe_echo::cuda {

using namespace router_detail;

void router_forward(const RouterForwardArgs& a, void* scratch, GroupedGemm* gemm, cudaStream_t s) {
  const RouterTensors& io = a.tensors;
  const RouterConfig& cfg = a.config;
  check_router_dtypes(io.x, io.weight);
  const int64_t T = io.x.size(0), H = io.x.size(1), E = io.weight.size(0), K = io.topk_idx.size(1);
  if (T == 0) {
    MOE_ECHO_CUDA_CHECK(cudaMemsetAsync(io.counts.data, 0, size_t(E) * sizeof(int32_t), s));
    MOE_ECHO_CUDA_CHECK(cudaMemsetAsync(a.losses.data, 0, 3 * sizeof(float), s));
    return;
  }
  ScratchCarver c(scratch);
  const RouterScratch sc = carve(c, T, E, H);
  logits_product(io.x, io.weight, io.logits, sc, gemm, s);
  const float* logits = io.logits.as<float>();
  const bool sigmoid = cfg.score_function == ScoreFunction::sigmoid;
  const int64_t blocks = loss_blocks(T);
  const int64_t sequences = router_sequences(cfg, T);
  GroupLimit gl;
  gl.groups = cfg.expert_groups;
  gl.per = int(E / std::max(1, cfg.expert_groups));
  gl.topk_groups = cfg.topk_groups;
  gl.top2 = cfg.group_score == GroupScore::top2_sum;
  MOE_ECHO_CHECK(gl.groups >= 1 && gl.groups <= kMaxExpertGroups && E % gl.groups == 0 &&
                     gl.topk_groups >= 1 && gl.topk_groups <= gl.groups,
                 "router groups: expert_groups = " << gl.groups << ", topk_groups = "
                                                   << gl.topk_groups << " for " << E << " experts");
  auto select = [&](auto kernel) {
    MOE_ECHO_LAUNCH(kernel, unsigned(blocks), kSelectWarps * 32, select_smem_bytes(E), s, T, int(E),
                    int(K), logits, a.bias.as<float>(), io.scores.as<float>(),
                    io.topk_idx.as<int32_t>(), io.topk_weight.as<float>(), sc.block_counts,
                    sc.partial, sc.partial_z, sigmoid, cfg.normalize_topk, gl,
                    cfg.routed_scaling_factor, sequences > 0 ? sc.lse : nullptr, sc.total);
  };
  const bool fused =
      with_experts_per_lane(E, [&](auto p) { select(router_select_kernel<decltype(p)::value>); });
  if (!fused) {
    MOE_ECHO_CUDA_CHECK(cudaMemsetAsync(io.counts.data, 0, size_t(E) * sizeof(int32_t), s));
    MOE_ECHO_LAUNCH(router_topk_kernel, token_warp_blocks(T), 32 * kWarpsPerBlock, 0, s, T, int(E),
                    int(K), logits, a.bias.as<float>(), io.scores.as<float>(),
                    io.topk_idx.as<int32_t>(), io.topk_weight.as<float>(), io.counts.as<int32_t>(),
                    sc.lse, sc.total, sigmoid, cfg.normalize_topk, gl, cfg.routed_scaling_factor);
    MOE_ECHO_LAUNCH(router_loss_partial_kernel, unsigned(blocks), 256, 0, s, T, int(E), logits,
                    sc.lse, sc.total, sigmoid, sc.partial, sc.partial_z);
  }
  if (sequences > 0) {
    sequence_counts(T, int(E), int(K), cfg.seq_len, sequences, io.topk_idx.as<int32_t>(),
                    sc.seq_counts, s);
    const dim3 grid(unsigned(E), unsigned(std::min<int64_t>(sequences, 65535)));
    MOE_ECHO_LAUNCH(router_seq_terms_kernel, grid, kSeqThreads, 0, s, T, int(E), int(K),
                    cfg.seq_len, sequences, logits, sc.lse, sc.total, sigmoid, sc.seq_counts,
                    sc.seq_terms);
  }
  MOE_ECHO_LAUNCH(router_loss_final_kernel, 1, 256, 0, s, T, int(E), int(K), blocks, sc.partial,
                  sc.partial_z, fused ? sc.block_counts : nullptr, io.counts.as<int32_t>(),
                  cfg.aux_loss_coeff, cfg.z_loss_coeff, a.losses.as<float>(), sequences,
                  sc.seq_terms, cfg.seq_aux_loss_coeff);
}

}  // namespace moe_echo::cuda
