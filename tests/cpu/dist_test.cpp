// Bootstrap without GPUs: torchrun's variables, the TCP rendezvous (threads and real processes
// on a free port), its timeout messages, and the watchdog (in a forked child: it ends the
// process). Rows are self-describing: each rank's bytes encode the rank, so a lost, duplicated
// or misplaced contribution shows.
#include "moe_echo/dist.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "moe_echo/error.hpp"
#include "moe_echo/host_collectives.hpp"

namespace moe_echo {
namespace {

using namespace std::chrono_literals;

using Vars = std::map<std::string, std::optional<std::string>>;

// Sets variables for one test and restores the previous environment afterwards.
class ScopedEnv {
 public:
  explicit ScopedEnv(Vars values) {
    for (const char* name :
         {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOE_ECHO_TIMEOUT_S",
          "MOE_ECHO_LOST_PEER_EXIT_S", "TORCHELASTIC_USE_AGENT_STORE"}) {
      const char* old = std::getenv(name);
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
      ::unsetenv(name);
    }
    for (const auto& [k, v] : values)
      if (v) ::setenv(k.c_str(), v->c_str(), 1);
  }
  ~ScopedEnv() {
    for (const auto& [k, v] : saved_)
      if (v)
        ::setenv(k.c_str(), v->c_str(), 1);
      else
        ::unsetenv(k.c_str());
  }

 private:
  Vars saved_;
};

Vars torchrun_env(int rank, int world) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", std::to_string(rank)},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", "29555"}};
}

// With `values` set, `read` (by default DistEnv::from_env) throws ConfigError naming `name`, its
// message holding every one of `parts`.
void expect_env_error(
    Vars values, const std::string& name, const std::vector<std::string>& parts,
    const std::function<void()>& read = [] { DistEnv::from_env(); }) {
  ScopedEnv env(values);
  try {
    read();
    ADD_FAILURE() << "no error for " << name << (parts.empty() ? "" : ": " + parts.front());
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.field(), name);
    const std::string msg = e.what();
    for (const std::string& part : parts) EXPECT_NE(msg.find(part), std::string::npos) << msg;
  }
}

TEST(DistEnv, NoVariablesMeansRankZeroOfOne) {
  ScopedEnv env(Vars{});
  const DistEnv d = DistEnv::from_env();
  EXPECT_EQ(d.rank, 0);
  EXPECT_EQ(d.world_size, 1);
  EXPECT_EQ(d.local_rank, 0);
  EXPECT_EQ(default_timeout(), 300s);
}

TEST(DistEnv, ReadsTorchrunVariables) {
  auto values = torchrun_env(3, 8);
  values["LOCAL_RANK"] = "1";
  values["MASTER_ADDR"] = "node-7";
  values["MOE_ECHO_TIMEOUT_S"] = "42";
  ScopedEnv env(values);
  const DistEnv d = DistEnv::from_env();
  EXPECT_EQ(d.rank, 3);
  EXPECT_EQ(d.world_size, 8);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.master_addr, "node-7");
  EXPECT_EQ(d.master_port, 29555);
  EXPECT_EQ(default_timeout(), 42s);
}

TEST(DistEnv, TorchrunAgentStoreMovesTheRendezvousToTheNextPort) {
  auto values = torchrun_env(0, 2);
  values["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  {
    ScopedEnv env(values);
    EXPECT_EQ(DistEnv::from_env().master_port, 29556);
  }
  values["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  {
    ScopedEnv env(values);
    EXPECT_EQ(DistEnv::from_env().master_port, 29555);
  }
  values["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  values["MASTER_PORT"] = "65535";
  expect_env_error(values, "MASTER_PORT", {"MASTER_PORT = '65535'", "MASTER_PORT + 1"});
}

TEST(DistEnv, WorldOfOneNeedsNoMaster) {
  ScopedEnv env(Vars{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}});
  EXPECT_EQ(DistEnv::from_env().world_size, 1);
}

