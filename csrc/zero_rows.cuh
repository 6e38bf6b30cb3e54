// Packed varlen attention: the rows of its outputs that no sequence holds (attention.h's ZeroRows), filled by some
// threads of a launch that runs anyway (the forward's order kernel, the backward's pre kernel), or by
// attention_varlen.cu's own launch where none does
#pragma once

#include <cstdint>

#include "attention.h"

namespace pykernels {
namespace attn {

// Threads [0, n_threads) (this one `tid`) fill each target's rows outside [cu[0], cu[batch]) (clamped to [0, rows]),
// in each of its slices: 16-byte units where the rows, slices and base allow them, else 4- or 2-byte ones. The bounds
// of every target are loaded first, together (one memory latency, not one a target: run311 timed the first version's
// launch at 3.2 us with nothing to fill). Nothing outside: no store.
__device__ __forceinline__ void fill_rows_outside(const ZeroRows& z, int64_t tid, int64_t n_threads) {
  int lo_at[3] = {0, 0, 0}, hi_at[3] = {0, 0, 0};
#pragma unroll
  for (int j = 0; j < 3; ++j)
    if (j < z.n) {
      lo_at[j] = z.t[j].cu[0];
      hi_at[j] = z.t[j].cu[z.batch];
    }
#pragma unroll
  for (int j = 0; j < 3; ++j) {
    if (j >= z.n) break;
    const ZeroRows::Target& t = z.t[j];
    const int64_t lo = min(max(static_cast<int64_t>(lo_at[j]), int64_t{0}), t.rows);
    const int64_t hi = max(min(static_cast<int64_t>(hi_at[j]), t.rows), lo);
    const int64_t out_rows = lo + (t.rows - hi);
    if (out_rows == 0) continue;
    const uintptr_t base = reinterpret_cast<uintptr_t>(t.ptr);
    const auto fits = [&](int u) { return t.row_bytes % u == 0 && t.outer_bytes % u == 0 && base % u == 0; };
    const int unit = fits(16) ? 16 : fits(4) ? 4 : 2;
    const int64_t per_row = t.row_bytes / unit, per_slice = out_rows * per_row, n0 = lo * per_row;
    for (int64_t i = tid; i < per_slice * t.outer; i += n_threads) {
      const int64_t sl = i / per_slice, w = i - sl * per_slice;
      const int64_t u = w < n0 ? w : hi * per_row + (w - n0);
      char* const q = static_cast<char*>(t.ptr) + sl * t.outer_bytes + u * unit;
      if (unit == 16)
        *reinterpret_cast<uint4*>(q) = make_uint4(t.fill, t.fill, t.fill, t.fill);
      else if (unit == 4)
        *reinterpret_cast<uint32_t*>(q) = t.fill;
      else
        *reinterpret_cast<uint16_t*>(q) = static_cast<uint16_t>(t.fill);
    }
  }
}

}  // namespace attn
}  // namespace pykernels
