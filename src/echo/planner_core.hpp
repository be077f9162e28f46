// The ECHO planner's core, written once for the host (src/echo/planner.cpp) and the device
// (src/cuda/planner.cu): the same steps over the same flat arrays, so both produce the same plan
// bit for bit. The algorithm and its invariants are described in planner.cpp.
//
// No allocation, no exceptions, no standard library containers: every array lives in a caller's
// scratch buffer (PlannerCore::bytes(cfg) bytes, 8-byte aligned) bound by bind().
//
// The host runs init_experts, init_ranks, place_clones (its greedy runs, with reset_experts and
// init_ranks between them), refine, align_blocks and write on one thread: this file is the
// sequential specification. The device makes the same state changes in the same order but spreads
// the scans over threads: the initialisation and the plan over a whole block (init_experts /
// init_ranks / write_part over disjoint indices, a barrier between them), and placement and
// refinement on one warp with the warp-parallel twins of the searches in planner_warp.hpp
// (PlannerWarp), which change the state only through the functions here (its re-splits in
// registers, resplit_regs: the same split as water_fill, found without sorting).
#pragma once

#include <cstddef>
#include <cstdint>

#include "moe_echo/planner.hpp"

#if defined(__CUDACC__)
#define MOE_ECHO_HD __host__ __device__
#define MOE_ECHO_D __device__
#else
#define MOE_ECHO_HD
#define MOE_ECHO_D
#endif
// Loop unrolling on the device (register arrays need it; for loads, more of them in flight).
#if defined(__CUDA_ARCH__)
#define MOE_ECHO_PRAGMA(x) _Pragma(#x)
#define MOE_ECHO_UNROLL MOE_ECHO_PRAGMA(unroll)
#define MOE_ECHO_UNROLL_BY(n) MOE_ECHO_PRAGMA(unroll n)
#else
#define MOE_ECHO_UNROLL
#define MOE_ECHO_UNROLL_BY(n)
#endif

