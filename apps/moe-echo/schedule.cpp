// moe-echo schedule: the ops one call of a layer enqueues, in order (its step schedule,
// docs/design.md "The step schedule"), for the layer the options describe. Prints the listing
// describe_step gives; runs nothing.
#include <iostream>
#include <memory>

#include "commands.hpp"
#include "layer_options.hpp"
#include "moe_echo/backends.hpp"
#include "moe_echo/layer.hpp"

namespace moe_echo::cli {

namespace {

struct ScheduleOptions {
  LayerOptions layer;
  std::string call = "forward";
};

int run_schedule(const ScheduleOptions& o) {
  const StepCall call = parse_step_call(o.call, "call");
  // The schedule depends on the configs only: resolved as on the CPU backend, whose token count
  // for GPU-sized presets changes no mode.
  auto backend = make_cpu_backend();
  const ResolvedLayer r = resolve(o.layer, *backend);
  std::cout << describe_step(r.moe, ParallelConfig{r.ep, 0}, r.echo, call);
  return 0;
}

}  // namespace

void add_schedule(CLI::App& app, Runner& run) {
  auto o = std::make_shared<ScheduleOptions>();
  CLI::App* cmd = app.add_subcommand(
      "schedule",
      "The ops one call of the layer enqueues, in order: what runs over which window and "
      "buffers, on which stream, inside which spill round's conditional block, and where the "
      "split phases begin (the step schedule, docs/design.md)");
  add_layer_options(cmd, o->layer);
  add_option(cmd, "--call", o->call, "forward, backward, forward_split or backward_split")
      ->capture_default_str();
  cmd->callback([&run, o] { run = [o] { return run_schedule(*o); }; });
}

}  // namespace moe_echo::cli
