// The step schedule as text (schedule.hpp): names of the ops, buffers and forms, and the listing
// that moe-echo schedule, describe_step and the golden tests print.
#include <algorithm>
#include <sstream>

#include "layer/schedule.hpp"

namespace moe_echo::step {

const char* to_string(Buf b) {
  static const char* const names[] = {"-",      "x",       "y",        "dy",       "dx", "x_packed",
                                      "recv_x", "recv_xq", "recv_red", "recv_out", "h",  "a",
                                      "da",     "dh",      "dw1",      "dw2"};
  return names[int(b)];
}

const char* to_string(Op op) {
  static const char* const names[] = {"fork",
                                      "end_fork",
                                      "join",
                                      "if_round",
                                      "end_if",
                                      "mark",
                                      "router",
                                      "count_gather",
                                      "plan",
                                      "plan_placed",
                                      "keep_placement",
                                      "layout",
                                      "chunk_plan",
                                      "pull_clones",
                                      "quantize_weights",
                                      "zero_clone_grads",
                                      "zero_home_grads",
                                      "router_backward",
                                      "reduce_clone_grads",
                                      "bias_update",
                                      "shared_forward",
                                      "shared_backward",
                                      "zero_y",
                                      "quantize_x",
                                      "dispatch",
                                      "fan_out",
                                      "fan_out_fp8",
                                      "scatter",
                                      "fan_in",
                                      "combine",
                                      "gemm",
                                      "wgrad",
                                      "swiglu",
                                      "swiglu_backward",
                                      "dequantize_x"};
  return names[int(op)];
}

// The forms as the listing shows them (schedule.hpp says what each means).
const char* to_string(Form f) {
  static const char* const names[] = {"plain",    "fp8",       "fp8:swiglu-rows",
                                      "fp8:recv", "fp8:+cols", "fp8:cols-ready"};
  return names[int(f)];
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
         << " -> " << to_string(o.c) << (o.overwrite ? " write" : " add")
         << (o.zero_clone_slots ? " (empty clone slots zeroed)" : "") << " [" << to_string(o.form)
         << "]";
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
