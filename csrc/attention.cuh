// Scaled dot-product attention's CUDA kernels, forward and backward, and their launchers: the device half of
// torch.ops.pykernels_cuda.attention (attention.cpp: inputs, outputs, autograd, registration), the CUDA backend of
// pykernels.scaled_dot_product_attention and pykernels.varlen_attention. Included by the four translation units
// attention_{fwd,bwd}_{fp16,bf16}.cu, each instantiating one launcher.
//
// Algorithm: FlashAttention-2 on the warp-level tensor-core instruction mma.sync.m16n8k16 (fp16 / bf16 operands,
// fp32 accumulators), tiles staged in shared memory by cp.async and read into fragments by ldmatrix. Rows of
// shared tiles are padded by 16 bytes, so the 8 rows an ldmatrix reads fall in distinct banks.
//   forward : a block of 4 warps per (64 queries, head, batch); each warp owns 16 query rows and walks the key
//             blocks (64 keys, 32 above D = 128): S = Q K^T, an online softmax in the log2 domain (running max
//             and sum per row, one rescale of the O accumulator a block), O += P V with P taken straight from
//             S's accumulator registers as the A operand (the m16n8 accumulator layout of two n-tiles is the
//             m16k16 A layout). K and V are single-buffered but loaded asynchronously: the next K block is in
//             flight while P V runs and the next V block while the next S runs. Saves lse (natural log, fp32).
//   backward: three kernels, no atomics (bitwise reproducible; on Hopper at D <= 128 the fused kernel below
//             instead, whose dQ is summed by bulk reductions, unless the backward must be deterministic):
//             pre  : delta = rowsum(dO * O) (fp32), one warp a row;
//             dK/dV: a block per (64 keys, kv head, batch; and a half of the head dim above D = 128, where the
//                    two accumulators would not fit in registers), looping over the query heads of its group
//                    (GQA) and their blocks of 32 queries: S^T = K Q^T, P^T = exp2(S^T - lse), dV += P^T dO,
//                    dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q;
//             dQ   : a block per (64 queries, head, batch) looping over key blocks: dQ += dS K.
//   Every product is one of two helpers on a warp's 16 rows: mma_abt (A B^T, A from registers or a shared tile:
//   S, S^T, dP, dP^T) and mma_acc_b (A B with A in accumulator registers: P V, P^T dO, dS^T Q, dS K).
// Masks: the forward and dQ kernels take the mask's mode as a template flag (MaskMode, chosen on the host), so the
// unmasked kernel's softmax carries no mask code at all. A mask of batch and key only (key padding; strides 0 over
// heads and queries) is read once a key (into shared memory; registers in dK/dV); the forward and dQ blocks first
// find the batch's valid key range [lo, hi) (key_range: the threads scan the mask row together) and visit only the
// key blocks that meet it, and a dK/dV block whose 64 keys are all masked writes zeros without visiting a query.
// Any other mask is read once an element through an out-of-line call.
// Semantics are pykernels.attention's: top-left causal (query i sees keys j <= i), a boolean (True = take part)
// or additive mask read through its strides (stride 0 where it broadcasts), rows with no key to attend to give
// output 0, lse -inf and zero gradients; dropout keeps an element where 16 bits of philox(seed, ((b Hq + h) Sq + i)
// ceil(Sk / 8) + j / 8) are >= p 2^16 (philox.cuh: Triton's tl.randint4x bit for bit, one call shared by the lanes
// holding its 8 keys, so the mask
// is the Triton kernels' and pykernels.attention_dropout_mask's; varlen: Sq, Sk = the max lengths, i, j inside the
// sequence).
// Cover (checked in Python first, pykernels/attention.py _cuda_cover; the TORCH_CHECKs here name what they
// reject): fp16 / bf16; q, k, v of one head dim D, a multiple of 8 up to 256 (computed at the next of
// 32, 64, 96, 128, 192, 256, the padding columns zero-filled); unit last stride (other strides any: rows are
// read through them; a tensor whose rows are not 16-byte aligned is copied); batch and heads up to 65535;
// int64 offsets throughout.
// On Hopper (sm_90a build, 9.0 device) the forward and the dQ and dK/dV kernels at head dims up to 128 run on
// warpgroup MMA instead (plan_of(p).sm90): the forward is warp-specialised (attn_fwd_sm90_ws_kernel: a producer
// warpgroup, two consumer warpgroups taking turns, a persistent grid); see the design notes above attn_fwd_sm90_kernel,
// attn_fwd_sm90_ws_kernel and attn_bwd_sm90_kernel.
// Measured (H100, graph replay, run234; benchmarks/results/HISTORY.md, twenty-seventh session): BERT-base 283 / 225
// TFLOP/s forward / backward (FlashAttention-2's 237 / 156, the Triton path's 330 / 295, cuDNN's 352 / 247), key
// padding 253 / 222, GPT-2 194 / 194, so pykernels takes it when named, and under auto only for eager calls with
// dropout (where its C++ autograd's host time wins: pykernels/attention.py AUTO_CUDA_DROPOUT). Every element test (the tile's edge:
// keys past the sequence or above the diagonal; dropout; the mask's kind) is a compile-time flag split at the call
// (with_flag) or a template mask mode: as run-time tests inside the unrolled element loops they compiled to
// branches that cost the forward 30% and the backward 35% (run215-216, run219). The mma.sync kernels: the mask
// mode as a template flag took the unmasked forward from 111 to 161 TFLOP/s (run200 -> run202); double-buffered
// tiles and two m-tiles a warp measured slower (run198-199).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "attention.h"
#include "pack.cuh"
#include "fwd_order.cuh"
#include "zero_rows.cuh"
#include "pdl.cuh"
#include "philox.cuh"
#include "wgmma.cuh"

namespace pykernels {
namespace attn {

constexpr int kThreads = 128;  // 4 warps a block, every kernel
constexpr int kRows = 64;      // query rows (forward, dQ) or key rows (dK/dV) a block: 16 a warp

// ---------------------------------------------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, zero-filled (nothing read) when !valid
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c (16x8 fp32) += a (16x16, row) * b (16x8, col)
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                   uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// The A operand (16 rows x 16 k) of two accumulator n-tiles c0 (k 0-7) and c1 (k 8-15) of 16 rows each
template <typename T>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}

// ldmatrix lane addresses in a shared tile of row stride LD elements. A operand (16 rows from r0, 16 k from c0):
template <typename T, int LD>
__device__ __forceinline__ uint32_t a_addr(const T* s, int r0, int c0, int lane) {
  const int mi = lane >> 3, rr = lane & 7;
  return smem_addr(s + (r0 + (mi & 1) * 8 + rr) * LD + c0 + (mi >> 1) * 8);
}
// B operand of two n-tiles (n0, n0 + 8) from a [n][k] tile (non-transposed ldmatrix), k from c0
template <typename T, int LD>
__device__ __forceinline__ uint32_t b_addr(const T* s, int n0, int c0, int lane) {
  const int mi = lane >> 3, rr = lane & 7;
  return smem_addr(s + (n0 + (mi >> 1) * 8 + rr) * LD + c0 + (mi & 1) * 8);
}
// B operand of two n-tiles (c0, c0 + 8) from a [k][n] tile (transposed ldmatrix), k from r0
template <typename T, int LD>
__device__ __forceinline__ uint32_t bt_addr(const T* s, int r0, int c0, int lane) {
  const int mi = lane >> 3, rr = lane & 7;
  return smem_addr(s + (r0 + (mi & 1) * 8 + rr) * LD + c0 + (mi >> 1) * 8);
}

// Rows [0, nrows) of a R x D tile from global rows g + r * stride (columns past d and rows past nrows zero-filled)
template <typename T, int R, int D>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t stride, int nrows, int d, int tid) {
  constexpr int C = D / 8, LD = D + 8;
#pragma unroll 4
  for (int i = tid; i < R * C; i += kThreads) {
    const int r = i / C, c = i % C;
    const bool ok = r < nrows && c * 8 < d;
    cp_async16(smem_addr(s + r * LD + c * 8), ok ? g + r * stride + c * 8 : g, ok);
  }
}

// The two tile products every kernel is made of, for one warp's 16 rows (N, K multiples of 16):
// acc (16 x N) += A (16 x K) B^T, B N rows of a [n][k] shared tile; a_of(kt, a) gives A's fragment of k-step kt
// (from registers, or ldmatrix from a shared tile: smem_rows)
template <typename T, int LD, int K, int N, typename AF>
__device__ __forceinline__ void mma_abt(float (&acc)[N / 8][4], AF&& a_of, const T* sB, int lane) {
#pragma unroll
  for (int kt = 0; kt < K / 16; ++kt) {
    uint32_t a[4];
    a_of(kt, a);
#pragma unroll
    for (int nt = 0; nt < N / 8; nt += 2) {
      uint32_t bf[4];
      ldsm_x4(bf, b_addr<T, LD>(sB, nt * 8, kt * 16, lane));
      mma<T>(acc[nt], a, bf[0], bf[1]);
      mma<T>(acc[nt + 1], a, bf[2], bf[3]);
    }
  }
}
// A's fragments for mma_abt: 16 rows from r0 of a [m][k] shared tile
template <typename T, int LD>
__device__ __forceinline__ auto smem_rows(const T* s, int r0, int lane) {
  return [=](int kt, uint32_t(&a)[4]) { ldsm_x4(a, a_addr<T, LD>(s, r0, kt * 16, lane)); };
}
// acc (16 x N) += A (16 x K) B: A in accumulator registers (K / 8 n-tiles of 16 rows, as an mma left them: P, dS),
// B the K x N block from column c0 of a [k][n] shared tile, read transposed
template <typename T, int LD, int K, int N>
__device__ __forceinline__ void mma_acc_b(float (&acc)[N / 8][4], const float (&s)[K / 8][4], const T* sB, int c0,
                                          int lane) {
#pragma unroll
  for (int kt = 0; kt < K / 16; ++kt) {
    uint32_t a[4];
    acc_to_a<T>(a, s[2 * kt], s[2 * kt + 1]);
#pragma unroll
    for (int nt = 0; nt < N / 8; nt += 2) {
      uint32_t bf[4];
      ldsm_x4_t(bf, bt_addr<T, LD>(sB, kt * 16, c0 + nt * 8, lane));
      mma<T>(acc[nt], a, bf[0], bf[1]);
      mma<T>(acc[nt + 1], a, bf[2], bf[3]);
    }
  }
}
template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// ---------------------------------------------------------------------------------------------------------------
// Element rules shared by the kernels
// ---------------------------------------------------------------------------------------------------------------
struct Seq {
  int64_t q_off, k_off;  // first row of the sequence (varlen), else 0
  int sq, sk;
};

__device__ __forceinline__ Seq seq_of(const Params& p, int b) {
  Seq s;
  if (p.cu_q != nullptr) {
    s.q_off = p.cu_q[b];
    s.sq = p.cu_q[b + 1] - p.cu_q[b];
    s.k_off = p.cu_k[b];
    s.sk = p.cu_k[b + 1] - p.cu_k[b];
  } else {
    s.q_off = s.k_off = 0;
    s.sq = p.sq;
    s.sk = p.sk;
  }
  return s;
}

// Params::dq_acc's leading dim and the rows of a slice: (B, Sq) dense, (1, T) over packed varlen sequences
__host__ __device__ __forceinline__ int64_t dq_acc_batch(const Params& p) { return p.cu_q != nullptr ? 1 : p.batch; }
__host__ __device__ __forceinline__ int64_t dq_acc_rows(const Params& p) { return p.cu_q != nullptr ? p.tq : p.sq; }

// The mask's addend in log2 units at element offset ``off``
__device__ __forceinline__ float mask_log2_at(const void* mask, int kind, int64_t off) {
  switch (kind) {
    case kBoolMask: return static_cast<const bool*>(mask)[off] ? 0.f : -INFINITY;
    case kF32Mask: return static_cast<const float*>(mask)[off] * kLog2e;
    case kF16Mask: return __half2float(static_cast<const __half*>(mask)[off]) * kLog2e;
    case kBF16Mask: return __bfloat162float(static_cast<const __nv_bfloat16*>(mask)[off]) * kLog2e;
    case kF64Mask: return static_cast<float>(static_cast<const double*>(mask)[off]) * kLog2e;
    default: return 0.f;
  }
}
// The same out of line, for the tiles' unrolled loops (an element each)
static __device__ __noinline__ float mask_log2(const void* mask, int kind, int64_t off) {
  return mask_log2_at(mask, kind, off);
}

// How a kernel reads the mask, a template flag of every kernel but the delta one, chosen on the host (mask_mode):
// none; key-only (key padding: an addend a key of the batch, read once a key, and the key blocks outside the batch's
// valid range skipped); any other (read once an element). (The dK/dV kernels decided at run time until run219: a
// per-element branch in their unrolled loops.)
enum MaskMode : int { kModeNone = 0, kModeKeys = 1, kModeAny = 2 };

inline int mask_mode(const Params& p) {
  return p.mask_kind == kNoMask ? kModeNone : p.mask_keys ? kModeKeys : kModeAny;
}

// The warp-specialised forward's sequence b with Params::kv_range (kRange: a boolean key-padding mask split in two
// launches, fwd_key_ranges): the unmasked kernel (MODE kModeNone) takes the batches whose valid keys are one run
// [lo, hi) (kv_range's dense flag; key_run) as sequences of keys lo .. hi - 1, masked by index past the run's end as
// any sequence's last key block, and skips the others (sq 0: no tile); the key-mask kernel (kModeKeys) skips those
// and takes the others as without the split
// (with dropout only a run from key 0, which attn_kv_range_kernel's flag says: the keep bits' Philox counters count
// keys from the row's first, 8 a call; a condition on lo here made ptxas serialize the key-mask kernel's wgmma chains)
__device__ __forceinline__ bool key_run(const int* r) { return r[2] != 0; }
template <int MODE, bool kRange>
__device__ __forceinline__ Seq ws_seq(const Params& p, int b) {
  Seq s = seq_of(p, b);
  if constexpr (kRange) {
    const int* r = p.kv_range + 3 * b;
    const bool dense = key_run(r);
    if constexpr (MODE == kModeNone) {
      if (dense) {
        s.k_off = r[0];
        s.sk = r[1] - r[0];
      } else {
        s.sq = 0;
      }
    } else if (dense) {
      s.sq = 0;
    }
  }
  return s;
}

// The scaled score (log2 units) of query i and key j, -inf where masked. ``edge``: the tile may hold keys past
// the sequence or above the causal diagonal (a compile-time constant where the caller splits on it: with_flag).
// ``kb``: key j's addend of a key-only mask (kModeKeys); other masks are read here, only inside the (sq, sk)
// rectangle.
template <int MODE>
__device__ __forceinline__ float score(const Params& p, float acc, int b, int h, int i, int j, int sq, int sk,
                                       bool edge, float kb) {
  float x = acc * p.scale_log2;
  if constexpr (MODE == kModeKeys) x += kb;
  if constexpr (MODE == kModeAny)
    x = i < sq && j < sk ? x + mask_log2(p.mask, p.mask_kind, b * p.m_sb + h * p.m_sh + i * p.m_sq + j * p.m_sk)
                         : -INFINITY;
  if (edge) {  // (a constant at the call sites: with_flag)
    const int lim = p.causal ? min(sk, i + 1) : sk;  // keys j < lim take part
    x = j < lim ? x : -INFINITY;
  }
  return x;
}

// f(std::true_type) or f(std::false_type) as ``flag`` is: the element code compiled twice, so that a block without
// keys past the sequence or above the diagonal (edge) or a call without dropout runs none of their tests (run215:
// the per-element tests as branches cost the forward 30%)
template <typename F>
__device__ __forceinline__ void with_flag(bool flag, F&& f) {
  if (flag)
    f(std::true_type{});
  else
    f(std::false_type{});
}

// A key-only mask's addend for key j of batch b (-inf past the sequence); 0 without one. Inline by default (the
// forward and dQ kernels read it a block ahead of its use, which an out-of-line call would wait for); the dK/dV
// kernel, which reads it once, calls out of line (inline, its D = 64 kernel spills 8 bytes more at 168 registers).
template <bool kInline = true>
__device__ __forceinline__ float key_bias(const Params& p, int b, int j, int sk) {
  if (p.mask_kind == kNoMask || !p.mask_keys) return 0.f;
  if (j >= sk) return -INFINITY;
  const int64_t off = b * p.m_sb + j * p.m_sk;
  return kInline ? mask_log2_at(p.mask, p.mask_kind, off) : mask_log2(p.mask, p.mask_kind, off);
}

// The keys [lo, hi) of [0, n) outside which batch b's key-only mask masks every key (lo >= hi: it masks them all),
// found by NT threads together (thread tid scans keys tid, tid + NT, ...; each warp reduces by shuffles, then every
// thread reads the warps' partials from ``red`` (2 NT / 32 ints) after ``sync()``, the threads' barrier): the
// forward and dQ kernels visit only the key blocks that meet it. ``red`` is read after the barrier, so a caller that
// calls again alternates two buffers (the warp-specialised producer) or has a barrier between the calls.
template <int NT, int UNROLL, typename Sync>
__device__ __forceinline__ int2 key_range(const Params& p, int b, int n, int sk, int tid, int* red, Sync&& sync) {
  static_assert(NT % 32 == 0, "whole warps");
  int lo = n, hi = 0;
#pragma unroll UNROLL
  for (int j = tid; j < n; j += NT) {
    if (key_bias(p, b, j, sk) != -INFINITY) {
      lo = min(lo, j);
      hi = j + 1;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  if ((tid & 31) == 0) {
    red[2 * (tid >> 5)] = lo;
    red[2 * (tid >> 5) + 1] = hi;
  }
  sync();
#pragma unroll
  for (int w = 0; w < NT / 32; ++w) {
    lo = min(lo, red[2 * w]);
    hi = max(hi, red[2 * w + 1]);
  }
  return make_int2(lo, hi);
}
// The whole block's (NT threads, __syncthreads)
template <int NT = kThreads>
__device__ __forceinline__ int2 key_range(const Params& p, int b, int n, int sk) {
  __shared__ int red[2 * NT / 32];
  return key_range<NT, 4>(p, b, n, sk, threadIdx.x, red, [] { __syncthreads(); });
}

// A key-only mask's addends of key block nb (keys nb BC .. nb BC + BC - 1, a thread a key) go to buf[nb % 2] before
// the barrier that precedes their use, read from global memory a block earlier into ``next``, so that the read's
// latency hides behind a block's work. key_addends_first reads the first block's (nb0; none when nb0 >= nb1);
// key_addends(nb) stores block nb's and reads block nb + 1's (-inf from nb1 on).
template <int BC>
__device__ __forceinline__ float key_addends_first(const Params& p, int b, int nb0, int nb1, int sk) {
  return threadIdx.x < BC && nb0 < nb1 ? key_bias(p, b, nb0 * BC + threadIdx.x, sk) : 0.f;
}
template <int BC>
__device__ __forceinline__ void key_addends(const Params& p, float (&buf)[2][BC], float& next, int nb, int nb1, int b,
                                            int sk) {
  if (threadIdx.x < BC) {
    buf[nb & 1][threadIdx.x] = next;
    next = nb + 1 < nb1 ? key_bias(p, b, (nb + 1) * BC + threadIdx.x, sk) : -INFINITY;
  }
}

// Dropout keeps (b, h, i, j) where 16 bits of Philox at ((b Hq + h) Sq + i) ceil(Sk / 8) + j / 8 are >= p 2^16
// (p a multiple of 2^-16; the Triton kernels' mask), and scales it by 1 / (1 - p). One Philox call serves 8 keys of a
// query row; the lanes that hold them share it (philox.cuh's quad / octet transpose): a lane draws one call for every
// 8 elements it holds instead of one an element (which cost the attention with dropout 1.5-2x the time of the
// Triton kernels', run244). Inline in the wgmma kernels (their calls overlap; with the transpose 1.41-1.50x faster
// forward and backward with dropout than an out-of-line exchange of words, H200 run255); out of line in the mma.sync
// kernels (inline, their dK/dV kernel with an element mask spilled 144-168 bytes around it).
struct DropRows {
  uint64_t rows0;   // counter row of query 0 of (b, h): (b Hq + h) Sq
  uint64_t groups;  // Philox calls a query row: ceil(Sk / 8)
  // the counter of query row i's first call (keys 0-7); key block j / 8's is this plus j / 8
  __device__ __forceinline__ uint64_t row_ctr(int i) const { return (rows0 + static_cast<uint64_t>(i)) * groups; }
};
__device__ __forceinline__ DropRows drop_rows(const Params& p, int b, int h) {
  return {(static_cast<uint64_t>(b) * p.hq + h) * static_cast<uint64_t>(p.sq), static_cast<uint64_t>(p.drop_sk) >> 3};
}
__device__ __forceinline__ uint32_t drop_threshold(const Params& p) {
  return static_cast<uint32_t>(p.p_drop * 65536.f);
}
// philox.cuh's keep_byte as a carry chain (attention's draws only: 1 <= thr < 2^16, p > 0): value v's half moved to
// the top plus (2^16 - thr) 2^16 carries out iff the half is >= thr, and addc shifts each carry into the byte, bit 7
// first: two instructions a bit (keep_byte's compare, select and or: about three)
__device__ __forceinline__ uint32_t keep_byte_carry(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, uint32_t thr) {
  const uint32_t k = (0x10000u - thr) << 16;
  uint32_t bits;
  asm("{\n\t.reg .u32 t;\n\t"
      "add.cc.u32 t, %4, %9;\n\taddc.u32 %0, 0, 0;\n\t"
      "add.cc.u32 t, %8, %9;\n\taddc.u32 %0, %0, %0;\n\t"
      "add.cc.u32 t, %3, %9;\n\taddc.u32 %0, %0, %0;\n\t"
      "add.cc.u32 t, %7, %9;\n\taddc.u32 %0, %0, %0;\n\t"
      "add.cc.u32 t, %2, %9;\n\taddc.u32 %0, %0, %0;\n\t"
      "add.cc.u32 t, %6, %9;\n\taddc.u32 %0, %0, %0;\n\t"
      "add.cc.u32 t, %1, %9;\n\taddc.u32 %0, %0, %0;\n\t"
      "add.cc.u32 t, %5, %9;\n\taddc.u32 %0, %0, %0;\n\t}"
      : "=&r"(bits)
      : "r"(w0), "r"(w1), "r"(w2), "r"(w3), "r"(w0 << 16), "r"(w1 << 16), "r"(w2 << 16), "r"(w3 << 16), "r"(k));
  return bits;
}
// A lane group's keep bits (philox.cuh's transpose): each lane draws the call at its ``ctr``. F = 2: the quad (the 4
// lanes t4 of one g, me = t4; 2-bit fields); F = 1: the octet (the 8 lanes g of one t4, me = g, 4 lanes apart; 1-bit
// fields). kCarry: keep_byte_carry (the forwards: 1.02-1.04x faster with dropout, H200 run306; the backward's
// kernels keep keep_byte, where the carry chain moved ptxas's spills both ways and timed 0.99-1.01x)
template <int F, bool kCarry = false>
__device__ __forceinline__ uint32_t group_keep_bits_inl(uint64_t seed, uint64_t ctr, uint32_t thr, int me) {
  static_assert(F == 1 || F == 2, "quad or octet");
  uint32_t w0, w1, w2, w3;
  philox4x32(seed, ctr, w0, w1, w2, w3);
  uint32_t x = kCarry ? keep_byte_carry(w0, w1, w2, w3, thr) : keep_byte(w0, w1, w2, w3, thr);
#pragma unroll
  for (int s = F == 2 ? 2 : 4; s >= 1; s >>= 1)
    x = transpose_stage<F>(x, __shfl_xor_sync(0xffffffffu, x, F == 2 ? s : s << 2), s, me & s);
  return x;
}
// Out of line for the mma.sync kernels (inline, their dK/dV kernel with an element mask spilled 144-168 bytes)
template <int F, bool kCarry = false>
static __device__ __noinline__ uint32_t group_keep_bits(uint64_t seed, uint64_t ctr, uint32_t thr, int me) {
  return group_keep_bits_inl<F, kCarry>(seed, ctr, thr, me);
}
// Keep bits of a row-layout thread (rows row[0], row[1]; columns 2 t4, 2 t4 + 1 of the 8-key n-tiles nt, nt + 1 from
// key k0, k0 a multiple of 8): bit 2 (2 u + r) + q is element (row[r], k0 + (nt + u) 8 + 2 t4 + q), i.e.
// sc[nt + u][2 r + q]. The quad's lane t4 draws the call of row[t4 & 1], tile nt + (t4 >> 1). kInl: inline (the
// wgmma kernels, whose independent calls then overlap) or out of line. kSeedReg: the seed held in a register
// (philox.cuh's drop_seed_reg: the forwards, whose draws also take keep_byte_carry), else read from shared memory at
// each use (the backward's kernels, whose registers are spent).
template <bool kInl = false, bool kSeedReg = false>
__device__ __forceinline__ uint32_t row_keep_bits(const Params& p, const DropRows& d, const int (&row)[2], int k0,
                                                  int nt, int t4) {
  const int i = (t4 & 1) ? row[1] : row[0];
  const uint64_t ctr = d.row_ctr(i) + static_cast<uint64_t>((k0 >> 3) + nt + (t4 >> 1));
  const uint64_t seed = kSeedReg ? drop_seed_reg() : drop_seed();
  return kInl ? group_keep_bits_inl<2, kSeedReg>(seed, ctr, drop_threshold(p), t4)  // (kSeedReg: the forwards)
              : group_keep_bits<2, kSeedReg>(seed, ctr, drop_threshold(p), t4);
}
// Keep bits of a key-row-layout thread (the dK/dV kernels: keys key[0] = kb + g, key[1] = kb + 8 + g, kb a multiple of
// 8; queries qs + (nt + u) 8 + 2 t4 + q of the n-tiles nt, nt + 1): bit 4 u + 2 r + q is element (query
// qs + (nt + u) 8 + 2 t4 + q, key[r]), i.e. st[nt + u][2 r + q]. The octet's lane g draws call c = g.
// The dropout's factor of an element whose keep bit is bit ``bit`` of ``keep``: 1 / (1 - p) kept, 0 dropped; 1 without
// dropout (DROP, a constant)
template <bool DROP>
__device__ __forceinline__ float keep_scale(const Params& p, uint32_t keep, int bit) {
  return DROP ? ((keep >> bit) & 1u ? p.inv_keep : 0.f) : 1.f;
}
template <bool kInl = false>
__device__ __forceinline__ uint32_t key_keep_bits(const Params& p, const DropRows& d, const int (&key)[2], int qs,
                                                  int nt, int t4, int g) {
  const int i = qs + (nt + (g >> 2)) * 8 + 2 * t4 + (g & 1);
  const uint64_t ctr = d.row_ctr(i) +
                       static_cast<uint64_t>(((key[0] - g) >> 3) + ((g >> 1) & 1));
  return kInl ? group_keep_bits_inl<1>(drop_seed(), ctr, drop_threshold(p), g)
              : group_keep_bits<1>(drop_seed(), ctr, drop_threshold(p), g);
}

// lse (natural log) -> the log2-domain subtrahend of the backward; +inf for a row with no key (its P is 0)
__device__ __forceinline__ float lse_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

// ---------------------------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------------------------
// The online softmax's lazy max (FlashAttention-4's conditional rescaling; Params::lazy_max): a row's running max, and
// with it O and l, move only when a block's max exceeds it by more than this (log2 units), so that most blocks after
// a row's first skip O's rescale (D / 4 FMULs a thread); the exponents against the stale max are then at most 2^8,
// which fp32 O and l and the 16-bit P hold exactly as well (O / l and the lse are the same quotient). H200 run321-323:
// 1-3% faster forwards at D = 128, 0-1% at D = 64
constexpr float kLazyMax = 8.f;
// 2^x on the FMA pipe instead of MUFU.EX2 (FlashAttention-4's exponential emulation): x = j + f, j = floor(x), f in
// [0, 1); 2^f by a cubic (relative error at most 8.6e-5, 2^-13.5: a sixth of fp16's rounding of P, 2^-11, a 23rd of
// bf16's), 2^j by its exponent bits, then one product. j comes from the magic-number sum 1.5 2^23 + x rounded down
// (its low bits: j), so the whole is 9 instructions (max, 3 adds, 3 FMAs, a shift-add, a product) of the pipes that
// issue one a cycle, against MUFU.EX2's one per 8-9 cycles a scheduler. x <= -127 (and -inf: a masked score) gives
// exactly 0 (clamped to -127: f = 0, p = 1, 2^j's bits 0); NaN stays NaN (max.NaN, and NaN p times any 2^j); x must be
// below 128. Not in the package's kernels: the warp-specialised forward at D = 64 with 4 of each 16 n-tiles' here was
// 1-2% slower without dropout and 5-6% with it (6 of 16: 5% and 9%), H200 run342; softmax_wgmma_probe.cu showed why:
// its softmax_block alone 802 cycles against 819, but beside the other warpgroup's products 1106 against 1083, and
// those products 796 cycles against 673 (the FMA pipe's work, not MUFU's, is what the tensor cores' slows). Kept for
// that probe (softmax_block's kEmu).
__device__ __forceinline__ float exp2_fma(float x) {
  float xc;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(xc) : "f"(x), "f"(-127.f));
  const float t = __fadd_rd(xc, 12582912.f);  // 1.5 2^23 + floor(xc): floor(xc) in the low mantissa bits
  const float f = xc - (t - 12582912.f);      // (both exact)
  const float p = fmaf(f, fmaf(f, fmaf(f, 0.07706602f, 0.22764611f), 0.69511654f), 1.f);
  // 2^j: (j + 127) << 23, j the low 9 bits of t's (1.5 2^23's are 0), so t's bits << 23 plus 127 << 23
  return p * __uint_as_float((__float_as_uint(t) << 23) + 0x3F800000u);
}

// The online softmax of one key block (keys k0 ..) on a warp's 16 query rows, two a thread (row[0], row[1]; the
// thread's columns 2 t4, 2 t4 + 1 of each 8-key n-tile, mma.sync's and wgmma's accumulator layout): the scores sc
// (raw Q K^T) become P (dropped elements zeroed; store_out scales by 1 / (1 - p)), the running max m and sum l (log2
// domain; per thread, the row's 4 threads share the max through shuffles) move on, and O is rescaled where the max
// moved (kLazyMax: a warp's O only when one of its rows' did). ``kb``: the block's key addends (kModeKeys).
// ``kRaw`` (no mask, a positive scale: the caller checks both): the max is taken over the raw scores and each
// exponent is one FFMA, raw * scale - max (FlashAttention's form; an FMUL an element fewer).
// ``kBits`` (the warp-specialised forward, Params::fwd_drop_bits): the keep bits of the block's first kBits 8-key
// n-tiles are read from shared memory at ``bits`` (row[0]'s BC / 8 bytes, byte c the keep bits of keys k0 + 8 c ..,
// bit v key 8 c + v; row[1]'s 8 rows on, BC / 8 bytes a row), which the producer warpgroup drew (ws_draw_bits); the
// rest's are drawn here.
// ``kEmu`` (softmax_wgmma_probe.cu only): of each 16 8-key n-tiles, the exponentials of kEmu are exp2_fma's (on the
// FMA pipe), the rest MUFU.EX2's.
// ``kDeferO`` (the warp-specialised forward's overlap, FwdWsCfg's kOvl): O is not touched (its P V is in flight); the
// rows' rescale factors go to ``alpha_out`` (1 where the max did not move) for the caller to apply.
// ``mark`` (the warp-specialised forward's timeline build only, FwdTrace): called with 13 on entry, 16 + r after row
// r's max, 14 after both rows' exponentials and sums, 15 at the end.
struct NoMark {
  __device__ __forceinline__ void operator()(int) const {}
};
// A thread's accumulator tile (its two rows, N / 8 n-tiles in the m16n8 layout) times the rows' factors
template <int N>
__device__ __forceinline__ void scale_rows(float (&acc)[N][4], const float (&f)[2]) {
#pragma unroll
  for (int dt = 0; dt < N; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[dt][e] *= f[e >> 1];
}
template <int MODE, int BC, int D, bool kRaw = false, bool kInl = false, int kBits = 0, int kEmu = 0,
          bool kDeferO = false, typename Mark = NoMark>
__device__ __forceinline__ void softmax_block(const Params& p, float (&sc)[BC / 8][4], float (&o)[D / 8][4],
                                              float (&m)[2], float (&l)[2], int b, int h, const int (&row)[2],
                                              int k0, const Seq& s, bool edge, const float* kb, int t4,
                                              uint32_t bits = 0u, Mark mark = Mark{}, float* alpha_out = nullptr) {
  mark(13);
  static_assert(!kRaw || MODE == kModeNone, "raw scores only without a mask");
  static_assert(kEmu >= 0 && kEmu <= BC / 8, "kEmu of the block's 8-key n-tiles");
  float alpha[2];
  bool grown = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // (the row's max in one chain: in 4, softmax_wgmma_probe.cu's softmax_block took 819 cycles (run342) against 810
    // (run341), whose other rows repeated to 0.1 cycle between the two calls)
    float mx = -INFINITY;
    const int lim = p.causal ? min(s.sk, row[r] + 1) : s.sk;  // (kRaw, edge) keys j < lim take part
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int jl = nt * 8 + 2 * t4 + e;
        float x;
        if constexpr (kRaw)
          x = !edge || k0 + jl < lim ? sc[nt][2 * r + e] : -INFINITY;
        else
          x = score<MODE>(p, sc[nt][2 * r + e], b, h, row[r], k0 + jl, s.sq, s.sk, edge,
                          MODE == kModeKeys ? kb[jl] : 0.f);
        sc[nt][2 * r + e] = x;
        mx = fmaxf(mx, x);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mark(16 + r);
    if (kRaw) mx *= p.scale_log2;
    // the max moves only where it grew by more than p.lazy_max (m[r] = -inf: where the block has a key); else the
    // block's exponents are taken against the old max, at most 2^kLazyMax, and O and l keep their scale
    const bool grow = mx > m[r] + p.lazy_max;
    const float m_new = grow ? mx : m[r];
    const float base = m_new == -INFINITY ? 0.f : m_new;  // a row masked so far: exp2(-inf - 0) = 0
    alpha[r] = grow ? exp2f(m[r] - base) : 1.f;
    grown |= grow;
    m[r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = sc[nt][2 * r + e];
        const float a = kRaw ? fmaf(x, p.scale_log2, -base) : x - base;
        const float pe = (nt * kEmu) % (BC / 8) >= BC / 8 - kEmu ? exp2_fma(a) : exp2f(a);  // (kEmu of each 16)
        sc[nt][2 * r + e] = pe;
        sum += pe;
      }
    }
    l[r] = l[r] * alpha[r] + sum;
  }
  mark(14);
  if constexpr (kDeferO) {  // (O's P V is in flight: the caller rescales O by alpha once it is complete)
    alpha_out[0] = alpha[0];
    alpha_out[1] = alpha[1];
  } else if (__any_sync(0xffffffffu, grown)) {  // (warp-uniform: a row that did not grow has alpha 1)
    scale_rows(o, alpha);
  }
  if (kBits > 0 || p.p_drop > 0.f) {  // (kBits: the caller's flag, with dropout only)
    static_assert(BC % 16 == 0, "the dropout's quad draws n-tiles in pairs");
    static_assert(kBits == 0 || (BC == 128 && (kBits == 8 || kBits == 12 || kBits == 16)),
                  "at most 16 bytes a row, 8 or 16 a load");
    constexpr int W = kBits / 4;
    // the producer's bytes: each byte's bits 2 t4, 2 t4 + 1 (this thread's columns of the n-tile) moved to bits 0, 1
    uint32_t w[2][4];
    if constexpr (W > 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t a = bits + r * 8 * (BC / 8);
        if constexpr (W == 4)
          asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(w[r][0]), "=r"(w[r][1]), "=r"(w[r][2]), "=r"(w[r][3])
                       : "r"(a));
        else
          asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(w[r][0]), "=r"(w[r][1]) : "r"(a));
        if constexpr (W == 3) asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(w[r][2]) : "r"(a + 8));
