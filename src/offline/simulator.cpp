#include "moe_echo/simulator.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "moe_echo/error.hpp"
#include "moe_echo/planner.hpp"

namespace moe_echo::offline {

const char* to_string(Policy p) {
  switch (p) {
    case Policy::echo: return "echo";
    case Policy::eplb: return "eplb";
    case Policy::eplb_periodic: return "eplb_periodic";
    case Policy::none: return "none";
    case Policy::echo_stale: return "echo_stale";
    case Policy::echo_step: return "echo_step";
  }
  return "?";
}

namespace {
constexpr int64_t kMaxRankExperts = int64_t(1) << 28;
constexpr int kMaxThreads = 1024;
constexpr int kMaxMicroBatches = 64;
}  // namespace

void validate(const SimulatorConfig& c) {
  if (c.ranks < 1) reject("ep", c.ranks, "ep >= 1");
  if (c.experts < 1) reject("experts", c.experts, "experts >= 1");
  if (c.experts % c.ranks != 0)
    reject("experts", c.experts, "a multiple of ep (" + std::to_string(c.ranks) + ")");
  if (c.top_k < 1 || c.top_k > c.experts)
    reject("top_k", c.top_k, "1 <= top_k <= experts (" + std::to_string(c.experts) + ")");
  MoeConfig routing;  // the layer's rules for groups
  routing.hidden = routing.ffn = routing.max_tokens = 1;
  routing.experts = c.experts;
  routing.top_k = std::min(c.top_k, kMaxTopK);
  routing.expert_groups = c.expert_groups;
  routing.topk_groups = c.topk_groups;
  routing.group_score = GroupScore::max;  // any group size
  validate(routing);
  if (c.steps < 0) reject("steps", c.steps, "steps >= 1 (or 0: every step of the trace)");
  if (c.layers < 0) reject("layers", c.layers, "layers >= 1 (or 0: every layer of the trace)");
  if (c.spare_slots < 0) reject("spare_slots", c.spare_slots, "spare_slots >= 0");
  if (c.max_clones < 0) reject("max_clones", c.max_clones, "max_clones >= 0");
  if (c.clone_cost_rows < -1 || c.clone_cost_rows > kMaxCloneCostRows)
    reject("clone_cost_rows", c.clone_cost_rows,
           "0 <= clone_cost_rows <= " + std::to_string(kMaxCloneCostRows) +
               " (or -1: from the cost model; at the largest no clone pays for itself)");
  // Sense: clones and slots beyond what can be placed (one replica of an expert per rank, on
  // ranks other than its home) never help; the library defaults pass on any layout.
  const int useful_clones = std::max(c.ranks - 1, EchoConfig{}.max_clones_per_expert);
  if (c.max_clones > useful_clones)
    reject("max_clones", c.max_clones,
           "max_clones <= max(ep - 1, 2) = " + std::to_string(useful_clones) +
               " (a clone sits on another rank than its expert, one per rank)");
  const int useful_slots = std::max(c.experts - c.experts / c.ranks, 1);
  if (c.spare_slots > useful_slots)
    reject("spare_slots", c.spare_slots,
           "spare_slots <= max(experts - experts / ep, 1) = " + std::to_string(useful_slots) +
               " (a spare slot holds a clone of another rank's expert)");
  if (int64_t(c.experts) * c.ranks > kMaxRankExperts)
    reject("ep", c.ranks,
           "ep * experts <= 2^28 (experts = " + std::to_string(c.experts) +
               "): the rank-by-expert count tables");
  if (c.eplb_period < 1) reject("eplb_period", c.eplb_period, "eplb_period >= 1");
  if (c.micro_batches < 1 || c.micro_batches > kMaxMicroBatches)
    reject("micro_batches", c.micro_batches,
           "1 <= micro_batches <= " + std::to_string(kMaxMicroBatches));
  if (c.threads < 1 || c.threads > kMaxThreads)
    reject("threads", c.threads, "1 <= threads <= " + std::to_string(kMaxThreads));
  if (c.hidden < 1) reject("hidden", c.hidden, "hidden >= 1");
  if (c.ffn < 1) reject("ffn", c.ffn, "ffn >= 1");
  if (c.grad_bytes != 2 && c.grad_bytes != 4)
    reject("grad_bytes", c.grad_bytes, "2 (bf16) or 4 (fp32)");
  if (c.master_state_bytes < 0)
    reject("master_state_bytes", c.master_state_bytes, "master_state_bytes >= 0");
  if (c.policies.empty())
    reject("policies", "(none)", "at least one of echo, eplb, eplb_periodic, none, echo_stale");
  for (size_t i = 0; i < c.policies.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (c.policies[i] == c.policies[j])
        reject("policies", std::string("'") + to_string(c.policies[i]) + "' twice",
               "each of echo, eplb, eplb_periodic, none at most once");
  validate(c.cost.gpu);
}

double memory_bytes(const SimulatorConfig& c, int64_t steps, int64_t layers) {
  const double R = c.ranks, E = c.experts, P = double(c.policies.size());
  const double samples = double(steps) * double(layers);
  const double slots = R * (E / R + c.spare_slots);
  const double per_thread = R * E * 16 + slots * 64 + E * (1.0 + c.max_clones) * 32 + E * 64;
  const double threads = std::min<double>(c.threads, std::max<double>(double(layers), 1));
  return samples * (P * 56 + 16) + threads * P * per_thread + double(layers) * (E * 64 + P * 24);
}

double percentile_sorted(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double rank = std::ceil(q * double(sorted.size()));
  const size_t i = size_t(std::clamp(rank, 1.0, double(sorted.size()))) - 1;
  return sorted[i];
}

double PolicyStats::spill_fraction(double capacity_factor) const {
  if (samples_sorted.empty()) return 0;
  const auto it = std::upper_bound(samples_sorted.begin(), samples_sorted.end(), capacity_factor);
  return double(samples_sorted.end() - it) / double(samples_sorted.size());
}

const PolicyStats* SimulationResult::find(Policy p) const {
  for (const PolicyStats& s : policies)
    if (s.policy == p) return &s;
  return nullptr;
}

namespace {

// Per (policy, step, layer) sample of one run, and per-layer totals. Every sum over layers is
// taken in layer order after the threads join, so the result does not depend on which thread
// finished first (floating-point addition is not associative); only the planner's wall time is
// summed as the threads finish.
struct Samples {
  std::vector<double> ratio, compute_ms, comm_ms, clone_ms;
  std::vector<int32_t> clones;
  std::vector<double> migration_bytes, migration_ms;  // [L]
  std::vector<int64_t> replacements;                  // [L]
  double planner_s = 0;
  int64_t planner_calls = 0;
  std::mutex mu;  // guards planner_s and planner_calls
};

// State of EPLB with periodic re-placement for one layer.
struct PeriodicEplb {
  EplbPlacement placement;
  std::vector<double> observed;  // [E] rows since the last re-placement
  std::vector<int32_t> master;   // [E] rank of each expert's first replica
  std::vector<int32_t> hosted;   // [R] redundant replicas on each rank
  std::vector<int32_t> served;   // [R] redundant replicas whose master is on each rank
  int32_t redundant = 0;

  void set(EplbPlacement p, int experts) {
    placement = std::move(p);
    const int R = placement.ranks, slots = placement.slots_per_rank;
    master.assign(size_t(experts), -1);
    hosted.assign(size_t(R), 0);
    served.assign(size_t(R), 0);
    redundant = 0;
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < slots; ++s) {
        const int e = placement.slot_expert[size_t(r) * slots + size_t(s)];
        if (e < 0) continue;
        if (master[size_t(e)] < 0) {
          master[size_t(e)] = r;
        } else {
          ++hosted[size_t(r)];
          ++served[size_t(master[size_t(e)])];
          ++redundant;
        }
      }
  }
};

}  // namespace

namespace {
// simulator_planner_config of a validated cfg; entry_rows: rows moved per routed (token, k)
// entry (a token's row crosses once per rank it picks).
PlannerConfig planner_config(const SimulatorConfig& cfg, double entry_rows) {
  PlannerConfig pc;
  pc.ranks = cfg.ranks;
  pc.experts = cfg.experts;
  pc.spare_slots = cfg.spare_slots;
  pc.max_clones = cfg.max_clones;
  // -1: a clone link priced in rows by the same terms as the step estimate (est_step_ms).
  pc.clone_cost_rows = cfg.clone_cost_rows >= 0
                           ? cfg.clone_cost_rows
                           : cfg.cost.step_clone_cost_rows(cfg.hidden, cfg.ffn, cfg.grad_bytes,
                                                           cfg.ranks, entry_rows);
  return pc;
}
}  // namespace

PlannerConfig simulator_planner_config(const SimulatorConfig& cfg) {
  validate(cfg);
  const double reach =
      ranks_per_token(cfg.experts, cfg.ranks, cfg.top_k, cfg.expert_groups, cfg.topk_groups);
  return planner_config(cfg, reach / double(cfg.top_k));
}

SimulationResult simulate(const TraceSource& trace, const SimulatorConfig& cfg_in) {
  SimulatorConfig cfg = cfg_in;
  validate(cfg);
  if (trace.experts() != cfg.experts)
    reject("experts", cfg.experts,
           "the trace's expert count (" + std::to_string(trace.experts()) + ", " +
               trace.describe() + ")");
  if (cfg.steps == 0) cfg.steps = trace.steps();
  if (cfg.layers == 0) cfg.layers = trace.layers();
  if (cfg.steps > trace.steps())
    reject("steps", cfg.steps, "steps <= the trace's " + std::to_string(trace.steps()));
  if (cfg.layers > trace.layers())
    reject("layers", cfg.layers, "layers <= the trace's " + std::to_string(trace.layers()));

  const auto t0 = std::chrono::steady_clock::now();
  const int R = cfg.ranks, E = cfg.experts, S = cfg.spare_slots, N = cfg.steps, L = cfg.layers;
  const double reach = ranks_per_token(E, R, cfg.top_k, cfg.expert_groups, cfg.topk_groups);
  const int reach_max = max_ranks_per_token(E, R, cfg.top_k, cfg.expert_groups, cfg.topk_groups);
  const double entry_rows = reach / double(cfg.top_k);
  const PlannerConfig pc = planner_config(cfg, entry_rows);
  const int64_t clone_cost_rows = pc.clone_cost_rows;
  validate(pc);
  // echo_step plans on the first of M micro-batches a placement that serves all M: one transfer
  // a clone for M micro-batches' worth of rows, so its clone cost in rows of that map is 1/M.
  PlannerConfig pc_step = pc;
  pc_step.clone_cost_rows = pc.clone_cost_rows / cfg.micro_batches;

  const size_t P = cfg.policies.size();
  const size_t samples = size_t(N) * size_t(L);
  std::vector<Samples> out(P);
  for (Samples& s : out) {
    s.ratio.assign(samples, 0);
    s.compute_ms.assign(samples, 0);
    s.comm_ms.assign(samples, 0);
    s.clone_ms.assign(samples, 0);
    s.clones.assign(samples, 0);
    s.migration_bytes.assign(size_t(L), 0);
    s.migration_ms.assign(size_t(L), 0);
    s.replacements.assign(size_t(L), 0);
  }
  std::vector<double> mean_rows(samples, 0);

  const double link_bytes_per_clone = clone_link_bytes(cfg.hidden, cfg.ffn, cfg.grad_bytes);
  const double master_bytes = expert_bytes(cfg.hidden, cfg.ffn, double(cfg.master_state_bytes));
  const CostModel& cost = cfg.cost;

  auto run_layer = [&](int layer) {
    auto stream = trace.open_layer(layer, R);
    std::vector<int32_t> C(size_t(R) * size_t(E));
    std::vector<int64_t> expert_load(static_cast<size_t>(E));
    std::vector<Plan> plans, ahead;  // ahead: echo_stale's plan_echo of the step before
    for (size_t p = 0; p < P; ++p) plans.emplace_back(pc);
    for (size_t p = 0; p < P; ++p) ahead.emplace_back(pc);
    PeriodicEplb periodic;
    std::vector<int32_t> hosted(static_cast<size_t>(R)), served(static_cast<size_t>(R));
    std::vector<double> planner_s(P, 0);
    double migration_bytes = 0, migration_ms = 0;
    int64_t replacements = 0;
    // The step's rows over its micro-batches: each row to one of M uniformly (a multinomial split
    // of every count), from a generator of this layer's own.
    const int M = cfg.micro_batches;
    std::vector<int32_t> parts(M > 1 ? size_t(M) * size_t(R) * size_t(E) : 0);
    std::mt19937_64 split_rng(0x5eed5eedull + uint64_t(layer));
    for (int step = 0; step < N; ++step) {
      stream->next(C.data());
      if (M > 1)
        for (size_t i = 0; i < size_t(R) * size_t(E); ++i) {
          int32_t left = C[i];
          for (int m = 0; m + 1 < M; ++m) {
            std::binomial_distribution<int32_t> pick(left, 1.0 / double(M - m));
            const int32_t x = left > 0 ? pick(split_rng) : 0;
            parts[size_t(m) * size_t(R) * size_t(E) + i] = x;
            left -= x;
          }
          parts[size_t(M - 1) * size_t(R) * size_t(E) + i] = left;
        }
      auto map_of = [&](int m) {
        return M > 1 ? parts.data() + size_t(m) * size_t(R) * size_t(E) : C.data();
      };
      std::vector<double> mean_of(size_t(M), 0.0);  // each micro-batch's mean rank load
      for (int m = 0; m < M; ++m) {
        const int32_t* Cm = map_of(m);
        mean_of[size_t(m)] =
            double(std::accumulate(Cm, Cm + size_t(R) * size_t(E), int64_t(0))) / double(R);
      }
      std::fill(expert_load.begin(), expert_load.end(), 0);
      for (int r = 0; r < R; ++r)
        for (int e = 0; e < E; ++e) expert_load[size_t(e)] += C[size_t(r) * E + size_t(e)];
      const int64_t total = std::accumulate(expert_load.begin(), expert_load.end(), int64_t(0));
      const double mean = double(total) / double(R);
      const size_t idx = size_t(step) * size_t(L) + size_t(layer);
      mean_rows[idx] = mean;
      for (size_t p = 0; p < P; ++p) {
        const Policy policy = cfg.policies[p];
        Samples& o = out[p];
        o.ratio[idx] = o.compute_ms[idx] = o.comm_ms[idx] = o.clone_ms[idx] = 0;
        o.clones[idx] = 0;
        const auto c0 = std::chrono::steady_clock::now();
        // Each micro-batch is a forward and backward on its own map. A policy that plans on
        // every map (echo, eplb) pulls its clones for each; one that keeps a placement for the
        // step (echo_step, echo_stale, eplb_periodic) pulls them once, with its first.
        const bool pulls_each = policy == Policy::echo || policy == Policy::eplb;
        for (int m = 0; m < M; ++m) {
          const int32_t* Cm = map_of(m);
          const double mean_m = mean_of[size_t(m)];
          int64_t max_load = 0;
          int32_t clones = 0;
          std::fill(hosted.begin(), hosted.end(), 0);
          std::fill(served.begin(), served.end(), 0);
          if (policy == Policy::eplb_periodic) {
            if (m == 0 && step == 0) {
              // Nothing observed yet: experts stay home and the redundant slots stay empty.
              EplbPlacement home;
              home.ranks = R;
              home.slots_per_rank = E / R + S;
              home.slot_expert.assign(size_t(R) * size_t(home.slots_per_rank), -1);
              for (int e = 0; e < E; ++e)
                home.slot_expert[size_t(pc.home_rank(e)) * size_t(home.slots_per_rank) +
                                 size_t(pc.home_slot(e))] = e;
              periodic.set(std::move(home), E);
              periodic.observed.assign(size_t(E), 0.0);
            } else if (m == 0 && step % cfg.eplb_period == 0) {
              const std::vector<int32_t> old_master = periodic.master;
              periodic.set(eplb_place(periodic.observed, R, E / R + S), E);
              std::fill(periodic.observed.begin(), periodic.observed.end(), 0.0);
              ++replacements;
              std::vector<int32_t> moved_in(size_t(R), 0), moved_out(size_t(R), 0);
              for (int e = 0; e < E; ++e)
                if (old_master[size_t(e)] != periodic.master[size_t(e)]) {
                  ++moved_in[size_t(periodic.master[size_t(e)])];
                  ++moved_out[size_t(old_master[size_t(e)])];
                }
              int32_t worst = 0, moved = 0;
              for (int r = 0; r < R; ++r) {
                worst = std::max({worst, moved_in[size_t(r)], moved_out[size_t(r)]});
                moved += moved_in[size_t(r)];
              }
              migration_bytes += double(moved) * master_bytes;
              migration_ms += cost.all_to_all_ms(double(worst) * master_bytes, R);
            }
            const std::vector<int64_t> loads = eplb_rank_loads(periodic.placement, Cm, R, E);
            max_load = *std::max_element(loads.begin(), loads.end());
            if (m + 1 == M)
              for (int e = 0; e < E; ++e)
                periodic.observed[size_t(e)] += double(expert_load[size_t(e)]);
            clones = periodic.redundant;
            hosted = periodic.hosted;
            served = periodic.served;
          } else {
            PlanView v = plans[p].view();
            if (policy == Policy::echo) {
              plan_echo(Cm, pc, v);
            } else if (policy == Policy::echo_stale) {
              if (step == 0)
                plan_none(Cm, pc, v);
              else
                plan_placed(Cm, pc, ahead[p].view().spare_expert, v);
              if (m + 1 == M) plan_echo(Cm, pc, ahead[p].view());  // the next step's placement
            } else if (policy == Policy::echo_step) {
              if (m == 0) {
                plan_echo(Cm, pc_step, v);
                plan_echo(Cm, pc_step, ahead[p].view());  // the step's placement
              } else {
                plan_placed(Cm, pc_step, ahead[p].view().spare_expert, v);
              }
            } else if (policy == Policy::eplb) {
              plan_eplb_restricted(Cm, pc, v);
            } else {
              plan_none(Cm, pc, v);
            }
            max_load = *std::max_element(v.load_after, v.load_after + R);
            for (int r = 0; r < R; ++r)
              for (int s = 0; s < S; ++s) {
                const int e = v.spare_expert[size_t(r) * S + size_t(s)];
                if (e < 0) continue;
                ++clones;
                ++hosted[size_t(r)];
                ++served[size_t(pc.home_rank(e))];
              }
          }
          int32_t clone_links = 0;
          for (int r = 0; r < R; ++r)
            clone_links = std::max(clone_links, hosted[size_t(r)] + served[size_t(r)]);
          o.ratio[idx] += (mean_m > 0 ? double(max_load) / mean_m : 1.0) / double(M);
          o.compute_ms[idx] +=
              cost.gemm_ms(CostModel::train_flops(double(max_load), cfg.hidden, cfg.ffn));
          // dispatch + combine, forward and backward: four all-to-alls of the busiest rank's
          // rows (one per token and rank it picks)
          o.comm_ms[idx] += cost.dispatch_combine_ms(double(max_load), cfg.hidden, R, entry_rows);
          if (m == 0 || pulls_each) {
            o.clones[idx] += clones;
            o.clone_ms[idx] += cost.all_to_all_ms(double(clone_links) * link_bytes_per_clone, R);
          }
        }
        planner_s[p] +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
      }
    }
    for (size_t p = 0; p < P; ++p) {
      if (cfg.policies[p] == Policy::eplb_periodic) {
        out[p].migration_bytes[size_t(layer)] = migration_bytes;
        out[p].migration_ms[size_t(layer)] = migration_ms;
        out[p].replacements[size_t(layer)] = replacements;
      }
      std::lock_guard<std::mutex> lock(out[p].mu);
      out[p].planner_s += planner_s[p];
      out[p].planner_calls += int64_t(N) * cfg.micro_batches;
    }
  };

  // Layers over threads; the first exception stops the others' pickup and is rethrown.
  std::atomic<int> next_layer{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto worker = [&] {
    for (int l; (l = next_layer.fetch_add(1)) < L;) {
      try {
        run_layer(l);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
        next_layer = L;
      }
    }
  };
  const int threads = std::min(cfg.threads, L);
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);

  SimulationResult res;
  res.config = cfg;
  res.steps = N;
  res.layers = L;
  res.ranks_per_token = reach;
  res.max_ranks_per_token = reach_max;
  res.clone_cost_rows = clone_cost_rows;
  res.trace = trace.describe();
  res.mean_rows_per_rank =
      std::accumulate(mean_rows.begin(), mean_rows.end(), 0.0) / double(samples);
  const double bytes_per_clone = clone_bytes(cfg.hidden, cfg.ffn, cfg.grad_bytes);
  for (size_t p = 0; p < P; ++p) {
    Samples& o = out[p];
    PolicyStats st;
    st.policy = cfg.policies[p];
    st.samples_sorted = o.ratio;
    std::sort(st.samples_sorted.begin(), st.samples_sorted.end());
    st.max_over_mean_mean = std::accumulate(o.ratio.begin(), o.ratio.end(), 0.0) / double(samples);
    st.max_over_mean_p50 = percentile_sorted(st.samples_sorted, 0.50);
    st.max_over_mean_p99 = percentile_sorted(st.samples_sorted, 0.99);
    st.max_over_mean_max = st.samples_sorted.back();
    st.max_over_mean_per_step.assign(size_t(N), 0);
    double clones = 0, compute = 0, comm = 0, clone = 0, overlap = 0;
    for (int s = 0; s < N; ++s) {
      double acc = 0;
      for (int l = 0; l < L; ++l) {
        const size_t i = size_t(s) * size_t(L) + size_t(l);
        acc += o.ratio[i];
        clones += o.clones[i];
        compute += o.compute_ms[i];
        comm += o.comm_ms[i];
        clone += o.clone_ms[i];
        overlap += std::max(o.compute_ms[i], o.comm_ms[i] + o.clone_ms[i]);
      }
      st.max_over_mean_per_step[size_t(s)] = acc / double(L);
    }
    st.clones_per_step = clones / double(N);
    st.clone_bytes_per_step = st.clones_per_step * bytes_per_clone;
    const double migration_bytes =
        std::accumulate(o.migration_bytes.begin(), o.migration_bytes.end(), 0.0);
    const double migration_ms = std::accumulate(o.migration_ms.begin(), o.migration_ms.end(), 0.0);
    const int64_t replacements =
        std::accumulate(o.replacements.begin(), o.replacements.end(), int64_t(0));
    st.migration_bytes_per_step = migration_bytes / double(N);
    st.replacements = replacements / std::max(1, L);
    st.compute_ms = compute / double(N);
    st.comm_ms = comm / double(N);
    st.clone_ms = clone / double(N);
    st.migration_ms = migration_ms / double(N);
    st.est_step_ms = st.compute_ms + st.comm_ms + st.clone_ms + st.migration_ms;
    st.est_step_ms_overlap = overlap / double(N) + st.migration_ms;
    st.planner_ms_per_call = o.planner_calls ? o.planner_s * 1e3 / double(o.planner_calls) : 0;
    res.policies.push_back(std::move(st));
  }
  res.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace moe_echo::offline
