// GCC 12 reports a false -Wrestrict inside std::string's operator+ (GCC bug 105329) for the
// error messages below; the pragma must precede the standard headers to reach that code.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wrestrict"
#endif

#include "moe_echo/trace.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "moe_echo/cost_model.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"

namespace moe_echo::offline {

// ---- Random numbers --------------------------------------------------------------------------

// The dense [step][layer][src][expert] count table a trace file becomes: at most 2^26 counts
// (256 MiB), checked before it is allocated.
constexpr size_t kMaxTraceCells = size_t(1) << 26;

namespace {

// Tags that keep the random streams of different purposes apart.
constexpr uint64_t kTagSwitch = 1, kTagRanking = 2, kTagDrift = 3, kTagSource = 4;

constexpr double kNormalVariance = 10.0;  // binomial: normal approximation at n*q*(1-q) >= this

}  // namespace

uint64_t stream_seed(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ a);
  h = splitmix64(h ^ b);
  return splitmix64(h ^ c);
}

double Sampler::normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  const double u1 = 1.0 - uniform();  // (0, 1]
  const double u2 = uniform();
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double t = 6.283185307179586 * u2;
  spare_ = r * std::sin(t);
  has_spare_ = true;
  return r * std::cos(t);
}

int64_t Sampler::binomial(int64_t n, double q) {
  if (n <= 0 || q <= 0) return 0;
  if (q >= 1) return n;
  if (q > 0.5) return n - binomial(n, 1.0 - q);
  const double mean = double(n) * q;
  const double var = mean * (1.0 - q);
  if (var >= kNormalVariance) {
    const double k = std::floor(mean + std::sqrt(var) * normal() + 0.5);
    return int64_t(std::clamp(k, 0.0, double(n)));
  }
  // Exact inversion: walk the pmf from 0 (mean < 2 * kNormalVariance, so few steps and no
  // underflow of (1-q)^n).
  const double ratio = q / (1.0 - q);
  double pk = std::exp(double(n) * std::log1p(-q));
  double u = uniform();
  int64_t k = 0;
  while (u > pk && k < n) {
    u -= pk;
    pk *= ratio * double(n - k) / double(k + 1);
    ++k;
    if (pk <= 0) break;
  }
  return k;
}

void sample_multinomial(Sampler& rng, int64_t n, const std::vector<double>& p,
                        const std::vector<int>& order, int64_t cap, int32_t* out) {
  const size_t m = order.size();
  double p_left = 0;
  for (int e : order) p_left += p[e];
  int64_t left = n;
  for (size_t j = 0; j < m; ++j) {
    const int e = order[j];
    int64_t c;
    if (j + 1 == m || left == 0) {
      c = j + 1 == m ? left : 0;
    } else {
      const double q = p_left > p[e] ? p[e] / p_left : 1.0;
      c = rng.binomial(left, q);
    }
    c = std::min(c, cap);
    out[e] = int32_t(c);
    left -= c;
    p_left -= p[e];
  }
  // Rows cut by the cap go to the categories below it, hottest first.
  for (size_t j = 0; j < m && left > 0; ++j) {
    const int e = order[j];
    const int64_t add = std::min<int64_t>(cap - out[e], left);
    if (add > 0) {
      out[e] += int32_t(add);
      left -= add;
    }
  }
}

