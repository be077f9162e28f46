// The ECHO planner (DESIGN.md section 3): which hot experts to clone into spare slots this step
// and how many rows each replica takes, plus the per-source assignment of rows to replicas.
//
// Algorithm (plan_echo):
// 1. w[e] = sum over sources of C[src][e]; every rank starts with its home experts' rows.
// 2. Greedy placement, one clone per step while spare slots are free: relieve the busiest group
//    (the busiest rank plus the ranks it is already levelled with through cloned experts); the
//    hottest expert with rows in the group and clones left is cloned onto the least loaded rank
//    outside the group with a free slot and no replica of it, its rows re-split by integer
//    water-filling, and the re-split propagates to neighbouring cloned experts. Kept only when the
//    group's busiest load drops by more than clone_cost_rows; else undone, next candidate; stop
//    when no candidate helps.
// 3. Refinement: water-fill every cloned expert in expert order, pass after pass, until nothing
//    moves (bounded): descends the sum of squared loads towards the min-max split.
// 4. The plan: clones in ascending (rank, spare slot) order after the home replica; a clone left
//    with no rows is dropped.
//
// Invariants:
// - Pure function of (C, cfg) in integer arithmetic (int64 inside), ties broken by the lowest
//   index, no hash maps, no floating point: the same plan bit for bit on every rank, and a later
//   single-CTA CUDA port can follow the same loops over the same flat arrays.
// - Every change (a clone, a re-split) is a water-fill, which keeps every rank it touches at or
//   below the largest load among them before, so the busiest load never rises above the no-clone
//   plan's.
// - At most one replica of an expert per rank, at most S clones per rank, at most
//   min(max_clones, R - 1) clones per expert; an expert's replica rows sum to its rows.
//
// Cost: O(R*E) to read C; per greedy step O(R) (argmax, target) plus the group search over
// its ranks' experts and at most 2M + 16 re-splits of O(M) each (M = 1 + max_clones); the
// refinement O(clones * M) per pass. Measured on one idle x86 core at R = E = 256, S = 1..4: at
// most 0.3 ms with max_clones = 2 (0.02 ms on strong skew), at most 0.9 ms with max_clones = 8.
#include "moe_echo/planner.hpp"

#include <algorithm>
#include <limits>
#include <sstream>
#include <string>

#include "moe_echo/error.hpp"

