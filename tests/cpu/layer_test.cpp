// The whole layer on in-process ranks: R ranks equal one rank holding all experts, ECHO on equals
// ECHO off, forced overflow stays exact, edge shapes, and gradients against finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "layer_harness.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/random.hpp"
#include "test_util.hpp"

namespace moe_echo::test {
namespace {

MoeConfig small_moe(int experts = 8, int top_k = 2, int tokens = 12) {
  MoeConfig m;
  m.hidden = 16;
  m.ffn = 12;
  m.experts = experts;
  m.top_k = top_k;
  m.max_tokens = tokens;
  return m;
}

std::vector<std::vector<double>> per_rank(int ranks, int64_t tokens, int64_t hidden,
                                          uint64_t seed) {
  std::vector<std::vector<double>> v;
  for (int r = 0; r < ranks; ++r) v.push_back(random_values(size_t(tokens * hidden), seed + r));
  return v;
}

std::vector<double> concat(const std::vector<std::vector<double>>& parts) {
  std::vector<double> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  return all;
}

std::vector<double> sum(const std::vector<std::vector<double>>& parts) {
  std::vector<double> s(parts[0].size(), 0.0);
  for (const auto& p : parts)
    for (size_t i = 0; i < p.size(); ++i) s[i] += p[i];
  return s;
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b, double tol,
                  const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_LE(rel_error(a, b), tol) << what;
}

TEST(Layer, RRanksEqualOneRankHoldingAllExperts) {
  for (int R : {2, 4}) {
    for (bool echo : {false, true}) {
      LayerCase multi;
      multi.moe = small_moe(8, 2, 10);
      multi.ranks = R;
      multi.echo.enabled = echo;
      multi.echo.spare_slots_per_rank = 1;
      multi.moe.capacity_factor = 0.6;  // forces spill rounds on busy ranks
      LayerCase single = multi;
      single.ranks = 1;
      single.moe.max_tokens = multi.moe.max_tokens * R;
      single.echo.enabled = false;
      const auto x = per_rank(R, 10, 16, 100);
      const auto g = per_rank(R, 10, 16, 200);
      const LayerRun m = run_layer(multi, x, g);
      const LayerRun s = run_layer(single, {concat(x)}, {concat(g)});
      SCOPED_TRACE("R = " + std::to_string(R) + (echo ? " echo on" : " echo off"));
      expect_close(concat(m.y), s.y[0], 1e-13, "y");
      expect_close(concat(m.dx), s.dx[0], 1e-13, "dx");
      expect_close(m.dw1, s.dw1, 1e-13, "dw1");
      expect_close(m.dw2, s.dw2, 1e-13, "dw2");
      expect_close(sum(m.d_router), s.d_router[0], 1e-13, "router weight gradient");
    }
  }
}

TEST(Layer, EchoOnEqualsEchoOffUnderSkew) {
  for (auto score : {ScoreFunction::softmax, ScoreFunction::sigmoid}) {
    LayerCase on;
    on.moe = small_moe(16, 2, 64);
    on.moe.score_function = score;
    on.moe.aux_loss_coeff = 0.01;
    on.moe.z_loss_coeff = 0.001;
    on.ranks = 4;
    on.echo.enabled = true;
    on.echo.spare_slots_per_rank = 2;
    on.echo.max_clones_per_expert = 2;
    LayerCase off = on;
    off.echo.enabled = false;
    const SkewedInput in = skewed(on, 64, 1.5, 11);
    const auto g = per_rank(4, 64, 16, 300);
    const LayerRun a = run_layer(on, in.x, g, in.params);
    const LayerRun b = run_layer(off, in.x, g, in.params);
    EXPECT_GT(a.stats[0].clones, 0) << "skewed routing should make ECHO clone";
    EXPECT_LT(a.stats[0].max_over_mean_after, a.stats[0].max_over_mean_before);
    EXPECT_DOUBLE_EQ(b.stats[0].max_over_mean_after, b.stats[0].max_over_mean_before);
    for (int r = 0; r < 4; ++r) {
      expect_close(a.y[size_t(r)], b.y[size_t(r)], 1e-14, "y");
      expect_close(a.dx[size_t(r)], b.dx[size_t(r)], 1e-13, "dx");
      expect_close(a.d_router[size_t(r)], b.d_router[size_t(r)], 1e-13, "router gradient");
    }
    expect_close(a.dw1, b.dw1, 1e-13, "dw1");
    expect_close(a.dw2, b.dw2, 1e-13, "dw2");
  }
}

// Ranks on several nodes (the in-process world's hierarchical dispatch and combine: one copy of a
// token per node, forwarded inside it) give the bits of one node: ECHO clones, spill rounds,
// chunks, shared experts and FP8 included.
TEST(Layer, RanksOnSeveralNodesGiveTheBitsOfOneNode) {
  for (int variant = 0; variant < 4; ++variant) {
    LayerCase one;
    one.moe = small_moe(16, variant == 1 ? 6 : 2, 32);
    one.ranks = 4;
    one.passes = 2;
    one.echo.enabled = variant != 2;
    one.echo.spare_slots_per_rank = 2;
    one.moe.capacity_factor = variant == 0 ? 0.3 : 2.0;
    if (variant == 1) one.moe.chunks = 3;
    if (variant == 2) {
      one.moe.shared_experts = 2;
      one.moe.shared_ffn = 3;
    }
    if (variant == 3) {
      one.moe.ffn = 16;
      one.moe.precision = Precision::fp8;
    }
    const SkewedInput in = skewed(one, 32, 1.5, 41);
    const auto g = per_rank(4, 32, 16, 900);
    const LayerRun a = run_layer(one, in.x, g, in.params);
    if (variant == 0) {
      EXPECT_GT(a.stats[0].spill_rounds, 0);
    }
    if (variant < 2) {  // (FP8 clones on its quantization blocks: none at these few rows)
      EXPECT_GT(a.stats[0].clones, 0) << "variant " << variant;
    }
    for (int per_node : {1, 2}) {
      SCOPED_TRACE("variant " + std::to_string(variant) + ", " + std::to_string(per_node) +
                   " ranks per node");
      LayerCase nodes = one;
      nodes.ranks_per_node = per_node;
      const LayerRun b = run_layer(nodes, in.x, g, in.params);
      EXPECT_EQ(a.y, b.y);
      EXPECT_EQ(a.dx, b.dx);
      EXPECT_EQ(a.d_router, b.d_router);
      EXPECT_EQ(a.dw1, b.dw1);
      EXPECT_EQ(a.dw2, b.dw2);
      EXPECT_EQ(a.stats[0].clones, b.stats[0].clones);
    }
  }
}

// After zero_grad the first backward writes the expert gradients; a second one without zero_grad
// adds to them (spill rounds and clones included): two passes give twice the gradients of one.
TEST(Layer, BackwardsAfterOneZeroGradAccumulate) {
  for (double cf : {0.3, 4.0}) {
    for (bool echo : {false, true}) {
      LayerCase c;
      c.moe = small_moe(8, 2, 32);
      c.ranks = 4;
      c.echo.enabled = echo;
      c.moe.capacity_factor = cf;
      const SkewedInput in = skewed(c, 32, 1.5, 9);
      const auto g = per_rank(4, 32, 16, 700);
      SCOPED_TRACE("capacity factor " + std::to_string(cf) + (echo ? " echo" : ""));
      const LayerRun one = run_layer(c, in.x, g, in.params);
      c.passes = 2;
      const LayerRun two = run_layer(c, in.x, g, in.params);
      auto twice = [](std::vector<double> v) {
        for (double& e : v) e *= 2;
        return v;
      };
      expect_close(two.dw1, twice(one.dw1), 1e-13, "dw1");
      expect_close(two.dw2, twice(one.dw2), 1e-13, "dw2");
      for (int r = 0; r < 4; ++r)
        expect_close(two.d_router[size_t(r)], twice(one.d_router[size_t(r)]), 1e-13, "d_router");
      EXPECT_GT(one.stats[0].spill_rounds + (cf > 1 ? 1 : 0), 0);
    }
  }
}

// backward_into writes the home experts' gradients into tensors of the caller's, poisoned first:
// the same bits as backward() after zero_grad, with clones reduced into them and spill rounds.
TEST(Layer, BackwardIntoWritesTheGradientsBackwardWould) {
  for (int R : {1, 2, 4}) {
    for (double cf : {0.3, 4.0}) {
      for (bool echo : {false, true}) {
        LayerCase c;
        c.moe = small_moe(8, 2, 32);
        c.ranks = R;
        c.echo.enabled = echo;
        c.echo.spare_slots_per_rank = 2;
        c.moe.capacity_factor = cf;
        const SkewedInput in = skewed(c, 32, 1.5, 13);
        const auto g = per_rank(R, 32, 16, 900);
        SCOPED_TRACE("R = " + std::to_string(R) + ", capacity factor " + std::to_string(cf) +
                     (echo ? ", echo" : ""));
        const LayerRun ref = run_layer(c, in.x, g, in.params);
        c.backward_into = true;
        // The whole backward and the split one (backward_dispatch with the tensors), on a layer
        // with its own w1/w2 gradient buffers and on one without (LayerOwns::expert_grads).
        for (int way = 0; way < 4; ++way) {
          c.split_phases = way % 2 == 1;
          c.expert_grads = way < 2;
          SCOPED_TRACE(std::string(c.split_phases ? "split" : "whole") +
                       (c.expert_grads ? "" : ", no expert gradient buffers"));
          const LayerRun into = run_layer(c, in.x, g, in.params);
          EXPECT_EQ(into.dw1, ref.dw1);
          EXPECT_EQ(into.dw2, ref.dw2);
          for (int r = 0; r < R; ++r) {
            EXPECT_EQ(into.y[size_t(r)], ref.y[size_t(r)]);
            EXPECT_EQ(into.dx[size_t(r)], ref.dx[size_t(r)]);
            EXPECT_EQ(into.d_router[size_t(r)], ref.d_router[size_t(r)]);
          }
        }
        c.split_phases = false;
        c.expert_grads = true;
        if (echo && R > 1) {
          EXPECT_GT(ref.stats[0].clones, 0);
        }
        if (cf < 1) {
          EXPECT_GT(ref.stats[0].spill_rounds, 0);
        }
      }
    }
  }
}

// Without its own w1/w2 gradient buffers a layer holds exactly their bytes less, refuses by name
// what would write or read them (a plain backward, grad(w1), optimizer state), and keeps the
// other gradients (the router's).
TEST(Layer, WithoutExpertGradientBuffers) {
  const MoeConfig m = small_moe(8, 2, 16);
  const ParallelConfig par{1, 0};
  const EchoConfig e;
  const LayerOwns none(/*optimizer=*/false, /*grads=*/false), grads(false, true);
  const size_t dw = size_t(m.experts * (m.hidden * 2 * m.ffn + m.ffn * m.hidden)) * 8;
  EXPECT_EQ(MoeLayer::layer_memory_bytes(m, par, e, DType::f64, DType::f64, grads),
            MoeLayer::layer_memory_bytes(m, par, e, DType::f64, DType::f64, none) + dw);
  EXPECT_EQ(MoeStack::memory_bytes({m, m}, par, e, DType::f64, DType::f64, grads),
            MoeStack::memory_bytes({m, m}, par, e, DType::f64, DType::f64, none) + 2 * dw);
  auto expect_error = [](const std::function<void()>& f, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one naming: " << what;
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(what), std::string::npos) << err.what();
    }
  };
  InProcessWorld world(1);
  world.run([&](int) {
    auto be = make_cpu_backend(DType::f64);
    expect_error(
        [&] { MoeLayer(*be, world.communicator(0), m, par, e, 3, LayerOwns(true, false)); },
        "with optimizer state and without expert gradients");
    MoeLayer layer(*be, world.communicator(0), m, par, e, 3, none);
    EXPECT_EQ(layer.layer_bytes(),
              MoeLayer::layer_memory_bytes(m, par, e, DType::f64, DType::f64, none));
    const int64_t T = 16, H = m.hidden;
    std::vector<void*> owned;
    auto tensor = [&](Tensor t, uint64_t seed) {
      t.data = be->allocate(t.bytes());
      owned.push_back(t.data);
      write_tensor(*be, t, random_values(size_t(t.numel()), seed));
      return t;
    };
    const Tensor x = tensor(Tensor(nullptr, DType::f64, {T, H}), 1),
                 y = tensor(Tensor(nullptr, DType::f64, {T, H}), 2),
                 dy = tensor(Tensor(nullptr, DType::f64, {T, H}), 3),
                 dx = tensor(Tensor(nullptr, DType::f64, {T, H}), 4);
    layer.forward(x, y);
    expect_error([&] { layer.backward(dy, dx); },
                 "backward of a layer built without expert gradients");
    expect_error([&] { (void)layer.grad(Param::w1); },
                 "grad(w1) of a layer built without expert gradients");
    expect_error([&] { (void)layer.grad(Param::w2); },
                 "grad(w2) of a layer built without expert gradients");
    const MoeLayer::ExpertGrads into{
        tensor(Tensor(nullptr, DType::f64, {m.experts, H, 2 * m.ffn}), 5),
        tensor(Tensor(nullptr, DType::f64, {m.experts, m.ffn, H}), 6)};
    layer.forward(x, y);
    layer.backward_into(x, dy, dx, into);
    double sq = 0;
    for (double v : read_tensor(*be, layer.grad(Param::router_weight))) sq += v * v;
    EXPECT_GT(sq, 0.0);
    layer.zero_grad();  // skips the buffers it does not hold
    for (void* p : owned) be->deallocate(p);
  });
}

