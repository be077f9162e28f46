// The device planner (Backend::plan on the CUDA backend) against the CPU planner (plan_echo /
// plan_none): for random, Zipf-skewed, one-hot-expert and sparse routing maps over many configs
// (ranks 1 to 256, spare slots, clone limits, clone costs, whole blocks of 1 or 128 rows), the
// whole plan storage must be equal element for element. The device plan storage is poisoned
// first, so an unwritten entry fails. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "moe_echo/planner.hpp"
#include "test_util.hpp"

namespace moe_echo::test {
namespace {

TEST(CudaPlanner, PlansAreBitIdenticalToTheCpuPlanner) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  auto gpu = cuda::make_cuda_backend();
  std::mt19937_64 rng(2024);
  struct Shape {
    int R, EPR, S, clones;
  };
  const Shape shapes[] = {{1, 8, 1, 2},  {1, 64, 0, 0}, {2, 4, 1, 1},   {4, 2, 2, 2},
                          {4, 8, 1, 3},  {8, 4, 2, 2},  {8, 32, 1, 8},  {16, 2, 4, 4},
                          {32, 8, 1, 2}, {64, 4, 2, 2}, {256, 1, 1, 2}, {256, 1, 4, 8}};
  int64_t plans = 0, clones = 0;
  for (const Shape& sh : shapes)
    for (int mode = 0; mode < 4; ++mode)
      for (int64_t cost : {int64_t(0), int64_t(40)})
        for (int row_block : {1, 128})
          for (bool echo : {false, true}) {
            PlannerConfig cfg;
            cfg.ranks = sh.R;
            cfg.experts = sh.R * sh.EPR;
            cfg.spare_slots = sh.S;
            cfg.max_clones = sh.clones;
            cfg.clone_cost_rows = cost;
            cfg.row_block = row_block;
            SCOPED_TRACE("R " + std::to_string(sh.R) + " E " + std::to_string(cfg.experts) + " S " +
                         std::to_string(sh.S) + " clones " + std::to_string(sh.clones) + " mode " +
                         std::to_string(mode) + " cost " + std::to_string(cost) + " row_block " +
                         std::to_string(row_block) + (echo ? " echo" : " none"));
            const auto C = planner_routing_map(cfg.ranks, cfg.experts, mode, rng);
            Plan want(cfg);
            if (echo)
              plan_echo(C.data(), cfg, want.view());
            else
              plan_none(C.data(), cfg, want.view());
            OwnedTensor map(*gpu, DType::i32, {cfg.ranks, cfg.experts}),
                plan(*gpu, DType::i32, {plan_ints(cfg)});
            map.write(std::vector<double>(C.begin(), C.end()));
            poison(plan);
            gpu->plan(*map, cfg, echo, *plan, nullptr);
            ASSERT_EQ(to_i32(plan.read()), want.storage);
            ++plans;
            clones += want.view().num_clones[0];
          }
  EXPECT_GT(clones, 100) << "the sweep made too few clones to exercise the greedy placement";
  RecordProperty("plans", int(plans));
  RecordProperty("clones", int(clones));
}

// Backend::plan_placed on the device equals plan_placed on the host bit for bit, for placements
// that plan_echo made from another map (clones kept in their slots, holes between them).
TEST(CudaPlanner, PlacedPlansAreBitIdenticalToTheCpuPlanner) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  auto gpu = cuda::make_cuda_backend();
  std::mt19937_64 rng(2025);
  struct Shape {
    int R, EPR, S, clones;
  };
  const Shape shapes[] = {{2, 4, 1, 1},   {4, 2, 2, 2},  {4, 8, 1, 3},  {8, 4, 2, 2},
                          {8, 32, 1, 8},  {16, 2, 4, 4}, {32, 8, 1, 2}, {64, 4, 2, 2},
                          {256, 1, 1, 2}, {256, 1, 4, 8}};
  int64_t plans = 0, clones = 0;
  for (const Shape& sh : shapes)
    for (int mode = 0; mode < 4; ++mode)
      for (int row_block : {1, 128}) {
        PlannerConfig cfg;
        cfg.ranks = sh.R;
        cfg.experts = sh.R * sh.EPR;
        cfg.spare_slots = sh.S;
        cfg.max_clones = sh.clones;
        cfg.row_block = row_block;
        SCOPED_TRACE("R " + std::to_string(sh.R) + " E " + std::to_string(cfg.experts) + " S " +
                     std::to_string(sh.S) + " mode " + std::to_string(mode) + " row_block " +
                     std::to_string(row_block));
        const auto before = planner_routing_map(cfg.ranks, cfg.experts, mode, rng);
        const auto now = planner_routing_map(cfg.ranks, cfg.experts, mode, rng);
        Plan ahead(cfg), want(cfg);
        plan_echo(before.data(), cfg, ahead.view());
        std::vector<int32_t> placement(ahead.view().spare_expert,
                                       ahead.view().spare_expert + sh.R * sh.S);
        if (sh.S > 1)  // a hole before a clone: its slot must be kept
          for (int r = 0; r < sh.R; ++r)
            if (placement[size_t(r * sh.S)] >= 0 && placement[size_t(r * sh.S + 1)] < 0)
              std::swap(placement[size_t(r * sh.S)], placement[size_t(r * sh.S + 1)]);
        plan_placed(now.data(), cfg, placement.data(), want.view());
        OwnedTensor map(*gpu, DType::i32, {cfg.ranks, cfg.experts}),
            place(*gpu, DType::i32, {int64_t(sh.R) * sh.S}),
            plan(*gpu, DType::i32, {plan_ints(cfg)});
        map.write(std::vector<double>(now.begin(), now.end()));
        place.write(std::vector<double>(placement.begin(), placement.end()));
        poison(plan);
        gpu->plan_placed(*map, cfg, *place, *plan, nullptr);
        ASSERT_EQ(to_i32(plan.read()), want.storage);
        ++plans;
        clones += want.view().num_clones[0];
      }
  EXPECT_GT(clones, 50) << "the sweep placed too few clones";
  RecordProperty("plans", int(plans));
  RecordProperty("clones", int(clones));
}

}  // namespace
}  // namespace moe_echo::test
