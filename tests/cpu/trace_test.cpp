// The routing trace generator against its parameters (row sums, the per-token cap, Zipf exponent,
// multinomial spread, drift, domain switches, the DeepSeek-R1 calibration), and the trace file
// reader and writer (formats, round trips, and errors that name the file and the line).
#include "moe_echo/trace.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "moe_echo/error.hpp"

namespace moe_echo::offline {
namespace {

using moe_echo::test::config_error;

GeneratorConfig small_cfg() {
  GeneratorConfig c;
  c.experts = 32;
  c.top_k = 4;
  c.tokens = 2048;
  c.layers = 3;
  c.steps = 50;
  c.seed = 7;
  return c;
}

std::vector<int32_t> next_map(LayerStream& s, int R, int E) {
  std::vector<int32_t> C(size_t(R) * size_t(E));
  s.next(C.data());
  return C;
}

// Least-squares slope of y over x.
double slope(const std::vector<double>& x, const std::vector<double>& y) {
  const double n = double(x.size());
  const double mx = std::accumulate(x.begin(), x.end(), 0.0) / n;
  const double my = std::accumulate(y.begin(), y.end(), 0.0) / n;
  double sxy = 0, sxx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
  }
  return sxy / sxx;
}

// ---- random numbers --------------------------------------------------------------------------

TEST(TraceRng, BinomialMeanAndVarianceInBothRegimes) {
  // (n, q): exact inversion (n q (1-q) < 10), the normal approximation, and q > 1/2 (symmetry).
  const std::pair<int64_t, double> cases[] = {{1000, 0.002}, {50, 0.1}, {100000, 0.3}, {400, 0.9}};
  for (const auto& [n, q] : cases) {
    Sampler rng(stream_seed(3, uint64_t(n)));
    const int draws = 40000;
    double sum = 0, sq = 0;
    for (int i = 0; i < draws; ++i) {
      const int64_t k = rng.binomial(n, q);
      ASSERT_GE(k, 0);
      ASSERT_LE(k, n);
      sum += double(k);
      sq += double(k) * double(k);
    }
    const double mean = sum / draws, var = sq / draws - mean * mean;
    const double want_mean = double(n) * q, want_var = double(n) * q * (1 - q);
    EXPECT_NEAR(mean, want_mean, 5 * std::sqrt(want_var / draws) + 1e-9) << "n " << n << " q " << q;
    EXPECT_NEAR(var / want_var, 1.0, 0.05) << "n " << n << " q " << q;
  }
  Sampler rng(1);
  EXPECT_EQ(rng.binomial(0, 0.5), 0);
  EXPECT_EQ(rng.binomial(10, 0.0), 0);
  EXPECT_EQ(rng.binomial(10, 1.0), 10);
}

TEST(TraceRng, CapProbabilitiesWaterFills) {
  std::vector<double> p = {0.5, 0.3, 0.1, 0.05, 0.05};
  cap_probabilities(p, 0.25);
  EXPECT_NEAR(std::accumulate(p.begin(), p.end(), 0.0), 1.0, 1e-12);
  EXPECT_NEAR(p[0], 0.25, 1e-12);
  EXPECT_NEAR(p[1], 0.25, 1e-12);
  // the uncapped keep their ratios: 0.1 : 0.05 : 0.05 share the remaining 0.5
  EXPECT_NEAR(p[2], 0.25, 1e-12);
  EXPECT_NEAR(p[3], 0.125, 1e-12);
  EXPECT_NEAR(p[4], 0.125, 1e-12);
  std::vector<double> q = {0.2, 0.2, 0.6};
  cap_probabilities(q, 1.0);  // nothing above the cap: unchanged
  EXPECT_DOUBLE_EQ(q[2], 0.6);
}

TEST(TraceRng, MultinomialSumsExactlyAndRespectsTheCap) {
  std::vector<double> p = {0.4, 0.3, 0.2, 0.1};
  std::vector<int> order = {0, 1, 2, 3};
  Sampler rng(11);
  for (int t = 0; t < 1000; ++t) {
    int32_t out[4];
    sample_multinomial(rng, 100, p, order, 35, out);
    EXPECT_EQ(out[0] + out[1] + out[2] + out[3], 100);
    for (int32_t c : out) EXPECT_LE(c, 35);
  }
}

// ---- generator -------------------------------------------------------------------------------

TEST(TraceGenerator, EverySourceSendsTKRowsAndAtMostTToOneExpert) {
  GeneratorConfig c = small_cfg();
  c.zipf = {2.0};  // steep: the cap binds
  const TraceGenerator gen(c);
  const int R = 5;
  for (int l = 0; l < c.layers; ++l) {
    auto s = gen.open_layer(l, R);
    for (int step = 0; step < c.steps; ++step) {
      const auto C = next_map(*s, R, c.experts);
      for (int r = 0; r < R; ++r) {
        int64_t sum = 0;
        for (int e = 0; e < c.experts; ++e) {
          const int32_t v = C[size_t(r) * c.experts + e];
          ASSERT_GE(v, 0);
          ASSERT_LE(v, c.tokens);
          sum += v;
        }
        ASSERT_EQ(sum, int64_t(c.tokens) * c.top_k);
      }
    }
  }
}

TEST(TraceGenerator, DeterministicWhateverTheOrderLayersAreRead) {
  const TraceGenerator gen(small_cfg());
  const int R = 4, E = gen.experts();
  auto a = gen.open_layer(2, R);
  std::vector<std::vector<int32_t>> first;
  for (int s = 0; s < 10; ++s) first.push_back(next_map(*a, R, E));
  auto b0 = gen.open_layer(0, R);
  auto b2 = gen.open_layer(2, R);
  for (int s = 0; s < 10; ++s) {
    next_map(*b0, R, E);
    EXPECT_EQ(next_map(*b2, R, E), first[size_t(s)]) << "step " << s;
  }
  GeneratorConfig other = small_cfg();
  other.seed = 8;
  const TraceGenerator other_gen(other);  // a stream reads its generator: keep it alive
  auto c = other_gen.open_layer(2, R);
  EXPECT_NE(next_map(*c, R, E), first[0]);
}

TEST(TraceGenerator, ZipfExponentIsRecoveredFromTheCounts) {
  for (double s : {0.6, 1.0}) {
    GeneratorConfig c;
    c.experts = 64;
    c.top_k = 2;  // top share 1/H_64 ~ 0.21 < 1/K: no capping
    c.tokens = 8192;
    c.layers = 1;
    c.steps = 40;
    c.zipf = {s};
    c.drift_std = 0;
    c.switch_prob = 0;
    const TraceGenerator gen(c);
    GeneratorStream stream(gen, 0, 8);
    std::vector<double> total(size_t(c.experts), 0);
    std::vector<int32_t> C(size_t(8) * c.experts);
    for (int step = 0; step < c.steps; ++step) {
      stream.next(C.data());
      for (int r = 0; r < 8; ++r)
        for (int e = 0; e < c.experts; ++e) total[size_t(e)] += C[size_t(r) * c.experts + e];
    }
    std::vector<double> x, y;
    for (int i = 0; i < 32; ++i) {  // the 32 hottest: counts large enough for logs
      x.push_back(std::log(i + 1.0));
      y.push_back(std::log(total[size_t(stream.ranking()[size_t(i)])]));
    }
    EXPECT_NEAR(-slope(x, y), s, 0.03) << "zipf " << s;
  }
}

TEST(TraceGenerator, PerSourceCountsHaveMultinomialMeanAndVariance) {
  GeneratorConfig c;
  c.experts = 16;
  c.top_k = 2;
  c.tokens = 4096;
  c.layers = 1;
  c.steps = 400;
  c.zipf = {0.8};
  c.drift_std = 0;
  c.switch_prob = 0;
  const TraceGenerator gen(c);
  GeneratorStream stream(gen, 0, 4);
  const double n = double(c.tokens) * c.top_k;
  std::vector<double> sum(16, 0), sq(16, 0);
  std::vector<int32_t> C(4 * 16);
  for (int step = 0; step < c.steps; ++step) {
    stream.next(C.data());
    for (int r = 0; r < 4; ++r)
      for (int e = 0; e < 16; ++e) {
        sum[size_t(e)] += C[size_t(r) * 16 + e];
        sq[size_t(e)] += double(C[size_t(r) * 16 + e]) * C[size_t(r) * 16 + e];
      }
  }
  const double draws = 4.0 * c.steps;
  for (int e = 0; e < 16; ++e) {
    const double p = stream.probabilities()[size_t(e)];
    const double mean = sum[size_t(e)] / draws, var = sq[size_t(e)] / draws - mean * mean;
    EXPECT_NEAR(mean / (n * p), 1.0, 0.01) << "expert " << e;
    EXPECT_NEAR(var / (n * p * (1 - p)), 1.0, 0.2) << "expert " << e;
  }
}

TEST(TraceGenerator, DriftHasTheStationaryStdAndMeanReversionTime) {
  GeneratorConfig c;
  c.experts = 128;
  c.top_k = 1;
  c.tokens = 1;
  c.layers = 1;
  c.steps = 3000;
  c.drift_std = 0.4;
  c.drift_steps = 20;
  c.switch_prob = 0;
  const TraceGenerator gen(c);
  GeneratorStream stream(gen, 0, 1);
  std::vector<int32_t> C(size_t(c.experts));
  std::vector<double> prev(size_t(c.experts));
  double sq = 0, lag = 0, n = 0;
  for (int step = 0; step < c.steps; ++step) {
    stream.next(C.data());
    for (int e = 0; e < c.experts; ++e) {
      const double d = stream.log_weights()[size_t(e)] - stream.base_log_weights()[size_t(e)];
      if (step > 0) {
        sq += d * d;
        lag += d * prev[size_t(e)];
        n += 1;
      }
      prev[size_t(e)] = d;
    }
  }
  EXPECT_NEAR(std::sqrt(sq / n), c.drift_std, 0.02);
  EXPECT_NEAR(lag / sq, 1.0 - 1.0 / c.drift_steps, 0.01);  // AR(1) coefficient
}

TEST(TraceGenerator, DomainSwitchesComeAtTheirRateAndRedrawTheRanking) {
  GeneratorConfig c = small_cfg();
  c.steps = 4000;
  c.switch_prob = 0.02;
  const TraceGenerator gen(c);
  int switches = 0;
  for (int s = 0; s < c.steps; ++s) switches += gen.domain_switch(s);
  const double want = 0.02 * (c.steps - 1);
  EXPECT_NEAR(switches, want, 4 * std::sqrt(want));
  EXPECT_FALSE(gen.domain_switch(0));
  // The ranking changes exactly at the switch steps, in every layer.
  for (int l = 0; l < 2; ++l) {
    GeneratorStream stream(gen, l, 1);
    std::vector<int32_t> C(size_t(c.experts));
    std::vector<int> before;
    for (int s = 0; s < 300; ++s) {
      stream.next(C.data());
      if (s > 0) {
        EXPECT_EQ(stream.ranking() != before, gen.domain_switch(s)) << "step " << s;
      }
      before = stream.ranking();
    }
  }
  c.switch_prob = 0;
  const TraceGenerator none(c);
  for (int s = 0; s < 500; ++s) EXPECT_FALSE(none.domain_switch(s));
}

TEST(TraceGenerator, ZipfPerLayerSpreadsFromLoToHi) {
  GeneratorConfig c;
  c.layers = 5;
  c.zipf_lo = 0.4;
  c.zipf_hi = 0.8;
  EXPECT_DOUBLE_EQ(c.zipf_exponent(0), 0.4);
  EXPECT_DOUBLE_EQ(c.zipf_exponent(2), 0.6);
  EXPECT_DOUBLE_EQ(c.zipf_exponent(4), 0.8);
  c.zipf = {1.1};
  EXPECT_DOUBLE_EQ(c.zipf_exponent(3), 1.1);
  c.zipf = {0.1, 0.2, 0.3, 0.4, 0.5};
  EXPECT_DOUBLE_EQ(c.zipf_exponent(3), 0.4);
  c.zipf = {0.1, 0.2};
  EXPECT_NE(config_error([&] { validate(c); }).find("zipf = 2 values is invalid"),
            std::string::npos);
}

// The defaults reproduce the published DeepSeek-R1 figure: at EP32 with 256 experts and top-8,
// no balancing leaves the busiest rank about 2.56x the mean (DeepSeek EPLB).
TEST(TraceGenerator, DefaultsAreCalibratedToDeepSeekR1AtEP32) {
  GeneratorConfig c;  // defaults: 256 experts, top-8, 8 layers
  c.steps = 150;
  const int R = 32, E = c.experts, per = E / R;
  const TraceGenerator gen(c);
  double sum = 0;
  int n = 0;
  std::vector<int32_t> C(size_t(R) * E);
  for (int l = 0; l < c.layers; ++l) {
    auto s = gen.open_layer(l, R);
    for (int step = 0; step < c.steps; ++step) {
      s->next(C.data());
      std::vector<int64_t> load(size_t(R), 0);
      int64_t total = 0;
      for (int r = 0; r < R; ++r)
        for (int e = 0; e < E; ++e) {
          load[size_t(e / per)] += C[size_t(r) * E + e];
          total += C[size_t(r) * E + e];
        }
      sum += double(*std::max_element(load.begin(), load.end())) * R / double(total);
      ++n;
    }
  }
  const double mean = sum / n;
  EXPECT_GT(mean, 2.2);
  EXPECT_LT(mean, 2.9);
}

TEST(TraceGenerator, InvalidParametersNameTheField) {
  const std::pair<std::function<void(GeneratorConfig&)>, std::string> cases[] = {
      {[](GeneratorConfig& c) { c.experts = 0; }, "experts = 0 is invalid"},
      {[](GeneratorConfig& c) { c.top_k = 300; },
       "top_k = 300 is invalid: allowed 1 <= top_k <= experts (256)"},
      {[](GeneratorConfig& c) { c.tokens = 0; }, "tokens = 0 is invalid"},
      {[](GeneratorConfig& c) { c.tokens = 1 << 30; }, "tokens * top_k <= 2^31-1"},
      {[](GeneratorConfig& c) { c.steps = 0; }, "steps = 0 is invalid"},
      {[](GeneratorConfig& c) { c.layers = 0; }, "layers = 0 is invalid"},
      {[](GeneratorConfig& c) { c.zipf = {-1}; }, "zipf = -1 is invalid"},
      {[](GeneratorConfig& c) { c.drift_std = -0.1; }, "drift_std = -0.1 is invalid"},
      {[](GeneratorConfig& c) { c.drift_steps = 0.5; }, "drift_steps = 0.5 is invalid"},
      {[](GeneratorConfig& c) { c.switch_prob = 1.5; }, "switch_prob = 1.5 is invalid"},
  };
  for (const auto& [mutate, message] : cases) {
    GeneratorConfig c;
    mutate(c);
    EXPECT_NE(config_error([&] { validate(c); }).find(message), std::string::npos) << message;
  }
}

// ---- trace files -----------------------------------------------------------------------------

std::vector<int32_t> map_of(const TraceSource& t, int layer, int step, int R) {
  auto s = t.open_layer(layer, R);
  std::vector<int32_t> C(size_t(R) * t.experts());
  for (int i = 0; i <= step; ++i) s->next(C.data());
  return C;
}

TEST(TraceFile, LongCsvWithCommentsAndMissingZeros) {
  const std::string text =
      "# my router log\n"
      "step,layer,expert,count\n"
      "0,0,0,10\n"
      "0,0,3,5\n"
      "\n"
      "0,1,1,7\n"
      "1,0,2,4\n"
      "1,1,3,9\n";
  const TraceFile t = TraceFile::parse_csv(text, "log.csv", 4);
  EXPECT_EQ(t.steps(), 2);
  EXPECT_EQ(t.layers(), 2);
  EXPECT_EQ(t.experts(), 4);
  EXPECT_EQ(t.source_ranks(), 0);
  EXPECT_EQ(t.total(0, 0, 0), 10);
  EXPECT_EQ(t.total(0, 0, 1), 0);
  EXPECT_EQ(t.total(0, 0, 3), 5);
  EXPECT_EQ(t.total(1, 1, 3), 9);
  // one source: the map is the totals
  EXPECT_EQ(map_of(t, 0, 0, 1), (std::vector<int32_t>{10, 0, 0, 5}));
  // inferred expert count: the largest index + 1
  EXPECT_EQ(TraceFile::parse_csv(text, "log.csv").experts(), 4);
}

TEST(TraceFile, TotalsSpreadEvenlyOverSourcesKeepEveryExpertsLoad) {
  const TraceFile t = TraceFile::parse_csv("step,layer,e0,e1,e2\n0,0,10,3,0\n", "w.csv");
  const auto C = map_of(t, 0, 0, 4);
  // 10 over 4 sources: 3,3,2,2 starting at source 0; 3 over 4 starting at source 1: 0,1,1,1
  EXPECT_EQ(C, (std::vector<int32_t>{3, 0, 0, 3, 1, 0, 2, 1, 0, 2, 1, 0}));
}

TEST(TraceFile, WideCsvWithSourcesIsUsedAsRecorded) {
  const std::string text =
      "step,layer,src,e0,e1\n"
      "0,0,0,1,2\n"
      "0,0,1,3,4\n";
  const TraceFile t = TraceFile::parse_csv(text, "w.csv");
  EXPECT_EQ(t.source_ranks(), 2);
  EXPECT_EQ(map_of(t, 0, 0, 2), (std::vector<int32_t>{1, 2, 3, 4}));
  // another EP size: totals 4 and 6 respread over 3 sources
  EXPECT_EQ(map_of(t, 0, 0, 3), (std::vector<int32_t>{2, 2, 1, 2, 1, 2}));
}

TEST(TraceFile, JsonTotalsAndPerSource) {
  const TraceFile a = TraceFile::parse_json(
      R"({"format": "moe-echo-trace", "version": 1, "experts": 3, "layers": 1, "steps": 2,
          "counts": [[[1, 2, 3]], [[4, 5, 6]]]})",
      "a.json");
  EXPECT_EQ(a.steps(), 2);
  EXPECT_EQ(a.total(1, 0, 2), 6);
  const TraceFile b = TraceFile::parse_json(
      R"({"format": "moe-echo-trace", "experts": 2, "layers": 1, "steps": 1, "source_ranks": 2,
          "counts": [[[[1, 2], [3, 4]]]]})",
      "b.json");
  EXPECT_EQ(b.source_ranks(), 2);
  EXPECT_EQ(map_of(b, 0, 0, 2), (std::vector<int32_t>{1, 2, 3, 4}));
}

