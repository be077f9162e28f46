// The host-collectives communicator against the in-process one: the same inputs on R = 1..4 ranks
// give the same bytes from every op (all-gather, all-reduce, dispatch and combine over windows that
// cut groups, clone pull and reduce), a whole MoeLayer over it equals the layer over the
// in-process communicator bit for bit, bf16 rows sum in float and round once, and bad use throws
// a clear error. Its collectives here are ThreadCollectives: the ranks are threads of an
// InProcessWorld that meet at the world's barrier (which a failing rank aborts).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "layer_harness.hpp"
#include "moe_echo/backends.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_collectives.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/planner.hpp"
#include "test_util.hpp"

namespace moe_echo {
namespace {

// ---- HostCollectives over the threads of an InProcessWorld -----------------------------------

// What each rank posts for a collective: the others read it between two barriers.
struct Board {
  explicit Board(int ranks) : posts(static_cast<size_t>(ranks)) {}
  struct Post {
    const char* op = nullptr;
    const void* send = nullptr;
    size_t bytes = 0;                                 // all_gather
    const std::vector<size_t>* send_bytes = nullptr;  // all_to_all_v
    const std::vector<size_t>* recv_bytes = nullptr;
  };
  std::vector<Post> posts;
};

class ThreadCollectives final : public HostCollectives {
 public:
  ThreadCollectives(InProcessWorld& world, Board& board, int rank)
      : world_(world), board_(board), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return world_.size(); }

  void all_gather(const void* send, void* recv, size_t bytes) override {
    post({"all_gather", send, bytes, nullptr, nullptr});
    for (int r = 0; r < size(); ++r)
      MOE_ECHO_CHECK(board_.posts[size_t(r)].bytes == bytes,
                     "all_gather: rank " << r << " gives " << board_.posts[size_t(r)].bytes
                                         << " bytes, rank " << rank_ << " " << bytes);
    for (int r = 0; r < size(); ++r)
      if (bytes)
        std::memcpy(static_cast<char*>(recv) + size_t(r) * bytes, board_.posts[size_t(r)].send,
                    bytes);
    meet();
  }

  void all_to_all_v(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                    const std::vector<size_t>& recv_bytes) override {
    post({"all_to_all_v", send, 0, &send_bytes, &recv_bytes});
    const size_t R = size_t(size());
    // Every rank checks every pair, so that all of them throw together (none reads).
    for (size_t s = 0; s < R; ++s) {
      const Board::Post& p = board_.posts[s];
      MOE_ECHO_CHECK(p.send_bytes->size() == R && p.recv_bytes->size() == R,
                     "all_to_all_v: rank " << s << " passes " << p.send_bytes->size() << " and "
                                           << p.recv_bytes->size() << " sizes for " << R
                                           << " ranks");
    }
    for (size_t s = 0; s < R; ++s)
      for (size_t d = 0; d < R; ++d)
        MOE_ECHO_CHECK((*board_.posts[s].send_bytes)[d] == (*board_.posts[d].recv_bytes)[s],
                       "all_to_all_v: rank " << s << " sends " << (*board_.posts[s].send_bytes)[d]
                                             << " bytes to rank " << d << ", which expects "
                                             << (*board_.posts[d].recv_bytes)[s]);
    size_t to = 0;
    for (size_t s = 0; s < R; ++s) {
      const std::vector<size_t>& sent = *board_.posts[s].send_bytes;
      size_t from = 0;
      for (size_t d = 0; d < size_t(rank_); ++d) from += sent[d];
      if (recv_bytes[s])
        std::memcpy(static_cast<char*>(recv) + to,
                    static_cast<const char*>(board_.posts[s].send) + from, recv_bytes[s]);
      to += recv_bytes[s];
    }
    meet();
  }

  void barrier() override {
    post({"barrier", nullptr, 0, nullptr, nullptr});
    meet();
  }

 private:
  void meet() { world_.communicator(rank_).barrier(); }

  // Posts this rank's arguments and waits for every rank's; all must be in the same collective.
  void post(const Board::Post& p) {
    board_.posts[size_t(rank_)] = p;
    meet();
    for (int r = 0; r < size(); ++r)
      MOE_ECHO_CHECK(std::string(board_.posts[size_t(r)].op) == p.op,
                     "rank " << r << " is in " << board_.posts[size_t(r)].op << ", rank " << rank_
                             << " in " << p.op);
  }

