// Dispatch and combine of the NCCL communicator next to NCCL's own ncclAlltoAll moving the same
// bytes, in the same run, all three captured in CUDA graphs (10 back to back per graph) and timed
// with CUDA events.
//
//   moe-echo launch -n 4 -- build/nccl_comm_bench [--reps 20] [--ctas 32,64,128] [--json out.json]
//
// Per config (T tokens per rank, top-K of E experts, hidden H, bf16 rows): every (token, k) row
// goes to the rank of its expert, rows land grouped by expert in source-rank order (the layer's
// receive layout). Bytes per GPU = T * K * H * 2 (every row a rank sends, the quarter that stays
// on the GPU included), the same for the all-to-all (count = bytes / R per peer). GB/s = bytes
// per GPU / time, the slowest rank's median time. The dispatch result is checked row by row
// (every row encodes its source rank, token and k) before anything is timed; the combine result
// must bring every row back.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "comm/nccl_communicator.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_check.hpp"
#include "moe_echo/backends.hpp"
#include "moe_echo/error.hpp"

using namespace moe_echo;

namespace {

struct Config {
  std::string name;
  int T, K, E, H;
};

uint32_t word_of(int src, int64_t entry, int64_t w) {
  uint64_t z = (uint64_t(src) << 48) ^ (uint64_t(entry) << 16) ^ uint64_t(w);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return uint32_t(z ^ (z >> 31));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Times `enqueue` (one op) captured kPerGraph times back to back in one graph: `reps` replays
// after 3 warm-ups, each between events; the median replay over kPerGraph. Repeating the op
// inside the graph amortises the ranks' start skew (a host barrier precedes every replay).
constexpr int kPerGraph = 10;
double time_graph_us(cudaStream_t s, const std::function<void()>& enqueue, int reps,
                     const std::function<void()>& before_each) {
  cuda::CapturedGraph g(s, [&] {
    for (int i = 0; i < kPerGraph; ++i) enqueue();
  });
  cudaEvent_t a, b;
  MOE_ECHO_CUDA_CHECK(cudaEventCreate(&a));
  MOE_ECHO_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < reps + 3; ++i) {
    before_each();
    MOE_ECHO_CUDA_CHECK(cudaEventRecord(a, s));
    g.launch(s);
    MOE_ECHO_CUDA_CHECK(cudaEventRecord(b, s));
    MOE_ECHO_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    MOE_ECHO_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 3) t.push_back(ms * 1e3 / kPerGraph);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  std::vector<int> ctas_list = {32, 64, 128};
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) {
      reps = std::stoi(argv[++i]);
    } else if (a == "--ctas" && i + 1 < argc) {
      ctas_list.clear();
      std::stringstream ss(argv[++i]);
      for (std::string tok; std::getline(ss, tok, ',');) ctas_list.push_back(std::stoi(tok));
    } else if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--reps N] [--ctas 32,64,128] [--json FILE]\n", argv[0]);
      return 2;
    }
  }
  try {
    const DistEnv env = DistEnv::from_env();
    const int R = env.world_size, me = env.rank;
    if (R < 2) {
      std::fprintf(stderr, "run under `moe-echo launch -n N` with N >= 2\n");
      return 2;
    }
    select_device(env);
    auto be = cuda::make_cuda_backend();
    Rendezvous rv(env);
    cudaDeviceProp prop{};
    MOE_ECHO_CUDA_CHECK(cudaGetDeviceProperties(&prop, env.local_rank));
    cudaStream_t s;
    MOE_ECHO_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    auto max_over_ranks = [&](double v) {
      Bytes b(sizeof v);
      std::memcpy(b.data(), &v, sizeof v);
      double m = v;
      for (const Bytes& x : rv.all_gather_bytes(b)) {
        double y;
        std::memcpy(&y, x.data(), sizeof y);
        m = std::max(m, y);
      }
      return m;
    };

    const std::vector<Config> configs = {
        {"T1024 K8 E128 H2048", 1024, 8, 128, 2048},
        {"T4096 K2 E32 H4096 (notes' prototype)", 4096, 2, 32, 4096},
        {"T8192 K8 E128 H2048 (Qwen3-30B-A3B)", 8192, 8, 128, 2048},
    };
    nlohmann::json results = nlohmann::json::array();
    if (me == 0)
      std::printf("%-42s %5s %10s %9s %9s %9s %9s %9s %9s %7s %7s\n", "config", "ctas", "MiB/GPU",
                  "disp_us", "disp_GB/s", "comb_us", "comb_GB/s", "a2a_us", "a2a_GB/s", "d/a2a",
                  "c/a2a");
    for (int ctas : ctas_list) {
      NcclOptions no;
      no.ctas = ctas;
      auto comm = make_nccl_communicator(rv, no);
      ncclComm_t nccl = static_cast<ncclComm_t>(nccl_comm_handle(*comm));
      for (const Config& c : configs) {
        const int64_t n = int64_t(c.T) * c.K, H = c.H, EPR = c.E / R;
        const size_t row_bytes = size_t(H) * 2;
        // Global routes (every rank draws every rank's, from one seed): K distinct experts.
        std::vector<std::vector<int32_t>> expert(static_cast<size_t>(R));
        std::mt19937_64 rng(42);
        for (int src = 0; src < R; ++src) {
          expert[size_t(src)].resize(size_t(n));
          std::vector<int> perm(static_cast<size_t>(c.E));
          for (int t = 0; t < c.T; ++t) {
            for (int k = 0; k < c.K; ++k) {  // partial Fisher-Yates
              if (k == 0) std::iota(perm.begin(), perm.end(), 0);
              const int j = k + int(rng() % uint64_t(c.E - k));
              std::swap(perm[size_t(k)], perm[size_t(j)]);
              expert[size_t(src)][size_t(t * c.K + k)] = perm[size_t(k)];
            }
          }
        }
        // Receive layout: at each rank, rows grouped by local expert, then source rank, then entry.
        std::vector<std::vector<int32_t>> count(static_cast<size_t>(R),
                                                std::vector<int32_t>(size_t(c.E), 0));
        for (int src = 0; src < R; ++src)
          for (int32_t e : expert[size_t(src)]) ++count[size_t(src)][size_t(e)];
        std::vector<int64_t> base(size_t(c.E), 0), incoming(size_t(R), 0);
        for (int e = 0; e < c.E; ++e) {
          const int d = int(e / EPR);
          base[size_t(e)] = incoming[size_t(d)];
          for (int src = 0; src < R; ++src) incoming[size_t(d)] += count[size_t(src)][size_t(e)];
        }
        std::vector<std::vector<int32_t>> dest_rank(static_cast<size_t>(R)),
            dest_row(static_cast<size_t>(R));
        {
          std::vector<int64_t> at = base;
          for (int src = 0; src < R; ++src) {
            dest_rank[size_t(src)].resize(size_t(n));
            dest_row[size_t(src)].resize(size_t(n));
            for (int64_t i = 0; i < n; ++i) {
              const int e = expert[size_t(src)][size_t(i)];
              dest_rank[size_t(src)][size_t(i)] = int32_t(e / EPR);
              dest_row[size_t(src)][size_t(i)] = int32_t(at[size_t(e)]++);
            }
          }
        }
        const int64_t cap = *std::max_element(incoming.begin(), incoming.end());
        // Device buffers.
        int32_t *d_rank, *d_row;
        void *x, *gathered, *a2a_send, *a2a_recv;
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&d_rank, size_t(n) * 4));
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&d_row, size_t(n) * 4));
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&x, size_t(n) * row_bytes));
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&gathered, size_t(n) * row_bytes));
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&a2a_send, size_t(n) * row_bytes));
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&a2a_recv, size_t(n) * row_bytes));
        MOE_ECHO_CUDA_CHECK(cudaMemcpy(d_rank, dest_rank[size_t(me)].data(), size_t(n) * 4,
                                       cudaMemcpyHostToDevice));
        MOE_ECHO_CUDA_CHECK(
            cudaMemcpy(d_row, dest_row[size_t(me)].data(), size_t(n) * 4, cudaMemcpyHostToDevice));
        const int64_t words = int64_t(row_bytes / 4);
        {
          std::vector<uint32_t> h(size_t(n) * size_t(words));
          for (int64_t i = 0; i < n; ++i)
            for (int64_t w = 0; w < words; ++w) h[size_t(i * words + w)] = word_of(me, i, w);
          MOE_ECHO_CUDA_CHECK(cudaMemcpy(x, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
          MOE_ECHO_CUDA_CHECK(cudaMemcpy(a2a_send, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
        }
        SymmetricBuffer recv = comm->alloc_symmetric(*be, size_t(cap) * row_bytes);
        const RowRoute route{d_rank, d_row, n, 1};
        const RoundWindow win{0, cap};

        // Correctness first: dispatch, check every received row; combine, check every row is back.
        MOE_ECHO_CUDA_CHECK(cudaMemset(gathered, 0, size_t(n) * row_bytes));
        MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
        rv.barrier();
        comm->dispatch(route, win, x, row_bytes, recv, s);
        comm->combine(route, win, recv, row_bytes, gathered, s);
        MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
        int64_t bad = 0;
        {
          std::vector<uint32_t> h(size_t(incoming[size_t(me)]) * size_t(words));
          MOE_ECHO_CUDA_CHECK(
              cudaMemcpy(h.data(), recv.local, h.size() * 4, cudaMemcpyDeviceToHost));
          for (int src = 0; src < R; ++src)
            for (int64_t i = 0; i < n; ++i) {
              if (dest_rank[size_t(src)][size_t(i)] != me) continue;
              const int64_t row = dest_row[size_t(src)][size_t(i)];
              for (int64_t w = 0; w < words; w += 97)
                bad += h[size_t(row * words + w)] != word_of(src, i, w);
              bad += h[size_t(row * words + words - 1)] != word_of(src, i, words - 1);
            }
          std::vector<uint32_t> g(size_t(n) * size_t(words));
          MOE_ECHO_CUDA_CHECK(cudaMemcpy(g.data(), gathered, g.size() * 4, cudaMemcpyDeviceToHost));
          for (int64_t i = 0; i < n; ++i)
            for (int64_t w = 0; w < words; w += 97)
              bad += g[size_t(i * words + w)] != word_of(me, i, w);
        }
        const double bad_all = max_over_ranks(double(bad));

        // ncclAlltoAll warm-up outside the capture (lazy connection).
        const size_t per_peer = size_t(n) * row_bytes / size_t(R) / 2;  // bf16 elements
        auto a2a = [&] {
          if (ncclAlltoAll(a2a_send, a2a_recv, per_peer, ncclBfloat16, nccl, s) != ncclSuccess)
            throw Error("ncclAlltoAll failed");
        };
        a2a();
        MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
        auto sync_ranks = [&] {
          MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
          rv.barrier();
        };
        const double disp = max_over_ranks(time_graph_us(
            s, [&] { comm->dispatch(route, win, x, row_bytes, recv, s); }, reps, sync_ranks));
        const double comb = max_over_ranks(time_graph_us(
            s, [&] { comm->combine(route, win, recv, row_bytes, gathered, s); }, reps, sync_ranks));
        const double alltoall = max_over_ranks(time_graph_us(s, a2a, reps, sync_ranks));
        const double bytes = double(n) * double(row_bytes);
        if (me == 0) {
          std::printf("%-42s %5d %10.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %7.2f %7.2f%s\n",
                      c.name.c_str(), ctas, bytes / (1 << 20), disp, bytes / disp * 1e-3, comb,
                      bytes / comb * 1e-3, alltoall, bytes / alltoall * 1e-3, alltoall / disp,
                      alltoall / comb, bad_all > 0 ? "  WRONG ROWS" : "");
          std::fflush(stdout);
          results.push_back({{"config", c.name},
                             {"tokens", c.T},
                             {"top_k", c.K},
                             {"experts", c.E},
                             {"hidden", c.H},
                             {"ranks", R},
                             {"ctas", ctas},
                             {"bytes_per_gpu", bytes},
                             {"bytes_leaving_gpu", bytes * (R - 1) / R},
                             {"rows_checked_bad", bad_all},
                             {"dispatch_us", disp},
                             {"dispatch_GBps_per_gpu", bytes / disp * 1e-3},
                             {"combine_us", comb},
                             {"combine_GBps_per_gpu", bytes / comb * 1e-3},
                             {"alltoall_us", alltoall},
                             {"alltoall_GBps_per_gpu", bytes / alltoall * 1e-3}});
        }
        MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
        rv.barrier();
        comm->free_symmetric(*be, recv);
        for (void* p : {(void*)d_rank, (void*)d_row, x, gathered, a2a_send, a2a_recv})
          MOE_ECHO_CUDA_CHECK(cudaFree(p));
      }
      rv.barrier();
    }
    if (me == 0 && !json_path.empty()) {
      nlohmann::json j;
      j["benchmark"] = "nccl_comm_bench";
      j["device"] = prop.name;
      j["ranks"] = R;
      j["reps"] = reps;
      j["timing"] = "median of reps CUDA-graph replays per op, CUDA events, slowest rank";
      j["results"] = results;
      std::ofstream(json_path) << j.dump(2) << "\n";
      std::printf("wrote %s\n", json_path.c_str());
    }
    rv.barrier();
    cudaStreamDestroy(s);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nccl_comm_bench: %s\n", e.what());
    return 1;
  }
}
