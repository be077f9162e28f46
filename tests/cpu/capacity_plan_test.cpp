// `moe-echo plan`: every validation rule (errors name the parameter, its value and what is
// allowed; warnings name the parameter), the memory and time formulas against hand computation,
// the memory against what a built MoeStack allocates, which wall binds, and the simulator's
// suggestion of spare slots and capacity factor.
#include "moe_echo/capacity_plan.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "moe_echo/backends.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/layer.hpp"
#include "moe_echo/random.hpp"
#include "test_util.hpp"

namespace moe_echo::offline {
namespace {

// A small valid input: 8 GPUs of one node, EP 8, Qwen3-like sizes.
WallsInput base() {
  WallsInput in;
  in.model = model_preset("qwen3-30b-a3b");
  in.model.seq_len = 4096;
  in.layout.ep = 8;
  in.gpu = gpu_preset("h200");
  return in;
}

const Finding* find(const std::vector<Finding>& f, const std::string& field, Severity s) {
  for (const Finding& x : f)
    if (x.field == field && x.severity == s) return &x;
  return nullptr;
}

struct Rule {
  std::string name;
  std::function<void(WallsInput&)> mutate;
  std::string field;
  std::string message;  // a substring of the message
};

TEST(WallsValidation, BaseInputIsClean) {
  EXPECT_TRUE(check(base()).empty());
  EXPECT_NO_THROW(validate(base()));
}

TEST(WallsValidation, EveryErrorRuleNamesTheParameterItsValueAndWhatIsAllowed) {
  const std::vector<Rule> rules = {
      {"hidden", [](WallsInput& i) { i.model.hidden = 0; }, "hidden",
       "hidden = 0 is invalid: allowed hidden >= 1"},
      {"ffn", [](WallsInput& i) { i.model.ffn = -2; }, "ffn",
       "ffn = -2 is invalid: allowed ffn >= 1"},
      {"experts", [](WallsInput& i) { i.model.experts = 0; }, "experts", "experts = 0 is invalid"},
      {"layers", [](WallsInput& i) { i.model.layers = 0; }, "layers", "layers = 0 is invalid"},
      {"seq_len", [](WallsInput& i) { i.model.seq_len = 0; }, "seq_len", "seq_len = 0 is invalid"},
      {"micro_batch", [](WallsInput& i) { i.model.micro_batch = 0; }, "micro_batch",
       "micro_batch = 0 is invalid"},
      {"ep", [](WallsInput& i) { i.layout.ep = 0; }, "ep", "ep = 0 is invalid: allowed ep >= 1"},
      {"etp", [](WallsInput& i) { i.layout.etp = 0; }, "etp", "etp = 0 is invalid"},
      {"dp", [](WallsInput& i) { i.layout.dp = 0; }, "dp", "dp = 0 is invalid"},
      {"pp", [](WallsInput& i) { i.layout.pp = 0; }, "pp", "pp = 0 is invalid"},
      {"vpp", [](WallsInput& i) { i.layout.vpp = 0; }, "vpp", "vpp = 0 is invalid"},
      {"kernels", [](WallsInput& i) { i.train.kernels_per_layer = 0; }, "kernels_per_layer",
       "kernels_per_layer = 0 is invalid"},
      {"top_k", [](WallsInput& i) { i.model.top_k = 129; }, "top_k",
       "top_k = 129 is invalid: allowed 1 <= top_k <= experts (128)"},
      {"dtype", [](WallsInput& i) { i.model.dtype = "fp8"; }, "dtype",
       "dtype = 'fp8' is invalid: allowed bf16, fp16 or fp32"},
      {"grad_dtype", [](WallsInput& i) { i.train.grad_dtype = "fp16"; }, "grad_dtype",
       "grad_dtype = 'fp16' is invalid: allowed fp32 (the MoE layers accumulate gradients in "
       "fp32"},
      {"grad_dtype bf16", [](WallsInput& i) { i.train.grad_dtype = "bf16"; }, "grad_dtype",
       "grad_dtype = 'bf16' is invalid: allowed fp32"},
      {"recompute", [](WallsInput& i) { i.train.recompute = "all"; }, "recompute",
       "recompute = 'all' is invalid: allowed none, moe_act, experts, dispatch or all_but_fc1"},
      {"recompute's old name", [](WallsInput& i) { i.train.recompute = "swiglu"; }, "recompute",
       "recompute = 'swiglu' is invalid: allowed none, moe_act, experts, dispatch or all_but_fc1"},
      {"the library's layer", [](WallsInput& i) { i.model.top_k = 33; }, "top_k",
       "top_k = 33 is invalid: allowed top_k <= 32 (a token's entries are handled by one warp) "
       "(the MoE layer of one GPU"},
      {"capacity_factor", [](WallsInput& i) { i.train.capacity_factor = 0; }, "capacity_factor",
       "capacity_factor = 0 is invalid: allowed a finite value > 0"},
      {"spare_slots", [](WallsInput& i) { i.train.spare_slots = -1; }, "spare_slots",
       "spare_slots = -1 is invalid"},
      {"max_clones", [](WallsInput& i) { i.train.max_clones = -1; }, "max_clones",
       "max_clones = -1 is invalid"},
      {"reserve_gb", [](WallsInput& i) { i.train.reserve_gb = -1; }, "reserve_gb",
       "reserve_gb = -1 is invalid"},
      {"experts % ep", [](WallsInput& i) { i.layout.ep = 6; }, "experts",
       "experts = 128 is invalid: allowed a multiple of ep (6)"},
      {"ffn % etp", [](WallsInput& i) { i.layout.etp = 5; }, "etp",
       "etp = 5 is invalid: allowed a divisor of ffn (768)"},
      {"layers % pp", [](WallsInput& i) { i.layout.pp = 5; }, "pp",
       "pp = 5 is invalid: allowed a divisor of layers (48)"},
      {"vpp needs pp", [](WallsInput& i) { i.layout.vpp = 2; }, "vpp",
       "vpp = 2 is invalid: allowed vpp = 1 when pp = 1"},
      {"vpp divides stage",
       [](WallsInput& i) {
         i.layout.pp = 4;
         i.layout.vpp = 5;
       },
       "vpp", "vpp = 5 is invalid: allowed a divisor of the layers per pipeline stage (12)"},
      {"comm_overlap needs ep > 1",
       [](WallsInput& i) {
         i.layout.ep = 1;
         i.train.comm_overlap = true;
       },
       "comm_overlap", "comm_overlap = true is invalid: allowed only with ep > 1"},
      {"comm_overlap needs 16-bit",
       [](WallsInput& i) {
         i.model.dtype = "fp32";
         i.train.comm_overlap = true;
       },
       "dtype", "dtype = fp32 is invalid: allowed bf16 or fp16 with comm_overlap"},
      {"comm_overlap with pp needs vpp",
       [](WallsInput& i) {
         i.layout.pp = 4;
         i.train.comm_overlap = true;
       },
       "vpp", "vpp = 1 is invalid: allowed vpp >= 2 with comm_overlap and pp = 4"},
      {"overlap is the layer's", [](WallsInput& i) { i.train.overlap = "on"; }, "overlap",
       "overlap = 'on' is invalid: allowed none or wgrad"},
      {"overlap wgrad beside an FP8 dispatch needs an FP8 fc1 weight gradient",
       [](WallsInput& i) {
         i.train.overlap = "wgrad";
         i.train.precision = "fp8";
         i.train.fp8_gemms = "fprop1";
       },
       "overlap", "overlap = 'wgrad' is invalid: allowed 'none' when fc1's forward is FP8"},
      {"rows fit int32", [](WallsInput& i) { i.model.micro_batch = 100000; }, "micro_batch",
       "micro_batch = 100000 is invalid: allowed seq_len * micro_batch * top_k * etp <= 2^31-1"},
      {"rows past int64",
       [](WallsInput& i) {
         i.model.seq_len = std::numeric_limits<int>::max();
         i.model.micro_batch = std::numeric_limits<int>::max();
       },
       "micro_batch", "allowed seq_len * micro_batch * top_k * etp <= 2^31-1"},
      {"world size fits int32",
       [](WallsInput& i) { i.layout.dp = std::numeric_limits<int>::max(); }, "dp",
       "allowed etp * ep * dp * pp <= 2^31-1"},
      {"capacity fits int32",
       [](WallsInput& i) {
         i.model.micro_batch = 60000;
         i.train.capacity_factor = 2;
       },
       "capacity_factor", "capacity_factor = 2 is invalid: allowed capacity_factor * seq_len"},
      {"gpu constants", [](WallsInput& i) { i.gpu.network_gbps = 0; }, "network_gbps",
       "network_gbps = 0 is invalid: allowed a finite value > 0"},
      {"gpus per node", [](WallsInput& i) { i.gpu.gpus_per_node = 0; }, "gpus_per_node",
       "gpus_per_node = 0 is invalid"},
      {"across nodes", [](WallsInput& i) { i.train.across_nodes = "tree"; }, "across_nodes",
       "across_nodes = 'tree' is invalid: allowed flat or hierarchical"},
      {"hierarchical nodes hold equal shares",
       [](WallsInput& i) {
         i.model.experts = 96;
         i.layout.ep = 12;
         i.train.across_nodes = "hierarchical";
       },
       "across_nodes",
       "across_nodes = 'hierarchical' is invalid: allowed flat when ep (12) is not a multiple of "
       "the EP ranks of a node (8)"},
  };
  for (const Rule& r : rules) {
    WallsInput in = base();
    r.mutate(in);
    const std::vector<Finding> f = check(in);
    const Finding* hit = find(f, r.field, Severity::error);
    ASSERT_NE(hit, nullptr) << r.name << ": no error for " << r.field;
    EXPECT_NE(hit->message.find(r.message), std::string::npos)
        << r.name << "\ngot:  " << hit->message << "\nwant: " << r.message;
    try {
      validate(in);
      ADD_FAILURE() << r.name << ": validate did not throw";
    } catch (const ConfigError& e) {
      EXPECT_FALSE(e.field().empty()) << r.name;
    }
  }
}

TEST(WallsValidation, EveryWarningRuleNamesTheParameter) {
  const std::vector<Rule> rules = {
      {"spare slots with ep 1", [](WallsInput& i) { i.layout.ep = 1; }, "spare_slots",
       "spare_slots = 1 has no effect with ep = 1"},
      {"spare slots without clones", [](WallsInput& i) { i.train.max_clones = 0; }, "max_clones",
       "max_clones = 0 leaves the 1 spare slot(s) empty"},
      {"etp beyond the node", [](WallsInput& i) { i.layout.etp = 16; }, "etp",
       "etp = 16 does not fit the 8-GPU NVLink domain"},
      {"ep spans nodes", [](WallsInput& i) { i.layout.ep = 32; }, "ep",
       "ep * etp = 32 GPUs spans 4 nodes: 75% of dispatch/combine traffic crosses the network"},
      {"few rows per expert", [](WallsInput& i) { i.model.seq_len = 128; }, "micro_batch",
       "rows per local expert per micro-batch"},
      {"comm_overlap without graphs",
       [](WallsInput& i) {
         i.train.comm_overlap = true;
         i.train.cuda_graphs = false;
       },
       "cuda_graphs", "comm_overlap without CUDA graphs"},
  };
  for (const Rule& r : rules) {
    WallsInput in = base();
    r.mutate(in);
    const std::vector<Finding> f = check(in);
    const Finding* hit = find(f, r.field, Severity::warning);
    ASSERT_NE(hit, nullptr) << r.name;
    EXPECT_NE(hit->message.find(r.message), std::string::npos)
        << r.name << "\ngot:  " << hit->message << "\nwant: " << r.message;
    EXPECT_NO_THROW(validate(in)) << r.name << ": a warning must not stop the run";
  }
}

TEST(WallsValidation, CapacityFactorBelowThePlannedImbalanceSpills) {
  WallsInput in = base();
  Imbalance imb;
  imb.mean = 1.3;
  imb.p99 = 1.6;
  imb.source = "test";
  in.train.capacity_factor = 1.25;  // below the mean: every step
  imb.spill_fraction = 0.7;
  auto f = check_capacity(in, imb);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].field, "capacity_factor");
  EXPECT_EQ(f[0].severity, Severity::warning);
  EXPECT_NE(f[0].message.find("capacity_factor = 1.25 is below the planned imbalance"),
            std::string::npos)
      << f[0].message;
  EXPECT_NE(f[0].message.find("spills every step"), std::string::npos);
  EXPECT_NE(f[0].message.find("capacity_factor >= 1.60"), std::string::npos) << f[0].message;
  in.train.capacity_factor = 1.4;  // between mean and p99: a share of steps
  imb.spill_fraction = 0.123;
  f = check_capacity(in, imb);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_NE(f[0].message.find("spills on 12.3% of layer-steps"), std::string::npos) << f[0].message;
  in.train.capacity_factor = 1.6;  // at the p99: fine
  imb.spill_fraction = 0.01;
  EXPECT_TRUE(check_capacity(in, imb).empty());
  // the estimate carries it into its findings
  in.train.capacity_factor = 1.0;
  imb.spill_fraction = 1.0;
  const WallsReport r = estimate_walls(in, imb);
  EXPECT_NE(find(r.findings, "capacity_factor", Severity::warning), nullptr);
}