TEST(Layer, ForcedOverflowIsExactAndCounted) {
  LayerCase roomy;
  roomy.moe = small_moe(8, 2, 32);
  roomy.ranks = 4;
  roomy.echo.enabled = false;
  roomy.moe.capacity_factor = 4.0;  // never overflows
  const SkewedInput in = skewed(roomy, 32, 1.5, 5);
  const auto g = per_rank(4, 32, 16, 400);
  const LayerRun ref = run_layer(roomy, in.x, g, in.params);
  for (double cf : {0.05, 0.3, 1.0}) {
    for (bool echo : {false, true}) {
      LayerCase tight = roomy;
      tight.moe.capacity_factor = cf;
      tight.echo.enabled = echo;
      const LayerRun t = run_layer(tight, in.x, g, in.params);
      SCOPED_TRACE("capacity factor " + std::to_string(cf) + (echo ? " echo" : ""));
      const int64_t cap = capacity_rows(tight.moe);
      int64_t expected_overflow = 0, max_rows = 0;
      for (int32_t rows : t.stats[0].load_after) {
        expected_overflow += std::max<int64_t>(0, rows - cap);
        max_rows = std::max<int64_t>(max_rows, rows);
      }
      EXPECT_EQ(t.stats[0].overflow_rows_all, expected_overflow);
      EXPECT_EQ(t.stats[0].spill_rounds, int((max_rows + cap - 1) / cap) - 1);
      if (cf < 1.0) {
        EXPECT_GT(t.stats[0].overflow_rows_all, 0);
      }
      for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(t.stats[size_t(r)].overflow_rows,
                  std::max<int64_t>(0, t.stats[size_t(r)].received_rows - cap));
        expect_close(t.y[size_t(r)], ref.y[size_t(r)], 1e-13, "y");
        expect_close(t.dx[size_t(r)], ref.dx[size_t(r)], 1e-13, "dx");
      }
      expect_close(t.dw1, ref.dw1, 1e-13, "dw1");
      expect_close(t.dw2, ref.dw2, 1e-13, "dw2");
    }
  }
}

// Every token picks every expert, two per rank, in two slots: a token has two members on each
// rank, and windows smaller than a rank's rows put them in the same window (capacity 16 of 24
// rows) or split them across spill rounds (capacity 8). Forward, backward and the router gradient
// (through the combine-weight gradients pulled back per entry) equal one rank's roomy run.
TEST(Layer, MembersOnOneRankTogetherOrSplitAcrossSpillRounds) {
  for (double cf : {0.3, 0.65}) {
    for (bool echo : {false, true}) {
      LayerCase multi;
      multi.moe = small_moe(4, 4, 6);
      multi.moe.aux_loss_coeff = 0.01;
      multi.ranks = 2;
      multi.echo.enabled = echo;
      multi.echo.spare_slots_per_rank = 1;
      multi.moe.capacity_factor = cf;
      LayerCase single = multi;
      single.ranks = 1;
      single.moe.max_tokens = 12;
      single.echo.enabled = false;
      single.moe.capacity_factor = 4.0;
      const auto x = per_rank(2, 6, 16, 500);
      const auto g = per_rank(2, 6, 16, 600);
      const LayerRun m = run_layer(multi, x, g);
      const LayerRun s = run_layer(single, {concat(x)}, {concat(g)});
      SCOPED_TRACE("capacity factor " + std::to_string(cf) + (echo ? " echo" : ""));
      EXPECT_GT(m.stats[0].spill_rounds, 0);
      expect_close(concat(m.y), s.y[0], 1e-13, "y");
      expect_close(concat(m.dx), s.dx[0], 1e-13, "dx");
      expect_close(m.dw1, s.dw1, 1e-13, "dw1");
      expect_close(m.dw2, s.dw2, 1e-13, "dw2");
      expect_close(sum(m.d_router), s.d_router[0], 1e-13, "router weight gradient");
    }
  }
}

TEST(Layer, ZeroAndOneTokenAndUnevenRanks) {
  LayerCase c;
  c.moe = small_moe(8, 2, 4);
  c.ranks = 2;
  c.echo.spare_slots_per_rank = 1;
  // rank 0 has no tokens, rank 1 one token; then both empty.
  for (auto tokens : {std::vector<int>{0, 1}, std::vector<int>{0, 0}, std::vector<int>{1, 4}}) {
    std::vector<std::vector<double>> x, g;
    for (int r = 0; r < 2; ++r) {
      x.push_back(random_values(size_t(tokens[size_t(r)] * 16), 10 + r));
      g.push_back(random_values(size_t(tokens[size_t(r)] * 16), 20 + r));
    }
    const LayerRun m = run_layer(c, x, g);
    LayerCase single = c;
    single.ranks = 1;
    single.moe.max_tokens = 8;
    const LayerRun s = run_layer(single, {concat(x)}, {concat(g)});
    expect_close(concat(m.y), s.y[0], 1e-13, "y");
    expect_close(concat(m.dx), s.dx[0], 1e-13, "dx");
    expect_close(m.dw1, s.dw1, 1e-13, "dw1");
    for (double v : concat(m.y)) EXPECT_TRUE(std::isfinite(v));
  }
}

