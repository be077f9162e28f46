// Rendezvous: a star of TCP connections around rank 0 (dist.hpp states the contract).
//
// Wire format. Every message is a frame: an 8-byte little-endian length, then that many bytes.
//   hello   (rank r -> 0, once):   "moe-echo" magic, u32 rank, u32 world_size
//   request (rank r -> 0, per op): u8 op, u64 sequence number, the rank's bytes
//   answer  (0 -> rank r):         u8 status; ok: every rank's bytes, each as a frame;
//                                  failed: the error message, which the rank throws as its own
// Rank 0 answers only when every rank has sent its request, so each connection carries at most
// one frame each way at a time. Sockets are non-blocking and every wait is a poll() bounded by
// the operation's deadline; signals (EINTR) and partial reads and writes are resumed.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "dist/dist_util.hpp"
#include "moe_echo/dist.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_collectives.hpp"

namespace moe_echo {
namespace {

using dist_util::get_u64;
using dist_util::put_u64;
using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

constexpr char kMagic[8] = {'m', 'o', 'e', '-', 'e', 'c', 'h', 'o'};
constexpr size_t kHelloBytes = sizeof kMagic + 8;
constexpr uint64_t kMaxFrameBytes = uint64_t(1) << 34;  // refuses garbage from a stray client
constexpr uint8_t kOk = 0, kFailed = 1;
constexpr uint8_t kAllGather = 1, kBroadcast = 2, kBarrier = 3;
// Ranks other than 0 wait this much longer than rank 0 for its answer: when ranks are missing,
// rank 0's message, which names them, then arrives before their own timeout.
constexpr std::chrono::seconds kAnswerGrace{5};

const char* op_name(uint8_t op) {
  switch (op) {
    case kAllGather: return "all_gather_bytes";
    case kBroadcast: return "broadcast_bytes";
    case kBarrier: return "barrier";
    default: return "an unknown operation";
  }
}

std::string seconds_text(std::chrono::milliseconds t) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", double(t.count()) / 1000.0);
  return buf;
}

// "rank 2" or "ranks 2, 3".
std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

Bytes frame(const Bytes& payload) {
  Bytes out;
  out.reserve(8 + payload.size());
  put_u64(out, payload.size());
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

// The answer that makes a rank throw `message`.
Bytes failure_frame(const std::string& message) {
  Bytes answer(1 + message.size());
  answer[0] = kFailed;
  std::memcpy(answer.data() + 1, message.data(), message.size());
  return frame(answer);
}

int ms_left(Deadline deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return int(std::clamp<long long>(left, 0, INT_MAX));
}

// poll() resumed after signals with the time left; returns 0 once the deadline has passed.
int poll_until(std::vector<pollfd>& fds, Deadline deadline) {
  for (;;) {
    const int n = ::poll(fds.data(), fds.size(), ms_left(deadline));
    if (n >= 0) return n;
    if (errno != EINTR) throw Error(std::string("rendezvous: poll: ") + std::strerror(errno));
  }
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);  // not retried on EINTR: Linux has closed the descriptor already
  fd = -1;
}

enum class Io { done, timeout, closed };

Io send_all(int fd, const Bytes& data, Deadline deadline) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += size_t(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      std::vector<pollfd> p{{fd, POLLOUT, 0}};
      if (poll_until(p, deadline) == 0) return Io::timeout;
    } else {
      return Io::closed;  // EPIPE, ECONNRESET: the peer is gone
    }
  }
  return Io::done;
}

// Collects one frame from a non-blocking socket, reading no byte beyond it.
struct FrameReader {
  Bytes buf;  // the 8-byte header, then the payload
  bool done = false;

  uint64_t length() const { return get_u64(buf.data()); }
  Bytes payload() const { return Bytes(buf.begin() + 8, buf.end()); }

  // Reads what is available now; false when the peer closed the connection or sent a header
  // that no rank would send.
  bool read_available(int fd) {
    while (!done) {
      const uint64_t want = buf.size() < 8 ? 8 - buf.size() : 8 + length() - buf.size();
      const size_t have = buf.size();
      buf.resize(have + size_t(std::min<uint64_t>(want, 1 << 20)));
      const ssize_t n = ::recv(fd, buf.data() + have, buf.size() - have, 0);
      buf.resize(have + size_t(std::max<ssize_t>(n, 0)));
      if (n == 0) return false;
      if (n < 0) {
        if (errno == EINTR) continue;
        return errno == EAGAIN || errno == EWOULDBLOCK;
      }
      if (buf.size() < 8) continue;
      if (length() > kMaxFrameBytes) return false;
      done = buf.size() == 8 + length();
    }
    return true;
  }
};