namespace moe_echo::planner_core {

constexpr int kMaxRefinePasses = 64;

template <class T>
MOE_ECHO_HD inline T min_of(T a, T b) {
  return b < a ? b : a;
}
template <class T>
MOE_ECHO_HD inline T max_of(T a, T b) {
  return a < b ? b : a;
}

// Integer water-filling: split `rows` over k replicas, given in ascending rank order, whose ranks
// carry `base[i]` rows of other work, so that the largest total base[i] + out[i] is as small as
// possible. Finds the largest level L with sum max(0, L - base[i]) <= rows, gives every replica
// max(0, L - base[i]), then one more row to each replica at the level in index (= rank) order
// until none is left: the lowest rank gets the remainder first. `order` is scratch for k indices.
// The result is the integer min-max split.
MOE_ECHO_HD inline void water_fill(int k, const int64_t* base, int64_t rows, int64_t* out,
                                   int* order) {
  // Indices sorted by base (stable: equal bases keep rank order). Insertion sort: k is small.
  for (int i = 0; i < k; ++i) {
    int j = i;
    while (j > 0 && base[order[j - 1]] > base[i]) {
      order[j] = order[j - 1];
      --j;
    }
    order[j] = i;
  }
  // On [base_(m-1), base_m] (the m smallest bases) the poured rows are m * L - prefix_m.
  int64_t prefix = 0, level = base[order[0]];
  for (int m = 1; m <= k; ++m) {
    prefix += base[order[m - 1]];
    level = (rows + prefix) / m;
    if (m == k || level < base[order[m]]) break;
  }
  int64_t left = rows;
  for (int i = 0; i < k; ++i) {
    out[i] = base[i] < level ? level - base[i] : 0;
    left -= out[i];
  }
  // Fewer rows are left than replicas at the level (base[i] <= L); lowest rank first.
  for (int i = 0; i < k && left > 0; ++i)
    if (base[i] <= level) {
      out[i] += 1;
      --left;
    }
}

// water_fill for k <= K replicas in registers, without sorting (the device's hot path). The
// level water_fill finds is the largest L whose fill sum max(0, L - base[i]) is at most `rows`,
// and that fill is max over m of (m * L - the m smallest bases' sum), so L is the smallest
// (rows + the m smallest bases' sum) / m over m = 1..k; the m smallest are, for each i, the bases
// before it in (base, index) order and itself. The split from the level is water_fill's.
template <int K>
MOE_ECHO_HD inline void water_fill_regs(int k, const int64_t (&base)[K], int64_t rows,
                                        int64_t (&out)[K]) {
  int64_t level = 0;
  MOE_ECHO_UNROLL
  for (int i = 0; i < K; ++i) {
    if (i >= k) continue;
    int m = 0;
    int64_t sum = 0;
    MOE_ECHO_UNROLL
    for (int j = 0; j < K; ++j)
      if (j < k && (base[j] < base[i] || (base[j] == base[i] && j <= i))) {
        ++m;
        sum += base[j];
      }
    const int64_t l = (rows + sum) / m;
    level = i == 0 || l < level ? l : level;
  }
  int64_t left = rows;
  MOE_ECHO_UNROLL
  for (int i = 0; i < K; ++i) {
    out[i] = i < k && base[i] < level ? level - base[i] : 0;
    left -= out[i];
  }
  MOE_ECHO_UNROLL
  for (int i = 0; i < K; ++i)
    if (i < k && left > 0 && base[i] <= level) {
      out[i] += 1;
      --left;
    }
}

// Index of the lowest set bit of v (v != 0).
MOE_ECHO_HD inline int lowest_bit(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __ffs(v) - 1;
#else
  return __builtin_ctz(v);
#endif
}

MOE_ECHO_HD inline int bit_count(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __popc(v);
#else
  return __builtin_popcount(v);
#endif
}

// Working state of one planning run, in flat arrays. Replicas of expert e are kept sorted by rank
// in rep_rank[e*M .. e*M + nrep[e]); the home replica is the one on home_rank(e).
struct PlannerCore {
  int R = 0, E = 0, S = 0, M = 0, epr = 0, clone_limit = 0, max_resplits = 0, row_block = 1;
  int64_t *w = nullptr, *load = nullptr, *rep_rows = nullptr;
  int32_t *rep_rank = nullptr, *nrep = nullptr, *spare = nullptr, *spare_used = nullptr;
  // Clone links per rank: the clones it hosts plus the clones of its home experts elsewhere (each
  // moves one expert's weights and gradient over the rank's link); max_links is their maximum.
  int32_t* links = nullptr;
  int32_t max_links = 0;
  // Placement's link budget: a clone may not give any rank more than `budget` links. After a stop
  // the trials made under the budget before it (`tried_below`) are not made again.
  int32_t budget = 0, tried_below = 0;
  // The cheapest plan seen at a stop (best_cost: its busiest load plus clone_cost_rows per link
  // of its busiest-linked rank), kept to return to: loads, links, slot use, and per spare slot
  // its clone and that clone's rows. best_here: the state is that plan.
  bool has_best = false, best_here = false;
  int64_t best_cost = 0;
  int32_t snap_max_links = 0;
  int64_t *snap_load = nullptr, *snap_rows = nullptr;
  int32_t *snap_links = nullptr, *snap_used = nullptr, *snap_spare = nullptr;
  // Per rank, a bit per home expert that has clones (nrep > 1): `words` words per rank. Lets the
  // hot loops visit a rank's cloned experts without scanning all of its home experts.
  int words = 0;
  uint32_t* multi = nullptr;
  // Scratch of one water-fill (k <= M replicas).
  int64_t *sc_base = nullptr, *sc_rows = nullptr;
  int32_t* sc_rank = nullptr;
  int* order = nullptr;
  // Scratch of the greedy step: epochs instead of clearing per step (`stamp` marks the busiest
  // group and the candidates of one step, `trial` the ranks touched and experts queued by one
  // trial clone).
  int32_t stamp = 0, trial = 0;
  int32_t *group_stamp = nullptr, *touched_stamp = nullptr, *cand_stamp = nullptr,
          *replica_stamp = nullptr, *queued = nullptr;
  // Lists: group and touched hold distinct ranks (<= R), cand distinct experts (<= E); queue is a
  // FIFO ring of E entries (an expert is queued again only after it was taken out, so at most E
  // wait at once).
  int32_t *group = nullptr, *touched = nullptr, *cand = nullptr, *queue = nullptr;
  int n_group = 0, n_touched = 0, n_cand = 0;
  // The device's step: the ranks a clone may go to (clone_limit + 1 at most, least loaded first)
  // and each candidate's target among them.
  int32_t *targets = nullptr, *cand_target = nullptr;
  int64_t q_head = 0, q_tail = 0;
  int64_t* cand_score = nullptr;
  // Undo log of a trial clone: per change, the expert's replica list and its ranks' loads before.
  bool journaling = false;
  int j_count = 0;
  int32_t *j_expert = nullptr, *j_nrep = nullptr, *j_rank = nullptr;
  int64_t *j_rows = nullptr, *j_load = nullptr;

  // Binds the arrays to `base` (nullptr: only measures); returns the bytes used.
  MOE_ECHO_HD size_t bind(const PlannerConfig& cfg, void* base) {
    R = cfg.ranks;
    E = cfg.experts;
    S = cfg.spare_slots;
    M = 1 + cfg.max_clones;  // cfg.max_replicas(), written out for the device
    epr = cfg.experts / cfg.ranks;
    clone_limit = min_of(cfg.max_clones, cfg.ranks - 1);
    max_resplits = 2 * M + 16;
    row_block = cfg.row_block;
    size_t at = 0;
    char* b = static_cast<char*>(base);
    auto take = [&](auto& p, int64_t n) { take_array(p, n, b, at); };
    const int64_t EM = int64_t(E) * M, J = int64_t(max_resplits) + 1;
    take(w, E);
    take(load, R);
    take(rep_rows, EM);
    take(rep_rank, EM);
    take(nrep, E);
    take(spare, int64_t(R) * S);
    take(spare_used, R);
    take(links, R);
    take(snap_load, R);
    take(snap_rows, int64_t(R) * S);
    take(snap_links, R);
    take(snap_used, R);
    take(snap_spare, int64_t(R) * S);
    words = (epr + 31) / 32;
    take(multi, int64_t(R) * words);
    take(sc_base, M + 1);
    take(sc_rows, M + 1);
    take(sc_rank, M + 1);
    take(order, M + 1);
    take(group_stamp, R);
    take(touched_stamp, R);
    take(cand_stamp, E);
    take(replica_stamp, R);
    take(queued, E);
    take(group, R);
    take(touched, R);
    take(cand, E);
    take(queue, E);
    take(cand_score, E);
    take(targets, R);
    take(cand_target, E);
    take(j_expert, J);
    take(j_nrep, J);
    take(j_rank, J * M);
    take(j_rows, J * M);
    take(j_load, J * M);
    return at;
  }
  static size_t bytes(const PlannerConfig& cfg) {
    PlannerCore c;
    return c.bind(cfg, nullptr);
  }

