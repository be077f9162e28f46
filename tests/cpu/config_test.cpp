// Every validation rule: the error names the field, the value and what is allowed.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "moe_echo/config.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/planner.hpp"
#include "moe_echo/synthetic.hpp"

namespace moe_echo {
namespace {

MoeConfig good_moe() {
  MoeConfig m;
  m.hidden = 64;
  m.ffn = 128;
  m.experts = 16;
  m.top_k = 2;
  m.max_tokens = 256;
  return m;
}

void expect_rejected(const std::function<void()>& f, const std::string& field,
                     const std::string& value) {
  try {
    f();
    FAIL() << "no error for " << field;
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.field(), field);
    const std::string msg = e.what();
    EXPECT_NE(msg.find(field + " = " + value), std::string::npos) << msg;
    EXPECT_NE(msg.find("allowed"), std::string::npos) << msg;
  }
}

TEST(Config, DefaultsOfAGoodConfigPass) {
  EXPECT_NO_THROW(validate(good_moe(), ParallelConfig{4, 3}, EchoConfig{}));
}

// Group-limited routing, routed scaling and the sequence aux loss.
TEST(Config, RoutingRules) {
  auto with = [](auto edit) {
    return [edit] {
      MoeConfig m = good_moe();  // 16 experts, top-2
      edit(m);
      validate(m);
    };
  };
  expect_rejected(with([](MoeConfig& m) { m.expert_groups = 0; }), "expert_groups", "0");
  expect_rejected(with([](MoeConfig& m) { m.expert_groups = 3; }), "expert_groups", "3");
  expect_rejected(with([](MoeConfig& m) {
                    m.experts = 128;
                    m.expert_groups = 64;
                  }),
                  "expert_groups", "64");
  expect_rejected(with([](MoeConfig& m) {
                    m.expert_groups = 4;
                    m.topk_groups = 5;
                  }),
                  "topk_groups", "5");
  expect_rejected(with([](MoeConfig& m) { m.topk_groups = 0; }), "topk_groups", "0");
  // Top-2 inside one group of 1 expert: fewer experts than top_k to pick from.
  expect_rejected(with([](MoeConfig& m) {
                    m.expert_groups = 16;
                    m.group_score = GroupScore::max;
                  }),
                  "top_k", "2");
  expect_rejected(with([](MoeConfig& m) {
                    m.expert_groups = 16;
                    m.topk_groups = 4;
                  }),
                  "group_score", "top2_sum");
  expect_rejected(with([](MoeConfig& m) { m.routed_scaling_factor = 0; }), "routed_scaling_factor",
                  "0");
  expect_rejected(with([](MoeConfig& m) { m.seq_aux_loss_coeff = -1; }), "seq_aux_loss_coeff",
                  "-1");
  expect_rejected(with([](MoeConfig& m) { m.seq_aux_loss_coeff = 0.1; }), "seq_len", "0");
  expect_rejected(with([](MoeConfig& m) { m.seq_len = -2; }), "seq_len", "-2");
  expect_rejected(with([](MoeConfig& m) { m.shared_experts = -1; }), "shared_experts", "-1");
  expect_rejected(with([](MoeConfig& m) { m.shared_ffn = -4; }), "shared_ffn", "-4");
  expect_rejected(with([](MoeConfig& m) { m.shared_side_stream = true; }), "shared_side_stream",
                  "true");
  expect_rejected(with([](MoeConfig& m) { m.overlap_sms = -1; }), "overlap_sms", "-1");
  expect_rejected(with([](MoeConfig& m) { m.overlap_sms = 5000; }), "overlap_sms", "5000");
  expect_rejected(with([](MoeConfig& m) { m.overlap = Overlap(7); }), "overlap", "7");
  // fc1's weight gradient unquantized after an FP8 dispatch reads recv_red, which the combine
  // sends: not beside it.
  expect_rejected(with([](MoeConfig& m) {
                    m.overlap = Overlap::wgrad;
                    m.precision = Precision::fp8;
                    m.hidden = m.ffn = 32;
                    m.fp8_gemms = fp8_gemm::fprop1;
                  }),
                  "overlap", "'wgrad'");
  expect_rejected(with([](MoeConfig& m) { m.chunks = 0; }), "chunks", "0");
  expect_rejected(with([](MoeConfig& m) { m.chunks = kMaxChunks + 1; }), "chunks",
                  std::to_string(kMaxChunks + 1));
  // The FP8 dispatch lands its e4m3 rows in recv_red, which the chunks' combines read.
  expect_rejected(with([](MoeConfig& m) {
                    m.chunks = 2;
                    m.precision = Precision::fp8;
                    m.hidden = m.ffn = 32;
                  }),
                  "chunks", "2");
  EXPECT_EQ(parse_overlap("wgrad"), Overlap::wgrad);
  EXPECT_EQ(parse_overlap("none"), Overlap::none);
  EXPECT_THROW(parse_overlap("chunks"), ConfigError);
  EXPECT_EQ(parse_group_score("max"), GroupScore::max);
  EXPECT_EQ(parse_group_score("top2_sum"), GroupScore::top2_sum);
  expect_rejected([] { parse_group_score("sum"); }, "group_score", "'sum'");
  EXPECT_NO_THROW(with([](MoeConfig& m) {
    m.expert_groups = 8;
    m.topk_groups = 1;
    m.routed_scaling_factor = 2.5;
    m.seq_aux_loss_coeff = 1e-4;
    m.seq_len = 64;
  })());
}

TEST(Config, MoeFields) {
  auto with = [](auto edit) {
    return [edit] {
      MoeConfig m = good_moe();
      edit(m);
      validate(m);
    };
  };
  expect_rejected(with([](MoeConfig& m) { m.hidden = 0; }), "hidden", "0");
  expect_rejected(with([](MoeConfig& m) { m.hidden = -3; }), "hidden", "-3");
  expect_rejected(with([](MoeConfig& m) { m.ffn = 0; }), "ffn", "0");
  expect_rejected(with([](MoeConfig& m) { m.experts = 0; }), "experts", "0");
  expect_rejected(with([](MoeConfig& m) { m.top_k = 0; }), "top_k", "0");
  expect_rejected(with([](MoeConfig& m) { m.top_k = 17; }), "top_k", "17");
  // More experts than kMaxTopK: the top_k limit of one warp per token applies on its own.
  expect_rejected(with([](MoeConfig& m) {
                    m.experts = 64;
                    m.top_k = kMaxTopK + 1;
                  }),
                  "top_k", std::to_string(kMaxTopK + 1));
  EXPECT_NO_THROW(with([](MoeConfig& m) {
    m.experts = 64;
    m.top_k = kMaxTopK;
  })());
  expect_rejected(with([](MoeConfig& m) { m.max_tokens = 0; }), "max_tokens", "0");
  expect_rejected(with([](MoeConfig& m) {
                    m.max_tokens = 1 << 30;
                    m.top_k = 8;
                  }),
                  "max_tokens", std::to_string(1 << 30));
  expect_rejected(with([](MoeConfig& m) { m.aux_loss_coeff = -1; }), "aux_loss_coeff", "-1");
  expect_rejected(
      with([](MoeConfig& m) { m.z_loss_coeff = std::numeric_limits<double>::infinity(); }),
      "z_loss_coeff", "inf");
  expect_rejected(with([](MoeConfig& m) { m.bias_update_rate = -0.5; }), "bias_update_rate",
                  "-0.5");
}

TEST(Config, TopKMessageNamesTheBound) {
  MoeConfig m = good_moe();
  m.top_k = 0;
  try {
    validate(m);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "top_k = 0 is invalid: allowed 1 <= top_k <= experts (16)");
  }
}

