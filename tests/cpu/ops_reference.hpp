// Naive references of the CPU ops, written from the contracts in include/moe_echo/backend.hpp and
// docs/design.md, not src/cpu: plain double loops over host vectors, one function per op, so a
// reader can check each against the formula by eye. The op tests compare the backend with these.
//
// Where the contract fixes a storage precision (router logits and scores are stored in the
// backend's float dtype, and top-k selection and combine weights are defined on the stored
// scores), `stored(dt, v)` rounds to that dtype; everything else is exact double arithmetic.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "moe_echo/config.hpp"
#include "moe_echo/tensor.hpp"

namespace moe_echo::test::ref {

// v as a tensor of dtype dt holds it.
inline double stored(DType dt, double v) { return dt == DType::f32 ? double(float(v)) : v; }

// ---- Router -------------------------------------------------------------------------------------

struct RouterResult {
  std::vector<double> logits, scores;  // [T, E]
  std::vector<int32_t> topk_idx;       // [T, K]
  std::vector<double> topk_weight;     // [T, K]
  std::vector<int32_t> counts;         // [E]
  double aux = 0, z = 0;
};

// logits = x @ w^T; scores = softmax(logits) or sigmoid(logits); top-k by score + bias (descending,
// ties to the lower expert index); weights = selected scores (normalised to sum 1 if asked);
// aux = coeff * E * sum_e f_e P_e, f_e = count_e / (T K), P_e = mean_t p[t,e] with p the scores
// normalised over experts; z = coeff * mean_t logsumexp(logits_t)^2. No tokens: both losses 0.
inline RouterResult router_forward(const std::vector<double>& x, const std::vector<double>& w,
                                   const std::vector<double>& bias, int64_t T, int64_t H, int64_t E,
                                   int64_t K, ScoreFunction sf, bool normalize, double aux_coeff,
                                   double z_coeff, DType dt) {
  RouterResult r;
  r.logits.assign(size_t(T * E), 0.0);
  r.scores.assign(size_t(T * E), 0.0);
  r.topk_idx.assign(size_t(T * K), -1);
  r.topk_weight.assign(size_t(T * K), 0.0);
  r.counts.assign(size_t(E), 0);
  std::vector<double> p_mean(size_t(E), 0.0);
  double lse_sq_sum = 0;
  for (int64_t t = 0; t < T; ++t) {
    double* l = &r.logits[size_t(t * E)];
    double* s = &r.scores[size_t(t * E)];
    for (int64_t e = 0; e < E; ++e) {
      double dot = 0;
      for (int64_t h = 0; h < H; ++h) dot += x[size_t(t * H + h)] * w[size_t(e * H + h)];
      l[e] = stored(dt, dot);
    }
    double mx = l[0];
    for (int64_t e = 1; e < E; ++e) mx = std::max(mx, l[e]);
    double sum_exp = 0;
    for (int64_t e = 0; e < E; ++e) sum_exp += std::exp(l[e] - mx);
    const double lse = mx + std::log(sum_exp);
    lse_sq_sum += lse * lse;
    std::vector<double> exact(static_cast<size_t>(E));
    double total = 0;
    for (int64_t e = 0; e < E; ++e) {
      exact[size_t(e)] = sf == ScoreFunction::softmax ? std::exp(l[e] - mx) / sum_exp
                                                      : 1.0 / (1.0 + std::exp(-l[e]));
      total += exact[size_t(e)];
      s[e] = stored(dt, exact[size_t(e)]);
    }
    for (int64_t e = 0; e < E; ++e) p_mean[size_t(e)] += exact[size_t(e)] / total / double(T);
    // K rounds of argmax over the unchosen experts; a strict '>' keeps the lower index on ties.
    std::vector<bool> chosen(size_t(E), false);
    double sel_sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (chosen[size_t(e)]) continue;
        if (best < 0 || s[e] + bias[size_t(e)] > s[best] + bias[size_t(best)]) best = e;
      }
      chosen[size_t(best)] = true;
      r.topk_idx[size_t(t * K + k)] = int32_t(best);
      r.counts[size_t(best)] += 1;
      sel_sum += s[best];
    }
    for (int64_t k = 0; k < K; ++k) {
      const double sv = s[r.topk_idx[size_t(t * K + k)]];
      r.topk_weight[size_t(t * K + k)] = normalize ? sv / sel_sum : sv;
    }
  }
  if (T > 0) {
    double fp = 0;
    for (int64_t e = 0; e < E; ++e)
      fp += double(r.counts[size_t(e)]) / double(T * K) * p_mean[size_t(e)];
    r.aux = aux_coeff * double(E) * fp;
    r.z = z_coeff * lse_sq_sum / double(T);
  }
  return r;
}

