// A micro-batch in flight: the state of its forward and backward as a small state machine (the
// calls a micro-batch takes and the states they move it between, in one table), the arguments
// of its current call (Step) and the graph key that comes from them.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "layer/schedule.hpp"
#include "moe_echo/backend.hpp"
#include "moe_echo/layer.hpp"

namespace moe_echo {

// The calls that move a micro-batch (MoeLayer's forward, backward and their split phases).
enum class FlightCall : uint8_t {
  forward,
  forward_dispatch,
  forward_experts,
  forward_combine,
  backward,
  backward_dispatch,
  backward_experts,
  backward_combine,
};
const char* to_string(FlightCall c);

enum class FlightState : uint8_t {
  idle,                   // no forward awaits its backward
  forward_dispatched,     // between forward_dispatch and forward_experts
  forward_experts_done,   // between forward_experts and forward_combine
  awaiting_backward,      // a forward whose backward has not run yet
  backward_dispatched,    // between backward_dispatch and backward_experts
  backward_experts_done,  // between backward_experts and backward_combine
};
// Between the phases of a split forward or backward.
bool in_split(FlightState s);

// The state `call` moves micro-batch m from `s` to; throws Error naming the call, the
// micro-batch and what it must follow when the table does not allow it.
FlightState transition(FlightState s, FlightCall call, int m);
// Throws Error naming `call` when micro-batch m in state `s` is between split phases.
void check_not_split(FlightState s, const char* call, int m);

// A call's arguments, kept from its first phase to the next ones, and its flags.
struct Step {
  Tensor x, y, dy, dx;
  int64_t T = 0;
  MoeLayer::ExpertGrads into;  // backward_into's gradients, or empty
  step::Flags flags;
  const step::Schedule* schedule = nullptr;  // the layer's, for these flags (LayerCore::schedule)
  // Everything the call's work depends on that may change between calls: the graph key of
  // Backend::enqueue_as_graph (the schedule is a function of the flags and the layer's modes).
  std::vector<uint64_t> key() const;
};

// A micro-batch's host state (MoeConfig::in_flight of them).
struct Flight {
  FlightState state = FlightState::idle;
  std::unique_ptr<GraphCache> forward_graph, backward_graph;
  std::unique_ptr<GraphCache> phase_graphs[6];  // the split phases, in call order
  Step step;
  int64_t last_tokens = 0;
  Tensor last_x;
  int64_t placement_epoch = 0;  // EchoPlacement::step: the placement its forward used
  bool placed = true;           // its forward planned a placement and pulled the clones
};

}  // namespace moe_echo
