// Every CPU op through the Backend interface, in f64 and f32, against the naive references of
// ops_reference.hpp and against central finite differences.
//
// How every test reads:
// - Inputs are fresh random values from seeded generators (never zeros; AdamW also runs from the
//   zero moments of a real first step). Outputs are poisoned before each call (kPoison, or
//   kPoisonInt for i32) and must be fully written where the contract says so and keep the poison
//   where it says "untouched". Input rows the contract says are never read hold NaN, so a read
//   would show up in a valid output.
// - Every tensor has guard bytes on both sides; an op that writes outside its tensors fails.
// - Float outputs are compared by relative norm with tolerance 1e-12 (f64) or 1e-5 (f32);
//   integer outputs (top-k indices, counts, destinations, offsets, flags) must match exactly.
// - Gradients are checked by central differences in f64 (relative 1e-6), and linear ops also by
//   their adjoint identities.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "model_routing_reference.hpp"
#include "moe_echo/backend.hpp"
#include "moe_echo/backends.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/planner.hpp"
#include "ops_reference.hpp"
#include "test_util.hpp"

namespace moe_echo {

// Readable test parameters in failure messages (found by argument-dependent lookup).
static void PrintTo(DType dt, std::ostream* os) { *os << to_string(dt); }
static void PrintTo(ScoreFunction f, std::ostream* os) { *os << to_string(f); }

namespace {

using test::rel_error;

constexpr double kPoison = 0x1p100;  // exact in f32 and f64, far from any value an op produces
constexpr int32_t kPoisonInt = -123456789;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kFdTolerance = 1e-6;

double tolerance(DType dt) { return dt == DType::f64 ? 1e-12 : 1e-5; }

std::string dtype_name(DType dt) { return to_string(dt); }

// ---- Buffers with guard bytes -------------------------------------------------------------------

// Owns the backend allocations of one test; every tensor sits between two guard regions.
class Arena {
 public:
  explicit Arena(Backend& be) : be_(be) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() {
    for (const Block& b : blocks_) be_.deallocate(b.base);
  }

  Tensor make(DType dt, std::initializer_list<int64_t> dims) {
    Tensor t(nullptr, dt, dims);
    const size_t bytes = t.bytes();
    auto* base = static_cast<unsigned char*>(be_.allocate(bytes + 2 * kGuard));
    const std::vector<unsigned char> pattern(kGuard, kGuardByte);
    be_.copy_from_host(base, pattern.data(), kGuard);
    be_.copy_from_host(base + kGuard + bytes, pattern.data(), kGuard);
    blocks_.push_back({base, bytes});
    t.data = base + kGuard;
    return t;
  }

  // True when nothing was written outside the tensors handed out.
  bool guards_intact() const {
    std::vector<unsigned char> seen(kGuard);
    for (const Block& b : blocks_) {
      for (const unsigned char* at : {b.base, b.base + kGuard + b.bytes}) {
        be_.copy_to_host(seen.data(), at, kGuard);
        for (unsigned char c : seen)
          if (c != kGuardByte) return false;
      }
    }
    return true;
  }

 private:
  static constexpr size_t kGuard = 64;
  static constexpr unsigned char kGuardByte = 0xA5;
  struct Block {
    unsigned char* base;
    size_t bytes;
  };
  Backend& be_;
  std::vector<Block> blocks_;
};

// ---- Host <-> tensor helpers --------------------------------------------------------------------

std::vector<double> get(Backend& be, const Tensor& t) { return read_tensor(be, t); }
void put(Backend& be, const Tensor& t, const std::vector<double>& v) { write_tensor(be, t, v); }

// Writes uniform random values in [lo, hi) and returns them as the tensor holds them.
std::vector<double> put_random(Backend& be, const Tensor& t, uint64_t seed, double lo = -1.0,
                               double hi = 1.0) {
  put(be, t, test::random_values(size_t(t.numel()), seed, lo, hi));
  return get(be, t);
}

void poison(Backend& be, const Tensor& t) {
  put(be, t, std::vector<double>(size_t(t.numel()), t.dtype == DType::i32 ? kPoisonInt : kPoison));
}

bool is_poison(double v, DType dt) { return dt == DType::i32 ? v == kPoisonInt : v == kPoison; }

int64_t count_poison(const std::vector<double>& v, DType dt) {
  return std::count_if(v.begin(), v.end(), [&](double x) { return is_poison(x, dt); });
}

std::vector<int32_t> as_ints(const std::vector<double>& v) {
  std::vector<int32_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = int32_t(v[i]);
  return out;
}

std::vector<double> as_doubles(const std::vector<int32_t>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// Equal element by element, NaN equal to NaN.
bool same_values(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
  return true;
}

double rel_scalar(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-300); }

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

double norm(const std::vector<double>& a) { return std::sqrt(dot(a, a)); }

// =================================================================================================
// Router forward
// =================================================================================================

enum class BiasMode { random, skewed };  // skewed: expert 0 always first, the last one never chosen

struct RouterShape {
  int64_t T, H, E, K;
};
void PrintTo(const RouterShape& s, std::ostream* os) {
  *os << "T=" << s.T << " H=" << s.H << " E=" << s.E << " K=" << s.K;
}
void PrintTo(BiasMode m, std::ostream* os) { *os << (m == BiasMode::skewed ? "skewed" : "random"); }

// The router's tensors for one shape, and a forward that can be rerun with perturbed inputs.
struct RouterRig {
  Backend& be;
  Arena arena;
  int64_t T, H, E, K;
  Tensor x, weight, bias, logits, scores, topk_idx, topk_weight, counts, losses;

  RouterRig(Backend& backend, RouterShape s)
      : be(backend), arena(backend), T(s.T), H(s.H), E(s.E), K(s.K) {
    const DType act = be.activation_dtype(), fl = be.float_dtype();
    x = arena.make(act, {T, H});
    weight = arena.make(fl, {E, H});
    bias = arena.make(fl, {E});
    logits = arena.make(fl, {T, E});
    scores = arena.make(fl, {T, E});
    topk_idx = arena.make(DType::i32, {T, K});
    topk_weight = arena.make(fl, {T, K});
    counts = arena.make(DType::i32, {E});
    losses = arena.make(fl, {3});
  }

  RouterForwardArgs args(const RouterConfig& config) const {
    RouterForwardArgs a;
    a.tensors = RouterTensors{x, weight, logits, scores, topk_idx, topk_weight, counts};
    a.bias = bias;
    a.losses = losses;
    a.config = config;
    return a;
  }
  RouterForwardArgs args(ScoreFunction sf, bool normalize, double aux, double z) const {
    return args(RouterConfig{sf, normalize, aux, z});
  }

  void poison_outputs() {
    for (const Tensor* t : {&logits, &scores, &topk_idx, &topk_weight, &counts, &losses})
      poison(be, *t);
  }
};

std::vector<double> bias_values(BiasMode mode, int64_t E, uint64_t seed) {
  std::vector<double> b = test::random_values(size_t(E), seed, -0.3, 0.3);
  if (mode == BiasMode::skewed) {
    b[0] = 10.0;
    if (E > 1) b[size_t(E - 1)] = -10.0;
  }
  return b;
}

using RouterParam = std::tuple<RouterShape, ScoreFunction, bool, BiasMode, DType>;

class RouterForwardTest : public ::testing::TestWithParam<RouterParam> {};

TEST_P(RouterForwardTest, MatchesReference) {
  const auto [shape, sf, normalize, bias_mode, dt] = GetParam();
  auto be = make_cpu_backend(dt);
  RouterRig rig(*be, shape);
  const int64_t T = shape.T, H = shape.H, E = shape.E, K = shape.K;
  const uint64_t seed = uint64_t(T * 1000 + H * 100 + E * 10 + K);
  const auto x = put_random(*be, rig.x, seed + 1);
  const auto w = put_random(*be, rig.weight, seed + 2);
  put(*be, rig.bias, bias_values(bias_mode, E, seed + 3));
  const auto bias = get(*be, rig.bias);
  rig.poison_outputs();
  const double aux_c = 0.37, z_c = 0.011;
  be->router_forward(rig.args(sf, normalize, aux_c, z_c), nullptr);

  const auto ref = test::ref::router_forward(x, w, bias, T, H, E, K, sf, normalize, aux_c, z_c, dt);
  const double tol = tolerance(dt);
  const auto logits = get(*be, rig.logits), scores = get(*be, rig.scores);
  const auto tw = get(*be, rig.topk_weight), losses = get(*be, rig.losses);
  const auto idx = as_ints(get(*be, rig.topk_idx)), counts = as_ints(get(*be, rig.counts));
  EXPECT_EQ(count_poison(logits, dt) + count_poison(scores, dt) + count_poison(tw, dt), 0);
  EXPECT_LT(rel_error(logits, ref.logits), tol);
  EXPECT_LT(rel_error(scores, ref.scores), tol);
  EXPECT_EQ(idx, ref.topk_idx);
  EXPECT_EQ(counts, ref.counts);
  EXPECT_LT(rel_error(tw, ref.topk_weight), tol);
  if (T == 0) {
    EXPECT_EQ(losses[0], 0.0);
    EXPECT_EQ(losses[1], 0.0);
  } else {
    EXPECT_LT(rel_scalar(losses[0], ref.aux), tol) << losses[0] << " vs " << ref.aux;
    EXPECT_LT(rel_scalar(losses[1], ref.z), tol) << losses[1] << " vs " << ref.z;
  }
  // Counts sum to T*K; the skewed bias puts expert 0 first everywhere and never picks the last.
  EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t(0)), T * K);
  if (bias_mode == BiasMode::skewed) {
    for (int64_t t = 0; t < T; ++t) EXPECT_EQ(idx[size_t(t * K)], 0);
    if (E > K) {
      EXPECT_EQ(counts[size_t(E - 1)], 0);
    }
  }
  // The bias changes the selection on bigger shapes (so the test above means something), while
  // the weights stay the unbiased scores.
  if (bias_mode == BiasMode::random && T >= 13 && E > K) {
    const auto unbiased = test::ref::router_forward(x, w, std::vector<double>(size_t(E), 0.0), T, H,
                                                    E, K, sf, normalize, aux_c, z_c, dt);
    EXPECT_NE(unbiased.topk_idx, ref.topk_idx) << "bias too small to matter";
  }
  if (!normalize) {  // the raw weight is exactly the stored score, bias not added
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = idx[size_t(t * K + k)];
        EXPECT_EQ(tw[size_t(t * K + k)], scores[size_t(t * E + e)]) << "t " << t << " k " << k;
      }
  }
  // Inputs untouched.
  EXPECT_EQ(get(*be, rig.x), x);
  EXPECT_EQ(get(*be, rig.weight), w);
  EXPECT_EQ(get(*be, rig.bias), bias);
  EXPECT_TRUE(rig.arena.guards_intact());
}

