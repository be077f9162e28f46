// PeerMonitor: watches the processes of the other ranks on this host through /proc (dist.hpp
// says what it reports and when it ends the process).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "dist/dist_util.hpp"
#include "moe_echo/dist.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo {
namespace {

using dist_util::get_u64;
using dist_util::put_u64;

struct Stat {
  char state = '?';
  uint64_t start_ticks = 0;
};

// /proc/<pid>/stat's state (field 3) and start time (field 22); nullopt when there is no such
// process (or /proc cannot be read).
std::optional<Stat> read_stat(int64_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!f || !std::getline(f, line)) return std::nullopt;
  const size_t close = line.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(line.substr(close + 1));
  Stat st;
  std::string field;
  rest >> st.state;
  for (int i = 4; i < 22 && rest >> field; ++i) {
  }
  if (!(rest >> st.start_ticks)) return std::nullopt;
  return st;
}

std::string first_line(const char* path) {
  std::ifstream f(path);
  std::string line;
  if (f) std::getline(f, line);
  return line;
}

constexpr uint64_t kProcessIdMagic = 0x6469636f7270656dull;  // "meprocid"

}  // namespace

ProcessId ProcessId::self() { return of(int64_t(::getpid())); }

ProcessId ProcessId::of(int64_t pid) {
  ProcessId id;
  id.pid = pid;
  const std::optional<Stat> st = read_stat(id.pid);
  id.start_ticks = st ? st->start_ticks : 0;
  char ns[128] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  const std::string boot = first_line("/proc/sys/kernel/random/boot_id");
  if (st && n > 0 && !boot.empty()) id.host = boot + " " + std::string(ns, size_t(n));
  return id;
}

Bytes ProcessId::to_bytes() const {
  Bytes out;
  put_u64(out, kProcessIdMagic);
  put_u64(out, uint64_t(pid));
  put_u64(out, start_ticks);
  put_u64(out, host.size());
  out.insert(out.end(), host.begin(), host.end());
  return out;
}

ProcessId ProcessId::from_bytes(const Bytes& b) {
  MOE_ECHO_CHECK(b.size() >= 32 && get_u64(b.data()) == kProcessIdMagic &&
                     get_u64(b.data() + 24) == b.size() - 32,
                 "not a process id (" << b.size() << " bytes)");
  ProcessId id;
  id.pid = int64_t(get_u64(b.data() + 8));
  id.start_ticks = get_u64(b.data() + 16);
  id.host.assign(b.begin() + 32, b.end());
  return id;
}

PeerMonitor::PeerMonitor(int rank, std::vector<ProcessId> peers,
                         std::function<std::optional<PeerLoss>()> probe,
                         std::function<void(const PeerLoss&)> on_lost, Options options)
    : rank_(rank),
      peers_(std::move(peers)),
      stopped_since_ns_(peers_.size(), 0),
      probe_(std::move(probe)),
      on_lost_(std::move(on_lost)),
      options_(options) {
  MOE_ECHO_CHECK(rank >= 0 && rank < int(peers_.size()),
                 "rank " << rank << " of " << peers_.size() << " processes");
  MOE_ECHO_CHECK(options_.period.count() > 0 && options_.stopped_grace.count() >= 0 &&
                     options_.exit_grace.count() >= 0 && options_.raised_grace.count() >= 0,
                 "PeerMonitor periods: period "
                     << options_.period.count() << " ms, stopped_grace "
                     << options_.stopped_grace.count() << " ms, exit_grace "
                     << options_.exit_grace.count() << " ms, raised_grace "
                     << options_.raised_grace.count() << " ms (each >= 0, the period > 0)");
  const std::string& mine = peers_[size_t(rank)].host;
  for (int r = 0; r < int(peers_.size()); ++r)
    if (r != rank && !mine.empty() && peers_[size_t(r)].host == mine && peers_[size_t(r)].pid > 0)
      watched_.push_back(r);
  thread_ = std::thread([this] { watch(); });
}

PeerMonitor::~PeerMonitor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  thread_.join();
}

void PeerMonitor::consume() {
  int64_t none = 0;
  consumed_ns_.compare_exchange_strong(none, std::max<int64_t>(dist_util::steady_ns(), 1));
}

std::optional<PeerLoss> PeerMonitor::lost() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lost_;
}

std::optional<PeerLoss> PeerMonitor::look(int r, int64_t now) {
  const ProcessId& p = peers_[size_t(r)];
  const std::optional<Stat> st = read_stat(p.pid);
  const std::string who = "rank " + std::to_string(r) + " (pid " + std::to_string(p.pid) + ")";
  if (!st || st->state == 'Z' || st->state == 'X' || st->start_ticks != p.start_ticks)
    return PeerLoss{PeerLoss::Kind::exited, r, p.pid, who + " exited"};
  int64_t& since = stopped_since_ns_[size_t(r)];
  if (st->state != 'T') {
    since = 0;
    return std::nullopt;
  }
  if (since == 0) since = now;
  const int64_t grace_ns = std::chrono::nanoseconds(options_.stopped_grace).count();
  if (now - since < grace_ns) return std::nullopt;
  char s[32];
  std::snprintf(s, sizeof s, "%g s", double(options_.stopped_grace.count()) / 1000.0);
  return PeerLoss{PeerLoss::Kind::stopped, r, p.pid,
                  who + " is stopped (SIGSTOP or a terminal stop) for " + s};
}

void PeerMonitor::watch() {
  int64_t stuck_ns = 0;  // when the probe first reported: something waits on the loss
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    stop_cv_.wait_for(lock, options_.period);
    if (stop_) break;
    const int64_t now = dist_util::steady_ns();
    lock.unlock();
    std::optional<PeerLoss> loss;
    if (!lost_)
      for (int r : watched_)
        if ((loss = look(r, now))) break;
    std::optional<PeerLoss> stuck;
    if (probe_ && stuck_ns == 0) stuck = probe_();
    lock.lock();
    if (stuck) stuck_ns = now;
    if (!lost_ && !loss) loss = stuck;
    // A stopped peer blocks whatever waits on it, ours or not: its loss starts the clock itself.
    if (loss && loss->kind == PeerLoss::Kind::stopped && stuck_ns == 0) stuck_ns = now;
    if (!lost_ && loss) {
      lost_ = loss;
      lock.unlock();
      if (on_lost_) on_lost_(*loss);
      lock.lock();
    }
    if (!lost_) continue;
    const int64_t consumed_ns = consumed_ns_.load();
    char message[768];
    int n = 0;
    if (consumed_ns != 0) {
      const int64_t grace_ns = std::chrono::nanoseconds(options_.raised_grace).count();
      if (grace_ns == 0 || now - consumed_ns < grace_ns) continue;
      n = std::snprintf(message, sizeof message,
                        "moe-echo: rank %d: %s; raised %g s ago and the process is still "
                        "running; aborting\n",
                        rank_, lost_->message.c_str(),
                        double(options_.raised_grace.count()) / 1000.0);
    } else {
      const int64_t grace_ns = std::chrono::nanoseconds(options_.exit_grace).count();
      if (stuck_ns == 0 || grace_ns == 0 || now - stuck_ns < grace_ns) continue;
      n = std::snprintf(message, sizeof message,
                        "moe-echo: rank %d: %s; nothing raised it within %g s; aborting\n", rank_,
                        lost_->message.c_str(), double(options_.exit_grace.count()) / 1000.0);
    }
    dist_util::end_process(message, n, sizeof message);
  }
}

}  // namespace moe_echo
