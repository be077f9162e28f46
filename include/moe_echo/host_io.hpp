// Host I/O: reading and writing a backend's tensors as host doubles, for build time and tests,
// and the host's one bf16 conversion; reading and writing whole files with every failure named.
//
// Invariants: read_tensor and write_tensor synchronise the backend (never use them inside a
// step); values convert to and from the tensor's dtype, bf16 through to_bf16 / from_bf16 below.
// The file functions never fail quietly: a file that cannot be opened, written, flushed or read
// throws FileError naming the path and the system's reason (strerror), so the tools report it and
// exit non-zero (src/contract/host_files.cpp).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "moe_echo/error.hpp"

#include "moe_echo/backend.hpp"
#include "moe_echo/tensor.hpp"

namespace moe_echo {

// The tensor's elements as doubles.
std::vector<double> read_tensor(Backend& backend, const Tensor& t);
// Writes `values` (one per element) into the tensor, converted to its dtype.
void write_tensor(Backend& backend, const Tensor& t, const std::vector<double>& values);

// f32 -> bf16 bits, rounded to nearest even as __float2bfloat16_rn (a NaN stays a NaN).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// bf16 bits -> f32 (exact).
inline float from_bf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// f32 -> e4m3 (OCP E4M3FN) bits, rounded to nearest even and saturated to +-448 (infinities
// included), a NaN to 0x7F: what CUDA's __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3)
// does.
uint8_t to_e4m3(float f);
// e4m3 bits -> f32 (exact; 0x7F and 0xFF are NaN).
float from_e4m3(uint8_t b);

// ---- Files -----------------------------------------------------------------------------------

// A file that could not be read or written. what() reads "cannot write 'out/r.json': No such
// file or directory".
class FileError : public Error {
 public:
  FileError(std::string path, std::string reason, const std::string& message)
      : Error(message), path_(std::move(path)), reason_(std::move(reason)) {}
  const std::string& path() const { return path_; }
  const std::string& reason() const { return reason_; }  // strerror's text

 private:
  std::string path_, reason_;
};

// A file written piece by piece (created or truncated when constructed). Every failure, opening
// included, throws FileError; close() flushes and reports what the last writes could not store
// (a full disk shows only there). The destructor closes a file close() was not called on,
// quietly, as when an exception leaves the writer's scope.
class OutputFile {
 public:
  explicit OutputFile(std::string path);
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  void write(std::string_view bytes);
  void close();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

// Writes `bytes` as the whole content of the file at `path` (OutputFile: open, write, close).
void write_file(const std::string& path, std::string_view bytes);
// The whole content of the file at `path`; FileError when it cannot be opened or read (a folder
// included).
std::string read_file(const std::string& path);

// Checks before a run that `path` (an output file) can be written: its folder exists and is
// writable, and the path is not a folder. Throws ConfigError naming `field`
// ("json = '/no/such/r.json' is invalid: allowed a path in an existing folder ('/no/such/' is
// none)"). An empty path passes (no output asked for).
void check_output_path(const std::string& field, const std::string& path);
// The same for a folder that files will be written into: it exists, is a folder, and is writable.
void check_output_dir(const std::string& field, const std::string& dir);

}  // namespace moe_echo
