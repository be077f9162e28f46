// Row arithmetic that the NCCL communicator types share: the combine's sum of a token's lead rows
// (the sync-free kernel pulls them from peers, the baseline's from a packed buffer: the same sums
// in the same order, so both give the same bits) and the host-side dispatch on row and float
// dtypes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "moe_echo/tensor.hpp"

namespace moe_echo::nccl {

constexpr unsigned kFull = 0xffffffffu;

// Rows of Y as words W: N elements per word, summed in Acc (f32 for bf16 and f32, f64 for f64).
template <class Y, class W>
struct Words;
template <>
struct Words<cuda::bf16, uint4> {
  using Acc = float;
  static constexpr int N = 8;
  __device__ static void load(const uint4& w, float (&a)[N]) { cuda::unpack_bf16x8(w, a); }
  __device__ static void add(const uint4& w, float (&a)[N]) {
    float f[N];
    cuda::unpack_bf16x8(w, f);
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] += f[i];
  }
  __device__ static uint4 store(const float (&a)[N]) { return cuda::pack_bf16x8(a); }
};
template <>
struct Words<cuda::bf16, cuda::bf16> {
  using Acc = float;
  static constexpr int N = 1;
  __device__ static void load(const cuda::bf16& w, float (&a)[N]) { a[0] = __bfloat162float(w); }
  __device__ static void add(const cuda::bf16& w, float (&a)[N]) { a[0] += __bfloat162float(w); }
  __device__ static cuda::bf16 store(const float (&a)[N]) { return __float2bfloat16_rn(a[0]); }
};
template <>
struct Words<float, uint4> {
  using Acc = float;
  static constexpr int N = 4;
  __device__ static void load(const uint4& w, float (&a)[N]) {
    a[0] = __uint_as_float(w.x);
    a[1] = __uint_as_float(w.y);
    a[2] = __uint_as_float(w.z);
    a[3] = __uint_as_float(w.w);
  }
  __device__ static void add(const uint4& w, float (&a)[N]) {
    a[0] += __uint_as_float(w.x);
    a[1] += __uint_as_float(w.y);
    a[2] += __uint_as_float(w.z);
    a[3] += __uint_as_float(w.w);
  }
  __device__ static uint4 store(const float (&a)[N]) {
    return make_uint4(__float_as_uint(a[0]), __float_as_uint(a[1]), __float_as_uint(a[2]),
                      __float_as_uint(a[3]));
  }
};
template <>
struct Words<double, uint4> {
  using Acc = double;
  static constexpr int N = 2;
  __device__ static void load(const uint4& w, double (&a)[N]) {
    a[0] = __hiloint2double(int(w.y), int(w.x));
    a[1] = __hiloint2double(int(w.w), int(w.z));
  }
  __device__ static void add(const uint4& w, double (&a)[N]) {
    a[0] += __hiloint2double(int(w.y), int(w.x));
    a[1] += __hiloint2double(int(w.w), int(w.z));
  }
  __device__ static uint4 store(const double (&a)[N]) {
    return make_uint4(unsigned(__double2loint(a[0])), unsigned(__double2hiint(a[0])),
                      unsigned(__double2loint(a[1])), unsigned(__double2hiint(a[1])));
  }
};
template <class Y>
struct Words<Y, Y> {  // f32 and f64 one element at a time
  using Acc = Y;
  static constexpr int N = 1;
  __device__ static void load(const Y& w, Y (&a)[N]) { a[0] = w; }
  __device__ static void add(const Y& w, Y (&a)[N]) { a[0] += w; }
  __device__ static Y store(const Y (&a)[N]) { return a[0]; }
};

// out <- (add ? out : 0) + rows 0 .. count-1 in order, summed in Acc and rounded once. Lane j <
// count holds row j's address in lane_row (count <= 32). Four words per lane and two rows in
// flight at a time; the sum order per element is the row order whatever the batching.
template <class Y, class W>
__device__ __forceinline__ void sum_rows(W* __restrict__ out, int64_t words, bool add,
                                         unsigned long long lane_row, int count, int lane) {
  using V = Words<Y, W>;
  using A = typename V::Acc;
  constexpr int U = 4, N = V::N;
  // The trip count is the same on every lane (the shuffles below need the whole warp).
  for (int64_t base = 0; base < words; base += 32 * U) {
    const int64_t w0 = base + lane;
    A acc[U][N];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (add && w0 + 32 * u < words) {
        V::load(out[w0 + 32 * u], acc[u]);
      } else {
#pragma unroll
        for (int x = 0; x < N; ++x) acc[u][x] = A(0);
      }
    }
    int j = 0;
    for (; j + 1 < count; j += 2) {
      const W* a = reinterpret_cast<const W*>(__shfl_sync(kFull, lane_row, j));
      const W* b = reinterpret_cast<const W*>(__shfl_sync(kFull, lane_row, j + 1));
      W va[U], vb[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (w0 + 32 * u < words) {
          va[u] = a[w0 + 32 * u];
          vb[u] = b[w0 + 32 * u];
        }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (w0 + 32 * u < words) {
          V::add(va[u], acc[u]);
          V::add(vb[u], acc[u]);
        }
    }
    if (j < count) {
      const W* a = reinterpret_cast<const W*>(__shfl_sync(kFull, lane_row, j));
      W va[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (w0 + 32 * u < words) va[u] = a[w0 + 32 * u];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (w0 + 32 * u < words) V::add(va[u], acc[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (w0 + 32 * u < words) out[w0 + 32 * u] = V::store(acc[u]);
  }
}

// The fan table's float type (f32 or f64).
template <class F>
void with_float(DType t, F&& f) {
  if (t == DType::f64)
    f(double{});
  else
    f(float{});
}

// Rows of y's dtype (bf16, f32, f64) as 16-byte words when `vec`, else one element at a time:
// f(element, word).
template <class F>
void with_rows(DType t, bool vec, F&& f) {
  switch (t) {
    case DType::bf16: vec ? f(cuda::bf16{}, uint4{}) : f(cuda::bf16{}, cuda::bf16{}); break;
    case DType::f32: vec ? f(float{}, uint4{}) : f(float{}, float{}); break;
    default: vec ? f(double{}, uint4{}) : f(double{}, double{}); break;
  }
}

}  // namespace moe_echo::nccl
