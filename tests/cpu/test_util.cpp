#include "test_util.hpp"

#include <gtest/gtest.h>

#include "moe_echo/error.hpp"

namespace moe_echo::test {

std::string config_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError thrown";
  return "";
}

std::vector<double> random_values(size_t n, uint64_t seed, double lo, double hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

std::vector<float> random_floats(size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

std::vector<int32_t> planner_routing_map(int R, int E, int mode, std::mt19937_64& rng) {
  std::vector<int32_t> C(size_t(R) * size_t(E));
  const double alpha = 0.6 + double(rng() % 100) / 50.0;
  for (int s = 0; s < R; ++s)
    for (int e = 0; e < E; ++e) {
      double v = 0;
      switch (mode) {
        case 0: v = double(rng() % 200); break;
        case 1: v = 4000.0 / std::pow(e + 1.0, alpha) * (0.5 + double(rng() % 100) / 100); break;
        case 2: v = e == 0 ? 8000 : double(rng() % 3); break;
        default: v = rng() % 6 == 0 ? double(rng() % 3000) : 0; break;
      }
      C[size_t(s) * size_t(E) + size_t(e)] = int32_t(v);
    }
  return C;
}

}  // namespace moe_echo::test
