// The configs' enum names, validate()'s checks of the fields' combinations (the per-field rules
// of the lists run first, core/field_checks.hpp) and the sizes derived from a config.
#include "moe_echo/config.hpp"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <sstream>

#include "core/field_checks.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo {
namespace {

std::string range(const char* lo, const char* field, const std::string& hi) {
  return std::string(lo) + " <= " + field + " <= " + hi;
}

constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();
// The most elements of one tensor a layer allocates (8 TiB of f64), so that no size product
// overflows and a nonsense shape is refused before anything is sized from it.
constexpr int64_t kMaxElements = int64_t(1) << 40;
// Rank-by-expert tables (routing counts, the planner's loads) hold at most this many entries.
constexpr int64_t kMaxRankExperts = int64_t(1) << 28;

// The name of `v` (EnumNames), or "?" for a value outside the enum.
template <class E>
const char* enum_name(E v) {
  const int i = int(v);
  return i >= 0 && i < int(std::size(EnumNames<E>::names)) ? EnumNames<E>::names[i] : "?";
}

// The value named `s`; throws ConfigError naming `field` with every name otherwise.
template <class E>
E parse_enum(const std::string& s, const char* field) {
  const int n = int(std::size(EnumNames<E>::names));
  std::string allowed;
  for (int i = 0; i < n; ++i) {
    if (s == EnumNames<E>::names[i]) return E(i);
    allowed += std::string(i == 0 ? "" : i + 1 == n ? " or " : ", ") + EnumNames<E>::names[i];
  }
  reject(field, "'" + s + "'", allowed);
}

}  // namespace

const char* to_string(ScoreFunction f) { return enum_name(f); }
ScoreFunction parse_score_function(const std::string& s, const char* field) {
  return parse_enum<ScoreFunction>(s, field);
}
const char* to_string(GroupScore g) { return enum_name(g); }
GroupScore parse_group_score(const std::string& s, const char* field) {
  return parse_enum<GroupScore>(s, field);
}
const char* to_string(Recompute r) { return enum_name(r); }
Recompute parse_recompute(const std::string& s, const char* field) {
  return parse_enum<Recompute>(s, field);
}
const char* to_string(Overlap o) { return enum_name(o); }
Overlap parse_overlap(const std::string& s, const char* field) {
  return parse_enum<Overlap>(s, field);
}
const char* to_string(EchoPlacement p) { return enum_name(p); }
EchoPlacement parse_echo_placement(const std::string& s, const char* field) {
  return parse_enum<EchoPlacement>(s, field);
}
const char* to_string(Precision p) { return enum_name(p); }
Precision parse_precision(const std::string& s, const char* field) {
  return parse_enum<Precision>(s, field);
}

namespace {
struct Fp8GemmName {
  const char* name;
  uint32_t bits;
};
constexpr Fp8GemmName kFp8GemmNames[] = {{"fprop1", fp8_gemm::fprop1},
                                         {"fprop2", fp8_gemm::fprop2},
                                         {"dgrad1", fp8_gemm::dgrad1},
                                         {"dgrad2", fp8_gemm::dgrad2},
                                         {"wgrad1", fp8_gemm::wgrad1},
                                         {"wgrad2", fp8_gemm::wgrad2},
                                         {"fprop", fp8_gemm::fprop1 | fp8_gemm::fprop2},
                                         {"dgrad", fp8_gemm::dgrad1 | fp8_gemm::dgrad2},
                                         {"wgrad", fp8_gemm::wgrad1 | fp8_gemm::wgrad2},
                                         {"all", fp8_gemm::all}};
}  // namespace

std::string fp8_gemms_to_string(uint32_t gemms) {
  if (gemms == fp8_gemm::all) return "all";
  std::string out;
  for (int i = 0; i < 6; ++i)
    if (gemms & kFp8GemmNames[i].bits)
      out += std::string(out.empty() ? "" : ",") + kFp8GemmNames[i].name;
  return out.empty() ? "none" : out;
}

