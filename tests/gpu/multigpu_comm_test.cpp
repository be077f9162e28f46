// The NCCL communicator's ops across ranks, each against the in-process semantics:
// - dispatch/combine: self-describing rows (every byte a function of source rank, source row and
//   position) routed by a global random permutation into two receive windows; nothing lost,
//   duplicated or corrupted, receive rows nobody routed keep their sentinel, and combine brings
//   every routed row back (entries outside the window keep theirs). Row sizes cover every copy
//   width (16, 8, 4, 2, 1 byte words); entry counts include ranks with no entries. Both
//   dispatchers (sync-free and baseline).
// - all_gather_i32 exact; all_reduce_sum bit-exact to a rank-order double sum on the LSA path,
//   identical bits on every rank through ncclAllReduce.
// - pull_clone_weights / reduce_clone_grads on a hand-made plan whose clones live on other ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_test_util.hpp"
#include "multigpu_world.hpp"

namespace moe_echo::test {
namespace {

uint8_t byte_of(int src, int64_t row, size_t at) {
  return uint8_t((uint64_t(src) * 0x9e37u + uint64_t(row) * 131u + uint64_t(at) * 7u + 1u) & 0xffu);
}

// Routes of every rank, drawn from one seed (every rank computes the same): entry i of rank s
// goes to (rank[s][i], row[s][i]) or nowhere (-1, -1); rows at each destination are a random
// permutation of [0, incoming[d]).
struct GlobalRoutes {
  std::vector<std::vector<int32_t>> rank, row;
  std::vector<int64_t> incoming;
};

GlobalRoutes make_routes(int R, const std::vector<int64_t>& n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  GlobalRoutes g;
  g.rank.resize(size_t(R));
  g.row.resize(size_t(R));
  g.incoming.assign(size_t(R), 0);
  std::vector<std::vector<std::pair<int, int64_t>>> to(static_cast<size_t>(R));
  for (int s = 0; s < R; ++s) {
    g.rank[size_t(s)].assign(size_t(n[size_t(s)]), -1);
    g.row[size_t(s)].assign(size_t(n[size_t(s)]), -1);
    for (int64_t i = 0; i < n[size_t(s)]; ++i) {
      if (rng() % 7 == 0) continue;
      const int d = int(rng() % uint64_t(R));
      to[size_t(d)].push_back({s, i});
    }
  }
  for (int d = 0; d < R; ++d) {
    auto& v = to[size_t(d)];
    std::shuffle(v.begin(), v.end(), rng);
    g.incoming[size_t(d)] = int64_t(v.size());
    for (size_t j = 0; j < v.size(); ++j) {
      g.rank[size_t(v[j].first)][size_t(v[j].second)] = d;
      g.row[size_t(v[j].first)][size_t(v[j].second)] = int32_t(j);
    }
  }
  return g;
}

struct DeviceBytes {
  Backend& be;
  void* p;
  size_t n;
  DeviceBytes(Backend& b, size_t bytes)
      : be(b), p(b.allocate(std::max<size_t>(bytes, 1))), n(bytes) {}
  ~DeviceBytes() { be.deallocate(p); }
  void put(const std::vector<uint8_t>& v) { be.copy_from_host(p, v.data(), v.size()); }
  std::vector<uint8_t> get() const {
    std::vector<uint8_t> v(n);
    be.copy_to_host(v.data(), p, n);
    return v;
  }
};

class MultiGpuRows : public ::testing::TestWithParam<Dispatcher> {};

TEST_P(MultiGpuRows, DispatchAndCombineMoveEveryRowOnce) {
  MOE_ECHO_MULTIGPU_WORLD(w);
  Backend& be = *w->be;
  Communicator& comm = w->comm(GetParam());
  const int R = w->size(), me = w->rank();
  EXPECT_EQ(comm.rank(), me);
  EXPECT_EQ(comm.size(), R);
  struct Counts {
    const char* name;
    std::vector<int64_t> n;
  };
  std::vector<Counts> cases = {{"none", std::vector<int64_t>(size_t(R), 0)},
                               {"one", std::vector<int64_t>(size_t(R), 1)},
                               {"uneven", {}},
                               {"rank1_empty", {}}};
  for (int s = 0; s < R; ++s) {
    cases[2].n.push_back(257 + 13 * s);
    cases[3].n.push_back(s == 1 ? 0 : 300);
  }
  int case_id = 0;
  for (const Counts& c : cases)
    for (size_t row_bytes : {size_t(4096), size_t(72), size_t(36), size_t(74), size_t(37)})
      for (int src_div : {1, 3}) {
        SCOPED_TRACE(std::string(c.name) + " row_bytes " + std::to_string(row_bytes) + " src_div " +
                     std::to_string(src_div));
        const GlobalRoutes g = make_routes(R, c.n, 1000 + uint64_t(case_id++));
        const int64_t n = c.n[size_t(me)];
        const int64_t max_in = *std::max_element(g.incoming.begin(), g.incoming.end());
        const int64_t half = max_in / 2 + 1;
        auto src_rows = [&](int s) { return (c.n[size_t(s)] + src_div - 1) / src_div; };
        std::vector<uint8_t> src(size_t(src_rows(me)) * row_bytes);
        for (int64_t r = 0; r < src_rows(me); ++r)
          for (size_t b = 0; b < row_bytes; ++b) src[size_t(r) * row_bytes + b] = byte_of(me, r, b);
        OwnedTensor dr(be, DType::i32, {std::max<int64_t>(n, 1)}),
            dw(be, DType::i32, {std::max<int64_t>(n, 1)});
        std::vector<double> rk(g.rank[size_t(me)].begin(), g.rank[size_t(me)].end()),
            rw(g.row[size_t(me)].begin(), g.row[size_t(me)].end());
        rk.resize(size_t(std::max<int64_t>(n, 1)), -1);
        rw.resize(size_t(std::max<int64_t>(n, 1)), -1);
        dr.write(rk);
        dw.write(rw);
        DeviceBytes src_d(be, src.size());
        if (!src.empty()) src_d.put(src);
        const RowRoute route{dr->as<int32_t>(), dw->as<int32_t>(), n, src_div};
        SymmetricBuffer recv = comm.alloc_symmetric(be, size_t(half) * row_bytes);
        for (RoundWindow win : {RoundWindow{0, half}, RoundWindow{half, half}}) {
          DeviceBytes gathered(be, size_t(n) * row_bytes + 1);
          be.copy_from_host(recv.local, std::vector<uint8_t>(recv.bytes, 0xAB).data(), recv.bytes);
          gathered.put(std::vector<uint8_t>(gathered.n, 0xCD));
          be.synchronize();
          comm.barrier();  // every sentinel is in place before any rank writes
          comm.dispatch(route, win, src_d.p, row_bytes, recv, nullptr);
          comm.combine(route, win, recv, row_bytes, gathered.p, nullptr);
          be.synchronize();
          std::vector<uint8_t> got(recv.bytes);
          be.copy_to_host(got.data(), recv.local, recv.bytes);
          const auto back = gathered.get();
          // My receive window: every global entry routed here inside the window, once.
          std::vector<int> hits(size_t(win.rows), 0);
          int64_t bad = 0;
          for (int s = 0; s < R; ++s)
            for (int64_t i = 0; i < c.n[size_t(s)]; ++i) {
              if (g.rank[size_t(s)][size_t(i)] != me) continue;
              const int64_t row = g.row[size_t(s)][size_t(i)] - win.row_lo;
              if (row < 0 || row >= win.rows) continue;
              ++hits[size_t(row)];
              for (size_t b = 0; b < row_bytes; ++b)
                bad += got[size_t(row) * row_bytes + b] != byte_of(s, i / src_div, b);
            }
          EXPECT_EQ(bad, 0) << "corrupted bytes in the receive window (window at " << win.row_lo
                            << ")";
          int64_t dup = 0, untouched_bad = 0;
          for (int64_t row = 0; row < win.rows; ++row) {
            dup += hits[size_t(row)] > 1;
            if (hits[size_t(row)] == 0)
              for (size_t b = 0; b < row_bytes; ++b)
                untouched_bad += got[size_t(row) * row_bytes + b] != 0xAB;
          }
          EXPECT_EQ(dup, 0);
          EXPECT_EQ(untouched_bad, 0) << "receive rows nobody routed lost their sentinel";
          // Combine: my in-window entries come back as my own rows; the rest keep the sentinel.
          int64_t back_bad = 0;
          for (int64_t i = 0; i < n; ++i) {
            const int64_t row = g.row[size_t(me)][size_t(i)] - win.row_lo;
            const bool in = g.rank[size_t(me)][size_t(i)] >= 0 && row >= 0 && row < win.rows;
            for (size_t b = 0; b < row_bytes; ++b)
              back_bad +=
                  back[size_t(i) * row_bytes + b] != (in ? byte_of(me, i / src_div, b) : 0xCD);
          }
          EXPECT_EQ(back_bad, 0) << "combined rows wrong";
          EXPECT_EQ(back.back(), 0xCD) << "combine wrote past the last entry";
        }
        comm.free_symmetric(be, recv);
      }
}

INSTANTIATE_TEST_SUITE_P(Dispatchers, MultiGpuRows,
                         ::testing::Values(Dispatcher::syncfree, Dispatcher::baseline),
                         [](const auto& p) { return std::string(to_string(p.param)); });

TEST(MultiGpuCollectives, AllGatherAndAllReduce) {
  MOE_ECHO_MULTIGPU_WORLD(w);
  Backend& be = *w->be;
  const int R = w->size(), me = w->rank();
  for (Dispatcher d : {Dispatcher::syncfree, Dispatcher::baseline}) {
    SCOPED_TRACE(to_string(d));
    Communicator& comm = w->comm(d);
    for (int64_t n : {int64_t(5), int64_t(300)}) {
      OwnedTensor local(be, DType::i32, {n}), all(be, DType::i32, {R * n});
      std::vector<double> lv(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) lv[size_t(i)] = me * 1000 + i;
      local.write(lv);
      poison(all);
      comm.all_gather_i32(local->as<int32_t>(), all->as<int32_t>(), n, nullptr);
      const auto got = all.read();
      int64_t bad = 0;
      for (int r = 0; r < R; ++r)
        for (int64_t i = 0; i < n; ++i) bad += got[size_t(r * n + i)] != r * 1000 + i;
      EXPECT_EQ(bad, 0) << "all_gather n " << n;
    }
    // f32 and f64: values of every rank are known to all (seeded by rank), so the rank-order
    // double sum is the expected value.
    for (DType dt : {DType::f32, DType::f64})
      for (int64_t n : {int64_t(1), int64_t(1000), int64_t(5000)}) {
        SCOPED_TRACE(std::string(to_string(dt)) + " n " + std::to_string(n));
        std::vector<std::vector<double>> v(static_cast<size_t>(R));
        for (int r = 0; r < R; ++r) {
          v[size_t(r)] = random_values(size_t(n), 77 + uint64_t(r) * 13 + uint64_t(n), -3, 3);
          if (dt == DType::f32) v[size_t(r)] = round_f32(v[size_t(r)]);
        }
        OwnedTensor t(be, dt, {n});
        t.write(v[size_t(me)]);
        comm.all_reduce_sum(*t, nullptr);
        const auto got = t.read();
        const bool lsa =
            size_t(n) * dtype_size(dt) <= (d == Dispatcher::baseline ? 4096u : (16u << 20));
        double max_err = 0;  // over the sum of magnitudes
        int64_t inexact = 0;
        for (int64_t i = 0; i < n; ++i) {
          double sum = 0, scale = 1e-30;
          for (int r = 0; r < R; ++r) {
            sum += v[size_t(r)][size_t(i)];
            scale += std::abs(v[size_t(r)][size_t(i)]);
          }
          const double want = dt == DType::f32 ? double(float(sum)) : sum;
          inexact += got[size_t(i)] != want;
          max_err = std::max(max_err, std::abs(got[size_t(i)] - want) / scale);
        }
        if (lsa) {
          EXPECT_EQ(inexact, 0) << "LSA all-reduce must equal the rank-order double sum";
        } else {
          EXPECT_LT(max_err, dt == DType::f32 ? 1e-6 : 1e-14) << "ncclAllReduce path";
        }
        // Identical bits on every rank.
        const auto every = w->all_gather(got);
        for (int r = 0; r < R; ++r) EXPECT_EQ(every[size_t(r)], got) << "rank " << r << " differs";
      }
  }
}

// Plan: E = 2R experts (two per rank), S = 2 spare slots, M = 3. Rank r's spare slot 0 clones
// expert 0 of rank r + 1; odd ranks' spare slot 1 clones expert 1 of rank r - 1; rank 2's spare
// slot 1 clones expert 0 of rank 1 when R > 2 (that expert's second clone); the rest stay empty.
// Replicas of each expert in ascending (rank, slot) order.
TEST(MultiGpuClones, PullWeightsAndReduceGradientsFollowThePlan) {
  MOE_ECHO_MULTIGPU_WORLD(w);
  Backend& be = *w->be;
  const int R = w->size(), me = w->rank();
  PlannerConfig cfg;
  cfg.ranks = R;
  cfg.experts = 2 * R;
  cfg.spare_slots = 2;
  cfg.max_clones = 2;
  const int EPR = 2, S = 2, M = 3, E = cfg.experts;
  Plan plan(cfg);
  PlanView pv = plan.view();
  for (int i = 0; i < R * S; ++i) pv.spare_expert[i] = -1;
  for (int i = 0; i < E * M; ++i)
    pv.replica_rank[i] = pv.replica_slot[i] = -1, pv.replica_rows[i] = 0;
  for (int r = 0; r < R; ++r) {
    pv.spare_expert[r * S + 0] = ((r + 1) % R) * EPR + 0;
    if (r % 2 == 1) pv.spare_expert[r * S + 1] = ((r + R - 1) % R) * EPR + 1;
  }
  if (R > 2) pv.spare_expert[2 * S + 1] = 1 * EPR + 0;  // expert 2's second clone
  int clones = 0;
  for (int e = 0; e < E; ++e) {
    pv.replica_rank[e * M] = e / EPR;
    pv.replica_slot[e * M] = e % EPR;
    int j = 1;
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < S; ++s)
        if (pv.spare_expert[r * S + s] == e) {
          ASSERT_LT(j, M);
          pv.replica_rank[e * M + j] = r;
          pv.replica_slot[e * M + j] = EPR + s;
          ++j;
          ++clones;
        }
  }
  pv.num_clones[0] = clones;
  OwnedTensor plan_d(be, DType::i32, {plan_ints(cfg)});
  plan_d.write(std::vector<double>(plan.storage.begin(), plan.storage.end()));
  const PlanView dplan = plan_view(plan_d->as<int32_t>(), cfg);

