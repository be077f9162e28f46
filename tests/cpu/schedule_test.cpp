// The step schedule (src/layer/schedule.hpp): golden listings of representative configs, and the
// rules every schedule keeps (blocks matched, one fork at a time and joined, split phases that
// hold whole blocks, only side-stream ops on the side stream, no op of a mode that is off), over
// every combination of the modes.
//
// The golden listings live in tests/cpu/golden/schedules/NAME.txt; MOE_ECHO_UPDATE_GOLDEN=1
// rewrites them from the builder (then read the diff: it is the change in what a step runs).
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "layer/schedule.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/layer.hpp"

using namespace moe_echo;
using namespace moe_echo::step;

namespace {

std::string golden_path(const std::string& name) {
  return std::string(MOE_ECHO_GOLDEN_DIR) + "/schedules/" + name + ".txt";
}

void expect_golden(const std::string& name, const Modes& m, const Flags& f) {
  const std::string got = to_string(build_schedule(m, f), f);
  const std::string path = golden_path(name);
  if (std::getenv("MOE_ECHO_UPDATE_GOLDEN")) {
    std::ofstream(path) << got;
    return;
  }
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << "no golden listing " << path << " (MOE_ECHO_UPDATE_GOLDEN=1 writes it)";
  std::stringstream want;
  want << in.rdbuf();
  EXPECT_EQ(got, want.str()) << "the schedule of " << name << " changed; if on purpose, "
                             << "MOE_ECHO_UPDATE_GOLDEN=1 rewrites " << path;
}

// A plain layer: no spill round, no ECHO slots, bf16.
Modes plain() { return Modes{}; }
Flags forward_flags() { return Flags{}; }
Flags backward_flags() {
  Flags f;
  f.backward = true;
  f.overwrite_grads = f.overwrite_shared = true;  // after zero_grad
  f.reduce_clones = false;
  return f;
}
Modes echo(Modes m) {
  m.spare_slots = true;
  return m;
}
Flags echo_backward() {
  Flags f = backward_flags();
  f.reduce_clones = true;
  return f;
}

}  // namespace

TEST(Schedule, PlainStep) {
  expect_golden("plain_forward", plain(), forward_flags());
  expect_golden("plain_backward", plain(), backward_flags());
}

TEST(Schedule, EchoWithSpillRounds) {
  Modes m = echo(plain());
  m.rounds = 3;
  m.bias_update = true;
  expect_golden("spill_echo_forward", m, forward_flags());
  expect_golden("spill_echo_backward", m, echo_backward());
}

TEST(Schedule, Chunks) {
  Modes m = plain();
  m.chunks = 3;
  expect_golden("chunks_forward", m, forward_flags());
  expect_golden("chunks_backward", m, backward_flags());
}

TEST(Schedule, OverlapWgrad) {
  Modes m = plain();
  m.overlap_wgrad = true;
  expect_golden("overlap_wgrad_backward", m, backward_flags());
}

TEST(Schedule, Fp8) {
  Modes m = echo(plain());
  m.fp8 = true;
  m.fp8_gemms = fp8_gemm::all;
  Flags f = forward_flags();
  f.quantize_home = true;
  expect_golden("fp8_forward", m, f);
  expect_golden("fp8_backward", m, echo_backward());
  // FP8 without the FP8 dispatch: fc1's rows cross in bf16, the other GEMMs quantize.
  m.fp8_gemms = fp8_gemm::all & ~fp8_gemm::fprop1;
  expect_golden("fp8_no_dispatch_backward", m, echo_backward());
  // With chunks, a backward with FP8 weight gradients runs whole, and says so.
  m.fp8_gemms = fp8_gemm::all & ~fp8_gemm::fprop1;
  m.chunks = 2;
  expect_golden("fp8_chunks_backward", m, echo_backward());
}

TEST(Schedule, SharedExpertsOnTheSideStream) {
  Modes m = plain();
  m.shared = m.shared_side = true;
  expect_golden("shared_side_forward", m, forward_flags());
  expect_golden("shared_side_backward", m, backward_flags());
  m.rounds = 2;
  expect_golden("shared_side_spill_forward", m, forward_flags());
}

TEST(Schedule, SplitPhases) {
  Modes m = echo(plain());
  m.shared = m.shared_side = true;
  Flags f = forward_flags();
  f.split = true;
  expect_golden("split_forward", m, f);
  Flags b = echo_backward();
  b.split = true;
  expect_golden("split_backward", m, b);
}

