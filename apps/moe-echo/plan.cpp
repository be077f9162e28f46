// moe-echo plan: memory, communication and compute of the MoE layers on one GPU of a parallel
// layout, which wall binds, the validation rules of the combination, and a capacity factor and
// spare-slot count suggested by the simulator. docs/plan.md documents the model and every field.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "commands.hpp"
#include "layer_options.hpp"
#include "moe_echo/capacity_plan.hpp"
#include "moe_echo/cost_model.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/presets.hpp"
#include "moe_echo/simulator.hpp"
#include "moe_echo/trace.hpp"

namespace moe_echo::cli {
namespace {

using namespace moe_echo::offline;

struct PlanOptions {
  std::string preset{ModelSpec{}.name};
  std::optional<std::string> model;  // --model, the older spelling of --preset
  std::string overlap = "none";      // MoeConfig::overlap, or the older on/off of --comm-overlap
  std::optional<int> hidden, ffn, experts, top_k, layers, expert_groups, topk_groups;
  int seq_len = 4096, micro_batch = 1;
  std::string dtype = "bf16";
  LayoutSpec layout;
  TrainingSpec train;
  std::string gpu = "h200", measured;
  std::optional<double> memory_gb, gemm_tflops, nvlink_gbps, network_gbps;
  std::optional<int> gpus_per_node;
  std::optional<double> imbalance;
  std::string trace, json;
  SweepOptions sweep;
};

std::string fmt(double v, int precision) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", precision, v);
  return buf;
}

const char* severity(Severity s) { return s == Severity::error ? "error" : "warning"; }

int run_plan(const PlanOptions& o) {
  WallsInput in;
  if (o.model) std::cerr << "moe-echo: warning: --model is deprecated: use --preset\n";
  in.model = o.model ? model_preset(*o.model, "model") : model_preset(o.preset, "preset");
  if (o.hidden) in.model.hidden = *o.hidden;
  if (o.ffn) in.model.ffn = *o.ffn;
  if (o.experts) in.model.experts = *o.experts;
  if (o.top_k) in.model.top_k = *o.top_k;
  if (o.expert_groups) in.model.expert_groups = *o.expert_groups;
  if (o.topk_groups) in.model.topk_groups = *o.topk_groups;
  // Another expert count without groups given: no group limit.
  if (o.experts && !o.expert_groups) in.model.expert_groups = in.model.topk_groups = 1;
  if (o.layers) in.model.layers = *o.layers;
  in.model.seq_len = o.seq_len;
  in.model.micro_batch = o.micro_batch;
  in.model.dtype = o.dtype;
  in.layout = o.layout;
  in.train = o.train;
  if (o.overlap == "on" || o.overlap == "off") {  // before --overlap took none or wgrad
    std::cerr << "moe-echo: warning: --overlap " << o.overlap
              << " is deprecated: use --comm-overlap " << o.overlap
              << " (--overlap is the layer's: none or wgrad)\n";
    in.train.comm_overlap = in.train.comm_overlap || o.overlap == "on";
  } else {
    in.train.overlap = o.overlap;
  }
  in.gpu = gpu_preset(o.gpu);
  if (!o.measured.empty()) apply_measured_file(in.gpu, o.measured);
  if (o.memory_gb) in.gpu.memory_gb = *o.memory_gb;
  if (o.gemm_tflops) in.gpu.gemm_tflops = *o.gemm_tflops;
  if (o.nvlink_gbps) in.gpu.nvlink_gbps = *o.nvlink_gbps;
  if (o.network_gbps) in.gpu.network_gbps = *o.network_gbps;
  if (o.gpus_per_node) in.gpu.gpus_per_node = *o.gpus_per_node;
  validate(in);  // every error rule, before the simulation
  if (o.imbalance && (!std::isfinite(*o.imbalance) || *o.imbalance < 1.0))
    reject("imbalance", *o.imbalance, "a finite value >= 1 (busiest rank / mean)");
  if (o.sweep.steps < 1) reject("sim_steps", o.sweep.steps, "sim_steps >= 1");
  if (o.sweep.layers < 1) reject("sim_layers", o.sweep.layers, "sim_layers >= 1");
  if (o.imbalance && !o.trace.empty())
    reject("trace", "'" + o.trace + "'",
           "no --trace with --imbalance (the trace feeds the simulator, which --imbalance skips)");
  check_output_path("json", o.json);
  if (!o.imbalance && in.layout.ep > 1) {  // the simulator's sweep: refuse what cannot fit
    SimulatorConfig sc;
    sc.ranks = in.layout.ep;
    sc.experts = in.model.experts;
    sc.spare_slots = std::max(in.train.spare_slots, 4);
    sc.max_clones = std::max(in.train.max_clones, 8);
    sc.threads = o.sweep.threads;
    sc.policies = {Policy::echo};
    const double need = memory_bytes(sc, o.sweep.steps, o.sweep.layers);
    const double have = physical_memory_bytes();
    if (have > 0 && need > 0.8 * have) {
      std::ostringstream m;
      m.precision(3);
      m << "memory = " << need / (1 << 30) << " GiB is invalid: allowed at most 80% of this "
        << "machine's " << have / (1 << 30) << " GiB for the simulator (" << o.sweep.steps
        << " steps x " << o.sweep.layers << " layers, EP " << sc.ranks << ", " << sc.experts
        << " experts); lower --sim-steps, --sim-layers or --threads, or give --imbalance";
      throw ConfigError("memory", m.str());
    }
  }

  const ModelSpec& m = in.model;
  const LayoutSpec& l = in.layout;
  Imbalance imb;
  Suggestion sug;
  bool simulated = false;
  if (o.imbalance) {
    imb.mean = imb.p99 = *o.imbalance;
    imb.spill_fraction = in.train.capacity_factor < *o.imbalance ? 1.0 : 0.0;
    imb.source = "given";
  } else if (l.ep == 1) {
    imb.source = "ep = 1: one rank takes every row";
  } else {
    std::unique_ptr<TraceFile> trace;
    if (!o.trace.empty()) trace = std::make_unique<TraceFile>(TraceFile::read(o.trace, m.experts));
    std::vector<SimulationResult> runs;
    sug = suggest(in, o.sweep, trace.get(), &runs);
    simulated = true;
    const int want_clones = in.train.spare_slots == 0 ? 0 : std::min(in.train.max_clones, l.ep - 1);
    for (const SimulationResult& r : runs)
      if (r.config.spare_slots == in.train.spare_slots && r.config.max_clones == want_clones) {
        const PolicyStats& p = r.policies[0];
        imb.mean = p.max_over_mean_mean;
        imb.p99 = p.max_over_mean_p99;
        imb.spill_fraction = p.spill_fraction(in.train.capacity_factor);
        imb.source = "ECHO with " + std::to_string(in.train.spare_slots) + " spare slot(s) and " +
                     std::to_string(in.train.max_clones) + " clone(s) per expert, " +
                     (trace ? "trace " + o.trace : std::string("generator")) + ", " +
                     std::to_string(r.steps) + " steps x " + std::to_string(r.layers) + " layers";
      }
  }
  const WallsReport rep = estimate_walls(in, imb);
  const MemoryBreakdown& mem = rep.memory;
  const LayerTimes& lt = rep.layer;

  std::ostringstream out;
  out << "moe-echo plan: " << m.name << " (H " << m.hidden << ", F " << m.ffn << ", " << m.experts
      << " experts, top-" << m.top_k << ", " << m.layers << " MoE layers), seq " << m.seq_len
      << " x micro-batch " << m.micro_batch << ", " << m.dtype << "\n"
      << "layout: etp " << l.etp << " x ep " << l.ep << " x dp " << l.dp << " x pp " << l.pp
      << " (vpp " << l.vpp << ") = " << rep.world_size << " GPUs; " << in.gpu.name << " ("
      << fmt(in.gpu.memory_gb, 0) << " GB, GEMM " << fmt(in.gpu.gemm_tflops, 0)
      << " TFLOP/s, NVLink " << fmt(in.gpu.nvlink_gbps, 0) << " GB/s, network "
      << fmt(in.gpu.network_gbps, 0) << " GB/s, " << in.gpu.gpus_per_node << " GPUs/node)\n"
      << "imbalance: busiest rank " << fmt(imb.mean, 2) << "x the mean (p99 " << fmt(imb.p99, 2)
      << "), " << imb.source << "\n\n";
  char line[256];
  auto row = [&](const char* what, double gb) {
    std::snprintf(line, sizeof line, "  %-50s %9.2f\n", what, gb);
    out << line;
  };
  out << "memory per GPU, GB (first pipeline stage: " << rep.layers_per_stage
      << " MoE layers as one MoeStack, " << fmt(mem.microbatches_in_flight, 2)
      << " micro-batches in flight)\n";
  row("weights (home experts, router, shared experts)", mem.weights_gb);
  row("gradients (fp32)", mem.grads_gb);
  row(in.train.distributed_optimizer ? "optimizer state (AdamW m, v; sharded over dp)"
                                     : "optimizer state (AdamW m, v)",
      mem.optimizer_gb);
  row("echo-slot weights (clones, a pool per GPU and set)", mem.spare_weights_gb);
  row("echo-slot gradients (fp32)", mem.spare_grads_gb);
  row(("kept for backward, routing (recompute " + in.train.recompute + ")").c_str(),
      mem.activations_gb);
  row("MoE workspace and layer temporaries", mem.buffers_gb);
  row("MoE layers", mem.moe_gb);
  row("reserve (attention, dense layers, framework)", mem.reserve_gb);
  row("total", mem.total_gb);
  out << "  " << (mem.fits() ? "fits in " : "does NOT fit in ") << fmt(mem.capacity_gb, 0)
      << " GB; against recompute none, moe_act saves " << fmt(mem.recompute_moe_act_saves_gb, 2)
      << " GB, experts " << fmt(mem.recompute_experts_saves_gb, 2) << " GB, dispatch "
      << fmt(mem.recompute_dispatch_saves_gb, 2) << " GB, all_but_fc1 "
      << fmt(mem.recompute_all_but_fc1_saves_gb, 2) << " GB\n\n";
  out << "per MoE layer and micro-batch, forward + backward, busiest rank:\n"
      << "  tokens per GPU " << lt.tokens << "; receive window " << lt.capacity_rows
      << " rows (capacity factor " << fmt(in.train.capacity_factor, 2) << ")\n"
      << "  EP ranks a token's row goes to: " << fmt(lt.ranks_per_token, 2)
      << " expected under uniform routing, at most " << lt.max_ranks_per_token;
  if (in.model.expert_groups > 1)
    out << " (top " << in.model.topk_groups << " of " << in.model.expert_groups
        << " expert groups)";
  out << "\n";
  if (lt.network_rows_per_token > 0)
    out << "  rows a token sends out of its GPU: " << fmt(lt.nvlink_rows_per_token, 2)
        << " over NVLink, " << fmt(lt.network_rows_per_token, 2) << " over the network ("
        << in.train.across_nodes << " across nodes)\n";
  out << "  dispatch " << fmt(lt.dispatch_bytes / 1e6, 1) << " MB, combine "
      << fmt(lt.combine_bytes / 1e6, 1) << " MB leaving each GPU per direction (forward)";
  if (l.etp > 1) out << ", ETP gather " << fmt(lt.etp_bytes / 1e6, 1) << " MB";
  out << "\n";
  std::snprintf(line, sizeof line,
                "  dispatch/combine %.3f ms, clones %.3f ms, expert GEMM %.3f ms, shared experts "
                "%.3f ms, launches %.3f ms -> %.3f ms per layer%s\n",
                lt.comm_ms, lt.clone_ms, lt.gemm_ms, lt.shared_ms, lt.host_ms, lt.layer_ms,
                in.train.comm_overlap            ? " (overlapped)"
                : in.train.shared_expert_overlap ? " (shared experts beside dispatch/combine)"
                                                 : "");
  out << line;
  if (lt.wgrad_hidden_ms > 0)
    out << "  overlap wgrad: fc1's weight-gradient GEMM hides " << fmt(lt.wgrad_hidden_ms, 3)
        << " ms of the backward's combine\n";
  out << "  MoE time of one micro-batch on one stage: " << fmt(rep.stage_ms, 2) << " ms\n\n";
  out << "binding wall: " << rep.binding_wall << " (" << rep.reason << ")\n";
  for (const std::string& a : rep.advice) out << "  - " << a << "\n";
  if (simulated) {
    out << "\nsuggestion: --spare-slots " << sug.spare_slots << " --max-clones " << sug.max_clones
        << " --capacity-factor " << fmt(sug.capacity_factor, 2) << " (" << sug.reason << ")\n";
    std::snprintf(line, sizeof line, "  %11s %10s %9s %7s %12s %10s\n", "spare slots", "max clones",
                  "max/mean", "p99", "clones/step", "memory GB");
    out << line;
    for (const SpareSlotOption& s : sug.sweep) {
      std::snprintf(line, sizeof line, "  %11d %10d %9.3f %7.3f %12.1f %10.2f\n", s.spare_slots,
                    s.max_clones, s.mean, s.p99, s.clones_per_step, s.memory_gb);
      out << line;
    }
  }
  if (!rep.findings.empty()) out << "\n";
  for (const Finding& f : rep.findings) out << severity(f.severity) << ": " << f.message << "\n";
  std::cout << out.str() << std::flush;

  if (!o.json.empty()) {
    nlohmann::json j;
    j["tool"] = "moe-echo plan";
    j["model"] = {{"name", m.name},       {"hidden", m.hidden},
                  {"ffn", m.ffn},         {"experts", m.experts},
                  {"top_k", m.top_k},     {"layers", m.layers},
                  {"seq_len", m.seq_len}, {"micro_batch", m.micro_batch},
                  {"dtype", m.dtype}};
    j["layout"] = {{"ep", l.ep}, {"etp", l.etp}, {"dp", l.dp},
                   {"pp", l.pp}, {"vpp", l.vpp}, {"world_size", rep.world_size}};
    const TrainingSpec& t = in.train;
    j["training"] = {{"capacity_factor", t.capacity_factor},
                     {"spare_slots", t.spare_slots},
                     {"max_clones", t.max_clones},
                     {"overlap", t.overlap},
                     {"comm_overlap", t.comm_overlap},
                     {"across_nodes", t.across_nodes},
                     {"shared_expert_overlap", t.shared_expert_overlap},
                     {"distributed_optimizer", t.distributed_optimizer},
                     {"recompute", t.recompute},
                     {"precision", t.precision},
                     {"fp8_gemms", t.fp8_gemms},
                     {"grad_dtype", t.grad_dtype},
                     {"cuda_graphs", t.cuda_graphs},
                     {"kernels_per_layer", t.kernels_per_layer},
                     {"reserve_gb", t.reserve_gb}};
    j["gpu"] = {{"name", in.gpu.name},
                {"memory_gb", in.gpu.memory_gb},
                {"gemm_tflops", in.gpu.gemm_tflops},
                {"nvlink_gbps", in.gpu.nvlink_gbps},
                {"network_gbps", in.gpu.network_gbps},
                {"gpus_per_node", in.gpu.gpus_per_node},
                {"launch_us", in.gpu.launch_us},
                {"graph_node_us", in.gpu.graph_node_us}};
    j["imbalance"] = {{"mean", imb.mean},
                      {"p99", imb.p99},
                      {"spill_fraction", imb.spill_fraction},
                      {"source", imb.source}};
    j["memory_gb"] = {{"weights", mem.weights_gb},
                      {"grads", mem.grads_gb},
                      {"optimizer", mem.optimizer_gb},
                      {"spare_weights", mem.spare_weights_gb},
                      {"spare_grads", mem.spare_grads_gb},
                      {"activations", mem.activations_gb},
                      {"buffers", mem.buffers_gb},
                      {"moe", mem.moe_gb},
                      {"reserve", mem.reserve_gb},
                      {"total", mem.total_gb},
                      {"capacity", mem.capacity_gb},
                      {"fits", mem.fits()},
                      {"microbatches_in_flight", mem.microbatches_in_flight},
                      {"recompute_moe_act_saves", mem.recompute_moe_act_saves_gb},
                      {"recompute_experts_saves", mem.recompute_experts_saves_gb},
                      {"recompute_dispatch_saves", mem.recompute_dispatch_saves_gb},
                      {"recompute_all_but_fc1_saves", mem.recompute_all_but_fc1_saves_gb}};
    const MoeMemory& lib = mem.library;
    j["stage_memory_bytes"] = {{"params", lib.params},
                               {"grads", lib.grads},
                               {"optimizer", lib.optimizer},
                               {"routing", lib.routing},
                               {"activations", lib.activations},
                               {"temporaries", lib.temporaries},
                               {"workspace", lib.workspace},
                               {"echo_slot_weights", lib.echo_slot_weights},
                               {"echo_slot_grads", lib.echo_slot_grads},
                               {"fp8", lib.fp8},
                               {"total", lib.total()}};
    j["layer"] = {{"tokens", lt.tokens},
                  {"capacity_rows", lt.capacity_rows},
                  {"shared_ms", lt.shared_ms},
                  {"ranks_per_token", lt.ranks_per_token},
                  {"max_ranks_per_token", lt.max_ranks_per_token},
                  {"nvlink_rows_per_token", lt.nvlink_rows_per_token},
                  {"network_rows_per_token", lt.network_rows_per_token},
                  {"dispatch_bytes", lt.dispatch_bytes},
                  {"combine_bytes", lt.combine_bytes},
                  {"etp_bytes", lt.etp_bytes},
                  {"clone_bytes", lt.clone_bytes},
                  {"comm_ms", lt.comm_ms},
                  {"clone_ms", lt.clone_ms},
                  {"gemm_ms", lt.gemm_ms},
                  {"host_ms", lt.host_ms},
                  {"exposed_comm_ms", lt.exposed_comm_ms},
                  {"wgrad_hidden_ms", lt.wgrad_hidden_ms},
                  {"layer_ms", lt.layer_ms}};
    j["stage_ms"] = rep.stage_ms;
    j["binding_wall"] = rep.binding_wall;
    j["reason"] = rep.reason;
    j["advice"] = rep.advice;
    j["findings"] = nlohmann::json::array();
    for (const Finding& f : rep.findings)
      j["findings"].push_back(
          {{"severity", severity(f.severity)}, {"field", f.field}, {"message", f.message}});
    if (simulated) {
      j["suggestion"] = {{"spare_slots", sug.spare_slots},
                         {"max_clones", sug.max_clones},
                         {"capacity_factor", sug.capacity_factor},
                         {"reason", sug.reason}};
      j["suggestion"]["sweep"] = nlohmann::json::array();
      for (const SpareSlotOption& s : sug.sweep)
        j["suggestion"]["sweep"].push_back({{"spare_slots", s.spare_slots},
                                            {"max_clones", s.max_clones},
                                            {"max_over_mean_mean", s.mean},
                                            {"max_over_mean_p99", s.p99},
                                            {"clones_per_step", s.clones_per_step},
                                            {"memory_gb", s.memory_gb}});
    }
    write_file(o.json, j.dump(1) + "\n");
  }
  return 0;
}

}  // namespace