const RouterShape kRouterShapes[] = {
    {0, 5, 4, 2},    {1, 7, 4, 1},   {1, 3, 1, 1},     {13, 9, 6, 3},
    {255, 13, 9, 2}, {256, 5, 8, 3}, {257, 11, 16, 4},
};

std::string router_name(const ::testing::TestParamInfo<RouterParam>& info) {
  const auto& [s, sf, normalize, bias_mode, dt] = info.param;
  std::ostringstream name;
  name << "T" << s.T << "_H" << s.H << "_E" << s.E << "_K" << s.K << "_" << to_string(sf)
       << (normalize ? "_norm" : "_raw") << (bias_mode == BiasMode::skewed ? "_skewed" : "_bias")
       << "_" << to_string(dt);
  return name.str();
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RouterForwardTest,
    ::testing::Combine(::testing::ValuesIn(kRouterShapes),
                       ::testing::Values(ScoreFunction::softmax, ScoreFunction::sigmoid),
                       ::testing::Bool(), ::testing::Values(BiasMode::random, BiasMode::skewed),
                       ::testing::Values(DType::f64, DType::f32)),
    router_name);

// Equal selection scores go to the lower expert index: identical weight rows give bit-identical
// scores, and the bias of the tied experts is equal.
TEST(RouterForward, TiesGoToLowerIndex) {
  for (DType dt : {DType::f64, DType::f32})
    for (ScoreFunction sf : {ScoreFunction::softmax, ScoreFunction::sigmoid}) {
      SCOPED_TRACE(dtype_name(dt) + " " + to_string(sf));
      auto be = make_cpu_backend(dt);
      const int64_t T = 9, H = 5, E = 6, K = 3;
      RouterRig rig(*be, {T, H, E, K});
      put_random(*be, rig.x, 11);
      // Every expert has the same weight row: all scores tie, so the top-k is 0, 1, 2.
      const auto row = test::random_values(size_t(H), 12);
      std::vector<double> w;
      for (int64_t e = 0; e < E; ++e) w.insert(w.end(), row.begin(), row.end());
      put(*be, rig.weight, w);
      put(*be, rig.bias, std::vector<double>(size_t(E), 0.25));
      rig.poison_outputs();
      be->router_forward(rig.args(sf, true, 0.1, 0.1), nullptr);
      const auto idx = as_ints(get(*be, rig.topk_idx));
      const auto tw = get(*be, rig.topk_weight);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t k = 0; k < K; ++k) {
          EXPECT_EQ(idx[size_t(t * K + k)], k) << "token " << t;
          EXPECT_NEAR(tw[size_t(t * K + k)], 1.0 / double(K), tolerance(dt));
        }
      EXPECT_EQ(as_ints(get(*be, rig.counts)), (std::vector<int32_t>{9, 9, 9, 0, 0, 0}));

      // Pairs: experts 1 and 4 share a row and a bias, and beat the others.
      auto w2 = test::random_values(size_t(E * H), 13, -0.2, 0.2);
      const auto hot = test::random_values(size_t(H), 14);
      for (int64_t h = 0; h < H; ++h)
        w2[size_t(1 * H + h)] = w2[size_t(4 * H + h)] = hot[size_t(h)];
      put(*be, rig.weight, w2);
      std::vector<double> b(size_t(E), 0.0);
      b[1] = b[4] = 5.0;
      put(*be, rig.bias, b);
      rig.poison_outputs();
      be->router_forward(rig.args(sf, false, 0.1, 0.1), nullptr);
      const auto idx2 = as_ints(get(*be, rig.topk_idx));
      const auto scores = get(*be, rig.scores);
      for (int64_t t = 0; t < T; ++t) {
        ASSERT_EQ(scores[size_t(t * E + 1)], scores[size_t(t * E + 4)]);
        EXPECT_EQ(idx2[size_t(t * K + 0)], 1) << "token " << t;
        EXPECT_EQ(idx2[size_t(t * K + 1)], 4) << "token " << t;
      }
      EXPECT_TRUE(rig.arena.guards_intact());
    }
}

// =================================================================================================
// Router backward
// =================================================================================================

struct RouterBackwardCase {
  RouterShape shape;
  ScoreFunction sf;
  bool normalize;
};
void PrintTo(const RouterBackwardCase& c, std::ostream* os) {
  PrintTo(c.shape, os);
  *os << " " << to_string(c.sf) << (c.normalize ? " normalized" : " raw");
}

class RouterBackwardTest : public ::testing::TestWithParam<RouterBackwardCase> {};

// Objective J = sum g * topk_weight + aux + z as the forward computes it.
double router_objective(Backend& be, RouterRig& rig, const RouterForwardArgs& a,
                        const std::vector<double>& g, const std::vector<int32_t>& want_idx) {
  be.router_forward(a, nullptr);
  const auto idx = as_ints(get(be, rig.topk_idx));
  EXPECT_EQ(idx, want_idx) << "the perturbation changed the selection";
  const auto tw = get(be, rig.topk_weight);
  const auto losses = get(be, rig.losses);
  return dot(g, tw) + losses[0] + losses[1] + losses[2];
}

// d_weight and dx (accumulated onto random values) against central differences of the forward.
void check_router_gradients(RouterShape shape, const RouterConfig& config, uint64_t seed) {
  auto be = make_cpu_backend(DType::f64);
  RouterRig rig(*be, shape);
  const int64_t T = shape.T, H = shape.H, E = shape.E, K = shape.K;
  auto x = put_random(*be, rig.x, seed + 1, -2.0, 2.0);
  auto w = put_random(*be, rig.weight, seed + 2);
  put(*be, rig.bias, bias_values(BiasMode::random, E, seed + 3));
  const auto fa = rig.args(config);
  rig.poison_outputs();
  be->router_forward(fa, nullptr);
  const auto idx0 = as_ints(get(*be, rig.topk_idx));
  const auto g = test::random_values(size_t(T * K), seed + 4);

  Arena arena(*be);
  const Tensor d_topk = arena.make(DType::f64, {T, K});
  const Tensor d_weight = arena.make(DType::f64, {E, H});
  const Tensor dx = arena.make(DType::f64, {T, H});
  put(*be, d_topk, g);
  const auto dw0 = put_random(*be, d_weight, seed + 5);
  const auto dx0 = put_random(*be, dx, seed + 6);
  RouterBackwardArgs ba;
  ba.tensors = fa.tensors;
  ba.d_topk_weight = d_topk;
  ba.d_weight = d_weight;
  ba.dx = dx;
  ba.config = fa.config;
  be->router_backward(ba, nullptr);
  auto grad_w = get(*be, d_weight), grad_x = get(*be, dx);
  for (size_t i = 0; i < grad_w.size(); ++i) grad_w[i] -= dw0[i];
  for (size_t i = 0; i < grad_x.size(); ++i) grad_x[i] -= dx0[i];

  const double eps = 1e-6;
  auto fd = [&](std::vector<double>& v, const Tensor& t) {
    std::vector<double> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const double keep = v[i];
      v[i] = keep + eps;
      put(*be, t, v);
      const double jp = router_objective(*be, rig, fa, g, idx0);
      v[i] = keep - eps;
      put(*be, t, v);
      const double jm = router_objective(*be, rig, fa, g, idx0);
      v[i] = keep;
      put(*be, t, v);
      out[i] = (jp - jm) / (2 * eps);
    }
    return out;
  };
  const auto fd_w = fd(w, rig.weight);
  const auto fd_x = fd(x, rig.x);
  EXPECT_LT(rel_error(grad_w, fd_w), kFdTolerance);
  EXPECT_LT(rel_error(grad_x, fd_x), kFdTolerance);
  EXPECT_GT(norm(fd_w), 1e-3);  // the check compares something
  EXPECT_TRUE(rig.arena.guards_intact());
  EXPECT_TRUE(arena.guards_intact());
}

TEST_P(RouterBackwardTest, MatchesFiniteDifferences) {
  const auto c = GetParam();
  const uint64_t seed =
      uint64_t(7000 + c.shape.T * 31 + c.shape.E * 7 + c.shape.K) + (c.normalize ? 1 : 0);
  check_router_gradients(c.shape, RouterConfig{c.sf, c.normalize, 0.3, 0.05}, seed);
}

const RouterBackwardCase kRouterBackwardCases[] = {
    {{1, 4, 5, 2}, ScoreFunction::softmax, true}, {{1, 4, 5, 2}, ScoreFunction::softmax, false},
    {{1, 4, 5, 2}, ScoreFunction::sigmoid, true}, {{1, 4, 5, 2}, ScoreFunction::sigmoid, false},
    {{9, 7, 6, 3}, ScoreFunction::softmax, true}, {{9, 7, 6, 3}, ScoreFunction::softmax, false},
    {{9, 7, 6, 3}, ScoreFunction::sigmoid, true}, {{9, 7, 6, 3}, ScoreFunction::sigmoid, false},
    {{6, 3, 4, 1}, ScoreFunction::softmax, true}, {{6, 3, 4, 1}, ScoreFunction::sigmoid, false},
    {{5, 5, 1, 1}, ScoreFunction::softmax, true}, {{5, 5, 1, 1}, ScoreFunction::sigmoid, true},
};

std::string router_backward_name(const ::testing::TestParamInfo<RouterBackwardCase>& info) {
  const auto& c = info.param;
  std::ostringstream name;
  name << "T" << c.shape.T << "_H" << c.shape.H << "_E" << c.shape.E << "_K" << c.shape.K << "_"
       << to_string(c.sf) << (c.normalize ? "_norm" : "_raw");
  return name.str();
}

INSTANTIATE_TEST_SUITE_P(Cases, RouterBackwardTest, ::testing::ValuesIn(kRouterBackwardCases),
                         router_backward_name);