Io read_frame(int fd, Deadline deadline, Bytes& payload) {
  FrameReader reader;
  for (;;) {
    if (!reader.read_available(fd)) return Io::closed;
    if (reader.done) {
      payload = reader.payload();
      return Io::done;
    }
    std::vector<pollfd> p{{fd, POLLIN, 0}};
    if (poll_until(p, deadline) == 0) return Io::timeout;
  }
}

struct AddrList {
  addrinfo* head = nullptr;
  ~AddrList() {
    if (head) freeaddrinfo(head);
  }
  // 0 or a getaddrinfo error code.
  int resolve(const std::string& host, int port) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    return getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &head);
  }
};

void set_no_delay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Rank 0's listening socket on every interface of MASTER_ADDR's address family, as torchrun's
// store does: MASTER_ADDR may name this host by an address other hosts do not use for it.
int listen_on(const DistEnv& env, std::string& error) {
  AddrList master;
  const int family =
      master.resolve(env.master_addr, env.master_port) == 0 && master.head->ai_family == AF_INET6
          ? AF_INET6
          : AF_INET;
  const int fd = ::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    error = std::strerror(errno);
    return -1;
  }
  int one = 1, zero = 0;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (family == AF_INET6) {
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
    a->sin6_family = AF_INET6;
    a->sin6_addr = in6addr_any;
    a->sin6_port = htons(uint16_t(env.master_port));
    len = sizeof *a;
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&addr);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_ANY);
    a->sin_port = htons(uint16_t(env.master_port));
    len = sizeof *a;
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    error = std::strerror(errno);
    ::close(fd);
    return -1;
  }
  return fd;
}

// One attempt to connect to MASTER_ADDR:MASTER_PORT before the deadline: the socket, or -1 with
// `error` set.
int try_connect(const DistEnv& env, Deadline deadline, std::string& error) {
  AddrList list;
  if (const int rc = list.resolve(env.master_addr, env.master_port); rc != 0) {
    error = std::string("cannot resolve MASTER_ADDR: ") + gai_strerror(rc);
    return -1;
  }
  for (addrinfo* a = list.head; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    int err = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    if (err == EINPROGRESS || err == EINTR) {
      std::vector<pollfd> p{{fd, POLLOUT, 0}};
      socklen_t len = sizeof err;
      if (poll_until(p, deadline) == 0)
        err = ETIMEDOUT;
      else if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
        err = errno;
    }
    if (err == 0) {
      set_no_delay(fd);
      return fd;
    }
    error = std::strerror(err);
    close_fd(fd);
  }
  return -1;
}

}  // namespace

int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  MOE_ECHO_CHECK(fd >= 0, "socket: " << std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  ::close(fd);
  MOE_ECHO_CHECK(ok, "cannot find a free TCP port: " << std::strerror(err));
  return ntohs(addr.sin_port);
}

Rendezvous::Rendezvous(const DistEnv& env, std::chrono::milliseconds timeout)
    : env_(env), timeout_(timeout) {
  MOE_ECHO_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size,
                 "rank " << env.rank << " of " << env.world_size);
  MOE_ECHO_CHECK(timeout.count() > 0, "timeout " << timeout.count() << " ms");
  if (env_.world_size == 1) return;
  const Deadline deadline = Clock::now() + timeout_;
  if (env_.rank == 0)
    accept_ranks(deadline);
  else
    connect_to_rank0(deadline);
}

