// SwiGLU over the valid rows of the receive window only: a = silu(gate) * up with h = gate | up.
#include <cmath>

#include "cpu/cpu_ops.hpp"

namespace moe_echo::cpu {
namespace {
double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }
}  // namespace

template <class T>
void swiglu_forward(const SwigluArgs& a) {
  if (a.a_q.data || a.a_scale.data)
    check_fp8_row_args({a.a, a.a_q, a.a_scale, {}, a.window}, a.a.dtype);
  const int64_t F = a.a.size(1), rows = valid_rows(a.window);
  for (int64_t i = 0; i < rows; ++i) {
    const T* h = a.h.as<T>() + i * 2 * F;
    T* out = a.a.as<T>() + i * F;
    for (int64_t f = 0; f < F; ++f) {
      const double gate = double(h[f]), up = double(h[F + f]);
      out[f] = T(gate * sigmoid(gate) * up);
    }
  }
  if (a.a_q.data) quantize_fp8_rows<T>({a.a, a.a_q, a.a_scale, {}, a.window});
}

template <class T>
void swiglu_backward(const SwigluArgs& a) {
  const int64_t F = a.da.size(1), rows = valid_rows(a.window);
  for (int64_t i = 0; i < rows; ++i) {
    const T* h = a.h.as<T>() + i * 2 * F;
    const T* da = a.da.as<T>() + i * F;
    T* dh = a.dh.as<T>() + i * 2 * F;
    for (int64_t f = 0; f < F; ++f) {
      const double gate = double(h[f]), up = double(h[F + f]), sg = sigmoid(gate);
      const double silu = gate * sg;
      dh[f] = T(double(da[f]) * up * sg * (1.0 + gate * (1.0 - sg)));
      dh[F + f] = T(double(da[f]) * silu);
    }
  }
}

MOE_ECHO_CPU_INSTANTIATE(swiglu_forward, SwigluArgs);
MOE_ECHO_CPU_INSTANTIATE(swiglu_backward, SwigluArgs);

}  // namespace moe_echo::cpu
