// A plain shared-memory tiled GEMM with fp32 accumulation, for the router's small products
// (logits = x W^T, dW += dl^T x, dx += dl W). Not the expert GEMMs (those are CUTLASS grouped
// GEMMs in grouped_gemm*.cu).
//
// C[m, n] = sum_k A(m, k) * B(k, n), each output accumulated by one thread in increasing k, so
// the result is deterministic. Operands come through loader functors (any dtype, any layout);
// kAContigK / kBContigK say which index is contiguous in memory so tile loads coalesce. The
// epilogue functor receives (m, n, acc) for every in-range output.
#pragma once

#include "cuda/common.cuh"

namespace moe_echo::cuda {

constexpr int kGemmBM = 64, kGemmBN = 64, kGemmBK = 16, kGemmTM = 4, kGemmTN = 4;
constexpr int kGemmThreads = (kGemmBM / kGemmTM) * (kGemmBN / kGemmTN);  // 256

template <bool kAContigK, bool kBContigK, class LoadA, class LoadB, class Store>
__global__ void __launch_bounds__(kGemmThreads)
    tiled_gemm_kernel(int64_t M, int64_t N, int64_t K, LoadA load_a, LoadB load_b, Store store) {
  __shared__ float As[kGemmBK][kGemmBM + 4];
  __shared__ float Bs[kGemmBK][kGemmBN + 4];
  const int tid = int(threadIdx.x);
  const int64_t m0 = int64_t(blockIdx.y) * kGemmBM, n0 = int64_t(blockIdx.x) * kGemmBN;
  const int tm = tid / (kGemmBN / kGemmTN), tn = tid % (kGemmBN / kGemmTN);
  float acc[kGemmTM][kGemmTN] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kGemmBK) {
    // A tile: BM x BK = 1024 elements, 4 per thread.
#pragma unroll
    for (int r = 0; r < (kGemmBM * kGemmBK) / kGemmThreads; ++r) {
      const int l = tid + r * kGemmThreads;
      const int mm = kAContigK ? l / kGemmBK : l % kGemmBM;
      const int kk = kAContigK ? l % kGemmBK : l / kGemmBM;
      const int64_t m = m0 + mm, k = k0 + kk;
      As[kk][mm] = (m < M && k < K) ? load_a(m, k) : 0.f;
    }
#pragma unroll
    for (int r = 0; r < (kGemmBN * kGemmBK) / kGemmThreads; ++r) {
      const int l = tid + r * kGemmThreads;
      const int nn = kBContigK ? l / kGemmBK : l % kGemmBN;
      const int kk = kBContigK ? l % kGemmBK : l / kGemmBN;
      const int64_t n = n0 + nn, k = k0 + kk;
      Bs[kk][nn] = (n < N && k < K) ? load_b(k, n) : 0.f;
    }
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
#pragma unroll
  for (int i = 0; i < kGemmTM; ++i)
#pragma unroll
    for (int j = 0; j < kGemmTN; ++j) {
      const int64_t m = m0 + tm * kGemmTM + i, n = n0 + tn * kGemmTN + j;
      if (m < M && n < N) store(m, n, acc[i][j]);
    }
}

template <bool kAContigK, bool kBContigK, class LoadA, class LoadB, class Store>
void tiled_gemm(const char* name, int64_t M, int64_t N, int64_t K, LoadA a, LoadB b, Store c,
                cudaStream_t s) {
  if (M <= 0 || N <= 0) return;
  const dim3 grid(unsigned((N + kGemmBN - 1) / kGemmBN), unsigned((M + kGemmBM - 1) / kGemmBM));
  launch(name, tiled_gemm_kernel<kAContigK, kBContigK, LoadA, LoadB, Store>, grid,
         dim3(kGemmThreads), 0, s, M, N, K, a, b, c);
}

}  // namespace moe_echo::cuda