  InProcessWorld& world_;
  Board& board_;
  const int rank_;
};

// Each rank's host-collectives communicator over ThreadCollectives on the world's threads.
class HostRanks {
 public:
  explicit HostRanks(int ranks)
      : board_(ranks),
        collectives_(static_cast<size_t>(ranks)),
        comms_(static_cast<size_t>(ranks)) {}
  Communicator& operator()(InProcessWorld& world, int rank, Backend& backend) {
    collectives_[size_t(rank)] = std::make_unique<ThreadCollectives>(world, board_, rank);
    comms_[size_t(rank)] = make_host_collectives_communicator(*collectives_[size_t(rank)], backend);
    return *comms_[size_t(rank)];
  }

 private:
  Board board_;
  std::vector<std::unique_ptr<ThreadCollectives>> collectives_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

// ---- Running the same ops over both communicators ---------------------------------------------

// What one rank saw, as named byte strings.
struct Record {
  std::vector<std::string> names;
  std::vector<std::vector<char>> bytes;
  void add(const std::string& name, const void* p, size_t n) {
    names.push_back(name);
    bytes.emplace_back(static_cast<const char*>(p), static_cast<const char*>(p) + n);
  }
  void add(const std::string& name, const Tensor& t) { add(name, t.data, t.bytes()); }
};

using Body = std::function<void(Communicator& comm, Backend& backend, int rank, Record& rec)>;

std::vector<Record> run_ranks(int ranks, DType dtype, bool host, const Body& body) {
  std::vector<Record> records(static_cast<size_t>(ranks));
  InProcessWorld world(ranks);
  HostRanks host_ranks(ranks);
  world.run([&](int r) {
    auto be = make_cpu_backend(dtype);
    Communicator& comm = host ? host_ranks(world, r, *be) : world.communicator(r);
    body(comm, *be, r, records[size_t(r)]);
  });
  return records;
}

// Runs `body` over the in-process and the host-collectives communicator: every record the same.
void expect_same_records(int ranks, DType dtype, const Body& body) {
  const std::vector<Record> want = run_ranks(ranks, dtype, false, body);
  const std::vector<Record> got = run_ranks(ranks, dtype, true, body);
  for (int r = 0; r < ranks; ++r) {
    const Record& a = want[size_t(r)];
    const Record& b = got[size_t(r)];
    ASSERT_EQ(a.names, b.names) << "rank " << r;
    for (size_t i = 0; i < a.names.size(); ++i) {
      const auto& x = a.bytes[i];
      const auto& y = b.bytes[i];
      ASSERT_EQ(x.size(), y.size()) << "rank " << r << ": " << a.names[i];
      const auto at = std::mismatch(x.begin(), x.end(), y.begin());
      EXPECT_TRUE(at.first == x.end())
          << "rank " << r << ": " << a.names[i] << " differs from byte " << (at.first - x.begin())
          << " of " << x.size();
    }
  }
}

// A tensor of the backend's, filled with `values` (converted to its dtype).
Tensor make_tensor(Backend& be, DType dt, std::initializer_list<int64_t> dims,
                   const std::vector<double>& values) {
  Tensor t(nullptr, dt, dims);
  t.data = be.allocate(std::max<size_t>(t.bytes(), 1));
  write_tensor(be, t, values);
  return t;
}

// A symmetric buffer viewed as a tensor.
std::pair<SymmetricBuffer, Tensor> make_symmetric(Communicator& comm, Backend& be, DType dt,
                                                  std::initializer_list<int64_t> dims) {
  Tensor t(nullptr, dt, dims);
  SymmetricBuffer b = comm.alloc_symmetric(be, t.bytes());
  t.data = b.local;
  return {b, t};
}

void poison(const Tensor& t) { std::memset(t.data, 0xA5, t.bytes()); }

// Values of mixed magnitudes, so that sums in another order give other bits.
std::vector<double> mixed(size_t n, uint64_t seed) {
  std::vector<double> v = test::random_values(n, seed);
  std::mt19937_64 rng(seed ^ 0x5eed);
  std::uniform_int_distribution<int> exponent(-20, 20);
  for (double& e : v) e = std::ldexp(e, exponent(rng));
  return v;
}

// ---- all_gather_i32 and all_reduce_sum --------------------------------------------------------

TEST(HostCollectivesComm, GatherAndReduceEqualInProcess) {
  for (DType dt : {DType::f64, DType::f32})
    for (int R = 1; R <= 4; ++R) {
      SCOPED_TRACE("R = " + std::to_string(R) + " " + to_string(dt));
      expect_same_records(R, dt, [&](Communicator& comm, Backend& be, int rank, Record& rec) {
        std::vector<double> local;
        for (int i = 0; i < 5; ++i) local.push_back(rank * 10 + i - 20);
        const Tensor mine = make_tensor(be, DType::i32, {5}, local);
        const Tensor all =
            make_tensor(be, DType::i32, {R, 5}, std::vector<double>(size_t(R) * 5, 0));
        comm.all_gather_i32(mine.as<int32_t>(), all.as<int32_t>(), 5, nullptr);
        rec.add("all_gather_i32", all);
        std::vector<double> v = mixed(9, 40 + uint64_t(rank));
        v[0] = -0.0;  // -0 on every rank: the rank-order sum from +0 gives +0
        v[1] = rank % 2 ? -0.0 : 1e-30;
        const Tensor t = make_tensor(be, dt, {3, 3}, v);
        comm.all_reduce_sum(t, nullptr);
        rec.add("all_reduce_sum", t);
        comm.barrier();
        for (const Tensor* x : {&mine, &all, &t}) be.deallocate(x->data);
      });
    }
}

// ---- dispatch and combine ---------------------------------------------------------------------

// One source rank's routes: entry i = t * K + k goes to receive row row[i] of rank rank[i].
struct Routes {
  int64_t tokens = 0;
  std::vector<int32_t> rank, row;
  std::vector<double> weight;
};

struct RouteCase {
  const char* name;
  int ranks, top_k;
  int64_t hidden;
  std::vector<int64_t> tokens;  // per source rank
  int64_t capacity;             // window rows
  bool weighted;
  // 0: destinations uniform; 1: most entries on rank 0, none on the last rank; 2: a token's
  // entries mostly on one rank (several members per lead).
  int pattern;
};

// Destinations by pattern, then each rank's receive rows in (slot, source, entry) order, as the
// layout deals them: windows cut slots and a token's members apart.
std::vector<Routes> make_routes(const RouteCase& c, uint64_t seed, int64_t& max_rows) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> any_rank(0, c.ranks - 1), any_slot(0, 2);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<Routes> routes(static_cast<size_t>(c.ranks));
  std::vector<std::vector<std::tuple<int, int, int64_t>>> on(static_cast<size_t>(c.ranks));
  for (int s = 0; s < c.ranks; ++s) {
    Routes& r = routes[size_t(s)];
    r.tokens = c.tokens[size_t(s)];
    for (int64_t t = 0; t < r.tokens; ++t) {
      const int base = any_rank(rng);
      for (int k = 0; k < c.top_k; ++k) {
        int d = any_rank(rng);
        const double u = unit(rng);
        if (c.pattern == 1) d = c.ranks == 1 || u < 0.7 ? 0 : d % (c.ranks - 1);
        if (c.pattern == 2 && u < 0.75) d = base;
        on[size_t(d)].emplace_back(any_slot(rng), s, int64_t(r.rank.size()));
        r.rank.push_back(int32_t(d));
        r.row.push_back(0);
        r.weight.push_back(0.05 + unit(rng));
      }
    }
  }
  max_rows = 0;
  for (auto& entries : on) {
    std::sort(entries.begin(), entries.end());
    for (size_t row = 0; row < entries.size(); ++row)
      routes[size_t(std::get<1>(entries[row]))].row[size_t(std::get<2>(entries[row]))] =
          int32_t(row);
    max_rows = std::max<int64_t>(max_rows, int64_t(entries.size()));
  }
  return routes;
}

const RouteCase kRouteCases[] = {
    {"one_rank", 1, 4, 5, {9}, 7, true, 2},
    {"one_rank_top1", 1, 1, 6, {8}, 3, false, 0},
    {"two_ranks_spill", 2, 4, 5, {12, 9}, 6, true, 2},
    {"two_ranks_unweighted", 2, 3, 4, {10, 7}, 5, false, 0},
    {"two_ranks_one_without_tokens", 2, 3, 4, {0, 7}, 4, true, 1},
    {"three_ranks_hot", 3, 4, 3, {8, 6, 9}, 6, true, 1},
    {"three_ranks_one_window", 3, 2, 7, {5, 5, 5}, 64, true, 0},
    {"four_ranks_spill", 4, 4, 6, {8, 0, 5, 12}, 5, true, 2},
    {"four_ranks_wide_top_k", 4, 8, 3, {6, 7, 1, 4}, 9, true, 2},
    {"four_ranks_hot", 4, 3, 4, {5, 6, 7, 2}, 8, false, 1},
    {"four_ranks_no_tokens", 4, 2, 4, {0, 0, 0, 0}, 4, true, 0},
};

// Every round's dispatch (receive rows and fan table) and combine (y, values_out) on one rank.
// Token rows describe themselves: source rank * 1000 + token + h / 1024.
void route_rounds(const RouteCase& c, const std::vector<Routes>& routes, int64_t cap, int rounds,
                  DType dt, Communicator& comm, Backend& be, int rank, Record& rec) {
  const int K = c.top_k;
  const int64_t H = c.hidden;
  const Routes& mine = routes[size_t(rank)];
  const int64_t T = mine.tokens, n = T * K;
  auto [recv_sym, recv] = make_symmetric(comm, be, dt, {cap, H});
  auto [red_sym, red] = make_symmetric(comm, be, dt, {cap, H});
  auto [members_sym, members] = make_symmetric(comm, be, DType::i32, {cap, K});
  auto [weights_sym, weights] = make_symmetric(comm, be, dt, {cap, K});
  auto [values_sym, values] = make_symmetric(comm, be, dt, {cap});
  const FanTable fan{members_sym, weights_sym, values_sym, K, dt};
  std::vector<double> xv(size_t(T * H)), ranks(mine.rank.begin(), mine.rank.end()),
      rows(mine.row.begin(), mine.row.end());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) xv[size_t(t * H + h)] = rank * 1000 + t + double(h) / 1024;
  const Tensor x = make_tensor(be, dt, {T, H}, xv);
  const Tensor dest_rank = make_tensor(be, DType::i32, {n}, ranks);
  const Tensor dest_row = make_tensor(be, DType::i32, {n}, rows);
  const Tensor weight = make_tensor(be, dt, {n}, mine.weight);
  const Tensor y = make_tensor(be, dt, {T, H}, std::vector<double>(size_t(T * H), 0));
  const Tensor out = make_tensor(be, dt, {n}, std::vector<double>(size_t(n), 0));
  const RowRoute route{dest_rank.as<int32_t>(), dest_row.as<int32_t>(),
                       c.weighted ? weight.data : nullptr, n, K};
  const size_t row_bytes = size_t(H) * dtype_size(dt);
  for (int r = 0; r < rounds; ++r) {
    const std::string round = "round " + std::to_string(r) + " ";
    const RoundWindow win{r * cap, cap};
    for (const Tensor* t : {&recv, &members, &weights}) poison(*t);
    comm.dispatch(route, win, x.data, row_bytes, recv_sym, fan, nullptr);
    rec.add(round + "receive rows", recv);
    rec.add(round + "fan members", members);
    rec.add(round + "fan weights", weights);

    const uint64_t seed = 1000 + uint64_t(rank * 64 + r);
    write_tensor(be, red, mixed(size_t(cap * H), seed));
    write_tensor(be, values, test::random_values(size_t(cap), seed + 1));
    write_tensor(be, y, mixed(size_t(T * H), seed + 2));
    poison(out);
    const int32_t flag = r % 3 == 2 ? 1 : 0;  // no flag, flag 0, flag 1 in turn
    comm.combine(route, win, red_sym, y, r % 3 == 0 ? nullptr : &flag, fan,
                 r % 2 ? out.data : nullptr, nullptr);
    rec.add(round + "y", y);
    rec.add(round + "values_out", out);
  }
  for (const Tensor* t : {&x, &dest_rank, &dest_row, &weight, &y, &out}) be.deallocate(t->data);
  for (SymmetricBuffer* b : {&recv_sym, &red_sym, &members_sym, &weights_sym, &values_sym})
    comm.free_symmetric(be, *b);
}

