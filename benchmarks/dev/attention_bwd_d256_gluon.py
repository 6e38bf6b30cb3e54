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

Usage: ``python benchmarks/dev/attention_bwd_d256_gluon.py --compile-only`` (any machine: Triton's ptxas, registers,
spills, shared memory); on an sm_90 GPU without arguments (``--quick``: three timed shapes): dK / dV against the
float64 reference and the Triton
kernel's, then each shape's time (graph replay) of this kernel, of the Triton backward and its kernels (profiler),
and cuDNN's backward. H200 run480 (``attention_bwd_d256_split_*_run480.txt``): the checks passed, B4 H8 S4096 causal
1.009 ms against the Triton dK/dV kernel's 2.157 (the next shape's set-up failed after cuDNN's graph capture:
"Offset increment outside graph capture"; cuDNN is now timed by do_bench, not captured).
"""
from __future__ import annotations

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
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        assert dkdv_d256(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=sc)
        qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=sc,
                                                               enable_gqa=h != hkv)
        _, dk_r, dv_r = torch.autograd.grad(ref, (qq, kk, vv), do.double())
        err = [(x.double() - r).abs().max().item() for x, r in ((dk, dk_r), (dv, dv_r), (dk_t, dk_r), (dv_t, dv_r))]
        print(f"check B{b} H{h}/{hkv} Sq{sq} Sk{sk} {'causal' if causal else 'full'}: |dk - ref| {err[0]:.2e} "
              f"|dv - ref| {err[1]:.2e} (Triton {err[2]:.2e} / {err[3]:.2e}); "
              f"NaN {bool(dk.isnan().any() or dv.isnan().any())}",
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
        # (do_bench, host included: run480's capture of cuDNN's backward left the generator mid-capture)
        cudnn = do_bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
        gemm4 = 4 * 2 * b * h * s * s * 256 / (2 if causal else 1)
        print(f"B{b} H{h} S{s} D256 {'causal' if causal else 'full'}: this dK/dV {ours:.4f} ms "
              f"({gemm4 / ours / 1e9:.0f} "
              f"TFLOP/s of its 4 GEMMs); the Triton backward {pair:.4f} ms, its kernels (ms) {kern}; cuDNN backward "
              f"(do_bench) {cudnn:.4f} ms", flush=True)


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    else:
        gpu_check_and_time()
