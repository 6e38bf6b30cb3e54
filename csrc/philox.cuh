// Philox 4x32-7 as Triton's tl.randint4x(seed, offset, n_rounds=7) computes it, bit for bit: counter (offset lo,
// offset hi, 0, 0), key (seed lo, seed hi), kPhiloxRounds = 7 rounds (philox4x32; pykernels.attention.philox4x32 in
// eager PyTorch; seven as FlashAttention-2 and torch's flash backend, pykernels.attention.PHILOX_ROUNDS). The
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
#if defined(__CUDA_ARCH__)
  hi = __umulhi(a, b);  // one IMAD.WIDE; the 64-bit product's form added a zero to each high word (20 IADDs a call)
  lo = a * b;
#else
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
#endif
}

constexpr int kPhiloxRounds = 7;

// The four output words of Philox-4x32-7 (Triton's tl.randint4x(seed, offset, kPhiloxRounds)) in o0..o3.
PK_HD void philox4x32(uint64_t seed, uint64_t offset, uint32_t& o0, uint32_t& o1, uint32_t& o2, uint32_t& o3) {
  uint32_t c0 = static_cast<uint32_t>(offset), c1 = static_cast<uint32_t>(offset >> 32), c2 = 0u, c3 = 0u;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int i = 0; i < kPhiloxRounds; ++i) {
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
// lane group). Each lane of the group draws one call (its own counter), turns its 8 values into 8 keep bits
// (keep_byte: bit v for value v, the low half of word v / 2 for even v) and the group transposes those bits in
// xor-shuffle stages (transpose_stage): lane me's call is row me of a bit matrix whose column c the lane needs; at
// stage s, lanes me and me ^ s swap the off-diagonal blocks of fields s apart, so log2(group) shuffles give every
// lane its column. One call a lane instead of one an element; the mask is the same; no lane-dependent selects (an
// earlier exchange picked a word per lane and round: divergent branches, 159 instructions a call, run255).
// * quad (4 lanes; the forward's and dQ kernels' layout: lane t4 holds columns 2 t4, 2 t4 + 1 of each 8-key tile):
//   2-bit fields (a lane's two columns), stages s = 2, 1. Result: bits 2c + q, q = 0, 1, are the keep bits of its
//   columns 2 t4 + q in call c (the call lane c drew).
// * octet (8 lanes; the dK/dV kernels' transposed layout: lane g holds key g of each 8): 1-bit fields, stages
//   s = 4, 2, 1. Result: bit c is the keep bit of its key in call c.
// Host-callable: tests/test_csrc.py runs the stages on the host against dropout_bits16. (The attention forwards take
// attention.cuh's keep_byte_carry instead of keep_byte: the same bits by an add.cc / addc chain, device only.)
PK_HD uint32_t keep_byte(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, uint32_t thr) {
  const uint32_t w[4] = {w0, w1, w2, w3}, hi = thr << 16;  // a half >= thr iff it, moved to the top, is >= thr 2^16
  uint32_t bits = 0u;
#pragma unroll
  for (int q = 0; q < 4; ++q) bits |= ((w[q] << 16) >= hi ? 1u : 0u) << (2 * q) | (w[q] >= hi ? 1u : 0u) << (2 * q + 1);
  return bits;
}
// Stage s of the transpose for a lane holding x that received y from lane me ^ s: F-bit fields, s F bits apart
// (lo: the fields whose index has bit s clear); ``upper``: me & s.
template <int F>
PK_HD uint32_t transpose_stage(uint32_t x, uint32_t y, int s, bool upper) {
  const int shift = s * F;
  const uint32_t lo = F == 2 ? (s == 2 ? 0x0Fu : 0x33u) : (s == 4 ? 0x0Fu : s == 2 ? 0x33u : 0x55u);
  return upper ? (x & (lo << shift)) | ((y >> shift) & lo) : (x & lo) | ((y & lo) << shift);
}

// The keep bits (bit j for element off + j, kept where its 16 bits >= p 2^16) of P <= 8 - off consecutive elements
// of one Philox call's 8 (LayerNorm's packs: off 0, or 0 / 4 for 4-element fp32 packs). One call for the pack: the
// call's keep_byte shifted to the pack.
template <int P>
PK_HD uint32_t keep_pack_bits(uint64_t seed, uint64_t counter, int off, float p) {
  uint32_t c0, c1, c2, c3;
  philox4x32(seed, counter, c0, c1, c2, c3);
  return (keep_byte(c0, c1, c2, c3, static_cast<uint32_t>(p * 65536.f)) >> off) & ((1u << P) - 1u);
}

#if defined(__CUDACC__)
// The dropout seed lives in device memory (a (1,) int64 tensor drawn on the device: csrc/dispatch.h's draw_seed,
// pykernels._rng.op_seed), never in a launch argument, so that a CUDA graph's replay reads the seed its generator drew
// for that replay instead of the one frozen into the captured launch. A kernel whose tile loops use it copies it into
// shared memory once (drop_seed_init: one thread, one barrier, the condition uniform over the block) and reads it at
// each use with a volatile shared load (drop_seed): held in a register, the 64-bit seed stays live across the loops
// (ptxas hoists a plain load of it out of them), which took the wgmma backward at D = 64 from 12 to 104 bytes of spill.
__device__ __forceinline__ uint64_t* drop_seed_slot() {
  __shared__ uint64_t slot;
  return &slot;
}
__device__ __forceinline__ void drop_seed_init(bool dropout, const int64_t* seed) {
  if (dropout) {
    if (threadIdx.x == 0) *drop_seed_slot() = static_cast<uint64_t>(*seed);
    __syncthreads();
  }
}
// (the low word only: seeds are drawn in [0, 2^31), so the key's high word is a known 0, which frees a register and
// folds that half of the key schedule to constants)
__device__ __forceinline__ uint64_t drop_seed() {
  uint32_t v;
  asm volatile("ld.volatile.shared.u32 %0, [%1];"
               : "=r"(v)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(drop_seed_slot()))));
  return v;
}
// A plain read, which ptxas may hoist into a register for the whole kernel: for kernels with registers to spare (the
// forwards), where the volatile read's latency at each use cost more than the register
__device__ __forceinline__ uint64_t drop_seed_reg() { return *reinterpret_cast<const uint32_t*>(drop_seed_slot()); }
#endif

// The dropout rate the kernels realise for p: p rounded to a multiple of 2^-16 (pykernels.attention.dropout_rate)
inline double dropout_rate(double p) {
  return p > 0.0 ? std::min(std::nearbyint(p * 65536.0), 65535.0) / 65536.0 : 0.0;
}

}  // namespace pykernels
