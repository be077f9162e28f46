// FP8 blockwise quantization (backend.hpp, Fp8RowArgs / Fp8BlockArgs / Fp8ColArgs): per tile, the
// largest magnitude, the scale max(amax / 448, FLT_MIN) (1 for a tile of zeros) and every element
// as e4m3(x * (1 / scale)), all in float as the CUDA kernels compute it.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "cpu/cpu_ops.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"

namespace moe_echo::cpu {
namespace {

// A tile's scale s = max(amax / 448, FLT_MIN) (1 for a tile of zeros: s stays a normal float, so
// its multiplier 1 / s, one IEEE division per tile, is finite): a value x is stored as
// e4m3(x * (1 / s)).
struct TileQuant {
  float s, inv;
  explicit TileQuant(float amax)
      : s(amax > 0.f ? std::max(amax / 448.f, FLT_MIN) : 1.f), inv(1.f / s) {}
  uint8_t operator()(float x) const { return to_e4m3(x * inv); }
};

}  // namespace

template <class T>
void quantize_fp8_rows(const Fp8RowArgs& a) {
  const int64_t KT = check_fp8_row_args(a, a.x.dtype), K = a.x.size(1);
  const int64_t rows = a.window.group_offsets ? valid_rows(a.window) : a.x.size(0);
  const T* x = a.x.as<T>();
  // Row r's values and scales: q and scale, or packed row r (values, then scales, then zeros).
  const int64_t pitch = a.packed.data ? fp8_packed_row_bytes(K) : 0;
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* q = a.packed.data ? a.packed.as<uint8_t>() + r * pitch : a.q.as<uint8_t>() + r * K;
    float* scale = a.packed.data ? reinterpret_cast<float*>(q + K) : a.scale.as<float>() + r * KT;
    if (a.packed.data) std::fill(q + K + KT * 4, q + pitch, uint8_t(0));
    for (int64_t t = 0; t < KT; ++t) {
      const int64_t lo = t * kFp8Tile, hi = std::min(K, lo + kFp8Tile);
      float amax = 0.f;
      for (int64_t k = lo; k < hi; ++k) amax = std::max(amax, std::fabs(float(x[r * K + k])));
      const TileQuant tq(amax);
      scale[t] = tq.s;
      for (int64_t k = lo; k < hi; ++k) q[k] = tq(float(x[r * K + k]));
    }
  }
}

template <class T>
void dequantize_fp8_rows(const Fp8RowArgs& a) {
  const int64_t KT = check_fp8_dequant_args(a, a.x.dtype), K = a.x.size(1);
  const int64_t rows = a.window.group_offsets ? valid_rows(a.window) : a.x.size(0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k)
      a.x.as<T>()[r * K + k] =
          T(from_e4m3(a.q.as<uint8_t>()[r * K + k]) * a.scale.as<float>()[r * KT + k / kFp8Tile]);
}

template <class T>
void quantize_fp8_blocks(const Fp8BlockArgs& a) {
  check_fp8_block_args(a, a.w.dtype);
  const int64_t G = a.w.size(0), K = a.w.size(1), N = a.w.size(2), KT = fp8_tiles(K),
                NT = fp8_tiles(N);
  const T* w = a.w.as<T>();
  for (int64_t g = 0; g < G; ++g)
    for (int64_t kt = 0; kt < KT; ++kt)
      for (int64_t nt = 0; nt < NT; ++nt) {
        const int64_t k0 = kt * kFp8Tile, k1 = std::min(K, k0 + kFp8Tile);
        const int64_t n0 = nt * kFp8Tile, n1 = std::min(N, n0 + kFp8Tile);
        auto at = [&](int64_t k, int64_t n) { return float(w[(g * K + k) * N + n]); };
        float amax = 0.f;
        for (int64_t k = k0; k < k1; ++k)
          for (int64_t n = n0; n < n1; ++n) amax = std::max(amax, std::fabs(at(k, n)));
        const TileQuant tq(amax);
        a.scale.as<float>()[(g * KT + kt) * NT + nt] = tq.s;
        if (a.scale_t.data) a.scale_t.as<float>()[(g * NT + nt) * KT + kt] = tq.s;
        for (int64_t k = k0; k < k1; ++k)
          for (int64_t n = n0; n < n1; ++n) {
            const uint8_t v = tq(at(k, n));
            if (a.q.data) a.q.as<uint8_t>()[(g * K + k) * N + n] = v;
            if (a.q_t.data) a.q_t.as<uint8_t>()[(g * N + n) * K + k] = v;
          }
      }
}

template <class T>
void quantize_fp8_cols(const Fp8ColArgs& a) {
  const GroupWindow& w = a.window;
  const int64_t P = check_fp8_col_args(a, a.x.dtype), K = a.x.size(1), KT = fp8_tiles(K);
  // x[i][k] as a float: the activation, or an e4m3 value times its row tile's scale.
  const bool fp8_in = a.x.dtype == DType::e4m3;
  auto value = [&](int64_t i, int64_t k) {
    if (fp8_in)
      return from_e4m3(a.x.as<uint8_t>()[i * K + k]) * a.x_scale.as<float>()[i * KT + k / kFp8Tile];
    return float(a.x.as<T>()[i * K + k]);
  };
  uint8_t* q = a.q_t.as<uint8_t>();
  float* scale = a.scale.as<float>();
  int32_t* po = a.padded_offsets.as<int32_t>();
  int64_t p = 0;
  for (int g = 0; g < w.groups; ++g) {
    po[g] = int32_t(p);
    const RowRange rr = group_rows(w, g);
    const int64_t m = std::max<int64_t>(rr.end - rr.begin, 0), tiles_g = fp8_tiles(m);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t t = 0; t < tiles_g; ++t) {
        const int64_t lo = t * kFp8Tile, hi = std::min(m, lo + kFp8Tile);
        float amax = 0.f;
        for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(value(rr.begin + i, k)));
        const TileQuant tq(amax);
        scale[K * p / kFp8Tile + t * K + k] = tq.s;
        for (int64_t i = lo; i < lo + kFp8Tile; ++i)
          q[k * P + p + i] = i < hi ? tq(value(rr.begin + i, k)) : 0;
      }
    p += tiles_g * kFp8Tile;
  }
  po[w.groups] = int32_t(p);
  if (a.row_q.data) quantize_fp8_rows<T>({a.x, a.row_q, a.row_scale, {}, w});
}

MOE_ECHO_CPU_INSTANTIATE(quantize_fp8_rows, Fp8RowArgs);
MOE_ECHO_CPU_INSTANTIATE(dequantize_fp8_rows, Fp8RowArgs);
MOE_ECHO_CPU_INSTANTIATE(quantize_fp8_blocks, Fp8BlockArgs);
MOE_ECHO_CPU_INSTANTIATE(quantize_fp8_cols, Fp8ColArgs);

}  // namespace moe_echo::cpu