TEST(DistEnv, MalformedVariablesNameVariableValueAndRange) {
  auto with = [](const char* name, std::optional<std::string> value) {
    auto values = torchrun_env(1, 4);
    values[name] = std::move(value);
    return values;
  };
  expect_env_error(with("RANK", "x"), "RANK",
                   {"RANK = 'x' is invalid: allowed an integer 0 <= RANK < WORLD_SIZE (4)"});
  expect_env_error(with("RANK", "4"), "RANK", {"RANK = '4'", "WORLD_SIZE (4)"});
  expect_env_error(with("RANK", "-1"), "RANK", {"RANK = '-1'"});
  expect_env_error(with("RANK", "1 "), "RANK", {"RANK = '1 '"});
  expect_env_error(with("RANK", ""), "RANK", {"RANK = ''"});
  expect_env_error(with("RANK", std::nullopt), "RANK", {"RANK = (not set)", "allowed"});
  expect_env_error(with("WORLD_SIZE", "0"), "WORLD_SIZE", {"WORLD_SIZE = '0'", "allowed"});
  expect_env_error(with("WORLD_SIZE", "99999999999999999999"), "WORLD_SIZE", {"allowed"});
  expect_env_error(with("WORLD_SIZE", std::nullopt), "WORLD_SIZE", {"WORLD_SIZE = (not set)"});
  expect_env_error(with("LOCAL_RANK", "4"), "LOCAL_RANK", {"LOCAL_RANK = '4'", "WORLD_SIZE (4)"});
  expect_env_error(with("LOCAL_RANK", std::nullopt), "LOCAL_RANK", {"LOCAL_RANK = (not set)"});
  expect_env_error(with("MASTER_ADDR", std::nullopt), "MASTER_ADDR",
                   {"MASTER_ADDR = (not set)", "WORLD_SIZE > 1"});
  expect_env_error(with("MASTER_ADDR", ""), "MASTER_ADDR", {"MASTER_ADDR = ''"});
  expect_env_error(
      with("MASTER_PORT", "70000"), "MASTER_PORT",
      {"MASTER_PORT = '70000' is invalid: allowed an integer 1 <= MASTER_PORT <= 65535"});
  expect_env_error(with("MASTER_PORT", "0x10"), "MASTER_PORT", {"MASTER_PORT = '0x10'"});
  expect_env_error(with("MASTER_PORT", std::nullopt), "MASTER_PORT", {"MASTER_PORT = (not set)"});
  // One variable alone is a mistake, not a single process.
  expect_env_error({{"RANK", "0"}}, "WORLD_SIZE", {"WORLD_SIZE = (not set)", "together"});
}

// Each of `bad` as the value of `var` makes `read` throw ConfigError naming var and the value.
void expect_rejected(const std::string& var, std::initializer_list<const char*> bad,
                     const std::function<void()>& read) {
  for (const char* value : bad)
    expect_env_error(Vars{{var, value}}, var, {var + " = '" + value + "'"}, read);
}

TEST(DistEnv, LostPeerExitVariable) {
  {
    ScopedEnv env(Vars{});
    EXPECT_EQ(lost_peer_exit(), 15s);
  }
  {
    ScopedEnv env(Vars{{"MOE_ECHO_LOST_PEER_EXIT_S", "0"}});
    EXPECT_EQ(lost_peer_exit(), 0s);
  }
  expect_rejected("MOE_ECHO_LOST_PEER_EXIT_S", {"-1", "abc", "2.5", ""}, [] { lost_peer_exit(); });
}

TEST(DistEnv, TimeoutVariable) {
  expect_rejected("MOE_ECHO_TIMEOUT_S", {"0", "-5", "abc", "1.5", ""}, [] { default_timeout(); });
}

DistEnv local_env(int rank, int world, int port) {
  DistEnv d;
  d.rank = rank;
  d.world_size = world;
  d.local_rank = rank;
  d.master_addr = "127.0.0.1";
  d.master_port = port;
  return d;
}

// Runs fn(rank) on one thread per rank; returns each rank's error message ("" when none).
std::vector<std::string> run_ranks(int world, const std::function<void(int)>& fn,
                                   const std::vector<int>& ranks = {}) {
  std::vector<int> which = ranks;
  if (which.empty())
    for (int r = 0; r < world; ++r) which.push_back(r);
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (const int r : which)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  return errors;
}

