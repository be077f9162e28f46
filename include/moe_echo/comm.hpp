// Communicator: how the R expert-parallel ranks of a layer exchange counts, rows and weights.
//
// Implementations: in-process (R ranks as threads of one process, for the CPU backend and CI),
// NCCL host API (baseline), NCCL device API (sync-free). All per-step ops are collective: every
// rank calls the same ops in the same order. Buffers that peers read or write are symmetric:
// allocated collectively, the same size on every rank, at layer build time.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "moe_echo/backend.hpp"
#include "moe_echo/dist.hpp"
#include "moe_echo/planner.hpp"
#include "moe_echo/tensor.hpp"

namespace moe_echo {

// A buffer every rank holds at the same id; peers may read and write it during collective ops.
struct SymmetricBuffer {
  void* local = nullptr;
  size_t bytes = 0;
  int id = -1;
};

// Where each (token, k) entry of this rank goes: receive row dest_row[i] (global over rounds) of
// rank dest_rank[i]. Entry i belongs to token i / top_k.
struct RowRoute {
  const int32_t* dest_rank = nullptr;  // device [n]
  const int32_t* dest_row = nullptr;   // device [n]
  const void* weight = nullptr;        // device [n] combine weights (the fan table's float dtype),
                                       // or nullptr: weight 1
  int64_t n = 0;                       // tokens * top_k
  int top_k = 1;
  RowChunks chunks = {};  // the one chunk of the window a call moves (see below)
};

// Leads and members. Entry i is in a window when row_lo <= dest_row[i] < row_lo + rows. In a
// window, the members of (token t, rank d) are t's entries in the window with dest_rank d; the
// lead is the member with the lowest receive row (the first in slot order: receive rows are laid
// out slot by slot). A token's row crosses to rank d once per window, into the lead's receive
// row; the receiver copies it to the other members' rows (Backend::fan_out) and sums the members'
// results into the lead's row (Backend::fan_in) before the source reads it back, so a token
// picking several experts on one rank moves one row each way, not one per expert.
//
// Chunks (RowRoute::chunks, MoeConfig::chunks): the calls of a window's chunks 0, 1, ... together
// move what one call over the whole window moves, with the same bits. A dispatch moves the
// (token, rank) pairs whose lead row lies in its chunk at that rank: a pair's lead row is in the
// earliest chunk of its members, so the row has arrived when the first of them is computed, and
// the receiver's fan_out of that chunk copies it to members in later chunks (FanArgs::chunk). A
// combine sums the tokens whose last chunk is its chunk: the highest chunk of the token's entries
// over all ranks (0 for a token without entries in the window); a pair's fan_in belongs to its
// last member's chunk, so every lead row a token needs is summed by then. Each token's y is
// written by one of the calls, the others leave it as it is.
//
// The fan table tells the receiver who its members are: symmetric buffers of the layer, indexed by
// window row (row - row_lo), written by the dispatch on the receiving rank:
// - members [rows, K] i32: for a lead row p, the window rows of p's members, p first, then the
//   others in k order, then -1 padding; for any other row q in the window, members[q][0] = -1.
// - weights [rows, K] float: the route's combine weight of each member (1 without weights).
// - values  [rows] float: written by the receiver (Backend::fan_out's d_weight), read back per
//   entry by the combine.
// Only rows that some entry targets this round are written: readers visit valid rows only.
struct FanTable {
  SymmetricBuffer members, weights, values;
  int top_k = 1;
  DType float_dtype = DType::f32;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Whether every per-step op can be captured into a CUDA graph (no host synchronisation inside
  // a step). MoeLayer runs eager steps of a capturable communicator as graphs (see
  // Backend::enqueue_as_graph), and those of others op by op.
  virtual bool capturable() const { return true; }
  // Host, at every step's enqueue (no device work, no sync): throws Error naming the peer when
  // this communicator knows one was lost (the NCCL communicators' PeerMonitor); a no-op for the
  // others. An eager step relaunches a cached graph without calling the per-step ops below, so
  // this is where it learns of the loss.
  virtual void check_peers() {}

  // Build time (collective, may block).
  virtual SymmetricBuffer alloc_symmetric(Backend& backend, size_t bytes) = 0;
  virtual void free_symmetric(Backend& backend, SymmetricBuffer& buf) = 0;
  virtual void barrier() = 0;

  // Per step (collective, capture-safe on device communicators).
  // all[r * n + i] = local[i] of rank r, for i < n.
  virtual void all_gather_i32(const int32_t* local, int32_t* all, int64_t n, Stream s) = 0;
  // t <- sum over ranks of t (f32 or f64), summed in rank order so every rank gets the same bits.
  // For replicated parameters such as the router weight.
  virtual void all_reduce_sum(const Tensor& t, Stream s) = 0;
  // Row t of `src` (row_bytes each) to the lead row of `recv` on every rank where token t has
  // entries in the window, once per rank; the fan table of those rows on the receiving rank
  // (members and weights). Other members' rows of `recv` are left to the receiver's fan_out.
  virtual void dispatch(const RowRoute& route, RoundWindow window, const void* src,
                        size_t row_bytes, const SymmetricBuffer& recv, const FanTable& fan,
                        Stream s) = 0;
  // For every token t of y ([n / top_k, H], activation or float dtype):
  //   y[t] = (accumulate && *accumulate != 0 ? y[t] : 0)
  //          + sum over t's lead entries i in the window, in k order, of
  //            row (dest_row[i] - row_lo) of `red` on rank dest_rank[i]   (rows of y's dtype),
  // summed in float (f32 for bf16 and f32, f64 for f64) and rounded once. `accumulate` is a device
  // flag (or nullptr: overwrite). Tokens without entries in the window get the first term only.
  // When values_out is given (device, [n] of the fan's float dtype): values_out[i] <- fan.values
  // at window row (dest_row[i] - row_lo) of rank dest_rank[i], for every entry i in the window.
  virtual void combine(const RowRoute& route, RoundWindow window, const SymmetricBuffer& red,
                       const Tensor& y, const int32_t* accumulate, const FanTable& fan,
                       void* values_out, Stream s) = 0;
  // ECHO clone weight sync: every spare slot s of this rank that the plan fills with expert e gets
  // home slot (e % (E/R)) of rank (e / (E/R)) of `home` (symmetric: each rank's E/R home slots of
  // slot_bytes), written at `spare` + s * slot_bytes (this rank's cfg.spare_slots slots, any memory
  // of the backend: a layer's own, or a pool of echo slots that the layers of a model share).
  virtual void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg,
                                  const SymmetricBuffer& home, void* spare, size_t slot_bytes,
                                  Stream s) = 0;
  // ECHO clone gradient reduction: every home expert j of this rank adds, in replica order, the
  // gradients its clones accumulated in the spare slots of `spare` on other ranks (or on this one)
  // to slot j of `home`. `spare` is symmetric: each rank's cfg.spare_slots slots of slot_elems
  // (spare slot s, plan slot E/R + s, at s * slot_elems); `home` this rank's E/R home slots, any
  // memory of the backend (the layer's gradients, or a framework's gradient tensor).
  virtual void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg,
                                  const SymmetricBuffer& spare, void* home, int64_t slot_elems,
                                  DType dtype, Stream s) = 0;
};

