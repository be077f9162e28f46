// Load-balance simulator: runs the balancing policies on the same routing maps, step after step
// and layer after layer, and reports how evenly each spreads the rows over the EP ranks, what
// clones it makes and what it costs in bytes and (estimated) time.
//
// Policies (all see exactly the same maps):
//   echo           plan_echo each step and layer (S spare slots per rank)
//   eplb           plan_eplb_restricted each step: DeepSeek EPLB confined to the same spare slots
//   eplb_periodic  eplb_place every `eplb_period` steps from the loads observed since the last
//                  re-placement (E/R + S slots per rank, R*S redundant replicas, unrestricted),
//                  then eplb_rank_loads each step; until the first re-placement nothing has
//                  been observed, so experts stay home and the redundant slots stay empty
//   none           plan_none: every expert on its home rank
//   echo_stale     plan_placed on the placement plan_echo made from the previous step's map of
//                  the same layer (none at step 0): the clones are chosen a step ahead, as when
//                  their weights are pulled right after the optimizer, and only the rows are
//                  split on this step's map (not in the default set)
//   echo_step      with micro_batches = M > 1: plan_echo on the step's first micro-batch, with the
//                  clone cost divided by M (one transfer serves M micro-batches), plan_placed on
//                  that placement for the others (EchoPlacement::step: the clones pulled and
//                  reduced once a step); with one micro-batch the same as echo (not in the
//                  default set)
//
// Micro-batches (micro_batches = M > 1): each step's rows are split over M forwards (each row to
// one of them uniformly); every policy runs on each micro-batch's map, a sample's max/mean is the
// mean over them, and its time the sum. echo and eplb plan, and pull their clones, for each
// micro-batch; echo_step, echo_stale and eplb_periodic keep a placement for the step and pull it
// once.
//
// Invariants:
// - A sample is one (step, layer): max over ranks of the rank load (rows) over the mean. The
//   mean is the same for every policy (all rows are processed somewhere).
// - Results do not depend on `threads` (layers are split over threads; each layer's trace stream
//   and policy state are sequential in steps).
// - Training accounting: a replica that is not an expert's master (an ECHO clone, an EPLB
//   redundant expert) must pull the expert's weights and push back its gradient every step,
//   because the optimizer changes the weights every step. EPLB's periodic re-placement also moves
//   masters (with their optimizer state) between ranks; those bytes are counted apart.
//
// Part of the offline tools: library moe_echo_offline (CPU only), src/offline/simulator.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe_echo/config.hpp"
#include "moe_echo/cost_model.hpp"
#include "moe_echo/planner.hpp"
#include "moe_echo/presets.hpp"
#include "moe_echo/trace.hpp"

