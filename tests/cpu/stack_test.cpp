// MoeStack: L layers on one shared MoeWorkspace (receive windows, temporaries, echo slots) against
// L layers built apart, on R in-process ranks of the CPU backend (f64): each layer's output feeds
// the next, the backwards run in reverse, two steps (the second adds to the first's gradients).
// Every output, input gradient, parameter gradient and statistic must be bit-identical, with
// ECHO clones in several layers of the same step and spill rounds in some; every recompute option
// must give the bits of recompute = none; the bytes allocated must equal the estimate.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moe_echo/backends.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/layer.hpp"
#include "test_util.hpp"

namespace moe_echo::test {
namespace {

constexpr int H = 16;

MoeConfig layer_config(int ffn, int experts, int top_k) {
  MoeConfig m;
  m.hidden = H;
  m.ffn = ffn;
  m.experts = experts;
  m.top_k = top_k;
  m.max_tokens = 48;
  m.aux_loss_coeff = 0.01;
  m.z_loss_coeff = 0.001;
  m.capacity_factor = 0.85;
  return m;
}

// Four layers of different shapes (H is the model's): the workspace is sized for the largest.
// Layer 1 takes at most 40 tokens per rank: its receive capacity (ceil(0.85 * 40 * 3) rows) is
// below the mean rows per rank, so it always spills; the others spill only when skewed enough.
std::vector<MoeConfig> four_layers(Recompute r = Recompute::none) {
  std::vector<MoeConfig> l = {layer_config(24, 8, 2), layer_config(16, 8, 3),
                              layer_config(32, 4, 2), layer_config(16, 8, 2)};
  l[1].max_tokens = 40;
  for (MoeConfig& m : l) m.recompute = r;
  return l;
}

EchoConfig echo_config() {
  EchoConfig e;
  e.spare_slots_per_rank = 2;
  e.max_clones_per_expert = 2;
  return e;
}

struct StackCase {
  std::vector<MoeConfig> layers;
  int ranks = 2;
  EchoConfig echo = echo_config();
  bool stacked = true;  // one MoeStack, or separate MoeLayers (seeds seed + l)
  uint64_t seed = 11;
  std::vector<double> hot;  // per layer: selection bias on expert 0 (skews routing to it)
};

struct StackRun {
  // [rank][layer]
  std::vector<std::vector<std::vector<double>>> y, dx, d_router, dw1, dw2;
  std::vector<std::vector<StepStats>> stats;
  std::vector<size_t> bytes;  // per rank: what the stack (or the separate layers) allocated
};

int tokens(int rank) { return 40 - 2 * rank; }

StackRun run_stack(const StackCase& c) {
  const int R = c.ranks, L = int(c.layers.size());
  StackRun out;
  out.y.resize(size_t(R));
  out.dx.resize(size_t(R));
  out.d_router.resize(size_t(R));
  out.dw1.resize(size_t(R));
  out.dw2.resize(size_t(R));
  out.stats.resize(size_t(R));
  out.bytes.resize(size_t(R));
  InProcessWorld world(R);
  world.run([&](int r) {
    auto be = make_cpu_backend(DType::f64);
    Communicator& comm = world.communicator(r);
    const ParallelConfig par{R, r};
    std::unique_ptr<MoeStack> stack;
    std::vector<std::unique_ptr<MoeLayer>> apart;
    if (c.stacked)
      stack = std::make_unique<MoeStack>(*be, comm, c.layers, par, c.echo, c.seed);
    else
      for (int l = 0; l < L; ++l)
        apart.push_back(std::make_unique<MoeLayer>(*be, comm, c.layers[size_t(l)], par, c.echo,
                                                   c.seed + uint64_t(l)));
    auto layer = [&](int l) -> MoeLayer& {
      return c.stacked ? stack->layer(l) : *apart[size_t(l)];
    };
    for (int l = 0; l < L && l < int(c.hot.size()); ++l)
      if (c.hot[size_t(l)] != 0) {
        std::vector<double> bias(size_t(c.layers[size_t(l)].experts), 0.0);
        bias[0] = c.hot[size_t(l)];
        write_tensor(*be, layer(l).param(Param::router_bias), bias);
      }
    const int64_t T = tokens(r);
    std::vector<Tensor> acts, grads;  // acts[l]: layer l's input (acts[L]: the output)
    std::vector<void*> owned;
    auto alloc = [&]() {
      Tensor t(nullptr, DType::f64, {T, H});
      t.data = be->allocate(t.bytes());
      owned.push_back(t.data);
      write_tensor(*be, t, std::vector<double>(size_t(T * H), 1e30));  // poison
      return t;
    };
    for (int l = 0; l <= L; ++l) acts.push_back(alloc()), grads.push_back(alloc());
    for (int step = 0; step < 2; ++step) {
      write_tensor(*be, acts[0], random_values(size_t(T * H), 100 + 10 * uint64_t(r) + step));
      write_tensor(*be, grads[size_t(L)],
                   random_values(size_t(T * H), 200 + 10 * uint64_t(r) + step));
      if (step == 0)
        for (int l = 0; l < L; ++l) layer(l).zero_grad();
      for (int l = 0; l < L; ++l) layer(l).forward(acts[size_t(l)], acts[size_t(l + 1)]);
      for (int l = L - 1; l >= 0; --l)
        layer(l).backward(acts[size_t(l)], grads[size_t(l + 1)], grads[size_t(l)]);
    }
    for (int l = 0; l < L; ++l) {
      out.y[size_t(r)].push_back(read_tensor(*be, acts[size_t(l + 1)]));
      out.dx[size_t(r)].push_back(read_tensor(*be, grads[size_t(l)]));
      out.d_router[size_t(r)].push_back(read_tensor(*be, layer(l).grad(Param::router_weight)));
      out.dw1[size_t(r)].push_back(read_tensor(*be, layer(l).grad(Param::w1)));
      out.dw2[size_t(r)].push_back(read_tensor(*be, layer(l).grad(Param::w2)));
      out.stats[size_t(r)].push_back(layer(l).stats());
    }
    if (c.stacked) {
      out.bytes[size_t(r)] = stack->bytes();
    } else {
      for (const auto& l : apart) out.bytes[size_t(r)] += l->workspace_bytes();
    }
    for (void* p : owned) be->deallocate(p);
  });
  return out;
}

size_t differing(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size()) + 1;
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(double)) != 0;
  return n;
}