// What the cases exercise: leads with several members, (token, rank) pairs split across windows,
// ranks that receive nothing.
struct Coverage {
  int64_t multi_member_leads = 0, split_pairs = 0, idle_ranks = 0;
};

void count_coverage(const RouteCase& c, const std::vector<Routes>& routes, int64_t cap,
                    Coverage& cov) {
  const int K = c.top_k;
  std::vector<int64_t> received(static_cast<size_t>(c.ranks), 0);
  for (const Routes& r : routes)
    for (int64_t t = 0; t < r.tokens; ++t)
      for (int k = 0; k < K; ++k) {
        const size_t i = size_t(t * K + k);
        ++received[size_t(r.rank[i])];
        for (int k2 = 0; k2 < k; ++k2) {
          const size_t j = size_t(t * K + k2);
          if (r.rank[j] != r.rank[i]) continue;
          ++(r.row[j] / cap == r.row[i] / cap ? cov.multi_member_leads : cov.split_pairs);
          break;
        }
      }
  for (int64_t v : received) cov.idle_ranks += v == 0;
}

TEST(HostCollectivesComm, DispatchAndCombineEqualInProcess) {
  Coverage cov;
  for (DType dt : {DType::f64, DType::f32})
    for (const RouteCase& c : kRouteCases) {
      SCOPED_TRACE(std::string(c.name) + " " + to_string(dt));
      int64_t max_rows = 0;
      const auto routes = make_routes(c, 7 + uint64_t(&c - kRouteCases), max_rows);
      // Every round that holds rows, and one past them (an empty window).
      const int rounds = int((max_rows + c.capacity - 1) / c.capacity) + 1;
      expect_same_records(c.ranks, dt, [&](Communicator& comm, Backend& be, int rank, Record& rec) {
        route_rounds(c, routes, c.capacity, rounds, dt, comm, be, rank, rec);
      });
      if (dt == DType::f64) count_coverage(c, routes, c.capacity, cov);
    }
  EXPECT_GT(cov.multi_member_leads, 0);
  EXPECT_GT(cov.split_pairs, 0);
  EXPECT_GT(cov.idle_ranks, 0);
}

