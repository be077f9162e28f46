// Model presets: the shape of one MoE layer of each model that the CLI (`--preset`), the offline
// tools (simulator, capacity plan) and the benchmarks name, in one table.
//
// Invariants:
// - Every number of a model's shape lives here once; users read the table (the Python and shell
//   benchmarks, which cannot, repeat the numbers of the models they run).
// - moe_layers == 0 marks a shape that is no model ("tiny": a layer that runs in seconds on a
//   CPU); the capacity plan takes models only.
// - Names are lowercase; the table's order is the order names are listed in messages.
// - Routing as the models define it: DeepSeek-V3 sigmoid scores, 8 groups of which a token keeps
//   4 (sum of each group's top-2 keys), weights normalised and times 2.5, one shared expert;
//   Qwen3-MoE (norm_topk_prob) and Mixtral softmax top-k renormalised over the k. gpt-oss is not
//   in the table: its experts' clamped SwiGLU with biases is not this library's expert.
#pragma once

#include <string>
#include <string_view>

#include "moe_echo/config.hpp"

namespace moe_echo {

struct ModelPreset {
  std::string_view name;
  int hidden = 0;   // H
  int ffn = 0;      // F, one expert's FFN size (fc1 H x 2F, fc2 F x H)
  int experts = 0;  // E, routed experts of one MoE layer
  int top_k = 0;    // K
  ScoreFunction score = ScoreFunction::softmax;
  int moe_layers = 0;  // MoE layers of the model (0: no model)
  int tokens = 0;      // tokens per rank per step of the layer benchmarks (ANCHORS.md)
  int ep = 0;          // expert-parallel ranks of the layer benchmarks
  // The model's routing (MoeConfig's fields of the same names).
  bool normalize_topk = true;
  int expert_groups = 1;
  int topk_groups = 1;
  GroupScore group_score = GroupScore::top2_sum;
  double routed_scaling_factor = 1.0;
  int shared_experts = 0;  // dense SwiGLU experts of size F every token goes through
};

inline constexpr ModelPreset kTinyLayer{
    .name = "tiny", .hidden = 64, .ffn = 128, .experts = 16, .top_k = 2, .tokens = 256, .ep = 4};
inline constexpr ModelPreset kDeepSeekV3{.name = "deepseek-v3",
                                         .hidden = 7168,
                                         .ffn = 2048,
                                         .experts = 256,
                                         .top_k = 8,
                                         .score = ScoreFunction::sigmoid,
                                         .moe_layers = 58,  // of 61 layers, the first 3 dense
                                         .tokens = 8192,
                                         .ep = 4,
                                         .expert_groups = 8,
                                         .topk_groups = 4,
                                         .group_score = GroupScore::top2_sum,
                                         .routed_scaling_factor = 2.5,
                                         .shared_experts = 1};
inline constexpr ModelPreset kQwen3_30B_A3B{.name = "qwen3-30b-a3b",
                                            .hidden = 2048,
                                            .ffn = 768,
                                            .experts = 128,
                                            .top_k = 8,
                                            .moe_layers = 48,
                                            .tokens = 8192,
                                            .ep = 4};
inline constexpr ModelPreset kQwen3_235B_A22B{.name = "qwen3-235b-a22b",
                                              .hidden = 4096,
                                              .ffn = 1536,
                                              .experts = 128,
                                              .top_k = 8,
                                              .moe_layers = 94,
                                              .tokens = 8192,
                                              .ep = 4};
inline constexpr ModelPreset kMixtral8x7B{.name = "mixtral-8x7b",
                                          .hidden = 4096,
                                          .ffn = 14336,
                                          .experts = 8,
                                          .top_k = 2,
                                          .moe_layers = 32,
                                          .tokens = 8192,
                                          .ep = 4};

inline constexpr const ModelPreset* kModelPresets[] = {&kTinyLayer, &kDeepSeekV3, &kQwen3_30B_A3B,
                                                       &kQwen3_235B_A22B, &kMixtral8x7B};

// The MoeConfig of the preset's layer: its shape and routing, max_tokens = tokens, the library's
// defaults for the rest.
MoeConfig moe_config(const ModelPreset& p);

// The preset named `name` (exactly), or nullptr.
const ModelPreset* find_model_preset(std::string_view name);

// The names in table order, of models only or of every preset, joined by ", " and by
// `last_separator` before the last: "a, b, c" or, with " or ", "a, b or c".
std::string model_preset_names(bool models_only, std::string_view last_separator = ", ");

}  // namespace moe_echo
