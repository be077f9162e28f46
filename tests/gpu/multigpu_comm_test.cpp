// The NCCL communicator's ops across ranks, each against the in-process semantics:
// - dispatch/combine (comm.hpp's leads and members): token rows encoding source rank, token and
//   byte position, routed by a global random permutation with several entries of a token on one
//   rank, into two spill windows; lead rows, the fan table (members, weights) exactly, rows that
//   are no lead untouched; combine sums against fp64 with the accumulate flag off, 0 and 1,
//   values_out per entry; row sizes for every copy width, bf16/f32/f64 rows, f32/f64 fan floats,
//   ranks with no tokens, top_k 1 to 32; both dispatchers, whose combines agree bit for bit.
// - all_gather_i32 exact; all_reduce_sum bit-exact to a rank-order double sum on the LSA path,
//   identical bits on every rank through ncclAllReduce.
// - pull_clone_weights / reduce_clone_grads on a hand-made plan whose clones live on other ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_test_util.hpp"
#include "multigpu_world.hpp"

namespace moe_echo::test {
namespace {

uint8_t byte_of(int src, int64_t token, size_t at) {
  return uint8_t((uint64_t(src) * 0x9e37u + uint64_t(token) * 131u + uint64_t(at) * 7u + 1u) &
                 0xffu);
}

// A value in [-1, 1) that every rank computes alike from (a, b, c).
double hashed(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t z = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^
               (c + 0x8CB92BA72F3D8DD7ull) * 0x94D049BB133111EBull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return double(z >> 11) * 0x1.0p-52 - 1.0;
}

double round_to(DType dt, double v) {
  return dt == DType::bf16 ? round_bf16(v) : dt == DType::f32 ? double(float(v)) : v;
}

// Routes of every rank, drawn from one seed (every rank computes the same): entry (t, k) of rank s
// goes to (rank[s][i], row[s][i]) or nowhere (-1, -1). Tokens pick ranks with repeats, so a token
// often has several entries on one rank; rows at each destination are a random permutation of
// [0, incoming[d]).
struct GlobalRoutes {
  std::vector<std::vector<int32_t>> rank, row;
  std::vector<int64_t> incoming;
};

GlobalRoutes make_routes(int R, const std::vector<int64_t>& tokens, int K, uint64_t seed) {
  std::mt19937_64 rng(seed);
  GlobalRoutes g;
  g.rank.resize(size_t(R));
  g.row.resize(size_t(R));
  g.incoming.assign(size_t(R), 0);
  std::vector<std::vector<std::pair<int, int64_t>>> to(static_cast<size_t>(R));
  for (int s = 0; s < R; ++s) {
    const int64_t n = tokens[size_t(s)] * K;
    g.rank[size_t(s)].assign(size_t(n), -1);
    g.row[size_t(s)].assign(size_t(n), -1);
    for (int64_t i = 0; i < n; ++i) {
      if (rng() % 8 == 0) continue;
      to[rng() % uint64_t(R)].push_back({s, i});
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

struct RowCase {
  std::string name;
  std::vector<int64_t> tokens;  // per rank
  int K;
  size_t row_bytes;  // dispatched token rows (any byte size: every copy width)
  DType y;           // combine rows
  int64_t H;
  DType fl;  // fan table floats
  bool weighted, values;
};

std::vector<RowCase> row_cases(int R) {
  auto per_rank = [R](auto f) {
    std::vector<int64_t> v;
    for (int s = 0; s < R; ++s) v.push_back(f(s));
    return v;
  };
  const DType bf = DType::bf16, f32 = DType::f32, f64 = DType::f64;
  return {
      {"k8_h2048", per_rank([](int s) { return 100 + 13 * s; }), 8, 4096, bf, 2048, f32, true,
       true},
      {"k3_odd_rows", per_rank([](int s) { return 257 + 13 * s; }), 3, 72, bf, 37, f32, false,
       true},
      {"k1", per_rank([](int) { return 300; }), 1, 36, f32, 36, f32, true, true},
      {"rank1_empty", per_rank([](int s) { return s == 1 ? 0 : 300; }), 6, 74, f32, 37, f32, true,
       false},
      {"k32_one_token", per_rank([](int) { return 1; }), 32, 37, bf, 64, f32, true, true},
      {"no_tokens", per_rank([](int) { return 0; }), 4, 4096, bf, 2048, f32, true, true},
      {"f64", per_rank([](int s) { return 90 + s; }), 5, 4096, f64, 40, f64, true, true},
      {"grid_stride", per_rank([](int s) { return 3000 + 7 * s; }), 2, 80, bf, 40, f32, true, true},
  };
}

// Dispatch and combine on both dispatchers, two spill windows, against the host's reading of
// comm.hpp: lead rows carry the token row (bytes of source rank, token, position), the fan table
// holds each lead's members (the lead, then k order, -1 padded) and weights, non-lead rows get
// members[q][0] = -1 and keep their receive-row sentinel, untargeted rows keep every sentinel; the
// combine sums the leads' red rows (values hashed from rank, row, column) onto y (accumulate flag
// nullptr, 0 or 1) against an fp64 sum, pulls values_out per entry, and gives the same bits on both
// dispatchers.
TEST(MultiGpuRows, DispatchAndCombineMoveOneRowPerTokenAndRank) {
  MOE_ECHO_MULTIGPU_WORLD(w);
  Backend& be = *w->be;
  const int R = w->size(), me = w->rank();
  for (CommKind k : kAllComms) {
    EXPECT_EQ(w->comm(k).rank(), me);
    EXPECT_EQ(w->comm(k).size(), R);
    // The baseline switches to host-API mode on ranks that span NVLink teams (nodes).
    if (k != CommKind::baseline) {
      EXPECT_EQ(nccl_uses_host_api(w->comm(k)), k == CommKind::host_api) << to_string(k);
    }
  }
  int case_id = 0;
  int64_t nonleads_seen = 0;
  for (const RowCase& c : row_cases(R)) {
    SCOPED_TRACE(c.name);
    const uint64_t seed = 1000 + uint64_t(case_id++);
    const int K = c.K;
    const size_t fl = dtype_size(c.fl), ys = dtype_size(c.y);
    const GlobalRoutes g = make_routes(R, c.tokens, K, seed);
    const int64_t T = c.tokens[size_t(me)], n = T * K, H = c.H;
    const int64_t max_in = *std::max_element(g.incoming.begin(), g.incoming.end());
    const int64_t half = max_in / 2 + 1;
    auto weight_of = [&](int s, int64_t i) {
      return c.weighted ? round_to(c.fl, hashed(seed, uint64_t(s), uint64_t(i)) + 1.5) : 1.0;
    };
    auto red_of = [&](int rank, int64_t q, int64_t h) {
      return round_to(c.y, hashed(seed + 7, uint64_t(rank) * 1000003u + uint64_t(q), uint64_t(h)));
    };
    auto value_of = [&](int rank, int64_t q) {
      return round_to(c.fl, hashed(seed + 9, uint64_t(rank), uint64_t(q)) * 10);
    };
    auto in_window = [&](int s, int64_t i, RoundWindow win) {
      const int64_t q = g.row[size_t(s)][size_t(i)] - win.row_lo;
      return g.rank[size_t(s)][size_t(i)] >= 0 && q >= 0 && q < win.rows;
    };
    // The lead of a (token, rank) pair: its entry in the window with the lowest receive row.
    auto is_lead = [&](int s, int64_t i, RoundWindow win) {
      for (int64_t j = i - i % K; j < i - i % K + K; ++j)
        if (j != i && in_window(s, j, win) &&
            g.rank[size_t(s)][size_t(j)] == g.rank[size_t(s)][size_t(i)] &&
            g.row[size_t(s)][size_t(j)] < g.row[size_t(s)][size_t(i)])
          return false;
      return true;
    };

    // This rank's inputs.
    std::vector<uint8_t> src(size_t(T) * c.row_bytes);
    for (int64_t t = 0; t < T; ++t)
      for (size_t b = 0; b < c.row_bytes; ++b) src[size_t(t) * c.row_bytes + b] = byte_of(me, t, b);
    DeviceBytes src_d(be, src.size());
    if (!src.empty()) src_d.put(src);
    const int64_t n1 = std::max<int64_t>(n, 1);
    OwnedTensor dr(be, DType::i32, {n1}), dw(be, DType::i32, {n1}), wt(be, c.fl, {n1});
    {
      std::vector<double> rk(size_t(n1), -1), rw(size_t(n1), -1), wv(size_t(n1), 0);
      for (int64_t i = 0; i < n; ++i) {
        rk[size_t(i)] = g.rank[size_t(me)][size_t(i)];
        rw[size_t(i)] = g.row[size_t(me)][size_t(i)];
        wv[size_t(i)] = weight_of(me, i);
      }
      dr.write(rk);
      dw.write(rw);
      wt.write(wv);
    }
    const RowRoute route{dr->as<int32_t>(), dw->as<int32_t>(), c.weighted ? wt->data : nullptr, n,
                         K};
    std::vector<double> y0 = random_values(size_t(std::max<int64_t>(T, 1) * H), seed + 3, -2, 2);
    for (double& x : y0) x = round_to(c.y, x);

    // Symmetric buffers: receive rows, red rows, the fan table.
    std::vector<std::vector<double>> y_by_dispatcher;
    for (CommKind k : kAllComms) {
      SCOPED_TRACE(to_string(k));
      Communicator& comm = w->comm(k);
      SymmetricBuffer recv = comm.alloc_symmetric(be, size_t(half) * c.row_bytes);
      SymmetricBuffer red = comm.alloc_symmetric(be, size_t(half * H) * ys);
      FanTable fan;
      fan.members = comm.alloc_symmetric(be, size_t(half * K) * sizeof(int32_t));
      fan.weights = comm.alloc_symmetric(be, size_t(half * K) * fl);
      fan.values = comm.alloc_symmetric(be, size_t(half) * fl);
      fan.top_k = K;
      fan.float_dtype = c.fl;
      const Tensor red_t(red.local, c.y, {half, H}), values_t(fan.values.local, c.fl, {half});
      {
        std::vector<double> rv(static_cast<size_t>(half * H)), vv(static_cast<size_t>(half));
        for (int64_t q = 0; q < half; ++q) {
          vv[size_t(q)] = value_of(me, q);
          for (int64_t h = 0; h < H; ++h) rv[size_t(q * H + h)] = red_of(me, q, h);
        }
        write_tensor(be, red_t, rv);
        write_tensor(be, values_t, vv);
      }
      OwnedTensor y_buf(be, c.y, {std::max<int64_t>(T, 1), H}), values_out(be, c.fl, {n1}),
          flag(be, DType::i32, {1});
      const Tensor y = y_buf->rows(0, T);
      std::vector<double> y_all;
      for (RoundWindow win : {RoundWindow{0, half}, RoundWindow{half, half}}) {
        SCOPED_TRACE("window at " + std::to_string(win.row_lo));
        const int mode = (case_id + int(win.row_lo > 0)) % 3;  // accumulate: nullptr, 0, 1
        const bool add = mode == 2;
        be.copy_from_host(recv.local, std::vector<uint8_t>(recv.bytes, 0xAB).data(), recv.bytes);
        be.copy_from_host(fan.members.local, std::vector<uint8_t>(fan.members.bytes, 0xA5).data(),
                          fan.members.bytes);
        be.copy_from_host(fan.weights.local, std::vector<uint8_t>(fan.weights.bytes, 0xFF).data(),
                          fan.weights.bytes);
        y_buf.write(y0);
        poison(values_out);
        flag.write({double(add)});
        be.synchronize();
        comm.barrier();  // every sentinel is in place before any rank writes
        comm.dispatch(route, win, src_d.p, c.row_bytes, recv, fan, nullptr);
        comm.combine(route, win, red, y, mode == 0 ? nullptr : flag->as<int32_t>(), fan,
                     c.values ? values_out->data : nullptr, nullptr);
        be.synchronize();

        // Receive window and fan table of this rank.
        std::vector<uint8_t> got(recv.bytes), members_b(fan.members.bytes),
            weights_b(fan.weights.bytes);
        be.copy_to_host(got.data(), recv.local, got.size());
        be.copy_to_host(members_b.data(), fan.members.local, members_b.size());
        be.copy_to_host(weights_b.data(), fan.weights.local, weights_b.size());
        auto member_at = [&](int64_t q, int j) {
          int32_t v;
          std::memcpy(&v, members_b.data() + size_t(q * K + j) * 4, 4);
          return v;
        };
        auto weight_at = [&](int64_t q, int j) {
          const uint8_t* p = weights_b.data() + size_t(q * K + j) * fl;
          if (c.fl == DType::f32) {
            float f;
            std::memcpy(&f, p, 4);
            return double(f);
          }
          double v;
          std::memcpy(&v, p, 8);
          return v;
        };
        std::vector<int> kind(size_t(half), 0);  // 0 untargeted, 1 lead, 2 other member
        int64_t row_bad = 0, table_bad = 0, hit_twice = 0;
        for (int s = 0; s < R; ++s)
          for (int64_t i = 0; i < c.tokens[size_t(s)] * K; ++i) {
            if (g.rank[size_t(s)][size_t(i)] != me || !in_window(s, i, win)) continue;
            const int64_t q = g.row[size_t(s)][size_t(i)] - win.row_lo;
            hit_twice += kind[size_t(q)] != 0;
            if (!is_lead(s, i, win)) {
              kind[size_t(q)] = 2;
              table_bad += member_at(q, 0) != -1;
              continue;
            }
            kind[size_t(q)] = 1;
            for (size_t b = 0; b < c.row_bytes; ++b)
              row_bad += got[size_t(q) * c.row_bytes + b] != byte_of(s, i / K, b);
            // The lead first, then the pair's other members in k order.
            int j = 0;
            auto member = [&](int64_t i2) {
              table_bad += member_at(q, j) != g.row[size_t(s)][size_t(i2)] - win.row_lo;
              table_bad += weight_at(q, j) != weight_of(s, i2);
              ++j;
            };
            member(i);
            for (int64_t i2 = i - i % K; i2 < i - i % K + K; ++i2)
              if (i2 != i && in_window(s, i2, win) && g.rank[size_t(s)][size_t(i2)] == me)
                member(i2);
            for (; j < K; ++j) table_bad += member_at(q, j) != -1;
          }
        int64_t sentinel_bad = 0, nonleads = 0;
        for (int64_t q = 0; q < half; ++q) {
          nonleads += kind[size_t(q)] == 2;
          if (kind[size_t(q)] == 1) continue;
          for (size_t b = 0; b < c.row_bytes; ++b)
            sentinel_bad += got[size_t(q) * c.row_bytes + b] != 0xAB;
          for (size_t b = kind[size_t(q)] == 2 ? 4 : 0; b < size_t(K) * 4; ++b)
            sentinel_bad += members_b[size_t(q * K) * 4 + b] != 0xA5;
          for (size_t b = 0; b < size_t(K) * fl; ++b)
            sentinel_bad += weights_b[size_t(q * K) * fl + b] != 0xFF;
        }
        nonleads_seen += nonleads;
        EXPECT_EQ(hit_twice, 0) << "test routes target a row twice";
        EXPECT_EQ(row_bad, 0) << "lead rows: wrong bytes";
        EXPECT_EQ(table_bad, 0) << "fan table: wrong members or weights";
        EXPECT_EQ(sentinel_bad, 0) << "rows that are no lead were written";

        // Combine: y against an fp64 sum, exact where a token has no lead; values per entry.
        std::vector<double> yg = y_buf.read();
        yg.resize(size_t(T * H));
        std::vector<double> want(size_t(T * H));
        int64_t no_lead_bad = 0, values_bad = 0;
        std::vector<double> vo = values_out.read();
        for (int64_t t = 0; t < T; ++t) {
          int leads = 0;
          for (int64_t h = 0; h < H; ++h) want[size_t(t * H + h)] = add ? y0[size_t(t * H + h)] : 0;
          for (int64_t i = t * K; i < t * K + K; ++i) {
            if (!in_window(me, i, win)) {
              values_bad += !std::isnan(vo[size_t(i)]);
              continue;
            }
            const int dst = g.rank[size_t(me)][size_t(i)];
            const int64_t q = g.row[size_t(me)][size_t(i)] - win.row_lo;
            if (c.values)
              values_bad += vo[size_t(i)] != value_of(dst, q);
            else
              values_bad += !std::isnan(vo[size_t(i)]);
            if (!is_lead(me, i, win)) continue;
            ++leads;
            for (int64_t h = 0; h < H; ++h) want[size_t(t * H + h)] += red_of(dst, q, h);
          }
          if (leads == 0)
            for (int64_t h = 0; h < H; ++h)
              no_lead_bad += yg[size_t(t * H + h)] != want[size_t(t * H + h)];
        }
        const double tol = c.y == DType::bf16 ? kBf16Tol : c.y == DType::f32 ? kF32Tol : 1e-12;
        EXPECT_LT(rel_error(yg, want), tol) << "combined rows (accumulate mode " << mode << ")";
        EXPECT_EQ(no_lead_bad, 0) << "tokens without a lead in the window";
        EXPECT_EQ(values_bad, 0) << "values_out";
        y_all.insert(y_all.end(), yg.begin(), yg.end());
      }
      y_by_dispatcher.push_back(y_all);
      be.synchronize();
      comm.barrier();
      for (SymmetricBuffer* b : {&recv, &red, &fan.members, &fan.weights, &fan.values})
        comm.free_symmetric(be, *b);
    }
    EXPECT_EQ(y_by_dispatcher[0], y_by_dispatcher[1]) << "the dispatchers' combines differ in bits";
    EXPECT_EQ(y_by_dispatcher[0], y_by_dispatcher[2])
        << "the host-API mode's combine differs in bits";
  }
  EXPECT_GT(nonleads_seen, 0) << "no token had two entries on one rank";
}

TEST(MultiGpuCollectives, AllGatherAndAllReduce) {
  MOE_ECHO_MULTIGPU_WORLD(w);
  Backend& be = *w->be;
  const int R = w->size(), me = w->rank();
  // Ranks that span nodes (NVLink teams; the baseline then runs in host-API mode on its own):
  // every communicator's all-reduce is ncclAllReduce there.
  const bool nodes = nccl_uses_host_api(w->comm(CommKind::baseline));
  for (CommKind k : kAllComms) {
    SCOPED_TRACE(to_string(k));
    Communicator& comm = w->comm(k);
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
        const size_t staging = k == CommKind::baseline ? 4096u : (16u << 20);
        const bool lsa = !nodes && k != CommKind::host_api && size_t(n) * dtype_size(dt) <= staging;
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

  for (CommKind k : kAllComms) {
    Communicator& comm = w->comm(k);
    for (size_t slot_bytes : {size_t(3 * 4096), size_t(1998)}) {
      SCOPED_TRACE(std::string(to_string(k)) + " slot_bytes " + std::to_string(slot_bytes));
      auto wbyte = [](int r, int slot, size_t b) {
        return uint8_t((r * 31 + slot * 17 + b * 3 + 5) & 0xff);
      };
      // Home slots symmetric (peers pull from them); the spare slots in plain device memory.
      SymmetricBuffer wb = comm.alloc_symmetric(be, size_t(EPR) * slot_bytes);
      void* spare = be.allocate(size_t(S) * slot_bytes);
      std::vector<uint8_t> mine(size_t(EPR + S) * slot_bytes);
      for (int slot = 0; slot < EPR + S; ++slot)
        for (size_t b = 0; b < slot_bytes; ++b)
          mine[size_t(slot) * slot_bytes + b] = wbyte(me, slot, b);
      be.copy_from_host(wb.local, mine.data(), size_t(EPR) * slot_bytes);
      be.copy_from_host(spare, mine.data() + size_t(EPR) * slot_bytes, size_t(S) * slot_bytes);
      comm.barrier();
      comm.pull_clone_weights(dplan, cfg, wb, spare, slot_bytes, nullptr);
      be.synchronize();
      std::vector<uint8_t> got(mine.size());
      be.copy_to_host(got.data(), wb.local, size_t(EPR) * slot_bytes);
      be.copy_to_host(got.data() + size_t(EPR) * slot_bytes, spare, size_t(S) * slot_bytes);
      be.deallocate(spare);
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
      SCOPED_TRACE(std::string(to_string(k)) + " " + to_string(dt));
      const int64_t slot_elems = 1001;
      auto gval = [](int r, int slot, int64_t x) {
        return double((r * 7 + slot * 3 + x) % 17 - 8);
      };
      // The spare slots' gradients symmetric (their home ranks read them); home ones plain.
      SymmetricBuffer gb =
          comm.alloc_symmetric(be, size_t(S) * size_t(slot_elems) * dtype_size(dt));
      Tensor spare_g(gb.local, dt, {int64_t(S), slot_elems});
      OwnedTensor home_g(be, dt, {int64_t(EPR), slot_elems});
      std::vector<double> hv(size_t(EPR * slot_elems)), sv(size_t(S * slot_elems));
      for (int slot = 0; slot < EPR + S; ++slot)
        for (int64_t x = 0; x < slot_elems; ++x)
          (slot < EPR ? hv[size_t(slot * slot_elems + x)]
                      : sv[size_t((slot - EPR) * slot_elems + x)]) = gval(me, slot, x);
      home_g.write(hv);
      write_tensor(be, spare_g, sv);
      comm.barrier();
      comm.reduce_clone_grads(dplan, cfg, gb, home_g->data, slot_elems, dt, nullptr);
      be.synchronize();
      const auto got = home_g.read();
      int64_t bad = 0;
      for (int slot = 0; slot < EPR; ++slot)
        for (int64_t x = 0; x < slot_elems; ++x) {
          double want = gval(me, slot, x);
          const int e = me * EPR + slot;
          for (int j = 1; j < M; ++j)
            if (pv.replica_rank[e * M + j] >= 0)
              want += gval(pv.replica_rank[e * M + j], pv.replica_slot[e * M + j], x);
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
