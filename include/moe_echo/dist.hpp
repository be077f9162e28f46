// Processes and bootstrap: one process per GPU.
//
// Ranks learn who they are from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT); `moe-echo launch -n N` sets the same ones. They meet at a small TCP rendezvous on
// MASTER_ADDR:MASTER_PORT (rank 0 listens, the others connect) to exchange the NCCL unique id and
// to wait for each other. Every blocking call has a deadline and names the ranks that did not
// arrive; a Watchdog ends a process whose steps stop making progress, so that one dead or hung
// rank never leaves the others waiting forever. docs/launch.md is the user's side of this.
//
// None of this needs NCCL or a GPU: it is plain POSIX sockets and threads, tested in CI.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace moe_echo {

// Where this process sits among the ranks of a job.
struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // index of this process on its node: its GPU among CUDA_VISIBLE_DEVICES
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // of the rendezvous: MASTER_PORT, + 1 under torchrun's agent store

  // Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. With none of them set, the
  // process is rank 0 of 1 (the defaults above). Otherwise RANK, WORLD_SIZE and LOCAL_RANK must
  // be set, and MASTER_ADDR and MASTER_PORT too when WORLD_SIZE > 1. When torchrun's agent
  // hosts its own store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True, its default), the
  // rendezvous uses MASTER_PORT + 1 on the same host. A missing or malformed
  // variable throws ConfigError naming it, its value and what is allowed, e.g.
  // "RANK = 'x' is invalid: allowed an integer 0 <= RANK < WORLD_SIZE (4)".
  static DistEnv from_env();
};

// The deadline of every blocking rendezvous call, of the watchdog and of the NCCL communicator's
// device waits for a live peer: MOE_ECHO_TIMEOUT_S seconds (an integer >= 1; ConfigError
// otherwise), 300 s when unset.
std::chrono::seconds default_timeout();
// How long a process may keep running once a lost peer was raised to it (PeerMonitor's
// raised_grace in the NCCL communicator): MOE_ECHO_LOST_PEER_EXIT_S seconds, an integer >= 0
// (0: never ended for it; default 15). ConfigError naming the variable otherwise.
std::chrono::seconds lost_peer_exit();

// A TCP port on 127.0.0.1 that was free when asked (the OS picks it; another process may take it
// before it is used, which is rare). For tests and `moe-echo launch --master-port 0`.
int free_tcp_port();

using Bytes = std::vector<uint8_t>;

// A star-shaped rendezvous store: rank 0 listens on MASTER_ADDR:MASTER_PORT (every interface,
// like torchrun), ranks 1..N-1 connect to it. The constructor returns once all N ranks are
// connected, so it is itself a barrier. Every operation is collective: all ranks call the same
// operations in the same order (a mismatch is detected and reported). Each call blocks for at
// most `timeout` and then throws moe_echo::Error naming the ranks that did not arrive, e.g.
// "rendezvous at 127.0.0.1:29500: ranks 2, 3 did not connect within 30 s"; rank 0 sends the same
// message to the ranks that did arrive, so every rank reports the same cause. A rank whose
// process dies closes its socket: the others fail at once instead of waiting for the timeout.
// A failed Rendezvous is unusable (it throws on every later call). Host-side setup only: never
// on a step's hot path. With WORLD_SIZE 1 there are no sockets and every call returns at once.
class Rendezvous {
 public:
  explicit Rendezvous(const DistEnv& env, std::chrono::milliseconds timeout = default_timeout());
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }

  // Returns every rank's `local`, indexed by rank. Sizes may differ between ranks.
  std::vector<Bytes> all_gather_bytes(const Bytes& local);
  // Returns the root's `bytes` on every rank (the others' `bytes` are ignored). The NCCL unique
  // id (128 bytes) is shared this way from rank 0.
  Bytes broadcast_bytes(const Bytes& bytes, int root = 0);
  // Returns once every rank has called barrier().
  void barrier();

 private:
  using Deadline = std::chrono::steady_clock::time_point;
  void connect_to_rank0(Deadline deadline);
  void accept_ranks(Deadline deadline);
  std::vector<Bytes> exchange(uint8_t op, const Bytes& local);
  [[noreturn]] void fail(const std::string& message);
  std::string where() const;

  DistEnv env_;
  std::chrono::milliseconds timeout_;
  uint64_t sequence_ = 0;  // number of operations so far; ranks must agree on it
  bool failed_ = false;
  // Rank 0: fds_[r] is the socket of rank r (fds_[0] unused). Other ranks: fds_[0] is rank 0's.
  std::vector<int> fds_;
};

// Ends the process when the step loop stops making progress.
//
// A background thread waits for kick(); when none arrives within `timeout` while armed, it
// prints "moe-echo: rank R: no progress in <what> for N s (watchdog timeout; set
// MOE_ECHO_TIMEOUT_S to change it); aborting" to stderr and calls _exit(kExitCode).
//
// This is the one place where library code ends the process instead of throwing: a rank stuck
// in a collective (an NCCL kernel spinning on a peer that died, a device-API barrier) cannot be
// interrupted or unwound from another thread, and its peers wait on it in turn. Exiting frees
// the GPU and closes the rendezvous sockets, so the launcher (or torchrun) sees the exit code and
// stops the job with a message instead of hanging forever. _exit skips destructors and atexit
// handlers on purpose: CUDA and NCCL teardown can block on the very kernel that is stuck.
class Watchdog {
 public:
  static constexpr int kExitCode = 124;  // as timeout(1); `moe-echo launch` reports it as such

