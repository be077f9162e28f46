// moe-echo simulate: the balancing policies (ECHO, EPLB restricted to the spare slots, EPLB with
// periodic re-placement, none) on the same routing count matrices, from the generator or a
// recorded trace file. Prints a table; --json and --plot write every number and a max/mean plot.
// docs/simulate.md documents every flag, the trace formats and the JSON fields.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "commands.hpp"
#include "layer_options.hpp"
#include "moe_echo/cost_model.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/simulator.hpp"
#include "moe_echo/svg_plot.hpp"
#include "moe_echo/trace.hpp"

namespace moe_echo::cli {
namespace {

using namespace moe_echo::offline;

// The defaults of the flags: the library's.
const SimulatorConfig kSim;
const GeneratorConfig kGen;

struct SimulateOptions {
  int ep = kSim.ranks, experts = kSim.experts, top_k = kSim.top_k, tokens = kGen.tokens;
  int expert_groups = kSim.expert_groups, topk_groups = kSim.topk_groups;
  std::optional<int> steps, layers;
  int spare_slots = kSim.spare_slots, max_clones = kSim.max_clones;
  int eplb_period = kSim.eplb_period, threads = kSim.threads, micro_batches = kSim.micro_batches;
  int64_t clone_cost_rows = kSim.clone_cost_rows;
  uint64_t seed = kGen.seed;
  std::string trace, write_trace, json, plot;
  std::vector<double> zipf;
  std::optional<double> zipf_lo, zipf_hi, drift_std, drift_steps, switch_prob;
  int hidden = kSim.hidden, ffn = kSim.ffn, grad_bytes = kSim.grad_bytes;
  std::string gpu = kSim.cost.gpu.name, measured;
  std::optional<double> gemm_tflops, nvlink_gbps, network_gbps;
  std::optional<int> gpus_per_node;
  std::vector<std::string> policies;
};

std::string fmt(double v, int precision) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", precision, v);
  return buf;
}

Policy parse_policy(const std::string& s) {
  for (Policy p : kAllPolicies)
    if (s == to_string(p)) return p;
  reject("policies", "'" + s + "'", "echo, eplb, eplb_periodic, none, echo_stale, echo_step");
}

nlohmann::json policy_json(const PolicyStats& p) {
  nlohmann::json j;
  j["max_over_mean_mean"] = p.max_over_mean_mean;
  j["max_over_mean_p50"] = p.max_over_mean_p50;
  j["max_over_mean_p99"] = p.max_over_mean_p99;
  j["max_over_mean_max"] = p.max_over_mean_max;
  j["clones_per_step"] = p.clones_per_step;
  j["clone_bytes_per_step"] = p.clone_bytes_per_step;
  j["migration_bytes_per_step"] = p.migration_bytes_per_step;
  j["replacements"] = p.replacements;
  j["compute_ms_per_step"] = p.compute_ms;
  j["comm_ms_per_step"] = p.comm_ms;
  j["clone_ms_per_step"] = p.clone_ms;
  j["migration_ms_per_step"] = p.migration_ms;
  j["est_step_ms"] = p.est_step_ms;
  j["est_step_ms_overlap"] = p.est_step_ms_overlap;
  j["planner_ms_per_call"] = p.planner_ms_per_call;
  j["max_over_mean_per_step"] = p.max_over_mean_per_step;
  return j;
}

int run_simulate(const SimulateOptions& o) {
  SimulatorConfig sc;
  sc.ranks = o.ep;
  sc.experts = o.experts;
  sc.top_k = o.top_k;
  sc.expert_groups = o.expert_groups;
  sc.topk_groups = o.topk_groups;
  sc.spare_slots = o.spare_slots;
  sc.max_clones = o.max_clones;
  sc.clone_cost_rows = o.clone_cost_rows;
  sc.eplb_period = o.eplb_period;
  sc.micro_batches = o.micro_batches;
  sc.threads = o.threads;
  sc.hidden = o.hidden;
  sc.ffn = o.ffn;
  sc.grad_bytes = o.grad_bytes;
  if (!o.policies.empty()) {
    sc.policies.clear();
    for (const std::string& p : o.policies) sc.policies.push_back(parse_policy(p));
  }
  GpuSpec gpu = gpu_preset(o.gpu);
  if (!o.measured.empty()) apply_measured_file(gpu, o.measured);
  if (o.gemm_tflops) gpu.gemm_tflops = *o.gemm_tflops;
  if (o.nvlink_gbps) gpu.nvlink_gbps = *o.nvlink_gbps;
  if (o.network_gbps) gpu.network_gbps = *o.network_gbps;
  if (o.gpus_per_node) gpu.gpus_per_node = *o.gpus_per_node;
  sc.cost.gpu = gpu;
  if (o.steps && *o.steps < 1) reject("steps", *o.steps, "steps >= 1");
  if (o.layers && *o.layers < 1) reject("layers", *o.layers, "layers >= 1");
  validate(sc);  // flags first, before any work
  check_output_path("json", o.json);
  check_output_path("plot", o.plot);
  check_output_path("write_trace", o.write_trace);

  std::unique_ptr<TraceSource> source;
  if (!o.trace.empty()) {
    if (!o.zipf.empty() || o.zipf_lo || o.zipf_hi || o.drift_std || o.drift_steps || o.switch_prob)
      throw ConfigError("trace", "trace = " + o.trace +
                                     " is invalid with generator flags (--zipf, --zipf-lo, "
                                     "--zipf-hi, --drift-std, --drift-steps, --switch-prob): "
                                     "allowed one trace source");
    source = std::make_unique<TraceFile>(TraceFile::read(o.trace, o.experts));
    sc.steps = o.steps.value_or(0);
    sc.layers = o.layers.value_or(0);
  } else {
    GeneratorConfig g;
    g.experts = o.experts;
    g.top_k = o.top_k;
    g.tokens = o.tokens;
    g.steps = o.steps.value_or(g.steps);
    g.layers = o.layers.value_or(g.layers);
    g.zipf = o.zipf;
    g.zipf_lo = o.zipf_lo.value_or(g.zipf_lo);
    g.zipf_hi = o.zipf_hi.value_or(g.zipf_hi);
    g.drift_std = o.drift_std.value_or(g.drift_std);
    g.drift_steps = o.drift_steps.value_or(g.drift_steps);
    g.switch_prob = o.switch_prob.value_or(g.switch_prob);
    g.seed = o.seed;
    source = std::make_unique<TraceGenerator>(g);
  }
  // Refuse what cannot fit before the run (the steps and layers a trace holds are known now).
  const int64_t steps = sc.steps > 0 ? sc.steps : source->steps();
  const int64_t layers = sc.layers > 0 ? sc.layers : source->layers();
  const double need = memory_bytes(sc, steps, layers), have = physical_memory_bytes();
  if (have > 0 && need > 0.8 * have) {
    std::ostringstream m;
    m.precision(3);
    m << "memory = " << need / (1 << 30) << " GiB is invalid: allowed at most 80% of this "
      << "machine's " << have / (1 << 30) << " GiB (" << steps << " steps x " << layers
      << " layers, EP " << sc.ranks << ", " << sc.experts << " experts, " << sc.threads
      << " threads); lower --steps, --layers, --ep, --experts or --threads";
    throw ConfigError("memory", m.str());
  }
  if (!o.write_trace.empty()) write_trace_csv(*source, o.ep, false, o.write_trace);

  const SimulationResult res = simulate(*source, sc);
  const SimulatorConfig& c = res.config;

  std::ostringstream out;
  out << "moe-echo simulate: EP " << c.ranks << ", " << c.experts << " experts, top-" << c.top_k
      << ", " << res.steps << " steps x " << res.layers << " layers, " << c.spare_slots
      << " spare slot(s) per rank, max " << c.max_clones << " clone(s) per expert";
  if (c.micro_batches > 1) out << ", " << c.micro_batches << " micro-batches a step";
  out << "\n"
      << "trace: " << res.trace << "\n"
      << "rows per rank (mean): " << fmt(res.mean_rows_per_rank, 0) << "\n"
      << "ranks a token's rows go to: " << fmt(res.ranks_per_token, 2)
      << " expected under uniform routing, at most " << res.max_ranks_per_token;
  if (c.expert_groups > 1)
    out << " (top " << c.topk_groups << " of " << c.expert_groups << " expert groups)";
  out << "\n"
      << "cost model: " << gpu.name << ", GEMM " << fmt(gpu.gemm_tflops, 0) << " TFLOP/s, NVLink "
      << fmt(gpu.nvlink_gbps, 0) << " GB/s, network " << fmt(gpu.network_gbps, 0) << " GB/s, "
      << gpu.gpus_per_node << " GPUs/node; H " << c.hidden << ", F " << c.ffn << "; clone "
      << fmt(clone_bytes(c.hidden, c.ffn, c.grad_bytes) / 1e6, 1) << " MB (bf16 weights in, "
      << (c.grad_bytes == 2 ? "bf16" : "fp32") << " gradient out); ECHO clone cost "
      << res.clone_cost_rows << " rows\n\n";
  char line[256];
  std::snprintf(line, sizeof line, "%-14s %9s %6s %6s %6s %12s %13s %9s %9s %10s\n", "policy",
                "max/mean", "p50", "p99", "max", "clones/step", "clone GB/step", "step ms",
                "overlap", "planner ms");
  out << line;
  for (const PolicyStats& p : res.policies) {
    std::snprintf(line, sizeof line,
                  "%-14s %9.3f %6.3f %6.3f %6.3f %12.1f %13.2f %9.2f %9.2f %10.3f\n",
                  to_string(p.policy), p.max_over_mean_mean, p.max_over_mean_p50,
                  p.max_over_mean_p99, p.max_over_mean_max, p.clones_per_step,
                  (p.clone_bytes_per_step + p.migration_bytes_per_step) / 1e9, p.est_step_ms,
                  p.est_step_ms_overlap, p.planner_ms_per_call);
    out << line;
  }
  out << "\nmax/mean: busiest rank's rows over the mean, per (step, layer); mean, p50 and p99 over "
         "all of them.\nstep ms: estimated expert GEMM + dispatch/combine + clone traffic of "
      << res.layers << " layers, forward and backward; overlap: comm hidden under compute.\n"
      << "elapsed " << fmt(res.elapsed_s, 2) << " s (" << c.threads << " thread(s))\n";
  std::cout << out.str() << std::flush;

  if (!o.json.empty()) {
    nlohmann::json j;
    j["tool"] = "moe-echo simulate";
    j["config"] = {{"ep", c.ranks},
                   {"experts", c.experts},
                   {"top_k", c.top_k},
                   {"expert_groups", c.expert_groups},
                   {"topk_groups", c.topk_groups},
                   {"ranks_per_token", res.ranks_per_token},
                   {"max_ranks_per_token", res.max_ranks_per_token},
                   {"steps", res.steps},
                   {"layers", res.layers},
                   {"spare_slots", c.spare_slots},
                   {"max_clones", c.max_clones},
                   {"clone_cost_rows", res.clone_cost_rows},
                   {"eplb_period", c.eplb_period},
                   {"micro_batches", c.micro_batches},
                   {"threads", c.threads},
                   {"hidden", c.hidden},
                   {"ffn", c.ffn},
                   {"grad_bytes", c.grad_bytes},
                   {"seed", o.seed},
                   {"trace", res.trace}};
    if (const auto* gen = dynamic_cast<const TraceGenerator*>(source.get())) {
      const GeneratorConfig& g = gen->config();
      std::vector<double> zipf;
      for (int l = 0; l < g.layers; ++l) zipf.push_back(g.zipf_exponent(l));
      j["config"]["generator"] = {{"tokens", g.tokens},           {"zipf_per_layer", zipf},
                                  {"drift_std", g.drift_std},     {"drift_steps", g.drift_steps},
                                  {"switch_prob", g.switch_prob}, {"seed", g.seed}};
    }
    j["cost_model"] = {{"gpu", gpu.name},
                       {"gemm_tflops", gpu.gemm_tflops},
                       {"nvlink_gbps", gpu.nvlink_gbps},
                       {"network_gbps", gpu.network_gbps},
                       {"gpus_per_node", gpu.gpus_per_node},
                       {"clone_bytes", clone_bytes(c.hidden, c.ffn, c.grad_bytes)}};
    j["mean_rows_per_rank"] = res.mean_rows_per_rank;
    j["policies"] = nlohmann::json::object();
    for (const PolicyStats& p : res.policies) j["policies"][to_string(p.policy)] = policy_json(p);
    j["elapsed_s"] = res.elapsed_s;
    write_file(o.json, j.dump(1) + "\n");
  }
  if (!o.plot.empty()) {
    LinePlot plot;
    plot.title = "busiest rank / mean, EP " + std::to_string(c.ranks) + ", " +
                 std::to_string(c.experts) + " experts, top-" + std::to_string(c.top_k) +
                 " (mean over " + std::to_string(res.layers) + " layers)";
    plot.y_label = "rank load max / mean";
    plot.y_min = 1.0;
    for (const PolicyStats& p : res.policies)
      plot.series.push_back({to_string(p.policy), p.max_over_mean_per_step, ""});
    write_svg(plot, o.plot);
  }
  return 0;
}

}  // namespace

