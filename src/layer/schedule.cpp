// The step schedule's builder (schedule.hpp): every decision a mode makes about a step is here.
//
// Order of a forward: the shared experts first (they write y; forked onto the side stream with
// shared_side_stream), the router, the routing map, ECHO's plan, the layout, the clones pulled,
// the spill rounds whole (each inside run_if, adding into y), then round 0 (dispatch, experts,
// combine) last, so that round 0's activations stay in the buffers for the backward; with chunks,
// round 0 as a pipeline of chunks. The backward mirrors it: the shared experts' backward first
// (it writes dx), round 0, the spill rounds (each recomputed), the router's backward, the clone
// gradients home and the bias update.
#include "layer/schedule.hpp"

#include "moe_echo/error.hpp"
#include "moe_echo/planner.hpp"

namespace moe_echo::step {

Modes modes_of(const MoeConfig& moe, const ParallelConfig& par, const EchoConfig& echo) {
  Modes m;
  m.rounds = max_rounds(moe, par, echo);
  m.chunks = moe.chunks;
  m.shared = shared_width(moe) > 0;
  m.shared_side = m.shared && moe.shared_side_stream;
  m.recompute = moe.recompute;
  m.overlap_wgrad = moe.overlap == Overlap::wgrad;
  m.spare_slots = planner_config(moe, par, echo).spare_slots > 0;
  m.own_slots = m.spare_slots && echo.placement == EchoPlacement::step;
  m.fp8 = moe.precision == Precision::fp8;
  m.fp8_gemms = m.fp8 ? moe.fp8_gemms : 0;
  m.bias_update = moe.bias_update;
  return m;
}

bool one_gemm_expert_grads(const Modes& m) {
  return m.rounds == 1 && m.chunks == 1 && !m.spare_slots && !m.fp8;
}

uint64_t Flags::bits() const {
  uint64_t v = 0;
  int i = 0;
  for (bool f : {backward, split, place, quantize_home, repull, overwrite_grads, overwrite_shared,
                 zero_home, zero_clones, reduce_clones})
    v |= uint64_t(f) << i++;
  return v;
}

namespace {

// Appends ops; a mark set by mark() goes on the next op (a second mark first becomes an op of
// its own), and the fork and if blocks are matched.
class Builder {
 public:
  Builder(const Modes& m, const Flags& f) : m_(m), f_(f) {}

  Schedule take() {
    flush_mark();
    MOE_ECHO_CHECK(open_.empty(), "schedule: an unclosed block");
    s_.phase[3] = s_.ops.size();
    for (int k = 1; k < 3; ++k)
      if (s_.phase[size_t(k)] == 0) s_.phase[size_t(k)] = s_.phase[size_t(k) - 1];
    return std::move(s_);
  }

  // Forward and backward.
  void forward();
  void backward();

 private:
  // The FP8 parts of the layer's precision.
  bool fp8_dispatch() const { return m_.uses(fp8_gemm::fprop1); }
  bool fp8_weights() const {
    return m_.uses(fp8_gemm::fprop1 | fp8_gemm::dgrad1 | fp8_gemm::fprop2 | fp8_gemm::dgrad2);
  }
  int fp8_weight_bits() const {
    return (m_.uses(fp8_gemm::fprop1 | fp8_gemm::dgrad1) ? 1 : 0) |
           (m_.uses(fp8_gemm::fprop2 | fp8_gemm::dgrad2) ? 2 : 0);
  }
  // Whether fc's dgrad quantizes its operand's columns for the wgrad too (both FP8).
  bool dgrad_with_cols(int fc) const {
    return fc == 1 ? m_.uses(fp8_gemm::dgrad1) && m_.uses(fp8_gemm::wgrad1)
                   : m_.uses(fp8_gemm::dgrad2) && m_.uses(fp8_gemm::wgrad2);
  }
  bool fp8_wgrads() const { return m_.uses(fp8_gemm::wgrad1 | fp8_gemm::wgrad2); }
  bool chunked_forward() const { return m_.chunks > 1 && !f_.split; }
  // FP8 weight gradients quantize their operands' columns over whole groups, in the dgrads.
  bool chunked_backward() const { return m_.chunks > 1 && !f_.split && !fp8_wgrads(); }

