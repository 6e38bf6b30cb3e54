// Scaled dot-product attention, forward and backward, in CUDA C++ with its autograd in C++:
// torch.ops.pykernels_cuda.attention, the CUDA backend of pykernels.scaled_dot_product_attention and
// pykernels.varlen_attention.
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
//   backward: three kernels, no atomics (bitwise reproducible):
//             pre  : delta = rowsum(dO * O) (fp32), one warp a row;
//             dK/dV: a block per (64 keys, kv head, batch; and a half of the head dim above D = 128, where the
//                    two accumulators would not fit in registers), looping over the query heads of its group
//                    (GQA) and their query blocks: S^T = K Q^T, P^T = exp2(S^T - lse), dV += P^T dO,
//                    dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q;
//             dQ   : a block per (64 queries, head, batch) looping over key blocks: dQ += dS K.
// Semantics are pykernels.attention's: top-left causal (query i sees keys j <= i), a boolean (True = take part)
// or additive mask read through its strides (stride 0 where it broadcasts: a mask of batch and key only, key
// padding, is read once a key into shared memory (forward, dQ) or registers (dK/dV), any other once an element
// through an out-of-line call), rows with no key to attend to give
// output 0, lse -inf and zero gradients; dropout keeps an element where philox(seed, ((b Hq + h) Sq + i) Sk + j)
// >= p (philox.cuh: Triton's tl.rand bit for bit, so the mask is the Triton kernels' and
// pykernels.attention_dropout_mask's; varlen: Sq, Sk = the max lengths, i, j inside the sequence).
// Cover (checked in Python first, pykernels/attention.py _cuda_cover; the TORCH_CHECKs here name what they
// reject): fp16 / bf16; q, k, v of one head dim D, a multiple of 8 up to 256 (computed at the next of
// 32, 64, 96, 128, 192, 256, the padding columns zero-filled); unit last stride (other strides any: rows are
// read through them; a tensor whose rows are not 16-byte aligned is copied); batch and heads up to 65535;
// int64 offsets throughout.
// Measured (H200, graph replay; benchmarks/results/HISTORY.md, twenty-second session): about a third of the Triton
// path's speed (BERT-base 111 / 83 TFLOP/s forward / backward, Triton's 336 / 305), so pykernels takes it only when
// named. Double-buffered tiles and two m-tiles a warp measured slower; the kernel is latency-bound at 12 warps an SM.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "dispatch.h"
#include "pack.cuh"
#include "philox.cuh"