TEST(Layer, AllTokensOnOneExpert) {
  LayerCase c;
  c.moe = small_moe(8, 1, 16);
  c.ranks = 4;
  c.echo.spare_slots_per_rank = 2;
  c.echo.max_clones_per_expert = 3;
  c.moe.capacity_factor = 1.0;
  const auto x = per_rank(4, 16, 16, 50);
  const auto g = per_rank(4, 16, 16, 60);
  GlobalParams p = run_layer(c, x, g).params;
  p.router_bias.assign(8, 0.0);
  p.router_bias[5] = 100.0;  // every token selects expert 5
  const LayerRun on = run_layer(c, x, g, p);
  LayerCase off = c;
  off.echo.enabled = false;
  const LayerRun ref = run_layer(off, x, g, p);
  EXPECT_EQ(ref.stats[0].load_before[2], 64);  // expert 5 lives on rank 2
  EXPECT_EQ(on.stats[0].clones, 3);
  // Per clone 3 H F weights in and 3 H F gradients home, both f64 here.
  EXPECT_EQ(on.stats[0].clone_bytes, 3 * 3 * c.moe.hidden * c.moe.ffn * (8 + 8));
  EXPECT_EQ(on.stats[0].load_after[2], 16);  // split over 4 replicas
  EXPECT_GT(ref.stats[0].overflow_rows_all, 0);
  for (int r = 0; r < 4; ++r) expect_close(on.y[size_t(r)], ref.y[size_t(r)], 1e-14, "y");
  expect_close(on.dw1, ref.dw1, 1e-13, "dw1");
  expect_close(on.dw2, ref.dw2, 1e-13, "dw2");
}

TEST(Layer, OddShapes) {
  LayerCase c;
  c.moe.hidden = 13;
  c.moe.ffn = 7;
  c.moe.experts = 6;
  c.moe.top_k = 3;
  c.moe.max_tokens = 9;
  c.ranks = 3;
  c.echo.spare_slots_per_rank = 1;
  c.moe.capacity_factor = 0.7;
  const auto x = per_rank(3, 9, 13, 70);
  const auto g = per_rank(3, 9, 13, 80);
  const LayerRun m = run_layer(c, x, g);
  LayerCase single = c;
  single.ranks = 1;
  single.moe.max_tokens = 27;
  const LayerRun s = run_layer(single, {concat(x)}, {concat(g)});
  expect_close(concat(m.y), s.y[0], 1e-13, "y");
  expect_close(m.dw2, s.dw2, 1e-13, "dw2");
}

// Central differences of the objective sum_r <y_r, g_r> + aux_r + z_r (fp64) against backward.
// Groups aligned to ranks bound the ranks a token's rows go to by topk_groups: 16 experts on 4
// ranks in 4 groups, top-4 inside 2 groups; without the limit, tokens reach 3 or 4 ranks.
TEST(Layer, GroupsAlignedToRanksBoundRanksPerToken) {
  for (int topk_groups : {2, 4}) {
    LayerCase c;
    c.moe = small_moe(16, 4, 40);
    c.moe.score_function = ScoreFunction::sigmoid;
    c.moe.expert_groups = 4;
    c.moe.topk_groups = topk_groups;
    c.moe.routed_scaling_factor = 2.5;
    c.ranks = 4;
    c.echo.enabled = false;
    const LayerRun run = run_layer(c, per_rank(4, 40, 16, 500), per_rank(4, 40, 16, 600));
    SCOPED_TRACE("topk_groups " + std::to_string(topk_groups));
    for (const StepStats& st : run.stats) {
      EXPECT_GE(st.ranks_per_token_mean, 1.0);
      if (topk_groups == 2) {
        EXPECT_LE(st.ranks_per_token_max, 2);
      } else {
        EXPECT_GT(st.ranks_per_token_max, 2);
      }
    }
  }
}

// y, dx and every gradient of a layer with shared experts equal the layer without them plus a
// dense SwiGLU of the shared weights computed here, on 2 ranks with spill rounds, two passes
// (gradients accumulate), and a rank with no tokens; the shared weights' gradients also against
// central differences.
TEST(Layer, SharedExpertsEqualTheLayerWithoutPlusADenseSwiGLU) {
  for (int64_t T1 : {10, 0}) {
    LayerCase with;
    with.moe = small_moe(8, 2, 10);
    with.moe.shared_experts = 2;
    with.moe.shared_ffn = 3;
    with.ranks = 2;
    with.passes = 2;
    with.moe.capacity_factor = 0.3;  // spill rounds on busy ranks
    LayerCase without = with;
    without.moe.shared_experts = 0;
    SCOPED_TRACE("rank 1 tokens " + std::to_string(T1));
    const int64_t H = 16, S = 6, T[2] = {10, T1};
    std::vector<std::vector<double>> x = {random_values(size_t(T[0] * H), 40),
                                          random_values(size_t(T[1] * H), 41)};
    std::vector<std::vector<double>> g = {random_values(size_t(T[0] * H), 42),
                                          random_values(size_t(T[1] * H), 43)};
    const LayerRun a = run_layer(with, x, g);
    const LayerRun b = run_layer(without, x, g);
    const std::vector<double>&w1 = a.params.shared_w1, &w2 = a.params.shared_w2;
    ASSERT_EQ(w1.size(), size_t(H * 2 * S));
    std::vector<double> dw1(w1.size(), 0.0), dw2(w2.size(), 0.0);
    for (int r = 0; r < 2; ++r) {
      std::vector<double> y(b.y[size_t(r)]), dx(b.dx[size_t(r)]);
      for (int64_t t = 0; t < T[r]; ++t) {
        const double* xt = &x[size_t(r)][size_t(t * H)];
        const double* gt = &g[size_t(r)][size_t(t * H)];
        std::vector<double> gate(static_cast<size_t>(S)), up(gate), act(gate), da(gate);
        for (int64_t j = 0; j < S; ++j) {
          gate[size_t(j)] = up[size_t(j)] = 0;
          for (int64_t h = 0; h < H; ++h) {
            gate[size_t(j)] += xt[h] * w1[size_t(h * 2 * S + j)];
            up[size_t(j)] += xt[h] * w1[size_t(h * 2 * S + S + j)];
          }
          const double sg = 1 / (1 + std::exp(-gate[size_t(j)]));
          act[size_t(j)] = gate[size_t(j)] * sg * up[size_t(j)];
        }
        for (int64_t h = 0; h < H; ++h)
          for (int64_t j = 0; j < S; ++j) {
            y[size_t(t * H + h)] += act[size_t(j)] * w2[size_t(j * H + h)];
            da[size_t(j)] += gt[h] * w2[size_t(j * H + h)];
            dw2[size_t(j * H + h)] += 2 * act[size_t(j)] * gt[h];  // two passes
          }
        for (int64_t j = 0; j < S; ++j) {
          const double gj = gate[size_t(j)], sg = 1 / (1 + std::exp(-gj));
          const double d_gate = da[size_t(j)] * up[size_t(j)] * sg * (1 + gj * (1 - sg));
          const double d_up = da[size_t(j)] * gj * sg;
          for (int64_t h = 0; h < H; ++h) {
            dx[size_t(t * H + h)] +=
                d_gate * w1[size_t(h * 2 * S + j)] + d_up * w1[size_t(h * 2 * S + S + j)];
            dw1[size_t(h * 2 * S + j)] += 2 * d_gate * xt[h];
            dw1[size_t(h * 2 * S + S + j)] += 2 * d_up * xt[h];
          }
        }
      }
      expect_close(a.y[size_t(r)], y, 1e-13, "y");
      expect_close(a.dx[size_t(r)], dx, 1e-13, "dx");
      expect_close(a.d_router[size_t(r)], b.d_router[size_t(r)], 1e-13, "router gradient");
    }
    expect_close(a.dw1, b.dw1, 1e-13, "dw1");
    expect_close(a.dw2, b.dw2, 1e-13, "dw2");
    expect_close(sum(a.d_shared_w1), dw1, 1e-13, "shared w1 gradient");
    expect_close(sum(a.d_shared_w2), dw2, 1e-13, "shared w2 gradient");
    // On a side stream (the CPU backend runs it in place): the same values.
    LayerCase side = with;
    side.moe.shared_side_stream = true;
    const LayerRun c = run_layer(side, x, g);
    for (int r = 0; r < 2; ++r) {
      expect_close(c.y[size_t(r)], a.y[size_t(r)], 0.0, "y, side stream");
      expect_close(c.dx[size_t(r)], a.dx[size_t(r)], 0.0, "dx, side stream");
    }
    expect_close(sum(c.d_shared_w1), sum(a.d_shared_w1), 0.0, "shared w1 gradient, side stream");
    EXPECT_GT(a.stats[0].spill_rounds + a.stats[1].spill_rounds, 0) << "no spill round ran";
    // Central differences of the objective (two passes: twice the one-pass gradient).
    LayerCase once = with;
    once.passes = 1;
    Rng pick(9, 0);
    for (int trial = 0; trial < 3; ++trial) {
      const size_t i1 = pick.below(w1.size()), i2 = pick.below(w2.size());
      auto fd = [&](auto mutate) {
        GlobalParams p = a.params;
        mutate(p, 1e-6);
        const double up = run_layer(once, x, g, p).objective;
        p = a.params;
        mutate(p, -1e-6);
        return (up - run_layer(once, x, g, p).objective) / 2e-6;
      };
      const double d1 = fd([&](GlobalParams& p, double e) { p.shared_w1[i1] += e; });
      const double d2 = fd([&](GlobalParams& p, double e) { p.shared_w2[i2] += e; });
      EXPECT_NEAR(dw1[i1] / 2, d1, 1e-6 * (1 + std::fabs(d1))) << "shared_w1[" << i1 << "]";
      EXPECT_NEAR(dw2[i2] / 2, d2, 1e-6 * (1 + std::fabs(d2))) << "shared_w2[" << i2 << "]";
    }
  }
}

