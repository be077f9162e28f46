// The buffer table of a MoE layer (buffers.hpp) and what is derived from it.
#include "layer/buffers.hpp"

#include <algorithm>

#include "moe_echo/backend.hpp"
#include "moe_echo/planner.hpp"

namespace moe_echo {

namespace {

// Round 0's expert activations, and whether a layer keeps each for its backward (its own buffer)
// or leaves it to the workspace (recomputed in the backward).
enum class Act { recv_x, h, a, recv_out };
bool keeps(Recompute r, Act act) {
  switch (act) {
    case Act::recv_x: return !redone(r).dispatch;
    case Act::h: return !redone(r).fc1;
    case Act::a: return !redone(r).swiglu;
    case Act::recv_out: return !redone(r).fc2;
  }
  return true;
}

// The parts each micro-batch in flight has its own of.
bool per_micro_batch(size_t MoeMemory::*part) {
  return part == &MoeMemory::routing || part == &MoeMemory::activations ||
         part == &MoeMemory::temporaries;
}

struct SlotInfo {
  bool symmetric;
  size_t MoeMemory::*part;  // counted in (a workspace's)
};
SlotInfo slot_info(Slot s) {
  switch (s) {
    case Slot::recv_x:
    case Slot::recv_red:
    case Slot::fan_members:
    case Slot::fan_weights:
    case Slot::fan_values: return {true, &MoeMemory::workspace};
    case Slot::recv_out:
    case Slot::h:
    case Slot::a:
    case Slot::da:
    case Slot::dh: return {false, &MoeMemory::workspace};
    case Slot::w1_spare:
    case Slot::w2_spare: return {false, &MoeMemory::echo_slot_weights};
    case Slot::dw1_spare:
    case Slot::dw2_spare: return {true, &MoeMemory::echo_slot_grads};
    default: return {false, &MoeMemory::fp8};
  }
}

// Builds the table: `part(p)` sets the part the rows declared next count in; `own` declares a
// buffer of the layer (micro-batch's when its part is one each micro-batch has), `sym` a
// symmetric one, `ws` a view of a workspace slot, and `at(keep, slot)` the layer's own buffer
// when `keep`, else a view of `slot`.
class Table {
 public:
  explicit Table(std::vector<BufferRow>& rows) : rows_(rows) {}
  void part(size_t MoeMemory::*p) { part_ = p; }
  BufferRow& own(const char* name, Tensor& t, DType dt, std::vector<int64_t> dims,
                 bool zero = false) {
    BufferRow r;
    r.name = name, r.tensor = &t, r.dtype = dt, r.dims = std::move(dims), r.part = part_;
    r.home = per_micro_batch(part_) ? Home::micro_batch : Home::layer;
    r.zero = zero;
    rows_.push_back(std::move(r));
    return rows_.back();
  }
  BufferRow& sym(const char* name, Tensor& t, SymmetricBuffer& sb, DType dt,
                 std::vector<int64_t> dims) {
    BufferRow& r = own(name, t, dt, std::move(dims));
    r.sym = &sb;
    return r;
  }
  BufferRow& ws(const char* name, Tensor* t, Slot slot, DType dt, std::vector<int64_t> dims) {
    BufferRow r;
    r.name = name, r.tensor = t, r.dtype = dt, r.dims = std::move(dims), r.part = part_;
    r.home = Home::workspace, r.slot = slot;
    rows_.push_back(std::move(r));
    return rows_.back();
  }
  BufferRow& at(bool keep, const char* name, Tensor& t, Slot slot, DType dt,
                std::vector<int64_t> dims) {
    return keep ? own(name, t, dt, std::move(dims)) : ws(name, &t, slot, dt, std::move(dims));
  }
  // A weight's e4m3 copies of `slabs` [k, n] slabs: the layer's own, or the four slots from
  // `first` on.
  void fp8_weight(const char* name, Fp8Weight& w, int64_t slabs, int64_t k, int64_t n, bool keep,
                  Slot first) {
    if (slabs == 0) return;
    const int f = int(first);
    at(keep, name, w.q, first, DType::e4m3, {slabs, k, n});
    at(keep, name, w.q_t, Slot(f + 1), DType::e4m3, {slabs, n, k});
    at(keep, name, w.s, Slot(f + 2), DType::f32, {slabs, fp8_tiles(k), fp8_tiles(n)});
    at(keep, name, w.s_t, Slot(f + 3), DType::f32, {slabs, fp8_tiles(n), fp8_tiles(k)});
  }

