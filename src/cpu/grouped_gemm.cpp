// Grouped GEMM over the receive window: group g (an expert slot) multiplies its rows by its own
// weight matrix. Group extents are read from the device-side offsets; rows outside every group
// are never touched. Weights are [G, K, N] row-major (fc1: K = H, N = 2F; fc2: K = F, N = H).
#include <vector>

#include "cpu/cpu_ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cpu {
namespace {

// Weight slab of group g, [Kd, N]: b_home[g] for home groups, else b[g - home] (GemmArgs).
template <class T>
const T* weight_slab(const GemmArgs& a, int g, int64_t Kd, int64_t N) {
  const int64_t home = gemm_home_groups(a.b_home);
  if (home) {
    MOE_ECHO_CHECK(a.b_home.dtype == a.b.dtype || !a.b.data,
                   "grouped_gemm: b_home " << a.b_home.describe() << " for b " << a.b.describe());
    MOE_ECHO_CHECK(
        a.b_home.ndim == 3 && a.b_home.size(1) * a.b_home.size(2) == Kd * N,
        "grouped_gemm: b_home " << a.b_home.describe() << " for slabs of " << Kd << " x " << N);
  }
  if (g < home) return a.b_home.as<T>() + int64_t(g) * Kd * N;
  MOE_ECHO_CHECK(a.b.data && g - home < a.b.size(0), "grouped_gemm: group "
                                                         << g << " past b " << a.b.describe()
                                                         << " (" << home << " home groups)");
  return a.b.as<T>() + (int64_t(g) - home) * Kd * N;
}

}  // namespace

template <class T>
void gemm_fprop(const GemmArgs& a) {  // c[i, :] = a[i, :] @ b[g]
  const Tensor& shape = a.b_home.data ? a.b_home : a.b;
  const int64_t Kd = a.a.size(1), N = shape.size(2);
  std::vector<double> acc(static_cast<size_t>(N));
  for (int g = 0; g < a.window.groups; ++g) {
    const RowRange rr = group_rows(a.window, g);
    if (rr.end <= rr.begin) continue;
    const T* w = weight_slab<T>(a, g, Kd, N);
    for (int64_t i = rr.begin; i < rr.end; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0);
      const T* x = a.a.as<T>() + i * Kd;
      for (int64_t k = 0; k < Kd; ++k) {
        const double xv = double(x[k]);
        const T* wk = w + k * N;
        for (int64_t n = 0; n < N; ++n) acc[size_t(n)] += xv * double(wk[n]);
      }
      T* y = a.c.as<T>() + i * N;
      for (int64_t n = 0; n < N; ++n) y[n] = T(acc[size_t(n)]);
    }
  }
}

template <class T>
void gemm_dgrad(const GemmArgs& a) {  // c[i, :] = a[i, :] @ b[g]^T
  const Tensor& shape = a.b_home.data ? a.b_home : a.b;
  const int64_t N = a.a.size(1), Kd = shape.size(1);
  for (int g = 0; g < a.window.groups; ++g) {
    const RowRange rr = group_rows(a.window, g);
    if (rr.end <= rr.begin) continue;
    const T* w = weight_slab<T>(a, g, Kd, N);
    for (int64_t i = rr.begin; i < rr.end; ++i) {
      const T* dy = a.a.as<T>() + i * N;
      T* dx = a.c.as<T>() + i * Kd;
      for (int64_t k = 0; k < Kd; ++k) {
        const T* wk = w + k * N;
        double acc = 0;
        for (int64_t n = 0; n < N; ++n) acc += double(dy[n]) * double(wk[n]);
        dx[k] = T(acc);
      }
    }
  }
}

template <class T>
void gemm_wgrad(const GemmArgs& a) {  // c[g] (+)= a[rows of g]^T @ b[rows of g]
  const int64_t Kd = a.a.size(1), N = a.b.size(1);
  const int64_t home = a.c_home.data ? a.c_home.size(0) : 0;
  MOE_ECHO_CHECK(
      !a.c_home.data || ((a.c_home.dtype == a.c.dtype || !a.c.data) && a.c_home.ndim == 3 &&
                         a.c_home.size(1) == Kd && a.c_home.size(2) == N),
      "grouped_gemm wgrad: c_home " << a.c_home.describe() << " for c " << a.c.describe());
  auto slab = [&](int g) {
    if (g < home) return a.c_home.as<T>() + int64_t(g) * Kd * N;
    MOE_ECHO_CHECK(a.c.data && g - home < a.c.size(0), "grouped_gemm wgrad: group "
                                                           << g << " past c " << a.c.describe()
                                                           << " (" << home << " home groups)");
    return a.c.as<T>() + (int64_t(g) - home) * Kd * N;
  };
  std::vector<double> acc(size_t(Kd * N));
  for (int g = 0; g < a.window.groups; ++g) {
    const RowRange rr = group_rows(a.window, g);
    if (rr.end <= rr.begin) {  // no rows in the window: kept, or zero when written and the group
      const bool has_rows = a.window.group_offsets[g + 1] > a.window.group_offsets[g];
      if (!a.accumulate && (has_rows || g < a.zero_empty_below))  // rows in other windows
        std::fill_n(slab(g), Kd * N, T(0));
      continue;
    }
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t i = rr.begin; i < rr.end; ++i) {
      const T* x = a.a.as<T>() + i * Kd;
      const T* dy = a.b.as<T>() + i * N;
      for (int64_t k = 0; k < Kd; ++k) {
        const double xv = double(x[k]);
        double* row = acc.data() + k * N;
        for (int64_t n = 0; n < N; ++n) row[n] += xv * double(dy[n]);
      }
    }
    T* dw = slab(g);
    for (int64_t j = 0; j < Kd * N; ++j)
      dw[j] = T(a.accumulate ? double(dw[j]) + acc[size_t(j)] : acc[size_t(j)]);
  }
}

MOE_ECHO_CPU_INSTANTIATE(gemm_fprop, GemmArgs);
MOE_ECHO_CPU_INSTANTIATE(gemm_dgrad, GemmArgs);
MOE_ECHO_CPU_INSTANTIATE(gemm_wgrad, GemmArgs);

}  // namespace moe_echo::cpu
