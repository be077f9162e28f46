// In-process communicator: R ranks as threads sharing one address space. Symmetric buffers are a
// table of every rank's pointer per id; collective ops are "barrier, move rows, barrier", the
// same shape as the LSA kernels of the device communicator:
//   entry barrier: peers are done with the buffers about to be written (write-after-read),
//   exit barrier:  every write is visible before anyone consumes it (read-after-write).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/comm_args.hpp"
#include "comm/host_comm_ops.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/dist.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo {

struct InProcessWorld::State {
  State(int r, std::chrono::milliseconds t, int p)
      : ranks(r),
        per_node(p),
        timeout(t),
        here(size_t(r), 0),
        node_inbox(size_t(r)),
        node_requests(size_t(r)),
        node_replies(size_t(r)) {}

  // A reusable barrier that can be aborted, so that a failing rank never leaves the others
  // waiting forever; a rank that waits `timeout` for the others aborts the world, naming the
  // ranks that never arrived.
  void barrier(int rank) {
    std::unique_lock<std::mutex> lock(mu);
    if (aborted) throw Error("in-process world aborted: another rank failed");
    const uint64_t gen = generation;
    here[size_t(rank)] = gen + 1;
    if (++arrived == ranks) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    if (!cv.wait_for(lock, timeout, [&] { return generation != gen || aborted; })) {
      std::ostringstream missing;
      for (int r = 0; r < ranks; ++r)
        if (here[size_t(r)] != gen + 1) missing << (missing.tellp() > 0 ? ", " : "") << r;
      aborted = true;
      cv.notify_all();
      throw Error("in-process world: rank " + std::to_string(rank) + " waited " +
                  std::to_string(timeout.count()) + " ms at a barrier for rank(s) " +
                  missing.str() +
                  ", which never arrived (timeout; set MOE_ECHO_TIMEOUT_S to change it)");
    }
    if (aborted && generation == gen) throw Error("in-process world aborted: another rank failed");
  }
  void abort() {
    std::lock_guard<std::mutex> lock(mu);
    aborted = true;
    cv.notify_all();
  }

  const int ranks;
  const int per_node;  // ranks per node
  const std::chrono::milliseconds timeout;
  std::vector<uint64_t> here;  // per rank: 1 + the barrier generation it last arrived at
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  // Symmetric buffers: table[id][rank].
  std::vector<std::vector<void*>> table;
  std::vector<std::vector<size_t>> table_bytes;
  std::vector<const void*> staging;  // per rank, for all-gathers
  std::vector<std::unique_ptr<Communicator>> comms;

  // Across nodes. A dispatch's message to a forwarder: one token's row and the writes it asks on
  // the forwarder's node (a lead's row and fan table row, or -1 at members[row][0] of another
  // member).
  struct NodeWrite {
    int32_t rank;
    int64_t row;  // window row
    bool lead;
    int members;                       // fan table members written (a lead's)
    std::vector<int32_t> member_rows;  // [K], the lead's fan table row
    std::vector<char> member_weights;  // [members] in the fan's float dtype
  };
  struct NodeMessage {
    std::vector<char> row;
    std::vector<NodeWrite> writes;
  };
  // A combine's request to a forwarder: the (rank, window row) of a token's leads on its node, in
  // k order, and of every entry there when fan values are asked; the reply holds those rows and
  // values, in that order.
  struct NodeRequest {
    int source;
    int64_t token;
    int node;
    std::vector<std::pair<int32_t, int64_t>> leads, entries;
  };
  struct NodeReply {
    std::vector<char> rows, values;
  };
  std::mutex node_mu;
  std::vector<std::vector<NodeMessage>> node_inbox;                        // per forwarder
  std::vector<std::vector<NodeRequest>> node_requests;                     // per forwarder
  std::vector<std::map<std::pair<int64_t, int>, NodeReply>> node_replies;  // per source
  std::atomic<int64_t> dispatch_within{0}, dispatch_across{0}, combine_within{0}, combine_across{0};
};

