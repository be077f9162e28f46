// Fuzz target: config validation plus layer construction on the CPU backend. Each input is a
// MoE, parallel and ECHO config (sizes mostly small, sometimes extreme, NaN and infinity among
// the doubles). validate() either throws moe_echo::ConfigError, or the config is valid: then,
// when the layer is small enough to build quickly (MoeLayer::memory_bytes), every rank of an
// in-process world builds the layer and runs one forward and backward step on random tokens, and
// the outputs must be finite. Anything else (another exception, a crash, a sanitizer finding) is
// a finding.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "moe_echo/backends.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/config.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/layer.hpp"
#include "moe_echo/random.hpp"

namespace {

using namespace moe_echo;

// Mostly a small size in [lo, hi]; now and then any int (negative, huge).
int size_in(FuzzedDataProvider& in, int lo, int hi) {
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) return in.ConsumeIntegral<int>();
  return in.ConsumeIntegralInRange<int>(lo, hi);
}

// Mostly a value in [lo, hi]; now and then NaN, an infinity, a negative or a huge value.
double value_in(FuzzedDataProvider& in, double lo, double hi) {
  switch (in.ConsumeIntegralInRange<int>(0, 19)) {
    case 0: return std::numeric_limits<double>::quiet_NaN();
    case 1: return std::numeric_limits<double>::infinity();
    case 2: return -in.ConsumeFloatingPoint<double>();
    case 3: return in.ConsumeFloatingPoint<double>();
    default: return in.ConsumeFloatingPointInRange<double>(lo, hi);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  MoeConfig moe;
  moe.hidden = size_in(in, 1, 24);
  moe.ffn = size_in(in, 1, 24);
  moe.experts = size_in(in, 1, 16);
  moe.top_k = size_in(in, 1, 4);
  moe.max_tokens = size_in(in, 1, 33);
  moe.score_function = in.ConsumeBool() ? ScoreFunction::softmax : ScoreFunction::sigmoid;
  moe.normalize_topk = in.ConsumeBool();
  moe.aux_loss_coeff = value_in(in, 0, 1);
  moe.z_loss_coeff = value_in(in, 0, 1);
  moe.bias_update = in.ConsumeBool();
  moe.bias_update_rate = value_in(in, 0, 0.1);
  ParallelConfig par;
  par.ep_size = size_in(in, 1, 4);
  EchoConfig echo;
  echo.enabled = in.ConsumeBool();
  echo.spare_slots_per_rank = size_in(in, 0, 4);
  moe.capacity_factor = value_in(in, 0.05, 3);
  echo.max_clones_per_expert = size_in(in, 0, 4);
  echo.clone_cost_rows = in.ConsumeIntegralInRange<int>(0, 3) == 0
                             ? in.ConsumeIntegral<int64_t>()
                             : in.ConsumeIntegralInRange<int64_t>(0, 64);
  const uint64_t seed = in.ConsumeIntegral<uint64_t>();
  try {
    validate(moe, par, echo);
  } catch (const ConfigError&) {
    return 0;
  }
  // A valid config: build and run it when it is small (a fuzz run must stay fast).
  const size_t bytes =
      MoeLayer::memory_bytes(moe, par, echo, DType::f64, DType::f64, /*optimizer_state=*/true);
  if (bytes > (size_t(64) << 20) || par.ep_size > 4) return 0;
  const int R = par.ep_size, T = moe.max_tokens, H = moe.hidden;
  InProcessWorld world(R);
  world.run([&](int rank) {
    auto backend = make_backend("cpu");
    MoeLayer layer(*backend, world.communicator(rank), moe, ParallelConfig{R, rank}, echo, seed);
    auto alloc = [&](std::initializer_list<int64_t> dims) {
      Tensor t(nullptr, backend->activation_dtype(), dims);
      t.data = backend->allocate(t.bytes());
      return t;
    };
    Tensor x = alloc({T, H}), y = alloc({T, H}), dy = alloc({T, H}), dx = alloc({T, H});
    std::vector<double> xh(size_t(T) * size_t(H));
    Rng rng(seed, 1, uint64_t(rank));
    for (auto& v : xh) v = rng.normal();
    write_tensor(*backend, x, xh);
    for (auto& v : xh) v = rng.normal();
    write_tensor(*backend, dy, xh);
    layer.zero_grad();
    layer.forward(x, y);
    layer.backward(dy, dx);
    // Outputs are finite for coefficients of sensible size; a finite coefficient near the
    // largest double may overflow a loss term, which validate() does not bound.
    if (moe.aux_loss_coeff <= 1e6 && moe.z_loss_coeff <= 1e6 && moe.bias_update_rate <= 1e6)
      for (const Tensor* t : {&y, &dx})
        for (double v : read_tensor(*backend, *t))
          MOE_ECHO_CHECK(std::isfinite(v), "a layer output is not finite: " << v);
    for (void* p : {x.data, y.data, dy.data, dx.data}) backend->deallocate(p);
  });
  return 0;
}