  // Expert loads from the routing map and the no-clone state, for experts first, first + step, ...
  MOE_ECHO_HD void init_experts(const int32_t* routing_map, int first, int step) {
    for (int e = first; e < E; e += step) {
      int64_t sum = 0;
      MOE_ECHO_UNROLL_BY(16)
      for (int src = 0; src < R; ++src) sum += routing_map[int64_t(src) * E + e];
      w[e] = sum;
      go_home(e);
    }
  }
  // The no-clone state of experts first, first + step, ... again (w kept), for a second run.
  MOE_ECHO_HD void reset_experts(int first, int step) {
    for (int e = first; e < E; e += step) go_home(e);
  }
  // Expert e on its home rank alone, with all its rows.
  MOE_ECHO_HD void go_home(int e) {
    const int64_t at = int64_t(e) * M;
    for (int j = 0; j < M; ++j) {
      rep_rank[at + j] = j == 0 ? e / epr : -1;
      rep_rows[at + j] = j == 0 ? w[e] : 0;
    }
    nrep[e] = 1;
    cand_stamp[e] = 0;
    queued[e] = 0;
  }
  // Rank loads and slots, for ranks first, first + step, ... (after every init_experts or
  // reset_experts). With
  // load_before, also writes the plan's loads before cloning (the device's write_part does not).
  MOE_ECHO_HD void init_ranks(int first, int step, int32_t* load_before = nullptr) {
    for (int r = first; r < R; r += step) {
      int64_t sum = 0;
      for (int e = r * epr; e < (r + 1) * epr; ++e) sum += w[e];
      load[r] = sum;
      if (load_before) load_before[r] = int32_t(sum);
      spare_used[r] = 0;
      links[r] = 0;
      group_stamp[r] = 0;
      touched_stamp[r] = 0;
      replica_stamp[r] = 0;
      for (int s = 0; s < S; ++s) spare[int64_t(r) * S + s] = -1;
      for (int i = 0; i < words; ++i) multi[int64_t(r) * words + i] = 0;
    }
  }

  MOE_ECHO_HD int64_t rows_on(int e, int r) const {
    for (int j = 0; j < nrep[e]; ++j)
      if (rep_rank[int64_t(e) * M + j] == r) return rep_rows[int64_t(e) * M + j];
    return 0;
  }

  // Keeps expert e's bit in `multi` equal to nrep[e] > 1.
  MOE_ECHO_HD void mark(int e) {
    const int j = e % epr;
    uint32_t& word = multi[int64_t(e / epr) * words + j / 32];
    const uint32_t bit = 1u << (j % 32);
    word = nrep[e] > 1 ? (word | bit) : (word & ~bit);
  }

  // Calls f(e), in the order of for_experts_on, for every expert with clones that has a replica
  // on rank r: its cloned home experts, then its spare slots.
  template <class F>
  MOE_ECHO_HD void for_cloned_on(int r, F&& f) const {
    for (int i = 0; i < words; ++i)
      for (uint32_t v = multi[int64_t(r) * words + i]; v != 0; v &= v - 1)
        f(r * epr + i * 32 + lowest_bit(v));
    for (int s = 0; s < spare_used[r]; ++s) f(spare[int64_t(r) * S + s]);
  }

  // Calls f(e) for every expert with a replica on rank r: home experts, then spare slots.
  template <class F>
  MOE_ECHO_HD void for_experts_on(int r, F&& f) const {
    for (int e = r * epr; e < (r + 1) * epr; ++e) f(e);
    for (int s = 0; s < spare_used[r]; ++s) f(spare[int64_t(r) * S + s]);
  }

  // Water-fills expert e over its replicas plus (when extra >= 0) a new one on rank `extra`.
  // Leaves ranks (ascending), bases and rows in the sc_* scratch; returns the count.
  MOE_ECHO_HD int trial_fill(int e, int extra) {
    int k = 0;
    const int64_t at = int64_t(e) * M;
    bool inserted = extra < 0;
    for (int j = 0; j < nrep[e]; ++j) {
      const int r = rep_rank[at + j];
      if (!inserted && extra < r) {
        sc_rank[k] = extra;
        sc_base[k] = load[extra];
        ++k;
        inserted = true;
      }
      sc_rank[k] = r;
      sc_base[k] = load[r] - rep_rows[at + j];
      ++k;
    }
    if (!inserted) {
      sc_rank[k] = extra;
      sc_base[k] = load[extra];
      ++k;
    }
    water_fill(k, sc_base, w[e], sc_rows, order);
    return k;
  }

  MOE_ECHO_HD void save(int e) {
    const int64_t at = int64_t(e) * M, i = j_count++;
    j_expert[i] = e;
    j_nrep[i] = nrep[e];
    for (int j = 0; j < nrep[e]; ++j) {
      j_rank[i * M + j] = rep_rank[at + j];
      j_rows[i * M + j] = rep_rows[at + j];
      j_load[i * M + j] = load[rep_rank[at + j]];
    }
  }

