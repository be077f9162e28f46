// The micro-batch state machine (flight.hpp).
#include "layer/flight.hpp"

#include <string>

#include "moe_echo/error.hpp"

namespace moe_echo {

const char* to_string(FlightCall c) {
  static const char* const names[] = {"forward",          "forward_dispatch", "forward_experts",
                                      "forward_combine",  "backward",         "backward_dispatch",
                                      "backward_experts", "backward_combine"};
  return names[int(c)];
}

bool in_split(FlightState s) {
  return s != FlightState::idle && s != FlightState::awaiting_backward;
}

namespace {

// The table: per call, the states it may start from and the state it leaves.
struct Move {
  FlightCall call;
  FlightState from[2];
  int n_from;
  FlightState to;
};
constexpr FlightState kIdle = FlightState::idle, kAwait = FlightState::awaiting_backward;
constexpr Move kMoves[] = {
    {FlightCall::forward, {kIdle, kAwait}, 2, kAwait},
    {FlightCall::forward_dispatch, {kIdle, kAwait}, 2, FlightState::forward_dispatched},
    {FlightCall::forward_experts,
     {FlightState::forward_dispatched},
     1,
     FlightState::forward_experts_done},
    {FlightCall::forward_combine, {FlightState::forward_experts_done}, 1, kAwait},
    {FlightCall::backward, {kAwait}, 1, kIdle},
    {FlightCall::backward_dispatch, {kAwait}, 1, FlightState::backward_dispatched},
    {FlightCall::backward_experts,
     {FlightState::backward_dispatched},
     1,
     FlightState::backward_experts_done},
    {FlightCall::backward_combine, {FlightState::backward_experts_done}, 1, kIdle},
};

const char* state_words(FlightState s) {
  switch (s) {
    case FlightState::idle:
    case FlightState::awaiting_backward: return "with no split forward or backward under way";
    case FlightState::forward_dispatched: return "after forward_dispatch";
    case FlightState::forward_experts_done: return "after forward_experts";
    case FlightState::backward_dispatched: return "after backward_dispatch";
    case FlightState::backward_experts_done: return "after backward_experts";
  }
  return "?";
}

bool starts(FlightCall c) {
  return c == FlightCall::forward || c == FlightCall::forward_dispatch ||
         c == FlightCall::backward || c == FlightCall::backward_dispatch;
}

}  // namespace

void check_not_split(FlightState s, const char* call, int m) {
  if (!in_split(s)) return;
  const bool forward =
      s == FlightState::forward_dispatched || s == FlightState::forward_experts_done;
  throw Error(std::string(call) + ": micro-batch " + std::to_string(m) +
              " of this layer is between the phases of a split " +
              (forward ? "forward (forward_dispatch without its forward_combine)"
                       : "backward (backward_dispatch without its backward_combine)"));
}

FlightState transition(FlightState s, FlightCall call, int m) {
  const Move& mv = kMoves[int(call)];
  for (int i = 0; i < mv.n_from; ++i)
    if (mv.from[i] == s) return mv.to;
  if (starts(call)) check_not_split(s, to_string(call), m);
  if (starts(call))  // a backward without a forward awaiting it
    throw Error("backward of micro-batch " + std::to_string(m) +
                " without a forward of it before (each forward takes one backward; a second "
                "backward needs a new forward)");
  const FlightCall before = FlightCall(int(call) - 1);
  throw Error(std::string(to_string(call)) + " must follow " + to_string(before) +
              " of this layer and micro-batch; micro-batch " + std::to_string(m) + " is " +
              state_words(s));
}

std::vector<uint64_t> Step::key() const {
  auto address = [](const void* p) { return uint64_t(reinterpret_cast<uintptr_t>(p)); };
  // The gradients' dtype too: the wgrad kernels of a float and an activation-dtype `into` differ.
  return {address(x.data), address(y.data),        address(dy.data),       address(dx.data),
          uint64_t(T),     address(into.dw1.data), address(into.dw2.data), uint64_t(into.dw1.dtype),
          flags.bits()};
}

}  // namespace moe_echo
