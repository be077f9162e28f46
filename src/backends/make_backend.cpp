// Backend selection: "auto" takes the GPU when this build has the CUDA backend and a GPU is
// visible, the CPU otherwise. This folder sits above both backends (src/cpu, src/cuda) and is the
// only library code that names them both; nothing below it includes it.
#include "moe_echo/backends.hpp"
#include "moe_echo/error.hpp"

#ifdef MOE_ECHO_WITH_CUDA
#include "cuda/cuda_backend.hpp"
#endif

namespace moe_echo {

bool cuda_backend_available() {
#ifdef MOE_ECHO_WITH_CUDA
  return cuda::device_count() > 0;
#else
  return false;
#endif
}

std::unique_ptr<Backend> make_backend(const std::string& name) {
  if (name == "cpu") return make_cpu_backend(DType::f32);
#ifdef MOE_ECHO_WITH_CUDA
  if (name == "cuda" || (name == "auto" && cuda_backend_available())) {
    if (!cuda_backend_available())
      throw ConfigError("backend",
                        "backend = 'cuda' is invalid here: no GPU is visible; allowed auto or cpu");
    return cuda::make_cuda_backend();
  }
#endif
  if (name == "auto") return make_cpu_backend(DType::f32);
  reject("backend", "'" + name + "'",
         cuda_backend_available() ? "auto, cpu or cuda" : "auto or cpu");
}

}  // namespace moe_echo
