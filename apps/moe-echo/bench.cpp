// moe-echo bench: training steps (forward + backward) of L MoE layers on synthetic tokens with
// skewed expert popularity, one table row per step and a summary; --json writes every number.
// Each layer's output feeds the next and the backwards run in reverse; the layers share one
// MoeStack (one workspace) or, with --separate, are L MoeLayers each with its own workspace.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "commands.hpp"
#include "layer_options.hpp"
#include "moe_echo/backends.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/dist.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/layer.hpp"
#include "moe_echo/random.hpp"
#include "moe_echo/stats.hpp"
#include "moe_echo/synthetic.hpp"
#include "progress.hpp"

#ifdef MOE_ECHO_WITH_CUDA
#include <cuda_runtime.h>

#include <future>

#include "moe_echo/cuda.hpp"
#include "moe_echo/cuda_check.hpp"
#endif
#ifdef MOE_ECHO_WITH_NCCL
#include "moe_echo/nccl.hpp"
#endif

namespace moe_echo::cli {
namespace {

struct BenchOptions {
  LayerOptions layer;
  int steps = 20;
  std::optional<int> warmup;
  std::string skew = "zipf:1.2";
  std::string json;
  std::string dispatcher = "syncfree";  // GPU ranks: syncfree or baseline
  std::string capture = "off";          // GPU: on = one CUDA graph per step, replayed
  std::string phases = "off";           // GPU: on = time each phase of the step
  std::optional<int> comm_ctas;         // GPU ranks: CTAs of the NCCL kernels (unset: its default)
  int layers = 1;                       // L layers per step
  bool separate = false;                // L MoeLayers with their own workspaces, not one MoeStack
  bool split_phases = false;            // each forward and backward as its three split calls
  int ranks_per_node = 0;               // CPU ranks: the in-process world's nodes (0: one node)
};

// The most layers one bench step runs.
constexpr int kMaxLayers = 4096;
// The most steps of a run, and of steps times layers: the table keeps every step's statistics of
// every layer (about 100 bytes each) for the summary and --json.
constexpr int kMaxSteps = 1000000;
constexpr int64_t kMaxStepLayers = 10000000;

// One layer's statistics of a step (rank 0's view, as StepStats).
struct LayerRow {
  double mm_no_echo = 0, mm_echo = 0;
  int clones = 0;
  int64_t clone_bytes = 0, overflow_rows = 0;
  int spill_rounds = 0;
  double aux_loss = 0, z_loss = 0;
};

// A step of all L layers: times of all forwards and all backwards; statistics summed over the
// layers (rows per rank, clones, clone bytes, overflow rows, spill rounds, losses) or averaged
// (load max/mean, ranks per token; the most ranks per token is the largest), and per layer.
struct StepRow {
  int step = 0;
  double fwd_ms = 0, bwd_ms = 0, tokens_per_s = 0;
  double step_ms = 0, ms_per_layer = 0;
  double mm_no_echo = 0, mm_echo = 0;
  int clones = 0;
  int64_t clone_bytes = 0, overflow_rows = 0;
  int spill_rounds = 0;
  double aux_loss = 0, z_loss = 0, seq_aux_loss = 0;
  double ranks_per_token = 0;  // rank 0's tokens: mean ranks their rows go to
  int max_ranks_per_token = 0;
  int64_t dispatch_bytes = 0, dispatch_row_bytes = 0;  // rank 0's forward dispatch, all layers
  std::vector<int32_t> load_before, load_after;
  std::vector<LayerRow> layers;
};

// What the MoE objects allocated on rank 0, and the estimate made before building them.
struct BenchMemory {
  size_t total = 0;      // everything: the workspaces and the layers' own parts
  size_t workspace = 0;  // the stack's one workspace, or the sum of every layer's own
  size_t layers = 0;     // the layers' own parts (parameters, gradients, routing, kept activations)
  double estimate = 0;   // moe_bytes_per_rank, which check_memory compared against the memory
  MoeMemory parts;       // the estimate by part
};

double mib(double bytes) { return bytes / (1 << 20); }

// The bench's L layers on one rank: one MoeStack (one workspace for all) or, with --separate,
// L MoeLayers each with its own workspace. Layer l is initialised from seed + l either way, so
// both hold the same weights and compute the same results. Built without optimizer state (the
// bench does not update weights).
class BenchLayers {
 public:
  BenchLayers(Backend& backend, Communicator& comm, const ResolvedLayer& L, int layers,
              bool separate, int rank, uint64_t seed, bool split_phases)
      : split_(split_phases) {
    const ParallelConfig par{L.ep, rank};
    if (!separate) {
      stack_ =
          std::make_unique<MoeStack>(backend, comm, std::vector<MoeConfig>(size_t(layers), L.moe),
                                     par, L.echo, seed, /*optimizer_state=*/false);
      return;
    }
    for (int l = 0; l < layers; ++l)
      separate_.push_back(std::make_unique<MoeLayer>(backend, comm, L.moe, par, L.echo,
                                                     seed + uint64_t(l),
                                                     /*optimizer_state=*/false));
  }
  int size() const { return stack_ ? stack_->size() : int(separate_.size()); }
  MoeLayer& layer(int l) { return stack_ ? stack_->layer(l) : *separate_[size_t(l)]; }

  BenchMemory memory() const {
    BenchMemory m;
    if (stack_) {
      m.workspace = stack_->workspace().bytes();
      for (int l = 0; l < stack_->size(); ++l) m.layers += stack_->layer(l).layer_bytes();
      m.total = stack_->bytes();
    } else {
      for (const auto& l : separate_) {
        m.layers += l->layer_bytes();
        m.total += l->workspace_bytes();
      }
      m.workspace = m.total - m.layers;
    }
    return m;
  }