  // Undoes a trial in reverse order, so every rank's load returns to its value before its first
  // change. The rank that got the new clone is not among the clone's saved ranks: the caller
  // restores it.
  MOE_ECHO_HD void rollback() {
    while (j_count > 0) {
      const int64_t i = --j_count;
      const int e = j_expert[i];
      const int64_t at = int64_t(e) * M;
      for (int j = j_nrep[i]; j < nrep[e]; ++j) {
        rep_rank[at + j] = -1;
        rep_rows[at + j] = 0;
      }
      nrep[e] = j_nrep[i];
      mark(e);
      for (int j = 0; j < nrep[e]; ++j) {
        rep_rank[at + j] = j_rank[i * M + j];
        rep_rows[at + j] = j_rows[i * M + j];
        load[rep_rank[at + j]] = j_load[i * M + j];
      }
    }
  }

  // Rank r's load becomes `now` by a re-split of expert e: r is marked touched and, with
  // propagate, its other cloned experts are queued for a re-split.
  MOE_ECHO_HD void move_load(int e, int r, int64_t now, bool propagate) {
    load[r] = now;
    if (touched_stamp[r] != trial) {
      touched_stamp[r] = trial;
      touched[n_touched++] = r;
    }
    if (propagate)
      for_cloned_on(r, [&](int z) {
        if (z != e && nrep[z] > 1 && queued[z] != trial) {
          queued[z] = trial;
          queue[q_tail % E] = z;
          ++q_tail;
        }
      });
  }

  // Commits the split left by trial_fill (k replicas sorted by rank) for expert e; ranks whose
  // load changed are marked touched and their cloned experts queued for a re-split.
  MOE_ECHO_HD void commit(int e, int k, bool propagate) {
    const int64_t at = int64_t(e) * M;
    for (int j = 0; j < k; ++j) {
      const int r = sc_rank[j];
      const int64_t now = sc_base[j] + sc_rows[j];
      if (now != load[r]) move_load(e, r, now, propagate);
      rep_rank[at + j] = r;
      rep_rows[at + j] = sc_rows[j];
    }
    nrep[e] = k;
    mark(e);
  }

  // Re-splits expert e by water-filling; true when its rows moved.
  MOE_ECHO_HD bool refill(int e, bool propagate) {
    const int k = trial_fill(e, -1);
    const int64_t at = int64_t(e) * M;
    bool diff = false;
    for (int j = 0; j < k; ++j) diff |= sc_rows[j] != rep_rows[at + j];
    if (!diff) return false;
    if (journaling) save(e);
    commit(e, k, propagate);
    return true;
  }

  // trial_fill and commit for an expert with at most K replicas after the change, in registers:
  // re-splits e over its replicas plus (extra >= 0) a new one on rank `extra`, with the same split
  // (water_fill_regs) and the same changes in the same order as commit. Without extra it is
  // refill: nothing changes, and false is returned, when no rows move; a re-split keeps the
  // replicas, so only rows and loads are written. With extra, K > nrep[e] (a candidate has at
  // most clone_limit < M replicas).
  template <int K>
  MOE_ECHO_HD bool resplit_regs(int e, int extra, bool propagate) {
    const int64_t at = int64_t(e) * M;
    const int n = nrep[e], k = extra >= 0 ? n + 1 : n;
    int old_rank[K], rank[K], before = 0;
    int64_t old_rows[K], rows[K], base[K], split[K];
    MOE_ECHO_UNROLL
    for (int j = 0; j < K; ++j) {
      old_rank[j] = j < n ? rep_rank[at + j] : 0;
      old_rows[j] = j < n ? rep_rows[at + j] : 0;
      before += j < n && old_rank[j] < extra ? 1 : 0;
    }
    // The new replica (no rows yet) goes before the first replica on a higher rank.
    MOE_ECHO_UNROLL
    for (int j = 0; j < K; ++j) {
      rank[j] = old_rank[j];
      rows[j] = old_rows[j];
    }
    if (extra >= 0) {
      MOE_ECHO_UNROLL
      for (int j = 1; j < K; ++j)
        if (j > before) {
          rank[j] = old_rank[j - 1];
          rows[j] = old_rows[j - 1];
        }
      MOE_ECHO_UNROLL
      for (int j = 0; j < K; ++j)
        if (j == before) {
          rank[j] = extra;
          rows[j] = 0;
        }
    }
    MOE_ECHO_UNROLL
    for (int j = 0; j < K; ++j) base[j] = j < k ? load[rank[j]] - rows[j] : 0;
    water_fill_regs<K>(k, base, w[e], split);
    if (extra < 0) {
      bool diff = false;
      MOE_ECHO_UNROLL
      for (int j = 0; j < K; ++j) diff |= j < k && split[j] != rows[j];
      if (!diff) return false;
      if (journaling) {  // save(e), from the registers
        const int64_t i = j_count++;
        j_expert[i] = e;
        j_nrep[i] = n;
        MOE_ECHO_UNROLL
        for (int j = 0; j < K; ++j)
          if (j < n) {
            j_rank[i * M + j] = rank[j];
            j_rows[i * M + j] = rows[j];
            j_load[i * M + j] = base[j] + rows[j];
          }
      }
    }
    MOE_ECHO_UNROLL
    for (int j = 0; j < K; ++j) {
      if (j >= k) continue;
      const int64_t now = base[j] + split[j];
      if (now != load[rank[j]]) move_load(e, rank[j], now, propagate);
      if (extra >= 0) rep_rank[at + j] = rank[j];
      rep_rows[at + j] = split[j];
    }
    if (extra >= 0) {
      nrep[e] = k;
      mark(e);
    }
    return true;
  }

