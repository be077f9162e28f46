// MoeLayer: one dropless MoE layer on one expert-parallel rank, forward and backward, written
// once over the Backend and Communicator interfaces (docs/design.md sections 2, 4 and 5).
//
// Building a layer validates the configs, sizes and allocates its whole workspace (collectively:
// symmetric buffers are registered with the communicator). forward() and backward() allocate
// nothing and never wait on the host; every rank of the layer must call them in the same order.
//
// Gradients accumulate (+=) across backward calls until zero_grad(), in the backend's float dtype.
// Home expert weights are the parameters; spare slots hold clones for one step only and are not
// parameters.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moe_echo/backend.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/config.hpp"
#include "moe_echo/planner.hpp"
#include "moe_echo/tensor.hpp"

namespace moe_echo {

enum class Param {
  router_weight,  // [E, H] float
  router_bias,    // [E] float (aux-loss-free balancing; updated by the layer, no gradient)
  w1,             // [E/R, H, 2F] activation: fc1 of this rank's home experts (gate | up)
  w2,             // [E/R, F, H] activation: fc2 of this rank's home experts
  shared_w1,      // [1, H, 2S] activation: fc1 of the shared experts (S = shared_width), or empty
  shared_w2,      // [1, S, H] activation: fc2 of the shared experts, or empty
};
const char* to_string(Param p);

struct StepStats {
  double aux_loss = 0;  // this rank's aux loss (coefficient applied)
  double z_loss = 0;
  double seq_aux_loss = 0;           // this rank's sequence-level aux loss (coefficient applied)
  std::vector<int32_t> load_before;  // [R] rows each rank would receive without ECHO
  std::vector<int32_t> load_after;   // [R] rows each rank received
  double max_over_mean_before = 0;   // busiest rank over the mean, without ECHO
  double max_over_mean_after = 0;    // ... with this step's plan
  int clones = 0;                    // clones given rows by this forward's plan (all ranks)
  // Clone traffic, all ranks: per clone 3 H F weights in (activation dtype) and 3 H F gradients
  // home (float dtype), so 3 H F (2 + 4) bytes on the CUDA backend (bf16 weights, fp32 gradients).
  // With EchoPlacement::step a step's clones move once: counted on the forward that pulled them
  // (the step's first), 0 on the forwards that kept its placement.
  int64_t clone_bytes = 0;
  // EchoPlacement::step: this forward split its rows over the placement an earlier forward of the
  // step made, and pulled no clone.
  bool placement_kept = false;
  int64_t received_rows = 0;      // rows this rank's experts processed
  int64_t overflow_rows = 0;      // rows beyond this rank's capacity (done in spill rounds)
  int64_t overflow_rows_all = 0;  // the same over all ranks
  int spill_rounds = 0;           // rounds beyond the first (identical on all ranks)
  // Ranks this rank's tokens send rows to (each token once per rank it picks experts on, after
  // ECHO's placement): mean and max over the tokens. Group-limited routing with groups aligned
  // to ranks bounds the max by topk_groups.
  double ranks_per_token_mean = 0;
  int ranks_per_token_max = 0;
  // The forward dispatch of this rank's tokens: bytes per row (H activations; in fp8 the packed
  // e4m3 row, fp8_packed_row_bytes(H)) and bytes sent (a row per token and rank it picks, this
  // rank's own included); the backward sends dy rows of H activations the same way.
  int64_t dispatch_row_bytes = 0;
  int64_t dispatch_bytes = 0;
};

struct AdamWConfig {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

// Sees the phases of a step: the layer calls mark(phase, stream) on the step's stream where each
// phase starts, in a fixed order (see MoeLayer::forward/backward), so that a benchmark can record
// an event per call and time each phase on the device. Spill rounds run inside conditional
// branches and are not marked: their time falls to the phase before them.
class PhaseObserver {
 public:
  virtual ~PhaseObserver() = default;
  virtual void mark(const char* phase, Stream stream) = 0;
};

class MoeLayer;
class LayerCore;

// What MoE layers allocate on one rank, by part, in bytes. Each memory_breakdown below fills the
// parts its memory_bytes counts (a layer's own part leaves workspace and echo slots at 0, a
// workspace only those), and total() is that memory_bytes.
struct MoeMemory {
  size_t params = 0;       // router weight and bias (float dtype), home experts' w1 and w2 and the
                           // shared experts (activation dtype)
  size_t grads = 0;        // their gradients (float dtype; the router bias has none)
  size_t optimizer = 0;    // AdamW m and v (float dtype) and the step count, with optimizer_state
  size_t routing = 0;      // per token and per step: router logits and scores, top-k indices and
                           // weights, routing map, plan, destinations, group offsets, round flags
  size_t activations = 0;  // kept for the backward: round 0's expert activations the layer keeps
                           // (Recompute), the shared experts' fc1 and SwiGLU outputs
  size_t temporaries = 0;  // the layer's own backward temporaries: combine-weight gradients, the
                           // shared experts' activation gradients
  size_t workspace = 0;    // the workspace's buffers but the echo slots: receive windows, fan
                           // table, backward temporaries, the activations no layer keeps
  size_t echo_slot_weights = 0;  // the echo slots: clones' w1 and w2 (activation dtype)
  size_t echo_slot_grads = 0;    // their gradients (float dtype)
  size_t fp8 = 0;  // precision fp8: the e4m3 copies of the home experts' weights (each layer's)
                   // and of the echo slots' (the workspace's, shared like the slots), both
                   // layouts with scales; the GEMM operands of one round (rows and the
                   // transposed, group-padded columns of wgrad) and the packed rows to dispatch