  void set_phase_observer(PhaseObserver* observer) {
    for (int l = 0; l < size(); ++l) layer(l).set_phase_observer(observer);
  }
  void zero_grad(Stream s = nullptr) {
    for (int l = 0; l < size(); ++l) layer(l).zero_grad(s);
  }
  // acts[0] is the input, acts[l + 1] layer l's output and layer l + 1's input.
  void forward(const std::vector<Tensor>& acts, Stream s = nullptr) {
    for (int l = 0; l < size(); ++l) {
      if (!split_) {
        layer(l).forward(acts[size_t(l)], acts[size_t(l + 1)], s);
        continue;
      }
      layer(l).forward_dispatch(acts[size_t(l)], acts[size_t(l + 1)], s);
      layer(l).forward_experts(s);
      layer(l).forward_combine(s);
    }
  }
  // grads[L] is the output's gradient, grads[l] layer l's input gradient; in reverse order.
  void backward(const std::vector<Tensor>& grads, Stream s = nullptr) {
    for (int l = size() - 1; l >= 0; --l) {
      if (!split_) {
        layer(l).backward(grads[size_t(l + 1)], grads[size_t(l)], s);
        continue;
      }
      layer(l).backward_dispatch(grads[size_t(l + 1)], grads[size_t(l)], s);
      layer(l).backward_experts(s);
      layer(l).backward_combine(s);
    }
  }
  std::vector<StepStats> stats() {
    std::vector<StepStats> st;
    for (int l = 0; l < size(); ++l) st.push_back(layer(l).stats());
    return st;
  }

 private:
  bool split_ = false;
  std::unique_ptr<MoeStack> stack_;
  std::vector<std::unique_ptr<MoeLayer>> separate_;
};

// What both paths (CPU ranks as threads; one GPU per process) report, printed by rank 0.
struct Report {
  Report(const BenchOptions& opts, const ResolvedLayer& layer, const char* backend_name)
      : o(opts), L(layer), backend(backend_name) {}
  const BenchOptions& o;
  const ResolvedLayer& L;
  const char* backend;
  int warmup = 0;
  BenchMemory memory;
  std::string dispatcher, capture;  // GPU path only
  std::string device;
  std::vector<StepRow> rows;
  // --phases on: per phase, per timed step, the slowest rank's and the ranks' mean ms.
  std::vector<std::string> phase_names;
  std::vector<std::vector<double>> phase_max, phase_mean;
  // CPU ranks on more than one node: the rows dispatch and combine moved over the run.
  int ranks_per_node = 0;
  std::optional<InProcessWorld::Traffic> traffic;

  void header() const {
    const MoeConfig& moe = L.moe;
    std::printf(
        "moe-echo bench: preset %s, backend %s, H %d, F %d, E %d, top-%d %s, %d tokens/rank, "
        "EP %d, ECHO %s (spare slots %d, max clones %d), capacity factor %.2f, skew %s\n",
        L.preset.c_str(), backend, moe.hidden, moe.ffn, moe.experts, moe.top_k,
        to_string(moe.score_function), moe.max_tokens, L.ep, L.echo.enabled ? "on" : "off",
        L.echo.spare_slots_per_rank, L.echo.max_clones_per_expert, L.moe.capacity_factor,
        o.skew.c_str());
    if (moe.expert_groups > 1 || moe.routed_scaling_factor != 1.0 || moe.seq_aux_loss_coeff > 0 ||
        moe.shared_experts > 0)
      std::printf(
          "routing: %d expert groups, top %d by %s, weights %s x %.3g, sequence aux loss %g "
          "(sequences of %d), %d shared expert(s)\n",
          moe.expert_groups, moe.topk_groups, to_string(moe.group_score),
          moe.normalize_topk ? "normalised" : "raw", moe.routed_scaling_factor,
          moe.seq_aux_loss_coeff, moe.seq_len, moe.shared_experts);
    if (!dispatcher.empty())
      std::printf(
          "GPU ranks: %d x %s, dispatcher %s, capture %s (times: CUDA events, max over "
          "ranks)\n",
          L.ep, device.c_str(), dispatcher.c_str(), capture.c_str());
    if (L.tokens_reduced_for_cpu)
      std::printf(
          "note: the CPU backend runs preset %s with %d tokens per rank (set --tokens to "
          "change)\n",
          L.preset.c_str(), moe.max_tokens);
    std::printf("layers: %d, %s, recompute %s, overlap %s, chunks %d, precision %s%s\n", o.layers,
                o.separate ? "separate (each MoeLayer with its own workspace)"
                           : "one MoeStack (one workspace for all)",
                to_string(moe.recompute),
                moe.overlap == Overlap::wgrad
                    ? ("wgrad (" + std::to_string(moe.overlap_sms) + " SMs left)").c_str()
                    : "none",
                moe.chunks, to_string(moe.precision),
                moe.precision == Precision::fp8
                    ? (" (fp8 GEMMs: " + fp8_gemms_to_string(moe.fp8_gemms) + ")").c_str()
                    : "");
  }

  // After the layers are built: what they allocated, and the table's head.
  void table_header() const {
    print_memory();
    std::printf("%5s %9s %9s %9s %9s %11s %12s %12s %6s %9s %6s\n", "step", "fwd_ms", "bwd_ms",
                "step_ms", "ms/layer", "tokens/s", "max/mean", "max/mean", "clones", "overflow",
                "spill");
    std::printf("%5s %9s %9s %9s %9s %11s %12s %12s %6s %9s %6s\n", "", "", "", "", "", "",
                "(no ECHO)", L.echo.enabled ? "(ECHO)" : "(ECHO off)", "", "rows", "rounds");
    std::fflush(stdout);
  }

  void print_memory() const {
    std::printf(
        "MoE memory per rank: %.2f MiB allocated = %s %.2f MiB + layers' own %.2f MiB "
        "(%.2f MiB per layer; estimated before building %.2f MiB)\n",
        mib(double(memory.total)), o.separate ? "workspaces" : "shared workspace",
        mib(double(memory.workspace)), mib(double(memory.layers)),
        mib(double(memory.total)) / o.layers, mib(memory.estimate));
  }