void expect_same(const StackRun& a, const StackRun& b) {
  ASSERT_EQ(a.y.size(), b.y.size());
  for (size_t r = 0; r < a.y.size(); ++r)
    for (size_t l = 0; l < a.y[r].size(); ++l) {
      SCOPED_TRACE("rank " + std::to_string(r) + " layer " + std::to_string(l));
      EXPECT_EQ(differing(a.y[r][l], b.y[r][l]), 0u) << "y";
      EXPECT_EQ(differing(a.dx[r][l], b.dx[r][l]), 0u) << "dx";
      EXPECT_EQ(differing(a.d_router[r][l], b.d_router[r][l]), 0u) << "router gradient";
      EXPECT_EQ(differing(a.dw1[r][l], b.dw1[r][l]), 0u) << "w1 gradient";
      EXPECT_EQ(differing(a.dw2[r][l], b.dw2[r][l]), 0u) << "w2 gradient";
      const StepStats &sa = a.stats[r][l], &sb = b.stats[r][l];
      EXPECT_EQ(sa.aux_loss, sb.aux_loss);
      EXPECT_EQ(sa.z_loss, sb.z_loss);
      EXPECT_EQ(sa.load_before, sb.load_before);
      EXPECT_EQ(sa.load_after, sb.load_after);
      EXPECT_EQ(sa.clones, sb.clones);
      EXPECT_EQ(sa.received_rows, sb.received_rows);
      EXPECT_EQ(sa.overflow_rows_all, sb.overflow_rows_all);
      EXPECT_EQ(sa.spill_rounds, sb.spill_rounds);
    }
}

// The run exercises what the stack shares: clones in at least two layers, spill rounds in one.
void expect_clones_and_spills(const StackRun& run) {
  int cloned = 0, spilled = 0;
  for (const StepStats& s : run.stats[0]) {
    cloned += s.clones > 0;
    spilled += s.spill_rounds > 0;
  }
  EXPECT_GE(cloned, 2) << "layers with clones";
  EXPECT_GE(spilled, 1) << "layers with spill rounds";
}