TEST(TraceFile, WrittenGeneratorTraceReadsBackWithTheSameTotals) {
  GeneratorConfig c = small_cfg();
  c.steps = 6;
  const TraceGenerator gen(c);
  const std::string path =
      (std::filesystem::temp_directory_path() / "moe_echo_trace_roundtrip.csv").string();
  write_trace_csv(gen, 4, false, path);
  const TraceFile t = TraceFile::read(path, c.experts);
  ASSERT_EQ(t.steps(), c.steps);
  ASSERT_EQ(t.layers(), c.layers);
  for (int l = 0; l < c.layers; ++l) {
    auto s = gen.open_layer(l, 4);
    std::vector<int32_t> C(size_t(4) * c.experts);
    for (int step = 0; step < c.steps; ++step) {
      s->next(C.data());
      for (int e = 0; e < c.experts; ++e) {
        int64_t tot = 0;
        for (int r = 0; r < 4; ++r) tot += C[size_t(r) * c.experts + e];
        ASSERT_EQ(t.total(step, l, e), tot) << "step " << step << " layer " << l << " expert " << e;
      }
    }
  }
  const std::string src_path =
      (std::filesystem::temp_directory_path() / "moe_echo_trace_roundtrip_src.csv").string();
  write_trace_csv(gen, 4, true, src_path);
  const TraceFile ts = TraceFile::read(src_path, c.experts);
  EXPECT_EQ(ts.source_ranks(), 4);
  EXPECT_EQ(map_of(ts, 1, 3, 4), map_of(gen, 1, 3, 4));
  std::filesystem::remove(path);
  std::filesystem::remove(src_path);
}

