// Can a peer-to-peer weight copy run beside a kernel that holds every SM, without slowing it?
// Measures, on GPU 0 with GPU 1 as the peer, each as a replayed CUDA graph:
//   compute            one 200 KiB-shared-memory CTA per SM, as a persistent GEMM holds them;
//                      compute(-n) leaves n SMs free
//   ce_copy            a memcpy node, peer -> local (the copy engine)
//   sm_copy            a grid-stride copy kernel of 16 CTAs, one load in flight per thread
//   ilp_copy(n)        a copy kernel of n CTAs with 8 loads in flight per thread (pull)
//   ce_push, ilp_push  the same, local -> peer (stores over NVLink)
//   tma_copy(n)        n CTAs streaming bulk copies (TMA) through shared memory
//   ce_switch(_local)  a memcpy node inside a conditional SWITCH body, the branch chosen on the
//                      device (from the peer, or from local memory)
// alone and side by side (two branches of one graph): a copy that overlaps fully shows
// max(compute, copy), one that needs SMs the compute holds shows more.
// Build: the CMake target ce_overlap_probe (CUDA builds), or
//        nvcc -O3 -std=c++20 -arch=sm_90a bench/ce_overlap_probe.cu -o ce_overlap_probe
// Run:   ce_overlap_probe [MiB, default 352: one Mixtral expert's w1 + w2 in bf16] [compute iters]
//        [switch-peer: also the peer SWITCH case, last]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

__global__ void compute_kernel(float* out, int iters) {
  extern __shared__ float smem[];
  float a = threadIdx.x * 1e-3f, b = 1.0001f, c = 0.9999f, d = blockIdx.x * 1e-4f;
  for (int i = 0; i < iters; ++i) {
    a = fmaf(a, b, c);
    d = fmaf(d, c, b);
    c = fmaf(c, a, -d) * 1e-3f + 0.9999f;
  }
  smem[threadIdx.x] = a + d;
  __syncthreads();
  if (smem[threadIdx.x] == 12345.0f) out[threadIdx.x] = smem[(threadIdx.x + 1) % blockDim.x];
}

__global__ void sm_copy_kernel(const int4* src, int4* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// Each thread keeps kUnroll 16-byte loads in flight (peer reads are latency-bound).
constexpr int kUnroll = 8;
__global__ void __launch_bounds__(1024) ilp_copy_kernel(const int4* src, int4* dst, size_t n) {
  const size_t stride = size_t(gridDim.x) * blockDim.x * kUnroll;
  for (size_t base = (blockIdx.x * size_t(blockDim.x)) * kUnroll + threadIdx.x; base < n;
       base += stride) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t i = base + size_t(u) * blockDim.x;
      if (i < n) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t i = base + size_t(u) * blockDim.x;
      if (i < n) dst[i] = v[u];
    }
  }
}

