// Host-collectives communicator (moe_echo/host_collectives.hpp): every op copies what it needs to
// the host, moves it with the caller's blocking collectives and copies the results back, with the
// in-process communicator's arithmetic (comm/host_comm_ops.hpp), so both give the same bits.
//
// dispatch: each rank lists its leads of the window per destination (token order) and sends one
// record per lead: the members' window rows (K ints, lead first, -1 padded), their weights (K of
// the fan's float dtype) and the token's row. The receiver writes the row into the lead's receive
// row, the record's members and weights into the lead's fan rows, and -1 into members[q][0] of
// every other member q: exactly the rows the in-process dispatch writes.
// combine: each rank asks every destination for the red rows of its leads (and the fan values of
// all its entries when values_out is given) by window row; the destination answers in the order
// asked, and the asker sums each token's rows in k order.
// Clone ops: the plan (identical on every rank) says who sends which slot to whom, so their
// exchanges need no counts.
#include "moe_echo/host_collectives.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "comm/comm_args.hpp"
#include "comm/host_comm_ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo {
namespace {

size_t round_up8(size_t v) { return (v + 7) / 8 * 8; }

// Offsets of segments laid back to back: at[d] = sizes[0] + ... + sizes[d - 1]; at[size] = total.
std::vector<size_t> offsets(const std::vector<size_t>& sizes) {
  std::vector<size_t> at(sizes.size() + 1, 0);
  for (size_t d = 0; d < sizes.size(); ++d) at[d + 1] = at[d] + sizes[d];
  return at;
}

// Bytes [at, at + bytes) of a backend buffer and their place in host memory: the destination of a
// read, the source of a write.
struct Piece {
  size_t at = 0;
  size_t bytes = 0;
  char* host = nullptr;
};

// Moves pieces between a backend buffer and host memory through the backend's copies: pieces
// that lie side by side in the buffer (or overlap, for reads) move in one copy, staged through a
// scratch buffer.
class PieceMover {
 public:
  explicit PieceMover(Backend& backend) : backend_(backend) {}

  void read(const void* base, size_t limit, std::vector<Piece>& pieces, const char* what) {
    prepare(limit, pieces, what);
    const char* b = static_cast<const char*>(base);
    for (size_t lo = 0, hi = 0; lo < pieces.size(); lo = hi) {
      const size_t start = pieces[lo].at;
      size_t end = start + pieces[lo].bytes;
      for (hi = lo + 1; hi < pieces.size() && pieces[hi].at <= end; ++hi)
        end = std::max(end, pieces[hi].at + pieces[hi].bytes);
      if (hi == lo + 1) {
        backend_.copy_to_host(pieces[lo].host, b + start, end - start);
        continue;
      }
      scratch_.resize(end - start);
      backend_.copy_to_host(scratch_.data(), b + start, end - start);
      for (size_t p = lo; p < hi; ++p)
        std::memcpy(pieces[p].host, scratch_.data() + (pieces[p].at - start), pieces[p].bytes);
    }
  }

  // Pieces may not overlap: two would mean two entries routed to one row.
  void write(void* base, size_t limit, std::vector<Piece>& pieces, const char* what) {
    prepare(limit, pieces, what);
    char* b = static_cast<char*>(base);
    for (size_t p = 1; p < pieces.size(); ++p)
      MOE_ECHO_CHECK(pieces[p].at >= pieces[p - 1].at + pieces[p - 1].bytes,
                     what << ": bytes " << pieces[p].at << ".." << pieces[p].at + pieces[p].bytes
                          << " are written twice (two entries routed to one row?)");
    for (size_t lo = 0, hi = 0; lo < pieces.size(); lo = hi) {
      const size_t start = pieces[lo].at;
      size_t end = start + pieces[lo].bytes;
      for (hi = lo + 1; hi < pieces.size() && pieces[hi].at == end; ++hi) end += pieces[hi].bytes;
      if (hi == lo + 1) {
        backend_.copy_from_host(b + start, pieces[lo].host, end - start);
        continue;
      }
      scratch_.resize(end - start);
      for (size_t p = lo; p < hi; ++p)
        std::memcpy(scratch_.data() + (pieces[p].at - start), pieces[p].host, pieces[p].bytes);
      backend_.copy_from_host(b + start, scratch_.data(), end - start);
    }
  }