void cap_probabilities(std::vector<double>& p, double cap) {
  const size_t n = p.size();
  if (n == 0 || cap * double(n) < 1.0 - 1e-12) return;
  std::vector<int> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(),
            [&](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  // suffix sums of the sorted weights
  std::vector<double> rest(n + 1, 0.0);
  for (size_t i = n; i-- > 0;) rest[i] = rest[i + 1] + p[idx[i]];
  size_t capped = 0;
  double scale = 1.0 / rest[0];
  while (capped < n) {
    scale = rest[capped] > 0 ? (1.0 - double(capped) * cap) / rest[capped] : 0.0;
    if (p[idx[capped]] * scale <= cap) break;
    ++capped;
  }
  for (size_t i = 0; i < n; ++i) p[idx[i]] = i < capped ? cap : p[idx[i]] * scale;
}

// ---- Generator -------------------------------------------------------------------------------

double GeneratorConfig::zipf_exponent(int layer) const {
  if (zipf.size() == 1) return zipf[0];
  if (!zipf.empty()) return zipf.at(size_t(layer));
  if (layers <= 1) return 0.5 * (zipf_lo + zipf_hi);
  return zipf_lo + (zipf_hi - zipf_lo) * double(layer) / double(layers - 1);
}

void validate(const GeneratorConfig& c) {
  if (c.experts < 1) reject("experts", c.experts, "experts >= 1");
  if (c.top_k < 1 || c.top_k > c.experts)
    reject("top_k", c.top_k, "1 <= top_k <= experts (" + std::to_string(c.experts) + ")");
  if (c.tokens < 1) reject("tokens", c.tokens, "tokens >= 1");
  if (int64_t(c.tokens) * c.top_k > std::numeric_limits<int32_t>::max())
    reject("tokens", c.tokens, "tokens * top_k <= 2^31-1");
  if (c.layers < 1) reject("layers", c.layers, "layers >= 1");
  if (c.steps < 1) reject("steps", c.steps, "steps >= 1");
  if (c.zipf.size() > 1 && c.zipf.size() != size_t(c.layers))
    reject("zipf", std::to_string(c.zipf.size()) + " values",
           "one value, or one per layer (" + std::to_string(c.layers) + ")");
  for (double s : c.zipf)
    if (!std::isfinite(s) || s < 0) reject("zipf", s, "finite exponents >= 0");
  if (!std::isfinite(c.zipf_lo) || c.zipf_lo < 0)
    reject("zipf_lo", c.zipf_lo, "a finite value >= 0");
  if (!std::isfinite(c.zipf_hi) || c.zipf_hi < 0)
    reject("zipf_hi", c.zipf_hi, "a finite value >= 0");
  if (!std::isfinite(c.drift_std) || c.drift_std < 0)
    reject("drift_std", c.drift_std, "a finite value >= 0");
  if (!std::isfinite(c.drift_steps) || c.drift_steps < 1)
    reject("drift_steps", c.drift_steps, "a finite value >= 1");
  if (!(c.switch_prob >= 0 && c.switch_prob <= 1))
    reject("switch_prob", c.switch_prob, "0 <= switch_prob <= 1");
}

TraceGenerator::TraceGenerator(GeneratorConfig cfg) : cfg_(std::move(cfg)) { validate(cfg_); }

std::unique_ptr<LayerStream> TraceGenerator::open_layer(int layer, int ranks) const {
  MOE_ECHO_CHECK(layer >= 0 && layer < cfg_.layers, "layer " << layer << " of " << cfg_.layers);
  MOE_ECHO_CHECK(ranks >= 1, "ranks = " << ranks);
  return std::make_unique<GeneratorStream>(*this, layer, ranks);
}

std::string TraceGenerator::describe() const {
  std::ostringstream s;
  s << "generator (zipf ";
  if (cfg_.zipf.empty())
    s << cfg_.zipf_lo << ".." << cfg_.zipf_hi;
  else if (cfg_.zipf.size() == 1)
    s << cfg_.zipf[0];
  else
    s << "per layer";
  s << ", drift_std " << cfg_.drift_std << ", drift_steps " << cfg_.drift_steps << ", switch_prob "
    << cfg_.switch_prob << ", tokens " << cfg_.tokens << ", seed " << cfg_.seed << ")";
  return s.str();
}

bool TraceGenerator::domain_switch(int step) const {
  if (step <= 0 || cfg_.switch_prob <= 0) return false;
  Rng rng(stream_seed(cfg_.seed, kTagSwitch, uint64_t(step)));
  return rng.uniform() < cfg_.switch_prob;
}

GeneratorStream::GeneratorStream(const TraceGenerator& gen, int layer, int ranks)
    : gen_(gen), layer_(layer), ranks_(ranks) {
  const int e = gen.config().experts;
  ranking_.resize(size_t(e));
  mu_.resize(size_t(e));
  x_.resize(size_t(e));
  p_.resize(size_t(e));
  order_.resize(size_t(e));
}

void GeneratorStream::draw_ranking(uint64_t key) {
  Rng rng(key);
  std::iota(ranking_.begin(), ranking_.end(), 0);
  for (size_t i = ranking_.size(); i > 1; --i)  // Fisher-Yates
    std::swap(ranking_[i - 1], ranking_[size_t(rng.next() % i)]);
  const double s = gen_.config().zipf_exponent(layer_);
  for (size_t i = 0; i < ranking_.size(); ++i)
    mu_[size_t(ranking_[i])] = -s * std::log(double(i + 1));
}

void GeneratorStream::next(int32_t* routing_map) {
  const GeneratorConfig& c = gen_.config();
  ++step_;
  const uint64_t layer = uint64_t(layer_), step = uint64_t(step_);
  Sampler drift(stream_seed(c.seed, kTagDrift, layer, step));
  const double theta = 1.0 / c.drift_steps;
  if (step_ == 0) {
    draw_ranking(stream_seed(c.seed, kTagRanking, layer, 0));
    for (size_t e = 0; e < x_.size(); ++e) x_[e] = mu_[e] + c.drift_std * drift.normal();
  } else {
    if (gen_.domain_switch(step_)) {
      std::vector<double> dev(x_.size());
      for (size_t e = 0; e < x_.size(); ++e) dev[e] = x_[e] - mu_[e];
      draw_ranking(stream_seed(c.seed, kTagRanking, layer, step));
      for (size_t e = 0; e < x_.size(); ++e) x_[e] = mu_[e] + dev[e];
    }
    // AR(1) with stationary variance sigma^2 / (1 - (1 - theta)^2) = drift_std^2
    const double sigma = c.drift_std * std::sqrt(theta * (2.0 - theta));
    for (size_t e = 0; e < x_.size(); ++e)
      x_[e] += theta * (mu_[e] - x_[e]) + sigma * drift.normal();
  }
  const double x_max = *std::max_element(x_.begin(), x_.end());
  double sum = 0;
  for (size_t e = 0; e < x_.size(); ++e) sum += p_[e] = std::exp(x_[e] - x_max);
  for (double& v : p_) v /= sum;
  cap_probabilities(p_, 1.0 / c.top_k);
  std::iota(order_.begin(), order_.end(), 0);
  std::sort(order_.begin(), order_.end(), [&](int a, int b) {
    return p_[size_t(a)] > p_[size_t(b)] || (p_[size_t(a)] == p_[size_t(b)] && a < b);
  });
  const int64_t rows = int64_t(c.tokens) * c.top_k;
  for (int src = 0; src < ranks_; ++src) {
    Sampler rng(stream_seed(c.seed, (kTagSource << 32) | layer, step, uint64_t(src)));
    sample_multinomial(rng, rows, p_, order_, c.tokens, routing_map + size_t(src) * x_.size());
  }
}

// ---- Trace files -----------------------------------------------------------------------------

namespace {

[[noreturn]] void file_error(const std::string& origin, size_t line, const std::string& msg) {
  throw ConfigError("trace", origin + ":" + std::to_string(line) + ": " + msg);
}
[[noreturn]] void file_error(const std::string& origin, const std::string& msg) {
  throw ConfigError("trace", origin + ": " + msg);
}

// The counts of a file's table, [steps][layers][max(1, source_ranks)][experts], within
// kMaxTraceCells.
size_t table_cells(const std::string& origin, int steps, int layers, int source_ranks,
                   int experts) {
  const size_t srcs = size_t(std::max(1, source_ranks));
  const size_t cells = size_t(steps) * size_t(layers) * srcs * size_t(experts);
  if (cells > kMaxTraceCells)
    file_error(origin, "too large: steps x layers x sources x experts = " + std::to_string(cells) +
                           " counts (at most 2^26, a 256 MiB table)");
  return cells;
}

std::string trim(std::string_view s) {
  size_t a = 0, b = s.size();
  while (a < b && (s[a] == ' ' || s[a] == '\t' || s[a] == '\r')) ++a;
  while (b > a && (s[b - 1] == ' ' || s[b - 1] == '\t' || s[b - 1] == '\r')) --b;
  return std::string(s.substr(a, b - a));
}

std::vector<std::string> split_csv(std::string_view line) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t comma = line.find(',', start);
    out.push_back(
        trim(line.substr(start, comma == std::string_view::npos ? line.npos : comma - start)));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

int64_t parse_count(const std::string& field, const std::string& column, const std::string& origin,
                    size_t line, int64_t max = std::numeric_limits<int32_t>::max()) {
  int64_t v = 0;
  const char* end = field.data() + field.size();
  const auto [ptr, ec] = std::from_chars(field.data(), end, v);
  if (field.empty() || ec != std::errc() || ptr != end || v < 0)
    file_error(origin, line, "column '" + column + "': '" + field + "' is not an integer >= 0");
  if (v > max)
    file_error(origin, line,
               "column '" + column + "': " + field + " is too large (at most " +
                   std::to_string(max) + ")");
  return v;
}

struct Row {
  int64_t step, layer, src;
  size_t line;
  size_t first;  // index of this row's first value in the value pool
};

}  // namespace

TraceFile TraceFile::parse_csv(const std::string& text, const std::string& origin, int experts) {
  std::istringstream in(text);
  std::string raw;
  size_t line_no = 0;
  std::vector<std::string> header;
  size_t header_line = 0;
  while (std::getline(in, raw)) {
    ++line_no;
    const std::string t = trim(raw);
    if (t.empty() || t[0] == '#') continue;
    header = split_csv(t);
    header_line = line_no;
    break;
  }
  if (header.empty())
    file_error(origin, "no header line (expected step,layer,expert,count or step,layer,e0,e1,...)");

  auto column = [&](const std::string& name) -> int {
    int found = -1;
    for (size_t i = 0; i < header.size(); ++i) {
      if (header[i] != name) continue;
      if (found >= 0) file_error(origin, header_line, "column '" + name + "' appears twice");
      found = int(i);
    }
    return found;
  };
  const int c_step = column("step"), c_layer = column("layer"), c_src = column("src");
  const int c_expert = column("expert"), c_count = column("count");
  if (c_step < 0 || c_layer < 0)
    file_error(origin, header_line, "the header must name the columns 'step' and 'layer'");
  const bool long_form = c_expert >= 0 || c_count >= 0;
  std::vector<int> expert_columns;  // wide form: column of expert e
  if (long_form) {
    if (c_expert < 0 || c_count < 0)
      file_error(origin, header_line, "the long form needs both columns 'expert' and 'count'");
    for (size_t i = 0; i < header.size(); ++i)
      if (int(i) != c_step && int(i) != c_layer && int(i) != c_src && int(i) != c_expert &&
          int(i) != c_count)
        file_error(origin, header_line,
                   "unknown column '" + header[i] + "': allowed step, layer, src, expert, count");
  } else {
    for (size_t i = 0; i < header.size(); ++i) {
      if (int(i) == c_step || int(i) == c_layer || int(i) == c_src) continue;
      const std::string want = "e" + std::to_string(expert_columns.size());
      if (header[i] != want)
        file_error(origin, header_line,
                   "column '" + header[i] + "': expected '" + want +
                       "' (wide form: step, layer, [src,] e0, e1, ... in order; long form: "
                       "step, layer, [src,] expert, count)");
      expert_columns.push_back(int(i));
    }
    if (expert_columns.empty())
      file_error(origin, header_line, "no expert columns (e0, e1, ...) and no 'expert','count'");
    if (experts > 0 && int(expert_columns.size()) != experts)
      file_error(origin, header_line,
                 std::to_string(expert_columns.size()) +
                     " expert columns, but the simulation has " + std::to_string(experts) +
                     " experts");
  }

  constexpr int64_t kMaxIndex = 1 << 24;
  std::vector<Row> rows;
  std::vector<int64_t> values;  // long: expert, count pairs; wide: E counts per row
  int64_t max_step = -1, max_layer = -1, max_src = -1, max_expert = -1;
  while (std::getline(in, raw)) {
    ++line_no;
    const std::string t = trim(raw);
    if (t.empty() || t[0] == '#') continue;
    const std::vector<std::string> f = split_csv(t);
    if (f.size() != header.size())
      file_error(origin, line_no,
                 std::to_string(f.size()) + " fields, but the header has " +
                     std::to_string(header.size()));
    Row r;
    r.line = line_no;
    r.step = parse_count(f[size_t(c_step)], "step", origin, line_no, kMaxIndex);
    r.layer = parse_count(f[size_t(c_layer)], "layer", origin, line_no, kMaxIndex);
    r.src = c_src >= 0 ? parse_count(f[size_t(c_src)], "src", origin, line_no, kMaxIndex) : 0;
    r.first = values.size();
    if (long_form) {
      const int64_t e = parse_count(f[size_t(c_expert)], "expert", origin, line_no, kMaxIndex);
      if (experts > 0 && e >= experts)
        file_error(origin, line_no,
                   "expert " + std::to_string(e) + " is out of range: the simulation has " +
                       std::to_string(experts) + " experts (0.." + std::to_string(experts - 1) +
                       ")");
      values.push_back(e);
      values.push_back(parse_count(f[size_t(c_count)], "count", origin, line_no));
      max_expert = std::max(max_expert, e);
    } else {
      for (size_t e = 0; e < expert_columns.size(); ++e)
        values.push_back(parse_count(f[size_t(expert_columns[e])],
                                     header[size_t(expert_columns[e])], origin, line_no));
    }
    max_step = std::max(max_step, r.step);
    max_layer = std::max(max_layer, r.layer);
    max_src = std::max(max_src, r.src);
    rows.push_back(r);
  }
  if (rows.empty())
    file_error(origin, "no data rows after the header (line " + std::to_string(header_line) + ")");

  TraceFile tf;
  tf.origin_ = origin;
  tf.steps_ = int(max_step + 1);
  tf.layers_ = int(max_layer + 1);
  tf.source_ranks_ = c_src >= 0 ? int(max_src + 1) : 0;
  tf.experts_ =
      long_form ? (experts > 0 ? experts : int(max_expert + 1)) : int(expert_columns.size());
  const size_t srcs = size_t(std::max(1, tf.source_ranks_));
  const size_t cells = table_cells(origin, tf.steps_, tf.layers_, tf.source_ranks_, tf.experts_);
  tf.counts_.assign(cells, 0);
  std::vector<uint8_t> seen(long_form ? cells : size_t(tf.steps_) * tf.layers_ * srcs, 0);
  std::vector<uint8_t> step_layer(size_t(tf.steps_) * size_t(tf.layers_), 0);
  for (const Row& r : rows) {
    const size_t base = ((size_t(r.step) * tf.layers_ + size_t(r.layer)) * srcs + size_t(r.src));
    step_layer[size_t(r.step) * tf.layers_ + size_t(r.layer)] = 1;
    if (long_form) {
      const size_t cell = base * tf.experts_ + size_t(values[r.first]);
      if (seen[cell])
        file_error(origin, r.line,
                   "a second count for step " + std::to_string(r.step) + ", layer " +
                       std::to_string(r.layer) +
                       (c_src >= 0 ? ", src " + std::to_string(r.src) : "") + ", expert " +
                       std::to_string(values[r.first]));
      seen[cell] = 1;
      tf.counts_[cell] = int32_t(values[r.first + 1]);
    } else {
      if (seen[base])
        file_error(origin, r.line,
                   "a second row for step " + std::to_string(r.step) + ", layer " +
                       std::to_string(r.layer) +
                       (c_src >= 0 ? ", src " + std::to_string(r.src) : ""));
      seen[base] = 1;
      for (size_t e = 0; e < size_t(tf.experts_); ++e)
        tf.counts_[base * tf.experts_ + e] = int32_t(values[r.first + e]);
    }
  }
  for (int s = 0; s < tf.steps_; ++s)
    for (int l = 0; l < tf.layers_; ++l)
      if (!step_layer[size_t(s) * tf.layers_ + size_t(l)])
        file_error(origin, "no rows for step " + std::to_string(s) + ", layer " +
                               std::to_string(l) + " (steps 0.." + std::to_string(tf.steps_ - 1) +
                               " and layers 0.." + std::to_string(tf.layers_ - 1) +
                               " must all appear)");
  // Per-layer totals must fit the int32 routing map.
  for (int s = 0; s < tf.steps_; ++s)
    for (int l = 0; l < tf.layers_; ++l)
      for (int e = 0; e < tf.experts_; ++e)
        if (tf.total(s, l, e) > std::numeric_limits<int32_t>::max())
          file_error(origin, "step " + std::to_string(s) + ", layer " + std::to_string(l) +
                                 ", expert " + std::to_string(e) +
                                 ": total over sources exceeds 2^31-1");
  return tf;
}

TraceFile TraceFile::parse_json(const std::string& text, const std::string& origin, int experts) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // nlohmann reports "at line L, column C"
    file_error(origin, std::string("not valid JSON: ") + e.what());
  } catch (const nlohmann::json::out_of_range& e) {  // a number beyond double, e.g. 1e999
    file_error(origin, std::string("not valid JSON: ") + e.what());
  }
  if (!doc.is_object()) file_error(origin, "expected a JSON object at the top level");
  auto get_int = [&](const char* key, bool required, int64_t lo) -> int64_t {
    if (!doc.contains(key)) {
      if (required) file_error(origin, std::string("missing key \"") + key + "\"");
      return 0;
    }
    if (!doc[key].is_number_integer() || doc[key].get<int64_t>() < lo)
      file_error(origin, std::string("\"") + key + "\" must be an integer >= " +
                             std::to_string(lo) + ", got " + doc[key].dump());
    return doc[key].get<int64_t>();
  };
  if (!doc.contains("format") || doc["format"] != "moe-echo-trace")
    file_error(origin, "\"format\" must be \"moe-echo-trace\"");
  if (doc.contains("version") && doc["version"] != 1)
    file_error(origin, "\"version\" " + doc["version"].dump() + " is not supported (1 is)");
  TraceFile tf;
  tf.origin_ = origin;
  tf.experts_ = int(get_int("experts", true, 1));
  tf.layers_ = int(get_int("layers", true, 1));
  tf.steps_ = int(get_int("steps", true, 1));
  tf.source_ranks_ = int(get_int("source_ranks", false, 0));
  if (experts > 0 && tf.experts_ != experts)
    file_error(origin, "\"experts\" is " + std::to_string(tf.experts_) +
                           ", but the simulation has " + std::to_string(experts) + " experts");
  if (!doc.contains("counts") || !doc["counts"].is_array())
    file_error(origin,
               "missing array \"counts\" ([step][layer][expert] or [step][layer][src][expert])");
  const nlohmann::json& counts = doc["counts"];
  const size_t srcs = size_t(std::max(1, tf.source_ranks_));
  const size_t cells = table_cells(origin, tf.steps_, tf.layers_, tf.source_ranks_, tf.experts_);
  tf.counts_.assign(cells, 0);
  auto expect_array = [&](const nlohmann::json& j, size_t n, const std::string& path,
                          const char* what) {
    if (!j.is_array() || j.size() != n)
      file_error(origin,
                 path + ": expected an array of " + std::to_string(n) + " " + what + ", got " +
                     (j.is_array() ? std::to_string(j.size()) + " entries" : j.type_name()));
  };
  expect_array(counts, size_t(tf.steps_), "counts", "steps");
  for (size_t s = 0; s < size_t(tf.steps_); ++s) {
    const std::string ps = "counts[" + std::to_string(s) + "]";
    expect_array(counts[s], size_t(tf.layers_), ps, "layers");
    for (size_t l = 0; l < size_t(tf.layers_); ++l) {
      const std::string pl = ps + "[" + std::to_string(l) + "]";
      for (size_t r = 0; r < srcs; ++r) {
        const nlohmann::json* row = &counts[s][l];
        std::string pr = pl;
        if (tf.source_ranks_ > 0) {
          if (r == 0) expect_array(*row, srcs, pl, "source ranks");
          row = &(*row)[r];
          pr += "[" + std::to_string(r) + "]";
        }
        expect_array(*row, size_t(tf.experts_), pr, "expert counts");
        const size_t base = ((s * tf.layers_ + l) * srcs + r) * tf.experts_;
        for (size_t e = 0; e < size_t(tf.experts_); ++e) {
          const nlohmann::json& v = (*row)[e];
          if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
              v.get<int64_t>() > std::numeric_limits<int32_t>::max())
            file_error(origin, pr + "[" + std::to_string(e) + "]: " + v.dump() +
                                   " is not an integer in 0..2^31-1");
          tf.counts_[base + e] = int32_t(v.get<int64_t>());
        }
      }
    }
  }
  return tf;
}