TEST(Layer, GradientsMatchFiniteDifferences) {
  for (auto score : {ScoreFunction::softmax, ScoreFunction::sigmoid}) {
    LayerCase c;
    c.moe = small_moe(4, 2, 6);
    c.moe.hidden = 8;
    c.moe.ffn = 5;
    c.moe.score_function = score;
    c.moe.aux_loss_coeff = 0.1;
    c.moe.z_loss_coeff = 0.01;
    // The routing rules of real models: groups (2 of 2 experts, 1 kept), scaling, sequence loss.
    if (score == ScoreFunction::sigmoid) {
      c.moe.expert_groups = 2;
      c.moe.topk_groups = 1;
      c.moe.routed_scaling_factor = 2.5;
      c.moe.seq_aux_loss_coeff = 0.05;
      c.moe.seq_len = 4;
    }
    c.ranks = 2;
    c.echo.spare_slots_per_rank = 1;
    c.moe.capacity_factor = 0.5;
    const auto x = per_rank(2, 6, 8, 90);
    const auto g = per_rank(2, 6, 8, 91);
    const LayerRun base = run_layer(c, x, g);
    const double eps = 1e-6;
    Rng pick(3, 0);
    auto fd = [&](auto mutate) {
      GlobalParams p = base.params;
      auto xp = x;
      mutate(p, xp, +eps);
      const double up = run_layer(c, xp, g, p).objective;
      p = base.params;
      xp = x;
      mutate(p, xp, -eps);
      const double down = run_layer(c, xp, g, p).objective;
      return (up - down) / (2 * eps);
    };
    for (int trial = 0; trial < 6; ++trial) {
      const size_t i1 = pick.below(base.params.w1.size()), i2 = pick.below(base.params.w2.size());
      const size_t ir = pick.below(base.params.router_weight.size()), ix = pick.below(x[1].size());
      const double d1 = fd([&](GlobalParams& p, auto&, double e) { p.w1[i1] += e; });
      const double d2 = fd([&](GlobalParams& p, auto&, double e) { p.w2[i2] += e; });
      const double dr = fd([&](GlobalParams& p, auto&, double e) { p.router_weight[ir] += e; });
      const double dxv = fd([&](GlobalParams&, auto& xp, double e) { xp[1][ix] += e; });
      EXPECT_NEAR(base.dw1[i1], d1, 1e-6 * (1 + std::fabs(d1))) << "w1[" << i1 << "]";
      EXPECT_NEAR(base.dw2[i2], d2, 1e-6 * (1 + std::fabs(d2))) << "w2[" << i2 << "]";
      EXPECT_NEAR(base.d_router[0][ir] + base.d_router[1][ir], dr, 1e-6 * (1 + std::fabs(dr)))
          << "router[" << ir << "]";
      EXPECT_NEAR(base.dx[1][ix], dxv, 1e-6 * (1 + std::fabs(dxv))) << "x[1][" << ix << "]";
    }
  }
}

// The phase observer sees every phase of a step once, in the same order every step and on every
// rank; ECHO adds the clone transfers, and a layer with spill rounds marks where they start.
TEST(Layer, PhaseObserverSeesEachPhaseOnceInAFixedOrder) {
  struct Recorder final : PhaseObserver {
    std::vector<std::string> names;
    void mark(const char* phase, Stream) override { names.emplace_back(phase); }
  };
  for (bool echo : {false, true}) {
    SCOPED_TRACE(echo ? "echo" : "no echo");
    const int R = 2, T = 16;
    MoeConfig m = small_moe(8, 2, T);
    EchoConfig e;
    e.enabled = echo;
    InProcessWorld world(R);
    std::vector<std::vector<std::string>> first(R), second(R);
    world.run([&](int r) {
      auto be = make_cpu_backend(DType::f64);
      MoeLayer layer(*be, world.communicator(r), m, ParallelConfig{R, r}, e, 3);
      Recorder rec;
      layer.set_phase_observer(&rec);
      std::vector<void*> owned;
      auto tensor = [&](uint64_t seed) {
        Tensor t(nullptr, be->activation_dtype(), {T, m.hidden});
        t.data = be->allocate(t.bytes());
        owned.push_back(t.data);
        write_tensor(*be, t, random_values(size_t(T * m.hidden), seed + uint64_t(r)));
        return t;
      };
      const Tensor x = tensor(10), y = tensor(20), dy = tensor(30), dx = tensor(40);
      for (auto* out : {&first[size_t(r)], &second[size_t(r)]}) {
        rec.names.clear();
        layer.zero_grad();
        layer.forward(x, y);
        layer.backward(dy, dx);
        *out = rec.names;
      }
      layer.set_phase_observer(nullptr);
      for (void* p : owned) be->deallocate(p);
    });
    const std::vector<std::string>& names = first[0];
    ASSERT_FALSE(names.empty());
    EXPECT_EQ(names.front(), "router");
    for (const char* must : {"plan", "dispatch", "fc1", "fc2", "combine", "bwd_wgrad_fc1",
                             "bwd_combine", "bwd_router"})
      EXPECT_NE(std::find(names.begin(), names.end(), must), names.end()) << must;
    const bool clones = std::find(names.begin(), names.end(), "clone_pull") != names.end();
    EXPECT_EQ(clones, echo);
    for (size_t i = 0; i < names.size(); ++i)
      for (size_t j = i + 1; j < names.size(); ++j)
        EXPECT_NE(names[i], names[j]) << "twice: " << names[i];
    for (int r = 0; r < R; ++r) {
      EXPECT_EQ(first[size_t(r)], names) << "rank " << r;
      EXPECT_EQ(second[size_t(r)], names) << "rank " << r << ", second step";
    }
  }
}

// The split-phase calls (forward_dispatch, forward_experts, forward_combine and the backward's
// three) give forward()'s and backward()'s results bit for bit: ECHO with clones, spill rounds,
// shared experts (on the side stream, with and without spill rounds), every recompute option, two
// passes after one zero_grad.
TEST(Layer, SplitPhasesEqualTheWholeForwardAndBackward) {
  struct Case {
    const char* name;
    void (*set)(LayerCase&);
    bool spill, clones;
  };
  const Case cases[] = {
      {"echo under skew",
       [](LayerCase& c) {
         c.echo.enabled = true;
         c.echo.spare_slots_per_rank = 2;
         c.echo.max_clones_per_expert = 2;
         c.moe.capacity_factor = 4.0;
       },
       false, true},
      {"echo and spill rounds",
       [](LayerCase& c) {
         c.echo.enabled = true;
         c.echo.spare_slots_per_rank = 1;
         c.moe.capacity_factor = 0.3;
       },
       true, true},
      {"shared experts on the side stream",
       [](LayerCase& c) {
         c.moe.shared_experts = 2;
         c.moe.shared_ffn = 3;
         c.moe.shared_side_stream = true;
         c.moe.capacity_factor = 4.0;
       },
       false, false},
      {"shared experts on the side stream, spill rounds",
       [](LayerCase& c) {
         c.moe.shared_experts = 2;
         c.moe.shared_ffn = 3;
         c.moe.shared_side_stream = true;
         c.moe.capacity_factor = 0.3;
       },
       true, false},
      {"shared experts in line",
       [](LayerCase& c) {
         c.moe.shared_experts = 1;
         c.moe.shared_ffn = 4;
         c.moe.capacity_factor = 0.3;
       },
       true, false},
      {"recompute dispatch",
       [](LayerCase& c) {
         c.moe.recompute = Recompute::dispatch;
         c.moe.capacity_factor = 0.3;
       },
       true, false},
      {"recompute experts",
       [](LayerCase& c) {
         c.moe.recompute = Recompute::experts;
         c.moe.capacity_factor = 4.0;
       },
       false, false},
      {"recompute moe_act, spill rounds",
       [](LayerCase& c) { c.moe.recompute = Recompute::moe_act; }, true, false},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    LayerCase whole;
    whole.moe = small_moe(16, 2, 32);
    whole.ranks = 4;
    whole.passes = 2;
    whole.echo.enabled = false;
    k.set(whole);
    LayerCase split = whole;
    split.split_phases = true;
    const SkewedInput in = skewed(whole, 32, 1.5, 21);
    const auto g = per_rank(4, 32, 16, 500);
    const LayerRun a = run_layer(whole, in.x, g, in.params);
    const LayerRun b = run_layer(split, in.x, g, in.params);
    int spill = 0, clones = 0;
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(b.y[size_t(r)], a.y[size_t(r)]) << "y, rank " << r;
      EXPECT_EQ(b.dx[size_t(r)], a.dx[size_t(r)]) << "dx, rank " << r;
      EXPECT_EQ(b.d_router[size_t(r)], a.d_router[size_t(r)]) << "router gradient, rank " << r;
      EXPECT_EQ(b.d_shared_w1[size_t(r)], a.d_shared_w1[size_t(r)]) << "shared w1 gradient";
      EXPECT_EQ(b.d_shared_w2[size_t(r)], a.d_shared_w2[size_t(r)]) << "shared w2 gradient";
      spill += b.stats[size_t(r)].spill_rounds;
      clones = std::max(clones, b.stats[size_t(r)].clones);
    }
    EXPECT_EQ(b.dw1, a.dw1);
    EXPECT_EQ(b.dw2, a.dw2);
    EXPECT_EQ(spill > 0, k.spill) << "spill rounds " << spill;
    EXPECT_EQ(clones > 0, k.clones) << "clones " << clones;
  }
}

