// The whole MoE layer on the CUDA backend (EP size 1, the local communicator) against the CPU
// layer (f32, the in-process communicator) on the same parameters and inputs: forward and
// backward, then a whole training step captured in one CUDA graph and replayed with new tokens.
//
// Parameters and inputs are rounded to what the GPU holds (bf16 experts and activations, f32
// router) and given to both layers. Tokens are drawn so that every top-k choice is clear (gaps
// between the best K + 1 selection keys above 1e-6), so routing, loads and spill rounds must agree
// exactly; outputs and gradients within kLayerTol (bf16 intermediates), losses within 1e-4.
// With one rank the rank receives T * K rows whatever the routing, so spill rounds come from a
// capacity factor below 1 (rounds = ceil(T K / capacity)); the cases below cover no spill, one
// and two spill rounds, and a configured round that stays inactive. Skipped without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test_util.hpp"
#include "layer_harness.hpp"
#include "layer_inputs.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::test {
namespace {

struct GpuLayer {
  std::unique_ptr<Backend> be = cuda::make_cuda_backend();
  std::unique_ptr<Communicator> comm = cuda::make_local_communicator();
  MoeLayer layer;
  GpuLayer(const MoeConfig& m, const EchoConfig& e, uint64_t seed)
      : layer(*be, *comm, m, ParallelConfig{1, 0}, e, seed) {}
  void set(const GlobalParams& p) {
    write_tensor(*be, layer.param(Param::router_weight), p.router_weight);
    write_tensor(*be, layer.param(Param::router_bias), p.router_bias);
    write_tensor(*be, layer.param(Param::w1), p.w1);
    write_tensor(*be, layer.param(Param::w2), p.w2);
    if (!p.shared_w1.empty()) {
      write_tensor(*be, layer.param(Param::shared_w1), p.shared_w1);
      write_tensor(*be, layer.param(Param::shared_w2), p.shared_w2);
    }
  }
};

// x, y, dy, dx of a [T, H] step in bf16: x drawn from seed in [-1, 1), dy from seed + 1 in
// [-dy_scale, dy_scale), both bf16-exact; y and dx for the step to write.
struct StepTensors {
  OwnedTensor x, y, dy, dx;
  StepTensors(Backend& be, int64_t T, int64_t H, uint64_t seed, double dy_scale)
      : x(be, DType::bf16, {T, H}),
        y(be, DType::bf16, {T, H}),
        dy(be, DType::bf16, {T, H}),
        dx(be, DType::bf16, {T, H}) {
    x.write(round_bf16(random_values(size_t(T * H), seed, -1, 1)));
    dy.write(round_bf16(random_values(size_t(T * H), seed + 1, -dy_scale, dy_scale)));
  }
};

// =================================================================================================
// Forward + backward against the CPU layer
// =================================================================================================

struct LayerParam {
  std::string name;
  int H, F, E, K, max_tokens, T;
  ScoreFunction sf;
  double capacity_factor;
  int hot = -1;  // expert every token picks first (bias), or -1
  bool aux_z = true;
  // The routing of real models: group-limited top-k, routed scaling, the sequence aux loss, and
  // shared experts (defaults: none).
  int groups = 1, topk_groups = 1;
  double scale = 1.0, seq_aux = 0.0;
  int seq_len = 0, shared_experts = 0;
  bool side_stream = false;  // the shared experts on the backend's side stream
  bool fp8 = false;          // MoeConfig::precision fp8 (against the CPU layer in fp8)
};

class CudaLayerTest : public ::testing::TestWithParam<LayerParam> {};

std::string layer_name(const ::testing::TestParamInfo<LayerParam>& p) { return p.param.name; }

TEST_P(CudaLayerTest, ForwardBackwardMatchCpuLayer) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  const LayerParam lp = GetParam();
  LayerCase c;
  c.moe.hidden = lp.H;
  c.moe.ffn = lp.F;
  c.moe.experts = lp.E;
  c.moe.top_k = lp.K;
  c.moe.max_tokens = lp.max_tokens;
  c.moe.score_function = lp.sf;
  c.moe.aux_loss_coeff = lp.aux_z ? 0.01 : 0.0;
  c.moe.z_loss_coeff = lp.aux_z ? 0.001 : 0.0;
  c.moe.capacity_factor = lp.capacity_factor;
  c.moe.expert_groups = lp.groups;
  c.moe.topk_groups = lp.topk_groups;
  c.moe.routed_scaling_factor = lp.scale;
  c.moe.seq_aux_loss_coeff = lp.seq_aux;
  c.moe.seq_len = lp.seq_len;
  c.moe.shared_experts = lp.shared_experts;
  c.moe.precision = lp.fp8 ? Precision::fp8 : Precision::bf16;
  c.ranks = 1;
  LayerCase gpu_case = c;  // the CPU layer runs the shared experts in place either way
  gpu_case.moe.shared_side_stream = lp.side_stream;
  c.dtype = DType::f32;
  const uint64_t seed = uint64_t(lp.H + lp.E * 3 + lp.T * 7 + lp.K);
  const GlobalParams p = rounded_params(c.moe, seed, lp.hot);
  const auto x = draw_tokens(lp.T, c.moe, p.router_weight, p.router_bias, seed + 10);
  const auto g = round_bf16(random_values(size_t(lp.T * lp.H), seed + 11, -1, 1));
  const LayerRun cpu = run_layer(c, {x}, {g}, p);

