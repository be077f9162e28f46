// The run loop and the step ops (layer_core.hpp, schedule.hpp): one function per op kind over
// its window, its arguments from the op and the call's Step. No op asks which mode the layer is
// in: the schedule's builder decided (schedule.cpp).
//
// Rows: a token's row crosses to each rank it picks experts on once per window (dispatch into
// the lead row), the receiver fans it out to the other members' rows, runs the experts, and sums
// the members' weighted outputs into the lead row (fan_in); the source sums one row per rank
// (combine). The backward sends dy the same way; the receiver's scatter weights it per member and
// computes the combine-weight gradient there (it holds the expert outputs), fan_in sums the
// members' dx rows, and the combine brings back one dx row per rank and every entry's weight
// gradient.
//
// Rounds: receive buffers hold `capacity` rows. Round r handles receive rows
// [r * capacity, (r + 1) * capacity) of every rank; a spill round runs only when some rank
// received more rows than the rounds before it hold (decided on the device from the routing map,
// which every rank shares, so all ranks take the same branch). Memory is bounded by the capacity
// whatever the routing, and no row is ever dropped.
#include <algorithm>

#include "layer/expert_gemms.hpp"
#include "layer/layer_core.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo {

using step::Buf;
using step::Op;
using step::StepOp;

void LayerCore::run(const Step& st, size_t begin, size_t end, Stream s) {
  const std::vector<StepOp>& ops = st.schedule->ops;
  for (size_t i = begin; i < end; ++i) {
    const StepOp& op = ops[i];
    if (op.mark && observer_) observer_->mark(op.mark, s);
    if (op.op == Op::fork || op.op == Op::if_round) {
      const size_t close = size_t(op.end);
      auto body = [&, i, close](Stream bs) { run(st, i + 1, close, bs); };
      if (op.op == Op::fork)
        backend_.fork_side(body, s);
      else
        backend_.run_if(part().round_active.as<int32_t>() + op.win.round, body, s);
      i = close;
      continue;
    }
    exec(op, st, s);
  }
}

namespace {

// The router's tensors for T tokens of x: the forward writes them, the backward reads them.
RouterTensors router_tensors(const LayerTensors& w, const StepPart& p, const Tensor& x, int64_t T) {
  return RouterTensors{x,
                       w.router_weight,
                       p.logits.rows(0, T),
                       p.scores.rows(0, T),
                       p.topk_idx.rows(0, T),
                       p.topk_weight.rows(0, T),
                       p.counts};
}

}  // namespace

