// FP8 (e4m3) on the host and the CPU backend: the conversion against a brute-force nearest-value
// search over all 256 codes (ties to the even code, saturation at 448, NaN), and the blockwise
// quantization of rows (1 x 128 tiles) and weight slabs (128 x 128 blocks) against a plain fp64
// reading of its definition: scale = amax / 448 (1 for zeros), q = e4m3(x * (1 / scale)),
// dequantized q * scale within e4m3's half-ulp of x.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <tuple>
#include <vector>

#include "moe_echo/backends.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"
#include "test_util.hpp"

namespace moe_echo::test {
namespace {

// A tensor of the CPU backend, freed with it.
class OwnedTensor {
 public:
  OwnedTensor(Backend& be, DType dt, std::initializer_list<int64_t> dims)
      : be_(be), t_(nullptr, dt, dims) {
    t_.data = be.allocate(t_.bytes());
  }
  ~OwnedTensor() { be_.deallocate(t_.data); }
  OwnedTensor(const OwnedTensor&) = delete;
  OwnedTensor& operator=(const OwnedTensor&) = delete;
  const Tensor& operator*() const { return t_; }
  void write(const std::vector<double>& v) const { write_tensor(be_, t_, v); }
  std::vector<double> read() const { return read_tensor(be_, t_); }

 private:
  Backend& be_;
  Tensor t_;
};

// The code whose value is nearest to f (ties: the even code), by trying all of them; finite
// values beyond 448 saturate, NaN is 0x7F.
uint8_t nearest_e4m3(float f) {
  if (std::isnan(f)) return 0x7F;
  const double a = std::fabs(double(f));
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 0x7F; ++c) {  // the finite non-negative codes
    const double err = std::fabs(double(from_e4m3(uint8_t(c))) - a);
    if (err < best_err || (err == best_err && c % 2 == 0)) best = c, best_err = err;
  }
  return uint8_t(best | (std::signbit(f) ? 0x80 : 0));
}

TEST(Fp8, DecodesEveryCode) {
  EXPECT_EQ(from_e4m3(0x00), 0.f);
  EXPECT_EQ(from_e4m3(0x01), std::ldexp(1.f, -9));  // smallest subnormal
  EXPECT_EQ(from_e4m3(0x08), std::ldexp(1.f, -6));  // smallest normal
  EXPECT_EQ(from_e4m3(0x38), 1.f);
  EXPECT_EQ(from_e4m3(0x7E), 448.f);
  EXPECT_EQ(from_e4m3(0xFE), -448.f);
  EXPECT_TRUE(std::isnan(from_e4m3(0x7F)) && std::isnan(from_e4m3(0xFF)));
  for (int c = 0; c < 256; ++c) {  // every finite code converts back to itself
    if ((c & 0x7F) != 0x7F && c != 0x80) {
      EXPECT_EQ(to_e4m3(from_e4m3(uint8_t(c))), c) << c;
    }
  }
}

TEST(Fp8, RoundsToNearestEvenAndSaturates) {
  // Every midpoint between neighbouring codes and values around each, both signs.
  std::vector<float> probes;
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = from_e4m3(uint8_t(c)), hi = from_e4m3(uint8_t(c + 1));
    const float mid = (lo + hi) / 2;  // exact in float
    for (float v : {lo, mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1000.f), hi})
      probes.push_back(v);
  }
  for (float v :
       {447.f, 448.f, 449.f, 463.9f, 464.f, 480.f, 1e6f, 1e-30f, std::ldexp(1.f, -10),
        std::nextafter(std::ldexp(1.f, -10), 1.f), std::numeric_limits<float>::infinity()})
    probes.push_back(v);
  for (float v : random_floats(20000, 5))  // spread over many binades
    probes.push_back(v * std::ldexp(1.f, int(std::fabs(v) * 1e4f) % 24 - 12));
  for (float v : probes)
    for (float f : {v, -v}) {
      const uint8_t want = std::isinf(f) ? uint8_t(f > 0 ? 0x7E : 0xFE) : nearest_e4m3(f);
      EXPECT_EQ(to_e4m3(f), want) << f;
    }
  EXPECT_EQ(to_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7F);
}

// The definition in fp64 where it can be: per tile amax, scale = float(amax / 448), each value
// converted by the brute-force nearest code of float(x / scale).
float definition_scale(double amax) {
  return amax > 0 ? std::max(float(float(amax) / 448.f), std::numeric_limits<float>::min()) : 1.f;
}
// A value's code in a tile of scale sc: the nearest code to v * (1 / sc) in f32.
double definition_code(float v, float sc) { return from_e4m3(nearest_e4m3(v * (1.f / sc))); }

