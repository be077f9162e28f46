// Every validation rule: the error names the field, the value and what is allowed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <stdexcept>
#include <vector>

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
  expect_rejected(with([](MoeConfig& m) { m.capacity_factor = 0; }), "capacity_factor", "0");
  expect_rejected(with([](MoeConfig& m) { m.capacity_factor = -2; }), "capacity_factor", "-2");
  expect_rejected(with([](MoeConfig& m) { m.capacity_factor = std::nan(""); }), "capacity_factor",
                  "nan");
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
  expect_rejected(with([](EchoConfig& e) { e.max_clones_per_expert = -1; }),
                  "max_clones_per_expert", "-1");
  expect_rejected(with([](EchoConfig& e) { e.clone_cost_rows = -5; }), "clone_cost_rows", "-5");
}

TEST(Config, DerivedSizes) {
  MoeConfig m = good_moe();
  EchoConfig e;
  m.capacity_factor = 1.25;
  e.spare_slots_per_rank = 3;
  EXPECT_EQ(capacity_rows(m), 640);  // ceil(1.25 * 256 * 2)
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

// The Zipf exponent at its extremes: 0 and kMaxZipfExponent are skews; NaN, infinities, negative
// and larger exponents are refused by name, with what is allowed.
TEST(Config, SkewExponentExtremes) {
  EXPECT_EQ(parse_skew("zipf:0").exponent, 0.0);
  EXPECT_EQ(parse_skew("zipf:100").exponent, kMaxZipfExponent);
  EXPECT_EQ(parse_skew("zipf:1e-300").exponent, 1e-300);
  for (const char* s : {"zipf:nan", "zipf:inf", "zipf:-inf", "zipf:1e308", "zipf:1e6", "zipf:100.5",
                        "zipf:-1", "zipf:-0.5", "zipf:1e999", "zipf:1.2x"}) {
    SCOPED_TRACE(s);
    try {
      parse_skew(s);
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.field(), "skew");
      EXPECT_NE(std::string(e.what()).find(std::string("'") + s + "'"), std::string::npos);
      EXPECT_NE(std::string(e.what()).find("0 <= S <= 100"), std::string::npos) << e.what();
    }
  }
}

// At the steepest exponent the synthetic tokens stay finite (log-popularity in the log domain:
// exp(-100 ln 64) underflows, its log does not), the popularity sums to 1 with the hottest expert
// holding almost all of it, and the uniform skew is flat.
TEST(Synthetic, SteepestSkewGivesFiniteTokens) {
  const int E = 64, H = 64, T = 32;
  for (double s : {0.0, 1.2, 50.0, kMaxZipfExponent}) {
    SCOPED_TRACE(s);
    SkewSpec spec;
    spec.exponent = s;
    SyntheticTokens synth(E, H, spec, 7);
    for (int step : {0, 57}) {
      const std::vector<double> p = synth.popularity(step), logp = synth.log_popularity(step);
      double sum = 0, top = 0;
      for (int e = 0; e < E; ++e) {
        ASSERT_TRUE(std::isfinite(logp[size_t(e)])) << "expert " << e;
        ASSERT_LE(logp[size_t(e)], 0.0);
        sum += p[size_t(e)];
        top = std::max(top, p[size_t(e)]);
      }
      EXPECT_NEAR(sum, 1.0, 1e-12);
      if (s >= 50) {
        EXPECT_GT(top, 1.0 - 1e-12);
      }
      for (double v : synth.tokens(step, 1, T)) ASSERT_TRUE(std::isfinite(v));
    }
  }
}