  // Fills the row's statistics from rank 0's layers (one StepStats per layer) and prints it. A
  // statistic or time that is NaN or infinite ends the run (moe_echo::Error naming the step, the
  // layer and the quantity).
  void add(StepRow row, const std::vector<StepStats>& layers) {
    const auto finite = [&](const char* name, double v, int layer) {
      if (std::isfinite(v)) return;
      throw Error("bench: step " + std::to_string(row.step) +
                  (layer < 0 ? std::string() : ", layer " + std::to_string(layer)) + ": " + name +
                  " is " + std::to_string(v) + " (not finite); the run is stopped");
    };
    finite("fwd_ms", row.fwd_ms, -1);
    finite("bwd_ms", row.bwd_ms, -1);
    const int R = L.ep, T = L.moe.max_tokens, n = int(layers.size());
    row.step_ms = row.fwd_ms + row.bwd_ms;
    row.ms_per_layer = row.step_ms / n;
    row.tokens_per_s = double(R) * T / (row.step_ms * 1e-3);
    row.load_before.assign(size_t(R), 0);
    row.load_after.assign(size_t(R), 0);
    for (int l = 0; l < n; ++l) {
      const StepStats& st = layers[size_t(l)];
      finite("aux_loss", st.aux_loss, n > 1 ? l : -1);
      finite("z_loss", st.z_loss, n > 1 ? l : -1);
      finite("load max/mean without ECHO", st.max_over_mean_before, n > 1 ? l : -1);
      finite("load max/mean with ECHO", st.max_over_mean_after, n > 1 ? l : -1);
      LayerRow lr;
      lr.mm_no_echo = st.max_over_mean_before;
      lr.mm_echo = st.max_over_mean_after;
      lr.clones = st.clones;
      lr.clone_bytes = st.clone_bytes;
      lr.overflow_rows = st.overflow_rows_all;
      lr.spill_rounds = st.spill_rounds;
      lr.aux_loss = st.aux_loss;
      lr.z_loss = st.z_loss;
      row.layers.push_back(lr);
      row.mm_no_echo += lr.mm_no_echo / n;
      row.mm_echo += lr.mm_echo / n;
      row.clones += lr.clones;
      row.clone_bytes += lr.clone_bytes;
      row.overflow_rows += lr.overflow_rows;
      row.spill_rounds += lr.spill_rounds;
      row.aux_loss += st.aux_loss;
      row.z_loss += st.z_loss;
      row.seq_aux_loss += st.seq_aux_loss;
      row.ranks_per_token += st.ranks_per_token_mean / n;
      row.max_ranks_per_token = std::max(row.max_ranks_per_token, st.ranks_per_token_max);
      row.dispatch_bytes += st.dispatch_bytes;
      row.dispatch_row_bytes = st.dispatch_row_bytes;
      for (size_t r = 0; r < size_t(R) && r < st.load_before.size(); ++r) {
        row.load_before[r] += st.load_before[r];
        row.load_after[r] += st.load_after[r];
      }
    }
    std::printf("%5d %9.3f %9.3f %9.3f %9.3f %11.0f %12.3f %12.3f %6d %9lld %6d\n", row.step,
                row.fwd_ms, row.bwd_ms, row.step_ms, row.ms_per_layer, row.tokens_per_s,
                row.mm_no_echo, row.mm_echo, row.clones, (long long)row.overflow_rows,
                row.spill_rounds);
    std::fflush(stdout);
    rows.push_back(row);
  }