TEST(Fp8, RowTilesFollowTheDefinition) {
  auto be = make_cpu_backend(DType::f32);
  for (const auto& [rows, K] :
       std::vector<std::pair<int64_t, int64_t>>{{5, 256}, {3, 300}, {1, 7}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(K));
    const int64_t KT = (K + 127) / 128;
    std::vector<double> x = random_values(size_t(rows * K), uint64_t(rows * K), -3, 3);
    for (int64_t k = 0; k < std::min<int64_t>(K, 128); ++k) x[size_t(k)] = 0;  // a zero tile
    if (rows > 2)
      for (int64_t k = 0; k < K; ++k) x[size_t(2 * K + k)] *= 1e-3;  // a small-valued row
    if (rows > 3)  // a row of normal values whose amax / 448 is not: its scale is FLT_MIN
      for (int64_t k = 0; k < K; ++k)
        x[size_t(3 * K + k)] =
            std::copysign(std::fabs(x[size_t(3 * K + k)]) + 0.5, x[size_t(3 * K + k)]) * 1e-36;
    OwnedTensor xt(*be, DType::f32, {rows, K}), q(*be, DType::e4m3, {rows, K}),
        s(*be, DType::f32, {rows, KT});
    xt.write(x);
    be->quantize_fp8_rows({*xt, *q, *s}, nullptr);
    const std::vector<double> got_q = q.read(), got_s = s.read();
    std::vector<double> deq, orig;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t < KT; ++t) {
        double amax = 0;
        for (int64_t k = t * 128; k < std::min(K, t * 128 + 128); ++k)
          amax = std::max(amax, std::fabs(double(float(x[size_t(r * K + k)]))));
        const float sc = definition_scale(amax);
        ASSERT_EQ(float(got_s[size_t(r * KT + t)]), sc) << "scale of row " << r << " tile " << t;
        for (int64_t k = t * 128; k < std::min(K, t * 128 + 128); ++k) {
          const float v = float(x[size_t(r * K + k)]);
          ASSERT_EQ(float(got_q[size_t(r * K + k)]), definition_code(v, sc)) << r << ", " << k;
          deq.push_back(got_q[size_t(r * K + k)] * sc);
          orig.push_back(v);
        }
      }
    EXPECT_LT(rel_error(deq, orig), 1.0 / 16) << "dequantized values";
    EXPECT_EQ(got_s[0], 1.0) << "a tile of zeros has scale 1";
  }
}

TEST(Fp8, WeightBlocksFollowTheDefinitionInBothLayouts) {
  auto be = make_cpu_backend(DType::f32);
  const int64_t G = 2, K = 200, N = 136, KT = 2, NT = 2;
  const std::vector<double> w = random_values(size_t(G * K * N), 77, -0.5, 0.5);
  OwnedTensor wt(*be, DType::f32, {G, K, N}), q(*be, DType::e4m3, {G, K, N}),
      qt(*be, DType::e4m3, {G, N, K}), s(*be, DType::f32, {G, KT, NT}),
      st(*be, DType::f32, {G, NT, KT});
  wt.write(w);
  be->quantize_fp8_blocks({*wt, *q, *qt, *s, *st}, nullptr);
  const std::vector<double> got_q = q.read(), got_qt = qt.read(), got_s = s.read(),
                            got_st = st.read();
  for (int64_t g = 0; g < G; ++g)
    for (int64_t kt = 0; kt < KT; ++kt)
      for (int64_t nt = 0; nt < NT; ++nt) {
        double amax = 0;
        for (int64_t k = kt * 128; k < std::min(K, kt * 128 + 128); ++k)
          for (int64_t n = nt * 128; n < std::min(N, nt * 128 + 128); ++n)
            amax = std::max(amax, std::fabs(double(float(w[size_t((g * K + k) * N + n)]))));
        const float sc = definition_scale(amax);
        ASSERT_EQ(float(got_s[size_t((g * KT + kt) * NT + nt)]), sc);
        ASSERT_EQ(float(got_st[size_t((g * NT + nt) * KT + kt)]), sc) << "scale_t";
        for (int64_t k = kt * 128; k < std::min(K, kt * 128 + 128); ++k)
          for (int64_t n = nt * 128; n < std::min(N, nt * 128 + 128); ++n) {
            const double want = definition_code(float(w[size_t((g * K + k) * N + n)]), sc);
            ASSERT_EQ(got_q[size_t((g * K + k) * N + n)], want) << g << ", " << k << ", " << n;
            ASSERT_EQ(got_qt[size_t((g * N + n) * K + k)], want) << g << ", " << n << ", " << k;
          }
      }
}

