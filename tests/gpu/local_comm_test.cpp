// The single-GPU communicator. Dispatch: self-describing rows (every byte names its source token
// and position) go to each token's lead row only (its lowest window row), once per window, and
// the fan table names the lead, then its other members in k order, with their weights; rows that no
// entry targets keep their sentinel, and so do the other members' rows (the receiver's fan_out
// fills them). Checked byte for byte: the local dispatch writes nothing else. Row sizes cover every
// copy width (16, 8, 4, 2 and 1 byte words), top_k 1 to 32. Combine: each token's lead row replaces
// or is added to y (bf16 and f32 rows, against an fp64 reference; plain copies and untouched tokens
// bit for bit), and the per-entry values come back bit for bit. A round trip through the backend's
// fan ops checks that the table the dispatch writes is the one they read, forward and backward. The
// clone kernels run on a hand-made plan that clones within the one rank (the planner never does
// with one rank, but the kernels must still follow the plan). Skipped without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_test_util.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::test {
namespace {

struct Bytes {
  Backend& be;
  void* p;
  size_t n;
  Bytes(Backend& b, size_t bytes) : be(b), p(b.allocate(bytes)), n(bytes) {}
  ~Bytes() { be.deallocate(p); }
  void put(const std::vector<uint8_t>& v) { be.copy_from_host(p, v.data(), v.size()); }
  std::vector<uint8_t> get() const {
    std::vector<uint8_t> v(n);
    be.copy_to_host(v.data(), p, n);
    return v;
  }
};

uint8_t byte_of(int64_t row, size_t at) {
  return uint8_t((row * 131 + int64_t(at) * 7 + 1) & 0xff);
}

template <class T>
void put_bytes(std::vector<uint8_t>& bytes, size_t at, T v) {
  std::memcpy(bytes.data() + at * sizeof(T), &v, sizeof(T));
}

// Routes of T tokens of K entries, all to rank 0: the routed entries take receive rows
// [0, routed) in a random order; about one entry in seven stays unrouted (-1, -1).
struct Routes {
  int64_t T, K, routed = 0;
  std::vector<int32_t> rank, row;
  std::vector<float> weight;
  Routes(int64_t tokens, int64_t top_k, uint64_t seed) : T(tokens), K(top_k) {
    const size_t n = size_t(T * K);
    std::mt19937_64 rng(seed);
    rank.assign(n, 0);
    row.assign(n, -1);
    std::vector<size_t> routed_entries;
    for (size_t i = 0; i < n; ++i)
      if (rng() % 7 != 0) routed_entries.push_back(i);
    routed = int64_t(routed_entries.size());
    std::vector<int32_t> perm(routed_entries.size());
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (size_t j = 0; j < routed_entries.size(); ++j) row[routed_entries[j]] = perm[j];
    for (size_t i = 0; i < n; ++i)
      if (row[i] < 0) rank[i] = -1;
    const auto w = round_f32(random_values(n, seed + 1, 0.05, 1.0));
    weight.assign(w.begin(), w.end());
  }
  // Token t's entries in the window, in k order.
  std::vector<int64_t> in_window(int64_t t, RoundWindow win) const {
    std::vector<int64_t> e;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = t * K + k, r = int64_t(row[size_t(i)]) - win.row_lo;
      if (rank[size_t(i)] == 0 && r >= 0 && r < win.rows) e.push_back(i);
    }
    return e;
  }
  int64_t window_row(int64_t i, RoundWindow win) const { return row[size_t(i)] - win.row_lo; }
  // Token t's entries in the window as its lead's fan table lists them: the lead (the lowest
  // window row) first, then the others in k order.
  std::vector<int64_t> members(int64_t t, RoundWindow win) const {
    std::vector<int64_t> e = in_window(t, win);
    const auto lead = std::min_element(
        e.begin(), e.end(), [&](int64_t a, int64_t b) { return row[size_t(a)] < row[size_t(b)]; });
    if (lead != e.end()) std::rotate(e.begin(), lead, lead + 1);
    return e;
  }
};