void Rendezvous::connect_to_rank0(Deadline deadline) {
  fds_.assign(1, -1);
  std::string error = "timed out";
  auto pause = std::chrono::milliseconds(10);
  while (fds_[0] < 0) {
    fds_[0] = try_connect(env_, deadline, error);
    if (fds_[0] >= 0 || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - Clock::now()));
    pause = std::min(pause * 2, std::chrono::milliseconds(500));
  }
  if (fds_[0] < 0)
    fail(where() + ": rank " + std::to_string(env_.rank) + " could not connect to rank 0 within " +
         seconds_text(timeout_) + " (last error: " + error +
         "); check that rank 0 is running and that MASTER_ADDR and MASTER_PORT are the same on "
         "every rank");
  Bytes hello(kMagic, kMagic + sizeof kMagic);
  for (const int v : {env_.rank, env_.world_size})
    for (int i = 0; i < 4; ++i) hello.push_back(uint8_t(uint32_t(v) >> (8 * i)));
  Bytes answer;
  Io io = send_all(fds_[0], frame(hello), deadline);
  if (io == Io::done) io = read_frame(fds_[0], deadline + kAnswerGrace, answer);
  if (io == Io::closed)
    fail(where() +
         ": rank 0 closed the connection while ranks were connecting (its process "
         "exited or failed; see its output)");
  if (io == Io::timeout)
    fail(where() + ": rank 0 did not confirm that all ranks connected within " +
         seconds_text(timeout_ + kAnswerGrace));
  if (answer.empty() || answer[0] != kOk)
    fail(std::string(answer.begin() + (answer.empty() ? 0 : 1), answer.end()) +
         " (reported by rank 0)");
}

void Rendezvous::accept_ranks(Deadline deadline) {
  const int world = env_.world_size;
  fds_.assign(size_t(world), -1);
  std::string error;
  int listener = listen_on(env_, error);
  if (listener < 0)
    fail(where() + ": rank 0 cannot listen on port " + std::to_string(env_.master_port) + ": " +
         error + " (another job may be using MASTER_PORT: choose another)");
  struct Pending {
    int fd;
    FrameReader hello;
  };
  std::vector<Pending> pending;  // connected, hello not complete yet
  const auto close_pending = [&] {
    close_fd(listener);
    for (Pending& c : pending) close_fd(c.fd);
  };
  int arrived = 1;
  while (arrived < world) {
    std::vector<pollfd> p{{listener, POLLIN, 0}};
    for (const Pending& c : pending) p.push_back({c.fd, POLLIN, 0});
    if (poll_until(p, deadline) == 0) {
      std::vector<int> missing;
      for (int r = 1; r < world; ++r)
        if (fds_[size_t(r)] < 0) missing.push_back(r);
      close_pending();
      fail(where() + ": " + rank_list(missing) + " did not connect within " +
           seconds_text(timeout_));
    }
    for (;;) {
      const int fd = ::accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) {
        set_no_delay(fd);
        pending.push_back({fd, {}});
      } else if (errno != EINTR && errno != ECONNABORTED) {
        break;  // EAGAIN: none left for now
      }
    }
    for (size_t i = 0; i < pending.size();) {
      if (pending[i].hello.read_available(pending[i].fd) && !pending[i].hello.done) {
        ++i;
        continue;
      }
      const Bytes hello = pending[i].hello.done ? pending[i].hello.payload() : Bytes{};
      int fd = pending[i].fd;
      pending.erase(pending.begin() + std::ptrdiff_t(i));
      if (hello.size() != kHelloBytes || std::memcmp(hello.data(), kMagic, sizeof kMagic) != 0) {
        close_fd(fd);  // a stray client, or one that went away: not one of our ranks
        continue;
      }
      uint32_t values[2] = {0, 0};
      for (size_t k = 0; k < 2; ++k)
        for (size_t b = 0; b < 4; ++b)
          values[k] |= uint32_t(hello[sizeof kMagic + 4 * k + b]) << (8 * b);
      const int r = int(values[0]), their_world = int(values[1]);
      std::string problem;
      if (their_world != world)
        problem = "rank " + std::to_string(r) + " has WORLD_SIZE " + std::to_string(their_world) +
                  " but rank 0 has " + std::to_string(world) + " (every rank needs the same one)";
      else if (r < 1 || r >= world)
        problem = "a process claims RANK " + std::to_string(r) + ", outside 1.." +
                  std::to_string(world - 1);
      else if (fds_[size_t(r)] >= 0)
        problem = "two processes claim RANK " + std::to_string(r) +
                  " (is another job using MASTER_PORT " + std::to_string(env_.master_port) + "?)";
      if (!problem.empty()) {
        const std::string message = where() + ": " + problem;
        send_all(fd, failure_frame(message), Clock::now() + std::chrono::seconds(1));
        close_fd(fd);
        close_pending();
        fail(message);  // tells the ranks already connected too
      }
      fds_[size_t(r)] = fd;
      ++arrived;
    }
  }
  close_pending();  // the listener, and stray clients that never said hello
  for (int r = 1; r < world; ++r)
    if (send_all(fds_[size_t(r)], frame(Bytes{kOk}), deadline + kAnswerGrace) != Io::done)
      fail(where() + ": rank " + std::to_string(r) + " went away while ranks were connecting");
}

