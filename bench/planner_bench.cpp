// The ECHO planner's time per call on the host (plan_echo) and on the GPU (Backend::plan of the
// CUDA backend), on routing maps drawn as an EP layer's router produces them: every rank's tokens
// pick K distinct experts from SyntheticTokens' popularity (uniform or Zipf with drift), summed
// into C[R][E]. Planner config as `moe-echo bench --spare-slots 2` builds it on a GPU: 2 spare
// slots per rank, 2 clones per expert, clone_cost_rows from the H200 cost model (fp32 gradients);
// every case is also run with clone_cost_rows 0, where no trial is pruned (the search's worst
// case).
//
// Correctness first: for every routing map the GPU plan storage (poisoned before) must equal the
// host plan element for element, checked before the timed launches and again after them. Any
// difference is printed and makes the exit status 1.
//
// Timing:
// - host: std::chrono around every plan_echo call (after warm-up), median over all calls;
// - GPU: CUDA events between back-to-back Backend::plan launches on one stream. The stream first
//   waits on a host function that returns once every launch and event is enqueued, so the events
//   measure the device (the kernel and the gap between two dependent launches) and not the host's
//   enqueue rate. Median over all launches;
// - the floor: echo = false (plan_none: the expert sums and the plan write, no search), the same
//   way on the GPU and on the host.
//
// usage: planner_bench [--out FILE] [--commit SHA] [--date YYYY-MM-DD] [--config NAME[,NAME]]
//                      [--ranks R[,R]] [--steps N] [--tokens N] [--host-iters N]
//                      [--gpu-iters N] [--warmup N] [--seed N]
// Exit status: 0; 1 when a GPU plan differs from the host plan; 2 on bad arguments, no GPU or an
// error (CUDA errors are reported with the failed call's name).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "moe_echo/backend.hpp"
#include "moe_echo/backends.hpp"
#include "moe_echo/cost_model.hpp"
#include "moe_echo/cuda.hpp"
#include "moe_echo/cuda_check.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/planner.hpp"
#include "moe_echo/presets.hpp"
#include "moe_echo/random.hpp"
#include "moe_echo/stats.hpp"
#include "moe_echo/synthetic.hpp"

using namespace moe_echo;

namespace {

constexpr int kSpareSlots = 2;  // `moe-echo bench` defaults (apps/moe-echo/layer_options.cpp)
constexpr int kMaxClones = 2;
constexpr int kGradBytes = 4;  // fp32 clone gradients, as the layer reduces them
constexpr int32_t kPoison = -77777;

struct Case {
  std::string name;
  int experts, top_k, hidden, ffn, ranks;
};

Case model_case(const ModelPreset& p, int ranks) {
  return {std::string(p.name), p.experts, p.top_k, p.hidden, p.ffn, ranks};
}

struct Options {
  std::string out, commit, date, only_configs, only_ranks;
  int steps = 8, tokens = 8192, host_iters = 200, gpu_iters = 100, warmup = 5;
  uint64_t seed = 7;
};

bool listed(const std::string& list, const std::string& item) {
  return list.empty() || ("," + list + ",").find("," + item + ",") != std::string::npos;
}

std::string today_utc() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", &tm);
  return buf;
}

// The host CPU's model name (host times depend on it), or "" where /proc/cpuinfo has none.
std::string host_cpu() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
    }
  return "";
}