// The routes on the device.
struct DeviceRoutes {
  OwnedTensor rank, row, weight;
  DeviceRoutes(Backend& be, const Routes& r)
      : rank(be, DType::i32, {r.T * r.K}),
        row(be, DType::i32, {r.T * r.K}),
        weight(be, DType::f32, {r.T * r.K}) {
    rank.write(std::vector<double>(r.rank.begin(), r.rank.end()));
    row.write(std::vector<double>(r.row.begin(), r.row.end()));
    weight.write(std::vector<double>(r.weight.begin(), r.weight.end()));
  }
  RowRoute route(const Routes& r, bool weighted) const {
    return RowRoute{rank->as<int32_t>(), row->as<int32_t>(), weighted ? weight->data : nullptr,
                    r.T * r.K, int(r.K)};
  }
};

// The fan table of a window: symmetric buffers, freed with it.
struct Fan {
  Communicator& comm;
  Backend& be;
  FanTable table;
  Fan(Communicator& c, Backend& b, int64_t rows, int64_t K) : comm(c), be(b) {
    table.members = comm.alloc_symmetric(be, size_t(rows * K) * sizeof(int32_t));
    table.weights = comm.alloc_symmetric(be, size_t(rows * K) * sizeof(float));
    table.values = comm.alloc_symmetric(be, size_t(rows) * sizeof(float));
    table.top_k = int(K);
    table.float_dtype = DType::f32;
  }
  ~Fan() {
    comm.free_symmetric(be, table.members);
    comm.free_symmetric(be, table.weights);
    comm.free_symmetric(be, table.values);
  }
  static void fill(Backend& be, const SymmetricBuffer& buf, uint8_t v) {
    const std::vector<uint8_t> bytes(buf.bytes, v);
    be.copy_from_host(buf.local, bytes.data(), bytes.size());
  }
  static std::vector<uint8_t> get(Backend& be, const SymmetricBuffer& buf) {
    std::vector<uint8_t> bytes(buf.bytes);
    be.copy_to_host(bytes.data(), buf.local, bytes.size());
    return bytes;
  }
};

TEST(LocalCommunicator, DispatchSendsEachTokenOnceAndWritesTheFanTable) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  auto be = cuda::make_cuda_backend();
  auto comm = cuda::make_local_communicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  for (size_t row_bytes : {size_t(128), size_t(72), size_t(36), size_t(74), size_t(37)})
    for (int64_t K : {int64_t(1), int64_t(3), int64_t(8), int64_t(32)})
      for (int64_t T : {int64_t(0), int64_t(1), int64_t(255), int64_t(256), int64_t(257)}) {
        const bool weighted = (T + K) % 2 == 1;
        SCOPED_TRACE("row_bytes " + std::to_string(row_bytes) + " K " + std::to_string(K) + " T " +
                     std::to_string(T) + (weighted ? " weighted" : ""));
        const Routes r(T, K, uint64_t(T) * 31 + row_bytes + uint64_t(K));
        const DeviceRoutes dr(*be, r);
        std::vector<uint8_t> src(size_t(T) * row_bytes);
        for (int64_t t = 0; t < T; ++t)
          for (size_t b = 0; b < row_bytes; ++b) src[size_t(t) * row_bytes + b] = byte_of(t, b);
        Bytes src_d(*be, src.size() + 1);
        src_d.put(src);
        // Two windows cover the routed rows: window 1 starts at the middle.
        const int64_t half = r.routed / 2 + 1;
        for (RoundWindow win : {RoundWindow{0, half}, RoundWindow{half, half}}) {
          SymmetricBuffer recv = comm->alloc_symmetric(*be, size_t(win.rows) * row_bytes);
          Fan fan(*comm, *be, win.rows, K);
          Fan::fill(*be, recv, 0xAB);
          Fan::fill(*be, fan.table.members, 0xEE);
          Fan::fill(*be, fan.table.weights, 0xEE);
          comm->dispatch(dr.route(r, weighted), win, src_d.p, row_bytes, recv, fan.table, nullptr);
          std::vector<uint8_t> want_recv(recv.bytes, 0xAB),
              want_members(fan.table.members.bytes, 0xEE),
              want_weights(fan.table.weights.bytes, 0xEE);
          for (int64_t t = 0; t < T; ++t) {
            const auto e = r.members(t, win);
            if (e.empty()) continue;
            const int64_t p = r.window_row(e[0], win);
            std::memcpy(want_recv.data() + size_t(p) * row_bytes,
                        src.data() + size_t(t) * row_bytes, row_bytes);
            for (int64_t m = 0; m < K; ++m) {
              const bool member = size_t(m) < e.size();
              put_bytes(want_members, size_t(p * K + m),
                        member ? int32_t(r.window_row(e[size_t(m)], win)) : int32_t(-1));
              if (member)
                put_bytes(want_weights, size_t(p * K + m),
                          weighted ? r.weight[size_t(e[size_t(m)])] : 1.0f);
              if (member && m > 0)
                put_bytes(want_members, size_t(r.window_row(e[size_t(m)], win) * K), int32_t(-1));
            }
          }
          const auto got_recv = Fan::get(*be, recv), got_members = Fan::get(*be, fan.table.members),
                     got_weights = Fan::get(*be, fan.table.weights);
          for (int64_t row = 0; row < win.rows; ++row)
            ASSERT_TRUE(std::memcmp(got_recv.data() + size_t(row) * row_bytes,
                                    want_recv.data() + size_t(row) * row_bytes, row_bytes) == 0)
                << "receive row " << row;
          for (int64_t row = 0; row < win.rows; ++row) {
            ASSERT_TRUE(std::memcmp(got_members.data() + size_t(row * K) * 4,
                                    want_members.data() + size_t(row * K) * 4, size_t(K) * 4) == 0)
                << "members of row " << row;
            ASSERT_TRUE(std::memcmp(got_weights.data() + size_t(row * K) * 4,
                                    want_weights.data() + size_t(row * K) * 4, size_t(K) * 4) == 0)
                << "weights of row " << row;
          }
          comm->free_symmetric(*be, recv);
        }
      }
}

