// Summary statistics of timing samples, for the benchmarks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace moe_echo {

// The middle sample (the mean of the two middle ones for an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / double(v.size());
}

// The sample at rank round(q * (n - 1)) in ascending order, q in [0, 1]; 0 for none.
inline double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, size_t(q * double(v.size() - 1) + 0.5));
  return v[i];
}

}  // namespace moe_echo
