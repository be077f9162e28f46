// Checks of the FP8 and chunk-plan argument structs that every backend makes the same way
// (backend.hpp).
#include "moe_echo/backend.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo {
namespace {

// A window's groups: a count and, when there are any, their offsets.
void check_window_groups(const GroupWindow& w, const char* op) {
  MOE_ECHO_CHECK(w.groups >= 0 && (w.groups == 0 || w.group_offsets),
                 op << ": window of " << w.groups << " groups, offsets " << w.group_offsets);
}

}  // namespace

int64_t check_fp8_col_args(const Fp8ColArgs& a, DType x_dtype) {
  const GroupWindow& w = a.window;
  const bool fp8_in = a.x.data != nullptr && a.x.dtype == DType::e4m3;
  check_tensor(a.x, "quantize_fp8_cols x", fp8_in ? DType::e4m3 : x_dtype, {-1, -1});
  const int64_t K = a.x.size(1);
  MOE_ECHO_CHECK(a.x.size(0) >= w.rows,
                 "quantize_fp8_cols: x " << a.x.describe() << " for " << w.rows << " window rows");
  if (fp8_in)
    check_tensor(a.x_scale, "quantize_fp8_cols x_scale (of an e4m3 x)", DType::f32,
                 {a.x.size(0), fp8_tiles(K)});
  else
    MOE_ECHO_CHECK(a.x_scale.data == nullptr, "quantize_fp8_cols: x_scale "
                                                  << a.x_scale.describe() << " given for an x of "
                                                  << to_string(a.x.dtype)
                                                  << " (only e4m3 x has one)");
  check_window_groups(w, "quantize_fp8_cols");
  check_tensor(a.q_t, "quantize_fp8_cols q_t", DType::e4m3, {K, -1});
  const int64_t P = a.q_t.size(1);
  MOE_ECHO_CHECK(P % kFp8Tile == 0 && P >= fp8_padded_rows(w.rows, w.groups),
                 "quantize_fp8_cols: q_t " << a.q_t.describe()
                                           << " needs a multiple of 128 columns, at least "
                                           << fp8_padded_rows(w.rows, w.groups));
  check_tensor(a.scale, "quantize_fp8_cols scale", DType::f32, {K * P / kFp8Tile});
  check_tensor(a.padded_offsets, "quantize_fp8_cols padded_offsets", DType::i32,
               {int64_t(w.groups) + 1});
  if (a.row_q.data || a.row_scale.data) {
    MOE_ECHO_CHECK(!fp8_in, "quantize_fp8_cols: row_q " << a.row_q.describe()
                                                        << " for an e4m3 x (rows of an "
                                                           "activation-dtype x only)");
    check_tensor(a.row_q, "quantize_fp8_cols row_q", DType::e4m3, {-1, K});
    MOE_ECHO_CHECK(a.row_q.size(0) >= w.rows, "quantize_fp8_cols: row_q " << a.row_q.describe()
                                                                          << " for " << w.rows
                                                                          << " window rows");
    check_tensor(a.row_scale, "quantize_fp8_cols row_scale", DType::f32,
                 {a.row_q.size(0), fp8_tiles(K)});
  }
  return P;
}

int64_t check_fp8_row_args(const Fp8RowArgs& a, DType x_dtype) {
  check_tensor(a.x, "quantize_fp8_rows x", x_dtype, {-1, -1});
  const int64_t rows = a.x.size(0), K = a.x.size(1), KT = fp8_tiles(K);
  if (a.packed.data) {
    MOE_ECHO_CHECK(a.q.data == nullptr && a.scale.data == nullptr,
                   "quantize_fp8_rows: packed " << a.packed.describe()
                                                << " given with q or scale (one or the other)");
    check_tensor(a.packed, "quantize_fp8_rows packed", DType::e4m3,
                 {rows, fp8_packed_row_bytes(K)});
    MOE_ECHO_CHECK(reinterpret_cast<uintptr_t>(a.packed.data) % 16 == 0,
                   "quantize_fp8_rows: packed at " << a.packed.data << " must be 16-byte aligned");
  } else {
    check_tensor(a.q, "quantize_fp8_rows q", DType::e4m3, {rows, K});
    check_tensor(a.scale, "quantize_fp8_rows scale", DType::f32, {rows, KT});
  }
  if (a.window.group_offsets || a.window.groups) {
    check_window_groups(a.window, "quantize_fp8_rows");
    MOE_ECHO_CHECK(a.window.rows >= 0 && a.window.row_lo >= 0 && rows >= a.window.rows,
                   "quantize_fp8_rows: x " << a.x.describe() << " for a window of " << a.window.rows
                                           << " rows from row " << a.window.row_lo);
  }
  return KT;
}