TEST(TraceFile, TotalsOfAGeneratorMatchItsColumnSums) {
  GeneratorConfig c = small_cfg();
  c.steps = 5;
  const TraceGenerator gen(c);
  const TraceFile t = TraceFile::totals_of(gen, 6);
  const auto C = map_of(gen, 2, 4, 6);
  for (int e = 0; e < c.experts; ++e) {
    int64_t tot = 0;
    for (int r = 0; r < 6; ++r) tot += C[size_t(r) * c.experts + e];
    EXPECT_EQ(t.total(4, 2, e), tot);
  }
}

struct BadFile {
  std::string text;
  std::string message;  // a substring of the error
};

TEST(TraceFile, BadCsvFilesNameTheLine) {
  const BadFile cases[] = {
      {"", "bad.csv: no header line"},
      {"# only a comment\n", "bad.csv: no header line"},
      {"step,layer,expert,count\n", "bad.csv: no data rows"},
      {"step,layer,expert,count\n0,0,1,5\n0,0,2,abc\n",
       "bad.csv:3: column 'count': 'abc' is not an integer >= 0"},
      {"step,layer,expert,count\n0,0,1,-4\n",
       "bad.csv:2: column 'count': '-4' is not an integer >= 0"},
      {"step,layer,expert,count\n0,0,1,1.5\n", "bad.csv:2: column 'count': '1.5'"},
      {"step,layer,expert,count\n0,0,1,99999999999\n",
       "bad.csv:2: column 'count': 99999999999 is too large"},
      {"step,layer,expert,count\n0,0,1\n", "bad.csv:2: 3 fields, but the header has 4"},
      // A fuzzer's find: two rows naming step 5555555 and layer 55 ask for a dense table of
      // 2.5 billion counts; refused before it is allocated.
      {"step,layer,src,e0,e1,e2,e3\n5555555,55,0,1,2,3,4\n0,0,1,555,4,0,0\n",
       "bad.csv: too large: steps x layers x sources x experts = 2488889088 counts (at most 2^26"},
      {"step,layer,expert,count\n0,0,1,2\n\n0,0,1,3\n",
       "bad.csv:4: a second count for step 0, layer 0, expert 1"},
      {"step,layer,expert,count\n0,0,9,2\n",
       "bad.csv:2: expert 9 is out of range: the simulation has 4 experts"},
      {"step,layer,expert,count,weight\n0,0,1,2,3\n", "bad.csv:1: unknown column 'weight'"},
      {"step,layer,expert\n0,0,1\n", "bad.csv:1: the long form needs both columns"},
      {"layer,expert,count\n0,0,1\n",
       "bad.csv:1: the header must name the columns 'step' and 'layer'"},
      {"step,layer,e0,e2\n0,0,1,2\n", "bad.csv:1: column 'e2': expected 'e1'"},
      {"step,layer,e0,e1\n0,0,1,2\n",
       "bad.csv:1: 2 expert columns, but the simulation has 4 experts"},
      {"step,layer,e0,e1,e2,e3\n0,0,1,2,3,4\n0,0,1,2,3,4\n",
       "bad.csv:3: a second row for step 0, layer 0"},
      {"step,layer,expert,count\n0,0,1,2\n2,0,1,2\n", "bad.csv: no rows for step 1, layer 0"},
      {"step,layer,step,expert,count\n", "bad.csv:1: column 'step' appears twice"},
  };
  for (const BadFile& c : cases) {
    const std::string msg = config_error([&] { TraceFile::parse_csv(c.text, "bad.csv", 4); });
    EXPECT_NE(msg.find(c.message), std::string::npos) << "got: " << msg << "\nwant: " << c.message;
  }
}