// Rank r's contribution: r + 1 copies of a byte that encodes (r, round); rank 0's is empty.
Bytes contribution(int r, int round) {
  return Bytes(size_t(r == 0 ? 0 : r + 1), uint8_t(r * 16 + round));
}

TEST(Rendezvous, ThreadsExchangeBytesAndBarriers) {
  for (const int world : {1, 2, 5}) {
    const int port = free_tcp_port();
    const auto errors = run_ranks(world, [&](int r) {
      Rendezvous rv(local_env(r, world, port), 20s);
      EXPECT_EQ(rv.rank(), r);
      for (int round = 0; round < 3; ++round) {
        const std::vector<Bytes> all = rv.all_gather_bytes(contribution(r, round));
        ASSERT_EQ(all.size(), size_t(world));
        for (int s = 0; s < world; ++s) EXPECT_EQ(all[size_t(s)], contribution(s, round));
        rv.barrier();
      }
      // The NCCL unique id: 128 bytes from rank 0, then from the last rank.
      Bytes id(128);
      for (size_t i = 0; i < id.size(); ++i) id[i] = uint8_t(i * 7 + r);
      Bytes expected(128);
      for (size_t i = 0; i < expected.size(); ++i) expected[i] = uint8_t(i * 7);
      EXPECT_EQ(rv.broadcast_bytes(id), expected);
      for (size_t i = 0; i < expected.size(); ++i) expected[i] = uint8_t(i * 7 + world - 1);
      EXPECT_EQ(rv.broadcast_bytes(id, world - 1), expected);
      // A large message crosses many socket buffers.
      const Bytes big(3 << 20, uint8_t(r));
      const std::vector<Bytes> all = rv.all_gather_bytes(big);
      for (int s = 0; s < world; ++s) EXPECT_EQ(all[size_t(s)], Bytes(3 << 20, uint8_t(s)));
    });
    for (const std::string& e : errors) EXPECT_EQ(e, "");
  }
}

TEST(Rendezvous, HostCollectivesOverIt) {
  // make_rendezvous_collectives: all_gather and all_to_all_v with segments of different sizes
  // (empty ones included), every byte where HostCollectives says.
  for (const int world : {1, 3}) {
    const int port = free_tcp_port();
    const auto errors = run_ranks(world, [&](int r) {
      Rendezvous rv(local_env(r, world, port), 20s);
      const std::unique_ptr<HostCollectives> hc = make_rendezvous_collectives(rv);
      EXPECT_EQ(hc->rank(), r);
      EXPECT_EQ(hc->size(), world);
      const uint64_t mine = 1000 + uint64_t(r);
      std::vector<uint64_t> all(size_t(world), 0);
      hc->all_gather(&mine, all.data(), sizeof mine);
      for (int s = 0; s < world; ++s) EXPECT_EQ(all[size_t(s)], 1000 + uint64_t(s));
      // Rank s sends (s + d) % 3 bytes of value 16 s + d to rank d.
      auto bytes = [](int s, int d) { return size_t((s + d) % 3); };
      std::vector<size_t> send_bytes, recv_bytes;
      Bytes send, expected;
      for (int d = 0; d < world; ++d) {
        send_bytes.push_back(bytes(r, d));
        send.insert(send.end(), bytes(r, d), uint8_t(16 * r + d));
        recv_bytes.push_back(bytes(d, r));
        expected.insert(expected.end(), bytes(d, r), uint8_t(16 * d + r));
      }
      Bytes recv(expected.size(), 0xee);
      hc->all_to_all_v(send.data(), send_bytes, recv.data(), recv_bytes);
      EXPECT_EQ(recv, expected);
      hc->barrier();
    });
    for (const std::string& e : errors) EXPECT_EQ(e, "");
  }
}

TEST(Rendezvous, ForkedProcessesExchangeBytes) {
  const int world = 3, port = free_tcp_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int code = 0;
      try {
        Rendezvous rv(local_env(r, world, port), 20s);
        const std::vector<Bytes> all = rv.all_gather_bytes(contribution(r, 0));
        for (int s = 0; s < world; ++s)
          if (all[size_t(s)] != contribution(s, 0)) code = 10 + s;
        rv.barrier();
        if (rv.broadcast_bytes(Bytes(128, uint8_t(r + 1))) != Bytes(128, 1)) code = 20;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        code = 30;
      }
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  for (int r = 0; r < world; ++r) {
    int status = 0;
    ASSERT_EQ(::waitpid(pids[size_t(r)], &status, 0), pids[size_t(r)]);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "rank " << r;
  }
}