  void mark(const char* name) {
    flush_mark();
    pending_ = name;
  }
  void mark(int round, const char* name) {
    if (round == 0) mark(name);
  }
  void flush_mark() {
    if (!pending_) return;
    StepOp o;
    o.op = Op::mark;
    o.mark = pending_;
    pending_ = nullptr;
    s_.ops.push_back(o);
  }
  StepOp& emit(StepOp o) {
    o.mark = pending_;
    pending_ = nullptr;
    if (o.op == Op::fork || o.op == Op::if_round) open_.push_back(s_.ops.size());
    if (o.op == Op::end_fork || o.op == Op::end_if) {
      MOE_ECHO_CHECK(!open_.empty(), "schedule: an end without its block");
      s_.ops[open_.back()].end = int(s_.ops.size());
      open_.pop_back();
    }
    s_.ops.push_back(o);
    return s_.ops.back();
  }
  StepOp& emit(Op op, Window w = {}) {
    StepOp o;
    o.op = op;
    o.win = w;
    return emit(o);
  }
  void phase_end(int k) {
    flush_mark();
    s_.phase[size_t(k)] = s_.ops.size();
  }
  template <class F>
  void side(F&& body) {
    emit(Op::fork);
    body();
    flush_mark();
    emit(Op::end_fork);
  }
  template <class F>
  void if_round(int r, F&& body) {
    emit(Op::if_round, {r, -1});
    body();
    emit(Op::end_if);
  }
  void gemm(Window w, int fc, Pass pass, Buf a, Buf c, Form form) {
    StepOp& o = emit(Op::gemm, w);
    o.fc = fc, o.pass = pass, o.a = a, o.c = c, o.form = form;
  }
  // The form of a gemm whose rows are quantized when its FP8 bit is on.
  Form rows_form(uint32_t gemm) const { return m_.uses(gemm) ? Form::quantize : Form::plain; }
  void wgrad(Window w, int fc, Buf a, Buf b, bool overwrite, bool cols_ready) {
    StepOp& o = emit(Op::wgrad, w);
    o.fc = fc, o.a = a, o.b = b, o.c = fc == 1 ? Buf::dw1 : Buf::dw2, o.overwrite = overwrite;
    o.zero_clone_slots = overwrite && m_.own_slots;
    const bool fp8 = m_.uses(fc == 1 ? fp8_gemm::wgrad1 : fp8_gemm::wgrad2);
    o.form = !fp8 ? Form::plain : cols_ready ? Form::cols_ready : Form::quantize;
  }
  void fan_in(Window w, Buf a, Buf c, bool weighted) {
    StepOp& o = emit(Op::fan_in, w);
    o.a = a, o.c = c, o.weighted = weighted;
  }
  void dispatch(Window w, Buf a, Buf c) {
    StepOp& o = emit(Op::dispatch, w);
    o.a = a, o.c = c;
  }
  void combine(Window w, Buf c, Acc acc) {
    StepOp& o = emit(Op::combine, w);
    o.a = Buf::recv_red, o.c = c, o.acc = acc;
  }
  void quantize_weights(bool home, bool spare) {
    StepOp& o = emit(Op::quantize_weights);
    o.home = home, o.spare = spare, o.fc = fp8_weight_bits();
  }
  void shared_backward() { emit(Op::shared_backward).overwrite = f_.overwrite_shared; }

  // Forward parts.
  void dispatch_tokens(int r);
  void fc1_forward(Window w) {
    gemm(w, 1, Pass::fprop, fp8_dispatch() ? Buf::recv_xq : Buf::recv_x, Buf::h,
         fp8_dispatch() ? Form::received : Form::plain);
  }
  void experts(Window w);
  void chunks(bool forward, Acc acc);
  // Backward parts.
  void recompute(int r);
  void backward_dispatch(int r);
  void backward_experts(int r, bool overwrite, bool delay_wgrad1);
  void wgrad1(Window w, bool overwrite);
  void chunk_backward(Window w);
  void backward_finish(bool side_open);