  GpuLayer gl(gpu_case.moe, c.echo, c.seed);
  gl.set(p);
  OwnedTensor xt(*gl.be, DType::bf16, {lp.T, lp.H}), yt(*gl.be, DType::bf16, {lp.T, lp.H}),
      gt(*gl.be, DType::bf16, {lp.T, lp.H}), dxt(*gl.be, DType::bf16, {lp.T, lp.H});
  xt.write(x);
  gt.write(g);
  poison(yt);
  poison(dxt);
  gl.layer.zero_grad();
  gl.layer.forward(*xt, *yt);
  gl.layer.backward(*gt, *dxt);
  const StepStats st = gl.layer.stats();
  expect_stats_equal(st, cpu.stats[0]);
  // FP8: a bf16 intermediate one ulp apart (fp32 sums in another order) can quantize to the
  // neighbouring e4m3 code, so the GPU and CPU layers differ by more than in bf16.
  const double tol = lp.fp8 ? kFp8LayerTol : kLayerTol;
  EXPECT_TRUE(close(yt.read(), cpu.y[0], tol, "y"));
  EXPECT_TRUE(close(dxt.read(), cpu.dx[0], tol, "dx"));
  EXPECT_TRUE(close(read_tensor(*gl.be, gl.layer.grad(Param::router_weight)), cpu.d_router[0], tol,
                    "d_router"));
  EXPECT_TRUE(close(read_tensor(*gl.be, gl.layer.grad(Param::w1)), cpu.dw1, tol, "dw1"));
  EXPECT_TRUE(close(read_tensor(*gl.be, gl.layer.grad(Param::w2)), cpu.dw2, tol, "dw2"));
  if (lp.shared_experts > 0 && lp.T > 0) {
    EXPECT_TRUE(close(read_tensor(*gl.be, gl.layer.grad(Param::shared_w1)), cpu.d_shared_w1[0],
                      kLayerTol, "d_shared_w1"));
    EXPECT_TRUE(close(read_tensor(*gl.be, gl.layer.grad(Param::shared_w2)), cpu.d_shared_w2[0],
                      kLayerTol, "d_shared_w2"));
  }
  if (lp.hot >= 0) {
    EXPECT_EQ(st.load_after[0], lp.T * lp.K);
  }
  RecordProperty("spill_rounds", st.spill_rounds);

  // Deterministic: the same step again gives the same bits.
  const auto y1 = yt.read(), dx1 = dxt.read();
  const auto dw1_1 = read_tensor(*gl.be, gl.layer.grad(Param::w1));
  const auto dr_1 = read_tensor(*gl.be, gl.layer.grad(Param::router_weight));
  poison(yt);
  poison(dxt);
  gl.layer.zero_grad();
  gl.layer.forward(*xt, *yt);
  gl.layer.backward(*gt, *dxt);
  EXPECT_EQ(yt.read(), y1) << "y differs between two runs";
  EXPECT_EQ(dxt.read(), dx1) << "dx differs between two runs";
  EXPECT_EQ(read_tensor(*gl.be, gl.layer.grad(Param::w1)), dw1_1) << "dw1 differs between two runs";
  EXPECT_EQ(read_tensor(*gl.be, gl.layer.grad(Param::router_weight)), dr_1)
      << "d_router differs between two runs";

  // backward_into: the same expert gradients, written into poisoned tensors of the caller's.
  {
    const auto dw2_0 = read_tensor(*gl.be, gl.layer.grad(Param::w2));
    OwnedTensor dw1_into(*gl.be, DType::f32, {lp.E, lp.H, 2 * lp.F}),
        dw2_into(*gl.be, DType::f32, {lp.E, lp.F, lp.H});
    poison(dw1_into);
    poison(dw2_into);
    gl.layer.zero_grad();
    gl.layer.forward(*xt, *yt);
    gl.layer.backward_into(*xt, *gt, *dxt, {*dw1_into, *dw2_into});
    EXPECT_EQ(dw1_into.read(), dw1_1) << "dw1 of backward_into";
    EXPECT_EQ(dw2_into.read(), dw2_0) << "dw2 of backward_into";
    EXPECT_EQ(dxt.read(), dx1) << "dx of backward_into";
    gl.layer.zero_grad();  // the layer's own expert gradients are stale now; start again
    gl.layer.forward(*xt, *yt);
    gl.layer.backward(*gt, *dxt);
  }

  // Without zero_grad the next backward adds: the expert gradients double (after zero_grad the
  // first round writes them instead, see MoeLayer::zero_grad).
  const auto dw2_1 = read_tensor(*gl.be, gl.layer.grad(Param::w2));
  gl.layer.forward(*xt, *yt);
  gl.layer.backward(*gt, *dxt);
  auto twice = [](std::vector<double> v) {
    for (double& e : v) e *= 2;
    return v;
  };
  EXPECT_TRUE(close(read_tensor(*gl.be, gl.layer.grad(Param::w1)), twice(dw1_1), 1e-5,
                    "dw1 after a second backward without zero_grad"));
  EXPECT_TRUE(close(read_tensor(*gl.be, gl.layer.grad(Param::w2)), twice(dw2_1), 1e-5,
                    "dw2 after a second backward without zero_grad"));
}