// The clone cost at its extremes: 0 and 2^31-1 rows (no clone pays for itself) are costs; more,
// or a negative cost, is refused by name with the bound.
TEST(Config, CloneCostRowsBound) {
  const MoeConfig m = good_moe();
  const ParallelConfig par{4, 0};
  for (int64_t cost : {int64_t(0), int64_t(1), kMaxCloneCostRows}) {
    EchoConfig e;
    e.clone_cost_rows = cost;
    EXPECT_NO_THROW(validate(m, par, e)) << cost;
  }
  for (int64_t cost : {kMaxCloneCostRows + 1, std::numeric_limits<int64_t>::max(), int64_t(-1),
                       std::numeric_limits<int64_t>::min()}) {
    SCOPED_TRACE(cost);
    EchoConfig e;
    e.clone_cost_rows = cost;
    try {
      validate(m, par, e);
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& err) {
      EXPECT_EQ(err.field(), "clone_cost_rows");
      EXPECT_NE(std::string(err.what()).find("0 <= clone_cost_rows <= 2147483647"),
                std::string::npos)
          << err.what();
    }
  }
}

// The field lists (config_fields.hpp): each field's text round-trips, its default is the
// struct's, and a bad value of each field is refused by the field's name. A field added to a
// list fails FieldListsRefuseABadValueOfEveryFieldByName until kBadValues names a bad value of it.
TEST(ConfigFields, TextRoundTripsAndDefaultsAreTheStructs) {
  MoeConfig m = good_moe();
  m.score_function = ScoreFunction::sigmoid;
  m.aux_loss_coeff = 0.0123;
  m.bias_update = true;
  m.recompute = Recompute::experts;
  m.precision = Precision::fp8;
  m.fp8_gemms = fp8_gemm::fprop1 | fp8_gemm::wgrad2;
  m.capacity_factor = 1.0 / 3.0;
  MoeConfig copy;
  for (const ConfigField& f : moe_config_fields()) {
    SCOPED_TRACE(f.name);
    EXPECT_EQ(field_text(MoeConfig{}, f.name), f.default_text);
    set_field(copy, f.name, field_text(m, f.name), f.name);
    EXPECT_EQ(field_text(copy, f.name), field_text(m, f.name));
  }
  EXPECT_DOUBLE_EQ(copy.capacity_factor, 1.0 / 3.0);  // the shortest text that reads back exactly
  EXPECT_EQ(copy.fp8_gemms, fp8_gemm::fprop1 | fp8_gemm::wgrad2);
  EXPECT_EQ(field_text(m, "fp8_gemms"), "fprop1,wgrad2");
  EchoConfig e;
  e.placement = EchoPlacement::step;
  e.clone_cost_rows = int64_t(1) << 40;
  EchoConfig echo_copy;
  for (const ConfigField& f : echo_config_fields()) {
    SCOPED_TRACE(f.name);
    EXPECT_EQ(field_text(EchoConfig{}, f.name), f.default_text);
    set_field(echo_copy, f.name, field_text(e, f.name), f.name);
  }
  EXPECT_EQ(echo_copy.placement, EchoPlacement::step);
  EXPECT_EQ(echo_copy.clone_cost_rows, int64_t(1) << 40);
}

TEST(ConfigFields, EveryFieldIsDescribed) {
  for (const auto* list : {&moe_config_fields(), &echo_config_fields()})
    for (const ConfigField& f : *list) {
      SCOPED_TRACE(f.name);
      const std::string type = f.type;
      EXPECT_TRUE(type == "int" || type == "float" || type == "bool" || type == "str");
      EXPECT_FALSE(std::string(f.help).empty());
      EXPECT_FALSE(f.allowed.empty());
      for (const std::string& c : f.choices) EXPECT_NE(f.allowed.find(c), std::string::npos);
    }
  auto field = [](const char* name) {
    for (const ConfigField& f : moe_config_fields())
      if (std::string(f.name) == name) return f;
    throw std::runtime_error(std::string("no field ") + name);
  };
  EXPECT_EQ(field("chunks").allowed, "1 <= chunks <= 16");
  EXPECT_EQ(field("hidden").allowed, "hidden >= 1");
  EXPECT_EQ(field("aux_loss_coeff").allowed, "a finite value in [0, 1e6]");
  EXPECT_EQ(field("routed_scaling_factor").allowed, "a finite value in (0, 1e6]");
  EXPECT_EQ(field("capacity_factor").allowed, "a finite value > 0");
  EXPECT_EQ(field("overlap").allowed, "none or wgrad");
  EXPECT_EQ(field("overlap").choices, (std::vector<std::string>{"none", "wgrad"}));
  EXPECT_EQ(field("capacity_factor").default_text, "1.25");
  EXPECT_EQ(std::string(field("fp8_gemms").type), "str");
  EXPECT_TRUE(field("fp8_gemms").choices.empty());  // a list of names, not one of them
}

