// The MoE layer on R GPUs (one process each, the NCCL communicator) against references computed
// on the host by every rank alike:
// - the CPU layer on R in-process ranks (the same EP layout): outputs, input gradients, router and
//   expert gradients within kLayerTol; routing statistics (loads with and without ECHO, clones,
//   overflow, spill rounds) exactly;
// - the CPU layer on ONE rank holding all experts and all R * T tokens (aux and z losses off, as
//   they are per-rank terms): y and dx of each rank's tokens, every expert gradient, the router
//   gradient summed over ranks;
// - ECHO on against ECHO off on the GPUs under skew (clones made);
// - forced overflow (capacity factor 0.3: spill rounds through the conditional path);
// - both dispatchers (sync-free and baseline);
// - Overlap::wgrad and the split-phase calls against the whole step without overlap, bit for bit;
// - the forward in chunks (MoeConfig::chunks) against one chunk, bit for bit;
// - two micro-batches in flight (MoeConfig::in_flight 2), one's forward phases interleaved with
//   the other's backward phases: each micro-batch's outputs and input gradients bit for bit
//   with a clone placement per micro-batch; with one per step (EchoPlacement::step) the second
//   micro-batch's within a reordered sum's error;
// - a whole training step (forward, backward, router-gradient all-reduce, AdamW) captured in ONE
//   CUDA graph per rank and replayed 6 times with new tokens written on the device, routing
//   changing (a replay with every token on one expert: overflow, spill round, clones), every
//   replay checked against the CPU layers stepped the same way; the router weight stays
//   bit-identical on every rank.
// Tokens are drawn with clear top-k margins so that routing agrees exactly with the CPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "layer_harness.hpp"
#include "layer_inputs.hpp"
#include "multigpu_world.hpp"

