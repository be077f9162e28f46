// The device planner's warp code: placement and refinement of src/echo/planner_core.hpp on one
// warp (src/cuda/planner.cu; tests/cpu/planner_warp_test.cpp runs it on host threads). PlannerWarp
// is a PlannerCore (the same state, the same scratch, PlannerCore::bytes) with the warp-parallel
// twins of place_clones and refine. Lane 0 alone changes the state, with the core's own
// build_group and try_clone (its re-splits in registers, resplit_fast), and all lanes share the
// searches between the changes: the busiest rank, the target ranks, the candidates and their
// order, the cloned experts. Each search finds what the host's loop finds (the same minimum or
// maximum, ties to the lowest index), so both plans are equal bit for bit.
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

// PlannerCore with the device's placement and refinement on one warp. Lane 0 makes every change
// to the planning state; the other lanes write only their own entries of a step's lists
// (candidates, cloned experts), and a lane reads what another wrote only after a wp.sync() that
// follows the write. Each lane has its own PlannerWarp: only lane 0's scalars (n_touched, the
// queue, the journal, trial) are kept; those other lanes need are broadcast (n_group) or advanced
// by every lane alike (stamp).
struct PlannerWarp : PlannerCore {
  // Lists in `targets` the eligible target ranks of this step (a free spare slot, outside the
  // group) in the order of the host's target search, least loaded first, ties to the lowest rank:
  // the first clone_limit + 1 of them, or all when fewer. A candidate holds at most clone_limit
  // replicas, so its target (the first of them without a replica of it) is in the list when it
  // has one. Returns the count; 0 also when the least loaded is within 1 or clone_cost_rows rows
  // of `level`: the host skips a candidate with such a target, and every target is at least as
  // loaded as the first, so then no trial runs in this step.
  template <class W>
  MOE_ECHO_D int find_targets(const W& wp, int64_t level, int64_t clone_cost_rows) {
    int n = 0, last = -1;
    int64_t last_load = 0;
    while (n <= clone_limit) {
      int64_t key = 0;  // -load: warp_best keeps the largest
      int r_best = -1, unused = 0;
      for (int r = wp.lane; r < R; r += W::kLanes) {
        if (spare_used[r] >= S || group_stamp[r] == stamp) continue;
        const int64_t l = load[r];
        if (last >= 0 && (l < last_load || (l == last_load && r <= last))) continue;  // listed
        if (r_best < 0 || -l > key) {  // ascending r: the first of equal loads stays
          key = -l;
          r_best = r;
        }
      }
      warp_best(wp, key, r_best, unused);
      if (r_best < 0) break;
      if (n == 0 && (-key >= level - 1 || level + key <= clone_cost_rows)) break;
      if (wp.lane == 0) targets[n] = r_best;
      ++n;
      last = r_best;
      last_load = -key;
    }
    wp.sync();
    return n;
  }

  // The candidates of this step with their targets, in cand / cand_score / cand_target (in no
  // particular order): the experts the host's candidate loop keeps (clones left, more than
  // clone_cost_rows rows in the group), less those whose target the host would skip (none, or
  // within 1 or clone_cost_rows rows of `level`). Those skips hold for the whole step: a trial
  // that fails is undone, so loads and replicas are those of the step's start at every try.
  // The lanes visit the group's experts as the host does, each member's home experts and filled
  // spare slots (epr + S slots per member, the unfilled ones empty); an expert with replicas on
  // several members counts once, at the first of them in rank order.
  template <class W>
  MOE_ECHO_D int collect_candidates(const W& wp, int64_t level, int64_t clone_cost_rows,
                                    int n_targets) {
    const int per = epr + S, slots = n_group * per;
    int n = 0;
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
        if (first == b && in_group > clone_cost_rows) {
          for (int k = 0; k < n_targets && target < 0; ++k) {
            const int r = targets[k];
            bool holds = false;
            for (int j = 0; j < nrep[x]; ++j) holds |= rep_rank[at + j] == r;
            if (!holds) target = r;
          }
          keep = target >= 0 && load[target] < level - 1 && level - load[target] > clone_cost_rows;
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
    wp.sync();
    return n;
  }

  // place_clones on a warp: the same trials in the same order, so the same clones.
  template <class W>
  MOE_ECHO_D void place_clones_warp(const W& wp, int64_t clone_cost_rows) {
    if (S == 0 || clone_limit == 0) return;
    int64_t free_slots = int64_t(R) * S;
    while (free_slots > 0) {
      ++stamp;
      int64_t level = 0;
      int top = -1, unused = 0;
      for (int r = wp.lane; r < R; r += W::kLanes)
        if (top < 0 || load[r] > level) {
          level = load[r];
          top = r;
        }
      warp_best(wp, level, top, unused);
      if (level == 0) break;
      if (wp.lane == 0) build_group(top, level);
      wp.sync();
      n_group = wp.shfl(n_group, 0);
      const int n_targets = find_targets(wp, level, clone_cost_rows);
      if (n_targets == 0) break;
      n_cand = collect_candidates(wp, level, clone_cost_rows, n_targets);
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
        if (wp.lane == 0) kept = try_clone<true>(x, cand_target[at], level, clone_cost_rows);
        wp.sync();
        placed = wp.shfl(kept, 0) != 0;
      }
      if (!placed) break;
      --free_slots;
    }
    wp.sync();
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
