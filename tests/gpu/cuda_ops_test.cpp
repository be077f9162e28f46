// Every CUDA backend op (except the grouped GEMMs: grouped_gemm_test.cpp) against the CPU
// reference backend (src/cpu, f32) on the same inputs. Inputs are fresh random values rounded to
// bf16 first (activations) or to f32; outputs are poisoned (NaN, or -77777 for integers) before
// each call. Routes, counts, offsets and layouts must match exactly; floating-point outputs by
// relative norm (gpu_test_util.hpp states the tolerances). Router inputs are drawn so that the
// top-k margins are clear (every gap between consecutive keys among the best K + 1 above 1e-6,
// while f32 logits differ from the reference by ~1e-8), so exact route equality is a fair test.
// Skipped where no GPU is visible.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::test {
namespace {

struct Backends {
  std::unique_ptr<Backend> cpu = make_cpu_backend(DType::f32);
  std::unique_ptr<Backend> gpu = cuda::make_cuda_backend();
};

// The same logical tensor on both backends: activations are f32 on the CPU and bf16 on the GPU.
enum class Kind { act, flt, i32 };
struct Pair {
  OwnedTensor c, g;
  Pair(Backends& b, Kind k, std::initializer_list<int64_t> dims)
      : c(*b.cpu, k == Kind::i32 ? DType::i32 : DType::f32, dims),
        g(*b.gpu, k == Kind::i32 ? DType::i32 : (k == Kind::act ? DType::bf16 : DType::f32), dims) {
  }
  // Writes v (already rounded to what the GPU tensor holds) to both.
  void write(const std::vector<double>& v) const {
    c.write(v);
    g.write(v);
  }
  void poison_both() const {
    poison(c);
    poison(g);
  }
};

std::vector<double> uniform(size_t n, uint64_t seed, double lo = -1, double hi = 1) {
  return random_values(n, seed, lo, hi);
}

// Relative error and NaN guard in one message.
::testing::AssertionResult close(const std::vector<double>& gpu, const std::vector<double>& cpu,
                                 double tol, const char* what) {
  if (gpu.size() != cpu.size())
    return ::testing::AssertionFailure()
           << what << ": sizes " << gpu.size() << " vs " << cpu.size();
  if (!all_finite(gpu)) return ::testing::AssertionFailure() << what << ": non-finite GPU output";
  const double err = rel_error(gpu, cpu);
  if (err > tol)
    return ::testing::AssertionFailure() << what << ": rel error " << err << " > " << tol;
  return ::testing::AssertionSuccess();
}

// =================================================================================================
// Router
// =================================================================================================

struct RouterCase {
  int64_t T, H, E, K;
  ScoreFunction sf;
  bool normalize;
  // Group-limited top-k (1, 1: none), routed scaling, sequence aux loss (0: none).
  int groups = 1, topk_groups = 1;
  GroupScore group_score = GroupScore::top2_sum;
  double scale = 1.0;
  double seq_aux = 0.0;
  int seq_len = 0;
  RouterConfig config(double aux, double z) const {
    RouterConfig r{sf, normalize, aux, z};
    r.expert_groups = groups;
    r.topk_groups = topk_groups;
    r.group_score = group_score;
    r.routed_scaling_factor = scale;
    r.seq_aux_loss_coeff = seq_aux;
    r.seq_len = seq_len;
    return r;
  }
};
std::string router_name(const ::testing::TestParamInfo<RouterCase>& info) {
  const RouterCase& c = info.param;
  std::ostringstream s;
  s << "T" << c.T << "_H" << c.H << "_E" << c.E << "_K" << c.K << "_" << to_string(c.sf)
    << (c.normalize ? "_norm" : "_raw");
  if (c.groups > 1)
    s << "_G" << c.groups << "_top" << c.topk_groups << "_" << to_string(c.group_score);
  if (c.scale != 1.0) s << "_scaled";
  if (c.seq_aux != 0) s << "_seq" << c.seq_len;
  return s.str();
}

struct RouterPairs {
  Pair x, w, bias, logits, scores, idx, weight, counts, losses;
  RouterPairs(Backends& b, int64_t T, int64_t H, int64_t E, int64_t K)
      : x(b, Kind::act, {T, H}),
        w(b, Kind::flt, {E, H}),
        bias(b, Kind::flt, {E}),
        logits(b, Kind::flt, {T, E}),
        scores(b, Kind::flt, {T, E}),
        idx(b, Kind::i32, {T, K}),
        weight(b, Kind::flt, {T, K}),
        counts(b, Kind::i32, {E}),
        losses(b, Kind::flt, {3}) {}
  RouterForwardArgs args(bool gpu, const RouterCase& c, double aux, double z) const {
    auto t = [&](const Pair& p) { return gpu ? *p.g : *p.c; };
    RouterForwardArgs a;
    a.tensors = RouterTensors{t(x), t(w), t(logits), t(scores), t(idx), t(weight), t(counts)};
    a.bias = t(bias);
    a.losses = t(losses);
    a.config = c.config(aux, z);
    return a;
  }
};

// True when the n + 1 largest of v are not all separated by more than `margin` (sorts v).
bool unclear_best(std::vector<double>& v, int64_t n, double margin) {
  std::sort(v.begin(), v.end(), std::greater<double>());
  for (int64_t k = 0; k < std::min<int64_t>(n, int64_t(v.size()) - 1); ++k)
    if (v[size_t(k)] - v[size_t(k + 1)] <= margin) return true;
  return false;
}

// Tokens whose selection is not clear by more than `margin` on the CPU's keys (score + bias):
// with a group limit, the best topk_groups + 1 group scores, then the best K + 1 keys inside the
// chosen groups; without, the best K + 1 keys.
std::vector<int64_t> unclear_tokens(const std::vector<double>& scores,
                                    const std::vector<double>& bias, const RouterCase& c,
                                    double margin) {
  const int64_t T = c.T, E = c.E, K = c.K, per = E / c.groups;
  std::vector<int64_t> bad;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> key(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) key[size_t(e)] = scores[size_t(t * E + e)] + bias[size_t(e)];
    std::vector<double> eligible = key;
    if (c.groups > 1) {
      std::vector<std::pair<double, int>> group;
      for (int g = 0; g < c.groups; ++g) {
        std::vector<double> in(key.begin() + g * per, key.begin() + (g + 1) * per);
        std::sort(in.begin(), in.end(), std::greater<double>());
        group.push_back({c.group_score == GroupScore::top2_sum ? in[0] + in[1] : in[0], g});
      }
      std::vector<double> group_scores;
      for (const auto& gs : group) group_scores.push_back(gs.first);
      if (unclear_best(group_scores, c.topk_groups, margin)) {
        bad.push_back(t);
        continue;
      }
      std::sort(group.begin(), group.end(), [](auto a, auto b) { return a.first > b.first; });
      eligible.clear();
      for (int i = 0; i < c.topk_groups; ++i)
        for (int64_t e = group[size_t(i)].second * per; e < (group[size_t(i)].second + 1) * per;
             ++e)
          eligible.push_back(key[size_t(e)]);
    }
    if (unclear_best(eligible, K, margin)) bad.push_back(t);
  }
  return bad;
}

