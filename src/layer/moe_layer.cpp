// The step orchestration of docs/design.md section 2, written once over Backend and Communicator.
//
// Rows: a token's row crosses to each rank it picks experts on once per round (dispatch into the
// lead row), the receiver fans it out to the other members' rows, runs the experts, and sums the
// members' weighted outputs into the lead row (fan_in); the source sums one row per rank (combine).
// The backward sends dy the same way; the receiver's fan_out weights it per member and computes
// the combine-weight gradient there (it holds the expert outputs), fan_in sums the members' dx
// rows, and the combine brings back one dx row per rank and every entry's weight gradient.
//
// Rounds: receive buffers hold `capacity` rows. Round r handles receive rows
// [r * capacity, (r + 1) * capacity) of every rank; round 0 always runs, a spill round only when
// some rank received more rows than the rounds before it hold (decided from the routing map,
// which every rank shares, so all ranks take the same branch). The forward runs the spill rounds
// first and round 0 last, so round 0's activations stay in the workspace for the backward; the
// backward runs round 0 on them and recomputes each spill round's activations. Memory is bounded
// by the capacity whatever the routing, and no row is ever dropped.
//
// Shared experts: one dense SwiGLU over all T tokens (a single group of the expert GEMMs). The
// forward runs it first and writes y, so every routed round adds to y; the backward runs it first
// and writes dx, so every routed round adds to dx too. Their weights are replicated on the ranks.
#include "moe_echo/layer.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>

#include "core/random.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"

namespace moe_echo {

const char* to_string(Param p) {
  switch (p) {
    case Param::router_weight: return "router_weight";
    case Param::router_bias: return "router_bias";
    case Param::w1: return "w1";
    case Param::w2: return "w2";
    case Param::shared_w1: return "shared_w1";
    case Param::shared_w2: return "shared_w2";
  }
  return "?";
}

// A micro-batch's part of a layer's buffers (MoeConfig::in_flight): its routing, plan and layout,
// the activations the layer keeps for its backward, the temporaries between its phases, and its
// views of the workspace's buffers (set m % 2 for micro-batch m). The rest (parameters,
// gradients, optimizer state, the home weights' e4m3 copies) the micro-batches share.
struct StepPart {
  // Routing.
  Tensor logits, scores, topk_idx, topk_weight, counts, losses;
  Tensor routing_map, plan, assign, dest_rank, dest_row, group_offsets, rank_rows, round_active;
  // MoeConfig::chunks > 1: round 0's chunks (ChunkPlanArgs: bounds [R, chunks + 1] of every
  // rank, this rank's group offsets per chunk [chunks, slots + 1]).
  Tensor chunk_bounds, chunk_offsets;
  // The spare slots (this step's clones, not parameters) are views of the workspace's echo
  // slots, their gradients symmetric there too (their home ranks reduce them).
  SymmetricBuffer dw1_spare_sym, dw2_spare_sym;
  Tensor w1_spare, w2_spare, dw1_spare, dw2_spare;  // [S, ...] (empty without spare slots)
  // Receive windows and expert activations (capacity rows): the layer's own where it keeps them
  // for its backward (MoeConfig::recompute), the workspace's otherwise.
  // recv_x: token rows in (forward and recompute). recv_red: the rows the source reads back
  // (forward: weighted output sums; backward: dy rows in, then dx sums out). recv_out: expert
  // output rows, then their gradients, then dx rows.
  SymmetricBuffer recv_x_sym, recv_red_sym;
  FanTable fan;
  Tensor recv_x, recv_red, recv_out, h, a, da, dh;
  Tensor fan_members, fan_weights, fan_values;
  // Source side.
  Tensor d_topk_weight;
  // Shared experts (empty without): the group offsets {0, T} of their one group; activations of
  // up to T tokens; and a device flag holding 1 (the routed rounds then add to y and dx).
  Tensor shared_offsets, shared_h, shared_a, shared_da, shared_dh, one;
  // Precision fp8 (empty otherwise): the echo slots' e4m3 copies of the weights (the home
  // slots' are in Buffers); the rows of one GEMM's activation operand (row_q [cap, max(2F, H)],
  // row_s), and wgrad's two transposed column operands (col_a, col_b [max(H, 2F), P], their
  // scales and padded offsets).
  struct Fp8Weight {
    Tensor q, q_t, s, s_t;
  };
  Fp8Weight w1_spare_q, w2_spare_q;
  Tensor row_q, row_s, col_a, col_as, col_b, col_bs, col_po, col_po2;
  // Precision fp8's dispatch: x's rows quantized and packed (x_send [T, fp8_packed_row_bytes(H)],
  // the workspace's), landing in recv_red's bytes, fanned out into recv_x's bytes as e4m3 rows
  // recv_xq [cap, H] and their scales recv_xs [cap, ceil(H / 128)].
  Tensor x_send, recv_xq, recv_xs;
};

// The buffers in use are the StepPart of the current micro-batch (MoeLayer::select_micro_batch
// copies micro_batches[m] in).
struct MoeLayer::Buffers : StepPart {
  // Parameters and gradients of the home experts. w1 and w2 are symmetric (peers pull clones of
  // them).
  Tensor router_weight, router_bias, d_router_weight;
  SymmetricBuffer w1_sym, w2_sym;
  Tensor w1, w2, dw1, dw2;  // [E/R, ...]
  // Optimizer state (float dtype), for router weight, w1 home, w2 home; float masters of w1, w2
  // and the shared experts (MoeConfig::master_weights).
  Tensor m_router, v_router, m_w1, v_w1, m_w2, v_w2;
  Tensor master_w1, master_w2, master_sw1, master_sw2;
  Tensor optimizer_step;  // [1] i32: steps taken, advanced on the device
  // Shared experts (empty without): weights [1, H, 2S] and [1, S, H], their gradients and AdamW
  // state.
  Tensor shared_w1, shared_w2, d_shared_w1, d_shared_w2, m_sw1, v_sw1, m_sw2, v_sw2;
  // Precision fp8: each home expert weight's e4m3 copies for fprop (q_t, scale_t) and dgrad
  // (q, scale).
  Fp8Weight w1_q, w2_q;
  // EchoPlacement::step: the plan of the step's first forward, which made its placement (its
  // spare_expert; its replicas name every clone slot the step's backwards may leave gradients
  // in, which the reduction reads); the echo slots are then the layer's own (StepPart's spare
  // tensors, the same in every micro-batch).
  Tensor step_plan;

  std::vector<StepPart> micro_batches;  // [MoeConfig::in_flight]
  std::vector<void*> owned;
  std::vector<SymmetricBuffer*> symmetric;
  size_t bytes = 0;
};

namespace {

// The fan ops of a round (`f`: MoeLayer::fan_args), over the whole window or one chunk's rows
// (FanArgs::chunk, nullptr: all): the forward's fan-out copies the token rows to their members in
// recv_x (unweighted, in place); its fan-in sums the members' weighted outputs into their lead
// rows of recv_red; the backward's scatter writes w dy to every member of recv_out and the
// combine-weight gradients <dy, out> into the fan values.
FanArgs expand_args(FanArgs f, const StepPart& b, const int32_t* chunk) {
  f.weights = Tensor();
  f.src = b.recv_x;
  f.dst = b.recv_x;
  f.chunk = chunk;
  return f;
}
FanArgs sum_args(FanArgs f, const StepPart& b, const int32_t* chunk) {
  f.src = b.recv_out;
  f.dst = b.recv_red;
  f.chunk = chunk;
  return f;
}
FanArgs scatter_args(FanArgs f, const StepPart& b, const int32_t* chunk) {
  f.src = b.recv_red;
  f.dst = b.recv_out;
  f.other = b.recv_out;
  f.d_weight = b.fan_values;
  f.chunk = chunk;
  return f;
}

// Whether a layer with `spare_slots` echo slots keeps them itself (EchoPlacement::step) rather
// than in the workspace's pool.
bool own_echo_slots(const EchoConfig& e, int spare_slots) {
  return e.placement == EchoPlacement::step && spare_slots > 0;
}

// Round 0's expert activations, and whether a layer keeps each for its backward (its own buffer)
// or leaves it to the workspace (recomputed in the backward).
enum class Act { recv_x, h, a, recv_out };
bool keeps(Recompute r, Act act) {
  switch (act) {
    case Act::recv_x: return r != Recompute::dispatch;
    case Act::h: return r == Recompute::none || r == Recompute::moe_act;
    case Act::a: return r == Recompute::none;
    case Act::recv_out: return r == Recompute::none || r == Recompute::moe_act;
  }
  return true;
}

// Shapes of one layer's activation buffers (capacity rows).
struct ActShapes {
  int64_t cap, H, F, K, S;  // S: spare slots
  ActShapes(const MoeConfig& m, const ParallelConfig& p, const EchoConfig& e)
      : cap(capacity_rows(m)),
        H(m.hidden),
        F(m.ffn),
        K(m.top_k),
        S(planner_config(m, p, e).spare_slots) {}
  int64_t cols(Act act) const {
    switch (act) {
      case Act::recv_x: return H;
      case Act::h: return 2 * F;
      case Act::a: return F;
      case Act::recv_out: return H;
    }
    return 0;
  }
};

// Which FP8 parts a layer needs (MoeConfig::fp8_gemms): the FP8 dispatch (fc1's forward in
// FP8), row operands quantized before a GEMM (fc2's forward, the dgrads), wgrad's transposed
// column operands, and e4m3 copies of w1 (fc1's forward or dgrad) and of w2.
bool fp8_dispatch(const MoeConfig& m) { return uses_fp8(m, fp8_gemm::fprop1); }
bool fp8_rows(const MoeConfig& m) {
  return uses_fp8(m, fp8_gemm::fprop2 | fp8_gemm::dgrad1 | fp8_gemm::dgrad2);
}
bool fp8_cols(const MoeConfig& m) { return uses_fp8(m, fp8_gemm::wgrad1 | fp8_gemm::wgrad2); }
bool fp8_w1(const MoeConfig& m) { return uses_fp8(m, fp8_gemm::fprop1 | fp8_gemm::dgrad1); }
bool fp8_w2(const MoeConfig& m) { return uses_fp8(m, fp8_gemm::fprop2 | fp8_gemm::dgrad2); }
bool fp8_weights(const MoeConfig& m) { return fp8_w1(m) || fp8_w2(m); }

// Shapes of precision fp8's quantized GEMM operands (one GEMM at a time, in the workspace): the
// rows of an activation operand [cap, W] with scales [cap, WT], and wgrad's two transposed
// operands [W, P] with their scales and padded offsets [G + 1].
struct Fp8Shapes {
  int64_t W, WT, P, G;
  // The bytes of one received row in fp8 (recv_xq's row and recv_xs's), and of a packed one.
  static int64_t recv_row_bytes(int64_t H) { return H + fp8_tiles(H) * 4; }
  Fp8Shapes(const ActShapes& s, int slots)
      : W(std::max(s.H, 2 * s.F)), WT(fp8_tiles(W)), P(fp8_padded_rows(s.cap, slots)), G(slots) {}
};

// A device tensor `dev`, a symmetric one `sym` (or both only count bytes, for memory_bytes).
// `part` names the part of MoeMemory the buffers declared next belong to (only counted).
struct Allocator {
  std::function<Tensor(DType, std::initializer_list<int64_t>)> dev;
  std::function<Tensor(SymmetricBuffer&, DType, std::initializer_list<int64_t>)> sym;
  std::function<void(size_t MoeMemory::*)> part = [](size_t MoeMemory::*) {};
};

}  // namespace

// Byte buffers; each layer views them with its own shapes.
struct MoeWorkspace::Buffers {
  struct Bytes {
    size_t bytes = 0;
    void* local = nullptr;
    SymmetricBuffer sym;  // symmetric ones
  };
  Bytes recv_x, recv_red, fan_members, fan_weights, fan_values;  // symmetric
  Bytes recv_out, h, a, da, dh;
  Bytes w1_spare, w2_spare;    // echo slots' weights
  Bytes dw1_spare, dw2_spare;  // echo slots' gradients (symmetric)
  // Precision fp8: the quantized operands of one GEMM (MoeLayer::Buffers has their shapes).
  Bytes fp8_row_q, fp8_row_s, fp8_col_a, fp8_col_as, fp8_col_b, fp8_col_bs, fp8_po, fp8_po2;
  Bytes fp8_x_send;  // x's packed rows (the FP8 dispatch's source)
  // The echo slots' e4m3 copies of w1 and w2, shared like the slots (made after each pull): the
  // bytes of a Fp8Weight of `slabs` [K, N] slabs.
  struct Fp8WeightBytes {
    Bytes q, q_t, s, s_t;
    void grow(int64_t slabs, int64_t K, int64_t N) {
      const auto at_least = [](Bytes& b, size_t n) { b.bytes = std::max(b.bytes, n); };
      at_least(q, size_t(slabs * K * N));
      at_least(q_t, size_t(slabs * K * N));
      at_least(s, size_t(slabs * fp8_tiles(K) * fp8_tiles(N)) * sizeof(float));
      at_least(s_t, size_t(slabs * fp8_tiles(K) * fp8_tiles(N)) * sizeof(float));
    }
    size_t bytes() const { return q.bytes + q_t.bytes + s.bytes + s_t.bytes; }
  };
  Fp8WeightBytes fp8_w1s, fp8_w2s;
  std::vector<void*> owned;
  std::vector<SymmetricBuffer*> symmetric;
  size_t bytes = 0;

