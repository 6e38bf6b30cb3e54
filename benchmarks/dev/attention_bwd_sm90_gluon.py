"""Experiment (not used by the package; NOT YET RUN ON A GPU): the attention backward's dK/dV kernel for
Hopper (sm_90) in Gluon, with the forward's structure (``kernels/attention_sm90.py``), aimed at the
D = 128 backward goal (>= 400 TFLOP/s; the Triton backward reaches 288-318 on the causal shapes, 393 at
S = 8192 bidirectional, cuDNN 437-502; H100 run36).

Written 2026-11-26 after that session's GPU budget was spent: it compiles for sm_90 on a CPU machine
(``--compile-only``, Triton's ptxas; ``tests/test_gluon_sm90_compile.py`` checks it), nothing more.

Why it can hold dK and dV in registers at D = 128. Gluon's PTX carries ``.maxnreg 168`` and ptxas
reports "168 registers" for a 12-warp warp-specialised kernel, which looked like a cap on every
partition. The SASS says otherwise: after ``USETMAXREG.TRY_ALLOC 240`` the consumer code uses registers
up to R237 (the forward's D = 128 kernel; 21 spill instructions in all, scalars of the prologue and the
tile loop). So a consumer warpgroup has ~240 registers: dK and dV (64 keys x 128 fp32 each: 128
registers a thread) plus S^T, dP^T (64 x 64 fp32: 32 each) and P^T, dS^T in bf16 (16 each) fit.

One CTA = 128 keys of one (batch, kv head): two consumer warpgroups of 64 keys each and a 1-warp TMA
producer. The producer loads each warpgroup's K and V once, then Q_j and dO_j (BLOCK_M query rows,
one stage of a STAGES-deep ring per block, both warpgroups release a stage) for every query head of the
GQA group and every query block the keys can see. Per block, in each consumer (transposed tiles, so
that no operand needs a register transpose; FlashAttention-2/3's dK/dV loop):

    S^T = K Q_j^T, dP^T = V dO_j^T         (async wgmma, both in flight)
    wait S^T: P^T = exp2(S^T * scale * log2 e - lse_j * log2 e)    (0 above the causal diagonal)
    dV += P^T dO_j                          (async; P^T from registers)
    wait dP^T: dS^T = P^T (dP^T - delta_j)
    dK += dS^T Q_j                          (async; dS^T from registers)
    wait both; release the stage

and at the end dK *= scale, then dK and dV through the K and V buffers by TMA (the store clips keys
>= Sk). lse comes from the forward (natural log, +inf past Sq so P = 0 there), delta = rowsum(dO * O)
from the Triton preprocess kernel (or torch here). dQ stays with the Triton dQ kernel.

Q and dO come through host descriptors over contiguous (B * H * S, D) views (query rows past Sq read
the next head's rows: P = 0 there through lse = +inf); K, V, dK, dV through descriptors of the kv head's
slice made on the device (once per CTA). Scope: sm_90, fp16/bf16, D 64 or 128, contiguous q/do, no
mask/dropout/varlen.

Usage (GPU): ``python benchmarks/dev/attention_bwd_sm90_gluon.py``: dK/dV against the Triton backward's,
then ms and TFLOP/s (dK/dV's 4 GEMMs) next to the Triton backward; ``--compile-only`` anywhere.
"""
from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from pykernels._kernels.attention_sm90 import _slice_desc

LOG2E = 1.4426950408889634
# (keys per warpgroup, BLOCK_M queries, STAGES); the first is the default. At D = 128 with 64-query blocks
# ptxas spills 92-116 bytes (dK, dV, S^T, dP^T near the 240 registers); 32-query blocks halve S^T and dP^T.
CONFIGS = {64: [(64, 64, 2)], 128: [(64, 32, 3), (64, 64, 2)]}
MAX_REGS = 65536 // (12 * 32) // 8 * 8