 private:
  std::vector<BufferRow>& rows_;
  size_t MoeMemory::*part_ = &MoeMemory::params;
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

}  // namespace

size_t BufferRow::bytes() const {
  size_t n = dtype_size(dtype);
  for (int64_t d : dims) n *= size_t(d);
  return n;
}

Tensor BufferRow::view(void* data) const {
  Tensor t(data, dtype, {});
  t.ndim = int(dims.size());
  std::copy(dims.begin(), dims.end(), t.shape.begin());
  return t;
}

bool slot_symmetric(Slot s) { return slot_info(s).symmetric; }

BufferDims::BufferDims(const MoeConfig& m, const ParallelConfig& par, const EchoConfig& echo,
                       DType act_, DType fl_, LayerOwns owns)
    : moe(m),
      act(act_),
      fl(fl_),
      optimizer_state(owns.optimizer_state),
      expert_grads(owns.expert_grads) {
  const PlannerConfig planner = planner_config(m, par, echo);
  T = m.max_tokens, H = m.hidden, F = m.ffn, E = m.experts, K = m.top_k;
  R = par.ep_size, EPR = E / R;
  G = slots_per_rank(m, par, echo);
  cap = capacity_rows(m);
  SP = planner.spare_slots;
  S = shared_width(m);
  rounds = max_rounds(m, par, echo);
  plan_ints = moe_echo::plan_ints(planner);
  max_replicas = planner.max_replicas();
  own_slots = echo.placement == EchoPlacement::step && SP > 0;
}

std::vector<BufferRow> buffer_table(const BufferDims& d, LayerTensors& l, StepPart& p) {
  std::vector<BufferRow> rows;
  Table t(rows);
  const MoeConfig& m = d.moe;
  const DType act = d.act, fl = d.fl, i32 = DType::i32;
  const int64_t T = d.T, H = d.H, F = d.F, E = d.E, K = d.K, R = d.R, EPR = d.EPR, G = d.G,
                cap = d.cap, SP = d.SP, S = d.S;

  // Parameters, gradients (they accumulate in the float dtype) and the layer's echo slots.
  t.part(&MoeMemory::params);
  t.own("router_weight", l.router_weight, fl, {E, H});
  t.own("router_bias", l.router_bias, fl, {E}, true);
  t.part(&MoeMemory::grads);
  t.own("d_router_weight", l.d_router_weight, fl, {E, H}, true);
  t.part(&MoeMemory::params);
  t.sym("w1", l.w1, l.w1_sym, act, {EPR, H, 2 * F}).zero = true;
  t.sym("w2", l.w2, l.w2_sym, act, {EPR, F, H}).zero = true;
  t.part(&MoeMemory::grads);
  if (d.expert_grads) {
    t.own("dw1", l.dw1, fl, {EPR, H, 2 * F}, true);
    t.own("dw2", l.dw2, fl, {EPR, F, H}, true);
  }
  // The echo slots: the layer's own with EchoPlacement::step, else the workspace's pool.
  const bool own = d.own_slots, pool = SP > 0 && !own;
  if (own || pool) {
    t.part(&MoeMemory::echo_slot_weights);
    t.at(own, "w1_spare", p.w1_spare, Slot::w1_spare, act, {SP, H, 2 * F});
    t.at(own, "w2_spare", p.w2_spare, Slot::w2_spare, act, {SP, F, H});
    if (own) t.own("step_plan", l.step_plan, i32, {d.plan_ints});
    t.part(&MoeMemory::echo_slot_grads);
    if (own) {
      t.sym("dw1_spare", p.dw1_spare, p.dw1_spare_sym, fl, {SP, H, 2 * F});
      t.sym("dw2_spare", p.dw2_spare, p.dw2_spare_sym, fl, {SP, F, H});
    } else {
      t.ws("dw1_spare", &p.dw1_spare, Slot::dw1_spare, fl, {SP, H, 2 * F}).sym = &p.dw1_spare_sym;
      t.ws("dw2_spare", &p.dw2_spare, Slot::dw2_spare, fl, {SP, F, H}).sym = &p.dw2_spare_sym;
    }
  }
  t.part(&MoeMemory::optimizer);
  if (d.optimizer_state) {
    t.own("m_router", l.m_router, fl, {E, H}, true);
    t.own("v_router", l.v_router, fl, {E, H}, true);
    t.own("m_w1", l.m_w1, fl, {EPR, H, 2 * F}, true);
    t.own("v_w1", l.v_w1, fl, {EPR, H, 2 * F}, true);
    t.own("m_w2", l.m_w2, fl, {EPR, F, H}, true);
    t.own("v_w2", l.v_w2, fl, {EPR, F, H}, true);
    t.own("optimizer_step", l.optimizer_step, i32, {1}, true);
    if (m.master_weights) {
      t.own("master_w1", l.master_w1, fl, {EPR, H, 2 * F});
      t.own("master_w2", l.master_w2, fl, {EPR, F, H});
    }
  }

  // Routing (each micro-batch's).
  t.part(&MoeMemory::routing);
  t.own("logits", p.logits, fl, {T, E});
  t.own("scores", p.scores, fl, {T, E});
  t.own("topk_idx", p.topk_idx, i32, {T, K});
  t.own("topk_weight", p.topk_weight, fl, {T, K});
  t.own("counts", p.counts, i32, {E}, true);
  t.own("losses", p.losses, fl, {3}, true);
  t.own("routing_map", p.routing_map, i32, {R, E}, true);
  t.own("plan", p.plan, i32, {d.plan_ints}, true);
  t.own("assign", p.assign, i32, {R * E * d.max_replicas});
  t.own("dest_rank", p.dest_rank, i32, {T * K});
  t.own("dest_row", p.dest_row, i32, {T * K});
  t.own("group_offsets", p.group_offsets, i32, {G + 1}, true);
  t.own("rank_rows", p.rank_rows, i32, {R}, true);
  t.own("round_active", p.round_active, i32, {d.rounds}, true);
  if (m.chunks > 1) {
    t.own("chunk_bounds", p.chunk_bounds, i32, {R, m.chunks + 1});
    t.own("chunk_offsets", p.chunk_offsets, i32, {m.chunks, G + 1});
  }

  // Receive windows and round 0's activations: the layer's own where it keeps them for its
  // backward (MoeConfig::recompute), else the workspace's. With the FP8 dispatch recv_x holds
  // the e4m3 rows and their scales, and the packed rows land in recv_red's bytes.
  const Recompute rc = m.recompute;
  const bool fp8x = fp8_dispatch(m);
  t.part(&MoeMemory::activations);
  const DType recv_dt = fp8x ? DType::e4m3 : act;
  const int64_t recv_cols = fp8x ? H + fp8_tiles(H) * 4 : H;
  if (!keeps(rc, Act::recv_x))
    t.ws("recv_x", &p.recv_x, Slot::recv_x, recv_dt, {cap, recv_cols}).sym = &p.recv_x_sym;
  else if (fp8x)  // the packed rows land in recv_red: the rows kept need not be symmetric
    t.own("recv_x", p.recv_x, recv_dt, {cap, recv_cols});
  else
    t.sym("recv_x", p.recv_x, p.recv_x_sym, act, {cap, H});
  t.at(keeps(rc, Act::h), "h", p.h, Slot::h, act, {cap, 2 * F});
  t.at(keeps(rc, Act::a), "a", p.a, Slot::a, act, {cap, F});
  t.at(keeps(rc, Act::recv_out), "recv_out", p.recv_out, Slot::recv_out, act, {cap, H});
  t.ws("recv_red", &p.recv_red, Slot::recv_red, act, {cap, H}).sym = &p.recv_red_sym;
  if (fp8x)
    t.ws("recv_red (fp8 packed rows)", nullptr, Slot::recv_red, DType::e4m3,
         {cap, fp8_packed_row_bytes(H)});
  t.ws("fan_members", &p.fan_members, Slot::fan_members, i32, {cap, K}).sym = &p.fan_members_sym;
  t.ws("fan_weights", &p.fan_weights, Slot::fan_weights, fl, {cap, K}).sym = &p.fan_weights_sym;
  t.ws("fan_values", &p.fan_values, Slot::fan_values, fl, {cap}).sym = &p.fan_values_sym;
  t.ws("da", &p.da, Slot::da, act, {cap, F});
  t.ws("dh", &p.dh, Slot::dh, act, {cap, 2 * F});
  t.part(&MoeMemory::temporaries);
  t.own("d_topk_weight", p.d_topk_weight, fl, {T, K});

  if (S > 0) {  // the shared experts
    t.part(&MoeMemory::params);
    t.own("shared_w1", l.shared_w1, act, {1, H, 2 * S});
    t.own("shared_w2", l.shared_w2, act, {1, S, H});
    t.part(&MoeMemory::grads);
    t.own("d_shared_w1", l.d_shared_w1, fl, {1, H, 2 * S}, true);
    t.own("d_shared_w2", l.d_shared_w2, fl, {1, S, H}, true);
    t.part(&MoeMemory::optimizer);
    if (d.optimizer_state) {
      t.own("m_sw1", l.m_sw1, fl, {1, H, 2 * S}, true);
      t.own("v_sw1", l.v_sw1, fl, {1, H, 2 * S}, true);
      t.own("m_sw2", l.m_sw2, fl, {1, S, H}, true);
      t.own("v_sw2", l.v_sw2, fl, {1, S, H}, true);
      if (m.master_weights) {
        t.own("master_sw1", l.master_sw1, fl, {1, H, 2 * S});
        t.own("master_sw2", l.master_sw2, fl, {1, S, H});
      }
    }
    t.part(&MoeMemory::routing);
    t.own("shared_offsets", p.shared_offsets, i32, {2});
    t.part(&MoeMemory::activations);
    t.own("shared_h", p.shared_h, act, {T, 2 * S});
    t.own("shared_a", p.shared_a, act, {T, S});
    t.part(&MoeMemory::temporaries);
    t.own("shared_da", p.shared_da, act, {T, S});
    t.own("shared_dh", p.shared_dh, act, {T, 2 * S});
    t.own("one", p.one, i32, {1});
  }

  if (m.precision == Precision::fp8) {
    t.part(&MoeMemory::fp8);
    if (fp8_w1(m)) t.fp8_weight("w1_q", l.w1_q, EPR, H, 2 * F, true, Slot::none);
    if (fp8_w2(m)) t.fp8_weight("w2_q", l.w2_q, EPR, F, H, true, Slot::none);
    // The echo slots' copies: the layer's own with its own slots, else the workspace's.
    if (fp8_w1(m) && (own || pool))
      t.fp8_weight("w1_spare_q", p.w1_spare_q, SP, H, 2 * F, own, Slot::w1_spare_q);
    if (fp8_w2(m) && (own || pool))
      t.fp8_weight("w2_spare_q", p.w2_spare_q, SP, F, H, own, Slot::w2_spare_q);
    // The quantized operands of one GEMM: the rows of an activation operand [cap, W] with
    // scales [cap, WT], and wgrad's two transposed operands [W, P] with their scales and padded
    // offsets [G + 1].
    const int64_t W = std::max(H, 2 * F), WT = fp8_tiles(W), P = fp8_padded_rows(cap, G);
    if (fp8_rows(m)) {
      t.ws("row_q", &p.row_q, Slot::row_q, DType::e4m3, {cap, W});
      t.ws("row_s", &p.row_s, Slot::row_s, DType::f32, {cap, WT});
    }
    if (fp8_cols(m)) {
      t.ws("col_a", &p.col_a, Slot::col_a, DType::e4m3, {W, P});
      t.ws("col_as", &p.col_as, Slot::col_as, DType::f32, {W * P / kFp8Tile});
      t.ws("col_b", &p.col_b, Slot::col_b, DType::e4m3, {W, P});
      t.ws("col_bs", &p.col_bs, Slot::col_bs, DType::f32, {W * P / kFp8Tile});
      t.ws("col_po", &p.col_po, Slot::col_po, i32, {G + 1});
      t.ws("col_po2", &p.col_po2, Slot::col_po2, i32, {G + 1});
    }
    if (fp8x) t.ws("x_send", &p.x_send, Slot::x_send, DType::e4m3, {T, fp8_packed_row_bytes(H)});
  }
  return rows;
}

void derive_views(const BufferDims& d, StepPart& p) {
  if (fp8_dispatch(d.moe)) {
    p.recv_xq = Tensor(p.recv_x.data, DType::e4m3, {d.cap, d.H});
    p.recv_xs = Tensor(static_cast<char*>(p.recv_x.data) + d.cap * d.H, DType::f32,
                       {d.cap, fp8_tiles(d.H)});
  }
  p.fan.members = p.fan_members_sym;
  p.fan.weights = p.fan_weights_sym;
  p.fan.values = p.fan_values_sym;
  p.fan.top_k = int(d.K);
  p.fan.float_dtype = d.fl;
}

void SlotBytes::grow(const BufferDims& d) {
  LayerTensors l;
  StepPart p;
  for (const BufferRow& r : buffer_table(d, l, p))
    if (r.home == Home::workspace) {
      size_t& b = bytes[size_t(r.slot)];
      b = std::max(b, r.bytes());
    }
}

MoeMemory SlotBytes::memory() const {
  MoeMemory m;
  for (int s = 0; s < kSlots; ++s) m.*(slot_info(Slot(s)).part) += bytes[size_t(s)];
  return m;
}

size_t SlotBytes::total() const {
  size_t t = 0;
  for (size_t b : bytes) t += b;
  return t;
}

MoeMemory layer_memory(const BufferDims& d) {
  LayerTensors l;
  StepPart p;
  MoeMemory m;
  for (const BufferRow& r : buffer_table(d, l, p)) {
    if (r.home == Home::workspace) continue;
    m.*(r.part) += r.bytes() * size_t(r.home == Home::micro_batch ? d.moe.in_flight : 1);
  }
  return m;
}

}  // namespace moe_echo