// Draws x (bf16 values) so that every token's top-k is clear on the CPU reference; runs the CPU
// forward on it. Returns x.
std::vector<double> draw_clear_tokens(Backends& b, RouterPairs& rt, const RouterCase& c,
                                      const std::vector<double>& bias, uint64_t seed) {
  std::vector<double> x = round_bf16(uniform(size_t(c.T * c.H), seed));
  std::mt19937_64 rng(seed ^ 0x9e37);
  for (int attempt = 0;; ++attempt) {
    rt.x.c.write(x);
    b.cpu->router_forward(rt.args(false, c, 0.01, 0.001), nullptr);
    const auto bad = unclear_tokens(rt.scores.c.read(), bias, c, 1e-6);
    if (bad.empty()) return x;
    EXPECT_LT(attempt, 50) << "could not draw tokens with clear top-k margins";
    if (attempt >= 50) return x;
    std::uniform_real_distribution<double> u(-1, 1);
    for (int64_t t : bad)
      for (int64_t h = 0; h < c.H; ++h) x[size_t(t * c.H + h)] = round_bf16(u(rng));
  }
}

class RouterTest : public ::testing::TestWithParam<RouterCase> {};

TEST_P(RouterTest, ForwardAndBackwardMatchCpu) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  const RouterCase c = GetParam();
  Backends b;
  RouterPairs rt(b, c.T, c.H, c.E, c.K);
  const uint64_t seed = uint64_t(c.T * 131 + c.H * 17 + c.E * 7 + c.K) + (c.normalize ? 1 : 0);
  const auto w = round_f32(uniform(size_t(c.E * c.H), seed + 1, -0.5, 0.5));
  const auto bias = round_f32(uniform(size_t(c.E), seed + 2, -0.05, 0.05));
  rt.w.write(w);
  rt.bias.write(bias);
  const double aux = 0.01, z = 0.001;
  const auto x = draw_clear_tokens(b, rt, c, bias, seed + 3);
  rt.x.g.write(x);
  for (Pair* p : {&rt.logits, &rt.scores, &rt.idx, &rt.weight, &rt.counts, &rt.losses})
    p->g.fill(p == &rt.idx || p == &rt.counts ? kPoisonInt : std::nan(""));
  b.gpu->router_forward(rt.args(true, c, aux, z), nullptr);

  EXPECT_EQ(rt.idx.g.read(), rt.idx.c.read()) << "top-k experts";
  EXPECT_EQ(rt.counts.g.read(), rt.counts.c.read()) << "counts";
  EXPECT_TRUE(close(rt.logits.g.read(), rt.logits.c.read(), kF32Tol, "logits"));
  EXPECT_TRUE(close(rt.scores.g.read(), rt.scores.c.read(), kF32Tol, "scores"));
  EXPECT_TRUE(close(rt.weight.g.read(), rt.weight.c.read(), kF32Tol, "topk_weight"));
  const auto lg = rt.losses.g.read(), lc = rt.losses.c.read();
  EXPECT_NEAR(lg[0], lc[0], 1e-5 * std::abs(lc[0]) + 1e-9) << "aux loss";
  EXPECT_NEAR(lg[1], lc[1], 1e-5 * std::abs(lc[1]) + 1e-9) << "z loss";
  EXPECT_NEAR(lg[2], lc[2], 1e-5 * std::abs(lc[2]) + 1e-9) << "sequence aux loss";
  if (c.seq_aux != 0 && c.T > 0) {
    EXPECT_GT(lc[2], 0.0);
  }
  if (c.T == 0) {
    EXPECT_EQ(lg, (std::vector<double>{0, 0, 0}));
  }

  // Backward: += into random dW and dx.
  Pair g(b, Kind::flt, {c.T, c.K}), dw(b, Kind::flt, {c.E, c.H}), dx(b, Kind::act, {c.T, c.H});
  g.write(round_f32(uniform(size_t(c.T * c.K), seed + 4)));
  const auto dw0 = round_f32(uniform(size_t(c.E * c.H), seed + 5));
  dw.write(dw0);
  dx.write(round_bf16(uniform(size_t(c.T * c.H), seed + 6)));
  for (bool gpu : {false, true}) {
    const RouterForwardArgs f = rt.args(gpu, c, aux, z);
    RouterBackwardArgs a;
    a.tensors = f.tensors;
    a.d_topk_weight = gpu ? *g.g : *g.c;
    a.d_weight = gpu ? *dw.g : *dw.c;
    a.dx = gpu ? *dx.g : *dx.c;
    a.config = f.config;
    (gpu ? b.gpu : b.cpu)->router_backward(a, nullptr);
  }
  EXPECT_TRUE(close(dw.g.read(), dw.c.read(), 10 * kF32Tol, "d_weight"));
  EXPECT_TRUE(close(dx.g.read(), dx.c.read(), kBf16Tol, "dx"));
  // The increment alone (the random start would hide a wrong small one). Its terms cancel (dl
  // changes sign over the tokens), so f32 accumulation errors, relative to the sum, grow beyond
  // f32's epsilon: 1.8e-4 was measured at T 512, E 256 (sigmoid); a product that lost a part of
  // its f32 operand (2^-8 relative) would be off by about 4e-3.
  auto minus_start = [&](std::vector<double> v) {
    for (size_t i = 0; i < v.size(); ++i) v[i] -= dw0[i];
    return v;
  };
  if (c.T > 0) {
    EXPECT_TRUE(
        close(minus_start(dw.g.read()), minus_start(dw.c.read()), 1e-3, "d_weight increment"));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RouterTest,
    ::testing::Values(
        RouterCase{0, 64, 8, 2, ScoreFunction::softmax, true},
        RouterCase{1, 64, 8, 2, ScoreFunction::softmax, true},
        RouterCase{1, 37, 5, 5, ScoreFunction::sigmoid, false},
        RouterCase{255, 64, 16, 4, ScoreFunction::softmax, true},
        RouterCase{256, 96, 64, 8, ScoreFunction::sigmoid, true},
        RouterCase{257, 37, 33, 1, ScoreFunction::softmax, false},
        RouterCase{257, 128, 128, 8, ScoreFunction::softmax, true},
        RouterCase{1000, 256, 40, 6, ScoreFunction::sigmoid, false},
        // Tensor-core products (E >= 32; T, E, H multiples of 8).
        RouterCase{256, 64, 32, 4, ScoreFunction::softmax, true},
        RouterCase{512, 512, 256, 8, ScoreFunction::sigmoid, true},
        RouterCase{1024, 2048, 128, 8, ScoreFunction::softmax, true},
        // The dW product in 8 row groups of unequal sizes (2056 rows).
        RouterCase{2056, 256, 64, 8, ScoreFunction::sigmoid, true},
        // Group-limited top-k, routed scaling and the sequence aux loss: DeepSeek-V3's
        // gate (8 groups, top 4, sum of the top 2, x 2.5) in the register kernels,
        // the group max, odd sizes, and E > 256 (the kernels that read memory).
        RouterCase{512, 512, 256, 8, ScoreFunction::sigmoid, true, 8, 4, GroupScore::top2_sum, 2.5,
                   0.003, 128},
        RouterCase{1000, 256, 40, 6, ScoreFunction::sigmoid, false, 5, 2, GroupScore::max, 1.7,
                   0.01, 100},
        RouterCase{257, 128, 128, 8, ScoreFunction::softmax, true, 4, 2, GroupScore::max, 1.0, 0.01,
                   50},
        RouterCase{255, 64, 16, 4, ScoreFunction::sigmoid, true, 1, 1, GroupScore::top2_sum, 2.5,
                   0.02, 1},
        RouterCase{1, 64, 16, 4, ScoreFunction::sigmoid, true, 4, 2, GroupScore::top2_sum, 2.5, 0.1,
                   4},
        RouterCase{300, 64, 320, 8, ScoreFunction::sigmoid, true, 8, 3, GroupScore::top2_sum, 2.5,
                   0.01, 64},
        RouterCase{300, 64, 320, 6, ScoreFunction::softmax, false, 32, 6, GroupScore::max, 2.0, 0.0,
                   0}),
    router_name);