// bf16 rows (the CUDA backend's activations): each token's lead rows summed in f32 in k order
// onto y (or zero), rounded to bf16 once.
TEST(HostCollectivesComm, CombineSumsBf16RowsInFloatAndRoundsOnce) {
  const RouteCase c{"bf16", 3, 4, 6, {7, 5, 6}, 5, false, 2};
  const int K = c.top_k, R = c.ranks;
  const int64_t H = c.hidden, cap = c.capacity;
  int64_t max_rows = 0;
  const auto routes = make_routes(c, 99, max_rows);
  const int rounds = int((max_rows + cap - 1) / cap);
  // red[d][round] as bf16 bits, y before each round per source rank.
  auto bits = [](const std::vector<double>& v) {
    std::vector<uint16_t> b;
    for (double e : v) b.push_back(to_bf16(float(e)));
    return b;
  };
  auto red_of = [&](int d, int r) {
    return bits(mixed(size_t(cap * H), 500 + uint64_t(d * 64 + r)));
  };
  auto y_of = [&](int s, int r) {
    return bits(mixed(size_t(routes[size_t(s)].tokens * H), 700 + uint64_t(s * 64 + r)));
  };
  std::vector<std::vector<std::vector<uint16_t>>> got(static_cast<size_t>(R));
  InProcessWorld world(R);
  HostRanks host_ranks(R);
  world.run([&](int rank) {
    auto be = make_cpu_backend(DType::f32);
    Communicator& comm = host_ranks(world, rank, *be);
    const Routes& mine = routes[size_t(rank)];
    const int64_t T = mine.tokens, n = T * K;
    auto [red_sym, red] = make_symmetric(comm, *be, DType::f32, {cap, H / 2});  // bf16 bytes
    auto [members_sym, members] = make_symmetric(comm, *be, DType::i32, {cap, K});
    auto [weights_sym, weights] = make_symmetric(comm, *be, DType::f32, {cap, K});
    auto [values_sym, values] = make_symmetric(comm, *be, DType::f32, {cap});
    const FanTable fan{members_sym, weights_sym, values_sym, K, DType::f32};
    std::vector<uint16_t> y(size_t(T * H));
    const RowRoute route{mine.rank.data(), mine.row.data(), nullptr, n, K};
    for (int r = 0; r < rounds; ++r) {
      const auto red_bits = red_of(rank, r);
      std::memcpy(red.data, red_bits.data(), red_bits.size() * 2);
      y = y_of(rank, r);
      const int32_t flag = r % 2;
      comm.combine(route, RoundWindow{r * cap, cap}, red_sym, Tensor(y.data(), DType::bf16, {T, H}),
                   &flag, fan, nullptr, nullptr);
      got[size_t(rank)].push_back(y);
    }
    for (SymmetricBuffer* b : {&red_sym, &members_sym, &weights_sym, &values_sym})
      comm.free_symmetric(*be, *b);
  });
  int64_t bad = 0, summed = 0;
  for (int s = 0; s < R; ++s)
    for (int r = 0; r < rounds; ++r) {
      const Routes& sr = routes[size_t(s)];
      const auto y0 = y_of(s, r);
      for (int64_t t = 0; t < sr.tokens; ++t)
        for (int64_t h = 0; h < H; ++h) {
          float acc = r % 2 ? from_bf16(y0[size_t(t * H + h)]) : 0.0f;
          for (int k = 0; k < K; ++k) {
            auto in = [&](int kk) { return sr.row[size_t(t * K + kk)] / cap == r; };
            bool lead = in(k);
            for (int k2 = 0; k2 < k && lead; ++k2)
              lead = !(in(k2) && sr.rank[size_t(t * K + k2)] == sr.rank[size_t(t * K + k)]);
            if (!lead) continue;
            const int64_t row = sr.row[size_t(t * K + k)] - r * cap;
            acc += from_bf16(red_of(sr.rank[size_t(t * K + k)], r)[size_t(row * H + h)]);
            ++summed;
          }
          bad += got[size_t(s)][size_t(r)][size_t(t * H + h)] != to_bf16(acc);
        }
    }
  EXPECT_GT(summed, 0);
  EXPECT_EQ(bad, 0);
}

