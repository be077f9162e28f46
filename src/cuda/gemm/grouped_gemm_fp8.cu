// GroupedGemmFp8 (grouped_gemm_fp8.hpp): per-call checks, the prep kernel that writes every
// group's FP8 problem on the device, and one fixed kernel pair (two tile orders) per op. The
// trade-offs are GroupedGemm's (grouped_gemm.cu): no host sync, a prep kernel and a GEMM launch
// per call even for an empty window, the tile order chosen from host-known extents.
#include <algorithm>

#include "cuda/gemm/grouped_gemm_detail.hpp"
#include "cuda/gemm/grouped_gemm_fp8.hpp"
#include "moe_echo/cuda_check.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

using gemm_detail::KernelRunner;
using gemm_detail::ProblemArrays;

using gemm_detail::GemmOp;
const char* op_name(GemmOp op) {
  return op == GemmOp::fprop   ? "grouped_gemm fp8 fprop"
         : op == GemmOp::dgrad ? "grouped_gemm fp8 dgrad"
                               : "grouped_gemm fp8 wgrad";
}

constexpr int64_t kTile = kFp8Tile;

// The weights' K and N (GemmArgs' [G, K, N]), and wgrad's padded columns P.
struct Dims {
  int64_t k = 0, n = 0, p = 0;
};

