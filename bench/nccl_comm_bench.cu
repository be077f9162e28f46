// Dispatch and combine of the NCCL communicator next to NCCL's own ncclAlltoAll moving the same
// bytes, in the same run, all captured in CUDA graphs (10 back to back per graph) and timed with
// CUDA events.
//
//   moe-echo launch -n 4 -- build/nccl_comm_bench [--reps 20] [--ctas 64,128] [--json out.json]
//
// Per config (T tokens per rank, top-K of E experts, hidden H, bf16 rows): every (token, k) entry
// goes to the rank of its expert, receive rows grouped by expert in source-rank order (the layer's
// receive layout). Two routes over the same entries:
// - "entry" (top_k = 1: every entry its own token row, the data flow before rows were sent once
//   per token and rank): T * K rows move each way;
// - "token" (top_k = K, the layer's route): one row per (token, destination rank), the lead row,
//   dispatched with its fan table entries; the combine sums one row per lead.
// "logical rows" = T * K entries, "rows moved" = the rank's lead rows (mean over ranks). Bytes
// per GPU = rows moved * H * 2 (the rows that stay on the GPU included), and the all-to-all moves
// the same bytes (count = bytes / R per peer). GB/s = bytes per GPU / time, the slowest rank's
// median time. Before anything is timed, the dispatch result is checked (lead rows carry their
// token's words, members[p][0] = p), and the combine's sums are checked exactly (red rows of small
// integers).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "moe_echo/backends.hpp"
#include "moe_echo/cuda.hpp"
#include "moe_echo/cuda_check.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "moe_echo/nccl.hpp"
#include "moe_echo/nccl_check.hpp"
#include "moe_echo/presets.hpp"

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

// Red rows of small integers (exact in bf16 and in any order of f32 sums): value of rank r,
// window row q, column h.
__host__ __device__ inline int red_value(int r, int64_t q, int64_t h) {
  return int((int64_t(r) * 7 + q * 3 + h) % 9) - 4;
}

__global__ void fill_red_kernel(__nv_bfloat16* red, int64_t rows, int64_t H, int rank) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * H;
       i += int64_t(gridDim.x) * blockDim.x)
    red[i] = __float2bfloat16_rn(float(red_value(rank, i / H, i % H)));
}