  void summary() const;
};

void Report::summary() const {
  const MoeConfig& moe = L.moe;
  const int R = L.ep, T = moe.max_tokens, H = moe.hidden;
  std::vector<double> f, b, tps, before, after, clones, clone_bytes, reach, dispatch_bytes;
  int reach_max = 0;
  int64_t overflow = 0;
  int spill_steps = 0;
  for (const StepRow& r : rows) {
    if (r.step >= warmup) {
      f.push_back(r.fwd_ms);
      b.push_back(r.bwd_ms);
      tps.push_back(r.tokens_per_s);
    }
    before.push_back(r.mm_no_echo);
    after.push_back(r.mm_echo);
    clones.push_back(r.clones);
    clone_bytes.push_back(double(r.clone_bytes));
    dispatch_bytes.push_back(double(r.dispatch_bytes));
    reach.push_back(r.ranks_per_token);
    reach_max = std::max(reach_max, r.max_ranks_per_token);
    overflow += r.overflow_rows;
    spill_steps += r.spill_rounds > 0;
  }
  const double fwd_ms = median(f), bwd_ms = median(b);
  const double tokens_per_s = double(R) * T / ((fwd_ms + bwd_ms) * 1e-3);
  std::printf("\nsummary over %d steps (times: median of steps %d..%d)\n", o.steps, warmup,
              o.steps - 1);
  std::printf("  forward %.3f ms, backward %.3f ms, %.0f tokens/s (all %d ranks)\n", fwd_ms, bwd_ms,
              tokens_per_s, R);
  std::printf("  step %.3f ms for %d layer(s): %.3f ms per layer\n", fwd_ms + bwd_ms, o.layers,
              (fwd_ms + bwd_ms) / o.layers);
  std::printf("  ");
  print_memory();
  std::printf("  rank load max/mean without ECHO: mean %.3f, p99 %.3f\n", mean(before),
              percentile(before, 0.99));
  if (L.echo.enabled)
    std::printf(
        "  rank load max/mean with ECHO:    mean %.3f, p99 %.3f; %.2f clones/step, "
        "%.1f KiB clone traffic/step\n",
        mean(after), percentile(after, 0.99), mean(clones), mean(clone_bytes) / 1024);
  std::printf("  ranks a token's rows go to (rank 0's tokens): mean %.2f, at most %d\n",
              mean(reach), reach_max);
  std::printf("  overflow rows (beyond capacity %lld, run in spill rounds): %lld in %d steps\n",
              (long long)capacity_rows(moe), (long long)overflow, spill_steps);
  const bool nodes = traffic && ranks_per_node < R;
  const double per_step = 1.0 / (double(o.steps) * o.layers);
  if (nodes)
    std::printf(
        "  rows a layer's step moves on %d nodes of %d ranks (all ranks): dispatch %.1f across "
        "nodes (one per token and node), %.1f within; combine %.1f across, %.1f within\n",
        R / ranks_per_node, ranks_per_node, traffic->dispatch_across * per_step,
        traffic->dispatch_within * per_step, traffic->combine_across * per_step,
        traffic->combine_within * per_step);
  if (!phase_names.empty()) {
    std::printf(
        "\n  phases (ms, median over timed steps; a phase ends where the next starts; comm\n"
        "  phases include the wait for the slowest peer%s)\n  %-22s %9s %9s\n",
        o.layers > 1 ? "; each phase summed over the layers" : "", "phase", "max rank", "mean");
    for (size_t i = 0; i < phase_names.size(); ++i)
      std::printf("  %-22s %9.3f %9.3f\n", phase_names[i].c_str(), median(phase_max[i]),
                  median(phase_mean[i]));
  }

  if (o.json.empty()) return;
  using nlohmann::json;
  json j;
  j["command"] = "bench";
  j["version"] = "0.1.0";
  j["backend"] = backend;
  j["config"] = {{"preset", L.preset},
                 {"hidden", H},
                 {"ffn", moe.ffn},
                 {"experts", moe.experts},
                 {"top_k", moe.top_k},
                 {"tokens_per_rank", T},
                 {"ep", R},
                 {"score_function", to_string(moe.score_function)},
                 {"normalize_topk", moe.normalize_topk},
                 {"expert_groups", moe.expert_groups},
                 {"topk_groups", moe.topk_groups},
                 {"group_score", to_string(moe.group_score)},
                 {"routed_scaling_factor", moe.routed_scaling_factor},
                 {"seq_aux_loss_coeff", moe.seq_aux_loss_coeff},
                 {"seq_len", moe.seq_len},
                 {"shared_experts", moe.shared_experts},
                 {"echo", L.echo.enabled},
                 {"spare_slots", L.echo.spare_slots_per_rank},
                 {"max_clones", L.echo.max_clones_per_expert},
                 {"capacity_factor", L.moe.capacity_factor},
                 {"capacity_rows", capacity_rows(moe)},
                 {"clone_cost_rows", L.echo.clone_cost_rows},
                 {"skew", o.skew},
                 {"steps", o.steps},
                 {"warmup", warmup},
                 {"seed", o.layer.seed},
                 {"layers", o.layers},
                 {"recompute", to_string(moe.recompute)},
                 {"overlap", to_string(moe.overlap)},
                 {"overlap_sms", moe.overlap_sms},
                 {"chunks", moe.chunks},
                 {"precision", to_string(moe.precision)},
                 {"fp8_gemms", fp8_gemms_to_string(moe.fp8_gemms)},
                 {"separate", o.separate},
                 {"split_phases", o.split_phases},
                 {"workspace_bytes_per_rank", memory.total}};
  j["memory"] = {{"moe_bytes_per_rank", memory.total},
                 {"workspace_bytes", memory.workspace},
                 {"layers_bytes", memory.layers},
                 {"bytes_per_layer", double(memory.total) / o.layers},
                 {"estimate_bytes", memory.estimate}};
  // By part, as estimated (MoeMemory); step_state_bytes: what a step holds beside the parameters,
  // their gradients and optimizer state (routing, kept activations, temporaries, workspace, echo
  // slots).
  const MoeMemory& p = memory.parts;
  j["memory"]["parts"] = {{"params", p.params},
                          {"grads", p.grads},
                          {"optimizer", p.optimizer},
                          {"routing", p.routing},
                          {"activations", p.activations},
                          {"temporaries", p.temporaries},
                          {"workspace", p.workspace},
                          {"echo_slot_weights", p.echo_slot_weights},
                          {"echo_slot_grads", p.echo_slot_grads},
                          {"fp8", p.fp8}};
  j["memory"]["step_state_bytes"] = p.routing + p.activations + p.temporaries + p.workspace +
                                    p.echo_slot_weights + p.echo_slot_grads + p.fp8;
  if (!dispatcher.empty()) {
    j["config"]["dispatcher"] = dispatcher;
    j["config"]["capture"] = capture;
    j["config"]["device"] = device;
    j["config"]["processes"] = R;
  }
  j["steps"] = json::array();
  for (const StepRow& r : rows) {
    json layers = json::array();
    for (const LayerRow& lr : r.layers)
      layers.push_back({{"load_max_over_mean_no_echo", lr.mm_no_echo},
                        {"load_max_over_mean_echo", lr.mm_echo},
                        {"clones", lr.clones},
                        {"clone_bytes", lr.clone_bytes},
                        {"overflow_rows", lr.overflow_rows},
                        {"spill_rounds", lr.spill_rounds},
                        {"aux_loss", lr.aux_loss},
                        {"z_loss", lr.z_loss}});
    j["steps"].push_back({{"step", r.step},
                          {"fwd_ms", r.fwd_ms},
                          {"bwd_ms", r.bwd_ms},
                          {"step_ms", r.step_ms},
                          {"step_ms_per_layer", r.ms_per_layer},
                          {"tokens_per_s", r.tokens_per_s},
                          {"load_max_over_mean_no_echo", r.mm_no_echo},
                          {"load_max_over_mean_echo", r.mm_echo},
                          {"rank_rows_no_echo", r.load_before},
                          {"rank_rows_echo", r.load_after},
                          {"clones", r.clones},
                          {"clone_bytes", r.clone_bytes},
                          {"overflow_rows", r.overflow_rows},
                          {"spill_rounds", r.spill_rounds},
                          {"aux_loss", r.aux_loss},
                          {"z_loss", r.z_loss},
                          {"seq_aux_loss", r.seq_aux_loss},
                          {"ranks_per_token", r.ranks_per_token},
                          {"max_ranks_per_token", r.max_ranks_per_token},
                          {"dispatch_bytes", r.dispatch_bytes},
                          {"layers", layers}});
  }
  json s = {{"fwd_ms", fwd_ms},
            {"bwd_ms", bwd_ms},
            {"step_ms", fwd_ms + bwd_ms},
            {"step_ms_per_layer", (fwd_ms + bwd_ms) / o.layers},
            {"moe_bytes_per_rank", memory.total},
            {"tokens_per_s", tokens_per_s},
            {"load_max_over_mean_no_echo", mean(before)},
            {"load_max_over_mean_no_echo_p99", percentile(before, 0.99)},
            {"clones_per_step", mean(clones)},
            {"ranks_per_token", mean(reach)},
            {"max_ranks_per_token", reach_max},
            {"clone_bytes_per_step", mean(clone_bytes)},
            {"dispatch_row_bytes", rows.empty() ? 0 : rows.front().dispatch_row_bytes},
            {"dispatch_bytes_per_step", mean(dispatch_bytes)},
            {"overflow_rows", overflow},
            {"steps_with_spill", spill_steps}};
  if (nodes) {
    j["config"]["ranks_per_node"] = ranks_per_node;
    s["rows_per_layer_step"] = {{"dispatch_across_nodes", traffic->dispatch_across * per_step},
                                {"dispatch_within_nodes", traffic->dispatch_within * per_step},
                                {"combine_across_nodes", traffic->combine_across * per_step},
                                {"combine_within_nodes", traffic->combine_within * per_step}};
  }
  if (L.echo.enabled) {
    s["load_max_over_mean_echo"] = mean(after);
    s["load_max_over_mean_echo_p99"] = percentile(after, 0.99);
  } else {
    s["load_max_over_mean_echo"] = nullptr;
    s["load_max_over_mean_echo_p99"] = nullptr;
  }
  if (!phase_names.empty()) {
    json ph = json::array();
    for (size_t i = 0; i < phase_names.size(); ++i)
      ph.push_back({{"phase", phase_names[i]},
                    {"max_rank_ms", median(phase_max[i])},
                    {"mean_ms", median(phase_mean[i])}});
    s["phases"] = ph;
  }
  j["summary"] = s;
  write_file(o.json, j.dump(2) + "\n");
  std::printf("wrote %s\n", o.json.c_str());
}

int check_steps(BenchOptions& o) {
  if (o.steps < 1 || o.steps > kMaxSteps)
    reject("steps", o.steps, "1 <= steps <= " + std::to_string(kMaxSteps));
  if (int64_t(o.steps) * o.layers > kMaxStepLayers)
    reject("steps", o.steps,
           "steps * layers <= " + std::to_string(kMaxStepLayers) + " (layers " +
               std::to_string(o.layers) + "; every layer's statistics of every step are kept)");
  if (!o.warmup) o.warmup = std::min(1, o.steps - 1);
  if (*o.warmup < 0 || *o.warmup >= o.steps)
    reject("warmup", *o.warmup, "0 <= warmup < steps (" + std::to_string(o.steps) + ")");
  return *o.warmup;
}

#ifdef MOE_ECHO_WITH_CUDA
int run_bench_gpu(const BenchOptions& opts, const DistEnv& env);
#endif

int run_bench(const BenchOptions& opts) {
  const DistEnv env = DistEnv::from_env();
  if (opts.layers < 1 || opts.layers > kMaxLayers)
    reject("layers", opts.layers, "1 <= layers <= " + std::to_string(kMaxLayers));
  if (opts.capture != "on" && opts.capture != "off")
    reject("capture", "'" + opts.capture + "'", "on or off");
  if (opts.phases != "on" && opts.phases != "off")
    reject("phases", "'" + opts.phases + "'", "on or off");
  if (opts.comm_ctas && (*opts.comm_ctas < 1 || *opts.comm_ctas > 128))
    reject("comm_ctas", *opts.comm_ctas, "1 <= comm_ctas <= 128 (unset: the communicator's 128)");
  check_output_path("json", opts.json);
  if (opts.dispatcher != "syncfree" && opts.dispatcher != "baseline")
    reject("dispatcher", "'" + opts.dispatcher + "'", "syncfree or baseline");
  if (env.world_size > 1 && opts.layer.backend == "cpu")
    reject("WORLD_SIZE", env.world_size,
           "1 with --backend cpu: the CPU backend runs its ranks as threads of one process; run "
           "`moe-echo bench --backend cpu --ep " +
               std::to_string(env.world_size) + "` without moe-echo launch");
#ifdef MOE_ECHO_WITH_CUDA
  if (env.world_size > 1 || opts.layer.backend == "cuda" ||
      (opts.layer.backend == "auto" && cuda_backend_available())) {
    if (opts.ranks_per_node != 0)
      reject("ranks_per_node", opts.ranks_per_node,
             "0 on GPU ranks (their nodes are the machines NCCL finds; the option places the CPU "
             "backend's in-process ranks on nodes)");
    return run_bench_gpu(opts, env);
  }
#endif
  if (env.world_size > 1)
    reject("WORLD_SIZE", env.world_size,
           "1: this moe-echo is built without CUDA, and the CPU backend runs its ranks as threads "
           "of one process; run `moe-echo bench --ep " +
               std::to_string(env.world_size) + "` without moe-echo launch");
  if (opts.capture == "on")
    reject("capture", "on", "off on the CPU backend (CUDA graphs need a GPU)");
  if (opts.phases == "on")
    reject("phases", "on", "off on the CPU backend (phases are timed with CUDA events)");
  if (opts.dispatcher != "syncfree")
    reject("dispatcher", "'" + opts.dispatcher + "'",
           "syncfree on the CPU backend (in-process ranks)");
  if (opts.comm_ctas)
    reject("comm_ctas", *opts.comm_ctas,
           "unset on the CPU backend (it sets the NCCL kernels of GPU ranks)");
  auto probe = make_backend(opts.layer.backend);
  const ResolvedLayer L = resolve(opts.layer, *probe);
  BenchOptions o = opts;
  const int warmup = check_steps(o);
  const SkewSpec skew = parse_skew(o.skew, "skew");
  const MoeConfig& moe = L.moe;
  const int R = L.ep, T = moe.max_tokens, H = moe.hidden;
  if (moe.experts > moe.hidden)
    throw ConfigError("experts", "experts = " + std::to_string(moe.experts) +
                                     " is invalid for bench: synthetic routing needs experts <= "
                                     "hidden (" +
                                     std::to_string(moe.hidden) + ")");
  if (o.ranks_per_node < 0 || (o.ranks_per_node > 0 && R % o.ranks_per_node != 0))
    reject("ranks_per_node", o.ranks_per_node,
           "0 (one node) or a divisor of the ranks (ep " + std::to_string(R) + ")");
  // Ranks of the CPU backend share this process: refuse what cannot fit rather than swap or die.
  // Per rank: the layers, and the inputs and gradients of every layer boundary (L + 1 of each).
  const int NL = o.layers;
  check_memory(L, *probe, NL, !o.separate, /*optimizer_state=*/false, 2.0 * (NL + 1) * T * H * 8);
  SyntheticTokens synth(moe.experts, H, skew, o.layer.seed);

  Report report(o, L, probe->name());
  report.warmup = warmup;
  report.memory.estimate = moe_bytes_per_rank(L, *probe, NL, !o.separate, false);
  report.memory.parts = moe_memory_per_rank(L, *probe, NL, !o.separate, false);
  report.header();
  std::fflush(stdout);
  warn_if_slow_on_cpu("bench", L, NL, o.steps);

  std::vector<std::vector<double>> fwd(size_t(R), std::vector<double>(size_t(o.steps))), bwd = fwd;
  const auto start = std::chrono::steady_clock::now();
  // A line on stderr whenever the run is quiet for 5 s (GPU-sized layers on the CPU).
  Heartbeat heartbeat("bench", o.steps);
  heartbeat.stage("building the layers");
  InProcessWorld world(R, default_timeout(), o.ranks_per_node);
  world.run([&](int rank) {
    auto backend = make_backend(o.layer.backend);
    std::unique_ptr<Communicator> comm_holder;
    Communicator& comm = rank_communicator(*backend, world, rank, comm_holder);
    BenchLayers layers(*backend, comm, L, NL, o.separate, rank, o.layer.seed, o.split_phases);
    if (rank == 0) layers.set_phase_observer(&heartbeat);
    for (int l = 0; l < NL; ++l)
      write_tensor(*backend, layers.layer(l).param(Param::router_weight), synth.router_weight());
    if (rank == 0) {
      const double estimate = report.memory.estimate;
      const MoeMemory parts = report.memory.parts;
      report.memory = layers.memory();
      report.memory.estimate = estimate;
      report.memory.parts = parts;
      report.table_header();
      heartbeat.printed();
    }
    RankTensors alloc(*backend);
    std::vector<Tensor> acts, grads;  // acts[0] = x, acts[L] = y; grads[L] = dy, grads[0] = dx
    for (int l = 0; l <= NL; ++l) acts.push_back(alloc({T, H})), grads.push_back(alloc({T, H}));
    std::vector<double> dy_host(size_t(T) * size_t(H));
    for (int step = 0; step < o.steps; ++step) {
      if (rank == 0) heartbeat.step(step);
      write_tensor(*backend, acts[0], synth.tokens(step, rank, T));
      Rng rng(o.layer.seed ^ 0xd1ull, uint64_t(step), uint64_t(rank));
      for (auto& v : dy_host) v = rng.normal() / double(T);
      write_tensor(*backend, grads[size_t(NL)], dy_host);
      layers.zero_grad();
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      if (rank == 0) heartbeat.stage("forward");
      layers.forward(acts);
      backend->synchronize();
      const auto t1 = std::chrono::steady_clock::now();
      if (rank == 0) heartbeat.stage("backward");
      layers.backward(grads);
      backend->synchronize();
      const auto t2 = std::chrono::steady_clock::now();
      fwd[size_t(rank)][size_t(step)] = std::chrono::duration<double, std::milli>(t1 - t0).count();
      bwd[size_t(rank)][size_t(step)] = std::chrono::duration<double, std::milli>(t2 - t1).count();
      comm.barrier();
      if (rank != 0) continue;
      const std::vector<StepStats> st = layers.stats();
      StepRow row;
      row.step = step;
      for (int r = 0; r < R; ++r) {
        row.fwd_ms = std::max(row.fwd_ms, fwd[size_t(r)][size_t(step)]);
        row.bwd_ms = std::max(row.bwd_ms, bwd[size_t(r)][size_t(step)]);
      }
      report.add(row, st);
      const double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (elapsed > 3.0 && step + 1 < o.steps)
        std::fprintf(stderr, "[bench] step %d/%d, %.1f s elapsed, about %.0f s left\n", step + 1,
                     o.steps, elapsed, elapsed / (step + 1) * (o.steps - step - 1));
      heartbeat.printed();
    }
  });

  report.ranks_per_node = world.ranks_per_node();
  report.traffic = world.traffic();
  report.summary();
  return 0;
}

#ifdef MOE_ECHO_WITH_CUDA
// --phases on: an event where each phase of the step starts, in the order of the first step's
// marks (every step marks the same phases; inside a capture the records become graph nodes).
class PhaseEvents final : public PhaseObserver {
 public:
  ~PhaseEvents() override {
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
  }
  void start_step(unsigned flags) {
    next_ = 0;
    flags_ = flags;
  }
  void mark(const char* phase, Stream stream) override {
    if (next_ == names_.size()) {
      cudaEvent_t e;
      MOE_ECHO_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
      names_.emplace_back(phase);
    }
    MOE_ECHO_CHECK(names_[next_] == phase, "phase " << next_ << " of the step is '" << phase
                                                    << "', it was '" << names_[next_] << "'");
    MOE_ECHO_CUDA_CHECK(
        cudaEventRecordWithFlags(events_[next_++], static_cast<cudaStream_t>(stream), flags_));
  }
  const std::vector<std::string>& names() const { return names_; }
  // Milliseconds of each phase of the last step; the last one ends at `end`.
  std::vector<double> elapsed(cudaEvent_t end) const {
    std::vector<double> ms(events_.size());
    for (size_t i = 0; i < events_.size(); ++i) {
      float t = 0;
      MOE_ECHO_CUDA_CHECK(
          cudaEventElapsedTime(&t, events_[i], i + 1 < events_.size() ? events_[i + 1] : end));
      ms[i] = t;
    }
    return ms;
  }

