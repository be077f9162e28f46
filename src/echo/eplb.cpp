// DeepSeek EPLB as a baseline, re-implemented from its published algorithm: greedy replication
// (one more replica at a time to the expert with the largest load per replica), then balanced
// packing (replicas heaviest first, each to the least loaded rank that still has a free slot),
// and at run time every expert's rows split evenly over its replicas.
//
// Invariants: deterministic (exact integer comparisons of load per replica where loads are rows,
// ties broken by the lowest expert or rank index); never two replicas of one expert on one rank
// in plan_eplb_restricted; every slot of an EplbPlacement is filled when there are enough experts.
#include <algorithm>

#include "moe_echo/error.hpp"
#include "moe_echo/planner.hpp"

namespace moe_echo {
namespace {

// Splits `rows` evenly over n parts, the first `rows % n` parts one row more.
int64_t even_part(int64_t rows, int n, int j) { return rows / n + (j < rows % n ? 1 : 0); }

}  // namespace

void plan_eplb_restricted(const int32_t* routing_map, const PlannerConfig& cfg, PlanView out) {
  validate(cfg);
  const int R = cfg.ranks, E = cfg.experts, S = cfg.spare_slots, M = cfg.max_replicas();
  const int epr = cfg.experts_per_rank();
  const int clone_limit = std::min(cfg.max_clones, R - 1);

  std::vector<int64_t> w(size_t(E), 0);
  for (int src = 0; src < R; ++src)
    for (int e = 0; e < E; ++e) {
      MOE_ECHO_CHECK(routing_map[int64_t(src) * E + e] >= 0,
                     "routing_map[" << src << "][" << e << "] is negative");
      w[e] += routing_map[int64_t(src) * E + e];
    }

  // Greedy replication of the R*S extra replicas: largest w[e] / n[e] first (compared exactly as
  // w[a] * n[b] > w[b] * n[a]), within the clone limit; experts with no rows get none.
  std::vector<int32_t> n(size_t(E), 1);
  const int64_t extras = int64_t(R) * S;
  for (int64_t k = 0; k < (clone_limit > 0 ? extras : 0); ++k) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      if (n[e] > clone_limit || w[e] == 0) continue;
      if (best < 0 || w[e] * n[best] > w[best] * n[e]) best = e;
    }
    if (best < 0) break;
    ++n[best];
  }

  // Balanced packing of the clones. Rank loads start from the home replicas' even shares.
  std::vector<int64_t> load(size_t(R), 0);
  for (int e = 0; e < E; ++e) load[e / epr] += even_part(w[e], n[e], 0);
  struct Item {
    int expert, index;  // clone `index` (1..n-1) of `expert`
  };
  std::vector<Item> items;
  for (int e = 0; e < E; ++e)
    for (int j = 1; j < n[e]; ++j) items.push_back({e, j});
  // Heaviest share first; equal shares by expert, then clone index.
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    const int64_t sa = even_part(w[a.expert], n[a.expert], a.index);
    const int64_t sb = even_part(w[b.expert], n[b.expert], b.index);
    if (sa != sb) return sa > sb;
    if (a.expert != b.expert) return a.expert < b.expert;
    return a.index < b.index;
  });
  std::vector<int32_t> spare(size_t(R) * S, -1), used(size_t(R), 0);
  // on_rank[e * R + r]: expert e has a replica on rank r. R*E bytes, fine for a baseline.
  std::vector<uint8_t> on_rank(size_t(E) * R, 0);
  for (int e = 0; e < E; ++e) on_rank[size_t(e) * R + e / epr] = 1;
  std::vector<int32_t> placed(size_t(E), 1);
  for (const Item& it : items) {
    int target = -1;
    for (int r = 0; r < R; ++r)
      if (used[r] < S && !on_rank[size_t(it.expert) * R + r] &&
          (target < 0 || load[r] < load[target]))
        target = r;
    if (target < 0) continue;  // no rank can take it: the expert keeps fewer replicas
    spare[size_t(target) * S + used[target]++] = it.expert;
    on_rank[size_t(it.expert) * R + target] = 1;
    load[target] += even_part(w[it.expert], n[it.expert], it.index);
    ++placed[it.expert];
  }

  // The plan: replicas home first, then clones in ascending (rank, slot); rows split evenly over
  // the replicas actually placed, the remainder to the lowest replica index.
  for (int64_t i = 0; i < int64_t(R) * S; ++i) out.spare_expert[i] = spare[size_t(i)];
  for (int64_t i = 0; i < int64_t(E) * M; ++i) {
    out.replica_rank[i] = -1;
    out.replica_slot[i] = -1;
    out.replica_rows[i] = 0;
  }
  std::vector<int32_t> count(size_t(E), 1);
  for (int e = 0; e < E; ++e) {
    out.replica_rank[int64_t(e) * M] = e / epr;
    out.replica_slot[int64_t(e) * M] = e % epr;
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) {
      const int e = spare[size_t(r) * S + s];
      if (e < 0) continue;
      const int j = count[e]++;
      out.replica_rank[int64_t(e) * M + j] = r;
      out.replica_slot[int64_t(e) * M + j] = epr + s;
    }
  std::fill(load.begin(), load.end(), 0);
  int32_t clones = 0;
  for (int e = 0; e < E; ++e) {
    clones += count[e] - 1;
    for (int j = 0; j < count[e]; ++j) {
      const int64_t rows = even_part(w[e], count[e], j);
      out.replica_rows[int64_t(e) * M + j] = int32_t(rows);
      load[out.replica_rank[int64_t(e) * M + j]] += rows;
    }
  }
  std::vector<int64_t> before(size_t(R), 0);
  for (int e = 0; e < E; ++e) before[e / epr] += w[e];
  for (int r = 0; r < R; ++r) {
    out.load_before[r] = int32_t(before[r]);
    out.load_after[r] = int32_t(load[r]);
  }
  out.num_clones[0] = clones;
}

