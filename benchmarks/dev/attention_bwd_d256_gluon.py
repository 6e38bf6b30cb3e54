"""A Hopper (sm_90) dK/dV kernel for head dim 256, in Gluon: where it was written (run480), now the package's
``kernels/attention_sm90_bwd.py`` ``_attention_bwd_dkdv_split_sm90_kernel``; this probe checks and times it.

Why. Above D = 128 the attention backward is the Triton FlashAttention-2 pair (0.58-0.73x cuDNN in run474-478's
matrix). The package's Gluon dK/dV kernel (``kernels/attention_sm90_bwd.py``) cannot take D = 256: each consumer
warpgroup holds its 64 keys' dK and dV, 2 x 64 x 256 fp32, 256 registers a thread. Its Gluon dQ kernel compiles at
D = 256 but its 32-key blocks lost to Triton's dQ kernel (run478).

The split (FlashAttention-3's layout for large head dims). A CTA takes BLOCK_N = 64 keys of one (batch, kv head);
both consumer warpgroups work on the same keys and split the head dim's columns: warpgroup w holds dK[:, w D/2 :
(w + 1) D/2] and dV's same columns (2 x 64 x 128 fp32: 128 registers). Per query block j (BLOCK_M = 64 queries; the
producer warp streams Q_j, dO_j, lse_j and delta_j through a STAGES-deep ring, ``_dkdv_producer`` of the package):

    warpgroup 0:  S^T = K Q_j^T,  P^T = exp2(S^T scale log2 e - lse_j log2 e) (causal: 0 above the diagonal)
                  P^T -> shared memory (pt_smem[it % 2]); p_bar
    warpgroup 1:  dP^T = V dO_j^T; waits p_bar, loads P^T; dS^T = P^T (dP^T - delta_j) -> ds_smem[it % 2]; s_bar
    both:         dV[:, cols] += P^T dO_j[:, cols];  dK[:, cols] += dS^T Q_j[:, cols]

Each warpgroup runs one full-width GEMM (S^T or dP^T, 64 x 64 x 256) and two half-width ones (64 x 128 x 64) a
block, so their tensor-core work is equal; warpgroup 0 feeds its dV GEMM P^T from registers and its dK GEMM dS^T
from shared memory, warpgroup 1 the other way round. The double-buffered P^T / dS^T tiles need no release barrier:
a warpgroup reaches block it + 2 only after waiting on the other's barrier of block it + 1, which the other passes
only after its block it's GEMMs completed. At the end both halves go into the K / V buffers (once neither
warpgroup reads K or V) and warpgroup 0 stores the two tiles by TMA. dK * scale. dQ is not computed here: Triton's
dQ kernel runs first and forms delta (as the package's pair does).

Shared memory at 64 x 64 x 2 stages: Q and dO 128 KiB, K and V 64 KiB, P^T and dS^T 32 KiB: 225 KiB.

The "roles" variant below (``_dkdv_d256_roles_kernel``, compiled on the CPU only: 12-16 bytes spilled, 230864 B):
warpgroup 0 holds all of dV, warpgroup 1 all of dK, and P^T reaches warpgroup 1 in fp32 (dK's error then that of
one bf16 rounding of dS^T, as in the Triton kernel; the column split rounds P^T too). The probe checks and times both.

Usage: ``python benchmarks/dev/attention_bwd_d256_gluon.py --compile-only`` (any machine: Triton's ptxas, registers,
spills, shared memory); on an sm_90 GPU without arguments (``--quick``: three timed shapes): dK / dV against the
float64 reference and the Triton
kernel's, then each shape's time (graph replay) of this kernel, of the Triton backward and its kernels (profiler),
and cuDNN's backward. H200 run480 (``attention_bwd_d256_split_*_run480.txt``): the checks passed, B4 H8 S4096 causal
1.009 ms against the Triton dK/dV kernel's 2.157 (the next shape's set-up failed after cuDNN's graph capture:
"Offset increment outside graph capture"; cuDNN is now timed by do_bench, not captured).
"""
from __future__ import annotations

import itertools
import os
import sys

import torch

