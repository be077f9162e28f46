// The device planner's warp code: placement and refinement of src/echo/planner_core.hpp on one
// warp (src/cuda/planner.cu; tests/cpu/planner_warp_test.cpp runs it on host threads). PlannerWarp
// is a PlannerCore (the same state, the same scratch, PlannerCore::bytes) with the warp-parallel
// twins of place_clones and refine. Lane 0 alone changes the state, with the core's own
// build_group, try_clone (its re-splits in registers, resplit_fast) and restore_best, and all lanes
// share the searches between the changes: the busiest rank, the target ranks, the candidates and
// their order, the fewest links a budget raise needs, the load floor, the cloned experts; and the
// resets between the two greedy runs and the copies of a kept plan, over disjoint entries. Each
// search finds what the host's loop finds (the same minimum or maximum, ties to the lowest
// index), so both plans are equal bit for bit.
#pragma once

#include <cstdint>

#include "echo/planner_core.hpp"

namespace moe_echo::planner_core {

// The warp-cooperative functions below take a warp as W: W::kLanes lanes (a power of two, at
// most 32), wp.lane, wp.sync() (a barrier of all lanes that orders their memory accesses),
// wp.shfl(v, src), wp.shfl_xor(v, mask) and wp.ballot(pred) over all lanes. Every lane calls
// them together, in uniform control flow.

// The best of each lane's (key, idx, extra), to every lane: the largest key, ties to the lowest
// idx; idx < 0 marks a lane with nothing. idx is unique among the lanes that have something, so
// every lane ends with the same triple.
template <class W>
MOE_ECHO_D void warp_best(const W& wp, int64_t& key, int& idx, int& extra) {
  for (int m = W::kLanes / 2; m > 0; m /= 2) {
    const int64_t k2 = wp.shfl_xor(key, m);
    const int i2 = wp.shfl_xor(idx, m);
    const int x2 = wp.shfl_xor(extra, m);
    if (i2 >= 0 && (idx < 0 || k2 > key || (k2 == key && i2 < idx))) {
      key = k2;
      idx = i2;
      extra = x2;
    }
  }
}

// Appends the items of this round whose lane has `keep` to a list at `n` (lanes in order), and
// returns the new length; `slot` gets this lane's position when it keeps its item.
template <class W>
MOE_ECHO_D int warp_append(const W& wp, bool keep, int n, int& slot) {
  const uint32_t kept = wp.ballot(keep);
  slot = n + bit_count(kept & ((1u << wp.lane) - 1u));
  return n + bit_count(kept);
}

// The smallest (warp_min) and largest (warp_max) of the lanes' values, and their sum (warp_sum),
// to every lane.
template <class W, class T>
MOE_ECHO_D T warp_min(const W& wp, T v) {
  for (int m = W::kLanes / 2; m > 0; m /= 2) v = min_of(v, wp.shfl_xor(v, m));
  return v;
}
template <class W, class T>
MOE_ECHO_D T warp_max(const W& wp, T v) {
  for (int m = W::kLanes / 2; m > 0; m /= 2) v = max_of(v, wp.shfl_xor(v, m));
  return v;
}
template <class W, class T>
MOE_ECHO_D T warp_sum(const W& wp, T v) {
  for (int m = W::kLanes / 2; m > 0; m /= 2) v += wp.shfl_xor(v, m);
  return v;
}

// PlannerCore with the device's placement and refinement on one warp. Lane 0 makes every change
// to the planning state but the resets between runs; the other lanes write only their own
// entries of a step's lists (candidates, cloned experts), of a kept plan (its ranks) and of a
// reset, and a lane reads what another wrote only after a wp.sync() that follows the write. Each
// lane has its own PlannerWarp: only lane 0's scalars (n_touched, the queue, the journal, trial)
// are kept; those other lanes need are broadcast (n_group, max_links) or advanced by every lane
// alike (stamp, the budget, the kept cost).
struct PlannerWarp : PlannerCore {
  // Fewest links + 1 of a free target (need_target, set by find_targets) and of a candidate's
  // home (need_home, set by collect_candidates) in this step, on every lane: raise_budget's
  // inputs at a stop.
  int need_target = 0, need_home = 0;