TEST(WallsModel, Presets) {
  const ModelSpec d = model_preset("DeepSeek-V3");
  EXPECT_EQ(d.hidden, 7168);
  EXPECT_EQ(d.ffn, 2048);
  EXPECT_EQ(d.experts, 256);
  EXPECT_EQ(d.top_k, 8);
  EXPECT_EQ(d.layers, 58);
  const ModelSpec m = model_preset("mixtral-8x7b");
  EXPECT_EQ(m.experts, 8);
  EXPECT_EQ(m.top_k, 2);
  try {
    model_preset("gpt-5");
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.field(), "model");
    EXPECT_NE(
        std::string(e.what()).find(
            "model = 'gpt-5' is invalid: allowed deepseek-v3, qwen3-30b-a3b, qwen3-235b-a22b or "
            "mixtral-8x7b"),
        std::string::npos);
  }
}

TEST(WallsModel, MemoryMatchesHandComputation) {
  WallsInput in = base();  // H 2048, F 768, E 128, K 8, 48 layers, EP 8, no shared experts
  in.layout.dp = 4;
  in.layout.pp = 4;
  in.layout.vpp = 2;
  in.train.spare_slots = 2;
  Imbalance imb;
  const WallsReport r = estimate_walls(in, imb);
  const double H = 2048, F = 768, E = 128, K = 8, T = 4096;
  const double P = 3.0 * H * F, local = 16, Lp = 12;
  const double inflight = 4 * (1 + 3.0 / 8);  // interleaved 1F1B on the first stage
  const MemoryBreakdown& m = r.memory;
  EXPECT_EQ(r.layers_per_stage, 12);
  EXPECT_EQ(r.world_size, 8 * 4 * 4);
  EXPECT_DOUBLE_EQ(m.microbatches_in_flight, inflight);
  // Parameters: home experts (bf16), router weight and bias (fp32); fp32 gradients; AdamW m and
  // v in fp32 and the step count, sharded over dp.
  EXPECT_NEAR(m.weights_gb, Lp * (local * P * 2 + E * H * 4 + E * 4) / 1e9, 1e-12);
  EXPECT_NEAR(m.grads_gb, Lp * (local * P + E * H) * 4 / 1e9, 1e-12);
  EXPECT_NEAR(m.optimizer_gb, Lp * ((local * P + E * H) * 8 + 4) / 4 / 1e9, 1e-12);
  // One pool of echo slots per GPU and workspace set, whatever the layers: two sets, as more than
  // one micro-batch is in flight.
  EXPECT_NEAR(m.spare_weights_gb, 2 * 2 * P * 2 / 1e9, 1e-12);
  EXPECT_NEAR(m.spare_grads_gb, 2 * 2 * P * 4 / 1e9, 1e-12);
  const double cap = std::ceil(1.25 * T * K);
  EXPECT_EQ(r.layer.capacity_rows, int64_t(cap));
  // Kept with recompute none: received rows, fc1 and SwiGLU outputs, expert outputs; per layer
  // and micro-batch in flight, with the routing.
  const MoeMemory& lib = m.library;
  EXPECT_NEAR(double(lib.activations), Lp * cap * (2 * H + 3 * F) * 2, 1e-3);
  EXPECT_NEAR(m.activations_gb, inflight * double(lib.activations + lib.routing) / 1e9, 1e-9);
  EXPECT_GE(double(lib.routing), Lp * (T * E * 4 * 2 + T * K * 4 * 2));  // logits, scores, top-k
  // The workspace: rows read back (H), SwiGLU gradients (3 F), the fan table (K i32 members, K
  // fp32 weights, one fp32 value per row), in two sets; each layer's combine-weight gradients
  // [T, K] fp32 per micro-batch in flight.
  EXPECT_NEAR(double(lib.workspace), cap * (H + 3 * F) * 2 + cap * (8 * K + 4), 1e-3);
  EXPECT_NEAR(double(lib.temporaries), Lp * T * K * 4, 1e-3);
  EXPECT_NEAR(m.buffers_gb, (2 * double(lib.workspace) + inflight * double(lib.temporaries)) / 1e9,
              1e-12);
  const double sum = m.weights_gb + m.grads_gb + m.optimizer_gb + m.spare_weights_gb +
                     m.spare_grads_gb + m.activations_gb + m.buffers_gb;
  EXPECT_NEAR(m.moe_gb, sum, 1e-9);
  EXPECT_NEAR(m.total_gb, m.moe_gb + m.reserve_gb, 1e-9);
  // A recompute option drops buffers from every layer and micro-batch in flight and holds one
  // copy in each of the workspace's two sets: moe_act SwiGLU's output (F), experts also fc1's
  // output and the expert outputs (3 F + H), dispatch also the received rows (3 F + 2 H), and
  // all_but_fc1 all of them but fc1's output (F + 2 H).
  const double copies = Lp * inflight - 2;
  EXPECT_NEAR(m.recompute_moe_act_saves_gb, copies * cap * F * 2 / 1e9, 1e-9);
  EXPECT_NEAR(m.recompute_experts_saves_gb, copies * cap * (3 * F + H) * 2 / 1e9, 1e-9);
  EXPECT_NEAR(m.recompute_dispatch_saves_gb, copies * cap * (3 * F + 2 * H) * 2 / 1e9, 1e-9);
  EXPECT_NEAR(m.recompute_all_but_fc1_saves_gb, copies * cap * (F + 2 * H) * 2 / 1e9, 1e-9);
  // recompute applies its saving; no distributed optimizer keeps the whole state
  in.train.recompute = "experts";
  in.train.distributed_optimizer = false;
  const WallsReport r2 = estimate_walls(in, imb);
  EXPECT_NEAR(r2.memory.activations_gb,
              m.activations_gb - Lp * inflight * cap * (3 * F + H) * 2 / 1e9, 1e-9);
  EXPECT_NEAR(r2.memory.moe_gb - r2.memory.optimizer_gb,
              m.moe_gb - m.optimizer_gb - m.recompute_experts_saves_gb, 1e-9);
  EXPECT_NEAR(r2.memory.optimizer_gb, 4 * m.optimizer_gb, 1e-9);
}

