// The argument checks of comm.hpp's per-step ops, written once for every communicator (in-process,
// host collectives, single GPU, NCCL), so that each rejects the same calls with the same message.
// A message names the op, the argument, the value given and what is allowed.
//
// Invariants: a check reads only host values (sizes, dtypes, the route's top_k and chunk numbers,
// the SymmetricBuffer byte counts), never device memory, so it is capture-safe; what only one
// communicator can check (a live buffer of its own, its device limits) stays with it.
#pragma once

#include <cstddef>
#include <initializer_list>

#include "moe_echo/comm.hpp"

namespace moe_echo::comm_args {

// The dtypes one communicator takes for an argument, e.g. {DType::f32, DType::f64}.
using DTypes = std::initializer_list<DType>;

// dispatch and combine (op names which): a route of whole tokens of 1 to kMaxTopK entries, with
// 0 <= chunk < chunks when it names chunks; a window of rows >= 0 from row_lo >= 0; a fan table
// of the route's top_k whose float dtype is one of `fan_dtypes`.
void check_route(const char* op, const RowRoute& route, RoundWindow win, const FanTable& fan,
                 DTypes fan_dtypes);
// combine's y: [route.n / route.top_k, H] of one of `dtypes`.
void check_combine_rows(const RowRoute& route, const Tensor& y, DTypes dtypes);
// The window's rows fit, by their SymmetricBuffer::bytes, the row buffer (row_bytes per row) and
// the fan table (members [rows, K] i32, weights [rows, K] and values [rows] of its float dtype).
void check_window_fits(const char* op, RoundWindow win, const SymmetricBuffer& rows_buf,
                       size_t row_bytes, const FanTable& fan);
// all_reduce_sum's tensor and reduce_clone_grads' slots: f32 or f64.
void check_sum_dtype(const char* op, DType dtype);
// pull_clone_weights and reduce_clone_grads: a plan of this communicator's `ranks` ranks, a
// multiple of them experts, spare slots and clones >= 0.
void check_plan(const char* op, const PlannerConfig& cfg, int ranks);

}  // namespace moe_echo::comm_args