  // Lists in `targets` the eligible target ranks of this step (a free spare slot, under the
  // budget, outside the group) in the order of the host's target search, least loaded first,
  // ties to the lowest rank: the first clone_limit + 1 of them, or all when fewer. A candidate
  // holds at most clone_limit replicas, so its target (the first of them without a replica of
  // it) is in the list when it has one. Returns the count; 0 also when the least loaded is
  // within 1 or `threshold` rows of `level`: the host skips a candidate with such a target, and
  // every target is at least as loaded as the first, so then no trial runs in this step.
  template <class W>
  MOE_ECHO_D int find_targets(const W& wp, int64_t level, int64_t threshold) {
    int n = 0, last = -1, need = link_limit() + 1;
    int64_t last_load = 0;
    while (n <= clone_limit) {
      int64_t key = 0;  // -load: warp_best keeps the largest
      int r_best = -1, unused = 0;
      for (int r = wp.lane; r < R; r += W::kLanes) {
        if (spare_used[r] >= S || group_stamp[r] == stamp) continue;
        if (n == 0) need = min_of(need, links[r] + 1);
        if (links[r] >= budget) continue;
        const int64_t l = load[r];
        if (last >= 0 && (l < last_load || (l == last_load && r <= last))) continue;  // listed
        if (r_best < 0 || -l > key) {  // ascending r: the first of equal loads stays
          key = -l;
          r_best = r;
        }
      }
      warp_best(wp, key, r_best, unused);
      if (r_best < 0) break;
      if (n == 0 && (-key >= level - 1 || level + key <= threshold)) break;
      if (wp.lane == 0) targets[n] = r_best;
      ++n;
      last = r_best;
      last_load = -key;
    }
    need_target = warp_min(wp, need);
    wp.sync();
    return n;
  }

  // The candidates of this step with their targets, in cand / cand_score / cand_target (in no
  // particular order): the experts the host's candidate loop keeps (clones left, more than
  // `threshold` rows in the group, their home under the budget), less those whose trial the host
  // would skip (no target, a target within 1 or `threshold` rows of `level`, or a trial made
  // before the last raise of the budget). Those skips hold for the whole step: a trial that
  // fails is undone, so loads and replicas are those of the step's start at every try. Also sets
  // need_home. The lanes visit the group's experts as the host does, each member's home experts
  // and filled spare slots (epr + S slots per member, the unfilled ones empty); an expert with
  // replicas on several members counts once, at the first of them in rank order.
  template <class W>
  MOE_ECHO_D int collect_candidates(const W& wp, int64_t level, int64_t threshold, int n_targets) {
    const int per = epr + S, slots = n_group * per;
    int n = 0, need = link_limit() + 1;
    for (int round = 0; round < slots; round += W::kLanes) {
      const int t = round + wp.lane;
      bool keep = false;
      int b = -1, x = -1, target = -1;
      int64_t in_group = 0;
      if (t < slots) {
        b = group[t / per];
        const int i = t % per;
        if (i < epr)
          x = b * epr + i;
        else if (i - epr < spare_used[b])
          x = spare[int64_t(b) * S + i - epr];
      }
      if (x >= 0 && nrep[x] <= clone_limit) {
        const int64_t at = int64_t(x) * M;
        int first = -1;
        for (int j = 0; j < nrep[x]; ++j) {
          const int r = rep_rank[at + j];
          if (group_stamp[r] != stamp) continue;
          if (first < 0) first = r;
          in_group += rep_rows[at + j];
        }
        if (first == b && in_group > threshold) {
          need = min_of(need, links[x / epr] + 1);
          for (int k = 0; k < n_targets && target < 0 && links[x / epr] < budget; ++k) {
            const int r = targets[k];
            bool holds = false;
            for (int j = 0; j < nrep[x]; ++j) holds |= rep_rank[at + j] == r;
            if (!holds) target = r;
          }
          keep = target >= 0 && load[target] < level - 1 && level - load[target] > threshold &&
                 !tried_before(x, target);
        }
      }
      int slot = 0;
      n = warp_append(wp, keep, n, slot);
      if (keep) {
        cand[slot] = x;
        cand_score[slot] = in_group;
        cand_target[slot] = target;
      }
    }
    need_home = warp_min(wp, need);
    wp.sync();
    return n;
  }