namespace pykernels {
namespace {

using at::Tensor;
using c10::optional;

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kThreads = 128;  // 4 warps a block, every kernel
constexpr int kRows = 64;      // query rows (forward, dQ) or key rows (dK/dV) a block: 16 a warp

enum MaskKind : int { kNoMask = 0, kBoolMask = 1, kF32Mask = 2, kF16Mask = 3, kBF16Mask = 4, kF64Mask = 5 };

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  void* out;  // forward: o; backward: unused
  void* dq;
  void* dk;
  void* dv;
  float* lse;
  float* delta;
  int64_t q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss, do_sb, do_sh, do_ss;
  int64_t dq_sb, dq_sh, dq_ss, dk_sb, dk_sh, dk_ss, dv_sb, dv_sh, dv_ss;
  int64_t lse_sb, lse_sh;  // lse / delta of (b, h, i): lse[b lse_sb + h lse_sh + row offset + i]
  const int* cu_q;         // varlen: sequence b is rows cu[b]:cu[b+1] (nullptr: dense)
  const int* cu_k;
  int sq, sk;              // dense lengths; varlen: the max lengths (the dropout counter's Sq, Sk)
  int hq, group;           // query heads; query heads per kv head
  int d;                   // the real head dim (a multiple of 8)
  float scale_log2;        // softmax scale * log2(e)
  float scale;
  const void* mask;
  int mask_kind;
  bool mask_keys;          // the mask depends on (batch, key) only (key padding): read once a key, not an element
  int64_t m_sb, m_sh, m_sq, m_sk;
  bool causal;
  float p_drop, inv_keep;
  uint64_t seed;
};

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

// The mask's addend in log2 units at element offset ``off`` (out of line: the tiles' unrolled loops call it)
__device__ __noinline__ float mask_log2(const void* mask, int kind, int64_t off) {
  switch (kind) {
    case kBoolMask: return static_cast<const bool*>(mask)[off] ? 0.f : -INFINITY;
    case kF32Mask: return static_cast<const float*>(mask)[off] * kLog2e;
    case kF16Mask: return __half2float(static_cast<const __half*>(mask)[off]) * kLog2e;
    case kBF16Mask: return __bfloat162float(static_cast<const __nv_bfloat16*>(mask)[off]) * kLog2e;
    case kF64Mask: return static_cast<float>(static_cast<const double*>(mask)[off]) * kLog2e;
    default: return 0.f;
  }
}

// The scaled score (log2 units) of query i and key j, -inf where masked. ``edge``: the tile may hold keys past
// the sequence or above the causal diagonal. ``kb``: key j's mask addend for a key-only mask (else 0); other masks
// are read here, only inside the (sq, sk) rectangle.
__device__ __forceinline__ float score(const Params& p, float acc, int b, int h, int i, int j, int sq, int sk,
                                       bool edge, float kb) {
  float x = acc * p.scale_log2 + kb;
  if (p.mask_kind != kNoMask && !p.mask_keys)
    x = i < sq && j < sk ? x + mask_log2(p.mask, p.mask_kind, b * p.m_sb + h * p.m_sh + i * p.m_sq + j * p.m_sk)
                         : -INFINITY;
  if (edge && (j >= sk || (p.causal && j > i))) x = -INFINITY;
  return x;
}

// A key-only mask's addend for key j of batch b (-inf past the sequence); 0 without one
__device__ __forceinline__ float key_bias(const Params& p, int b, int j, int sk) {
  if (p.mask_kind == kNoMask || !p.mask_keys) return 0.f;
  return j < sk ? mask_log2(p.mask, p.mask_kind, b * p.m_sb + j * p.m_sk) : -INFINITY;
}

// The dropout factor (0 or 1 / (1 - p)) of (b, h, i, j): Philox at ((b Hq + h) Sq + i) Sk + j
__device__ __noinline__ float keep_at(uint64_t seed, uint64_t off, float p_drop, float inv_keep) {
  return philox_uniform(seed, off) >= p_drop ? inv_keep : 0.f;
}
__device__ __forceinline__ float keep_factor(const Params& p, int b, int h, int i, int j) {
  const uint64_t off = (static_cast<uint64_t>(b) * p.hq + h) * static_cast<uint64_t>(p.sq) * p.sk +
                       static_cast<uint64_t>(i) * p.sk + static_cast<uint64_t>(j);
  return keep_at(p.seed, off, p.p_drop, p.inv_keep);
}

// lse (natural log) -> the log2-domain subtrahend of the backward; +inf for a row with no key (its P is 0)
__device__ __forceinline__ float lse_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

// ---------------------------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------------------------
template <int D>
struct FwdCfg {
  static constexpr int BC = D > 128 ? 32 : 64;  // keys a block
  static constexpr int LD = D + 8;
  static constexpr size_t smem(size_t elt) { return static_cast<size_t>(kRows + 2 * BC) * LD * elt; }
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attn_fwd_kernel(const Params p) {
  using C = FwdCfg<D>;
  constexpr int BC = C::BC, LD = C::LD;
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
  const int n_end = p.causal ? min(s.sk, q0 + kRows) : s.sk;  // keys past n_end are masked for every row here
  const int nblocks = (n_end + BC - 1) / BC;
  // a key-only mask's addends of key block nb, into skb[nb % 2] (written before the barrier that precedes their use)
  __shared__ float skb[2][BC];
  const auto keys_of = [&](int nb) {
    if (p.mask_keys && p.mask_kind != kNoMask && nb < nblocks && tid < BC) skb[nb & 1][tid] = key_bias(p, b, nb * BC + tid, s.sk);
  };
  keys_of(0);

  load_tile<T, kRows, D>(sQ, Q, p.q_ss, min(kRows, s.sq - q0), p.d, tid);
  if (nblocks > 0) load_tile<T, BC, D>(sK, K, p.k_ss, min(BC, s.sk), p.d, tid);
  cp_async_commit();
  if (nblocks > 0) load_tile<T, BC, D>(sV, V, p.v_ss, min(BC, s.sk), p.d, tid);
  cp_async_commit();

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  constexpr bool kQRegs = D <= 128;  // Q's fragments stay in registers (above: read from shared memory each block)
  uint32_t qf[kQRegs ? D / 16 : 1][4];

  for (int nb = 0; nb < nblocks; ++nb) {
    const int k0 = nb * BC;
    cp_async_wait<1>();  // Q and this K block
    __syncthreads();
    if constexpr (kQRegs) {
      if (nb == 0) {
#pragma unroll
        for (int kt = 0; kt < D / 16; ++kt) ldsm_x4(qf[kt], a_addr<T, LD>(sQ, warp * 16, kt * 16, lane));
      }
    }
    float sc[BC / 8][4];
#pragma unroll
    for (int i = 0; i < BC / 8; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.f;
#pragma unroll
    for (int kt = 0; kt < D / 16; ++kt) {
      uint32_t qa[4];
      if constexpr (!kQRegs) ldsm_x4(qa, a_addr<T, LD>(sQ, warp * 16, kt * 16, lane));
      const uint32_t(&a)[4] = kQRegs ? qf[kQRegs ? kt : 0] : qa;
#pragma unroll
      for (int nt = 0; nt < BC / 8; nt += 2) {
        uint32_t bk[4];
        ldsm_x4(bk, b_addr<T, LD>(sK, nt * 8, kt * 16, lane));
        mma<T>(sc[nt], a, bk[0], bk[1]);
        mma<T>(sc[nt + 1], a, bk[2], bk[3]);
      }
    }
    __syncthreads();  // every warp is done with sK
    if (nb + 1 < nblocks) load_tile<T, BC, D>(sK, K + (k0 + BC) * p.k_ss, p.k_ss, min(BC, s.sk - k0 - BC), p.d, tid);
    cp_async_commit();
    keys_of(nb + 1);
    const float* kbs = skb[nb & 1];
    const bool keys = p.mask_keys && p.mask_kind != kNoMask;

    // online softmax (log2 domain); the row's 4 threads (t4 = 0..3) share its max through shuffles
    const bool edge = k0 + BC > s.sk || (p.causal && k0 + BC - 1 > q0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = k0 + nt * 8 + 2 * t4 + e;
          const float x = score(p, sc[nt][2 * r + e], b, h, row[r], j, s.sq, s.sk, edge,
                                keys ? kbs[nt * 8 + 2 * t4 + e] : 0.f);
          sc[nt][2 * r + e] = x;
          mx = fmaxf(mx, x);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx);
      const float base = m_new == -INFINITY ? 0.f : m_new;  // a row masked so far: exp2(-inf - 0) = 0
      const float alpha = exp2f(m[r] - base);
      m[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = exp2f(sc[nt][2 * r + e] - base);
          sc[nt][2 * r + e] = pe;
          sum += pe;
        }
      }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][2 * r] *= alpha;
        o[dt][2 * r + 1] *= alpha;
      }
    }
    if (p.p_drop > 0.f) {
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] *= keep_factor(p, b, h, row[e >> 1], k0 + nt * 8 + 2 * t4 + (e & 1));
    }

    cp_async_wait<1>();  // this V block (the next K block may still be in flight)
    __syncthreads();
