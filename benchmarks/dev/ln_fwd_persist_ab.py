"""The C++ LayerNorm forward alone (torch.ops.pykernels_cuda.layer_norm, no autograd), for an A/B of the persistent
forward of narrow warp rows (csrc/layer_norm.cu ln_fwd_persist_kernel) against the one-row-a-warp grid: run it once
as is and once with ``PYKERNELS_LN_FWD_PERSIST=0`` (read once per process).

Usage (GPU): ``python benchmarks/dev/ln_fwd_persist_ab.py [--dump out.pt]``. Prints one line per case: forward us
(CUDA graph replay: host time out) and the bytes it moves (x, residual in; y, s out; mean, rstd) against a device
copy's bandwidth measured here. ``--dump``: the outputs of a fixed set of cases (inputs and dropout seeds drawn from
fixed seeds), saved for a bitwise comparison of the two runs (``--compare a.pt b.pt``)."""
from __future__ import annotations

import argparse
import os

import torch
from triton.testing import do_bench_cudagraph

import pykernels._C  # noqa: F401  (registers torch.ops.pykernels_cuda)

# (M, N, dtype, parameter dtype, prenorm, dropout_p, residual)
BENCH = [(16384, 768, torch.bfloat16, torch.bfloat16, False, 0.0, True),
         (16384, 768, torch.bfloat16, torch.float32, False, 0.0, True),
         (16384, 768, torch.bfloat16, torch.bfloat16, True, 0.0, True),
         (16384, 768, torch.bfloat16, torch.float32, True, 0.1, True),
         (16384, 768, torch.bfloat16, torch.bfloat16, False, 0.1, True),
         (65536, 768, torch.bfloat16, torch.float32, False, 0.0, True),
         (16384, 512, torch.bfloat16, torch.bfloat16, False, 0.0, True),
         (16384, 256, torch.bfloat16, torch.bfloat16, False, 0.0, True),
         (16384, 384, torch.float32, torch.float32, False, 0.0, True),
         (16384, 1024, torch.bfloat16, torch.bfloat16, False, 0.0, True)]  # (4 packs a lane: never persistent)

# (M, N, dtype, parameter dtype, prenorm, dropout_p, residual, rms): rows below the grid, ragged tails, 1-3 packs
DUMP = [(3, 768, torch.bfloat16, torch.bfloat16, True, 0.1, True, False),
        (20003, 768, torch.bfloat16, torch.bfloat16, False, 0.1, True, False),
        (20003, 768, torch.bfloat16, torch.float32, True, 0.1, True, False),
        (16384, 768, torch.bfloat16, torch.float32, False, 0.0, True, False),
        (9001, 520, torch.float16, torch.float16, True, 0.0, True, True),
        (40001, 256, torch.bfloat16, torch.bfloat16, False, 0.1, False, False),
        (5003, 384, torch.float32, torch.float32, False, 0.1, True, False),
        (5003, 136, torch.float32, torch.float32, True, 0.0, True, False),
        (1, 8, torch.bfloat16, torch.bfloat16, False, 0.1, True, True),
        (2113, 760, torch.bfloat16, torch.float32, True, 0.2, True, True)]


def _inputs(m, n, dt, pdt, residual, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, n, device="cuda", dtype=dt, generator=g)
    r = torch.randn(m, n, device="cuda", dtype=dt, generator=g) if residual else None
    w = 1 + 0.5 * torch.randn(n, device="cuda", dtype=pdt, generator=g)
    b = 0.5 * torch.randn(n, device="cuda", dtype=pdt, generator=g)
    return x, r, w, b


def copy_bandwidth() -> float:
    a = torch.empty(1 << 28, device="cuda", dtype=torch.uint8)
    c = torch.empty_like(a)
    t = do_bench_cudagraph(lambda: c.copy_(a)) * 1e-3
    return 2 * a.numel() / t


def bench(copy_bw: float) -> None:
    for m, n, dt, pdt, pre, p, residual in BENCH:
        x, r, w, b = _inputs(m, n, dt, pdt, residual, 0)

        seed = torch.tensor([1234], device="cuda") if p > 0 else None  # (the op reads it from device memory)

        def f():
            torch.ops.pykernels_cuda.layer_norm(x, w, b, r, 1e-5, p, seed, pre, False)

        f()
        t = do_bench_cudagraph(f) * 1e-3
        e = x.element_size()
        moved = m * n * e * (1 + (r is not None) + 1 + pre) + 8 * m + 2 * n * torch.finfo(pdt).bits // 8
        print(f"{m:6d} x {n:4d} {str(dt)[6:]:8s} w {str(pdt)[6:]:8s} {'pre ' if pre else 'post'} p={p:.1f}: "
              f"{t * 1e6:7.2f} us  {moved / t / 1e12:5.2f} TB/s  {100 * moved / t / copy_bw:5.1f}% of copy")


def dump(path: str) -> None:
    outs = []
    for i, (m, n, dt, pdt, pre, p, residual, rms) in enumerate(DUMP):
        x, r, w, b = _inputs(m, n, dt, pdt, residual, 100 + i)
        torch.manual_seed(1000 + i)  # the op's dropout seed (drawn on the device from this state)
        outs.append([t.cpu() for t in torch.ops.pykernels_cuda.layer_norm_fwd(x, w, b, r, 1e-5, p, pre, rms)])
        # the fp64 reference, where no dropout (its mask is the Triton kernels'; tests/test_layer_norm.py checks it)
        if p == 0.0:
            s = x.double() + (r.double() if r is not None else 0)
            mu = torch.zeros_like(s[:, :1]) if rms else s.mean(1, keepdim=True)
            rstd = ((s - mu) ** 2).mean(1, keepdim=True).add(1e-5).rsqrt()
            y = (s - mu) * rstd * w.double() + b.double()
            err = (outs[-1][0].double().cuda() - y).abs().max().item()
            tol = 1e-5 * 4 if dt == torch.float32 else 0.05
            print(f"dump case {i} ({m} x {n}): max |y - fp64 ref| = {err:.3g} {'ok' if err < tol else 'TOO LARGE'}")
    torch.save(outs, path)


def compare(a: str, b: str) -> None:
    bad = 0
    for i, (ta, tb) in enumerate(zip(torch.load(a), torch.load(b))):
        for name, u, v in zip(["y", "s", "mean", "rstd", "seed"], ta, tb):
            if not torch.equal(u, v):
                bad += 1
                print(f"case {i} {DUMP[i][:2]}: {name} DIFFERS")
    print("compare:", "all outputs bitwise equal" if not bad else f"{bad} outputs differ")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    print(torch.cuda.get_device_name(), "PYKERNELS_LN_FWD_PERSIST =", os.environ.get("PYKERNELS_LN_FWD_PERSIST", "1"))
    if args.dump:
        dump(args.dump)
    if not args.no_bench:
        bw = copy_bandwidth()
        print(f"device copy: {bw / 1e12:.2f} TB/s")
        bench(bw)


if __name__ == "__main__":
    main()
