// Configuration of one MoE layer, its expert-parallel placement and ECHO.
//
// Configs are plain structs that grow by appending fields. `validate()` checks every field and
// every combination; a violation throws moe_echo::ConfigError whose message names the field, the
// value given and what is allowed. Everything a layer allocates is sized from these structs.
#pragma once

#include <cstdint>
#include <string>

namespace moe_echo {

inline constexpr int kVersionMajor = 0;
inline constexpr int kVersionMinor = 1;
inline constexpr int kVersionPatch = 0;

enum class ScoreFunction { softmax, sigmoid };

const char* to_string(ScoreFunction f);
// Parses "softmax" or "sigmoid"; throws ConfigError naming `field` otherwise.
ScoreFunction parse_score_function(const std::string& s, const char* field = "score_function");

// How group-limited routing scores a group of experts from its experts' selection keys (score +
// bias): top2_sum, the sum of its two largest keys (DeepSeek-V3); max, its largest key.
enum class GroupScore { top2_sum, max };

const char* to_string(GroupScore g);
// Parses "top2_sum" or "max"; throws ConfigError naming `field` otherwise.
GroupScore parse_group_score(const std::string& s, const char* field = "group_score");

// What a layer keeps from its forward for its backward (round 0's expert activations at the
// receive capacity); the backward recomputes the rest, with gradients bit-identical to none.
enum class Recompute {
  none,      // keep the received rows, fc1's output, SwiGLU's output and the experts' outputs
  moe_act,   // keep the received rows, fc1's output and the experts' outputs; redo SwiGLU
  experts,   // keep the received rows; redo fc1, SwiGLU and fc2
  dispatch,  // keep only the routing (and the caller's x): redo the dispatch and the experts
};

const char* to_string(Recompute r);
// Parses "none", "moe_act", "experts" or "dispatch"; throws ConfigError naming `field` otherwise.
Recompute parse_recompute(const std::string& s, const char* field = "recompute");

// What a layer's backward runs beside its communication (MoeConfig::overlap).
enum class Overlap {
  none,   // every op in turn on the caller's stream
  wgrad,  // round 0's fc1 weight-gradient GEMM on a second stream (Backend::fork_side) beside
          // round 0's combine and the router's backward, on all SMs but overlap_sms
};
const char* to_string(Overlap o);
// Parses "none" or "wgrad"; throws ConfigError naming `field` otherwise.
Overlap parse_overlap(const std::string& s, const char* field = "overlap");

// The number format of the routed experts' GEMMs (the router stays fp32, the shared experts and
// every activation between the GEMMs stay in the activation dtype, gradients and master weights
// in the float dtype).
enum class Precision {
  bf16,  // the activation dtype's GEMMs (bf16 on the CUDA backend)
  fp8,   // e4m3 operands with blockwise fp32 scales (1 x 128 tiles of activations and gradients,
         // 128 x 128 blocks of weights: backend.hpp, Fp8GemmArgs), quantized before each GEMM;
         // needs hidden and ffn multiples of 16
};
const char* to_string(Precision p);
// Parses "bf16" or "fp8"; throws ConfigError naming `field` otherwise.
Precision parse_precision(const std::string& s, const char* field = "precision");

// Precision fp8: which of the six expert GEMMs run on e4m3 operands (MoeConfig::fp8_gemms, a set
// of these bits); the others run in the activation dtype as with precision bf16. With fprop1 the
// tokens cross in e4m3 (the FP8 dispatch); without it in the activation dtype.
namespace fp8_gemm {
inline constexpr uint32_t fprop1 = 1;   // h = x w1
inline constexpr uint32_t fprop2 = 2;   // y = a w2
inline constexpr uint32_t dgrad2 = 4;   // da = dy w2^T
inline constexpr uint32_t wgrad2 = 8;   // dw2 = a^T dy
inline constexpr uint32_t dgrad1 = 16;  // dx = dh w1^T
inline constexpr uint32_t wgrad1 = 32;  // dw1 = x^T dh
inline constexpr uint32_t all = 63;
}  // namespace fp8_gemm
// "all", or a comma-separated list of fprop1, fprop2, dgrad1, dgrad2, wgrad1, wgrad2, and the
// pairs fprop, dgrad, wgrad; to_string gives the list (or "all"). Throws ConfigError naming
// `field` for anything else or an empty set.
std::string fp8_gemms_to_string(uint32_t gemms);
uint32_t parse_fp8_gemms(const std::string& s, const char* field = "fp8_gemms");

// The largest top_k a layer takes: one warp handles a token's entries in dispatch and combine.
inline constexpr int kMaxTopK = 32;
// The most expert groups of group-limited routing: one warp holds a token's group scores.
inline constexpr int kMaxExpertGroups = 32;
// The most micro-batches in flight per layer (MoeConfig::in_flight).
inline constexpr int kMaxInFlight = 16;
// The most chunks of a forward's received rows (MoeConfig::chunks).
inline constexpr int kMaxChunks = 16;

struct MoeConfig {
  int hidden = 0;      // H
  int ffn = 0;         // F: fc1 is H x 2F (gate | up), fc2 is F x H
  int experts = 0;     // E, routed experts of the layer (all ranks together)
  int top_k = 0;       // K, experts chosen per token
  int max_tokens = 0;  // T, the most tokens one rank feeds the layer in one step
  ScoreFunction score_function = ScoreFunction::softmax;
  bool normalize_topk = true;   // rescale the K chosen weights to sum to 1
  double aux_loss_coeff = 0.0;  // Switch-style load-balancing loss: coeff * E * sum_e f_e P_e
  double z_loss_coeff = 0.0;    // coeff * mean_t logsumexp(logits_t)^2
  bool bias_update = false;     // aux-loss-free balancing: b_e += rate * sign(mean - count_e)
  double bias_update_rate = 1e-3;
  // Group-limited top-k: experts [g E/G, (g + 1) E/G) form group g of G = expert_groups; a token
  // picks its topk_groups best groups by group_score, then its top_k experts inside them. Groups
  // that align to EP ranks bound the ranks a token's rows go to. 1 and 1: no group limit.
  int expert_groups = 1;
  int topk_groups = 1;
  GroupScore group_score = GroupScore::top2_sum;
  // Combine weights times this constant, after normalisation (DeepSeek-V3's 2.5).
  double routed_scaling_factor = 1.0;
  // Sequence-level aux loss: the aux loss's formula over each run of seq_len consecutive tokens
  // (the last run may be shorter), averaged over the runs: coeff * mean_s E sum_e f_se P_se.
  double seq_aux_loss_coeff = 0.0;
  int seq_len = 0;  // tokens per sequence; 0 with seq_aux_loss_coeff 0
  // Shared experts: dense SwiGLU experts every token goes through, their output added to the
  // routed experts'. Together they are one SwiGLU of width shared_experts * shared_ffn (0: ffn),
  // replicated on every EP rank, run by the expert GEMM kernels as one group.
  int shared_experts = 0;
  int shared_ffn = 0;
  // Run the shared experts on a second stream (Backend::fork_side), beside the router, the plan,
  // the layout and (without spill rounds configured) round 0's dispatch and expert GEMMs; joined
  // before the first combine that adds into y (forward) or dx (backward).
  bool shared_side_stream = false;
  // What the forward keeps for the backward (see Recompute).
  Recompute recompute = Recompute::none;
  // What the backward runs beside its communication (see Overlap), and with Overlap::wgrad the
  // SMs the weight-gradient GEMM leaves to the communication kernels (CUDA backend; less than the
  // GPU's SM count).
  Overlap overlap = Overlap::none;
  int overlap_sms = 16;
  // Round 0 of the forward and the backward in this many chunks of its received rows (1: one, no
  // overlap). Chunk c's expert GEMMs (the backward's dgrads) run on the backend's side stream, on
  // all SMs but overlap_sms, while chunk c + 1 is dispatched and chunk c - 1 combined on the
  // step's stream, the backward's weight gradients after the chunks; the chunks' rows are
  // computed on the device from the layout (Backend::chunk_plan, RowChunks), and the results are
  // the bits of one chunk. forward() and backward() only: the split-phase calls refuse it. A
  // backward with FP8 weight gradients runs whole.
  int chunks = 1;
  // Micro-batches in flight: how many forwards may await their backward at once, each keeping
  // its own routing, plan and kept activations (MoeLayer's micro_batch argument picks one, from
  // 0 to in_flight - 1). With 2 or more, two micro-batches' split phases may also interleave:
  // micro-batch m uses set m % 2 of the workspace's receive windows, temporaries and echo slots.
  int in_flight = 1;
  // Float master copies of the expert and shared-expert weights (with optimizer state): AdamW
  // updates the masters and writes the weights the GEMMs read (bf16 on CUDA) as their rounding,
  // so updates below a bf16 ulp are not lost. The router weight is float already.
  bool master_weights = false;
  // The routed experts' GEMMs (see Precision), and with fp8 which of them (fp8_gemm bits; the
  // rest in the activation dtype).
  Precision precision = Precision::bf16;
  uint32_t fp8_gemms = fp8_gemm::all;
};
// Whether GEMM `g` (an fp8_gemm bit) of a layer with this config runs in FP8.
inline bool uses_fp8(const MoeConfig& m, uint32_t g) {
  return m.precision == Precision::fp8 && (m.fp8_gemms & g) != 0;
}
// The shared experts' total FFN width (0 without shared experts).
inline int shared_width(const MoeConfig& m) {
  return m.shared_experts * (m.shared_ffn > 0 ? m.shared_ffn : m.ffn);
}

struct ParallelConfig {
  int ep_size = 1;  // R
  int ep_rank = 0;  // r
};

// How long an ECHO clone placement holds, and where a layer keeps its clones (EchoConfig).
enum class EchoPlacement {
  // Every forward plans clones for its own routing and pulls their weights into the echo slots
  // that the layers of a workspace share; every backward reduces its clones' gradients home.
  micro_batch,
  // A layer keeps one placement for a whole step, in echo slots of its own: the first forward
  // after the weights changed (the layer's construction, optimizer_step, weights_changed) plans
  // it from its routing and pulls the clones; the step's other forwards split their rows over it
  // (plan_placed) and pull nothing; the backwards add their clones' gradients in the slots,
  // reduced home once by the step's last backward (MoeLayer::hold_clone_grads).
  step,
};
const char* to_string(EchoPlacement p);
// Parses "micro_batch" or "step"; throws ConfigError naming `field` otherwise.
EchoPlacement parse_echo_placement(const std::string& s, const char* field = "placement");

struct EchoConfig {
  bool enabled = true;
  int spare_slots_per_rank = 1;   // S: slots per rank that may hold a clone for one step
  double capacity_factor = 1.25;  // receive buffer rows = ceil(capacity_factor * T * K)
  int max_clones_per_expert = 2;  // clones of one expert in one step (replicas = 1 + clones)
  // Cost of one clone (weights in, gradient out) in routed rows of expert work, per clone link
  // of the busiest-linked rank (a rank's links: clones it hosts + clones of its home experts):
  // the planner minimises the busiest rank's load plus this per such link (planner.hpp).
  int64_t clone_cost_rows = 0;
  EchoPlacement placement = EchoPlacement::micro_batch;  // see EchoPlacement
};

// Throws ConfigError on the first invalid field or combination.
void validate(const MoeConfig& moe);
void validate(const ParallelConfig& par, const MoeConfig& moe);
void validate(const EchoConfig& echo, const ParallelConfig& par);
void validate(const MoeConfig& moe, const ParallelConfig& par, const EchoConfig& echo);

// Derived sizes (valid configs only).
inline int experts_per_rank(const MoeConfig& m, const ParallelConfig& p) {
  return m.experts / p.ep_size;
}
// Expert slots on every rank: home slots then spare slots.
int slots_per_rank(const MoeConfig& m, const ParallelConfig& p, const EchoConfig& e);
// Rows a rank's receive buffer holds in one round: ceil(capacity_factor * T * K).
int64_t capacity_rows(const MoeConfig& m, const EchoConfig& e);
// Upper bound on rounds (first round plus spill rounds) for any routing.
int max_rounds(const MoeConfig& m, const ParallelConfig& p, const EchoConfig& e);

}  // namespace moe_echo