#pragma unroll
        for (int i = 0; i < W; ++i) w[r][i] = (w[r][i] >> (2 * t4)) & 0x03030303u;
      }
    }
    const DropRows d = drop_rows(p, b, h);
#pragma unroll
    for (int nt = 0; nt < BC / 8; nt += 2) {
      // bit 4 u + 2 r + q: element sc[nt + u][2 r + q] (row_keep_bits' layout): drawn here past the first kBits
      uint32_t kb = 0u;
      if (nt >= kBits) {
        kb = row_keep_bits<kInl, true>(p, d, row, k0, nt, t4);
      } else {
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int r = 0; r < 2; ++r) kb |= ((w[r][(nt + u) >> 2] >> (8 * ((nt + u) & 3))) & 3u) << (4 * u + 2 * r);
      }
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt + u][e] = (kb >> (4 * u + e)) & 1u ? sc[nt + u][e] : 0.f;  // store_out scales
    }
  }
  mark(15);
}

// A warp's tile of N columns (an m16n8 accumulator per 8) times ``scale`` into rows off + row[r] (those below n) of a
// (b, h, row, column) tensor, from column c0 (columns from d on are not written)
template <typename T, int N>
__device__ __forceinline__ void store_rows(void* out, int64_t sb, int64_t sh, int64_t ss, const float (&acc)[N / 8][4],
                                           float scale, int b, int h, const int (&row)[2], int64_t off, int n, int c0,
                                           int d, int t4) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= n) continue;
    T* dst = static_cast<T*>(out) + b * sb + h * sh + (off + row[r]) * ss;
#pragma unroll
    for (int dt = 0; dt < N / 8; ++dt) {
      const int c = c0 + dt * 8 + 2 * t4;
      if (c < d) *reinterpret_cast<uint32_t*>(dst + c) = pack2<T>(acc[dt][2 * r] * scale, acc[dt][2 * r + 1] * scale);
    }
  }
}

// A thread's two rows' sums l over their quad (``sum``) and O's scale (``inv``: 1 / l times the dropout's
// 1 / (1 - p); 0 for a row with no key)
__device__ __forceinline__ void out_scale(const Params& p, const float (&l)[2], float (&sum)[2], float (&inv)[2]) {
  sum[0] = l[0];
  sum[1] = l[1];
#pragma unroll
  for (int x = 1; x <= 2; x *= 2)
#pragma unroll
    for (int r = 0; r < 2; ++r) sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], x);
#pragma unroll
  for (int r = 0; r < 2; ++r) inv[r] = sum[r] > 0.f ? p.inv_keep / sum[r] : 0.f;
}

// The lse of the rows (natural log; -inf for a row with no key), by each quad's first lane, from out_scale's sums
__device__ __forceinline__ void store_lse(const Params& p, const float (&m)[2], const float (&sum)[2], int b, int h,
                                          const int (&row)[2], const Seq& s, int t4) {
  if (t4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
      if (row[r] < s.sq)
        p.lse[b * p.lse_sb + h * p.lse_sh + s.q_off + row[r]] =
            sum[r] > 0.f ? (m[r] + log2f(sum[r])) / kLog2e : -INFINITY;
  }
}

// O / l (times the dropout's 1 / (1 - p)) and the lse (natural log; -inf for a row with no key) of a warp's rows, as
// softmax_block left them
template <typename T, int D>
__device__ __forceinline__ void store_out(const Params& p, const float (&o)[D / 8][4], const float (&m)[2],
                                          const float (&l)[2], int b, int h, const int (&row)[2], const Seq& s,
                                          int t4) {
  // both rows' sums first, then every store: a row's shuffles after the other's stores waited for those stores to
  // read their registers (Nsight Compute, run322: store_out held about 15% of the BERT-base forward's stall samples;
  // with this order and TileWalk the forward took 1-3% less, run323)
  float sum[2], inv[2];
  out_scale(p, l, sum, inv);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row[r];
    if (i >= s.sq) continue;
    T* O = static_cast<T*>(p.out) + b * p.o_sb + h * p.o_sh + (s.q_off + i) * p.o_ss;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const int c = dt * 8 + 2 * t4;
      if (c < p.d) *reinterpret_cast<uint32_t*>(O + c) = pack2<T>(o[dt][2 * r] * inv[r], o[dt][2 * r + 1] * inv[r]);
    }
  }
  store_lse(p, m, sum, b, h, row, s, t4);
}

#if defined(PK_WGMMA)
// store_out through shared memory (the warp-specialised forward at D = 64, FwdTma::o_on): the consumer warpgroup's 64
// rows from ``qw`` packed into its O tile at ``so`` (1024-byte aligned, 128-byte swizzled rows: the map's layout) by
// its 128 threads (named barrier ``bar``), then stored by its ``leader``'s TMA store (rows past the sequence clipped by
// the map, as columns past d). The leader waits for its previous store to have read the tile before the tile is
// written again, and for all its stores before the kernel ends (bulk_wait_all). The lse as store_out writes it.
template <typename T>
__device__ __forceinline__ void store_out_tma(const Params& p, const CUtensorMap* map, int order, uint32_t so, int bar,
                                              bool leader, const float (&o)[8][4], const float (&m)[2],
                                              const float (&l)[2], int b, int h, const int (&row)[2], int qw,
                                              const Seq& s, int t4) {
  float sum[2], inv[2];
  out_scale(p, l, sum, inv);
  if (qw < s.sq) {  // (uniform over the warpgroup)
    if (leader) bulk_wait_read();
    named_sync(bar, 128);
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int dt = 0; dt < 8; ++dt)
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(so + sw128_offset(64, row[r] - qw, dt * 8) + 4 * t4),
                     "r"(pack2<T>(o[dt][2 * r] * inv[r], o[dt][2 * r + 1] * inv[r]))
                     : "memory");
    fence_async_smem();  // (the generic proxy's writes, before the async proxy reads them)
    named_sync(bar, 128);
    if (leader) {
      const int i = static_cast<int>(s.q_off) + qw;
      const auto at = [&](int c) { return (order & 3) == c ? i : ((order >> 2) & 3) == c ? h : b; };
      tma_store_4d(map, so, 0, at(1), at(2), at(3));
    }
  }
  store_lse(p, m, sum, b, h, row, s, t4);
}
#endif

template <int D>
struct FwdCfg {
  static constexpr int BC = D > 128 ? 32 : 64;  // keys a block
  static constexpr int LD = D + 8;
  static constexpr size_t smem(size_t elt) { return static_cast<size_t>(kRows + 2 * BC) * LD * elt; }
};

template <typename T, int D, int MODE>
__global__ void __launch_bounds__(kThreads) attn_fwd_kernel(const Params p) {
  pdl_enter();  // (launch: pdl.cuh)
  drop_seed_init(p.p_drop > 0.f, p.seed);  // (the seed into shared memory, with dropout only)
  using C = FwdCfg<D>;
  constexpr int BC = C::BC, LD = C::LD;
  constexpr bool kKeys = MODE == kModeKeys;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kRows * LD;
  T* sV = sK + BC * LD;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const Seq s = seq_of(p, b);
  const int q0 = blockIdx.x * kRows;
  if (q0 >= s.sq) return;  // (varlen: this sequence is shorter than the grid's max)
  const T* Q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh + (s.q_off + q0) * p.q_ss;
  const T* K = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh + s.k_off * p.k_ss;
  const T* V = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh + s.k_off * p.v_ss;
  load_tile<T, kRows, D>(sQ, Q, p.q_ss, min(kRows, s.sq - q0), p.d, tid);
  cp_async_commit();  // (Q in flight while a key-only mask's range is found)
  const int n_end = p.causal ? min(s.sk, q0 + kRows) : s.sk;  // keys past n_end are masked for every row here
  int nb0 = 0, nb1 = (n_end + BC - 1) / BC;                  // the key blocks visited
  if constexpr (kKeys) {
    const int2 r = key_range(p, b, n_end, s.sk);
    nb0 = r.x / BC;
    nb1 = r.x < r.y ? (r.y + BC - 1) / BC : nb0;
  }
  __shared__ float skb[2][kKeys ? BC : 1];  // the key addends (key_addends)
  float kb_next = kKeys ? key_addends_first<BC>(p, b, nb0, nb1, s.sk) : 0.f;
  if constexpr (kKeys) key_addends(p, skb, kb_next, nb0, nb1, b, s.sk);

  if (nb0 < nb1) load_tile<T, BC, D>(sK, K + nb0 * BC * p.k_ss, p.k_ss, min(BC, s.sk - nb0 * BC), p.d, tid);
  cp_async_commit();
  if (nb0 < nb1) load_tile<T, BC, D>(sV, V + nb0 * BC * p.v_ss, p.v_ss, min(BC, s.sk - nb0 * BC), p.d, tid);
  cp_async_commit();

  float o[D / 8][4];
  zero(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  constexpr bool kQRegs = D <= 128;  // Q's fragments stay in registers (above: read from shared memory each block)
  uint32_t qf[kQRegs ? D / 16 : 1][4];
  const auto q_of = [&](int kt, uint32_t(&a)[4]) {
    if constexpr (kQRegs) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = qf[kt][e];
    } else {
      ldsm_x4(a, a_addr<T, LD>(sQ, warp * 16, kt * 16, lane));
    }
  };

  for (int nb = nb0; nb < nb1; ++nb) {
    const int k0 = nb * BC;
    cp_async_wait<1>();  // Q and this K block
    __syncthreads();
    if constexpr (kQRegs) {
      if (nb == nb0) {
#pragma unroll
        for (int kt = 0; kt < D / 16; ++kt) ldsm_x4(qf[kt], a_addr<T, LD>(sQ, warp * 16, kt * 16, lane));
      }
    }
    float sc[BC / 8][4];
    zero(sc);
    mma_abt<T, LD, D, BC>(sc, q_of, sK, lane);  // S = Q K^T
    __syncthreads();  // every warp is done with sK
    if (nb + 1 < nb1) load_tile<T, BC, D>(sK, K + (k0 + BC) * p.k_ss, p.k_ss, min(BC, s.sk - k0 - BC), p.d, tid);
    cp_async_commit();
    if constexpr (kKeys) {
      if (nb + 1 < nb1) key_addends(p, skb, kb_next, nb + 1, nb1, b, s.sk);
    }

    const bool edge = k0 + BC > s.sk || (p.causal && k0 + BC - 1 > q0);
    with_flag(edge, [&](auto e) {
      softmax_block<MODE, BC, D>(p, sc, o, m, l, b, h, row, k0, s, decltype(e)::value, skb[nb & 1], t4);
    });

    cp_async_wait<1>();  // this V block (the next K block may still be in flight)
    __syncthreads();
    mma_acc_b<T, LD, BC, D>(o, sc, sV, 0, lane);  // O += P V
    __syncthreads();  // every warp is done with sV
    if (nb + 1 < nb1) load_tile<T, BC, D>(sV, V + (k0 + BC) * p.v_ss, p.v_ss, min(BC, s.sk - k0 - BC), p.d, tid);
    cp_async_commit();
  }
  cp_async_wait<0>();
  store_out<T, D>(p, o, m, l, b, h, row, s, t4);
}

// The forwards on Hopper's warpgroup MMA (sm_90a; every mask mode, dropout, varlen, GQA), which launch_forward takes at
// head dims up to 128 on a 9.0 device (plan_of(p).sm90) with PYKERNELS_CUDA_ATTN_SM90=1, or without a mask and with a
// scale that is not positive (the warp-specialised kernel below takes every other case). Both stage K and V blocks of
// 64 keys in 128-byte swizzled rows (cp.async, wgmma.cuh), two buffers each, and issue S = Q K^T as a wgmma chain from
// shared Q and K and O += P V as one from P in registers (S's accumulators, as in the mma.sync kernel) and V in shared
// memory, read N-major; the softmax, mask, dropout and output rules are the mma.sync kernel's (softmax_block,
// store_out).
//   attn_fwd_sm90_kernel (D <= 64): a block of 2 warpgroups (4 warps each) per (128 queries, head, batch), each
//     warpgroup owning 64 rows, 2 blocks an SM; each warpgroup waits for its S, runs the softmax, then P V. A
//     warpgroup whose rows all lie above the causal diagonal of a key block, or past the sequence, skips that
//     block's products.
//   attn_fwd_sm90_pipe_kernel (D <= 128): one warpgroup per (64 queries, head, batch); the next key block's S is
//     issued before this block's softmax, so the tensor cores run it meanwhile.
// Measured (H200, graph replay, TFLOP/s forward; benchmarks/results/HISTORY.md, twenty-fourth session), against the
// mma.sync kernel's 163 at BERT-base, 157 with key padding, 126 at GPT-2 and 177 at S2048 D128 causal: the two
// warpgroups 188 / 181 / 131 (run209); one warpgroup of 128-key blocks, 3 blocks an SM, 183 / 172 / 133 (run208);
// three warpgroups a block (one block an SM: the block-wide barriers keep them in step, so no softmax overlaps
// another warpgroup's MMA) 164 / 155 / 108; at D = 128 the pipelined kernel 207 where the others run 189-190
// (run208-209), at D = 64 (64-key blocks, 2 blocks an SM at 226 registers) 151 / 135 / 114. Written in place, the
// softmax's S registers (the next chain's accumulators) make ptxas serialize the chains (C7515): it works on a copy.
template <int D>
struct FwdSm90Cfg {
  static constexpr int NWG = 2;        // warpgroups a block
  static constexpr int BM = 64 * NWG;  // query rows a block
  static constexpr int BN = 64;        // keys a block
  static constexpr int NT = 128 * NWG;
  static constexpr int MIN_BLOCKS = 2;  // blocks an SM (128 registers a thread)
  static constexpr uint32_t QBYTES = BM * D * 2, KVBYTES = BN * D * 2;
  static constexpr size_t smem() { return 1024 + QBYTES + 4 * KVBYTES; }  // Q, 2 buffers of K and V; 1024-aligned
};

// Rows [0, nrows) of an R x D tile from global rows g + r * stride into 128-byte swizzled rows at shared address s
// (columns past d and rows past nrows zero-filled), by NT threads: thread tid copies column chunk tid % C of rows
// tid / C + k NT / C, so its swizzled offsets are one constant apart. UNROLL: the warp-specialised producer (56
// registers) keeps the loop rolled.
template <typename T, int R, int D, int NT, int UNROLL = 4>
__device__ __forceinline__ void load_tile_sw128(uint32_t s, const T* g, int64_t stride, int nrows, int d, int tid) {
  constexpr int C = D / 8, RS = NT / C;  // column chunks a row; rows a pass (a multiple of 8)
  static_assert(NT % C == 0 && RS % 8 == 0 && R % RS == 0, "tile shape");
  const int c = tid % C, r0 = tid / C;
  const bool col_ok = c * 8 < d;
  const T* src = g + r0 * stride + c * 8;
  const uint32_t dst = s + sw128_offset(R, r0, c * 8);
#pragma unroll UNROLL
  for (int k = 0; k < R / RS; ++k) {
    const bool ok = col_ok && r0 + k * RS < nrows;
    cp_async16(dst + k * RS * 128, ok ? src : g, ok);
    src += RS * stride;
  }
}