 private:
  // Drops empty pieces, checks the others lie inside the first `limit` bytes, sorts them.
  static void prepare(size_t limit, std::vector<Piece>& pieces, const char* what) {
    pieces.erase(
        std::remove_if(pieces.begin(), pieces.end(), [](const Piece& p) { return p.bytes == 0; }),
        pieces.end());
    for (const Piece& p : pieces)
      MOE_ECHO_CHECK(p.bytes <= limit && p.at <= limit - p.bytes,
                     what << ": bytes " << p.at << ".." << p.at + p.bytes << " outside the "
                          << limit << " bytes the op may touch");
    std::sort(pieces.begin(), pieces.end(),
              [](const Piece& a, const Piece& b) { return a.at < b.at; });
  }

  Backend& backend_;
  std::vector<char> scratch_;
};

// Calls f(i, d, lead) for every entry i of the window in entry order: d its destination rank,
// lead whether it leads its (token, rank) pair. The route is on the host.
template <class F>
void for_each_in_window(const RowRoute& route, RoundWindow win, int ranks, bool combine, F&& f) {
  const int K = route.top_k;
  for (int64_t first = 0; first < route.n; first += K) {
    if (combine && !host_comm::combine_sums(route, win, first)) continue;
    for (int k = 0; k < K; ++k) {
      const int64_t i = first + k;
      if (!host_comm::in_window(route, win, i) ||
          (!combine && !host_comm::dispatch_moves(route, win, first, k)))
        continue;
      const int d = route.dest_rank[i];
      MOE_ECHO_CHECK(d >= 0 && d < ranks,
                     "entry " << i << " in the window is routed to rank " << d << " of " << ranks);
      f(i, d, host_comm::lead_entry(route, win, first, k) == k);
    }
  }
}

// y's element type (bf16 as its bits) as f(Y{}).
template <class F>
void with_row_type(DType t, F&& f) {
  if (t == DType::f64)
    f(double{});
  else if (t == DType::f32)
    f(float{});
  else
    f(host_comm::Bf16Bits{});
}

class HostCollectivesCommunicator final : public Communicator {
 public:
  HostCollectivesCommunicator(HostCollectives& collectives, Backend& backend)
      : coll_(collectives),
        backend_(backend),
        io_(backend),
        rank_(collectives.rank()),
        size_(collectives.size()) {
    if (size_ < 1) reject("HostCollectives::size()", size_, "a rank count >= 1");
    if (rank_ < 0 || rank_ >= size_)
      reject("HostCollectives::rank()", rank_, "0 <= rank < size (" + std::to_string(size_) + ")");
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool capturable() const override { return false; }

  SymmetricBuffer alloc_symmetric(Backend& backend, size_t bytes) override {
    check_backend(backend, "alloc_symmetric");
    const int id = int(held_.size());
    const std::vector<size_t> all = gather_sizes({bytes});
    for (int r = 0; r < size_; ++r)
      MOE_ECHO_CHECK(all[size_t(r)] == bytes,
                     "symmetric buffer " << id << ": rank " << r << " allocates " << all[size_t(r)]
                                         << " bytes, rank " << rank_ << " " << bytes);
    SymmetricBuffer buf;
    buf.local = backend_.allocate(bytes);
    buf.bytes = bytes;
    buf.id = id;
    held_.push_back(buf);
    return buf;
  }

  // Nobody else reads this rank's buffers: no collective.
  void free_symmetric(Backend& backend, SymmetricBuffer& buf) override {
    if (!buf.local) return;
    check_backend(backend, "free_symmetric");
    live(buf, "free_symmetric");
    backend_.deallocate(buf.local);
    held_[size_t(buf.id)].local = nullptr;
    buf.local = nullptr;
  }

  void barrier() override { coll_.barrier(); }

  void all_gather_i32(const int32_t* local, int32_t* all, int64_t n, Stream) override {
    MOE_ECHO_CHECK(n >= 0, "all_gather_i32 of " << n << " ints per rank");
    const size_t bytes = size_t(n) * sizeof(int32_t);
    send_.resize(bytes);
    recv_.resize(bytes * size_t(size_));
    backend_.copy_to_host(send_.data(), local, bytes);
    coll_.all_gather(send_.data(), recv_.data(), bytes);
    backend_.copy_from_host(all, recv_.data(), recv_.size());
  }

  void all_reduce_sum(const Tensor& t, Stream) override {
    comm_args::check_sum_dtype("all_reduce_sum", t.dtype);
    const size_t bytes = t.bytes();
    send_.resize(bytes);
    recv_.resize(bytes * size_t(size_));
    backend_.copy_to_host(send_.data(), t.data, bytes);
    coll_.all_gather(send_.data(), recv_.data(), bytes);
    std::vector<const void*> parts;
    for (int r = 0; r < size_; ++r) parts.push_back(recv_.data() + size_t(r) * bytes);
    host_comm::store_sum(host_comm::rank_order_sum(parts, t.dtype, t.numel()), t.dtype,
                         send_.data());
    backend_.copy_from_host(t.data, send_.data(), bytes);
  }

  void dispatch(const RowRoute& route, RoundWindow win, const void* src, size_t row_bytes,
                const SymmetricBuffer& recv, const FanTable& fan, Stream) override {
    comm_args::check_route("dispatch", route, win, fan, {DType::f32, DType::f64});
    check_window(win, recv, row_bytes, fan, "dispatch");
    const RowRoute h = host_route(route, fan, /*weights=*/true);
    const int K = route.top_k;
    const size_t R = size_t(size_), fl = dtype_size(fan.float_dtype), rows = size_t(win.rows);
    // A record: members [K] i32, weights [K] float, the row; padded to 8 bytes.
    const size_t members_row = size_t(K) * sizeof(int32_t), weights_at = members_row;
    const size_t row_at = weights_at + size_t(K) * fl;
    const size_t record = round_up8(row_at + row_bytes);

    std::vector<size_t> leads(R, 0);
    for_each_in_window(h, win, size_, false,
                       [&](int64_t, int d, bool lead) { leads[size_t(d)] += lead; });
    std::vector<size_t> send_bytes(R);
    for (size_t d = 0; d < R; ++d) send_bytes[d] = leads[d] * record;
    std::vector<size_t> at = offsets(send_bytes);
    send_.assign(at[R], 0);
    pieces_.clear();
    for_each_in_window(h, win, size_, false, [&](int64_t i, int d, bool lead) {
      if (!lead) return;
      char* r = send_.data() + at[size_t(d)];
      at[size_t(d)] += record;
      const int64_t first = i - i % K;
      host_comm::list_members(h, win, first, int(i - first), fan.float_dtype,
                              reinterpret_cast<int32_t*>(r), r + weights_at);
      pieces_.push_back({size_t(first / K) * row_bytes, row_bytes, r + row_at});
    });
    io_.read(src, size_t(route.n / K) * row_bytes, pieces_, "dispatch (token rows)");

    const std::vector<size_t> incoming = counts_to_me(leads, 1);
    std::vector<size_t> recv_bytes(R);
    for (size_t s = 0; s < R; ++s) recv_bytes[s] = incoming[s] * record;
    recv_.resize(offsets(recv_bytes)[R]);
    coll_.all_to_all_v(send_.data(), send_bytes, recv_.data(), recv_bytes);

    pieces_.clear();
    members_.clear();
    weights_.clear();
    for (size_t j = 0; j < recv_.size() / record; ++j) {
      char* r = recv_.data() + j * record;
      const int32_t* m = reinterpret_cast<const int32_t*>(r);
      int count = 0;
      while (count < K && m[count] >= 0) ++count;
      MOE_ECHO_CHECK(count > 0, "dispatch: a lead arrived without its window row");
      const size_t p = size_t(m[0]);
      pieces_.push_back({p * row_bytes, row_bytes, r + row_at});
      members_.push_back({p * members_row, members_row, r});
      weights_.push_back({p * size_t(K) * fl, size_t(count) * fl, r + weights_at});
      for (int q = 1; q < count; ++q)
        members_.push_back(
            {size_t(m[q]) * members_row, sizeof(int32_t), reinterpret_cast<char*>(&not_a_lead_)});
    }
    io_.write(recv.local, rows * row_bytes, pieces_, "dispatch (receive rows)");
    io_.write(fan.members.local, rows * members_row, members_, "dispatch (fan members)");
    io_.write(fan.weights.local, rows * size_t(K) * fl, weights_, "dispatch (fan weights)");
  }

  void combine(const RowRoute& route, RoundWindow win, const SymmetricBuffer& red, const Tensor& y,
               const int32_t* accumulate, const FanTable& fan, void* values_out, Stream) override {
    comm_args::check_route("combine", route, win, fan, {DType::f32, DType::f64});
    comm_args::check_combine_rows(route, y, {DType::bf16, DType::f32, DType::f64});
    const size_t row_bytes = size_t(y.size(1)) * dtype_size(y.dtype);
    check_window(win, red, row_bytes, fan, "combine");
    const RowRoute h = host_route(route, fan, /*weights=*/false);
    const size_t R = size_t(size_), fl = dtype_size(fan.float_dtype), rows = size_t(win.rows);
    const size_t n = size_t(route.n);

    // Requests per destination: the window rows of its leads, then of every entry (values_out).
    std::vector<size_t> count(2 * R, 0);
    lead_slot_.resize(n);
    value_slot_.resize(n);
    for_each_in_window(h, win, size_, true, [&](int64_t i, int d, bool lead) {
      if (lead) lead_slot_[size_t(i)] = count[2 * size_t(d)]++;
      if (values_out) value_slot_[size_t(i)] = count[2 * size_t(d) + 1]++;
    });
    // Per rank, for its (leads, entries) counts: the request's bytes (window rows as i32) and
    // the answer's (the rows, then the values, padded to 8 bytes).
    auto request_bytes = [&](const std::vector<size_t>& c) {
      std::vector<size_t> ask(R);
      for (size_t r = 0; r < R; ++r) ask[r] = (c[2 * r] + c[2 * r + 1]) * sizeof(int32_t);
      return ask;
    };
    auto answer_bytes_of = [&](const std::vector<size_t>& c) {
      std::vector<size_t> answer(R);
      for (size_t r = 0; r < R; ++r)
        answer[r] = round_up8(c[2 * r] * row_bytes + c[2 * r + 1] * fl);
      return answer;
    };
    const std::vector<size_t> ask_bytes = request_bytes(count),
                              answer_bytes = answer_bytes_of(count);
    const std::vector<size_t> ask_at = offsets(ask_bytes), answer_at = offsets(answer_bytes);
    send_.resize(ask_at[R]);
    for_each_in_window(h, win, size_, true, [&](int64_t i, int d, bool lead) {
      int32_t* ask = reinterpret_cast<int32_t*>(send_.data() + ask_at[size_t(d)]);
      const int32_t row = int32_t(h.dest_row[i] - win.row_lo);
      if (lead) ask[lead_slot_[size_t(i)]] = row;
      if (values_out) ask[count[2 * size_t(d)] + value_slot_[size_t(i)]] = row;
    });

    // The requests this rank answers, per source.
    const std::vector<size_t> asked = counts_to_me(count, 2);
    const std::vector<size_t> asked_bytes = request_bytes(asked),
                              reply_bytes = answer_bytes_of(asked);
    const std::vector<size_t> asked_at = offsets(asked_bytes), reply_at = offsets(reply_bytes);
    recv_.resize(asked_at[R]);
    coll_.all_to_all_v(send_.data(), ask_bytes, recv_.data(), asked_bytes);
    reply_.assign(reply_at[R], 0);
    std::vector<Piece>& values = weights_;  // the fan values pieces
    pieces_.clear();
    values.clear();
    for (size_t s = 0; s < R; ++s) {
      const int32_t* ask = reinterpret_cast<const int32_t*>(recv_.data() + asked_at[s]);
      char* out = reply_.data() + reply_at[s];
      const size_t leads = asked[2 * s];
      for (size_t j = 0; j < leads; ++j)
        pieces_.push_back({size_t(ask[j]) * row_bytes, row_bytes, out + j * row_bytes});
      for (size_t j = 0; j < asked[2 * s + 1]; ++j)
        values.push_back({size_t(ask[leads + j]) * fl, fl, out + leads * row_bytes + j * fl});
    }
    io_.read(red.local, rows * row_bytes, pieces_, "combine (red rows)");
    io_.read(fan.values.local, rows * fl, values, "combine (fan values)");
    answer_.resize(answer_at[R]);
    coll_.all_to_all_v(reply_.data(), reply_bytes, answer_.data(), answer_bytes);

    // The sums, on a host copy of y.
    int32_t flag = 0;
    if (accumulate) backend_.copy_to_host(&flag, accumulate, sizeof flag);
    const bool add = flag != 0;
    y_.resize(y.bytes());
    // With chunks the tokens this call does not sum keep their y: all of y comes back.
    if (add || route.chunks.bounds) backend_.copy_to_host(y_.data(), y.data, y.bytes());
    pieces_.clear();
    with_row_type(y.dtype, [&](auto elem) {
      using Y = decltype(elem);
      auto lead_row = [&](int64_t i) {
        const size_t d = size_t(h.dest_rank[i]);
        return reinterpret_cast<const Y*>(answer_.data() + answer_at[d] +
                                          lead_slot_[size_t(i)] * row_bytes);
      };
      auto entry = [&](int64_t i) {
        const size_t d = size_t(h.dest_rank[i]);
        if (values_out)
          pieces_.push_back({size_t(i) * fl, fl,
                             answer_.data() + answer_at[d] + count[2 * d] * row_bytes +
                                 value_slot_[size_t(i)] * fl});
      };
      host_comm::sum_leads<Y>(h, win, reinterpret_cast<Y*>(y_.data()), y.size(0), y.size(1), add,
                              lead_row, entry);
    });
    backend_.copy_from_host(y.data, y_.data(), y.bytes());
    if (values_out) io_.write(values_out, n * fl, pieces_, "combine (values_out)");
  }

  // Spare slot s of rank r <- the home slot of spare_expert[r][s] on its home rank. Both sides of
  // every pair of ranks visit the slots in (r, s) order.
  void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& home, void* spare, size_t slot_bytes,
                          Stream) override {
    comm_args::check_plan("pull_clone_weights", cfg, size_);
    const int S = cfg.spare_slots, EPR = cfg.experts_per_rank();
    const size_t R = size_t(size_), home_limit = size_t(EPR) * slot_bytes,
                 spare_limit = size_t(S) * slot_bytes;
    check_fits(home, home_limit, "pull_clone_weights");
    if (S == 0 || cfg.max_clones == 0) return;  // no clones on any rank
    plan_.resize(R * size_t(S));
    backend_.copy_to_host(plan_.data(), plan.spare_expert, plan_.size() * sizeof(int32_t));
    std::vector<size_t> send_bytes(R, 0), recv_bytes(R, 0);
    pieces_.clear();
    for (int r = 0; r < size_; ++r)
      for (int s = 0; s < S; ++s) {
        const int e = plan_[size_t(r * S + s)];
        if (e < 0) continue;
        MOE_ECHO_CHECK(e < cfg.experts, "plan: spare slot " << s << " of rank " << r
                                                            << " holds expert " << e << " of "
                                                            << cfg.experts);
        const int owner = cfg.home_rank(e);
        if (owner == rank_) {  // in (r, s) order: the send buffer's destination segments in turn
          send_bytes[size_t(r)] += slot_bytes;
          pieces_.push_back({size_t(cfg.home_slot(e)) * slot_bytes, slot_bytes, nullptr});
        }
        if (r == rank_) recv_bytes[size_t(owner)] += slot_bytes;
      }
    std::vector<size_t> at = exchange_slots(home.local, home_limit, slot_bytes, send_bytes,
                                            recv_bytes, "pull_clone_weights (home slots)");
    pieces_.clear();
    for (int s = 0; s < S; ++s) {
      const int e = plan_[size_t(rank_ * S + s)];
      if (e < 0) continue;
      size_t& from = at[size_t(cfg.home_rank(e))];
      pieces_.push_back({size_t(s) * slot_bytes, slot_bytes, recv_.data() + from});
      from += slot_bytes;
    }
    io_.write(spare, spare_limit, pieces_, "pull_clone_weights (spare slots)");
  }