float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  std::vector<int> ctas_list = {64, 128};
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
      std::fprintf(stderr, "usage: %s [--reps N] [--ctas 64,128] [--json FILE]\n", argv[0]);
      return 2;
    }
  }
  try {
    check_output_path("json", json_path);  // every rank, before the run: none waits on a failed one
    const DistEnv env = DistEnv::from_env();
    const int R = env.world_size, me = env.rank;
    if (R < 2) {
      std::fprintf(stderr, "run under `moe-echo launch -n N` with N >= 2\n");
      return 2;
    }
    select_device(env);
    auto be = make_backend("cuda");
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

    const ModelPreset& q = kQwen3_30B_A3B;
    const std::vector<Config> configs = {
        {"T1024 K8 E128 H2048", 1024, 8, 128, 2048},
        {"T4096 K2 E32 H4096 (notes' prototype)", 4096, 2, 32, 4096},
        {"T" + std::to_string(q.tokens) + " K" + std::to_string(q.top_k) + " E" +
             std::to_string(q.experts) + " H" + std::to_string(q.hidden) + " (Qwen3-30B-A3B)",
         q.tokens, q.top_k, q.experts, q.hidden},
    };
    nlohmann::json results = nlohmann::json::array();
    if (me == 0)
      std::printf("%-38s %4s %5s %8s %8s %7s %8s %7s %8s %7s %8s %7s %5s %5s\n", "config", "ctas",
                  "route", "logical", "moved", "MiB", "disp_us", "GB/s", "comb_us", "GB/s",
                  "a2a_us", "GB/s", "d/a2a", "c/a2a");
    for (int ctas : ctas_list) {
      NcclOptions no;
      no.ctas = ctas;
      auto comm = make_nccl_communicator(rv, no);
      ncclComm_t nccl = static_cast<ncclComm_t>(nccl_comm_handle(*comm));
      for (const Config& c : configs) {
        const int64_t T = c.T, K = c.K, n = T * K, H = c.H, EPR = c.E / R;
        const size_t row_bytes = size_t(H) * 2;
        // Global routes (every rank draws every rank's, from one seed): K distinct experts.
        std::vector<std::vector<int32_t>> expert(static_cast<size_t>(R));
        std::mt19937_64 rng(42);
        for (int src = 0; src < R; ++src) {
          expert[size_t(src)].resize(size_t(n));
          std::vector<int> perm(static_cast<size_t>(c.E));
          for (int64_t t = 0; t < T; ++t) {
            for (int64_t k = 0; k < K; ++k) {  // partial Fisher-Yates
              if (k == 0) std::iota(perm.begin(), perm.end(), 0);
              const int64_t j = k + int64_t(rng() % uint64_t(c.E - k));
              std::swap(perm[size_t(k)], perm[size_t(j)]);
              expert[size_t(src)][size_t(t * K + k)] = perm[size_t(k)];
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
        std::vector<int64_t> leads(size_t(R), 0);
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
            for (int64_t t = 0; t < T; ++t) {
              uint64_t seen = 0;  // ranks < 64
              for (int64_t k = 0; k < K; ++k)
                seen |= 1ull << dest_rank[size_t(src)][size_t(t * K + k)];
              leads[size_t(src)] += std::popcount(seen);
            }
          }
        }
        const double mean_leads =
            double(std::accumulate(leads.begin(), leads.end(), int64_t(0))) / R;
        const int64_t cap = *std::max_element(incoming.begin(), incoming.end());
        // Device buffers. x_entry: one row per entry (the entry route's tokens) = x row t for
        // entry t * K + k, so both routes carry the same words.
        int32_t *d_rank, *d_row;
        float* d_weight;
        void *x, *x_entry, *y, *y_entry, *a2a_send, *a2a_recv;
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&d_rank, size_t(n) * 4));
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&d_row, size_t(n) * 4));
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&d_weight, size_t(n) * 4));
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&x, size_t(T) * row_bytes));
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&x_entry, size_t(n) * row_bytes));
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&y, size_t(T) * row_bytes));
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&y_entry, size_t(n) * row_bytes));
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&a2a_send, size_t(n) * row_bytes));
        MOE_ECHO_CUDA_CHECK(cudaMalloc(&a2a_recv, size_t(n) * row_bytes));
        MOE_ECHO_CUDA_CHECK(cudaMemcpy(d_rank, dest_rank[size_t(me)].data(), size_t(n) * 4,
                                       cudaMemcpyHostToDevice));
        MOE_ECHO_CUDA_CHECK(
            cudaMemcpy(d_row, dest_row[size_t(me)].data(), size_t(n) * 4, cudaMemcpyHostToDevice));
        {
          std::vector<float> wv(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) wv[size_t(i)] = 0.25f + float(i % 7) * 0.125f;
          MOE_ECHO_CUDA_CHECK(
              cudaMemcpy(d_weight, wv.data(), size_t(n) * 4, cudaMemcpyHostToDevice));
        }
        const int64_t words = int64_t(row_bytes / 4);
        {
          std::vector<uint32_t> h(size_t(T) * size_t(words));
          for (int64_t t = 0; t < T; ++t)
            for (int64_t w = 0; w < words; ++w) h[size_t(t * words + w)] = word_of(me, t, w);
          MOE_ECHO_CUDA_CHECK(cudaMemcpy(x, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
          for (int64_t k = 0; k < K; ++k)  // entry t * K + k <- row t: a strided 2D copy
            MOE_ECHO_CUDA_CHECK(cudaMemcpy2D(static_cast<char*>(x_entry) + size_t(k) * row_bytes,
                                             size_t(K) * row_bytes, x, row_bytes, row_bytes,
                                             size_t(T), cudaMemcpyDeviceToDevice));
          MOE_ECHO_CUDA_CHECK(
              cudaMemcpy(a2a_send, x_entry, size_t(n) * row_bytes, cudaMemcpyDeviceToDevice));
        }
        SymmetricBuffer recv = comm->alloc_symmetric(*be, size_t(cap) * row_bytes);
        SymmetricBuffer red = comm->alloc_symmetric(*be, size_t(cap) * row_bytes);
        FanTable fan;
        fan.members = comm->alloc_symmetric(*be, size_t(cap * K) * 4);
        fan.weights = comm->alloc_symmetric(*be, size_t(cap * K) * 4);
        fan.values = comm->alloc_symmetric(*be, size_t(cap) * 4);
        fan.top_k = int(K);
        fan.float_dtype = DType::f32;
        FanTable fan1 = fan;  // the entry route's (top_k 1) view of the same buffers
        fan1.top_k = 1;
        fill_red_kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(red.local), cap, H, me);
        MOE_ECHO_CUDA_CHECK(cudaGetLastError());
        const RoundWindow win{0, cap};

        struct Route {
          const char* name;
          RowRoute route;
          const FanTable* fan;
          const void* src;
          Tensor y;
          double rows_moved;
        };
        const Route routes[2] = {
            {"entry", RowRoute{d_rank, d_row, nullptr, n, 1}, &fan1, x_entry,
             Tensor(y_entry, DType::bf16, {n, H}), double(n)},
            {"token", RowRoute{d_rank, d_row, d_weight, n, int(K)}, &fan, x,
             Tensor(y, DType::bf16, {T, H}), mean_leads},
        };
        auto sync_ranks = [&] {
          MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
          rv.barrier();
        };
        for (const Route& ro : routes) {
          const int64_t top = ro.route.top_k;
          // Correctness first: dispatch, check the lead rows; combine, check the sums exactly.
          MOE_ECHO_CUDA_CHECK(cudaMemset(recv.local, 0, recv.bytes));
          MOE_ECHO_CUDA_CHECK(cudaMemset(fan.members.local, 0xff, fan.members.bytes));
          MOE_ECHO_CUDA_CHECK(cudaMemset(ro.y.data, 0xff, ro.y.bytes()));
          MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
          rv.barrier();
          comm->dispatch(ro.route, win, ro.src, row_bytes, recv, *ro.fan, s);
          comm->combine(ro.route, win, red, ro.y, nullptr, *ro.fan, nullptr, s);
          MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
          int64_t bad = 0;
          {
            std::vector<uint32_t> h(size_t(incoming[size_t(me)]) * size_t(words));
            MOE_ECHO_CUDA_CHECK(
                cudaMemcpy(h.data(), recv.local, h.size() * 4, cudaMemcpyDeviceToHost));
            std::vector<int32_t> mem(size_t(incoming[size_t(me)] * top));
            MOE_ECHO_CUDA_CHECK(
                cudaMemcpy(mem.data(), fan.members.local, mem.size() * 4, cudaMemcpyDeviceToHost));
            for (int src = 0; src < R; ++src)
              for (int64_t i = 0; i < n; ++i) {
                if (dest_rank[size_t(src)][size_t(i)] != me) continue;
                bool lead = true;
                for (int64_t j = i - i % top; j < i; ++j)
                  lead = lead && dest_rank[size_t(src)][size_t(j)] != me;
                if (!lead) continue;
                const int64_t row = dest_row[size_t(src)][size_t(i)];
                for (int64_t w = 0; w < words; w += 97)
                  bad += h[size_t(row * words + w)] != word_of(src, i / K, w);
                bad += h[size_t(row * words + words - 1)] != word_of(src, i / K, words - 1);
                bad += mem[size_t(row * top)] != row;
              }
            const int64_t toks = n / top;
            std::vector<uint16_t> g(size_t(toks * H));
            MOE_ECHO_CUDA_CHECK(
                cudaMemcpy(g.data(), ro.y.data, g.size() * 2, cudaMemcpyDeviceToHost));
            for (int64_t t = 0; t < toks; ++t)
              for (int64_t hh = 0; hh < H; hh += 61) {
                uint64_t seen = 0;
                int want = 0;
                for (int64_t i = t * top; i < t * top + top; ++i) {
                  const int d = dest_rank[size_t(me)][size_t(i)];
                  if (seen >> d & 1) continue;
                  seen |= 1ull << d;
                  want += red_value(d, dest_row[size_t(me)][size_t(i)], hh);
                }
                bad += bf16_to_float(g[size_t(t * H + hh)]) != float(want);
              }
          }
          const double bad_all = max_over_ranks(double(bad));

          const double bytes = ro.rows_moved * double(row_bytes);
          const size_t per_peer = size_t(bytes / R / 2);  // bf16 elements
          auto a2a = [&] {
            MOE_ECHO_NCCL_CHECK(ncclAlltoAll(a2a_send, a2a_recv, per_peer, ncclBfloat16, nccl, s));
          };
          a2a();  // warm-up outside the capture (lazy connection)
          MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
          const double disp = max_over_ranks(time_graph_us(
              s, [&] { comm->dispatch(ro.route, win, ro.src, row_bytes, recv, *ro.fan, s); }, reps,
              sync_ranks));
          const double comb = max_over_ranks(time_graph_us(
              s, [&] { comm->combine(ro.route, win, red, ro.y, nullptr, *ro.fan, nullptr, s); },
              reps, sync_ranks));
          const double alltoall = max_over_ranks(time_graph_us(s, a2a, reps, sync_ranks));
          if (me == 0) {
            std::printf(
                "%-38s %4d %5s %8lld %8.0f %7.1f %8.1f %7.1f %8.1f %7.1f %8.1f %7.1f %5.2f "
                "%5.2f%s\n",
                c.name.c_str(), ctas, ro.name, static_cast<long long>(n), ro.rows_moved,
                bytes / (1 << 20), disp, bytes / disp * 1e-3, comb, bytes / comb * 1e-3, alltoall,
                bytes / alltoall * 1e-3, alltoall / disp, alltoall / comb,
                bad_all > 0 ? "  WRONG ROWS" : "");
            std::fflush(stdout);
            results.push_back({{"config", c.name},
                               {"route", ro.name},
                               {"tokens", c.T},
                               {"top_k", c.K},
                               {"route_top_k", top},
                               {"experts", c.E},
                               {"hidden", c.H},
                               {"ranks", R},
                               {"ctas", ctas},
                               {"logical_rows", n},
                               {"rows_moved_mean", ro.rows_moved},
                               {"bytes_per_gpu", bytes},
                               {"checked_bad", bad_all},
                               {"dispatch_us", disp},
                               {"dispatch_GBps_per_gpu", bytes / disp * 1e-3},
                               {"combine_us", comb},
                               {"combine_GBps_per_gpu", bytes / comb * 1e-3},
                               {"alltoall_us", alltoall},
                               {"alltoall_GBps_per_gpu", bytes / alltoall * 1e-3}});
          }
        }
        MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
        rv.barrier();
        for (SymmetricBuffer* b : {&recv, &red, &fan.members, &fan.weights, &fan.values})
          comm->free_symmetric(*be, *b);
        for (void* p : {(void*)d_rank, (void*)d_row, (void*)d_weight, x, x_entry, y, y_entry,
                        a2a_send, a2a_recv})
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
      write_file(json_path, j.dump(2) + "\n");  // FileError names the path and the reason
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