INSTANTIATE_TEST_SUITE_P(
    Configs, CudaLayerTest,
    ::testing::Values(
        LayerParam{"small", 64, 32, 8, 2, 128, 100, ScoreFunction::softmax, 1.25},
        LayerParam{"no_tokens", 64, 32, 8, 2, 16, 0, ScoreFunction::softmax, 1.25},
        LayerParam{"one_token", 64, 32, 8, 2, 16, 1, ScoreFunction::softmax, 1.25},
        LayerParam{"one_spill_round", 64, 32, 8, 2, 64, 64, ScoreFunction::softmax, 0.6},
        LayerParam{"two_spill_rounds_one_idle", 64, 32, 8, 2, 64, 48, ScoreFunction::sigmoid, 0.3},
        LayerParam{"all_on_one_expert", 64, 32, 8, 2, 64, 64, ScoreFunction::softmax, 0.5, 3},
        LayerParam{"empty_experts", 128, 64, 32, 1, 16, 8, ScoreFunction::softmax, 1.0},
        LayerParam{"t255", 128, 64, 16, 4, 255, 255, ScoreFunction::softmax, 1.0},
        LayerParam{"t256", 128, 64, 16, 4, 256, 256, ScoreFunction::sigmoid, 0.75},
        LayerParam{"t257", 128, 64, 16, 4, 257, 257, ScoreFunction::softmax, 1.0, -1, false},
        LayerParam{"wide", 256, 128, 64, 8, 512, 512, ScoreFunction::softmax, 1.25},
        // DeepSeek-V3's routing at a small size: 8 groups, top 4, x 2.5, the sequence aux loss
        // and one shared expert; with spill rounds; and with no tokens.
        LayerParam{"deepseek_routing", 128, 64, 64, 8, 256, 256, ScoreFunction::sigmoid, 1.0, -1,
                   true, 8, 4, 2.5, 0.01, 64, 1},
        LayerParam{"deepseek_routing_spill", 64, 32, 32, 4, 128, 100, ScoreFunction::sigmoid, 0.4,
                   -1, true, 8, 2, 2.5, 0.01, 30, 2},
        LayerParam{"shared_no_tokens", 64, 32, 8, 2, 16, 0, ScoreFunction::softmax, 1.25, -1, true,
                   1, 1, 1.0, 0.0, 0, 1},
        // The shared experts on the side stream: without spill rounds (joined in round 0) and
        // with them (joined before the rounds).
        LayerParam{"shared_side_stream", 128, 64, 64, 8, 256, 256, ScoreFunction::sigmoid, 1.25, -1,
                   true, 8, 4, 2.5, 0.01, 64, 1, true},
        LayerParam{"shared_side_stream_spill", 64, 32, 32, 4, 128, 100, ScoreFunction::sigmoid, 0.4,
                   -1, true, 8, 2, 2.5, 0.0, 0, 2, true},
        // Precision fp8: the FP8 GEMMs and quantizers against the CPU layer's FP8 references.
        LayerParam{"fp8_small", 64, 32, 8, 2, 128, 100, ScoreFunction::softmax, 1.25, -1, true, 1,
                   1, 1.0, 0.0, 0, 0, false, true},
        LayerParam{"fp8_no_tokens", 64, 32, 8, 2, 16, 0, ScoreFunction::softmax, 1.25, -1, true, 1,
                   1, 1.0, 0.0, 0, 0, false, true},
        LayerParam{"fp8_spill_rounds", 64, 32, 8, 2, 64, 48, ScoreFunction::sigmoid, 0.3, -1, true,
                   1, 1, 1.0, 0.0, 0, 0, false, true},
        LayerParam{"fp8_wide_shared", 256, 128, 64, 8, 512, 512, ScoreFunction::softmax, 1.25, -1,
                   true, 1, 1, 1.0, 0.0, 0, 1, false, true}),
    layer_name);

// =================================================================================================
// One training step captured in a CUDA graph, replayed with new tokens
// =================================================================================================

TEST(CudaLayerGraph, CapturedStepReplaysMatchCpuLayer) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  MoeConfig m;
  m.hidden = 64;
  m.ffn = 32;
  m.experts = 8;
  m.top_k = 2;
  m.max_tokens = 64;
  m.aux_loss_coeff = 0.01;
  m.z_loss_coeff = 0.001;
  m.bias_update = true;
  m.bias_update_rate = 1e-3;
  EchoConfig echo;
  m.capacity_factor = 0.4;             // capacity 52 rows, 3 rounds configured
  const int64_t T = 48, H = m.hidden;  // 96 rows: rounds 0 and 1 run, round 2 stays idle
  // The optimizer step lives on the device, so every replay advances the bias correction. A large
  // eps keeps the update a smooth function of g (with a tiny eps the first steps are close to
  // lr * sign(g), and gradients near 0 whose sign differs between GPU and CPU would move a weight
  // by 2 lr).
  AdamWConfig adam;
  adam.lr = 1e-3;
  adam.beta1 = 0.9;
  adam.beta2 = 0.999;
  adam.eps = 1e-2;
  adam.weight_decay = 0.01;

  GpuLayer gl(m, echo, 5);
  gl.set(rounded_params(m, 21));
  auto cpu_be = make_cpu_backend(DType::f32);
  InProcessWorld world(1);
  MoeLayer cpu(*cpu_be, world.communicator(0), m, ParallelConfig{1, 0}, echo, 5);

  OwnedTensor x(*gl.be, DType::bf16, {T, H}), y(*gl.be, DType::bf16, {T, H}),
      dy(*gl.be, DType::bf16, {T, H}), dx(*gl.be, DType::bf16, {T, H});
  OwnedTensor cx(*cpu_be, DType::f32, {T, H}), cy(*cpu_be, DType::f32, {T, H}),
      cdy(*cpu_be, DType::f32, {T, H}), cdx(*cpu_be, DType::f32, {T, H});
  x.write(std::vector<double>(size_t(T * H), 0.5));
  dy.write(std::vector<double>(size_t(T * H), 0.5));

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Stream s = stream;
  // Any host sync, allocation or host copy inside the step would make the capture fail.
  std::unique_ptr<cuda::CapturedGraph> graph;
  ASSERT_NO_THROW(graph = std::make_unique<cuda::CapturedGraph>(stream, [&] {
                    gl.layer.zero_grad(s);
                    gl.layer.forward(*x, *y, s);
                    gl.layer.backward(*dy, *dx, s);
                    gl.layer.optimizer_step(adam, s);
                  }));
  // Spill rounds 1 and 2 are conditional, in the forward and in the backward, and so is the
  // forward's zeroing of y before the spill rounds add into it.
  EXPECT_EQ(graph->conditional_nodes(), 5u);

  const Param params[] = {Param::router_weight, Param::router_bias, Param::w1, Param::w2};
  for (int replay = 0; replay < 6; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    // Both layers start the step from the GPU's parameters (optimizer moments do not carry over
    // with beta = 0), so every replay is checked on its own.
    for (Param p : params)
      write_tensor(*cpu_be, cpu.param(p), read_tensor(*gl.be, gl.layer.param(p)));
    const auto w = read_tensor(*gl.be, gl.layer.param(Param::router_weight));
    const auto bias = read_tensor(*gl.be, gl.layer.param(Param::router_bias));
    const int hot = replay == 3 ? 5 : -1;  // replay 3: every token picks expert 5 first
    const auto xv = draw_tokens(T, m, w, bias, 100 + uint64_t(replay), hot);
    const auto dyv = round_bf16(random_values(size_t(T * H), 200 + uint64_t(replay), -1, 1));
    x.write(xv);
    dy.write(dyv);
    cx.write(xv);
    cdy.write(dyv);
    poison(y);
    poison(dx);

    graph->launch(stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);

    cpu.zero_grad();
    cpu.forward(*cx, *cy);
    cpu.backward(*cdy, *cdx);
    const std::vector<double> cpu_grads[] = {read_tensor(*cpu_be, cpu.grad(Param::router_weight)),
                                             read_tensor(*cpu_be, cpu.grad(Param::w1)),
                                             read_tensor(*cpu_be, cpu.grad(Param::w2))};
    cpu.optimizer_step(adam);

    const StepStats gs = gl.layer.stats(), cs = cpu.stats();
    expect_stats_equal(gs, cs);
    EXPECT_EQ(gs.spill_rounds, 1);
    if (hot >= 0) {
      const auto idx_counts = gs.load_after;  // all rows on the one rank
      EXPECT_EQ(idx_counts[0], T * m.top_k);
    }
    EXPECT_TRUE(close(y.read(), cy.read(), kLayerTol, "y"));
    EXPECT_TRUE(close(dx.read(), cdx.read(), kLayerTol, "dx"));
    EXPECT_TRUE(close(read_tensor(*gl.be, gl.layer.grad(Param::router_weight)), cpu_grads[0],
                      kLayerTol, "d_router"));
    EXPECT_TRUE(
        close(read_tensor(*gl.be, gl.layer.grad(Param::w1)), cpu_grads[1], kLayerTol, "dw1"));
    EXPECT_TRUE(
        close(read_tensor(*gl.be, gl.layer.grad(Param::w2)), cpu_grads[2], kLayerTol, "dw2"));
    // After the optimizer: the router (f32) closely, experts within bf16 rounding, and the bias
    // (integer counts, the same double arithmetic) bit for bit.
    EXPECT_TRUE(close(read_tensor(*gl.be, gl.layer.param(Param::router_weight)),
                      read_tensor(*cpu_be, cpu.param(Param::router_weight)), 1e-3,
                      "router_weight"));
    EXPECT_TRUE(close(read_tensor(*gl.be, gl.layer.param(Param::w1)),
                      read_tensor(*cpu_be, cpu.param(Param::w1)), kBf16Tol, "w1"));
    EXPECT_TRUE(close(read_tensor(*gl.be, gl.layer.param(Param::w2)),
                      read_tensor(*cpu_be, cpu.param(Param::w2)), kBf16Tol, "w2"));
    EXPECT_EQ(read_tensor(*gl.be, gl.layer.param(Param::router_bias)),
              read_tensor(*cpu_be, cpu.param(Param::router_bias)));
    if (HasFailure()) break;
  }
  graph.reset();
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace moe_echo::test