uint32_t parse_fp8_gemms(const std::string& s, const char* field) {
  uint32_t bits = 0;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = std::min(s.find(',', start), s.size());
    const std::string item = s.substr(start, comma - start);
    bool known = false;
    for (const Fp8GemmName& n : kFp8GemmNames)
      if (item == n.name) bits |= n.bits, known = true;
    if (!known) reject(field, "'" + s + "'", kFp8GemmsAllowed);
    start = comma + 1;
  }
  return bits;
}

// The per-field rules (check_fields) first, then the combinations, each naming the field it
// refuses.
void validate(const MoeConfig& m) {
  check_fields(m);
  if (m.top_k < 1 || m.top_k > m.experts)
    reject("top_k", m.top_k, range("1", "top_k", "experts (" + std::to_string(m.experts) + ")"));
  if (m.top_k > kMaxTopK)
    reject("top_k", m.top_k,
           "top_k <= " + std::to_string(kMaxTopK) + " (a token's entries are handled by one warp)");
  if (int64_t(m.max_tokens) * m.top_k > kMaxRows)
    reject("max_tokens", m.max_tokens,
           "max_tokens * top_k <= 2^31-1 (top_k = " + std::to_string(m.top_k) + ")");
  if (m.experts % m.expert_groups != 0)
    reject("expert_groups", m.expert_groups,
           range("1", "expert_groups", std::to_string(kMaxExpertGroups)) + ", dividing experts (" +
               std::to_string(m.experts) + ")");
  if (m.topk_groups > m.expert_groups)
    reject("topk_groups", m.topk_groups,
           range("1", "topk_groups", "expert_groups (" + std::to_string(m.expert_groups) + ")"));
  const int64_t selectable = int64_t(m.topk_groups) * (m.experts / m.expert_groups);
  if (m.top_k > selectable)
    reject("top_k", m.top_k,
           "top_k <= topk_groups * experts / expert_groups (" + std::to_string(selectable) +
               ": the experts of the chosen groups)");
  if (m.group_score == GroupScore::top2_sum && m.expert_groups > 1 &&
      m.experts / m.expert_groups < 2)
    reject("group_score", to_string(m.group_score),
           "max when a group holds one expert (experts / expert_groups = 1)");
  if (m.overlap == Overlap::wgrad && uses_fp8(m, fp8_gemm::fprop1) &&
      !uses_fp8(m, fp8_gemm::wgrad1))
    reject("overlap", "'wgrad'",
           "'none' when fc1's forward is FP8 and its weight gradient is not (fp8_gemms with fprop1 "
           "and without wgrad1: that weight gradient reads the received rows' values from the "
           "buffer the combine sends)");
  if (m.chunks > 1 && uses_fp8(m, fp8_gemm::fprop1))
    reject("chunks", m.chunks,
           "1 with the FP8 dispatch (precision fp8 with fprop1 in fp8_gemms): its e4m3 rows land "
           "in the buffer that the chunks' combines read");
  if (m.precision == Precision::fp8 && (m.hidden % 16 != 0 || m.ffn % 16 != 0))
    reject(m.hidden % 16 != 0 ? "hidden" : "ffn", m.hidden % 16 != 0 ? m.hidden : m.ffn,
           "a multiple of 16 with precision fp8 (16-byte e4m3 rows for the FP8 GEMMs)");
  if (m.shared_side_stream && m.shared_experts == 0)
    reject("shared_side_stream", "true", "false without shared experts (shared_experts = 0)");
  if (int64_t(m.shared_experts) * (m.shared_ffn > 0 ? m.shared_ffn : m.ffn) > kMaxRows)
    reject("shared_experts", m.shared_experts, "shared_experts * shared_ffn <= 2^31-1");
  if (m.seq_aux_loss_coeff > 0 && m.seq_len < 1)
    reject("seq_len", m.seq_len, "seq_len >= 1 with seq_aux_loss_coeff > 0");
}

