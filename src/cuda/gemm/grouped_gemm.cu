// GroupedGemm: the prep kernel that turns a GroupWindow into CUTLASS problems on the device, the
// per-call checks, and the class that owns one fixed kernel per op (see grouped_gemm.hpp).
//
// Trade-offs said where they are made:
// - No host sync: the host never learns the group sizes. The persistent CUTLASS grid is sized by
//   the SM count and its tile scheduler reads the shapes on the device, skipping empty groups.
// - Every call runs the prep kernel and the GEMM, even for a window with no rows (a few
//   microseconds), so that a captured graph is valid for any routing.
// - Each op has its own problem arrays and kernel workspace, so fprop, dgrad and wgrad of one
//   GroupedGemm may run on different streams at once; two calls of the same op must be
//   stream-ordered.
// - Each op holds its kernel twice, with the two tile orders (M or N fastest; same
//   instantiation, two parameter sets), and each call picks one by CUTLASS's rule on host-known
//   extents (gemm_detail::raster_index).
#include <algorithm>

#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/grouped_gemm_detail.hpp"
#include "moe_echo/cuda_check.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace gemm_detail {

const char* to_string(GemmOp op) {
  switch (op) {
    case GemmOp::fprop: return "fprop";
    case GemmOp::dgrad: return "dgrad";
    case GemmOp::wgrad: return "wgrad";
  }
  return "?";
}

namespace {

constexpr size_t align16(size_t bytes) { return (bytes + 15) / 16 * 16; }

// One block; thread g handles groups g, g + blockDim.x, ...
__global__ void prep_kernel(GemmOp op, const int32_t* __restrict__ offsets, int groups,
                            int max_groups, int64_t row_lo, int64_t rows, const char* a,
                            const char* b, const char* b_home, char* c, char* c_home, int n_home,
                            int64_t K, int64_t N, int64_t c_elem, ProblemArrays p) {
  constexpr int64_t kBf16 = 2;
  for (int g = int(threadIdx.x); g < max_groups; g += int(blockDim.x)) {
    const auto [m, r] = window_group_rows(offsets, g, groups, row_lo, rows);  // r: first row
    int32_t shape[3] = {0, 0, 0};       // (M, N, K) of the CUTLASS problem
    const int gw = g < groups ? g : 0;  // weight slab of an empty trailing group
    // Home split (GemmArgs::b_home / c_home): home groups in their own slabs, the others from 0.
    const char* wb = gw < n_home ? b_home + gw * K * N * kBf16 : b + (gw - n_home) * K * N * kBf16;
    switch (op) {
      case GemmOp::fprop:  // (m x K) . (K x N)
        if (m > 0) shape[0] = int32_t(m), shape[1] = int32_t(N), shape[2] = int32_t(K);
        p.ptr_a[g] = a + r * K * kBf16;
        p.ptr_b[g] = wb;
        p.ptr_c[g] = c + r * N * kBf16;
        p.ld_a[g] = K, p.ld_b[g] = N, p.ld_c[g] = N;
        break;
      case GemmOp::dgrad:  // (m x N) . (N x K), the weight slab read transposed
        if (m > 0) shape[0] = int32_t(m), shape[1] = int32_t(K), shape[2] = int32_t(N);
        p.ptr_a[g] = a + r * N * kBf16;
        p.ptr_b[g] = wb;
        p.ptr_c[g] = c + r * K * kBf16;
        p.ld_a[g] = N, p.ld_b[g] = N, p.ld_c[g] = K;
        break;
      case GemmOp::wgrad:  // (K x m) . (m x N): the rows are the reduction; never K = 0
        if (m > 0) shape[0] = int32_t(K), shape[1] = int32_t(N), shape[2] = int32_t(m);
        p.ptr_a[g] = a + r * K * kBf16;
        p.ptr_b[g] = b + r * N * kBf16;
        p.ptr_c[g] =
            gw < n_home ? c_home + gw * K * N * c_elem : c + (gw - n_home) * K * N * c_elem;
        p.ld_a[g] = K, p.ld_b[g] = N, p.ld_c[g] = N;
        break;
    }
    p.shapes[3 * g + 0] = shape[0];
    p.shapes[3 * g + 1] = shape[1];
    p.shapes[3 * g + 2] = shape[2];
  }
}

}  // namespace