TEST(LocalCommunicator, CombineAddsEachTokensLeadRowAndPullsValues) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  auto be = cuda::make_cuda_backend();
  auto comm = cuda::make_local_communicator();
  OwnedTensor flag0(*be, DType::i32, {1}), flag1(*be, DType::i32, {1});
  flag0.write({0});
  flag1.write({1});
  for (DType dt : {DType::bf16, DType::f32})
    for (int64_t H : {int64_t(64), int64_t(dt == DType::bf16 ? 37 : 3)})
      for (int64_t K : {int64_t(1), int64_t(4), int64_t(8)})
        for (int64_t T : {int64_t(0), int64_t(1), int64_t(255), int64_t(257)})
          for (int mode = 0; mode < 3; ++mode) {  // no flag, flag 0 (overwrite), flag 1 (add)
            SCOPED_TRACE(std::string(to_string(dt)) + " H " + std::to_string(H) + " K " +
                         std::to_string(K) + " T " + std::to_string(T) + " mode " +
                         std::to_string(mode));
            const uint64_t seed = uint64_t(T * 7 + K * 3 + H) + uint64_t(mode) * 1000;
            const Routes r(T, K, seed);
            const DeviceRoutes dr(*be, r);
            const bool add = mode == 2;
            auto round = [&](std::vector<double> v) {
              return dt == DType::bf16 ? round_bf16(std::move(v)) : round_f32(std::move(v));
            };
            // The second half of the routed rows.
            const int64_t half = r.routed / 2;
            const RoundWindow win{half, r.routed - half + 1};
            SymmetricBuffer red = comm->alloc_symmetric(*be, size_t(win.rows * H) * dtype_size(dt));
            Fan fan(*comm, *be, win.rows, K);
            const Tensor red_t(red.local, dt, {win.rows, H});
            const Tensor values_t(fan.table.values.local, DType::f32, {win.rows});
            const auto red_v = round(random_values(size_t(win.rows * H), seed + 1));
            const auto values_v = round_f32(random_values(size_t(win.rows), seed + 2));
            write_tensor(*be, red_t, red_v);
            write_tensor(*be, values_t, values_v);
            OwnedTensor y(*be, dt, {T, H}), values_out(*be, DType::f32, {T * K});
            const auto y_old = round(random_values(size_t(T * H), seed + 3));
            if (add)
              y.write(y_old);
            else
              poison(y);
            poison(values_out);
            const int32_t* flag =
                mode == 0 ? nullptr : (add ? flag1->as<int32_t>() : flag0->as<int32_t>());
            comm->combine(dr.route(r, true), win, red, *y, flag, fan.table, values_out->data,
                          nullptr);
            const auto got = y.read(), got_values = values_out.read();
            std::vector<double> want(size_t(T * H));
            for (int64_t t = 0; t < T; ++t) {
              const auto e = r.members(t, win);
              for (int64_t h = 0; h < H; ++h) {
                const size_t at = size_t(t * H + h);
                const double lead =
                    e.empty() ? 0.0 : red_v[size_t(r.window_row(e[0], win) * H + h)];
                want[at] = (add ? y_old[at] : 0.0) + lead;
                // One row's sum is the row itself; a token with no entry keeps y or gets 0.
                if (!add || e.empty()) {
                  ASSERT_EQ(got[at], want[at]) << "token " << t << " h " << h;
                }
              }
              for (int64_t k = 0; k < K; ++k) {
                const int64_t i = t * K + k;
                const bool in = std::find(e.begin(), e.end(), i) != e.end();
                if (in) {
                  ASSERT_EQ(got_values[size_t(i)], values_v[size_t(r.window_row(i, win))])
                      << "value of entry " << i;
                } else {
                  ASSERT_TRUE(std::isnan(got_values[size_t(i)])) << "value of entry " << i;
                }
              }
            }
            EXPECT_LE(rel_error(got, want), dt == DType::bf16 ? 4e-3 : 1e-7);
            comm->free_symmetric(*be, red);
          }
}