// R ranks as threads of one process. Each thread drives one rank through communicator(r); ops
// meet at barriers as device collectives would. A rank that waits `timeout` at a barrier (default:
// MOE_ECHO_TIMEOUT_S, 300 s) aborts the world with an error naming the ranks that never arrived.
//
// Nodes (ranks_per_node P, a divisor of R; 0 or R: one node): ranks r and s share a node when
// r / P == s / P. With more than one node, dispatch and combine move rows as a hierarchical
// dispatcher across nodes does, with the same results bit for bit:
// - dispatch: a token's row goes to the ranks of its own node directly, and once to every other
//   node it has entries on (in the call), to that node's forwarder for the source (the rank of
//   that node with the source's index in its own node), with the writes it asks there: for each
//   of the token's entries the call moves to that node, the receive row's rank and window row,
//   and for a lead its fan table row; the forwarder then makes those writes on its node's ranks;
// - combine: the source asks each other node's forwarder for the lead rows (and fan values) of
//   its tokens' entries on that node, the forwarder gathers them from its node's ranks and sends
//   them back, and the source sums every lead in k order as the flat path does.
// traffic() counts the rows each way.
class InProcessWorld {
 public:
  explicit InProcessWorld(int ranks, std::chrono::milliseconds timeout = default_timeout(),
                          int ranks_per_node = 0);
  ~InProcessWorld();
  InProcessWorld(const InProcessWorld&) = delete;
  InProcessWorld& operator=(const InProcessWorld&) = delete;

  int size() const;
  Communicator& communicator(int rank);
  // Runs fn(rank) on one thread per rank and joins them. If a rank throws (or times out at a
  // barrier), the world is aborted (every rank waiting at a barrier throws too) and the first
  // exception is rethrown here. A rank still running `timeout` after the abort (hung outside the
  // barriers, where it cannot be interrupted) ends the process: a message naming it on stderr and
  // _exit(Watchdog::kExitCode), 124.
  void run(const std::function<void(int rank)>& fn);

  int ranks_per_node() const;
  // Rows moved by dispatch and combine since the world was made (or reset): within a node (from
  // the source, or a forwarder's writes and gathers) and across nodes (a dispatch's one copy per
  // (token, node), a combine's lead rows sent back).
  struct Traffic {
    int64_t dispatch_within = 0, dispatch_across = 0;
    int64_t combine_within = 0, combine_across = 0;
  };
  Traffic traffic() const;
  void reset_traffic();

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace moe_echo