template <typename T, int D, int MODE>
__global__ void __launch_bounds__(FwdSm90Cfg<D>::NT, FwdSm90Cfg<D>::MIN_BLOCKS) attn_fwd_sm90_kernel(const Params p) {
  pdl_enter();  // (launch: pdl.cuh)
  drop_seed_init(p.p_drop > 0.f, p.seed);  // (the seed into shared memory, with dropout only)
#if defined(PK_WGMMA)
  using C = FwdSm90Cfg<D>;
  constexpr int BM = C::BM, BN = C::BN, NT = C::NT;
  constexpr bool kKeys = MODE == kModeKeys;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sK = sQ + C::QBYTES, sV = sK + 2 * C::KVBYTES;  // stage st at + st * KVBYTES
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int wg = warp >> 2;  // warpgroup
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const Seq s = seq_of(p, b);
  const int q0 = blockIdx.x * BM;
  if (q0 >= s.sq) return;  // (varlen: this sequence is shorter than the grid's max)
  const T* Q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh + (s.q_off + q0) * p.q_ss;
  const T* K = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh + s.k_off * p.k_ss;
  const T* V = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh + s.k_off * p.v_ss;
  load_tile_sw128<T, BM, D, NT>(sQ, Q, p.q_ss, min(BM, s.sq - q0), p.d, tid);
  cp_async_commit();
  const int n_end = p.causal ? min(s.sk, q0 + BM) : s.sk;  // keys past n_end are masked for every row here
  int nb0 = 0, nb1 = (n_end + BN - 1) / BN;               // the key blocks visited
  if constexpr (kKeys) {
    const int2 r = key_range<NT>(p, b, n_end, s.sk);
    nb0 = r.x / BN;
    nb1 = r.x < r.y ? (r.y + BN - 1) / BN : nb0;
  }
  __shared__ float skb[2][kKeys ? BN : 1];  // the key addends (key_addends)
  float kb_next = kKeys ? key_addends_first<BN>(p, b, nb0, nb1, s.sk) : 0.f;
  if constexpr (kKeys) key_addends(p, skb, kb_next, nb0, nb1, b, s.sk);
  const auto load_kv = [&](int nb, int st) {
    const int k0 = nb * BN, n = min(BN, s.sk - k0);
    load_tile_sw128<T, BN, D, NT>(sK + st * C::KVBYTES, K + k0 * p.k_ss, p.k_ss, n, p.d, tid);
    load_tile_sw128<T, BN, D, NT>(sV + st * C::KVBYTES, V + k0 * p.v_ss, p.v_ss, n, p.d, tid);
  };
  if (nb0 < nb1) load_kv(nb0, 0);
  cp_async_commit();

  float o[D / 8][4];
  zero(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int qw = q0 + wg * 64;  // the warpgroup's first row
  const int row[2] = {qw + (warp & 3) * 16 + g, qw + (warp & 3) * 16 + g + 8};
  // descriptors: Q (K-major, the warpgroup's 64 rows), K (K-major, BN rows), V (N-major: 16 keys a k-step)
  const uint32_t q_base = sQ + wg * 64 * 128;

  for (int nb = nb0; nb < nb1; ++nb) {
    const int k0 = nb * BN, st = (nb - nb0) & 1;
    if (nb + 1 < nb1) load_kv(nb + 1, st ^ 1);  // (stage st ^ 1 was freed by the last iteration's final barrier)
    cp_async_commit();
    if constexpr (kKeys) {
      if (nb + 1 < nb1) key_addends(p, skb, kb_next, nb + 1, nb1, b, s.sk);
    }
    cp_async_wait<1>();  // Q and this block's K and V
    fence_async_smem();
    __syncthreads();
    if (qw < s.sq && !(p.causal && k0 > qw + 63)) {  // the warpgroup has a row that sees a key here
      const uint32_t k_base = sK + st * C::KVBYTES, v_base = sV + st * C::KVBYTES;
      float sc[BN / 8][4];
      wgmma_fence();
      wgmma_chain_ss<T, BN, D, BM, BN>(sc, q_base, k_base);  // S = Q K^T
      wgmma_commit();
      wgmma_wait_all();
      fence_acc(sc);
      const bool edge = k0 + BN > s.sk || (p.causal && k0 + BN - 1 > qw);
      with_flag(edge, [&](auto e) {
        softmax_block<MODE, BN, D>(p, sc, o, m, l, b, h, row, k0, s, decltype(e)::value, skb[nb & 1], t4);
      });
      uint32_t pa[BN / 16][4];
#pragma unroll
      for (int kt = 0; kt < BN / 16; ++kt) acc_to_a<T>(pa[kt], sc[2 * kt], sc[2 * kt + 1]);
      fence_acc(o);
      wgmma_fence();
#pragma unroll
      for (int kt = 0; kt < BN / 16; ++kt)  // O += P V
        wgmma_rs<T, D>(o, pa[kt], gmma_desc<BN * 128, 1024>(v_base, kt * 16 * 128));
      wgmma_commit();
      wgmma_wait_all();
      fence_acc(o);
    }
    __syncthreads();  // every warpgroup is done with stage st
  }
  cp_async_wait<0>();
  store_out<T, D>(p, o, m, l, b, h, row, s, t4);
#else
  __trap();  // (not launched: the host takes this kernel only from an sm_90a build on a 9.0 device)
#endif
}

// attn_fwd_sm90_pipe_kernel's blocks: key block nb + 1's S accumulates in one register set while block nb's is
// the softmax's input (two sets, alternating); K block nb + 3 and V block nb + 2 load while blocks nb, nb + 1 compute
template <int D>
struct FwdSm90PipeCfg {
  static constexpr int BM = 64;  // query rows a block: one warpgroup
  static constexpr int BN = 64;  // keys a block
  static constexpr int NT = 128;
  static constexpr int MIN_BLOCKS = 2;  // blocks an SM (up to 255 registers a thread)
  static constexpr uint32_t QBYTES = BM * D * 2, KVBYTES = BN * D * 2;
  static constexpr size_t smem() { return 1024 + QBYTES + 4 * KVBYTES; }  // Q, 2 buffers of K and V; 1024-aligned
};

template <typename T, int D, int MODE>
__global__ void __launch_bounds__(FwdSm90PipeCfg<D>::NT, FwdSm90PipeCfg<D>::MIN_BLOCKS) attn_fwd_sm90_pipe_kernel(const Params p) {
  pdl_enter();  // (launch: pdl.cuh)
  drop_seed_init(p.p_drop > 0.f, p.seed);  // (the seed into shared memory, with dropout only)
#if defined(PK_WGMMA)
  using C = FwdSm90PipeCfg<D>;
  constexpr int BM = C::BM, BN = C::BN, NT = C::NT;
  constexpr bool kKeys = MODE == kModeKeys;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sK = sQ + C::QBYTES, sV = sK + 2 * C::KVBYTES;  // key block nb's K and V at + (nb % 2) KVBYTES
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const Seq s = seq_of(p, b);
  const int q0 = blockIdx.x * BM;
  if (q0 >= s.sq) return;  // (varlen: this sequence is shorter than the grid's max)
  const T* Q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh + (s.q_off + q0) * p.q_ss;
  const T* K = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh + s.k_off * p.k_ss;
  const T* V = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh + s.k_off * p.v_ss;
  const int n_end = p.causal ? min(s.sk, q0 + BM) : s.sk;  // keys past n_end are masked for every row here
  int nb0 = 0, nb1 = (n_end + BN - 1) / BN;               // the key blocks visited
  const auto load_k = [&](int nb) {
    if (nb < nb1)
      load_tile_sw128<T, BN, D, NT>(sK + (nb & 1) * C::KVBYTES, K + nb * BN * p.k_ss, p.k_ss, min(BN, s.sk - nb * BN),
                                    p.d, tid);
  };
  const auto load_v = [&](int nb) {
    if (nb < nb1)
      load_tile_sw128<T, BN, D, NT>(sV + (nb & 1) * C::KVBYTES, V + nb * BN * p.v_ss, p.v_ss, min(BN, s.sk - nb * BN),
                                    p.d, tid);
  };
  load_tile_sw128<T, BM, D, NT>(sQ, Q, p.q_ss, min(BM, s.sq - q0), p.d, tid);
  if constexpr (kKeys) {  // (Q in flight while the range is found)
    const int2 r = key_range(p, b, n_end, s.sk);
    nb0 = r.x / BN;
    nb1 = r.x < r.y ? (r.y + BN - 1) / BN : nb0;
  }
  __shared__ float skb[2][kKeys ? BN : 1];  // the key addends (key_addends)
  float kb_next = kKeys ? key_addends_first<BN>(p, b, nb0, nb1, s.sk) : 0.f;
  if constexpr (kKeys) key_addends(p, skb, kb_next, nb0, nb1, b, s.sk);
  // cp.async groups: {Q, K nb0}, {K nb0 + 1, V nb0}, {K nb0 + 2, V nb0 + 1} (after block nb0's S), then one an
  // iteration: {K nb + 3, V nb + 2}
  load_k(nb0);
  cp_async_commit();
  load_k(nb0 + 1);
  load_v(nb0);
  cp_async_commit();

  float o[D / 8][4];
  zero(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  // S = Q K^T of key block nb into acc, issued (committed, not waited for)
  const auto issue_s = [&](float(&acc)[BN / 8][4], int nb) {
    const uint32_t k_base = sK + (nb & 1) * C::KVBYTES;
    wgmma_fence();
    wgmma_chain_ss<T, BN, D, BM, BN>(acc, sQ, k_base);
    wgmma_commit();
  };
  // one key block: cur holds its S; the next block's S is issued into nxt before the softmax and lands by the end
  const auto step = [&](int nb, float(&cur)[BN / 8][4], float(&nxt)[BN / 8][4]) {
    const int k0 = nb * BN;
    cp_async_wait<1>();  // K block nb + 1 and V block nb
    fence_async_smem();
    __syncthreads();
    float x[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[i][e] = cur[i][e];
    if (nb + 1 < nb1) issue_s(nxt, nb + 1);
    if constexpr (kKeys) {
      if (nb + 1 < nb1) key_addends(p, skb, kb_next, nb + 1, nb1, b, s.sk);
    }
    const bool edge = k0 + BN > s.sk || (p.causal && k0 + BN - 1 > q0);
    with_flag(edge, [&](auto e) {
      softmax_block<MODE, BN, D, false, true>(p, x, o, m, l, b, h, row, k0, s, decltype(e)::value, skb[nb & 1], t4);
    });
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt) acc_to_a<T>(pa[kt], x[2 * kt], x[2 * kt + 1]);
    fence_acc(o);
    wgmma_fence();
    const uint32_t v_base = sV + (nb & 1) * C::KVBYTES;
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt)  // O += P V
      wgmma_rs<T, D>(o, pa[kt], gmma_desc<BN * 128, 1024>(v_base, kt * 16 * 128));
    wgmma_commit();
    wgmma_wait_all();
    fence_acc(o);
    fence_acc(nxt);
    __syncthreads();  // every warp is done with K block nb + 1 and V block nb: their buffers take nb + 3, nb + 2
    load_k(nb + 3);
    load_v(nb + 2);
    cp_async_commit();
  };

  float sa[BN / 8][4], sb[BN / 8][4];  // S of key blocks nb0, nb0 + 2, ... and nb0 + 1, nb0 + 3, ...
  cp_async_wait<1>();                  // Q and K block nb0
  fence_async_smem();
  __syncthreads();
  if (nb0 < nb1) {
    issue_s(sa, nb0);
    wgmma_wait_all();
    fence_acc(sa);
  }
  __syncthreads();  // every warp is done with K block nb0: its buffer takes nb0 + 2
  load_k(nb0 + 2);
  load_v(nb0 + 1);
  cp_async_commit();
  for (int nb = nb0; nb < nb1; nb += 2) {
    step(nb, sa, sb);
    if (nb + 1 < nb1) step(nb + 1, sb, sa);
  }
  cp_async_wait<0>();
  store_out<T, D>(p, o, m, l, b, h, row, s, t4);
#else
  __trap();  // (not launched: the host takes this kernel only from an sm_90a build on a 9.0 device)
#endif
}

// attn_fwd_sm90_ws_kernel: FlashAttention-3's warp specialisation on a persistent grid (one block an SM walks the
// (query tile, head, batch) tiles gridDim.x apart; causal: each head's tiles longest first, alternating with shortest
// first by round where the grid allows, tile_at / fwd_ws_grid). Warpgroup 0 is the producer: it drops to 56 registers
// and streams each tile's Q (two buffers, so the next tile's Q lands during this one) and its key blocks' K and V (a
// ring of STAGES). Inputs that TMA can address (make_fwd_tma; packed varlen sequences too, as rows of a batch of one,
// each sequence's last V block by cp.async: the producer's note) are loaded by TMA: thread 0 issues each tile as one
// or two 64-column boxes counted on the slot's full mbarrier (expect_tx), and TMA zero-fills rows and columns outside
// the tensor; without a key-only mask (or packed sequences) the producer's other threads leave at once. Otherwise (a
// stride-0 K / V) its 128 threads load by cp.async, each load announced on an mbarrier when it lands
// (cp.async.mbarrier.arrive.noinc), masked-out rows and columns past d zero-filled as in the other kernels. Warpgroups
// 1 and 2 are the consumers (224 registers), 64 query rows each: for key block j, on its turn (two named barriers hand
// the turn back and forth, so one warpgroup's products run while the other's softmax does), a warpgroup issues S_j = Q
// K_j^T and O += P_{j-1} V_{j-1} as one group, passes the turn, waits, frees K_j and V_{j-1} (mbarrier arrivals, one a
// warp), then runs the softmax of S_j (softmax_block, every rule of the other kernels; unmasked, on the raw scores with
// one FFMA an element, which needs a positive scale: the host checks). No block-wide barrier after the set-up. A
// key-only mask (key padding): the producer finds each tile's valid key range (its 128 threads together) and streams
// only the key blocks that meet it, and it writes each block's key addends into a ring slot that the consumers free
// after their softmax; both announced on the full barriers by plain (release) arrivals next to the loads' own.
// TMA and the alternating causal order (run238, H200, graph replay, TFLOP/s forward, against cp.async and longest first
// in every round in the same call): BERT-base 283 -> 305, key padding 243 -> 260, GPT-2 193 -> 237, S2048 D128 causal
// 383 -> 471. The order alone: GPT-2 1.20x, S2048 D128 causal 1.12x (Nsight Compute, run237, H100: the SMs had been
// active 82% of the kernel there, the blocks of one residue of n_m taking the longest tiles each round); TMA alone
// 1.02-1.10x (the cp.async producer had executed 23-35% of the kernel's instructions, on the consumers' schedulers).
// Measured (H100, graph replay, TFLOP/s forward, run222; the plain wgmma kernels above in the same call): BERT-base
// 286 (217), key padding 241 (209), GPT-2 195 (159), S2048 D128 causal 386 (233); before the warpgroup index was
// made warp-uniform (ptxas had serialized the chains in the role branch, C7520) 242 / 241 / 162 / 317 (run217).
// Tried and not kept: 4 ring slots at D = 64 (run215: no change); FlashAttention-3's intra-warpgroup overlap (S_j and
// P_{j-1} V_{j-1} in two commit groups, wait_group 1 before the softmax, O rescaled after both: run224, measured with
// the chains unserialized, 0.95x BERT-base, 0.93x key padding, 0.96x GPT-2, 0.94x S2048 D128 causal: with two consumers
// taking turns the tensor cores are already fed during a softmax); a tile's last P V issued with the next tile's first
// S at D = 64, consumers at 232 registers (run219: 0.97x BERT-base, 0.85x key padding, measured while the chains were
// serialized), and again on this kernel with the chains whole (run327: the pending tile's O live across the tile loop
// made ptxas take the consumers as divergent until Q's wait polled by votes and every branch on a value read from
// memory was a vote; then 0.91x BERT-base, 0.94x GPT-2, 0.88x S2048 D128 causal: HISTORY, forty-ninth session); the
// mbarrier waits' suspend-time hint (run325: no gain). (In the overlap variant an empty second commit group on a
// tile's first block kept the chains whole; a branch around that commit made ptxas serialize them, C7514.) The
// profile before the edge split (run215, Nsight Compute) put 24% of the samples on the producer's waits for free slots
// (idle, as it should be) and 12% on branch resolution in the consumers' element loops, which with_flag removed.
// O at D = 64 on dense inputs: each consumer warpgroup packs its tile into shared memory and one of its threads stores
// it by TMA (store_out_tma), where the register stores had put 16 global stores a thread and their addressing in
// each tile's epilogue (run330-332, H200: BERT-base 86.1-87.4 -> 79.8-81.0 us, GPT-2 51.6-52.0 -> 48.1-49.3, key
// padding 92.2-93.6 -> 87.7-88.9; with dropout BERT-base 1.5% slower, GPT-2 1% and key padding 4.5% faster).
// The softmax turn (FwdTma::soft_turn, fwd_soft_turn): at D = 64 without a causal mask the consumers also take turns at
// their softmaxes (named barriers kSoft + w, consumer 1 arriving first), so the two never run at once. The kernel's
// timeline (run336-337, FwdTrace below) had each warpgroup's softmax at 1450-1600 SM cycles against 650-700 for its
// products, the two softmaxes overlapping for about two thirds of each, and the tensor cores idle about half of each
// key block; a softmax alone takes 780 cycles (benchmarks/dev/softmax_probe.cu, run338), 1010 beside the other
// warpgroup's products (softmax_wgmma_probe.cu, run340). H200 run340, one build, against the turn off: without dropout
// BERT-base 79.3-79.8 -> 78.8-78.9 us, key padding 90.0-90.1 -> 79.1-79.5 (-12%), packed sequences 84.7-85.3 ->
// 80.8-81.7; with dropout 0.1 BERT-base 130.4-130.7 -> 126.4-126.8, packed 124.2-127.4 -> 121.9-122.2. Off where it did
// not gain (run337, run339, on everywhere): causal (GPT-2 +1% with dropout), D = 128 (S2048 causal within noise), and
// dropout under a key-only mask (+2-5%: its consumers draw every keep bit, integer work that the overlap had hidden).
// Three consumers (NW = 3, FwdWsCfg<64, 3>; where fwd_three_consumers says): tiles of 192 query rows, the turn passed
// 0 -> 1 -> 2 -> 0 (named barriers kTurn + w, each waited by its warpgroup and arrived at by the one before), the
// producer at 32 registers (TMA only: no key ranges, no keep bits) and the consumers at 160 (no spills at D = 64).
// Three consumers overlap (kOvl, fwd_overlap; by default without dropout): FlashAttention-3's intra-warpgroup overlap,
// S_j and P_{j-1} V_{j-1} two commit groups (an empty second one on a tile's first block, committed in both branches:
// a commit after the branch's join made ptxas close the P V's group and add an empty one, so that wait_group 1 waited
// for the P V too), the softmax after S_j's wait (softmax_block's kDeferO: O untouched), then the P V's wait, V's
// slot freed and O rescaled; a key block's K and previous V polled together (mbar_wait2). The timeline (run347) had
// shown the three softmaxes running at once, about 2200 timeline cycles each against 1500 with two, while the tensor
// cores idled; each warpgroup's own P V now runs beside them. Not kept at two consumers (run224: 0.93-0.96x, above).
// A timeline of the warp-specialised forward, for development only (a build with -DPYKERNELS_FWD_TRACE, setup.py's
// PYKERNELS_NVCC_FLAGS; benchmarks/dev/attention_fwd_trace.py reads and summarises it): each warp of the first
// kTraceCtas blocks records its first kTraceN events, the event's code in the top 16 bits and the SM's clock64 below,
// at kTraceWarps slots a block (the producer's warps 0-3, the consumers' 4-11, a third consumer's 12-15); every lane
// stores the same value, so the code stays free of per-lane branches (a divergent path around the products makes
// ptxas serialize them, C7520).
// Codes: 0 the consumer's start; 1 a tile's Q landed; 2 a key block's turn taken; 3 its products done; 4 its softmax
// done; 5 the last P V's turn taken; 6 its product done; 7 the tile's O stored; 8 / 9 / 10 the producer past a Q / K /
// V slot's empty wait (its loads issued right after); 11 a key block's K (and the previous V) landed, before its turn;
// 12 the last V landed; inside softmax_block (its ``mark``): 13 entered (after the softmax turn where it is on),
// 16 / 17 row 0's / row 1's max found, 14 both rows' exponentials and sums done, 15 its end (the dropout's zeros
// applied).
// The clock reads keep ptxas from moving work across them, so the phases inside the softmax are the build's own.
#ifdef PYKERNELS_FWD_TRACE
constexpr int kTraceCtas = 16, kTraceWarps = 16, kTraceN = 2048;  // (16 warps: three consumers too)
static __device__ unsigned long long g_fwd_trace[kTraceCtas * kTraceWarps * kTraceN];
struct FwdTrace {
  int n = 0;
  __device__ __forceinline__ void mark(int code) {
    if (blockIdx.x < kTraceCtas) {
      unsigned long long c;
      asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(c));
      g_fwd_trace[(blockIdx.x * kTraceWarps + (threadIdx.x >> 5)) * kTraceN + min(n, kTraceN - 1)] =
          (static_cast<unsigned long long>(code) << 48) | (c & 0xFFFFFFFFFFFFull);
    }
    ++n;
  }
};
#define PK_FWD_TRACE_DECL FwdTrace trace_
#define PK_FWD_TRACE(code) trace_.mark(code)
#else
#define PK_FWD_TRACE_DECL
#define PK_FWD_TRACE(code)
#endif

// NW: the consumer warpgroups (2; 3 at D = 64 without a mask: fwd_three_consumers); MIX: tiles that may mix heads
// (the kernel's kMix)
template <int D, int NW = 2, bool MIX = false>
struct FwdWsCfg {
  static_assert(NW == 2 || (NW == 3 && D == 64), "three consumers at D = 64 only (their 160 registers)");
  static constexpr int BM = 64 * NW;  // query rows a tile: a consumer warpgroup's 64 each
  static constexpr int BN = 128;  // keys a block
  // K / V ring slots: 3 at D = 64, 2 at D = 128 (3 would not fit). A slot's V is freed a block after its K (P V lags a
  // block), so with 2 slots the producer can issue a block's V only about one block before its P V; 3 took the
  // forward 1.06-1.07x with key padding and 1.00-1.01x otherwise, 4 no further (run233; run215, before the edge
  // split, had found 4 no faster)
  // Tiles that mix heads (MIX) take 4 at D = 64: a tile of two heads streams their blocks in turn, so that each head
  // has half the ring, as many blocks ahead as 2 slots give the others (3 there, H200 run420: 64 x 12 x 256 tokens
  // 57.3-57.5 us against 47.0-47.4, BERT-base 79.8-80.0 against 72.7-73.2; faster only where no tile mixes, 40 x 12 x
  // 384 forced 56.0 against 56.9-57.2)
  static constexpr int STAGES = D == 64 ? (MIX ? 4 : 3) : 2;
  static constexpr int NT = 128 * (1 + NW);  // the producer warpgroup and the consumers
  // the warpgroups' registers (setmaxnreg): at most 512 a thread of each warpgroup together (64K a block)
  static constexpr int PRODUCER_REGS = NW == 2 ? 56 : 32, CONSUMER_REGS = NW == 2 ? 224 : 160;
  static constexpr uint32_t QBYTES = BM * D * 2, KVBYTES = BN * D * 2;
  // q full / empty (2 each), k full / empty, v full / empty, key addends empty (key-only masks)
  static constexpr int NBAR = 4 + 5 * STAGES;
  // then (key-only masks) the key addends a ring slot, each tile's key-block range, the producer's reduction
  static constexpr size_t EXTRA = STAGES * BN * 4 + 2 * 2 * 4 + 2 * 4 * 2 * 4;
  // then (Params::fwd_drop_bits) the keep bits a ring slot: a byte each 8 keys of a row (16-byte aligned)
  static constexpr uint32_t BITS = NW == 2 ? BM * BN / 8 : 0;  // (three consumers: they draw every bit)
  // the 8-key n-tiles of a block whose keep bits the producer draws (the first DRAWN; the consumers draw the rest).
  // H200 run319-320 (BERT-base forward with dropout): 16 138.6-139.5 us, 12 133.4-134.1, 8 129.2-130.2 but GPT-2's and
  // the packed batch's forward + backward 3-5 us slower than at 12
  static constexpr int DRAWN = 12;
  // D = 64: then each consumer warpgroup's O tile (64 rows of 128 bytes, 1024-byte aligned), which a TMA store takes
  // to global memory (FwdTma::o_on; D = 128 has no room left for it)
  static constexpr uint32_t OBYTES = D == 64 ? NW * 64 * 128 : 0;
  static constexpr size_t smem() {
    return 1024 + 2 * QBYTES + 2 * STAGES * KVBYTES + NBAR * 8 + EXTRA + 16 + STAGES * BITS + (D == 64 ? 1024 : 0) +
           OBYTES;
  }
};

// The warp-specialised forward's TMA maps (dense inputs whose strides TMA can take: make_fwd_tma): q, k and v each a
// 4-D map of d columns, then rows, heads and batch in the order of increasing stride, box 64 columns x 128 rows,
// 128-byte swizzled, which is sw128_offset's layout of a 64-column region. ``order[i]`` says where tensor i's rows,
// heads and batch go (2 bits each, coordinate 1..3). ``on`` 0: the producer loads by cp.async instead. ``o`` (where
// ``o_on``: dense, D = 64, on): the output's map, box 64 columns x 64 rows (a consumer warpgroup's rows), its order
// ``order[3]``: the consumers store O through shared memory by TMA instead of from registers.
struct FwdTma {
  CUtensorMap q, k, v, o;
  int order[4];
  int on, o_on;
  int soft_turn;  // the consumers' softmaxes take turns too (fwd_soft_turn)
  int fence;      // the consumers fence the async proxy before each key block's products (fwd_fence)
};

// The backward's TMA maps (attn_bwd_sm90_kernel, dense inputs: make_bwd_tma): q and dout with boxes of 64 rows (the
// dQ blocks) and of 32 (the dK/dV blocks' query blocks), k and v of 64; ``order`` as FwdTma's, in that order
struct BwdTma {
  CUtensorMap q64, do64, q32, do32, k, v;
  int order[6];
  int on;
};

#if defined(PK_WGMMA)
// The R x D tile of ``map`` at (row, head, batch) into shared memory at ``dst`` in sw128_offset's layout (its 64-column
// regions one box each), its bytes counted on ``bar``; rows and columns outside the tensor land as zeros
template <int R, int D>
__device__ __forceinline__ void tma_tile(uint32_t dst, const CUtensorMap* map, int order, int row, int head, int b,
                                         uint32_t bar) {
  const auto at = [&](int i) { return (order & 3) == i ? row : ((order >> 2) & 3) == i ? head : b; };
  const int c1 = at(1), c2 = at(2), c3 = at(3);
#pragma unroll
  for (int r = 0; r < D / 64; ++r) tma_load_4d(dst + r * R * 128, map, r * 64, c1, c2, c3, bar);
}

// A backward block's start under TMA: thread 0 initialises the block's n mbarriers from ``bars`` (one arrival each)
// and loads its first two tiles (maps m0 and m1, at the same rows) into s0 and s1, counted on the first: W R-row
// tiles of each, back to back (the fused backward's two warpgroups at D = 128: one each); then the block syncs, so
// that every thread sees the barriers initialised before it waits on one
template <int R, int D, int W = 1>
__device__ __forceinline__ void tma_block_start(uint32_t bars, int n, uint32_t s0, const CUtensorMap* m0, int o0,
                                                uint32_t s1, const CUtensorMap* m1, int o1, int row, int head, int b) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < n; ++i) mbar_init(bars + 8 * i, 1);
    mbar_init_fence();
    mbar_expect_tx(bars, 2 * W * R * D * 2);
#pragma unroll
    for (int w = 0; w < W; ++w) {
      tma_tile<R, D>(s0 + w * R * D * 2, m0, o0, row + w * R, head, b, bars);
      tma_tile<R, D>(s1 + w * R * D * 2, m1, o1, row + w * R, head, b, bars);
    }
  }
  __syncthreads();
}
#endif

// Tile t of the persistent walk: (query tile, head, batch), query tiles fastest (a head's K and V stay in L2).
// Causal: a head's tiles longest first; where the grid is a multiple of the tiles a head (fwd_ws_grid), every head's
// tiles lie in one round of the grid and odd rounds take them shortest first, so each block alternates long and short
// tiles (the Gluon forward's schedule). Longest first in every round had left the blocks of one residue of n_m the
// longest tiles each round: the SMs active 82% of the kernel at B4 H16 S2048 D128 causal (run237, Nsight Compute).
__device__ __forceinline__ Tile tile_at(const Params& p, int64_t t, int n_m, bool alternate = true) {
  return tile_of(t, n_m, p.hq, gridDim.x, alternate && p.causal);  // (fwd_order.cuh)
}

// Packed varlen sequences (at most kOrderSeqs): the warp-specialised forward walks the tiles in the order of their
// sequences' key blocks, most first, every tile a real one, rounds alternating direction. tile_at's round-robin walk
// over sequences of different lengths gives the persistent blocks unequal work (a model of BERT's packed batch,
// lengths 256..512: the busiest block 1.18-1.30x the mean; sorted and alternating 1.02-1.06x). attn_fwd_order_kernel
// (one block) sorts the sequences (a counting sort by key blocks, kOrderClasses classes, the last holding the rest)
// and writes the walk, Params::fwd_order: entry t is tile_at's index of the t-th tile, entry fwd_order_n the tile
// count. The order within a class follows the atomics: which block takes a tile varies, what it computes does not.
// (Built inside the forward kernel, the sort had spilled its warpgroups' registers: ptxas 24-56 bytes. Batches under
// a key-padding mask were ordered too, by the key blocks of each one's valid range: the order kernel's scan of the
// mask took 7.7 us of the BERT batch's forward and the walk saved none of it, run308.)
constexpr int kOrderClasses = 64;  // (kOrderSeqs, kOrderBM: attention.h)
struct FwdOrder {
  int* seq;   // sequence ids by rank
  int* pre;   // pre[r]: tiles before rank r (Hq times the query tiles of the sequences before it); pre[B] all
  int* m_of;  // query tiles of sequence b
  int* cls;   // kOrderClasses counters
};
// The inclusive prefix sum of x over a full warp's lanes (this one ``lane``)
__device__ __forceinline__ int warp_inclusive_sum(int x, int lane) {
#pragma unroll
  for (int s = 1; s < 32; s <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, s);
    if (lane >= s) x += y;
  }
  return x;
}
template <int BM, int BN>
__device__ __forceinline__ void fwd_order_build(const Params& p, const FwdOrder& o, int n_m, int tid, int nt) {
  for (int c = tid; c < kOrderClasses; c += nt) o.cls[c] = 0;
  __syncthreads();
  for (int b = tid; b < p.batch; b += nt) {  // the key blocks of each sequence
    const int sq = p.cu_q[b + 1] - p.cu_q[b], sk = p.cu_k[b + 1] - p.cu_k[b];
    o.m_of[b] = min((sq + BM - 1) / BM, n_m);  // (tile_at's walk too visits n_m query tiles at most)
    o.seq[b] = min((sk + BN - 1) / BN, kOrderClasses - 1);  // (the class, for now)
    atomicAdd(&o.cls[o.seq[b]], 1);
  }
  __syncthreads();
  static_assert(kOrderClasses == 64, "two classes a lane");
  if (tid < 32) {  // each class's first rank, the most key blocks first: an exclusive scan by one warp, two a lane
    const int c0 = kOrderClasses - 1 - 2 * tid, n0 = o.cls[c0], n1 = o.cls[c0 - 1];
    const int x = warp_inclusive_sum(n0 + n1, tid);
    o.cls[c0] = x - n0 - n1;
    o.cls[c0 - 1] = x - n1;
  }
  __syncthreads();
  for (int b = tid; b < p.batch; b += nt) o.pre[atomicAdd(&o.cls[o.seq[b]], 1)] = b;  // (pre: ranks' ids, for now)
  __syncthreads();
  for (int b = tid; b < p.batch; b += nt) o.seq[b] = o.pre[b];
  __syncthreads();
  if (tid < 32) {  // pre: an exclusive scan of Hq m_of over the ranks, by one warp
    int carry = 0;
    for (int r0 = 0; r0 < p.batch; r0 += 32) {
      const int r = r0 + tid;
      const int v = r < p.batch ? p.hq * o.m_of[o.seq[r]] : 0;
      const int x = warp_inclusive_sum(v, tid);
      if (r < p.batch) o.pre[r] = carry + x - v;
      carry += __shfl_sync(0xffffffffu, x, 31);
    }
    if (tid == 0) o.pre[p.batch] = carry;
  }
  __syncthreads();
}
// The walk for the forward's grid of g blocks and n_m query tiles a head: Params::fwd_order (block 0); the other
// blocks (kOrderFillBlocks, where the caller passes targets) fill o's and lse's rows outside the sequences, which
// saves their own launch (zero_rows_outside_kernel: 3.2 us, run311)
constexpr int kOrderFillBlocks = 32;
template <int BM, int BN>
__global__ void __launch_bounds__(1024) attn_fwd_order_kernel(const Params p, int* order, int n_m, int g,
                                                                const ZeroRows outside) {
  if (blockIdx.x > 0) {
    fill_rows_outside(outside, static_cast<int64_t>(blockIdx.x - 1) * blockDim.x + threadIdx.x,
                      static_cast<int64_t>(gridDim.x - 1) * blockDim.x);
    return;
  }
  __shared__ int seq[kOrderSeqs], pre[kOrderSeqs + 1], m_of[kOrderSeqs], cls[kOrderClasses];
  const FwdOrder o{seq, pre, m_of, cls};
  fwd_order_build<BM, BN>(p, o, n_m, threadIdx.x, blockDim.x);
  const int n = pre[p.batch];
  for (int t = threadIdx.x; t < n; t += blockDim.x) {
    const OrderTile x = order_tile(t, g, p.batch, p.causal, o.seq, o.pre, o.m_of);  // (fwd_order.cuh)
    order[t] = x.m + n_m * (x.h + p.hq * x.b);
  }
  if (threadIdx.x == 0) order[p.fwd_order_n] = n;
}

