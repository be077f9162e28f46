// FP8 grouped GEMMs (backend.hpp, Fp8GemmArgs): the specification the CUDA kernels are tested
// against. Every operand is reduction-major e4m3 with one fp32 scale per 128 of the reduction;
// each output element is the sum over reduction blocks of (s_a s_b) times the block's exact sum of
// decoded products (double here: products of e4m3 values are exact, so only the order of the
// block sums differs from the GPU's fp32 accumulation), rounded once into c.
//
// fprop and dgrad are one computation, out[i][j] = sum_k a[i][k] b[j][k] over rows i of group g
// and weight rows j of its slab: fprop reads the slab transposed and quantized for it (q_t,
// scale_t: [N][K]), dgrad the slab as it is (q, scale: [K][N], the reduction along N).
#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu/cpu_ops.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"

namespace moe_echo::cpu {
namespace {

// The 256 e4m3 codes decoded once.
const std::vector<double>& e4m3_table() {
  static const std::vector<double> table = [] {
    std::vector<double> t(256);
    for (int b = 0; b < 256; ++b) t[size_t(b)] = double(from_e4m3(uint8_t(b)));
    return t;
  }();
  return table;
}

// Rows decoded together: each weight row is decoded once per block of this many rows.
constexpr int64_t kDecodedRows = 32;
// Rows whose sums run side by side (independent chains, each in the specification's order).
constexpr int kLanes = 4;

// acc[l] = the sum over the 128-wide tiles t of [0, K) of sa(l, t) * sb(t) * (the sum over tile
// t's k of a[l * stride + k] * b[k]), for L rows of a at once: k in order within a tile, then
// the tiles in order, as the specification sums.
template <int L, class ScaleA, class ScaleB>
void tiled_dots(const double* a, int64_t stride, const double* b, int64_t K, ScaleA sa, ScaleB sb,
                double* acc) {
  for (int l = 0; l < L; ++l) acc[l] = 0;
  for (int64_t t = 0, k0 = 0; k0 < K; ++t, k0 += kFp8Tile) {
    const int64_t k1 = std::min(K, k0 + kFp8Tile);
    double block[L] = {};
    for (int64_t k = k0; k < k1; ++k) {
      const double x = b[k];
      for (int l = 0; l < L; ++l) block[l] += a[l * stride + k] * x;
    }
    for (int l = 0; l < L; ++l) acc[l] += double(sa(l, t)) * double(sb(t)) * block[l];
  }
}

// f(lanes, r) for rows r of [0, n): kLanes rows at a time while that many remain, then one
// (lanes: a std::integral_constant, the rows f takes).
template <class F>
void by_lanes(int64_t n, F f) {
  int64_t r = 0;
  for (; r + kLanes <= n; r += kLanes) f(std::integral_constant<int, kLanes>{}, r);
  for (; r < n; ++r) f(std::integral_constant<int, 1>{}, r);
}

// out[i][j] for rows [begin, end) of a ([rows][Kr] codes, [rows][KT] scales) against slab rows
// j < Nout of b ([Nout][Kr] codes, [Nout / 128][KT] scales). Blocks of kDecodedRows rows of a
// are decoded once, then each slab row once per block; every output's sums run in the order of
// the specification (k within a block, then the blocks).
template <class T>
void rows_times_slab(const Fp8GemmArgs& a, int64_t begin, int64_t end, const uint8_t* qb,
                     const float* sb, int64_t Kr, int64_t Nout) {
  const double* dec = e4m3_table().data();
  const int64_t KT = fp8_tiles(Kr);
  const uint8_t* qa = a.a.as<uint8_t>();
  const float* sa = a.a_scale.as<float>();
  T* c = a.c.as<T>();
  std::vector<double> da(static_cast<size_t>(kDecodedRows * Kr));
  std::vector<double> db(static_cast<size_t>(Kr));
  for (int64_t i0 = begin; i0 < end; i0 += kDecodedRows) {
    const int64_t n = std::min(kDecodedRows, end - i0);
    const uint8_t* rows = qa + i0 * Kr;
    for (int64_t e = 0; e < n * Kr; ++e) da[size_t(e)] = dec[rows[e]];
    for (int64_t j = 0; j < Nout; ++j) {
      const uint8_t* bj = qb + j * Kr;
      for (int64_t k = 0; k < Kr; ++k) db[size_t(k)] = dec[bj[k]];
      const float* sbj = sb + (j / kFp8Tile) * KT;
      by_lanes(n, [&](auto lanes, int64_t r) {
        constexpr int L = decltype(lanes)::value;
        double acc[L];
        tiled_dots<L>(
            da.data() + r * Kr, Kr, db.data(), Kr,
            [&](int l, int64_t kt) { return sa[(i0 + r + l) * KT + kt]; },
            [&](int64_t kt) { return sbj[kt]; }, acc);
        for (int l = 0; l < L; ++l) c[(i0 + r + l) * Nout + j] = T(acc[l]);
      });
    }
  }
}

// Slab g of the weights (b, or b_home / b for a home split) with its scales.
struct Slab {
  const uint8_t* q;
  const float* scale;
};
Slab weight_slab(const Fp8GemmArgs& a, int g, int64_t slab_elems, int64_t slab_scales) {
  const int64_t home = gemm_home_groups(a.b_home);
  if (g < home)
    return {a.b_home.as<uint8_t>() + g * slab_elems, a.b_home_scale.as<float>() + g * slab_scales};
  MOE_ECHO_CHECK(a.b.data && g - home < a.b.size(0), "grouped_gemm fp8: group "
                                                         << g << " past b " << a.b.describe()
                                                         << " (" << home << " home groups)");
  return {a.b.as<uint8_t>() + (g - home) * slab_elems,
          a.b_scale.as<float>() + (g - home) * slab_scales};
}

// fprop (reduction K, out N: slab [N][K]) or dgrad (reduction N, out K: slab [K][N]).
template <class T>
void fprop_or_dgrad(const Fp8GemmArgs& a, bool fprop) {
  const char* name = fprop ? "grouped_gemm fp8 fprop" : "grouped_gemm fp8 dgrad";
  const Tensor& shape = a.b_home.data ? a.b_home : a.b;
  check_tensor(shape, name, DType::e4m3, {-1, -1, -1});
  check_tensor(a.a, name, DType::e4m3, {-1, -1});
  const int64_t Kr = a.a.size(1);
  // fprop: slab [N][K] (q_t); dgrad: slab [K][N] (q). The slab's second extent is the reduction.
  MOE_ECHO_CHECK(shape.size(2) == Kr,
                 name << ": weights " << shape.describe() << " do not take a reduction of " << Kr);
  const int64_t Nout = shape.size(1), KT = fp8_tiles(Kr), NT = fp8_tiles(Nout);
  check_tensor(a.a_scale, name, DType::f32, {a.a.size(0), KT});
  if (a.b.data) check_tensor(a.b_scale, name, DType::f32, {a.b.size(0), NT, KT});
  if (a.b_home.data) check_tensor(a.b_home_scale, name, DType::f32, {a.b_home.size(0), NT, KT});
  check_tensor(a.c, name, a.c.dtype, {-1, Nout});
  for (int g = 0; g < a.window.groups; ++g) {
    const RowRange rr = group_rows(a.window, g);
    if (rr.end <= rr.begin) continue;
    const Slab s = weight_slab(a, g, Nout * Kr, NT * KT);
    rows_times_slab<T>(a, rr.begin, rr.end, s.q, s.scale, Kr, Nout);
  }
}

}  // namespace

template <class T>
void gemm_fp8_fprop(const Fp8GemmArgs& a) {
  fprop_or_dgrad<T>(a, true);
}

template <class T>
void gemm_fp8_dgrad(const Fp8GemmArgs& a) {
  fprop_or_dgrad<T>(a, false);
}

template <class T>
void gemm_fp8_wgrad(const Fp8GemmArgs& a) {  // c[g] (+)= x_g^T dy_g over the padded columns
  const char* name = "grouped_gemm fp8 wgrad";
  check_tensor(a.a, name, DType::e4m3, {-1, -1});
  check_tensor(a.b, name, DType::e4m3, {-1, a.a.size(1)});
  const int64_t Kd = a.a.size(0), N = a.b.size(0), P = a.a.size(1);
  check_tensor(a.a_scale, name, DType::f32, {Kd * P / kFp8Tile});
  check_tensor(a.b_scale, name, DType::f32, {N * P / kFp8Tile});
  check_tensor(a.padded_offsets, name, DType::i32, {int64_t(a.window.groups) + 1});
  const int64_t home = a.c_home.data ? a.c_home.size(0) : 0;
  auto slab = [&](int g) {
    if (g < home) return a.c_home.as<T>() + int64_t(g) * Kd * N;
    MOE_ECHO_CHECK(a.c.data && g - home < a.c.size(0), name << ": group " << g << " past c "
                                                            << a.c.describe() << " (" << home
                                                            << " home groups)");
    return a.c.as<T>() + (int64_t(g) - home) * Kd * N;
  };
  const double* dec = e4m3_table().data();
  const uint8_t* qa = a.a.as<uint8_t>();
  const uint8_t* qb = a.b.as<uint8_t>();
  const float* sa = a.a_scale.as<float>();
  const float* sb = a.b_scale.as<float>();
  const int32_t* po = a.padded_offsets.as<int32_t>();
  for (int g = 0; g < a.window.groups; ++g) {
    const RowRange rr = group_rows(a.window, g);
    T* dw = slab(g);
    if (rr.end <= rr.begin) {  // as the bf16 wgrad: kept, or zero when written
      const bool has_rows = a.window.group_offsets[g + 1] > a.window.group_offsets[g];
      if (!a.accumulate && (has_rows || g < a.zero_empty_below)) std::fill_n(dw, Kd * N, T(0));
      continue;
    }
    const int64_t p = po[g], tg = fp8_tiles(rr.end - rr.begin);
    MOE_ECHO_CHECK(po[g + 1] - p == tg * kFp8Tile && p + tg * kFp8Tile <= P,
                   name << ": padded_offsets of group " << g << " (" << p << ", " << po[g + 1]
                        << ") do not hold its " << rr.end - rr.begin << " rows");
    const float* sag = sa + Kd * p / kFp8Tile;
    const float* sbg = sb + N * p / kFp8Tile;
    // Blocks of kDecodedRows rows of a's group columns decoded once, then each row of b's once
    // per block; the sums run in the specification's order (columns of a tile, then the tiles).
    const int64_t cols = tg * kFp8Tile;
    std::vector<double> da(static_cast<size_t>(kDecodedRows * cols));
    std::vector<double> db(static_cast<size_t>(cols));
    for (int64_t k0 = 0; k0 < Kd; k0 += kDecodedRows) {
      const int64_t nk = std::min(kDecodedRows, Kd - k0);
      for (int64_t r = 0; r < nk; ++r) {
        const uint8_t* row = qa + (k0 + r) * P + p;
        for (int64_t e = 0; e < cols; ++e) da[size_t(r * cols + e)] = dec[row[e]];
      }
      for (int64_t n = 0; n < N; ++n) {
        const uint8_t* row = qb + n * P + p;
        for (int64_t e = 0; e < cols; ++e) db[size_t(e)] = dec[row[e]];
        by_lanes(nk, [&](auto lanes, int64_t r) {
          constexpr int L = decltype(lanes)::value;
          double acc[L];
          tiled_dots<L>(
              da.data() + r * cols, cols, db.data(), cols,
              [&](int l, int64_t t) { return sag[t * Kd + k0 + r + l]; },
              [&](int64_t t) { return sbg[t * N + n]; }, acc);
          for (int l = 0; l < L; ++l) {
            T& out = dw[(k0 + r + l) * N + n];
            out = T(a.accumulate ? double(out) + acc[l] : acc[l]);
          }
        });
      }
    }
  }
}

MOE_ECHO_CPU_INSTANTIATE(gemm_fp8_fprop, Fp8GemmArgs);
MOE_ECHO_CPU_INSTANTIATE(gemm_fp8_dgrad, Fp8GemmArgs);
MOE_ECHO_CPU_INSTANTIATE(gemm_fp8_wgrad, Fp8GemmArgs);

}  // namespace moe_echo::cpu