  // resplit_regs where M is small, else trial_fill and commit (refill without extra): the
  // device's re-split.
  MOE_ECHO_HD bool resplit_fast(int e, int extra, bool propagate) {
    switch (M) {
      case 2: return resplit_regs<2>(e, extra, propagate);
      case 3: return resplit_regs<3>(e, extra, propagate);
      case 4: return resplit_regs<4>(e, extra, propagate);
      default:
        if (extra < 0) return refill(e, propagate);
        commit(e, trial_fill(e, extra), propagate);
        return true;
    }
  }

  // The busiest group of a greedy step, from its busiest rank `top` at load `level`: breadth-first
  // search over cloned experts with rows on a member. Sets group, n_group and group_stamp.
  MOE_ECHO_HD void build_group(int top, int64_t level) {
    n_group = 0;
    group[n_group++] = top;
    group_stamp[top] = stamp;
    for (int g = 0; g < n_group; ++g) {
      const int b = group[g];
      for_cloned_on(b, [&](int x) {
        if (nrep[x] < 2 || rows_on(x, b) == 0) return;
        for (int j = 0; j < nrep[x]; ++j) {
          const int r = rep_rank[int64_t(x) * M + j];
          if (group_stamp[r] != stamp && load[r] >= level - 1) {
            group_stamp[r] = stamp;
            group[n_group++] = r;
          }
        }
      });
    }
  }

  // Trial: clones x onto `target`, re-splits, propagates, and measures the group's new busiest
  // load. Keeps the clone (in target's next spare slot, one more link on the target and on x's
  // home) and returns true when it lowers the group's busiest load `level` by more than
  // `threshold` rows; else undoes it. kFast: the re-splits by resplit_fast (the device's).
  template <bool kFast = false>
  MOE_ECHO_HD bool try_clone(int x, int target, int64_t level, int64_t threshold) {
    ++trial;
    journaling = true;
    j_count = 0;
    n_touched = 0;
    q_head = q_tail = 0;
    save(x);  // rollback restores the loads of x's ranks; the target's is kept here
    const int64_t target_load = load[target];
    if (kFast)
      resplit_fast(x, target, true);
    else
      commit(x, trial_fill(x, target), true);
    int resplits = 0;
    while (q_head < q_tail && resplits < max_resplits) {
      const int z = queue[q_head % E];
      ++q_head;
      queued[z] = 0;  // may be queued again if its ranks change later in this trial
      if (kFast ? resplit_fast(z, -1, true) : refill(z, true)) ++resplits;
    }
    int64_t new_max = 0;
    for (int gi = 0; gi < n_group; ++gi) new_max = max_of(new_max, load[group[gi]]);
    for (int ti = 0; ti < n_touched; ++ti) new_max = max_of(new_max, load[touched[ti]]);
    journaling = false;
    if (level - new_max > threshold) {
      spare[int64_t(target) * S + spare_used[target]] = x;
      ++spare_used[target];
      const int home = x / epr;
      ++links[target];
      ++links[home];
      max_links = max_of(max_links, max_of(links[target], links[home]));
      return true;
    }
    rollback();
    load[target] = target_load;
    return false;
  }

  // The most links a rank can reach: every clone of its home experts (at most one per spare slot
  // in all) and a full set of spare slots. A budget of link_limit() admits every clone.
  MOE_ECHO_HD int link_limit() const {
    return int(min_of(int64_t(epr) * clone_limit, int64_t(R) * S)) + S;
  }

  // No plan's busiest load is below the mean load (rounded up), nor below an expert's rows over
  // its most replicas (rounded up). Sums over experts first, first + step, ... into total and top.
  MOE_ECHO_HD void floor_part(int first, int step, int64_t& total, int64_t& top) const {
    for (int e = first; e < E; e += step) {
      total += w[e];
      top = max_of(top, (w[e] + clone_limit) / (clone_limit + 1));
    }
  }
  MOE_ECHO_HD int64_t floor_of(int64_t total, int64_t top) const {
    return max_of(top, (total + R - 1) / R);
  }

  // Keeps the state as the best plan when it costs less than the one kept (or none is kept): the
  // scalars on every caller, the arrays for ranks first, first + step, ... (the caller syncs).
  MOE_ECHO_HD void keep_if_best(int64_t level, int64_t clone_cost_rows, int first, int step) {
    const int64_t cost = level + clone_cost_rows * max_links;
    if (has_best && cost >= best_cost) return;
    has_best = best_here = true;
    best_cost = cost;
    snap_max_links = max_links;
    for (int r = first; r < R; r += step) {
      snap_load[r] = load[r];
      snap_links[r] = links[r];
      snap_used[r] = spare_used[r];
      for (int s = 0; s < spare_used[r]; ++s) {
        const int64_t i = int64_t(r) * S + s;
        snap_spare[i] = spare[i];
        snap_rows[i] = rows_on(spare[i], r);
      }
    }
  }