namespace moe_echo::offline {

enum class Policy { echo, eplb, eplb_periodic, none, echo_stale, echo_step };
const char* to_string(Policy p);
inline constexpr Policy kAllPolicies[] = {Policy::echo, Policy::eplb,       Policy::eplb_periodic,
                                          Policy::none, Policy::echo_stale, Policy::echo_step};
inline constexpr Policy kDefaultPolicies[] = {Policy::echo, Policy::eplb, Policy::eplb_periodic,
                                              Policy::none};

struct SimulatorConfig {
  int ranks = 32;                     // R, the EP size
  int experts = kDeepSeekV3.experts;  // E
  int top_k = kDeepSeekV3.top_k;      // K (the text report, and rows moved per routed entry; rows
                                      // come from the trace)
  // Group-limited routing (1, 1: none): the rows a token sends go to the ranks its topk_groups
  // groups cover (the cost model's ranks_per_token), for the all-to-all bytes.
  int expert_groups = 1;
  int topk_groups = 1;
  int steps = 0;   // 0: every step of the trace
  int layers = 0;  // 0: every layer of the trace
  // S per rank (ECHO, EPLB restricted; EPLB periodic gets R*S replicas); the library's default.
  int spare_slots = EchoConfig{}.spare_slots_per_rank;
  int max_clones = EchoConfig{}.max_clones_per_expert;  // ECHO: clones per expert per step
  int64_t clone_cost_rows = -1;  // ECHO: -1 derives it from the cost model (step_clone_cost_rows)
  int eplb_period = 100;         // steps between EPLB re-placements
  int micro_batches = 1;         // M: forwards a step's rows are split over (1 to 64)
  int threads = 2;
  std::vector<Policy> policies{std::begin(kDefaultPolicies), std::end(kDefaultPolicies)};
  // Model (DeepSeek-V3's layer unless set) and cost model, for bytes and time.
  int hidden = kDeepSeekV3.hidden;  // H
  int ffn = kDeepSeekV3.ffn;        // F
  int grad_bytes = 2;               // bytes per parameter of a clone's gradient sent home (bf16)
  int master_state_bytes = 14;      // bytes per parameter moved with a master: bf16 weight + fp32
                                    // master copy + Adam m and v (2 + 4 + 4 + 4)
  CostModel cost;
};

// Throws ConfigError naming the first invalid field.
void validate(const SimulatorConfig& cfg);

// The planner config simulate() plans every step with: ranks, experts, spare slots and clones of
// cfg, and its clone cost (cfg.clone_cost_rows, or from the cost model when it is -1).
PlannerConfig simulator_planner_config(const SimulatorConfig& cfg);

struct PolicyStats {
  Policy policy = Policy::none;
  // max/mean over ranks, over all (step, layer) samples
  double max_over_mean_mean = 0, max_over_mean_p50 = 0, max_over_mean_p99 = 0,
         max_over_mean_max = 0;
  std::vector<double> max_over_mean_per_step;  // [steps]: mean over layers
  std::vector<double> samples_sorted;          // [steps * layers], ascending
  double clones_per_step = 0;                  // summed over layers, mean over steps
  double clone_bytes_per_step = 0;             // clones_per_step * clone_bytes
  double migration_bytes_per_step = 0;         // EPLB periodic: master moves, amortised over steps
  int64_t replacements = 0;                    // EPLB periodic: re-placements made
  // Estimated time per step (all simulated layers, forward + backward): the busiest rank's
  // expert GEMMs, all-to-all (dispatch + combine, both directions) and clone traffic.
  double compute_ms = 0, comm_ms = 0, clone_ms = 0, migration_ms = 0;
  double est_step_ms = 0;          // serial: compute + comm + clone + migration
  double est_step_ms_overlap = 0;  // max(compute, comm + clone) per layer, + migration
  double planner_ms_per_call = 0;  // host time of one planner call (this machine)
  // Fraction of samples with max/mean above `capacity_factor` (they spill).
  double spill_fraction(double capacity_factor) const;
};

struct SimulationResult {
  SimulatorConfig config;
  int steps = 0, layers = 0;
  // Ranks a token's rows go to: expected under uniform routing and at most (cost model).
  double ranks_per_token = 0;
  int max_ranks_per_token = 0;
  double mean_rows_per_rank = 0;      // mean over samples of the mean rank load
  int64_t clone_cost_rows = 0;        // what ECHO used
  std::string trace;                  // describe() of the source
  std::vector<PolicyStats> policies;  // in config.policies order
  double elapsed_s = 0;
  const PolicyStats* find(Policy p) const;
};

SimulationResult simulate(const TraceSource& trace, const SimulatorConfig& cfg);

// An upper estimate of the bytes simulate() allocates for `steps` x `layers` samples of a valid
// cfg (the per-sample results of every policy, each thread's count tables and plans, the
// generator's state), so that a caller can refuse a run that cannot fit before it starts.
double memory_bytes(const SimulatorConfig& cfg, int64_t steps, int64_t layers);

// Nearest-rank percentile (q in [0, 1]) of ascending values.
double percentile_sorted(const std::vector<double>& sorted, double q);

}  // namespace moe_echo::offline
