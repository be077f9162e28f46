// Shared by the GPU layer tests: tokens with clear top-k margins (so routing on the GPU agrees
// exactly with the CPU reference), parameters already rounded to the GPU dtypes, and the checks
// of outputs and step statistics against the CPU layer.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "layer_harness.hpp"

namespace moe_echo::test {

// Host selection keys (score + bias) in double; tokens whose best K + 1 keys (with a group limit:
// whose best topk_groups + 1 group scores, then the best K + 1 keys inside the chosen groups) are
// not separated by more than 1e-6 are redrawn. `hot` >= 0 pulls every token towards that expert.
inline std::vector<double> draw_tokens(int64_t T, const MoeConfig& m, const std::vector<double>& w,
                                       const std::vector<double>& bias, uint64_t seed,
                                       int hot = -1) {
  const int64_t H = m.hidden, E = m.experts, K = m.top_k;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> x(size_t(T * H));
  auto draw_row = [&](int64_t t) {
    for (int64_t h = 0; h < H; ++h) {
      double v = u(rng);
      if (hot >= 0) v = 0.3 * v + (w[size_t(hot * H + h)] > 0 ? 1.0 : -1.0);
      x[size_t(t * H + h)] = round_bf16(v);
    }
  };
  std::vector<double> key(static_cast<size_t>(E)), l(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int attempt = 0;; ++attempt) {
      draw_row(t);
      double mx = -INFINITY;
      for (int64_t e = 0; e < E; ++e) {
        double acc = 0;
        for (int64_t h = 0; h < H; ++h) acc += x[size_t(t * H + h)] * w[size_t(e * H + h)];
        l[size_t(e)] = double(float(acc));
        mx = std::max(mx, l[size_t(e)]);
      }
      double se = 0;
      for (int64_t e = 0; e < E; ++e) se += std::exp(l[size_t(e)] - mx);
      for (int64_t e = 0; e < E; ++e) {
        const double s = m.score_function == ScoreFunction::softmax
                             ? std::exp(l[size_t(e)] - mx) / se
                             : 1.0 / (1.0 + std::exp(-l[size_t(e)]));
        key[size_t(e)] = double(float(s)) + bias[size_t(e)];
      }
      auto clear_best = [](std::vector<double> v, int64_t n) {
        std::sort(v.begin(), v.end(), std::greater<double>());
        bool ok = true;
        for (int64_t k = 0; k < std::min<int64_t>(n, int64_t(v.size()) - 1); ++k)
          ok = ok && v[size_t(k)] - v[size_t(k + 1)] > 1e-6;
        return ok;
      };
      bool clear = true;
      std::vector<double> eligible = key;
      if (m.expert_groups > 1) {
        const int64_t per = E / m.expert_groups;
        std::vector<std::pair<double, int64_t>> group;
        for (int64_t g = 0; g < m.expert_groups; ++g) {
          std::vector<double> in(key.begin() + g * per, key.begin() + (g + 1) * per);
          std::sort(in.begin(), in.end(), std::greater<double>());
          group.push_back({m.group_score == GroupScore::top2_sum ? in[0] + in[1] : in[0], g});
        }
        std::vector<double> scores;
        for (const auto& gs : group) scores.push_back(gs.first);
        clear = clear_best(scores, m.topk_groups);
        std::sort(group.begin(), group.end(), [](auto a, auto b) { return a.first > b.first; });
        eligible.clear();
        for (int i = 0; i < m.topk_groups; ++i)
          for (int64_t e = group[size_t(i)].second * per; e < (group[size_t(i)].second + 1) * per;
               ++e)
            eligible.push_back(key[size_t(e)]);
      }
      clear = clear && clear_best(eligible, K);
      if (clear) break;
      if (attempt > 100) {
        ADD_FAILURE() << "no token with clear top-k margins";
        break;
      }
    }
  }
  return x;
}

