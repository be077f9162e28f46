// Layout: where every (token, k) row of this rank goes, derived from the routing map C and the
// plan alone, so every rank computes the same receive layout without further exchange.
//
// Receive layout of rank d: its slots in order (home slots, then spare slots); inside a slot,
// rows grouped by source rank in rank order; inside a source, in (token, k) order. Group offsets
// are global over rounds: round r holds receive rows [r * capacity, (r + 1) * capacity).
#include <algorithm>
#include <vector>

#include "cpu/cpu_ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cpu {

RowRange group_rows(const GroupWindow& w, int g) {
  const int64_t lo = std::max<int64_t>(w.group_offsets[g], w.row_lo);
  const int64_t hi = std::min<int64_t>(w.group_offsets[g + 1], w.row_lo + w.rows);
  if (hi <= lo) return {0, 0};
  return {lo - w.row_lo, hi - w.row_lo};
}

int64_t valid_rows(const GroupWindow& w) {
  const int64_t total = w.group_offsets[w.groups];
  return std::clamp<int64_t>(total - w.row_lo, 0, w.rows);
}

void layout(const LayoutArgs& a) {
  const PlannerConfig& cfg = a.planner;
  const int R = cfg.ranks, E = cfg.experts, M = cfg.max_replicas(), EPR = cfg.experts_per_rank();
  const int S = cfg.spare_slots;
  MOE_ECHO_CHECK(a.slots == EPR + S, "slots " << a.slots << " != E/R + S = " << EPR + S);
  const int32_t* C = a.routing_map.as<int32_t>();
  const PlanView plan = plan_view(a.plan.as<int32_t>(), cfg);
  int32_t* assign = a.assign.as<int32_t>();
  compute_assignment(C, cfg, plan, assign);

  // Rows of every (rank, slot), then the first receive row of every (rank, slot).
  std::vector<int64_t> slot_base(size_t(R) * size_t(a.slots + 1), 0);
  auto base = [&](int r, int g) -> int64_t& {
    return slot_base[size_t(r) * size_t(a.slots + 1) + size_t(g)];
  };
  for (int e = 0; e < E; ++e)
    for (int j = 0; j < M; ++j) {
      const int r = plan.replica_rank[e * M + j];
      if (r < 0) continue;
      base(r, plan.replica_slot[e * M + j] + 1) += plan.replica_rows[e * M + j];
    }
  int32_t* rank_rows = a.rank_rows.as<int32_t>();
  int64_t max_rows = 0;
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < a.slots; ++g) base(r, g + 1) += base(r, g);
    rank_rows[r] = int32_t(base(r, a.slots));
    max_rows = std::max(max_rows, base(r, a.slots));
  }
  int32_t* offsets = a.group_offsets.as<int32_t>();
  for (int g = 0; g <= a.slots; ++g) offsets[g] = int32_t(base(a.rank, g));

  const int64_t rounds = a.round_active.size(0);
  int32_t* active = a.round_active.as<int32_t>();
  for (int64_t r = 0; r < rounds; ++r) active[r] = max_rows > r * a.capacity ? 1 : 0;
  MOE_ECHO_CHECK(max_rows <= rounds * a.capacity, "receive rows " << max_rows << " exceed "
                                                                  << rounds << " rounds of "
                                                                  << a.capacity);

  // First receive row, on the replica's rank, of this source's rows for replica j of e.
  const int me = a.rank;
  std::vector<int64_t> first_row(size_t(E) * size_t(M), 0);
  for (int e = 0; e < E; ++e)
    for (int j = 0; j < M; ++j) {
      const int r = plan.replica_rank[e * M + j];
      if (r < 0) continue;
      int64_t row = base(r, plan.replica_slot[e * M + j]);
      for (int src = 0; src < me; ++src) row += assign[(size_t(src) * E + e) * M + j];
      first_row[size_t(e) * M + j] = row;
    }

  // Walk this rank's (token, k) rows in order; the i-th row of expert e goes to the replica whose
  // share of this source's rows covers position i.
  const int64_t n = a.topk_idx.numel();
  const int32_t* idx = a.topk_idx.as<int32_t>();
  int32_t* dest_rank = a.dest_rank.as<int32_t>();
  int32_t* dest_row = a.dest_row.as<int32_t>();
  std::vector<int32_t> replica(static_cast<size_t>(E), 0), used(static_cast<size_t>(E), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int e = idx[i];
    MOE_ECHO_CHECK(e >= 0 && e < E, "expert index " << e << " outside [0, " << E << ")");
    int& j = replica[size_t(e)];
    while (j < M && used[size_t(e)] >= assign[(size_t(me) * E + e) * M + j]) {
      used[size_t(e)] = 0;
      ++j;
    }
    MOE_ECHO_CHECK(j < M, "routing map disagrees with the routes: expert "
                              << e << " got more rows from rank " << me << " than C says");
    dest_rank[i] = plan.replica_rank[e * M + j];
    dest_row[i] = int32_t(first_row[size_t(e) * M + j] + used[size_t(e)]);
    ++used[size_t(e)];
  }
}

void chunk_plan(const ChunkPlanArgs& a) {
  check_chunk_plan(a);
  const int64_t R = a.rank_rows.size(0), C = a.bounds.size(1) - 1, G1 = a.group_offsets.size(0);
  int32_t* bounds = a.bounds.as<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n =
        std::clamp<int64_t>(int64_t(a.rank_rows.as<int32_t>()[r]) - a.row_lo, 0, a.capacity);
    for (int64_t c = 0; c <= C; ++c) bounds[r * (C + 1) + c] = int32_t(c * n / C);
  }
  const int32_t* mine = bounds + int64_t(a.rank) * (C + 1);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t g = 0; g < G1; ++g)
      a.offsets.as<int32_t>()[c * G1 + g] = int32_t(std::clamp<int64_t>(
          a.group_offsets.as<int32_t>()[g], a.row_lo + mine[c], a.row_lo + mine[c + 1]));
}

}  // namespace moe_echo::cpu