// Tied groups go to the lower group and tied experts to the lower expert, on the GPU as on the
// CPU: identical weight rows make every score equal bit for bit, so the bias orders the keys, and
// groups 1 and 3 have the same (best) biases.
TEST(Router, TiedGroupsGoToTheLowerIndex) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  Backends b;
  for (int64_t E : {16, 320})  // register and memory kernels
    for (GroupScore rule : {GroupScore::top2_sum, GroupScore::max})
      for (int topk_groups : {1, 2}) {
        SCOPED_TRACE("E " + std::to_string(E) + " " + to_string(rule) + " top " +
                     std::to_string(topk_groups));
        const int64_t per = E / 4;
        RouterCase c{37, 32, E, 3, ScoreFunction::sigmoid, true, 4, topk_groups, rule, 2.5};
        RouterPairs rt(b, c.T, c.H, c.E, c.K);
        const auto row = round_f32(uniform(size_t(c.H), 21, -0.5, 0.5));
        std::vector<double> w;
        for (int64_t e = 0; e < E; ++e) w.insert(w.end(), row.begin(), row.end());
        std::vector<double> bias(size_t(E), -1.0);
        for (int64_t g : {1, 3}) {
          bias[size_t(g * per + 0)] = 0.5;
          bias[size_t(g * per + 1)] = 0.25;
          bias[size_t(g * per + 2)] = 0.5;
          bias[size_t(g * per + 3)] = 0.0;
        }
        rt.w.write(w);
        rt.bias.write(bias);
        rt.x.write(round_bf16(uniform(size_t(c.T * c.H), 22)));
        poison(rt.idx.c);
        poison(rt.idx.g);
        b.cpu->router_forward(rt.args(false, c, 0.0, 0.0), nullptr);
        b.gpu->router_forward(rt.args(true, c, 0.0, 0.0), nullptr);
        const auto idx = to_i32(rt.idx.g.read());
        EXPECT_EQ(idx, to_i32(rt.idx.c.read()));
        const std::vector<int32_t> want =
            topk_groups == 1
                ? std::vector<int32_t>{int32_t(per), int32_t(per + 2), int32_t(per + 1)}
                : std::vector<int32_t>{int32_t(per), int32_t(per + 2), int32_t(3 * per)};
        for (int64_t t = 0; t < c.T; ++t)
          EXPECT_EQ(std::vector<int32_t>(idx.begin() + t * c.K, idx.begin() + (t + 1) * c.K), want)
              << "token " << t;
      }
}

