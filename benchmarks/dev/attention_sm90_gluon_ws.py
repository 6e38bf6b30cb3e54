"""Experiment (not used by the package; NOT YET RUN ON A GPU): the sm_90 Gluon attention forward of
``attention_sm90_gluon.py`` with warp specialisation, the piece that experiment lacked.

Written 2026-11-26 after the GPU budget of that session was spent: it compiles for sm_90 on a CPU machine
(``python benchmarks/dev/attention_sm90_gluon_ws.py --compile-only``, Triton's own ptxas; registers and
shared memory printed per config), and nothing more is known. The next GPU session runs
``python benchmarks/dev/attention_sm90_gluon_ws.py`` (the correctness sweep of the non-specialised
experiment over this kernel, then TFLOP/s next to it, the Triton forward and cuDNN).

Two kernels. ``_attention_fwd_sm90_ws_kernel`` changes against ``attention_sm90_gluon.py``
(FlashAttention-3's producer/consumer split, Shah et al. 2024, section 3.1):
* a 1-warp **load partition** (``gl.warp_specialize`` worker, 24 registers) issues every TMA load: Q once,
  then K and V block by block into a STAGES-deep ring, each stage waiting on its ``empty`` mbarrier;
* the **compute partition** (the default one, ``num_warps`` warps, the registers the loader gives up)
  runs the same intra-warpgroup overlap as before (the next QK^T in flight during the softmax), and
  releases a stage by arriving on its ``empty`` mbarrier once the P V wgmma that read it has completed,
  instead of a CTA-wide barrier and a refill issued by its own threads.
The epilogue (O / l through Q's buffer by TMA, lse by pointer) is the compute partition's.
``_attention_fwd_sm90_pp_kernel`` adds the ping-pong (section 3.2): a CTA takes 2 x 64 query rows, two
consumer warpgroups (the default partition and a 4-warp worker, 240 registers each) share one K/V ring,
and the right to issue tensor-core work alternates between them through two "turn" mbarriers, so that
one warpgroup's softmax overlaps the other's GEMMs. Each K/V stage is released after both arrived.
Both compile for sm_90 with Triton's ptxas and no spills (``--compile-only``); the worker's partition
barriers are named barriers of their own (``bar.sync 3, 128`` against the default partition's 0).
Usage on the GPU: ``python benchmarks/dev/attention_sm90_gluon_ws.py [--kernel ws,pp] [--quick]``.

Scope as ``attention_sm90_gluon.applies``: sm_90, fp16/bf16, D 64 or 128, no mask/dropout/varlen.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

_spec = importlib.util.spec_from_file_location(
    "attention_sm90_gluon", os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_sm90_gluon.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)
_mask_scores, _needs_mask, _softmax_step = base._mask_scores, base._needs_mask, base._softmax_step


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty,
                    start_m, n_blocks, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """The producer warp: Q, then K and V of every block, each stage once the consumers released it."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [start_m, 0], q_bar, q_smem)
    _fill_kv_ring(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, n_blocks, STAGES, BLOCK_N)


