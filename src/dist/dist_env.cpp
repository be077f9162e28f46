// DistEnv::from_env and MOE_ECHO_TIMEOUT_S: torchrun's variables, strictly parsed. A typo in a
// launcher script must fail here with the variable's name, not later as a hang at rendezvous.
#include <charconv>
#include <cstdlib>
#include <string>

#include "moe_echo/dist.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo {
namespace {

const char* const kVariables[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"};

[[noreturn]] void reject(const std::string& name, const char* value, const std::string& allowed) {
  const std::string shown = value ? "'" + std::string(value) + "'" : "(not set)";
  throw ConfigError(name, name + " = " + shown + " is invalid: allowed " + allowed);
}

// The whole value as a decimal integer in [lo, hi], or reject.
int parse_int(const char* name, const char* value, long long lo, long long hi,
              const std::string& allowed) {
  if (!value) reject(name, value, allowed);
  const std::string s = value;
  long long v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || v < lo || v > hi)
    reject(name, value, allowed);
  return static_cast<int>(v);
}

}  // namespace

DistEnv DistEnv::from_env() {
  DistEnv env;
  bool any = false;
  for (const char* name : kVariables) any = any || std::getenv(name) != nullptr;
  if (!any) return env;  // a single process: rank 0 of 1

  const std::string together =
      " (set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT together, as torchrun and "
      "`moe-echo launch` do)";
  env.world_size = parse_int("WORLD_SIZE", std::getenv("WORLD_SIZE"), 1, 1 << 20,
                             "an integer 1 <= WORLD_SIZE <= 1048576" + together);
  const std::string ws = std::to_string(env.world_size);
  env.rank = parse_int("RANK", std::getenv("RANK"), 0, env.world_size - 1,
                       "an integer 0 <= RANK < WORLD_SIZE (" + ws + ")");
  env.local_rank = parse_int("LOCAL_RANK", std::getenv("LOCAL_RANK"), 0, env.world_size - 1,
                             "an integer 0 <= LOCAL_RANK < WORLD_SIZE (" + ws + ")");

  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  if (env.world_size == 1 && !addr && !port) return env;  // no rendezvous needed
  const std::string needed = env.world_size > 1 ? " (needed when WORLD_SIZE > 1)" : "";
  if (!addr || !*addr)
    reject("MASTER_ADDR", addr, "the host name or IP address of rank 0's node" + needed);
  env.master_addr = addr;
  // Under torchrun's shared store (TORCHELASTIC_USE_AGENT_STORE=True), torchrun's agent already
  // listens on MASTER_PORT on rank 0's node; the ranks then meet on the next port.
  const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool shifted = agent_store && std::string(agent_store) == "True";
  const int max_port = shifted ? 65534 : 65535;
  const std::string allowed =
      "an integer 1 <= MASTER_PORT <= " + std::to_string(max_port) +
      (shifted ? " (the rendezvous uses MASTER_PORT + 1 under torchrun's agent store)" : needed);
  env.master_port = parse_int("MASTER_PORT", port, 1, max_port, allowed) + (shifted ? 1 : 0);
  return env;
}

std::chrono::seconds default_timeout() {
  const char* value = std::getenv("MOE_ECHO_TIMEOUT_S");
  if (!value) return std::chrono::seconds(300);
  return std::chrono::seconds(parse_int("MOE_ECHO_TIMEOUT_S", value, 1, 1 << 30,
                                        "an integer number of seconds >= 1 (default 300)"));
}

std::chrono::seconds lost_peer_exit() {
  const char* value = std::getenv("MOE_ECHO_LOST_PEER_EXIT_S");
  if (!value) return std::chrono::seconds(15);
  return std::chrono::seconds(
      parse_int("MOE_ECHO_LOST_PEER_EXIT_S", value, 0, 1 << 30,
                "an integer number of seconds >= 0 (0: never; default 15)"));
}

}  // namespace moe_echo