TEST(Router, TiesGoToTheLowerIndexAndOneExpertCanTakeEveryToken) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  Backends b;
  const RouterCase c{257, 32, 8, 3, ScoreFunction::softmax, true};
  RouterPairs rt(b, c.T, c.H, c.E, c.K);
  // Experts 2 and 5 have identical weights (equal logits and scores on both backends, bit for
  // bit), and a large bias sends every token to expert 6 first.
  auto w = round_f32(uniform(size_t(c.E * c.H), 11, -0.5, 0.5));
  for (int64_t h = 0; h < c.H; ++h) w[size_t(5 * c.H + h)] = w[size_t(2 * c.H + h)];
  std::vector<double> bias(size_t(c.E), 0.0);
  bias[6] = 4.0;
  rt.w.write(w);
  rt.bias.write(bias);
  const auto x = round_bf16(uniform(size_t(c.T * c.H), 12));
  rt.x.write(x);
  b.cpu->router_forward(rt.args(false, c, 0.01, 0.0), nullptr);
  poison(rt.idx.g);
  b.gpu->router_forward(rt.args(true, c, 0.01, 0.0), nullptr);
  const auto idx = to_i32(rt.idx.g.read());
  EXPECT_EQ(idx, to_i32(rt.idx.c.read()));
  int64_t both = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    EXPECT_EQ(idx[size_t(t * c.K)], 6);
    // Expert 5 ties with expert 2, so it can only come right after it.
    for (int64_t k = 0; k < c.K; ++k)
      if (idx[size_t(t * c.K + k)] == 5) {
        ASSERT_GT(k, 0) << "token " << t;
        EXPECT_EQ(idx[size_t(t * c.K + k - 1)], 2) << "token " << t;
        ++both;
      }
  }
  EXPECT_GT(both, 0) << "no token chose both tied experts";
  EXPECT_EQ(to_i32(rt.counts.g.read())[6], c.T);
}

TEST(Router, BiasUpdateIsBitIdentical) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  Backends b;
  for (auto [R, E] : {std::pair{1, 8}, {4, 16}, {3, 300}}) {
    Pair C(b, Kind::i32, {R, E}), bias(b, Kind::flt, {E});
    std::mt19937_64 rng(uint64_t(R * E));
    std::vector<double> counts(size_t(R * E));
    for (auto& v : counts) v = double(rng() % 50);
    counts[0] = 0;
    C.write(counts);
    bias.write(round_f32(uniform(size_t(E), uint64_t(E), -0.1, 0.1)));
    b.cpu->router_bias_update(*C.c, *bias.c, 1e-3, nullptr);
    b.gpu->router_bias_update(*C.g, *bias.g, 1e-3, nullptr);
    EXPECT_EQ(bias.g.read(), bias.c.read()) << "R " << R << " E " << E;
  }
}

// =================================================================================================
// Layout (against the CPU layout, exactly, for every rank of random and skewed routing maps)
// =================================================================================================

std::vector<int32_t> random_routes(int64_t T, int K, int E, bool hot, std::mt19937_64& rng) {
  std::vector<int32_t> idx(size_t(T) * size_t(K));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    if (hot) std::iter_swap(perm.begin(), std::find(perm.begin(), perm.end(), 0));
    for (int k = 0; k < K; ++k) idx[size_t(t * K + k)] = perm[size_t(k)];
  }
  return idx;
}

struct LayoutCase {
  int R, EPR, K, S, max_clones;
  bool echo;
  int row_block = 1;  // PlannerConfig::row_block: whole blocks in order (FP8 weight gradients)
};

