// Two micro-batches of one layer on one GPU (MoeConfig::in_flight 2), three ways, each timed from
// the first call to the last on stream A (events, median of --iters after --warmup):
// - one at a time: forward 0, backward 0, forward 1, backward 1 on stream A (in_flight 1);
// - interleaved on one stream: micro-batch 1's forward phases between micro-batch 0's backward
//   phases (a combined 1F1B step), all on stream A;
// - on two streams: the same calls, dispatch and combine phases on stream A, experts phases on
//   stream B, ordered by events only, so one micro-batch's expert GEMMs run beside the other's
//   dispatch or combine (each micro-batch on its own backend lane);
// - one clone placement for the step: one at a time with EchoConfig::placement = step, the
//   first backward holding its clone gradients, so the clones are pulled and their gradients
//   reduced once for both micro-batches.
// Each iteration is a new step (weights_changed first, as after an optimizer step: in fp8 the
// home weights are quantized again, and the step placement plans anew).
// The first three modes' outputs and gradients are checked equal to one at a time, bit for bit,
// before timing; the fourth's first micro-batch (its placement is micro-batch 0's own; micro-batch
// 1's rows are split over it, so its sums may round differently with clones). Tokens are drawn with
// Zipf-skewed routing (exponent 1.2) at the model slices of layer_bench (the slice's experts per
// rank). Under `moe-echo launch -n R` (a CUDA + NCCL build) the layer runs with expert parallelism
// over the R GPUs on the sync-free NCCL communicator (ECHO on); each iteration starts after a host
// barrier and counts the slowest rank.
//
// usage: [moe-echo launch -n R --] micro_batch_bench --out results.json [--iters N] [--warmup N]
//                          [--tokens T] [--config NAME[,NAME]] [--precision bf16|fp8]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moe_echo/backends.hpp"
#include "moe_echo/cuda.hpp"
#include "moe_echo/dist.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/layer.hpp"
#include "moe_echo/presets.hpp"
#include "moe_echo/random.hpp"
#include "moe_echo/synthetic.hpp"
#ifdef MOE_ECHO_WITH_NCCL
#include "moe_echo/nccl.hpp"
#endif

using namespace moe_echo;

