"""The C++ LayerNorm backward's kernels over a sweep of row counts, by the profiler's kernel records (each kernel's
own GPU time, no host gaps): it separates the backward's per-row cost from its fixed cost (ramp, tail, the
dweight / dbias reduction) as time = fixed + rows x per-row.

Usage (GPU): ``python benchmarks/dev/ln_bwd_sweep.py [--graph] [--n 768] [--rows 2048,4096,...] [--settings "LN_BWD_FMA=1;LN_BWD_FMA=0"]``
(environment variables without their ``PYKERNELS_`` prefix, read at every call; default: none set). One line a setting, variant, row
count and kernel: its mean time a call and, for ln_bwd_kernel, the % of the card's copy bandwidth over the backward's
fewest bytes (four rows of M x N bf16).

``--graph``: instead, the backward op alone (``pykernels_cuda::layer_norm_bwd`` on one forward's saved tensors) replayed
from a CUDA graph, with the weight and bias (dweight / dbias: the partial sums and their reduction) and without (no
partial sums, no reduction kernel; the row math then takes w = 1), beside the forward op and a copy of the backward's
bytes, and each column's least-squares line over the row counts: its fixed us and its per-row rate in TB/s over four
rows of M x N bf16 (the post-LN forward moves three, so its rate reads 4/3 high). H200 run383-385: with dweight / dbias
8-9 us fixed at N = 768-1024 before the block sums in slots (4.3-5.3 since), 27 us at N = 4096; without, 0.2-2.7 us.

Under programmatic dependent launch a kernel's profiler time starts when its first block is resident: the dweight /
dbias reduction (``ln_partial_sum_kernel``) starts when the first backward block exits, so its time is its own work
plus how far apart the SMs finish the backward (run374-375: 4-12 us at 16384-65536 rows, about 2 us of its own).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402  (benchmarks/common.py)

import pykernels  # noqa: E402
from ln_dropout_kernels import mean_kernel_us  # noqa: E402  (benchmarks/dev, this script's directory)


def kernel_us(m: int, n: int, prenorm: bool, iters: int) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    ups = [torch.randn_like(x) for _ in range(2)]

    def step():
        out = pykernels.layer_norm(x, w, b, residual=r, prenorm=prenorm, backend="cuda")
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(outs, (x, r, w, b), ups[:len(outs)])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return mean_kernel_us(step, iters, r"ln_\w+_kernel(<[^(]*>)?", 70)


def graph_us(m: int, n: int, prenorm: bool, rep: int) -> dict[str, float]:
    """The backward op alone in graph replay (us): with weight and bias, without, the forward op (the same four rows
    of bytes: it reads x and r and writes y and s pre-LN), and a copy of those bytes."""
    import pykernels._C  # noqa: F401  (registers torch.ops.pykernels_cuda; pykernels loads it lazily)
    g = torch.Generator(device="cuda").manual_seed(0)
    x, r, dy, ds = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    w, b = (torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    op = torch.ops.pykernels_cuda
    _, s, mean, rstd, seed = op.layer_norm_fwd(x, w, b, r, 1e-5, 0.0, prenorm, False)
    a, res = (s, None) if prenorm else (x, r)

    def bwd(wb):
        return op.layer_norm_bwd(dy, ds if prenorm else None, a, res, w if wb else None, b if wb else None, mean,
                                 rstd, seed, 0.0, prenorm, False)

    def bench(f) -> float:
        return common.graph_us(f, rep=rep)

    return {"bwd": bench(lambda: bwd(True)), "bwd_no_wb": bench(lambda: bwd(False)),
            "fwd": bench(lambda: op.layer_norm_fwd(x, w, b, r, 1e-5, 0.0, prenorm, False)),
            "copy": common.copy_graph_us(4 * m * n * 2, rep=rep)}


def fit(ms: list[int], us: list[float], n: int) -> str:
    """Least squares us = fixed + rows x per-row: the fixed us, and the per-row rate over four M x N bf16 rows."""
    k = len(ms)
    mx, my = sum(ms) / k, sum(us) / k
    slope = sum((a - mx) * (b - my) for a, b in zip(ms, us)) / sum((a - mx) ** 2 for a in ms)
    return f"fixed {my - slope * mx:6.2f} us, {4 * n * 2 / (slope * 1e-6) / 1e12:5.2f} TB/s a row"


def sweep(args, one: str, copy_tbps: float) -> None:
    """Both variants' rows under one setting, labelled ``one`` (``--graph``: graph-replay times and their fits; else
    kernel times)."""
    for prenorm in (True, False):
        if args.graph:
            ms = [int(v) for v in args.rows.split(",")]
            cols: dict[str, list[float]] = {}
            for m in ms:
                t = graph_us(m, args.n, prenorm, args.rep)
                print(f"{one} {'pre' if prenorm else 'post'} {m}x{args.n} graph " +
                      " ".join(f"{k} {v:.2f} us" for k, v in t.items()), flush=True)
                for k, v in t.items():
                    cols.setdefault(k, []).append(v)
            if len(ms) > 1:
                for k, v in cols.items():
                    print(f"{one} {'pre' if prenorm else 'post'} N={args.n} fit {k}: {fit(ms, v, args.n)}")
            continue
        for m in (int(v) for v in args.rows.split(",")):
            for name, us in sorted(kernel_us(m, args.n, prenorm, args.iters).items()):
                extra = ""
                if name.startswith("ln_bwd_kernel"):
                    extra = f" {100 * 4 * m * args.n * 2 / (us * 1e-6) / (copy_tbps * 1e12):5.1f}%"
                print(f"{one} {'pre' if prenorm else 'post'} {m}x{args.n} {name} {us:.2f} us{extra}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=768)
    ap.add_argument("--rows", default="2048,4096,8192,16384,32768,65536")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--settings", default="", help="';'-separated settings, each NAME=VALUE[,NAME=VALUE]")
    ap.add_argument("--graph", action="store_true", help="the backward op alone in graph replay, and the fits")
    ap.add_argument("--rep", type=int, default=20, help="--graph: ms of unrolled calls a graph")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    copy_tbps = common.ceilings()["copy_TBps"]
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} copy {copy_tbps:.3f} TB/s")
    for setting in common.env_settings(args.settings):
        with common.env_setting(setting):
            sweep(args, common.settings_label(setting), copy_tbps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
