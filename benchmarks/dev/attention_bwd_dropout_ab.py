"""The attention backward with dropout at D = 128 on Hopper, kernel against kernel in one process (GPU): the Gluon
dK/dV kernel drawing the mask itself (``attention_sm90_bwd``'s HAS_DROPOUT, fused with dQ or beside Triton's dQ
kernel as the speed rule picks), with its draws before the S^T / dP^T wait (``DROPOUT_EARLY``) or after P^T, its
keep bits by compares or by a carry chain (``DROPOUT_CARRY``), its transposes by rotates (``DROPOUT_ROT``), and
with ``--base FILE`` another version of the module (e.g. ``git show HEAD:kernels/attention_sm90_bwd.py``); the
Triton kernels (``DROPOUT_KERNELS`` off); the C++ op's backward; cuDNN's backward with dropout; and the Gluon
backward without dropout (the dropout's cost). Every backward takes the C++ forward's output, lse and seed (the same
mask: each row says how far its dK / dV / dQ are from the Triton kernels'); cuDNN's draws its own mask.

Usage (GPU): ``python benchmarks/dev/attention_bwd_dropout_ab.py [--p 0.1] [--rep 20]``. One line a shape and
variant (gluon-early: the draws before the wait, keep bits by compares; gluon-carry: by the carry chain, the
default since run451; gluon-rot: with the rotate transposes; gluon-late-carry / gluon-late-rot: the draws after
P^T; gluon-base: ``--base``'s module, its defaults): ``case variant us TFLOP/s max|diff|`` (us: one backward's
CUDA-graph replay, ``common.graph_us``, ``--rep`` ms of replays; run447 and run451 timed the median of 20 / 30
replays of a 5-call graph of the script's own; FLOPs 2.5x the forward's 4 B H S^2 D, half of it causal).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import graph_us  # noqa: E402  (benchmarks/common.py)

CASES = (("causal_2k", 4, 16, 2048, True), ("full_1k", 8, 16, 1024, False), ("full_4k", 4, 16, 4096, False),
         ("causal_4k", 4, 16, 4096, True), ("causal_8k_b1", 1, 16, 8192, True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--rep", type=int, default=20, help="ms of replays a variant (do_bench_cudagraph)")
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES))
    ap.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--base", default="", help="a file of kernels/attention_sm90_bwd.py to time as gluon-base")
    args = ap.parse_args()
    from pykernels._backend import cuda_ops_ready
    assert cuda_ops_ready(), "needs the C++ extension (pykernels._C)"
    from pykernels._kernels import attention as tri
    from pykernels._kernels import attention_sm90_bwd as kb
    pkg = sys.modules["pykernels._kernels"]
    base = None
    if args.base:  # (loaded as a sibling module: its relative imports resolve in the package)
        import importlib.util
        spec = importlib.util.spec_from_file_location("pykernels._kernels.attention_sm90_bwd_base", args.base)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} p {args.p} "
          f"commit {os.environ.get('PYKERNELS_COMMIT', '?')}", flush=True)
    want = set(args.cases.split(","))
    defaults = kb.DROPOUT_EARLY, kb.DROPOUT_KERNELS, kb.DROPOUT_CARRY, kb.DROPOUT_ROT
    for name, b, h, s, causal in CASES:
        if name not in want:
            continue
        d, sc = 128, 128 ** -0.5
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn_like(q)
        o, lse, seed = torch.ops.pykernels_cuda.attention_fwd(q, k, v, None, None, None, s, s, args.p, causal, sc)
        o0, lse0, _ = torch.ops.pykernels_cuda.attention_fwd(q, k, v, None, None, None, s, s, 0.0, causal, sc)
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)

        def gluon(early: bool, on: bool = True, p: float = args.p, carry: bool = False, rot: bool = False, mod=None):
            def run():
                if mod is not None:  # (sm90_backward imports the module from the package at each call)
                    pkg.attention_sm90_bwd = mod
                    try:
                        return tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc, dropout_p=p,
                                                 seed=seed)
                    finally:
                        pkg.attention_sm90_bwd = kb
                kb.DROPOUT_EARLY, kb.DROPOUT_KERNELS, kb.DROPOUT_CARRY, kb.DROPOUT_ROT = early, on, carry, rot
                return tri.attention_bwd(do, q, k, v, o if p else o0, lse if p else lse0, None, causal=causal,
                                         scale=sc, dropout_p=p, seed=seed)
            return run

        def cpp():
            return torch.ops.pykernels_cuda.attention_bwd(do, q, k, v, o, lse, None, None, None, s, s, args.p, causal,
                                                          sc, seed, False)

        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out_c = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, dropout_p=args.p, is_causal=causal,
                                                                     scale=sc)

        def cudnn():
            return torch.autograd.grad(out_c, (qq, kk, vv), do, retain_graph=True)

        ref = gluon(True, on=False)()  # the Triton kernels with the same mask
        variants = (("gluon-early", gluon(True)), ("gluon-carry", gluon(True, carry=True)),
                    ("gluon-rot", gluon(True, carry=True, rot=True)), ("gluon-late-carry", gluon(False, carry=True)),
                    ("gluon-late-rot", gluon(False, carry=True, rot=True)),
                    *((("gluon-base", gluon(True, mod=base)),) if base is not None else ()),
                    ("gluon-late", gluon(False)), ("triton", gluon(True, on=False)), ("cpp", cpp), ("cudnn", cudnn),
                    ("gluon-nodrop", gluon(True, p=0.0)))
        for vname, fn in variants:
            if args.variants and vname not in args.variants.split(","):
                continue
            try:
                got = fn()
                diff = (max((x.float() - y.float()).abs().max().item() for x, y in zip(got, ref))
                        if vname not in ("cudnn", "gluon-nodrop") else float("nan"))
                us = graph_us(fn, rep=args.rep)
                print(f"{name} {vname} {us:.1f} {flops / us / 1e6:.1f} {diff:.2e}", flush=True)
            except Exception as e:  # a probe: report and go on
                print(f"{name} {vname} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
        kb.DROPOUT_EARLY, kb.DROPOUT_KERNELS, kb.DROPOUT_CARRY, kb.DROPOUT_ROT = defaults


if __name__ == "__main__":
    main()