#pragma unroll
    for (int kt = 0; kt < BC / 16; ++kt) {
      uint32_t a[4];
      acc_to_a<T>(a, sc[2 * kt], sc[2 * kt + 1]);
#pragma unroll
      for (int dt = 0; dt < D / 8; dt += 2) {
        uint32_t bv[4];
        ldsm_x4_t(bv, bt_addr<T, LD>(sV, kt * 16, dt * 8, lane));
        mma<T>(o[dt], a, bv[0], bv[1]);
        mma<T>(o[dt + 1], a, bv[2], bv[3]);
      }
    }
    __syncthreads();  // every warp is done with sV
    if (nb + 1 < nblocks) load_tile<T, BC, D>(sV, V + (k0 + BC) * p.v_ss, p.v_ss, min(BC, s.sk - k0 - BC), p.d, tid);
    cp_async_commit();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int i = row[r];
    if (i >= s.sq) continue;
    T* O = static_cast<T*>(p.out) + b * p.o_sb + h * p.o_sh + (s.q_off + i) * p.o_ss;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const int c = dt * 8 + 2 * t4;
      if (c < p.d) *reinterpret_cast<uint32_t*>(O + c) = pack2<T>(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
    }
    if (t4 == 0) p.lse[b * p.lse_sb + h * p.lse_sh + s.q_off + i] = sum > 0.f ? (m[r] + log2f(sum)) / kLog2e : -INFINITY;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------------------------
// delta = rowsum(dO * O) in fp32; a warp a row, a lane a 16-byte pack (D <= 256)
template <typename T>
__global__ void __launch_bounds__(kThreads) attn_bwd_pre_kernel(const Params p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.y, b = blockIdx.z;
  const Seq s = seq_of(p, b);
  constexpr int n = Pack<T>::n;
  for (int r = 0; r < kRows / 4; ++r) {
    const int i = blockIdx.x * kRows + warp * (kRows / 4) + r;
    if (i >= s.sq) return;
    float acc = 0.f;
    if (lane * n < p.d) {
      const T* O = static_cast<const T*>(p.o) + b * p.o_sb + h * p.o_sh + (s.q_off + i) * p.o_ss + lane * n;
      const T* dO = static_cast<const T*>(p.dout) + b * p.do_sb + h * p.do_sh + (s.q_off + i) * p.do_ss + lane * n;
      float fo[n], fd[n];
      unpack<T>(*reinterpret_cast<const uint4*>(O), fo);
      unpack<T>(*reinterpret_cast<const uint4*>(dO), fd);
#pragma unroll
      for (int e = 0; e < n; ++e) acc += fo[e] * fd[e];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) p.delta[b * p.lse_sb + h * p.lse_sh + s.q_off + i] = acc;
  }
}

