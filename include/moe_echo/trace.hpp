// Routing traces for the load-balance simulator: sequences of routing maps C[R][E] (rows that
// source rank src routes to expert e), one per step and MoE layer. Two sources: a synthetic
// generator, and recorded counts read from a CSV or JSON file (docs/simulate.md documents both).
//
// Invariants:
// - A trace is consumed one layer at a time, step after step (LayerStream::next); layers are
//   independent, so the simulator may run them on different threads.
// - Deterministic: the same config and seed give the same maps whatever the number of threads
//   and whatever order the layers are read in (every random draw comes from a counter-based
//   stream keyed by (seed, layer, step, source)).
// - Generator: every source sends exactly T*K rows per step and at most T rows to one expert
//   (a token picks K distinct experts).
//
// Part of the offline tools: library moe_echo_offline (CPU only), src/offline/trace.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moe_echo/presets.hpp"
#include "moe_echo/random.hpp"

namespace moe_echo::offline {

// One layer's routing maps, step after step.
class LayerStream {
 public:
  virtual ~LayerStream() = default;
  // Writes the next step's routing map C[ranks][experts] (row-major).
  virtual void next(int32_t* routing_map) = 0;
};

class TraceSource {
 public:
  virtual ~TraceSource() = default;
  virtual int experts() const = 0;
  virtual int layers() const = 0;
  virtual int steps() const = 0;
  // A stream over the maps of `layer` with `ranks` source ranks (ranks must divide nothing in
  // particular; the reader spreads recorded totals over them, see TraceFile).
  virtual std::unique_ptr<LayerStream> open_layer(int layer, int ranks) const = 0;
  virtual std::string describe() const = 0;
};

// ---- Generator -------------------------------------------------------------------------------
//
// Expert popularity of a layer is Zipf over a random ranking of its experts: the base log-weight
// of the expert ranked i (from 0) is mu = -s_layer * ln(i + 1). Around that base each expert's
// log-weight x drifts as a mean-reverting (Ornstein-Uhlenbeck, AR(1)) process,
//   x <- x + (mu - x) / drift_steps + sigma * N(0, 1),
// with sigma chosen so that the stationary standard deviation of x - mu is drift_std. A domain
// switch (probability switch_prob per step, the same steps for all layers) draws a new ranking:
// different experts become hot at once, and the drift keeps its current deviation. The
// probabilities p = softmax(x) are capped at 1/K (water-filling) and every source samples its
// T*K rows multinomially from them (sampling: conditional binomials, see sample_multinomial).
struct GeneratorConfig {  // the shape defaults: DeepSeek-V3's layer (R1 has the same)
  int experts = kDeepSeekV3.experts;
  int top_k = kDeepSeekV3.top_k;
  int tokens = kDeepSeekV3.tokens;  // T: tokens each source rank routes per step
  int layers = 8;
  int steps = 1000;
  // Zipf exponent per layer: empty -> spread linearly from zipf_lo (layer 0) to zipf_hi (last
  // layer); one value -> every layer; else exactly one value per layer.
  std::vector<double> zipf;
  double zipf_lo = 0.5;
  double zipf_hi = 0.7;
  double drift_std = 0.3;      // stationary std of an expert's log-weight around its base
  double drift_steps = 50.0;   // mean-reversion time in steps (AR coefficient 1 - 1/drift_steps)
  double switch_prob = 0.002;  // probability of a domain switch per step
  uint64_t seed = 1;

  double zipf_exponent(int layer) const;
};

// Throws ConfigError naming the first invalid field.
void validate(const GeneratorConfig& cfg);

// The generator's draws on the library's generator (core/random.hpp, the same uniforms):
// normals two per pair of uniforms (Box-Muller: the cosine, then the sine on the next call), and
// Binomial(n, q): exact inversion when n*q*(1-q) < 10, else the normal approximation rounded and
// clamped to [0, n] (documented error: the tails beyond ~4 sigma are cut).
class Sampler {
 public:
  explicit Sampler(uint64_t seed) : rng_(seed) {}
  double uniform() { return rng_.uniform(); }  // [0, 1)
  double normal();                             // N(0, 1)
  int64_t binomial(int64_t n, double q);

