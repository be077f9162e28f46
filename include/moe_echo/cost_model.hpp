// Cost model of the CPU-only tools (`moe-echo simulate`, `moe-echo plan`): what a GPU reaches, and
// the time of the three kinds of MoE work on it (expert GEMMs, dispatch/combine, clone traffic).
//
// Invariants:
// - Every constant is an achieved rate, not a datasheet peak, except `peak_tflops` which is kept
//   for reference only. Defaults are the H200 measurements of docs/ANCHORS (see docs/simulate.md
//   for where every number comes from); a measured-results file overrides any of them.
// - Units are in the names: `_tflops` 1e12 FLOP/s, `_gbps` 1e9 bytes/s (GB/s, not Gbit/s),
//   `_tbps` 1e12 bytes/s, `_gb` 1e9 bytes, `_us` / `_ms` time. Every function returns ms.
// - Pure functions of their inputs: no clock, no state.
//
// Part of the offline tools: library moe_echo_offline (CPU only), src/offline/cost_model.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "moe_echo/error.hpp"

namespace moe_echo::offline {

using moe_echo::reject;  // "field = value is invalid: allowed ..." (error.hpp)

struct GpuSpec {
  std::string name = "h200";
  double memory_gb = 141.0;    // device memory (datasheet, 1e9 bytes)
  double peak_tflops = 989.0;  // dense bf16 datasheet peak (reference only)
  double gemm_tflops = 690.0;  // bf16 grouped GEMM reached (ANCHORS: 692-697 TFLOP/s)
  // FP8 blockwise grouped GEMMs of a training step reached, their operands' quantization
  // included: fprop, dgrad and wgrad (a third of the FLOPs each) at the DeepSeek-V3 and Mixtral
  // shapes on an H200, the harmonic mean of the three (751 and 775 TFLOP/s;
  // bench/results/grouped_gemm_fp8_h200_2026-11-24.json)
  double fp8_gemm_tflops = 760.0;
  double hbm_tbps = 4.2;       // device-to-device copy reached (ANCHORS: 4.2 TB/s)
  double nvlink_gbps = 310.0;  // all-to-all bytes leaving one GPU per second, within a node
  double network_gbps = 40.0;  // bytes leaving one GPU per second across nodes (400 Gb/s NIC)
  int gpus_per_node = 8;       // GPUs joined by NVLink
  double launch_us = 4.0;      // host cost of one kernel launch outside a CUDA graph
  double graph_node_us = 0.5;  // cost of one kernel node inside a replayed CUDA graph
};

// "h200" or "h100" (case-insensitive); throws ConfigError naming `gpu` otherwise.
GpuSpec gpu_preset(const std::string& name);
// The names gpu_preset accepts, for help texts and messages.
std::vector<std::string> gpu_preset_names();

// Overrides fields of `gpu` from a measured-results JSON file. The file is an object whose keys
// are the GpuSpec field names above (all optional), either at the top level or inside a
// "cost_model" object; "gpu" or "name" names the preset to start from. Unknown keys, wrong types
// and values <= 0 throw ConfigError naming the file and the key.
void apply_measured_file(GpuSpec& gpu, const std::string& path);
// The same from JSON text (`origin` names the source in messages).
void apply_measured_json(GpuSpec& gpu, const std::string& json_text, const std::string& origin);

// Throws ConfigError naming the first field <= 0 (or gpus_per_node < 1).
void validate(const GpuSpec& gpu);

// Where the all-to-all traffic of one GPU goes: `ep` ranks, each a group of `etp` GPUs; ranks are
// numbered with expert tensor parallelism innermost (as Megatron does), so min(ep, G / etp) EP
// ranks share a node of G GPUs and the rest of the destinations are across the network.
double intra_node_fraction(int ep, int etp, int gpus_per_node);
// The EP ranks a node of `gpus_per_node` GPUs holds: gpus_per_node / etp, at least 1.
int ep_ranks_per_node(int etp, int gpus_per_node);

struct CostModel {
  GpuSpec gpu;

