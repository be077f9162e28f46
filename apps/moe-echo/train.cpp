// moe-echo train: fits one MoE layer (the student) to a fixed random MoE layer (the teacher) by
// AdamW on a regression loss, and prints the loss per step. By default it trains twice, with ECHO
// on and off, from the same initial weights and data, and checks that the loss falls and that the
// two curves agree (ECHO moves work between ranks; it must not change the mathematics).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "commands.hpp"
#include "core/random.hpp"
#include "layer_options.hpp"
#include "moe_echo/backends.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/layer.hpp"

namespace moe_echo::cli {
namespace {

struct TrainOptions {
  LayerOptions layer;
  int steps = 60;
  double lr = 1e-2;
  double weight_decay = 0.0;
  std::string compare = "both";
  double tolerance = 1e-5;
  std::string json;
};

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
  InProcessWorld world(R);
  world.run([&](int rank) {
    auto backend = make_backend(o.layer.backend);
    std::unique_ptr<Communicator> comm_holder;
    Communicator& comm = rank_communicator(*backend, world, rank, comm_holder);
    MoeLayer teacher(*backend, comm, moe, ParallelConfig{R, rank}, teacher_echo,
                     o.layer.seed + 7919);
    MoeLayer student(*backend, comm, moe, ParallelConfig{R, rank}, student_echo, o.layer.seed);
    // The teacher routes like the student at initialisation (its experts are its own), so the
    // student can reach it: it must learn the teacher's experts and keep the routing.
    write_tensor(*backend, teacher.param(Param::router_weight),
                 read_tensor(*backend, student.param(Param::router_weight)));
    const DType act = backend->activation_dtype();
    auto alloc = [&](std::initializer_list<int64_t> dims) {
      Tensor t(nullptr, act, dims);
      t.data = backend->allocate(t.bytes());
      return t;
    };
    Tensor x = alloc({T, H}), target = alloc({T, H}), y = alloc({T, H}), dy = alloc({T, H}),
           dx = alloc({T, H});
    std::vector<double> xh(size_t(T) * size_t(H));
    AdamWConfig adam;
    adam.lr = o.lr;
    adam.weight_decay = o.weight_decay;
    for (int step = 0; step < o.steps; ++step) {
      Rng rng(o.layer.seed ^ 0x7a11ull, uint64_t(step), uint64_t(rank));
      for (auto& v : xh) v = rng.normal();
      write_tensor(*backend, x, xh);
      teacher.forward(x, target);
      student.forward(x, y);
      // loss = 0.5 * mean over all ranks, tokens and features of (y - target)^2
      const std::vector<double> yv = read_tensor(*backend, y), tv = read_tensor(*backend, target);
      std::vector<double> g(yv.size());
      const double denom = double(R) * T * H;
      double local = 0;
      for (size_t i = 0; i < yv.size(); ++i) {
        const double d = yv[i] - tv[i];
        local += 0.5 * d * d / denom;
        g[i] = d / denom;
      }
      write_tensor(*backend, dy, g);
      student.zero_grad();
      student.backward(dy, dx);
      student.all_reduce_router_grad();
      student.optimizer_step(adam);
      rank_loss[size_t(rank)] = local;
      comm.barrier();
      if (rank == 0) {
        double total = 0;
        for (double v : rank_loss) total += v;
        losses[size_t(step)] = total;
      }
      comm.barrier();
    }
  });
  return losses;
}

int run_train(const TrainOptions& o) {
  if (o.steps < 2) reject("steps", o.steps, "steps >= 2");
  if (!(o.lr > 0) || !std::isfinite(o.lr)) reject("lr", o.lr, "a finite value > 0");
  if (o.compare != "both" && o.compare != "on" && o.compare != "off")
    reject("echo", "'" + o.compare + "'", "both, on or off");
  auto probe = make_backend(o.layer.backend);
  LayerOptions lo = o.layer;
  lo.echo = "on";
  const ResolvedLayer L = resolve(lo, *probe);
  std::printf(
      "moe-echo train: teacher-student regression, preset %s, backend %s, H %d, F %d, "
      "E %d, top-%d, %d tokens/rank, EP %d, AdamW lr %g\n",
      L.preset.c_str(), probe->name(), L.moe.hidden, L.moe.ffn, L.moe.experts, L.moe.top_k,
      L.moe.max_tokens, L.ep, o.lr);

  std::vector<double> on, off;
  if (o.compare != "off") on = train_once(o, L, true);
  if (o.compare != "on") off = train_once(o, L, false);
  const std::vector<double>& main = on.empty() ? off : on;

  std::printf("%5s %14s %14s %11s\n", "step", "loss (ECHO)", "loss (no ECHO)", "rel diff");
  double max_diff = 0;
  for (int s = 0; s < o.steps; ++s) {
    const double a = on.empty() ? NAN : on[size_t(s)], b = off.empty() ? NAN : off[size_t(s)];
    const double d =
        (on.empty() || off.empty()) ? NAN : std::fabs(a - b) / std::max(std::fabs(b), 1e-30);
    if (std::isfinite(d)) max_diff = std::max(max_diff, d);
    std::printf("%5d %14.6e %14.6e %11.2e\n", s, a, b, d);
  }
  const double first = main.front(), last = main.back();
  const bool falls = last < 0.5 * first;
  const bool agree = on.empty() || off.empty() || max_diff <= o.tolerance;
  std::printf("\nloss %.6e -> %.6e (%.1f%% of the first step): %s\n", first, last,
              100.0 * last / first, falls ? "falls" : "DOES NOT FALL to half");
  if (!on.empty() && !off.empty())
    std::printf("ECHO on vs off: max relative difference %.2e (tolerance %.0e): %s\n", max_diff,
                o.tolerance, agree ? "agree" : "DISAGREE");
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
                        {"max_rel_diff", max_diff},
                        {"loss_falls", falls},
                        {"curves_agree", agree}};
    std::ofstream out(o.json);
    if (!out) throw Error("cannot write --json file '" + o.json + "'");
    out << j.dump(2) << "\n";
  }
  return falls && agree ? 0 : 1;
}

}  // namespace

void add_train(CLI::App& app, Runner& run) {
  auto opts = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand(
      "train",
      "Train one MoE layer with AdamW to match a fixed random MoE teacher; print the loss per "
      "step, with ECHO on and off. Exit code 1 if the loss does not fall to half or the curves "
      "disagree.");
  add_layer_options(cmd, opts->layer);
  cmd->get_option("--echo")->description(
      "Which runs: both (default: ECHO on and off, compared), on, off");
  opts->layer.echo = "both";
  cmd->add_option("--steps", opts->steps, "Optimizer steps (default 60)");
  cmd->add_option("--lr", opts->lr, "AdamW learning rate (default 1e-2)");
  cmd->add_option("--weight-decay", opts->weight_decay, "AdamW decoupled weight decay (default 0)");
  cmd->add_option("--tolerance", opts->tolerance,
                  "Largest relative difference allowed between the ECHO on and off curves "
                  "(default 1e-5)");
  cmd->add_option("--json", opts->json, "Write the loss curves to this JSON file");
  cmd->callback([opts, &run] {
    opts->compare = opts->layer.echo;
    run = [opts] { return run_train(*opts); };
  });
}

}  // namespace moe_echo::cli
