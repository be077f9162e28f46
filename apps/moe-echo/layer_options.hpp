// Options shared by `bench` and `train`: a preset plus explicit overrides, resolved into configs.
// Every MoeConfig field has its option, made from the field list (moe_echo/config_fields.hpp):
// `--<name with dashes>` (`--top-k`), its help, what it allows and its default.
#pragma once

#include <CLI/CLI.hpp>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "moe_echo/backend.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/config.hpp"
#include "moe_echo/host_io.hpp"  // check_output_path: the --json, --plot and --write-trace files
#include "moe_echo/layer.hpp"
#include "moe_echo/presets.hpp"

namespace moe_echo::cli {

struct LayerOptions {
  std::string preset{kTinyLayer.name};
  std::string backend = "auto";
  // The MoeConfig fields given on the command line, as text, in moe_config_fields() order; the
  // others are the preset's or the library's defaults.
  std::vector<std::optional<std::string>> moe =
      std::vector<std::optional<std::string>>(moe_config_fields().size());
  std::optional<int> ep, spare_slots, max_clones;
  std::string echo = "on";
  std::optional<int64_t> clone_cost_rows;
  uint64_t seed = 1;
};

// The flag of a MoeConfig field's option: "--top-k" for top_k. A few fields also take an older,
// shorter spelling ("--tokens" for max_tokens; layer_options.cpp, kOlderFlags).
std::string field_flag(const ConfigField& f);
// The MoeConfig field `name` of the list.
const ConfigField& moe_field(std::string_view name);
// "<Help> (<allowed>; default <default>)": the help of a field's option.
std::string field_help(const ConfigField& f, const std::string& default_text);

struct ResolvedLayer {
  MoeConfig moe;
  int ep = 1;
  EchoConfig echo;
  std::string preset;
  bool tokens_reduced_for_cpu = false;
  bool gpu = false;  // the CUDA backend
};

void add_layer_options(CLI::App* cmd, LayerOptions& o);
// Applies the preset, then the explicit flags; validates (throws ConfigError). On the CPU backend
// GPU-sized presets run with fewer tokens; on the CUDA backend (one GPU per process) ep is the
// number of processes of the job, `world_size` (WORLD_SIZE under moe-echo launch or torchrun).
ResolvedLayer resolve(const LayerOptions& o, const Backend& backend, int world_size = 1);

// What `layers` layers of L allocate on one rank (with or without AdamW state): one MoeStack
// (`shared_workspace`: one workspace for all, MoeStack::memory_bytes) or as many MoeLayers each
// with its own workspace (MoeLayer::memory_bytes each).
// The same by part (MoeMemory: parameters, gradients, routing, kept activations, workspace, echo
// slots), for reports.
MoeMemory moe_memory_per_rank(const ResolvedLayer& L, const Backend& backend, int layers,
                              bool shared_workspace, bool optimizer_state);
double moe_bytes_per_rank(const ResolvedLayer& L, const Backend& backend, int layers,
                          bool shared_workspace, bool optimizer_state);

// Refuses, before anything is allocated, a run whose layers cannot fit: moe_bytes_per_rank plus
// `extra_bytes_per_rank` on each rank. On the CPU backend every rank lives in this process, so
// that times the L.ep ranks must fit in 80% of this machine's memory; on the CUDA backend (one
// rank per process) it must fit in the GPU's free memory. Throws ConfigError naming the memory
// needed and the flags that set it.
void check_memory(const ResolvedLayer& L, const Backend& backend, int layers, bool shared_workspace,
                  bool optimizer_state, double extra_bytes_per_rank);

// Physical memory of this machine in bytes (0 when unknown).
double physical_memory_bytes();

// Tensors of one rank's run in the backend's activation dtype, freed when it ends (an exception
// included). Declare it after the backend, which must outlive it.
class RankTensors {
 public:
  explicit RankTensors(Backend& backend) : backend_(backend) {}
  ~RankTensors() {
    for (void* p : owned_) backend_.deallocate(p);
  }
  RankTensors(const RankTensors&) = delete;
  RankTensors& operator=(const RankTensors&) = delete;
  Tensor operator()(std::initializer_list<int64_t> dims) {
    Tensor t(nullptr, backend_.activation_dtype(), dims);
    t.data = backend_.allocate(t.bytes());
    owned_.push_back(t.data);
    return t;
  }

 private:
  Backend& backend_;
  std::vector<void*> owned_;
};

// The communicator of `rank`: the in-process world's on the CPU backend; on the CUDA backend the
// single-GPU communicator, kept alive by `holder`.
Communicator& rank_communicator(const Backend& backend, InProcessWorld& world, int rank,
                                std::unique_ptr<Communicator>& holder);

}  // namespace moe_echo::cli
