// The device-API kernels' barrier (src/comm/bounded_barrier.cuh) on one GPU: each "rank" is a
// kernel on its own stream with its own epochs, claim word and host-mapped wait state, and the
// inboxes are plain device memory, so ranks meet, time out and abort exactly as across GPUs,
// without NCCL.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "comm/bounded_barrier.cuh"

namespace moe_echo::nccl {
namespace {

using namespace std::chrono_literals;

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

struct PlainInbox {
  uint32_t* base;
  int ranks, indices;
  __device__ uint32_t* at(int owner, uint32_t index, int from) const {
    return base + (size_t(owner) * size_t(indices) + index) * size_t(ranks) + size_t(from);
  }
};

// Each round: thread 0 of CTA c writes the round into slot c of every peer, the CTA meets its
// peers, reads what each peer wrote into its own slots (it must be this round's), and meets them
// again before the next round overwrites. ok[c] is 1 when every sync returned true.
__global__ void meet_kernel(PlainInbox inbox, BarrierArgs a, int rounds, int* data, int* mismatches,
                            int* ok) {
  BoundedBarrier<PlainInbox> b(inbox, a, blockIdx.x);
  const int ctas = int(gridDim.x), c = int(blockIdx.x);
  int good = 1;
  for (int i = 1; i <= rounds && good; ++i) {
    if (threadIdx.x == 0)
      for (int p = 0; p < a.ranks; ++p)
        if (p != a.rank)
          reinterpret_cast<volatile int*>(data)[(size_t(p) * a.ranks + a.rank) * ctas + c] = i;
    if (!b.sync()) {
      good = 0;
      break;
    }
    if (threadIdx.x == 0)
      for (int p = 0; p < a.ranks; ++p)
        if (p != a.rank &&
            reinterpret_cast<volatile int*>(data)[(size_t(a.rank) * a.ranks + p) * ctas + c] != i)
          atomicAdd(mismatches, 1);
    if (!b.sync()) good = 0;
  }
  if (threadIdx.x == 0) ok[c] = good;
}

// The ranks of one simulated world.
struct World {
  int ranks, ctas;
  uint32_t* inbox = nullptr;
  int* data = nullptr;
  int* mismatches = nullptr;
  std::vector<uint32_t*> epochs;  // [ctas] epochs + the claim word, per rank
  std::vector<WaitState*> state;  // host-mapped, per rank
  std::vector<int*> ok;           // [ctas], per rank
  std::vector<cudaStream_t> streams;