// dispatch -> fan_out -> (expert rows) -> fan_in -> combine, forward and backward, as the layer
// runs them, against fp64 sums over each token's entries in the window.
TEST(LocalCommunicator, RoundTripThroughTheFanOps) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  auto be = cuda::make_cuda_backend();
  auto comm = cuda::make_local_communicator();
  for (int64_t H : {int64_t(64), int64_t(36)})
    for (int64_t K : {int64_t(1), int64_t(2), int64_t(8)}) {
      const int64_t T = 257;
      SCOPED_TRACE("H " + std::to_string(H) + " K " + std::to_string(K));
      const uint64_t seed = uint64_t(H * 10 + K);
      const Routes r(T, K, seed);
      const DeviceRoutes dr(*be, r);
      const RowRoute route = dr.route(r, true);
      OwnedTensor x(*be, DType::bf16, {T, H}), dy(*be, DType::bf16, {T, H}),
          y(*be, DType::bf16, {T, H}), dx(*be, DType::bf16, {T, H}),
          d_weight(*be, DType::f32, {T * K}), offsets(*be, DType::i32, {2});
      const auto xv = round_bf16(random_values(size_t(T * H), seed + 1));
      const auto dyv = round_bf16(random_values(size_t(T * H), seed + 2));
      x.write(xv);
      dy.write(dyv);
      offsets.write({0, double(r.routed)});
      poison(d_weight);
      const int64_t half = r.routed / 2 + 1;
      for (RoundWindow win : {RoundWindow{0, half}, RoundWindow{half, half}}) {
        SCOPED_TRACE("window at " + std::to_string(win.row_lo));
        const size_t row_bytes = size_t(H) * 2;
        SymmetricBuffer recv = comm->alloc_symmetric(*be, size_t(win.rows) * row_bytes),
                        red = comm->alloc_symmetric(*be, size_t(win.rows) * row_bytes);
        Fan fan(*comm, *be, win.rows, K);
        OwnedTensor out(*be, DType::bf16, {win.rows, H});
        const Tensor recv_t(recv.local, DType::bf16, {win.rows, H}),
            red_t(red.local, DType::bf16, {win.rows, H}),
            members(fan.table.members.local, DType::i32, {win.rows, K}),
            weights(fan.table.weights.local, DType::f32, {win.rows, K}),
            values(fan.table.values.local, DType::f32, {win.rows});
        write_tensor(*be, recv_t, std::vector<double>(size_t(win.rows * H), std::nan("")));
        const GroupWindow gw{win, offsets->as<int32_t>(), 1};

        // Forward: every entry's receive row holds its token's row, bit for bit.
        comm->dispatch(route, win, x->data, row_bytes, recv, fan.table, nullptr);
        FanArgs copy;
        copy.window = gw;
        copy.members = members;
        copy.src = copy.dst = recv_t;
        be->fan_out(copy, nullptr);
        const auto recv_v = read_tensor(*be, recv_t);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t i : r.in_window(t, win))
            for (int64_t h = 0; h < H; ++h)
              ASSERT_EQ(recv_v[size_t(r.window_row(i, win) * H + h)], xv[size_t(t * H + h)])
                  << "entry " << i << " h " << h;
        // Expert outputs: y[t] = sum over t's entries in the window of weight * out row.
        const auto out_v =
            round_bf16(random_values(size_t(win.rows * H), seed + 3 + uint64_t(win.row_lo)));
        out.write(out_v);
        FanArgs sum;
        sum.window = gw;
        sum.members = members;
        sum.weights = weights;
        sum.src = *out;
        sum.dst = red_t;
        be->fan_in(sum, nullptr);
        poison(y);
        comm->combine(route, win, red, *y, nullptr, fan.table, nullptr, nullptr);
        std::vector<double> want(size_t(T * H), 0.0);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t i : r.in_window(t, win))
            for (int64_t h = 0; h < H; ++h)
              want[size_t(t * H + h)] +=
                  double(r.weight[size_t(i)]) * out_v[size_t(r.window_row(i, win) * H + h)];
        EXPECT_LE(rel_error(y.read(), want), kBf16Tol) << "y";

        // Backward: dy to the lead rows; per member d_weight = <dy, out>, out <- weight * dy in
        // place; dx[t] = sum of the members' rows (here the weighted dy rows themselves).
        comm->dispatch(route, win, dy->data, row_bytes, red, fan.table, nullptr);
        FanArgs scatter;
        scatter.window = gw;
        scatter.members = members;
        scatter.weights = weights;
        scatter.src = red_t;
        scatter.dst = scatter.other = *out;
        scatter.d_weight = values;
        be->fan_out(scatter, nullptr);
        FanArgs gather;
        gather.window = gw;
        gather.members = members;
        gather.src = *out;
        gather.dst = red_t;
        be->fan_in(gather, nullptr);
        poison(dx);
        comm->combine(route, win, red, *dx, nullptr, fan.table, d_weight->data, nullptr);
        const auto dw = d_weight.read();
        std::vector<double> want_dx(size_t(T * H), 0.0), got_dw, want_dw;
        for (int64_t t = 0; t < T; ++t)
          for (int64_t i : r.in_window(t, win)) {
            double dot = 0;
            for (int64_t h = 0; h < H; ++h) {
              const double g = dyv[size_t(t * H + h)];
              dot += g * out_v[size_t(r.window_row(i, win) * H + h)];
              want_dx[size_t(t * H + h)] += round_bf16(double(r.weight[size_t(i)]) * g);
            }
            got_dw.push_back(dw[size_t(i)]);
            want_dw.push_back(dot);
          }
        EXPECT_LE(rel_error(dx.read(), want_dx), kBf16Tol) << "dx";
        EXPECT_LE(rel_error(got_dw, want_dw), kF32Tol) << "d_weight";
        comm->free_symmetric(*be, recv);
        comm->free_symmetric(*be, red);
      }
      // The two windows cover every routed entry's weight gradient, and only those.
      const auto dw = d_weight.read();
      for (int64_t i = 0; i < T * K; ++i)
        ASSERT_EQ(std::isfinite(dw[size_t(i)]), r.row[size_t(i)] >= 0) << "d_weight of entry " << i;
    }
}