Rendezvous::~Rendezvous() {
  for (int& fd : fds_) close_fd(fd);
}

std::string Rendezvous::where() const {
  return "rendezvous at " + env_.master_addr + ":" + std::to_string(env_.master_port);
}

void Rendezvous::fail(const std::string& message) {
  // Rank 0 tells every rank still connected, so that they all report the same cause.
  if (env_.rank == 0) {
    const Bytes f = failure_frame(message);
    const Deadline deadline = Clock::now() + std::chrono::seconds(1);
    for (int fd : fds_)
      if (fd >= 0) send_all(fd, f, deadline);
  }
  for (int& fd : fds_) close_fd(fd);
  failed_ = true;
  throw Error(message);
}

std::vector<Bytes> Rendezvous::exchange(uint8_t op, const Bytes& local) {
  if (failed_) throw Error(where() + ": unusable after an earlier failure");
  const uint64_t sequence = sequence_++;
  const int world = env_.world_size;
  if (world == 1) return {local};
  const Deadline deadline = Clock::now() + timeout_;
  const std::string what = where() + ": " + op_name(op) + ": ";
  const std::string gone = " closed its connection (its process exited or failed; see its output)";

  if (env_.rank != 0) {
    Bytes request{op};
    put_u64(request, sequence);
    request.insert(request.end(), local.begin(), local.end());
    Bytes answer;
    Io io = send_all(fds_[0], frame(request), deadline);
    if (io == Io::done) io = read_frame(fds_[0], deadline + kAnswerGrace, answer);
    if (io == Io::closed) fail(what + "rank 0" + gone);
    if (io == Io::timeout)
      fail(what + "rank 0 did not answer within " + seconds_text(timeout_ + kAnswerGrace));
    if (answer.empty() || answer[0] != kOk)
      fail(std::string(answer.begin() + (answer.empty() ? 0 : 1), answer.end()) +
           " (reported by rank 0)");
    std::vector<Bytes> all;
    size_t at = 1;
    while (at + 8 <= answer.size() && all.size() < size_t(world)) {
      const uint64_t n = get_u64(answer.data() + at);
      MOE_ECHO_CHECK(n <= answer.size() - at - 8, what << "malformed answer from rank 0");
      all.emplace_back(answer.begin() + std::ptrdiff_t(at + 8),
                       answer.begin() + std::ptrdiff_t(at + 8 + n));
      at += 8 + n;
    }
    MOE_ECHO_CHECK(all.size() == size_t(world) && at == answer.size(),
                   what << "malformed answer from rank 0");
    return all;
  }

  std::vector<Bytes> all(static_cast<size_t>(world));
  all[0] = local;
  std::vector<FrameReader> readers(static_cast<size_t>(world));
  std::vector<int> waiting;
  for (int r = 1; r < world; ++r) waiting.push_back(r);
  while (!waiting.empty()) {
    std::vector<pollfd> p;
    for (const int r : waiting) p.push_back({fds_[size_t(r)], POLLIN, 0});
    if (poll_until(p, deadline) == 0)
      fail(what + rank_list(waiting) + " did not arrive within " + seconds_text(timeout_));
    for (size_t i = 0; i < waiting.size();) {
      const int r = waiting[i];
      FrameReader& reader = readers[size_t(r)];
      if (!reader.read_available(fds_[size_t(r)])) fail(what + "rank " + std::to_string(r) + gone);
      if (!reader.done) {
        ++i;
        continue;
      }
      const Bytes request = reader.payload();
      const uint8_t their_op = request.empty() ? 0 : request[0];
      const uint64_t their_sequence = request.size() >= 9 ? get_u64(request.data() + 1) : 0;
      if (request.size() < 9 || their_op != op || their_sequence != sequence)
        fail(what + "rank " + std::to_string(r) + " called " + op_name(their_op) + " (operation " +
             std::to_string(their_sequence) + ") while rank 0 called " + op_name(op) +
             " (operation " + std::to_string(sequence) +
             "); every rank must call the same operations in the same order");
      all[size_t(r)].assign(request.begin() + 9, request.end());
      waiting.erase(waiting.begin() + std::ptrdiff_t(i));
    }
  }
  Bytes answer{kOk};
  for (const Bytes& b : all) {
    put_u64(answer, b.size());
    answer.insert(answer.end(), b.begin(), b.end());
  }
  const Bytes f = frame(answer);
  const Deadline send_deadline = Clock::now() + timeout_;
  for (int r = 1; r < world; ++r) {
    const Io io = send_all(fds_[size_t(r)], f, send_deadline);
    if (io == Io::closed) fail(what + "rank " + std::to_string(r) + gone);
    if (io == Io::timeout)
      fail(what + "rank " + std::to_string(r) + " did not take the answer within " +
           seconds_text(timeout_));
  }
  return all;
}

