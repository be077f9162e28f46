// The routed experts' GEMMs (expert_gemms.hpp).
#include "layer/expert_gemms.hpp"

#include "moe_echo/error.hpp"

namespace moe_echo {

Tensor fp8_operand(const Tensor& buffer, int64_t rows, int64_t cols) {
  Tensor t(buffer.data, buffer.dtype, {rows, cols});
  MOE_ECHO_CHECK(t.bytes() <= buffer.bytes(),
                 "fp8 buffer " << buffer.describe() << " for " << t.describe());
  return t;
}

namespace {
Tensor fp8_scales(const Tensor& buffer, int64_t n) {  // a [n] prefix
  return Tensor(fp8_operand(buffer, n, 1).data, buffer.dtype, {n});
}
}  // namespace

void ExpertGemms::rows(const GroupWindow& gw, int fc, step::Pass pass, step::Form form,
                       const Tensor& a, const Tensor& a_scale, const Tensor& c, Stream s) const {
  using step::Form;
  const bool dgrad = pass == step::Pass::dgrad;
  if (form == Form::plain) {
    const GemmArgs g{gw, a, fc == 1 ? p.w1_spare : p.w2_spare, c, true, 0, fc == 1 ? w.w1 : w.w2};
    if (dgrad)
      backend.gemm_dgrad(g, s);
    else
      backend.gemm_fprop(g, s);
    return;
  }
  if (form == Form::received) {
    fp8_rows(gw, fc, pass, a, a_scale, c, s);
    return;
  }
  const int64_t n = a.size(0), k = a.size(1);
  const Tensor q = fp8_operand(p.row_q, n, k), sc = fp8_operand(p.row_s, n, fp8_tiles(k));
  if (form == Form::quantize) {
    backend.quantize_fp8_rows({a, q, sc, {}, gw}, s);
  } else if (form == Form::with_cols) {
    const int64_t P = p.col_b.size(1);
    backend.quantize_fp8_cols({gw,
                               a,
                               fp8_operand(p.col_b, k, P),
                               fp8_scales(p.col_bs, k * P / kFp8Tile),
                               p.col_po2,
                               {},
                               q,
                               sc},
                              s);
  }  // Form::quantized: SwiGLU wrote them
  fp8_rows(gw, fc, pass, q, sc, c, s);
}

// The FP8 GEMM of rows in e4m3 with their 1 x 128 scales: fprop reads the weights' copies made
// for it (q_t, s_t), dgrad the others.
void ExpertGemms::fp8_rows(const GroupWindow& gw, int fc, step::Pass pass, const Tensor& q,
                           const Tensor& sc, const Tensor& c, Stream s) const {
  const Fp8Weight& wh = fc == 1 ? w.w1_q : w.w2_q;
  const Fp8Weight& ws = fc == 1 ? p.w1_spare_q : p.w2_spare_q;
  Fp8GemmArgs g;
  g.window = gw;
  g.a = q, g.a_scale = sc;
  g.c = c;
  if (pass == step::Pass::dgrad) {
    g.b = ws.q, g.b_scale = ws.s, g.b_home = wh.q, g.b_home_scale = wh.s;
    backend.gemm_fp8_dgrad(g, s);
  } else {
    g.b = ws.q_t, g.b_scale = ws.s_t, g.b_home = wh.q_t, g.b_home_scale = wh.s_t;
    backend.gemm_fp8_fprop(g, s);
  }
}

void ExpertGemms::wgrad(const GroupWindow& gw, int fc, step::Form form, const Tensor& a,
                        const Tensor& a_scale, const Tensor& bt, const Tensor& home, bool overwrite,
                        bool zero_clone_slots, Stream s) const {
  const Tensor& spare = fc == 1 ? p.dw1_spare : p.dw2_spare;
  const bool accumulate = !overwrite;
  const int zero_below = !overwrite ? 0 : zero_clone_slots ? slots : home_slots;
  if (form == step::Form::plain) {
    MOE_ECHO_CHECK(a_scale.data == nullptr, "expert wgrad: e4m3 rows for a bf16 weight gradient");
    backend.gemm_wgrad({gw, a, bt, spare, accumulate, zero_below, {}, home}, s);
    return;
  }
  const int64_t ka = a.size(1), nb = bt.size(1), P = p.col_a.size(1);
  const Tensor qa = fp8_operand(p.col_a, ka, P), qb = fp8_operand(p.col_b, nb, P);
  const Tensor sa = fp8_scales(p.col_as, ka * P / kFp8Tile),
               sb = fp8_scales(p.col_bs, nb * P / kFp8Tile);
  backend.quantize_fp8_cols({gw, a, qa, sa, p.col_po, a_scale}, s);
  if (form != step::Form::cols_ready) backend.quantize_fp8_cols({gw, bt, qb, sb, p.col_po2}, s);
  Fp8GemmArgs g;
  g.window = gw;
  g.a = qa, g.a_scale = sa, g.b = qb, g.b_scale = sb, g.padded_offsets = p.col_po;
  g.c = spare, g.c_home = home, g.accumulate = accumulate;
  g.zero_empty_below = zero_below;
  backend.gemm_fp8_wgrad(g, s);
}

}  // namespace moe_echo
