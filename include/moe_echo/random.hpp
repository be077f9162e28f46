// The library's one random generator (splitmix64), small, portable and seedable: the same stream
// on every platform and standard library, so initial weights, synthetic data and the offline
// tools' traces are reproducible bit for bit. Streams that tests or recorded results depend on
// must keep their numbers: change nothing here that changes an output.
#pragma once

#include <cmath>
#include <cstdint>

namespace moe_echo {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  // A stream keyed by several integers (seed, expert, tensor id, ...).
  Rng(uint64_t seed, uint64_t a, uint64_t b = 0) : state_(seed) {
    state_ = next() ^ (a * 0x9E3779B97F4A7C15ull);
    state_ = next() ^ (b * 0xC2B2AE3D27D4EB4Full);
  }
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1).
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Standard normal (Box-Muller).
  double normal() {
    double u1 = uniform();
    while (u1 <= 0) u1 = uniform();
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // Gumbel(0, 1).
  double gumbel() {
    double u = uniform();
    while (u <= 0) u = uniform();
    return -std::log(-std::log(u));
  }
  uint64_t below(uint64_t n) { return n ? next() % n : 0; }

 private:
  uint64_t state_;
};

// The splitmix64 finaliser of x + 0x9E3779B97F4A7C15: the first output of Rng(x), and a mixer for
// stream keys.
inline uint64_t splitmix64(uint64_t x) { return Rng(x).next(); }

}  // namespace moe_echo
