// The ops of one MoE layer step, as a backend implements them (CPU reference, CUDA).
//
// Contract for every per-step op:
// - It allocates nothing and never waits on the host: every buffer comes from the caller (the
//   layer's workspace), so a whole step can be captured in one CUDA graph.
// - Shapes are host values fixed at layer build; routing-dependent extents (group sizes, valid
//   rows, overflow) are read from device memory by the op itself.
// - Expert ops touch only valid rows: rows of the receive window that belong to no group are
//   neither read nor written.
// - Outputs named "+=" accumulate into what the caller holds; all others are overwritten.
// - `float` tensors below have the backend's float_dtype() (router, probabilities, losses);
//   activations and expert weights have activation_dtype().
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "moe_echo/config.hpp"
#include "moe_echo/planner.hpp"
#include "moe_echo/tensor.hpp"

namespace moe_echo {

// One round's window of receive rows of a rank: [row_lo, row_lo + rows), global over rounds
// (round r of a layer with capacity C is {r * C, C}). What the communicator's dispatch and combine
// take (comm.hpp).
struct RoundWindow {
  int64_t row_lo = 0;
  int64_t rows = 0;  // window size (the capacity)
};

// A round's window with its rows grouped by slot, what the expert ops take:
// GroupWindow{round_window, group_offsets, groups}. group_offsets[g] is the first receive row
// (global, over all rounds) of slot g, group_offsets[groups] the total; group g's rows in this
// window are [max(off[g], row_lo), min(off[g+1], row_lo + rows)) - row_lo.
struct GroupWindow : RoundWindow {
  const int32_t* group_offsets = nullptr;  // device, [groups + 1]
  int groups = 0;
};

// A window's rows split into chunks per rank (MoeConfig::chunks), so that one chunk's expert
// GEMMs can run while the next chunk is dispatched and the one before it combined: window row q
// of rank r lies in chunk c when bounds[r * (chunks + 1) + c] <= q < bounds[r * (chunks + 1) + c +
// 1] (device i32 [ranks][chunks + 1], non-decreasing from 0 to the rows rank r receives in the
// window: Backend::chunk_plan writes them). A call given chunks moves chunk `chunk` only
// (RowRoute::chunks, comm.hpp); bounds nullptr is one chunk, the whole window.
struct RowChunks {
  const int32_t* bounds = nullptr;
  int chunks = 1;
  int chunk = 0;
};

// The router's options, the same in its forward and its backward.
// Selection: per token, with expert_groups G > 1, its topk_groups best groups by group_score of
// the selection keys (score + bias; ties to the lower group), then the top K keys among the
// experts of those groups (ties to the lower expert). Combine weights: the chosen experts'
// unbiased scores, normalised to sum 1 when normalize_topk, times routed_scaling_factor.
struct RouterConfig {
  ScoreFunction score_function = ScoreFunction::softmax;
  bool normalize_topk = true;
  double aux_loss_coeff = 0;  // the backward takes every loss with upstream gradient 1
  double z_loss_coeff = 0;
  int expert_groups = 1;
  int topk_groups = 1;
  GroupScore group_score = GroupScore::top2_sum;
  double routed_scaling_factor = 1.0;
  double seq_aux_loss_coeff = 0;  // the aux loss per run of seq_len tokens, averaged over runs
  int seq_len = 0;
};
// A layer's router options (MoeConfig's fields of the same names).
inline RouterConfig router_config(const MoeConfig& m) {
  return RouterConfig{m.score_function, m.normalize_topk,        m.aux_loss_coeff,
                      m.z_loss_coeff,   m.expert_groups,         m.topk_groups,
                      m.group_score,    m.routed_scaling_factor, m.seq_aux_loss_coeff,
                      m.seq_len};
}
// Runs of seq_len tokens among T (the last may be shorter); 0 without a sequence-level loss.
inline int64_t router_sequences(const RouterConfig& c, int64_t T) {
  return c.seq_aux_loss_coeff != 0 && c.seq_len > 0 ? (T + c.seq_len - 1) / c.seq_len : 0;
}

// The router's tensors in its forward and its backward: the forward reads x and weight and writes
// the rest; the backward reads them all as the forward left them.
struct RouterTensors {
  Tensor x;            // [T, H] activation
  Tensor weight;       // [E, H] float
  Tensor logits;       // [T, E] float
  Tensor scores;       // [T, E] float: softmax probabilities, or sigmoid scores
  Tensor topk_idx;     // [T, K] i32, experts in descending order of selection score
  Tensor topk_weight;  // [T, K] float, combine weights
  Tensor counts;       // [E] i32, (token, k) pairs routed to each expert
};

struct RouterForwardArgs {
  RouterTensors tensors;  // x, weight in; the others out
  Tensor bias;            // [E] float, added to scores for expert selection only
  Tensor losses;          // out [3] float: aux, z and sequence aux losses (coefficients applied)
  RouterConfig config;
};

struct RouterBackwardArgs {
  RouterTensors tensors;  // in, as the forward left them
  Tensor d_topk_weight;   // [T, K] float, gradient of the task loss w.r.t. the combine weights
  Tensor d_weight;        // += [E, H] float
  Tensor dx;              // += [T, H] activation
  RouterConfig config;    // as in the forward
};

// Where every (token, k) row goes, from the routing map and the plan; identical on every rank.
struct LayoutArgs {
  Tensor routing_map;    // [R, E] i32, C[src][e]
  Tensor plan;           // [plan_ints] i32 (PlanView layout)
  Tensor topk_idx;       // [T, K] i32, this rank's routes
  Tensor assign;         // scratch [R * E * M] i32
  Tensor dest_rank;      // out [T * K] i32
  Tensor dest_row;       // out [T * K] i32: receive row on dest_rank (global over rounds)
  Tensor group_offsets;  // out [slots + 1] i32: this rank's receive rows per slot
  Tensor rank_rows;      // out [R] i32: rows every rank receives
  Tensor round_active;   // out [max_rounds] i32: 1 where some rank has rows in that round
  PlannerConfig planner;
  int rank = 0;
  int slots = 0;         // home + spare slots per rank
  int64_t capacity = 0;  // receive rows per round
};

// MoeConfig::chunks: a window's rows split into about equal chunks per rank (RowChunks). With
// n_r = min(rank_rows[r] - row_lo, capacity) clamped at 0 (the rows rank r receives in the
// window), bounds[r][c] = floor(c n_r / chunks). offsets[c] is this rank's group_offsets narrowed
// to chunk c: offsets[c][g] = clamp(group_offsets[g], row_lo + lo, row_lo + hi) for chunk c's
// rows [lo, hi) of this rank, so that GroupWindow{window, offsets[c], slots} gives chunk c's
// rows to the expert ops.
struct ChunkPlanArgs {
  Tensor rank_rows;      // [R] i32 (LayoutArgs::rank_rows)
  Tensor group_offsets;  // [slots + 1] i32 (LayoutArgs::group_offsets)
  Tensor bounds;         // out [R, chunks + 1] i32
  Tensor offsets;        // out [chunks, slots + 1] i32
  int rank = 0;
  int64_t row_lo = 0;
  int64_t capacity = 0;
};

struct GemmArgs {
  GroupWindow window;
  Tensor a;  // fprop: x [rows, K]          dgrad: dy [rows, N]     wgrad: x [rows, K]
  Tensor b;  // fprop: w [G, K, N]          dgrad: w [G, K, N]      wgrad: dy [rows, N]
  // wgrad: c is of the float dtype, or of the activation dtype when written (accumulate false):
  // then each group's sum is rounded once to it.
  Tensor c;  // fprop: out y [rows, N]      dgrad: out dx [rows, K] wgrad: += dw [G, K, N] float
  // wgrad only: false writes dw[g] = a^T b over the window's rows instead of adding to it (no read
  // of dw), and zero for a group whose rows all lie outside the window (later windows add to it);
  // a group with no rows at all keeps its dw either way, as does every group without rows in the
  // window with true.
  bool accumulate = true;
  // wgrad writing only: groups g < zero_empty_below with no rows at all are zeroed too instead of
  // kept (a layer's home experts that no token picked, when the backward writes the gradients).
  int zero_empty_below = 0;
  // Home split, optional: a layer's home experts and its clone slots in separate memory (home
  // weights and gradients per layer, clone slots in a pool shared by the layers of a model, or
  // home gradients in a framework's tensor). fprop/dgrad: groups g < b_home.size(0) take their
  // weights from b_home[g], the others from b[g - b_home.size(0)]. wgrad: groups
  // g < c_home.size(0) are in c_home[g] (same [K, N] float slabs), the others in
  // c[g - c_home.size(0)]. With a split, b (or c) may be empty when every group is a home group.
  Tensor b_home = {};
  Tensor c_home = {};
};
// Groups of `a` held in its home tensor (b_home for fprop/dgrad, c_home for wgrad), 0 if none.
inline int64_t gemm_home_groups(const Tensor& home) { return home.data ? home.size(0) : 0; }

struct SwigluArgs {
  GroupWindow window;  // only rows in some group are touched
  Tensor h;            // [rows, 2F]: gate | up
  Tensor a;            // [rows, F]: silu(gate) * up            (forward out; backward in)
  Tensor da;           // [rows, F]                              (backward in)
  Tensor dh;           // [rows, 2F]                             (backward out)
  // Forward, optional: in the same pass, a's 1 x 128 row quantization over the window's valid
  // rows, the bits of Fp8RowArgs{a, a_q, a_scale, {}, window} (a_q [rows, F] e4m3, a_scale
  // [rows, ceil(F / 128)] f32; rows past the valid ones are not written). Both empty otherwise.
  Tensor a_q = {};
  Tensor a_scale = {};
};

// The receiver's side of a token's members (see FanTable in comm.hpp): the fan table this round's
// dispatch wrote, read on valid rows only. A lead row p is a valid row with members[p][0] == p.
struct FanArgs {
  GroupWindow window;  // valid rows: rows of the window in some group
  Tensor members;      // [rows, K] i32
  Tensor weights;      // [rows, K] float, or empty: weight 1
  Tensor src;          // [rows, H] activation
  Tensor dst;          // [rows, H] activation
  Tensor other;        // fan_out only: [rows, H] activation, or empty
  Tensor d_weight;     // fan_out only: out [rows] float, or empty
  // One chunk of the window (RowChunks): device i32 [2], its window rows [lo, hi) on this rank
  // (the bounds row of this rank at the chunk), or nullptr: the whole window. fan_out then
  // writes the members of the lead rows p with lo <= p < hi, fan_in the lead rows p < hi whose
  // last member (largest row) lies in [lo, hi): a pair's row arrives with its lead's chunk and is
  // summed with its last member's. Fan table rows at or past hi are not read.
  const int32_t* chunk = nullptr;
};

// FP8 blockwise quantization (DeepSeek-V3's recipe): each tile's values x are stored as
// q = e4m3(x * (1 / s)) with one fp32 scale s = max(amax / 448, FLT_MIN) per tile (amax the
// tile's largest |x|; s = 1 for a tile of zeros; FLT_MIN keeps s normal and 1 / s finite), e4m3
// rounded to nearest even and saturated at 448 (host_io.hpp's to_e4m3), so that q s gives x back
// within e4m3's 3 mantissa bits. amax / 448 and 1 / s are IEEE fp32 divisions (one per tile) and
// x * (1 / s) an IEEE fp32 product, so every backend gives the same bits. A partial tile at an
// edge is a tile of the elements that exist.
struct Fp8RowArgs {  // 1 x 128 tiles along each row (activations and gradients, GEMM operand A)
  Tensor x;          // [rows, K] activation dtype
  Tensor q;          // [rows, K] e4m3 (with scale), or empty when packed is given
  Tensor scale;      // [rows, ceil(K / 128)] f32
  // Or one packed row per x row (what the FP8 dispatch sends): [rows, fp8_packed_row_bytes(K)]
  // e4m3 bytes, the row's K e4m3 values, then its ceil(K / 128) f32 scales, then zero padding to
  // a multiple of 16 bytes. The same bits as q and scale.
  Tensor packed = {};
  // With group offsets, x's rows are the window's rows and only its valid rows (those in some
  // group) are quantized; the others are not written. Without, every row of x.
  GroupWindow window = {};
};
struct Fp8BlockArgs {  // 128 x 128 blocks of each [K, N] slab (expert weights, operand B)
  Tensor w;            // [G, K, N] activation dtype
  Tensor q;            // [G, K, N] e4m3, or empty
  Tensor q_t;          // [G, N, K] e4m3: the same values transposed (for the other GEMM), or empty
  Tensor scale;        // [G, ceil(K / 128), ceil(N / 128)] f32 (the same blocks for q and q_t)
  Tensor scale_t;      // [G, ceil(N / 128), ceil(K / 128)] f32: the scales transposed, or empty
};
inline constexpr int64_t kFp8Tile = 128;
// Tiles of 128 (one scale each) along n elements.
inline int64_t fp8_tiles(int64_t n) { return (n + kFp8Tile - 1) / kFp8Tile; }
// Bytes of a packed FP8 row of K values (Fp8RowArgs::packed): K, then the scales, to 16 bytes.
inline int64_t fp8_packed_row_bytes(int64_t K) { return K + (fp8_tiles(K) * 4 + 15) / 16 * 16; }
// The FP8 dispatch's receiving side: for every lead row p of the window's valid rows and every
// member j of p (p included; FanArgs' members), q[j] and scale[j] = the values and scales of
// packed row src[p]. Nothing else is written.
struct Fp8FanArgs {
  GroupWindow window;
  Tensor members;  // [rows, K] i32 (FanArgs::members)
  Tensor src;      // [rows, fp8_packed_row_bytes(H)] e4m3 bytes: packed rows (Fp8RowArgs)
  Tensor q;        // out [rows, H] e4m3
  Tensor scale;    // out [rows, ceil(H / 128)] f32
  const int32_t* chunk = nullptr;  // as FanArgs::chunk for fan_out
};
// 1 x 128 tiles along the rows of each group, transposed (the operands of the FP8 weight
// gradient, whose reduction runs over a group's rows): group g's window rows [lo_g, hi_g) become
// columns [p_g, p_g + m_g) of q_t, m_g = hi_g - lo_g, where p_g = sum over h < g of
// round_up(m_h, 128) (padded_offsets[g]; padded_offsets[groups] the total). The columns
// [p_g + m_g, p_g + round_up(m_g, 128)) are zero, so every tile lies in one group. Group g's
// scales are a [round_up(m_g, 128) / 128][K] block at scale + K * p_g / 128 (the scales of one
// tile of every q_t row contiguous: what the wgrad kernel loads per 128 of its reduction).
// Columns at or beyond the total are not written.
struct Fp8ColArgs {
  GroupWindow window;
  Tensor x;               // [>= window.rows, K] activation dtype: window row i is x[i]; or e4m3
  Tensor q_t;             // [K, P] e4m3, P >= fp8_padded_rows(window.rows, window.groups)
  Tensor scale;           // [K * P / 128] f32
  Tensor padded_offsets;  // out [window.groups + 1] i32
  // With an e4m3 x, its row scales [>= window.rows, ceil(K / 128)] f32: x's values are the f32
  // products x[i][k] x_scale[i][k / 128]. Empty otherwise.
  Tensor x_scale = {};
  // Optional, for an x in the activation dtype: in the same pass, the 1 x 128 row quantization of
  // x's valid window rows, the bits of Fp8RowArgs{x, row_q, row_scale, {}, window} (rows of the
  // window in no group are not written). Both empty, or row_q [>= window.rows, K] e4m3 and
  // row_scale [row_q rows, ceil(K / 128)] f32.
  Tensor row_q = {};
  Tensor row_scale = {};
};
// Checks `a` against the contract above, x of dtype `x_dtype` (Error naming the tensor
// otherwise); returns q_t's columns P.
int64_t check_fp8_col_args(const Fp8ColArgs& a, DType x_dtype);
// The same for Fp8RowArgs (returns the tiles per row) and Fp8FanArgs (returns the scales per row).
int64_t check_fp8_row_args(const Fp8RowArgs& a, DType x_dtype);
int64_t check_fp8_fan_args(const Fp8FanArgs& a);
// dequantize_fp8_rows' Fp8RowArgs: q and scale, not packed rows (returns the tiles per row).
int64_t check_fp8_dequant_args(const Fp8RowArgs& a, DType x_dtype);
// Fp8BlockArgs, w of dtype `w_dtype`.
void check_fp8_block_args(const Fp8BlockArgs& a, DType w_dtype);
// ChunkPlanArgs's shapes (bounds [R, chunks + 1], offsets [chunks, slots + 1]) and rank.
void check_chunk_plan(const ChunkPlanArgs& a);
// Columns q_t needs for a window of `rows` rows in `groups` groups (every group padded to 128).
inline int64_t fp8_padded_rows(int64_t rows, int64_t groups) {
  return (rows + groups * (kFp8Tile - 1) + kFp8Tile - 1) / kFp8Tile * kFp8Tile;
}

// Grouped GEMMs on FP8 operands with blockwise scales (DeepSeek-V3's recipe). Each operand is
// e4m3 with one fp32 scale per 128 elements along the reduction (1 x 128 tiles of rows, or
// 128 x 128 blocks of weights), and each output element is
//   out = sum over reduction blocks kb of (s_a[kb] s_b[kb]) (sum over k in kb of q_a[k] q_b[k])
// (the block sum in fp32 or better, promoted and scaled every 128 of the reduction), rounded
// once to c's dtype (fprop, dgrad) or added to fp32 (wgrad). Both operands are reduction-major
// (the layout FP8 tensor cores need), so each op takes the copy made for it:
//   fprop: c[i] = a[i] @ w[g]     a = x rows (Fp8RowArgs of x: [rows, K], scale [rows, K/128]),
//                                 b = q_t [G, N, K] with scale_t [G, N/128, K/128]
//   dgrad: c[i] = a[i] @ w[g]^T   a = dy rows (Fp8RowArgs of dy: [rows, N], scale [rows, N/128]),
//                                 b = q [G, K, N] with scale [G, K/128, N/128]
//   wgrad: c[g] (+)= x_g^T dy_g   a = x's Fp8ColArgs (q_t [K, P], its scale), b = dy's
//                                 (q_t [N, P], its scale), padded_offsets from either
// Rows, groups, window, accumulate, zero_empty_below and the home split (b_home with
// b_home_scale; c_home) mean what they mean in GemmArgs. K and N must be multiples of 16.
struct Fp8GemmArgs {
  GroupWindow window;
  Tensor a, a_scale;
  Tensor b, b_scale;
  Tensor c;                  // fprop/dgrad: [rows, N or K] activation dtype; wgrad f32
  Tensor padded_offsets;     // wgrad only: [groups + 1] i32 (Fp8ColArgs)
  bool accumulate = true;    // wgrad only
  int zero_empty_below = 0;  // wgrad only
  Tensor b_home = {}, b_home_scale = {};
  Tensor c_home = {};
};

struct AdamWArgs {
  Tensor param, grad, m, v;  // same shape; param in its dtype, grad, m and v float
  Tensor step;               // [1] i32 on the device: the 1-based step, for bias correction; read
                             // by the op, so a captured graph that advances it stays correct
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  // Optional float master copy of param (same numel): AdamW updates the master and writes param
  // as the master rounded to param's dtype, so updates below param's precision accumulate.
  Tensor master = {};
};

// What one layer's per-step ops will need at most; given to Backend::reserve at layer build so a
// backend can size fixed workspaces (GEMM schedules, scratch) before any step runs.
struct Reservation {
  int max_groups = 0;      // expert slots per rank
  int64_t max_rows = 0;    // receive window rows (the capacity)
  int64_t max_tokens = 0;  // tokens per rank
  int hidden = 0, ffn = 0, experts = 0, top_k = 0, ranks = 1;
  PlannerConfig planner;  // the plans this layer will ask for (spare slots, clone limit)
  bool fp8 = false;       // the layer runs the FP8 grouped GEMMs (MoeConfig::precision)
  // MoeConfig::overlap wgrad: grouped GEMMs of max_groups for the side stream that run on all SMs
  // but overlap_sms (-1: none).
  int overlap_sms = -1;
  // Lanes of the backend's own resources the layer uses (Backend::set_lane): 2 for two
  // micro-batches in flight, whose phases may run on two streams at once.
  int lanes = 1;
};

// What Backend::enqueue_as_graph keeps between calls of one call site (an instantiated graph).
class GraphCache {
 public:
  virtual ~GraphCache() = default;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual DType activation_dtype() const = 0;
  virtual DType float_dtype() const = 0;

