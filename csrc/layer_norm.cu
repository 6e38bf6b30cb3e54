// Residual add + LayerNorm / RMSNorm, forward and backward, in CUDA C++, with its autograd in C++.
//
// Why a C++ op. The Triton path runs its forward and backward through Python (an autograd.Function,
// launch wrappers, the partial-sum reduction): about 690 us of host time per forward+backward on the
// H100 machine's host, against 176 us for eager torch, so at BERT sizes the op is host-bound in eager
// mode. Here the whole op, autograd included, is one dispatcher call: pykernels_cuda::layer_norm has a
// CUDA kernel (no grad) and an Autograd kernel (a torch::autograd::Function), so the backward runs in
// C++ on autograd's device thread without taking the GIL. torch.compile cannot trace that autograd, so the same
// kernels are also a compiled pair, layer_norm_fwd / layer_norm_bwd (at the end), which compiled graphs call.
//
// Kernels. A row is held in registers by RT threads: in the forward one warp (RT = 32) for N <= 1024,
// the whole 256-thread block for wider rows (N <= 8192 fp16/bf16, <= 4096 fp32; sums over the block
// through shared memory); in the backward one warp up to 3 packs per lane, two warps (RT = 64, sums
// exchanged through shared memory under a named barrier of the pair) up to N = 1024, a block beyond. Each thread owns VPL packs of 16 bytes (8 fp16/bf16 or 4 fp32 elements),
// interleaved so that RT threads' loads are contiguous. Forward fp16 / bf16 warp rows of at most 2 packs a lane (N <= 512)
// run on a persistent grid (ln_fwd_persist_kernel: each warp walks rows gridDim.x * 8 apart and loads
// the next row's x and residual before this row's math); PYKERNELS_LN_FWD_PERSIST=0 gives them one row a warp.
// Those of 3-4 packs (512 < N <= 1024) take two-warp blocks with late weight loads (ln_fwd_rows_kernel: 64 registers
// at 3 packs, 32 warps an SM); PYKERNELS_LN_FWD_ROWS=0 gives them ln_fwd_kernel's eight-row blocks.
// Statistics in fp32 from registers (two passes over registers: exact variance, no E[x^2] - E[x]^2).
//   forward : s = x + residual; mean, rstd; y = (s - mean) * rstd * w + b; stores y, s (pre-LN only),
//             mean (LayerNorm), rstd.
//   backward: two passes over a row held as raw packs (first the row sums, then dx), with
//             xhat = (s - mean) * rstd (s saved for pre-LN, recomputed from x + residual for post-LN),
//             g = dy * w, ds = rstd * (g - mean(g) - xhat * mean(g * xhat)) (+ the gradient arriving
//             through s for pre-LN, loaded with the row where the registers allow); dx = ds
//             (= dresidual); both row sums in one exchange. A thread's columns are the same in every row it
//             visits, so up to 16 elements a thread it loads their weights once, as fp32, before its rows (H200
//             run263: 5-7% of the kernel at N = 768). Block rows of at most 2 packs per thread
//             issue the next row's loads before this row's math (a block otherwise has one row in
//             flight). dweight = sum dy * xhat and dbias = sum dy
//             accumulate per lane in fp32 registers over the rows a warp visits (grid-stride loop over a
//             persistent grid), are summed over the block's row groups in shared memory in a fixed
//             order (each group's sums in its own slot, then the block's threads over the slots: kDwbSlots),
//             and each block writes one fp32 partial row; a second kernel (ln_partial_sum_kernel) sums the
//             partial rows and casts once. No atomics: bitwise reproducible.
// Inputs are made contiguous and 16-byte aligned (a copy only when they are not) before the kernels
// see them, and the tensors saved for the backward are those copies.
// Cover: fp16/bf16/fp32 x; residual of x's dtype; weight and bias of x's dtype or both fp32 (autocast's
// parameters beside bf16 / fp16 rows; dweight / dbias come back in that dtype), or absent; N a multiple of the pack
// (8 / 4 elements) up to 8192 (fp32: 4096), at most 32 elements per thread. Dropout on x: element
// (row, col) takes 16 bits of the Philox call at row ceil(N / 8) + col / 8, one call a pack (csrc/philox.cuh,
// keep_pack_bits: the Triton kernels' dropout_keep bit for bit), kept where they are >= p 2^16, p rounded to a
// multiple of 2^-16, so the mask equals the Triton kernels' and pykernels.layer_norm.layer_norm_dropout_mask's; the
// backward regenerates it (a thread's <= 32 keep bits of a row live in one register between passes);
// dropout is a template flag, so the Philox code costs registers only in dropout calls. Python checks the
// cover first (pykernels/layer_norm.py, _cuda_cover); the TORCH_CHECKs here name what they reject.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <cstdlib>
#include <string>
#include <type_traits>

#include "dispatch.h"
#include "pack.cuh"
#include "pdl.cuh"
#include "philox.cuh"

namespace pykernels {
namespace {

using at::Tensor;
using c10::optional;

constexpr int kWarps = 8;  // rows per block (one warp each)
constexpr int kThreads = kWarps * 32;
constexpr int kMaxElemsPerLane = 32;  // registers: a backward thread keeps a row's share as raw packs
constexpr int kMaxN16 = 8192, kMaxN32 = 4096;  // widest rows (fp16/bf16, fp32): 32 elements per thread

// Dropout keep bits of the P-element pack at (row, col), col a multiple of P: one Philox call at row ceil(N / 8) +
// col / 8 (philox.cuh keep_pack_bits: the Triton kernels' dropout_keep, bit for bit)
template <int P>
__device__ __forceinline__ uint32_t keep_bits(uint64_t seed, int64_t row, int N, int col, float p) {
  const uint64_t counter = static_cast<uint64_t>(row) * static_cast<uint64_t>((N + 7) / 8) + static_cast<uint64_t>(col >> 3);
  return keep_pack_bits<P>(seed, counter, col & 7, p);
}

// Sum over the RT threads that share a row: a warp (RT = 32) or the whole block (RT = kThreads).
template <int RT>
__device__ __forceinline__ float row_sum(float v) {
  v = warp_sum(v);
  if constexpr (RT == 32) {
    return v;
  } else {
    static_assert(RT == kThreads, "a row is one warp or one block");
    __shared__ float red[kWarps];
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) t += red[i];
    __syncthreads();  // red is reused by the next sum
    return t;
  }
}

// the 64 threads of warps 2g and 2g + 1 (a backward row of two warps) wait for each other: named
// barrier 1 + g (0 is __syncthreads'), so the block's other rows are not held up
__device__ __forceinline__ void pair_sync() {
  asm volatile("bar.sync %0, 64;" : : "r"(1 + (static_cast<int>(threadIdx.x) >> 6)) : "memory");
}

// both sums of the backward (row_sum of each): shuffles within a warp, then one exchange through
// shared memory for rows of two warps (RT = 64) or of the whole block
template <int RT>
__device__ __forceinline__ void row_sum2(float& a, float& b) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  if constexpr (RT == 64) {
    __shared__ float2 pair[kWarps];
    const int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) pair[w] = make_float2(a, b);
    pair_sync();
    const float2 lo = pair[w & ~1], hi = pair[w | 1];  // the same order in both warps: equal sums
    pair_sync();  // pair is reused by the next row
    a = lo.x + hi.x;
    b = lo.y + hi.y;
  } else if constexpr (RT != 32) {
    static_assert(RT == kThreads, "a backward row is one warp, two warps or one block");
    __shared__ float2 red2[kWarps];
    if ((threadIdx.x & 31) == 0) red2[threadIdx.x >> 5] = make_float2(a, b);
    __syncthreads();
    float ta = 0.f, tb = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) {
      ta += red2[i].x;
      tb += red2[i].y;
    }
    __syncthreads();  // red2 is reused by the next row
    a = ta;
    b = tb;
  }
}

// The forward's math of one row from its raw packs (x, and the residual where has_res), at rows of RT threads: s =
// dropout(x) + residual, mean, rstd, and the stores (y, s where store_s, mean, rstd). WE: the weight and bias packs come
// from registers (w_raw, b_raw: one 16-byte load a pack, W = T), else from memory here, a pack at a time.
template <typename T, typename W, int VPL, int RT, bool DROP, bool WE>
__device__ __forceinline__ void ln_fwd_row(const uint4 (&x_raw)[VPL], const uint4 (&r_raw)[VPL],
                                           const uint4 (&w_raw)[VPL], const uint4 (&b_raw)[VPL],
                                           const W* __restrict__ w, const W* __restrict__ b, T* __restrict__ y,
                                           T* __restrict__ s, float* __restrict__ mean_out,
                                           float* __restrict__ rstd_out, int64_t row, int lane, int N, float eps,
                                           bool has_res, bool has_w, bool has_b, bool store_s, bool rms,
                                           uint64_t seed, float drop_p, float drop_scale) {
  constexpr int P = Pack<T>::n;
  const int64_t base = row * N;
  float v[VPL][P];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int col = (i * RT + lane) * P;
    if (col < N) {
      unpack<T>(x_raw[i], v[i]);
      if constexpr (DROP) {
        const uint32_t kb = keep_bits<P>(seed, row, N, col, drop_p);
#pragma unroll
        for (int j = 0; j < P; ++j) v[i][j] = (kb >> j) & 1u ? v[i][j] * drop_scale : 0.f;
      }
      if (has_res) {
        float r[P];
        unpack<T>(r_raw[i], r);
#pragma unroll
        for (int j = 0; j < P; ++j) v[i][j] += r[j];
      }
    } else {
#pragma unroll
      for (int j = 0; j < P; ++j) v[i][j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < P; ++j) sum += v[i][j];
  }
  const float inv_n = 1.f / static_cast<float>(N);
  const float mu = rms ? 0.f : row_sum<RT>(sum) * inv_n;
  float var = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    if ((i * RT + lane) * P < N) {
#pragma unroll
      for (int j = 0; j < P; ++j) {
        const float d = v[i][j] - mu;
        var += d * d;
      }
    }
  }
  const float rstd = rsqrtf(row_sum<RT>(var) * inv_n + eps);
  if (lane == 0) {
    if (!rms) mean_out[row] = mu;
    rstd_out[row] = rstd;
  }
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int col = (i * RT + lane) * P;
    if (col < N) {
      if (store_s) store_pack(s + base + col, v[i]);
      float wv[P], bv[P], o[P];
      if constexpr (WE) {
        if (has_w) unpack<W>(w_raw[i], wv);
        if (has_b) unpack<W>(b_raw[i], bv);
      } else {
        if (has_w) load_packs<W, P>(w + col, wv);
        if (has_b) load_packs<W, P>(b + col, bv);
      }
#pragma unroll
      for (int j = 0; j < P; ++j) {
        float t = (v[i][j] - mu) * rstd;
        if (has_w) t *= wv[j];
        if (has_b) t += bv[j];
        o[j] = t;
      }
      store_pack(y + base + col, o);
    }
  }
}

