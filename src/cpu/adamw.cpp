// AdamW with decoupled weight decay and bias correction (Loshchilov & Hutter).
#include <cmath>

#include "cpu/cpu_ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cpu {

template <class T>
void adamw(const AdamWArgs& a) {
  const int64_t n = a.param.numel();
  T* p = a.param.as<T>();
  const T* g = a.grad.as<T>();
  T* m = a.m.as<T>();
  T* v = a.v.as<T>();
  const double step = double(a.step.as<int32_t>()[0]);
  const double c1 = 1.0 - std::pow(a.beta1, step);
  const double c2 = 1.0 - std::pow(a.beta2, step);
  T* master = a.master.data ? a.master.as<T>() : nullptr;  // the CPU backend's dtypes are equal
  MOE_ECHO_CHECK(!master || (a.master.numel() == n && a.master.dtype == a.param.dtype),
                 "adamw master " << a.master.describe() << " for " << a.param.describe());
  for (int64_t i = 0; i < n; ++i) {
    const double gi = double(g[i]);
    const double mi = a.beta1 * double(m[i]) + (1.0 - a.beta1) * gi;
    const double vi = a.beta2 * double(v[i]) + (1.0 - a.beta2) * gi * gi;
    m[i] = T(mi);
    v[i] = T(vi);
    const double update = (mi / c1) / (std::sqrt(vi / c2) + a.eps);
    const T w = master ? master[i] : p[i];
    const T next = T(double(w) * (1.0 - a.lr * a.weight_decay) - a.lr * update);
    if (master) master[i] = next;
    p[i] = next;
  }
}

MOE_ECHO_CPU_INSTANTIATE(adamw, AdamWArgs);

}  // namespace moe_echo::cpu
