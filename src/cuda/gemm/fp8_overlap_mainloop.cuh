// The FP8 blockwise mainloop with its promotion overlapped: the consumer side of CUTLASS 4.2's
// ptr-array FP8BlockScaledAccum collective (loads, pipeline, scale layouts and TMA descriptors
// all stay CUTLASS's), with mma() replaced.
//
// CUTLASS's mma() issues a K block's wgmmas into a temporary accumulator, waits for all of them,
// then promotes: main += temp * scale_a * scale_b, with the tensor cores idle meanwhile. With a
// scale per row on both operands (the weight gradient: 1 x 128 tiles on x^T and dy^T) that is a
// multiply and a fused multiply-add on each of a thread's 64 accumulators per K block; with a
// weight block's one scale (fprop, dgrad) a fused multiply-add.
//
// Here each warp group keeps two temporary accumulators and issues K block k + 1's wgmmas into one
// before it promotes block k from the other (warpgroup_wait<1>), so the promotion runs beside the
// tensor cores. 3 x 64 accumulator registers per thread at a 128 x 128 tile of two warp groups.
// A stage's buffer (data and scales) is released after its promotion; the last one by mma_tail,
// as CUTLASS's contract has it. A tile with no K blocks (an empty group) ends with zeros.
// Measured against CUTLASS's consumer on the same tiles: docs/fp8.md.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace moe_echo::cuda::gemm_detail {

template <class Base>
struct Fp8OverlapMainloop : Base {
  using typename Base::ElementBlockScale;
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  using typename Base::TileShape;

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const& /*mainloop_params*/) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "accumulators must be in registers");
    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;

    auto sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    auto sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    // The scales as (BLK_M, BLK_N, (scale blocks of K, stage)) views of the output tile: A's
    // broadcast along N, B's along M, so that they partition exactly as the accumulators do.
    auto sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(
            make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                       make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
            make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                        make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    auto sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(
            make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                       make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
            make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                        make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    TiledMma tiled_mma;
    const int warp_group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    auto wg_mma = tiled_mma.get_slice(
        make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{})(warp_group));
    auto tCrA = wg_mma.make_fragment_A(wg_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
    auto tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
    auto thr_c = tiled_mma.get_slice(thread_idx);
    auto tCsSFA = thr_c.partition_C(sSFA);  // (MMA, MMA_M, MMA_N, (K blocks, PIPE))
    auto tCsSFB = thr_c.partition_C(sSFB);
    // Registers for one stage's scales: only the distinct values (the broadcast modes keep
    // stride 0).
    auto sfa = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
    auto sfb = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));
    auto part0 = make_fragment_like(accum);
    auto part1 = make_fragment_like(accum);

    // One K block's wgmmas into a temporary accumulator, started from zero, committed as one
    // batch.
    auto issue = [&](auto& part, int stage) {
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(part);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), part);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(part);
    };
    // A stage's scales into registers, in two parts around the wait for that stage's wgmmas: A's
    // and the first kEarlyB of B's before it, so that the promotion's first multiplies do not
    // wait on shared memory, the rest after it (all of them before the wait would not fit in the
    // registers beside three accumulator sets). The compact views list each distinct scale once,
    // in the same order for the shared-memory and the register side (same layouts).
    auto sfb_regs = filter_zeros(sfb);
    constexpr int kEarlyB = cute::min(16, int(size(decltype(sfb_regs){})));
    auto load_scales_early = [&](int stage) {
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), sfa);
      auto from = filter_zeros(tCsSFB(_, _, _, make_coord(_0{}, stage)));
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kEarlyB; ++j) sfb_regs(j) = from(j);
    };
    auto load_scales_late = [&](int stage) {
      auto from = filter_zeros(tCsSFB(_, _, _, make_coord(_0{}, stage)));
      CUTLASS_PRAGMA_UNROLL
      for (int j = kEarlyB; j < size(sfb_regs); ++j) sfb_regs(j) = from(j);
    };
    // main += part * scale_a * scale_b, after the block's wgmmas completed (the caller waited).
    // With one scale per tile on a side the products scale_a * scale_b repeat and fold.
    auto promote = [&](auto& part) {
      warpgroup_fence_operand(part);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += part(i) * (sfa(i) * sfb(i));
      warpgroup_fence_operand(part);
    };

    clear(accum);
    if (k_tile_count <= 0) return;
    // wgmma reads its accumulator operand even when it starts from zero. Defined values, pinned
    // here by the fences, keep the compiler from later copying a register of an in-flight wgmma
    // into them (ptxas would then wait for that wgmma).
    clear(part0);
    clear(part1);
    warpgroup_fence_operand(part0);
    warpgroup_fence_operand(part1);
    PipelineState issued = smem_pipe_read;    // the next stage to issue
    PipelineState promoted = smem_pipe_read;  // the oldest stage in flight
    // Issue the next stage into `next`, then promote the oldest one from `done` and release it.
    auto advance = [&](auto& next, auto& done) {
      pipeline.consumer_wait(issued);
      issue(next, issued.index());
      ++issued;
      load_scales_early(promoted.index());
      warpgroup_wait<1>();
      load_scales_late(promoted.index());
      promote(done);
      pipeline.consumer_release(promoted);
      ++promoted;
    };
    // Promote the last stage from `done`; it stays held (mma_tail releases it).
    auto finish = [&](auto& done) {
      load_scales_early(promoted.index());
      warpgroup_wait<0>();
      load_scales_late(promoted.index());
      promote(done);
    };
    pipeline.consumer_wait(issued);
    issue(part0, issued.index());
    ++issued;
    // Two K blocks per trip, so that each temporary accumulator is a fixed set of registers.
    int k = 1;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k + 1 < k_tile_count; k += 2) {
      advance(part1, part0);
      advance(part0, part1);
    }
    if (k < k_tile_count) {
      advance(part1, part0);
      finish(part1);
    } else {
      finish(part0);
    }
  }
};

}  // namespace moe_echo::cuda::gemm_detail
