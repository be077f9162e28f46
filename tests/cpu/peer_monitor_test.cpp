// PeerMonitor and ProcessId (include/moe_echo/dist.hpp) with real processes: a forked child plays
// the peer rank, and is killed, stopped, continued or left running.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

#include "moe_echo/dist.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo {
namespace {

using namespace std::chrono_literals;

// A child process that sleeps until killed; reaped by the destructor.
struct Child {
  pid_t pid = -1;
  Child() {
    pid = ::fork();
    if (pid == 0) {
      // Dies with its parent (even stopped), and holds none of its output: a death test's
      // parent reads that to its end, which a stopped child would never give.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      const int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 1);
      ::dup2(null, 2);
      for (;;) ::pause();
    }
  }
  ~Child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
  // The child's ProcessId as the child would send it (its /proc entry exists once fork returned).
  ProcessId id() const {
    const ProcessId id = ProcessId::of(pid);
    EXPECT_GT(id.start_ticks, 0u) << "no /proc entry for the child";
    return id;
  }
};

PeerMonitor::Options fast(std::chrono::milliseconds stopped_grace = 300ms,
                          std::chrono::milliseconds exit_grace = 0ms,
                          std::chrono::milliseconds raised_grace = 0ms) {
  PeerMonitor::Options o;
  o.period = 20ms;
  o.stopped_grace = stopped_grace;
  o.exit_grace = exit_grace;
  o.raised_grace = raised_grace;
  return o;
}

// Waits up to `limit` for the monitor to report a loss.
std::optional<PeerLoss> wait_lost(const PeerMonitor& m, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    if (auto l = m.lost()) return l;
    std::this_thread::sleep_for(5ms);
  }
  return m.lost();
}

TEST(ProcessId, RoundTripsThroughBytesAndRefusesOthers) {
  const ProcessId me = ProcessId::self();
  EXPECT_EQ(me.pid, int64_t(::getpid()));
  EXPECT_GT(me.start_ticks, 0u);
  EXPECT_FALSE(me.host.empty());
  const ProcessId back = ProcessId::from_bytes(me.to_bytes());
  EXPECT_EQ(back.pid, me.pid);
  EXPECT_EQ(back.start_ticks, me.start_ticks);
  EXPECT_EQ(back.host, me.host);
  Bytes bad = me.to_bytes();
  bad.pop_back();
  EXPECT_THROW(ProcessId::from_bytes(bad), Error);
  EXPECT_THROW(ProcessId::from_bytes(Bytes(40, 0)), Error);
}

TEST(PeerMonitor, AKilledPeerIsReportedOnceByRank) {
  Child child;
  std::atomic<int> calls{0};
  PeerLoss seen;
  PeerMonitor m(
      0, {ProcessId::self(), child.id()}, nullptr,
      [&](const PeerLoss& l) {
        seen = l;
        ++calls;
      },
      fast());
  EXPECT_EQ(m.watched(), std::vector<int>{1});
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(m.lost()) << m.lost()->message;  // alive and running
  const auto t0 = std::chrono::steady_clock::now();
  ::kill(child.pid, SIGKILL);  // a zombie until reaped: counted as exited too
  const auto l = wait_lost(m, 2s);
  ASSERT_TRUE(l);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  EXPECT_EQ(l->kind, PeerLoss::Kind::exited);
  EXPECT_EQ(l->rank, 1);
  EXPECT_EQ(l->message, "rank 1 (pid " + std::to_string(child.pid) + ") exited");
  ::waitpid(child.pid, nullptr, 0);  // now gone from /proc altogether
  child.pid = -1;
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(seen.rank, 1);
}

TEST(PeerMonitor, AStoppedPeerIsReportedAfterTheGraceAndAContinuedOneIsNot) {
  Child child;
  PeerMonitor m(2, {child.id(), ProcessId::self(), ProcessId::self()}, nullptr, nullptr,
                fast(400ms));
  // Rank 1 has this process's id (same host): watched and alive. Rank 0 is the child.
  EXPECT_EQ(m.watched(), (std::vector<int>{0, 1}));
  ::kill(child.pid, SIGSTOP);
  std::this_thread::sleep_for(150ms);
  ::kill(child.pid, SIGCONT);  // stopped shorter than the grace: nothing to report
  std::this_thread::sleep_for(600ms);
  EXPECT_FALSE(m.lost());
  const auto t0 = std::chrono::steady_clock::now();
  ::kill(child.pid, SIGSTOP);
  const auto l = wait_lost(m, 3s);
  ASSERT_TRUE(l);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, 350ms);
  EXPECT_LT(took, 1500ms);
  EXPECT_EQ(l->kind, PeerLoss::Kind::stopped);
  EXPECT_EQ(l->rank, 0);
  EXPECT_NE(l->message.find("rank 0 (pid " + std::to_string(child.pid) + ") is stopped"),
            std::string::npos)
      << l->message;
}

TEST(PeerMonitor, AReusedPidOrAnotherHostIsNotTheSameProcess) {
  Child child;
  ProcessId other_start = child.id();
  other_start.start_ticks += 1;  // what a pid the kernel reused would show
  ProcessId elsewhere = child.id();
  elsewhere.host = "another host";
  PeerMonitor m(0, {ProcessId::self(), elsewhere, other_start}, nullptr, nullptr, fast());
  EXPECT_EQ(m.watched(), std::vector<int>{2});  // rank 1 is on another host: not watched
  const auto l = wait_lost(m, 2s);
  ASSERT_TRUE(l);
  EXPECT_EQ(l->rank, 2);
  EXPECT_EQ(l->kind, PeerLoss::Kind::exited);
  // The child itself is alive and running: only its start time told it apart.
  EXPECT_EQ(::kill(child.pid, 0), 0);
  EXPECT_EQ(ProcessId::of(child.pid).start_ticks + 1, other_start.start_ticks);
}

