// The step schedule as text (schedule.hpp): names of the ops, buffers and forms, and the listing
// that moe-echo schedule, describe_step and the golden tests print.
#include <algorithm>
#include <sstream>

#include "layer/schedule.hpp"

namespace moe_echo::step {

const char* to_string(Buf b) {
  switch (b) {
    case Buf::none: return "-";
    case Buf::x: return "x";
    case Buf::y: return "y";
    case Buf::dy: return "dy";
    case Buf::dx: return "dx";
    case Buf::x_packed: return "x_packed";
    case Buf::recv_x: return "recv_x";
    case Buf::recv_xq: return "recv_xq";
    case Buf::recv_red: return "recv_red";
    case Buf::recv_out: return "recv_out";
    case Buf::h: return "h";
    case Buf::a: return "a";
    case Buf::da: return "da";
    case Buf::dh: return "dh";
    case Buf::dw1: return "dw1";
    case Buf::dw2: return "dw2";
  }
  return "?";
}

const char* to_string(Op op) {
  switch (op) {
    case Op::fork: return "fork";
    case Op::end_fork: return "end_fork";
    case Op::join: return "join";
    case Op::if_round: return "if_round";
    case Op::end_if: return "end_if";
    case Op::mark: return "mark";
    case Op::router: return "router";
    case Op::count_gather: return "count_gather";
    case Op::plan: return "plan";
    case Op::plan_placed: return "plan_placed";
    case Op::keep_placement: return "keep_placement";
    case Op::layout: return "layout";
    case Op::chunk_plan: return "chunk_plan";
    case Op::pull_clones: return "pull_clones";
    case Op::quantize_weights: return "quantize_weights";
    case Op::zero_clone_grads: return "zero_clone_grads";
    case Op::zero_home_grads: return "zero_home_grads";
    case Op::router_backward: return "router_backward";
    case Op::reduce_clone_grads: return "reduce_clone_grads";
    case Op::bias_update: return "bias_update";
    case Op::shared_forward: return "shared_forward";
    case Op::shared_backward: return "shared_backward";
    case Op::zero_y: return "zero_y";
    case Op::quantize_x: return "quantize_x";
    case Op::dispatch: return "dispatch";
    case Op::fan_out: return "fan_out";
    case Op::fan_out_fp8: return "fan_out_fp8";
    case Op::scatter: return "scatter";
    case Op::fan_in: return "fan_in";
    case Op::combine: return "combine";
    case Op::gemm: return "gemm";
    case Op::wgrad: return "wgrad";
    case Op::swiglu: return "swiglu";
    case Op::swiglu_backward: return "swiglu_backward";
    case Op::dequantize_x: return "dequantize_x";
  }
  return "?";
}

const char* to_string(Form f) {
  switch (f) {
    case Form::plain: return "plain";
    case Form::quantize: return "fp8";
    case Form::quantized: return "fp8 rows from swiglu";
    case Form::received: return "fp8 rows received";
    case Form::with_cols: return "fp8 with the wgrad's columns";
    case Form::cols_ready: return "fp8 b's columns from the dgrad";
  }
  return "?";
}

namespace {

std::string window(const Window& w) {
  std::string s = "r" + std::to_string(w.round);
  if (w.chunk >= 0) s += " chunk " + std::to_string(w.chunk);
  return s;
}

const char* acc_name(Acc a) {
  switch (a) {
    case Acc::write: return "write";
    case Acc::add: return "add";
    case Acc::spill: return "add if spilled";
    case Acc::round: return "add";
  }
  return "?";
}

// One op's line (without indentation).
std::string line(const StepOp& o) {
  std::ostringstream os;
  os << to_string(o.op);
  switch (o.op) {
    case Op::if_round: os << " " << o.win.round; break;
    case Op::quantize_weights:
      os << (o.home ? " home" : "") << (o.spare ? " spare" : "")
         << ((o.home || o.spare) && o.fc ? "" : " (none)");
      if (o.home || o.spare) os << ((o.fc & 1) ? " w1" : "") << ((o.fc & 2) ? " w2" : "");
      break;
    case Op::reduce_clone_grads:
      os << (o.step_plan ? " of the step's placement" : "") << " -> dw1, dw2";
      break;
    case Op::shared_backward: os << (o.overwrite ? " write" : " add"); break;
    case Op::quantize_x:
    case Op::fan_out:
    case Op::fan_out_fp8:
    case Op::scatter:
    case Op::swiglu_backward:
    case Op::dequantize_x: os << " " << window(o.win); break;
    case Op::swiglu:
      os << " " << window(o.win) << (o.quantize_out ? " (+ fp8 rows for fc2)" : "");
      break;
    case Op::dispatch:
      os << " " << window(o.win) << " " << to_string(o.a) << " -> " << to_string(o.c);
      break;
    case Op::fan_in:
      os << " " << window(o.win) << " " << to_string(o.a) << " -> " << to_string(o.c)
         << (o.weighted ? " weighted" : "");
      break;
    case Op::combine:
      os << " " << window(o.win) << " " << to_string(o.a) << " -> " << to_string(o.c) << " "
         << acc_name(o.acc);
      break;
    case Op::gemm:
      os << " fc" << o.fc << (o.pass == Pass::fprop ? " fprop " : " dgrad ") << window(o.win) << " "
         << to_string(o.a) << " -> " << to_string(o.c) << " [" << to_string(o.form) << "]";
      break;
    case Op::wgrad:
      os << " fc" << o.fc << " " << window(o.win) << " " << to_string(o.a) << ", " << to_string(o.b)
         << " -> " << to_string(o.c) << (o.overwrite ? " write" : " add") << " ["
         << to_string(o.form) << "]";
      break;
    case Op::mark: os << " " << o.mark; break;
    default: break;
  }
  return os.str();
}

}  // namespace

std::string to_string(const Schedule& s, const Flags& f) {
  static const char* const forward_phases[] = {"forward_dispatch", "forward_experts",
                                               "forward_combine"};
  static const char* const backward_phases[] = {"backward_dispatch", "backward_experts",
                                                "backward_combine"};
  std::ostringstream os;
  const auto ops =
      std::count_if(s.ops.begin(), s.ops.end(), [](const StepOp& o) { return o.op != Op::mark; });
  os << (f.backward ? "backward" : "forward") << (f.split ? " (split)" : "") << ": " << ops
     << " ops\n";
  if (!s.note.empty()) os << "# " << s.note << "\n";
  int depth = 0;
  for (size_t i = 0; i < s.ops.size(); ++i) {
    if (f.split)
      for (int k = 0; k < 3; ++k)
        if (s.phase[size_t(k)] == i && (k == 0 || s.phase[size_t(k)] != s.phase[size_t(k) - 1]))
          os << "-- " << (f.backward ? backward_phases : forward_phases)[k] << "\n";
    const StepOp& o = s.ops[i];
    if (o.op == Op::mark) continue;  // a phase mark only (PhaseObserver)
    if (o.op == Op::end_fork || o.op == Op::end_if) --depth;
    os << std::string(size_t(2 * depth), ' ') << line(o) << "\n";
    if (o.op == Op::fork || o.op == Op::if_round) ++depth;
  }
  return os.str();
}

}  // namespace moe_echo::step
