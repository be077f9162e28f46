// Grouped GEMM benchmark: GroupedGemm's fprop, dgrad and wgrad at the ANCHORS.md shapes and at
// one EP4 rank of the Mixtral layer (balanced groups, bf16, all rows valid), next to the
// production kernel with each tile order, with tile swizzle and on fewer SMs, plus optional
// alternative kernel configurations.
//
// For every (shape, op, kernel): one call checked first against an fp64 reference at sampled
// output entries (rel. error over the samples), then timed under sustained load, interleaved
// with the other kernels of the same (shape, op) over several rounds (see Bench). A timed call
// is what a layer pays: the prep kernel plus the CUTLASS kernel, between two CUDA events.
// FLOPs = 2 * rows * K * N for every op. Inputs: uniform [-1, 1) bf16 with full mantissas
// (bench/torch_grouped_mm.py draws the same distribution: power, hence clocks, depend on it).
// Output: one JSON file (--out) and a table on stdout; bench/torch_grouped_mm.py adds
// torch._grouped_mm measured on the same GPU and the ratios. With --fp8, per (shape, op): the bf16
// production kernel, the FP8 blockwise kernel alone and with the quantization of its activation
// operands (bench/torch_grouped_mm.py --fp8 adds torch._scaled_grouped_mm rowwise).
//
// This one source file is also compiled once per variant kernel (MOE_ECHO_GG_VARIANT = index,
// CMake options MOE_ECHO_GEMM_VARIANTS for bf16, MOE_ECHO_GEMM_FP8_VARIANTS for FP8): each such
// object instantiates one alternative CUTLASS configuration and registers it; the main program
// (no MOE_ECHO_GG_VARIANT) times them all (the FP8 ones with --fp8).
//
// Internal headers on purpose: this is a kernel probe, not a user of the library. It times the
// CUTLASS kernels below the Backend interface (src/cuda/gemm: the runners, their tile orders and
// alternative configurations swapped in through GroupedGemmFp8::replace_kernel) and the FP8
// quantizers (src/cuda/ops.hpp), none of which the public headers expose. Every other benchmark
// and the CLI include only include/moe_echo/.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "cuda/gemm/grouped_gemm_detail.hpp"

namespace gg_bench {
using moe_echo::cuda::gemm_detail::GemmOp;
using moe_echo::cuda::gemm_detail::KernelRunner;
using moe_echo::cuda::gemm_detail::ProblemArrays;
using moe_echo::cuda::gemm_detail::RunnerOptions;
using MakeRunner = std::unique_ptr<KernelRunner> (*)(const ProblemArrays&, int,
                                                     const RunnerOptions&);
struct Variant {
  GemmOp op;
  const char* name;
  MakeRunner make;
  bool fp8 = false;      // an FP8 blockwise kernel (timed by --fp8 on GroupedGemmFp8's prep)
  bool bf16_dw = false;  // a wgrad writing bf16 (into the first half of each group's fp32 slab)
};
bool add_variant(const Variant& v);
}  // namespace gg_bench

#if defined(MOE_ECHO_GG_VARIANT)
// ---- one alternative kernel configuration -----------------------------------------------------
#include "cuda/gemm/grouped_gemm_cutlass.cuh"

