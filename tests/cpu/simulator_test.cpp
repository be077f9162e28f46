// The cost model (formulas, presets, measured-results files), the load-balance simulator (every
// policy against a direct computation on the same maps, determinism across threads, the EPLB
// re-placement schedule) and the SVG plot.
#include "moe_echo/simulator.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "moe_echo/cost_model.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/planner.hpp"
#include "moe_echo/svg_plot.hpp"
#include "moe_echo/trace.hpp"

namespace moe_echo::offline {
namespace {

using moe_echo::test::config_error;

// ---- cost model ------------------------------------------------------------------------------

TEST(CostModel, GemmTimeIsFlopsOverReachedRate) {
  CostModel c;  // H200 defaults
  EXPECT_DOUBLE_EQ(c.gpu.gemm_tflops, 690.0);
  EXPECT_NEAR(c.gemm_ms(690e12), 1000.0, 1e-9);
  // 8192 rows of DeepSeek-V3 (H 7168, F 2048): 6 * rows * H * F forward, x3 with backward
  EXPECT_DOUBLE_EQ(CostModel::forward_flops(8192, 7168, 2048), 6.0 * 8192 * 7168 * 2048);
  EXPECT_DOUBLE_EQ(CostModel::train_flops(8192, 7168, 2048), 18.0 * 8192 * 7168 * 2048);
}

TEST(CostModel, AllToAllSplitsIntraAndInterNode) {
  CostModel c;
  c.gpu.nvlink_gbps = 300;
  c.gpu.network_gbps = 50;
  c.gpu.gpus_per_node = 8;
  EXPECT_EQ(c.all_to_all_ms(1e9, 1), 0.0);           // nothing leaves a lone rank
  EXPECT_NEAR(c.all_to_all_ms(3e9, 8), 10.0, 1e-9);  // all 7 peers on the node: 3 GB / 300 GB/s
  // EP 16 over 2 nodes: 7 of 15 peers on the node, 8 across; the network takes 8/15 of the bytes
  EXPECT_NEAR(c.all_to_all_ms(1.5e9, 16), 1.5e9 * 8 / 15 / 50e9 * 1e3, 1e-9);
  // ETP 2: 4 EP ranks per node
  EXPECT_DOUBLE_EQ(intra_node_fraction(8, 2, 8), 0.5);
  EXPECT_DOUBLE_EQ(intra_node_fraction(4, 2, 8), 1.0);
  EXPECT_DOUBLE_EQ(intra_node_fraction(64, 1, 8), 0.125);
  EXPECT_DOUBLE_EQ(intra_node_fraction(1, 1, 8), 1.0);
}

TEST(CostModel, CloneCostInRowsIsCloneTimeOverRowTime) {
  CostModel c;
  const int H = 7168, F = 2048;
  // weights in (bf16) + gradient out (bf16): 3 H F * (2 + 2) bytes over NVLink
  EXPECT_DOUBLE_EQ(clone_bytes(H, F, 2), 3.0 * H * F * 4);
  EXPECT_DOUBLE_EQ(clone_bytes(H, F, 4), 3.0 * H * F * 6);
  const double clone_ms = 3.0 * H * F * 4 / 310e9 * 1e3;
  const double row_ms = 18.0 * H * F / 690e12 * 1e3;
  EXPECT_NEAR(c.clone_ms(H, F, 2), clone_ms, 1e-12);
  EXPECT_NEAR(c.row_ms(H, F), row_ms, 1e-15);
  EXPECT_EQ(c.clone_cost_rows(H, F, 2), int64_t(std::ceil(clone_ms / row_ms)));
}

TEST(CostModel, TheSimulatorPricesACloneLinkByItsOwnStepEstimate) {
  CostModel c;
  const int H = 7168, F = 2048;
  // EP 32 over 4 nodes of 8: a link's 3 H F * 2 bytes mostly cross the 40 GB/s network; a row
  // costs its GEMM and its share of four all-to-alls.
  const double reach = ranks_per_token(256.0, 32.0, 8.0) / 8.0;
  const double link_ms = c.all_to_all_ms(3.0 * H * F * 2, 32);
  const double row_ms = c.row_ms(H, F) + 4.0 * c.all_to_all_ms(reach * 31.0 / 32.0 * 2 * H, 32);
  EXPECT_EQ(c.step_clone_cost_rows(H, F, 2, 32, reach), int64_t(std::ceil(link_ms / row_ms)));
  EXPECT_EQ(c.step_clone_cost_rows(H, F, 2, 32, reach), 1254);
  // One NVLink node: the link and the rows' traffic both at NVLink speed.
  EXPECT_EQ(c.step_clone_cost_rows(H, F, 2, 8, ranks_per_token(256.0, 8.0, 8.0) / 8.0), 580);
  // fp32 gradients out: the larger direction sets the link's time.
  EXPECT_GT(c.step_clone_cost_rows(H, F, 4, 8, 1.0), c.step_clone_cost_rows(H, F, 2, 8, 1.0));
  EXPECT_EQ(c.step_clone_cost_rows(H, F, 2, 1, 1.0), 0);  // one rank: nothing moves
  SimulatorConfig s;
  EXPECT_EQ(simulator_planner_config(s).clone_cost_rows, 1254);  // the defaults: EP 32
  s.clone_cost_rows = 7;
  EXPECT_EQ(simulator_planner_config(s).clone_cost_rows, 7);  // a given cost is kept
}

TEST(Simulator, ClonesPricedByTheStepEstimateDoNotLengthenIt) {
  // The planner minimises the busiest load plus its clone price; priced by the step estimate's
  // own terms, ECHO's estimated step is no longer than with the NVLink-only price, at EP 32 over
  // the network and at EP 8 inside a node (where the NVLink-only price is about 2.6x too high).
  for (int R : {32, 8}) {
    GeneratorConfig g;
    g.steps = 150;
    g.layers = 4;
    const TraceGenerator gen(g);
    SimulatorConfig c;
    c.ranks = R;
    c.policies = {Policy::echo};
    const SimulationResult derived = simulate(gen, c);
    c.clone_cost_rows = CostModel{}.clone_cost_rows(c.hidden, c.ffn, c.grad_bytes);
    ASSERT_EQ(c.clone_cost_rows, 1484);
    const SimulationResult nvlink = simulate(gen, c);
    EXPECT_LT(derived.clone_cost_rows, c.clone_cost_rows) << "ep " << R;
    EXPECT_LE(derived.policies[0].est_step_ms, nvlink.policies[0].est_step_ms) << "ep " << R;
    EXPECT_LE(derived.policies[0].max_over_mean_mean, nvlink.policies[0].max_over_mean_mean)
        << "ep " << R;
  }
}

TEST(CostModel, LaunchOverheadWithAndWithoutGraphs) {
  CostModel c;
  EXPECT_NEAR(c.launch_ms(30, false), 30 * 4.0e-3, 1e-12);
  EXPECT_NEAR(c.launch_ms(30, true), 30 * 0.5e-3, 1e-12);
}

TEST(CostModel, Presets) {
  const GpuSpec h200 = gpu_preset("H200");
  EXPECT_EQ(h200.name, "h200");
  EXPECT_DOUBLE_EQ(h200.memory_gb, 141);
  EXPECT_DOUBLE_EQ(h200.nvlink_gbps, 310);
  EXPECT_DOUBLE_EQ(h200.hbm_tbps, 4.2);
  const GpuSpec h100 = gpu_preset("h100");
  EXPECT_DOUBLE_EQ(h100.memory_gb, 80);
  EXPECT_DOUBLE_EQ(h100.peak_tflops, 989);
  EXPECT_NEAR(h100.hbm_tbps, 3.35 * 0.875, 1e-12);
  EXPECT_NE(config_error([] {
              gpu_preset("a100");
            }).find("gpu = 'a100' is invalid: allowed h200 or h100"),
            std::string::npos);
}

TEST(CostModel, MeasuredResultsOverrideConstants) {
  GpuSpec g;
  apply_measured_json(
      g, R"({"gpu": "h100", "gemm_tflops": 600, "nvlink_gbps": 250.5, "gpus_per_node": 4})",
      "m.json");
  EXPECT_EQ(g.name, "h100");
  EXPECT_DOUBLE_EQ(g.memory_gb, 80);  // from the preset
  EXPECT_DOUBLE_EQ(g.gemm_tflops, 600);
  EXPECT_DOUBLE_EQ(g.nvlink_gbps, 250.5);
  EXPECT_EQ(g.gpus_per_node, 4);
  // constants under "cost_model", next to other keys of a results file
  GpuSpec h;
  apply_measured_json(
      h, R"({"date": "2026-11-21", "rows": [1, 2], "cost_model": {"network_gbps": 45}})", "r.json");
  EXPECT_DOUBLE_EQ(h.network_gbps, 45);
  EXPECT_DOUBLE_EQ(h.gemm_tflops, 690);
  // from a file
  const std::string path =
      (std::filesystem::temp_directory_path() / "moe_echo_measured.json").string();
  std::ofstream(path) << R"({"hbm_tbps": 4.0})";
  GpuSpec k;
  apply_measured_file(k, path);
  EXPECT_DOUBLE_EQ(k.hbm_tbps, 4.0);
  std::filesystem::remove(path);
}

TEST(CostModel, BadMeasuredFilesNameTheKey) {
  const std::pair<std::string, std::string> cases[] = {
      {R"({"gemm_tflop": 600})",
       "m.json: unknown key \"gemm_tflop\": allowed gpu, name, gpus_per_node, memory_gb"},
      {R"({"gemm_tflops": "fast"})", "m.json: \"gemm_tflops\" must be a number"},
      {R"({"gemm_tflops": -1})", "m.json: gemm_tflops = -1 is invalid: allowed a finite value > 0"},
      {R"({"gpus_per_node": 2.5})", "\"gpus_per_node\" must be an integer"},
      {R"({"gpus_per_node": 0})", "gpus_per_node = 0 is invalid"},
      {R"({"cost_model": {"foo": 1}})", "unknown key \"foo\""},
      {R"({"cost_model": 3})", "\"cost_model\" must be a JSON object"},
      {R"({"gpu": "b200"})", "gpu = 'b200' is invalid"},
      {R"([1])", "m.json: expected a JSON object"},
      {"{\n\"gemm_tflops\": 1,\n}", "m.json: not valid JSON"},
  };
  for (const auto& [text, message] : cases) {
    GpuSpec g;
    const std::string json = text;  // clang 14 cannot capture a structured binding
    const std::string msg = config_error([&] { apply_measured_json(g, json, "m.json"); });
    EXPECT_NE(msg.find(message), std::string::npos) << "got: " << msg << "\nwant: " << message;
  }
  GpuSpec g;
  EXPECT_NE(config_error([&] { apply_measured_file(g, "/nonexistent.json"); }).find("cannot open"),
            std::string::npos);
}

// ---- simulator -------------------------------------------------------------------------------

// A file trace from per-expert totals: [step][layer][expert].
TraceFile totals_trace(int E, const std::vector<std::vector<std::vector<int>>>& counts) {
  nlohmann::json j;
  j["format"] = "moe-echo-trace";
  j["experts"] = E;
  j["steps"] = counts.size();
  j["layers"] = counts[0].size();
  j["counts"] = counts;
  return TraceFile::parse_json(j.dump(), "test.json");
}

SimulatorConfig small_sim(int R, int E) {
  SimulatorConfig c;
  c.ranks = R;
  c.experts = E;
  c.top_k = 2;
  c.spare_slots = 1;
  c.max_clones = 2;
  c.clone_cost_rows = 0;
  c.eplb_period = 3;
  c.hidden = 64;
  c.ffn = 32;
  return c;
}

TEST(Simulator, UniformRoutingIsBalancedUnderEveryPolicy) {
  const int R = 4, E = 8;
  std::vector<std::vector<std::vector<int>>> counts(
      5, std::vector<std::vector<int>>(2, std::vector<int>(E, 100)));
  const TraceFile t = totals_trace(E, counts);
  const SimulationResult r = simulate(t, small_sim(R, E));
  ASSERT_EQ(r.policies.size(), 4u);
  for (Policy policy : {Policy::echo, Policy::eplb_periodic, Policy::none}) {
    EXPECT_DOUBLE_EQ(r.find(policy)->max_over_mean_mean, 1.0) << to_string(policy);
    EXPECT_DOUBLE_EQ(r.find(policy)->max_over_mean_p99, 1.0) << to_string(policy);
  }
  // EPLB restricted always fills the spare slots and splits evenly, so it unbalances a balanced
  // map: experts 0-3 get a second replica (ties go to the lowest index) on ranks 1-3 and 0.
  EXPECT_GT(r.find(Policy::eplb)->max_over_mean_mean, 1.0);
  EXPECT_EQ(r.find(Policy::echo)->clones_per_step, 0.0);
  EXPECT_EQ(r.find(Policy::none)->clones_per_step, 0.0);
  EXPECT_DOUBLE_EQ(r.mean_rows_per_rank, 200.0);
}

TEST(Simulator, NoneMatchesTheHomePlacementAndEchoNeverWorse) {
  GeneratorConfig g;
  g.experts = 16;
  g.top_k = 2;
  g.tokens = 512;
  g.layers = 3;
  g.steps = 40;
  g.zipf = {1.2};
  const TraceGenerator gen(g);
  const int R = 4, E = 16;
  SimulatorConfig c = small_sim(R, E);
  const SimulationResult r = simulate(gen, c);
  // direct: the busiest home rank over the mean, per (step, layer)
  std::vector<double> direct;
  for (int l = 0; l < g.layers; ++l) {
    auto s = gen.open_layer(l, R);
    std::vector<int32_t> C(size_t(R) * E);
    for (int step = 0; step < g.steps; ++step) {
      s->next(C.data());
      std::vector<int64_t> load(R, 0);
      for (int src = 0; src < R; ++src)
        for (int e = 0; e < E; ++e) load[size_t(e / (E / R))] += C[size_t(src) * E + e];
      const double total = double(std::accumulate(load.begin(), load.end(), int64_t(0)));
      direct.push_back(double(*std::max_element(load.begin(), load.end())) * R / total);
    }
  }
  std::sort(direct.begin(), direct.end());
  const PolicyStats& none = *r.find(Policy::none);
  EXPECT_EQ(none.samples_sorted.size(), direct.size());
  for (size_t i = 0; i < direct.size(); ++i) EXPECT_NEAR(none.samples_sorted[i], direct[i], 1e-12);
  EXPECT_NEAR(none.max_over_mean_mean,
              std::accumulate(direct.begin(), direct.end(), 0.0) / double(direct.size()), 1e-12);
  const PolicyStats& echo = *r.find(Policy::echo);
  EXPECT_LE(echo.max_over_mean_mean, none.max_over_mean_mean);
  EXPECT_LE(echo.max_over_mean_p99, none.max_over_mean_p99);
  EXPECT_LT(echo.max_over_mean_mean, none.max_over_mean_mean);  // skewed: clones help
  EXPECT_GT(echo.clones_per_step, 0);
  EXPECT_LE(echo.clones_per_step, double(R) * c.spare_slots * g.layers);
  EXPECT_DOUBLE_EQ(echo.clone_bytes_per_step, echo.clones_per_step * clone_bytes(64, 32, 2));
  EXPECT_EQ(echo.max_over_mean_per_step.size(), size_t(g.steps));
}

TEST(Simulator, EchoAndEplbMatchThePlannerOnEachMap) {
  // two steps, one layer, R = 2: [0, 1] home on rank 0, [2, 3] on rank 1
  const std::vector<std::vector<std::vector<int>>> counts = {{{400, 0, 50, 50}},
                                                             {{100, 100, 100, 100}}};
  const TraceFile t = totals_trace(4, counts);
  SimulatorConfig c = small_sim(2, 4);
  const SimulationResult r = simulate(t, c);
  const PlannerConfig pc = simulator_planner_config(c);
  for (Policy p : {Policy::echo, Policy::eplb}) {
    std::vector<double> want;
    auto s = t.open_layer(0, 2);
    std::vector<int32_t> C(8);
    for (int step = 0; step < 2; ++step) {
      s->next(C.data());
      Plan plan(pc);
      if (p == Policy::echo)
        plan_echo(C.data(), pc, plan.view());
      else
        plan_eplb_restricted(C.data(), pc, plan.view());
      const double mean = step == 0 ? 250.0 : 200.0;
      want.push_back(plan.max_load_after() / mean);
    }
    const PolicyStats& got = *r.find(p);
    EXPECT_NEAR(got.max_over_mean_per_step[0], want[0], 1e-12) << to_string(p);
    EXPECT_NEAR(got.max_over_mean_per_step[1], want[1], 1e-12) << to_string(p);
  }
  // no balancing: 400 of 500 rows on rank 0
  EXPECT_NEAR(r.find(Policy::none)->max_over_mean_per_step[0], 1.6, 1e-12);
  EXPECT_LT(r.find(Policy::echo)->max_over_mean_per_step[0], 1.6);
}

TEST(Simulator, EchoStaleSplitsEachMapOverThePreviousStepsPlacement) {
  // three steps, one layer, R = 2: expert 0 hot, then expert 2 hot, then expert 2 again
  const std::vector<std::vector<std::vector<int>>> counts = {
      {{400, 0, 50, 50}}, {{50, 50, 400, 0}}, {{60, 40, 390, 10}}};
  const TraceFile t = totals_trace(4, counts);
  SimulatorConfig c = small_sim(2, 4);
  c.policies = {Policy::echo_stale, Policy::echo};
  const SimulationResult r = simulate(t, c);
  const PlannerConfig pc = simulator_planner_config(c);
  std::vector<double> want;
  auto s = t.open_layer(0, 2);
  std::vector<int32_t> C(8);
  Plan before(pc);
  for (int step = 0; step < 3; ++step) {
    s->next(C.data());
    Plan plan(pc);
    if (step == 0)
      plan_none(C.data(), pc, plan.view());
    else
      plan_placed(C.data(), pc, before.view().spare_expert, plan.view());
    want.push_back(plan.max_load_after() / 250.0);
    plan_echo(C.data(), pc, before.view());
  }
  const PolicyStats& got = *r.find(Policy::echo_stale);
  for (int step = 0; step < 3; ++step)
    EXPECT_NEAR(got.max_over_mean_per_step[size_t(step)], want[size_t(step)], 1e-12) << step;
  EXPECT_NEAR(want[0], 1.6, 1e-12) << "no placement before the first step";
  EXPECT_NEAR(want[1], 1.6, 1e-12) << "the clone of expert 0 leaves expert 2 alone on rank 1";
  EXPECT_LT(want[2], 1.05) << "expert 2's clone, placed a step ahead";
  EXPECT_LT(r.find(Policy::echo)->max_over_mean_per_step[1], want[1]);
}

// micro_batches = M: each step's rows split over M forwards. echo_step plans on the first and
// keeps that placement for the others, pulling its clones once a step where echo pulls for each
// micro-batch; with one micro-batch the two are the same. The split does not depend on threads.
TEST(Simulator, EchoStepKeepsTheFirstMicroBatchsPlacementAndPullsItOnce) {
  GeneratorConfig g;
  g.experts = 16;
  g.top_k = 2;
  g.tokens = 2048;
  g.layers = 3;
  g.steps = 30;
  g.zipf = {1.2};
  const TraceGenerator gen(g);
  SimulatorConfig c = small_sim(4, 16);
  c.policies = {Policy::echo, Policy::echo_step, Policy::none};
  const SimulationResult one = simulate(gen, c);
  const PolicyStats &echo1 = *one.find(Policy::echo), &step1 = *one.find(Policy::echo_step);
  EXPECT_EQ(step1.samples_sorted, echo1.samples_sorted);
  EXPECT_EQ(step1.clones_per_step, echo1.clones_per_step);
  EXPECT_EQ(step1.est_step_ms, echo1.est_step_ms);
  c.micro_batches = 3;
  const SimulationResult three = simulate(gen, c);
  const PolicyStats &echo3 = *three.find(Policy::echo), &step3 = *three.find(Policy::echo_step),
                    &none3 = *three.find(Policy::none);
  EXPECT_DOUBLE_EQ(three.mean_rows_per_rank, one.mean_rows_per_rank);
  EXPECT_GT(step3.clones_per_step, 0);
  EXPECT_GT(echo3.clones_per_step, 2 * step3.clones_per_step) << "echo pulls for each of 3";
  EXPECT_LT(step3.clone_ms, echo3.clone_ms);
  EXPECT_LT(step3.max_over_mean_mean, none3.max_over_mean_mean);
  EXPECT_LT(step3.max_over_mean_mean, 1.05 * echo3.max_over_mean_mean);
  // Each micro-batch draws its rows from the step's: the home placement's imbalance is the
  // step's, within the sampling noise of a third of the rows.
  EXPECT_NEAR(none3.max_over_mean_mean, one.find(Policy::none)->max_over_mean_mean, 0.02);
  c.threads = 3;
  const SimulationResult threaded = simulate(gen, c);
  for (size_t p = 0; p < c.policies.size(); ++p)
    EXPECT_EQ(threaded.policies[p].samples_sorted, three.policies[p].samples_sorted);
  c.micro_batches = 0;
  EXPECT_NE(config_error([&] { simulate(gen, c); }).find("micro_batches = 0 is invalid"),
            std::string::npos);
}

TEST(Simulator, PeriodicEplbRePlacesOnScheduleFromObservedLoads) {
  const int R = 2, E = 4, N = 10;
  // the same skewed map every step: after the first re-placement EPLB fits it
  std::vector<std::vector<std::vector<int>>> counts(N, {{600, 200, 100, 100}});
  const TraceFile t = totals_trace(E, counts);
  SimulatorConfig c = small_sim(R, E);
  c.eplb_period = 4;
  c.policies = {Policy::eplb_periodic};
  const SimulationResult r = simulate(t, c);
  const PolicyStats& p = r.policies[0];
  EXPECT_EQ(p.replacements, 2);  // steps 4 and 8
  auto expected = [&](const std::vector<double>& loads) {
    const EplbPlacement pl = eplb_place(loads, R, E / R + c.spare_slots);
    const std::vector<int32_t> C = {300, 100, 50, 50, 300, 100, 50, 50};  // totals spread over 2
    const auto rl = eplb_rank_loads(pl, C.data(), R, E);
    return double(*std::max_element(rl.begin(), rl.end())) / 500.0;
  };
  const double first = 800.0 / 500.0;  // home placement: experts 0 and 1 on rank 0
  const double later = expected({2400, 800, 400, 400});  // 4 steps observed
  for (int s = 0; s < 4; ++s) EXPECT_NEAR(p.max_over_mean_per_step[size_t(s)], first, 1e-12) << s;
  for (int s = 4; s < N; ++s) EXPECT_NEAR(p.max_over_mean_per_step[size_t(s)], later, 1e-12) << s;
  EXPECT_LE(later, first);
  // redundant replicas from step 4 on (none before the first re-placement)
  EXPECT_DOUBLE_EQ(p.clones_per_step, double(R * c.spare_slots) * (N - 4) / N);
}

TEST(Simulator, ResultsDoNotDependOnThreads) {
  GeneratorConfig g;
  g.experts = 32;
  g.top_k = 4;
  g.tokens = 256;
  g.layers = 5;
  g.steps = 30;
  const TraceGenerator gen(g);
  SimulatorConfig c = small_sim(8, 32);
  c.threads = 1;
  const SimulationResult a = simulate(gen, c);
  // Sums over layers (EPLB's migration time among them) are taken in layer order whichever
  // thread finishes first: every statistic is the same bit for bit.
  for (int threads : {2, 3, 5}) {
    c.threads = threads;
    const SimulationResult b = simulate(gen, c);
    ASSERT_EQ(a.policies.size(), b.policies.size());
    for (size_t p = 0; p < a.policies.size(); ++p) {
      const PolicyStats &x = a.policies[p], &y = b.policies[p];
      SCOPED_TRACE(std::string(to_string(x.policy)) + ", threads " + std::to_string(threads));
      EXPECT_EQ(x.samples_sorted, y.samples_sorted);
      EXPECT_EQ(x.max_over_mean_per_step, y.max_over_mean_per_step);
      EXPECT_EQ(x.clones_per_step, y.clones_per_step);
      EXPECT_EQ(x.compute_ms, y.compute_ms);
      EXPECT_EQ(x.comm_ms, y.comm_ms);
      EXPECT_EQ(x.clone_ms, y.clone_ms);
      EXPECT_EQ(x.migration_ms, y.migration_ms);
      EXPECT_EQ(x.migration_bytes_per_step, y.migration_bytes_per_step);
      EXPECT_EQ(x.replacements, y.replacements);
      EXPECT_EQ(x.est_step_ms, y.est_step_ms);
      EXPECT_EQ(x.est_step_ms_overlap, y.est_step_ms_overlap);
    }
  }
}

TEST(Simulator, StepTimeAddsComputeCommAndClones) {
  const std::vector<std::vector<std::vector<int>>> counts = {{{300, 100, 100, 100}}};
  const TraceFile t = totals_trace(4, counts);
  SimulatorConfig c = small_sim(2, 4);
  c.policies = {Policy::none};
  const SimulationResult r = simulate(t, c);
  const PolicyStats& p = r.policies[0];
  const CostModel cost;
  const double max_load = 400;  // rank 0: experts 0 and 1
  EXPECT_NEAR(p.compute_ms, cost.gemm_ms(CostModel::train_flops(max_load, 64, 32)), 1e-15);
  // Top-2 of 4 experts on 2 ranks: a token misses a rank with probability C(2,2)/C(4,2) = 1/6,
  // so it picks 5/3 ranks and moves 5/6 rows per routed entry; half of them leave the GPU.
  EXPECT_NEAR(ranks_per_token(4, 2, 2), 5.0 / 3.0, 1e-15);
  EXPECT_NEAR(p.comm_ms, 4 * cost.all_to_all_ms(max_load * (5.0 / 6.0) * 0.5 * 64 * 2, 2), 1e-15);
  EXPECT_EQ(p.clone_ms, 0.0);
  EXPECT_NEAR(p.est_step_ms, p.compute_ms + p.comm_ms, 1e-15);
  EXPECT_NEAR(p.est_step_ms_overlap, std::max(p.compute_ms, p.comm_ms), 1e-15);
}

// Ranks a token's rows reach under group-limited routing: no limit equals the plain formula;
// groups of one rank each (DeepSeek-V3's 8 groups on EP 8) follow the hand formula and are
// bounded by topk_groups; an unaligned layout matches a Monte Carlo draw of the same model.
TEST(CostModel, RanksPerTokenUnderGroupLimits) {
  EXPECT_NEAR(ranks_per_token(256, 8, 8, 1, 1), ranks_per_token(256.0, 8.0, 8.0), 1e-12);
  EXPECT_NEAR(ranks_per_token(256, 8, 8, 8, 8), ranks_per_token(256.0, 8.0, 8.0), 1e-12);
  // 4 groups chosen, each one rank of 32 experts; a chosen rank is missed when all 8 picks fall
  // in the other 96 experts: 4 (1 - C(96, 8) / C(128, 8)).
  double miss = 1;
  for (int i = 0; i < 8; ++i) miss *= double(96 - i) / double(128 - i);
  EXPECT_NEAR(ranks_per_token(256, 8, 8, 8, 4), 4 * (1 - miss), 1e-12);
  EXPECT_EQ(max_ranks_per_token(256, 8, 8, 8, 4), 4);
  EXPECT_EQ(max_ranks_per_token(256, 8, 8, 1, 1), 8);
  EXPECT_EQ(max_ranks_per_token(256, 32, 8, 8, 4), 8);  // each group spans 4 ranks
  EXPECT_EQ(max_ranks_per_token(256, 32, 8, 8, 1), 4);
  EXPECT_LT(ranks_per_token(256, 8, 8, 8, 4), ranks_per_token(256.0, 8.0, 8.0));
  // 12 experts in 3 groups of 4 on 4 ranks of 3 (groups straddle ranks), top 2 groups, top-3.
  std::mt19937_64 rng(5);
  const int draws = 200000;
  double sum = 0;
  for (int d = 0; d < draws; ++d) {
    std::vector<int> groups = {0, 1, 2};
    std::shuffle(groups.begin(), groups.end(), rng);
    std::vector<int> experts;
    for (int i = 0; i < 2; ++i)
      for (int e = groups[size_t(i)] * 4; e < groups[size_t(i)] * 4 + 4; ++e) experts.push_back(e);
    std::shuffle(experts.begin(), experts.end(), rng);
    std::vector<int> ranks = {experts[0] / 3, experts[1] / 3, experts[2] / 3};
    std::sort(ranks.begin(), ranks.end());
    sum += double(std::unique(ranks.begin(), ranks.end()) - ranks.begin());
  }
  EXPECT_NEAR(ranks_per_token(12, 4, 3, 3, 2), sum / draws, 0.01);
  EXPECT_EQ(max_ranks_per_token(12, 4, 3, 3, 2), 3);
}

TEST(Simulator, SpillFractionAndPercentiles) {
  PolicyStats p;
  for (int i = 1; i <= 100; ++i) p.samples_sorted.push_back(1.0 + i / 100.0);
  EXPECT_DOUBLE_EQ(p.spill_fraction(1.5), 0.5);
  EXPECT_DOUBLE_EQ(p.spill_fraction(3.0), 0.0);
  EXPECT_DOUBLE_EQ(p.spill_fraction(1.0), 1.0);
  EXPECT_DOUBLE_EQ(percentile_sorted(p.samples_sorted, 0.99), 1.99);
  EXPECT_DOUBLE_EQ(percentile_sorted(p.samples_sorted, 0.50), 1.50);
  EXPECT_DOUBLE_EQ(percentile_sorted(p.samples_sorted, 0.0), 1.01);
  EXPECT_DOUBLE_EQ(percentile_sorted({}, 0.5), 0.0);
}

TEST(Simulator, InvalidConfigsNameTheField) {
  const TraceFile t = totals_trace(8, {{{1, 1, 1, 1, 1, 1, 1, 1}}});
  const std::pair<std::function<void(SimulatorConfig&)>, std::string> cases[] = {
      {[](SimulatorConfig& c) { c.ranks = 3; },
       "experts = 8 is invalid: allowed a multiple of ep (3)"},
      {[](SimulatorConfig& c) { c.ranks = 0; }, "ep = 0 is invalid"},
      {[](SimulatorConfig& c) { c.experts = 16; },
       "experts = 16 is invalid: allowed the trace's expert count (8"},
      {[](SimulatorConfig& c) { c.steps = 5; },
       "steps = 5 is invalid: allowed steps <= the trace's 1"},
      {[](SimulatorConfig& c) { c.layers = 2; }, "layers = 2 is invalid"},
      {[](SimulatorConfig& c) { c.spare_slots = -1; }, "spare_slots = -1 is invalid"},
      {[](SimulatorConfig& c) { c.eplb_period = 0; }, "eplb_period = 0 is invalid"},
      {[](SimulatorConfig& c) { c.threads = 0; }, "threads = 0 is invalid"},
      {[](SimulatorConfig& c) { c.grad_bytes = 3; },
       "grad_bytes = 3 is invalid: allowed 2 (bf16) or 4 (fp32)"},
      {[](SimulatorConfig& c) { c.top_k = 9; }, "top_k = 9 is invalid"},
      {[](SimulatorConfig& c) { c.policies.clear(); }, "policies = (none) is invalid"},
      {[](SimulatorConfig& c) { c.cost.gpu.nvlink_gbps = 0; }, "nvlink_gbps = 0 is invalid"},
  };
  for (const auto& [mutate, message] : cases) {
    SimulatorConfig c = small_sim(2, 8);
    mutate(c);
    const std::string msg = config_error([&] { simulate(t, c); });
    EXPECT_NE(msg.find(message), std::string::npos) << "got: " << msg << "\nwant: " << message;
  }
}

// The acceptance scale, shortened: EP 256 and 256 experts run at a rate that puts the full
// 1000 steps x 8 layers well under a minute on 2 cores (docs/simulate.md has the measured time).
TEST(Simulator, Ep256ScaleIsFast) {
  GeneratorConfig g;
  g.experts = 256;
  g.steps = 40;
  g.layers = 2;
  const TraceGenerator gen(g);
  SimulatorConfig c;
  c.ranks = 256;
  c.experts = 256;
  c.threads = 2;
  const SimulationResult r = simulate(gen, c);
  const double per_map_s = r.elapsed_s / (g.steps * g.layers);
#ifndef MOE_ECHO_SANITIZED  // sanitized code runs several times slower
  EXPECT_LT(per_map_s * 8000, 60.0) << "projected " << per_map_s * 8000 << " s for 1000 x 8";
#endif
  EXPECT_LT(r.find(Policy::echo)->max_over_mean_mean, r.find(Policy::none)->max_over_mean_mean);
}

// ---- SVG plot --------------------------------------------------------------------------------

TEST(SvgPlot, OnePolylinePerSeriesWithLegendAndEscapes) {
  LinePlot p;
  p.title = "max/mean <EP 8> & more";
  p.y_label = "ratio";
  p.series.push_back({"echo", {1.0, 1.1, 1.05}, ""});
  p.series.push_back({"none", {2.0, std::nan(""), 2.5}, "#000000"});
  const std::string svg = render_svg(p);
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  size_t lines = 0;
  for (size_t at = 0; (at = svg.find("<polyline", at)) != std::string::npos; ++at) ++lines;
  EXPECT_EQ(lines, 2u);
  EXPECT_NE(svg.find(">echo</text>"), std::string::npos);
  EXPECT_NE(svg.find(">none</text>"), std::string::npos);
  EXPECT_NE(svg.find("max/mean &lt;EP 8&gt; &amp; more"), std::string::npos);
  EXPECT_NE(svg.find("stroke=\"#000000\""), std::string::npos);
  EXPECT_EQ(svg.find("nan"), std::string::npos);  // the NaN point is skipped
}

TEST(SvgPlot, NiceTicks) {
  EXPECT_EQ(nice_ticks(0, 1000, 6), (std::vector<double>{0, 200, 400, 600, 800, 1000}));
  const auto t = nice_ticks(0.95, 2.62, 6);
  ASSERT_FALSE(t.empty());
  EXPECT_GE(t.front(), 0.95);
  EXPECT_LE(t.back(), 2.62);
  EXPECT_NEAR(t[1] - t[0], 0.5, 1e-12);
  EXPECT_EQ(nice_ticks(3, 3, 5), (std::vector<double>{3}));
}

}  // namespace
}  // namespace moe_echo::offline