TEST(Config, ParallelFields) {
  const MoeConfig m = good_moe();
  expect_rejected([&] { validate(ParallelConfig{0, 0}, m); }, "ep_size", "0");
  expect_rejected([&] { validate(ParallelConfig{4, 4}, m); }, "ep_rank", "4");
  expect_rejected([&] { validate(ParallelConfig{4, -1}, m); }, "ep_rank", "-1");
  expect_rejected([&] { validate(ParallelConfig{3, 0}, m); }, "experts", "16");
  MoeConfig big = m;
  big.max_tokens = 1 << 26;
  big.top_k = 8;
  big.experts = 1024;
  expect_rejected([&] { validate(ParallelConfig{1024, 0}, big); }, "ep_size", "1024");
}

TEST(Config, EchoFields) {
  const ParallelConfig p{4, 0};
  auto with = [&](auto edit) {
    return [edit, p] {
      EchoConfig e;
      edit(e);
      validate(e, p);
    };
  };
  expect_rejected(with([](EchoConfig& e) { e.spare_slots_per_rank = -1; }), "spare_slots_per_rank",
                  "-1");
  expect_rejected(with([](EchoConfig& e) { e.capacity_factor = 0; }), "capacity_factor", "0");
  expect_rejected(with([](EchoConfig& e) { e.capacity_factor = -2; }), "capacity_factor", "-2");
  expect_rejected(with([](EchoConfig& e) { e.capacity_factor = std::nan(""); }), "capacity_factor",
                  "nan");
  expect_rejected(with([](EchoConfig& e) { e.max_clones_per_expert = -1; }),
                  "max_clones_per_expert", "-1");
  expect_rejected(with([](EchoConfig& e) { e.clone_cost_rows = -5; }), "clone_cost_rows", "-5");
}