// (Params::fwd_drop_bits) the producer thread of a query row: the keep bits of keys k0 .. k0 + 8 N - 1 of its row
// (the block's first N n-tiles) into shared memory at ``dst``, byte c (bit v: key k0 + 8 c + v) from the Philox call
// at ``ctr`` + c (the row's counter plus k0 / 8), as row_keep_bits' quads draw them (keep_byte_carry); the caller
// draws nothing for a row past the sequence (never stored). Most of the consumers' draws (two a lane and n-tile pair,
// each followed by the quad's exchange) move to the producer warpgroup, whose threads otherwise wait on the ring's
// mbarriers; all of them (N = 16) left the producer the bound (run317-319: FwdWsCfg::DRAWN).
template <int BN, int N>
__device__ __forceinline__ void ws_draw_bits(const Params& p, uint32_t dst, uint64_t ctr) {
  static_assert(BN == 128 && N % 4 == 0 && N <= BN / 8, "at most 16 calls a row, a word of 4 at a time");
  const uint64_t seed = drop_seed();
  const uint32_t thr = drop_threshold(p);
#pragma unroll 1
  for (int j = 0; j < N / 4; ++j) {  // (a word of 4 calls at a time: at its 56 registers all 16 unrolled spilled)
    uint32_t w = 0u;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      uint32_t a0, a1, a2, a3;
      philox4x32(seed, ctr + static_cast<uint64_t>(4 * j + c), a0, a1, a2, a3);
      w |= keep_byte_carry(a0, a1, a2, a3, thr) << (8 * c);
    }
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(dst + 4 * j), "r"(w) : "memory");
  }
}

template <typename T, int D, int MODE, int NW = 2, bool kOvl = false, bool kMix = false, bool kRange = false>
__global__ void __launch_bounds__(FwdWsCfg<D, NW>::NT, 1)
    attn_fwd_sm90_ws_kernel(const Params p, const __grid_constant__ FwdTma tm) {
  pdl_enter();  // (launch: pdl.cuh)
  drop_seed_init(p.p_drop > 0.f, p.seed);  // (the seed into shared memory, with dropout only)
#if defined(PK_WGMMA)
  static_assert(!kOvl || (NW == 3 && MODE == kModeNone), "the overlap: three consumers, no mask");
  static_assert(!kMix || kOvl, "tiles that mix heads: the overlap kernel's");
  static_assert(!kRange || (!kMix && MODE != kModeAny), "key ranges (ws_seq): dense tiles, a key-only mask's split");
  if constexpr (kRange && MODE == kModeKeys) {  // the key-mask half of the split: nothing to do where every batch's
    int any = 0;                                // keys are one run (the usual case), so the block leaves at once
    for (int b = threadIdx.x; b < p.batch; b += blockDim.x) any |= key_run(p.kv_range + 3 * b) ? 0 : 1;
    if (!__syncthreads_or(any)) return;
  }
  using C = FwdWsCfg<D, NW, kMix>;
  constexpr int BM = C::BM, BN = C::BN, S = C::STAGES;
  constexpr int kTurn = 1;  // named barriers kTurn + w: consumer warpgroup w's turn to issue its products
  constexpr int kProducer = 1 + NW;  // the producer warpgroup's named barrier (key-only masks)
  constexpr int kOStage = 2 + NW;    // named barriers kOStage + w: consumer warpgroup w's O tile (store_out_tma)
  constexpr int kSoft = 2 + 2 * NW;  // named barriers kSoft + w: consumer warpgroup w's turn at its softmax (soft_turn)
  static_assert(kSoft + NW <= 16, "16 named barriers");
  constexpr bool kKeys = MODE == kModeKeys;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;  // 2 Q buffers, then the K and V rings
  const uint32_t sK = sQ + 2 * C::QBYTES, sV = sK + S * C::KVBYTES, bars = sV + S * C::KVBYTES;
  const auto q_full = [&](int i) { return bars + 8u * i; };
  const auto q_empty = [&](int i) { return bars + 8u * (2 + i); };
  const auto k_full = [&](int i) { return bars + 8u * (4 + i); };
  const auto k_empty = [&](int i) { return bars + 8u * (4 + S + i); };
  const auto v_full = [&](int i) { return bars + 8u * (4 + 2 * S + i); };
  const auto v_empty = [&](int i) { return bars + 8u * (4 + 3 * S + i); };
  const auto b_empty = [&](int i) { return bars + 8u * (4 + 4 * S + i); };
  // key-only masks: the key addends of ring slot i, the key blocks [nb0, nb1) of the tile in Q buffer i, the
  // producer warps' partial ranges (two sets, alternating by tile)
  float* const skb = reinterpret_cast<float*>(smem_raw + (bars + 8u * C::NBAR - smem_addr(smem_raw)));
  int* const srange = reinterpret_cast<int*>(skb + S * BN);
  int* const sred = srange + 4;
  // (Params::fwd_drop_bits) ring slot i's keep bits at sbits + i BITS: row r's BN / 8 bytes at + r BN / 8
  const uint32_t sbits = (bars + 8u * C::NBAR + static_cast<uint32_t>(C::EXTRA) + 15u) & ~15u;
  // (D = 64) the consumer warpgroups' O tiles (store_out_tma), where the output's map is on
  const uint32_t sO = (sbits + S * C::BITS + 1023u) & ~1023u;
  const bool ostage = D == 64 && tm.o_on != 0;
  // (the host sets it with dropout only; not with key-only masks, whose producer also finds the key ranges and loads
  // the addends: with the draws too it spilled 72-96 bytes at its 56 registers, and at 72 registers (the consumers at
  // 216, no spills) it took the forward with dropout 1.05-1.06x longer, run318: the producer bounds the tile there)
  const bool bits = NW == 2 && !kKeys && p.fwd_drop_bits != 0;
  // the warpgroup, broadcast from lane 0 so that ptxas sees it uniform: a role branch on tid >> 7 is a divergent path
  // to it, and it serializes the wgmma chains inside one (C7520)
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), lane = tid & 31;
  const bool tma = tm.on != 0;
  if (tid == 0) {
    // full: the producer's 128 threads' cp.async arrivals, or its thread 0's expect_tx (TMA); empty: the consumers'
    // 4 NW warps (key-only masks: one more on q full for the range, 128 more on k full for the addends; the keep
    // bits: 128 more on k full)
    const uint32_t loads = tma ? 1 : 128;
    for (int i = 0; i < 2; ++i) {
      mbar_init(q_full(i), loads + (kKeys ? 1 : 0));
      mbar_init(q_empty(i), 4 * NW);
    }
    for (int i = 0; i < S; ++i) {
      mbar_init(k_full(i), loads + (kKeys || bits ? 128 : 0));
      mbar_init(k_empty(i), 4 * NW);
      mbar_init(v_full(i), loads);
      mbar_init(v_empty(i), 4 * NW);
      mbar_init(b_empty(i), 4 * NW);
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int n_m = (p.sq + BM - 1) / BM;
  // packed varlen sequences: the walk attn_fwd_order_kernel wrote (tile_at's indices, its causal order left out)
  const bool ordered = p.fwd_order != nullptr;
  // kMix: the 64-row units a head and in all (mix_rows; the host keeps 3 units within int32), three a tile
  const int n_u = (p.sq + 63) / 64, units = kMix ? n_u * p.hq * p.batch : 0;
  const int64_t n_tiles = kMix      ? (units + 2) / 3
                          : ordered ? p.fwd_order[p.fwd_order_n]
                                    : static_cast<int64_t>(n_m) * p.hq * p.batch;
  // the key blocks a tile visits: keys past n_end are masked for each of its rows
  const auto n_blocks = [&](const Seq& s, int q0) {
    const int n_end = p.causal ? min(s.sk, q0 + BM) : s.sk;
    return n_end > 0 ? (n_end + BN - 1) / BN : 0;
  };

  if (wg == 0) {  // producer
    regs_dec<C::PRODUCER_REGS>();
    PK_FWD_TRACE_DECL;
    // TMA: thread 0 issues every load; the other threads are needed only for the key ranges and addends, and for
    // packed varlen sequences (the maps' batch of one: rows at the sequence's offset) a sequence's last V block,
    // loaded by cp.async with the rows past the sequence zero-filled: TMA would bring the next sequence's rows, or
    // whatever lies past cu_seqlens[-1], and a P of 0 times a NaN there is NaN (its K rows, masked to -inf before the
    // max, may hold anything)
    const bool packed = p.cu_q != nullptr;
    if (tma && !kKeys && !packed && !bits && tid > 0) return;
    int qi = 0;      // tiles loaded (Q buffer qi % 2)
    uint32_t g = 0;  // key blocks loaded (ring slot g % S)
    // (tile_at, not TileWalk: the producer, off the consumers' path, has no registers for it with key-only masks)
    for (int64_t t = blockIdx.x; t < n_tiles; t += gridDim.x) {
      // kMix: the tile's first head A's (x), the last's B (mix_rows); ``sh`` 1 where they differ (a block each in turn)
      const Tile x = kMix ? mix_tile(mix_rows(static_cast<int>(t), 0, n_u, p.hq, units))
                          : tile_at(p, ordered ? p.fwd_order[t] : t, n_m, !ordered);
      const MixRows z = kMix ? mix_rows(static_cast<int>(t), NW - 1, n_u, p.hq, units) : MixRows{};
      const int sh = kMix ? z.step - 1 : 0;
      const int hkz = kMix ? z.h / p.group : 0;  // (B's K / V head once a tile: ptxas left the division in each block)
      const Seq s = ws_seq<MODE, kRange>(p, x.b);
      const int q0 = kMix ? 0 : x.m * BM;
      if (!kMix && q0 >= s.sq) continue;  // (varlen: this sequence is shorter than the max)
      const int hk = x.h / p.group;
      const int qb = qi & 1;
      mbar_wait(q_empty(qb), ((qi >> 1) & 1) ^ 1);
      PK_FWD_TRACE(8);
      // (the maps' row and batch: packed sequences are rows of a batch of one)
      const int tb = packed ? 0 : x.b;
      if (kMix) {  // (TMA: the host's rule) each warpgroup's 64 rows (the map's box), zeros past the sequence
        if (tid == 0) {
          mbar_expect_tx(q_full(qb), C::QBYTES);
#pragma unroll 1
          for (int w = 0; w < NW; ++w) {
            const MixRows r = mix_rows(static_cast<int>(t), w, n_u, p.hq, units);
            tma_tile<64, D>(sQ + qb * C::QBYTES + w * 64 * 128, &tm.q, tm.order[0], r.m * 64, r.h, r.b, q_full(qb));
          }
        }
      } else if (tma) {
        if (tid == 0) {
          mbar_expect_tx(q_full(qb), C::QBYTES);
          tma_tile<BM, D>(sQ + qb * C::QBYTES, &tm.q, tm.order[0], static_cast<int>(s.q_off) + q0, x.h, tb,
                          q_full(qb));
        }
      } else {
        load_tile_sw128<T, BM, D, 128, 1>(
            sQ + qb * C::QBYTES, static_cast<const T*>(p.q) + x.b * p.q_sb + x.h * p.q_sh + (s.q_off + q0) * p.q_ss,
            p.q_ss, min(BM, s.sq - q0), p.d, tid);
        cp_async_arrive(q_full(qb));
      }
      const T* K = static_cast<const T*>(p.k) + x.b * p.k_sb + hk * p.k_sh + s.k_off * p.k_ss;
      const T* V = static_cast<const T*>(p.v) + x.b * p.v_sb + hk * p.v_sh + s.k_off * p.v_ss;
      int nb0 = 0, nb1 = n_blocks(s, q0) << sh;
      // (the keep bits: this thread's row's first Philox counter; none for a row past the sequence)
      const bool draw = bits && q0 + tid < s.sq;
      const uint64_t dctr = draw ? drop_rows(p, x.b, x.h).row_ctr(q0 + tid) : 0;
      if constexpr (kKeys) {  // the valid keys [lo, hi) of [0, n_end), found by this warpgroup
        const int n_end = p.causal ? min(s.sk, q0 + BM) : s.sk;
        const int2 r = key_range<128, 1>(p, x.b, n_end, s.sk, tid, sred + qb * 8, [] { named_sync(kProducer, 128); });
        const int lo = r.x, hi = r.y;
        nb0 = lo / BN;
        nb1 = lo < hi ? (hi + BN - 1) / BN : nb0;
        if (tid == 0) {
          srange[2 * qb] = nb0;
          srange[2 * qb + 1] = nb1;
          mbar_arrive(q_full(qb));
        }
      }
      ++qi;
      for (int nb = nb0; nb < nb1; ++nb, ++g) {
        const int st = g % S, k0 = (nb >> sh) * BN, n = min(BN, s.sk - k0);
        const uint32_t ph = ((g / S) & 1) ^ 1;
        mbar_wait(k_empty(st), ph);
        PK_FWD_TRACE(9);
        const int kr = static_cast<int>(s.k_off) + k0;  // (the maps' row)
        // (kMix: B's blocks at the odd positions of a two-head tile)
        const bool bz = kMix && (nb & sh) != 0;
        const int hkj = bz ? hkz : hk, tbj = bz ? z.b : tb;
        if (tma) {
          if (tid == 0) {
            mbar_expect_tx(k_full(st), C::KVBYTES);
            tma_tile<BN, D>(sK + st * C::KVBYTES, &tm.k, tm.order[1], kr, hkj, tbj, k_full(st));
          }
        } else {
          load_tile_sw128<T, BN, D, 128, 1>(sK + st * C::KVBYTES, K + k0 * p.k_ss, p.k_ss, n, p.d, tid);
          cp_async_arrive(k_full(st));
        }
        if (kKeys || bits) {  // the key addends, the keep bits: each thread's, then its arrival
          float kb = 0.f;
          if constexpr (kKeys) kb = key_bias(p, x.b, k0 + tid, s.sk);
          mbar_wait(b_empty(st), ph);
          if constexpr (kKeys) skb[st * BN + tid] = kb;
          if (draw)
            ws_draw_bits<BN, C::DRAWN>(p, sbits + st * C::BITS + tid * (BN / 8), dctr + static_cast<uint64_t>(k0 >> 3));
          mbar_arrive(k_full(st));
        }
        mbar_wait(v_empty(st), ph);
        PK_FWD_TRACE(10);
        // (as K's load above: one lambda for both changed ptxas's schedule of the kernel, a build not measured)
        if (tma && !(packed && n < BN)) {
          if (tid == 0) {
            mbar_expect_tx(v_full(st), C::KVBYTES);
            tma_tile<BN, D>(sV + st * C::KVBYTES, &tm.v, tm.order[2], kr, hkj, tbj, v_full(st));
          }
        } else if (tma) {  // a packed sequence's last V block: every thread's cp.async counted, then the one arrival
          load_tile_sw128<T, BN, D, 128, 1>(sV + st * C::KVBYTES, V + k0 * p.v_ss, p.v_ss, n, p.d, tid);
          cp_async_arrive_inc(v_full(st));
          named_sync(kProducer, 128);
          if (tid == 0) mbar_arrive(v_full(st));
        } else {
          load_tile_sw128<T, BN, D, 128, 1>(sV + st * C::KVBYTES, V + k0 * p.v_ss, p.v_ss, n, p.d, tid);
          cp_async_arrive(v_full(st));
        }
      }
    }
    cp_async_wait_all();
    return;
  }

  // consumers
  regs_inc<C::CONSUMER_REGS>();
  PK_FWD_TRACE_DECL;
  PK_FWD_TRACE(0);
  const int cw = wg - 1, warp = (tid >> 5) & 3, g8 = lane >> 2, t4 = lane & 3;
  const int next = cw + 1 == NW ? 0 : cw + 1;  // the warpgroup whose turn follows this one's
  if (cw == NW - 1) named_arrive(kTurn, 256);  // consumer 0 takes the first turn
  const bool soft_turn = tm.soft_turn != 0;
  const bool fence = tm.fence != 0, packed = p.cu_q != nullptr;
  if (soft_turn && cw == NW - 1) named_arrive(kSoft, 256);  // and the first softmax turn
  int qi = 0;
  uint32_t g = 0;
  // kMix: the other head's block at ring position ``gs``, never read here, freed once it landed: at the warpgroup's
  // block at ring position g, the one at g - 1 (a wait that passes at once: the producer issued its K and V before
  // this block's K), and the first head's warpgroups free the second's last after their last P V (by then the second
  // head's warpgroup has taken its turn on it). (Tried, H200 run416: each position's V issued after the next one's
  // K, so that a V slot still held would not hold back the next K, and the other head's V freed two blocks later:
  // BERT-base 73.9-74.6 us against run415's 73.1-73.2 in this order. The timelines of both orders, run417 / run419,
  // had the key blocks' waits for K and the previous V about equal, 496-531 against 487-559 cycles.)
  const auto free_other = [&](uint32_t gs) {
    const int ss = gs % S;
    const uint32_t ps = (gs / S) & 1;
    mbar_wait2(k_full(ss), ps, v_full(ss), ps);
    if (lane == 0) {
      mbar_arrive(k_empty(ss));
      mbar_arrive(v_empty(ss));
    }
  };
  TileWalk walk(static_cast<int>(gridDim.x), static_cast<int>(blockIdx.x), n_m, p.hq);  // (fwd_order.cuh)
  MixWalk mwalk(static_cast<int>(gridDim.x), static_cast<int>(blockIdx.x), kMix ? n_u : 1, p.hq);
  for (int64_t t = blockIdx.x; t < n_tiles; t += gridDim.x, walk.next(n_m, p.hq), mwalk.next(n_u, p.hq)) {
    Tile x;
    // kMix: the warpgroup's own unit (mix_rows), its ring positions every ``step``-th from the tile's first plus
    // ``second``; else the tile's rows from q0, every position the warpgroup's
    int q0, step = 1, second = 0;
    if constexpr (kMix) {
      const MixRows r = mwalk.rows(cw, NW, n_u, p.hq, p.batch);
      x = Tile{r.m, r.h, r.b};
      q0 = r.m * 64;
      step = r.step;
      second = r.second;
    } else {
      x = ordered ? tile_at(p, p.fwd_order[t], n_m, false) : walk.tile(n_m, static_cast<int>(gridDim.x), p.causal);
      q0 = x.m * BM;
    }
    const Seq s = ws_seq<MODE, kRange>(p, x.b);
    if (!kMix && q0 >= s.sq) continue;
    const int qb = qi & 1;
    mbar_wait(q_full(qb), (qi >> 1) & 1);
    PK_FWD_TRACE(1);
    ++qi;
    const int qw = kMix ? q0 : q0 + cw * 64;  // the warpgroup's first row
    const int row[2] = {qw + warp * 16 + g8, qw + warp * 16 + g8 + 8};
    const uint32_t q_base = sQ + qb * C::QBYTES + cw * 64 * 128;
    float o[D / 8][4];
    zero(o);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    uint32_t pa[BN / 16][4];  // P of the previous key block (the A operand of its P V)
    int nb0 = 0, nb1 = n_blocks(s, q0);
    if constexpr (kKeys) {
      nb0 = srange[2 * qb];
      nb1 = srange[2 * qb + 1];
    }
    // O += P V of the key block in ring slot st (issued, not committed)
    const auto issue_pv = [&](int st) {
      const uint32_t v_base = sV + st * C::KVBYTES;
#pragma unroll
      for (int kt = 0; kt < BN / 16; ++kt) wgmma_rs<T, D>(o, pa[kt], gmma_desc<BN * 128, 1024>(v_base, kt * 16 * 128));
    };
    g += second;
    for (int nb = nb0; nb < nb1; ++nb, g += step) {
      const int st = g % S, pst = (g + S - step) % S, k0 = nb * BN;
      if (kOvl && nb > nb0) {  // (both polled at once: run349, BERT-base 69.6-69.9 us against 70.0-70.4 one by one)
        mbar_wait2(k_full(st), (g / S) & 1, v_full(pst), ((g - step) / S) & 1);
      } else {
        mbar_wait(k_full(st), (g / S) & 1);
        if (nb > nb0) mbar_wait(v_full(pst), ((g - step) / S) & 1);
      }
      // (before the turn: the products' registers not yet held; at S's wait it spilled)
      if (kMix && step == 2 && (second != 0 || nb > nb0)) free_other(g - 1);
      PK_FWD_TRACE(11);
      if (fence) fence_async_smem();  // (cp.async's tiles; TMA's land in the async proxy that wgmma reads)
      float sc[BN / 8][4], alpha[2];
      named_sync(kTurn + cw, 256);
      PK_FWD_TRACE(2);
      fence_acc(o);
      wgmma_fence();
      wgmma_chain_ss<T, BN, D, BM, BN>(sc, q_base, sK + st * C::KVBYTES);  // S = Q K^T
      if constexpr (kOvl) {  // S its own group; P V the next (an empty one on the tile's first block)
        wgmma_commit();
        if (nb > nb0) {
          issue_pv(pst);
          wgmma_commit();
        } else {
          wgmma_commit();
        }
      } else {
        if (nb > nb0) issue_pv(pst);
        wgmma_commit();
      }
      named_arrive(kTurn + next, 256);
      if constexpr (kOvl) {
        wgmma_wait<1>();  // S only: the previous block's P V runs on during this softmax
        fence_acc(sc);
      } else {
        wgmma_wait_all();
        fence_acc(sc);
        fence_acc(o);
      }
      PK_FWD_TRACE(3);
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(k_empty(st));
        if (!kOvl && nb > nb0) mbar_arrive(v_empty(pst));
        if (nb == nb1 - 1) mbar_arrive(q_empty(qb));  // the tile's last read of Q
      }
      const bool edge = k0 + BN > s.sk || (p.causal && k0 + BN - 1 > qw);
      if (soft_turn) named_sync(kSoft + cw, 256);
      with_flag(edge, [&](auto e) {
#ifdef PYKERNELS_FWD_TRACE
        const auto mark = [&](int code) { PK_FWD_TRACE(code); };
#else
        const NoMark mark;
#endif
        if constexpr (kOvl)
          softmax_block<MODE, BN, D, true, true, 0, 0, true>(p, sc, o, m, l, x.b, x.h, row, k0, s, decltype(e)::value,
                                                              skb + st * BN, t4, 0u, mark, alpha);
        else if (bits)  // (the keep bits of rows row[0], row[1] in the tile, the producer's)
          softmax_block<MODE, BN, D, MODE == kModeNone, true, C::DRAWN>(
              p, sc, o, m, l, x.b, x.h, row, k0, s, decltype(e)::value, skb + st * BN, t4,
              sbits + st * C::BITS + (row[0] - q0) * (BN / 8), mark);
        else
          softmax_block<MODE, BN, D, MODE == kModeNone, true>(p, sc, o, m, l, x.b, x.h, row, k0, s,
                                                               decltype(e)::value, skb + st * BN, t4, 0u, mark);
      });
      if constexpr (kOvl) {  // the previous block's P V complete: V's slot free, O rescaled where a max moved
        wgmma_wait_all();
        fence_acc(o);
        __syncwarp();
        if (lane == 0 && nb > nb0) mbar_arrive(v_empty(pst));
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) scale_rows(o, alpha);
      }
      if (soft_turn) named_arrive(kSoft + next, 256);
      if (kKeys || bits) {  // the warp's reads of the addends and keep bits are done
        __syncwarp();
        if (lane == 0) mbar_arrive(b_empty(st));
      }
#pragma unroll
      for (int kt = 0; kt < BN / 16; ++kt) acc_to_a<T>(pa[kt], sc[2 * kt], sc[2 * kt + 1]);
      PK_FWD_TRACE(4);
    }
    if (nb1 > nb0) {  // the last block's P V
      const int pst = (g + S - step) % S;
      mbar_wait(v_full(pst), ((g - step) / S) & 1);
      PK_FWD_TRACE(12);
      if (fence || packed) fence_async_smem();  // (and a packed sequence's last V block, cp.async's)
      named_sync(kTurn + cw, 256);
      PK_FWD_TRACE(5);
      fence_acc(o);
      wgmma_fence();
      issue_pv(pst);
      wgmma_commit();
      named_arrive(kTurn + next, 256);
      wgmma_wait_all();
      fence_acc(o);
      PK_FWD_TRACE(6);
      __syncwarp();
      if (lane == 0) mbar_arrive(v_empty(pst));
      if (kMix && step == 2 && second == 0) free_other(g - 1);  // (the second head's last block)
    } else if (lane == 0) {
      mbar_arrive(q_empty(qb));  // (no key: Q unread)
    }
    g -= second;
    if constexpr (D == 64) {
      if (ostage) {
        store_out_tma<T>(p, &tm.o, tm.order[3], sO + cw * 64 * 128, kOStage + cw, (tid & 127) == 0, o, m, l, x.b,
                         x.h, row, qw, s, t4);
        PK_FWD_TRACE(7);
        continue;
      }
    }
    store_out<T, D>(p, o, m, l, x.b, x.h, row, s, t4);
    PK_FWD_TRACE(7);
  }
  if (ostage && (tid & 127) == 0) bulk_wait_all();  // (the O tiles' stores done before the block's memory goes)
  if (cw == 0) named_sync(kTurn, 256);  // the last consumer's last pass of the turn
  if (soft_turn && cw == 0) named_sync(kSoft, 256);  // and of the softmax turn
#else
  __trap();  // (not launched: the host takes this kernel only from an sm_90a build on a 9.0 device)
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------------------------
// dS = P (dP Z - delta) on a query-row tile (the dQ kernels; keys k0 .., rows row[0], row[1] of the thread, lse2 and
// dl their lse in log2 units and delta): sc holds S and becomes dS; ``kb`` the block's key addends (kModeKeys)
template <int MODE, int BC, bool kInl = false>
__device__ __forceinline__ void ds_rows(const Params& p, float (&sc)[BC / 8][4], const float (&dp)[BC / 8][4], int b,
                                        int h, const int (&row)[2], int k0, const Seq& s, bool edge, const float* kb,
                                        const float (&lse2)[2], const float (&dl)[2], int t4) {
  static_assert(BC % 16 == 0, "the dropout's quad draws n-tiles in pairs");
  with_flag(p.p_drop > 0.f, [&](auto drop) {
    const DropRows d = drop_rows(p, b, h);
#pragma unroll
    for (int n2 = 0; n2 < BC / 8; n2 += 2) {
      const uint32_t keep = decltype(drop)::value ? row_keep_bits<kInl>(p, d, row, k0, n2, t4) : 0xFFu;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int nt = n2 + u;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1, i = row[r], jl = nt * 8 + 2 * t4 + (e & 1), j = k0 + jl;
          const float x = score<MODE>(p, sc[nt][e], b, h, i, j, s.sq, s.sk, edge, MODE == kModeKeys ? kb[jl] : 0.f);
          const float pe = exp2f(x - lse2[r]);
          const float z = keep_scale<decltype(drop)::value>(p, keep, 4 * u + e);
          sc[nt][e] = pe * (dp[nt][e] * z - dl[r]);
        }
      }
    }
  });
}
// The element walk of a key-row tile (the dK/dV kernels; queries qs .., keys key[0], key[1] of the thread): f(drop, n2,
// keep) for each pair of n-tiles n2, n2 + 1, with drop the dropout's flag as a constant and keep the pair's keep bits
// (bit 4 u + e: element e of n-tile n2 + u; 0xFF without dropout)
template <int BQ, bool kInl, typename F>
__device__ __forceinline__ void key_tile_walk(const Params& p, int b, int h, const int (&key)[2], int qs, int t4,
                                              F&& f) {
  static_assert(BQ % 16 == 0, "the dropout's octet draws n-tiles in pairs");
  with_flag(p.p_drop > 0.f, [&](auto drop) {
    const DropRows d = drop_rows(p, b, h);
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int n2 = 0; n2 < BQ / 8; n2 += 2)
      f(drop, n2, decltype(drop)::value ? key_keep_bits<kInl>(p, d, key, qs, n2, t4, g) : 0xFFu);
  });
}
// dS^T and P^T Z on a key-row tile (key addends kb; sL, sD the queries' lse in log2 units and delta): st holds S^T
// and becomes dS^T, dpt holds dP^T and becomes P^T Z (for dV); MODE the mask's (kb is read with kModeKeys)
template <int BQ, int MODE, bool kInl = false>
__device__ __forceinline__ void dst_rows(const Params& p, float (&st)[BQ / 8][4], float (&dpt)[BQ / 8][4], int b,
                                         int h, const int (&key)[2], int qs, const Seq& s, bool edge,
                                         const float (&kb)[2], const float* sL, const float* sD, int t4) {
  key_tile_walk<BQ, kInl>(p, b, h, key, qs, t4, [&](auto drop, int n2, uint32_t keep) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int nt = n2 + u;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int il = nt * 8 + 2 * t4 + (e & 1), i = qs + il, j = key[e >> 1];
        const float x = score<MODE>(p, st[nt][e], b, h, i, j, s.sq, s.sk, edge, kb[e >> 1]);
        const float pe = exp2f(x - sL[il]);
        const float z = keep_scale<decltype(drop)::value>(p, keep, 4 * u + e);
        st[nt][e] = pe * (dpt[nt][e] * z - sD[il]);  // dS^T
        dpt[nt][e] = pe * z;                          // P^T with dropout
      }
    }
  });
}
// dst_rows' first half (the deferred fused backward, whose dP^T products are still running): st holds S^T and becomes
// P^T (masked, no dropout), keep[n2 / 2] the keep bits of n-tiles n2, n2 + 1 (key_tile_walk's)
template <int BQ, int MODE>
__device__ __forceinline__ void pt_rows(const Params& p, float (&st)[BQ / 8][4], uint32_t (&keep)[BQ / 16], int b,
                                        int h, const int (&key)[2], int qs, const Seq& s, bool edge,
                                        const float (&kb)[2], const float* sL, int t4) {
  key_tile_walk<BQ, true>(p, b, h, key, qs, t4, [&](auto, int n2, uint32_t k) {
    keep[n2 / 2] = k;
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int nt = n2 + u, il = nt * 8 + 2 * t4 + (e & 1);
        st[nt][e] = exp2f(score<MODE>(p, st[nt][e], b, h, qs + il, key[e >> 1], s.sq, s.sk, edge, kb[e >> 1]) -
                          sL[il]);
      }
  });
}