// The f32 backward equals the f64 one (checked above) on the same f32-representable inputs, and
// with no tokens it leaves the accumulators as they were.
TEST(RouterBackward, F32MatchesF64AndZeroTokensIsANoOp) {
  for (ScoreFunction sf : {ScoreFunction::softmax, ScoreFunction::sigmoid})
    for (bool normalize : {true, false})
      for (RouterShape shape :
           {RouterShape{0, 5, 4, 2}, RouterShape{1, 3, 4, 2}, RouterShape{257, 13, 9, 3}}) {
        SCOPED_TRACE(std::string(to_string(sf)) + (normalize ? " norm T=" : " raw T=") +
                     std::to_string(shape.T));
        const uint64_t seed = 900 + uint64_t(shape.T);
        std::vector<std::vector<double>> grads[2];
        std::vector<int32_t> idx_seen[2];
        for (int which = 0; which < 2; ++which) {
          auto be = make_cpu_backend(which == 0 ? DType::f64 : DType::f32);
          RouterRig rig(*be, shape);
          // Random values rounded to f32 so both backends see the same inputs.
          auto f32_values = [](std::vector<double> v) {
            for (double& d : v) d = double(float(d));
            return v;
          };
          const int64_t T = shape.T, H = shape.H, E = shape.E, K = shape.K;
          put(*be, rig.x, f32_values(test::random_values(size_t(T * H), seed + 1)));
          put(*be, rig.weight, f32_values(test::random_values(size_t(E * H), seed + 2)));
          put(*be, rig.bias, f32_values(bias_values(BiasMode::random, E, seed + 3)));
          rig.poison_outputs();
          const RouterForwardArgs fa = rig.args(sf, normalize, 0.2, 0.03);
          be->router_forward(fa, nullptr);
          idx_seen[which] = as_ints(get(*be, rig.topk_idx));
          Arena arena(*be);
          const DType fl = be->float_dtype();
          const Tensor d_topk = arena.make(fl, {T, K});
          const Tensor d_weight = arena.make(fl, {E, H});
          const Tensor dx = arena.make(be->activation_dtype(), {T, H});
          put(*be, d_topk, f32_values(test::random_values(size_t(T * K), seed + 4)));
          const auto dw0 = f32_values(test::random_values(size_t(E * H), seed + 5));
          const auto dx0 = f32_values(test::random_values(size_t(T * H), seed + 6));
          put(*be, d_weight, dw0);
          put(*be, dx, dx0);
          RouterBackwardArgs ba;
          ba.tensors = fa.tensors;
          ba.d_topk_weight = d_topk;
          ba.d_weight = d_weight;
          ba.dx = dx;
          ba.config = fa.config;
          be->router_backward(ba, nullptr);
          auto gw = get(*be, d_weight), gx = get(*be, dx);
          if (T == 0) {
            EXPECT_EQ(gw, dw0) << "no tokens must leave d_weight as it was";
          }
          for (size_t i = 0; i < gw.size(); ++i) gw[i] -= dw0[i];
          for (size_t i = 0; i < gx.size(); ++i) gx[i] -= dx0[i];
          grads[which] = {gw, gx};
          EXPECT_TRUE(rig.arena.guards_intact());
          EXPECT_TRUE(arena.guards_intact());
        }
        ASSERT_EQ(idx_seen[0], idx_seen[1]);
        if (shape.T == 0) continue;
        // The differences above subtract O(1) accumulators, so compare at f32 resolution of them.
        EXPECT_LT(rel_error(grads[1][0], grads[0][0]), 1e-5);
        EXPECT_LT(rel_error(grads[1][1], grads[0][1]), 1e-5);
      }
}

// =================================================================================================
// Router rules of real models: group-limited top-k, routed scaling, sequence aux loss
// =================================================================================================

// A router config and the model definition it should reproduce.
struct ModelRoutingCase {
  const char* name;
  RouterShape shape;
  RouterConfig config;
  bool grouped_reference;  // DeepSeek-style grouped gate, else softmax top-k (Qwen3, Mixtral)
};

RouterConfig grouped(ScoreFunction sf, bool normalize, int groups, int topk_groups, GroupScore rule,
                     double scale) {
  RouterConfig c{sf, normalize, 0.0, 0.0};
  c.expert_groups = groups;
  c.topk_groups = topk_groups;
  c.group_score = rule;
  c.routed_scaling_factor = scale;
  return c;
}

const ModelRoutingCase kModelRoutingCases[] = {
    // DeepSeek-V3's gate at a small size: 8 groups of 4, top 3 groups, sum of top-2, x 2.5.
    {"deepseek_v3",
     {257, 11, 32, 4},
     grouped(ScoreFunction::sigmoid, true, 8, 3, GroupScore::top2_sum, 2.5),
     true},
    {"deepseek_v3_one_group",
     {64, 7, 32, 8},
     grouped(ScoreFunction::sigmoid, true, 8, 2, GroupScore::top2_sum, 2.5),
     true},
    {"group_max_raw",
     {255, 9, 24, 3},
     grouped(ScoreFunction::sigmoid, false, 6, 2, GroupScore::max, 1.7),
     true},
    {"group_max_softmax",
     {33, 5, 16, 2},
     grouped(ScoreFunction::softmax, true, 4, 1, GroupScore::max, 1.0),
     true},
    {"groups_of_one",
     {40, 6, 8, 3},
     grouped(ScoreFunction::sigmoid, true, 8, 4, GroupScore::max, 1.0),
     true},
    {"every_group",
     {40, 6, 12, 3},
     grouped(ScoreFunction::sigmoid, true, 3, 3, GroupScore::top2_sum, 2.0),
     true},
    // Qwen3-MoE (norm_topk_prob) and Mixtral: softmax top-k, renormalised; and without.
    {"qwen3", {129, 10, 16, 4}, RouterConfig{ScoreFunction::softmax, true, 0.0, 0.0}, false},
    {"mixtral", {77, 8, 8, 2}, RouterConfig{ScoreFunction::softmax, true, 0.0, 0.0}, false},
    {"softmax_raw", {50, 8, 8, 2}, RouterConfig{ScoreFunction::softmax, false, 0.0, 0.0}, false},
};

// Routes and weights against the fp64 model definitions on the backend's stored scores (with the
// scores themselves from the stored logits by the definition); the sequence aux loss against
// DeepSeek-V3's sequence-wise loss. Routes exactly, weights by relative norm.
TEST(RouterRules, MatchModelDefinitions) {
  for (const ModelRoutingCase& c : kModelRoutingCases)
    for (DType dt : {DType::f64, DType::f32}) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dt));
      auto be = make_cpu_backend(dt);
      RouterRig rig(*be, c.shape);
      const int64_t T = c.shape.T, E = c.shape.E, K = c.shape.K;
      const uint64_t seed = 4100 + uint64_t(T * 3 + E);
      put_random(*be, rig.x, seed + 1, -2.0, 2.0);
      put_random(*be, rig.weight, seed + 2);
      // Softmax models have no bias; the grouped gate's bias is large enough to change picks.
      put(*be, rig.bias,
          c.grouped_reference ? test::random_values(size_t(E), seed + 3, -0.2, 0.2)
                              : std::vector<double>(size_t(E), 0.0));
      const auto bias = get(*be, rig.bias);
      RouterConfig cfg = c.config;
      cfg.seq_aux_loss_coeff = 0.21;
      cfg.seq_len = 16;
      rig.poison_outputs();
      be->router_forward(rig.args(cfg), nullptr);

      const auto logits = get(*be, rig.logits), scores = get(*be, rig.scores);
      std::vector<double> exact(size_t(T * E)), stored_scores(size_t(T * E));
      for (int64_t t = 0; t < T; ++t) {
        double mx = -INFINITY, sum = 0;
        for (int64_t e = 0; e < E; ++e) mx = std::max(mx, logits[size_t(t * E + e)]);
        for (int64_t e = 0; e < E; ++e) sum += std::exp(logits[size_t(t * E + e)] - mx);
        for (int64_t e = 0; e < E; ++e) {
          const double l = logits[size_t(t * E + e)];
          exact[size_t(t * E + e)] = cfg.score_function == ScoreFunction::softmax
                                         ? std::exp(l - mx) / sum
                                         : 1.0 / (1.0 + std::exp(-l));
          stored_scores[size_t(t * E + e)] = test::ref::stored(dt, exact[size_t(t * E + e)]);
        }
      }
      EXPECT_LT(rel_error(scores, stored_scores), tolerance(dt));
      const test::model::Routes want =
          c.grouped_reference
              ? test::model::grouped_gate(
                    stored_scores, bias, T, E, K, cfg.expert_groups, cfg.topk_groups,
                    cfg.group_score == GroupScore::top2_sum ? test::model::GroupRule::top2_sum
                                                            : test::model::GroupRule::max,
                    cfg.normalize_topk, cfg.routed_scaling_factor)
              : test::model::softmax_topk(stored_scores, T, E, K, cfg.normalize_topk);
      const auto idx = as_ints(get(*be, rig.topk_idx));
      EXPECT_EQ(idx, want.idx);
      EXPECT_LT(rel_error(get(*be, rig.topk_weight), want.weights), tolerance(dt));
      const auto losses = get(*be, rig.losses);
      const double seq_want =
          test::model::sequence_balance_loss(exact, idx, T, E, K, cfg.seq_len, 0.21);
      EXPECT_LT(rel_scalar(losses[2], seq_want), tolerance(dt)) << losses[2] << " vs " << seq_want;
      EXPECT_EQ(losses[0], 0.0);
      // Every token's picks lie in at most topk_groups groups, and the limit changes the picks.
      if (cfg.expert_groups > 1 && cfg.topk_groups < cfg.expert_groups) {
        const int64_t per = E / cfg.expert_groups;
        for (int64_t t = 0; t < T; ++t) {
          std::vector<int64_t> g;
          for (int64_t k = 0; k < K; ++k) g.push_back(idx[size_t(t * K + k)] / per);
          std::sort(g.begin(), g.end());
          EXPECT_LE(std::unique(g.begin(), g.end()) - g.begin(), cfg.topk_groups) << "token " << t;
        }
        // (Groups of one expert scored by their max keep the top-k: the limit is then a no-op.)
        RouterConfig open = cfg;
        open.expert_groups = open.topk_groups = 1;
        be->router_forward(rig.args(open), nullptr);
        if (per > 1) {
          EXPECT_NE(as_ints(get(*be, rig.topk_idx)), idx) << "the limit changed nothing";
        }
      }
      EXPECT_TRUE(rig.arena.guards_intact());
    }
}

// Tied groups go to the lower group, tied experts to the lower expert: every score is equal
// (identical weight rows), so the bias alone orders the keys, and groups 1 and 3 have the same
// biases (the best).
TEST(RouterRules, TiedGroupsGoToLowerIndex) {
  for (DType dt : {DType::f64, DType::f32})
    for (GroupScore rule : {GroupScore::top2_sum, GroupScore::max}) {
      SCOPED_TRACE(dtype_name(dt) + " " + to_string(rule));
      auto be = make_cpu_backend(dt);
      const int64_t T = 5, H = 4, E = 16, K = 3;
      RouterRig rig(*be, {T, H, E, K});
      put_random(*be, rig.x, 61);
      const auto row = test::random_values(size_t(H), 62);
      std::vector<double> w;
      for (int64_t e = 0; e < E; ++e) w.insert(w.end(), row.begin(), row.end());
      put(*be, rig.weight, w);
      // Group g holds experts 4g .. 4g + 3; groups 1 and 3: biases 0.5, 0.25, 0.5, 0.
      std::vector<double> b(size_t(E), -1.0);
      for (int g : {1, 3}) {
        b[size_t(4 * g + 0)] = 0.5;
        b[size_t(4 * g + 1)] = 0.25;
        b[size_t(4 * g + 2)] = 0.5;
        b[size_t(4 * g + 3)] = 0.0;
      }
      put(*be, rig.bias, b);
      const std::vector<int32_t> one_group = {4, 6, 5}, two_groups = {4, 6, 12};
      for (int topk_groups : {1, 2}) {
        rig.poison_outputs();
        be->router_forward(
            rig.args(grouped(ScoreFunction::sigmoid, true, 4, topk_groups, rule, 1.0)), nullptr);
        const auto idx = as_ints(get(*be, rig.topk_idx));
        for (int64_t t = 0; t < T; ++t)
          EXPECT_EQ(std::vector<int32_t>(idx.begin() + t * K, idx.begin() + (t + 1) * K),
                    topk_groups == 1 ? one_group : two_groups)
              << "token " << t << ", top " << topk_groups << " groups";
      }
    }
}