TEST(LocalCommunicator, AllGatherAllReduceAndCloneKernelsFollowThePlan) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  auto be = cuda::make_cuda_backend();
  auto comm = cuda::make_local_communicator();
  // all_gather with one rank is a copy; all_reduce leaves the values.
  OwnedTensor a(*be, DType::i32, {5}), all(*be, DType::i32, {5}), f(*be, DType::f32, {7});
  a.write({1, 2, 3, 4, 5});
  poison(all);
  comm->all_gather_i32(a->as<int32_t>(), all->as<int32_t>(), 5, nullptr);
  EXPECT_EQ(all.read(), (std::vector<double>{1, 2, 3, 4, 5}));
  const auto fv = round_f32(random_values(7, 3));
  f.write(fv);
  comm->all_reduce_sum(*f, nullptr);
  EXPECT_EQ(f.read(), fv);

  // Plan: E = 4 experts on the rank, S = 2 spare slots, M = 3. Spare slot 0 holds a clone of
  // expert 2 (replica 1 of expert 2), spare slot 1 stays empty.
  PlannerConfig cfg;
  cfg.ranks = 1;
  cfg.experts = 4;
  cfg.spare_slots = 2;
  cfg.max_clones = 2;
  Plan plan(cfg);
  PlanView pv = plan.view();
  for (int i = 0; i < 2; ++i) pv.spare_expert[i] = -1;
  pv.spare_expert[0] = 2;
  for (int e = 0; e < 4; ++e)
    for (int j = 0; j < 3; ++j) {
      pv.replica_rank[e * 3 + j] = j == 0 ? 0 : -1;
      pv.replica_slot[e * 3 + j] = j == 0 ? e : -1;
    }
  pv.replica_rank[2 * 3 + 1] = 0;
  pv.replica_slot[2 * 3 + 1] = 4;
  OwnedTensor plan_d(*be, DType::i32, {plan_ints(cfg)});
  plan_d.write(std::vector<double>(plan.storage.begin(), plan.storage.end()));
  const PlanView dev = plan_view(plan_d->as<int32_t>(), cfg);

  for (int64_t slot_elems : {int64_t(1), int64_t(37), int64_t(4096)}) {
    SCOPED_TRACE("slot elems " + std::to_string(slot_elems));
    // Home slots 0..3 and spare slots 4, 5 in one allocation; the spare part given apart.
    SymmetricBuffer w = comm->alloc_symmetric(*be, size_t(6 * slot_elems) * 2);
    Tensor wt(w.local, DType::bf16, {6, slot_elems});
    auto wv = round_bf16(random_values(size_t(6 * slot_elems), uint64_t(slot_elems)));
    write_tensor(*be, wt, wv);
    comm->pull_clone_weights(dev, cfg, w, wt.rows(4, 2).data, size_t(slot_elems) * 2, nullptr);
    auto after = read_tensor(*be, wt);
    for (int64_t x = 0; x < slot_elems; ++x) {
      wv[size_t(4 * slot_elems + x)] = wv[size_t(2 * slot_elems + x)];  // slot 4 <- expert 2
    }
    EXPECT_EQ(after, wv);

    // Spare slots' gradients (symmetric) reduced into home gradients elsewhere.
    SymmetricBuffer g = comm->alloc_symmetric(*be, size_t(2 * slot_elems) * 4);
    Tensor gt(g.local, DType::f32, {2, slot_elems});
    auto gv = round_f32(random_values(size_t(2 * slot_elems), uint64_t(slot_elems) + 1));
    write_tensor(*be, gt, gv);
    OwnedTensor home(*be, DType::f32, {4, slot_elems});
    auto hv = round_f32(random_values(size_t(4 * slot_elems), uint64_t(slot_elems) + 2));
    home.write(hv);
    comm->reduce_clone_grads(dev, cfg, g, home->data, slot_elems, DType::f32, nullptr);
    const auto reduced = home.read();
    for (int64_t x = 0; x < slot_elems; ++x)
      hv[size_t(2 * slot_elems + x)] =
          double(float(hv[size_t(2 * slot_elems + x)]) + float(gv[size_t(x)]));
    EXPECT_EQ(reduced, hv);
    comm->free_symmetric(*be, w);
    comm->free_symmetric(*be, g);
  }
}

}  // namespace
}  // namespace moe_echo::test