TEST(TraceFile, BadJsonFilesNameTheLineOrThePath) {
  const BadFile cases[] = {
      {"{\"format\": \"moe-echo-trace\",\n \"experts\": 2,\n \"layers\": [}",
       "bad.json: not valid JSON"},
      {"{\n\"format\": \"moe-echo-trace\",\n\"experts\": 2 \"layers\": 1}", "line 3"},
      {"[1, 2]", "bad.json: expected a JSON object"},
      {R"({"experts": 2, "layers": 1, "steps": 1, "counts": [[[1, 2]]]})",
       "\"format\" must be \"moe-echo-trace\""},
      {R"({"format": "moe-echo-trace", "version": 2, "experts": 2, "layers": 1, "steps": 1, "counts": []})",
       "\"version\" 2 is not supported"},
      {R"({"format": "moe-echo-trace", "layers": 1, "steps": 1, "counts": []})",
       "missing key \"experts\""},
      {R"({"format": "moe-echo-trace", "experts": 0, "layers": 1, "steps": 1, "counts": []})",
       "\"experts\" must be an integer >= 1, got 0"},
      {R"({"format": "moe-echo-trace", "experts": 2, "layers": 1, "steps": 2, "counts": [[[1, 2]]]})",
       "counts: expected an array of 2 steps, got 1 entries"},
      {R"({"format": "moe-echo-trace", "experts": 2, "layers": 1, "steps": 1, "counts": [[[1, 2, 3]]]})",
       "counts[0][0]: expected an array of 2 expert counts, got 3 entries"},
      {R"({"format": "moe-echo-trace", "experts": 2, "layers": 1, "steps": 1, "counts": [[[1, -2]]]})",
       "counts[0][0][1]: -2 is not an integer"},
      {R"({"format": "moe-echo-trace", "experts": 2, "layers": 1, "steps": 1, "counts": [[[1, "x"]]]})",
       "counts[0][0][1]: \"x\" is not an integer"},
      {R"({"format": "moe-echo-trace", "experts": 2, "layers": 1, "steps": 1, "source_ranks": 2, "counts": [[[[1, 2]]]]})",
       "counts[0][0]: expected an array of 2 source ranks, got 1 entries"},
      {R"({"format": "moe-echo-trace", "experts": 3, "layers": 1, "steps": 1, "counts": [[[1, 2, 3]]]})",
       "\"experts\" is 3, but the simulation has 2 experts"},
      {R"({"format": "moe-echo-trace", "experts": 2, "layers": 1, "steps": 1})",
       "missing array \"counts\""},
  };
  for (const BadFile& c : cases) {
    const std::string msg = config_error([&] { TraceFile::parse_json(c.text, "bad.json", 2); });
    EXPECT_NE(msg.find(c.message), std::string::npos) << "got: " << msg << "\nwant: " << c.message;
  }
}

TEST(TraceFile, MissingFileIsAClearError) {
  const std::string msg = config_error([] { TraceFile::read("/nonexistent/trace.csv"); });
  EXPECT_NE(msg.find("/nonexistent/trace.csv: cannot open the file"), std::string::npos) << msg;
}

}  // namespace
}  // namespace moe_echo::offline
