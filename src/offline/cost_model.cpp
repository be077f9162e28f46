#include "moe_echo/cost_model.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "moe_echo/config.hpp"
#include "moe_echo/host_io.hpp"

namespace moe_echo::offline {
namespace {

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

std::vector<std::string> gpu_preset_names() { return {"h200", "h100"}; }

GpuSpec gpu_preset(const std::string& name) {
  const std::string n = lower(name);
  GpuSpec g;  // the defaults are the H200 of ANCHORS
  if (n == "h200") return g;
  if (n == "h100") {
    // H100 SXM datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB, NVLink 4 at 900 GB/s
    // both directions (450 GB/s each way), the same as the H200's. Achieved rates take the
    // fractions measured on the H200 (ANCHORS): grouped GEMM 690/989 = 0.70 of peak, copy
    // 4.2/4.8 = 0.875 of HBM, all-to-all 310/450 = 0.69 of one direction of NVLink.
    g.name = "h100";
    g.memory_gb = 80.0;
    g.peak_tflops = 989.0;
    g.gemm_tflops = 690.0;
    g.hbm_tbps = 3.35 * 0.875;
    g.nvlink_gbps = 310.0;
    return g;
  }
  reject("gpu", "'" + name + "'", "h200 or h100 (or a measured-results file, --measured)");
}

void validate(const GpuSpec& g) {
  const std::pair<const char*, double> fields[] = {
      {"memory_gb", g.memory_gb},      {"peak_tflops", g.peak_tflops},
      {"gemm_tflops", g.gemm_tflops},  {"fp8_gemm_tflops", g.fp8_gemm_tflops},
      {"hbm_tbps", g.hbm_tbps},        {"nvlink_gbps", g.nvlink_gbps},
      {"network_gbps", g.network_gbps}};
  for (const auto& [field, v] : fields)
    if (!std::isfinite(v) || v <= 0) reject(field, v, "a finite value > 0");
  if (!std::isfinite(g.launch_us) || g.launch_us < 0)
    reject("launch_us", g.launch_us, "a finite value >= 0");
  if (!std::isfinite(g.graph_node_us) || g.graph_node_us < 0)
    reject("graph_node_us", g.graph_node_us, "a finite value >= 0");
  if (g.gpus_per_node < 1) reject("gpus_per_node", g.gpus_per_node, "gpus_per_node >= 1");
}

void apply_measured_json(GpuSpec& g, const std::string& text, const std::string& origin) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw ConfigError("measured", origin + ": not valid JSON: " + e.what());
  }
  if (!doc.is_object()) throw ConfigError("measured", origin + ": expected a JSON object");
  const nlohmann::json& obj = doc.contains("cost_model") ? doc["cost_model"] : doc;
  if (!obj.is_object())
    throw ConfigError("measured", origin + ": \"cost_model\" must be a JSON object");
  for (const char* key : {"gpu", "name"}) {
    if (obj.contains(key)) {
      if (!obj[key].is_string())
        throw ConfigError("measured", origin + ": \"" + key + "\" must be a string");
      g = gpu_preset(obj[key].get<std::string>());
    }
  }
  struct Field {
    const char* key;
    double* value;
  };
  const Field fields[] = {{"memory_gb", &g.memory_gb},
                          {"peak_tflops", &g.peak_tflops},
                          {"gemm_tflops", &g.gemm_tflops},
                          {"hbm_tbps", &g.hbm_tbps},
                          {"fp8_gemm_tflops", &g.fp8_gemm_tflops},
                          {"nvlink_gbps", &g.nvlink_gbps},
                          {"network_gbps", &g.network_gbps},
                          {"launch_us", &g.launch_us},
                          {"graph_node_us", &g.graph_node_us}};
  std::string allowed = "gpu, name, gpus_per_node";
  for (const Field& f : fields) allowed += std::string(", ") + f.key;
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const std::string& key = it.key();
    if (key == "gpu" || key == "name") continue;
    if (key == "gpus_per_node") {
      if (!it->is_number_integer())
        throw ConfigError("measured", origin + ": \"gpus_per_node\" must be an integer");
      g.gpus_per_node = it->get<int>();
      continue;
    }
    const Field* f = std::find_if(std::begin(fields), std::end(fields),
                                  [&](const Field& x) { return key == x.key; });
    if (f == std::end(fields))  // other top-level keys are allowed next to a "cost_model" object
      throw ConfigError("measured", origin + ": unknown key \"" + key + "\": allowed " + allowed);
    if (!it->is_number())
      throw ConfigError("measured", origin + ": \"" + key + "\" must be a number");
    *f->value = it->get<double>();
  }
  try {
    validate(g);
  } catch (const ConfigError& e) {
    throw ConfigError(e.field(), origin + ": " + e.what());
  }
}

void apply_measured_file(GpuSpec& g, const std::string& path) {
  std::string text;
  try {
    text = read_file(path);
  } catch (const FileError& e) {
    reject("measured", "'" + path + "'",
           "a measured-results JSON file this user can read (cannot open it: " + e.reason() + ")");
  }
  apply_measured_json(g, text, path);
}

int ep_ranks_per_node(int etp, int gpus_per_node) {
  return std::max(1, gpus_per_node / std::max(1, etp));
}

double intra_node_fraction(int ep, int etp, int gpus_per_node) {
  if (ep <= 1) return 1.0;
  return double(std::min(ep, ep_ranks_per_node(etp, gpus_per_node))) / double(ep);
}

double CostModel::gemm_ms(double flops) const { return flops / (gpu.gemm_tflops * 1e12) * 1e3; }
double CostModel::fp8_gemm_ms(double flops) const {
  return flops / (gpu.fp8_gemm_tflops * 1e12) * 1e3;
}