TEST(Schedule, MicroBatchInFlight) {
  // Another micro-batch used the echo slots since this one's forward: its clones come back, and
  // its gradients add to the earlier backward's.
  Modes m = echo(plain());
  m.recompute = Recompute::dispatch;
  Flags f = echo_backward();
  f.repull = true;
  f.overwrite_grads = f.overwrite_shared = false;
  f.zero_clones = true;
  expect_golden("in_flight_repull_backward", m, f);
}

TEST(Schedule, StepPlacement) {
  Modes m = echo(plain());
  m.own_slots = true;
  Flags kept = forward_flags();
  kept.place = false;  // a later forward of the step keeps the placement
  expect_golden("step_placement_kept_forward", m, kept);
  Flags held = echo_backward();
  held.reduce_clones = false;  // hold_clone_grads: the clone gradients stay in the slots
  held.overwrite_grads = false;
  held.zero_home = true;
  expect_golden("step_placement_held_backward", m, held);
}

// The same listing from real configs through describe_step.
TEST(Schedule, DescribeStepFromConfigs) {
  MoeConfig moe;
  moe.hidden = 64, moe.ffn = 32, moe.experts = 8, moe.top_k = 2, moe.max_tokens = 32;
  ParallelConfig par{2, 0};
  EchoConfig e;
  e.enabled = false;
  const Modes m = modes_of(moe, par, e);
  EXPECT_FALSE(m.spare_slots);
  EXPECT_EQ(describe_step(moe, par, e, StepCall::forward),
            to_string(build_schedule(m, forward_flags()), forward_flags()));
  EXPECT_EQ(describe_step(moe, par, e, StepCall::backward),
            to_string(build_schedule(m, backward_flags()), backward_flags()));
  EXPECT_EQ(parse_step_call("backward_split"), StepCall::backward_split);
  EXPECT_THROW(parse_step_call("sideways"), ConfigError);
}

namespace {

bool side_op(Op op) {
  switch (op) {
    case Op::gemm:
    case Op::wgrad:
    case Op::swiglu:
    case Op::swiglu_backward:
    case Op::fan_out:
    case Op::fan_in:
    case Op::scatter:
    case Op::dequantize_x:
    case Op::shared_forward:
    case Op::shared_backward:
    case Op::mark: return true;
    default: return false;
  }
}

// The rules every schedule keeps, checked on slice [begin, end) (a whole call, or one phase).
void check_slice(const Schedule& s, size_t begin, size_t end, const std::string& what) {
  int depth_if = 0;
  bool in_fork = false, forked = false;  // inside a fork block; a fork not yet joined
  for (size_t i = begin; i < end; ++i) {
    const StepOp& o = s.ops[i];
    SCOPED_TRACE(what + ", op " + std::to_string(i) + " " + to_string(o.op));
    if (o.op == Op::fork || o.op == Op::if_round) {
      ASSERT_GT(o.end, int(i));
      ASSERT_LT(size_t(o.end), end) << "a block crosses the slice's end";
      EXPECT_EQ(s.ops[size_t(o.end)].op, o.op == Op::fork ? Op::end_fork : Op::end_if);
    }
    switch (o.op) {
      case Op::fork:
        EXPECT_FALSE(forked) << "a second fork before the first was joined";
        EXPECT_FALSE(in_fork);
        in_fork = forked = true;
        break;
      case Op::end_fork: in_fork = false; break;
      case Op::join:
        EXPECT_TRUE(forked) << "a join without a fork";
        EXPECT_FALSE(in_fork);
        forked = false;
        break;
      case Op::if_round:
        EXPECT_FALSE(in_fork);
        EXPECT_GE(o.win.round, 1);
        ++depth_if;
        break;
      case Op::end_if: --depth_if; break;
      default:
        if (in_fork) {
          EXPECT_TRUE(side_op(o.op)) << "not a side-stream op";
        }
        if (depth_if > 0) {
          EXPECT_EQ(o.mark, nullptr) << "a mark inside a spill round";
        }
        if (o.win.chunk >= 0) {
          EXPECT_EQ(o.win.round, 0);
        }
    }
    EXPECT_GE(depth_if, 0);
  }
  EXPECT_EQ(depth_if, 0);
  EXPECT_FALSE(forked) << what << ": a fork left unjoined";
}

}  // namespace

