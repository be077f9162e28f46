// The subcommands of `moe-echo`. Each add_* registers its options on `app` and, when its
// subcommand is chosen, sets `run` to the function that executes it and returns the exit code.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <sstream>
#include <string>

namespace moe_echo::cli {

using Runner = std::function<int()>;

// "default <v>" with v in its shortest form ("2", "1.25", "0.002"), for help texts that state a
// library default.
inline std::string default_is(double v) {
  std::ostringstream s;
  s << "default " << v;
  return s.str();
}

void add_bench(CLI::App& app, Runner& run);
void add_train(CLI::App& app, Runner& run);
void add_simulate(CLI::App& app, Runner& run);
void add_plan(CLI::App& app, Runner& run);
void add_launch(CLI::App& app, Runner& run);

}  // namespace moe_echo::cli