TEST(Rendezvous, RanksThatNeverConnectAreNamed) {
  const int port = free_tcp_port();
  const auto start = std::chrono::steady_clock::now();
  const auto errors =
      run_ranks(4, [&](int r) { Rendezvous rv(local_env(r, 4, port), 2s); }, {0, 1});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string expected =
      "rendezvous at 127.0.0.1:" + std::to_string(port) + ": ranks 2, 3 did not connect within 2 s";
  EXPECT_EQ(errors[0], expected);
  // Rank 1 connected: rank 0 tells it the same cause.
  EXPECT_EQ(errors[1], expected + " (reported by rank 0)");
  EXPECT_LT(seconds, 5.0);
}

TEST(Rendezvous, RankZeroThatNeverListensIsReported) {
  const int port = free_tcp_port();
  const auto errors = run_ranks(2, [&](int r) { Rendezvous rv(local_env(r, 2, port), 1s); }, {1});
  EXPECT_NE(errors[1].find("rank 1 could not connect to rank 0 within 1 s"), std::string::npos)
      << errors[1];
  EXPECT_NE(errors[1].find("Connection refused"), std::string::npos) << errors[1];
}

TEST(Rendezvous, RankThatNeverArrivesAtABarrierIsNamed) {
  const int port = free_tcp_port();
  const auto errors = run_ranks(3, [&](int r) {
    Rendezvous rv(local_env(r, 3, port), 1s);
    rv.barrier();
    if (r == 2) {
      std::this_thread::sleep_for(2500ms);  // misses the second barrier; stays connected
      return;
    }
    rv.barrier();
  });
  const std::string expected = "rendezvous at 127.0.0.1:" + std::to_string(port) +
                               ": barrier: rank 2 did not arrive within 1 s";
  EXPECT_EQ(errors[0], expected);
  EXPECT_EQ(errors[1], expected + " (reported by rank 0)");
  EXPECT_EQ(errors[2], "");
}

