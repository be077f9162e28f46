// moe-echo launch: starts N local ranks of a command with torchrun's variables, for users without
// torchrun. docs/launch.md documents the variables, the messages and the exit codes.
//
// Invariants: the launcher is single-threaded and owns every child it starts. Each child leads
// its own process group (so signals reach the whole rank, `sh -c` and its children included, and
// a Ctrl-C at the terminal reaches the launcher alone, which forwards it once). Output is read
// through one pipe per stream and written whole lines at a time, so lines never interleave. A
// child is reaped exactly once; the launcher returns only when every child has been reaped.
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "commands.hpp"
#include "moe_echo/dist.hpp"
#include "moe_echo/error.hpp"

extern char** environ;

namespace moe_echo::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct LaunchOptions {
  int nproc = 0;
  int master_port = 29500;
  double timeout_s = 0;  // 0: no limit
  double grace_s = 5;
  std::vector<std::string> command;
};

// One output stream of a child: the read end of its pipe and the partial line read so far.
struct Stream {
  int fd = -1;   // -1 once the child closed its end and everything was read
  int out = -1;  // STDOUT_FILENO or STDERR_FILENO
  std::string partial;
};

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  Stream streams[2];
};

volatile std::sig_atomic_t g_signal = 0;  // the last SIGINT or SIGTERM the launcher received

extern "C" void on_stop_signal(int sig) { g_signal = sig; }
extern "C" void on_child_signal(int) {}  // only interrupts poll() so that exits are seen at once

[[noreturn]] void reject(const std::string& field, const std::string& value,
                         const std::string& allowed) {
  throw ConfigError(field, field + " = " + value + " is invalid: allowed " + allowed);
}

// Writes all bytes, resumed after signals and partial writes. When the output is gone (a closed
// pipe) the bytes are dropped: the ranks must keep running and never block on a full pipe.
void write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w > 0) {
      p += w;
      n -= size_t(w);
    } else if (!(w < 0 && errno == EINTR)) {
      return;
    }
  }
}

void say(const std::string& message) {
  const std::string line = "moe-echo launch: " + message + "\n";
  write_all(STDERR_FILENO, line.data(), line.size());
}

// Forwards the complete lines of `s` (and, at the end of its stream, the partial last one) with
// the rank prefix, in one write.
void forward(Stream& s, int rank, bool at_end) {
  constexpr size_t kMaxLine = 64 * 1024;  // a longer line without '\n' is forwarded in pieces
  const std::string prefix = "[rank " + std::to_string(rank) + "] ";
  std::string out;
  size_t begin = 0;
  for (;;) {
    size_t end = s.partial.find('\n', begin);
    if (end == std::string::npos) {
      const size_t left = s.partial.size() - begin;
      if (left == 0 || (!at_end && left < kMaxLine)) break;
      end = s.partial.size();
    }
    out += prefix;
    out.append(s.partial, begin, end - begin);
    out += '\n';
    begin = std::min(end + 1, s.partial.size());
  }
  s.partial.erase(0, begin);
  write_all(s.out, out.data(), out.size());
}

