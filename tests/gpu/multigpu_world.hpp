// The process's rank in a multi-GPU test run: started by `moe-echo launch -n N -- multigpu_test`
// (or torchrun), one process per GPU. The world (rendezvous, CUDA backend, NCCL communicators) is
// built once before the first test and torn down after the last, collectively.
//
// Tests skip (every rank alike) unless WORLD_SIZE >= 2 and this node has a GPU per rank. Every
// rank runs the same tests in the same order; a test must reach every collective on every rank,
// so checks are EXPECT_* (never an early return between collectives). A rank stuck in a
// collective is ended by the watchdog (MOE_ECHO_TIMEOUT_S, 300 s by default) or the launcher's
// --timeout, so a hang fails the run instead of holding the GPUs.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "moe_echo/backend.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/dist.hpp"
#include "moe_echo/nccl.hpp"

namespace moe_echo::test {

// The world's communicators: the default one, the baseline dispatcher (other ops on the device
// API), and host-API mode (every op on NCCL's host API, as across nodes).
enum class CommKind { syncfree, baseline, host_api };
inline constexpr CommKind kAllComms[] = {CommKind::syncfree, CommKind::baseline,
                                         CommKind::host_api};
inline const char* to_string(CommKind k) {
  return k == CommKind::syncfree ? "syncfree" : k == CommKind::baseline ? "baseline" : "host_api";
}

struct MultiGpuWorld {
  DistEnv env;
  std::unique_ptr<Rendezvous> rv;
  std::unique_ptr<Backend> be;
  std::unique_ptr<Communicator> syncfree;  // the default communicator
  std::unique_ptr<Communicator> baseline;  // host-API dispatcher, tiny all-reduce staging
  std::unique_ptr<Communicator> host_api;  // host-API mode (NcclOptions::host_api)

  int rank() const { return env.rank; }
  int size() const { return env.world_size; }
  Communicator& comm(Dispatcher d) { return d == Dispatcher::baseline ? *baseline : *syncfree; }
  Communicator& comm(CommKind k) {
    return k == CommKind::syncfree ? *syncfree : k == CommKind::baseline ? *baseline : *host_api;
  }

  // Every rank's `v` (trivially copyable elements), indexed by rank, through the rendezvous.
  template <class T>
  std::vector<std::vector<T>> all_gather(const std::vector<T>& v) {
    Bytes mine(v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(mine.data(), v.data(), mine.size());
    const std::vector<Bytes> all = rv->all_gather_bytes(mine);
    std::vector<std::vector<T>> out(all.size());
    for (size_t r = 0; r < all.size(); ++r) {
      out[r].resize(all[r].size() / sizeof(T));
      if (!out[r].empty()) std::memcpy(out[r].data(), all[r].data(), all[r].size());
    }
    return out;
  }
};

// The world, or nullptr when this run must skip (skip_reason() says why).
MultiGpuWorld* world();
const std::string& skip_reason();

#define MOE_ECHO_MULTIGPU_WORLD(w)                                \
  ::moe_echo::test::MultiGpuWorld* w = ::moe_echo::test::world(); \
  if (!w) GTEST_SKIP() << ::moe_echo::test::skip_reason()

}  // namespace moe_echo::test