// Packed sequences: dq's, dk's and dv's rows outside the sequences (the backward's pre kernel fills them: zero_rows.cuh)
template <typename T>
__host__ __device__ __forceinline__ ZeroRows grads_outside(const Params& p) {
  ZeroRows z{};
  z.n = 3;
  z.batch = p.batch;
  constexpr int64_t e = sizeof(T);
  z.t[0] = {p.dq, p.cu_q, p.tq, p.dq_ss * e, 1, 0, 0u};
  z.t[1] = {p.dk, p.cu_k, p.tk, p.dk_ss * e, 1, 0, 0u};
  z.t[2] = {p.dv, p.cu_k, p.tk, p.dv_ss * e, 1, 0, 0u};
  return z;
}
constexpr int kPreFillBlocks = 64;  // the pre kernel's blocks that fill them

// delta = rowsum(dO * O) in fp32: L lanes a row (a 16-byte pack each; L 8 / 16 / 32 for D <= 64 / 128 / 256), each
// warp 16 rows, up to 4 of a lane's rows loaded at once (a warp a row, one load at a time, ran at half the card's
// bandwidth: 34 us of the BERT-base backward's 349, run225); the dq_acc zeroing and the packed gradients' outside rows
// (grads_outside) too
template <typename T, int L>
__global__ void __launch_bounds__(kThreads) attn_bwd_pre_kernel(const Params p) {
  pdl_enter();  // (launch: pdl.cuh)
  constexpr int n = Pack<T>::n;                          // elements a 16-byte chunk
  constexpr int RPW = 32 / L, ROWS = kRows / 4 / RPW;  // rows a warp a pass; passes (16 rows a warp)
  constexpr int BATCH = ROWS < 4 ? ROWS : 4;             // passes whose loads are in flight together
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c = lane % L;
  const int h = blockIdx.y, b = blockIdx.z;
  const Seq s = seq_of(p, b);
  const int i0 = blockIdx.x * kRows + warp * (kRows / 4) + lane / L;  // this lane's first row; then + k RPW
  const bool col_ok = c * n < p.d;
  const T* O = static_cast<const T*>(p.o) + b * p.o_sb + h * p.o_sh + (s.q_off + i0) * p.o_ss + c * n;
  const T* dO = static_cast<const T*>(p.dout) + b * p.do_sb + h * p.do_sh + (s.q_off + i0) * p.do_ss + c * n;
  float* const delta = p.delta + b * p.lse_sb + h * p.lse_sh + s.q_off + i0;
#pragma unroll
  for (int k0 = 0; k0 < ROWS; k0 += BATCH) {
    uint4 ro[BATCH], rd[BATCH];
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
      const bool ok = col_ok && i0 + (k0 + k) * RPW < s.sq;
      ro[k] = ok ? *reinterpret_cast<const uint4*>(O + (k0 + k) * RPW * p.o_ss) : make_uint4(0u, 0u, 0u, 0u);
      rd[k] = ok ? *reinterpret_cast<const uint4*>(dO + (k0 + k) * RPW * p.do_ss) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
      float fo[n], fd[n], acc = 0.f;
      unpack<T>(ro[k], fo);
      unpack<T>(rd[k], fd);
#pragma unroll
      for (int e = 0; e < n; ++e) acc += fo[e] * fd[e];
#pragma unroll
      for (int off = L / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
      if (c == 0 && i0 + (k0 + k) * RPW < s.sq) delta[(k0 + k) * RPW] = acc;
    }
  }
  if constexpr (L == 8 || L == 16) {
    // the fused backward's dQ sums (Params::dq_acc, B * Hq * Sq runs of L * 8 floats: dq_acc_cols, D <= 64 or <= 128)
    // zeroed here, 8 floats a lane, a run for each row this pass reads (at D = 128 a run is not the row's slices, but
    // the runs cover the buffer): the host allocates them uninitialised and no fill kernel runs (11.4 us, a launch of
    // its own, at BERT-base: run280). Varlen (D <= 64): Hq runs of T rows, the sequence's rows at its offset
    constexpr int COLS = L * 8;
    if (p.dq_acc != nullptr) {
      const int64_t ab = p.cu_q != nullptr ? 0 : b;
      // (varlen at D = 128: each lane's 8 floats in their own slice, (1, Hq, 2, T, 64): a run of 128 floats a row
      // would leave slice 1's last rows unzeroed where T > cu_seqlens[-1])
      float* const z = COLS == 128 && p.cu_q != nullptr
                           ? p.dq_acc + ((static_cast<int64_t>(h) * 2 + c / 8) * dq_acc_rows(p) + s.q_off + i0) * 64 +
                                 (c % 8) * 8
                           : p.dq_acc + ((ab * p.hq + h) * dq_acc_rows(p) + s.q_off + i0) * COLS + c * 8;
      const int64_t zs = COLS == 128 && p.cu_q != nullptr ? 64 : COLS;  // (floats from one row to the next)
#pragma unroll
      for (int k = 0; k < ROWS; ++k)
        if (i0 + k * RPW < s.sq) {
          reinterpret_cast<float4*>(z + k * RPW * zs)[0] = make_float4(0.f, 0.f, 0.f, 0.f);
          reinterpret_cast<float4*>(z + k * RPW * zs)[1] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
  }
  if (p.pre_fills) {  // packed: the gradients' rows outside the sequences, by the first kPreFillBlocks blocks
    // (before the kernels that write the sequences' rows, which are disjoint from them; dq_convert skips them)
    const int64_t gx = gridDim.x, gy = gridDim.y;
    const int64_t blk = blockIdx.x + gx * (blockIdx.y + gy * blockIdx.z);
    const int64_t nb = min(static_cast<int64_t>(kPreFillBlocks), gx * gy * gridDim.z);
    if (blk < nb) fill_rows_outside(grads_outside<T>(p), blk * blockDim.x + threadIdx.x, nb * blockDim.x);
  }
}

template <int D>
struct DkdvCfg {
  static constexpr int DC = D > 128 ? D / 2 : D;  // accumulator columns a block (two blocks a key block above 128)
  static constexpr int CHUNKS = D / DC;
  static constexpr int BQ = 32;  // query rows an iteration
  // D <= 64: 3 blocks an SM (168 registers; ptxas spills up to 52 bytes at D = 64): 4% faster than 2 blocks at 64
  // query rows an iteration (run203)
  static constexpr int MIN_BLOCKS = D <= 64 ? 3 : 1;
  static constexpr int LD = D + 8;
  static constexpr size_t smem(size_t elt) {
    return static_cast<size_t>(2 * kRows + 2 * BQ) * LD * elt + 2 * BQ * sizeof(float);
  }
};

template <typename T, int D, int MODE>
__global__ void __launch_bounds__(kThreads, DkdvCfg<D>::MIN_BLOCKS) attn_bwd_dkdv_kernel(const Params p) {
  pdl_enter();  // (launch: pdl.cuh)
  drop_seed_init(p.p_drop > 0.f, p.seed);  // (the seed into shared memory, with dropout only)
  using C = DkdvCfg<D>;
  constexpr int DC = C::DC, BQ = C::BQ, LD = C::LD;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kRows * LD;
  T* sQ = sV + kRows * LD;
  T* sO = sQ + BQ * LD;  // dO
  float* sL = reinterpret_cast<float*>(sO + BQ * LD);
  float* sDelta = sL + BQ;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int chunk = blockIdx.x % C::CHUNKS, k0 = (blockIdx.x / C::CHUNKS) * kRows;
  const int c0 = chunk * DC;
  const int hk = blockIdx.y, b = blockIdx.z;
  const Seq s = seq_of(p, b);
  if (k0 >= s.sk) return;
  const T* K = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh + (s.k_off + k0) * p.k_ss;
  const T* V = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh + (s.k_off + k0) * p.v_ss;
  load_tile<T, kRows, D>(sK, K, p.k_ss, min(kRows, s.sk - k0), p.d, tid);
  load_tile<T, kRows, D>(sV, V, p.v_ss, min(kRows, s.sk - k0), p.d, tid);
  cp_async_commit();

  float dk[DC / 8][4], dv[DC / 8][4];
  zero(dk);
  zero(dv);
  const int key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  const float kb[2] = {key_bias<false>(p, b, key[0], s.sk), key_bias<false>(p, b, key[1], s.sk)};
  const int q_first = p.causal ? (k0 / BQ) * BQ : 0;  // queries i < k0 see no key of this block
  // a key-only mask that masks every key of this block: dK = dV = 0, no query visited (block-uniform test)
  const bool keys = p.mask_kind != kNoMask && p.mask_keys;
  const int heads = !keys || __syncthreads_or(kb[0] != -INFINITY || kb[1] != -INFINITY) ? p.group : 0;

  for (int hh = 0; hh < heads; ++hh) {
    const int h = hk * p.group + hh;
    const T* Q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh + s.q_off * p.q_ss;
    const T* dO = static_cast<const T*>(p.dout) + b * p.do_sb + h * p.do_sh + s.q_off * p.do_ss;
    const int64_t lrow = b * p.lse_sb + h * p.lse_sh + s.q_off;
    for (int qs = q_first; qs < s.sq; qs += BQ) {
      const int nq = min(BQ, s.sq - qs);
      load_tile<T, BQ, D>(sQ, Q + qs * p.q_ss, p.q_ss, nq, p.d, tid);
      load_tile<T, BQ, D>(sO, dO + qs * p.do_ss, p.do_ss, nq, p.d, tid);
      cp_async_commit();
      if (tid < BQ) {
        sL[tid] = tid < nq ? lse_log2(p.lse[lrow + qs + tid]) : INFINITY;
        sDelta[tid] = tid < nq ? p.delta[lrow + qs + tid] : 0.f;
      }
      cp_async_wait<0>();
      __syncthreads();

      // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys x BQ queries
      float st[BQ / 8][4], dpt[BQ / 8][4];
      zero(st);
      zero(dpt);
      mma_abt<T, LD, D, BQ>(st, smem_rows<T, LD>(sK, warp * 16, lane), sQ, lane);
      mma_abt<T, LD, D, BQ>(dpt, smem_rows<T, LD>(sV, warp * 16, lane), sO, lane);
      // dS^T = P^T (dP^T Z - delta) in st, P^T Z (for dV) in dpt
      const bool edge = p.causal && qs < k0 + kRows - 1;
      with_flag(edge, [&](auto e) {
        dst_rows<BQ, MODE>(p, st, dpt, b, h, key, qs, s, decltype(e)::value, kb, sL, sDelta, t4);
      });
      mma_acc_b<T, LD, BQ, DC>(dv, dpt, sO, c0, lane);  // dV += P^T dO
      mma_acc_b<T, LD, BQ, DC>(dk, st, sQ, c0, lane);   // dK += dS^T Q
      __syncthreads();  // before the next iteration overwrites sQ, sO, sL, sDelta
    }
  }
  cp_async_wait<0>();  // (no query block: the K / V loads)

  store_rows<T, DC>(p.dk, p.dk_sb, p.dk_sh, p.dk_ss, dk, p.scale, b, hk, key, s.k_off, s.sk, c0, p.d, t4);
  store_rows<T, DC>(p.dv, p.dv_sb, p.dv_sh, p.dv_ss, dv, 1.f, b, hk, key, s.k_off, s.sk, c0, p.d, t4);
}

template <int D>
struct DqCfg {
  static constexpr int BC = D > 128 ? 32 : 64;  // keys an iteration
  static constexpr int LD = D + 8;
  static constexpr size_t smem(size_t elt) { return static_cast<size_t>(2 * kRows + 2 * BC) * LD * elt; }
};

template <typename T, int D, int MODE>
__global__ void __launch_bounds__(kThreads) attn_bwd_dq_kernel(const Params p) {
  pdl_enter();  // (launch: pdl.cuh)
  drop_seed_init(p.p_drop > 0.f, p.seed);  // (the seed into shared memory, with dropout only)
  using C = DqCfg<D>;
  constexpr int BC = C::BC, LD = C::LD;
  constexpr bool kKeys = MODE == kModeKeys;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sO = sQ + kRows * LD;  // dO
  T* sK = sO + kRows * LD;
  T* sV = sK + BC * LD;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const Seq s = seq_of(p, b);
  const int q0 = blockIdx.x * kRows;
  if (q0 >= s.sq) return;
  const T* Q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh + (s.q_off + q0) * p.q_ss;
  const T* dO = static_cast<const T*>(p.dout) + b * p.do_sb + h * p.do_sh + (s.q_off + q0) * p.do_ss;
  const T* K = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh + s.k_off * p.k_ss;
  const T* V = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh + s.k_off * p.v_ss;
  load_tile<T, kRows, D>(sQ, Q, p.q_ss, min(kRows, s.sq - q0), p.d, tid);
  load_tile<T, kRows, D>(sO, dO, p.do_ss, min(kRows, s.sq - q0), p.d, tid);
  cp_async_commit();

  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  float lse2[2], dl[2];
  const int64_t lrow = b * p.lse_sb + h * p.lse_sh + s.q_off;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lse2[r] = row[r] < s.sq ? lse_log2(p.lse[lrow + row[r]]) : INFINITY;
    dl[r] = row[r] < s.sq ? p.delta[lrow + row[r]] : 0.f;
  }
  float dq[D / 8][4];
  zero(dq);
  int k_lo = 0, k_hi = p.causal ? min(s.sk, q0 + kRows) : s.sk;  // the keys visited
  if constexpr (kKeys) {
    const int2 r = key_range(p, b, k_hi, s.sk);
    k_lo = r.x / BC * BC;
    k_hi = r.x < r.y ? r.y : k_lo;
  }
  // a key-only mask's addends of the key block (key_addends: alternating halves, read an iteration earlier)
  __shared__ float skb[2][kKeys ? BC : 1];
  const int nb1 = (k_hi + BC - 1) / BC;
  float kb_next = kKeys ? key_addends_first<BC>(p, b, k_lo / BC, nb1, s.sk) : 0.f;
  for (int k0 = k_lo; k0 < k_hi; k0 += BC) {
    const int half = (k0 / BC) & 1;
    if constexpr (kKeys) key_addends(p, skb, kb_next, k0 / BC, nb1, b, s.sk);
    load_tile<T, BC, D>(sK, K + k0 * p.k_ss, p.k_ss, min(BC, s.sk - k0), p.d, tid);
    load_tile<T, BC, D>(sV, V + k0 * p.v_ss, p.v_ss, min(BC, s.sk - k0), p.d, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    float sc[BC / 8][4], dp[BC / 8][4];
    zero(sc);
    zero(dp);
    mma_abt<T, LD, D, BC>(sc, smem_rows<T, LD>(sQ, warp * 16, lane), sK, lane);  // S = Q K^T
    mma_abt<T, LD, D, BC>(dp, smem_rows<T, LD>(sO, warp * 16, lane), sV, lane);  // dP = dO V^T
    const bool edge = k0 + BC > s.sk || (p.causal && k0 + BC - 1 > q0);
    with_flag(edge, [&](auto e) {  // dS
      ds_rows<MODE, BC>(p, sc, dp, b, h, row, k0, s, decltype(e)::value, skb[half], lse2, dl, t4);
    });
    mma_acc_b<T, LD, BC, D>(dq, sc, sK, 0, lane);  // dQ += dS K
    __syncthreads();  // before the next iteration overwrites sK, sV
  }
  cp_async_wait<0>();

  store_rows<T, D>(p.dq, p.dq_sb, p.dq_sh, p.dq_ss, dq, p.scale, b, h, row, s.q_off, s.sq, 0, p.d, t4);
}

// The backward's dQ and dK/dV kernels on warpgroup MMA (sm_90a, head dims up to 128; launch_backward takes them
// where plan_of(p).sm90 holds), with the mma.sync kernels' element rules (ds_rows, dst_rows) and no atomics:
//   dQ: one warpgroup a block of 64 queries (3 blocks an SM at D = 64, 2 above); key blocks of 64 double-buffered in
//       swizzled rows as in the forward; S = Q K^T and dP = dO V^T are two wgmma chains from shared memory, dQ += dS
//       K one from dS in registers with K read N-major.
//   dK/dV: one warpgroup a block of 64 keys (3 blocks an SM at D = 64, 2 above), its K and V in shared memory; query
//       blocks of 32 (all heads of the GQA group in turn) double-buffered with their lse and delta; S^T = K Q^T and
//       dP^T = V dO^T from shared memory, dV += P^T Z dO and dK += dS^T Q from registers with dO and Q read N-major.
// Measured (H200, graph replay, backward TFLOP/s; the mma.sync kernels' in the same call: 102 / 104 / 81 / 114):
// BERT-base 113, key padding 115, GPT-2 92, S2048 D128 causal 144 (run212); with 2 warpgroups a dQ block at D = 64
// and 64-query blocks in dK/dV (2 blocks an SM) 112 / 114 / 87 / 145 (run211). Each warpgroup waits for its chains
// (no overlap of the softmax-like element work with its own MMA), which left it at about 0.4x the Triton path's
// backward. What held it there was index work more than MMA: a profile of BERT-base (run225: dK/dV 209 us, dQ 106,
// delta 34 of 349) found IMAD the most issued opcode of dK/dV (18%) and barrier waits its largest stall (27%). One
// tile loader that computes a thread's addresses once (the old loop divided by the chunk count every copy), the
// delta kernel's L lanes a row, the (head, query block) walk without a division and the lse / delta loads taken off
// warp 0's path took the backward to 214 / 213 / 177 / 255 TFLOP/s on an H100 (run226-228; 0.73x the Triton path's
// at BERT-base). Three-deep Q / dO and K / V rings changed nothing (run230).
// Since run232 both run in one launch (attn_bwd_sm90_kernel: a block is dK/dV's or dQ's by its x), so that the two
// kernels' blocks share the SMs with one tail instead of two in sequence: 1.02-1.10x the backward (GPT-2 175 -> 190-192,
// key padding 210 -> 218-220). And at D = 64 without a mask the dQ blocks issue dQ_{j-1} += dS_{j-1} K_{j-1} after
// S_j and dP_j as a second commit group, waited for only after dS_j is formed (PIPE, the Gluon dQ kernel's order; K
// takes a third buffer, K_{j-1} being read while K_{j+1} loads): 1.02-1.04x more (BERT-base 220 -> 226-230). PIPE
// is not taken with masks (spills past 64 bytes at 168 registers with key-only masks, and 0.98x there) nor at D = 128
// (its third K buffer leaves one block an SM: 266 -> 194 at S2048 causal), run232. The same order in the dK/dV blocks
// (the last query block's dV and dK products issued after S^T and dP^T, a third Q / dO buffer) measured 0.96x at
// BERT-base and 0.98x at GPT-2 with every mask mode taking it (run235, spills 28-56 bytes at D = 64): not kept. One
// launch for the mma.sync kernels too was not tried on the GPU: ptxas spills the merged kernel 60-176 bytes at D =
// 64 and 256 (the two bodies' registers together), and it would lower the dQ blocks' occupancy at D = 96 and 192.
// Since run239 the blocks load their tiles by TMA where the inputs are dense and TMA can address them (BwdTma,
// make_bwd_tma; else by cp.async, as before): thread 0 issues each tile as 64-column boxes counted on the buffer's
// mbarrier, and the warpgroup waits there instead of cp.async.wait_group and a barrier. TMA is a template flag of the
// kernel: as a run-time branch it had grown the cp.async kernel by 11-19% of its SASS (and ptxas spilled it less), so
// that run239's A/B (1.02-1.05x) compared TMA with a slower cp.async kernel; the cp.async kernel is now bf81b6e's,
// SASS byte for byte, and ptxas gives the TMA kernel 2-20 registers fewer and no spill (the cp.async one spills 48
// bytes at D = 64 without a mask). run240 (H100, graph replay, backward TFLOP/s, TMA against that cp.async kernel in
// two alternating rounds): BERT-base 237-239 vs 228-229, key padding 222-223 vs 219-221, GPT-2 199 vs 194, S2048 D128
// causal 272-273 vs 263-268 (1.01-1.04x).
// FlashAttention-3's producer warp, ping-pong and dQ by atomics in the dK/dV blocks (two GEMMs of seven fewer) are
// what is left.
#if defined(PK_WGMMA)
// One product over the head dim, issued (not committed): acc = A B^T, N columns (as wgmma_two_ss)
template <typename T, int N, int D, int RA, int RB>
__device__ __forceinline__ void wgmma_one_ss(float (&acc)[N / 8][4], uint32_t a, uint32_t b) {
#pragma unroll
  for (int kt = 0; kt < D / 16; ++kt) {
    const uint32_t col = kt >> 2, kk = (kt & 3) * 32u;
    const uint64_t da = gmma_desc<16, 1024>(a, col * RA * 128 + kk), db = gmma_desc<16, 1024>(b, col * RB * 128 + kk);
    if (kt == 0) wgmma_ss_first<T, N>(acc, da, db);
    else wgmma_ss<T, N>(acc, da, db);
  }
}
// The backward's two products over the head dim, issued (not committed): acc1 = A1 B1^T and acc2 = A2 B2^T, N columns
// each (S and dP in the dQ blocks, their transposes in the dK/dV blocks). The A tiles have RA rows, the B tiles RB,
// each in the swizzled 128-byte rows of load_tile_sw128 (64-column chunks R * 128 bytes apart); D / 16 k-steps, the
// first of which overwrites the accumulators.
template <typename T, int N, int D, int RA, int RB>
__device__ __forceinline__ void wgmma_two_ss(float (&acc1)[N / 8][4], float (&acc2)[N / 8][4], uint32_t a1, uint32_t b1,
                                             uint32_t a2, uint32_t b2) {
#pragma unroll
  for (int kt = 0; kt < D / 16; ++kt) {
    const uint32_t col = kt >> 2, kk = (kt & 3) * 32u;
    const uint64_t da1 = gmma_desc<16, 1024>(a1, col * RA * 128 + kk);
    const uint64_t db1 = gmma_desc<16, 1024>(b1, col * RB * 128 + kk);
    const uint64_t da2 = gmma_desc<16, 1024>(a2, col * RA * 128 + kk);
    const uint64_t db2 = gmma_desc<16, 1024>(b2, col * RB * 128 + kk);
    if (kt == 0) {
      wgmma_ss_first<T, N>(acc1, da1, db1);
      wgmma_ss_first<T, N>(acc2, da2, db2);
    } else {
      wgmma_ss<T, N>(acc1, da1, db1);
      wgmma_ss<T, N>(acc2, da2, db2);
    }
  }
}
#endif  // PK_WGMMA

template <int D, int MODE>
struct DqSm90Pipe : std::bool_constant<D == 64 && MODE == kModeNone> {};

template <int D, bool PIPE>
struct DqSm90Cfg {
  static constexpr int NWG = 1;  // warpgroups a block
  static constexpr int BM = 64 * NWG, BN = 64, NT = 128 * NWG;
  static constexpr int MIN_BLOCKS = D == 64 ? 3 : 2;
  static constexpr int KBUF = PIPE ? 3 : 2;  // K buffers (V: 2)
  static constexpr uint32_t QBYTES = BM * D * 2, KVBYTES = BN * D * 2;
  // Q, dO, K and V buffers, then (TMA) the mbarriers of Q and dO, of each K and of each V buffer
  static constexpr size_t smem() { return 1024 + 2 * QBYTES + (KBUF + 2) * KVBYTES + 8 * (KBUF + 3); }
};

#if defined(PK_WGMMA)
template <typename T, int D, int MODE, bool PIPE, bool TMA>
__device__ __forceinline__ void bwd_dq_sm90_block(const Params& p, const BwdTma& tm, unsigned char* smem_raw, int bx,
                                                  int h, int b) {
  using C = DqSm90Cfg<D, PIPE>;
  constexpr int BM = C::BM, BN = C::BN, NT = C::NT;
  static_assert(!PIPE || C::NWG == 1, "PIPE: every visited key block is the warpgroup's");
  constexpr bool kKeys = MODE == kModeKeys;
  const uint32_t sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;
  // dO; K buffer st at sK + st KVBYTES, V buffer st at sV + st KVBYTES
  const uint32_t sO = sQ + C::QBYTES, sK = sO + C::QBYTES, sV = sK + C::KBUF * C::KVBYTES;
  // (TMA) the mbarriers: Q and dO, K buffer i, V buffer i
  const uint32_t bar_q = sV + 2 * C::KVBYTES, bar_k = bar_q + 8, bar_v = bar_k + 8 * C::KBUF;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int wg = warp >> 2;
  const int hk = h / p.group;
  const Seq s = seq_of(p, b);
  const int q0 = bx * BM;
  if (q0 >= s.sq) return;
  constexpr bool tma = TMA;
  const T* Q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh + (s.q_off + q0) * p.q_ss;
  const T* dO = static_cast<const T*>(p.dout) + b * p.do_sb + h * p.do_sh + (s.q_off + q0) * p.do_ss;
  const T* K = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh + s.k_off * p.k_ss;
  const T* V = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh + s.k_off * p.v_ss;
  if constexpr (tma) {  // thread 0 issues every load (dense rows: no sequence offsets)
    tma_block_start<BM, D>(bar_q, C::KBUF + 3, sQ, &tm.q64, tm.order[0], sO, &tm.do64, tm.order[1], q0, h, b);
  } else {
    load_tile_sw128<T, BM, D, NT>(sQ, Q, p.q_ss, min(BM, s.sq - q0), p.d, tid);
    load_tile_sw128<T, BM, D, NT>(sO, dO, p.do_ss, min(BM, s.sq - q0), p.d, tid);
  }
  cp_async_commit();
  const int qw = q0 + wg * 64;  // the warpgroup's first row
  const int row[2] = {qw + (warp & 3) * 16 + g, qw + (warp & 3) * 16 + g + 8};
  float lse2[2], dl[2];
  const int64_t lrow = b * p.lse_sb + h * p.lse_sh + s.q_off;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lse2[r] = row[r] < s.sq ? lse_log2(p.lse[lrow + row[r]]) : INFINITY;
    dl[r] = row[r] < s.sq ? p.delta[lrow + row[r]] : 0.f;
  }
  const int n_end = p.causal ? min(s.sk, q0 + BM) : s.sk;  // keys past n_end are masked for every row here
  int nb0 = 0, nb1 = (n_end + BN - 1) / BN;               // the key blocks visited
  if constexpr (kKeys) {
    const int2 r = key_range<NT>(p, b, n_end, s.sk);
    nb0 = r.x / BN;
    nb1 = r.x < r.y ? (r.y + BN - 1) / BN : nb0;
  }
  __shared__ float skb[2][kKeys ? BN : 1];  // the key addends (key_addends)
  float kb_next = kKeys ? key_addends_first<BN>(p, b, nb0, nb1, s.sk) : 0.f;
  if constexpr (kKeys) key_addends(p, skb, kb_next, nb0, nb1, b, s.sk);
  const auto load_kv = [&](int nb, int kst, int vst) {
    const int k0 = nb * BN, n = min(BN, s.sk - k0);
    if constexpr (tma) {
      if (tid == 0) {
        mbar_expect_tx(bar_k + 8 * kst, C::KVBYTES);
        tma_tile<BN, D>(sK + kst * C::KVBYTES, &tm.k, tm.order[4], k0, hk, b, bar_k + 8 * kst);
        mbar_expect_tx(bar_v + 8 * vst, C::KVBYTES);
        tma_tile<BN, D>(sV + vst * C::KVBYTES, &tm.v, tm.order[5], k0, hk, b, bar_v + 8 * vst);
      }
    } else {
      load_tile_sw128<T, BN, D, NT>(sK + kst * C::KVBYTES, K + k0 * p.k_ss, p.k_ss, n, p.d, tid);
      load_tile_sw128<T, BN, D, NT>(sV + vst * C::KVBYTES, V + k0 * p.v_ss, p.v_ss, n, p.d, tid);
    }
  };
  if (nb0 < nb1) load_kv(nb0, 0, 0);
  cp_async_commit();
  if constexpr (tma) mbar_wait(bar_q, 0);  // (also where no key block is visited: no load may land after the block's exit)

  float dq[D / 8][4];
  zero(dq);
  uint32_t pa[BN / 16][4];  // dS of the block (the A operand of dQ += dS K)
  const uint32_t q_base = sQ + wg * 64 * 128, o_base = sO + wg * 64 * 128;
  // dQ += dS K from pa with K at k_base (issued, not committed)
  const auto issue_dq = [&](uint32_t k_base) {
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt) wgmma_rs<T, D>(dq, pa[kt], gmma_desc<BN * 128, 1024>(k_base, kt * 16 * 128));
  };
  // the same, alone: issued, committed and waited for
  const auto run_dq = [&](uint32_t k_base) {
    wgmma_fence();
    issue_dq(k_base);
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(dq);
  };
  int kst = 0;  // this block's K buffer
  const auto k_prev = [&] { return sK + (kst == 0 ? C::KBUF - 1 : kst - 1) * C::KVBYTES; };  // the last block's
  // one key block; PREV (PIPE, past the first block): dQ_{j-1} is issued with S_j and dP_j (a compile-time flag: as a
  // run-time branch around that issue and its waits, ptxas injected warpgroup waits and serialized the chains, C7514,
  // and C7520 where nb0 comes from key_range)
  const auto step = [&](int nb, auto prev_c) {
    constexpr bool PREV = decltype(prev_c)::value;
    const int k0 = nb * BN, vst = (nb - nb0) & 1, kn = kst + 1 == C::KBUF ? 0 : kst + 1;
    // (their buffers were freed by an earlier iteration's final barrier: V_{j-1}'s by the last one, K_{j-2}'s, read
    // by dQ_{j-2} under PIPE, by the last one too)
    if (nb + 1 < nb1) load_kv(nb + 1, kn, vst ^ 1);
    cp_async_commit();
    if constexpr (kKeys) {
      if (nb + 1 < nb1) key_addends(p, skb, kb_next, nb + 1, nb1, b, s.sk);
    }
    if constexpr (tma) {  // this block's K and V (the i-th use of K buffer kst for i = (nb - nb0) / KBUF, of V's vst for / 2)
      mbar_wait(bar_k + 8 * kst, ((nb - nb0) / C::KBUF) & 1);
      mbar_wait(bar_v + 8 * vst, ((nb - nb0) >> 1) & 1);
      if constexpr (kKeys) __syncthreads();  // (the key addends)
    } else {
      cp_async_wait<1>();  // Q, dO and this block's K and V
      fence_async_smem();
      __syncthreads();
    }
    if (PIPE || (qw < s.sq && !(p.causal && k0 > qw + 63))) {  // the warpgroup has a row that sees a key here
      const uint32_t k_base = sK + kst * C::KVBYTES, v_base = sV + vst * C::KVBYTES;
      float sc[BN / 8][4], dp[BN / 8][4];
      fence_acc(dq);
      wgmma_fence();
      wgmma_two_ss<T, BN, D, BM, BN>(sc, dp, q_base, k_base, o_base, v_base);  // S = Q K^T, dP = dO V^T
      wgmma_commit();
      if constexpr (PREV) {  // dQ_{j-1} as a second group; wait for S_j and dP_j only
        issue_dq(k_prev());
        wgmma_commit();
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
      fence_acc(sc);
      fence_acc(dp);
      const bool edge = k0 + BN > s.sk || (p.causal && k0 + BN - 1 > qw);
      with_flag(edge, [&](auto e) {  // dS
        ds_rows<MODE, BN, true>(p, sc, dp, b, h, row, k0, s, decltype(e)::value, skb[nb & 1], lse2, dl, t4);
      });
      if constexpr (PREV) wgmma_wait<0>();  // dQ_{j-1}, which reads pa
      fence_acc(dq);
#pragma unroll
      for (int kt = 0; kt < BN / 16; ++kt) acc_to_a<T>(pa[kt], sc[2 * kt], sc[2 * kt + 1]);
      if constexpr (!PIPE) run_dq(k_base);  // dQ += dS K
    }
    __syncthreads();  // every warpgroup is done with buffers kst and vst (PIPE: but for K_j, read by dQ_j next)
    kst = kn;
  };
  if (PIPE && nb0 < nb1) {
    step(nb0, std::false_type{});
    for (int nb = nb0 + 1; nb < nb1; ++nb) step(nb, std::bool_constant<PIPE>{});
    run_dq(k_prev());  // the last block's dQ
  } else {
    for (int nb = nb0; nb < nb1; ++nb) step(nb, std::false_type{});
  }
  cp_async_wait<0>();
  store_rows<T, D>(p.dq, p.dq_sb, p.dq_sh, p.dq_ss, dq, p.scale, b, h, row, s.q_off, s.sq, 0, p.d, t4);
}
#endif  // PK_WGMMA

template <int D, int BQX = 32, int WGX = 1>
struct DkdvSm90Cfg {
  static constexpr int WG = WGX;                 // warpgroups a block (the fused backward at D = 128: two)
  static constexpr int BN = 64;                  // keys a warpgroup (a block: WG * BN)
  static constexpr int BQ = BQX;                 // queries an iteration (the pair: 32; the fused backward: 64)
  static constexpr int NT = 128 * WG;
  static constexpr int MIN_BLOCKS = WG == 2 ? 1 : D == 64 ? 3 : 2;
  // a warpgroup's K or V tile, a Q or dO tile, a warpgroup's part of the dS tile
  static constexpr uint32_t KBYTES = BN * D * 2, QBYTES = BQ * D * 2, DSBYTES = BQ * BN * 2;
  // (FUSED) the dQ tile: dq_acc's own rows (D floats), unpadded (dq_col's swizzle keeps its stores free of bank
  // conflicts), added to dq_acc as one run
  static constexpr uint32_t RBYTES = BQ * D * 4;
  // K, V (a tile a warpgroup), 2 buffers of Q and dO, (FUSED) the dS tile and the dQ tile, then (TMA) the mbarriers of
  // K and V and of each Q / dO buffer. FUSED: 73 KB at D = 64 (BQ = 64), three blocks an SM; 177 KB at D = 128 (two
  // warpgroups, BQ = 64), one
  // (defer: a second dS tile, and the mbarriers that free each Q / dO buffer and hand each dS tile over: 193 KB at
  // D = 128)
  static constexpr size_t smem(bool fused = false, bool defer = false) {
    return 1024 + 2 * WG * KBYTES + 4 * QBYTES + (fused ? WG * DSBYTES + RBYTES : 0) + 8 * 3 +
           (defer ? WG * DSBYTES + 8 * 6 : 0);
  }
};
// The dK/dV blocks' shape: the pair's (32-query iterations, one warpgroup of 64 keys), the fused backward's (64-query
// iterations; at D = 128 two warpgroups, 128 keys a block, sharing each query block's Q and dO tiles, each computing
// dQ^T's 64 head-dim rows of its half over the block's 128 keys)
template <int D, int FUSED>
using DkdvSm90For = DkdvSm90Cfg<D, FUSED ? 64 : 32, FUSED && D == 128 ? 2 : 1>;
// FUSED = 2 (D = 128; FUSED = 1 is D = 64's): dQ^T an iteration late, so that the two warpgroups need not meet at each
// iteration. Warpgroup w makes dQ^T of query block i - 1 (its head dims 64 w .., over the block's 128 keys) in
// iteration i, from the dS tile of block i - 1 (two dS tiles, each handed over by mbarriers: ready once both
// warpgroups stored their halves, free once both have read it), into a dQ half-tile of its own (64 rows x 64 head
// dims, 16 KB) added by a bulk reduction of its own into its slice of dq_acc, (B, Hq, 2, Sq, 64). The loop has no
// block barrier (a named barrier a warpgroup, a copy of the lse / delta a warpgroup, mbarriers that free each Q / dO
// buffer), so one warpgroup may run up to an iteration ahead of the other and its element work beside the other's
// products; the dQ reductions stay run288's (a 64 x 128 fp32 tile a block and iteration). run291 (H200, 4 x 16 x 2048
// causal, bf16): with dropout 747.7 / 749.1 us against 772.2 for dQ^T in its own iteration (run288's kernel, whose
// warpgroups met at two block barriers an iteration; removed after run292, where it took 774.9 against 754.7 in fp16);
// run292: without dropout 556.9 / 556.4 against the pair's 608.0 / 611.9.
// Since run294 S^T's and dP^T's products are two commit groups: P^T and the dropout's keep bits (pt_rows) form while
// dP^T's run, dV's products are issued, and dS^T forms while they run. run294 (H200, bf16, dropout 0.1, two rounds):
// 4 x 16 x 2048 causal 700.9 / 699.3 us against 750.8 / 746.5 waited together (fp16 698.3 against 749.6), 4 x 16 x
// 4096 4182.6 / 4185.2 against 4512.6 / 4515.3 (cuDNN 530-533 and 3273-3284: 0.71 -> 0.76x and 0.73 -> 0.78x);
// without dropout 566.0 / 568.2 against 561.8 / 560.8 and 3297.3 / 3284.9 against 3247.2 / 3239.0 (1-1.5% slower,
// kept: one kernel, and auto takes the Triton backward there).

// Where column c of query row q lives in a row of Params::dq_acc (and of the fused backward's unpadded dQ tile):
// bits 3-4 of c flipped by bits 1-2 of q, so that the 32 lanes of one store of a wgmma accumulator (rows q = 2 t4 +
// const, columns c = g + const) hit 32 banks of the tile (unswizzled, the 4 lanes of a g share one: 4-way conflicts).
// Runs of 8 columns from a multiple of 8 stay together (the convert kernel's 16-byte loads).
__device__ __forceinline__ int dq_col(int q, int c) { return c ^ (((q >> 1) & 3) << 3); }

// The fused backward's dQ tile: thread 0 adds it to dq_acc by one bulk reduction (the TMA unit reads the
// shared tile and adds it into global memory, FlashAttention-3's dQ path without a tensor map: the tile's rows are
// a contiguous run of dq_acc). bulk_wait_read (wgmma.cuh) before the tile is written again; bulk_wait_all before the
// kernel ends.
__device__ __forceinline__ void bulk_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(dst), "r"(src), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// The fused backward's dQ tile: fp32 into shared memory
__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}

