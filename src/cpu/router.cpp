// Router: fp32 (or fp64) scores, top-k selection with the aux-loss-free bias, combine weights,
// Switch-style aux loss and z-loss; and the backward of all of it.
//
// aux = coeff * E * sum_e f_e * P_e with f_e = counts_e / (T*K) (not differentiated) and
// P_e = mean_t p[t,e], p = softmax probabilities, or sigmoid scores normalised over experts.
// z = coeff * mean_t logsumexp(logits_t)^2. The bias only changes which experts are selected.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu/cpu_ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cpu {
namespace {

double logsumexp(const double* l, int n) {
  double m = -INFINITY;
  for (int i = 0; i < n; ++i) m = std::max(m, l[i]);
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(l[i] - m);
  return m + std::log(s);
}

}  // namespace

template <class T>
void router_forward(const RouterForwardArgs& a) {
  const RouterTensors& io = a.tensors;
  const RouterConfig& cfg = a.config;
  const int64_t T_ = io.x.size(0), H = io.x.size(1), E = io.weight.size(0), K = io.topk_idx.size(1);
  const T* x = io.x.as<T>();
  const T* w = io.weight.as<T>();
  const T* bias = a.bias.as<T>();
  T* logits = io.logits.as<T>();
  T* scores = io.scores.as<T>();
  int32_t* idx = io.topk_idx.as<int32_t>();
  T* tw = io.topk_weight.as<T>();
  int32_t* counts = io.counts.as<int32_t>();
  std::fill(counts, counts + E, 0);

  std::vector<double> l(static_cast<size_t>(E)), s(static_cast<size_t>(E)),
      prob_sum(static_cast<size_t>(E), 0.0);
  std::vector<int> order(static_cast<size_t>(E));
  double z_sum = 0;
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      double acc = 0;
      for (int64_t h = 0; h < H; ++h) acc += double(x[t * H + h]) * double(w[e * H + h]);
      l[size_t(e)] = double(T(acc));
      logits[t * E + e] = T(acc);
    }
    const double lse = logsumexp(l.data(), int(E));
    z_sum += lse * lse;
    double s_total = 0;
    for (int64_t e = 0; e < E; ++e) {
      s[size_t(e)] = cfg.score_function == ScoreFunction::softmax
                         ? std::exp(l[size_t(e)] - lse)
                         : 1.0 / (1.0 + std::exp(-l[size_t(e)]));
      scores[t * E + e] = T(s[size_t(e)]);
      s_total += s[size_t(e)];
    }
    for (int64_t e = 0; e < E; ++e) prob_sum[size_t(e)] += s[size_t(e)] / s_total;
    // Top-k by score + bias, ties to the lower expert index.
    std::iota(order.begin(), order.end(), 0);
    auto better = [&](int p, int q) {
      const double sp = double(T(s[size_t(p)])) + double(bias[p]);
      const double sq = double(T(s[size_t(q)])) + double(bias[q]);
      return sp > sq || (sp == sq && p < q);
    };
    std::partial_sort(order.begin(), order.begin() + K, order.end(), better);
    double sel_sum = 0;
    for (int64_t k = 0; k < K; ++k) sel_sum += double(T(s[size_t(order[size_t(k)])]));
    for (int64_t k = 0; k < K; ++k) {
      const int e = order[size_t(k)];
      idx[t * K + k] = e;
      const double sv = double(T(s[size_t(e)]));
      tw[t * K + k] = T(cfg.normalize_topk ? sv / sel_sum : sv);
      counts[e] += 1;
    }
  }
  T* losses = a.losses.as<T>();
  double aux = 0, z = 0;
  if (T_ > 0) {
    for (int64_t e = 0; e < E; ++e)
      aux += double(counts[e]) / double(T_ * K) * (prob_sum[size_t(e)] / double(T_));
    aux *= cfg.aux_loss_coeff * double(E);
    z = cfg.z_loss_coeff * z_sum / double(T_);
  }
  losses[0] = T(aux);
  losses[1] = T(z);
}

