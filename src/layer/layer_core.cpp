// Building a layer and a workspace from the buffer table (buffers.hpp), their memory counts, the
// layer's parameters' initialisation, and MoeStack.
#include "layer/layer_core.hpp"

#include <algorithm>
#include <cmath>

#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/random.hpp"

namespace moe_echo {

void release(Backend& backend, Communicator& comm, const std::vector<SymmetricBuffer*>& symmetric,
             const std::vector<void*>& owned) {
  try {
    backend.synchronize();
    for (SymmetricBuffer* s : symmetric) comm.free_symmetric(backend, *s);
  } catch (...) {
    for (SymmetricBuffer* s : symmetric)
      if (s->local) backend.deallocate(s->local);
  }
  for (void* p : owned) backend.deallocate(p);
}

namespace {
BufferDims dims_of(const MoeConfig& m, const ParallelConfig& par, const EchoConfig& echo, DType act,
                   DType fl, LayerOwns owns = {}) {
  return BufferDims(m, par, echo, act, fl, owns);
}
SlotBytes slots_for(const std::vector<MoeConfig>& layers, const ParallelConfig& par,
                    const EchoConfig& echo, DType act, DType fl) {
  SlotBytes sb;
  for (const MoeConfig& m : layers) sb.grow(dims_of(m, par, echo, act, fl));
  return sb;
}
}  // namespace

// ---- MoeWorkspace ---------------------------------------------------------------------------

int MoeWorkspace::sets_for(const std::vector<MoeConfig>& layers) {
  int sets = 1;
  for (const MoeConfig& m : layers) sets = std::max(sets, std::min(m.in_flight, 2));
  return sets;
}

MoeWorkspace::MoeWorkspace(Backend& backend, Communicator& comm,
                           const std::vector<MoeConfig>& layers, const ParallelConfig& par,
                           const EchoConfig& echo)
    : backend_(backend), comm_(comm), par_(par), echo_(echo) {
  MOE_ECHO_CHECK(!layers.empty(), "a workspace for no layers: allowed one layer or more");
  for (const MoeConfig& m : layers) validate(m, par, echo);
  sets_.resize(size_t(sets_for(layers)));
  for (Set& set : sets_) {
    set.buf = std::make_unique<Buffers>();
    Buffers& b = *set.buf;
    b.size = slots_for(layers, par, echo, backend.activation_dtype(), backend.float_dtype());
    for (int i = 0; i < kSlots; ++i) {
      const size_t n = b.size.bytes[size_t(i)];
      if (n == 0) continue;
      if (slot_symmetric(Slot(i))) {
        b.sym[size_t(i)] = comm.alloc_symmetric(backend, n);
        b.symmetric.push_back(&b.sym[size_t(i)]);
        b.local[size_t(i)] = b.sym[size_t(i)].local;
      } else {
        b.local[size_t(i)] = backend.allocate(n);
        b.owned.push_back(b.local[size_t(i)]);
      }
      b.bytes += n;
    }
  }
  backend.synchronize();
  comm.barrier();
}

MoeWorkspace::~MoeWorkspace() {
  for (Set& set : sets_)
    if (set.buf) release(backend_, comm_, set.buf->symmetric, set.buf->owned);
}

size_t MoeWorkspace::bytes() const {
  size_t total = 0;
  for (const Set& set : sets_) total += set.buf->bytes;
  return total;
}

size_t MoeWorkspace::memory_bytes(const std::vector<MoeConfig>& layers, const ParallelConfig& par,
                                  const EchoConfig& echo, DType activation, DType float_dtype) {
  return memory_breakdown(layers, par, echo, activation, float_dtype).total();
}

MoeMemory MoeWorkspace::memory_breakdown(const std::vector<MoeConfig>& layers,
                                         const ParallelConfig& par, const EchoConfig& echo,
                                         DType activation, DType float_dtype) {
  for (const MoeConfig& m : layers) validate(m, par, echo);
  const MoeMemory one = slots_for(layers, par, echo, activation, float_dtype).memory();
  MoeMemory all;
  for (int i = 0; i < sets_for(layers); ++i) all += one;
  return all;
}

MoeMemory& MoeMemory::operator+=(const MoeMemory& o) {
  params += o.params;
  grads += o.grads;
  optimizer += o.optimizer;
  routing += o.routing;
  activations += o.activations;
  temporaries += o.temporaries;
  workspace += o.workspace;
  echo_slot_weights += o.echo_slot_weights;
  echo_slot_grads += o.echo_slot_grads;
  fp8 += o.fp8;
  return *this;
}

// ---- A layer's buffers --------------------------------------------------------------------

LayerCore::LayerCore(MoeLayer& self, Backend& backend, Communicator& comm, const MoeConfig& moe,
                     const ParallelConfig& par, const EchoConfig& echo, uint64_t seed,
                     LayerOwns owns, MoeWorkspace* workspace)
    : self_(self), backend_(backend), comm_(comm), moe_(moe), par_(par), echo_(echo) {
  validate(moe_, par_, echo_);
  MOE_ECHO_CHECK(comm.size() == par.ep_size,
                 "communicator has " << comm.size() << " ranks but ep_size = " << par.ep_size);
  MOE_ECHO_CHECK(comm.rank() == par.ep_rank,
                 "communicator rank " << comm.rank() << " but ep_rank = " << par.ep_rank);
  planner_ = moe_echo::planner_config(moe, par, echo);
  validate(planner_);
  modes_ = step::modes_of(moe, par, echo);
  slots_ = slots_per_rank(moe, par, echo);
  capacity_ = capacity_rows(moe);
  rounds_ = max_rounds(moe, par, echo);
  MOE_ECHO_CHECK(owns.expert_grads || !owns.optimizer_state,
                 "a layer with optimizer state and without expert gradients: its optimizer_step "
                 "reads them (allowed: expert_grads with optimizer_state)");
  expert_grads_ = owns.expert_grads;
  const BufferDims dims(moe, par, echo, backend.activation_dtype(), backend.float_dtype(), owns);
  if (workspace) {
    MOE_ECHO_CHECK(&workspace->backend() == &backend && &workspace->communicator() == &comm,
                   "workspace built on another backend or communicator than the layer's");
    MOE_ECHO_CHECK(
        workspace->par_.ep_size == par.ep_size && workspace->par_.ep_rank == par.ep_rank &&
            moe_echo::planner_config(moe, par, workspace->echo_).spare_slots ==
                planner_.spare_slots,
        "workspace built for another expert-parallel layout or number of echo slots than the "
        "layer's");
    // Every slot of the workspace must hold this layer's need, checked before allocating.
    SlotBytes need;
    need.grow(dims);
    const SlotBytes& held = workspace->sets_[0].buf->size;
    for (int i = 0; i < kSlots; ++i)
      MOE_ECHO_CHECK(need.bytes[size_t(i)] <= held.bytes[size_t(i)],
                     "workspace buffer of " << held.bytes[size_t(i)]
                                            << " bytes where this layer needs "
                                            << need.bytes[size_t(i)]
                                            << ": build the workspace for this layer's config");
    MOE_ECHO_CHECK(workspace->sets() >= MoeWorkspace::sets_for({moe}),
                   "workspace of " << workspace->sets() << " set(s) of buffers for a layer of "
                                   << "in_flight = " << moe.in_flight
                                   << ", which needs 2: build the workspace for this layer's "
                                      "config");
    ws_ = workspace;
  } else {
    own_workspace_ =
        std::make_unique<MoeWorkspace>(backend, comm, std::vector<MoeConfig>{moe}, par, echo);
    ws_ = own_workspace_.get();
  }

  // The backend's per-layer resources. The shared experts' GEMMs take up to T rows in one
  // window; the side stream's GEMMs leave overlap_sms to the communication (overlap wgrad and
  // chunks).
  const int64_t max_rows =
      shared_width(moe) > 0 ? std::max<int64_t>(capacity_, moe.max_tokens) : capacity_;
  const bool side_gemms = moe.overlap == Overlap::wgrad || moe.chunks > 1;
  backend.reserve(Reservation{slots_, max_rows, moe.max_tokens, moe.hidden, moe.ffn, moe.experts,
                              moe.top_k, par.ep_size, planner_, moe.precision == Precision::fp8,
                              side_gemms ? moe.overlap_sms : -1, ws_->sets()});

  // The table once per micro-batch: the layer's own buffers allocated with micro-batch 0 (the
  // others copy their views), each micro-batch's own, the workspace's slots of its set viewed.
  parts_.resize(size_t(moe.in_flight));
  std::vector<BufferRow> first;
  LayerTensors unused;
  for (int m = 0; m < moe.in_flight; ++m) {
    std::vector<BufferRow> rows = buffer_table(dims, m == 0 ? w_ : unused, parts_[size_t(m)]);
    const MoeWorkspace::Buffers& set = *ws_->sets_[size_t(set_of(m))].buf;
    for (size_t i = 0; i < rows.size(); ++i) {
      BufferRow& r = rows[i];
      if (r.home == Home::workspace) {
        if (!r.tensor) continue;
        const size_t slot = size_t(r.slot);
        *r.tensor = r.view(set.local[slot]);
        MOE_ECHO_CHECK(r.bytes() <= set.size.bytes[slot],
                       "workspace buffer of " << set.size.bytes[slot] << " bytes for a "
                                              << r.tensor->describe()
                                              << " of this layer: build the workspace for this "
                                                 "layer's config");
        if (r.sym) *r.sym = set.sym[slot];
        continue;
      }
      if (r.home == Home::layer && m > 0) {  // shared: micro-batch 0's
        *r.tensor = *first[i].tensor;
        if (r.sym) *r.sym = *first[i].sym;
        continue;
      }
      Tensor t = r.view(nullptr);
      if (r.sym) {
        *r.sym = comm.alloc_symmetric(backend, t.bytes());
        symmetric_.push_back(r.sym);
        t.data = r.sym->local;
      } else {
        t.data = backend.allocate(t.bytes());
        owned_.push_back(t.data);
      }
      bytes_ += t.bytes();
      *r.tensor = t;
      if (r.zero) backend.fill_zero(t, nullptr);
    }
    derive_views(dims, parts_[size_t(m)]);
    if (m == 0) first = std::move(rows);
  }
  for (StepPart& p : parts_)
    if (p.one.data) {
      write_tensor(backend, p.one, std::vector<double>{1.0});
      write_tensor(backend, p.shared_offsets, std::vector<double>{0.0, double(moe.max_tokens)});
    }
  flights_.resize(size_t(moe.in_flight));
  select_micro_batch(0, "MoeLayer");
  init_parameters(seed);
  refresh_master_weights();
  backend.synchronize();
  comm.barrier();
}

LayerCore::~LayerCore() {
  if (ws_)
    for (MoeWorkspace::Set& set : ws_->sets_) {
      if (set.pool_owner.layer == &self_) set.pool_owner = {};
      if (set.split_owner.layer == &self_) set.split_owner = {};
    }
  release(backend_, comm_, symmetric_, owned_);
}

void LayerCore::refresh_master_weights() {
  const std::pair<Tensor*, Tensor*> pairs[] = {{&w_.master_w1, &w_.w1},
                                               {&w_.master_w2, &w_.w2},
                                               {&w_.master_sw1, &w_.shared_w1},
                                               {&w_.master_sw2, &w_.shared_w2}};
  for (const auto& [master, param] : pairs)
    if (master->data) write_tensor(backend_, *master, read_tensor(backend_, *param));
}

void LayerCore::init_parameters(uint64_t seed) {
  const int64_t H = moe_.hidden, F = moe_.ffn, E = moe_.experts, EPR = E / par_.ep_size;
  // Router: small, so that initial routing is close to uniform; the same on every rank.
  std::vector<double> rw(size_t(E * H));
  Rng rr(seed, 0x5eed, 0);
  for (auto& v : rw) v = rr.uniform(-1.0, 1.0) / std::sqrt(double(H));
  write_tensor(backend_, w_.router_weight, rw);
  // Experts, keyed by the global expert index.
  std::vector<double> w1(size_t(H * 2 * F)), w2(size_t(F * H));
  for (int64_t j = 0; j < EPR; ++j) {
    const int64_t e = par_.ep_rank * EPR + j;
    Rng r1(seed, 1000 + uint64_t(e), 1), r2(seed, 1000 + uint64_t(e), 2);
    for (auto& v : w1) v = r1.uniform(-1.0, 1.0) / std::sqrt(double(H));
    for (auto& v : w2) v = r2.uniform(-1.0, 1.0) / std::sqrt(double(F));
    write_tensor(backend_, w_.w1.rows(j, 1), w1);
    write_tensor(backend_, w_.w2.rows(j, 1), w2);
  }
  // Shared experts: the same on every rank.
  const int64_t S = shared_width(moe_);
  if (S > 0) {
    std::vector<double> s1(size_t(H * 2 * S)), s2(size_t(S * H));
    Rng r1(seed, 0x5a4ed, 1), r2(seed, 0x5a4ed, 2);
    for (auto& v : s1) v = r1.uniform(-1.0, 1.0) / std::sqrt(double(H));
    for (auto& v : s2) v = r2.uniform(-1.0, 1.0) / std::sqrt(double(S));
    write_tensor(backend_, w_.shared_w1, s1);
    write_tensor(backend_, w_.shared_w2, s2);
  }
}

// ---- Memory, before building --------------------------------------------------------------

MoeMemory MoeLayer::layer_memory_breakdown(const MoeConfig& moe, const ParallelConfig& par,
                                           const EchoConfig& echo, DType activation,
                                           DType float_dtype, LayerOwns owns) {
  validate(moe, par, echo);
  return layer_memory(dims_of(moe, par, echo, activation, float_dtype, owns));
}

MoeMemory MoeLayer::memory_breakdown(const MoeConfig& moe, const ParallelConfig& par,
                                     const EchoConfig& echo, DType activation, DType float_dtype,
                                     LayerOwns owns) {
  MoeMemory memory = layer_memory_breakdown(moe, par, echo, activation, float_dtype, owns);
  memory += MoeWorkspace::memory_breakdown({moe}, par, echo, activation, float_dtype);
  return memory;
}

size_t MoeLayer::layer_memory_bytes(const MoeConfig& moe, const ParallelConfig& par,
                                    const EchoConfig& echo, DType activation, DType float_dtype,
                                    LayerOwns owns) {
  return layer_memory_breakdown(moe, par, echo, activation, float_dtype, owns).total();
}

size_t MoeLayer::memory_bytes(const MoeConfig& moe, const ParallelConfig& par,
                              const EchoConfig& echo, DType activation, DType float_dtype,
                              LayerOwns owns) {
  return memory_breakdown(moe, par, echo, activation, float_dtype, owns).total();
}

// ---- MoeStack -----------------------------------------------------------------------------

MoeStack::MoeStack(Backend& backend, Communicator& comm, const std::vector<MoeConfig>& layers,
                   const ParallelConfig& par, const EchoConfig& echo, uint64_t seed,
                   bool optimizer_state)
    : workspace_(std::make_unique<MoeWorkspace>(backend, comm, layers, par, echo)) {
  layers_.reserve(layers.size());
  for (size_t l = 0; l < layers.size(); ++l)
    layers_.push_back(std::make_unique<MoeLayer>(backend, comm, layers[l], par, echo,
                                                 seed + uint64_t(l), optimizer_state,
                                                 workspace_.get()));
}

MoeStack::~MoeStack() { layers_.clear(); }  // before the workspace they use

MoeLayer& MoeStack::layer(int l) {
  MOE_ECHO_CHECK(l >= 0 && l < size(), "layer " << l << " of a stack of " << size());
  return *layers_[size_t(l)];
}
const MoeLayer& MoeStack::layer(int l) const {
  MOE_ECHO_CHECK(l >= 0 && l < size(), "layer " << l << " of a stack of " << size());
  return *layers_[size_t(l)];
}

size_t MoeStack::bytes() const {
  size_t total = workspace_->bytes();
  for (const auto& l : layers_) total += l->layer_bytes();
  return total;
}

size_t MoeStack::memory_bytes(const std::vector<MoeConfig>& layers, const ParallelConfig& par,
                              const EchoConfig& echo, DType activation, DType float_dtype,
                              LayerOwns owns) {
  return memory_breakdown(layers, par, echo, activation, float_dtype, owns).total();
}

MoeMemory MoeStack::memory_breakdown(const std::vector<MoeConfig>& layers,
                                     const ParallelConfig& par, const EchoConfig& echo,
                                     DType activation, DType float_dtype, LayerOwns owns) {
  MoeMemory memory = MoeWorkspace::memory_breakdown(layers, par, echo, activation, float_dtype);
  for (const MoeConfig& m : layers)
    memory += MoeLayer::layer_memory_breakdown(m, par, echo, activation, float_dtype, owns);
  return memory;
}

}  // namespace moe_echo
