// Internal pieces shared by the router's translation units (semantics: src/cpu/router.cpp):
// - router_products.cu: the three f32 products logits = x W^T, dW += dl^T x and dx += dl W (FFMA
//   kernels, tensor cores through the grouped GEMM, or the generic tiled GEMM), and the scratch;
// - router_select.cu: the forward, i.e. scores, the group limit, top-k by score + bias with ties
//   to the lower expert index, combine weights, counts, aux, z and sequence aux losses;
// - router_backward.cu: dl = the gradient w.r.t. the logits, the backward to dW and dx, and the
//   aux-loss-free bias update.
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
// Invariants between the files: every router op carves its scratch from the arena with carve(), in
// one fixed order, so a backward finds nothing of the forward's but what the args hold; dl is
// [T, padded_experts(E)] f32 with zeros past E, so the products read 8 experts as aligned float4.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda::router_detail {

constexpr int kTokensPerLossBlock = 32;
constexpr int kWarpsPerBlock = 8;
// The fused selection kernel (E <= 32 * kMaxExpertsPerLane): one block of kSelectWarps warps per
// kTokensPerLossBlock tokens, one warp per token, each lane holding experts lane + 32 p.
constexpr int kSelectWarps = 16, kMaxExpertsPerLane = 8;
// The gradient w.r.t. the logits is kept as [T, padded_experts(E)] (zeros past E), so the
// products can read 8 experts at a time as aligned float4 words.
constexpr int kExpertPad = 8;
inline int64_t padded_experts(int64_t E) { return (E + kExpertPad - 1) / kExpertPad * kExpertPad; }

struct RouterScratch {
  double* lse = nullptr;            // [T] logsumexp of each token's logits
  double* total = nullptr;          // [T] sum over experts of the (unrounded) scores
  double* partial = nullptr;        // [blocks, E] per-block sums of the normalised scores
  double* partial_z = nullptr;      // [blocks] per-block sums of lse^2
  int32_t* block_counts = nullptr;  // [blocks, E] routes per expert of each block
  float* dl = nullptr;              // [T, padded E] gradient w.r.t. the logits (backward)
  // The sequence aux loss (at most T sequences): routes per expert of each sequence, and each
  // sequence's per-expert terms f_se P_se (forward).
  int32_t* seq_counts = nullptr;  // [sequences, E]
  double* seq_terms = nullptr;    // [sequences, E]
  // The tensor-core products (tensor_shapes only): one-group windows {0, H} and {0, T}, then
  // the dW product's row groups of the T rows (offsets 4 on); x^T
  // [H, T]; W's three parts, transposed [3][H, E] (forward) or as [W0; W1; W0] [3E, H]
  // (backward); dl's parts [3][T, E] and [dl0 | dl0 | dl1] [T, 3E].
  int32_t* offsets = nullptr;
  bf16 *x_t = nullptr, *w_parts = nullptr, *dl_parts = nullptr, *dl_cat = nullptr;
  float* split = nullptr;       // split-K partial sums of the tiled GEMMs
  float* dw_partial = nullptr;  // [splits, padded E, H] per-split sums of the dW product
                                // (tensor cores: [row groups, E, H])
};

// The sequence aux loss's part of d loss / d p[t, e]: coeff / sequences * E * count_qe / (L K) / L
// for token t of sequence q of L tokens (the CPU's expression, in its order).
struct SequenceLoss {
  const int32_t* counts = nullptr;  // [sequences, E]
  int seq_len = 0;
  int64_t sequences = 0;  // 0: no sequence loss
  double coeff = 0;
  __device__ __forceinline__ double d_p(int64_t T, int E, int K, int64_t t, int e) const {
    const int64_t q = t / seq_len;
    const int64_t left = T - q * seq_len;
    const double L = double(left < seq_len ? left : int64_t(seq_len));
    return coeff / double(sequences) * double(E) * double(counts[q * E + e]) / (L * double(K)) / L;
  }
};

// Routes per expert of each sequence of `seq_len` tokens: counts [sequences, E] (forward and
// backward; router_select.cu).
void sequence_counts(int64_t T, int E, int K, int seq_len, int64_t sequences, const int32_t* idx,
                     int32_t* counts, cudaStream_t s);

inline int64_t loss_blocks(int64_t T) {
  return (T + kTokensPerLossBlock - 1) / kTokensPerLossBlock;
}

// The scratch of T tokens (router_products.cu: most of it is the products').
RouterScratch carve(ScratchCarver& c, int64_t T, int64_t E, int64_t H);

inline void check_router_dtypes(const Tensor& x, const Tensor& w) {
  MOE_ECHO_CHECK(x.dtype == DType::bf16,
                 "router x must be bf16 on the CUDA backend, got " << x.describe());
  MOE_ECHO_CHECK(w.dtype == DType::f32,
                 "router weight must be f32 on the CUDA backend, got " << w.describe());
}

inline unsigned token_warp_blocks(int64_t T) { return blocks_for(T, kWarpsPerBlock, grid_cap()); }

// The register kernels' experts per lane for E experts: calls f(std::integral_constant<int, P>{})
// with the fewest P of 1, 2, 4, kMaxExpertsPerLane that hold E on a warp and returns true, or
// returns false without a call when E > 32 * kMaxExpertsPerLane.
template <class F>
bool with_experts_per_lane(int64_t E, F&& f) {
  if (E <= 32)
    f(std::integral_constant<int, 1>{});
  else if (E <= 64)
    f(std::integral_constant<int, 2>{});
  else if (E <= 128)
    f(std::integral_constant<int, 4>{});
  else if (E <= 32 * kMaxExpertsPerLane)
    f(std::integral_constant<int, kMaxExpertsPerLane>{});
  else
    return false;
  return true;
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

// The same over a token's f32 logits l[0, E) in memory, lane j reading experts j, j + 32, ...
__device__ __forceinline__ double warp_logsumexp(const float* l, int lane, int E) {
  double mx = -INFINITY;
  for (int e = lane; e < E; e += 32) mx = fmax(mx, double(l[e]));
  mx = warp_max(mx);
  double sum_exp = 0;
  for (int e = lane; e < E; e += 32) sum_exp += exp(double(l[e]) - mx);
  return mx + log(warp_sum(sum_exp));
}

// The products (router_products.cu), each on the fastest path the shapes allow: on tensor cores
// when `gemm` is given (see router_products.cu), else the FFMA kernels, else the tiled GEMM.
// logits [T, E] = x W^T.
void logits_product(const Tensor& x, const Tensor& w, const Tensor& logits, const RouterScratch& sc,
                    GroupedGemm* gemm, cudaStream_t s);
// dW [E, H] += dl^T x (a sum over tokens) and dx [T, H] += dl W (a sum over experts), dl = sc.dl.
void grad_products(const Tensor& x, const Tensor& w, const Tensor& d_weight, const Tensor& dx,
                   const RouterScratch& sc, GroupedGemm* gemm, cudaStream_t s);

}  // namespace moe_echo::cuda::router_detail
