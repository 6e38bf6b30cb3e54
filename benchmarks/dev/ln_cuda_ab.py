"""Backward time of the CUDA C++ layer_norm (pre-LN, bf16) next to the Triton path's, for an A/B of a
kernel switch read once per process (run it once with ``PYKERNELS_LN_PREFETCH=0`` and once without).

Usage (GPU): ``python benchmarks/dev/ln_cuda_ab.py``. Prints one line per shape: forward+backward us (CUDA
graph replay, so host time is out; the forward is captured too, so that the backward runs on the capture
stream) for backend cuda and triton."""
from __future__ import annotations

import os

import torch
from triton.testing import do_bench_cudagraph

import pykernels

SHAPES = ((16384, 768), (16384, 1024), (16384, 2048), (8192, 4096), (4096, 8192), (65536, 768))


def fwd_bwd_us(backend: str, m: int, n: int) -> float:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    dy, ds = torch.randn_like(x), torch.randn_like(x)

    def step():
        y, s = pykernels.layer_norm(x, w, b, residual=r, prenorm=True, backend=backend)
        torch.autograd.backward([y, s], [dy, ds])

    step()  # warm up (autotuning, first launches) outside the graph
    return 1e3 * do_bench_cudagraph(step)


def main() -> None:
    print(torch.cuda.get_device_name(), "PYKERNELS_LN_PREFETCH =", os.environ.get("PYKERNELS_LN_PREFETCH", "1"))
    for m, n in SHAPES:
        cu, tr = fwd_bwd_us("cuda", m, n), fwd_bwd_us("triton", m, n)
        floor = 8 * m * n * 2 / 2.9e12 * 1e6  # x, r -> y, s; dy, ds, s -> dx (bf16), at ~2.9 TB/s copy
        print(f"{m:6d} x {n:5d}: fwd+bwd cuda {cu:7.1f} us  triton {tr:7.1f} us  (8-tensor floor ~{floor:.0f} us)")


if __name__ == "__main__":
    main()
