// MoeStack on R GPUs (one process each, the NCCL communicators): three layers of different shapes
// sharing one workspace and one pool of echo slots, against the same layers built apart, bit for
// bit, over two steps (the second adds to the first's gradients), with a hot expert in two layers
// (clones made in both, so the pool changes owner between a layer's forward and its backward) and
// spill rounds in every layer; every recompute option against none, bit for bit; a whole training
// step of the stack (zero_grad, forwards, backwards, router all-reduce, AdamW) in one CUDA graph
// per rank (the sync-free communicator), replayed with new tokens, against the same step run
// eagerly on a second stack. Each communicator (sync-free, baseline dispatcher, host-API mode) runs
// the stack-against-apart and recompute comparisons. The layer itself is checked against the CPU
// layers in multigpu_layer_test.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "moe_echo/cuda.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/layer.hpp"
#include "multigpu_world.hpp"

namespace moe_echo::test {
namespace {

constexpr int64_t H = 64;

// Capacity ceil(0.6 * 64 * K) rows a round against about 46 K rows per rank: spill rounds even
// after ECHO has balanced the loads.
MoeConfig layer_config(int ffn, int experts, int top_k, Recompute r) {
  MoeConfig m;
  m.hidden = int(H);
  m.ffn = ffn;
  m.experts = experts;
  m.top_k = top_k;
  m.max_tokens = 64;
  m.aux_loss_coeff = 0.01;
  m.z_loss_coeff = 0.001;
  m.recompute = r;
  m.capacity_factor = 0.6;
  return m;
}

std::vector<MoeConfig> three_layers(int R, Recompute r = Recompute::none) {
  return {layer_config(32, 4 * R, 2, r), layer_config(48, 2 * R, 3, r),
          layer_config(64, 4 * R, 2, r)};
}

EchoConfig echo_config() {
  EchoConfig e;
  e.enabled = true;
  e.spare_slots_per_rank = 2;
  e.max_clones_per_expert = 2;
  return e;
}

int64_t tokens(int rank) { return 48 - 3 * rank; }

struct Model {
  MultiGpuWorld& w;
  Communicator& comm;
  std::unique_ptr<MoeStack> stack;
  std::vector<std::unique_ptr<MoeLayer>> apart;
  std::vector<std::unique_ptr<OwnedTensor>> acts, grads;  // [L + 1] each
  const int64_t T;
  Model(MultiGpuWorld& world, Communicator& c, const std::vector<MoeConfig>& layers, bool stacked,
        uint64_t seed)
      : w(world), comm(c), T(tokens(world.rank())) {
    Backend& be = *w.be;
    const ParallelConfig par{w.size(), w.rank()};
    if (stacked)
      stack = std::make_unique<MoeStack>(be, comm, layers, par, echo_config(), seed);
    else
      for (size_t l = 0; l < layers.size(); ++l)
        apart.push_back(std::make_unique<MoeLayer>(be, comm, layers[l], par, echo_config(),
                                                   seed + uint64_t(l)));
    // A hot expert in layers 0 and 2 (a router bias every token's scores feel): clones in both.
    for (int l : {0, 2}) {
      std::vector<double> bias = read_tensor(be, layer(l).param(Param::router_bias));
      bias[size_t(l + 1)] += 4.0;
      write_tensor(be, layer(l).param(Param::router_bias), bias);
    }
    for (size_t l = 0; l <= layers.size(); ++l) {
      acts.push_back(std::unique_ptr<OwnedTensor>(new OwnedTensor(be, DType::bf16, {T, H})));
      grads.push_back(std::unique_ptr<OwnedTensor>(new OwnedTensor(be, DType::bf16, {T, H})));
      poison(*acts.back());
      poison(*grads.back());
    }
  }
  ~Model() {
    w.be->synchronize();
    comm.barrier();  // nobody frees its windows while a peer still reads them
  }
  int size() const { return stack ? stack->size() : int(apart.size()); }
  MoeLayer& layer(int l) { return stack ? stack->layer(l) : *apart[size_t(l)]; }
  void inputs(uint64_t seed) {
    const uint64_t s = seed + 17 * uint64_t(w.rank());
    acts[0]->write(round_bf16(random_values(size_t(T * H), s, -1, 1)));
    grads[size_t(size())]->write(round_bf16(random_values(size_t(T * H), s + 1, -1, 1)));
  }
  void step(bool zero, Stream s = nullptr) {
    const int L = size();
    if (zero)
      for (int l = 0; l < L; ++l) layer(l).zero_grad(s);
    for (int l = 0; l < L; ++l) layer(l).forward(**acts[size_t(l)], **acts[size_t(l + 1)], s);
    for (int l = L - 1; l >= 0; --l)
      layer(l).backward(**acts[size_t(l)], **grads[size_t(l + 1)], **grads[size_t(l)], s);
  }
  void train_step(const AdamWConfig& adam, Stream s) {
    step(true, s);
    for (int l = 0; l < size(); ++l) {
      layer(l).all_reduce_router_grad(s);
      layer(l).optimizer_step(adam, s);
    }
  }
  // Every output, input gradient, parameter gradient and statistic that tells the routing, of
  // every layer.
  std::vector<std::vector<double>> record() {
    Backend& be = *w.be;
    std::vector<std::vector<double>> r;
    for (int l = 0; l < size(); ++l) {
      r.push_back(acts[size_t(l + 1)]->read());
      r.push_back(grads[size_t(l)]->read());
      for (Param p : {Param::router_weight, Param::w1, Param::w2})
        r.push_back(read_tensor(be, layer(l).grad(p)));
      const StepStats st = layer(l).stats();
      r.push_back({double(st.spill_rounds), double(st.clones)});
    }
    return r;
  }
  std::vector<std::vector<double>> params() {
    std::vector<std::vector<double>> r;
    for (int l = 0; l < size(); ++l)
      for (Param p : {Param::router_weight, Param::router_bias, Param::w1, Param::w2})
        r.push_back(read_tensor(*w.be, layer(l).param(p)));
    return r;
  }
};

constexpr size_t kRecordsPerLayer = 6;

// Two steps: zero_grad, forward, backward; then forward and backward adding to the gradients.
std::vector<std::vector<double>> two_steps(Model& m) {
  m.inputs(100);
  m.step(true);
  m.inputs(200);
  m.step(false);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return m.record();
}

void expect_bits_equal(const std::vector<std::vector<double>>& a,
                       const std::vector<std::vector<double>>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(a[i], b[i]) << what << ": record " << i << " (layer " << i / kRecordsPerLayer << ")";
}

class MultiGpuStack : public ::testing::TestWithParam<CommKind> {};

TEST_P(MultiGpuStack, EqualsLayersBuiltApartAndEveryRecomputeGivesTheBitsOfNone) {
  MOE_ECHO_MULTIGPU_WORLD(w);
  Communicator& comm = w->comm(GetParam());
  const int R = w->size();
  std::vector<std::vector<double>> none;
  {
    Model stacked(*w, comm, three_layers(R), true, 9);
    none = two_steps(stacked);
    for (int l = 0; l < 3; ++l) {
      const StepStats st = stacked.layer(l).stats();
      EXPECT_GE(st.spill_rounds, 1) << "layer " << l << " spills";
      if (l != 1) {
        EXPECT_GT(st.clones, 0) << "layer " << l << " has a hot expert: clones";
      }
    }
  }
  {
    Model apart(*w, comm, three_layers(R), false, 9);
    expect_bits_equal(two_steps(apart), none, "layers built apart");
  }
  for (Recompute r :
       {Recompute::moe_act, Recompute::experts, Recompute::dispatch, Recompute::all_but_fc1}) {
    Model m(*w, comm, three_layers(R, r), true, 9);
    expect_bits_equal(two_steps(m), none, std::string("recompute ") + to_string(r));
  }
}

TEST_P(MultiGpuStack, WholeTrainingStepInOneGraphEqualsTheEagerStep) {
  MOE_ECHO_MULTIGPU_WORLD(w);
  if (GetParam() != CommKind::syncfree)
    GTEST_SKIP() << "only the sync-free communicator is capturable (the others wait on the host)";
  Communicator& comm = w->comm(GetParam());
  if (!comm.capturable())
    GTEST_SKIP() << "across nodes the sync-free communicator is capturable only with its clone "
                    "staging (MOE_ECHO_GIN_CLONE_SLOT_BYTES)";
  const int R = w->size();
  AdamWConfig adam;
  adam.eps = 1e-2;
  adam.weight_decay = 0.01;
  Model eager(*w, comm, three_layers(R, Recompute::dispatch), true, 4);
  Model captured(*w, comm, three_layers(R, Recompute::dispatch), true, 4);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::unique_ptr<cuda::CapturedGraph> graph;
  std::string capture_error;
  try {
    graph =
        std::make_unique<cuda::CapturedGraph>(stream, [&] { captured.train_step(adam, stream); });
  } catch (const std::exception& e) {
    capture_error = e.what();
  }
  const auto ok = w->all_gather(std::vector<int>{graph ? 1 : 0});
  bool all_ok = true;
  for (const auto& v : ok) all_ok = all_ok && v[0] == 1;
  ASSERT_TRUE(all_ok) << "capture failed on some rank: " << capture_error;
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    eager.inputs(300 + uint64_t(replay) * 10);
    captured.inputs(300 + uint64_t(replay) * 10);
    poison(*captured.acts.back());
    poison(*captured.grads.front());
    eager.train_step(adam, stream);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    w->rv->barrier();
    graph->launch(stream);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    expect_bits_equal(captured.record(), eager.record(), "graph replay");
    const auto pe = eager.params(), pc = captured.params();
    ASSERT_EQ(pe.size(), pc.size());
    for (size_t i = 0; i < pe.size(); ++i) EXPECT_EQ(pc[i], pe[i]) << "parameter " << i;
  }
  graph.reset();
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

INSTANTIATE_TEST_SUITE_P(Comms, MultiGpuStack, ::testing::ValuesIn(kAllComms),
                         [](const auto& p) { return std::string(to_string(p.param)); });

}  // namespace
}  // namespace moe_echo::test
