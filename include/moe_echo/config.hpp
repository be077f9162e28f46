// Configuration of one MoE layer, its expert-parallel placement and ECHO.
//
// Configs are plain structs that grow by appending fields. MoeConfig's and EchoConfig's fields
// are declared from their lists in config_fields.hpp (type, name, default, allowed values, help:
// read them there); the CLI and the Python binding take the fields from the same lists.
// `validate()` checks every field and every combination; a violation throws moe_echo::ConfigError
// whose message names the field, the value given and what is allowed. Everything a layer
// allocates is sized from these structs.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "moe_echo/config_fields.hpp"

namespace moe_echo {

inline constexpr int kVersionMajor = 0;
inline constexpr int kVersionMinor = 1;
inline constexpr int kVersionPatch = 0;

// The names of an enum's values, in the order of the values: to_string, the parsers, the CLI and
// the Python binding read them here.
template <class E>
struct EnumNames;

enum class ScoreFunction { softmax, sigmoid };
template <>
struct EnumNames<ScoreFunction> {
  static constexpr const char* names[] = {"softmax", "sigmoid"};
};

const char* to_string(ScoreFunction f);
// Parses "softmax" or "sigmoid"; throws ConfigError naming `field` otherwise.
ScoreFunction parse_score_function(const std::string& s, const char* field = "score_function");

// How group-limited routing scores a group of experts from its experts' selection keys (score +
// bias): top2_sum, the sum of its two largest keys (DeepSeek-V3); max, its largest key.
enum class GroupScore { top2_sum, max };
template <>
struct EnumNames<GroupScore> {
  static constexpr const char* names[] = {"top2_sum", "max"};
};

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
  // keep fc1's output (and the routing): redo the dispatch, SwiGLU and fc2, not fc1. fc1's output
  // is 2F per row against the received rows' H, and fc1 is twice fc2's work.
  all_but_fc1,
};
template <>
struct EnumNames<Recompute> {
  static constexpr const char* names[] = {"none", "moe_act", "experts", "dispatch", "all_but_fc1"};
};

// What the backward of an option does again (and so what the layer does not keep): the dispatch
// and fan-out of x (the received rows), fc1 (its output), SwiGLU (its output), fc2 (the experts'
// outputs).
struct Redone {
  bool dispatch, fc1, swiglu, fc2;
};
constexpr Redone redone(Recompute r) {
  switch (r) {
    case Recompute::none: return {false, false, false, false};
    case Recompute::moe_act: return {false, false, true, false};
    case Recompute::experts: return {false, true, true, true};
    case Recompute::dispatch: return {true, true, true, true};
    case Recompute::all_but_fc1: return {true, false, true, true};
  }
  return {false, false, false, false};
}

const char* to_string(Recompute r);
// Parses "none", "moe_act", "experts", "dispatch" or "all_but_fc1"; throws ConfigError naming
// `field` otherwise.
Recompute parse_recompute(const std::string& s, const char* field = "recompute");