// Reads what the pipe holds now; closes it at end of stream.
void drain(Stream& s, int rank) {
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(s.fd, buf, sizeof buf);
    if (n > 0) {
      s.partial.append(buf, size_t(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    ::close(s.fd);  // end of stream, or an error that ends it
    s.fd = -1;
    break;
  }
  forward(s, rank, s.fd < 0);
}

void signal_rank(const Child& c, int sig) {
  if (::killpg(c.pid, sig) != 0) ::kill(c.pid, sig);  // before the child's setpgid took effect
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  const int code = WEXITSTATUS(status);
  std::string s = "exited with code " + std::to_string(code);
  if (code == Watchdog::kExitCode) s += " (watchdog timeout: no progress; see its output)";
  if (code == 127) s += " (command not found?)";
  return s;
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

std::string rank_list(const std::vector<Child>& children) {
  std::string s;
  int n = 0;
  for (const Child& c : children)
    if (c.running) s += (n++ ? ", " : "") + std::to_string(c.rank);
  return (n == 1 ? "rank " : "ranks ") + s;
}

// The environment of one rank: ours, with torchrun's variables set, and the variables our GPU
// machines require (NVLink multicast off) set unless the user set them.
std::vector<std::string> rank_environment(int rank, int nproc, int port) {
  const std::vector<std::pair<std::string, std::string>> forced = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(nproc)},
      {"LOCAL_RANK", std::to_string(rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
      {"MASTER_ADDR", "127.0.0.1"},
      {"MASTER_PORT", std::to_string(port)},
      // No agent hosts a store on MASTER_PORT here (torchrun's does): rank 0 hosts its own.
      {"TORCHELASTIC_USE_AGENT_STORE", "False"}};
  const std::vector<std::pair<std::string, std::string>> defaults = {
      {"NCCL_NVLS_ENABLE", "0"},
      {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"},
      {"NVSHMEM_DISABLE_NVLS", "1"}};
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    bool replaced = false;
    for (const auto& [k, v] : forced) replaced = replaced || k == name;
    if (!replaced) env.push_back(entry);
  }
  for (const auto& [k, v] : forced) env.push_back(k + "=" + v);
  for (const auto& [k, v] : defaults)
    if (!std::getenv(k.c_str())) env.push_back(k + "=" + v);
  return env;
}

// Starts one rank. Everything the child needs is prepared before fork(); the child makes only
// async-signal-safe calls before exec.
void start(Child& c, const LaunchOptions& o, int port) {
  std::vector<std::string> env = rank_environment(c.rank, o.nproc, port);
  std::vector<char*> envp, argv;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = o.command;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string exec_failed = "moe-echo launch: cannot run '" + o.command[0] + "': ";

  int pipes[2][2] = {{-1, -1}, {-1, -1}};
  if (::pipe2(pipes[0], O_CLOEXEC) != 0 || ::pipe2(pipes[1], O_CLOEXEC) != 0) {
    const int err = errno;
    for (auto& p : pipes)
      for (int fd : p)
        if (fd >= 0) ::close(fd);
    throw Error(std::string("pipe: ") + std::strerror(err));
  }
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t parent = ::getpid();
  // Signals stay blocked across fork() until the child has its default handlers back: a stop
  // signal that arrives in between must end the child, not run the launcher's handler there.
  sigset_t all, old_mask;
  sigfillset(&all);
  ::sigprocmask(SIG_BLOCK, &all, &old_mask);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    for (int sig : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE}) ::signal(sig, SIG_DFL);
    ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
#ifdef __linux__
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // the launcher was killed: do not outlive it
    if (::getppid() != parent) ::_exit(1);
#endif
    if (null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);  // ranks read no input
    ::dup2(pipes[0][1], STDOUT_FILENO);
    ::dup2(pipes[1][1], STDERR_FILENO);
    environ = envp.data();
    ::execvp(argv[0], argv.data());
    const char* why = std::strerror(errno);
    write_all(STDERR_FILENO, exec_failed.data(), exec_failed.size());
    write_all(STDERR_FILENO, why, std::strlen(why));
    write_all(STDERR_FILENO, "\n", 1);
    ::_exit(127);
  }
  const int fork_errno = errno;
  ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  if (null_fd >= 0) ::close(null_fd);
  for (auto& p : pipes) ::close(p[1]);
  if (pid < 0) {
    for (auto& p : pipes) ::close(p[0]);
    throw Error(std::string("fork: ") + std::strerror(fork_errno));
  }
  ::setpgid(pid, pid);  // also here, so that signals sent right away reach the group
  c.pid = pid;
  c.running = true;
  for (int k = 0; k < 2; ++k) {
    ::fcntl(pipes[k][0], F_SETFL, ::fcntl(pipes[k][0], F_GETFL) | O_NONBLOCK);
    c.streams[k].fd = pipes[k][0];
    c.streams[k].out = k == 0 ? STDOUT_FILENO : STDERR_FILENO;
  }
}

// Installs the launcher's signal handlers for its lifetime and restores the previous ones.
class SignalScope {
 public:
  SignalScope() {
    g_signal = 0;
    install(SIGINT, on_stop_signal, 0);
    install(SIGTERM, on_stop_signal, 1);
    install(SIGCHLD, on_child_signal, 2);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ignore, &old_[3]);  // a closed stdout must not kill the launcher
  }
  ~SignalScope() {
    const int sigs[] = {SIGINT, SIGTERM, SIGCHLD, SIGPIPE};
    for (int i = 0; i < 4; ++i) ::sigaction(sigs[i], &old_[i], nullptr);
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

 private:
  void install(int sig, void (*handler)(int), int slot) {
    struct sigaction sa {};
    sa.sa_handler = handler;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;  // no SA_RESTART: the signal interrupts poll()
    ::sigaction(sig, &sa, &old_[slot]);
  }
  struct sigaction old_[4];
};

int run_launch(const LaunchOptions& o) {
  if (o.nproc < 1 || o.nproc > 1024)
    reject("nproc", std::to_string(o.nproc), "1 <= nproc <= 1024 (-n: ranks on this machine)");
  if (o.master_port < 0 || o.master_port > 65535)
    reject("master_port", std::to_string(o.master_port),
           "0 <= master_port <= 65535 (0: any free port)");
  if (!(o.timeout_s >= 0)) reject("timeout", std::to_string(o.timeout_s), "seconds >= 0 (0: none)");
  if (!(o.grace_s >= 0)) reject("grace", std::to_string(o.grace_s), "seconds >= 0");
  if (o.command.empty() || o.command[0].empty())
    reject("command", "(none)",
           "a command after `--`, e.g. moe-echo launch -n 2 -- python train.py");
  const int port = o.master_port == 0 ? free_tcp_port() : o.master_port;

  SignalScope signals;
  std::vector<Child> children(size_t(o.nproc));
  const auto stop_all = [&](int sig) {
    for (const Child& c : children)
      if (c.running) signal_rank(c, sig);
  };
  int result = 0;
  bool stopping = false, killed = false;
  Clock::time_point stop_time{};
  const auto begin_stop = [&](int sig, int code) {
    result = code;
    stopping = true;
    stop_time = Clock::now();
    stop_all(sig);
  };

  for (int r = 0; r < o.nproc; ++r) {
    children[size_t(r)].rank = r;
    try {
      start(children[size_t(r)], o, port);
    } catch (const Error& e) {
      say("cannot start rank " + std::to_string(r) + ": " + e.what() +
          "; stopping the ranks already started");
      begin_stop(SIGTERM, 1);
      break;
    }
  }

  const auto started = Clock::now();
  const auto grace = std::chrono::duration<double>(o.grace_s);
  const auto limit = std::chrono::duration<double>(o.timeout_s);
  Clock::time_point drain_until = Clock::time_point::max();
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Child*, Stream*>> owners;
    for (Child& c : children)
      for (Stream& s : c.streams)
        if (s.fd >= 0) {
          fds.push_back({s.fd, POLLIN, 0});
          owners.emplace_back(&c, &s);
        }
    if (::poll(fds.data(), fds.size(), 100) > 0)
      for (size_t i = 0; i < fds.size(); ++i)
        if (fds[i].revents) drain(*owners[i].second, owners[i].first->rank);

    for (Child& c : children) {
      if (!c.running) continue;
      int status = 0;
      pid_t w;
      do w = ::waitpid(c.pid, &status, WNOHANG);
      while (w < 0 && errno == EINTR);
      if (w == 0) continue;
      c.running = false;
      const bool failed = w < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0;
      if (!failed || stopping) continue;
      int code = 1;  // the status was lost (ECHILD)
      if (w > 0) code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
      for (Stream& s : c.streams)  // its last words before the verdict
        if (s.fd >= 0) drain(s, c.rank);
      bool others = false;
      for (const Child& d : children) others = others || d.running;
      say("rank " + std::to_string(c.rank) + " " + (w < 0 ? "was lost" : describe(status)) +
          (others ? "; stopping the other ranks" : ""));
      begin_stop(SIGTERM, code);
    }

    bool any_running = false;
    for (const Child& c : children) any_running = any_running || c.running;
    const auto now = Clock::now();
    if (g_signal != 0) {
      const int sig = g_signal;
      g_signal = 0;
      if (!stopping && any_running) {
        say(std::string("interrupted by ") + (sig == SIGINT ? "SIGINT" : "SIGTERM") +
            "; forwarding it to the ranks");
        begin_stop(sig, 128 + sig);
      } else if (any_running) {
        say("interrupted while stopping; sending SIGKILL to " + rank_list(children));
        stop_all(SIGKILL);
        killed = true;
      }
    }
    if (!stopping && o.timeout_s > 0 && any_running && now - started >= limit) {
      say("--timeout " + seconds(o.timeout_s) + " reached; stopping " + rank_list(children));
      begin_stop(SIGTERM, Watchdog::kExitCode);
    }
    if (stopping && !killed && any_running && now - stop_time >= grace) {
      say(rank_list(children) + " still running " + seconds(o.grace_s) +
          " after the stop signal; sending SIGKILL");
      stop_all(SIGKILL);
      killed = true;
    }
    if (!any_running) {
      // Every rank has exited; forward what is left in the pipes. A background process a rank
      // left behind may hold a pipe open: give it a moment, then stop listening.
      bool open = false;
      for (const Child& c : children)
        for (const Stream& s : c.streams) open = open || s.fd >= 0;
      if (!open) break;
      if (drain_until == Clock::time_point::max()) drain_until = now + std::chrono::seconds(1);
      if (now >= drain_until) {
        for (Child& c : children)
          for (Stream& s : c.streams)
            if (s.fd >= 0) {
              ::close(s.fd);
              s.fd = -1;
              forward(s, c.rank, true);
            }
        break;
      }
    }
  }
  return result;
}

}  // namespace

void add_launch(CLI::App& app, Runner& run) {
  auto o = std::make_shared<LaunchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "launch",
      "Start N local ranks of a command with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, "
      "MASTER_ADDR, MASTER_PORT), prefix their output with the rank, and stop them all when one "
      "fails (docs/launch.md)");
  add_option(cmd, "-n,--nproc", o->nproc, "ranks to start (one per GPU)")->required();
  add_option(cmd, "--master-port", o->master_port, "rendezvous port; 0 picks a free one")
      ->capture_default_str();
  add_option(cmd, "--timeout", o->timeout_s, "stop every rank after this many seconds (0: never)")
      ->capture_default_str();
  add_option(cmd, "--grace", o->grace_s,
             "seconds between SIGTERM and SIGKILL when stopping the ranks")
      ->capture_default_str();
  add_option(cmd, "command", o->command, "the command every rank runs, after `--`")->required();
  // Everything after `--` is the command: CLI11 takes it as positionals, options included.
  cmd->footer("Put `--` before the command: moe-echo launch -n 8 -- python train.py --steps 100");
  cmd->callback([&run, o] { run = [o] { return run_launch(*o); }; });
}

}  // namespace moe_echo::cli