// ---- clone weights and gradients --------------------------------------------------------------

TEST(HostCollectivesComm, ClonePullAndReduceEqualInProcess) {
  for (DType dt : {DType::f64, DType::f32})
    for (int R = 1; R <= 4; ++R) {
      SCOPED_TRACE("R = " + std::to_string(R) + " " + to_string(dt));
      const PlannerConfig cfg{R, 4 * R, 2, 2, 0};
      const int EPR = cfg.experts_per_rank();
      const int64_t elems = 6;
      // Two hot experts on rank 0: ECHO clones them (from 2 ranks on).
      std::vector<int32_t> map(size_t(R * cfg.experts));
      for (int s = 0; s < R; ++s)
        for (int e = 0; e < cfg.experts; ++e)
          map[size_t(s * cfg.experts + e)] = e == 0 ? 400 : e == 1 ? 250 : 10 + (s + e) % 7;
      Plan plan(cfg);
      plan_echo(map.data(), cfg, plan.view());
      if (R > 1) {
        EXPECT_GT(plan.view().num_clones[0], 0);
      }
      expect_same_records(R, dt, [&](Communicator& comm, Backend& be, int rank, Record& rec) {
        Plan mine(cfg);  // every rank plans for itself, as the layer does
        plan_echo(map.data(), cfg, mine.view());
        // Home slots symmetric (clones are pulled from them), spare slots any memory.
        auto [w_sym, w] = make_symmetric(comm, be, dt, {EPR, elems});
        std::vector<double> wv(size_t(EPR * elems));
        for (int j = 0; j < EPR; ++j)
          for (int64_t i = 0; i < elems; ++i)
            wv[size_t(j * elems + i)] = rank * 100 + j + double(i) / 64;
        write_tensor(be, w, wv);
        auto [spare_sym, spare] = make_symmetric(comm, be, dt, {cfg.spare_slots, elems});
        write_tensor(be, spare, std::vector<double>(size_t(cfg.spare_slots * elems), -1.0));
        comm.pull_clone_weights(mine.view(), cfg, w_sym, spare.data, size_t(elems) * dtype_size(dt),
                                nullptr);
        rec.add("weights", w);
        rec.add("spare weights", spare);
        // Clone gradients symmetric (their home ranks read them), home gradients any memory.
        auto [g_sym, g] = make_symmetric(comm, be, dt, {cfg.spare_slots, elems});
        write_tensor(be, g, mixed(size_t(cfg.spare_slots * elems), 60 + uint64_t(rank)));
        auto [h_sym, home] = make_symmetric(comm, be, dt, {EPR, elems});
        write_tensor(be, home, mixed(size_t(EPR * elems), 90 + uint64_t(rank)));
        comm.reduce_clone_grads(mine.view(), cfg, g_sym, home.data, elems, dt, nullptr);
        rec.add("gradients", home);
        comm.free_symmetric(be, w_sym);
        comm.free_symmetric(be, spare_sym);
        comm.free_symmetric(be, h_sym);
        comm.free_symmetric(be, g_sym);
      });
    }
}

