"""The C++ LayerNorm's launch settings A/B in one process: programmatic dependent launch (csrc/pdl.cuh,
``PYKERNELS_PDL``, read at every launch, so each graph is captured under its own setting; run361-362), and any other
switch read at every call (``--settings`` names it: the branch next/ln-bulk's ``PYKERNELS_LN_FWD_BULK``,
run363-364). Timed: the forward and forward+backward replayed from CUDA graphs of unrolled calls
(``triton.testing.do_bench_cudagraph``, as benchmarks/layer_norm.py times them), with a ``copy_`` of the forward's
bytes replayed the same way, and a chain as a model runs it: a GEMM (x @ W, cuBLAS) then the LayerNorm of its
output. The settings alternate over ``--rounds``.

One line a case, setting and round: ``SETTING round case fwd_us fwd_%copy fwdbwd_us (bwd_us bwd_%copy) gemm+ln_us``,
the % of the card's copy bandwidth (``common.ceilings()``) over the forward's fewest bytes (benchmarks/layer_norm.py's
count) and over the backward's (four rows of M x N: fwdbwd - fwd; ``--no-chain`` skips the GEMM chain).

Usage (GPU): ``python benchmarks/dev/pdl_ab.py [--rounds 2] [--rep 20] [--settings "PDL=1;PDL=0"] [--dropout 0.1]
[--param-dtype fp32] [--n 768,1024]`` (environment variables without their ``PYKERNELS_`` prefix, ``;`` between
settings and ``,`` between one setting's variables, each set for that setting's measurements only:
``common.env_settings``; ``--n`` keeps the cases of those hidden sizes). The two-warp forward against ln_fwd_kernel
(run366-367): ``--settings "LN_FWD_ROWS=1;LN_FWD_ROWS=0"``; the backward's fused row math against the old form
(run376): ``--settings "LN_BWD_FMA=1;LN_BWD_FMA=0"``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402  (benchmarks/common.py)

import pykernels  # noqa: E402

CASES = [("pre", 16384, 768), ("pre", 16384, 1024), ("pre", 8192, 4096), ("pre", 65536, 768),
         ("post", 16384, 768), ("post", 16384, 1024)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rep", type=int, default=20, help="ms of unrolled calls a graph (do_bench_cudagraph's rep)")
    ap.add_argument("--settings", default="PDL=1;PDL=0")
    ap.add_argument("--dropout", type=float, default=0.0, help="the LayerNorm's dropout_p (default 0)")
    ap.add_argument("--param-dtype", choices=["bf16", "fp32"], default="bf16",
                    help="weight and bias dtype (fp32: autocast's parameters beside bf16 rows)")
    ap.add_argument("--n", default="", help="comma-separated hidden sizes to keep (default: every case)")
    ap.add_argument("--no-chain", action="store_true", help="skip the GEMM + LayerNorm chain")
    args = ap.parse_args(argv)
    settings = common.env_settings(args.settings)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0

    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} pykernels.backends: {pykernels.backends()}")
    copy_tbps = common.ceilings()["copy_TBps"]
    print(f"# copy {copy_tbps:.3f} TB/s")

    def bench(f) -> float:
        return common.graph_us(f, rep=args.rep)

    keep = {int(n) for n in args.n.split(",") if n}
    pdt = torch.float32 if args.param_dtype == "fp32" else torch.bfloat16
    tag = (f" p={args.dropout}" if args.dropout else "") + (" fp32-params" if pdt == torch.float32 else "")
    for variant, M, N in CASES:
        if keep and N not in keep:
            continue
        torch.manual_seed(0)
        x, r = (torch.randn(M, N, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        w = torch.randn(N, device=dev, dtype=pdt, requires_grad=True)
        b = torch.randn(N, device=dev, dtype=pdt, requires_grad=True)
        pre = variant == "pre"
        ups = [torch.randn(M, N, device=dev, dtype=torch.bfloat16) for _ in range(2 if pre else 1)]
        gw = torch.randn(N, N, device=dev, dtype=torch.bfloat16) / N ** 0.5
        fwd_bytes = (4 if pre else 3) * M * N * 2
        # the backward's fewest bytes: s (pre) or x and the residual (post), dy and, pre-LN, the gradient through s;
        # dx (= dresidual); dweight / dbias are O(N)
        bwd_bytes = 4 * M * N * 2

        def ln(a):
            out = pykernels.layer_norm(a, w, b, 1e-5, residual=r, prenorm=pre, dropout_p=args.dropout,
                                       backend="cuda")
            return out if isinstance(out, tuple) else (out,)

        def fwd():
            return ln(x)

        def step():
            o = ln(x)
            return torch.autograd.grad(o, (x, r, w, b), ups[:len(o)])

        xd = x.detach()

        def chain():
            with torch.no_grad():
                return ln(xd @ gw)

        for rnd in range(args.rounds):
            copy_us = common.copy_graph_us(fwd_bytes, rep=args.rep)
            for setting in settings:
                label = common.settings_label(setting)
                with common.env_setting(setting):
                    f = bench(fwd)
                    fb = bench(step)
                    chain_txt = "" if args.no_chain else f"gemm+ln {bench(chain):.2f} us "
                pct = 100 * fwd_bytes / (f * 1e-6) / (copy_tbps * 1e12)
                bwd_pct = 100 * bwd_bytes / ((fb - f) * 1e-6) / (copy_tbps * 1e12)
                print(f"{label}{tag} {rnd} {variant}_{M}x{N} fwd {f:.2f} us {pct:.1f}% fwdbwd {fb:.2f} us "
                      f"(bwd {fb - f:.2f} us {bwd_pct:.1f}%) {chain_txt}(copy same bytes {copy_us:.2f} us)",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