namespace {

using host_comm::add_into;
using host_comm::in_window;
using host_comm::lead_entry;
using host_comm::row_ptr;

using State = InProcessWorld::State;

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(InProcessWorld::State& w, int rank) : w_(w), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return w_.ranks; }

  SymmetricBuffer alloc_symmetric(Backend& backend, size_t bytes) override {
    SymmetricBuffer buf;
    buf.local = backend.allocate(bytes);
    buf.bytes = bytes;
    buf.id = next_id_++;
    {
      std::lock_guard<std::mutex> lock(w_.mu);
      if (int(w_.table.size()) <= buf.id) {
        w_.table.resize(size_t(buf.id) + 1, std::vector<void*>(size_t(w_.ranks), nullptr));
        w_.table_bytes.resize(size_t(buf.id) + 1, std::vector<size_t>(size_t(w_.ranks), 0));
      }
      w_.table[size_t(buf.id)][size_t(rank_)] = buf.local;
      w_.table_bytes[size_t(buf.id)][size_t(rank_)] = bytes;
    }
    w_.barrier(rank_);
    for (int r = 0; r < w_.ranks; ++r)
      MOE_ECHO_CHECK(w_.table_bytes[size_t(buf.id)][size_t(r)] == bytes,
                     "symmetric buffer " << buf.id << ": rank " << r << " allocated "
                                         << w_.table_bytes[size_t(buf.id)][size_t(r)]
                                         << " bytes, rank " << rank_ << " " << bytes);
    w_.barrier(rank_);
    return buf;
  }

  void free_symmetric(Backend& backend, SymmetricBuffer& buf) override {
    if (!buf.local) return;
    w_.barrier(rank_);
    backend.deallocate(buf.local);
    buf.local = nullptr;
  }

  void barrier() override { w_.barrier(rank_); }

  void all_gather_i32(const int32_t* local, int32_t* all, int64_t n, Stream) override {
    w_.staging[size_t(rank_)] = local;
    w_.barrier(rank_);
    for (int r = 0; r < w_.ranks; ++r)
      std::memcpy(all + int64_t(r) * n, w_.staging[size_t(r)], size_t(n) * sizeof(int32_t));
    w_.barrier(rank_);
  }

  void all_reduce_sum(const Tensor& t, Stream) override {
    comm_args::check_sum_dtype("all_reduce_sum", t.dtype);
    w_.staging[size_t(rank_)] = t.data;
    w_.barrier(rank_);
    const std::vector<double> sum = host_comm::rank_order_sum(w_.staging, t.dtype, t.numel());
    w_.barrier(rank_);
    host_comm::store_sum(sum, t.dtype, t.data);
  }

  void dispatch(const RowRoute& route, RoundWindow win, const void* src, size_t row_bytes,
                const SymmetricBuffer& recv, const FanTable& fan, Stream) override {
    comm_args::check_route("dispatch", route, win, fan, {DType::f32, DType::f64});
    comm_args::check_window_fits("dispatch", win, recv, row_bytes, fan);
    const int K = route.top_k;
    const size_t fl = dtype_size(fan.float_dtype);
    w_.barrier(rank_);
    std::vector<int> message_of(size_t(nodes()), -1);
    std::vector<std::pair<int, State::NodeMessage>> messages;  // (node, message) of one token
    for (int64_t t = 0; t < route.n / K; ++t) {
      const int64_t first = t * K;
      for (int k = 0; k < K; ++k) {
        const int64_t i = first + k;
        if (!in_window(route, win, i) || !host_comm::dispatch_moves(route, win, first, k)) continue;
        const int d = route.dest_rank[i];
        const int64_t row = route.dest_row[i] - win.row_lo;
        const bool lead = lead_entry(route, win, first, k) == k;
        const char* token_row = static_cast<const char*>(src) + size_t(t) * row_bytes;
        if (node_of(d) == node_of(rank_)) {  // within the node: straight to the rank
          int32_t* members = static_cast<int32_t*>(peer(fan.members, d)) + row * K;
          if (!lead) {
            members[0] = -1;
            continue;
          }
          std::memcpy(row_ptr(peer(recv, d), row, row_bytes), token_row, row_bytes);
          host_comm::list_members(route, win, first, k, fan.float_dtype, members,
                                  row_ptr(peer(fan.weights, d), row, size_t(K) * fl));
          ++w_.dispatch_within;
          continue;
        }
        int& m = message_of[size_t(node_of(d))];
        if (m < 0) {  // the token's one copy for that node
          m = int(messages.size());
          messages.push_back({node_of(d), {{token_row, token_row + row_bytes}, {}}});
          ++w_.dispatch_across;
        }
        State::NodeWrite wr{d, row, lead, 0, {}, {}};
        if (lead) {
          wr.member_rows.resize(size_t(K));
          wr.member_weights.resize(size_t(K) * fl);
          wr.members = host_comm::list_members(route, win, first, k, fan.float_dtype,
                                               wr.member_rows.data(), wr.member_weights.data());
          wr.member_weights.resize(size_t(wr.members) * fl);
        }
        messages[size_t(m)].second.writes.push_back(std::move(wr));
      }
      if (messages.empty()) continue;
      {
        std::lock_guard<std::mutex> lock(w_.node_mu);
        for (auto& [node, msg] : messages)
          w_.node_inbox[size_t(forwarder(node, rank_))].push_back(std::move(msg));
      }
      messages.clear();
      std::fill(message_of.begin(), message_of.end(), -1);
    }
    w_.barrier(rank_);
    // As the forwarder: every message's writes on this node's ranks.
    for (const State::NodeMessage& msg : w_.node_inbox[size_t(rank_)])
      for (const State::NodeWrite& wr : msg.writes) {
        int32_t* members = static_cast<int32_t*>(peer(fan.members, wr.rank)) + wr.row * K;
        if (!wr.lead) {
          members[0] = -1;
          continue;
        }
        std::memcpy(row_ptr(peer(recv, wr.rank), wr.row, row_bytes), msg.row.data(), row_bytes);
        std::memcpy(members, wr.member_rows.data(), size_t(K) * sizeof(int32_t));
        std::memcpy(row_ptr(peer(fan.weights, wr.rank), wr.row, size_t(K) * fl),
                    wr.member_weights.data(), wr.member_weights.size());
        ++w_.dispatch_within;
      }
    w_.node_inbox[size_t(rank_)].clear();
    w_.barrier(rank_);
  }

  void combine(const RowRoute& route, RoundWindow win, const SymmetricBuffer& red, const Tensor& y,
               const int32_t* accumulate, const FanTable& fan, void* values_out, Stream) override {
    comm_args::check_route("combine", route, win, fan, {DType::f32, DType::f64});
    comm_args::check_combine_rows(route, y, {DType::f32, DType::f64});
    comm_args::check_window_fits("combine", win, red, size_t(y.size(1)) * dtype_size(y.dtype), fan);
    w_.barrier(rank_);
    const bool add = accumulate && *accumulate != 0;
    if (nodes() > 1) ask_other_nodes(route, win, red, y, fan, values_out != nullptr);
    if (y.dtype == DType::f32)
      combine_rows<float>(route, win, red, y, add, fan, values_out);
    else
      combine_rows<double>(route, win, red, y, add, fan, values_out);
    w_.barrier(rank_);
  }

  void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& home, void* spare, size_t slot_bytes,
                          Stream) override {
    comm_args::check_plan("pull_clone_weights", cfg, w_.ranks);
    w_.barrier(rank_);
    for (int s = 0; s < cfg.spare_slots; ++s) {
      const int e = plan.spare_expert[rank_ * cfg.spare_slots + s];
      if (e < 0) continue;
      const void* from = w_.table[size_t(home.id)][size_t(cfg.home_rank(e))];
      std::memcpy(row_ptr(spare, s, slot_bytes),
                  row_ptr(const_cast<void*>(from), cfg.home_slot(e), slot_bytes), slot_bytes);
    }
    w_.barrier(rank_);
  }

  void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& spare, void* home, int64_t slot_elems, DType dtype,
                          Stream) override {
    comm_args::check_plan("reduce_clone_grads", cfg, w_.ranks);
    comm_args::check_sum_dtype("reduce_clone_grads", dtype);
    w_.barrier(rank_);
    const int EPR = cfg.experts_per_rank(), M = cfg.max_replicas();
    const size_t slot_bytes = size_t(slot_elems) * dtype_size(dtype);
    for (int j = 0; j < EPR; ++j) {
      const int e = rank_ * EPR + j;
      for (int rep = 1; rep < M; ++rep) {
        const int r = plan.replica_rank[e * M + rep];
        if (r < 0) continue;
        const void* peer = w_.table[size_t(spare.id)][size_t(r)];
        const void* src =
            row_ptr(const_cast<void*>(peer), plan.replica_slot[e * M + rep] - EPR, slot_bytes);
        void* dst = row_ptr(home, j, slot_bytes);
        if (dtype == DType::f32)
          add_into<float>(dst, src, slot_elems);
        else
          add_into<double>(dst, src, slot_elems);
      }
    }
    w_.barrier(rank_);
  }

 private:
  void* peer(const SymmetricBuffer& buf, int rank) const {
    return w_.table[size_t(buf.id)][size_t(rank)];
  }

  int nodes() const { return w_.ranks / w_.per_node; }
  int node_of(int rank) const { return rank / w_.per_node; }
  // The rank of `node` that forwards what `source` sends there: the one with the source's index
  // in its own node.
  int forwarder(int node, int source) const { return node * w_.per_node + source % w_.per_node; }

  // Combine across nodes, before the sums: every token's requests to the other nodes'
  // forwarders, then (as a forwarder) the replies to the requests this rank got, so that every
  // reply is in place at the next barrier.
  void ask_other_nodes(const RowRoute& route, RoundWindow win, const SymmetricBuffer& red,
                       const Tensor& y, const FanTable& fan, bool values) {
    using Request = State::NodeRequest;
    const int K = route.top_k;
    std::vector<int> request_of(size_t(nodes()), -1);
    std::vector<Request> requests;
    for (int64_t t = 0; t < route.n / K; ++t) {
      const int64_t first = t * K;
      if (!host_comm::combine_sums(route, win, first)) continue;
      for (int k = 0; k < K; ++k) {
        const int64_t i = first + k;
        if (!in_window(route, win, i) || node_of(route.dest_rank[i]) == node_of(rank_)) continue;
        int& q = request_of[size_t(node_of(route.dest_rank[i]))];
        if (q < 0) {
          q = int(requests.size());
          requests.push_back(Request{rank_, t, node_of(route.dest_rank[i]), {}, {}});
        }
        const std::pair<int32_t, int64_t> at{route.dest_rank[i], route.dest_row[i] - win.row_lo};
        if (values) requests[size_t(q)].entries.push_back(at);
        if (lead_entry(route, win, first, k) == k) requests[size_t(q)].leads.push_back(at);
      }
      if (requests.empty()) continue;
      {
        std::lock_guard<std::mutex> lock(w_.node_mu);
        for (Request& r : requests)
          w_.node_requests[size_t(forwarder(r.node, rank_))].push_back(std::move(r));
      }
      requests.clear();
      std::fill(request_of.begin(), request_of.end(), -1);
    }
    w_.barrier(rank_);
    const size_t row_bytes = size_t(y.size(1)) * dtype_size(y.dtype);
    const size_t fl = dtype_size(fan.float_dtype);
    for (const Request& r : w_.node_requests[size_t(rank_)]) {
      State::NodeReply reply;
      for (const auto& [d, row] : r.leads) {
        const char* from = row_ptr(peer(red, d), row, row_bytes);
        reply.rows.insert(reply.rows.end(), from, from + row_bytes);
      }
      for (const auto& [d, row] : r.entries) {
        const char* from = row_ptr(peer(fan.values, d), row, fl);
        reply.values.insert(reply.values.end(), from, from + fl);
      }
      w_.combine_within += int64_t(r.leads.size());
      w_.combine_across += int64_t(r.leads.size());
      std::lock_guard<std::mutex> lock(w_.node_mu);
      w_.node_replies[size_t(r.source)][{r.token, r.node}] = std::move(reply);
    }
    w_.node_requests[size_t(rank_)].clear();
    w_.barrier(rank_);
  }

  // y[t] = (add ? y[t] : 0) + sum of t's lead rows, summed in T; values pulled per entry. Rows on
  // other nodes come from the replies ask_other_nodes gathered, in the order they were asked.
  template <class T>
  void combine_rows(const RowRoute& route, RoundWindow win, const SymmetricBuffer& red,
                    const Tensor& y, bool add, const FanTable& fan, void* values_out) {
    const size_t row_bytes = size_t(y.size(1)) * sizeof(T), fl = dtype_size(fan.float_dtype);
    const int K = route.top_k;
    auto& replies = w_.node_replies[size_t(rank_)];
    int64_t token = -1;
    std::vector<size_t> next_row(size_t(nodes()), 0), next_value(size_t(nodes()), 0);
    auto reply_of = [&](int64_t i) -> State::NodeReply& {
      if (i / K != token) {
        token = i / K;
        std::fill(next_row.begin(), next_row.end(), 0);
        std::fill(next_value.begin(), next_value.end(), 0);
      }
      return replies.at({token, node_of(route.dest_rank[i])});
    };
    auto row_of = [&](int64_t i) {
      const int d = route.dest_rank[i];
      if (node_of(d) != node_of(rank_)) {
        State::NodeReply& r = reply_of(i);
        const size_t at = next_row[size_t(node_of(d))]++ * row_bytes;
        return reinterpret_cast<const T*>(r.rows.data() + at);
      }
      ++w_.combine_within;
      return reinterpret_cast<const T*>(
          row_ptr(peer(red, d), route.dest_row[i] - win.row_lo, row_bytes));
    };
    auto value_of = [&](int64_t i) {
      if (!values_out) return;
      const int d = route.dest_rank[i];
      const char* from;
      if (node_of(d) != node_of(rank_)) {
        State::NodeReply& r = reply_of(i);
        from = r.values.data() + next_value[size_t(node_of(d))]++ * fl;
      } else {
        from = row_ptr(peer(fan.values, d), route.dest_row[i] - win.row_lo, fl);
      }
      std::memcpy(static_cast<char*>(values_out) + size_t(i) * fl, from, fl);
    };
    host_comm::sum_leads<T>(route, win, y.as<T>(), y.size(0), y.size(1), add, row_of, value_of);
    replies.clear();
  }

  InProcessWorld::State& w_;
  const int rank_;
  int next_id_ = 0;
};

}  // namespace