  World(int ranks_, int ctas_) : ranks(ranks_), ctas(ctas_) {
    const size_t inbox_words = size_t(ranks) * ctas * ranks;
    EXPECT_EQ(cudaMalloc(&inbox, inbox_words * 4), cudaSuccess);
    EXPECT_EQ(cudaMemset(inbox, 0, inbox_words * 4), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&data, size_t(ranks) * ranks * ctas * 4), cudaSuccess);
    EXPECT_EQ(cudaMemset(data, 0, size_t(ranks) * ranks * ctas * 4), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&mismatches, 4), cudaSuccess);
    EXPECT_EQ(cudaMemset(mismatches, 0, 4), cudaSuccess);
    for (int r = 0; r < ranks; ++r) {
      uint32_t* e = nullptr;
      EXPECT_EQ(cudaMalloc(&e, size_t(ctas + 1) * 4), cudaSuccess);
      EXPECT_EQ(cudaMemset(e, 0, size_t(ctas + 1) * 4), cudaSuccess);
      epochs.push_back(e);
      WaitState* s = nullptr;
      EXPECT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&s), sizeof(WaitState), cudaHostAllocMapped),
                cudaSuccess);
      std::memset(static_cast<void*>(s), 0, sizeof(WaitState));
      state.push_back(s);
      int* o = nullptr;
      EXPECT_EQ(cudaMalloc(&o, size_t(ctas) * 4), cudaSuccess);
      EXPECT_EQ(cudaMemset(o, 0xff, size_t(ctas) * 4), cudaSuccess);  // poisoned
      ok.push_back(o);
      cudaStream_t st;
      EXPECT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
      streams.push_back(st);
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  ~World() {
    (void)cudaDeviceSynchronize();
    for (int r = 0; r < ranks; ++r) {
      (void)cudaFree(epochs[size_t(r)]);
      (void)cudaFreeHost(state[size_t(r)]);
      (void)cudaFree(ok[size_t(r)]);
      (void)cudaStreamDestroy(streams[size_t(r)]);
    }
    (void)cudaFree(inbox);
    (void)cudaFree(data);
    (void)cudaFree(mismatches);
  }

  BarrierArgs args(int r, std::chrono::milliseconds timeout) const {
    BarrierArgs a;
    a.epochs = epochs[size_t(r)];
    a.claim = reinterpret_cast<int32_t*>(epochs[size_t(r)] + ctas);
    WaitState* dev = nullptr;
    EXPECT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), state[size_t(r)], 0),
              cudaSuccess);
    a.state = dev;
    a.timeout_ns = uint64_t(std::chrono::nanoseconds(timeout).count());
    a.rank = r;
    a.ranks = ranks;
    return a;
  }
  void launch(int r, int rounds, std::chrono::milliseconds timeout) {
    meet_kernel<<<ctas, 512, 0, streams[size_t(r)]>>>(
        PlainInbox{inbox, ranks, ctas}, args(r, timeout), rounds, data, mismatches, ok[size_t(r)]);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
  std::vector<int> oks(int r) const {
    std::vector<int> h(static_cast<size_t>(ctas), 0);
    EXPECT_EQ(cudaMemcpy(h.data(), ok[size_t(r)], h.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    return h;
  }
  int mismatch_count() const {
    int h = -1;
    EXPECT_EQ(cudaMemcpy(&h, mismatches, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(BoundedBarrier, RanksMeetEveryRoundAndTheEpochsCarryOverToTheNextKernel) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (int ranks : {2, 3}) {
    World w(ranks, 4);
    for (int launch = 0; launch < 2; ++launch) {
      for (int r = 0; r < ranks; ++r) w.launch(r, 3000, 60000ms);
      CUDA_OK(cudaDeviceSynchronize());
      for (int r = 0; r < ranks; ++r) {
        EXPECT_EQ(w.oks(r), std::vector<int>(4, 1)) << "rank " << r << " launch " << launch;
        EXPECT_EQ(w.state[size_t(r)]->failed, kWaitOk);
        EXPECT_EQ(w.state[size_t(r)]->abort, 0);
      }
      EXPECT_EQ(w.mismatch_count(), 0) << ranks << " ranks, launch " << launch;
    }
  }
}

TEST(BoundedBarrier, AWaitForAMissingPeerTimesOutAndNamesIt) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  World w(3, 4);
  const auto t0 = std::chrono::steady_clock::now();
  w.launch(0, 1, 300ms);  // rank 2 never comes
  w.launch(1, 1, 300ms);
  CUDA_OK(cudaDeviceSynchronize());
  const double took = seconds_since(t0);
  EXPECT_GE(took, 0.3);
  EXPECT_LT(took, 3.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(w.oks(r), std::vector<int>(4, 0)) << "rank " << r;
    EXPECT_EQ(w.state[size_t(r)]->failed, kWaitTimedOut) << "rank " << r;
    EXPECT_EQ(w.state[size_t(r)]->peer, 2) << "rank " << r;
    EXPECT_GE(w.state[size_t(r)]->where, 0);
    EXPECT_LT(w.state[size_t(r)]->where, 4);
    EXPECT_EQ(w.state[size_t(r)]->abort, 1) << "rank " << r;
  }
}

TEST(BoundedBarrier, TheHostsAbortEndsAnUnboundedWaitAndLaterWaitsGiveUpAtOnce) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  World w(2, 4);
  w.launch(0, 5, 0ms);  // no time bound; rank 1 never comes
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(cudaStreamQuery(w.streams[0]), cudaErrorNotReady);  // still waiting
  const auto t0 = std::chrono::steady_clock::now();
  w.state[0]->abort = 1;  // what PeerMonitor's on_lost does
  CUDA_OK(cudaStreamSynchronize(w.streams[0]));
  EXPECT_LT(seconds_since(t0), 1.0);
  EXPECT_EQ(w.oks(0), std::vector<int>(4, 0));
  EXPECT_EQ(w.state[0]->failed, kWaitAborted);
  EXPECT_EQ(w.state[0]->peer, 1);
  // The flag stays raised: the next kernel's waits give up too, without a time bound.
  const auto t1 = std::chrono::steady_clock::now();
  w.launch(0, 5, 0ms);
  CUDA_OK(cudaStreamSynchronize(w.streams[0]));
  EXPECT_LT(seconds_since(t1), 1.0);
  EXPECT_EQ(w.oks(0), std::vector<int>(4, 0));
}

}  // namespace
}  // namespace moe_echo::nccl
