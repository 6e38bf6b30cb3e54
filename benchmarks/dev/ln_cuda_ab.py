"""Backward time of the CUDA C++ layer_norm (pre-LN, bf16) next to the Triton path's, for an A/B of a
kernel switch read once per process (run it once with ``PYKERNELS_LN_PREFETCH=0`` and once without).

Usage (GPU): ``python benchmarks/dev/ln_cuda_ab.py``. Prints one line per shape: backward us (CUDA graph
replay of one backward, so host time is out) for backend cuda and triton."""
from __future__ import annotations

import os

import torch
from triton.testing import do_bench_cudagraph

import pykernels

SHAPES = ((16384, 768), (16384, 1024), (16384, 2048), (8192, 4096), (4096, 8192), (65536, 768))


def bwd_us(backend: str, m: int, n: int) -> float:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    y, s = pykernels.layer_norm(x, w, b, residual=r, prenorm=True, backend=backend)
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    torch.autograd.backward([y, s], [dy, ds], retain_graph=True)  # warm up outside the graph
    return 1e3 * do_bench_cudagraph(lambda: torch.autograd.backward([y, s], [dy, ds], retain_graph=True))


def main() -> None:
    print(torch.cuda.get_device_name(), "PYKERNELS_LN_PREFETCH =", os.environ.get("PYKERNELS_LN_PREFETCH", "1"))
    for m, n in SHAPES:
        cu, tr = bwd_us("cuda", m, n), bwd_us("triton", m, n)
        floor = 4 * m * n * 2 / 2.9e12 * 1e6  # reads dy, ds, s; writes dx (bf16), at ~2.9 TB/s copy
        print(f"{m:6d} x {n:5d}: cuda {cu:7.1f} us  triton {tr:7.1f} us  (4-tensor floor ~{floor:.0f} us)")


if __name__ == "__main__":
    main()
