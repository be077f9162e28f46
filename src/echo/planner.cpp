// ECHO planner (docs/design.md section 3): which hot experts to clone into spare slots this step
// and how many rows each replica takes, plus the per-source assignment of rows to replicas.
//
// Algorithm (plan_echo):
// 1. w[e] = sum over sources of C[src][e]; every rank starts with its home experts' rows.
// 2. Greedy placement, one clone per step while spare slots are free: relieve the busiest group
//    (the busiest rank plus the ranks it is already levelled with through cloned experts); the
//    hottest expert with rows in the group and clones left is cloned onto the least loaded rank
//    outside the group with a free slot and no replica of it, its rows re-split by integer
//    water-filling, and the re-split propagates to neighbouring cloned experts. Undone when the
//    group's busiest load does not drop enough; next candidate; a stop when none helps.
//    What a clone costs: its weights come in and its gradient goes home over the links of its
//    host and of its expert's home rank. A rank's clone links are the clones it hosts plus the
//    clones of its home experts elsewhere, and the clone traffic lasts as long as the
//    busiest-linked rank's, so a plan costs its busiest load plus clone_cost_rows per link of
//    its busiest-linked rank; a clone that leaves that count alone is hidden behind it and free.
//    Two runs from no clones, the cheaper plan stays:
//    a. Per clone: kept when it lowers the group's busiest load by more than clone_cost_rows;
//       the first stop ends the run. An expert with no more than clone_cost_rows rows in the
//       group is no candidate (a clone relieves the group of at most those rows), and a target
//       within clone_cost_rows of the busiest load is skipped (it only gains rows, so the new
//       busiest load is at least its load). With clone_cost_rows = 0 this run alone is the plan.
//    b. Under a link budget (clone_cost_rows > 0): a clone is kept when it lowers the group's
//       busiest load at all and leaves no rank above `budget` links. The budget starts at one
//       link. At a stop the plan is kept when it costs less than every plan kept before (run a's
//       and no clones included), and the budget rises to the least that admits a trial not yet
//       made (a trial made before a raise would fail again: the state has not changed), unless
//       no plan beyond can cost less than the kept one: some rank then reaches the new budget,
//       and no busiest load is below the floor (the mean load, and each expert's rows over its
//       most replicas). The run also ends when the floor plus the links so far reach the kept
//       cost (links are never removed), and returns to the kept plan when it ends dearer.
//    Run b searches, budget by budget, for the lowest busiest load each number of links
//    reaches; it finds plans run a misses (a clone that saves little but is hidden, a link that
//    pays only over several clones) and drops clones that do not lower the busiest rank.
// 3. Refinement: water-fill every cloned expert in expert order, pass after pass, until nothing
//    moves (bounded): descends the sum of squared loads towards the min-max split.
// 4. Whole blocks (row_block B > 1, FP8 weight gradients): every cloned expert's rows, in expert
//    order, re-split over its replicas in whole blocks of B rows of its row order, the partial
//    last block on the last replica with rows (a water-fill in blocks, trying each replica as
//    that last one). When the aligned plan costs more than the no-clone plan's busiest load, the
//    plan has no clones.
// 5. The plan: clones in ascending (rank, spare slot) order after the home replica; a clone left
//    with no rows is dropped.
//
// Invariants:
// - Pure function of (C, cfg) in integer arithmetic (int64 inside), ties broken by the lowest
//   index, no hash maps, no floating point: the same plan bit for bit on every rank. The loops
//   live in planner_core.hpp, over flat arrays in a scratch buffer; the CUDA backend runs them on
//   the device (src/cuda/planner.cu) with warp-parallel searches that give the same answers as
//   these sequential loops, so CPU and GPU plans agree bit for bit.
// - Every change (a clone, a re-split) is a water-fill, which keeps every rank it touches at or
//   below the largest load among them before, and a return to a kept plan restores it exactly,
//   so the busiest load never rises above the no-clone plan's. With clone_cost_rows > 0 the
//   plan's cost (as in step 2) is at most the no-clone busiest load: no clones is a plan run b
//   compares, refinement only lowers loads, and a dropped clone only removes links. Whole
//   blocks (step 4) may raise a load by up to a block per cloned expert; the aligned plan is
//   kept only when it still meets both bounds, otherwise the plan has no clones.
// - At most one replica of an expert per rank, at most S clones per rank, at most
//   min(max_clones, R - 1) clones per expert; an expert's replica rows sum to its rows.
//
// Cost: O(R*E) to read C; per greedy step O(R) (argmax, target) plus the group search over
// its ranks' experts and at most 2M + 16 re-splits of O(M) each (M = 1 + max_clones); per stop
// of run b O(R) and a kept plan's copy of O(R * S); a return O(R * S * M); the refinement
// O(clones * M) per pass. Run b roughly doubles a call with a clone cost: at the simulator's
// defaults (R = 32, E = 256, S = 1, max_clones 2, clone_cost_rows 1484) 0.063 ms per call on one
// core of this project's 2-core build machine, against 0.038 ms for run a alone; at
// R = E = 256 with max_clones 16, 0.72 ms against 0.21 ms
// (bench/results/simulate_planner_cap_2026-11-24.json, planner_time_harness).
// With clone_cost_rows = 0 the planner is run a alone, as measured on one idle x86 core at
// R = E = 256, S = 1..4: at most 0.3 ms with max_clones = 2 (0.02 ms on strong skew), at most
// 0.9 ms with max_clones = 8 (bench/results/planner_host_2026-11-21.json).
#include "moe_echo/planner.hpp"

