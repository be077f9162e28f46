// MoeLayer's public API (layer.hpp) over its LayerCore: each forward, backward or split phase
// checks its arguments and the micro-batch's state (flight.hpp), sets the call's flags from the
// layer's state, builds the call's schedule (schedule.hpp) and enqueues the slice of it that the
// call runs (one graph per call where eager steps run as graphs).
#include "moe_echo/layer.hpp"

#include <algorithm>

#include "layer/layer_core.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"

namespace moe_echo {

const char* to_string(Param p) {
  static const char* const names[] = {"router_weight", "router_bias", "w1", "w2",
                                      "shared_w1",     "shared_w2"};
  return names[int(p)];
}

const char* to_string(StepCall c) {
  static const char* const names[] = {"forward", "backward", "forward_split", "backward_split"};
  return names[int(c)];
}

StepCall parse_step_call(const std::string& s, const char* field) {
  for (StepCall c :
       {StepCall::forward, StepCall::backward, StepCall::forward_split, StepCall::backward_split})
    if (s == to_string(c)) return c;
  throw ConfigError(field, std::string(field) + " = '" + s +
                               "' is invalid: allowed 'forward', 'backward', 'forward_split' or "
                               "'backward_split'");
}

std::string describe_step(const MoeConfig& moe, const ParallelConfig& par, const EchoConfig& echo,
                          StepCall call) {
  validate(moe, par, echo);
  const step::Modes modes = step::modes_of(moe, par, echo);
  step::Flags f;
  f.backward = call == StepCall::backward || call == StepCall::backward_split;
  f.split = call == StepCall::forward_split || call == StepCall::backward_split;
  f.quantize_home =
      uses_fp8(moe, fp8_gemm::fprop1 | fp8_gemm::dgrad1 | fp8_gemm::fprop2 | fp8_gemm::dgrad2);
  f.overwrite_grads = f.overwrite_shared = true;  // after zero_grad
  f.reduce_clones = modes.spare_slots;
  return step::to_string(step::build_schedule(modes, f), f);
}

MoeLayer::MoeLayer(Backend& backend, Communicator& comm, const MoeConfig& moe,
                   const ParallelConfig& par, const EchoConfig& echo, uint64_t seed, LayerOwns owns,
                   MoeWorkspace* workspace)
    : core_(std::make_unique<LayerCore>(*this, backend, comm, moe, par, echo, seed, owns,
                                        workspace)) {}

MoeLayer::~MoeLayer() = default;

// ---- Calls and their states ---------------------------------------------------------------

void LayerCore::select_micro_batch(int m, const char* call) {
  MOE_ECHO_CHECK(m >= 0 && m < moe_.in_flight,
                 call << ": micro_batch = " << m << " is invalid: allowed 0 to "
                      << moe_.in_flight - 1 << " (MoeConfig::in_flight = " << moe_.in_flight
                      << ")");
  cur_ = m;
  fl_ = &flights_[size_t(m)];
  backend_.set_lane(set_of(m));  // the backend's resources of this workspace set
}

FlightState LayerCore::begin_call(FlightCall call) {
  const FlightState next = transition(fl_->state, call, cur_);
  if (call == FlightCall::forward || call == FlightCall::forward_dispatch ||
      call == FlightCall::backward || call == FlightCall::backward_dispatch)
    check_no_split(to_string(call));
  if ((call == FlightCall::forward_dispatch || call == FlightCall::backward_dispatch))
    MOE_ECHO_CHECK(moe_.chunks == 1,
                   to_string(call)
                       << ": MoeConfig::chunks = " << moe_.chunks
                       << " overlaps round 0's dispatch and combine with its GEMMs inside "
                          "forward() and backward(); the split-phase calls leave overlap to the "
                          "caller's schedule: build the layer with chunks = 1 to use them");
  return next;
}

void LayerCore::check_no_split(const char* call, bool workspace, bool all_micro_batches) const {
  for (int m = 0; m < moe_.in_flight; ++m) {
    if (m != cur_ && !all_micro_batches) continue;
    check_not_split(flights_[size_t(m)].state, call, m);
  }
  const MoeWorkspace::User owner = ws_set().split_owner;
  if (!workspace || owner.layer == nullptr || owner == user()) return;
  if (owner.layer == &self_)
    throw Error(std::string(call) + ": micro-batch " + std::to_string(owner.micro_batch) +
                " of this layer, sharing micro-batch " + std::to_string(cur_) +
                "'s workspace set (micro_batch % 2), is between the phases of a split forward or "
                "backward (the set's receive windows and echo slots are in use until its "
                "combine)");
  throw Error(std::string(call) +
              ": another layer sharing this micro-batch's workspace set is between the phases of "
              "a split forward or backward (its micro-batch " +
              std::to_string(owner.micro_batch) +
              "; the set's receive windows and echo slots are in use until its combine)");
}

void LayerCore::begin_forward(const Tensor& x, const Tensor& y, bool split) {
  const int64_t T = x.ndim == 2 ? x.size(0) : -1, H = moe_.hidden;
  check_tensor(x, "x", backend_.activation_dtype(), {-1, H});
  check_tensor(y, "y", backend_.activation_dtype(), {T, H});
  MOE_ECHO_CHECK(T <= moe_.max_tokens,
                 "x has " << T << " tokens, more than max_tokens = " << moe_.max_tokens);
  // EchoPlacement::step: the step's first forward (the weights changed since the last placement)
  // plans the placement; a new one would leave held clone gradients without their clones.
  const bool place = !own_slots() || !placement_held_;
  MOE_ECHO_CHECK(!(own_slots() && place && clone_grads_held_),
                 "forward: the expert weights changed (optimizer_step, weights_changed or a view "
                 "of w1 or w2 taken) while clone gradients of earlier backwards are held in the "
                 "echo slots (hold_clone_grads): run the step's last backward with "
                 "hold_clone_grads(false) first, which reduces them home");
  fl_->last_tokens = T;
  fl_->last_x = x;  // the router backward and spill-round recompute read it again
  last_forward_ = cur_;
  Step& st = fl_->step;
  st = Step{};
  st.x = x;
  st.y = y;
  st.T = T;
  st.flags.split = split;
  st.flags.place = place;
  st.flags.quantize_home = fp8_weight_bits() != 0 && fp8_weights_stale_;
  st.schedule = &schedule(st.flags);
  fl_->placed = place;
  if (own_slots()) placement_held_ = true;
  fl_->placement_epoch = placement_epoch_;
}

void LayerCore::begin_backward(const Tensor& dy, const Tensor& dx,
                               const MoeLayer::ExpertGrads& into, bool split) {
  const int64_t T = fl_->last_tokens, H = moe_.hidden;
  check_tensor(dy, "dy", backend_.activation_dtype(), {T, H});
  check_tensor(dx, "dx", backend_.activation_dtype(), {T, H});
  MOE_ECHO_CHECK(!own_slots() || fl_->placement_epoch == placement_epoch_,
                 "backward of micro-batch "
                     << cur_
                     << ": its forward ran on the clone placement of an earlier step (the expert "
                        "weights changed since: optimizer_step, weights_changed or a view of w1 "
                        "or w2 taken), whose clones the echo slots no longer hold; with "
                        "EchoPlacement::step run a step's backwards before its optimizer step");
  Step& st = fl_->step;
  st = Step{};
  st.x = fl_->last_x;
  st.dy = dy;
  st.dx = dx;
  st.T = T;
  st.into = into;
  MOE_ECHO_CHECK(expert_grads_ || into.dw1.data != nullptr,
                 "backward of a layer built without expert gradients (LayerOwns::expert_grads = "
                 "false): allowed backward_into, or backward_dispatch with `into`, which give the "
                 "tensors to write them into");
  step::Flags& f = st.flags;
  f.backward = true;
  f.split = split;
  // Expert gradients written elsewhere leave the layer's stale (a later backward() writes them
  // instead of adding to them); the shared experts' stay in the layer and accumulate as usual.
  f.overwrite_grads = grads_zeroed_ || expert_grads_stale_ || into.dw1.data != nullptr;
  f.overwrite_shared = grads_zeroed_;
  grads_zeroed_ = false;
  expert_grads_stale_ = into.dw1.data != nullptr;
  // Another micro-batch's or layer's forward or backward used the shared echo slots since this
  // micro-batch's forward: pull its clones again.
  f.repull = modes_.spare_slots && !own_slots() && !(ws_set().pool_owner == user());
  // Clone gradients held from earlier backwards of the step add up with this one's, so its GEMMs
  // add: home gradients to be written are zeroed first instead.
  if (clone_grads_held_ && f.overwrite_grads) {
    f.zero_home = true;
    f.overwrite_grads = false;
  }
  f.zero_clones = slots_ > moe_.experts / par_.ep_size && !f.overwrite_grads && !clone_grads_held_;
  f.reduce_clones = modes_.spare_slots && !(own_slots() && hold_clone_grads_);
  clone_grads_held_ = own_slots() && hold_clone_grads_;
  st.schedule = &schedule(f);
}

const step::Schedule& LayerCore::schedule(const step::Flags& f) {
  auto it = schedules_.find(f.bits());
  if (it == schedules_.end())
    it = schedules_.emplace(f.bits(), step::build_schedule(modes_, f)).first;
  return it->second;
}

void LayerCore::enqueue(std::unique_ptr<GraphCache>& cache, int phase, Stream s) {
  const Step& st = fl_->step;
  const size_t begin = phase < 0 ? 0 : st.schedule->phase[size_t(phase)];
  const size_t end = phase < 0 ? st.schedule->ops.size() : st.schedule->phase[size_t(phase) + 1];
  auto ops = [&](Stream g) { run(st, begin, end, g); };
  comm_.check_peers();
  if (eager_graphs())
    backend_.enqueue_as_graph(cache, st.key(), ops, s);
  else
    ops(s);
}

// ---- Forward and backward -----------------------------------------------------------------

// A call: its checks and the micro-batch's move (flight.hpp), its flags and schedule (a
// starting call), then its slice of the schedule enqueued; a split's dispatch holds the
// workspace set until its combine, and a starting call leaves its clones in the echo slots.
void LayerCore::call(FlightCall c, int m, Stream s, const Tensor& a, const Tensor& b,
                     const MoeLayer::ExpertGrads& into, const char* name) {
  select_micro_batch(m, name ? name : to_string(c));
  const FlightState next = begin_call(c);
  const bool forward = c <= FlightCall::forward_combine;
  const int first =
      forward ? int(FlightCall::forward_dispatch) : int(FlightCall::backward_dispatch);
  const bool whole = c == FlightCall::forward || c == FlightCall::backward;
  const int phase = whole ? -1 : int(c) - first;  // the split phase, 0 to 2
  if (phase <= 0) {
    if (forward)
      begin_forward(a, b, !whole);
    else
      begin_backward(a, b, into, !whole);
  }
  if (phase == 0) ws_set().split_owner = user();
  std::unique_ptr<GraphCache>& cache = whole ? (forward ? fl_->forward_graph : fl_->backward_graph)
                                             : fl_->phase_graphs[size_t((forward ? 0 : 3) + phase)];
  enqueue(cache, phase, s);
  fl_->state = next;
  if (phase == 2) ws_set().split_owner = {};
  if (phase <= 0) {
    if (forward && fl_->step.flags.quantize_home) fp8_weights_stale_ = false;
    ws_set().pool_owner = user();  // this micro-batch's clones are in the echo slots
  }
}

void MoeLayer::forward(const Tensor& x, const Tensor& y, Stream s, int micro_batch) {
  core_->call(FlightCall::forward, micro_batch, s, x, y);
}
void MoeLayer::forward_dispatch(const Tensor& x, const Tensor& y, Stream s, int micro_batch) {
  core_->call(FlightCall::forward_dispatch, micro_batch, s, x, y);
}
void MoeLayer::forward_experts(Stream s, int m) { core_->call(FlightCall::forward_experts, m, s); }
void MoeLayer::forward_combine(Stream s, int m) { core_->call(FlightCall::forward_combine, m, s); }

// The backward's split phases; backward(dy, dx) below.
void MoeLayer::backward_experts(Stream s, int m) {
  core_->call(FlightCall::backward_experts, m, s);
}
void MoeLayer::backward_combine(Stream s, int m) {
  core_->call(FlightCall::backward_combine, m, s);
}
void MoeLayer::backward_dispatch(const Tensor& dy, const Tensor& dx, Stream s, int micro_batch) {
  core_->call(FlightCall::backward_dispatch, micro_batch, s, dy, dx);
}
void MoeLayer::backward_dispatch(const Tensor& dy, const Tensor& dx, const ExpertGrads& into,
                                 Stream s, int micro_batch) {
  core_->check_into(into, "backward_dispatch");
  core_->call(FlightCall::backward_dispatch, micro_batch, s, dy, dx, into, "backward_dispatch");
}
void MoeLayer::backward(const Tensor& dy, const Tensor& dx, Stream s, int micro_batch) {
  core_->call(FlightCall::backward, micro_batch, s, dy, dx);
}

// backward() and backward_into() with x given again: its shape checked, then kept as the one the
// router's backward and the recompute read.
void MoeLayer::backward(const Tensor& x, const Tensor& dy, const Tensor& dx, Stream s,
                        int micro_batch) {
  LayerCore& l = *core_;
  l.select_micro_batch(micro_batch, "backward");
  check_tensor(x, "x", l.backend_.activation_dtype(), {l.fl_->last_tokens, l.moe_.hidden});
  l.fl_->last_x = x;
  l.call(FlightCall::backward, micro_batch, s, dy, dx);
}

void MoeLayer::backward_into(const Tensor& x, const Tensor& dy, const Tensor& dx,
                             const ExpertGrads& into, Stream s, int micro_batch) {
  LayerCore& l = *core_;
  l.select_micro_batch(micro_batch, "backward_into");
  check_tensor(x, "x", l.backend_.activation_dtype(), {l.fl_->last_tokens, l.moe_.hidden});
  l.check_into(into, "backward_into");
  l.fl_->last_x = x;
  l.call(FlightCall::backward, micro_batch, s, dy, dx, into, "backward_into");
}

void LayerCore::check_into(const MoeLayer::ExpertGrads& into, const char* call) const {
  const int64_t EPR = moe_.experts / par_.ep_size, H = moe_.hidden, F = moe_.ffn;
  // The float dtype, or the activation dtype where each gradient is one GEMM's.
  const DType act = backend_.activation_dtype();
  const DType dt = into.dw1.data && into.dw1.dtype == act && step::one_gemm_expert_grads(modes_)
                       ? act
                       : backend_.float_dtype();
  check_tensor(into.dw1, "dw1", dt, {EPR, H, 2 * F});
  check_tensor(into.dw2, "dw2", dt, {EPR, F, H});
  MOE_ECHO_CHECK(reinterpret_cast<uintptr_t>(into.dw1.data) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(into.dw2.data) % 16 == 0,
                 call << ": dw1 at " << into.dw1.data << " and dw2 at " << into.dw2.data
                      << " must be 16-byte aligned");
}

// ---- Parameters, gradients and the optimizer ----------------------------------------------

Tensor MoeLayer::param(Param p) const {
  LayerCore& l = *core_;
  const int64_t EPR = l.moe_.experts / l.par_.ep_size;
  if (p == Param::w1 || p == Param::w2) {  // the caller may write them
    l.fp8_weights_stale_ = true;
    l.drop_placement();
  }
  switch (p) {
    case Param::router_weight: return l.w_.router_weight;
    case Param::router_bias: return l.w_.router_bias;
    case Param::w1: return l.w_.w1.rows(0, EPR);
    case Param::w2: return l.w_.w2.rows(0, EPR);
    case Param::shared_w1: return l.w_.shared_w1;
    case Param::shared_w2: return l.w_.shared_w2;
  }
  return {};
}

Tensor MoeLayer::grad(Param p) const {
  const LayerCore& l = *core_;
  const int64_t EPR = l.moe_.experts / l.par_.ep_size;
  switch (p) {
    case Param::router_weight: return l.w_.d_router_weight;
    case Param::router_bias: throw Error("router_bias has no gradient");
    case Param::w1:
    case Param::w2:
      MOE_ECHO_CHECK(l.expert_grads_,
                     "grad(" << (p == Param::w1 ? "w1" : "w2")
                             << ") of a layer built without expert gradients (LayerOwns::"
                                "expert_grads = false): they were written where backward_into "
                                "was told");
      return p == Param::w1 ? l.w_.dw1.rows(0, EPR) : l.w_.dw2.rows(0, EPR);
    case Param::shared_w1: return l.w_.d_shared_w1;
    case Param::shared_w2: return l.w_.d_shared_w2;
  }
  return {};
}

void MoeLayer::weights_changed() {
  LayerCore& l = *core_;
  MOE_ECHO_CHECK(!l.clone_grads_held_,
                 "weights_changed: clone gradients of earlier backwards are held in the echo "
                 "slots (hold_clone_grads), reduced home by the step's last backward (run with "
                 "hold_clone_grads(false)); change the weights after it");
  l.fp8_weights_stale_ = true;
  l.drop_placement();
}

void MoeLayer::hold_clone_grads(bool hold) {
  LayerCore& l = *core_;
  MOE_ECHO_CHECK(!hold || l.echo_.placement == EchoPlacement::step,
                 "hold_clone_grads(true) needs EchoConfig::placement = step, not "
                     << to_string(l.echo_.placement)
                     << " (each micro-batch's clones are planned for it, and their gradients go "
                        "home with its backward)");
  l.hold_clone_grads_ = hold;
}

bool MoeLayer::clone_grads_held() const { return core_->clone_grads_held_; }

bool MoeLayer::holds_expert_grads() const { return core_->expert_grads_; }

bool MoeLayer::activation_dtype_grads() const { return step::one_gemm_expert_grads(core_->modes_); }

bool MoeLayer::activation_dtype_grads(const MoeConfig& moe, const ParallelConfig& par,
                                      const EchoConfig& echo) {
  return step::one_gemm_expert_grads(step::modes_of(moe, par, echo));
}

void MoeLayer::discard_grad(Stream s) {
  LayerCore& l = *core_;
  l.check_no_split("discard_grad", false, true);
  l.backend_.fill_zero(l.w_.d_router_weight, s);
  l.grads_zeroed_ = true;
}

void MoeLayer::zero_grad(Stream s) {
  LayerCore& l = *core_;
  l.check_no_split("zero_grad", false, true);
  for (const Tensor* t :
       {&l.w_.d_router_weight, &l.w_.dw1, &l.w_.dw2, &l.w_.d_shared_w1, &l.w_.d_shared_w2})
    if (t->data) l.backend_.fill_zero(*t, s);
  l.grads_zeroed_ = true;
  l.clone_grads_held_ = false;  // dropped: the next backward zeroes the clone slots' gradients
}

void MoeLayer::all_reduce_router_grad(Stream s) {
  LayerCore& l = *core_;
  for (const Tensor* t : {&l.w_.d_router_weight, &l.w_.d_shared_w1, &l.w_.d_shared_w2})
    if (t->data) l.comm_.all_reduce_sum(*t, s);
}

void MoeLayer::optimizer_step(const AdamWConfig& cfg, Stream s) {
  LayerCore& l = *core_;
  l.check_no_split("optimizer_step", false, true);
  const LayerTensors& w = l.w_;
  MOE_ECHO_CHECK(
      w.m_router.data != nullptr,
      "optimizer_step on a layer built without optimizer state (optimizer_state = false)");
  MOE_ECHO_CHECK(!l.clone_grads_held_,
                 "optimizer_step: clone gradients of earlier backwards are held in the echo slots "
                 "(hold_clone_grads), not yet in the home experts' gradients: run the step's last "
                 "backward with hold_clone_grads(false), which reduces them home");
  l.drop_placement();  // the next forward plans the next step's placement
  l.backend_.add_i32(w.optimizer_step, 1, s);
  auto step = [&](const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
                  const Tensor& master) {
    AdamWArgs a;
    a.param = p, a.grad = g, a.m = m, a.v = v, a.master = master;
    a.step = w.optimizer_step;
    a.lr = cfg.lr, a.beta1 = cfg.beta1, a.beta2 = cfg.beta2, a.eps = cfg.eps;
    a.weight_decay = cfg.weight_decay;
    l.backend_.adamw(a, s);
  };
  step(w.router_weight, w.d_router_weight, w.m_router, w.v_router, Tensor());
  step(w.w1, grad(Param::w1), w.m_w1, w.v_w1, w.master_w1);
  step(w.w2, grad(Param::w2), w.m_w2, w.v_w2, w.master_w2);
  if (w.shared_w1.data) {
    step(w.shared_w1, w.d_shared_w1, w.m_sw1, w.v_sw1, w.master_sw1);
    step(w.shared_w2, w.d_shared_w2, w.m_sw2, w.v_sw2, w.master_sw2);
  }
  if (l.fp8_weight_bits() != 0) {
    l.quantize_weights(true, false, l.fp8_weight_bits(), s);
    l.fp8_weights_stale_ = false;
  }
}

void MoeLayer::refresh_master_weights() { core_->refresh_master_weights(); }

void MoeLayer::reset_parameters(uint64_t seed) {
  LayerCore& l = *core_;
  l.backend_.synchronize();  // no step of the layer still reads the weights
  l.init_parameters(seed);
  l.backend_.fill_zero(l.w_.router_bias, nullptr);
  l.refresh_master_weights();
  weights_changed();
  l.backend_.synchronize();
}

void MoeLayer::set_phase_observer(PhaseObserver* observer) { core_->observer_ = observer; }

// ---- What the layer holds -----------------------------------------------------------------

const MoeConfig& MoeLayer::moe_config() const { return core_->moe_; }
const ParallelConfig& MoeLayer::parallel_config() const { return core_->par_; }
const EchoConfig& MoeLayer::echo_config() const { return core_->echo_; }
const PlannerConfig& MoeLayer::planner_config() const { return core_->planner_; }
int64_t MoeLayer::capacity() const { return core_->capacity_; }
int MoeLayer::slots() const { return core_->slots_; }

size_t MoeLayer::workspace_bytes() const {
  return core_->bytes_ + (core_->own_workspace_ ? core_->own_workspace_->bytes() : 0);
}
size_t MoeLayer::layer_bytes() const { return core_->bytes_; }

namespace {
void check_micro_batch(int m, const MoeConfig& moe, const char* call) {
  MOE_ECHO_CHECK(m >= 0 && m < moe.in_flight,
                 call << ": micro_batch = " << m << " is invalid: allowed 0 to "
                      << moe.in_flight - 1 << " (MoeConfig::in_flight = " << moe.in_flight << ")");
}
}  // namespace

Tensor MoeLayer::plan_buffer(int m) const {
  check_micro_batch(m, core_->moe_, "plan_buffer");
  return core_->parts_[size_t(m)].plan;
}
Tensor MoeLayer::losses(int m) const {
  check_micro_batch(m, core_->moe_, "losses");
  return core_->parts_[size_t(m)].losses;
}

StepStats MoeLayer::stats(int micro_batch) const {
  const LayerCore& l = *core_;
  const int m = micro_batch < 0 ? l.last_forward_ : micro_batch;
  check_micro_batch(m, l.moe_, "stats");
  const StepPart& b = l.parts_[size_t(m)];
  Backend& be = l.backend_;
  StepStats st;
  const auto losses = read_tensor(be, b.losses);
  st.aux_loss = losses[0];
  st.z_loss = losses[1];
  st.seq_aux_loss = losses[2];
  const int R = l.par_.ep_size;
  std::vector<int32_t> plan(size_t(plan_ints(l.planner_)));
  be.copy_to_host(plan.data(), b.plan.data, plan.size() * sizeof(int32_t));
  const PlanView pv = plan_view(plan.data(), l.planner_);
  st.load_before.assign(pv.load_before, pv.load_before + R);
  st.load_after.assign(pv.load_after, pv.load_after + R);
  auto max_over_mean = [](const std::vector<int32_t>& v) {
    double sum = 0, mx = 0;
    for (int32_t x : v) {
      sum += x;
      mx = std::max(mx, double(x));
    }
    return sum > 0 ? mx / (sum / double(v.size())) : 1.0;
  };
  st.max_over_mean_before = max_over_mean(st.load_before);
  st.max_over_mean_after = max_over_mean(st.load_after);
  st.clones = pv.num_clones[0];
  st.placement_kept = !l.flights_[size_t(m)].placed;
  // Per clone: fc1 and fc2 weights (3 H F values) pulled in, in the activation dtype, and their
  // gradients reduced home, in the float dtype (bf16 in and fp32 home on the CUDA backend).
  const int64_t expert_values = int64_t(3) * l.moe_.hidden * l.moe_.ffn;
  const int64_t act = int64_t(dtype_size(be.activation_dtype()));
  st.clone_bytes = st.placement_kept ? 0
                                     : int64_t(st.clones) * expert_values *
                                           (act + int64_t(dtype_size(be.float_dtype())));
  // Rows and rounds as the layout computed them on the device: every rank's receive rows, and
  // the rounds some rank has rows in (round 0 and the spill rounds).
  std::vector<int32_t> rank_rows(static_cast<size_t>(R)),
      round_active(static_cast<size_t>(l.rounds_));
  be.copy_to_host(rank_rows.data(), b.rank_rows.data, rank_rows.size() * sizeof(int32_t));
  be.copy_to_host(round_active.data(), b.round_active.data, round_active.size() * sizeof(int32_t));
  st.received_rows = rank_rows[size_t(l.par_.ep_rank)];
  st.overflow_rows = std::max<int64_t>(0, st.received_rows - l.capacity_);
  for (int32_t v : rank_rows) st.overflow_rows_all += std::max<int64_t>(0, v - l.capacity_);
  const auto active =
      std::count_if(round_active.begin(), round_active.end(), [](int32_t a) { return a != 0; });
  st.spill_rounds = std::max(0, int(active) - 1);
  // Distinct destination ranks of each token's K rows.
  const int64_t T = l.flights_[size_t(m)].last_tokens, K = l.moe_.top_k;
  std::vector<int32_t> dest(static_cast<size_t>(T * K));
  be.copy_to_host(dest.data(), b.dest_rank.data, dest.size() * sizeof(int32_t));
  int64_t ranks_sum = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::sort(dest.begin() + t * K, dest.begin() + (t + 1) * K);
    const int n =
        int(std::unique(dest.begin() + t * K, dest.begin() + (t + 1) * K) - (dest.begin() + t * K));
    ranks_sum += n;
    st.ranks_per_token_max = std::max(st.ranks_per_token_max, n);
  }
  st.ranks_per_token_mean = T > 0 ? double(ranks_sum) / double(T) : 0.0;
  st.dispatch_row_bytes = uses_fp8(l.moe_, fp8_gemm::fprop1) ? fp8_packed_row_bytes(l.moe_.hidden)
                                                             : int64_t(l.moe_.hidden) * act;
  st.dispatch_bytes = ranks_sum * st.dispatch_row_bytes;
  return st;
}

}  // namespace moe_echo
