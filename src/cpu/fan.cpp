// Fan out and fan in: the receiver's side of a token's members (FanTable in comm.hpp). A token's
// row arrives once per rank in its lead row; fan_out copies it (weighted, and with the
// combine-weight gradient when asked) to every member row, fan_in sums the members' rows back into
// the lead row. Only valid rows of the window are read; only member rows (fan_out) or lead rows
// (fan_in) are written; with a chunk (FanArgs::chunk), those of its leads only.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/cpu_ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cpu {
namespace {

// Member m of lead row p of the fan table `members` [rows, K], or -1 past the last one. Member
// rows must be valid rows.
int64_t member(const Tensor& members, int64_t p, int64_t m, int64_t valid) {
  const int64_t K = members.size(1);
  if (m >= K) return -1;
  const int64_t j = members.as<int32_t>()[p * K + m];
  MOE_ECHO_CHECK(j < valid, "fan table: member " << m << " of lead row " << p << " is row " << j
                                                 << ", outside the " << valid << " valid rows");
  return j < 0 ? -1 : j;
}

bool is_lead(const Tensor& members, int64_t p) {
  return members.as<int32_t>()[p * members.size(1)] == p;
}

// The lead rows [lo, hi) an op visits: a chunk's rows (FanArgs::chunk; fan_in from row 0) within
// the valid ones, or all of them.
struct Visit {
  int64_t lo = 0, hi = 0;
  int64_t last_lo = 0, last_hi = 0;  // fan_in with a chunk: leads whose last member is in them
};
Visit visit(const int32_t* chunk, int64_t valid, bool by_last) {
  if (!chunk) return {0, valid, 0, 0};
  const int64_t lo = chunk[0], hi = std::min<int64_t>(chunk[1], valid);
  return by_last ? Visit{0, hi, lo, chunk[1]} : Visit{lo, hi, 0, 0};
}

// The largest member row of lead row p.
int64_t last_member(const Tensor& members, int64_t p) {
  const int64_t K = members.size(1);
  int64_t last = p;
  for (int64_t m = 0; m < K && members.as<int32_t>()[p * K + m] >= 0; ++m)
    last = std::max<int64_t>(last, members.as<int32_t>()[p * K + m]);
  return last;
}

}  // namespace

template <class T>
void fan_out(const FanArgs& a) {
  const int64_t H = a.src.size(1), K = a.members.size(1), valid = valid_rows(a.window);
  const bool weighted = a.weights.data != nullptr, grad = a.d_weight.data != nullptr;
  MOE_ECHO_CHECK(!(weighted && a.dst.data == a.src.data),
                 "fan_out in place (dst == src) copies unweighted: pass no weights");
  MOE_ECHO_CHECK(!grad || a.other.data != nullptr, "fan_out: d_weight needs `other`");
  std::vector<double> lead(static_cast<size_t>(H));
  const Visit v = visit(a.chunk, valid, false);
  for (int64_t p = v.lo; p < v.hi; ++p) {
    if (!is_lead(a.members, p)) continue;
    const T* s = a.src.as<T>() + p * H;
    for (int64_t h = 0; h < H; ++h) lead[size_t(h)] = double(s[h]);
    for (int64_t m = 0; m < K; ++m) {
      const int64_t j = member(a.members, p, m, valid);
      if (j < 0) break;
      if (grad) {
        const T* o = a.other.as<T>() + j * H;
        double dot = 0;
        for (int64_t h = 0; h < H; ++h) dot += lead[size_t(h)] * double(o[h]);
        a.d_weight.as<T>()[j] = T(dot);
      }
      const double w = weighted ? double(a.weights.as<T>()[p * K + m]) : 1.0;
      T* d = a.dst.as<T>() + j * H;
      for (int64_t h = 0; h < H; ++h) d[h] = T(w * lead[size_t(h)]);
    }
  }
}

template <class T>
void fan_in(const FanArgs& a) {
  const int64_t H = a.src.size(1), K = a.members.size(1), valid = valid_rows(a.window);
  const bool weighted = a.weights.data != nullptr;
  std::vector<double> acc(static_cast<size_t>(H));
  const Visit v = visit(a.chunk, valid, true);
  for (int64_t p = v.lo; p < v.hi; ++p) {
    if (!is_lead(a.members, p)) continue;
    if (a.chunk) {
      const int64_t last = last_member(a.members, p);
      if (last < v.last_lo || last >= v.last_hi) continue;
    }
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t m = 0; m < K; ++m) {
      const int64_t j = member(a.members, p, m, valid);
      if (j < 0) break;
      const double w = weighted ? double(a.weights.as<T>()[p * K + m]) : 1.0;
      const T* s = a.src.as<T>() + j * H;
      for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += w * double(s[h]);
    }
    T* d = a.dst.as<T>() + p * H;
    for (int64_t h = 0; h < H; ++h) d[h] = T(acc[size_t(h)]);
  }
}

void fan_out_fp8(const Fp8FanArgs& a) {
  const int64_t HT = check_fp8_fan_args(a), H = a.q.size(1), pitch = fp8_packed_row_bytes(H);
  const int64_t valid = valid_rows(a.window);
  const Visit v = visit(a.chunk, valid, false);
  for (int64_t p = v.lo; p < v.hi; ++p) {
    if (!is_lead(a.members, p)) continue;
    const uint8_t* row = a.src.as<uint8_t>() + p * pitch;
    for (int64_t m = 0;; ++m) {
      const int64_t j = member(a.members, p, m, valid);
      if (j < 0) break;
      std::copy(row, row + H, a.q.as<uint8_t>() + j * H);
      std::memcpy(a.scale.as<float>() + j * HT, row + H, size_t(HT) * sizeof(float));
    }
  }
}

MOE_ECHO_CPU_INSTANTIATE(fan_out, FanArgs);
MOE_ECHO_CPU_INSTANTIATE(fan_in, FanArgs);

}  // namespace moe_echo::cpu
