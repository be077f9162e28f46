// The planner on the GPU: Backend::plan (and plan_placed) writes, on the device, the same plan bit
// for bit as plan_echo / plan_none (plan_placed) of src/echo/planner.cpp for the same routing map
// (and placement), by running the same
// code (src/echo/planner_core.hpp, with the warp code of src/echo/planner_warp.hpp) in one block:
// the expert loads and the initial state over all threads, then placement and refinement on
// warp 0 (and the whole blocks of align_blocks on its lane 0), then the plan over all threads
// again. The greedy loop's state changes are sequential by
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

// The slot of rank r's k-th clone in a placement: its k-th entry >= 0 (S entries from `row`).
__device__ int placed_slot(const int32_t* row, int S, int k) {
  for (int s = 0; s < S; ++s)
    if (row[s] >= 0 && k-- == 0) return s;
  return -1;
}

// kShared: the arrays in shared memory (a compile-time choice, so that their loads and stores
// compile to shared-memory instructions rather than generic ones) or in `scratch`.
// plan_echo when echo, plan_placed with a placement (its clones added in slot order on lane 0,
// then the refinement, and after the plan each clone's compact slot mapped back to its slot in
// the placement: spare_expert per rank, replica_slot per expert), else plan_none.
template <bool kShared>
__global__ void __launch_bounds__(kPlanThreads, 1)
    plan_kernel(PlannerConfig cfg, bool echo, const int32_t* __restrict__ routing_map,
                const int32_t* __restrict__ placement, PlanView out, void* scratch) {
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
  const int R = cfg.ranks, S = cfg.spare_slots, E = cfg.experts, M = 1 + cfg.max_clones;
  if ((echo || placement) && tid < Warp::kLanes) {  // warp 0, whole
    const Warp w{tid};
    if (placement == nullptr)
      core.place_clones_warp(w, cfg.clone_cost_rows);
    else if (tid == 0)
      for (int i = 0; i < R * S; ++i)
        if (placement[i] >= 0) core.add_clone(placement[i], i / S);
    w.sync();
    core.refine_warp(w);
    if (tid == 0) core.align_blocks(cfg.clone_cost_rows);  // whole blocks, row_block > 1
    w.sync();
  }
  __syncthreads();
  const int32_t mine = core.write_part(out, tid, threads);
  if (mine != 0) atomicAdd(&clones, mine);  // an integer sum: the same in any order
  __syncthreads();
  if (tid == 0) out.num_clones[0] = clones;
  if (placement == nullptr) return;
  const int epr = E / R;
  for (int r = tid; r < R; r += threads) {
    // From the last compact entry down: entry k moves to its slot s_k >= k, and every slot above
    // k already holds its final entry.
    int32_t* row = out.spare_expert + int64_t(r) * S;
    for (int k = S - 1; k >= 0; --k) {
      const int s = placed_slot(placement + int64_t(r) * S, S, k);
      if (s < 0 || s == k) continue;
      row[s] = row[k];
      row[k] = -1;
    }
  }
  for (int e = tid; e < E; e += threads)
    for (int j = 1; j < M; ++j) {
      const int64_t at = int64_t(e) * M + j;
      const int r = out.replica_rank[at];
      if (r >= 0)
        out.replica_slot[at] =
            epr + placed_slot(placement + int64_t(r) * S, S, out.replica_slot[at] - epr);
    }
}

// Checks the shapes and launches plan_kernel (placement: i32 [R * S], or empty).
void launch_plan(const Tensor& routing_map, const PlannerConfig& cfg, bool echo,
                 const Tensor& placement, const Tensor& plan, void* scratch, cudaStream_t s) {
  validate(cfg);
  MOE_ECHO_CHECK(
      routing_map.dtype == DType::i32 && routing_map.numel() == int64_t(cfg.ranks) * cfg.experts,
      "routing_map must be i32[" << cfg.ranks << ", " << cfg.experts << "], got "
                                 << routing_map.describe());
  MOE_ECHO_CHECK(
      placement.data == nullptr || (placement.dtype == DType::i32 &&
                                    placement.numel() == int64_t(cfg.ranks) * cfg.spare_slots),
      "placement must be i32[" << int64_t(cfg.ranks) * cfg.spare_slots << "], got "
                               << placement.describe());
  MOE_ECHO_CHECK(plan.dtype == DType::i32 && plan.numel() >= plan_ints(cfg),
                 "plan storage " << plan.describe() << " < " << plan_ints(cfg) << " ints");
  const size_t bytes = planner_core::PlannerCore::bytes(cfg);
  const PlanView out = plan_view(plan.as<int32_t>(), cfg);
  const int32_t* place = placement.as<int32_t>();
  if (bytes > kMaxSharedBytes) {
    MOE_ECHO_LAUNCH(plan_kernel<false>, 1, kPlanThreads, 0, s, cfg, echo, routing_map.as<int32_t>(),
                    place, out, scratch);
    return;
  }
  if (bytes > 48 * 1024)
    MOE_ECHO_CUDA_CHECK(cudaFuncSetAttribute(
        plan_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  MOE_ECHO_LAUNCH(plan_kernel<true>, 1, kPlanThreads, bytes, s, cfg, echo,
                  routing_map.as<int32_t>(), place, out, scratch);
}

}  // namespace

size_t planner_scratch_bytes(const PlannerConfig& cfg) {
  return planner_core::PlannerCore::bytes(cfg);
}

void plan(const Tensor& routing_map, const PlannerConfig& cfg, bool echo, const Tensor& plan,
          void* scratch, cudaStream_t s) {
  launch_plan(routing_map, cfg, echo, Tensor(), plan, scratch, s);
}

void plan_placed(const Tensor& routing_map, const PlannerConfig& cfg, const Tensor& placement,
                 const Tensor& plan, void* scratch, cudaStream_t s) {
  MOE_ECHO_CHECK(placement.data != nullptr, "plan_placed: no placement");
  launch_plan(routing_map, cfg, true, placement, plan, scratch, s);
}

}  // namespace moe_echo::cuda
