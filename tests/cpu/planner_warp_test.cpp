// The device planner's warp code (planner_warp.hpp: place_clones_warp, refine_warp; align_blocks
// on lane 0; write_part over a block) run on the host, each lane a thread and the warp's shuffles,
// ballots and syncs emulated with a barrier, against the host planner (plan_echo): the whole plan
// storage must be equal element for element, for random, Zipf-skewed, one-hot and sparse routing
// maps over many configs and 1, 4, 8 and 32 lanes. The GPU runs the same templates with real warp
// intrinsics (tests/gpu/cuda_planner_test.cpp checks it there); this test keeps their logic covered
// where there is no GPU.
#include <gtest/gtest.h>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "echo/planner_warp.hpp"
#include "moe_echo/planner.hpp"
#include "test_util.hpp"

namespace moe_echo::test {
namespace {

// A reusable barrier on a futex: the last lane to arrive starts the next generation and wakes
// the others, which yield a few times and then sleep in the kernel until the generation word
// changes (FUTEX_WAIT returns at once when it already has: no wake-up is lost). 32 lanes on a
// machine of 2 cores must sleep, not spin, while they wait. (Written here rather than std::barrier,
// whose libstdc++ 12 implementation waits on atomics through a shared waiter pool.)
class LaneBarrier {
 public:
  explicit LaneBarrier(int lanes) : lanes_(lanes) {}
  void arrive_and_wait() {
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == lanes_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      futex(FUTEX_WAKE_PRIVATE, INT_MAX);
      return;
    }
    for (int spin = 0; spin < kYields; ++spin) {
      if (generation_.load(std::memory_order_acquire) != generation) return;
      std::this_thread::yield();
    }
    while (generation_.load(std::memory_order_acquire) == generation)
      futex(FUTEX_WAIT_PRIVATE, generation);
  }

 private:
  void futex(int op, uint32_t value) {
    static_assert(sizeof(generation_) == sizeof(uint32_t) &&
                  std::atomic<uint32_t>::is_always_lock_free);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), op, value, nullptr, nullptr, 0);
  }

  static constexpr int kYields = 16;  // before sleeping: most waits are short with few lanes
  const int lanes_;
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> generation_{0};
};

// What the lanes of one emulated warp share: a barrier and one exchange slot per lane.
struct WarpShared {
  explicit WarpShared(int lanes) : barrier(lanes), slots(size_t(lanes)) {}
  LaneBarrier barrier;
  std::vector<int64_t> slots;
};

// planner_warp.hpp's warp interface (see the comment above warp_best there) over threads: every
// exchange writes this lane's slot, waits for all lanes, reads, and waits again before the slots
// are reused. The barrier also orders the lanes' other memory accesses, as __syncwarp does.
template <int L>
struct EmulatedWarp {
  static constexpr int kLanes = L;
  int lane;
  WarpShared* shared;
  void sync() const { shared->barrier.arrive_and_wait(); }
  template <class T>
  T shfl(T v, int src) const {
    return exchange(v, src);
  }
  template <class T>
  T shfl_xor(T v, int mask) const {
    return exchange(v, lane ^ mask);
  }
  uint32_t ballot(bool pred) const {
    shared->slots[size_t(lane)] = pred ? 1 : 0;
    sync();
    uint32_t mask = 0;
    for (int i = 0; i < L; ++i)
      if (shared->slots[size_t(i)] != 0) mask |= 1u << i;
    sync();
    return mask;
  }

 private:
  template <class T>
  T exchange(T v, int src) const {
    shared->slots[size_t(lane)] = static_cast<int64_t>(v);
    sync();
    const T got = static_cast<T>(shared->slots[size_t(src)]);
    sync();
    return got;
  }
};