  // Memory, used when a layer is built (never inside a step).
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p) = 0;
  virtual void copy_from_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void synchronize() = 0;
  // Build time (may allocate): called by every layer built on this backend.
  virtual void reserve(const Reservation& r) {}

  // Per-step ops (capture-safe).
  virtual void fill_zero(const Tensor& t, Stream s) = 0;
  virtual void copy(const Tensor& dst, const Tensor& src, Stream s) = 0;
  virtual void router_forward(const RouterForwardArgs& a, Stream s) = 0;
  virtual void router_backward(const RouterBackwardArgs& a, Stream s) = 0;
  // bias[e] += rate * sign(mean_e' count - count_e), count_e = sum over sources of C[src][e].
  virtual void router_bias_update(const Tensor& routing_map, const Tensor& bias, double rate,
                                  Stream s) = 0;
  virtual void plan(const Tensor& routing_map, const PlannerConfig& cfg, bool echo,
                    const Tensor& plan, Stream s) = 0;
  // plan_placed (planner.hpp) of a placement in device memory (i32 [R * S], e.g. the spare_expert
  // part of an earlier plan): the same plan bit for bit on every backend. The placement is
  // trusted on the device (a kept plan's is valid); the host checks only shapes.
  virtual void plan_placed(const Tensor& routing_map, const PlannerConfig& cfg,
                           const Tensor& placement, const Tensor& plan, Stream s) = 0;
  virtual void layout(const LayoutArgs& a, Stream s) = 0;
  virtual void chunk_plan(const ChunkPlanArgs& a, Stream s) = 0;
  virtual void gemm_fprop(const GemmArgs& a, Stream s) = 0;
  virtual void gemm_dgrad(const GemmArgs& a, Stream s) = 0;
  virtual void gemm_wgrad(const GemmArgs& a, Stream s) = 0;
  virtual void swiglu_forward(const SwigluArgs& a, Stream s) = 0;
  virtual void swiglu_backward(const SwigluArgs& a, Stream s) = 0;
  // For every lead row p and member j of p (p included): d_weight[j] = <src[p], other[j]> when
  // d_weight is given (float accumulation, before dst[j] is written), then dst[j] = w_j * src[p].
  // dst may be src, without weights only (the unweighted copy to the other members; row p is then
  // left as it is), or other (the rows are read before they are written).
  virtual void fan_out(const FanArgs& a, Stream s) = 0;
  // For every lead row p: dst[p] = sum over members j of p, in member order, of w_j * src[j],
  // accumulated in float and rounded once. dst may be src (each lead row is written after its
  // members are read; leads have disjoint members).
  virtual void fan_in(const FanArgs& a, Stream s) = 0;
  virtual void fan_out_fp8(const Fp8FanArgs& a, Stream s) = 0;
  virtual void adamw(const AdamWArgs& a, Stream s) = 0;
  virtual void quantize_fp8_rows(const Fp8RowArgs& a, Stream s) = 0;
  // The inverse on q and scale: x[r][k] = q[r][k] scale[r][k / 128] (the f32 product) rounded
  // to x's dtype (with a window, on its valid rows only).
  virtual void dequantize_fp8_rows(const Fp8RowArgs& a, Stream s) = 0;
  virtual void quantize_fp8_blocks(const Fp8BlockArgs& a, Stream s) = 0;
  virtual void quantize_fp8_cols(const Fp8ColArgs& a, Stream s) = 0;
  virtual void gemm_fp8_fprop(const Fp8GemmArgs& a, Stream s) = 0;
  virtual void gemm_fp8_dgrad(const Fp8GemmArgs& a, Stream s) = 0;
  virtual void gemm_fp8_wgrad(const Fp8GemmArgs& a, Stream s) = 0;
  // t[i] += value for every element of an i32 tensor (step counters).
  virtual void add_i32(const Tensor& t, int32_t value, Stream s) = 0;
  // Runs `body` (which enqueues ops on the stream it is given) only when the device flag is
  // non-zero. The CPU backend tests the flag directly and passes `s`; a capturing CUDA backend
  // turns it into a conditional graph node whose body it captures from a stream of its own.
  virtual void run_if(const int32_t* device_flag, const std::function<void(Stream)>& body,
                      Stream s) = 0;
  // Enqueues on `s` what `body` enqueues on the stream it is given, so that nothing in it waits
  // on the host, run_if included. The CUDA backend, when `s` is not capturing already, captures
  // the body on a stream of its own into a graph it keeps in `cache` (up to 8 per cache, the
  // least recently launched updated or replaced beyond that) and launches the graph on `s`;
  // while `s` is capturing, and on the CPU backend, the body runs on `s` directly. The body must
  // be capture-safe. One `cache` serves one call site; it is created on first use. `key` holds
  // everything the body's work depends on that may change between calls (pointers, sizes,
  // flags): when it equals an earlier call's whose graph is kept, that graph is launched again
  // as it is, with no capture (the body would capture the same work).
  virtual void enqueue_as_graph(std::unique_ptr<GraphCache>& cache,
                                const std::vector<uint64_t>& key,
                                const std::function<void(Stream)>& body, Stream s) {
    body(s);
  }
  // Enqueues `body` on the backend's side stream, after the work enqueued on `s` so far, and
  // returns; join_side(s) makes the work enqueued on `s` after it wait for all of body's. Only the
  // grouped GEMMs, the FP8 row and column quantization, SwiGLU and the fan ops may run in body
  // (the CUDA backend gives the side stream grouped GEMMs of its own: one group, and, after a
  // reservation with overlap_sms, more groups on all SMs but those; the fan ops' lead lists and
  // the router, planner and layout share one scratch arena, so while body runs fan ops, `s` runs
  // none of those). One fork at a time, each joined before the next. Capture-safe (the side
  // stream joins the capture). The CPU backend runs body on `s`.
  virtual void fork_side(const std::function<void(Stream)>& body, Stream s) { body(s); }
  // Which of the reserved lanes (Reservation::lanes) the ops enqueued next use: each lane has
  // its own grouped GEMM arguments, scratch and side stream (on the CUDA backend), so ops of two
  // lanes may run on two streams at once; ops of one lane go in one stream's order. The CPU
  // backend has nothing to keep apart.
  virtual void set_lane(int lane) {}
  virtual void join_side(Stream s) {}
};

}  // namespace moe_echo