// What a layer's backward runs beside its communication (MoeConfig::overlap).
enum class Overlap {
  none,   // every op in turn on the caller's stream
  wgrad,  // round 0's fc1 weight-gradient GEMM on a second stream (Backend::fork_side) beside
          // round 0's combine and the router's backward, on all SMs but overlap_sms
};
template <>
struct EnumNames<Overlap> {
  static constexpr const char* names[] = {"none", "wgrad"};
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
template <>
struct EnumNames<Precision> {
  static constexpr const char* names[] = {"bf16", "fp8"};
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
// What parse_fp8_gemms takes, in words.
inline constexpr const char* kFp8GemmsAllowed =
    "all, or a comma-separated list of fprop1, fprop2, dgrad1, dgrad2, wgrad1, wgrad2, fprop, "
    "dgrad, wgrad";

// The largest top_k a layer takes: one warp handles a token's entries in dispatch and combine.
inline constexpr int kMaxTopK = 32;
// The most expert groups of group-limited routing: one warp holds a token's group scores.
inline constexpr int kMaxExpertGroups = 32;
// The most micro-batches in flight per layer (MoeConfig::in_flight).
inline constexpr int kMaxInFlight = 16;
// The most chunks of a forward's received rows (MoeConfig::chunks).
inline constexpr int kMaxChunks = 16;
// The largest loss coefficient or rate (aux, z and sequence aux losses, bias updates, routed
// scaling): beyond it the float losses and gradients would overflow (no training uses more than a
// few units).
inline constexpr double kMaxCoeff = 1e6;
// The largest clone cost (EchoConfig::clone_cost_rows), 2^31-1 rows: a step's routed rows fit
// int32 (validate() bounds ep * max_tokens * top_k), so at this cost no clone ever pays for
// itself and a larger one would change no plan (the planner caps costs at 2^31 in any case).
inline constexpr int64_t kMaxCloneCostRows = 2147483647;

// One MoE layer: the fields of MOE_ECHO_MOE_CONFIG_FIELDS (config_fields.hpp), in its order.
struct MoeConfig {
#define MOE_ECHO_DECLARE_FIELD(type, name, default_value, rule, help) type name = default_value;
  MOE_ECHO_MOE_CONFIG_FIELDS(MOE_ECHO_DECLARE_FIELD)
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
template <>
struct EnumNames<EchoPlacement> {
  static constexpr const char* names[] = {"micro_batch", "step"};
};
const char* to_string(EchoPlacement p);
// Parses "micro_batch" or "step"; throws ConfigError naming `field` otherwise.
EchoPlacement parse_echo_placement(const std::string& s, const char* field = "placement");

// ECHO: the fields of MOE_ECHO_ECHO_CONFIG_FIELDS (config_fields.hpp), in its order.
struct EchoConfig {
  MOE_ECHO_ECHO_CONFIG_FIELDS(MOE_ECHO_DECLARE_FIELD)
#undef MOE_ECHO_DECLARE_FIELD
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
// Rows a rank's receive buffer holds in one round: ceil(capacity_factor * T * K), at least 1.
int64_t capacity_rows(const MoeConfig& m);
// Upper bound on rounds (first round plus spill rounds) for any routing. The EchoConfig does not
// enter (ECHO moves rows between ranks, not past the capacity); the overload keeps its callers.
int max_rounds(const MoeConfig& m, const ParallelConfig& p);
inline int max_rounds(const MoeConfig& m, const ParallelConfig& p, const EchoConfig&) {
  return max_rounds(m, p);
}

// The fields by name, as text: what the CLI's options and the Python binding's keywords are
// made of. A field's text is what its option takes: a number ("1.25", "16"), "true" or "false",
// an enum's name ("softmax") or, for fp8_gemms, "all" or a list ("fprop1,wgrad1").
struct ConfigField {
  const char* name;
  const char* type;                  // as text and in Python: "int", "float", "bool" or "str"
  std::string default_text;          // the struct's default, as text
  std::string allowed;               // what validate() allows, in words ("1 <= chunks <= 16")
  std::vector<std::string> choices;  // the names a "str" field takes (none for fp8_gemms)
  const char* help;
};
// The entries of MOE_ECHO_MOE_CONFIG_FIELDS and MOE_ECHO_ECHO_CONFIG_FIELDS, in order.
const std::vector<ConfigField>& moe_config_fields();
const std::vector<ConfigField>& echo_config_fields();
// The value of field `name` as text. Throws ConfigError for a name that is no field.
std::string field_text(const MoeConfig& m, std::string_view name);
std::string field_text(const EchoConfig& e, std::string_view name);
// Sets field `name` from its text. Throws ConfigError naming `param` (the field as the caller
// spells it, such as a CLI flag's "tokens") when the text is no value of the field's type ("x"
// for an int, 99999999999 for an int, "relu" for the score function); ranges and combinations
// are validate()'s.
void set_field(MoeConfig& m, std::string_view name, const std::string& text,
               const std::string& param);
void set_field(EchoConfig& e, std::string_view name, const std::string& text,
               const std::string& param);

}  // namespace moe_echo