@gluon.jit
def _bwd_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_bar, q_empty,
                  LSE, DELTA, dk_desc, dv_desc, H, GROUP, Sq, Sk, qk_scale, scale, b, hk, start_n, j_lo, n_qb,
                  HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                  IS_CAUSAL: gl.constexpr):
    for wg in gl.static_range(2):
        mbarrier.expect(kv_bar.index(wg), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [start_n + wg * BLOCK_N, 0], kv_bar.index(wg), k_smem.index(wg))
        tma.async_copy_global_to_shared(v_desc, [start_n + wg * BLOCK_N, 0], kv_bar.index(wg), v_smem.index(wg))
    it = 0
    for g in range(GROUP):
        row0 = (b * H + hk * GROUP + g) * Sq
        for j in range(j_lo, n_qb):
            s = it % STAGES
            mbarrier.wait(q_empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(q_bar.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [row0 + j * BLOCK_M, 0], q_bar.index(s), q_smem.index(s))
            tma.async_copy_global_to_shared(do_desc, [row0 + j * BLOCK_M, 0], q_bar.index(s), do_smem.index(s))
            it += 1


@gluon.jit
def _bwd_consumer(WG: gl.constexpr, q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_bar,
                  q_empty, LSE, DELTA, dk_desc, dv_desc, H, GROUP, Sq, Sk, qk_scale, scale, b, hk, start_n, j_lo, n_qb,
                  HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                  IS_CAUSAL: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    n0 = start_n + WG * BLOCK_N
    k_tile = k_smem.index(WG)
    v_tile = v_smem.index(WG)
    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, acc_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    keys = n0 + gl.arange(0, BLOCK_N, layout=row_s)
    mbarrier.wait(kv_bar.index(WG), 0)
    it = 0
    for g in range(GROUP):
        lrow = (b * H + hk * GROUP + g).to(gl.int64) * Sq
        for j in range(j_lo, n_qb):
            s = it % STAGES
            mbarrier.wait(q_bar.index(s), (it // STAGES) & 1)
            q_tile = q_smem.index(s)
            do_tile = do_smem.index(s)
            st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            cols = j * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s)
            lse2 = gl.load(LSE + lrow + cols, mask=cols < Sq, other=float("inf")) * 1.4426950408889634
            delta = gl.load(DELTA + lrow + cols, mask=cols < Sq, other=0.0)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
            pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
            if IS_CAUSAL:
                if j * BLOCK_M < n0 + BLOCK_N:  # the block reaches the diagonal: query i sees keys <= i
                    pt = gl.where(gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1), pt, 0.0)
            pt_op = gl.convert_layout(pt.to(dtype), a_layout)
            dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
            dst = pt * (dpt - gl.expand_dims(delta, 0))
            dst_op = gl.convert_layout(dst.to(dtype), a_layout)
            dk = warpgroup_mma(dst_op, q_tile, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            mbarrier.arrive(q_empty.index(s), count=1)
            it += 1
    # every wgmma that read this warpgroup's K and V is complete: their buffers stage dK and dV
    k_tile.store((dk * scale).to(dtype))
    v_tile.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [n0, 0], k_tile)
    tma.async_copy_shared_to_global(dv_desc, [n0, 0], v_tile)
    tma.store_wait(pendings=0)


@gluon.jit
def _attention_bwd_dkdv_sm90_kernel(q_desc, do_desc, K, V, DK, DV, LSE, DELTA,
                                    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                                    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                                    H, GROUP, Sq, Sk, qk_scale, scale,
                                    HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                                    STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, kv_layout: gl.constexpr,
                                    num_warps: gl.constexpr):
    """Grid (cdiv(Sk, 2 * BLOCK_N), kv heads, batch). LSE and DELTA: contiguous (B, H, Sq) fp32."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = K.dtype.element_ty
    start_n = gl.program_id(0) * (2 * BLOCK_N)
    hk = gl.program_id(1)
    b = gl.program_id(2)
    b64 = b.to(gl.int64)
    hk64 = hk.to(gl.int64)
    k_desc = _slice_desc(K, b64 * stride_kb + hk64 * stride_kh, Sk, stride_kn, HEAD_D, BLOCK_N, kv_layout)
    v_desc = _slice_desc(V, b64 * stride_vb + hk64 * stride_vh, Sk, stride_vn, HEAD_D, BLOCK_N, kv_layout)
    dk_desc = _slice_desc(DK, b64 * stride_dkb + hk64 * stride_dkh, Sk, stride_dkn, HEAD_D, BLOCK_N, kv_layout)
    dv_desc = _slice_desc(DV, b64 * stride_dvb + hk64 * stride_dvh, Sk, stride_dvn, HEAD_D, BLOCK_N, kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_D], kv_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    j_lo = 0
    if IS_CAUSAL:
        j_lo = start_n // BLOCK_M  # queries before the CTA's first key see none of its keys
    n_qb = gl.cdiv(Sq, BLOCK_M)
    gl.warp_specialize([
        (_bwd_consumer, (0, q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_bar, q_empty,
                          LSE, DELTA, dk_desc, dv_desc, H, GROUP, Sq, Sk, qk_scale, scale, b, hk, start_n, j_lo, n_qb,
                          HEAD_D, BLOCK_N, BLOCK_M, STAGES, IS_CAUSAL)),
        (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_bar, q_empty,
                         LSE, DELTA, dk_desc, dv_desc, H, GROUP, Sq, Sk, qk_scale, scale, b, hk, start_n, j_lo, n_qb,
                         HEAD_D, BLOCK_N, BLOCK_M, STAGES, IS_CAUSAL)),
        (_bwd_consumer, (1, q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_bar, q_empty,
                          LSE, DELTA, dk_desc, dv_desc, H, GROUP, Sq, Sk, qk_scale, scale, b, hk, start_n, j_lo, n_qb,
                          HEAD_D, BLOCK_N, BLOCK_M, STAGES, IS_CAUSAL)),
    ], [1, 4], [24, 240])


def layouts(block_n: int, block_m: int, d: int, dtype: torch.dtype):
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([block_m, d], gdt),
            gl.NVMMASharedLayout.get_default_for([block_n, d], gdt))


def attention_bwd_dkdv_sm90(do, q, k, v, lse, delta, *, causal: bool, scale: float, config=None):
    """dK, dV of contiguous (B, H, S, D) q / do and (B, Hkv, Sk, D) k / v; lse, delta (B, H, Sq) fp32."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from pykernels._kernels import _tuning
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    bn, bm, stages = config or CONFIGS[d][0]
    assert q.is_contiguous() and do.is_contiguous() and lse.is_contiguous() and delta.is_contiguous()
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    ql, kl = layouts(bn, bm, d, q.dtype)
    qd = TensorDescriptor.from_tensor(q.view(-1, d), [bm, d], ql)
    dod = TensorDescriptor.from_tensor(do.view(-1, d), [bm, d], ql)
    _tuning.ensure_allocator()
    _attention_bwd_dkdv_sm90_kernel[(_tuning.cdiv(sk, 2 * bn), hkv, batch)](
        qd, dod, k, v, dk, dv, lse, delta, *k.stride()[:3], *v.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        hq, hq // hkv, sq, sk, scale * LOG2E, scale,
        HEAD_D=d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=bool(causal), kv_layout=kl, num_warps=4,
        maxnreg=MAX_REGS)
    return dk, dv


def compile_only() -> None:
    import os
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import attention_sm90_gluon_ws as ws
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    fn = _attention_bwd_dkdv_sm90_kernel
    for d, (bn, bm, stages) in ((d, cfg) for d, cfgs in CONFIGS.items() for cfg in cfgs):
        for causal in (False, True):
            ql, kl = layouts(bn, bm, d, torch.bfloat16)
            qd = mangle_type(TensorDescriptor.from_tensor(torch.empty(4096, d, dtype=torch.bfloat16), [bm, d], ql))
            sig = {p.name: ("*bf16" if p.name in ("K", "V", "DK", "DV") else "*fp32" if p.name in ("LSE", "DELTA")
                            else "i64" if p.name.startswith("stride") else "fp32" if p.name in ("qk_scale", "scale")
                            else "constexpr" if p.is_constexpr else "i32") for p in fn.params}
            sig.update(q_desc=qd, do_desc=qd)
            consts = dict(HEAD_D=d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=causal, kv_layout=kl, num_warps=4)
            print(f"bwd-dkdv D{d} cfg{(bn, bm, stages)} {'causal' if causal else 'full'}: "
                  f"{ws.compile_report(fn, sig, consts, dict(num_warps=4, maxnreg=MAX_REGS))}", flush=True)


def main() -> None:
    if "--compile-only" in sys.argv:
        compile_only()
        return
    import os

    from triton.testing import do_bench

    from pykernels._kernels import attention as tri
    os.environ["PYKERNELS_ATTN_SM90"] = "0"  # the Triton forward's o and lse, as the Triton backward sees them
    print(torch.cuda.get_device_name(), torch.__version__)
    for b, h, hkv, s_, d, causal in [(32, 12, 12, 512, 64, False), (8, 12, 12, 1024, 64, True),
                                     (4, 16, 16, 4096, 128, True), (2, 16, 16, 8192, 128, False),
                                     (2, 16, 16, 8192, 128, True), (2, 8, 2, 1000, 128, True)]:
        try:
            q = torch.randn(b, h, s_, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, hkv, s_, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            do = torch.randn_like(q)
            sc = d ** -0.5
            o, lse = tri.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=0.0, seed=0)
            delta = (o.float() * do.float()).sum(-1).contiguous()
            dq_t, dk_t, dv_t = tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc, dropout_p=0.0,
                                                 seed=0)
            flops = 4 * 2 * b * h * s_ * s_ * d / (2 if causal else 1)  # dK/dV's 4 GEMMs
            ms_t = do_bench(lambda: tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc,
                                                      dropout_p=0.0, seed=0))
            print(f"B{b} H{h}/{hkv} S{s_} D{d} {'causal' if causal else 'full'}: Triton whole backward {ms_t:.3f} ms "
                  f"({2.5 * flops / 2 / ms_t / 1e9:.0f} TFLOP/s by the 2.5x-forward count)", flush=True)
            lse_c = lse.contiguous()
            for cfg in CONFIGS[d]:
                dk, dv = attention_bwd_dkdv_sm90(do, q, k, v, lse_c, delta, causal=causal, scale=sc, config=cfg)
                err = max((dk.float() - dk_t.float()).abs().max().item(),
                          (dv.float() - dv_t.float()).abs().max().item())
                ref = max(dk_t.float().abs().max().item(), dv_t.float().abs().max().item())
                ms = do_bench(lambda cfg=cfg: attention_bwd_dkdv_sm90(do, q, k, v, lse_c, delta, causal=causal,
                                                                       scale=sc, config=cfg))
                print(f"    gluon dK/dV {cfg}: max |dk, dv - Triton| {err:.2e} (max |Triton| {ref:.2e}); {ms:.3f} ms "
                      f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as e:  # report and go on: this is a probe
            print(f"B{b} H{h} S{s_} D{d}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
