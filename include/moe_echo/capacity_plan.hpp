// The capacity plan of `moe-echo plan`: the three walls of MoE training, estimated on the CPU for
// one GPU of a parallel layout: memory (does it fit), communication (dispatch/combine against
// expert GEMMs) and compute / host overhead; plus the validation rules production frameworks
// apply to the combination, and a capacity factor and spare-slot count suggested by the simulator.
//
// Scope and assumptions (docs/plan.md says them in full):
// - Only the MoE layers are modelled (routed and shared experts, router, dispatch/combine
//   buffers, echo slots); the attention, dense layers and framework take `reserve_gb` of memory.
//   Their memory is the library's: the stage's layers as MoeConfigs (stage_layers) and
//   MoeStack::memory_breakdown, so it is what a MoeStack of them allocates on one GPU.
// - Megatron-style layout: world = etp * ep * dp * pp with expert tensor parallelism innermost;
//   `dp` is the expert data-parallel size (copies of each expert shard). Each GPU feeds
//   T = seq_len * micro_batch tokens per micro-batch to each MoE layer.
// - Memory is that of the first pipeline stage (the one holding the most micro-batches).
// - Every number is per GPU; times are per MoE layer and micro-batch, forward + backward.
//
// Part of the offline tools: library moe_echo_offline (CPU only), src/offline/capacity_plan.cpp.
#pragma once

#include <string>
#include <vector>

#include "moe_echo/config.hpp"
#include "moe_echo/cost_model.hpp"
#include "moe_echo/layer.hpp"
#include "moe_echo/presets.hpp"
#include "moe_echo/simulator.hpp"