  // Every clone's gradient slot goes to its expert's home rank, which adds them in replica order.
  // Both sides of every pair of ranks visit the clones in (expert, replica) order.
  void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg,
                          const SymmetricBuffer& spare, void* home, int64_t slot_elems, DType dtype,
                          Stream) override {
    comm_args::check_plan("reduce_clone_grads", cfg, size_);
    comm_args::check_sum_dtype("reduce_clone_grads", dtype);
    MOE_ECHO_CHECK(slot_elems >= 0, "reduce_clone_grads: slots of " << slot_elems << " elements");
    const int S = cfg.spare_slots, EPR = cfg.experts_per_rank(), M = cfg.max_replicas();
    const int E = cfg.experts;
    const size_t R = size_t(size_), slot = size_t(slot_elems) * dtype_size(dtype);
    const size_t limit = size_t(S) * slot;
    check_fits(spare, limit, "reduce_clone_grads");
    if (S == 0 || cfg.max_clones == 0) return;  // no clones on any rank
    const size_t EM = size_t(E) * size_t(M);
    plan_.resize(2 * EM);
    backend_.copy_to_host(plan_.data(), plan.replica_rank, EM * sizeof(int32_t));
    backend_.copy_to_host(plan_.data() + EM, plan.replica_slot, EM * sizeof(int32_t));
    const int32_t* rep_rank = plan_.data();
    const int32_t* rep_slot = plan_.data() + EM;
    std::vector<size_t> send_bytes(R, 0), recv_bytes(R, 0);
    pieces_.clear();
    for (int e = 0; e < E; ++e)  // home ranks ascend with e: destination segments in turn
      for (int rep = 1; rep < M; ++rep) {
        const size_t x = size_t(e) * size_t(M) + size_t(rep);
        const int r = rep_rank[x], home_rank = cfg.home_rank(e);
        if (r < 0) continue;
        MOE_ECHO_CHECK(r < size_ && rep_slot[x] >= EPR && rep_slot[x] < EPR + S,
                       "plan: replica " << rep << " of expert " << e << " on rank " << r
                                        << ", slot " << rep_slot[x]);
        if (r == rank_) {
          send_bytes[size_t(home_rank)] += slot;
          pieces_.push_back({size_t(rep_slot[x] - EPR) * slot, slot, nullptr});
        }
        if (home_rank == rank_) recv_bytes[size_t(r)] += slot;
      }
    std::vector<size_t> at = exchange_slots(spare.local, limit, slot, send_bytes, recv_bytes,
                                            "reduce_clone_grads (clone slots)");

    // The home slots with clones, read, summed in replica order and written back.
    std::vector<int> cloned;
    for (int j = 0; j < EPR; ++j)
      for (int rep = 1; rep < M; ++rep)
        if (rep_rank[size_t(rank_ * EPR + j) * size_t(M) + size_t(rep)] >= 0) {
          cloned.push_back(j);
          break;
        }
    y_.resize(cloned.size() * slot);
    pieces_.clear();
    for (size_t c = 0; c < cloned.size(); ++c)
      pieces_.push_back({size_t(cloned[c]) * slot, slot, y_.data() + c * slot});
    io_.read(home, size_t(EPR) * slot, pieces_, "reduce_clone_grads (home slots)");
    for (size_t c = 0; c < cloned.size(); ++c) {
      const int e = rank_ * EPR + cloned[c];
      for (int rep = 1; rep < M; ++rep) {
        const int r = rep_rank[size_t(e) * size_t(M) + size_t(rep)];
        if (r < 0) continue;
        size_t& from = at[size_t(r)];
        if (dtype == DType::f32)
          host_comm::add_into<float>(y_.data() + c * slot, recv_.data() + from, slot_elems);
        else
          host_comm::add_into<double>(y_.data() + c * slot, recv_.data() + from, slot_elems);
        from += slot;
      }
    }
    io_.write(home, size_t(EPR) * slot, pieces_, "reduce_clone_grads (home slots)");
  }