// One block; thread g handles groups g, g + blockDim.x, ... (see grouped_gemm_detail.hpp for the
// invariants of the arrays: every entry written, empty groups (0, 0, 0) with valid pointers).
__global__ void fp8_prep_kernel(GemmOp op, const int32_t* __restrict__ offsets,
                                const int32_t* __restrict__ padded, int groups, int max_groups,
                                int64_t row_lo, int64_t rows, const uint8_t* a, const float* sa,
                                const uint8_t* b, const float* sb, const uint8_t* b_home,
                                const float* sb_home, char* c, char* c_home, int n_home, int64_t K,
                                int64_t N, int64_t P, ProblemArrays p) {
  const int64_t KT = (K + kTile - 1) / kTile, NT = (N + kTile - 1) / kTile;
  for (int g = int(threadIdx.x); g < max_groups; g += int(blockDim.x)) {
    const auto [m, r] = gemm_detail::window_group_rows(offsets, g, groups, row_lo, rows);
    const int gw = g < groups ? g : 0;
    const bool home = gw < n_home;
    const int64_t slab = home ? gw : gw - n_home;
    int32_t shape[3] = {0, 0, 0};
    switch (op) {
      case GemmOp::fprop:  // (m x K) . (K x N); the slab as [N][K] rows
        if (m > 0) shape[0] = int32_t(m), shape[1] = int32_t(N), shape[2] = int32_t(K);
        p.ptr_a[g] = a + r * K;
        p.ptr_sfa[g] = sa + r * KT;
        p.ptr_b[g] = (home ? b_home : b) + slab * N * K;
        p.ptr_sfb[g] = (home ? sb_home : sb) + slab * NT * KT;
        p.ptr_c[g] = c + r * N * 2;
        p.ld_a[g] = K, p.ld_b[g] = K, p.ld_c[g] = N;
        break;
      case GemmOp::dgrad:  // (m x N) . (N x K); the slab as [K][N] rows
        if (m > 0) shape[0] = int32_t(m), shape[1] = int32_t(K), shape[2] = int32_t(N);
        p.ptr_a[g] = a + r * N;
        p.ptr_sfa[g] = sa + r * NT;
        p.ptr_b[g] = (home ? b_home : b) + slab * K * N;
        p.ptr_sfb[g] = (home ? sb_home : sb) + slab * KT * NT;
        p.ptr_c[g] = c + r * K * 2;
        p.ld_a[g] = N, p.ld_b[g] = N, p.ld_c[g] = K;
        break;
      case GemmOp::wgrad: {  // (K x P_g) . (P_g x N) over the group's padded columns
        const int64_t pg = g < groups ? padded[g] : 0, mp = (m + kTile - 1) / kTile * kTile;
        if (m > 0) shape[0] = int32_t(K), shape[1] = int32_t(N), shape[2] = int32_t(mp);
        p.ptr_a[g] = a + pg;
        p.ptr_sfa[g] = sa + K * (pg / kTile);
        p.ptr_b[g] = b + pg;
        p.ptr_sfb[g] = sb + N * (pg / kTile);
        p.ptr_c[g] = (home ? c_home : c) + slab * K * N * 4;
        p.ld_a[g] = P, p.ld_b[g] = P, p.ld_c[g] = N;
        break;
      }
    }
    p.shapes[3 * g + 0] = shape[0];
    p.shapes[3 * g + 1] = shape[1];
    p.shapes[3 * g + 2] = shape[2];
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// fprop/dgrad weights: b and b_home (either may be absent when the other holds every group),
// [G, rows, cols] e4m3 with scales [G, fp8_tiles(rows), fp8_tiles(cols)].
void check_weights(const Fp8GemmArgs& a, const char* name, int64_t rows, int64_t cols) {
  MOE_ECHO_CHECK(a.b.data || a.b_home.data, name << ": b and b_home are both empty");
  if (a.b.data) {
    check_tensor(a.b, (std::string(name) + " b").c_str(), DType::e4m3, {-1, rows, cols});
    check_tensor(a.b_scale, (std::string(name) + " b_scale").c_str(), DType::f32,
                 {a.b.size(0), fp8_tiles(rows), fp8_tiles(cols)});
  }
  if (a.b_home.data) {
    check_tensor(a.b_home, (std::string(name) + " b_home").c_str(), DType::e4m3, {-1, rows, cols});
    check_tensor(a.b_home_scale, (std::string(name) + " b_home_scale").c_str(), DType::f32,
                 {a.b_home.size(0), fp8_tiles(rows), fp8_tiles(cols)});
  }
}

Dims check_args(GemmOp op, const Fp8GemmArgs& a, int max_groups) {
  const char* name = op_name(op);
  const std::string n = name;
  const GroupWindow& w = a.window;
  gemm_detail::check_window(name, w, max_groups);
  const int64_t slabs = gemm_home_groups(a.b_home) + (a.b.data ? a.b.size(0) : 0);
  Dims d;
  switch (op) {
    case GemmOp::fprop:  // a [rows, K], b = q_t [G, N, K], c [rows, N]
      check_tensor(a.a, (n + " a").c_str(), DType::e4m3, {-1, -1});
      d.k = a.a.size(1);
      d.n = (a.b_home.data ? a.b_home : a.b).size(1);
      check_weights(a, name, d.n, d.k);
      check_tensor(a.a_scale, (n + " a_scale").c_str(), DType::f32, {a.a.size(0), fp8_tiles(d.k)});
      check_tensor(a.c, (n + " c").c_str(), DType::bf16, {-1, d.n});
      break;
    case GemmOp::dgrad:  // a [rows, N], b = q [G, K, N], c [rows, K]
      check_tensor(a.a, (n + " a").c_str(), DType::e4m3, {-1, -1});
      d.n = a.a.size(1);
      d.k = (a.b_home.data ? a.b_home : a.b).size(1);
      check_weights(a, name, d.k, d.n);
      check_tensor(a.a_scale, (n + " a_scale").c_str(), DType::f32, {a.a.size(0), fp8_tiles(d.n)});
      check_tensor(a.c, (n + " c").c_str(), DType::bf16, {-1, d.k});
      break;
    case GemmOp::wgrad: {  // a = x^T [K, P], b = dy^T [N, P], c f32 [G, K, N]
      check_tensor(a.a, (n + " a").c_str(), DType::e4m3, {-1, -1});
      d.k = a.a.size(0), d.p = a.a.size(1);
      check_tensor(a.b, (n + " b").c_str(), DType::e4m3, {-1, d.p});
      d.n = a.b.size(0);
      MOE_ECHO_CHECK(d.p % kTile == 0 && d.p >= fp8_padded_rows(w.rows, w.groups),
                     name << ": a " << a.a.describe()
                          << " needs a multiple of 128 columns, at least "
                          << fp8_padded_rows(w.rows, w.groups) << " for " << w.rows << " rows in "
                          << w.groups << " groups");
      check_tensor(a.a_scale, (n + " a_scale").c_str(), DType::f32, {d.k * d.p / kTile});
      check_tensor(a.b_scale, (n + " b_scale").c_str(), DType::f32, {d.n * d.p / kTile});
      check_tensor(a.padded_offsets, (n + " padded_offsets").c_str(), DType::i32,
                   {int64_t(w.groups) + 1});
      if (a.c.data || !a.c_home.data)
        check_tensor(a.c, (n + " c").c_str(), DType::f32, {-1, d.k, d.n});
      if (a.c_home.data)
        check_tensor(a.c_home, (n + " c_home").c_str(), DType::f32, {-1, d.k, d.n});
      MOE_ECHO_CHECK(gemm_home_groups(a.c_home) + (a.c.data ? a.c.size(0) : 0) >= w.groups,
                     name << ": c " << a.c.describe() << " and c_home " << a.c_home.describe()
                          << " hold fewer than " << w.groups << " groups");
      MOE_ECHO_CHECK(aligned16(a.c.data) && aligned16(a.c_home.data) && aligned16(a.a.data) &&
                         aligned16(a.b.data),
                     name << ": a, b, c and c_home must be 16-byte aligned");
      break;
    }
  }
  if (op != GemmOp::wgrad) {
    MOE_ECHO_CHECK(a.a.size(0) >= w.rows && a.c.size(0) >= w.rows && slabs >= w.groups,
                   name << ": a " << a.a.describe() << ", c " << a.c.describe() << " need "
                        << w.rows << " rows and the weights " << w.groups << " groups (have "
                        << slabs << ")");
    MOE_ECHO_CHECK(aligned16(a.a.data) && aligned16(a.b.data) && aligned16(a.b_home.data) &&
                       aligned16(a.c.data),
                   name << ": a, b, b_home and c must be 16-byte aligned");
  }
  MOE_ECHO_CHECK(
      d.k > 0 && d.n > 0 && d.k % 16 == 0 && d.n % 16 == 0 && d.k <= INT32_MAX && d.n <= INT32_MAX,
      name << ": K = " << d.k << " and N = " << d.n
           << " must be positive multiples of 16 (16-byte e4m3 rows for TMA)");
  return d;
}

// The FP8 kernels of `op` (grouped_gemm_fp8_{fprop,wgrad}.cu: fprop and dgrad share one); `other`:
// wgrad writing (beta 0), none for fprop and dgrad.
std::unique_ptr<KernelRunner> make_kernel(GemmOp op, const ProblemArrays& p, int max_groups,
                                          const gemm_detail::RunnerOptions& o, bool other) {
  if (op == GemmOp::wgrad)
    return other ? gemm_detail::make_fp8_wgrad_runner(p, max_groups, o, 0.0f)
                 : gemm_detail::make_fp8_wgrad_runner(p, max_groups, o);
  return other ? nullptr : gemm_detail::make_fp8_runner(p, max_groups, o);
}

}  // namespace

struct GroupedGemmFp8::Impl : gemm_detail::GemmKernels {
  Impl(int groups, int sms) : GemmKernels("GroupedGemmFp8", groups, sms, make_kernel) {}

  void call(gemm_detail::OpKernels& op, const Fp8GemmArgs& a, cudaStream_t s) {
    const Dims d = check_args(op.op, a, max_groups);
    const int n_home =
        int(op.op == GemmOp::wgrad ? gemm_home_groups(a.c_home) : gemm_home_groups(a.b_home));
    const int threads = std::min(256, (max_groups + 31) / 32 * 32);
    fp8_prep_kernel<<<1, threads, 0, s>>>(
        op.op, a.window.group_offsets, a.padded_offsets.as<int32_t>(), a.window.groups, max_groups,
        a.window.row_lo, a.window.rows, a.a.as<uint8_t>(), a.a_scale.as<float>(), a.b.as<uint8_t>(),
        a.b_scale.as<float>(), a.b_home.as<uint8_t>(), a.b_home_scale.as<float>(),
        static_cast<char*>(a.c.data), static_cast<char*>(a.c_home.data), n_home, d.k, d.n, d.p,
        op.buffers.arrays());
    MOE_ECHO_CUDA_CHECK(cudaGetLastError());
    const bool overwrite = op.op == GemmOp::wgrad && !a.accumulate;
    op.pick(a.window, d.k, d.n, overwrite).run(s);
    if (overwrite) {  // slabs of groups with no rows in the window: as the bf16 wgrad
      GemmArgs z;
      z.window = a.window;
      z.c = a.c;
      z.c_home = a.c_home;
      z.zero_empty_below = a.zero_empty_below;
      gemm_detail::launch_zero_empty_groups(z, gemm_detail::GemmDims{d.k, d.n}, s);
    }
  }
};

GroupedGemmFp8::GroupedGemmFp8(int max_groups, int sm_count)
    : impl_(std::make_unique<Impl>(max_groups, sm_count)) {}

GroupedGemmFp8::~GroupedGemmFp8() = default;

int GroupedGemmFp8::max_groups() const { return impl_->max_groups; }
void GroupedGemmFp8::fprop(const Fp8GemmArgs& a, cudaStream_t s) {
  impl_->call(impl_->fprop, a, s);
}
void GroupedGemmFp8::dgrad(const Fp8GemmArgs& a, cudaStream_t s) {
  impl_->call(impl_->dgrad, a, s);
}
void GroupedGemmFp8::wgrad(const Fp8GemmArgs& a, cudaStream_t s) {
  impl_->call(impl_->wgrad, a, s);
}
void GroupedGemmFp8::replace_kernel(GemmOp op, RunnerFactory make) {
  gemm_detail::OpKernels& o = impl_->of(op);
  for (int along_n = 0; along_n < 2; ++along_n)
    o.runner[along_n] = make(o.buffers.arrays(), impl_->max_groups,
                             gemm_detail::runner_options(impl_->sm_count, along_n));
}

}  // namespace moe_echo::cuda