inline GlobalParams rounded_params(const MoeConfig& m, uint64_t seed, int hot_bias = -1) {
  const int64_t H = m.hidden, F = m.ffn, E = m.experts;
  GlobalParams p;
  p.router_weight = round_f32(random_values(size_t(E * H), seed, -1, 1));
  for (auto& v : p.router_weight) v = double(float(v / std::sqrt(double(H))));
  p.router_bias = round_f32(random_values(size_t(E), seed + 1, -0.01, 0.01));
  if (hot_bias >= 0) p.router_bias[size_t(hot_bias)] = 2.0;
  p.w1 = round_bf16(random_values(size_t(E * H * 2 * F), seed + 2, -1, 1));
  p.w2 = round_bf16(random_values(size_t(E * F * H), seed + 3, -1, 1));
  for (auto& v : p.w1) v = round_bf16(v / std::sqrt(double(H)));
  for (auto& v : p.w2) v = round_bf16(v / std::sqrt(double(F)));
  const int64_t S = shared_width(m);
  if (S > 0) {
    p.shared_w1 = round_bf16(random_values(size_t(H * 2 * S), seed + 4, -1, 1));
    p.shared_w2 = round_bf16(random_values(size_t(S * H), seed + 5, -1, 1));
    for (auto& v : p.shared_w1) v = round_bf16(v / std::sqrt(double(H)));
    for (auto& v : p.shared_w2) v = round_bf16(v / std::sqrt(double(S)));
  }
  return p;
}

// `got` against the reference `want`: same size, finite, relative error within tol.
inline ::testing::AssertionResult close(const std::vector<double>& got,
                                        const std::vector<double>& want, double tol,
                                        const std::string& what) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << what << ": sizes " << got.size() << " vs " << want.size();
  if (!all_finite(got)) return ::testing::AssertionFailure() << what << ": non-finite GPU values";
  const double err = rel_error(got, want);
  if (err > tol)
    return ::testing::AssertionFailure() << what << ": rel error " << err << " > " << tol;
  return ::testing::AssertionSuccess() << what << ": rel error " << err;
}

// `got` and `want` bit for bit; on a difference, how many values differ, the first and the
// largest difference (a few ulps of reordered sums read differently from a wrong row).
inline ::testing::AssertionResult same_bits(const std::vector<double>& got,
                                            const std::vector<double>& want,
                                            const std::string& what) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << what << ": sizes " << got.size() << " vs " << want.size();
  size_t differ = 0, first = got.size(), worst = 0;
  double max_abs = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i]))) continue;
    if (differ++ == 0) first = i;
    const double d = std::abs(got[i] - want[i]);
    if (!(d <= max_abs)) max_abs = d, worst = i;
  }
  if (differ == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << differ << " of " << got.size() << " values differ; first at " << first
         << " (" << got[first] << " vs " << want[first] << "), largest at " << worst << " ("
         << got[worst] << " vs " << want[worst] << "), rel error " << rel_error(got, want);
}

// Routing statistics must match exactly; losses within 1e-4 relative.
inline void expect_stats_equal(const StepStats& g, const StepStats& c) {
  EXPECT_NEAR(g.aux_loss, c.aux_loss, 1e-4 * std::abs(c.aux_loss) + 1e-9);
  EXPECT_NEAR(g.z_loss, c.z_loss, 1e-4 * std::abs(c.z_loss) + 1e-9);
  EXPECT_NEAR(g.seq_aux_loss, c.seq_aux_loss, 1e-4 * std::abs(c.seq_aux_loss) + 1e-9);
  EXPECT_EQ(g.ranks_per_token_mean, c.ranks_per_token_mean);
  EXPECT_EQ(g.ranks_per_token_max, c.ranks_per_token_max);
  EXPECT_EQ(g.load_before, c.load_before);
  EXPECT_EQ(g.load_after, c.load_after);
  EXPECT_EQ(g.clones, c.clones);
  EXPECT_EQ(g.received_rows, c.received_rows);
  EXPECT_EQ(g.overflow_rows, c.overflow_rows);
  EXPECT_EQ(g.overflow_rows_all, c.overflow_rows_all);
  EXPECT_EQ(g.spill_rounds, c.spill_rounds);
}

}  // namespace moe_echo::test
