// The in-process communicator's dispatch and combine against the contract of comm.hpp, on R = 1,
// 2 and 4 ranks with random routes (repeated ranks per token) and windows smaller than the rows a
// rank receives (spill rounds, a token's members on one rank split across windows).
//
// Every rank poisons its receive rows and fan table before each dispatch; afterwards exactly the
// lead rows hold their token's row, the fan table holds the members as specified, and every other
// row keeps the poison. The combine reads rows the test wrote (random on lead rows, NaN elsewhere,
// so a non-lead row summed shows), and is compared with an fp64 sum; values_out must be written
// exactly for the entries in the window.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "moe_echo/backends.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "test_util.hpp"

namespace moe_echo {
namespace {

using test::rel_error;

constexpr double kPoison = 0x1p100;
constexpr int32_t kPoisonInt = -123456789;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double tolerance(DType dt) { return dt == DType::f64 ? 1e-12 : 1e-5; }
double stored(DType dt, double v) { return dt == DType::f32 ? double(float(v)) : v; }
bool same(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }

// One source rank's routes: entry i = t * K + k goes to receive row row[i] of rank rank[i].
struct SourceRoutes {
  int64_t tokens = 0;
  std::vector<int32_t> rank, row;
  std::vector<double> weight;  // as stored in the float dtype
};

struct Case {
  const char* name;
  int ranks, top_k;
  int64_t hidden;
  std::vector<int64_t> tokens;  // per source rank
  int64_t capacity;             // window rows; 0: every row in one window
  bool weighted;
  bool hot;  // every entry on rank 0 (the others receive nothing)
};

// Random destination ranks (repeats within a token are common), then every destination rank's
// receive rows dealt out to its entries in a random order: windows cut members of one token apart.
std::vector<SourceRoutes> make_routes(const Case& c, DType fl, uint64_t seed,
                                      std::vector<int64_t>& received) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> any_rank(0, c.ranks - 1);
  std::uniform_real_distribution<double> weight(0.05, 1.0);
  std::vector<SourceRoutes> routes(static_cast<size_t>(c.ranks));
  std::vector<std::vector<std::pair<int, int64_t>>> entries_on(static_cast<size_t>(c.ranks));
  for (int s = 0; s < c.ranks; ++s) {
    SourceRoutes& r = routes[size_t(s)];
    r.tokens = c.tokens[size_t(s)];
    const size_t n = size_t(r.tokens * c.top_k);
    r.rank.resize(n);
    r.row.resize(n);
    r.weight.resize(n);
    for (size_t i = 0; i < n; ++i) {
      r.rank[i] = c.hot ? 0 : any_rank(rng);
      r.weight[i] = stored(fl, weight(rng));
      entries_on[size_t(r.rank[i])].push_back({s, int64_t(i)});
    }
  }
  received.assign(size_t(c.ranks), 0);
  for (int d = 0; d < c.ranks; ++d) {
    auto& e = entries_on[size_t(d)];
    std::shuffle(e.begin(), e.end(), rng);
    for (size_t row = 0; row < e.size(); ++row)
      routes[size_t(e[row].first)].row[size_t(e[row].second)] = int32_t(row);
    received[size_t(d)] = int64_t(e.size());
  }
  return routes;
}

// The k of the lead of entry (t, k) in window [lo, lo + rows): of t's entries in the window with
// the same destination rank, the one with the lowest receive row; -1 when (t, k) is not in the
// window.
int lead_k(const SourceRoutes& r, int K, int64_t lo, int64_t rows, int64_t t, int k) {
  auto in = [&](int kk) {
    const int64_t row = r.row[size_t(t * K + kk)] - lo;
    return row >= 0 && row < rows;
  };
  if (!in(k)) return -1;
  int lead = k;
  for (int kk = 0; kk < K; ++kk)
    if (in(kk) && r.rank[size_t(t * K + kk)] == r.rank[size_t(t * K + k)] &&
        r.row[size_t(t * K + kk)] < r.row[size_t(t * K + lead)])
      lead = kk;
  return lead;
}

// What one rank holds after a round, copied out by its thread.
struct Snapshot {
  std::vector<double> recv, weights, y, values_out;
  std::vector<int32_t> members;
};

// Runs the case on a world of `per_node` ranks per node (0: one node), checks it against the
// contract, and returns what every rank held after each round (and the world's traffic).
std::vector<std::vector<Snapshot>> run_case(const Case& c, DType dt, uint64_t seed,
                                            int per_node = 0,
                                            InProcessWorld::Traffic* traffic = nullptr) {
  const int R = c.ranks, K = c.top_k;
  const int64_t H = c.hidden;
  std::vector<int64_t> received;
  const auto routes = make_routes(c, dt, seed, received);
  const int64_t max_rows = *std::max_element(received.begin(), received.end());
  const int64_t cap = c.capacity > 0 ? c.capacity : std::max<int64_t>(max_rows, 1);
  const int rounds = int(std::max<int64_t>(1, (max_rows + cap - 1) / cap));

  // Inputs: token rows per source; per (receiver, round) the rows and values the receiver's
  // fan_in would have produced (random where some entry targets the row, NaN elsewhere) and
  // which of those rows are leads; per (source, round) y before the combine and its mode.
  std::vector<std::vector<double>> x(static_cast<size_t>(R));
  for (int s = 0; s < R; ++s) {
    x[size_t(s)] = test::random_values(size_t(routes[size_t(s)].tokens * H), seed + 10 + s);
    for (double& v : x[size_t(s)]) v = stored(dt, v);
  }
  std::vector<std::vector<std::vector<double>>> red(static_cast<size_t>(R)),
      values(static_cast<size_t>(R)), y0(static_cast<size_t>(R));
  for (int d = 0; d < R; ++d)
    for (int r = 0; r < rounds; ++r) {
      std::vector<double> rv(size_t(cap * H), kNaN), vv(size_t(cap), kNaN);
      const auto rnd =
          test::random_values(size_t(cap * (H + 1)), seed + 100 + uint64_t(d * 64 + r));
      for (int s = 0; s < R; ++s) {
        const SourceRoutes& sr = routes[size_t(s)];
        for (int64_t t = 0; t < sr.tokens; ++t)
          for (int k = 0; k < K; ++k) {
            const int lk = lead_k(sr, K, r * cap, cap, t, k);
            if (lk < 0 || sr.rank[size_t(t * K + k)] != d) continue;
            const int64_t row = sr.row[size_t(t * K + k)] - r * cap;
            vv[size_t(row)] = stored(dt, rnd[size_t(cap * H + row)]);
            if (lk == k)
              for (int64_t h = 0; h < H; ++h)
                rv[size_t(row * H + h)] = stored(dt, rnd[size_t(row * H + h)]);
          }
      }
      red[size_t(d)].push_back(rv);
      values[size_t(d)].push_back(vv);
    }
  for (int s = 0; s < R; ++s)
    for (int r = 0; r < rounds; ++r) {
      auto v = test::random_values(size_t(routes[size_t(s)].tokens * H),
                                   seed + 1000 + uint64_t(s * 64 + r));
      for (double& e : v) e = stored(dt, e);
      y0[size_t(s)].push_back(v);
    }
  // Accumulate mode of round r: 0 no flag, 1 flag 0, 2 flag 1.
  auto mode_of = [](int r) { return r % 3; };

  std::vector<std::vector<Snapshot>> snap(static_cast<size_t>(R),
                                          std::vector<Snapshot>(static_cast<size_t>(rounds)));
  InProcessWorld world(R, default_timeout(), per_node);
  world.run([&](int rank) {
    auto be = make_cpu_backend(dt);
    Communicator& comm = world.communicator(rank);
    const SourceRoutes& mine = routes[size_t(rank)];
    const int64_t n = mine.tokens * K;
    auto sym = [&](DType t, std::initializer_list<int64_t> dims) {
      Tensor view(nullptr, t, dims);
      SymmetricBuffer b = comm.alloc_symmetric(*be, view.bytes());
      view.data = b.local;
      return std::make_pair(b, view);
    };
    auto [recv_sym, recv] = sym(dt, {cap, H});
    auto [red_sym, red_t] = sym(dt, {cap, H});
    FanTable fan;
    fan.top_k = K;
    fan.float_dtype = dt;
    auto [members_sym, members] = sym(DType::i32, {cap, K});
    auto [weights_sym, weights] = sym(dt, {cap, K});
    auto [values_sym, values_t] = sym(dt, {cap});
    fan.members = members_sym;
    fan.weights = weights_sym;
    fan.values = values_sym;
    Tensor xt(be->allocate(size_t(mine.tokens * H) * dtype_size(dt)), dt, {mine.tokens, H});
    Tensor yt(be->allocate(size_t(mine.tokens * H) * dtype_size(dt)), dt, {mine.tokens, H});
    Tensor out(be->allocate(size_t(n) * dtype_size(dt)), dt, {n});
    Tensor wt(be->allocate(size_t(n) * dtype_size(dt)), dt, {n});
    write_tensor(*be, xt, x[size_t(rank)]);
    write_tensor(*be, wt, mine.weight);
    const RowRoute route{mine.rank.data(), mine.row.data(), c.weighted ? wt.data : nullptr, n, K};
    const size_t row_bytes = size_t(H) * dtype_size(dt);
    for (int r = 0; r < rounds; ++r) {
      const RoundWindow win{r * cap, cap};
      write_tensor(*be, recv, std::vector<double>(size_t(cap * H), kPoison));
      write_tensor(*be, members, std::vector<double>(size_t(cap * K), kPoisonInt));
      write_tensor(*be, weights, std::vector<double>(size_t(cap * K), kPoison));
      comm.dispatch(route, win, xt.data, row_bytes, recv_sym, fan, nullptr);
      Snapshot& sn = snap[size_t(rank)][size_t(r)];
      sn.recv = read_tensor(*be, recv);
      sn.weights = read_tensor(*be, weights);
      sn.members.resize(size_t(cap * K));
      std::memcpy(sn.members.data(), members.data, sn.members.size() * sizeof(int32_t));

      write_tensor(*be, red_t, red[size_t(rank)][size_t(r)]);
      write_tensor(*be, values_t, values[size_t(rank)][size_t(r)]);
      write_tensor(*be, yt, y0[size_t(rank)][size_t(r)]);
      write_tensor(*be, out, std::vector<double>(size_t(n), kPoison));
      const int32_t flag = mode_of(r) == 2 ? 1 : 0;
      comm.combine(route, win, red_sym, yt, mode_of(r) == 0 ? nullptr : &flag, fan, out.data,
                   nullptr);
      sn.y = read_tensor(*be, yt);
      sn.values_out = read_tensor(*be, out);
    }
    for (void* p : {xt.data, yt.data, out.data, wt.data}) be->deallocate(p);
    for (SymmetricBuffer* b : {&recv_sym, &red_sym, &members_sym, &weights_sym, &values_sym})
      comm.free_symmetric(*be, *b);
  });

  const double tol = tolerance(dt);
  for (int r = 0; r < rounds; ++r) {
    SCOPED_TRACE("round " + std::to_string(r));
    const int64_t lo = r * cap;
    // Expected receiver state: lead rows, member rows (non-lead), untouched rows.
    // Per receiving rank and window row: 0 no entry, 1 a lead, 2 another member.
    std::vector<std::vector<int>> kind(static_cast<size_t>(R),
                                       std::vector<int>(static_cast<size_t>(cap), 0));
    int64_t leads = 0, bad_rows = 0, bad_members = 0, bad_weights = 0;
    for (int s = 0; s < R; ++s) {
      const SourceRoutes& sr = routes[size_t(s)];
      for (int64_t t = 0; t < sr.tokens; ++t)
        for (int k = 0; k < K; ++k) {
          const int lk = lead_k(sr, K, lo, cap, t, k);
          if (lk < 0) continue;
          const int d = sr.rank[size_t(t * K + k)];
          const int64_t row = sr.row[size_t(t * K + k)] - lo;
          const Snapshot& sn = snap[size_t(d)][size_t(r)];
          if (lk != k) {
            kind[size_t(d)][size_t(row)] = 2;
            if (sn.members[size_t(row * K)] != -1) ++bad_members;
            continue;
          }
          kind[size_t(d)][size_t(row)] = 1;
          ++leads;
          for (int64_t h = 0; h < H; ++h)
            if (sn.recv[size_t(row * H + h)] != x[size_t(s)][size_t(t * H + h)]) ++bad_rows;
          // Members: the lead, then this lead's rank's other entries of t in the window in k
          // order, then -1.
          int m = 0;
          auto member = [&](int k2) {
            const size_t at = size_t(row * K + m);
            if (sn.members[at] != sr.row[size_t(t * K + k2)] - lo) ++bad_members;
            const double w = c.weighted ? sr.weight[size_t(t * K + k2)] : 1.0;
            if (sn.weights[at] != w) ++bad_weights;
            ++m;
          };
          member(k);
          for (int k2 = 0; k2 < K; ++k2)
            if (k2 != k && lead_k(sr, K, lo, cap, t, k2) == k) member(k2);
          for (; m < K; ++m)
            if (sn.members[size_t(row * K + m)] != -1) ++bad_members;
        }
    }
    EXPECT_EQ(bad_rows, 0) << "lead rows do not hold their token's row";
    EXPECT_EQ(bad_members, 0) << "fan table members";
    EXPECT_EQ(bad_weights, 0) << "fan table weights";
    int64_t written_elsewhere = 0;
    for (int d = 0; d < R; ++d) {
      const Snapshot& sn = snap[size_t(d)][size_t(r)];
      for (int64_t q = 0; q < cap; ++q) {
        const int kd = kind[size_t(d)][size_t(q)];
        if (kd != 1)
          for (int64_t h = 0; h < H; ++h)
            written_elsewhere += sn.recv[size_t(q * H + h)] != kPoison;
        if (kd == 0)
          for (int64_t k = 0; k < K; ++k) {
            written_elsewhere += sn.members[size_t(q * K + k)] != kPoisonInt;
            written_elsewhere += sn.weights[size_t(q * K + k)] != kPoison;
          }
      }
    }
    EXPECT_EQ(written_elsewhere, 0) << "dispatch wrote rows other than the leads' (or fan rows "
                                       "no entry targets)";

    // Combine: y and values_out per source rank.
    for (int s = 0; s < R; ++s) {
      const SourceRoutes& sr = routes[size_t(s)];
      const Snapshot& sn = snap[size_t(s)][size_t(r)];
      std::vector<double> want(size_t(sr.tokens * H));
      int64_t bad_untouched = 0, bad_values = 0;
      for (int64_t t = 0; t < sr.tokens; ++t) {
        bool any = false;
        for (int64_t h = 0; h < H; ++h)
          want[size_t(t * H + h)] =
              mode_of(r) == 2 ? y0[size_t(s)][size_t(r)][size_t(t * H + h)] : 0.0;
        for (int k = 0; k < K; ++k) {
          const size_t i = size_t(t * K + k);
          const int lk = lead_k(sr, K, lo, cap, t, k);
          if (lk < 0) {
            bad_values += sn.values_out[i] != kPoison;
            continue;
          }
          any = true;
          const int d = sr.rank[i];
          const int64_t row = sr.row[i] - lo;
          bad_values += !same(sn.values_out[i], values[size_t(d)][size_t(r)][size_t(row)]);
          if (lk != k) continue;
          for (int64_t h = 0; h < H; ++h)
            want[size_t(t * H + h)] += red[size_t(d)][size_t(r)][size_t(row * H + h)];
        }
        if (!any)
          for (int64_t h = 0; h < H; ++h)
            bad_untouched += sn.y[size_t(t * H + h)] != want[size_t(t * H + h)];
      }
      SCOPED_TRACE("source rank " + std::to_string(s) + " accumulate mode " +
                   std::to_string(mode_of(r)));
      EXPECT_LE(rel_error(sn.y, want), tol);
      EXPECT_EQ(bad_untouched, 0) << "tokens without entries in the window";
      EXPECT_EQ(bad_values, 0) << "values_out";
    }
  }
  if (traffic) *traffic = world.traffic();
  return snap;
}

// Counts the situations a case exercises: leads with several members, and (token, rank) pairs
// whose members fall in different windows.
struct Coverage {
  int64_t multi_member_leads = 0, split_pairs = 0;
};

Coverage coverage(const Case& c, DType dt, uint64_t seed) {
  std::vector<int64_t> received;
  const auto routes = make_routes(c, dt, seed, received);
  const int64_t max_rows = *std::max_element(received.begin(), received.end());
  const int64_t cap = c.capacity > 0 ? c.capacity : std::max<int64_t>(max_rows, 1);
  Coverage cov;
  const int K = c.top_k;
  for (const SourceRoutes& sr : routes)
    for (int64_t t = 0; t < sr.tokens; ++t)
      for (int k = 0; k < K; ++k) {
        const size_t i = size_t(t * K + k);
        const int64_t lo = sr.row[i] / cap * cap;  // the entry's own window
        if (lead_k(sr, K, lo, cap, t, k) != k) {
          ++cov.multi_member_leads;
          continue;
        }
        for (int k2 = 0; k2 < k; ++k2)
          if (sr.rank[size_t(t * K + k2)] == sr.rank[i]) {
            ++cov.split_pairs;  // an earlier entry on this rank is in another window
            break;
          }
      }
  return cov;
}

const Case kCases[] = {
    {"one_rank_one_window", 1, 4, 5, {9}, 0, true, false},
    {"one_rank_spill", 1, 4, 3, {11}, 7, true, false},
    {"one_rank_top1", 1, 1, 6, {8}, 3, false, false},
    {"two_ranks_one_window", 2, 3, 7, {10, 6}, 0, true, false},
    {"two_ranks_spill", 2, 4, 5, {12, 9}, 6, true, false},
    {"two_ranks_spill_unweighted", 2, 4, 5, {12, 9}, 5, false, false},
    {"two_ranks_one_empty", 2, 3, 4, {0, 7}, 4, true, false},
    {"four_ranks_spill", 4, 4, 6, {8, 0, 5, 12}, 5, true, false},
    {"four_ranks_wide_top_k", 4, 8, 3, {6, 7, 1, 4}, 9, true, false},
    {"four_ranks_hot_rank", 4, 3, 4, {5, 6, 7, 2}, 8, true, true},
    {"four_ranks_no_tokens", 4, 2, 4, {0, 0, 0, 0}, 4, true, false},
};

TEST(InProcessComm, DispatchWritesLeadsAndFanTableCombineSumsLeads) {
  Coverage total;
  for (DType dt : {DType::f64, DType::f32})
    for (const Case& c : kCases) {
      SCOPED_TRACE(std::string(c.name) + " " + to_string(dt));
      const uint64_t seed = 1 + uint64_t(&c - kCases);
      run_case(c, dt, seed);
      const Coverage cov = coverage(c, dt, seed);
      total.multi_member_leads += cov.multi_member_leads;
      total.split_pairs += cov.split_pairs;
    }
  EXPECT_GT(total.multi_member_leads, 0) << "no lead with several members was exercised";
  EXPECT_GT(total.split_pairs, 0) << "no token's members on one rank were split across windows";
}

// Ranks on several nodes: the same bits as one node in every buffer, rows crossing nodes once per
// (token, node) in a dispatch and once per lead in a combine, and nothing across with one node.
TEST(InProcessComm, NodesGiveTheBitsOfOneNodeWithOneCopyPerTokenAndNode) {
  int64_t saved = 0;  // rows a dispatch did not send across thanks to one copy per node
  for (DType dt : {DType::f64, DType::f32})
    for (const Case& c : kCases) {
      if (c.ranks < 2) continue;
      const uint64_t seed = 1 + uint64_t(&c - kCases);
      InProcessWorld::Traffic flat_traffic;
      const auto flat = run_case(c, dt, seed, 0, &flat_traffic);
      EXPECT_EQ(flat_traffic.dispatch_across + flat_traffic.combine_across, 0);
      // What must cross: per round, source and token, the other nodes it has entries on
      // (dispatch) and its leads on other nodes (combine).
      std::vector<int64_t> received;
      const auto routes = make_routes(c, dt, seed, received);
      const int64_t max_rows = *std::max_element(received.begin(), received.end());
      const int64_t cap = c.capacity > 0 ? c.capacity : std::max<int64_t>(max_rows, 1);
      const int rounds = int(std::max<int64_t>(1, (max_rows + cap - 1) / cap));
      for (int per_node = 1; per_node < c.ranks; ++per_node) {
        if (c.ranks % per_node != 0) continue;
        SCOPED_TRACE(std::string(c.name) + " " + to_string(dt) + ", " + std::to_string(per_node) +
                     " ranks per node");
        InProcessWorld::Traffic t;
        const auto nodes = run_case(c, dt, seed, per_node, &t);
        for (size_t r = 0; r < flat.size(); ++r)
          for (size_t w = 0; w < flat[r].size(); ++w) {
            const Snapshot &a = flat[r][w], &b = nodes[r][w];
            EXPECT_EQ(a.members, b.members);
            for (auto [x, y] : {std::pair{&a.recv, &b.recv},
                                {&a.weights, &b.weights},
                                {&a.y, &b.y},
                                {&a.values_out, &b.values_out}}) {
              ASSERT_EQ(x->size(), y->size());
              for (size_t i = 0; i < x->size(); ++i)
                ASSERT_TRUE(same((*x)[i], (*y)[i])) << "rank " << r << " round " << w;
            }
          }
        int64_t across = 0, leads_across = 0, pairs_across = 0;
        const int K = c.top_k;
        for (int w = 0; w < rounds; ++w)
          for (int s = 0; s < c.ranks; ++s) {
            const SourceRoutes& sr = routes[size_t(s)];
            for (int64_t tok = 0; tok < sr.tokens; ++tok) {
              std::vector<bool> node_hit(size_t(c.ranks / per_node), false);
              for (int k = 0; k < K; ++k) {
                const int lk = lead_k(sr, K, w * cap, cap, tok, k);
                const int d = sr.rank[size_t(tok * K + k)];
                if (lk < 0 || d / per_node == s / per_node) continue;
                node_hit[size_t(d / per_node)] = true;
                if (lk == k) ++leads_across;
              }
              across += std::count(node_hit.begin(), node_hit.end(), true);
            }
          }
        pairs_across = leads_across;  // one flat row per (token, rank) lead on another node
        EXPECT_EQ(t.dispatch_across, across);
        EXPECT_EQ(t.combine_across, leads_across);
        EXPECT_EQ(t.dispatch_within, flat_traffic.dispatch_within);
        EXPECT_EQ(t.combine_within, flat_traffic.combine_within);
        EXPECT_LE(across, pairs_across);
        saved += pairs_across - across;
      }
    }
  EXPECT_GT(saved, 0) << "no token had two ranks of one other node";
}

TEST(InProcessWorld, RanksPerNodeMustDivideTheRanks) {
  EXPECT_THROW(InProcessWorld(4, std::chrono::milliseconds(1000), 3), ConfigError);
  EXPECT_THROW(InProcessWorld(4, std::chrono::milliseconds(1000), -1), ConfigError);
  EXPECT_EQ(InProcessWorld(4, std::chrono::milliseconds(1000), 0).ranks_per_node(), 4);
  EXPECT_EQ(InProcessWorld(4, std::chrono::milliseconds(1000), 2).ranks_per_node(), 2);
}

}  // namespace
}  // namespace moe_echo

