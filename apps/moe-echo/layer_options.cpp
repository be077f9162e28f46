#include "layer_options.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "moe_echo/layer.hpp"

#include "commands.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/presets.hpp"
#include "offline/cost_model.hpp"

#ifdef MOE_ECHO_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/cuda_backend.hpp"
#endif

namespace moe_echo::cli {
namespace {

// Tokens per rank for a GPU-sized preset on the CPU backend, unless --tokens is given.
constexpr int kCpuPresetTokens = 64;

// The ECHO flags' defaults: the library's.
const EchoConfig kEcho;

}  // namespace

void add_layer_options(CLI::App* cmd, LayerOptions& o) {
  add_option(cmd, "--preset", o.preset,
             "Layer shape: " + model_preset_names(false) + " (default " + o.preset +
                 ", seconds on a CPU). Explicit flags below override it.");
  add_option(cmd, "--backend", o.backend, "auto (the GPU when there is one, else the CPU) or cpu");
  add_option(cmd, "--hidden", o.hidden, "Hidden size H");
  add_option(cmd, "--ffn", o.ffn, "Expert FFN size F (SwiGLU: fc1 H x 2F, fc2 F x H)");
  add_option(cmd, "--experts", o.experts, "Routed experts E (a multiple of --ep)");
  add_option(cmd, "--top-k", o.top_k, "Experts per token K (1 <= K <= E)");
  add_option(cmd, "--tokens", o.tokens, "Tokens per rank per step T");
  add_option(cmd, "--ep", o.ep,
             "Expert-parallel ranks R (CPU: simulated as threads; GPU: one process per GPU, "
             "started by moe-echo launch -n R, and the default is WORLD_SIZE)");
  add_option(cmd, "--score", o.score, "Router score function: softmax or sigmoid");
  add_option(cmd, "--expert-groups", o.expert_groups,
             "Group-limited top-k: experts in G groups of E/G (1 <= G <= " +
                 std::to_string(kMaxExpertGroups) + "; preset's, 1 = no limit)");
  add_option(cmd, "--topk-groups", o.topk_groups,
             "Groups each token picks its experts from (1 <= n <= G; preset's)");
  add_option(cmd, "--group-score", o.group_score,
             "How a group is scored: top2_sum (sum of its two best keys, DeepSeek-V3) or max");
  add_option(cmd, "--routed-scaling", o.routed_scaling,
             "Combine weights times this factor after normalisation (preset's, 1 = none)");
  add_option(cmd, "--shared-experts", o.shared_experts,
             "Dense SwiGLU experts of size F every token goes through (preset's)");
  cmd->add_flag("--shared-side-stream", o.shared_side_stream,
                "Run the shared experts on a second stream beside the router and dispatch");
  add_option(cmd, "--seq-aux-loss", o.seq_aux_loss_coeff,
             "Sequence-level aux loss coefficient (default 0; needs --seq-len)");
  add_option(cmd, "--seq-len", o.seq_len,
             "Tokens per sequence of the sequence-level aux loss (consecutive tokens)");
  add_option(cmd, "--aux-loss", o.aux_loss_coeff,
             "Aux load-balancing loss coefficient (default 0)");
  add_option(cmd, "--z-loss", o.z_loss_coeff, "Router z-loss coefficient (default 0)");
  cmd->add_flag("--bias-update", o.bias_update, "Aux-loss-free balancing bias updates");
  add_option(cmd, "--echo", o.echo, "ECHO cloning of hot experts: on (default) or off");
  add_option(
      cmd, "--spare-slots", o.spare_slots,
      "Spare expert slots per rank for clones (" + default_is(kEcho.spare_slots_per_rank) + ")");
  add_option(cmd, "--max-clones", o.max_clones,
             "Clones per expert per step (" + default_is(kEcho.max_clones_per_expert) + ")");
  add_option(cmd, "--capacity-factor", o.capacity_factor,
             "Receive buffer rows = ceil(factor * T * K); rows beyond it run in spill "
             "rounds, never dropped (" +
                 default_is(MoeConfig{}.capacity_factor) + ")");
  add_option(cmd, "--clone-cost-rows", o.clone_cost_rows,
             "Cost of one clone link in rows: ECHO minimises the busiest rank's load plus this "
             "per clone link of the busiest-linked rank (default: on the GPU, the H200 cost "
             "model's clone traffic time over one row's expert time, ~2200 rows; 0 on the CPU "
             "backend)");
  add_option(cmd, "--seed", o.seed, "Seed of weights and synthetic data (default 1)");
  add_option(cmd, "--recompute", o.recompute,
             "What each layer keeps for its backward: none (default), moe_act (redo SwiGLU), "
             "experts (redo fc1, SwiGLU, fc2) or dispatch (also redo the dispatch)");
  add_option(cmd, "--overlap", o.overlap,
             "What the backward runs beside its communication: none (default) or wgrad (fc1's "
             "weight-gradient GEMM on a second stream beside the combine)");
  add_option(cmd, "--overlap-sms", o.overlap_sms,
             "With --overlap wgrad or --chunks above 1, the SMs the side stream's GEMMs leave to "
             "communication (default 16)");
  add_option(cmd, "--chunks", o.chunks,
             "The received rows of the forward and the backward in this many chunks (1 to 16, "
             "default 1): a chunk's expert GEMMs run on a second stream while the next chunk is "
             "dispatched and the one before combined");
  add_option(cmd, "--precision", o.precision,
             "The routed experts' GEMMs: bf16 (default) or fp8 (e4m3 with blockwise scales; "
             "hidden and ffn multiples of 16)");
  add_option(cmd, "--fp8-gemms", o.fp8_gemms,
             "With --precision fp8, which expert GEMMs run in FP8 (the rest in bf16): all "
             "(default) or a comma-separated list of fprop1, fprop2, dgrad1, dgrad2, wgrad1, "
             "wgrad2, fprop, dgrad, wgrad (fprop1 also sends the tokens in e4m3)");
}

bool is_cuda(const Backend& backend) { return std::string(backend.name()) == "cuda"; }

ResolvedLayer resolve(const LayerOptions& o, const Backend& backend, int world_size) {
  const bool cpu_backend = !is_cuda(backend);
  const ModelPreset* preset = find_model_preset(o.preset);
  if (!preset) reject("preset", "'" + o.preset + "'", model_preset_names(false));
  const ModelPreset& p = *preset;
  ResolvedLayer r;
  r.preset = o.preset;
  r.gpu = !cpu_backend;
  r.moe.hidden = o.hidden.value_or(p.hidden);
  r.moe.ffn = o.ffn.value_or(p.ffn);
  r.moe.experts = o.experts.value_or(p.experts);
  r.moe.top_k = o.top_k.value_or(p.top_k);
  r.moe.max_tokens = o.tokens.value_or(p.tokens);
  if (!o.tokens && cpu_backend && p.moe_layers > 0) {
    r.moe.max_tokens = kCpuPresetTokens;
    r.tokens_reduced_for_cpu = true;
  }
  r.moe.score_function = o.score ? parse_score_function(*o.score, "score") : p.score;
  r.moe.normalize_topk = p.normalize_topk;
  r.moe.expert_groups = o.expert_groups.value_or(p.expert_groups);
  r.moe.topk_groups = o.topk_groups.value_or(o.expert_groups ? r.moe.expert_groups : p.topk_groups);
  r.moe.group_score =
      o.group_score ? parse_group_score(*o.group_score, "group_score") : p.group_score;
  r.moe.routed_scaling_factor = o.routed_scaling.value_or(p.routed_scaling_factor);
  r.moe.shared_experts = o.shared_experts.value_or(p.shared_experts);
  r.moe.shared_side_stream = o.shared_side_stream;
  r.moe.seq_aux_loss_coeff = o.seq_aux_loss_coeff;
  r.moe.seq_len = o.seq_len;
  r.moe.aux_loss_coeff = o.aux_loss_coeff;
  r.moe.z_loss_coeff = o.z_loss_coeff;
  r.moe.bias_update = o.bias_update;
  r.moe.recompute = parse_recompute(o.recompute, "recompute");
  r.moe.overlap = parse_overlap(o.overlap, "overlap");
  r.moe.overlap_sms = o.overlap_sms;
  r.moe.chunks = o.chunks;
  r.moe.precision = parse_precision(o.precision, "precision");
  r.moe.fp8_gemms = parse_fp8_gemms(o.fp8_gemms, "fp8-gemms");
  if (r.moe.precision != Precision::fp8 && o.fp8_gemms != "all")
    reject("fp8-gemms", "'" + o.fp8_gemms + "'", "all (the default) unless --precision fp8");
  r.ep = o.ep.value_or(cpu_backend ? p.ep : world_size);
  if (!cpu_backend && r.ep != world_size)
    reject("ep", r.ep,
           world_size == 1
               ? std::string("1 on the CUDA backend in one process (one GPU per rank: start N "
                             "ranks with `moe-echo launch -n N -- moe-echo bench --ep N`)")
               : "WORLD_SIZE (" + std::to_string(world_size) + "): one GPU per rank");
  if (!cpu_backend && (r.moe.hidden % 8 != 0 || r.moe.ffn % 8 != 0))
    reject(r.moe.hidden % 8 != 0 ? "hidden" : "ffn",
           r.moe.hidden % 8 != 0 ? r.moe.hidden : r.moe.ffn,
           "a multiple of 8 on the CUDA backend (16-byte aligned GEMM rows)");
  if (o.echo != "on" && o.echo != "off") reject("echo", "'" + o.echo + "'", "on or off");
  r.echo.enabled = o.echo == "on";
  r.echo.spare_slots_per_rank = o.spare_slots.value_or(kEcho.spare_slots_per_rank);
  r.echo.max_clones_per_expert = o.max_clones.value_or(kEcho.max_clones_per_expert);
  r.moe.capacity_factor = o.capacity_factor.value_or(MoeConfig{}.capacity_factor);
  // On a GPU a clone costs its weights in and its gradient out over NVLink; the cost model turns
  // that into rows of expert work (bf16 weights, fp32 gradients). Ranks simulated in one CPU
  // process pay a memory copy, so cloning is free there.
  r.echo.clone_cost_rows = o.clone_cost_rows.value_or(
      cpu_backend ? 0 : offline::CostModel{}.clone_cost_rows(r.moe.hidden, r.moe.ffn, 4));
  ParallelConfig par{r.ep, 0};
  validate(r.moe, par, r.echo);
  // A rank's spare slots hold clones of experts homed on other ranks, one slot per expert at
  // most: more slots stay empty. One spare slot (the default) is accepted on any layout.
  const int useful_slots = std::max(r.moe.experts - r.moe.experts / r.ep, 1);
  if (r.echo.spare_slots_per_rank > useful_slots)
    reject("spare_slots", r.echo.spare_slots_per_rank,
           "spare_slots <= max(experts - experts / ep, 1) = " + std::to_string(useful_slots) +
               " (a spare slot holds a clone of another rank's expert)");
  return r;
}

double physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? double(pages) * double(page) : 0.0;
}