 private:
  void check_backend(const Backend& backend, const char* op) const {
    MOE_ECHO_CHECK(&backend == &backend_, op << ": given backend '" << backend.name()
                                             << "', not the one this communicator was made with ('"
                                             << backend_.name() << "')");
  }

  // The bytes of a live symmetric buffer of this communicator.
  size_t live(const SymmetricBuffer& buf, const char* op) const {
    MOE_ECHO_CHECK(
        buf.id >= 0 && buf.id < int(held_.size()) && buf.local &&
            held_[size_t(buf.id)].local == buf.local,
        op << ": symmetric buffer " << buf.id << " is not a live buffer of this communicator");
    return held_[size_t(buf.id)].bytes;
  }

  void check_fits(const SymmetricBuffer& buf, size_t need, const char* op) const {
    const size_t have = live(buf, op);
    MOE_ECHO_CHECK(need <= have,
                   op << ": " << need << " bytes into a symmetric buffer of " << have);
  }

  // The window's buffers are live buffers of this communicator, and the window fits them.
  void check_window(RoundWindow win, const SymmetricBuffer& rows_buf, size_t row_bytes,
                    const FanTable& fan, const char* op) const {
    for (const SymmetricBuffer* b : {&rows_buf, &fan.members, &fan.weights, &fan.values})
      live(*b, op);
    comm_args::check_window_fits(op, win, rows_buf, row_bytes, fan);
  }