// Overlap::wgrad (round 0's fc1 weight gradient beside the combine, on the backend's side stream)
// gives the same bits as none, whole and split, with spill rounds, clones, shared experts on the
// side stream and a recompute option.
TEST(Layer, OverlapWgradGivesTheSameBits) {
  for (int variant = 0; variant < 4; ++variant) {
    LayerCase none;
    none.moe = small_moe(16, 2, 32);
    none.ranks = 4;
    none.passes = 2;
    none.echo.enabled = variant != 1;
    none.echo.spare_slots_per_rank = 2;
    none.moe.capacity_factor = variant == 0 ? 4.0 : 0.3;
    if (variant == 2) {
      none.moe.shared_experts = 2;
      none.moe.shared_ffn = 3;
      none.moe.shared_side_stream = true;
    }
    if (variant == 3) none.moe.recompute = Recompute::experts;
    const SkewedInput in = skewed(none, 32, 1.5, 23);
    const auto g = per_rank(4, 32, 16, 600);
    const LayerRun a = run_layer(none, in.x, g, in.params);
    for (bool split : {false, true}) {
      SCOPED_TRACE("variant " + std::to_string(variant) + (split ? ", split" : ""));
      LayerCase over = none;
      over.moe.overlap = Overlap::wgrad;
      over.split_phases = split;
      const LayerRun b = run_layer(over, in.x, g, in.params);
      for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(b.y[size_t(r)], a.y[size_t(r)]);
        EXPECT_EQ(b.dx[size_t(r)], a.dx[size_t(r)]);
        EXPECT_EQ(b.d_router[size_t(r)], a.d_router[size_t(r)]);
        EXPECT_EQ(b.d_shared_w1[size_t(r)], a.d_shared_w1[size_t(r)]);
      }
      EXPECT_EQ(b.dw1, a.dw1);
      EXPECT_EQ(b.dw2, a.dw2);
    }
  }
}

// MoeConfig::chunks: round 0's dispatches, expert GEMMs and combines in chunks, forward and
// backward (the weight gradients after the chunks), give the bits of one chunk. With clones,
// spill rounds, shared experts on the side stream, recompute dispatch, a token's experts on one
// rank split over chunks (top_k 6), more chunks than some ranks have rows, and FP8 GEMMs (without
// FP8 weight gradients the backward is chunked too, with them it runs whole).
TEST(Layer, ChunkedForwardAndBackwardGiveTheBitsOfOneChunk) {
  for (int variant = 0; variant < 7; ++variant) {
    LayerCase one;
    one.moe = small_moe(16, variant == 4 ? 6 : 2, 32);
    if (variant >= 5) {
      one.moe.ffn = 16;
      one.moe.precision = Precision::fp8;
      one.moe.fp8_gemms = variant == 5 ? fp8_gemm::fprop2 | fp8_gemm::dgrad1 | fp8_gemm::dgrad2
                                       : fp8_gemm::all & ~fp8_gemm::fprop1;
    }
    one.ranks = 4;
    one.passes = 2;
    one.echo.enabled = variant != 1;
    one.echo.spare_slots_per_rank = 2;
    one.moe.capacity_factor = variant == 3 ? 0.3 : 4.0;
    if (variant == 2) {
      one.moe.shared_experts = 2;
      one.moe.shared_ffn = 3;
      one.moe.shared_side_stream = true;
    }
    if (variant == 3) one.moe.recompute = Recompute::dispatch;
    const SkewedInput in = skewed(one, 32, 1.5, 29);
    const auto g = per_rank(4, 32, 16, 700);
    const LayerRun a = run_layer(one, in.x, g, in.params);
    if (variant == 3) {
      EXPECT_GT(a.stats[0].spill_rounds, 0);
    }
    for (int chunks : {2, 3, 16}) {
      SCOPED_TRACE("variant " + std::to_string(variant) + ", " + std::to_string(chunks) +
                   " chunks");
      LayerCase ch = one;
      ch.moe.chunks = chunks;
      const LayerRun b = run_layer(ch, in.x, g, in.params);
      for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(b.y[size_t(r)], a.y[size_t(r)]);
        EXPECT_EQ(b.dx[size_t(r)], a.dx[size_t(r)]);
        EXPECT_EQ(b.d_router[size_t(r)], a.d_router[size_t(r)]);
        EXPECT_EQ(b.d_shared_w1[size_t(r)], a.d_shared_w1[size_t(r)]);
      }
      EXPECT_EQ(b.dw1, a.dw1);
      EXPECT_EQ(b.dw2, a.dw2);
    }
  }
}

template <class F>
void expect_error(F call, const std::string& what) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one saying: " << what;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

// Micro-batches of one layer on R in-process ranks, run by a schedule of calls: "F2" a whole
// forward of micro-batch 2, "B2" its whole backward, "I2" its backward_into fresh tensors
// (added up over the run in into_dw1, into_dw2), "f2d" / "f2e" / "f2c" its forward's dispatch,
// experts and combine phases, "b2d" / "b2e" / "b2c" its backward's; "H1" / "H0"
// hold_clone_grads(true / false), "O0" optimizer_step, "Z0" zero_grad. Micro-batch k runs in the
// layer's in-flight slot k % in_flight; a micro-batch of a later step is a new k. One zero_grad
// before; the gradients accumulate over the backwards.
struct MicroBatchRun {
  std::vector<std::vector<std::vector<double>>> y, dx;     // [micro-batch][rank]
  std::vector<std::vector<double>> d_router, d_shared_w1;  // [rank]
  std::vector<double> dw1, dw2;                            // all experts
  std::vector<double> into_dw1, into_dw2;                  // all experts ("I" backwards)
  std::vector<double> w1;                                  // all experts, at the end
  int clones = 0, spill_rounds = 0;
  // Rank 0: clone pulls and clone-gradient reductions (phase marks, forward and backward), and
  // its forwards' StepStats.
  int pulls = 0, reduces = 0;
  std::vector<StepStats> forwards;
};

// Counts the phases marked.
struct PhaseCounter final : PhaseObserver {
  std::vector<std::string> seen;
  void mark(const char* phase, Stream) override { seen.emplace_back(phase); }
  int count(const std::string& p) const { return int(std::count(seen.begin(), seen.end(), p)); }
};

MicroBatchRun run_micro_batches(const LayerCase& c, const GlobalParams& params, int micro_batches,
                                const std::vector<std::string>& schedule) {
  const int R = c.ranks;
  const int64_t H = c.moe.hidden, F = c.moe.ffn, E = c.moe.experts, EPR = E / R,
                T = c.moe.max_tokens;
  MicroBatchRun out;
  out.y.assign(size_t(micro_batches), std::vector<std::vector<double>>(size_t(R)));
  out.dx = out.y;
  out.d_router.resize(size_t(R));
  out.d_shared_w1.resize(size_t(R));
  out.dw1.assign(size_t(E * H * 2 * F), 0.0);
  out.dw2.assign(size_t(E * F * H), 0.0);
  out.into_dw1 = out.w1 = out.dw1;
  out.into_dw2 = out.dw2;
  std::vector<StepStats> stats(static_cast<size_t>(R));
  InProcessWorld world(R);
  world.run([&](int r) {
    auto be = make_cpu_backend(c.dtype);
    MoeLayer layer(*be, world.communicator(r), c.moe, ParallelConfig{R, r}, c.echo, c.seed);
    const size_t w1n = size_t(H * 2 * F), w2n = size_t(F * H);
    set_params(*be, layer, params, r, R);
    std::vector<std::vector<double>> host;
    std::vector<Tensor> x, y, g, dx;
    auto tensor = [&](uint64_t seed) {
      Tensor t(nullptr, be->activation_dtype(), {T, H});
      t.data = be->allocate(t.bytes());
      write_tensor(*be, t,
                   seed ? random_values(size_t(T * H), seed) : std::vector<double>(T * H, 1e30));
      return t;
    };
    for (int k = 0; k < micro_batches; ++k) {
      x.push_back(tensor(1000 + 17 * uint64_t(k) + uint64_t(r)));
      g.push_back(tensor(5000 + 17 * uint64_t(k) + uint64_t(r)));
      y.push_back(tensor(0));
      dx.push_back(tensor(0));
    }
    PhaseCounter phases;
    layer.set_phase_observer(&phases);
    layer.zero_grad();
    std::vector<double> into1(size_t(EPR) * w1n, 0.0), into2(size_t(EPR) * w2n, 0.0);
    for (const std::string& op : schedule) {
      const char kind = op[0];
      const size_t k = size_t(op[1] - '0');
      const int m = int(k) % c.moe.in_flight;
      const char phase = op.size() > 2 ? op[2] : 'w';
      if (kind == 'H') layer.hold_clone_grads(k == 1);
      if (kind == 'O') layer.optimizer_step(AdamWConfig{});
      if (kind == 'Z') layer.zero_grad();
      if (kind == 'F') layer.forward(x[k], y[k], nullptr, m);
      if (kind == 'B') layer.backward(g[k], dx[k], nullptr, m);
      if (kind == 'I') {
        Tensor d1(nullptr, be->float_dtype(), {EPR, H, 2 * F}),
            d2(nullptr, be->float_dtype(), {EPR, F, H});
        d1.data = be->allocate(d1.bytes());
        d2.data = be->allocate(d2.bytes());
        write_tensor(*be, d1, std::vector<double>(size_t(d1.numel()), 1e30));  // poisoned
        write_tensor(*be, d2, std::vector<double>(size_t(d2.numel()), 1e30));
        layer.backward_into(x[k], g[k], dx[k], {d1, d2}, nullptr, m);
        const auto v1 = read_tensor(*be, d1), v2 = read_tensor(*be, d2);
        for (size_t i = 0; i < v1.size(); ++i) into1[i] += v1[i];
        for (size_t i = 0; i < v2.size(); ++i) into2[i] += v2[i];
        be->deallocate(d1.data);
        be->deallocate(d2.data);
      }
      if (kind == 'f' && phase == 'd') layer.forward_dispatch(x[k], y[k], nullptr, m);
      if (kind == 'f' && phase == 'e') layer.forward_experts(nullptr, m);
      if (kind == 'f' && phase == 'c') layer.forward_combine(nullptr, m);
      if (kind == 'b' && phase == 'd') layer.backward_dispatch(g[k], dx[k], nullptr, m);
      if (kind == 'b' && phase == 'e') layer.backward_experts(nullptr, m);
      if (kind == 'b' && phase == 'c') layer.backward_combine(nullptr, m);
      if (kind == 'F' || (kind == 'f' && phase == 'd')) {
        const StepStats st = layer.stats(m);
        stats[size_t(r)].clones = std::max(stats[size_t(r)].clones, st.clones);
        stats[size_t(r)].spill_rounds += st.spill_rounds;
        if (r == 0) out.forwards.push_back(st);
      }
    }
    layer.set_phase_observer(nullptr);
    if (r == 0) {
      out.pulls = phases.count("clone_pull") + phases.count("bwd_clone_pull");
      out.reduces = phases.count("bwd_clone_reduce");
    }
    std::copy(into1.begin(), into1.end(), out.into_dw1.begin() + r * EPR * w1n);
    std::copy(into2.begin(), into2.end(), out.into_dw2.begin() + r * EPR * w2n);
    const auto w1 = read_tensor(*be, layer.param(Param::w1));
    std::copy(w1.begin(), w1.end(), out.w1.begin() + r * EPR * w1n);
    for (int k = 0; k < micro_batches; ++k) {
      out.y[size_t(k)][size_t(r)] = read_tensor(*be, y[size_t(k)]);
      out.dx[size_t(k)][size_t(r)] = read_tensor(*be, dx[size_t(k)]);
    }
    out.d_router[size_t(r)] = read_tensor(*be, layer.grad(Param::router_weight));
    if (shared_width(c.moe) > 0)
      out.d_shared_w1[size_t(r)] = read_tensor(*be, layer.grad(Param::shared_w1));
    const auto dw1 = read_tensor(*be, layer.grad(Param::w1));
    const auto dw2 = read_tensor(*be, layer.grad(Param::w2));
    std::copy(dw1.begin(), dw1.end(), out.dw1.begin() + r * EPR * w1n);
    std::copy(dw2.begin(), dw2.end(), out.dw2.begin() + r * EPR * w2n);
    for (auto* v : {&x, &y, &g, &dx})
      for (Tensor& t : *v) be->deallocate(t.data);
  });
  for (const StepStats& st : stats) {
    out.clones = std::max(out.clones, st.clones);
    out.spill_rounds += st.spill_rounds;
  }
  return out;
}