// 16-byte loads a pack's weight (or bias) takes: 1 where W = T, 2 for fp32 parameters beside fp16 / bf16 rows
template <typename T, typename W>
constexpr int kParamPackLoads = Pack<T>::n * static_cast<int>(sizeof(W)) / 16;

// the lane's weight and bias packs (W = T: one load a pack), where col < N and the parameter is given
template <typename T, typename W, int VPL, int RT>
__device__ __forceinline__ void ln_fwd_params(const W* __restrict__ w, const W* __restrict__ b, int lane, int N,
                                              bool has_w, bool has_b, uint4 (&w_raw)[VPL], uint4 (&b_raw)[VPL]) {
  static_assert(kParamPackLoads<T, W> == 1, "one 16-byte load a pack");
  constexpr int P = Pack<T>::n;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int col = (i * RT + lane) * P;
    if (col < N) {
      if (has_w) w_raw[i] = *reinterpret_cast<const uint4*>(w + col);
      if (has_b) b_raw[i] = *reinterpret_cast<const uint4*>(b + col);
    }
  }
}

// the row's x and residual packs (where col < N; the residual where has_res), all issued before any is used
template <typename T, int VPL, int RT>
__device__ __forceinline__ void ln_fwd_load(const T* __restrict__ x, const T* __restrict__ res, int64_t row, int lane,
                                            int N, bool has_res, uint4 (&x_raw)[VPL], uint4 (&r_raw)[VPL]) {
  constexpr int P = Pack<T>::n;
  const int64_t base = row * N;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int col = (i * RT + lane) * P;
    if (col < N) {
      x_raw[i] = *reinterpret_cast<const uint4*>(x + base + col);
      if (has_res) r_raw[i] = *reinterpret_cast<const uint4*>(res + base + col);
    }
  }
}

// DROP: dropout on x (a template flag: the Philox code would otherwise cost every call its registers). W: the
// weight's and bias's element type, T or float (autocast keeps fp32 parameters beside bf16 / fp16 activations).
// A warp (RT = 32) or the block takes one row (the persistent walk of narrow rows: ln_fwd_persist_kernel).
template <typename T, typename W, int VPL, int RT, bool DROP>
__global__ void __launch_bounds__(kThreads) ln_fwd_kernel(
    const T* __restrict__ x, const T* __restrict__ res, const W* __restrict__ w, const W* __restrict__ b,
    T* __restrict__ y, T* __restrict__ s, float* __restrict__ mean_out, float* __restrict__ rstd_out,
    int64_t M, int N, float eps, bool has_res, bool has_w, bool has_b, bool store_s, bool rms,
    const int64_t* __restrict__ seed_ptr, float drop_p, float drop_scale) {
  pdl_enter();  // (launch_pdl: pdl.cuh)
  const int lane = threadIdx.x % RT;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / RT) + threadIdx.x / RT;
  if (row >= M) return;  // (RT = kThreads: one row per block, never taken)
  // the row's x and residual packs are all loaded before any is used: loaded where each pack is used, behind its
  // branches (col < N, has_res), a row waited for memory once a pack (ptxas does not hoist a load above a branch);
  // with the weights below, H200 run266 graph-replay forward 70.6 -> 84.2% of copy at post 16384 x 1024,
  // 86 -> 95% at 8192 x 4096
  uint4 x_raw[VPL], r_raw[VPL];
  ln_fwd_load<T, VPL, RT>(x, res, row, lane, N, has_res, x_raw, r_raw);
  // kWEarly: the weight and bias packs too (one 16-byte load a pack each), so their latency overlaps the row's sums
  // rather than the stores waiting for them a pack at a time; only where a pack's parameters are one load each (W = T)
  // and at most 4 packs a thread: fp32 parameters beside fp16 / bf16 rows (two loads each) took the 3-4-pack kernels
  // from 62-64 to 94-127 registers, fp32 rows of 6-8 packs to 110-157
  constexpr bool kWEarly = kParamPackLoads<T, W> == 1 && VPL <= 4;
  uint4 w_raw[VPL], b_raw[VPL];
  if constexpr (kWEarly) ln_fwd_params<T, W, VPL, RT>(w, b, lane, N, has_w, has_b, w_raw, b_raw);
  // the dropout seed, read from device memory (graph-safe: philox.cuh), after the row's loads are issued
  uint64_t seed = 0;
  if constexpr (DROP) seed = static_cast<uint32_t>(__ldg(seed_ptr));
  ln_fwd_row<T, W, VPL, RT, DROP, kWEarly>(x_raw, r_raw, w_raw, b_raw, w, b, y, s, mean_out, rstd_out, row, lane, N,
                                           eps, has_res, has_w, has_b, store_s, rms, seed, drop_p, drop_scale);
}

// The persistent forward of fp16 / bf16 warp rows of at most 2 packs a lane (N <= 512): a grid of the
// blocks resident an SM times the SMs (fwd_blocks_per_sm), whose warps walk rows gridDim.x * kWarps apart, each
// issuing the next row's x and residual loads before this row's math. One row a warp and out (ln_fwd_kernel) had
// nothing in flight across a warp's load, reductions and stores, then the block's turnover: 84-87% of copy bandwidth
// at 16384 x 768 bf16 on the H200. At most 128 registers (two blocks an SM). kWHold: the weight and bias packs of
// the lane's columns (the same in every row it visits) are loaded once, before the rows, where a pack's parameters are
// one load each (W = T); with fp32 parameters each pack's parameters are loaded where they are used (L1 hits after
// the first row). (Held at 3 packs a lane, they took the kernel past 128 registers: 24-36 bytes of spill.) No barrier
// anywhere (warp rows): a warp with no row, or with fewer rows than others, leaves. PYKERNELS_LN_FWD_PERSIST=0 takes
// ln_fwd_kernel instead (fwd_persist_enabled).
// Where it runs (H200 run272, CUDA-graph replay of the forward, 16384 rows, bf16 against the one-row grid in the same
// call): N = 512 13.89 -> 12.90 us (86 -> 92.6% of copy), N = 256 equal; at 3 packs a lane it lost as often as it
// won (N = 768: post-LN -1.5..-3.6%, pre-LN with fp32 parameters and dropout -1..-6%, post-LN with dropout +3%;
// fp32 rows of 384 -3.5..-4.7%; 65536 x 768 -4..-6%: two blocks an SM of 90-104 registers against three of the
// one-row kernel's 79), so rows of 3 packs and fp32 rows keep the one-row grid.
template <typename T, int VPL, int RT>
constexpr bool kFwdPersistable = RT == 32 && VPL <= 2 && sizeof(T) == 2;

template <typename T, typename W, int VPL, int RT, bool DROP>
__global__ void __launch_bounds__(kThreads, 2) ln_fwd_persist_kernel(
    const T* __restrict__ x, const T* __restrict__ res, const W* __restrict__ w, const W* __restrict__ b,
    T* __restrict__ y, T* __restrict__ s, float* __restrict__ mean_out, float* __restrict__ rstd_out,
    int64_t M, int N, float eps, bool has_res, bool has_w, bool has_b, bool store_s, bool rms,
    const int64_t* __restrict__ seed_ptr, float drop_p, float drop_scale) {
  pdl_enter();  // (launch_pdl: pdl.cuh)
  static_assert(kFwdPersistable<T, VPL, RT>, "the persistent forward is for fp16 / bf16 warp rows of <= 2 packs");
  constexpr int kRows = kThreads / RT;
  const int lane = threadIdx.x % RT;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRows;
  int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / RT;
  if (row >= M) return;
  uint64_t seed = 0;  // the dropout seed, read from device memory once (graph-safe: philox.cuh)
  if constexpr (DROP) seed = static_cast<uint32_t>(__ldg(seed_ptr));
  constexpr bool kWHold = kParamPackLoads<T, W> == 1;  // (rows of <= 2 packs: kFwdPersistable)
  uint4 w_raw[VPL], b_raw[VPL];
  if constexpr (kWHold) ln_fwd_params<T, W, VPL, RT>(w, b, lane, N, has_w, has_b, w_raw, b_raw);
  uint4 x_nxt[VPL], r_nxt[VPL];
  ln_fwd_load<T, VPL, RT>(x, res, row, lane, N, has_res, x_nxt, r_nxt);
  for (; row < M; row += stride) {
    uint4 x_cur[VPL], r_cur[VPL];
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      x_cur[i] = x_nxt[i];
      r_cur[i] = r_nxt[i];
    }
    // the next row's loads, in flight during this row's math (the dropout mask depends on the row and column only)
    if (row + stride < M) ln_fwd_load<T, VPL, RT>(x, res, row + stride, lane, N, has_res, x_nxt, r_nxt);
    ln_fwd_row<T, W, VPL, RT, DROP, kWHold>(x_cur, r_cur, w_raw, b_raw, w, b, y, s, mean_out, rstd_out, row, lane, N,
                                            eps, has_res, has_w, has_b, store_s, rms, seed, drop_p, drop_scale);
  }
}