TraceFile TraceFile::read(const std::string& path, int experts) {
  std::string text;
  try {
    text = read_file(path);
  } catch (const FileError& e) {
    file_error(path, "cannot open the file: " + e.reason());
  }
  const bool json = path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0;
  return json ? parse_json(text, path, experts) : parse_csv(text, path, experts);
}

TraceFile TraceFile::totals_of(const TraceSource& source, int ranks) {
  TraceFile tf;
  tf.origin_ = "totals of " + source.describe();
  tf.experts_ = source.experts();
  tf.layers_ = source.layers();
  tf.steps_ = source.steps();
  tf.source_ranks_ = 0;
  const size_t E = size_t(tf.experts_);
  tf.counts_.assign(size_t(tf.steps_) * size_t(tf.layers_) * E, 0);
  std::vector<int32_t> C(size_t(ranks) * E);
  for (int l = 0; l < tf.layers_; ++l) {
    auto stream = source.open_layer(l, ranks);
    for (int s = 0; s < tf.steps_; ++s) {
      stream->next(C.data());
      int32_t* out = tf.counts_.data() + (size_t(s) * size_t(tf.layers_) + size_t(l)) * E;
      for (int r = 0; r < ranks; ++r)
        for (size_t e = 0; e < E; ++e) out[e] += C[size_t(r) * E + e];
    }
  }
  return tf;
}