// A NaN selection key ranks after every number, NaN keys by index (docs/design.md, the router):
// experts whose weight row is NaN (a NaN sigmoid score) are never picked over finite ones, and
// when fewer than K keys are numbers the picks go on with the NaN experts in index order; the K
// picks are always distinct and in range. The same with the group limit (every group scored by
// its finite keys, a group of NaN keys last).
TEST(RouterForward, NanKeysRankLastAndPicksStayDistinct) {
  for (DType dt : {DType::f64, DType::f32})
    for (int groups : {1, 4}) {
      SCOPED_TRACE(dtype_name(dt) + " groups " + std::to_string(groups));
      auto be = make_cpu_backend(dt);
      const int64_t T = 7, H = 5, E = 8, K = 3;
      RouterRig rig(*be, {T, H, E, K});
      put_random(*be, rig.x, 71);
      put(*be, rig.bias, std::vector<double>(size_t(E), 0.0));
      const RouterConfig cfg =
          groups > 1 ? grouped(ScoreFunction::sigmoid, true, groups, groups, GroupScore::max, 1.0)
                     : RouterConfig{ScoreFunction::sigmoid, true, 0.0, 0.0};
      for (const std::vector<int>& nan_experts :
           {std::vector<int>{1, 4}, std::vector<int>{0, 2, 3, 5, 6, 7},
            std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}}) {
        auto w = test::random_values(size_t(E * H), 72, -0.5, 0.5);
        for (int e : nan_experts)
          for (int64_t h = 0; h < H; ++h) w[size_t(e * H + h)] = std::nan("");
        put(*be, rig.weight, w);
        rig.poison_outputs();
        be->router_forward(rig.args(cfg), nullptr);
        const auto idx = as_ints(get(*be, rig.topk_idx));
        const auto scores = get(*be, rig.scores);
        const int64_t finite = E - int64_t(nan_experts.size());
        for (int64_t t = 0; t < T; ++t) {
          std::vector<int32_t> picks(idx.begin() + t * K, idx.begin() + (t + 1) * K);
          std::vector<int32_t> sorted = picks;
          std::sort(sorted.begin(), sorted.end());
          EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end())
              << "token " << t << ": an expert picked twice";
          for (int64_t k = 0; k < K; ++k) {
            const int32_t e = picks[size_t(k)];
            ASSERT_TRUE(e >= 0 && e < E) << "token " << t << " pick " << k << ": " << e;
            // The first min(K, finite) picks are finite-scored; the rest NaN ones by index.
            EXPECT_EQ(std::isnan(scores[size_t(t * E + e)]), k >= finite) << "token " << t;
          }
          // The NaN picks come in index order, after the finite ones.
          for (int64_t k = std::max<int64_t>(finite, 0) + 1; k < K; ++k)
            EXPECT_LT(picks[size_t(k - 1)], picks[size_t(k)]) << "token " << t;
        }
        EXPECT_TRUE(rig.arena.guards_intact());
      }
    }
}

// A NaN or infinite value in one token's x makes its logits non-finite and every softmax score
// NaN: the token goes to experts 0 .. K-1 with NaN combine weights, the losses are NaN (reported,
// not hidden), and every other token routes exactly as without it.
TEST(RouterForward, NonFiniteTokenRoutesToLowestExpertsWithNanWeights) {
  for (DType dt : {DType::f64, DType::f32})
    for (double bad : {std::nan(""), std::numeric_limits<double>::infinity(),
                       -std::numeric_limits<double>::infinity()}) {
      SCOPED_TRACE(dtype_name(dt) + " x = " + std::to_string(bad));
      auto be = make_cpu_backend(dt);
      const int64_t T = 6, H = 4, E = 8, K = 2, bad_token = 2;
      RouterRig rig(*be, {T, H, E, K});
      auto x = test::random_values(size_t(T * H), 81);
      put(*be, rig.x, x);
      put_random(*be, rig.weight, 82);
      put(*be, rig.bias, std::vector<double>(size_t(E), 0.0));
      be->router_forward(rig.args(ScoreFunction::softmax, true, 0.1, 0.1), nullptr);
      const auto clean_idx = as_ints(get(*be, rig.topk_idx));
      const auto clean_w = get(*be, rig.topk_weight);
      x[size_t(bad_token * H + 1)] = bad;
      put(*be, rig.x, x);
      rig.poison_outputs();
      be->router_forward(rig.args(ScoreFunction::softmax, true, 0.1, 0.1), nullptr);
      const auto idx = as_ints(get(*be, rig.topk_idx));
      const auto tw = get(*be, rig.topk_weight);
      const auto losses = get(*be, rig.losses);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t k = 0; k < K; ++k) {
          const size_t i = size_t(t * K + k);
          if (t == bad_token) {
            EXPECT_EQ(idx[i], k);
            EXPECT_TRUE(std::isnan(tw[i]));
          } else {
            EXPECT_EQ(idx[i], clean_idx[i]) << "token " << t;
            EXPECT_EQ(tw[i], clean_w[i]) << "token " << t;
          }
        }
      EXPECT_TRUE(std::isnan(losses[0])) << "aux loss " << losses[0];
      EXPECT_TRUE(std::isnan(losses[1])) << "z loss " << losses[1];
      int64_t routes = 0;
      for (int32_t c : as_ints(get(*be, rig.counts))) routes += c;
      EXPECT_EQ(routes, T * K);
      EXPECT_TRUE(rig.arena.guards_intact());
    }
}

// The gradients with groups, routed scaling and the sequence aux loss (plus both batch losses)
// against central differences; sequences of 4 over 9 tokens leave a short last one.
TEST(RouterRules, GradientsMatchFiniteDifferences) {
  for (ScoreFunction sf : {ScoreFunction::softmax, ScoreFunction::sigmoid})
    for (bool normalize : {true, false}) {
      SCOPED_TRACE(std::string(to_string(sf)) + (normalize ? " norm" : " raw"));
      RouterConfig cfg = grouped(sf, normalize, 4, 2, GroupScore::top2_sum, 2.5);
      cfg.aux_loss_coeff = 0.3;
      cfg.z_loss_coeff = 0.05;
      cfg.seq_aux_loss_coeff = 0.4;
      cfg.seq_len = 4;
      check_router_gradients({9, 5, 8, 3}, cfg, 8100 + (normalize ? 1 : 0));
      // The sequence loss alone, one token per sequence.
      RouterConfig seq_only{sf, normalize, 0.0, 0.0};
      seq_only.seq_aux_loss_coeff = 0.7;
      seq_only.seq_len = 1;
      check_router_gradients({3, 4, 6, 2}, seq_only, 8200 + (normalize ? 1 : 0));
    }
}

// =================================================================================================
// Router bias update
// =================================================================================================

TEST(RouterBiasUpdate, SignOfMeanMinusCount) {
  struct Case {
    const char* name;
    int64_t R, E;
    std::vector<int32_t> C;
  };
  std::vector<Case> cases = {
      // counts {3, 5, 4, 4}: mean 4, experts 2 and 3 tie with the mean and keep their bias.
      {"ties", 2, 4, {1, 2, 4, 0, 2, 3, 0, 4}},
      // total 10 over 3 experts: mean 3.33, no tie.
      {"fractional_mean", 1, 3, {3, 4, 3}},
      // no rows at all: every count equals the mean.
      {"empty", 3, 2, {0, 0, 0, 0, 0, 0}},
      // every row on one expert.
      {"one_hot", 2, 5, {0, 0, 9, 0, 0, 0, 0, 7, 0, 0}},
      {"single", 1, 1, {5}},
  };
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<int> u(0, 300);
  Case rnd{"random", 4, 16, std::vector<int32_t>(64)};
  for (auto& v : rnd.C) v = u(rng);
  cases.push_back(rnd);

  for (DType dt : {DType::f64, DType::f32})
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dt));
      auto be = make_cpu_backend(dt);
      Arena arena(*be);
      const Tensor C = arena.make(DType::i32, {c.R, c.E});
      const Tensor bias = arena.make(be->float_dtype(), {c.E});
      put(*be, C, as_doubles(c.C));
      const auto b0 = put_random(*be, bias, 77);
      const double rate = 1e-3;
      be->router_bias_update(C, bias, rate, nullptr);
      const auto b1 = get(*be, bias);
      const auto want = test::ref::router_bias_update(c.C, c.R, c.E, b0, rate);
      EXPECT_LT(rel_error(b1, want), tolerance(dt));
      // Exact sign per expert, and no change at all where the count equals the mean.
      for (int64_t e = 0; e < c.E; ++e) {
        const double want_delta = want[size_t(e)] - b0[size_t(e)];
        const double got_delta = b1[size_t(e)] - b0[size_t(e)];
        if (want_delta == 0) {
          EXPECT_EQ(b1[size_t(e)], b0[size_t(e)]) << "expert " << e;
        } else {
          EXPECT_GT(got_delta * want_delta, 0) << "expert " << e;
        }
      }
      EXPECT_EQ(as_ints(get(*be, C)), c.C);
      EXPECT_TRUE(arena.guards_intact());
    }
}

// =================================================================================================
// Grouped GEMM
// =================================================================================================

struct WindowCase {
  const char* name;
  std::vector<int32_t> offsets;  // [G + 1], global receive rows
  int64_t row_lo, rows;
  int64_t K, N;  // GEMM inner and output sizes (SwiGLU uses K as F)
};
void PrintTo(const WindowCase& w, std::ostream* os) {
  *os << w.name << " offsets [";
  for (size_t i = 0; i < w.offsets.size(); ++i) *os << (i ? ", " : "") << w.offsets[i];
  *os << "] row_lo=" << w.row_lo << " rows=" << w.rows << " K=" << w.K << " N=" << w.N;
}

const WindowCase kWindows[] = {
    {"one_row", {0, 1}, 0, 1, 1, 1},
    {"single_group_256", {0, 256}, 0, 256, 7, 5},
    {"valid_255_of_256", {0, 100, 100, 255}, 0, 256, 7, 9},
    {"rows_257_first_group_empty", {0, 0, 130, 257}, 0, 257, 13, 3},
    {"all_rows_on_one_group", {0, 0, 0, 257, 257}, 0, 257, 5, 7},
    {"window_cuts_groups", {0, 50, 300, 310, 310, 520}, 256, 256, 7, 5},
    {"second_round_tail", {0, 200, 300, 400}, 256, 256, 3, 11},
    {"group_spans_whole_window", {0, 600}, 256, 256, 9, 3},
    {"window_after_all_rows", {0, 100, 200}, 256, 256, 5, 5},
    {"all_groups_empty", {0, 0, 0, 0}, 0, 3, 3, 5},
    {"zero_row_window", {0, 0, 0}, 0, 0, 3, 3},
};