// The one-row-a-warp forward of fp16 / bf16 rows of 3-4 packs a lane (512 < N <= 1024), two warps a block, with the
// weight and bias packs loaded where they are used (L1 hits after a block's first row), not early as ln_fwd_kernel
// loads them. Without those 2 x VPL registers a row of 3 packs fits in 64 registers (kRowsMinBlocks: 32 warps an SM
// against ln_fwd_kernel's 24 at 79), and a block of two warps frees its slot when its two rows are done, not its
// slowest of eight. H200 run366-368 (graph replay, bf16, PDL on), against ln_fwd_kernel in the same call: pre 16384 x
// 768 27.5-27.7 -> 26.2-26.7 us (87.2-87.5 -> 91.1-91.8% of copy bandwidth), post 16384 x 768 21.1 -> 20.0-20.3
// (85.3-86.0 -> 89.4-90.3%), pre 16384 x 1024 36.1-36.3 -> 34.4-34.6 (89 -> 93.1-93.4%), post 16384 x 1024 28.3-29.2 ->
// 26.3-26.4 (83-85.5 -> 91.3-91.9%), pre 65536 x 768 99.5-100.3 -> 97.8-98.7; with dropout 0.1 post / pre 16384 x 768
// 27.6 / 32.4 -> 25.5 / 31.1 us; with fp32 parameters 21.0 / 27.2 -> 20.7 / 26.6-26.8. Tried and not kept: four or
// eight warps a block (within 0.4 us, slower on most rows), one (post 16384 x 768 22.9 us), the early weights at two or
// four warps (72 registers, 28 warps an SM: 0.4-0.9 us slower), the weights issued once the mean is known (24 bytes of
// spill at 64 registers: 0.1-1.7 us slower), streaming stores (0.2-0.9 us slower) and streaming loads (post 16384 x 768
// faster, 19.4 us, than a same-size copy, 19.5: the benchmark's L2 reuse across its unrolled calls, not the op; every
// other shape 0.3-3.0 us slower; run368), a register cap of 56, 48 or 40 (36-236 bytes of spill: post 16384 x 768 21.8,
// 29.0, 34.4 us; run369). (At 4 packs a lane a cap of 64 registers spilled 60 bytes: 24 warps an SM there, 85
// registers.) PYKERNELS_LN_FWD_ROWS=0 takes ln_fwd_kernel instead (read at every call, for A/B in one process:
// benchmarks/dev/pdl_ab.py --settings "LN_FWD_ROWS=1;LN_FWD_ROWS=0").
constexpr int kRowWarps = 2;
enum FwdMode { kOneRow, kPersist, kRows };  // the forward's kernel (forward_impl)

template <typename T, int VPL>
constexpr bool kFwdRowsable = VPL >= 3 && VPL <= 4 && sizeof(T) == 2;

// blocks an SM the register cap asks for: 64 registers at 3 packs (32 warps), 85 at 4 (ptxas gives 72-73: 28 warps);
// no spill in any instantiation (with dropout, or fp32 parameters, too: CPU compile, benchmarks/dev/cuda_sass.py)
template <int VPL>
constexpr int kRowsMinBlocks = (VPL == 3 ? 32 : 24) / kRowWarps;

template <typename T, typename W, int VPL, bool DROP>
__global__ void __launch_bounds__(kRowWarps * 32, kRowsMinBlocks<VPL>) ln_fwd_rows_kernel(
    const T* __restrict__ x, const T* __restrict__ res, const W* __restrict__ w, const W* __restrict__ b,
    T* __restrict__ y, T* __restrict__ s, float* __restrict__ mean_out, float* __restrict__ rstd_out,
    int64_t M, int N, float eps, bool has_res, bool has_w, bool has_b, bool store_s, bool rms,
    const int64_t* __restrict__ seed_ptr, float drop_p, float drop_scale) {
  pdl_enter();  // (launch_pdl: pdl.cuh)
  static_assert(kFwdRowsable<T, VPL>, "the two-warp forward is for fp16 / bf16 warp rows of 3-4 packs");
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= M) return;
  uint4 x_raw[VPL], r_raw[VPL];
  ln_fwd_load<T, VPL, 32>(x, res, row, lane, N, has_res, x_raw, r_raw);
  uint64_t seed = 0;
  if constexpr (DROP) seed = static_cast<uint32_t>(__ldg(seed_ptr));
  const uint4(&unused)[VPL] = x_raw;  // (no early weight packs: ln_fwd_row loads them from w and b)
  ln_fwd_row<T, W, VPL, 32, DROP, false>(x_raw, r_raw, unused, unused, w, b, y, s, mean_out, rstd_out, row, lane, N,
                                         eps, has_res, has_w, has_b, store_s, rms, seed, drop_p, drop_scale);
}

// PYKERNELS_LN_FWD_ROWS=0: ln_fwd_kernel for the rows ln_fwd_rows_kernel takes (read at every call)
inline bool fwd_rows_enabled() {
  const char* e = std::getenv("PYKERNELS_LN_FWD_ROWS");
  return e == nullptr || std::string(e) != "0";
}

// one pack of a backward row: s (= the raw s or x, plus the residual when given), dy and the weight. The residual's
// pack comes from registers (res_raw, loaded with the row's other packs) when res_early, else from memory.
// WREG: the weight pack comes from registers (w_reg, loaded once before the row loop), else from memory.
template <typename T, typename W, bool WREG>
__device__ __forceinline__ void row_values(const uint4& s_raw, const uint4& dy_raw, const T* __restrict__ res,
                                           const uint4& res_raw, bool res_early, const W* __restrict__ w,
                                           const float* w_reg, int64_t base, int col, bool has_res, bool has_w,
                                           float* sv, float* d, float* wv, bool drop_x, uint32_t drop_bits,
                                           float drop_scale) {
  constexpr int P = Pack<T>::n;
  unpack<T>(s_raw, sv);
  unpack<T>(dy_raw, d);
  if (drop_x) {  // post-LN with dropout: s_raw is x, s = dropout(x) + residual (bit j: element j kept)
#pragma unroll
    for (int j = 0; j < P; ++j) sv[j] = (drop_bits >> j) & 1u ? sv[j] * drop_scale : 0.f;
  }
  if (has_res) {
    float r[P];
    if (res_early) unpack<T>(res_raw, r);
    else load_pack(res + base + col, r);
#pragma unroll
    for (int j = 0; j < P; ++j) sv[j] += r[j];
  }
  if constexpr (WREG) {
#pragma unroll
    for (int j = 0; j < P; ++j) wv[j] = w_reg[j];
  } else if (has_w) {
    load_packs<W, P>(w + col, wv);
  } else {
#pragma unroll
    for (int j = 0; j < P; ++j) wv[j] = 1.f;
  }
}

// dst[col] and dst[db_offset + col] = (ADD: +=) this thread's dweight and dbias sums over its columns
template <bool ADD, int VPL, int P, int RT>
__device__ __forceinline__ void put_sums(float* dst, int64_t db_offset, const float (&dw)[VPL][P],
                                         const float (&db)[VPL][P], int lane, int N) {
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int col = (i * RT + lane) * P;
    if (col < N) {
#pragma unroll
      for (int j = 0; j < P; ++j) {
        if constexpr (ADD) {
          dst[col + j] += dw[i][j];
          dst[db_offset + col + j] += db[i][j];
        } else {
          dst[col + j] = dw[i][j];
          dst[db_offset + col + j] = db[i][j];
        }
      }
    }
  }
}

// PF: the next row's raw loads are issued before this row's math (block rows of at most 2 packs per
// thread, where a block has a single row in flight otherwise, and rows of two warps with 2 packs a thread: 128
// registers and no spill without dropout, where Triton's prefetching programs kept more warps ready than ours, ncu
// run264; run266: 39.7 -> 34.4 us at 16384 x 768, with dropout 52.1 -> 48.5). kEarly: the row's third input, the
// gradient through s (pre-LN) or the residual (post-LN, which recomputes s = x + residual), is loaded with s and dy
// before any math (where the registers allow it, and always with dropout); else each pack of it is loaded where it
// is used, and the branch around each pack (col < N) kept ptxas from hoisting those loads: a row waited for
// memory once for s and dy, then once a pack (the residual in the first pass, ds in the second).
template <typename T, int VPL, int RT>
constexpr bool kPrefetchable = (RT == kThreads || RT == 64) && VPL <= 2;

// At most 128 registers (two blocks per SM), except where 128 would spill hundreds of bytes: fp32 rows of
// 32 elements per lane, and with dropout (Philox's registers on top) more than 16 elements per thread
// (fp16 / bf16 block rows of 3-4 packs a thread, N > 4096); those take one block per SM. (fp16/bf16 block rows of
// 4 packs per thread, N = 8192, spill 36 bytes: kept, for twice the warps in flight.)
template <typename T, int VPL, int RT, bool DROP>
constexpr int kBwdMinBlocks = ((sizeof(T) == 4 && VPL > 6) || (DROP && VPL * Pack<T>::n > 16)) ? 1 : 2;

