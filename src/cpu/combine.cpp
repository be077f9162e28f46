// Combine: y[t] = sum_k weight[t,k] * gathered[t*K + k], and its backward. The rows come back to
// their source rank first (Communicator::combine); this is the local weighted sum.
#include <vector>

#include "cpu/cpu_ops.hpp"

namespace moe_echo::cpu {

template <class T>
void combine_forward(const CombineArgs& a) {
  const int64_t T_ = a.y.size(0), H = a.y.size(1);
  const int64_t K = T_ > 0 ? a.gathered.size(0) / T_ : 0;
  const bool weighted = a.weight.data != nullptr;
  std::vector<double> acc(static_cast<size_t>(H));
  for (int64_t t = 0; t < T_; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t k = 0; k < K; ++k) {
      const double w = weighted ? double(a.weight.as<T>()[t * K + k]) : 1.0;
      const T* row = a.gathered.as<T>() + (t * K + k) * H;
      for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += w * double(row[h]);
    }
    T* y = a.y.as<T>() + t * H;
    for (int64_t h = 0; h < H; ++h) y[h] = T(acc[size_t(h)]);
  }
}

template <class T>
void combine_backward(const CombineBackwardArgs& a) {
  const int64_t T_ = a.dy.size(0), H = a.dy.size(1);
  const int64_t K = T_ > 0 ? a.gathered.size(0) / T_ : 0;
  for (int64_t t = 0; t < T_; ++t) {
    const T* dy = a.dy.as<T>() + t * H;
    for (int64_t k = 0; k < K; ++k) {
      const double w = double(a.weight.as<T>()[t * K + k]);
      const T* row = a.gathered.as<T>() + (t * K + k) * H;
      T* drow = a.d_gathered.as<T>() + (t * K + k) * H;
      double dot = 0;
      for (int64_t h = 0; h < H; ++h) {
        dot += double(dy[h]) * double(row[h]);
        drow[h] = T(w * double(dy[h]));
      }
      a.d_weight.as<T>()[t * K + k] = T(dot);
    }
  }
}

template void combine_forward<float>(const CombineArgs&);
template void combine_forward<double>(const CombineArgs&);
template void combine_backward<float>(const CombineBackwardArgs&);
template void combine_backward<double>(const CombineBackwardArgs&);

}  // namespace moe_echo::cpu