@gluon.jit
def _fill_kv_ring(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, n_blocks, STAGES: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """K and V of every block into the STAGES-deep ring, a stage once its consumers released it. K runs
    one block ahead of V (issue order K0, K1, V0, K2, V1, ...), and K and V stages are released apart
    (K once its QK^T completed, V once its P V did), so the next QK^T's operand is never queued behind
    the V that the current P V still reads."""
    mbarrier.wait(k_empty.index(0), 1)  # mbarriers start with phase 1 complete: the first round does not wait
    mbarrier.expect(k_bar.index(0), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [0, 0], k_bar.index(0), k_smem.index(0))
    for blk in range(n_blocks):
        nxt = blk + 1
        if nxt < n_blocks:
            ns = nxt % STAGES
            mbarrier.wait(k_empty.index(ns), ((nxt // STAGES) & 1) ^ 1)
            mbarrier.expect(k_bar.index(ns), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [nxt * BLOCK_N, 0], k_bar.index(ns), k_smem.index(ns))
        slot = blk % STAGES
        mbarrier.wait(v_empty.index(slot), ((blk // STAGES) & 1) ^ 1)
        mbarrier.expect(v_bar.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [blk * BLOCK_N, 0], v_bar.index(slot), v_smem.index(slot))


@gluon.jit
def _consume(q_tile, k_smem, v_smem, q_ready, k_bar, v_bar, k_empty, v_empty, turn_bar, WG: gl.constexpr, O, LSE, o_off,
             l_off, stride_om, Sq, Sk, qk_scale, my_m, n_blocks, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, q_layout: gl.constexpr,
             NW: gl.constexpr, TURNS: gl.constexpr):
    """A consumer's whole work on its BLOCK_M query rows (from ``my_m``; Q in ``q_tile``): the blocks' QK^T
    and P V on asynchronous wgmma, the next QK^T in flight during the softmax; each K/V stage released
    through ``k_empty`` once its QK^T completed and ``v_empty`` once the P V that read it completed; then O / l by TMA through ``q_tile`` and
    lse. NW warps. TURNS (ping-pong): tensor-core work is issued only on this warpgroup's turn
    (``turn_bar[WG]``), which passes to the other warpgroup right after the issue."""
    dtype: gl.constexpr = q_tile.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)

    mbarrier.wait(q_ready, 0)
    mbarrier.wait(k_bar.index(0), 0)
    if TURNS:  # turn t completes phase t of turn_bar[WG] (warpgroup 0's phase 0 at init)
        mbarrier.wait(turn_bar.index(WG), 0)
    s = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if TURNS:
        mbarrier.arrive(turn_bar.index(1 - WG), count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    if _needs_mask(0, my_m, Sk, BLOCK_N, IS_CAUSAL):
        s = _mask_scores(s, 0, my_m, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, s_layout)
    m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i, qk_scale)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_blocks):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_bar.index(slot), (j // STAGES) & 1)
        mbarrier.wait(v_bar.index(prev), ((j - 1) // STAGES) & 1)
        if TURNS:
            mbarrier.wait(turn_bar.index(WG), j & 1)
        s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        if TURNS:
            mbarrier.arrive(turn_bar.index(1 - WG), count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        mbarrier.arrive(k_empty.index(slot), count=1)  # S_j done (groups complete in order); P V may run
        if _needs_mask(j, my_m, Sk, BLOCK_N, IS_CAUSAL):
            s = _mask_scores(s, j, my_m, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, s_layout)
        m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i, qk_scale)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        # V of block j - 1 is no longer read
        fence_async_shared()
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)

    last = n_blocks - 1
    mbarrier.wait(v_bar.index(last % STAGES), (last // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(last % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    l_o = gl.convert_layout(l_i, row_o)
    out = acc / gl.expand_dims(l_o, 1)
    rows = my_m + gl.arange(0, BLOCK_M, layout=row_s)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + l_off + rows, lse, mask=rows < Sq)
    # every QK^T is complete, so Q's buffer stages O for the TMA store (which clips rows >= Sq)
    o_desc = tma.make_tensor_descriptor(O + o_off, [Sq, HEAD_D], [stride_om, 1], [BLOCK_M, HEAD_D], q_layout)
    q_tile.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [my_m, 0], q_tile)
    tma.store_wait(pendings=0)


@gluon.jit
def _compute_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty,
                       start_m, n_blocks, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                       O, LSE, o_off, l_off, stride_om, Sq, Sk, qk_scale,
                       HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, IS_CAUSAL: gl.constexpr,
                       q_layout: gl.constexpr, num_warps: gl.constexpr):
    _consume(q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty, k_empty, 0, O, LSE, o_off, l_off,
             stride_om, Sq, Sk, qk_scale, start_m, n_blocks, HEAD_D, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL,
             q_layout, num_warps, False)


@gluon.jit
def _head_descriptors(Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                      stride_vn, GROUP, Sq, Sk, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      q_layout: gl.constexpr, kv_layout: gl.constexpr):
    """The program's (batch, head) slices of Q, K and V as device-built tensor descriptors (grid axes 1 and
    2: head, batch; GQA by head index), and the batch and head indices (int64)."""
    h = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    hk = (h // GROUP).to(gl.int64)
    h64 = h.to(gl.int64)
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h64 * stride_qh, [Sq, HEAD_D], [stride_qm, 1],
                                        [BLOCK_M, HEAD_D], q_layout)
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + hk * stride_kh, [Sk, HEAD_D], [stride_kn, 1],
                                        [BLOCK_N, HEAD_D], kv_layout)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + hk * stride_vh, [Sk, HEAD_D], [stride_vn, 1],
                                        [BLOCK_N, HEAD_D], kv_layout)
    return q_desc, k_desc, v_desc, b, h64


@gluon.jit
def _attention_fwd_sm90_ws_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    GROUP, Sq, Sk, qk_scale,
    HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, q_layout: gl.constexpr, kv_layout: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = Q.dtype.element_ty
    start_m = gl.program_id(0) * BLOCK_M
    q_desc, k_desc, v_desc, b, h64 = _head_descriptors(
        Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        GROUP, Sq, Sk, HEAD_D, BLOCK_M, BLOCK_N, q_layout, kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)

    if IS_CAUSAL:
        hi = gl.minimum(Sk, start_m + BLOCK_M)
    else:
        hi = Sk
    n_blocks = gl.cdiv(hi, BLOCK_N)

    o_off = b * stride_ob + h64 * stride_oh
    l_off = b * stride_lb + h64 * stride_lh
    gl.warp_specialize([
        (_compute_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty,
                              start_m, n_blocks, STAGES, BLOCK_N, O, LSE, o_off, l_off, stride_om, Sq, Sk, qk_scale,
                              HEAD_D, BLOCK_M, IS_CAUSAL, q_layout, num_warps)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty,
                           start_m, n_blocks, STAGES, BLOCK_N)),
    ], [1], [24])


@gluon.jit
def _pp_consumer0(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty, turn_bar, O, LSE,
                  o_off, l_off, stride_om, Sq, Sk, qk_scale, start_m, n_blocks, HEAD_D: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  q_layout: gl.constexpr):
    _consume(q_smem.index(0), k_smem, v_smem, q_bar.index(0), k_bar, v_bar, k_empty, v_empty, turn_bar, 0, O, LSE, o_off,
             l_off, stride_om, Sq, Sk, qk_scale, start_m, n_blocks, HEAD_D, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL,
             q_layout, 4, True)


@gluon.jit
def _pp_consumer1(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty, turn_bar, O, LSE,
                  o_off, l_off, stride_om, Sq, Sk, qk_scale, start_m, n_blocks, HEAD_D: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  q_layout: gl.constexpr):
    _consume(q_smem.index(1), k_smem, v_smem, q_bar.index(1), k_bar, v_bar, k_empty, v_empty, turn_bar, 1, O, LSE, o_off,
             l_off, stride_om, Sq, Sk, qk_scale, start_m + BLOCK_M, n_blocks, HEAD_D, BLOCK_M, BLOCK_N, STAGES,
             IS_CAUSAL, q_layout, 4, True)


@gluon.jit
def _pp_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty, turn_bar, O, LSE,
               o_off, l_off, stride_om, Sq, Sk, qk_scale, start_m, n_blocks, HEAD_D: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
               q_layout: gl.constexpr):
    """The producer warp: both warpgroups' Q tiles, then K and V block by block into the ring; a stage is
    refilled once both warpgroups released it (its empty barrier counts 2 arrivals)."""
    for wg in gl.static_range(2):
        mbarrier.expect(q_bar.index(wg), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [start_m + wg * BLOCK_M, 0], q_bar.index(wg), q_smem.index(wg))
    _fill_kv_ring(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, n_blocks, STAGES, BLOCK_N)


@gluon.jit
def _attention_fwd_sm90_pp_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    GROUP, Sq, Sk, qk_scale,
    HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, q_layout: gl.constexpr, kv_layout: gl.constexpr, num_warps: gl.constexpr,
):
    """Ping-pong: a CTA takes 2 * BLOCK_M query rows; two consumer warpgroups (the default partition and
    a 4-warp worker, BLOCK_M rows each) share one K/V ring filled by a 1-warp producer. num_warps = 4."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = Q.dtype.element_ty
    start_m = gl.program_id(0) * (2 * BLOCK_M)
    q_desc, k_desc, v_desc, b, h64 = _head_descriptors(
        Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        GROUP, Sq, Sk, HEAD_D, BLOCK_M, BLOCK_N, q_layout, kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.arrive(turn_bar.index(0), count=1)  # warpgroup 0 has the first turn (phase 0 complete)

    # the CTA's causal extent is its last warpgroup's; a warpgroup past the diagonal masks what it must
    if IS_CAUSAL:
        hi = gl.minimum(Sk, start_m + 2 * BLOCK_M)
    else:
        hi = Sk
    n_blocks = gl.cdiv(hi, BLOCK_N)
    o_off = b * stride_ob + h64 * stride_oh
    l_off = b * stride_lb + h64 * stride_lh
    gl.warp_specialize([
        (_pp_consumer0, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty, turn_bar,
                         O, LSE, o_off, l_off, stride_om, Sq, Sk, qk_scale, start_m, n_blocks, HEAD_D, BLOCK_M,
                         BLOCK_N, STAGES, IS_CAUSAL, q_layout)),
        (_pp_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty, turn_bar,
                      O, LSE, o_off, l_off, stride_om, Sq, Sk, qk_scale, start_m, n_blocks, HEAD_D, BLOCK_M,
                      BLOCK_N, STAGES, IS_CAUSAL, q_layout)),
        (_pp_consumer1, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty, turn_bar,
                         O, LSE, o_off, l_off, stride_om, Sq, Sk, qk_scale, start_m, n_blocks, HEAD_D, BLOCK_M,
                         BLOCK_N, STAGES, IS_CAUSAL, q_layout)),
    ], [1, 4], [24, 240])


# ping-pong: (BLOCK_M per warpgroup, BLOCK_N, STAGES); a CTA takes 2 * BLOCK_M rows
PP_CONFIGS = {64: [(64, 128, 2), (64, 128, 3), (64, 64, 4)], 128: [(64, 128, 2), (64, 128, 3), (64, 64, 3)]}


CONFIGS = base.CONFIGS
WARPS_TOTAL_REGS = 65536


def _run(kernel, q, k, v, causal, scale, bm, bn, stages, rows_per_cta, warps, regs):
    """Allocate o (laid out like q where TMA allows) and lse, and launch ``kernel`` over (query tiles of
    ``rows_per_cta`` rows, heads, batch)."""
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    o = base.empty_like_layout(q)
    if any(s % 8 for s in o.stride()[:3]):
        o = base.empty(batch, hq, sq, d, dtype=q.dtype, device=q.device)
    lse = base.empty(batch, hq, sq, dtype=torch.float32, device=q.device)
    base._tuning.ensure_allocator()
    ql, kl = base.smem_layouts(bm, bn, d, q.dtype)
    kernel[(base._tuning.cdiv(sq, rows_per_cta), hq, batch)](
        q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
        hq // hkv, sq, sk, scale * base.LOG2E,
        HEAD_D=d, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, IS_CAUSAL=bool(causal), q_layout=ql, kv_layout=kl,
        num_warps=warps, maxnreg=regs)
    return o, lse


def attention_fwd_sm90_ws(q, k, v, *, causal: bool, scale: float, config=None):
    """Same contract as ``attention_sm90_gluon.attention_fwd_sm90``."""
    bm, bn, stages, warps = config or CONFIGS[q.shape[-1]][0]
    return _run(_attention_fwd_sm90_ws_kernel, q, k, v, causal, scale, bm, bn, stages, bm, warps, max_regs(warps))


def attention_fwd_sm90_pp(q, k, v, *, causal: bool, scale: float, config=None):
    """The ping-pong kernel; same contract as ``attention_fwd_sm90_ws``. ``config`` = (BLOCK_M per warpgroup,
    BLOCK_N, STAGES), or a 4-tuple of the other experiments (its BLOCK_N and STAGES, 64 rows a warpgroup)."""
    cfg = config or PP_CONFIGS[q.shape[-1]][0]
    bm, bn, stages = (64, cfg[1], cfg[2]) if len(cfg) == 4 else cfg  # wgmma: 64 rows per warpgroup
    return _run(_attention_fwd_sm90_pp_kernel, q, k, v, causal, scale, bm, bn, stages, 2 * bm, 4, max_regs(8))


def max_regs(warps: int) -> int:
    """The launch's register cap: the compute warps plus one warpgroup for the loader share the SM's
    64K registers (one CTA per SM), in multiples of 8; the loader gives its share back (24 registers)."""
    return WARPS_TOTAL_REGS // ((warps + 4) * 32) // 8 * 8


def _ptxas_report(ptx: str) -> str:
    """Registers and spills of the kernel as Triton's own ptxas reports them for sm_90a."""
    import re
    import subprocess
    import tempfile

    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    out = res.stdout + res.stderr
    regs = re.findall(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill stores", out)
    return f"ptxas: {regs[0] if regs else '?'} registers, {spills[0] if spills else '?'} bytes spilled"


def compile_report(fn, sig: dict, consts: dict, opts: dict) -> str:
    """Compile a Gluon kernel for sm_90 without a GPU (Triton's own ptxas) and say what came out: "compiled;"
    with shared memory, the setmaxnreg values, whether a wgmma group stays in flight, registers and spills,
    or "ERROR ..." (reported, not raised: this is a probe)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    try:
        kern = triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=opts)
    except Exception as e:  # noqa: BLE001
        return f"ERROR {type(e).__name__}: {str(e)[:400]}"
    ptx = kern.asm["ptx"]
    regs = sorted(set(ln.split()[-1] for ln in ptx.splitlines() if "setmaxnreg" in ln))
    return (f"compiled; shared {kern.metadata.shared} B, setmaxnreg {regs}, "
            f"wgmma.wait_group 1: {'wgmma.wait_group.sync.aligned 1' in ptx}; {_ptxas_report(ptx)}")


def compile_only() -> None:
    """Compile every config for sm_90 without a GPU (Triton's ptxas) and print registers and shared memory."""
    runs = [(base._attention_fwd_sm90_kernel, "plain", d, cfg) for d, cfgs in CONFIGS.items() for cfg in cfgs[:1]]
    runs += [(_attention_fwd_sm90_ws_kernel, "ws", d, cfg) for d, cfgs in CONFIGS.items() for cfg in cfgs]
    runs += [(_attention_fwd_sm90_pp_kernel, "ping-pong", d, (cfg[0], cfg[1], cfg[2], 4))
             for d, cfgs in PP_CONFIGS.items() for cfg in cfgs]
    for fn, kind, d, cfg in runs:
            for causal in (False, True):
                bm, bn, stages, warps = cfg
                ql, kl = base.smem_layouts(bm, bn, d, torch.bfloat16)
                sig = {}
                for p in fn.params:
                    n = p.name
                    sig[n] = ("*bf16" if n in "QKVO" else "*fp32" if n == "LSE" else "i64" if n.startswith("stride")
                              else "i32" if n in ("GROUP", "Sq", "Sk") else "fp32" if n == "qk_scale" else "constexpr")
                consts = dict(HEAD_D=d, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, IS_CAUSAL=causal, q_layout=ql,
                              kv_layout=kl, num_warps=warps)
                opts = dict(num_warps=warps)
                if kind != "plain":
                    opts["maxnreg"] = max_regs(8 if kind == "ping-pong" else warps)
                print(f"{kind} D{d} cfg{cfg} {'causal' if causal else 'full'}: {compile_report(fn, sig, consts, opts)}")


def main() -> None:
    if "--compile-only" in sys.argv:
        compile_only()
        return
    # The non-specialised experiment's correctness sweep and benchmark, with its kernel swapped for these
    # (``--kernel ws``, ``pp`` or both); then the non-specialised kernel again in the same run.
    kinds = {"ws": attention_fwd_sm90_ws, "pp": attention_fwd_sm90_pp}
    chosen = sys.argv[sys.argv.index("--kernel") + 1].split(",") if "--kernel" in sys.argv else list(kinds)
    plain = base.attention_fwd_sm90
    plain_configs = base.CONFIGS
    for kind in chosen:
        print(f"== {kind} kernel (correctness sweep, then TFLOP/s with Triton, cuDNN and flash)")
        base.attention_fwd_sm90 = kinds[kind]
        base.CONFIGS = PP_CONFIGS if kind == "pp" else plain_configs
        base.main()
    base.CONFIGS = plain_configs
    if "--plain" not in sys.argv:
        return
    print("== the non-specialised kernel, same shapes")
    from triton.testing import do_bench
    for b, h, s_, d, causal in [(32, 12, 512, 64, False), (2, 16, 8192, 128, False), (2, 16, 8192, 128, True)]:
        q, k, v = (torch.randn(b, h, s_, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * s_ * s_ * d / (2 if causal else 1)
        for cfg in CONFIGS[d]:
            ms = do_bench(lambda cfg=cfg: plain(q, k, v, causal=causal, scale=d ** -0.5, config=cfg), warmup=50, rep=200)
            print(f"B{b} H{h} S{s_} D{d} {'causal' if causal else 'full':<6} plain gluon {cfg} {ms:8.3f} "
                  f"{flops / ms / 1e9:8.1f}", flush=True)


if __name__ == "__main__":
    main()