void add_plan(CLI::App& app, Runner& run) {
  auto o = std::make_shared<PlanOptions>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Memory, communication and compute of the MoE layers per GPU for a model, parallel layout "
      "and GPU: which wall binds, validation of the combination, and a capacity factor and "
      "spare-slot count from the simulator (docs/plan.md)");
  add_option(cmd, "--preset", o->preset, "preset: " + model_preset_names(true))
      ->capture_default_str();
  add_option(cmd, "--model", o->model, "The same as --preset (deprecated)")
      ->group("Older spellings");
  add_option(cmd, "--hidden", o->hidden, "hidden size H (overrides the preset)");
  add_option(cmd, "--ffn", o->ffn, "expert FFN size F");
  add_option(cmd, "--experts", o->experts, "routed experts E");
  add_option(cmd, "--top-k", o->top_k, "experts per token K");
  add_option(cmd, "--expert-groups", o->expert_groups,
             "group-limited routing: experts in G groups (the model's; 1: no limit)");
  add_option(cmd, "--topk-groups", o->topk_groups, "groups a token picks its experts from");
  add_option(cmd, "--layers", o->layers, "MoE layers");
  add_option(cmd, "--seq-len", o->seq_len, "sequence length")->capture_default_str();
  add_option(cmd, "--micro-batch", o->micro_batch, "sequences per micro-batch")
      ->capture_default_str();
  add_option(cmd, "--dtype", o->dtype, "bf16, fp16 or fp32")->capture_default_str();
  add_option(cmd, "--ep", o->layout.ep, "expert parallel size")->capture_default_str();
  add_option(cmd, "--etp", o->layout.etp, "expert tensor parallel size")->capture_default_str();
  add_option(cmd, "--dp", o->layout.dp, "expert data parallel size")->capture_default_str();
  add_option(cmd, "--pp", o->layout.pp, "pipeline parallel size")->capture_default_str();
  add_option(cmd, "--vpp", o->layout.vpp, "virtual pipeline stages per rank")
      ->capture_default_str();
  add_option(cmd, "--gpu", o->gpu, "h200 or h100")->capture_default_str();
  add_option(cmd, "--measured", o->measured, "measured-results JSON overriding the GPU constants");
  add_option(cmd, "--memory-gb", o->memory_gb, "GPU memory, GB");
  add_option(cmd, "--gemm-tflops", o->gemm_tflops, "grouped GEMM TFLOP/s reached");
  add_option(cmd, "--nvlink-gbps", o->nvlink_gbps, "all-to-all GB/s per GPU within a node");
  add_option(cmd, "--network-gbps", o->network_gbps, "all-to-all GB/s per GPU across nodes");
  add_option(cmd, "--gpus-per-node", o->gpus_per_node, "GPUs per NVLink domain");
  add_option(cmd, "--capacity-factor", o->train.capacity_factor, "receive window / balanced rows")
      ->capture_default_str();
  add_option(cmd, "--spare-slots", o->train.spare_slots, "spare slots per rank")
      ->capture_default_str();
  add_option(cmd, "--max-clones", o->train.max_clones, "ECHO clones per expert per step")
      ->capture_default_str();
  add_option(cmd, "--shared-expert-overlap", o->train.shared_expert_overlap,
             "run the model's shared experts beside dispatch/combine (on/off; not with "
             "--comm-overlap)");
  add_option(cmd, "--overlap", o->overlap,
             field_help(moe_field("overlap"), "none") +
                 "; priced as the combine's time hidden, up to fc1's weight-gradient GEMM's");
  add_option(cmd, "--across-nodes", o->train.across_nodes,
             "how dispatch/combine cross nodes: flat (one row per token and EP rank it picks, "
             "what runs across nodes today) or hierarchical (one row per token and other node, "
             "fanned out inside that node by its forwarder: the in-process world's nodes)")
      ->capture_default_str();
  add_option(cmd, "--comm-overlap", o->train.comm_overlap,
             "price dispatch/combine hidden under the expert GEMMs, as a framework's EP "
             "communication overlap does (on/off; the layer's own overlaps are --overlap wgrad and "
             "chunks)")
      ->capture_default_str();
  add_option(cmd, "--distributed-optimizer", o->train.distributed_optimizer,
             "shard optimizer state over dp (on/off)")
      ->capture_default_str();
  add_option(cmd, "--recompute", o->train.recompute,
             "what each MoE layer keeps for its backward: none, moe_act (redo SwiGLU), experts "
             "(redo fc1, SwiGLU, fc2), dispatch (also redo the dispatch) or all_but_fc1 (keep "
             "fc1's output, redo the dispatch, SwiGLU and fc2)")
      ->capture_default_str();
  add_option(cmd, "--precision", o->train.precision,
             "the routed experts' GEMMs: bf16 or fp8 (memory of the e4m3 copies, time at the "
             "GPU's fp8_gemm_tflops)")
      ->capture_default_str();
  add_option(cmd, "--fp8-gemms", o->train.fp8_gemms,
             "with --precision fp8, which expert GEMMs are priced and sized in FP8: all or a "
             "list of fprop1, fprop2, dgrad1, dgrad2, wgrad1, wgrad2, fprop, dgrad, wgrad")
      ->capture_default_str();
  add_option(cmd, "--grad-dtype", o->train.grad_dtype,
             "gradients: fp32 (the MoE layers accumulate in fp32)")
      ->capture_default_str();
  add_option(cmd, "--cuda-graphs", o->train.cuda_graphs,
             "the step replays as a CUDA graph (on/off)")
      ->capture_default_str();
  add_option(cmd, "--kernels-per-layer", o->train.kernels_per_layer,
             "kernel launches per MoE layer, forward + backward")
      ->capture_default_str();
  add_option(cmd, "--reserve-gb", o->train.reserve_gb, "memory of everything but the MoE layers")
      ->capture_default_str();
  add_option(cmd, "--imbalance", o->imbalance,
             "busiest rank / mean to plan for (skips the simulator)");
  add_option(cmd, "--trace", o->trace, "routing trace for the simulator (.csv or .json)");
  add_option(cmd, "--sim-steps", o->sweep.steps, "simulator steps per spare-slot count")
      ->capture_default_str();
  add_option(cmd, "--sim-layers", o->sweep.layers, "simulator layers")->capture_default_str();
  add_option(cmd, "--seed", o->sweep.seed, "simulator seed")->capture_default_str();
  add_option(cmd, "--threads", o->sweep.threads, "simulator threads")->capture_default_str();
  add_option(cmd, "--json", o->json, "write the report as JSON");
  cmd->callback([&run, o] { run = [o] { return run_plan(*o); }; });
}

}  // namespace moe_echo::cli
