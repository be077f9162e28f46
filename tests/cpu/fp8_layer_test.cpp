// The layer with precision fp8 on the CPU backend (the FP8 references of backend.hpp: e4m3
// operands decoded exactly, block sums in double) on in-process ranks:
// - against the same layer in bf16 precision on the f64 backend (no rounding but e4m3's): y, dx
//   and the expert gradients within kFp8LayerTol by relative norm, and not bit-identical (the
//   quantization happened);
// - ECHO on against off under skew, with spill rounds: y and dx bit for bit (rows are quantized
//   per row, and a clone's weights quantize as its home expert's); the expert gradients both
//   within kFp8LayerTol of the unquantized layer's (a spill round's boundary cuts an expert's rows
//   at another row with ECHO on than off, and the transposed quantization of wgrad starts its
//   tiles there, so the two differ by about e4m3's error; without spill rounds they are equal up
//   to the order of sums: fp8_echo_test.cpp);
// - every recompute option against none, bit for bit;
// - what the layer allocates against MoeLayer::memory_bytes, with the fp8 part counted;
// - hidden or ffn not a multiple of 16 refused by name.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "layer_harness.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "test_util.hpp"

namespace moe_echo::test {
namespace {

// e4m3 keeps 3 mantissa bits: each GEMM's operands carry about 2-4% of relative error, and the
// layer chains two GEMMs forward and two backward.
constexpr double kFp8LayerTol = 8e-2;

MoeConfig fp8_moe(int experts, int top_k, int tokens) {
  MoeConfig m;
  m.hidden = 32;
  m.ffn = 48;
  m.experts = experts;
  m.top_k = top_k;
  m.max_tokens = tokens;
  m.aux_loss_coeff = 0.01;
  m.precision = Precision::fp8;
  return m;
}

std::vector<std::vector<double>> per_rank(int ranks, int64_t n, uint64_t seed) {
  std::vector<std::vector<double>> v;
  for (int r = 0; r < ranks; ++r) v.push_back(random_values(size_t(n), seed + uint64_t(r)));
  return v;
}

std::vector<double> concat(const std::vector<std::vector<double>>& parts) {
  std::vector<double> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  return all;
}

TEST(Fp8Layer, CloseToTheUnquantizedLayer) {
  for (int R : {1, 2}) {
    LayerCase fp8;
    fp8.moe = fp8_moe(8, 2, 40);
    fp8.ranks = R;
    fp8.echo.enabled = true;
    fp8.echo.spare_slots_per_rank = 1;
    fp8.moe.capacity_factor = 0.7;  // spill rounds
    LayerCase exact = fp8;
    exact.moe.precision = Precision::bf16;
    const SkewedInput in = skewed(fp8, 40, 1.2, 21);
    const auto g = per_rank(R, 40 * 32, 400);
    const LayerRun a = run_layer(fp8, in.x, g, in.params);
    const LayerRun b = run_layer(exact, in.x, g, in.params);
    SCOPED_TRACE("R = " + std::to_string(R));
    const double ey = rel_error(concat(a.y), concat(b.y)),
                 edx = rel_error(concat(a.dx), concat(b.dx));
    const double e1 = rel_error(a.dw1, b.dw1), e2 = rel_error(a.dw2, b.dw2);
    EXPECT_LE(ey, kFp8LayerTol) << "y";
    EXPECT_LE(edx, kFp8LayerTol) << "dx";
    EXPECT_LE(e1, kFp8LayerTol) << "dw1";
    EXPECT_LE(e2, kFp8LayerTol) << "dw2";
    EXPECT_GT(ey, 1e-4) << "y equals the unquantized layer's: was anything quantized?";
    std::printf("[ fp8 layer ] R %d: rel. error vs unquantized y %.3e dx %.3e dw1 %.3e dw2 %.3e\n",
                R, ey, edx, e1, e2);
    EXPECT_GT(a.stats[0].spill_rounds + (R > 1 ? a.stats[1].spill_rounds : 0), 0);
    RecordProperty("rel_error_y_dx_dw1_dw2", std::to_string(ey) + " " + std::to_string(edx) + " " +
                                                 std::to_string(e1) + " " + std::to_string(e2));
  }
}

// 16 experts of top-2 over `ranks` ranks, 48 tokens each, ECHO on with 2 spare slots and a
// capacity that spills under skew.
LayerCase echo_case(int ranks) {
  LayerCase c;
  c.moe = fp8_moe(16, 2, 48);
  c.ranks = ranks;
  c.echo.enabled = true;
  c.echo.spare_slots_per_rank = 2;
  c.echo.max_clones_per_expert = 2;
  c.moe.capacity_factor = 0.8;
  return c;
}

TEST(Fp8Layer, EchoOnEqualsOffAndRecomputeEqualsNone) {
  LayerCase on = echo_case(4);
  LayerCase off = on;
  off.echo.enabled = false;
  const SkewedInput in = skewed(on, 48, 1.5, 31);
  const auto g = per_rank(4, 48 * 32, 500);
  const LayerRun a = run_layer(on, in.x, g, in.params);
  const LayerRun b = run_layer(off, in.x, g, in.params);
  EXPECT_GT(a.stats[0].clones, 0) << "skewed routing should make ECHO clone";
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(a.y[size_t(r)], b.y[size_t(r)]) << "y, rank " << r;
    EXPECT_EQ(a.dx[size_t(r)], b.dx[size_t(r)]) << "dx, rank " << r;
  }
  // The weight gradients differ by about e4m3's own error (the spill rounds cut the experts' rows
  // at other rows, and wgrad's tiles start there): both within kFp8LayerTol of the unquantized
  // layer's.
  LayerCase exact = off;
  exact.moe.precision = Precision::bf16;
  const LayerRun e = run_layer(exact, in.x, g, in.params);
  for (const LayerRun* run : {&a, &b}) {
    EXPECT_LE(rel_error(run->dw1, e.dw1), kFp8LayerTol) << "dw1";
    EXPECT_LE(rel_error(run->dw2, e.dw2), kFp8LayerTol) << "dw2";
  }
  for (Recompute rc :
       {Recompute::moe_act, Recompute::experts, Recompute::dispatch, Recompute::all_but_fc1}) {
    LayerCase c = on;
    c.moe.recompute = rc;
    const LayerRun r = run_layer(c, in.x, g, in.params);
    EXPECT_EQ(concat(r.y), concat(a.y)) << to_string(rc);
    EXPECT_EQ(concat(r.dx), concat(a.dx)) << to_string(rc);
    EXPECT_EQ(r.dw1, a.dw1) << to_string(rc);
    EXPECT_EQ(r.dw2, a.dw2) << to_string(rc);
  }
}

// Overlap::wgrad and the split-phase calls in fp8 (the dh columns quantized in the experts phase
// feed the weight gradient in the combine phase): forward()/backward()'s bits, clones and spill
// rounds included; and fc1's FP8 forward with its weight gradient unquantized refuses the overlap.
TEST(Fp8Layer, OverlapWgradAndSplitPhasesGiveTheSameBits) {
  const LayerCase base = echo_case(4);
  const SkewedInput in = skewed(base, 48, 1.5, 37);
  const auto g = per_rank(4, 48 * 32, 700);
  const LayerRun a = run_layer(base, in.x, g, in.params);
  int spill = 0;
  for (const StepStats& st : a.stats) spill += st.spill_rounds;
  EXPECT_GT(spill, 0) << "no spill round ran";
  EXPECT_GT(a.stats[0].clones, 0) << "no clone made";
  for (bool split : {false, true}) {
    for (bool overlap : {false, true}) {
      if (!split && !overlap) continue;
      SCOPED_TRACE(std::string(split ? "split" : "whole") + (overlap ? ", overlap wgrad" : ""));
      LayerCase c = base;
      c.split_phases = split;
      if (overlap) c.moe.overlap = Overlap::wgrad;
      const LayerRun r = run_layer(c, in.x, g, in.params);
      EXPECT_EQ(concat(r.y), concat(a.y));
      EXPECT_EQ(concat(r.dx), concat(a.dx));
      EXPECT_EQ(r.dw1, a.dw1);
      EXPECT_EQ(r.dw2, a.dw2);
      EXPECT_EQ(concat(r.d_router), concat(a.d_router));
    }
  }
  LayerCase refused = base;
  refused.moe.overlap = Overlap::wgrad;
  refused.moe.fp8_gemms = fp8_gemm::fprop1;
  EXPECT_THROW(run_layer(refused, in.x, g, in.params), ConfigError);
}

// The e4m3 weight copies follow the weights: optimizer_step quantizes the updated weights (A's
// second forward), and weights written through param() are quantized by the next forward (B).
TEST(Fp8Layer, WeightCopiesFollowTheOptimizerAndWrittenWeights) {
  auto be = make_cpu_backend(DType::f64);
  InProcessWorld world(1);
  const MoeConfig m = fp8_moe(8, 2, 24);
  const EchoConfig e;
  MoeLayer a(*be, world.communicator(0), m, ParallelConfig{1, 0}, e, 3);
  MoeLayer b(*be, world.communicator(0), m, ParallelConfig{1, 0}, e, 4);
  auto tensor = [&](uint64_t seed) {
    Tensor t(be->allocate(size_t(24 * 32 * 8)), DType::f64, {24, 32});
    write_tensor(*be, t, random_values(24 * 32, seed));
    return t;
  };
  const Tensor x1 = tensor(1), x2 = tensor(2), dy = tensor(3), ya = tensor(4), yb = tensor(5),
               dx = tensor(6);
  a.zero_grad();
  a.forward(x1, ya);
  a.backward(dy, dx);
  AdamWConfig adam;
  adam.lr = 1e-2;
  a.optimizer_step(adam);
  a.forward(x2, ya);
  a.backward(dy, dx);
  for (Param p : {Param::router_weight, Param::router_bias, Param::w1, Param::w2})
    write_tensor(*be, b.param(p), read_tensor(*be, a.param(p)));
  b.forward(x2, yb);
  EXPECT_EQ(read_tensor(*be, yb), read_tensor(*be, ya));
  b.backward(dy, dx);
  for (const Tensor* t : {&x1, &x2, &dy, &ya, &yb, &dx}) be->deallocate(t->data);
}

TEST(Fp8Layer, MemoryEstimateCountsTheFp8Copies) {
  auto be = make_cpu_backend(DType::f32);
  InProcessWorld world(1);
  const MoeConfig m = fp8_moe(8, 2, 24);
  EchoConfig e;
  e.spare_slots_per_rank = 1;
  MoeLayer layer(*be, world.communicator(0), m, ParallelConfig{1, 0}, e, 1);
  EXPECT_EQ(layer.workspace_bytes(),
            MoeLayer::memory_bytes(m, ParallelConfig{1, 0}, e, DType::f32, DType::f32));
  const MoeMemory parts =
      MoeLayer::memory_breakdown(m, ParallelConfig{1, 0}, e, DType::f32, DType::f32);
  MoeConfig bf = m;
  bf.precision = Precision::bf16;
  const MoeMemory none =
      MoeLayer::memory_breakdown(bf, ParallelConfig{1, 0}, e, DType::f32, DType::f32);
  EXPECT_EQ(none.fp8, 0u);
  EXPECT_GT(parts.fp8, 0u);
  // The received rows are kept as e4m3 values and their scales instead of activations.
  const int64_t cap = capacity_rows(m), H = m.hidden, HT = (H + kFp8Tile - 1) / kFp8Tile;
  const size_t saved = size_t(cap * H) * sizeof(float) - size_t(cap * (H + 4 * HT));
  EXPECT_EQ(parts.activations + saved, none.activations);
  EXPECT_EQ(parts.total() + saved, none.total() + parts.fp8);
}

// MoeConfig::fp8_gemms: each set of GEMMs in FP8 and the rest unquantized. The forward GEMMs
// decide y: without fprop1 and fprop2 in the set y is the unquantized layer's bit for bit (the
// tokens then cross unquantized too), with both it is the all-FP8 layer's; every set stays within
// kFp8LayerTol of the unquantized layer, ECHO on equals off and recompute dispatch equals none.
TEST(Fp8Layer, EachSetOfFp8GemmsIsCloseAndForwardBitsFollowTheForwardGemms) {
  const LayerCase all = echo_case(2);
  LayerCase exact = all;
  exact.moe.precision = Precision::bf16;
  const SkewedInput in = skewed(all, 48, 1.5, 41);
  const auto g = per_rank(2, 48 * 32, 600);
  const LayerRun a = run_layer(all, in.x, g, in.params);
  const LayerRun e = run_layer(exact, in.x, g, in.params);
  for (const char* set : {"fprop1", "fprop", "dgrad", "wgrad", "fprop1,wgrad2", "dgrad2,wgrad1"}) {
    SCOPED_TRACE(set);
    LayerCase c = all;
    c.moe.fp8_gemms = parse_fp8_gemms(set);
    const LayerRun r = run_layer(c, in.x, g, in.params);
    const bool fprop = (c.moe.fp8_gemms & (fp8_gemm::fprop1 | fp8_gemm::fprop2)) != 0;
    if (!fprop) {
      EXPECT_EQ(concat(r.y), concat(e.y)) << "y of a layer with no FP8 forward GEMM";
    } else {
      EXPECT_NE(concat(r.y), concat(e.y)) << "y: was anything quantized?";
    }
    if (c.moe.fp8_gemms == (fp8_gemm::fprop1 | fp8_gemm::fprop2)) {
      EXPECT_EQ(concat(r.y), concat(a.y)) << "y with both forward GEMMs in FP8";
    }
    EXPECT_LE(rel_error(concat(r.y), concat(e.y)), kFp8LayerTol) << "y";
    EXPECT_LE(rel_error(concat(r.dx), concat(e.dx)), kFp8LayerTol) << "dx";
    EXPECT_LE(rel_error(r.dw1, e.dw1), kFp8LayerTol) << "dw1";
    EXPECT_LE(rel_error(r.dw2, e.dw2), kFp8LayerTol) << "dw2";
    EXPECT_NE(r.dx, a.dx) << "dx equals the all-FP8 layer's";
    LayerCase off = c;
    off.echo.enabled = false;
    const LayerRun o = run_layer(off, in.x, g, in.params);
    EXPECT_EQ(concat(o.y), concat(r.y)) << "ECHO off, y";
    EXPECT_EQ(concat(o.dx), concat(r.dx)) << "ECHO off, dx";
    LayerCase rc = c;
    rc.moe.recompute = Recompute::dispatch;
    const LayerRun d = run_layer(rc, in.x, g, in.params);
    EXPECT_EQ(concat(d.y), concat(r.y)) << "recompute dispatch, y";
    EXPECT_EQ(concat(d.dx), concat(r.dx)) << "recompute dispatch, dx";
    EXPECT_EQ(d.dw1, r.dw1) << "recompute dispatch, dw1";
    EXPECT_EQ(d.dw2, r.dw2) << "recompute dispatch, dw2";
  }
}

// The error each set of FP8 GEMMs leaves, at a shape of whole 128-wide tiles (H 256, F 256). y
// depends on the forward GEMMs only: every set with fc1's forward in FP8 and fc2's unquantized
// gives the same y, already about 5e-2 from the unquantized layer (SwiGLU multiplies fc1's two
// quantized halves, so their errors add), and fc2's forward adds more. dx and the weight gradients
// lose error with each backward GEMM taken out of FP8.
TEST(Fp8Layer, ErrorOfEachSetOfFp8Gemms) {
  LayerCase all;
  all.moe = fp8_moe(8, 2, 64);
  all.moe.hidden = 256;
  all.moe.ffn = 256;
  all.moe.aux_loss_coeff = 0;
  LayerCase exact = all;
  exact.moe.precision = Precision::bf16;
  const SkewedInput in = skewed(all, 64, 1.0, 5);
  const auto g = per_rank(1, 64 * 256, 900);
  const LayerRun e = run_layer(exact, in.x, g, in.params);
  struct Result {
    std::vector<double> y;
    double ey, edx, edw1, edw2;
  };
  auto run = [&](const char* set) {
    LayerCase c = all;
    c.moe.fp8_gemms = parse_fp8_gemms(set);
    const LayerRun r = run_layer(c, in.x, g, in.params);
    const Result res{concat(r.y), rel_error(concat(r.y), concat(e.y)),
                     rel_error(concat(r.dx), concat(e.dx)), rel_error(r.dw1, e.dw1),
                     rel_error(r.dw2, e.dw2)};
    std::printf("[ fp8 sets ] %-20s y %.3e dx %.3e dw1 %.3e dw2 %.3e\n", set, res.ey, res.edx,
                res.edw1, res.edw2);
    return res;
  };
  const Result a = run("all"), no_fprop2 = run("fprop1,dgrad,wgrad"),
               fc1_dgrad = run("fprop1,dgrad1,wgrad"), fprop1 = run("fprop1");
  EXPECT_EQ(no_fprop2.y, fprop1.y);
  EXPECT_EQ(fc1_dgrad.y, fprop1.y);
  EXPECT_GT(fprop1.ey, 3e-2) << "fc1's forward alone";
  EXPECT_GT(a.ey, fprop1.ey) << "fc2's forward adds error";
  EXPECT_GT(a.edx, no_fprop2.edx);
  EXPECT_GT(no_fprop2.edx, fc1_dgrad.edx) << "fc2's dgrad";
  EXPECT_GT(fc1_dgrad.edx, fprop1.edx) << "fc1's dgrad";
  EXPECT_GT(fc1_dgrad.edw2, fprop1.edw2) << "fc2's wgrad";
  for (const Result* r : {&a, &no_fprop2, &fc1_dgrad, &fprop1}) {
    EXPECT_LE(r->ey, kFp8LayerTol);
    EXPECT_LE(r->edx, kFp8LayerTol);
    EXPECT_LE(r->edw1, kFp8LayerTol);
    EXPECT_LE(r->edw2, kFp8LayerTol);
  }
}

// A layer allocates the FP8 parts its GEMMs need only: with fprop1 alone no wgrad columns, no
// row operands and no copies of w2; without fprop1 the received rows stay unquantized.
TEST(Fp8Layer, Fp8GemmsDecideWhatIsAllocated) {
  const ParallelConfig par{1, 0};
  EchoConfig e;
  e.spare_slots_per_rank = 1;
  MoeConfig m = fp8_moe(8, 2, 24);
  const MoeMemory all = MoeLayer::memory_breakdown(m, par, e, DType::f32, DType::f32);
  m.fp8_gemms = fp8_gemm::fprop1;
  const MoeMemory fprop1 = MoeLayer::memory_breakdown(m, par, e, DType::f32, DType::f32);
  m.fp8_gemms = fp8_gemm::dgrad1 | fp8_gemm::dgrad2;
  const MoeMemory dgrad = MoeLayer::memory_breakdown(m, par, e, DType::f32, DType::f32);
  MoeConfig bf = m;
  bf.precision = Precision::bf16;
  const MoeMemory none = MoeLayer::memory_breakdown(bf, par, e, DType::f32, DType::f32);
  EXPECT_LT(fprop1.fp8, all.fp8);
  EXPECT_LT(dgrad.fp8, all.fp8);
  EXPECT_GT(fprop1.fp8, 0u);
  EXPECT_EQ(fprop1.activations, all.activations) << "the received rows in e4m3 with fprop1";
  EXPECT_EQ(dgrad.activations, none.activations) << "unquantized received rows without fprop1";
  auto be = make_cpu_backend(DType::f32);
  InProcessWorld world(1);
  for (uint32_t set : {fp8_gemm::fprop1, fp8_gemm::dgrad1 | fp8_gemm::wgrad2}) {
    m.fp8_gemms = set;
    MoeLayer layer(*be, world.communicator(0), m, par, e, 1);
    EXPECT_EQ(layer.workspace_bytes(), MoeLayer::memory_bytes(m, par, e, DType::f32, DType::f32))
        << fp8_gemms_to_string(set);
  }
  m.fp8_gemms = 0;
  EXPECT_THROW(validate(m), ConfigError);
  m.fp8_gemms = 64;
  EXPECT_THROW(validate(m), ConfigError);
  EXPECT_EQ(parse_fp8_gemms("all"), fp8_gemm::all);
  EXPECT_EQ(parse_fp8_gemms("wgrad,fprop1"),
            fp8_gemm::wgrad1 | fp8_gemm::wgrad2 | fp8_gemm::fprop1);
  EXPECT_EQ(fp8_gemms_to_string(fp8_gemm::fprop1 | fp8_gemm::dgrad2), "fprop1,dgrad2");
  EXPECT_EQ(fp8_gemms_to_string(fp8_gemm::all), "all");
  EXPECT_THROW(parse_fp8_gemms("fprop1,,dgrad1"), ConfigError);
  EXPECT_THROW(parse_fp8_gemms(""), ConfigError);
}

TEST(Fp8Layer, HiddenAndFfnMustBeMultiplesOf16) {
  MoeConfig m = fp8_moe(8, 2, 8);
  m.ffn = 40;
  try {
    validate(m);
    ADD_FAILURE() << "ffn 40 accepted with precision fp8";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("ffn"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("multiple of 16"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_precision("fp8"), Precision::fp8);
  EXPECT_THROW(parse_precision("fp16"), ConfigError);
}

}  // namespace
}  // namespace moe_echo::test
