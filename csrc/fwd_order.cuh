// The warp-specialised attention forward's ordered walk (attention.cuh's attn_fwd_order_kernel, which sorts the
// sequences and writes the walk): which tile the t-th of the walk is, given the sorted ranks. Host-callable, so that
// tests/test_csrc.py checks the walk on a CPU: every tile once, rounds alternating direction.
#pragma once

#include "philox.cuh"  // (PK_HD)

namespace pykernels {
namespace attn {

struct OrderTile {
  int b, h, m;  // sequence (batch), head, query tile
};

// Tile t (t < pre[batch]) of the walk of a grid of g blocks over the ranks: seq[r] the sequence of rank r, pre[r] the
// tiles before it (Hq times the query tiles of the ranks before; pre[batch] all), m_of[b] sequence b's query tiles.
// Round t / g runs backwards where odd (the last round over its own tiles), then a binary search over pre finds the
// rank; a head's tiles longest first where causal.
PK_HD OrderTile order_tile(int t, int g, int batch, bool causal, const int* seq, const int* pre, const int* m_of) {
  const int n = pre[batch];
  const int round = t / g, k = t - round * g;
  const int base = round * g, width = n - base < g ? n - base : g;
  const int u = base + ((round & 1) ? width - 1 - k : k);
  int lo = 0, hi = batch;  // pre[lo] <= u < pre[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (pre[mid] <= u)
      lo = mid;
    else
      hi = mid;
  }
  OrderTile x;
  x.b = seq[lo];
  const int mq = m_of[x.b], w = u - pre[lo];
  x.h = w / mq;
  x.m = w - x.h * mq;
  if (causal) x.m = mq - 1 - x.m;
  return x;
}

}  // namespace attn
}  // namespace pykernels