  // greedy on a warp: the same trials in the same order, so the same clones, the same budget
  // raises and the same kept plan. Lane 0 changes the state; every lane holds the scalars
  // (max_links broadcast after each kept clone) and keeps its share of a plan.
  template <class W>
  MOE_ECHO_D int64_t greedy_warp(const W& wp, int64_t clone_cost_rows, bool budgeted,
                                 int64_t floor_rows) {
    const int64_t threshold = budgeted ? 0 : clone_cost_rows;
    max_links = 0;
    budget = budgeted ? 1 : link_limit();
    tried_below = 0;
    int64_t free_slots = int64_t(R) * S, level = 0;
    for (bool first = true;; first = false) {
      ++stamp;
      int top = -1, unused = 0;
      level = 0;
      for (int r = wp.lane; r < R; r += W::kLanes)
        if (top < 0 || load[r] > level) {
          level = load[r];
          top = r;
        }
      warp_best(wp, level, top, unused);
      if (budgeted && first) {
        keep_if_best(level, clone_cost_rows, wp.lane, W::kLanes);  // no clones
        wp.sync();
      }
      if (free_slots == 0 || level == 0) break;
      if (budgeted && floor_rows + clone_cost_rows * max_links >= best_cost) break;
      if (wp.lane == 0) build_group(top, level);
      wp.sync();
      n_group = wp.shfl(n_group, 0);
      const int n_targets = find_targets(wp, level, threshold);
      if (n_targets == 0 && !budgeted) break;
      n_cand = collect_candidates(wp, level, threshold, n_targets);
      // Trials hottest first, ties by the lowest expert index: each round picks the best
      // candidate after the one tried last.
      bool placed = false;
      int64_t last_score = 0;
      int last = -1;
      while (!placed) {
        int64_t score = 0;
        int x = -1, at = -1;
        for (int i = wp.lane; i < n_cand; i += W::kLanes) {
          const int64_t sc = cand_score[i];
          const int cx = cand[i];
          if (last >= 0 && (sc > last_score || (sc == last_score && cx <= last))) continue;
          if (x < 0 || sc > score || (sc == score && cx < x)) {
            score = sc;
            x = cx;
            at = i;
          }
        }
        warp_best(wp, score, x, at);
        if (x < 0) break;
        last_score = score;
        last = x;
        int kept = 0;
        if (wp.lane == 0) kept = try_clone<true>(x, cand_target[at], level, threshold);
        wp.sync();
        placed = wp.shfl(kept, 0) != 0;
      }
      if (placed) {
        max_links = wp.shfl(max_links, 0);
        --free_slots;
        tried_below = 0;
        best_here = false;
        continue;
      }
      if (!budgeted) break;
      keep_if_best(level, clone_cost_rows, wp.lane, W::kLanes);
      wp.sync();
      if (!raise_budget(need_home, need_target, floor_rows, clone_cost_rows)) break;
    }
    wp.sync();
    return level;
  }

  // place_clones on a warp: the floor's sums over the lanes, the reset over the lanes, the
  // return to the kept plan on lane 0.
  template <class W>
  MOE_ECHO_D void place_clones_warp(const W& wp, int64_t clone_cost_rows) {
    if (S == 0 || clone_limit == 0) return;
    const int64_t cost = capped(clone_cost_rows);
    has_best = best_here = false;
    const int64_t level = greedy_warp(wp, cost, false, 0);
    if (cost == 0) return;
    keep_if_best(level, cost, wp.lane, W::kLanes);
    int64_t total = 0, top_rows = 0;
    floor_part(wp.lane, W::kLanes, total, top_rows);
    const int64_t floor_rows = floor_of(warp_sum(wp, total), warp_max(wp, top_rows));
    wp.sync();
    reset_experts(wp.lane, W::kLanes);
    wp.sync();
    init_ranks(wp.lane, W::kLanes);
    wp.sync();
    keep_if_best(greedy_warp(wp, cost, true, floor_rows), cost, wp.lane, W::kLanes);
    wp.sync();
    if (!best_here) {
      if (wp.lane == 0) restore_best();
      max_links = snap_max_links;
      best_here = true;
      wp.sync();
    }
  }

  // refine on a warp: the lanes list the cloned experts in ascending order (refills keep every
  // nrep), lane 0 re-splits them pass after pass.
  template <class W>
  MOE_ECHO_D void refine_warp(const W& wp) {
    wp.sync();
    ++trial;
    n_touched = 0;
    int n = 0;
    for (int round = 0; round < E; round += W::kLanes) {
      const int e = round + wp.lane;
      const bool cloned = e < E && nrep[e] > 1;
      int slot = 0;
      n = warp_append(wp, cloned, n, slot);
      if (cloned) cand[slot] = e;
    }
    wp.sync();
    if (wp.lane == 0)
      for (int pass = 0; pass < kMaxRefinePasses; ++pass) {
        bool changed = false;
        for (int i = 0; i < n; ++i) changed |= resplit_fast(cand[i], -1, false);
        if (!changed) break;
      }
    wp.sync();
  }
};

}  // namespace moe_echo::planner_core