EplbPlacement eplb_place(const std::vector<double>& expert_load, int ranks, int slots_per_rank) {
  const int E = int(expert_load.size());
  MOE_ECHO_CHECK(ranks >= 1 && slots_per_rank >= 1,
                 "ranks = " << ranks << ", slots_per_rank = " << slots_per_rank);
  MOE_ECHO_CHECK(int64_t(ranks) * slots_per_rank >= E, ranks << " ranks * " << slots_per_rank
                                                             << " slots cannot hold " << E
                                                             << " experts");
  for (int e = 0; e < E; ++e)
    MOE_ECHO_CHECK(expert_load[size_t(e)] >= 0, "expert_load[" << e << "] is negative");

  // Greedy replication: every expert once, then the largest load per replica, at most one
  // replica per rank (ties: lowest expert).
  std::vector<int32_t> n(size_t(E), 1);
  const int64_t total_slots = int64_t(ranks) * slots_per_rank;
  for (int64_t k = E; k < total_slots; ++k) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      if (n[e] >= ranks) continue;
      if (best < 0 || expert_load[size_t(e)] * n[best] > expert_load[size_t(best)] * n[e]) best = e;
    }
    if (best < 0) break;
    ++n[best];
  }

  // Balanced packing: replicas heaviest first to the least loaded rank with a free slot, a rank
  // without a replica of that expert when one exists.
  struct Item {
    double share;
    int expert;
  };
  std::vector<Item> items;
  for (int e = 0; e < E; ++e)
    for (int j = 0; j < n[e]; ++j) items.push_back({expert_load[size_t(e)] / n[e], e});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    if (a.share != b.share) return a.share > b.share;
    return a.expert < b.expert;
  });
  EplbPlacement p;
  p.ranks = ranks;
  p.slots_per_rank = slots_per_rank;
  p.slot_expert.assign(size_t(total_slots), -1);
  std::vector<double> load(size_t(ranks), 0.0);
  std::vector<int32_t> used(size_t(ranks), 0);
  std::vector<uint8_t> on_rank(size_t(E) * ranks, 0);
  for (const Item& it : items) {
    int target = -1;
    for (int pass = 0; pass < 2 && target < 0; ++pass)
      for (int r = 0; r < ranks; ++r) {
        if (used[r] >= slots_per_rank) continue;
        if (pass == 0 && on_rank[size_t(it.expert) * ranks + r]) continue;
        if (target < 0 || load[r] < load[target]) target = r;
      }
    MOE_ECHO_CHECK(target >= 0, "no free slot for expert " << it.expert);
    p.slot_expert[size_t(target) * slots_per_rank + used[target]++] = it.expert;
    on_rank[size_t(it.expert) * ranks + target] = 1;
    load[target] += it.share;
  }
  return p;
}

std::vector<int64_t> eplb_rank_loads(const EplbPlacement& placement, const int32_t* routing_map,
                                     int src_ranks, int experts) {
  const int R = placement.ranks, P = placement.slots_per_rank;
  MOE_ECHO_CHECK(
      int64_t(placement.slot_expert.size()) == int64_t(R) * P,
      "placement has " << placement.slot_expert.size() << " slots, expected " << int64_t(R) * P);
  std::vector<int64_t> w(size_t(experts), 0);
  for (int src = 0; src < src_ranks; ++src)
    for (int e = 0; e < experts; ++e) w[size_t(e)] += routing_map[int64_t(src) * experts + e];
  std::vector<int32_t> n(size_t(experts), 0);
  for (int32_t e : placement.slot_expert) {
    MOE_ECHO_CHECK(e >= -1 && e < experts, "placement names expert " << e);
    if (e >= 0) ++n[size_t(e)];
  }
  for (int e = 0; e < experts; ++e)
    MOE_ECHO_CHECK(n[size_t(e)] > 0 || w[size_t(e)] == 0,
                   "expert " << e << " has " << w[size_t(e)] << " rows but no replica");
  // Even split, the remainder to the replicas in slot order (lowest rank first).
  std::vector<int32_t> seen(size_t(experts), 0);
  std::vector<int64_t> load(size_t(R), 0);
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < P; ++s) {
      const int e = placement.slot_expert[size_t(r) * P + s];
      if (e < 0) continue;
      load[size_t(r)] += even_part(w[size_t(e)], n[size_t(e)], seen[size_t(e)]++);
    }
  return load;
}

}  // namespace moe_echo