using WindowParam = std::tuple<WindowCase, DType>;

std::string window_name(const ::testing::TestParamInfo<WindowParam>& info) {
  return std::string(std::get<0>(info.param).name) + "_" + dtype_name(std::get<1>(info.param));
}

// Random values in the rows of `rows_valid`, NaN elsewhere (rows the op must not read).
std::vector<double> rows_or_nan(const std::vector<bool>& rows_valid, int64_t cols, uint64_t seed,
                                double lo = -1.0, double hi = 1.0) {
  auto v = test::random_values(rows_valid.size() * size_t(cols), seed, lo, hi);
  for (size_t i = 0; i < rows_valid.size(); ++i)
    if (!rows_valid[i])
      for (int64_t c = 0; c < cols; ++c) v[i * size_t(cols) + size_t(c)] = kNaN;
  return v;
}

// Rows of the output: the valid ones match `want`, the others keep the poison.
void expect_rows(const std::vector<double>& got, const std::vector<double>& want,
                 const std::vector<bool>& rows_valid, int64_t cols, DType dt, double tol) {
  std::vector<double> g, w;
  int64_t untouched_bad = 0;
  for (size_t i = 0; i < rows_valid.size(); ++i)
    for (int64_t c = 0; c < cols; ++c) {
      const size_t at = i * size_t(cols) + size_t(c);
      if (rows_valid[i]) {
        g.push_back(got[at]);
        w.push_back(want[at]);
      } else if (!is_poison(got[at], dt)) {
        ++untouched_bad;
      }
    }
  EXPECT_EQ(untouched_bad, 0) << "rows outside every group were written";
  EXPECT_EQ(count_poison(g, dt), 0) << "valid rows left unwritten";
  EXPECT_LT(rel_error(g, w), tol);
}

class GroupedGemmTest : public ::testing::TestWithParam<WindowParam> {};

TEST_P(GroupedGemmTest, FpropDgradWgradMatchReferenceAndAreAdjoint) {
  const auto& [wc, dt] = GetParam();
  auto be = make_cpu_backend(dt);
  Arena arena(*be);
  const int64_t G = int64_t(wc.offsets.size()) - 1, rows = wc.rows, K = wc.K, N = wc.N;
  const double tol = tolerance(dt);
  const Tensor offsets = arena.make(DType::i32, {G + 1});
  put(*be, offsets, as_doubles(wc.offsets));
  GroupWindow win;
  win.group_offsets = offsets.as<int32_t>();
  win.groups = int(G);
  win.row_lo = wc.row_lo;
  win.rows = rows;

  std::vector<bool> valid(static_cast<size_t>(rows));
  std::vector<bool> group_has_rows(size_t(G), false);
  for (int64_t i = 0; i < rows; ++i) {
    const int g = test::ref::group_of_row(wc.offsets, wc.row_lo, i);
    valid[size_t(i)] = g >= 0;
    if (g >= 0) group_has_rows[size_t(g)] = true;
  }
  const DType act = be->activation_dtype();
  const Tensor x = arena.make(act, {rows, K}), w = arena.make(act, {G, K, N});
  const Tensor y = arena.make(act, {rows, N}), dy = arena.make(act, {rows, N});
  const Tensor dx = arena.make(act, {rows, K}), dw = arena.make(act, {G, K, N});
  put(*be, x, rows_or_nan(valid, K, 101));
  put(*be, dy, rows_or_nan(valid, N, 102));
  const auto xv = get(*be, x), dyv = get(*be, dy);
  const auto wv = put_random(*be, w, 103);

  // fprop
  poison(*be, y);
  GemmArgs fa{win, x, w, y};
  be->gemm_fprop(fa, nullptr);
  std::vector<double> y_ref(size_t(rows * N), kPoison);
  test::ref::gemm_fprop(wc.offsets, wc.row_lo, rows, K, N, xv, wv, y_ref);
  const auto yv = get(*be, y);
  {
    SCOPED_TRACE("fprop");
    expect_rows(yv, y_ref, valid, N, dt, tol);
  }

  // dgrad
  poison(*be, dx);
  be->gemm_dgrad(GemmArgs{win, dy, w, dx}, nullptr);
  std::vector<double> dx_ref(size_t(rows * K), kPoison);
  test::ref::gemm_dgrad(wc.offsets, wc.row_lo, rows, K, N, dyv, wv, dx_ref);
  const auto dxv = get(*be, dx);
  {
    SCOPED_TRACE("dgrad");
    expect_rows(dxv, dx_ref, valid, K, dt, tol);
  }

  // wgrad accumulates; groups with no row in the window keep their gradient bit for bit.
  const auto dw0 = put_random(*be, dw, 104);
  be->gemm_wgrad(GemmArgs{win, x, dy, dw}, nullptr);
  auto dw_ref = dw0;
  test::ref::gemm_wgrad(wc.offsets, wc.row_lo, rows, K, N, xv, dyv, dw_ref);
  const auto dwv = get(*be, dw);
  EXPECT_LT(rel_error(dwv, dw_ref), tol) << "wgrad";
  for (int64_t g = 0; g < G; ++g) {
    if (group_has_rows[size_t(g)]) continue;
    for (int64_t j = 0; j < K * N; ++j)
      ASSERT_EQ(dwv[size_t(g * K * N + j)], dw0[size_t(g * K * N + j)]) << "empty group " << g;
  }
  // accumulate = false writes the product where the group has rows in the window and zero where
  // its rows are all outside (the NaN start is never read); a group with no rows keeps its own,
  // or is zeroed too when it lies below zero_empty_below.
  for (const int below : {0, int(G / 2) + 1}) {
    std::vector<double> start(dw0.size(), std::nan("")), ref(dw0.size(), 0.0);
    for (int64_t g = below; g < G; ++g)
      if (wc.offsets[size_t(g + 1)] == wc.offsets[size_t(g)])
        for (int64_t j = g * K * N; j < (g + 1) * K * N; ++j)
          start[size_t(j)] = ref[size_t(j)] = dw0[size_t(j)];
    put(*be, dw, start);
    GemmArgs over{win, x, dy, dw};
    over.accumulate = false;
    over.zero_empty_below = below;
    be->gemm_wgrad(over, nullptr);
    test::ref::gemm_wgrad(wc.offsets, wc.row_lo, rows, K, N, xv, dyv, ref);
    EXPECT_LT(rel_error(get(*be, dw), ref), tol)
        << "wgrad with accumulate = false, zero_empty_below = " << below;
  }

  // Adjoint identities over the valid rows: <dy, X W> = <dgrad(dy), X> = <wgrad(X, dy), W>.
  // (For a linear map these are exactly what finite differences would measure.)
  double y_dy = 0, x_dx = 0, w_dw = 0, scale = 0;
  for (int64_t i = 0; i < rows; ++i) {
    if (!valid[size_t(i)]) continue;
    for (int64_t n = 0; n < N; ++n) y_dy += yv[size_t(i * N + n)] * dyv[size_t(i * N + n)];
    for (int64_t k = 0; k < K; ++k) x_dx += xv[size_t(i * K + k)] * dxv[size_t(i * K + k)];
  }
  for (size_t j = 0; j < wv.size(); ++j) w_dw += wv[j] * (dwv[j] - dw0[j]);
  std::vector<double> y_valid, dy_valid;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t n = 0; n < N && valid[size_t(i)]; ++n) {
      y_valid.push_back(yv[size_t(i * N + n)]);
      dy_valid.push_back(dyv[size_t(i * N + n)]);
    }
  scale = norm(y_valid) * norm(dy_valid) + norm(wv) * norm(dw0);
  EXPECT_LE(std::abs(y_dy - x_dx), 10 * tol * scale) << y_dy << " vs " << x_dx;
  EXPECT_LE(std::abs(y_dy - w_dw), 10 * tol * scale) << y_dy << " vs " << w_dw;

  // Inputs untouched (their NaN rows included).
  EXPECT_TRUE(same_values(get(*be, x), xv));
  EXPECT_TRUE(same_values(get(*be, dy), dyv));
  EXPECT_EQ(get(*be, w), wv);
  EXPECT_EQ(as_ints(get(*be, offsets)), wc.offsets);
  EXPECT_TRUE(arena.guards_intact());
}

INSTANTIATE_TEST_SUITE_P(Windows, GroupedGemmTest,
                         ::testing::Combine(::testing::ValuesIn(kWindows),
                                            ::testing::Values(DType::f64, DType::f32)),
                         window_name);

// A GEMM against central differences of a non-linear objective J = sum(dy * tanh(X W)) in f64:
// dgrad and wgrad, fed dY = dy * (1 - tanh^2), give dJ/dX and dJ/dW.
TEST(GroupedGemm, GradientsMatchFiniteDifferences) {
  auto be = make_cpu_backend(DType::f64);
  Arena arena(*be);
  const std::vector<int32_t> off = {0, 3, 3, 9, 14};  // window [2, 2 + 10): cuts groups 0 and 3
  const int64_t G = 4, row_lo = 2, rows = 10, K = 3, N = 5;
  const Tensor offsets = arena.make(DType::i32, {G + 1});
  put(*be, offsets, as_doubles(off));
  const GroupWindow win{{row_lo, rows}, offsets.as<int32_t>(), int(G)};
  const Tensor x = arena.make(DType::f64, {rows, K}), w = arena.make(DType::f64, {G, K, N});
  const Tensor y = arena.make(DType::f64, {rows, N}), dy = arena.make(DType::f64, {rows, N});
  const Tensor dx = arena.make(DType::f64, {rows, K}), dw = arena.make(DType::f64, {G, K, N});
  auto xv = put_random(*be, x, 201);
  auto wv = put_random(*be, w, 202);
  const auto up = test::random_values(size_t(rows * N), 203);
  std::vector<bool> valid(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i)
    valid[size_t(i)] = test::ref::group_of_row(off, row_lo, i) >= 0;

  auto objective = [&]() {
    put(*be, x, xv);
    put(*be, w, wv);
    be->gemm_fprop(GemmArgs{win, x, w, y}, nullptr);
    const auto yv = get(*be, y);
    double j = 0;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t n = 0; n < N && valid[size_t(i)]; ++n)
        j += up[size_t(i * N + n)] * std::tanh(yv[size_t(i * N + n)]);
    return j;
  };
  objective();
  const auto yv = get(*be, y);
  std::vector<double> dyv(size_t(rows * N), 0.0);
  for (size_t i = 0; i < dyv.size(); ++i) {
    const double th = std::tanh(yv[i]);
    dyv[i] = up[i] * (1 - th * th);
  }
  put(*be, dy, dyv);
  be->gemm_dgrad(GemmArgs{win, dy, w, dx}, nullptr);
  be->fill_zero(dw, nullptr);
  be->gemm_wgrad(GemmArgs{win, x, dy, dw}, nullptr);
  const auto dxv = get(*be, dx), dwv = get(*be, dw);

  const double eps = 1e-6;
  auto fd = [&](std::vector<double>& v) {
    std::vector<double> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const double keep = v[i];
      v[i] = keep + eps;
      const double jp = objective();
      v[i] = keep - eps;
      const double jm = objective();
      v[i] = keep;
      out[i] = (jp - jm) / (2 * eps);
    }
    return out;
  };
  const auto fd_x = fd(xv);
  const auto fd_w = fd(wv);
  std::vector<double> dx_valid, fd_x_valid;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t k = 0; k < K && valid[size_t(i)]; ++k) {
      dx_valid.push_back(dxv[size_t(i * K + k)]);
      fd_x_valid.push_back(fd_x[size_t(i * K + k)]);
    }
  EXPECT_LT(rel_error(dx_valid, fd_x_valid), kFdTolerance);
  EXPECT_LT(rel_error(dwv, fd_w), kFdTolerance);
  EXPECT_TRUE(arena.guards_intact());
}