// The plan's MoE memory is the library's: for one GPU of a layout without pipelining or data
// parallelism (one micro-batch in flight, optimizer state whole), what a MoeStack of the stage's
// layers allocates. Built on the CPU backend (f32: --dtype fp32), counted for bf16.
TEST(WallsModel, MoeMemoryIsWhatABuiltStackAllocates) {
  WallsInput in;
  in.model.name = "small";
  in.model.hidden = 64;
  in.model.ffn = 48;
  in.model.experts = 8;
  in.model.top_k = 2;
  in.model.layers = 3;
  in.model.expert_groups = in.model.topk_groups = 1;
  in.model.shared_experts = 1;
  in.model.seq_len = 40;
  in.model.dtype = "fp32";
  in.layout.ep = 2;
  in.train.spare_slots = 2;
  in.gpu = gpu_preset("h200");
  for (const char* recompute : {"none", "moe_act", "experts", "dispatch", "all_but_fc1"}) {
    SCOPED_TRACE(recompute);
    in.train.recompute = recompute;
    in.model.dtype = "fp32";
    const WallsReport r = estimate_walls(in, Imbalance{});
    const StageLayers stage = stage_layers(in);
    ASSERT_EQ(stage.layers.size(), 3u);
    EXPECT_EQ(stage.layers[0].ffn, 48);
    EXPECT_EQ(stage.layers[0].max_tokens, 40);
    EXPECT_EQ(to_string(stage.layers[0].recompute), std::string(recompute));
    EXPECT_EQ(stage.activation, DType::f32);
    InProcessWorld world(2);
    std::vector<size_t> built(2);
    world.run([&](int rank) {
      auto be = make_cpu_backend(DType::f32);
      const ParallelConfig par{2, rank};
      MoeStack stack(*be, world.communicator(rank), stage.layers, par, stage.echo);
      built[size_t(rank)] = stack.bytes();
    });
    EXPECT_EQ(built[0], built[1]);
    EXPECT_EQ(r.memory.library.total(), built[0]);
    EXPECT_NEAR(r.memory.moe_gb * 1e9, double(built[0]), 0.02 * double(built[0]));
    EXPECT_NEAR(r.memory.moe_gb * 1e9, double(built[0]), 1e-3) << "the same count";
    // bf16 weights and activations, fp32 gradients and optimizer state: the CUDA backend's.
    in.model.dtype = "bf16";
    const WallsReport b = estimate_walls(in, Imbalance{});
    const StageLayers s16 = stage_layers(in);
    EXPECT_EQ(s16.activation, DType::bf16);
    const size_t want =
        MoeStack::memory_bytes(s16.layers, s16.par, s16.echo, DType::bf16, DType::f32);
    EXPECT_NEAR(b.memory.moe_gb * 1e9, double(want), 0.02 * double(want));
    EXPECT_NEAR(b.memory.moe_gb * 1e9, double(want), 1e-3);
    EXPECT_LT(want, built[0]);
  }
  // ETP shards F and gathers etp GPUs' rows into a window: ffn / etp, capacity factor * etp.
  in.layout.etp = 2;
  const StageLayers sharded = stage_layers(in);
  EXPECT_EQ(sharded.layers[0].ffn, 24);
  EXPECT_DOUBLE_EQ(sharded.layers[0].capacity_factor, 2 * in.train.capacity_factor);
}