namespace moe_echo::test {
namespace {

// Not a correctness check: the time of one captured training step (forward + backward) at a
// Qwen3-30B-A3B-sized single-GPU slice (H 2048, F 768, E 16, top-8, 8192 tokens), for the record.
// ANCHORS.md: the plain PyTorch layer takes 7.03 ms for this step on an H200.
TEST(CudaLayerTiming, Qwen3SizedStepInOneGraph) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  MoeConfig m;
  m.hidden = 2048;
  m.ffn = 768;
  m.experts = 16;
  m.top_k = 8;
  m.max_tokens = 8192;
  m.aux_loss_coeff = 0.01;
  EchoConfig echo;
  GpuLayer gl(m, echo, 3);
  const int64_t T = m.max_tokens, H = m.hidden;
  StepTensors tensors(*gl.be, T, H, 1, 1e-3);
  OwnedTensor &x = tensors.x, &y = tensors.y, &dy = tensors.dy, &dx = tensors.dx;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Stream s = stream;
  cuda::CapturedGraph fwd(stream, [&] { gl.layer.forward(*x, *y, s); });
  cuda::CapturedGraph step(stream, [&] {
    gl.layer.zero_grad(s);
    gl.layer.forward(*x, *y, s);
    gl.layer.backward(*dy, *dx, s);
  });
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  auto median_ms = [&](cuda::CapturedGraph& g) {
    for (int i = 0; i < 3; ++i) g.launch(stream);
    std::vector<float> ms;
    for (int i = 0; i < 15; ++i) {
      cudaEventRecord(a, stream);
      g.launch(stream);
      cudaEventRecord(b, stream);
      cudaEventSynchronize(b);
      float t = 0;
      cudaEventElapsedTime(&t, a, b);
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return double(ms[ms.size() / 2]);
  };
  const double f_ms = median_ms(fwd), s_ms = median_ms(step);
  // The router alone (its f32 GEMMs are plain tiled kernels, not tensor-core GEMMs).
  const int64_t E = m.experts, K = m.top_k;
  OwnedTensor logits(*gl.be, DType::f32, {T, E}), scores(*gl.be, DType::f32, {T, E}),
      idx(*gl.be, DType::i32, {T, K}), tw(*gl.be, DType::f32, {T, K}),
      counts(*gl.be, DType::i32, {E}), losses(*gl.be, DType::f32, {2}),
      dtw(*gl.be, DType::f32, {T, K}), dw(*gl.be, DType::f32, {E, H});
  dtw.write(random_values(size_t(T * K), 3, -1, 1));
  RouterForwardArgs rf;
  rf.tensors =
      RouterTensors{*x, gl.layer.param(Param::router_weight), *logits, *scores, *idx, *tw, *counts};
  rf.bias = gl.layer.param(Param::router_bias);
  rf.losses = *losses;
  RouterBackwardArgs rb;
  rb.tensors = rf.tensors;
  rb.d_topk_weight = *dtw;
  rb.d_weight = *dw;
  rb.dx = *dx;
  cuda::CapturedGraph router_f(stream, [&] { gl.be->router_forward(rf, s); });
  cuda::CapturedGraph router_b(stream, [&] { gl.be->router_backward(rb, s); });
  const double rf_ms = median_ms(router_f), rb_ms = median_ms(router_b);
  std::printf("[ timing ] router alone: forward %.3f ms, backward %.3f ms\n", rf_ms, rb_ms);
  const double rows = double(T) * m.top_k, flops = 18.0 * rows * H * m.ffn;
  std::printf(
      "[ timing ] Qwen3-sized step (T %lld, H %lld, F %d, E %d, K %d): forward %.3f ms, "
      "forward+backward %.3f ms, expert TFLOP/s %.0f\n",
      (long long)T, (long long)H, m.ffn, m.experts, m.top_k, f_ms, s_ms,
      flops / (s_ms * 1e-3) / 1e12);
  RecordProperty("forward_ms", std::to_string(f_ms));
  RecordProperty("step_ms", std::to_string(s_ms));
  EXPECT_TRUE(all_finite(dx.read()));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(stream);
}

// =================================================================================================
// An eager step never waits on the host
// =================================================================================================

// Eager forward and backward (no capture), with a spill round that may run, enqueue everything
// without waiting on the host: while a host function that waits for a flag holds the stream, both
// calls return (the flag is set only after they did, or after 20 s); the results then equal, bit
// for bit, the same step run with nothing holding the stream.
// Holds `stream` with a host function, runs `enqueue` on another thread and says whether it
// returned while the stream was still held (it waited on the device otherwise); then releases it.
bool returns_while_held(cudaStream_t stream, const std::function<void()>& enqueue) {
  std::atomic<bool> release{false};
  auto hold = [](void* flag) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!static_cast<std::atomic<bool>*>(flag)->load() &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  if (cudaLaunchHostFunc(stream, hold, &release) != cudaSuccess) {
    ADD_FAILURE() << "cudaLaunchHostFunc failed";
    return false;
  }
  auto done = std::async(std::launch::async, enqueue);
  const bool returned = done.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  release = true;
  done.get();
  return returned;
}

TEST(CudaLayerEager, StepNeverWaitsOnHost) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  MoeConfig m;
  m.hidden = 64;
  m.ffn = 48;
  m.experts = 8;
  m.top_k = 2;
  m.max_tokens = 128;
  m.aux_loss_coeff = 0.01;
  EchoConfig echo;
  m.capacity_factor = 0.5;  // 128 receive rows for 256: round 0 and one spill round
  GpuLayer gl(m, echo, 9);
  gl.set(rounded_params(m, 41));
  const int64_t T = m.max_tokens, H = m.hidden;
  StepTensors tensors(*gl.be, T, H, 51, 1.0);
  OwnedTensor &x = tensors.x, &y = tensors.y, &dy = tensors.dy, &dx = tensors.dx;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Stream s = stream;
  auto step = [&] {
    gl.layer.zero_grad(s);
    gl.layer.forward(*x, *y, s);
    gl.layer.backward(*dy, *dx, s);
  };

