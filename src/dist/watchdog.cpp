// Watchdog: ends a process whose step loop has stopped making progress (dist.hpp says why this
// is the one place where library code ends the process).
//
// kick() is one atomic store and never wakes the thread: the thread sleeps until the deadline of
// the last kick it saw, then looks again, so the cost per step is independent of the timeout.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "dist/dist_util.hpp"
#include "moe_echo/dist.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo {
namespace {

using dist_util::steady_ns;

int rank_from_env() {
  const char* value = std::getenv("RANK");
  int rank = 0;
  if (!value || std::from_chars(value, value + std::strlen(value), rank).ec != std::errc())
    return 0;
  return rank;
}

}  // namespace

Watchdog::Watchdog(std::chrono::milliseconds timeout, std::string what, int rank)
    : timeout_(timeout),
      what_(std::move(what)),
      rank_(rank >= 0 ? rank : rank_from_env()),
      last_kick_ns_(steady_ns()) {
  MOE_ECHO_CHECK(timeout.count() > 0, "watchdog timeout " << timeout.count() << " ms");
  thread_ = std::thread([this] { watch(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  thread_.join();
}

void Watchdog::kick() { last_kick_ns_.store(steady_ns(), std::memory_order_relaxed); }

void Watchdog::arm() {
  kick();
  armed_.store(true);
}

void Watchdog::disarm() { armed_.store(false); }

void Watchdog::watch() {
  const int64_t timeout_ns = std::chrono::nanoseconds(timeout_).count();
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    const int64_t due_ns = last_kick_ns_.load(std::memory_order_relaxed) + timeout_ns;
    const int64_t now = steady_ns();
    if (!armed_.load() || now < due_ns) {
      // Disarmed: look again after one timeout (arm() restarts the clock anyway).
      const int64_t wait_ns = armed_.load() ? due_ns - now : timeout_ns;
      stop_cv_.wait_for(lock, std::chrono::nanoseconds(wait_ns));
      continue;
    }
    char message[512];
    const int n = std::snprintf(
        message, sizeof message,
        "moe-echo: rank %d: no progress in %s for %g s (watchdog timeout; set MOE_ECHO_TIMEOUT_S "
        "to change it); aborting\n",
        rank_, what_.c_str(), double(timeout_.count()) / 1000.0);
    dist_util::end_process(message, n, sizeof message);
  }
}

}  // namespace moe_echo
