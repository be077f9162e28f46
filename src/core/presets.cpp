// The model preset table's look-ups (moe_echo/presets.hpp); the table itself is in the header.
#include "moe_echo/presets.hpp"

#include <vector>

namespace moe_echo {

MoeConfig moe_config(const ModelPreset& p) {
  MoeConfig m;
  m.hidden = p.hidden;
  m.ffn = p.ffn;
  m.experts = p.experts;
  m.top_k = p.top_k;
  m.max_tokens = p.tokens;
  m.score_function = p.score;
  m.normalize_topk = p.normalize_topk;
  m.expert_groups = p.expert_groups;
  m.topk_groups = p.topk_groups;
  m.group_score = p.group_score;
  m.routed_scaling_factor = p.routed_scaling_factor;
  m.shared_experts = p.shared_experts;
  return m;
}

const ModelPreset* find_model_preset(std::string_view name) {
  for (const ModelPreset* p : kModelPresets)
    if (p->name == name) return p;
  return nullptr;
}

std::string model_preset_names(bool models_only, std::string_view last_separator) {
  std::vector<std::string_view> names;
  for (const ModelPreset* p : kModelPresets)
    if (!models_only || p->moe_layers > 0) names.push_back(p->name);
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) s += i + 1 == names.size() ? last_separator : std::string_view(", ");
    s += names[i];
  }
  return s;
}

}  // namespace moe_echo
