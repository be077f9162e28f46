// Runs one forward + backward of a MoE layer on R in-process ranks and collects everything on
// the host, so layer tests can compare layouts (R ranks vs 1, ECHO on vs off, capacities).
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include "moe_echo/backends.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/layer.hpp"

namespace moe_echo::test {

struct LayerCase {
  MoeConfig moe;
  int ranks = 1;
  EchoConfig echo;
  uint64_t seed = 7;
  DType dtype = DType::f64;
  int passes = 1;  // forward + backward passes after one zero_grad (gradients accumulate)
  // backward_into tensors of the test's own (poisoned first) instead of the layer's buffers
  // (with split phases, backward_dispatch with them); with one pass only.
  bool backward_into = false;
  // The layer built with its own w1/w2 gradient buffers (LayerOwns; without, no optimizer
  // state either, and backward_into only).
  bool expert_grads = true;
  // Each forward and backward as its three split-phase calls (MoeLayer::forward_dispatch ...).
  bool split_phases = false;
  // The world's ranks per node (InProcessWorld): 0, one node.
  int ranks_per_node = 0;
};

// Parameters of the whole layer (all experts), to override the seeded initial values.
struct GlobalParams {
  std::vector<double> router_weight;  // [E, H]
  std::vector<double> router_bias;    // [E]
  std::vector<double> w1;             // [E, H, 2F]
  std::vector<double> w2;             // [E, F, H]
  std::vector<double> shared_w1;      // [H, 2S] (shared experts; every rank holds them)
  std::vector<double> shared_w2;      // [S, H]
};

struct LayerRun {
  std::vector<std::vector<double>> y, dx, d_router;  // per rank
  std::vector<double> dw1, dw2;                      // all experts, home gradients concatenated
  std::vector<std::vector<double>> d_shared_w1, d_shared_w2;  // per rank (not all-reduced)
  GlobalParams params;                                        // as initialised (or overridden)
  std::vector<StepStats> stats;                               // per rank
  double objective = 0;  // sum over ranks of <y_r, g_r> + aux_r + z_r + seq_aux_r
};

// The communicator of one rank, from the in-process world whose threads run the ranks, the rank
// and its backend; left empty, the world's own (in-process) communicator.
using CommunicatorOf =
    std::function<Communicator&(InProcessWorld& world, int rank, Backend& backend)>;

// Writes rank r's part of `params` into the layer (router weight and bias, its home experts'
// w1 and w2 out of R ranks', the shared experts when given).
void set_params(Backend& be, MoeLayer& layer, const GlobalParams& params, int r, int R);

// x[r] holds T_r * H values (T_r may differ per rank, <= max_tokens); g[r] the same shape.
LayerRun run_layer(const LayerCase& c, const std::vector<std::vector<double>>& x,
                   const std::vector<std::vector<double>>& g,
                   const std::optional<GlobalParams>& params = std::nullopt,
                   const CommunicatorOf& communicator = {});

// Tokens that route with Zipf-skewed popularity: the router weight is overridden to match.
struct SkewedInput {
  std::vector<std::vector<double>> x;
  GlobalParams params;
};
SkewedInput skewed(const LayerCase& c, int tokens, double exponent, uint64_t seed);

}  // namespace moe_echo::test