namespace moe_echo {
namespace {

template <class V>
[[noreturn]] void reject(const char* field, V value, const std::string& allowed) {
  std::ostringstream s;
  s << field << " = " << value << " is invalid: allowed " << allowed;
  throw ConfigError(field, s.str());
}

constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
constexpr int kMaxRefinePasses = 64;

// Reads C into expert loads w[E] (int64) and checks that every count and the total fit the plan's
// int32 fields. Returns the total.
int64_t expert_loads(const int32_t* routing_map, const PlannerConfig& cfg, int64_t* w) {
  const int R = cfg.ranks, E = cfg.experts;
  for (int e = 0; e < E; ++e) w[e] = 0;
  int32_t smallest = 0;
  for (int src = 0; src < R; ++src) {
    const int32_t* row = routing_map + int64_t(src) * E;
    for (int e = 0; e < E; ++e) {
      smallest = std::min(smallest, row[e]);
      w[e] += row[e];
    }
  }
  MOE_ECHO_CHECK(smallest >= 0, "routing_map holds a negative count (" << smallest << ")");
  int64_t total = 0;
  for (int e = 0; e < E; ++e) total += w[e];
  MOE_ECHO_CHECK(total <= kMaxInt32,
                 "routing_map holds " << total << " rows in all, more than int32 plan fields hold");
  return total;
}

// Integer water-filling: split `rows` over k replicas, given in ascending rank order, whose ranks
// carry `base[i]` rows of other work, so that the largest total base[i] + out[i] is as small as
// possible. Finds the largest level L with sum max(0, L - base[i]) <= rows, gives every replica
// max(0, L - base[i]), then one more row to each replica at the level in index (= rank) order
// until none is left: the lowest rank gets the remainder first. `order` is scratch for k indices.
// The result is the integer min-max split.
void water_fill(int k, const int64_t* base, int64_t rows, int64_t* out, int* order) {
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

// Working state of one planning run, in flat arrays. Replicas of expert e are kept sorted by rank
// in rep_rank[e*M .. e*M + nrep[e]); the home replica is the one on home_rank(e).
struct State {
  int R = 0, E = 0, S = 0, M = 0, epr = 0, clone_limit = 0;
  std::vector<int64_t> w, load, rep_rows;
  std::vector<int32_t> rep_rank, nrep, spare, spare_used;
  // Scratch of one water-fill (k <= M replicas).
  std::vector<int64_t> sc_base, sc_rows;
  std::vector<int32_t> sc_rank;
  std::vector<int> order;
  // Scratch of the greedy step: epochs instead of clearing per step (`stamp` marks the busiest
  // group and the candidates of one step, `trial` the ranks touched and experts queued by one
  // trial clone).
  int32_t stamp = 0, trial = 0;
  std::vector<int32_t> group_stamp, touched_stamp, cand_stamp, replica_stamp, queued;
  std::vector<int32_t> group, touched, cand, queue;
  std::vector<int64_t> cand_score;
  // Undo log of a trial clone: per change, the expert's replica list and its ranks' loads before.
  bool journaling = false;
  int max_resplits = 0, j_count = 0;
  std::vector<int32_t> j_expert, j_nrep, j_rank;
  std::vector<int64_t> j_rows, j_load;

  explicit State(const PlannerConfig& cfg)
      : R(cfg.ranks),
        E(cfg.experts),
        S(cfg.spare_slots),
        M(cfg.max_replicas()),
        epr(cfg.experts_per_rank()),
        clone_limit(std::min(cfg.max_clones, cfg.ranks - 1)),
        w(size_t(E)),
        load(size_t(R), 0),
        rep_rows(size_t(E) * M, 0),
        rep_rank(size_t(E) * M, -1),
        nrep(size_t(E), 1),
        spare(size_t(R) * S, -1),
        spare_used(size_t(R), 0),
        sc_base(size_t(M) + 1),
        sc_rows(size_t(M) + 1),
        sc_rank(size_t(M) + 1),
        order(size_t(M) + 1),
        group_stamp(size_t(R), 0),
        touched_stamp(size_t(R), 0),
        cand_stamp(size_t(E), 0),
        replica_stamp(size_t(R), 0),
        queued(size_t(E), 0),
        max_resplits(2 * M + 16),
        j_expert(size_t(max_resplits) + 1),
        j_nrep(size_t(max_resplits) + 1),
        j_rank((size_t(max_resplits) + 1) * M),
        j_rows((size_t(max_resplits) + 1) * M),
        j_load((size_t(max_resplits) + 1) * M) {}

  void init(const int32_t* routing_map, const PlannerConfig& cfg) {
    expert_loads(routing_map, cfg, w.data());
    for (int e = 0; e < E; ++e) {
      rep_rank[size_t(e) * M] = e / epr;
      rep_rows[size_t(e) * M] = w[e];
      load[e / epr] += w[e];
    }
  }

  int64_t rows_on(int e, int r) const {
    for (int j = 0; j < nrep[e]; ++j)
      if (rep_rank[size_t(e) * M + j] == r) return rep_rows[size_t(e) * M + j];
    return 0;
  }

  // Calls f(e) for every expert with a replica on rank r: home experts, then spare slots.
  template <class F>
  void for_experts_on(int r, F&& f) const {
    for (int e = r * epr; e < (r + 1) * epr; ++e) f(e);
    for (int s = 0; s < spare_used[r]; ++s) f(spare[size_t(r) * S + s]);
  }

  // Water-fills expert e over its replicas plus (when extra >= 0) a new one on rank `extra`.
  // Leaves ranks (ascending), bases and rows in the sc_* scratch; returns the count.
  int trial_fill(int e, int extra) {
    int k = 0;
    const size_t at = size_t(e) * M;
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
    water_fill(k, sc_base.data(), w[e], sc_rows.data(), order.data());
    return k;
  }

  void save(int e) {
    const size_t at = size_t(e) * M, i = size_t(j_count++);
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
  void rollback() {
    while (j_count > 0) {
      const size_t i = size_t(--j_count);
      const int e = j_expert[i];
      const size_t at = size_t(e) * M;
      for (int j = j_nrep[i]; j < nrep[e]; ++j) {
        rep_rank[at + j] = -1;
        rep_rows[at + j] = 0;
      }
      nrep[e] = j_nrep[i];
      for (int j = 0; j < nrep[e]; ++j) {
        rep_rank[at + j] = j_rank[i * M + j];
        rep_rows[at + j] = j_rows[i * M + j];
        load[rep_rank[at + j]] = j_load[i * M + j];
      }
    }
  }

  // Commits the split left by trial_fill (k replicas sorted by rank) for expert e; ranks whose
  // load changed are marked touched and their cloned experts queued for a re-split.
  void commit(int e, int k, bool propagate) {
    const size_t at = size_t(e) * M;
    for (int j = 0; j < k; ++j) {
      const int r = sc_rank[j];
      const int64_t now = sc_base[j] + sc_rows[j];
      if (now != load[r]) {
        load[r] = now;
        if (touched_stamp[r] != trial) {
          touched_stamp[r] = trial;
          touched.push_back(r);
        }
        if (propagate)
          for_experts_on(r, [&](int z) {
            if (z != e && nrep[z] > 1 && queued[z] != trial) {
              queued[z] = trial;
              queue.push_back(z);
            }
          });
      }
      rep_rank[at + j] = r;
      rep_rows[at + j] = sc_rows[j];
    }
    nrep[e] = k;
  }

  // Re-splits expert e by water-filling; true when its rows moved.
  bool refill(int e, bool propagate) {
    const int k = trial_fill(e, -1);
    const size_t at = size_t(e) * M;
    bool diff = false;
    for (int j = 0; j < k; ++j) diff |= sc_rows[j] != rep_rows[at + j];
    if (!diff) return false;
    if (journaling) save(e);
    commit(e, k, propagate);
    return true;
  }

  // Step 2: greedy placement of clones into spare slots. Each step relieves the busiest group:
  // the busiest rank and the ranks at (within one row of) its load that it already shares a
  // cloned expert with, since water-filling has levelled them and only moving rows out of the
  // whole group lowers it. The candidate experts are those with rows in the group, hottest
  // (most rows in the group) first; a candidate is cloned onto the least loaded rank outside the
  // group with a free spare slot and no replica of it, re-split, and the re-split propagates to
  // the cloned experts of the ranks it changed (a bounded number of re-splits). The clone is kept
  // when the group's busiest load drops by more than clone_cost_rows; otherwise it is undone and
  // the next candidate is tried. When no candidate helps, placement stops.
  void place_clones(int64_t clone_cost_rows) {
    if (S == 0 || clone_limit == 0) return;
    int64_t free_slots = int64_t(R) * S;
    while (free_slots > 0) {
      ++stamp;
      int top = 0;
      for (int r = 1; r < R; ++r)
        if (load[r] > load[top]) top = r;
      const int64_t level = load[top];
      if (level == 0) break;
      // The busiest group, by breadth-first search over cloned experts with rows on a member.
      group.clear();
      group.push_back(top);
      group_stamp[top] = stamp;
      for (size_t g = 0; g < group.size(); ++g) {
        const int b = group[g];
        for_experts_on(b, [&](int x) {
          if (nrep[x] < 2 || rows_on(x, b) == 0) return;
          for (int j = 0; j < nrep[x]; ++j) {
            const int r = rep_rank[size_t(x) * M + j];
            if (group_stamp[r] != stamp && load[r] >= level - 1) {
              group_stamp[r] = stamp;
              group.push_back(r);
            }
          }
        });
      }
      // Candidates: experts with rows in the group and clones left, by rows in the group.
      cand.clear();
      cand_score.clear();
      for (int b : group)
        for_experts_on(b, [&](int x) {
          if (cand_stamp[x] == stamp || nrep[x] > clone_limit) return;
          cand_stamp[x] = stamp;
          int64_t in_group = 0;
          for (int j = 0; j < nrep[x]; ++j) {
            const int r = rep_rank[size_t(x) * M + j];
            if (group_stamp[r] == stamp) in_group += rep_rows[size_t(x) * M + j];
          }
          if (in_group == 0) return;
          cand.push_back(x);
          cand_score.push_back(in_group);
        });
      // Hottest first, ties by lowest expert index (insertion sort: few candidates).
      for (size_t i = 1; i < cand.size(); ++i) {
        const int x = cand[i];
        const int64_t sc = cand_score[i];
        size_t j = i;
        while (j > 0 && (cand_score[j - 1] < sc || (cand_score[j - 1] == sc && cand[j - 1] > x))) {
          cand[j] = cand[j - 1];
          cand_score[j] = cand_score[j - 1];
          --j;
        }
        cand[j] = x;
        cand_score[j] = sc;
      }

      bool placed = false;
      for (size_t c = 0; c < cand.size() && !placed; ++c) {
        const int x = cand[c];
        const int32_t rstamp = x + 1;  // replica_stamp[r] == x + 1: rank r holds a replica of x
        for (int j = 0; j < nrep[x]; ++j) replica_stamp[rep_rank[size_t(x) * M + j]] = rstamp;
        int target = -1;
        for (int r = 0; r < R; ++r)
          if (spare_used[r] < S && group_stamp[r] != stamp && replica_stamp[r] != rstamp &&
              (target < 0 || load[r] < load[target]))
            target = r;
        for (int j = 0; j < nrep[x]; ++j) replica_stamp[rep_rank[size_t(x) * M + j]] = 0;
        if (target < 0 || load[target] >= level - 1) continue;

        // Trial: clone, re-split, propagate; measure the group's new busiest load.
        ++trial;
        journaling = true;
        j_count = 0;
        touched.clear();
        queue.clear();
        save(x);  // rollback restores the loads of x's ranks; the target's is kept here
        const int64_t target_load = load[target];
        commit(x, trial_fill(x, target), true);
        int resplits = 0;
        for (size_t q = 0; q < queue.size() && resplits < max_resplits; ++q) {
          const int z = queue[q];
          queued[z] = 0;  // may be queued again if its ranks change later in this trial
          if (refill(z, true)) ++resplits;
        }
        int64_t new_max = 0;
        for (int r : group) new_max = std::max(new_max, load[r]);
        for (int r : touched) new_max = std::max(new_max, load[r]);
        journaling = false;
        if (level - new_max > clone_cost_rows) {
          spare[size_t(target) * S + spare_used[target]] = x;
          ++spare_used[target];
          --free_slots;
          placed = true;
        } else {
          rollback();
          load[target] = target_load;
        }
      }
      if (!placed) break;
    }
  }

  // Step 3: re-split every cloned expert by water-filling, in expert order, until nothing
  // changes or the pass budget is spent. Each re-split is the integer min-max for its ranks given
  // the rest, so no pass raises the busiest load; the passes descend the sum of squares.
  void refine() {
    ++trial;
    for (int pass = 0; pass < kMaxRefinePasses; ++pass) {
      bool changed = false;
      for (int e = 0; e < E; ++e)
        if (nrep[e] > 1) changed |= refill(e, false);
      if (!changed) break;
    }
  }
  // Step 4: writes the plan. Replica 0 is home, then the clones in ascending rank order; a clone
  // that ended with no rows is dropped (its slot stays empty: pulling weights for nothing is
  // waste).
  void write(PlanView out) const {
    std::vector<int64_t> before(size_t(R), 0);
    for (int e = 0; e < E; ++e) before[e / epr] += w[e];
    for (int r = 0; r < R; ++r) {
      out.load_before[r] = int32_t(before[r]);
      out.load_after[r] = int32_t(load[r]);
    }
    for (int64_t i = 0; i < int64_t(R) * S; ++i) out.spare_expert[i] = -1;
    int32_t clones = 0;
    for (int e = 0; e < E; ++e) {
      const size_t at = size_t(e) * M;
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
        while (spare[size_t(r) * S + s] != e) ++s;
        out.spare_expert[size_t(r) * S + s] = e;
        out.replica_rank[at + j_out] = r;
        out.replica_slot[at + j_out] = epr + s;
        out.replica_rows[at + j_out] = int32_t(rows);
        ++j_out;
        ++clones;
      }
    }
    out.num_clones[0] = clones;
  }
};

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
}

void plan_none(const int32_t* routing_map, const PlannerConfig& cfg, PlanView out) {
  validate(cfg);
  State st(cfg);
  st.init(routing_map, cfg);
  st.write(out);
}

void plan_echo(const int32_t* routing_map, const PlannerConfig& cfg, PlanView out) {
  validate(cfg);
  State st(cfg);
  st.init(routing_map, cfg);
  st.place_clones(cfg.clone_cost_rows);
  st.refine();
  st.write(out);
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
    // Pass 1: a source keeps its rows on its own rank, up to that replica's quota.
    for (int src = 0; src < R; ++src) {
      int32_t* a = assign + (int64_t(src) * E + e) * M;
      for (int j = 0; j < M; ++j) a[j] = 0;
      left[src] = routing_map[int64_t(src) * E + e];
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