// The four layers skewed so that several clone and one spills, stacked against built apart: the
// same bits, and one workspace instead of four takes less memory.
void expect_stack_equals_layers_apart(std::vector<MoeConfig> layers, int ranks) {
  StackCase c;
  c.layers = std::move(layers);
  c.ranks = ranks;
  c.hot = {4.0, 0.0, 6.0, 3.0};
  const StackRun stacked = run_stack(c);
  c.stacked = false;
  const StackRun apart = run_stack(c);
  expect_clones_and_spills(stacked);
  expect_same(stacked, apart);
  EXPECT_LT(stacked.bytes[0], apart.bytes[0]);
}

TEST(Stack, EqualsLayersBuiltApartBitForBit) {
  for (int R : {2, 4}) {
    SCOPED_TRACE("R = " + std::to_string(R));
    expect_stack_equals_layers_apart(four_layers(), R);
  }
}

// Precision fp8: the echo slots' e4m3 copies are shared like the slots (made after each pull,
// again when a backward pulls its clones back): the stack still equals layers built apart.
TEST(Stack, Fp8StackEqualsLayersBuiltApartBitForBit) {
  std::vector<MoeConfig> layers = four_layers();
  for (MoeConfig& m : layers) {
    m.precision = Precision::fp8;
    m.ffn = (m.ffn + 15) / 16 * 16;  // fp8 needs multiples of 16
  }
  expect_stack_equals_layers_apart(layers, 2);
}

// EchoConfig::placement = step: each layer keeps its clones in echo slots of its own, for its
// next forward too (no weights changed between the two steps here). The stack still equals the
// layers built apart bit for bit, and a placement per micro-batch up to the order of sums.
TEST(Stack, StepPlacementStackEqualsLayersBuiltApart) {
  StackCase c;
  c.layers = four_layers();
  c.ranks = 2;
  c.hot = {4.0, 0.0, 6.0, 3.0};
  const StackRun per_micro_batch = run_stack(c);
  c.echo.placement = EchoPlacement::step;
  const StackRun stacked = run_stack(c);
  expect_clones_and_spills(stacked);
  c.stacked = false;
  const StackRun apart = run_stack(c);
  expect_same(stacked, apart);
  EXPECT_LT(stacked.bytes[0], apart.bytes[0]);
  for (size_t r = 0; r < 2; ++r)
    for (size_t l = 0; l < 4; ++l) {
      SCOPED_TRACE("rank " + std::to_string(r) + " layer " + std::to_string(l));
      EXPECT_LE(rel_error(stacked.y[r][l], per_micro_batch.y[r][l]), 1e-13);
      EXPECT_LE(rel_error(stacked.dx[r][l], per_micro_batch.dx[r][l]), 1e-13);
      EXPECT_LE(rel_error(stacked.dw1[r][l], per_micro_batch.dw1[r][l]), 1e-13);
      EXPECT_LE(rel_error(stacked.dw2[r][l], per_micro_batch.dw2[r][l]), 1e-13);
    }
  // The echo slots are each layer's own: the stack holds four layers' of them, not one pool.
  EXPECT_GT(stacked.bytes[0], per_micro_batch.bytes[0]);
}

TEST(Stack, OneRankEqualsLayersBuiltApart) {
  StackCase c;
  c.layers = four_layers();
  c.ranks = 1;
  c.hot = {4.0, 0.0, 6.0, 0.0};
  const StackRun stacked = run_stack(c);
  c.stacked = false;
  expect_same(stacked, run_stack(c));
}

