// moe-echo train: fits one MoE layer (the student) to a fixed random MoE layer (the teacher) by
// AdamW on a regression loss, and prints the loss per step. By default it trains twice, with ECHO
// on and off, from the same initial weights and data, and checks that the loss falls and that the
// two curves agree (ECHO moves work between ranks; it must not change the mathematics): within
// 1e-5 by default, and within 5e-2 with precision fp8, whose e4m3 rounding turns the last-bit
// differences of summation order into whole e4m3 steps over the steps (docs/fp8.md, "ECHO under
// FP8"; each step's equality is what tests/cpu/fp8_echo_test.cpp checks).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <vector>

#include "commands.hpp"
#include "layer_options.hpp"
#include "moe_echo/backends.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/layer.hpp"
#include "moe_echo/random.hpp"
#include "progress.hpp"

namespace moe_echo::cli {
namespace {

struct TrainOptions {
  LayerOptions layer;
  int steps = 60;
  double lr = 1e-2;
  double weight_decay = 0.0;
  std::string compare = "both";
  std::optional<double> tolerance;  // unset: kCurveTolerance, or kFp8CurveTolerance with fp8
  std::string json;
};

// Steps are bounded so that the loss curves stay small.
constexpr int kMaxSteps = 1000000;
// The largest relative difference allowed by default between the ECHO on and off curves: the
// order of fp32 sums, and with precision fp8 what e4m3 rounding makes of it over the steps
// (at the defaults about 1e-3 over 60 steps and 1e-2 over 150, as much with no FP8 weight
// gradient: two fp8 runs drift apart into two draws of e4m3 rounding; below e4m3's step, 2^-4).
constexpr double kCurveTolerance = 1e-5;
constexpr double kFp8CurveTolerance = 5e-2;

// The settings that can make a run diverge, as "--lr (0.01)" or "--lr (1e+10), --weight-decay
// (5) or --aux-loss-coeff (1e+06)": the learning rate, and those set above their defaults.
std::string divergence_knobs(const TrainOptions& o, const MoeConfig& m) {
  const MoeConfig d;
  std::vector<std::pair<const char*, double>> knobs = {{"--lr", o.lr}};
  if (o.weight_decay > 0) knobs.emplace_back("--weight-decay", o.weight_decay);
  if (m.aux_loss_coeff > d.aux_loss_coeff) knobs.emplace_back("--aux-loss-coeff", m.aux_loss_coeff);
  if (m.z_loss_coeff > d.z_loss_coeff) knobs.emplace_back("--z-loss-coeff", m.z_loss_coeff);
  if (m.seq_aux_loss_coeff > d.seq_aux_loss_coeff)
    knobs.emplace_back("--seq-aux-loss-coeff", m.seq_aux_loss_coeff);
  if (m.routed_scaling_factor > d.routed_scaling_factor)
    knobs.emplace_back("--routed-scaling-factor", m.routed_scaling_factor);
  if (m.bias_update && m.bias_update_rate > d.bias_update_rate)
    knobs.emplace_back("--bias-update-rate", m.bias_update_rate);
  std::ostringstream s;
  for (size_t i = 0; i < knobs.size(); ++i)
    s << (i == 0                  ? ""
          : i + 1 == knobs.size() ? " or "
                                  : ", ")
      << knobs[i].first << " (" << knobs[i].second << ")";
  return s.str();
}

// Loss per step of one training run. Teacher and student share EP layout and data.
std::vector<double> train_once(const TrainOptions& o, const ResolvedLayer& L, bool echo_on) {
  const MoeConfig& moe = L.moe;
  const int R = L.ep, T = moe.max_tokens, H = moe.hidden;
  EchoConfig student_echo = L.echo;
  student_echo.enabled = echo_on;
  EchoConfig teacher_echo = L.echo;
  teacher_echo.enabled = false;
  std::vector<double> losses(size_t(o.steps), 0.0);
  std::vector<double> rank_loss(size_t(R), 0.0);
  // A line on stderr whenever the run is quiet for 5 s (train prints its table at the end).
  Heartbeat heartbeat(echo_on ? "train, ECHO on" : "train, ECHO off", o.steps);
  heartbeat.stage("building the layers");
  InProcessWorld world(R);
  world.run([&](int rank) {
    auto backend = make_backend(o.layer.backend);
    std::unique_ptr<Communicator> comm_holder;
    Communicator& comm = rank_communicator(*backend, world, rank, comm_holder);
    MoeLayer teacher(*backend, comm, moe, ParallelConfig{R, rank}, teacher_echo,
                     o.layer.seed + 7919);
    MoeLayer student(*backend, comm, moe, ParallelConfig{R, rank}, student_echo, o.layer.seed);
    if (rank == 0) student.set_phase_observer(&heartbeat);
    // The teacher routes like the student at initialisation (its experts are its own), so the
    // student can reach it: it must learn the teacher's experts and keep the routing.
    write_tensor(*backend, teacher.param(Param::router_weight),
                 read_tensor(*backend, student.param(Param::router_weight)));
    RankTensors alloc(*backend);
    Tensor x = alloc({T, H}), target = alloc({T, H}), y = alloc({T, H}), dy = alloc({T, H}),
           dx = alloc({T, H});
    std::vector<double> xh(size_t(T) * size_t(H));
    AdamWConfig adam;
    adam.lr = o.lr;
    adam.weight_decay = o.weight_decay;
    for (int step = 0; step < o.steps; ++step) {
      if (rank == 0) heartbeat.step(step);
      Rng rng(o.layer.seed ^ 0x7a11ull, uint64_t(step), uint64_t(rank));
      for (auto& v : xh) v = rng.normal();
      write_tensor(*backend, x, xh);
      teacher.forward(x, target);
      student.forward(x, y);
      // loss = 0.5 * mean over all ranks, tokens and features of (y - target)^2
      const std::vector<double> yv = read_tensor(*backend, y), tv = read_tensor(*backend, target);
      std::vector<double> g(yv.size());
      bool finite_out = true;
      const double denom = double(R) * T * H;
      double local = 0;
      for (size_t i = 0; i < yv.size(); ++i) {
        const double d = yv[i] - tv[i];
        local += 0.5 * d * d / denom;
        g[i] = d / denom;
        finite_out = finite_out && std::isfinite(yv[i]);
      }
      if (!finite_out) local = std::numeric_limits<double>::quiet_NaN();
      write_tensor(*backend, dy, g);
      student.zero_grad();
      student.backward(dy, dx);
      student.all_reduce_router_grad();
      student.optimizer_step(adam);
      rank_loss[size_t(rank)] = local;
      comm.barrier();
      double total = 0;
      for (double v : rank_loss) total += v;
      if (rank == 0) losses[size_t(step)] = total;
      comm.barrier();
      // Every rank sees the same total and stops at the same step.
      if (!std::isfinite(total)) {
        std::ostringstream m;
        m << "train (ECHO " << (echo_on ? "on" : "off") << "): the loss of step " << step << " is "
          << total << " (not finite): the run diverged; lower " << divergence_knobs(o, moe);
        throw Error(m.str());
      }
    }
  });
  return losses;
}

int run_train(const TrainOptions& o) {
  if (o.steps < 2 || o.steps > kMaxSteps)
    reject("steps", o.steps, "2 <= steps <= " + std::to_string(kMaxSteps));
  if (!(o.lr > 0) || !std::isfinite(o.lr)) reject("lr", o.lr, "a finite value > 0");
  if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay))
    reject("weight_decay", o.weight_decay, "a finite value >= 0");
  if (o.tolerance && (!(*o.tolerance > 0) || !std::isfinite(*o.tolerance)))
    reject("tolerance", *o.tolerance, "a finite value > 0");
  if (o.compare != "both" && o.compare != "on" && o.compare != "off")
    reject("echo", "'" + o.compare + "'", "both, on or off");
  check_output_path("json", o.json);
  auto probe = make_backend(o.layer.backend);
  LayerOptions lo = o.layer;
  lo.echo = "on";
  const ResolvedLayer L = resolve(lo, *probe);
  const double tolerance = o.tolerance                         ? *o.tolerance
                           : L.moe.precision == Precision::fp8 ? kFp8CurveTolerance
                                                               : kCurveTolerance;
  // Per rank: teacher and student with AdamW state, and x, target, y, dy, dx and their host copies.
  const double T = L.moe.max_tokens, H = L.moe.hidden;
  check_memory(L, *probe, 2, /*shared_workspace=*/false, /*optimizer_state=*/true, 9.0 * T * H * 8);
  std::printf(
      "moe-echo train: teacher-student regression, preset %s, backend %s, H %d, F %d, "
      "E %d, top-%d, %d tokens/rank, EP %d, AdamW lr %g\n",
      L.preset.c_str(), probe->name(), L.moe.hidden, L.moe.ffn, L.moe.experts, L.moe.top_k,
      L.moe.max_tokens, L.ep, o.lr);
  std::fflush(stdout);
  // Per step: the teacher's forward and the student's forward and backward, about a step of one
  // layer and a forward; twice with --echo both.
  warn_if_slow_on_cpu("train", L, 1, o.steps, o.compare == "both" ? 2 : 1);