  poison(y);
  poison(dx);
  step();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(gl.layer.stats().spill_rounds, 1);
  const auto y_ref = y.read(), dx_ref = dx.read();
  const auto dw1_ref = read_tensor(*gl.be, gl.layer.grad(Param::w1));

  poison(y);
  poison(dx);
  EXPECT_TRUE(returns_while_held(stream, step))
      << "forward or backward waited for the held stream (a host sync)";
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(y.read(), y_ref);
  EXPECT_EQ(dx.read(), dx_ref);
  EXPECT_EQ(read_tensor(*gl.be, gl.layer.grad(Param::w1)), dw1_ref);

  // New values in the same tensors (the cached graphs launched again, no capture) and the same
  // values in other tensors (captured anew): the same bits, and not the first step's.
  StepTensors other(*gl.be, T, H, 77, 1.0);
  x.write(other.x.read());
  dy.write(other.dy.read());
  poison(y);
  poison(dx);
  step();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const auto y_cached = y.read(), dx_cached = dx.read();
  const auto dw1_cached = read_tensor(*gl.be, gl.layer.grad(Param::w1));
  EXPECT_NE(y_cached, y_ref);
  poison(other.y);
  poison(other.dx);
  gl.layer.zero_grad(s);
  gl.layer.forward(*other.x, *other.y, s);
  gl.layer.backward(*other.dy, *other.dx, s);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(other.y.read(), y_cached);
  EXPECT_EQ(other.dx.read(), dx_cached);
  EXPECT_EQ(read_tensor(*gl.be, gl.layer.grad(Param::w1)), dw1_cached);
  cudaStreamDestroy(stream);
}

// The layer of the eager split, overlap and micro-batch tests: H = F = `hidden`, 8 experts, top 2,
// `tokens` tokens, aux loss on.
MoeConfig spill_test_moe(int hidden, int tokens) {
  MoeConfig m;
  m.hidden = hidden;
  m.ffn = hidden;
  m.experts = 8;
  m.top_k = 2;
  m.max_tokens = tokens;
  m.aux_loss_coeff = 0.01;
  return m;
}

// Two micro-batches (tokens and output gradients from seeds[k]) one at a time on `stream`:
// outputs, input gradients, and the gradients they accumulate.
struct OneAtATime {
  std::vector<double> y[2], dx[2], dw1, dw2, d_router;
};
OneAtATime one_at_a_time(const MoeConfig& m, const EchoConfig& echo, const GlobalParams& params,
                         const uint64_t (&seeds)[2], cudaStream_t stream) {
  GpuLayer ref(m, echo, 9);
  ref.set(params);
  StepTensors t0(*ref.be, m.max_tokens, m.hidden, seeds[0], 1.0),
      t1(*ref.be, m.max_tokens, m.hidden, seeds[1], 1.0);
  ref.layer.zero_grad(stream);
  ref.layer.forward(*t0.x, *t0.y, stream);
  ref.layer.backward(*t0.dy, *t0.dx, stream);
  ref.layer.forward(*t1.x, *t1.y, stream);
  ref.layer.backward(*t1.dy, *t1.dx, stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  OneAtATime o;
  o.y[0] = t0.y.read(), o.y[1] = t1.y.read();
  o.dx[0] = t0.dx.read(), o.dx[1] = t1.dx.read();
  o.dw1 = read_tensor(*ref.be, ref.layer.grad(Param::w1));
  o.dw2 = read_tensor(*ref.be, ref.layer.grad(Param::w2));
  o.d_router = read_tensor(*ref.be, ref.layer.grad(Param::router_weight));
  return o;
}

// Two micro-batches' outputs and input gradients (t0, t1) and the layer's accumulated gradients
// equal `ref`'s bit for bit.
void expect_one_at_a_time(const OneAtATime& ref, StepTensors& t0, StepTensors& t1, GpuLayer& gl,
                          int pass) {
  EXPECT_EQ(t0.y.read(), ref.y[0]) << "pass " << pass;
  EXPECT_EQ(t1.y.read(), ref.y[1]) << "pass " << pass;
  EXPECT_EQ(t0.dx.read(), ref.dx[0]) << "pass " << pass;
  EXPECT_EQ(t1.dx.read(), ref.dx[1]) << "pass " << pass;
  EXPECT_EQ(read_tensor(*gl.be, gl.layer.grad(Param::w1)), ref.dw1) << "pass " << pass;
  EXPECT_EQ(read_tensor(*gl.be, gl.layer.grad(Param::w2)), ref.dw2) << "pass " << pass;
  EXPECT_EQ(read_tensor(*gl.be, gl.layer.grad(Param::router_weight)), ref.d_router)
      << "pass " << pass;
}

// `step` (two micro-batches) run once to capture its graphs, then twice with the outputs poisoned
// and the step enqueued behind a held stream: it returns first (no host wait), and gives `ref`'s
// bits each time.
void expect_held_passes_give(const OneAtATime& ref, StepTensors& t0, StepTensors& t1, GpuLayer& gl,
                             cudaStream_t stream, const std::function<void()>& step) {
  step();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  for (int pass = 0; pass < 2; ++pass) {
    for (OwnedTensor* t : {&t0.y, &t1.y, &t0.dx, &t1.dx}) poison(*t);
    EXPECT_TRUE(returns_while_held(stream, step))
        << "a step waited for the held stream (a host sync), pass " << pass;
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    expect_one_at_a_time(ref, t0, t1, gl, pass);
  }
}

// One whole step (zero_grad, forward, backward; tokens and output gradients from `seed`) of a
// fresh layer on `stream`: the reference bits of the eager overlap tests, whose layers have one
// spill round unless they have shared experts.
struct StepBits {
  std::vector<double> y, dx, dw1, dw2;
};
StepBits whole_step_bits(const MoeConfig& m, const EchoConfig& echo, const GlobalParams& params,
                         uint64_t seed, cudaStream_t stream) {
  GpuLayer ref(m, echo, 9);
  ref.set(params);
  StepTensors t(*ref.be, m.max_tokens, m.hidden, seed, 1.0);
  ref.layer.zero_grad(stream);
  ref.layer.forward(*t.x, *t.y, stream);
  ref.layer.backward(*t.dy, *t.dx, stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(ref.layer.stats().spill_rounds, m.shared_experts > 0 ? 0 : 1);
  return StepBits{t.y.read(), t.dx.read(), read_tensor(*ref.be, ref.layer.grad(Param::w1)),
                  read_tensor(*ref.be, ref.layer.grad(Param::w2))};
}

// The split-phase calls on the GPU (a graph per phase) and Overlap::wgrad (fc1's weight gradient
// on the side stream beside the combine, on fewer SMs): the bits of the whole step without
// overlap, with a spill round, with the shared experts on the side stream, in fp8; after a first
// step of each kind, enqueued while the stream is held (nothing waits on the host), twice each
// (the second time from cached graphs).
TEST(CudaLayerEager, SplitPhasesAndOverlapGiveTheWholeStepsBitsAndNeverWaitOnHost) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  for (int variant = 0; variant < 5; ++variant) {
    MoeConfig m = spill_test_moe(128, 128);
    EchoConfig echo;
    m.capacity_factor = 0.5;  // round 0 and one spill round
    const char* name = "spill round";
    if (variant == 1 || variant == 3) {
      name = variant == 1 ? "shared experts on the side stream"
                          : "shared experts on the side stream, overlap wgrad";
      m.shared_experts = 1;
      m.shared_ffn = 64;
      m.shared_side_stream = true;
      m.capacity_factor = 1.0;
    } else if (variant == 2 || variant == 4) {
      name = variant == 2 ? "fp8, spill round" : "fp8, spill round, overlap wgrad";
      m.precision = Precision::fp8;
    }
    SCOPED_TRACE(name);
    const GlobalParams params = rounded_params(m, 41);
    const int64_t T = m.max_tokens, H = m.hidden;
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    const Stream s = stream;
    // The whole step without overlap: the reference bits.
    const StepBits ref = whole_step_bits(m, echo, params, 51, stream);
    const std::vector<double>&y_ref = ref.y, &dx_ref = ref.dx, &dw1_ref = ref.dw1;
    if (variant >= 3) {
      m.overlap = Overlap::wgrad;
      m.overlap_sms = 20;
    }
    GpuLayer gl(m, echo, 9);
    gl.set(params);
    StepTensors tensors(*gl.be, T, H, 51, 1.0);
    OwnedTensor &x = tensors.x, &y = tensors.y, &dy = tensors.dy, &dx = tensors.dx;
    const std::function<void()> whole_step = [&] {
      gl.layer.zero_grad(s);
      gl.layer.forward(*x, *y, s);
      gl.layer.backward(*dy, *dx, s);
    };
    const std::function<void()> split_step = [&] {
      gl.layer.zero_grad(s);
      gl.layer.forward_dispatch(*x, *y, s);
      gl.layer.forward_experts(s);
      gl.layer.forward_combine(s);
      gl.layer.backward_dispatch(*dy, *dx, s);
      gl.layer.backward_experts(s);
      gl.layer.backward_combine(s);
    };
    for (int pass = 0; pass < 4; ++pass) {
      if (pass % 2 == 0) {  // a first step of this kind, not held
        (pass < 2 ? whole_step : split_step)();
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      }
      poison(y);
      poison(dx);
      EXPECT_TRUE(returns_while_held(stream, pass < 2 ? whole_step : split_step))
          << "a step waited for the held stream (a host sync), pass " << pass;
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_EQ(y.read(), y_ref) << "pass " << pass;
      EXPECT_EQ(dx.read(), dx_ref) << "pass " << pass;
      EXPECT_EQ(read_tensor(*gl.be, gl.layer.grad(Param::w1)), dw1_ref) << "pass " << pass;
    }
    cudaStreamDestroy(stream);
  }
}

// MoeConfig::chunks on the GPU (one rank: the local communicator): round 0 in 3 chunks, forward
// and backward, each chunk's fan-out and expert GEMMs (dgrads) on the side stream (on all SMs but
// overlap_sms) beside the next chunk's dispatch and the combine of the one before, the weight
// gradients after the chunks: the bits of one chunk, in bf16 with a spill round, with the shared
// experts on the side stream, and in fp8 without the FP8 dispatch, with and without FP8 weight
// gradients (with them the backward runs whole); a token's two experts often fall in different
// chunks. After a first step, enqueued while the stream is held (no host wait), twice (the second
// from the cached graph).
TEST(CudaLayerEager, ChunkedForwardAndBackwardGiveTheBitsOfOneChunkAndNeverWaitOnHost) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  for (int variant = 0; variant < 4; ++variant) {
    MoeConfig m = spill_test_moe(128, 128);
    EchoConfig echo;
    m.capacity_factor = 0.5;  // round 0 and one spill round
    const char* name = "spill round";
    if (variant == 1) {
      name = "shared experts on the side stream";
      m.shared_experts = 1;
      m.shared_ffn = 64;
      m.shared_side_stream = true;
      m.capacity_factor = 1.0;
    } else if (variant == 2) {
      name = "fp8 without the FP8 dispatch, spill round";
      m.precision = Precision::fp8;
      m.fp8_gemms = fp8_gemm::all & ~fp8_gemm::fprop1;
    } else if (variant == 3) {
      name = "fp8 fprop2 and dgrads, spill round";
      m.precision = Precision::fp8;
      m.fp8_gemms = fp8_gemm::fprop2 | fp8_gemm::dgrad1 | fp8_gemm::dgrad2;
    }
    SCOPED_TRACE(name);
    const GlobalParams params = rounded_params(m, 43);
    const int64_t T = m.max_tokens, H = m.hidden;
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    const Stream s = stream;
    const StepBits ref = whole_step_bits(m, echo, params, 53, stream);
    const std::vector<double>&y_ref = ref.y, &dx_ref = ref.dx, &dw1_ref = ref.dw1,
          &dw2_ref = ref.dw2;
    m.chunks = 3;
    m.overlap_sms = 20;
    GpuLayer gl(m, echo, 9);
    gl.set(params);
    StepTensors tensors(*gl.be, T, H, 53, 1.0);
    OwnedTensor &x = tensors.x, &y = tensors.y, &dy = tensors.dy, &dx = tensors.dx;
    const std::function<void()> step = [&] {
      gl.layer.zero_grad(s);
      gl.layer.forward(*x, *y, s);
      gl.layer.backward(*dy, *dx, s);
    };
    step();
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (int pass = 0; pass < 2; ++pass) {
      poison(y);
      poison(dx);
      EXPECT_TRUE(returns_while_held(stream, step))
          << "a step waited for the held stream (a host sync), pass " << pass;
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_EQ(y.read(), y_ref) << "pass " << pass;
      EXPECT_EQ(dx.read(), dx_ref) << "pass " << pass;
      EXPECT_EQ(read_tensor(*gl.be, gl.layer.grad(Param::w1)), dw1_ref) << "pass " << pass;
      EXPECT_EQ(read_tensor(*gl.be, gl.layer.grad(Param::w2)), dw2_ref) << "pass " << pass;
    }
    cudaStreamDestroy(stream);
  }
}

// Two micro-batches in flight (MoeConfig::in_flight 2), micro-batch 1's forward phases
// interleaved with micro-batch 0's backward phases on one stream (a combined 1F1B step): the
// outputs, input gradients and weight gradients of one micro-batch at a time, bit for bit, in
// bf16 and fp8 with a spill round (fp8 with overlap wgrad), and with shared experts on the side
// stream; a held step enqueues without waiting on the host.
TEST(CudaLayerEager, MicroBatchesInFlightInterleavedGiveTheBitsOfOneAtATime) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  for (int variant = 0; variant < 3; ++variant) {
    MoeConfig m = spill_test_moe(128, 128);
    EchoConfig echo;
    m.capacity_factor = 0.5;  // round 0 and one spill round
    const char* name = "bf16, spill round";
    if (variant == 1) {
      name = "fp8, spill round, overlap wgrad";
      m.precision = Precision::fp8;
      m.overlap = Overlap::wgrad;
      m.overlap_sms = 20;
    } else if (variant == 2) {
      name = "shared experts on the side stream";
      m.shared_experts = 1;
      m.shared_ffn = 64;
      m.shared_side_stream = true;
      m.capacity_factor = 1.0;
    }
    SCOPED_TRACE(name);
    const GlobalParams params = rounded_params(m, 43);
    const int64_t T = m.max_tokens, H = m.hidden;
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    const Stream s = stream;
    const OneAtATime ref = one_at_a_time(m, echo, params, {71, 81}, stream);
    m.in_flight = 2;
    GpuLayer gl(m, echo, 9);
    gl.set(params);
    StepTensors t0(*gl.be, T, H, 71, 1.0), t1(*gl.be, T, H, 81, 1.0);
    const std::function<void()> step = [&] {
      MoeLayer& l = gl.layer;
      l.zero_grad(s);
      l.forward(*t0.x, *t0.y, s, 0);
      l.forward_dispatch(*t1.x, *t1.y, s, 1);
      l.backward_dispatch(*t0.dy, *t0.dx, s, 0);
      l.forward_experts(s, 1);
      l.backward_experts(s, 0);
      l.forward_combine(s, 1);
      l.backward_combine(s, 0);
      l.backward(*t1.dy, *t1.dx, s, 1);
    };
    expect_held_passes_give(ref, t0, t1, gl, stream, step);
    EXPECT_EQ(gl.layer.stats(0).spill_rounds, m.shared_experts > 0 ? 0 : 1);
    cudaStreamDestroy(stream);
  }
}

