"""The Triton attention backward with dropout, its dK/dV kernel's keep bits by inline PTX (``attention.PTX_DROPOUT``)
against ``dropout_keep``'s draws, in one process (GPU; no C++ extension needed): the whole backward's CUDA-graph
replay (``common.graph_us``) after the Triton forward with the same seed, and the largest gradient difference between
the two (the same mask: one bf16 unit at the gradients' size or less). D = 128 cases run the Triton kernels
(``attention_sm90_bwd.DROPOUT_KERNELS`` off), not the Gluon ones.

Usage (GPU): ``python benchmarks/dev/attention_bwd_triton_dropout_ab.py [--p 0.1] [--rep 30] [--cases ...]``. One
line a case: ``case ptx_us dropout_keep_us speed-up max|diff|``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import graph_us  # noqa: E402  (benchmarks/common.py)

CASES = {"bert": (32, 12, 512, 64, False), "gpt2": (8, 12, 1024, 64, True), "d64_s2k_causal": (4, 16, 2048, 64, True),
         "d128_causal_2k": (4, 16, 2048, 128, True), "d128_full_1k": (8, 16, 1024, 128, False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--rep", type=int, default=30, help="ms of replays a variant (do_bench_cudagraph)")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    from pykernels._kernels import attention as tri
    from pykernels._kernels import attention_sm90_bwd as kb
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

        def run(ptx: bool):
            def f():
                tri.PTX_DROPOUT = ptx
                return tri.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=sc, dropout_p=args.p,
                                         seed=seed)
            return f
        got, ref = run(True)(), run(False)()
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(got, ref))
        t_ptx, t_old = graph_us(run(True), rep=args.rep), graph_us(run(False), rep=args.rep)
        tri.PTX_DROPOUT = True
        print(f"{name} {t_ptx:.1f} {t_old:.1f} {t_old / t_ptx:.3f}x {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