void add_simulate(CLI::App& app, Runner& run) {
  auto o = std::make_shared<SimulateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "simulate",
      "Compare ECHO, EPLB (restricted to the spare slots, and periodic), and no balancing on "
      "routing counts from a generator or a trace file (docs/simulate.md)");
  add_option(cmd, "--ep", o->ep, "EP size R (source and destination ranks)")->capture_default_str();
  add_option(cmd, "--experts", o->experts, "routed experts E")->capture_default_str();
  add_option(cmd, "--top-k", o->top_k, "experts per token K")->capture_default_str();
  add_option(cmd, "--expert-groups", o->expert_groups,
             "group-limited routing: experts in G groups (1: no limit)")
      ->capture_default_str();
  add_option(cmd, "--topk-groups", o->topk_groups, "groups a token picks its experts from")
      ->capture_default_str();
  add_option(cmd, "--tokens", o->tokens, "generator: tokens per rank per step T")
      ->capture_default_str();
  add_option(cmd, "--steps", o->steps,
             "steps (" + default_is(kGen.steps) + "; with --trace every step of the file)");
  add_option(cmd, "--layers", o->layers,
             "MoE layers (" + default_is(kGen.layers) + "; with --trace every layer of the file)");
  add_option(cmd, "--spare-slots", o->spare_slots, "spare slots per rank S")->capture_default_str();
  add_option(cmd, "--max-clones", o->max_clones, "ECHO: clones per expert per step")
      ->capture_default_str();
  add_option(cmd, "--clone-cost-rows", o->clone_cost_rows,
             "ECHO: cost of one clone link in rows (-1: from the cost model)")
      ->capture_default_str();
  add_option(cmd, "--eplb-period", o->eplb_period, "eplb_periodic: steps between re-placements")
      ->capture_default_str();
  add_option(cmd, "--micro-batches", o->micro_batches,
             "forwards each step's rows are split over; echo and eplb plan and pull clones for "
             "each, echo_step, echo_stale and eplb_periodic once a step")
      ->capture_default_str();
  add_option(cmd, "--threads", o->threads, "worker threads (layers are split over them)")
      ->capture_default_str();
  add_option(cmd, "--seed", o->seed, "generator seed")->capture_default_str();
  add_option(cmd, "--trace", o->trace,
             "routing trace file (.csv or .json) instead of the generator");
  add_option(cmd, "--write-trace", o->write_trace, "write the routing counts used as a CSV trace");
  add_option(cmd, "--zipf", o->zipf, "generator: Zipf exponent, one value or one per layer")
      ->delimiter(',');
  add_option(cmd, "--zipf-lo", o->zipf_lo,
             "generator: exponent of the first layer (" + default_is(kGen.zipf_lo) + ")");
  add_option(cmd, "--zipf-hi", o->zipf_hi,
             "generator: exponent of the last layer (" + default_is(kGen.zipf_hi) + ")");
  add_option(cmd, "--drift-std", o->drift_std,
             "generator: stationary std of log-popularity (" + default_is(kGen.drift_std) + ")");
  add_option(cmd, "--drift-steps", o->drift_steps,
             "generator: mean-reversion time in steps (" + default_is(kGen.drift_steps) + ")");
  add_option(cmd, "--switch-prob", o->switch_prob,
             "generator: domain switches per step (" + default_is(kGen.switch_prob) + ")");
  add_option(cmd, "--hidden", o->hidden, "hidden size H (bytes and time)")->capture_default_str();
  add_option(cmd, "--ffn", o->ffn, "expert FFN size F (bytes and time)")->capture_default_str();
  add_option(cmd, "--grad-bytes", o->grad_bytes,
             "bytes per parameter of a clone's gradient (2 or 4)")
      ->capture_default_str();
  add_option(cmd, "--gpu", o->gpu, "cost model preset: h200 or h100")->capture_default_str();
  add_option(cmd, "--measured", o->measured, "measured-results JSON overriding the cost model");
  add_option(cmd, "--gemm-tflops", o->gemm_tflops, "grouped GEMM TFLOP/s reached");
  add_option(cmd, "--nvlink-gbps", o->nvlink_gbps, "all-to-all GB/s per GPU within a node");
  add_option(cmd, "--network-gbps", o->network_gbps, "all-to-all GB/s per GPU across nodes");
  add_option(cmd, "--gpus-per-node", o->gpus_per_node, "GPUs per NVLink domain");
  add_option(
      cmd, "--policies", o->policies,
      "subset of echo,eplb,eplb_periodic,none,echo_stale,echo_step (default: the first four)")
      ->delimiter(',');
  add_option(cmd, "--json", o->json, "write the results as JSON");
  add_option(cmd, "--plot", o->plot, "write an SVG plot of max/mean over steps");
  cmd->callback([&run, o] { run = [o] { return run_simulate(*o); }; });
}

}  // namespace moe_echo::cli