template <int D>
struct DkdvCfg {
  static constexpr int DC = D > 128 ? D / 2 : D;  // accumulator columns a block (two blocks a key block above 128)
  static constexpr int CHUNKS = D / DC;
  static constexpr int BQ = D > 64 ? 32 : 64;      // query rows an iteration
  static constexpr int LD = D + 8;
  static constexpr size_t smem(size_t elt) {
    return static_cast<size_t>(2 * kRows + 2 * BQ) * LD * elt + 2 * BQ * sizeof(float);
  }
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attn_bwd_dkdv_kernel(const Params p) {
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
#pragma unroll
  for (int i = 0; i < DC / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
  const int key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  const float kb[2] = {key_bias(p, b, key[0], s.sk), key_bias(p, b, key[1], s.sk)};
  const int q_first = p.causal ? (k0 / BQ) * BQ : 0;  // queries i < k0 see no key of this block

  for (int hh = 0; hh < p.group; ++hh) {
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
#pragma unroll
      for (int i = 0; i < BQ / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
      for (int kt = 0; kt < D / 16; ++kt) {
        uint32_t ak[4], av[4];
        ldsm_x4(ak, a_addr<T, LD>(sK, warp * 16, kt * 16, lane));
        ldsm_x4(av, a_addr<T, LD>(sV, warp * 16, kt * 16, lane));
#pragma unroll
        for (int nt = 0; nt < BQ / 8; nt += 2) {
          uint32_t bq[4], bo[4];
          ldsm_x4(bq, b_addr<T, LD>(sQ, nt * 8, kt * 16, lane));
          mma<T>(st[nt], ak, bq[0], bq[1]);
          mma<T>(st[nt + 1], ak, bq[2], bq[3]);
          ldsm_x4(bo, b_addr<T, LD>(sO, nt * 8, kt * 16, lane));
          mma<T>(dpt[nt], av, bo[0], bo[1]);
          mma<T>(dpt[nt + 1], av, bo[2], bo[3]);
        }
      }
      // P^T, then dS^T = P^T (dP^T Z - delta) in st and P^T Z (for dV) in dpt's place after use
      const bool edge = p.causal && qs < k0 + kRows - 1;
#pragma unroll
      for (int nt = 0; nt < BQ / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int il = nt * 8 + 2 * t4 + (e & 1), i = qs + il, j = key[e >> 1];
          const float x = score(p, st[nt][e], b, h, i, j, s.sq, s.sk, edge, kb[e >> 1]);
          const float pe = exp2f(x - sL[il]);
          const float z = p.p_drop > 0.f ? keep_factor(p, b, h, i, j) : 1.f;
          st[nt][e] = pe * (dpt[nt][e] * z - sDelta[il]);  // dS^T
          dpt[nt][e] = pe * z;                              // P^T with dropout
        }
      }
#pragma unroll
      for (int kq = 0; kq < BQ / 16; ++kq) {
        uint32_t ap[4], as[4];
        acc_to_a<T>(ap, dpt[2 * kq], dpt[2 * kq + 1]);
        acc_to_a<T>(as, st[2 * kq], st[2 * kq + 1]);
#pragma unroll
        for (int dt = 0; dt < DC / 8; dt += 2) {
          uint32_t bo[4], bq[4];
          ldsm_x4_t(bo, bt_addr<T, LD>(sO, kq * 16, c0 + dt * 8, lane));
          mma<T>(dv[dt], ap, bo[0], bo[1]);
          mma<T>(dv[dt + 1], ap, bo[2], bo[3]);
          ldsm_x4_t(bq, bt_addr<T, LD>(sQ, kq * 16, c0 + dt * 8, lane));
          mma<T>(dk[dt], as, bq[0], bq[1]);
          mma<T>(dk[dt + 1], as, bq[2], bq[3]);
        }
      }
      __syncthreads();  // before the next iteration overwrites sQ, sO, sL, sDelta
    }
  }
  cp_async_wait<0>();  // (no query block: the K / V loads)

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = key[r];
    if (j >= s.sk) continue;
    T* dK = static_cast<T*>(p.dk) + b * p.dk_sb + hk * p.dk_sh + (s.k_off + j) * p.dk_ss;
    T* dV = static_cast<T*>(p.dv) + b * p.dv_sb + hk * p.dv_sh + (s.k_off + j) * p.dv_ss;
#pragma unroll
    for (int dt = 0; dt < DC / 8; ++dt) {
      const int c = c0 + dt * 8 + 2 * t4;
      if (c < p.d) {
        *reinterpret_cast<uint32_t*>(dK + c) = pack2<T>(dk[dt][2 * r] * p.scale, dk[dt][2 * r + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(dV + c) = pack2<T>(dv[dt][2 * r], dv[dt][2 * r + 1]);
      }
    }
  }
}

template <int D>
struct DqCfg {
  static constexpr int BC = D > 128 ? 32 : 64;  // keys an iteration
  static constexpr int LD = D + 8;
  static constexpr size_t smem(size_t elt) { return static_cast<size_t>(2 * kRows + 2 * BC) * LD * elt; }
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attn_bwd_dq_kernel(const Params p) {
  using C = DqCfg<D>;
  constexpr int BC = C::BC, LD = C::LD;
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
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
  const int n_end = p.causal ? min(s.sk, q0 + kRows) : s.sk;
  __shared__ float skb[2][BC];  // a key-only mask's addends of the key block (alternating halves)
  const bool keys = p.mask_keys && p.mask_kind != kNoMask;
  for (int k0 = 0; k0 < n_end; k0 += BC) {
    const int half = (k0 / BC) & 1;
    if (keys && tid < BC) skb[half][tid] = key_bias(p, b, k0 + tid, s.sk);
    load_tile<T, BC, D>(sK, K + k0 * p.k_ss, p.k_ss, min(BC, s.sk - k0), p.d, tid);
    load_tile<T, BC, D>(sV, V + k0 * p.v_ss, p.v_ss, min(BC, s.sk - k0), p.d, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    float sc[BC / 8][4], dp[BC / 8][4];
#pragma unroll
    for (int i = 0; i < BC / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[i][e] = dp[i][e] = 0.f;
#pragma unroll
    for (int kt = 0; kt < D / 16; ++kt) {
      uint32_t aq[4], ao[4];
      ldsm_x4(aq, a_addr<T, LD>(sQ, warp * 16, kt * 16, lane));
      ldsm_x4(ao, a_addr<T, LD>(sO, warp * 16, kt * 16, lane));
#pragma unroll
      for (int nt = 0; nt < BC / 8; nt += 2) {
        uint32_t bk[4], bv[4];
        ldsm_x4(bk, b_addr<T, LD>(sK, nt * 8, kt * 16, lane));
        mma<T>(sc[nt], aq, bk[0], bk[1]);
        mma<T>(sc[nt + 1], aq, bk[2], bk[3]);
        ldsm_x4(bv, b_addr<T, LD>(sV, nt * 8, kt * 16, lane));
        mma<T>(dp[nt], ao, bv[0], bv[1]);
        mma<T>(dp[nt + 1], ao, bv[2], bv[3]);
      }
    }
    const bool edge = k0 + BC > s.sk || (p.causal && k0 + BC - 1 > q0);
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, i = row[r], j = k0 + nt * 8 + 2 * t4 + (e & 1);
        const float x = score(p, sc[nt][e], b, h, i, j, s.sq, s.sk, edge, keys ? skb[half][j - k0] : 0.f);
        const float pe = exp2f(x - lse2[r]);
        const float z = p.p_drop > 0.f ? keep_factor(p, b, h, i, j) : 1.f;
        sc[nt][e] = pe * (dp[nt][e] * z - dl[r]);  // dS
      }
    }
#pragma unroll
    for (int kt = 0; kt < BC / 16; ++kt) {
      uint32_t a[4];
      acc_to_a<T>(a, sc[2 * kt], sc[2 * kt + 1]);
#pragma unroll
      for (int dt = 0; dt < D / 8; dt += 2) {
        uint32_t bk[4];
        ldsm_x4_t(bk, bt_addr<T, LD>(sK, kt * 16, dt * 8, lane));
        mma<T>(dq[dt], a, bk[0], bk[1]);
        mma<T>(dq[dt + 1], a, bk[2], bk[3]);
      }
    }
    __syncthreads();  // before the next iteration overwrites sK, sV
  }
  cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row[r];
    if (i >= s.sq) continue;
    T* dQ = static_cast<T*>(p.dq) + b * p.dq_sb + h * p.dq_sh + (s.q_off + i) * p.dq_ss;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const int c = dt * 8 + 2 * t4;
      if (c < p.d) *reinterpret_cast<uint32_t*>(dQ + c) = pack2<T>(dq[dt][2 * r] * p.scale, dq[dt][2 * r + 1] * p.scale);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Host
// ---------------------------------------------------------------------------------------------------------------
constexpr const char* kOp = "pykernels_cuda.attention";

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

template <typename K>
void launch(K kernel, dim3 grid, size_t smem, const Params& p, cudaStream_t stream) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  if (smem > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                            static_cast<int>(smem)));
  kernel<<<grid, kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// rows that cp.async can read 16 bytes at a time: a 16-byte aligned start and row / head / batch strides that
// keep it (stride 0 included); otherwise a contiguous copy
Tensor aligned(const Tensor& t) {
  const int64_t esz = t.element_size();
  bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int i = 0; i + 1 < t.dim() && ok; ++i) ok = (t.stride(i) * esz) % 16 == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

struct Shape {
  bool varlen;
  int64_t B, Hq, Hkv, Sq, Sk, D;
};

Shape check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                   const optional<Tensor>& cu_q, const optional<Tensor>& cu_k, int64_t max_q, int64_t max_k) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), kOp, ": query, key and value must be CUDA tensors");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), kOp,
              ": query, key and value must have one dtype");
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, kOp,
              ": query must be float16 or bfloat16, got ", q.scalar_type());
  const bool varlen = cu_q.has_value();
  TORCH_CHECK(varlen == cu_k.has_value(), kOp, ": cu_seqlens_q and cu_seqlens_k go together");
  const int nd = varlen ? 3 : 4;
  TORCH_CHECK(q.dim() == nd && k.dim() == nd && v.dim() == nd, kOp, ": query, key and value must be ",
              varlen ? "(tokens, heads, D)" : "(B, H, S, D)");
  Shape s;
  s.varlen = varlen;
  s.D = q.size(-1);
  TORCH_CHECK(k.size(-1) == s.D && v.size(-1) == s.D, kOp, ": query, key and value must have one head dim");
  TORCH_CHECK(s.D > 0 && s.D <= 256 && s.D % 8 == 0, kOp, ": head dim must be a multiple of 8 up to 256, got ", s.D);
  s.Hq = q.size(1);  // (B, H, S, D) and (tokens, H, D) alike
  s.Hkv = k.size(1);
  TORCH_CHECK(v.size(1) == s.Hkv && s.Hkv > 0 && s.Hq % s.Hkv == 0, kOp,
              ": query heads must be a multiple of key/value heads");
  TORCH_CHECK(s.Hq <= 65535, kOp, ": at most 65535 heads");
  if (varlen) {
    TORCH_CHECK(mask == c10::nullopt || !mask->defined(), kOp, ": varlen takes no mask");
    TORCH_CHECK(cu_q->scalar_type() == at::kInt && cu_k->scalar_type() == at::kInt && cu_q->dim() == 1 &&
                    cu_q->numel() == cu_k->numel() && cu_q->numel() >= 1 && cu_q->is_cuda() && cu_k->is_cuda(),
                kOp, ": cu_seqlens_q / cu_seqlens_k must be int32 CUDA tensors of B + 1 entries");
    TORCH_CHECK(k.size(0) == v.size(0), kOp, ": key and value must have the same tokens");
    s.B = cu_q->numel() - 1;
    s.Sq = max_q;
    s.Sk = max_k;
  } else {
    s.B = q.size(0);
    s.Sq = q.size(2);
    s.Sk = k.size(2);
    TORCH_CHECK(k.size(0) == s.B && v.size(0) == s.B && v.size(2) == s.Sk, kOp,
                ": key and value must be (B, Hkv, Sk, D) with query's B");
    if (mask.has_value() && mask->defined()) {
      TORCH_CHECK(mask->dim() == 4 && mask->size(0) == s.B && mask->size(1) == s.Hq && mask->size(2) == s.Sq &&
                      mask->size(3) == s.Sk && mask->is_cuda(),
                  kOp, ": attn_mask must be a (B, Hq, Sq, Sk) CUDA view");
      const auto mt = mask->scalar_type();
      TORCH_CHECK(mt == at::kBool || mt == at::kFloat || mt == at::kHalf || mt == at::kBFloat16 || mt == at::kDouble,
                  kOp, ": attn_mask must be bool or float, got ", mt);
    }
  }
  TORCH_CHECK(s.B <= 65535, kOp, ": at most 65535 sequences");
  TORCH_CHECK(s.Sq < (int64_t{1} << 31) - 64 && s.Sk < (int64_t{1} << 31) - 64, kOp, ": sequences below 2^31");
  return s;
}