namespace {

#define CHECK_CUDA(x)                                                        \
  do {                                                                       \
    cudaError_t err_ = (x);                                                  \
    if (err_ != cudaSuccess) {                                               \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(err_)); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

// FNV-1a over a tensor's bytes (copied to the host in chunks): equal digests for equal bits.
uint64_t digest(Backend& be, const Tensor& t, uint64_t h = 1469598103934665603ull) {
  const size_t chunk = size_t(64) << 20;
  std::vector<uint64_t> host(chunk / 8);
  const char* src = static_cast<const char*>(t.data);
  for (size_t off = 0; off < t.bytes(); off += chunk) {
    const size_t n = std::min(chunk, t.bytes() - off);
    be.copy_to_host(host.data(), src + off, n);
    for (size_t i = 0; i < n / 8; ++i) h = (h ^ host[i]) * 1099511628211ull;
  }
  return h;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Slice {
  const ModelPreset* model;
  int experts;
};

// The tensors of two micro-batches.
struct MicroBatches {
  Tensor x[2], y[2], dy[2], dx[2];
};

}  // namespace

int run(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string out = "micro_batch_bench.json", only, precision = "bf16";
  int iters = 20, warmup = 5, tokens = 8192;
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
    else if (a == "--config")
      only = v;
    else if (a == "--precision")
      precision = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  check_output_path("out", out);  // before any GPU time
  if (precision != "bf16" && precision != "fp8") {
    std::fprintf(stderr, "--precision %s is invalid: allowed bf16 or fp8\n", precision.c_str());
    return 2;
  }
  const DistEnv env = DistEnv::from_env();
  const int R = env.world_size, rank = env.rank;
  std::unique_ptr<Backend> be;  // destroyed after the communicator
  std::unique_ptr<Rendezvous> rv;
  std::unique_ptr<Communicator> comm;
  if (R > 1) {
#ifdef MOE_ECHO_WITH_NCCL
    select_device(env);
    be = make_backend("cuda");
    rv = std::make_unique<Rendezvous>(env);
    comm = make_nccl_communicator(*rv);
#else
    std::fprintf(stderr, "WORLD_SIZE = %d needs a build with NCCL\n", R);
    return 2;
#endif
  } else {
    be = make_backend("cuda");
    comm = cuda::make_local_communicator();
  }
  // The slowest rank's value of each entry.
  auto max_over_ranks = [&](std::vector<double> v) {
    if (!rv) return v;
    Bytes mine(v.size() * sizeof(double));
    std::memcpy(mine.data(), v.data(), mine.size());
    for (const Bytes& peer : rv->all_gather_bytes(mine))
      for (size_t i = 0; i < v.size(); ++i) {
        double x = 0;
        std::memcpy(&x, peer.data() + i * sizeof(double), sizeof x);
        v[i] = std::max(v[i], x);
      }
    return v;
  };
  const std::vector<Slice> slices = {{&kQwen3_30B_A3B, 16}, {&kDeepSeekV3, 32}, {&kMixtral8x7B, 8}};
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  nlohmann::json results = nlohmann::json::array();
  if (rank == 0)
    std::printf("%-14s %-9s %14s %14s %14s %10s %14s\n", "config", "precision", "one_at_a_time",
                "interleaved", "two_streams", "speedup", "step_placement");
  int matched = 0;
  for (const Slice& sl : slices) {
    const std::string name(sl.model->name);
    if (!only.empty() && only.find(name) == std::string::npos) continue;
    ++matched;
    MoeConfig m;
    m.hidden = sl.model->hidden;
    m.ffn = sl.model->ffn;
    m.experts = sl.experts * R;
    m.top_k = sl.model->top_k;
    m.max_tokens = tokens;
    m.precision = precision == "fp8" ? Precision::fp8 : Precision::bf16;
    EchoConfig echo;
    const int64_t T = tokens, H = m.hidden;
    // One layer per mode (in_flight 1 and 2), the same seed: the same weights.
    MoeLayer one(*be, *comm, m, ParallelConfig{R, rank}, echo, 3);
    MoeConfig m2 = m;
    m2.in_flight = 2;
    MoeLayer two(*be, *comm, m2, ParallelConfig{R, rank}, echo, 3);
    EchoConfig per_step = echo;
    per_step.placement = EchoPlacement::step;
    MoeLayer three(*be, *comm, m, ParallelConfig{R, rank}, per_step, 3);
    SkewSpec skew;
    skew.exponent = 1.2;
    SyntheticTokens synth(m.experts, m.hidden, skew, 17);
    write_tensor(*be, one.param(Param::router_weight), synth.router_weight());
    write_tensor(*be, two.param(Param::router_weight), synth.router_weight());
    write_tensor(*be, three.param(Param::router_weight), synth.router_weight());
    MicroBatches mb;
    for (int k = 0; k < 2; ++k) {
      for (Tensor* t : {&mb.x[k], &mb.y[k], &mb.dy[k], &mb.dx[k]}) {
        *t = Tensor(nullptr, be->activation_dtype(), {T, H});
        t->data = be->allocate(t->bytes());
      }
      write_tensor(*be, mb.x[k], synth.tokens(k, rank, int(T)));
      Rng rng(29, uint64_t(k), uint64_t(rank));
      std::vector<double> g(size_t(T * H));
      for (auto& v : g) v = rng.normal() / double(T);
      write_tensor(*be, mb.dy[k], g);
    }
    cudaStream_t a, b;
    CHECK_CUDA(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    CHECK_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    cudaEvent_t ev[3], e0, e1;
    for (cudaEvent_t& e : ev) CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    auto after = [&](cudaStream_t waiter, cudaStream_t on, cudaEvent_t e) {
      CHECK_CUDA(cudaEventRecord(e, on));
      CHECK_CUDA(cudaStreamWaitEvent(waiter, e, 0));
    };
    const std::function<void()> modes[4] = {[&] {
                                              one.weights_changed();  // a new step
                                              one.zero_grad(a);
                                              for (int k = 0; k < 2; ++k) {
                                                one.forward(mb.x[k], mb.y[k], a);
                                                one.backward(mb.dy[k], mb.dx[k], a);
                                              }
                                            },
                                            [&] {
                                              two.weights_changed();
                                              two.zero_grad(a);
                                              two.forward(mb.x[0], mb.y[0], a, 0);
                                              two.forward_dispatch(mb.x[1], mb.y[1], a, 1);
                                              two.backward_dispatch(mb.dy[0], mb.dx[0], a, 0);
                                              two.forward_experts(a, 1);
                                              two.backward_experts(a, 0);
                                              two.forward_combine(a, 1);
                                              two.backward_combine(a, 0);
                                              two.backward(mb.dy[1], mb.dx[1], a, 1);
                                            },
                                            [&] {
                                              two.weights_changed();
                                              two.zero_grad(a);
                                              two.forward(mb.x[0], mb.y[0], a, 0);
                                              two.forward_dispatch(mb.x[1], mb.y[1], a, 1);
                                              after(b, a, ev[0]);
                                              two.backward_dispatch(mb.dy[0], mb.dx[0], a, 0);
                                              two.forward_experts(b, 1);
                                              after(b, a, ev[1]);
                                              two.backward_experts(b, 0);
                                              after(a, b, ev[2]);
                                              two.forward_combine(a, 1);
                                              two.backward_combine(a, 0);
                                              two.backward(mb.dy[1], mb.dx[1], a, 1);
                                            },
                                            [&] {
                                              three.weights_changed();
                                              three.zero_grad(a);
                                              three.hold_clone_grads(true);
                                              three.forward(mb.x[0], mb.y[0], a);
                                              three.backward(mb.dy[0], mb.dx[0], a);
                                              three.hold_clone_grads(false);
                                              three.forward(mb.x[1], mb.y[1], a);
                                              three.backward(mb.dy[1], mb.dx[1], a);
                                            }};
    // Bits of each mode against one at a time (digests of the outputs, input gradients and
    // weight gradients).
    uint64_t ref = 0, ref0 = 0;
    bool same[4] = {true, true, true, true};
    for (int mode = 0; mode < 4; ++mode) {
      modes[mode]();
      CHECK_CUDA(cudaDeviceSynchronize());
      MoeLayer& l = mode == 0 ? one : mode == 3 ? three : two;
      const uint64_t h0 = digest(*be, mb.dx[0], digest(*be, mb.y[0]));  // micro-batch 0
      uint64_t h = h0;
      h = digest(*be, mb.dx[1], digest(*be, mb.y[1], h));
      for (Param p : {Param::w1, Param::w2, Param::router_weight}) h = digest(*be, l.grad(p), h);
      if (mode == 0)
        ref = h, ref0 = h0;
      else
        same[mode] = mode == 3 ? h0 == ref0 : h == ref;
    }
    double ms[4];
    for (int mode = 0; mode < 4; ++mode) {
      std::vector<double> t;
      for (int it = 0; it < warmup + iters; ++it) {
        comm->barrier();
        CHECK_CUDA(cudaEventRecord(e0, a));
        modes[mode]();
        CHECK_CUDA(cudaStreamWaitEvent(a, ev[2], 0));  // b's last work (two streams)
        CHECK_CUDA(cudaEventRecord(e1, a));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float f = 0;
        CHECK_CUDA(cudaEventElapsedTime(&f, e0, e1));
        if (it >= warmup) t.push_back(f);
      }
      ms[mode] = median(max_over_ranks(t));
    }
    {  // the bits agree on every rank
      const std::vector<double> differ =
          max_over_ranks({same[1] ? 0.0 : 1.0, same[2] ? 0.0 : 1.0, same[3] ? 0.0 : 1.0});
      same[1] = differ[0] == 0, same[2] = differ[1] == 0, same[3] = differ[2] == 0;
    }
    const double speedup = ms[0] / ms[2];
    if (rank == 0)
      std::printf("%-14s %-9s %11.3f ms %11.3f ms %11.3f ms %9.3fx %11.3f ms%s\n", name.c_str(),
                  precision.c_str(), ms[0], ms[1], ms[2], speedup, ms[3],
                  same[1] && same[2] && same[3] ? "" : "  (BITS DIFFER)");
    results.push_back({{"config", name},
                       {"hidden", m.hidden},
                       {"ffn", m.ffn},
                       {"experts", m.experts},
                       {"ep", R},
                       {"top_k", m.top_k},
                       {"tokens_per_micro_batch", T},
                       {"precision", precision},
                       {"skew_exponent", 1.2},
                       {"one_at_a_time_ms", ms[0]},
                       {"interleaved_one_stream_ms", ms[1]},
                       {"two_streams_ms", ms[2]},
                       {"two_streams_speedup", speedup},
                       {"step_placement_ms", ms[3]},
                       {"interleaved_bits_equal", same[1]},
                       {"two_streams_bits_equal", same[2]},
                       {"step_placement_micro_batch0_bits_equal", same[3]}});
    for (cudaEvent_t e : ev) CHECK_CUDA(cudaEventDestroy(e));
    CHECK_CUDA(cudaEventDestroy(e0));
    CHECK_CUDA(cudaEventDestroy(e1));
    CHECK_CUDA(cudaStreamDestroy(a));
    CHECK_CUDA(cudaStreamDestroy(b));
    for (int k = 0; k < 2; ++k)
      for (Tensor* t : {&mb.x[k], &mb.y[k], &mb.dy[k], &mb.dx[k]}) be->deallocate(t->data);
    be->synchronize();
    comm->barrier();  // no rank frees its windows (the layers' end) while a peer reads them
  }
  if (matched == 0) {
    std::fprintf(stderr,
                 "--config %s is invalid: allowed a comma-separated list of qwen3-30b-a3b, "
                 "deepseek-v3, mixtral-8x7b\n",
                 only.c_str());
    return 2;
  }
  nlohmann::json doc = {{"device", prop.name},
                        {"kernel", "moe_echo MoeLayer, two micro-batches (in_flight 2)"},
                        {"iters", iters},
                        {"warmup", warmup},
                        {"results", results}};
  if (rank == 0) write_file(out, doc.dump(2) + "\n");
  bool ok = true;
  for (const auto& r : results)
    ok = ok && r["interleaved_bits_equal"].get<bool>() && r["two_streams_bits_equal"].get<bool>();
  return ok ? 0 : 1;
}

// A results file that cannot be written, or any other failure: its message on stderr and exit
// code 1 (2 for an invalid --out, before the run).
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const moe_echo::ConfigError& e) {
    std::fprintf(stderr, "%s: error: %s\n", "micro_batch_bench", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", "micro_batch_bench", e.what());
    return 1;
  }
}