#include <algorithm>
#include <limits>
#include <sstream>
#include <string>

#include "echo/planner_core.hpp"
#include "moe_echo/backend.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo {
namespace {

constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();

// Checks that every count of C is non-negative and that the total fits the plan's int32 fields.
void check_routing_map(const int32_t* routing_map, const PlannerConfig& cfg) {
  const int64_t n = int64_t(cfg.ranks) * cfg.experts;
  int32_t smallest = 0;
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    smallest = std::min(smallest, routing_map[i]);
    total += routing_map[i];
  }
  MOE_ECHO_CHECK(smallest >= 0, "routing_map holds a negative count (" << smallest << ")");
  MOE_ECHO_CHECK(total <= kMaxInt32,
                 "routing_map holds " << total << " rows in all, more than int32 plan fields hold");
}

// Runs the shared core (planner_core.hpp) on the host, in a scratch buffer of its own: plan_echo
// when echo, plan_placed with a placement (its clones added in slot order, then the refinement,
// and the written plan's compact slots mapped back to the placement's), else plan_none.
void run_planner(const int32_t* routing_map, const PlannerConfig& cfg, bool echo,
                 const int32_t* placement, PlanView out) {
  validate(cfg);
  check_routing_map(routing_map, cfg);
  std::vector<int64_t> scratch((planner_core::PlannerCore::bytes(cfg) + 7) / 8);
  planner_core::PlannerCore core;
  core.bind(cfg, scratch.data());
  core.init_experts(routing_map, 0, 1);
  core.init_ranks(0, 1);
  const int R = cfg.ranks, S = cfg.spare_slots;
  // slot[r * S + k]: the placement's slot of rank r's k-th clone (the core fills slots in order).
  std::vector<int32_t> slot(placement ? size_t(R) * size_t(S) : 0, -1);
  if (placement) {
    for (int i = 0; i < R * S; ++i)
      if (placement[i] >= 0) {
        const int r = i / S;
        slot[size_t(r) * S + size_t(core.spare_used[r])] = i % S;
        core.add_clone(placement[i], r);
      }
    core.refine();
    core.align_blocks(cfg.clone_cost_rows);
  } else if (echo) {
    core.place_clones(cfg.clone_cost_rows);
    core.refine();
    core.align_blocks(cfg.clone_cost_rows);
  }
  core.write(out);
  if (!placement) return;
  const int epr = cfg.experts_per_rank(), M = cfg.max_replicas();
  for (int r = 0; r < R; ++r) {
    std::vector<int32_t> compact(out.spare_expert + int64_t(r) * S,
                                 out.spare_expert + int64_t(r + 1) * S);
    std::fill(out.spare_expert + int64_t(r) * S, out.spare_expert + int64_t(r + 1) * S, -1);
    for (int k = 0; k < S; ++k)
      if (compact[size_t(k)] >= 0)
        out.spare_expert[int64_t(r) * S + slot[size_t(r) * S + k]] = compact[size_t(k)];
  }
  for (int64_t i = 0; i < int64_t(cfg.experts) * M; ++i)
    if (i % M != 0 && out.replica_rank[i] >= 0) {
      const int r = out.replica_rank[i];
      out.replica_slot[i] = epr + slot[size_t(r) * S + size_t(out.replica_slot[i] - epr)];
    }
}

}  // namespace