// Shared experts on the side stream and the weight-gradient overlap (a micro-batch test case).
void shared_beside_overlap(LayerCase& c) {
  c.moe.shared_experts = 1;
  c.moe.shared_ffn = 4;
  c.moe.shared_side_stream = true;
  c.moe.overlap = Overlap::wgrad;
}

// The layer of the micro-batch tests: 16 experts, top 2, 32 tokens on 4 ranks with 2 spare slots
// each, then what `set` changes.
LayerCase micro_batch_case(const std::function<void(LayerCase&)>& set) {
  LayerCase c;
  c.moe = small_moe(16, 2, 32);
  c.ranks = 4;
  c.echo.spare_slots_per_rank = 2;
  set(c);
  return c;
}

// Several micro-batches in flight (MoeConfig::in_flight) give the bits of one at a time: a
// pipeline schedule's forwards all before their backwards, and a combined 1F1B schedule that
// interleaves one micro-batch's forward phases with another's backward phases (slots reused
// once a backward is done). With clones and spill rounds, shared experts on the side stream with
// the weight-gradient overlap, and recompute of the dispatch.
TEST(Layer, MicroBatchesInFlightGiveTheBitsOfOneAtATime) {
  struct Case {
    const char* name;
    std::function<void(LayerCase&)> set;
    bool spill;
  };
  const std::vector<Case> cases = {
      {"clones and spill rounds", [](LayerCase& c) { c.moe.capacity_factor = 0.4; }, true},
      {"shared experts on the side stream, overlap wgrad", shared_beside_overlap, false},
      {"recompute dispatch, spill rounds",
       [](LayerCase& c) {
         c.moe.recompute = Recompute::dispatch;
         c.moe.capacity_factor = 0.4;
       },
       true},
  };
  const std::vector<std::string> one_at_a_time = {"F0", "B0", "F1", "B1", "F2", "B2"};
  const std::vector<std::string> pipeline = {"F0", "F1", "F2", "B0", "B1", "B2"};
  const std::vector<std::string> combined = {
      "f0d", "f0e", "f0c",                       // warm-up forward
      "f1d", "b0d", "f1e", "b0e", "f1c", "b0c",  // forward 1 beside backward 0
      "f2d", "b1d", "f2e", "b1e", "f2c", "b1c",  // forward 2 (slot 0 again) beside 1
      "b2d", "b2e", "b2c"};                      // cool-down backward
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    const LayerCase base = micro_batch_case(k.set);
    const SkewedInput in = skewed(base, 32, 1.5, 31);
    const MicroBatchRun a = run_micro_batches(base, in.params, 3, one_at_a_time);
    EXPECT_GT(a.clones, 0);
    EXPECT_EQ(a.spill_rounds > 0, k.spill) << "spill rounds " << a.spill_rounds;
    for (int in_flight : {3, 2}) {
      LayerCase c = base;
      c.moe.in_flight = in_flight;
      const MicroBatchRun b =
          run_micro_batches(c, in.params, 3, in_flight == 3 ? pipeline : combined);
      SCOPED_TRACE("in_flight " + std::to_string(in_flight));
      for (size_t mb = 0; mb < 3; ++mb)
        for (size_t r = 0; r < 4; ++r) {
          EXPECT_EQ(b.y[mb][r], a.y[mb][r]) << "y of micro-batch " << mb << ", rank " << r;
          EXPECT_EQ(b.dx[mb][r], a.dx[mb][r]) << "dx of micro-batch " << mb << ", rank " << r;
        }
      for (size_t r = 0; r < 4; ++r) {
        EXPECT_EQ(b.d_router[r], a.d_router[r]) << "router gradient, rank " << r;
        EXPECT_EQ(b.d_shared_w1[r], a.d_shared_w1[r]) << "shared w1 gradient, rank " << r;
      }
      EXPECT_EQ(b.dw1, a.dw1);
      EXPECT_EQ(b.dw2, a.dw2);
      EXPECT_EQ(b.spill_rounds, a.spill_rounds);
    }
  }
}

// EchoConfig::placement = step: the placement a step's first forward makes holds for the step's
// other micro-batches (their rows split over it), so the clones are pulled once a step; the
// backwards hold their clone gradients and the step's last one reduces them home once. Outputs
// and gradients equal those of a placement per micro-batch up to the order of their sums (1e-13
// in f64), over two steps with an optimizer step between, run one at a time, as a pipeline, as a
// combined 1F1B schedule, and through backward_into (whose gradients add up to the step's).
TEST(Layer, StepPlacementMovesClonesOncePerStep) {
  struct Case {
    const char* name;
    std::function<void(LayerCase&)> set;
  };
  const std::vector<Case> cases = {
      {"clones and spill rounds", [](LayerCase& c) { c.moe.capacity_factor = 0.4; }},
      {"shared experts on the side stream, overlap wgrad", shared_beside_overlap},
      {"recompute dispatch", [](LayerCase& c) { c.moe.recompute = Recompute::dispatch; }},
  };
  // Two steps of three micro-batches each (0-2, then 3-5).
  auto two_steps = [](const std::vector<std::string>& first, const std::vector<std::string>& last) {
    std::vector<std::string> ops = first;
    ops.insert(ops.end(), {"O0", "Z0"});
    for (const std::string& op : last) ops.push_back(op);
    return ops;
  };
  auto shifted = [](std::vector<std::string> ops) {  // the same with micro-batches 3-5
    for (std::string& op : ops)
      if (op[0] != 'H') op[1] = char(op[1] + 3);
    return ops;
  };
  struct Schedule {
    const char* name;
    int in_flight;
    std::vector<std::string> step;
  };
  const std::vector<Schedule> schedules = {
      {"one at a time", 1, {"H1", "F0", "B0", "F1", "B1", "H0", "F2", "B2"}},
      {"pipeline", 3, {"H1", "F0", "F1", "F2", "B0", "B1", "H0", "B2"}},
      {"combined 1F1B", 2, {"H1",  "f0d", "f0e", "f0c", "f1d", "b0d", "f1e", "b0e", "f1c", "b0c",
                            "f2d", "b1d", "f2e", "b1e", "f2c", "b1c", "H0",  "b2d", "b2e", "b2c"}},
  };
  const std::vector<std::string> ref_step = {"F0", "B0", "F1", "B1", "F2", "B2"};
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    const LayerCase base = micro_batch_case(k.set);
    const SkewedInput in = skewed(base, 32, 1.5, 31);
    const MicroBatchRun a =
        run_micro_batches(base, in.params, 6, two_steps(ref_step, shifted(ref_step)));
    ASSERT_GT(a.clones, 0);
    EXPECT_EQ(a.pulls, 6);
    EXPECT_EQ(a.reduces, 6);
    for (const Schedule& sc : schedules) {
      SCOPED_TRACE(sc.name);
      LayerCase c = base;
      c.echo.placement = EchoPlacement::step;
      c.moe.in_flight = sc.in_flight;
      const MicroBatchRun b =
          run_micro_batches(c, in.params, 6, two_steps(sc.step, shifted(sc.step)));
      for (size_t mb = 0; mb < 6; ++mb)
        for (size_t r = 0; r < 4; ++r) {
          SCOPED_TRACE("micro-batch " + std::to_string(mb) + ", rank " + std::to_string(r));
          expect_close(b.y[mb][r], a.y[mb][r], 1e-13, "y");
          expect_close(b.dx[mb][r], a.dx[mb][r], 1e-13, "dx");
        }
      for (size_t r = 0; r < 4; ++r) {
        expect_close(b.d_router[r], a.d_router[r], 1e-13, "router gradient");
        if (shared_width(c.moe) > 0)
          expect_close(b.d_shared_w1[r], a.d_shared_w1[r], 1e-13, "shared w1 gradient");
      }
      expect_close(b.dw1, a.dw1, 1e-13, "dw1 (the second step's)");
      expect_close(b.dw2, a.dw2, 1e-13, "dw2 (the second step's)");
      expect_close(b.w1, a.w1, 1e-13, "w1 after the first optimizer step");
      // One pull and one reduction a step; the forwards after a step's first keep its clones.
      EXPECT_EQ(b.pulls, 2);
      EXPECT_EQ(b.reduces, 2);
      ASSERT_EQ(b.forwards.size(), 6u);
      for (size_t f = 0; f < 6; ++f) {
        const StepStats& st = b.forwards[f];
        const StepStats& first = b.forwards[f < 3 ? 0 : 3];
        EXPECT_EQ(st.placement_kept, f % 3 != 0) << "forward " << f;
        EXPECT_LE(st.clones, first.clones) << "forward " << f;  // those given rows
        // The step's clones move on its first forward: 3 H F f64 values in and 3 H F home.
        EXPECT_EQ(st.clone_bytes,
                  f % 3 == 0 ? int64_t(st.clones) * 3 * c.moe.hidden * c.moe.ffn * 16 : 0)
            << "forward " << f;
      }
      EXPECT_GT(b.forwards[0].clone_bytes, 0);
    }
    // backward_into after each forward (a framework's fresh gradient tensors): the step's last
    // one takes the held clone gradients, so the tensors add up to the step's gradients.
    LayerCase c = base;
    c.echo.placement = EchoPlacement::step;
    const MicroBatchRun one = run_micro_batches(base, in.params, 3, ref_step);
    const MicroBatchRun into =
        run_micro_batches(c, in.params, 3, {"H1", "F0", "I0", "F1", "I1", "H0", "F2", "I2"});
    expect_close(into.into_dw1, one.dw1, 1e-13, "dw1 through backward_into");
    expect_close(into.into_dw2, one.dw2, 1e-13, "dw2 through backward_into");
    EXPECT_EQ(into.reduces, 1);
  }
}