 private:
  std::vector<std::string> names_;
  std::vector<cudaEvent_t> events_;
  size_t next_ = 0;
  unsigned flags_ = cudaEventRecordDefault;
};

// The marks of a step summed by phase name, in the order of each name's first mark: every layer
// marks the same phases, so with L layers each phase is the sum of its L occurrences (the phases
// still add up to the step). `names` gets the names.
std::vector<double> sum_by_phase(const std::vector<std::string>& marks,
                                 const std::vector<double>& ms, std::vector<std::string>& names) {
  names.clear();
  std::vector<double> sums;
  for (size_t i = 0; i < marks.size(); ++i) {
    const auto at = std::find(names.begin(), names.end(), marks[i]);
    if (at == names.end()) {
      names.push_back(marks[i]);
      sums.push_back(ms[i]);
    } else {
      sums[size_t(at - names.begin())] += ms[i];
    }
  }
  return sums;
}

// One rank per process on its GPU (LOCAL_RANK), the NCCL communicator between processes (the
// single-GPU communicator when the job has one rank). Token batches are generated before the
// timed steps and copied in on the device between steps; each step's forward and backward are
// timed with CUDA events on the step's stream (in the graph with --capture on), the reported
// time of a step is the slowest rank's. Statistics come from rank 0's layers after the step.
// With --capture on, the whole step (every layer's forward and backward) is one CUDA graph.
int run_bench_gpu(const BenchOptions& opts, const DistEnv& env) {
  BenchOptions o = opts;
  const bool capture = o.capture == "on";
  const int R = env.world_size, rank = env.rank;
#ifdef MOE_ECHO_WITH_NCCL
  const Dispatcher dispatcher = parse_dispatcher(o.dispatcher, "dispatcher");
  if (R > 1) select_device(env);
#else
  if (R > 1)
    reject("WORLD_SIZE", R,
           "1: this build has no NCCL (configure with NCCL_ROOT for multi-GPU runs)");
#endif
  if (capture && o.dispatcher == "baseline")
    reject("capture", "on",
           "off with --dispatcher baseline (it copies counts to the host and "
           "waits for them inside the step, which a CUDA graph cannot hold)");
  if (R == 1 && o.dispatcher == "baseline")
    reject("dispatcher", "'baseline'", "syncfree on one GPU (there is nothing to send)");
  auto backend = make_backend(o.layer.backend);
  if (std::string(backend->name()) != "cuda")
    reject("backend", "'" + o.layer.backend + "'", "auto or cuda for GPU ranks");
  const ResolvedLayer L = resolve(o.layer, *backend, R);
  const int warmup = check_steps(o);
  const SkewSpec skew = parse_skew(o.skew, "skew");
  const MoeConfig& moe = L.moe;
  const int T = moe.max_tokens, H = moe.hidden;
  if (moe.experts > moe.hidden)
    throw ConfigError("experts", "experts = " + std::to_string(moe.experts) +
                                     " is invalid for bench: synthetic routing needs experts <= "
                                     "hidden (" +
                                     std::to_string(moe.hidden) + ")");
  // Per rank (one GPU): the layers, the inputs and gradients of every layer boundary (L + 1 of
  // each) and two batches of tokens and output gradients.
  const int NL = o.layers;
  const double act_bytes = double(dtype_size(backend->activation_dtype()));
  check_memory(L, *backend, NL, !o.separate, /*optimizer_state=*/false,
               (2.0 * (NL + 1) + 4.0) * T * H * act_bytes);
  std::unique_ptr<Rendezvous> rv;
  std::unique_ptr<Communicator> comm;
#ifdef MOE_ECHO_WITH_NCCL
  if (R > 1) {
    rv = std::make_unique<Rendezvous>(env);
    NcclOptions no;
    no.dispatcher = dispatcher;
    if (o.comm_ctas) no.ctas = *o.comm_ctas;
    // Across nodes: staging for this run's tokens and rows (activations in or out of the layer).
    no.gin_max_tokens = std::max(T, 1);
    no.gin_max_row_bytes = std::max<size_t>(16, size_t(H) * size_t(act_bytes));
    // and for a clone's weights or gradient (an expert's fc1 slot, the larger), so that the
    // clone ops across nodes are kernels too and a step can be captured.
    no.gin_clone_slot_bytes = size_t(H) * 2 * size_t(moe.ffn) *
                              std::max(size_t(act_bytes), dtype_size(backend->float_dtype()));
    comm = make_nccl_communicator(*rv, no);
  }
#endif
  if (!comm) comm = cuda::make_local_communicator();
  if (capture && !comm->capturable())
    reject("capture", "on",
           "off with this communicator (its ops wait on the host, which a CUDA graph cannot "
           "hold)");
  auto barrier = [&] {
    if (rv) rv->barrier();
  };
  // Element by element over the ranks: the largest value and the sum.
  struct OverRanks {
    std::vector<double> max, sum;
  };
  auto over_ranks = [&](const std::vector<double>& mine) {
    OverRanks r{mine, mine};
    if (!rv) return r;
    Bytes bytes(mine.size() * sizeof(double));
    std::memcpy(bytes.data(), mine.data(), bytes.size());
    r.sum.assign(mine.size(), 0.0);
    for (const Bytes& peer : rv->all_gather_bytes(bytes)) {
      MOE_ECHO_CHECK(peer.size() == bytes.size(), "ranks sent different counts of values");
      for (size_t i = 0; i < mine.size(); ++i) {
        double v = 0;
        std::memcpy(&v, peer.data() + i * sizeof(double), sizeof v);
        r.max[i] = std::max(r.max[i], v);
        r.sum[i] += v;
      }
    }
    return r;
  };
  auto max_over_ranks = [&](double v) { return over_ranks({v}).max[0]; };
  cudaDeviceProp prop{};
  int device = 0;
  MOE_ECHO_CUDA_CHECK(cudaGetDevice(&device));
  MOE_ECHO_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));