// Groups of a window: sizes, and the window [row_lo, row_lo + rows) over their global rows.
struct Window {
  std::vector<int32_t> offsets;
  int64_t row_lo = 0, rows = 0;
  GroupWindow view() const {
    GroupWindow w;
    w.group_offsets = offsets.data();
    w.groups = int(offsets.size()) - 1;
    w.row_lo = row_lo;
    w.rows = rows;
    return w;
  }
};

// Group g's window rows [lo, hi).
std::pair<int64_t, int64_t> rows_of(const Window& w, int g) {
  const int64_t lo = std::max<int64_t>(w.offsets[size_t(g)], w.row_lo),
                hi = std::min<int64_t>(w.offsets[size_t(g) + 1], w.row_lo + w.rows);
  return {lo - w.row_lo, std::max(lo, hi) - w.row_lo};
}

TEST(Fp8, ColumnsRestartAtEveryGroupAndPadTo128) {
  auto be = make_cpu_backend(DType::f32);
  // Groups of 0, 1, 130, 0 and 200 rows; the window cuts the last one.
  const Window win{{0, 0, 1, 131, 131, 331}, 0, 300};
  const int64_t K = 136, G = 5, P = fp8_padded_rows(win.rows, G);
  const std::vector<double> x = random_values(size_t(win.rows * K), 81, -3, 3);
  OwnedTensor xt(*be, DType::f32, {win.rows, K}), q(*be, DType::e4m3, {K, P}),
      s(*be, DType::f32, {K * P / 128}), po(*be, DType::i32, {G + 1});
  xt.write(x);
  be->quantize_fp8_cols({win.view(), *xt, *q, *s, *po}, nullptr);
  const std::vector<double> got_q = q.read(), got_s = s.read(), got_po = po.read();
  // Padded offsets: 0, 0, 128, 384, 384, then 384 + 256 (169 rows of the last group).
  EXPECT_EQ(got_po, (std::vector<double>{0, 0, 128, 384, 384, 640}));
  for (int g = 0; g < G; ++g) {
    const auto [lo, hi] = rows_of(win, g);
    const int64_t p = int64_t(got_po[size_t(g)]), m = hi - lo, tg = (m + 127) / 128;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t t = 0; t < tg; ++t) {
        double amax = 0;
        for (int64_t i = t * 128; i < std::min(m, t * 128 + 128); ++i)
          amax = std::max(amax, std::fabs(double(float(x[size_t((lo + i) * K + k)]))));
        const float sc = definition_scale(amax);
        ASSERT_EQ(float(got_s[size_t(K * p / 128 + t * K + k)]), sc) << g << ", " << k;
        for (int64_t i = t * 128; i < t * 128 + 128; ++i) {
          const double want = i < m ? definition_code(float(x[size_t((lo + i) * K + k)]), sc) : 0.0;
          ASSERT_EQ(got_q[size_t(k * P + p + i)], want) << g << ", " << k << ", " << i;
        }
      }
  }
}