// FM (fp16 / bf16 rows; bwd_fma_enabled): the row's math in fused multiply-adds with per-row constants. First pass:
// xhat = s rstd + (-mean rstd), one FFMA where (s - mean) rstd takes an add and a multiply. Second pass:
// ds = rstd (dy w + s a + c), a = -rstd mean(g xhat), c = rstd mean mean(g xhat) - mean(g): two FFMAs and a multiply (an
// FFMA with the gradient through s), where rstd (dy w - mean(g) - xhat mean(g xhat)) took xhat's two, two FFMAs and a
// multiply (and an add). The rows' math is most of the kernel's instructions (ncu run371: it issues on 53-59% of a
// scheduler's cycles and is latency-bound at 16 warps an SM). fp32 differences: c carries mean a with one rounding,
// 2^-24 |mean| / std relative to ds, below fp16 / bf16 rounding for any |mean| / std < 2^10. H200 run376: 0.01-1.06 us a
// call faster without dropout, 0.8-3.3 with. Other layouts of the backward, each slower on the GPU (run372-375; the
// README's LayerNorm section): rows of three / four warps at one pack a thread; rows copied into shared-memory stages
// by cp.async.bulk for consumer warps; rows taken from a global counter rather than a fixed stride.
// ln_bwd_kernel's dweight / dbias block sums (dwb_mode; RT < kThreads): none (neither parameter needs them), each row
// group's into its own slot of [kRows][2][N] at once (16-byte stores) and the block's threads summing the slots by
// column (kDwbSlots, the default), or the row groups adding theirs into one [2][N] buffer one group after another
// (kDwbTurns, PYKERNELS_LN_BWD_SLOTS=0: a barrier a group, and a warp's 8 adjacent columns a thread hit 4 banks, an
// 8-way conflict on every load and store). Both add in slot order from 0: the same bits. The turns were most of the
// backward's fixed cost: ln_bwd_sweep.py --graph (H200 run383-384) fits the backward alone as 8.5-9.2 us + rows at
// copy bandwidth with dweight / dbias, 0.8-1.7 us + the same without; with the slots 4.3-5.3 us. pdl_ab.py (run384):
// the backward 3.4-3.8 us faster a call at 16384 rows (pre 16384 x 768 34.65 -> 31.1 us), 3.4-3.7 at pre 65536 x 768,
// 2.1-3.5 with dropout. Block rows (N > 1024, RT = kThreads) write their partials straight from registers (thread-major
// under the slots: below). (The slots' final loop and the turns' copy loop written as one loop, a branch in it: ptxas
// then spilled 28-36 bytes in the prefetching two-warp rows, the 16384 x 768 shapes' kernels; two loops kept.)
enum DwbMode : int { kDwbNone = 0, kDwbTurns = 1, kDwbSlots = 2 };
constexpr size_t kDwbSlotBytes = 32 * 1024;  // kRows x 2 x N floats: 4 x 2 x 1024 (two-warp rows), 8 x 2 x 512 (warp)
template <typename T, typename W, int VPL, int RT, bool PF, bool DROP, bool FM = false>
__global__ void __launch_bounds__(kThreads, (kBwdMinBlocks<T, VPL, RT, DROP>)) ln_bwd_kernel(
    const T* __restrict__ dy, const T* __restrict__ ds_out, const T* __restrict__ a, const T* __restrict__ res,
    const W* __restrict__ w, const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx,
    T* __restrict__ dres, float* __restrict__ partial, int64_t M, int N, bool has_ds, bool has_res, bool has_w,
    int dwb_mode, bool rms, bool recompute, const int64_t* __restrict__ seed_ptr, float drop_p, float drop_scale) {
  pdl_enter();  // (launch_pdl: pdl.cuh)
  constexpr int P = Pack<T>::n;
  static_assert(!FM || sizeof(T) == 2, "the fused row math is for fp16 / bf16 rows");
  constexpr bool kEarly = DROP || !(sizeof(T) == 2 && VPL >= 4);  // (fp16 / bf16 block rows of 4 packs spill)
  static_assert(!PF || (kPrefetchable<T, VPL, RT> && (!DROP || RT == 64)),
                "prefetch is for rows of at most 2 packs a thread (with dropout: rows of two warps)");
  // dweight, dbias block sums (RT < kThreads): [2][N] (kDwbTurns), [kRows][2][N] (kDwbSlots)
  extern __shared__ __align__(16) float smem[];
  constexpr int kRows = kThreads / RT;  // rows a block works on at a time
  drop_seed_init(DROP, seed_ptr);  // (the dropout seed into shared memory, read at each use: philox.cuh)
  const int lane = threadIdx.x % RT;
  float dw[VPL][P], db[VPL][P];
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
#pragma unroll
    for (int j = 0; j < P; ++j) dw[i][j] = db[i][j] = 0.f;
  }
  // kWReg: a thread's columns are the same in every row it visits, so where the registers allow (at most 16 elements
  // a thread) it loads their weights once, here, as fp32; else each pass of each row loads them again, one pack at a
  // time behind the pack's branch, and the streaming row data can evict them from L1 in between
  constexpr bool kWReg = VPL * P <= 16;
  float wr[kWReg ? VPL : 1][P];
  if constexpr (kWReg) {
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int col = (i * RT + lane) * P;
#pragma unroll
      for (int j = 0; j < P; ++j) wr[i][j] = 1.f;
      if (has_w && col < N) load_packs<W, P>(w + col, wr[i]);
    }
  }
  const float inv_n = 1.f / static_cast<float>(N);
  // a thread's share of one row as raw 16-byte packs (4 registers each, not 2 * P fp32 values): s (or x),
  // dy and, when kEarly, the third input t: the gradient arriving through s (has_ds: pre-LN) or else the
  // residual (post-LN; the two never come together from the ops, and a residual beside ds is read late);
  // plus the row's statistics
  struct Raw {
    uint4 s[VPL], dy[VPL], t[VPL];
    float mu, rs;
  };
  const bool res_early = kEarly && has_res && !has_ds;
  const auto load_raw = [&](int64_t r, Raw& o) {
    const int64_t base = r * N;
    o.mu = rms ? 0.f : mean[r];
    o.rs = rstd[r];
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int col = (i * RT + lane) * P;
      if (col < N) {
        o.s[i] = *reinterpret_cast<const uint4*>(a + base + col);
        o.dy[i] = *reinterpret_cast<const uint4*>(dy + base + col);
        if (kEarly && has_ds) o.t[i] = *reinterpret_cast<const uint4*>(ds_out + base + col);
        else if (res_early) o.t[i] = *reinterpret_cast<const uint4*>(res + base + col);
      }
    }
  };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRows;
  int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / RT;
  Raw cur, nxt;
  if (PF && row < M) load_raw(row, nxt);
  // (RT = kThreads: every thread of a block takes the same rows, so the block-wide sums are uniform)
  for (; row < M; row += stride) {
    if constexpr (PF) {
      cur = nxt;
      if (row + stride < M) load_raw(row + stride, nxt);  // in flight during this row's math
    } else {
      load_raw(row, cur);
    }
    const int64_t base = row * N;
    const float mu = cur.mu, rs = cur.rs;
    const float nmr = -mu * rs;  // (FM)
    uint32_t kept = 0xffffffffu;  // dropout keep bits of the thread's VPL * P (<= 32) elements of the row
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int col = (i * RT + lane) * P;
      if (col < N) {
        if constexpr (DROP) {
          const uint32_t kb = keep_bits<P>(drop_seed(), row, N, col, drop_p);
          kept &= ~((~kb & ((1u << P) - 1u)) << (i * P));
        }
        float sv[P], d[P], wv[P];
        row_values<T, W, kWReg>(cur.s[i], cur.dy[i], res, cur.t[i], res_early, w, wr[kWReg ? i : 0], base, col,
                                has_res, has_w, sv, d, wv, DROP && recompute, kept >> (i * P), drop_scale);
#pragma unroll
        for (int j = 0; j < P; ++j) {
          const float xh = FM ? fmaf(sv[j], rs, nmr) : (sv[j] - mu) * rs;
          const float g = d[j] * wv[j];
          sg += g;
          sgx += g * xh;
          dw[i][j] += d[j] * xh;
          db[i][j] += d[j];
        }
      }
    }
    row_sum2<RT>(sg, sgx);  // one reduction for both sums
    const float mg = rms ? 0.f : sg * inv_n;
    const float mgx = sgx * inv_n;
    const float fa = -rs * mgx, fc = rs * mgx * mu - mg;  // (FM)
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int col = (i * RT + lane) * P;
      if (col < N) {
        float sv[P], d[P], wv[P], o[P], extra[P];
        row_values<T, W, kWReg>(cur.s[i], cur.dy[i], res, cur.t[i], res_early, w, wr[kWReg ? i : 0], base, col,
                                has_res, has_w, sv, d, wv, DROP && recompute, kept >> (i * P), drop_scale);
        if (has_ds) {
          if constexpr (kEarly) unpack<T>(cur.t[i], extra);
          else load_pack(ds_out + base + col, extra);
        }
#pragma unroll
        for (int j = 0; j < P; ++j) {
          if constexpr (FM) {
            const float inner = fmaf(d[j], wv[j], fmaf(sv[j], fa, fc));
            o[j] = has_ds ? fmaf(rs, inner, extra[j]) : rs * inner;
          } else {
            const float xh = (sv[j] - mu) * rs;
            o[j] = rs * (d[j] * wv[j] - mg - xh * mgx);
            if (has_ds) o[j] += extra[j];
          }
        }
        if constexpr (DROP) {  // dresidual = ds; dx = dropout's backward of ds
          store_pack(dres + base + col, o);
#pragma unroll
          for (int j = 0; j < P; ++j) o[j] = (kept >> (i * P + j)) & 1u ? o[j] * drop_scale : 0.f;
        }
        store_pack(dx + base + col, o);
      }
    }
  }
  if (dwb_mode == kDwbNone) return;
  if constexpr (RT == kThreads) {  // the block's threads own disjoint columns: their sums are the block's
    // Under the slots: thread-major rows of VPL P RT floats, a warp's store 128 contiguous bytes. (H200 run386, the
    // column order's 8 scalar stores of adjacent columns a thread against these: the backward at pre 8192 x 4096 88.0
    // -> 71.4 us in pdl_ab.py; ln_bwd_sweep.py --graph's fixed cost at N = 4096 27.3 -> 8.1 us, 2.3 without dw / db.)
    if (dwb_mode == kDwbSlots) {
      constexpr int kLen = VPL * P * RT;
      float* dst = partial + static_cast<int64_t>(blockIdx.x) * kLen;
      const int64_t dbo = static_cast<int64_t>(gridDim.x) * kLen;
#pragma unroll
      for (int i = 0; i < VPL; ++i) {
        if ((i * RT + lane) * P < N) {
#pragma unroll
          for (int j = 0; j < P; ++j) {
            dst[(i * P + j) * RT + lane] = dw[i][j];
            dst[dbo + (i * P + j) * RT + lane] = db[i][j];
          }
        }
      }
      return;
    }
    put_sums<false, VPL, P, RT>(partial + static_cast<int64_t>(blockIdx.x) * N,  // (column order: a warp's store
                                static_cast<int64_t>(gridDim.x) * N, dw, db, lane, N);  // 32 sectors, 4 B each)
    return;
  }
  if (dwb_mode == kDwbSlots) {  // each row group its own slot at once, then the block's sums over them in slot order
    float* slot = smem + (threadIdx.x / RT) * 2 * N;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int col = (i * RT + lane) * P;
      if (col < N) {
#pragma unroll
        for (int q = 0; q < P / 4; ++q) {
          *reinterpret_cast<float4*>(slot + col + 4 * q) =
              make_float4(dw[i][4 * q], dw[i][4 * q + 1], dw[i][4 * q + 2], dw[i][4 * q + 3]);
          *reinterpret_cast<float4*>(slot + N + col + 4 * q) =
              make_float4(db[i][4 * q], db[i][4 * q + 1], db[i][4 * q + 2], db[i][4 * q + 3]);
        }
      }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < 2 * N; c += kThreads) {
      float t = 0.f;  // (0 + slot 0 + slot 1 ...: the turns' order, so the same bits)
#pragma unroll
      for (int g = 0; g < kRows; ++g) t += smem[g * 2 * N + c];
      const int which = c / N, col = c - which * N;
      partial[(static_cast<int64_t>(which) * gridDim.x + blockIdx.x) * N + col] = t;
    }
    return;
  }
  for (int c = threadIdx.x; c < 2 * N; c += kThreads) smem[c] = 0.f;
  // the block's row groups (a warp or a pair of warps each) add their sums one after the other (fixed
  // order: bitwise reproducible)
  for (int turn = 0; turn < kRows; ++turn) {
    __syncthreads();
    if (static_cast<int>(threadIdx.x) / RT == turn) put_sums<true, VPL, P, RT>(smem, N, dw, db, lane, N);
  }
  __syncthreads();
  // partial: [2][gridDim.x][N]
  for (int c = threadIdx.x; c < 2 * N; c += kThreads) {
    const int which = c / N, col = c - which * N;
    partial[(static_cast<int64_t>(which) * gridDim.x + blockIdx.x) * N + col] = smem[c];
  }
}