// C[R][E] of one step: each rank's `tokens` tokens draw K distinct experts by successive draws
// without replacement, each proportional to p among the experts not drawn yet (inverse CDF,
// a repeat is drawn again). That is the distribution of Gumbel-top-k on log p, which the layer's
// synthetic router realises, at O(K log E) per token instead of O(E). Every rank has its own
// stream keyed by (seed, step, rank).
std::vector<int32_t> draw_routing_map(const std::vector<double>& p, int ranks, int tokens,
                                      int top_k, uint64_t seed, int step) {
  const size_t E = p.size();
  MOE_ECHO_CHECK(top_k >= 1 && size_t(top_k) <= E,
                 "top_k " << top_k << " with " << E << " experts");
  std::vector<double> cdf(E);
  double total = 0;
  for (size_t e = 0; e < E; ++e) cdf[e] = total += p[e];
  std::vector<int32_t> C(static_cast<size_t>(ranks) * E, 0);
  std::vector<int> picked(static_cast<size_t>(top_k));
  for (int r = 0; r < ranks; ++r) {
    Rng rng(seed, uint64_t(step) + 1, uint64_t(r) + 1);
    int32_t* row = C.data() + size_t(r) * E;
    for (int t = 0; t < tokens; ++t)
      for (int k = 0; k < top_k; ++k) {
        int e = 0;
        do {
          const double u = rng.uniform() * total;
          e = int(std::min<size_t>(
              size_t(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin()), E - 1));
        } while (std::find(picked.begin(), picked.begin() + k, e) != picked.begin() + k);
        picked[size_t(k)] = e;
        ++row[e];
      }
  }
  return C;
}

// Which plan field entry `i` of the storage belongs to, as "field[index]".
std::string plan_entry(const PlannerConfig& cfg, int64_t i) {
  std::vector<int32_t> storage(static_cast<size_t>(plan_ints(cfg)));
  const PlanView v = plan_view(storage.data(), cfg);
  const int32_t* base = storage.data();
  const std::pair<const char*, const int32_t*> fields[] = {
      {"spare_expert", v.spare_expert}, {"replica_rank", v.replica_rank},
      {"replica_slot", v.replica_slot}, {"replica_rows", v.replica_rows},
      {"load_before", v.load_before},   {"load_after", v.load_after},
      {"num_clones", v.num_clones}};
  std::string name = "?";
  int64_t at = i;
  for (const auto& [n, ptr] : fields)
    if (ptr - base <= i) {
      name = n;
      at = i - (ptr - base);
    }
  return name + "[" + std::to_string(at) + "]";
}