namespace moe_echo::test {
namespace {

// Relative error of bf16 outputs whose sums ran in another order (one ulp is 2^-8 relative).
constexpr double kReorderTol = 2e-3;

std::vector<double> slice(const std::vector<double>& v, size_t part, size_t parts) {
  const size_t n = v.size() / parts;
  return std::vector<double>(v.begin() + std::ptrdiff_t(part * n),
                             v.begin() + std::ptrdiff_t((part + 1) * n));
}

// One forward + backward of this rank's GPU layer; everything read back to the host.
struct GpuRun {
  std::vector<double> y, dx, d_router, dw1, dw2;
  StepStats stats;
};

// split: the forward and backward as their three split-phase calls each. interleaved (with
// c.moe.in_flight 2): two micro-batches of the same tokens, micro-batch 1's forward phases
// between micro-batch 0's backward phases; y and dx are micro-batch 1's (micro-batch 0's must
// equal them: y2 and dx2), the gradients the two backwards' sum. With EchoPlacement::step the
// first backward holds its clone gradients and the second reduces both.
struct Interleaved {
  std::vector<double> y2, dx2;
};
GpuRun run_gpu(MultiGpuWorld& w, Communicator& comm, const LayerCase& c, const GlobalParams& p,
               const std::vector<double>& x, const std::vector<double>& g, bool split = false,
               Interleaved* interleaved = nullptr) {
  Backend& be = *w.be;
  const int R = w.size(), r = w.rank();
  const int64_t H = c.moe.hidden, T = int64_t(x.size()) / H;
  MoeLayer layer(be, comm, c.moe, ParallelConfig{R, r}, c.echo, c.seed);
  write_tensor(be, layer.param(Param::router_weight), p.router_weight);
  write_tensor(be, layer.param(Param::router_bias), p.router_bias);
  write_tensor(be, layer.param(Param::w1), slice(p.w1, size_t(r), size_t(R)));
  write_tensor(be, layer.param(Param::w2), slice(p.w2, size_t(r), size_t(R)));
  OwnedTensor xt(be, DType::bf16, {T, H}), yt(be, DType::bf16, {T, H}), gt(be, DType::bf16, {T, H}),
      dxt(be, DType::bf16, {T, H});
  xt.write(x);
  gt.write(g);
  poison(yt);
  poison(dxt);
  layer.zero_grad();
  if (interleaved) {
    OwnedTensor y0(be, DType::bf16, {T, H}), dx0(be, DType::bf16, {T, H});
    poison(y0);
    poison(dx0);
    const bool step = c.echo.placement == EchoPlacement::step;
    layer.forward(*xt, *y0, nullptr, 0);
    layer.forward_dispatch(*xt, *yt, nullptr, 1);
    if (step) layer.hold_clone_grads(true);
    layer.backward_dispatch(*gt, *dx0, nullptr, 0);
    layer.forward_experts(nullptr, 1);
    layer.backward_experts(nullptr, 0);
    layer.forward_combine(nullptr, 1);
    layer.backward_combine(nullptr, 0);
    if (step) layer.hold_clone_grads(false);
    layer.backward(*gt, *dxt, nullptr, 1);
    interleaved->y2 = y0.read();
    interleaved->dx2 = dx0.read();
  } else if (split) {
    layer.forward_dispatch(*xt, *yt);
    layer.forward_experts();
    layer.forward_combine();
    layer.backward_dispatch(*gt, *dxt);
    layer.backward_experts();
    layer.backward_combine();
  } else {
    layer.forward(*xt, *yt);
    layer.backward(*gt, *dxt);
  }
  GpuRun out;
  out.y = yt.read();
  out.dx = dxt.read();
  out.d_router = read_tensor(be, layer.grad(Param::router_weight));
  out.dw1 = read_tensor(be, layer.grad(Param::w1));
  out.dw2 = read_tensor(be, layer.grad(Param::w2));
  out.stats = layer.stats();
  be.synchronize();
  comm.barrier();  // nobody frees its windows (the layer's destructor) while a peer still reads
  return out;
}

struct LayerParam {
  std::string name;
  int H, F, experts_per_rank, K, T;
  ScoreFunction sf;
  double capacity_factor;
  bool echo = false;
  int hot = -1;         // expert every token picks first (bias), or -1
  bool aux_z = false;   // aux and z losses on (then no one-rank comparison)
  bool uneven = false;  // rank r feeds T - 19 r tokens, rank 1 none
  Dispatcher dispatcher = Dispatcher::syncfree;
  bool host_api = false;  // host-API mode (every op on NCCL's host API); needs baseline
};

class MultiGpuLayer : public ::testing::TestWithParam<LayerParam> {};

TEST_P(MultiGpuLayer, MatchesCpuLayersOnRanksAndOnOneRank) {
  MOE_ECHO_MULTIGPU_WORLD(w);
  const LayerParam lp = GetParam();
  const int R = w->size(), me = w->rank();
  LayerCase c;
  c.moe.hidden = lp.H;
  c.moe.ffn = lp.F;
  c.moe.experts = lp.experts_per_rank * R;
  c.moe.top_k = lp.K;
  c.moe.max_tokens = lp.T;
  c.moe.score_function = lp.sf;
  c.moe.aux_loss_coeff = lp.aux_z ? 0.01 : 0.0;
  c.moe.z_loss_coeff = lp.aux_z ? 0.001 : 0.0;
  c.echo.enabled = lp.echo;
  c.echo.spare_slots_per_rank = 2;
  c.echo.max_clones_per_expert = 2;
  c.moe.capacity_factor = lp.capacity_factor;
  c.ranks = R;
  c.dtype = DType::f32;
  const uint64_t seed = uint64_t(lp.H + lp.experts_per_rank * 3 + lp.T * 7 + lp.K + R);
  const GlobalParams p = rounded_params(c.moe, seed, lp.hot);
  std::vector<std::vector<double>> xs(static_cast<size_t>(R)), gs(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    const int64_t T = lp.uneven ? (r == 1 ? 0 : lp.T - 19 * r) : lp.T;
    xs[size_t(r)] = draw_tokens(T, c.moe, p.router_weight, p.router_bias, seed + 10 + uint64_t(r));
    gs[size_t(r)] = round_bf16(random_values(size_t(T * lp.H), seed + 100 + uint64_t(r), -1, 1));
  }
  const LayerRun cpu = run_layer(c, xs, gs, p);

  Communicator& comm = lp.host_api ? w->comm(CommKind::host_api) : w->comm(lp.dispatcher);
  const GpuRun gpu = run_gpu(*w, comm, c, p, xs[size_t(me)], gs[size_t(me)]);
  expect_stats_equal(gpu.stats, cpu.stats[size_t(me)]);
  if (lp.hot >= 0 && lp.echo) {
    EXPECT_GT(gpu.stats.clones, 0) << "skewed routing should make clones";
    EXPECT_LT(gpu.stats.max_over_mean_after, gpu.stats.max_over_mean_before);
  }
  // Clone traffic: per clone 3 H F bf16 weights in and 3 H F fp32 gradients home.
  EXPECT_EQ(gpu.stats.clone_bytes, int64_t(gpu.stats.clones) * 3 * lp.H * lp.F * (2 + 4));
  if (lp.capacity_factor < 0.5) {
    EXPECT_GT(gpu.stats.overflow_rows_all, 0) << "expected overflow";
  }
  EXPECT_TRUE(close(gpu.y, cpu.y[size_t(me)], kLayerTol, "y"));
  EXPECT_TRUE(close(gpu.dx, cpu.dx[size_t(me)], kLayerTol, "dx"));
  EXPECT_TRUE(close(gpu.d_router, cpu.d_router[size_t(me)], kLayerTol, "d_router"));
  EXPECT_TRUE(close(gpu.dw1, slice(cpu.dw1, size_t(me), size_t(R)), kLayerTol, "dw1"));
  EXPECT_TRUE(close(gpu.dw2, slice(cpu.dw2, size_t(me), size_t(R)), kLayerTol, "dw2"));
  RecordProperty("spill_rounds", gpu.stats.spill_rounds);
  RecordProperty("clones", gpu.stats.clones);

  // ECHO on == off: the same step on the GPUs with the other setting.
  if (lp.echo) {
    LayerCase off = c;
    off.echo.enabled = false;
    const GpuRun g2 = run_gpu(*w, comm, off, p, xs[size_t(me)], gs[size_t(me)]);
    EXPECT_EQ(g2.stats.clones, 0);
    EXPECT_EQ(g2.stats.load_before, gpu.stats.load_before);
    EXPECT_TRUE(close(gpu.y, g2.y, kLayerTol, "y ECHO on vs off"));
    EXPECT_TRUE(close(gpu.dx, g2.dx, kLayerTol, "dx ECHO on vs off"));
    EXPECT_TRUE(close(gpu.dw1, g2.dw1, kLayerTol, "dw1 ECHO on vs off"));
    EXPECT_TRUE(close(gpu.dw2, g2.dw2, kLayerTol, "dw2 ECHO on vs off"));
    EXPECT_TRUE(close(gpu.d_router, g2.d_router, kLayerTol, "d_router ECHO on vs off"));
  }

  // Overlap wgrad (fc1's weight gradient beside the combine, on GEMMs that leave 8 SMs to it),
  // whole and as split-phase calls: the same bits on the GPUs.
  {
    LayerCase ov = c;
    ov.moe.overlap = Overlap::wgrad;
    ov.moe.overlap_sms = 8;
    for (bool split : {false, true}) {
      SCOPED_TRACE(split ? "overlap wgrad, split phases" : "overlap wgrad");
      const GpuRun g3 = run_gpu(*w, comm, ov, p, xs[size_t(me)], gs[size_t(me)], split);
      EXPECT_TRUE(same_bits(g3.y, gpu.y, "y, overlap wgrad"));
      EXPECT_TRUE(same_bits(g3.dx, gpu.dx, "dx, overlap wgrad"));
      EXPECT_TRUE(same_bits(g3.d_router, gpu.d_router, "d_router, overlap wgrad"));
      EXPECT_TRUE(same_bits(g3.dw1, gpu.dw1, "dw1, overlap wgrad"));
      EXPECT_TRUE(same_bits(g3.dw2, gpu.dw2, "dw2, overlap wgrad"));
    }
  }

  // The forward in chunks (MoeConfig::chunks 3: a chunk's expert GEMMs beside the next chunk's
  // dispatch and the one before's combine, on GEMMs that leave 8 SMs to them): the same bits.
  {
    SCOPED_TRACE("forward in 3 chunks");
    LayerCase ch = c;
    ch.moe.chunks = 3;
    ch.moe.overlap_sms = 8;
    const GpuRun g5 = run_gpu(*w, comm, ch, p, xs[size_t(me)], gs[size_t(me)]);
    EXPECT_TRUE(same_bits(g5.y, gpu.y, "y, 3 chunks"));
    EXPECT_TRUE(same_bits(g5.dx, gpu.dx, "dx, 3 chunks"));
    EXPECT_TRUE(same_bits(g5.d_router, gpu.d_router, "d_router, 3 chunks"));
    EXPECT_TRUE(same_bits(g5.dw1, gpu.dw1, "dw1, 3 chunks"));
    EXPECT_TRUE(same_bits(g5.dw2, gpu.dw2, "dw2, 3 chunks"));
  }

  // Two micro-batches in flight, interleaved: each gives the whole step's y and dx bits; the
  // gradients are the two backwards' sum. With a placement per step too (the second forward
  // keeps the first's clones, the clone gradients go home once): micro-batch 0 makes the
  // placement as the whole step does (the same bits); micro-batch 1 splits its rows over it, which
  // can give a clone no rows and sum a token's experts in another order (as the CPU layer test
  // StepPlacementMovesClonesOncePerStep says: 1e-13 in f64), so its y and dx are within
  // kReorderTol of the whole step's (a few values one bf16 ulp apart: 4.3e-4 at most on 4 H200s).
  for (EchoPlacement placement : {EchoPlacement::micro_batch, EchoPlacement::step}) {
    SCOPED_TRACE(std::string("two micro-batches, placement ") + to_string(placement));
    LayerCase two = c;
    two.moe.in_flight = 2;
    two.echo.placement = placement;
    Interleaved other;
    const GpuRun g4 = run_gpu(*w, comm, two, p, xs[size_t(me)], gs[size_t(me)], false, &other);
    SCOPED_TRACE("clones: the whole step " + std::to_string(gpu.stats.clones) + ", micro-batch 1 " +
                 std::to_string(g4.stats.clones) + ", rank " + std::to_string(me));
    if (placement == EchoPlacement::micro_batch) {
      EXPECT_TRUE(same_bits(g4.y, gpu.y, "y of micro-batch 1"));
      EXPECT_TRUE(same_bits(g4.dx, gpu.dx, "dx of micro-batch 1"));
    } else {
      EXPECT_LE(g4.stats.clones, gpu.stats.clones);  // those given rows
      EXPECT_TRUE(close(g4.y, gpu.y, kReorderTol, "y of micro-batch 1"));
      EXPECT_TRUE(close(g4.dx, gpu.dx, kReorderTol, "dx of micro-batch 1"));
    }
    EXPECT_TRUE(same_bits(other.y2, gpu.y, "y of micro-batch 0"));
    EXPECT_TRUE(same_bits(other.dx2, gpu.dx, "dx of micro-batch 0"));
    auto twice = [](std::vector<double> v) {
      for (double& e : v) e *= 2;
      return v;
    };
    EXPECT_TRUE(close(g4.dw1, twice(gpu.dw1), kLayerTol, "dw1 of two micro-batches"));
    EXPECT_TRUE(close(g4.dw2, twice(gpu.dw2), kLayerTol, "dw2 of two micro-batches"));
    EXPECT_TRUE(close(g4.d_router, twice(gpu.d_router), kLayerTol, "d_router, two"));
  }

  // R ranks == one rank holding every expert and every token.
  if (!lp.aux_z) {
    LayerCase one = c;
    one.ranks = 1;
    std::vector<double> xcat, gcat;
    std::vector<size_t> begin;
    for (int r = 0; r < R; ++r) {
      begin.push_back(xcat.size());
      xcat.insert(xcat.end(), xs[size_t(r)].begin(), xs[size_t(r)].end());
      gcat.insert(gcat.end(), gs[size_t(r)].begin(), gs[size_t(r)].end());
    }
    one.moe.max_tokens = std::max<int>(1, int(xcat.size() / size_t(lp.H)));
    const LayerRun ref = run_layer(one, {xcat}, {gcat}, p);
    const size_t b = begin[size_t(me)], n = xs[size_t(me)].size();
    const std::vector<double> y1(ref.y[0].begin() + std::ptrdiff_t(b),
                                 ref.y[0].begin() + std::ptrdiff_t(b + n));
    const std::vector<double> dx1(ref.dx[0].begin() + std::ptrdiff_t(b),
                                  ref.dx[0].begin() + std::ptrdiff_t(b + n));
    EXPECT_TRUE(close(gpu.y, y1, kLayerTol, "y vs one rank"));
    EXPECT_TRUE(close(gpu.dx, dx1, kLayerTol, "dx vs one rank"));
    EXPECT_TRUE(
        close(gpu.dw1, slice(ref.dw1, size_t(me), size_t(R)), kLayerTol, "dw1 vs one rank"));
    EXPECT_TRUE(
        close(gpu.dw2, slice(ref.dw2, size_t(me), size_t(R)), kLayerTol, "dw2 vs one rank"));
    const auto every = w->all_gather(gpu.d_router);
    std::vector<double> sum(gpu.d_router.size(), 0.0);
    for (const auto& v : every)
      for (size_t i = 0; i < v.size() && i < sum.size(); ++i) sum[i] += v[i];
    EXPECT_TRUE(close(sum, ref.d_router[0], kLayerTol, "d_router summed over ranks vs one rank"));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configs, MultiGpuLayer,
    ::testing::Values(
        LayerParam{"small", 64, 32, 4, 2, 96, ScoreFunction::softmax, 1.25},
        LayerParam{"echo_skew", 64, 32, 4, 2, 96, ScoreFunction::softmax, 1.25, true, 1},
        LayerParam{"overflow_echo", 64, 32, 4, 2, 96, ScoreFunction::softmax, 0.3, true, 2},
        LayerParam{"uneven_tokens_aux", 128, 64, 2, 4, 120, ScoreFunction::sigmoid, 1.0, true, -1,
                   true, true},
        LayerParam{"wide", 256, 128, 8, 8, 128, ScoreFunction::softmax, 1.0, true},
        LayerParam{"baseline_small", 64, 32, 4, 2, 96, ScoreFunction::softmax, 1.25, false, -1,
                   false, false, Dispatcher::baseline},
        LayerParam{"baseline_overflow_echo", 64, 32, 4, 2, 96, ScoreFunction::softmax, 0.3, true, 2,
                   false, false, Dispatcher::baseline},
        LayerParam{"host_api_echo_skew", 64, 32, 4, 2, 96, ScoreFunction::softmax, 1.25, true, 1,
                   false, false, Dispatcher::baseline, true},
        LayerParam{"host_api_overflow_echo", 64, 32, 4, 2, 96, ScoreFunction::softmax, 0.3, true, 2,
                   false, false, Dispatcher::baseline, true}),
    [](const auto& p) { return p.param.name; });

// ================================================================================================
// A whole training step in one CUDA graph per rank, replayed with routing changing on the device
// ================================================================================================

TEST(MultiGpuGraph, CapturedTrainingStepReplaysMatchCpuLayers) {
  MOE_ECHO_MULTIGPU_WORLD(w);
  if (!w->comm(Dispatcher::syncfree).capturable())
    GTEST_SKIP() << "across nodes the sync-free communicator is capturable only with its clone "
                    "staging (MOE_ECHO_GIN_CLONE_SLOT_BYTES)";
  Backend& be = *w->be;
  const int R = w->size(), me = w->rank();
  MoeConfig m;
  m.hidden = 64;
  m.ffn = 32;
  m.experts = 4 * R;
  m.top_k = 2;
  m.max_tokens = 64;
  m.aux_loss_coeff = 0.01;
  m.z_loss_coeff = 0.001;
  m.bias_update = true;
  m.bias_update_rate = 1e-3;
  EchoConfig echo;
  echo.enabled = true;
  echo.spare_slots_per_rank = 2;
  echo.max_clones_per_expert = 2;
  m.capacity_factor = 0.7;
  // Capacity ceil(0.7 * max_tokens 64 * K 2) = 90 rows a round, below the mean load of 48 tokens
  // (96 rows): every replay runs spill round 1 (ECHO balances the loads, so a capacity at or
  // above the mean would never spill); the IF nodes of the later rounds stay off.
  const int64_t T = 48, H = m.hidden, EPR = m.experts / R;
  AdamWConfig adam;
  adam.eps = 1e-2;  // a smooth update (see cuda_layer_test's graph test)
  adam.weight_decay = 0.01;
  const uint64_t seed = 5;

  MoeLayer gl(be, w->comm(Dispatcher::syncfree), m, ParallelConfig{R, me}, echo, seed);
  {
    const GlobalParams p0 = rounded_params(m, 21);
    write_tensor(be, gl.param(Param::router_weight), p0.router_weight);
    write_tensor(be, gl.param(Param::router_bias), p0.router_bias);
    write_tensor(be, gl.param(Param::w1), slice(p0.w1, size_t(me), size_t(R)));
    write_tensor(be, gl.param(Param::w2), slice(p0.w2, size_t(me), size_t(R)));
  }
  // The CPU reference: R in-process ranks, stepped exactly like the GPU ranks.
  InProcessWorld cw(R);
  std::vector<std::unique_ptr<Backend>> cbe(static_cast<size_t>(R));
  std::vector<std::unique_ptr<MoeLayer>> cl(static_cast<size_t>(R));
  cw.run([&](int r) {
    cbe[size_t(r)] = make_cpu_backend(DType::f32);
    cl[size_t(r)] = std::make_unique<MoeLayer>(*cbe[size_t(r)], cw.communicator(r), m,
                                               ParallelConfig{R, r}, echo, seed);
  });
  // CPU layers free their buffers collectively: on their own rank threads.
  struct FreeCpuLayers {
    InProcessWorld& cw;
    std::vector<std::unique_ptr<MoeLayer>>& cl;
    ~FreeCpuLayers() {
      cw.run([&](int r) { cl[size_t(r)].reset(); });
    }
  } free_cpu_layers{cw, cl};

  OwnedTensor x(be, DType::bf16, {T, H}), y(be, DType::bf16, {T, H}), dy(be, DType::bf16, {T, H}),
      dx(be, DType::bf16, {T, H});
  x.write(std::vector<double>(size_t(T * H), 0.5));
  dy.write(std::vector<double>(size_t(T * H), 0.5));
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Stream s = stream;
  std::unique_ptr<cuda::CapturedGraph> graph;
  std::string capture_error;
  try {
    graph = std::make_unique<cuda::CapturedGraph>(stream, [&] {
      gl.zero_grad(s);
      gl.forward(*x, *y, s);
      gl.backward(*dy, *dx, s);
      gl.all_reduce_router_grad(s);
      gl.optimizer_step(adam, s);
    });
  } catch (const std::exception& e) {
    capture_error = e.what();
  }
  // Every rank must agree before replaying (a rank without a graph would hang the others).
  const auto ok = w->all_gather(std::vector<int>{graph ? 1 : 0});
  bool all_ok = true;
  for (const auto& v : ok) all_ok = all_ok && v[0] == 1;
  ASSERT_TRUE(all_ok) << "capture failed on some rank: " << capture_error;
  const size_t rounds = size_t(max_rounds(m, ParallelConfig{R, me}, echo));
  // One IF node per spill round in both passes, and the forward's zeroing of y before the
  // spill rounds add into it.
  EXPECT_EQ(graph->conditional_nodes(), rounds > 1 ? 2 * (rounds - 1) + 1 : 0)
      << "one IF node per spill round, both passes, and the forward's zeroing of y";

  int spills = 0, clone_steps = 0;
  for (int replay = 0; replay < 6; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    // Global parameters as the GPUs hold them now (experts gathered from their home ranks).
    const auto rw = read_tensor(be, gl.param(Param::router_weight));
    const auto rb = read_tensor(be, gl.param(Param::router_bias));
    const auto every_rw = w->all_gather(rw), every_rb = w->all_gather(rb);
    for (int r = 0; r < R; ++r) {
      EXPECT_EQ(every_rw[size_t(r)], rw) << "router weight differs on rank " << r;
      EXPECT_EQ(every_rb[size_t(r)], rb) << "router bias differs on rank " << r;
    }
    const auto w1 = w->all_gather(read_tensor(be, gl.param(Param::w1)));
    const auto w2 = w->all_gather(read_tensor(be, gl.param(Param::w2)));
    const int hot = replay == 3 ? 1 : replay == 5 ? int(EPR) + 1 : -1;
    std::vector<std::vector<double>> xs(static_cast<size_t>(R)), dys(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) {
      xs[size_t(r)] = draw_tokens(T, m, rw, rb, 100 + uint64_t(replay) * 10 + uint64_t(r), hot);
      dys[size_t(r)] = round_bf16(
          random_values(size_t(T * H), 200 + uint64_t(replay) * 10 + uint64_t(r), -1, 1));
    }
    x.write(xs[size_t(me)]);
    dy.write(dys[size_t(me)]);
    poison(y);
    poison(dx);
    be.synchronize();
    w->rv->barrier();
    graph->launch(stream);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);

    struct CpuOut {
      std::vector<double> y, dx, d_router, dw1, dw2, p_router, p_bias, p_w1, p_w2;
      StepStats stats;
    };
    std::vector<CpuOut> co(static_cast<size_t>(R));
    cw.run([&](int r) {
      Backend& b = *cbe[size_t(r)];
      MoeLayer& L = *cl[size_t(r)];
      write_tensor(b, L.param(Param::router_weight), rw);
      write_tensor(b, L.param(Param::router_bias), rb);
      write_tensor(b, L.param(Param::w1), w1[size_t(r)]);
      write_tensor(b, L.param(Param::w2), w2[size_t(r)]);
      Tensor cx(b.allocate(size_t(T * H) * 4), DType::f32, {T, H}),
          cy(b.allocate(size_t(T * H) * 4), DType::f32, {T, H}),
          cdy(b.allocate(size_t(T * H) * 4), DType::f32, {T, H}),
          cdx(b.allocate(size_t(T * H) * 4), DType::f32, {T, H});
      write_tensor(b, cx, xs[size_t(r)]);
      write_tensor(b, cdy, dys[size_t(r)]);
      L.zero_grad();
      L.forward(cx, cy);
      L.backward(cdy, cdx);
      L.all_reduce_router_grad();
      CpuOut& o = co[size_t(r)];
      o.y = read_tensor(b, cy);
      o.dx = read_tensor(b, cdx);
      o.d_router = read_tensor(b, L.grad(Param::router_weight));
      o.dw1 = read_tensor(b, L.grad(Param::w1));
      o.dw2 = read_tensor(b, L.grad(Param::w2));
      L.optimizer_step(adam);
      o.p_router = read_tensor(b, L.param(Param::router_weight));
      o.p_bias = read_tensor(b, L.param(Param::router_bias));
      o.p_w1 = read_tensor(b, L.param(Param::w1));
      o.p_w2 = read_tensor(b, L.param(Param::w2));
      o.stats = L.stats();
      for (Tensor* t : {&cx, &cy, &cdy, &cdx}) b.deallocate(t->data);
    });
    const CpuOut& c = co[size_t(me)];
    const StepStats gs = gl.stats();
    expect_stats_equal(gs, c.stats);
    spills += gs.spill_rounds > 0;
    clone_steps += gs.clones > 0;
    EXPECT_TRUE(close(y.read(), c.y, kLayerTol, "y"));
    EXPECT_TRUE(close(dx.read(), c.dx, kLayerTol, "dx"));
    EXPECT_TRUE(close(read_tensor(be, gl.grad(Param::router_weight)), c.d_router, kLayerTol,
                      "d_router (all-reduced)"));
    EXPECT_TRUE(close(read_tensor(be, gl.grad(Param::w1)), c.dw1, kLayerTol, "dw1"));
    EXPECT_TRUE(close(read_tensor(be, gl.grad(Param::w2)), c.dw2, kLayerTol, "dw2"));
    EXPECT_TRUE(
        close(read_tensor(be, gl.param(Param::router_weight)), c.p_router, 1e-3, "router_weight"));
    EXPECT_TRUE(close(read_tensor(be, gl.param(Param::w1)), c.p_w1, kBf16Tol, "w1"));
    EXPECT_TRUE(close(read_tensor(be, gl.param(Param::w2)), c.p_w2, kBf16Tol, "w2"));
    EXPECT_EQ(read_tensor(be, gl.param(Param::router_bias)), c.p_bias);
  }
  EXPECT_EQ(spills, 6) << "every replay should run a spill round";
  EXPECT_GT(clone_steps, 0) << "no replay made clones";
  RecordProperty("replays_with_spill", spills);
  RecordProperty("replays_with_clones", clone_steps);
  graph.reset();
  cudaStreamDestroy(stream);
  be.synchronize();
  w->rv->barrier();
}

}  // namespace
}  // namespace moe_echo::test
