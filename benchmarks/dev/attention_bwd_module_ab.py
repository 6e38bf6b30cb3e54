"""A/B of two versions of ``kernels/attention_sm90_bwd.py`` in one process: the whole backward
(``attention.attention_bwd``, what the op's backward runs) with the installed module, then with the file given
by ``--old`` (e.g. ``git show HEAD:kernels/attention_sm90_bwd.py > /tmp/old.py``; run106 compared the fix of the ds_bar bug so), alternating rounds, GPU time
by CUDA-graph replay, gradients compared. The file is loaded as a module of the package, so its relative
imports resolve.

Usage (GPU): ``python benchmarks/dev/attention_bwd_module_ab.py --old /tmp/old.py [--cases s4096c,s8192c]``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_sm90_gluon_ws import graph_ms  # noqa: E402
from attention_ncu import CASES  # noqa: E402

import pykernels._kernels as pkg  # noqa: E402
from pykernels._kernels import attention as katt  # noqa: E402
from pykernels._kernels import attention_sm90_bwd  # noqa: E402,F401  (makes it the package's attribute)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--cases", default="s1024c,s4096c,s8192c,s4096,s8192")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return
    spec = importlib.util.spec_from_file_location("pykernels._kernels._old_attention_sm90_bwd", args.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    new = pkg.attention_sm90_bwd
    mods = {"new": new, "old": old}
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: whole backward, new vs old "
          f"attention_sm90_bwd, graph replay, best of {args.rounds} rounds alternating; TFLOP/s (5-GEMM count)")
    try:
        for name in args.cases.split(","):
            b, h, s, d, causal = CASES[name]
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            scale = d ** -0.5
            o, lse = katt.attention_fwd(q, k, v, None, causal=causal, scale=scale, dropout_p=0.0, seed=0)
            flops = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1.0)

            def fn():
                return katt.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=scale, dropout_p=0.0, seed=0)
            grads, best = {}, {}
            for _ in range(args.rounds):
                for tag, mod in mods.items():
                    pkg.attention_sm90_bwd = mod
                    grads[tag] = fn()
                    best[tag] = min(best.get(tag, 1e9), graph_ms(fn))
            err = max((x.float() - y.float()).abs().max().item() for x, y in zip(grads["new"], grads["old"]))
            print(f"{name:8s} B{b} H{h} S{s} D{d} {'causal' if causal else 'full'}: new {best['new'] * 1e3:8.1f} us "
                  f"({flops / best['new'] * 1e-9:5.1f}) old {best['old'] * 1e3:8.1f} us ({flops / best['old'] * 1e-9:5.1f})"
                  f" speed-up {best['old'] / best['new']:.3f}x, max |new - old| {err:.1e}", flush=True)
    finally:
        pkg.attention_sm90_bwd = new


if __name__ == "__main__":
    main()