  SyntheticTokens synth(moe.experts, H, skew, o.layer.seed);
  BenchLayers layers(*backend, *comm, L, NL, o.separate, rank, o.layer.seed, o.split_phases);
  for (int l = 0; l < NL; ++l)
    write_tensor(*backend, layers.layer(l).param(Param::router_weight), synth.router_weight());
  PhaseEvents phase_events;
  if (o.phases == "on") layers.set_phase_observer(&phase_events);
  const DType act = backend->activation_dtype();
  std::vector<void*> owned;
  auto alloc = [&](std::initializer_list<int64_t> dims) {
    Tensor t(nullptr, act, dims);
    t.data = backend->allocate(t.bytes());
    owned.push_back(t.data);
    return t;
  };
  std::vector<Tensor> acts, grads;  // acts[0] = x, acts[L] = y; grads[L] = dy, grads[0] = dx
  for (int l = 0; l <= NL; ++l) acts.push_back(alloc({T, H})), grads.push_back(alloc({T, H}));
  // Distinct batches (tokens and output gradients), generated in parallel, cycled over steps.
  const int batches = std::min(o.steps + 1, 2);
  std::vector<Tensor> xb, dyb;
  {
    std::vector<std::future<std::pair<std::vector<double>, std::vector<double>>>> gen;
    for (int b = 0; b < batches; ++b)
      gen.push_back(std::async(std::launch::async, [&, b] {
        std::vector<double> dyh(size_t(T) * size_t(H));
        Rng rng(o.layer.seed ^ 0xd1ull, uint64_t(b), uint64_t(rank));
        for (auto& v : dyh) v = rng.normal() / double(T);
        return std::make_pair(synth.tokens(b, rank, T), std::move(dyh));
      }));
    for (int b = 0; b < batches; ++b) {
      auto [xh, dyh] = gen[size_t(b)].get();
      xb.push_back(alloc({T, H}));
      dyb.push_back(alloc({T, H}));
      write_tensor(*backend, xb.back(), xh);
      write_tensor(*backend, dyb.back(), dyh);
    }
  }
  cudaStream_t stream;
  MOE_ECHO_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t ev[3];
  for (auto& e : ev) MOE_ECHO_CUDA_CHECK(cudaEventCreate(&e));
  const Stream s = stream;
  auto load_batch = [&](int step) {
    const int b = step % batches;
    backend->copy(acts[0], xb[size_t(b)], s);
    backend->copy(grads[size_t(NL)], dyb[size_t(b)], s);
    MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(stream));
  };
  // One step: every layer's forward, then their backwards in reverse; inside a capture (all of
  // it in one graph) the event records become graph nodes.
  auto enqueue_step = [&](unsigned flags) {
    phase_events.start_step(flags);
    layers.zero_grad(s);
    MOE_ECHO_CUDA_CHECK(cudaEventRecordWithFlags(ev[0], stream, flags));
    layers.forward(acts, s);
    MOE_ECHO_CUDA_CHECK(cudaEventRecordWithFlags(ev[1], stream, flags));
    layers.backward(grads, s);
    MOE_ECHO_CUDA_CHECK(cudaEventRecordWithFlags(ev[2], stream, flags));
  };
  // Warm-up outside the table: module loading, lazy NCCL connections, GEMM setup.
  load_batch(0);
  barrier();
  enqueue_step(cudaEventRecordDefault);
  MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::unique_ptr<cuda::CapturedGraph> graph;
  if (capture) {
    graph = std::make_unique<cuda::CapturedGraph>(stream,
                                                  [&] { enqueue_step(cudaEventRecordExternal); });
    barrier();
  }

  Report report(o, L, backend->name());
  report.warmup = warmup;
  report.memory = layers.memory();
  report.memory.estimate = moe_bytes_per_rank(L, *backend, NL, !o.separate, false);
  report.memory.parts = moe_memory_per_rank(L, *backend, NL, !o.separate, false);
  report.dispatcher = R > 1 ? o.dispatcher : "local (one GPU)";
