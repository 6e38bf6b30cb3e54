"""Attention forward for Hopper (sm_90) in Gluon: FlashAttention-3's structure (Shah et al. 2024).

Why a second forward. Triton 3.6 waits for every wgmma right after issuing it (``wgmma.wait_group 0``,
``benchmarks/dev/sm90_codegen.py``), and a plain ``@triton.jit`` kernel cannot split its warps into a
producer and consumers, so the Triton forward in ``attention.py`` tops out at 0.74-0.85x cuDNN on an
H100 at D = 128. Gluon (Triton's lower-level language; same compiler, launcher and cache) gives the
kernel explicit shared memory, mbarriers, TMA, asynchronous wgmma and warp specialisation.

Structure of ``_attention_fwd_sm90_kernel``. A tile is 2 x 64 query rows of one (batch, head); a CTA
walks tiles program_id, + num_programs, ... (a persistent grid of one CTA per SM, or one tile per CTA).

* a 1-warp **producer** (``gl.warp_specialize`` worker, 24 registers) issues every TMA load: both
  warpgroups' Q tiles (double-buffered across tiles where they fit beside the K/V ring, D <= 128, so the
  next tile's Q arrives during this tile's epilogue; at D = 256 one Q tile a warpgroup, ``Q_BUFS``), then K and V block by block into a STAGES-deep ring, K one block ahead of V (order K0, K1,
  V0, K2, V1, ...). Each stage of K and of V has its own ``empty`` mbarrier (2 arrivals, one per
  consumer), so the next QK^T's operand never queues behind the V the current P V still reads;
* two **consumer warpgroups** (the default partition and a 4-warp worker, ``setmaxnreg`` 240 each), 64
  query rows each, share the ring. Each runs the intra-warpgroup overlap: issue S_j = Q K_j^T and
  O += P_{j-1} V_{j-1} asynchronously, wait for S_j only, release K_j, run the online softmax on S_j
  while the P V wgmma runs, then wait for it, release V_{j-1} and rescale O;
* **ping-pong**: the right to issue tensor-core work alternates between the consumers through two
  "turn" mbarriers (taken before the issue, passed on right after it), so one warpgroup's softmax
  runs during the other's GEMMs and the tensor cores stay busy. Ring slots, phases and turns are
  counted over the CTA's tiles.
* **schedule**: query tiles fastest (a head's K/V stay in L2). Causal: a table the host makes
  (``_causal_order``: each group of heads' tiles longest first, each to the CTA with the least work so
  far, one CTA per SM; 1.02-1.03x the rounds below at the benchmark's causal shapes, run430); without it
  (``PYKERNELS_ATTN_SM90_ORDER=0``, or a launch captured before the table was uploaded) the grid is a
  multiple of the tiles per head and alternate rounds reverse a head's order, so each persistent CTA
  alternates long and short tiles (a plain round robin handed each CTA tiles of one length, run32:
  0.69-0.95x of one tile per CTA; alternating, run34: D = 64 GPT-2 shape 217 -> 276 TFLOP/s).

The epilogue of each consumer: O / l through its Q buffer by TMA (see Descriptors for the tail), and
lse = (m + log2 l) * ln 2 (natural log, as the Triton forward saves it, so ``attention_bwd`` takes it).
Scores are in base 2 (``qk_scale = scale * log2 e``). Causal masking is top-left aligned as in
``attention.py``: a tile visits the key blocks up to its last row's diagonal; a block is masked only
where it crosses the diagonal or the key tail (a uniform branch).

Scope (``unsupported`` says why not): sm_90, fp16/bf16, D = Dv in (64, 80, 96, 128, 192, 256; 80 and 96 on
128-wide tiles, 192 on 256-wide ones: ``TILE_D``), no mask (or a boolean
key-padding mask with its key range, not causal: ``KEY_PAD``), no dropout, scale > 0, no empty dimension,
TMA-aligned q/k/v. ``preferred`` is the speed rule of the auto path. Packed varlen sequences take the same
kernel (``VARLEN``, ``attention_fwd_sm90_varlen``; ``varlen_unsupported`` says why not, and
``kernels.attention.sm90_varlen_forward`` holds its rule: D = 128, one cu_seqlens for queries and keys).

Descriptors. Where q, k, v and o can each be seen as one (rows, row stride) matrix in which every
(batch, head) slice is a run of rows at one column offset (contiguous (B, H, S, D); transformers'
(B, S, H, D) views; expanded batch or head dims), the host builds one descriptor per tensor and a CTA
addresses its head at (row, column) coordinates (``HOST_DESC``); tiles that run past a head's Sk read
the next head's rows and are masked like any key tail, and a query tail tile is stored through a
descriptor of its head made on the device, whose store clips at Sq. Otherwise (other layouts) each CTA
makes its head's descriptors on the device and takes one tile (bitwise the same results; a GPU test
checks it). Making descriptors on the device costs several microseconds per CTA: host descriptors
took the D = 64 BERT-base forward from 181 to 344 TFLOP/s with the persistent grid (run34).
Head dims on wider tiles (``TILE_D``): a Gluon tensor's dims are powers of two, so D = 80 and 96 run the
D = 128 kernel and D = 192 the D = 256 one, every descriptor D columns wide in tiles of the wider width
(``D_COLS``): TMA loads read zeros past column D (no score changes, O's extra columns 0) and stores clip
there. Host descriptors only where every (batch, head) slice starts at column 0 of its row view (the
(B, S, H, D) views of several heads take the CTAs' own). H200 run486-488, forward against cuDNN in the same
call: D = 192 0.80-0.85x (the Triton 256 tiles 0.55x), D = 80 / 96 0.95-1.10x (the C++ op 0.90-0.98x).

Measured, H100 80GB HBM3, triton 3.6, bf16 forward, graph replay, run34 (same run): B32 H12 S512 D64
344 TFLOP/s (Triton 323, cuDNN 379); B8 H12 S1024 D64 causal 276 (217, 277); B16 H16 S1024 D128 causal
460 (278, 439); B4 H16 S4096 D128 causal 579 (396, 516); B2 H16 S8192 D128 585 / 592 full / causal
(449 / 430, 623 / 528).

Gluon has no CPU interpreter: this runs on the GPU only (CPU CI compiles it for sm_90 in
``tests/test_gluon_sm90_compile.py``). ``PYKERNELS_ATTN_SM90=0`` turns the auto path off.
"""
from __future__ import annotations

import functools
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from pykernels._alloc import empty, empty_strided

from . import _launch, _tuning

LOG2E = 1.4426950408889634
# (rows per consumer warpgroup, BLOCK_N, STAGES) per head dim; a CTA takes two warpgroups' rows. D = 256: 64 keys a
# block, two stages, one Q tile a warpgroup (``q_bufs``; 197 KB of shared memory, no spill at 240 registers a
# consumer: its O is 128 of them). H200 run474 (``attention_sm90_configs.py --d256``, graph replay) against 64 x 32
# with 3 stages and two Q tiles (the Q ring kept, 225 KB): 654 against 483 TFLOP/s at B4 H8 S4096 causal, 672 / 484
# at B4 H8 S2048, 535 / 432 at B16 H16 S512 (32-key blocks halve each wgmma's N); 64 x 32 x 4 and 64 x 128 x 1 slower
# still. D = 192 runs the D = 256 kernel, D = 80 and 96 the D = 128 one (``TILE_D``).
CONFIGS = {64: (64, 128, 2), 80: (64, 128, 2), 96: (64, 128, 2), 128: (64, 128, 2), 192: (64, 64, 2),
           256: (64, 64, 2)}
# head dims that run on wider tiles: a Gluon tensor's dims are powers of two, so D = 192 runs the D = 256 kernel on
# 256-wide tiles over 192-column descriptors (``D_COLS``): TMA loads read zeros in columns 192-255 (nothing added to
# S, O's columns there 0) and stores clip there, so no padded copies, for a third more tensor-core work than the
# columns need. Host descriptors only where every (batch, head) slice starts at column 0 of its (rows, row stride)
# view (``_flat_geometry``'s ``zero_fill``: (B, H, S, D) rows, not the (B, S, H, D) views, where a 256-wide tile would
# cover the next head's columns); else the CTAs make them on the device. ``PYKERNELS_ATTN_SM90_D192=0`` keeps D = 192
# on the Triton kernels (``preferred``; the backward's dK/dV kernel reads the same switch). D = 80 and 96 likewise on
# the D = 128 kernels' tiles (1.6x / 1.33x the columns' work), where auto ran the C++ op's wgmma kernels (D computed as
# 96, ``pykernels.attention.AUTO_CUDA_HEAD_DIMS``): H200 run487 (matrix, graph replay, forward / backward against
# cuDNN in the same call) 8 x 16 x 2048 D80 0.95 / 0.99x, D80 causal (32 heads) 1.10 / 0.92x, D96 1.01 / 0.98x, D96
# causal 1.08 / 0.93x, where the C++ op was 0.90 / 0.81, 0.93 / 0.83, 0.94 / 0.79, 0.98 / 0.80 (run472);
# ``PYKERNELS_ATTN_SM90_D80_96=0`` turns it off (auto then takes the C++ op there again)
TILE_D = {80: 128, 96: 128, 192: 256}
D192 = os.environ.get("PYKERNELS_ATTN_SM90_D192", "1") not in ("", "0")
D80_96 = os.environ.get("PYKERNELS_ATTN_SM90_D80_96", "1") not in ("", "0")
# D = 192's forward GEMMs on its columns only, as two power-of-two blocks of 128 and 64 (``_consume``'s D_A / D_B:
# QK^T in two wgmma groups over K, O as two accumulators of 128 and 64 columns), not on the 256-wide tile's zero
# columns: a quarter of the tensor-core work less, 96 accumulator registers a thread instead of 128. Column blocks are
# whole 128-byte swizzle atoms (64 bf16), as the dK/dV kernel's dQ slices are; D = 80 / 96 would need blocks of
# 16 / 32 columns, inside an atom. H200 run490 (matrix, graph replay, forward TFLOP/s, on and off in the same call):
# B4 H8 S2048 577 against 502 padded and cuDNN's 625 (0.92x, was 0.80x); B4 H8 S4096 causal 573 against 490-512 and
# cuDNN's 565-573 (1.00x, was 0.87-0.91x). ``PYKERNELS_ATTN_SM90_SPLIT_D=0`` runs the padded GEMMs.
SPLIT = {192: (128, 64)}
SPLIT_D = os.environ.get("PYKERNELS_ATTN_SM90_SPLIT_D", "1") not in ("", "0")