TEST(WallsModel, TimesMatchTheCostModel) {
  WallsInput in = base();
  Imbalance imb;
  imb.mean = 1.2;
  imb.p99 = 1.5;
  const WallsReport r = estimate_walls(in, imb);
  const CostModel cost{in.gpu};
  const double T = 4096, K = 8, H = 2048, F = 768;
  EXPECT_EQ(r.layer.tokens, 4096);
  // One row per (token, rank it picks): 8 ranks of 16 experts each, a token's 8 distinct experts
  // miss a given rank with probability C(112, 8) / C(128, 8).
  const double missed =
      std::exp(std::lgamma(113.0) - std::lgamma(105.0) - std::lgamma(129.0) + std::lgamma(121.0));
  const double ranks_per_token = 8 * (1 - missed);
  EXPECT_NEAR(r.layer.dispatch_bytes, T * ranks_per_token * 7.0 / 8 * H * 2, 1e-3);
  EXPECT_LT(r.layer.dispatch_bytes, T * K * 7.0 / 8 * H * 2);  // fewer rows than (token, k) pairs
  EXPECT_DOUBLE_EQ(r.layer.combine_bytes, r.layer.dispatch_bytes);
  EXPECT_NEAR(r.layer.gemm_ms, cost.gemm_ms(18 * T * K * 1.2 * H * F), 1e-12);
  EXPECT_NEAR(r.layer.comm_ms, 4 * cost.all_to_all_ms(r.layer.dispatch_bytes * 1.2, 8), 1e-12);
  // One spare slot: weights in for the forward and again for the backward of every layer but the
  // last (48 layers), fp32 gradients out.
  EXPECT_NEAR(r.layer.clone_bytes, 3 * H * F * ((2.0 * 48 - 1) / 48 * 2 + 4), 1e-6);
  EXPECT_NEAR(r.layer.host_ms, 30 * 0.5e-3, 1e-12);
  EXPECT_NEAR(r.layer.layer_ms, r.layer.gemm_ms + r.layer.comm_ms + r.layer.clone_ms, 1e-12);
  EXPECT_NEAR(r.stage_ms, 48 * r.layer.layer_ms, 1e-9);
  // Recompute: moe_act adds no GEMM; experts and dispatch run fc1 and fc2 forward again (6 H F
  // per row), dispatch also the forward's dispatch.
  WallsInput rc = in;
  rc.train.recompute = "moe_act";
  EXPECT_NEAR(estimate_walls(rc, imb).layer.gemm_ms, r.layer.gemm_ms, 1e-12);
  rc.train.recompute = "experts";
  const WallsReport e = estimate_walls(rc, imb);
  EXPECT_NEAR(e.layer.gemm_ms, cost.gemm_ms((18 + 6) * T * K * 1.2 * H * F), 1e-12);
  EXPECT_NEAR(e.layer.comm_ms, r.layer.comm_ms, 1e-12);
  rc.train.recompute = "dispatch";
  const WallsReport d = estimate_walls(rc, imb);
  EXPECT_NEAR(d.layer.gemm_ms, e.layer.gemm_ms, 1e-12);
  EXPECT_NEAR(d.layer.comm_ms, 5 * cost.all_to_all_ms(r.layer.dispatch_bytes * 1.2, 8), 1e-12);
  // all_but_fc1: fc2 forward again (2 H F per row) and the forward's dispatch.
  rc.train.recompute = "all_but_fc1";
  const WallsReport a = estimate_walls(rc, imb);
  EXPECT_NEAR(a.layer.gemm_ms, cost.gemm_ms((18 + 2) * T * K * 1.2 * H * F), 1e-12);
  EXPECT_NEAR(a.layer.comm_ms, d.layer.comm_ms, 1e-12);
  // Precision fp8: the forward's rows cross as packed e4m3 rows (H values and H / 128 scales,
  // to 16 bytes: 2112 bytes at H 2048), the combine and the backward's in bf16.
  WallsInput f8 = in;
  f8.train.precision = "fp8";
  const WallsReport q = estimate_walls(f8, imb);
  EXPECT_NEAR(q.layer.dispatch_bytes, r.layer.dispatch_bytes * 2112.0 / (H * 2), 1e-6);
  EXPECT_DOUBLE_EQ(q.layer.combine_bytes, r.layer.combine_bytes);
  EXPECT_NEAR(q.layer.comm_ms,
              cost.all_to_all_ms(q.layer.dispatch_bytes * 1.2, 8) +
                  3 * cost.all_to_all_ms(r.layer.dispatch_bytes * 1.2, 8),
              1e-12);
  EXPECT_LT(q.layer.comm_ms, r.layer.comm_ms);
  EXPECT_NEAR(q.layer.gemm_ms, cost.fp8_gemm_ms(18 * T * K * 1.2 * H * F), 1e-12);
  // fp8_gemms: each GEMM at its own rate (fc1's forward 4 H F per row, the rest 14 H F in bf16);
  // without fprop1 the dispatch stays bf16.
  f8.train.fp8_gemms = "fprop1";
  const WallsReport q1 = estimate_walls(f8, imb);
  EXPECT_NEAR(q1.layer.gemm_ms,
              cost.fp8_gemm_ms(4 * T * K * 1.2 * H * F) + cost.gemm_ms(14 * T * K * 1.2 * H * F),
              1e-12);
  EXPECT_DOUBLE_EQ(q1.layer.dispatch_bytes, q.layer.dispatch_bytes);
  f8.train.fp8_gemms = "dgrad,wgrad";
  EXPECT_DOUBLE_EQ(estimate_walls(f8, imb).layer.dispatch_bytes, r.layer.dispatch_bytes);
  // overlap wgrad: the backward's combine (one all-to-all of the combine's rows) beside fc1's
  // weight-gradient GEMM (4 H F per row), the shorter hidden.
  WallsInput ov = in;
  ov.train.overlap = "wgrad";
  const WallsReport w = estimate_walls(ov, imb);
  const double combine_ms = cost.all_to_all_ms(r.layer.combine_bytes * 1.2, 8);
  const double wgrad1_ms = cost.gemm_ms(4 * T * K * 1.2 * H * F);
  EXPECT_GT(w.layer.wgrad_hidden_ms, 0);
  EXPECT_NEAR(w.layer.wgrad_hidden_ms, std::min(combine_ms, wgrad1_ms), 1e-12);
  EXPECT_NEAR(w.layer.layer_ms, r.layer.layer_ms - w.layer.wgrad_hidden_ms, 1e-12);
  EXPECT_NEAR(w.layer.exposed_comm_ms, r.layer.exposed_comm_ms - w.layer.wgrad_hidden_ms, 1e-12);
  EXPECT_EQ(r.layer.wgrad_hidden_ms, 0);
  in.train.comm_overlap = true;
  const WallsReport o = estimate_walls(in, imb);
  EXPECT_NEAR(o.layer.layer_ms, std::max(o.layer.gemm_ms, o.layer.comm_ms + o.layer.clone_ms),
              1e-12);
}

