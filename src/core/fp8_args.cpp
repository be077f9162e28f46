// Checks of the FP8 argument structs that every backend makes the same way (backend.hpp).
#include "moe_echo/backend.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo {

int64_t check_fp8_col_args(const Fp8ColArgs& a, DType x_dtype) {
  const GroupWindow& w = a.window;
  check_tensor(a.x, "quantize_fp8_cols x", x_dtype, {-1, -1});
  const int64_t K = a.x.size(1);
  MOE_ECHO_CHECK(a.x.size(0) >= w.rows,
                 "quantize_fp8_cols: x " << a.x.describe() << " for " << w.rows << " window rows");
  MOE_ECHO_CHECK(
      w.groups >= 0 && (w.groups == 0 || w.group_offsets),
      "quantize_fp8_cols: window of " << w.groups << " groups, offsets " << w.group_offsets);
  check_tensor(a.q_t, "quantize_fp8_cols q_t", DType::e4m3, {K, -1});
  const int64_t P = a.q_t.size(1);
  MOE_ECHO_CHECK(P % kFp8Tile == 0 && P >= fp8_padded_rows(w.rows, w.groups),
                 "quantize_fp8_cols: q_t " << a.q_t.describe()
                                           << " needs a multiple of 128 columns, at least "
                                           << fp8_padded_rows(w.rows, w.groups));
  check_tensor(a.scale, "quantize_fp8_cols scale", DType::f32, {K * P / kFp8Tile});
  check_tensor(a.padded_offsets, "quantize_fp8_cols padded_offsets", DType::i32,
               {int64_t(w.groups) + 1});
  return P;
}

}  // namespace moe_echo