TEST(Rendezvous, RankThatDiesFailsTheOthersAtOnce) {
  const int port = free_tcp_port();
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks(3, [&](int r) {
    Rendezvous rv(local_env(r, 3, port), 30s);
    if (r == 1) return;  // its sockets close, as when its process dies
    rv.all_gather_bytes(contribution(r, 0));
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(errors[0].find("all_gather_bytes: rank 1 closed its connection"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[2].find("rank 1 closed its connection"), std::string::npos) << errors[2];
  EXPECT_LT(seconds, 10.0);  // far below the 30 s timeout
}

TEST(Rendezvous, MismatchedOperationsAreReported) {
  const int port = free_tcp_port();
  const auto errors = run_ranks(2, [&](int r) {
    Rendezvous rv(local_env(r, 2, port), 10s);
    try {
      if (r == 0)
        rv.all_gather_bytes({1, 2, 3});
      else
        rv.barrier();
      ADD_FAILURE() << "no error on rank " << r;
    } catch (const Error&) {
      try {
        rv.barrier();  // a failed rendezvous stays failed
      } catch (const Error& later) {
        EXPECT_NE(std::string(later.what()).find("unusable"), std::string::npos);
      }
      throw;
    }
  });
  for (const std::string& e : errors)
    EXPECT_NE(e.find("rank 1 called barrier (operation 0) while rank 0 called all_gather_bytes"),
              std::string::npos)
        << e;
}

TEST(Rendezvous, DifferentWorldSizesAreReported) {
  const int port = free_tcp_port();
  const auto errors =
      run_ranks(2, [&](int r) { Rendezvous rv(local_env(r, r == 0 ? 2 : 3, port), 10s); });
  EXPECT_NE(errors[0].find("rank 1 has WORLD_SIZE 3 but rank 0 has 2"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("rank 1 has WORLD_SIZE 3 but rank 0 has 2"), std::string::npos)
      << errors[1];
}

TEST(Rendezvous, StrayClientsAreIgnored) {
  const int port = free_tcp_port();
  const auto errors = run_ranks(3, [&](int r) {
    if (r == 2) {  // not a rank: one client writes garbage, another stays silent
      const auto connect_client = [&] {
        const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_port = htons(uint16_t(port));
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        while (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
          std::this_thread::sleep_for(10ms);
        return fd;
      };
      const char junk[] = "GET / HTTP/1.0\r\n\r\n";
      const int noisy = connect_client();
      EXPECT_GT(::write(noisy, junk, sizeof junk - 1), 0);
      ::close(noisy);
      const int silent = connect_client();
      std::this_thread::sleep_for(1s);  // still connected while the ranks meet
      ::close(silent);
      return;
    }
    std::this_thread::sleep_for(r == 1 ? 300ms : 0ms);  // the stray clients come first
    Rendezvous rv(local_env(r, 2, port), 10s);
    const std::vector<Bytes> all = rv.all_gather_bytes(contribution(r, 0));
    EXPECT_EQ(all[1], contribution(1, 0));
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(Rendezvous, BusyPortIsNamed) {
  const int port = free_tcp_port();
  // Rank 0 of one job holds the port while rank 0 of another tries to listen on it.
  const auto errors = run_ranks(2, [&](int r) {
    if (r == 0) {
      try {
        Rendezvous holder(local_env(0, 2, port), 1s);
      } catch (const Error&) {
      }
    } else {
      std::this_thread::sleep_for(300ms);
      Rendezvous rv(local_env(0, 2, port), 1s);
    }
  });
  EXPECT_NE(errors[1].find("rank 0 cannot listen on port " + std::to_string(port)),
            std::string::npos)
      << errors[1];
}

TEST(Watchdog, KicksKeepItQuietAndSilenceEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        Watchdog dog(1s, "training step", 3);
        for (int i = 0; i < 8; ++i) {  // 1.6 s of steady progress: no timeout
          std::this_thread::sleep_for(200ms);
          dog.kick();
        }
        std::fprintf(stderr, "survived the kicks\n");
        std::this_thread::sleep_for(10s);  // a hang
        std::_Exit(0);
      },
      testing::ExitedWithCode(Watchdog::kExitCode),
      "survived the kicks\nmoe-echo: rank 3: no progress in training step for 1 s \\(watchdog "
      "timeout; set MOE_ECHO_TIMEOUT_S to change it\\); aborting");
}

TEST(Watchdog, DisarmPausesItAndArmRestartsIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ::setenv("RANK", "5", 1);
        Watchdog dog(500ms, "checkpoint");
        dog.disarm();
        std::this_thread::sleep_for(1200ms);
        std::fprintf(stderr, "disarmed ok\n");
        dog.arm();
        std::this_thread::sleep_for(5s);
        std::_Exit(0);
      },
      testing::ExitedWithCode(Watchdog::kExitCode),
      "disarmed ok\nmoe-echo: rank 5: no progress in checkpoint for 0.5 s");
}

TEST(Watchdog, NeverFiresAfterDestruction) {
  const auto start = std::chrono::steady_clock::now();
  { Watchdog dog(200ms, "nothing", 0); }
  std::this_thread::sleep_for(400ms);                       // the process is still here
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);  // the destructor did not wait
}

// Run under `moe-echo launch` (see tests/CMakeLists.txt): the ranks find each other from the
// environment alone. Skipped when run on its own.
TEST(Launched, RendezvousFromEnvironment) {
  if (!std::getenv("WORLD_SIZE")) GTEST_SKIP() << "not started by moe-echo launch";
  const DistEnv env = DistEnv::from_env();
  Rendezvous rv(env, 30s);
  const std::vector<Bytes> all = rv.all_gather_bytes(contribution(env.rank, 1));
  ASSERT_EQ(all.size(), size_t(env.world_size));
  for (int s = 0; s < env.world_size; ++s) EXPECT_EQ(all[size_t(s)], contribution(s, 1));
  rv.barrier();
  std::printf("rank %d of %d: rendezvous ok\n", env.rank, env.world_size);
}

}  // namespace
}  // namespace moe_echo