TEST(WallsModel, DispatchBytesCountOneRowPerTokenAndRank) {
  Imbalance imb;
  const double T = 4096, H = 2048;
  auto bytes = [&](int ep, int experts, int top_k) {
    WallsInput in = base();
    in.layout.ep = ep;
    in.model.experts = experts;
    in.model.top_k = top_k;
    return estimate_walls(in, imb).layer.dispatch_bytes;
  };
  EXPECT_EQ(bytes(1, 128, 8), 0.0);                          // no remote rank
  EXPECT_NEAR(bytes(8, 128, 1), T * 7.0 / 8 * H * 2, 1e-6);  // top-1: one rank per token
  EXPECT_NEAR(bytes(8, 8, 8), T * 7.0 * H * 2, 1e-6);        // every expert: every rank
  EXPECT_NEAR(bytes(8, 16, 2), T * 7.0 / 8 * H * 2 * 8 * (1 - 14.0 / 16 * 13 / 15), 1e-6);
}

// Rows a token sends out of its GPU, against a draw of tokens routed as the model routes (its
// topk_groups groups at random, then its K experts at random among theirs, from a source rank at
// random): flat, one row per EP rank it picks off its own (over NVLink within the node, over the
// network beyond); hierarchical, one network row per other node it picks, and over NVLink the
// rows for its own node's ranks plus, as a forwarder, the rows other nodes' tokens send it for the
// other ranks of its node. One node: the two are the same.
TEST(WallsModel, RowsAcrossNodesFlatAndHierarchical) {
  Imbalance imb;
  WallsInput in;
  in.model = model_preset("deepseek-v3");  // E 256, K 8, 8 groups, top 4
  in.layout.ep = 32;                       // 4 nodes of 8
  const int E = in.model.experts, K = in.model.top_k, G = in.model.expert_groups;
  const int R = in.layout.ep, P = in.gpu.gpus_per_node, N = R / P;
  Rng rng(7, 1, 2);
  double own = 0, other_ranks = 0, other_nodes = 0, forwarded = 0;
  const int draws = 40000;
  for (int d = 0; d < draws; ++d) {
    std::vector<int> groups(static_cast<size_t>(G));
    for (int g = 0; g < G; ++g) groups[size_t(g)] = g;
    for (int g = 0; g < in.model.topk_groups; ++g)
      std::swap(groups[size_t(g)], groups[size_t(g + int(rng.next() % uint64_t(G - g)))]);
    std::vector<int> pool;
    for (int g = 0; g < in.model.topk_groups; ++g)
      for (int e = 0; e < E / G; ++e) pool.push_back(groups[size_t(g)] * (E / G) + e);
    for (int k = 0; k < K; ++k)
      std::swap(pool[size_t(k)],
                pool[size_t(k + int(rng.next() % uint64_t(pool.size() - size_t(k))))]);
    const int src = int(rng.next() % uint64_t(R));
    std::vector<bool> rank_hit(static_cast<size_t>(R)), node_hit(static_cast<size_t>(N));
    for (int k = 0; k < K; ++k) rank_hit[size_t(pool[size_t(k)] / (E / R))] = true;
    for (int r = 0; r < R; ++r) {
      if (!rank_hit[size_t(r)] || r == src) continue;
      if (r / P == src / P) {
        ++own;
      } else {
        ++other_ranks;
        node_hit[size_t(r / P)] = true;
        if (r % P != src % P) ++forwarded;  // the forwarder (src's index there) passes it on
      }
    }
    other_nodes += double(std::count(node_hit.begin(), node_hit.end(), true));
  }
  const LayerTimes flat = estimate_walls(in, imb).layer;
  EXPECT_NEAR(flat.nvlink_rows_per_token, own / draws, 0.02);
  EXPECT_NEAR(flat.network_rows_per_token, other_ranks / draws, 0.03);
  in.train.across_nodes = "hierarchical";
  const LayerTimes tree = estimate_walls(in, imb).layer;
  EXPECT_NEAR(tree.network_rows_per_token, other_nodes / draws, 0.02);
  EXPECT_NEAR(tree.nvlink_rows_per_token, (own + forwarded) / draws, 0.03);
  EXPECT_LT(tree.network_rows_per_token, 0.5 * flat.network_rows_per_token);
  EXPECT_LT(tree.comm_ms, flat.comm_ms);
  const double T = double(tree.tokens), row = 7168 * 2;
  EXPECT_NEAR(tree.dispatch_bytes,
              T * (tree.nvlink_rows_per_token + tree.network_rows_per_token) * row, 1e-3);
  // One node: nothing crosses the network either way.
  in.layout.ep = 8;
  const LayerTimes one_tree = estimate_walls(in, imb).layer;
  in.train.across_nodes = "flat";
  const LayerTimes one_flat = estimate_walls(in, imb).layer;
  EXPECT_EQ(one_tree.network_rows_per_token, 0.0);
  EXPECT_EQ(one_tree.nvlink_rows_per_token, one_flat.nvlink_rows_per_token);
  EXPECT_EQ(one_tree.comm_ms, one_flat.comm_ms);
}

