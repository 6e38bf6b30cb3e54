// Philox 4x32-10 as Triton's tl.randint4x(seed, offset) computes it, bit for bit: counter (offset lo, offset hi,
// 0, 0), key (seed lo, seed hi), ten rounds (philox4x32; pykernels.attention.philox4x32 in eager PyTorch). The
// dropout of every pykernels kernel decides an element on 16 of the 128 bits of the call at its row's counter plus
// column / 8 (kernels/_dropout.py): dropout_bits16 for one element (the reference the exchange below is tested
// against), the quad / octet exchange for the C++ attention's lane groups, keep_pack_bits for a pack (the C++
// LayerNorm), dropout_rate for the rate that p becomes. Host-callable too, so tests/test_csrc.py checks
// them on a CPU against the PyTorch reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define PK_HD __host__ __device__ __forceinline__
#else
#define PK_HD inline
#endif

namespace pykernels {

PK_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// The four output words of Philox-4x32-10 (Triton's tl.randint4x(seed, offset)) in o0..o3.
PK_HD void philox4x32(uint64_t seed, uint64_t offset, uint32_t& o0, uint32_t& o1, uint32_t& o2, uint32_t& o3) {
  uint32_t c0 = static_cast<uint32_t>(offset), c1 = static_cast<uint32_t>(offset >> 32), c2 = 0u, c3 = 0u;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    uint32_t hi_b, lo_b, hi_a, lo_a;
    mulhilo32(0xCD9E8D57u, c2, hi_b, lo_b);
    mulhilo32(0xD2511F53u, c0, hi_a, lo_a);
    const uint32_t n0 = hi_b ^ c1 ^ k0, n2 = hi_a ^ c3 ^ k1;
    c0 = n0;
    c1 = lo_b;
    c2 = n2;
    c3 = lo_a;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  o0 = c0;
  o1 = c1;
  o2 = c2;
  o3 = c3;
}

// The attention dropout's 16 random bits of key j of a query row (pykernels.attention.dropout_bits): word
// (j % 8) / 2 of Philox at counter row_counter + j / 8, its low half for even j.
PK_HD uint32_t dropout_bits16(uint64_t seed, uint64_t row_counter, uint32_t j) {
  uint32_t c0, c1, c2, c3;
  philox4x32(seed, row_counter + (j >> 3), c0, c1, c2, c3);
  const uint32_t q = (j & 7u) >> 1;  // selects, not an indexed array (which would live in local memory)
  const uint32_t w = q == 0u ? c0 : q == 1u ? c1 : q == 2u ? c2 : c3;
  return (j & 1u) ? (w >> 16) : (w & 0xFFFFu);
}

// Lanes that share Philox calls (the C++ attention: its mma / wgmma layouts spread the 8 keys of one call over a
// lane group). Each lane of the group draws one call (its own counter) and the group swaps words through xor
// shuffles: in round k, lane me receives from lane me ^ k what that lane's ``*_send`` picked for it, and folds it in
// with ``*_take``. Round 0 is the lane's own call. One call a lane instead of one an element; the mask is the same.
// * quad (4 lanes; the forward's and dQ kernels' layout: lane t4 holds columns 2 t4, 2 t4 + 1 of each 8-key tile):
//   lane t4 needs word t4 of every call (its two columns' 16 bits). Result: bits 2c + q, q = 0, 1, are the keep
//   bits of its columns 2 t4 + q in call c (the call lane c drew).
// * octet (8 lanes; the dK/dV kernels' transposed layout: lane g holds key g of each 8): lane g needs the 16 bits of
//   key g of every call. Result: bit c is the keep bit of its key in call c.
// Host-callable: tests/test_csrc.py runs the exchange on the host against dropout_bits16.
PK_HD uint32_t word_of(const uint32_t (&w)[4], int q) { return q == 0 ? w[0] : q == 1 ? w[1] : q == 2 ? w[2] : w[3]; }
PK_HD uint32_t quad_send(const uint32_t (&w)[4], int me, int k) { return word_of(w, me ^ k); }
PK_HD uint32_t quad_take(uint32_t bits, uint32_t v, int me, int k, uint32_t thr) {
  const uint32_t two = ((v & 0xFFFFu) >= thr ? 1u : 0u) | ((v >> 16) >= thr ? 2u : 0u);
  return bits | two << (2 * (me ^ k));
}
PK_HD uint32_t octet_send(const uint32_t (&w)[4], int me, int k) {
  const int to = me ^ k;
  const uint32_t v = word_of(w, to >> 1);
  return (to & 1) ? v >> 16 : v & 0xFFFFu;
}
PK_HD uint32_t octet_take(uint32_t bits, uint32_t v, int me, int k, uint32_t thr) {
  return bits | (v >= thr ? 1u : 0u) << (me ^ k);
}

// The keep bits (bit j for element off + j, kept where its 16 bits >= p 2^16) of P <= 8 - off consecutive elements
// of one Philox call's 8 (LayerNorm's packs: off 0, or 0 / 4 for 4-element fp32 packs). One call for the pack.
template <int P>
PK_HD uint32_t keep_pack_bits(uint64_t seed, uint64_t counter, int off, float p) {
  uint32_t c0, c1, c2, c3;
  philox4x32(seed, counter, c0, c1, c2, c3);
  const uint32_t thr = static_cast<uint32_t>(p * 65536.f);
  uint32_t bits = 0u;
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const int e = off + j, q = e >> 1;
    const uint32_t w = q == 0 ? c0 : q == 1 ? c1 : q == 2 ? c2 : c3;
    const uint32_t r = (e & 1) ? (w >> 16) : (w & 0xFFFFu);
    bits |= (r >= thr ? 1u : 0u) << j;
  }
  return bits;
}

// The dropout rate the kernels realise for p: p rounded to a multiple of 2^-16 (pykernels.attention.dropout_rate)
inline double dropout_rate(double p) {
  return p > 0.0 ? std::min(std::nearbyint(p * 65536.0), 65535.0) / 65536.0 : 0.0;
}

}  // namespace pykernels