  for (Dispatcher d : {Dispatcher::syncfree, Dispatcher::baseline}) {
    Communicator& comm = w->comm(d);
    for (size_t slot_bytes : {size_t(3 * 4096), size_t(1998)}) {
      SCOPED_TRACE(std::string(to_string(d)) + " slot_bytes " + std::to_string(slot_bytes));
      auto wbyte = [](int r, int slot, size_t b) {
        return uint8_t((r * 31 + slot * 17 + b * 3 + 5) & 0xff);
      };
      SymmetricBuffer wb = comm.alloc_symmetric(be, size_t(EPR + S) * slot_bytes);
      std::vector<uint8_t> mine(size_t(EPR + S) * slot_bytes);
      for (int slot = 0; slot < EPR + S; ++slot)
        for (size_t b = 0; b < slot_bytes; ++b)
          mine[size_t(slot) * slot_bytes + b] = wbyte(me, slot, b);
      be.copy_from_host(wb.local, mine.data(), mine.size());
      comm.barrier();
      comm.pull_clone_weights(dplan, cfg, wb, slot_bytes, nullptr);
      be.synchronize();
      std::vector<uint8_t> got(mine.size());
      be.copy_to_host(got.data(), wb.local, got.size());
      int64_t bad = 0;
      for (int slot = 0; slot < EPR + S; ++slot) {
        const int e = slot >= EPR ? pv.spare_expert[me * S + (slot - EPR)] : -1;
        for (size_t b = 0; b < slot_bytes; ++b) {
          const uint8_t want = e >= 0 ? wbyte(e / EPR, e % EPR, b) : wbyte(me, slot, b);
          bad += got[size_t(slot) * slot_bytes + b] != want;
        }
      }
      EXPECT_EQ(bad, 0) << "pulled clone weights";
      comm.barrier();
      comm.free_symmetric(be, wb);
    }
    // Gradients: small integers, so every order of summation is exact.
    for (DType dt : {DType::f32, DType::f64}) {
      SCOPED_TRACE(std::string(to_string(d)) + " " + to_string(dt));
      const int64_t slot_elems = 1001;
      auto gval = [](int r, int slot, int64_t x) {
        return double((r * 7 + slot * 3 + x) % 17 - 8);
      };
      SymmetricBuffer gb =
          comm.alloc_symmetric(be, size_t(EPR + S) * size_t(slot_elems) * dtype_size(dt));
      Tensor gt(gb.local, dt, {int64_t(EPR + S), slot_elems});
      std::vector<double> gv(size_t((EPR + S) * slot_elems));
      for (int slot = 0; slot < EPR + S; ++slot)
        for (int64_t x = 0; x < slot_elems; ++x)
          gv[size_t(slot * slot_elems + x)] = gval(me, slot, x);
      write_tensor(be, gt, gv);
      comm.barrier();
      comm.reduce_clone_grads(dplan, cfg, gb, slot_elems, dt, nullptr);
      be.synchronize();
      const auto got = read_tensor(be, gt);
      int64_t bad = 0;
      for (int slot = 0; slot < EPR + S; ++slot)
        for (int64_t x = 0; x < slot_elems; ++x) {
          double want = gval(me, slot, x);
          if (slot < EPR) {
            const int e = me * EPR + slot;
            for (int j = 1; j < M; ++j)
              if (pv.replica_rank[e * M + j] >= 0)
                want += gval(pv.replica_rank[e * M + j], pv.replica_slot[e * M + j], x);
          }
          bad += got[size_t(slot * slot_elems + x)] != want;
        }
      EXPECT_EQ(bad, 0) << "reduced clone gradients";
      comm.barrier();
      comm.free_symmetric(be, gb);
    }
  }
}

}  // namespace
}  // namespace moe_echo::test
