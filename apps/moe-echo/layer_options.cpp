#include "layer_options.hpp"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>

#include "moe_echo/layer.hpp"

#include "commands.hpp"
#include "moe_echo/cost_model.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/presets.hpp"

#ifdef MOE_ECHO_WITH_CUDA
#include <cuda_runtime.h>

#include "moe_echo/cuda.hpp"
#endif

namespace moe_echo::cli {
namespace {

// Tokens per rank for a GPU-sized preset on the CPU backend, unless --tokens is given.
constexpr int kCpuPresetTokens = 64;

// The ECHO flags' defaults: the library's.
const EchoConfig kEcho;

// Older spellings of some fields' options, kept working beside the field's own (listed apart by
// --help); a message names the spelling given ("tokens = '1.5' is invalid").
struct OlderFlag {
  const char* field;
  const char* flag;
};
constexpr OlderFlag kOlderFlags[] = {{"max_tokens", "--tokens"},
                                     {"score_function", "--score"},
                                     {"aux_loss_coeff", "--aux-loss"},
                                     {"z_loss_coeff", "--z-loss"},
                                     {"routed_scaling_factor", "--routed-scaling"},
                                     {"seq_aux_loss_coeff", "--seq-aux-loss"}};

const char* older_flag(std::string_view field) {
  for (const OlderFlag& o : kOlderFlags)
    if (field == o.field) return o.flag;
  return nullptr;
}

// Whether some preset sets field `name` to another value than the library's default.
bool preset_sets(const char* name) {
  const std::string library = field_text(MoeConfig{}, name);
  for (const ModelPreset* p : kModelPresets)
    if (field_text(moe_config(*p), name) != library) return true;
  return false;
}

size_t field_index(std::string_view name) {
  const std::vector<ConfigField>& fields = moe_config_fields();
  for (size_t i = 0; i < fields.size(); ++i)
    if (name == fields[i].name) return i;
  throw Error("no MoeConfig field " + std::string(name));
}

// The option `flag` of field `f` into `value`, its text checked when it is parsed (a value of the
// field's type, or exit 2 naming the flag's parameter; ranges are validate()'s, in resolve).
CLI::Option* add_field_option(CLI::App* cmd, const ConfigField& f, const std::string& flag,
                              std::optional<std::string>& value, const std::string& help) {
  CLI::Option* opt = nullptr;
  if (std::string_view(f.type) == "bool") {  // --x, --x=true or --x=false
    opt = cmd->add_flag(flag, value, help);
  } else {
    opt = cmd->add_option(flag, value, help);
    const std::string_view type = f.type;
    opt->type_name(type == "str" ? "TEXT" : type == "int" ? "INT" : "FLOAT");
  }
  const std::string name = f.name, param = parameter_name(flag);
  opt->check(CLI::Validator(
      [name, param](std::string& text) {
        MoeConfig scratch;
        set_field(scratch, name, text, param);
        return std::string();
      },
      "", "field"));
  return opt;
}

}  // namespace

const ConfigField& moe_field(std::string_view name) {
  return moe_config_fields()[field_index(name)];
}

std::string field_flag(const ConfigField& f) {
  std::string flag = "--" + std::string(f.name);
  for (char& c : flag)
    if (c == '_') c = '-';
  return flag;
}

std::string field_help(const ConfigField& f, const std::string& default_text) {
  std::string h = f.help;
  h[0] = char(std::toupper(static_cast<unsigned char>(h[0])));
  const std::string allowed =
      std::string_view(f.type) == "bool" ? "a flag, =false to turn it off" : f.allowed;
  return h + " (" + allowed + "; default " + default_text + ")";
}

void add_layer_options(CLI::App* cmd, LayerOptions& o) {
  add_option(cmd, "--preset", o.preset,
             "Layer shape: " + model_preset_names(false) + " (default " + o.preset +
                 ", seconds on a CPU). Explicit flags below override it.");
  add_option(cmd, "--backend", o.backend, "auto (the GPU when there is one, else the CPU) or cpu");
  add_option(cmd, "--ep", o.ep,
             "Expert-parallel ranks R (CPU: simulated as threads; GPU: one process per GPU, "
             "started by moe-echo launch -n R, and the default is WORLD_SIZE)");
  // One option per MoeConfig field.
  const std::vector<ConfigField>& fields = moe_config_fields();
  for (size_t i = 0; i < fields.size(); ++i) {
    const ConfigField& f = fields[i];
    std::string help = field_help(f, preset_sets(f.name) ? "the preset's" : f.default_text);
    add_field_option(cmd, f, field_flag(f), o.moe[i], help);
    if (const char* older = older_flag(f.name))
      add_field_option(cmd, f, older, o.moe[i], "The same as " + field_flag(f))
          ->group("Older spellings");
  }
  add_option(cmd, "--echo", o.echo, "ECHO cloning of hot experts: on (default) or off");
  add_option(
      cmd, "--spare-slots", o.spare_slots,
      "Spare expert slots per rank for clones (" + default_is(kEcho.spare_slots_per_rank) + ")");
  add_option(cmd, "--max-clones", o.max_clones,
             "Clones per expert per step (" + default_is(kEcho.max_clones_per_expert) + ")");
  add_option(cmd, "--clone-cost-rows", o.clone_cost_rows,
             "Cost of one clone link in rows: ECHO minimises the busiest rank's load plus this "
             "per clone link of the busiest-linked rank (default: on the GPU, the H200 cost "
             "model's clone traffic time over one row's expert time, ~2200 rows; 0 on the CPU "
             "backend)");
  add_option(cmd, "--seed", o.seed, "Seed of weights and synthetic data (default 1)");
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
  auto given = [&](std::string_view name) -> const std::optional<std::string>& {
    return o.moe[field_index(name)];
  };
  r.moe = moe_config(p);
  if (!given("max_tokens") && cpu_backend && p.moe_layers > 0) {
    r.moe.max_tokens = kCpuPresetTokens;
    r.tokens_reduced_for_cpu = true;
  }
  const std::vector<ConfigField>& fields = moe_config_fields();
  for (size_t i = 0; i < fields.size(); ++i)
    if (o.moe[i]) set_field(r.moe, fields[i].name, *o.moe[i], fields[i].name);
  // Other expert groups without --topk-groups: a token may pick from all of them.
  if (given("expert_groups") && !given("topk_groups")) r.moe.topk_groups = r.moe.expert_groups;
  const std::optional<std::string>& fp8_gemms = given("fp8_gemms");
  if (r.moe.precision != Precision::fp8 && fp8_gemms && *fp8_gemms != "all")
    reject("fp8_gemms", "'" + *fp8_gemms + "'", "all (the default) unless --precision fp8");
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