// DeepSeek-V3's shared expert: its GEMMs add to the layer's time on the step's stream, or run
// beside dispatch/combine with shared_expert_overlap, which refuses comm_overlap; group-limited
// routing bounds the ranks a token's row goes to by topk_groups.
TEST(WallsModel, SharedExpertsAndGroupLimits) {
  Imbalance imb;
  WallsInput in;
  in.model = model_preset("deepseek-v3");
  in.layout.ep = 8;
  const CostModel cost{in.gpu};
  const WallsReport plain = estimate_walls(in, imb);
  const double T = double(plain.layer.tokens);
  EXPECT_EQ(in.model.shared_experts, 1);
  EXPECT_NEAR(plain.layer.shared_ms, cost.gemm_ms(CostModel::train_flops(T, 7168, 2048)), 1e-12);
  const double comm = plain.layer.comm_ms + plain.layer.clone_ms;
  EXPECT_NEAR(plain.layer.layer_ms,
              std::max(plain.layer.gemm_ms + plain.layer.shared_ms + comm, plain.layer.host_ms),
              1e-12);
  in.train.shared_expert_overlap = true;
  const WallsReport side = estimate_walls(in, imb);
  EXPECT_NEAR(
      side.layer.layer_ms,
      std::max(side.layer.gemm_ms + std::max(side.layer.shared_ms, comm), side.layer.host_ms),
      1e-12);
  EXPECT_LT(side.layer.layer_ms, plain.layer.layer_ms);
  in.train.comm_overlap = true;
  EXPECT_EQ(test::config_error([&] { validate(in); }),
            "shared_expert_overlap = true is invalid: allowed false with comm_overlap (both put "
            "work on the one stream beside the expert GEMMs: the shared experts or the "
            "dispatch/combine)");
  in.train.comm_overlap = false;
  in.model.shared_experts = 0;
  EXPECT_NE(test::config_error([&] { validate(in); }).find("shared_expert_overlap"),
            std::string::npos);
  // 8 groups on 8 ranks, 4 kept: at most 4 ranks; fewer rows than without the limit.
  EXPECT_EQ(plain.layer.max_ranks_per_token, 4);
  WallsInput open = in;
  open.train.shared_expert_overlap = false;
  open.model.expert_groups = open.model.topk_groups = 1;
  const WallsReport free = estimate_walls(open, imb);
  EXPECT_EQ(free.layer.max_ranks_per_token, 8);
  EXPECT_LT(plain.layer.dispatch_bytes, free.layer.dispatch_bytes);
}