// One thread per CTA streams chunks through shared memory with bulk copies (TMA): kStages
// buffers of kChunk bytes, loads kStages ahead.
constexpr int kStages = 4;
constexpr int kChunk = 48 * 1024;
__global__ void tma_copy_kernel(const char* src, char* dst, size_t bytes) {
  extern __shared__ __align__(128) char buf[];
  __shared__ __align__(8) unsigned long long bar[kStages];
  if (threadIdx.x != 0) return;
  const size_t chunks = bytes / kChunk;
  for (int st = 0; st < kStages; ++st) {
    const unsigned b = unsigned(__cvta_generic_to_shared(&bar[st]));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b));
  }
  asm volatile("fence.mbarrier_init.release.cluster;");
  auto issue = [&](size_t c, int st) {
    const unsigned b = unsigned(__cvta_generic_to_shared(&bar[st]));
    const unsigned d = unsigned(__cvta_generic_to_shared(buf + st * kChunk));
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(kChunk));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(d),
        "l"(src + c * kChunk), "r"(kChunk), "r"(b)
        : "memory");
  };
  // chunks of this CTA: blockIdx.x, blockIdx.x + gridDim.x, ...
  unsigned phase[kStages] = {0, 0, 0, 0};
  size_t next = blockIdx.x;
  for (int st = 0; st < kStages && next < chunks; ++st, next += gridDim.x) issue(next, st);
  size_t cur = blockIdx.x;
  int st = 0;
  while (cur < chunks) {
    const unsigned b = unsigned(__cvta_generic_to_shared(&bar[st]));
    unsigned done = 0;
    while (!done)
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
          "selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(b), "r"(phase[st]));
    phase[st] ^= 1;
    const unsigned sp = unsigned(__cvta_generic_to_shared(buf + st * kChunk));
    asm volatile(
        "cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + cur * kChunk),
        "r"(sp), "r"(kChunk)
        : "memory");
    asm volatile("cp.async.bulk.commit_group;");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    if (next < chunks) issue(next, st), next += gridDim.x;
    cur += gridDim.x;
    st = (st + 1) % kStages;
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void set_switch_kernel(cudaGraphConditionalHandle h, const int* value) {
  cudaGraphSetConditional(h, unsigned(*value));
}

struct Ctx {
  int sms = 0;
  int iters = 0;
  size_t bytes = 0;
  void* src = nullptr;        // on GPU 1
  void* dst = nullptr;        // on GPU 0
  void* local_src = nullptr;  // on GPU 0
  void* peer_dst = nullptr;   // on GPU 1
  float* sink = nullptr;
  int* choice = nullptr;
};

constexpr int kSmem = 200 * 1024;

// One kernel node (no dependencies) of `func` with the given launch shape and arguments.
cudaGraphNode_t add_kernel(cudaGraph_t g, void* func, unsigned grid, unsigned block, unsigned smem,
                           void** args) {
  cudaKernelNodeParams p{};
  p.func = func;
  p.gridDim = dim3(grid);
  p.blockDim = dim3(block);
  p.sharedMemBytes = smem;
  p.kernelParams = args;
  cudaGraphNode_t n;
  CK(cudaGraphAddKernelNode(&n, g, nullptr, 0, &p));
  return n;
}

void add_memcpy(cudaGraph_t g, void* dst, const void* src, size_t bytes) {
  cudaGraphNode_t n;
  CK(cudaGraphAddMemcpyNode1D(&n, g, nullptr, 0, dst, src, bytes, cudaMemcpyDeviceToDevice));
}

// The compute kernel on all SMs but Spare.
template <int Spare>
void add_compute(cudaGraph_t g, const Ctx& c) {
  void* args[] = {(void*)&c.sink, (void*)&c.iters};
  add_kernel(g, (void*)compute_kernel, unsigned(c.sms - Spare), 256, kSmem, args);
}

// The copy engine: pull (peer -> local) or push (local -> peer).
void add_ce_copy(cudaGraph_t g, const Ctx& c) { add_memcpy(g, c.dst, c.src, c.bytes); }
void add_ce_push(cudaGraph_t g, const Ctx& c) { add_memcpy(g, c.peer_dst, c.local_src, c.bytes); }

// A 16-byte-word copy kernel of Ctas CTAs of 1024 threads: pull or push.
template <int Ctas, bool Push>
void add_word_copy(cudaGraph_t g, const Ctx& c, void* func) {
  const int4* s = static_cast<const int4*>(Push ? c.local_src : c.src);
  int4* d = static_cast<int4*>(Push ? c.peer_dst : c.dst);
  size_t n16 = c.bytes / 16;
  void* args[] = {(void*)&s, (void*)&d, (void*)&n16};
  add_kernel(g, func, Ctas, 1024, 0, args);
}

void add_sm_copy(cudaGraph_t g, const Ctx& c) {
  add_word_copy<16, false>(g, c, (void*)sm_copy_kernel);
}
template <int Ctas>
void add_ilp_copy(cudaGraph_t g, const Ctx& c) {
  add_word_copy<Ctas, false>(g, c, (void*)ilp_copy_kernel);
}
template <int Ctas>
void add_ilp_push(cudaGraph_t g, const Ctx& c) {
  add_word_copy<Ctas, true>(g, c, (void*)ilp_copy_kernel);
}

template <int Ctas>
void add_tma_copy(cudaGraph_t g, const Ctx& c) {
  const char* s = static_cast<const char*>(c.src);
  char* d = static_cast<char*>(c.dst);
  size_t b = c.bytes;
  void* args[] = {(void*)&s, (void*)&d, (void*)&b};
  add_kernel(g, (void*)tma_copy_kernel, Ctas, 32, kStages * kChunk, args);
}

// set_switch_kernel -> SWITCH(4 branches); branch 2 (the device's choice) copies, the others
// copy nothing.
void add_ce_switch_from(cudaGraph_t g, const Ctx& c, const void* src) {
  cudaGraphConditionalHandle h;
  CK(cudaGraphConditionalHandleCreate(&h, g, 0, cudaGraphCondAssignDefault));
  void* args[] = {(void*)&h, (void*)&c.choice};
  const cudaGraphNode_t set = add_kernel(g, (void*)set_switch_kernel, 1, 1, 0, args);
  cudaGraphNodeParams cp{};
  cp.type = cudaGraphNodeTypeConditional;
  cp.conditional.handle = h;
  cp.conditional.type = cudaGraphCondTypeSwitch;
  cp.conditional.size = 4;
  cudaGraphNode_t cond;
  CK(cudaGraphAddNode(&cond, g, &set, nullptr, 1, &cp));
  for (int b = 0; b < 4; ++b) {
    if (b == 2) {
      add_memcpy(cp.conditional.phGraph_out[b], c.dst, src, c.bytes);
    } else {
      cudaGraphNode_t n;
      CK(cudaGraphAddEmptyNode(&n, cp.conditional.phGraph_out[b], nullptr, 0));
    }
  }
}

void add_ce_switch(cudaGraph_t g, const Ctx& c) { add_ce_switch_from(g, c, c.src); }
void add_ce_switch_local(cudaGraph_t g, const Ctx& c) { add_ce_switch_from(g, c, c.local_src); }

float time_graph(cudaGraph_t g, cudaStream_t s, int reps) {
  cudaGraphExec_t ex;
  CK(cudaGraphInstantiate(&ex, g, 0));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ex, s));
  CK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ex, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  CK(cudaGraphExecDestroy(ex));
  return ms[ms.size() / 2];
}