#ifdef MOE_ECHO_WITH_NCCL
  if (R > 1 && nccl_uses_host_api(*comm)) report.dispatcher += " (every op on NCCL's host API)";
#endif
  report.capture = capture ? "on (one graph per step)" : "off";
  report.device = prop.name;
  if (rank == 0) {
    report.header();
    report.table_header();
  }
  Watchdog watchdog(default_timeout(), "bench step", rank);
  for (int step = 0; step < o.steps; ++step) {
    load_batch(step);
    barrier();
    if (graph)
      graph->launch(stream);
    else
      enqueue_step(cudaEventRecordDefault);
    MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(stream));
    watchdog.kick();
    float f = 0, b = 0;
    MOE_ECHO_CUDA_CHECK(cudaEventElapsedTime(&f, ev[0], ev[1]));
    MOE_ECHO_CUDA_CHECK(cudaEventElapsedTime(&b, ev[1], ev[2]));
    StepRow row;
    row.step = step;
    row.fwd_ms = max_over_ranks(f);
    row.bwd_ms = max_over_ranks(b);
    if (o.phases == "on" && step >= warmup) {
      std::vector<std::string> names;
      const OverRanks ph =
          over_ranks(sum_by_phase(phase_events.names(), phase_events.elapsed(ev[2]), names));
      const size_t n = ph.max.size();
      report.phase_names = names;
      report.phase_max.resize(n);
      report.phase_mean.resize(n);
      for (size_t i = 0; i < n; ++i) {
        report.phase_max[i].push_back(ph.max[i]);
        report.phase_mean[i].push_back(ph.sum[i] / R);
      }
    }
    const std::vector<StepStats> st = layers.stats();
    if (rank == 0) report.add(row, st);
  }
  if (rank == 0) report.summary();
  barrier();
  graph.reset();
  for (auto& e : ev) (void)cudaEventDestroy(e);
  (void)cudaStreamDestroy(stream);
  for (void* p : owned) backend->deallocate(p);
  return 0;
}
#endif
}  // namespace

