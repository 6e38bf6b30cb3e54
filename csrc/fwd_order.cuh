// The warp-specialised attention forward's walks over its tiles: the ordered walk over packed sequences
// (attention.cuh's attn_fwd_order_kernel sorts the sequences and writes it: which tile the t-th of the walk is, given
// the sorted ranks), and the dense walk (tile_of, TileWalk). Host-callable, so that tests/test_csrc.py checks both on a
// CPU: every tile once, rounds alternating direction; TileWalk's steps equal to tile_of's divisions.
#pragma once

#include <cstdint>

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

// The warp-specialised forward's walk over dense tiles (attention.cuh's tile_at and its consumers' TileWalk): tile t of
// a persistent grid of g blocks is query tile m of (head h, batch b), t = (b Hq + h) n_m + m, the query tiles of a
// causal head in alternate rounds (t / g) last first where g is no multiple of n_m (``flip``: causal and
// alternating). Host-callable: tests/test_csrc.py checks TileWalk against tile_of on a CPU.
struct Tile {
  int m, h, b;
};
PK_HD Tile tile_of(int64_t t, int n_m, int hq, unsigned g, bool flip) {
  const int64_t bh = t / n_m;
  Tile x;
  x.m = static_cast<int>(t - bh * n_m);
  if (flip && (g % n_m != 0 || ((t / g) & 1) == 0)) x.m = n_m - 1 - x.m;
  x.h = static_cast<int>(bh % hq);
  x.b = static_cast<int>(bh / hq);
  return x;
}
// tile_of's tiles t0, t0 + g, ... stepped by additions, the step's quotients by n_m and Hq found once
// (g = (qq Hq + rq) n_m + rm), so that no tile divides (tile_of's 64-bit divisions at each tile's start, in the
// producer and in every consumer warp, held 3% of the BERT-base forward's stall samples, H200 run322). t0 < g.
struct TileWalk {
  int m, h, b, round;  // tile_of's m before the flip, h, b; the round (t / g)
  int rm, rq, qq;
  PK_HD TileWalk(int g, int t0, int n_m, int hq) {
    const int qg = g / n_m, bh = t0 / n_m;
    rm = g - qg * n_m;
    qq = qg / hq;
    rq = qg - qq * hq;
    m = t0 - bh * n_m;
    b = bh / hq;
    h = bh - b * hq;
    round = 0;
  }
  PK_HD void next(int n_m, int hq) {
    m += rm;
    const int c1 = m >= n_m ? 1 : 0;
    m -= c1 * n_m;
    h += rq + c1;  // (< 2 Hq)
    const int c2 = h >= hq ? 1 : 0;
    h -= c2 * hq;
    b += qq + c2;
    ++round;
  }
  PK_HD Tile tile(int n_m, int g, bool flip) const {
    const bool f = flip && (g % n_m != 0 || (round & 1) == 0);
    return {f ? n_m - 1 - m : m, h, b};
  }
};

// The three-consumer forward's walk over 64-row units that may mix heads (attention.cuh's kMix): unit u is query rows
// 64 m .. 64 m + 63 of head (b, h), u = (b Hq + h) n_u + m, n_u = ceil(Sq / 64) a head, ``units`` = n_u Hq B in all;
// tile t is units 3 t, 3 t + 1, 3 t + 2, one a consumer warpgroup w, so that no warpgroup computes rows past a head's
// sequence but in the walk's last tile (units past the last: the last head's rows past its sequence, whose products
// run and are never stored). With n_u >= 2 a tile meets at most two heads: the first unit's (A) and the last's (B).
// Where they differ (``step`` 2) the producer streams the tile's key blocks A's and B's in turn (A's block j at the
// tile's ring position 2 j, B's at 2 j + 1), and a warpgroup of B (``second``) takes the odd positions; else
// (``step`` 1) the one head's blocks one after the other, as the other tiles of the kernel.
struct MixRows {
  int m, h, b;  // warpgroup w's unit: query block m of head h, batch b
  int step;     // 2 where the tile meets two heads, else 1
  int second;   // 1 where warpgroup w's head is the tile's second (its ring positions odd), else 0
};
PK_HD MixRows mix_rows(int t, int w, int n_u, int hq, int units) {
  const int u = 3 * t + w, last = units - 1;
  const int a = 3 * t / n_u, z = (3 * t + 2 < units ? 3 * t + 2 : last) / n_u, me = (u < units ? u : last) / n_u;
  MixRows x;
  x.m = u - me * n_u;
  x.b = me / hq;
  x.h = me - x.b * hq;
  x.step = a != z ? 2 : 1;
  x.second = me != a ? 1 : 0;
  return x;
}
PK_HD Tile mix_tile(const MixRows& r) { return {r.m, r.h, r.b}; }
// mix_rows's tiles t0, t0 + g, ... of a grid of g blocks, stepped by additions (as TileWalk): the consumers' divisions
// would leave their rows and head in vector registers, where these sums stay uniform (ptxas: 450-500 bytes of spills
// in the softmax at the consumers' 160 registers with mix_rows there, 8 this way, in the dropout path's set-up once a
// tile). t0 < g; 3 (t0 + g) within int32.
struct MixWalk : TileWalk {  // TileWalk over the units, 3 g of them a round: its m, h, b the tile's first unit's
  PK_HD MixWalk(int g, int t0, int n_u, int hq) : TileWalk(3 * g, 3 * t0, n_u, hq) {}
  // mix_rows(t, w, ...) of this tile t: warpgroup w's unit (of nw a tile) is in the next head where m + w passes the
  // head's n_u units, if there is a next head (else it is a unit past the last: the last head's rows past its end)
  PK_HD MixRows rows(int w, int nw, int n_u, int hq, int batch) const {
    const int hn = h + 1 == hq ? 0 : h + 1, bn = h + 1 == hq ? b + 1 : b;
    const bool more = bn < batch, second = more && m + w >= n_u;
    MixRows x;
    x.m = second ? m + w - n_u : m + w;
    x.h = second ? hn : h;
    x.b = second ? bn : b;
    x.step = more && m + nw - 1 >= n_u ? 2 : 1;
    x.second = second ? 1 : 0;
    return x;
  }
};

}  // namespace attn
}  // namespace pykernels
