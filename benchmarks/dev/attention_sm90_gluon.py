"""Experiment (not used by the package): an attention forward for Hopper (sm_90) in Gluon, with TMA
loads and asynchronous wgmma, the next block's QK^T in flight while the current block's softmax runs.

Result (H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, cuDNN 9.19, 2026-11-26, bf16 forward,
``benchmarks/results/attention_sm90_gluon_*_run16.txt``): correct on every probe case (336: D 64/128,
fp16/bf16, both layouts, GQA, causal, lengths 1/17/127/256/300/700/1000), but no faster than the
plain-Triton forward: B2 H16 S8192 D128 full 462 TFLOP/s (best of 3 configs) vs Triton 479 vs cuDNN
615; B32 H12 S512 D64 255 vs 301 vs 358. The overlap the schedule adds is offset by what it lacks:
with the loads issued by the consumer warps themselves, each iteration needs a CTA barrier before a
stage is refilled, and a program builds its tensor descriptors on the device. Beating cuDNN needs
FlashAttention-3's whole structure (a producer warp with register reallocation, two consumer
warpgroups in ping-pong, 128-row tiles sharing K/V), not the overlap alone.

Usage: ``python benchmarks/dev/attention_sm90_gluon.py [--quick]`` (sm_90): correctness of every
config, then forward TFLOP/s on the ANCHORS shapes next to the Triton forward, cuDNN and flash.

Why a second forward. Triton 3.6 waits for every wgmma right after issuing it (``wgmma.wait_group 0``;
``benchmarks/dev/sm90_codegen.py`` shows it), so in the plain-Triton forward the tensor cores sit idle
during each softmax and the kernel reaches 0.80-0.85x of cuDNN on an H100. Gluon (Triton's lower-level
language, same compiler and launcher) lets the kernel say how many wgmma groups stay outstanding.

Schedule per program (one query block of BLOCK_M rows of one (batch, head)), FlashAttention-3's
intra-warpgroup overlap (Shah et al. 2024, Algorithm 2), without its producer warp:

    S_0 = Q K_0^T; P_0 = softmax step(S_0)
    for j = 1 .. n-1:
        issue S_j = Q K_j^T              (async)
        issue O += P_{j-1} V_{j-1}       (async)
        wait until only one group is outstanding: S_j done, P V may still run
        softmax step on S_j -> m_j, l_j, P_j, alpha_j     (overlaps the P V wgmma)
        wait for P V; O *= alpha_j; refill the freed K/V stages by TMA
    O += P_{n-1} V_{n-1}; O /= l; store O by TMA, lse = (m + log2 l) * ln 2

K and V come through a STAGES-deep ring of shared-memory buffers, one mbarrier per buffer (TMA
completion), refilled STAGES blocks ahead by one thread after a CTA barrier (both warpgroups must be
done reading a buffer before TMA overwrites it). Q is loaded once; its buffer stages O for the store.
Tensor descriptors are built on the device per program (base pointer at the (batch, head) slice,
shape (S, D), the caller's row stride), so any layout with a unit last stride and 16-byte aligned
strides works, and TMA's zero fill and store clipping handle the sequence tails (key columns >= Sk
are masked to -inf in the last block; rows >= Sq are never stored).

Scores are in base 2: ``qk_scale = scale * log2(e)`` (scale > 0), ``m`` is the running max of
``S * qk_scale``, ``p = exp2(S * qk_scale - m)``. Causal masking is top-left aligned as in
``kernels/attention.py``; blocks above the diagonal are never loaded, and only blocks that cross the
diagonal or the key tail pay for the mask (a uniform branch).

Scope (``applies`` checks it): sm_90, fp16/bf16, head dim 64 or 128 with Dv == D, no mask, no dropout, not varlen, scale > 0,
GQA by head index. Gluon has no CPU interpreter: this runs on the GPU only.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.testing import do_bench

from pykernels._alloc import empty, empty_like_layout
from pykernels._kernels import _launch, _tuning
from pykernels._kernels import attention as tri
from pykernels._kernels.attention_sm90 import (  # noqa: F401
    _head_descriptors, _mask_scores, _needs_mask, _slice_desc, _softmax_step, smem_layouts)

LOG2E = 1.4426950408889634


@gluon.jit
def _load_kv(desc, bufs, bars, blk, n_blocks, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """TMA block ``blk`` of K or V into stage ``blk % STAGES`` (nothing when blk >= n_blocks)."""
    slot = blk % STAGES
    pred = blk < n_blocks
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [blk * BLOCK_N, 0], bars.index(slot), bufs.index(slot), pred=pred)


@gluon.jit
def _attention_fwd_sm90_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    GROUP, Sq, Sk, qk_scale,
    HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, q_layout: gl.constexpr, kv_layout: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = Q.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid_m = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    hk = (h // GROUP).to(gl.int64)
    h64 = h.to(gl.int64)
    start_m = pid_m * BLOCK_M

    q_desc, k_desc, v_desc = _head_descriptors(
        Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        b, h64, hk, Sq, Sk, HEAD_D, BLOCK_M, BLOCK_N, q_layout, kv_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)

    if IS_CAUSAL:
        hi = gl.minimum(Sk, start_m + BLOCK_M)
    else:
        hi = Sk
    n_blocks = gl.cdiv(hi, BLOCK_N)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [start_m, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load_kv(k_desc, k_smem, k_bar, i, n_blocks, STAGES, BLOCK_N)
        _load_kv(v_desc, v_smem, v_bar, i, n_blocks, STAGES, BLOCK_N)

    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)

    # block 0
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    if _needs_mask(0, start_m, Sk, BLOCK_N, IS_CAUSAL):
        s = _mask_scores(s, 0, start_m, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, s_layout)
    m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i, qk_scale)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_blocks):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_bar.index(slot), (j // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        if _needs_mask(j, start_m, Sk, BLOCK_N, IS_CAUSAL):
            s = _mask_scores(s, j, start_m, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, s_layout)
        m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i, qk_scale)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        # K of block j-1 and V of block j-1 are read by every warpgroup now: refill stage (j-1) % STAGES
        gl.thread_barrier()
        _load_kv(k_desc, k_smem, k_bar, j - 1 + STAGES, n_blocks, STAGES, BLOCK_N)
        _load_kv(v_desc, v_smem, v_bar, j - 1 + STAGES, n_blocks, STAGES, BLOCK_N)

    last = n_blocks - 1
    mbarrier.wait(v_bar.index(last % STAGES), (last // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(last % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    l_o = gl.convert_layout(l_i, row_o)
    out = acc / gl.expand_dims(l_o, 1)
    rows = start_m + gl.arange(0, BLOCK_M, layout=row_s)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + b * stride_lb + h64 * stride_lh + rows, lse, mask=rows < Sq)
    # Q's buffer stages O for the TMA store (which clips rows >= Sq)
    o_desc = _slice_desc(O, b * stride_ob + h64 * stride_oh, Sq, stride_om, HEAD_D, BLOCK_M, q_layout)
    gl.thread_barrier()
    q_smem.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [start_m, 0], q_smem)
    tma.store_wait(pendings=0)


# (BLOCK_M, BLOCK_N, STAGES, num_warps) per head dim; the first is the default.
CONFIGS = {64: [(128, 128, 2, 8), (128, 64, 3, 8), (64, 128, 2, 4)],
           128: [(128, 64, 2, 8), (128, 128, 2, 8), (64, 64, 2, 4)]}


def attention_fwd_sm90(q, k, v, *, causal: bool, scale: float, config=None):
    """q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), checked by ``applies``. Returns o (laid out like q) and lse
    (B, Hq, Sq) fp32, as ``kernels.attention.attention_fwd`` does."""
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    bm, bn, stages, warps = config or CONFIGS[d][0]
    o = empty_like_layout(q)
    if any(s % 8 for s in o.stride()[:3]):
        o = empty(batch, hq, sq, d, dtype=q.dtype, device=q.device)
    lse = empty(batch, hq, sq, dtype=torch.float32, device=q.device)
    _tuning.ensure_allocator()
    ql, kl = smem_layouts(bm, bn, d, q.dtype)
    _launch.fast(_attention_fwd_sm90_kernel)[(_tuning.cdiv(sq, bm), hq, batch)](
        q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
        hq // hkv, sq, sk, scale * LOG2E,
        HEAD_D=d, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, IS_CAUSAL=bool(causal), q_layout=ql, kv_layout=kl,
        num_warps=warps)
    return o, lse


def applies(q, k, v, mask, *, dropout_p: float, scale: float, varlen: bool) -> str | None:
    """None when the sm_90 kernel covers the call, else the reason it does not: the package kernel's
    scope (``kernels/attention_sm90.unsupported``), which this experiment shares."""
    from pykernels._kernels.attention_sm90 import unsupported
    return unsupported(q, k, v, mask, dropout_p=dropout_p, scale=scale, varlen=varlen)


def ref(q, k, v, causal, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, scale=scale)


def check(b, hq, hkv, sq, sk, d, causal, dtype, layout, cfg):
    def make(h, s):
        if layout == "bshd":
            return torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(b, h, s, d, device="cuda", dtype=dtype)
    q, k, v = make(hq, sq), make(hkv, sk), make(hkv, sk)
    scale = d ** -0.5
    why = applies(q, k, v, None, dropout_p=0.0, scale=scale, varlen=False)
    if why is not None:
        return f"not covered: {why}"
    o, lse = attention_fwd_sm90(q, k, v, causal=causal, scale=scale, config=cfg)
    r = ref(q, k, v, causal, scale)
    with sdpa_kernel([SDPBackend.MATH]):
        eager = F.scaled_dot_product_attention(q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1),
                                               is_causal=causal, scale=scale)
    err = (o.double() - r).abs().max().item()
    err_eager = (eager.double() - r).abs().max().item()
    # lse against the reference's
    kk = k.repeat_interleave(hq // hkv, 1).double()
    s = q.double() @ kk.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    lse_err = (lse.double() - torch.logsumexp(s, -1)).abs().max().item()
    ok = err <= 2 * err_eager + 1e-3 and lse_err < 1e-3 and torch.isfinite(o).all().item()
    return f"{'ok ' if ok else 'BAD'} err {err:.2e} (eager {err_eager:.2e}) lse {lse_err:.1e}"


def main():
    quick = "--quick" in sys.argv
    dev = torch.cuda.get_device_name()
    print(f"{dev}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    cases = [(2, 4, 4, 1, 1, False), (2, 4, 2, 17, 17, True), (1, 3, 3, 127, 1000, False), (1, 2, 1, 1000, 127, True),
             (2, 2, 2, 1000, 1000, True), (1, 2, 2, 256, 256, False), (1, 2, 2, 300, 700, True)]
    for d in (64, 128):
        for cfg in CONFIGS[d]:
            for dtype in (torch.bfloat16, torch.float16):
                for layout in ("bhsd", "bshd"):
                    for (b, hq, hkv, sq, sk, causal) in cases:
                        try:
                            res = check(b, hq, hkv, sq, sk, d, causal, dtype, layout, cfg)
                        except Exception as e:  # report and go on: this is a probe
                            res = f"ERROR {type(e).__name__}: {str(e)[:300]}"
                        if not res.startswith("ok") or (b, sq) == (1, 256):
                            print(f"D{d} cfg{cfg} {str(dtype)[6:]} {layout} b{b} h{hq}/{hkv} {sq}x{sk} "
                                  f"{'causal' if causal else 'full'}: {res}")
    print("correctness sweep done")

    shapes = [(32, 12, 512, 64, False), (8, 12, 1024, 64, True), (4, 16, 4096, 128, True), (2, 16, 8192, 128, False),
              (2, 16, 8192, 128, True)]
    if quick:
        shapes = shapes[:2]
    print(f"{'shape':<30} {'impl':<26} {'ms':>8} {'TFLOP/s':>8}")
    for b, h, s, d, causal in shapes:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        scale = d ** -0.5
        rows = []
        for cfg in CONFIGS[d]:
            rows.append((f"gluon {cfg}", lambda cfg=cfg: attention_fwd_sm90(q, k, v, causal=causal, scale=scale,
                                                                            config=cfg)))
        rows.append(("triton (autotuned)", lambda: tri.attention_fwd(q, k, v, None, causal=causal, scale=scale,
                                                                     dropout_p=0.0, seed=0)))
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def f(be=be):
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            rows.append((name, f))
        for name, fn in rows:
            try:
                ms = do_bench(fn, warmup=50, rep=200)
                print(f"B{b} H{h} S{s} D{d} {'causal' if causal else 'full':<6} {name:<26} {ms:8.3f} "
                      f"{flops / ms / 1e9:8.1f}", flush=True)
            except Exception as e:
                print(f"B{b} H{h} S{s} D{d} {name}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
