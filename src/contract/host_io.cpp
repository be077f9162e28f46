// Host I/O (moe_echo/host_io.hpp): one copy through a host staging buffer each way, converted
// element by element; the backend is synchronised before a read and after a write.
#include "moe_echo/host_io.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "moe_echo/error.hpp"

namespace moe_echo {

namespace {

// One element of type T at p, which may be unaligned (a staging buffer of any dtype).
template <class T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
void store(unsigned char* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

}  // namespace

std::vector<double> read_tensor(Backend& backend, const Tensor& t) {
  const int64_t n = t.numel();
  std::vector<unsigned char> raw(t.bytes());
  backend.synchronize();
  backend.copy_to_host(raw.data(), t.data, raw.size());
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const unsigned char* p = raw.data() + size_t(i) * dtype_size(t.dtype);
    double& v = out[size_t(i)];
    switch (t.dtype) {
      case DType::f32: v = load<float>(p); break;
      case DType::f64: v = load<double>(p); break;
      case DType::bf16: v = from_bf16(load<uint16_t>(p)); break;
      case DType::i32: v = load<int32_t>(p); break;
      case DType::e4m3: v = from_e4m3(*p); break;
    }
  }
  return out;
}

void write_tensor(Backend& backend, const Tensor& t, const std::vector<double>& values) {
  MOE_ECHO_CHECK(int64_t(values.size()) == t.numel(), values.size()
                                                          << " values for " << t.describe());
  std::vector<unsigned char> raw(t.bytes());
  for (size_t i = 0; i < values.size(); ++i) {
    unsigned char* p = raw.data() + i * dtype_size(t.dtype);
    const double v = values[i];
    switch (t.dtype) {
      case DType::f32: store(p, float(v)); break;
      case DType::f64: store(p, v); break;
      case DType::bf16: store(p, to_bf16(float(v))); break;
      case DType::i32: store(p, int32_t(v)); break;
      case DType::e4m3: *p = to_e4m3(float(v)); break;
    }
  }
  backend.copy_from_host(t.data, raw.data(), raw.size());
  backend.synchronize();
}

uint8_t to_e4m3(float f) {
  if (std::isnan(f)) return 0x7F;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (a >= 448.f) return sign | 0x7E;  // saturated: 448 = 1.75 x 2^8
  if (a == 0.f) return sign;
  // e4m3 values near a are multiples of 2^(E - 3), E = max(floor(log2 a), -6) (subnormals below
  // 2^-6 step by 2^-9); a / step is exact (a power of 2) and rounds to nearest even.
  int e = 0;
  (void)std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1)
  const int E = std::max(e - 1, -6);
  const float steps = std::nearbyint(std::ldexp(a, 3 - E));  // 8 .. 16 (normal) or 0 .. 8
  if (steps == 0.f) return sign;
  if (E == -6 && steps < 8.f) return sign | uint8_t(steps);  // subnormal: mantissa only
  // Normal: steps == 16 carried into the next binade.
  const int exp = steps == 16.f ? E + 1 : E;
  const int mant = steps == 16.f ? 0 : int(steps) - 8;
  return sign | uint8_t(((exp + 7) << 3) | mant);
}

float from_e4m3(uint8_t b) {
  const int exp = (b >> 3) & 0xF, mant = b & 0x7;
  if (exp == 0xF && mant == 0x7) return std::numeric_limits<float>::quiet_NaN();
  const float v = exp == 0 ? std::ldexp(float(mant), -9) : std::ldexp(float(8 + mant), exp - 10);
  return (b & 0x80) ? -v : v;
}

}  // namespace moe_echo