// Per field, a text that set_field or validate() refuses.
const std::map<std::string, std::string> kBadValues = {
    {"hidden", "0"},
    {"ffn", "-1"},
    {"experts", "0"},
    {"top_k", "0"},
    {"max_tokens", "99999999999"},
    {"score_function", "relu"},
    {"normalize_topk", "maybe"},
    {"aux_loss_coeff", "2e6"},
    {"z_loss_coeff", "nan"},
    {"bias_update", "yes"},
    {"bias_update_rate", "-1"},
    {"expert_groups", "3"},
    {"topk_groups", "0"},
    {"group_score", "mean"},
    {"routed_scaling_factor", "0"},
    {"seq_aux_loss_coeff", "-0.5"},
    {"seq_len", "-2"},
    {"shared_experts", "-1"},
    {"shared_ffn", "-4"},
    {"shared_side_stream", "true"},  // without shared experts
    {"recompute", "swiglu"},
    {"overlap", "chunks"},
    {"overlap_sms", "5000"},
    {"chunks", "0"},
    {"in_flight", "17"},
    {"master_weights", "2"},
    {"precision", "fp16"},
    {"fp8_gemms", "fprop3"},
    {"capacity_factor", "0"},
    // EchoConfig
    {"enabled", "maybe"},
    {"spare_slots_per_rank", "-1"},
    {"max_clones_per_expert", "-1"},
    {"clone_cost_rows", "-5"},
    {"placement", "once"},
};

TEST(ConfigFields, FieldListsRefuseABadValueOfEveryFieldByName) {
  auto refused = [](const std::string& name, const std::function<void()>& apply) {
    try {
      apply();
      ADD_FAILURE() << name << " = '" << kBadValues.at(name) << "' is accepted";
    } catch (const ConfigError& err) {
      EXPECT_EQ(err.field(), name) << err.what();
      EXPECT_NE(std::string(err.what()).find(name + " = "), std::string::npos) << err.what();
    }
  };
  size_t listed = 0;
  for (const ConfigField& f : moe_config_fields()) {
    ++listed;
    ASSERT_TRUE(kBadValues.count(f.name)) << "kBadValues has no bad value of field " << f.name;
    refused(f.name, [&] {
      MoeConfig m = good_moe();
      set_field(m, f.name, kBadValues.at(f.name), f.name);
      validate(m, ParallelConfig{4, 0}, EchoConfig{});
    });
  }
  for (const ConfigField& f : echo_config_fields()) {
    ++listed;
    ASSERT_TRUE(kBadValues.count(f.name)) << "kBadValues has no bad value of field " << f.name;
    refused(f.name, [&] {
      EchoConfig e;
      set_field(e, f.name, kBadValues.at(f.name), f.name);
      validate(good_moe(), ParallelConfig{4, 0}, e);
    });
  }
  EXPECT_EQ(listed, kBadValues.size()) << "kBadValues names a field that no list has";
}

TEST(ConfigFields, AFieldOfAnotherNameIsRefused) {
  MoeConfig m;
  try {
    set_field(m, "capacity", "1.5", "capacity");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.field(), "field");
    EXPECT_NE(std::string(e.what()).find("capacity_factor"), std::string::npos) << e.what();
  }
  // capacity_factor is MoeConfig's, with ECHO on or off.
  EXPECT_THROW(field_text(EchoConfig{}, "capacity_factor"), ConfigError);
  EXPECT_EQ(field_text(MoeConfig{}, "capacity_factor"), "1.25");
}

}  // namespace
}  // namespace moe_echo