TEST(Schedule, EveryCombinationKeepsTheRules) {
  int checked = 0;
  for (int rounds : {1, 2, 3})
    for (int chunks : {1, 2})
      for (int shared : {0, 1, 2})  // none, on the step's stream, on the side stream
        for (Recompute rc : {Recompute::none, Recompute::moe_act, Recompute::experts,
                             Recompute::dispatch, Recompute::all_but_fc1})
          for (bool overlap : {false, true})
            for (uint32_t fp8 : {0u, fp8_gemm::all, fp8_gemm::all & ~fp8_gemm::fprop1,
                                 fp8_gemm::wgrad1 | fp8_gemm::wgrad2})
              for (int slots : {0, 1, 2})  // none, the pool, the layer's own
                for (int call = 0; call < 4; ++call)
                  for (int variant = 0; variant < 2; ++variant) {
                    Modes m;
                    m.rounds = rounds, m.chunks = chunks;
                    m.shared = shared > 0, m.shared_side = shared == 2;
                    m.recompute = rc, m.overlap_wgrad = overlap;
                    m.fp8 = fp8 != 0, m.fp8_gemms = fp8;
                    m.spare_slots = slots > 0, m.own_slots = slots == 2;
                    Flags f;
                    f.backward = call >= 2, f.split = call % 2 == 1;
                    f.place = variant == 0 || !m.own_slots;
                    f.quantize_home = variant == 0 && m.fp8;
                    f.repull = variant == 1 && m.spare_slots && !m.own_slots;
                    f.overwrite_grads = f.overwrite_shared = variant == 0;
                    f.reduce_clones = m.spare_slots;
                    const Schedule s = build_schedule(m, f);
                    const std::string what = to_string(s, f);
                    check_slice(s, 0, s.ops.size(), what);
                    if (f.split)
                      for (int k = 0; k < 3; ++k)
                        check_slice(s, s.phase[size_t(k)], s.phase[size_t(k) + 1], what);
                    // No op of a mode that is off.
                    const bool chunked =
                        chunks > 1 && !f.split &&
                        !(f.backward && (fp8 & (fp8_gemm::wgrad1 | fp8_gemm::wgrad2)));
                    for (const StepOp& o : s.ops) {
                      bool off = false;
                      off |= rounds == 1 && o.op == Op::if_round;
                      off |=
                          (chunks == 1 || f.split) && (o.op == Op::chunk_plan || o.win.chunk >= 0);
                      off |= !m.fp8 && (o.op == Op::quantize_weights || o.op == Op::quantize_x ||
                                        o.op == Op::fan_out_fp8 || o.op == Op::dequantize_x);
                      off |= !m.fp8 && (o.op == Op::gemm || o.op == Op::wgrad) &&
                             o.form != Form::plain;
                      off |= !m.spare_slots &&
                             (o.op == Op::pull_clones || o.op == Op::reduce_clone_grads);
                      off |=
                          !m.shared && (o.op == Op::shared_forward || o.op == Op::shared_backward);
                      // The side stream: the shared experts, the chunks, overlap wgrad only.
                      off |= o.op == Op::fork && !m.shared_side && !chunked &&
                             !(f.backward && m.overlap_wgrad);
                      EXPECT_FALSE(off) << to_string(o.op) << " in\n" << what;
                    }
                    // Where a backward writing the expert gradients may round them to the
                    // activation dtype (one_gemm_expert_grads), one plain wgrad per fc writes
                    // each and nothing adds to them afterwards.
                    if (one_gemm_expert_grads(m) && f.backward && f.overwrite_grads) {
                      int writes[3] = {0, 0, 0}, others = 0;
                      for (const StepOp& o : s.ops) {
                        if (o.op == Op::wgrad && o.overwrite && o.form == Form::plain)
                          ++writes[o.fc];
                        else if (o.op == Op::wgrad || o.op == Op::reduce_clone_grads ||
                                 o.op == Op::zero_home_grads)
                          ++others;
                      }
                      EXPECT_EQ(writes[1], 1) << what;
                      EXPECT_EQ(writes[2], 1) << what;
                      EXPECT_EQ(others, 0) << what;
                    }
                    EXPECT_EQ(one_gemm_expert_grads(m),
                              rounds == 1 && chunks == 1 && slots == 0 && fp8 == 0);
                    ++checked;
                    if (::testing::Test::HasFailure()) return;
                  }
  EXPECT_GT(checked, 1000);
}