void LayerCore::exec(const StepOp& op, const Step& st, Stream s) {
  const StepPart& p = part();
  const int64_t T = st.T, K = moe_.top_k, H = moe_.hidden;
  const RoundWindow round{op.win.round * capacity_, capacity_};
  const bool chunk = op.win.chunk >= 0;
  // The op's window with its groups (a chunk's own group offsets), and a chunk's rows on this
  // rank (FanArgs::chunk).
  const GroupWindow gw =
      chunk
          ? GroupWindow{round, p.chunk_offsets.as<int32_t>() + int64_t(op.win.chunk) * (slots_ + 1),
                        slots_}
          : GroupWindow{round, p.group_offsets.as<int32_t>(), slots_};
  const int32_t* chunk_rows = chunk ? p.chunk_bounds.as<int32_t>() +
                                          int64_t(par_.ep_rank) * (moe_.chunks + 1) + op.win.chunk
                                    : nullptr;
  auto route = [&] {
    RowRoute r{p.dest_rank.as<int32_t>(), p.dest_row.as<int32_t>(), p.topk_weight.data, T * K,
               int(K)};
    if (chunk) r.chunks = RowChunks{p.chunk_bounds.as<int32_t>(), moe_.chunks, op.win.chunk};
    return r;
  };
  auto fan = [&] {
    FanArgs f;
    f.window = GroupWindow{round, p.group_offsets.as<int32_t>(), slots_};
    f.members = p.fan_members;
    f.weights = p.fan_weights;
    f.chunk = chunk_rows;
    return f;
  };
  auto tensor = [&](Buf b) -> Tensor {
    switch (b) {
      case Buf::x: return st.x;
      case Buf::y: return st.y;
      case Buf::dy: return st.dy;
      case Buf::dx: return st.dx;
      case Buf::x_packed: return fp8_operand(p.x_send, T, fp8_packed_row_bytes(H));
      case Buf::recv_x: return p.recv_x;
      case Buf::recv_xq: return p.recv_xq;
      case Buf::recv_red: return p.recv_red;
      case Buf::recv_out: return p.recv_out;
      case Buf::h: return p.h;
      case Buf::a: return p.a;
      case Buf::da: return p.da;
      case Buf::dh: return p.dh;
      case Buf::dw1: return st.into.dw1.data ? st.into.dw1 : w_.dw1;
      case Buf::dw2: return st.into.dw2.data ? st.into.dw2 : w_.dw2;
      case Buf::none: break;
    }
    return {};
  };
  const ExpertGemms gemms{backend_, w_, p, int(moe_.experts / par_.ep_size), slots_};
  switch (op.op) {
    case Op::fork:
    case Op::end_fork:
    case Op::if_round:
    case Op::end_if:
    case Op::mark: return;
    case Op::join: backend_.join_side(s); return;

    case Op::router: {
      RouterForwardArgs ra;
      ra.tensors = router_tensors(w_, p, st.x, T);
      ra.bias = w_.router_bias;
      ra.losses = p.losses;
      ra.config = router_config(moe_);
      backend_.router_forward(ra, s);
      return;
    }
    case Op::count_gather:
      comm_.all_gather_i32(p.counts.as<int32_t>(), p.routing_map.as<int32_t>(), moe_.experts, s);
      return;
    case Op::plan: backend_.plan(p.routing_map, planner_, echo_.enabled, p.plan, s); return;
    case Op::plan_placed: {
      const PlanView kept = plan_view(w_.step_plan.as<int32_t>(), planner_);
      const Tensor placement(kept.spare_expert, DType::i32,
                             {int64_t(par_.ep_size) * planner_.spare_slots});
      backend_.plan_placed(p.routing_map, planner_, placement, p.plan, s);
      return;
    }
    case Op::keep_placement: backend_.copy(w_.step_plan, p.plan, s); return;
    case Op::layout: {
      LayoutArgs la;
      la.routing_map = p.routing_map;
      la.plan = p.plan;
      la.topk_idx = p.topk_idx.rows(0, T);
      la.assign = p.assign;
      la.dest_rank = p.dest_rank.rows(0, T * K);
      la.dest_row = p.dest_row.rows(0, T * K);
      la.group_offsets = p.group_offsets;
      la.rank_rows = p.rank_rows;
      la.round_active = p.round_active;
      la.planner = planner_;
      la.rank = par_.ep_rank;
      la.slots = slots_;
      la.capacity = capacity_;
      backend_.layout(la, s);
      return;
    }
    case Op::chunk_plan:
      backend_.chunk_plan({p.rank_rows, p.group_offsets, p.chunk_bounds, p.chunk_offsets,
                           par_.ep_rank, 0, capacity_},
                          s);
      return;
    case Op::pull_clones: {
      const PlanView plan = plan_view(p.plan.as<int32_t>(), planner_);
      comm_.pull_clone_weights(plan, planner_, w_.w1_sym, p.w1_spare.data,
                               w_.w1.row_numel() * dtype_size(w_.w1.dtype), s);
      comm_.pull_clone_weights(plan, planner_, w_.w2_sym, p.w2_spare.data,
                               w_.w2.row_numel() * dtype_size(w_.w2.dtype), s);
      return;
    }
    case Op::quantize_weights: quantize_weights(op.home, op.spare, op.fc, s); return;
    case Op::zero_clone_grads:
      backend_.fill_zero(p.dw1_spare, s);
      backend_.fill_zero(p.dw2_spare, s);
      return;
    case Op::zero_home_grads:
      backend_.fill_zero(tensor(Buf::dw1), s);
      backend_.fill_zero(tensor(Buf::dw2), s);
      return;
    case Op::router_backward: {
      RouterBackwardArgs rb;
      rb.tensors = router_tensors(w_, p, st.x, T);
      rb.d_topk_weight = p.d_topk_weight.rows(0, T);
      rb.d_weight = w_.d_router_weight;
      rb.dx = st.dx;
      rb.config = router_config(moe_);
      backend_.router_backward(rb, s);
      return;
    }
    case Op::reduce_clone_grads: {
      // The clones of the micro-batch's plan, or with EchoPlacement::step all of the step's (a
      // micro-batch's plan leaves out a clone given no rows, which an earlier one may have had).
      const PlanView plan =
          plan_view((op.step_plan ? w_.step_plan : p.plan).as<int32_t>(), planner_);
      const Tensor dw1 = tensor(Buf::dw1), dw2 = tensor(Buf::dw2);
      comm_.reduce_clone_grads(plan, planner_, p.dw1_spare_sym, dw1.data, dw1.row_numel(),
                               dw1.dtype, s);
      comm_.reduce_clone_grads(plan, planner_, p.dw2_spare_sym, dw2.data, dw2.row_numel(),
                               dw2.dtype, s);
      return;
    }
    case Op::bias_update:
      backend_.router_bias_update(p.routing_map, w_.router_bias, moe_.bias_update_rate, s);
      return;

    case Op::shared_forward: {  // y = SwiGLU(x W1s) W2s over the T tokens (written)
      if (observer_) observer_->mark("shared_experts", s);
      if (T == 0) return;
      const GroupWindow sw{{0, T}, p.shared_offsets.as<int32_t>(), 1};
      backend_.gemm_fprop({sw, st.x, w_.shared_w1, p.shared_h}, s);
      backend_.swiglu_forward({sw, p.shared_h, p.shared_a, Tensor(), Tensor()}, s);
      backend_.gemm_fprop({sw, p.shared_a, w_.shared_w2, st.y}, s);
      return;
    }
    case Op::shared_backward: {  // dx written; weight gradients added, or written
      if (observer_) observer_->mark("bwd_shared_experts", s);
      if (T == 0) {
        if (op.overwrite) {
          backend_.fill_zero(w_.d_shared_w1, s);
          backend_.fill_zero(w_.d_shared_w2, s);
        }
        return;
      }
      const GroupWindow sw{{0, T}, p.shared_offsets.as<int32_t>(), 1};
      backend_.gemm_dgrad({sw, st.dy, w_.shared_w2, p.shared_da}, s);
      backend_.gemm_wgrad({sw, p.shared_a, st.dy, w_.d_shared_w2, !op.overwrite}, s);
      backend_.swiglu_backward({sw, p.shared_h, p.shared_a, p.shared_da, p.shared_dh}, s);
      backend_.gemm_dgrad({sw, p.shared_dh, w_.shared_w1, st.dx}, s);
      backend_.gemm_wgrad({sw, st.x, p.shared_dh, w_.d_shared_w1, !op.overwrite}, s);
      return;
    }

    case Op::zero_y: backend_.fill_zero(st.y, s); return;
    case Op::quantize_x:
      backend_.quantize_fp8_rows({st.x, Tensor(), Tensor(), tensor(Buf::x_packed)}, s);
      return;
    case Op::dispatch: {
      const Tensor src = tensor(op.a);
      const size_t row_bytes = op.a == Buf::x_packed
                                   ? size_t(fp8_packed_row_bytes(H))
                                   : size_t(H) * dtype_size(backend_.activation_dtype());
      comm_.dispatch(route(), round, src.data, row_bytes,
                     op.c == Buf::recv_x ? p.recv_x_sym : p.recv_red_sym, p.fan, s);
      return;
    }
    case Op::fan_out: {
      FanArgs f = fan();
      f.weights = Tensor();
      f.src = p.recv_x;
      f.dst = p.recv_x;
      backend_.fan_out(f, s);
      return;
    }
    case Op::fan_out_fp8: {
      const int64_t pitch = fp8_packed_row_bytes(H);
      backend_.fan_out_fp8(
          {fan().window, p.fan_members, Tensor(p.recv_red.data, DType::e4m3, {capacity_, pitch}),
           p.recv_xq, p.recv_xs},
          s);
      return;
    }
    case Op::scatter: {
      FanArgs f = fan();
      f.src = p.recv_red;
      f.dst = p.recv_out;
      f.other = p.recv_out;
      f.d_weight = p.fan_values;
      backend_.fan_out(f, s);
      return;
    }
    case Op::fan_in: {
      FanArgs f = fan();
      if (!op.weighted) f.weights = Tensor();
      f.src = tensor(op.a);
      f.dst = tensor(op.c);
      backend_.fan_in(f, s);
      return;
    }
    case Op::combine: {
      const int32_t* active = p.round_active.as<int32_t>();
      const int32_t* accumulate = op.acc == step::Acc::add     ? p.one.as<int32_t>()
                                  : op.acc == step::Acc::spill ? active + 1
                                  : op.acc == step::Acc::round ? active + op.win.round
                                                               : nullptr;
      comm_.combine(route(), round, p.recv_red_sym, tensor(op.c), accumulate, p.fan,
                    op.c == Buf::dx ? p.d_topk_weight.data : nullptr, s);
      return;
    }

    case Op::gemm:
      gemms.rows(gw, op.fc, op.pass, op.form, tensor(op.a),
                 op.a == Buf::recv_xq ? p.recv_xs : Tensor(), tensor(op.c), s);
      return;
    case Op::wgrad:
      gemms.wgrad(gw, op.fc, op.form, tensor(op.a), op.a == Buf::recv_xq ? p.recv_xs : Tensor(),
                  tensor(op.b), tensor(op.c), op.overwrite, op.zero_clone_slots, s);
      return;
    case Op::swiglu:
      if (op.quantize_out) {  // a's FP8 rows for fc2 written by SwiGLU itself
        const int64_t rows = p.a.size(0), F = p.a.size(1);
        backend_.swiglu_forward({gw, p.h, p.a, Tensor(), Tensor(), fp8_operand(p.row_q, rows, F),
                                 fp8_operand(p.row_s, rows, fp8_tiles(F))},
                                s);
      } else {
        backend_.swiglu_forward({gw, p.h, p.a, Tensor(), Tensor()}, s);
      }
      return;
    case Op::swiglu_backward: backend_.swiglu_backward({gw, p.h, p.a, p.da, p.dh}, s); return;
    case Op::dequantize_x:
      backend_.dequantize_fp8_rows({p.recv_red, p.recv_xq, p.recv_xs, {}, gw}, s);
      return;
  }
}

void LayerCore::quantize_weights(bool home, bool spare, int weights, Stream s) {
  const StepPart& p = part();
  if (home && (weights & 1))
    backend_.quantize_fp8_blocks({w_.w1, w_.w1_q.q, w_.w1_q.q_t, w_.w1_q.s, w_.w1_q.s_t}, s);
  if (home && (weights & 2))
    backend_.quantize_fp8_blocks({w_.w2, w_.w2_q.q, w_.w2_q.q_t, w_.w2_q.s, w_.w2_q.s_t}, s);
  if (spare && p.w1_spare.data && (weights & 1))
    backend_.quantize_fp8_blocks(
        {p.w1_spare, p.w1_spare_q.q, p.w1_spare_q.q_t, p.w1_spare_q.s, p.w1_spare_q.s_t}, s);
  if (spare && p.w2_spare.data && (weights & 2))
    backend_.quantize_fp8_blocks(
        {p.w2_spare, p.w2_spare_q.q, p.w2_spare_q.q_t, p.w2_spare_q.s, p.w2_spare_q.s_t}, s);
}

}  // namespace moe_echo