int64_t TraceFile::total(int step, int layer, int expert) const {
  const size_t srcs = size_t(std::max(1, source_ranks_));
  const size_t base = (size_t(step) * layers_ + size_t(layer)) * srcs;
  int64_t t = 0;
  for (size_t r = 0; r < srcs; ++r) t += counts_[(base + r) * experts_ + size_t(expert)];
  return t;
}

class TraceFileStream final : public LayerStream {
 public:
  TraceFileStream(const TraceFile& f, int layer, int ranks) : f_(f), layer_(layer), ranks_(ranks) {}
  void next(int32_t* C) override {
    ++step_;
    MOE_ECHO_CHECK(step_ < f_.steps_, "trace " << f_.origin_ << " has " << f_.steps_ << " steps");
    const size_t E = size_t(f_.experts_);
    const size_t srcs = size_t(std::max(1, f_.source_ranks_));
    const int32_t* base =
        f_.counts_.data() + (size_t(step_) * f_.layers_ + size_t(layer_)) * srcs * E;
    if (f_.source_ranks_ == ranks_) {
      std::copy(base, base + srcs * E, C);
      return;
    }
    for (size_t e = 0; e < E; ++e) {
      int64_t total = 0;
      for (size_t r = 0; r < srcs; ++r) total += base[r * E + e];
      const int64_t each = total / ranks_, rem = total % ranks_;
      for (int r = 0; r < ranks_; ++r) {
        const int64_t shifted = (int64_t(r) - int64_t(e % size_t(ranks_)) + ranks_) % ranks_;
        C[size_t(r) * E + e] = int32_t(each + (shifted < rem ? 1 : 0));
      }
    }
  }

