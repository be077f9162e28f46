#include "moe_echo/synthetic.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "moe_echo/error.hpp"
#include "moe_echo/random.hpp"

namespace moe_echo {

SkewSpec parse_skew(const std::string& s, const char* field) {
  SkewSpec spec;
  if (s == "uniform") {
    spec.exponent = 0;
    spec.drift = 0;
    return spec;
  }
  if (s.rfind("zipf:", 0) == 0) {
    try {
      size_t used = 0;
      spec.exponent = std::stod(s.substr(5), &used);
      if (used == s.size() - 5 && spec.exponent >= 0 && spec.exponent <= kMaxZipfExponent)
        return spec;  // NaN fails both comparisons
    } catch (const std::exception&) {
    }
  }
  reject(field, "'" + s + "'",
         "uniform or zipf:S with 0 <= S <= " + std::to_string(int(kMaxZipfExponent)) +
             " (e.g. zipf:1.2)");
}

std::string to_string(const SkewSpec& s) {
  if (s.exponent == 0 && s.drift == 0) return "uniform";
  std::ostringstream o;
  o << "zipf:" << s.exponent;
  return o.str();
}

SyntheticTokens::SyntheticTokens(int experts, int hidden, const SkewSpec& skew, uint64_t seed)
    : experts_(experts), hidden_(hidden), skew_(skew), seed_(seed) {
  MOE_ECHO_CHECK(experts <= hidden, "synthetic routing needs experts ("
                                        << experts << ") <= hidden (" << hidden << ")");
  Rng rng(seed, 0x51e3, 0);
  zipf_rank_.resize(size_t(experts));
  std::iota(zipf_rank_.begin(), zipf_rank_.end(), 0);
  for (int i = experts - 1; i > 0; --i)
    std::swap(zipf_rank_[size_t(i)], zipf_rank_[rng.below(uint64_t(i) + 1)]);
  phase_.resize(size_t(experts));
  for (auto& p : phase_) p = rng.uniform(0, 6.283185307179586);
  // Q: Gram-Schmidt on Gaussian rows.
  const size_t H = size_t(hidden);
  q_.assign(size_t(experts) * H, 0.0);
  for (int e = 0; e < experts; ++e) {
    double* row = q_.data() + size_t(e) * H;
    for (size_t h = 0; h < H; ++h) row[h] = rng.normal();
    for (int pass = 0; pass < 2; ++pass)
      for (int f = 0; f < e; ++f) {
        const double* other = q_.data() + size_t(f) * H;
        double dot = 0;
        for (size_t h = 0; h < H; ++h) dot += row[h] * other[h];
        for (size_t h = 0; h < H; ++h) row[h] -= dot * other[h];
      }
    double norm = 0;
    for (size_t h = 0; h < H; ++h) norm += row[h] * row[h];
    norm = std::sqrt(norm);
    for (size_t h = 0; h < H; ++h) row[h] /= norm;
  }
}

std::vector<double> SyntheticTokens::log_popularity(int step) const {
  std::vector<double> w(static_cast<size_t>(experts_));
  for (int e = 0; e < experts_; ++e) {
    const double drift =
        skew_.drift *
        std::sin(6.283185307179586 * step / std::max(1, skew_.drift_period) + phase_[size_t(e)]);
    w[size_t(e)] = -skew_.exponent * std::log(zipf_rank_[size_t(e)] + 1.0) + drift;
  }
  // log p = w - logsumexp(w), with the largest w taken out first: no exp overflows and the
  // hottest expert's term is 1, so the sum is in [1, E] and every log p is finite.
  const double top = *std::max_element(w.begin(), w.end());
  double sum = 0;
  for (double v : w) sum += std::exp(v - top);
  const double log_sum = top + std::log(sum);
  for (double& v : w) v -= log_sum;
  return w;
}

std::vector<double> SyntheticTokens::popularity(int step) const {
  std::vector<double> p = log_popularity(step);
  for (double& v : p) v = std::exp(v);
  return p;
}

std::vector<double> SyntheticTokens::tokens(int step, int rank, int count) const {
  const size_t H = size_t(hidden_), E = size_t(experts_);
  const std::vector<double> logp = log_popularity(step);
  std::vector<double> x(size_t(count) * H), coef(E);
  Rng rng(seed_ ^ 0x70c3e5ull, uint64_t(step) + 1, uint64_t(rank) + 1);
  for (int t = 0; t < count; ++t) {
    double* xt = x.data() + size_t(t) * H;
    for (size_t h = 0; h < H; ++h) xt[h] = rng.normal();
    // Remove the noise's component in the span of Q, then add Q^T l.
    for (size_t e = 0; e < E; ++e) {
      const double* q = q_.data() + e * H;
      double dot = 0;
      for (size_t h = 0; h < H; ++h) dot += q[h] * xt[h];
      coef[e] = logp[e] + rng.gumbel() - dot;
    }
    for (size_t e = 0; e < E; ++e) {
      const double* q = q_.data() + e * H;
      for (size_t h = 0; h < H; ++h) xt[h] += coef[e] * q[h];
    }
  }
  return x;
}

}  // namespace moe_echo