void set_strides(const Tensor& t, bool varlen, int64_t& sb, int64_t& sh, int64_t& ss) {
  if (varlen) {
    sb = 0;
    ss = t.stride(0);
    sh = t.stride(1);
  } else {
    sb = t.stride(0);
    sh = t.stride(1);
    ss = t.stride(2);
  }
}

Params base_params(const Shape& s, const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                   const optional<Tensor>& cu_q, const optional<Tensor>& cu_k, double p_drop, bool causal,
                   double scale, int64_t seed) {
  Params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  set_strides(q, s.varlen, p.q_sb, p.q_sh, p.q_ss);
  set_strides(k, s.varlen, p.k_sb, p.k_sh, p.k_ss);
  set_strides(v, s.varlen, p.v_sb, p.v_sh, p.v_ss);
  if (s.varlen) {
    p.cu_q = cu_q->data_ptr<int>();
    p.cu_k = cu_k->data_ptr<int>();
    p.lse_sb = 0;
    p.lse_sh = q.size(0);
  } else {
    p.lse_sb = s.Hq * s.Sq;
    p.lse_sh = s.Sq;
  }
  p.sq = static_cast<int>(s.Sq);
  p.sk = static_cast<int>(s.Sk);
  p.hq = static_cast<int>(s.Hq);
  p.group = static_cast<int>(s.Hq / s.Hkv);
  p.d = static_cast<int>(s.D);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.mask_kind = kNoMask;
  if (mask.has_value() && mask->defined()) {
    const Tensor& m = *mask;
    p.mask = m.data_ptr();
    switch (m.scalar_type()) {
      case at::kBool: p.mask_kind = kBoolMask; break;
      case at::kFloat: p.mask_kind = kF32Mask; break;
      case at::kHalf: p.mask_kind = kF16Mask; break;
      case at::kBFloat16: p.mask_kind = kBF16Mask; break;
      default: p.mask_kind = kF64Mask; break;
    }
    p.m_sb = m.stride(0);
    p.m_sh = m.stride(1);
    p.m_sq = m.stride(2);
    p.m_sk = m.stride(3);
    p.mask_keys = (m.size(1) == 1 || m.stride(1) == 0) && (m.size(2) == 1 || m.stride(2) == 0);
  }
  p.causal = causal;
  p.p_drop = static_cast<float>(p_drop);
  p.inv_keep = p_drop > 0.0 ? static_cast<float>(1.0 / (1.0 - p_drop)) : 1.f;
  p.seed = static_cast<uint64_t>(seed);
  return p;
}