TEST(Stack, EveryRecomputeOptionGivesTheBitsOfNone) {
  StackCase c;
  c.ranks = 2;
  c.hot = {4.0, 0.0, 6.0, 3.0};
  c.layers = four_layers(Recompute::none);
  const StackRun none = run_stack(c);
  expect_clones_and_spills(none);
  for (Recompute r :
       {Recompute::moe_act, Recompute::experts, Recompute::dispatch, Recompute::all_but_fc1}) {
    SCOPED_TRACE(to_string(r));
    c.layers = four_layers(r);
    const StackRun got = run_stack(c);
    expect_same(got, none);
    EXPECT_LT(got.bytes[0], none.bytes[0]) << "keeps less than none";
  }
  // Options mixed in one model, and layers built apart with them.
  c.layers = four_layers();
  c.layers[0].recompute = Recompute::dispatch;
  c.layers[1].recompute = Recompute::moe_act;
  c.layers[2].recompute = Recompute::experts;
  c.layers[3].recompute = Recompute::all_but_fc1;
  expect_same(run_stack(c), none);
  c.stacked = false;
  expect_same(run_stack(c), none);
}

TEST(Stack, BytesEqualTheEstimateAndGrowByTheLayersOwnPart) {
  for (Recompute r : {Recompute::none, Recompute::moe_act, Recompute::experts, Recompute::dispatch,
                      Recompute::all_but_fc1}) {
    SCOPED_TRACE(to_string(r));
    const std::vector<MoeConfig> layers = four_layers(r);
    const EchoConfig echo = echo_config();
    InProcessWorld world(2);
    world.run([&](int rank) {
      auto be = make_cpu_backend(DType::f64);
      const ParallelConfig par{2, rank};
      MoeStack stack(*be, world.communicator(rank), layers, par, echo);
      EXPECT_EQ(stack.bytes(), MoeStack::memory_bytes(layers, par, echo, DType::f64, DType::f64));
      size_t own = 0;
      for (int l = 0; l < stack.size(); ++l) {
        EXPECT_EQ(
            stack.layer(l).layer_bytes(),
            MoeLayer::layer_memory_bytes(layers[size_t(l)], par, echo, DType::f64, DType::f64));
        EXPECT_EQ(stack.layer(l).workspace_bytes(), stack.layer(l).layer_bytes())
            << "a layer of a stack owns no workspace";
        own += stack.layer(l).layer_bytes();
      }
      EXPECT_EQ(stack.bytes(), stack.workspace().bytes() + own);
    });
    // Eight copies of the last layer instead of four: the workspace stays, the layers add.
    const ParallelConfig par{2, 0};
    std::vector<MoeConfig> eight(8, layers[3]), four(4, layers[3]);
    const size_t b8 = MoeStack::memory_bytes(eight, par, echo, DType::f64, DType::f64);
    const size_t b4 = MoeStack::memory_bytes(four, par, echo, DType::f64, DType::f64);
    EXPECT_EQ(b8 - b4,
              4 * MoeLayer::layer_memory_bytes(layers[3], par, echo, DType::f64, DType::f64));
  }
  // What a layer keeps shrinks with each option: none > moe_act > experts > dispatch. all_but_fc1
  // keeps fc1's output (2F a row) where experts keeps the received rows (H = 16): more than
  // experts at F 24, less at F 4, and more than dispatch either way.
  const ParallelConfig par{2, 0};
  auto kept = [&](Recompute r, int ffn) {
    MoeConfig m = layer_config(ffn, 8, 2);
    m.recompute = r;
    return MoeLayer::layer_memory_bytes(m, par, echo_config(), DType::f64, DType::f64);
  };
  size_t last = SIZE_MAX;
  for (Recompute r :
       {Recompute::none, Recompute::moe_act, Recompute::experts, Recompute::dispatch}) {
    EXPECT_LT(kept(r, 24), last) << to_string(r);
    last = kept(r, 24);
  }
  EXPECT_GT(kept(Recompute::all_but_fc1, 24), kept(Recompute::experts, 24));
  EXPECT_LT(kept(Recompute::all_but_fc1, 4), kept(Recompute::experts, 4));
  for (int ffn : {4, 24})
    EXPECT_GT(kept(Recompute::all_but_fc1, ffn), kept(Recompute::dispatch, ffn)) << ffn;
}

