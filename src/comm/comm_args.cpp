// The communicators' argument checks (comm_args.hpp).
#include "comm/comm_args.hpp"

#include <algorithm>
#include <string>

#include "moe_echo/config.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::comm_args {
namespace {

bool contains(DTypes dtypes, DType d) {
  return std::find(dtypes.begin(), dtypes.end(), d) != dtypes.end();
}

// "f32", "f32 or f64", "bf16, f32 or f64".
std::string describe(DTypes dtypes) {
  std::string s;
  size_t i = 0;
  for (DType d : dtypes) {
    if (i > 0) s += i + 1 == dtypes.size() ? " or " : ", ";
    s += to_string(d);
    ++i;
  }
  return s;
}

}  // namespace

void check_route(const char* op, const RowRoute& route, RoundWindow win, const FanTable& fan,
                 DTypes fan_dtypes) {
  MOE_ECHO_CHECK(
      route.top_k >= 1 && route.top_k <= kMaxTopK && route.n >= 0 && route.n % route.top_k == 0,
      op << ": route of " << route.n << " entries, top_k " << route.top_k << "; allowed top_k 1 to "
         << kMaxTopK << ", dividing the entries");
  const RowChunks& c = route.chunks;
  MOE_ECHO_CHECK(!c.bounds || (c.chunks >= 1 && c.chunk >= 0 && c.chunk < c.chunks),
                 op << ": route chunk " << c.chunk << " of " << c.chunks
                    << " chunks; allowed chunks >= 1 and chunk 0 to chunks - 1");
  MOE_ECHO_CHECK(win.row_lo >= 0 && win.rows >= 0, op << ": window of rows " << win.row_lo << " + "
                                                      << win.rows
                                                      << "; allowed row_lo >= 0 and rows >= 0");
  MOE_ECHO_CHECK(fan.top_k == route.top_k, op << ": fan table of top_k " << fan.top_k
                                              << " for a route of top_k " << route.top_k);
  MOE_ECHO_CHECK(contains(fan_dtypes, fan.float_dtype), op << ": fan table float dtype "
                                                           << to_string(fan.float_dtype)
                                                           << "; allowed " << describe(fan_dtypes));
}

void check_combine_rows(const RowRoute& route, const Tensor& y, DTypes dtypes) {
  MOE_ECHO_CHECK(contains(dtypes, y.dtype) && y.ndim == 2 && y.size(0) * route.top_k == route.n,
                 "combine: y " << y.describe() << " for " << route.n << " entries of top_k "
                               << route.top_k << "; allowed " << describe(dtypes)
                               << " [entries / top_k, H]");
}

void check_window_fits(const char* op, RoundWindow win, const SymmetricBuffer& rows_buf,
                       size_t row_bytes, const FanTable& fan) {
  const size_t rows = size_t(win.rows), K = size_t(fan.top_k), fl = dtype_size(fan.float_dtype);
  struct Need {
    const char* buffer;
    size_t bytes, have;
  };
  const Need needs[] = {{"rows", rows * row_bytes, rows_buf.bytes},
                        {"fan members", rows * K * sizeof(int32_t), fan.members.bytes},
                        {"fan weights", rows * K * fl, fan.weights.bytes},
                        {"fan values", rows * fl, fan.values.bytes}};
  for (const Need& n : needs)
    MOE_ECHO_CHECK(n.bytes <= n.have, op << ": a window of " << win.rows
                                         << " rows does not fit the symmetric buffers: " << n.buffer
                                         << " needs " << n.bytes << " bytes, has " << n.have);
}

void check_sum_dtype(const char* op, DType dtype) {
  MOE_ECHO_CHECK(dtype == DType::f32 || dtype == DType::f64,
                 op << " supports f32 and f64, not " << to_string(dtype));
}

void check_plan(const char* op, const PlannerConfig& cfg, int ranks) {
  MOE_ECHO_CHECK(cfg.ranks == ranks && cfg.experts >= ranks && cfg.experts % ranks == 0 &&
                     cfg.spare_slots >= 0 && cfg.max_clones >= 0,
                 op << ": plan of " << cfg.ranks << " ranks, " << cfg.experts << " experts, "
                    << cfg.spare_slots << " spare slots, " << cfg.max_clones
                    << " clones on a communicator of " << ranks << " ranks");
}

}  // namespace moe_echo::comm_args