// Misuse of a step's placement is refused by name, before anything runs: holding clone
// gradients with a placement per micro-batch, an optimizer step or changed weights while they
// are held, and the backward of a forward made on an earlier step's placement.
// A layer built with chunks refuses the split-phase calls by name, and runs forward() and
// backward() after.
TEST(Layer, ChunksRefuseTheSplitPhasesByName) {
  InProcessWorld world(2);
  world.run([&](int r) {
    auto be = make_cpu_backend(DType::f64);
    MoeConfig m = small_moe(8, 2, 16);
    m.chunks = 2;
    std::vector<Tensor> t;
    for (uint64_t i = 0; i < 4; ++i) {
      Tensor v(nullptr, DType::f64, {16, 16});
      v.data = be->allocate(v.bytes());
      write_tensor(*be, v, random_values(256, 60 + i + 10 * uint64_t(r)));
      t.push_back(v);
    }
    MoeLayer layer(*be, world.communicator(r), m, ParallelConfig{2, r}, EchoConfig{});
    layer.zero_grad();
    expect_error([&] { layer.forward_dispatch(t[0], t[1]); },
                 "forward_dispatch: MoeConfig::chunks = 2 overlaps round 0's dispatch and combine");
    layer.forward(t[0], t[1]);
    expect_error(
        [&] { layer.backward_dispatch(t[2], t[3]); },
        "backward_dispatch: MoeConfig::chunks = 2 overlaps round 0's dispatch and combine");
    layer.backward(t[2], t[3]);
    for (const Tensor& v : t) be->deallocate(v.data);
  });
}

TEST(Layer, StepPlacementMisuseIsRefusedByName) {
  InProcessWorld world(2);
  world.run([&](int r) {
    auto be = make_cpu_backend(DType::f64);
    MoeConfig m = small_moe(8, 2, 16);
    m.in_flight = 2;
    std::vector<Tensor> t;
    for (uint64_t i = 0; i < 6; ++i) {
      Tensor v(nullptr, DType::f64, {16, 16});
      v.data = be->allocate(v.bytes());
      write_tensor(*be, v, random_values(256, 40 + i + 10 * uint64_t(r)));
      t.push_back(v);
    }
    const Tensor &x = t[0], &y = t[1], &dy = t[2], &dx = t[3], &x1 = t[4], &y1 = t[5];
    {
      MoeLayer per_micro_batch(*be, world.communicator(r), m, ParallelConfig{2, r}, EchoConfig{});
      expect_error([&] { per_micro_batch.hold_clone_grads(true); },
                   "hold_clone_grads(true) needs EchoConfig::placement = step, not micro_batch");
      per_micro_batch.hold_clone_grads(false);
    }
    EchoConfig e;
    e.placement = EchoPlacement::step;
    MoeLayer layer(*be, world.communicator(r), m, ParallelConfig{2, r}, e);
    layer.zero_grad();
    layer.hold_clone_grads(true);
    layer.forward(x, y);
    layer.backward(dy, dx);
    EXPECT_TRUE(layer.clone_grads_held());
    expect_error([&] { layer.optimizer_step(AdamWConfig{}); },
                 "optimizer_step: clone gradients of earlier backwards are held in the echo slots");
    expect_error([&] { layer.weights_changed(); },
                 "weights_changed: clone gradients of earlier backwards are held");
    (void)layer.param(Param::w1);  // a view of w1: the caller may write it
    expect_error([&] { layer.forward(x, y); },
                 "forward: the expert weights changed (optimizer_step, weights_changed or a view "
                 "of w1 or w2 taken) while clone gradients of earlier backwards are held");
    layer.zero_grad();  // drops them
    EXPECT_FALSE(layer.clone_grads_held());
    layer.hold_clone_grads(false);
    layer.forward(x, y, nullptr, 0);
    layer.forward(x1, y1, nullptr, 1);
    layer.backward(dy, dx, nullptr, 0);
    layer.optimizer_step(AdamWConfig{});
    expect_error([&] { layer.backward(dy, dx, nullptr, 1); },
                 "backward of micro-batch 1: its forward ran on the clone placement of an "
                 "earlier step");
    for (Tensor& v : t) be->deallocate(v.data);
  });
}

// A micro-batch outside in_flight is refused by name; two splits of one workspace set (micro
// batches 0 and 2) may not interleave; nothing is left half done.
TEST(Layer, MicroBatchesOutOfRangeOrSharingASetAreRefusedByName) {
  auto be = make_cpu_backend(DType::f32);
  InProcessWorld world(1);
  MoeConfig m = small_moe();
  m.in_flight = 3;
  MoeLayer layer(*be, world.communicator(0), m, ParallelConfig{1, 0}, EchoConfig{});
  auto floats = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  std::vector<float> xh = floats(random_values(4 * 16, 3)), dyh = floats(random_values(4 * 16, 4));
  std::vector<float> y0(4 * 16), y2(4 * 16), dx0(4 * 16);
  Tensor x(xh.data(), DType::f32, {4, 16}), dy(dyh.data(), DType::f32, {4, 16});
  Tensor t_y0(y0.data(), DType::f32, {4, 16}), t_y2(y2.data(), DType::f32, {4, 16});
  Tensor t_dx0(dx0.data(), DType::f32, {4, 16});
  expect_error([&] { layer.forward(x, t_y0, nullptr, 3); },
               "forward: micro_batch = 3 is invalid: allowed 0 to 2 (MoeConfig::in_flight = 3)");
  expect_error([&] { layer.backward(dy, t_dx0, nullptr, -1); },
               "backward: micro_batch = -1 is invalid: allowed 0 to 2");
  expect_error([&] { layer.losses(5); }, "losses: micro_batch = 5 is invalid");
  expect_error([&] { layer.backward(dy, t_dx0, nullptr, 1); },
               "backward of micro-batch 1 without a forward of it before");
  layer.forward_dispatch(x, t_y0, nullptr, 0);
  expect_error([&] { layer.forward_dispatch(x, t_y2, nullptr, 2); },
               "forward_dispatch: micro-batch 0 of this layer, sharing micro-batch 2's "
               "workspace set (micro_batch % 2), is between the phases");
  expect_error([&] { layer.zero_grad(); }, "zero_grad: micro-batch 0 of this layer is between");
  layer.forward(x, t_y2, nullptr, 1);  // set 1: free
  layer.forward_experts(nullptr, 0);
  layer.forward_combine(nullptr, 0);
  layer.forward(x, t_y2, nullptr, 2);
  EXPECT_EQ(y0, y2);
  layer.backward(dy, t_dx0, nullptr, 0);
  EXPECT_THROW(layer.backward(dy, t_dx0, nullptr, 0), Error);
  layer.backward(dy, t_dx0, nullptr, 2);
  MoeConfig wide = m;
  wide.in_flight = kMaxInFlight + 1;
  expect_error([&] { validate(wide); }, "in_flight = 17 is invalid");
}