class LayoutTest : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(LayoutTest, MatchesCpuExactly) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  const LayoutCase lc = GetParam();
  Backends b;
  const int R = lc.R, E = lc.R * lc.EPR, K = lc.K;
  PlannerConfig cfg;
  cfg.ranks = R;
  cfg.experts = E;
  cfg.spare_slots = lc.S;
  cfg.max_clones = lc.max_clones;
  cfg.row_block = lc.row_block;
  const int slots = lc.EPR + lc.S, M = cfg.max_replicas();
  uint64_t seed = uint64_t(R * 1000 + E * 10 + K);
  for (int64_t T :
       {int64_t(0), int64_t(1), int64_t(255), int64_t(256), int64_t(257), int64_t(3000)})
    for (bool hot : {false, true})
      for (double cf : {1.25, 0.3}) {
        SCOPED_TRACE("T " + std::to_string(T) + (hot ? " hot" : " uniform") + " cf " +
                     std::to_string(cf));
        std::mt19937_64 rng(++seed);
        std::vector<std::vector<int32_t>> routes(static_cast<size_t>(R));
        std::vector<double> C(size_t(R * E), 0.0);
        for (int src = 0; src < R; ++src) {
          const int64_t Ts = src == 0 ? T : int64_t(rng() % size_t(T + 1));
          routes[size_t(src)] = random_routes(Ts, K, E, hot, rng);
          for (int32_t e : routes[size_t(src)]) C[size_t(src * E + e)] += 1;
        }
        std::vector<int32_t> Ci(C.begin(), C.end());
        Plan plan(cfg);
        if (lc.echo)
          plan_echo(Ci.data(), cfg, plan.view());
        else
          plan_none(Ci.data(), cfg, plan.view());
        const int64_t capacity = std::max<int64_t>(1, int64_t(std::ceil(cf * double(T) * K)));
        const int64_t total = std::accumulate(C.begin(), C.end(), int64_t(0));
        const int rounds = int(std::max<int64_t>(1, (total + capacity - 1) / capacity));
        Pair map(b, Kind::i32, {R, E}), plan_t(b, Kind::i32, {plan_ints(cfg)});
        map.write(C);
        plan_t.write(std::vector<double>(plan.storage.begin(), plan.storage.end()));
        for (int me = 0; me < R; ++me) {
          SCOPED_TRACE("rank " + std::to_string(me));
          const int64_t n = int64_t(routes[size_t(me)].size());
          Pair idx(b, Kind::i32, {n / K, K}), assign(b, Kind::i32, {R * E * M}),
              dest_rank(b, Kind::i32, {n}), dest_row(b, Kind::i32, {n}),
              offsets(b, Kind::i32, {slots + 1}), rank_rows(b, Kind::i32, {R}),
              active(b, Kind::i32, {rounds});
          idx.write(std::vector<double>(routes[size_t(me)].begin(), routes[size_t(me)].end()));
          for (const Pair* p : {&assign, &dest_rank, &dest_row, &offsets, &rank_rows, &active})
            p->poison_both();
          for (bool gpu : {false, true}) {
            auto t = [&](const Pair& p) { return gpu ? *p.g : *p.c; };
            LayoutArgs a;
            a.routing_map = t(map);
            a.plan = t(plan_t);
            a.topk_idx = t(idx);
            a.assign = t(assign);
            a.dest_rank = t(dest_rank);
            a.dest_row = t(dest_row);
            a.group_offsets = t(offsets);
            a.rank_rows = t(rank_rows);
            a.round_active = t(active);
            a.planner = cfg;
            a.rank = me;
            a.slots = slots;
            a.capacity = capacity;
            (gpu ? b.gpu : b.cpu)->layout(a, nullptr);
          }
          EXPECT_EQ(dest_rank.g.read(), dest_rank.c.read());
          EXPECT_EQ(dest_row.g.read(), dest_row.c.read());
          EXPECT_EQ(offsets.g.read(), offsets.c.read());
          EXPECT_EQ(rank_rows.g.read(), rank_rows.c.read());
          EXPECT_EQ(active.g.read(), active.c.read());
          EXPECT_EQ(assign.g.read(), assign.c.read());
          if (HasFailure()) return;
        }
      }
}

std::string layout_name(const ::testing::TestParamInfo<LayoutCase>& p) {
  const LayoutCase& c = p.param;
  std::ostringstream s;
  s << "R" << c.R << "_EPR" << c.EPR << "_K" << c.K << "_S" << c.S << "_C" << c.max_clones
    << (c.echo ? "_echo" : "_none");
  if (c.row_block > 1) s << "_B" << c.row_block;
  return s.str();
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, LayoutTest,
    ::testing::Values(LayoutCase{1, 8, 2, 1, 2, true}, LayoutCase{1, 1, 1, 0, 0, false},
                      LayoutCase{1, 64, 8, 0, 0, false}, LayoutCase{2, 4, 2, 1, 1, true},
                      LayoutCase{4, 2, 3, 2, 2, true}, LayoutCase{4, 8, 4, 1, 3, true},
                      LayoutCase{8, 32, 8, 2, 2, true}, LayoutCase{3, 5, 2, 0, 0, false},
                      LayoutCase{4, 8, 4, 1, 3, true, 128}, LayoutCase{8, 32, 8, 2, 2, true, 16}),
    layout_name);

// =================================================================================================
// SwiGLU (valid prefix only; rows beyond keep their poison)
// =================================================================================================

struct WindowCase {
  std::vector<double> offsets;  // [groups + 1]
  int64_t row_lo, rows, F;
};

class SwigluTest : public ::testing::TestWithParam<WindowCase> {};

TEST_P(SwigluTest, ForwardAndBackwardOnValidRowsOnly) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  const WindowCase w = GetParam();
  Backends b;
  const int64_t rows = w.rows, F = w.F;
  const int groups = int(w.offsets.size()) - 1;
  const int64_t valid = std::clamp<int64_t>(int64_t(w.offsets.back()) - w.row_lo, 0, rows);
  Pair off(b, Kind::i32, {groups + 1}), h(b, Kind::act, {rows, 2 * F}), a(b, Kind::act, {rows, F}),
      da(b, Kind::act, {rows, F}), dh(b, Kind::act, {rows, 2 * F});
  off.write(w.offsets);
  h.write(round_bf16(uniform(size_t(rows * 2 * F), uint64_t(rows + F), -3, 3)));
  da.write(round_bf16(uniform(size_t(rows * F), uint64_t(rows + F + 1))));
  a.poison_both();
  dh.poison_both();
  for (bool gpu : {false, true}) {
    auto t = [&](const Pair& p) { return gpu ? *p.g : *p.c; };
    const GroupWindow gw{{w.row_lo, rows}, t(off).as<int32_t>(), groups};
    Backend& be = gpu ? *b.gpu : *b.cpu;
    be.swiglu_forward({gw, t(h), t(a), Tensor(), Tensor()}, nullptr);
    be.swiglu_backward({gw, t(h), t(a), t(da), t(dh)}, nullptr);
  }
  for (auto [p, width] : {std::pair{&a, F}, {&dh, 2 * F}}) {
    const auto g = p->g.read(), c = p->c.read();
    const std::vector<double> gv(g.begin(), g.begin() + valid * width),
        cv(c.begin(), c.begin() + valid * width);
    EXPECT_TRUE(close(gv, cv, kBf16Tol, p == &a ? "a" : "dh"));
    for (int64_t i = valid * width; i < rows * width; ++i)
      ASSERT_TRUE(std::isnan(g[size_t(i)])) << "row " << i / width << " beyond the valid prefix";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Windows, SwigluTest,
    ::testing::Values(WindowCase{{0, 0, 0}, 0, 16, 8},             // nothing valid
                      WindowCase{{0, 0}, 0, 0, 8},                 // an empty window
                      WindowCase{{0, 1}, 0, 1, 37},                // one row, odd F
                      WindowCase{{0, 100, 100, 255}, 0, 256, 64},  // an empty group, 255 of 256
                      WindowCase{{0, 256}, 0, 256, 24},            // full
                      WindowCase{{0, 200, 257}, 0, 257, 40},       // full, 257
                      WindowCase{{0, 300, 700}, 256, 256, 16},     // second round, full
                      WindowCase{{0, 300, 600}, 512, 256, 16},     // third round, 88 valid
                      WindowCase{{0, 300, 500}, 512, 256, 16}));   // third round, none valid