int main(int argc, char** argv) {
  Ctx c;
  c.bytes = size_t(argc > 1 ? std::atof(argv[1]) : 352.0) * (1 << 20);
  c.bytes -= c.bytes % kChunk;  // whole bulk-copy chunks
  c.iters = argc > 2 ? std::atoi(argv[2]) : 200000;
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  if (ndev < 2) {
    std::printf("needs 2 GPUs\n");
    return 1;
  }
  CK(cudaSetDevice(1));
  CK(cudaDeviceEnablePeerAccess(0, 0));
  CK(cudaMalloc(&c.src, c.bytes));
  CK(cudaMemset(c.src, 0x3c, c.bytes));
  CK(cudaMalloc(&c.peer_dst, c.bytes));
  CK(cudaDeviceSynchronize());
  CK(cudaSetDevice(0));
  CK(cudaDeviceEnablePeerAccess(1, 0));
  CK(cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaFuncSetAttribute(compute_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  CK(cudaFuncSetAttribute(tma_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          kStages * kChunk));
  CK(cudaMalloc(&c.dst, c.bytes));
  CK(cudaMalloc(&c.sink, 4096));
  CK(cudaMalloc(&c.local_src, c.bytes));
  CK(cudaMemset(c.local_src, 0x3c, c.bytes));
  CK(cudaMalloc(&c.choice, sizeof(int)));
  const int two = 2;
  CK(cudaMemcpy(c.choice, &two, sizeof two, cudaMemcpyHostToDevice));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  using Add = void (*)(cudaGraph_t, const Ctx&);
  struct Case {
    const char* name;
    std::vector<Add> parts;
  };
  const std::vector<Case> cases = {
      {"compute", {add_compute<0>}},
      {"ce_copy", {add_ce_copy}},
      {"sm_copy(16 CTAs)", {add_sm_copy}},
      {"compute + ce_copy", {add_compute<0>, add_ce_copy}},
      {"compute + sm_copy", {add_compute<0>, add_sm_copy}},
      {"ce_push", {add_ce_push}},
      {"compute + ce_push", {add_compute<0>, add_ce_push}},
      {"ilp_push(2)", {add_ilp_push<2>}},
      {"ilp_push(4)", {add_ilp_push<4>}},
      {"ilp_push(8)", {add_ilp_push<8>}},
      {"ilp_copy(2)", {add_ilp_copy<2>}},
      {"ilp_copy(4)", {add_ilp_copy<4>}},
      {"ilp_copy(8)", {add_ilp_copy<8>}},
      {"tma_copy(1)", {add_tma_copy<1>}},
      {"tma_copy(2)", {add_tma_copy<2>}},
      {"tma_copy(4)", {add_tma_copy<4>}},
      {"compute(-2)", {add_compute<2>}},
      {"compute(-4)", {add_compute<4>}},
      {"compute(-4) + ilp(4)", {add_compute<4>, add_ilp_copy<4>}},
      {"compute(-2) + tma(2)", {add_compute<2>, add_tma_copy<2>}},
      {"compute(-4) + tma(4)", {add_compute<4>, add_tma_copy<4>}},
      {"ce_switch_local", {add_ce_switch_local}},
      {"compute + ce_switch_local", {add_compute<0>, add_ce_switch_local}},
  };
  std::printf("GPU 0 <- GPU 1, %zu MiB, %d SMs, compute iters %d\n", c.bytes >> 20, c.sms, c.iters);
  std::printf("%-26s %10s %10s\n", "case", "ms", "GB/s");
  for (const Case& k : cases) {
    cudaGraph_t g;
    CK(cudaGraphCreate(&g, 0));
    for (Add a : k.parts) a(g, c);
    const float ms = time_graph(g, s, 10);
    CK(cudaGraphDestroy(g));
    std::printf("%-26s %10.3f %10.1f\n", k.name, ms, double(c.bytes) / (ms * 1e-3) / 1e9);
  }
  for (auto add : {add_tma_copy<2>, add_ilp_copy<4>}) {
    CK(cudaMemset(c.dst, 0, c.bytes));
    cudaGraph_t g;
    CK(cudaGraphCreate(&g, 0));
    add(g, c);
    time_graph(g, s, 1);
    CK(cudaGraphDestroy(g));
    std::vector<unsigned char> h(c.bytes);
    CK(cudaMemcpy(h.data(), c.dst, c.bytes, cudaMemcpyDeviceToHost));
    const bool ok = std::all_of(h.begin(), h.end(), [](unsigned char v) { return v == 0x3c; });
    std::printf("copy check: %s\n", ok ? "ok" : "FAILED");
  }
  // A switch-body memcpy from the peer faults ("unspecified launch failure", which ends the
  // context): last, and only when asked.
  if (argc > 3 && std::string(argv[3]) == "switch-peer") {
    cudaGraph_t g;
    CK(cudaGraphCreate(&g, 0));
    add_ce_switch(g, c);
    std::printf("%-26s %10.3f\n", "ce_switch (peer)", time_graph(g, s, 10));
  }
  return 0;
}