  std::vector<double> on, off;
  if (o.compare != "off") on = train_once(o, L, true);
  if (o.compare != "on") off = train_once(o, L, false);
  const std::vector<double>& main = on.empty() ? off : on;

  std::printf("%5s %14s %14s %11s\n", "step", "loss (ECHO)", "loss (no ECHO)", "rel diff");
  double max_diff = 0;
  for (int s = 0; s < o.steps; ++s) {
    auto cell = [](const std::vector<double>& v, int step, const char* format) {
      char buf[32] = "-";
      if (!v.empty()) std::snprintf(buf, sizeof buf, format, v[size_t(step)]);
      return std::string(buf);
    };
    std::string d = "-";
    if (!on.empty() && !off.empty()) {
      const double a = on[size_t(s)], b = off[size_t(s)];
      const double rel = std::fabs(a - b) / std::max(std::fabs(b), 1e-30);
      max_diff = std::max(max_diff, rel);
      d = cell({rel}, 0, "%.2e");
    }
    std::printf("%5d %14s %14s %11s\n", s, cell(on, s, "%.6e").c_str(),
                cell(off, s, "%.6e").c_str(), d.c_str());
  }
  const double first = main.front(), last = main.back();
  const bool falls = last < 0.5 * first;
  // Only two runs can agree; one run is not compared and claims nothing.
  const bool compared = !on.empty() && !off.empty();
  const bool agree = compared && max_diff <= tolerance;
  std::printf("\nloss %.6e -> %.6e (%.1f%% of the first step): %s\n", first, last,
              100.0 * last / first, falls ? "falls" : "DOES NOT FALL to half");
  if (compared)
    std::printf("ECHO on vs off: max relative difference %.2e (tolerance %.0e): %s\n", max_diff,
                tolerance, agree ? "agree" : "DISAGREE");
  else
    std::printf("ECHO on vs off: not compared (only ECHO %s ran; --echo both compares)\n",
                on.empty() ? "off" : "on");
  if (!o.json.empty()) {
    nlohmann::json j = {{"command", "train"},
                        {"backend", probe->name()},
                        {"config",
                         {{"preset", L.preset},
                          {"hidden", L.moe.hidden},
                          {"ffn", L.moe.ffn},
                          {"experts", L.moe.experts},
                          {"top_k", L.moe.top_k},
                          {"tokens_per_rank", L.moe.max_tokens},
                          {"ep", L.ep},
                          {"lr", o.lr},
                          {"steps", o.steps},
                          {"seed", o.layer.seed}}},
                        {"loss_echo", on},
                        {"loss_no_echo", off},
                        {"max_rel_diff", compared ? nlohmann::json(max_diff) : nlohmann::json()},
                        {"tolerance", tolerance},
                        {"loss_falls", falls},
                        {"compared", compared},
                        {"curves_agree", compared ? nlohmann::json(agree) : nlohmann::json()}};
    write_file(o.json, j.dump(2) + "\n");
  }
  return falls && (agree || !compared) ? 0 : 1;
}

}  // namespace