// bias[e] + rate * sign(mean_e' count - count_e), count_e = sum_src C[src][e] (mean in double).
inline std::vector<double> router_bias_update(const std::vector<int32_t>& C, int64_t R, int64_t E,
                                              const std::vector<double>& bias, double rate) {
  std::vector<double> count(size_t(E), 0.0), out = bias;
  double total = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t e = 0; e < E; ++e) {
      count[size_t(e)] += C[size_t(r * E + e)];
      total += C[size_t(r * E + e)];
    }
  const double mean = total / double(E);
  for (int64_t e = 0; e < E; ++e) {
    const double d = mean - count[size_t(e)];
    out[size_t(e)] += rate * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0);
  }
  return out;
}

// ---- Group windows ------------------------------------------------------------------------------

// The group that owns window row i (global receive row row_lo + i), or -1 for a row outside every
// group. Empty groups own no row, so the first match is the only one.
inline int group_of_row(const std::vector<int32_t>& offsets, int64_t row_lo, int64_t i) {
  const int64_t row = row_lo + i;
  for (size_t g = 0; g + 1 < offsets.size(); ++g)
    if (offsets[g] <= row && row < offsets[g + 1]) return int(g);
  return -1;
}

// Valid rows of a window for SwiGLU (a prefix): clamp(offsets[G] - row_lo, 0, rows).
inline int64_t valid_prefix(const std::vector<int32_t>& offsets, int64_t row_lo, int64_t rows) {
  return std::clamp<int64_t>(int64_t(offsets.back()) - row_lo, 0, rows);
}

// ---- Grouped GEMM (per row; rows of no group are left as they are in `out`) ---------------------

// y[i] = x[i] @ w[g(i)], x [rows, K], w [G, K, N].
inline void gemm_fprop(const std::vector<int32_t>& off, int64_t row_lo, int64_t rows, int64_t K,
                       int64_t N, const std::vector<double>& x, const std::vector<double>& w,
                       std::vector<double>& y) {
  for (int64_t i = 0; i < rows; ++i) {
    const int g = group_of_row(off, row_lo, i);
    if (g < 0) continue;
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += x[size_t(i * K + k)] * w[size_t((g * K + k) * N + n)];
      y[size_t(i * N + n)] = acc;
    }
  }
}

// dx[i] = dy[i] @ w[g(i)]^T, dy [rows, N].
inline void gemm_dgrad(const std::vector<int32_t>& off, int64_t row_lo, int64_t rows, int64_t K,
                       int64_t N, const std::vector<double>& dy, const std::vector<double>& w,
                       std::vector<double>& dx) {
  for (int64_t i = 0; i < rows; ++i) {
    const int g = group_of_row(off, row_lo, i);
    if (g < 0) continue;
    for (int64_t k = 0; k < K; ++k) {
      double acc = 0;
      for (int64_t n = 0; n < N; ++n) acc += dy[size_t(i * N + n)] * w[size_t((g * K + k) * N + n)];
      dx[size_t(i * K + k)] = acc;
    }
  }
}

// dw[g] += sum over window rows i of g of x[i]^T dy[i].
inline void gemm_wgrad(const std::vector<int32_t>& off, int64_t row_lo, int64_t rows, int64_t K,
                       int64_t N, const std::vector<double>& x, const std::vector<double>& dy,
                       std::vector<double>& dw) {
  for (int64_t i = 0; i < rows; ++i) {
    const int g = group_of_row(off, row_lo, i);
    if (g < 0) continue;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n)
        dw[size_t((g * K + k) * N + n)] += x[size_t(i * K + k)] * dy[size_t(i * N + n)];
  }
}

// ---- SwiGLU -------------------------------------------------------------------------------------

inline double silu(double v) { return v / (1.0 + std::exp(-v)); }
inline double silu_grad(double v) {
  const double sg = 1.0 / (1.0 + std::exp(-v));
  return sg + v * sg * (1.0 - sg);
}

