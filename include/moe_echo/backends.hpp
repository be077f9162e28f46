// Backend factories.
#pragma once

#include <memory>
#include <string>

#include "moe_echo/backend.hpp"

namespace moe_echo {

// The CPU reference backend: plain loops, every tensor in `dtype` (f32, or f64 for gradient
// checks), accumulation in double.
std::unique_ptr<Backend> make_cpu_backend(DType dtype = DType::f32);

// True when this build has the CUDA backend and a GPU is visible.
bool cuda_backend_available();

// "cpu", or "auto" (the GPU when there is one, else the CPU). Throws ConfigError otherwise.
std::unique_ptr<Backend> make_backend(const std::string& name);

}  // namespace moe_echo