int raster_index(GemmOp op, const GroupWindow& w, int64_t k, int64_t n, const KernelRunner& r) {
  const int64_t groups = w.groups > 0 ? w.groups : 1;
  const int64_t rows = (w.rows + groups - 1) / groups;
  const int64_t m = op == GemmOp::wgrad ? k : rows;
  const int64_t cols = op == GemmOp::dgrad ? k : n;
  return raster_along_n(m, cols, r.tile_m(), r.tile_n()) ? 1 : 0;
}

int device_sm_count() {
  int device = 0, sms = 0;
  MOE_ECHO_CUDA_CHECK(cudaGetDevice(&device));
  MOE_ECHO_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

int bounded_sm_count(int sms) {
  MOE_ECHO_CHECK(sms >= 0, "grouped GEMM: sm_count " << sms << " must be >= 0 (0: all SMs)");
  const int all = device_sm_count();
  return sms == 0 ? all : std::min(sms, all);
}

namespace {

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Groups in the home tensor of `op` (GemmArgs::b_home for fprop/dgrad, c_home for wgrad).
int home_groups(GemmOp op, const GemmArgs& a) {
  return int(gemm_home_groups(op == GemmOp::wgrad ? a.c_home : a.b_home));
}

}  // namespace

ProblemBuffers::ProblemBuffers(int max_groups) {
  MOE_ECHO_CHECK(max_groups >= 1, "max_groups " << max_groups << " must be at least 1");
  const size_t G = size_t(max_groups);
  const size_t ptrs = align16(G * sizeof(void*)), lds = align16(G * sizeof(int64_t)),
               shapes = align16(G * 3 * sizeof(int32_t));
  MOE_ECHO_CUDA_CHECK(cudaMalloc(&base_, 5 * ptrs + 3 * lds + shapes));
  char* at = static_cast<char*>(base_);
  auto take = [&at](size_t bytes) {
    char* here = at;
    at += bytes;
    return here;
  };
  arrays_.ptr_a = reinterpret_cast<const void**>(take(ptrs));
  arrays_.ptr_b = reinterpret_cast<const void**>(take(ptrs));
  arrays_.ptr_c = reinterpret_cast<void**>(take(ptrs));
  arrays_.ptr_sfa = reinterpret_cast<const float**>(take(ptrs));
  arrays_.ptr_sfb = reinterpret_cast<const float**>(take(ptrs));
  arrays_.ld_a = reinterpret_cast<int64_t*>(take(lds));
  arrays_.ld_b = reinterpret_cast<int64_t*>(take(lds));
  arrays_.ld_c = reinterpret_cast<int64_t*>(take(lds));
  arrays_.shapes = reinterpret_cast<int32_t*>(take(shapes));
  // Every group empty until the first call writes its own problems.
  MOE_ECHO_CUDA_CHECK(cudaMemset(base_, 0, 5 * ptrs + 3 * lds + shapes));
}

ProblemBuffers::~ProblemBuffers() {
  if (base_) cudaFree(base_);
}

// The weights of fprop/dgrad: b, or b_home and b (home split), of one dtype and slab shape.
const Tensor& weights_shape(const GemmArgs& a) { return a.b_home.data ? a.b_home : a.b; }
int64_t slabs(const GemmArgs& a) {
  return gemm_home_groups(a.b_home) + (a.b.data ? a.b.size(0) : 0);
}
// dk, dn: the slab's K and N, or -1 for any.
void check_weights(const GemmArgs& a, const char* b_name, const char* home_name, int64_t dk,
                   int64_t dn) {
  if (a.b_home.data) {
    check_tensor(a.b_home, home_name, DType::bf16, {-1, dk, dn});
    if (a.b.data) check_tensor(a.b, b_name, DType::bf16, {-1, a.b_home.size(1), a.b_home.size(2)});
  } else {
    check_tensor(a.b, b_name, DType::bf16, {-1, dk, dn});
  }
}

void check_window(const char* name, const GroupWindow& w, int max_groups) {
  MOE_ECHO_CHECK(
      w.groups >= 0 && w.groups <= max_groups,
      name << ": window.groups " << w.groups << " outside [0, max_groups = " << max_groups << "]");
  MOE_ECHO_CHECK(w.groups == 0 || w.group_offsets != nullptr,
                 name << ": window.group_offsets is null");
  MOE_ECHO_CHECK(w.row_lo >= 0 && w.rows >= 0 && w.rows <= INT32_MAX,
                 name << ": window rows [" << w.row_lo << ", +" << w.rows
                      << ") must be non-negative and below 2^31");
}

GemmDims check_args(GemmOp op, const GemmArgs& a, int max_groups) {
  const char* name = op == GemmOp::fprop   ? "grouped_gemm fprop"
                     : op == GemmOp::dgrad ? "grouped_gemm dgrad"
                                           : "grouped_gemm wgrad";
  const GroupWindow& w = a.window;
  check_window(name, w, max_groups);
  GemmDims d;
  switch (op) {
    case GemmOp::fprop:  // a [rows, K], b [G, K, N], c [rows, N]
      check_tensor(a.a, "grouped_gemm fprop a", DType::bf16, {-1, -1});
      check_weights(a, "grouped_gemm fprop b", "grouped_gemm fprop b_home", a.a.size(1), -1);
      d.k = a.a.size(1), d.n = weights_shape(a).size(2);
      check_tensor(a.c, "grouped_gemm fprop c", DType::bf16, {-1, d.n});
      MOE_ECHO_CHECK(a.a.size(0) >= w.rows && a.c.size(0) >= w.rows && slabs(a) >= w.groups,
                     "grouped_gemm fprop: a " << a.a.describe() << ", c " << a.c.describe()
                                              << " need " << w.rows << " rows and b "
                                              << a.b.describe() << " " << w.groups << " groups");
      break;
    case GemmOp::dgrad:  // a [rows, N], b [G, K, N], c [rows, K]
      check_tensor(a.a, "grouped_gemm dgrad a", DType::bf16, {-1, -1});
      check_weights(a, "grouped_gemm dgrad b", "grouped_gemm dgrad b_home", -1, a.a.size(1));
      d.k = weights_shape(a).size(1), d.n = a.a.size(1);
      check_tensor(a.c, "grouped_gemm dgrad c", DType::bf16, {-1, d.k});
      MOE_ECHO_CHECK(a.a.size(0) >= w.rows && a.c.size(0) >= w.rows && slabs(a) >= w.groups,
                     "grouped_gemm dgrad: a " << a.a.describe() << ", c " << a.c.describe()
                                              << " need " << w.rows << " rows and b "
                                              << a.b.describe() << " " << w.groups << " groups");
      break;
    case GemmOp::wgrad: {  // a [rows, K], b [rows, N], c f32 [G, K, N] (bf16 when writing)
      check_tensor(a.a, "grouped_gemm wgrad a", DType::bf16, {-1, -1});
      check_tensor(a.b, "grouped_gemm wgrad b", DType::bf16, {-1, -1});
      d.k = a.a.size(1), d.n = a.b.size(1);
      const DType cdt = wgrad_c_dtype(a);
      MOE_ECHO_CHECK(cdt == DType::f32 || (cdt == DType::bf16 && !a.accumulate),
                     "grouped_gemm wgrad: c " << (a.c_home.data ? a.c_home : a.c).describe()
                                              << " must be f32, or bf16 when it is written "
                                                 "(accumulate false)");
      if (a.c.data || !a.c_home.data)
        check_tensor(a.c, "grouped_gemm wgrad c", cdt, {-1, d.k, d.n});
      MOE_ECHO_CHECK(a.a.size(0) >= w.rows && a.b.size(0) >= w.rows &&
                         gemm_home_groups(a.c_home) + (a.c.data ? a.c.size(0) : 0) >= w.groups,
                     "grouped_gemm wgrad: a " << a.a.describe() << ", b " << a.b.describe()
                                              << " need " << w.rows << " rows and c "
                                              << a.c.describe() << " " << w.groups << " groups");
      if (a.c_home.data) {
        check_tensor(a.c_home, "grouped_gemm wgrad c_home", cdt, {-1, d.k, d.n});
        MOE_ECHO_CHECK(aligned16(a.c_home.data), "grouped_gemm wgrad: c_home at "
                                                     << a.c_home.data << " is not 16-byte aligned");
      }
      break;
    }
  }
  // TMA moves 16-byte aligned boxes: every row of every operand must start 16-byte aligned.
  MOE_ECHO_CHECK(
      d.k > 0 && d.n > 0 && d.k % 8 == 0 && d.n % 8 == 0 && d.k <= INT32_MAX && d.n <= INT32_MAX,
      name << ": K = " << d.k << " and N = " << d.n
           << " must be positive multiples of 8 (16-byte rows for TMA)");
  // b (wgrad: c) may be null when a home tensor holds every group.
  const bool b_needed = !(op != GemmOp::wgrad && a.b_home.data),
             c_needed = !(op == GemmOp::wgrad && a.c_home.data);
  MOE_ECHO_CHECK(aligned16(a.a.data) && aligned16(a.b.data) && aligned16(a.c.data) &&
                     aligned16(a.b_home.data) && a.a.data && (a.b.data || !b_needed) &&
                     (a.c.data || !c_needed),
                 name << ": a, b, b_home and c must be 16-byte aligned and a, b and c non-null ("
                      << a.a.data << ", " << a.b.data << ", " << a.b_home.data << ", " << a.c.data
                      << ")");
  return d;
}

// wgrad writing (accumulate false): the slab (f32 or bf16, in 16-byte words) of every group with
// rows, none of them in the window, is set to zero (the sum over no rows; the other windows add
// to it later), and so is that of a group g < zero_empty_below with no rows at all. Groups with
// rows in the window (the GEMM writes them) or other groups with no rows at all (left as they are)
// are skipped. Block (x, y) takes part x of the slabs of groups y, y + gridDim.y, ...: a grid of
// one wave whatever the group count, so that the usual call (every group with rows in the window,
// nothing to zero) costs a few loads per block rather than a block per part of every group.
__global__ void zero_empty_groups_kernel(const int32_t* __restrict__ offsets, int groups,
                                         int64_t row_lo, int64_t rows, int zero_empty_below,
                                         uint4* c, uint4* c_home, int n_home, int64_t slab_words) {
  for (int g = int(blockIdx.y); g < groups; g += int(gridDim.y)) {
    const int64_t begin = offsets[g], end = offsets[g + 1];
    const int64_t lo = begin > row_lo ? begin : row_lo;
    const int64_t hi = end < row_lo + rows ? end : row_lo + rows;
    if (hi > lo || (end <= begin && g >= zero_empty_below)) continue;
    uint4* slab =
        g < n_home ? c_home + int64_t(g) * slab_words : c + int64_t(g - n_home) * slab_words;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < slab_words;
         i += int64_t(gridDim.x) * blockDim.x)
      slab[i] = make_uint4(0u, 0u, 0u, 0u);
  }
}

