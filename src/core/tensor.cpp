#include "moe_echo/tensor.hpp"

#include <sstream>

#include "moe_echo/error.hpp"

namespace moe_echo {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::e4m3: return 1;
  }
  return 0;
}

const char* to_string(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::e4m3: return "e4m3";
  }
  return "?";
}

Tensor::Tensor(void* d, DType t, std::initializer_list<int64_t> dims) : data(d), dtype(t) {
  MOE_ECHO_CHECK(dims.size() <= shape.size(), "at most 4 dimensions, got " << dims.size());
  for (int64_t v : dims) {
    MOE_ECHO_CHECK(v >= 0, "negative extent " << v);
    shape[size_t(ndim++)] = v;
  }
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[size_t(i)];
  return n;
}

int64_t Tensor::row_numel() const {
  int64_t n = 1;
  for (int i = 1; i < ndim; ++i) n *= shape[size_t(i)];
  return n;
}

Tensor Tensor::rows(int64_t lo, int64_t n) const {
  MOE_ECHO_CHECK(ndim >= 1 && lo >= 0 && n >= 0 && lo + n <= shape[0],
                 "rows [" << lo << ", " << lo + n << ") outside " << describe());
  Tensor t = *this;
  t.data = static_cast<char*>(data) + size_t(lo) * size_t(row_numel()) * dtype_size(dtype);
  t.shape[0] = n;
  return t;
}

std::string Tensor::describe() const {
  std::ostringstream s;
  s << to_string(dtype) << "[";
  for (int i = 0; i < ndim; ++i) s << (i ? ", " : "") << shape[size_t(i)];
  s << "]";
  return s.str();
}

void check_tensor(const Tensor& t, const char* what, DType dt,
                  std::initializer_list<int64_t> dims) {
  bool ok = t.dtype == dt && t.ndim == int(dims.size());
  int i = 0;
  for (int64_t v : dims) {
    if (ok && v >= 0 && t.shape[size_t(i)] != v) ok = false;
    ++i;
  }
  if (!ok) {
    std::ostringstream want;
    want << to_string(dt) << "[";
    i = 0;
    for (int64_t v : dims) {
      want << (i++ ? ", " : "");
      if (v < 0)
        want << "*";
      else
        want << v;
    }
    want << "]";
    MOE_ECHO_CHECK(false, what << " must be " << want.str() << ", got " << t.describe());
  }
  MOE_ECHO_CHECK(t.data != nullptr || t.numel() == 0, what << " has no data");
}

}  // namespace moe_echo
