// moe-echo: benchmark, train, simulate and plan MoE layers with ECHO load balancing, and list a
// layer's step schedule.
// Exit codes: 0 success, 1 runtime failure, 2 invalid arguments or configuration. Every invalid
// argument, the option parser's findings included, is reported in the library's form
// "X = V is invalid: allowed ...".
#include <cstdio>
#include <exception>
#include <iostream>

#include "commands.hpp"
#include "moe_echo/error.hpp"

namespace {

// The part of a CLI11 message after its first ": " (the arguments of "... not expected: a b").
std::string after_colon(const std::string& s) {
  const size_t at = s.find(": ");
  return at == std::string::npos ? s : s.substr(at + 2);
}

// The option parser's errors (unknown or missing arguments) as the library's messages.
std::string parse_message(const CLI::App& app, const CLI::ParseError& e, int argc, char** argv) {
  const std::vector<CLI::App*> subs = app.get_subcommands();
  const std::string cmd = subs.empty() ? "" : subs.front()->get_name();
  const std::string help = "`moe-echo " + (cmd.empty() ? "" : cmd + " ") + "--help`";
  const std::string what = e.what();
  if (dynamic_cast<const CLI::ExtrasError*>(&e)) {
    if (cmd.empty())
      return "command = '" + after_colon(what) +
             "' is invalid: allowed bench, train, simulate, plan, schedule or launch";
    return "argument = '" + after_colon(what) + "' is invalid: allowed the options that " + help +
           " lists";
  }
  if (dynamic_cast<const CLI::RequiredError*>(&e)) {
    if (cmd.empty())
      return "command = " + (argc > 1 ? "'" + std::string(argv[1]) + "'" : "(none)") +
             " is invalid: allowed bench, train, simulate, plan, schedule or launch";
    const std::string name = what.substr(0, what.find(' '));
    return moe_echo::cli::parameter_name(name) + " = (none) is invalid: allowed a value; " + name +
           " is required (" + help + ")";
  }
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e)) {
    const std::string name = what.substr(0, what.find(':'));
    return moe_echo::cli::parameter_name(name) + " = (no value) is invalid: allowed " + name +
           " followed by its value (" + help + ")";
  }
  if (dynamic_cast<const CLI::ConversionError*>(&e)) {  // a value_check-free option
    const std::string rest = after_colon(what);
    const size_t eq = rest.find(" = ");
    if (eq != std::string::npos)
      return moe_echo::cli::parameter_name(rest.substr(0, eq)) + " = '" + rest.substr(eq + 3) +
             "' is invalid: allowed a value of the option's type (" + help + ")";
  }
  return what + " (" + help + ")";
}

}  // namespace

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
  moe_echo::cli::add_schedule(app, run);
  try {
    try {
      app.parse(argc, argv);
    } catch (const CLI::Success& e) {
      return app.exit(e);  // --help, --version
    } catch (const CLI::ParseError& e) {
      std::cerr << "moe-echo: error: " << parse_message(app, e, argc, argv) << "\n";
      return 2;
    }
    return run ? run() : 0;
  } catch (const moe_echo::ConfigError& e) {
    std::cerr << "moe-echo: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moe-echo: error: " << e.what() << "\n";
    return 1;
  }
}
