// Internal pieces of GroupedGemm shared by its translation units, its GPU test and its benchmark.
//
// Per call, one small "prep" kernel reads the window's group offsets on the device and writes the
// CUTLASS problem of every group (shape, operand pointers, leading dimensions) into fixed device
// arrays; then one persistent CUTLASS ptr-array kernel, whose grid and workspace were fixed at
// construction, runs over them. Nothing is read back by the host, so a call is capture-safe.
//
// Invariants of the problem arrays written by the prep kernel:
// - Entries [0, max_groups) are always written; groups at or beyond window.groups, and groups
//   with no row in the window, get the shape (0, 0, 0): the CUTLASS group scheduler gives them
//   no tile, so they read and write nothing. In particular no K = 0 problem (wgrad of an empty
//   group) ever reaches a mainloop, whose accumulators would then be uninitialised.
// - Pointers of empty groups still point into the caller's tensors (never null).
// - Leading dimensions are in elements; CUTLASS's packed strides of the layouts used here have
//   exactly one dynamic entry (the leading dimension), which each kernel checks at construction.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "moe_echo/backend.hpp"

namespace moe_echo::cuda::gemm_detail {

enum class GemmOp { fprop, dgrad, wgrad };
const char* to_string(GemmOp op);

// Device arrays of one op's per-group CUTLASS arguments (see the invariants above).
struct ProblemArrays {
  int32_t* shapes = nullptr;        // [max_groups][3]: (M, N, K) of each group's CUTLASS problem
  const void** ptr_a = nullptr;     // [max_groups]
  const void** ptr_b = nullptr;     // [max_groups]
  void** ptr_c = nullptr;           // [max_groups]: epilogue source C and destination D (the same)
  const float** ptr_sfa = nullptr;  // [max_groups]: FP8 kernels: the scales of A and B
  const float** ptr_sfb = nullptr;
  int64_t* ld_a = nullptr;  // [max_groups]: leading dimensions, in elements
  int64_t* ld_b = nullptr;
  int64_t* ld_c = nullptr;
};

// Owns the device memory of one ProblemArrays (one cudaMalloc, every array 16-byte aligned, as
// CUTLASS builds its placeholder TMA descriptors from these addresses).
class ProblemBuffers {
 public:
  explicit ProblemBuffers(int max_groups);
  ~ProblemBuffers();
  ProblemBuffers(const ProblemBuffers&) = delete;
  ProblemBuffers& operator=(const ProblemBuffers&) = delete;
  const ProblemArrays& arrays() const { return arrays_; }