  // Every buffer with the bytes the largest layer needs; `each(bytes, symmetric)` in a fixed order.
  void size_for(const std::vector<MoeConfig>& layers, const ParallelConfig& par,
                const EchoConfig& echo, DType act, DType fl) {
    const size_t as = dtype_size(act), fs = dtype_size(fl);
    auto grow = [](Bytes& b, int64_t n, size_t elem) {
      b.bytes = std::max(b.bytes, size_t(n) * elem);
    };
    for (const MoeConfig& m : layers) {
      const ActShapes s(m, par, echo);
      const Recompute r = m.recompute;
      if (!keeps(r, Act::recv_x)) {
        if (fp8_dispatch(m))
          grow(recv_x, s.cap * Fp8Shapes::recv_row_bytes(s.H), 1);
        else
          grow(recv_x, s.cap * s.H, as);
      }
      if (!keeps(r, Act::h)) grow(h, s.cap * 2 * s.F, as);
      if (!keeps(r, Act::a)) grow(a, s.cap * s.F, as);
      if (!keeps(r, Act::recv_out)) grow(recv_out, s.cap * s.H, as);
      grow(recv_red, s.cap * s.H, as);
      grow(fan_members, s.cap * s.K, sizeof(int32_t));
      grow(fan_weights, s.cap * s.K, fs);
      grow(fan_values, s.cap, fs);
      grow(da, s.cap * s.F, as);
      grow(dh, s.cap * 2 * s.F, as);
      const bool pool = !own_echo_slots(echo, s.S);  // else the layers' own
      if (pool) {
        grow(w1_spare, s.S * s.H * 2 * s.F, as);
        grow(w2_spare, s.S * s.F * s.H, as);
        grow(dw1_spare, s.S * s.H * 2 * s.F, fs);
        grow(dw2_spare, s.S * s.F * s.H, fs);
      }
      if (m.precision == Precision::fp8) {
        const Fp8Shapes f(s, slots_per_rank(m, par, echo));
        if (fp8_rows(m)) {
          grow(fp8_row_q, s.cap * f.W, 1);
          grow(fp8_row_s, s.cap * f.WT, sizeof(float));
        }
        if (fp8_cols(m)) {
          grow(fp8_col_a, f.W * f.P, 1);
          grow(fp8_col_as, f.W * f.P / kFp8Tile, sizeof(float));
          grow(fp8_col_b, f.W * f.P, 1);
          grow(fp8_col_bs, f.W * f.P / kFp8Tile, sizeof(float));
          grow(fp8_po, f.G + 1, sizeof(int32_t));
          grow(fp8_po2, f.G + 1, sizeof(int32_t));
        }
        if (fp8_dispatch(m)) grow(fp8_x_send, m.max_tokens * fp8_packed_row_bytes(s.H), 1);
        if (fp8_w1(m) && pool) fp8_w1s.grow(s.S, s.H, 2 * s.F);
        if (fp8_w2(m) && pool) fp8_w2s.grow(s.S, s.F, s.H);
      }
    }
  }
  // The bytes by part: the echo slots apart from the rest.
  MoeMemory memory() {
    MoeMemory m;
    each([&](Bytes& x, bool) { m.workspace += x.bytes; });
    m.echo_slot_weights = w1_spare.bytes + w2_spare.bytes;
    m.echo_slot_grads = dw1_spare.bytes + dw2_spare.bytes;
    m.fp8 = fp8_row_q.bytes + fp8_row_s.bytes + fp8_col_a.bytes + fp8_col_as.bytes +
            fp8_col_b.bytes + fp8_col_bs.bytes + fp8_po.bytes + fp8_po2.bytes + fp8_x_send.bytes +
            fp8_w1s.bytes() + fp8_w2s.bytes();
    m.workspace -= m.echo_slot_weights + m.echo_slot_grads + m.fp8;
    return m;
  }
  template <class F>
  void each(F&& f) {
    f(recv_x, true), f(recv_red, true), f(fan_members, true), f(fan_weights, true);
    f(fan_values, true), f(recv_out, false), f(h, false), f(a, false), f(da, false);
    f(dh, false), f(w1_spare, false), f(w2_spare, false), f(dw1_spare, true);
    f(dw2_spare, true), f(fp8_row_q, false), f(fp8_row_s, false), f(fp8_col_a, false);
    f(fp8_col_as, false), f(fp8_col_b, false), f(fp8_col_bs, false), f(fp8_po, false);
    f(fp8_po2, false), f(fp8_x_send, false);
    for (Fp8WeightBytes* w : {&fp8_w1s, &fp8_w2s})
      f(w->q, false), f(w->q_t, false), f(w->s, false), f(w->s_t, false);
  }
};

int MoeWorkspace::sets_for(const std::vector<MoeConfig>& layers) {
  int sets = 1;
  for (const MoeConfig& m : layers) sets = std::max(sets, std::min(m.in_flight, 2));
  return sets;
}

MoeWorkspace::MoeWorkspace(Backend& backend, Communicator& comm,
                           const std::vector<MoeConfig>& layers, const ParallelConfig& par,
                           const EchoConfig& echo)
    : backend_(backend), comm_(comm), par_(par), echo_(echo) {
  MOE_ECHO_CHECK(!layers.empty(), "a workspace for no layers: allowed one layer or more");
  for (const MoeConfig& m : layers) validate(m, par, echo);
  sets_.resize(size_t(sets_for(layers)));
  for (Set& set : sets_) {
    set.buf = std::make_unique<Buffers>();
    Buffers& b = *set.buf;
    b.size_for(layers, par, echo, backend.activation_dtype(), backend.float_dtype());
    b.each([&](Buffers::Bytes& x, bool symmetric) {
      if (x.bytes == 0) return;
      if (symmetric) {
        x.sym = comm.alloc_symmetric(backend, x.bytes);
        b.symmetric.push_back(&x.sym);
        x.local = x.sym.local;
      } else {
        x.local = backend.allocate(x.bytes);
        b.owned.push_back(x.local);
      }
      b.bytes += x.bytes;
    });
  }
  backend.synchronize();
  comm.barrier();
}

namespace {
// Frees what a layer or workspace allocated: the symmetric buffers collectively (locally when a
// peer that failed cannot take part in the collective free), then the owned ones.
void release(Backend& backend, Communicator& comm, const std::vector<SymmetricBuffer*>& symmetric,
             const std::vector<void*>& owned) {
  try {
    backend.synchronize();
    for (SymmetricBuffer* s : symmetric) comm.free_symmetric(backend, *s);
  } catch (...) {
    for (SymmetricBuffer* s : symmetric)
      if (s->local) backend.deallocate(s->local);
  }
  for (void* p : owned) backend.deallocate(p);
}
}  // namespace

MoeWorkspace::~MoeWorkspace() {
  for (Set& set : sets_)
    if (set.buf) release(backend_, comm_, set.buf->symmetric, set.buf->owned);
}

size_t MoeWorkspace::bytes() const {
  size_t total = 0;
  for (const Set& set : sets_) total += set.buf->bytes;
  return total;
}

size_t MoeWorkspace::memory_bytes(const std::vector<MoeConfig>& layers, const ParallelConfig& par,
                                  const EchoConfig& echo, DType activation, DType float_dtype) {
  return memory_breakdown(layers, par, echo, activation, float_dtype).total();
}

MoeMemory MoeWorkspace::memory_breakdown(const std::vector<MoeConfig>& layers,
                                         const ParallelConfig& par, const EchoConfig& echo,
                                         DType activation, DType float_dtype) {
  for (const MoeConfig& m : layers) validate(m, par, echo);
  Buffers b;
  b.size_for(layers, par, echo, activation, float_dtype);
  MoeMemory one = b.memory(), all;
  for (int i = 0; i < sets_for(layers); ++i) all += one;
  return all;
}

MoeMemory& MoeMemory::operator+=(const MoeMemory& o) {
  params += o.params;
  grads += o.grads;
  optimizer += o.optimizer;
  routing += o.routing;
  activations += o.activations;
  temporaries += o.temporaries;
  workspace += o.workspace;
  echo_slot_weights += o.echo_slot_weights;
  echo_slot_grads += o.echo_slot_grads;
  fp8 += o.fp8;
  return *this;
}

// The parts of a layer's buffers each micro-batch in flight has its own of (MoeConfig::in_flight);
// the others (parameters, gradients, optimizer state, fp8 weight copies) the micro-batches share.
namespace {
bool per_micro_batch(size_t MoeMemory::*part) {
  return part == &MoeMemory::routing || part == &MoeMemory::activations ||
         part == &MoeMemory::temporaries;
}
}  // namespace

// Every buffer a layer owns, in one place (the workspace's are views, bound in the constructor).
struct BufferShapes {
  const MoeConfig& moe;
  const ParallelConfig& par;
  const PlannerConfig& planner;
  int slots;
  int64_t capacity;
  int rounds;
  DType act, fl;
  bool optimizer_state;
  bool own_slots;  // EchoPlacement::step with spare slots: the layer's own echo slots
};

void declare_buffers(MoeLayer::Buffers& b, const BufferShapes& s, const Allocator& alloc) {
  const auto& dev = alloc.dev;
  const auto& sym = alloc.sym;
  const DType act = s.act, fl = s.fl;
  const int64_t T = s.moe.max_tokens, H = s.moe.hidden, F = s.moe.ffn, E = s.moe.experts,
                K = s.moe.top_k;
  const int64_t R = s.par.ep_size, EPR = E / R, G = s.slots, cap = s.capacity;
  const bool optimizer_state = s.optimizer_state;
  const PlannerConfig& planner_ = s.planner;
  const int rounds_ = s.rounds;
  alloc.part(&MoeMemory::params);
  b.router_weight = dev(fl, {E, H});
  b.router_bias = dev(fl, {E});
  alloc.part(&MoeMemory::grads);
  b.d_router_weight = dev(fl, {E, H});
  alloc.part(&MoeMemory::params);
  b.w1 = sym(b.w1_sym, act, {EPR, H, 2 * F});
  b.w2 = sym(b.w2_sym, act, {EPR, F, H});
  alloc.part(&MoeMemory::grads);
  b.dw1 = dev(fl, {EPR, H, 2 * F});  // gradients accumulate in the float dtype
  b.dw2 = dev(fl, {EPR, F, H});
  const int64_t SP = planner_.spare_slots;
  if (s.own_slots) {  // EchoPlacement::step: the layer's own echo slots and placement
    alloc.part(&MoeMemory::echo_slot_weights);
    b.w1_spare = dev(act, {SP, H, 2 * F});
    b.w2_spare = dev(act, {SP, F, H});
    b.step_plan = dev(DType::i32, {plan_ints(planner_)});
    alloc.part(&MoeMemory::echo_slot_grads);
    b.dw1_spare = sym(b.dw1_spare_sym, fl, {SP, H, 2 * F});
    b.dw2_spare = sym(b.dw2_spare_sym, fl, {SP, F, H});
  }
  alloc.part(&MoeMemory::optimizer);
  if (optimizer_state) {
    b.m_router = dev(fl, {E, H});
    b.v_router = dev(fl, {E, H});
    b.m_w1 = dev(fl, {EPR, H, 2 * F});
    b.v_w1 = dev(fl, {EPR, H, 2 * F});
    b.m_w2 = dev(fl, {EPR, F, H});
    b.v_w2 = dev(fl, {EPR, F, H});
    b.optimizer_step = dev(DType::i32, {1});
    if (s.moe.master_weights) {
      b.master_w1 = dev(fl, {EPR, H, 2 * F});
      b.master_w2 = dev(fl, {EPR, F, H});
    }
  }

  alloc.part(&MoeMemory::routing);
  b.logits = dev(fl, {T, E});
  b.scores = dev(fl, {T, E});
  b.topk_idx = dev(DType::i32, {T, K});
  b.topk_weight = dev(fl, {T, K});
  b.counts = dev(DType::i32, {E});
  b.losses = dev(fl, {3});
  b.routing_map = dev(DType::i32, {R, E});
  b.plan = dev(DType::i32, {plan_ints(planner_)});
  b.assign = dev(DType::i32, {R * E * planner_.max_replicas()});
  b.dest_rank = dev(DType::i32, {T * K});
  b.dest_row = dev(DType::i32, {T * K});
  b.group_offsets = dev(DType::i32, {G + 1});
  b.rank_rows = dev(DType::i32, {R});
  b.round_active = dev(DType::i32, {rounds_});
  if (s.moe.chunks > 1) {
    b.chunk_bounds = dev(DType::i32, {R, s.moe.chunks + 1});
    b.chunk_offsets = dev(DType::i32, {s.moe.chunks, G + 1});
  }

  // Round 0's activations that this layer keeps for its backward.
  const Recompute r = s.moe.recompute;
  alloc.part(&MoeMemory::activations);
  if (keeps(r, Act::recv_x)) {
    if (fp8_dispatch(s.moe))  // e4m3 rows and scales (bind_workspace views them)
      b.recv_x = dev(DType::e4m3, {cap, Fp8Shapes::recv_row_bytes(H)});
    else
      b.recv_x = sym(b.recv_x_sym, act, {cap, H});
  }
  if (keeps(r, Act::h)) b.h = dev(act, {cap, 2 * F});
  if (keeps(r, Act::a)) b.a = dev(act, {cap, F});
  if (keeps(r, Act::recv_out)) b.recv_out = dev(act, {cap, H});
  alloc.part(&MoeMemory::temporaries);
  b.d_topk_weight = dev(fl, {T, K});

  const int64_t S = shared_width(s.moe);
  if (S > 0) {
    alloc.part(&MoeMemory::params);
    b.shared_w1 = dev(act, {1, H, 2 * S});
    b.shared_w2 = dev(act, {1, S, H});
    alloc.part(&MoeMemory::grads);
    b.d_shared_w1 = dev(fl, {1, H, 2 * S});
    b.d_shared_w2 = dev(fl, {1, S, H});
    alloc.part(&MoeMemory::optimizer);
    if (optimizer_state) {
      b.m_sw1 = dev(fl, {1, H, 2 * S});
      b.v_sw1 = dev(fl, {1, H, 2 * S});
      b.m_sw2 = dev(fl, {1, S, H});
      b.v_sw2 = dev(fl, {1, S, H});
      if (s.moe.master_weights) {
        b.master_sw1 = dev(fl, {1, H, 2 * S});
        b.master_sw2 = dev(fl, {1, S, H});
      }
    }
    alloc.part(&MoeMemory::routing);
    b.shared_offsets = dev(DType::i32, {2});
    alloc.part(&MoeMemory::activations);
    b.shared_h = dev(act, {T, 2 * S});
    b.shared_a = dev(act, {T, S});
    alloc.part(&MoeMemory::temporaries);
    b.shared_da = dev(act, {T, S});
    b.shared_dh = dev(act, {T, 2 * S});
    b.one = dev(DType::i32, {1});
  }

  if (s.moe.precision == Precision::fp8) {
    alloc.part(&MoeMemory::fp8);
    auto weight = [&](int64_t slabs, int64_t k, int64_t n) {
      StepPart::Fp8Weight w;
      if (slabs == 0) return w;
      w.q = dev(DType::e4m3, {slabs, k, n});
      w.q_t = dev(DType::e4m3, {slabs, n, k});
      w.s = dev(DType::f32, {slabs, fp8_tiles(k), fp8_tiles(n)});
      w.s_t = dev(DType::f32, {slabs, fp8_tiles(n), fp8_tiles(k)});
      return w;
    };
    // The echo slots' copies are the workspace's (the layer's own with its own slots).
    if (fp8_w1(s.moe)) b.w1_q = weight(EPR, H, 2 * F);
    if (fp8_w2(s.moe)) b.w2_q = weight(EPR, F, H);
    if (s.own_slots && fp8_w1(s.moe)) b.w1_spare_q = weight(SP, H, 2 * F);
    if (s.own_slots && fp8_w2(s.moe)) b.w2_spare_q = weight(SP, F, H);
  }
}

namespace {

// The workspace's buffers as this layer's tensors (those the layer does not own).
void bind_workspace(MoeLayer::Buffers& b, MoeWorkspace::Buffers& w, const MoeConfig& moe,
                    const ParallelConfig& par, const EchoConfig& echo, DType act, DType fl) {
  const ActShapes s(moe, par, echo);
  auto view = [](const MoeWorkspace::Buffers::Bytes& x, DType t,
                 std::initializer_list<int64_t> dims) {
    Tensor v(x.local, t, dims);
    MOE_ECHO_CHECK(v.bytes() <= x.bytes, "workspace buffer of " << x.bytes << " bytes for a "
                                                                << v.describe()
                                                                << " of this layer: build the "
                                                                   "workspace for this layer's "
                                                                   "config");
    return v;
  };
  const bool fp8 = fp8_dispatch(moe);
  if (!b.recv_x.data) {
    b.recv_x = fp8 ? view(w.recv_x, DType::e4m3, {s.cap, Fp8Shapes::recv_row_bytes(s.H)})
                   : view(w.recv_x, act, {s.cap, s.H});
    b.recv_x_sym = w.recv_x.sym;
  }
  if (fp8) {
    b.recv_xq = Tensor(b.recv_x.data, DType::e4m3, {s.cap, s.H});
    b.recv_xs = Tensor(static_cast<char*>(b.recv_x.data) + s.cap * s.H, DType::f32,
                       {s.cap, fp8_tiles(s.H)});
    b.x_send = view(w.fp8_x_send, DType::e4m3, {moe.max_tokens, fp8_packed_row_bytes(s.H)});
    // The packed rows land in recv_red's bytes (free between the dispatch and the fan-in).
    view(w.recv_red, DType::e4m3, {s.cap, fp8_packed_row_bytes(s.H)});
  }
  // The echo slots' e4m3 copies: [S, K, N] slabs as Fp8Weight (q, q_t, s, s_t).
  auto weight = [&](const MoeWorkspace::Buffers::Fp8WeightBytes& x, int64_t K, int64_t N) {
    return StepPart::Fp8Weight{view(x.q, DType::e4m3, {s.S, K, N}),
                               view(x.q_t, DType::e4m3, {s.S, N, K}),
                               view(x.s, DType::f32, {s.S, fp8_tiles(K), fp8_tiles(N)}),
                               view(x.s_t, DType::f32, {s.S, fp8_tiles(N), fp8_tiles(K)})};
  };
  const bool pool = s.S > 0 && !own_echo_slots(echo, s.S);  // else the layer's own
  if (pool && fp8_w1(moe)) b.w1_spare_q = weight(w.fp8_w1s, s.H, 2 * s.F);
  if (pool && fp8_w2(moe)) b.w2_spare_q = weight(w.fp8_w2s, s.F, s.H);
  if (!b.h.data) b.h = view(w.h, act, {s.cap, 2 * s.F});
  if (!b.a.data) b.a = view(w.a, act, {s.cap, s.F});
  if (!b.recv_out.data) b.recv_out = view(w.recv_out, act, {s.cap, s.H});
  b.recv_red = view(w.recv_red, act, {s.cap, s.H});
  b.recv_red_sym = w.recv_red.sym;
  b.fan_members = view(w.fan_members, DType::i32, {s.cap, s.K});
  b.fan_weights = view(w.fan_weights, fl, {s.cap, s.K});
  b.fan_values = view(w.fan_values, fl, {s.cap});
  b.fan.members = w.fan_members.sym;
  b.fan.weights = w.fan_weights.sym;
  b.fan.values = w.fan_values.sym;
  b.fan.top_k = int(s.K);
  b.fan.float_dtype = fl;
  b.da = view(w.da, act, {s.cap, s.F});
  b.dh = view(w.dh, act, {s.cap, 2 * s.F});
  const Fp8Shapes f(s, slots_per_rank(moe, par, echo));
  if (fp8_rows(moe)) {
    b.row_q = view(w.fp8_row_q, DType::e4m3, {s.cap, f.W});
    b.row_s = view(w.fp8_row_s, DType::f32, {s.cap, f.WT});
  }
  if (fp8_cols(moe)) {
    b.col_a = view(w.fp8_col_a, DType::e4m3, {f.W, f.P});
    b.col_as = view(w.fp8_col_as, DType::f32, {f.W * f.P / kFp8Tile});
    b.col_b = view(w.fp8_col_b, DType::e4m3, {f.W, f.P});
    b.col_bs = view(w.fp8_col_bs, DType::f32, {f.W * f.P / kFp8Tile});
    b.col_po = view(w.fp8_po, DType::i32, {f.G + 1});
    b.col_po2 = view(w.fp8_po2, DType::i32, {f.G + 1});
  }
  if (pool) {
    b.w1_spare = view(w.w1_spare, act, {s.S, s.H, 2 * s.F});
    b.w2_spare = view(w.w2_spare, act, {s.S, s.F, s.H});
    b.dw1_spare = view(w.dw1_spare, fl, {s.S, s.H, 2 * s.F});
    b.dw2_spare = view(w.dw2_spare, fl, {s.S, s.F, s.H});
    b.dw1_spare_sym = w.dw1_spare.sym;
    b.dw2_spare_sym = w.dw2_spare.sym;
  }
}

Allocator counting_allocator(MoeMemory& memory) {
  auto into = std::make_shared<size_t MoeMemory::*>(&MoeMemory::params);
  auto dev = [&memory, into](DType t, std::initializer_list<int64_t> dims) {
    Tensor view(nullptr, t, dims);
    memory.*(*into) += view.bytes();
    return view;
  };
  return Allocator{dev,
                   [dev](SymmetricBuffer&, DType t, std::initializer_list<int64_t> dims) {
                     return dev(t, dims);
                   },
                   [into](size_t MoeMemory::*part) { *into = part; }};
}

}  // namespace

MoeLayer::MoeLayer(Backend& backend, Communicator& comm, const MoeConfig& moe,
                   const ParallelConfig& par, const EchoConfig& echo, uint64_t seed,
                   bool optimizer_state, MoeWorkspace* workspace)
    : backend_(backend), comm_(comm), moe_(moe), par_(par), echo_(echo) {
  validate(moe_, par_, echo_);
  MOE_ECHO_CHECK(comm.size() == par.ep_size,
                 "communicator has " << comm.size() << " ranks but ep_size = " << par.ep_size);
  MOE_ECHO_CHECK(comm.rank() == par.ep_rank,
                 "communicator rank " << comm.rank() << " but ep_rank = " << par.ep_rank);
  planner_ = moe_echo::planner_config(moe, par, echo);
  validate(planner_);
  slots_ = slots_per_rank(moe, par, echo);
  capacity_ = capacity_rows(moe);
  rounds_ = max_rounds(moe, par, echo);
  own_slots_ = own_echo_slots(echo, planner_.spare_slots);
  if (workspace) {
    MOE_ECHO_CHECK(&workspace->backend() == &backend && &workspace->communicator() == &comm,
                   "workspace built on another backend or communicator than the layer's");
    MOE_ECHO_CHECK(
        workspace->par_.ep_size == par.ep_size && workspace->par_.ep_rank == par.ep_rank &&
            moe_echo::planner_config(moe, par, workspace->echo_).spare_slots ==
                planner_.spare_slots,
        "workspace built for another expert-parallel layout or number of echo slots than the "
        "layer's");
    // Every buffer of the workspace must hold this layer's need, checked before allocating.
    MoeWorkspace::Buffers need;
    need.size_for({moe}, par, echo, backend.activation_dtype(), backend.float_dtype());
    std::vector<size_t> needed, held;
    need.each([&](MoeWorkspace::Buffers::Bytes& x, bool) { needed.push_back(x.bytes); });
    workspace->sets_[0].buf->each(
        [&](MoeWorkspace::Buffers::Bytes& x, bool) { held.push_back(x.bytes); });
    for (size_t i = 0; i < needed.size(); ++i)
      MOE_ECHO_CHECK(needed[i] <= held[i], "workspace buffer of "
                                               << held[i] << " bytes where this layer needs "
                                               << needed[i]
                                               << ": build the workspace for this layer's config");
    MOE_ECHO_CHECK(workspace->sets() >= MoeWorkspace::sets_for({moe}),
                   "workspace of " << workspace->sets() << " set(s) of buffers for a layer of "
                                   << "in_flight = " << moe.in_flight
                                   << ", which needs 2: build the workspace for this layer's "
                                      "config");
    ws_ = workspace;
  } else {
    own_workspace_ =
        std::make_unique<MoeWorkspace>(backend, comm, std::vector<MoeConfig>{moe}, par, echo);
    ws_ = own_workspace_.get();
  }

  Reservation reservation;
  reservation.max_groups = slots_;
  // The shared experts' GEMMs take up to T rows in one window.
  reservation.max_rows =
      shared_width(moe) > 0 ? std::max<int64_t>(capacity_, moe.max_tokens) : capacity_;
  reservation.max_tokens = moe.max_tokens;
  reservation.hidden = moe.hidden;
  reservation.ffn = moe.ffn;
  reservation.experts = moe.experts;
  reservation.top_k = moe.top_k;
  reservation.ranks = par.ep_size;
  reservation.planner = planner_;
  reservation.fp8 = moe.precision == Precision::fp8;
  reservation.overlap_sms = moe.overlap == Overlap::wgrad || moe.chunks > 1 ? moe.overlap_sms : -1;
  reservation.lanes = ws_->sets();
  backend.reserve(reservation);

  buf_ = std::make_unique<Buffers>();
  Buffers& b = *buf_;
  Allocator alloc;
  alloc.dev = [&](DType t, std::initializer_list<int64_t> dims) {
    Tensor view(nullptr, t, dims);
    view.data = backend.allocate(view.bytes());
    b.owned.push_back(view.data);
    b.bytes += view.bytes();
    return view;
  };
  alloc.sym = [&](SymmetricBuffer& sb, DType t, std::initializer_list<int64_t> dims) {
    Tensor view(nullptr, t, dims);
    sb = comm.alloc_symmetric(backend, view.bytes());
    b.symmetric.push_back(&sb);
    b.bytes += view.bytes();
    view.data = sb.local;
    return view;
  };
  const BufferShapes shapes{moe,
                            par,
                            planner_,
                            slots_,
                            capacity_,
                            rounds_,
                            backend.activation_dtype(),
                            backend.float_dtype(),
                            optimizer_state,
                            own_slots_};
  declare_buffers(b, shapes, alloc);
  // Micro-batch 0's part is the one just declared; the others get their own routing,
  // activations and temporaries (the parts of the other MoeMemory fields are not allocated).
  auto current = std::make_shared<size_t MoeMemory::*>(&MoeMemory::params);
  Allocator per_step;
  per_step.part = [current](size_t MoeMemory::*p) { *current = p; };
  per_step.dev = [&, current](DType t, std::initializer_list<int64_t> dims) {
    return per_micro_batch(*current) ? alloc.dev(t, dims) : Tensor(nullptr, t, dims);
  };
  per_step.sym = [&, current](SymmetricBuffer& sb, DType t, std::initializer_list<int64_t> dims) {
    return per_micro_batch(*current) ? alloc.sym(sb, t, dims) : Tensor(nullptr, t, dims);
  };
  b.micro_batches.resize(size_t(moe.in_flight));
  for (int m = 0; m < moe.in_flight; ++m) {
    Buffers part;
    if (m > 0) declare_buffers(part, shapes, per_step);
    Buffers& declared = m == 0 ? b : part;
    bind_workspace(declared, *ws_->sets_[size_t(set_of(m))].buf, moe, par, echo,
                   backend.activation_dtype(), backend.float_dtype());
    if (m > 0 && own_slots_) {  // the layer's own echo slots serve every micro-batch
      declared.w1_spare = b.w1_spare, declared.w2_spare = b.w2_spare;
      declared.dw1_spare = b.dw1_spare, declared.dw2_spare = b.dw2_spare;
      declared.dw1_spare_sym = b.dw1_spare_sym, declared.dw2_spare_sym = b.dw2_spare_sym;
      declared.w1_spare_q = b.w1_spare_q, declared.w2_spare_q = b.w2_spare_q;
    }
    StepPart& kept = b.micro_batches[size_t(m)];
    kept = static_cast<const StepPart&>(declared);
    // The symmetric buffers in a StepPart that a layer allocates (recv_x when kept; the echo
    // slots' gradients when its own) are released through micro-batch 0's kept copy (buf_'s own
    // StepPart is overwritten by select_micro_batch).
    for (SymmetricBuffer*& sb : b.symmetric)
      for (auto member :
           {&StepPart::recv_x_sym, &StepPart::dw1_spare_sym, &StepPart::dw2_spare_sym})
        if (sb == &(declared.*member)) sb = &(kept.*member);
  }

  for (Tensor* t : {&b.w1, &b.w2, &b.dw1, &b.dw2, &b.d_router_weight, &b.router_bias, &b.m_router,
                    &b.v_router, &b.m_w1, &b.v_w1, &b.m_w2, &b.v_w2, &b.optimizer_step,
                    &b.d_shared_w1, &b.d_shared_w2, &b.m_sw1, &b.v_sw1, &b.m_sw2, &b.v_sw2})
    if (t->data) backend.fill_zero(*t, nullptr);
  for (StepPart& p : b.micro_batches) {
    for (Tensor* t : {&p.losses, &p.counts, &p.routing_map, &p.plan, &p.group_offsets, &p.rank_rows,
                      &p.round_active})
      backend.fill_zero(*t, nullptr);
    if (p.one.data) {
      write_tensor(backend, p.one, std::vector<double>{1.0});
      write_tensor(backend, p.shared_offsets, std::vector<double>{0.0, double(moe.max_tokens)});
    }
  }
  flights_.resize(size_t(moe.in_flight));
  select_micro_batch(0, "MoeLayer");
  init_parameters(seed);
  refresh_master_weights();
  backend.synchronize();
  comm.barrier();
}

void MoeLayer::refresh_master_weights() {
  Buffers& b = *buf_;
  const std::pair<Tensor*, Tensor*> pairs[] = {{&b.master_w1, &b.w1},
                                               {&b.master_w2, &b.w2},
                                               {&b.master_sw1, &b.shared_w1},
                                               {&b.master_sw2, &b.shared_w2}};
  for (const auto& [master, param] : pairs)
    if (master->data) write_tensor(backend_, *master, read_tensor(backend_, *param));
}

MoeLayer::~MoeLayer() {
  if (!buf_) return;
  if (ws_)
    for (MoeWorkspace::Set& set : ws_->sets_) {
      if (set.pool_owner.layer == this) set.pool_owner = {};
      if (set.split_owner.layer == this) set.split_owner = {};
    }
  release(backend_, comm_, buf_->symmetric, buf_->owned);
}

void MoeLayer::init_parameters(uint64_t seed) {
  Buffers& b = *buf_;
  const int64_t H = moe_.hidden, F = moe_.ffn, E = moe_.experts, EPR = E / par_.ep_size;
  // Router: small, so that initial routing is close to uniform; the same on every rank.
  std::vector<double> rw(size_t(E * H));
  Rng rr(seed, 0x5eed, 0);
  for (auto& v : rw) v = rr.uniform(-1.0, 1.0) / std::sqrt(double(H));
  write_tensor(backend_, b.router_weight, rw);
  // Experts, keyed by the global expert index.
  std::vector<double> w1(size_t(H * 2 * F)), w2(size_t(F * H));
  for (int64_t j = 0; j < EPR; ++j) {
    const int64_t e = par_.ep_rank * EPR + j;
    Rng r1(seed, 1000 + uint64_t(e), 1), r2(seed, 1000 + uint64_t(e), 2);
    for (auto& v : w1) v = r1.uniform(-1.0, 1.0) / std::sqrt(double(H));
    for (auto& v : w2) v = r2.uniform(-1.0, 1.0) / std::sqrt(double(F));
    write_tensor(backend_, b.w1.rows(j, 1), w1);
    write_tensor(backend_, b.w2.rows(j, 1), w2);
  }
  // Shared experts: the same on every rank.
  const int64_t S = shared_width(moe_);
  if (S > 0) {
    std::vector<double> s1(size_t(H * 2 * S)), s2(size_t(S * H));
    Rng r1(seed, 0x5a4ed, 1), r2(seed, 0x5a4ed, 2);
    for (auto& v : s1) v = r1.uniform(-1.0, 1.0) / std::sqrt(double(H));
    for (auto& v : s2) v = r2.uniform(-1.0, 1.0) / std::sqrt(double(S));
    write_tensor(backend_, b.shared_w1, s1);
    write_tensor(backend_, b.shared_w2, s2);
  }
}

Tensor MoeLayer::param(Param p) const {
  const int64_t EPR = moe_.experts / par_.ep_size;
  if (p == Param::w1 || p == Param::w2) {  // the caller may write them
    fp8_weights_stale_ = true;
    drop_placement();
  }
  switch (p) {
    case Param::router_weight: return buf_->router_weight;
    case Param::router_bias: return buf_->router_bias;
    case Param::w1: return buf_->w1.rows(0, EPR);
    case Param::w2: return buf_->w2.rows(0, EPR);
    case Param::shared_w1: return buf_->shared_w1;
    case Param::shared_w2: return buf_->shared_w2;
  }
  return {};
}

Tensor MoeLayer::grad(Param p) const {
  const int64_t EPR = moe_.experts / par_.ep_size;
  switch (p) {
    case Param::router_weight: return buf_->d_router_weight;
    case Param::router_bias: throw Error("router_bias has no gradient");
    case Param::w1: return buf_->dw1.rows(0, EPR);
    case Param::w2: return buf_->dw2.rows(0, EPR);
    case Param::shared_w1: return buf_->d_shared_w1;
    case Param::shared_w2: return buf_->d_shared_w2;
  }
  return {};
}

void MoeLayer::weights_changed() {
  MOE_ECHO_CHECK(!clone_grads_held_,
                 "weights_changed: clone gradients of earlier backwards are held in the echo "
                 "slots (hold_clone_grads), reduced home by the step's last backward (run with "
                 "hold_clone_grads(false)); change the weights after it");
  fp8_weights_stale_ = true;
  drop_placement();
}

void MoeLayer::hold_clone_grads(bool hold) {
  MOE_ECHO_CHECK(!hold || echo_.placement == EchoPlacement::step,
                 "hold_clone_grads(true) needs EchoConfig::placement = step, not "
                     << to_string(echo_.placement)
                     << " (each micro-batch's clones are planned for it, and their gradients go "
                        "home with its backward)");
  hold_clone_grads_ = hold;
}

void MoeLayer::discard_grad(Stream s) {
  check_no_split("discard_grad", false, true);
  backend_.fill_zero(buf_->d_router_weight, s);
  grads_zeroed_ = true;
}

void MoeLayer::zero_grad(Stream s) {
  check_no_split("zero_grad", false, true);
  backend_.fill_zero(buf_->d_router_weight, s);
  backend_.fill_zero(buf_->dw1, s);
  backend_.fill_zero(buf_->dw2, s);
  if (buf_->d_shared_w1.data) {
    backend_.fill_zero(buf_->d_shared_w1, s);
    backend_.fill_zero(buf_->d_shared_w2, s);
  }
  grads_zeroed_ = true;
  clone_grads_held_ = false;  // dropped: the next backward zeroes the clone slots' gradients
}

void MoeLayer::all_reduce_router_grad(Stream s) {
  comm_.all_reduce_sum(buf_->d_router_weight, s);
  if (buf_->d_shared_w1.data) {
    comm_.all_reduce_sum(buf_->d_shared_w1, s);
    comm_.all_reduce_sum(buf_->d_shared_w2, s);
  }
}

void MoeLayer::optimizer_step(const AdamWConfig& cfg, Stream s) {
  check_no_split("optimizer_step", false, true);
  Buffers& b = *buf_;
  MOE_ECHO_CHECK(
      b.m_router.data != nullptr,
      "optimizer_step on a layer built without optimizer state (optimizer_state = false)");
  MOE_ECHO_CHECK(!clone_grads_held_,
                 "optimizer_step: clone gradients of earlier backwards are held in the echo slots "
                 "(hold_clone_grads), not yet in the home experts' gradients: run the step's last "
                 "backward with hold_clone_grads(false), which reduces them home");
  drop_placement();  // the next forward plans the next step's placement
  backend_.add_i32(b.optimizer_step, 1, s);
  auto step = [&](const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
                  const Tensor& master) {
    AdamWArgs a;
    a.param = p, a.grad = g, a.m = m, a.v = v, a.master = master;
    a.step = b.optimizer_step;
    a.lr = cfg.lr, a.beta1 = cfg.beta1, a.beta2 = cfg.beta2, a.eps = cfg.eps;
    a.weight_decay = cfg.weight_decay;
    backend_.adamw(a, s);
  };
  step(b.router_weight, b.d_router_weight, b.m_router, b.v_router, Tensor());
  step(b.w1, grad(Param::w1), b.m_w1, b.v_w1, b.master_w1);
  step(b.w2, grad(Param::w2), b.m_w2, b.v_w2, b.master_w2);
  if (b.shared_w1.data) {
    step(b.shared_w1, b.d_shared_w1, b.m_sw1, b.v_sw1, b.master_sw1);
    step(b.shared_w2, b.d_shared_w2, b.m_sw2, b.v_sw2, b.master_sw2);
  }
  if (fp8_weights(moe_)) {
    quantize_weights(true, false, s);
    fp8_weights_stale_ = false;
  }
}

size_t MoeLayer::workspace_bytes() const {
  return buf_->bytes + (own_workspace_ ? own_workspace_->bytes() : 0);
}

size_t MoeLayer::layer_bytes() const { return buf_->bytes; }

MoeMemory MoeLayer::layer_memory_breakdown(const MoeConfig& moe, const ParallelConfig& par,
                                           const EchoConfig& echo, DType activation,
                                           DType float_dtype, bool optimizer_state) {
  validate(moe, par, echo);
  const PlannerConfig planner = moe_echo::planner_config(moe, par, echo);
  Buffers b;
  MoeMemory memory;
  declare_buffers(b,
                  {moe, par, planner, slots_per_rank(moe, par, echo), capacity_rows(moe),
                   max_rounds(moe, par, echo), activation, float_dtype, optimizer_state,
                   own_echo_slots(echo, planner.spare_slots)},
                  counting_allocator(memory));
  // Each micro-batch in flight has its own of these parts.
  for (size_t MoeMemory::*part :
       {&MoeMemory::params, &MoeMemory::grads, &MoeMemory::optimizer, &MoeMemory::routing,
        &MoeMemory::activations, &MoeMemory::temporaries, &MoeMemory::workspace,
        &MoeMemory::echo_slot_weights, &MoeMemory::echo_slot_grads, &MoeMemory::fp8})
    if (per_micro_batch(part)) memory.*part *= size_t(moe.in_flight);
  return memory;
}

MoeMemory MoeLayer::memory_breakdown(const MoeConfig& moe, const ParallelConfig& par,
                                     const EchoConfig& echo, DType activation, DType float_dtype,
                                     bool optimizer_state) {
  MoeMemory memory =
      layer_memory_breakdown(moe, par, echo, activation, float_dtype, optimizer_state);
  memory += MoeWorkspace::memory_breakdown({moe}, par, echo, activation, float_dtype);
  return memory;
}

size_t MoeLayer::layer_memory_bytes(const MoeConfig& moe, const ParallelConfig& par,
                                    const EchoConfig& echo, DType activation, DType float_dtype,
                                    bool optimizer_state) {
  return layer_memory_breakdown(moe, par, echo, activation, float_dtype, optimizer_state).total();
}

size_t MoeLayer::memory_bytes(const MoeConfig& moe, const ParallelConfig& par,
                              const EchoConfig& echo, DType activation, DType float_dtype,
                              bool optimizer_state) {
  return memory_breakdown(moe, par, echo, activation, float_dtype, optimizer_state).total();
}

MoeStack::MoeStack(Backend& backend, Communicator& comm, const std::vector<MoeConfig>& layers,
                   const ParallelConfig& par, const EchoConfig& echo, uint64_t seed,
                   bool optimizer_state)
    : workspace_(std::make_unique<MoeWorkspace>(backend, comm, layers, par, echo)) {
  layers_.reserve(layers.size());
  for (size_t l = 0; l < layers.size(); ++l)
    layers_.push_back(std::make_unique<MoeLayer>(backend, comm, layers[l], par, echo,
                                                 seed + uint64_t(l), optimizer_state,
                                                 workspace_.get()));
}

MoeStack::~MoeStack() { layers_.clear(); }  // before the workspace they use

MoeLayer& MoeStack::layer(int l) {
  MOE_ECHO_CHECK(l >= 0 && l < size(), "layer " << l << " of a stack of " << size());
  return *layers_[size_t(l)];
}
const MoeLayer& MoeStack::layer(int l) const {
  MOE_ECHO_CHECK(l >= 0 && l < size(), "layer " << l << " of a stack of " << size());
  return *layers_[size_t(l)];
}

size_t MoeStack::bytes() const {
  size_t total = workspace_->bytes();
  for (const auto& l : layers_) total += l->layer_bytes();
  return total;
}

size_t MoeStack::memory_bytes(const std::vector<MoeConfig>& layers, const ParallelConfig& par,
                              const EchoConfig& echo, DType activation, DType float_dtype,
                              bool optimizer_state) {
  return memory_breakdown(layers, par, echo, activation, float_dtype, optimizer_state).total();
}

MoeMemory MoeStack::memory_breakdown(const std::vector<MoeConfig>& layers,
                                     const ParallelConfig& par, const EchoConfig& echo,
                                     DType activation, DType float_dtype, bool optimizer_state) {
  MoeMemory memory = MoeWorkspace::memory_breakdown(layers, par, echo, activation, float_dtype);
  for (const MoeConfig& m : layers)
    memory +=
        MoeLayer::layer_memory_breakdown(m, par, echo, activation, float_dtype, optimizer_state);
  return memory;
}

namespace {
uint64_t address(const void* p) { return uint64_t(reinterpret_cast<uintptr_t>(p)); }

// The router's tensors for T tokens of x: the forward writes them, the backward reads them again.
RouterTensors router_tensors(const MoeLayer::Buffers& b, const Tensor& x, int64_t T) {
  return RouterTensors{x,
                       b.router_weight,
                       b.logits.rows(0, T),
                       b.scores.rows(0, T),
                       b.topk_idx.rows(0, T),
                       b.topk_weight.rows(0, T),
                       b.counts};
}
// An expert GEMM (fprop or dgrad) over the window: the home slots' weights from `home`, the
// spare slots' (clones) from `spare`.
GemmArgs experts_gemm(const GroupWindow& gw, const Tensor& a, const Tensor& spare,
                      const Tensor& home, const Tensor& c) {
  GemmArgs g;
  g.window = gw;
  g.a = a;
  g.b = spare;
  g.b_home = home;
  g.c = c;
  return g;
}
}  // namespace

// The expert weight gradients over the window: home slots into `home`, spare slots into `spare`;
// written (home slots without rows zeroed) or added.
GemmArgs MoeLayer::wgrad(const GroupWindow& gw, const Tensor& a, const Tensor& b,
                         const Tensor& spare, const Tensor& home, bool overwrite) const {
  GemmArgs g;
  g.window = gw;
  g.a = a;
  g.b = b;
  g.c = spare;
  g.c_home = home;
  g.accumulate = !overwrite;
  // Overwriting, a slot with no rows is zeroed: a home slot; with EchoPlacement::step a clone slot
  // too (the step's clone may get rows in a later backward, and is reduced home either way).
  g.zero_empty_below = overwrite ? (own_slots_ ? slots_ : int(moe_.experts / par_.ep_size)) : 0;
  return g;
}

void MoeLayer::quantize_weights(bool home, bool spare, Stream s) {
  const Buffers& b = *buf_;
  const bool w1 = fp8_w1(moe_), w2 = fp8_w2(moe_);  // the weights some FP8 GEMM reads
  if (home && w1)
    backend_.quantize_fp8_blocks({b.w1, b.w1_q.q, b.w1_q.q_t, b.w1_q.s, b.w1_q.s_t}, s);
  if (home && w2)
    backend_.quantize_fp8_blocks({b.w2, b.w2_q.q, b.w2_q.q_t, b.w2_q.s, b.w2_q.s_t}, s);
  if (spare && b.w1_spare.data && w1)
    backend_.quantize_fp8_blocks(
        {b.w1_spare, b.w1_spare_q.q, b.w1_spare_q.q_t, b.w1_spare_q.s, b.w1_spare_q.s_t}, s);
  if (spare && b.w2_spare.data && w2)
    backend_.quantize_fp8_blocks(
        {b.w2_spare, b.w2_spare_q.q, b.w2_spare_q.q_t, b.w2_spare_q.s, b.w2_spare_q.s_t}, s);
}

namespace {
// The first `rows` rows of an e4m3 [R, W] buffer (or its [R, tiles(W)] scales) viewed as
// [rows, cols] (a contiguous prefix: the FP8 operands of one GEMM, packed).
Tensor packed(const Tensor& buffer, int64_t rows, int64_t cols) {
  Tensor t(buffer.data, buffer.dtype, {rows, cols});
  MOE_ECHO_CHECK(t.bytes() <= buffer.bytes(),
                 "fp8 buffer " << buffer.describe() << " for " << t.describe());
  return t;
}
Tensor packed(const Tensor& buffer, int64_t n) {
  Tensor t(buffer.data, buffer.dtype, {n});
  MOE_ECHO_CHECK(t.bytes() <= buffer.bytes(),
                 "fp8 buffer " << buffer.describe() << " for " << t.describe());
  return t;
}
}  // namespace

// fprop (c = a @ w) or dgrad (c = a @ w^T) of fc1 or fc2 over the window. In fp8, a's rows are
// quantized first; fprop reads the weights' copies made for it (q_t, s_t), dgrad the others.
void MoeLayer::expert_rows_gemm(const GroupWindow& gw, const Tensor& a, int fc, const Tensor& c,
                                bool dgrad, Stream s) {
  const Buffers& b = *buf_;
  const Tensor& home = fc == 1 ? b.w1 : b.w2;
  const Tensor& spare = fc == 1 ? b.w1_spare : b.w2_spare;
  const uint32_t gemm = fc == 1 ? (dgrad ? fp8_gemm::dgrad1 : fp8_gemm::fprop1)
                                : (dgrad ? fp8_gemm::dgrad2 : fp8_gemm::fprop2);
  if (!uses_fp8(moe_, gemm)) {
    const GemmArgs g = experts_gemm(gw, a, spare, home, c);
    if (dgrad)
      backend_.gemm_dgrad(g, s);
    else
      backend_.gemm_fprop(g, s);
    return;
  }
  const int64_t rows = a.size(0), k = a.size(1);
  const Tensor q = packed(b.row_q, rows, k), sc = packed(b.row_s, rows, fp8_tiles(k));
  backend_.quantize_fp8_rows({a, q, sc, {}, gw}, s);
  quantized_rows_gemm(gw, q, sc, fc, c, dgrad, s);
}

// fc's dgrad c = d @ w^T. When fc's wgrad is FP8 too, d's rows and its columns for that wgrad
// (col_b, col_bs, col_po2) are quantized in one pass, which expert_wgrad then takes
// (`b_quantized`); returns whether they were.
bool MoeLayer::expert_dgrad(const GroupWindow& gw, const Tensor& d, int fc, const Tensor& c,
                            Stream s) {
  if (!dgrad_quantizes_cols(fc)) {
    expert_rows_gemm(gw, d, fc, c, true, s);
    return false;
  }
  const Buffers& b = *buf_;
  const int64_t rows = d.size(0), k = d.size(1), P = b.col_b.size(1);
  const Tensor q = packed(b.row_q, rows, k), sc = packed(b.row_s, rows, fp8_tiles(k));
  backend_.quantize_fp8_cols(
      {gw, d, packed(b.col_b, k, P), packed(b.col_bs, k * P / kFp8Tile), b.col_po2, {}, q, sc}, s);
  quantized_rows_gemm(gw, q, sc, fc, c, true, s);
  return true;
}

// expert_rows_gemm on rows already in e4m3 with their 1 x 128 scales.
void MoeLayer::quantized_rows_gemm(const GroupWindow& gw, const Tensor& q, const Tensor& sc, int fc,
                                   const Tensor& c, bool dgrad, Stream s) {
  const Buffers& b = *buf_;
  const Buffers::Fp8Weight& wh = fc == 1 ? b.w1_q : b.w2_q;
  const Buffers::Fp8Weight& ws = fc == 1 ? b.w1_spare_q : b.w2_spare_q;
  Fp8GemmArgs g;
  g.window = gw;
  g.a = q, g.a_scale = sc;
  g.c = c;
  if (dgrad) {
    g.b = ws.q, g.b_scale = ws.s, g.b_home = wh.q, g.b_home_scale = wh.s;
    backend_.gemm_fp8_dgrad(g, s);
  } else {
    g.b = ws.q_t, g.b_scale = ws.s_t, g.b_home = wh.q_t, g.b_home_scale = wh.s_t;
    backend_.gemm_fp8_fprop(g, s);
  }
}

void MoeLayer::expert_wgrad(const GroupWindow& gw, const Tensor& a, const Tensor& bt, int fc,
                            const Tensor& home, bool overwrite, Stream s, const Tensor& a_scale,
                            bool b_quantized) {
  const Buffers& b = *buf_;
  const Tensor& spare = fc == 1 ? b.dw1_spare : b.dw2_spare;
  if (!uses_fp8(moe_, fc == 1 ? fp8_gemm::wgrad1 : fp8_gemm::wgrad2)) {
    MOE_ECHO_CHECK(a_scale.data == nullptr, "expert_wgrad: e4m3 rows for a bf16 weight gradient");
    backend_.gemm_wgrad(wgrad(gw, a, bt, spare, home, overwrite), s);
    return;
  }
  const int64_t ka = a.size(1), nb = bt.size(1), P = b.col_a.size(1);
  const Tensor qa = packed(b.col_a, ka, P), qb = packed(b.col_b, nb, P);
  const Tensor sa = packed(b.col_as, ka * P / kFp8Tile), sb = packed(b.col_bs, nb * P / kFp8Tile);
  backend_.quantize_fp8_cols({gw, a, qa, sa, b.col_po, a_scale}, s);
  if (!b_quantized) backend_.quantize_fp8_cols({gw, bt, qb, sb, b.col_po2}, s);
  const GemmArgs w = wgrad(gw, a, bt, spare, home, overwrite);
  Fp8GemmArgs g;
  g.window = gw;
  g.a = qa, g.a_scale = sa, g.b = qb, g.b_scale = sb, g.padded_offsets = b.col_po;
  g.c = w.c, g.c_home = w.c_home, g.accumulate = w.accumulate;
  g.zero_empty_below = w.zero_empty_below;
  backend_.gemm_fp8_wgrad(g, s);
}

// h = recv_x @ w1 over the window (fp8: from the dispatched e4m3 rows, no quantization).
void MoeLayer::fc1_forward(const GroupWindow& gw, Stream s) {
  const Buffers& b = *buf_;
  if (fp8_dispatch(moe_))
    quantized_rows_gemm(gw, b.recv_xq, b.recv_xs, 1, b.h, false, s);
  else
    expert_rows_gemm(gw, b.recv_x, 1, b.h, false, s);
}

void MoeLayer::pull_clones(Stream s) {
  const Buffers& b = *buf_;
  const PlanView plan = plan_view(b.plan.as<int32_t>(), planner_);
  comm_.pull_clone_weights(plan, planner_, b.w1_sym, b.w1_spare.data,
                           b.w1.row_numel() * dtype_size(b.w1.dtype), s);
  comm_.pull_clone_weights(plan, planner_, b.w2_sym, b.w2_spare.data,
                           b.w2.row_numel() * dtype_size(b.w2.dtype), s);
}

namespace {
void check_micro_batch(int m, const MoeConfig& moe, const char* call) {
  MOE_ECHO_CHECK(m >= 0 && m < moe.in_flight,
                 call << ": micro_batch = " << m << " is invalid: allowed 0 to "
                      << moe.in_flight - 1 << " (MoeConfig::in_flight = " << moe.in_flight << ")");
}
}  // namespace

void MoeLayer::select_micro_batch(int m, const char* call) {
  check_micro_batch(m, moe_, call);
  cur_ = m;
  fl_ = &flights_[size_t(m)];
  static_cast<StepPart&>(*buf_) = buf_->micro_batches[size_t(m)];
  backend_.set_lane(set_of(m));  // the backend's resources of this workspace set
}

namespace {
const char* split_name(bool forward) {
  return forward ? "forward (forward_dispatch without its forward_combine)"
                 : "backward (backward_dispatch without its backward_combine)";
}
}  // namespace

void MoeLayer::check_no_split(const char* call, bool workspace, bool all_micro_batches) const {
  for (int m = 0; m < moe_.in_flight; ++m) {
    if (m != cur_ && !all_micro_batches) continue;
    const SplitPhase p = flights_[size_t(m)].split_phase;
    MOE_ECHO_CHECK(p == SplitPhase::none,
                   call << ": micro-batch " << m << " of this layer is between the phases of a "
                        << "split "
                        << split_name(p == SplitPhase::forward_dispatched ||
                                      p == SplitPhase::forward_experts_done));
  }
  const MoeWorkspace::User owner = ws_set().split_owner;
  if (!workspace || owner.layer == nullptr || owner == user()) return;
  if (owner.layer == this)
    throw Error(std::string(call) + ": micro-batch " + std::to_string(owner.micro_batch) +
                " of this layer, sharing micro-batch " + std::to_string(cur_) +
                "'s workspace set (micro_batch % 2), is between the phases of a split forward or "
                "backward (the set's receive windows and echo slots are in use until its "
                "combine)");
  throw Error(std::string(call) +
              ": another layer sharing this micro-batch's workspace set is between the phases of "
              "a split forward or backward (its micro-batch " +
              std::to_string(owner.micro_batch) +
              "; the set's receive windows and echo slots are in use until its combine)");
}

void MoeLayer::check_no_chunks(const char* call) const {
  MOE_ECHO_CHECK(moe_.chunks == 1,
                 call << ": MoeConfig::chunks = " << moe_.chunks
                      << " overlaps round 0's dispatch and combine with its GEMMs inside forward() "
                         "and backward(); the split-phase calls leave overlap to the caller's "
                         "schedule: build the layer with chunks = 1 to use them");
}

void MoeLayer::expect_phase(SplitPhase want, const char* call) const {
  static const char* const calls[] = {"", "forward_dispatch", "forward_experts",
                                      "backward_dispatch", "backward_experts"};
  static const char* const states[] = {"with no split forward or backward under way",
                                       "after forward_dispatch", "after forward_experts",
                                       "after backward_dispatch", "after backward_experts"};
  MOE_ECHO_CHECK(fl_->split_phase == want, call << " must follow " << calls[int(want)]
                                                << " of this layer and micro-batch; micro-batch "
                                                << cur_ << " is " << states[int(fl_->split_phase)]);
}

void MoeLayer::begin_forward(const Tensor& x, const Tensor& y, bool split) {
  const int64_t T = x.ndim == 2 ? x.size(0) : -1, H = moe_.hidden;
  check_tensor(x, "x", backend_.activation_dtype(), {-1, H});
  check_tensor(y, "y", backend_.activation_dtype(), {T, H});
  MOE_ECHO_CHECK(T <= moe_.max_tokens,
                 "x has " << T << " tokens, more than max_tokens = " << moe_.max_tokens);
  // EchoPlacement::step: the step's first forward (the weights changed since the last placement)
  // plans the placement; a new one would leave held clone gradients without their clones.
  const bool place = !own_slots_ || !placement_held_;
  MOE_ECHO_CHECK(!(own_slots_ && place && clone_grads_held_),
                 "forward: the expert weights changed (optimizer_step, weights_changed or a view "
                 "of w1 or w2 taken) while clone gradients of earlier backwards are held in the "
                 "echo slots (hold_clone_grads): run the step's last backward with "
                 "hold_clone_grads(false) first, which reduces them home");
  fl_->last_tokens = T;
  fl_->last_x = x;  // the router backward and spill-round recompute read it again
  last_forward_ = cur_;
  fl_->forward_pending = true;
  fl_->step = Step{};
  fl_->step.x = x;
  fl_->step.y = y;
  fl_->step.T = T;
  fl_->step.quantize_home = fp8_weights(moe_) && fp8_weights_stale_;
  fl_->step.split = split;
  fl_->step.place = place;
  fl_->placed = place;
  if (own_slots_) placement_held_ = true;
  fl_->placement_epoch = placement_epoch_;
}

void MoeLayer::forward(const Tensor& x, const Tensor& y, Stream s, int micro_batch) {
  select_micro_batch(micro_batch, "forward");
  check_no_split("forward");
  begin_forward(x, y, false);
  const Step& st = fl_->step;
  auto ops = [&](Stream g) {
    forward_dispatch_ops(st, g);
    if (chunked_forward(st)) {
      forward_chunks_ops(st, g);
      return;
    }
    forward_experts_ops(st, g);
    forward_combine_ops(st, g);
  };
  if (eager_graphs())
    backend_.enqueue_as_graph(fl_->forward_graph,
                              {address(x.data), address(y.data), uint64_t(st.T),
                               uint64_t(st.quantize_home), uint64_t(st.place)},
                              ops, s);
  else
    ops(s);
  if (st.quantize_home) fp8_weights_stale_ = false;
  ws_set().pool_owner = user();  // the forward pulled this micro-batch's clones into the slots
}

void MoeLayer::enqueue_phase(int phase, const std::function<void(Stream)>& ops, Stream s) {
  const Step& st = fl_->step;
  if (eager_graphs())
    backend_.enqueue_as_graph(
        fl_->phase_graphs[phase],
        {address(st.x.data), address(st.y.data), address(st.dy.data), address(st.dx.data),
         uint64_t(st.T), uint64_t(st.quantize_home), uint64_t(st.overwrite_grads),
         uint64_t(st.overwrite_shared), uint64_t(st.repull), address(st.into.dw1.data),
         address(st.into.dw2.data), uint64_t(st.place), uint64_t(st.zero_home),
         uint64_t(st.zero_clones), uint64_t(st.reduce_clones)},
        ops, s);
  else
    ops(s);
}

void MoeLayer::forward_dispatch(const Tensor& x, const Tensor& y, Stream s, int micro_batch) {
  select_micro_batch(micro_batch, "forward_dispatch");
  check_no_split("forward_dispatch");
  check_no_chunks("forward_dispatch");
  begin_forward(x, y, true);
  ws_set().split_owner = user();
  fl_->split_phase = SplitPhase::forward_dispatched;
  enqueue_phase(
      0, [&](Stream g) { forward_dispatch_ops(fl_->step, g); }, s);
  if (fl_->step.quantize_home) fp8_weights_stale_ = false;
  ws_set().pool_owner = user();
}

void MoeLayer::forward_experts(Stream s, int micro_batch) {
  select_micro_batch(micro_batch, "forward_experts");
  expect_phase(SplitPhase::forward_dispatched, "forward_experts");
  fl_->split_phase = SplitPhase::forward_experts_done;
  enqueue_phase(
      1, [&](Stream g) { forward_experts_ops(fl_->step, g); }, s);
}

void MoeLayer::forward_combine(Stream s, int micro_batch) {
  select_micro_batch(micro_batch, "forward_combine");
  expect_phase(SplitPhase::forward_experts_done, "forward_combine");
  enqueue_phase(
      2, [&](Stream g) { forward_combine_ops(fl_->step, g); }, s);
  fl_->split_phase = SplitPhase::none;
  ws_set().split_owner = {};
}

bool MoeLayer::shared_beside_experts(const Step& st, bool forward) const {
  return buf_->shared_w1.data != nullptr && moe_.shared_side_stream && st.split &&
         (!forward || rounds_ == 1);
}

// Shared experts (they write y) run first; on the side stream when asked, joined before the first
// combine: before the rounds when spill rounds are configured, else in round 0. A split forward
// without spill rounds runs them beside round 0's experts phase instead (one phase's graph holds
// both the fork and the join). Spill rounds run whole before round 0, so that round 0's
// activations stay in the buffers for the backward.
void MoeLayer::forward_dispatch_ops(const Step& st, Stream s) {
  Buffers& b = *buf_;
  const Tensor &x = st.x, &y = st.y;
  const int64_t T = st.T, K = moe_.top_k;
  const bool shared = b.shared_w1.data != nullptr, side = shared && moe_.shared_side_stream;
  if (side && !shared_beside_experts(st, true))
    backend_.fork_side([&](Stream ss) { shared_forward(x, y, T, ss); }, s);
  else if (shared && !side)
    shared_forward(x, y, T, s);
  RouterForwardArgs ra;
  ra.tensors = router_tensors(b, x, T);
  ra.bias = b.router_bias;
  ra.losses = b.losses;
  ra.config = router_config(moe_);
  mark("router", s);
  backend_.router_forward(ra, s);

  mark("count_gather", s);
  comm_.all_gather_i32(b.counts.as<int32_t>(), b.routing_map.as<int32_t>(), moe_.experts, s);
  mark("plan", s);
  if (own_slots_ && !st.place) {  // EchoPlacement::step: this micro-batch's rows over the kept one
    const PlanView kept = plan_view(b.step_plan.as<int32_t>(), planner_);
    const Tensor placement(kept.spare_expert, DType::i32,
                           {int64_t(par_.ep_size) * planner_.spare_slots});
    backend_.plan_placed(b.routing_map, planner_, placement, b.plan, s);
  } else {
    backend_.plan(b.routing_map, planner_, echo_.enabled, b.plan, s);
  }
  if (own_slots_ && st.place) backend_.copy(b.step_plan, b.plan, s);  // the step's placement

  LayoutArgs la;
  la.routing_map = b.routing_map;
  la.plan = b.plan;
  la.topk_idx = b.topk_idx.rows(0, T);
  la.assign = b.assign;
  la.dest_rank = b.dest_rank.rows(0, T * K);
  la.dest_row = b.dest_row.rows(0, T * K);
  la.group_offsets = b.group_offsets;
  la.rank_rows = b.rank_rows;
  la.round_active = b.round_active;
  la.planner = planner_;
  la.rank = par_.ep_rank;
  la.slots = slots_;
  la.capacity = capacity_;
  mark("layout", s);
  backend_.layout(la, s);

  const bool pull = planner_.spare_slots > 0 && st.place;
  if (pull) {
    mark("clone_pull", s);
    pull_clones(s);
  }
  if (moe_.precision == Precision::fp8) {
    mark("fp8_weights", s);
    quantize_weights(st.quantize_home, pull, s);
  }

  // With shared experts every round adds to y. Otherwise spill rounds add into y (zeroed first
  // when there are any); round 0 then adds to them, or writes y when there were none.
  if (side && rounds_ > 1) backend_.join_side(s);
  const int32_t* spill = rounds_ > 1 ? b.round_active.as<int32_t>() + 1 : nullptr;
  if (spill) mark("spill_rounds", s);
  if (spill && !shared)
    backend_.run_if(
        spill, [&](Stream bs) { backend_.fill_zero(y, bs); }, s);
  for (int r = rounds_ - 1; r >= 1; --r)
    backend_.run_if(
        b.round_active.as<int32_t>() + r,
        [&, r](Stream bs) {
          dispatch_tokens(r, x, T, bs);
          round_experts(r, bs);
          round_combine(r, y, T, spill, bs, false);
        },
        s);
  if (!chunked_forward(st)) dispatch_tokens(0, x, T, s);
}

bool MoeLayer::chunked_forward(const Step& st) const { return moe_.chunks > 1 && !st.split; }

// Round 0 in chunks (MoeConfig::chunks): chunk c's fan-out and expert GEMMs run on the side
// stream while the step's stream dispatches chunk c + 1 and combines chunk c - 1:
//   s:    plan  d0  d1  J F1  c0  d2  J F2  c1  ...  J  c(C-1)
//   side:           G0        G1            G2  ...
// (F: fork, J: join of the side stream). The shared experts on the side stream are joined
// before the chunks take it.
void MoeLayer::forward_chunks_ops(const Step& st, Stream s) {
  Buffers& b = *buf_;
  const bool shared = b.shared_w1.data != nullptr, side = shared && moe_.shared_side_stream;
  mark(0, "chunk_plan", s);
  backend_.chunk_plan(
      {b.rank_rows, b.group_offsets, b.chunk_bounds, b.chunk_offsets, par_.ep_rank, 0, capacity_},
      s);
  if (side && rounds_ == 1) backend_.join_side(s);
  const int32_t* accumulate = shared        ? b.one.as<int32_t>()
                              : rounds_ > 1 ? b.round_active.as<int32_t>() + 1
                                            : nullptr;
  run_chunks(true, st, accumulate, s);
}

// The chunks' pipeline of a forward or a backward (MoeConfig::chunks): per chunk c, its dispatch
// (x into recv_x, or dy into recv_red) on `s`, its expert work (chunk_experts or chunk_backward)
// forked onto the side stream once chunk c - 1's is joined, then chunk c - 1's combine (into y,
// or into dx with the combine-weight gradients); after the last chunk's expert work, the
// backward's weight gradients forked onto the side stream (joined by backward_finish_ops) beside
// the last combine.
void MoeLayer::run_chunks(bool forward, const Step& st, const int32_t* accumulate, Stream s) {
  Buffers& b = *buf_;
  const size_t row_bytes = size_t(moe_.hidden) * dtype_size(backend_.activation_dtype());
  auto combine = [&](int c) {
    mark(0, forward ? "combine" : "bwd_combine", s);
    comm_.combine(chunk_route(st.T, c), RoundWindow{0, capacity_}, b.recv_red_sym,
                  forward ? st.y : st.dx, accumulate, b.fan,
                  forward ? nullptr : b.d_topk_weight.data, s);
  };
  for (int c = 0; c < moe_.chunks; ++c) {
    mark(0, forward ? "dispatch" : "bwd_dispatch", s);
    comm_.dispatch(chunk_route(st.T, c), RoundWindow{0, capacity_},
                   forward ? st.x.data : st.dy.data, row_bytes,
                   forward ? b.recv_x_sym : b.recv_red_sym, b.fan, s);
    if (c > 0) backend_.join_side(s);
    backend_.fork_side(
        [&, c](Stream ss) { forward ? chunk_experts(c, ss) : chunk_backward(c, ss); }, s);
    if (c > 0) combine(c - 1);
  }
  backend_.join_side(s);
  if (!forward)
    backend_.fork_side(
        [&](Stream ss) {
          const GroupWindow gw{RoundWindow{0, capacity_}, b.group_offsets.as<int32_t>(), slots_};
          mark(0, "bwd_wgrad_fc2", ss);
          expert_wgrad(gw, b.a, b.recv_out, 2, st.into.dw2.data ? st.into.dw2 : b.dw2,
                       st.overwrite_grads, ss);
          round_wgrad1(0, st.overwrite_grads, st.into, ss);
        },
        s);
  combine(moe_.chunks - 1);
}

// This rank's window rows [lo, hi) of a chunk (FanArgs::chunk), and the chunk's rows as the
// expert ops' window (its group offsets).
const int32_t* MoeLayer::chunk_rows(int chunk) const {
  return buf_->chunk_bounds.as<int32_t>() + int64_t(par_.ep_rank) * (moe_.chunks + 1) + chunk;
}
GroupWindow MoeLayer::chunk_window(int chunk) const {
  return GroupWindow{
      {0, capacity_}, buf_->chunk_offsets.as<int32_t>() + int64_t(chunk) * (slots_ + 1), slots_};
}

RowRoute MoeLayer::chunk_route(int64_t T, int chunk) const {
  RowRoute r = route(T);
  r.chunks = RowChunks{buf_->chunk_bounds.as<int32_t>(), moe_.chunks, chunk};
  return r;
}

void MoeLayer::chunk_experts(int chunk, Stream s) {
  Buffers& b = *buf_;
  const int32_t* rows = chunk_rows(chunk);
  mark(0, "fan_out", s);
  backend_.fan_out(expand_args(fan_args(0), b, rows), s);
  window_experts(chunk_window(chunk), sum_args(fan_args(0), b, rows), s);
}

bool MoeLayer::chunked_backward(const Step& st) const {
  // FP8 weight gradients quantize their operands' columns over whole groups, in the dgrads.
  return moe_.chunks > 1 && !st.split && !uses_fp8(moe_, fp8_gemm::wgrad1 | fp8_gemm::wgrad2);
}

// Round 0's backward in chunks (MoeConfig::chunks; the forward's chunk plan): chunk c's dy
// scatter, dgrads and fan-in on the side stream while the step's stream dispatches chunk c + 1's
// dy and combines chunk c - 1's dx; the dgrad of fc1 writes its dx rows into recv_red (recv_out
// keeps d_out for fc2's weight gradient) and the fan-in sums them there in place. Both weight
// gradients run after the last chunk, over the whole window, on the side stream beside the last
// combine and the router's backward (delayed wgrad).
void MoeLayer::backward_chunks_ops(const Step& st, Stream s) {
  Buffers& b = *buf_;
  const bool shared = b.shared_w1.data != nullptr, side = shared && moe_.shared_side_stream;
  if (side) backend_.join_side(s);  // the shared experts' backward, before the chunks take it
  run_chunks(false, st, shared ? b.one.as<int32_t>() : nullptr, s);
  backward_finish_ops(st, true, s);
}

void MoeLayer::chunk_backward(int chunk, Stream s) {
  Buffers& b = *buf_;
  const int32_t* rows = chunk_rows(chunk);
  mark(0, "bwd_fan_out", s);
  backend_.fan_out(scatter_args(fan_args(0), b, rows), s);
  const GroupWindow gw = chunk_window(chunk);
  mark(0, "bwd_dgrad_fc2", s);
  expert_dgrad(gw, b.recv_out, 2, b.da, s);
  mark(0, "bwd_swiglu", s);
  backend_.swiglu_backward({gw, b.h, b.a, b.da, b.dh}, s);
  mark(0, "bwd_dgrad_fc1", s);
  expert_dgrad(gw, b.dh, 1, b.recv_red, s);
  FanArgs sum = fan_args(0);
  sum.weights = Tensor();
  sum.src = b.recv_red;
  sum.dst = b.recv_red;
  sum.chunk = rows;
  mark(0, "bwd_fan_in", s);
  backend_.fan_in(sum, s);
}

void MoeLayer::forward_experts_ops(const Step& st, Stream s) {
  const bool beside = shared_beside_experts(st, true);
  if (beside) backend_.fork_side([&](Stream ss) { shared_forward(st.x, st.y, st.T, ss); }, s);
  round_experts(0, s);
  if (beside) backend_.join_side(s);
}

void MoeLayer::forward_combine_ops(const Step& st, Stream s) {
  Buffers& b = *buf_;
  const bool shared = b.shared_w1.data != nullptr, side = shared && moe_.shared_side_stream;
  const int32_t* spill = rounds_ > 1 ? b.round_active.as<int32_t>() + 1 : nullptr;
  round_combine(0, st.y, st.T, shared ? b.one.as<int32_t>() : spill, s,
                side && rounds_ == 1 && !shared_beside_experts(st, true));
}

GroupWindow MoeLayer::shared_window(int64_t T) const {
  return GroupWindow{{0, T}, buf_->shared_offsets.as<int32_t>(), 1};
}

// y = SwiGLU(x W1s) W2s over the T tokens (written, not added).
void MoeLayer::shared_forward(const Tensor& x, const Tensor& y, int64_t T, Stream s) {
  Buffers& b = *buf_;
  mark("shared_experts", s);
  if (T == 0) return;
  const GroupWindow gw = shared_window(T);
  backend_.gemm_fprop({gw, x, b.shared_w1, b.shared_h}, s);
  backend_.swiglu_forward({gw, b.shared_h, b.shared_a, Tensor(), Tensor()}, s);
  backend_.gemm_fprop({gw, b.shared_a, b.shared_w2, y}, s);
}

// dx = the shared experts' input gradient (written); their weight gradients added, or written
// after zero_grad / discard_grad.
void MoeLayer::shared_backward(const Tensor& dy, const Tensor& dx, int64_t T, bool overwrite_grads,
                               Stream s) {
  Buffers& b = *buf_;
  mark("bwd_shared_experts", s);
  if (T == 0) {
    if (overwrite_grads) {
      backend_.fill_zero(b.d_shared_w1, s);
      backend_.fill_zero(b.d_shared_w2, s);
    }
    return;
  }
  const GroupWindow gw = shared_window(T);
  backend_.gemm_dgrad({gw, dy, b.shared_w2, b.shared_da}, s);
  backend_.gemm_wgrad({gw, b.shared_a, dy, b.d_shared_w2, !overwrite_grads}, s);
  backend_.swiglu_backward({gw, b.shared_h, b.shared_a, b.shared_da, b.shared_dh}, s);
  backend_.gemm_dgrad({gw, b.shared_dh, b.shared_w1, dx}, s);
  backend_.gemm_wgrad({gw, fl_->last_x, b.shared_dh, b.d_shared_w1, !overwrite_grads}, s);
}

RowRoute MoeLayer::route(int64_t T) const {
  const Buffers& b = *buf_;
  return RowRoute{b.dest_rank.as<int32_t>(), b.dest_row.as<int32_t>(), b.topk_weight.data,
                  T * moe_.top_k, moe_.top_k};
}

FanArgs MoeLayer::fan_args(int round) const {
  const Buffers& b = *buf_;
  FanArgs f;
  f.window = GroupWindow{{round * capacity_, capacity_}, b.group_offsets.as<int32_t>(), slots_};
  f.members = b.fan_members;
  f.weights = b.fan_weights;
  return f;
}

// Token rows to the experts of this round's window, expanded to every member row: recv_x. In fp8
// the rows cross quantized (values and scales packed in one row, about half the bytes of bf16):
// x is quantized once per token, the packed rows land in recv_red's bytes and fan out into
// recv_xq and recv_xs, which fc1 reads as they are.
void MoeLayer::dispatch_tokens(int round, const Tensor& x, int64_t T, Stream s) {
  Buffers& b = *buf_;
  if (fp8_dispatch(moe_)) {
    const int64_t pitch = fp8_packed_row_bytes(moe_.hidden);
    const Tensor send = packed(b.x_send, T, pitch);
    mark(round, "fp8_quantize_x", s);
    backend_.quantize_fp8_rows({x, Tensor(), Tensor(), send}, s);
    mark(round, "dispatch", s);
    comm_.dispatch(route(T), RoundWindow{round * capacity_, capacity_}, send.data, size_t(pitch),
                   b.recv_red_sym, b.fan, s);
    mark(round, "fan_out", s);
    const FanArgs f = fan_args(round);
    backend_.fan_out_fp8(
        {f.window, f.members, Tensor(b.recv_red.data, DType::e4m3, {capacity_, pitch}), b.recv_xq,
         b.recv_xs},
        s);
    return;
  }
  const size_t row_bytes = size_t(moe_.hidden) * dtype_size(backend_.activation_dtype());
  mark(round, "dispatch", s);
  comm_.dispatch(route(T), RoundWindow{round * capacity_, capacity_}, x.data, row_bytes,
                 b.recv_x_sym, b.fan, s);
  mark(round, "fan_out", s);
  backend_.fan_out(expand_args(fan_args(round), b, nullptr), s);
}

void MoeLayer::round_experts(int round, Stream s) {
  Buffers& b = *buf_;
  const RoundWindow win{round * capacity_, capacity_};
  window_experts(GroupWindow{win, b.group_offsets.as<int32_t>(), slots_},
                 sum_args(fan_args(round), b, nullptr), s);
}

void MoeLayer::window_experts(const GroupWindow& gw, const FanArgs& sum, Stream s) {
  Buffers& b = *buf_;
  const int round = int(gw.row_lo / std::max<int64_t>(capacity_, 1));
  mark(round, "fc1", s);
  fc1_forward(gw, s);
  mark(round, "swiglu", s);
  if (uses_fp8(moe_, fp8_gemm::fprop2)) {  // a's FP8 rows written by SwiGLU itself
    const int64_t rows = b.a.size(0), F = b.a.size(1);
    const Tensor q = packed(b.row_q, rows, F), sc = packed(b.row_s, rows, fp8_tiles(F));
    backend_.swiglu_forward({gw, b.h, b.a, Tensor(), Tensor(), q, sc}, s);
    mark(round, "fc2", s);
    quantized_rows_gemm(gw, q, sc, 2, b.recv_out, false, s);
  } else {
    backend_.swiglu_forward({gw, b.h, b.a, Tensor(), Tensor()}, s);
    mark(round, "fc2", s);
    expert_rows_gemm(gw, b.a, 2, b.recv_out, false, s);
  }
  mark(round, "fan_in", s);
  backend_.fan_in(sum, s);
}

void MoeLayer::round_combine(int round, const Tensor& y, int64_t T, const int32_t* accumulate,
                             Stream s, bool join_side) {
  Buffers& b = *buf_;
  mark(round, "combine", s);
  if (join_side) backend_.join_side(s);
  comm_.combine(route(T), RoundWindow{round * capacity_, capacity_}, b.recv_red_sym, y, accumulate,
                b.fan, nullptr, s);
}

void MoeLayer::backward(const Tensor& x, const Tensor& dy, const Tensor& dx, Stream s,
                        int micro_batch) {
  select_micro_batch(micro_batch, "backward");
  check_tensor(x, "x", backend_.activation_dtype(), {fl_->last_tokens, moe_.hidden});
  fl_->last_x = x;
  backward_impl(dy, dx, ExpertGrads{}, s);
}

void MoeLayer::backward_into(const Tensor& x, const Tensor& dy, const Tensor& dx,
                             const ExpertGrads& into, Stream s, int micro_batch) {
  select_micro_batch(micro_batch, "backward_into");
  check_tensor(x, "x", backend_.activation_dtype(), {fl_->last_tokens, moe_.hidden});
  const int64_t EPR = moe_.experts / par_.ep_size, H = moe_.hidden, F = moe_.ffn;
  check_tensor(into.dw1, "dw1", backend_.float_dtype(), {EPR, H, 2 * F});
  check_tensor(into.dw2, "dw2", backend_.float_dtype(), {EPR, F, H});
  MOE_ECHO_CHECK(reinterpret_cast<uintptr_t>(into.dw1.data) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(into.dw2.data) % 16 == 0,
                 "backward_into: dw1 at " << into.dw1.data << " and dw2 at " << into.dw2.data
                                          << " must be 16-byte aligned");
  fl_->last_x = x;
  backward_impl(dy, dx, into, s);
}

Tensor MoeLayer::plan_buffer(int m) const {
  check_micro_batch(m, moe_, "plan_buffer");
  return buf_->micro_batches[size_t(m)].plan;
}
Tensor MoeLayer::losses(int m) const {
  check_micro_batch(m, moe_, "losses");
  return buf_->micro_batches[size_t(m)].losses;
}

void MoeLayer::backward(const Tensor& dy, const Tensor& dx, Stream s, int micro_batch) {
  select_micro_batch(micro_batch, "backward");
  backward_impl(dy, dx, ExpertGrads{}, s);
}

void MoeLayer::begin_backward(const Tensor& dy, const Tensor& dx, const ExpertGrads& into,
                              bool split) {
  const int64_t T = fl_->last_tokens, H = moe_.hidden;
  MOE_ECHO_CHECK(fl_->forward_pending,
                 "backward of micro-batch "
                     << cur_
                     << " without a forward of it before (each "
                        "forward takes one backward; a second backward needs a new forward)");
  check_tensor(dy, "dy", backend_.activation_dtype(), {T, H});
  check_tensor(dx, "dx", backend_.activation_dtype(), {T, H});
  MOE_ECHO_CHECK(!own_slots_ || fl_->placement_epoch == placement_epoch_,
                 "backward of micro-batch "
                     << cur_
                     << ": its forward ran on the clone placement of an earlier step (the expert "
                        "weights changed since: optimizer_step, weights_changed or a view of w1 "
                        "or w2 taken), whose clones the echo slots no longer hold; with "
                        "EchoPlacement::step run a step's backwards before its optimizer step");
  fl_->forward_pending = false;
  fl_->step = Step{};
  fl_->step.x = fl_->last_x;
  fl_->step.dy = dy;
  fl_->step.dx = dx;
  fl_->step.T = T;
  fl_->step.into = into;
  fl_->step.split = split;
  // Expert gradients written elsewhere leave the layer's stale (a later backward() writes them
  // instead of adding to them); the shared experts' stay in the layer and accumulate as usual.
  Step& st = fl_->step;
  st.overwrite_grads = grads_zeroed_ || expert_grads_stale_ || into.dw1.data != nullptr;
  st.overwrite_shared = grads_zeroed_;
  grads_zeroed_ = false;
  expert_grads_stale_ = into.dw1.data != nullptr;
  // Another micro-batch's or layer's forward or backward used the shared echo slots since this
  // micro-batch's forward: pull its clones again.
  st.repull = planner_.spare_slots > 0 && !own_slots_ && !(ws_set().pool_owner == user());
  // Clone gradients held from earlier backwards of the step add up with this one's, so its GEMMs
  // add: home gradients to be written are zeroed first instead.
  if (clone_grads_held_ && st.overwrite_grads) {
    st.zero_home = true;
    st.overwrite_grads = false;
  }
  st.zero_clones =
      slots_ > moe_.experts / par_.ep_size && !st.overwrite_grads && !clone_grads_held_;
  st.reduce_clones = planner_.spare_slots > 0 && !(own_slots_ && hold_clone_grads_);
  clone_grads_held_ = own_slots_ && hold_clone_grads_;
}

void MoeLayer::backward_impl(const Tensor& dy, const Tensor& dx, const ExpertGrads& into,
                             Stream s) {
  check_no_split("backward");
  begin_backward(dy, dx, into, false);
  const Step& st = fl_->step;
  auto ops = [&](Stream g) {
    backward_dispatch_ops(st, g);
    if (chunked_backward(st)) {
      backward_chunks_ops(st, g);
      return;
    }
    backward_experts_ops(st, g);
    backward_combine_ops(st, g);
  };
  if (eager_graphs())
    backend_.enqueue_as_graph(
        fl_->backward_graph,
        {address(st.x.data), address(dy.data), address(dx.data), uint64_t(st.T),
         uint64_t(st.overwrite_grads), uint64_t(st.overwrite_shared), address(into.dw1.data),
         address(into.dw2.data), uint64_t(st.repull), uint64_t(st.zero_home),
         uint64_t(st.zero_clones), uint64_t(st.reduce_clones)},
        ops, s);
  else
    ops(s);
  ws_set().pool_owner = user();
}

void MoeLayer::backward_dispatch(const Tensor& dy, const Tensor& dx, Stream s, int micro_batch) {
  select_micro_batch(micro_batch, "backward_dispatch");
  check_no_split("backward_dispatch");
  check_no_chunks("backward_dispatch");
  begin_backward(dy, dx, ExpertGrads{}, true);
  ws_set().split_owner = user();
  fl_->split_phase = SplitPhase::backward_dispatched;
  enqueue_phase(
      3, [&](Stream g) { backward_dispatch_ops(fl_->step, g); }, s);
  ws_set().pool_owner = user();
}

void MoeLayer::backward_experts(Stream s, int micro_batch) {
  select_micro_batch(micro_batch, "backward_experts");
  expect_phase(SplitPhase::backward_dispatched, "backward_experts");
  fl_->split_phase = SplitPhase::backward_experts_done;
  enqueue_phase(
      4, [&](Stream g) { backward_experts_ops(fl_->step, g); }, s);
}

void MoeLayer::backward_combine(Stream s, int micro_batch) {
  select_micro_batch(micro_batch, "backward_combine");
  expect_phase(SplitPhase::backward_experts_done, "backward_combine");
  enqueue_phase(
      5, [&](Stream g) { backward_combine_ops(fl_->step, g); }, s);
  fl_->split_phase = SplitPhase::none;
  ws_set().split_owner = {};
}

// Round 0 writes dx, spill rounds add to it; then the router adds its part. After zero_grad,
// round 0 also writes the expert gradients of every slot with rows (zero if none are in round
// 0), which the spill rounds then add to; a home slot without rows is zeroed (so discard_grad
// needs no zeroing before), a spare slot without a clone is not read. Otherwise home slots add to
// what earlier backwards left, and clone slots, which hold this step's gradients only, are zeroed
// first. The shared experts (they write dx) run first, on the side stream when asked, joined
// before round 0's combine, which adds into dx; a split backward runs them beside round 0's
// experts phase.
void MoeLayer::backward_dispatch_ops(const Step& st, Stream s) {
  Buffers& b = *buf_;
  if (st.repull) {
    mark("bwd_clone_pull", s);
    pull_clones(s);
    // Precision fp8: the echo slots' e4m3 copies are shared like the slots, so they are made
    // again; the home experts' copies are the layer's own, made in its forward.
    if (fp8_weights(moe_)) quantize_weights(false, true, s);
  }
  mark("bwd_zero_clone_grads", s);
  if (st.zero_clones) {
    backend_.fill_zero(b.dw1_spare, s);
    backend_.fill_zero(b.dw2_spare, s);
  }
  if (st.zero_home) {
    backend_.fill_zero(st.into.dw1.data ? st.into.dw1 : b.dw1, s);
    backend_.fill_zero(st.into.dw2.data ? st.into.dw2 : b.dw2, s);
  }
  const bool shared = b.shared_w1.data != nullptr, side = shared && moe_.shared_side_stream;
  if (side && !shared_beside_experts(st, false))
    backend_.fork_side(
        [&](Stream ss) { shared_backward(st.dy, st.dx, st.T, st.overwrite_shared, ss); }, s);
  else if (shared && !side)
    shared_backward(st.dy, st.dx, st.T, st.overwrite_shared, s);
  if (chunked_backward(st))
    recompute_round(0, st.T, s);
  else
    round_backward_dispatch(0, st.dy, st.T, s);
}

void MoeLayer::backward_experts_ops(const Step& st, Stream s) {
  const bool beside = shared_beside_experts(st, false);
  if (beside)
    backend_.fork_side(
        [&](Stream ss) { shared_backward(st.dy, st.dx, st.T, st.overwrite_shared, ss); }, s);
  round_backward_experts(0, st.overwrite_grads, st.into, s, moe_.overlap == Overlap::wgrad);
  if (beside) backend_.join_side(s);
}

void MoeLayer::backward_combine_ops(const Step& st, Stream s) {
  Buffers& b = *buf_;
  const bool shared = b.shared_w1.data != nullptr, side = shared && moe_.shared_side_stream;
  const int64_t T = st.T;
  const Tensor& dx = st.dx;
  // Overlap::wgrad: round 0's fc1 weight gradient on the side stream beside round 0's combine
  // (and, without spill rounds, the router's backward), joined before the spill rounds, which
  // reuse its operands, or before the clone gradients go home. The shared experts' backward, on
  // the side stream too, is joined first (one fork at a time).
  const bool overlap = moe_.overlap == Overlap::wgrad;
  if (side && !shared_beside_experts(st, false)) backend_.join_side(s);
  if (overlap)
    backend_.fork_side([&](Stream ss) { round_wgrad1(0, st.overwrite_grads, st.into, ss); }, s);
  round_backward_combine(0, dx, T, shared ? b.one.as<int32_t>() : nullptr, s);
  backward_finish_ops(st, overlap, s);
}

// After round 0's combine: the spill rounds, the router's backward, the clone gradients home and
// the bias update. `side_open`: round 0's work forked onto the side stream, joined before the
// spill rounds (which reuse its operands) or, without them, after the router's backward.
void MoeLayer::backward_finish_ops(const Step& st, bool side_open, Stream s) {
  Buffers& b = *buf_;
  const int64_t T = st.T;
  const Tensor& dx = st.dx;
  if (side_open && rounds_ > 1) backend_.join_side(s);
  for (int r = 1; r < rounds_; ++r)
    backend_.run_if(
        b.round_active.as<int32_t>() + r,
        [&, r](Stream bs) {
          round_backward_dispatch(r, st.dy, T, bs);
          round_backward_experts(r, false, st.into, bs);
          round_backward_combine(r, dx, T, b.round_active.as<int32_t>() + r, bs);
        },
        s);

  RouterBackwardArgs rb;
  rb.tensors = router_tensors(b, st.x, T);
  rb.d_topk_weight = b.d_topk_weight.rows(0, T);
  rb.d_weight = b.d_router_weight;
  rb.dx = dx;
  rb.config = router_config(moe_);
  mark("bwd_router", s);
  backend_.router_backward(rb, s);
  if (side_open && rounds_ == 1) backend_.join_side(s);

  if (st.reduce_clones) {
    mark("bwd_clone_reduce", s);
    // The clones of the micro-batch's plan, or with EchoPlacement::step all of the step's (a
    // micro-batch's plan leaves out a clone given no rows, which an earlier one may have had).
    const PlanView plan = plan_view((own_slots_ ? b.step_plan : b.plan).as<int32_t>(), planner_);
    void* home1 = st.into.dw1.data ? st.into.dw1.data : b.dw1.data;
    void* home2 = st.into.dw2.data ? st.into.dw2.data : b.dw2.data;
    comm_.reduce_clone_grads(plan, planner_, b.dw1_spare_sym, home1, b.dw1.row_numel(), b.dw1.dtype,
                             s);
    comm_.reduce_clone_grads(plan, planner_, b.dw2_spare_sym, home2, b.dw2.row_numel(), b.dw2.dtype,
                             s);
  }
  mark("bwd_bias_update", s);
  if (moe_.bias_update)
    backend_.router_bias_update(b.routing_map, b.router_bias, moe_.bias_update_rate, s);
}

// Recomputes what the forward did not keep (recompute_round), then sends the dy rows to the lead
// rows and, per member, d_weight = <dy, out> and d_out = w * dy, in place.
void MoeLayer::round_backward_dispatch(int round, const Tensor& dy, int64_t T, Stream s) {
  Buffers& b = *buf_;
  const size_t row_bytes = size_t(moe_.hidden) * dtype_size(backend_.activation_dtype());
  const RoundWindow win{round * capacity_, capacity_};
  recompute_round(round, T, s);
  mark(round, "bwd_dispatch", s);
  comm_.dispatch(route(T), win, dy.data, row_bytes, b.recv_red_sym, b.fan, s);
  mark(round, "bwd_fan_out", s);
  backend_.fan_out(scatter_args(fan_args(round), b, nullptr), s);
}

// What a round's backward needs that its forward did not keep: everything for a spill round
// (round 0 ran last in the forward), for round 0 what MoeConfig::recompute leaves out.
void MoeLayer::recompute_round(int round, int64_t T, Stream s) {
  Buffers& b = *buf_;
  const GroupWindow gw{RoundWindow{round * capacity_, capacity_}, b.group_offsets.as<int32_t>(),
                       slots_};
  const Recompute rc = round > 0 ? Recompute::dispatch : moe_.recompute;
  if (rc != Recompute::none) mark(round, "bwd_recompute", s);
  if (rc == Recompute::dispatch) dispatch_tokens(round, fl_->last_x, T, s);
  if (rc == Recompute::dispatch || rc == Recompute::experts) fc1_forward(gw, s);
  if (rc != Recompute::none) backend_.swiglu_forward({gw, b.h, b.a, Tensor(), Tensor()}, s);
  if (rc == Recompute::dispatch || rc == Recompute::experts)
    expert_rows_gemm(gw, b.a, 2, b.recv_out, false, s);
}

// fc1's weight gradient from the received rows and dh (dh's columns quantized with its rows by
// the round's dgrad when both of fc1's backward GEMMs are FP8).
void MoeLayer::round_wgrad1(int round, bool overwrite_grads, const ExpertGrads& into, Stream s) {
  Buffers& b = *buf_;
  const GroupWindow gw{RoundWindow{round * capacity_, capacity_}, b.group_offsets.as<int32_t>(),
                       slots_};
  mark(round, "bwd_wgrad_fc1", s);
  const Tensor& dw1 = into.dw1.data ? into.dw1 : b.dw1;
  if (fp8_dispatch(moe_) && uses_fp8(moe_, fp8_gemm::wgrad1)) {
    expert_wgrad(gw, b.recv_xq, b.dh, 1, dw1, overwrite_grads, s, b.recv_xs,
                 dgrad_quantizes_cols(1));
  } else if (fp8_dispatch(moe_)) {
    // A weight gradient in the activation dtype from rows received in e4m3: their values into
    // recv_red (free between the scatter of dy and the fan-in; MoeConfig refuses Overlap::wgrad
    // here, which would run it beside the combine that sends recv_red).
    backend_.dequantize_fp8_rows({b.recv_red, b.recv_xq, b.recv_xs, {}, gw}, s);
    expert_wgrad(gw, b.recv_red, b.dh, 1, dw1, overwrite_grads, s);
  } else {
    expert_wgrad(gw, b.recv_x, b.dh, 1, dw1, overwrite_grads, s, Tensor(), dgrad_quantizes_cols(1));
  }
}

void MoeLayer::round_backward_experts(int round, bool overwrite_grads, const ExpertGrads& into,
                                      Stream s, bool delay_wgrad1) {
  Buffers& b = *buf_;
  const GroupWindow gw{RoundWindow{round * capacity_, capacity_}, b.group_offsets.as<int32_t>(),
                       slots_};
  mark(round, "bwd_dgrad_fc2", s);
  const bool dy_quantized = expert_dgrad(gw, b.recv_out, 2, b.da, s);
  mark(round, "bwd_wgrad_fc2", s);
  expert_wgrad(gw, b.a, b.recv_out, 2, into.dw2.data ? into.dw2 : b.dw2, overwrite_grads, s,
               Tensor(), dy_quantized);
  mark(round, "bwd_swiglu", s);
  backend_.swiglu_backward({gw, b.h, b.a, b.da, b.dh}, s);
  mark(round, "bwd_dgrad_fc1", s);
  expert_dgrad(gw, b.dh, 1, b.recv_out, s);  // dx rows
  // With Overlap::wgrad, round 0's fc1 weight gradient runs later, beside its combine.
  if (!delay_wgrad1) round_wgrad1(round, overwrite_grads, into, s);
  FanArgs sum = fan_args(round);
  sum.weights = Tensor();
  sum.src = b.recv_out;
  sum.dst = b.recv_red;
  mark(round, "bwd_fan_in", s);
  backend_.fan_in(sum, s);
}

void MoeLayer::round_backward_combine(int round, const Tensor& dx, int64_t T,
                                      const int32_t* accumulate, Stream s) {
  Buffers& b = *buf_;
  mark(round, "bwd_combine", s);
  comm_.combine(route(T), RoundWindow{round * capacity_, capacity_}, b.recv_red_sym, dx, accumulate,
                b.fan, b.d_topk_weight.data, s);
}

StepStats MoeLayer::stats(int micro_batch) const {
  const int m = micro_batch < 0 ? last_forward_ : micro_batch;
  check_micro_batch(m, moe_, "stats");
  const StepPart& b = buf_->micro_batches[size_t(m)];
  StepStats st;
  const auto losses = read_tensor(backend_, b.losses);
  st.aux_loss = losses[0];
  st.z_loss = losses[1];
  st.seq_aux_loss = losses[2];
  const int R = par_.ep_size;
  std::vector<int32_t> plan(size_t(plan_ints(planner_)));
  backend_.copy_to_host(plan.data(), b.plan.data, plan.size() * sizeof(int32_t));
  const PlanView pv = plan_view(plan.data(), planner_);
  st.load_before.assign(pv.load_before, pv.load_before + R);
  st.load_after.assign(pv.load_after, pv.load_after + R);
  auto max_over_mean = [](const std::vector<int32_t>& l) {
    double sum = 0, mx = 0;
    for (int32_t v : l) {
      sum += v;
      mx = std::max(mx, double(v));
    }
    return sum > 0 ? mx / (sum / double(l.size())) : 1.0;
  };
  st.max_over_mean_before = max_over_mean(st.load_before);
  st.max_over_mean_after = max_over_mean(st.load_after);
  st.clones = pv.num_clones[0];
  st.placement_kept = !flights_[size_t(m)].placed;
  // Per clone: fc1 and fc2 weights (3 H F values) pulled in, in the activation dtype, and their
  // gradients reduced home, in the float dtype (bf16 in and fp32 home on the CUDA backend).
  const int64_t expert_values = int64_t(3) * moe_.hidden * moe_.ffn;
  st.clone_bytes = st.placement_kept ? 0
                                     : int64_t(st.clones) * expert_values *
                                           int64_t(dtype_size(backend_.activation_dtype()) +
                                                   dtype_size(backend_.float_dtype()));
  // Rows and rounds as the layout computed them on the device: every rank's receive rows, and
  // the rounds some rank has rows in (round 0 and the spill rounds).
  std::vector<int32_t> rank_rows(static_cast<size_t>(R)),
      round_active(static_cast<size_t>(rounds_));
  backend_.copy_to_host(rank_rows.data(), b.rank_rows.data, rank_rows.size() * sizeof(int32_t));
  backend_.copy_to_host(round_active.data(), b.round_active.data,
                        round_active.size() * sizeof(int32_t));
  st.received_rows = rank_rows[size_t(par_.ep_rank)];
  st.overflow_rows = std::max<int64_t>(0, st.received_rows - capacity_);
  for (int32_t v : rank_rows) st.overflow_rows_all += std::max<int64_t>(0, v - capacity_);
  const auto active =
      std::count_if(round_active.begin(), round_active.end(), [](int32_t a) { return a != 0; });
  st.spill_rounds = std::max(0, int(active) - 1);
  // Distinct destination ranks of each token's K rows.
  const int64_t T = flights_[size_t(m)].last_tokens, K = moe_.top_k;
  std::vector<int32_t> dest(static_cast<size_t>(T * K));
  backend_.copy_to_host(dest.data(), b.dest_rank.data, dest.size() * sizeof(int32_t));
  int64_t ranks_sum = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::sort(dest.begin() + t * K, dest.begin() + (t + 1) * K);
    const int n =
        int(std::unique(dest.begin() + t * K, dest.begin() + (t + 1) * K) - (dest.begin() + t * K));
    ranks_sum += n;
    st.ranks_per_token_max = std::max(st.ranks_per_token_max, n);
  }
  st.ranks_per_token_mean = T > 0 ? double(ranks_sum) / double(T) : 0.0;
  st.dispatch_row_bytes =
      fp8_dispatch(moe_) ? fp8_packed_row_bytes(moe_.hidden)
                         : int64_t(moe_.hidden) * int64_t(dtype_size(backend_.activation_dtype()));
  st.dispatch_bytes = ranks_sum * st.dispatch_row_bytes;
  return st;
}

}  // namespace moe_echo
