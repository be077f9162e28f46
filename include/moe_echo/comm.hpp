// Communicator: how the R expert-parallel ranks of a layer exchange counts, rows and weights.
//
// Implementations: in-process (R ranks as threads of one process, for the CPU backend and CI),
// NCCL host API (baseline), NCCL device API (sync-free). All per-step ops are collective: every
// rank calls the same ops in the same order. Buffers that peers read or write are symmetric:
// allocated collectively, the same size on every rank, at layer build time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "moe_echo/backend.hpp"
#include "moe_echo/planner.hpp"
#include "moe_echo/tensor.hpp"

namespace moe_echo {

// A buffer every rank holds at the same id; peers may read and write it during collective ops.
struct SymmetricBuffer {
  void* local = nullptr;
  size_t bytes = 0;
  int id = -1;
};

// Where each (token, k) entry of this rank goes: receive row dest_row[i] of rank dest_rank[i].
// Entry i reads source row i / src_div (src_div = K for token rows, 1 for per-entry rows).
struct RowRoute {
  const int32_t* dest_rank = nullptr;  // device [n]
  const int32_t* dest_row = nullptr;   // device [n], global receive row over all rounds
  int64_t n = 0;
  int src_div = 1;
};

// One round's window of receive rows: [row_lo, row_lo + rows).
struct RoundWindow {
  int64_t row_lo = 0;
  int64_t rows = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

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
  // For every entry i whose dest_row lies in the window: row (dest_row - row_lo) of `recv` on rank
  // dest_rank <- row i / src_div of `src`. `recv` holds window.rows rows of `row_bytes`.
  virtual void dispatch(const RowRoute& route, RoundWindow window, const void* src,
                        size_t row_bytes, const SymmetricBuffer& recv, Stream s) = 0;
  // For every entry i whose dest_row lies in the window: row i of `gathered` <- row
  // (dest_row - row_lo) of `out` on rank dest_rank. Entries outside the window are untouched.
  virtual void combine(const RowRoute& route, RoundWindow window, const SymmetricBuffer& out,
                       size_t row_bytes, void* gathered, Stream s) = 0;
  // ECHO clone weight sync: every spare slot s of this rank that the plan fills with expert e gets
  // slot (e % (E/R)) of rank (e / (E/R)): `weights` holds [home + spare slots][slot_bytes].
  virtual void pull_clone_weights(const PlanView& plan, const PlannerConfig& cfg,
                                  const SymmetricBuffer& weights, size_t slot_bytes,
                                  Stream s) = 0;
  // ECHO clone gradient reduction: every home expert of this rank adds, in replica order, the
  // gradients its clones accumulated in their spare slots on other ranks.
  virtual void reduce_clone_grads(const PlanView& plan, const PlannerConfig& cfg,
                                  const SymmetricBuffer& grads, int64_t slot_elems, DType dtype,
                                  Stream s) = 0;
};

// R ranks as threads of one process. Each thread drives one rank through communicator(r); ops
// meet at barriers as device collectives would.
class InProcessWorld {
 public:
  explicit InProcessWorld(int ranks);
  ~InProcessWorld();
  InProcessWorld(const InProcessWorld&) = delete;
  InProcessWorld& operator=(const InProcessWorld&) = delete;

  int size() const;
  Communicator& communicator(int rank);
  // Runs fn(rank) on one thread per rank and joins them. If a rank throws, the world is aborted
  // (every rank waiting at a barrier throws too) and the first exception is rethrown here.
  void run(const std::function<void(int rank)>& fn);

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace moe_echo
