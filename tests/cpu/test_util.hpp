// Shared helpers of the CPU tests: seeded random data and relative-norm comparisons.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace moe_echo::test {

// The message of the ConfigError that f() throws; records a test failure if it throws none.
std::string config_error(const std::function<void()>& f);

// Fresh random values in [lo, hi) (never all zeros), from a seeded generator.
std::vector<double> random_values(size_t n, uint64_t seed, double lo = -1.0, double hi = 1.0);
std::vector<float> random_floats(size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f);

// A routing map C[R][E] (row-major counts) for planner tests, by mode: 0 uniform in [0, 200),
// 1 Zipf-like 4000 / (e + 1)^alpha with per-entry noise (alpha drawn in [0.6, 2.6)), 2 one hot
// expert (8000 rows on expert 0, 0-2 elsewhere), 3 sparse (a sixth of the entries in [0, 3000)).
std::vector<int32_t> planner_routing_map(int R, int E, int mode, std::mt19937_64& rng);

// ||a - b|| / max(||b||, tiny): the relative error of a against the reference b.
template <class A, class B>
double rel_error(const std::vector<A>& a, const std::vector<B>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  if (a.size() != b.size()) return 1e300;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace moe_echo::test