from pykernels._kernels.attention_sm90 import MAX_REGS, smem_layouts
from pykernels._kernels.attention_sm90_bwd import DKDV_SPLIT_CONFIGS, _ds_layout
from pykernels._kernels.attention_sm90_bwd import _attention_bwd_dkdv_split_sm90_kernel as _dkdv_d256_kernel
from pykernels._kernels.attention_sm90_bwd import attention_bwd_dkdv_split_sm90

CONFIG = DKDV_SPLIT_CONFIGS[256]  # (BLOCK_N keys a CTA, BLOCK_M queries a block, STAGES)


def _p_layout(bn: int, bm: int, dtype: torch.dtype):
    return _ds_layout(bn, bm, dtype)


def dkdv_d256(do, q, k, v, lse, delta, dk, dv, *, causal: bool, scale: float, config=CONFIG) -> bool:
    """The package's split kernel (``attention_bwd_dkdv_split_sm90``) on these tensors."""
    return attention_bwd_dkdv_split_sm90(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=scale, config=config)


# ---------------------------------------------------------------------------------------------------------------
# Variant "roles" (written after run480, compiled on the CPU only): the warpgroups split the work by role instead of
# by columns. Warpgroup 0 holds all of dV (64 x 256 fp32), warpgroup 1 all of dK: warpgroup 0 runs S^T = K Q_j^T,
# P^T (fp32) into shared memory (``p_bar``) and dV += P^T dO_j from its registers; warpgroup 1 runs dP^T = V dO_j^T,
# takes P^T in fp32 (exact, where the column split hands it over in bf16: dK's error 1.0-2.6x the Triton kernel's in
# run480), dS^T = P^T (dP^T - delta_j) in registers and dK += dS^T Q_j. Two 64 x 64 x 256 GEMMs a warpgroup a block, as
# in the column split; one hand-over instead of two (no dS^T tile, no ``s_bar``). The P^T tiles (fp32, one a ring
# stage) are rewritten only once the producer refilled that stage, i.e. after both warpgroups released it.
# ---------------------------------------------------------------------------------------------------------------
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from pykernels._kernels.attention_sm90 import LOG2E, _flat_coords, _flat_descriptor, _slice_desc  # noqa: E402
from pykernels._kernels.attention_sm90_bwd import _dkdv_producer, host_kv_descriptors  # noqa: E402


