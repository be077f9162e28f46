// The routed experts' GEMMs in one place: fprop, dgrad and wgrad of fc1 and fc2 over a window,
// bf16 or FP8 as the schedule's op says (step::Form: which operands are quantized here, which
// were quantized before), home slots from the layer's weights and spare slots (clones) from the
// echo slots, with the e4m3 copies of both in FP8.
//
// fp8_operand: the first `rows` rows of an e4m3 [R, W] buffer (or its [R, tiles(W)] scales)
// viewed as [rows, cols] (a contiguous prefix: the FP8 operands of one GEMM, packed).
#pragma once

#include "layer/buffers.hpp"
#include "layer/schedule.hpp"
#include "moe_echo/backend.hpp"

namespace moe_echo {

Tensor fp8_operand(const Tensor& buffer, int64_t rows, int64_t cols);

struct ExpertGemms {
  Backend& backend;
  const LayerTensors& w;
  const StepPart& p;
  int home_slots, slots;  // experts per rank, and with the echo slots

  // c = a @ w (fprop) or a @ w^T (dgrad) of fc (1 or 2). `form`: plain; quantize (a's rows
  // first); quantized (a's rows in the row operand already); received (a is recv_xq with
  // a_scale); with_cols (dgrad: a's rows and its columns for the next wgrad).
  void rows(const GroupWindow& gw, int fc, step::Pass pass, step::Form form, const Tensor& a,
            const Tensor& a_scale, const Tensor& c, Stream s) const;
  // fc's weight gradient a^T b over the window into `home` (the home slots) and the echo slots'
  // gradients, written or added (writing, home slots with no rows are zeroed, and with
  // `zero_clone_slots` clone slots too). `form`: plain; quantize (both operands' columns first; a
  // may be e4m3 with its row scales a_scale); cols_ready (b's columns from the dgrad's with_cols).
  void wgrad(const GroupWindow& gw, int fc, step::Form form, const Tensor& a, const Tensor& a_scale,
             const Tensor& b, const Tensor& home, bool overwrite, bool zero_clone_slots,
             Stream s) const;

 private:
  void fp8_rows(const GroupWindow& gw, int fc, step::Pass pass, const Tensor& q, const Tensor& sc,
                const Tensor& c, Stream s) const;
};

}  // namespace moe_echo