// The FP8 GEMMs of the CPU backend against the product of the dequantized operands (q * scale)
// in fp64 by plain loops: the same value up to the order of the sums (1e-12 in f64).
TEST(Fp8, GemmsEqualTheProductOfTheDequantizedOperands) {
  auto be = make_cpu_backend(DType::f64);
  const Window win{{0, 3, 3, 140, 150}, 2, 146};  // groups of 3, 0, 137, 10; the window cuts two
  const int64_t G = 4, K = 160, N = 272, R = win.rows, P = fp8_padded_rows(R, G);
  const int64_t KT = 2, NT = 3;
  const std::vector<double> x = random_values(size_t(R * K), 91, -2, 2),
                            dy = random_values(size_t(R * N), 92, -1, 1),
                            w = random_values(size_t(G * K * N), 93, -0.1, 0.1),
                            dw0 = random_values(size_t(G * K * N), 94, -1, 1);
  OwnedTensor xt(*be, DType::f64, {R, K}), dyt(*be, DType::f64, {R, N}),
      wt(*be, DType::f64, {G, K, N});
  xt.write(x), dyt.write(dy), wt.write(w);
  OwnedTensor xq(*be, DType::e4m3, {R, K}), xs(*be, DType::f32, {R, KT}),
      dyq(*be, DType::e4m3, {R, N}), dys(*be, DType::f32, {R, NT}), q(*be, DType::e4m3, {G, K, N}),
      qt(*be, DType::e4m3, {G, N, K}), s(*be, DType::f32, {G, KT, NT}),
      st(*be, DType::f32, {G, NT, KT}), xc(*be, DType::e4m3, {K, P}),
      xcs(*be, DType::f32, {K * P / 128}), dyc(*be, DType::e4m3, {N, P}),
      dycs(*be, DType::f32, {N * P / 128}), po(*be, DType::i32, {G + 1}),
      po2(*be, DType::i32, {G + 1}), y(*be, DType::f64, {R, N}), dx(*be, DType::f64, {R, K}),
      dw(*be, DType::f64, {G, K, N});
  be->quantize_fp8_rows({*xt, *xq, *xs}, nullptr);
  be->quantize_fp8_rows({*dyt, *dyq, *dys}, nullptr);
  be->quantize_fp8_blocks({*wt, *q, *qt, *s, *st}, nullptr);
  be->quantize_fp8_cols({win.view(), *xt, *xc, *xcs, *po}, nullptr);
  be->quantize_fp8_cols({win.view(), *dyt, *dyc, *dycs, *po2}, nullptr);
  y.write(std::vector<double>(size_t(R * N), 7.0));
  dx.write(std::vector<double>(size_t(R * K), 7.0));
  dw.write(dw0);
  Fp8GemmArgs f;
  f.window = win.view(), f.a = *xq, f.a_scale = *xs, f.b = *qt, f.b_scale = *st, f.c = *y;
  be->gemm_fp8_fprop(f, nullptr);
  Fp8GemmArgs d;
  d.window = win.view(), d.a = *dyq, d.a_scale = *dys, d.b = *q, d.b_scale = *s, d.c = *dx;
  be->gemm_fp8_dgrad(d, nullptr);
  Fp8GemmArgs g;
  g.window = win.view(), g.a = *xc, g.a_scale = *xcs, g.b = *dyc, g.b_scale = *dycs;
  g.padded_offsets = *po, g.c = *dw;
  be->gemm_fp8_wgrad(g, nullptr);
  // Dequantized operands, as plain [rows][cols] tables.
  const std::vector<double> vxq = xq.read(), vxs = xs.read(), vdyq = dyq.read(), vdys = dys.read(),
                            vq = q.read(), vs = s.read();
  auto xv = [&](int64_t i, int64_t k) {
    return vxq[size_t(i * K + k)] * vxs[size_t(i * KT + k / 128)];
  };
  auto dyv = [&](int64_t i, int64_t n) {
    return vdyq[size_t(i * N + n)] * vdys[size_t(i * NT + n / 128)];
  };
  auto wv = [&](int64_t gg, int64_t k, int64_t n) {
    return vq[size_t((gg * K + k) * N + n)] * vs[size_t((gg * KT + k / 128) * NT + n / 128)];
  };
  std::vector<double> want_y(size_t(R * N), 7.0), want_dx(size_t(R * K), 7.0), want_dw = dw0;
  for (int gg = 0; gg < G; ++gg) {
    const auto [lo, hi] = rows_of(win, gg);
    for (int64_t i = lo; i < hi; ++i) {
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += xv(i, k) * wv(gg, k, n);
        want_y[size_t(i * N + n)] = acc;
      }
      for (int64_t k = 0; k < K; ++k) {
        double acc = 0;
        for (int64_t n = 0; n < N; ++n) acc += dyv(i, n) * wv(gg, k, n);
        want_dx[size_t(i * K + k)] = acc;
      }
    }
  }
  // wgrad reads x and dy quantized along the rows of each group: dequantize the columns.
  const std::vector<double> vxc = xc.read(), vxcs = xcs.read(), vdyc = dyc.read(),
                            vdycs = dycs.read(), vpo = po.read();
  for (int gg = 0; gg < G; ++gg) {
    const auto [lo, hi] = rows_of(win, gg);
    const int64_t p = int64_t(vpo[size_t(gg)]);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t i = 0; i < hi - lo; ++i)
          acc += vxc[size_t(k * P + p + i)] * vxcs[size_t(K * p / 128 + i / 128 * K + k)] *
                 vdyc[size_t(n * P + p + i)] * vdycs[size_t(N * p / 128 + i / 128 * N + n)];
        want_dw[size_t((gg * K + k) * N + n)] += acc;
      }
  }
  EXPECT_LT(rel_error(y.read(), want_y), 1e-12) << "fprop";
  EXPECT_LT(rel_error(dx.read(), want_dx), 1e-12) << "dgrad";
  EXPECT_LT(rel_error(dw.read(), want_dw), 1e-12) << "wgrad";
  // And the cost of e4m3 against the unquantized product: a few percent.
  std::vector<double> exact(size_t(R * N), 7.0);
  for (int gg = 0; gg < G; ++gg) {
    const auto [lo, hi] = rows_of(win, gg);
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k)
          acc +=
              double(float(x[size_t(i * K + k)])) * double(float(w[size_t((gg * K + k) * N + n)]));
        exact[size_t(i * N + n)] = acc;
      }
  }
  const double e = rel_error(y.read(), exact);
  EXPECT_GT(e, 1e-3) << "e4m3 cannot be this exact: the quantization did not happen";
  EXPECT_LT(e, 6e-2) << "fprop against the unquantized product";
}