  const Modes& m_;
  const Flags& f_;
  Schedule s_;
  const char* pending_ = nullptr;
  std::vector<size_t> open_;
};

// Token rows to the experts of round r's window, expanded to every member row: recv_x. In fp8
// the rows cross quantized (values and scales packed in one row, about half the bytes of bf16):
// x is quantized once per token, the packed rows land in recv_red's bytes and fan out into
// recv_xq, which fc1 reads as it is.
void Builder::dispatch_tokens(int r) {
  const Window w{r, -1};
  if (fp8_dispatch()) {
    mark(r, "fp8_quantize_x");
    emit(Op::quantize_x, w);
    mark(r, "dispatch");
    dispatch(w, Buf::x_packed, Buf::recv_red);
    mark(r, "fan_out");
    emit(Op::fan_out_fp8, w);
    return;
  }
  mark(r, "dispatch");
  dispatch(w, Buf::x, Buf::recv_x);
  mark(r, "fan_out");
  emit(Op::fan_out, w);
}

// fc1, SwiGLU, fc2 and the weighted fan-in over a window (a round, or a chunk of round 0).
void Builder::experts(Window w) {
  const int r = w.round;
  mark(r, "fc1");
  fc1_forward(w);
  mark(r, "swiglu");
  const bool q = m_.uses(fp8_gemm::fprop2);  // a's FP8 rows written by SwiGLU itself
  emit(Op::swiglu, w).quantize_out = q;
  mark(r, "fc2");
  gemm(w, 2, Pass::fprop, Buf::a, Buf::recv_out, q ? Form::quantized : Form::plain);
  mark(r, "fan_in");
  fan_in(w, Buf::recv_out, Buf::recv_red, true);
}

// Round 0 in chunks (MoeConfig::chunks): chunk c's expert work runs on the side stream while
// the step's stream dispatches chunk c + 1 and combines chunk c - 1:
//   s:    d0  d1  J F1  c0  d2  J F2  c1  ...  J  c(C-1)
//   side:         G0        G1            G2  ...
// (F: fork, J: join). The backward's weight gradients run after the last chunk's, over the
// whole window, on the side stream beside the last combine (joined in backward_finish).
void Builder::chunks(bool forward, Acc acc) {
  const Buf out = forward ? Buf::y : Buf::dx;
  for (int c = 0; c < m_.chunks; ++c) {
    mark(forward ? "dispatch" : "bwd_dispatch");
    dispatch({0, c}, forward ? Buf::x : Buf::dy, forward ? Buf::recv_x : Buf::recv_red);
    if (c > 0) emit(Op::join);
    side([&] {
      if (forward) {
        mark("fan_out");
        emit(Op::fan_out, {0, c});
        experts({0, c});
      } else {
        chunk_backward({0, c});
      }
    });
    if (c > 0) {
      mark(forward ? "combine" : "bwd_combine");
      combine({0, c - 1}, out, acc);
    }
  }
  emit(Op::join);
  if (!forward)
    side([&] {
      mark("bwd_wgrad_fc2");
      wgrad({0, -1}, 2, Buf::a, Buf::recv_out, f_.overwrite_grads, false);
      wgrad1({0, -1}, f_.overwrite_grads);
    });
  mark(forward ? "combine" : "bwd_combine");
  combine({0, m_.chunks - 1}, out, acc);
}

void Builder::forward() {
  const bool side_stream = m_.shared_side;
  // A split forward without spill rounds runs the shared experts beside round 0's experts phase
  // (one phase's graph holds both the fork and the join).
  const bool beside = side_stream && f_.split && m_.rounds == 1;
  if (side_stream && !beside)
    side([&] { emit(Op::shared_forward); });
  else if (m_.shared && !side_stream)
    emit(Op::shared_forward);
  mark("router");
  emit(Op::router);
  mark("count_gather");
  emit(Op::count_gather);
  mark("plan");
  emit(m_.own_slots && !f_.place ? Op::plan_placed : Op::plan);
  if (m_.own_slots && f_.place) emit(Op::keep_placement);
  mark("layout");
  emit(Op::layout);
  const bool pull = m_.spare_slots && f_.place;
  if (pull) {
    mark("clone_pull");
    emit(Op::pull_clones);
  }
  if (m_.fp8) {
    mark("fp8_weights");
    quantize_weights(f_.quantize_home, pull);
  }
  // With shared experts every round adds to y. Otherwise spill rounds add into y (zeroed first
  // when there are any); round 0 then adds to them, or writes y when there were none.
  if (side_stream && m_.rounds > 1) emit(Op::join);
  if (m_.rounds > 1) {
    mark("spill_rounds");
    if (!m_.shared) if_round(1, [&] { emit(Op::zero_y); });
  }
  const Acc after_spill = m_.shared ? Acc::add : m_.rounds > 1 ? Acc::spill : Acc::write;
  for (int r = m_.rounds - 1; r >= 1; --r)
    if_round(r, [&] {
      dispatch_tokens(r);
      experts({r, -1});
      combine({r, -1}, Buf::y, Acc::spill);
    });
  if (chunked_forward()) {
    mark("chunk_plan");
    emit(Op::chunk_plan);
    if (side_stream && m_.rounds == 1) emit(Op::join);
    chunks(true, after_spill);
    return;
  }
  dispatch_tokens(0);
  phase_end(1);
  if (beside) side([&] { emit(Op::shared_forward); });
  experts({0, -1});
  if (beside) emit(Op::join);
  phase_end(2);
  mark("combine");
  if (side_stream && m_.rounds == 1 && !beside) emit(Op::join);
  combine({0, -1}, Buf::y, after_spill);
}

// What a round's backward needs that its forward did not keep: everything for a spill round
// (round 0 ran last in the forward), for round 0 what MoeConfig::recompute leaves out.
void Builder::recompute(int r) {
  const Recompute rc = r > 0 ? Recompute::dispatch : m_.recompute;
  const Window w{r, -1};
  const Redone again = redone(rc);
  if (rc != Recompute::none) mark(r, "bwd_recompute");
  if (again.dispatch) dispatch_tokens(r);
  if (again.fc1) fc1_forward(w);
  if (again.swiglu) emit(Op::swiglu, w);
  if (again.fc2) gemm(w, 2, Pass::fprop, Buf::a, Buf::recv_out, rows_form(fp8_gemm::fprop2));
}

// Recomputes, then sends the dy rows to the lead rows and, per member, d_weight = <dy, out> and
// d_out = w * dy.
void Builder::backward_dispatch(int r) {
  recompute(r);
  mark(r, "bwd_dispatch");
  dispatch({r, -1}, Buf::dy, Buf::recv_red);
  mark(r, "bwd_fan_out");
  emit(Op::scatter, {r, -1});
}

// fc1's weight gradient from the received rows and dh (dh's columns quantized with its rows by
// the dgrad before when both of fc1's backward GEMMs are FP8). A bf16 weight gradient from rows
// received in e4m3 reads their values from recv_red (free between the scatter of dy and the
// fan-in; MoeConfig refuses Overlap::wgrad there, which would run it beside the combine that
// sends recv_red).
void Builder::wgrad1(Window w, bool overwrite) {
  mark(w.round, "bwd_wgrad_fc1");
  const bool cols = dgrad_with_cols(1);
  if (fp8_dispatch() && m_.uses(fp8_gemm::wgrad1)) {
    wgrad(w, 1, Buf::recv_xq, Buf::dh, overwrite, cols);
  } else if (fp8_dispatch()) {
    emit(Op::dequantize_x, w);
    wgrad(w, 1, Buf::recv_red, Buf::dh, overwrite, false);
  } else {
    wgrad(w, 1, Buf::recv_x, Buf::dh, overwrite, cols);
  }
}

Form dgrad_form(bool with_cols, bool fp8) {
  return with_cols ? Form::with_cols : fp8 ? Form::quantize : Form::plain;
}

void Builder::backward_experts(int r, bool overwrite, bool delay_wgrad1) {
  const Window w{r, -1};
  mark(r, "bwd_dgrad_fc2");
  const bool cols2 = dgrad_with_cols(2);
  gemm(w, 2, Pass::dgrad, Buf::recv_out, Buf::da, dgrad_form(cols2, m_.uses(fp8_gemm::dgrad2)));
  mark(r, "bwd_wgrad_fc2");
  wgrad(w, 2, Buf::a, Buf::recv_out, overwrite, cols2);
  mark(r, "bwd_swiglu");
  emit(Op::swiglu_backward, w);
  mark(r, "bwd_dgrad_fc1");
  gemm(w, 1, Pass::dgrad, Buf::dh, Buf::recv_out,
       dgrad_form(dgrad_with_cols(1), m_.uses(fp8_gemm::dgrad1)));  // dx rows
  // With Overlap::wgrad, round 0's fc1 weight gradient runs later, beside its combine.
  if (!delay_wgrad1) wgrad1(w, overwrite);
  mark(r, "bwd_fan_in");
  fan_in(w, Buf::recv_out, Buf::recv_red, false);
}

// A chunk's backward: its dy scatter, dgrads and fan-in; fc1's dgrad writes its dx rows into
// recv_red (recv_out keeps d_out for fc2's weight gradient) and the fan-in sums them in place.
void Builder::chunk_backward(Window w) {
  mark("bwd_fan_out");
  emit(Op::scatter, w);
  mark("bwd_dgrad_fc2");
  gemm(w, 2, Pass::dgrad, Buf::recv_out, Buf::da, rows_form(fp8_gemm::dgrad2));
  mark("bwd_swiglu");
  emit(Op::swiglu_backward, w);
  mark("bwd_dgrad_fc1");
  gemm(w, 1, Pass::dgrad, Buf::dh, Buf::recv_red, rows_form(fp8_gemm::dgrad1));
  mark("bwd_fan_in");
  fan_in(w, Buf::recv_red, Buf::recv_red, false);
}

// After round 0's combine: the spill rounds, the router's backward, the clone gradients home and
// the bias update. `side_open`: round 0's work forked onto the side stream, joined before the
// spill rounds (which reuse its operands) or, without them, after the router's backward.
void Builder::backward_finish(bool side_open) {
  if (side_open && m_.rounds > 1) emit(Op::join);
  for (int r = 1; r < m_.rounds; ++r)
    if_round(r, [&] {
      backward_dispatch(r);
      backward_experts(r, false, false);
      combine({r, -1}, Buf::dx, Acc::round);
    });
  mark("bwd_router");
  emit(Op::router_backward);
  if (side_open && m_.rounds == 1) emit(Op::join);
  if (f_.reduce_clones) {
    mark("bwd_clone_reduce");
    emit(Op::reduce_clone_grads).step_plan = m_.own_slots;
  }
  mark("bwd_bias_update");
  if (m_.bias_update) emit(Op::bias_update);
}

// Round 0 writes dx, spill rounds add to it; then the router adds its part. The shared experts
// (they write dx) run first, on the side stream when asked, joined before round 0's combine,
// which adds into dx; a split backward runs them beside round 0's experts phase.
void Builder::backward() {
  if (f_.repull) {
    mark("bwd_clone_pull");
    emit(Op::pull_clones);
    // The echo slots' e4m3 copies are shared like the slots, so they are made again; the home
    // experts' copies are the layer's own, made in its forward.
    if (fp8_weights()) quantize_weights(false, true);
  }
  mark("bwd_zero_clone_grads");
  if (f_.zero_clones) emit(Op::zero_clone_grads);
  if (f_.zero_home) emit(Op::zero_home_grads);
  const bool side_stream = m_.shared_side, beside = side_stream && f_.split;
  if (side_stream && !beside)
    side([&] { shared_backward(); });
  else if (m_.shared && !side_stream)
    shared_backward();
  if (chunked_backward()) {
    recompute(0);
    if (side_stream) emit(Op::join);  // before the chunks take the side stream
    chunks(false, m_.shared ? Acc::add : Acc::write);
    backward_finish(true);
    return;
  }
  if (m_.chunks > 1 && !f_.split)
    s_.note = "chunks: this backward runs whole (its FP8 weight gradients quantize whole groups)";
  backward_dispatch(0);
  phase_end(1);
  if (beside) side([&] { shared_backward(); });
  backward_experts(0, f_.overwrite_grads, m_.overlap_wgrad);
  if (beside) emit(Op::join);
  phase_end(2);
  // Overlap::wgrad: round 0's fc1 weight gradient on the side stream beside round 0's combine
  // (and, without spill rounds, the router's backward), joined before the spill rounds, which
  // reuse its operands, or before the clone gradients go home. The shared experts' backward, on
  // the side stream too, is joined first (one fork at a time).
  if (side_stream && !beside) emit(Op::join);
  if (m_.overlap_wgrad) side([&] { wgrad1({0, -1}, f_.overwrite_grads); });
  mark("bwd_combine");
  combine({0, -1}, Buf::dx, m_.shared ? Acc::add : Acc::write);
  backward_finish(m_.overlap_wgrad);
}

}  // namespace

Schedule build_schedule(const Modes& modes, const Flags& flags) {
  Builder b(modes, flags);
  if (flags.backward)
    b.backward();
  else
    b.forward();
  return b.take();
}

}  // namespace moe_echo::step
