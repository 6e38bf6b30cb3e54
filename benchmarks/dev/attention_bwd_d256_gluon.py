"""A Hopper (sm_90) dK/dV kernel for head dim 256, in Gluon: a development kernel, not in the package yet.

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

Usage: ``python benchmarks/dev/attention_bwd_d256_gluon.py --compile-only`` (any machine: Triton's ptxas, registers,
spills, shared memory); on an sm_90 GPU without arguments (``--quick``: three timed shapes): dK / dV against the float64 reference and the Triton
kernel's, then each shape's time (graph replay) of this kernel, of the Triton backward and its kernels (profiler),
and cuDNN's backward. Not yet run on a GPU (written in the eightieth session, compiled on the CPU only).
"""
from __future__ import annotations

import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from pykernels._kernels.attention_sm90 import (LOG2E, MAX_REGS, _flat_coords, _flat_descriptor, _slice_desc,
                                               smem_layouts)
from pykernels._kernels.attention_sm90_bwd import _dkdv_producer

CONFIG = (64, 64, 2)  # (BLOCK_N keys a CTA, BLOCK_M queries a block, STAGES)


@gluon.jit
def _split_consumer(WG: gl.constexpr, q_smem, do_smem, k_smem, v_smem, pt_smem, ds_smem, lse_smem, dlt_smem, kv_bar,
                    q_bar, q_empty, p_bar, s_bar, end_bar, st_bar, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col,
                    GROUP, qk_scale, scale, start_n, j_lo, n_qb, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr,
                    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Consumer warpgroup WG: columns [WG * HEAD_D / 2, + HEAD_D / 2) of the CTA's keys' dK and dV (module
    docstring)."""
    HALF: gl.constexpr = HEAD_D // 2
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HALF, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    keys = start_n + gl.arange(0, BLOCK_N, layout=row_s)
    dk = gl.zeros([BLOCK_N, HALF], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HALF], gl.float32, acc_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    mbarrier.wait(kv_bar.index(0), 0)
    it = 0
    for g in range(GROUP):
        for j in range(j_lo, n_qb):
            s = it % STAGES
            buf = it % 2
            ph = (it // 2) & 1
            mbarrier.wait(q_bar.index(s), (it // STAGES) & 1)
            q_tile = q_smem.index(s)
            do_tile = do_smem.index(s)
            pt_tile = pt_smem.index(buf)
            ds_tile = ds_smem.index(buf)
            if WG == 0:
                st = warpgroup_mma(k_smem.index(0), q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                lse2 = lse_smem.index(s).load(col_s)
                st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
                pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
                if IS_CAUSAL:
                    if j * BLOCK_M < start_n + BLOCK_N:  # the block reaches the diagonal: query i sees keys <= i
                        cols = j * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s)
                        pt = gl.where(gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1), pt, 0.0)
                pt16 = pt.to(dtype)
                pt_tile.store(pt16)
                fence_async_shared()
                mbarrier.arrive(p_bar.index(buf), count=1)
                dv = warpgroup_mma(gl.convert_layout(pt16, a_layout), do_tile.slice(0, HALF, dim=1), dv,
                                   is_async=True)
                mbarrier.wait(s_bar.index(buf), ph)
                dk = warpgroup_mma(ds_tile, q_tile.slice(0, HALF, dim=1), dk, is_async=True)
            else:
                dpt = warpgroup_mma(v_smem.index(0), do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                delta = dlt_smem.index(s).load(col_s)
                dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
                mbarrier.wait(p_bar.index(buf), ph)
                dv = warpgroup_mma(pt_tile, do_tile.slice(HALF, HALF, dim=1), dv, is_async=True)
                pt = pt_tile.load(s_layout).to(gl.float32)
                dst16 = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
                ds_tile.store(dst16)
                fence_async_shared()
                mbarrier.arrive(s_bar.index(buf), count=1)
                dk = warpgroup_mma(gl.convert_layout(dst16, a_layout), q_tile.slice(HALF, HALF, dim=1), dk,
                                   is_async=True)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            mbarrier.arrive(q_empty.index(s), count=1)
            it += 1
    mbarrier.arrive(end_bar.index(0), count=1)
    mbarrier.wait(end_bar.index(0), 0)  # both warpgroups past their loops: no GEMM reads K or V any more
    k_smem.index(0).slice(WG * HALF, HALF, dim=1).store((dk * scale).to(dtype))
    v_smem.index(0).slice(WG * HALF, HALF, dim=1).store(dv.to(dtype))
    fence_async_shared()
    if WG == 0:
        mbarrier.wait(st_bar.index(0), 0)  # warpgroup 1's halves are in place
        tma.async_copy_shared_to_global(dk_desc, [dk_row + start_n, dk_col], k_smem.index(0))
        tma.async_copy_shared_to_global(dv_desc, [dv_row + start_n, dv_col], v_smem.index(0))
        tma.store_wait(pendings=0)
    else:
        mbarrier.arrive(st_bar.index(0), count=1)


@gluon.jit
def _dkdv_d256_kernel(q_desc, do_desc, K, V, DK, DV, LSE, DELTA,
                      stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                      stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                      stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_lb, stride_lh,
                      H, GROUP, Sq, Sk, qk_scale, scale,
                      HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                      IS_CAUSAL: gl.constexpr, kv_layout: gl.constexpr, p_layout: gl.constexpr,
                      num_warps: gl.constexpr, HOST_KV: gl.constexpr):
    """Grid (cdiv(Sk, BLOCK_N), kv heads, batch). q_desc / do_desc: host descriptors over (rows, row stride) views
    (``_flat_descriptor``); K, V, dK, dV: host descriptors likewise where Sk is a multiple of BLOCK_N (HOST_KV),
    else the tensors, whose (batch, kv head) slices get descriptors made here (a store clips keys >= Sk). LSE and
    DELTA (B, H, Sq) fp32, unit last stride."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    gl.static_assert(HEAD_D % 128 == 0, "each warpgroup's column half a multiple of 64")
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
    pt_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], p_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], p_layout)
    stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    dlt_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    s_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    end_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    st_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    for i in gl.static_range(2):
        mbarrier.init(p_bar.index(i), count=1)
        mbarrier.init(s_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_bar.index(i), count=2)  # (the TMA's expect, the stats' arrival: _dkdv_producer)
        mbarrier.init(q_empty.index(i), count=2)
    mbarrier.init(end_bar.index(0), count=2)
    mbarrier.init(st_bar.index(0), count=1)
    fence_async_shared()
    mbarrier.expect(kv_bar.index(0), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [k_row + start_n, k_col], kv_bar.index(0), k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [v_row + start_n, v_col], kv_bar.index(0), v_smem.index(0))
    j_lo = 0
    if IS_CAUSAL:
        j_lo = start_n // BLOCK_M  # queries before the CTA's first key see none of its keys
    n_qb = gl.cdiv(Sq, BLOCK_M)
    gl.warp_specialize([
        (_split_consumer, (0, q_smem, do_smem, k_smem, v_smem, pt_smem, ds_smem, lse_smem, dlt_smem, kv_bar, q_bar,
                           q_empty, p_bar, s_bar, end_bar, st_bar, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col,
                           GROUP, qk_scale, scale, start_n, j_lo, n_qb, HEAD_D, BLOCK_N, BLOCK_M, STAGES,
                           IS_CAUSAL)),
        (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, k_smem, k_smem,
                          lse_smem, dlt_smem, kv_bar, q_bar, q_empty, kv_bar, stride_qb, stride_qh, stride_qm,
                          stride_dob, stride_doh, stride_dom, LSE, DELTA, None, stride_lb, stride_lh, H, GROUP, Sq,
                          qk_scale, scale, b, hk, start_n, j_lo, n_qb, dk_desc, dv_desc, None, HEAD_D, BLOCK_N,
                          BLOCK_M, STAGES, IS_CAUSAL, False, False)),
        (_split_consumer, (1, q_smem, do_smem, k_smem, v_smem, pt_smem, ds_smem, lse_smem, dlt_smem, kv_bar, q_bar,
                           q_empty, p_bar, s_bar, end_bar, st_bar, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col,
                           GROUP, qk_scale, scale, start_n, j_lo, n_qb, HEAD_D, BLOCK_N, BLOCK_M, STAGES,
                           IS_CAUSAL)),
    ], [1, 4], [24, 240])