double moe_bytes_per_rank(const ResolvedLayer& L, const Backend& backend, int layers,
                          bool shared_workspace, bool optimizer_state) {
  const ParallelConfig par{L.ep, 0};
  const DType act = backend.activation_dtype(), fl = backend.float_dtype();
  if (!shared_workspace)
    return double(layers) *
           double(MoeLayer::memory_bytes(L.moe, par, L.echo, act, fl, optimizer_state));
  // MoeStack::memory_bytes of `layers` copies of L.moe, without building the list: a workspace
  // sized for one of them serves all.
  return double(MoeWorkspace::memory_bytes({L.moe}, par, L.echo, act, fl)) +
         double(layers) *
             double(MoeLayer::layer_memory_bytes(L.moe, par, L.echo, act, fl, optimizer_state));
}

MoeMemory moe_memory_per_rank(const ResolvedLayer& L, const Backend& backend, int layers,
                              bool shared_workspace, bool optimizer_state) {
  const ParallelConfig par{L.ep, 0};
  const DType act = backend.activation_dtype(), fl = backend.float_dtype();
  MoeMemory total;
  if (shared_workspace) total += MoeWorkspace::memory_breakdown({L.moe}, par, L.echo, act, fl);
  const MoeMemory one =
      shared_workspace
          ? MoeLayer::layer_memory_breakdown(L.moe, par, L.echo, act, fl, optimizer_state)
          : MoeLayer::memory_breakdown(L.moe, par, L.echo, act, fl, optimizer_state);
  for (int l = 0; l < layers; ++l) total += one;
  return total;
}