  size_t total() const {
    return params + grads + optimizer + routing + activations + temporaries + workspace +
           echo_slot_weights + echo_slot_grads + fp8;
  }
  MoeMemory& operator+=(const MoeMemory& o);
};

// What the MoE layers of a model on one rank share, used by one layer at a time: the receive
// windows and the fan table, the expert activations of round 0 that a layer does not keep for its
// backward (see Recompute), the backward's temporaries, and the pool of echo slots (the spare
// slots' weights, pulled for a layer's forward and again for its backward when another layer
// used the pool in between, and their gradients, reduced home at the end of each backward).
// Each buffer is sized for the largest need of the layers it was built for. With a layer of
// MoeConfig::in_flight 2 or more, all of it is there twice (two sets: micro-batch m of a layer
// uses set m % 2), so that two micro-batches' split phases may interleave. Building is
// collective across the ranks of `comm` (the receive windows, the fan table and the echo slots'
// gradients are symmetric).
class MoeWorkspace {
 public:
  MoeWorkspace(Backend& backend, Communicator& comm, const std::vector<MoeConfig>& layers,
               const ParallelConfig& par, const EchoConfig& echo);
  ~MoeWorkspace();
  MoeWorkspace(const MoeWorkspace&) = delete;
  MoeWorkspace& operator=(const MoeWorkspace&) = delete;

  size_t bytes() const;  // what it allocated on this rank
  int sets() const { return int(sets_.size()); }
  // The same, before building.
  static size_t memory_bytes(const std::vector<MoeConfig>& layers, const ParallelConfig& par,
                             const EchoConfig& echo, DType activation, DType float_dtype);
  // The same by part (workspace and echo slots).
  static MoeMemory memory_breakdown(const std::vector<MoeConfig>& layers, const ParallelConfig& par,
                                    const EchoConfig& echo, DType activation, DType float_dtype);
  // Sets of buffers built for these layers: 2 when one has in_flight 2 or more, else 1.
  static int sets_for(const std::vector<MoeConfig>& layers);
  Backend& backend() const { return backend_; }
  Communicator& communicator() const { return comm_; }

  struct Buffers;
  // A micro-batch of a layer (MoeConfig::in_flight).
  struct User {
    const MoeLayer* layer = nullptr;
    int micro_batch = 0;
    bool operator==(const User& o) const {
      return layer == o.layer && micro_batch == o.micro_batch;
    }
  };