TEST(PeerMonitor, TheProbeReportsWhatTheProcessesCannot) {
  std::atomic<bool> fail{false};
  PeerMonitor m(
      0, {ProcessId::self()},
      [&]() -> std::optional<PeerLoss> {
        if (!fail.load()) return std::nullopt;
        return PeerLoss{PeerLoss::Kind::other, 3, 0, "rank 3 did not arrive"};
      },
      nullptr, fast());
  EXPECT_TRUE(m.watched().empty());
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(m.lost());
  fail = true;
  const auto l = wait_lost(m, 2s);
  ASSERT_TRUE(l);
  EXPECT_EQ(l->message, "rank 3 did not arrive");
}

TEST(PeerMonitor, RefusesBadArguments) {
  EXPECT_THROW(PeerMonitor(1, {ProcessId::self()}, nullptr, nullptr, fast()), Error);
  PeerMonitor::Options o = fast();
  o.period = 0ms;
  EXPECT_THROW(PeerMonitor(0, {ProcessId::self()}, nullptr, nullptr, o), Error);
  o = fast();
  o.raised_grace = -1ms;
  EXPECT_THROW(PeerMonitor(0, {ProcessId::self()}, nullptr, nullptr, o), Error);
}

// The probe of a wait that gave up once the loss is known (what the NCCL communicator's is).
using MonitorRef = std::atomic<const PeerMonitor*>;
std::function<std::optional<PeerLoss>()> waits_once_lost(MonitorRef& m) {
  return [&m]() -> std::optional<PeerLoss> {
    const PeerMonitor* p = m.load();
    if (p && p->lost()) return PeerLoss{PeerLoss::Kind::other, 1, 0, "a wait gave up"};
    return std::nullopt;
  };
}

TEST(PeerMonitorDeathTest, ALossAWaitIsStuckOnAndNobodyRaisesEndsTheProcessWithTheMessage) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        Child child;
        MonitorRef self{nullptr};
        PeerMonitor m(0, {ProcessId::self(), child.id()}, waits_once_lost(self), nullptr,
                      fast(300ms, 300ms));
        self = &m;
        ::kill(child.pid, SIGKILL);
        std::this_thread::sleep_for(5s);  // a step that never comes back to the library
        std::_Exit(0);
      },
      testing::ExitedWithCode(Watchdog::kExitCode),
      "moe-echo: rank 0: rank 1 \\(pid [0-9]+\\) exited; nothing raised it within 0.3 s; "
      "aborting");
}

TEST(PeerMonitorDeathTest, AStoppedPeerNobodyRaisesEndsTheProcessEvenWithNoWaitOfOurs) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        Child child;
        PeerMonitor m(
            0, {ProcessId::self(), child.id()}, [] { return std::optional<PeerLoss>(); }, nullptr,
            fast(300ms, 300ms));
        ::kill(child.pid, SIGSTOP);  // as a host wait of another library, blocked on it
        std::this_thread::sleep_for(5s);
        std::_Exit(0);
      },
      testing::ExitedWithCode(Watchdog::kExitCode),
      "moe-echo: rank 0: rank 1 \\(pid [0-9]+\\) is stopped \\(SIGSTOP or a terminal stop\\) "
      "for 0.3 s; nothing raised it within 0.3 s; aborting");
}

TEST(PeerMonitor, APeerThatEndsWhileNothingWaitsOnItDoesNotEndTheProcess) {
  Child child;
  PeerMonitor m(
      0, {ProcessId::self(), child.id()}, [] { return std::optional<PeerLoss>(); }, nullptr,
      fast(300ms, 200ms));
  ::kill(child.pid, SIGKILL);  // as a rank leaving first at the end of a run
  ASSERT_TRUE(wait_lost(m, 2s));
  std::this_thread::sleep_for(600ms);  // past the exit grace: still here, the loss kept
  EXPECT_EQ(m.lost()->rank, 1);
}

TEST(PeerMonitorDeathTest, ARaisedLossEndsAProcessStillRunningAfterTheRaisedGrace) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        Child child;
        MonitorRef self{nullptr};
        PeerMonitor m(0, {ProcessId::self(), child.id()}, waits_once_lost(self), nullptr,
                      fast(300ms, 200ms, 400ms));
        self = &m;
        ::kill(child.pid, SIGKILL);
        while (!m.lost()) std::this_thread::sleep_for(5ms);
        m.consume();                      // raised to the program, which then never ends
        std::this_thread::sleep_for(5s);  // (a teardown blocked on the lost peer)
        std::_Exit(0);
      },
      testing::ExitedWithCode(Watchdog::kExitCode),
      "moe-echo: rank 0: rank 1 \\(pid [0-9]+\\) exited; raised 0.4 s ago and the process is "
      "still running; aborting");
}

TEST(PeerMonitor, AConsumedLossDoesNotEndTheProcess) {
  Child child;
  MonitorRef self{nullptr};
  PeerMonitor m(0, {ProcessId::self(), child.id()}, waits_once_lost(self), nullptr,
                fast(300ms, 200ms));
  self = &m;
  ::kill(child.pid, SIGKILL);
  ASSERT_TRUE(wait_lost(m, 2s));
  m.consume();
  std::this_thread::sleep_for(500ms);  // past the exit grace: still here
  SUCCEED();
}

}  // namespace
}  // namespace moe_echo