// Device memory of the backend, freed with it.
class DeviceBuffer {
 public:
  DeviceBuffer(Backend& be, size_t bytes) : be_(be), p_(be.allocate(bytes)) {}
  ~DeviceBuffer() {
    try {
      be_.deallocate(p_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "planner_bench: freeing device memory: %s\n", e.what());
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }

 private:
  Backend& be_;
  void* p_;
};

// Timing events, created once and destroyed with the object.
class Events {
 public:
  explicit Events(int n) : ev_(static_cast<size_t>(n), nullptr) {
    for (auto& e : ev_) MOE_ECHO_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~Events() {
    for (auto e : ev_)
      if (e) (void)cudaEventDestroy(e);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  cudaEvent_t operator[](size_t i) const { return ev_[i]; }
  size_t size() const { return ev_.size(); }

 private:
  std::vector<cudaEvent_t> ev_;
};

// Holds a stream until the host opens it, so launches enqueued behind it run back to back.
// Opens by itself after kGateTimeout (timed_out is then set: the host enqueued too slowly and the
// first intervals may include host time).
struct Gate {
  std::atomic<bool> open{false};
  std::atomic<bool> timed_out{false};
};
constexpr auto kGateTimeout = std::chrono::seconds(10);

void CUDART_CB wait_for_gate(void* arg) {
  auto* gate = static_cast<Gate*>(arg);
  const auto start = std::chrono::steady_clock::now();
  while (!gate->open.load(std::memory_order_acquire)) {
    if (std::chrono::steady_clock::now() - start > kGateTimeout) {
      gate->timed_out.store(true);
      return;
    }
    std::this_thread::yield();
  }
}

// Device time (us) of each of `events.size() - 1` back-to-back `enqueue()` calls on `s`, with
// the stream held behind a gate until all are enqueued. Adds to `gate_timeouts` when the gate
// opened by itself.
std::vector<double> time_gpu(cudaStream_t s, const Events& events,
                             const std::function<void()>& enqueue, int& gate_timeouts) {
  Gate gate;
  MOE_ECHO_CUDA_CHECK(cudaLaunchHostFunc(s, wait_for_gate, &gate));
  try {
    MOE_ECHO_CUDA_CHECK(cudaEventRecord(events[0], s));
    for (size_t i = 1; i < events.size(); ++i) {
      enqueue();
      MOE_ECHO_CUDA_CHECK(cudaEventRecord(events[i], s));
    }
  } catch (...) {
    gate.open.store(true, std::memory_order_release);
    (void)cudaStreamSynchronize(s);  // the host function must finish before `gate` goes away
    throw;
  }
  gate.open.store(true, std::memory_order_release);
  MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
  MOE_ECHO_CUDA_CHECK(cudaGetLastError());
  if (gate.timed_out.load()) ++gate_timeouts;
  std::vector<double> us;
  for (size_t i = 1; i < events.size(); ++i) {
    float ms = 0;
    MOE_ECHO_CUDA_CHECK(cudaEventElapsedTime(&ms, events[i - 1], events[i]));
    us.push_back(double(ms) * 1e3);
  }
  return us;
}

// Host time (us) of each of `iters` calls of `call`, after `warmup` untimed calls.
template <class F>
std::vector<double> time_host(int iters, int warmup, F&& call) {
  for (int i = 0; i < warmup; ++i) call();
  std::vector<double> us;
  us.reserve(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    const auto t1 = std::chrono::steady_clock::now();
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  return us;
}

// The busiest rank's load over the mean load.
double max_over_mean(const int32_t* load, int ranks) {
  int64_t sum = 0;
  int32_t most = 0;
  for (int r = 0; r < ranks; ++r) {
    sum += load[r];
    most = std::max(most, load[r]);
  }
  return sum ? double(most) * ranks / double(sum) : 1.0;
}

// Plans on the GPU and compares the whole storage with `want`; prints the first differences.
// Returns true when equal.
bool gpu_plan_matches(Backend& be, cudaStream_t s, const Tensor& map, const Tensor& plan,
                      const PlannerConfig& cfg, bool echo, const Plan& want,
                      const std::string& what) {
  const size_t n = want.storage.size();
  std::vector<int32_t> got(n, kPoison);
  be.copy_from_host(plan.data, got.data(), n * sizeof(int32_t));
  be.plan(map, cfg, echo, plan, s);
  MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
  MOE_ECHO_CUDA_CHECK(cudaGetLastError());
  be.copy_to_host(got.data(), plan.data, n * sizeof(int32_t));
  if (got == want.storage) return true;
  size_t differ = 0;
  for (size_t i = 0; i < n; ++i)
    if (got[i] != want.storage[i] && differ++ < 8)
      std::fprintf(stderr, "  %s: %s host %d gpu %d\n", what.c_str(),
                   plan_entry(cfg, int64_t(i)).c_str(), want.storage[i], got[i]);
  std::fprintf(stderr, "MISMATCH %s: %zu of %zu plan entries differ\n", what.c_str(), differ, n);
  return false;
}

// Reads the value after a flag; exits with status 2 on a malformed or out-of-range number.
int parse_int(const std::string& flag, const std::string& v, int lo, int hi = 1000000000) {
  try {
    size_t used = 0;
    const long x = std::stol(v, &used);
    if (used == v.size() && x >= lo && x <= hi) return int(x);
  } catch (const std::exception&) {
  }
  std::fprintf(stderr, "%s = '%s' is invalid: allowed an integer in [%d, %d]\n", flag.c_str(),
               v.c_str(), lo, hi);
  std::exit(2);
}

struct Row {
  std::string label;
  int ranks, experts;
  std::string skew;
  int64_t cost_rows;
  double clones, host_us, gpu_us, gpu_none_us, before, after;
};

int run(const Options& o, const std::string& command) {
  if (cuda::device_count() == 0) {
    std::fprintf(stderr, "planner_bench: no CUDA device visible (needs a GPU)\n");
    return 2;
  }
  int device = 0;
  MOE_ECHO_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  MOE_ECHO_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::fprintf(stderr, "device %d: %s (sm_%d%d)\n", device, prop.name, prop.major, prop.minor);

  std::vector<Case> cases;
  for (const ModelPreset* p : {&kQwen3_30B_A3B, &kDeepSeekV3, &kMixtral8x7B})
    cases.push_back(model_case(*p, p->ep));
  for (int r : {8, 16, 32, 64}) cases.push_back(model_case(kDeepSeekV3, r));

  auto be = make_backend("cuda");
  cudaStream_t s = nullptr;
  MOE_ECHO_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { (void)cudaStreamDestroy(s); }
  } stream_guard{s};
  const Events events(o.gpu_iters + 1);

  nlohmann::json results = nlohmann::json::array();
  std::vector<Row> rows;
  int64_t plans_checked = 0, plans_differ = 0;
  int gate_timeouts = 0;
  for (const Case& c : cases) {
    if (!listed(o.only_configs, c.name) || !listed(o.only_ranks, std::to_string(c.ranks))) continue;
    PlannerConfig base;
    base.ranks = c.ranks;
    base.experts = c.experts;
    base.spare_slots = kSpareSlots;
    base.max_clones = kMaxClones;
    validate(base);
    const int64_t model_cost = offline::CostModel{}.clone_cost_rows(c.hidden, c.ffn, kGradBytes);
    const int R = c.ranks, E = c.experts;
    DeviceBuffer map_buf(*be, size_t(R) * size_t(E) * sizeof(int32_t));
    DeviceBuffer plan_buf(*be, size_t(plan_ints(base)) * sizeof(int32_t));
    const Tensor map(map_buf.get(), DType::i32, {R, E});
    const Tensor plan(plan_buf.get(), DType::i32, {plan_ints(base)});

    for (const std::string skew_name : {"uniform", "zipf:1.2"}) {
      const SkewSpec skew = parse_skew(skew_name);
      // Popularity depends on the seed only (the Zipf ranks and drift phases are drawn before
      // the router weight), so the router weight is built at hidden = E, which is cheap.
      const SyntheticTokens synth(E, E, skew, o.seed);
      std::vector<std::vector<int32_t>> maps;
      std::vector<int> map_step;
      for (int i = 0; i < o.steps; ++i) {
        // The maps span one drift period, so the hot set moves between them.
        const int step = i * std::max(1, skew.drift_period) / o.steps;
        maps.push_back(
            draw_routing_map(synth.popularity(step), R, o.tokens, c.top_k, o.seed, step));
        map_step.push_back(step);
      }
      const std::string tag = c.name + " R" + std::to_string(R) + " " + skew_name;

      // The floor: plan_none on the host and on the GPU, checked like the ECHO plans.
      std::vector<double> host_none, gpu_none;
      for (size_t m = 0; m < maps.size(); ++m) {
        be->copy_from_host(map.data, maps[m].data(), maps[m].size() * sizeof(int32_t));
        Plan want(base);
        plan_none(maps[m].data(), base, want.view());
        ++plans_checked;
        if (!gpu_plan_matches(*be, s, map, plan, base, false, want,
                              tag + " none map " + std::to_string(m)))
          ++plans_differ;
        const auto h = time_host(o.host_iters, o.warmup,
                                 [&] { plan_none(maps[m].data(), base, want.view()); });
        host_none.insert(host_none.end(), h.begin(), h.end());
        for (int w = 0; w < o.warmup; ++w) be->plan(map, base, false, plan, s);
        const auto g = time_gpu(
            s, events, [&] { be->plan(map, base, false, plan, s); }, gate_timeouts);
        gpu_none.insert(gpu_none.end(), g.begin(), g.end());
      }

      for (const int64_t cost : {model_cost, int64_t(0)}) {
        PlannerConfig cfg = base;
        cfg.clone_cost_rows = cost;
        std::vector<double> host_all, gpu_all, clones, before, after;
        nlohmann::json per_map = nlohmann::json::array();
        for (size_t m = 0; m < maps.size(); ++m) {
          be->copy_from_host(map.data, maps[m].data(), maps[m].size() * sizeof(int32_t));
          Plan want(cfg);
          plan_echo(maps[m].data(), cfg, want.view());
          const std::string what =
              tag + " cost " + std::to_string(cost) + " map " + std::to_string(m);
          ++plans_checked;
          if (!gpu_plan_matches(*be, s, map, plan, cfg, true, want, what)) ++plans_differ;

          Plan scratch(cfg);
          const auto h = time_host(o.host_iters, o.warmup,
                                   [&] { plan_echo(maps[m].data(), cfg, scratch.view()); });
          for (int w = 0; w < o.warmup; ++w) be->plan(map, cfg, true, plan, s);
          const auto g = time_gpu(
              s, events, [&] { be->plan(map, cfg, true, plan, s); }, gate_timeouts);
          // The storage the timed launches left must still be the host plan.
          std::vector<int32_t> last(want.storage.size());
          be->copy_to_host(last.data(), plan.data, last.size() * sizeof(int32_t));
          ++plans_checked;
          if (last != want.storage || scratch.storage != want.storage) {
            std::fprintf(stderr, "MISMATCH %s: plan after the timed calls differs (%s)\n",
                         what.c_str(), last != want.storage ? "gpu" : "host");
            ++plans_differ;
          }
          host_all.insert(host_all.end(), h.begin(), h.end());
          gpu_all.insert(gpu_all.end(), g.begin(), g.end());
          const PlanView v = want.view();
          clones.push_back(v.num_clones[0]);
          before.push_back(max_over_mean(v.load_before, R));
          after.push_back(max_over_mean(v.load_after, R));
          per_map.push_back({{"step", map_step[m]},
                             {"clones", v.num_clones[0]},
                             {"host_us_median", median(h)},
                             {"gpu_us_median", median(g)},
                             {"load_max_over_mean_before", before.back()},
                             {"load_max_over_mean_after", after.back()}});
        }
        const Row row{.label = c.name,
                      .ranks = R,
                      .experts = E,
                      .skew = skew_name,
                      .cost_rows = cost,
                      .clones = mean(clones),
                      .host_us = median(host_all),
                      .gpu_us = median(gpu_all),
                      .gpu_none_us = median(gpu_none),
                      .before = mean(before),
                      .after = mean(after)};
        rows.push_back(row);
        std::fprintf(stderr, "%s cost %lld: host %.2f us, gpu %.2f us, %.2f clones\n", tag.c_str(),
                     static_cast<long long>(cost), row.host_us, row.gpu_us, row.clones);
        results.push_back({{"case", c.name},
                           {"ranks", R},
                           {"experts", E},
                           {"top_k", c.top_k},
                           {"hidden", c.hidden},
                           {"ffn", c.ffn},
                           {"tokens_per_rank", o.tokens},
                           {"skew", skew_name},
                           {"spare_slots", cfg.spare_slots},
                           {"max_clones", cfg.max_clones},
                           {"clone_cost_rows", cost},
                           {"clone_cost_from", cost == model_cost ? "cost model" : "zero"},
                           {"clones_mean", row.clones},
                           {"host_us_median", row.host_us},
                           {"host_us_mean", mean(host_all)},
                           {"gpu_us_median", row.gpu_us},
                           {"gpu_us_mean", mean(gpu_all)},
                           {"gpu_over_host", row.host_us > 0 ? row.gpu_us / row.host_us : 0.0},
                           {"host_none_us_median", median(host_none)},
                           {"gpu_none_us_median", row.gpu_none_us},
                           {"load_max_over_mean_before", row.before},
                           {"load_max_over_mean_after", row.after},
                           {"maps", per_map}});
      }
    }
  }

  if (!o.out.empty()) {
    nlohmann::json doc = {
        {"what",
         "ECHO planner time per call: plan_echo on one host thread, Backend::plan "
         "(CUDA backend) on the GPU; GPU plans checked equal to the host plans"},
        {"device", prop.name},
        {"compute_capability", std::to_string(prop.major) + "." + std::to_string(prop.minor)},
        {"host_cpu", host_cpu()},
        {"date", o.date.empty() ? today_utc() : o.date},
        {"commit", o.commit},
        {"command", command},
        {"config",
         {{"tokens_per_rank", o.tokens},
          {"maps_per_case", o.steps},
          {"spare_slots", kSpareSlots},
          {"max_clones", kMaxClones},
          {"clone_cost_rows", "offline::CostModel{}.clone_cost_rows(H, F, 4) and 0"},
          {"routing",
           "per rank, K distinct experts per token drawn from SyntheticTokens "
           "popularity (Gumbel-top-k distribution); maps span one drift period"},
          {"host_iters_per_map", o.host_iters},
          {"gpu_iters_per_map", o.gpu_iters},
          {"warmup", o.warmup},
          {"seed", o.seed}}},
        {"plans_checked", plans_checked},
        {"plans_differ", plans_differ},
        {"gate_timeouts", gate_timeouts},
        {"results", results}};
    write_file(o.out, doc.dump(1) + "\n");  // FileError: the path and the reason, exit 1
  }

  if (gate_timeouts)
    std::fprintf(stderr, "warning: %d timed batches started before all launches were enqueued\n",
                 gate_timeouts);
  std::printf("%-14s %5s %7s %-8s %9s %6s %9s %9s %8s %9s %7s %7s\n", "case", "ranks", "experts",
              "skew", "cost_rows", "clones", "host_us", "gpu_us", "gpu/host", "gpu_none", "before",
              "after");
  for (const Row& r : rows)
    std::printf("%-14s %5d %7d %-8s %9lld %6.2f %9.2f %9.2f %8.2f %9.2f %7.3f %7.3f\n",
                r.label.c_str(), r.ranks, r.experts, r.skew.c_str(),
                static_cast<long long>(r.cost_rows), r.clones, r.host_us, r.gpu_us,
                r.host_us > 0 ? r.gpu_us / r.host_us : 0.0, r.gpu_none_us, r.before, r.after);
  std::printf(
      "(medians per call in us; before/after: busiest rank's load over the mean, mean "
      "over %d maps; gpu_none: echo = false)\n",
      o.steps);
  if (plans_differ) {
    std::printf("FAILED: %lld of %lld GPU plans differ from the host plans\n",
                static_cast<long long>(plans_differ), static_cast<long long>(plans_checked));
    return 1;
  }
  std::printf("all %lld GPU plans equal the host plans\n", static_cast<long long>(plans_checked));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::string command = "planner_bench";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", a.c_str());
      return 2;
    }
    const std::string v = argv[i + 1];
    if (a == "--out")
      o.out = v;
    else if (a == "--commit")
      o.commit = v;
    else if (a == "--date")
      o.date = v;
    else if (a == "--config")
      o.only_configs = v;
    else if (a == "--ranks")
      o.only_ranks = v;
    else if (a == "--steps")
      o.steps = parse_int(a, v, 1);
    else if (a == "--tokens")
      o.tokens = parse_int(a, v, 1);
    else if (a == "--host-iters")
      o.host_iters = parse_int(a, v, 1);
    else if (a == "--gpu-iters")
      o.gpu_iters = parse_int(a, v, 1, 1000);  // launches queued behind the gate
    else if (a == "--warmup")
      o.warmup = parse_int(a, v, 0);
    else if (a == "--seed")
      o.seed = uint64_t(parse_int(a, v, 0));
    else {
      std::fprintf(stderr, "unknown option %s (see the usage at the top of planner_bench.cpp)\n",
                   a.c_str());
      return 2;
    }
  }
  try {
    check_output_path("out", o.out);  // before any timing
    return run(o, command);
  } catch (const moe_echo::FileError& e) {
    std::fprintf(stderr, "planner_bench: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "planner_bench: error: %s\n", e.what());
    return 2;
  }
}
