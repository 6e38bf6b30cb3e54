"""The Triton attention backward with dropout: its kernels' keep bits by inline PTX (``attention.PTX_DROPOUT``: the
dK/dV kernel's octet draws and, since the seventy-fifth session, the dQ kernel's quad draws) against ``dropout_keep``'s
draws, in one process (GPU; no C++ extension needed): the whole backward's CUDA-graph replay (``common.graph_us``)
after the Triton forward with the same seed, and the largest gradient difference between the two (the same mask:
0, the same arithmetic). D = 128 cases run the Triton kernels (``attention_sm90_bwd.DROPOUT_KERNELS`` off), not the
Gluon ones.

Usage (GPU): ``python benchmarks/dev/attention_bwd_triton_dropout_ab.py [--p 0.1] [--rep 30] [--cases ...]
[--base FILE] [--sweep]``. One line a case: ``case ptx_us dropout_keep_us speed-up max|diff|``, then with ``--base``
(another version of kernels/attention.py, e.g. ``git show HEAD~3:kernels/attention.py``, loaded beside)
``case base base_us ptx/base``, the PTX draws without the keep buffer (``KEEP_BUFFER_MB`` 0: both kernels draw;
``case nobuf us nobuf/ptx max|diff|``), the keep bits stored by the forward and loaded by both backward kernels
(``case stored bwd us ptx/stored max|diff| fwd us against us max|diff| fwd+bwd speed-up``), the backward without
dropout (``case nodrop us``), and with ``--sweep`` each dQ and
dK/dV config of the kernels' tables for the case's head-dim tier, pinned one at a time (the other kernel at its
default; ``fwd``: the forward alone): ``case dq|dkdv|fwd BMxBNxWxS us``; and the forward with dropout, PTX against
``dropout_keep`` (``case fwd ptx_us dropout_keep_us speed-up max|diff|``).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import graph_us  # noqa: E402  (benchmarks/common.py)

CASES = {"bert": (32, 12, 512, 64, False), "gpt2": (8, 12, 1024, 64, True), "d64_s2k_causal": (4, 16, 2048, 64, True),
         "d128_causal_2k": (4, 16, 2048, 128, True), "d128_full_1k": (8, 16, 1024, 128, False)}


# (the table each kernel takes with dropout by PTX)
SWEEP = {"dq": "dq_dropout_ptx", "dkdv": "dkdv_dropout_ptx", "fwd": "fwd_short"}


def _pinned(tri, kind: str, tier: int, cfg):
    """Context: ``kind``'s dropout table at ``tier`` is just ``cfg`` (its autotuner's choices forgotten before and
    after)."""
    import contextlib

    from pykernels._kernels import _launch

    @contextlib.contextmanager
    def ctx():
        table = tri._TABLE[SWEEP[kind]]
        old = table[tier]
        kern = {"dq": tri._attention_bwd_dq_kernel, "dkdv": tri._attention_bwd_dkdv_kernel,
                "fwd": tri._attention_fwd_kernel}[kind]
        table[tier] = [cfg]
        kern.cache.clear()
        _launch.fast(kern).cache.clear()  # (the fast launcher keeps each key's compiled kernel too)
        try:
            yield
        finally:
            table[tier] = old
            kern.cache.clear()
            _launch.fast(kern).cache.clear()
    return ctx()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--rep", type=int, default=30, help="ms of replays a variant (do_bench_cudagraph)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--base", default="", help="a file of kernels/attention.py to time beside (loaded as a sibling)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--kernels", action="store_true", help="each kernel's time in the PTX backward (profiler)")
    args = ap.parse_args()
    from pykernels._kernels import attention as tri
    from pykernels._kernels import attention_sm90_bwd as kb
    base = None
    if args.base:  # (loaded as a sibling module: its relative imports resolve in the package)
        spec = importlib.util.spec_from_file_location("pykernels._kernels.attention_base", args.base)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} p {args.p} "
          f"commit {os.environ.get('PYKERNELS_COMMIT', '?')}", flush=True)
    kb.DROPOUT_KERNELS = False  # (the D = 128 cases: the Triton kernels, not the Gluon dK/dV kernel)
    for name in args.cases.split(","):
        b, h, s, d, causal = CASES[name]
        sc = d ** -0.5
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn_like(q)
        seed = torch.tensor([12345], dtype=torch.int64, device="cuda")  # (on the device: nothing copied in a capture)
        o, lse = tri.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=args.p, seed=seed)

        def run(ptx: bool, mod=tri, p=args.p):
            def f():
                mod.PTX_DROPOUT = ptx
                return mod.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc, dropout_p=p, seed=seed)
            return f
        got, ref = run(True)(), run(False)()
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(got, ref))
        t_ptx, t_old = graph_us(run(True), rep=args.rep), graph_us(run(False), rep=args.rep)
        tri.PTX_DROPOUT = True
        print(f"{name} {t_ptx:.1f} {t_old:.1f} {t_old / t_ptx:.3f}x {diff:.2e}", flush=True)
        keep_mb, tri.KEEP_BUFFER_MB = tri.KEEP_BUFFER_MB, 0  # (the PTX draws in both kernels: no keep buffer)
        try:
            ngot = run(True)()
            ndiff = max((x.float() - y.float()).abs().max().item() for x, y in zip(got, ngot))
            t_nobuf = graph_us(run(True), rep=args.rep)
        finally:
            tri.KEEP_BUFFER_MB = keep_mb
        print(f"{name} nobuf {t_nobuf:.1f} {t_nobuf / t_ptx:.3f}x {ndiff:.2e}", flush=True)
        # the keep bits stored by the forward (``attention_fwd``'s ``keep``), loaded by both backward kernels
        kbuf = tri.keep_buffer(b, h, s, s, q.device)
        fwd_store = lambda: tri.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=args.p,  # noqa: E731
                                              seed=seed, keep=kbuf)
        sdiff_o = (fwd_store()[0].float() - o.float()).abs().max().item()
        stored = lambda: tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc,  # noqa: E731
                                           dropout_p=args.p, seed=seed, keep=kbuf)
        sdiff = max((x.float() - y.float()).abs().max().item() for x, y in zip(got, stored()))
        t_stored, t_fstore = graph_us(stored, rep=args.rep), graph_us(fwd_store, rep=args.rep)
        t_fptx = graph_us(lambda: tri.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=args.p,
                                                    seed=seed), rep=args.rep)
        print(f"{name} stored bwd {t_stored:.1f} {t_ptx / t_stored:.3f}x {sdiff:.2e} fwd {t_fstore:.1f} against "
              f"{t_fptx:.1f} {sdiff_o:.2e} fwd+bwd {(t_fptx + t_ptx) / (t_fstore + t_stored):.3f}x", flush=True)
        if base is not None:
            bgot = run(True, base)()
            bdiff = max((x.float() - y.float()).abs().max().item() for x, y in zip(got, bgot))
            t_base = graph_us(run(True, base), rep=args.rep)
            print(f"{name} base {t_base:.1f} {t_base / t_ptx:.3f}x {bdiff:.2e}", flush=True)
        print(f"{name} nodrop {graph_us(run(True, p=0.0), rep=args.rep):.1f}", flush=True)
        if args.kernels:
            from common import gpu_kernels_us
            for p_ in (args.p, 0.0):
                one = run(True, p=p_)
                for us, kname in gpu_kernels_us(lambda: [one() for _ in range(10)], 10):
                    print(f"{name} kernel p={p_} {us:.1f} {kname[:80]}", flush=True)
        def fwd(ptx: bool):
            def f():
                tri.PTX_DROPOUT = ptx
                return tri.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=args.p, seed=seed)
            return f
        fdiff = (fwd(True)()[0].float() - fwd(False)()[0].float()).abs().max().item()
        t_fp, t_fo = graph_us(fwd(True), rep=args.rep), graph_us(fwd(False), rep=args.rep)
        tri.PTX_DROPOUT = True
        print(f"{name} fwd {t_fp:.1f} {t_fo:.1f} {t_fo / t_fp:.3f}x {fdiff:.2e}", flush=True)
        if args.sweep:
            tier = 64 if d <= 64 else 128
            for kind in ("dq", "dkdv", "fwd"):
                main_table = tri._TABLE["fwd" if kind == "fwd" else kind][tier]
                for cfg in dict.fromkeys(tri._TABLE[SWEEP[kind]][tier] + main_table):
                    with _pinned(tri, kind, tier, cfg):
                        try:
                            t = graph_us(fwd(True) if kind == "fwd" else run(True), rep=args.rep)
                        except Exception as e:  # (a config the case cannot take)
                            print(f"{name} {kind} {'x'.join(map(str, cfg))} failed: {str(e).splitlines()[0][:120]}",
                                  flush=True)
                            continue
                    print(f"{name} {kind} {'x'.join(map(str, cfg))} {t:.1f}", flush=True)


if __name__ == "__main__":
    main()