namespace moe_echo::offline {

// The most MoE layers of a model `plan` takes (real models have tens; the plan keeps one layer
// config per layer of a pipeline stage).
inline constexpr int kMaxPlanLayers = 100000;

struct ModelSpec {  // defaults: DeepSeek-V3
  std::string name{kDeepSeekV3.name};
  int hidden = kDeepSeekV3.hidden;                // H
  int ffn = kDeepSeekV3.ffn;                      // F (expert FFN size)
  int experts = kDeepSeekV3.experts;              // E
  int top_k = kDeepSeekV3.top_k;                  // K
  int layers = kDeepSeekV3.moe_layers;            // MoE layers
  int expert_groups = kDeepSeekV3.expert_groups;  // group-limited routing (1: none)
  int topk_groups = kDeepSeekV3.topk_groups;
  int shared_experts = kDeepSeekV3.shared_experts;  // dense SwiGLU experts of size F per layer
  int seq_len = 4096;
  int micro_batch = 1;
  std::string dtype = "bf16";  // bf16, fp16 or fp32 (weights and activations)
};
// The model preset named `name` (moe_echo/presets.hpp, models only, any case); throws
// ConfigError naming `field` otherwise.
ModelSpec model_preset(const std::string& name, const char* field = "model");

struct LayoutSpec {
  int ep = 8;   // expert parallel size
  int etp = 1;  // expert tensor parallel size (shards F)
  int dp = 1;   // expert data parallel size
  int pp = 1;   // pipeline stages
  int vpp = 1;  // virtual pipeline stages per rank (1: no interleaving)
};

struct TrainingSpec {
  // The library's defaults (MoeConfig, EchoConfig): receive window rows = ceil(capacity_factor *
  // T * K) (* etp); ECHO's S spare slots per rank and clones per expert per step.
  double capacity_factor = MoeConfig{}.capacity_factor;
  int spare_slots = EchoConfig{}.spare_slots_per_rank;
  int max_clones = EchoConfig{}.max_clones_per_expert;
  // What the layer's backward runs beside its communication (MoeConfig::overlap): none, or wgrad
  // (fc1's weight-gradient GEMM beside the backward's combine).
  std::string overlap = "none";
  // Price dispatch/combine hidden under the expert GEMMs, as a framework's EP communication
  // overlap does (the layer itself does not: its overlaps are `overlap` and MoeConfig::chunks).
  bool comm_overlap = false;
  // How dispatch and combine cross nodes: "flat", one row per token and EP rank it picks (what
  // runs across nodes today: NCCL's host API), or "hierarchical", one row per token and other
  // node over the network, fanned out over NVLink inside that node by its forwarder (the
  // in-process world's nodes, InProcessWorld's ranks_per_node: docs/multigpu.md).
  std::string across_nodes = "flat";
  // Run the shared experts beside dispatch/combine (on a side stream); conflicts with
  // comm_overlap, which claims the same stream beside the expert GEMMs.
  bool shared_expert_overlap = false;
  bool distributed_optimizer = true;  // optimizer state sharded over dp
  std::string recompute = "none";     // what a layer keeps: none, moe_act, experts, dispatch,
                                      // all_but_fc1
  std::string precision = "bf16";     // the routed experts' GEMMs: bf16 or fp8
  std::string fp8_gemms = "all";      // with fp8: which of them (MoeConfig::fp8_gemms)
  std::string grad_dtype = "fp32";    // gradients: fp32 (the layers' float dtype)
  bool cuda_graphs = true;            // the step replays as a CUDA graph
  int kernels_per_layer = 30;         // kernel launches of one MoE layer, forward + backward
  double reserve_gb = 6.0;            // memory for everything that is not an MoE layer
};

struct WallsInput {
  ModelSpec model;
  LayoutSpec layout;
  TrainingSpec train;
  GpuSpec gpu;
};

enum class Severity { error, warning };
struct Finding {
  Severity severity = Severity::error;
  std::string field;    // the parameter the message is about
  std::string message;  // "field = value is invalid: allowed ..." (errors) or advice (warnings)
};

// Every rule that does not need the simulator, in a fixed order (docs/plan.md lists them).
std::vector<Finding> check(const WallsInput& in);
// Throws ConfigError for the first error of check(in).
void validate(const WallsInput& in);

// Imbalance the plan is sized for: busiest rank / mean under ECHO at the chosen spare slots.
struct Imbalance {
  double mean = 1.0, p99 = 1.0;
  double spill_fraction = 0.0;     // share of (step, layer) samples above the capacity factor
  std::string source = "assumed";  // "simulated ..." or "given"
};
// The capacity-factor rule: a warning when capacity_factor < the p99 imbalance (or the mean).
std::vector<Finding> check_capacity(const WallsInput& in, const Imbalance& imb);

// The MoE layers of one pipeline stage on one GPU as the library builds them: layers / pp
// MoeConfigs of H, F / etp (one ETP shard, the shared experts' too), E, K, the model's expert
// groups, T = seq_len * micro_batch tokens and the chosen recompute; ECHO with the spare slots
// and clones of the training spec and capacity factor * etp (an EP rank's etp GPUs gather each
// other's rows, so a GPU's receive window holds about etp times the rows); the activation dtype
// of --dtype (fp16 counted as bf16, the same size) and fp32 as the float dtype (the CUDA
// backend's: router, gradients, optimizer state, fan weights). Valid inputs only (validate()).
struct StageLayers {
  std::vector<MoeConfig> layers;
  ParallelConfig par;
  EchoConfig echo;
  DType activation = DType::bf16, float_dtype = DType::f32;
  // MoeStack::memory_breakdown of the layers, with optimizer state.
  MoeMemory memory() const;
};
StageLayers stage_layers(const WallsInput& in);
StageLayers stage_layers(const WallsInput& in, Recompute recompute);

struct MemoryBreakdown {
  // Parameters (home experts, router, shared experts), their gradients (fp32), AdamW state (fp32
  // m and v; divided by dp with the distributed optimizer).
  double weights_gb = 0, grads_gb = 0, optimizer_gb = 0;
  // The echo slots: one pool per GPU that every layer's clones pass through (per workspace set:
  // twice with more than one micro-batch in flight).
  double spare_weights_gb = 0, spare_grads_gb = 0;
  // Kept for the backward (after the chosen recompute) and the routing, per micro-batch in flight.
  double activations_gb = 0;
  // The workspace (receive windows, fan table, backward temporaries, the activations no layer
  // keeps; two sets with more than one micro-batch in flight), the layers' backward temporaries
  // per micro-batch in flight, and with precision fp8 the e4m3 weight copies and operands.
  double buffers_gb = 0;
  double moe_gb = 0;  // the MoE layers: every line above
  double reserve_gb = 0;
  double total_gb = 0, capacity_gb = 0;
  double microbatches_in_flight = 1;  // on the first pipeline stage (layer-micro-batches / Lp)
  // MoE memory each recompute option saves against none.
  double recompute_moe_act_saves_gb = 0, recompute_experts_saves_gb = 0,
         recompute_dispatch_saves_gb = 0, recompute_all_but_fc1_saves_gb = 0;
  // The library's count for the stage (one micro-batch in flight, optimizer state unsharded):
  // what a MoeStack of stage_layers(in) allocates on one GPU, in bytes.
  MoeMemory library;
  bool fits() const { return total_gb <= capacity_gb; }
};

struct LayerTimes {
  int64_t tokens = 0;         // T per GPU per micro-batch
  int64_t capacity_rows = 0;  // receive window rows per GPU
  // EP ranks a token's row goes to: expected under uniform routing (with the model's group
  // limit), and at most.
  double ranks_per_token = 0;
  int max_ranks_per_token = 0;
  // Rows one token's dispatch (or combine) moves out of its GPU, balanced: over NVLink (to the
  // EP ranks of its node; hierarchical: also a forwarder's fan-out of other nodes' rows) and over
  // the network (flat: one per EP rank it picks on other nodes; hierarchical: one per other node
  // it picks). Their sum times T and the row's bytes is dispatch_bytes.
  double nvlink_rows_per_token = 0, network_rows_per_token = 0;
  double dispatch_bytes = 0;  // forward, leaving one GPU to other EP ranks (balanced): one row
                              // per token and rank it picks (fp8: packed e4m3 rows)
  double combine_bytes = 0;   // the same rows in the activation dtype (also dy and dx's)
  double etp_bytes = 0;       // forward, ETP all-gather of received rows (0 when etp = 1)
  double clone_bytes = 0;     // clone weights in (forward, and again for the backward when other
                              // layers used the echo slots in between) + fp32 gradients out
  double comm_ms = 0;         // dispatch + combine + ETP, forward + backward, busiest rank
  double clone_ms = 0;
  double gemm_ms = 0;  // expert GEMMs forward + backward (+ recompute), busiest rank
  // (comm_ms includes the dispatch again with recompute dispatch)
  double shared_ms = 0;  // shared experts' GEMMs forward + backward (all T tokens)
  double host_ms = 0;    // kernel launch overhead
  double layer_ms = 0;   // max(gpu time, host time); gpu = comm_overlap ? max : sum
  double exposed_comm_ms = 0;
  // overlap wgrad: the backward's combine beside fc1's weight-gradient GEMM, the shorter hidden
  double wgrad_hidden_ms = 0;
};

struct SpareSlotOption {
  int spare_slots = 0;
  int max_clones = 0;
  double mean = 0, p99 = 0;  // ECHO busiest rank / mean
  double clones_per_step = 0;
  double memory_gb = 0;  // echo-slot weights and gradients per GPU
};

struct Suggestion {
  int spare_slots = 0;
  int max_clones = 0;
  double capacity_factor = 1.0;
  std::vector<SpareSlotOption> sweep;
  std::string reason;
};

struct WallsReport {
  int world_size = 0;
  int layers_per_stage = 0;
  MemoryBreakdown memory;
  LayerTimes layer;
  double stage_ms = 0;       // layers_per_stage * layer_ms: MoE time of one micro-batch on a stage
  std::string binding_wall;  // memory, communication, compute, host-overhead
  std::string reason;
  std::vector<std::string> advice;
  Imbalance imbalance;
  std::vector<Finding> findings;
};

// Memory, times and the binding wall at `imbalance` (validate first).
WallsReport estimate_walls(const WallsInput& in, const Imbalance& imbalance);

// Runs the simulator (generator, or `trace` when non-null) with ECHO at the layout's EP size
// for every pair of spare slots in `spare_slots` and max clones in `max_clones` (plus the
// training spec's own pair; max clones above ep - 1 are dropped), and suggests the first pair in
// (spare slots, max clones) order whose p99 is within 2% of the best, with a capacity factor at
// that p99 rounded up to 0.05. The routing counts are generated once and reused (ECHO's loads
// depend on the per-expert totals only). `results`, when given, gets one simulation per sweep
// entry, in the same order.
struct SweepOptions {
  int steps = 200;
  int layers = 4;
  int threads = 2;
  uint64_t seed = 1;
  std::vector<int> spare_slots{0, 1, 2, 4};
  std::vector<int> max_clones{2, 4, 8};
};
Suggestion suggest(const WallsInput& in, const SweepOptions& opt, const TraceSource* trace,
                   std::vector<SimulationResult>* results = nullptr);

// Bytes per element of "bf16", "fp16", "fp32".
int dtype_bytes(const std::string& dtype);

}  // namespace moe_echo::offline
