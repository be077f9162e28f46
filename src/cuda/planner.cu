// The planner on the GPU: Backend::plan writes, on the device, the same plan bit for bit as
// plan_echo / plan_none of src/echo/planner.cpp for the same routing map, by running the same
// code (src/echo/planner_core.hpp, with the warp code of src/echo/planner_warp.hpp) in one block:
// the expert loads and the initial state over all threads, then placement and refinement on
// warp 0, then the plan over all threads again. The greedy loop's state changes are sequential by
// nature and run on lane 0 (integer work over a few arrays of E and R entries, kept in shared
// memory); its searches over ranks and experts (the busiest rank, the targets, the candidates and
// their order) run on the whole warp.
//
// The host checks the config; the routing map comes from the router's counts, so it is never
// negative and its total fits int32 (validate(MoeConfig, ...) bounds T * K * R).
#include "cuda/common.cuh"
#include "cuda/ops.hpp"
#include "echo/planner_warp.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/planner.hpp"

namespace moe_echo::cuda {
namespace {

constexpr int kPlanThreads = 256;
static_assert(kPlanThreads % 32 == 0, "warp 0 must be whole");
// The planner's arrays live in shared memory when they fit: lane 0's greedy loop is a long chain
// of dependent loads and stores, which shared memory serves in tens of cycles where global memory
// (stores write through to L2) costs hundreds. Larger configs fall back to the global scratch.
constexpr size_t kMaxSharedBytes = 160 * 1024;

// One warp, as planner_warp.hpp's warp-cooperative functions take it; every call is made by all 32
// lanes together.
struct Warp {
  static constexpr int kLanes = 32;
  static constexpr unsigned kAll = 0xffffffffu;
  int lane;
  __device__ void sync() const { __syncwarp(kAll); }
  template <class T>
  __device__ T shfl(T v, int src) const {
    return __shfl_sync(kAll, v, src);
  }
  template <class T>
  __device__ T shfl_xor(T v, int mask) const {
    return __shfl_xor_sync(kAll, v, mask);
  }
  __device__ uint32_t ballot(bool pred) const { return __ballot_sync(kAll, pred ? 1 : 0); }
};

// kShared: the arrays in shared memory (a compile-time choice, so that their loads and stores
// compile to shared-memory instructions rather than generic ones) or in `scratch`.
template <bool kShared>
__global__ void __launch_bounds__(kPlanThreads, 1)
    plan_kernel(PlannerConfig cfg, bool echo, const int32_t* __restrict__ routing_map, PlanView out,
                void* scratch) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int clones;
  const int tid = int(threadIdx.x), threads = int(blockDim.x);
  planner_core::PlannerWarp core;
  core.bind(cfg, kShared ? static_cast<void*>(smem) : scratch);
  if (tid == 0) clones = 0;
  core.init_experts(routing_map, tid, threads);
  __syncthreads();
  core.init_ranks(tid, threads, out.load_before);
  __syncthreads();
  if (echo && tid < Warp::kLanes) {  // warp 0, whole
    const Warp w{tid};
    core.place_clones_warp(w, cfg.clone_cost_rows);
    core.refine_warp(w);
  }
  __syncthreads();
  const int32_t mine = core.write_part(out, tid, threads);
  if (mine != 0) atomicAdd(&clones, mine);  // an integer sum: the same in any order
  __syncthreads();
  if (tid == 0) out.num_clones[0] = clones;
}

}  // namespace

size_t planner_scratch_bytes(const PlannerConfig& cfg) {
  return planner_core::PlannerCore::bytes(cfg);
}

void plan(const Tensor& routing_map, const PlannerConfig& cfg, bool echo, const Tensor& plan,
          void* scratch, cudaStream_t s) {
  validate(cfg);
  MOE_ECHO_CHECK(
      routing_map.dtype == DType::i32 && routing_map.numel() == int64_t(cfg.ranks) * cfg.experts,
      "routing_map must be i32[" << cfg.ranks << ", " << cfg.experts << "], got "
                                 << routing_map.describe());
  MOE_ECHO_CHECK(plan.dtype == DType::i32 && plan.numel() >= plan_ints(cfg),
                 "plan storage " << plan.describe() << " < " << plan_ints(cfg) << " ints");
  const size_t bytes = planner_core::PlannerCore::bytes(cfg);
  const PlanView out = plan_view(plan.as<int32_t>(), cfg);
  if (bytes > kMaxSharedBytes) {
    MOE_ECHO_LAUNCH(plan_kernel<false>, 1, kPlanThreads, 0, s, cfg, echo, routing_map.as<int32_t>(),
                    out, scratch);
    return;
  }
  if (bytes > 48 * 1024)
    MOE_ECHO_CUDA_CHECK(cudaFuncSetAttribute(
        plan_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  MOE_ECHO_LAUNCH(plan_kernel<true>, 1, kPlanThreads, bytes, s, cfg, echo,
                  routing_map.as<int32_t>(), out, scratch);
}

}  // namespace moe_echo::cuda