 private:
  friend class LayerCore;
  struct Set {
    std::unique_ptr<Buffers> buf;
    User pool_owner;  // the micro-batch whose clones the echo slots hold now
    // The micro-batch between its split-phase dispatch and combine (MoeLayer::forward_dispatch):
    // it holds the receive windows and temporaries until then.
    User split_owner;
  };
  Backend& backend_;
  Communicator& comm_;
  ParallelConfig par_;
  EchoConfig echo_;
  std::vector<Set> sets_;
};

// What a MoeLayer allocates beside its parameters and the buffers of its step. A bool converts
// to it (the optimizer state alone, as before).
struct LayerOwns {
  bool optimizer_state = true;  // AdamW's m and v (and master weights) for optimizer_step
  // dw1 and dw2 in the layer. Without them the expert gradients are only written into tensors
  // the caller gives (backward_into, or backward_dispatch with `into`): a plain backward is
  // refused, and grad(w1 or w2) too.
  bool expert_grads = true;
  LayerOwns(bool optimizer = true, bool grads = true)  // NOLINT: converts from a bool
      : optimizer_state(optimizer), expert_grads(grads) {}
};

class MoeLayer {
 public:
  // Validates (throws ConfigError), then allocates everything. Collective across the ranks of
  // `comm`. Parameters are initialised from `seed` per global expert, so any EP layout of the
  // same config and seed holds the same weights. AdamW state (2 floats per parameter) is
  // allocated only with optimizer_state. With a workspace (one built for this layer's config
  // among others, on the same backend and communicator, not owned), the layer uses it for its
  // receive windows, temporaries and echo slots; without, it builds its own.
  MoeLayer(Backend& backend, Communicator& comm, const MoeConfig& moe, const ParallelConfig& par,
           const EchoConfig& echo, uint64_t seed = 1, LayerOwns owns = {},
           MoeWorkspace* workspace = nullptr);
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // x, y: [T, H] activation, T <= max_tokens (T may be 0). Capture-safe, and never waits on the
  // host: outside a capture the step's work is enqueued as one graph (Backend::enqueue_as_graph)
  // when the communicator is capturable and no phase observer is set; otherwise it is enqueued op
  // by op, and on the CUDA backend each possible spill round then reads its flag on the host.
  //
  // micro_batch (0 to MoeConfig::in_flight - 1, every call below takes it): which of the layer's
  // in-flight micro-batches the call is for. Each keeps its own routing, plan and activations
  // from its forward to its backward, so up to in_flight forwards may await their backwards (a
  // pipeline schedule's), in any order; parameters and gradients are shared (the backwards add
  // in the order they run). A forward of a micro-batch replaces what its last forward kept.
  void forward(const Tensor& x, const Tensor& y, Stream stream = nullptr, int micro_batch = 0);
  // Once per forward (throws otherwise), the same way as the forward (graph or op by op).
  // dy: [T, H] for the micro-batch's last forward, whose x must still hold the same values;
  // dx: [T, H] out.
  // Accumulates parameter gradients; the aux and z losses enter with gradient 1. Reduces clone
  // gradients into their home experts and, when enabled, applies the aux-loss-free bias update.
  // Capture-safe.
  void backward(const Tensor& dy, const Tensor& dx, Stream stream = nullptr, int micro_batch = 0);

  // The same, with x given again (a framework that saves x for the backward passes it here): it
  // must have the last forward's shape and values.
  void backward(const Tensor& x, const Tensor& dy, const Tensor& dx, Stream stream = nullptr,
                int micro_batch = 0);