void launch_zero_empty_groups(const GemmArgs& a, const GemmDims& d, cudaStream_t s) {
  if (a.window.groups <= 0) return;
  // K and N are multiples of 8 (checked): whole 16-byte words of f32 or bf16.
  const int64_t words = d.k * d.n * int64_t(dtype_size(wgrad_c_dtype(a))) / 16;
  const unsigned parts = unsigned(std::min<int64_t>((words + 255) / 256, 128));
  const unsigned lanes = unsigned(std::min(a.window.groups, 8));
  zero_empty_groups_kernel<<<dim3(parts, lanes), 256, 0, s>>>(
      a.window.group_offsets, a.window.groups, a.window.row_lo, a.window.rows, a.zero_empty_below,
      static_cast<uint4*>(a.c.data), static_cast<uint4*>(a.c_home.data),
      home_groups(GemmOp::wgrad, a), words);
  MOE_ECHO_CUDA_CHECK(cudaGetLastError());
}

void launch_prep(GemmOp op, const GemmArgs& a, const GemmDims& d, const ProblemArrays& p,
                 int max_groups, cudaStream_t s) {
  const int threads = std::min(256, (max_groups + 31) / 32 * 32);
  prep_kernel<<<1, threads, 0, s>>>(
      op, a.window.group_offsets, a.window.groups, max_groups, a.window.row_lo, a.window.rows,
      static_cast<const char*>(a.a.data), static_cast<const char*>(a.b.data),
      static_cast<const char*>(a.b_home.data), static_cast<char*>(a.c.data),
      static_cast<char*>(a.c_home.data), home_groups(op, a), d.k, d.n,
      op == GemmOp::wgrad ? int64_t(dtype_size(wgrad_c_dtype(a))) : int64_t(2), p);
  MOE_ECHO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gemm_detail

using gemm_detail::GemmOp;

namespace {

// The bf16 kernels of `op` (grouped_gemm_{fprop,dgrad,wgrad}.cu); `other`: fprop adding (beta 1),
// wgrad writing (beta 0), none for dgrad.
std::unique_ptr<gemm_detail::KernelRunner> make_kernel(GemmOp op,
                                                       const gemm_detail::ProblemArrays& p,
                                                       int max_groups,
                                                       const gemm_detail::RunnerOptions& o,
                                                       bool other) {
  switch (op) {
    case GemmOp::fprop:
      return other ? gemm_detail::make_fprop_runner(p, max_groups, o, 1.0f)
                   : gemm_detail::make_fprop_runner(p, max_groups, o);
    case GemmOp::dgrad: return other ? nullptr : gemm_detail::make_dgrad_runner(p, max_groups, o);
    case GemmOp::wgrad:
      return other ? gemm_detail::make_wgrad_runner(p, max_groups, o, 0.0f)
                   : gemm_detail::make_wgrad_runner(p, max_groups, o);
  }
  return nullptr;
}

}  // namespace

namespace gemm_detail {

int GemmKernels::checked_max_groups(const char* owner, int groups) {
  MOE_ECHO_CHECK(groups >= 1, owner << ": max_groups " << groups << " must be >= 1");
  return groups;
}

}  // namespace gemm_detail

struct GroupedGemm::Impl : gemm_detail::GemmKernels {
  Impl(int groups, int sms) : GemmKernels("GroupedGemm", groups, sms, make_kernel) {
    for (int along_n = 0; along_n < 2; ++along_n)
      wgrad_bf16[along_n] = gemm_detail::make_wgrad_bf16_runner(
          wgrad.buffers.arrays(), max_groups, gemm_detail::runner_options(sm_count, along_n));
  }

  // `other`: the op's other beta (fprop adds, wgrad writes).
  void call(gemm_detail::OpKernels& op, const GemmArgs& a, cudaStream_t s, bool other = false) {
    const gemm_detail::GemmDims d = gemm_detail::check_args(op.op, a, max_groups);
    gemm_detail::launch_prep(op.op, a, d, op.buffers.arrays(), max_groups, s);
    if (op.op == GemmOp::wgrad &&
        gemm_detail::wgrad_c_dtype(a) == DType::bf16)  // writing (checked)
      wgrad_bf16[op.along_n(a.window, d.k, d.n)]->run(s);
    else
      op.pick(a.window, d.k, d.n, other).run(s);
    if (op.op == GemmOp::wgrad && other) gemm_detail::launch_zero_empty_groups(a, d, s);
  }

  std::unique_ptr<gemm_detail::KernelRunner> wgrad_bf16[2];  // as wgrad's runner[2], bf16 D
};

GroupedGemm::GroupedGemm(int max_groups, int sm_count)
    : impl_(std::make_unique<Impl>(max_groups, sm_count)) {}

GroupedGemm::~GroupedGemm() = default;

int GroupedGemm::max_groups() const { return impl_->max_groups; }

void GroupedGemm::fprop(const GemmArgs& a, cudaStream_t s) { impl_->call(impl_->fprop, a, s); }
void GroupedGemm::dgrad(const GemmArgs& a, cudaStream_t s) { impl_->call(impl_->dgrad, a, s); }
void GroupedGemm::wgrad(const GemmArgs& a, cudaStream_t s) {
  impl_->call(impl_->wgrad, a, s, !a.accumulate);
}
void GroupedGemm::fprop_add(const GemmArgs& a, cudaStream_t s) {
  impl_->call(impl_->fprop, a, s, true);
}

}  // namespace moe_echo::cuda
