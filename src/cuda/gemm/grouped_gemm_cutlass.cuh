// The CUTLASS 4.2 sm90a ptr-array grouped GEMM behind every GroupedGemm op, as one template.
// Include it only from a translation unit that instantiates one kernel (each instantiation costs
// about 80 s and 3.4 GB of compiler memory on two cores): grouped_gemm_{fprop,dgrad,wgrad,
// wgrad_bf16}.cu, and the benchmark's optional variants.
//
// bf16 operands, fp32 accumulation, epilogue D = alpha * acc + beta * C with C = D (the same
// matrix): beta = 0 for fprop/dgrad (bf16 D, C never read), beta = 1 for wgrad (fp32 D, +=);
// wgrad_bf16 writes a bf16 D with no C at all (NoSource).
// Problem shapes live only on the device (host_problem_shapes = nullptr), so the persistent grid
// is sized by the SM count and the workspace (per-SM TMA descriptors) by it too: both are fixed
// here, once, and run() is a bare launch.
#pragma once

#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>

#include "cuda/gemm/fp8_overlap_mainloop.cuh"
#include "cuda/gemm/grouped_gemm_detail.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/util/packed_stride.hpp"
#include "moe_echo/cuda_check.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda::gemm_detail {

// The launch parameters every runner fixes at construction (hardware info, grid, tile order,
// swizzle), the implementability check, the workspace and CUTLASS's initialize. Returns the
// workspace (cudaMalloc'd, or null), which the runner frees.
template <class GemmKernel, class Gemm, class Arguments>
void* initialize_gemm(Gemm& gemm, Arguments& args, const RunnerOptions& o, const char* name) {
  using RasterOrderOptions = cutlass::gemm::kernel::detail::RasterOrderOptions;
  int device = 0;
  MOE_ECHO_CUDA_CHECK(cudaGetDevice(&device));
  args.hw_info = cutlass::KernelHardwareInfo::make_kernel_hardware_info<GemmKernel>(device);
  if (o.sm_count > 0 && o.sm_count < args.hw_info.sm_count) args.hw_info.sm_count = o.sm_count;
  if (!o.occupancy_grid) args.hw_info.max_active_clusters = 0;
  args.scheduler.raster_order =
      o.raster_along_n ? RasterOrderOptions::AlongN : RasterOrderOptions::AlongM;
  args.scheduler.max_swizzle_size = o.max_swizzle;
  MOE_ECHO_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess,
                 name << ": CUTLASS cannot implement this grouped GEMM");
  void* workspace = nullptr;
  const size_t ws = Gemm::get_workspace_size(args);
  if (ws > 0) MOE_ECHO_CUDA_CHECK(cudaMalloc(&workspace, ws));
  const cutlass::Status st = gemm.initialize(args, workspace);
  if (st != cutlass::Status::kSuccess && workspace) cudaFree(workspace);
  MOE_ECHO_CHECK(st == cutlass::Status::kSuccess,
                 name << ": CUTLASS initialize failed: " << cutlass::cutlassGetStatusString(st));
  return workspace;
}

template <class GemmKernel, class Gemm>
std::string describe_gemm(const Gemm& gemm) {
  const dim3 grid = Gemm::get_grid_shape(gemm.params());
  std::ostringstream o;
  o << "grid " << grid.x << "x" << grid.y << "x" << grid.z << ", block "
    << GemmKernel::MaxThreadsPerBlock << ", smem " << GemmKernel::SharedStorageSize
    << " B, max active clusters " << gemm.params().hw_info.max_active_clusters;
  return o.str();
}

template <class Gemm>
void run_gemm(Gemm& gemm, cudaStream_t s, const char* name) {
  const cutlass::Status st = gemm.run(s);
  MOE_ECHO_CHECK(st == cutlass::Status::kSuccess,
                 name << ": CUTLASS launch failed: " << cutlass::cutlassGetStatusString(st) << " ("
                      << cudaGetErrorString(cudaGetLastError()) << ")");
}

// One kernel configuration. LayoutA/LayoutB are CUTLASS's (M x K) and (K x N) layout tags:
// RowMajor A and ColumnMajor B are K-major; ColumnMajor A and RowMajor B are M/N-major.
// Fp8ScaleN 0: bf16 operands. Otherwise e4m3 operands with blockwise fp32 scales (CUTLASS's
// FP8BlockScaledAccum mainloop: the scaled block sums promoted into fp32 every 128 of K), one
// scale per row of A and per Fp8ScaleN columns of B for each 128 of K, both operands K-major (FP8
// wgmma needs it). The scale arrays of a group are K-major ([rows][K / 128]), or with
// Fp8ScalesMN MN-major ([K / 128][rows]: the scales one K block needs are contiguous).
// Fp8Overlap: the consumer side of that mainloop replaced by Fp8OverlapMainloop (the promotion of
// one K block runs beside the next block's wgmmas; fp8_overlap_mainloop.cuh).
// EpiTileN: the epilogue's subtile is TileM x EpiTileN (0: CUTLASS's choice, 128 x 32 at a
// cooperative 128 x 128 tile). NoSource: D = acc, no C operand at all (no C buffers in shared
// memory, beta fixed at 0). EpiStagesD: how many of a tile's subtile stores may be in flight
// (0: CUTLASS's choice, 2; with as many as the tile has subtiles, the epilogue never waits for its
// own tile's stores and they drain during the next tile's main loop).
template <class ElementD_, class LayoutA_, class LayoutB_, int TileM, int TileN, int TileK,
          int ClusterM, int ClusterN, bool Pingpong_, int Fp8ScaleN_ = 0, bool Fp8ScalesMN_ = false,
          bool Fp8Overlap_ = false, int EpiTileN_ = 0, bool NoSource_ = false, int EpiStagesD_ = 0>
