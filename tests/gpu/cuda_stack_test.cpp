// MoeStack on the CUDA backend (one GPU, the local communicator): four layers of different shapes
// on one shared workspace against the same layers built apart, bit for bit, over two steps (the
// second adds to the first's gradients), with spill rounds; every recompute option against none,
// bit for bit; a whole training step of the stack (zero_grad, four forwards, four backwards,
// AdamW) captured in one CUDA graph and replayed with new tokens against the same step run eagerly
// on a second stack; and the bytes the stack allocates against MoeStack::memory_bytes. The CUDA
// layer itself is checked against the CPU layer in cuda_layer_test. Skipped without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "moe_echo/cuda.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/layer.hpp"

namespace moe_echo::test {
namespace {

constexpr int64_t H = 64;

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
  m.capacity_factor = 0.4;
  return m;
}

// With one rank, spill rounds come from the capacity factor: ceil(0.4 * 64 * K) rows per round
// against 48 K rows.
std::vector<MoeConfig> four_layers(Recompute r = Recompute::none) {
  return {layer_config(32, 8, 2, r), layer_config(48, 8, 3, r), layer_config(64, 4, 2, r),
          layer_config(32, 16, 4, r)};
}

EchoConfig echo_config() {
  EchoConfig e;
  e.spare_slots_per_rank = 2;
  return e;
}

constexpr int64_t kTokens = 48;

struct Model {
  std::unique_ptr<Backend> be = cuda::make_cuda_backend();
  std::unique_ptr<Communicator> comm = cuda::make_local_communicator();
  std::unique_ptr<MoeStack> stack;
  std::vector<std::unique_ptr<MoeLayer>> apart;
  std::vector<std::unique_ptr<OwnedTensor>> acts, grads;  // [L + 1] each
  Model(const std::vector<MoeConfig>& layers, bool stacked, uint64_t seed) {
    const ParallelConfig par{1, 0};
    if (stacked)
      stack = std::make_unique<MoeStack>(*be, *comm, layers, par, echo_config(), seed);
    else
      for (size_t l = 0; l < layers.size(); ++l)
        apart.push_back(std::make_unique<MoeLayer>(*be, *comm, layers[l], par, echo_config(),
                                                   seed + uint64_t(l)));
    for (size_t l = 0; l <= layers.size(); ++l) {
      acts.push_back(std::unique_ptr<OwnedTensor>(new OwnedTensor(*be, DType::bf16, {kTokens, H})));
      grads.push_back(
          std::unique_ptr<OwnedTensor>(new OwnedTensor(*be, DType::bf16, {kTokens, H})));
      poison(*acts.back());
      poison(*grads.back());
    }
  }
  int size() const { return stack ? stack->size() : int(apart.size()); }
  MoeLayer& layer(int l) { return stack ? stack->layer(l) : *apart[size_t(l)]; }
  void inputs(uint64_t seed) {
    acts[0]->write(round_bf16(random_values(size_t(kTokens * H), seed, -1, 1)));
    grads[size_t(size())]->write(round_bf16(random_values(size_t(kTokens * H), seed + 1, -1, 1)));
  }
  void step(bool zero, Stream s = nullptr) {
    const int L = size();
    if (zero)
      for (int l = 0; l < L; ++l) layer(l).zero_grad(s);
    for (int l = 0; l < L; ++l) layer(l).forward(**acts[size_t(l)], **acts[size_t(l + 1)], s);
    for (int l = L - 1; l >= 0; --l)
      layer(l).backward(**acts[size_t(l)], **grads[size_t(l + 1)], **grads[size_t(l)], s);
  }
  // Every output, input gradient and parameter gradient, and the spill rounds, of every layer.
  std::vector<std::vector<double>> record() {
    std::vector<std::vector<double>> r;
    for (int l = 0; l < size(); ++l) {
      r.push_back(acts[size_t(l + 1)]->read());
      r.push_back(grads[size_t(l)]->read());
      for (Param p : {Param::router_weight, Param::w1, Param::w2})
        r.push_back(read_tensor(*be, layer(l).grad(p)));
      r.push_back({double(layer(l).stats().spill_rounds)});
    }
    return r;
  }
};

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
    EXPECT_EQ(a[i], b[i]) << what << ": record " << i << " (layer " << i / 6 << ")";
}