int64_t check_fp8_dequant_args(const Fp8RowArgs& a, DType x_dtype) {
  MOE_ECHO_CHECK(a.packed.data == nullptr,
                 "dequantize_fp8_rows reads q and scale, not packed rows");
  return check_fp8_row_args(a, x_dtype);
}

void check_fp8_block_args(const Fp8BlockArgs& a, DType w_dtype) {
  check_tensor(a.w, "quantize_fp8_blocks w", w_dtype, {-1, -1, -1});
  const int64_t G = a.w.size(0), K = a.w.size(1), N = a.w.size(2), KT = fp8_tiles(K),
                NT = fp8_tiles(N);
  check_tensor(a.scale, "quantize_fp8_blocks scale", DType::f32, {G, KT, NT});
  if (a.q.data) check_tensor(a.q, "quantize_fp8_blocks q", DType::e4m3, {G, K, N});
  if (a.q_t.data) check_tensor(a.q_t, "quantize_fp8_blocks q_t", DType::e4m3, {G, N, K});
  if (a.scale_t.data)
    check_tensor(a.scale_t, "quantize_fp8_blocks scale_t", DType::f32, {G, NT, KT});
}

int64_t check_fp8_fan_args(const Fp8FanArgs& a) {
  check_tensor(a.q, "fan_out_fp8 q", DType::e4m3, {-1, -1});
  const int64_t rows = a.window.rows, H = a.q.size(1), HT = fp8_tiles(H);
  MOE_ECHO_CHECK(a.q.size(0) >= rows,
                 "fan_out_fp8: q " << a.q.describe() << " for " << rows << " window rows");
  check_tensor(a.scale, "fan_out_fp8 scale", DType::f32, {a.q.size(0), HT});
  check_tensor(a.src, "fan_out_fp8 src", DType::e4m3, {-1, fp8_packed_row_bytes(H)});
  MOE_ECHO_CHECK(a.src.size(0) >= rows,
                 "fan_out_fp8: src " << a.src.describe() << " for " << rows << " window rows");
  MOE_ECHO_CHECK(
      a.members.dtype == DType::i32 && a.members.ndim == 2 && a.members.size(0) >= rows &&
          a.members.size(1) >= 1,
      "fan_out_fp8: members must be i32 [>= " << rows << ", K], got " << a.members.describe());
  check_window_groups(a.window, "fan_out_fp8");
  return HT;
}

void check_chunk_plan(const ChunkPlanArgs& a) {
  check_tensor(a.rank_rows, "chunk_plan rank_rows", DType::i32, {-1});
  check_tensor(a.group_offsets, "chunk_plan group_offsets", DType::i32, {-1});
  const int64_t R = a.rank_rows.size(0), G1 = a.group_offsets.size(0);
  check_tensor(a.bounds, "chunk_plan bounds", DType::i32, {R, -1});
  const int64_t C = a.bounds.size(1) - 1;
  MOE_ECHO_CHECK(C >= 1 && C <= kMaxChunks, "chunk_plan: bounds " << a.bounds.describe() << " give "
                                                                  << C << " chunks; allowed 1 to "
                                                                  << kMaxChunks);
  check_tensor(a.offsets, "chunk_plan offsets", DType::i32, {C, G1});
  MOE_ECHO_CHECK(a.rank >= 0 && a.rank < R, "chunk_plan: rank " << a.rank << " of " << R);
  MOE_ECHO_CHECK(a.row_lo >= 0 && a.capacity >= 0,
                 "chunk_plan: row_lo " << a.row_lo << ", capacity " << a.capacity);
}

}  // namespace moe_echo