// The plan kernel of src/cuda/planner.cu with L threads that are all in warp 0.
template <int L>
std::vector<int32_t> plan_on_emulated_warp(const std::vector<int32_t>& map,
                                           const PlannerConfig& cfg) {
  std::vector<int32_t> storage(size_t(plan_ints(cfg)), -77777);  // poison: unwritten shows
  const PlanView out = plan_view(storage.data(), cfg);
  std::vector<int64_t> scratch((planner_core::PlannerCore::bytes(cfg) + 7) / 8);
  WarpShared shared(L);
  std::atomic<int32_t> clones{0};
  std::vector<std::thread> lanes;
  for (int lane = 0; lane < L; ++lane)
    lanes.emplace_back([&, lane] {
      planner_core::PlannerWarp core;
      core.bind(cfg, scratch.data());
      core.init_experts(map.data(), lane, L);
      shared.barrier.arrive_and_wait();
      core.init_ranks(lane, L, out.load_before);
      shared.barrier.arrive_and_wait();
      const EmulatedWarp<L> w{lane, &shared};
      core.place_clones_warp(w, cfg.clone_cost_rows);
      core.refine_warp(w);
      if (lane == 0) core.align_blocks(cfg.clone_cost_rows);
      w.sync();
      shared.barrier.arrive_and_wait();
      clones += core.write_part(out, lane, L);
      shared.barrier.arrive_and_wait();
      if (lane == 0) out.num_clones[0] = clones.load();
    });
  for (std::thread& t : lanes) t.join();
  return storage;
}

// Over shapes x 4 routing modes x `modes_per_shape` draws x the clone costs `costs`.
template <int L>
void check_shapes(int modes_per_shape, uint64_t seed, int row_block = 1,
                  std::vector<int64_t> costs = {0, 40, 2226}) {
  struct Shape {
    int R, EPR, S, clones;
  };
  const Shape shapes[] = {{1, 8, 1, 2},  {2, 4, 1, 1},  {4, 2, 2, 2},   {4, 8, 1, 3},
                          {4, 32, 2, 2}, {8, 4, 2, 2},  {8, 32, 1, 8},  {16, 2, 4, 4},
                          {32, 8, 1, 2}, {64, 4, 2, 2}, {256, 1, 1, 2}, {256, 1, 4, 8}};
  std::mt19937_64 rng(seed);
  int64_t plans = 0, clones = 0;
  for (const Shape& sh : shapes)
    for (int mode = 0; mode < 4; ++mode)
      for (int rep = 0; rep < modes_per_shape; ++rep)
        for (int64_t cost : costs) {
          PlannerConfig cfg;
          cfg.ranks = sh.R;
          cfg.experts = sh.R * sh.EPR;
          cfg.spare_slots = sh.S;
          cfg.max_clones = sh.clones;
          cfg.clone_cost_rows = cost;
          cfg.row_block = row_block;
          SCOPED_TRACE("lanes " + std::to_string(L) + " R " + std::to_string(sh.R) + " E " +
                       std::to_string(cfg.experts) + " S " + std::to_string(sh.S) + " clones " +
                       std::to_string(sh.clones) + " mode " + std::to_string(mode) + " cost " +
                       std::to_string(cost) + " row_block " + std::to_string(row_block));
          const std::vector<int32_t> map = planner_routing_map(sh.R, cfg.experts, mode, rng);
          Plan host(cfg);
          plan_echo(map.data(), cfg, host.view());
          const std::vector<int32_t> warp = plan_on_emulated_warp<L>(map, cfg);
          ASSERT_EQ(warp, host.storage);
          ++plans;
          clones += host.view().num_clones[0];
        }
  EXPECT_GT(clones, plans / 4) << "too few clones placed for the test to mean much";
}

TEST(PlannerWarp, OneLaneEqualsTheHostPlanner) { check_shapes<1>(1, 11); }
TEST(PlannerWarp, FourLanesEqualTheHostPlanner) { check_shapes<4>(2, 12); }
TEST(PlannerWarp, EightLanesEqualTheHostPlanner) { check_shapes<8>(1, 13); }
// A whole warp, at one clone cost (the 4- and 8-lane runs take all three): 32 threads meet at
// every shuffle, which costs most under the sanitizers.
TEST(PlannerWarp, ThirtyTwoLanesEqualTheHostPlanner) { check_shapes<32>(1, 14, 1, {40}); }
// Whole blocks of an expert's rows (FP8 weight gradients): align_blocks on lane 0 after the warp's
// refinement, as the kernel runs it.
TEST(PlannerWarp, WholeBlocksEqualTheHostPlanner) {
  check_shapes<4>(1, 15, 128);
  check_shapes<4>(1, 16, 16);
}

}  // namespace
}  // namespace moe_echo::test
