// The router alone on one GPU, forward + backward, plain top-k against the routing rules of real
// models at DeepSeek-V3's shape (E 256, top-8, H 7168, 8192 tokens): group-limited top-k (8
// groups, top 4, by the sum of each group's top-2 keys or by its max), the routed scaling factor,
// and the sequence aux loss. Target: group-limited forward + backward at most 1.2x plain top-k.
//
// Correctness first: on the first --check tokens every config's routes equal the CPU reference's
// (same bf16 tokens, same f32 weight; at most 1% of the tokens may differ, where random tokens put
// two keys within f32 rounding: the GPU tests check exact equality on clear margins) and its
// combine weights agree by relative norm (1e-5); then forward and backward are timed with CUDA
// events (warm-up, median of --iters). Exit status 1 when a check fails.
//
// usage: router_bench [--out results.json] [--iters N] [--warmup N] [--tokens T] [--check N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moe_echo/backends.hpp"
#include "moe_echo/cuda.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/presets.hpp"
#include "moe_echo/random.hpp"

using namespace moe_echo;

namespace {

#define CHECK_CUDA(x)                                                     \
  do {                                                                    \
    cudaError_t e = (x);                                                  \
    if (e != cudaSuccess) {                                               \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e)); \
      std::exit(1);                                                       \
    }                                                                     \
  } while (0)