// The bytes of a backend tensor.
std::vector<uint8_t> bytes_of(Backend& be, const Tensor& t) {
  std::vector<uint8_t> out(t.bytes());
  be.copy_to_host(out.data(), t.data, out.size());
  return out;
}

// Packed rows (what the FP8 dispatch sends): each row's e4m3 values, then its scales' f32 bytes,
// then zeros to a multiple of 16 bytes; the same bits as quantizing into q and scale.
TEST(Fp8, PackedRowsHoldTheRowTilesBitForBit) {
  auto be = make_cpu_backend(DType::f32);
  for (const auto& [rows, K] :
       std::vector<std::pair<int64_t, int64_t>>{{3, 256}, {2, 304}, {4, 16}, {0, 128}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(K));
    const int64_t KT = (K + 127) / 128, pitch = fp8_packed_row_bytes(K);
    EXPECT_EQ(pitch % 16, 0);
    EXPECT_GE(pitch, K + 4 * KT);
    EXPECT_LT(pitch, K + 4 * KT + 16);
    OwnedTensor xt(*be, DType::f32, {rows, K}), q(*be, DType::e4m3, {rows, K}),
        sc(*be, DType::f32, {rows, KT}), packed(*be, DType::e4m3, {rows, pitch});
    xt.write(random_values(size_t(rows * K), uint64_t(K + 5), -4, 4));
    std::vector<uint8_t> poison(size_t(rows * pitch), 0xAB);
    if (rows > 0) std::memcpy((*packed).data, poison.data(), poison.size());
    be->quantize_fp8_rows({*xt, *q, *sc}, nullptr);
    Fp8RowArgs a;
    a.x = *xt, a.packed = *packed;
    be->quantize_fp8_rows(a, nullptr);
    const std::vector<uint8_t> p = bytes_of(*be, *packed), qb = bytes_of(*be, *q),
                               sb = bytes_of(*be, *sc);
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = p.data() + r * pitch;
      EXPECT_TRUE(std::equal(row, row + K, qb.begin() + r * K)) << "values of row " << r;
      EXPECT_TRUE(std::equal(row + K, row + K + 4 * KT, sb.begin() + r * KT * 4))
          << "scales of row " << r;
      EXPECT_TRUE(std::all_of(row + K + 4 * KT, row + pitch, [](uint8_t b) { return b == 0; }))
          << "padding of row " << r;
    }
  }
  // One or the other: packed rows with q, or a packed tensor of the wrong width, are refused.
  OwnedTensor xt(*be, DType::f32, {2, 128}), q(*be, DType::e4m3, {2, 128}),
      sc(*be, DType::f32, {2, 1}), packed(*be, DType::e4m3, {2, 144}),
      narrow(*be, DType::e4m3, {2, 132});
  EXPECT_THROW(be->quantize_fp8_rows({*xt, *q, *sc, *packed}, nullptr), Error);
  EXPECT_THROW(be->quantize_fp8_rows({*xt, Tensor(), Tensor(), *narrow}, nullptr), Error);
}