  // Returns to the kept plan: every cloned expert goes home with all its rows, then the kept
  // clones are put back (in rank order among the replicas) with their rows, the home replica
  // keeping the rest; loads, links and slots as kept.
  MOE_ECHO_HD void restore_best() {
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < spare_used[r]; ++s) {
        const int x = spare[int64_t(r) * S + s];
        if (nrep[x] == 1) continue;
        const int64_t at = int64_t(x) * M;
        for (int j = 0; j < M; ++j) {
          rep_rank[at + j] = j == 0 ? x / epr : -1;
          rep_rows[at + j] = j == 0 ? w[x] : 0;
        }
        nrep[x] = 1;
        mark(x);
      }
    max_links = snap_max_links;
    for (int r = 0; r < R; ++r) {
      load[r] = snap_load[r];
      links[r] = snap_links[r];
      spare_used[r] = snap_used[r];
      for (int s = 0; s < S; ++s) {
        const int64_t i = int64_t(r) * S + s;
        spare[i] = s < spare_used[r] ? snap_spare[i] : -1;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < spare_used[r]; ++s) {
        const int64_t i = int64_t(r) * S + s;
        const int x = spare[i];
        const int64_t at = int64_t(x) * M;
        int j = nrep[x];
        for (; j > 0 && rep_rank[at + j - 1] > r; --j) {
          rep_rank[at + j] = rep_rank[at + j - 1];
          rep_rows[at + j] = rep_rows[at + j - 1];
        }
        rep_rank[at + j] = r;
        rep_rows[at + j] = snap_rows[i];
        ++nrep[x];
        for (int k = 0; k < nrep[x]; ++k)
          if (rep_rank[at + k] == x / epr) rep_rows[at + k] -= snap_rows[i];
        mark(x);
      }
    best_here = true;
  }

  // At a stop (no trial under the budget lowered the busiest group): raises the budget to the
  // least that admits a trial not yet made, given the fewest links+1 of a candidate's home
  // (need_home) and of a free target (need_target). Every clone that this admits and the old
  // budget did not gives some rank `next` links, so no plan beyond costs less than
  // floor_rows + clone_cost_rows * next: false (stop) when that is no cheaper than the kept
  // plan, or when no budget admits more.
  MOE_ECHO_HD bool raise_budget(int need_home, int need_target, int64_t floor_rows,
                                int64_t clone_cost_rows) {
    const int next = max_of(budget + 1, max_of(need_home, need_target));
    if (next > link_limit() || floor_rows + clone_cost_rows * next >= best_cost) return false;
    tried_below = budget;
    budget = next;
    return true;
  }

  // Whether the clone of x onto `target` was tried under the budget before the last raise (on
  // this state, as the state does not change at a stop): it would fail again.
  MOE_ECHO_HD bool tried_before(int x, int target) const {
    return links[x / epr] < tried_below && links[target] < tried_below;
  }

  // One greedy run of step 2 (planner.cpp) from the state as it is; returns the busiest load it
  // ends with. Without `budgeted`: every clone must lower the busiest group by more than
  // clone_cost_rows. With it: by any row, under the link budget, which starts at one link and
  // rises at stops (raise_budget); the cheapest plan at a stop is kept (keep_if_best;
  // floor_rows: the floor of the busiest load, floor_of).
  MOE_ECHO_HD int64_t greedy(int64_t clone_cost_rows, bool budgeted, int64_t floor_rows) {
    const int64_t threshold = budgeted ? 0 : clone_cost_rows;
    max_links = 0;
    budget = budgeted ? 1 : link_limit();
    tried_below = 0;
    int64_t free_slots = int64_t(R) * S, level = 0;
    for (bool first = true;; first = false) {
      ++stamp;
      int top = 0;
      level = load[0];
      for (int r = 1; r < R; ++r)
        if (load[r] > level) {
          level = load[r];
          top = r;
        }
      if (budgeted && first) keep_if_best(level, clone_cost_rows, 0, 1);  // no clones
      if (free_slots == 0 || level == 0) break;
      // Links are never removed: no later plan costs less than the floor and the links so far.
      if (budgeted && floor_rows + clone_cost_rows * max_links >= best_cost) break;
      build_group(top, level);
      // Candidates: experts with more than `threshold` rows in the group, clones left and their
      // home under the budget, by rows in the group. A clone relieves the group of at most x's
      // rows there.
      n_cand = 0;
      int need_home = link_limit() + 1;
      for (int gi = 0; gi < n_group; ++gi)
        for_experts_on(group[gi], [&](int x) {
          if (cand_stamp[x] == stamp || nrep[x] > clone_limit) return;
          cand_stamp[x] = stamp;
          int64_t in_group = 0;
          for (int j = 0; j < nrep[x]; ++j) {
            const int r = rep_rank[int64_t(x) * M + j];
            if (group_stamp[r] == stamp) in_group += rep_rows[int64_t(x) * M + j];
          }
          if (in_group <= threshold) return;
          need_home = min_of(need_home, links[x / epr] + 1);
          if (links[x / epr] >= budget) return;
          cand[n_cand] = x;
          cand_score[n_cand] = in_group;
          ++n_cand;
        });
      // Hottest first, ties by lowest expert index (insertion sort: few candidates).
      for (int i = 1; i < n_cand; ++i) {
        const int x = cand[i];
        const int64_t sc = cand_score[i];
        int j = i;
        while (j > 0 && (cand_score[j - 1] < sc || (cand_score[j - 1] == sc && cand[j - 1] > x))) {
          cand[j] = cand[j - 1];
          cand_score[j] = cand_score[j - 1];
          --j;
        }
        cand[j] = x;
        cand_score[j] = sc;
      }

      bool placed = false;
      for (int c = 0; c < n_cand && !placed; ++c) {
        const int x = cand[c];
        const int32_t rstamp = x + 1;  // replica_stamp[r] == x + 1: rank r holds a replica of x
        for (int j = 0; j < nrep[x]; ++j) replica_stamp[rep_rank[int64_t(x) * M + j]] = rstamp;
        // The least loaded rank (ties to the lowest) with a free spare slot, under the budget,
        // outside the group and without a replica of x.
        int target = -1;
        int64_t least = 0;
        for (int r = 0; r < R; ++r)
          if (spare_used[r] < S && links[r] < budget && group_stamp[r] != stamp &&
              replica_stamp[r] != rstamp && (target < 0 || load[r] < least)) {
            target = r;
            least = load[r];
          }
        for (int j = 0; j < nrep[x]; ++j) replica_stamp[rep_rank[int64_t(x) * M + j]] = 0;
        // The target only gains rows, so the new busiest load is at least its load now.
        if (target < 0 || load[target] >= level - 1 || level - load[target] <= threshold ||
            tried_before(x, target))
          continue;
        if (try_clone(x, target, level, threshold)) {
          --free_slots;
          placed = true;
        }
      }
      if (placed) {
        tried_below = 0;
        best_here = false;
        continue;
      }
      if (!budgeted) break;
      keep_if_best(level, clone_cost_rows, 0, 1);
      int need_target = link_limit() + 1;
      for (int r = 0; r < R; ++r)
        if (spare_used[r] < S && group_stamp[r] != stamp)
          need_target = min_of(need_target, links[r] + 1);
      if (!raise_budget(need_home, need_target, floor_rows, clone_cost_rows)) break;
    }
    return level;
  }