// Four 8 x 8 16-bit matrices in mma's fragment layout (register j: matrix j), stored transposed: row m of matrix j at
// the address lane 8 j + m gives (the fused backward's dS tile)
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// Rows n.. of an R-row tile in sw128_offset's layout (D / 64 regions of R rows x 128 bytes) set to zero by the NT
// threads (the swizzle permutes 16-byte chunks within a row, so a row's 128 bytes are its own); a caller fences
// (fence_async_smem) and syncs before wgmma reads them
template <int R, int D, int NT>
__device__ __forceinline__ void zero_tail_rows(uint32_t tile, int n, int tid) {
  constexpr int CH = R * (D / 64) * 8;  // 16-byte chunks of the tile
  for (int i = tid; i < CH; i += NT) {
    const int region = i / (R * 8), r = (i / 8) % R;
    if (r >= n) {
      const uint32_t a = tile + region * R * 128 + r * 128 + (i % 8) * 16;
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0u) : "memory");
    }
  }
}

#if defined(PK_WGMMA)
template <typename T, int D, int MODE, bool TMA, int FUSED = 0>
__device__ __forceinline__ void bwd_dkdv_sm90_block(const Params& p, const BwdTma& tm, unsigned char* smem_raw, int bx,
                                                    int hk, int b) {
  using C = DkdvSm90For<D, FUSED>;
  constexpr int BN = C::BN, BQ = C::BQ, NT = C::NT, WG = C::WG;
  constexpr bool DEFER = FUSED == 2 || FUSED == 4;
  static_assert(!FUSED || ((D == 64 || D == 128) && WG == D / 64 && BQ == 64),
                "the fused dQ: a warpgroup a 64 x 64 wgmma tile");
  static_assert((FUSED != 1 && FUSED != 3) || D == 64, "FUSED = 1, 3: D = 64 (D = 128 defers dQ^T: FUSED = 2)");
  // FUSED = 3: FUSED = 1 over packed varlen sequences by TMA (the maps' batch of one, rows at each sequence's offset);
  // a tile that runs past its sequence (the last key block, a sequence's last query block) is zeroed there once it
  // lands (zero_tail_rows): TMA brings the next sequence's rows, or whatever lies past cu_seqlens[-1], and a P or dS of
  // 0 times a NaN there is NaN. FUSED = 4: FUSED = 2 (D = 128, deferred) over packed sequences likewise, a tail tile
  // zeroed by the block's 256 threads together and a block barrier after it (both warpgroups read every Q / dO row,
  // and dQ^T reads both warpgroups' K tiles; the tail iterations are the same for both)
  static_assert(FUSED != 4 || D == 128, "FUSED = 4: D = 128");
  constexpr bool PACKED = FUSED == 3 || FUSED == 4;
  static_assert(!PACKED || (TMA && MODE == kModeNone), "packed sequences: TMA, no mask");
  static_assert(!DEFER || WG == 2, "the deferred dQ^T: D = 128, two warpgroups");
  static_assert(!DEFER || TMA, "the deferred dQ^T's buffers are handed over on TMA's mbarriers");
  // K and V: a BN-row tile a warpgroup, back to back (warpgroup w's at + w KBYTES)
  const uint32_t sK = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sV = sK + WG * C::KBYTES, sQ = sV + WG * C::KBYTES, sO = sQ + 2 * C::QBYTES;  // (buffer u: + u QBYTES)
  // (FUSED) dS, BQ query rows of the block's WG * BN keys (warpgroup w's BN keys a 128-byte region at + w DSBYTES)
  const uint32_t sDS = sO + 2 * C::QBYTES;
  // (FUSED) the dQ tile, BQ query rows (C::RBYTES); DEFER: dS tile v at sDS + v WG DSBYTES, the dQ tile after both,
  // warpgroup w's half-tile (BQ rows of 64 floats) at sRed + w RBYTES / 2
  const uint32_t sRed = sDS + (FUSED ? (DEFER ? 2 : 1) * WG * C::DSBYTES : 0u);
  // (TMA) the mbarriers of K and V, and of Q / dO buffer u at bar_q + 8 u; (DEFER) Q / dO buffer u freed at
  // bar_e + 8 u, dS tile v ready at bar_dr + 8 v and freed at bar_df + 8 v (two arrivals each: a warpgroup's leader)
  const uint32_t bar_kv = sRed + (FUSED ? C::RBYTES : 0u), bar_q = bar_kv + 8;
  const uint32_t bar_e = bar_q + 16, bar_dr = bar_e + 16, bar_df = bar_dr + 16;
  // the query block's lse (log2 units) and delta (DEFER: a copy a warpgroup, sw)
  constexpr int NS = DEFER ? WG : 1;
  __shared__ float sL[NS][2][BQ], sD[NS][2][BQ];
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int wg = WG > 1 ? tid >> 7 : 0, warp = WG > 1 ? (tid >> 5) & 3 : tid >> 5;  // (one warpgroup: as before)
  const int k0 = bx * WG * BN, kw = k0 + wg * BN;  // the block's first key, this warpgroup's
  const uint32_t sKw = sK + wg * C::KBYTES, sVw = sV + wg * C::KBYTES;
  // (DEFER) this warpgroup's copy of the statistics, its thread of the stats loads, its leader, its named barrier
  const int sw = DEFER ? wg : 0, stid = DEFER ? (tid & 127) : tid;
  const bool leader = DEFER ? (tid & 127) == 0 : tid == 0;
  const auto wg_sync = [&] {
    if constexpr (DEFER) named_sync(1 + wg, 128);
    else __syncthreads();
  };
  const Seq s = seq_of(p, b);
  if (k0 >= s.sk) return;
  constexpr bool tma = TMA;
  const T* K = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh + (s.k_off + k0) * p.k_ss;
  const T* V = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh + (s.k_off + k0) * p.v_ss;
  // (PACKED) the maps' batch and the sequences' first rows
  const int tb = PACKED ? 0 : b;
  const int qr0 = PACKED ? static_cast<int>(s.q_off) : 0, kr0 = PACKED ? static_cast<int>(s.k_off) : 0;
  if constexpr (tma) {  // thread 0 issues every load (dense rows: no sequence offsets)
    if (DEFER && tid == 0)  // (counted by tma_block_start's fence and sync)
      for (int i = 0; i < 6; ++i) mbar_init(bar_e + 8 * i, WG);
    tma_block_start<BN, D, WG>(bar_kv, 3, sK, &tm.k, tm.order[4], sV, &tm.v, tm.order[5], kr0 + k0, hk, tb);
  } else {
    load_tile_sw128<T, BN, D, NT>(sK, K, p.k_ss, min(BN, s.sk - k0), p.d, tid);
    load_tile_sw128<T, BN, D, NT>(sV, V, p.v_ss, min(BN, s.sk - k0), p.d, tid);
  }
  const int key[2] = {kw + warp * 16 + g, kw + warp * 16 + g + 8};
  const float kb[2] = {key_bias<false>(p, b, key[0], s.sk), key_bias<false>(p, b, key[1], s.sk)};
  const int q_first = p.causal ? (k0 / BQ) * BQ : 0;  // queries i < k0 see no key of this block
  // a key-only mask that masks every key of this block: dK = dV = 0, no query visited (block-uniform test)
  const bool keys = p.mask_kind != kNoMask && p.mask_keys;
  const int heads = !keys || __syncthreads_or(kb[0] != -INFINITY || kb[1] != -INFINITY) ? p.group : 0;
  const int nqb = q_first < s.sq ? (s.sq - q_first + BQ - 1) / BQ : 0;  // query blocks a head
  const int total = heads * nqb;                                        // iterations: (head, query block)
  // the iterations walk (head, query block) query blocks fastest: (h, qs) steps to the next by ``advance`` (a division
  // by nqb an iteration cost more than it saves)
  const auto advance = [&](int& h, int& qs) {
    qs += BQ;
    if (qs >= s.sq) {
      qs = q_first;
      ++h;
    }
  };
  // (h, qs)'s Q, dO tiles into buffer u (cp.async), its lse (log2 units) and delta into registers of threads
  // tid < BQ (ld_lse, ld_delta), stored to sL / sD [u] by put_stats after the iteration's products, so that their
  // latency hides behind them (stored at once, warp 0 stalled on the loads an iteration while the others waited at
  // the barrier: run225's profile)
  float ld_lse = INFINITY, ld_delta = 0.f;
  const auto load_q = [&](int h, int qs, int u) {
    const int nq = min(BQ, s.sq - qs);
    if constexpr (tma) {
      if (tid == 0) {
        mbar_expect_tx(bar_q + 8 * u, 2 * C::QBYTES);
        // (the maps of BQ-row boxes: q32 / do32, or the dQ blocks' q64 / do64)
        tma_tile<BQ, D>(sQ + u * C::QBYTES, BQ == 64 ? &tm.q64 : &tm.q32, tm.order[BQ == 64 ? 0 : 2], qr0 + qs, h,
                        tb, bar_q + 8 * u);
        tma_tile<BQ, D>(sO + u * C::QBYTES, BQ == 64 ? &tm.do64 : &tm.do32, tm.order[BQ == 64 ? 1 : 3], qr0 + qs, h,
                        tb, bar_q + 8 * u);
      }
    } else {
      const T* Q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh + (s.q_off + qs) * p.q_ss;
      const T* dO = static_cast<const T*>(p.dout) + b * p.do_sb + h * p.do_sh + (s.q_off + qs) * p.do_ss;
      load_tile_sw128<T, BQ, D, NT>(sQ + u * C::QBYTES, Q, p.q_ss, nq, p.d, tid);
      load_tile_sw128<T, BQ, D, NT>(sO + u * C::QBYTES, dO, p.do_ss, nq, p.d, tid);
    }
    if (stid < BQ) {
      const int64_t lrow = b * p.lse_sb + h * p.lse_sh + s.q_off + qs;
      ld_lse = stid < nq ? p.lse[lrow + stid] : -INFINITY;
      ld_delta = stid < nq ? p.delta[lrow + stid] : 0.f;
    }
  };
  const auto put_stats = [&](int u) {
    if (stid < BQ) {
      sL[sw][u][stid] = lse_log2(ld_lse);  // (-inf: a row past the block, or one whose every key is masked)
      sD[sw][u][stid] = ld_delta;
    }
  };
  // (FUSED) dQ^T's products, issued (not committed): this warpgroup's 64 head dims (64 wg ..) over the block's WG * BN
  // keys, K^T from warpgroup kt / 4's K tile, its 64-column region wg (BN * 128 bytes apart; MN-major: 16 keys a
  // k-step), dS K-major from that warpgroup's region of the dS tile at ds
  const auto dqt_products = [&](float (&acc)[BQ / 8][4], uint32_t ds) {
    if constexpr (FUSED) {
#pragma unroll
      for (int kt = 0; kt < WG * BN / 16; ++kt) {
        const int kh = kt / (BN / 16), kk = kt % (BN / 16);
        wgmma_ss_ta64<T>(acc, gmma_desc<BN * 128, 1024>(sK + kh * C::KBYTES + wg * BN * 128, kk * 16 * 128),
                         gmma_desc<16, 1024>(ds + kh * C::DSBYTES, kk * 32), kt > 0 ? 1 : 0);
      }
    }
  };
  // (DEFER) dQ^T of query block j (head ph, first query pqs) from dS tile j & 1 (ready: both halves stored), this
  // warpgroup's head dims 64 wg .. over the block's 128 keys, issued and committed (not waited). j = -1 (the first
  // iteration) issues the products on tile 1 unwaited, their result unused: an unconditional chain keeps ptxas's
  // accumulator registers fixed (skipped by a branch, the kernel spilled 672-764 bytes)
  const auto dqt_issue = [&](float (&acc)[BQ / 8][4], int j) {
    if constexpr (DEFER) {
      if (j >= 0) mbar_wait(bar_dr + 8 * (j & 1), (j >> 1) & 1);
      wgmma_fence();
      dqt_products(acc, sDS + (j & 1) * WG * C::DSBYTES);
      wgmma_commit();
    }
  };
  // (FUSED) a retired dQ^T of query block j (head jh, first query jqs) into this warpgroup's tile (D = 128: a half),
  // unscaled, in dq_acc's layout (jqs is a multiple of 64, so a tile row's dq_col swizzle is its dq_acc row's; varlen,
  // whose rows start at the sequence's offset, swizzles by q + q_off), then its leader adds the valid rows to its slice
  // of dq_acc (after the tile's last reduction was read: the leader's bulk_wait_read and a barrier since); (DEFER) j's
  // dS tile is freed first where ``free_ds``. (Varlen and the other inputs TMA cannot take come by cp.async: tma false)
  constexpr bool dense_acc = tma && !PACKED;  // (dq_acc's rows: Sq a head, no sequence offset)
  const int qsw = dense_acc ? 0 : static_cast<int>(s.q_off & 7);
  const int64_t acc_b = dense_acc || p.cu_q == nullptr ? b : 0;
  const int64_t acc_rows = dense_acc ? p.sq : dq_acc_rows(p);
  const auto dqt_out = [&](float (&acc)[BQ / 8][4], int j, int jh, int jqs, bool free_ds) {
    if constexpr (FUSED) {
      const uint32_t red = sRed + wg * (C::RBYTES / 2);
      fence_acc(acc);
#pragma unroll
      for (int i = 0; i < BQ / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = warp * 16 + g + 8 * (e >> 1), q = 8 * i + 2 * t4 + (e & 1);
          st_shared_f32(red + (q * 64 + dq_col(q + qsw, c)) * 4, acc[i][e]);
        }
      fence_async_smem();
      wg_sync();  // (also: every warp's share of j's dQ^T products retired, so the dS tile may be freed)
      if (leader) {
        if (free_ds) mbar_arrive(bar_df + 8 * (j & 1));
        bulk_add_f32(p.dq_acc + (((acc_b * p.hq + jh) * WG + wg) * acc_rows + (dense_acc ? 0 : s.q_off) + jqs) * 64,
                     red, static_cast<uint32_t>(min(BQ, s.sq - jqs)) * 64 * 4);
      }
    }
  };
  int ph = 0, pqs = 0;  // (DEFER) the last iteration's head and first query
  int h = hk * p.group, qs = q_first;  // this iteration's head and first query
  int lh = h, lqs = qs;                 // the next load's
  if (total > 0) {
    load_q(lh, lqs, 0);
    put_stats(0);
    advance(lh, lqs);
  }
  cp_async_commit();  // {K, V, the first query block}
  if constexpr (tma) mbar_wait(bar_kv, 0);  // (also where no query block is visited: no load may land after the block's exit)
  if constexpr (PACKED) {  // the key block's rows past the sequence (each warpgroup's tile)
    if (k0 + WG * BN > s.sk) {
#pragma unroll
      for (int w = 0; w < WG; ++w) {
        zero_tail_rows<BN, D, NT>(sK + w * C::KBYTES, s.sk - k0 - w * BN, tid);
        zero_tail_rows<BN, D, NT>(sV + w * C::KBYTES, s.sk - k0 - w * BN, tid);
      }
      fence_async_smem();  // (one warpgroup: the loop's barrier after its first wait orders them before any MMA)
      if constexpr (WG > 1) __syncthreads();
    }
  }

  float dk[D / 8][4], dv[D / 8][4];
  zero(dk);
  zero(dv);
  for (int it = 0; it < total; ++it, advance(h, qs)) {
    const int u = it & 1;
    if (it + 1 < total) {  // (its buffer was freed by the last iteration's final barrier; DEFER: by both warpgroups)
      if (DEFER && tid == 0 && it >= 1) mbar_wait(bar_e + 8 * (u ^ 1), ((it - 1) >> 1) & 1);
      load_q(lh, lqs, u ^ 1);
      advance(lh, lqs);
    }
    cp_async_commit();
    if constexpr (tma) {
      mbar_wait(bar_q + 8 * u, (it >> 1) & 1);  // this query block (the (it / 2)-th use of buffer u)
      if (PACKED && qs + BQ > s.sq) {  // (its rows past the sequence; the barrier below orders them before the MMAs)
        zero_tail_rows<BQ, D, NT>(sQ + u * C::QBYTES, s.sq - qs, tid);
        zero_tail_rows<BQ, D, NT>(sO + u * C::QBYTES, s.sq - qs, tid);
        fence_async_smem();
        if constexpr (DEFER) __syncthreads();  // (both warpgroups' halves of the zeroing)
      }
    } else {
      cp_async_wait<1>();  // K, V and this query block
      fence_async_smem();
    }
    wg_sync();  // (and the block's lse and delta)
    const uint32_t q_base = sQ + u * C::QBYTES, o_base = sO + u * C::QBYTES;
    float st[BQ / 8][4], dpt[BQ / 8][4];
    uint32_t ps[BQ / 16][4], pz[BQ / 16][4];
    if constexpr (DEFER) {
      // S^T's and dP^T's products in two commit groups: P^T (and the dropout's keep bits) forms while dP^T's run,
      // then dV's products (P^T Z dO) are issued, and dS^T forms while they run (FlashAttention-3's overlap within a
      // warpgroup; the pair of groups waited together left the element work beside the other warpgroup's only)
      wgmma_fence();
      wgmma_one_ss<T, BQ, D, BN, BQ>(st, sKw, q_base);  // S^T = K Q^T
      wgmma_commit();
      wgmma_one_ss<T, BQ, D, BN, BQ>(dpt, sVw, o_base);  // dP^T = V dO^T
      wgmma_commit();
      wgmma_wait<1>();
      fence_acc(st);
      uint32_t keep[BQ / 16];
      const bool edge = p.causal && qs < kw + BN - 1;
      with_flag(edge, [&](auto e) {  // P^T
        pt_rows<BQ, MODE>(p, st, keep, b, h, key, qs, s, decltype(e)::value, kb, sL[sw][u], t4);
      });
      with_flag(p.p_drop > 0.f, [&](auto drop) {  // P^T Z, dV's A operand
#pragma unroll
        for (int kt = 0; kt < BQ / 16; ++kt) {
          float a[2][4];
#pragma unroll
          for (int v = 0; v < 2; ++v)
#pragma unroll
            for (int e = 0; e < 4; ++e)  // (a select, not st keep_scale: a multiply by 0 is other SASS than run294's)
              a[v][e] = decltype(drop)::value ? ((keep[kt] >> (4 * v + e)) & 1u ? st[2 * kt + v][e] * p.inv_keep : 0.f)
                                              : st[2 * kt + v][e];
          acc_to_a<T>(pz[kt], a[0], a[1]);
        }
      });
      fence_acc(dv);
      wgmma_fence();
#pragma unroll
      for (int kt = 0; kt < BQ / 16; ++kt) wgmma_rs<T, D>(dv, pz[kt], gmma_desc<BQ * 128, 1024>(o_base, kt * 16 * 128));
      wgmma_commit();
      wgmma_wait<1>();  // (dP^T's)
      fence_acc(dpt);
      with_flag(p.p_drop > 0.f, [&](auto drop) {  // dS^T = P^T (dP^T Z - delta)
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int il = nt * 8 + 2 * t4 + (e & 1);
            const float z = keep_scale<decltype(drop)::value>(p, keep[nt >> 1], 4 * (nt & 1) + e);
            st[nt][e] *= dpt[nt][e] * z - sD[sw][u][il];
          }
      });
#pragma unroll
      for (int kt = 0; kt < BQ / 16; ++kt) acc_to_a<T>(ps[kt], st[2 * kt], st[2 * kt + 1]);
    } else {
      wgmma_fence();
      wgmma_two_ss<T, BQ, D, BN, BQ>(st, dpt, sKw, q_base, sVw, o_base);  // S^T = K Q^T, dP^T = V dO^T
      wgmma_commit();
      wgmma_wait_all();
      fence_acc(st);
      fence_acc(dpt);
      const bool edge = p.causal && qs < kw + BN - 1;
      with_flag(edge, [&](auto e) {  // dS^T, P^T Z
        dst_rows<BQ, MODE, true>(p, st, dpt, b, h, key, qs, s, decltype(e)::value, kb, sL[sw][u], sD[sw][u], t4);
      });
#pragma unroll
      for (int kt = 0; kt < BQ / 16; ++kt) {
        acc_to_a<T>(ps[kt], st[2 * kt], st[2 * kt + 1]);
        acc_to_a<T>(pz[kt], dpt[2 * kt], dpt[2 * kt + 1]);
      }
    }
    if constexpr (FUSED) {
      // dV's products (P^T Z dO) run while dS goes to its tile (DEFER: issued above), then dQ^T = K^T dS^T's, then
      // dK's (dS^T Q), which run while dQ^T's tile is written and handed to the bulk reduction
      if constexpr (!DEFER) {
        fence_acc(dv);
        wgmma_fence();
#pragma unroll
        for (int kt = 0; kt < BQ / 16; ++kt)
          wgmma_rs<T, D>(dv, pz[kt], gmma_desc<BQ * 128, 1024>(o_base, kt * 16 * 128));
        wgmma_commit();
      }
      // dS (ps) into the dS tile: query rows, keys along a row. ps[kt] holds four 8 x 8 matrices (keys 0-7 / 8-15 of
      // the warp by queries 0-7 / 8-15 of the k-step, in that order); stmatrix .trans stores each transposed, lane
      // 8 j + m giving the address of matrix j's row m (a query; 8 keys, 16 bytes): two instructions a k-step pair
      // where an element store each (and its address) took 16
      const int j = lane >> 3, m = lane & 7;
      // DEFER: dS into tile u once both warpgroups have read it (dQ^T of block it - 2, in their last iteration), then
      // this warpgroup's half of it is ready; dQ^T of block it - 1 runs with dK's products. Else (D = 64) dQ^T of
      // this block, from the one dS tile
      if (DEFER && it >= 2) mbar_wait(bar_df + 8 * u, ((it - 2) >> 1) & 1);
      const uint32_t ds = sDS + ((DEFER ? u * WG : 0) + wg) * C::DSBYTES;
#pragma unroll
      for (int kt = 0; kt < BQ / 16; ++kt)
        stmatrix_x4_trans(ds + sw128_offset(BQ, 16 * kt + (j >> 1) * 8 + m, warp * 16 + (j & 1) * 8), ps[kt]);
      fence_async_smem();  // (the generic proxy's stores, read by wgmma's async proxy)
      wg_sync();
      if (DEFER && leader) mbar_arrive(bar_dr + 8 * u);
      float dqt[BQ / 8][4];
      fence_acc(dk);
      if constexpr (DEFER) {
        dqt_issue(dqt, it - 1);
        wgmma_fence();
      } else {
        wgmma_fence();
        dqt_products(dqt, sDS);
        wgmma_commit();
      }
#pragma unroll
      for (int kt = 0; kt < BQ / 16; ++kt)
        wgmma_rs<T, D>(dk, ps[kt], gmma_desc<BQ * 128, 1024>(q_base, kt * 16 * 128));
      wgmma_commit();
      wgmma_wait<1>();  // (dV's and dQ^T's)
      fence_acc(pz);
      if constexpr (DEFER) {
        if (it >= 1) dqt_out(dqt, it - 1, ph, pqs, true);
      } else {
        dqt_out(dqt, it, h, qs, false);
      }
    } else {  // dV += P^T Z dO and dK += dS^T Q, interleaved
      fence_acc(dk);
      fence_acc(dv);
      wgmma_fence();
#pragma unroll
      for (int kt = 0; kt < BQ / 16; ++kt) {
        wgmma_rs<T, D>(dv, pz[kt], gmma_desc<BQ * 128, 1024>(o_base, kt * 16 * 128));
        wgmma_rs<T, D>(dk, ps[kt], gmma_desc<BQ * 128, 1024>(q_base, kt * 16 * 128));
      }
      wgmma_commit();
      wgmma_wait_all();
      fence_acc(dk);
      fence_acc(dv);
    }
    if (it + 1 < total) put_stats(u ^ 1);
    if constexpr (FUSED) {
      wgmma_wait_all();  // (dK's products)
      fence_acc(dk);
      fence_acc(dv);
      fence_acc(ps);
      if (leader) bulk_wait_read();  // (the dQ tile is read: the next iteration may write it)
    }
    wg_sync();  // every warp is done with buffer u (and the next iteration's lse and delta are stored)
    if constexpr (DEFER) {
      if (leader) mbar_arrive(bar_e + 8 * u);  // (this warpgroup's part: buffer u free once both arrive)
      ph = h;
      pqs = qs;
    }
  }
  if constexpr (DEFER) {
    if (total > 0) {  // the last query block's dQ^T
      float dqt[BQ / 8][4];
      fence_acc(dk);
      fence_acc(dv);
      dqt_issue(dqt, total - 1);
      wgmma_wait_all();
      dqt_out(dqt, total - 1, ph, pqs, false);
    }
  }
  if constexpr (FUSED) {
    if (leader) bulk_wait_all();
  }
  cp_async_wait<0>();  // (no query block: the K / V loads)
  store_rows<T, D>(p.dk, p.dk_sb, p.dk_sh, p.dk_ss, dk, p.scale, b, hk, key, s.k_off, s.sk, 0, p.d, t4);
  store_rows<T, D>(p.dv, p.dv_sb, p.dv_sh, p.dv_ss, dv, 1.f, b, hk, key, s.k_off, s.sk, 0, p.d, t4);
}
#endif  // PK_WGMMA