// fan_out_fp8: each lead row's packed values and scales reach all its members' rows (the lead's
// own included) and nothing else; rows past the valid ones stay as they were.
TEST(Fp8, FanOutCopiesEachLeadsPackedRowToItsMembers) {
  auto be = make_cpu_backend(DType::f32);
  const int64_t H = 272, HT = 3, pitch = fp8_packed_row_bytes(H), rows = 10, K = 3;
  const Window win{{0, 4, 4, 7}, 0, rows};  // 7 valid rows of 10
  // Leads 0 (members 0, 3, 5), 1, 2 (2, 6) and 4; rows 3, 5 and 6 are members.
  const std::vector<double> members = {0, 3,  5,  1, -1, -1, 2,  6,  -1, 0,  -1, -1, 4,  -1, -1,
                                       0, -1, -1, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
  const std::vector<int64_t> lead_of = {0, 1, 2, 0, 4, 0, 2};
  OwnedTensor m(*be, DType::i32, {rows, K}), xt(*be, DType::f32, {rows, H}),
      src(*be, DType::e4m3, {rows, pitch}), q(*be, DType::e4m3, {rows, H}),
      sc(*be, DType::f32, {rows, HT});
  m.write(members);
  xt.write(random_values(size_t(rows * H), 61, -2, 2));
  Fp8RowArgs pa;
  pa.x = *xt, pa.packed = *src;
  be->quantize_fp8_rows(pa, nullptr);
  const std::vector<uint8_t> poison_q(size_t(rows * H), 0x5A),
      poison_s(size_t(rows * HT * 4), 0xC3);
  std::memcpy((*q).data, poison_q.data(), poison_q.size());
  std::memcpy((*sc).data, poison_s.data(), poison_s.size());
  be->fan_out_fp8({win.view(), *m, *src, *q, *sc}, nullptr);
  const std::vector<uint8_t> p = bytes_of(*be, *src), qb = bytes_of(*be, *q),
                             sb = bytes_of(*be, *sc);
  for (int64_t j = 0; j < rows; ++j) {
    if (j >= int64_t(lead_of.size())) {
      EXPECT_TRUE(std::all_of(qb.begin() + j * H, qb.begin() + (j + 1) * H,
                              [](uint8_t b) { return b == 0x5A; }))
          << "row " << j << " is past the valid rows";
      continue;
    }
    const uint8_t* row = p.data() + lead_of[size_t(j)] * pitch;
    EXPECT_TRUE(std::equal(row, row + H, qb.begin() + j * H)) << "values of row " << j;
    EXPECT_TRUE(std::equal(row + H, row + H + 4 * HT, sb.begin() + j * HT * 4))
        << "scales of row " << j;
  }
  EXPECT_THROW(be->fan_out_fp8({win.view(), *m, *xt, *q, *sc}, nullptr), Error) << "src not packed";
}

// dequantize_fp8_rows: each value the f32 product of its e4m3 code and its tile's scale.
TEST(Fp8, DequantizedRowsAreCodeTimesScale) {
  auto be = make_cpu_backend(DType::f32);
  const int64_t rows = 3, K = 272, KT = 3;
  OwnedTensor xt(*be, DType::f32, {rows, K}), q(*be, DType::e4m3, {rows, K}),
      sc(*be, DType::f32, {rows, KT}), back(*be, DType::f32, {rows, K});
  xt.write(random_values(size_t(rows * K), 77, -6, 6));
  be->quantize_fp8_rows({*xt, *q, *sc}, nullptr);
  back.write(std::vector<double>(size_t(rows * K), 1234.0));  // poison
  be->dequantize_fp8_rows({*back, *q, *sc}, nullptr);
  const std::vector<double> got = back.read(), qv = q.read(), sv = sc.read(), x = xt.read();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const float want = float(qv[size_t(r * K + k)]) * float(sv[size_t(r * KT + k / 128)]);
      ASSERT_EQ(float(got[size_t(r * K + k)]), want) << r << ", " << k;
    }
  EXPECT_LT(rel_error(got, x), 1.0 / 16) << "back near the original values";
}