struct Config {
  std::string name;
  RouterConfig router;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The router's tensors of T tokens on one backend.
struct Rig {
  Backend& be;
  std::vector<void*> owned;
  Tensor x, w, bias, logits, scores, idx, weight, counts, losses, d_weight, dw, dx;
  Rig(Backend& backend, int64_t T, int64_t H, int64_t E, int64_t K) : be(backend) {
    const DType act = be.activation_dtype(), fl = be.float_dtype();
    x = make(act, {T, H});
    w = make(fl, {E, H});
    bias = make(fl, {E});
    logits = make(fl, {T, E});
    scores = make(fl, {T, E});
    idx = make(DType::i32, {T, K});
    weight = make(fl, {T, K});
    counts = make(DType::i32, {E});
    losses = make(fl, {3});
    d_weight = make(fl, {T, K});
    dw = make(fl, {E, H});
    dx = make(act, {T, H});
  }
  ~Rig() {
    for (void* p : owned) be.deallocate(p);
  }
  Tensor make(DType t, std::initializer_list<int64_t> dims) {
    Tensor v(nullptr, t, dims);
    v.data = be.allocate(v.bytes());
    owned.push_back(v.data);
    return v;
  }
  RouterForwardArgs forward(const RouterConfig& c) const {
    RouterForwardArgs a;
    a.tensors = RouterTensors{x, w, logits, scores, idx, weight, counts};
    a.bias = bias;
    a.losses = losses;
    a.config = c;
    return a;
  }
  RouterBackwardArgs backward(const RouterConfig& c) const {
    RouterBackwardArgs a;
    a.tensors = RouterTensors{x, w, logits, scores, idx, weight, counts};
    a.d_topk_weight = d_weight;
    a.d_weight = dw;
    a.dx = dx;
    a.config = c;
    return a;
  }
};

std::vector<double> random_rounded(size_t n, uint64_t seed, double scale, bool bf16) {
  Rng r(seed, 0);
  std::vector<double> v(n);
  for (double& d : v) {
    d = r.uniform(-scale, scale);
    if (bf16) {  // round to nearest bf16 through its f32 bits
      float f = float(d);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
      std::memcpy(&f, &u, 4);
      d = f;
    } else {
      d = double(float(d));
    }
  }
  return v;
}

double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace

int run(int argc, char** argv) {
  std::string out = "router_bench.json";
  int iters = 50, warmup = 10, tokens = kDeepSeekV3.tokens, check = 256;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--out")
      out = v;
    else if (a == "--iters")
      iters = std::stoi(v);
    else if (a == "--warmup")
      warmup = std::stoi(v);
    else if (a == "--tokens")
      tokens = std::stoi(v);
    else if (a == "--check")
      check = std::stoi(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  check_output_path("out", out);  // before any GPU time
  const ModelPreset& p = kDeepSeekV3;
  const int64_t T = tokens, H = p.hidden, E = p.experts, K = p.top_k;
  auto grouped = [&](GroupScore rule, double scale, double seq) {
    RouterConfig c{p.score, true, 1e-4, 0.0};
    c.expert_groups = p.expert_groups;
    c.topk_groups = p.topk_groups;
    c.group_score = rule;
    c.routed_scaling_factor = scale;
    c.seq_aux_loss_coeff = seq;
    c.seq_len = seq > 0 ? 4096 : 0;
    return c;
  };
  const std::vector<Config> configs = {
      {"plain_topk", RouterConfig{p.score, true, 1e-4, 0.0}},
      {"groups_top2_sum", grouped(GroupScore::top2_sum, 1.0, 0.0)},
      {"groups_max", grouped(GroupScore::max, 1.0, 0.0)},
      {"deepseek_v3", grouped(GroupScore::top2_sum, p.routed_scaling_factor, 0.0)},
      {"deepseek_v3_seq_aux", grouped(GroupScore::top2_sum, p.routed_scaling_factor, 1e-4)},
  };

  auto gpu = make_backend("cuda");
  auto cpu = make_cpu_backend(DType::f32);
  Rig g(*gpu, T, H, E, K);
  const int64_t C = std::min<int64_t>(check, T);
  Rig c(*cpu, C, H, E, K);
  // Tokens and weights as in a trained layer's range; a bias of the aux-loss-free size.
  const auto x = random_rounded(size_t(T * H), 1, 1.0, true);
  const auto w = random_rounded(size_t(E * H), 2, 1.0 / std::sqrt(double(H)), false);
  const auto b = random_rounded(size_t(E), 3, 1e-3, false);
  const auto dw = random_rounded(size_t(T * K), 4, 1.0, false);
  write_tensor(*gpu, g.x, x);
  write_tensor(*gpu, g.w, w);
  write_tensor(*gpu, g.bias, b);
  write_tensor(*gpu, g.d_weight, dw);
  write_tensor(*cpu, c.x, std::vector<double>(x.begin(), x.begin() + C * H));
  write_tensor(*cpu, c.w, w);
  write_tensor(*cpu, c.bias, b);

  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1, e2;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  CHECK_CUDA(cudaEventCreate(&e2));
  nlohmann::json results = nlohmann::json::array();
  std::printf("router_bench: %s, E %lld, top-%lld, H %lld, T %lld (checked on %lld tokens)\n",
              prop.name, (long long)E, (long long)K, (long long)H, (long long)T, (long long)C);
  std::printf("%-22s %8s %8s %8s %9s %10s %10s\n", "config", "fwd_ms", "bwd_ms", "total",
              "vs plain", "routes", "weights");
  double plain_ms = 0;
  int failures = 0;
  for (const Config& cfg : configs) {
    // Correctness: the first C tokens alone on both backends.
    RouterForwardArgs gf = g.forward(cfg.router);
    gf.tensors.x = g.x.rows(0, C);
    gf.tensors.logits = g.logits.rows(0, C);
    gf.tensors.scores = g.scores.rows(0, C);
    gf.tensors.topk_idx = g.idx.rows(0, C);
    gf.tensors.topk_weight = g.weight.rows(0, C);
    gpu->router_forward(gf, s);
    cpu->router_forward(c.forward(cfg.router), nullptr);
    CHECK_CUDA(cudaStreamSynchronize(s));
    const auto gi = read_tensor(*gpu, gf.tensors.topk_idx), ci = read_tensor(*cpu, c.idx);
    const auto gw = read_tensor(*gpu, gf.tensors.topk_weight), cw = read_tensor(*cpu, c.weight);
    // Tokens routed differently, and the weights of the others. (Random tokens may put two keys
    // within the f32 rounding of the logits, where the backends may differ; the GPU tests draw
    // tokens with clear margins and require every route equal.)
    int64_t differ = 0;
    std::vector<double> gw_same, cw_same;
    for (int64_t t = 0; t < C; ++t) {
      const bool same =
          std::equal(gi.begin() + t * K, gi.begin() + (t + 1) * K, ci.begin() + t * K);
      differ += !same;
      if (same) {
        gw_same.insert(gw_same.end(), gw.begin() + t * K, gw.begin() + (t + 1) * K);
        cw_same.insert(cw_same.end(), cw.begin() + t * K, cw.begin() + (t + 1) * K);
      }
    }
    const double werr = rel_error(gw_same, cw_same);
    const bool ok = differ * 100 <= C && werr < 1e-5;
    failures += !ok;

    // Timing: forward, then backward on its outputs, each between events.
    std::vector<double> f_ms, b_ms;
    for (int i = 0; i < warmup + iters; ++i) {
      CHECK_CUDA(cudaEventRecord(e0, s));
      gpu->router_forward(g.forward(cfg.router), s);
      CHECK_CUDA(cudaEventRecord(e1, s));
      gpu->router_backward(g.backward(cfg.router), s);
      CHECK_CUDA(cudaEventRecord(e2, s));
      CHECK_CUDA(cudaEventSynchronize(e2));
      float a = 0, bb = 0;
      CHECK_CUDA(cudaEventElapsedTime(&a, e0, e1));
      CHECK_CUDA(cudaEventElapsedTime(&bb, e1, e2));
      if (i >= warmup) {
        f_ms.push_back(a);
        b_ms.push_back(bb);
      }
    }
    const double fwd = median(f_ms), bwd = median(b_ms), total = fwd + bwd;
    if (cfg.name == "plain_topk") plain_ms = total;
    const double ratio = plain_ms > 0 ? total / plain_ms : 0;
    std::printf("%-22s %8.3f %8.3f %8.3f %8.3fx %10s %10.1e\n", cfg.name.c_str(), fwd, bwd, total,
                ratio, (std::to_string(differ) + " differ").c_str(), werr);
    results.push_back({{"config", cfg.name},
                       {"expert_groups", cfg.router.expert_groups},
                       {"topk_groups", cfg.router.topk_groups},
                       {"group_score", to_string(cfg.router.group_score)},
                       {"routed_scaling_factor", cfg.router.routed_scaling_factor},
                       {"seq_aux_loss_coeff", cfg.router.seq_aux_loss_coeff},
                       {"seq_len", cfg.router.seq_len},
                       {"fwd_ms", fwd},
                       {"bwd_ms", bwd},
                       {"fwd_bwd_ms", total},
                       {"over_plain", ratio},
                       {"checked_tokens", C},
                       {"tokens_routed_differently", differ},
                       {"weights_rel_error", werr},
                       {"correct", ok}});
  }
  const nlohmann::json doc = {{"device", prop.name},
                              {"what", "router forward + backward, CUDA events, median"},
                              {"experts", E},
                              {"top_k", K},
                              {"hidden", H},
                              {"tokens", T},
                              {"iters", iters},
                              {"warmup", warmup},
                              {"target_over_plain", 1.2},
                              {"results", results}};
  write_file(out, doc.dump(2) + "\n");
  CHECK_CUDA(cudaStreamDestroy(s));
  return failures == 0 ? 0 : 1;
}

// A results file that cannot be written, or any other failure: its message on stderr and exit
// code 1 (2 for an invalid --out, before the run).
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const moe_echo::ConfigError& e) {
    std::fprintf(stderr, "%s: error: %s\n", "router_bench", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", "router_bench", e.what());
    return 1;
  }
}