  // The clone ops' exchange: the slots pieces_ lists (in the order of their destinations) are read
  // from `buf` into send_ and sent; recv_ receives recv_bytes from each rank. Returns where each
  // source's slots start in recv_.
  std::vector<size_t> exchange_slots(const void* buf, size_t limit, size_t slot,
                                     const std::vector<size_t>& send_bytes,
                                     const std::vector<size_t>& recv_bytes, const char* what) {
    send_.resize(pieces_.size() * slot);
    for (size_t j = 0; j < pieces_.size(); ++j) pieces_[j].host = send_.data() + j * slot;
    io_.read(buf, limit, pieces_, what);
    std::vector<size_t> at = offsets(recv_bytes);
    recv_.resize(at.back());
    coll_.all_to_all_v(send_.data(), send_bytes, recv_.data(), recv_bytes);
    return at;
  }

  // The route on the host (this communicator's copies), with weights when asked and given;
  // comm_args::check_route has checked it.
  RowRoute host_route(const RowRoute& route, const FanTable& fan, bool weights) {
    const size_t n = size_t(route.n), fl = dtype_size(fan.float_dtype);
    dest_rank_.resize(n);
    dest_row_.resize(n);
    backend_.copy_to_host(dest_rank_.data(), route.dest_rank, n * sizeof(int32_t));
    backend_.copy_to_host(dest_row_.data(), route.dest_row, n * sizeof(int32_t));
    RowRoute h{dest_rank_.data(), dest_row_.data(), nullptr, route.n, route.top_k, route.chunks};
    if (route.chunks.bounds) {
      const RowChunks& c = route.chunks;
      chunk_bounds_.resize(size_t(size_) * size_t(c.chunks + 1));
      backend_.copy_to_host(chunk_bounds_.data(), c.bounds, chunk_bounds_.size() * sizeof(int32_t));
      h.chunks.bounds = chunk_bounds_.data();
    }
    if (weights && route.weight) {
      route_weight_.resize(n * fl);
      backend_.copy_to_host(route_weight_.data(), route.weight, n * fl);
      h.weight = route_weight_.data();
    }
    return h;
  }