// ---- the whole layer --------------------------------------------------------------------------

size_t differing(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(double)) != 0;
  return n;
}

TEST(HostCollectivesLayer, EqualsInProcessLayerBitForBit) {
  for (DType dt : {DType::f64, DType::f32})
    for (int R : {2, 4})
      for (bool spill : {false, true}) {
        test::LayerCase c;
        c.moe.hidden = 16;
        c.moe.ffn = 12;
        c.moe.experts = 16;
        c.moe.top_k = spill ? 4 : 2;
        c.moe.max_tokens = 32;
        c.moe.aux_loss_coeff = 0.01;
        c.moe.z_loss_coeff = 0.001;
        c.ranks = R;
        c.dtype = dt;
        c.echo.enabled = true;
        c.echo.spare_slots_per_rank = 2;
        c.echo.max_clones_per_expert = 2;
        c.moe.capacity_factor = spill ? 0.3 : 1.25;  // spill rounds on busy ranks
        c.passes = spill ? 2 : 1;                    // gradients accumulate over spill rounds
        SCOPED_TRACE("R = " + std::to_string(R) + (spill ? " spill" : " skewed") + " " +
                     to_string(dt));
        const test::SkewedInput in = test::skewed(c, 32, 1.5, 11 + uint64_t(R));
        std::vector<std::vector<double>> g;
        for (int r = 0; r < R; ++r) g.push_back(test::random_values(32 * 16, 300 + uint64_t(r)));
        const test::LayerRun want = test::run_layer(c, in.x, g, in.params);
        HostRanks host_ranks(R);
        const test::LayerRun got = test::run_layer(
            c, in.x, g, in.params, [&](InProcessWorld& w, int r, Backend& be) -> Communicator& {
              return host_ranks(w, r, be);
            });
        EXPECT_GT(want.stats[0].clones, 0) << "skewed routing should make ECHO clone";
        if (spill) {
          EXPECT_GT(want.stats[0].spill_rounds, 0);
        }
        EXPECT_EQ(got.stats[0].clones, want.stats[0].clones);
        EXPECT_EQ(got.stats[0].spill_rounds, want.stats[0].spill_rounds);
        for (int r = 0; r < R; ++r) {
          EXPECT_EQ(differing(got.y[size_t(r)], want.y[size_t(r)]), 0u) << "y of rank " << r;
          EXPECT_EQ(differing(got.dx[size_t(r)], want.dx[size_t(r)]), 0u) << "dx of rank " << r;
          EXPECT_EQ(differing(got.d_router[size_t(r)], want.d_router[size_t(r)]), 0u)
              << "router gradient of rank " << r;
        }
        EXPECT_EQ(differing(got.dw1, want.dw1), 0u) << "dw1";
        EXPECT_EQ(differing(got.dw2, want.dw2), 0u) << "dw2";
        if (c.passes == 1) {  // home gradients in the caller's tensors: clones reduced there
          c.backward_into = true;
          HostRanks into_ranks(R);
          const test::LayerRun into = test::run_layer(
              c, in.x, g, in.params, [&](InProcessWorld& w, int r, Backend& be) -> Communicator& {
                return into_ranks(w, r, be);
              });
          EXPECT_EQ(differing(into.dw1, want.dw1), 0u) << "dw1 (backward_into)";
          EXPECT_EQ(differing(into.dw2, want.dw2), 0u) << "dw2 (backward_into)";
        }
      }
}

