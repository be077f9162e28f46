// ECHO planner: which hot experts to clone into spare slots this step, and how many rows each
// replica takes. Also the baselines it is compared with (no balancing, DeepSeek EPLB, the
// brute-force optimum for tiny cases).
//
// Invariants:
// - Deterministic: the plan is a pure function of the routing map C and the PlannerConfig, in
//   integer arithmetic with ties broken by the lowest index, so every rank (and the CPU and GPU
//   implementations) computes the same plan bit for bit without a second exchange.
// - A plan never raises the busiest rank's load above the no-clone load, and with a clone cost
//   its cost (busiest load + clone_cost_rows per clone link of the busiest-linked rank) never
//   exceeds the no-clone busiest load.
// - With row_block B > 1, every replica of an expert takes a multiple of B rows but the last one
//   with rows (in replica order), which takes the rest.
// - The plan is a flat array of int32 (`plan_ints()` entries) so a device kernel can write it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "moe_echo/config.hpp"

namespace moe_echo {

struct PlannerConfig {
  int ranks = 1;        // R
  int experts = 1;      // E (home expert e lives on rank e / (E/R), local slot e % (E/R))
  int spare_slots = 0;  // S per rank
  int max_clones = 0;   // clones per expert per step; replicas per expert M = 1 + max_clones
  // What one clone link costs, in rows of the busiest rank: a plan costs its busiest load plus
  // this per clone link of its busiest-linked rank (clones it hosts + clones of its home experts
  // elsewhere). 0: clones are free, and any clone that lowers the busiest load is made.
  int64_t clone_cost_rows = 0;
  // The rows of an expert with clones are split between its replicas in whole blocks of this
  // many rows of the expert's row order (sources in rank order, each source's rows in (token, k)
  // order, as one slot would receive them with no clones): the replicas take consecutive runs of
  // that order in replica order (compute_assignment), and each run but the last starts and ends
  // on a block boundary. 1: any split, and a source's rows go first to a replica on its own rank.
  // planner_config sets kFp8Tile (128) when a weight-gradient GEMM runs in FP8: its operands are
  // quantized in tiles of 128 of an expert's rows from the start of each replica's rows, so whole
  // blocks give every tile the same rows with ECHO on and off.
  int row_block = 1;

