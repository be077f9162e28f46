// Fuzz target: the routing-trace reader (TraceFile::parse_csv and parse_json). Any input either
// parses into a trace whose every map can be read back, or throws moe_echo::ConfigError naming
// the file; anything else (another exception, a crash, a sanitizer finding, a run past the
// memory limit) is a finding. The first byte picks the format and the expert count asked for.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "moe_echo/error.hpp"
#include "moe_echo/trace.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool json = data[0] & 1;
  const int experts = (data[0] >> 1) % 8 == 0 ? 0 : (data[0] >> 1) % 64;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  using moe_echo::offline::TraceFile;
  try {
    const TraceFile t = json ? TraceFile::parse_json(text, "fuzz.json", experts)
                             : TraceFile::parse_csv(text, "fuzz.csv", experts);
    // A trace that parsed is read whole, as the simulator reads it.
    const int ranks = 1 + int(size % 4);
    std::vector<int32_t> map(size_t(ranks) * size_t(t.experts()));
    for (int l = 0; l < t.layers(); ++l) {
      auto stream = t.open_layer(l, ranks);
      for (int s = 0; s < t.steps(); ++s) stream->next(map.data());
    }
  } catch (const moe_echo::ConfigError&) {
  }
  return 0;
}