// =================================================================================================
// SwiGLU
// =================================================================================================

class SwigluTest : public ::testing::TestWithParam<WindowParam> {};

TEST_P(SwigluTest, ValidPrefixOnlyAndMatchesReference) {
  const auto& [wc, dt] = GetParam();
  auto be = make_cpu_backend(dt);
  Arena arena(*be);
  const int64_t G = int64_t(wc.offsets.size()) - 1, rows = wc.rows, F = wc.K;
  const double tol = tolerance(dt);
  const Tensor offsets = arena.make(DType::i32, {G + 1});
  put(*be, offsets, as_doubles(wc.offsets));
  const GroupWindow win{{wc.row_lo, rows}, offsets.as<int32_t>(), int(G)};
  const int64_t valid_rows = test::ref::valid_prefix(wc.offsets, wc.row_lo, rows);
  std::vector<bool> valid(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) valid[size_t(i)] = i < valid_rows;

  const DType act = be->activation_dtype();
  const Tensor h = arena.make(act, {rows, 2 * F}), a = arena.make(act, {rows, F});
  const Tensor da = arena.make(act, {rows, F}), dh = arena.make(act, {rows, 2 * F});
  put(*be, h, rows_or_nan(valid, 2 * F, 301, -4.0, 4.0));
  put(*be, da, rows_or_nan(valid, F, 302));
  const auto hv = get(*be, h), dav = get(*be, da);

  SwigluArgs args{win, h, a, da, dh};
  poison(*be, a);
  be->swiglu_forward(args, nullptr);
  std::vector<double> a_ref(size_t(rows * F), kPoison);
  test::ref::swiglu_forward(valid_rows, F, hv, a_ref);
  {
    SCOPED_TRACE("forward");
    expect_rows(get(*be, a), a_ref, valid, F, dt, tol);
  }

  poison(*be, dh);
  be->swiglu_backward(args, nullptr);
  std::vector<double> dh_ref(size_t(rows * 2 * F), kPoison);
  test::ref::swiglu_backward(valid_rows, F, hv, dav, dh_ref);
  const auto dhv = get(*be, dh);
  {
    SCOPED_TRACE("backward");
    expect_rows(dhv, dh_ref, valid, 2 * F, dt, tol);
  }

  // Central differences of J = sum(da * a(h)) in f64. SwiGLU is elementwise in (gate, up) pairs,
  // so shifting every gate (or every up) at once measures each element's own derivative.
  if (dt == DType::f64 && valid_rows > 0) {
    const double eps = 1e-6;
    std::vector<double> fd(size_t(valid_rows * 2 * F)), got(fd.size());
    for (int half = 0; half < 2; ++half) {
      std::vector<double> plus = hv, minus = hv;
      for (int64_t i = 0; i < valid_rows; ++i)
        for (int64_t f = 0; f < F; ++f) {
          plus[size_t(i * 2 * F + half * F + f)] += eps;
          minus[size_t(i * 2 * F + half * F + f)] -= eps;
        }
      put(*be, h, plus);
      be->swiglu_forward(args, nullptr);
      const auto ap = get(*be, a);
      put(*be, h, minus);
      be->swiglu_forward(args, nullptr);
      const auto am = get(*be, a);
      for (int64_t i = 0; i < valid_rows; ++i)
        for (int64_t f = 0; f < F; ++f) {
          const size_t at = size_t(i * 2 * F + half * F + f);
          fd[at] =
              dav[size_t(i * F + f)] * (ap[size_t(i * F + f)] - am[size_t(i * F + f)]) / (2 * eps);
          got[at] = dhv[at];
        }
    }
    put(*be, h, hv);
    EXPECT_LT(rel_error(got, fd), kFdTolerance);
  }
  EXPECT_TRUE(arena.guards_intact());
}

INSTANTIATE_TEST_SUITE_P(Windows, SwigluTest,
                         ::testing::Combine(::testing::ValuesIn(kWindows),
                                            ::testing::Values(DType::f64, DType::f32)),
                         window_name);

// =================================================================================================
// Fan out / fan in
// =================================================================================================

// A random fan table over the valid prefix of a window: valid rows split into leads with 1..K
// members in random order (lead first), plus a few orphan rows no lead names (members[q][0] = -1,
// left alone by both ops). Non-lead rows hold -1 then garbage, padding weights and non-lead
// weights are NaN (never read), and rows past the valid prefix hold stale leads
// (members[q][0] == q) that must be ignored.
struct FanCase {
  std::vector<int32_t> members;  // [rows, K]
  std::vector<double> weights;   // [rows, K]
  std::vector<bool> lead, member;
};

FanCase random_fan_table(int64_t rows, int64_t valid, int64_t K, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> any_row(-1, int32_t(std::max<int64_t>(rows - 1, 0)));
  std::uniform_real_distribution<double> weight(0.05, 1.0);
  FanCase f;
  f.members.resize(size_t(rows * K));
  for (auto& m : f.members) m = any_row(rng);
  f.weights.assign(size_t(rows * K), kNaN);
  f.lead.assign(size_t(rows), false);
  f.member.assign(size_t(rows), false);
  for (int64_t q = valid; q < rows; ++q) f.members[size_t(q * K)] = int32_t(q);
  std::vector<int32_t> order(static_cast<size_t>(valid));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  for (size_t at = 0; at < order.size();) {
    if (rng() % 8 == 0) {  // an orphan
      f.members[size_t(order[at]) * size_t(K)] = -1;
      ++at;
      continue;
    }
    const size_t n = std::min<size_t>(1 + rng() % size_t(K), order.size() - at);
    const int64_t p = order[at];
    f.lead[size_t(p)] = true;
    for (size_t m = 0; m < size_t(K); ++m) {
      f.members[size_t(p * K) + m] = m < n ? order[at + m] : -1;
      if (m < n) f.weights[size_t(p * K) + m] = weight(rng);
    }
    for (size_t m = 0; m < n; ++m) {
      const int64_t j = order[at + m];
      f.member[size_t(j)] = true;
      if (m > 0) f.members[size_t(j * K)] = -1;
    }
    at += n;
  }
  return f;
}

// Rows of `got`: where `written`, close to `want`; elsewhere bit-for-bit `before` (NaN included).
void expect_fan_rows(const std::vector<double>& got, const std::vector<double>& want,
                     const std::vector<double>& before, const std::vector<bool>& written,
                     int64_t cols, double tol, const char* what) {
  std::vector<double> g, w;
  int64_t changed = 0;
  for (size_t i = 0; i < written.size(); ++i)
    for (int64_t c = 0; c < cols; ++c) {
      const size_t at = i * size_t(cols) + size_t(c);
      if (written[i]) {
        g.push_back(got[at]);
        w.push_back(want[at]);
      } else if (!(got[at] == before[at] || (std::isnan(got[at]) && std::isnan(before[at])))) {
        ++changed;
      }
    }
  EXPECT_EQ(changed, 0) << what << ": rows the op must leave alone were written";
  EXPECT_LE(rel_error(g, w), tol) << what;
}

using FanParam = std::tuple<WindowCase, int, DType>;

std::string fan_name(const ::testing::TestParamInfo<FanParam>& info) {
  return std::string(std::get<0>(info.param).name) + "_K" +
         std::to_string(std::get<1>(info.param)) + "_" + dtype_name(std::get<2>(info.param));
}

class FanTest : public ::testing::TestWithParam<FanParam> {};