int64_t plan_ints(const PlannerConfig& cfg) {
  const int64_t R = cfg.ranks, E = cfg.experts, S = cfg.spare_slots, M = cfg.max_replicas();
  return R * S + 3 * E * M + 2 * R + 1;
}

PlanView plan_view(int32_t* base, const PlannerConfig& cfg) {
  const int64_t R = cfg.ranks, E = cfg.experts, S = cfg.spare_slots, M = cfg.max_replicas();
  PlanView v;
  v.spare_expert = base;
  v.replica_rank = v.spare_expert + R * S;
  v.replica_slot = v.replica_rank + E * M;
  v.replica_rows = v.replica_slot + E * M;
  v.load_before = v.replica_rows + E * M;
  v.load_after = v.load_before + R;
  v.num_clones = v.load_after + R;
  return v;
}

PlannerConfig planner_config(const MoeConfig& m, const ParallelConfig& p, const EchoConfig& e) {
  PlannerConfig c;
  c.ranks = p.ep_size;
  c.experts = m.experts;
  c.spare_slots = e.enabled ? e.spare_slots_per_rank : 0;
  c.max_clones = e.enabled ? e.max_clones_per_expert : 0;
  c.clone_cost_rows = e.clone_cost_rows;
  // FP8 weight gradients quantize their operands in 1 x 128 tiles along an expert's rows.
  if (uses_fp8(m, fp8_gemm::wgrad1) || uses_fp8(m, fp8_gemm::wgrad2)) c.row_block = int(kFp8Tile);
  return c;
}

int32_t Plan::max_load_after() const {
  const int64_t R = cfg.ranks, E = cfg.experts, S = cfg.spare_slots, M = cfg.max_replicas();
  const int32_t* p = storage.data() + R * S + 3 * E * M + R;
  return *std::max_element(p, p + R);
}

int32_t Plan::max_load_before() const {
  const int64_t R = cfg.ranks, E = cfg.experts, S = cfg.spare_slots, M = cfg.max_replicas();
  const int32_t* p = storage.data() + R * S + 3 * E * M;
  return *std::max_element(p, p + R);
}

void validate(const PlannerConfig& cfg) {
  if (cfg.ranks < 1) reject("ranks", cfg.ranks, "ranks >= 1");
  if (cfg.experts < 1) reject("experts", cfg.experts, "experts >= 1");
  if (cfg.experts % cfg.ranks != 0)
    reject("experts", cfg.experts, "a multiple of ranks (" + std::to_string(cfg.ranks) + ")");
  if (cfg.spare_slots < 0) reject("spare_slots", cfg.spare_slots, "spare_slots >= 0");
  if (int64_t(cfg.ranks) * cfg.spare_slots > kMaxInt32)
    reject("spare_slots", cfg.spare_slots, "ranks * spare_slots <= 2^31-1");
  if (cfg.max_clones < 0) reject("max_clones", cfg.max_clones, "max_clones >= 0");
  if (int64_t(cfg.experts) * (int64_t(cfg.max_clones) + 1) * 3 > kMaxInt32)
    reject("max_clones", cfg.max_clones, "3 * experts * (1 + max_clones) <= 2^31-1");
  if (cfg.clone_cost_rows < 0)
    reject("clone_cost_rows", cfg.clone_cost_rows, "clone_cost_rows >= 0");
  if (cfg.row_block < 1) reject("row_block", cfg.row_block, "row_block >= 1");
}

