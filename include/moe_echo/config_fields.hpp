// The fields of MoeConfig and EchoConfig, each written once: its C++ type, name, default, the
// values it allows and a one-line help.
//
// Everything that names a field is generated from these lists or checked against them:
// - the structs' members and defaults (config.hpp declares MoeConfig and EchoConfig from them);
// - validate()'s per-field checks (the rule column; combinations of fields stay in config.cpp);
// - the fields by name, as text (config.hpp: moe_config_fields(), set_field(), field_text());
// - the CLI's layer options of `bench` and `train`, one per MoeConfig field, `--top-k` for top_k
//   (apps/moe-echo/layer_options.cpp);
// - the Python binding's keywords and moe_echo._ext.moe_config_fields() (python/ext/module.cpp),
//   which tests/python/test_config_fields.py holds the PyTorch module's signature and docstring
//   to.
// Adding a field is one entry here, appended at the end of its list (configs grow at the end);
// its help is what `moe-echo bench --help` and the Python field list print.
//
// An entry is X(type, name, default, rule, help). The rule says what validate() allows:
//   at_least(lo), in_range(lo, hi)  a number in [lo, hi] (finite, for floating types)
//   above(lo), above_up_to(lo, hi)  a finite number > lo (and <= hi)
//   flag()                          a bool
//   choice()                        one of an enum's names (EnumNames in config.hpp)
//   fp8_gemm_set()                  a non-empty set of fp8_gemm bits; text "all" or a list
//   by_hand("...")                  checked by config.cpp only; the text says what it allows
// The rules are constexpr values of FieldRule below; a macro's user expands the list where
// moe_echo::field_rules is in scope (the struct declarations ignore the column).
#pragma once

#include <limits>
#include <sstream>
#include <string>
#include <type_traits>

namespace moe_echo {

// What a number of type T may be, for messages (the field checks' and the CLI's).
template <class T>
std::string number_kind() {
  if constexpr (std::is_floating_point_v<T>) {
    return "a finite number";
  } else {
    std::ostringstream s;
    s << "an integer from " << +std::numeric_limits<T>::min() << " to "
      << +std::numeric_limits<T>::max();
    return s.str();
  }
}

// What values one field allows (see the rule column above).
struct FieldRule {
  enum Kind { number, flag, choice, fp8_gemm_set, by_hand };
  Kind kind = number;
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false;        // lo itself is not allowed
  const char* text = nullptr;  // by_hand: what config.cpp allows, in words
};

namespace field_rules {
constexpr FieldRule at_least(double lo) { return {FieldRule::number, lo}; }
constexpr FieldRule in_range(double lo, double hi) { return {FieldRule::number, lo, hi}; }
constexpr FieldRule above(double lo) {
  return {FieldRule::number, lo, std::numeric_limits<double>::infinity(), true};
}
constexpr FieldRule above_up_to(double lo, double hi) { return {FieldRule::number, lo, hi, true}; }
constexpr FieldRule flag() { return {FieldRule::flag}; }
constexpr FieldRule choice() { return {FieldRule::choice}; }
constexpr FieldRule fp8_gemm_set() { return {FieldRule::fp8_gemm_set}; }
constexpr FieldRule by_hand(const char* text) {
  FieldRule r{FieldRule::by_hand};
  r.text = text;
  return r;
}
}  // namespace field_rules

}  // namespace moe_echo