TEST_P(FanTest, OutAndInMatchReferenceOnLeadsAndMembersOnly) {
  const auto& [wc, top_k, dt] = GetParam();
  auto be = make_cpu_backend(dt);
  Arena arena(*be);
  const int64_t G = int64_t(wc.offsets.size()) - 1, rows = wc.rows, K = top_k, H = wc.N;
  const double tol = tolerance(dt);
  const Tensor offsets = arena.make(DType::i32, {G + 1});
  put(*be, offsets, as_doubles(wc.offsets));
  const GroupWindow win{{wc.row_lo, rows}, offsets.as<int32_t>(), int(G)};
  const int64_t valid = test::ref::valid_prefix(wc.offsets, wc.row_lo, rows);
  const uint64_t seed = uint64_t(rows * 1000 + K * 10 + H);
  const FanCase fc = random_fan_table(rows, valid, K, seed);

  const DType act = be->activation_dtype(), fl = be->float_dtype();
  const Tensor members = arena.make(DType::i32, {rows, K}), weights = arena.make(fl, {rows, K});
  const Tensor src = arena.make(act, {rows, H}), other = arena.make(act, {rows, H});
  const Tensor dst = arena.make(act, {rows, H}), d_weight = arena.make(fl, {rows});
  put(*be, members, as_doubles(fc.members));
  put(*be, weights, fc.weights);
  const auto wv = get(*be, weights);  // as stored
  // src: lead rows only are read by fan_out, member rows by fan_in; other: member rows.
  const std::vector<bool>&lead_rows = fc.lead, &member_rows = fc.member;
  auto stored = [&](const Tensor& t, const std::vector<double>& v) {
    put(*be, t, v);
    return get(*be, t);
  };
  const auto src_lead = stored(src, rows_or_nan(lead_rows, H, seed + 1));
  const auto src_member = stored(src, rows_or_nan(member_rows, H, seed + 2));
  const auto other_v = stored(other, rows_or_nan(member_rows, H, seed + 3));
  std::vector<double> poisoned(size_t(rows * H), kPoison), poisoned_w(size_t(rows), kPoison);

  struct Mode {
    const char* name;
    bool weighted, grad;
    enum { distinct, in_place, onto_other } dst;
  };
  for (const Mode mode :
       {Mode{"copy in place", false, false, Mode::in_place},
        Mode{"copy", false, false, Mode::distinct}, Mode{"weighted", true, false, Mode::distinct},
        Mode{"weighted with d_weight", true, true, Mode::distinct},
        Mode{"weighted with d_weight onto other", true, true, Mode::onto_other},
        Mode{"unweighted with d_weight onto other", false, true, Mode::onto_other}}) {
    SCOPED_TRACE(std::string("fan_out ") + mode.name);
    put(*be, src, src_lead);
    put(*be, other, other_v);
    poison(*be, dst);
    poison(*be, d_weight);
    FanArgs a;
    a.window = win;
    a.members = members;
    a.weights = mode.weighted ? weights : Tensor();
    a.src = src;
    a.dst = mode.dst == Mode::in_place ? src : mode.dst == Mode::onto_other ? other : dst;
    a.other = mode.grad ? other : Tensor();
    a.d_weight = mode.grad ? d_weight : Tensor();
    be->fan_out(a, nullptr);

    const std::vector<double>& before = mode.dst == Mode::in_place     ? src_lead
                                        : mode.dst == Mode::onto_other ? other_v
                                                                       : poisoned;
    std::vector<double> want = before, want_dw = poisoned_w;
    test::ref::fan_out(valid, K, H, fc.members, mode.weighted ? wv : std::vector<double>{},
                       src_lead, mode.grad ? &other_v : nullptr, want, &want_dw);
    expect_fan_rows(get(*be, a.dst), want, before, fc.member, H, tol, "dst");
    if (mode.dst != Mode::in_place) {
      expect_fan_rows(get(*be, src), src_lead, src_lead, std::vector<bool>(size_t(rows)), H, 0,
                      "src");
    }
    if (mode.grad)
      expect_fan_rows(get(*be, d_weight), want_dw, poisoned_w, fc.member, 1, tol, "d_weight");
  }

  for (bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "fan_in weighted" : "fan_in unweighted");
    put(*be, src, src_member);
    poison(*be, dst);
    FanArgs a;
    a.window = win;
    a.members = members;
    a.weights = weighted ? weights : Tensor();
    a.src = src;
    a.dst = dst;
    be->fan_in(a, nullptr);
    std::vector<double> want = poisoned;
    test::ref::fan_in(valid, K, H, fc.members, weighted ? wv : std::vector<double>{}, src_member,
                      want);
    expect_fan_rows(get(*be, dst), want, poisoned, fc.lead, H, tol, "dst");
  }

  // Adjoints: <fan_out_w(a), b> over member rows = <a, fan_in_w(b)> over lead rows, and d_weight
  // is the derivative of <fan_out_w(a), b> in each member's weight.
  if (dt == DType::f64 && valid > 0) {
    const auto a_v = rows_or_nan(lead_rows, H, seed + 4),
               b_v = rows_or_nan(member_rows, H, seed + 5);
    FanArgs out;
    out.window = win;
    out.members = members;
    out.weights = weights;
    out.src = src;
    out.dst = dst;
    out.other = other;
    out.d_weight = d_weight;
    put(*be, src, a_v);
    put(*be, other, b_v);
    poison(*be, dst);
    be->fan_out(out, nullptr);
    const auto fa = get(*be, dst), dw = get(*be, d_weight);
    FanArgs in = out;
    in.src = other;
    in.other = Tensor();
    in.d_weight = Tensor();
    poison(*be, dst);
    be->fan_in(in, nullptr);
    const auto fb = get(*be, dst);
    double lhs = 0, rhs = 0, dw_sum = 0;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const size_t at = size_t(i * H + h);
        if (fc.member[size_t(i)]) lhs += fa[at] * b_v[at];
        if (fc.lead[size_t(i)]) rhs += a_v[at] * fb[at];
      }
    // sum_j w_j d_weight[j] = <fan_out_w(a), b> (linear in the weights).
    for (int64_t p = 0; p < valid; ++p)
      for (int64_t m = 0; m < K && fc.lead[size_t(p)]; ++m) {
        const int32_t j = fc.members[size_t(p * K + m)];
        if (j < 0) break;
        dw_sum += wv[size_t(p * K + m)] * dw[size_t(j)];
      }
    EXPECT_NEAR(lhs, rhs, 1e-12 * (1 + std::fabs(lhs)));
    EXPECT_NEAR(dw_sum, lhs, 1e-12 * (1 + std::fabs(lhs)));
  }
  EXPECT_TRUE(arena.guards_intact());
}

INSTANTIATE_TEST_SUITE_P(Windows, FanTest,
                         ::testing::Combine(::testing::ValuesIn(kWindows),
                                            ::testing::Values(1, 3, kMaxTopK),
                                            ::testing::Values(DType::f64, DType::f32)),
                         fan_name);

// A weighted copy in place is refused (the lead row would be scaled before its members read it);
// a sum in place (dst == src, the chunked backward's fan-in) gives the lead rows of a sum into
// another buffer and leaves the other rows as they are.
TEST(Fan, RejectsWeightedCopyInPlaceAndSumsInPlace) {
  auto be = make_cpu_backend(DType::f64);
  Arena arena(*be);
  std::vector<int32_t> off{0, 5};
  const Tensor offsets = arena.make(DType::i32, {2});
  put(*be, offsets, as_doubles(off));
  // Leads 1 (members 1, 4, 0) and 2 (alone); rows 0, 3 and 4 are other members or none.
  const Tensor members = arena.make(DType::i32, {5, 3}), weights = arena.make(DType::f64, {5, 3});
  const Tensor x = arena.make(DType::f64, {5, 4}), apart = arena.make(DType::f64, {5, 4});
  put(*be, members, {-1, 9, 9, 1, 4, 0, 2, -1, 9, -1, 9, 9, -1, 9, 9});
  put_random(*be, weights, 1);
  put_random(*be, x, 2);
  FanArgs a;
  a.window = GroupWindow{{0, 5}, offsets.as<int32_t>(), 1};
  a.members = members;
  a.weights = weights;
  a.src = x;
  a.dst = x;
  EXPECT_THROW(be->fan_out(a, nullptr), Error);
  const auto before = get(*be, x);
  put(*be, apart, before);
  a.dst = apart;
  be->fan_in(a, nullptr);
  const auto want = get(*be, apart);
  a.dst = x;
  be->fan_in(a, nullptr);
  const auto got = get(*be, x);
  for (int64_t r = 0; r < 5; ++r)
    for (int64_t h = 0; h < 4; ++h) {
      const size_t i = size_t(r * 4 + h);
      EXPECT_EQ(got[i], (r == 1 || r == 2) ? want[i] : before[i]) << "row " << r << " h " << h;
    }
  EXPECT_NE(want[4], before[4]) << "lead row 1 was not summed";
}

// =================================================================================================
// AdamW
// =================================================================================================

TEST(AdamW, TwoStepsMatchHandWrittenUpdate) {
  for (DType dt : {DType::f64, DType::f32})
    for (double wd : {0.0, 0.1})
      for (bool zero_state : {true, false}) {  // a real first step starts from m = v = 0
        SCOPED_TRACE(dtype_name(dt) + " wd=" + std::to_string(wd) +
                     (zero_state ? " fresh state" : " random state"));
        auto be = make_cpu_backend(dt);
        Arena arena(*be);
        const Tensor p = arena.make(dt, {37, 3}), g = arena.make(dt, {37, 3});
        const Tensor m = arena.make(be->float_dtype(), {37, 3}),
                     v = arena.make(be->float_dtype(), {37, 3});
        auto pv = put_random(*be, p, 1);
        std::vector<double> mv(111, 0.0), vv(111, 0.0);
        if (zero_state) {
          be->fill_zero(m, nullptr);
          be->fill_zero(v, nullptr);
        } else {
          mv = put_random(*be, m, 2, -0.1, 0.1);
          vv = put_random(*be, v, 3, 0.001, 0.01);
        }
        for (int64_t step = 1; step <= 2; ++step) {
          const auto gv = put_random(*be, g, 10 + uint64_t(step));
          AdamWArgs a;
          a.param = p;
          a.grad = g;
          a.m = m;
          a.v = v;
          a.lr = 1e-2;
          a.beta1 = 0.9;
          a.beta2 = 0.95;
          a.eps = 1e-8;
          a.weight_decay = wd;
          int32_t step_value = int32_t(step);
          a.step = Tensor(&step_value, DType::i32, {1});
          be->adamw(a, nullptr);
          test::ref::adamw_step(pv, gv, mv, vv, a.lr, a.beta1, a.beta2, a.eps, wd, step);
          EXPECT_LT(rel_error(get(*be, p), pv), tolerance(dt)) << "step " << step;
          EXPECT_LT(rel_error(get(*be, m), mv), tolerance(dt)) << "step " << step;
          EXPECT_LT(rel_error(get(*be, v), vv), tolerance(dt)) << "step " << step;
          EXPECT_EQ(get(*be, g), gv);
          // Keep the reference on what the tensors hold, so f32 rounding does not compound.
          pv = get(*be, p);
          mv = get(*be, m);
          vv = get(*be, v);
        }
        EXPECT_TRUE(arena.guards_intact());
      }
}

// =================================================================================================
// Layout
// =================================================================================================

enum class Routing { uniform, hot_expert, few_experts };

struct LayoutCase {
  int R, EPR, K;
};
void PrintTo(const LayoutCase& c, std::ostream* os) {
  *os << "R=" << c.R << " E/R=" << c.EPR << " K=" << c.K;
}

class LayoutTest : public ::testing::TestWithParam<LayoutCase> {};

// topk_idx [T, K] of one source: K distinct experts per token.
std::vector<int32_t> random_routes(int64_t T, int K, int E, Routing routing, std::mt19937_64& rng) {
  std::vector<int32_t> idx(size_t(T) * size_t(K));
  const int pool = routing == Routing::few_experts ? std::max(K, E / 2) : E;
  std::vector<int32_t> perm(static_cast<size_t>(pool));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    if (routing == Routing::hot_expert) {  // expert 0 first for every token
      std::iter_swap(perm.begin(), std::find(perm.begin(), perm.end(), 0));
    }
    for (int k = 0; k < K; ++k) idx[size_t(t * K + k)] = perm[size_t(k)];
  }
  return idx;
}

// What a sweep of layouts exercised (so a sweep that never clones or spills is noticed).
struct LayoutCoverage {
  int64_t layouts = 0, with_clones = 0, with_spill_rounds = 0, with_empty_experts = 0;
};

