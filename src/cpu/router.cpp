// Router: fp32 (or fp64) scores, top-k selection with the aux-loss-free bias, combine weights,
// Switch-style aux loss and z-loss; and the backward of all of it.
//
// aux = coeff * E * sum_e f_e * P_e with f_e = counts_e / (T*K) (not differentiated) and
// P_e = mean_t p[t,e], p = softmax probabilities, or sigmoid scores normalised over experts.
// z = coeff * mean_t logsumexp(logits_t)^2. The bias only changes which experts are selected.
// The sequence aux loss is aux's formula over each run of seq_len tokens, averaged over the runs.
// Group-limited selection (expert_groups > 1) keeps the experts of the token's topk_groups best
// groups (group score: the sum of the group's two largest keys, or its largest; ties to the lower
// group) and takes the top-k among them; the weights are the normalised unbiased scores times
// routed_scaling_factor.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu/cpu_ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cpu {
namespace {

// The selection order of experts and groups: the larger key first, ties to the lower index; a NaN
// key after every number, NaN keys by index. A strict total order, as std::partial_sort needs (a
// NaN compared with > alone is not one, and can send the sort out of range): a NaN score is never
// picked over a number, and the K picks are always K distinct experts in [0, E). The GPU's
// ranks_before (src/cuda/router_select.cu) is the same order.
bool rank_before(double ka, int a, double kb, int b) {
  const bool na = std::isnan(ka), nb = std::isnan(kb);
  if (na || nb) return na == nb ? a < b : nb;
  return ka > kb || (ka == kb && a < b);
}

double logsumexp(const double* l, int n) {
  double m = -INFINITY;
  for (int i = 0; i < n; ++i) m = std::max(m, l[i]);
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(l[i] - m);
  return m + std::log(s);
}

// The experts a token may pick (ascending), given its selection keys: all of them, or those of
// its topk_groups best groups.
void eligible_experts(const RouterConfig& cfg, const std::vector<double>& key,
                      std::vector<int>& out) {
  const int E = int(key.size()), G = cfg.expert_groups, per = E / G;
  out.clear();
  if (G <= 1) {
    for (int e = 0; e < E; ++e) out.push_back(e);
    return;
  }
  std::vector<double> group(static_cast<size_t>(G));
  for (int g = 0; g < G; ++g) {
    double first = -INFINITY, second = -INFINITY;  // the two largest keys, first >= second
    for (int e = g * per; e < (g + 1) * per; ++e) {
      const double k = key[size_t(e)];
      if (k > first) {
        second = first;
        first = k;
      } else if (k > second) {
        second = k;
      }
    }
    group[size_t(g)] = cfg.group_score == GroupScore::top2_sum ? first + second : first;
  }
  std::vector<int> order(static_cast<size_t>(G));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + cfg.topk_groups, order.end(), [&](int p, int q) {
    return rank_before(group[size_t(p)], p, group[size_t(q)], q);
  });
  std::sort(order.begin(), order.begin() + cfg.topk_groups);
  for (int i = 0; i < cfg.topk_groups; ++i)
    for (int e = order[size_t(i)] * per; e < (order[size_t(i)] + 1) * per; ++e) out.push_back(e);
}