unsigned blocks_of(int64_t rows) { return static_cast<unsigned>((rows + kRows - 1) / kRows); }

// (o, lse)
std::vector<Tensor> forward_impl(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                 const optional<Tensor>& mask, const optional<Tensor>& cu_q,
                                 const optional<Tensor>& cu_k, int64_t max_q, int64_t max_k, double p_drop,
                                 bool causal, double scale, int64_t seed) {
  const Shape s = check_inputs(q_in, k_in, v_in, mask, cu_q, cu_k, max_q, max_k);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = aligned(q_in), k = aligned(k_in), v = aligned(v_in);
  // o in q's layout where q is dense (transformers' transposed views reshape back for free); varlen rows past
  // cu_seqlens_q[-1] are 0
  Tensor o = s.varlen ? at::zeros_like(q, at::MemoryFormat::Contiguous) : poisoned(aligned(at::empty_like(q)));
  Tensor lse = s.varlen ? at::full({s.Hq, q.size(0)}, -INFINITY, q.options().dtype(at::kFloat))
                        : poisoned(at::empty({s.B, s.Hq, s.Sq}, q.options().dtype(at::kFloat)));
  Params p = base_params(s, q, k, v, mask, cu_q, cu_k, p_drop, causal, scale, seed);
  p.out = o.data_ptr();
  set_strides(o, s.varlen, p.o_sb, p.o_sh, p.o_ss);
  p.lse = lse.data_ptr<float>();
  auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(blocks_of(s.Sq), static_cast<unsigned>(s.Hq), static_cast<unsigned>(s.B));
  dispatch_float_dtype(q.scalar_type(), "pykernels_cuda.attention: query", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      dispatch_head_dim(p.d, [&](auto dc) {
        constexpr int D = decltype(dc)::value;
        launch(attn_fwd_kernel<T, D>, grid, FwdCfg<D>::smem(sizeof(T)), p, stream);
      });
    }
  });
  return {o, lse};
}

