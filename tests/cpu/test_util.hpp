// Shared helpers of the CPU tests: seeded random data and relative-norm comparisons.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <random>
#include <vector>

namespace moe_echo::test {

// The message of the ConfigError that f() throws; records a test failure if it throws none.
std::string config_error(const std::function<void()>& f);

// Fresh random values in [lo, hi) (never all zeros), from a seeded generator.
std::vector<double> random_values(size_t n, uint64_t seed, double lo = -1.0, double hi = 1.0);
std::vector<float> random_floats(size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f);

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