// =================================================================================================
// Fan out and fan in (random fan tables; only valid rows are read, only member or lead rows are
// written)
// =================================================================================================

struct FanCase {
  int64_t rows, row_lo, valid, K, H;
};

std::string fan_name(const ::testing::TestParamInfo<FanCase>& info) {
  const FanCase& c = info.param;
  std::ostringstream s;
  s << "rows" << c.rows << "_lo" << c.row_lo << "_valid" << c.valid << "_K" << c.K << "_H" << c.H;
  return s.str();
}

// A fan table over the window's rows: the valid rows, shuffled, are cut into tokens of 1 to K
// members; a token's first member is its lead. Rows past the valid prefix hold a stale table
// that looks like leads whose members are valid rows (what an earlier round may leave behind),
// which no op may follow.
struct RandomFanTable {
  std::vector<double> members, weights;
  std::vector<int64_t> leads;
  std::vector<bool> is_lead;
};

RandomFanTable random_fan_table(const FanCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  RandomFanTable f;
  f.members.assign(size_t(c.rows * c.K), 0.0);
  f.weights = round_f32(uniform(size_t(c.rows * c.K), seed + 1, 0.05, 1.0));
  f.is_lead.assign(size_t(c.rows), false);
  std::vector<int64_t> perm(static_cast<size_t>(c.valid));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  // Stale entries first: every row of the table holds something (the ops must not read it).
  for (int64_t q = 0; q < c.rows; ++q)
    for (int64_t m = 0; m < c.K; ++m)
      f.members[size_t(q * c.K + m)] =
          m == 0 ? double(q) : (c.valid > 0 ? double(int64_t(rng() % uint64_t(c.valid))) : -1.0);
  for (size_t at = 0; at < perm.size();) {
    const size_t n = std::min(perm.size() - at, size_t(1 + rng() % uint64_t(c.K)));
    const int64_t p = perm[at];
    f.leads.push_back(p);
    f.is_lead[size_t(p)] = true;
    for (int64_t m = 0; m < c.K; ++m)
      f.members[size_t(p * c.K + m)] = size_t(m) < n ? double(perm[at + size_t(m)]) : -1.0;
    for (size_t m = 1; m < n; ++m) f.members[size_t(perm[at + m] * c.K)] = -1.0;
    at += n;
  }
  return f;
}

class FanTest : public ::testing::TestWithParam<FanCase> {};