// (dq, dk, dv)
std::vector<Tensor> backward_impl(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                  const Tensor& o_in, const Tensor& lse, const optional<Tensor>& mask,
                                  const optional<Tensor>& cu_q, const optional<Tensor>& cu_k, int64_t max_q,
                                  int64_t max_k, double p_drop, bool causal, double scale, int64_t seed) {
  const Shape s = check_inputs(q_in, k_in, v_in, mask, cu_q, cu_k, max_q, max_k);
  TORCH_CHECK(dout_in.sizes() == o_in.sizes(), kOp, ": the output gradient must have the output's shape");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = aligned(q_in), k = aligned(k_in), v = aligned(v_in), o = aligned(o_in);
  const Tensor dout = aligned(dout_in.scalar_type() == q.scalar_type() ? dout_in : dout_in.to(q.scalar_type()));
  // varlen: rows past cu_seqlens[-1] (which no block writes) are 0; dense: every row is written
  const auto alloc = [&](const Tensor& t) {
    return s.varlen ? at::zeros_like(t, at::MemoryFormat::Contiguous) : poisoned(aligned(at::empty_like(t)));
  };
  Tensor dq = alloc(q), dk = alloc(k), dv = alloc(v);
  Tensor delta = at::empty_like(lse);
  Params p = base_params(s, q, k, v, mask, cu_q, cu_k, p_drop, causal, scale, seed);
  p.o = o.data_ptr();
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.lse = const_cast<float*>(lse.data_ptr<float>());
  p.delta = delta.data_ptr<float>();
  set_strides(o, s.varlen, p.o_sb, p.o_sh, p.o_ss);
  set_strides(dout, s.varlen, p.do_sb, p.do_sh, p.do_ss);
  set_strides(dq, s.varlen, p.dq_sb, p.dq_sh, p.dq_ss);
  set_strides(dk, s.varlen, p.dk_sb, p.dk_sh, p.dk_ss);
  set_strides(dv, s.varlen, p.dv_sb, p.dv_sh, p.dv_ss);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 qgrid(blocks_of(s.Sq), static_cast<unsigned>(s.Hq), static_cast<unsigned>(s.B));
  dispatch_float_dtype(q.scalar_type(), "pykernels_cuda.attention: query", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      launch(attn_bwd_pre_kernel<T>, qgrid, 0, p, stream);
      dispatch_head_dim(p.d, [&](auto dc) {
        constexpr int D = decltype(dc)::value;
        const dim3 kgrid(blocks_of(s.Sk) * DkdvCfg<D>::CHUNKS, static_cast<unsigned>(s.Hkv),
                         static_cast<unsigned>(s.B));
        launch(attn_bwd_dkdv_kernel<T, D>, kgrid, DkdvCfg<D>::smem(sizeof(T)), p, stream);
        launch(attn_bwd_dq_kernel<T, D>, qgrid, DqCfg<D>::smem(sizeof(T)), p, stream);
      });
    }
  });
  return {dq, dk, dv};
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& q,
                                                const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                                                const optional<Tensor>& cu_q, const optional<Tensor>& cu_k,
                                                int64_t max_q, int64_t max_k, double p_drop, bool causal,
                                                double scale, int64_t seed) {
    auto out = forward_impl(q, k, v, mask, cu_q, cu_k, max_q, max_k, p_drop, causal, scale, seed);
    const Tensor none;
    ctx->save_for_backward({q, k, v, out[0], out[1], mask.value_or(none), cu_q.value_or(none), cu_k.value_or(none)});
    ctx->saved_data["max_q"] = max_q;
    ctx->saved_data["max_k"] = max_k;
    ctx->saved_data["p_drop"] = p_drop;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["seed"] = seed;
    return {out[0]};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "pykernels_cuda::attention: double backward (create_graph=True) is "
                "not supported; use backend='reference'");
    auto saved = ctx->get_saved_variables();
    const auto opt = [](const Tensor& t) { return t.defined() ? optional<Tensor>(t) : optional<Tensor>(); };
    const Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(saved[3]);
    auto g = backward_impl(dout, saved[0], saved[1], saved[2], saved[3], saved[4], opt(saved[5]), opt(saved[6]),
                           opt(saved[7]), ctx->saved_data["max_q"].toInt(), ctx->saved_data["max_k"].toInt(),
                           ctx->saved_data["p_drop"].toDouble(), ctx->saved_data["causal"].toBool(),
                           ctx->saved_data["scale"].toDouble(), ctx->saved_data["seed"].toInt());
    return {g[0], g[1], g[2], Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(),
            Tensor()};
  }
};

Tensor attention_autograd(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                          const optional<Tensor>& cu_q, const optional<Tensor>& cu_k, int64_t max_q, int64_t max_k,
                          double p_drop, bool causal, double scale, int64_t seed) {
  return AttentionFunction::apply(q, k, v, mask, cu_q, cu_k, max_q, max_k, p_drop, causal, scale, seed)[0];
}

Tensor attention_nograd(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                        const optional<Tensor>& cu_q, const optional<Tensor>& cu_k, int64_t max_q, int64_t max_k,
                        double p_drop, bool causal, double scale, int64_t seed) {
  return forward_impl(q, k, v, mask, cu_q, cu_k, max_q, max_k, p_drop, causal, scale, seed)[0];
}

}  // namespace
}  // namespace pykernels

TORCH_LIBRARY_FRAGMENT(pykernels_cuda, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, float dropout_p, bool causal, float scale, int seed) -> Tensor");
}

TORCH_LIBRARY_IMPL(pykernels_cuda, CUDA, m) { m.impl("attention", &pykernels::attention_nograd); }

TORCH_LIBRARY_IMPL(pykernels_cuda, Autograd, m) { m.impl("attention", &pykernels::attention_autograd); }
