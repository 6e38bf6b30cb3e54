"""Host time of one masked_lm_loss forward+backward, phase by phase, and where it goes: the device is
drained before each phase, so the numbers are the host's own work (launches, dispatch, Python), not
queueing. Then torch.profiler's CPU table (self time per op) and cProfile's cumulative Python table.

Usage (GPU): ``python benchmarks/dev/mlm_host_profile.py [--case bert|tiny]``"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import pykernels

CASES = {"bert": (16384, 2446, 768, 30522), "tiny": (64, 16, 64, 128)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="bert")
    args = ap.parse_args()
    n, m, h, v = CASES[args.case]
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda") * h**-0.5).to(torch.bfloat16).requires_grad_()
    target = torch.full((n,), -100, device="cuda")
    target[torch.randperm(n, device="cuda")[:m]] = torch.randint(0, v, (m,), device="cuda")

    def fwd():
        return pykernels.masked_lm_loss(hidden, weight, target)

    for _ in range(5):
        fwd().backward()
    torch.cuda.synchronize()
    tf, tb = [], []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = fwd()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        tf.append(t1 - t0)
        tb.append(t3 - t2)
    tf.sort()
    tb.sort()
    print(f"{torch.cuda.get_device_name()} case {args.case}: N {n} M {m} H {h} V {v}")
    print(f"host, device drained before each phase (median of 20): forward {tf[10] * 1e6:.0f} us, "
          f"backward {tb[10] * 1e6:.0f} us")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            fwd().backward()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        fwd().backward()
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