TEST_P(FanTest, OutAndInMatchCpu) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  const FanCase c = GetParam();
  Backends b;
  const int64_t rows = c.rows, K = c.K, H = c.H, valid = c.valid;
  const uint64_t seed = uint64_t(rows * 131 + c.row_lo * 7 + K * 3 + H);
  const RandomFanTable table = random_fan_table(c, seed);
  // Three groups; the valid prefix of the window is offsets[3] - row_lo.
  const double end = double(c.row_lo + valid);
  Pair off(b, Kind::i32, {4}), members(b, Kind::i32, {rows, K}), weights(b, Kind::flt, {rows, K});
  off.write({0, std::floor(end / 3), std::floor(2 * end / 3), end});
  members.write(table.members);
  weights.write(table.weights);
  auto window = [&](bool gpu) {
    return GroupWindow{{c.row_lo, rows}, (gpu ? *off.g : *off.c).as<int32_t>(), 3};
  };
  // Poison NaN for rows an op must write, random values where it must read or leave alone.
  const double nan = std::nan("");
  const auto random_rows = [&](uint64_t s) { return round_bf16(uniform(size_t(rows * H), s)); };
  auto rows_where = [&](std::vector<double> v, auto&& keep) {
    for (int64_t r = 0; r < rows; ++r)
      if (!keep(r))
        for (int64_t h = 0; h < H; ++h) v[size_t(r * H + h)] = nan;
    return v;
  };
  auto slice = [&](const std::vector<double>& v, auto&& take) {
    std::vector<double> out;
    for (int64_t r = 0; r < rows; ++r)
      if (take(r)) out.insert(out.end(), v.begin() + r * H, v.begin() + (r + 1) * H);
    return out;
  };
  auto lead_or_past = [&](int64_t r) { return r >= valid || table.is_lead[size_t(r)]; };
  auto is_valid = [&](int64_t r) { return r < valid; };
  auto past = [&](int64_t r) { return r >= valid; };
  auto is_lead = [&](int64_t r) { return r < valid && table.is_lead[size_t(r)]; };
  // Rows past the valid prefix keep what they held, bit for bit.
  auto expect_past_untouched = [&](const std::vector<double>& got,
                                   const std::vector<double>& before, const char* what) {
    const auto g = slice(got, past), w = slice(before, past);
    for (size_t i = 0; i < g.size(); ++i)
      if (!(g[i] == w[i] || (std::isnan(g[i]) && std::isnan(w[i])))) {
        ADD_FAILURE() << what << ": row " << valid + int64_t(i) / H
                      << " past the valid prefix written";
        return;
      }
  };

  // 1. The unweighted copy in place (dispatch's lead rows to their members): bit-exact.
  {
    SCOPED_TRACE("copy in place");
    Pair x(b, Kind::act, {rows, H});
    const auto xv = rows_where(random_rows(seed + 2), lead_or_past);
    x.write(xv);
    for (bool gpu : {false, true}) {
      FanArgs a;
      a.window = window(gpu);
      a.members = gpu ? *members.g : *members.c;
      a.src = a.dst = gpu ? *x.g : *x.c;
      (gpu ? b.gpu : b.cpu)->fan_out(a, nullptr);
    }
    const auto g = x.g.read();
    EXPECT_EQ(slice(g, is_valid), slice(x.c.read(), is_valid));
    EXPECT_TRUE(all_finite(slice(g, is_valid))) << "a valid row was not written";
    expect_past_untouched(g, xv, "x");
  }
  // 2. fan_out weighted, with and without d_weight, in place (dst == other) and apart.
  for (int variant = 0; variant < 4; ++variant) {
    const bool weighted = variant != 3, grad = variant >= 1, in_place = variant == 2;
    SCOPED_TRACE("fan_out variant " + std::to_string(variant));
    Pair src(b, Kind::act, {rows, H}), other(b, Kind::act, {rows, H}), dst(b, Kind::act, {rows, H}),
        dw(b, Kind::flt, {rows});
    src.write(rows_where(random_rows(seed + 3 + uint64_t(variant)), lead_or_past));
    const auto ov = random_rows(seed + 7 + uint64_t(variant));
    other.write(ov);
    dst.poison_both();
    dw.poison_both();
    for (bool gpu : {false, true}) {
      auto t = [&](const Pair& p) { return gpu ? *p.g : *p.c; };
      FanArgs a;
      a.window = window(gpu);
      a.members = t(members);
      if (weighted) a.weights = t(weights);
      a.src = t(src);
      a.dst = in_place ? t(other) : t(dst);
      if (grad) {
        a.other = t(other);
        a.d_weight = t(dw);
      }
      (gpu ? b.gpu : b.cpu)->fan_out(a, nullptr);
    }
    const Pair& out = in_place ? other : dst;
    const auto g = out.g.read();
    EXPECT_TRUE(close(slice(g, is_valid), slice(out.c.read(), is_valid), kBf16Tol, "dst"));
    expect_past_untouched(g, in_place ? ov : std::vector<double>(size_t(rows * H), nan), "dst");
    if (grad) {
      const auto dg = dw.g.read(), dc = dw.c.read();
      EXPECT_TRUE(close(std::vector<double>(dg.begin(), dg.begin() + valid),
                        std::vector<double>(dc.begin(), dc.begin() + valid), kF32Tol, "d_weight"));
      for (int64_t r = valid; r < rows; ++r)
        ASSERT_TRUE(std::isnan(dg[size_t(r)]))
            << "d_weight of row " << r << " past the valid prefix";
    }
  }
  // 3. fan_in, weighted and not: lead rows written, every other row keeps its poison.
  for (bool weighted : {true, false}) {
    SCOPED_TRACE(weighted ? "fan_in weighted" : "fan_in unweighted");
    Pair src(b, Kind::act, {rows, H}), dst(b, Kind::act, {rows, H});
    src.write(rows_where(random_rows(seed + 11 + (weighted ? 1 : 0)), is_valid));
    dst.poison_both();
    for (bool gpu : {false, true}) {
      auto t = [&](const Pair& p) { return gpu ? *p.g : *p.c; };
      FanArgs a;
      a.window = window(gpu);
      a.members = t(members);
      if (weighted) a.weights = t(weights);
      a.src = t(src);
      a.dst = t(dst);
      (gpu ? b.gpu : b.cpu)->fan_in(a, nullptr);
    }
    const auto g = dst.g.read();
    EXPECT_TRUE(close(slice(g, is_lead), slice(dst.c.read(), is_lead), kBf16Tol, "dst"));
    for (int64_t r = 0; r < rows; ++r) {
      if (is_lead(r)) continue;
      for (int64_t h = 0; h < H; ++h)
        ASSERT_TRUE(std::isnan(g[size_t(r * H + h)])) << "fan_in wrote row " << r << ", not a lead";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Tables, FanTest,
                         ::testing::Values(FanCase{16, 0, 0, 4, 64},       // nothing valid
                                           FanCase{0, 0, 0, 2, 64},        // an empty window
                                           FanCase{1, 0, 1, 1, 8},         // one row
                                           FanCase{1, 0, 1, 8, 37},        // one row, odd H
                                           FanCase{256, 0, 255, 8, 64},    // 255 of 256
                                           FanCase{256, 0, 256, 2, 2048},  // full
                                           FanCase{257, 0, 257, 3, 40},    // full, 257
                                           FanCase{300, 256, 44, 32, 24},  // second round, K 32
                                           FanCase{257, 514, 200, 5, 12},  // third round, odd H
                                           FanCase{400, 0, 380, 8, 7168}),
                         fan_name);

// =================================================================================================
// AdamW
// =================================================================================================

TEST(AdamW, TwoStepsMatchCpuForF32AndBf16Parameters) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  Backends b;
  for (Kind kind : {Kind::flt, Kind::act})
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(257), int64_t(100000)})
      for (double wd : {0.0, 0.1}) {
        SCOPED_TRACE(std::string(kind == Kind::act ? "bf16" : "f32") + " n " + std::to_string(n) +
                     " wd " + std::to_string(wd));
        Pair p(b, kind, {n}), g(b, Kind::flt, {n}), m(b, Kind::flt, {n}), v(b, Kind::flt, {n});
        auto pv = uniform(size_t(n), uint64_t(n) + 1);
        p.write(kind == Kind::act ? round_bf16(pv) : round_f32(pv));
        m.write(round_f32(uniform(size_t(n), uint64_t(n) + 2, -0.1, 0.1)));
        v.write(round_f32(uniform(size_t(n), uint64_t(n) + 3, 0.001, 0.01)));
        for (int64_t step = 1; step <= 2; ++step) {
          g.write(round_f32(uniform(size_t(n), uint64_t(n) + 10 + uint64_t(step))));
          for (bool gpu : {false, true}) {
            auto t = [&](const Pair& x) { return gpu ? *x.g : *x.c; };
            Backend& be = gpu ? *b.gpu : *b.cpu;
            Tensor step_t(be.allocate(sizeof(int32_t)), DType::i32, {1});
            write_tensor(be, step_t, {double(step)});
            AdamWArgs a{t(p), t(g), t(m), t(v), step_t, 1e-2, 0.9, 0.95, 1e-8, wd};
            be.adamw(a, nullptr);
            be.synchronize();
            be.deallocate(step_t.data);
          }
          // bf16 parameters round the update once more (see adamw.cu); m and v are f32.
          EXPECT_TRUE(close(p.g.read(), p.c.read(), kind == Kind::act ? kBf16Tol : 1e-6, "param"));
          EXPECT_TRUE(close(m.g.read(), m.c.read(), 1e-6, "m"));
          EXPECT_TRUE(close(v.g.read(), v.c.read(), 1e-6, "v"));
          // The next step starts both from what the GPU holds.
          for (const Pair* x : {&p, &m, &v}) x->c.write(x->g.read());
        }
      }
}