 private:
  const TraceFile& f_;
  int layer_, ranks_, step_ = -1;
};

std::unique_ptr<LayerStream> TraceFile::open_layer(int layer, int ranks) const {
  MOE_ECHO_CHECK(layer >= 0 && layer < layers_, "layer " << layer << " of " << layers_);
  MOE_ECHO_CHECK(ranks >= 1, "ranks = " << ranks);
  return std::make_unique<TraceFileStream>(*this, layer, ranks);
}

void write_trace_csv(const TraceSource& source, int ranks, bool per_source,
                     const std::string& path) {
  OutputFile file(path);   // every failure names the path and the reason
  std::ostringstream out;  // one step's lines, then written
  const int E = source.experts(), L = source.layers();
  out << "# moe-echo routing trace: " << source.describe() << "\n";
  out << "# "
      << (per_source ? "per source rank"
                     : "per-expert totals over " + std::to_string(ranks) + " source ranks")
      << "\n";
  out << "step,layer" << (per_source ? ",src" : "");
  for (int e = 0; e < E; ++e) out << ",e" << e;
  out << "\n";
  std::vector<std::unique_ptr<LayerStream>> streams;
  for (int l = 0; l < L; ++l) streams.push_back(source.open_layer(l, ranks));
  std::vector<int32_t> C(size_t(ranks) * size_t(E));
  std::vector<int64_t> tot(static_cast<size_t>(E));
  for (int s = 0; s < source.steps(); ++s) {
    for (int l = 0; l < L; ++l) {
      streams[size_t(l)]->next(C.data());
      if (per_source) {
        for (int r = 0; r < ranks; ++r) {
          out << s << ',' << l << ',' << r;
          for (int e = 0; e < E; ++e) out << ',' << C[size_t(r) * E + size_t(e)];
          out << '\n';
        }
      } else {
        std::fill(tot.begin(), tot.end(), 0);
        for (int r = 0; r < ranks; ++r)
          for (int e = 0; e < E; ++e) tot[size_t(e)] += C[size_t(r) * E + size_t(e)];
        out << s << ',' << l;
        for (int e = 0; e < E; ++e) out << ',' << tot[size_t(e)];
        out << '\n';
      }
    }
    file.write(out.str());
    out.str("");
  }
  file.write(out.str());  // the header of a trace without steps
  file.close();
}

}  // namespace moe_echo::offline