  // Every rank's `mine` (the same count on all), gathered: [rank][i].
  std::vector<size_t> gather_sizes(const std::vector<size_t>& mine) {
    std::vector<uint64_t> send(mine.begin(), mine.end()), all(mine.size() * size_t(size_));
    coll_.all_gather(send.data(), all.data(), send.size() * sizeof(uint64_t));
    return std::vector<size_t>(all.begin(), all.end());
  }

  // per_dest[d * fields + f] of every rank, gathered; returns, per source s, what s holds for
  // this rank: out[s * fields + f].
  std::vector<size_t> counts_to_me(const std::vector<size_t>& per_dest, size_t fields) {
    const std::vector<size_t> all = gather_sizes(per_dest);
    const size_t R = size_t(size_), row = R * fields;
    std::vector<size_t> out(R * fields);
    for (size_t s = 0; s < R; ++s)
      for (size_t f = 0; f < fields; ++f)
        out[s * fields + f] = all[s * row + size_t(rank_) * fields + f];
    return out;
  }

  HostCollectives& coll_;
  Backend& backend_;
  PieceMover io_;
  const int rank_, size_;
  std::vector<SymmetricBuffer> held_;  // by id; freed ones keep local = nullptr
  int32_t not_a_lead_ = -1;            // members[q][0] of a non-lead row q
  // Host staging, kept between calls.
  std::vector<int32_t> dest_rank_, dest_row_, plan_, chunk_bounds_;
  std::vector<char> route_weight_, send_, recv_, reply_, answer_, y_;
  std::vector<size_t> lead_slot_, value_slot_;
  std::vector<Piece> pieces_, members_, weights_;
};

}  // namespace

std::unique_ptr<Communicator> make_host_collectives_communicator(HostCollectives& collectives,
                                                                 Backend& backend) {
  return std::make_unique<HostCollectivesCommunicator>(collectives, backend);
}

}  // namespace moe_echo
