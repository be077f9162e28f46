// The whole MoE layer on one GPU, forward + backward captured in one CUDA graph, at the shapes of
// ANCHORS.md's plain PyTorch layer (8192 tokens, router fp32 softmax top-k). Writes the tokens,
// router weight and upstream gradient of every case to --dump so bench/torch_moe_layer.py runs
// the PyTorch layer on exactly the same routing; for cases with small experts it also writes the
// expert weights and our outputs, and the script checks them numerically before timing.
//
// With --shared 1 each config also runs with its model's shared experts (DeepSeek-V3: one, of
// size F; configs without one get one, to time it), on the step's stream and on the side stream,
// and the table gives the step time over the same layer without them (target: at most 1.1x).
//
// usage: layer_bench --dump DIR --out results.json [--iters N] [--warmup N] [--config NAME[,NAME]]
//                    [--shared 1]
//        layer_bench --profile 1 [--config NAME]   (one uniform-routing step of each config, for
//                                                   a kernel profiler: no timing, no dump)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moe_echo/backends.hpp"
#include "moe_echo/cuda.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/layer.hpp"
#include "moe_echo/presets.hpp"
#include "moe_echo/random.hpp"
#include "moe_echo/synthetic.hpp"

using namespace moe_echo;

namespace {

struct Case {
  std::string name;
  int experts, top_k, hidden, ffn;
  bool dump_weights;       // experts small enough to hand to the PyTorch script for a numeric check
  int shared_experts = 0;  // with --shared 1: the model's, at least one
  bool side_stream = false;  // the shared experts on the backend's side stream
};

// `experts` experts of a model's layer on one GPU.
Case slice(const ModelPreset& p, int experts, bool dump_weights) {
  return {std::string(p.name),          experts, p.top_k, p.hidden, p.ffn, dump_weights,
          std::max(1, p.shared_experts)};
}

#define CHECK_CUDA(x)                                                     \
  do {                                                                    \
    cudaError_t e = (x);                                                  \
    if (e != cudaSuccess) {                                               \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e)); \
      std::exit(1);                                                       \
    }                                                                     \
  } while (0)

