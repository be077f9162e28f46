#include "progress.hpp"

#include <algorithm>
#include <cstdio>
#include <vector>

namespace moe_echo::cli {

double step_flops(const ResolvedLayer& L, int layers) {
  const MoeConfig& m = L.moe;
  const double T = double(m.max_tokens) * L.ep, H = m.hidden, F = m.ffn;
  const double shared_width = double(m.shared_experts) * (m.shared_ffn > 0 ? m.shared_ffn : F);
  const double gemms = 18.0 * T * H * (double(m.top_k) * F + shared_width);
  const double router = 6.0 * T * H * double(m.experts);
  return double(layers) * (gemms + router);
}

namespace {

// FLOP/s of one core on the CPU GEMM's loops (src/cpu/grouped_gemm.cpp), 64 x 256 x 256 repeated
// for at least 20 ms: `axpy` the forward's acc[n] += x * w[n], else the data gradient's dot
// products.
double loop_flops_per_second(bool axpy) {
  constexpr int M = 64, K = 256, N = 256;
  std::vector<float> x(size_t(M) * K, 0.5f), w(size_t(K) * N, 0.25f), y(size_t(M) * N);
  std::vector<double> acc(N);
  const auto t0 = std::chrono::steady_clock::now();
  double flops = 0, seconds = 0;
  do {
    for (int i = 0; i < M; ++i) {
      if (axpy) {
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int k = 0; k < K; ++k) {
          const double xv = x[size_t(i) * K + size_t(k)];
          const float* wk = w.data() + size_t(k) * N;
          for (int n = 0; n < N; ++n) acc[size_t(n)] += xv * double(wk[n]);
        }
        for (int n = 0; n < N; ++n) y[size_t(i) * N + size_t(n)] = float(acc[size_t(n)]);
      } else {
        for (int k = 0; k < K; ++k) {
          const float* wk = w.data() + size_t(k) * N;
          const float* xi = x.data() + size_t(i) * K;  // K == N here
          double dot = 0;
          for (int n = 0; n < N; ++n) dot += double(xi[n]) * double(wk[n]);
          y[size_t(i) * N + size_t(k)] = float(dot);
        }
      }
    }
    flops += 2.0 * M * K * N;
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (seconds < 0.02);
  volatile float sink = y[0];  // keep the loop
  (void)sink;
  return flops / seconds;
}

}  // namespace

double cpu_step_seconds(const ResolvedLayer& L, int layers) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const double parallel = double(std::min<unsigned>(cores, unsigned(std::max(L.ep, 1))));
  const double flops = step_flops(L, layers);
  return flops / 3.0 / (loop_flops_per_second(true) * parallel) +
         2.0 * flops / 3.0 / (loop_flops_per_second(false) * parallel);
}

double warn_if_slow_on_cpu(const char* what, const ResolvedLayer& L, int layers, int steps,
                           int runs) {
  const double flops = step_flops(L, layers);
  if (flops < 1e9) return 0;  // well under a second: no estimate, no note
  const double per_step = cpu_step_seconds(L, layers);
  if (per_step < 3.0) return per_step;
  const double total = per_step * double(steps) * double(runs);
  char all[32];
  if (total < 120)
    std::snprintf(all, sizeof all, "%.0f s", total);
  else
    std::snprintf(all, sizeof all, "%.0f min", total / 60.0);
  std::fprintf(stderr,
               "moe-echo %s: note: this layer is large for the CPU backend: %.0f GFLOP per step "
               "over %d rank(s), about %.0f s per step and %s for %d step(s) on this machine (a "
               "rough estimate, not counting building the layers); a progress line follows "
               "every few seconds. For a run of seconds use --preset tiny, or lower --hidden, "
               "--ffn, --experts, --tokens or --steps; GPU-sized presets are meant for the CUDA "
               "backend.\n",
               what, flops / 1e9, L.ep, per_step, all, steps * runs);
  std::fflush(stderr);
  return per_step;
}

Heartbeat::Heartbeat(std::string tool, int steps, double period_s)
    : tool_(std::move(tool)), steps_(steps), period_(period_s) {
  start_ = step_start_ = last_line_ = Clock::now();
  thread_ = std::thread([this] { loop(); });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Heartbeat::stage(const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  stage_ = what;
  phase_.clear();
}

void Heartbeat::step(int step) {
  std::lock_guard<std::mutex> lock(mu_);
  step_ = step;
  step_start_ = Clock::now();
  stage_.clear();
  phase_.clear();
}

void Heartbeat::mark(const char* phase, Stream) {
  std::lock_guard<std::mutex> lock(mu_);
  phase_ = phase ? phase : "";
}

void Heartbeat::printed() {
  std::lock_guard<std::mutex> lock(mu_);
  last_line_ = Clock::now();
}

void Heartbeat::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const auto due = last_line_ + std::chrono::duration_cast<Clock::duration>(period_);
    if (cv_.wait_until(lock, due, [&] { return stop_; })) break;
    const auto now = Clock::now();
    if (now < last_line_ + std::chrono::duration_cast<Clock::duration>(period_)) continue;
    const double all = std::chrono::duration<double>(now - start_).count();
    std::string where = step_ < 0
                            ? "before the first step"
                            : "step " + std::to_string(step_ + 1) + "/" + std::to_string(steps_);
    if (!stage_.empty()) where += ", " + stage_;
    if (!phase_.empty()) where += ", phase " + phase_;
    if (step_ >= 0)
      std::fprintf(stderr, "[%s] %s: %.1f s into the step, %.1f s in all\n", tool_.c_str(),
                   where.c_str(), std::chrono::duration<double>(now - step_start_).count(), all);
    else
      std::fprintf(stderr, "[%s] %s: %.1f s in all\n", tool_.c_str(), where.c_str(), all);
    std::fflush(stderr);
    last_line_ = now;
  }
}

}  // namespace moe_echo::cli