@gluon.jit
def _roles_consumer(WG: gl.constexpr, q_smem, do_smem, k_smem, v_smem, pt_smem, lse_smem, dlt_smem, kv_bar, q_bar,
                    q_empty, p_bar, end_bar, st_bar, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col, GROUP,
                    qk_scale, scale, start_n, j_lo, n_qb, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr,
                    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Warpgroup 0: S^T, P^T and dV; warpgroup 1: dP^T, dS^T and dK (the variant's comment above)."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    keys = start_n + gl.arange(0, BLOCK_N, layout=row_s)
    acc = gl.zeros([BLOCK_N, HEAD_D], gl.float32, acc_layout)  # dV (warpgroup 0) or dK (warpgroup 1)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    mbarrier.wait(kv_bar.index(0), 0)
    it = 0
    for g in range(GROUP):
        for j in range(j_lo, n_qb):
            s = it % STAGES
            ph = (it // STAGES) & 1
            mbarrier.wait(q_bar.index(s), ph)
            q_tile = q_smem.index(s)
            do_tile = do_smem.index(s)
            pt_tile = pt_smem.index(s)
            if WG == 0:
                st = warpgroup_mma(k_smem.index(0), q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                lse2 = lse_smem.index(s).load(col_s)
                st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
                pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
                if IS_CAUSAL:
                    if j * BLOCK_M < start_n + BLOCK_N:  # the block reaches the diagonal: query i sees keys <= i
                        cols = j * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s)
                        pt = gl.where(gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1), pt, 0.0)
                pt_tile.store(pt)
                mbarrier.arrive(p_bar.index(s), count=1)
                acc = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_tile, acc, is_async=True)
            else:
                dpt = warpgroup_mma(v_smem.index(0), do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                delta = dlt_smem.index(s).load(col_s)
                dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
                mbarrier.wait(p_bar.index(s), ph)
                pt = pt_tile.load(s_layout)
                dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
                acc = warpgroup_mma(gl.convert_layout(dst, a_layout), q_tile, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(q_empty.index(s), count=1)
            it += 1
    mbarrier.arrive(end_bar.index(0), count=1)
    mbarrier.wait(end_bar.index(0), 0)  # both warpgroups past their loops: no GEMM reads K or V any more
    if WG == 0:
        v_smem.index(0).store(acc.to(dtype))
    else:
        k_smem.index(0).store((acc * scale).to(dtype))
    fence_async_shared()
    if WG == 0:
        mbarrier.wait(st_bar.index(0), 0)  # warpgroup 1's dK is in place
        tma.async_copy_shared_to_global(dk_desc, [dk_row + start_n, dk_col], k_smem.index(0))
        tma.async_copy_shared_to_global(dv_desc, [dv_row + start_n, dv_col], v_smem.index(0))
        tma.store_wait(pendings=0)
    else:
        mbarrier.arrive(st_bar.index(0), count=1)


@gluon.jit
def _dkdv_d256_roles_kernel(
    q_desc, do_desc, K, V, DK, DV, LSE, DELTA,
    stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_lb, stride_lh,
    H, GROUP, Sq, Sk, qk_scale, scale,
    HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, kv_layout: gl.constexpr, p_layout: gl.constexpr,
    num_warps: gl.constexpr, HOST_KV: gl.constexpr,
):
    """The package's ``_attention_bwd_dkdv_split_sm90_kernel`` with ``_roles_consumer``: P^T tiles fp32, one a
    stage (``p_layout`` an fp32 layout), no dS^T tiles."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = q_desc.dtype
    start_n = gl.program_id(0) * BLOCK_N
    hk = gl.program_id(1).to(gl.int64)
    b = gl.program_id(2).to(gl.int64)
    if HOST_KV:
        k_desc = K
        v_desc = V
        dk_desc = DK
        dv_desc = DV
        k_row, k_col = _flat_coords(b * stride_kb + hk * stride_kh, stride_kn)
        v_row, v_col = _flat_coords(b * stride_vb + hk * stride_vh, stride_vn)
        dk_row, dk_col = _flat_coords(b * stride_dkb + hk * stride_dkh, stride_dkn)
        dv_row, dv_col = _flat_coords(b * stride_dvb + hk * stride_dvh, stride_dvn)
    else:
        k_desc = _slice_desc(K, b * stride_kb + hk * stride_kh, Sk, stride_kn, HEAD_D, BLOCK_N, kv_layout)
        v_desc = _slice_desc(V, b * stride_vb + hk * stride_vh, Sk, stride_vn, HEAD_D, BLOCK_N, kv_layout)
        dk_desc = _slice_desc(DK, b * stride_dkb + hk * stride_dkh, Sk, stride_dkn, HEAD_D, BLOCK_N, kv_layout)
        dv_desc = _slice_desc(DV, b * stride_dvb + hk * stride_dvh, Sk, stride_dvn, HEAD_D, BLOCK_N, kv_layout)
        k_row, k_col, v_row, v_col, dk_row, dk_col, dv_row, dv_col = 0, 0, 0, 0, 0, 0, 0, 0
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_D], kv_layout)
    pt_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, BLOCK_M], p_layout)
    stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    dlt_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    end_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    st_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_bar.index(i), count=2)  # (the TMA's expect, the stats' arrival: _dkdv_producer)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(p_bar.index(i), count=1)
    mbarrier.init(end_bar.index(0), count=2)
    mbarrier.init(st_bar.index(0), count=1)
    fence_async_shared()
    mbarrier.expect(kv_bar.index(0), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [k_row + start_n, k_col], kv_bar.index(0), k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [v_row + start_n, v_col], kv_bar.index(0), v_smem.index(0))
    j_lo = 0
    if IS_CAUSAL:
        j_lo = start_n // BLOCK_M
    n_qb = gl.cdiv(Sq, BLOCK_M)
    gl.warp_specialize([
        (_roles_consumer, (0, q_smem, do_smem, k_smem, v_smem, pt_smem, lse_smem, dlt_smem, kv_bar, q_bar, q_empty,
                           p_bar, end_bar, st_bar, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col, GROUP, qk_scale,
                           scale, start_n, j_lo, n_qb, HEAD_D, BLOCK_N, BLOCK_M, STAGES, IS_CAUSAL)),
        (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, k_smem, k_smem,
                          lse_smem, dlt_smem, kv_bar, q_bar, q_empty, kv_bar, stride_qb, stride_qh, stride_qm,
                          stride_dob, stride_doh, stride_dom, LSE, DELTA, None, stride_lb, stride_lh, H, GROUP, Sq,
                          qk_scale, scale, b, hk, start_n, j_lo, n_qb, dk_desc, dv_desc, None, HEAD_D, BLOCK_N,
                          BLOCK_M, STAGES, IS_CAUSAL, False, False)),
        (_roles_consumer, (1, q_smem, do_smem, k_smem, v_smem, pt_smem, lse_smem, dlt_smem, kv_bar, q_bar, q_empty,
                           p_bar, end_bar, st_bar, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col, GROUP, qk_scale,
                           scale, start_n, j_lo, n_qb, HEAD_D, BLOCK_N, BLOCK_M, STAGES, IS_CAUSAL)),
    ], [1, 4], [24, 240])


def _pf_layout(bn: int, bm: int):
    return gl.NVMMASharedLayout.get_default_for([bn, bm], gl.float32)


def dkdv_d256_roles(do, q, k, v, lse, delta, dk, dv, *, causal: bool, scale: float, config=CONFIG) -> bool:
    """The "roles" variant on these tensors (as ``attention_bwd_dkdv_split_sm90``)."""
    from pykernels._kernels import _launch, _tuning
    from pykernels._kernels.attention_sm90 import _tma_ok
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    bn, bm, stages = config
    ql, kl = smem_layouts(bm, bn, d, q.dtype)
    qd, dod = _flat_descriptor(q, bm, ql), _flat_descriptor(do, bm, ql)
    if qd is None or dod is None or not (_tma_ok(dk) and _tma_ok(dv)):
        return False
    host = host_kv_descriptors(k, v, dk, dv, bn, kl, cta_keys=bn)
    _tuning.ensure_allocator()
    _launch.fast(_dkdv_d256_roles_kernel)[(_tuning.cdiv(sk, bn), hkv, batch)](
        qd, dod, *(host or (k, v, dk, dv)), lse, delta, *q.stride()[:3], *do.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], *lse.stride()[:2], hq, hq // hkv, sq, sk,
        scale * LOG2E, scale, HEAD_D=d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=bool(causal),
        kv_layout=kl, p_layout=_pf_layout(bn, bm), num_warps=4, HOST_KV=host is not None, maxnreg=MAX_REGS)
    return True


def compile_only() -> None:
    """Compile the kernel for sm_90 on any machine (``attention_sm90_gluon_ws.compile_report``): causal or not,
    K / V through host descriptors or made on the device."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import attention_sm90_gluon_ws as ws
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    d = 256
    bn, bm, stages = CONFIG
    ql, kl = smem_layouts(bm, bn, d, torch.bfloat16)

    def desc(rows, layout):
        return mangle_type(TensorDescriptor.from_tensor(torch.empty(4096, d, dtype=torch.bfloat16), [rows, d], layout))

    variants = ((_dkdv_d256_kernel, "bwd-dkdv-d256", _p_layout(bn, bm, torch.bfloat16)),
                (_dkdv_d256_roles_kernel, "bwd-dkdv-d256-roles", _pf_layout(bn, bm)))
    for (fn, label, pl), causal, host_kv in itertools.product(variants, (False, True), (False, True)):
        sig = {}
        for p in fn.params:
            n = p.name
            sig[n] = (desc(bm, ql) if n in ("q_desc", "do_desc") else desc(bn, kl) if host_kv and n in (
                "K", "V", "DK", "DV") else "*bf16" if n in ("K", "V", "DK", "DV") else "*fp32" if n in (
                "LSE", "DELTA") else "i64" if n.startswith("stride") else "fp32" if n in ("qk_scale", "scale")
                else "constexpr" if p.is_constexpr else "i32")
        consts = dict(HEAD_D=d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=causal, kv_layout=kl,
                      p_layout=pl, num_warps=4, HOST_KV=host_kv)
        print(f"{label} cfg{CONFIG} {'causal' if causal else 'full'}{' host-kv' if host_kv else ''}: "
              f"{ws.compile_report(fn, sig, consts, dict(num_warps=4, maxnreg=MAX_REGS))}", flush=True)


def gpu_check_and_time() -> None:
    """dK / dV of the package's split kernel and of the "roles" variant against float64 and against the Triton dK/dV
    kernel's, then graph-replay times (ms): both kernels, the Triton backward (and its kernels by the profiler),
    cuDNN's backward (do_bench)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from attention_sm90_gluon_ws import graph_ms
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from pykernels._kernels import attention as tri
    print("#", torch.cuda.get_device_name(), torch.__version__, "CONFIG", CONFIG, flush=True)
    os.environ["PYKERNELS_ATTN_SM90_BWD"] = ""  # the Triton pair for the comparison
    checks = [(2, 4, 2, 1000, 1100, True), (1, 4, 4, 1031, 1024, False), (2, 2, 2, 64, 127, False),
              (1, 6, 2, 700, 700, True), (1, 2, 1, 300, 4096, False)]
    for b, h, hkv, sq, sk, causal in checks:
        g = torch.Generator(device="cuda").manual_seed(sq)
        q = torch.randn(b, h, sq, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(b, hkv, sk, 256, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        do = torch.randn_like(q)
        sc = 256 ** -0.5
        o, lse = tri.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=0.0, seed=0)
        _, dk_t, dv_t = tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc, dropout_p=0.0, seed=0)
        delta = (do.float() * o.float()).sum(-1)
        qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=sc,
                                                               enable_gqa=h != hkv)
        _, dk_r, dv_r = torch.autograd.grad(ref, (qq, kk, vv), do.double())
        for label, fn in (("split", dkdv_d256), ("roles", dkdv_d256_roles)):
            dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
            assert fn(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=sc)
            err = [(x.double() - r).abs().max().item()
                   for x, r in ((dk, dk_r), (dv, dv_r), (dk_t, dk_r), (dv_t, dv_r))]
            print(f"check {label} B{b} H{h}/{hkv} Sq{sq} Sk{sk} {'causal' if causal else 'full'}: |dk - ref| "
                  f"{err[0]:.2e} |dv - ref| {err[1]:.2e} (Triton {err[2]:.2e} / {err[3]:.2e}); "
                  f"NaN {bool(dk.isnan().any() or dv.isnan().any())}", flush=True)
    shapes = [(4, 8, 4096, True), (4, 8, 2048, False), (2, 8, 8192, False), (16, 16, 512, False), (1, 8, 8192, True)]
    for b, h, s, causal in shapes[:3] if "--quick" in sys.argv else shapes:
        q, k, v = (torch.randn(b, h, s, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn_like(q)
        sc = 256 ** -0.5
        o, lse = tri.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=0.0, seed=0)
        delta = (do.float() * o.float()).sum(-1)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        ours = graph_ms(lambda: dkdv_d256(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=sc))
        roles = graph_ms(lambda: dkdv_d256_roles(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=sc))
        pair = graph_ms(lambda: tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc, dropout_p=0.0,
                                                  seed=0))
        os.environ["PYKERNELS_ATTN_SM90_BWD"] = "dkdv"  # the package's backward with the split kernel (Triton's dQ)
        whole = graph_ms(lambda: tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc,
                                                   dropout_p=0.0, seed=0))
        os.environ["PYKERNELS_ATTN_SM90_BWD"] = ""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc, dropout_p=0.0, seed=0)
            torch.cuda.synchronize()
        kern = {e.key[:40]: e.device_time_total / 1e3 for e in prof.key_averages() if e.device_time_total > 0}
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=sc)
        # (do_bench, host included: run480's capture of cuDNN's backward left the generator mid-capture)
        cudnn = do_bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
        gemm4 = 4 * 2 * b * h * s * s * 256 / (2 if causal else 1)
        print(f"B{b} H{h} S{s} D256 {'causal' if causal else 'full'}: split dK/dV {ours:.4f} ms "
              f"({gemm4 / ours / 1e9:.0f} TFLOP/s of its 4 GEMMs), roles {roles:.4f} ms "
              f"({gemm4 / roles / 1e9:.0f}); the package's backward with the split kernel {whole:.4f} ms "
              f"({1.25 * gemm4 / whole / 1e9:.0f} TFLOP/s, 2.5x the forward's); the Triton backward {pair:.4f} ms, "
              f"its kernels (ms) {kern}; "
              f"cuDNN backward (do_bench) {cudnn:.4f} ms", flush=True)


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    else:
        gpu_check_and_time()