TEST(WallsModel, EachWallBindsWhereItShould) {
  Imbalance imb;
  {  // memory: a tiny GPU
    WallsInput in = base();
    in.gpu.memory_gb = 10;
    const WallsReport r = estimate_walls(in, imb);
    EXPECT_EQ(r.binding_wall, "memory");
    EXPECT_FALSE(r.memory.fits());
    ASSERT_FALSE(r.advice.empty());
    // Every option that keeps less, by the library's names, dispatch among them.
    for (const char* o : {"--recompute moe_act", "--recompute experts", "--recompute dispatch",
                          "--recompute all_but_fc1"})
      EXPECT_NE(r.advice[0].find(o), std::string::npos) << r.advice[0];
    in.train.recompute = "experts";
    const WallsReport e = estimate_walls(in, imb);
    ASSERT_FALSE(e.advice.empty());
    EXPECT_EQ(e.advice[0].find("--recompute experts"), std::string::npos) << e.advice[0];
    EXPECT_NE(e.advice[0].find("--recompute dispatch"), std::string::npos) << e.advice[0];
  }
  {  // communication: EP across nodes over a slow network
    WallsInput in = base();
    in.layout.ep = 64;
    in.layout.pp = 4;
    const WallsReport r = estimate_walls(in, imb);
    EXPECT_EQ(r.binding_wall, "communication") << r.reason;
  }
  {  // compute: big experts inside one node
    WallsInput in = base();
    in.model = model_preset("mixtral-8x7b");
    in.layout.ep = 8;
    in.layout.pp = 8;
    in.gpu.memory_gb = 1000;
    const WallsReport r = estimate_walls(in, imb);
    EXPECT_EQ(r.binding_wall, "compute") << r.reason;
  }
  {  // host overhead: a tiny layer launched without CUDA graphs
    WallsInput in = base();
    in.model.hidden = 256;
    in.model.ffn = 128;
    in.model.seq_len = 256;
    in.train.cuda_graphs = false;
    const WallsReport r = estimate_walls(in, imb);
    EXPECT_EQ(r.binding_wall, "host-overhead") << r.reason;
  }
}