namespace moe_echo::test {
namespace {

// ---- ranks that die or hang ----------------------------------------------------------------

TEST(InProcessWorld, RankThatThrowsEndsEveryRank) {
  InProcessWorld world(3, std::chrono::milliseconds(60000));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    world.run([&](int r) {
      if (r == 1) throw Error("rank 1 failed on purpose");
      world.communicator(r).barrier();  // the others wait here until the abort
    });
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rank 1 failed on purpose");
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5)) << "at once";
}

TEST(InProcessWorld, RankThatNeverArrivesIsNamedAfterTheTimeout) {
  InProcessWorld world(3, std::chrono::milliseconds(300));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    world.run([&](int r) {
      if (r != 2) world.communicator(r).barrier();  // rank 2 returns without the barrier
    });
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("waited 300 ms at a barrier for rank(s) 2, which never "
                                         "arrived (timeout; set MOE_ECHO_TIMEOUT_S"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST(InProcessWorldDeathTest, HungRankEndsTheProcessWithAMessage) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        InProcessWorld world(2, std::chrono::milliseconds(300));
        world.run([&](int r) {
          if (r == 1) std::this_thread::sleep_for(std::chrono::seconds(60));  // hangs
          world.communicator(r).barrier();
        });
      },
      testing::ExitedWithCode(124),
      "rank\\(s\\) 1 still running 300 ms after the world aborted \\(in-process world: rank 0 "
      "waited 300 ms at a barrier for rank\\(s\\) 1");
}

}  // namespace
}  // namespace moe_echo::test