 private:
  void* base_ = nullptr;
  ProblemArrays arrays_;
};

// Launch choices of one kernel that need no new instantiation (the benchmark tries them).
struct RunnerOptions {
  int sm_count = 0;             // SMs the persistent grid may use; 0 = all (fewer leaves room
                                // for kernels on other streams)
  bool occupancy_grid = true;   // grid from cudaOccupancyMaxActiveClusters (CUTLASS's
                                // make_kernel_hardware_info); false = CUTLASS's SM-count rule
  bool raster_along_n = false;  // tile order inside a group: M fastest (CUTLASS's grouped
                                // default) or N fastest (see raster_along_n() below)
  int max_swizzle = 1;          // CUTLASS tile swizzle (1, 2, 4, 8)
};

// One CUTLASS grouped-GEMM kernel with its parameters and workspace fixed at construction (over
// one ProblemArrays and max_groups groups). run() only launches: capture-safe, allocation-free.
// Runs of one runner must be stream-ordered (its workspace holds per-SM TMA descriptors).
class KernelRunner {
 public:
  virtual ~KernelRunner() = default;
  virtual void run(cudaStream_t s) = 0;
  virtual const char* name() const = 0;
  virtual std::string describe() const = 0;  // grid, block, shared memory
  virtual int tile_m() const = 0;            // CTA tile extents of the CUTLASS problem
  virtual int tile_n() const = 0;
};

// The production kernels, one translation unit each (grouped_gemm_{fprop,dgrad,wgrad}.cu, and
// grouped_gemm_wgrad_bf16.cu below).
// fprop: beta 0 writes c, beta 1 adds to it (bf16 C = D read, one rounding of c + a @ b).
std::unique_ptr<KernelRunner> make_fprop_runner(const ProblemArrays& p, int max_groups,
                                                const RunnerOptions& o = {}, float beta = 0.0f);
std::unique_ptr<KernelRunner> make_dgrad_runner(const ProblemArrays& p, int max_groups,
                                                const RunnerOptions& o = {});
// wgrad: beta 1 adds to dw (C = D is read), beta 0 writes it (C is not read); with beta 0 the
// slabs of groups without rows are zeroed by launch_zero_empty_groups.
std::unique_ptr<KernelRunner> make_wgrad_runner(const ProblemArrays& p, int max_groups,
                                                const RunnerOptions& o = {}, float beta = 1.0f);
// wgrad writing bf16 (grouped_gemm_wgrad_bf16.cu): beta 0, bf16 D, no C; the fp32 accumulators
// rounded once. The slabs of groups without rows are zeroed by launch_zero_empty_groups.
std::unique_ptr<KernelRunner> make_wgrad_bf16_runner(const ProblemArrays& p, int max_groups,
                                                     const RunnerOptions& o = {});

// The FP8 blockwise kernels (grouped_gemm_fp8_{fprop,wgrad}.cu): e4m3 operands, both K-major,
// K-major fp32 scales per 128 of K. fprop and dgrad share one kernel (bf16 D; 1 x 128 scales on A,
// 128 x 128 on B); wgrad has per-row scales on both operands and fp32 D (beta 1 adds, 0 writes).
std::unique_ptr<KernelRunner> make_fp8_runner(const ProblemArrays& p, int max_groups,
                                              const RunnerOptions& o = {});
std::unique_ptr<KernelRunner> make_fp8_wgrad_runner(const ProblemArrays& p, int max_groups,
                                                    const RunnerOptions& o = {}, float beta = 1.0f);

// CUTLASS's rule for one GEMM (tile_scheduler_params.h): walk along M (M fastest) when the
// problem has more tiles along N than along M, else along N. Measured on an H200 at the
// ANCHORS.md shapes (bench/results), the better order was worth up to 9% and this rule picked it
// in every case where the two differed by more than the noise.
inline bool raster_along_n(int64_t m, int64_t n, int tile_m, int tile_n) {
  return (n + tile_n - 1) / tile_n <= (m + tile_m - 1) / tile_m;
}

// The runner (0: M fastest, 1: N fastest) whose tile order suits a call of `op` over `w` with the
// weights' K and N, by the rule above: wgrad's M (= K) and N are exact; for fprop and dgrad the
// rows of a group are known only on the device, so the balanced size rows / groups stands in.
// The choice only orders tiles: results are the same either way.
int raster_index(GemmOp op, const GroupWindow& w, int64_t k, int64_t n, const KernelRunner& r);
// SMs of the current device.
int device_sm_count();
// `sms` bounded by the device's SM count; 0: all of them.
int bounded_sm_count(int sms);

// The launch options of a kernel on sm_count SMs in one tile order (0: M fastest, 1: N fastest).
inline RunnerOptions runner_options(int sm_count, int along_n) {
  RunnerOptions o;
  o.sm_count = sm_count;
  o.raster_along_n = along_n == 1;
  return o;
}

// A kernel factory as GroupedGemm and GroupedGemmFp8 use it: make(op, p, max_groups, options,
// other) is op's kernel over p or, with `other`, its kernel of the other beta (null where the op
// has none).
using MakeKernel = std::unique_ptr<KernelRunner> (*)(GemmOp, const ProblemArrays&, int,
                                                     const RunnerOptions&, bool);

// One op's problem arrays and kernels, in both tile orders: `runner` and, where the op has one,
// `alt` with its other beta (bf16 fprop adding, wgrad writing).
struct OpKernels {
  OpKernels(GemmOp o, int max_groups, int sm_count, MakeKernel make) : op(o), buffers(max_groups) {
    for (int along_n = 0; along_n < 2; ++along_n) {
      const RunnerOptions opt = runner_options(sm_count, along_n);
      runner[along_n] = make(o, buffers.arrays(), max_groups, opt, false);
      alt[along_n] = make(o, buffers.arrays(), max_groups, opt, true);
    }
  }
  // The kernel whose tile order suits a call over `w` with the weights' K and N (raster_index);
  // `other`: the one of the other beta.
  KernelRunner& pick(const GroupWindow& w, int64_t k, int64_t n, bool other) {
    const int n_first = along_n(w, k, n);
    return other ? *alt[n_first] : *runner[n_first];
  }
  // The tile order (index into runner and alt) that suits a call over `w` (raster_index).
  int along_n(const GroupWindow& w, int64_t k, int64_t n) const {
    return raster_index(op, w, k, n, *runner[0]);
  }
  GemmOp op;
  ProblemBuffers buffers;
  std::unique_ptr<KernelRunner> runner[2];  // M fastest, N fastest
  std::unique_ptr<KernelRunner> alt[2];
};

// What GroupedGemm and GroupedGemmFp8 (`owner`, for the messages) hold: their group bound, the SMs
// their kernels use (bounded_sm_count) and each op's kernels.
struct GemmKernels {
  GemmKernels(const char* owner, int groups, int sms, MakeKernel make)
      : max_groups(checked_max_groups(owner, groups)),
        sm_count(bounded_sm_count(sms)),
        fprop(GemmOp::fprop, max_groups, sm_count, make),
        dgrad(GemmOp::dgrad, max_groups, sm_count, make),
        wgrad(GemmOp::wgrad, max_groups, sm_count, make) {}
  OpKernels& of(GemmOp op) {
    return op == GemmOp::fprop ? fprop : op == GemmOp::dgrad ? dgrad : wgrad;
  }
  static int checked_max_groups(const char* owner, int groups);

