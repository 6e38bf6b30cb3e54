"""Where the masked-LM loss's host time goes, phase by phase, with the GPU kept busy.

Each timed call runs behind a queued ``torch.cuda._sleep`` (the forward's count copy done first), so
launches never wait for the device and every number is the host's own work: Python, dispatch and
launches. Timers wrap the layers from the outside (the public function, the autograd node, the op's
backward, the kernel-level backward, and inside it each kind of call), so the probe changes no code.
Medians of ``--reps`` calls.

Usage (GPU): ``python benchmarks/dev/mlm_host_breakdown.py [--case bert|gpt2] [--reps 40]``"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import torch

import pykernels
from pykernels._kernels import _launch
import pykernels._kernels.masked_lm_loss as K

P = sys.modules["pykernels.masked_lm_loss"]

CASES = {"bert": (16384, 2446, 768, 30522), "gpt2": (8192, 8192, 768, 50257)}
_T: dict[str, list[float]] = collections.defaultdict(list)
_ACC: dict[str, float] = collections.defaultdict(float)


def timed(name, fn, acc=False):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t0
            if acc:
                _ACC[name] += dt
            else:
                _T[name].append(dt)
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="bert")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--reduction", default="mean")
    args = ap.parse_args()
    n, m, h, v = CASES[args.case]
    torch.manual_seed(0)
    dev = "cuda"
    hidden = torch.randn(n, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device=dev) * h**-0.5).to(torch.bfloat16).requires_grad_()
    target = torch.full((n,), -100, device=dev)
    target[torch.randperm(n, device=dev)[:m]] = torch.randint(0, v, (m,), device=dev)

    def fwd():
        return pykernels.masked_lm_loss(hidden, weight, target, reduction=args.reduction)

    for _ in range(5):
        fwd().backward()
        hidden.grad = weight.grad = None
    torch.cuda.synchronize()

    # wrap the layers (counted per call) and the calls inside the chunk loop (summed per backward)
    P._bwd.impl = timed("op _bwd impl", P._bwd.impl)
    K.masked_lm_loss_bwd_sized = timed("kernel-level bwd_sized", K.masked_lm_loss_bwd_sized)
    P._fwd.impl = timed("op _fwd impl", P._fwd.impl)
    K.masked_lm_loss_fwd = timed("kernel-level fwd", K.masked_lm_loss_fwd)
    K.compact = timed("compact", K.compact)
    P._COUNTS.start = timed("count copy start", P._COUNTS.start)
    fast_call = _launch.FastKernel.call
    _launch.FastKernel.call = timed("  triton launches", fast_call, acc=True)
    real_mm, real_addmm = torch.mm, torch.addmm
    torch.mm = timed("  torch.mm", real_mm, acc=True)
    torch.addmm = timed("  torch.addmm", real_addmm, acc=True)
    real_sum = torch.Tensor.sum
    torch.Tensor.sum = timed("  Tensor.sum", real_sum, acc=True)
    real_setitem = torch.Tensor.__setitem__
    torch.Tensor.__setitem__ = timed("  Tensor.__setitem__", real_setitem, acc=True)

    totals = collections.defaultdict(list)
    for _ in range(args.reps):
        _ACC.clear()
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # ~10+ ms of GPU work queued ahead of the forward
        t0 = time.perf_counter()
        loss = fwd()
        t1 = time.perf_counter()
        for k, val in _ACC.items():
            totals["fwd" + k].append(val)
        _ACC.clear()
        torch.cuda.synchronize()  # the count copy is done: the backward's event wait returns at once
        torch.cuda._sleep(40_000_000)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        for k, val in _ACC.items():
            totals["bwd" + k].append(val)
        totals["public forward (with grad)"].append(t1 - t0)
        totals["loss.backward()"].append(t3 - t2)
        hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.mm, torch.addmm, torch.Tensor.sum, torch.Tensor.__setitem__ = real_mm, real_addmm, real_sum, real_setitem
    _launch.FastKernel.call = fast_call

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} case {args.case}: N {n} M {m} H {h} V {v} "
          f"reduction {args.reduction}; host time with the GPU busy, median of {args.reps} (us)")
    for name, vals in list(totals.items()) + list(_T.items()):
        print(f"{name:40s} {statistics.median(vals) * 1e6:9.1f}   (calls {len(vals)})")


if __name__ == "__main__":
    main()