  // The forward and the backward as three calls each, for a framework's schedule that runs other
  // work between them (on its other streams, ordered by its own events):
  // - forward_dispatch(x, y): router, routing map, plan, clone pull, any spill rounds whole (they
  //   add into y), then round 0's token rows sent to their experts' ranks;
  // - forward_experts(): round 0's expert GEMMs and SwiGLU on the rows received (and the shared
  //   experts, beside them on the side stream with MoeConfig::shared_side_stream);
  // - forward_combine(): round 0's outputs back into y.
  // - backward_dispatch(dy, dx): the clones pulled again if another layer used the echo slots,
  //   what MoeConfig::recompute left out recomputed, then round 0's dy rows sent to the experts;
  // - backward_experts(): round 0's input-gradient and weight-gradient GEMMs (and the shared
  //   experts' backward, beside them on the side stream);
  // - backward_combine(): round 0's dx rows back into dx, any spill rounds whole, the router's
  //   backward, the clone gradients reduced home and the bias update.
  // Each call enqueues on its stream and returns, as forward()/backward() do (one graph per phase
  // where they use one); the calls of one split go in this order, once each, and no other
  // forward or backward of a layer sharing this layer's workspace runs between a dispatch and
  // its combine (both throw otherwise: the receive windows and echo slots are in use). The
  // results equal forward() and backward() bit for bit.
  // With in_flight 2 or more, the splits of two micro-batches that use different workspace sets
  // (m % 2) may interleave, e.g. micro-batch 1's forward phases between micro-batch 0's backward
  // phases (a combined 1F1B schedule). Their dispatch and combine phases communicate: enqueue
  // them in the same order on every rank, and all of a layer's phases on one stream (the
  // backend's scratch and the communicator's barriers serve one stream's order).
  void forward_dispatch(const Tensor& x, const Tensor& y, Stream stream = nullptr,
                        int micro_batch = 0);
  void forward_experts(Stream stream = nullptr, int micro_batch = 0);
  void forward_combine(Stream stream = nullptr, int micro_batch = 0);
  void backward_dispatch(const Tensor& dy, const Tensor& dx, Stream stream = nullptr,
                         int micro_batch = 0);
  void backward_experts(Stream stream = nullptr, int micro_batch = 0);
  void backward_combine(Stream stream = nullptr, int micro_batch = 0);

  // Where backward_into puts the home experts' gradients: dw1 [E/R, H, 2F] and dw2 [E/R, F, H],
  // both of the backend's float dtype, in its memory (16-byte aligned on CUDA); or both of its
  // activation dtype where activation_dtype_grads() (each rounded once from the GEMM's fp32 sum,
  // the bits of the float ones cast, without writing or reading those).
  struct ExpertGrads {
    Tensor dw1, dw2;
  };
  // backward(x, dy, dx) that writes this step's home-expert gradients of w1 and w2 into `into`
  // (a framework's fresh gradient tensors) instead of the layer's buffers: written, not added
  // (experts no token picked get zeros; their clones' gradients are reduced into them), so no
  // copy out is needed. The layer's own w1 and w2 gradients are left stale, as after
  // discard_grad; the router weight's gradient accumulates in the layer as in backward().
  void backward_into(const Tensor& x, const Tensor& dy, const Tensor& dx, const ExpertGrads& into,
                     Stream stream = nullptr, int micro_batch = 0);
  // backward_dispatch(dy, dx) whose split backward writes the home-expert gradients into `into`
  // as backward_into does (read by backward_experts and backward_combine, so they must stay
  // alive until backward_combine's work is done).
  void backward_dispatch(const Tensor& dy, const Tensor& dx, const ExpertGrads& into,
                         Stream stream = nullptr, int micro_batch = 0);

  // Device views that each forward of the micro-batch writes (valid until its next forward, read
  // without a sync): the plan (PlanView layout over planner_config(): rank loads before and after
  // ECHO, clones) and the losses [3] float (aux, z, sequence aux; coefficients applied).
  Tensor plan_buffer(int micro_batch = 0) const;
  Tensor losses(int micro_batch = 0) const;