void check_memory(const ResolvedLayer& L, const Backend& backend, int layers, bool shared_workspace,
                  bool optimizer_state, double extra_bytes_per_rank) {
  const double per_rank =
      moe_bytes_per_rank(L, backend, layers, shared_workspace, optimizer_state) +
      extra_bytes_per_rank;
  char what[96];
  std::snprintf(what, sizeof what, "%d %s layer(s)", layers,
                layers == 1        ? "MoE"
                : shared_workspace ? "stacked MoE"
                                   : "separate MoE");
  const char* lower = layers > 1 ? "lower --layers, --experts, --hidden, --ffn, --tokens or --ep"
                                 : "lower --experts, --hidden, --ffn, --tokens or --ep";
  char msg[512];
  if (L.gpu) {  // one rank per process, on its GPU
#ifdef MOE_ECHO_WITH_CUDA
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) return;
    if (per_rank > double(free)) {
      std::snprintf(msg, sizeof msg,
                    "memory = %.1f GiB is invalid: %s need that on each GPU and allowed is at "
                    "most the %.1f GiB free on this one (of %.1f GiB); %s",
                    per_rank / (1 << 30), what, double(free) / (1 << 30), double(total) / (1 << 30),
                    lower);
      throw ConfigError("memory", msg);
    }
#endif
    return;
  }
  const double need = per_rank * L.ep, have = physical_memory_bytes();
  if (have > 0 && need > 0.8 * have) {
    std::snprintf(msg, sizeof msg,
                  "memory = %.1f GiB is invalid: the CPU backend holds all %d ranks of %s in "
                  "this process (%.1f GiB each) and allowed is at most 80%% of this machine's "
                  "%.1f GiB; %s, or run on a GPU",
                  need / (1 << 30), L.ep, what, per_rank / (1 << 30), have / (1 << 30), lower);
    throw ConfigError("memory", msg);
  }
}

void check_output_path(const std::string& field, const std::string& path) {
  if (path.empty()) return;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) reject(field, "'" + path + "'", "a file path, not a folder");
    if (::access(path.c_str(), W_OK) != 0)
      reject(field, "'" + path + "'", "a file this user may write (it is read-only)");
    return;
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    reject(field, "'" + path + "'", "a path in an existing folder ('" + dir + "' is none)");
  if (::access(dir.c_str(), W_OK) != 0)
    reject(field, "'" + path + "'", "a path in a folder this user may write ('" + dir + "')");
}

Communicator& rank_communicator(const Backend& backend, InProcessWorld& world, int rank,
                                std::unique_ptr<Communicator>& holder) {
#ifdef MOE_ECHO_WITH_CUDA
  if (is_cuda(backend)) {
    holder = cuda::make_local_communicator();
    return *holder;
  }
#endif
  return world.communicator(rank);
}

}  // namespace moe_echo::cli
