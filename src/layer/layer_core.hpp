// What a MoeLayer is made of (MoeLayer holds one): its configs, buffers (buffers.hpp), micro-
// batches in flight (flight.hpp) and the run loop that enqueues a slice of a step schedule
// (schedule.hpp) op by op. The ops (step_ops.cpp) and the expert GEMMs (expert_gemms.cpp) read
// their arguments from the op and the call's Step only.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "layer/buffers.hpp"
#include "layer/flight.hpp"
#include "layer/schedule.hpp"
#include "moe_echo/layer.hpp"

namespace moe_echo {

// The workspace's allocated slots (one set).
struct MoeWorkspace::Buffers {
  SlotBytes size;
  std::array<void*, kSlots> local{};
  std::array<SymmetricBuffer, kSlots> sym{};
  std::vector<void*> owned;
  std::vector<SymmetricBuffer*> symmetric;
  size_t bytes = 0;
};

class LayerCore {
 public:
  LayerCore(MoeLayer& self, Backend& backend, Communicator& comm, const MoeConfig& moe,
            const ParallelConfig& par, const EchoConfig& echo, uint64_t seed, LayerOwns owns,
            MoeWorkspace* workspace);
  ~LayerCore();

  // Call bookkeeping (moe_layer.cpp). `call` runs a forward, a backward or a split phase of
  // micro-batch m; a and b: x and y of a forward, dy and dx of a backward (with `into`:
  // backward_into's gradients), nothing for a later split phase; `name`: the public call's, for
  // errors (the call's own by default).
  void call(FlightCall c, int m, Stream s, const Tensor& a = {}, const Tensor& b = {},
            const MoeLayer::ExpertGrads& into = {}, const char* name = nullptr);
  void select_micro_batch(int m, const char* call);
  // Moves the current micro-batch by `call` (throws when the table does not allow it, or the
  // workspace set is held by another user's split), returning the state it moves to.
  FlightState begin_call(FlightCall call);
  void begin_forward(const Tensor& x, const Tensor& y, bool split);
  // `into`'s shapes, dtype and alignment (backward_into, backward_dispatch with into).
  void check_into(const MoeLayer::ExpertGrads& into, const char* call) const;
  void begin_backward(const Tensor& dy, const Tensor& dx, const MoeLayer::ExpertGrads& into,
                      bool split);
  // The schedule of a call with these flags: built once per distinct flags, then kept.
  const step::Schedule& schedule(const step::Flags& f);
  // Enqueues phase `phase` of the current call's schedule (-1: all of it) on `s`, as a graph of
  // its own where eager steps run as graphs.
  void enqueue(std::unique_ptr<GraphCache>& cache, int phase, Stream s);
  void check_no_split(const char* call, bool workspace = true,
                      bool all_micro_batches = false) const;
  MoeWorkspace::User user() const { return {&self_, cur_}; }
  int set_of(int m) const { return m % ws_->sets(); }
  MoeWorkspace::Set& ws_set() const { return ws_->sets_[size_t(set_of(cur_))]; }
  bool eager_graphs() const { return observer_ == nullptr && comm_.capturable(); }
  void drop_placement() {
    if (placement_held_) ++placement_epoch_;
    placement_held_ = false;
  }
  void quantize_weights(bool home, bool spare, int weights, Stream s);
  bool own_slots() const { return modes_.own_slots; }
  // Precision fp8: the weights some FP8 GEMM reads (bits 1: w1, 2: w2).
  int fp8_weight_bits() const {
    return (uses_fp8(moe_, fp8_gemm::fprop1 | fp8_gemm::dgrad1) ? 1 : 0) |
           (uses_fp8(moe_, fp8_gemm::fprop2 | fp8_gemm::dgrad2) ? 2 : 0);
  }
  void init_parameters(uint64_t seed);
  void refresh_master_weights();

  // The run loop (step_ops.cpp): ops [begin, end) of the schedule on `s`.
  void run(const Step& st, size_t begin, size_t end, Stream s);
  void exec(const step::StepOp& op, const Step& st, Stream s);

  StepPart& part() { return parts_[size_t(cur_)]; }
  const StepPart& part() const { return parts_[size_t(cur_)]; }

  MoeLayer& self_;
  Backend& backend_;
  Communicator& comm_;
  std::unique_ptr<MoeWorkspace> own_workspace_;
  MoeWorkspace* ws_ = nullptr;
  MoeConfig moe_;
  ParallelConfig par_;
  EchoConfig echo_;
  PlannerConfig planner_;
  step::Modes modes_;
  int slots_ = 0;
  int64_t capacity_ = 0;
  int rounds_ = 0;
  PhaseObserver* observer_ = nullptr;
  bool grads_zeroed_ = false;        // zero_grad or discard_grad since the last backward
  bool expert_grads_stale_ = false;  // the last backward wrote the expert gradients elsewhere
  bool expert_grads_ = true;         // dw1 and dw2 in the layer (LayerOwns::expert_grads)
  // EchoPlacement::step: whether the slots hold the clones of this step's placement, which
  // renewal of it is current (a forward records its epoch; its backward needs the same), and
  // the clone gradients' state.
  bool placement_held_ = false;
  int64_t placement_epoch_ = 0;
  bool hold_clone_grads_ = false;
  bool clone_grads_held_ = false;
  bool fp8_weights_stale_ = true;  // precision fp8: home weights changed since quantized
  std::map<uint64_t, step::Schedule> schedules_;  // by Flags::bits
  std::vector<Flight> flights_;
  int cur_ = 0;           // the current micro-batch
  int last_forward_ = 0;  // the micro-batch of the last forward
  Flight* fl_ = nullptr;  // &flights_[cur_]
  LayerTensors w_;
  std::vector<StepPart> parts_;  // [MoeConfig::in_flight]
  std::vector<void*> owned_;
  std::vector<SymmetricBuffer*> symmetric_;
  size_t bytes_ = 0;
};

// Frees what a layer or workspace allocated: the symmetric buffers collectively (locally when a
// peer that failed cannot take part in the collective free), then the owned ones.
void release(Backend& backend, Communicator& comm, const std::vector<SymmetricBuffer*>& symmetric,
             const std::vector<void*>& owned);

}  // namespace moe_echo
