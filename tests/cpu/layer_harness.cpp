#include "layer_harness.hpp"

#include <mutex>

#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/synthetic.hpp"

namespace moe_echo::test {

void set_params(Backend& be, MoeLayer& layer, const GlobalParams& params, int r, int R) {
  const MoeConfig& m = layer.moe_config();
  const int64_t EPR = m.experts / R;
  const size_t w1n = size_t(m.hidden) * 2 * size_t(m.ffn), w2n = size_t(m.ffn) * size_t(m.hidden);
  write_tensor(be, layer.param(Param::router_weight), params.router_weight);
  write_tensor(be, layer.param(Param::router_bias), params.router_bias);
  write_tensor(be, layer.param(Param::w1),
               std::vector<double>(params.w1.begin() + r * EPR * w1n,
                                   params.w1.begin() + (r + 1) * EPR * w1n));
  write_tensor(be, layer.param(Param::w2),
               std::vector<double>(params.w2.begin() + r * EPR * w2n,
                                   params.w2.begin() + (r + 1) * EPR * w2n));
  if (!params.shared_w1.empty()) {
    write_tensor(be, layer.param(Param::shared_w1), params.shared_w1);
    write_tensor(be, layer.param(Param::shared_w2), params.shared_w2);
  }
}

LayerRun run_layer(const LayerCase& c, const std::vector<std::vector<double>>& x,
                   const std::vector<std::vector<double>>& g,
                   const std::optional<GlobalParams>& params, const CommunicatorOf& communicator) {
  const int R = c.ranks;
  const int64_t H = c.moe.hidden, F = c.moe.ffn, E = c.moe.experts, EPR = E / R;
  LayerRun out;
  out.y.resize(size_t(R));
  out.dx.resize(size_t(R));
  out.d_router.resize(size_t(R));
  out.stats.resize(size_t(R));
  out.d_shared_w1.resize(size_t(R));
  out.d_shared_w2.resize(size_t(R));
  out.dw1.assign(size_t(E * H * 2 * F), 0.0);
  out.dw2.assign(size_t(E * F * H), 0.0);
  out.params.w1.assign(size_t(E * H * 2 * F), 0.0);
  out.params.w2.assign(size_t(E * F * H), 0.0);
  std::vector<double> objective(size_t(R), 0.0);
  InProcessWorld world(R, default_timeout(), c.ranks_per_node);
  world.run([&](int r) {
    auto be = make_cpu_backend(c.dtype);
    Communicator& comm = communicator ? communicator(world, r, *be) : world.communicator(r);
    MoeLayer layer(*be, comm, c.moe, ParallelConfig{R, r}, c.echo, c.seed,
                   LayerOwns(/*optimizer=*/c.expert_grads, c.expert_grads));
    const size_t w1n = size_t(H * 2 * F), w2n = size_t(F * H);
    if (params) set_params(*be, layer, *params, r, R);
    const int64_t T = int64_t(x[size_t(r)].size()) / H;
    auto alloc = [&](const std::vector<double>* init) {
      Tensor t(nullptr, be->activation_dtype(), {T, H});
      t.data = be->allocate(t.bytes() ? t.bytes() : 1);
      std::vector<double> poison(size_t(T * H), 1e30);
      write_tensor(*be, t, init ? *init : poison);
      return t;
    };
    Tensor xt = alloc(&x[size_t(r)]), yt = alloc(nullptr), gt = alloc(&g[size_t(r)]),
           dxt = alloc(nullptr);
    layer.zero_grad();
    Tensor dw1_into(nullptr, be->float_dtype(), {EPR, H, 2 * F}),
        dw2_into(nullptr, be->float_dtype(), {EPR, F, H});
    if (c.backward_into) {
      MOE_ECHO_CHECK(c.passes == 1, "backward_into takes one pass, not " << c.passes);
      for (Tensor* t : {&dw1_into, &dw2_into}) {
        t->data = be->allocate(t->bytes());
        write_tensor(*be, *t, std::vector<double>(size_t(t->numel()), 1e30));
      }
      if (c.split_phases) {
        layer.forward_dispatch(xt, yt);
        layer.forward_experts();
        layer.forward_combine();
        layer.backward_dispatch(gt, dxt, {dw1_into, dw2_into});
        layer.backward_experts();
        layer.backward_combine();
      } else {
        layer.forward(xt, yt);
        layer.backward_into(xt, gt, dxt, {dw1_into, dw2_into});
      }
    }
    for (int pass = 0; pass < c.passes && !c.backward_into; ++pass) {
      if (c.split_phases) {
        layer.forward_dispatch(xt, yt);
        layer.forward_experts();
        layer.forward_combine();
        layer.backward_dispatch(gt, dxt);
        layer.backward_experts();
        layer.backward_combine();
      } else {
        layer.forward(xt, yt);
        layer.backward(gt, dxt);
      }
    }
    out.y[size_t(r)] = read_tensor(*be, yt);
    out.dx[size_t(r)] = read_tensor(*be, dxt);
    out.d_router[size_t(r)] = read_tensor(*be, layer.grad(Param::router_weight));
    out.stats[size_t(r)] = layer.stats();
    const auto dw1 = read_tensor(*be, c.backward_into ? dw1_into : layer.grad(Param::w1));
    const auto dw2 = read_tensor(*be, c.backward_into ? dw2_into : layer.grad(Param::w2));
    const auto w1 = read_tensor(*be, layer.param(Param::w1));
    const auto w2 = read_tensor(*be, layer.param(Param::w2));
    std::copy(dw1.begin(), dw1.end(), out.dw1.begin() + r * EPR * w1n);
    std::copy(dw2.begin(), dw2.end(), out.dw2.begin() + r * EPR * w2n);
    std::copy(w1.begin(), w1.end(), out.params.w1.begin() + r * EPR * w1n);
    std::copy(w2.begin(), w2.end(), out.params.w2.begin() + r * EPR * w2n);
    if (shared_width(c.moe) > 0) {
      out.d_shared_w1[size_t(r)] = read_tensor(*be, layer.grad(Param::shared_w1));
      out.d_shared_w2[size_t(r)] = read_tensor(*be, layer.grad(Param::shared_w2));
    }
    if (r == 0) {
      out.params.router_weight = read_tensor(*be, layer.param(Param::router_weight));
      out.params.router_bias = read_tensor(*be, layer.param(Param::router_bias));
      if (shared_width(c.moe) > 0) {
        out.params.shared_w1 = read_tensor(*be, layer.param(Param::shared_w1));
        out.params.shared_w2 = read_tensor(*be, layer.param(Param::shared_w2));
      }
    }
    double obj = out.stats[size_t(r)].aux_loss + out.stats[size_t(r)].z_loss +
                 out.stats[size_t(r)].seq_aux_loss;
    for (size_t i = 0; i < out.y[size_t(r)].size(); ++i)
      obj += out.y[size_t(r)][i] * g[size_t(r)][i];
    objective[size_t(r)] = obj;
    for (Tensor* t : {&xt, &yt, &gt, &dxt}) be->deallocate(t->data);
    for (Tensor* t : {&dw1_into, &dw2_into})
      if (t->data) be->deallocate(t->data);
  });
  for (double o : objective) out.objective += o;
  return out;
}

SkewedInput skewed(const LayerCase& c, int tokens, double exponent, uint64_t seed) {
  SkewSpec spec;
  spec.exponent = exponent;
  SyntheticTokens synth(c.moe.experts, c.moe.hidden, spec, seed);
  SkewedInput in;
  for (int r = 0; r < c.ranks; ++r) in.x.push_back(synth.tokens(0, r, tokens));
  in.params = run_layer(c, in.x, in.x).params;  // the seeded experts
  in.params.router_weight = synth.router_weight();
  return in;
}

}  // namespace moe_echo::test