  // Starts armed. `rank` < 0 reads RANK from the environment (0 when unset or malformed).
  Watchdog(std::chrono::milliseconds timeout, std::string what, int rank = -1);
  ~Watchdog();  // stops the thread; never fires afterwards
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Progress: the timeout restarts from now. Lock-free; cheap enough to call every step.
  void kick();
  // arm() restarts the timeout and enables the watchdog; disarm() pauses it (for work that may
  // legitimately take longer, such as writing a checkpoint).
  void arm();
  void disarm();

 private:
  void watch();

  std::chrono::milliseconds timeout_;
  std::string what_;
  int rank_;
  std::atomic<int64_t> last_kick_ns_;  // steady_clock
  std::atomic<bool> armed_{true};
  std::mutex mutex_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread thread_;
};

// A process as the other ranks on its host can watch it: its pid, its start time (clock ticks
// after boot, /proc/<pid>/stat field 22: a pid the kernel reused names another process) and a host
// key (the boot id and the pid namespace: a pid means the same process only where they agree).
struct ProcessId {
  int64_t pid = 0;
  uint64_t start_ticks = 0;
  std::string host;  // empty where /proc cannot say (then the process is not watched)

  static ProcessId self();
  // Process `pid` as this process sees it in /proc (the same host and pid namespace); start_ticks
  // 0 and host empty when there is no such process.
  static ProcessId of(int64_t pid);
  Bytes to_bytes() const;
  // Throws moe_echo::Error on bytes that to_bytes() did not write.
  static ProcessId from_bytes(const Bytes& bytes);
};

// What became of a watched peer: its process ended (`exited`: gone, a zombie, or its pid taken by
// another process) or stopped (SIGSTOP, Ctrl-Z: state T for PeerMonitor::Options::stopped_grace;
// a process stopped by a debugger, state t, is not counted); or a check of the caller's own (a
// device wait that gave up) said so (`other`).
struct PeerLoss {
  enum class Kind { exited, stopped, other };
  Kind kind = Kind::other;
  int rank = -1;  // the peer, or -1 when `other` names none
  int64_t pid = 0;
  std::string message;  // "rank 1 (pid 4242) exited" and the like, from the watching rank's side
};

// Watches the processes of the other ranks of this host, so that a rank waiting for a peer on the
// device (an NVLink barrier, whose spin no host thread can interrupt) learns at once that the peer
// is gone instead of waiting forever, and tells which rank it was.
//
// A thread looks at each watched peer every `period` (/proc/<pid>/stat: gone, zombie, another
// start time, or stopped) and calls `probe`, the caller's check that something of its own waits
// on a lost peer (a device wait that gave up; nullopt while none did). The first loss found, of a
// peer's process or else the probe's, is kept (lost()) and handed to `on_lost` once, on the
// thread; the loss is then the caller's to raise, and consume() says it was raised. A peer that
// ends while nothing waits on it (ranks leaving at the end of a run at different times) is only
// kept. Once the probe reports, or once the loss is a stopped peer (which no launcher notices and
// on which any wait blocks: a device barrier, a host rendezvous, another library's collective), a
// loss not consumed within `exit_grace` (a step replayed from a CUDA graph never comes back to
// the library's host code; a host wait may be outside it) makes the thread print
// "moe-echo: rank R: <message>; nothing raised it within N s; aborting" to stderr and end the
// process with Watchdog::kExitCode, as the Watchdog does and for its reasons. A loss that was
// raised (consume()) while the process is still running `raised_grace` later (its teardown
// blocked on the lost peer: another library's communicator destroyed gracefully, a host barrier)
// ends it the same way ("...; raised N s ago and the process is still running; aborting"), as
// torch's NCCL watchdog tears a process down after a collective's error.
//
// Peers whose ProcessId.host differs from this process's (another host, or another pid
// namespace) are not watched: their losses show only as the probe's.
class PeerMonitor {
 public:
  struct Options {
    std::chrono::milliseconds period{100};
    std::chrono::milliseconds stopped_grace{5000};
    std::chrono::milliseconds exit_grace{10000};    // 0: never end the process
    std::chrono::milliseconds raised_grace{15000};  // 0: a raised loss never ends the process
  };
  // peers[r] is rank r's process (rank `rank`'s own entry is not watched).
  PeerMonitor(int rank, std::vector<ProcessId> peers,
              std::function<std::optional<PeerLoss>()> probe,
              std::function<void(const PeerLoss&)> on_lost, Options options);
  ~PeerMonitor();
  PeerMonitor(const PeerMonitor&) = delete;
  PeerMonitor& operator=(const PeerMonitor&) = delete;

  // The ranks whose processes are watched (same host key), in rank order.
  const std::vector<int>& watched() const { return watched_; }
  // The first loss found, if any. Thread-safe.
  std::optional<PeerLoss> lost() const;
  // The loss was raised to the caller's caller: no process exit after exit_grace; one after
  // raised_grace if the process is still running then. Thread-safe; the first call counts.
  void consume();

 private:
  void watch();
  std::optional<PeerLoss> look(int rank, int64_t now_ns);

  int rank_;
  std::vector<ProcessId> peers_;
  std::vector<int> watched_;
  std::vector<int64_t> stopped_since_ns_;  // per rank: 0 while not stopped
  std::function<std::optional<PeerLoss>()> probe_;
  std::function<void(const PeerLoss&)> on_lost_;
  Options options_;
  mutable std::mutex mutex_;
  std::optional<PeerLoss> lost_;
  std::atomic<int64_t> consumed_ns_{0};  // steady clock of the first consume(), 0 before
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace moe_echo