// resident blocks per SM of a backward instantiation at the largest shared memory it takes (``slots``: kDwbSlots'
// kRows x 2 x N floats, at most 32 KB; else 2 x 1024 floats), queried once each (the persistent grid fills the GPU once)
template <typename T, typename W, int VPL, int RT, bool PF, bool DROP, bool FM>
int bwd_blocks_per_sm(bool slots) {
  const auto query = [](size_t bytes) {
    int k = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&k, ln_bwd_kernel<T, W, VPL, RT, PF, DROP, FM>, kThreads,
                                                                 bytes));
    return std::max(k, 1);
  };
  static const int turns = query(2 * 1024 * sizeof(float)), with_slots = query(kDwbSlotBytes);
  return slots ? with_slots : turns;
}

// out[k][col] = sum_p partial[k][p][col], cast to T (the parameters' type): the backward's last step, after its last
// block. A block sums 32 columns over kSumGroups row groups, a thread 4 adjacent columns (a 16-byte load a row: N is a
// multiple of 4) of every kSumGroups-th partial row, kSumUnroll rows' loads issued before any of their adds (rows past
// progs load the last row again, unconditionally: behind a bound, ptxas issued them one at a time), so that the
// 2 x progs x N partials (264 x 768 x 2 floats at two blocks an SM on 132 SMs) take one round of L2 latency; then the
// groups' sums in shared memory, in a fixed order (bitwise reproducible). (The minimum of 2 blocks an SM lets ptxas
// take the 54 registers that the loads in flight need; at its default 32 it interleaved them with the adds, 3 at a
// time.) The kernel before it (8 row groups of 32 columns, a float a thread: a round of latency every few rows) took
// the backward 0.3-1.6 us longer a call on every shape of benchmarks/layer_norm.py (H200 run381, pdl_ab.py: pre 16384
// x 768 35.4-35.5 -> 34.7-34.8 us, pre 16384 x 1024 43.7-43.8 -> 42.7-43.0, post 16384 x 1024 43.8-43.9 -> 42.7-43.0).
// A partial row holds ``len`` floats: the columns in order (``rt`` = 0), or the block rows' thread-major order
// (ln_bwd_kernel's kDwbSlots at RT = kThreads: position (i P + j) rt + t holds column (i rt + t) P + j of thread t's
// pack i, P = ``pk``), whose positions past N hold nothing (summed, never written out). (H200 run386: loads past
// progs spread over each row group's own first row instead of all re-reading the last one: the same time, +-0.3 us.)
__device__ __forceinline__ int partial_col(int pos, int rt, int pk) {
  if (rt == 0) return pos;
  const int q = pos / rt, t = pos - q * rt;
  return ((q / pk) * rt + t) * pk + q % pk;
}
constexpr int kSumGroups = 64, kSumUnroll = 8, kSumThreads = 8 * kSumGroups;
template <typename T>
__global__ void __launch_bounds__(kSumThreads, 2) ln_partial_sum_kernel(const float* __restrict__ partial,
                                                                         T* __restrict__ dw, T* __restrict__ db,
                                                                         int progs, int N, int len, int rt, int pk) {
  pdl_enter();  // (launch_pdl: pdl.cuh)
  __shared__ float buf[kSumGroups][33];
  const int cx = threadIdx.x & 7, ry = threadIdx.x >> 3;
  const int col = blockIdx.x * 32 + cx * 4;  // (a position of the partial rows: a column where rt = 0)
  const int which = blockIdx.y;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (col < len) {
    const float* p = partial + static_cast<int64_t>(which) * progs * len + col;
    for (int r0 = ry; r0 < progs; r0 += kSumGroups * kSumUnroll) {
      float4 v[kSumUnroll];
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u)
        v[u] = __ldcg(
            reinterpret_cast<const float4*>(p + static_cast<int64_t>(min(r0 + u * kSumGroups, progs - 1)) * len));
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) {
        if (r0 + u * kSumGroups < progs) {
          acc.x += v[u].x;
          acc.y += v[u].y;
          acc.z += v[u].z;
          acc.w += v[u].w;
        }
      }
    }
  }
  buf[ry][cx * 4] = acc.x;
  buf[ry][cx * 4 + 1] = acc.y;
  buf[ry][cx * 4 + 2] = acc.z;
  buf[ry][cx * 4 + 3] = acc.w;
  __syncthreads();
  constexpr int kParts = 8, kPer = kSumGroups / kParts;  // column c's groups in 8 parts of 8, then the parts
  const int c = threadIdx.x & 31, part = threadIdx.x >> 5;
  if (part < kParts) {
    float t = 0.f;
#pragma unroll
    for (int g = 0; g < kPer; ++g) t += buf[part * kPer + g][c];
    buf[part * kPer][c] = t;  // (only this thread reads or writes rows part * kPer .. + kPer - 1 of column c)
  }
  __syncthreads();
  const int pos = blockIdx.x * 32 + threadIdx.x;
  const int out = pos < len ? partial_col(pos, rt, pk) : N;
  if (threadIdx.x < 32 && out < N) {
    float t = 0.f;
#pragma unroll
    for (int q = 0; q < kParts; ++q) t += buf[q * kPer][threadIdx.x];
    (which == 0 ? dw : db)[out] = from_f<T>(t);
  }
}

// f(VPL, RT) for the forward: rows of up to 32 elements per lane (N <= 1024) are one warp's (RT = 32, 1..4 packs per
// lane for fp16/bf16, 1..8 for fp32); wider rows are one block's (RT = 256, 1..4 packs per thread:
// N <= 8192 fp16/bf16, <= 4096 fp32).
// whether a forward row of N elements is one warp's (else one block's): dispatch_shape and the forward's
// grid agree on it (the backward's rows: bwd_row_threads)
constexpr bool warp_rows(int N) { return N <= 32 * kMaxElemsPerLane; }

template <typename T, typename F>
void dispatch_shape(int N, F&& f) {
  using W = std::integral_constant<int, 32>;
  using B = std::integral_constant<int, kThreads>;
  const int packs = N / Pack<T>::n;
  if (warp_rows(N)) {
    const int vpl = (packs + 31) / 32;
    if (vpl <= 1) f(std::integral_constant<int, 1>{}, W{});
    else if (vpl <= 2) f(std::integral_constant<int, 2>{}, W{});
    else if (vpl <= 3) f(std::integral_constant<int, 3>{}, W{});
    else if (vpl <= 4 || sizeof(T) == 2) f(std::integral_constant<int, 4>{}, W{});
    else if constexpr (sizeof(T) == 4) {
      if (vpl <= 6) f(std::integral_constant<int, 6>{}, W{});
      else f(std::integral_constant<int, 8>{}, W{});
    }
  } else {
    const int vpl = (packs + kThreads - 1) / kThreads;
    if (vpl <= 1) f(std::integral_constant<int, 1>{}, B{});
    else if (vpl <= 2) f(std::integral_constant<int, 2>{}, B{});
    else if (vpl <= 3) f(std::integral_constant<int, 3>{}, B{});
    else f(std::integral_constant<int, 4>{}, B{});
  }
}

