// GCC 12 reports a false -Wrestrict inside std::string's operator+ (GCC bug 105329) for the
// messages below; the pragma must precede the standard headers to reach that code.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wrestrict"
#endif

#include "moe_echo/capacity_plan.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <sstream>

#include "moe_echo/backend.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/presets.hpp"

namespace moe_echo::offline {
namespace {

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string fmt(double v, int precision = 2) {
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(precision);
  s << v;
  return s.str();
}

template <class V>
std::string invalid(const std::string& field, const V& value, const std::string& allowed) {
  std::ostringstream s;
  s << field << " = " << value << " is invalid: allowed " << allowed;
  return s.str();
}

constexpr double kGB = 1e9;

// Micro-batches whose activations the first stage holds (1F1B: pp; interleaved: more,
// Korthikanti et al. 2022: factor 1 + (pp - 1) / (pp * vpp)).
double microbatches_in_flight(const LayoutSpec& l) {
  if (l.pp == 1) return 1.0;
  return l.pp * (l.vpp > 1 ? 1.0 + double(l.pp - 1) / double(l.pp * l.vpp) : 1.0);
}

// The MoeConfig::in_flight whose workspace has the sets `inflight` micro-batches need: two sets
// with more than one in flight (MoeWorkspace::sets_for), else one.
int in_flight_for_sets(double inflight) { return inflight > 1.0 ? 2 : 1; }

// Echo-slot memory per GPU with `spare_slots` slots, the library's: one pool in the workspace
// that every layer's clones pass through (weights and their fp32 gradients), one per workspace
// set (two with more than one micro-batch in flight).
double echo_slots_gb(const WallsInput& in, int spare_slots) {
  WallsInput w = in;
  w.train.spare_slots = spare_slots;
  const StageLayers s = stage_layers(w);
  MoeConfig layer = s.layers.front();
  layer.in_flight = in_flight_for_sets(microbatches_in_flight(in.layout));
  const MoeMemory m =
      MoeWorkspace::memory_breakdown({layer}, s.par, s.echo, s.activation, s.float_dtype);
  return double(m.echo_slot_weights + m.echo_slot_grads) / kGB;
}

// The library's count of a stage whose layers keep `in_flight` micro-batches.
MoeMemory stage_memory(const WallsInput& in, Recompute recompute, int in_flight) {
  StageLayers s = stage_layers(in, recompute);
  for (MoeConfig& c : s.layers) c.in_flight = in_flight;
  return s.memory();
}

// A stage's memory with `inflight` micro-batches in flight, as the library allocates it:
// `one` counted with one micro-batch a layer, `sets` with two (MoeConfig::in_flight 2: the
// workspace's two sets of receive windows, temporaries and echo slots; with one in flight the
// same as `one`). Parameters, gradients, optimizer state (sharded over `optimizer_shards`) and
// the workspace from `sets`; each layer's routing, kept activations and temporaries once per
// micro-batch in flight (each of a layer's in_flight slots has its own).
struct StageMemory {
  MoeMemory one, sets;
  double inflight = 1.0, optimizer_shards = 1.0;
  double per_micro_batch() const {
    return inflight * double(one.activations + one.routing + one.temporaries);
  }
  double gb() const {
    return (double(sets.params + sets.grads + sets.echo_slot_weights + sets.echo_slot_grads +
                   sets.workspace + sets.fp8) +
            double(sets.optimizer) / optimizer_shards + per_micro_batch()) /
           kGB;
  }
};
StageMemory stage_memory(const WallsInput& in, Recompute recompute, double inflight,
                         double optimizer_shards) {
  StageMemory m;
  m.one = stage_memory(in, recompute, 1);
  const int sets_in_flight = in_flight_for_sets(inflight);
  m.sets = sets_in_flight > 1 ? stage_memory(in, recompute, sets_in_flight) : m.one;
  m.inflight = inflight;
  m.optimizer_shards = optimizer_shards;
  return m;
}

}  // namespace

StageLayers stage_layers(const WallsInput& in) {
  return stage_layers(in, parse_recompute(in.train.recompute, "recompute"));
}

StageLayers stage_layers(const WallsInput& in, Recompute recompute) {
  const ModelSpec& m = in.model;
  const LayoutSpec& l = in.layout;
  MoeConfig c;
  c.hidden = m.hidden;
  c.ffn = m.ffn / l.etp;
  c.experts = m.experts;
  c.top_k = m.top_k;
  c.max_tokens = int(int64_t(m.seq_len) * m.micro_batch);
  c.expert_groups = m.expert_groups;
  c.topk_groups = m.topk_groups;
  // The group score does not change what a layer allocates; max where groups of one expert
  // leave top2_sum undefined.
  c.group_score = m.expert_groups > 1 && m.experts / m.expert_groups < 2 ? GroupScore::max
                                                                         : GroupScore::top2_sum;
  c.shared_experts = m.shared_experts;
  c.recompute = recompute;
  c.precision = parse_precision(in.train.precision, "precision");
  c.fp8_gemms = parse_fp8_gemms(in.train.fp8_gemms, "fp8_gemms");
  c.capacity_factor = in.train.capacity_factor * l.etp;
  c.overlap = parse_overlap(in.train.overlap, "overlap");
  StageLayers s;
  s.layers.assign(size_t(m.layers / l.pp), c);
  s.par = ParallelConfig{l.ep, 0};
  s.echo.spare_slots_per_rank = in.train.spare_slots;
  s.echo.max_clones_per_expert = in.train.max_clones;
  s.activation = m.dtype == "fp32" ? DType::f32 : DType::bf16;
  s.float_dtype = DType::f32;
  return s;
}

MoeMemory StageLayers::memory() const {
  return MoeStack::memory_breakdown(layers, par, echo, activation, float_dtype,
                                    /*optimizer_state=*/true);
}

ModelSpec model_preset(const std::string& name, const char* field) {
  const ModelPreset* p = find_model_preset(lower(name));
  if (!p || p->moe_layers == 0) reject(field, "'" + name + "'", model_preset_names(true, " or "));
  ModelSpec m;
  m.name = p->name;
  m.hidden = p->hidden;
  m.ffn = p->ffn;
  m.experts = p->experts;
  m.top_k = p->top_k;
  m.layers = p->moe_layers;
  m.expert_groups = p->expert_groups;
  m.topk_groups = p->topk_groups;
  m.shared_experts = p->shared_experts;
  return m;
}

int dtype_bytes(const std::string& dtype) {
  if (dtype == "bf16" || dtype == "fp16") return 2;
  if (dtype == "fp32") return 4;
  return 0;
}

std::vector<Finding> check(const WallsInput& in) {
  std::vector<Finding> f;
  auto error = [&](const std::string& field, const std::string& msg) {
    f.push_back({Severity::error, field, msg});
  };
  auto warning = [&](const std::string& field, const std::string& msg) {
    f.push_back({Severity::warning, field, msg});
  };
  const ModelSpec& m = in.model;
  const LayoutSpec& l = in.layout;
  const TrainingSpec& t = in.train;

  // Ranges of single values.
  const std::pair<const char*, int> positive[] = {
      {"hidden", m.hidden}, {"ffn", m.ffn},         {"experts", m.experts},
      {"layers", m.layers}, {"seq_len", m.seq_len}, {"micro_batch", m.micro_batch},
      {"ep", l.ep},         {"etp", l.etp},         {"dp", l.dp},
      {"pp", l.pp},         {"vpp", l.vpp},         {"kernels_per_layer", t.kernels_per_layer}};
  for (const auto& [field, v] : positive)
    if (v < 1) error(field, invalid(field, v, std::string(field) + " >= 1"));
  // The model counts a pipeline stage's layers one MoeConfig each (MoeStack::memory_breakdown).
  if (m.layers > kMaxPlanLayers)
    error("layers", invalid("layers", m.layers,
                            "1 <= layers <= " + std::to_string(kMaxPlanLayers) +
                                " (MoE layers of one model; DeepSeek-V3 has 58)"));
  if (!f.empty()) return f;  // the rules below divide by these
  if (m.top_k < 1 || m.top_k > m.experts)
    error("top_k",
          invalid("top_k", m.top_k, "1 <= top_k <= experts (" + std::to_string(m.experts) + ")"));
  if (m.expert_groups < 1 || m.expert_groups > kMaxExpertGroups || m.experts % m.expert_groups != 0)
    error("expert_groups", invalid("expert_groups", m.expert_groups,
                                   "1 <= expert_groups <= " + std::to_string(kMaxExpertGroups) +
                                       ", dividing experts (" + std::to_string(m.experts) + ")"));
  else if (m.topk_groups < 1 || m.topk_groups > m.expert_groups)
    error("topk_groups",
          invalid("topk_groups", m.topk_groups,
                  "1 <= topk_groups <= expert_groups (" + std::to_string(m.expert_groups) + ")"));
  else if (m.top_k > int64_t(m.topk_groups) * (m.experts / m.expert_groups))
    error("top_k", invalid("top_k", m.top_k,
                           "top_k <= topk_groups * experts / expert_groups (the experts of the "
                           "chosen groups)"));
  if (dtype_bytes(m.dtype) == 0)
    error("dtype", invalid("dtype", "'" + m.dtype + "'", "bf16, fp16 or fp32"));
  if (t.grad_dtype != "fp32")
    error("grad_dtype", invalid("grad_dtype", "'" + t.grad_dtype + "'",
                                "fp32 (the MoE layers accumulate gradients in fp32, the "
                                "backend's float dtype)"));
  // A field read by its config parser: the ConfigError it throws, as a finding.
  auto parsed = [&](auto parse) {
    try {
      parse();
    } catch (const ConfigError& e) {
      error(e.field(), e.what());
    }
  };
  parsed([&] { parse_precision(t.precision, "precision"); });
  parsed([&] {
    parse_fp8_gemms(t.fp8_gemms, "fp8_gemms");
    if (t.precision != "fp8" && t.fp8_gemms != "all")
      error("fp8_gemms", invalid("fp8_gemms", "'" + t.fp8_gemms + "'",
                                 "all (the default) unless precision is fp8"));
  });
  parsed([&] { parse_overlap(t.overlap, "overlap"); });
  parsed([&] { parse_recompute(t.recompute, "recompute"); });
  if (!std::isfinite(t.capacity_factor) || t.capacity_factor <= 0)
    error("capacity_factor", invalid("capacity_factor", t.capacity_factor, "a finite value > 0"));
  if (t.spare_slots < 0)
    error("spare_slots", invalid("spare_slots", t.spare_slots, "spare_slots >= 0"));
  if (t.max_clones < 0) error("max_clones", invalid("max_clones", t.max_clones, "max_clones >= 0"));
  if (!std::isfinite(t.reserve_gb) || t.reserve_gb < 0)
    error("reserve_gb", invalid("reserve_gb", t.reserve_gb, "a finite value >= 0"));

  // Combinations.
  if (m.experts % l.ep != 0)
    error("experts",
          invalid("experts", m.experts, "a multiple of ep (" + std::to_string(l.ep) + ")"));
  // Clones and spare slots beyond what can be placed (one replica of an expert per rank, on
  // ranks other than its home) never help; the library defaults pass on any layout.
  const int useful_clones = std::max(l.ep - 1, 2);
  if (t.max_clones > useful_clones)
    error("max_clones", invalid("max_clones", t.max_clones,
                                "max_clones <= max(ep - 1, 2) = " + std::to_string(useful_clones) +
                                    " (a clone sits on another rank than its expert)"));
  const int useful_slots = std::max(m.experts - m.experts / l.ep, 1);
  if (t.spare_slots > useful_slots)
    error("spare_slots", invalid("spare_slots", t.spare_slots,
                                 "spare_slots <= max(experts - experts / ep, 1) = " +
                                     std::to_string(useful_slots) +
                                     " (a spare slot holds a clone of another rank's expert)"));
  if (int64_t(m.experts) * l.ep > (int64_t(1) << 28))
    error("ep", invalid("ep", l.ep,
                        "ep * experts <= 2^28 (experts = " + std::to_string(m.experts) +
                            "): the simulator's rank-by-expert tables"));
  if (double(l.etp) * l.ep * l.dp * l.pp > std::numeric_limits<int32_t>::max())
    error("dp", invalid("dp", l.dp, "etp * ep * dp * pp <= 2^31-1 (the world size)"));
  if (m.ffn % l.etp != 0)
    error("etp", invalid("etp", l.etp,
                         "a divisor of ffn (" + std::to_string(m.ffn) +
                             "): expert tensor parallelism shards F"));
  if (m.layers % l.pp != 0)
    error("pp", invalid("pp", l.pp, "a divisor of layers (" + std::to_string(m.layers) + ")"));
  if (l.vpp > 1 && l.pp == 1)
    error("vpp", invalid("vpp", l.vpp,
                         "vpp = 1 when pp = 1 (an interleaved schedule needs "
                         "pipeline parallelism)"));
  if (l.vpp > 1 && m.layers % l.pp == 0 && (m.layers / l.pp) % l.vpp != 0)
    error("vpp", invalid("vpp", l.vpp,
                         "a divisor of the layers per pipeline stage (" +
                             std::to_string(m.layers / l.pp) + ")"));
  if (m.shared_experts < 0)
    error("shared_experts", invalid("shared_experts", m.shared_experts, "shared_experts >= 0"));
  if (t.shared_expert_overlap && t.comm_overlap)
    error("shared_expert_overlap",
          invalid("shared_expert_overlap", "true",
                  "false with comm_overlap (both put work on the one stream beside the expert "
                  "GEMMs: the shared experts or the dispatch/combine)"));
  if (t.shared_expert_overlap && m.shared_experts == 0)
    error("shared_expert_overlap",
          invalid("shared_expert_overlap", "true", "false without shared experts"));
  if (t.across_nodes != "flat" && t.across_nodes != "hierarchical")
    error("across_nodes",
          invalid("across_nodes", "'" + t.across_nodes + "'", "flat or hierarchical"));
  if (t.across_nodes == "hierarchical" && l.ep > 1) {
    const int per_node = ep_ranks_per_node(l.etp, in.gpu.gpus_per_node);
    if (l.ep > per_node && l.ep % per_node != 0)
      error("across_nodes", invalid("across_nodes", "'hierarchical'",
                                    "flat when ep (" + std::to_string(l.ep) +
                                        ") is not a multiple of the EP ranks of a node (" +
                                        std::to_string(per_node) +
                                        "): the nodes would not hold equal shares of the experts"));
  }
  if (t.comm_overlap && l.ep == 1)
    error("comm_overlap", invalid("comm_overlap", "true",
                                  "only with ep > 1 (ep = 1 has no dispatch or "
                                  "combine to overlap)"));
  if (t.comm_overlap && m.dtype == "fp32")
    error("dtype", invalid("dtype", "fp32",
                           "bf16 or fp16 with comm_overlap (the overlapped "
                           "dispatch/combine kernels move 16-bit rows)"));
  if (t.comm_overlap && l.pp > 1 && l.vpp == 1)
    error("vpp", invalid("vpp", 1,
                         "vpp >= 2 with comm_overlap and pp = " + std::to_string(l.pp) +
                             " (the overlap interleaves one virtual stage's "
                             "communication with another's computation)"));
  // In double: seq_len * micro_batch * top_k * etp can pass 2^63 at extreme values.
  const double rows = double(m.seq_len) * m.micro_batch * m.top_k * l.etp;
  if (rows > std::numeric_limits<int32_t>::max())
    error("micro_batch",
          invalid("micro_batch", m.micro_batch, "seq_len * micro_batch * top_k * etp <= 2^31-1"));
  else if (std::ceil(t.capacity_factor * double(rows)) > std::numeric_limits<int32_t>::max())
    error("capacity_factor", invalid("capacity_factor", t.capacity_factor,
                                     "capacity_factor * seq_len * micro_batch * top_k * etp "
                                     "<= 2^31-1"));
  try {
    validate(in.gpu);
  } catch (const ConfigError& e) {
    error(e.field(), e.what());
  }
  if (!f.empty()) return f;
  // The library's own rules for the layer one GPU builds (stage_layers), such as top_k <= 32.
  try {
    const StageLayers s = stage_layers(in);
    validate(s.layers.front(), s.par, s.echo);
  } catch (const ConfigError& e) {
    error(e.field(), std::string(e.what()) +
                         " (the MoE layer of one GPU: max_tokens = seq_len * micro_batch, ffn / "
                         "etp, ep_size = ep, capacity_factor * etp)");
  }
  if (!f.empty()) return f;

  // Advice: valid, but probably not what was meant.
  if (t.spare_slots > 0 && l.ep == 1)
    warning("spare_slots", "spare_slots = " + std::to_string(t.spare_slots) +
                               " has no effect with ep = 1: there is no other rank to clone to");
  if (t.spare_slots > 0 && t.max_clones == 0 && l.ep > 1)
    warning("max_clones", "max_clones = 0 leaves the " + std::to_string(t.spare_slots) +
                              " spare slot(s) empty: ECHO makes no clones");
  if (l.etp > in.gpu.gpus_per_node || in.gpu.gpus_per_node % l.etp != 0)
    warning("etp", "etp = " + std::to_string(l.etp) + " does not fit the " +
                       std::to_string(in.gpu.gpus_per_node) +
                       "-GPU NVLink domain: expert tensor-parallel collectives cross the network");
  if (int64_t(l.ep) * l.etp > in.gpu.gpus_per_node)
    warning("ep", "ep * etp = " + std::to_string(int64_t(l.ep) * l.etp) + " GPUs spans " +
                      std::to_string((int64_t(l.ep) * l.etp + in.gpu.gpus_per_node - 1) /
                                     in.gpu.gpus_per_node) +
                      " nodes: " +
                      fmt(100 * (1 - intra_node_fraction(l.ep, l.etp, in.gpu.gpus_per_node)), 0) +
                      "% of dispatch/combine traffic crosses the network at " +
                      fmt(in.gpu.network_gbps, 0) + " GB/s per GPU");
  const double rows_per_expert =
      double(m.seq_len) * m.micro_batch * m.top_k * l.ep * l.etp / double(m.experts);
  if (rows_per_expert < 128)
    warning("micro_batch", "about " + fmt(rows_per_expert, 0) +
                               " rows per local expert per micro-batch: grouped GEMM tiles "
                               "(128 rows) run mostly empty; raise micro_batch or seq_len");
  if (t.comm_overlap && !t.cuda_graphs)
    warning("cuda_graphs",
            "comm_overlap without CUDA graphs: the host launches both streams' kernels "
            "every step, and the host-overhead wall comes closer");
  return f;
}

void validate(const WallsInput& in) {
  for (const Finding& f : check(in))
    if (f.severity == Severity::error) throw ConfigError(f.field, f.message);
}

std::vector<Finding> check_capacity(const WallsInput& in, const Imbalance& imb) {
  std::vector<Finding> f;
  const double cf = in.train.capacity_factor;
  const std::string what = "capacity_factor = " + fmt(cf, 2);
  const std::string need = fmt(std::ceil(imb.p99 * 20.0 - 1e-9) / 20.0, 2);
  if (cf < imb.mean || imb.spill_fraction >= 0.99)
    f.push_back({Severity::warning, "capacity_factor",
                 what + " is below the planned imbalance (busiest rank " + fmt(imb.mean, 2) +
                     "x the mean on average, " + imb.source +
                     "): the receive window overflows and spills every step; allowed "
                     "capacity_factor >= " +
                     need + " (p99) to spill rarely"});
  else if (cf < imb.p99)
    f.push_back({Severity::warning, "capacity_factor",
                 what + " is below the p99 imbalance " + fmt(imb.p99, 2) + " (" + imb.source +
                     "): the busiest rank spills on " + fmt(100 * imb.spill_fraction, 1) +
                     "% of layer-steps; capacity_factor >= " + need + " spills on about 1%"});
  return f;
}

WallsReport estimate_walls(const WallsInput& in, const Imbalance& imb) {
  validate(in);
  const ModelSpec& m = in.model;
  const LayoutSpec& l = in.layout;
  const TrainingSpec& t = in.train;
  const CostModel cost{in.gpu};
  WallsReport r;
  r.imbalance = imb;
  r.findings = check(in);
  for (Finding& f : check_capacity(in, imb)) r.findings.push_back(std::move(f));
  r.world_size = l.etp * l.ep * l.dp * l.pp;
  r.layers_per_stage = m.layers / l.pp;
  const double Lp = r.layers_per_stage;
  const double a = dtype_bytes(m.dtype);  // weight and activation bytes
  const double H = m.hidden, F = m.ffn, K = m.top_k;
  const double P = 3.0 * H * F / l.etp;  // parameters of one expert shard
  const double inflight = microbatches_in_flight(l);
  const double optimizer_shards = t.distributed_optimizer ? l.dp : 1;
  const Recompute recompute = parse_recompute(t.recompute, "recompute");

  // Memory: the library's count of the stage's layers (what a MoeStack of them allocates), each
  // layer's routing, kept activations and temporaries once per micro-batch in flight, and with
  // more than one the workspace's second set.
  const StageLayers stage = stage_layers(in);
  const StageMemory sm = stage_memory(in, recompute, inflight, optimizer_shards);
  const MoeMemory &lib = sm.one, &sets = sm.sets;
  MemoryBreakdown& mem = r.memory;
  mem.library = lib;
  mem.microbatches_in_flight = inflight;
  mem.weights_gb = double(sets.params) / kGB;
  mem.grads_gb = double(sets.grads) / kGB;
  mem.optimizer_gb = double(sets.optimizer) / optimizer_shards / kGB;
  mem.spare_weights_gb = double(sets.echo_slot_weights) / kGB;
  mem.spare_grads_gb = double(sets.echo_slot_grads) / kGB;
  mem.activations_gb = inflight * double(lib.activations + lib.routing) / kGB;
  mem.buffers_gb = (double(sets.workspace + sets.fp8) + inflight * double(lib.temporaries)) / kGB;
  mem.moe_gb = sm.gb();
  // Each option against none: the layers keep less, the workspace holds one copy of the rest
  // (per set).
  constexpr Recompute kOptions[] = {Recompute::moe_act, Recompute::experts, Recompute::dispatch,
                                    Recompute::all_but_fc1};
  double saves[5] = {};
  const double none_gb = stage_memory(in, Recompute::none, inflight, optimizer_shards).gb();
  for (Recompute o : kOptions)
    saves[int(o)] = none_gb - stage_memory(in, o, inflight, optimizer_shards).gb();
  mem.recompute_moe_act_saves_gb = saves[int(Recompute::moe_act)];
  mem.recompute_experts_saves_gb = saves[int(Recompute::experts)];
  mem.recompute_dispatch_saves_gb = saves[int(Recompute::dispatch)];
  mem.recompute_all_but_fc1_saves_gb = saves[int(Recompute::all_but_fc1)];
  mem.reserve_gb = t.reserve_gb;
  mem.total_gb = mem.moe_gb + mem.reserve_gb;
  mem.capacity_gb = in.gpu.memory_gb;

  LayerTimes& lt = r.layer;
  lt.tokens = int64_t(m.seq_len) * m.micro_batch;
  const double T = double(lt.tokens);
  lt.capacity_rows = capacity_rows(stage.layers.front());

  // Communication of the busiest rank: it receives imbalance x the mean rows. A token's row
  // crosses once to each rank it picks (the receiver fans it out to the experts there and sums
  // their outputs before it goes back), (ep-1)/ep of those ranks remote.
  lt.ranks_per_token = ranks_per_token(m.experts, l.ep, m.top_k, m.expert_groups, m.topk_groups);
  lt.max_ranks_per_token =
      max_ranks_per_token(m.experts, l.ep, m.top_k, m.expert_groups, m.topk_groups);
  const double token_rows = T * lt.ranks_per_token;
  // Of the ranks a token picks, (P - 1) / ep are the other EP ranks of its node (P = per_node)
  // and (ep - P) / ep on other nodes. Hierarchical: one row per other node it picks instead (N
  // nodes; a node holds E/N consecutive experts, so the nodes it picks are ranks_per_token over N),
  // and each node's forwarder passes the rows for its node's other ranks on over NVLink.
  const double per_node = double(std::min(l.ep, ep_ranks_per_node(l.etp, in.gpu.gpus_per_node)));
  const double own_node = lt.ranks_per_token * (per_node - 1.0) / double(l.ep);
  const double other_nodes = lt.ranks_per_token * (double(l.ep) - per_node) / double(l.ep);
  const int nodes = int(std::lround(double(l.ep) / per_node));
  if (t.across_nodes == "hierarchical" && nodes > 1) {
    const double node_picks =
        ranks_per_token(m.experts, nodes, m.top_k, m.expert_groups, m.topk_groups);
    lt.network_rows_per_token = node_picks * double(nodes - 1) / double(nodes);
    lt.nvlink_rows_per_token = own_node + other_nodes * (per_node - 1.0) / per_node;
  } else {
    lt.network_rows_per_token = other_nodes;
    lt.nvlink_rows_per_token = own_node;
  }
  // With precision fp8 the forward's rows cross in e4m3 with their scales (packed rows); the
  // combine and the backward's rows stay in the activation dtype.
  const MoeConfig& lc = stage.layers.front();
  const double forward_row =
      uses_fp8(lc, fp8_gemm::fprop1) ? double(fp8_packed_row_bytes(m.hidden)) : H * a;
  const double out_rows = T * (lt.nvlink_rows_per_token + lt.network_rows_per_token);
  lt.dispatch_bytes = out_rows * forward_row;
  lt.combine_bytes = out_rows * H * a;
  lt.etp_bytes = double(l.etp - 1) * token_rows * H * a;
  const double busiest = imb.mean;  // the average step's busiest rank
  auto links = [&](double row_bytes) {
    const double rows = T * busiest * row_bytes;
    return cost.links_ms(rows * lt.nvlink_rows_per_token, rows * lt.network_rows_per_token);
  };
  const double a2a_dispatch = l.ep > 1 ? links(forward_row) : 0.0;
  const double a2a = l.ep > 1 ? links(H * a) : 0.0;
  const double etp_ms = l.etp > 1 ? cost.nvlink_ms(lt.etp_bytes * busiest) : 0.0;
  // forward: dispatch + combine (+ ETP all-gather and reduce-scatter); backward: dy's dispatch and
  // dx's combine; with recompute dispatch or all_but_fc1 the forward's dispatch once more
  lt.comm_ms = a2a_dispatch + 3.0 * a2a + 4.0 * etp_ms;
  const Redone again = redone(recompute);
  if (again.dispatch) lt.comm_ms += a2a_dispatch + etp_ms;
  // Clones: weights in for the forward, and again for the backward when other layers used the
  // echo slots in between (every layer but the stage's last with one micro-batch in flight, all
  // with more); fp32 gradients home.
  const double pulls = inflight > 1 ? 2.0 : (2.0 * Lp - 1.0) / Lp;
  lt.clone_bytes = l.ep > 1 ? t.spare_slots * P * (pulls * a + 4.0) : 0.0;
  lt.clone_ms = cost.all_to_all_ms(lt.clone_bytes, l.ep, l.etp);
  const double busiest_rows = T * K * l.etp * busiest;
  // Per row: fc1 forward and its dgrad and wgrad 4 H F each, fc2's 2 H F each (train_flops'
  // 18 H F); with recompute experts or dispatch fc1 and fc2 forward again, with all_but_fc1 fc2
  // alone (SwiGLU alone, moe_act, is elementwise). Each GEMM at the FP8 or the bf16 rate as
  // MoeConfig::fp8_gemms says.
  const struct {
    uint32_t gemm;
    double hf;  // H F per row
  } gemms[] = {{fp8_gemm::fprop1, again.fc1 ? 8.0 : 4.0},
               {fp8_gemm::fprop2, again.fc2 ? 4.0 : 2.0},
               {fp8_gemm::dgrad1, 4.0},
               {fp8_gemm::dgrad2, 2.0},
               {fp8_gemm::wgrad1, 4.0},
               {fp8_gemm::wgrad2, 2.0}};
  lt.gemm_ms = 0;
  double wgrad1_ms = 0;
  for (const auto& g : gemms) {
    const double flops = g.hf * busiest_rows * H * F / l.etp;
    const double ms = uses_fp8(lc, g.gemm) ? cost.fp8_gemm_ms(flops) : cost.gemm_ms(flops);
    lt.gemm_ms += ms;
    if (g.gemm == fp8_gemm::wgrad1) wgrad1_ms = ms;
  }
  // overlap wgrad: the backward's combine (dx's all-to-all) runs beside fc1's weight-gradient
  // GEMM; the shorter of the two is hidden (the GEMM priced at the full GPU's rate).
  lt.wgrad_hidden_ms = lc.overlap == Overlap::wgrad ? std::min(a2a, wgrad1_ms) : 0.0;
  lt.shared_ms =
      cost.gemm_ms(CostModel::train_flops(T, m.hidden, m.shared_experts * m.ffn) / l.etp);
  lt.host_ms = cost.launch_ms(t.kernels_per_layer, t.cuda_graphs);
  const double comm = lt.comm_ms + lt.clone_ms;
  // The communication left on the step's stream beside the GEMMs: all of it but what overlap
  // wgrad hides.
  const double open_comm = comm - lt.wgrad_hidden_ms;
  double gpu_ms = 0;
  if (t.shared_expert_overlap) {  // the shared experts beside dispatch/combine
    gpu_ms = lt.gemm_ms + std::max(lt.shared_ms, open_comm);
    lt.exposed_comm_ms = std::max(0.0, open_comm - lt.shared_ms);
  } else {
    const double gemm = lt.gemm_ms + lt.shared_ms;
    gpu_ms = t.comm_overlap ? std::max(gemm, comm) : gemm + open_comm;
    lt.exposed_comm_ms = t.comm_overlap ? std::max(0.0, comm - gemm) : open_comm;
  }
  lt.layer_ms = std::max(gpu_ms, lt.host_ms);
  r.stage_ms = Lp * lt.layer_ms;

  // Which wall binds.
  if (!mem.fits()) {
    r.binding_wall = "memory";
    r.reason = "needs " + fmt(mem.total_gb, 1) + " GB of " + fmt(mem.capacity_gb, 0) + " GB";
    // Each option that keeps less than the chosen one, with what it saves against it and what
    // its backward does again.
    const char* redo[] = {"", "SwiGLU", "fc1, SwiGLU and fc2", "the dispatch and the experts",
                          "the dispatch, SwiGLU and fc2"};
    std::string options;
    for (Recompute o : kOptions) {
      const double more = saves[int(o)] - saves[int(recompute)];
      if (more < 0.05) continue;
      options += std::string(options.empty() ? "" : "; ") + "--recompute " + to_string(o) +
                 " saves " + fmt(more, 1) + " GB" +
                 (mem.total_gb - more <= mem.capacity_gb ? " and would fit" : "") +
                 " (the backward redoes " + redo[int(o)] + ")";
    }
    if (!options.empty()) r.advice.push_back(options);
    if (!t.distributed_optimizer && l.dp > 1)
      r.advice.push_back("a distributed optimizer shards " + fmt(mem.optimizer_gb, 1) +
                         " GB of optimizer state over dp = " + std::to_string(l.dp));
    if (m.experts % (l.ep * 2) == 0) {
      WallsInput wider = in;
      wider.layout.ep *= 2;
      try {
        const double saved =
            mem.moe_gb - stage_memory(wider, recompute, inflight, optimizer_shards).gb();
        r.advice.push_back("ep = " + std::to_string(l.ep * 2) +
                           " halves the home experts per GPU, their weights, gradients and "
                           "optimizer state (" +
                           fmt(saved, 1) + " GB saved)");
      } catch (const ConfigError&) {
        // the library refuses the wider layout (its rank-by-expert tables): no advice
      }
    }
    if (l.pp > 1 || m.layers % 2 == 0)
      r.advice.push_back("more pipeline stages hold fewer layers per GPU");
  } else if (lt.host_ms >= gpu_ms) {
    r.binding_wall = "host-overhead";
    r.reason = "kernel launches take " + fmt(lt.host_ms * 1e3, 0) + " us per layer, the GPU work " +
               fmt(gpu_ms * 1e3, 0) + " us";
    if (!t.cuda_graphs) r.advice.push_back("capture the step in a CUDA graph (--cuda-graphs on)");
    r.advice.push_back("raise micro_batch: GPU work grows with tokens, launches do not");
  } else if (comm > lt.gemm_ms) {
    r.binding_wall = "communication";
    r.reason =
        "dispatch/combine + clones take " + fmt(comm, 3) + " ms per layer, expert GEMMs " +
        fmt(lt.gemm_ms, 3) + " ms" +
        (t.comm_overlap ? " (overlapped: " + fmt(lt.exposed_comm_ms, 3) + " ms exposed)" : "");
    if (lc.overlap == Overlap::none && l.ep > 1)
      r.advice.push_back("--overlap wgrad hides " + fmt(std::min(a2a, wgrad1_ms), 3) +
                         " ms per layer (the backward's combine beside fc1's weight-gradient "
                         "GEMM)");
    if (!t.comm_overlap && l.ep > 1)
      r.advice.push_back("a framework's EP communication overlap (--comm-overlap) hides up to " +
                         fmt(std::min(comm, lt.gemm_ms), 3) + " ms per layer");
    if (int64_t(l.ep) * l.etp > in.gpu.gpus_per_node)
      r.advice.push_back("keep ep * etp within one NVLink domain (" +
                         std::to_string(in.gpu.gpus_per_node) + " GPUs): network is " +
                         fmt(in.gpu.nvlink_gbps / in.gpu.network_gbps, 1) + "x slower");
    r.advice.push_back(
        "bytes and FLOPs both grow with tokens: a larger micro-batch does not move this wall");
  } else {
    r.binding_wall = "compute";
    r.reason = "expert GEMMs take " + fmt(lt.gemm_ms, 3) +
               " ms per layer, dispatch/combine + clones " + fmt(comm, 3) + " ms";
    r.advice.push_back("the busiest rank sets the pace: imbalance " + fmt(imb.mean, 2) +
                       "x costs " + fmt(100 * (1 - 1 / std::max(1.0, imb.mean)), 0) +
                       "% of the GEMM time; profile the grouped GEMM next");
  }
  return r;
}

Suggestion suggest(const WallsInput& in, const SweepOptions& opt, const TraceSource* trace,
                   std::vector<SimulationResult>* results) {
  validate(in);
  const ModelSpec& m = in.model;
  const LayoutSpec& l = in.layout;
  Suggestion s;
  std::vector<std::pair<int, int>> cands;
  for (int S : opt.spare_slots)
    for (int mc : opt.max_clones) cands.emplace_back(S, mc);
  cands.emplace_back(in.train.spare_slots, in.train.max_clones);
  // The sweep's own candidates within what can be placed (the user's pair is valid already).
  const int useful_slots = std::max(m.experts - m.experts / l.ep, 1);
  for (auto& c : cands) {
    c.first = std::min(c.first, useful_slots);
    if (c.first == 0) c.second = 0;  // no spare slot, no clone
    c.second = std::min(c.second, l.ep - 1);
  }
  std::sort(cands.begin(), cands.end());
  cands.erase(std::unique(cands.begin(), cands.end()), cands.end());
  GeneratorConfig g;
  g.experts = m.experts;
  g.top_k = m.top_k;
  g.tokens = m.seq_len * m.micro_batch * l.etp;  // rows an EP rank (etp GPUs) sends per step
  g.steps = opt.steps;
  g.layers = opt.layers;
  g.seed = opt.seed;
  std::unique_ptr<TraceSource> owned;
  if (!trace) owned = std::make_unique<TraceGenerator>(g);
  const TraceFile totals = TraceFile::totals_of(trace ? *trace : *owned, l.ep);
  for (const auto& [S, mc] : cands) {
    SimulatorConfig sc;
    sc.ranks = l.ep;
    sc.experts = m.experts;
    sc.top_k = m.top_k;
    sc.steps = std::min(opt.steps, totals.steps());
    sc.layers = std::min(opt.layers, totals.layers());
    sc.spare_slots = S;
    sc.max_clones = mc;
    sc.threads = opt.threads;
    sc.hidden = m.hidden;
    sc.ffn = m.ffn;
    sc.policies = {Policy::echo};
    sc.cost.gpu = in.gpu;
    SimulationResult res = simulate(totals, sc);
    res.trace = trace ? trace->describe() : owned->describe();
    const PolicyStats& p = res.policies[0];
    SpareSlotOption o;
    o.spare_slots = S;
    o.max_clones = mc;
    o.mean = p.max_over_mean_mean;
    o.p99 = p.max_over_mean_p99;
    o.clones_per_step = p.clones_per_step;
    o.memory_gb = echo_slots_gb(in, S);
    s.sweep.push_back(o);
    if (results) results->push_back(std::move(res));
  }
  double best = s.sweep[0].p99;
  for (const SpareSlotOption& o : s.sweep) best = std::min(best, o.p99);
  for (const SpareSlotOption& o : s.sweep)
    if (o.p99 <= best * 1.02) {
      s.spare_slots = o.spare_slots;
      s.max_clones = o.max_clones;
      s.capacity_factor = std::max(1.0, std::ceil(o.p99 * 20.0 - 1e-9) / 20.0);
      s.reason = "the fewest spare slots, then clones, within 2% of the best p99 (" + fmt(best, 2) +
                 "); capacity factor at that p99, rounded up to 0.05";
      break;
    }
  return s;
}

}  // namespace moe_echo::offline