// Columns of e4m3 rows (the dispatched x, for fc1's weight gradient) are the columns of their
// values q * scale, bit for bit.
TEST(Fp8, ColumnsOfE4m3RowsEqualColumnsOfTheirValues) {
  auto be = make_cpu_backend(DType::f32);
  const Window win{{0, 0, 1, 131, 131, 331}, 0, 300};
  const int64_t K = 272, KT = 3, G = 5, P = fp8_padded_rows(win.rows, G), R = win.rows;
  OwnedTensor xt(*be, DType::f32, {R, K}), q(*be, DType::e4m3, {R, K}),
      sc(*be, DType::f32, {R, KT}), xd(*be, DType::f32, {R, K});
  xt.write(random_values(size_t(R * K), 71, -5, 5));
  be->quantize_fp8_rows({*xt, *q, *sc}, nullptr);
  const std::vector<double> qv = q.read(), sv = sc.read();
  std::vector<double> deq(size_t(R * K));
  for (int64_t i = 0; i < R; ++i)
    for (int64_t k = 0; k < K; ++k)
      deq[size_t(i * K + k)] =
          double(float(qv[size_t(i * K + k)]) * float(sv[size_t(i * KT + k / 128)]));
  xd.write(deq);
  OwnedTensor a(*be, DType::e4m3, {K, P}), as(*be, DType::f32, {K * P / 128}),
      apo(*be, DType::i32, {G + 1}), b(*be, DType::e4m3, {K, P}),
      bs(*be, DType::f32, {K * P / 128}), bpo(*be, DType::i32, {G + 1});
  // Columns past the padded total are not written: the same fill in both.
  for (const OwnedTensor* t : {&a, &as, &b, &bs})
    t->write(std::vector<double>(size_t((**t).numel()), 0.0));
  be->quantize_fp8_cols({win.view(), *xd, *a, *as, *apo}, nullptr);
  be->quantize_fp8_cols({win.view(), *q, *b, *bs, *bpo, *sc}, nullptr);
  EXPECT_EQ(bytes_of(*be, *b), bytes_of(*be, *a));
  EXPECT_EQ(bytes_of(*be, *bs), bytes_of(*be, *as));
  EXPECT_EQ(bpo.read(), apo.read());
  EXPECT_THROW(be->quantize_fp8_cols({win.view(), *q, *b, *bs, *bpo}, nullptr), Error)
      << "e4m3 x without its scales";
  EXPECT_THROW(be->quantize_fp8_cols({win.view(), *xd, *b, *bs, *bpo, *sc}, nullptr), Error)
      << "scales for an x that is not e4m3";
}

// SwiGLU with a's FP8 rows (SwigluArgs::a_q): SwiGLU, then the rows of the window's valid rows.
TEST(Fp8, SwigluWithFp8RowsEqualsSwigluThenRows) {
  auto be = make_cpu_backend(DType::f32);
  const Window win{{20, 20, 21, 151, 151, 351}, 20, 400};  // 331 valid rows
  const int64_t F = 200, FT = 2, R = win.rows;
  OwnedTensor h(*be, DType::f32, {R, 2 * F}), a1(*be, DType::f32, {R, F}),
      a2(*be, DType::f32, {R, F}), q1(*be, DType::e4m3, {R, F}), q2(*be, DType::e4m3, {R, F}),
      s1(*be, DType::f32, {R, FT}), s2(*be, DType::f32, {R, FT});
  h.write(random_values(size_t(R * 2 * F), 93, -4, 4));
  for (const OwnedTensor* t : {&a1, &a2, &q1, &q2, &s1, &s2})
    t->write(std::vector<double>(size_t((**t).numel()), 7.0));
  be->swiglu_forward({win.view(), *h, *a1, Tensor(), Tensor(), *q1, *s1}, nullptr);
  be->swiglu_forward({win.view(), *h, *a2, Tensor(), Tensor()}, nullptr);
  be->quantize_fp8_rows({*a2, *q2, *s2, {}, win.view()}, nullptr);
  EXPECT_EQ(bytes_of(*be, *a1), bytes_of(*be, *a2));
  EXPECT_EQ(bytes_of(*be, *q1), bytes_of(*be, *q2));
  EXPECT_EQ(bytes_of(*be, *s1), bytes_of(*be, *s2));
  const std::vector<uint8_t> qb = bytes_of(*be, *q1);
  EXPECT_EQ(std::count(qb.begin() + 331 * F, qb.end(), to_e4m3(7.f)), (R - 331) * F);
  OwnedTensor narrow(*be, DType::e4m3, {R, F - 8});
  EXPECT_THROW(be->swiglu_forward({win.view(), *h, *a1, Tensor(), Tensor(), *narrow, *s1}, nullptr),
               Error);
  EXPECT_THROW(be->swiglu_forward({win.view(), *h, *a1, Tensor(), Tensor(), *q1, {}}, nullptr),
               Error);
}