// Routes per expert of each sequence: [sequences, E].
std::vector<int64_t> sequence_counts(const RouterConfig& cfg, const int32_t* idx, int64_t T,
                                     int64_t E, int64_t K) {
  const int64_t S = router_sequences(cfg, T);
  std::vector<int64_t> c(static_cast<size_t>(S * E), 0);
  for (int64_t t = 0; S > 0 && t < T; ++t)
    for (int64_t k = 0; k < K; ++k) c[size_t(t / cfg.seq_len * E + idx[t * K + k])] += 1;
  return c;
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
  std::vector<double> key(static_cast<size_t>(E));
  std::vector<int> order;
  const int64_t S = router_sequences(cfg, T_);
  std::vector<double> seq_prob(static_cast<size_t>(S * E), 0.0);  // sum over a sequence's p
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
    for (int64_t e = 0; e < E; ++e) {
      prob_sum[size_t(e)] += s[size_t(e)] / s_total;
      key[size_t(e)] = double(T(s[size_t(e)])) + double(bias[e]);
    }
    if (S > 0)
      for (int64_t e = 0; e < E; ++e)
        seq_prob[size_t(t / cfg.seq_len * E + e)] += s[size_t(e)] / s_total;
    // Top-k by score + bias among the eligible experts, ties to the lower expert index, NaN keys
    // last (rank_before).
    eligible_experts(cfg, key, order);
    auto better = [&](int p, int q) { return rank_before(key[size_t(p)], p, key[size_t(q)], q); };
    std::partial_sort(order.begin(), order.begin() + K, order.end(), better);
    double sel_sum = 0;
    for (int64_t k = 0; k < K; ++k) sel_sum += double(T(s[size_t(order[size_t(k)])]));
    for (int64_t k = 0; k < K; ++k) {
      const int e = order[size_t(k)];
      idx[t * K + k] = e;
      const double sv = double(T(s[size_t(e)]));
      tw[t * K + k] = T((cfg.normalize_topk ? sv / sel_sum : sv) * cfg.routed_scaling_factor);
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
  // Sequence aux: per sequence of L tokens, E sum_e count_se / (L K) * seq_prob_se / L.
  double seq_aux = 0;
  if (S > 0) {
    const auto seq_counts = sequence_counts(cfg, idx, T_, E, K);
    for (int64_t q = 0; q < S; ++q) {
      const double L = double(std::min<int64_t>(cfg.seq_len, T_ - q * cfg.seq_len));
      double fp = 0;
      for (int64_t e = 0; e < E; ++e)
        fp += double(seq_counts[size_t(q * E + e)]) / (L * double(K)) *
              (seq_prob[size_t(q * E + e)] / L);
      seq_aux += fp;
    }
    seq_aux *= cfg.seq_aux_loss_coeff * double(E) / double(S);
  }
  losses[0] = T(aux);
  losses[1] = T(z);
  losses[2] = T(seq_aux);
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

  // d seq_aux / d p[t,e] = coeff / sequences * E * count_se / (L K) / L for t in sequence s.
  const int64_t sequences = router_sequences(cfg, T_);
  const auto seq_counts = sequence_counts(cfg, idx, T_, E, K);
  const double scale = cfg.routed_scaling_factor;
  std::vector<double> ds(static_cast<size_t>(E)), dl(static_cast<size_t>(E)),
      l(static_cast<size_t>(E)), d_pt(static_cast<size_t>(E));
  for (int64_t t = 0; t < T_; ++t) {
    const T* s = scores + t * E;
    std::fill(ds.begin(), ds.end(), 0.0);
    // Combine weights w_k = c s_k / sum_j s_j (normalised) or c s_k.
    if (cfg.normalize_topk) {
      double sel_sum = 0, gw = 0;
      for (int64_t k = 0; k < K; ++k) {
        sel_sum += double(s[idx[t * K + k]]);
        gw += double(g[t * K + k]) * double(tw[t * K + k]);
      }
      for (int64_t k = 0; k < K; ++k)
        ds[size_t(idx[t * K + k])] += (scale * double(g[t * K + k]) - gw) / sel_sum;
    } else {
      for (int64_t k = 0; k < K; ++k) ds[size_t(idx[t * K + k])] += scale * double(g[t * K + k]);
    }
    // Aux losses through p.
    if (cfg.aux_loss_coeff != 0 || sequences > 0) {
      d_pt = d_p;
      if (sequences > 0) {
        const int64_t q = t / cfg.seq_len;
        const double L = double(std::min<int64_t>(cfg.seq_len, T_ - q * cfg.seq_len));
        for (int64_t e = 0; e < E; ++e)
          d_pt[size_t(e)] += cfg.seq_aux_loss_coeff / double(sequences) * double(E) *
                             double(seq_counts[size_t(q * E + e)]) / (L * double(K)) / L;
      }
      if (cfg.score_function == ScoreFunction::softmax) {
        for (int64_t e = 0; e < E; ++e) ds[size_t(e)] += d_pt[size_t(e)];
      } else {
        double S = 0, dps = 0;
        for (int64_t e = 0; e < E; ++e) {
          S += double(s[e]);
          dps += d_pt[size_t(e)] * double(s[e]);
        }
        for (int64_t e = 0; e < E; ++e) ds[size_t(e)] += d_pt[size_t(e)] / S - dps / (S * S);
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

MOE_ECHO_CPU_INSTANTIATE(router_forward, RouterForwardArgs);
MOE_ECHO_CPU_INSTANTIATE(router_backward, RouterBackwardArgs);
template void router_bias_update<float>(const Tensor&, const Tensor&, double);
template void router_bias_update<double>(const Tensor&, const Tensor&, double);

}  // namespace moe_echo::cpu
