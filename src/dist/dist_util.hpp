// What the bootstrap's pieces (src/dist/*.cpp) share: little-endian u64 framing, the steady
// clock in nanoseconds, and the way a watching thread ends the process.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "moe_echo/dist.hpp"

namespace moe_echo::dist_util {

inline void put_u64(Bytes& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(uint8_t(v >> (8 * i)));
}

inline uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Writes the first `length` bytes of `message` (formatted by the caller into a local buffer of
// `capacity` bytes, snprintf's return as length) to stderr with one write(2), then _exit with
// Watchdog::kExitCode: no allocation and no stream lock that a stuck thread might hold, and no
// destructors, since teardown may block on the very wait that is stuck.
[[noreturn]] inline void end_process(const char* message, int length, size_t capacity) {
  if (length > 0) {
    const size_t bytes = std::min(size_t(length), capacity - 1);
    [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, message, bytes);
  }
  ::_exit(Watchdog::kExitCode);
}

}  // namespace moe_echo::dist_util