double CostModel::all_to_all_ms(double bytes, int ep, int etp) const {
  if (ep <= 1 || bytes <= 0) return 0.0;
  // `bytes` is what leaves the GPU for other ranks; of the ep - 1 other ranks, the ones on this
  // node take their share over NVLink and the rest over the network, in parallel.
  const double intra_ranks = intra_node_fraction(ep, etp, gpu.gpus_per_node) * ep - 1.0;
  const double others = double(ep - 1);
  const double intra = bytes * std::max(0.0, intra_ranks) / others;
  const double inter = bytes - intra;
  return std::max(intra / (gpu.nvlink_gbps * 1e9), inter / (gpu.network_gbps * 1e9)) * 1e3;
}

double CostModel::nvlink_ms(double bytes) const { return bytes / (gpu.nvlink_gbps * 1e9) * 1e3; }

double CostModel::links_ms(double nvlink_bytes, double network_bytes) const {
  return std::max(nvlink_bytes / (gpu.nvlink_gbps * 1e9),
                  network_bytes / (gpu.network_gbps * 1e9)) *
         1e3;
}

double CostModel::launch_ms(int kernels, bool cuda_graph) const {
  return kernels * (cuda_graph ? gpu.graph_node_us : gpu.launch_us) * 1e-3;
}

double CostModel::row_ms(int hidden, int ffn) const {
  return gemm_ms(train_flops(1.0, hidden, ffn));
}

double CostModel::clone_ms(int hidden, int ffn, int grad_bytes) const {
  return nvlink_ms(clone_bytes(hidden, ffn, grad_bytes));
}

namespace {
// A clone's time over a row's, rounded up, capped at kMaxCloneCostRows, the cost at which no
// clone pays for itself: extreme GPU numbers (a GEMM rate near the largest double, a link near
// 0 GB/s) make the ratio overflow int64 or the row time vanish.
int64_t clone_rows(double clone_ms, double row_ms) {
  const double rows = std::ceil(clone_ms / row_ms);
  if (rows >= 0 && rows < double(kMaxCloneCostRows)) return int64_t(rows);
  return rows < 0 ? 0 : kMaxCloneCostRows;  // NaN (0 / 0) and above: the cap
}
}  // namespace

int64_t CostModel::clone_cost_rows(int hidden, int ffn, int grad_bytes) const {
  return clone_rows(clone_ms(hidden, ffn, grad_bytes), row_ms(hidden, ffn));
}

int64_t CostModel::step_clone_cost_rows(int hidden, int ffn, int grad_bytes, int ep,
                                        double rows_per_entry) const {
  if (ep <= 1) return 0;
  const double row =
      gemm_ms(train_flops(1.0, hidden, ffn)) + dispatch_combine_ms(1.0, hidden, ep, rows_per_entry);
  return clone_rows(all_to_all_ms(clone_link_bytes(hidden, ffn, grad_bytes), ep), row);
}

double CostModel::dispatch_combine_ms(double rows, int hidden, int ep,
                                      double rows_per_entry) const {
  if (ep <= 1) return 0.0;
  const double remote = double(ep - 1) / double(ep);
  return 4.0 * all_to_all_ms(rows * rows_per_entry * remote * (double(hidden) * 2.0), ep);
}

double ranks_per_token(double E, double ep, double K) {
  double missed = 1.0;
  for (int i = 0; i < int(K); ++i) missed *= std::max(0.0, (E - E / ep - i) / (E - i));
  return ep * (1.0 - missed);
}

namespace {
// Experts of group g on rank r (groups of E/G, ranks of E/ep consecutive experts).
int64_t overlap(int64_t E, int64_t ep, int64_t G, int64_t r, int64_t g) {
  const int64_t r0 = r * (E / ep), r1 = r0 + E / ep, g0 = g * (E / G), g1 = g0 + E / G;
  return std::max<int64_t>(0, std::min(r1, g1) - std::max(r0, g0));
}
}  // namespace

double ranks_per_token(int E, int ep, int K, int groups, int topk_groups) {
  const int64_t M = int64_t(topk_groups) * (E / groups);  // experts of the chosen groups
  double total = 0;
  for (int64_t r = 0; r < ep; ++r) {
    // ways[c][s]: choices of c groups (of those seen) holding s of rank r's experts.
    std::vector<std::vector<double>> ways(size_t(topk_groups) + 1,
                                          std::vector<double>(size_t(E) + 1, 0.0));
    ways[0][0] = 1;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t o = overlap(E, ep, groups, r, g);
      for (int64_t c = topk_groups; c >= 1; --c)
        for (int64_t s = E; s >= o; --s)
          ways[size_t(c)][size_t(s)] += ways[size_t(c - 1)][size_t(s - o)];
    }
    double all = 0, missed = 0;
    for (int64_t s = 0; s <= E; ++s) {
      const double w = ways[size_t(topk_groups)][size_t(s)];
      if (w == 0) continue;
      double miss = 1.0;  // C(M - s, K) / C(M, K)
      for (int64_t i = 0; i < K; ++i) miss *= std::max(0.0, double(M - s - i) / double(M - i));
      all += w;
      missed += w * miss;
    }
    total += 1.0 - missed / all;
  }
  return total;
}

int max_ranks_per_token(int E, int ep, int K, int groups, int topk_groups) {
  std::vector<int> spans;
  for (int64_t g = 0; g < groups; ++g) {
    int n = 0;
    for (int64_t r = 0; r < ep; ++r) n += overlap(E, ep, groups, r, g) > 0;
    spans.push_back(n);
  }
  std::sort(spans.begin(), spans.end(), std::greater<int>());
  int reach = 0;
  for (int i = 0; i < topk_groups; ++i) reach += spans[size_t(i)];
  return std::min({K, ep, reach});
}

}  // namespace moe_echo::offline
