// The step schedule: the one place where a layer's modes are decided.
//
// build_schedule() turns a layer's modes (Modes: spill rounds, chunks, shared experts and their
// stream, recompute, overlap, precision and its FP8 GEMMs, ECHO's slots) and one call's flags
// (Flags: forward or backward, whole or split, what this call pulls, zeroes, writes or adds) into
// a flat list of ops. Each op says what runs over which window (a round, or a chunk of round 0),
// on which buffers, with which arguments; fork/end_fork put ops on the backend's side stream,
// join waits for them, if_round/end_if make a spill round's ops device-conditional, and the
// phase bounds say where each split-phase call (dispatch, experts, combine) begins and ends.
// The layer runs a slice of the list op by op (LayerCore::run); no op asks which mode is on.
//
// The list is plain data: to_string() prints it (moe-echo schedule, describe_step), and golden
// tests pin the listings of representative configs (tests/cpu/schedule_test.cpp).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "moe_echo/config.hpp"

namespace moe_echo::step {

// The buffers an op reads or writes: the call's tensors (x, y, dy, dx; dw1 and dw2 are the
// expert gradients the call writes, the layer's or backward_into's) and the current
// micro-batch's buffers (x_packed: x's rows quantized and packed for the FP8 dispatch; recv_xq:
// the received e4m3 rows with their scales).
enum class Buf : uint8_t {
  none,
  x,
  y,
  dy,
  dx,
  x_packed,
  recv_x,
  recv_xq,
  recv_red,
  recv_out,
  h,
  a,
  da,
  dh,
  dw1,
  dw2,
};
const char* to_string(Buf b);

enum class Op : uint8_t {
  // Structure.
  fork,      // the ops up to the matching end_fork run on the side stream (Backend::fork_side)
  end_fork,  //
  join,      // the step's stream waits for the side stream's ops (Backend::join_side)
  if_round,  // the ops up to the matching end_if run when round win.round is active (run_if)
  end_if,    //
  mark,      // nothing but its phase mark (PhaseObserver)
  // Routing, ECHO and the step's bookkeeping.
  router,              // router forward: logits, scores, top-k, losses
  count_gather,        // every rank's expert counts (the routing map)
  plan,                // ECHO's plan from the routing map
  plan_placed,         // a plan over the step's kept placement (EchoPlacement::step)
  keep_placement,      // this plan becomes the step's placement (EchoPlacement::step)
  layout,              // destinations, group offsets, rank rows, active rounds
  chunk_plan,          // round 0's chunk bounds and per-chunk group offsets
  pull_clones,         // clone weights into the echo slots
  quantize_weights,    // e4m3 copies of the home (`home`) and echo slots' (`spare`) weights
  zero_clone_grads,    // the echo slots' gradients zeroed
  zero_home_grads,     // dw1 and dw2 zeroed
  router_backward,     // the router's backward into dx (adds) and its weight gradient
  reduce_clone_grads,  // the echo slots' gradients added into their home experts' (dw1, dw2)
  bias_update,         // aux-loss-free bias update
  shared_forward,      // the shared experts: y written
  shared_backward,     // the shared experts: dx written, weight gradients written or added
  // Rows.
  zero_y,       // y zeroed (spill rounds add into it)
  quantize_x,   // x's rows quantized and packed (x_packed)
  dispatch,     // a's rows to their lead receive rows (c) of the window
  fan_out,      // the lead rows copied to their members (recv_x, in place)
  fan_out_fp8,  // the packed e4m3 rows landed in recv_red fanned out into recv_xq
  scatter,      // w dy to every member (recv_red -> recv_out) and the combine-weight gradients
  fan_in,       // members summed into their lead rows (a -> c; `weighted`: times their weights)
  combine,      // the window's rows back into c (y or dx; dx with the combine-weight gradients)
  // Expert work over the window.
  gemm,             // c = a @ w (fprop) or a @ w^T (dgrad) of fc1 or fc2
  wgrad,            // c (dw1 or dw2) = a^T b, home slots written or added, clone slots too
  swiglu,           // a = SwiGLU(h) (`quantize_out`: its e4m3 rows for fc2 too)
  swiglu_backward,  // dh from h, a, da
  dequantize_x,     // recv_xq's e4m3 rows as activations in recv_red (for a bf16 wgrad of fc1)
};
const char* to_string(Op op);

enum class Pass : uint8_t { fprop, dgrad };

// How a GEMM gets its operands (the layer's precision, decided by the builder).
enum class Form : uint8_t {
  plain,       // the activation dtype
  quantize,    // fp8: a's rows (gemm) or both operands' columns (wgrad) quantized first
  quantized,   // fp8 gemm: a's rows are in the row operand already (SwiGLU wrote them)
  received,    // fp8 gemm: a is recv_xq, the received e4m3 rows with their scales
  with_cols,   // fp8 dgrad: a's rows and its columns for the next wgrad quantized in one pass
  cols_ready,  // fp8 wgrad: b's columns were quantized by the dgrad before (with_cols)
};
const char* to_string(Form f);

// What a combine does with what its destination holds.
enum class Acc : uint8_t {
  write,  // writes
  add,    // adds (the shared experts wrote it first)
  spill,  // adds when some spill round ran (it wrote or zeroed it), else writes
  round,  // adds when round win.round is active (a spill round of the backward)
};

// Round `round`'s window of receive rows, or one chunk of it (chunk >= 0; round 0 only).
struct Window {
  int round = 0;
  int chunk = -1;
};

struct StepOp {
  Op op = Op::mark;
  Window win;
  int fc = 0;  // gemm, wgrad: 1 or 2; quantize_weights: bits 1 (w1) and 2 (w2)
  Pass pass = Pass::fprop;
  Form form = Form::plain;
  Buf a = Buf::none, b = Buf::none, c = Buf::none;
  Acc acc = Acc::write;
  bool home = false, spare = false;  // quantize_weights
  bool overwrite = false;            // wgrad, shared_backward: write instead of add
  // wgrad writing: clone slots with no rows are zeroed too, not only home slots
  // (EchoPlacement::step: the step's clone may get rows in a later backward).
  bool zero_clone_slots = false;
  bool weighted = false;       // fan_in
  bool quantize_out = false;   // swiglu
  bool step_plan = false;      // reduce_clone_grads: the step's placement's clones
  const char* mark = nullptr;  // marked on the op's stream before it runs
  int end = -1;                // fork, if_round: the index of the matching end op
};

// A layer's modes (fixed when it is built).
struct Modes {
  int rounds = 1;  // round 0 and the spill rounds the capacity may need
  int chunks = 1;
  bool shared = false, shared_side = false;
  Recompute recompute = Recompute::none;
  bool overlap_wgrad = false;
  bool spare_slots = false;  // ECHO has echo slots (clones may be pulled)
  bool own_slots = false;    // EchoPlacement::step: the layer keeps its placement and slots
  bool fp8 = false;          // Precision::fp8
  uint32_t fp8_gemms = 0;    // with fp8: the fp8_gemm bits
  bool bias_update = false;
  bool uses(uint32_t gemm) const { return fp8 && (fp8_gemms & gemm) != 0; }
};
Modes modes_of(const MoeConfig& moe, const ParallelConfig& par, const EchoConfig& echo);
// Whether a backward that writes the expert gradients writes each one with one bf16 GEMM that
// nothing adds to afterwards (no spill round, no chunks, no echo slots whose gradients are added
// home, no FP8): then they may be rounded to the activation dtype by that GEMM itself.
bool one_gemm_expert_grads(const Modes& m);

// One call's flags (from the layer's state when the call begins; the graph key holds them).
struct Flags {
  bool backward = false;
  bool split = false;  // the split-phase calls: three phases
  // Forward.
  bool place = true;           // plan (and pull) a placement; false: split over the kept one
  bool quantize_home = false;  // fp8: the home weights' e4m3 copies made again
  // Backward.
  bool repull = false;           // the clones pulled again (another user took the echo slots)
  bool overwrite_grads = false;  // the expert gradients written, not added
  bool overwrite_shared = false;
  bool zero_home = false, zero_clones = false, reduce_clones = true;
  uint64_t bits() const;  // all of them, for a graph key
};

struct Schedule {
  std::vector<StepOp> ops;
  // Phase k of a split call runs ops [phase[k], phase[k + 1]); a whole call runs them all.
  std::array<size_t, 4> phase{};
  // Why a mode asked for was not used for this call, or empty (printed with the listing).
  std::string note;
};

Schedule build_schedule(const Modes& modes, const Flags& flags);
// The listing: a header line, then one op a line, indented inside fork and if blocks, with the
// split phases named.
std::string to_string(const Schedule& s, const Flags& flags);

}  // namespace moe_echo::step