  // A plan's rows fit int32, so no clone pays for a cost above 2^31 rows: costs are capped there,
  // which keeps a cost times links in int64 and changes no plan.
  MOE_ECHO_HD static int64_t capped(int64_t clone_cost_rows) {
    return min_of(clone_cost_rows, int64_t(1) << 31);
  }

  // Step 2 of planner.cpp: run a (per clone) and, with a clone cost, run b (under a link budget)
  // from no clones again; the cheaper plan stays.
  MOE_ECHO_HD void place_clones(int64_t clone_cost_rows) {
    if (S == 0 || clone_limit == 0) return;
    const int64_t cost = capped(clone_cost_rows);
    has_best = best_here = false;
    const int64_t level = greedy(cost, false, 0);
    if (cost == 0) return;
    keep_if_best(level, cost, 0, 1);
    int64_t total = 0, top_rows = 0;
    floor_part(0, 1, total, top_rows);
    reset_experts(0, 1);
    init_ranks(0, 1);
    keep_if_best(greedy(cost, true, floor_of(total, top_rows)), cost, 0, 1);
    if (!best_here) restore_best();
  }

  // A clone of expert x in target's next spare slot, placed by the caller (plan_placed): x is
  // water-filled over its replicas and the new one, and the two ranks get a link each.
  MOE_ECHO_HD void add_clone(int x, int target) {
    ++trial;
    n_touched = 0;
    spare[int64_t(target) * S + spare_used[target]] = x;
    ++spare_used[target];
    commit(x, trial_fill(x, target), false);
    ++links[target];
    ++links[x / epr];
  }

  // Step 3: re-split every cloned expert by water-filling, in expert order, until nothing
  // changes or the pass budget is spent.
  MOE_ECHO_HD void refine() {
    ++trial;
    n_touched = 0;  // the touched list is not read here; only its stamps keep it short
    for (int pass = 0; pass < kMaxRefinePasses; ++pass) {
      bool changed = false;
      for (int e = 0; e < E; ++e)
        if (nrep[e] > 1) changed |= refill(e, false);
      if (!changed) break;
    }
  }

  // Step 4, with row_block B > 1: the rows of every cloned expert in whole blocks (PlannerConfig::
  // row_block), one expert after another in expert order, each against the loads the others
  // leave: align_expert. Then, should the aligned plan cost more than the no-clone plan's
  // busiest load (its busiest load plus clone_cost_rows per link of the busiest-linked rank, the
  // links counted as placed), every expert goes home: the invariants of planner.cpp hold for the
  // aligned plan too. One thread (the device runs it on lane 0).
  MOE_ECHO_HD void align_blocks(int64_t clone_cost_rows) {
    if (row_block <= 1) return;
    for (int e = 0; e < E; ++e)
      if (nrep[e] > 1) align_expert(e);
    int64_t before = 0, after = 0;
    int32_t most_links = 0;
    for (int r = 0; r < R; ++r) {
      int64_t home = 0;
      for (int e = r * epr; e < (r + 1) * epr; ++e) home += w[e];
      before = max_of(before, home);
      after = max_of(after, load[r]);
      most_links = max_of(most_links, links[r]);
    }
    if (after + capped(clone_cost_rows) * most_links <= before) return;
    reset_experts(0, 1);
    init_ranks(0, 1);
    max_links = 0;
  }

  // Expert e's rows over its replicas in whole blocks of B = row_block rows. The replicas in
  // replica order (home, then the clones by rank; `order` holds their indices), with bases (their
  // ranks' loads without e's rows) in sc_base. The w[e] % B rows of the last, partial block go to
  // the last replica with rows, h: for each h (only the last replica when w[e] % B == 0) the
  // replicas up to h take the w[e] / B whole blocks by fill_blocks and the replicas after h none;
  // the h with the lowest busiest load among e's ranks stays, ties to the lowest h (fewer clones
  // with rows). A clone left with no rows stays placed (write drops it).
  MOE_ECHO_HD void align_expert(int e) {
    const int64_t at = int64_t(e) * M;
    const int k = nrep[e], home = e / epr;
    int n = 0;
    for (int j = 0; j < k; ++j)
      if (rep_rank[at + j] == home) order[n++] = j;
    for (int j = 0; j < k; ++j)
      if (rep_rank[at + j] != home) order[n++] = j;
    for (int i = 0; i < k; ++i)
      sc_base[i] = load[rep_rank[at + order[i]]] - rep_rows[at + order[i]];
    const int64_t blocks = w[e] / row_block, rest = w[e] % row_block;
    int best = k - 1;
    int64_t best_max = 0;
    for (int h = rest == 0 ? k - 1 : 0; h < k; ++h) {
      const int64_t top = fill_blocks(k, h, blocks, rest);
      if (h == (rest == 0 ? k - 1 : 0) || top < best_max) {
        best = h;
        best_max = top;
      }
    }
    fill_blocks(k, best, blocks, rest);
    for (int i = 0; i < k; ++i) {
      const int j = order[i];
      rep_rows[at + j] = sc_rows[i];
      load[rep_rank[at + j]] = sc_base[i] + sc_rows[i];
    }
  }