TEST(CudaStack, EqualsLayersBuiltApartAndEveryRecomputeGivesTheBitsOfNone) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  std::vector<std::vector<double>> none;
  {
    Model stacked(four_layers(), true, 9);
    none = two_steps(stacked);
    for (int l = 0; l < 4; ++l)
      EXPECT_GE(stacked.layer(l).stats().spill_rounds, 1) << "layer " << l << " spills";
  }
  {
    Model apart(four_layers(), false, 9);
    expect_bits_equal(two_steps(apart), none, "layers built apart");
  }
  for (Recompute r :
       {Recompute::moe_act, Recompute::experts, Recompute::dispatch, Recompute::all_but_fc1}) {
    Model m(four_layers(r), true, 9);
    expect_bits_equal(two_steps(m), none, std::string("recompute ") + to_string(r));
  }
}

TEST(CudaStack, WholeTrainingStepInOneGraphEqualsTheEagerStep) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  std::vector<MoeConfig> layers = four_layers();
  layers[1].recompute = Recompute::dispatch;
  layers[2].recompute = Recompute::moe_act;
  AdamWConfig adam;
  adam.lr = 1e-3;
  adam.weight_decay = 0.01;
  Model captured(layers, true, 3), eager(layers, true, 3);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Stream s = stream;
  std::unique_ptr<cuda::CapturedGraph> graph;
  ASSERT_NO_THROW(graph = std::make_unique<cuda::CapturedGraph>(stream, [&] {
                    captured.step(true, s);
                    for (int l = 0; l < captured.size(); ++l)
                      captured.layer(l).optimizer_step(adam, s);
                  }));
  EXPECT_GE(graph->conditional_nodes(), 8u) << "spill rounds of every layer, forward and backward";
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    captured.inputs(300 + 10 * uint64_t(replay));
    eager.inputs(300 + 10 * uint64_t(replay));
    for (int l = 0; l < captured.size(); ++l) {  // every output and input gradient
      poison(*captured.acts[size_t(l + 1)]);
      poison(*captured.grads[size_t(l)]);
    }
    graph->launch(stream);
    eager.step(true, s);
    for (int l = 0; l < eager.size(); ++l) eager.layer(l).optimizer_step(adam, s);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    expect_bits_equal(captured.record(), eager.record(), "captured vs eager");
    for (int l = 0; l < captured.size(); ++l)
      for (Param p : {Param::router_weight, Param::w1, Param::w2})
        EXPECT_EQ(read_tensor(*captured.be, captured.layer(l).param(p)),
                  read_tensor(*eager.be, eager.layer(l).param(p)))
            << "layer " << l << " " << to_string(p) << " after AdamW";
    if (HasFailure()) break;
  }
  graph.reset();
  cudaStreamDestroy(stream);
}

TEST(CudaStack, BytesEqualTheEstimate) {
  MOE_ECHO_SKIP_WITHOUT_GPU();
  for (Recompute r : {Recompute::none, Recompute::moe_act, Recompute::experts, Recompute::dispatch,
                      Recompute::all_but_fc1}) {
    const std::vector<MoeConfig> layers = four_layers(r);
    Model m(layers, true, 1);
    EXPECT_EQ(m.stack->bytes(), MoeStack::memory_bytes(layers, ParallelConfig{1, 0}, echo_config(),
                                                       DType::bf16, DType::f32))
        << to_string(r);
  }
}

}  // namespace
}  // namespace moe_echo::test