// Split phases out of order, a whole forward or backward in the middle of a split, and another
// layer of the same workspace between a dispatch and its combine are refused by name; nothing
// is left half done (the layer runs normally afterwards).
TEST(Layer, SplitPhasesOutOfOrderAreRefusedByName) {
  auto be = make_cpu_backend(DType::f32);
  InProcessWorld world(1);
  EchoConfig echo;
  echo.spare_slots_per_rank = 1;
  MoeStack stack(*be, world.communicator(0), std::vector<MoeConfig>(2, small_moe()),
                 ParallelConfig{1, 0}, echo);
  MoeLayer &a = stack.layer(0), &b = stack.layer(1);
  auto floats = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  std::vector<float> xh = floats(random_values(4 * 16, 3)), dyh = floats(random_values(4 * 16, 4));
  std::vector<float> ya(4 * 16), yb(4 * 16), dxa(4 * 16), dxb(4 * 16);
  Tensor x(xh.data(), DType::f32, {4, 16}), dy(dyh.data(), DType::f32, {4, 16});
  Tensor y_a(ya.data(), DType::f32, {4, 16}), y_b(yb.data(), DType::f32, {4, 16});
  Tensor dx_a(dxa.data(), DType::f32, {4, 16}), dx_b(dxb.data(), DType::f32, {4, 16});
  expect_error([&] { a.forward_experts(); },
               "forward_experts must follow forward_dispatch of this layer and micro-batch; "
               "micro-batch 0 is with no split forward or backward under way");
  expect_error([&] { a.backward_dispatch(dy, dx_a); },
               "backward of micro-batch 0 without a forward of it before");
  a.forward_dispatch(x, y_a);
  expect_error([&] { a.forward(x, y_a); },
               "forward: micro-batch 0 of this layer is between the phases of a split forward "
               "(forward_dispatch without its forward_combine)");
  expect_error([&] { b.forward(x, y_b); },
               "forward: another layer sharing this micro-batch's workspace set is between the "
               "phases");
  expect_error([&] { b.forward_dispatch(x, y_b); }, "forward_dispatch: another layer sharing");
  expect_error([&] { a.forward_combine(); },
               "forward_combine must follow forward_experts of this layer and micro-batch; "
               "micro-batch 0 is after forward_dispatch");
  expect_error([&] { a.zero_grad(); }, "zero_grad: micro-batch 0 of this layer is between");
  expect_error([&] { a.optimizer_step(AdamWConfig{}); },
               "optimizer_step: micro-batch 0 of this layer is between");
  a.forward_experts();
  a.forward_combine();
  // The same forward as a whole gives the same y; another layer may run in between.
  std::vector<float> y_whole(4 * 16);
  b.forward(x, y_b);
  b.backward(dy, dx_b);
  a.backward_dispatch(dy, dx_a);
  expect_error([&] { a.backward_combine(); },
               "backward_combine must follow backward_experts of this layer and micro-batch; "
               "micro-batch 0 is after backward_dispatch");
  expect_error([&] { b.forward(x, y_b); }, "another layer sharing this micro-batch's workspace");
  a.backward_experts();
  a.backward_combine();
  expect_error([&] { a.backward_dispatch(dy, dx_a); },
               "backward of micro-batch 0 without a forward of it before");
  a.forward(x, Tensor(y_whole.data(), DType::f32, {4, 16}));
  EXPECT_EQ(y_whole, ya);
  a.backward(dy, dx_a);
}

TEST(Layer, MemoryEstimateMatchesWhatIsAllocated) {
  for (bool optimizer : {false, true}) {
    for (bool echo : {false, true}) {
      auto be = make_cpu_backend(DType::f32);
      InProcessWorld world(1);
      MoeConfig m = small_moe();
      m.in_flight = optimizer ? 3 : 1;  // 3: the layer's per-micro-batch part thrice, 2 sets
      m.recompute = echo ? Recompute::none : Recompute::dispatch;
      EchoConfig e;
      e.enabled = echo;
      // With a placement a step, the echo slots are the layer's own.
      e.placement = optimizer ? EchoPlacement::step : EchoPlacement::micro_batch;
      MoeLayer layer(*be, world.communicator(0), m, ParallelConfig{1, 0}, e, 1, optimizer);
      EXPECT_EQ(layer.workspace_bytes(), MoeLayer::memory_bytes(m, ParallelConfig{1, 0}, e,
                                                                DType::f32, DType::f32, optimizer));
      if (!optimizer) {
        EXPECT_THROW(layer.optimizer_step(AdamWConfig{}), Error);
      }
    }
  }
}

TEST(Layer, RejectsBadTensorsAndConfigs) {
  auto be = make_cpu_backend(DType::f32);
  InProcessWorld world(1);
  MoeConfig m = small_moe();
  // The communicator's size must match ep_size (checked before anything collective).
  EXPECT_THROW(MoeLayer(*be, world.communicator(0), m, ParallelConfig{2, 0}, EchoConfig{}, 1),
               Error);
  MoeConfig bad = m;
  bad.top_k = 0;
  try {
    MoeLayer layer(*be, world.communicator(0), bad, ParallelConfig{1, 0}, EchoConfig{}, 1);
    FAIL() << "top_k = 0 accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.field(), "top_k");
  }
  MoeLayer layer(*be, world.communicator(0), m, ParallelConfig{1, 0}, EchoConfig{}, 1);
  std::vector<float> host(size_t(13 * 16), 0.5f);
  Tensor too_many(host.data(), DType::f32, {13, 16});  // max_tokens is 12
  std::vector<float> yh(size_t(13 * 16));
  Tensor y(yh.data(), DType::f32, {13, 16});
  EXPECT_THROW(layer.forward(too_many, y), Error);
  Tensor wrong_width(host.data(), DType::f32, {4, 15});
  EXPECT_THROW(layer.forward(wrong_width, y), Error);
  std::vector<double> dh(size_t(4 * 16));
  Tensor wrong_dtype(dh.data(), DType::f64, {4, 16});
  EXPECT_THROW(layer.forward(wrong_dtype, y), Error);
  // Each forward takes exactly one backward: its activations are spent by it.
  std::vector<float> xh(size_t(4 * 16), 0.25f), y4(size_t(4 * 16)), dyh(size_t(4 * 16), 0.5f),
      dxh(size_t(4 * 16));
  Tensor x4(xh.data(), DType::f32, {4, 16}), y4t(y4.data(), DType::f32, {4, 16}),
      dy4(dyh.data(), DType::f32, {4, 16}), dx4(dxh.data(), DType::f32, {4, 16});
  EXPECT_THROW(layer.backward(dy4, dx4), Error);  // no forward yet
  layer.forward(x4, y4t);
  EXPECT_NO_THROW(layer.backward(dy4, dx4));
  EXPECT_THROW(layer.backward(dy4, dx4), Error);  // its forward's backward already ran
}

// A communicator that learns a peer was lost (an NCCL communicator's PeerMonitor) is asked at
// every step's enqueue, so an eager step that relaunches a cached graph (calling no per-step op)
// still throws its error instead of running on a dead communicator.
class LosesAPeer final : public Communicator {
 public:
  explicit LosesAPeer(Communicator& inner) : inner_(inner) {}
  bool lost = false;
  int checks = 0;
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  bool capturable() const override { return inner_.capturable(); }
  void check_peers() override {
    ++checks;
    if (lost) throw Error("rank 1 (pid 4242) exited");
  }
  SymmetricBuffer alloc_symmetric(Backend& b, size_t bytes) override {
    return inner_.alloc_symmetric(b, bytes);
  }
  void free_symmetric(Backend& b, SymmetricBuffer& buf) override { inner_.free_symmetric(b, buf); }
  void barrier() override { inner_.barrier(); }
  void all_gather_i32(const int32_t* local, int32_t* all, int64_t n, Stream s) override {
    inner_.all_gather_i32(local, all, n, s);
  }
  void all_reduce_sum(const Tensor& t, Stream s) override { inner_.all_reduce_sum(t, s); }
  void dispatch(const RowRoute& route, RoundWindow window, const void* src, size_t row_bytes,
                const SymmetricBuffer& recv, const FanTable& fan, Stream s) override {
    inner_.dispatch(route, window, src, row_bytes, recv, fan, s);
  }
  void combine(const RowRoute& route, RoundWindow window, const SymmetricBuffer& red,
               const Tensor& y, const int32_t* accumulate, const FanTable& fan, void* values_out,
               Stream s) override {
    inner_.combine(route, window, red, y, accumulate, fan, values_out, s);
  }
  void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& home, void* spare, size_t slot_bytes,
                          Stream s) override {
    inner_.pull_clone_weights(plan, cfg, home, spare, slot_bytes, s);
  }
  void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& spare, void* home, int64_t slot_elems, DType dtype,
                          Stream s) override {
    inner_.reduce_clone_grads(plan, cfg, spare, home, slot_elems, dtype, s);
  }

 private:
  Communicator& inner_;
};

TEST(Layer, AStepThrowsOnceItsCommunicatorLostAPeer) {
  const MoeConfig m = small_moe(8, 2, 16);
  InProcessWorld world(1);
  world.run([&](int) {
    auto be = make_cpu_backend(DType::f64);
    LosesAPeer comm(world.communicator(0));
    MoeLayer layer(*be, comm, m, ParallelConfig{1, 0}, EchoConfig{}, 3);
    const int64_t T = 16, H = m.hidden;
    std::vector<void*> owned;
    auto tensor = [&](uint64_t seed) {
      Tensor t(nullptr, DType::f64, {T, H});
      t.data = be->allocate(t.bytes());
      owned.push_back(t.data);
      write_tensor(*be, t, random_values(size_t(t.numel()), seed));
      return t;
    };
    const Tensor x = tensor(1), y = tensor(2), dy = tensor(3), dx = tensor(4);
    layer.forward(x, y);
    layer.backward(dy, dx);
    EXPECT_GE(comm.checks, 2);  // the forward's and the backward's enqueues
    comm.lost = true;
    try {
      layer.forward(x, y);
      ADD_FAILURE() << "a step ran on a communicator that lost a peer";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("rank 1 (pid 4242) exited"), std::string::npos)
          << err.what();
    }
    for (void* p : owned) be->deallocate(p);
  });
}

}  // namespace
}  // namespace moe_echo::test