// The backward's dK/dV and dQ blocks in one launch: blocks x < nkb of the grid (nkb + nqb, hq, batch) are dK/dV's
// (those whose y is past the kv heads leave at once), the rest dQ's; x runs fastest, so a head's dK/dV and dQ blocks
// run side by side.
// FUSED (D = 64 or 128, TMA loads, a grid of the dK/dV blocks only): each dK/dV block also adds its share of dQ, so the
// dropout mask and the softmax are computed once instead of twice (the pair computes both in its dK/dV and its dQ
// blocks). It walks the queries 64 at a time (the pair's dK/dV blocks: 32). A query block's dS (the 16-bit values dK
// uses) goes to a shared tile of 64 query rows x 64 keys a warpgroup (K-major, 128-byte swizzled), and a sixth wgmma
// makes dQ^T = K^T dS^T (64 head-dim rows x 64 queries: K read transposed from its tile, tnspA), which goes through a
// shared dQ tile (dq_acc's own rows) into Params::dq_acc (fp32, zeroed by the pre kernel; rows of dq_acc_cols(d)
// floats, columns swizzled by dq_col) by one bulk reduction of the block's rows, issued by thread 0
// (FlashAttention-3's dQ path). D = 64: one warpgroup of 64 keys, three blocks an SM at 168 registers. D = 128 (since
// run288): two warpgroups of 64 keys each (128 keys a block, one block an SM at 254-255 registers, 177 KB of shared
// memory) share each query block's Q and dO tiles; warpgroup w makes dQ^T's head dims 64 w .. over the block's 128
// keys (K's region w of both warpgroups' tiles, both halves of the dS tile); since run291 an iteration late
// (FUSED = 2, DkdvSm90For's note), with or without dropout since run292. On one warpgroup of 64 keys and 32-query
// iterations (two blocks an SM at 233-239 registers, dQ^T as two 64-row tiles) it had taken 806.6-823.2 us against the
// pair's 843.4-848.1 with dropout and 747.3-756.9 against 610.1-615.6 without (run287); on two, 773.5 against 842.7
// and 613.2 against 614.0 (run288; cuDNN with dropout 530.1, H200, 4 x 16 x 2048 causal).
// Then attn_dq_convert_kernel writes dQ = scale dq_acc. Measured (H200, bf16, dropout 0.1, kernel time a call, the
// backward at BERT-base / GPT-2): run277 503.9 / 295.9 us (pair) -> 471.5 / 290.8 (scalar atomics) -> 443.9 / 273.9
// (float4 atomics); run280-282 353.4 / 217.4 (32-query iterations, the instructions cut); run283-284 326-328 / 201-206
// (64-query iterations and the split commit; with float4 atomics instead of the bulk reduction 359-361 / 221-223, with
// 32-query iterations 365 / 224, the bulk read waited an iteration later 337-341 / 205-209; cuDNN 285-289 / 178-181).
// Without dropout the pair's 322 us beat the fused 367 at 32-query iterations (run276 / run277: across two calls), so
// the host took it with dropout only; at 64-query iterations the fused kernel without dropout is 1.09-1.11x the pair
// (run286: 239.2 / 141.9 us against 261.4 / 155.6), the default there since run287 (fused_dq_plan).
template <typename T, int D, int MODE, bool TMA, int FUSED = 0>
__global__ void __launch_bounds__(DkdvSm90For<D, FUSED>::NT, DkdvSm90For<D, FUSED>::MIN_BLOCKS)
    attn_bwd_sm90_kernel(const Params p, const __grid_constant__ BwdTma tm) {
  pdl_enter();  // (launch: pdl.cuh)
  drop_seed_init(p.p_drop > 0.f, p.seed);  // (the seed into shared memory, with dropout only)
#if defined(PK_WGMMA)
  constexpr bool PIPE = DqSm90Pipe<D, MODE>::value;
  static_assert(DkdvSm90Cfg<D>::NT == DqSm90Cfg<D, PIPE>::NT &&
                    DkdvSm90Cfg<D>::MIN_BLOCKS == DqSm90Cfg<D, PIPE>::MIN_BLOCKS,
                "one block shape");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int nkb = (p.sk + DkdvSm90Cfg<D>::BN - 1) / DkdvSm90Cfg<D>::BN;
  const int bx = blockIdx.x;
  if (FUSED || bx < nkb) {  // (FUSED: the grid has the dK/dV blocks only)
    if (static_cast<int>(blockIdx.y) < p.hq / p.group)
      bwd_dkdv_sm90_block<T, D, MODE, TMA, FUSED>(p, tm, smem_raw, bx, blockIdx.y, blockIdx.z);
  } else if constexpr (!FUSED) {
    bwd_dq_sm90_block<T, D, MODE, PIPE, TMA>(p, tm, smem_raw, bx - nkb, blockIdx.y, blockIdx.z);
  }
#else
  __trap();  // (not launched: the host takes this kernel only from an sm_90a build on a 9.0 device)
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------------------------
// The computed head dim: the next of 32, 64, 96, 128, 192, 256
template <typename F>
void dispatch_head_dim(int d, F&& f) {
  if (d <= 32) f(std::integral_constant<int, 32>{});
  else if (d <= 64) f(std::integral_constant<int, 64>{});
  else if (d <= 96) f(std::integral_constant<int, 96>{});
  else if (d <= 128) f(std::integral_constant<int, 128>{});
  else if (d <= 192) f(std::integral_constant<int, 192>{});
  else f(std::integral_constant<int, 256>{});
}

// Calls f with the mask mode as a constant
template <typename F>
void dispatch_mask_mode(const Params& p, F&& f) {
  switch (mask_mode(p)) {
    case kModeNone: f(std::integral_constant<int, kModeNone>{}); break;
    case kModeKeys: f(std::integral_constant<int, kModeKeys>{}); break;
    default: f(std::integral_constant<int, kModeAny>{}); break;
  }
}

// A kernel's dynamic shared memory above 48 KB must be allowed once a device: remembered per kernel and device
inline void allow_smem(const void* kernel, size_t smem) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> allowed;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  size_t& done = allowed[{kernel, dev}];
  if (done < smem) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    done = smem;
  }
}

// Which launches are programmatic (pdl.cuh): those whose role letter PYKERNELS_PDL_ATTN lists (read at each launch;
// default "f"): 'w' the warp-specialised forward, 'p' the backward's pre kernel, 'f' its sm_90a dQ / dK / dV kernel,
// 'c' the dQ conversion, 'k' the unmasked half of a key-padding mask's split (fwd_key_ranges); the others launch
// plainly. H200 run426 ('k', BERT-base with key padding, graph replay, two rounds): forward 78.7-78.8 us against
// 79.5-79.7 plainly, but the forward+backward 327.7-328.5 against 320.4-320.5 (the C++ op; auto 296.7-296.8 against
// 289.8-289.9). H200 run362 (graph replay, BERT-base / GPT-2 / key padding, no dropout, two rounds): 'f' 0.4-1.0 us
// faster than none on all six, 'w' even, 'p' and 'c' 1-3 us slower (their kernels' blocks, resident early, waiting
// beside the kernel ahead)
inline bool attn_pdl(char role) {
  if (role == 0) return false;
  const char* e = std::getenv("PYKERNELS_PDL_ATTN");
  return std::strchr(e != nullptr ? e : "f", role) != nullptr;
}

inline void launch(void (*kernel)(Params), dim3 grid, size_t smem, const Params& p, cudaStream_t stream,
                   int threads = kThreads, char role = 0) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  if (smem > 48 * 1024) allow_smem(reinterpret_cast<const void*>(kernel), smem);
  launch_maybe_pdl(attn_pdl(role), kernel, grid, dim3(threads), smem, stream, p);
}

// A kernel of a second parameter (attn_fwd_sm90_ws_kernel's TMA maps)
template <typename Extra>
inline void launch(void (*kernel)(Params, Extra), dim3 grid, size_t smem, const Params& p, const Extra& extra,
                   cudaStream_t stream, int threads, char role = 0) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  if (smem > 48 * 1024) allow_smem(reinterpret_cast<const void*>(kernel), smem);
  launch_maybe_pdl(attn_pdl(role), kernel, grid, dim3(threads), smem, stream, p, extra);
}

// The device's compute capability 9.0 and SM count, asked once a device
struct DeviceInfo {
  bool hopper;
  int sms;
};
inline DeviceInfo device_info() {
  static std::mutex mu;
  static std::map<int, DeviceInfo> known;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = known.find(dev);
  if (it != known.end()) return it->second;
  int major = 0, minor = 0, sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return known[dev] = DeviceInfo{major == 9 && minor == 0, sms};
}

// The environment variable PYKERNELS_CUDA_ATTN_SM90 (read each launch, for A/B runs and tests): "0" selects the
// mma.sync kernels, "1" the warpgroup-MMA kernels without the warp-specialised forward; unset (or anything else),
// the default
enum Sm90Choice : int { kSm90Off = 0, kSm90Plain = 1, kSm90Default = 2 };
// The first character of the environment variable ``name`` (read at each call: the A/B switches), 0 where unset
inline char env_first(const char* name) {
  const char* e = std::getenv(name);
  return e != nullptr ? e[0] : 0;
}
inline int sm90_choice() {
  const char env = env_first("PYKERNELS_CUDA_ATTN_SM90");
  return env == '0' ? kSm90Off : env == '1' ? kSm90Plain : kSm90Default;
}

// Which kernels a launch runs, read once a launch: ``sm90`` whether the forward and backward run their warpgroup-MMA
// kernels (attn_fwd_sm90_ws_kernel and the rest: a build with sm_90a code, PYKERNELS_SM90A from setup.py's default
// TORCH_CUDA_ARCH_LIST; a device of compute capability 9.0; a head dim up to 128; PYKERNELS_CUDA_ATTN_SM90 not "0"),
// ``choice`` the environment's Sm90Choice, ``sms`` the device's SM count (the persistent grid)
struct Plan {
  bool sm90;
  int choice;
  int sms;
};
inline Plan plan_of(const Params& p) {
#if defined(PYKERNELS_SM90A)
  const int choice = sm90_choice();
  if (p.d > 128 || choice == kSm90Off) return Plan{false, choice, 0};
  const DeviceInfo info = device_info();
  return Plan{info.hopper, choice, info.sms};
#else
  (void)p;
  return Plan{false, kSm90Off, 0};
#endif
}