struct KernelConfig {
  using ElementD = ElementD_;
  using LayoutA = LayoutA_;
  using LayoutB = LayoutB_;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  static constexpr bool Pingpong = Pingpong_;
  static constexpr int Fp8ScaleN = Fp8ScaleN_;
  static constexpr bool Fp8ScalesMN = Fp8ScalesMN_;
  static constexpr bool Fp8Overlap = Fp8Overlap_;
  static constexpr int EpiTileN = EpiTileN_;
  static constexpr bool NoSource = NoSource_;
  static constexpr int EpiStagesD = EpiStagesD_;
};

// The CUTLASS ptr-array TMA epilogue `Epi` with StagesD store stages (StagesC raised to match where
// the stores reuse the C buffers); StagesD 0 leaves it as built.
template <class Epi, int StagesD>
struct EpilogueWithStagesD {
  using type = Epi;
};
template <class Fusion, int StagesC, int StagesD>
struct FusionWithStages;
template <int SC, int SD, int FS, bool R, bool Dl, int NW, class Op, class Tile, class EpiTile,
          int NewSC, int NewSD>
struct FusionWithStages<
    cutlass::epilogue::fusion::FusionCallbacks<
        cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<SC, SD, FS, R, Dl, NW>, Op, Tile,
        EpiTile>,
    NewSC, NewSD> {
  using type = cutlass::epilogue::fusion::FusionCallbacks<
      cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<NewSC, NewSD, FS, R, Dl, NW>, Op, Tile,
      EpiTile>;
};
template <int SC, int SD, int FS, bool R, bool Dl, int NW, class Tile, class EpiTile, class EC,
          class StrideC, class ED, class StrideD, class Fusion, class... Rest, int NewSD>
requires(NewSD > 0) struct EpilogueWithStagesD<
    cutlass::epilogue::collective::CollectiveEpilogue<
        cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<SC, SD, FS, R, Dl, NW>, Tile, EpiTile, EC,
        StrideC, ED, StrideD, Fusion, Rest...>,
    NewSD> {
  static constexpr int NewSC = R ? (SC > NewSD ? SC : NewSD) : SC;
  using type = cutlass::epilogue::collective::CollectiveEpilogue<
      cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<NewSC, NewSD, FS, R, Dl, NW>, Tile, EpiTile,
      EC, StrideC, ED, StrideD, typename FusionWithStages<Fusion, NewSC, NewSD>::type, Rest...>;
};

template <class Config>
inline constexpr bool KernelConfig_is_fp8 = Config::Fp8ScaleN > 0;

template <class Config>
inline constexpr int TileM_of = int(cute::size<0>(typename Config::TileShape{}));

template <class Config>
class CutlassRunner final : public KernelRunner {
 public:
  static constexpr bool kFp8 = Config::Fp8ScaleN > 0;
  static constexpr cute::GMMA::Major kScaleMajor =
      Config::Fp8ScalesMN ? cute::GMMA::Major::MN : cute::GMMA::Major::K;
  using ElementAB = std::conditional_t<kFp8, cutlass::float_e4m3_t, cutlass::bfloat16_t>;
  using ElementAcc = float;
  using ElementD = typename Config::ElementD;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, (kFp8 ? Config::Fp8ScaleN : 1),
                                                                128, kScaleMajor, kScaleMajor>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using MainloopLayoutA =
      std::conditional_t<kFp8, cute::tuple<typename Config::LayoutA*, LayoutSFA*>,
                         typename Config::LayoutA*>;
  using MainloopLayoutB =
      std::conditional_t<kFp8, cute::tuple<typename Config::LayoutB*, LayoutSFB*>,
                         typename Config::LayoutB*>;
  using KernelSchedule = std::conditional_t<
      kFp8,
      std::conditional_t<
          Config::Pingpong,
          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum,
          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum>,
      std::conditional_t<Config::Pingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>;
  using EpilogueSchedule =
      std::conditional_t<Config::Pingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  static constexpr int kAlignAB = 16 / int(sizeof(ElementAB));  // 8 elements: TMA's 16 bytes
  static constexpr int kAlignD = 16 / int(sizeof(ElementD));

