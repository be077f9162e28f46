// A plain shared-memory tiled GEMM with fp32 accumulation, for the router's small products
// (logits = x W^T, dW += dl^T x, dx += dl W). Not the expert GEMMs (those are CUTLASS grouped
// GEMMs in grouped_gemm*.cu).
//
// C[m, n] = sum_k A(m, k) * B(k, n), each output accumulated by one thread in increasing k (per
// K split, the splits then added in a fixed order), so the result is deterministic for a given
// GPU (the split count depends on its multiprocessor count). Operands come through loader
// functors (any dtype, any layout);
// kAContigK / kBContigK say which index is contiguous in memory so tile loads coalesce. The
// epilogue functor receives (m, n, acc) for every in-range output.
#pragma once

#include "cuda/common.cuh"

namespace moe_echo::cuda {

constexpr int kGemmBM = 64, kGemmBN = 64, kGemmBK = 16, kGemmTM = 4, kGemmTN = 4;
constexpr int kGemmThreads = (kGemmBM / kGemmTM) * (kGemmBN / kGemmTN);  // 256

// One operand's BK x BX tile into shared memory: tile[kk][xx] = load(x0 + xx, k0 + kk), 0 outside
// x < X and k < k_end; kContigK: consecutive threads walk k (the index contiguous in memory).
template <int BX, bool kContigK, class Load>
__device__ __forceinline__ void load_tile(float (&tile)[kGemmBK][BX + 4], int tid, int64_t x0,
                                          int64_t X, int64_t k0, int64_t k_end, const Load& load) {
#pragma unroll
  for (int r = 0; r < (BX * kGemmBK) / kGemmThreads; ++r) {
    const int l = tid + r * kGemmThreads;
    const int xx = kContigK ? l / kGemmBK : l % BX;
    const int kk = kContigK ? l % kGemmBK : l / BX;
    const int64_t x = x0 + xx, k = k0 + kk;
    tile[kk][xx] = (x < X && k < k_end) ? load(x, k) : 0.f;
  }
}

// Split-K: blockIdx.z takes k-tiles [z * k_tiles_per_split, ...). With one split the epilogue
// runs here; with several, each split writes its partial tile to partial[z][M][N] and
// tiled_gemm_reduce_kernel adds the splits in z order, so the result stays deterministic.
template <bool kAContigK, bool kBContigK, class LoadA, class LoadB, class Store>
__global__ void __launch_bounds__(kGemmThreads)
    tiled_gemm_kernel(int64_t M, int64_t N, int64_t K, int64_t k_per_split, LoadA load_a,
                      LoadB load_b, Store store, float* partial) {
  __shared__ float As[kGemmBK][kGemmBM + 4];
  __shared__ float Bs[kGemmBK][kGemmBN + 4];
  const int tid = int(threadIdx.x);
  const int64_t m0 = int64_t(blockIdx.y) * kGemmBM, n0 = int64_t(blockIdx.x) * kGemmBN;
  const int64_t k_begin = int64_t(blockIdx.z) * k_per_split;
  const int64_t k_end = k_begin + k_per_split < K ? k_begin + k_per_split : K;
  const int tm = tid / (kGemmBN / kGemmTN), tn = tid % (kGemmBN / kGemmTN);
  float acc[kGemmTM][kGemmTN] = {};
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kGemmBK) {
    // Tiles of BM x BK and BN x BK = 1024 elements, 4 per thread.
    load_tile<kGemmBM, kAContigK>(As, tid, m0, M, k0, k_end, load_a);
    load_tile<kGemmBN, kBContigK>(Bs, tid, n0, N, k0, k_end,
                                  [&](int64_t n, int64_t k) { return load_b(k, n); });
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kGemmBK; ++kk) {
      float a[kGemmTM], b[kGemmTN];
#pragma unroll
      for (int i = 0; i < kGemmTM; ++i) a[i] = As[kk][tm * kGemmTM + i];
#pragma unroll
      for (int j = 0; j < kGemmTN; ++j) b[j] = Bs[kk][tn * kGemmTN + j];
#pragma unroll
      for (int i = 0; i < kGemmTM; ++i)
#pragma unroll
        for (int j = 0; j < kGemmTN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
  float* part = partial ? partial + int64_t(blockIdx.z) * M * N : nullptr;
#pragma unroll
  for (int i = 0; i < kGemmTM; ++i)
#pragma unroll
    for (int j = 0; j < kGemmTN; ++j) {
      const int64_t m = m0 + tm * kGemmTM + i, n = n0 + tn * kGemmTN + j;
      if (m >= M || n >= N) continue;
      if (part)
        part[m * N + n] = acc[i][j];
      else
        store(m, n, acc[i][j]);
    }
}

template <class Store>
__global__ void tiled_gemm_reduce_kernel(int64_t M, int64_t N, int splits,
                                         const float* __restrict__ partial, Store store) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < M * N;
       i += int64_t(gridDim.x) * blockDim.x) {
    float sum = 0.f;
    for (int z = 0; z < splits; ++z) sum += partial[int64_t(z) * M * N + i];
    store(i / N, i % N, sum);
  }
}

// Floats of split-K scratch tiled_gemm may use (for any shape): splits are only made while the
// grid has fewer tiles than multiprocessors, and stop at 3 * SMs tiles in all.
inline int64_t tiled_gemm_scratch_floats() { return int64_t(3) * sm_count() * kGemmBM * kGemmBN; }

// C = A B through the loaders and the epilogue. `split_scratch` (tiled_gemm_scratch_floats()
// floats) lets a grid with few output tiles split K to fill the GPU; nullptr: no split.
template <bool kAContigK, bool kBContigK, class LoadA, class LoadB, class Store>
void tiled_gemm(const char* name, int64_t M, int64_t N, int64_t K, LoadA a, LoadB b, Store c,
                cudaStream_t s, float* split_scratch = nullptr) {
  if (M <= 0 || N <= 0) return;
  const int64_t tiles = ((N + kGemmBN - 1) / kGemmBN) * ((M + kGemmBM - 1) / kGemmBM);
  const int64_t k_tiles = (K + kGemmBK - 1) / kGemmBK;
  const int64_t sms = sm_count();
  int64_t splits = 1;
  if (split_scratch && tiles < sms) {
    // Enough blocks for two waves, at least 8 k-tiles per split, within the scratch.
    splits = std::min<int64_t>((2 * sms + tiles - 1) / tiles, k_tiles / 8);
    splits = std::min<int64_t>(splits, tiled_gemm_scratch_floats() / (M * N));
    splits = std::max<int64_t>(splits, 1);
  }
  const int64_t k_per_split = (k_tiles + splits - 1) / splits * kGemmBK;
  splits = k_per_split > 0 ? (K + k_per_split - 1) / k_per_split : 1;
  if (splits < 1) splits = 1;
  const dim3 grid(unsigned((N + kGemmBN - 1) / kGemmBN), unsigned((M + kGemmBM - 1) / kGemmBM),
                  unsigned(splits));
  float* partial = splits > 1 ? split_scratch : nullptr;
  launch(name, tiled_gemm_kernel<kAContigK, kBContigK, LoadA, LoadB, Store>, grid,
         dim3(kGemmThreads), 0, s, M, N, K, k_per_split > 0 ? k_per_split : int64_t(kGemmBK), a, b,
         c, partial);
  if (partial)
    launch(name, tiled_gemm_reduce_kernel<Store>, blocks_for(M * N, 256, grid_cap()), dim3(256), 0,
           s, M, N, int(splits), partial, c);
}

}  // namespace moe_echo::cuda