TEST(WallsSuggest, SweepsSpareSlotsAndClonesAndPicksTheFewestNearTheBest) {
  WallsInput in;
  in.model.hidden = 256;
  in.model.ffn = 128;
  in.model.experts = 32;
  in.model.top_k = 4;
  in.model.layers = 4;
  in.model.seq_len = 1024;
  in.layout.ep = 8;
  SweepOptions opt;
  opt.steps = 60;
  opt.layers = 2;
  std::vector<SimulationResult> runs;
  const Suggestion s = suggest(in, opt, nullptr, &runs);
  // (0, 0), then spare slots 1, 2, 4 with clones 2, 4, 7 (8 capped at ep - 1)
  ASSERT_EQ(s.sweep.size(), 10u);
  ASSERT_EQ(runs.size(), s.sweep.size());
  EXPECT_EQ(s.sweep[0].spare_slots, 0);
  EXPECT_EQ(s.sweep[0].max_clones, 0);
  EXPECT_EQ(s.sweep[0].memory_gb, 0.0);
  EXPECT_EQ(s.sweep[3].max_clones, 7);
  double best = 1e9;
  for (size_t i = 0; i < s.sweep.size(); ++i) {
    best = std::min(best, s.sweep[i].p99);
    EXPECT_EQ(runs[i].config.spare_slots, s.sweep[i].spare_slots);
    EXPECT_EQ(runs[i].config.max_clones, s.sweep[i].max_clones);
  }
  const SpareSlotOption* chosen = nullptr;
  for (const SpareSlotOption& o : s.sweep)
    if (o.spare_slots == s.spare_slots && o.max_clones == s.max_clones) chosen = &o;
  ASSERT_NE(chosen, nullptr);
  EXPECT_LE(chosen->p99, best * 1.02);
  for (const SpareSlotOption& o : s.sweep)  // nothing earlier in the order qualifies
    if (&o == chosen)
      break;
    else
      EXPECT_GT(o.p99, best * 1.02);
  EXPECT_GE(s.capacity_factor, chosen->p99);
  EXPECT_LT(s.capacity_factor, chosen->p99 + 0.05 + 1e-9);
  EXPECT_NEAR(s.capacity_factor * 20, std::round(s.capacity_factor * 20), 1e-9);
  EXPECT_LT(s.sweep[0].p99, 10.0);
  EXPECT_LT(chosen->p99, s.sweep[0].p99);  // clones help on the default skew
}

}  // namespace
}  // namespace moe_echo::offline
