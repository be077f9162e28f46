// The single-GPU communicator: self-describing rows (every 32-bit word names its source row and
// position) are dispatched into a receive window and combined back; nothing may be lost,
// duplicated or corrupted, rows outside the window and unrouted entries (-1) keep their sentinel.
// Row sizes cover every copy width (16, 8, 4, 2 and 1 byte words). The clone kernels run on a
// hand-made plan that clones within the one rank (the planner never does with one rank, but the
// kernels must still follow the plan). Skipped without a GPU.
#include <gtest/gtest.h>

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

uint8_t byte_of(int64_t row, size_t at) { return uint8_t((row * 131 + int64_t(at) * 7 + 1) & 0xff); }

TEST(LocalCommunicator, DispatchAndCombineMoveEveryRowOnce) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  auto be = cuda::make_cuda_backend();
  auto comm = cuda::make_local_communicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  for (size_t row_bytes : {size_t(128), size_t(72), size_t(36), size_t(74), size_t(37)})
    for (int src_div : {1, 3})
      for (int64_t n : {int64_t(0), int64_t(1), int64_t(255), int64_t(256), int64_t(257)}) {
        SCOPED_TRACE("row_bytes " + std::to_string(row_bytes) + " src_div " +
                     std::to_string(src_div) + " n " + std::to_string(n));
        std::mt19937_64 rng(uint64_t(n) * 31 + row_bytes + uint64_t(src_div));
        // Routes: a permutation of receive rows [0, n), some entries unrouted (-1).
        std::vector<int32_t> rows(static_cast<size_t>(n)), ranks(static_cast<size_t>(n), 0);
        std::iota(rows.begin(), rows.end(), 0);
        std::shuffle(rows.begin(), rows.end(), rng);
        for (int64_t i = 0; i < n; ++i)
          if (rng() % 7 == 0) ranks[size_t(i)] = rows[size_t(i)] = -1;
        const int64_t src_rows = (n + src_div - 1) / src_div;
        std::vector<uint8_t> src(size_t(src_rows) * row_bytes);
        for (int64_t r = 0; r < src_rows; ++r)
          for (size_t b = 0; b < row_bytes; ++b) src[size_t(r) * row_bytes + b] = byte_of(r, b);
        OwnedTensor dr(*be, DType::i32, {n}), dw(*be, DType::i32, {n});
        dr.write(std::vector<double>(ranks.begin(), ranks.end()));
        dw.write(std::vector<double>(rows.begin(), rows.end()));
        Bytes src_d(*be, src.size() + 1);
        src_d.put(src);
        const RowRoute route{dr->as<int32_t>(), dw->as<int32_t>(), n, src_div};
        // Two windows cover [0, n): window 1 starts at the middle.
        const int64_t half = n / 2 + 1;
        for (RoundWindow win : {RoundWindow{0, half}, RoundWindow{half, half}}) {
          SymmetricBuffer recv = comm->alloc_symmetric(*be, size_t(win.rows) * row_bytes);
          Bytes gathered(*be, size_t(n) * row_bytes + 1);
          const std::vector<uint8_t> sentinel_recv(recv.bytes, 0xAB), sentinel_g(gathered.n, 0xCD);
          be->copy_from_host(recv.local, sentinel_recv.data(), recv.bytes);
          gathered.put(sentinel_g);
          comm->dispatch(route, win, src_d.p, row_bytes, recv, nullptr);
          comm->combine(route, win, recv, row_bytes, gathered.p, nullptr);
          std::vector<uint8_t> r(recv.bytes);
          be->copy_to_host(r.data(), recv.local, recv.bytes);
          const auto g = gathered.get();
          std::vector<int> hits(size_t(win.rows), 0);
          for (int64_t i = 0; i < n; ++i) {
            const int64_t row = int64_t(rows[size_t(i)]) - win.row_lo;
            const bool in = ranks[size_t(i)] == 0 && row >= 0 && row < win.rows;
            for (size_t b = 0; b < row_bytes; ++b) {
              const uint8_t want = in ? byte_of(i / src_div, b) : 0xCD;
              ASSERT_EQ(g[size_t(i) * row_bytes + b], want) << "gathered entry " << i << " byte " << b;
            }
            if (!in) continue;
            ++hits[size_t(row)];
            for (size_t b = 0; b < row_bytes; ++b)
              ASSERT_EQ(r[size_t(row) * row_bytes + b], byte_of(i / src_div, b))
                  << "receive row " << row << " byte " << b;
          }
          for (int64_t row = 0; row < win.rows; ++row) {
            ASSERT_LE(hits[size_t(row)], 1);
            if (hits[size_t(row)] == 0) {
              for (size_t b = 0; b < row_bytes; ++b)
                ASSERT_EQ(r[size_t(row) * row_bytes + b], 0xAB) << "untouched receive row " << row;
            }
          }
          EXPECT_EQ(g.back(), 0xCD) << "wrote past the last entry";
          comm->free_symmetric(*be, recv);
        }
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
    SymmetricBuffer w = comm->alloc_symmetric(*be, size_t(6 * slot_elems) * 2);
    Tensor wt(w.local, DType::bf16, {6, slot_elems});
    auto wv = round_bf16(random_values(size_t(6 * slot_elems), uint64_t(slot_elems)));
    write_tensor(*be, wt, wv);
    comm->pull_clone_weights(dev, cfg, w, size_t(slot_elems) * 2, nullptr);
    auto after = read_tensor(*be, wt);
    for (int64_t x = 0; x < slot_elems; ++x) {
      wv[size_t(4 * slot_elems + x)] = wv[size_t(2 * slot_elems + x)];  // slot 4 <- expert 2
    }
    EXPECT_EQ(after, wv);

    SymmetricBuffer g = comm->alloc_symmetric(*be, size_t(6 * slot_elems) * 4);
    Tensor gt(g.local, DType::f32, {6, slot_elems});
    auto gv = round_f32(random_values(size_t(6 * slot_elems), uint64_t(slot_elems) + 1));
    write_tensor(*be, gt, gv);
    comm->reduce_clone_grads(dev, cfg, g, slot_elems, DType::f32, nullptr);
    const auto reduced = read_tensor(*be, gt);
    for (int64_t x = 0; x < slot_elems; ++x)
      gv[size_t(2 * slot_elems + x)] =
          double(float(gv[size_t(2 * slot_elems + x)]) + float(gv[size_t(4 * slot_elems + x)]));
    EXPECT_EQ(reduced, gv);
    comm->free_symmetric(*be, w);
    comm->free_symmetric(*be, g);
  }
}

}  // namespace
}  // namespace moe_echo::test