void dump(Backend& be, const Tensor& t, const std::string& path) {
  std::vector<char> host(t.bytes());
  be.synchronize();
  be.copy_to_host(host.data(), t.data, host.size());
  write_file(path, std::string_view(host.data(), host.size()));  // FileError names the path
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int run(int argc, char** argv) {
  std::string dump_dir = "/tmp/moe_echo_layer", out = "layer_bench.json", only;
  int iters = 20, warmup = 5, tokens = 8192;
  bool profile = false, shared = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--dump")
      dump_dir = v;
    else if (a == "--out")
      out = v;
    else if (a == "--iters")
      iters = std::stoi(v);
    else if (a == "--warmup")
      warmup = std::stoi(v);
    else if (a == "--config")
      only = v;
    else if (a == "--tokens")
      tokens = std::stoi(v);
    else if (a == "--profile")
      profile = std::stoi(v) != 0;
    else if (a == "--shared")
      shared = std::stoi(v) != 0;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  // Before any GPU time: the folder every case dumps into, and the results file.
  check_output_dir("dump", dump_dir);
  if (!profile) check_output_path("out", out);
  const std::vector<Case> cases = {
      slice(kQwen3_30B_A3B, 16, true),
      slice(kDeepSeekV3, 32, false),
      slice(kMixtral8x7B, 8, false),
  };
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  nlohmann::json results = nlohmann::json::array();
  std::printf("%-14s %-9s %6s %5s %10s %10s %12s %9s\n", "config", "skew", "shared", "side",
              "fwd_ms", "fwd+bwd_ms", "expert TF/s", "vs plain");
  std::vector<Case> runs;
  for (const Case& c : cases) {
    Case plain = c;
    plain.shared_experts = 0;
    runs.push_back(plain);
    if (shared && !profile) {
      Case with = c;
      with.dump_weights = false;
      runs.push_back(with);
      with.side_stream = true;
      runs.push_back(with);
    }
  }
  std::map<std::string, double> plain_ms;  // config + skew: step time without shared experts
  for (const Case& c : runs) {
    if (!only.empty() && ("," + only + ",").find("," + c.name + ",") == std::string::npos) continue;
    // One layer per config (its expert weights take a while to draw on the host); each skew
    // writes its own router weight and tokens.
    auto be = make_backend("cuda");
    auto comm = cuda::make_local_communicator();
    MoeConfig m;
    m.hidden = c.hidden;
    m.ffn = c.ffn;
    m.experts = c.experts;
    m.top_k = c.top_k;
    m.max_tokens = tokens;
    m.shared_experts = c.shared_experts;
    m.shared_side_stream = c.side_stream;
    EchoConfig echo;
    echo.enabled = false;     // one GPU: nothing to balance
    m.capacity_factor = 1.0;  // one rank receives exactly T * K rows
    MoeLayer layer(*be, *comm, m, ParallelConfig{1, 0}, echo, 1, /*optimizer_state=*/false);
    for (const std::string skew_name : {"uniform", "zipf:1.2"}) {
      if (profile && skew_name != "uniform") continue;
      SkewSpec skew = parse_skew(skew_name);
      skew.drift = 0;
      SyntheticTokens synth(c.experts, c.hidden, skew, 7);
      write_tensor(*be, layer.param(Param::router_weight), synth.router_weight());
      auto alloc = [&](DType t, std::initializer_list<int64_t> dims) {
        Tensor x(nullptr, t, dims);
        x.data = be->allocate(x.bytes());
        return x;
      };
      const int64_t T = tokens, H = c.hidden;
      Tensor x = alloc(DType::bf16, {T, H}), y = alloc(DType::bf16, {T, H}),
             dy = alloc(DType::bf16, {T, H}), dx = alloc(DType::bf16, {T, H});
      write_tensor(*be, x, synth.tokens(0, 0, int(T)));
      std::vector<double> g(size_t(T * H));
      Rng rng(11, 0);
      for (auto& v : g) v = rng.normal() * 1e-2;
      write_tensor(*be, dy, g);

      cudaStream_t s;
      CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      cuda::CapturedGraph step(s, [&] {
        layer.zero_grad(s);
        layer.forward(x, y, s);
        layer.backward(dy, dx, s);
      });
      if (profile) {  // one step, for a profiler that times every kernel of it
        step.launch(s);
        CHECK_CUDA(cudaStreamSynchronize(s));
        std::printf("%-14s profiled one step (%zu graph nodes)\n", c.name.c_str(),
                    step.top_level_nodes());
        CHECK_CUDA(cudaStreamDestroy(s));
        for (Tensor* t : {&x, &y, &dy, &dx}) be->deallocate(t->data);
        continue;
      }
      cuda::CapturedGraph fwd(s, [&] { layer.forward(x, y, s); });
      cudaEvent_t e0, e1;
      CHECK_CUDA(cudaEventCreate(&e0));
      CHECK_CUDA(cudaEventCreate(&e1));
      auto time = [&](cuda::CapturedGraph& gr) {
        for (int i = 0; i < warmup; ++i) gr.launch(s);
        std::vector<double> ms;
        for (int i = 0; i < iters; ++i) {
          CHECK_CUDA(cudaEventRecord(e0, s));
          gr.launch(s);
          CHECK_CUDA(cudaEventRecord(e1, s));
          CHECK_CUDA(cudaEventSynchronize(e1));
          float t = 0;
          CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
          ms.push_back(t);
        }
        return median(ms);
      };
      const double step_ms = time(step), fwd_ms = time(fwd);
      step.launch(s);  // leave y, dx of a full step for the dump
      CHECK_CUDA(cudaStreamSynchronize(s));
      const StepStats st = layer.stats();
      const double flops = 3.0 * 6.0 * double(T) * c.top_k * c.hidden * c.ffn;
      const std::string tag = c.name + "_" + (skew_name == "uniform" ? "uniform" : "zipf1.2") +
                              (c.shared_experts > 0 ? "_shared" : "") +
                              (c.side_stream ? "_side" : "");
      const std::string base = dump_dir + "/" + tag;
      dump(*be, x, base + "_x.bin");
      dump(*be, dy, base + "_dy.bin");
      dump(*be, layer.param(Param::router_weight), base + "_router.bin");
      if (c.dump_weights) {
        dump(*be, layer.param(Param::w1), base + "_w1.bin");
        dump(*be, layer.param(Param::w2), base + "_w2.bin");
        dump(*be, y, base + "_y.bin");
        dump(*be, dx, base + "_dx.bin");
      }
      if (c.shared_experts == 0) plain_ms[c.name + skew_name] = step_ms;
      const double over_plain =
          plain_ms.count(c.name + skew_name) ? step_ms / plain_ms[c.name + skew_name] : 0.0;
      std::printf("%-14s %-9s %6d %5s %10.3f %10.3f %12.1f %8.3fx\n", c.name.c_str(),
                  skew_name.c_str(), c.shared_experts, c.side_stream ? "on" : "off", fwd_ms,
                  step_ms, flops / (step_ms * 1e-3) / 1e12, over_plain);
      results.push_back({{"config", c.name},
                         {"skew", skew_name},
                         {"tag", tag},
                         {"experts", c.experts},
                         {"top_k", c.top_k},
                         {"hidden", c.hidden},
                         {"ffn", c.ffn},
                         {"shared_experts", c.shared_experts},
                         {"shared_side_stream", c.side_stream},
                         {"over_no_shared", over_plain},
                         {"tokens", T},
                         {"fwd_ms", fwd_ms},
                         {"fwd_bwd_ms", step_ms},
                         {"expert_tflops", flops / (step_ms * 1e-3) / 1e12},
                         {"aux_loss", st.aux_loss},
                         {"dumped_weights", c.dump_weights},
                         {"graph_nodes", step.top_level_nodes()}});
      CHECK_CUDA(cudaEventDestroy(e0));
      CHECK_CUDA(cudaEventDestroy(e1));
      CHECK_CUDA(cudaStreamDestroy(s));
      for (Tensor* t : {&x, &y, &dy, &dx}) be->deallocate(t->data);
    }
  }
  if (profile) return 0;
  nlohmann::json doc = {{"device", prop.name},
                        {"kernel", "moe_echo MoeLayer (CUDA graph)"},
                        {"iters", iters},
                        {"warmup", warmup},
                        {"results", results}};
  write_file(out, doc.dump(2) + "\n");
  return 0;
}

// A file that cannot be written (a --dump folder or --out path that does not exist) or any other
// failure: its message on stderr and exit code 1 (2 for an invalid --dump or --out, before the
// run).
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const moe_echo::ConfigError& e) {
    std::fprintf(stderr, "layer_bench: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "layer_bench: error: %s\n", e.what());
    return 1;
  }
}