def zero_fill_on(d: int) -> bool:
    """Whether head dim ``d`` of ``TILE_D`` runs the Gluon kernels on its wider tiles (``D192``, ``D80_96``); True
    for the head dims the kernels take as they are."""
    return D192 if d == 192 else D80_96 if d in (80, 96) else True


# with a key-padding mask at D = 64: 128 rows x 64 keys per warpgroup (finer key blocks skip more padding):
# 1.032-1.043x at BERT-base key padding, graph replay (run98, ``attention_ab_fwd64_*_run98.txt``; the benchmark
# 1.01 -> 1.05x FlexAttention, run109); without a mask even (BERT) or 0.79x (GPT-2 causal), so only here.
# GPU key-padding tests at odd lengths: run110
KEY_PAD_CONFIGS = {64: (128, 64, 3)}
# the Q tiles are double-buffered across a CTA's tiles (the next tile's Q arrives during this tile's epilogue)
# where that fits beside the K/V ring in sm_90's 227 KiB of shared memory per block; else (D > 128) one Q tile
# a warpgroup, loaded once its O left it (``q_bufs``)
SMEM_PER_BLOCK = 232448
MAX_REGS = 65536 // (12 * 32) // 8 * 8  # 12 warps on one SM: the launch cap (168); setmaxnreg moves them
MIN_SK_D64 = 1024  # the auto path's rule at D = 64, causal (at D = 128 it always wins): ``preferred``
# the varlen forward's head dims (``kernels.attention.sm90_varlen_forward``): against the Triton varlen kernel
# (H100 run113, ``benchmarks/dev/attention_varlen_ab.py``, lengths uniform in [S / 2, S], graph replay) D = 128
# 1.16-1.32x for S 128..2048, D = 64 0.88-0.95x (the 128-row tiles waste more of each sequence's tail)
VARLEN_HEAD_DIMS = (128,)


@gluon.jit
def _mask_scores(s, j, start_m, Sk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr,
                 s_layout: gl.constexpr):
    """-inf where key column >= Sk (tail block) or, when causal, column > row."""
    cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    ok = gl.expand_dims(cols < Sk, 0)
    if IS_CAUSAL:
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        ok = ok & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
    return gl.where(ok, s, float("-inf"))