  // Device views of a parameter and its gradient (router_bias has no gradient). With precision
  // fp8, taking the view of w1 or w2 marks their e4m3 copies stale (the caller may write them):
  // the next forward quantizes them again.
  Tensor param(Param p) const;
  // The expert weights were changed through a view taken earlier: with precision fp8 the next
  // forward quantizes them again, and with EchoPlacement::step it plans a new placement and pulls
  // its clones (optimizer_step does both itself). Throws while clone gradients are held.
  void weights_changed();
  // EchoPlacement::step (turning it on with micro_batch throws): while on, a backward leaves
  // its clones' gradients in the layer's echo slots, added to those of the step's earlier
  // backwards, instead of reducing them home; the next backward run with it off reduces all of
  // them home at once (into its home gradients: the layer's, or backward_into's `into`). Turn it
  // on for all but the step's last backward, as with DDP's no_sync. zero_grad drops what is held;
  // optimizer_step and weights_changed refuse to run while gradients are held.
  void hold_clone_grads(bool hold);
  // Clone gradients of earlier backwards wait in the echo slots (EchoPlacement::step).
  bool clone_grads_held() const;
  // The layer holds w1 and w2 gradients of its own (LayerOwns::expert_grads); without them a
  // backward writes them where backward_into's `into` says.
  bool holds_expert_grads() const;
  // Whether backward_into (and backward_dispatch with `into`) takes expert gradients of the
  // activation dtype too: each expert's gradient comes from one GEMM that nothing adds to
  // afterwards (no spill round, no chunks, no echo slots, bf16 precision), so that GEMM writes it
  // rounded. The same for every layer of these configs (before building one).
  bool activation_dtype_grads() const;
  static bool activation_dtype_grads(const MoeConfig& moe, const ParallelConfig& par,
                                     const EchoConfig& echo);
  Tensor grad(Param p) const;
  // Zeroes the gradients. The next backward then writes the expert gradients of its first round
  // instead of adding to zeros (no read of them); a CUDA graph captured from zero_grad through
  // backward keeps that choice, so replay it whole (a backward captured without the zero_grad
  // before it adds, as after any other backward).
  void zero_grad(Stream stream = nullptr);
  // Makes the next backward write the gradients as after zero_grad, without zeroing them first
  // (only the router weight's, which the backward adds to): the expert gradients hold stale values
  // until that backward writes every home expert's, those of experts no token picked as zeros.
  // For a framework that takes the gradients out after each backward.
  void discard_grad(Stream stream = nullptr);
  // The router weight and the shared experts are replicated on every EP rank: sum their gradients
  // over the ranks before the optimizer (a framework that owns data-parallel gradient reduction
  // does this itself).
  void all_reduce_router_grad(Stream stream = nullptr);
  // AdamW on every parameter with a gradient (router weight, home w1, w2, shared experts); with
  // MoeConfig::master_weights on the float masters, the weights written as their rounding. With
  // precision fp8, then the e4m3 copies of the home experts' weights (once per step: forwards
  // quantize only the clones they pull).
  void optimizer_step(const AdamWConfig& cfg, Stream stream = nullptr);
  // With master weights: sets every master to its weight's current value (after the weights were
  // written from outside, e.g. loaded from a checkpoint). Waits for the device.
  void refresh_master_weights();
  // The parameters set again as the constructor sets them from `seed` (per global expert, so
  // any EP layout of the same seed holds the same weights), the router bias zeroed, the masters
  // refreshed, and weights_changed(). Not collective; waits for the device.
  void reset_parameters(uint64_t seed);

  // Marks phases on `observer` from the next call on (nullptr: none); not owned.
  void set_phase_observer(PhaseObserver* observer);

  // Statistics of a micro-batch's last forward (-1: of the last forward of any): the losses, the
  // plan's loads and clones, and the rows and rounds the layout computed. Waits for the device
  // (all work queued on it, as read_tensor does) before copying them to the host, so call it
  // after the step, never inside a capture; the CPU backend has them at once.
  StepStats stats(int micro_batch = -1) const;