// The backward's rows: one warp's up to 64 packs per row fp16/bf16 (N <= 512: <= 2 packs per lane) or 96 fp32
// (N <= 384: <= 3 packs), two warps' up to N = 1024 (2..4 packs per thread: at N = 1024 fp16/bf16 one warp
// would hold 32 elements per lane and spill at 128 registers), one block's beyond. The forward keeps warp_rows.
// fp16 / bf16 rows of 65..96 packs (N = 768) take two warps (2 packs a thread, a quarter of them idle in the second)
// rather than one warp with 3 packs a lane: the backward is latency-bound there (ncu, run260: 0.45 instructions issued
// a cycle per scheduler from 3.9 warps, 25% occupancy at 128 registers), and two warps a row took it from 35.3 to 30.2
// us at GPT-2's bf16 pre-LN with dropout, 28.9 to 24.1 without, 56.4 to 55.3 and 43.9 to 42.5 at BERT's post-LN
// (H200, run260).
template <typename T>
int bwd_row_threads(int N) {
  const int packs = N / Pack<T>::n;
  if (packs <= (sizeof(T) == 2 ? 64 : 96)) return 32;
  return warp_rows(N) ? 64 : kThreads;
}

// f(VPL, RT) for the backward (bwd_row_threads)
template <typename T, typename F>
void dispatch_bwd_shape(int N, F&& f) {
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I3 = std::integral_constant<int, 3>;
  using I4 = std::integral_constant<int, 4>;
  const int rt = bwd_row_threads<T>(N);
  const int vpl = (N / Pack<T>::n + rt - 1) / rt;
  if (rt == 32) {
    using W = std::integral_constant<int, 32>;
    if (vpl <= 1) f(I1{}, W{});
    else if (vpl <= 2) f(I2{}, W{});
    else if constexpr (sizeof(T) == 4) f(I3{}, W{});  // (fp16 / bf16 warp rows have at most 2 packs a lane)
  } else if (rt == 64) {  // (fp16/bf16: 65..128 packs, always 2 per thread)
    using W2 = std::integral_constant<int, 64>;
    if (sizeof(T) == 2 || vpl <= 2) f(I2{}, W2{});
    else if constexpr (sizeof(T) == 4) {
      if (vpl <= 3) f(I3{}, W2{});
      else f(I4{}, W2{});
    }
  } else {  // (fp32: more than 256 packs, at least 2 per thread)
    using B = std::integral_constant<int, kThreads>;
    if (sizeof(T) == 2 && vpl <= 1) {
      if constexpr (sizeof(T) == 2) f(I1{}, B{});
    } else if (vpl <= 2) f(I2{}, B{});
    else if (vpl <= 3) f(I3{}, B{});
    else f(I4{}, B{});
  }
}

// PYKERNELS_LN_PREFETCH=0 turns the backward's next-row prefetch off (read once; for measurements)
bool prefetch_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("PYKERNELS_LN_PREFETCH");
    return e == nullptr || std::string(e) != "0";
  }();
  return on;
}

// PYKERNELS_LN_FWD_PERSIST=0 turns the forward's persistent walk (kFwdPersistable) off: every shape then
// takes the one-row-a-warp grid (read once; for A/B measurements in one build)
bool fwd_persist_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("PYKERNELS_LN_FWD_PERSIST");
    return e == nullptr || std::string(e) != "0";
  }();
  return on;
}

// resident blocks per SM of a persistent forward instantiation (no shared memory), queried once: its grid fills the
// GPU once
template <typename T, typename W, int VPL, int RT, bool DROP>
int fwd_blocks_per_sm() {
  static const int n = [] {
    int k = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&k, ln_fwd_persist_kernel<T, W, VPL, RT, DROP>,
                                                                 kThreads, 0));
    return std::max(k, 1);
  }();
  return n;
}

// f(PF, DROP): DROP = dropout; PF = whether the backward of this row shape prefetches the next row
// (with dropout only for two-warp rows: elsewhere the Philox registers leave no room for a second row)
template <typename T, int VPL, int RT, typename F>
void dispatch_variant(bool dropout, F&& f) {
  // (prefetching with dropout on one block an SM, warp rows of 3 packs: 56.4 -> 63.2 us, run260; two-warp rows of 2
  // packs prefetch at 128 registers with 16-20 bytes of spill, a few local loads and stores a row)
  if (dropout) {
    if constexpr (kPrefetchable<T, VPL, RT> && RT == 64) {
      if (prefetch_enabled()) {
        f(std::true_type{}, std::true_type{});
        return;
      }
    }
    f(std::false_type{}, std::true_type{});
    return;
  }
  if constexpr (kPrefetchable<T, VPL, RT>) {
    if (prefetch_enabled()) {
      f(std::true_type{}, std::false_type{});
      return;
    }
  }
  f(std::false_type{}, std::false_type{});
}

int sm_count(int device) {
  static int cached[64] = {0};
  if (device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cached[device] = n;
  }
  return cached[device];
}

// t itself when contiguous with a 16-byte aligned start (the kernels' vector loads need both), else a copy
Tensor dense(const Tensor& t) {
  if (t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

int pack_of(at::ScalarType st) { return st == at::kFloat ? 4 : 8; }

void check_row_tensor(const char* name, const Tensor& t, const Tensor& x, bool param) {
  TORCH_CHECK(t.is_cuda() && t.device() == x.device(), "pykernels_cuda.layer_norm: ", name,
              " must be on x's device ", x.device());
  TORCH_CHECK(t.dtype() == x.dtype() || (param && t.scalar_type() == at::kFloat), "pykernels_cuda.layer_norm: ",
              name, " must have x's dtype ", x.dtype(), param ? " or float32" : "", ", got ", t.dtype());
}

// The weight's and bias's dtype: x's or float32 (autocast's fp32 parameters beside bf16 / fp16 rows), one for both.
at::ScalarType param_dtype(const Tensor& x, const optional<Tensor>& w, const optional<Tensor>& b) {
  if (w.has_value() && b.has_value())
    TORCH_CHECK(w->dtype() == b->dtype(), "pykernels_cuda.layer_norm: bias must have weight's dtype ", w->dtype(),
                ", got ", b->dtype());
  return w.has_value() ? w->scalar_type() : b.has_value() ? b->scalar_type() : x.scalar_type();
}

void check_inputs(const Tensor& x, const optional<Tensor>& w, const optional<Tensor>& b,
                  const optional<Tensor>& r) {
  TORCH_CHECK(x.is_cuda(), "pykernels_cuda.layer_norm: x must be a CUDA tensor");
  TORCH_CHECK(x.dim() == 2, "pykernels_cuda.layer_norm: x must be 2-D (M, N), got ", x.dim(), " dims");
  const int64_t n = x.size(1);
  const int p = pack_of(x.scalar_type());
  const int max_n = p == 8 ? kMaxN16 : kMaxN32;
  TORCH_CHECK(n > 0 && n % p == 0 && n <= max_n, "pykernels_cuda.layer_norm: N must be a positive multiple of ",
              p, " up to ", max_n, " for ", x.dtype(), ", got ", n);
  if (w.has_value()) {
    check_row_tensor("weight", *w, x, true);
    TORCH_CHECK(w->dim() == 1 && w->size(0) == n, "pykernels_cuda.layer_norm: weight must have shape (", n, ",)");
  }
  if (b.has_value()) {
    check_row_tensor("bias", *b, x, true);
    TORCH_CHECK(b->dim() == 1 && b->size(0) == n, "pykernels_cuda.layer_norm: bias must have shape (", n, ",)");
  }
  param_dtype(x, w, b);
  if (r.has_value()) {
    check_row_tensor("residual", *r, x, false);
    TORCH_CHECK(r->sizes() == x.sizes(), "pykernels_cuda.layer_norm: residual must have x's shape");
  }
}

// f(T, W): the row's element type (x's dtype) and the parameters' (``pdt``: T's own or float)
template <typename F>
void dispatch_types(at::ScalarType xdt, at::ScalarType pdt, F&& f) {
  dispatch_float_dtype(xdt, "pykernels_cuda.layer_norm: x", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      f(T{}, float{});
    } else {
      if (pdt == at::kFloat) f(T{}, float{});
      else f(T{}, T{});
    }
  });
}