@gluon.jit
def _needs_mask(j, start_m, Sk, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    last = j * BLOCK_N + BLOCK_N - 1
    need = last >= Sk
    if IS_CAUSAL:
        need = need | (last > start_m)
    return need


@gluon.jit
def _key_span(KvRange, b, n_blocks, Sk, BLOCK_N: gl.constexpr, KEY_PAD: gl.constexpr):
    """The tile's key blocks as (first block j0, count, empty, lo, hi, dense). KEY_PAD: only the blocks of
    its batch's valid key range [lo, hi) (``KvRange`` int32 (B, 3): lo, hi, dense, from
    ``pykernels.attention._key_padding_range``; dense = every key in [lo, hi) valid). A batch without a
    valid key is ``empty``: the tile runs its first block unmasked (lo = 0, hi = Sk, dense) and the
    consumers store O = 0 and lse = -inf. Otherwise (0, n_blocks, False, 0, Sk, True)."""
    j0 = 0
    n = n_blocks
    empty = False
    lo = 0
    hi = Sk
    dense = True
    if KEY_PAD:
        lo = gl.load(KvRange + 3 * b)
        hi = gl.load(KvRange + 3 * b + 1)
        dense = gl.load(KvRange + 3 * b + 2) != 0
        j0 = lo // BLOCK_N
        n = gl.minimum(n_blocks, gl.cdiv(hi, BLOCK_N)) - j0
        empty = n <= 0
        j0 = gl.where(empty, 0, j0)
        n = gl.where(empty, 1, n)
        lo = gl.where(empty, 0, lo)
        hi = gl.where(empty, Sk, hi)
        dense = dense | empty
    return j0, n, empty, lo, hi, dense


@gluon.jit
def _key_pad_scores(s, blk, mask_row, stride_mn, Sk, lo, hi, dense, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Key padding on key block ``blk``'s scores: -inf outside [lo, hi), where the block crosses either end,
    when the batch's valid keys are ``dense``; else -inf where the boolean mask row ``mask_row`` (uint8,
    stride ``stride_mn``) is False (keys past Sk are left to ``_mask_scores``)."""
    start = blk * BLOCK_N
    cols = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if dense:
        if (start < lo) | (start + BLOCK_N > hi):
            s = gl.where(gl.expand_dims((cols >= lo) & (cols < hi), 0), s, float("-inf"))
    else:
        keep = gl.load(mask_row + cols * stride_mn, mask=cols < Sk, other=1)
        s = gl.where(gl.expand_dims(keep != 0, 0), s, float("-inf"))
    return s


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """Online softmax on raw scores s (fp32, mma layout): new max, new sum, P (fp32), rescale factor."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return m_new, l_i, p, alpha


@gluon.jit
def _fill_kv_ring(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, n_blocks, base, k_row0, k_col0,
                  v_row0, v_col0, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """K and V of every block of one tile (rows from ``k_row0`` / ``v_row0`` of the descriptors, at column
    ``k_col0`` / ``v_col0``) into the STAGES-deep ring, K one block ahead of V, each stage once its
    consumers released it. ``base``: blocks the CTA streamed before this tile (ring slot and phase of
    block j are those of base + j; mbarriers start with phase 1 complete: the first round does not wait)."""
    _load_stage(k_desc, k_smem, k_bar, k_empty, base, k_row0, k_col0, STAGES)
    for blk in range(n_blocks):
        nxt = blk + 1
        if nxt < n_blocks:
            _load_stage(k_desc, k_smem, k_bar, k_empty, base + nxt, k_row0 + nxt * BLOCK_N, k_col0, STAGES)
        _load_stage(v_desc, v_smem, v_bar, v_empty, base + blk, v_row0 + blk * BLOCK_N, v_col0, STAGES)


@gluon.jit
def _load_stage(desc, smem, full, empty, g, row, col, STAGES: gl.constexpr):
    """Block number ``g`` of a ring (stage g % STAGES): wait until its consumers released the stage, then
    one TMA load of ``desc``'s tile at (row, col) into it, completing ``full``'s phase."""
    slot = g % STAGES
    mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
    mbarrier.expect(full.index(slot), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], full.index(slot), smem.index(slot))


@gluon.jit
def _flat_coords(off, stride_m):
    """(row, column) of element offset ``off`` in a (rows, stride_m) view (int32: the caller checked)."""
    return (off // stride_m).to(gl.int32), (off % stride_m).to(gl.int32)


@gluon.jit
def _slice_desc(base, off, rows, stride_rows, HEAD_D: gl.constexpr, BLOCK: gl.constexpr, layout: gl.constexpr,
                COLS: gl.constexpr = 0):
    """A descriptor, made on the device, of one (batch, head) slice: ``rows`` x HEAD_D from ``base + off``
    with row stride ``stride_rows``, BLOCK-row tiles (a store through it clips rows >= ``rows``). COLS > 0: the
    slice is ``rows`` x COLS (COLS < HEAD_D) in HEAD_D-wide tiles: a load reads zeros past column COLS, a store
    clips there."""
    if COLS > 0:
        desc = tma.make_tensor_descriptor(base + off, [rows, COLS], [stride_rows, 1], [BLOCK, HEAD_D], layout)
    else:
        desc = tma.make_tensor_descriptor(base + off, [rows, HEAD_D], [stride_rows, 1], [BLOCK, HEAD_D], layout)
    return desc


@gluon.jit
def _mma_nt_cols(a_tile, b_tile, zero, D_A: gl.constexpr, D_B: gl.constexpr):
    """a_tile b_tile^T (shared tiles, row-major, the head dim the product's K), issued: one wgmma group, or with D_B > 0
    two over the head dim's column blocks [0, D_A) and [D_A, D_A + D_B) (the tiles' columns past them not read)."""
    if D_B > 0:
        acc = warpgroup_mma(a_tile.slice(0, D_A, dim=1), b_tile.slice(0, D_A, dim=1).permute((1, 0)), zero,
                            use_acc=False, is_async=True)
        acc = warpgroup_mma(a_tile.slice(D_A, D_B, dim=1), b_tile.slice(D_A, D_B, dim=1).permute((1, 0)), acc,
                            is_async=True)
    else:
        acc = warpgroup_mma(a_tile, b_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    return acc


@gluon.jit
def _consume(q_tile, k_smem, v_smem, q_ready, k_bar, v_bar, k_empty, v_empty, turn_bar, WG: gl.constexpr, Sk,
             qk_scale, my_m, n_blocks, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, NW: gl.constexpr, TURNS: gl.constexpr, base, q_phase,
             j0=0, Mask=None, mask_off=0, stride_mn=0, lo=0, hi=0, dense=True, KEY_PAD: gl.constexpr = False,
             D_A: gl.constexpr = 0, D_B: gl.constexpr = 0):
    """A consumer's main loop on its BLOCK_M query rows (from ``my_m``; Q in ``q_tile``), NW warps: the
    blocks' QK^T and P V on asynchronous wgmma, the next QK^T in flight during the softmax; K_j released
    through ``k_empty`` once its QK^T completed, V_j through ``v_empty`` once its P V did. Returns the
    unnormalised O (fp32), the row max m (base 2) and the row sum l; ``_epilogue`` stores them. TURNS (ping-pong): tensor-core work is issued only on this
    warpgroup's turn (``turn_bar[WG]``), passed to the other warpgroup right after the issue. ``base``:
    key blocks the CTA consumed before this tile (ring slots, phases and turns continue from there);
    ``q_phase``: the phase of ``q_ready`` that this tile's Q completes. KEY_PAD: the blocks are j0, j0 + 1,
    ... of the head's keys, masked per ``_key_pad_scores`` (``_key_span``; the mask row at ``Mask + mask_off``). D_B > 0 (``SPLIT_D``): the head dim's
    columns as two blocks, [0, D_A) and [D_A, D_A + D_B), each a power of two: QK^T over both (two wgmma groups),
    O as two accumulators (two P V groups), so that the tile's columns past D_A + D_B (zeros, ``TILE_D``) cost no
    tensor-core work. Returns (O, m, l, O's second block; O itself where D_B = 0)"""
    dtype: gl.constexpr = q_tile.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    if D_B > 0:
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, D_A, 16])
        ob_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                            instr_shape=[16, D_B, 16])
        pb_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ob_layout, k_width=2)
        row_ob: gl.constexpr = gl.SliceLayout(1, ob_layout)
        acc = gl.zeros([BLOCK_M, D_A], gl.float32, o_layout)
        acc_b = gl.zeros([BLOCK_M, D_B], gl.float32, ob_layout)
        S_GROUPS: gl.constexpr = 2  # (wgmma groups a QK^T, and a P V)
    else:
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
        acc_b = acc
        S_GROUPS: gl.constexpr = 1
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)

    mbarrier.wait(q_ready, q_phase)
    mbarrier.wait(k_bar.index(base % STAGES), (base // STAGES) & 1)
    if TURNS:  # issue t (counted over the CTA's tiles) waits phase t of turn_bar[WG] (warpgroup 0's 0 at init)
        mbarrier.wait(turn_bar.index(WG), base & 1)
    s = _mma_nt_cols(q_tile, k_smem.index(base % STAGES), s_zero, D_A, D_B)
    if TURNS:
        mbarrier.arrive(turn_bar.index(1 - WG), count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(base % STAGES), count=1)
    if KEY_PAD:
        s = _key_pad_scores(s, j0, Mask + mask_off, stride_mn, Sk, lo, hi, dense, BLOCK_N, s_layout)
    if _needs_mask(j0, my_m, Sk, BLOCK_N, IS_CAUSAL):
        s = _mask_scores(s, j0, my_m, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, s_layout)
    m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i, qk_scale)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    if D_B > 0:
        pb_op = gl.convert_layout(p.to(dtype), pb_layout)

    for j in range(1, n_blocks):
        g = base + j
        slot = g % STAGES
        prev = (g - 1) % STAGES
        mbarrier.wait(k_bar.index(slot), (g // STAGES) & 1)
        mbarrier.wait(v_bar.index(prev), ((g - 1) // STAGES) & 1)
        if TURNS:
            mbarrier.wait(turn_bar.index(WG), g & 1)
        k_tile = k_smem.index(slot)
        v_tile = v_smem.index(prev)
        s = _mma_nt_cols(q_tile, k_tile, s_zero, D_A, D_B)
        if D_B > 0:
            acc = warpgroup_mma(p_op, v_tile.slice(0, D_A, dim=1), acc, is_async=True)
            acc_b = warpgroup_mma(pb_op, v_tile.slice(D_A, D_B, dim=1), acc_b, is_async=True)
        else:
            acc = warpgroup_mma(p_op, v_tile, acc, is_async=True)
        if TURNS:
            mbarrier.arrive(turn_bar.index(1 - WG), count=1)
        s = warpgroup_mma_wait(num_outstanding=S_GROUPS, deps=(s, ))
        mbarrier.arrive(k_empty.index(slot), count=1)  # S_j done (groups complete in order); P V may run
        if KEY_PAD:
            s = _key_pad_scores(s, j0 + j, Mask + mask_off, stride_mn, Sk, lo, hi, dense, BLOCK_N, s_layout)
        if _needs_mask(j0 + j, my_m, Sk, BLOCK_N, IS_CAUSAL):
            s = _mask_scores(s, j0 + j, my_m, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, s_layout)
        m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i, qk_scale)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        if D_B > 0:
            pb_op = gl.convert_layout(p.to(dtype), pb_layout)
            acc, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_b))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        fence_async_shared()
        mbarrier.arrive(v_empty.index(prev), count=1)  # V of block j - 1 is no longer read
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        if D_B > 0:
            acc_b = acc_b * gl.expand_dims(gl.convert_layout(alpha, row_ob), 1)

    last = base + n_blocks - 1
    mbarrier.wait(v_bar.index(last % STAGES), (last // STAGES) & 1)
    v_tile = v_smem.index(last % STAGES)
    if D_B > 0:
        acc = warpgroup_mma(p_op, v_tile.slice(0, D_A, dim=1), acc, is_async=True)
        acc_b = warpgroup_mma(pb_op, v_tile.slice(D_A, D_B, dim=1), acc_b, is_async=True)
        acc, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_b))
    else:
        acc = warpgroup_mma(p_op, v_tile, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        acc_b = acc
    mbarrier.arrive(v_empty.index(last % STAGES), count=1)  # the next tile's blocks reuse the ring
    return acc, m_i, l_i, acc_b


@gluon.jit
def _lg2_approx(x):
    """log2 of fp32 ``x`` by the MUFU (``lg2.approx.f32``: absolute error about 2^-22 per the PTX ISA; -inf at
    0)."""
    return gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _epilogue(acc, m_i, l_i, q_tile, O, LSE, o_off, l_off, stride_om, Sq, my_m, o_desc, HEAD_D: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NW: gl.constexpr, HOST_O: gl.constexpr,
              q_layout: gl.constexpr, D_COLS: gl.constexpr = 0, acc_b=None, D_A: gl.constexpr = 0,
              D_B: gl.constexpr = 0):
    """O / l by TMA through ``q_tile`` (every QK^T is complete, so Q's buffer stages O) and lse (natural
    log) by pointer. HOST_O: a whole tile goes through the caller's descriptor ``o_desc`` over every head's
    rows; a tail tile (and every tile without HOST_O) through this head's (Sq, D) descriptor made on the
    device, whose store clips rows >= Sq. The offsets are computed by the caller after the main loop, so
    they hold no registers during it. D_COLS > 0: O's rows are D_COLS wide (``TILE_D``). D_B > 0: O is ``acc``
    (columns [0, D_A)) and ``acc_b`` (the next D_B), ``_consume``'s split."""
    dtype: gl.constexpr = q_tile.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    if D_B > 0:
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, D_A, 16])
        ob_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                            instr_shape=[16, D_B, 16])
    else:
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, HEAD_D, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_o = gl.convert_layout(l_i, row_o)
    # l >= 1 (the row max's own term) and finite: one reciprocal a row and a multiply an element. ``acc / l``
    # lowers to div.full.f32, whose range checks cost three instructions an element (FMUL, FSEL, FMUL), and
    # gl.log2 to a 20-instruction polynomial; lg2.approx is within about 2^-22 (run126's profile put 8% of the
    # BERT-base forward's stall samples in this epilogue)
    out = acc * gl.expand_dims(1.0 / l_o, 1)
    rows = my_m + gl.arange(0, BLOCK_M, layout=row_s)
    lse = (m_i + _lg2_approx(l_i)) * 0.6931471805599453
    gl.store(LSE + l_off + rows, lse, mask=rows < Sq)
    if D_B > 0:  # (the tile's columns past D_A + D_B keep Q's zeros; the store clips them)
        q_tile.slice(0, D_A, dim=1).store(out.to(dtype))
        out_b = acc_b * gl.expand_dims(1.0 / gl.convert_layout(l_i, gl.SliceLayout(1, ob_layout)), 1)
        q_tile.slice(D_A, D_B, dim=1).store(out_b.to(dtype))
    else:
        q_tile.store(out.to(dtype))
    fence_async_shared()
    _store_rows(q_tile, O, o_off, stride_om, Sq, my_m, o_desc, HEAD_D, BLOCK_M, HOST_O, q_layout, D_COLS)