// Master weights on the CPU backend (float masters of float weights: the same arithmetic): the
// steps give the bits of a layer without them, also after weights written from outside and
// refresh_master_weights; they cost one float per expert weight.
TEST(Stack, MasterWeightsGiveTheSameStepsOnTheCpu) {
  InProcessWorld world(1);
  world.run([&](int) {
    auto be = make_cpu_backend(DType::f32);
    Communicator& comm = world.communicator(0);
    MoeConfig plain = layer_config(24, 8, 2), mastered = plain;
    mastered.master_weights = true;
    const ParallelConfig par{1, 0};
    MoeLayer a(*be, comm, plain, par, echo_config(), 5),
        b(*be, comm, mastered, par, echo_config(), 5);
    EXPECT_EQ(b.layer_bytes() - a.layer_bytes(), size_t(8 * (H * 2 * 24 + 24 * H)) * sizeof(float));
    const int64_t T = 40;
    std::vector<void*> owned;
    auto tensor = [&](uint64_t seed) {
      Tensor t(nullptr, DType::f32, {T, H});
      t.data = be->allocate(t.bytes());
      owned.push_back(t.data);
      write_tensor(*be, t, random_values(size_t(T * H), seed));
      return t;
    };
    const Tensor x = tensor(1), dy = tensor(2), y = tensor(3), dx = tensor(4);
    AdamWConfig adam;
    adam.lr = 1e-2;
    for (int step = 0; step < 3; ++step) {
      if (step == 2)  // weights from outside (a checkpoint): the masters follow after a refresh
        for (MoeLayer* l : {&a, &b}) {
          write_tensor(*be, l->param(Param::w1), random_values(size_t(8 * H * 48), 9));
          if (l == &b) l->refresh_master_weights();
        }
      for (MoeLayer* l : {&a, &b}) {
        l->zero_grad();
        l->forward(x, y);
        l->backward(dy, dx);
        l->optimizer_step(adam);
      }
      for (Param p : {Param::w1, Param::w2, Param::router_weight})
        EXPECT_EQ(read_tensor(*be, a.param(p)), read_tensor(*be, b.param(p)))
            << "step " << step << " " << to_string(p);
    }
    for (void* p : owned) be->deallocate(p);
  });
}