  const MoeConfig& moe_config() const;
  const ParallelConfig& parallel_config() const;
  const EchoConfig& echo_config() const;
  const PlannerConfig& planner_config() const;
  int64_t capacity() const;
  int slots() const;
  // Bytes this layer allocated on its rank (parameters, gradients, optimizer state, routing,
  // the activations it keeps for its backward) and those of its workspace when it owns one.
  size_t workspace_bytes() const;
  // The layer's own part alone (without any workspace).
  size_t layer_bytes() const;
  // Before building: what a layer of this config allocates on one rank with its own workspace,
  // and its own part alone (in a model, beside the shared MoeWorkspace).
  static size_t memory_bytes(const MoeConfig& moe, const ParallelConfig& par,
                             const EchoConfig& echo, DType activation, DType float_dtype,
                             LayerOwns owns = {});
  static size_t layer_memory_bytes(const MoeConfig& moe, const ParallelConfig& par,
                                   const EchoConfig& echo, DType activation, DType float_dtype,
                                   LayerOwns owns = {});
  // The same two by part.
  static MoeMemory memory_breakdown(const MoeConfig& moe, const ParallelConfig& par,
                                    const EchoConfig& echo, DType activation, DType float_dtype,
                                    LayerOwns owns = {});
  static MoeMemory layer_memory_breakdown(const MoeConfig& moe, const ParallelConfig& par,
                                          const EchoConfig& echo, DType activation,
                                          DType float_dtype, LayerOwns owns = {});

 private:
  friend class LayerCore;
  std::unique_ptr<LayerCore> core_;
};

// The calls describe_step lists: forward() and backward(), or their split phases.
enum class StepCall { forward, backward, forward_split, backward_split };
const char* to_string(StepCall c);
// Parses "forward", "backward", "forward_split" or "backward_split"; throws ConfigError naming
// `field` otherwise.
StepCall parse_step_call(const std::string& s, const char* field = "call");

// The ops a call of a layer of these configs enqueues, in order, as text: one op a line, those
// on the side stream or inside a spill round's device-conditional block indented under their
// fork or if, a split call's phases named (docs/design.md, "The step schedule"). The forward is
// a step's first (it plans and pulls its clones, and in fp8 quantizes the home weights); the
// backward follows zero_grad. Throws ConfigError on invalid configs.
std::string describe_step(const MoeConfig& moe, const ParallelConfig& par, const EchoConfig& echo,
                          StepCall call);

// The MoE layers of one model on one rank: L layers (each layer's output feeds the next, in the
// caller's hands) sharing one MoeWorkspace, one communicator and one pool of
// echo.spare_slots_per_rank echo slots. Layer l is initialised from seed + l. Every layer runs its
// forward and backward as a MoeLayer does; the backwards go in reverse order of the forwards
// (each layer's backward after its own forward; no other order is needed).
class MoeStack {
 public:
  MoeStack(Backend& backend, Communicator& comm, const std::vector<MoeConfig>& layers,
           const ParallelConfig& par, const EchoConfig& echo, uint64_t seed = 1,
           bool optimizer_state = true);
  ~MoeStack();
  int size() const { return int(layers_.size()); }
  MoeLayer& layer(int l);
  const MoeLayer& layer(int l) const;
  MoeWorkspace& workspace() { return *workspace_; }
  // Bytes allocated on this rank: the workspace and every layer's own part.
  size_t bytes() const;
  // The same, before building.
  static size_t memory_bytes(const std::vector<MoeConfig>& layers, const ParallelConfig& par,
                             const EchoConfig& echo, DType activation, DType float_dtype,
                             LayerOwns owns = {});
  // The same by part: the workspace's and every layer's own parts added up.
  static MoeMemory memory_breakdown(const std::vector<MoeConfig>& layers, const ParallelConfig& par,
                                    const EchoConfig& echo, DType activation, DType float_dtype,
                                    LayerOwns owns = {});

 private:
  std::unique_ptr<MoeWorkspace> workspace_;
  std::vector<std::unique_ptr<MoeLayer>> layers_;
};

}  // namespace moe_echo