namespace {

int checked_per_node(int ranks, int per_node) {
  if (ranks < 1) reject("ranks", ranks, ">= 1");
  if (per_node == 0) return ranks;
  if (per_node < 0 || ranks % per_node != 0)
    reject("ranks_per_node", per_node,
           "0 (one node) or a divisor of the ranks (" + std::to_string(ranks) + ")");
  return per_node;
}

}  // namespace

InProcessWorld::InProcessWorld(int ranks, std::chrono::milliseconds timeout, int ranks_per_node)
    : state_(std::make_unique<State>(ranks, timeout, checked_per_node(ranks, ranks_per_node))) {
  state_->staging.resize(size_t(ranks), nullptr);
  for (int r = 0; r < ranks; ++r)
    state_->comms.push_back(std::make_unique<InProcessCommunicator>(*state_, r));
}

InProcessWorld::~InProcessWorld() = default;

int InProcessWorld::size() const { return state_->ranks; }

int InProcessWorld::ranks_per_node() const { return state_->per_node; }

InProcessWorld::Traffic InProcessWorld::traffic() const {
  return Traffic{state_->dispatch_within.load(), state_->dispatch_across.load(),
                 state_->combine_within.load(), state_->combine_across.load()};
}

void InProcessWorld::reset_traffic() {
  state_->dispatch_within = 0;
  state_->dispatch_across = 0;
  state_->combine_within = 0;
  state_->combine_across = 0;
}