  int experts_per_rank() const { return experts / ranks; }
  int max_replicas() const { return 1 + max_clones; }
  int home_rank(int e) const { return e / experts_per_rank(); }
  int home_slot(int e) const { return e % experts_per_rank(); }
};

// The planner's config of a layer: its ranks and experts, and ECHO's spare slots, clone limit and
// clone cost (no spare slots and no clones when ECHO is off).
PlannerConfig planner_config(const MoeConfig& m, const ParallelConfig& p, const EchoConfig& e);

// Non-owning view of a plan stored as int32 arrays. Replica j of expert e: j = 0 is the home
// replica, j >= 1 are its clones in ascending (rank, spare slot) order; unused entries hold -1
// (rank, slot) and 0 (rows). Slots are local: home slots 0..E/R-1, spare slot s is E/R + s.
struct PlanView {
  int32_t* spare_expert = nullptr;  // [R * S]: expert cloned into spare slot s of rank r, or -1
  int32_t* replica_rank = nullptr;  // [E * M]
  int32_t* replica_slot = nullptr;  // [E * M]
  int32_t* replica_rows = nullptr;  // [E * M]: rows replica j of e processes (sum = load of e)
  int32_t* load_before = nullptr;   // [R]: rows each rank would receive with no clones
  int32_t* load_after = nullptr;    // [R]: rows each rank receives under this plan
  int32_t* num_clones = nullptr;    // [1]
};

// int32 entries of a plan's storage; PlanView over `base` laid out in the field order above.
int64_t plan_ints(const PlannerConfig& cfg);
PlanView plan_view(int32_t* base, const PlannerConfig& cfg);

// An owning plan (host memory).
struct Plan {
  PlannerConfig cfg;
  std::vector<int32_t> storage;
  explicit Plan(const PlannerConfig& c) : cfg(c), storage(size_t(plan_ints(c)), 0) {}
  PlanView view() { return plan_view(storage.data(), cfg); }
  int32_t max_load_after() const;
  int32_t max_load_before() const;
};

// Throws ConfigError naming the field if cfg is inconsistent (E % R != 0, negative counts...).
void validate(const PlannerConfig& cfg);

// ECHO planner (docs/design.md section 3) on routing map C[R][E] (row-major). Writes every entry
// of `out`. With spare_slots == 0 or max_clones == 0 it writes the no-clone plan.
void plan_echo(const int32_t* routing_map, const PlannerConfig& cfg, PlanView out);

// The plan of a placement chosen before this routing map (placement[r * S + s]: the expert cloned
// into spare slot s of rank r, or -1; e.g. the spare_expert of the previous step's plan, or of a
// step's first micro-batch that the step's later ones keep): the clones stay in their slots and
// each cloned expert's rows of this map are split over its replicas by plan_echo's water-filling
// refinement (a clone left with no rows is dropped, as plan_echo drops one). Throws ConfigError
// naming `placement` when an entry is not an expert, a clone sits on its expert's home rank or
// beside another replica of it, or an expert has more than min(max_clones, R - 1) clones.
void plan_placed(const int32_t* routing_map, const PlannerConfig& cfg, const int32_t* placement,
                 PlanView out);

// The no-clone plan (every expert on its home slot).
void plan_none(const int32_t* routing_map, const PlannerConfig& cfg, PlanView out);

// Rows source rank src sends to replica j of expert e: assign[(src * E + e) * M + j].
// With row_block 1, locality first: a source first fills a replica on its own rank, then the
// replicas in replica order, each up to its remaining quota; sources are served in rank order.
// With row_block > 1, in order: sources in rank order fill the replicas in replica order, so
// replica j takes the expert's rows [sum of rows of replicas < j, + its rows) in the expert's row
// order (see row_block). Deterministic.
void compute_assignment(const int32_t* routing_map, const PlannerConfig& cfg, const PlanView& plan,
                        int32_t* assign);

// ---- Baselines, for comparison in tests and the simulator only ----

// DeepSeek EPLB restricted to the same spare slots: the R*S extra replicas go to the experts with
// the highest load per replica (greedy), are packed heaviest first onto the least loaded rank that
// has a free spare slot and no replica of that expert yet, and every expert's rows are split evenly
// over its replicas. Written as a PlanView so it is evaluated like an ECHO plan.
void plan_eplb_restricted(const int32_t* routing_map, const PlannerConfig& cfg, PlanView out);

// Unrestricted EPLB placement from a load estimate (e.g. long-run statistics): `slots_per_rank`
// slots on each of `ranks` ranks (ranks * slots_per_rank >= experts), every expert gets at least
// one replica, the rest by greedy replication; balanced packing of replicas to ranks.
struct EplbPlacement {
  int ranks = 0;
  int slots_per_rank = 0;
  std::vector<int32_t> slot_expert;  // [ranks * slots_per_rank]
};
EplbPlacement eplb_place(const std::vector<double>& expert_load, int ranks, int slots_per_rank);
// Rank loads when a step's routing map is served by a fixed placement, each expert's rows split
// evenly over its replicas (as EPLB does at run time).
std::vector<int64_t> eplb_rank_loads(const EplbPlacement& placement, const int32_t* routing_map,
                                     int src_ranks, int experts);

// The optimum of the min-max problem for tiny cases: the smallest possible busiest-rank load
// over every placement of clones into spare slots (respecting max_clones, at most one replica of
// an expert per rank) and every integer split of rows over replicas. Exponential: tests only.
int64_t brute_force_min_max_load(const int32_t* routing_map, const PlannerConfig& cfg);
// The same search for the planner's cost with a clone cost: the smallest busiest-rank load plus
// clone_cost_rows per clone link of the busiest-linked rank (a rank's clone links: the clones it
// hosts plus the clones of its home experts). Exponential: tests only.
int64_t brute_force_min_cost(const int32_t* routing_map, const PlannerConfig& cfg);

}  // namespace moe_echo