// Every rank's layout from one routing map and plan, checked against the receive-layout rules.
void check_layout(Backend& be, const PlannerConfig& cfg, bool echo,
                  const std::vector<std::vector<int32_t>>& routes, int K, int64_t capacity,
                  LayoutCoverage& coverage) {
  const int R = cfg.ranks, E = cfg.experts, EPR = cfg.experts_per_rank(), S = cfg.spare_slots;
  const int M = cfg.max_replicas(), slots = EPR + S;
  Arena arena(be);
  std::vector<int32_t> C(size_t(R) * size_t(E), 0);
  for (int src = 0; src < R; ++src)
    for (int32_t e : routes[size_t(src)]) ++C[size_t(src) * size_t(E) + size_t(e)];
  const Tensor routing_map = arena.make(DType::i32, {R, E});
  put(be, routing_map, as_doubles(C));
  const Tensor plan = arena.make(DType::i32, {plan_ints(cfg)});
  poison(be, plan);
  be.plan(routing_map, cfg, echo, plan, nullptr);
  auto plan_host = as_ints(get(be, plan));
  const PlanView pv = plan_view(plan_host.data(), cfg);
  {  // Backend::plan is the planner of planner.hpp.
    Plan direct(cfg);
    if (echo)
      plan_echo(C.data(), cfg, direct.view());
    else
      plan_none(C.data(), cfg, direct.view());
    EXPECT_EQ(plan_host, direct.storage) << "Backend::plan differs from the planner";
  }

  int64_t max_load = 0;
  for (int r = 0; r < R; ++r) max_load = std::max<int64_t>(max_load, pv.load_after[r]);
  const int64_t rounds = std::max<int64_t>(1, (max_load + capacity - 1) / capacity) + 1;
  ++coverage.layouts;
  coverage.with_clones += pv.num_clones[0] > 0;
  coverage.with_spill_rounds += max_load > capacity;
  for (int e = 0; e < E; ++e) {
    int64_t rows = 0;
    for (int src = 0; src < R; ++src) rows += C[size_t(src) * size_t(E) + size_t(e)];
    if (rows == 0 && max_load > 0) {
      ++coverage.with_empty_experts;
      break;
    }
  }

  // Rows of each (rank, slot) according to the plan, and the expert each slot holds.
  std::vector<int64_t> plan_rows(size_t(R * slots), 0);
  std::vector<int> slot_expert(size_t(R * slots), -1);
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < EPR; ++g) slot_expert[size_t(r * slots + g)] = r * EPR + g;
    for (int s = 0; s < S; ++s)
      slot_expert[size_t(r * slots + EPR + s)] = pv.spare_expert[r * S + s];
  }
  for (int e = 0; e < E; ++e)
    for (int j = 0; j < M; ++j)
      if (pv.replica_rank[e * M + j] >= 0)
        plan_rows[size_t(pv.replica_rank[e * M + j] * slots + pv.replica_slot[e * M + j])] +=
            pv.replica_rows[e * M + j];

  // One layout call per rank.
  struct RankOut {
    std::vector<int32_t> dest_rank, dest_row, offsets, rank_rows, round_active;
  };
  std::vector<RankOut> out(static_cast<size_t>(R));
  for (int me = 0; me < R; ++me) {
    const int64_t T = int64_t(routes[size_t(me)].size()) / K;
    const Tensor topk_idx = arena.make(DType::i32, {T, K});
    put(be, topk_idx, as_doubles(routes[size_t(me)]));
    LayoutArgs a;
    a.routing_map = routing_map;
    a.plan = plan;
    a.topk_idx = topk_idx;
    a.assign = arena.make(DType::i32, {int64_t(R) * E * M});
    a.dest_rank = arena.make(DType::i32, {T * K});
    a.dest_row = arena.make(DType::i32, {T * K});
    a.group_offsets = arena.make(DType::i32, {slots + 1});
    a.rank_rows = arena.make(DType::i32, {R});
    a.round_active = arena.make(DType::i32, {rounds});
    a.planner = cfg;
    a.rank = me;
    a.slots = slots;
    a.capacity = capacity;
    for (const Tensor* t :
         {&a.assign, &a.dest_rank, &a.dest_row, &a.group_offsets, &a.rank_rows, &a.round_active})
      poison(be, *t);
    be.layout(a, nullptr);
    RankOut& o = out[size_t(me)];
    o.dest_rank = as_ints(get(be, a.dest_rank));
    o.dest_row = as_ints(get(be, a.dest_row));
    o.offsets = as_ints(get(be, a.group_offsets));
    o.rank_rows = as_ints(get(be, a.rank_rows));
    o.round_active = as_ints(get(be, a.round_active));
    EXPECT_EQ(as_ints(get(be, topk_idx)), routes[size_t(me)]);
  }
  EXPECT_EQ(as_ints(get(be, plan)), plan_host) << "layout changed the plan";

  // Shared outputs agree on every rank; offsets and rank rows agree with the plan.
  for (int me = 0; me < R; ++me) {
    SCOPED_TRACE("rank " + std::to_string(me));
    const RankOut& o = out[size_t(me)];
    EXPECT_EQ(o.rank_rows, out[0].rank_rows);
    EXPECT_EQ(o.round_active, out[0].round_active);
    EXPECT_EQ(o.rank_rows[size_t(me)], pv.load_after[me]);
    // Fatal: the row checks below index by these offsets.
    ASSERT_EQ(o.offsets[0], 0);
    for (int g = 0; g < slots; ++g)
      ASSERT_EQ(o.offsets[size_t(g + 1)] - o.offsets[size_t(g)], plan_rows[size_t(me * slots + g)])
          << "slot " << g;
    ASSERT_EQ(o.offsets[size_t(slots)], pv.load_after[me]);
  }
  for (int r = 0; r < R; ++r) EXPECT_EQ(out[0].rank_rows[size_t(r)], pv.load_after[r]);
  for (int64_t round = 0; round < rounds; ++round)
    EXPECT_EQ(out[0].round_active[size_t(round)], max_load > round * capacity ? 1 : 0)
        << "round " << round;

  // Every (rank, receive row) is hit exactly once; remember who hit it.
  struct Hit {
    int src = -1;
    int64_t i = -1;
  };
  std::vector<std::vector<Hit>> owner(static_cast<size_t>(R));
  for (int d = 0; d < R; ++d) owner[size_t(d)].resize(size_t(std::max(0, pv.load_after[d])));
  for (int src = 0; src < R; ++src) {
    const RankOut& o = out[size_t(src)];
    for (size_t i = 0; i < o.dest_rank.size(); ++i) {
      const int d = o.dest_rank[i];
      const int64_t row = o.dest_row[i];
      ASSERT_TRUE(d >= 0 && d < R) << "src " << src << " row " << i << " dest_rank " << d;
      ASSERT_TRUE(row >= 0 && row < int64_t(owner[size_t(d)].size()))
          << "src " << src << " row " << i << " dest_row " << row << " on rank " << d;
      Hit& h = owner[size_t(d)][size_t(row)];
      ASSERT_EQ(h.src, -1) << "rank " << d << " row " << row << " hit twice (src " << h.src
                           << " and " << src << ")";
      h = {src, int64_t(i)};
    }
  }
  for (int d = 0; d < R; ++d) {
    const auto& off = out[size_t(d)].offsets;
    for (int g = 0; g < slots; ++g) {
      const int expert = slot_expert[size_t(d * slots + g)];
      Hit prev;
      for (int64_t row = off[size_t(g)]; row < off[size_t(g + 1)]; ++row) {
        const Hit h = owner[size_t(d)][size_t(row)];
        ASSERT_GE(h.src, 0) << "rank " << d << " row " << row << " never hit";
        // The slot holds the routed expert: its home slot, or a spare slot the plan gave it.
        const int routed = routes[size_t(h.src)][size_t(h.i)];
        ASSERT_EQ(routed, expert) << "rank " << d << " slot " << g << " row " << row;
        if (g < EPR) {
          ASSERT_EQ(d, cfg.home_rank(routed));
          ASSERT_EQ(g, cfg.home_slot(routed));
        }
        // By source in rank order, then in (token, k) order.
        ASSERT_TRUE(prev.src < h.src || (prev.src == h.src && prev.i < h.i))
            << "rank " << d << " slot " << g << " row " << row << ": (" << h.src << ", " << h.i
            << ") after (" << prev.src << ", " << prev.i << ")";
        prev = h;
      }
    }
  }
  EXPECT_TRUE(arena.guards_intact());
}

TEST_P(LayoutTest, EveryRowLandsOnceInSlotSourceTokenOrder) {
  const LayoutCase c = GetParam();
  const int R = c.R, E = c.R * c.EPR, K = c.K;
  auto be = make_cpu_backend(DType::f32);
  const int64_t token_choices[] = {0, 1, 7, 255, 256, 257};
  uint64_t seed = uint64_t(R * 100 + c.EPR * 10 + K);
  LayoutCoverage coverage;
  for (Routing routing : {Routing::uniform, Routing::hot_expert, Routing::few_experts})
    for (bool same_tokens : {true, false})
      for (int S = 0; S <= 2; ++S)
        for (int max_clones = 0; max_clones <= 2; ++max_clones)
          for (bool echo : {false, true})
            for (double capacity_factor : {1.0, 0.3}) {
              if (!echo && max_clones > 0) continue;
              std::mt19937_64 rng(++seed);
              std::vector<std::vector<int32_t>> routes(static_cast<size_t>(R));
              int64_t t_max = 0;
              for (int src = 0; src < R; ++src) {
                const int64_t T = same_tokens ? token_choices[seed % 6] : token_choices[rng() % 6];
                t_max = std::max(t_max, T);
                routes[size_t(src)] = random_routes(T, K, E, routing, rng);
              }
              PlannerConfig cfg;
              cfg.ranks = R;
              cfg.experts = E;
              cfg.spare_slots = S;
              cfg.max_clones = max_clones;
              const int64_t capacity =
                  std::max<int64_t>(1, int64_t(std::ceil(capacity_factor * double(t_max) * K)));
              SCOPED_TRACE("routing " + std::to_string(int(routing)) + " same_tokens " +
                           std::to_string(same_tokens) + " S " + std::to_string(S) +
                           " max_clones " + std::to_string(max_clones) + " echo " +
                           std::to_string(echo) + " capacity " + std::to_string(capacity));
              check_layout(*be, cfg, echo, routes, K, capacity, coverage);
              if (HasFatalFailure()) return;
            }
  EXPECT_GT(coverage.with_spill_rounds, 0);
  if (R >= 2 && E > K) {  // with E == K every load is equal and nothing is worth cloning
    EXPECT_GT(coverage.with_clones, 0) << "no sweep case made a clone";
  }
  if (E > K) {  // with E == K every token routes to every expert
    EXPECT_GT(coverage.with_empty_experts, 0) << "no sweep case left an expert empty";
  }
  RecordProperty("layouts", int(coverage.layouts));
}

std::vector<LayoutCase> layout_cases() {
  std::vector<LayoutCase> cases;
  for (int R = 1; R <= 4; ++R)
    for (int EPR = 1; EPR <= 3; ++EPR)
      for (int K = 1; K <= 3; ++K)
        if (K <= R * EPR) cases.push_back({R, EPR, K});
  return cases;
}

std::string layout_name(const ::testing::TestParamInfo<LayoutCase>& info) {
  std::ostringstream name;
  name << "R" << info.param.R << "_EPR" << info.param.EPR << "_K" << info.param.K;
  return name.str();
}

INSTANTIATE_TEST_SUITE_P(Ranks, LayoutTest, ::testing::ValuesIn(layout_cases()), layout_name);

}  // namespace
}  // namespace moe_echo
