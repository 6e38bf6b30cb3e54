// What the CUDA C++ attention's host code (attention.cpp) and its kernels (attention.cuh) share: the kernels'
// parameters and the launchers. The launchers are defined in attention.cuh and instantiated one translation unit a
// direction and dtype (attention_{fwd,bwd}_{fp16,bf16}.cu), so that nvcc compiles the four in parallel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace pykernels {
namespace attn {

constexpr float kLog2e = 1.4426950408889634f;

enum MaskKind : int { kNoMask = 0, kBoolMask = 1, kF32Mask = 2, kF16Mask = 3, kBF16Mask = 4, kF64Mask = 5 };

// The columns of a row of Params::dq_acc: the fused backward's head dims padded to its tile (64 for D <= 64, 128 for
// D <= 128)
inline int dq_acc_cols(int d) { return d <= 64 ? 64 : 128; }

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
  int batch;               // B (varlen: the number of sequences)
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
  int drop_sk;             // Sk rounded up to a multiple of 8: the dropout counter's row stride (drop_rows; in the
                           // padding after causal, so the struct's size is unchanged)
  float p_drop, inv_keep;
  const int64_t* seed;      // the dropout seed, (1,) int64 in device memory (philox.cuh's drop_seed_init)
  float* dq_acc;            // backward: the fused kernel's dQ sums, fp32 (B, Hq, dq_acc_cols(d) / 64, Sq, 64) (a slice
                            // of 64 head dims a warpgroup; varlen (1, Hq, dq_acc_cols(d) / 64, T, 64), the packed
                            // rows), zeroed by the pre kernel (nullptr: the pair; fused_dq_planned; its shape:
                            // dq_acc_batch, dq_acc_rows)
  int64_t tq, tk;           // varlen: the packed query and key rows (the forward's TMA maps, dq_acc's rows); dense: 0
  int* fwd_order;           // forward, packed varlen sequences (nullptr: none): room for the warp-specialised kernel's
                            // walk, fwd_order_tiles + 1 int32 (attn_fwd_order_kernel writes it; the count last)
  int64_t fwd_order_n;      // its tiles' room: fwd_order_tiles
  int pre_fills;            // backward, packed sequences: the pre kernel zeroes the gradients' rows outside the
                            // sequences (launch_backward sets it; 0: a launch of their own, PYKERNELS_CUDA_ATTN_FILL)
  int fwd_drop_bits;        // the warp-specialised forward with dropout: its producer warpgroup draws the keep bits of
                            // each key block's first FwdWsCfg::DRAWN n-tiles into shared memory for the consumers
                            // (launch_forward sets it; 0: the consumers draw all of them,
                            // PYKERNELS_CUDA_ATTN_FWD_DRAWS=consumers)
  float lazy_max;           // forward: the online softmax's lazy max (attention.cuh's kLazyMax; launch_forward sets it;
                            // 0, the max moved at every block where it grew: PYKERNELS_CUDA_ATTN_FWD_LAZY=0)
  const int* kv_range;      // forward, a boolean key-padding mask (nullptr: none): each batch's valid keys, (B, 3)
                            // int32 lo, hi, dense (pykernels.attention._key_padding_range's; launch_kv_range writes
                            // it), where fwd_key_ranges_planned: the forward split in two launches (attention.cuh)
};

// The warp-specialised forward's ordered walk over packed varlen sequences (attention.cuh's attn_fwd_order_kernel):
// at most kOrderSeqs sequences; its room, one int32 a tile of kOrderBM query rows a head and sequence, at most Sq's
// (max seqlen_q's) tiles each, and the count (0 where it does not apply: the caller passes no room)
constexpr int kOrderSeqs = 1024, kOrderBM = 128;
inline int64_t fwd_order_tiles(int64_t batch, int64_t hq, int64_t sq) {
  const int64_t n = (sq + kOrderBM - 1) / kOrderBM * hq * batch;
  return batch <= kOrderSeqs && n < INT32_MAX ? n : 0;
}

// Packed varlen sequences: up to three tensors whose rows outside [cu[0], cu[batch]) no kernel writes, filled there
// (zero_rows.cuh's fill_rows_outside): each `outer` slices of `rows` rows (contiguous), the fill a 32-bit pattern
// (0, or -inf for lse). The forward's o and lse (by the order kernel's spare blocks, else zero_rows_outside's own
// launch); the backward's dq, dk, dv are filled by its pre kernel from Params alone
struct ZeroRows {
  struct Target {
    void* ptr;
    const int* cu;        // device cu_seqlens (batch + 1 entries)
    int64_t rows;         // rows a slice (total tokens)
    int64_t row_bytes;    // bytes a row
    int64_t outer;        // slices (1; lse: heads)
    int64_t outer_bytes;  // bytes from one slice to the next
    uint32_t fill;        // the pattern (0; lse: -inf's bits)
  } t[3];
  int n;                  // targets
  int batch;
};
void zero_rows_outside(const ZeroRows& z, cudaStream_t stream);

// o and lse (Params::out, Params::lse) from q, k, v on ``stream``; T is __half or __nv_bfloat16; ``outside``:
// packed sequences, o's and lse's rows outside the sequences, filled on the same stream
template <typename T>
void launch_forward(const Params& p, cudaStream_t stream, const ZeroRows* outside = nullptr);
// dq, dk, dv (and the delta scratch) from dout, q, k, v, o, lse
template <typename T>
void launch_backward(const Params& p, cudaStream_t stream);
// Whether launch_backward would run the fused backward for p (dQ added into Params::dq_acc by bulk reductions, no dQ
// blocks; fp16 or bf16): Hopper from an sm_90a build, head dim <= 128,
// PYKERNELS_CUDA_ATTN_FUSED_DQ and PYKERNELS_CUDA_ATTN_TMA not '0'. The caller allocates dq_acc (uninitialised:
// launch_backward's pre kernel zeroes it) where it is true, and leaves it nullptr where the backward must be
// reproducible bit for bit (the reductions' order varies)
bool fused_dq_planned(const Params& p);
// Whether launch_forward would split p's boolean key-padding mask by each batch's valid keys (attention.cuh's
// fwd_key_ranges): then the caller sets Params::kv_range, to a (B, 3) int32 tensor of the ranges it has or that
// launch_kv_range computes on ``stream`` (no host sync)
bool fwd_key_ranges_planned(const Params& p);
void launch_kv_range(const Params& p, int* out, cudaStream_t stream);

extern template void launch_forward<__half>(const Params&, cudaStream_t, const ZeroRows*);
extern template void launch_forward<__nv_bfloat16>(const Params&, cudaStream_t, const ZeroRows*);
extern template void launch_backward<__half>(const Params&, cudaStream_t);
extern template void launch_backward<__nv_bfloat16>(const Params&, cudaStream_t);

#ifdef PYKERNELS_FWD_TRACE
int64_t fwd_trace_read(unsigned long long* host, bool reset);  // (attention_fwd_bf16.cu; development builds only)
#endif
}  // namespace attn
}  // namespace pykernels
