// GroupedGemm (CUTLASS ptr-array kernels, device-side group sizes) against the CPU reference.
//
// Every check draws fresh random bf16 inputs (never zeros), poisons the outputs before the call,
// and compares with cpu::gemm_{fprop,dgrad,wgrad}<float> on the same values (bf16 -> float is
// exact) by relative norm: bf16 outputs below 1e-2, the fp32 wgrad increment below 1e-3. Rows
// outside every group must keep their poison bit for bit, and an empty group's fp32 wgrad slab
// its previous bits; wgrad writing bf16 gives the fp32 kernel's values rounded once, bit for bit.
// Shapes: empty groups, one group holding every row, windows that cut groups
// (row_lo > 0), 255/256/257 rows, 0 and 1 row, K and N multiples of 8 but not of 16, fewer
// groups than max_groups after a call with more, both tile orders, and a CUDA graph replayed with
// group sizes changed on the device between replays. Skipped where no GPU is visible.
#include "cuda/gemm/grouped_gemm.hpp"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/cpu_ops.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "test_util.hpp"

namespace moe_echo {
namespace {

bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device visible"

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#define CK(expr) ck((expr), #expr)

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

constexpr uint16_t kPoison = 0xFFFF;  // a bf16 NaN: any unwritten row stays exactly this

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) { CK(cudaMalloc(&p_, bytes ? bytes : 16)); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }
  template <class T>
  void upload(const std::vector<T>& v) {
    CK(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <class T>
  std::vector<T> download(size_t n) const {
    std::vector<T> v(n);
    CK(cudaMemcpy(v.data(), p_, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

// Random bf16 values: bits for the device, the same values as floats for the reference.
struct Bf16 {
  std::vector<uint16_t> bits;
  std::vector<float> values;
};
Bf16 random_bf16(size_t n, uint64_t seed) {
  Bf16 r;
  const std::vector<float> f = test::random_floats(n, seed);
  r.bits.resize(n);
  r.values.resize(n);
  for (size_t i = 0; i < n; ++i) {
    r.bits[i] = to_bf16(f[i]);
    r.values[i] = from_bf16(r.bits[i]);
  }
  return r;
}

struct Case {
  std::string name;
  std::vector<int32_t> offsets;  // [groups + 1], global receive rows
  int64_t row_lo = 0, rows = 0;  // the window
  int64_t K = 0, N = 0;
};

GroupWindow window_of(const Case& c, const int32_t* offsets) {
  GroupWindow w;
  w.group_offsets = offsets;
  w.groups = int(c.offsets.size()) - 1;
  w.row_lo = c.row_lo;
  w.rows = c.rows;
  return w;
}

// Window rows that belong to some group.
std::vector<bool> covered_rows(const Case& c) {
  const GroupWindow w = window_of(c, c.offsets.data());
  std::vector<bool> in(size_t(c.rows), false);
  for (int g = 0; g < w.groups; ++g) {
    const cpu::RowRange rr = cpu::group_rows(w, g);
    for (int64_t i = rr.begin; i < rr.end; ++i) in[size_t(i)] = true;
  }
  return in;
}

// Device tensors of one case, allocated once and refilled with fresh data by refill().
struct CaseData {
  explicit CaseData(const Case& c)
      : G(int(c.offsets.size()) - 1),
        x(size_t(c.rows * c.K) * 2),
        w(size_t(std::max(G, 1) * c.K * c.N) * 2),
        y(size_t(c.rows * c.N) * 2),
        dy(size_t(c.rows * c.N) * 2),
        dx(size_t(c.rows * c.K) * 2),
        dw(size_t(std::max(G, 1) * c.K * c.N) * 4),
        offsets(c.offsets.size() * 4) {}

  void refill(const Case& c, uint64_t seed) {
    hx = random_bf16(size_t(c.rows * c.K), seed + 1);
    hw = random_bf16(size_t(std::max(G, 1) * c.K * c.N), seed + 2);
    hdy = random_bf16(size_t(c.rows * c.N), seed + 3);
    hdw0 = test::random_floats(size_t(std::max(G, 1) * c.K * c.N), seed + 4);
    x.upload(hx.bits);
    w.upload(hw.bits);
    dy.upload(hdy.bits);
    offsets.upload(c.offsets);
  }
  // Outputs poisoned, wgrad's accumulator reset to its random start.
  void poison() {
    CK(cudaMemset(y.get(), 0xFF, y_bytes()));
    CK(cudaMemset(dx.get(), 0xFF, dx_bytes()));
    dw.upload(hdw0);
  }
  size_t y_bytes() const { return hdy.bits.size() * 2; }
  size_t dx_bytes() const { return hx.bits.size() * 2; }

  GemmArgs fprop_args(const Case& c) const {
    GemmArgs a;
    a.window = window_of(c, static_cast<const int32_t*>(offsets.get()));
    a.a = Tensor(x.get(), DType::bf16, {c.rows, c.K});
    a.b = Tensor(w.get(), DType::bf16, {std::max(G, 1), c.K, c.N});
    a.c = Tensor(y.get(), DType::bf16, {c.rows, c.N});
    return a;
  }
  GemmArgs dgrad_args(const Case& c) const {
    GemmArgs a;
    a.window = window_of(c, static_cast<const int32_t*>(offsets.get()));
    a.a = Tensor(dy.get(), DType::bf16, {c.rows, c.N});
    a.b = Tensor(w.get(), DType::bf16, {std::max(G, 1), c.K, c.N});
    a.c = Tensor(dx.get(), DType::bf16, {c.rows, c.K});
    return a;
  }
  GemmArgs wgrad_args(const Case& c) const {
    GemmArgs a;
    a.window = window_of(c, static_cast<const int32_t*>(offsets.get()));
    a.a = Tensor(x.get(), DType::bf16, {c.rows, c.K});
    a.b = Tensor(dy.get(), DType::bf16, {c.rows, c.N});
    a.c = Tensor(dw.get(), DType::f32, {std::max(G, 1), c.K, c.N});
    return a;
  }

  int G;
  DeviceBuffer x, w, y, dy, dx, dw, offsets;
  Bf16 hx, hw, hdy;
  std::vector<float> hdw0;
};

// Host views of the same values for the CPU reference (float; the reference sums in double).
GemmArgs host_args(const GemmArgs& dev, const Case& c, void* a, void* b, void* out) {
  GemmArgs h = dev;
  h.window.group_offsets = c.offsets.data();
  h.a = Tensor(a, DType::f32, {dev.a.size(0), dev.a.size(1)});
  h.b = dev.b.ndim == 3 ? Tensor(b, DType::f32, {dev.b.size(0), dev.b.size(1), dev.b.size(2)})
                        : Tensor(b, DType::f32, {dev.b.size(0), dev.b.size(1)});
  h.c = dev.c.ndim == 3 ? Tensor(out, DType::f32, {dev.c.size(0), dev.c.size(1), dev.c.size(2)})
                        : Tensor(out, DType::f32, {dev.c.size(0), dev.c.size(1)});
  return h;
}

// A bf16 [rows, width] output: group rows match the reference, other rows keep the poison.
void expect_rows(const char* op, const Case& c, const std::vector<uint16_t>& got,
                 const std::vector<float>& ref, int64_t width) {
  const std::vector<bool> in = covered_rows(c);
  std::vector<float> g, r;
  int64_t bad_poison = 0, non_finite = 0;
  for (int64_t i = 0; i < c.rows; ++i) {
    for (int64_t j = 0; j < width; ++j) {
      const size_t at = size_t(i * width + j);
      if (in[size_t(i)]) {
        const float v = from_bf16(got[at]);
        if (!std::isfinite(v)) ++non_finite;
        g.push_back(v);
        r.push_back(ref[at]);
      } else if (got[at] != kPoison) {
        ++bad_poison;
      }
    }
  }
  EXPECT_EQ(non_finite, 0) << op << ": unwritten or non-finite values inside groups";
  EXPECT_EQ(bad_poison, 0) << op << ": rows outside every group were written";
  if (!g.empty()) {
    const double err = test::rel_error(g, r);
    EXPECT_LT(err, 1e-2) << op << ": relative error " << err << " over " << g.size() << " values";
  }
}

// Runs (or has run) the three ops of one case and checks them all.
void check_outputs(const Case& c, const CaseData& d) {
  const int G = d.G;
  const int Gs = std::max(G, 1);
  std::vector<float> hx = d.hx.values, hw = d.hw.values, hdy = d.hdy.values;

  {  // fprop
    std::vector<float> ref(size_t(c.rows * c.N), 0.f);
    const GemmArgs h = host_args(d.fprop_args(c), c, hx.data(), hw.data(), ref.data());
    cpu::gemm_fprop<float>(h);
    expect_rows("fprop", c, d.y.download<uint16_t>(size_t(c.rows * c.N)), ref, c.N);
  }
  {  // dgrad
    std::vector<float> ref(size_t(c.rows * c.K), 0.f);
    const GemmArgs h = host_args(d.dgrad_args(c), c, hdy.data(), hw.data(), ref.data());
    cpu::gemm_dgrad<float>(h);
    expect_rows("dgrad", c, d.dx.download<uint16_t>(size_t(c.rows * c.K)), ref, c.K);
  }
  {  // wgrad: compare the increments; empty groups keep their exact bits
    std::vector<float> ref = d.hdw0;
    const GemmArgs h = host_args(d.wgrad_args(c), c, hx.data(), hdy.data(), ref.data());
    cpu::gemm_wgrad<float>(h);
    const std::vector<float> got = d.dw.download<float>(size_t(Gs) * size_t(c.K * c.N));
    const GroupWindow w = window_of(c, c.offsets.data());
    std::vector<double> inc_got, inc_ref;
    int64_t touched_empty = 0;
    const size_t slab = size_t(c.K * c.N);
    for (int g = 0; g < Gs; ++g) {
      const cpu::RowRange rr = g < G ? cpu::group_rows(w, g) : cpu::RowRange{0, 0};
      for (size_t j = size_t(g) * slab; j < size_t(g + 1) * slab; ++j) {
        if (rr.end > rr.begin) {
          inc_got.push_back(double(got[j]) - double(d.hdw0[j]));
          inc_ref.push_back(double(ref[j]) - double(d.hdw0[j]));
        } else if (float_bits(got[j]) != float_bits(d.hdw0[j])) {
          ++touched_empty;
        }
      }
    }
    EXPECT_EQ(touched_empty, 0) << "wgrad: an empty group's gradient changed";
    if (!inc_got.empty()) {
      const double err = test::rel_error(inc_got, inc_ref);
      EXPECT_LT(err, 1e-3) << "wgrad: relative error of the increment " << err;
    }
  }
}

void run_case(cuda::GroupedGemm& gg, const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.name);
  CaseData d(c);
  d.refill(c, seed);
  d.poison();
  gg.fprop(d.fprop_args(c), nullptr);
  gg.dgrad(d.dgrad_args(c), nullptr);
  gg.wgrad(d.wgrad_args(c), nullptr);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  check_outputs(c, d);
}

std::vector<Case> cases() {
  return {
      // Eight groups of uneven sizes first, so that later cases with fewer groups run on
      // problem arrays that once held eight.
      {"eight_groups_uneven", {0, 300, 301, 301, 700, 1100, 1357, 1800, 2000}, 0, 2048, 512, 384},
      {"empty_groups_and_tail", {0, 37, 37, 300, 301, 420}, 0, 512, 136, 264},
      {"one_group_holds_all", {0, 0, 0, 700, 700, 700}, 0, 700, 128, 256},
      {"window_cuts_groups", {0, 50, 180, 180, 390, 520, 600}, 100, 300, 72, 200},
      {"rows_255_256_257", {0, 255, 511, 768}, 0, 800, 256, 136},
      {"second_round_window", {0, 300, 900, 1000}, 512, 512, 64, 40},
      {"zero_and_one_row", {0, 0, 1, 1}, 0, 8, 8, 24},
      {"window_past_every_row", {0, 10, 20}, 64, 128, 96, 104},
      {"no_groups", {0}, 0, 16, 16, 16},
      // More tiles along N than along M: the kernels that walk tiles M-first (the cases above
      // take the N-first ones).
      {"wide_n", {0, 40, 100}, 0, 128, 64, 1024},
  };
}

TEST(GroupedGemmGpu, MatchesCpuReference) {
  SKIP_WITHOUT_GPU();
  cuda::GroupedGemm gg(8);
  EXPECT_EQ(gg.max_groups(), 8);
  uint64_t seed = 1000;
  for (const Case& c : cases()) run_case(gg, c, seed += 10);
}

// The start of a wgrad that writes: NaN everywhere (a kernel that read it would leave NaN) but in
// the groups it keeps (no rows at all, at or past `below`), which hold hdw0 (rounded to bf16 with
// `bf16`).
std::vector<float> writing_start(const Case& c, const CaseData& d, int below, bool bf16) {
  const size_t slab = size_t(c.K * c.N);
  std::vector<float> start(size_t(std::max(d.G, 1)) * slab,
                           std::numeric_limits<float>::quiet_NaN());
  for (int g = below; g < d.G; ++g)
    if (c.offsets[size_t(g + 1)] == c.offsets[size_t(g)])
      for (size_t j = size_t(g) * slab; j < size_t(g + 1) * slab; ++j)
        start[j] = bf16 ? from_bf16(to_bf16(d.hdw0[j])) : d.hdw0[j];
  return start;
}

// A wgrad that writes (accumulate false, zero_empty_below `below`) into d.dw, which holds `start`.
GemmArgs writing_args(const Case& c, CaseData& d, const std::vector<float>& start, int below) {
  d.dw.upload(start);
  GemmArgs args = d.wgrad_args(c);
  args.accumulate = false;
  args.zero_empty_below = below;
  return args;
}

// wgrad with accumulate = false: the product where the group has rows in the window, zero where
// its rows are all outside (the old values are NaN, so a kernel that read them would leave NaN); a
// group with no rows at all keeps its bits, or is zero when below zero_empty_below.
TEST(GroupedGemmGpu, WgradOverwriteNeverReadsTheOldGradient) {
  SKIP_WITHOUT_GPU();
  cuda::GroupedGemm gg(8);
  uint64_t seed = 5000;
  for (const Case& c : cases())
    for (const int below : {0, 4}) {
      SCOPED_TRACE(c.name + " zero_empty_below " + std::to_string(below));
      CaseData d(c);
      d.refill(c, seed += 10);
      const int Gs = std::max(d.G, 1);
      const size_t slab = size_t(c.K * c.N);
      const GroupWindow w = window_of(c, c.offsets.data());
      const std::vector<float> start = writing_start(c, d, below, false);
      const GemmArgs args = writing_args(c, d, start, below);
      gg.wgrad(args, nullptr);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());

      std::vector<float> hx = d.hx.values, hdy = d.hdy.values, ref = start;
      const GemmArgs h = host_args(args, c, hx.data(), hdy.data(), ref.data());
      cpu::gemm_wgrad<float>(h);
      const std::vector<float> got = d.dw.download<float>(size_t(Gs) * slab);
      std::vector<double> g_rows, r_rows;
      int64_t wrong_outside = 0, non_finite = 0;
      for (int g = 0; g < d.G; ++g) {  // (with no groups the slab is no group's and stays NaN)
        const cpu::RowRange rr = cpu::group_rows(w, g);
        const bool has_rows = c.offsets[size_t(g + 1)] > c.offsets[size_t(g)];
        for (size_t j = size_t(g) * slab; j < size_t(g + 1) * slab; ++j) {
          if (rr.end > rr.begin) {
            non_finite += !std::isfinite(got[j]);
            g_rows.push_back(got[j]);
            r_rows.push_back(ref[j]);
          } else if (float_bits(got[j]) != (has_rows || g < below ? 0u : float_bits(d.hdw0[j]))) {
            ++wrong_outside;
          }
        }
      }
      EXPECT_EQ(non_finite, 0) << "wgrad overwrite: non-finite values (the old gradient was read)";
      EXPECT_EQ(wrong_outside, 0)
          << "wgrad overwrite: a group without rows in the window is not zero (rows elsewhere) or "
             "not kept (no rows)";
      if (!g_rows.empty()) {
        const double err = test::rel_error(g_rows, r_rows);
        EXPECT_LT(err, 1e-3) << "wgrad overwrite: relative error " << err;
      }
    }
}

// wgrad writing bf16 (accumulate false, c and c_home bf16): every value is the fp32 writing
// kernel's rounded once to bf16 (round to nearest even, as a cast of the fp32 gradient gives),
// bit for bit, with the same zeroed and kept groups, with and without a home split; the old
// values are NaN where the kernel writes or zeroes, so a read of them would show.
TEST(GroupedGemmGpu, WgradWritingBf16IsTheFp32SumRoundedOnce) {
  SKIP_WITHOUT_GPU();
  cuda::GroupedGemm gg(8);
  uint64_t seed = 6000;
  for (const Case& c : cases())
    for (const int below : {0, 4})
      for (const bool split : {false, true}) {
        CaseData d(c);
        if (split && d.G < 2) continue;
        SCOPED_TRACE(c.name + " zero_empty_below " + std::to_string(below) +
                     (split ? " home split" : ""));
        d.refill(c, seed += 10);
        const int Gs = std::max(d.G, 1);
        const size_t slab = size_t(c.K * c.N), total = size_t(Gs) * slab;
        const std::vector<float> start = writing_start(c, d, below, true);
        GemmArgs args = writing_args(c, d, start, below);
        gg.wgrad(args, nullptr);
        CK(cudaDeviceSynchronize());
        const std::vector<float> want = d.dw.download<float>(total);

        std::vector<uint16_t> start16(total);
        for (size_t j = 0; j < total; ++j) start16[j] = to_bf16(start[j]);
        DeviceBuffer dw16(total * 2);
        dw16.upload(start16);
        const int home = split ? d.G / 2 : 0;
        if (split) {
          args.c_home = Tensor(dw16.get(), DType::bf16, {home, c.K, c.N});
          args.c = Tensor(static_cast<uint16_t*>(dw16.get()) + home * slab, DType::bf16,
                          {Gs - home, c.K, c.N});
        } else {
          args.c = Tensor(dw16.get(), DType::bf16, {Gs, c.K, c.N});
        }
        gg.wgrad(args, nullptr);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        const std::vector<uint16_t> got = dw16.download<uint16_t>(total);
        int64_t differ = 0;
        for (size_t j = 0; j < total; ++j) differ += got[j] != to_bf16(want[j]);
        EXPECT_EQ(differ, 0) << "bf16 values that are not the fp32 kernel's rounded once";
      }
  // Adding into bf16 is refused, naming c.
  CaseData d(cases()[0]);
  GemmArgs args = d.wgrad_args(cases()[0]);
  args.c = Tensor(d.dw.get(), DType::bf16, {d.G, cases()[0].K, cases()[0].N});
  args.accumulate = true;
  try {
    gg.wgrad(args, nullptr);
    ADD_FAILURE() << "a bf16 wgrad that adds was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bf16 when it is written"), std::string::npos) << e.what();
  }
}

// wgrad with c_home: groups g < c_home.size(0) go to c_home (accumulating or writing, empty ones
// zeroed below zero_empty_below there), the others to c[g - home]; the bits equal a run without
// c_home, and the memory before c (where the home slabs were) is never touched.
TEST(GroupedGemmGpu, WgradHomeGroupsGoToTheirOwnTensor) {
  SKIP_WITHOUT_GPU();
  cuda::GroupedGemm gg(8);
  uint64_t seed = 7000;
  for (const Case& c : cases())
    for (const bool accumulate : {true, false}) {
      CaseData d(c);
      if (d.G < 2) continue;
      SCOPED_TRACE(c.name + (accumulate ? " accumulate" : " write"));
      d.refill(c, seed += 10);
      const int home = d.G / 2;
      const size_t slab = size_t(c.K * c.N), total = size_t(d.G) * slab;
      GemmArgs args = d.wgrad_args(c);
      args.accumulate = accumulate;
      args.zero_empty_below = accumulate ? 0 : home;
      d.dw.upload(d.hdw0);
      gg.wgrad(args, nullptr);
      CK(cudaDeviceSynchronize());
      const std::vector<float> want = d.dw.download<float>(total);

      DeviceBuffer home_dw(size_t(home) * slab * 4);
      home_dw.upload(std::vector<float>(d.hdw0.begin(), d.hdw0.begin() + home * slab));
      std::vector<float> poisoned = d.hdw0;
      std::fill(poisoned.begin(), poisoned.begin() + home * slab, -7.25f);
      d.dw.upload(poisoned);
      args.c_home = Tensor(home_dw.get(), DType::f32, {home, c.K, c.N});
      args.c =
          Tensor(static_cast<float*>(d.dw.get()) + home * slab, DType::f32, {d.G - home, c.K, c.N});
      gg.wgrad(args, nullptr);
      CK(cudaDeviceSynchronize());
      const std::vector<float> got_home = home_dw.download<float>(size_t(home) * slab);
      const std::vector<float> got_rest = d.dw.download<float>(total);
      int64_t differ = 0, touched = 0;
      for (size_t j = 0; j < total; ++j) {
        const float got = j < home * slab ? got_home[j] : got_rest[j];
        differ += float_bits(got) != float_bits(want[j]);
        if (j < home * slab) touched += float_bits(got_rest[j]) != float_bits(-7.25f);
      }
      EXPECT_EQ(differ, 0) << "values differing from the run without c_home";
      EXPECT_EQ(touched, 0) << "c's slabs of home groups were written";
    }
}

// fprop and dgrad with b_home: groups g < b_home.size(0) read their weights there, the others
// from b[g - home]; the bits equal a run with every slab in b (the slabs before b poisoned).
TEST(GroupedGemmGpu, HomeGroupsReadTheirOwnWeights) {
  SKIP_WITHOUT_GPU();
  cuda::GroupedGemm gg(8);
  uint64_t seed = 7500;
  for (const Case& c : cases()) {
    CaseData d(c);
    if (d.G < 2) continue;
    SCOPED_TRACE(c.name);
    d.refill(c, seed += 10);
    const int home = d.G / 2;
    const size_t slab = size_t(c.K * c.N);
    d.poison();
    gg.fprop(d.fprop_args(c), nullptr);
    gg.dgrad(d.dgrad_args(c), nullptr);
    CK(cudaDeviceSynchronize());
    const auto want_y = d.y.download<uint16_t>(d.y_bytes() / 2);
    const auto want_dx = d.dx.download<uint16_t>(d.dx_bytes() / 2);

    DeviceBuffer home_w(size_t(home) * slab * 2);
    home_w.upload(std::vector<uint16_t>(d.hw.bits.begin(), d.hw.bits.begin() + home * slab));
    std::vector<uint16_t> poisoned = d.hw.bits;
    std::fill(poisoned.begin(), poisoned.begin() + home * slab, uint16_t(0x7FC0));  // NaN
    d.w.upload(poisoned);
    d.poison();
    for (bool fprop : {true, false}) {
      GemmArgs args = fprop ? d.fprop_args(c) : d.dgrad_args(c);
      args.b_home = Tensor(home_w.get(), DType::bf16, {home, c.K, c.N});
      args.b = Tensor(static_cast<uint16_t*>(d.w.get()) + home * slab, DType::bf16,
                      {d.G - home, c.K, c.N});
      if (fprop)
        gg.fprop(args, nullptr);
      else
        gg.dgrad(args, nullptr);
    }
    CK(cudaDeviceSynchronize());
    EXPECT_EQ(d.y.download<uint16_t>(d.y_bytes() / 2), want_y) << "fprop";
    EXPECT_EQ(d.dx.download<uint16_t>(d.dx_bytes() / 2), want_dx) << "dgrad";
  }
}

// fprop_add: rows in a group become c + a @ b[g] (rounded once), the other rows keep their bits.
TEST(GroupedGemmGpu, FpropAddAddsToTheOutputRows) {
  SKIP_WITHOUT_GPU();
  cuda::GroupedGemm gg(8);
  uint64_t seed = 7000;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    CaseData d(c);
    d.refill(c, seed += 10);
    const Bf16 y0 = random_bf16(size_t(c.rows * c.N), seed + 5);
    d.y.upload(y0.bits);
    gg.fprop_add(d.fprop_args(c), nullptr);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<float> hx = d.hx.values, hw = d.hw.values, ref(size_t(c.rows * c.N), 0.f);
    cpu::gemm_fprop<float>(host_args(d.fprop_args(c), c, hx.data(), hw.data(), ref.data()));
    const std::vector<uint16_t> got = d.y.download<uint16_t>(size_t(c.rows * c.N));
    const std::vector<bool> in = covered_rows(c);
    std::vector<double> g, r;
    int64_t changed_outside = 0;
    for (int64_t i = 0; i < c.rows; ++i)
      for (int64_t j = 0; j < c.N; ++j) {
        const size_t at = size_t(i * c.N + j);
        if (in[size_t(i)]) {
          g.push_back(from_bf16(got[at]));
          r.push_back(double(y0.values[at]) + double(ref[at]));
        } else if (got[at] != y0.bits[at]) {
          ++changed_outside;
        }
      }
    EXPECT_EQ(changed_outside, 0) << "fprop_add wrote rows outside every group";
    if (!g.empty()) {
      const double err = test::rel_error(g, r);
      EXPECT_LT(err, 1e-2) << "fprop_add: relative error " << err;
    }
  }
}

TEST(GroupedGemmGpu, ExactlyMaxGroups) {
  SKIP_WITHOUT_GPU();
  const Case c{"three_of_three", {0, 129, 129, 257}, 0, 300, 48, 56};
  cuda::GroupedGemm gg(3);
  run_case(gg, c, 77);
}

TEST(GroupedGemmGpu, RejectsMisalignedShapesAndPointers) {
  SKIP_WITHOUT_GPU();
  cuda::GroupedGemm gg(2);
  const Case ok{"aligned", {0, 8, 16}, 0, 16, 64, 64};
  CaseData d(ok);
  d.refill(ok, 5);
  GemmArgs a = d.fprop_args(ok);
  a.a = Tensor(d.x.get(), DType::bf16, {16, 60});  // K = 60: rows of 120 bytes
  a.b = Tensor(d.w.get(), DType::bf16, {2, 60, 64});
  EXPECT_THROW(gg.fprop(a, nullptr), Error);
  a = d.fprop_args(ok);
  a.c = Tensor(static_cast<char*>(d.y.get()) + 2, DType::bf16, {16, 64});  // 2-byte offset
  EXPECT_THROW(gg.fprop(a, nullptr), Error);
  a = d.fprop_args(ok);
  a.window.groups = 3;  // more groups than the GroupedGemm was built for
  EXPECT_THROW(gg.fprop(a, nullptr), Error);
  GemmArgs wg = d.wgrad_args(ok);
  wg.c.dtype = DType::bf16;  // wgrad accumulates in fp32 only
  EXPECT_THROW(gg.wgrad(wg, nullptr), Error);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Capture the three ops once; replay with other group sizes written to the device between
// replays (and outputs re-poisoned), checking every replay.
TEST(GroupedGemmGpu, GraphReplaysFollowDeviceGroupSizes) {
  SKIP_WITHOUT_GPU();
  Case c{"graph", {0, 100, 200, 300, 400}, 64, 512, 128, 192};
  const std::vector<std::vector<int32_t>> replays = {
      {0, 100, 200, 300, 400},  // as captured
      {0, 0, 500, 500, 560},    // empty groups; the window cuts the big one
      {0, 257, 257, 258, 576},  // 257 and 1 rows
      {64, 64, 64, 64, 64},     // nothing at all
      {0, 64, 128, 320, 700},   // the last group runs past the window
  };
  cuda::GroupedGemm gg(4);
  CaseData d(c);
  d.refill(c, 4242);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  gg.fprop(d.fprop_args(c), s);
  gg.dgrad(d.dgrad_args(c), s);
  gg.wgrad(d.wgrad_args(c), s);
  CK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  for (size_t r = 0; r < replays.size(); ++r) {
    SCOPED_TRACE("replay " + std::to_string(r));
    c.offsets = replays[r];
    d.offsets.upload(c.offsets);
    d.poison();
    // The uploads and memsets ran on the legacy default stream, which a non-blocking stream does
    // not wait for (and a pageable upload may return before its copy lands): finish them first.
    CK(cudaDeviceSynchronize());
    CK(cudaGraphLaunch(exec, s));
    CK(cudaStreamSynchronize(s));
    check_outputs(c, d);
  }
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(s));
}

}  // namespace
}  // namespace moe_echo
