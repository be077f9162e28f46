// FP8 blockwise quantization on the GPU against the CPU reference backend on the same values:
// fresh random bf16 inputs over several magnitudes (a tile of zeros, a tiny-valued row, partial
// tiles at the edges), outputs poisoned first; the e4m3 codes and the fp32 scales must be the
// same bits (both compute amax / 448 and 1 / scale as IEEE fp32 divisions, x * (1 / scale) as an
// IEEE fp32 product, and round to nearest even). Skipped where no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"

namespace moe_echo::test {
namespace {

std::vector<double> inputs(size_t n, uint64_t seed, double scale) {
  std::vector<double> v = random_values(n, seed, -scale, scale);
  for (size_t i = 0; i < n; ++i)  // magnitudes over several binades within each tile
    v[i] *= std::ldexp(1.0, int(i * 7 % 9) - 4);
  return round_bf16(v);
}

TEST(Fp8QuantGpu, RowTilesMatchCpuBitForBit) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend(DType::f32);
  auto gpu = cuda::make_cuda_backend();
  for (const auto& [rows, K] : std::vector<std::pair<int64_t, int64_t>>{
           {64, 2048}, {37, 768}, {5, 200}, {1, 8}, {0, 128}, {3, 300}, {2, 77}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(K));
    const int64_t KT = (K + 127) / 128;
    std::vector<double> x = inputs(size_t(rows * K), uint64_t(rows + K), 3.0);
    if (rows > 1)
      for (int64_t k = 0; k < std::min<int64_t>(K, 128); ++k) x[size_t(K + k)] = 0;  // zero tile
    if (rows > 3)
      for (int64_t k = 0; k < K; ++k)
        x[size_t(3 * K + k)] = round_bf16(x[size_t(3 * K + k)] * 1e-6);
    if (rows > 4)  // a row of normal values whose amax / 448 is not: its scale is FLT_MIN
      for (int64_t k = 0; k < K; ++k)
        x[size_t(4 * K + k)] = round_bf16(
            std::copysign(std::fabs(x[size_t(4 * K + k)]) + 0.5, x[size_t(4 * K + k)]) * 1e-36);
    OwnedTensor xc(*cpu, DType::f32, {rows, K}), qc(*cpu, DType::e4m3, {rows, K}),
        sc(*cpu, DType::f32, {rows, KT});
    OwnedTensor xg(*gpu, DType::bf16, {rows, K}), qg(*gpu, DType::e4m3, {rows, K}),
        sg(*gpu, DType::f32, {rows, KT});
    xc.write(x);
    xg.write(x);
    poison(qg);
    poison(sg);
    cpu->quantize_fp8_rows({*xc, *qc, *sc}, nullptr);
    gpu->quantize_fp8_rows({*xg, *qg, *sg}, nullptr);
    EXPECT_EQ(sg.read(), sc.read()) << "scales";
    EXPECT_EQ(qg.read(), qc.read()) << "e4m3 values";
  }
}

TEST(Fp8QuantGpu, WeightBlocksMatchCpuBitForBitInBothLayouts) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend(DType::f32);
  auto gpu = cuda::make_cuda_backend();
  for (const auto& [G, K, N] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {4, 256, 384}, {3, 200, 136}, {2, 130, 100}, {1, 8, 8}, {2, 2048, 1536}}) {
    SCOPED_TRACE(std::to_string(G) + " x " + std::to_string(K) + " x " + std::to_string(N));
    const int64_t KT = (K + 127) / 128, NT = (N + 127) / 128;
    std::vector<double> w = inputs(size_t(G * K * N), uint64_t(G * K + N), 0.05);
    for (int64_t n = 0; n < std::min<int64_t>(N, 128); ++n)  // group 0's first block: zeros
      for (int64_t k = 0; k < std::min<int64_t>(K, 128); ++k) w[size_t(k * N + n)] = 0;
    OwnedTensor wc(*cpu, DType::f32, {G, K, N}), qc(*cpu, DType::e4m3, {G, K, N}),
        qtc(*cpu, DType::e4m3, {G, N, K}), sc(*cpu, DType::f32, {G, KT, NT});
    OwnedTensor wg(*gpu, DType::bf16, {G, K, N}), qg(*gpu, DType::e4m3, {G, K, N}),
        qtg(*gpu, DType::e4m3, {G, N, K}), sg(*gpu, DType::f32, {G, KT, NT});
    wc.write(w);
    wg.write(w);
    poison(qg);
    poison(qtg);
    poison(sg);
    cpu->quantize_fp8_blocks({*wc, *qc, *qtc, *sc, Tensor()}, nullptr);
    gpu->quantize_fp8_blocks({*wg, *qg, *qtg, *sg, Tensor()}, nullptr);
    EXPECT_EQ(sg.read(), sc.read()) << "scales";
    EXPECT_EQ(qg.read(), qc.read()) << "q [G, K, N]";
    EXPECT_EQ(qtg.read(), qtc.read()) << "q_t [G, N, K]";
    // Only the transposed layout asked for: q stays untouched.
    poison(qg);
    poison(qtg);
    gpu->quantize_fp8_blocks({*wg, Tensor(), *qtg, *sg, Tensor()}, nullptr);
    EXPECT_EQ(qtg.read(), qtc.read()) << "q_t alone";
    for (double v : qg.read()) ASSERT_TRUE(std::isnan(v)) << "q written though not asked for";
  }
}

