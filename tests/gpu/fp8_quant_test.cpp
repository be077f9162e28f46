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
           {4, 256, 384}, {3, 200, 136}, {1, 8, 8}, {2, 2048, 1536}}) {
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

}  // namespace
}  // namespace moe_echo::test