TEST(Config, DerivedSizes) {
  MoeConfig m = good_moe();
  EchoConfig e;
  e.capacity_factor = 1.25;
  e.spare_slots_per_rank = 3;
  EXPECT_EQ(capacity_rows(m, e), 640);  // ceil(1.25 * 256 * 2)
  EXPECT_EQ(slots_per_rank(m, ParallelConfig{4, 0}, e), 7);
  e.enabled = false;
  EXPECT_EQ(slots_per_rank(m, ParallelConfig{4, 0}, e), 4);
  EXPECT_EQ(max_rounds(m, ParallelConfig{4, 0}, e), 4);  // 2048 rows / 640 per round
}

TEST(Config, PlannerConfigFollowsEcho) {
  MoeConfig m;
  m.experts = 16;
  EchoConfig e;
  e.spare_slots_per_rank = 3;
  e.max_clones_per_expert = 2;
  e.clone_cost_rows = 77;
  const PlannerConfig on = planner_config(m, ParallelConfig{4, 1}, e);
  EXPECT_EQ(on.ranks, 4);
  EXPECT_EQ(on.experts, 16);
  EXPECT_EQ(on.spare_slots, 3);
  EXPECT_EQ(on.max_clones, 2);
  EXPECT_EQ(on.clone_cost_rows, 77);
  e.enabled = false;
  const PlannerConfig off = planner_config(m, ParallelConfig{4, 1}, e);
  EXPECT_EQ(off.spare_slots, 0);
  EXPECT_EQ(off.max_clones, 0);
}

TEST(Config, ScoreFunctionAndSkewParsing) {
  EXPECT_EQ(parse_score_function("sigmoid"), ScoreFunction::sigmoid);
  expect_rejected([] { parse_score_function("relu", "score"); }, "score", "'relu'");
  EXPECT_DOUBLE_EQ(parse_skew("zipf:1.2").exponent, 1.2);
  EXPECT_EQ(parse_skew("uniform").exponent, 0.0);
  expect_rejected([] { parse_skew("zipf:-1"); }, "skew", "'zipf:-1'");
  expect_rejected([] { parse_skew("zipf:"); }, "skew", "'zipf:'");
  expect_rejected([] { parse_skew("pareto"); }, "skew", "'pareto'");
}

}  // namespace
}  // namespace moe_echo