void plan_none(const int32_t* routing_map, const PlannerConfig& cfg, PlanView out) {
  run_planner(routing_map, cfg, false, nullptr, out);
}

void plan_echo(const int32_t* routing_map, const PlannerConfig& cfg, PlanView out) {
  run_planner(routing_map, cfg, true, nullptr, out);
}

void plan_placed(const int32_t* routing_map, const PlannerConfig& cfg, const int32_t* placement,
                 PlanView out) {
  validate(cfg);  // before the placement's checks; run_planner checks the map
  const int R = cfg.ranks, E = cfg.experts, S = cfg.spare_slots;
  const int limit = std::min(cfg.max_clones, R - 1);
  std::vector<int32_t> clones(size_t(E), 0);
  std::vector<uint8_t> on_rank(size_t(R) * size_t(E), 0);  // a clone of e on rank r already
  for (int i = 0; i < R * S; ++i) {
    const int r = i / S, e = placement[i];
    if (e == -1) continue;
    auto bad = [&](const std::string& why) {
      reject("placement", "[" + std::to_string(i) + "] = " + std::to_string(e),
             why + " (spare slot " + std::to_string(i % S) + " of rank " + std::to_string(r) + ")");
    };
    if (e < 0 || e >= E) bad("-1 or an expert in [0, " + std::to_string(E) + ")");
    if (cfg.home_rank(e) == r) bad("an expert whose home is another rank");
    if (on_rank[size_t(r) * E + size_t(e)]) bad("one replica of an expert per rank");
    if (++clones[size_t(e)] > limit)
      bad("at most min(max_clones, ranks - 1) = " + std::to_string(limit) + " clones per expert");
    on_rank[size_t(r) * E + size_t(e)] = 1;
  }
  run_planner(routing_map, cfg, true, placement, out);
}

void compute_assignment(const int32_t* routing_map, const PlannerConfig& cfg, const PlanView& plan,
                        int32_t* assign) {
  validate(cfg);
  const int R = cfg.ranks, E = cfg.experts, M = cfg.max_replicas();
  std::vector<int32_t> quota(static_cast<size_t>(M)), left(static_cast<size_t>(R));
  for (int e = 0; e < E; ++e) {
    const int32_t* rrank = plan.replica_rank + int64_t(e) * M;
    const int32_t* rrows = plan.replica_rows + int64_t(e) * M;
    int n = 1;
    while (n < M && rrank[n] >= 0) ++n;
    if (n == 1) {  // no clone: the home replica takes every row
      for (int src = 0; src < R; ++src) {
        int32_t* a = assign + (int64_t(src) * E + e) * M;
        a[0] = routing_map[int64_t(src) * E + e];
        for (int j = 1; j < M; ++j) a[j] = 0;
      }
      continue;
    }
    for (int j = 0; j < M; ++j) quota[j] = j < n ? rrows[j] : 0;
    // Pass 1: a source keeps its rows on its own rank, up to that replica's quota (row_block 1:
    // with whole blocks the replicas take the expert's rows in order, pass 2 alone).
    for (int src = 0; src < R; ++src) {
      int32_t* a = assign + (int64_t(src) * E + e) * M;
      for (int j = 0; j < M; ++j) a[j] = 0;
      left[src] = routing_map[int64_t(src) * E + e];
      if (cfg.row_block > 1) continue;
      for (int j = 0; j < n; ++j) {
        if (rrank[j] != src) continue;
        const int32_t take = std::min(left[src], quota[j]);
        a[j] = take;
        quota[j] -= take;
        left[src] -= take;
        break;
      }
    }
    // Pass 2: the rest, sources in rank order, replicas in replica order.
    for (int src = 0; src < R; ++src) {
      int32_t* a = assign + (int64_t(src) * E + e) * M;
      for (int j = 0; j < n && left[src] > 0; ++j) {
        const int32_t take = std::min(left[src], quota[j]);
        a[j] += take;
        quota[j] -= take;
        left[src] -= take;
      }
      MOE_ECHO_CHECK(left[src] == 0, "plan replica rows of expert "
                                         << e << " do not cover routing_map rows of source "
                                         << src);
    }
  }
}

}  // namespace moe_echo
