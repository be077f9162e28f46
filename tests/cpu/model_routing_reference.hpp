// The routing of real models' MoE blocks, in fp64, written from their published definitions and
// not from the library's router, so the router's rules can be checked against them by eye:
//
// - DeepSeek-V3 (technical report, section 2.1.2, and its released gate): s = sigmoid(logits);
//   the selection key is s + bias (the aux-loss-free bias: selection only); experts split into
//   n_group groups, a group scored by the sum of its two largest keys; the token keeps its
//   topk_group best groups and takes the top-k keys among their experts; the weights are the
//   chosen unbiased s, divided by their sum, times routed_scaling_factor.
// - The group max variant (DeepSeek-V2's group-limited greedy selection): a group is scored by
//   its largest key instead.
// - Qwen3-MoE and Mixtral: p = softmax(logits); the top-k p; weights p, renormalised over the k
//   (Mixtral, Qwen3 with norm_topk_prob) or not.
// - The sequence-wise balance loss of DeepSeek-V3 (its equations 17-20): per sequence of L tokens,
//   f_i = E / (K L) * #{t : i in topk_t}, P_i = mean_t s'_{i,t} with s' the scores normalised over
//   experts; L_seq = alpha * sum_i f_i P_i, here averaged over the batch's sequences.
//
// Ties: a key compares larger first, then the lower index (groups and experts alike); a stable
// sort of (key, index) pairs does it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace moe_echo::test::model {

struct Routes {
  std::vector<int32_t> idx;     // [T, K] in descending key order
  std::vector<double> weights;  // [T, K]
};

// Indices 0..n-1 sorted by descending v, ties to the lower index.
inline std::vector<int> argsort_desc(const std::vector<double>& v) {
  std::vector<int> order(v.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return v[size_t(a)] > v[size_t(b)]; });
  return order;
}

enum class GroupRule { top2_sum, max };

// DeepSeek-V3's gate on stored scores `s` [T, E] (sigmoid already applied by the caller, so the
// check uses the same rounded scores as the router) and bias [E].
inline Routes grouped_gate(const std::vector<double>& s, const std::vector<double>& bias, int64_t T,
                           int64_t E, int64_t K, int n_group, int topk_group, GroupRule rule,
                           bool norm_topk_prob, double scaling) {
  Routes r;
  const int64_t per = E / n_group;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> choice(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) choice[size_t(e)] = s[size_t(t * E + e)] + bias[size_t(e)];
    std::vector<double> group_scores(static_cast<size_t>(n_group));
    for (int g = 0; g < n_group; ++g) {
      std::vector<double> in(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::sort(in.begin(), in.end(), [](double a, double b) { return a > b; });
      group_scores[size_t(g)] = rule == GroupRule::top2_sum ? in[0] + in[1] : in[0];
    }
    const std::vector<int> groups = argsort_desc(group_scores);
    std::vector<double> masked(static_cast<size_t>(E), -INFINITY);
    for (int i = 0; i < topk_group; ++i)
      for (int64_t e = groups[size_t(i)] * per; e < (groups[size_t(i)] + 1) * per; ++e)
        masked[size_t(e)] = choice[size_t(e)];
    const std::vector<int> order = argsort_desc(masked);
    double sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += s[size_t(t * E + order[size_t(k)])];
    for (int64_t k = 0; k < K; ++k) {
      const double w = s[size_t(t * E + order[size_t(k)])];
      r.idx.push_back(order[size_t(k)]);
      r.weights.push_back((norm_topk_prob ? w / sum : w) * scaling);
    }
  }
  return r;
}

// Qwen3-MoE / Mixtral: top-k of the softmax probabilities `p` [T, E], renormalised or not.
inline Routes softmax_topk(const std::vector<double>& p, int64_t T, int64_t E, int64_t K,
                           bool renormalize) {
  Routes r;
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<double> row(p.begin() + t * E, p.begin() + (t + 1) * E);
    const std::vector<int> order = argsort_desc(row);
    double sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += row[size_t(order[size_t(k)])];
    for (int64_t k = 0; k < K; ++k) {
      r.idx.push_back(order[size_t(k)]);
      r.weights.push_back(renormalize ? row[size_t(order[size_t(k)])] / sum
                                      : row[size_t(order[size_t(k)])]);
    }
  }
  return r;
}

// The sequence-wise balance loss over sequences of seq_len tokens (the last may be shorter),
// averaged over the sequences; `exact` [T, E] are the unrounded scores.
inline double sequence_balance_loss(const std::vector<double>& exact,
                                    const std::vector<int32_t>& idx, int64_t T, int64_t E,
                                    int64_t K, int64_t seq_len, double alpha) {
  if (T == 0) return 0.0;
  double total = 0;
  int64_t sequences = 0;
  for (int64_t t0 = 0; t0 < T; t0 += seq_len, ++sequences) {
    const int64_t L = std::min(seq_len, T - t0);
    std::vector<double> f(static_cast<size_t>(E), 0.0), P(static_cast<size_t>(E), 0.0);
    for (int64_t t = t0; t < t0 + L; ++t) {
      for (int64_t k = 0; k < K; ++k) f[size_t(idx[size_t(t * K + k)])] += 1.0;
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += exact[size_t(t * E + e)];
      for (int64_t e = 0; e < E; ++e) P[size_t(e)] += exact[size_t(t * E + e)] / sum / double(L);
    }
    double loss = 0;
    for (int64_t e = 0; e < E; ++e) loss += double(E) / double(K * L) * f[size_t(e)] * P[size_t(e)];
    total += alpha * loss;
  }
  return total / double(sequences);
}

}  // namespace moe_echo::test::model