def _p_layout(bn: int, bm: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([bn, bm], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def dkdv_d256(do, q, k, v, lse, delta, dk, dv, *, causal: bool, scale: float, config=CONFIG) -> bool:
    """dK, dV into ``dk``, ``dv`` ((B, H, S, 256) fp16 / bf16, TMA-aligned); lse and delta (B, H, Sq) fp32 with a
    unit last stride (delta = rowsum(dO O)). False (nothing launched) where q or do has no host descriptor."""
    from pykernels._kernels import _launch, _tuning
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    bn, bm, stages = config
    ql, kl = smem_layouts(bm, bn, d, q.dtype)
    qd, dod = _flat_descriptor(q, bm, ql), _flat_descriptor(do, bm, ql)
    if qd is None or dod is None:
        return False
    host = None
    if sk % bn == 0:
        host = tuple(_flat_descriptor(t, bn, kl) for t in (k, v, dk, dv))
        host = None if any(x is None for x in host) else host
    _tuning.ensure_allocator()  # (descriptors made on the device)
    _launch.fast(_dkdv_d256_kernel)[(_tuning.cdiv(sk, bn), hkv, batch)](
        qd, dod, *(host or (k, v, dk, dv)), lse, delta, *q.stride()[:3], *do.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], *lse.stride()[:2], hq, hq // hkv, sq, sk,
        scale * LOG2E, scale, HEAD_D=d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=bool(causal),
        kv_layout=kl, p_layout=_p_layout(bn, bm, q.dtype), num_warps=4, HOST_KV=host is not None, maxnreg=MAX_REGS)
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

    fn = _dkdv_d256_kernel
    for causal in (False, True):
        for host_kv in (False, True):
            sig = {}
            for p in fn.params:
                n = p.name
                sig[n] = (desc(bm, ql) if n in ("q_desc", "do_desc") else desc(bn, kl) if host_kv and n in (
                    "K", "V", "DK", "DV") else "*bf16" if n in ("K", "V", "DK", "DV") else "*fp32" if n in (
                    "LSE", "DELTA") else "i64" if n.startswith("stride") else "fp32" if n in ("qk_scale", "scale")
                    else "constexpr" if p.is_constexpr else "i32")
            consts = dict(HEAD_D=d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=causal, kv_layout=kl,
                          p_layout=_p_layout(bn, bm, torch.bfloat16), num_warps=4, HOST_KV=host_kv)
            print(f"bwd-dkdv-d256 cfg{CONFIG} {'causal' if causal else 'full'}{' host-kv' if host_kv else ''}: "
                  f"{ws.compile_report(fn, sig, consts, dict(num_warps=4, maxnreg=MAX_REGS))}", flush=True)


def gpu_check_and_time() -> None:
    """dK / dV against float64 and against the Triton dK/dV kernel's, then graph-replay times (ms): this kernel, the
    Triton backward (and its kernels by the profiler), cuDNN's backward."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from attention_sm90_gluon_ws import graph_ms
    from torch.nn.attention import SDPBackend, sdpa_kernel

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
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        assert dkdv_d256(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=sc)
        qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=sc,
                                                               enable_gqa=h != hkv)
        _, dk_r, dv_r = torch.autograd.grad(ref, (qq, kk, vv), do.double())
        err = [(x.double() - r).abs().max().item() for x, r in ((dk, dk_r), (dv, dv_r), (dk_t, dk_r), (dv_t, dv_r))]
        print(f"check B{b} H{h}/{hkv} Sq{sq} Sk{sk} {'causal' if causal else 'full'}: |dk - ref| {err[0]:.2e} "
              f"|dv - ref| {err[1]:.2e} (Triton {err[2]:.2e} / {err[3]:.2e}); NaN {bool(dk.isnan().any() or dv.isnan().any())}",
              flush=True)
    shapes = [(4, 8, 4096, True), (4, 8, 2048, False), (2, 8, 8192, False), (16, 16, 512, False), (1, 8, 8192, True)]
    for b, h, s, causal in shapes[:3] if "--quick" in sys.argv else shapes:
        q, k, v = (torch.randn(b, h, s, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn_like(q)
        sc = 256 ** -0.5
        o, lse = tri.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=0.0, seed=0)
        delta = (do.float() * o.float()).sum(-1)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        ours = graph_ms(lambda: dkdv_d256(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=sc))
        pair = graph_ms(lambda: tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc, dropout_p=0.0,
                                                  seed=0))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc, dropout_p=0.0, seed=0)
            torch.cuda.synchronize()
        kern = {e.key[:40]: e.device_time_total / 1e3 for e in prof.key_averages() if e.device_time_total > 0}
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=sc)
        try:
            cudnn = graph_ms(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
        except Exception:  # (capture refused: do_bench, host included)  # noqa: BLE001
            from triton.testing import do_bench
            cudnn = do_bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
        gemm4 = 4 * 2 * b * h * s * s * 256 / (2 if causal else 1)
        print(f"B{b} H{h} S{s} D256 {'causal' if causal else 'full'}: this dK/dV {ours:.4f} ms ({gemm4 / ours / 1e9:.0f} "
              f"TFLOP/s of its 4 GEMMs); the Triton backward {pair:.4f} ms, its kernels (ms) {kern}; cuDNN backward "
              f"{cudnn:.4f} ms", flush=True)


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    else:
        gpu_check_and_time()