// ---- bad use -----------------------------------------------------------------------------------

// The message of the moe_echo::Error some rank throws running `body` over the host-collectives
// communicator on R ranks ("" when none does).
std::string host_error(int R, const Body& body) {
  try {
    run_ranks(R, DType::f32, true, body);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& message, const std::string& part) {
  return message.find(part) != std::string::npos;
}

// The error of `body` (as host_error) names `part`.
void expect_error(int R, const std::string& part, const Body& body) {
  const std::string message = host_error(R, body);
  EXPECT_TRUE(has(message, part)) << "wanted \"" << part << "\" in: " << message;
}

// A window of `rows` rows of H floats with its fan table, and one token's route (top_k 2).
struct SmallWindow {
  SmallWindow(Communicator& comm, Backend& be, int64_t rows, int64_t H) : comm_(comm), be_(be) {
    std::tie(recv_sym, recv) = make_symmetric(comm, be, DType::f32, {rows, H});
    std::tie(fan.members, std::ignore) = make_symmetric(comm, be, DType::i32, {rows, 2});
    std::tie(fan.weights, std::ignore) = make_symmetric(comm, be, DType::f32, {rows, 2});
    std::tie(fan.values, std::ignore) = make_symmetric(comm, be, DType::f32, {rows});
    fan.top_k = 2;
  }
  ~SmallWindow() {
    for (SymmetricBuffer* b : {&recv_sym, &fan.members, &fan.weights, &fan.values})
      comm_.free_symmetric(be_, *b);
  }
  Communicator& comm_;
  Backend& be_;
  SymmetricBuffer recv_sym;
  Tensor recv;
  FanTable fan;
  int32_t dest_rank[2] = {0, 0}, dest_row[2] = {0, 1};
  float x[8] = {};
  RowRoute route() { return RowRoute{dest_rank, dest_row, nullptr, 2, 2}; }
};

// A symmetric buffer freed when its case ends, also when the op under test throws.
struct ScopedSymmetric {
  ScopedSymmetric(Communicator& comm, Backend& be, size_t bytes)
      : comm_(comm), be_(be), buf(comm.alloc_symmetric(be, bytes)) {}
  ~ScopedSymmetric() { comm_.free_symmetric(be_, buf); }
  Communicator& comm_;
  Backend& be_;
  SymmetricBuffer buf;
};

TEST(HostCollectivesComm, BadUseThrowsClearErrors) {
  {
    // Each rank names the other's size, and either may throw first.
    const std::string m = host_error(2, [](Communicator& comm, Backend& be, int rank, Record&) {
      comm.alloc_symmetric(be, size_t(rank ? 72 : 64));
    });
    EXPECT_TRUE(has(m, "symmetric buffer 0: rank 0 allocates 64 bytes, rank 1 72") ||
                has(m, "symmetric buffer 0: rank 1 allocates 72 bytes, rank 0 64"))
        << m;
  }
  expect_error(1, "not the one this communicator was made with",
               [](Communicator& comm, Backend&, int, Record&) {
                 auto other = make_cpu_backend(DType::f32);
                 comm.alloc_symmetric(*other, 64);
               });
  expect_error(2, "a window of 5 rows does not fit the symmetric buffers",
               [](Communicator& comm, Backend& be, int, Record&) {
                 SmallWindow w(comm, be, 4, 4);
                 comm.dispatch(w.route(), RoundWindow{0, 5}, w.x, 16, w.recv_sym, w.fan, nullptr);
               });
  expect_error(2, "fan table of top_k 3 for a route of top_k 2",
               [](Communicator& comm, Backend& be, int, Record&) {
                 SmallWindow w(comm, be, 4, 4);
                 w.fan.top_k = 3;
                 comm.dispatch(w.route(), RoundWindow{0, 4}, w.x, 16, w.recv_sym, w.fan, nullptr);
               });
  expect_error(2, "entry 1 in the window is routed to rank 2 of 2",
               [](Communicator& comm, Backend& be, int, Record&) {
                 SmallWindow w(comm, be, 4, 4);
                 w.dest_rank[1] = 2;
                 comm.dispatch(w.route(), RoundWindow{0, 4}, w.x, 16, w.recv_sym, w.fan, nullptr);
               });
  expect_error(2, "written twice", [](Communicator& comm, Backend& be, int rank, Record&) {
    SmallWindow w(comm, be, 4, 4);
    w.dest_row[0] = 1;  // both ranks' first entries on row 1 of rank 0
    w.dest_rank[1] = 1;
    w.dest_row[1] = rank;
    comm.dispatch(w.route(), RoundWindow{0, 4}, w.x, 16, w.recv_sym, w.fan, nullptr);
  });
  expect_error(2, "combine: y f32[3, 4] for 2 entries of top_k 2",
               [](Communicator& comm, Backend& be, int, Record&) {
                 SmallWindow w(comm, be, 4, 4);
                 float y[12] = {};
                 comm.combine(w.route(), RoundWindow{0, 4}, w.recv_sym,
                              Tensor(y, DType::f32, {3, 4}), nullptr, w.fan, nullptr, nullptr);
               });
  expect_error(
      2, "pull_clone_weights: symmetric buffer 0 is not a live buffer",
      [](Communicator& comm, Backend& be, int, Record&) {
        SymmetricBuffer b = comm.alloc_symmetric(be, 64);
        comm.free_symmetric(be, b);
        b.local = &b;  // a stale copy
        comm.pull_clone_weights(PlanView{}, PlannerConfig{2, 2, 1, 1, 0}, b, nullptr, 8, nullptr);
      });
  expect_error(2, "pull_clone_weights: 72 bytes into a symmetric buffer of 64",
               [](Communicator& comm, Backend& be, int, Record&) {
                 ScopedSymmetric b(comm, be, 64);
                 comm.pull_clone_weights(PlanView{}, PlannerConfig{2, 2, 1, 1, 0}, b.buf,
                                         b.buf.local, 72, nullptr);
               });
  expect_error(2, "plan of 4 ranks, 8 experts, 1 spare slots, 1 clones on a communicator of 2",
               [](Communicator& comm, Backend& be, int, Record&) {
                 ScopedSymmetric b(comm, be, 64);
                 comm.reduce_clone_grads(PlanView{}, PlannerConfig{4, 8, 1, 1, 0}, b.buf,
                                         b.buf.local, 2, DType::f32, nullptr);
               });
  expect_error(1, "all_reduce_sum supports f32 and f64, not i32",
               [](Communicator& comm, Backend&, int, Record&) {
                 int32_t v[4] = {};
                 comm.all_reduce_sum(Tensor(v, DType::i32, {4}), nullptr);
               });

  // Collectives whose rank lies outside their size.
  struct Lone final : HostCollectives {
    int rank() const override { return 2; }
    int size() const override { return 2; }
    void all_gather(const void*, void*, size_t) override {}
    void all_to_all_v(const void*, const std::vector<size_t>&, void*,
                      const std::vector<size_t>&) override {}
    void barrier() override {}
  } lone;
  auto be = make_cpu_backend(DType::f32);
  EXPECT_TRUE(has(test::config_error([&] { make_host_collectives_communicator(lone, *be); }),
                  "HostCollectives::rank() = 2 is invalid: allowed 0 <= rank < size (2)"));
}

}  // namespace
}  // namespace moe_echo