@gluon.jit
def _store_rows(tile, X, x_off, stride_xm, S, my_m, x_desc, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                HOST: gl.constexpr, layout: gl.constexpr, COLS: gl.constexpr = 0):
    """Rows [my_m, + BLOCK_M) of the (batch, head) slice at element offset ``x_off`` of X from the shared
    ``tile`` (written and fenced) by TMA, then waits. HOST: a whole tile goes through the caller's
    descriptor ``x_desc`` over every head's rows; a tail tile (and every tile without HOST) through this
    head's (S, D) descriptor made on the device, whose store clips rows >= S. COLS > 0: X's rows are COLS
    wide (``_slice_desc``; the store clips columns >= COLS)."""
    if HOST and my_m + BLOCK_M <= S:
        row0, col0 = _flat_coords(x_off, stride_xm)
        tma.async_copy_shared_to_global(x_desc, [row0 + my_m, col0], tile)
    else:
        head = _slice_desc(X, x_off, S, stride_xm, HEAD_D, BLOCK_M, layout, COLS)
        tma.async_copy_shared_to_global(head, [my_m, 0], tile)
    tma.store_wait(pendings=0)


@gluon.jit
def _head_descriptors(Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                      stride_vn, b, h64, hk, Sq, Sk, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, q_layout: gl.constexpr, kv_layout: gl.constexpr,
                      COLS: gl.constexpr = 0):
    """The (batch b, head h64 / kv head hk) slices of Q, K and V as tensor descriptors made on the device (COLS >
    0: COLS columns in HEAD_D-wide tiles, ``_slice_desc``)."""
    q_desc = _slice_desc(Q, b * stride_qb + h64 * stride_qh, Sq, stride_qm, HEAD_D, BLOCK_M, q_layout, COLS)
    k_desc = _slice_desc(K, b * stride_kb + hk * stride_kh, Sk, stride_kn, HEAD_D, BLOCK_N, kv_layout, COLS)
    v_desc = _slice_desc(V, b * stride_vb + hk * stride_vh, Sk, stride_vn, HEAD_D, BLOCK_N, kv_layout, COLS)
    return q_desc, k_desc, v_desc


@gluon.jit
def _tile_run(Order, n_tiles, ORDER: gl.constexpr):
    """(first, end, step) of the CTA's tiles in the persistent grid: with ORDER its run of the host's tile table
    (``_causal_order``: the CTAs' run starts, then the tiles), else every num_programs-th tile from its own."""
    if ORDER:
        i0 = gl.load(Order + gl.program_id(0))
        i1 = gl.load(Order + gl.program_id(0) + 1)
        step = 1
    else:
        i0 = gl.program_id(0)
        i1 = n_tiles
        step = gl.num_programs(0)
    return i0, i1, step


@gluon.jit
def _tile_at(Order, i, ORDER: gl.constexpr):
    """The tile at place ``i`` of ``_tile_run``'s range."""
    if ORDER:
        tile = gl.load(Order + gl.num_programs(0) + 1 + i)
    else:
        tile = i
    return tile


