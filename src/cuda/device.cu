// Device queries and the error helpers shared by every CUDA file.
#include <cuda_runtime.h>

#include <mutex>
#include <sstream>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/cuda_backend.hpp"

namespace moe_echo::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: clear the sticky error
    return 0;
  }
  return n;
}

int current_device() {
  int device = 0;
  MOE_ECHO_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

int sm_count() {
  static std::mutex mu;
  static std::vector<int> cached;  // per device, 0 = not read yet
  int device = 0;
  MOE_ECHO_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  if (int(cached.size()) <= device) cached.resize(size_t(device) + 1, 0);
  if (cached[size_t(device)] == 0)
    MOE_ECHO_CUDA_CHECK(
        cudaDeviceGetAttribute(&cached[size_t(device)], cudaDevAttrMultiProcessorCount, device));
  return cached[size_t(device)];
}

namespace detail {

void throw_cuda_error(cudaError_t code, const char* what, const char* file, int line) {
  // Reported here: clear it, so that a later launch check does not report it again (a failed
  // allocation leaves its error behind for cudaGetLastError).
  (void)cudaGetLastError();
  std::ostringstream s;
  s << "CUDA error " << cudaGetErrorName(code) << " (" << cudaGetErrorString(code) << ") in "
    << what;
  ::moe_echo::detail::fail(file, line, s.str());
}

void check_launch(const char* kernel_name) {
  const cudaError_t code = cudaGetLastError();
  if (code != cudaSuccess) {
    std::ostringstream s;
    s << "launch of " << kernel_name;
    throw_cuda_error(code, s.str().c_str(), __FILE__, __LINE__);
  }
}

}  // namespace detail
}  // namespace moe_echo::cuda