namespace gg_bench {
namespace {
namespace gd = moe_echo::cuda::gemm_detail;
using bf16 = cutlass::bfloat16_t;
using Row = cutlass::layout::RowMajor;
using Col = cutlass::layout::ColumnMajor;
// Layouts per op as in grouped_gemm_{fprop,dgrad,wgrad}.cu; only tile, cluster and schedule vary.
#if MOE_ECHO_GG_VARIANT == 0
constexpr GemmOp kOp = GemmOp::fprop;
using Config = gd::KernelConfig<bf16, Row, Row, 256, 128, 64, 2, 1, false>;
constexpr const char* kName = "fprop 256x128x64 c2x1 coop";
#elif MOE_ECHO_GG_VARIANT == 1
constexpr GemmOp kOp = GemmOp::fprop;
using Config = gd::KernelConfig<bf16, Row, Row, 128, 256, 64, 1, 2, false>;
constexpr const char* kName = "fprop 128x256x64 c1x2 coop";
#elif MOE_ECHO_GG_VARIANT == 2
constexpr GemmOp kOp = GemmOp::dgrad;
using Config = gd::KernelConfig<bf16, Row, Col, 128, 256, 64, 1, 2, false>;
constexpr const char* kName = "dgrad 128x256x64 c1x2 coop";
#elif MOE_ECHO_GG_VARIANT == 3
constexpr GemmOp kOp = GemmOp::dgrad;
using Config = gd::KernelConfig<bf16, Row, Col, 128, 128, 64, 2, 1, true>;
constexpr const char* kName = "dgrad 128x128x64 c2x1 pingpong";
#elif MOE_ECHO_GG_VARIANT == 4
constexpr GemmOp kOp = GemmOp::wgrad;
using Config = gd::KernelConfig<float, Col, Row, 128, 256, 64, 2, 1, false>;
constexpr const char* kName = "wgrad 128x256x64 c2x1 coop";
#elif MOE_ECHO_GG_VARIANT == 5
constexpr GemmOp kOp = GemmOp::wgrad;
using Config = gd::KernelConfig<float, Col, Row, 128, 128, 64, 1, 2, true>;
constexpr const char* kName = "wgrad 128x128x64 c1x2 pingpong";
#elif MOE_ECHO_GG_VARIANT == 6
constexpr GemmOp kOp = GemmOp::fprop;
using Config = gd::KernelConfig<bf16, Row, Row, 128, 128, 64, 2, 1, true>;
constexpr const char* kName = "fprop 128x128x64 c2x1 pingpong";
// wgrad writing (beta 0: what the layer runs when it overwrites its gradients) without a C operand
// at all: no C buffers in shared memory, so more main-loop stages; fp32 dW as in production.
// Measured at the 64-expert shape on an H200 (bench/results): no faster than the production kernel
// at beta 0 (C buffers allocated, never read).
#elif MOE_ECHO_GG_VARIANT == 7
constexpr GemmOp kOp = GemmOp::wgrad;
using Config =
    gd::KernelConfig<float, Col, Row, 128, 128, 64, 2, 1, true, 0, false, false, 0, true>;
constexpr const char* kName = "wgrad 128x128x64 c2x1 pingpong, writing, no C";
#elif MOE_ECHO_GG_VARIANT == 8
constexpr GemmOp kOp = GemmOp::wgrad;
using Config =
    gd::KernelConfig<float, Col, Row, 128, 256, 64, 2, 1, false, 0, false, false, 0, true>;
constexpr const char* kName = "wgrad 128x256x64 c2x1 coop, writing, no C";
#elif MOE_ECHO_GG_VARIANT == 9
constexpr GemmOp kOp = GemmOp::wgrad;
using Config =
    gd::KernelConfig<float, Col, Row, 256, 128, 64, 2, 1, false, 0, false, false, 0, true>;
constexpr const char* kName = "wgrad 256x128x64 c2x1 coop, writing, no C";
#elif MOE_ECHO_GG_VARIANT == 10
constexpr GemmOp kOp = GemmOp::wgrad;
using Config =
    gd::KernelConfig<float, Col, Row, 128, 128, 64, 2, 1, true, 0, false, false, 0, true, 4>;
constexpr const char* kName = "wgrad 128x128x64 c2x1 pingpong, writing, no C, 4 stores in flight";
#elif MOE_ECHO_GG_VARIANT == 11
constexpr GemmOp kOp = GemmOp::wgrad;
using Config =
    gd::KernelConfig<float, Col, Row, 128, 128, 64, 1, 2, true, 0, false, false, 0, true>;
constexpr const char* kName = "wgrad 128x128x64 c1x2 pingpong, writing, no C";
// FP8 blockwise (CMake option MOE_ECHO_GEMM_FP8_VARIANTS, indices from 100): layouts and scale
// granularity as in grouped_gemm_fp8_{fprop,wgrad}.cu; tile, cluster and schedule vary.
#elif MOE_ECHO_GG_VARIANT == 100  // (a 128x128 ping-pong tile with a scale per column of B
                                  // does not compile: each warp group would hold 2 x 128 floats)
constexpr GemmOp kOp = GemmOp::wgrad;
using Config = gd::KernelConfig<float, Row, Col, 64, 128, 128, 1, 1, true, 1, true>;
constexpr const char* kName = "fp8 wgrad 64x128x128 c1x1 pingpong";
#elif MOE_ECHO_GG_VARIANT == 101
constexpr GemmOp kOp = GemmOp::wgrad;
using Config = gd::KernelConfig<float, Row, Col, 64, 128, 128, 2, 1, true, 1, true>;
constexpr const char* kName = "fp8 wgrad 64x128x128 c2x1 pingpong";
#elif MOE_ECHO_GG_VARIANT == 102
constexpr GemmOp kOp = GemmOp::wgrad;
using Config = gd::KernelConfig<float, Row, Col, 64, 128, 128, 1, 2, true, 1, true>;
constexpr const char* kName = "fp8 wgrad 64x128x128 c1x2 pingpong";
#elif MOE_ECHO_GG_VARIANT == 103
constexpr GemmOp kOp = GemmOp::fprop;
using Config = gd::KernelConfig<bf16, Row, Col, 64, 128, 128, 2, 1, true, 128>;
constexpr const char* kName = "fp8 fprop 64x128x128 c2x1 pingpong";
#elif MOE_ECHO_GG_VARIANT == 104
constexpr GemmOp kOp = GemmOp::dgrad;
using Config = gd::KernelConfig<bf16, Row, Col, 64, 128, 128, 2, 1, true, 128>;
constexpr const char* kName = "fp8 dgrad 64x128x128 c2x1 pingpong";
// The production tiles on CUTLASS's own FP8BlockScaledAccum consumer (promotion after each K
// block's wgmmas complete), beside the production Fp8OverlapMainloop.
#elif MOE_ECHO_GG_VARIANT == 105
constexpr GemmOp kOp = GemmOp::wgrad;
using Config = gd::KernelConfig<float, Row, Col, 128, 128, 128, 2, 1, false, 1, true, false>;
constexpr const char* kName = "fp8 wgrad 128x128x128 c2x1 coop, serial promotion";
#elif MOE_ECHO_GG_VARIANT == 106
constexpr GemmOp kOp = GemmOp::fprop;
using Config = gd::KernelConfig<bf16, Row, Col, 128, 128, 128, 2, 1, false, 128, false, false>;
constexpr const char* kName = "fp8 fprop 128x128x128 c2x1 coop, serial promotion";
#elif MOE_ECHO_GG_VARIANT == 107
constexpr GemmOp kOp = GemmOp::dgrad;
using Config = gd::KernelConfig<bf16, Row, Col, 128, 128, 128, 2, 1, false, 128, false, false>;
constexpr const char* kName = "fp8 dgrad 128x128x128 c2x1 coop, serial promotion";
// The epilogue of the FP8 wgrad: 128 x 64 subtiles (two per tile) instead of 128 x 32 (four);
// and, writing (beta 0, what the layer runs when it overwrites its gradients), no C operand.
#elif MOE_ECHO_GG_VARIANT == 108
constexpr GemmOp kOp = GemmOp::wgrad;
using Config =
    gd::KernelConfig<float, Row, Col, 128, 128, 128, 2, 1, false, 1, true, true, 64, false>;
constexpr const char* kName = "fp8 wgrad 128x128x128 c2x1 coop, epilogue 128x64";
#elif MOE_ECHO_GG_VARIANT == 109
constexpr GemmOp kOp = GemmOp::wgrad;
using Config =
    gd::KernelConfig<float, Row, Col, 128, 128, 128, 2, 1, false, 1, true, true, 64, true>;
constexpr const char* kName = "fp8 wgrad 128x128x128 c2x1 coop, writing, no C, epilogue 128x64";
#elif MOE_ECHO_GG_VARIANT == 110
constexpr GemmOp kOp = GemmOp::wgrad;
using Config =
    gd::KernelConfig<float, Row, Col, 128, 128, 128, 2, 1, false, 1, true, true, 0, true>;
constexpr const char* kName = "fp8 wgrad 128x128x128 c2x1 coop, writing, no C";
// What the fp32 output costs: the production wgrad writing a bf16 dW (as PyTorch's rowwise FP8
// grouped GEMM does), half the epilogue's bytes.
#elif MOE_ECHO_GG_VARIANT == 111
constexpr GemmOp kOp = GemmOp::wgrad;
using Config = gd::KernelConfig<bf16, Row, Col, 128, 128, 128, 2, 1, false, 1, true, true>;
constexpr const char* kName = "fp8 wgrad 128x128x128 c2x1 coop, writing a bf16 dW";
// The production wgrad with all four of a tile's subtile stores in flight (EpiStagesD 4): its
// epilogue does not wait for its own stores, which drain during the next tile's main loop.
#elif MOE_ECHO_GG_VARIANT == 112
constexpr GemmOp kOp = GemmOp::wgrad;
using Config =
    gd::KernelConfig<float, Row, Col, 128, 128, 128, 2, 1, false, 1, true, true, 0, false, 4>;
constexpr const char* kName = "fp8 wgrad 128x128x128 c2x1 coop, 4 stores in flight";
#elif MOE_ECHO_GG_VARIANT == 113
#define MOE_ECHO_GG_WRITING 1
constexpr GemmOp kOp = GemmOp::wgrad;
using Config =
    gd::KernelConfig<float, Row, Col, 128, 128, 128, 2, 1, false, 1, true, true, 0, false, 4>;
constexpr const char* kName = "fp8 wgrad 128x128x128 c2x1 coop, writing, 4 stores in flight";
#elif MOE_ECHO_GG_VARIANT == 114
constexpr GemmOp kOp = GemmOp::fprop;
using Config =
    gd::KernelConfig<bf16, Row, Col, 128, 128, 128, 2, 1, false, 128, false, true, 0, false, 4>;
constexpr const char* kName = "fp8 fprop 128x128x128 c2x1 coop, 4 stores in flight";
#elif MOE_ECHO_GG_VARIANT == 115
constexpr GemmOp kOp = GemmOp::wgrad;
using Config =
    gd::KernelConfig<bf16, Row, Col, 128, 128, 128, 2, 1, false, 1, true, true, 0, false, 4>;
constexpr const char* kName =
    "fp8 wgrad 128x128x128 c2x1 coop, writing a bf16 dW, 4 stores in flight";
#else
#error "unknown MOE_ECHO_GG_VARIANT"
#endif

constexpr bool kBf16Dw = kOp == GemmOp::wgrad && std::is_same_v<typename Config::ElementD, bf16>;
std::unique_ptr<KernelRunner> make(const ProblemArrays& p, int max_groups, const RunnerOptions& o) {
  // wgrad adds (beta 1) into fp32 unless the kernel has no C operand or the variant writes
  // (MOE_ECHO_GG_WRITING); a bf16 dW is written.
#if defined(MOE_ECHO_GG_WRITING)
  constexpr bool kWriting = true;
#else
  constexpr bool kWriting = false;
#endif
  const float beta =
      kOp == GemmOp::wgrad && !Config::NoSource && !kBf16Dw && !kWriting ? 1.0f : 0.0f;
  return std::make_unique<gd::CutlassRunner<Config>>(p, max_groups, o, beta, kName);
}
[[maybe_unused]] const bool registered =
    add_variant({kOp, kName, &make, gd::KernelConfig_is_fp8<Config>, kBf16Dw});
}  // namespace
}  // namespace gg_bench

