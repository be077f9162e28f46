// Every buffer of a MoE layer, declared once (buffer_table): its shape as a function of the
// configs, its dtype, the part of MoeMemory it counts in, and who holds it: the layer (shared by
// its micro-batches, or one per micro-batch in flight) or the workspace (one slot of bytes that
// the layers bound to it view with their own shapes, sized for the largest). Allocation, the
// workspace's sizing, the binding of its slots as a layer's views and both memory counts
// (MoeLayer::memory_breakdown, MoeWorkspace::memory_breakdown, moe-echo plan) all read the table.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "moe_echo/comm.hpp"
#include "moe_echo/config.hpp"
#include "moe_echo/layer.hpp"
#include "moe_echo/tensor.hpp"

namespace moe_echo {

// A weight's e4m3 copies (precision fp8): for dgrad (q, s) and, transposed, for fprop (q_t, s_t).
struct Fp8Weight {
  Tensor q, q_t, s, s_t;
};

// A micro-batch's buffers (MoeConfig::in_flight of them): its routing, plan and layout, the
// activations the layer keeps for its backward, the temporaries between its phases, and its
// views of the workspace's slots (set m % 2 for micro-batch m).
struct StepPart {
  // Routing.
  Tensor logits, scores, topk_idx, topk_weight, counts, losses;
  Tensor routing_map, plan, assign, dest_rank, dest_row, group_offsets, rank_rows, round_active;
  // MoeConfig::chunks > 1: round 0's chunks (ChunkPlanArgs: bounds [R, chunks + 1] of every
  // rank, this rank's group offsets per chunk [chunks, slots + 1]).
  Tensor chunk_bounds, chunk_offsets;
  // The spare slots (this step's clones, not parameters): the workspace's echo slots, or the
  // layer's own (EchoPlacement::step); their gradients symmetric (their home ranks reduce them).
  SymmetricBuffer dw1_spare_sym, dw2_spare_sym;
  Tensor w1_spare, w2_spare, dw1_spare, dw2_spare;  // [S, ...] (empty without spare slots)
  // Receive windows and expert activations (capacity rows): the layer's own where it keeps them
  // for its backward (MoeConfig::recompute), the workspace's otherwise.
  // recv_x: token rows in (forward and recompute). recv_red: the rows the source reads back
  // (forward: weighted output sums; backward: dy rows in, then dx sums out). recv_out: expert
  // output rows, then their gradients, then dx rows.
  SymmetricBuffer recv_x_sym, recv_red_sym, fan_members_sym, fan_weights_sym, fan_values_sym;
  FanTable fan;
  Tensor recv_x, recv_red, recv_out, h, a, da, dh;
  Tensor fan_members, fan_weights, fan_values;
  // Source side.
  Tensor d_topk_weight;
  // Shared experts (empty without): the group offsets {0, T} of their one group; activations of
  // up to T tokens; and a device flag holding 1 (the routed rounds then add to y and dx).
  Tensor shared_offsets, shared_h, shared_a, shared_da, shared_dh, one;
  // Precision fp8 (empty otherwise): the echo slots' e4m3 copies of the weights; the rows of
  // one GEMM's activation operand (row_q [cap, max(2F, H)], row_s), and wgrad's two transposed
  // column operands (col_a, col_b [max(H, 2F), P], their scales and padded offsets).
  Fp8Weight w1_spare_q, w2_spare_q;
  Tensor row_q, row_s, col_a, col_as, col_b, col_bs, col_po, col_po2;
  // Precision fp8's dispatch: x's rows quantized and packed (x_send [T, fp8_packed_row_bytes(H)]),
  // landing in recv_red's bytes, fanned out into recv_x's bytes as e4m3 rows recv_xq [cap, H]
  // and their scales recv_xs [cap, ceil(H / 128)].
  Tensor x_send, recv_xq, recv_xs;
};

// What the micro-batches of a layer share: parameters, gradients, optimizer state, the home
// weights' e4m3 copies and, with EchoPlacement::step, the step's placement.
struct LayerTensors {
  Tensor router_weight, router_bias, d_router_weight;
  SymmetricBuffer w1_sym, w2_sym;  // peers pull clones of w1 and w2
  Tensor w1, w2, dw1, dw2;         // [E/R, ...]
  // AdamW state (float dtype) and the float masters (MoeConfig::master_weights).
  Tensor m_router, v_router, m_w1, v_w1, m_w2, v_w2;
  Tensor master_w1, master_w2, master_sw1, master_sw2;
  Tensor optimizer_step;  // [1] i32: steps taken, advanced on the device
  // Shared experts (empty without): weights [1, H, 2S] and [1, S, H], gradients, AdamW state.
  Tensor shared_w1, shared_w2, d_shared_w1, d_shared_w2, m_sw1, v_sw1, m_sw2, v_sw2;
  Fp8Weight w1_q, w2_q;
  // EchoPlacement::step: the plan of the step's first forward, which made its placement (its
  // replicas name every clone slot the step's backwards may leave gradients in).
  Tensor step_plan;
};

// The workspace's slots: byte buffers each bound layer views with its own shapes.
enum class Slot : uint8_t {
  recv_x,
  recv_red,
  fan_members,
  fan_weights,
  fan_values,
  recv_out,
  h,
  a,
  da,
  dh,
  w1_spare,
  w2_spare,
  dw1_spare,
  dw2_spare,
  row_q,
  row_s,
  col_a,
  col_as,
  col_b,
  col_bs,
  col_po,
  col_po2,
  x_send,
  w1_spare_q,
  w1_spare_q_t,
  w1_spare_s,
  w1_spare_s_t,
  w2_spare_q,
  w2_spare_q_t,
  w2_spare_s,
  w2_spare_s_t,
  none,
};
inline constexpr int kSlots = int(Slot::none);

// Where a buffer lives.
enum class Home : uint8_t {
  layer,        // the layer's own, shared by its micro-batches
  micro_batch,  // the layer's own, one per micro-batch in flight
  workspace,    // a view of a workspace slot
};

// One buffer of a layer.
struct BufferRow {
  const char* name = "";
  Tensor* tensor = nullptr;        // where the tensor goes (nullptr: a size the slot must hold)
  SymmetricBuffer* sym = nullptr;  // symmetric buffers: their handle
  DType dtype = DType::f32;
  std::vector<int64_t> dims;
  size_t MoeMemory::*part = &MoeMemory::params;  // counted in (layer's own)
  Home home = Home::layer;
  Slot slot = Slot::none;  // Home::workspace
  bool zero = false;       // zeroed when allocated
  size_t bytes() const;
  Tensor view(void* data) const;  // the buffer's shape over `data`
};

// The sizes a layer's buffers take from its configs.
struct BufferDims {
  BufferDims(const MoeConfig& moe, const ParallelConfig& par, const EchoConfig& echo, DType act,
             DType fl, LayerOwns owns);
  MoeConfig moe;
  DType act, fl;
  bool optimizer_state;
  bool expert_grads;
  int64_t T, H, F, E, K, R, EPR;
  int64_t G;    // slots per rank
  int64_t cap;  // receive capacity rows
  int64_t SP;   // spare slots (echo slots) per rank
  int64_t S;    // the shared experts' width
  int rounds;
  int64_t plan_ints, max_replicas;
  bool own_slots;  // EchoPlacement::step with spare slots: the layer's own echo slots
};

// Every buffer of a layer (targets: `layer` and micro-batch `part`), in allocation order.
std::vector<BufferRow> buffer_table(const BufferDims& d, LayerTensors& layer, StepPart& part);

// The views derived from the table's buffers (recv_xq and recv_xs in recv_x's bytes; the fan
// table's handles).
void derive_views(const BufferDims& d, StepPart& part);

// The workspace's slots' bytes (one set).
struct SlotBytes {
  std::array<size_t, kSlots> bytes{};
  // Grows every slot to hold what this layer's table asks of it.
  void grow(const BufferDims& d);
  // The bytes by part: the echo slots, their gradients and the fp8 operands apart from the rest.
  MoeMemory memory() const;
  size_t total() const;
};
bool slot_symmetric(Slot s);

// The bytes a layer's own buffers take, by part (each micro-batch in flight has its own
// routing, activations and temporaries).
MoeMemory layer_memory(const BufferDims& d);

}  // namespace moe_echo
