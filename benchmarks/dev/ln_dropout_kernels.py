"""GPU time a call of the LayerNorm kernels with dropout (and without: ``--p 0.1 0``), C++ (backend "cuda") next to
Triton, by the profiler's
kernel records (each kernel's own time; wall-clock timing of one eager call measures the host).

The shapes are the training steps' (benchmarks/train_step.py): BERT-base's post-LN with its branch dropout
(32 x 512 rows of 768, bf16 rows with fp32 weight and bias as under autocast) and GPT-2's pre-LN with the residual
dropout (8 x 1024 rows of 768).

Usage (GPU): ``python benchmarks/dev/ln_dropout_kernels.py [--iters 30] [--p 0.1 ...]``. Prints, a shape, dropout
rate and backend, the mean device time a call of each kernel it launched (forward, backward, the dweight / dbias
reduction).

``--ncu CASE`` (``bert`` or ``gpt2``, at the first ``--p``) instead runs one step of each backend between
``cudaProfilerStart`` and ``cudaProfilerStop`` after the warm-up (Triton's autotuning included), for Nsight Compute
with ``--profile-from-start off``: ``ncu --profile-from-start off -k regex:bwd ... python
benchmarks/dev/ln_dropout_kernels.py --ncu bert`` profiles the tuned kernels only.
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict

import torch

import pykernels

CASES = (("bert post-LN", 16384, 768, False), ("gpt2 pre-LN", 8192, 768, True))


def kernel_us(backend: str, m: int, n: int, prenorm: bool, iters: int, p: float = 0.1,
              ncu: bool = False) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = torch.randn(n, device="cuda", generator=g).requires_grad_()
    b = torch.randn(n, device="cuda", generator=g).requires_grad_()
    dy = torch.randn_like(x)

    def step():
        out = pykernels.layer_norm(x, w, b, residual=r, prenorm=prenorm, dropout_p=p, backend=backend)
        y = out[0] if prenorm else out
        torch.autograd.backward([y], [dy])

    for _ in range(3):
        step()  # compiles / warms up outside the profile
    torch.cuda.synchronize()
    if ncu:  # one step inside the profiler's range, nothing timed here
        torch.cuda.profiler.start()
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return {}
    return mean_kernel_us(step, iters)


def mean_kernel_us(step, iters: int, pattern: str = r"(_?layer_norm\w*|ln_\w+_kernel)(<[^(]*>)?",
                   width: int = 60) -> dict[str, float]:
    """``iters`` calls of ``step`` under the profiler: the mean device time a call of each CUDA kernel whose name
    matches ``pattern`` (the match's first ``width`` characters name it: the kernel and, for the C++ ones, its
    template arguments). Also used by ln_bwd_sweep.py."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in prof.events():
        found = re.search(pattern, e.name)
        if e.device_type == torch.autograd.DeviceType.CUDA and found:
            name = found.group(0)[:width]
            total[name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            count[name] += 1
    return {k: total[k] / count[k] for k in total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--p", type=float, nargs="+", default=[0.1], help="dropout rates (each a set of lines)")
    ap.add_argument("--ncu", choices=[c[0].split()[0] for c in CASES], help="one profiled step a backend (see above)")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if args.ncu:
        name, m, n, prenorm = next(c for c in CASES if c[0].startswith(args.ncu))
        for backend in ("cuda", "triton"):
            kernel_us(backend, m, n, prenorm, args.iters, args.p[0], ncu=True)
        return
    for p in args.p:
        for name, m, n, prenorm in CASES:
            for backend in ("cuda", "triton"):
                for k, us in sorted(kernel_us(backend, m, n, prenorm, args.iters, p).items()):
                    print(f"{name:13s} {m:6d} x {n}  p {p:<4g} {backend:6s}  {k:60s} {us:7.1f} us a call")


if __name__ == "__main__":
    main()
