// The subcommands of `moe-echo`. Each add_* registers its options on `app` and, when its
// subcommand is chosen, sets `run` to the function that executes it and returns the exit code.
#pragma once

#include <CLI/CLI.hpp>
#include <charconv>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "moe_echo/config_fields.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cli {

using Runner = std::function<int()>;

// "default <v>" with v in its shortest form ("2", "1.25", "0.002"), for help texts that state a
// library default.
inline std::string default_is(double v) {
  std::ostringstream s;
  s << "default " << v;
  return s.str();
}

// The parameter name of a flag in messages: "--top-k" -> "top_k".
inline std::string parameter_name(std::string n) {
  n.erase(0, n.find_first_not_of('-'));
  for (char& c : n)
    if (c == '-') c = '_';
  return n;
}

namespace detail {
template <class T>
struct OptionValue {
  using type = T;
};
template <class T>
struct OptionValue<std::optional<T>> {
  using type = T;
};
template <class T>
struct OptionValue<std::vector<T>> {
  using type = T;
};

// Checks one command-line value of an option holding T before CLI11 converts it: a number must
// be written whole (no trailing characters), fit T (no wrapping: "-1" is not an unsigned value),
// and be finite; on/off for a bool. Throws ConfigError naming the parameter otherwise.
template <class T>
CLI::Validator value_check(std::string name) {
  return CLI::Validator(
      [name](std::string& text) -> std::string {
        const char *begin = text.data(), *end = text.data() + text.size();
        if constexpr (std::is_same_v<T, bool>) {
          if (text != "on" && text != "off" && text != "true" && text != "false" && text != "1" &&
              text != "0")
            reject(name, "'" + text + "'", "on or off");
        } else {
          T v{};
          const auto [ptr, ec] = std::from_chars(begin, end, v);
          bool ok = ec == std::errc() && ptr == end && !text.empty();
          if constexpr (std::is_floating_point_v<T>) ok = ok && std::isfinite(v);
          if (!ok) reject(name, "'" + text + "'", number_kind<T>());
        }
        return std::string();
      },
      "", "value_check");
}
}  // namespace detail

// cmd->add_option(flags, var, description), with every value checked by detail::value_check
// before it is converted, so that a value the option cannot hold exits 2 with the project's
// message ("tokens = '99999999999' is invalid: allowed an integer from ...") instead of
// wrapping, rounding or a parser message.
template <class V>
CLI::Option* add_option(CLI::App* cmd, const std::string& flags, V& var,
                        const std::string& description = "") {
  CLI::Option* opt = cmd->add_option(flags, var, description);
  using T = typename detail::OptionValue<V>::type;
  if constexpr (std::is_arithmetic_v<T>)
    opt->check(detail::value_check<T>(parameter_name(opt->get_name())));
  return opt;
}

void add_bench(CLI::App& app, Runner& run);
void add_train(CLI::App& app, Runner& run);
void add_simulate(CLI::App& app, Runner& run);
void add_plan(CLI::App& app, Runner& run);
void add_launch(CLI::App& app, Runner& run);
void add_schedule(CLI::App& app, Runner& run);

}  // namespace moe_echo::cli