// The raw bytes of a tensor.
std::vector<uint8_t> raw_bytes(Backend& be, const OwnedTensor& t) {
  std::vector<uint8_t> out(t->bytes());
  be.copy_to_host(out.data(), t->data, out.size());
  return out;
}

// SwiGLU writing a's FP8 rows in its own pass (F % 128 == 0) or after it (other F): the bits of
// SwiGLU followed by the rows of the window's valid rows, rows past them keep their poison; a
// against the CPU's within bf16 rounding.
TEST(Fp8QuantGpu, SwigluWithFp8RowsEqualsSwigluThenRows) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend(DType::f32);
  auto gpu = cuda::make_cuda_backend();
  for (const int64_t F : {int64_t(768), int64_t(256), int64_t(200)}) {
    SCOPED_TRACE("F " + std::to_string(F));
    const int64_t R = 300, FT = (F + 127) / 128;
    const std::vector<int32_t> offsets{40, 40, 41, 171, 171, 301};  // 261 valid rows of [40, 340)
    OwnedTensor off(*gpu, DType::i32, {6});
    off.write(std::vector<double>(offsets.begin(), offsets.end()));
    GroupWindow w;
    w.group_offsets = off->as<int32_t>();
    w.groups = 5;
    w.row_lo = 40;
    w.rows = R;
    OwnedTensor h(*gpu, DType::bf16, {R, 2 * F}), a1(*gpu, DType::bf16, {R, F}),
        a2(*gpu, DType::bf16, {R, F}), q1(*gpu, DType::e4m3, {R, F}), q2(*gpu, DType::e4m3, {R, F}),
        s1(*gpu, DType::f32, {R, FT}), s2(*gpu, DType::f32, {R, FT});
    h.write(inputs(size_t(R * 2 * F), uint64_t(F), 4.0));
    for (const OwnedTensor* t : {&a1, &a2, &q1, &q2, &s1, &s2}) poison(*t);
    gpu->swiglu_forward({w, *h, *a1, Tensor(), Tensor(), *q1, *s1}, nullptr);
    gpu->swiglu_forward({w, *h, *a2, Tensor(), Tensor()}, nullptr);
    gpu->quantize_fp8_rows({*a2, *q2, *s2, {}, w}, nullptr);
    gpu->synchronize();
    EXPECT_EQ(raw_bytes(*gpu, a1), raw_bytes(*gpu, a2)) << "a";
    EXPECT_EQ(raw_bytes(*gpu, q1), raw_bytes(*gpu, q2)) << "e4m3 rows";
    EXPECT_EQ(raw_bytes(*gpu, s1), raw_bytes(*gpu, s2)) << "row scales";
    const std::vector<uint8_t> qb = raw_bytes(*gpu, q1);
    EXPECT_EQ(std::count(qb.begin() + 261 * F, qb.end(), uint8_t(0x7F)), (R - 261) * F)
        << "rows past the valid ones were written";
    EXPECT_LT(std::count(qb.begin(), qb.begin() + 261 * F, uint8_t(0x7F)), 261 * F / 100)
        << "the valid rows were not written";
  }
}

}  // namespace
}  // namespace moe_echo::test