// MoeConfig: one MoE layer. kMaxCoeff and the other limits are config.hpp's.
#define MOE_ECHO_MOE_CONFIG_FIELDS(X)                                                              \
  X(int, hidden, 0, at_least(1), "H, the hidden size")                                             \
  X(int, ffn, 0, at_least(1), "F, one expert's FFN size: fc1 is H x 2F (gate | up), fc2 F x H")    \
  X(int, experts, 0, at_least(1), "E, the routed experts of the layer (all ranks together)")       \
  X(int, top_k, 0, by_hand("1 <= top_k <= experts, at most 32"),                                   \
    "K, the experts chosen per token")                                                             \
  X(int, max_tokens, 0, at_least(1), "T, the most tokens one rank feeds the layer in one step")    \
  X(ScoreFunction, score_function, ScoreFunction::softmax, choice(),                               \
    "the router's score function")                                                                 \
  X(bool, normalize_topk, true, flag(), "rescale the K chosen weights to sum to 1")                \
  X(double, aux_loss_coeff, 0.0, in_range(0, kMaxCoeff),                                           \
    "Switch-style load-balancing loss: coeff * E * sum_e f_e P_e")                                 \
  X(double, z_loss_coeff, 0.0, in_range(0, kMaxCoeff),                                             \
    "router z-loss: coeff * mean_t logsumexp(logits_t)^2")                                         \
  X(bool, bias_update, false, flag(),                                                              \
    "aux-loss-free balancing: router bias b_e += rate * sign(mean - count_e) each step")           \
  X(double, bias_update_rate, 1e-3, in_range(0, kMaxCoeff), "the rate of bias_update")             \
  /* Group-limited top-k: experts [g E/G, (g + 1) E/G) form group g of G = expert_groups; a */     \
  /* token picks its topk_groups best groups by group_score, then its top_k experts inside */      \
  /* them. Groups that align to EP ranks bound the ranks a token's rows go to. */                  \
  X(int, expert_groups, 1, in_range(1, kMaxExpertGroups),                                          \
    "group-limited top-k: the experts in this many groups of E/G, a divisor of E; 1: no limit")    \
  X(int, topk_groups, 1, at_least(1),                                                              \
    "the groups a token picks its experts from, at most expert_groups")                            \
  X(GroupScore, group_score, GroupScore::top2_sum, choice(),                                       \
    "how a group is scored: top2_sum (sum of its two best keys, DeepSeek-V3) or max")              \
  X(double, routed_scaling_factor, 1.0, above_up_to(0, kMaxCoeff),                                 \
    "the combine weights times this factor, after normalisation (DeepSeek-V3's 2.5)")              \
  /* The aux loss's formula over each run of seq_len consecutive tokens (the last run may be */    \
  /* shorter), averaged over the runs: coeff * mean_s E sum_e f_se P_se. */                        \
  X(double, seq_aux_loss_coeff, 0.0, in_range(0, kMaxCoeff),                                       \
    "sequence-level aux loss: the aux loss of each run of seq_len tokens, averaged")               \
  X(int, seq_len, 0, at_least(0),                                                                  \
    "tokens per sequence of the sequence-level aux loss; at least 1 with its coefficient")         \
  /* Shared experts: dense SwiGLU experts every token goes through, their output added to the */   \
  /* routed experts'; together one SwiGLU of width shared_experts * shared_ffn (0: ffn), */        \
  /* replicated on every EP rank, run by the expert GEMM kernels as one group. */                  \
  X(int, shared_experts, 0, at_least(0), "dense SwiGLU experts every token goes through")          \
  X(int, shared_ffn, 0, at_least(0), "one shared expert's FFN size; 0: ffn")                       \
  /* On Backend::fork_side, beside the router, the plan, the layout and (without spill rounds */   \
  /* configured) round 0's dispatch and expert GEMMs; joined before the first combine that */      \
  /* adds into y (forward) or dx (backward). */                                                    \
  X(bool, shared_side_stream, false, flag(),                                                       \
    "run the shared experts on a second stream beside the router and the dispatch")                \
  X(Recompute, recompute, Recompute::none, choice(),                                               \
    "what the forward keeps for the backward: all (none), or it redoes SwiGLU (moe_act), fc1, "    \
    "SwiGLU and fc2 (experts), the dispatch too (dispatch) or all of them but fc1, whose output "  \
    "it keeps (all_but_fc1); the same gradient bits")                                              \
  X(Overlap, overlap, Overlap::none, choice(),                                                     \
    "what the backward runs beside its communication: nothing (none) or fc1's weight-gradient "    \
    "GEMM on a second stream beside the combine (wgrad); the same bits")                           \
  X(int, overlap_sms, 16, in_range(0, 1024),                                                       \
    "the SMs that a second stream's GEMMs leave to communication with overlap wgrad or chunks "    \
    "above 1 (CUDA; below the GPU's SMs)")                                                         \
  /* Chunk c's expert GEMMs (the backward's dgrads) run on the backend's side stream, on all */    \
  /* SMs but overlap_sms, while chunk c + 1 is dispatched and chunk c - 1 combined on the */       \
  /* step's stream, the backward's weight gradients after the chunks; the chunks' rows are */      \
  /* computed on the device from the layout (Backend::chunk_plan, RowChunks), and the results */   \
  /* are the bits of one chunk. forward() and backward() only: the split-phase calls refuse */     \
  /* it. A backward with FP8 weight gradients runs whole. */                                       \
  X(int, chunks, 1, in_range(1, kMaxChunks),                                                       \
    "the received rows of the forward and the backward in this many chunks: a chunk's expert "     \
    "GEMMs on a second stream while the next is dispatched and the one before combined; the same " \
    "bits")                                                                                        \
  /* Each micro-batch in flight keeps its own routing, plan and kept activations (MoeLayer's */    \
  /* micro_batch argument picks one, 0 to in_flight - 1). With 2 or more, two micro-batches' */    \
  /* split phases may also interleave: micro-batch m uses set m % 2 of the workspace's receive */  \
  /* windows, temporaries and echo slots. */                                                       \
  X(int, in_flight, 1, in_range(1, kMaxInFlight),                                                  \
    "micro-batches in flight: forwards that may await their backward at once")                     \
  /* AdamW (the layer's own optimizer_step) updates float masters of the expert and */             \
  /* shared-expert weights and writes the weights the GEMMs read (bf16 on CUDA) as their */        \
  /* rounding, so updates below a bf16 ulp are not lost. The router weight is float already. */    \
  X(bool, master_weights, false, flag(),                                                           \
    "float master copies of the expert weights for the layer's own AdamW")                         \
  X(Precision, precision, Precision::bf16, choice(),                                               \
    "the routed experts' GEMMs: bf16, or fp8 (e4m3 with blockwise scales; hidden and ffn "         \
    "multiples of 16)")                                                                            \
  X(uint32_t, fp8_gemms, fp8_gemm::all, fp8_gemm_set(),                                            \
    "with precision fp8, the expert GEMMs that run in FP8, the rest in the activation dtype; "     \
    "with fprop1 the tokens cross in e4m3")                                                        \
  /* Rows beyond the capacity run in spill rounds, never dropped; with ECHO on or off. */          \
  X(double, capacity_factor, 1.25, above(0),                                                       \
    "receive buffer rows per round = ceil(capacity_factor * max_tokens * top_k)")