void add_bench(CLI::App& app, Runner& run) {
  auto opts = std::make_shared<BenchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "Time training steps (forward + backward) of MoE layers on synthetic tokens with skewed "
      "expert popularity; report rank load balance with and without ECHO, clones, overflow and "
      "the memory the layers allocate.");
  add_layer_options(cmd, opts->layer);
  add_option(cmd, "--layers", opts->layers,
             "MoE layers per step, each layer's output the next one's input, backwards in "
             "reverse (default 1, at most " +
                 std::to_string(kMaxLayers) + ")");
  cmd->add_flag("--separate", opts->separate,
                "Build the layers as separate MoeLayers, each with its own workspace, instead of "
                "one MoeStack sharing one workspace (to compare their memory and time)");
  cmd->add_flag("--split-phases", opts->split_phases,
                "Run each forward and backward as its three split-phase calls (dispatch, "
                "experts, combine; MoeLayer::forward_dispatch ...) instead of one call");
  add_option(cmd, "--steps", opts->steps, "Steps to run (default 20)");
  add_option(cmd, "--warmup", opts->warmup,
             "Leading steps left out of the timing summary (default 1)");
  add_option(cmd, "--skew", opts->skew,
             "Expert popularity: uniform or zipf:S (default zipf:1.2), drifting slowly "
             "across steps");
  add_option(cmd, "--json", opts->json, "Write every number printed to this JSON file");
  add_option(cmd, "--dispatcher", opts->dispatcher,
             "GPU ranks (moe-echo launch -n N -- moe-echo bench --ep N): syncfree (default; "
             "NCCL device API, no host sync) or baseline (counts to the host, exact-size "
             "ncclSend/ncclRecv)");
  add_option(cmd, "--capture", opts->capture,
             "GPU: on = each step (every layer's forward + backward) captured once into one CUDA "
             "graph and replayed; off (default) = launched eagerly. Times come from CUDA events");
  add_option(cmd, "--comm-ctas", opts->comm_ctas,
             "GPU ranks: CTAs of the NCCL communicator's dispatch/combine kernels, 1 to 128 "
             "(default: the communicator's, 128)");
  add_option(cmd, "--ranks-per-node", opts->ranks_per_node,
             "CPU ranks: place the --ep in-process ranks on nodes of this many (a divisor of ep), "
             "so that dispatch and combine move rows as across nodes: one copy of a token per "
             "other node, forwarded inside it (the same results); the summary counts the rows "
             "across and within nodes. 0 (default): one node");
  add_option(cmd, "--phases", opts->phases,
             "GPU: on = also time each phase of the step (router, plan, dispatch, GEMMs, ...) "
             "with CUDA events and print them after the summary, each phase summed over the "
             "layers; off (default)");
  cmd->callback([opts, &run] { run = [opts] { return run_bench(*opts); }; });
}

}  // namespace moe_echo::cli
