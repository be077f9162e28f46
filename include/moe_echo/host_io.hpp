// Host I/O: reading and writing a backend's tensors as host doubles, for build time and tests.
//
// Invariants: both calls synchronise the backend (never use them inside a step); values convert
// to and from the tensor's dtype, bf16 rounding to nearest even.
#pragma once

#include <vector>

#include "moe_echo/backend.hpp"
#include "moe_echo/tensor.hpp"

namespace moe_echo {

// The tensor's elements as doubles.
std::vector<double> read_tensor(Backend& backend, const Tensor& t);
// Writes `values` (one per element) into the tensor, converted to its dtype.
void write_tensor(Backend& backend, const Tensor& t, const std::vector<double>& values);

}  // namespace moe_echo