#else
// ---- the benchmark program ---------------------------------------------------------------------
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>

#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/grouped_gemm_fp8.hpp"
#include "cuda/ops.hpp"
#include "moe_echo/backend.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/presets.hpp"
#include "moe_echo/random.hpp"
#include "moe_echo/synthetic.hpp"

namespace gg_bench {

std::vector<Variant>& variants() {
  static std::vector<Variant> v;
  return v;
}
bool add_variant(const Variant& v) {
  variants().push_back(v);
  return true;
}

namespace {

namespace gd = moe_echo::cuda::gemm_detail;
using moe_echo::DType;
using moe_echo::Fp8GemmArgs;
using moe_echo::GemmArgs;
using moe_echo::Tensor;

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#define CK(expr) ck((expr), #expr)

struct Shape {
  std::string name;
  int experts;
  int64_t rows, K, N;  // K = H, N = 2F (fc1)
  // Rows per group in memory order (empty: balanced, rows * g / experts apart).
  std::vector<int32_t> sizes = {};
  // Runs only when --shape names it, with the production kernel in either tile order only.
  bool on_request = false;
  // Laid out by split_order(): groups [0, split_at) and [split_at, experts) also run their wgrad
  // as two kernels on two streams (0: not split).
  int split_at = 0;
};

// The rows an EP 2 rank's experts get under Zipf 1.2 routing: 2 * experts experts with the
// popularity of moe-echo bench's synthetic tokens at step 0 (SyntheticTokens::log_popularity),
// `tokens` tokens each drawing top_k distinct experts by Gumbel top-k, as the router picks for
// those tokens; rows of experts [0, experts) counted: the group sizes of rank 0's expert GEMMs.
std::vector<int32_t> zipf_sizes(int experts, int hidden, int64_t tokens, int top_k, uint64_t seed) {
  const int all = 2 * experts;
  const std::vector<double> logp =
      moe_echo::SyntheticTokens(all, hidden, moe_echo::parse_skew("zipf:1.2"), seed)
          .log_popularity(0);
  moe_echo::Rng rng(seed, 0x2195);
  std::vector<double> key(logp.size());
  std::vector<int> order(logp.size());
  std::vector<int32_t> sizes(size_t(experts), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int e = 0; e < all; ++e) {
      key[size_t(e)] = logp[size_t(e)] + rng.gumbel();
      order[size_t(e)] = e;
    }
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int a, int b) { return key[size_t(a)] > key[size_t(b)]; });
    for (int k = 0; k < top_k; ++k)
      if (order[size_t(k)] < experts) ++sizes[size_t(order[size_t(k)])];
  }
  return sizes;
}

// The same sizes laid out for two kernels on two streams: from the largest size down, each goes
// to the half with fewer rows so far; the first half keeps its sizes from the largest down, the
// second from the smallest up, so the two kernels start on the hottest and on the coldest groups
// and end with about the same rows. Returns the layout and where the second half begins.
std::pair<std::vector<int32_t>, int> split_order(std::vector<int32_t> sizes) {
  std::sort(sizes.begin(), sizes.end(), std::greater<int32_t>());
  std::vector<int32_t> a, b;
  int64_t ra = 0, rb = 0;
  for (int32_t n : sizes) {
    if (ra <= rb) {
      a.push_back(n);
      ra += n;
    } else {
      b.push_back(n);
      rb += n;
    }
  }
  std::reverse(b.begin(), b.end());
  const int at = int(a.size());
  a.insert(a.end(), b.begin(), b.end());
  return {a, at};
}

// Sizes scaled to `rows` in all (each rounded down, the rest to the largest): the shape of the
// draw at the balanced shape's rows, so that times compare at the same FLOPs.
std::vector<int32_t> scaled(std::vector<int32_t> sizes, int64_t rows) {
  int64_t sum = 0;
  for (int32_t n : sizes) sum += n;
  int64_t left = rows;
  for (int32_t& n : sizes) {
    n = int32_t(int64_t(n) * rows / std::max<int64_t>(sum, 1));
    left -= n;
  }
  *std::max_element(sizes.begin(), sizes.end()) += int32_t(left);
  return sizes;
}

// An EP 2 rank's fc1 of a preset (half its experts, the rows of 8192 tokens at top_k), balanced,
// under Zipf 1.2 routing in expert order, and the same sizes laid out by split_order().
std::vector<Shape> ep2_fc1(const moe_echo::ModelPreset& p) {
  const int e = p.experts / 2;
  const std::string base = std::string(p.name) + "-ep2";
  const int64_t rows = int64_t(p.tokens) * p.top_k, K = p.hidden, N = 2 * int64_t(p.ffn);
  const std::vector<int32_t> z =
      scaled(zipf_sizes(e, p.hidden, 2 * int64_t(p.tokens), p.top_k, 7), rows);
  const auto [split, at] = split_order(z);
  return {{base, e, rows, K, N, {}, true, 0},
          {base + "-zipf1.2", e, rows, K, N, z, true, 0},
          {base + "-zipf1.2-split", e, rows, K, N, split, true, at}};
}

// fc1 of `experts` experts of a model on one GPU, with every row of the model's tokens per rank:
// T * K rows, K = H, N = 2F.
Shape fc1(const moe_echo::ModelPreset& p, int experts) {
  return {std::string(p.name), experts, int64_t(p.tokens) * p.top_k, p.hidden, 2 * int64_t(p.ffn)};
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void fill_uniform(__nv_bfloat16* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float u = float(mix64(seed * 0x100000001B3ull + i) >> 40) * (1.0f / 16777216.0f);
    p[i] = __float2bfloat16(2.0f * u - 1.0f);
  }
}