  // Integer water-filling in whole blocks: `blocks` blocks of row_block rows over the replicas
  // 0..h of sc_base (replica order), replica h holding the `rest` rows of the partial block
  // first, the replicas after h nothing. The largest level L whose fill, each replica i <= h
  // topped up to L in whole blocks (ceil((L - base_i) / B) of them when base_i < L), needs at
  // most `blocks`; then each block left (fewer than h + 1) to the replica with the lowest total,
  // ties to the lowest index. Rows into sc_rows[0..k); returns the largest base + rows.
  MOE_ECHO_HD int64_t fill_blocks(int k, int h, int64_t blocks, int64_t rest) {
    const int64_t B = row_block;
    auto start = [&](int i) { return sc_base[i] + (i == h ? rest : 0); };
    auto need = [&](int64_t level) {
      int64_t sum = 0;
      for (int i = 0; i <= h; ++i)
        if (start(i) < level) sum += (level - start(i) + B - 1) / B;
      return sum;
    };
    int64_t lo = start(0);
    for (int i = 1; i <= h; ++i) lo = min_of(lo, start(i));
    int64_t hi = lo + (blocks + 1) * B;  // need(lo) = 0 <= blocks < need(hi)
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (need(mid) <= blocks)
        lo = mid;
      else
        hi = mid;
    }
    int64_t left = blocks;
    for (int i = 0; i < k; ++i) {
      sc_rows[i] = i <= h && start(i) < lo ? (lo - start(i) + B - 1) / B * B : 0;
      left -= sc_rows[i] / B;
    }
    for (; left > 0; --left) {
      int low = 0;
      for (int i = 1; i <= h; ++i)
        if (start(i) + sc_rows[i] < start(low) + sc_rows[low]) low = i;
      sc_rows[low] += B;
    }
    int64_t top = 0;
    for (int i = 0; i < k; ++i) {
      if (i == h) sc_rows[i] += rest;
      top = max_of(top, sc_base[i] + sc_rows[i]);
    }
    return top;
  }

  // Step 5: writes the plan on one thread (the device runs write_part over a block and takes
  // load_before from init_ranks).
  MOE_ECHO_HD void write(PlanView out) const {
    for (int r = 0; r < R; ++r) {
      int64_t before = 0;
      for (int e = r * epr; e < (r + 1) * epr; ++e) before += w[e];
      out.load_before[r] = int32_t(before);
    }
    out.num_clones[0] = write_part(out, 0, 1);
  }

  // The plan but load_before and num_clones, on the threads first, first + step, ... of a block.
  // Replica 0 is home, then the clones in ascending rank order; a clone that ended with no rows
  // is dropped (its slot stays empty). Rank, spare slot and expert entries are independent (a
  // spare slot names its expert when that clone kept rows). Returns the clones this thread wrote;
  // num_clones is their sum over the threads, left to the caller.
  MOE_ECHO_HD int32_t write_part(PlanView out, int first, int step) const {
    for (int r = first; r < R; r += step) out.load_after[r] = int32_t(load[r]);
    for (int i = first; i < R * S; i += step) {
      const int r = i / S, s = i % S;
      out.spare_expert[i] = s < spare_used[r] && rows_on(spare[i], r) != 0 ? spare[i] : -1;
    }
    int32_t clones = 0;
    for (int e = first; e < E; e += step) {
      const int64_t at = int64_t(e) * M;
      const int home = e / epr;
      int j_out = 1;
      for (int j = 0; j < M; ++j) {
        out.replica_rank[at + j] = -1;
        out.replica_slot[at + j] = -1;
        out.replica_rows[at + j] = 0;
      }
      for (int j = 0; j < nrep[e]; ++j) {
        const int r = rep_rank[at + j];
        const int64_t rows = rep_rows[at + j];
        if (r == home) {
          out.replica_rank[at] = r;
          out.replica_slot[at] = e % epr;
          out.replica_rows[at] = int32_t(rows);
          continue;
        }
        if (rows == 0) continue;
        int s = 0;
        while (spare[int64_t(r) * S + s] != e) ++s;
        out.replica_rank[at + j_out] = r;
        out.replica_slot[at + j_out] = epr + s;
        out.replica_rows[at + j_out] = int32_t(rows);
        ++j_out;
        ++clones;
      }
    }
    return clones;
  }

 private:
  template <class T>
  MOE_ECHO_HD static void take_array(T*& p, int64_t n, char* base, size_t& at) {
    p = base ? reinterpret_cast<T*>(base + at) : nullptr;
    at += (size_t(n > 0 ? n : 0) * sizeof(T) + 7) / 8 * 8;
  }
};

}  // namespace moe_echo::planner_core
