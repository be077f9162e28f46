// What the in-process and host-collectives communicators compute alike on host memory: which
// entries of a route lie in a window, their leads and members (FanTable in comm.hpp), a token's
// combine sum, the rank-order sum of an all-reduce and the replica-order sum of clone gradients.
// One definition, so that both give the same bits.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "moe_echo/comm.hpp"
#include "moe_echo/host_io.hpp"

namespace moe_echo::host_comm {

inline char* row_ptr(void* base, int64_t row, size_t row_bytes) {
  return static_cast<char*>(base) + size_t(row) * row_bytes;
}

// dst[i] += src[i]: a clone's gradient into its home expert's (replica order is the caller's).
template <class T>
void add_into(void* dst, const void* src, int64_t n) {
  T* d = static_cast<T*>(dst);
  const T* s = static_cast<const T*>(src);
  for (int64_t i = 0; i < n; ++i) d[i] += s[i];
}

// The route's pointers are read directly: host memory.
inline bool in_window(const RowRoute& route, RoundWindow win, int64_t i) {
  const int64_t row = int64_t(route.dest_row[i]) - win.row_lo;
  return row >= 0 && row < win.rows;
}

// The k of the lead of entry first + k's (token, rank) pair: its entry in the window with the
// lowest receive row.
inline int lead_entry(const RowRoute& route, RoundWindow win, int64_t first, int k) {
  const int d = route.dest_rank[first + k];
  int lead = k;
  for (int k2 = 0; k2 < route.top_k; ++k2)
    if (in_window(route, win, first + k2) && route.dest_rank[first + k2] == d &&
        route.dest_row[first + k2] < route.dest_row[first + lead])
      lead = k2;
  return lead;
}

// The chunk (RowChunks) of entry i in the window at its rank; 0 without chunks.
inline int entry_chunk(const RowRoute& route, RoundWindow win, int64_t i) {
  const RowChunks& c = route.chunks;
  if (!c.bounds) return 0;
  const int32_t* b = c.bounds + int64_t(route.dest_rank[i]) * (c.chunks + 1);
  const int64_t q = int64_t(route.dest_row[i]) - win.row_lo;
  int chunk = 0;
  while (chunk + 1 < c.chunks && q >= b[chunk + 1]) ++chunk;
  return chunk;
}

// Whether a dispatch call moves entry first + k (in the window): its pair's lead row lies in
// the call's chunk. Always, without chunks.
inline bool dispatch_moves(const RowRoute& route, RoundWindow win, int64_t first, int k) {
  return !route.chunks.bounds ||
         entry_chunk(route, win, first + lead_entry(route, win, first, k)) == route.chunks.chunk;
}

// Whether a combine call sums the token of entries [first, first + K): its last chunk (the
// highest of its entries in the window; 0 without any) is the call's. Always, without chunks.
inline bool combine_sums(const RowRoute& route, RoundWindow win, int64_t first) {
  if (!route.chunks.bounds) return true;
  int last = 0;
  for (int k = 0; k < route.top_k; ++k)
    if (in_window(route, win, first + k)) last = std::max(last, entry_chunk(route, win, first + k));
  return last == route.chunks.chunk;
}

// Writes 1 at p, which may be unaligned (a weight inside a byte buffer of rows).
inline void write_one(void* p, DType dt) {
  const float one_f = 1.0f;
  const double one_d = 1.0;
  if (dt == DType::f32)
    std::memcpy(p, &one_f, sizeof one_f);
  else
    std::memcpy(p, &one_d, sizeof one_d);
}

// The fan table row of the lead entry first + k (destination d): members[0..K) gets the window
// rows of (token, d)'s entries in the window, the lead first, then the others in k order, then
// -1 padding; weights (float_dtype bytes each, f32 or f64) gets each member's route weight (1
// without weights), members only. Returns the member count.
inline int list_members(const RowRoute& route, RoundWindow win, int64_t first, int k,
                        DType float_dtype, int32_t* members, char* weights) {
  const int K = route.top_k, d = route.dest_rank[first + k];
  const size_t fl = dtype_size(float_dtype);
  int m = 0;
  auto add = [&](int64_t j) {
    members[m] = int32_t(route.dest_row[j] - win.row_lo);
    if (route.weight)
      std::memcpy(weights + size_t(m) * fl, static_cast<const char*>(route.weight) + size_t(j) * fl,
                  fl);
    else
      write_one(weights + size_t(m) * fl, float_dtype);
    ++m;
  };
  add(first + k);
  for (int k2 = 0; k2 < K; ++k2) {
    const int64_t j = first + k2;
    if (k2 != k && in_window(route, win, j) && route.dest_rank[j] == d) add(j);
  }
  for (int p = m; p < K; ++p) members[p] = -1;
  return m;
}

// all_reduce_sum: sum[i] = 0 + parts[0][i] + parts[1][i] + ... in rank order, in double, for
// parts of dtype f32 or f64 (comm_args::check_sum_dtype); store_sum rounds it into `out` once.
inline std::vector<double> rank_order_sum(const std::vector<const void*>& parts, DType dtype,
                                          int64_t n) {
  std::vector<double> sum(static_cast<size_t>(n), 0.0);
  for (const void* p : parts)
    for (int64_t i = 0; i < n; ++i)
      sum[size_t(i)] += dtype == DType::f32 ? double(static_cast<const float*>(p)[i])
                                            : static_cast<const double*>(p)[i];
  return sum;
}

inline void store_sum(const std::vector<double>& sum, DType dtype, void* out) {
  for (size_t i = 0; i < sum.size(); ++i) {
    if (dtype == DType::f32)
      static_cast<float*>(out)[i] = float(sum[i]);
    else
      static_cast<double*>(out)[i] = sum[i];
  }
}

// Rows as the combine sums them: in float for f32 and bf16 (bf16 stored as its bits), in double
// for f64.
template <class Y>
struct RowSum {
  using Acc = Y;
  static Acc load(Y v) { return v; }
  static Y store(Acc a) { return a; }
};
struct Bf16Bits {
  uint16_t bits;
};
template <>
struct RowSum<Bf16Bits> {
  using Acc = float;
  static float load(Bf16Bits v) { return from_bf16(v.bits); }
  static Bf16Bits store(float a) { return Bf16Bits{to_bf16(a)}; }
};

// The combine on the source rank, y [tokens, H] in host memory: for every token t the call sums
// (combine_sums; the others are left as they are),
//   y[t] = (add ? y[t] : 0) + sum over t's lead entries i in the window, in k order, of lead_row(i)
// summed in RowSum's accumulator and rounded once; entry(i) is called for every entry i in the
// window (leads and members, in entry order), before the lead's row is read.
template <class Y, class LeadRow, class Entry>
void sum_leads(const RowRoute& route, RoundWindow win, Y* y, int64_t tokens, int64_t H, bool add,
               LeadRow&& lead_row, Entry&& entry) {
  using S = RowSum<Y>;
  const int K = route.top_k;
  std::vector<typename S::Acc> acc(static_cast<size_t>(H));
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t first = t * K;
    if (!combine_sums(route, win, first)) continue;
    Y* out = y + t * H;
    for (int64_t h = 0; h < H; ++h) acc[size_t(h)] = add ? S::load(out[h]) : typename S::Acc(0);
    for (int k = 0; k < K; ++k) {
      const int64_t i = first + k;
      if (!in_window(route, win, i)) continue;
      entry(i);
      if (lead_entry(route, win, first, k) != k) continue;
      const Y* r = lead_row(i);
      for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += S::load(r[h]);
    }
    for (int64_t h = 0; h < H; ++h) out[h] = S::store(acc[size_t(h)]);
  }
}

}  // namespace moe_echo::host_comm
