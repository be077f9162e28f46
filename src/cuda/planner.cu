// The planner on the GPU: Backend::plan writes, on the device, the same plan bit for bit as
// plan_echo / plan_none of src/echo/planner.cpp for the same routing map, by running the same
// code (src/echo/planner_core.hpp) in one block: the expert loads and the initial state over all
// threads, then placement, refinement and the plan itself on thread 0 (the greedy loop is
// sequential by nature; it is integer work over a few arrays of E and R entries, kept in shared
// memory).
//
// The host checks the config; the routing map comes from the router's counts, so it is never
// negative and its total fits int32 (validate(MoeConfig, ...) bounds T * K * R).
#include "cuda/common.cuh"
#include "cuda/ops.hpp"
#include "echo/planner_core.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/planner.hpp"

namespace moe_echo::cuda {
namespace {

constexpr int kPlanThreads = 256;
// The planner's arrays live in shared memory when they fit: thread 0's greedy loop is a long chain
// of dependent loads and stores, which shared memory serves in tens of cycles where global memory
// (stores write through to L2) costs hundreds. Larger configs fall back to the global scratch.
constexpr size_t kMaxSharedBytes = 160 * 1024;

__global__ void __launch_bounds__(kPlanThreads, 1)
    plan_kernel(PlannerConfig cfg, bool echo, const int32_t* __restrict__ routing_map,
                PlanView out, void* scratch, bool in_shared) {
  extern __shared__ __align__(16) unsigned char smem[];
  planner_core::PlannerCore core;
  core.bind(cfg, in_shared ? static_cast<void*>(smem) : scratch);
  core.init_experts(routing_map, int(threadIdx.x), int(blockDim.x));
  __syncthreads();
  core.init_ranks(int(threadIdx.x), int(blockDim.x));
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (echo) {
    core.place_clones(cfg.clone_cost_rows);
    core.refine();
  }
  core.write(out);
}

}  // namespace

size_t planner_scratch_bytes(const PlannerConfig& cfg) {
  return planner_core::PlannerCore::bytes(cfg);
}

void plan(const Tensor& routing_map, const PlannerConfig& cfg, bool echo, const Tensor& plan,
          void* scratch, cudaStream_t s) {
  validate(cfg);
  MOE_ECHO_CHECK(routing_map.dtype == DType::i32 &&
                     routing_map.numel() == int64_t(cfg.ranks) * cfg.experts,
                 "routing_map must be i32[" << cfg.ranks << ", " << cfg.experts << "], got "
                                            << routing_map.describe());
  MOE_ECHO_CHECK(plan.dtype == DType::i32 && plan.numel() >= plan_ints(cfg),
                 "plan storage " << plan.describe() << " < " << plan_ints(cfg) << " ints");
  const size_t bytes = planner_core::PlannerCore::bytes(cfg);
  const bool in_shared = bytes <= kMaxSharedBytes;
  const size_t smem = in_shared ? bytes : 0;
  if (smem > 48 * 1024)
    MOE_ECHO_CUDA_CHECK(cudaFuncSetAttribute(plan_kernel,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             int(smem)));
  MOE_ECHO_LAUNCH(plan_kernel, 1, kPlanThreads, smem, s, cfg, echo, routing_map.as<int32_t>(),
                  plan_view(plan.as<int32_t>(), cfg), scratch, in_shared);
}

}  // namespace moe_echo::cuda