// EchoConfig: ECHO, the cloning of hot experts into spare slots.
#define MOE_ECHO_ECHO_CONFIG_FIELDS(X)                                                            \
  X(bool, enabled, true, flag(), "ECHO: clone the hot experts into spare slots on other ranks")   \
  X(int, spare_slots_per_rank, 1, at_least(0),                                                    \
    "S, the slots per rank that may hold a clone for one step")                                   \
  X(int, max_clones_per_expert, 2, at_least(0),                                                   \
    "clones of one expert in one step (replicas = 1 + clones)")                                   \
  /* Per clone link of the busiest-linked rank (a rank's links: clones it hosts + clones of */    \
  /* its home experts): the planner minimises the busiest rank's load plus this per such link */  \
  /* (planner.hpp). */                                                                            \
  X(int64_t, clone_cost_rows, 0, in_range(0, kMaxCloneCostRows),                                  \
    "the cost of one clone (weights in, gradient out) in routed rows of expert work (0: free; "   \
    "on a GPU, `moe-echo bench` and the PyTorch module take the cost model's price when it is "   \
    "not given)")                                                                                 \
  X(EchoPlacement, placement, EchoPlacement::micro_batch, choice(),                               \
    "how long a clone placement holds: one forward (micro_batch) or a step (step, in echo slots " \
    "of the layer's own)")