@gluon.jit
def _tile_coords(tile, n_m, H, GROUP, Sk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr,
                 ORDER: gl.constexpr):
    """Tile index -> (first query row of the CTA's 2 * BLOCK_M, batch, head, kv head (int64), key blocks).
    Query tiles run fastest (a head's K/V stay in L2). Causal: a head's tiles longest first in even rounds
    of the grid and shortest first in odd ones, so a persistent CTA alternates long and short tiles (the
    host makes the grid a multiple of n_m: every head's tiles lie in one round). ORDER: ``tile`` is an
    entry of the host's tile table (``_causal_order``), taken as it is (tile = (batch * H + head) * n_m +
    query tile)."""
    pid_m = tile % n_m
    if IS_CAUSAL:
        if ORDER:
            pass
        else:
            if (tile // gl.num_programs(0)) % 2 == 0:
                pid_m = n_m - 1 - pid_m
    hb = tile // n_m
    h = hb % H
    start_m = pid_m * (2 * BLOCK_M)
    # the CTA's causal extent is its last warpgroup's; a warpgroup past the diagonal masks what it must
    if IS_CAUSAL:
        hi = gl.minimum(Sk, start_m + 2 * BLOCK_M)
    else:
        hi = Sk
    return start_m, (hb // H).to(gl.int64), h.to(gl.int64), (h // GROUP).to(gl.int64), gl.cdiv(hi, BLOCK_N)


@gluon.jit
def _varlen_span(CuQ, CuK, b, start_m, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Sequence b of a varlen batch, for the tile of 2 * BLOCK_M rows from ``start_m``: (first query row
    (int64), query length, first key row (int64), key length for the masks, the tile's key blocks, empty).
    Causal: top-left aligned in the sequence, as the dense kernel (the tile's blocks up to its last row's
    diagonal). A sequence without keys is ``empty``: its tile runs one block with key 0 unmasked (finite
    scores, no NaN) and the consumers store O = 0 and lse = -inf."""
    q0 = gl.load(CuQ + b)
    sq = gl.load(CuQ + b + 1) - q0
    k0 = gl.load(CuK + b)
    sk = gl.load(CuK + b + 1) - k0
    empty = sk <= 0
    sk = gl.where(empty, 1, sk)
    hi = sk
    if IS_CAUSAL:
        hi = gl.minimum(sk, start_m + 2 * BLOCK_M)
    return q0.to(gl.int64), sq, k0.to(gl.int64), sk, gl.cdiv(hi, BLOCK_N), empty


@gluon.jit
def _consumer(WG: gl.constexpr, Q, K, V, O, LSE, q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar,
              k_empty, v_empty, turn_bar, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb,
              stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, H, GROUP, Sq, Sk, qk_scale,
              n_m, n_tiles, Mask, KvRange, stride_mb, stride_mn, CuQ, CuK, Order, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, HOST_DESC: gl.constexpr,
              KEY_PAD: gl.constexpr, VARLEN: gl.constexpr, ORDER: gl.constexpr, q_layout: gl.constexpr,
              Q_BUFS: gl.constexpr, D_COLS: gl.constexpr = 0, D_A: gl.constexpr = 0, D_B: gl.constexpr = 0):
    """Consumer warpgroup WG over the CTA's tiles: rows [start_m + WG * BLOCK_M, + BLOCK_M) of each; its Q
    buffer of a tile is (tile count % Q_BUFS, WG), released through ``q_empty`` once O left it. VARLEN: tiles
    past their sequence's length are skipped (by the producer alike), so the count of active tiles is
    carried through the loop. D_COLS > 0: O's rows are D_COLS wide (``TILE_D``); D_B > 0: O in two column blocks
    (``_consume``'s split, dense tiles only)."""
    if VARLEN:  # (its own loop: the dense one below stays as it was, register for register)
        base = 0
        n_done = 0  # active tiles so far (the producer skips the same ones)
        for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            start_m, b, h, hk, n_blocks = _tile_coords(tile, n_m, H, GROUP, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, ORDER)
            q0, sq_t, k0, sk_t, n_blocks, v_empty_seq = _varlen_span(CuQ, CuK, b, start_m, BLOCK_M, BLOCK_N, IS_CAUSAL)
            if start_m < sq_t:
                buf = (n_done % Q_BUFS) * 2 + WG
                my_m = start_m + WG * BLOCK_M
                acc, m_i, l_i, _ = _consume(q_smem.index(buf), k_smem, v_smem, q_bar.index(buf), k_bar, v_bar, k_empty,
                                         v_empty, turn_bar, WG, sk_t, qk_scale, my_m, n_blocks, HEAD_D, BLOCK_M,
                                         BLOCK_N, STAGES, IS_CAUSAL, 4, True, base, (n_done // Q_BUFS) & 1)
                hb = tile // n_m  # (sequence, head, start and length again: not held through the main loop)
                b = (hb // H).to(gl.int64)
                h = (hb % H).to(gl.int64)
                q0, sq_t, k0, sk_t, nb, v_empty_seq = _varlen_span(CuQ, CuK, b, start_m, BLOCK_M, BLOCK_N, IS_CAUSAL)
                acc = acc * gl.where(v_empty_seq, 0.0, 1.0)  # a sequence without keys: O = 0, lse = -inf
                m_i = gl.where(v_empty_seq, float("-inf"), m_i)
                _epilogue(acc, m_i, l_i, q_smem.index(buf), O, LSE, h * stride_oh + q0 * stride_om,
                          h * stride_lh + q0, stride_om, sq_t, my_m, o_desc, HEAD_D, BLOCK_M, BLOCK_N, 4, HOST_DESC,
                          q_layout, D_COLS)
                mbarrier.arrive(q_empty.index(buf), count=1)
                base += n_blocks
                n_done += 1
    else:
        base = 0
        i0, i1, step = _tile_run(Order, n_tiles, ORDER)
        for i in range(i0, i1, step):
            tile = _tile_at(Order, i, ORDER)
            start_m, b, h, hk, n_blocks = _tile_coords(tile, n_m, H, GROUP, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, ORDER)
            it = (i - i0) // step  # this CTA's tile count (not loop-carried)
            buf = (it % Q_BUFS) * 2 + WG
            my_m = start_m + WG * BLOCK_M
            j0, n_blocks, empty, lo, hi, dense = _key_span(KvRange, b, n_blocks, Sk, BLOCK_N, KEY_PAD)
            acc, m_i, l_i, acc_b = _consume(q_smem.index(buf), k_smem, v_smem, q_bar.index(buf), k_bar, v_bar,
                                            k_empty, v_empty, turn_bar, WG, Sk, qk_scale, my_m, n_blocks, HEAD_D,
                                            BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, 4, True, base, (it // Q_BUFS) & 1, j0,
                                            Mask, b * stride_mb, stride_mn, lo, hi, dense, KEY_PAD, D_A, D_B)
            if KEY_PAD:  # a batch without a valid key: O = 0, lse = -inf
                acc = acc * gl.where(empty, 0.0, 1.0)
                acc_b = acc_b * gl.where(empty, 0.0, 1.0)  # (D_B = 0: acc_b is O itself, unused)
                m_i = gl.where(empty, float("-inf"), m_i)
            hb = tile // n_m  # (batch, head) again: not held in registers through the main loop
            b = (hb // H).to(gl.int64)
            h = (hb % H).to(gl.int64)
            _epilogue(acc, m_i, l_i, q_smem.index(buf), O, LSE, b * stride_ob + h * stride_oh,
                      b * stride_lb + h * stride_lh, stride_om, Sq, my_m, o_desc, HEAD_D, BLOCK_M, BLOCK_N, 4,
                      HOST_DESC, q_layout, D_COLS, acc_b, D_A, D_B)
            mbarrier.arrive(q_empty.index(buf), count=1)
            base += n_blocks


@gluon.jit
def _producer(Q, K, V, O, LSE, q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar,
              k_empty, v_empty, turn_bar, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb,
              stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, H, GROUP, Sq, Sk, qk_scale,
              n_m, n_tiles, Mask, KvRange, stride_mb, stride_mn, CuQ, CuK, Order, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, HOST_DESC: gl.constexpr,
              KEY_PAD: gl.constexpr, VARLEN: gl.constexpr, ORDER: gl.constexpr, q_layout: gl.constexpr,
              Q_BUFS: gl.constexpr):
    """The producer warp, over the CTA's tiles: both warpgroups' Q tiles (``Q_BUFS`` a warpgroup: two,
    double-buffered across tiles, where they fit; else one, loaded once the last tile's O left it), then the tile's K/V through the ring (each stage's empty barriers count 2 arrivals, one per consumer).
    VARLEN: a sequence b is rows [cu[b], cu[b + 1]) of the packed tensors (``stride_*b`` 0); tiles past its
    length are skipped, as the consumers skip them."""
    base = 0
    it = 0
    i0, i1, step = _tile_run(Order, n_tiles, ORDER)
    for i in range(i0, i1, step):
        tile = _tile_at(Order, i, ORDER)
        start_m, b, h, hk, n_blocks = _tile_coords(tile, n_m, H, GROUP, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, ORDER)
        active = True
        sk_t = Sk
        if VARLEN:
            q0, sq_t, k0, sk_t, n_blocks, v_empty_seq = _varlen_span(CuQ, CuK, b, start_m, BLOCK_M, BLOCK_N, IS_CAUSAL)
            active = start_m < sq_t
        if active:
            j0, n_blocks, empty, lo, hi, dense = _key_span(KvRange, b, n_blocks, sk_t, BLOCK_N, KEY_PAD)
            q_row0, q_col0, k_row0, k_col0, v_row0, v_col0 = 0, 0, 0, 0, 0, 0
            if HOST_DESC:
                q_off = b * stride_qb + h * stride_qh
                k_off = b * stride_kb + hk * stride_kh
                v_off = b * stride_vb + hk * stride_vh
                if VARLEN:
                    q_off = q_off + q0 * stride_qm
                    k_off = k_off + k0 * stride_kn
                    v_off = v_off + k0 * stride_vn
                q_row0, q_col0 = _flat_coords(q_off, stride_qm)
                k_row0, k_col0 = _flat_coords(k_off, stride_kn)
                v_row0, v_col0 = _flat_coords(v_off, stride_vn)
            for wg in gl.static_range(2):
                buf = (it % Q_BUFS) * 2 + wg
                mbarrier.wait(q_empty.index(buf), ((it // Q_BUFS) & 1) ^ 1)
                mbarrier.expect(q_bar.index(buf), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [q_row0 + start_m + wg * BLOCK_M, q_col0], q_bar.index(buf),
                                                q_smem.index(buf))
            _fill_kv_ring(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, n_blocks, base,
                          k_row0 + j0 * BLOCK_N, k_col0, v_row0 + j0 * BLOCK_N, v_col0, STAGES, BLOCK_N)
            base += n_blocks
            it += 1


@gluon.jit
def _alloc_kv_ring(dtype: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                   kv_layout: gl.constexpr):
    """The K/V ring two ping-pong consumers share (``_fill_kv_ring`` fills it): STAGES stages of K and of
    V, each with a "full" mbarrier and an "empty" one that counts an arrival per consumer, and the two
    turn mbarriers, warpgroup 0 holding the first turn (its phase 0 complete)."""
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.arrive(turn_bar.index(0), count=1)
    return k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, turn_bar


@gluon.jit
def _attention_fwd_sm90_kernel(
    Q, K, V, O, LSE, QD, KD, VD, OD,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    H, GROUP, Sq, Sk, qk_scale, n_m, n_tiles, Mask, KvRange, stride_mb, stride_mn, CuQ, CuK, Order,
    HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, HOST_DESC: gl.constexpr, KEY_PAD: gl.constexpr, VARLEN: gl.constexpr,
    ORDER: gl.constexpr, q_layout: gl.constexpr, kv_layout: gl.constexpr, num_warps: gl.constexpr,
    Q_BUFS: gl.constexpr, D_COLS: gl.constexpr = 0, D_A: gl.constexpr = 0, D_B: gl.constexpr = 0,
):
    """Tiles of 2 * BLOCK_M query rows of one (batch, head), n_m per head, n_tiles in all, over a 1-D grid:
    a CTA takes tiles program_id, + num_programs, ... (persistent when the grid is smaller than n_tiles).
    Two consumer warpgroups (the default partition and a 4-warp worker) in ping-pong over one K/V ring
    filled by a 1-warp producer; num_warps = 4. HOST_DESC: QD..OD are the caller's descriptors over
    (rows, row stride) views of q, k, v, o, and a head's tiles sit at (row, column) coordinates of its
    offset; else (one tile per CTA) the CTA makes its head's descriptors on the device. KEY_PAD: a boolean
    key-padding mask (uint8, ``Mask + b * stride_mb + key * stride_mn``) with its per-batch valid key range
    ``KvRange`` (int32 (B, 3)): a tile streams only the key blocks of that range (``_key_span``) and masks
    their keys (``_key_pad_scores``: by index where the range is dense, else by the mask); not causal (the
    host's rule). VARLEN: packed (T, H, D) q/k/v/o seen as (1, H, T, D) (``stride_*b`` 0), batch b the
    sequence at rows [CuQ[b], CuQ[b + 1]) and [CuK[b], CuK[b + 1]); n_m tiles per (sequence, head) from the
    longest, those past a sequence's length skipped; lse (H, T) at ``h * stride_lh + row``; host
    descriptors only; causal top-left aligned within each sequence. D_COLS > 0 (``TILE_D``): q, k, v, o are
    D_COLS < HEAD_D columns wide, in HEAD_D-wide tiles (the host's descriptors so too); D_B > 0 (
    ``SPLIT_D``): the consumers' GEMMs on column blocks [0, D_A) and [D_A, D_A + D_B) only (``_consume``)."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    gl.static_assert(HOST_DESC or not VARLEN, "varlen takes the host's descriptors")
    gl.static_assert(not ORDER or (HOST_DESC and not VARLEN), "the tile table is the dense persistent grid's")
    dtype: gl.constexpr = Q.dtype.element_ty
    if HOST_DESC:
        q_desc, k_desc, v_desc, o_desc = QD, KD, VD, OD
    else:
        start_m, b, h, hk, n_blocks = _tile_coords(gl.program_id(0), n_m, H, GROUP, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, False)
        q_desc, k_desc, v_desc = _head_descriptors(
            Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
            stride_vn, b, h, hk, Sq, Sk, HEAD_D, BLOCK_M, BLOCK_N, q_layout, kv_layout, D_COLS)
        o_desc = q_desc  # (unused: the consumers make the head's O descriptor)
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFS, BLOCK_M, HEAD_D], q_layout)  # (tile % Q_BUFS, warpgroup)
    q_bar = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * Q_BUFS):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, turn_bar = _alloc_kv_ring(dtype, STAGES, BLOCK_N, HEAD_D,
                                                                              kv_layout)
    # (a tuple of the arguments cannot hold the constexpr layouts: each partition gets them spelled out)
    gl.warp_specialize([
        (_consumer, (0, Q, K, V, O, LSE, q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, k_empty,
                        v_empty, turn_bar, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb,
                        stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, H, GROUP, Sq, Sk,
                        qk_scale, n_m, n_tiles, Mask, KvRange, stride_mb, stride_mn, CuQ, CuK, Order, HEAD_D, BLOCK_M, BLOCK_N,
                        STAGES, IS_CAUSAL, HOST_DESC, KEY_PAD, VARLEN, ORDER, q_layout, Q_BUFS, D_COLS, D_A, D_B)),
        (_producer, (Q, K, V, O, LSE, q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, k_empty,
                        v_empty, turn_bar, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb,
                        stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, H, GROUP, Sq, Sk,
                        qk_scale, n_m, n_tiles, Mask, KvRange, stride_mb, stride_mn, CuQ, CuK, Order, HEAD_D, BLOCK_M, BLOCK_N,
                        STAGES, IS_CAUSAL, HOST_DESC, KEY_PAD, VARLEN, ORDER, q_layout, Q_BUFS)),
        (_consumer, (1, Q, K, V, O, LSE, q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, k_empty,
                        v_empty, turn_bar, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb,
                        stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, H, GROUP, Sq, Sk,
                        qk_scale, n_m, n_tiles, Mask, KvRange, stride_mb, stride_mn, CuQ, CuK, Order, HEAD_D, BLOCK_M, BLOCK_N,
                        STAGES, IS_CAUSAL, HOST_DESC, KEY_PAD, VARLEN, ORDER, q_layout, Q_BUFS, D_COLS, D_A, D_B)),
    ], [1, 4], [24, 240])


def q_bufs(block_m: int, block_n: int, stages: int, d: int) -> int:
    """Q tiles a consumer warpgroup holds (``Q_BUFS``): 2 where both warpgroups' two Q tiles and the K/V ring
    (bf16 / fp16) fit ``SMEM_PER_BLOCK`` with 1 KiB to spare for the mbarriers, else 1."""
    ring = 2 * stages * block_n * d * 2
    return 2 if 4 * block_m * d * 2 + ring + 1024 <= SMEM_PER_BLOCK else 1


@functools.lru_cache(maxsize=64)
def smem_layouts(block_m: int, block_n: int, d: int, dtype: torch.dtype):
    """NVMMA shared layouts of a Q (or O) tile and of a K/V tile (cached: ~10 us of host time a call)."""
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([block_m, d], gdt),
            gl.NVMMASharedLayout.get_default_for([block_n, d], gdt))


def _tma_strides_ok(stride) -> bool:
    """TMA's rules on a (B, H, S, D) tensor's strides: a unit last stride, the others multiples of 16 bytes
    (8 elements of 2 bytes), a nonzero row stride. (Spelled out, with no generator: the host path is what
    limits eager calls at BERT sizes, run131.)"""
    sb, sh, sm, sd = stride
    return sd == 1 and sm > 0 and sb % 8 == 0 and sh % 8 == 0 and sm % 8 == 0


def _tma_ok(t: torch.Tensor) -> bool:
    """``_tma_strides_ok`` and a 16-byte aligned base."""
    return _tma_strides_ok(t.stride()) and not t.data_ptr() & 15


def unsupported(q, k, v, mask, *, dropout_p: float, scale: float, varlen: bool, kv_range=None,
                causal: bool = False) -> str | None:
    """None when this kernel covers the call (dense (B, H, S, D) tensors), else the reason it does not. A
    mask is covered only as a boolean key-padding mask with its ``kv_range`` (the forward, not causal)."""
    if varlen or dropout_p > 0:
        return "dropout or varlen"
    if mask is not None and (kv_range is None or mask.dtype != torch.bool or causal):
        return "a mask other than a boolean key-padding mask (not causal)"
    if q.numel() == 0 or k.numel() == 0:
        return "an empty tensor"  # (a grid of no programs is not a valid launch)
    if q.device.type != "cuda" or _tuning.interpret():
        return "not an sm_90 GPU"
    props = _tuning.device_properties(q.device)  # (cached: torch.cuda.get_device_capability costs ~8 us a call)
    if (props.major, props.minor) != (9, 0):
        return "not an sm_90 GPU"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return "dtype is not float16/bfloat16"
    d = q.shape[-1]
    if d not in CONFIGS or k.shape[-1] != d or v.shape[-1] != d:
        return f"head dim is not {', '.join(map(str, sorted(CONFIGS)))} (or Dv != D)"
    if not scale > 0:
        return "scale <= 0"
    if not (_tma_ok(q) and _tma_ok(k) and _tma_ok(v)):
        return "strides not TMA-aligned"
    return None


def enabled() -> bool:
    return os.environ.get("PYKERNELS_ATTN_SM90", "1") not in ("", "0")


def preferred(q, k, causal: bool) -> bool:
    """The auto path's speed rule against the Triton forward (H100 run34,
    ``benchmarks/dev/attention_sm90_crossover.py``, graph replay): D = 128 always (1.17-1.64x); D = 64
    without causal masking from Sk = 512 (1.04-1.09x; 0.97x at 256), causal from 1024 (1.10-1.18x; 0.72x
    at 256, 0.91x at 512). D = 256 always: H200 run474 (``benchmarks/dev/attention_sm90_configs.py --d256``, graph
    replay, TFLOP/s against the Triton forward's D = 256 tier) B4 H8 S4096 causal 654 / 426, B4 H8 S2048 672 / 474,
    B2 H8 S8192 624 / 510, B16 H16 S512 535 / 353, B1 H8 S8192 causal 682 / 415. D = 192 on the D = 256 kernel,
    D = 80 and 96 on the D = 128 one (``TILE_D``) where ``zero_fill_on``."""
    d, sk = q.shape[-1], k.shape[2]
    if d == 64:
        return sk >= (MIN_SK_D64 if causal else 512) and enabled()
    if d in TILE_D:
        return zero_fill_on(d) and enabled()
    return d in (128, 256) and enabled()


def _flat_geometry(shape, strides, block_rows: int, zero_fill: bool = False):
    """(rows, row stride) of a host descriptor over a (B, H, S, D) tensor of this shape and these strides
    seen as a (rows, stride(2)) matrix, in which every (batch, head) slice is a run of rows at one column
    offset; None when the strides do not allow that (then the kernel makes each head's descriptors on the
    device). Covers contiguous (B, H, S, D) and the (B, S, H, D) transposed views, packed or padded rows, and
    expanded (stride 0) batch or head dims. ``zero_fill`` (tiles wider than D, ``TILE_D``): every slice must
    start at column 0 (not the (B, S, H, D) views of more than one head)."""
    batch, heads, seq, d = shape
    sb, sh, sm, _ = strides
    if sm < d or seq < block_rows:
        return None
    if batch > 1 and sb % sm:
        return None
    if heads > 1 and sh % sm and (zero_fill or not (sh >= d and sh * (heads - 1) + d <= sm)):
        return None
    rows = ((batch - 1) * sb + (heads - 1) * sh) // sm + seq
    if rows >= 2**31:
        return None
    return rows, sm


def _descriptor_fields(geometry, block_rows: int, d: int, layout, tile_d: int = 0) -> tuple:
    """(shape, strides, block shape, layout) of the host descriptor of ``_flat_geometry``'s ``geometry``
    (rows, row stride): what ``_descriptor`` sets (the lists are only read by the launcher). ``tile_d`` > d:
    d columns wide in tile_d-wide tiles (loads read zeros past column d, stores clip there; the geometry's
    ``zero_fill``)."""
    rows, sm = geometry
    if tile_d > d:
        return [rows, d], [sm, 1], [block_rows, tile_d], layout
    return [rows, sm], [sm, 1], [block_rows, d], layout


def _descriptor(t: torch.Tensor, fields):
    """The host descriptor over ``t`` with ``_descriptor_fields``' ``fields`` (``_launch.host_descriptor``)."""
    return _launch.host_descriptor(t, *fields)


def _flat_descriptor(t: torch.Tensor, block_rows: int, layout):
    """``_descriptor`` over ``t`` (B, H, S, D) with its ``_flat_geometry``, or None where there is none."""
    geometry = _flat_geometry(t.shape, t.stride(), block_rows)
    if geometry is None:
        return None
    return _descriptor(t, _descriptor_fields(geometry, block_rows, t.shape[3], layout))


_SMS: dict = {}


def _num_sms(device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _SMS.get(idx)
    if n is None:
        n = _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


# The causal persistent forward's tile table (``_causal_order``). Without it the grid is the largest multiple of
# a head's tiles within the SMs (128 of an H100's or H200's 132 at n_m = 32 or 64: 3% of the card idle) and a
# CTA's tiles alternate in order round by round. With it every SM takes tiles: each (batch, head) group's tiles
# longest first, handed one by one to the CTA with the least work so far (longest-processing-time), the work of
# a tile modelled as its key blocks plus ``ORDER_TILE_COST`` (its Q load and epilogue); a group is as many
# heads as the candidates' best model (``_order_groups``) within ``ORDER_L2_BYTES`` of K / V, so that the tiles
# running together share their heads' K / V in L2. Taken where the model's last CTA ends no later than the
# alternating rounds' (``ORDER_MIN_GAIN`` sooner; ``PYKERNELS_ATTN_SM90_ORDER``: ``auto``, ``1`` wherever the
# persistent causal grid runs, ``0`` never), for at most ``ORDER_MAX_TILES`` tiles (the table's host time, once
# per shape: 3.5 ms at GPT-2's 768 tiles, 8 ms at 2048, 27 ms at 32768 with one candidate group past
# ``ORDER_FEW_GROUPS_TILES``, 61 ms at 65536). H200 run430 (``benchmarks/dev/attention_fwd_order_ab.py``, the two
# alternating graph by graph), forward speed-up over the rounds: B4 H16 S4096 D128 1.017x, B2 H16 S8192 1.019x,
# B1 H16 S16384 1.021x, B8 H16 S2048 1.009x, B16 H16 S1024 1.031x, B8 H12 S1024 D64 (GPT-2) 1.027x (the model:
# no gain; so the threshold is 0), B3 H12 S2048 D128 (4.5 rounds of 128 CTAs) 1.25x; groups of one head (4
# MiB at S8192): 0.96-0.97x at S4096 / S8192.
ORDER_TILE_COST = 1.0
ORDER_L2_BYTES = 24 << 20
ORDER_MIN_GAIN = 0.0
ORDER_MAX_TILES = 1 << 16
ORDER_FEW_GROUPS_TILES = 1 << 13


def order_mode() -> str:
    """``PYKERNELS_ATTN_SM90_ORDER``: ``auto`` (default), ``1`` or ``0``; anything else is a ValueError."""
    mode = os.environ.get("PYKERNELS_ATTN_SM90_ORDER", "auto").strip().lower() or "auto"
    if mode not in ("auto", "1", "0"):
        raise ValueError(f"PYKERNELS_ATTN_SM90_ORDER must be auto, 1 or 0, got {mode!r}")
    return mode


def _order_groups(n_m: int, sms: int, g_max: int, n_tiles: int = 0) -> list:
    """The heads-per-group candidates of ``_causal_order``: about 0.5 .. 4 rounds of the grid's tiles; past
    ``ORDER_FEW_GROUPS_TILES`` tiles only the group of a round or just under (the greedy's host time; with
    many tiles a CTA the groups' ends weigh less)."""
    fs = (1,) if n_tiles > ORDER_FEW_GROUPS_TILES else (0.5, 1, 1.25, 1.5, 2, 3, 4)
    cands = {max(1, sms // n_m)} | {max(1, round(sms * f / n_m)) for f in fs}
    return sorted(g for g in cands if g <= g_max) or [1]


def _causal_order(n_m: int, n_bh: int, sk: int, rows: int, block_n: int, sms: int, head_bytes: int,
                  force: bool = False):
    """The causal persistent forward's tile table, or None where the alternating rounds are modelled as
    faster (``ORDER_MIN_GAIN``; ``force``: always a table). ``n_m`` tiles of ``rows`` query rows per
    (batch, head), ``n_bh`` (batch, head)s, tile p of a head visiting cdiv(min(sk, (p + 1) rows), block_n) key
    blocks; ``head_bytes`` the K / V bytes a query head reads. Returns (grid, table): table = the CTAs' starts
    (grid + 1 int32, into the tile list) then the tile list, CTA c's tiles at [table[c], table[c + 1]), in
    the order it runs them (tile = (batch * H + head) * n_m + query tile)."""
    import heapq
    n_tiles = n_m * n_bh
    grid = min(n_tiles, sms)
    cost = [_tuning.cdiv(min(sk, (p + 1) * rows), block_n) + ORDER_TILE_COST for p in range(n_m)]
    # the alternating rounds (``_tile_coords``), as the kernel runs them without a table
    g_old = min(n_tiles, sms // n_m * n_m) if n_m <= sms else n_tiles
    loads = [0.0] * g_old
    for t in range(n_tiles):
        p = t % n_m
        if (t // g_old) % 2 == 0:
            p = n_m - 1 - p
        loads[t % g_old] += cost[p]
    old = max(loads)
    by_len = sorted(range(n_m), key=lambda p: -cost[p])
    best = None
    for g in _order_groups(n_m, grid, max(1, min(n_bh, ORDER_L2_BYTES // max(1, head_bytes))), n_tiles):
        heap = [(0.0, c) for c in range(grid)]
        runs = [[] for _ in range(grid)]
        for g0 in range(0, n_bh, g):
            for p in by_len:
                for hb in range(g0, min(n_bh, g0 + g)):
                    load, c = heap[0]
                    runs[c].append(hb * n_m + p)
                    heapq.heapreplace(heap, (load + cost[p], c))
        span = max(load for load, _ in heap)
        if best is None or span < best[0]:
            best = (span, runs)
    if not force and best[0] > old * (1.0 - ORDER_MIN_GAIN):
        return None
    starts, tiles = [0], []
    for run in best[1]:
        tiles += run
        starts.append(len(tiles))
    return grid, starts + tiles


_ORDER_TABLES: dict = {}


def _order_table(table: list, device) -> torch.Tensor:
    """``table`` as an int32 tensor on ``device``, one per distinct table and device, kept for the process: a
    CUDA graph that captured a launch reads it at every replay, whatever becomes of the plan that made it
    (``_FWD_PLANS`` starts over when full). A table is at most ``ORDER_MAX_TILES`` + SMs + 1 ints."""
    key = (tuple(table), str(device))
    t = _ORDER_TABLES.get(key)
    if t is None:
        t = _ORDER_TABLES[key] = torch.tensor(table, dtype=torch.int32).to(device)
    return t


class _FwdPlan:
    """What ``attention_fwd_sm90`` works out from the shapes, strides, dtype, device and flags of a call,
    kept per such key (``_FWD_PLANS``) so that a repeated call only allocates, makes its descriptors and
    launches: the host path is what limits eager calls at BERT sizes (run131: 289 us of host time for a
    74 us kernel). Everything here is a function of the key; what is not (the tensors' addresses) is
    checked on every call (``__call__``)."""

    __slots__ = ("o_shape", "o_stride", "o_layout_ok", "lse_shape", "geo", "grid", "args", "kwargs", "kernel",
                 "key_pad", "dtype", "order_spec", "order", "order_kwargs")

    def __init__(self, q, k, v, causal, scale, config, host_descriptors, persistent, key_pad):
        """``config`` (BLOCK_M, BLOCK_N, STAGES), resolved by ``forward_plan``."""
        batch, hq, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        bm, bn, stages = config
        self.dtype = q.dtype
        # o laid out like q (``empty_like_layout``) where TMA takes that layout, else contiguous; the strides
        # from a meta tensor (no allocation)
        like = torch.empty_like(q, memory_format=torch.preserve_format, device="meta").stride()
        self.o_layout_ok = _tma_strides_ok(like)
        self.o_shape, self.o_stride = tuple(q.shape), like if self.o_layout_ok else None
        self.lse_shape = (batch, hq, sq)
        tile_d = TILE_D.get(d, d)  # (D = 192 on 256-wide tiles, 80 and 96 on 128-wide ones)
        ql, kl = smem_layouts(bm, bn, tile_d, q.dtype)
        o_strides = like if self.o_layout_ok else (hq * sq * d, sq * d, d, 1)
        # (rows, row stride) of the four flat descriptors, or None: device-made descriptors
        geo = None
        if host_descriptors:
            geo = tuple(_flat_geometry(shape, strides, rows, zero_fill=tile_d != d)
                        for shape, strides, rows in ((q.shape, q.stride(), bm), (k.shape, k.stride(), bn),
                                                     (v.shape, v.stride(), bn), (q.shape, o_strides, bm)))
            if any(g is None for g in geo):
                geo = None
            else:
                geo = tuple(_descriptor_fields(g, rows, d, lay, tile_d)
                            for g, rows, lay in zip(geo, (bm, bn, bn, bm), (ql, kl, kl, ql)))
        self.geo = geo
        n_m = _tuning.cdiv(sq, 2 * bm)
        n_tiles = n_m * hq * batch
        # host descriptors: a persistent grid (one CTA per SM walks the tiles; the next tile's Q and K/V loads
        # overlap the current epilogue). Causal: the grid is a multiple of the tiles per head (n_m), so that
        # alternate rounds reverse a head's order and each CTA alternates long and short tiles (a plain
        # round robin gave each CTA tiles of one length: run32, 0.69-0.95x of one tile per CTA); one tile per
        # CTA, longest first, where n_m exceeds the SMs. Device-made descriptors: one tile per CTA.
        sms = _num_sms(q.device)
        grid = n_tiles
        if geo is not None and persistent is not False:
            grid = min(n_tiles, sms if not causal else (sms // n_m * n_m if n_m <= sms else n_tiles))
        self.grid = (grid,)
        self.key_pad = key_pad
        # the launch's arguments after q, k, v, o, lse, the four descriptors (strides: lse contiguous)
        self.args = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o_strides[:3], hq * sq, sq,
                     hq, hq // hkv, sq, sk, scale * LOG2E, n_m, n_tiles)
        self.kwargs = dict(HEAD_D=tile_d, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, IS_CAUSAL=bool(causal),
                           HOST_DESC=geo is not None, KEY_PAD=key_pad, VARLEN=False, ORDER=False, q_layout=ql,
                           kv_layout=kl, num_warps=4, maxnreg=MAX_REGS, Q_BUFS=q_bufs(bm, bn, stages, tile_d),
                           D_COLS=d if tile_d != d else 0)
        if SPLIT_D and d in SPLIT:
            self.kwargs.update(D_A=SPLIT[d][0], D_B=SPLIT[d][1])
        self.kernel = _launch.fast(_attention_fwd_sm90_kernel)
        # causal on the persistent grid: the tile table where it is modelled faster (``_causal_order``); made
        # here, uploaded on the first call that is not capturing a CUDA graph (the rounds serve until then)
        self.order_spec = self.order = None
        self.order_kwargs = dict(self.kwargs, ORDER=True)
        mode = order_mode() if causal else "0"
        if mode != "0" and geo is not None and persistent is not False and not key_pad and n_m <= sms \
                and n_tiles <= ORDER_MAX_TILES:
            head_bytes = 2 * sk * d * q.element_size() // (hq // hkv)
            self.order_spec = _causal_order(n_m, hq * batch, sk, 2 * bm, bn, sms, head_bytes, force=mode == "1")

    def __call__(self, q, k, v, mask=None, kv_range=None):
        dev = q.device
        if self.o_layout_ok:
            o = empty_strided(self.o_shape, self.o_stride, dtype=self.dtype, device=dev)
        else:
            o = empty(*self.o_shape, dtype=self.dtype, device=dev)
        if o.data_ptr() & 15:  # (never with torch's caching allocator: its blocks are 512-byte aligned)
            raise RuntimeError("pykernels: the attention output's allocation is not 16-byte aligned, which the "
                               "sm_90 kernel's TMA stores need (a custom CUDA allocator?)")
        lse = empty(*self.lse_shape, dtype=torch.float32, device=dev)
        descs = (None,) * 4
        if self.geo is not None:
            gq, gk, gv, go = self.geo
            descs = (_descriptor(q, gq), _descriptor(k, gk), _descriptor(v, gv), _descriptor(o, go))
        _tuning.ensure_allocator()  # device-made descriptors (with host ones: for a query tail tile's store)
        key_pad = self.key_pad
        grid, order, kwargs = self.grid, None, self.kwargs
        if self.order_spec is not None:
            order = self.order
            if order is None and not _tuning.capturing(dev):
                order = self.order = _order_table(self.order_spec[1], dev)
            if order is not None:
                grid, kwargs = (self.order_spec[0],), self.order_kwargs
        self.kernel[grid](
            q, k, v, o, lse, *descs, *self.args,
            mask.view(torch.uint8) if key_pad else None, kv_range if key_pad else None,
            mask.stride(0) if key_pad else 0, mask.stride(3) if key_pad else 0, None, None, order, **kwargs)
        return o, lse


_FWD_PLANS: dict = {}
_MAX_PLANS = 1024  # the cache starts over when full (bounded whatever the callers vary)


def forward_plan(q, k, v, *, causal: bool, scale: float, config=None, host_descriptors: bool = True,
                 persistent: bool | None = None, key_pad: bool = False) -> _FwdPlan:
    """The cached ``_FwdPlan`` of a call with these tensors' shapes, strides, dtype and device and these flags."""
    d = q.shape[3]
    config = config or (KEY_PAD_CONFIGS.get(d, CONFIGS[d]) if key_pad else CONFIGS[d])  # (read per call: tools
    # and tests change these tables)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, bool(causal),
           scale, config, host_descriptors, persistent, key_pad, MAX_REGS, order_mode() if causal else None, SPLIT_D)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        if len(_FWD_PLANS) >= _MAX_PLANS:
            _FWD_PLANS.clear()
        plan = _FWD_PLANS[key] = _FwdPlan(q, k, v, causal, scale, config, host_descriptors, persistent, key_pad)
    return plan


def attention_fwd_sm90(q, k, v, *, causal: bool, scale: float, config=None, host_descriptors: bool = True,
                       persistent: bool | None = None, mask=None, kv_range=None):
    """q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), covered per ``unsupported``. Returns o (laid out like q when
    TMA allows) and lse (B, Hq, Sq) fp32, as ``attention.attention_fwd`` does. ``host_descriptors``: take
    the host-descriptor variant where the layouts allow it (False: always make them on the device).
    ``persistent`` False: one tile per CTA even where the persistent grid would be taken. ``mask``: a
    boolean key-padding mask, a (B, H, Sq, Sk) view with strides 0 over heads and rows, with ``kv_range``
    (int32 (B, 3), ``pykernels.attention._key_padding_range``)."""
    plan = forward_plan(q, k, v, causal=causal, scale=scale, config=config, host_descriptors=host_descriptors,
                        persistent=persistent, key_pad=mask is not None)
    return plan(q, k, v, mask, kv_range)


def _packed_4d(t: torch.Tensor) -> torch.Tensor:
    """A packed (T, H, D) tensor as the (1, H, T, D) view the kernel's descriptors take."""
    return t.unsqueeze(0).transpose(1, 2)


def varlen_unsupported(q, k, v, *, dropout_p: float, scale: float, causal: bool) -> str | None:
    """None when the varlen forward (``attention_fwd_sm90_varlen``) covers packed (T, H, D) q, k, v, else
    why not: the dense rule (``unsupported``) on their (1, H, T, D) views, and every tensor seen through
    one host descriptor (at least a tile of rows, 16-byte aligned). Causal or not."""
    q4, k4, v4 = (_packed_4d(t) for t in (q, k, v))
    why = unsupported(q4, k4, v4, None, dropout_p=dropout_p, scale=scale, varlen=False)
    if why is not None:
        return why
    bm, bn, _ = CONFIGS[q.shape[-1]]
    ql, kl = smem_layouts(bm, bn, q.shape[-1], q.dtype)
    if _flat_descriptor(q4, bm, ql) is None or any(_flat_descriptor(t, bn, kl) is None for t in (k4, v4)):
        return "a packed tensor with fewer rows than a tile or strides one descriptor cannot take"
    return None


def attention_fwd_sm90_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                              scale: float, causal: bool = False):
    """The varlen forward on packed q (Tq, Hq, D), k / v (Tk, Hkv, D) covered per ``varlen_unsupported``:
    o (Tq, Hq, D) and lse (Hq, Tq) fp32 as ``attention.attention_fwd`` returns them for varlen (lse -inf and
    o unwritten on rows no sequence covers: the caller zeroes those o rows, as for the Triton kernel). A
    persistent grid over (sequence, head, tile of 2 * BLOCK_M rows) tiles, n_m per (sequence, head) from
    ``max_seqlen_q``; a sequence's tiles past its length are skipped, its tail tile stored through a
    descriptor made on the device that clips at the sequence's end, and its keys past the end (the next
    sequence's rows) are masked as a key tail. Causal: top-left aligned within each sequence (as the Triton
    varlen kernel); the grid's rounds alternate each head's tile order as in the dense kernel."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    batch = cu_seqlens_q.numel() - 1
    bm, bn, stages = CONFIGS[d]
    o = empty(tq, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
    n_m = _tuning.cdiv(max_seqlen_q, 2 * bm)
    n_tiles = n_m * hq * batch
    if n_tiles == 0:
        return o.zero_(), lse
    q4, k4, v4, o4 = (_packed_4d(t) for t in (q, k, v, o))
    ql, kl = smem_layouts(bm, bn, d, q.dtype)
    descs = (_flat_descriptor(q4, bm, ql), _flat_descriptor(k4, bn, kl), _flat_descriptor(v4, bn, kl),
             _flat_descriptor(o4, bm, ql))
    if any(x is None for x in descs):
        raise ValueError("attention_fwd_sm90_varlen: the tensors do not meet varlen_unsupported's rule")
    _tuning.ensure_allocator()  # a sequence's tail tile is stored through a descriptor made on the device
    sms = _num_sms(q.device)
    # causal: as in the dense kernel, a multiple of the tiles per (sequence, head), so that each one's tiles
    # lie in one round of the grid (``_tile_coords`` reverses their order in alternate rounds)
    grid = min(n_tiles, sms if not causal else (sms // n_m * n_m if n_m <= sms else n_tiles))
    strides = lambda t: (0, t.stride(1), t.stride(0))  # noqa: E731  (sequence, head, token)
    _launch.fast(_attention_fwd_sm90_kernel)[(grid,)](
        q, k, v, o, lse, *descs, *strides(q), *strides(k), *strides(v), *strides(o), 0, lse.stride(0),
        hq, hq // hkv, max_seqlen_q, max_seqlen_k, scale * LOG2E, n_m, n_tiles, None, None, 0, 0,
        cu_seqlens_q, cu_seqlens_k, None,
        HEAD_D=d, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, IS_CAUSAL=bool(causal), HOST_DESC=True, KEY_PAD=False,
        VARLEN=True, ORDER=False, q_layout=ql, kv_layout=kl, num_warps=4, maxnreg=MAX_REGS,
        Q_BUFS=q_bufs(bm, bn, stages, d))
    return o, lse
