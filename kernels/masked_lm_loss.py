"""Masked-position-only LM loss: fused LM-head matmul + softmax cross-entropy, forward and backward.

Design note
===========
Problem. ``hidden`` (N, H), tied ``weight`` (V, H), optional ``bias`` (V,), ``target`` (N,) int64.
Only the M rows whose target is not ``ignore_index`` take part (M ~ 0.15 N for BERT MLM, M = N for a
causal LM). Per valid row r: ``z = h_r W^T + b``, ``lse = logsumexp(z)``,
``loss = lse - (1 - eps) z_t - eps/V sum_j z_j`` (label smoothing eps as ``F.cross_entropy``), and
``dz = g_r (softmax(z) - (1 - eps) onehot(t) - eps/V)``, ``dh_r = dz W``, ``dW = sum_r dz_r^T h_r``,
``db = sum_r dz_r``. Neither the (N, V) nor the (M, V) logits ever exist in full.

Compaction. ``_compact_kernel`` (one program per 1024 positions, each counting the valid targets before its
slice, then a prefix sum within it; up to 65536 positions, else
``pykernels.masked_lm_loss.compact_rows`` with torch ops) turns ``target != ignore_index`` into a
fixed-size (N,) int32 list of valid row indices and a device int32 ``count``, and zeroes the loss and
lse outputs. Every forward kernel is launched on a grid sized for N rows (or for the vocabulary) and
reads ``count`` from device memory: row blocks that start at or beyond ``count`` exit at once. The
pointer kernels gather rows inside (``rows[i]``); the Hopper TMA kernel reads a compacted copy of the
valid rows (``_gather_rows_kernel``, M x H, a few MiB). The forward never waits for the device.

Three backwards. The forward also starts a non-blocking copy of ``count`` to pinned host memory and
records an event (``pykernels.masked_lm_loss._CountCopies``). The backward waits on that event (by then
the GPU is usually far past the compaction, with the forward's kernels still queued, so neither a
drained queue nor an idle GPU) and runs :func:`masked_lm_loss_bwd_sized` with M known on the host:
buffers and grids for M rows, N / M times wider vocabulary chunks for the same memory, cuBLAS for the
two gradient GEMMs. Under CUDA-graph capture, or with ``graph_safe=True``, it runs
:func:`masked_lm_loss_bwd` instead: every buffer and grid sized for N, K loops over rows running
``range(0, count, BLOCK_K)``; nothing waits, and the op replays from a graph with any valid count. A captured
call whose eager warm-up left a valid count (``pykernels.masked_lm_loss._ValidSeen``) runs, unless it names
``graph_safe=True``, :func:`masked_lm_loss_bwd_bounded` for a capacity of that count plus 8 standard deviations
(the sized backward in capacity mode for up to that many rows, then the graph-safe kernels over the rows past it
in a few row blocks, adding into the same dweight / dbias: exact for any count; each block is an IF node of the
captured graph (csrc/graph_if.cu, ``_tuning.graph_if``), run at replay only where a row reaches it, so with no row
past the capacity a replay pays one one-thread kernel for the whole overflow pass; H200 run402, BERT-base replayed:
0.839 ms at 97.6 MiB above the inputs, against the capacity pass's 0.844 alone and 2.133 graph-safe; where rows
are past it, a block's dhidden programs split each chunk's columns up to ``OVERFLOW_DH_SPLITS`` ways, their fp32
partial sums added in order by ``_dhidden_reduce_kernel``: 206 rows past it replayed in 1.054 ms against 1.662
unsplit, run406), or the dense backward below where the capacity is at least 90% of N.
With ``dense=True`` (the causal LM, nearly every target valid) it runs :func:`masked_lm_loss_bwd_dense`:
the sized backward with M = N, every position a row and the ignored ones masked (zero upstream
gradient, lse +inf); nothing waits and every shape is known on the host, so it also replays from a
graph, at the sized path's speed (GPT-2, H100: 5.2 ms in graph replay against 12.2 ms graph-safe).

Kernels (all fp32 accumulation, fp32 statistics, exp2 with log2(e) folded in, masked lanes filled
with -inf before the max and 0 before the sums, int64 offsets wherever a row or vocabulary index
is multiplied by a stride):

0. ``_logits_tma_kernel`` (sm_90+, fp16/bf16, 16-byte aligned weight rows; PYKERNELS_MLM_TMA=0 off):
   persistent programs (one per SM) walk the (row block, vocabulary tile) grid, row blocks fastest, and
   fetch both operands through tensor descriptors built on the device (the TMA engine, no address math
   or masks in registers, rows and columns past the ends read as 0); the software pipeline spans tiles
   (``tl.range(flatten=True)``). Two epilogues: the forward's per-tile row statistics (max, sum-exp, and
   with smoothing the sum) into (N / BLOCK_N tiles, N) partials merged by the combine kernel below, which
   also computes each row's target logit as a dot product (picking it out of every tile was a compare, a
   select and a sum per logit: 873 -> 841 us at BERT-base, H100 run163); the sized backward's dz stored
   through a descriptor clipped to (M, VC). Measured on an H200 (2026-11-26,
   ``benchmarks/dev/mlm_tma_probe.py``): BERT-base forward 0.298 vs 0.317 ms, sized backward 0.77 vs
   1.01 ms; GPT-2 forward 1.24 vs 1.47 ms, backward 4.29 vs 5.44 ms (pointer kernels). Hopper's automatic
   warp specialisation (``warp_specialize=True``) leaves the sm_90 code unchanged in Triton 3.6
   (``benchmarks/dev/sm90_codegen.py``), so on sm_90 the sized backward's dz and the forward's
   statistics run the warp-specialised Gluon kernel of ``masked_lm_loss_sm90`` instead (``_sm90``, ``SM90_DZ``
   / ``SM90_FWD``: 1.21x for dz at BERT-base, H100 run166; the forward 1.29-1.36x with a bias, 1.02-1.05x
   without one, run181-182), with the same arguments and outputs.
   Otherwise, and for fp32, the pointer kernels 1 and 2a:
1. ``_masked_lm_loss_fwd_kernel``, grid (N / BLOCK_M row blocks, SPLIT vocabulary slices): for its
   rows and its slice of V it computes logit tiles with ``tl.dot`` (K loop over H) and keeps an
   online max / sum-exp (log2 domain), the target logit and (with smoothing) the sum of logits.
   The vocabulary split gives the machine enough programs: 2446 masked rows are only 20 row blocks
   of 128, 600 programs once V is cut into 30 slices of 1024. ``_masked_lm_loss_combine_kernel`` merges the
   SPLIT partials per row (a few bytes per row) and writes loss and lse at the row's position.
   FLOPs 2 M V H; bytes ~ (M/BLOCK_M) V H (weight re-read per row block, mostly L2) + M H.
2. Sized backward (M known on the host), in vocabulary chunks of VC columns (the (M, VC) dlogits buffer
   within dhidden's N x H elements where it lives when a chunk of ``SIZED_DLOGITS_BUDGET_BYTES``, 16 MiB,
   fits there: dhidden is written only after the last chunk, then zeroed and filled; else a buffer of
   the budget plus dhidden's bytes, dhidden being allocated only after the chunks), per chunk:
   a. the TMA kernel's dz epilogue, or ``_masked_lm_loss_dlogits_kernel``: either recomputes the logit
      tile in fp32 (2 M VC H FLOPs), turns it into dz with the saved lse and the upstream grad, and
      stores dz in the weight dtype (compacted rows). Its grid covers the host's M rows; if the device
      count differs, every dz is NaN (never a silently partial gradient). With ``max_valid`` (capacity
      mode) M is the caller's upper bound instead: nothing waits for the count, the rows past the device
      count get dz 0 (and zero gathered rows), and only a count above M poisons.
   b. dW[chunk] = dz^T h_c (cuBLAS, fp32 accumulation, written once: each chunk owns its rows of dW);
      dbias[chunk] = column sums of dz in fp32; dh_c += dz W[chunk] (cuBLAS with an fp32 output,
      ``out_dtype``, accumulated in place across chunks), scattered once to the valid positions.
   While the rows of dW past a chunk can hold a wider chunk's dlogits, they do (``_chunk_plan``): dW is
   written chunk by chunk, so those rows are free until a later chunk writes them. At GPT-2 size this
   makes the first chunks 4096 columns wide instead of 1792 (22 chunks instead of 29; 50 with neither
   the scratch rows nor dhidden's bytes), which cuts the fp32 dh accumulator's round trips and the
   host's per-chunk work at no extra memory: narrow chunks run cuBLAS far below its peak (H100: dW at 419
   TFLOP/s for 1024 columns, 748 for 4096, ``benchmarks/dev/mlm_gemm_probe.py``).
   h_c is the (M, H) gather of the valid rows (``hidden`` itself when every row is valid). On the TMA
   path every chunk is padded to a multiple of 8 columns (dz 0 there, dW a view of a padded buffer):
   cuBLAS fell back to a ~3x slower sm_80 kernel for BERT's 4922-column last chunk (H100, 2026-11-26).
   The dh GEMM stops at the chunk's last multiple of 8 columns; the rest (< 8 columns) is added by the
   dhidden scatter kernel, which reads the fp32 accumulator anyway (a second cuBLAS GEMM there read and
   wrote all of it: 10 us at BERT-base, 17 us at GPT-2), also where every row is valid (rows[i] = i: the
   scatter is then the accumulator's cast to dhidden, with the tail added).
   (Measured and dropped: the logits from a cuBLAS GEMM in the input dtype plus an in-place elementwise
   kernel, ~8% less GPU time on an H200 (run6), but the rounded logits no longer match the forward's
   fp32 lse exactly: at V = 1 the exact-zero gradient came out ~1e-7..1e-4 where eager gives 0.)
3. Graph-safe backward, in vocabulary chunks of VC columns (VC chosen so the (N, VC) dlogits buffer
   stays within ``DLOGITS_BUDGET_BYTES``, 64 MiB), per chunk:
   a. ``_masked_lm_loss_dlogits_kernel`` as above, grid sized for N rows (blocks past ``count`` exit).
   b. ``_masked_lm_loss_bwd_kernel``, one launch with two kinds of programs that both only read the
      chunk's dlogits (at 15% masking neither kind fills the GPU alone, together they do):
      - dW tiles, (VC / BLOCK_A) x (H / BLOCK_H) programs: dW[chunk] = dz^T h with the K loop over the
        ``count`` compacted rows (gathered), fp32 accumulator, written once in the weight dtype: no
        fp32 (V, H) buffer, no atomics, deterministic. The first H tile also sums dz for dbias.
      - dhidden tiles, (N / BLOCK_A) x (H / BLOCK_H) programs: dh += dz W[chunk] into an fp32 (N, H)
        accumulator (compacted rows; not allocated when V fits one chunk); the last chunk writes the
        hidden dtype straight to each row's position in the zero-initialised dhidden.
   Programs for a gradient no input needs are not launched (frozen embeddings: no dW tiles).
Both: 4 matmuls of M x V x H (forward 1, backward 3) = 8 M V H FLOPs; the dlogits buffer is written
once and read twice (3 x 2 M V bytes in bf16).

Why not the alternatives. (i) Accumulating dh (BLOCK_M x H) or dW (BLOCK_N x H) in registers inside
the logits kernel, flash-attention style, does not fit: with H = 768 an fp32 128 x 768 tile is 384 KiB,
more than an SM's register file; splitting H would recompute the logits H / BLOCK_H times. (ii) cuBLAS
on the compacted rows needs M on the host (a sync) or wastes 85% of the FLOPs on a fixed N-row buffer
at 15% masking. (iii) Computing the gradients during the forward (Liger) saves the recompute only when
the whole (rows, V) chunk is materialised, and then dW must be accumulated across row chunks in an
fp32 (V, H) buffer (94 MiB for BERT-base), over the memory budget.

Memory above the inputs (BERT-base MLM: N 16384, M 2446, V 30522, H 768, bf16; measured peaks in
benchmarks/results/*_run14.csv, *_run148.txt). Sized: dhidden (N H) and dW (V H) in the input dtype (24 + 45
MiB), the (M, VC) dlogits chunks in a buffer of the budget plus dhidden's bytes (36 MiB: 4 chunks; dhidden is
allocated after it is freed; inside dhidden's own memory, 24 MiB, they would need 6 chunks, ``_chunk_layout``),
h_c and the fp32 (M, H) accumulator (4 + 7 MiB): 92 MiB (84 with the 6 chunks, GPU time 1.00 against 0.95
ms); GPT-2 (N = M = 8192, V 50257; the chunks do not fit in dhidden, a 16 MiB buffer):
126 MiB. The TMA forward's transient compacted rows and per-tile partials (71 MiB at BERT-base, 51 MiB
at GPT-2, ``TMA_FWD_BUDGET_BYTES``) are freed before the backward. Graph-safe: the (N, VC) buffer
(64 MiB) and an fp32 (N, H) accumulator (48 MiB) instead, both sized for N because the count stays on
the device: 181 and 174 MiB.

Launches per call: forward 3-4 Triton kernels (compaction, [row gather,] logits, combine) + the count
copy; sized backward 3 per chunk (dz kernel, two GEMMs) + the row gather and the dhidden scatter (one Triton
launch each: the gathered rows in, every position of dhidden out, 0 at the ignored ones); graph-safe backward 2
Triton kernels per chunk. Host time is what limits the sized backward at BERT-base on the GPU
machines' slow host CPUs: ~1.1-1.3 ms of host time for ~0.7-0.8 ms of GPU time (6 chunks, ~150-200 us
of Python, torch dispatch and launches each), so fewer, wider chunks pay off more than faster kernels.

Limits. Targets outside [0, V) that are not ``ignore_index`` are never used to address memory: their
loss (and lse) is NaN and their gradient is that of the plain softmax (no one-hot term); the
reference raises an error for them. ``hidden`` and ``weight`` share one dtype (fp16, bf16, fp32); fp32
uses IEEE ``tl.dot`` (no TF32) to match eager fp32. The interpreter (TRITON_INTERPRET=1) runs one
small fixed tile configuration.

References: Liger-Kernel fused_linear_cross_entropy (chunked gradients), Cut Cross-Entropy
(Wijmans et al. 2024, blockwise logits never materialised), llm.c fused_classifier (loss and dlogits
in one pass), FlashAttention-2 (online softmax with exp2).
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from pykernels._alloc import empty

from . import _launch
from . import _tuning

# Inside the kernels log2(e) = 1.4426950408889634 and ln(2) = 0.6931471805599453 appear as literals
# (folded into the logit scale: exp(z - lse) = exp2(z * log2e - lse * log2e)).

_INTERPRET = _tuning.interpret()  # read once: the config tables below are built at import

# Memory budget for the (N, VC) dlogits buffer of the graph-safe backward (valid count unknown on
# the host: the buffer is sized for all N rows).
DLOGITS_BUDGET_BYTES = 64 * 2**20
# Memory budget for the (M, VC) dlogits buffer of the sized backward (valid count M known on the host).
SIZED_DLOGITS_BUDGET_BYTES = 16 * 2**20


def _configs(gpu: list[tuple], names: tuple[str, ...], interp: tuple,
             fp32: tuple) -> tuple[list[triton.Config], set]:
    """Autotune configs: a small list for 16-bit inputs plus one for fp32 inputs on the GPU (IEEE fp32
    tiles take twice the shared memory), or one small config under the interpreter. Returns the list
    and the set of its fp32 configs (for ``_prune_by_dtype``)."""
    def make(r):
        return triton.Config(dict(zip(names, r[:-2])), num_warps=r[-2], num_stages=r[-1])
    if _INTERPRET:
        return [make(interp)], set()
    fp32_configs = [make(fp32)]
    return [make(r) for r in gpu] + fp32_configs, set(fp32_configs)


def _prune_by_dtype(fp32_set: set):
    """``early_config_prune``: the fp32 configs for fp32 inputs, the others for fp16/bf16. With
    PYKERNELS_AUTOTUNE=0 (the tests) the first survivor runs, so each dtype gets a config that fits."""
    def prune(configs, named_args, **kwargs):
        is_fp32 = named_args["h_ptr"].dtype == torch.float32
        kept = [c for c in configs if (c in fp32_set) == is_fp32]
        return kept or list(configs)
    return {"early_config_prune": prune}


_MNK = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
# (BLOCK_M/BLOCK_A, BLOCK_N/BLOCK_H, BLOCK_K, warps, stages). The first entry is the default (tests run
# with PYKERNELS_AUTOTUNE=0); the rest are Hopper candidates. Every tile is >= 64 rows per warpgroup with
# warps a multiple of 4, so tl.dot lowers to wgmma on sm_90. Checked offline for sm_90 (Triton 3.6
# front end + bundled ptxas, bf16 and fp16, with and without bias + label smoothing): all listed
# 16-bit configs have no register spills (no STL in the SASS) and fit shared memory (<= 192 KiB of the
# 227 KiB per block). Rejected because they spill: the logits kernels at 128 x 256 (w8), 256 x 128
# (forward, w8) and any w16 tile (128 registers per thread); the backward GEMM at 128 x 256, 256 x 128
# and 128 x 128 with 4 warps. More stages and a
# 128-wide K step are what is left to hide the load latency behind the wgmma of the H (or row/column)
# loop; the logits kernels' softmax epilogue is not overlapped with the next tile's loads, so a deeper
# pipeline helps them most. Few configs: every one is a compile on the first call.
# The forward also keeps the running max / sum / target logit (and with bias and smoothing, more): a
# 128-wide K step (128 x 128 x 128) and 128 x 64 on 4 warps spill there, 64 x 256 and 128 x 64 on 8
# warps do not.
_FWD_CONFIGS, _FWD_FP32 = _configs([(128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 4),
                                    (64, 256, 64, 8, 3), (128, 64, 64, 8, 4)],
                                   _MNK, (16, 32, 16, 1, 1), (64, 64, 32, 4, 2))
# The dlogits kernel keeps only the tile and its exp2 live (no running statistics), so 256 x 128 fits.
_DLOGITS_CONFIGS, _DLOGITS_FP32 = _configs([(128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 4),
                                            (128, 128, 128, 8, 3), (256, 128, 64, 8, 3)],
                                           _MNK, (16, 32, 16, 1, 1), (64, 64, 32, 4, 2))
_AHK = ("BLOCK_A", "BLOCK_H", "BLOCK_K")
# The backward keeps its earlier list: 128 x 256 spills a little offline, yet the H100 run with it was
# faster (backward 1.84 ms at BERT-base) than the spill-free candidates (2.30 ms, same card, 2026-11-26).
_BWD_CONFIGS, _BWD_FP32 = _configs([(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 3)],
                                   _AHK, (16, 16, 16, 1, 1), (64, 64, 32, 4, 2))


@triton.jit
def _tile_stats(acc, tgt, offs_n, mask_n, SMOOTH: tl.constexpr, ZT: tl.constexpr):
    """Per-row statistics of one fp32 logit tile (columns ``offs_n``, valid where ``mask_n``): max of the
    log2-scaled logits, sum of exp2 relative to it, with ZT the target's logit (0 if not in the tile; else
    the combine kernel computes it) and, with SMOOTH, the sum of the logits."""
    z2 = tl.where(mask_n[None, :], acc * 1.4426950408889634, float("-inf"))
    m = tl.max(z2, axis=1)
    s = tl.sum(tl.exp2(z2 - m[:, None]), axis=1)
    if ZT:
        zt = tl.sum(tl.where(offs_n[None, :] == tgt[:, None], acc, 0.0), axis=1)
    else:
        zt = s  # (not stored)
    zsum = zt
    if SMOOTH:
        zsum = tl.sum(tl.where(mask_n[None, :], acc, 0.0), axis=1)
    return m, s, zt, zsum


@triton.jit
def _dlogits_tile(acc, tgt, lse2, g, offs_n, smooth_eps, V):
    """dz of one fp32 logit tile: g (softmax - (1 - eps) onehot - eps / V), from the saved lse."""
    p = tl.exp2(acc * 1.4426950408889634 - lse2[:, None])
    d = p - tl.where(offs_n[None, :] == tgt[:, None], 1.0 - smooth_eps, 0.0) - smooth_eps / V
    return d * g[:, None]


@triton.jit
def _logit_tile(h_row, w_col, b_ptr, offs_n, mask_m, mask_n, H, stride_hh, stride_wh, stride_b,
                HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One fp32 (BLOCK_M, BLOCK_N) tile of logits, h[rows] W[offs_n]^T (+ bias): ``h_row`` the rows' (BLOCK_M, 1)
    pointers, ``w_col`` the columns' (1, BLOCK_N) weight-row pointers; a K loop over H."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < H
        a = tl.load(h_row + offs_k[None, :] * stride_hh, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_col + offs_k[:, None] * stride_wh, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n.to(tl.int64) * stride_b, mask=mask_n, other=0.0).to(tl.float32)
        acc += bias[None, :]
    return acc


@_tuning.autotune(configs=_FWD_CONFIGS, key=["H", "V_PER_SPLIT", "DTYPE_KEY"],
                  prune_configs_by=_prune_by_dtype(_FWD_FP32))
@triton.jit
def _masked_lm_loss_fwd_kernel(
    h_ptr,          # (N, H) hidden states, any strides
    w_ptr,          # (V, H) weight, any strides
    b_ptr,          # (V,) bias (unused unless HAS_BIAS)
    tgt_ptr,        # (N,) int64 targets, by position
    rows_ptr,       # (N,) int32 compacted valid row positions; entries >= count are unused
    count_ptr,      # (1,) int32 number of valid rows (device)
    part_m_ptr,     # (SPLIT, N) fp32 out: running max of log2-scaled logits, per compacted row
    part_s_ptr,     # (SPLIT, N) fp32 out: sum of exp2(z*log2e - max)
    part_zt_ptr,    # (SPLIT, N) fp32 out: target logit if the target lies in this slice, else 0
    part_zsum_ptr,  # (SPLIT, N) fp32 out: sum of logits in this slice (only if SMOOTH)
    N, V, H,        # sizes
    V_PER_SPLIT,    # columns per vocabulary slice (a multiple of 256)
    stride_hn, stride_hh, stride_wv, stride_wh, stride_b,
    DTYPE_KEY,      # the input dtype, as an autotune key only
    HAS_BIAS: tl.constexpr, SMOOTH: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    count = tl.load(count_ptr)
    start_m = pid_m * BLOCK_M
    # Row blocks past the valid rows do nothing: their partials are never read.
    if start_m < count:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        mask_m = offs_m < count
        rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        tgt = tl.load(tgt_ptr + rows, mask=mask_m, other=-1)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        s_i = tl.zeros((BLOCK_M,), tl.float32)
        zt_i = tl.zeros((BLOCK_M,), tl.float32)
        zsum_i = tl.zeros((BLOCK_M,), tl.float32)
        v_start = pid_s * V_PER_SPLIT
        v_end = tl.minimum(v_start + V_PER_SPLIT, V)
        h_row = h_ptr + rows[:, None] * stride_hn
        # Every slice holds at least one column (the launcher sizes SPLIT so), so m_i is finite after
        # the first tile and exp2(m_i - m_new) never sees -inf - -inf.
        for v0 in range(v_start, v_end, BLOCK_N):
            offs_n = v0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < v_end
            w_col = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wv
            acc = _logit_tile(h_row, w_col, b_ptr, offs_n, mask_m, mask_n, H, stride_hh, stride_wh, stride_b,
                              HAS_BIAS, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
            z2 = tl.where(mask_n[None, :], acc * 1.4426950408889634, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(z2, axis=1))
            s_i = s_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(z2 - m_new[:, None]), axis=1)
            m_i = m_new
            zt_i += tl.sum(tl.where(offs_n[None, :] == tgt[:, None], acc, 0.0), axis=1)
            if SMOOTH:
                zsum_i += tl.sum(tl.where(mask_n[None, :], acc, 0.0), axis=1)
        _store_partials(part_m_ptr, part_s_ptr, part_zt_ptr, part_zsum_ptr, pid_s.to(tl.int64) * N + offs_m,
                        mask_m, m_i, s_i, zt_i, zsum_i, SMOOTH, True)


@triton.jit
def _store_partials(part_m_ptr, part_s_ptr, part_zt_ptr, part_zsum_ptr, out, mask, m, s, zt, zsum,
                    SMOOTH: tl.constexpr, ZT: tl.constexpr):
    """One slice's (or tile's) row statistics into the (SPLIT, N) partials the combine kernel merges."""
    tl.store(part_m_ptr + out, m, mask=mask)
    tl.store(part_s_ptr + out, s, mask=mask)
    if ZT:
        tl.store(part_zt_ptr + out, zt, mask=mask)
    if SMOOTH:
        tl.store(part_zsum_ptr + out, zsum, mask=mask)


@triton.jit
def _masked_lm_loss_combine_kernel(
    tgt_ptr, rows_ptr, count_ptr,
    part_m_ptr, part_s_ptr, part_zt_ptr, part_zsum_ptr,  # (SPLIT, N) fp32 partials of the forward kernel
    loss_ptr,       # (N,) fp32 out, by position (pre-zeroed: ignored positions stay 0)
    lse_ptr,        # (N,) fp32 out, by position (pre-zeroed)
    h_ptr, w_ptr, b_ptr,  # ZT_DOT: hidden (by position), weight and bias, for the target logits
    N, V, H, SPLIT,
    smooth_eps,     # label smoothing eps
    stride_hn, stride_hh, stride_wv, stride_wh, stride_b,
    SMOOTH: tl.constexpr, ZT_DOT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Merges the forward's per-tile partials of each valid row into its loss and lse. With ZT_DOT the
    target's logit is not in the partials (the TMA forward's tiles skip it): it is the row's dot product with
    the target's weight row (plus its bias), in fp32 from the inputs' values."""
    pid = tl.program_id(0)
    count = tl.load(count_ptr)
    start = pid * BLOCK
    if start < count:
        offs = start + tl.arange(0, BLOCK)
        mask = offs < count
        rows = tl.load(rows_ptr + offs, mask=mask, other=0).to(tl.int64)
        tgt = tl.load(tgt_ptr + rows, mask=mask, other=0)
        # (BLOCK_S, BLOCK) tiles of partials, rows contiguous, online over the tiles: each tile's max
        # rescales the running sum (exp2(-inf) = 0 on the first tile). Many loads in flight per program:
        # one slice per step made this a chain of SPLIT dependent loads (33 us at BERT-base, H100 run156).
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK,), tl.float32)
        zt = tl.zeros((BLOCK,), tl.float32)
        zsum = tl.zeros((BLOCK,), tl.float32)
        for s0 in range(0, SPLIT, BLOCK_S):
            sl = s0 + tl.arange(0, BLOCK_S)
            m2 = (sl < SPLIT)[:, None] & mask[None, :]
            off2 = sl.to(tl.int64)[:, None] * N + offs[None, :]
            ms = tl.load(part_m_ptr + off2, mask=m2, other=float("-inf"))
            ss = tl.load(part_s_ptr + off2, mask=m2, other=0.0)
            m_new = tl.maximum(m, tl.max(ms, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (rows past the count: all -inf)
            total = total * tl.exp2(m - m_safe) + tl.sum(ss * tl.exp2(ms - m_safe[None, :]), 0)
            m = m_new
            if not ZT_DOT:
                zt += tl.sum(tl.load(part_zt_ptr + off2, mask=m2, other=0.0), 0)
            if SMOOTH:
                zsum += tl.sum(tl.load(part_zsum_ptr + off2, mask=m2, other=0.0), 0)
        if ZT_DOT:
            t_in = mask & (tgt >= 0) & (tgt < V)
            t_row = tl.where(t_in, tgt, 0)
            for h0 in range(0, H, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                hm = t_in[:, None] & (offs_h < H)[None, :]
                hv = tl.load(h_ptr + rows[:, None] * stride_hn + offs_h[None, :] * stride_hh, mask=hm, other=0.0)
                wv = tl.load(w_ptr + t_row[:, None] * stride_wv + offs_h[None, :] * stride_wh, mask=hm, other=0.0)
                zt += tl.sum(hv.to(tl.float32) * wv.to(tl.float32), 1)
            if HAS_BIAS:
                zt += tl.load(b_ptr + t_row * stride_b, mask=t_in, other=0.0).to(tl.float32)
        lse = (m + tl.log2(tl.where(mask, total, 1.0))) * 0.6931471805599453
        loss = lse - (1.0 - smooth_eps) * zt
        if SMOOTH:
            loss -= (smooth_eps / V) * zsum
        # A target outside [0, V) addressed no memory; its loss is NaN so it cannot pass unnoticed.
        in_range = (tgt >= 0) & (tgt < V)
        loss = tl.where(in_range, loss, float("nan"))
        tl.store(loss_ptr + rows, loss, mask=mask)
        tl.store(lse_ptr + rows, lse, mask=mask)


@triton.jit
def _dlogits_block(h_ptr, w_ptr, b_ptr, tgt_ptr, rows_ptr, lse_ptr, gloss_ptr, dl_ptr, V, H, v_off, VC,
                   stride_hn, stride_hh, stride_wv, stride_wh, stride_b, stride_dl, stride_g, smooth_eps,
                   start_m, pid_n, n_rows, count, mismatch, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (BLOCK_M rows from ``start_m``, BLOCK_N columns) tile of ``_masked_lm_loss_dlogits_kernel``."""
    offs_c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)   # column within the chunk
    mask_n = offs_c < VC
    offs_n = v_off + offs_c                              # vocabulary column
    w_col = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wv
    offs_m = start_m + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    tgt = tl.load(tgt_ptr + rows, mask=mask_m, other=-1)
    lse2 = tl.load(lse_ptr + rows, mask=mask_m, other=0.0) * 1.4426950408889634
    g = tl.load(gloss_ptr + rows * stride_g, mask=mask_m, other=0.0)
    h_row = h_ptr + rows[:, None] * stride_hn
    acc = _logit_tile(h_row, w_col, b_ptr, offs_n, mask_m, mask_n, H, stride_hh, stride_wh, stride_b,
                      HAS_BIAS, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    d = _dlogits_tile(acc, tgt, lse2, g, offs_n, smooth_eps, V)
    d = tl.where((offs_m < count)[:, None], d, 0.0)  # (capacity rows past the count)
    if mismatch:
        d = tl.full((BLOCK_M, BLOCK_N), float("nan"), tl.float32)
    dst = dl_ptr + offs_m.to(tl.int64)[:, None] * stride_dl + offs_c[None, :]
    tl.store(dst, d.to(dl_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@_tuning.autotune(configs=_DLOGITS_CONFIGS, key=["H", "VC", "DTYPE_KEY"],
                  prune_configs_by=_prune_by_dtype(_DLOGITS_FP32))
@triton.jit(do_not_specialize=["v_off", "VC", "expected_count"])
def _masked_lm_loss_dlogits_kernel(
    h_ptr, w_ptr, b_ptr, tgt_ptr, rows_ptr, count_ptr,
    lse_ptr,        # (N,) fp32 lse, by position
    gloss_ptr,      # (N,) fp32 upstream gradient of the per-position loss
    dl_ptr,         # (N, VC) out: dlogits of this chunk, compacted rows, weight dtype
    N, V, H,
    v_off,          # first vocabulary column of this chunk
    VC,             # columns in this chunk
    stride_hn, stride_hh, stride_wv, stride_wh, stride_b,
    stride_dl,      # row stride of the dlogits buffer
    stride_g,       # stride of the upstream gradient (0: one value for every position, a mean's or sum's)
    smooth_eps,
    expected_count,  # the sized backward's host count (-1: none); a mismatch poisons dz with NaN
    capacity,       # 1: expected_count is an upper bound (max_valid): rows past the device count get dz 0,
                    # and only a device count above it poisons
    DTYPE_KEY,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROW_LOOP: tl.constexpr,  # the grid's row programs may be fewer than the row blocks: each walks every
                             # m_programs-th one (the bounded backward's overflow pass)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # One grid axis (no 65535 limit on the row blocks), column tiles varying fastest: the programs of
    # the valid row blocks come first in launch order and the ones that exit at once (row blocks past
    # count) trail behind them. The chunk's weight slice and the valid rows are L2-resident, so this
    # order costs no reuse.
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(VC, BLOCK_N)
    pid_n = pid % n_tiles
    pid_m = pid // n_tiles
    count = tl.load(count_ptr)
    # The sized backward passes its host count: the buffer and grid hold exactly that many rows, and
    # if the device disagrees every dz of the call is NaN (rows past the device count read entry 0 of
    # the compaction, a valid position) so that no gradient comes out silently partial.
    n_rows = count
    mismatch = False
    if expected_count >= 0:
        n_rows = expected_count
        if capacity:
            mismatch = count > expected_count
        else:
            mismatch = count != expected_count
    if ROW_LOOP:  # (a grid sized for every possible row block is tens of thousands of programs that only exit
        # where the overflow pass has no row, its usual case)
        m_programs = tl.num_programs(0) // n_tiles
        for start_m in range(pid_m * BLOCK_M, n_rows, m_programs * BLOCK_M):
            _dlogits_block(h_ptr, w_ptr, b_ptr, tgt_ptr, rows_ptr, lse_ptr, gloss_ptr, dl_ptr, V, H, v_off, VC,
                           stride_hn, stride_hh, stride_wv, stride_wh, stride_b, stride_dl, stride_g, smooth_eps,
                           start_m, pid_n, n_rows, count, mismatch, HAS_BIAS, DOT_PRECISION, BLOCK_M, BLOCK_N,
                           BLOCK_K)
    else:
        start_m = pid_m * BLOCK_M
        if start_m < n_rows:
            _dlogits_block(h_ptr, w_ptr, b_ptr, tgt_ptr, rows_ptr, lse_ptr, gloss_ptr, dl_ptr, V, H, v_off, VC,
                           stride_hn, stride_hh, stride_wv, stride_wh, stride_b, stride_dl, stride_g, smooth_eps,
                           start_m, pid_n, n_rows, count, mismatch, HAS_BIAS, DOT_PRECISION, BLOCK_M, BLOCK_N,
                           BLOCK_K)


@triton.jit
def _dweight_tile(
    h_ptr, rows_ptr, dl_ptr, dw_ptr, db_ptr, count, pid_n, pid_h,
    H, v_off, VC, stride_hn, stride_hh, stride_dl,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dW[v_off + tile, h tile] = dz[:count, tile]^T h[rows[:count], h tile], fp32 accumulator, written
    once in the weight dtype; the first H tile also writes dbias = sum of dz over rows. ACCUMULATE: added to
    the dW and dbias an earlier pass wrote (the bounded backward's overflow rows), and with no rows
    (count 0) nothing is read or written, so that pass's values stay bit for bit."""
    offs_c = pid_n * BLOCK_A + tl.arange(0, BLOCK_A)
    mask_n = offs_c < VC
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    acc = tl.zeros((BLOCK_A, BLOCK_H), tl.float32)
    db = tl.zeros((BLOCK_A,), tl.float32)
    # K loop over the valid rows only: count comes from device memory.
    for k0 in range(0, count, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < count
        rows = tl.load(rows_ptr + offs_k, mask=mask_k, other=0).to(tl.int64)
        dl = tl.load(dl_ptr + offs_k.to(tl.int64)[:, None] * stride_dl + offs_c[None, :],
                     mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        hh = tl.load(h_ptr + rows[:, None] * stride_hn + offs_h[None, :] * stride_hh,
                     mask=mask_k[:, None] & mask_h[None, :], other=0.0)
        acc = tl.dot(tl.trans(dl), hh, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            db += tl.sum(dl.to(tl.float32), axis=0)
    offs_v = (v_off + offs_c).to(tl.int64)
    dw_at = dw_ptr + offs_v[:, None] * H + offs_h[None, :]
    mask_w = mask_n[:, None] & mask_h[None, :]
    if ACCUMULATE:
        if count > 0:
            acc += tl.load(dw_at, mask=mask_w, other=0.0).to(tl.float32)
            tl.store(dw_at, acc.to(dw_ptr.dtype.element_ty), mask=mask_w)
            if HAS_BIAS:
                if pid_h == 0:
                    db += tl.load(db_ptr + offs_v, mask=mask_n, other=0.0).to(tl.float32)
                    tl.store(db_ptr + offs_v, db.to(db_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(dw_at, acc.to(dw_ptr.dtype.element_ty), mask=mask_w)
        if HAS_BIAS:
            if pid_h == 0:
                tl.store(db_ptr + offs_v, db.to(db_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _dhidden_block(
    w_ptr, rows_ptr, dl_ptr, acc_ptr, dh_ptr, count, start_m, pid_h,
    H, v_off, VC, stride_wv, stride_wh, stride_dl,
    is_first, is_last, c0, c1, split, part_ptr, DOT_PRECISION: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (BLOCK_A rows from ``start_m``, BLOCK_H columns) tile of ``_dhidden_tile`` over the chunk's columns
    [c0, c1). ``split``: the fp32 sum goes as it is to ``part_ptr`` (a split's slot of the partial sums, which
    ``_dhidden_reduce_kernel`` adds) instead of into the accumulator or dhidden."""
    offs_m = start_m + tl.arange(0, BLOCK_A)
    mask_m = offs_m < count
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    acc = tl.zeros((BLOCK_A, BLOCK_H), tl.float32)
    dl_row = dl_ptr + offs_m.to(tl.int64)[:, None] * stride_dl
    for k0 in range(c0, c1, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < c1
        dl = tl.load(dl_row + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        ww = tl.load(w_ptr + (v_off + offs_k).to(tl.int64)[:, None] * stride_wv + offs_h[None, :] * stride_wh,
                     mask=mask_k[:, None] & mask_h[None, :], other=0.0)
        acc = tl.dot(dl, ww, acc, input_precision=DOT_PRECISION)
    mask = mask_m[:, None] & mask_h[None, :]
    acc_off = offs_m.to(tl.int64)[:, None] * H + offs_h[None, :]
    if split:
        tl.store(part_ptr + acc_off, acc, mask=mask)
    else:
        _dhidden_finish(acc, acc_ptr, acc_off, rows_ptr, dh_ptr, offs_m, mask_m, offs_h, mask, H, is_first, is_last)


@triton.jit
def _dhidden_finish(acc, acc_ptr, acc_off, rows_ptr, dh_ptr, offs_m, mask_m, offs_h, mask, H, is_first, is_last):
    """A dhidden tile's fp32 sum over this chunk's columns (rows offs_m of the compacted rows, columns offs_h) plus
    the accumulator after the first chunk: into the accumulator, or on the last chunk cast to dhidden at each row's
    position (``rows_ptr``). ``_dhidden_block`` and ``_dhidden_reduce_kernel`` end with it."""
    if is_first == 0:
        acc += tl.load(acc_ptr + acc_off, mask=mask, other=0.0)
    if is_last != 0:
        rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        tl.store(dh_ptr + rows[:, None] * H + offs_h[None, :], acc.to(dh_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(acc_ptr + acc_off, acc, mask=mask)


@triton.jit
def _dhidden_tile(
    w_ptr, rows_ptr, dl_ptr, acc_ptr, dh_ptr, count, pid_m, pid_h,
    H, v_off, VC, stride_wv, stride_wh, stride_dl,
    is_first, is_last, m_programs, k_splits, ks, part_ptr, part_rows, DOT_PRECISION: tl.constexpr,
    ROW_LOOP: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dh[rows tile, h tile] (+)= dz[rows tile, :VC] W[v_off:v_off+VC, h tile]: fp32 accumulator carried
    across chunks in acc_ptr (compacted rows); the last chunk writes the hidden dtype by position. ROW_LOOP: row
    block pid_m and every m_programs-th one after it (the grid's row programs may be fewer than the row blocks),
    and with ``k_splits`` > 1 only the ks-th of k_splits even column ranges, its fp32 sum into slot ks of the
    (k_splits, part_rows, H) partial sums (``_dhidden_reduce_kernel`` adds them in order)."""
    if ROW_LOOP:
        span = tl.cdiv(tl.cdiv(VC, k_splits), BLOCK_K) * BLOCK_K
        c0 = ks * span
        c1 = tl.minimum(VC, c0 + span)
        part = part_ptr + ks.to(tl.int64) * part_rows * H
        for start_m in range(pid_m * BLOCK_A, count, m_programs * BLOCK_A):
            _dhidden_block(w_ptr, rows_ptr, dl_ptr, acc_ptr, dh_ptr, count, start_m, pid_h, H, v_off, VC,
                           stride_wv, stride_wh, stride_dl, is_first, is_last, c0, c1, k_splits > 1, part,
                           DOT_PRECISION, BLOCK_A, BLOCK_H, BLOCK_K)
    else:
        start_m = pid_m * BLOCK_A
        if start_m < count:
            _dhidden_block(w_ptr, rows_ptr, dl_ptr, acc_ptr, dh_ptr, count, start_m, pid_h, H, v_off, VC,
                           stride_wv, stride_wh, stride_dl, is_first, is_last, 0, VC, False, acc_ptr,
                           DOT_PRECISION, BLOCK_A, BLOCK_H, BLOCK_K)


@triton.jit(do_not_specialize=["part_rows", "k_splits", "is_first", "is_last"])
def _dhidden_reduce_kernel(part_ptr, acc_ptr, rows_ptr, count_ptr, dh_ptr, H, part_rows, k_splits, is_first,
                           is_last, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The split dhidden of ``_dhidden_tile`` (ROW_LOOP, k_splits > 1) for the first ``count`` compacted rows:
    the k_splits slots added in order, then as ``_dhidden_block``'s own sum (``_dhidden_finish``): plus the
    accumulator after the first chunk, into the accumulator, or on the last chunk cast to dhidden at each row's
    position. Programs wholly past the count exit."""
    pid = tl.program_id(0)
    c_tiles = tl.cdiv(H, BLOCK_C)
    offs_r = (pid // c_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = (pid % c_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
    count = tl.load(count_ptr)
    if (pid // c_tiles) * BLOCK_R < count:
        mask_r = offs_r < count
        mask = mask_r[:, None] & (offs_c < H)[None, :]
        off = offs_r.to(tl.int64)[:, None] * H + offs_c[None, :]
        acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
        slot = part_rows.to(tl.int64) * H
        for ks in range(0, k_splits):
            acc += tl.load(part_ptr + ks * slot + off, mask=mask, other=0.0)
        _dhidden_finish(acc, acc_ptr, off, rows_ptr, dh_ptr, offs_r, mask_r, offs_c, mask, H, is_first, is_last)


@_tuning.autotune(configs=_BWD_CONFIGS, key=["H", "VC", "DTYPE_KEY", "is_first", "is_last", "do_dw", "k_splits"],
                  prune_configs_by=_prune_by_dtype(_BWD_FP32), restore_value=["acc_ptr", "dw_ptr", "db_ptr"])
@triton.jit(do_not_specialize=["v_off", "VC", "is_first", "is_last", "do_dw", "k_splits", "part_rows"])
def _masked_lm_loss_bwd_kernel(
    h_ptr, w_ptr, rows_ptr, count_ptr,
    dl_ptr,         # (N, VC) dlogits of this chunk (compacted rows)
    dw_ptr,         # (V, H) out: weight gradient (contiguous); rows v_off .. v_off + VC written here
    db_ptr,         # (V,) out: bias gradient (only if HAS_BIAS)
    acc_ptr,        # (N, H) fp32 dhidden accumulator across chunks (compacted rows; unused with one chunk)
    dh_ptr,         # (N, H) out: hidden gradient by position (contiguous, pre-zeroed), written on the last chunk
    H, v_off, VC,
    stride_hn, stride_hh, stride_wv, stride_wh, stride_dl,
    DTYPE_KEY,
    is_first,       # 1 on the first chunk: nothing to accumulate onto yet
    is_last,        # 1 on the last chunk: write dhidden instead of the accumulator
    do_dw,          # 0: no dW programs (weight and bias need no gradient); the grid then holds dhidden only
    k_splits,       # ROW_LOOP: the dhidden programs split the chunk's columns k_splits ways (1: not split)
    part_ptr,       # k_splits > 1: (k_splits, part_rows, H) fp32 partial sums of dhidden (else unused)
    part_rows,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # dW and dbias added to an earlier pass's (``_dweight_tile``)
    ROW_LOOP: tl.constexpr,    # the dhidden programs may be fewer than the row blocks (``_dhidden_tile``)
    BLOCK_A: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # dW (reduction over the valid rows) and dhidden (reduction over the chunk's columns) both only read
    # the chunk's dlogits, so one launch runs them side by side: at 15% masking neither fills the GPU
    # alone (a 1024-column chunk has 48 dW tiles; 2446 rows have 120 dhidden tiles).
    pid = tl.program_id(0)
    count = tl.load(count_ptr)
    h_tiles = tl.cdiv(H, BLOCK_H)
    dw_programs = tl.cdiv(VC, BLOCK_A) * h_tiles * do_dw  # the first programs compute dW tiles, the rest dhidden
    if pid < dw_programs:
        _dweight_tile(h_ptr, rows_ptr, dl_ptr, dw_ptr, db_ptr, count, pid // h_tiles, pid % h_tiles,
                      H, v_off, VC, stride_hn, stride_hh, stride_dl,
                      HAS_BIAS, DOT_PRECISION, ACCUMULATE, BLOCK_A, BLOCK_H, BLOCK_K)
    else:
        q = pid - dw_programs
        per_split = (tl.num_programs(0) - dw_programs) // k_splits  # (ROW_LOOP: row programs x H tiles a split)
        ks = q // per_split
        q = q % per_split
        m_programs = per_split // h_tiles
        _dhidden_tile(w_ptr, rows_ptr, dl_ptr, acc_ptr, dh_ptr, count, q // h_tiles, q % h_tiles,
                      H, v_off, VC, stride_wv, stride_wh, stride_dl,
                      is_first, is_last, m_programs, k_splits, ks, part_ptr, part_rows, DOT_PRECISION, ROW_LOOP,
                      BLOCK_A, BLOCK_H, BLOCK_K)


@triton.jit(do_not_specialize=["v_off", "VC", "n_rows"])
def _logits_tma_kernel(
    a_ptr,          # (R, H) compacted hidden rows, row stride lda (16-byte multiple), columns contiguous
    w_ptr,          # (V, H) weight, row stride stride_wv (16-byte multiple), columns contiguous
    out_ptr,        # DZ: (M, VC) dlogits of the chunk, row stride ldo (16-byte multiple); else unused
    b_ptr, tgt_ptr, rows_ptr, count_ptr,
    lse_ptr, gloss_ptr,                                  # DZ: saved lse and upstream grad, by position
    part_m_ptr, part_s_ptr, part_zt_ptr, part_zsum_ptr,  # not DZ: (n_vtiles, N) per-tile partials
    N, V, H, R, v_off, VC,
    n_rows,         # rows to cover (-1: read the device count)
    capacity,       # 1: n_rows is an upper bound (max_valid): rows past the device count get dz 0, and
                    # only a device count above n_rows poisons
    lda, stride_wv, ldo, stride_b, stride_g, smooth_eps,
    NUM_PROGRAMS: tl.constexpr, DZ: tl.constexpr, HAS_BIAS: tl.constexpr, SMOOTH: tl.constexpr,
    ZT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Persistent logit tiles z = h_c W[v_off:v_off + VC]^T through Hopper tensor descriptors (TMA), with
    one of two epilogues: DZ writes dz (the sized backward's dlogits), else the tile's row statistics
    go to the per-tile partials that ``_masked_lm_loss_combine_kernel`` merges (the forward). The row
    blocks vary fastest, so the programs in flight share the weight tile they stream. The descriptors
    are built on the device, once per persistent program (host-built ones cost ~35 us of host time per
    launch to encode)."""
    count = tl.load(count_ptr)
    # The forward covers the device count (n_rows = -1); the sized backward its host count, and if the
    # device disagrees every dz is NaN (as in ``_masked_lm_loss_dlogits_kernel``).
    mismatch = False
    if n_rows < 0:
        n_rows = count
    elif capacity:
        mismatch = count > n_rows
    else:
        mismatch = count != n_rows
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[R, H], strides=[lda, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[V, H], strides=[stride_wv, 1], block_shape=[BLOCK_N, BLOCK_K])
    if DZ:
        # rows past M and columns past VC are clipped on store
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[n_rows, VC], strides=[ldo, 1],
                                             block_shape=[BLOCK_M, BLOCK_N])
    m_tiles = tl.cdiv(n_rows, BLOCK_M)
    n_tiles = m_tiles * tl.cdiv(VC, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_tiles, NUM_PROGRAMS, flatten=True):
        pid_m = tile % m_tiles
        pid_n = tile // m_tiles
        off_m = pid_m * BLOCK_M
        off_c = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            a = a_desc.load([off_m, k0])
            b = w_desc.load([v_off + off_c, k0])
            acc = tl.dot(a, b.T, acc)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n_rows
        offs_c = off_c + tl.arange(0, BLOCK_N)
        offs_n = v_off + offs_c
        mask_n = (offs_c < VC) & (offs_n < V)  # (the sized backward may pad the last chunk past V)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n.to(tl.int64) * stride_b, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if DZ or ZT:
            rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
            tgt = tl.load(tgt_ptr + rows, mask=mask_m, other=-1)
        else:
            tgt = offs_m  # (unused)
        if DZ:
            lse2 = tl.load(lse_ptr + rows, mask=mask_m, other=0.0) * 1.4426950408889634
            g = tl.load(gloss_ptr + rows * stride_g, mask=mask_m, other=0.0)
            d = tl.where(mask_n[None, :] & (offs_m < count)[:, None],
                         _dlogits_tile(acc, tgt, lse2, g, offs_n, smooth_eps, V), 0.0)
            if mismatch:
                d = tl.full((BLOCK_M, BLOCK_N), float("nan"), tl.float32)
            out_desc.store([off_m, off_c], d.to(out_ptr.dtype.element_ty))
        else:
            m, s, zt, zsum = _tile_stats(acc, tgt, offs_n, mask_n, SMOOTH, ZT)
            _store_partials(part_m_ptr, part_s_ptr, part_zt_ptr, part_zsum_ptr, pid_n.to(tl.int64) * N + offs_m,
                            mask_m, m, s, zt, zsum, SMOOTH, ZT)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


_DTYPE_KEYS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def _dtype_key(dtype: torch.dtype) -> int:
    return _DTYPE_KEYS[dtype]


@triton.jit
def _compact_kernel(tgt_ptr, rows_ptr, count_ptr, loss_ptr, lse_ptr, N, ignore_index, BLOCK: tl.constexpr,
                    SCAN: tl.constexpr):
    """rows[:count] = positions with target != ignore_index in increasing order, rows[count:] = 0 (a valid
    position to read), count, and loss = lse = 0 everywhere (the forward fills the valid positions). Program p
    owns positions [p BLOCK, (p + 1) BLOCK): it counts the valid targets before its slice and in all (one pass
    over the targets, SCAN at a time: N <= COMPACT_KERNEL_MAX_N, mostly from L2), then writes its slice's
    rows at that base plus their prefix sum, its slice of loss and lse, and its slice of rows[count:].
    (One program walking the slices in turn took 15 us at BERT-base's 16384 positions, this 3.5: H100 run159.)"""
    pid = tl.program_id(0)
    start = pid * BLOCK
    before = tl.zeros((), tl.int32)
    total = tl.zeros((), tl.int32)
    for s0 in range(0, N, SCAN):
        offs_s = s0 + tl.arange(0, SCAN)
        t = tl.load(tgt_ptr + offs_s, mask=offs_s < N, other=ignore_index)
        valid = (t != ignore_index).to(tl.int32)
        total += tl.sum(valid, 0)
        before += tl.sum(tl.where(offs_s < start, valid, 0), 0)
    offs = start + tl.arange(0, BLOCK)
    in_n = offs < N
    t = tl.load(tgt_ptr + offs, mask=in_n, other=ignore_index)
    valid = ((t != ignore_index) & in_n).to(tl.int32)
    pos = before + tl.cumsum(valid, 0) - 1
    tl.store(rows_ptr + pos, offs, mask=valid != 0)
    tl.store(loss_ptr + offs, tl.zeros((BLOCK,), tl.float32), mask=in_n)
    tl.store(lse_ptr + offs, tl.zeros((BLOCK,), tl.float32), mask=in_n)
    tl.store(rows_ptr + offs, tl.zeros((BLOCK,), tl.int32), mask=in_n & (offs >= total))  # (disjoint slots)
    if pid == 0:
        tl.store(count_ptr, total)


# Above this many positions the compaction uses torch's multi-block scan (each program of the kernel reads
# every target).
COMPACT_KERNEL_MAX_N = 1 << 16
# The compaction's (positions a program, targets a counting step, warps): H100 run159 3.5 us at BERT-base's 16384
# positions (the one-program kernel before it 15 us), the fastest of six.
COMPACT_CONFIG = (1024, 8192, 8)


def compact(target: torch.Tensor, ignore_index: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``target`` (N,) int64 -> (rows (N,) int32, count (1,) int32, loss (N,) fp32 zeros, lse (N,) fp32
    zeros) in one launch, the result ``pykernels.masked_lm_loss.compact_rows`` gives with torch ops (7
    launches) plus the forward's zeroed outputs; None when N is past ``COMPACT_KERNEL_MAX_N`` or 0."""
    n = target.numel()
    if n == 0 or n > COMPACT_KERNEL_MAX_N:
        return None
    dev = target.device
    rows = empty(n, dtype=torch.int32, device=dev)
    count = empty(1, dtype=torch.int32, device=dev)
    loss = empty(n, dtype=torch.float32, device=dev)
    lse = empty(n, dtype=torch.float32, device=dev)
    block, scan, warps = (16, 32, 1) if _INTERPRET else COMPACT_CONFIG
    scan = min(scan, max(triton.next_power_of_2(n), block))
    _launch.fast(_compact_kernel)[(_tuning.cdiv(n, block),)](
        target.contiguous(), rows, count, loss, lse, n, int(ignore_index), BLOCK=block, SCAN=scan, num_warps=warps)
    return rows, count, loss, lse


@triton.jit
def _gather_rows_kernel(h_ptr, rows_ptr, count_ptr, out_ptr, H, R, stride_hn, stride_hh,
                        ZERO_TAIL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[i] = h[rows[i]] for i < min(count, R) (device count, R rows in ``out``): the valid rows,
    compacted. Rows past count are left as they are (the logits kernel never reads them into a result;
    the sized backward's dz is NaN when its host count is not the device's), or with ZERO_TAIL set to 0
    (the capacity backward's rows past the count: their dz is 0, and 0 x NaN would not be)."""
    start = tl.program_id(0) * BLOCK_R
    count = tl.minimum(tl.load(count_ptr), R)
    if ZERO_TAIL:
        offs_t = start + tl.arange(0, BLOCK_R)
        tail = (offs_t >= count) & (offs_t < R)
        if start + BLOCK_R > count:
            for h0 in range(0, H, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * H + offs_h[None, :],
                         tl.zeros((BLOCK_R, BLOCK_H), out_ptr.dtype.element_ty),
                         mask=tail[:, None] & (offs_h < H)[None, :])
    if start < count:
        offs_r = start + tl.arange(0, BLOCK_R)
        mask_r = offs_r < count
        rows = tl.load(rows_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask = mask_r[:, None] & (offs_h < H)[None, :]
            x = tl.load(h_ptr + rows[:, None] * stride_hn + offs_h[None, :] * stride_hh, mask=mask)
            tl.store(out_ptr + offs_r.to(tl.int64)[:, None] * H + offs_h[None, :], x, mask=mask)


@triton.jit
def _scatter_rows_kernel(acc_ptr, rows_ptr, count_ptr, tgt_ptr, dh_ptr, tail_ptr, wt_ptr, N, M, H, ignore_index,
                         stride_acc, n_tail, stride_tail, stride_wt,
                         capacity, ZERO_IGNORED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """dhidden by position from the compacted rows: dh[rows[i]] = acc[i] (cast) for i < M (the first
    cdiv(M, BLOCK_R) programs); with ZERO_IGNORED the other cdiv(N, BLOCK_R) programs write 0 at every
    position whose target is ``ignore_index``, so every position is written once, with no memset. If the
    device count is not M (``capacity``: above M; M rows are an upper bound and those past the count are
    not positions), those programs write NaN at the valid positions too (as the dz kernels do): never a
    silently partial gradient. ``n_tail`` (< 8) more columns of dlogits (``tail`` (M, n_tail)) and rows of the
    weight (``wt``) are added to acc on the way, in fp32: the last chunk's odd tail, which as a cuBLAS GEMM
    read and wrote all of acc (10 us at BERT-base, H100 run156)."""
    pid = tl.program_id(0)
    row_programs = tl.cdiv(M, BLOCK_R)
    offs_r = (pid % row_programs) * BLOCK_R + tl.arange(0, BLOCK_R)
    count = tl.load(count_ptr)
    if pid < row_programs:
        mask_r = (offs_r < M) & (offs_r < count)
        pos = tl.load(rows_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask = mask_r[:, None] & (offs_h < H)[None, :]
            x = tl.load(acc_ptr + offs_r.to(tl.int64)[:, None] * stride_acc + offs_h[None, :], mask=mask)
            x = x.to(tl.float32)  # (acc is fp32, or the one chunk's product in the input dtype)
            for j in range(0, n_tail):
                dc = tl.load(tail_ptr + offs_r.to(tl.int64) * stride_tail + j, mask=mask_r, other=0.0)
                wr = tl.load(wt_ptr + j * stride_wt + offs_h, mask=offs_h < H, other=0.0)
                x += dc.to(tl.float32)[:, None] * wr.to(tl.float32)[None, :]
            tl.store(dh_ptr + pos[:, None] * H + offs_h[None, :], x.to(dh_ptr.dtype.element_ty), mask=mask)
    elif ZERO_IGNORED:
        offs_p = (pid - row_programs) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask_p = offs_p < N
        t = tl.load(tgt_ptr + offs_p, mask=mask_p, other=0)
        ignored = t == ignore_index
        if capacity:
            bad = count > M
        else:
            bad = count != M
        fill = tl.where(ignored, 0.0, float("nan"))
        write = mask_p & (ignored | bad)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            val = tl.zeros((BLOCK_R, BLOCK_H), tl.float32) + fill[:, None]
            tl.store(dh_ptr + offs_p.to(tl.int64)[:, None] * H + offs_h[None, :], val.to(dh_ptr.dtype.element_ty),
                     mask=write[:, None] & (offs_h < H)[None, :])


# Logit tiles through Hopper tensor descriptors (``_logits_tma_kernel``) where they apply (sm_90+,
# fp16/bf16, 16-byte aligned rows); PYKERNELS_MLM_TMA=0 keeps the pointer kernels everywhere.
USE_TMA = os.environ.get("PYKERNELS_MLM_TMA", "1") not in ("", "0")
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the TMA logits kernel, forward (statistics epilogue) and
# backward (dz epilogue). The forward's was fastest at BERT-base and GPT-2 sizes in three runs of 8 tiles
# timed with do_bench on an H200 (benchmarks/dev/mlm_tma_probe.py). The backward's from the same tiles
# timed in GPU time (a public forward+backward's kernels, torch.profiler; do_bench ranks them by host noise
# at BERT-base, where the sized backward is host-bound): H100 run151, 128 x 256 x 64 took BERT-base MLM
# from 945 to 898 us and GPT-2 from 4822 to 4718 us against the 128 x 128 x 128 before it
# (benchmarks/dev/mlm_config_gpu_sweep.py, benchmarks/results/mlm_config_gpu_sweep_*_run151.txt).
TMA_FWD_CONFIG = (256, 128, 64, 8, 3)
TMA_DZ_CONFIG = (128, 256, 64, 8, 3)
# The TMA forward's transient buffers, the (N, H) compacted rows and the per-tile partials (one per
# BLOCK_N vocabulary columns), are sized for all N rows (the count stays on the device); above this many
# bytes the forward keeps the pointer kernel (gathered rows, ~32 vocabulary slices: ~32 partials a row).
# BERT-base MLM: 24 + 47 MiB; GPT-2: 12 + 38 MiB, both freed before the backward's peak.
TMA_FWD_BUDGET_BYTES = 128 * 2**20


def _num_programs(device: torch.device) -> int:
    """Persistent programs of the TMA kernel: one per SM (4 under the interpreter)."""
    return 4 if _INTERPRET else _tuning.device_properties(device).multi_processor_count


def tma_applies(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the logit tiles can come through tensor descriptors: Hopper or newer (the interpreter
    emulates descriptors), fp16/bf16, and the weight's rows contiguous with 16-byte aligned base and
    row stride (the compacted hidden rows are a fresh contiguous buffer)."""
    if not USE_TMA or hidden.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not _INTERPRET and (not hidden.is_cuda or _tuning.device_properties(hidden.device).major < 9):
        return False
    elem = weight.element_size()
    h = weight.shape[1]
    return (weight.stride(1) == 1 and (weight.stride(0) * elem) % 16 == 0 and (h * elem) % 16 == 0
            and weight.data_ptr() % 16 == 0)


def _tma_cfg(cfg: tuple) -> tuple:
    return (16, 32, 16, 1, 1) if _INTERPRET else cfg


def gather_rows(hidden: torch.Tensor, rows: torch.Tensor, count: torch.Tensor, n_rows: int | None = None,
                zero_tail: bool = False) -> torch.Tensor:
    """(R, H) buffer whose first ``count`` rows are ``hidden[rows[:count]]`` (device count, no sync);
    R = ``n_rows`` (the sized backward's host count or capacity) or N; ``zero_tail``: rows past the count 0."""
    n, h = hidden.shape
    r = n if n_rows is None else n_rows
    out = empty(r, h, dtype=hidden.dtype, device=hidden.device)
    block_r, block_h = (16, 32) if _INTERPRET else (32, 256)
    _launch.fast(_gather_rows_kernel)[(_tuning.cdiv(r, block_r),)](
        hidden, rows, count, out, h, r, hidden.stride(0), hidden.stride(1), ZERO_TAIL=zero_tail, BLOCK_R=block_r,
        BLOCK_H=block_h, num_warps=4)
    return out


def scatter_rows(acc: torch.Tensor, rows: torch.Tensor, count: torch.Tensor, target: torch.Tensor,
                 dhidden: torch.Tensor, ignore_index: int | None, capacity: bool = False,
                 tail: tuple[torch.Tensor, torch.Tensor] | None = None, covers_all: bool = False) -> None:
    """dhidden (N, H) contiguous <- ``acc`` (M, H) at positions ``rows[:M]``, 0 where the target is
    ``ignore_index`` (one launch; ``ignore_index`` None: zero-fill first, then scatter). ``tail``: (dz (M, T),
    w (T, H)) with T < 8, whose product is added to acc in fp32 on the way. ``covers_all``: ``rows[:M]`` are
    every position (M = N, the device count M), so the scatter alone writes all of dhidden: no zero fill and
    no programs for ignored positions."""
    n, h = dhidden.shape
    m = acc.shape[0]
    acc = acc if acc.stride(1) == 1 else acc.contiguous()
    if tail is not None:
        dt, wt = tail
        if dt.shape[1] >= 8 or dt.shape != (m, wt.shape[0]) or wt.shape[1] != h or dt.stride(1) != 1 \
                or wt.stride(1) != 1:
            raise ValueError("scatter_rows: tail must be (dz (M, T), w (T, H)) with T < 8 and unit last strides")
    else:
        dt = wt = acc  # placeholders, never read (no tail columns)
    if covers_all:
        if m != n:
            raise ValueError(f"scatter_rows: covers_all needs as many rows as positions, got {m} and {n}")
        ignore_index = -1  # (unused: no ZERO_IGNORED programs)
        zero_ignored = False
    else:
        zero_ignored = ignore_index is not None
        if ignore_index is None:
            dhidden.zero_()
    block_r, block_h = (16, 32) if _INTERPRET else (32, 256)
    programs = _tuning.cdiv(m, block_r) + (_tuning.cdiv(n, block_r) if zero_ignored else 0)
    _launch.fast(_scatter_rows_kernel)[(programs,)](
        acc, rows, count, target, dhidden, dt, wt, n, m, h, 0 if ignore_index is None else int(ignore_index),
        acc.stride(0), 0 if tail is None else dt.shape[1], dt.stride(0), wt.stride(0), int(capacity),
        ZERO_IGNORED=zero_ignored, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4)


def _sm90_config(dz: bool) -> tuple:
    """The Gluon kernel's (BLOCK_M, BLOCK_N, BLOCK_K, STAGES) for that epilogue (imported on first use: Gluon
    kernels are sm_90 code)."""
    from . import masked_lm_loss_sm90
    return masked_lm_loss_sm90.DZ_CONFIG if dz else masked_lm_loss_sm90.FWD_CONFIG


def _sm90(hidden: torch.Tensor, dz: bool) -> bool:
    """Whether the logit tiles run the warp-specialised Gluon kernel (``masked_lm_loss_sm90``) rather than
    ``_logits_tma_kernel``: an sm_90 card and that epilogue's switch on (``PYKERNELS_MLM_SM90``)."""
    if not (SM90_DZ if dz else SM90_FWD) or _INTERPRET or not hidden.is_cuda:
        return False
    return _tuning.device_properties(hidden.device).major == 9


def _logits_tma(hc, weight, bias, target, rows, count, lse, grad_loss, partials, *, n, n_rows,
                label_smoothing, cfg, dz, capacity: bool = False, zt: bool = True, sm90: bool = False):
    """``launch(out, v_off, vc)``: runs ``_logits_tma_kernel`` over ``hc`` (R, H) x weight[v_off:v_off + vc],
    dz into ``out`` (dz) or the statistics into ``partials`` (m, s, zt, zsum), or with ``sm90`` the Gluon
    kernel of ``masked_lm_loss_sm90`` (whose forward tiles leave the target logit to the combine kernel:
    ``zt`` must be off). What does not change between the chunks of a backward is worked out once, here
    (host time is what limits those loops)."""
    if sm90:
        if zt and not dz:
            raise ValueError("_logits_tma: the sm_90 kernel's forward tiles do not compute the target logit")
        from . import masked_lm_loss_sm90
        return masked_lm_loss_sm90.logits(hc, weight, bias, target, rows, count, lse, grad_loss, partials, n=n,
                                          n_rows=n_rows, label_smoothing=label_smoothing, dz=dz, capacity=capacity)
    bm, bn, bk, warps, stages = _tma_cfg(cfg)
    if not _INTERPRET:
        _tuning.ensure_allocator()
    parts = tuple(partials) if partials is not None else (lse,) * 4
    flags = dict(DZ=dz, HAS_BIAS=bias is not None, SMOOTH=label_smoothing > 0.0, ZT=zt or dz,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return _tile_launcher(_launch.fast(_logits_tma_kernel), hc, weight, bias, target, rows, count, lse, grad_loss,
                          parts, n=n, n_rows=n_rows, label_smoothing=label_smoothing, dz=dz, capacity=capacity,
                          block_m=bm, block_n=bn, programs=_num_programs(hc.device), flags=flags)


def _tile_launcher(kernel, hc, weight, bias, target, rows, count, lse, grad_loss, parts, *, n, n_rows,
                   label_smoothing, dz, capacity, block_m, block_n, programs, flags, col_mask=False,
                   descriptors=None):
    """``launch(out, v_off, vc)`` of a persistent logit-tile kernel, ``_logits_tma_kernel`` or the Gluon
    ``masked_lm_loss_sm90._logits_sm90_kernel`` (``kernel``: its fast launcher), which take the same runtime
    parameters in the same order (``parts``: the partials that kernel reads, ``flags``: its constexprs and
    compile options; ``col_mask``: the kernel takes a ``COL_MASK`` constexpr, set for a chunk that reaches
    past V; ``descriptors``: (hc's, weight's, ``f(out, vc)`` giving out's) host TMA descriptors, passed where the
    Triton kernel takes the three pointers). The grid is one program per SM, at most one per (block_m x
    block_n) tile."""
    v, h = weight.shape
    cap = int(capacity)
    row_tiles = _tuning.cdiv(hc.shape[0] if n_rows < 0 else n_rows, block_m)
    head = (hc, weight) if descriptors is None else descriptors[:2]
    mid = ((bias if bias is not None else weight, target, rows, count, lse, grad_loss) + tuple(parts)
           + (n, v, h, hc.shape[0]))
    strides = (hc.stride(0), weight.stride(0))
    tail = (bias.stride(0) if bias is not None else 0, grad_loss.stride(0) if dz else 0, float(label_smoothing))

    def launch(out, v_off: int, vc: int) -> None:
        if out is None:
            out = hc  # placeholder, never read
        grid = max(1, min(programs, row_tiles * _tuning.cdiv(vc, block_n)))
        extra = {"COL_MASK": v_off + vc > v} if col_mask else {}
        o = out if descriptors is None else descriptors[2](out, vc)
        kernel[(grid,)](*head, o, *mid, v_off, vc, n_rows, cap, *strides, out.stride(0), *tail,
                        NUM_PROGRAMS=grid, **flags, **extra)
    return launch


def masked_lm_loss_fwd(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                       bias: torch.Tensor | None, rows: torch.Tensor, count: torch.Tensor, *,
                       label_smoothing: float, loss: torch.Tensor | None = None,
                       lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` (N, H), ``weight`` (V, H), ``target`` (N,) int64, ``bias`` (V,) or None; ``rows`` (N,)
    int32 and ``count`` (1,) int32: the compacted valid positions and their number, on the device;
    ``loss`` / ``lse``: zeroed (N,) fp32 outputs (from :func:`compact`) or None (allocated here).

    Returns ``loss`` (N,) fp32 (0 at ignored positions) and ``lse`` (N,) fp32 (0 at ignored positions),
    both by position. A target outside [0, V) gives NaN loss and lse."""
    n, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    target = target.contiguous()
    if loss is None:
        loss = torch.zeros(n, dtype=torch.float32, device=dev)
    if lse is None:
        lse = torch.zeros(n, dtype=torch.float32, device=dev)
    if n == 0:
        return loss, lse
    smooth = label_smoothing > 0.0
    n_parts = 4 if smooth else 3

    def partials(split, zt=True):
        """(m, s, zt, zsum) partials; zt a placeholder when the combine kernel computes the target logit,
        zsum when there is no smoothing (neither written nor read then)."""
        part = lambda: empty(split, n, dtype=torch.float32, device=dev)  # noqa: E731
        m_s = [part(), part()]
        zt_buf = part() if zt else m_s[0]
        return m_s + [zt_buf, part() if smooth else zt_buf]

    # (the Gluon forward: 1.29-1.36x the Triton 256 x 128 tiles with a bias, 1.02-1.05x without one since its
    # epilogue lost the select an element: run181-182)
    sm90 = _sm90(hidden, False)
    if sm90:
        split = _tuning.cdiv(v, _sm90_config(False)[1])
    else:
        split = _tuning.cdiv(v, _tma_cfg(TMA_FWD_CONFIG)[1])  # one partial per vocabulary tile
    zt_dot = False
    if (tma_applies(hidden, weight)
            and split * n * 4 * n_parts + n * h * hidden.element_size() <= TMA_FWD_BUDGET_BYTES):
        zt_dot = FWD_TARGET_DOT or sm90  # (the Gluon kernel's tiles leave the target logit to the combine)
        part_m, part_s, part_zt, part_zsum = parts = partials(split, zt=not zt_dot)
        _logits_tma(gather_rows(hidden, rows, count), weight, bias, target, rows, count, lse, lse, parts,
                    n=n, n_rows=-1, label_smoothing=label_smoothing, cfg=TMA_FWD_CONFIG, dz=False,
                    zt=not zt_dot, sm90=sm90)(None, 0, v)
    else:
        # About 32 vocabulary slices of >= 1024 columns (multiples of 256): enough programs (and small
        # ones, so the last wave is short) when few rows are valid, and few partials to merge.
        v_per_split = max(1024, _tuning.cdiv(_tuning.cdiv(v, 32), 256) * 256)
        split = _tuning.cdiv(v, v_per_split)
        part_m, part_s, part_zt, part_zsum = partials(split)
        b = bias if bias is not None else weight  # placeholder pointer, never read
        grid = lambda meta: (_tuning.cdiv(n, meta["BLOCK_M"]), split)  # noqa: E731
        _launch.fast(_masked_lm_loss_fwd_kernel)[grid](
            hidden, weight, b, target, rows, count, part_m, part_s, part_zt, part_zsum,
            n, v, h, v_per_split,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            bias.stride(0) if bias is not None else 0,
            _dtype_key(hidden.dtype),
            HAS_BIAS=bias is not None, SMOOTH=smooth, DOT_PRECISION=_dot_precision(hidden.dtype))
    block, block_s = COMBINE_BLOCKS  # small row blocks: 2446 valid rows are 77 programs of 32 rows
    _launch.fast(_masked_lm_loss_combine_kernel)[(_tuning.cdiv(n, block),)](
        target, rows, count, part_m, part_s, part_zt, part_zsum, loss, lse,
        hidden, weight, bias if bias is not None else weight,
        n, v, h, split, float(label_smoothing),
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        bias.stride(0) if bias is not None else 0,
        SMOOTH=smooth, ZT_DOT=zt_dot, HAS_BIAS=bias is not None, BLOCK=block, BLOCK_S=block_s,
        BLOCK_H=32 if _INTERPRET else 128, num_warps=COMBINE_WARPS)
    return loss, lse


# The TMA forward's tiles leave the target's logit out of their epilogue (a compare, a select and a sum over
# every logit) and the combine kernel computes it as a dot product. H100 run163 (kernel time of a public
# forward+backward, alternating, two rounds): BERT-base 873 -> 841 us, BERT-large 1033 -> 1008, GPT-2 4687 ->
# 4563 (the combine kernel 2-4 us longer); the gradients bitwise the same. PYKERNELS_MLM_TARGET_DOT=0: off.
FWD_TARGET_DOT = os.environ.get("PYKERNELS_MLM_TARGET_DOT", "1") not in ("", "0")
# The sized backward's chunk width chosen for whole rounds of the dz kernel's tiles (``_chunk_columns``);
# PYKERNELS_MLM_WAVE_CHUNKS=0: the evenly split width.
WAVE_CHUNKS = os.environ.get("PYKERNELS_MLM_WAVE_CHUNKS", "1") not in ("", "0")
# The warp-specialised Gluon kernel for the logit tiles on sm_90 (``masked_lm_loss_sm90``): its softmax
# epilogues run while the other consumer warpgroup's GEMMs do. H100 run166 (device time a launch,
# benchmarks/dev/mlm_logits_sm90.py; outputs bitwise the Triton kernel's): the sized backward's dz 1.21x at
# BERT-base (a 7680-column chunk 68 -> 56 us), 1.16-1.19x BERT-large, 1.23-1.27x GPT-2, 1.32-1.42x with a bias;
# the forward 1.25x with a bias (BERT-base 232 -> 185 us) and 0.96-1.01x without one, so the forward took
# it only with a bias. A public forward+backward's kernel time at BERT-base 837-847 -> 818 us, GPT-2 4505-4551
# -> 4295. Since the forward's epilogue lost its select an element (run181-183) it is 1.02-1.05x the Triton
# forward without a bias too, and the forward always takes it (public GPU time 0.793 -> 0.787-0.792 ms at
# BERT-base, 4.42-4.43 -> 4.34-4.38 at GPT-2, run183). PYKERNELS_MLM_SM90=0 keeps the Triton kernel for both;
# "fwd" or "dz" takes it for that one only.
_SM90_ENV = os.environ.get("PYKERNELS_MLM_SM90", "1").strip().lower()
SM90_FWD = _SM90_ENV in ("1", "fwd")
SM90_DZ = _SM90_ENV in ("1", "dz")
# The combine kernel's (rows, partials) tile and warps: H100 run159 (device time a launch, six tiles) 8.6 us at
# BERT-base (2446 rows x 239 partials), 25.4 at GPT-2 (8192 x 393); 32 x 64 on 4 warps 10.5 / 27.5 us, and the
# one-slice-a-step loop before it 33 / 66 us (run156).
COMBINE_BLOCKS = (16, 16) if _INTERPRET else (32, 128)
COMBINE_WARPS = 1 if _INTERPRET else 8


def _grad_buffers(hidden, weight, bias, compute_dhidden: bool, compute_dweight: bool):
    """The backward's outputs: dhidden zero-initialised (ignored rows keep their 0), dweight and dbias
    uninitialised (every row is written), each None when not requested."""
    n, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    dhidden = torch.zeros(n, h, dtype=hidden.dtype, device=dev) if compute_dhidden else None
    dweight = empty(v, h, dtype=weight.dtype, device=dev) if compute_dweight else None
    dbias = empty(v, dtype=bias.dtype, device=dev) if compute_dweight and bias is not None else None
    return dhidden, dweight, dbias


def _no_rows(dhidden, dweight, dbias):
    """Gradients of a call with no valid row (or none requested): all zero."""
    for t in (dweight, dbias):
        if t is not None:
            t.zero_()
    return dhidden, dweight, dbias


def _chunk_columns(n: int, v: int, elem: int, budget: int, waves: tuple[int, int, int] | None = None) -> int:
    """Vocabulary columns per backward chunk: the (n, VC) dlogits buffer stays within ``budget`` bytes
    (VC a multiple of 256, at least 256), and chunks are evened out so the last is not a sliver.

    ``waves`` = (row tiles, tile columns, persistent programs) of the dz kernel: among the widths from the
    even one up to the budget's (multiples of the tile columns; the same number of chunks), the one whose
    chunks take the fewest rounds of tiles over the programs, the narrowest on a tie (the last round of a
    chunk's kernel runs on few SMs while the rest wait for the GEMMs after it). BERT-base MLM on an H100 (20
    row tiles of 128, 132 SMs): 4 chunks of 8320 columns (65 tiles: 10 rounds each, the last chunk 7)
    instead of 7680 (60 tiles: 9.1 rounds, so 10, and 9), 39 -> 37 rounds for 3.0 MiB more of the budget's
    memory (run167, kernel time of a forward+backward: 819-831 us with the Gluon dz kernel and even chunks,
    811-814 with these widths)."""
    vc = max(256, (budget // max(n * elem, 1)) // 256 * 256)
    if vc >= v:
        return v
    chunks = _tuning.cdiv(v, vc)
    even = _tuning.cdiv(_tuning.cdiv(v, chunks), 256) * 256
    if waves is None:
        return even
    row_tiles, bn, programs = waves
    cdiv = _tuning.cdiv

    def rounds(width: int) -> int:  # a chunk's rounds of tiles over the programs
        return cdiv(row_tiles * cdiv(width, bn), programs)

    best, width = None, even
    for w in range(cdiv(cdiv(v, chunks), bn) * bn, vc + 1, bn):
        r = (chunks - 1) * rounds(w) + rounds(v - (chunks - 1) * w)
        if best is None or r < best:  # (the narrowest of the fewest rounds)
            best, width = r, w
    return width


def _chunk_plan(v: int, vc: int, m: int, h: int, pad: int, dw_rows: int) -> list[tuple[int, int, bool]]:
    """The sized backward's vocabulary chunks: (first column, width, in dW scratch). Chunks are ``vc``
    wide (the dlogits buffer), except that while the rows of dW past a chunk (``dw_rows`` of H elements,
    the padded dW buffer; 0: no scratch) can hold a wider (M, width) dlogits block, the chunk is that
    wide (a multiple of 256) and its dlogits live there: dW's rows are written chunk by chunk, so rows
    past the current chunk are free until a later chunk writes them. At GPT-2 size (M = N = 8192,
    H 768, V 50257, vc 1024) the first chunks are 4096 wide: 29 chunks instead of 50, for the same memory."""
    plan = []
    v_off = 0
    while v_off < v:
        w = 0
        if dw_rows and vc < v:
            w = (dw_rows - v_off) * h // (m + h) // 256 * 256  # m w <= (dw_rows - v_off - w) h
        if w > vc:
            width = min(w, v - v_off)
            w_pad = _tuning.cdiv(width, pad) * pad
            if (v_off + w_pad) * h + m * w_pad <= dw_rows * h:
                plan.append((v_off, width, True))
                v_off += width
                continue
        width = min(vc, v - v_off)
        plan.append((v_off, width, False))
        v_off += width
    return plan


def _chunk_layout(m: int, v: int, h: int, elem: int, budget: int, dh_elems: int, dh_elem: int, pad: int,
                  scratch_rows: int, waves: tuple[int, int, int] | None = None
                  ) -> tuple[int, bool, list[tuple[int, int, bool]]]:
    """The sized backward's chunk width, where its dlogits live, and its chunks: (VC, shared, plan). Two layouts: in
    dhidden's memory (shared: chunks of max(budget, dhidden's bytes)), or in a buffer of the budget plus dhidden's
    bytes, dhidden allocated after that buffer is freed. The second costs the budget in peak memory; it is taken
    when the first does not fit or needs more chunks (each chunk is a kernel launch and two or three cuBLAS calls
    of host time, and narrow GEMMs run slower). BERT-base MLM (M 2446, V 30522, H 768, bf16): 4 chunks of 7680
    columns instead of 6 (7168, 5376, 5120 x 3, 2618), peak 84 -> 92 MiB (run148). ``waves``: see
    :func:`_chunk_columns`."""
    vc = _chunk_columns(m, v, elem, max(budget, dh_elems * dh_elem), waves)
    vc_own = _chunk_columns(m, v, elem, budget + dh_elems * dh_elem, waves)
    plan_own = _chunk_plan(v, vc_own, m, h, pad, scratch_rows)
    if m * _tuning.cdiv(vc, pad) * pad <= dh_elems:
        plan = _chunk_plan(v, vc, m, h, pad, scratch_rows)
        if len(plan) <= len(plan_own):
            return vc, True, plan
    return vc_own, False, plan_own


def masked_lm_loss_bwd(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                       target: torch.Tensor, bias: torch.Tensor | None, lse: torch.Tensor,
                       rows: torch.Tensor, count: torch.Tensor, *, label_smoothing: float,
                       compute_dhidden: bool = True, compute_dweight: bool = True,
                       dlogits_budget_bytes: int | None = None, n_rows: int | None = None,
                       into: tuple | None = None, row_programs: int | None = None, work: tuple | None = None,
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``grad_loss`` (N,) fp32 upstream gradient of the per-position loss; ``lse`` (N,) fp32 from the
    forward; ``rows``/``count`` as for the forward. Returns ``dhidden`` (N, H) (zero at ignored rows),
    ``dweight`` (V, H) and ``dbias`` (V,) in the input dtypes; ``dhidden`` is None unless
    ``compute_dhidden``, ``dweight`` and ``dbias`` are None unless ``compute_dweight`` (and a bias).

    ``n_rows``: how many entries ``rows`` has room for (default N; buffers and grids are sized for them).
    ``into``: the (dhidden, dweight, dbias) of an earlier pass over other rows, completed in place (the bounded
    backward's overflow rows): dweight and dbias are added to (left untouched, bit for bit, when ``count`` is 0)
    and dhidden is written at these rows' positions only. ``row_programs``: at most this many programs a column
    tile take the row blocks (each every row_programs-th one; default: a program a row block). ``work``: the
    (n_rows, VC) dlogits buffer (VC its width, the vocabulary chunk) and, where VC < V and dhidden is computed,
    the (n_rows, H) fp32 dhidden accumulator to use instead of allocating them (the bounded backward's blocks), and
    None or (with ``row_programs``) a (S, n_rows, H) fp32 buffer for dhidden's partial sums, S > 1: each chunk's
    dhidden programs then split its columns S ways (S times the programs, each walking 1/S of the columns: a few
    hundred overflow rows make only a dozen row x H tiles, each else walking a chunk of thousands of columns alone),
    and ``_dhidden_reduce_kernel`` adds the S sums in order (deterministic)."""
    n, h = hidden.shape
    r = n if n_rows is None else int(n_rows)
    if not 0 <= r <= n:
        raise ValueError(f"n_rows must be in [0, {n}], got {r}")
    v = weight.shape[0]
    dev = hidden.device
    target = target.contiguous()
    grad_loss = _grad_vector(grad_loss)
    lse = lse.contiguous()
    if into is not None:
        dhidden, dweight, dbias = into
    else:
        dhidden, dweight, dbias = _grad_buffers(hidden, weight, bias, compute_dhidden, compute_dweight)
    if r == 0 or not (compute_dhidden or compute_dweight):  # (an earlier pass's gradients stay as they are)
        return (dhidden, dweight, dbias) if into is not None else _no_rows(dhidden, dweight, dbias)
    part = None
    if work is None:
        budget = DLOGITS_BUDGET_BYTES if dlogits_budget_bytes is None else dlogits_budget_bytes
        vc = _chunk_columns(r, v, weight.element_size(), budget)
        dl = empty(r, vc, dtype=weight.dtype, device=dev)
    else:
        dl, work_acc, part = work
        vc = dl.shape[1]
        if not (compute_dhidden and row_programs is not None):
            part = None  # (the split is the row-walking dhidden programs' own)
    k_splits = part.shape[0] if part is not None else 1
    n_chunks = _tuning.cdiv(v, vc)

    def row_blocks(block: int) -> int:
        blocks = _tuning.cdiv(r, block)
        return blocks if row_programs is None else max(1, min(blocks, int(row_programs)))

    if compute_dhidden:
        if n_chunks == 1:
            acc = dhidden
        else:
            acc = empty(r, h, dtype=torch.float32, device=dev) if work is None else work_acc
    # placeholders for pointers a launch never dereferences (a flag or a zero program count guards them)
    acc = acc if compute_dhidden else dl
    dh_out = dhidden if compute_dhidden else dl
    dw_out = dweight if compute_dweight else dl
    b = bias if bias is not None else weight
    db = dbias if dbias is not None else dw_out
    prec = _dot_precision(hidden.dtype)
    key = _dtype_key(hidden.dtype)
    for c in range(n_chunks):
        v_off = c * vc
        vc_c = min(vc, v - v_off)
        _launch.fast(_masked_lm_loss_dlogits_kernel)[
                lambda m: (_tuning.cdiv(vc_c, m["BLOCK_N"]) * row_blocks(m["BLOCK_M"]),)](
            hidden, weight, b, target, rows, count, lse, grad_loss, dl,
            n, v, h, v_off, vc_c,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            bias.stride(0) if bias is not None else 0, dl.stride(0), grad_loss.stride(0), float(label_smoothing),
            -1, 0, key,
            HAS_BIAS=bias is not None, DOT_PRECISION=prec, ROW_LOOP=row_programs is not None)

        def grid(m):
            h_tiles = _tuning.cdiv(h, m["BLOCK_H"])
            dw_programs = _tuning.cdiv(vc_c, m["BLOCK_A"]) * h_tiles if compute_dweight else 0
            return (dw_programs + (row_blocks(m["BLOCK_A"]) * h_tiles * k_splits if compute_dhidden else 0),)

        _launch.fast(_masked_lm_loss_bwd_kernel)[grid](
            hidden, weight, rows, count, dl, dw_out, db, acc, dh_out,
            h, v_off, vc_c, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), dl.stride(0),
            key, int(c == 0), int(c == n_chunks - 1), int(compute_dweight), k_splits,
            part if part is not None else acc, r,
            HAS_BIAS=bias is not None and compute_dweight, DOT_PRECISION=prec, ACCUMULATE=into is not None,
            ROW_LOOP=row_programs is not None)
        if part is not None:  # (acc: where one chunk, dhidden itself, neither read nor written: is_first and is_last)
            _launch.fast(_dhidden_reduce_kernel)[(_tuning.cdiv(r, REDUCE_ROWS) * _tuning.cdiv(h, REDUCE_COLS),)](
                part, acc, rows, count, dh_out, h, r, k_splits, int(c == 0), int(c == n_chunks - 1),
                BLOCK_R=REDUCE_ROWS, BLOCK_C=REDUCE_COLS)
    return dhidden, dweight, dbias


REDUCE_ROWS, REDUCE_COLS = 16, 128  # _dhidden_reduce_kernel's tile


def _grad_vector(grad_loss: torch.Tensor) -> torch.Tensor:
    """The (N,) upstream gradient as the kernels read it: fp32, any stride (a mean's or sum's gradient
    arrives expanded from one value, stride 0: read in place instead of materialised, one launch less)."""
    return grad_loss if grad_loss.dtype == torch.float32 else grad_loss.to(torch.float32)


_ADDMM_OUT_DTYPE: bool | None = None


def _addmm_f32(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc + a @ b`` in fp32 (``a @ b`` when ``acc`` is None) for fp16/bf16/fp32 ``a``, ``b``: cuBLAS
    with an fp32 output (``out_dtype``, torch >= 2.8 on CUDA) so the product is never rounded to 16 bits
    before it is accumulated; elsewhere (CPU, older builds) through fp32 copies."""
    global _ADDMM_OUT_DTYPE
    if a.dtype == torch.float32:
        return torch.mm(a, b) if acc is None else acc.addmm_(a, b)
    if a.is_cuda:
        if _ADDMM_OUT_DTYPE is None:
            try:
                t = torch.ones(2, 2, dtype=a.dtype, device=a.device)
                _ADDMM_OUT_DTYPE = torch.mm(t, t, out_dtype=torch.float32).dtype == torch.float32
            except (TypeError, RuntimeError, NotImplementedError):
                _ADDMM_OUT_DTYPE = False
        if _ADDMM_OUT_DTYPE:
            if acc is None:
                return torch.mm(a, b, out_dtype=torch.float32)
            return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)  # in place: no copy of acc
    prod = torch.mm(a.float(), b.float())
    return prod if acc is None else acc.add_(prod)


def masked_lm_loss_bwd_dense(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                             target: torch.Tensor, bias: torch.Tensor | None, lse: torch.Tensor, *,
                             ignore_index: int, label_smoothing: float, compute_dhidden: bool = True,
                             compute_dweight: bool = True,
                             ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The backward over every position, with no count on the host: the sized backward with M = N,
    every row its own position, the ignored rows' upstream gradient set to 0 and their lse to +inf (so
    their softmax is exactly 0 however large the logits: 0 * finite, never 0 * inf). Nothing waits for
    the device and every shape is known on the host, so it can be captured in a CUDA graph. Same
    arguments and results as :func:`masked_lm_loss_bwd`, without the compaction."""
    n = hidden.shape[0]
    dev = hidden.device
    valid = target != ignore_index
    g = torch.where(valid, grad_loss.to(torch.float32), 0.0)
    lse = torch.where(valid, lse, float("inf"))
    rows = torch.arange(n, dtype=torch.int32, device=dev)
    count = torch.full((1,), n, dtype=torch.int32, device=dev)  # the kernels' count check: every row
    return masked_lm_loss_bwd_sized(g, hidden, weight, target, bias, lse, rows, count, n,
                                    label_smoothing=label_smoothing, compute_dhidden=compute_dhidden,
                                    compute_dweight=compute_dweight)


def masked_lm_loss_bwd_sized(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                             target: torch.Tensor, bias: torch.Tensor | None, lse: torch.Tensor,
                             rows: torch.Tensor, count: torch.Tensor, num_rows: int, *, label_smoothing: float,
                             compute_dhidden: bool = True, compute_dweight: bool = True,
                             dlogits_budget_bytes: int | None = None, ignore_index: int | None = None,
                             capacity: bool = False,
                             ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The backward when the number of valid rows ``num_rows`` (= ``count``) is known on the host, or with
    ``capacity`` an upper bound of it (``max_valid``: nothing waits for the device; the rows past the device
    count are zero rows, and a device count above ``num_rows`` makes every gradient NaN).

    Same arguments and results as :func:`masked_lm_loss_bwd`. Buffers and grids are sized for the M valid
    rows instead of all N, so the vocabulary chunks are N / M times wider for the same memory, and the two
    GEMMs of each chunk run on cuBLAS over the compacted rows:

    * the TMA kernel's dz epilogue (Hopper, fp16/bf16) or ``_masked_lm_loss_dlogits_kernel`` recomputes
      the chunk's logits in fp32 and writes dz (M, VC) in the weight dtype, into dhidden's memory when
      it fits there, else into dweight's not-yet-written rows or a buffer of the budget
      (:func:`_chunk_plan`);
    * dW[chunk] = dz^T h_c (cuBLAS, fp32 accumulation, written once in the weight dtype: each chunk owns
      its rows of dW), dbias[chunk] = column sums of dz in fp32;
    * dh_c (+)= dz W[chunk] (cuBLAS with an fp32 output accumulated across chunks), written once to the
      valid positions of dhidden (zeroed after the last chunk: its memory may have held dz).

    ``h_c`` is the (M, H) gather of the valid rows (``hidden`` itself when every row is valid). With
    ``ignore_index`` the last step writes every position of dhidden in one launch (the accumulated rows
    at theirs, 0 where the target is ``ignore_index``); without it dhidden is zero-filled first."""
    n, h = hidden.shape
    v = weight.shape[0]
    m = int(num_rows)
    if not 0 <= m <= n:
        raise ValueError(f"num_rows must be in [0, {n}] (the number of valid rows), got {m}")
    dev = hidden.device
    dtype = hidden.dtype
    if m == 0 or not (compute_dhidden or compute_dweight):
        return _no_rows(*_grad_buffers(hidden, weight, bias, compute_dhidden, compute_dweight))
    use_tma = tma_applies(hidden, weight)
    # With TMA the chunks' widths are padded to multiples of 8 columns (dz is 0 there): cuBLAS picks a
    # ~3x slower sm_80 kernel for a GEMM with an odd output or reduction width (BERT's last chunk, 4922
    # of V = 30522), so dweight is a view of a buffer with up to 7 more rows, and the chunk's odd tail (< 8
    # columns) is added to dhidden by the scatter kernel (or, where every row is valid, a second tiny GEMM).
    pad = 8 if use_tma else 1
    dw_buf = empty(_tuning.cdiv(v, pad) * pad, h, dtype=weight.dtype, device=dev) if compute_dweight else None
    dweight = dw_buf[:v] if compute_dweight else None
    dbias = empty(v, dtype=bias.dtype, device=dev) if compute_dweight and bias is not None else None
    target = target.contiguous()
    grad_loss = _grad_vector(grad_loss)
    lse = lse.contiguous()
    all_rows = m == n and not capacity  # compaction keeps order: every row valid means rows[i] == i
    # dhidden is written only after the last chunk, so its memory serves the dlogits chunks first: they
    # live in dhidden itself when the budget's chunk fits there (BERT MLM: N x H is ~6 times M x 768
    # columns); else (causal LM, M = N) dhidden is allocated only after the chunks, and the chunk buffer
    # gets the budget plus dhidden's bytes (GPT-2: 1792 columns instead of 1024 at the same peak; a
    # narrow chunk's GEMMs run far below cuBLAS's peak, 419 / 325 TFLOP/s at 1024 against 537 / 490 at
    # 2048 on an H100, benchmarks/results/mlm_gemm_probe_*_run21.txt).
    dh_elems = n * h if compute_dhidden else 0
    elem = weight.element_size()
    budget = SIZED_DLOGITS_BUDGET_BYTES if dlogits_budget_bytes is None else dlogits_budget_bytes
    dw_rows = _tuning.cdiv(v, pad) * pad if compute_dweight else 0
    scratch_rows = dw_rows if use_tma else 0
    waves = None
    sm90_dz = use_tma and _sm90(hidden, True)
    if use_tma and WAVE_CHUNKS:
        bm_dz, bn_dz = _sm90_config(True)[:2] if sm90_dz else _tma_cfg(TMA_DZ_CONFIG)[:2]
        waves = (_tuning.cdiv(m, bm_dz), bn_dz, _num_programs(dev))
    vc, shared, plan = _chunk_layout(m, v, h, elem, budget, dh_elems, hidden.element_size(), pad, scratch_rows,
                                     waves)
    ld = _tuning.cdiv(vc, pad) * pad  # TMA: row stride padded to 16 bytes
    dhidden = empty(n, h, dtype=hidden.dtype, device=dev) if compute_dhidden and shared else None
    dl = (dhidden.view(-1)[:m * ld] if shared else empty(m * ld, dtype=weight.dtype, device=dev)).view(m, ld)
    hc = None
    if compute_dweight or use_tma:
        hc = hidden if all_rows else gather_rows(hidden, rows, count, m, zero_tail=capacity)
        elem = hc.element_size()
        if use_tma and not (hc.stride(1) == 1 and (hc.stride(0) * elem) % 16 == 0 and hc.data_ptr() % 16 == 0):
            hc = hc.clone(memory_format=torch.contiguous_format)  # rows as tensor descriptors need them
    b = bias if bias is not None else weight  # placeholder pointer, never read
    prec = _dot_precision(dtype)
    key = _dtype_key(dtype)
    if use_tma:
        dz_launch = _logits_tma(hc, weight, bias, target, rows, count, lse, grad_loss, None, n=n, n_rows=m,
                                label_smoothing=label_smoothing, cfg=TMA_DZ_CONFIG, dz=True, capacity=capacity,
                                sm90=sm90_dz)
    flat_dw = dw_buf.view(-1) if dw_buf is not None and use_tma else None
    db32 = None
    if dbias is not None:
        db32 = dbias if dbias.dtype == torch.float32 else empty(v, dtype=torch.float32, device=dev)
    acc = tail = None
    for v_off, vc_c, scratch in plan:
        w_pad = _tuning.cdiv(vc_c, pad) * pad
        if scratch:  # this chunk's dlogits in dW's rows past the chunk (written by later chunks only)
            start = (v_off + w_pad) * h
            d_pad = flat_dw[start:start + m * w_pad].view(m, w_pad)
        else:
            d_pad = dl[:, :w_pad]
        d = d_pad[:, :vc_c]
        if use_tma:
            dz_launch(d_pad, v_off, w_pad)
        else:
            _launch.fast(_masked_lm_loss_dlogits_kernel)[
                    lambda meta: (_tuning.cdiv(vc_c, meta["BLOCK_N"]) * _tuning.cdiv(m, meta["BLOCK_M"]),)](
                hidden, weight, b, target, rows, count, lse, grad_loss, dl,
                n, v, h, v_off, vc_c,
                hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
                bias.stride(0) if bias is not None else 0, dl.stride(0), grad_loss.stride(0), float(label_smoothing),
                m, int(capacity), key,
                HAS_BIAS=bias is not None, DOT_PRECISION=prec, ROW_LOOP=False)
        if compute_dweight:
            torch.mm(d_pad.t(), hc, out=dw_buf[v_off:v_off + w_pad])
            if dbias is not None:  # column sums in fp32, rounded once at the end (one call a chunk)
                torch.sum(d, 0, dtype=torch.float32, out=db32[v_off:v_off + vc_c])
        if compute_dhidden:
            wc = weight[v_off:v_off + vc_c]
            # K a multiple of 8 (as for dW above): the odd tail of the last chunk (< 8 columns) is added
            # by the kernel that writes dhidden, which reads acc anyway (a cuBLAS GEMM for it read and wrote
            # all of acc: 10 us at BERT-base, H100 run156; 17 us at GPT-2, run189)
            k8 = vc_c - vc_c % pad if vc_c > pad else vc_c
            if acc is None and vc_c == v and k8 == vc_c:
                acc = torch.mm(d, wc)  # one chunk: cuBLAS accumulates the whole sum in fp32
            elif k8 == vc_c:
                acc = _addmm_f32(acc, d, wc)
            else:
                acc = _addmm_f32(acc, d[:, :k8], wc[:k8])
                tail = (d[:, k8:].contiguous(), wc[k8:])  # (copied out: dl's memory becomes dhidden)
    if db32 is not None and db32 is not dbias:
        dbias.copy_(db32)
    if compute_dhidden:  # the dlogits are dead now: their memory becomes dhidden
        if not shared:
            del dl, d, d_pad  # the chunk buffer goes back to the allocator before dhidden takes its place
            dhidden = empty(n, h, dtype=hidden.dtype, device=dev)
        if all_rows and tail is None:
            dhidden.copy_(acc)
        else:  # (every row valid: rows[i] = i, so the scatter is a cast that adds the tail)
            scatter_rows(acc, rows, count, target, dhidden, ignore_index, capacity, tail, covers_all=all_rows)
    return dhidden, dweight, dbias


# The bounded backward's overflow pass: programs a column tile over its row blocks. A program a row block made ~50k
# programs a call that only exit where no row is past the bound (the common case): H200 run391, 0.948 ms replayed
# against the capacity pass's 0.842 alone; with 16 row programs 0.902 against 0.844 (run393;
# ``benchmarks/dev/mlm_bounded_probe.py``). Since then the pass is in row blocks, each captured in an IF node of the
# graph where the CUDA extension is built (``_tuning.graph_if``), so with no row past the bound a replay skips its
# launches: 0.839 against 0.844 for the capacity pass alone, and 97.6 MiB above the inputs (the blocks share one
# block's buffers) where one pass sized for every overflow row took 169 (run402); 1.032 ms with every block launched.
OVERFLOW_ROW_PROGRAMS = 1 if _INTERPRET else 16  # (one: the interpreter walks several row blocks a program)
OVERFLOW_BLOCKS = 4       # the overflow rows (N - bound of them) are taken in at most this many blocks of rows:
OVERFLOW_FIRST_ROWS = 512  # a first block this small (an overflow past 8 standard deviations is usually a few
OVERFLOW_ALIGN = 64        # hundred rows), then the rest in even blocks, multiples of this many rows
# A block's dhidden programs split each chunk's columns this many ways at most (as many as the bounded backward's fp32
# buffer holds: 7 for the first block at BERT-base, within the buffer the later blocks' accumulators need anyway).
# Unsplit, 206 overflow rows made 12 dhidden programs of 128 x 128, each walking a 16384-column chunk alone: H200
# run405, a 1.662 ms replay where the capacity pass alone took 0.847; split 7 ways, 1.054 against 0.832 (run406;
# ``mlm_bounded_probe.py --profile``: the backward kernel's time in an eager call, every block launched, 934 -> 308 us).
OVERFLOW_DH_SPLITS = 8


def overflow_blocks(n: int, bound: int) -> list[tuple[int, int]]:
    """(first row, rows) of each block of the bounded backward's overflow pass over the N - bound rows past the
    bound: a first block of ``OVERFLOW_FIRST_ROWS`` (its dlogits chunks as wide as the buffer allows: few launches
    where a few hundred rows overflow, the usual case), then the rest in at most ``OVERFLOW_BLOCKS - 1`` even blocks
    of a multiple of ``OVERFLOW_ALIGN`` rows (BERT-base MLM, 16384 positions at 15%: bound 2816, blocks of 512 and
    three of 4352 rows at most)."""
    over = n - bound
    if over <= 0:
        return []
    align = OVERFLOW_ALIGN
    first = min(over, _tuning.cdiv(OVERFLOW_FIRST_ROWS, align) * align)
    rest = over - first
    blocks = [(bound, first)]
    if rest > 0:
        size = _tuning.cdiv(_tuning.cdiv(rest, max(1, OVERFLOW_BLOCKS - 1)), align) * align
        blocks += [(start, min(size, n - start)) for start in range(bound + first, n, size)]
    return blocks


def masked_lm_loss_bwd_bounded(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                               target: torch.Tensor, bias: torch.Tensor | None, lse: torch.Tensor,
                               rows: torch.Tensor, count: torch.Tensor, bound: int, *, label_smoothing: float,
                               compute_dhidden: bool = True, compute_dweight: bool = True,
                               ignore_index: int | None = None,
                               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The backward with no count on the host, exact for any count, at the capacity backward's speed while the
    count stays within ``bound`` (a CUDA-graph-captured MLM call: ``pykernels.masked_lm_loss._ValidSeen``):

    * the first ``min(count, bound)`` valid rows take :func:`masked_lm_loss_bwd_sized` with capacity ``bound``
      (cuBLAS GEMMs sized for ``bound`` rows), handed a count clamped to the bound, so it never poisons;
    * the rows past the bound, ``count - bound`` of them (on the device; usually none), take the graph-safe
      :func:`masked_lm_loss_bwd` over ``rows[bound:]`` in the blocks of :func:`overflow_blocks` (one dlogits
      buffer of ``SIZED_DLOGITS_BUDGET_BYTES`` and one accumulator serve every block), adding into the first
      pass's dweight / dbias and writing dhidden at their own positions (which the first pass left alone).
      Captured in a CUDA graph (the CUDA extension built) each block is an IF node nested in the one before it,
      taken at replay only where a row is past the block's start: with no row past the bound a replay runs one
      one-thread kernel for the whole pass. Elsewhere every block is launched and, with no row in it, its programs exit
      at once; so captured or not, the same kernels run on the same rows (bit for bit the same gradients).

    Where rows overflow, dweight and dbias are rounded once a pass with rows (each pass's sum added in the
    weight dtype: twice where the rows past the bound fit one block, the usual overflow); dhidden's rows come
    from one pass each, rounded once. Same arguments and results as :func:`masked_lm_loss_bwd`."""
    n = hidden.shape[0]
    bound = max(0, min(int(bound), n))
    head = torch.clamp(count, max=bound)           # (int32 stays int32: no host value read)
    grads = masked_lm_loss_bwd_sized(grad_loss, hidden, weight, target, bias, lse, rows, head, bound,
                                     label_smoothing=label_smoothing, compute_dhidden=compute_dhidden,
                                     compute_dweight=compute_dweight, ignore_index=ignore_index, capacity=True)
    blocks = overflow_blocks(n, bound)
    if not blocks or not (compute_dhidden or compute_dweight):
        return grads
    # everything the blocks read or fill, made before the first IF node (no allocation inside one): one dlogits
    # buffer, each block's (rows, VC) view of it as wide as the sized budget allows its rows, and one accumulator
    v, elem = weight.shape[0], weight.element_size()
    widths = [_chunk_columns(r, v, elem, SIZED_DLOGITS_BUDGET_BYTES) for _, r in blocks]
    grad_loss, target, lse = _grad_vector(grad_loss), target.contiguous(), lse.contiguous()
    dl = empty(max(r * vc for (_, r), vc in zip(blocks, widths)), dtype=weight.dtype, device=hidden.device)
    # one fp32 buffer of f rows for dhidden: a block's accumulator across its chunks (its first r rows, where it has
    # more than one chunk) and after it the partial sums of its split columns (as many splits of r rows as fit, up to
    # OVERFLOW_DH_SPLITS; at least that many for the first block's rows, the overflow that usually happens)
    h = hidden.shape[1]
    chunked = [vc < v for vc in widths]
    f = max([r for (_, r), c in zip(blocks, chunked) if c] + [OVERFLOW_DH_SPLITS * blocks[0][1]])
    f32 = empty(f * h, dtype=torch.float32, device=hidden.device) if compute_dhidden else None
    heres = empty(len(blocks), dtype=torch.int32, device=hidden.device)  # each block's count of rows
    with contextlib.ExitStack() as nested:
        for i, ((start, r), vc, c) in enumerate(zip(blocks, widths, chunked)):
            here = heres[i:i + 1]
            acc = part = None
            if f32 is not None:
                acc = f32[:r * h].view(r, h) if c else None
                splits = min(OVERFLOW_DH_SPLITS, (f - (r if c else 0)) // r)
                if splits > 1:
                    at = r * h if c else 0
                    part = f32[at:at + splits * r * h].view(splits, r, h)
            nested.enter_context(_tuning.graph_if(count, start, r, here))
            masked_lm_loss_bwd(grad_loss, hidden, weight, target, bias, lse, rows[start:start + r], here,
                               label_smoothing=label_smoothing, compute_dhidden=compute_dhidden,
                               compute_dweight=compute_dweight, n_rows=r, into=grads,
                               row_programs=OVERFLOW_ROW_PROGRAMS, work=(dl[:r * vc].view(r, vc), acc, part))
    return grads
