// Synthetic tokens whose expert popularity follows a chosen skew, for `moe-echo bench`.
//
// Popularity: expert e has Zipf rank rho(e) (a seeded random permutation, so the hot experts are
// spread over ranks as in real models) and log-popularity
//   log p_e(step) = -s * log(rho(e) + 1) + a * sin(2 pi step / P + phi_e)
// with drift amplitude a (default 0.3) and period P (default 200 steps): popularity drifts
// slowly, so the hot set changes over a run. "uniform" is s = 0, a = 0.
//
// Tokens: the router weight is set to Q, E orthonormal rows of length H (needs E <= H), and
// token t is x_t = Q^T l_t + (I - Q^T Q) n_t with target logits l_t[e] = log p_e + g_{t,e},
// g Gumbel noise and n Gaussian noise. The router's top-k of x_t is then the Gumbel-top-k of p:
// each token draws K distinct experts with probabilities proportional to p, without replacement.
//
// Implementation: src/core/synthetic.cpp (library moe_echo).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe_echo {

struct SkewSpec {
  double exponent = 0.0;   // Zipf s; 0 is uniform
  double drift = 0.3;      // amplitude a of the log-popularity drift
  int drift_period = 200;  // P, steps
};

// The steepest Zipf exponent of a skew. At S = 100 the hottest expert is already 2^100 times as
// popular as the next one (a log-popularity gap of 69, beyond reach of the Gumbel noise), and the
// synthetic logits grow as S log E: larger exponents change no route worth measuring and only
// push the tokens toward the limits of the activation dtype.
constexpr double kMaxZipfExponent = 100;

// "uniform" or "zipf:S" (0 <= S <= kMaxZipfExponent). Throws ConfigError naming `field`
// otherwise (NaN and infinities included).
SkewSpec parse_skew(const std::string& s, const char* field = "skew");
std::string to_string(const SkewSpec& s);

class SyntheticTokens {
 public:
  SyntheticTokens(int experts, int hidden, const SkewSpec& skew, uint64_t seed);
  // Expected share of each expert at `step` (normalised p; a share below ~1e-308 is 0).
  std::vector<double> popularity(int step) const;
  // log p of each expert at `step`, computed in the log domain: finite for every exponent the
  // parser allows, even where p itself underflows to 0.
  std::vector<double> log_popularity(int step) const;
  // Router weight [E, H] that makes the tokens route as described (orthonormal rows).
  const std::vector<double>& router_weight() const { return q_; }
  // Tokens [T, H] for (step, rank), reproducible.
  std::vector<double> tokens(int step, int rank, int count) const;

 private:
  int experts_, hidden_;
  SkewSpec skew_;
  uint64_t seed_;
  std::vector<int> zipf_rank_;
  std::vector<double> phase_, q_;
};

}  // namespace moe_echo