  int max_groups;
  int sm_count;
  OpKernels fprop, dgrad, wgrad;
};

#ifdef __CUDACC__
// The prep kernels' view of group g in a window (GroupWindow's rule): m rows from window row r;
// m = 0 (and r = 0) for a group at or beyond `groups` or with no row in the window.
struct WindowGroupRows {
  int64_t m, r;
};
__device__ __forceinline__ WindowGroupRows window_group_rows(const int32_t* __restrict__ offsets,
                                                             int g, int groups, int64_t row_lo,
                                                             int64_t rows) {
  int64_t lo = 0, hi = 0;
  if (g < groups) {
    const int64_t begin = offsets[g], end = offsets[g + 1];
    lo = begin > row_lo ? begin : row_lo;
    hi = end < row_lo + rows ? end : row_lo + rows;
  }
  const int64_t m = hi > lo ? hi - lo : 0;
  return {m, m > 0 ? lo - row_lo : 0};
}
#endif

// Extents of one call, after checking the tensors against the op (dtypes, shapes, alignment).
struct GemmDims {
  int64_t k = 0;  // the K of GemmArgs ([G, K, N] weights)
  int64_t n = 0;
};
GemmDims check_args(GemmOp op, const GemmArgs& a, int max_groups);
// The dtype of a wgrad's output slabs (c_home's where there is a home split, else c's).
inline DType wgrad_c_dtype(const GemmArgs& a) { return a.c_home.data ? a.c_home.dtype : a.c.dtype; }
// The window's groups (0 to max_groups, with offsets) and rows (from row_lo >= 0, below 2^31), for
// the op `name` ("grouped_gemm fprop", "grouped_gemm fp8 wgrad", ...).
void check_window(const char* name, const GroupWindow& w, int max_groups);
// Zeroes the slab c[g] (f32 or bf16) of every group g with rows, none in the window (wgrad
// writing).
void launch_zero_empty_groups(const GemmArgs& a, const GemmDims& d, cudaStream_t s);

// Enqueues the prep kernel (one block) that fills p from a.window.group_offsets.
void launch_prep(GemmOp op, const GemmArgs& a, const GemmDims& d, const ProblemArrays& p,
                 int max_groups, cudaStream_t s);

}  // namespace moe_echo::cuda::gemm_detail