// -> y, s (pre-LN; else empty), mean (LayerNorm; else empty), rstd, and the dense x and residual the
// kernel read (saved for the post-LN backward)
std::vector<Tensor> forward_impl(const Tensor& x_in, const optional<Tensor>& w_in, const optional<Tensor>& b_in,
                                 const optional<Tensor>& r_in, double eps, double dropout_p,
                                 const optional<Tensor>& seed, bool prenorm, bool rms) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "pykernels_cuda.layer_norm: dropout_p must be in [0, 1), got ",
              dropout_p);
  check_inputs(x_in, w_in, b_in, r_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = dense(x_in);
  const Tensor r = r_in.has_value() ? dense(*r_in) : Tensor();
  const Tensor w = w_in.has_value() ? dense(*w_in) : Tensor();
  const Tensor b = b_in.has_value() ? dense(*b_in) : Tensor();
  const int64_t M = x.size(0);
  const int N = static_cast<int>(x.size(1));
  auto f32 = x.options().dtype(at::kFloat);
  Tensor y = poisoned(at::empty_like(x));
  Tensor s = prenorm ? poisoned(at::empty_like(x)) : at::empty({0}, x.options());
  Tensor mean = at::empty({rms ? 0 : M}, f32);
  Tensor rstd = at::empty({M}, f32);
  if (M == 0) return {y, s, mean, rstd, x, r};
  const int64_t rows_per_block = warp_rows(N) ? kWarps : 1;
  const auto blocks = static_cast<unsigned>((M + rows_per_block - 1) / rows_per_block);
  TORCH_CHECK(blocks < (1u << 31), "pykernels_cuda.layer_norm: too many rows");
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_types(x.scalar_type(), param_dtype(x, w_in, b_in), [&](auto tag, auto wtag) {
    using T = decltype(tag);
    using W = decltype(wtag);
    dispatch_shape<T>(N, [&](auto v, auto rt) {
     constexpr int kV = decltype(v)::value, kRT = decltype(rt)::value;
     // mode: kOneRow (ln_fwd_kernel), kPersist (ln_fwd_persist_kernel) or kRows (ln_fwd_rows_kernel)
     const auto launch = [&](auto drop, auto mode) {
      constexpr bool kDrop = decltype(drop)::value;
      constexpr int kMode = decltype(mode)::value;
      unsigned grid = blocks, threads = kThreads;
      if constexpr (kMode == kPersist) {
        const int64_t cap = static_cast<int64_t>(fwd_blocks_per_sm<T, W, kV, kRT, kDrop>()) * sm_count(x.get_device());
        grid = static_cast<unsigned>(std::min<int64_t>(blocks, cap));
      } else if constexpr (kMode == kRows) {
        TORCH_CHECK((M + kRowWarps - 1) / kRowWarps < (int64_t{1} << 31), "pykernels_cuda.layer_norm: too many rows");
        grid = static_cast<unsigned>((M + kRowWarps - 1) / kRowWarps);
        threads = kRowWarps * 32;
      }
      const auto kernel = [&] {
        if constexpr (kMode == kPersist) return ln_fwd_persist_kernel<T, W, kV, kRT, kDrop>;
        else if constexpr (kMode == kRows) return ln_fwd_rows_kernel<T, W, kV, kDrop>;
        else return ln_fwd_kernel<T, W, kV, kRT, kDrop>;
      }();
      launch_pdl(kernel, dim3(grid), dim3(threads), 0, stream,
          static_cast<const T*>(x.data_ptr()), r.defined() ? static_cast<const T*>(r.data_ptr()) : nullptr,
          w.defined() ? static_cast<const W*>(w.data_ptr()) : nullptr,
          b.defined() ? static_cast<const W*>(b.data_ptr()) : nullptr, static_cast<T*>(y.data_ptr()),
          prenorm ? static_cast<T*>(s.data_ptr()) : nullptr, rms ? nullptr : mean.data_ptr<float>(),
          rstd.data_ptr<float>(), M, N, static_cast<float>(eps), r.defined(), w.defined(), b.defined(), prenorm,
          rms, seed_ptr(dropout_p, seed, x, "pykernels_cuda.layer_norm"), static_cast<float>(dropout_rate(dropout_p)),
          dropout_p > 0.0 ? static_cast<float>(1.0 / (1.0 - dropout_rate(dropout_p))) : 1.f);
     };
     const auto pick = [&](auto drop) {
      if constexpr (kRT == 32 && kFwdRowsable<T, kV>) {
        if (fwd_rows_enabled()) {
          launch(drop, std::integral_constant<int, kRows>{});
          return;
        }
      }
      if constexpr (kFwdPersistable<T, kV, kRT>) {
        if (fwd_persist_enabled()) {
          launch(drop, std::integral_constant<int, kPersist>{});
          return;
        }
      }
      launch(drop, std::integral_constant<int, kOneRow>{});
     };
     if (dropout_p > 0.0) pick(std::true_type{});
     else pick(std::false_type{});
    });
  });
  return {y, s, mean, rstd, x, r};
}

// PYKERNELS_LN_BWD_FMA=0: the fp16 / bf16 backward without the fused row math (ln_bwd_kernel's FM; read at every
// call, for A/B runs)
inline bool bwd_fma_enabled() {
  const char* e = std::getenv("PYKERNELS_LN_BWD_FMA");
  return e == nullptr || std::string(e) != "0";
}

// PYKERNELS_LN_BWD_SLOTS=0: the backward's dweight / dbias block sums in turns (kDwbTurns; A/B runs and tests, read at
// each call); default: in slots (kDwbSlots)
inline bool bwd_slots_enabled() {
  const char* e = std::getenv("PYKERNELS_LN_BWD_SLOTS");
  return e == nullptr || e[0] != '0';
}