  static constexpr bool kSource = !Config::NoSource;
  using ElementC = std::conditional_t<kSource, ElementD, void>;
  using EpilogueTile =
      std::conditional_t<Config::EpiTileN == 0, cutlass::epilogue::collective::EpilogueTileAuto,
                         cute::Shape<cute::Int<TileM_of<Config>>, cute::Int<Config::EpiTileN>>>;
  using Fusion = cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAcc, ElementC>;
  using BuiltEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::TileShape,
      typename Config::ClusterShape, EpilogueTile, ElementAcc, ElementAcc, ElementC,
      cutlass::layout::RowMajor*, kAlignD, ElementD, cutlass::layout::RowMajor*, kAlignD,
      EpilogueSchedule, Fusion>::CollectiveOp;
  using CollectiveEpilogue = typename EpilogueWithStagesD<BuiltEpilogue, Config::EpiStagesD>::type;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, MainloopLayoutA, kAlignAB,
      ElementAB, MainloopLayoutB, kAlignAB, ElementAcc, typename Config::TileShape,
      typename Config::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using CollectiveMainloop = std::conditional_t<kFp8 && Config::Fp8Overlap,
                                                Fp8OverlapMainloop<BuiltMainloop>, BuiltMainloop>;
  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideC = typename GemmKernel::InternalStrideC;
  using StrideD = typename GemmKernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  CutlassRunner(const ProblemArrays& p, int max_groups, const RunnerOptions& o, float beta,
                const char* name)
      : name_(name) {
    static_assert(sizeof(Shape3) == 3 * sizeof(int32_t));
    static_assert(sizeof(StrideA) == sizeof(int64_t) && sizeof(StrideB) == sizeof(int64_t) &&
                      sizeof(StrideC) == sizeof(int64_t) && sizeof(StrideD) == sizeof(int64_t),
                  "packed strides must hold one dynamic leading dimension");
    check_abi();

    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {max_groups, reinterpret_cast<Shape3*>(p.shapes), nullptr};
    args.mainloop.ptr_A = reinterpret_cast<const ElementAB**>(p.ptr_a);
    args.mainloop.dA = reinterpret_cast<StrideA*>(p.ld_a);
    args.mainloop.ptr_B = reinterpret_cast<const ElementAB**>(p.ptr_b);
    args.mainloop.dB = reinterpret_cast<StrideB*>(p.ld_b);
    if constexpr (kFp8) {
      // Grouped mode derives each group's scale layout from its device-side shape; the layout
      // arguments only carry the type.
      args.mainloop.ptr_SFA = p.ptr_sfa;
      args.mainloop.layout_SFA = nullptr;
      args.mainloop.ptr_SFB = p.ptr_sfb;
      args.mainloop.layout_SFB = nullptr;
    }
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.dAlpha = {cute::_0{}, cute::_0{}, 0};
    args.epilogue.thread.beta = beta;
    args.epilogue.thread.dBeta = {cute::_0{}, cute::_0{}, 0};
    if constexpr (kSource) {
      args.epilogue.ptr_C = const_cast<const ElementD**>(reinterpret_cast<ElementD**>(p.ptr_c));
    } else {
      MOE_ECHO_CHECK(beta == 0.0f, name << ": a kernel without C needs beta 0, not " << beta);
      args.epilogue.ptr_C = nullptr;
    }
    args.epilogue.dC = reinterpret_cast<StrideC*>(p.ld_c);
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(p.ptr_c);
    args.epilogue.dD = reinterpret_cast<StrideD*>(p.ld_c);
    workspace_ = initialize_gemm<GemmKernel>(gemm_, args, o, name_);
  }

  ~CutlassRunner() override {
    if (workspace_) cudaFree(workspace_);
  }

  void run(cudaStream_t s) override { run_gemm(gemm_, s, name_); }

  const char* name() const override { return name_; }

  int tile_m() const override { return TileM_of<Config>; }
  int tile_n() const override { return int(cute::size<1>(typename Config::TileShape{})); }

  std::string describe() const override { return describe_gemm<GemmKernel>(gemm_); }

 private:
  // The prep kernel writes plain int32 triples and int64 leading dimensions; check once that
  // CUTLASS's types lay them out that way (cute tuples of one dynamic member, in order).
  static void check_abi() {
    const Shape3 shape = cute::make_shape(11, 22, 33);
    const int32_t want_shape[3] = {11, 22, 33};
    MOE_ECHO_CHECK(std::memcmp(&shape, want_shape, sizeof want_shape) == 0,
                   "cute::Shape<int,int,int> is not laid out as (M, N, K) int32");
    const int64_t ld = 77;
    const auto sa = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(77, 77, 1));
    const auto sb = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(77, 77, 1));
    const auto sc = cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(77, 77, 1));
    MOE_ECHO_CHECK(std::memcmp(&sa, &ld, sizeof ld) == 0 && std::memcmp(&sb, &ld, sizeof ld) == 0 &&
                       std::memcmp(&sc, &ld, sizeof ld) == 0,
                   "a CUTLASS packed stride does not hold its leading dimension as one int64");
  }

  const char* name_;
  Gemm gemm_;
  void* workspace_ = nullptr;
};

}  // namespace moe_echo::cuda::gemm_detail