// A bf16 parameter with an f32 master: the master follows the CPU's f32 AdamW (on an f32 master)
// and the parameter is exactly the master rounded to bf16, even when updates are far below a bf16
// ulp (lr 1e-5: without the master they would be rounded away).
TEST(AdamW, Bf16ParameterWithF32MasterIsTheMastersRounding) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  Backends b;
  for (double lr : {1e-2, 1e-5}) {
    SCOPED_TRACE("lr " + std::to_string(lr));
    const int64_t n = 4099;
    Pair p(b, Kind::act, {n}), master(b, Kind::flt, {n}), g(b, Kind::flt, {n}),
        m(b, Kind::flt, {n}), v(b, Kind::flt, {n});
    const auto w0 = round_bf16(uniform(size_t(n), 31));
    p.write(w0);
    master.write(w0);
    m.write(std::vector<double>(size_t(n), 0.0));
    v.write(std::vector<double>(size_t(n), 0.0));
    for (int64_t step = 1; step <= 3; ++step) {
      g.write(round_f32(uniform(size_t(n), 40 + uint64_t(step))));
      for (bool gpu : {false, true}) {
        auto t = [&](const Pair& x) { return gpu ? *x.g : *x.c; };
        Backend& be = gpu ? *b.gpu : *b.cpu;
        Tensor step_t(be.allocate(sizeof(int32_t)), DType::i32, {1});
        write_tensor(be, step_t, {double(step)});
        AdamWArgs a{t(p), t(g), t(m), t(v), step_t, lr, 0.9, 0.95, 1e-8, 0.1, t(master)};
        be.adamw(a, nullptr);
        be.synchronize();
        be.deallocate(step_t.data);
      }
      EXPECT_TRUE(close(master.g.read(), master.c.read(), 1e-6, "master"));
      EXPECT_EQ(p.g.read(), round_bf16(master.g.read())) << "parameter = bf16(master)";
      for (const Pair* x : {&master, &m, &v}) x->c.write(x->g.read());
    }
    const auto moved = master.g.read();
    int64_t changed = 0;
    for (int64_t i = 0; i < n; ++i) changed += moved[size_t(i)] != w0[size_t(i)];
    EXPECT_GT(changed, n * 99 / 100) << "masters moved";  // (three updates may cancel exactly)
  }
}

// =================================================================================================
// Memory, copies and errors
// =================================================================================================

TEST(CudaBackend, DtypesCopiesAndErrorsNameTheCudaError) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  Backends b;
  EXPECT_EQ(b.gpu->activation_dtype(), DType::bf16);
  EXPECT_EQ(b.gpu->float_dtype(), DType::f32);
  EXPECT_STREQ(b.gpu->name(), "cuda");
  EXPECT_EQ(make_backend("auto")->name(), std::string("cuda"));
  OwnedTensor a(*b.gpu, DType::f32, {1000}), c(*b.gpu, DType::f32, {1000});
  const auto v = round_f32(uniform(1000, 5));
  a.write(v);
  poison(c);
  b.gpu->copy(*c, *a, nullptr);
  EXPECT_EQ(c.read(), v);
  b.gpu->fill_zero(*c, nullptr);
  EXPECT_EQ(c.read(), std::vector<double>(1000, 0.0));
  OwnedTensor empty(*b.gpu, DType::f32, {0});
  b.gpu->fill_zero(*empty, nullptr);
  b.gpu->copy(*empty, *empty, nullptr);
  try {
    (void)b.gpu->allocate(size_t(1) << 62);
    FAIL() << "allocating 4 EiB succeeded";
  } catch (const OutOfMemoryError& e) {
    for (const char* part :
         {"out of GPU memory", "4611686018427387904 bytes", "cudaErrorMemoryAllocation"}) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  }
  // The error was reported once: the next kernel launch does not see it again.
  EXPECT_NO_THROW(b.gpu->fill_zero(*c, nullptr));
  EXPECT_EQ(c.read(), std::vector<double>(1000, 0.0));
}

}  // namespace
}  // namespace moe_echo::test