// -> dx, dweight (or undefined), dbias (or undefined), dresidual (dx itself without dropout). ``a`` is the
// saved s (pre-LN) or x (post-LN, ``recompute``: s = dropout(x) + residual again); ``pdt`` the parameters' dtype
// (that of dweight and dbias); ``want_dwb`` false: neither parameter needs a gradient (frozen), so the row sums
// for dweight / dbias, their buffer and the kernel that reduces it are skipped (both undefined then).
std::vector<Tensor> backward_impl(const Tensor& dy_in, const Tensor& ds_in, const Tensor& a_in, const Tensor& res_in,
                                  const Tensor& w_in, bool has_b, at::ScalarType pdt, const Tensor& mean,
                                  const Tensor& rstd, bool rms, bool recompute, double dropout_p,
                                  const optional<Tensor>& seed, bool want_dwb) {
  const c10::cuda::CUDAGuard guard(a_in.device());
  const Tensor a = dense(a_in);
  const Tensor res = res_in.defined() ? dense(res_in) : Tensor();
  const Tensor w = w_in.defined() ? dense(w_in) : Tensor();
  const Tensor dy = dense(dy_in);
  const Tensor ds = ds_in.defined() ? dense(ds_in) : Tensor();
  const int64_t M = a.size(0);
  const int N = static_cast<int>(a.size(1));
  Tensor dx = poisoned(at::empty_like(a));
  const bool dropout = dropout_p > 0.0;
  Tensor dres = dropout ? poisoned(at::empty_like(a)) : dx;
  const bool need = want_dwb && (w.defined() || has_b);
  const int sms = sm_count(a.get_device());
  int rt_threads = kThreads;
  dispatch_float_dtype(a.scalar_type(), "pykernels_cuda.layer_norm: x", [&](auto tag) { rt_threads = bwd_row_threads<decltype(tag)>(N); });
  const int64_t rows_per_block = kThreads / rt_threads;
  const int64_t want = (M + rows_per_block - 1) / rows_per_block;
  const bool slots = bwd_slots_enabled();
  const size_t smem = need && rt_threads < kThreads ? (slots ? rows_per_block : 1) * 2 * N * sizeof(float) : 0;
  int per_sm = 1;
  int len = N, layout_rt = 0, layout_p = 1;  // the partial rows' length and order (ln_partial_sum_kernel)
  const bool fma = a.element_size() == 2 && bwd_fma_enabled();  // (ln_bwd_kernel's FM)
  dispatch_types(a.scalar_type(), pdt, [&](auto tag, auto wtag) {
    using T = decltype(tag);
    using W = decltype(wtag);
    dispatch_bwd_shape<T>(N, [&](auto v, auto rt) {
      constexpr int kV = decltype(v)::value, kRT = decltype(rt)::value;
      dispatch_variant<T, kV, kRT>(dropout, [&](auto pf, auto drop) {
        constexpr bool kPF = decltype(pf)::value, kDrop = decltype(drop)::value;
        per_sm = bwd_blocks_per_sm<T, W, kV, kRT, kPF, kDrop, false>(slots);
        if (kRT == kThreads && slots) {
          len = kV * Pack<T>::n * kRT;
          layout_rt = kRT;
          layout_p = Pack<T>::n;
        }
        if constexpr (sizeof(T) == 2) {  // (the launched kernel's own occupancy: its registers may differ)
          if (fma) per_sm = bwd_blocks_per_sm<T, W, kV, kRT, kPF, kDrop, true>(slots);
        }
      });
    });
  });
  const int progs = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, static_cast<int64_t>(per_sm) * sms)));
  auto f32 = a.options().dtype(at::kFloat);
  Tensor partial = at::empty({need ? 2 * progs * static_cast<int64_t>(len) : 0}, f32);
  const auto popts = a.options().dtype(pdt);
  Tensor dw = need && w.defined() ? poisoned(at::empty({N}, popts)) : Tensor();
  Tensor db = need && has_b ? poisoned(at::empty({N}, popts)) : Tensor();
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_types(a.scalar_type(), pdt, [&](auto tag, auto wtag) {
    using T = decltype(tag);
    using W = decltype(wtag);
    if (M > 0) {
      dispatch_bwd_shape<T>(N, [&](auto v, auto rt) {
       constexpr int kV = decltype(v)::value, kRT = decltype(rt)::value;
       dispatch_variant<T, kV, kRT>(dropout, [&](auto pf, auto drop) {
        constexpr bool kPF = decltype(pf)::value, kDrop = decltype(drop)::value;
        auto kernel = ln_bwd_kernel<T, W, kV, kRT, kPF, kDrop, false>;
        if constexpr (sizeof(T) == 2) {
          if (fma) kernel = ln_bwd_kernel<T, W, kV, kRT, kPF, kDrop, true>;
        }
        launch_pdl(kernel, dim3(progs), dim3(kThreads), smem, stream,
            static_cast<const T*>(dy.data_ptr()), ds.defined() ? static_cast<const T*>(ds.data_ptr()) : nullptr,
            static_cast<const T*>(a.data_ptr()), res.defined() ? static_cast<const T*>(res.data_ptr()) : nullptr,
            w.defined() ? static_cast<const W*>(w.data_ptr()) : nullptr, rms ? nullptr : mean.data_ptr<float>(),
            rstd.data_ptr<float>(), static_cast<T*>(dx.data_ptr()), static_cast<T*>(dres.data_ptr()),
            need ? partial.data_ptr<float>() : nullptr, M, N, ds.defined(), res.defined(), w.defined(),
            need ? (slots ? kDwbSlots : kDwbTurns) : kDwbNone, rms,
            recompute, seed_ptr(dropout_p, seed, a, "pykernels_cuda.layer_norm_bwd"),
            static_cast<float>(dropout_rate(dropout_p)),
            dropout ? static_cast<float>(1.0 / (1.0 - dropout_rate(dropout_p))) : 1.f);
       });
      });
    } else if (need) {
      partial.zero_();
    }
    if (need) {
      Tensor dw_t = dw.defined() ? dw : at::empty({N}, popts);
      Tensor db_t = db.defined() ? db : at::empty({N}, popts);
      dim3 grid((len + 31) / 32, 2);
      launch_pdl(ln_partial_sum_kernel<W>, grid, dim3(kSumThreads), 0, stream, partial.data_ptr<float>(),
                 static_cast<W*>(dw_t.data_ptr()), static_cast<W*>(db_t.data_ptr()), M > 0 ? progs : 1, N, len,
                 layout_rt, layout_p);
    }
  });
  return {dx, dw, db, dres};
}

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                const optional<Tensor>& w, const optional<Tensor>& b,
                                                const optional<Tensor>& r, double eps, double dropout_p,
                                                const optional<Tensor>& seed, bool prenorm, bool rms) {
    auto out = forward_impl(x, w, b, r, eps, dropout_p, seed, prenorm, rms);
    // pre-LN saves s (an output anyway); post-LN saves x and residual and recomputes s
    ctx->save_for_backward({prenorm ? out[1] : out[4], prenorm ? Tensor() : out[5],
                            w.has_value() ? *w : Tensor(), out[2], out[3], seed.value_or(Tensor())});
    ctx->saved_data["prenorm"] = prenorm;
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["has_b"] = b.has_value();
    ctx->saved_data["has_r"] = r.has_value();
    ctx->saved_data["pdt"] = static_cast<int64_t>(param_dtype(x, w, b));
    ctx->saved_data["dropout_p"] = dropout_p;
    if (!prenorm) ctx->mark_non_differentiable({out[1]});
    // an output's gradient that never came (post-LN's placeholder s, an unused pre-LN s) stays undefined: the
    // backward skips it, where materialised it was a zeros tensor allocated, filled and read every backward
    ctx->set_materialize_grads(false);
    return {out[0], out[1]};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // grad mode is on in a backward only under create_graph=True: the kernels are not differentiable,
    // and gradients of this backward would be silently missing
    TORCH_CHECK(!at::GradMode::is_enabled(), "pykernels_cuda::layer_norm: double backward (create_graph=True) is "
                "not supported; use backend='reference' for this layer");
    auto saved = ctx->get_saved_variables();
    const bool prenorm = ctx->saved_data["prenorm"].toBool();
    const bool rms = ctx->saved_data["rms"].toBool();
    const bool has_b = ctx->saved_data["has_b"].toBool();
    const bool has_r = ctx->saved_data["has_r"].toBool();
    const Tensor& a = saved[0];
    Tensor dy = grads[0];
    if (!dy.defined()) dy = at::zeros_like(a);  // (only s was used)
    const Tensor ds = prenorm ? grads[1] : Tensor();
    const auto pdt = static_cast<at::ScalarType>(ctx->saved_data["pdt"].toInt());
    // the inputs' edges: x, then weight and bias where given (an absent optional has none)
    const bool has_w = saved[2].defined();
    const bool need_dw = has_w && ctx->needs_input_grad(1);
    const bool need_db = has_b && ctx->needs_input_grad(has_w ? 2 : 1);
    auto g = backward_impl(dy, ds, a, saved[1], saved[2], has_b, pdt, saved[3], saved[4], rms, !prenorm,
                           ctx->saved_data["dropout_p"].toDouble(),
                           saved[5].defined() ? optional<Tensor>(saved[5]) : optional<Tensor>(), need_dw || need_db);
    // without dropout dx and dresidual are equal: one tensor serves both
    return {g[0], need_dw ? g[1] : Tensor(), need_db ? g[2] : Tensor(), has_r ? g[3] : Tensor(), Tensor(), Tensor(),
            Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> layer_norm_autograd(const Tensor& x, const optional<Tensor>& w, const optional<Tensor>& b,
                                               const optional<Tensor>& r, double eps, double dropout_p,
                                               const optional<Tensor>& seed, bool prenorm, bool rms_norm) {
  auto out = LayerNormFunction::apply(x, w, b, r, eps, dropout_p, seed, prenorm, rms_norm);
  return {out[0], out[1]};
}

std::tuple<Tensor, Tensor> layer_norm_nograd(const Tensor& x, const optional<Tensor>& w, const optional<Tensor>& b,
                                             const optional<Tensor>& r, double eps, double dropout_p,
                                             const optional<Tensor>& seed, bool prenorm, bool rms_norm) {
  auto out = forward_impl(x, w, b, r, eps, dropout_p, seed, prenorm, rms_norm);
  return {out[0], out[1]};
}

// The compiled graphs' pair (torch.compile): the forward and the backward as two ops with no autograd of their own.
// pykernels.layer_norm's _CudaLayerNorm (an autograd.Function that dynamo traces) calls them, so a compiled graph calls
// these C++ kernels directly (no Python at run time); their fake impls are in pykernels/_cuda_ops.py. The forward
// draws the dropout seed (draw_seed) and returns it; the backward reads it back.
// -> y, s (pre-LN; else (0,)), mean (LayerNorm; else (0,)), rstd, seed
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layer_norm_fwd(const Tensor& x, const optional<Tensor>& w,
                                                                  const optional<Tensor>& b, const optional<Tensor>& r,
                                                                  double eps, double dropout_p, bool prenorm,
                                                                  bool rms_norm) {
  Tensor seed = draw_seed(dropout_p, x);
  auto out = forward_impl(x, w, b, r, eps, dropout_p, seed, prenorm, rms_norm);
  return {out[0], out[1], out[2], out[3], seed};
}

// ``a``: the forward's s (pre-LN) or its x (post-LN: s is recomputed from x and ``residual``). -> dx ((0,) without
// dropout, where it equals dresidual: outputs of an op may not alias), dresidual, dweight, dbias ((0,) where the
// forward had no weight / bias; in the parameters' dtype)
std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_bwd(const Tensor& dy, const optional<Tensor>& ds, const Tensor& a,
                                                          const optional<Tensor>& residual, const optional<Tensor>& w,
                                                          const optional<Tensor>& b, const Tensor& mean,
                                                          const Tensor& rstd, const Tensor& seed, double dropout_p,
                                                          bool prenorm, bool rms_norm) {
  constexpr const char* kOp = "pykernels_cuda.layer_norm_bwd";
  TORCH_CHECK(a.is_cuda() && a.dim() == 2 && dy.sizes() == a.sizes() && dy.scalar_type() == a.scalar_type(), kOp,
              ": dy must be a CUDA tensor of a's (M, N) shape and dtype");
  TORCH_CHECK(!ds.has_value() || (prenorm && ds->sizes() == a.sizes() && ds->scalar_type() == a.scalar_type()), kOp,
              ": ds (pre-LN only) must have a's shape and dtype");
  TORCH_CHECK(prenorm || !residual.has_value() || residual->sizes() == a.sizes(), kOp,
              ": residual must have a's shape");
  const auto pdt = param_dtype(a, w, b);
  auto g = backward_impl(dy, ds.value_or(Tensor()), a, prenorm ? Tensor() : residual.value_or(Tensor()),
                         w.value_or(Tensor()), b.has_value(), pdt, mean, rstd, rms_norm, !prenorm, dropout_p,
                         seed, true);
  const auto none = [&](at::ScalarType dt) { return at::empty({0}, a.options().dtype(dt)); };
  return {dropout_p > 0.0 ? g[0] : none(a.scalar_type()), g[3], g[1].defined() ? g[1] : none(pdt),
          g[2].defined() ? g[2] : none(pdt)};
}

}  // namespace
}  // namespace pykernels

TORCH_LIBRARY(pykernels_cuda, m) {
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, float dropout_p, "
        "Tensor? seed, bool prenorm, bool rms_norm) -> (Tensor, Tensor)");
  m.def("layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, float dropout_p, "
        "bool prenorm, bool rms_norm) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("layer_norm_bwd(Tensor dy, Tensor? ds, Tensor a, Tensor? residual, Tensor? weight, Tensor? bias, Tensor mean, "
        "Tensor rstd, Tensor seed, float dropout_p, bool prenorm, bool rms_norm) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pykernels_cuda, CUDA, m) {
  m.impl("layer_norm", &pykernels::layer_norm_nograd);
  m.impl("layer_norm_fwd", &pykernels::layer_norm_fwd);
  m.impl("layer_norm_bwd", &pykernels::layer_norm_bwd);
}

TORCH_LIBRARY_IMPL(pykernels_cuda, Autograd, m) { m.impl("layer_norm", &pykernels::layer_norm_autograd); }

namespace pykernels {
void bind_graph_if(pybind11::module_& m);  // csrc/graph_if.cu
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pykernels CUDA C++ kernels; the ops are registered as torch.ops.pykernels_cuda.*";
  pykernels::bind_graph_if(m);
  // whether this build has sm_90a code (TORCH_CUDA_ARCH_LIST with 9.0a: the attention forward's wgmma kernel)
#if defined(PYKERNELS_SM90A)
  m.attr("sm90a") = true;
#else
  m.attr("sm90a") = false;
#endif
}