void add_train(CLI::App& app, Runner& run) {
  auto opts = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand(
      "train",
      "Train one MoE layer with AdamW to match a fixed random MoE teacher; print the loss per "
      "step, with ECHO on and off. Exit code 1 if the loss does not fall to half, the curves "
      "disagree, or a loss is not finite (the run stops at that step).");
  add_layer_options(cmd, opts->layer);
  cmd->get_option("--echo")->description(
      "Which runs: both (default: ECHO on and off, compared), on, off");
  opts->layer.echo = "both";
  add_option(cmd, "--steps", opts->steps, "Optimizer steps (default 60)");
  add_option(cmd, "--lr", opts->lr, "AdamW learning rate (default 1e-2)");
  add_option(cmd, "--weight-decay", opts->weight_decay, "AdamW decoupled weight decay (default 0)");
  add_option(cmd, "--tolerance", opts->tolerance,
             "Largest relative difference allowed between the ECHO on and off curves "
             "(default 1e-5; 5e-2 with --precision fp8, where e4m3 rounding amplifies the "
             "order of sums over the steps: docs/fp8.md)");
  add_option(cmd, "--json", opts->json, "Write the loss curves to this JSON file");
  cmd->callback([opts, &run] {
    opts->compare = opts->layer.echo;
    run = [opts] { return run_train(*opts); };
  });
}

}  // namespace moe_echo::cli
