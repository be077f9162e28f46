// Helpers of the CUDA backend tests: GPU detection (tests skip without one), tensors owned by a
// backend, bf16 rounding of host values (inputs are rounded to bf16 first, so the CPU reference
// and the GPU see the same numbers), poison values and relative-norm checks.
//
// Tolerances (relative norm ||gpu - cpu|| / ||cpu||, the CPU reference in f32 with double sums):
//   kF32Tol   f32 outputs of f32 math (router logits, scores, weights, gradients of f32 params)
//   kBf16Tol  one rounding to bf16 of an f32 result: 2^-9 per element at most (~2e-3), plus
//             f32 accumulation differences
//   kLayerTol the whole layer: bf16 intermediates (h, a, dy rows) rounded once more each
//   kFp8LayerTol the layer in precision fp8 against the CPU's FP8 layer: an intermediate one
//             bf16 ulp apart may quantize to the neighbouring e4m3 code (1/16 relative)
// Integers (routes, counts, offsets, layouts, plans) must match exactly.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cuda/cuda_backend.hpp"
#include "moe_echo/backends.hpp"
#include "moe_echo/host_io.hpp"
#include "test_util.hpp"

namespace moe_echo::test {

constexpr double kF32Tol = 2e-5;
constexpr double kBf16Tol = 6e-3;
constexpr double kLayerTol = 2e-2;
constexpr double kFp8LayerTol = 3e-2;

#define MOE_ECHO_SKIP_WITHOUT_GPU() \
  if (!::moe_echo::cuda_backend_available()) GTEST_SKIP() << "no CUDA device visible"

inline double round_bf16(double v) { return double(from_bf16(to_bf16(float(v)))); }
inline std::vector<double> round_bf16(std::vector<double> v) {
  for (auto& x : v) x = round_bf16(x);
  return v;
}
inline std::vector<double> round_f32(std::vector<double> v) {
  for (auto& x : v) x = double(float(x));
  return v;
}

// A tensor allocated on a backend, freed with it.
class OwnedTensor {
 public:
  OwnedTensor(Backend& be, DType dt, std::initializer_list<int64_t> dims)
      : be_(&be), t_(nullptr, dt, dims) {
    t_.data = be.allocate(t_.bytes());
  }
  ~OwnedTensor() {
    if (t_.data) be_->deallocate(t_.data);
  }
  OwnedTensor(const OwnedTensor&) = delete;
  OwnedTensor& operator=(const OwnedTensor&) = delete;
  OwnedTensor(OwnedTensor&& o) noexcept : be_(o.be_), t_(o.t_) { o.t_.data = nullptr; }

  const Tensor& operator*() const { return t_; }
  const Tensor* operator->() const { return &t_; }
  void write(const std::vector<double>& v) const { write_tensor(*be_, t_, v); }
  std::vector<double> read() const { return read_tensor(*be_, t_); }
  void fill(double v) const { write(std::vector<double>(size_t(t_.numel()), v)); }

 private:
  Backend* be_;
  Tensor t_;
};

// A value no kernel writes: NaN for floating-point tensors, a large negative for i32.
constexpr double kPoisonInt = -77777;
inline void poison(const OwnedTensor& t) {
  t.fill(t->dtype == DType::i32 ? kPoisonInt : std::nan(""));
}
inline bool all_finite(const std::vector<double>& v) {
  for (double x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

inline std::vector<int32_t> to_i32(const std::vector<double>& v) {
  return std::vector<int32_t>(v.begin(), v.end());
}

}  // namespace moe_echo::test
