// Progress of long CPU runs: an estimate before the run, and a line on stderr at least every few
// seconds while it is quiet, so that a GPU-sized layer on the CPU backend never runs for minutes
// without a word.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "layer_options.hpp"
#include "moe_echo/layer.hpp"

namespace moe_echo::cli {

// Floating-point operations of one training step (forward + backward) of `layers` layers of L on
// all L.ep ranks: the expert GEMMs (routed rows and shared experts: 6 H F per row forward, twice
// that backward) and the router (6 H E per token).
double step_flops(const ResolvedLayer& L, int layers);

// Seconds of one such step on this machine's CPU backend: the forward's third of the FLOPs at the
// rate of a short timed run of the CPU GEMM's forward loop (acc[n] += x * w[n]), the backward's
// two thirds at that of its data-gradient loop (a dot product per element), both on float
// operands with double accumulators and times the cores the ranks can use. Rough (within a few
// times, more on a loaded machine); for the estimate printed before a long run.
double cpu_step_seconds(const ResolvedLayer& L, int layers);

// Before a CPU run of `steps` steps: when a step is estimated above a few seconds, a note on
// stderr with the estimate per step and in all, that progress lines follow, and what makes the
// run short (`what` names the tool: "bench", "train"; `runs` multiplies the steps, e.g. ECHO on
// and off). Returns the estimated seconds per step (0 when not estimated).
double warn_if_slow_on_cpu(const char* what, const ResolvedLayer& L, int layers, int steps,
                           int runs = 1);

// A background thread that prints where the run is ("[bench] step 3/20, forward, phase
// gemm_fc1: 12.0 s into the step, 47.3 s in all") whenever nothing was printed for `period_s`.
// The run tells it where it is: stage() and step() from any thread, mark() from the layer of
// rank 0 (it is a PhaseObserver); printed() when the run printed a line itself.
class Heartbeat final : public PhaseObserver {
 public:
  Heartbeat(std::string tool, int steps, double period_s = 5.0);
  ~Heartbeat() override;
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  void stage(const std::string& what);  // "building the layers", "forward", "backward"
  void step(int step);                  // step `step` (from 0) begins
  void mark(const char* phase, Stream stream) override;
  void printed();

 private:
  using Clock = std::chrono::steady_clock;
  void loop();

  std::string tool_;
  int steps_;
  std::chrono::duration<double> period_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  int step_ = -1;
  std::string stage_, phase_;
  Clock::time_point start_, step_start_, last_line_;
  std::thread thread_;
};

}  // namespace moe_echo::cli
