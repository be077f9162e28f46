#include "moe_echo/error.hpp"

namespace moe_echo::detail {

void fail(const char* file, int line, const std::string& message) {
  std::ostringstream s;
  s << message << " (" << file << ":" << line << ")";
  throw Error(s.str());
}

}  // namespace moe_echo::detail