// One sampled output entry per block: an fp64 dot product of the bf16 inputs, and what the
// kernel wrote there. idx = (row or group, column) as chosen on the host.
__global__ void sample_reference(GemmOp op, const __nv_bfloat16* a, const __nv_bfloat16* b,
                                 const void* c, bool bf16_dw, const int32_t* offsets, int groups,
                                 int64_t K, int64_t N, const int64_t* idx, double* ref,
                                 double* got) {
  const int s = blockIdx.x;
  const int64_t i = idx[2 * s], j = idx[2 * s + 1];
  int g = 0;
  if (op != GemmOp::wgrad)
    while (g + 1 < groups && offsets[g + 1] <= i) ++g;
  double acc = 0;
  if (op == GemmOp::fprop) {  // y[i, j] = sum_k x[i, k] w[g, k, j]
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x)
      acc +=
          double(__bfloat162float(a[i * K + k])) * double(__bfloat162float(b[(g * K + k) * N + j]));
  } else if (op == GemmOp::dgrad) {  // dx[i, j] = sum_n dy[i, n] w[g, j, n]
    for (int64_t n = threadIdx.x; n < N; n += blockDim.x)
      acc +=
          double(__bfloat162float(a[i * N + n])) * double(__bfloat162float(b[(g * K + j) * N + n]));
  } else {  // dw[i = group, j = k * N + n] = sum_r x[r, k] dy[r, n]
    const int64_t k = j / N, n = j % N;
    for (int64_t r = offsets[i] + threadIdx.x; r < offsets[i + 1]; r += blockDim.x)
      acc += double(__bfloat162float(a[r * K + k])) * double(__bfloat162float(b[r * N + n]));
  }
  __shared__ double part[256];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (int(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    ref[s] = part[0];
    if (op == GemmOp::wgrad && bf16_dw) {  // group i's bf16 dW at the start of its fp32 slab
      got[s] = double(__bfloat162float(static_cast<const __nv_bfloat16*>(c)[2 * i * K * N + j]));
    } else if (op == GemmOp::wgrad) {
      got[s] = double(static_cast<const float*>(c)[i * K * N + j]);
    } else {
      const int64_t width = op == GemmOp::fprop ? N : K;
      got[s] = double(__bfloat162float(static_cast<const __nv_bfloat16*>(c)[i * width + j]));
    }
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Result {
  std::string shape, op, kernel;
  double ms_median, ms_min, ms_max_round, ms_min_round, tflops, rel_err;
  int calls;
};

struct Candidate {
  std::string label;
  std::function<void()> call;
  bool bf16_dw = false;  // wgrad output in bf16 (Variant::bf16_dw)
};

// Timing protocol (the GPU's clocks follow its power draw, so a kernel timed right after idle
// runs faster than the same kernel under sustained load, as in training): per (shape, op), all
// candidates are checked, then the GPU is pre-heated with the first one for preheat_ms, then
// `rounds` rounds each time every candidate in turn (a few untimed calls, then per-call CUDA
// events over at least block_ms and 20 calls). A candidate's time is the median of its round
// medians; the spread of the round medians is reported too.
class Bench {
 public:
  // fp8: per op, the bf16 production kernel against the FP8 blockwise kernel (GEMM alone, and
  // with the quantization of the operands a step produces: x or dy rows, or both transposed),
  // instead of the tile-order, swizzle and SM-count variants.
  Bench(double preheat_ms, double block_ms, int rounds, bool fp8)
      : preheat_ms_(preheat_ms), block_ms_(block_ms), rounds_(rounds), fp8_(fp8) {
    CK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
    int dev = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, dev));
    CK(cudaMalloc(&d_idx_, kSamples * 2 * sizeof(int64_t)));
    CK(cudaMalloc(&d_ref_, kSamples * sizeof(double)));
    CK(cudaMalloc(&d_got_, kSamples * sizeof(double)));
  }
  ~Bench() {
    if (side_) cudaStreamDestroy(side_);
    if (fork_) cudaEventDestroy(fork_);
    if (join_) cudaEventDestroy(join_);
    cudaFree(d_idx_);
    cudaFree(d_ref_);
    cudaFree(d_got_);
    cudaStreamDestroy(s_);
  }

  void run_shape(const Shape& sh) {
    const int E = sh.experts;
    const int64_t R = sh.rows, K = sh.K, N = sh.N;
    std::vector<int32_t> offs(size_t(E) + 1);
    for (int g = 0; g <= E; ++g)
      offs[size_t(g)] = sh.sizes.empty() ? int32_t(R * g / E)
                        : g == 0         ? 0
                                         : offs[size_t(g) - 1] + sh.sizes[size_t(g) - 1];
    // Buffers: x [R, K], w [E, K, N], y [R, N], dy [R, N], dx [R, K] bf16; dw [E, K, N] fp32.
    auto alloc = [](size_t bytes) {
      void* p = nullptr;
      CK(cudaMalloc(&p, bytes));
      return p;
    };
    void* x = alloc(size_t(R * K) * 2);
    void* w = alloc(size_t(E) * size_t(K * N) * 2);
    void* y = alloc(size_t(R * N) * 2);
    void* dy = alloc(size_t(R * N) * 2);
    void* dx = alloc(size_t(R * K) * 2);
    void* dw = alloc(size_t(E) * size_t(K * N) * 4);
    int32_t* d_offs = static_cast<int32_t*>(alloc(offs.size() * 4));
    CK(cudaMemcpy(d_offs, offs.data(), offs.size() * 4, cudaMemcpyHostToDevice));
    fill_uniform<<<1024, 256, 0, s_>>>(static_cast<__nv_bfloat16*>(x), size_t(R * K), 11);
    fill_uniform<<<1024, 256, 0, s_>>>(static_cast<__nv_bfloat16*>(w), size_t(E) * size_t(K * N),
                                       12);
    fill_uniform<<<1024, 256, 0, s_>>>(static_cast<__nv_bfloat16*>(dy), size_t(R * N), 13);
    CK(cudaGetLastError());

    moe_echo::GroupWindow win;
    win.group_offsets = d_offs;
    win.groups = E;
    win.row_lo = 0;
    win.rows = R;
    GemmArgs fa, da, wa;
    fa.window = da.window = wa.window = win;
    fa.a = Tensor(x, DType::bf16, {R, K});
    fa.b = Tensor(w, DType::bf16, {E, K, N});
    fa.c = Tensor(y, DType::bf16, {R, N});
    da.a = Tensor(dy, DType::bf16, {R, N});
    da.b = Tensor(w, DType::bf16, {E, K, N});
    da.c = Tensor(dx, DType::bf16, {R, K});
    wa.a = Tensor(x, DType::bf16, {R, K});
    wa.b = Tensor(dy, DType::bf16, {R, N});
    wa.c = Tensor(dw, DType::f32, {E, K, N});

    moe_echo::cuda::GroupedGemm gg(E);
    const double flop = 2.0 * double(R) * double(K) * double(N);
    if (fp8_) {
      run_fp8_shape(sh, win, fa, da, wa, gg, flop);
      for (void* p : {x, w, y, dy, dx, dw, static_cast<void*>(d_offs)}) CK(cudaFree(p));
      return;
    }
    // wgrad writing (beta 0; the layer's call when it overwrites its gradients): prep, the GEMM
    // and the kernel that zeroes the slabs of groups without rows.
    GemmArgs wa_write = wa;
    wa_write.accumulate = false;
    const struct {
      GemmOp op;
      const GemmArgs* args;
      std::function<void()> call;
    } ops[] = {{GemmOp::fprop, &fa, [&] { gg.fprop(fa, s_); }},
               {GemmOp::dgrad, &da, [&] { gg.dgrad(da, s_); }},
               {GemmOp::wgrad, &wa, [&] { gg.wgrad(wa, s_); }}};
    // The production kernel of each op with either tile order forced, and the variant kernels.
    const Variant production[] = {
        {GemmOp::fprop, "fprop production kernel",
         [](const gd::ProblemArrays& p, int groups, const RunnerOptions& o) {
           return gd::make_fprop_runner(p, groups, o);
         }},
        {GemmOp::dgrad, "dgrad production kernel", &gd::make_dgrad_runner},
        {GemmOp::wgrad, "wgrad production kernel",
         [](const gd::ProblemArrays& p, int groups, const RunnerOptions& o) {
           return gd::make_wgrad_runner(p, groups, o);
         }}};
    RunnerOptions along_m, along_n;
    along_n.raster_along_n = true;
    for (const auto& o : ops) {
      std::vector<Candidate> cands{{"GroupedGemm (production)", o.call}};
      if (o.op == GemmOp::wgrad)
        cands.push_back({"GroupedGemm (production), writing", [&] { gg.wgrad(wa_write, s_); }});
      std::vector<std::unique_ptr<gd::ProblemBuffers>> buffers;
      std::vector<std::unique_ptr<KernelRunner>> runners;
      auto add = [&](const Variant& v, const RunnerOptions& opt, const char* suffix) {
        buffers.push_back(std::make_unique<gd::ProblemBuffers>(E));
        runners.push_back(v.make(buffers.back()->arrays(), E, opt));
        const gd::GemmDims dims = gd::check_args(v.op, *o.args, E);
        const gd::ProblemArrays& arrays = buffers.back()->arrays();
        KernelRunner* r = runners.back().get();
        const GemmArgs* args = o.args;
        cands.push_back({std::string(v.name) + suffix + " [" + r->describe() + "]", [=, this] {
                           gd::launch_prep(v.op, *args, dims, arrays, E, s_);
                           r->run(s_);
                         }});
      };
      for (const Variant& v : production)
        if (v.op == o.op) {
          add(v, along_m, " +raster M");
          add(v, along_n, " +raster N");
          if (sh.on_request) continue;  // the tile orders only
          for (int sw : {2, 4, 8}) {
            // Tile swizzle: blocks of sw tiles across the raster, so that the tiles in flight
            // share more A and B panels in L2.
            RunnerOptions m = along_m, n = along_n;
            m.max_swizzle = n.max_swizzle = sw;
            add(v, m, (" +raster M swizzle " + std::to_string(sw)).c_str());
            add(v, n, (" +raster N swizzle " + std::to_string(sw)).c_str());
          }
          // The persistent grid on fewer SMs, leaving the rest to kernels on other streams
          // (communication beside the GEMM): what the GEMM gives up.
          for (int spare : {8, 16}) {
            RunnerOptions m = along_m, n = along_n;
            m.sm_count = n.sm_count = sm_count_ - spare;
            const std::string on = " on " + std::to_string(sm_count_ - spare) + " SMs";
            add(v, m, (" +raster M" + on).c_str());
            add(v, n, (" +raster N" + on).c_str());
          }
        }
      if (o.op == GemmOp::wgrad && sh.split_at > 0) add_split_wgrad(sh, wa, offs, x, dy, dw, cands);
      if (o.op == GemmOp::wgrad && !sh.on_request) {  // the production kernel writing (beta 0)
        const Variant writing{GemmOp::wgrad, "wgrad production kernel, writing",
                              [](const gd::ProblemArrays& p, int groups, const RunnerOptions& r) {
                                return gd::make_wgrad_runner(p, groups, r, 0.0f);
                              }};
        add(writing, along_m, " +raster M");
        add(writing, along_n, " +raster N");
      }
      for (const Variant& v : variants())
        if (v.op == o.op && !v.fp8 && !sh.on_request) {
          add(v, along_m, " +raster M");
          add(v, along_n, " +raster N");
        }
      run_op(sh, o.op, *o.args, cands, flop);
    }
    for (void* p : {x, w, y, dy, dx, dw, static_cast<void*>(d_offs)}) CK(cudaFree(p));
  }

  const std::vector<Result>& results() const { return results_; }

 private:
  static constexpr int kSamples = 192;

  // The wgrad of a split shape as two production kernels at once, each persistent on half the
  // SMs, on two streams: groups [0, split_at) (hottest first) on the bench's stream, the others
  // (coldest first) on a second one that forks from it and joins it again, so the two kernels'
  // tiles, bound by the fp32 gradient write (cold groups) and by their K loops (hot ones), run side
  // by side instead of wave after wave. The same tiles as one kernel: the same bits.
  void add_split_wgrad(const Shape& sh, const GemmArgs& wa, const std::vector<int32_t>& offs,
                       void* x, void* dy, void* dw, std::vector<Candidate>& cands) {
    const int E = sh.experts, half = sh.split_at;
    const int64_t K = sh.K, N = sh.N, mid = offs[size_t(half)], R = offs[size_t(E)];
    if (!side_) {
      CK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
      CK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
      CK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
    }
    const int sms[2] = {sm_count_ / 2, sm_count_ - sm_count_ / 2};
    for (int writing = 0; writing < 2; ++writing) {
      SplitWgrad& sp = split_[writing];
      GemmArgs* args = sp.args;
      args[0] = wa;
      args[0].accumulate = !writing;
      args[0].window.groups = half;
      args[0].window.rows = mid;
      args[0].a = Tensor(x, DType::bf16, {mid, K});
      args[0].b = Tensor(dy, DType::bf16, {mid, N});
      args[0].c = Tensor(dw, DType::f32, {half, K, N});
      args[1] = args[0];
      args[1].window.group_offsets = wa.window.group_offsets + half;
      args[1].window.groups = E - half;
      args[1].window.row_lo = mid;
      args[1].window.rows = R - mid;
      args[1].a = Tensor(static_cast<char*>(x) + mid * K * 2, DType::bf16, {R - mid, K});
      args[1].b = Tensor(static_cast<char*>(dy) + mid * N * 2, DType::bf16, {R - mid, N});
      args[1].c =
          Tensor(static_cast<char*>(dw) + int64_t(half) * K * N * 4, DType::f32, {E - half, K, N});
      for (int i = 0; i < 2; ++i) {
        sp.buffers[i] = std::make_unique<gd::ProblemBuffers>(args[i].window.groups);
        // 128 x 128: the wgrad kernel's tile (grouped_gemm_wgrad.cu), for CUTLASS's tile order
        // rule.
        const RunnerOptions o = gd::runner_options(sms[i], gd::raster_along_n(K, N, 128, 128));
        sp.runners[i] = gd::make_wgrad_runner(sp.buffers[i]->arrays(), args[i].window.groups, o,
                                              writing ? 0.0f : 1.0f);
        sp.dims[i] = gd::check_args(GemmOp::wgrad, args[i], args[i].window.groups);
      }
      cands.push_back(
          {"two production kernels on " + std::to_string(sms[0]) + " + " + std::to_string(sms[1]) +
               " SMs, two streams, hot and cold groups first" + (writing ? ", writing" : ""),
           [this, &sp] {
             CK(cudaEventRecord(fork_, s_));
             CK(cudaStreamWaitEvent(side_, fork_, 0));
             const cudaStream_t st[2] = {s_, side_};
             for (int i = 0; i < 2; ++i) {
               gd::launch_prep(GemmOp::wgrad, sp.args[i], sp.dims[i], sp.buffers[i]->arrays(),
                               sp.args[i].window.groups, st[i]);
               sp.runners[i]->run(st[i]);
             }
             CK(cudaEventRecord(join_, side_));
             CK(cudaStreamWaitEvent(s_, join_, 0));
           }});
    }
  }

  void run_fp8_shape(const Shape& sh, const moe_echo::GroupWindow& win, const GemmArgs& fa,
                     const GemmArgs& da, const GemmArgs& wa, moe_echo::cuda::GroupedGemm& gg,
                     double flop) {
    namespace mc = moe_echo::cuda;
    const int E = sh.experts;
    const int64_t R = sh.rows, K = sh.K, N = sh.N, KT = (K + 127) / 128, NT = (N + 127) / 128;
    const int64_t P = moe_echo::fp8_padded_rows(R, E);
    std::vector<void*> owned;
    auto alloc = [&](size_t bytes) {
      void* p = nullptr;
      CK(cudaMalloc(&p, bytes));
      owned.push_back(p);
      return p;
    };
    const Tensor xq(alloc(size_t(R * K)), DType::e4m3, {R, K}),
        xs(alloc(size_t(R * KT) * 4), DType::f32, {R, KT}),
        dyq(alloc(size_t(R * N)), DType::e4m3, {R, N}),
        dys(alloc(size_t(R * NT) * 4), DType::f32, {R, NT}),
        q(alloc(size_t(E) * size_t(K * N)), DType::e4m3, {E, K, N}),
        q_t(alloc(size_t(E) * size_t(K * N)), DType::e4m3, {E, N, K}),
        s(alloc(size_t(E * KT * NT) * 4), DType::f32, {E, KT, NT}),
        s_t(alloc(size_t(E * KT * NT) * 4), DType::f32, {E, NT, KT}),
        xt(alloc(size_t(K * P)), DType::e4m3, {K, P}),
        xts(alloc(size_t(K * P / 128) * 4), DType::f32, {K * P / 128}),
        dyt(alloc(size_t(N * P)), DType::e4m3, {N, P}),
        dyts(alloc(size_t(N * P / 128) * 4), DType::f32, {N * P / 128}),
        po(alloc(size_t(E + 1) * 4), DType::i32, {E + 1}),
        po2(alloc(size_t(E + 1) * 4), DType::i32, {E + 1});
    mc::quantize_fp8_rows({fa.a, xq, xs}, s_);
    mc::quantize_fp8_rows({da.a, dyq, dys}, s_);
    mc::quantize_fp8_blocks({fa.b, q, q_t, s, s_t}, s_);
    mc::quantize_fp8_cols({win, fa.a, xt, xts, po}, s_);
    mc::quantize_fp8_cols({win, da.a, dyt, dyts, po2}, s_);
    CK(cudaStreamSynchronize(s_));
    mc::GroupedGemmFp8 g8(E);
    Fp8GemmArgs f, d, w;
    f.window = d.window = w.window = win;
    f.a = xq, f.a_scale = xs, f.b = q_t, f.b_scale = s_t, f.c = fa.c;
    d.a = dyq, d.a_scale = dys, d.b = q, d.b_scale = s, d.c = da.c;
    w.a = xt, w.a_scale = xts, w.b = dyt, w.b_scale = dyts, w.padded_offsets = po, w.c = wa.c;
    // beta 0 (dW = x^T dy, not dW +=): what the layer runs when it overwrites its gradients
    Fp8GemmArgs w_write = w;
    w_write.accumulate = false;
    GemmArgs wa_write = wa;
    wa_write.accumulate = false;
    // FP8 variant kernels (MOE_ECHO_GEMM_FP8_VARIANTS) on a GroupedGemmFp8 of their own each.
    std::vector<std::unique_ptr<mc::GroupedGemmFp8>> alt;
    auto with_variants = [&](GemmOp op, std::vector<Candidate> c) {
      for (const Variant& v : variants()) {
        if (!v.fp8 || v.op != op) continue;
        alt.push_back(std::make_unique<mc::GroupedGemmFp8>(E));
        alt.back()->replace_kernel(op, v.make);
        mc::GroupedGemmFp8* g = alt.back().get();
        const Fp8GemmArgs* args = op == GemmOp::fprop ? &f : op == GemmOp::dgrad ? &d : &w;
        c.push_back({std::string(v.name),
                     [=, this] {
                       if (op == GemmOp::fprop) g->fprop(*args, s_);
                       if (op == GemmOp::dgrad) g->dgrad(*args, s_);
                       if (op == GemmOp::wgrad) g->wgrad(*args, s_);
                     },
                     v.bf16_dw});
      }
      return c;
    };
    const std::vector<Candidate> fprop = {
        {"GroupedGemm bf16 (production)", [&] { gg.fprop(fa, s_); }},
        {"FP8 blockwise GEMM", [&] { g8.fprop(f, s_); }},
        {"FP8 blockwise GEMM + quantize x rows", [&] {
           mc::quantize_fp8_rows({fa.a, xq, xs}, s_);
           g8.fprop(f, s_);
         }}};
    const std::vector<Candidate> dgrad = {
        {"GroupedGemm bf16 (production)", [&] { gg.dgrad(da, s_); }},
        {"FP8 blockwise GEMM", [&] { g8.dgrad(d, s_); }},
        {"FP8 blockwise GEMM + quantize dy rows", [&] {
           mc::quantize_fp8_rows({da.a, dyq, dys}, s_);
           g8.dgrad(d, s_);
         }}};
    const std::vector<Candidate> wgrad = {
        {"GroupedGemm bf16 (production)", [&] { gg.wgrad(wa, s_); }},
        {"GroupedGemm bf16, writing", [&] { gg.wgrad(wa_write, s_); }},
        {"FP8 blockwise GEMM", [&] { g8.wgrad(w, s_); }},
        {"FP8 blockwise GEMM, writing", [&] { g8.wgrad(w_write, s_); }},
        {"FP8 blockwise GEMM + quantize x and dy columns", [&] {
           mc::quantize_fp8_cols({win, fa.a, xt, xts, po}, s_);
           mc::quantize_fp8_cols({win, da.a, dyt, dyts, po2}, s_);
           g8.wgrad(w, s_);
         }}};
    run_op(sh, GemmOp::fprop, fa, with_variants(GemmOp::fprop, fprop), flop);
    run_op(sh, GemmOp::dgrad, da, with_variants(GemmOp::dgrad, dgrad), flop);
    run_op(sh, GemmOp::wgrad, wa, with_variants(GemmOp::wgrad, wgrad), flop);
    CK(cudaStreamSynchronize(s_));
    for (void* p : owned) CK(cudaFree(p));
  }

  // Sampled fp64 check of one call (outputs poisoned first; wgrad's accumulator zeroed).
  double check(const Shape& sh, GemmOp op, const GemmArgs& a, const Candidate& c) {
    const int64_t K = sh.K, N = sh.N;
    // A wgrad that adds starts from zeros; one that writes, like fprop and dgrad, from NaN.
    if (op == GemmOp::wgrad && c.label.find("writing") == std::string::npos) {
      CK(cudaMemsetAsync(a.c.data, 0, a.c.bytes(), s_));
    } else {
      CK(cudaMemsetAsync(a.c.data, 0xFF, a.c.bytes(), s_));
    }
    c.call();
    std::mt19937_64 rng(std::hash<std::string>{}(c.label) ^ uint64_t(sh.rows * 31 + K * 7 + N));
    std::vector<int64_t> idx(2 * kSamples);
    for (int s = 0; s < kSamples; ++s) {
      if (op == GemmOp::wgrad) {
        idx[2 * s] = int64_t(rng() % uint64_t(sh.experts));
        idx[2 * s + 1] = int64_t(rng() % uint64_t(K * N));
      } else {
        idx[2 * s] = int64_t(rng() % uint64_t(sh.rows));
        idx[2 * s + 1] = int64_t(rng() % uint64_t(op == GemmOp::fprop ? N : K));
      }
    }
    CK(cudaMemcpyAsync(d_idx_, idx.data(), idx.size() * 8, cudaMemcpyHostToDevice, s_));
    sample_reference<<<kSamples, 256, 0, s_>>>(op, static_cast<const __nv_bfloat16*>(a.a.data),
                                               static_cast<const __nv_bfloat16*>(a.b.data),
                                               a.c.data, c.bf16_dw, a.window.group_offsets,
                                               sh.experts, K, N, d_idx_, d_ref_, d_got_);
    CK(cudaGetLastError());
    std::vector<double> ref(kSamples), got(kSamples);
    CK(cudaMemcpyAsync(ref.data(), d_ref_, kSamples * 8, cudaMemcpyDeviceToHost, s_));
    CK(cudaMemcpyAsync(got.data(), d_got_, kSamples * 8, cudaMemcpyDeviceToHost, s_));
    CK(cudaStreamSynchronize(s_));
    double num = 0, den = 0;
    for (int s = 0; s < kSamples; ++s) {
      const double d = std::isfinite(got[s]) ? got[s] - ref[s] : 1e30;
      num += d * d;
      den += ref[s] * ref[s];
    }
    return std::sqrt(num / std::max(den, 1e-300));
  }

  // Per-call times (ms) of chunks of calls until at least min_ms and min_calls are covered.
  std::vector<double> time_calls(const std::function<void()>& call, double min_ms, int min_calls) {
    constexpr int kChunk = 10;
    std::vector<cudaEvent_t> ev(2 * kChunk);
    for (cudaEvent_t& e : ev) CK(cudaEventCreate(&e));
    std::vector<double> ms;
    double total = 0;
    while (total < min_ms || int(ms.size()) < min_calls) {
      for (int i = 0; i < kChunk; ++i) {
        CK(cudaEventRecord(ev[size_t(2 * i)], s_));
        call();
        CK(cudaEventRecord(ev[size_t(2 * i + 1)], s_));
      }
      CK(cudaStreamSynchronize(s_));
      for (int i = 0; i < kChunk; ++i) {
        float t = 0;
        CK(cudaEventElapsedTime(&t, ev[size_t(2 * i)], ev[size_t(2 * i + 1)]));
        ms.push_back(t);
        total += t;
      }
    }
    for (cudaEvent_t& e : ev) CK(cudaEventDestroy(e));
    return ms;
  }

  void run_op(const Shape& sh, GemmOp op, const GemmArgs& a, const std::vector<Candidate>& cands,
              double flop) {
    std::vector<double> err;
    for (const Candidate& c : cands) err.push_back(check(sh, op, a, c));
    time_calls(cands.front().call, preheat_ms_, 1);
    std::vector<std::vector<double>> round_medians(cands.size());
    std::vector<double> best(cands.size(), 1e300);
    std::vector<int> calls(cands.size(), 0);
    for (int r = 0; r < rounds_; ++r) {
      for (size_t i = 0; i < cands.size(); ++i) {
        for (int w = 0; w < 3; ++w) cands[i].call();
        const std::vector<double> ms = time_calls(cands[i].call, block_ms_, 20);
        round_medians[i].push_back(median(ms));
        best[i] = std::min(best[i], *std::min_element(ms.begin(), ms.end()));
        calls[i] += int(ms.size());
      }
    }
    for (size_t i = 0; i < cands.size(); ++i) {
      Result res;
      res.shape = sh.name;
      res.op = gd::to_string(op);
      res.kernel = cands[i].label;
      res.ms_median = median(round_medians[i]);
      res.ms_min = best[i];
      res.ms_min_round = *std::min_element(round_medians[i].begin(), round_medians[i].end());
      res.ms_max_round = *std::max_element(round_medians[i].begin(), round_medians[i].end());
      res.tflops = flop / (res.ms_median * 1e-3) / 1e12;
      res.rel_err = err[i];
      res.calls = calls[i];
      std::printf("%-13s %-5s %7.4f ms %6.1f TFLOP/s rounds %.1f%% err %.1e %s%s\n",
                  res.shape.c_str(), res.op.c_str(), res.ms_median, res.tflops,
                  100.0 * (res.ms_max_round - res.ms_min_round) / res.ms_median, res.rel_err,
                  res.kernel.c_str(),
                  res.rel_err < wrong_above(op, res.kernel) ? "" : "  <-- WRONG");
      std::fflush(stdout);
      results_.push_back(res);
    }
  }

  // The sampled error against the bf16 inputs in fp64 above which a kernel is wrong: bf16 output
  // rounding for bf16 kernels; e4m3's 3 mantissa bits on both operands for FP8 (a few percent).
  static double wrong_above(GemmOp op, const std::string& kernel) {
    if (kernel.find("FP8") != std::string::npos || kernel.find("fp8") != std::string::npos)
      return 6e-2;
    return op == GemmOp::wgrad ? 1e-3 : 1e-2;
  }

  double preheat_ms_, block_ms_;
  int rounds_;
  bool fp8_ = false;
  cudaStream_t s_ = nullptr;
  cudaStream_t side_ = nullptr;  // add_split_wgrad's second stream and its fork and join
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  struct SplitWgrad {  // add_split_wgrad's two halves at one beta
    GemmArgs args[2];
    gd::GemmDims dims[2];
    std::unique_ptr<gd::ProblemBuffers> buffers[2];
    std::unique_ptr<KernelRunner> runners[2];
  };
  SplitWgrad split_[2];  // adding (beta 1), writing (beta 0)
  int sm_count_ = 0;
  int64_t* d_idx_ = nullptr;
  double* d_ref_ = nullptr;
  double* d_got_ = nullptr;
  std::vector<Result> results_;
};

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}

