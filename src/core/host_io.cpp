// Host I/O (moe_echo/host_io.hpp): one copy through a host staging buffer each way, converted
// element by element; the backend is synchronised before a read and after a write.
#include "moe_echo/host_io.hpp"

#include <cstring>

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
    }
  }
  backend.copy_from_host(t.data, raw.data(), raw.size());
  backend.synchronize();
}

}  // namespace moe_echo