std::vector<Bytes> Rendezvous::all_gather_bytes(const Bytes& local) {
  return exchange(kAllGather, local);
}

Bytes Rendezvous::broadcast_bytes(const Bytes& bytes, int root) {
  MOE_ECHO_CHECK(root >= 0 && root < env_.world_size,
                 "broadcast root " << root << " outside 0.." << env_.world_size - 1);
  // Only the root's bytes travel; the others send an empty request to say they arrived.
  return std::move(exchange(kBroadcast, env_.rank == root ? bytes : Bytes{})[size_t(root)]);
}

void Rendezvous::barrier() { exchange(kBarrier, {}); }

namespace {

class RendezvousCollectives final : public HostCollectives {
 public:
  explicit RendezvousCollectives(Rendezvous& rv) : rv_(rv) {}
  int rank() const override { return rv_.rank(); }
  int size() const override { return rv_.world_size(); }

  void all_gather(const void* send, void* recv, size_t bytes) override {
    const auto* p = static_cast<const uint8_t*>(send);
    const std::vector<Bytes> all = rv_.all_gather_bytes(Bytes(p, p + bytes));
    auto* out = static_cast<uint8_t*>(recv);
    for (size_t r = 0; r < all.size(); ++r) {
      MOE_ECHO_CHECK(all[r].size() == bytes, "all_gather: rank " << r << " sent " << all[r].size()
                                                                 << " bytes, this rank " << bytes);
      if (bytes) std::memcpy(out + r * bytes, all[r].data(), bytes);
    }
  }

  // Every rank's whole send buffer travels to every rank, which keeps its own segments: simple
  // and correct, meant for setup and tests rather than a step's hot path.
  void all_to_all_v(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                    const std::vector<size_t>& recv_bytes) override {
    const int n = size(), me = rank();
    MOE_ECHO_CHECK(int(send_bytes.size()) == n && int(recv_bytes.size()) == n,
                   "all_to_all_v: " << send_bytes.size() << " send and " << recv_bytes.size()
                                    << " receive sizes for " << n << " ranks");
    Bytes mine;
    for (size_t b : send_bytes) put_u64(mine, b);
    size_t total = 0;
    for (size_t b : send_bytes) total += b;
    const auto* p = static_cast<const uint8_t*>(send);
    mine.insert(mine.end(), p, p + total);
    const std::vector<Bytes> all = rv_.all_gather_bytes(mine);
    auto* out = static_cast<uint8_t*>(recv);
    for (int s = 0; s < n; ++s) {
      const Bytes& theirs = all[size_t(s)];
      MOE_ECHO_CHECK(theirs.size() >= size_t(n) * 8,
                     "all_to_all_v: rank " << s << " sent a short header");
      size_t offset = size_t(n) * 8, size = 0;
      for (int d = 0; d < n; ++d) {
        const size_t b = get_u64(theirs.data() + size_t(d) * 8);
        if (d < me) offset += b;
        if (d == me) size = b;
      }
      MOE_ECHO_CHECK(size == recv_bytes[size_t(s)] && offset + size <= theirs.size(),
                     "all_to_all_v: rank " << s << " sends " << size << " bytes to rank " << me
                                           << ", which expects " << recv_bytes[size_t(s)]);
      if (size) std::memcpy(out, theirs.data() + offset, size);
      out += size;
    }
  }

  void barrier() override { rv_.barrier(); }

 private:
  Rendezvous& rv_;
};

}  // namespace

std::unique_ptr<HostCollectives> make_rendezvous_collectives(Rendezvous& rendezvous) {
  return std::make_unique<RendezvousCollectives>(rendezvous);
}

}  // namespace moe_echo