// printf-style text appended to `s` (the results file, written at once by write_file).
__attribute__((format(printf, 2, 3))) void appendf(std::string& s, const char* fmt, ...) {
  va_list a, b;
  va_start(a, fmt);
  va_copy(b, a);
  const int n = std::vsnprintf(nullptr, 0, fmt, a);
  va_end(a);
  if (n > 0) {
    const size_t at = s.size();
    s.resize(at + size_t(n) + 1);
    std::vsnprintf(s.data() + at, size_t(n) + 1, fmt, b);
    s.resize(at + size_t(n));
  }
  va_end(b);
}

}  // namespace
}  // namespace gg_bench

int main(int argc, char** argv) {
  using namespace gg_bench;
  std::string out = "grouped_gemm_bench.json", commit = "unknown", only;
  double preheat_ms = 300, block_ms = 100;
  int rounds = 3;
  bool fp8 = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error("missing value after " + a);
      return argv[++i];
    };
    if (a == "--out")
      out = next();
    else if (a == "--commit")
      commit = next();
    else if (a == "--preheat-ms")
      preheat_ms = std::stod(next());
    else if (a == "--block-ms")
      block_ms = std::stod(next());
    else if (a == "--rounds")
      rounds = std::stoi(next());
    else if (a == "--shape")
      only = next();
    else if (a == "--fp8")
      fp8 = true;
    else {
      std::fprintf(stderr,
                   "usage: grouped_gemm_bench [--out F.json] [--commit SHA] [--preheat-ms T] "
                   "[--block-ms T] [--rounds N] [--shape NAME[,NAME...]] [--fp8]\n");
      return 2;
    }
  }
  try {
    moe_echo::check_output_path("out", out);  // before any GPU time
    int dev = 0;
    CK(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    // One EP4 rank of the Mixtral layer bench: 2 experts of 8192 rows, fc1 and fc2 (K = F, N = H).
    const Shape ep4 = fc1(moe_echo::kMixtral8x7B, 2);
    // The whole Qwen3-30B-A3B layer's 64 experts on one GPU (the end-to-end model's MoE blocks):
    // 1024 rows per expert instead of 4096.
    const Shape all64 = fc1(moe_echo::kQwen3_30B_A3B, 64);
    std::vector<Shape> shapes = {fc1(moe_echo::kQwen3_30B_A3B, 16),
                                 {all64.name + "-64e", all64.experts, all64.rows, all64.K, all64.N},
                                 fc1(moe_echo::kDeepSeekV3, 32),
                                 fc1(moe_echo::kMixtral8x7B, 8),
                                 {ep4.name + "-ep4-fc1", ep4.experts, ep4.rows, ep4.K, ep4.N},
                                 {ep4.name + "-ep4-fc2", ep4.experts, ep4.rows, ep4.N / 2, ep4.K}};
    // On request (--shape): an EP 2 rank's fc1 at DeepSeek-V3 and Qwen3-30B-A3B, balanced and
    // with Zipf 1.2 group sizes (what skewed routing costs the GEMMs at the same rows).
    for (const auto* p : {&moe_echo::kDeepSeekV3, &moe_echo::kQwen3_30B_A3B})
      for (Shape& sh : ep2_fc1(*p)) shapes.push_back(std::move(sh));
    std::vector<Shape> picked;
    for (const Shape& sh : shapes)
      if (only.empty() ? !sh.on_request
                       : ("," + only + ",").find("," + sh.name + ",") != std::string::npos)
        picked.push_back(sh);
    if (picked.empty()) {
      std::string names;
      for (const Shape& sh : shapes) names += (names.empty() ? "" : ", ") + sh.name;
      throw std::runtime_error("--shape '" + only +
                               "' names no shape (allowed, comma-separated: " + names + ")");
    }
    std::printf(
        "device %s, %d SMs; %zu variant kernels; pre-heat %.0f ms, %d rounds of >= %.0f ms\n",
        prop.name, prop.multiProcessorCount, variants().size(), preheat_ms, rounds, block_ms);
    Bench bench(preheat_ms, block_ms, rounds, fp8);
    for (const Shape& sh : picked) bench.run_shape(sh);

    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    std::string doc;
    appendf(doc, "{\n  \"device\": \"%s\",\n  \"sm_count\": %d,\n  \"date\": \"%s\",\n",
            json_escape(prop.name).c_str(), prop.multiProcessorCount, date);
    appendf(doc, "  \"git_commit\": \"%s\",\n", json_escape(commit).c_str());
    appendf(doc,
            "  \"config\": {\"dtype\": \"bf16 in, fp32 accumulate; fprop/dgrad bf16 out, "
            "wgrad fp32 +=\", \"groups\": \"balanced unless a shape lists its sizes\", \"inputs\": "
            "\"uniform [-1, 1) bf16\", "
            "\"timing\": \"CUDA events per call (prep + GEMM); pre-heat %.0f ms per (shape, op), "
            "then %d rounds interleaving the kernels, each >= %.0f ms and >= 20 calls; "
            "ms_median = median of round medians\", \"flop\": \"2 * rows * K * N\"},\n",
            preheat_ms, rounds, block_ms);
    appendf(doc, "  \"shapes\": [\n");
    for (size_t i = 0; i < picked.size(); ++i) {
      std::string sizes;
      for (int32_t n : picked[i].sizes) sizes += (sizes.empty() ? "" : ", ") + std::to_string(n);
      appendf(doc,
              "    {\"name\": \"%s\", \"experts\": %d, \"rows\": %lld, \"K\": %lld, \"N\": "
              "%lld, \"sizes\": [%s]}%s\n",
              picked[i].name.c_str(), picked[i].experts, (long long)picked[i].rows,
              (long long)picked[i].K, (long long)picked[i].N, sizes.c_str(),
              i + 1 < picked.size() ? "," : "");
    }
    appendf(doc, "  ],\n  \"results\": [\n");
    const auto& rs = bench.results();
    for (size_t i = 0; i < rs.size(); ++i) {
      const Result& r = rs[i];
      appendf(doc,
              "    {\"shape\": \"%s\", \"op\": \"%s\", \"kernel\": \"%s\", \"ms_median\": %.5f, "
              "\"ms_min\": %.5f, \"ms_round_min\": %.5f, \"ms_round_max\": %.5f, \"tflops\": %.2f, "
              "\"sampled_rel_err\": %.3e, \"calls\": %d}%s\n",
              r.shape.c_str(), r.op.c_str(), json_escape(r.kernel).c_str(), r.ms_median, r.ms_min,
              r.ms_min_round, r.ms_max_round, r.tflops, r.rel_err, r.calls,
              i + 1 < rs.size() ? "," : "");
    }
    appendf(doc, "  ]\n}\n");
    moe_echo::write_file(out, doc);  // FileError names the path and the reason
    std::printf("wrote %s\n", out.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "grouped_gemm_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
#endif