template <class T>
void router_backward(const RouterBackwardArgs& a) {
  const RouterTensors& io = a.tensors;
  const RouterConfig& cfg = a.config;
  const int64_t T_ = io.x.size(0), H = io.x.size(1), E = io.weight.size(0), K = io.topk_idx.size(1);
  if (T_ == 0) return;
  const T* x = io.x.as<T>();
  const T* w = io.weight.as<T>();
  const T* logits = io.logits.as<T>();
  const T* scores = io.scores.as<T>();
  const int32_t* idx = io.topk_idx.as<int32_t>();
  const T* tw = io.topk_weight.as<T>();
  const int32_t* counts = io.counts.as<int32_t>();
  const T* g = a.d_topk_weight.as<T>();
  T* dw = a.d_weight.as<T>();
  T* dx = a.dx.as<T>();

  // d aux / d p[t,e] = coeff * E * f_e / T.
  std::vector<double> d_p(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e)
    d_p[size_t(e)] =
        cfg.aux_loss_coeff * double(E) * double(counts[e]) / double(T_ * K) / double(T_);

  std::vector<double> ds(static_cast<size_t>(E)), dl(static_cast<size_t>(E)),
      l(static_cast<size_t>(E));
  for (int64_t t = 0; t < T_; ++t) {
    const T* s = scores + t * E;
    std::fill(ds.begin(), ds.end(), 0.0);
    // Combine weights.
    if (cfg.normalize_topk) {
      double sel_sum = 0, gw = 0;
      for (int64_t k = 0; k < K; ++k) {
        sel_sum += double(s[idx[t * K + k]]);
        gw += double(g[t * K + k]) * double(tw[t * K + k]);
      }
      for (int64_t k = 0; k < K; ++k)
        ds[size_t(idx[t * K + k])] += (double(g[t * K + k]) - gw) / sel_sum;
    } else {
      for (int64_t k = 0; k < K; ++k) ds[size_t(idx[t * K + k])] += double(g[t * K + k]);
    }
    // Aux loss through p.
    if (cfg.aux_loss_coeff != 0) {
      if (cfg.score_function == ScoreFunction::softmax) {
        for (int64_t e = 0; e < E; ++e) ds[size_t(e)] += d_p[size_t(e)];
      } else {
        double S = 0, dps = 0;
        for (int64_t e = 0; e < E; ++e) {
          S += double(s[e]);
          dps += d_p[size_t(e)] * double(s[e]);
        }
        for (int64_t e = 0; e < E; ++e) ds[size_t(e)] += d_p[size_t(e)] / S - dps / (S * S);
      }
    }
    // Scores to logits.
    if (cfg.score_function == ScoreFunction::softmax) {
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += ds[size_t(e)] * double(s[e]);
      for (int64_t e = 0; e < E; ++e) dl[size_t(e)] = double(s[e]) * (ds[size_t(e)] - dot);
    } else {
      for (int64_t e = 0; e < E; ++e)
        dl[size_t(e)] = ds[size_t(e)] * double(s[e]) * (1.0 - double(s[e]));
    }
    // z-loss: d/dl of coeff/T * lse^2 = coeff/T * 2 lse * softmax(l).
    if (cfg.z_loss_coeff != 0) {
      for (int64_t e = 0; e < E; ++e) l[size_t(e)] = double(logits[t * E + e]);
      const double lse = logsumexp(l.data(), int(E));
      const double c = cfg.z_loss_coeff * 2.0 * lse / double(T_);
      for (int64_t e = 0; e < E; ++e) dl[size_t(e)] += c * std::exp(l[size_t(e)] - lse);
    }
    for (int64_t e = 0; e < E; ++e) {
      const double d = dl[size_t(e)];
      for (int64_t h = 0; h < H; ++h) {
        dw[e * H + h] = T(double(dw[e * H + h]) + d * double(x[t * H + h]));
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      double acc = 0;
      for (int64_t e = 0; e < E; ++e) acc += dl[size_t(e)] * double(w[e * H + h]);
      dx[t * H + h] = T(double(dx[t * H + h]) + acc);
    }
  }
}

template <class T>
void router_bias_update(const Tensor& routing_map, const Tensor& bias, double rate) {
  const int64_t R = routing_map.size(0), E = routing_map.size(1);
  const int32_t* C = routing_map.as<int32_t>();
  T* b = bias.as<T>();
  std::vector<int64_t> count(static_cast<size_t>(E), 0);
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t e = 0; e < E; ++e) {
      count[size_t(e)] += C[r * E + e];
      total += C[r * E + e];
    }
  // sign(mean - count_e), compared as total vs E * count_e to stay in integers.
  for (int64_t e = 0; e < E; ++e) {
    const int64_t diff = total - E * count[size_t(e)];
    const double sgn = diff > 0 ? 1.0 : (diff < 0 ? -1.0 : 0.0);
    b[e] = T(double(b[e]) + rate * sgn);
  }
}

template void router_forward<float>(const RouterForwardArgs&);
template void router_forward<double>(const RouterForwardArgs&);
template void router_backward<float>(const RouterBackwardArgs&);
template void router_backward<double>(const RouterBackwardArgs&);
template void router_bias_update<float>(const Tensor&, const Tensor&, double);
template void router_bias_update<double>(const Tensor&, const Tensor&, double);

}  // namespace moe_echo::cpu
