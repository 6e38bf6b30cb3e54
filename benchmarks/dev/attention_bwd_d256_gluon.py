"""The Hopper (sm_90) dK/dV kernel for head dim 256, in Gluon: the package's ``kernels/attention_sm90_bwd.py``
``_attention_bwd_dkdv_d256_sm90_kernel`` (``DKDV_D256_CONFIGS``' comment has the algorithm); this probe compiles,
checks and times it.

Why. Above D = 128 the attention backward was the Triton FlashAttention-2 pair (0.58-0.73x cuDNN in run474-478's
matrix). The package's other Gluon dK/dV kernel cannot take D = 256: each consumer warpgroup holds its 64 keys' dK
and dV, 2 x 64 x 256 fp32, 256 registers a thread. Its Gluon dQ kernel compiles at D = 256 but its 32-key blocks lost
to Triton's dQ kernel (run478).

History. run480 wrote it with the warpgroups splitting the head dim's columns (each held half of dK's and dV's
columns; P^T and dS^T handed over in bf16; commit 7fc36f1): B4 H8 S4096 causal 1.009 ms against the Triton dK/dV
kernel's 2.157. run481 timed that against the role split (warpgroup 0 all of dV, warpgroup 1 all of dK, P^T handed
over once in fp32), 1.06-1.10x faster at five shapes and dK's error that of the Triton kernel (the column split's
1.0-2.6x): the role split is the package's.

Usage: ``python benchmarks/dev/attention_bwd_d256_gluon.py --compile-only`` (any machine: Triton's ptxas, registers,
spills, shared memory; D = 256 and the staged D = 192, ``D_COLS``); on an sm_90 GPU without arguments (``--quick``: three timed shapes): dK / dV against the
float64 reference and the Triton kernel's, then each shape's time (graph replay) of this kernel, of the package's
whole backward with it and with the Triton pair (and its kernels by the profiler), and cuDNN's backward (do_bench: a
captured cuDNN backward left the generator mid-capture in run480, "Offset increment outside graph capture").
H200 run481 (``attention_bwd_d256_*_run481.txt``).
"""
from __future__ import annotations

import itertools
import os
import sys

import torch

from pykernels._kernels.attention_sm90 import MAX_REGS, smem_layouts
from pykernels._kernels.attention_sm90_bwd import DKDV_D256_CONFIGS, _attention_bwd_dkdv_d256_sm90_kernel, _pt_layout
from pykernels._kernels.attention_sm90_bwd import attention_bwd_dkdv_d256_sm90 as dkdv_d256

CONFIG = DKDV_D256_CONFIGS[256]  # (BLOCK_N keys a CTA, BLOCK_M queries a block, STAGES)


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

    fn = _attention_bwd_dkdv_d256_sm90_kernel
    only = os.environ.get("COMPILE_ONLY_SPLIT")  # "1": the D = 192 column split's compiles only
    for cols, split, causal, host_kv in itertools.product((0, 192), (False, True), (False, True), (False, True)):
        if (split and cols != 192) or (only and not split):
            continue  # (the split, ``SPLIT_D_BWD``: D = 192 only)
        sig = {}
        for p in fn.params:
            n = p.name
            sig[n] = (desc(bm, ql) if n in ("q_desc", "do_desc") else desc(bn, kl) if host_kv and n in (
                "K", "V", "DK", "DV") else "*bf16" if n in ("K", "V", "DK", "DV") else "*fp32" if n in (
                "LSE", "DELTA") else "i64" if n.startswith("stride") else "fp32" if n in ("qk_scale", "scale")
                else "constexpr" if p.is_constexpr else "i32")
        consts = dict(HEAD_D=d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=causal, kv_layout=kl,
                      p_layout=_pt_layout(bn, bm), num_warps=4, HOST_KV=host_kv, D_COLS=cols, D_A=0, D_B=0)
        if split:
            consts.update(D_A=128, D_B=64)
        print(f"bwd-dkdv-d{cols or 256}{' split 128+64' if split else ''} cfg{CONFIG} "
              f"{'causal' if causal else 'full'}{' host-kv' if host_kv else ''}: "
              f"{ws.compile_report(fn, sig, consts, dict(num_warps=4, maxnreg=MAX_REGS))}", flush=True)


def gpu_check_and_time() -> None:
    """dK / dV of the kernel against float64 and against the Triton dK/dV kernel's, then graph-replay times (ms): the
    kernel, the package's backward with it and with the Triton pair (its kernels by the profiler), cuDNN's backward
    (do_bench)."""
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
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        assert dkdv_d256(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=sc)
        err = [(x.double() - r).abs().max().item() for x, r in ((dk, dk_r), (dv, dv_r), (dk_t, dk_r), (dv_t, dv_r))]
        print(f"check B{b} H{h}/{hkv} Sq{sq} Sk{sk} {'causal' if causal else 'full'}: |dk - ref| "
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
        pair = graph_ms(lambda: tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc, dropout_p=0.0,
                                                  seed=0))
        os.environ["PYKERNELS_ATTN_SM90_BWD"] = "dkdv"  # the package's backward with the kernel (Triton's dQ)
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
        print(f"B{b} H{h} S{s} D256 {'causal' if causal else 'full'}: dK/dV {ours:.4f} ms "
              f"({gemm4 / ours / 1e9:.0f} TFLOP/s of its 4 GEMMs); the package's backward with it {whole:.4f} ms "
              f"({1.25 * gemm4 / whole / 1e9:.0f} TFLOP/s, 2.5x the forward's); the Triton backward {pair:.4f} ms, "
              f"its kernels (ms) {kern}; "
              f"cuDNN backward (do_bench) {cudnn:.4f} ms", flush=True)


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    else:
        gpu_check_and_time()