// a[i, f] = silu(h[i, f]) * h[i, F + f] for the first `valid` rows.
inline void swiglu_forward(int64_t valid, int64_t F, const std::vector<double>& h,
                           std::vector<double>& a) {
  for (int64_t i = 0; i < valid; ++i)
    for (int64_t f = 0; f < F; ++f)
      a[size_t(i * F + f)] = silu(h[size_t(i * 2 * F + f)]) * h[size_t(i * 2 * F + F + f)];
}

inline void swiglu_backward(int64_t valid, int64_t F, const std::vector<double>& h,
                            const std::vector<double>& da, std::vector<double>& dh) {
  for (int64_t i = 0; i < valid; ++i)
    for (int64_t f = 0; f < F; ++f) {
      const double gate = h[size_t(i * 2 * F + f)], up = h[size_t(i * 2 * F + F + f)];
      dh[size_t(i * 2 * F + f)] = da[size_t(i * F + f)] * up * silu_grad(gate);
      dh[size_t(i * 2 * F + F + f)] = da[size_t(i * F + f)] * silu(gate);
    }
}

// ---- Fan out / fan in --------------------------------------------------------------------------

// The fan table of a window (FanTable in comm.hpp) as the tests build it: members [rows, K] (a lead
// row p has members[p][0] == p, then its member rows, then -1), weights [rows, K] (empty: all 1).
// Only the first `valid` rows are looked at.
inline bool fan_lead(const std::vector<int32_t>& members, int64_t K, int64_t p) {
  return members[size_t(p * K)] == p;
}

// For every lead p < valid and member j of p: d_weight[j] = <src[p], other[j]> (when other is
// given), dst[j] = w_j src[p]. Reads only src and other, so dst may start as a copy of either.
inline void fan_out(int64_t valid, int64_t K, int64_t H, const std::vector<int32_t>& members,
                    const std::vector<double>& weights, const std::vector<double>& src,
                    const std::vector<double>* other, std::vector<double>& dst,
                    std::vector<double>* d_weight) {
  for (int64_t p = 0; p < valid; ++p) {
    if (!fan_lead(members, K, p)) continue;
    for (int64_t m = 0; m < K; ++m) {
      const int64_t j = members[size_t(p * K + m)];
      if (j < 0) break;
      const double w = weights.empty() ? 1.0 : weights[size_t(p * K + m)];
      if (other) {
        double dot = 0;
        for (int64_t h = 0; h < H; ++h) dot += src[size_t(p * H + h)] * (*other)[size_t(j * H + h)];
        (*d_weight)[size_t(j)] = dot;
      }
      for (int64_t h = 0; h < H; ++h) dst[size_t(j * H + h)] = w * src[size_t(p * H + h)];
    }
  }
}

// For every lead p < valid: dst[p] = sum over members j of p of w_j src[j].
inline void fan_in(int64_t valid, int64_t K, int64_t H, const std::vector<int32_t>& members,
                   const std::vector<double>& weights, const std::vector<double>& src,
                   std::vector<double>& dst) {
  for (int64_t p = 0; p < valid; ++p) {
    if (!fan_lead(members, K, p)) continue;
    for (int64_t h = 0; h < H; ++h) dst[size_t(p * H + h)] = 0.0;
    for (int64_t m = 0; m < K; ++m) {
      const int64_t j = members[size_t(p * K + m)];
      if (j < 0) break;
      const double w = weights.empty() ? 1.0 : weights[size_t(p * K + m)];
      for (int64_t h = 0; h < H; ++h) dst[size_t(p * H + h)] += w * src[size_t(j * H + h)];
    }
  }
}

// ---- AdamW --------------------------------------------------------------------------------------

// One AdamW step (decoupled weight decay, bias correction with the 1-based step), in place.
inline void adamw_step(std::vector<double>& p, const std::vector<double>& g, std::vector<double>& m,
                       std::vector<double>& v, double lr, double beta1, double beta2, double eps,
                       double weight_decay, int64_t step) {
  for (size_t i = 0; i < p.size(); ++i) {
    m[i] = beta1 * m[i] + (1 - beta1) * g[i];
    v[i] = beta2 * v[i] + (1 - beta2) * g[i] * g[i];
    const double m_hat = m[i] / (1 - std::pow(beta1, double(step)));
    const double v_hat = v[i] / (1 - std::pow(beta2, double(step)));
    p[i] = p[i] - lr * weight_decay * p[i] - lr * m_hat / (std::sqrt(v_hat) + eps);
  }
}

}  // namespace moe_echo::test::ref