// Rows of a window (Fp8RowArgs::window) and the rows written in the column pass
// (Fp8ColArgs::row_q): the valid rows get the bits of quantizing every row, the rows past them
// keep what they held; the columns of the fused pass are those of the pass alone.
TEST(Fp8, WindowRowsAndTheFusedPassQuantizeTheValidRowsOnly) {
  auto be = make_cpu_backend(DType::f32);
  // Groups of 0, 1, 130, 0 and 200 rows from global row 20; the window [20, 420) has 331 valid
  // rows.
  const Window win{{20, 20, 21, 151, 151, 351}, 20, 400};
  const int64_t K = 264, KT = 3, G = 5, P = fp8_padded_rows(win.rows, G), R = win.rows, valid = 331;
  OwnedTensor xt(*be, DType::f32, {R, K}), q(*be, DType::e4m3, {R, K}),
      sc(*be, DType::f32, {R, KT});
  xt.write(random_values(size_t(R * K), 91, -4, 4));
  be->quantize_fp8_rows({*xt, *q, *sc}, nullptr);
  const std::vector<uint8_t> q_all = bytes_of(*be, *q), s_all = bytes_of(*be, *sc);
  OwnedTensor qw(*be, DType::e4m3, {R, K}), sw(*be, DType::f32, {R, KT}),
      qf(*be, DType::e4m3, {R, K}), sf(*be, DType::f32, {R, KT}), ct(*be, DType::e4m3, {K, P}),
      cs(*be, DType::f32, {K * P / 128}), po(*be, DType::i32, {G + 1}),
      ct2(*be, DType::e4m3, {K, P}), cs2(*be, DType::f32, {K * P / 128}),
      po2(*be, DType::i32, {G + 1});
  for (const OwnedTensor* t : {&qw, &sw, &qf, &sf, &ct, &cs, &ct2, &cs2})
    t->write(std::vector<double>(size_t((**t).numel()), 7.0));
  be->quantize_fp8_rows({*xt, *qw, *sw, {}, win.view()}, nullptr);
  be->quantize_fp8_cols({win.view(), *xt, *ct, *cs, *po, {}, *qf, *sf}, nullptr);
  be->quantize_fp8_cols({win.view(), *xt, *ct2, *cs2, *po2}, nullptr);
  EXPECT_EQ(bytes_of(*be, *ct), bytes_of(*be, *ct2)) << "columns";
  EXPECT_EQ(bytes_of(*be, *cs), bytes_of(*be, *cs2)) << "column scales";
  for (const auto& [qo, so, what] : {std::tuple{&qw, &sw, "window"}, {&qf, &sf, "fused"}}) {
    const std::vector<uint8_t> qb = bytes_of(*be, **qo), sb = bytes_of(*be, **so);
    const size_t qv = size_t(valid * K), sv = size_t(valid * KT * 4);
    EXPECT_TRUE(std::equal(qb.begin(), qb.begin() + long(qv), q_all.begin())) << what;
    EXPECT_TRUE(std::equal(sb.begin(), sb.begin() + long(sv), s_all.begin())) << what;
    EXPECT_EQ(std::count(qb.begin() + long(qv), qb.end(), to_e4m3(7.f)), long(qb.size() - qv))
        << what << ": rows past the valid ones were written";
    const std::vector<double> sd = so->read();
    EXPECT_EQ(std::count(sd.begin() + long(valid * KT), sd.end(), 7.0), long((R - valid) * KT))
        << what << ": scales past the valid rows were written";
  }
  // Bad arguments: rows for an e4m3 x, a row_q of the wrong width, no row_scale, a window larger
  // than x.
  EXPECT_THROW(be->quantize_fp8_cols({win.view(), *q, *ct, *cs, *po, *sc, *qf, *sf}, nullptr),
               Error);
  OwnedTensor narrow(*be, DType::e4m3, {R, K - 8});
  EXPECT_THROW(be->quantize_fp8_cols({win.view(), *xt, *ct, *cs, *po, {}, *narrow, *sf}, nullptr),
               Error);
  EXPECT_THROW(be->quantize_fp8_cols({win.view(), *xt, *ct, *cs, *po, {}, *qf, {}}, nullptr),
               Error);
  Window big = win;
  big.rows = R + 1;
  EXPECT_THROW(be->quantize_fp8_rows({*xt, *qw, *sw, {}, big.view()}, nullptr), Error);
  // Dequantizing a window: its valid rows are those of every row's dequantization, the rest kept.
  OwnedTensor back(*be, DType::f32, {R, K}), back_all(*be, DType::f32, {R, K});
  back.write(std::vector<double>(size_t(R * K), 7.0));
  be->dequantize_fp8_rows({*back, *q, *sc, {}, win.view()}, nullptr);
  be->dequantize_fp8_rows({*back_all, *q, *sc}, nullptr);
  const std::vector<double> bw = back.read(), ba = back_all.read();
  EXPECT_TRUE(std::equal(bw.begin(), bw.begin() + long(valid * K), ba.begin()));
  EXPECT_EQ(std::count(bw.begin() + long(valid * K), bw.end(), 7.0), long((R - valid) * K));
}

}  // namespace
}  // namespace moe_echo::test