void validate(const ParallelConfig& p, const MoeConfig& m) {
  if (p.ep_size < 1) reject("ep_size", p.ep_size, "ep_size >= 1");
  if (p.ep_rank < 0 || p.ep_rank >= p.ep_size)
    reject("ep_rank", p.ep_rank,
           range("0", "ep_rank", "ep_size - 1 (" + std::to_string(p.ep_size - 1) + ")"));
  if (m.experts % p.ep_size != 0)
    reject("experts", m.experts, "a multiple of ep_size (" + std::to_string(p.ep_size) + ")");
  if (int64_t(m.max_tokens) * m.top_k * p.ep_size > kMaxRows)
    reject("ep_size", p.ep_size, "max_tokens * top_k * ep_size <= 2^31-1");
  if (int64_t(m.experts) * p.ep_size > kMaxRankExperts)
    reject("ep_size", p.ep_size,
           "experts * ep_size <= 2^28 (experts = " + std::to_string(m.experts) + ")");
}

void validate(const EchoConfig& e, const ParallelConfig& p) {
  check_fields(e);
  // Each clone of an expert sits on a rank other than the expert's, one per rank: more than
  // ep_size - 1 clones cannot be placed. The library default (2) is accepted on any ep_size.
  const int useful_clones = std::max(p.ep_size - 1, EchoConfig{}.max_clones_per_expert);
  if (e.max_clones_per_expert > useful_clones)
    reject("max_clones_per_expert", e.max_clones_per_expert,
           "max_clones_per_expert <= max(ep_size - 1, 2) = " + std::to_string(useful_clones) +
               " (a clone sits on another rank than its expert, one per rank)");
}

void validate(const MoeConfig& m, const ParallelConfig& p, const EchoConfig& e) {
  validate(m);
  validate(p, m);
  validate(e, p);
  const double cap = std::ceil(m.capacity_factor * double(m.max_tokens) * m.top_k);
  if (cap > double(kMaxRows))
    reject("capacity_factor", m.capacity_factor, "capacity_factor * max_tokens * top_k <= 2^31-1");
  if (int64_t(m.experts) / p.ep_size + e.spare_slots_per_rank > 1 << 20)
    reject("spare_slots_per_rank", e.spare_slots_per_rank,
           "experts / ep_size + spare slots <= 2^20");
  if (int64_t(m.max_tokens) * m.hidden > kMaxElements)
    reject("max_tokens", m.max_tokens,
           "max_tokens * hidden <= 2^40 (hidden = " + std::to_string(m.hidden) + ")");
  if (int64_t(m.experts) * m.hidden > kMaxElements)
    reject("experts", m.experts,
           "experts * hidden <= 2^40 (hidden = " + std::to_string(m.hidden) + ")");
  const int64_t slots = int64_t(m.experts) / p.ep_size + e.spare_slots_per_rank;
  if (double(slots) * 3.0 * m.hidden * m.ffn > double(kMaxElements))
    reject("ffn", m.ffn,
           "3 * hidden * ffn * slots per rank <= 2^40 (hidden = " + std::to_string(m.hidden) +
               ", " + std::to_string(slots) + " slots per rank)");
  if (cap * 2.0 * std::max(m.hidden, m.ffn) > double(kMaxElements))
    reject("capacity_factor", m.capacity_factor,
           "capacity_factor * max_tokens * top_k * 2 * max(hidden, ffn) <= 2^40 (the receive "
           "buffers)");
}

int slots_per_rank(const MoeConfig& m, const ParallelConfig& p, const EchoConfig& e) {
  return experts_per_rank(m, p) + (e.enabled ? e.spare_slots_per_rank : 0);
}

int64_t capacity_rows(const MoeConfig& m) {
  const double cap = std::ceil(m.capacity_factor * double(m.max_tokens) * m.top_k);
  return std::max<int64_t>(1, int64_t(cap));
}

int max_rounds(const MoeConfig& m, const ParallelConfig& p) {
  const int64_t worst = int64_t(m.max_tokens) * m.top_k * p.ep_size;  // every row to one rank
  const int64_t cap = capacity_rows(m);
  return int((worst + cap - 1) / cap);
}

}  // namespace moe_echo