// EchoConfig::placement = step on one rank, where no clone can be placed: the step's first
// forward plans on the device and keeps the plan, the second splits its rows over it
// (plan_placed), the first backward holds its clone gradients and the second reduces them. The
// bits of a placement per micro-batch, in bf16 and fp8 with a spill round, the forwards
// pipelined, enqueued while the stream is held, with weights_changed (a new placement) each step.
TEST(CudaLayerEager, StepPlacementGivesTheBitsOfAPlacementPerMicroBatch) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  for (bool fp8 : {false, true}) {
    MoeConfig m = spill_test_moe(128, 128);
    if (fp8) m.precision = Precision::fp8;
    EchoConfig echo;
    m.capacity_factor = 0.5;  // round 0 and one spill round
    SCOPED_TRACE(fp8 ? "fp8, spill round" : "bf16, spill round");
    const GlobalParams params = rounded_params(m, 45);
    const int64_t T = m.max_tokens, H = m.hidden;
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    const Stream s = stream;
    const OneAtATime ref = one_at_a_time(m, echo, params, {73, 83}, stream);
    m.in_flight = 2;
    echo.placement = EchoPlacement::step;
    GpuLayer gl(m, echo, 9);
    gl.set(params);
    StepTensors t0(*gl.be, T, H, 73, 1.0), t1(*gl.be, T, H, 83, 1.0);
    const std::function<void()> step = [&] {
      MoeLayer& l = gl.layer;
      l.weights_changed();  // a new step: a new placement
      l.zero_grad(s);
      l.hold_clone_grads(true);
      l.forward(*t0.x, *t0.y, s, 0);
      l.forward(*t1.x, *t1.y, s, 1);
      l.backward(*t0.dy, *t0.dx, s, 0);
      l.hold_clone_grads(false);
      l.backward(*t1.dy, *t1.dx, s, 1);
    };
    expect_held_passes_give(ref, t0, t1, gl, stream, step);
    EXPECT_FALSE(gl.layer.stats(0).placement_kept);
    EXPECT_TRUE(gl.layer.stats(1).placement_kept);
    EXPECT_EQ(gl.layer.stats(1).spill_rounds, 1);
    EXPECT_FALSE(gl.layer.clone_grads_held());
    cudaStreamDestroy(stream);
  }
}