// The driver's cuTensorMapEncodeTiled, found once through the runtime (no link against libcuda); nullptr where the
// driver has none
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A TMA map of the (batch, heads, rows, d) tensor at ``base`` (element strides sb, sh, ss; d contiguous) for tiles of
// 64 columns x ``box_rows`` rows, 128-byte swizzled (FwdTma); ``order`` as FwdTma's. False where TMA cannot address
// the tensor (a base not 16-byte aligned, a stride of a dimension longer than 1 that is 0 or not a multiple of 16
// bytes, or the driver refuses the map): the kernel then loads it by cp.async.
template <typename T>
bool encode_map(CUtensorMap* map, int* order, const void* base, int64_t batch, int64_t heads, int64_t rows, int d,
                int64_t sb, int64_t sh, int64_t ss, int box_rows) {
  static_assert(sizeof(T) == 2, "fp16 / bf16");
  const auto encode = tensor_map_encoder();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  struct Dim {
    int64_t size, stride;
    int role;  // 0 rows, 1 heads, 2 batch
  };
  Dim dims[3] = {{rows, ss, 0}, {heads, sh, 1}, {batch, sb, 2}};
  for (const Dim& x : dims)
    if (x.size > 1 && (x.stride <= 0 || x.stride % 8 != 0)) return false;
  // dimensions longer than 1 by increasing stride, then those of length 1 (any stride: the next multiple up)
  std::stable_sort(dims, dims + 3, [](const Dim& a, const Dim& b) {
    if ((a.size > 1) != (b.size > 1)) return a.size > 1;
    return a.size > 1 && a.stride < b.stride;
  });
  cuuint64_t size[4] = {static_cast<cuuint64_t>(d), 0, 0, 0}, stride[3];
  cuuint32_t box[4] = {64, 1, 1, 1}, unit[4] = {1, 1, 1, 1};
  int64_t span = static_cast<int64_t>(d) * 2;  // bytes from one index of the previous dimension to past its last
  *order = 0;
  for (int i = 0; i < 3; ++i) {
    const Dim& x = dims[i];
    const int64_t bytes = x.size > 1 ? x.stride * 2 : (span + 15) / 16 * 16;
    size[i + 1] = static_cast<cuuint64_t>(x.size);
    stride[i] = static_cast<cuuint64_t>(bytes);
    span = std::max(span, bytes * x.size);
    if (x.role == 0) box[i + 1] = static_cast<cuuint32_t>(box_rows);
    *order |= (i + 1) << (2 * x.role);
  }
  const auto dtype = std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode(map, dtype, 4, const_cast<void*>(base), size, stride, box, unit,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// PYKERNELS_CUDA_ATTN_TMA (read each launch, for A/B runs and tests): '0' keeps the cp.async loads; '1' requires TMA
// (require_tma: an error where the inputs rule it out); else (0 where unset) TMA where it can
inline char tma_env() { return env_first("PYKERNELS_CUDA_ATTN_TMA"); }
inline void require_tma(bool on, char env, const char* pass) {
  TORCH_CHECK(on || env != '1', "PYKERNELS_CUDA_ATTN_TMA=1: the ", pass,
              " cannot load these inputs by TMA (a base address not 16-byte aligned, a stride of 0 or not a multiple "
              "of 16 bytes, or, in the backward, packed varlen sequences)");
}

// The maps' batch and rows, forward and backward alike: dense (B, Sq, Sk); packed varlen sequences as rows of a batch
// of one (the packed T_q, T_k), which TMA's int32 coordinates must address (ok)
struct TmaRows {
  int64_t nb, rq, rk;
  bool ok;
};
inline TmaRows tma_rows(const Params& p) {
  const bool packed = p.cu_q != nullptr;
  const int64_t rq = packed ? p.tq : p.sq, rk = packed ? p.tk : p.sk;
  return {packed ? 1 : p.batch, rq, rk, rq > 0 && rk > 0 && rq < INT32_MAX && rk < INT32_MAX};
}

// Whether the warp-specialised forward's consumers take turns at their softmaxes (FwdTma::soft_turn; the note on
// attn_fwd_sm90_ws_kernel): with two consumers (``nw``) at D = 64 without a causal mask, but for dropout under a
// key-only mask (whose consumers draw every keep bit themselves); three consumers never (run343: 81.5-82.0 us at
// BERT-base against 71.0-71.3). PYKERNELS_CUDA_ATTN_FWD_SOFT_TURN: 1 on, 0 off (A/B runs and tests, read at each
// call); unset, that rule
inline bool fwd_soft_turn(const Params& p, int d, int mode, int nw = 2) {
  const char e = env_first("PYKERNELS_CUDA_ATTN_FWD_SOFT_TURN");
  if (e == '1' || e == '0') return e == '1';
  return nw == 2 && d == 64 && !p.causal && !(mode == kModeKeys && p.p_drop > 0.f);  // (three consumers: off)
}

// Whether the warp-specialised forward's consumers fence the async proxy (fence.proxy.async) before each key block's
// products (FwdTma::fence): where cp.async loads the tiles (a generic-proxy write that wgmma, the async proxy, then
// reads), not where TMA does (its writes are the async proxy's, complete at the mbarrier's phase: CUTLASS's TMA
// pipelines wait on the mbarrier alone). A packed sequence's last V block (cp.async) keeps its fence either way.
// PYKERNELS_CUDA_ATTN_FWD_FENCE=1: every block, as before run341 (A/B runs and tests, read at each call)
inline bool fwd_fence(const FwdTma& tm) { return tm.on == 0 || env_first("PYKERNELS_CUDA_ATTN_FWD_FENCE") == '1'; }

// Whether the three consumer warpgroups overlap each key block's softmax with their own previous P V
// (attn_fwd_sm90_ws_kernel's kOvl: S_j and P_{j-1} V_{j-1} two commit groups, the softmax after S_j's, O rescaled
// after both; FlashAttention-3's intra-warpgroup overlap): by default without dropout. H200, BERT-base without
// dropout: run348 69.4-69.6 us against 71.0-71.3; run349 (K and V polled together too) 69.6-69.9 against 70.7-71.2
// (cuDNN 67.3). With dropout (three forced) it was slower: 147.9-148.4 against 144.4-144.8 (run348).
// PYKERNELS_CUDA_ATTN_FWD_OVERLAP=1 / 0 forces it on / off (A/B runs and tests, read at each call)
inline bool fwd_overlap(const Params& p) {
  const char e = env_first("PYKERNELS_CUDA_ATTN_FWD_OVERLAP");
  return e == '1' || (e != '0' && p.p_drop == 0.f);
}

// Whether the three-consumer overlap kernel takes tiles that mix heads (attn_fwd_sm90_ws_kernel's kMix; fwd_order.cuh's
// mix_rows): three 64-row units a tile, consecutive over (batch, head, rows), so that a head's rows are never padded
// to a multiple of 192 (BERT-base's 512 rows: 8 warpgroup-tiles of work instead of 9, the third tile's third
// warpgroup computing rows past the sequence). Dense, not causal (a causal tile's warpgroups would visit different key
// blocks), the overlap kernel's (fwd_overlap), at least two units a head (a tile then meets two heads at most), the
// walk's units within int32; by default where a head's units are no multiple of 3 (else every tile is one head's,
// as without it) from 3 units (at 2, 65..128 rows, two consumers' 128-row tiles pad no more). H200 run415, D = 64,
// kernel time in graph replay (settings alternating, two rounds), against the 192-row tiles and two consumers:
// 32 x 12 x 512 tokens 73.1-73.2 us against 73.8-73.9 and 81.7-81.8 (cuDNN 72.1), 64 x 12 x 256 47.3 against 59.2-59.5
// and 51.3-51.4 (cuDNN 45.1), 48 x 12 x 300 62.7-62.8 against 64.1 (cuDNN 73.1), 16 x 12 x 1000 126.4-126.8 against
// 131.5-131.8 (cuDNN 140.0); at 2 units 128 x 12 x 100 36.2 against two's 38.3-38.4 but 128 x 12 x 128 38.3-39.3
// against 37.1-37.2. A tile of two heads took 3-5% longer than one of one in the timeline (run417).
// PYKERNELS_CUDA_ATTN_FWD_MIX=1 / 0 forces it on / off where it applies (A/B runs and tests, read at each call).
inline bool fwd_mix(const Params& p) {
  const int64_t n_u = (p.sq + 63) / 64, units = n_u * p.hq * p.batch;
  if (p.cu_q != nullptr || p.causal || n_u < 2 || units > INT32_MAX - 3 || !fwd_overlap(p)) return false;
  const char e = env_first("PYKERNELS_CUDA_ATTN_FWD_MIX");
  return e == '1' || (e != '0' && n_u >= 3 && n_u % 3 != 0);
}

// Whether the warp-specialised forward runs three consumer warpgroups (tiles of 192 query rows, FwdWsCfg<64, 3>)
// instead of two: at D <= 64 without a mask on dense inputs (not packed sequences: the order kernel's tiles are 128
// rows), where TMA takes the inputs (the host falls back to two otherwise), by default neither causal nor with dropout.
// With two, the products of one warpgroup run during the other's softmax, and a key block takes two softmaxes
// (1000-1100 cycles each beside the products, softmax_wgmma_probe.cu) while the tensor cores idle for about 40% of it;
// with three (FlashAttention-3's tile at D = 64) two warpgroups' products share each softmax. H200 run343, one build:
// BERT-base 78.5-78.8 -> 71.0-71.3 us (cuDNN 68.0); slower where it is off: GPT-2 (causal) 48.2 -> 60.2 (a tile of 192
// rows visits the key blocks of its last row: more of them masked), dropout 0.1 BERT-base 127 -> 144-145 (the consumers
// draw every keep bit: the producer, at 32 registers, draws none). Its caller is the D = 64 kernel's branch (d <= 64).
// Tried and not kept (run344): a warpgroup with no
// valid row in its tile (BERT-base's third tile a head: rows 512-575) taking its turns and freeing the slots without
// computing, 74.9-75.5 us against 78.6-78.9 for two: slower than computing rows that are never stored (the third
// warpgroup's products keep the other two's softmaxes apart). PYKERNELS_CUDA_ATTN_FWD_WG=3 / 2 (or 0) forces three /
// two (A/B runs and tests, read at each call). By default also two where three's 192-row tiles would pad the sequence
// to more than 1.25x the rows of two's 128-row tiles (sq <= 128 and 193..256: 1.5x; fwd_three_pad_ok): at BERT-base's
// 512 rows three's 576 against two's 512 (1.125x) still take 69.7-70.2 against 78.3 us, a row of three's tiles about
// 1.26x cheaper, but 128 x 12 x 128 tokens took 36.4-36.5 us on three (192 rows a tile for 128) against 33.2-33.3 on
// two, 64 x 12 x 256 55.5 against 47.7-47.8 (H200 run379, kernel time; cuDNN 28.3, 41.0; forward+backward between -1%
// and +3%, run380: the README's attention section). Tried and not kept (run378): BERT-base's last 128 rows a head by
// a second launch of the two-consumer kernel after three consumers over the first 384, 80.4-80.6 against 69.7-70.2 us.
inline bool fwd_three_pad_ok(int64_t sq) {
  const int64_t rows3 = (sq + 191) / 192 * 192, rows2 = (sq + 127) / 128 * 128;
  return 4 * rows3 <= 5 * rows2;
}
inline bool fwd_three_consumers(const Params& p) {
  if (p.cu_q != nullptr) return false;
  const char e = env_first("PYKERNELS_CUDA_ATTN_FWD_WG");
  return e == '3' ||
         (e != '2' && e != '0' && !p.causal && p.p_drop == 0.f && (fwd_three_pad_ok(p.sq) || fwd_mix(p)));
}

// Whether the forward splits a boolean key-padding mask (BERT's attention mask) by each batch's valid keys
// (Params::kv_range, attn_kv_range_kernel or the caller's): the key-mask kernel (two consumers, a key addend an
// element) takes only the batches whose valid keys are not one run [lo, hi) (key_run), and leaves at once where
// there is none; then an unmasked kernel takes the others as sequences of keys lo .. hi - 1 (ws_seq), so that a
// padded batch runs the unmasked kernel's tiles on its valid key blocks. No host sync: both launches read the ranges
// on the device. At D <= 64, not causal, a positive scale, on dense inputs that TMA takes (launch_forward_kernels
// falls back to the key-mask kernel alone otherwise). Without dropout the unmasked half is the three-consumer overlap
// kernel on 192-row tiles (not kMix: a tile of two batches would meet two key ranges; PYKERNELS_CUDA_ATTN_FWD_WG,
// _OVERLAP and _MIX leave the split alone), where fwd_three_pad_ok says its tiles pad little; with dropout the
// two-consumer kernel whose producer draws keep bits (the unmasked call's), over runs from key 0 only (key_run: the
// Philox counters count a row's keys from its first, 8 a call).
// PYKERNELS_CUDA_ATTN_FWD_RANGES=0: the key-mask kernel alone (A/B runs and tests, read at each call); '1' also where
// fwd_three_pad_ok says no. H200 run425 (graph replay, forward, three rounds, settings alternating): 32 x 12 x 512
// tokens with key padding (lengths uniform in 256..512, the attention benchmark's) 78.0-79.0 us against 85.4-87.1
// unsplit (FlexAttention 97.7, cuDNN 119.2); 16 x 12 x 1000 (lengths in 500..1000) 121.6-123.3 against 145.1-146.3.
// Run426's kernel records at the first: the unmasked half 71.2-71.9 us, the key-mask half leaving at once 1.6,
// attn_kv_range_kernel 2.4 (the C++ op; auto passes the ranges of the Triton kernel its backward takes, 1.6).
inline bool fwd_key_ranges(const Params& p) {
  const char e = env_first("PYKERNELS_CUDA_ATTN_FWD_RANGES");
  if (e == '0') return false;
  if (p.mask_kind != kBoolMask || !p.mask_keys || p.cu_q != nullptr || p.causal || p.d > 64 ||
      !(p.scale_log2 > 0.f) || p.sq <= 0 || p.sk <= 0 || (p.p_drop == 0.f && e != '1' && !fwd_three_pad_ok(p.sq)))
    return false;
  const Plan plan = plan_of(p);
  return plan.sm90 && plan.choice == kSm90Default;
}

// PYKERNELS_CUDA_ATTN_FWD_STORE=registers: the warp-specialised forward at D = 64 stores O from registers (as before
// run330; A/B runs and tests, read at each call); default: through shared memory by TMA where FwdTma::o_on
inline bool fwd_store_by_tma() { return env_first("PYKERNELS_CUDA_ATTN_FWD_STORE") != 'r'; }

// The forward's TMA maps where TMA takes all three inputs (tma_env): dense, or packed varlen sequences as the rows of
// a batch of one (Params::tq, tk rows; the kernel loads at each sequence's offset); ``o_map``: the output's too
// (FwdTma::o), where the inputs' are on, the sequences dense, and fwd_store_by_tma
template <typename T>
FwdTma make_fwd_tma(const Params& p, int bm, int bn, bool o_map = false) {
  FwdTma tm;
  std::memset(&tm, 0, sizeof(tm));
  const char env = tma_env();
  if (env == '0') return tm;
  const int hk = p.hq / p.group;
  const TmaRows r = tma_rows(p);
  const int64_t nb = r.nb, rq = r.rq, rk = r.rk;
  tm.on = r.ok &&
          encode_map<T>(&tm.q, &tm.order[0], p.q, nb, p.hq, rq, p.d, p.q_sb, p.q_sh, p.q_ss, bm) &&
          encode_map<T>(&tm.k, &tm.order[1], p.k, nb, hk, rk, p.d, p.k_sb, p.k_sh, p.k_ss, bn) &&
          encode_map<T>(&tm.v, &tm.order[2], p.v, nb, hk, rk, p.d, p.v_sb, p.v_sh, p.v_ss, bn);
  require_tma(tm.on, env, "forward");
  tm.o_on = o_map && tm.on && p.cu_q == nullptr && fwd_store_by_tma() &&
            encode_map<T>(&tm.o, &tm.order[3], p.out, p.batch, p.hq, p.sq, p.d, p.o_sb, p.o_sh, p.o_ss, 64);
  return tm;
}

// The backward's TMA maps (BwdTma; the dQ blocks' query rows bm, the dK/dV blocks' bq, both's key rows bn), on the
// forward's rule (make_fwd_tma)
template <typename T>
BwdTma make_bwd_tma(const Params& p, int bm, int bq, int bn, bool packed_ok) {
  BwdTma tm;
  std::memset(&tm, 0, sizeof(tm));
  const char env = tma_env();
  if (env == '0') return tm;
  const int hk = p.hq / p.group;
  int* o = tm.order;
  // packed varlen sequences (only where the caller runs the fused kernel over them, packed_ok): a batch of one
  const TmaRows r = tma_rows(p);
  const int64_t nb = r.nb, rq = r.rq, rk = r.rk;
  tm.on = (p.cu_q == nullptr || packed_ok) && r.ok &&
          encode_map<T>(&tm.q64, &o[0], p.q, nb, p.hq, rq, p.d, p.q_sb, p.q_sh, p.q_ss, bm) &&
          encode_map<T>(&tm.do64, &o[1], p.dout, nb, p.hq, rq, p.d, p.do_sb, p.do_sh, p.do_ss, bm) &&
          encode_map<T>(&tm.q32, &o[2], p.q, nb, p.hq, rq, p.d, p.q_sb, p.q_sh, p.q_ss, bq) &&
          encode_map<T>(&tm.do32, &o[3], p.dout, nb, p.hq, rq, p.d, p.do_sb, p.do_sh, p.do_ss, bq) &&
          encode_map<T>(&tm.k, &o[4], p.k, nb, hk, rk, p.d, p.k_sb, p.k_sh, p.k_ss, bn) &&
          encode_map<T>(&tm.v, &o[5], p.v, nb, hk, rk, p.d, p.v_sb, p.v_sh, p.v_ss, bn);
  require_tma(tm.on, env, "backward");
  return tm;
}

// The warp-specialised forward's persistent grid: a block an SM, or one a tile where there are fewer tiles; causal,
// a multiple of the tiles a head (n_m) where n_m <= sms, so that tile_at can alternate each head's order by round
inline unsigned fwd_ws_grid(const Params& p, int bm, int sms) {
  const int64_t n_m = (p.sq + bm - 1) / bm;
  const int64_t tiles = n_m * p.hq * p.batch;
  const int64_t blocks = p.causal && n_m <= sms ? sms / n_m * n_m : sms;
  return static_cast<unsigned>(std::min<int64_t>(tiles, blocks));
}

inline unsigned blocks_of(int64_t rows) { return static_cast<unsigned>((rows + kRows - 1) / kRows); }


// PYKERNELS_CUDA_ATTN_FILL=launch: packed sequences' rows outside the sequences filled by a launch of their own after
// the kernels, forward and backward (A/B runs of the fills folded into the order and pre kernels; read at each call)
inline bool fill_by_launch() { return env_first("PYKERNELS_CUDA_ATTN_FILL") == 'l'; }

// PYKERNELS_CUDA_ATTN_FWD_DRAWS=consumers: the warp-specialised forward's consumers draw all the dropout's keep bits
// themselves (as before run317; A/B runs, read at each call); default: its producer warpgroup draws those of each key
// block's first FwdWsCfg::DRAWN n-tiles (ws_draw_bits), the consumers the rest
inline bool fwd_draws_by_consumers() { return env_first("PYKERNELS_CUDA_ATTN_FWD_DRAWS") == 'c'; }

// PYKERNELS_CUDA_ATTN_FWD_LAZY=0: the forward's online softmax moves a row's max at every block where it grew (as
// before run321; A/B runs, read at each call); default: only where it grew by more than kLazyMax
inline float lazy_max_env() { return env_first("PYKERNELS_CUDA_ATTN_FWD_LAZY") == '0' ? 0.f : kLazyMax; }

// The forward's kernels; ``filled``: the order kernel filled ``outside`` (its spare blocks)
template <typename T>
void launch_forward_kernels(const Params& p, cudaStream_t stream, const ZeroRows* outside, bool& filled) {
  const Plan plan = plan_of(p);
  if (plan.sm90) {
    dispatch_mask_mode(p, [&](auto mode) {
      constexpr int M = decltype(mode)::value;
      // the warp-specialised kernel, persistent (unmasked: raw scores, so a positive scale; softmax_block)
      if (plan.choice == kSm90Default && (M != kModeNone || p.scale_log2 > 0.f)) {
        const auto ws = [&](auto dc) {
          constexpr int D = decltype(dc)::value;
          if constexpr (D == 64 && M == kModeKeys) {  // a key-padding mask split by its ranges (fwd_key_ranges)
            if (p.kv_range != nullptr) {
              using C2 = FwdWsCfg<64>;
              using C3 = FwdWsCfg<64, 3>;
              const bool drop = p.p_drop > 0.f;  // (two consumers then, the producer drawing keep bits, as unmasked)
              Params a = p;  // (the unmasked kernel's)
              a.mask = nullptr;
              a.mask_kind = kNoMask;
              a.mask_keys = false;
              a.fwd_order = nullptr;
              a.fwd_drop_bits = drop && !fwd_draws_by_consumers();
              FwdTma ta = make_fwd_tma<T>(a, drop ? C2::BM : C3::BM, C3::BN, true);
              if (ta.on) {
                ta.soft_turn = fwd_soft_turn(a, 64, kModeNone, drop ? 2 : 3);
                ta.fence = fwd_fence(ta);
                Params k = p;
                k.fwd_order = nullptr;
                k.fwd_drop_bits = 0;
                FwdTma tk = make_fwd_tma<T>(k, C2::BM, C2::BN, true);
                tk.soft_turn = fwd_soft_turn(p, 64, M);
                tk.fence = fwd_fence(tk);
                launch(attn_fwd_sm90_ws_kernel<T, 64, M, 2, false, false, true>, dim3(fwd_ws_grid(p, C2::BM, plan.sms)),
                       C2::smem(), k, tk, stream, C2::NT, 'w');
                if (drop)
                  launch(attn_fwd_sm90_ws_kernel<T, 64, kModeNone, 2, false, false, true>,
                         dim3(fwd_ws_grid(p, C2::BM, plan.sms)), C2::smem(), a, ta, stream, C2::NT, 'k');
                else
                  launch(attn_fwd_sm90_ws_kernel<T, 64, kModeNone, 3, true, false, true>,
                         dim3(fwd_ws_grid(p, C3::BM, plan.sms)), C3::smem(), a, ta, stream, C3::NT, 'k');
                return;
              }
            }
          }
          if constexpr (D == 64 && M == kModeNone) {  // three consumer warpgroups (fwd_three_consumers)
            using C3 = FwdWsCfg<64, 3>;
            if (fwd_three_consumers(p)) {
              Params q = p;
              q.fwd_order = nullptr;
              q.fwd_drop_bits = 0;  // (its consumers draw every keep bit: C3::BITS)
              const bool mix = fwd_mix(q);  // (Q's map then in boxes of a warpgroup's 64 rows)
              FwdTma tm = make_fwd_tma<T>(q, mix ? 64 : C3::BM, C3::BN, true);
              if (tm.on) {
                tm.soft_turn = fwd_soft_turn(p, 64, M, 3);
                tm.fence = fwd_fence(tm);
                if (mix) {  // a block an SM, or one a tile of three units
                  using CM = FwdWsCfg<64, 3, true>;
                  const int64_t tiles = ((p.sq + 63) / 64 * p.hq * p.batch + 2) / 3;
                  const dim3 gridm(static_cast<unsigned>(std::min<int64_t>(tiles, plan.sms)));
                  launch(attn_fwd_sm90_ws_kernel<T, 64, M, 3, true, true>, gridm, CM::smem(), q, tm, stream, CM::NT,
                         'w');
                  return;
                }
                const dim3 grid3(fwd_ws_grid(p, C3::BM, plan.sms));
                if (fwd_overlap(q))
                  launch(attn_fwd_sm90_ws_kernel<T, 64, M, 3, true>, grid3, C3::smem(), q, tm, stream, C3::NT, 'w');
                else
                  launch(attn_fwd_sm90_ws_kernel<T, 64, M, 3>, grid3, C3::smem(), q, tm, stream, C3::NT, 'w');
                return;
              }
            }
          }
          using C = FwdWsCfg<D>;
          const dim3 grid(fwd_ws_grid(p, C::BM, plan.sms));
          static_assert(C::BM == kOrderBM, "fwd_order_tiles's query tiles");
          Params q = p;  // (packed sequences: the walk's order, attn_fwd_order_kernel, where the caller gave room)
          if (p.fwd_order != nullptr && p.cu_q != nullptr && p.batch <= kOrderSeqs && grid.x > 0 &&
              env_first("PYKERNELS_CUDA_ATTN_FWD_ORDER") != '0') {  // ('0': tile_at's walk, A/B runs)
            filled = outside != nullptr && outside->n > 0 && !fill_by_launch();
            attn_fwd_order_kernel<C::BM, C::BN><<<filled ? 1 + kOrderFillBlocks : 1, 1024, 0, stream>>>(
                p, p.fwd_order, static_cast<int>((p.sq + C::BM - 1) / C::BM), static_cast<int>(grid.x),
                filled ? *outside : ZeroRows{});
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          } else {
            q.fwd_order = nullptr;
          }
          q.fwd_drop_bits = p.p_drop > 0.f && !fwd_draws_by_consumers();
          FwdTma tm = make_fwd_tma<T>(q, C::BM, C::BN, D == 64);
          tm.soft_turn = fwd_soft_turn(p, D, M);
          tm.fence = fwd_fence(tm);
          launch(attn_fwd_sm90_ws_kernel<T, D, M>, grid, C::smem(), q, tm, stream, C::NT, 'w');
        };
        if (p.d <= 64)
          ws(std::integral_constant<int, 64>{});
        else
          ws(std::integral_constant<int, 128>{});
      } else if (p.d <= 64) {
        using C = FwdSm90Cfg<64>;
        const dim3 grid(static_cast<unsigned>((p.sq + C::BM - 1) / C::BM), static_cast<unsigned>(p.hq),
                        static_cast<unsigned>(p.batch));
        launch(attn_fwd_sm90_kernel<T, 64, M>, grid, C::smem(), p, stream, C::NT);
      } else {
        using C = FwdSm90PipeCfg<128>;
        const dim3 grid(static_cast<unsigned>((p.sq + C::BM - 1) / C::BM), static_cast<unsigned>(p.hq),
                        static_cast<unsigned>(p.batch));
        launch(attn_fwd_sm90_pipe_kernel<T, 128, M>, grid, C::smem(), p, stream, C::NT);
      }
    });
    return;
  }
  const dim3 grid(blocks_of(p.sq), static_cast<unsigned>(p.hq), static_cast<unsigned>(p.batch));
  dispatch_head_dim(p.d, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    dispatch_mask_mode(p, [&](auto mode) {
      launch(attn_fwd_kernel<T, D, decltype(mode)::value>, grid, FwdCfg<D>::smem(sizeof(T)), p, stream);
    });
  });
}

template <typename T>
void launch_forward(const Params& p, cudaStream_t stream, const ZeroRows* outside) {
  bool filled = false;
  Params q = p;
  q.lazy_max = lazy_max_env();
  launch_forward_kernels<T>(q, stream, outside, filled);
  if (outside != nullptr && !filled) zero_rows_outside(*outside, stream);  // (disjoint rows: any order)
}

// The fused backward's last step: dQ = scale * dq_acc in dQ's dtype and strides (8 columns a thread, 16-byte stores:
// dQ is allocated with 16-byte aligned rows); COLS = dq_acc_cols: dq_acc is (B, Hq, COLS / 64, Sq, 64), a slice of 64
// head dims a warpgroup of the fused kernel (attention.h); varlen (1, Hq, 1, T, 64), the rows outside the sequences
// skipped (the pre kernel zeroed them in dQ: grads_outside)
template <typename T, int COLS>
__global__ void __launch_bounds__(256) attn_dq_convert_kernel(const Params p) {
  pdl_enter();  // (launch: pdl.cuh)
  constexpr int TPR = COLS / 8;  // threads a row
  const int64_t t = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x, row = t / TPR;
  const int c = static_cast<int>(t % TPR) * 8;
  const bool varlen = p.cu_q != nullptr;
  const int64_t rows = dq_acc_rows(p);  // (Sq, or T)
  if (row >= dq_acc_batch(p) * p.hq * rows || c >= p.d) return;
  const int64_t i = row % rows;
  const int h = static_cast<int>((row / rows) % p.hq);
  const int b = static_cast<int>(row / (rows * p.hq));
  if (varlen && (i >= p.cu_q[p.batch] || i < p.cu_q[0])) return;  // (the pre kernel filled those rows)
  // (i: the row in its head)
  const float* base =
      p.dq_acc + (((row - i) * (COLS / 64) + (c >> 6) * rows) + i) * 64 + dq_col(static_cast<int>(i & 7), c & 63);
  const float4* src = reinterpret_cast<const float4*>(base);
  const float4 x = src[0], y = src[1];
  uint4 v;
  v.x = pack2<T>(x.x * p.scale, x.y * p.scale);
  v.y = pack2<T>(x.z * p.scale, x.w * p.scale);
  v.z = pack2<T>(y.x * p.scale, y.y * p.scale);
  v.w = pack2<T>(y.z * p.scale, y.w * p.scale);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + b * p.dq_sb + h * p.dq_sh + i * p.dq_ss + c) = v;  // (varlen: sb 0)
}

// PYKERNELS_CUDA_ATTN_FUSED_DQ (read each call): '0' the pair always; else the fused backward wherever it applies
// (Hopper, sm_90a build, dense inputs, D <= 128), with or without dropout: at D <= 64 1.07-1.11x the pair without
// dropout (run286-288); at D = 128 (dQ^T an iteration late) 1.13x the pair with dropout and 1.09-1.22x without
// (run292: 4 x 16 x 2048 causal 556.9 / 556.4 us against 608.0 / 611.9, 4 x 16 x 4096 3225.2 / 3220.7 against
// 3931.8 / 3960.0, 1 x 16 x 8192 causal 1790.9 / 1777.0 against 2096.0 / 2118.8). ('a', which took it at D = 128
// without dropout before run292, is the default's synonym.) Inputs TMA cannot load (packed varlen sequences, stride-0
// K / V) take the fused kernel's cp.async twin at D = 64 with dropout only: at the packed BERT batch with dropout
// 1.11x the pair (run299: 305.6 / 303.7 us against 339.7 / 337.5), without it slower (spills: 164 bytes at its 168
// registers, against the TMA kernel's 20); '1' takes it without dropout too (A/B runs). Packed sequences at D = 64
// now run the fused kernel by TMA (FUSED = 3, bwd_dkdv_sm90_block's note; 84 bytes of spill), with or without
// dropout, and at D = 128 the deferred one (FUSED = 4); 'c' keeps them on the cp.async twin at D = 64 and the pair at
// D = 128 (A/B runs). Run303 (H200, the packed BERT batch): backward 282.7 us against the twin's 304.8 with dropout,
// 226.1 against the pair's 235.9 without; D = 128 (8 x 16 x 1024) 475.4 / 407.3 against the pair's 559.9 / 439.2.
inline char fused_dq_env() { return env_first("PYKERNELS_CUDA_ATTN_FUSED_DQ"); }
inline bool fused_cp_async(const Params& p) {
  return p.p_drop > 0.f || fused_dq_env() == '1' || fused_dq_env() == 'c';
}

// fused_dq_planned's rule (attention.h)
inline bool fused_dq_plan(const Params& p) {
  // ('c' keeps packed sequences off TMA: the cp.async twin at D <= 64, the pair above, so no dq_acc to zero there)
  const int dmax = p.cu_q != nullptr && fused_dq_env() == 'c' ? 64 : 128;
  return fused_dq_env() != '0' && p.d <= dmax && tma_env() != '0' && plan_of(p).sm90;
}

template <int D, typename T, int M>
void launch_backward_sm90(const Params& p, cudaStream_t stream) {
  constexpr bool PIPE = DqSm90Pipe<D, M>::value;
  using Cq = DqSm90Cfg<D, PIPE>;
  using Ck = DkdvSm90Cfg<D>;
  static_assert(Ck::BN == Cq::BN, "one key block for K and V's maps");
  const unsigned nkb = static_cast<unsigned>((p.sk + Ck::BN - 1) / Ck::BN);
  const unsigned nqb = static_cast<unsigned>((p.sq + Cq::BM - 1) / Cq::BM);
  // packed varlen sequences by TMA in the fused kernel (FUSED = 3 at D = 64, 4 at D = 128; 'c': the twin, the pair)
  const bool packed = p.cu_q != nullptr;
  const bool packed_tma = packed && M == kModeNone && p.dq_acc != nullptr && fused_dq_env() != 'c';
  const BwdTma tm = make_bwd_tma<T>(p, Cq::BM, Ck::BQ, Ck::BN, packed_tma);
  if (p.dq_acc != nullptr) {
    // the fused backward: the dK/dV blocks add dQ into dq_acc (zeroed by the pre kernel), then dQ from it. At D = 64
    // inputs TMA cannot load (strides fused_dq_plan cannot see; packed sequences under 'c') come by cp.async; at D = 128
    // they take the pair below (the deferred kernel's buffers are handed over by TMA's mbarriers)
    if (tm.on || (D == 64 && M == kModeNone && fused_cp_async(p))) {
      constexpr int FUSED = D == 128 ? 2 : 1;  // (D = 128: dQ^T an iteration late)
      using Cf = DkdvSm90For<D, FUSED>;
      const unsigned fkb = static_cast<unsigned>((p.sk + Cf::WG * Cf::BN - 1) / (Cf::WG * Cf::BN));
      const dim3 fgrid(fkb, static_cast<unsigned>(p.hq), static_cast<unsigned>(p.batch));
      if (tm.on && packed) {
        if constexpr (M == kModeNone)  // (packed_tma; D = 128: FUSED = 4, deferred)
          launch(attn_bwd_sm90_kernel<T, D, M, true, D == 128 ? 4 : 3>, fgrid, Cf::smem(true, D == 128), p, tm,
                 stream, Cf::NT, 'f');
      } else if (tm.on) {
        launch(attn_bwd_sm90_kernel<T, D, M, true, FUSED>, fgrid, Cf::smem(true, FUSED == 2), p, tm, stream, Cf::NT,
               'f');
      } else if constexpr (D == 64 && M == kModeNone) {  // (varlen takes no mask)
        launch(attn_bwd_sm90_kernel<T, D, M, false, FUSED>, fgrid, Cf::smem(true, false), p, tm, stream, Cf::NT, 'f');
      }
      const int64_t threads = dq_acc_batch(p) * p.hq * dq_acc_rows(p) * (D / 8);
      launch(attn_dq_convert_kernel<T, D>, dim3(static_cast<unsigned>((threads + 255) / 256)), 0, p,
             stream, 256, 'c');
      return;
    }
  }
  const dim3 grid(nkb + nqb, static_cast<unsigned>(p.hq), static_cast<unsigned>(p.batch));
  // (TMA a template flag: the cp.async kernel is the one of before, with no test of it)
  launch(tm.on ? attn_bwd_sm90_kernel<T, D, M, true> : attn_bwd_sm90_kernel<T, D, M, false>, grid,
         std::max(Ck::smem(), Cq::smem()), p, tm, stream, Ck::NT, 'f');
}

template <typename T>
void launch_backward_kernels(const Params& p, cudaStream_t stream) {
  const dim3 qgrid(blocks_of(p.sq), static_cast<unsigned>(p.hq), static_cast<unsigned>(p.batch));
  if (p.d <= 64)
    launch(attn_bwd_pre_kernel<T, 8>, qgrid, 0, p, stream, kThreads, 'p');
  else if (p.d <= 128)
    launch(attn_bwd_pre_kernel<T, 16>, qgrid, 0, p, stream, kThreads, 'p');
  else
    launch(attn_bwd_pre_kernel<T, 32>, qgrid, 0, p, stream, kThreads, 'p');
  if (plan_of(p).sm90) {
    dispatch_mask_mode(p, [&](auto mode) {
      constexpr int M = decltype(mode)::value;
      if (p.d <= 64)
        launch_backward_sm90<64, T, M>(p, stream);
      else
        launch_backward_sm90<128, T, M>(p, stream);
    });
    return;
  }
  dispatch_head_dim(p.d, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    const dim3 kgrid(blocks_of(p.sk) * DkdvCfg<D>::CHUNKS, static_cast<unsigned>(p.hq / p.group),
                     static_cast<unsigned>(p.batch));
    dispatch_mask_mode(p, [&](auto mode) {
      launch(attn_bwd_dkdv_kernel<T, D, decltype(mode)::value>, kgrid, DkdvCfg<D>::smem(sizeof(T)), p, stream);
      launch(attn_bwd_dq_kernel<T, D, decltype(mode)::value>, qgrid, DqCfg<D>::smem(sizeof(T)), p, stream);
    });
  });
}

template <typename T>
void launch_backward(const Params& p, cudaStream_t stream) {
  const bool own = p.cu_q != nullptr && fill_by_launch();
  Params q = p;
  q.pre_fills = p.cu_q != nullptr && !own;
  launch_backward_kernels<T>(q, stream);
  if (own) zero_rows_outside(grads_outside<T>(p), stream);  // (after dq_convert, which skips those rows)
}

}  // namespace attn
}  // namespace pykernels