Communicator& InProcessWorld::communicator(int rank) {
  MOE_ECHO_CHECK(rank >= 0 && rank < state_->ranks, "rank " << rank << " outside the world");
  return *state_->comms[size_t(rank)];
}

void InProcessWorld::run(const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(size_t(state_->ranks));
  std::vector<std::thread> threads;
  std::mutex done_mu;
  std::condition_variable done_cv;
  std::vector<bool> done(size_t(state_->ranks), false);
  for (int r = 0; r < state_->ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
        state_->abort();
      }
      std::lock_guard<std::mutex> lock(done_mu);
      done[size_t(r)] = true;
      done_cv.notify_all();
    });
  // A rank that hangs outside the barriers cannot be interrupted: once the world is aborted, the
  // other ranks get one more timeout to return, then the process ends with a message, as the
  // watchdog ends a hung rank of a multi-process run (Watchdog::kExitCode).
  {
    std::unique_lock<std::mutex> lock(done_mu);
    auto all_done = [&] {
      for (bool d : done)
        if (!d) return false;
      return true;
    };
    for (;;) {
      if (done_cv.wait_for(lock, std::chrono::milliseconds(100), all_done)) break;
      bool aborted;
      {
        std::lock_guard<std::mutex> world_lock(state_->mu);
        aborted = state_->aborted;
      }
      if (!aborted) continue;
      if (done_cv.wait_for(lock, state_->timeout, all_done)) break;
      std::ostringstream hung;
      for (int r = 0; r < state_->ranks; ++r)
        if (!done[size_t(r)]) hung << (hung.tellp() > 0 ? ", " : "") << r;
      std::string why = "another rank failed";
      for (auto& e : errors) {
        if (!e) continue;
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& err) {
          why = err.what();
        } catch (...) {
        }
        if (why.find("world aborted") == std::string::npos) break;
      }
      std::fprintf(stderr,
                   "moe-echo: in-process world: rank(s) %s still running %lld ms after the "
                   "world aborted (%s); aborting\n",
                   hung.str().c_str(), static_cast<long long>(state_->timeout.count()),
                   why.c_str());
      std::fflush(stderr);
      _exit(Watchdog::kExitCode);
    }
  }
  for (auto& t : threads) t.join();
  // Report the first failure that is not just another rank noticing the abort.
  std::exception_ptr first;
  for (auto& e : errors) {
    if (!e) continue;
    if (!first) first = e;
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      if (std::string(err.what()).find("world aborted") == std::string::npos) {
        first = e;
        break;
      }
    } catch (...) {
      first = e;
      break;
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace moe_echo
