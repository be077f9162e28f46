// moe-echo: benchmark, train, simulate and plan MoE layers with ECHO load balancing.
// Exit codes: 0 success, 1 runtime failure, 2 invalid arguments or configuration.
#include <cstdio>
#include <exception>
#include <iostream>

#include "commands.hpp"
#include "moe_echo/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{
      "moe-echo: dropless expert-parallel MoE layers with ECHO (elastic cloning of hot experts).\n"
      "Run `moe-echo <command> --help` for the options of a command."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "moe-echo 0.1.0");
  moe_echo::cli::Runner run;
  // subcommands are registered here
  moe_echo::cli::add_bench(app, run);
  moe_echo::cli::add_train(app, run);
  moe_echo::cli::add_simulate(app, run);
  moe_echo::cli::add_plan(app, run);
  moe_echo::cli::add_launch(app, run);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    return run ? run() : 0;
  } catch (const moe_echo::ConfigError& e) {
    std::cerr << "moe-echo: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moe-echo: error: " << e.what() << "\n";
    return 1;
  }
}