// MoeMemory: the parts add up to memory_bytes and to what a built stack allocates, each part is
// the buffers it names, and a recompute option moves activations from the layers to the workspace.
TEST(Stack, MemoryBreakdownAddsUpToTheBytesAllocated) {
  const EchoConfig echo = echo_config();
  for (Recompute r : {Recompute::none, Recompute::moe_act, Recompute::experts, Recompute::dispatch,
                      Recompute::all_but_fc1}) {
    SCOPED_TRACE(to_string(r));
    std::vector<MoeConfig> layers = four_layers(r);
    layers[2].shared_experts = 1;  // shared experts' parameters, activations and temporaries
    for (bool optimizer : {false, true}) {
      InProcessWorld world(2);
      world.run([&](int rank) {
        auto be = make_cpu_backend(DType::f64);
        const ParallelConfig par{2, rank};
        MoeStack stack(*be, world.communicator(rank), layers, par, echo, 1, optimizer);
        const MoeMemory m =
            MoeStack::memory_breakdown(layers, par, echo, DType::f64, DType::f64, optimizer);
        EXPECT_EQ(m.total(), stack.bytes());
        EXPECT_EQ(m.total(),
                  MoeStack::memory_bytes(layers, par, echo, DType::f64, DType::f64, optimizer));
        EXPECT_EQ(m.workspace + m.echo_slot_weights + m.echo_slot_grads, stack.workspace().bytes());
        const MoeMemory w =
            MoeWorkspace::memory_breakdown(layers, par, echo, DType::f64, DType::f64);
        EXPECT_EQ(w.total(), stack.workspace().bytes());
        EXPECT_EQ(w.params + w.grads + w.optimizer + w.routing + w.activations + w.temporaries, 0u);
        for (int l = 0; l < stack.size(); ++l) {
          const MoeConfig& c = layers[size_t(l)];
          const MoeMemory own =
              MoeLayer::layer_memory_breakdown(c, par, echo, DType::f64, DType::f64, optimizer);
          EXPECT_EQ(own.total(), stack.layer(l).layer_bytes());
          EXPECT_EQ(own.workspace + own.echo_slot_weights + own.echo_slot_grads, 0u);
          // Parameters: router weight and bias, home experts, shared experts (all f64 here).
          const size_t E = size_t(c.experts), F = size_t(c.ffn), S = size_t(shared_width(c));
          const size_t home = 3 * H * F * (E / 2), shared = 3 * H * S;
          EXPECT_EQ(own.params, 8 * (E * H + E + home + shared));
          EXPECT_EQ(own.grads, 8 * (E * H + home + shared));
          EXPECT_EQ(own.optimizer, optimizer ? 16 * (E * H + home + shared) + 4 : 0u);
          // A layer alone: its own part plus a workspace of its own.
          MoeMemory alone = own;
          alone += MoeWorkspace::memory_breakdown({c}, par, echo, DType::f64, DType::f64);
          const MoeMemory apart =
              MoeLayer::memory_breakdown(c, par, echo, DType::f64, DType::f64, optimizer);
          EXPECT_EQ(apart.total(), alone.total());
          EXPECT_EQ(apart.total(),
                    MoeLayer::memory_bytes(c, par, echo, DType::f64, DType::f64, optimizer));
          EXPECT_EQ(apart.echo_slot_weights, alone.echo_slot_weights);
        }
        // The echo slots: 2 spare slots of the largest layer (F = 32), weights and gradients.
        EXPECT_EQ(m.echo_slot_weights, size_t(8 * 2 * 3 * H * 32));
        EXPECT_EQ(m.echo_slot_grads, size_t(8 * 2 * 3 * H * 32));
      });
    }
  }
  // What a layer keeps for its backward shrinks with each option; what it leaves to the workspace
  // lands there once for all layers.
  const ParallelConfig par{2, 0};
  const MoeConfig m = layer_config(24, 8, 2);
  const EchoConfig off = [] {
    EchoConfig e = echo_config();
    e.enabled = false;
    return e;
  }();
  const int64_t cap = capacity_rows(m);
  const size_t row = 8 * size_t(cap);
  const size_t kept[] = {row * (H + 2 * 24 + 24 + H), row * (H + 2 * 24 + H), row * H, 0};
  const Recompute options[] = {Recompute::none, Recompute::moe_act, Recompute::experts,
                               Recompute::dispatch};
  size_t workspace_none = 0;
  for (int i = 0; i < 4; ++i) {
    MoeConfig c = m;
    c.recompute = options[i];
    SCOPED_TRACE(to_string(c.recompute));
    const MoeMemory own = MoeLayer::layer_memory_breakdown(c, par, echo, DType::f64, DType::f64);
    EXPECT_EQ(own.activations, kept[i]);
    const MoeMemory w = MoeWorkspace::memory_breakdown(std::vector<MoeConfig>(4, c), par, echo,
                                                       DType::f64, DType::f64);
    if (i == 0) workspace_none = w.workspace;
    EXPECT_EQ(w.workspace - workspace_none, kept[0] - kept[i]) << "one copy for four layers";
    // Without ECHO, no echo slots.
    const MoeMemory no_echo = MoeStack::memory_breakdown({c}, par, off, DType::f64, DType::f64);
    EXPECT_EQ(no_echo.echo_slot_weights + no_echo.echo_slot_grads, 0u);
  }
}

TEST(Stack, RejectsAWorkspaceTooSmallForTheLayer) {
  InProcessWorld world(1);
  world.run([&](int) {
    auto be = make_cpu_backend(DType::f64);
    Communicator& comm = world.communicator(0);
    MoeWorkspace ws(*be, comm, {layer_config(16, 8, 2)}, ParallelConfig{1, 0}, echo_config());
    try {
      MoeLayer big(*be, comm, layer_config(32, 8, 2), ParallelConfig{1, 0}, echo_config(), 1, true,
                   &ws);
      ADD_FAILURE() << "no error for a layer larger than its workspace";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("build the workspace for this layer's config"),
                std::string::npos)
          << e.what();
    }
    EchoConfig other = echo_config();
    other.spare_slots_per_rank = 3;
    try {
      MoeLayer odd(*be, comm, layer_config(16, 8, 2), ParallelConfig{1, 0}, other, 1, true, &ws);
      ADD_FAILURE() << "no error for another number of echo slots";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("number of echo slots"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace moe_echo::test
