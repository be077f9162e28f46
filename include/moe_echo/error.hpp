// One error family for the whole library.
//
// Library code never exits or aborts on bad input: it throws moe_echo::Error (internal invariant
// or runtime failure, with file and line) or moe_echo::ConfigError (a user-facing validation error
// whose message names the parameter, its value and what is allowed). Status codes appear only at
// the boundaries (CLI exit codes, the Python binding).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moe_echo {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A parameter outside its allowed range. `what()` reads like
// "top_k = 0 is invalid: allowed 1 <= top_k <= experts (16)".
class ConfigError : public Error {
 public:
  ConfigError(std::string field, std::string message) : Error(message), field_(std::move(field)) {}
  const std::string& field() const { return field_; }

 private:
  std::string field_;
};

// The device (or host) could not give a buffer: `what()` says how many bytes were asked for and
// how many were free. The Python binding raises MemoryError for it (the PyTorch module
// torch.OutOfMemoryError).
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

// Throws ConfigError(field, "<field> = <value> is invalid: allowed <allowed>"). Quote string
// values by passing them as "'" + s + "'".
template <class V>
[[noreturn]] void reject(const std::string& field, const V& value, const std::string& allowed) {
  std::ostringstream s;
  s << field << " = " << value << " is invalid: allowed " << allowed;
  throw ConfigError(field, s.str());
}

namespace detail {
[[noreturn]] void fail(const char* file, int line, const std::string& message);
}  // namespace detail

}  // namespace moe_echo

// Throws moe_echo::Error with file, line and a streamed message when `cond` is false.
#define MOE_ECHO_CHECK(cond, msg)                                                 \
  do {                                                                            \
    if (!(cond)) {                                                                \
      std::ostringstream moe_echo_check_stream_;                                  \
      moe_echo_check_stream_ << "check failed: " #cond ": " << msg;               \
      ::moe_echo::detail::fail(__FILE__, __LINE__, moe_echo_check_stream_.str()); \
    }                                                                             \
  } while (0)

// The body of the checks of a library's status codes (MOE_ECHO_CUDA_CHECK in cuda_check.hpp,
// MOE_ECHO_NCCL_CHECK in nccl_check.hpp): evaluates `call` once and, unless it returns `ok`, calls
// `thrower(status, what, __FILE__, __LINE__)`, which names the code and throws moe_echo::Error.
#define MOE_ECHO_STATUS_CHECK(Status, ok, thrower, call, what)                         \
  do {                                                                                 \
    const Status moe_echo_status_ = (call);                                            \
    if (moe_echo_status_ != (ok)) thrower(moe_echo_status_, what, __FILE__, __LINE__); \
  } while (0)
