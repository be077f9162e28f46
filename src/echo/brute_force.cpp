// The brute-force optima of ECHO's problems, for tests on tiny cases only: the smallest busiest
// load (min-max), and the smallest busiest load plus clone_cost_rows per clone link of the
// busiest-linked rank (a rank's links: the clones it hosts plus the clones of its home experts).
//
// Enumerates every placement of clones into spare slots (a set of at most S experts per rank,
// none of them homed there, at most max_clones clones per expert); for each placement the best
// integer split is found by binary search on the busiest load T with a max-flow feasibility check
// (source -> expert e with capacity w[e] -> every rank holding a replica of e -> sink with
// capacity T). Integer capacities give an integer flow, so the optimum found is an integer split.
// A placement's links are fixed, so its cost is its best T plus the links' cost; a clone that
// would get no rows is a placement without it, also enumerated.
// Exponential in R and S: MOE_ECHO_CHECK rejects cases whose enumeration would be too large.
#include <algorithm>
#include <vector>

#include "moe_echo/error.hpp"
#include "moe_echo/planner.hpp"

namespace moe_echo {
namespace {

constexpr double kMaxPlacements = 2e7;

// Edmonds-Karp max flow on a dense capacity matrix: graphs here have at most a few dozen nodes.
class MaxFlow {
 public:
  explicit MaxFlow(int nodes) : n_(nodes), cap_(size_t(nodes) * nodes), prev_(size_t(nodes)) {}
  void reset() { std::fill(cap_.begin(), cap_.end(), 0); }
  void add(int u, int v, int64_t c) { cap_[size_t(u) * n_ + v] += c; }
  int64_t run(int s, int t) {
    int64_t flow = 0;
    std::vector<int> queue(static_cast<size_t>(n_));
    while (true) {
      std::fill(prev_.begin(), prev_.end(), -1);
      prev_[s] = s;
      int head = 0, tail = 0;
      queue[tail++] = s;
      while (head < tail && prev_[t] < 0) {
        const int u = queue[head++];
        for (int v = 0; v < n_; ++v)
          if (prev_[v] < 0 && cap_[size_t(u) * n_ + v] > 0) {
            prev_[v] = u;
            queue[tail++] = v;
          }
      }
      if (prev_[t] < 0) return flow;
      int64_t push = -1;
      for (int v = t; v != s; v = prev_[v]) {
        const int64_t c = cap_[size_t(prev_[v]) * n_ + v];
        push = push < 0 ? c : std::min(push, c);
      }
      for (int v = t; v != s; v = prev_[v]) {
        cap_[size_t(prev_[v]) * n_ + v] -= push;
        cap_[size_t(v) * n_ + prev_[v]] += push;
      }
      flow += push;
    }
  }

 private:
  int n_;
  std::vector<int64_t> cap_;
  std::vector<int> prev_;
};

struct Search {
  int R, E, S, epr, clone_limit;
  int64_t link_cost = 0;  // per link of the busiest-linked rank; 0: min-max
  std::vector<int64_t> w;
  int64_t total = 0, lower = 0, best = 0;  // best: the lowest cost found
  std::vector<int32_t> clones;             // [E]: clones placed so far
  std::vector<int32_t> links;              // [R]: clone links so far
  std::vector<uint8_t> on_rank;            // [E * R]: replica of e on rank r
  std::vector<int32_t> cand;               // experts worth cloning (rows > 0), hottest first
  MaxFlow flow;

  Search(int r, int e, int s, int limit)
      : R(r),
        E(e),
        S(s),
        epr(e / r),
        clone_limit(limit),
        w(size_t(e), 0),
        clones(size_t(e), 0),
        links(size_t(r), 0),
        on_rank(size_t(e) * r, 0),
        flow(e + r + 2) {}

  bool feasible(int64_t T) {
    flow.reset();
    const int src = E + R, sink = E + R + 1;
    for (int e = 0; e < E; ++e) {
      if (w[e] == 0) continue;
      flow.add(src, e, w[e]);
      for (int r = 0; r < R; ++r)
        if (on_rank[size_t(e) * R + r]) flow.add(e, E + r, w[e]);
    }
    for (int r = 0; r < R; ++r) flow.add(E + r, sink, T);
    return flow.run(src, sink) == total;
  }

