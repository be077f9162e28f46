// Non-owning views of contiguous, row-major device (or host) memory.
//
// A Tensor never owns its memory: buffers are allocated once, when a layer is built, by the
// backend's allocator and carved into views. Shapes are host values; everything that depends on
// routing (group sizes, valid rows) lives in device memory and is read by the kernels.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace moe_echo {

// e4m3: OCP FP8 E4M3FN (1 byte; 4 exponent bits, 3 mantissa bits, largest finite 448, no
// infinities), the storage of blockwise-quantized tensors (backend.hpp, quantize_fp8_*).
enum class DType : uint8_t { f32, f64, bf16, i32, e4m3 };

size_t dtype_size(DType t);
const char* to_string(DType t);

// The stream a per-step op runs on (cudaStream_t on the CUDA backend; ignored on the CPU).
using Stream = void*;

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  std::array<int64_t, 4> shape{0, 0, 0, 0};

  Tensor() = default;
  Tensor(void* d, DType t, std::initializer_list<int64_t> dims);

  int64_t size(int dim) const { return shape[size_t(dim)]; }
  int64_t numel() const;
  size_t bytes() const { return size_t(numel()) * dtype_size(dtype); }
  // Elements in one index of dimension 0 (the "row" of a matrix, one expert of a [G,K,N] stack).
  int64_t row_numel() const;
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
  // Rows [lo, lo + n) of dimension 0, as a view.
  Tensor rows(int64_t lo, int64_t n) const;
  std::string describe() const;  // "f32[4096, 2048]"
};

// Throws moe_echo::Error naming `what` unless t has dtype `dt` and the given shape
// (a -1 entry matches any extent).
void check_tensor(const Tensor& t, const char* what, DType dt, std::initializer_list<int64_t> dims);

}  // namespace moe_echo