// The same two micro-batches with their phases on two streams at once, ordered by events only:
// dispatch and combine phases on stream A, experts phases on stream B, so micro-batch 1's expert
// GEMMs run beside micro-batch 0's backward dispatch (each micro-batch on its own backend lane:
// GEMM arguments, scratch, side stream). The bits of one micro-batch at a time, three times over.
TEST(CudaLayerEager, MicroBatchesOnTwoStreamsGiveTheBitsOfOneAtATime) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  for (int variant = 0; variant < 2; ++variant) {
    MoeConfig m = spill_test_moe(256, 512);
    EchoConfig echo;
    m.capacity_factor = 0.5;  // round 0 and one spill round
    if (variant == 1) {
      m.precision = Precision::fp8;
      m.shared_experts = 1;
      m.shared_ffn = 128;
      m.shared_side_stream = true;
    }
    SCOPED_TRACE(variant == 0 ? "bf16, spill round" : "fp8, spill round, shared experts beside");
    const GlobalParams params = rounded_params(m, 47);
    const int64_t T = m.max_tokens, H = m.hidden;
    cudaStream_t a, b;
    ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
    const OneAtATime ref = one_at_a_time(m, echo, params, {91, 93}, a);
    m.in_flight = 2;
    GpuLayer gl(m, echo, 9);
    gl.set(params);
    StepTensors t0(*gl.be, T, H, 91, 1.0), t1(*gl.be, T, H, 93, 1.0);
    cudaEvent_t ev[4];
    for (cudaEvent_t& e : ev)
      ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
    auto after = [&](cudaStream_t waiter, cudaStream_t on, cudaEvent_t e) {
      ASSERT_EQ(cudaEventRecord(e, on), cudaSuccess);
      ASSERT_EQ(cudaStreamWaitEvent(waiter, e, 0), cudaSuccess);
    };
    for (int pass = 0; pass < 3; ++pass) {
      for (OwnedTensor* t : {&t0.y, &t1.y, &t0.dx, &t1.dx}) poison(*t);
      MoeLayer& l = gl.layer;
      l.zero_grad(a);
      l.forward(*t0.x, *t0.y, a, 0);
      l.forward_dispatch(*t1.x, *t1.y, a, 1);
      after(b, a, ev[0]);  // micro-batch 1's rows are in
      l.backward_dispatch(*t0.dy, *t0.dx, a, 0);
      l.forward_experts(b, 1);  // beside micro-batch 0's backward dispatch
      after(b, a, ev[1]);
      l.backward_experts(b, 0);
      after(a, b, ev[2]);
      l.forward_combine(a, 1);
      l.backward_combine(a, 0);
      l.backward(*t1.dy, *t1.dx, a, 1);
      ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
      expect_one_at_a_time(ref, t0, t1, gl, pass);
    }
    for (cudaEvent_t e : ev) cudaEventDestroy(e);
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
  }
}

}  // namespace
}  // namespace moe_echo::test