  // Expert GEMM FLOPs of `rows` routed rows of a SwiGLU expert (H x 2F then F x H): forward 6HF
  // per row; backward (dgrad + wgrad) twice that.
  static double forward_flops(double rows, int hidden, int ffn) {
    return 6.0 * rows * double(hidden) * double(ffn);
  }
  static double train_flops(double rows, int hidden, int ffn) {
    return 3.0 * forward_flops(rows, hidden, ffn);
  }
  // Time of `flops` of expert GEMM work at gemm_tflops.
  double gemm_ms(double flops) const;
  // The same at fp8_gemm_tflops.
  double fp8_gemm_ms(double flops) const;
  // Time to move `bytes` out of (or into) one GPU in an all-to-all over `ep` ranks of `etp` GPUs:
  // the intra-node share at nvlink_gbps and the rest at network_gbps, both links busy at once.
  double all_to_all_ms(double bytes, int ep, int etp = 1) const;
  // Point-to-point bytes over NVLink (clone weights in, clone gradients out).
  double nvlink_ms(double bytes) const;
  // Bytes leaving one GPU over NVLink and over the network at once: the slower of the two.
  double links_ms(double nvlink_bytes, double network_bytes) const;
  // Host overhead of `kernels` launches, in a CUDA graph or not.
  double launch_ms(int kernels, bool cuda_graph) const;
  // Time of one routed row of training work (forward + backward) and of one clone (weights in +
  // gradient out over NVLink); their ratio is the clone cost in rows the ECHO planner compares a
  // clone's saving with.
  double row_ms(int hidden, int ffn) const;
  double clone_ms(int hidden, int ffn, int grad_bytes) const;
  // clone_ms / row_ms rounded up, at most kMaxCloneCostRows (2^31-1, where no clone pays).
  int64_t clone_cost_rows(int hidden, int ffn, int grad_bytes) const;
  // The same priced by the simulator's step estimate over `ep` ranks (what `moe-echo simulate`
  // and the planner it runs use): one more clone link of the busiest-linked rank moves one
  // expert's weights in and gradient out (per parameter the larger of 2 bytes and grad_bytes, the
  // two directions at once) through all_to_all_ms; one more row of the busiest rank costs its
  // expert GEMM time and its share of the four dispatch/combine all-to-alls (rows_per_entry rows
  // of 2 * hidden bytes moved per routed entry, (ep - 1) / ep of them to other ranks). Rounded up
  // and capped as above; 0 on one rank (nothing moves).
  int64_t step_clone_cost_rows(int hidden, int ffn, int grad_bytes, int ep,
                               double rows_per_entry) const;
  // The step estimate's dispatch and combine of `rows` routed rows of the busiest rank, forward
  // and backward: four all-to-alls of rows_per_entry rows of 2 * hidden bytes (bf16) per routed
  // row, (ep - 1) / ep of them to other ranks; 0 on one rank.
  double dispatch_combine_ms(double rows, int hidden, int ep, double rows_per_entry) const;
};

// Expected EP ranks a token's row goes to under uniform routing: its K distinct experts are a
// uniform draw of K of E, and a rank holding E/ep of them is missed with probability
// C(E - E/ep, K) / C(E, K). The layer sends a token's row once per rank it picks, not once per
// expert, so dispatch and combine move ranks_per_token / K rows per routed (token, k) entry.
double ranks_per_token(double E, double ep, double K);
// The same under group-limited routing (expert groups of E/groups consecutive experts, ranks of
// E/ep): the token's topk_groups groups a uniform draw of the groups, its K experts a uniform
// draw of theirs. Exact for that model (a sum over how many of a rank's experts the chosen groups
// hold); groups = topk_groups gives the formula above.
double ranks_per_token(int E, int ep, int K, int groups, int topk_groups);
// The most ranks one token's rows can reach: min(K, ep, the ranks the topk_groups groups that
// span the most ranks span). With groups aligned to ranks (ep dividing groups) it is
// min(K, topk_groups).
int max_ranks_per_token(int E, int ep, int K, int groups, int topk_groups);

// Bytes of one expert's weights (SwiGLU: 3 * H * F parameters) at `bytes_per_param`.
inline double expert_bytes(int hidden, int ffn, double bytes_per_param) {
  return 3.0 * double(hidden) * double(ffn) * bytes_per_param;
}
// Traffic of one clone for one step: weights in (bf16, 2 bytes a parameter) and its gradient out
// to the home expert (`grad_bytes` a parameter: 2 for bf16, 4 for fp32).
inline double clone_bytes(int hidden, int ffn, int grad_bytes) {
  return expert_bytes(hidden, ffn, 2.0) + expert_bytes(hidden, ffn, double(grad_bytes));
}
// What one clone link moves each way at once through the all-to-all (the simulator's clone term):
// per parameter the larger of the weights in (bf16) and the gradient out (`grad_bytes`).
inline double clone_link_bytes(int hidden, int ffn, int grad_bytes) {
  return expert_bytes(hidden, ffn, double(std::max(2, grad_bytes)));
}

}  // namespace moe_echo::offline