 private:
  Rng rng_;
  double spare_ = 0;
  bool has_spare_ = false;
};

// A stream key: mixes its arguments into a seed (splitmix64 finaliser).
uint64_t stream_seed(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0);

// Multinomial(n, p) into out[i] for categories in `order` (descending p is best: the large
// counts take the normal approximation, the small ones exact inversion), by conditional
// binomials: category order[j] draws Binomial(left, p_j / p_left). Each count is clamped to
// `cap` (rows above it go to the categories below the cap, in order). Sum of out is exactly n
// when n <= cap * p.size().
void sample_multinomial(Sampler& rng, int64_t n, const std::vector<double>& p,
                        const std::vector<int>& order, int64_t cap, int32_t* out);

// Caps probabilities at `cap` by water-filling (the excess is spread over the others in
// proportion to their weight), keeping the sum 1. Requires cap * p.size() >= 1.
void cap_probabilities(std::vector<double>& p, double cap);

class TraceGenerator final : public TraceSource {
 public:
  explicit TraceGenerator(GeneratorConfig cfg);  // validates
  int experts() const override { return cfg_.experts; }
  int layers() const override { return cfg_.layers; }
  int steps() const override { return cfg_.steps; }
  std::unique_ptr<LayerStream> open_layer(int layer, int ranks) const override;
  std::string describe() const override;
  const GeneratorConfig& config() const { return cfg_; }
  // Whether a domain switch happens at `step` (the same for every layer).
  bool domain_switch(int step) const;

 private:
  GeneratorConfig cfg_;
};

// The generator's stream of one layer; public so tests can read the popularity behind a map.
class GeneratorStream final : public LayerStream {
 public:
  GeneratorStream(const TraceGenerator& gen, int layer, int ranks);
  void next(int32_t* routing_map) override;
  // After next(): the step just produced, the capped probabilities it was sampled from, the
  // uncapped log-weights x and their bases mu, and the expert ranked i-th (hottest first).
  int step() const { return step_; }
  const std::vector<double>& probabilities() const { return p_; }
  const std::vector<double>& log_weights() const { return x_; }
  const std::vector<double>& base_log_weights() const { return mu_; }
  const std::vector<int>& ranking() const { return ranking_; }

 private:
  void draw_ranking(uint64_t key);

  const TraceGenerator& gen_;
  int layer_, ranks_, step_ = -1;
  std::vector<int> ranking_;  // ranking_[i]: expert ranked i
  std::vector<double> mu_, x_, p_;
  std::vector<int> order_;  // experts by descending p
};

// ---- Trace files -----------------------------------------------------------------------------
//
// Recorded per-step, per-layer expert counts (docs/simulate.md, "Trace files"):
// - CSV, long form: header `step,layer,expert,count` (optionally a `src` column), one row per
//   nonzero count; missing entries are 0.
// - CSV, wide form: header `step,layer,e0,e1,...,e{E-1}` (optionally `src` after `layer`), one
//   row per (step, layer[, src]).
// - JSON: {"format": "moe-echo-trace", "version": 1, "experts": E, "layers": L, "steps": N,
//   "source_ranks": R (optional, 0 or absent: per-expert totals), "counts": [step][layer][expert]
//   or [step][layer][src][expert]}.
// Lines starting with '#' and blank lines are skipped in CSV. Steps and layers are numbered from
// 0; every step 0..N-1 and layer 0..L-1 must appear at least once.
class TraceFile final : public TraceSource {
 public:
  // Reads `path` (".json" -> JSON, else CSV). `experts` = 0 infers the count (CSV: largest
  // expert index + 1); otherwise expert indices must be below it. Errors throw ConfigError
  // naming the file and the line (CSV) or the JSON path.
  static TraceFile read(const std::string& path, int experts = 0);
  static TraceFile parse_csv(const std::string& text, const std::string& origin, int experts = 0);
  static TraceFile parse_json(const std::string& text, const std::string& origin, int experts = 0);
  // The per-expert totals of every map of `source` (read with `ranks` sources), kept in memory:
  // a cheap source for repeated simulations whose policies depend on expert loads only.
  static TraceFile totals_of(const TraceSource& source, int ranks);

  int experts() const override { return experts_; }
  int layers() const override { return layers_; }
  int steps() const override { return steps_; }
  int source_ranks() const { return source_ranks_; }  // 0: per-expert totals only
  // Maps: when the file has per-source counts and `ranks` equals source_ranks(), they are used
  // as recorded. Otherwise each expert's total is spread evenly over `ranks` sources (c / R each,
  // the remainder one row each to sources e, e+1, ... mod R), which keeps every expert's load.
  std::unique_ptr<LayerStream> open_layer(int layer, int ranks) const override;
  std::string describe() const override { return origin_; }
  // Per-expert total of (step, layer, expert) over sources.
  int64_t total(int step, int layer, int expert) const;

 private:
  std::string origin_;
  int experts_ = 0, layers_ = 0, steps_ = 0, source_ranks_ = 0;
  std::vector<int32_t> counts_;  // [steps][layers][max(1, source_ranks)][experts]
  friend class TraceFileStream;
};

// Writes `layers` x `steps` maps of `source` as a wide-form CSV (per-expert totals, or per source
// rank when `ranks` > 0 and per_source is true).
void write_trace_csv(const TraceSource& source, int ranks, bool per_source,
                     const std::string& path);

}  // namespace moe_echo::offline