  void evaluate() {
    const int64_t extra = link_cost * *std::max_element(links.begin(), links.end());
    if (best <= lower + extra) return;
    // Cheap necessary condition first: experts with a single replica pin their rows to its rank.
    std::vector<int64_t> pinned(size_t(R), 0);
    for (int e = 0; e < E; ++e)
      if (clones[e] == 0) pinned[e / epr] += w[e];
    for (int r = 0; r < R; ++r)
      if (pinned[r] + extra >= best) return;
    if (!feasible(best - extra - 1)) return;
    int64_t lo = lower, hi = best - extra - 1;  // hi is feasible
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (feasible(mid))
        hi = mid;
      else
        lo = mid + 1;
    }
    best = hi + extra;
  }

  // Chooses the clones of rank r: candidates cand[from..] in order, `left` slots still free.
  void place(int r, int from, int left) {
    if (best <= lower) return;
    if (r == R) {
      evaluate();
      return;
    }
    place(r + 1, 0, S);  // this rank takes no more clones
    if (left == 0) return;
    for (int i = from; i < int(cand.size()); ++i) {
      const int e = cand[size_t(i)];
      if (on_rank[size_t(e) * R + r] || clones[e] >= clone_limit) continue;
      on_rank[size_t(e) * R + r] = 1;
      ++clones[e];
      ++links[r];
      ++links[e / epr];
      place(r, i + 1, left - 1);
      --links[e / epr];
      --links[r];
      --clones[e];
      on_rank[size_t(e) * R + r] = 0;
    }
  }
};

double combinations_up_to(int n, int k) {
  double sum = 0, c = 1;
  for (int i = 0; i <= k && i <= n; ++i) {
    sum += c;
    c = c * (n - i) / (i + 1);
  }
  return sum;
}

}  // namespace

namespace {

int64_t brute_force(const int32_t* routing_map, const PlannerConfig& cfg, int64_t link_cost) {
  validate(cfg);
  const int R = cfg.ranks, E = cfg.experts, S = cfg.spare_slots;
  const int clone_limit = std::min(cfg.max_clones, R - 1);
  Search st(R, E, S, clone_limit);
  st.link_cost = link_cost;
  for (int src = 0; src < R; ++src)
    for (int e = 0; e < E; ++e) st.w[e] += routing_map[int64_t(src) * E + e];
  std::vector<int64_t> load(size_t(R), 0);
  for (int e = 0; e < E; ++e) {
    st.total += st.w[e];
    st.on_rank[size_t(e) * R + e / st.epr] = 1;
    load[e / st.epr] += st.w[e];
  }
  st.best = *std::max_element(load.begin(), load.end());
  if (S == 0 || clone_limit == 0) return st.best;

  // Lower bound: the average, and each expert spread over as many ranks as it may use.
  st.lower = (st.total + R - 1) / R;
  for (int e = 0; e < E; ++e)
    st.lower = std::max(st.lower, (st.w[e] + clone_limit) / (clone_limit + 1));

  for (int e = 0; e < E; ++e)
    if (st.w[e] > 0) st.cand.push_back(e);
  std::stable_sort(st.cand.begin(), st.cand.end(), [&](int a, int b) { return st.w[a] > st.w[b]; });
  double placements = 1;
  for (int r = 0; r < R; ++r) {
    int n = 0;
    for (int e : st.cand) n += e / st.epr != r;
    placements *= combinations_up_to(n, S);
  }
  MOE_ECHO_CHECK(placements <= kMaxPlacements, "brute force over about "
                                                   << placements << " clone placements (R = " << R
                                                   << ", E = " << E << ", S = " << S
                                                   << ") is too large; allowed " << kMaxPlacements);
  st.place(0, 0, S);
  return st.best;
}

}  // namespace

int64_t brute_force_min_max_load(const int32_t* routing_map, const PlannerConfig& cfg) {
  return brute_force(routing_map, cfg, 0);
}

int64_t brute_force_min_cost(const int32_t* routing_map, const PlannerConfig& cfg) {
  return brute_force(routing_map, cfg, cfg.clone_cost_rows);
}

}  // namespace moe_echo
