// Host I/O (moe_echo/host_io.hpp): one copy through a host staging buffer each way, converted
// element by element; the backend is synchronised before a read and after a write.
#include "moe_echo/host_io.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "moe_echo/error.hpp"

namespace moe_echo {

std::vector<double> read_tensor(Backend& backend, const Tensor& t) {
  const int64_t n = t.numel();
  std::vector<unsigned char> raw(t.bytes());
  backend.synchronize();
  backend.copy_to_host(raw.data(), t.data, raw.size());
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const unsigned char* p = raw.data() + size_t(i) * dtype_size(t.dtype);
    switch (t.dtype) {
      case DType::f32: {
        float v;
        std::memcpy(&v, p, 4);
        out[size_t(i)] = v;
        break;
      }
      case DType::f64: {
        double v;
        std::memcpy(&v, p, 8);
        out[size_t(i)] = v;
        break;
      }
      case DType::bf16: {
        uint16_t v;
        std::memcpy(&v, p, 2);
        out[size_t(i)] = from_bf16(v);
        break;
      }
      case DType::i32: {
        int32_t v;
        std::memcpy(&v, p, 4);
        out[size_t(i)] = v;
        break;
      }
      case DType::e4m3: out[size_t(i)] = from_e4m3(*p); break;
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
    switch (t.dtype) {
      case DType::f32: {
        const float v = float(values[i]);
        std::memcpy(p, &v, 4);
        break;
      }
      case DType::f64: {
        std::memcpy(p, &values[i], 8);
        break;
      }
      case DType::bf16: {
        const uint16_t v = to_bf16(float(values[i]));
        std::memcpy(p, &v, 2);
        break;
      }
      case DType::i32: {
        const int32_t v = int32_t(values[i]);
        std::memcpy(p, &v, 4);
        break;
      }
      case DType::e4m3: *p = to_e4m3(float(values[i])); break;
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
